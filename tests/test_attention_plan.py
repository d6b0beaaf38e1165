"""The blocked attention kernel traced once per plan (``rulesets/_attention_plan.py``) and its backward traced once
per types and replayed (``rulesets/kernels/replay.py``): layers alike share one trace, layers that differ in what the
trace reads do not, and a joint program replayed is the joint program traced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rulesets
import rulesets.kernels.attention as K
import rulesets.kernels.replay as R
from rewrite import rewrite
from rewrite.rules import builder


def _layers(second_scale):
    def f(q, k, v, w):
        a = jax.nn.softmax(q @ k.T * 0.125, axis=-1) @ v
        return jax.nn.softmax((a @ w) @ k.T * second_scale, axis=-1) @ v
    return f


def _operands(n=512, d=16):
    q, k, v, w = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(n, d)] * 3 + [(d, d)]))
    return q, k, v, w / 4


@pytest.fixture
def kernel_traces(monkeypatch):
    """The names of the functions rules trace at the test's shapes (the packs' example checks, which a test may run
    first, trace theirs), counted afresh (the process-wide traces emptied for the test)."""
    seen = []
    trace_at = builder.trace_at

    def counted(fn, avals):
        if any(tuple(a.shape) == (512, 16) for a in avals):
            seen.append(getattr(fn, "__qualname__", ""))
        return trace_at(fn, avals)

    monkeypatch.setattr(builder, "trace_at", counted)
    monkeypatch.setattr(builder, "_TRACES", builder._Traces())
    return seen


@pytest.mark.parametrize("second_scale, traces", [(0.125, 1), (0.25, 2)])
def test_alike_layers_share_one_kernel_trace_and_others_do_not(kernel_traces, second_scale, traces):
    """Two layers whose logits are the same steps over leaves of the same types and literals build one kernel,
    traced once; a layer whose scale is another literal (read by the kernel as a constant) is traced apart, and each
    layer computes its own values and gradients."""
    f = _layers(second_scale)
    ops = _operands()
    g = rewrite(f, rulesets=[rulesets.attention], cache=False)
    got = g.result(*ops)
    assert sum(s.fired for k, s in got.stats.items() if k.startswith("attn_")) == 2, "both layers are blocked"
    assert sum("Plan.kernel" in name for name in kernel_traces) == traces, kernel_traces
    np.testing.assert_allclose(g(*ops), f(*ops), rtol=2e-5, atol=2e-5)
    loss = lambda fn: lambda *xs: jnp.sum(fn(*xs) ** 2)  # noqa: E731
    for a, b in zip(jax.grad(loss(g), argnums=(0, 1, 2, 3))(*ops), jax.grad(loss(f), argnums=(0, 1, 2, 3))(*ops)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def _joint_text(kernel_fn, ops):
    """The text of a joint program (outputs and gradients) of a function calling the kernel, as the rewrite traces
    joints (``rewrite/grad/vjp.py``'s ``joint_program``)."""
    def joint(*xs):
        out, pull = jax.vjp(lambda *a: kernel_fn(*a) * 2.0, *xs)
        return out, pull(jnp.ones_like(out))
    return str(jax.make_jaxpr(joint)(*ops))


@pytest.mark.parametrize("scores, query_block", [(K.Scores(scale=0.25), None),
                                                 (K.Scores(scale=0.5, causal=True), 64),
                                                 (K.Scores(causal=True), None)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_replayed_backward_gives_the_joint_program_that_tracing_it_gives(monkeypatch, scores, query_block, dtype):
    """The backward traced once and replayed puts the same equations in a joint program as tracing it there does
    (the rewrite's emitted programs must stay byte for byte), and a second joint program replays it: traced once."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 128, 8), dtype) for i in range(3))
    make = lambda: lambda q, k, v: K.attention(q, k, v, scores=scores, block=32, query_block=query_block)  # noqa: E731
    traced = []
    trace_at = R.trace_at
    monkeypatch.setattr(R, "trace_at", lambda fn, avals: traced.append(1) or trace_at(fn, avals))
    replayed = _joint_text(make(), (q, k, v))
    monkeypatch.setattr(K, "replayed", lambda fn: fn)  # the backward as JAX calls it: traced at every joint
    assert replayed == _joint_text(make(), (q, k, v))



def test_a_function_replayed_is_traced_once_per_types_and_binds_what_tracing_binds(monkeypatch):
    """:func:`rulesets.kernels.replay.replayed` traces once per argument structure and types (a weak type is a type
    of its own), and what it binds into the caller's trace is what calling the function there binds: a loop over
    its body traced once."""
    traced = []
    trace_at = R.trace_at
    monkeypatch.setattr(R, "trace_at", lambda fn, avals: traced.append(1) or trace_at(fn, avals))

    def fn(pair, g):
        x, y = pair
        step = lambda c, r: (c + jnp.sum(r * g).astype(c.dtype), jnp.tanh(r) * 0.5)  # noqa: E731
        total, ys = jax.lax.scan(step, jnp.zeros((), x.dtype), x)
        return {"sum": total, "ys": ys + y}, None

    once = R.replayed(fn)
    x, y, g = jnp.ones((4, 3)), jnp.ones((4, 3)), jnp.ones((3,))
    callers = [lambda f: lambda x, y, g: f((x, y), g), lambda f: lambda x, y, g: f((x, y), g * 2.0)]
    for caller in callers:  # two callers of one type: the second replays the first's trace
        assert str(jax.make_jaxpr(caller(once))(x, y, g)) == str(jax.make_jaxpr(caller(fn))(x, y, g))
    assert len(traced) == 1  # the second caller's trace replays the first's
    once((x, y), 2.0)  # a weak-typed scalar: another type
    once((x.astype(jnp.bfloat16), y), g)
    assert len(traced) == 3
    got, none = once((x, y), g)
    want, _ = fn((x, y), g)
    assert none is None and set(got) == {"sum", "ys"}
    np.testing.assert_array_equal(got["ys"], want["ys"])
    np.testing.assert_array_equal(got["sum"], want["sum"])
