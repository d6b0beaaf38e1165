"""Effect tokens (``jax.lax.create_token``) as arguments and results of a rewritten function.

Code that orders its effects by hand (mpi4jax's older API, ``infeed``/``outfeed``) threads a token through
its functions. Under ``jax.jit`` a token argument was taken for an array (its type has no shape: an
``AttributeError`` from the rewriter); called eagerly, it was baked into the program as a constant that
could not be run; under ``jax.grad`` the derivative programs made an array cotangent for it. A rewritten
function now takes and returns tokens wherever ``jax.jit`` of it does (JAX's own ``vmap`` and ``jvp`` of
such a function fail, so the rewriter is not asked more).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rewrite import rewrite

PACKS = [None, ["algebra", "scan", "derivatives", "nn", "linalg"]]


def passes(x, token):
    return jnp.sin(x) * 1.0, token


def orders(x, token):
    token = jax.lax.after_all(token)
    return jnp.sum(jnp.tanh(x) * jnp.exp(x)), token


MODES = {
    "eager": lambda f: f,
    "jit": jax.jit,
    "grad": lambda f: jax.grad(lambda x, t: jnp.sum(f(x, t)[0].astype(jnp.float32))),
    "jit_grad": lambda f: jax.jit(jax.grad(lambda x, t: jnp.sum(f(x, t)[0].astype(jnp.float32)))),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("packs", PACKS, ids=["default", "all"])
@pytest.mark.parametrize("fn", [passes, orders])
def test_a_token_passes_through_a_rewritten_function_as_through_jit(fn, packs, mode, dtype):
    x = jnp.linspace(-1.5, 1.5, 12, dtype=dtype)
    token = jax.lax.create_token()
    kw = {} if packs is None else {"rulesets": packs}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: the program is rewritten, and strict raises on a failure
        got = MODES[mode](rewrite(fn, strict=True, **kw))(x, token)
    want = MODES[mode](jax.jit(fn))(x, token)
    if mode in ("eager", "jit"):
        assert isinstance(got[1], type(token))
        got, want = got[0], want[0]
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("packs", PACKS, ids=["default", "all"])
def test_jax_grad_of_a_rewritten_loss_that_threads_a_token(packs):
    kw = {} if packs is None else {"rulesets": packs}
    loss = lambda x, t: orders(x, t)[0]  # noqa: E731
    x = jnp.linspace(-1.5, 1.5, 12)
    token = jax.lax.create_token()
    np.testing.assert_allclose(jax.grad(rewrite(loss, strict=True, **kw))(x, token),
                               jax.grad(loss)(x, token), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_a_token_closed_over_and_returned_comes_back_a_token(jit):
    """A token the function closes over is no input of its program. Once tokens were traced, one returned became
    an output of the program, a constant the e-graph held as a NumPy object array: the call returned that array,
    and under `jax.jit` JAX refused it (api_test's `test_jit_capturing_token`)."""
    token = jax.lax.create_token()
    g = rewrite(lambda x: (jnp.sin(x) * 1.0, token), rulesets=["algebra"], strict=True)
    y, out = (jax.jit(g) if jit else g)(jnp.linspace(0.0, 1.0, 4))
    assert isinstance(out, type(token))
    np.testing.assert_allclose(y, jnp.sin(jnp.linspace(0.0, 1.0, 4)), rtol=1e-6)
