"""A layer loop's backward in a whole training step (``rewrite/grad/loops.py``): layers stacked by ``lax.scan``
(linen's ``nn.scan``, equinox's scan over stacked blocks), with or without ``remat``, whose backward loop is
proven, one iteration at a time, to run the layer's VJP, and replaced by loops over the rewritten layer: under
``remat`` recomputing it, without it reading the residuals its VJP's split stacks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import rulesets
from benchmarks import wholestep as ws
from rewrite.ir.jaxapi import core, scan_counts
from tests.test_wholestep import (PACKS, _close, _labels, _moved, _normal, _replaced, _replaced_program, _tiny_flat,
                                  _tiny_replaced)


def _dots_in_loops(jaxpr: core.Jaxpr, inside: bool = False) -> list[tuple]:
    """The output shapes of the products computed inside a loop's body, at any depth."""
    found = []
    for e in jaxpr.eqns:
        if inside and e.primitive.name == "dot_general":
            found.append(tuple(e.outvars[0].aval.shape))
        for p in e.params.values():
            inner = p.jaxpr if isinstance(p, core.ClosedJaxpr) else p
            if isinstance(inner, core.Jaxpr):
                found += _dots_in_loops(inner, inside or e.primitive.name in ("scan", "while"))
    return found


def _step_replaced_keeps_values(name: str, dtype: str, split: bool) -> None:
    """The SGD step ``name`` under jit: its backward layer loop is replaced (recomputing the layer, or ``split``
    at the rewritten layer's residuals), and the loss and new parameters are the original's."""
    _, leaves = _tiny_flat(name, dtype)
    _, changed, finding, want, got, wider = _tiny_replaced(name, dtype)  # linen_scan_remat's: the library test's too
    assert changed is not None and any("backward layer loop" in r for r in finding.replaced), str(finding)
    assert any("split at its residuals" in r for r in finding.replaced) == split, str(finding)
    _close(want, got, 2e-4 if dtype == "float32" else 2e-2, wider, _moved(want, leaves))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["linen_scan_remat", "equinox_scan_remat"])
def test_scan_remat_backward_loop_replaced(name, dtype):
    """linen's ``nn.scan`` over ``nn.remat`` blocks, equinox's ``lax.scan`` over ``eqx.filter_checkpoint`` of
    stacked blocks, under jit with SGD: the backward layer loop is proven and replaced, and the loss and the new
    parameters are the original's, at f32 and with bf16 parameters."""
    _step_replaced_keeps_values(name, dtype, split=False)  # recomputing, as remat


def _step_at_512_replaced(name: str) -> tuple:
    """The SGD step ``name`` at N=512 with the memory packs: its backward layer loop is replaced. Returns the
    step, its arguments, its program, the changed program and N."""
    size = ws.Size(batch=2, length=512, width=16, heads=2, vocab=256)
    step, args = ws.CASES[name](size, ws.plain, opt=optax.sgd(0.1))
    flat, leaves = ws._flat(step, args)
    closed, changed, finding = _replaced_program(flat, leaves, PACKS)  # the program kept for the tests' premises
    assert changed is not None and any("backward layer loop" in r for r in finding.replaced), str(finding)
    return flat, leaves, closed, changed, size.length


@pytest.mark.parametrize("name", ["linen_scan_remat", "equinox_scan_remat"])
def test_scan_remat_backward_loop_holds_no_scores(name):
    """At N=512 the rewritten layer's attention is blocked: no product inside either layer loop computes the
    N x N scores (the step's own backward loop recomputed them in each layer), and the step holds under 60% of
    the original's temp memory (the loss cut at the loop alone held about as much as the original: linen 15.5
    against 15.4 MiB, equinox 13.5 against 13.5; with the loops replaced 7.6 and 7.3)."""
    flat, leaves, closed, changed, n = _step_at_512_replaced(name)
    assert not [s for s in _dots_in_loops(changed.jaxpr) if s[-2:] == (n, n)]
    assert [s for s in _dots_in_loops(closed.jaxpr) if s[-2:] == (n, n)]  # the test's premise

    def temp(f):
        return jax.jit(f).lower(*leaves).compile().memory_analysis().temp_size_in_bytes

    assert temp(core.jaxpr_as_fun(changed)) < 0.6 * temp(flat)


def _scan_step(remat: bool, dtype: str = "float32"):
    layer = lambda h, w: (jnp.tanh(h @ w[0]) @ w[1] + h, None)  # noqa: E731
    body = jax.checkpoint(layer) if remat else layer

    def loss(ws_, v, x, y):
        h, _ = jax.lax.scan(body, x, ws_)
        return optax.softmax_cross_entropy_with_integer_labels((h @ v).astype(jnp.float32), y).mean()

    def step(ws_, v, x, y):
        value, (gw, gv) = jax.value_and_grad(loss, argnums=(0, 1))(ws_, v, x, y)
        return ws_ - 0.1 * gw, v - 0.1 * gv, value

    return step


def _scan_args(dtype: str, scale: float, seed: int) -> list:
    rng = np.random.default_rng(seed)  # numpy's: jax.random compiles its generator for each shape it draws
    w, v, x = (rng.standard_normal(s).astype(np.float32) for s in ((3, 2, 8, 8), (8, 4), (16, 8)))
    return [jnp.asarray(a.astype(jnp.dtype(dtype))) for a in (w * np.float32(scale), v, x)] + [_labels(16, 4)]


@functools.lru_cache(maxsize=None)
def _scan_step_replaced(remat: bool, dtype: str) -> tuple:
    """``_scan_step(remat)`` at ``dtype``, and its program with the backward layer loop replaced
    (``rulesets.algebra``): once per ``remat`` and dtype, since the program traced, and so what ``find_losses``
    finds in it, depends on the arguments' shapes and dtypes, not on their values (the examples' scale and seed)."""
    step = _scan_step(remat)
    changed, finding = _replaced(step, _scan_args(dtype, 1.0, 0), packs=[rulesets.algebra])
    assert changed is not None and any("backward layer loop" in r for r in finding.replaced), str(finding)
    run = core.jaxpr_as_fun(changed)
    return step, changed, finding, jax.jit(lambda *a: (step(*a), run(*a)))


def _small_scan_step_replaced(remat: bool, dtype: str, scale: float, seed: int) -> tuple:
    """``_scan_step(remat)`` at ``dtype`` with its layers' weights scaled by ``scale``: its backward layer loop
    is replaced (``rulesets.algebra``). Also returns the step and the changed program under one ``jax.jit``
    (arguments -> (the step's outputs, the changed program's)), one function per ``remat`` and dtype, so that the
    examples compile it once (a new ``jaxpr_as_fun`` is traced and compiled anew), the two together (compiled
    together they cost less than apart)."""
    step, changed, finding, jitted = _scan_step_replaced(remat, dtype)
    return step, _scan_args(dtype, scale, seed), changed, finding, jitted


def test_the_scan_step_is_rewritten_once_per_dtype_whatever_its_values():
    """The memo the value tests share: a second example at the same dtype reads the first's rewrite, which is the
    rewrite of its own arguments (the same program)."""
    _scan_step_replaced.cache_clear()
    step, args, changed, _, _ = _small_scan_step_replaced(True, "float32", 0.0, 1)
    assert _small_scan_step_replaced(True, "float32", -2.0, 7)[2] is changed
    assert _scan_step_replaced.cache_info().hits == 1
    again, _ = _replaced(step, args, packs=[rulesets.algebra])
    assert str(again) == str(changed)


@settings(max_examples=6, deadline=None)
@given(dtype=st.sampled_from(["float32", "bfloat16", "float16", "float64"]),
       scale=st.sampled_from([0.0, 0.5, -2.0]), seed=st.integers(0, 2**16))
def test_scan_checkpoint_backward_loop_values(dtype, scale, seed):
    """``lax.scan`` over ``jax.checkpoint`` of a residual layer, any float dtype, weights scaled by 0, a half or
    -2: the backward loop is replaced and the new parameters and loss are the original's."""
    if dtype == "float64" and not jax.config.jax_enable_x64:
        dtype = "float32"
    step, args, changed, finding, both = _small_scan_step_replaced(True, dtype, scale, seed)
    want, got = both(*args)
    tol = {"float32": 1e-5, "float64": 1e-12}.get(dtype, 2e-2)
    _close(want, got, tol)


def _stacked(jaxpr: core.Jaxpr) -> list[tuple]:
    """The shapes of the arrays the step's loops stack (their per-iteration outputs), at the top level."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            found += [tuple(v.aval.shape) for v in e.outvars[scan_counts(e.params)[1]:]]
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["linen_scan", "equinox_scan"])
def test_plain_scan_backward_loop_replaced(name, dtype):
    """linen's ``nn.scan`` over plain blocks and equinox's ``lax.scan`` over stacked blocks, no ``remat``, under jit
    with SGD: the backward layer loop, which reads the residuals the forward loop stacked, is proven and replaced
    by the rewritten layer's split, and the loss and the new parameters are the original's, at f32 and with
    bf16 parameters."""
    _step_replaced_keeps_values(name, dtype, split=True)


@pytest.mark.parametrize("name", ["linen_scan", "equinox_scan"])
def test_plain_scan_stacks_no_scores(name):
    """At N=512, without ``remat``, the step's forward layer loop stacks each layer's N x N scores and
    probabilities for its backward; with the pair replaced by the rewritten layer's split, no array the loops
    stack has an N x N trailing pair, no product inside them computes one, and the step holds under half the
    original's temp memory (linen 33.8 -> 11.9 MiB, equinox 34.2 -> 11.8; their loss-first forms 19.7 and 19.3)."""
    flat, leaves, closed, changed, n = _step_at_512_replaced(name)
    assert [s for s in _stacked(closed.jaxpr) if s[-2:] == (n, n)]  # the test's premise
    assert not [s for s in _stacked(changed.jaxpr) if s[-2:] == (n, n)]
    assert not [s for s in _dots_in_loops(changed.jaxpr) if s[-2:] == (n, n)]

    def temp(f):
        return jax.jit(f).lower(*leaves).compile().memory_analysis().temp_size_in_bytes

    assert temp(core.jaxpr_as_fun(changed)) < 0.5 * temp(flat)


@settings(max_examples=6, deadline=None)
@given(dtype=st.sampled_from(["float32", "bfloat16", "float16"]), scale=st.sampled_from([0.0, 0.5, -2.0]),
       seed=st.integers(0, 2**16))
def test_plain_scan_backward_loop_values(dtype, scale, seed):
    """``lax.scan`` over a residual layer, no ``remat``, any of three float dtypes, weights scaled by 0, a half or
    -2: the backward loop is replaced by the layer's split (a loop reading the residuals its forward loop
    stacked), and the new parameters and loss are the original's, under jit and run eagerly."""
    step, args, changed, finding, both = _small_scan_step_replaced(False, dtype, scale, seed)
    assert not any("backward layer loop" in d for d in finding.declined), str(finding)
    want, got = both(*args)
    tol = 1e-5 if dtype == "float32" else 2e-2
    _close(want, got, tol)
    _close(want, core.jaxpr_as_fun(changed)(*args), tol)


def test_scan_with_stacked_outputs_read_is_kept():
    """A layer loop whose per-iteration outputs the loss reads too (``lax.scan`` returning each layer's output):
    the forward loop's stacked outputs are read by something other than its backward, whose body then also reads
    their cotangents. The pair is declined, says why, and the step's values are unchanged."""
    layer = lambda h, w: (jnp.tanh(h @ w[0]) @ w[1] + h,) * 2  # noqa: E731

    def loss(ws_, v, x, y):
        h, hs = jax.lax.scan(layer, x, ws_)
        logits = (h @ v).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + 0.1 * jnp.mean(hs ** 2)

    def step(ws_, v, x, y):
        value, (gw, gv) = jax.value_and_grad(loss, argnums=(0, 1))(ws_, v, x, y)
        return ws_ - 0.1 * gw, v - 0.1 * gv, value

    args = [_normal(0, (3, 2, 8, 8), scale=0.5), _normal(1, (8, 4)), _normal(2, (16, 8)), _labels(16, 4)]
    changed, finding = _replaced(step, args, packs=[rulesets.algebra])
    assert not any("backward layer loop" in r for r in finding.replaced), str(finding)
    assert any("stacked outputs are read by something other than its backward" in d for d in finding.declined), \
        str(finding)
    if changed is not None:
        _close(jax.jit(step)(*args), jax.jit(core.jaxpr_as_fun(changed))(*args), 1e-5)
