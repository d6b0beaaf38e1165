"""Rewrites under ``jax_numpy_dtype_promotion="strict"`` and ``jax_numpy_rank_promotion="raise"``, the settings
careful users train with.

The packs' rules and kernels write their dtypes as JAX's standard promotion reads them (float32 accumulators beside
bfloat16 operands). Under a user's strict promotion, defining ``rulesets.attention`` raised (its bfloat16 example
program), so every ``rewrite(f, rulesets=[<any pack's name>])`` on a machine with no cached checks raised, since a
name loaded every pack; and ``jax.grad`` of a rewritten bfloat16 or float16 attention or LM head raised from the
kernels' backward, which JAX traces under the user's settings; under ``rank_promotion="raise"`` defining
``rulesets.derivatives`` raised, and the LM head's rules. The packs' code now runs under standard promotion with rank
promotion allowed (``rewrite.rules.builder.standard_numpy``: the programs it makes hold each conversion and broadcast
explicitly), and a pack's name loads that pack alone.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rulesets
from rewrite import Ruleset, rewrite, rule

TOLERANCE = {"float32": 2e-4, "bfloat16": 3e-2, "float16": 4e-3}


def attention(q, k, v):
    return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) * 0.125, axis=-1) @ v


def lm_head(h, w, b, y):
    return optax.softmax_cross_entropy_with_integer_labels((h @ w + b[None, :]).astype(jnp.float32), y).mean()


@contextlib.contextmanager
def strict():
    """Both of JAX's strict settings (each alone is looser)."""
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


def _inputs(name, dtype):
    rng = np.random.default_rng(3)
    if name == "attention":
        return [jnp.asarray(rng.standard_normal((2, 512, 8)) + s, dtype) for s in (0.0, 0.0, 1.0)]
    return [jnp.asarray(rng.standard_normal((512, 64)), dtype), jnp.asarray(rng.standard_normal((64, 2048)) / 8, dtype),
            jnp.asarray(rng.standard_normal(2048), dtype), jnp.asarray(rng.integers(0, 2048, 512), jnp.int32)]


def _close(a, b, dtype):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    tol = TOLERANCE[dtype] * max(1.0, float(np.max(np.abs(b))))
    np.testing.assert_allclose(a, b, rtol=0, atol=tol)


def test_every_pack_is_defined_under_strict_settings():
    """Each pack's rules are traced at their probes and run on their example programs when defined: under strict
    dtype promotion ``rulesets.attention`` raised (its bfloat16 examples), under ``rank_promotion="raise"``
    ``rulesets.derivatives`` (``trig_sin2_over``'s example), in a process with no cached checks."""
    code = "import rulesets; print(sorted(rulesets.BUILTIN.items()) and len(rulesets.BUILTIN))"
    for setting in ({"JAX_NUMPY_DTYPE_PROMOTION": "strict"}, {"JAX_NUMPY_RANK_PROMOTION": "raise"}):
        env = {**os.environ, "JAX_REWRITE_CACHE_DIR": "off", **setting}
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
        assert run.returncode == 0 and run.stdout.strip() == str(len(rulesets.PACKS)), (setting, run.stderr[-2000:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name,packs,fires", [("attention", ["attention"], "attn_"),
                                               ("lm_head", ["nn"], "nn_lm_head_lse")])
def test_values_and_gradients_under_strict_settings(name, packs, fires, dtype):
    fn = {"attention": attention, "lm_head": lm_head}[name]
    args = _inputs(name, dtype)
    loss = lambda f: (lambda a, b, *rest: jnp.sum(jnp.sin(f(a, b, *rest).astype(jnp.float32))))
    want = fn(*args), jax.grad(loss(fn), (0, 1))(*args)
    with strict():
        g = rewrite(fn, rulesets=packs, strict=True, cache=False)
        assert any(k.startswith(fires) for k, s in g.result(*args).stats.items() if s.fired)
        eager = g(*args), jax.grad(loss(g), (0, 1))(*args)
        jitted = jax.jit(lambda *a: (g(*a), jax.grad(loss(g), (0, 1))(*a)))(*args)
        vjp = jax.vjp(lambda a: g(a, *args[1:]), args[0])[1](jnp.ones_like(want[0]))[0]
    want_vjp = jax.vjp(lambda a: fn(a, *args[1:]), args[0])[1](jnp.ones_like(want[0]))[0]
    if dtype == "float16":  # the original's own float16 gradient errs most here: both held to float64's
        with jax.enable_x64(True):
            wide = [a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
            ref = fn(*wide), jax.grad(loss(fn), (0, 1))(*wide)
        for got in (eager, jitted):
            for a, b, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(ref)):
                r = np.asarray(r, np.float64)
                ea, eb = (float(np.max(np.abs(np.asarray(x, np.float64) - r))) for x in (a, b))
                assert ea <= 2 * eb + 1e-3 * float(np.max(np.abs(r))), (ea, eb)
        return
    for got in (eager, jitted):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _close(a, b, dtype)
    _close(vjp, want_vjp, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name,packs", [("attention", ["attention"]), ("lm_head", ["nn"])])
def test_jvp_and_vmap_under_strict_settings(name, packs, dtype):
    fn = {"attention": attention, "lm_head": lm_head}[name]
    args = _inputs(name, dtype)
    t, stacked = jnp.ones_like(args[0]), jnp.stack([args[0]] * 2)
    of = lambda f: (lambda a: f(a, *args[1:]))
    want = jax.jvp(of(fn), (args[0],), (t,)), jax.vmap(of(fn))(stacked)
    with strict():
        g = rewrite(fn, rulesets=packs, strict=True, cache=False)
        got = [(jax.jvp(of(g), (args[0],), (t,)), jax.vmap(of(g))(stacked)),
               jax.jit(lambda a, s: (jax.jvp(of(g), (a,), (t,)), jax.vmap(of(g))(s)))(args[0], stacked)]
    for each in got:
        for a, b in zip(jax.tree.leaves(each), jax.tree.leaves(want)):
            _close(a, b, dtype)


def test_a_packs_name_loads_that_pack_alone():
    code = ("import sys, jax.numpy as jnp; from rewrite import rewrite; "
            "f = rewrite(lambda x: jnp.sum(x * 2.0), rulesets=['algebra']); f(jnp.ones(3)); "
            "print(sorted(m for m in sys.modules if m.startswith('rulesets.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "rulesets.algebra" in out and "rulesets.attention" not in out and "rulesets.nn" not in out, out


def test_a_rules_left_side_is_matched_as_the_users_program_was_traced():
    """The left side is checked against the matched program by tracing it at the match's types, under the user's
    settings as the program was: JAX keys its traces of an inner ``jit`` (``jnp.linalg.inv``) by them, so a left
    side traced under other settings held another inner program and never verified (the replacement, the rule's
    own code, is built under standard promotion)."""
    inv_solve = rule(lambda a, b: jnp.linalg.inv(a) @ b, lambda a, b: jnp.linalg.solve(a, b), name="inv_solve_p",
                     example_inputs=(jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32)))
    a = jnp.eye(5) * 2.0 + 0.1 * jax.random.normal(jax.random.key(0), (5, 5))
    b = jnp.arange(5.0)
    with strict():
        f = rewrite(lambda a, b: jnp.linalg.inv(a) @ b, rulesets=[Ruleset("s", [inv_solve], soundness="identity")],
                    strict=True)
        assert f.result(a, b).stats["inv_solve_p"].fired == 1
        np.testing.assert_allclose(f(a, b), jnp.linalg.solve(a, b), rtol=1e-5, atol=1e-5)
