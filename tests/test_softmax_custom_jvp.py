"""``jax.nn.softmax`` as jax 0.12.1 and later trace it by default (``jax_softmax_custom_jvp`` on): a
``custom_jvp_call`` of JAX's ``_softmax``, which the loader reads as the plain softmax (``rewrite/ir/softmax.py``).

On jax 0.12.1 every rule over a softmax saw an opaque call: the packs' own example checks failed, so
``rulesets.nn`` and ``rulesets.attention`` raised on import, and no attention or LM-head rule could fire. Each test
here sets the flag itself (``jax.softmax_custom_jvp``), so it runs on every JAX the pins admit (CI's jax 0.10 has the
flag, off by default).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax._src.core import jaxpr_as_fun

import rulesets
from rewrite import rewrite
from rewrite.define import check_example
from rewrite.grad.step import find_losses
from rewrite.ir.softmax import plain_softmax
from rewrite.testing import arrays


def _log_softmax(x):
    return jnp.log(jax.nn.softmax(x, axis=-1))


def _masked(x, m):
    return jnp.log(jax.nn.softmax(x, axis=-1, where=m) + 1.0) * 2.0


def _attention(q, k, v):
    return jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) * 0.125, axis=-1) @ v


def _cross_entropy(z, y):
    return -jnp.sum(y * jnp.log(jax.nn.softmax(z, axis=-1)))


#: name -> (function, its packs, its arguments: a shape (drawn in the float dtype under test) or "mask" (a boolean one))
PROGRAMS = {
    "log_softmax": (_log_softmax, ("nn",), [(8, 33)]),
    "masked": (_masked, ("nn",), [(4, 16), "mask"]),
    "attention": (_attention, ("attention",), [(2, 1024, 16)] * 3),
    "cross_entropy": (_cross_entropy, ("nn",), [(8, 50), (8, 50)]),
}


def _args(name: str, dtype, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for shape in PROGRAMS[name][2]:
        if shape == "mask":
            m = rng.random(out[0].shape) < 0.7
            m[:, 0] = True
            out.append(jnp.asarray(m))
        else:
            out.append(jnp.asarray(rng.normal(size=shape) * 3, dtype))
    return out


def _rewritten(name: str):
    fn, packs, _ = PROGRAMS[name]
    return rewrite(fn, rulesets=[getattr(rulesets, p) for p in packs])


def _rule(pack: str, name: str):
    return getattr(rulesets, pack).rule(name)


@pytest.mark.parametrize("pack,name", [("nn", "nn_log_softmax"), ("attention", "attn_blocked"),
                                       ("attention", "attn_blocked_vp")])
def test_the_packs_rules_over_a_softmax_pass_their_example_checks_with_the_setting_on(pack, name):
    """jax 0.12.1: ``ValueError: rule 'nn_log_softmax': the pattern has no match on its example program`` at import."""
    with jax.softmax_custom_jvp(True):
        check_example(_rule(pack, name))


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_program_rewritten_with_the_setting_on_is_the_one_rewritten_with_it_off(name):
    """The same matches, the same decision and the same program (attention at these sizes is matched and priced,
    and kept as written on CPU)."""
    args = _args(name, jnp.float32)
    seen = {}
    for flag in (False, True):
        with jax.softmax_custom_jvp(flag):
            result = _rewritten(name).result(*args)
            matched = {k: v.matched for k, v in result.stats.items() if v.matched}
            seen[flag] = (matched, result.rewritten, str(result.after))
    assert seen[False][0], f"{name}: no rule matched with the setting off"
    assert seen[True] == seen[False]
    assert seen[True][1] == (name != "attention")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64])
@pytest.mark.parametrize("name", ["log_softmax", "masked", "cross_entropy"])
def test_values_and_derivatives_with_the_setting_on_are_those_with_it_off(name, dtype):
    """The same program either way: the values and each derivative bit for bit, eagerly and under jit, against the
    rewrite with the setting off (itself held to the original by the packs' own tests); in float32 and float64 also
    close to JAX's own rule's."""
    with jax.enable_x64(dtype == jnp.float64):
        args = _args(name, dtype, seed=1)
        fn = PROGRAMS[name][0]
        floats = [i for i, a in enumerate(args) if a.dtype != jnp.bool_]

        def transformed(f):
            scalar = lambda *a: jnp.sum(f(*a).astype(jnp.float32))  # noqa: E731
            wrt = tuple(floats)
            tangents = [jnp.ones_like(args[i]) for i in floats]
            return {
                "value": lambda: f(*args),
                "grad": lambda: jax.grad(scalar, argnums=wrt)(*args),
                "vjp": lambda: jax.vjp(lambda *fl: f(*_with(args, floats, fl)), *[args[i] for i in floats])[1](
                    jnp.ones_like(f(*args))),
                "jvp": lambda: jax.jvp(lambda *fl: f(*_with(args, floats, fl)), [args[i] for i in floats],
                                       tangents)[1],
                "vmap": lambda: jax.vmap(lambda *a: f(*a), in_axes=(0,) * len(args))(*[a[None] for a in args]),
            }

        got = {}
        for flag in (False, True):
            with jax.softmax_custom_jvp(flag):
                r = _rewritten(name)
                for jit in (False, True):
                    f = jax.jit(r) if jit else r
                    got[flag, jit] = {k: jax.tree.map(np.asarray, v()) for k, v in transformed(f).items()}
        with jax.softmax_custom_jvp(True):
            jax_s = {k: jax.tree.map(np.asarray, v()) for k, v in transformed(fn).items() if k != "value"}
        for jit in (False, True):
            for k, want in got[False, jit].items():
                have = got[True, jit][k]
                for w, h in zip(jax.tree.leaves(want), jax.tree.leaves(have)):
                    np.testing.assert_array_equal(np.asarray(w, np.float64), np.asarray(h, np.float64),
                                                  err_msg=f"{name} {k} jit={jit}")
        if dtype not in (jnp.float32, jnp.float64):  # (JAX's rule in half precision is no reference: float64 is)
            return
        tol = {jnp.float64: 1e-9, jnp.float32: 1e-4}[dtype]
        for k, want in jax_s.items():
            for w, h in zip(jax.tree.leaves(want), jax.tree.leaves(got[True, True][k])):
                w, h = np.asarray(w, np.float64), np.asarray(h, np.float64)
                scale = max(1.0, float(np.nanmax(np.abs(w))))
                assert np.allclose(h, w, rtol=tol, atol=tol * scale, equal_nan=True), (name, k,
                                                                                     np.nanmax(np.abs(h - w)))


def _with(args: list, floats: list, values) -> list:
    out = list(args)
    for i, v in zip(floats, values):
        out[i] = v
    return out


@settings(deadline=None)
@given(arrays((6, 9), np.float32))
def test_the_plain_softmax_read_for_the_call_computes_jax_s_softmax(x):
    """:func:`plain_softmax` of the call JAX traces, run, against ``jax.nn.softmax`` with the setting on: equal bits
    (NaN where it has NaN), on drawn rows with zeros, negatives, infinities and NaN."""
    x = jnp.asarray(x)
    with jax.softmax_custom_jvp(True):
        closed = jax.make_jaxpr(functools.partial(jax.nn.softmax, axis=-1))(x)
        want = jax.nn.softmax(x, axis=-1)
    plain = plain_softmax(closed.jaxpr.eqns[0])
    assert plain is not None
    got = jaxpr_as_fun(plain)(*[x if v.aval.shape else np.float32(-np.inf) for v in closed.jaxpr.eqns[0].invars])
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want))


def test_a_custom_jvp_of_another_softmax_is_loaded_as_the_call_it_is():
    """Only JAX's own (its name and its source file): a user's ``_softmax`` with a rule of its own stays a call."""
    @jax.custom_jvp
    def _softmax(x):
        return jnp.exp(x) / jnp.sum(jnp.exp(x), axis=-1, keepdims=True)

    _softmax.defjvp(lambda p, t: (_softmax(*p), t[0]))
    closed = jax.make_jaxpr(_softmax)(jnp.ones((2, 3)))
    assert closed.jaxpr.eqns[0].primitive.name == "custom_jvp_call"
    assert plain_softmax(closed.jaxpr.eqns[0]) is None


def _logsumexp_call():
    closed = jax.make_jaxpr(functools.partial(jax.nn.logsumexp, axis=-1))(jnp.ones((3, 5)))
    return next((e for e in closed.jaxpr.eqns if e.primitive.name == "custom_jvp_call"), None)


@pytest.mark.skipif(_logsumexp_call() is None, reason="this JAX traces logsumexp inline (a custom_jvp from 0.12.1)")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jax_s_own_logsumexp_call_is_read_as_its_body(dtype):
    """jax 0.12.1's ``logsumexp`` is a ``custom_jvp_call`` of ``_logsumexp_impl`` whose rule reads ``softmax``: read
    as its body, a step over an integer-label cross-entropy is proven to hold its loss's gradients and replaced
    (before, every whole-step proof over it failed), with the values of the step as written."""
    from rewrite.ir.softmax import plain_call

    eqn = _logsumexp_call()
    assert plain_call(eqn) is eqn.params["call_jaxpr"]
    rng = np.random.default_rng(2)
    w, x = jnp.asarray(rng.normal(size=(16, 40)), dtype), jnp.asarray(rng.normal(size=(8, 16)), dtype)
    y = jnp.asarray(rng.integers(0, 40, size=8))

    def loss(w, x, y):
        logits = (x @ w).astype(jnp.float32)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0])

    def step(w, x, y):
        value, g = jax.value_and_grad(loss)(w, x, y)
        return w - 0.1 * g, value

    changed, finding = find_losses(jax.make_jaxpr(step)(w, x, y), *_proof_and_loss_first([rulesets.algebra]))
    assert changed is not None, str(finding)
    for want, got in zip(jax.jit(step)(w, x, y), jax.jit(jaxpr_as_fun(changed))(w, x, y)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-3)


def _proof_and_loss_first(packs):
    r = rewrite(lambda *a: None, rulesets=packs, cache=False)
    return r._proof, r._loss_first
