"""Round trip: with no rules, every program comes back equal in value and never larger.

Also checks that the emitted jaxpr type-checks, and that the rewritten
function works under jit, grad and vmap like the original.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core

from rewrite import rewrite
from rewrite.report.report import count_eqns

from .corpus import corpus

CORPUS = corpus()


def _close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype
        if np.issubdtype(x.dtype, np.inexact):
            np.testing.assert_allclose(x, y, rtol=2e-6, atol=2e-6)
        else:
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name,fn,args", CORPUS, ids=[c[0] for c in CORPUS])
def test_roundtrip(name, fn, args):
    r = rewrite(fn)
    want = eqx.filter_jit(fn)(*args)
    got = eqx.filter_jit(r)(*args)
    _close(got, want)
    result = r.result(*args)
    core.check_jaxpr(result.after.jaxpr)
    assert count_eqns(result.after) <= count_eqns(result.before), name
    assert result.stopped == "saturated"
    assert r.rewrites == 1  # the jitted and the direct call share one rewrite


def test_duplicates_are_shared():
    def f(x):
        return jnp.sin(x) * 2 + jnp.sin(x) * 2
    r = rewrite(f)
    closed = r.jaxpr(jnp.ones(3))
    assert [e.primitive.name for e in closed.eqns].count("sin") == 1
    np.testing.assert_allclose(r(jnp.ones(3)), f(jnp.ones(3)))


def test_dead_code_is_dropped():
    def f(x):
        unused = jnp.exp(x) @ jnp.ones((3, 3))  # noqa: F841
        return x + 1
    assert count_eqns(rewrite(f).jaxpr(jnp.ones(3))) == 1


@pytest.mark.parametrize("name", ["seed000", "mlp_loss", "layernorm", "rnn_mse", "attention"])
def test_transformations_compose(name):
    fn, args = next((f, a) for n, f, a in CORPUS if n == name)
    r = rewrite(fn)

    def scalar(f):
        return lambda *a: jnp.sum(jax.tree_util.tree_leaves(f(*a))[0])

    _close(jax.grad(scalar(r))(*args), jax.grad(scalar(fn))(*args))
    _close(jax.jit(jax.grad(scalar(r)))(*args), jax.grad(scalar(fn))(*args))
    batched = jax.tree_util.tree_map(lambda a: jnp.stack([a, a * 0.5]), args)
    _close(jax.vmap(r)(*batched), jax.vmap(fn)(*batched))
    _, vjp_r = jax.vjp(scalar(r), *args)
    _, vjp_f = jax.vjp(scalar(fn), *args)
    _close(vjp_r(jnp.float32(1.0)), vjp_f(jnp.float32(1.0)))
