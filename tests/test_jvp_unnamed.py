"""``rewrite.jaxpr.trace.jvp_rules_unnamed``: JAX traces the joint programs (``grad/vjp.py``'s ``joint_program``),
JAX's own split (``as_written_vjp``) and the user's function (``trace``) without naming each JVP rule's arguments,
which JAX drops unread. The programs are the same, equation for equation: text, constants, source locations and name
stacks; JAX's ``debug_info`` is put back when the last window closes."""

import contextlib
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rewrite.grad.vjp as vjp
import rewrite.jaxpr.trace as trace_mod
from rewrite.ir.jaxapi import ad, core


def _rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def mlp(x, w1, b, w2, n):
    """Many primitives' JVP rules: products, tanh, a custom_jvp (gelu, relu), softmax, logsumexp, a power, a
    comparison, a gather, a bf16 round trip, an integer input, a nested jit, a scan, a cond and a checkpoint."""
    with jax.named_scope("layer"):
        h = jnp.tanh(x @ w1 + b)
        h = jax.nn.gelu(h) + jax.nn.relu(h) ** 3
    h = jax.jit(lambda v: jnp.where(v > 0, v, 0.1 * v))(h)
    h = h.astype(jnp.bfloat16).astype(jnp.float32)

    def step(c, w):
        return jnp.sin(c * w).sum(-1, keepdims=True) + c, jnp.max(c)
    h, ys = jax.lax.scan(step, h, jnp.stack([b, 2 * b]))
    h = jax.lax.cond(n > 2, lambda v: v * 2.0, lambda v: jnp.exp(-v), h)
    h = jax.checkpoint(lambda v: jnp.log1p(v * v))(h)
    logits = h @ w2
    picked = jnp.take_along_axis(logits, (n % 3 + jnp.zeros((logits.shape[0], 1), jnp.int32)), axis=-1)
    return (jax.nn.logsumexp(logits, -1) - picked[:, 0]).mean() + ys.sum(), jax.nn.softmax(logits)


ARGS = (_rand(4, 8), _rand(8, 8, seed=1), _rand(8, seed=2), _rand(8, 3, seed=3), jnp.int32(3))


def _frames(eqn):
    tb = eqn.source_info.traceback
    return None if tb is None else [(f.file_name, f.function_name, f.line_num) for f in tb.frames]


def _all_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in core.jaxprs_in_params(e.params):
            yield from _all_eqns(sub)


def _same(a, b):
    assert str(a) == str(b)
    assert len(a.consts) == len(b.consts)
    for x, y in zip(a.consts, b.consts):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ea, eb = list(_all_eqns(a.jaxpr)), list(_all_eqns(b.jaxpr))
    assert len(ea) == len(eb)
    for x, y in zip(ea, eb):
        assert str(x.source_info.name_stack) == str(y.source_info.name_stack)
        assert _frames(x) == _frames(y)
    assert any("layer" in str(e.source_info.name_stack) for e in ea)  # (what is compared is there to compare)
    assert any(any(__file__ == f[0] for f in _frames(e) or ()) for e in ea)


def _joint(closed):  # one call site for both ways, so that their tracebacks may be compared
    return vjp.joint_program(closed)[0]


def _as_written(closed):  # JAX's own split: its forward linearizes
    built = vjp.as_written_vjp(types.SimpleNamespace(closed=closed), None, priced=False)
    return built.fwd, built.bwd


def _traced(fn, args):
    return trace_mod.trace_call(fn, args, {}, (), ())[0].closed


WINDOW = trace_mod.jvp_rules_unnamed


@pytest.fixture
def named(monkeypatch):
    """``named(True)``: the windows do nothing (JAX names every JVP rule's arguments, as before); ``named(False)``:
    they are open, as the rewriter opens them."""
    def set_named(on):
        cm = contextlib.nullcontext if on else WINDOW
        monkeypatch.setattr(vjp, "jvp_rules_unnamed", cm)
        monkeypatch.setattr(trace_mod, "jvp_rules_unnamed", cm)
    return set_named


def test_a_joint_program_and_a_trace_are_the_same_programs_without_the_jvp_rules_argument_names(named, monkeypatch):
    before, calls = ad.debug_info, []
    real = trace_mod._unnamed_jvp_debug_info
    monkeypatch.setattr(trace_mod, "_unnamed_jvp_debug_info", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    closed = jax.make_jaxpr(mlp)(*ARGS)
    step = lambda *a: jax.value_and_grad(lambda *p: mlp(*p)[0], argnums=(0, 1, 2, 3))(*a)  # noqa: E731
    programs = {}
    for on in (True, False):
        named(on)
        programs[on] = (_joint(closed), _traced(step, ARGS), *_as_written(closed))
    assert calls.count("linearize_prim_jvp") > 20  # the windows were open, and JAX asked for the names there
    assert ad.debug_info is before  # JAX's own again
    for a, b in zip(programs[True], programs[False]):
        assert len(list(_all_eqns(a.jaxpr))) > 50
        _same(a, b)


def test_the_debug_info_it_gives_is_jax_s_less_what_jax_drops():
    real = trace_mod._named_debug_info or ad.debug_info
    rules = [ad.primitive_jvps[p] for p in (jax.lax.sin_p, jax.lax.dot_general_p, jax.lax.reduce_max_p)]
    primals = (np.ones(3, np.float32), np.ones(3, np.float32))
    params = {"dimension_numbers": (((0,), (0,)), ((), ())), "precision": None, "preferred_element_type": None}
    for rule in rules:
        ours = trace_mod._unnamed_jvp_debug_info("linearize_prim_jvp", rule, primals, params)
        theirs = real("linearize_prim_jvp", rule, primals, params)
        assert ours.arg_names is None and theirs.arg_names  # the names JAX made and drops
        assert ours.with_unknown_names() == theirs.with_unknown_names()
    # any other debug info is JAX's own
    f = lambda x, *, k: x  # noqa: E731
    assert trace_mod._unnamed_jvp_debug_info("jit", f, (1.0,), {"k": 2}) == real("jit", f, (1.0,), {"k": 2})


def test_jax_s_debug_info_is_put_back_when_the_last_window_closes():
    before = ad.debug_info
    with trace_mod.jvp_rules_unnamed():
        assert ad.debug_info is trace_mod._unnamed_jvp_debug_info
        with trace_mod.jvp_rules_unnamed():
            pass
        assert ad.debug_info is trace_mod._unnamed_jvp_debug_info  # an inner window's close leaves it open
        with pytest.raises(ZeroDivisionError):
            with trace_mod.jvp_rules_unnamed():
                1 / 0
        assert ad.debug_info is trace_mod._unnamed_jvp_debug_info
    assert ad.debug_info is before

    # windows of two threads that overlap, closed in the other order than opened
    opened, release = threading.Event(), threading.Event()

    def other():
        with trace_mod.jvp_rules_unnamed():
            opened.set()
            release.wait(10)
    t = threading.Thread(target=other)
    with trace_mod.jvp_rules_unnamed():
        t.start()
        opened.wait(10)
    assert ad.debug_info is trace_mod._unnamed_jvp_debug_info  # the other thread's window is still open
    release.set()
    t.join(10)
    assert ad.debug_info is before
