"""Decorator order: ``rewrite(jax.jit(f))`` keeps ``f``'s jit around the rewritten program.

The trace of a jitted function is one ``jit`` equation, which the rewriter
sees through. Run eagerly, the rewritten program would then execute one
operation at a time (``benchmarks/inner_jit.py``: 0.02x of ``jax.jit(f)`` on
a 2-layer transformer step); it is run under ``jit`` instead.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rulesets
from rewrite import rewrite


def f(x, w):
    return jnp.sum(jnp.tanh(x @ w) * 2 + jnp.sin(x) * jnp.cos(x))


X, W = jnp.linspace(0.1, 1.0, 12).reshape(3, 4), jnp.ones((4, 4)) * 0.1


@pytest.mark.parametrize("jit", [jax.jit, eqx.filter_jit, nnx.jit], ids=["jax.jit", "eqx.filter_jit", "nnx.jit"])
def test_the_inner_jit_stays_around_the_rewritten_program(jit):
    g = rewrite(jit(f), rulesets=[rulesets.algebra, rulesets.derivatives])
    np.testing.assert_allclose(g(X, W), f(X, W), rtol=1e-6)
    # what a call runs: one jit call of the rewritten program, not its operations one by one
    eqns = jax.make_jaxpr(g)(X, W).eqns
    assert [e.primitive.name for e in eqns] == ["jit"]
    assert eqns[0].params["name"] == "f"  # named as the user's function (HLO module, profiles), as jit(f) names it
    assert len(eqns[0].params["jaxpr"].eqns) > 1  # the rewritten program itself, inside it
    np.testing.assert_allclose(jax.jit(g)(X, W), f(X, W), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(g)(X, W), jax.grad(f)(X, W), rtol=1e-5)


def test_a_plain_function_is_not_wrapped():
    g = rewrite(f, rulesets=[rulesets.algebra])
    assert "jit" not in [e.primitive.name for e in jax.make_jaxpr(g)(X, W).eqns]
