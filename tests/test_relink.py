"""A ``custom_jvp`` whose ``nondiff_argnums`` hold a traced array differentiates once rewritten
(``rewrite/jaxpr/relink.py``).

distrax's von Mises sampler is such a ``custom_jvp``, with the PRNG key made inside the function: ``jax.jvp`` and
``jax.grad`` of the rewritten function raised ``TracerArrayConversionError`` and then ``UnexpectedTracerError``
(distrax's ``test_von_mises_sample_gradient``, routed through the rewriter), where the function as written runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rulesets
from rewrite import rewrite

# a derivative the rewriter declined (and said so) would pass the comparisons by JAX's own: each one is an error
pytestmark = pytest.mark.filterwarnings("error::rewrite.RewriteWarning")
PACKS = [rulesets.algebra, rulesets.scan, rulesets.derivatives, rulesets.nn, rulesets.linalg]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _noisy(x, key):
    """``x`` plus uniform noise: the sample's tangent is set by the rule (``3 t``), not by the sampler."""
    return x + jax.random.uniform(key, x.shape, x.dtype)


@_noisy.defjvp
def _noisy_jvp(key, primals, tangents):
    (x,), (t,) = primals, tangents
    return _noisy(x, key), 3 * t


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _scaled(x, scale):
    return jnp.sin(x) * scale


@_scaled.defjvp
def _scaled_jvp(scale, primals, tangents):
    (x,), (t,) = primals, tangents
    return _scaled(x, scale), jnp.cos(x) * scale * t


def _key_made_inside(x):
    return _noisy(x, jax.random.PRNGKey(1)) * 2


def _key_given(x, key):
    return _noisy(x, key) * 2


def _typed_key_given(x, seed):
    return _noisy(x, jax.random.key(seed)) * 2


def _scale_computed(x, s):
    return _scaled(x, jnp.exp(s)) + x


CASES = {  # name -> (function, the arguments after x, given x's dtype)
    "a key made inside": (_key_made_inside, lambda d: ()),
    "a key given": (_key_given, lambda d: (jax.random.PRNGKey(3),)),
    "a typed key given": (_typed_key_given, lambda d: (jnp.uint32(5),)),
    "a scale computed": (_scale_computed, lambda d: (jnp.linspace(-1, 1, 4).astype(d),)),
}
DTYPES = [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)]


def _same(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=tol, atol=tol)


def _both(name, dtype):
    fn, rest = CASES[name]
    return fn, rewrite(fn, rulesets=PACKS, strict=True), jnp.linspace(0.1, 1.0, 4).astype(dtype), rest(dtype)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_jvp_and_grad_of_the_rewritten_function_are_the_functions(name, dtype, tol):
    fn, f, x, rest = _both(name, dtype)
    t = jnp.ones_like(x)
    _same(jax.jvp(lambda x: f(x, *rest), (x,), (t,)), jax.jvp(lambda x: fn(x, *rest), (x,), (t,)), tol)
    _same(jax.grad(lambda x: f(x, *rest).astype(jnp.float32).sum())(x),
          jax.grad(lambda x: fn(x, *rest).astype(jnp.float32).sum())(x), tol)


@pytest.mark.parametrize("name", sorted(CASES))
def test_under_jit_vmap_and_a_second_derivative(name):
    fn, f, x, rest = _both(name, jnp.float32)
    t = jnp.full_like(x, 0.5)
    _same(f(x, *rest), fn(x, *rest), 1e-6)  # eagerly
    _same(jax.jit(f)(x, *rest), fn(x, *rest), 1e-6)
    _same(jax.jit(jax.grad(lambda x: f(x, *rest).sum()))(x), jax.grad(lambda x: fn(x, *rest).sum())(x), 1e-6)
    _same(jax.jvp(jax.jit(lambda x: f(x, *rest)), (x,), (t,)), jax.jvp(lambda x: fn(x, *rest), (x,), (t,)), 1e-6)
    xs = jnp.stack([x, x + 1])
    _same(jax.vmap(lambda x: jax.jvp(lambda x: f(x, *rest), (x,), (t,)))(xs),
          jax.vmap(lambda x: jax.jvp(lambda x: fn(x, *rest), (x,), (t,)))(xs), 1e-6)
    _same(jax.jacfwd(jax.grad(lambda x: f(x, *rest).sum()))(x),
          jax.jacfwd(jax.grad(lambda x: fn(x, *rest).sum()))(x), 1e-5)


def test_the_rule_reads_each_key_of_a_batch():
    """Keys batched by ``jax.vmap``: each sample's rule reads its own key, not a constant one."""
    f = rewrite(_key_given, rulesets=PACKS, strict=True)
    keys, x = jax.random.split(jax.random.PRNGKey(0), 3), jnp.linspace(0.1, 1.0, 4)
    jvp = jax.vmap(lambda k: jax.jvp(lambda x: f(x, k), (x,), (jnp.ones(4),)), out_axes=0)(keys)
    want = jax.vmap(lambda k: jax.jvp(lambda x: _key_given(x, k), (x,), (jnp.ones(4),)))(keys)
    _same(jvp, want, 1e-6)
    assert len({tuple(np.asarray(o)) for o in jvp[0]}) == 3
