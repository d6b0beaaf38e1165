"""``rulesets.scan``: move work into and out of ``lax.scan`` loops (JAX issue #4968, seed 001).

A loss over a scan's stacked outputs materialises a ``(length, batch, ...)``
array only to reduce it. The ``hoist`` rules compute such reductions inside
the loop instead: a reduction over the scan axis becomes an accumulator in the
carry, and one over the other axes makes each step emit its reduced slice.
Elementwise work between the loop and the reduction moves in with it
(``mean((ys - y) ** 2)``: ``y`` becomes an ``xs`` input of the loop, operands
that do not vary with the step become loop constants). The ``sink`` rule
does the same for what feeds a loop: an ``xs`` input built outside from
stacked arrays is computed step by step inside, and another loop's stacked
output may be recomputed there instead of stored (the loop fusion that the
backward program of ``jax.grad`` needs). The ``lift`` rule goes the other
way for per-step outputs that never read the carry: they are computed
outside the loop, for all steps at once, as one vectorised op. Every rule
builds a new loop next to the old one and hands it all of the old loop's
outputs; extraction keeps whichever program the cost model prefers, so an
output that is also used elsewhere is only hoisted when that pays.

Floating point: hoisting changes the order of summation (a running sum
instead of XLA's reduction tree), so the pack's class is ``identity``. A sum
of ``n`` terms moves by at most about ``n * eps * sum(|terms|)``; the pack's
:data:`TOLERANCE` covers sums of up to ~10^4 float32 terms of like sign.
Accumulators of float16/bfloat16 sums are kept in float32. Max and min are
exact. Apply the pack only when you name it.

Autodiff, two ways. ``jax.grad(rewrite(loss))``: a loop built by ``hoist``
asks the emitter (``_rw_remat``) to wrap its body in ``jax.checkpoint``
saving only the carries, so the gradient stores the carry history and
recomputes each step's other values (the loss residual ``2 * (o_t - y_t)``
among them) instead of stacking them; without differentiation the checkpoint
is free (:func:`make` picks another policy). ``rewrite(jax.grad(loss))``:
``sink`` moves the cotangent and the cheap residuals into the backward loop;
with ``AnalyticCost(stacked=...)`` pricing stacked memory it recomputes whole
steps. Measurements are in ``benchmarks/results/scan.md``.

>>> import jax, jax.numpy as jnp
>>> from jax import lax
>>> from rewrite import rewrite
>>> import rulesets
>>> def loss(h0, xs, y):
...     _, ys = lax.scan(lambda h, x: (jnp.tanh(h + x), h * x), h0, xs)
...     return jnp.mean((ys - y) ** 2)
>>> h0, xs, y = jnp.ones(256), jnp.ones((64, 256)), jnp.zeros((64, 256))
>>> fast = rewrite(loss, rulesets=[rulesets.scan])
>>> bool(jnp.allclose(fast(h0, xs, y), loss(h0, xs, y), rtol=1e-5))
True
>>> [e.primitive.name for e in fast.jaxpr(h0, xs, y).eqns]  # no stacked output, no reduction outside
['scan', 'div']
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rewrite import Ruleset, Tolerance, procedural, rule
from rewrite.loops import SCAN, Decline, Loop

#: How far a rewrite of this pack may move a float32 result (see the module docstring).
TOLERANCE = Tolerance(rtol=2e-5, atol=1e-5)

#: Reductions that can run as a carry, with the binary op that accumulates them.
_ACCUMULATE: dict[str, Callable[[Any, Any], Any]] = {"reduce_sum": lax.add, "reduce_max": lax.max,
                                                       "reduce_min": lax.min}


def _identity(prim: str, dtype: Any) -> Any:
    if prim == "reduce_sum":
        return 0
    if jnp.issubdtype(dtype, jnp.floating):
        return -np.inf if prim == "reduce_max" else np.inf
    info = jnp.iinfo(dtype)
    return info.min if prim == "reduce_max" else info.max


# ---------------------------------------------------------------------- hoisting reductions
def hoist_reductions(m, remat: str | None = "carries") -> Any:
    """``reduce(f(ys, ...))`` over a scan's stacked ``ys`` -> the reduction computed in a copy of the loop.

    Over the scan axis, an accumulator carry; over other axes only, a new
    per-step output. ``f`` is any chain of work that acts step by step
    (pointwise ops, broadcasts, readouts such as ``dot_general`` with
    weights, reshapes, transposes); its other operands become ``xs`` inputs
    or loop constants. Every reduction of the loop's outputs moves into one
    copy, whose body is checkpointed for autodiff with the policy ``remat``.
    """
    loop = Loop(m)
    if loop.params.get("_rw_hoisted") or not loop.stacked():
        return None  # a loop this rule built has its own reductions inside already
    results: list[tuple[Any, Callable]] = []
    for root, node in loop.consumers():
        if node.prim not in _ACCUMULATE:
            continue
        (operand,) = node.operands
        for axis in [a for a in range(operand.ndim) if operand.shape[a] == loop.length]:
            with loop.attempt():
                results.append((root, _hoist_one(loop, root, node, axis)))
                break
    if not results:
        return None
    res = loop.build(_rw_hoisted=True, **({"_rw_remat": remat} if remat else {}))
    pairs = loop.handover(res)
    for root, read in results:
        out = read(res)
        if out.aval != root.aval:
            return None
        pairs.append((root, out))
    return pairs


def _hoist_one(loop: Loop, root: Any, node: Any, axis: int) -> Callable:
    """Move one reduction into the loop; returns how to read its result from the copy's results."""
    m = loop.m
    (operand,) = node.operands
    axes = tuple(node.params["axes"])
    dtype = root.dtype
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise Decline(f"accumulating {dtype} is not supported")
    prim, params = node.primitive, node.params
    step = loop.per_step(operand, axis)
    inner = tuple(a - (a > axis) for a in axes if a != axis)
    if inner:
        step = m.trace(lambda e: prim.bind(e, **dict(params, axes=inner)), step)
    if axis not in axes:  # each step emits its reduced slice, stacked along the axis the reduction leaves it at
        k = loop.add_output(step)
        at = axis - sum(a < axis for a in axes)
        if at == 0:
            return lambda res: loop.output_result(res, k)
        perm = tuple(range(1, at + 1)) + (0,) + tuple(range(at + 1, root.ndim))
        return lambda res: m.trace(lambda y: lax.transpose(y, perm), loop.output_result(res, k))
    # An accumulator. Narrow floats accumulate in float32 and round once at the end.
    acc_dtype = np.dtype(np.float32) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 else dtype
    if acc_dtype != dtype:
        step = m.trace(lambda e: e.astype(acc_dtype), step)
    ident = _identity(node.prim, acc_dtype)
    init = m.trace(lambda: lax.full(root.shape, ident, acc_dtype))
    if init.aval != step.aval:
        raise Decline(f"accumulator {init.aval} does not match the step's {step.aval}")
    j, acc = loop.add_carry(init)
    loop.set_carry_next(j, m.trace(_ACCUMULATE[node.prim], acc, step))

    def read(res):
        final = loop.carry_result(res, j)
        return final if acc_dtype == dtype else m.trace(lambda a: a.astype(dtype), final)

    return read


# ---------------------------------------------------------------------- computing inputs inside the loop
def sink_inputs(m) -> Any:
    """``xs`` input ``z = f(a, b, ...)`` of a scan, stacked outside -> ``z[t] = f(a[t], b[t], ...)`` inside.

    ``f`` is a chain of work that acts step by step over arrays stacked along
    the scan axis and loop invariants, and may end in another loop's stacked
    output that that loop computes from its ``xs``, its constants and stacked
    outputs this loop reads anyway (``1 - h_t``, ``h_t @ V``): that output is
    then recomputed here instead of stored. This is the loop fusion that
    ``jax.grad``'s backward program needs: its residuals and cotangents are
    elementwise functions of the forward loop's outputs. Three copies are
    offered: without recomputation, recomputing only arithmetic, and
    recomputing anything; extraction weighs the work against the storage.
    """
    depth = int(m.params("sp").get("_rw_sunk", 0))
    if depth >= 3:  # each copy drops an input; a few rounds reach everything worth moving
        return None
    pairs: list = []
    seen: set = set()
    for recompute in (None, "cheap", "all"):
        found = _sink(m, recompute, depth)
        if found is not None and found[0] not in seen:
            seen.add(found[0])
            pairs += found[1]
    return pairs or None


def _sink(m, recompute: str | None, depth: int) -> tuple[Any, list] | None:
    loop = Loop(m)
    if not loop.outputs():
        return None  # nothing reads this loop (a backward loop whose results are all dropped, say)
    loop.recompute = recompute
    inside: dict[int, Any] = {}
    for j in range(loop.num_consts + loop.num_carry, len(loop.args)):
        z = loop.args[j]
        loop.no_leaf = {z.cls}
        with loop.attempt():
            inside[j] = loop.per_step(z, stacked={})
    loop.no_leaf = set()
    drop = {j: v for j, v in inside.items() if j not in loop.needed}
    if not drop:
        return None
    params = [loop.input(p) for p in range(len(loop.args))]
    body = m.function(loop.body.outs, params)
    if body is None:
        return None
    outs = m.trace(lambda *a: tuple(body(*a)), *[drop.get(p, params[p]) for p in range(len(loop.args))])
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    res = loop.build(drop_xs=tuple(drop), body_outs=outs, _rw_sunk=depth + 1)
    return tuple(v.name for v in res), loop.handover(res)


# ---------------------------------------------------------------------- lifting carry-independent outputs
def lift_independent(m) -> Any:
    """Stacked ``y_t = f(consts, x_t)`` that never reads the carry -> ``vmap(f)(consts, xs)`` outside the loop.

    The copy of the loop no longer computes or stacks ``y``; when nothing
    else of the loop is used, the loop disappears.
    """
    loop = Loop(m)
    used = sorted({i for _, i in loop.outputs() if i >= loop.num_carry})
    if not used:
        return None
    ncon, nc = loop.num_consts, loop.num_carry
    positions = list(range(ncon)) + list(range(ncon + nc, len(loop.args)))
    inputs = [loop.input(p) for p in positions]
    outer = [loop.args[p] for p in positions]
    in_axes = tuple(None if p < ncon else 0 for p in positions)
    lifted: dict[int, Any] = {}
    for k in used:
        f = m.function([loop.body.outs[k]], inputs)
        if f is None:
            continue
        batched = jax.vmap(lambda *a, f=f: f(*a)[0], in_axes=in_axes, axis_size=loop.length)
        y = m.trace(batched, *outer)
        if y.aval == loop.scan.aval[k]:
            lifted[k] = y
    if not lifted:
        return None
    res = loop.build(drop=tuple(lifted))
    return loop.handover(res, drop=tuple(lifted)) + [(v, lifted[i]) for v, i in loop.outputs() if i in lifted]


# ---------------------------------------------------------------------- the pack
def _mse_of_loop(h0, xs, y):
    """Where ``hoist_reductions`` applies: a mean squared error over a loop's stacked outputs."""
    _, ys = lax.scan(lambda h, x: (jnp.tanh(h + x), h * x), h0, xs)
    return jnp.mean((ys - y) ** 2)


def _loop_into_loop(c0, xs, w):
    """Where ``sink_inputs`` applies: one loop's outputs, combined elementwise, feed a second loop."""
    _, (a, b) = lax.scan(lambda c, x: (jnp.tanh(c * w + x), (c * 2.0 + x, x * w)), c0, xs)
    return lax.scan(lambda c, z: (c * 0.5 + z * c, jnp.sum(z * c)), c0, a * w + b)


def _seed(x1, x2, y):
    """Where ``lift_independent`` applies: the seed's loop, whose stacked output never reads the carry."""
    return jnp.square(y - lax.scan(lambda c, x: (jnp.sin(c), jnp.cos(x)), x1, x2)[1]).mean()


def _f32(*shape: int) -> Any:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def make(remat: str | None = "carries") -> Ruleset:
    """The pack, with the checkpoint policy of the loops it builds.

    ``remat`` is what ``jax.grad`` of a rewritten program keeps per step of a
    loop that ``hoist`` built: ``"carries"`` (the default: the carry history,
    and recompute the rest), ``"nothing"`` (only the body's inputs: least
    memory, most recomputation) or ``None`` (no checkpoint: JAX stacks every
    residual). Forward programs are the same under all three.

    >>> make(remat="nothing").rule("hoist_reductions").name
    'hoist_reductions'
    """
    hoist = Ruleset("hoist", [
        rule(SCAN, procedural(lambda m: hoist_reductions(m, remat)), name="hoist_reductions",  # reduce(f(ys, xs, c)) -> carry acc / per-step output
             example=(_mse_of_loop, (_f32(64), _f32(16, 64), _f32(16, 64)))),
    ], soundness="identity", tolerance=TOLERANCE,
        description="reductions of a scan's stacked outputs, computed inside the loop")
    sink = Ruleset("sink", [
        rule(SCAN, procedural(sink_inputs), name="sink_inputs",  # xs = f(a, b) stacked outside -> f(a[t], b[t]) inside
             example=(_loop_into_loop, (_f32(8, 64), _f32(16, 8, 64), _f32()))),
    ], soundness="identity", tolerance=TOLERANCE,
        description="inputs of a scan computed inside it from what they are made of")
    lift = Ruleset("lift", [
        rule(SCAN, procedural(lift_independent), name="lift_independent",  # ys[t] = f(c, xs[t]) -> vmap(f)(c, xs)
             example=(_seed, (_f32(10, 5, 8), _f32(30, 15, 12), _f32(30, 15, 12)))),
    ], soundness="identity", tolerance=TOLERANCE,
        description="per-step outputs that never read the carry, computed outside the loop at once")
    return Ruleset("scan", [hoist, sink, lift], soundness="identity", tolerance=TOLERANCE,
                   description="move reductions into scans and carry-independent work out of them")


scan = make()
hoist, sink, lift = scan.hoist, scan.sink, scan.lift
