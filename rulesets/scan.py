"""``rulesets.scan``: move work into and out of ``lax.scan`` loops (JAX issue #4968, seed 001).

A loss over a scan's stacked outputs materialises a ``(length, batch, ...)``
array only to reduce it. The ``hoist`` rules compute such reductions inside
the loop instead: a reduction over the scan axis becomes an accumulator in the
carry, and one over the other axes makes each step emit its reduced slice.
Work between the loop and the reduction that acts step by step moves in with
it: elementwise chains, broadcasts, readouts (``dot_general`` with weights),
reshapes and transposes that keep the loop's axis (``mean((ys @ V + b - y)
** 2)``: ``y`` becomes an ``xs`` input of the loop, ``V`` and ``b`` loop
constants). The ``buffers`` rules read ``fori_loop`` code: a ``while``
counted to a constant becomes a scan, and a buffer the loop writes row by
row at its counter (``buf.at[i].set(v)``) becomes a stacked output, which
the other rules then treat as any other. The ``sink`` rule
does the same for what feeds a loop: an ``xs`` input built outside from
stacked arrays is computed step by step inside, and another loop's stacked
output may be recomputed there instead of stored (the loop fusion that the
backward program of ``jax.grad`` needs). The ``lift`` rule goes the other
way for per-step outputs that never read the carry: they are computed
outside the loop, for all steps at once, as one vectorised op. Every rule
builds a new loop next to the old one and hands it all of the old loop's
outputs; extraction keeps whichever program the cost model prefers, so an
output that is also used elsewhere is only hoisted when that pays. The rules
act in one order (buffers, hoist, lift, sink: :data:`_ORDER`), each on the
loops the ones before it built, so that a loop is copied once per
combination of rules, not once per order of them.

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
from jax.extend.core import Var, jaxprs_in_params

from rewrite import Ruleset, Tolerance, procedural, rule
from rewrite.ir.jaxapi import has_reduced_axes, scan_counted
from rewrite.ir.primitives import nbytes
from rewrite.cache.fingerprint import CALLBACKS, Memo
from rewrite.jaxpr.trace import program_key, trace_at
from rewrite.rules.builder import _config, _Traces
from rewrite.loops import SCAN, WHILE, Body, Decline, Loop, adds_one
from rewrite.report.report import equations
from rulesets._examples import f32
from rulesets._numpy_eval import evaluated

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


# ---------------------------------------------------------------------- the order of the loop rules
#: The loop rules act in this order, each on the loops the rules before it built (and on the program's own):
#: a rule does not act on a loop that a later rule built. Each copy is a new loop, and one built by another
#: path (sink then hoist, hoist then sink) is a different term even where it computes the same, so without an
#: order each copy would be copied again by every rule, and the copies of copies would grow with every
#: iteration (the LM head's token loops in a sequence model's VJP, say). In this order a loop reaches each
#: combination once: its buffers as outputs, its reductions moved in (adding inputs), its carry-free outputs
#: lifted out, then its inputs (its own and those added) computed inside. Lift comes before sink: the other
#: way loses a declined candidate of the decision corpus (lm_head_grad_small's).
_ORDER = ("buffers", "hoist", "lift", "sink")
#: The annotation each rule puts on the loops it builds.
_MARK = {"buffers": "_rw_buffered", "hoist": "_rw_hoisted", "sink": "_rw_sunk", "lift": "_rw_lifted"}


def _after(loop: Any, rule: str) -> bool:
    """Whether ``loop`` (a :class:`Loop` or a scan's params) was built by a rule that comes after ``rule``."""
    params = loop.params if isinstance(loop, Loop) else loop
    return any(params.get(_MARK[r]) for r in _ORDER[_ORDER.index(rule) + 1:])


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
    if _after(loop, "hoist"):
        return None
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
    shape = root.shape  # (not root: a closure over a Value is traced afresh each time, builder._trace_key)
    init = m.trace(lambda: lax.full(shape, ident, acc_dtype))
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
    A copy is sunk again (up to three rounds) with the policies that built it.
    A loop a pack's kernel laid out (:func:`rewrite.loops.laid_out`) is left
    as it is.
    """
    sp = m.params("sp")
    depth = int(sp.get("_rw_sunk", 0))
    if depth >= 3:  # each copy drops an input; a few rounds reach everything worth moving
        return None
    if _after(sp, "sink") or sp.get("_rw_laid_out"):  # a later rule's copy, or a loop a kernel wrote
        return None
    # Each policy's copy is sunk again with that policy only (a policy that built the same copy as another
    # shares it): in every combination of policies over three rounds (39 copies of each loop, where these
    # are 9) the later rounds rebuilt what the first ones had built.
    policies = sp.get("_rw_recompute") or (None, "cheap", "all")
    found: dict[tuple, tuple[list, Callable]] = {}
    shared: dict = {}  # what the policies' copies share: the body read back as a function, the bodies traced
    for recompute in policies:
        plan = _sink(m, recompute, depth, shared)
        if plan is not None:
            found.setdefault(plan[0], ([], plan[1]))[0].append(recompute)
    pairs: list = []
    for built_by, build in found.values():
        pairs += build(tuple(built_by))
    return pairs or None


def _sink(m, recompute: str | None, depth: int, shared: dict) -> tuple[Any, Callable] | None:
    """The copy that sinks this loop's inputs under the policy ``recompute``: what it is (its dropped inputs and
    body outputs), and how to build it given the policies it stands for; ``None`` when nothing sinks.
    ``shared`` keeps what another policy's copy of the same loop made and this one may reuse."""
    loop = Loop(m)
    if not loop.outputs():
        return None  # nothing reads this loop (a backward loop whose results are all dropped, say)
    loop.recompute = recompute
    inside: dict[int, Any] = {}
    for j in range(loop.num_consts + loop.num_carry, len(loop.args)):
        z = loop.args[j]
        loop.no_leaf = {z.cls}
        with loop.attempt():
            step = loop.per_step(z, stacked={})
            if loop.is_input(step):
                raise Decline("nothing to compute inside: the input would be read as it is")
            inside[j] = step
    loop.no_leaf = set()
    drop = {j: v for j, v in inside.items() if j not in loop.needed}
    if not drop:
        return None
    params = [loop.input(p) for p in range(len(loop.args))]
    if "body" not in shared:  # the body's outputs as a function of its inputs: the same for every policy
        shared["body"] = m.function(loop.body.outs, params)
    body = shared["body"]
    if body is None:
        return None
    at = [drop.get(p, params[p]) for p in range(len(loop.args))]
    traced = tuple(v.name for v in at)
    if traced not in shared:  # two policies that compute the same inputs inside build the same body
        outs = m.trace(body, *at)  # (traced once per avals: Match.function)
        shared[traced] = list(outs) if isinstance(outs, tuple) else [outs]
    outs = shared[traced]
    # the same dropped inputs and body outputs (which name every input the copy adds) are the same copy
    key = (tuple(drop), tuple(o.name for o in outs))

    def build(policies: tuple) -> list:
        res = loop.build(drop_xs=tuple(drop), body_outs=outs, _rw_sunk=depth + 1, _rw_recompute=policies)
        return loop.handover(res)
    return key, build


# ---------------------------------------------------------------------- lifting carry-independent outputs
def lift_independent(m) -> Any:
    """Stacked ``y_t = f(consts, x_t)`` that never reads the carry -> ``vmap(f)(consts, xs)`` outside the loop.

    The copy of the loop no longer computes or stacks ``y``; when nothing
    else of the loop is used, the loop disappears. A carry that the body
    passes on unchanged (a backward loop's cotangent of a loop-invariant
    value, say) holds its initial value at every step: ``f`` may read it like
    a constant, and the loop's final value of it is its initial value.

    Declined where ``vmap(f)`` would hold an array larger than
    :data:`LIFT_HOLDS` times the stacked arrays it reads and returns together,
    and at least :data:`LIFT_BYTES`: a loop that reduces a large value each
    step (the LM head's loop over token blocks in ``rulesets.nn``: a block's
    logits, to a maximum and a sum per token) is written to hold one step's at
    a time, and lifted it holds every step's at once. The loop's constants are
    not counted: the loop holds them too, and a large one (the head's weight)
    would hide a held array as large as itself times :data:`LIFT_HOLDS`. Inside another operation's body
    (the head's ``custom_vjp``) extraction decides by node prices, which
    have no peak in them, and took the lifted form: the logits the pack
    removed came back (``tests/test_ecosystem.py``).
    """
    loop = Loop(m)
    if _after(loop, "lift"):
        return None
    ncon, nc = loop.num_consts, loop.num_carry
    fixed = [ncon + k for k in range(nc) if loop.body.outs[k].cls == loop.input(ncon + k).cls]
    same = [(v, loop.args[ncon + i]) for v, i in loop.outputs() if ncon + i in fixed]
    used = sorted({i for _, i in loop.outputs() if i >= nc})
    positions = list(range(ncon)) + fixed + list(range(ncon + nc, len(loop.args)))
    inputs = [loop.input(p) for p in positions]
    # which outputs the inputs alone compute: a slice each, not a function each (a loop of many outputs, as
    # hoist and the LM head's backward make, emitted its body once per output)
    free = [k for k, ok in zip(used, m.computes_each([loop.body.outs[k] for k in used], inputs)) if ok]
    # one function for all of them, so that work they share (a checkpointed body, say) is done once
    f = m.function([loop.body.outs[k] for k in free], inputs) if free else None
    if f is None and free:  # a slice that cannot be emitted (effects): the outputs that can be, as before
        free = [k for k in free if m.function([loop.body.outs[k]], inputs) is not None]
        f = m.function([loop.body.outs[k] for k in free], inputs) if free else None
    if f is None:
        return same or None
    in_axes = tuple(None if p < ncon + nc else 0 for p in positions)
    at = [loop.args[p] for p in positions]
    stacked = [p >= ncon + nc for p in positions]
    outs = [loop.scan.aval[k] for k in free]
    # the decline below, made before the lifted trace where the step's own program already shows an array that
    # vmap(f) holds (every decline of the heavy steps' loops; the trace and its key were 0.06 s of a step's rewrite)
    if _too_large(_batched_bytes(f, in_axes, loop.length), [v.aval for v, s in zip(at, stacked) if s], outs):
        return same or None
    if any(has_reduced_axes(a) for a in [v.aval for v in at] + outs):  # JAX's vmap cannot batch them
        return same or None
    lifted_fn = jax.vmap(lambda *a: tuple(f(*a)), in_axes=in_axes, axis_size=loop.length)
    try:  # traced once: read for what it holds, then inserted as it is
        traced = _lifted_trace(f, lifted_fn, in_axes, loop.length, [v.aval for v in at])
    except Exception:  # noqa: BLE001  (a trace that fails here fails in m.trace too, which decides)
        traced = None
    if traced is not None and (_holds_more(traced, outs, stacked) or _loops_again(traced, loop.length)):
        return same or None
    ys = m.trace(lifted_fn, *at) if traced is None else m.insert(traced, *at)
    ys = ys if isinstance(ys, (tuple, list)) else (ys,)
    lifted = {k: y for k, y in zip(free, ys) if y.aval == loop.scan.aval[k]}
    if not lifted:
        return same or None
    res = loop.build(drop=tuple(lifted), _rw_lifted=True)
    return same + loop.handover(res, drop=tuple(lifted)) + [(v, lifted[i]) for v, i in loop.outputs() if i in lifted]


#: ``lift_independent`` declines where the lifted computation holds an array this many times larger than what
#: it reads and returns together ...
LIFT_HOLDS = 4
#: ... and at least this many bytes.
LIFT_BYTES = 2 ** 20


def _lifted_trace(f: Any, lifted_fn: Callable[..., Any], in_axes: tuple, length: int, avals: list) -> Any:
    """``trace_at(lifted_fn, avals)``, ``lifted_fn`` being ``vmap(f)`` at ``in_axes`` over ``length`` steps: remembered
    by ``f``'s program (``f.jaxpr``, the body's slice ``Match.function`` read back; ``program_key``: its text and
    constants, bit for bit), for the process. The same loop's body is read back afresh at each snapshot, in each of
    a step's pipelines (its forward, its joint, the two again without the ``jointly`` rules), and traced lifted
    each time a match of it is tried: flax_lm_step traced 4 programs 22 times, 0.10 s of its 3.7 s
    (``tests/test_rewrite_time_paths.py`` counts the traces)."""
    closed = getattr(f, "jaxpr", None)
    program = None if closed is None else program_key(closed)
    if program is None:
        return trace_at(lifted_fn, avals)
    key = (program, in_axes, length, tuple(avals), _config())
    traced = _LIFTED.get(key)
    if traced is None:
        traced = trace_at(lifted_fn, avals)
        _LIFTED.put(key, traced)
    return traced


#: :func:`_lifted_trace`'s traces, by the body's program, ``in_axes``, length, avals and JAX's config; the oldest of
#: more than 64 dropped
_LIFTED = _Traces(size=64)


def _loops_again(traced: Any, length: int) -> bool:
    """Whether ``vmap(f)`` is itself a loop over the same steps: a ``pure_callback`` with
    ``vmap_method="sequential"`` is batched as ``lax.map``. Lifted, it is the loop it was lifted from, with a
    callback object of its own, which the rule would lift again at each iteration until the limit."""
    return any(e.primitive.name == "scan" and e.params.get("length") == length for e in traced.jaxpr.eqns)


def _holds_more(traced: Any, outs: list[Any], stacked: list[bool]) -> bool:
    """Whether ``traced`` (a closed jaxpr returning ``outs``) holds an array, in its bodies too, :data:`LIFT_HOLDS`
    times its stacked inputs (``stacked``, one flag an input) and ``outs`` together, and at least :data:`LIFT_BYTES`."""
    held = max((nbytes(v.aval) for e in equations(traced) for v in e.outvars), default=0)
    return _too_large(held, [a for a, s in zip(traced.in_avals, stacked) if s], outs)


def _too_large(held: int, read: list[Any], outs: list[Any]) -> bool:
    """Whether an array of ``held`` bytes is :data:`LIFT_HOLDS` times the stacked arrays ``read`` and ``outs`` (avals)
    together, and at least :data:`LIFT_BYTES`: what :func:`lift_independent` declines."""
    return held >= LIFT_BYTES and held > LIFT_HOLDS * sum(nbytes(a) for a in (*read, *outs))


def _batched_bytes(f: Any, in_axes: tuple, length: int) -> int:
    """A lower bound of the largest array ``vmap(f, in_axes)`` over ``length`` steps holds, from ``f``'s own program
    (``f.jaxpr``; 0 without one), not traced: an equation of it without bodies that reads a mapped value
    (an input at axis 0, or what such an equation made) is mapped too, its result ``length`` times as large. An
    equation with bodies (``custom_vjp``, ``checkpoint``, ``jit``) neither counts nor passes the mapping on: vmap
    may leave some of its results unmapped."""
    closed = getattr(f, "jaxpr", None)
    if closed is None:
        return 0
    mapped = {v for v, a in zip(closed.jaxpr.invars, in_axes) if a is not None}
    held = 0
    for e in closed.jaxpr.eqns:
        nested = next(jaxprs_in_params(e.params), None) is not None
        if nested or not any(isinstance(v, Var) and v in mapped for v in e.invars):
            continue
        mapped.update(e.outvars)
        held = max([held] + [nbytes(v.aval) * length for v in e.outvars])
    return held


# ---------------------------------------------------------------------- fori_loop buffers
def buffer_to_output(m) -> Any:
    """A carried buffer whose row ``i`` a counted loop sets each step -> a stacked output of the loop.

    ``fori_loop`` bodies store each step's value with ``buf.at[i].set(v)``
    (a ``scatter``) or ``dynamic_update_slice(buf, v[None], (i, 0, ...))``,
    where ``i`` is a counter carry (a known start, plus one per step). When
    nothing else in the loop reads the buffer and the rows written are
    distinct and in range (read off by evaluating the index at every step),
    the copy of the loop stacks ``v`` instead, and the buffer is its initial
    value with those rows replaced (the stacked output itself when every row
    is written in order). Then the other rules treat it as any stacked output.
    """
    loop = Loop(m)
    if _after(loop, "buffers"):
        return None
    counters = loop.counters()
    if loop.length < 1 or not counters:
        return None
    found = []
    for k in range(loop.num_carry):
        if k not in counters:
            with loop.attempt():
                found.append((k, *_buffer_rows(loop, k, counters)))
    if not found:
        return None
    outs = [(k, loop.add_output(step), rows) for k, step, rows in found]
    res = loop.build(drop_carries=[k for k, _, _ in found], _rw_buffered=True)
    pairs = loop.handover(res)
    finals = {k: _written(m, loop.args[loop.num_consts + k], loop.output_result(res, j), rows) for k, j, rows in outs}
    return pairs + [(v, finals[i]) for v, i in loop.outputs() if i in finals]


def _buffer_rows(loop: Loop, k: int, counters: dict[int, int]) -> tuple[Any, np.ndarray]:
    """Carry ``k`` as a buffer: the body value written each step, and the row it lands in, per stacked row."""
    m, T = loop.m, loop.length
    buf, buf_in = loop.args[loop.num_consts + k], loop.input(loop.num_consts + k)
    if buf.ndim == 0:
        raise Decline("not a buffer")
    for node in loop.body.outs[k].nodes:
        ops = node.operands
        if not ops or ops[0].cls != buf_in.cls:
            continue
        if node.prim == "dynamic_update_slice" and ops[1].shape == (1,) + buf.shape[1:]:
            update, index, rest = ops[1], ops[2], ops[3:]
            step = m.trace(lambda u: lax.squeeze(u, (0,)), update)
        elif node.prim == "scatter" and _sets_one_row(node.params, buf.ndim) and ops[1].shape == (1,) \
                and ops[2].shape == buf.shape[1:]:
            update, index, rest, step = ops[2], ops[1], [], ops[2]
        else:
            continue
        others = [loop.input(p) for p in range(len(loop.args)) if p != loop.num_consts + k]
        keep = [o for j, o in enumerate(loop.body.outs) if j != k] + [update, index, *rest]
        if m.function(keep, others) is None:
            raise Decline("the loop reads the buffer otherwise")
        for c, start in counters.items():
            at = m.function([index, *rest], [loop.input(loop.num_consts + c)])
            if at is None or _calls_back(at):
                continue
            steps = np.arange(start, start + T, dtype=loop.args[loop.num_consts + c].dtype)
            text = _text_of(at)
            key = None if text is None else ("rows", text, _value_key(steps))
            # in NumPy where the index's program is elementwise and broadcasts (a counter, its wrap below 0): XLA's
            # compile of lax.map(at) was 28-39 ms of a fori_loop's first rewrite (loops_fori)
            now = None if text is None else evaluated(at.jaxpr, [steps], batch=(T,))
            values = [np.asarray(v).reshape(T, -1)
                      for v in (now or _compute_now(lambda s, at=at: lax.map(at, s), steps, key=key))]
            if any(np.any(v != 0) for v in values[1:]):
                raise Decline("the write is not at a whole row")
            rows = values[0][:, 0].astype(np.int64)
            if loop.reverse:  # stacked row p is written at step T - 1 - p
                rows = rows[::-1]
            if len(set(rows.tolist())) != T or rows.min() < 0 or rows.max() >= buf.shape[0]:
                raise Decline("rows written twice or out of range")
            return step, rows
    raise Decline("no row write of a counter")


def _compute_now(fn: Callable, *args: Any, key: Any = None) -> Any:
    """``fn(*args)`` computed now, also while a rewrite runs inside an outer trace (``jit(grad(rewrite(f)))``).

    With a ``key`` (what the value depends on: the jaxpr it runs, as text, and the arguments), ``fn`` is compiled
    whole and run once (a ``Compiled`` call binds nothing in an outer trace), and the value kept by the key for
    the process (:data:`_NOW`): one by one, each operation compiled apart in a process's first rewrite, and a later
    rewrite of the same loop asks nothing of XLA. Without one, it is evaluated an operation at a time."""
    if key is not None:
        key = (key, jax.config.jax_enable_x64)
        if key in _NOW:
            return _NOW[key]
        return _NOW.keep(key, jax.tree.map(np.asarray, jax.jit(fn).lower(*args).compile()(*args)))
    with jax.ensure_compile_time_eval():
        return jax.tree.map(np.asarray, fn(*args))


#: :func:`_compute_now`'s values, by their keys
_NOW = Memo("rulesets.scan._NOW")


def _calls_back(fn: Any) -> bool:
    """Would computing a function read back from the e-graph now call into Python or have an effect? It is not
    computed then: the rewriter never runs a program's callback (``rewrite.cache.fingerprint.CALLBACKS``)."""
    return bool(fn.jaxpr.effects) or any(e.primitive.name in CALLBACKS for e in equations(fn.jaxpr))


def _text_of(fn: Any) -> str | None:
    """The text of the jaxpr a function read back from the e-graph runs (``Match.function``), where that text
    says all it computes (no constants held apart); else ``None``."""
    closed = getattr(fn, "jaxpr", None)
    return None if closed is None or closed.consts else str(closed.jaxpr)


def _value_key(v: Any) -> tuple:
    a = np.asarray(v)
    return a.dtype.str, a.shape, a.tobytes()


def _sets_one_row(params: dict, ndim: int) -> bool:
    dn = params["dimension_numbers"]
    return (params.get("update_jaxpr") is None and tuple(dn.update_window_dims) == tuple(range(ndim - 1))
            and tuple(dn.inserted_window_dims) == (0,) and tuple(dn.scatter_dims_to_operand_dims) == (0,)
            and not tuple(dn.operand_batching_dims) and not tuple(dn.scatter_indices_batching_dims))


def _written(m, init: Any, ys: Any, rows: np.ndarray) -> Any:
    """``init`` with row ``rows[p]`` replaced by ``ys[p]``."""
    r0, n = int(rows[0]), init.shape[0]
    if np.array_equal(rows, np.arange(r0, r0 + len(rows))):
        if r0 == 0 and len(rows) == n:
            return ys
        return m.trace(lambda b, y: lax.dynamic_update_slice(b, y, (r0,) + (0,) * (b.ndim - 1)), init, ys)
    return m.trace(lambda b, y: b.at[rows].set(y, unique_indices=True), init, ys)


#: The params a scan built from a ``while`` takes besides its body, length and input counts.
_SCAN_PARAMS = {k: v for k, v in scan_counted(jax.make_jaxpr(lambda c: lax.scan(lambda c, _: (c, None), c, None,
    length=1))(0.0).eqns[0].params).items() if k not in ("jaxpr", "length", "num_consts", "num_carry")}


def while_to_scan(m) -> Any:
    """``while`` whose condition reads only a counter carry and constants -> a ``scan`` of the trip count.

    The trip count is found by evaluating the condition at the counter's
    values, step by step (up to 2^20 steps), unless it calls back into Python
    or has an effect; the scan runs the same body as many times, so
    the loop's results are exactly the same. ``lax.fori_loop`` with bounds
    that are not Python ints writes such loops.
    """
    wp, args = m.params("wp"), m.list("args")
    cond, body = m.body("cb"), m.body("bb")
    cnc, bnc = int(wp["cond_nconsts"]), int(wp["body_nconsts"])
    carries = args[cnc + bnc:]
    cond_in = [m.param(cond.scope, i, a.aval) for i, a in enumerate(args[:cnc] + carries)]
    test = m.function([cond.outs[0]], cond_in)
    if test is None or _calls_back(test):
        return None
    used = [i for i, u in enumerate(test.uses) if u]
    fixed = {i: args[i].constant for i in used if i < cnc}
    counted = [i - cnc for i in used if i >= cnc]
    if any(v is None for v in fixed.values()) or len(counted) != 1:
        return None
    (k,) = counted
    start = carries[k].constant
    me = m.param(body.scope, bnc + k, carries[k].aval)
    if start is None or carries[k].ndim or not np.issubdtype(carries[k].dtype, np.integer) \
            or not adds_one(body.outs[k], me):
        return None
    cap, i0 = 1 << 20, np.asarray(start, carries[k].dtype)
    vals = [fixed[i] if i < cnc else None for i in range(len(cond_in))]

    def at(i):
        return test(*[i if j == cnc + k else (v if v is not None else jnp.zeros(cond_in[j].shape, cond_in[j].dtype))
                      for j, v in enumerate(vals)])[0]

    def steps(i0):  # the loop's own steps, one at a time: a condition's primitive may refuse a batch (equinox's)
        one = np.ones((), i0.dtype)
        return lax.while_loop(lambda c: (c[0] < cap) & at(c[1]), lambda c: (c[0] + 1, c[1] + one), (0, i0))[0]

    text = _text_of(test)
    key = None if text is None else ("steps", text, cnc + k, int(start), i0.dtype.str, cap, tuple(
        None if j == cnc + k else ("zeros", cond_in[j].shape, np.dtype(cond_in[j].dtype).str) if v is None
        else _value_key(v) for j, v in enumerate(vals)))
    trip = int(_compute_now(steps, i0, key=key))
    if trip < 1 or trip >= cap:
        return None
    params = dict(_SCAN_PARAMS, length=trip, num_consts=bnc, num_carry=len(carries), _rw_order=tuple(range(bnc + len(carries))))
    if "linear" in params:
        params["linear"] = (False,) * (bnc + len(carries))
    w = m["w"]
    res = m.node("scan", args[cnc:], params, list(w.aval), bodies=[Body(body.scope, body.outs)])
    return [(user, res[node.args[1]]) for user, node in m.users(w) if node.ctor == "Proj"]


# ---------------------------------------------------------------------- the pack
def _mse_of_loop(h0, xs, y):
    """Where ``hoist_reductions`` applies: a mean squared error over a loop's stacked outputs, and the loop's final
    carry, which the rewritten loop computes too (so that a wrong carry is compared)."""
    h, ys = lax.scan(lambda h, x: (jnp.tanh(h + x), h * x), h0, xs)
    return jnp.mean((ys - y) ** 2), h


def _loop_into_loop(c0, xs, w):
    """Where ``sink_inputs`` applies: one loop's outputs, combined elementwise, feed a second loop."""
    _, (a, b) = lax.scan(lambda c, x: (jnp.tanh(c * w + x), (c * 2.0 + x, x * w)), c0, xs)
    return lax.scan(lambda c, z: (c * 0.5 + z * c, jnp.sum(z * c)), c0, a * w + b)


def _seed(x1, x2, y):
    """Where ``lift_independent`` applies: the seed's loop, whose stacked output never reads the carry."""
    return jnp.square(y - lax.scan(lambda c, x: (jnp.sin(c), jnp.cos(x)), x1, x2)[1]).mean()


def _fori_buffer(x):
    """Where ``buffer_to_output`` applies: a ``fori_loop`` storing each step's value in row ``i`` of a buffer."""
    buf = jnp.zeros((8,) + x.shape, x.dtype)
    _, buf = lax.fori_loop(0, 8, lambda i, c: (jnp.tanh(c[0]), c[1].at[i].set(c[0] * 2.0)), (x, buf))
    return jnp.sum(buf ** 2)


def _counted_while(x, n):
    """Where ``while_to_scan`` applies: a counted loop whose bound is a constant of the program."""
    return lax.while_loop(lambda c: c[0] < 6, lambda c: (c[0] + 1, jnp.sin(c[1]) + n), (0, x))[1]


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
             example_program=(_mse_of_loop, (f32(64), f32(16, 64), f32(16, 64)))),
    ], soundness="identity", tolerance=TOLERANCE,
        description="reductions of a scan's stacked outputs, computed inside the loop")
    sink = Ruleset("sink", [
        rule(SCAN, procedural(sink_inputs), name="sink_inputs",  # xs = f(a, b) stacked outside -> f(a[t], b[t]) inside
             example_program=(_loop_into_loop, (f32(8, 64), f32(16, 8, 64), f32()))),
    ], soundness="identity", tolerance=TOLERANCE,
        description="inputs of a scan computed inside it from what they are made of")
    lift = Ruleset("lift", [
        rule(SCAN, procedural(lift_independent), name="lift_independent",  # ys[t] = f(c, xs[t]) -> vmap(f)(c, xs)
             example_program=(_seed, (f32(10, 5, 8), f32(30, 15, 12), f32(30, 15, 12)))),
    ], soundness="identity", tolerance=TOLERANCE,
        description="per-step outputs that never read the carry, computed outside the loop at once")
    buffers = Ruleset("buffers", [
        rule(WHILE, procedural(while_to_scan), name="while_to_scan",  # while(i < n) with i += 1 -> scan(length=n - i0)
             example_program=(_counted_while, (f32(4), f32()))),
        rule(SCAN, procedural(buffer_to_output), name="buffer_to_output",  # carry buf.at[i].set(v) -> stacked v
             example_program=(_fori_buffer, (f32(5),))),
    ], soundness="exact", description="counted loops as scans, and buffers they write row by row as stacked outputs")
    return Ruleset("scan", [hoist, sink, lift, buffers], soundness="identity", tolerance=TOLERANCE,
                   description="move reductions into scans and carry-independent work out of them")


scan = make()
hoist, sink, lift, buffers = scan.hoist, scan.sink, scan.lift, scan.buffers
