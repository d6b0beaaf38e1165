"""A rewritten function pickles: by name where its module holds it, else as what it was made of.

Its programs, compiled functions and locks belong to the process that made them (JAX's programs hold tracebacks,
which do not pickle): a copy rewrites again at its first call. ``jax.jit(rewrite(f))`` is pickled by
``cloudpickle`` (JAX's own ``pickle_test``; what sends a function to another process), and the built-in packs
travel by name, not rule by rule.
"""

from __future__ import annotations

import pickle

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rulesets
from rewrite import Ruleset, rewrite, rule

PACKS = ["algebra", "scan", "derivatives", "nn", "linalg"]


def loss(x, w):
    z = x @ w
    return jnp.sum(jax.nn.log_softmax(z, axis=-1) * 2.0 + jax.nn.log_softmax(z, axis=-1) * 2.0)


@rewrite(rulesets=PACKS)
def decorated(x):
    return jnp.sum(jnp.log(jax.nn.sigmoid(x)))


def _args(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return jax.random.normal(k1, (8, 16), dtype), jax.random.normal(k2, (16, 32), dtype)


def _close(a, b, dtype=jnp.float32):
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(u, np.float32), np.asarray(v, np.float32), rtol=tol, atol=tol)


def test_a_module_function_pickles_by_name():
    x = jnp.linspace(-3.0, 3.0, 7)
    decorated(x)  # programs of this process are held
    data = pickle.dumps(decorated)
    assert pickle.loads(data) is decorated
    assert len(data) < 200


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jit_of_rewrite_cloudpickles_after_a_call(dtype):
    f = jax.jit(rewrite(lambda x, w: loss(x, w), rulesets=PACKS))
    args = _args(dtype)
    want = f(*args), jax.jit(jax.grad(f, argnums=1))(*args)
    g = cloudpickle.loads(cloudpickle.dumps(f))
    _close((g(*args), jax.jit(jax.grad(g, argnums=1))(*args)), want, dtype)
    _close(want, (loss(*args), jax.grad(loss, argnums=1)(*args)), dtype)


def test_a_copy_is_made_again_with_its_options_and_no_programs():
    f = rewrite(loss, rulesets=[rulesets.algebra, "nn", rulesets.linalg], static_argnums=(), whole_step=False)
    args = _args()
    f(*args)
    jax.grad(f)(*args)
    assert f.rewrites == 1
    data = pickle.dumps(f)  # plain pickle: loss is a module function, the packs go by name
    g = pickle.loads(data)
    assert type(g) is type(f) and g is not f and g.fn is loss
    assert g._made[1] == ["algebra", "nn", "linalg"]
    assert [r.name for r, _ in g.entries] == [r.name for r, _ in f.entries]
    assert (g.rewrites, g.whole_step) == (0, False)
    _close((g(*args), jax.grad(g)(*args)), (f(*args), jax.grad(f)(*args)))
    tangents = tuple(jnp.ones_like(a) for a in args)
    _close(jax.jvp(g, args, tangents), jax.jvp(loss, args, tangents))
    _close(jax.vmap(g, (0, None))(jnp.stack([args[0]] * 2), args[1]), jax.vmap(loss, (0, None))(
        jnp.stack([args[0]] * 2), args[1]))
    assert g.rewrites >= 1
    assert b"log_softmax" not in data  # no rule's code or program travelled


def test_vjp_rewritten_function_pickles():
    with pytest.warns(DeprecationWarning):
        f = rewrite(lambda x: jnp.sum(jnp.sin(x) ** 2), rulesets=PACKS, vjp=True)
    x = jnp.linspace(-2.0, 2.0, 5)
    want = jax.grad(f)(x)
    g = cloudpickle.loads(cloudpickle.dumps(f))
    assert type(g) is type(f)
    _close(jax.grad(g)(x), want)
    _close(jax.vmap(g)(x[:, None]), jax.vmap(f)(x[:, None]))


def _fired(f, *args):
    return {name: s.fired for name, s in f.result(*args).stats.items() if s.fired}


def test_a_users_rule_travels_and_fires_after_its_sides_were_traced():
    mine = Ruleset("mine", [rule(lambda x: jnp.log(1.0 + x), lambda x: jnp.log1p(x), name="my_log1p")],
                   soundness="identity")
    f = rewrite(lambda x: jnp.log(1.0 + x) * 3.0, rulesets=[mine])
    x = jnp.asarray([0.0, 1e-8, 2.0, jnp.inf, jnp.nan])
    want = f(x)
    assert _fired(f, x) == {"my_log1p": 1}  # the rule's sides are now traced in this process
    g = cloudpickle.loads(cloudpickle.dumps(f))
    assert g.rewrites == 0 and _fired(g, x) == {"my_log1p": 1}
    np.testing.assert_array_equal(np.asarray(g(x)), np.asarray(want))
    assert float(g(jnp.asarray([1e-8]))[0]) == pytest.approx(3e-8, rel=1e-6)  # log1p's value, not log(1 + x)'s
