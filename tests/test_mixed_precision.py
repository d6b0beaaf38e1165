"""Derivatives of rewritten functions at every float dtype users train with, mixed among inputs and outputs.

bfloat16 and the float8 types are ml_dtypes, which numpy's ``issubdtype(..., np.inexact)`` does not know as
floating: a derivative program that chose its inputs that way left them out and its gradients were silently
zero (issue 29, item 1). Each transformation is compared with the same transformation of the original.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rulesets
from rewrite import rewrite
from rewrite.ir.primitives import is_inexact_dtype

LOW = [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]


def _close(got, want, rtol=2e-2):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert jnp.result_type(g) == jnp.result_type(w)
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.any(w != 0)  # a zero derivative would hide the bug this file is about
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-3)


def _transforms():
    return {
        "grad": jax.grad,
        "jit_grad": lambda f: jax.jit(jax.grad(f)),
        "value_and_grad": lambda f: (lambda x: jax.value_and_grad(f)(x)[1]),
        "jacrev": jax.jacrev,
        "jacfwd": jax.jacfwd,
        "hessian_diag": lambda f: (lambda x: jnp.diag(jax.hessian(f)(x.astype(jnp.float32).astype(x.dtype)))),
        "jvp": lambda f: (lambda x: jax.jvp(f, (x,), (jnp.ones_like(x),))[1]),
        "jit_jvp": lambda f: jax.jit(lambda x: jax.jvp(f, (x,), (jnp.ones_like(x),))[1]),
        "linearize": lambda f: (lambda x: jax.linearize(f, x)[1](jnp.ones_like(x))),
        "vjp": lambda f: (lambda x: jax.vjp(f, x)[1](jnp.ones((), jnp.float32))[0]),
        "vmap_grad": lambda f: (lambda x: jax.vmap(jax.grad(f))(jnp.stack([x, -x]))),
    }


@pytest.mark.parametrize("dtype", LOW, ids=lambda d: d.__name__)
@pytest.mark.parametrize("how", sorted(_transforms()))
def test_low_precision_inputs_with_a_float32_loss(dtype, how):
    x = jnp.linspace(-1, 1, 8).astype(dtype)
    f = lambda x: jnp.sum(jnp.sin(x.astype(jnp.float32)) * 1.0)  # noqa: E731
    tr = _transforms()[how]
    _close(tr(rewrite(f, rulesets=[rulesets.algebra]))(x), tr(f)(x))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
def test_a_low_precision_output_of_float32_inputs(dtype):
    x = jnp.linspace(-1, 1, 8)
    inner = lambda x: jnp.sin(x).astype(dtype)  # noqa: E731
    r = rewrite(inner)
    loss_r = lambda x: r(x).sum().astype(jnp.float32)  # noqa: E731
    loss = lambda x: inner(x).sum().astype(jnp.float32)  # noqa: E731
    _close(jax.grad(loss_r)(x), jax.grad(loss)(x))
    _close(jax.jit(jax.grad(loss_r))(x), jax.grad(loss)(x))
    _close(jax.jvp(r, (x,), (jnp.ones_like(x),))[1], jax.jvp(inner, (x,), (jnp.ones_like(x),))[1])
    assert r.derivative_rewrites == {"vjp": 1, "jvp": 1}  # the rewritten derivatives ran, not a fallback


def test_a_bfloat16_model_loss_with_every_pack():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    w = (jax.random.normal(k1, (16, 32)) * 0.2).astype(jnp.bfloat16)
    h = jax.random.normal(k2, (8, 16)).astype(jnp.bfloat16)
    labels = jax.random.randint(k3, (8,), 0, 32)

    def loss(w, h):
        logits = (h @ w).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    want = jax.grad(loss, (0, 1))(w, h)
    for pack in [rulesets.algebra, rulesets.derivatives, rulesets.linalg, rulesets.nn, rulesets.scan]:
        got = jax.grad(rewrite(loss, rulesets=[pack]), (0, 1))(w, h)
        _close(got, want, rtol=5e-2)


def test_a_tangent_the_program_does_not_take_falls_back_to_jax(monkeypatch):
    """Should the dtype choice of differentiated inputs ever disagree with JAX's, the derivative is JAX's
    derivative of the forward program, never a dropped tangent."""
    import rewrite.grad.primitive as primitive_module
    import rewrite.grad.vjp as vjp_module

    def none_in(closed):
        return [], list(range(len(closed.out_avals)))

    monkeypatch.setattr(vjp_module, "float_positions", none_in)
    monkeypatch.setattr(primitive_module, "float_positions", none_in)
    x = jnp.linspace(-1, 1, 8)
    f = lambda x: jnp.sum(jnp.sin(x))  # noqa: E731
    _close(jax.grad(rewrite(f))(x), jax.grad(f)(x))
    _close(jax.jvp(rewrite(f), (x,), (jnp.ones_like(x),))[1], jax.jvp(f, (x,), (jnp.ones_like(x),))[1])


@pytest.mark.parametrize("dtype", LOW + [jnp.float32, jnp.float64, jnp.complex64])
def test_the_float_predicate_knows_the_ml_dtypes(dtype):
    assert is_inexact_dtype(dtype)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jax.dtypes.float0, jax.random.key(0).dtype, None])
def test_the_float_predicate_rejects_the_rest(dtype):
    assert not is_inexact_dtype(dtype)
