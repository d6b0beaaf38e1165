"""The emitter's dead-code elimination keeps a ``custom_jvp``'s rule runnable (``rewrite/jaxpr/dce.py``).

JAX's ``_custom_jvp_call_dce`` wraps a rule so that it keeps ``[*used_outs, *used_outs]`` of its JVP program's
outputs where the call does not say ``symbolic_zeros``; a rule that returns a symbolic zero all the same has fewer
outputs, and ``jax.jvp`` of ``jax.vmap`` of the emitted program raised ``ValueError: foreach() argument 2 is longer
than argument 1`` (JAX's ``test_symbolic_zero_under_vmap_of_jit``, routed through the rewriter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rulesets
from rewrite import rewrite
from rewrite.jaxpr.dce import dce_chain, dce_jvp

PACKS = [rulesets.algebra, rulesets.derivatives, rulesets.nn]


@jax.custom_jvp
def _plus_one(x):
    return x + 1


@_plus_one.defjvp
def _plus_one_jvp(primals, tangents):
    (x,), _ = primals, tangents
    return _plus_one(x), jax.custom_derivatives.zero_from_primal(x, symbolic_zeros=True)


@jax.custom_jvp
def _pair(x):
    return x + 1, jnp.sin(x)


@_pair.defjvp
def _pair_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _pair(x), (jax.custom_derivatives.zero_from_primal(x, symbolic_zeros=True), jnp.cos(x) * t)


def _second_of_pair(x):
    return _pair(x)[1] * 2.0  # the first output unused: the rule kept under dead-code elimination


CASES = {"every output used": _plus_one, "an output unused": _second_of_pair}


def _same(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2), (jnp.float16, 1e-3)])
def test_a_rule_returning_a_symbolic_zero_runs_under_jvp_of_vmap(name, dtype, tol):
    f = CASES[name]
    r = rewrite(f, rulesets=PACKS, strict=True, cache=False)
    x = jnp.linspace(-1.0, 1.0, 3, dtype=dtype)
    want = jax.jvp(jax.vmap(f), (x,), (x,))
    for run in (r, jax.jit(r)):
        _same(jax.jvp(jax.vmap(run), (x,), (x,)), want, tol)
        _same(jax.vmap(lambda v, run=run: jax.jvp(run, (v,), (v,)))(x), want, tol)
    # (reverse mode: JAX's own ``jax.grad`` of such a rule raises, a ``SymbolicZero`` is not a JAX type)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_stored_program_with_such_a_rule_runs_when_read_back(name, tmp_path):
    f = CASES[name]
    x = jnp.linspace(-1.0, 1.0, 3)
    want = jax.jvp(jax.vmap(f), (x,), (x,))
    first = rewrite(f, rulesets=PACKS, strict=True, cache=tmp_path)
    _same(jax.jvp(jax.vmap(first), (x,), (x,)), want, 1e-6)
    second = rewrite(f, rulesets=PACKS, strict=True, cache=tmp_path)
    _same(jax.jvp(jax.vmap(second), (x,), (x,)), want, 1e-6)
    assert second.loaded == 1


def test_dce_chain_reads_the_wrapper_dce_jvp_makes():
    rule = jax.extend.linear_util.wrap_init(lambda *in_zeros: None, debug_info=None)
    wrapped = dce_jvp(dce_jvp(rule, [True, False]), [False, True])
    found, chain = dce_chain(wrapped)
    assert found is rule and chain == [[False, True], [True, False]]


def test_dce_chain_reads_a_closure_with_an_empty_cell_as_no_wrapper():
    """A rule's function may close over a name it has not assigned yet (attention's backward does): an empty cell
    is no wrapper's, not an error (``dce_chain`` is asked of every rule's ``custom_vjp`` the cache writes)."""
    def make():
        def f(*_):
            return later

        return f
        later = None  # (never reached: f's cell for it stays empty)

    fn = make()
    with pytest.raises(ValueError):
        _ = fn.__closure__[0].cell_contents
    rule = jax.extend.linear_util.wrap_init(fn, debug_info=None)
    assert dce_chain(rule) is None
    wrapped = dce_jvp(rule, [True])
    found, chain = dce_chain(wrapped)
    assert found is rule and chain == [[True]]
