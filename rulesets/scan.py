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
>>> h0, xs, y = jnp.ones(64), jnp.ones((16, 64)), jnp.zeros((16, 64))
>>> fast = rewrite(loss, rulesets=[rulesets.scan])
>>> bool(jnp.allclose(fast(h0, xs, y), loss(h0, xs, y), rtol=1e-5))
True
>>> [e.primitive.name for e in fast.jaxpr(h0, xs, y).eqns]  # no stacked output, no reduction outside
['scan', 'div']
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core

from rewrite import Pat, Ruleset, Tolerance, _terms, procedural, rule
from rewrite._rules import Body, Match, Value

#: How far a rewrite of this pack may move a float32 result (see the module docstring).
TOLERANCE = Tolerance(rtol=2e-5, atol=1e-5)

#: Reductions that can run as a carry, with the binary op that accumulates them.
_ACCUMULATE: dict[str, Callable[[Any, Any], Any]] = {"reduce_sum": lax.add, "reduce_max": lax.max,
                                                       "reduce_min": lax.min}
_POINTWISE = (_terms.ELEMENTWISE, _terms.TRANSCENDENTAL)


class _Decline(Exception):
    """This match cannot be rewritten (the procedure returns None)."""


def _step_aval(aval: Any) -> Any:
    """The aval of one step's slice of a stacked array, as ``lax.scan`` types it."""
    return core.mapped_aval(aval.shape[0], 0, aval)


def _stacked_aval(aval: Any, length: int) -> Any:
    return core.unmapped_aval(length, 0, aval)


class _Loop:
    """One matched scan, and a copy of it being built: the inputs and outputs a rule adds.

    The copy shares the old body's scope: new inputs are fresh ``Param``s of
    that scope, inserted into ``_rw_order`` where ``lax.scan`` expects them
    (constants, then carries, then ``xs``), so the rest of the body is reused
    as it is.
    """

    def __init__(self, m: Match) -> None:
        self.m = m
        self.s = m["s"]
        self.sp = m.params("sp")
        self.length = int(self.sp["length"])
        self.nc = int(self.sp["num_carry"])
        self.ncon = int(self.sp["num_consts"])
        self.body = m.body("b")
        self.args = m.list("args")
        self.scope = self.body.scope
        self.order = tuple(self.sp["_rw_order"])
        self.consts: list[tuple[int, Value]] = []         # (body input index, outer value)
        self.carries: list[tuple[int, Value, Value]] = []  # (index, initial value, next value)
        self.xs: list[tuple[int, Value]] = []
        self.ys: list[Value] = []                          # per-step values of new stacked outputs
        self.inputs: dict[Any, Value] = {}                 # outer class -> the body input it became
        self.needed: set[int] = set()                      # positions of old xs inputs the additions read
        self.recompute: str | None = None                  # may rebuild other loops' outputs here: "cheap", "all"
        self.no_leaf: set[Any] = set()                     # outer classes that must not become xs inputs

    # ------------------------------------------------------------------ reading the loop
    def projections(self) -> list[tuple[Value, int]]:
        """Every projection of the old loop that the e-graph holds: (its class, which output)."""
        return [(user, node.args[1]) for user, node in self.m.users(self.s) if node.ctor == "Proj"]

    def stacked(self) -> dict[Any, int]:
        """Class of each stacked output (``ys``) of the old loop -> its output index."""
        return {v.cls: i for v, i in self.projections() if i >= self.nc}

    def param(self, position: int) -> Value:
        """The body input at jaxpr position ``position`` (consts, carries, xs), as the body sees it."""
        arg = self.args[position]
        aval = arg.aval if position < self.ncon + self.nc else _step_aval(arg.aval)
        return self.m.param(self.scope, self.order[position], aval)

    # ------------------------------------------------------------------ adding to the copy
    def state(self) -> tuple:
        return len(self.consts), len(self.carries), len(self.xs), len(self.ys), dict(self.inputs), set(self.needed)

    def restore(self, state: tuple) -> None:
        nc, ncar, nx, ny, inputs, needed = state
        del self.consts[nc:], self.carries[ncar:], self.xs[nx:], self.ys[ny:]
        self.inputs, self.needed = inputs, needed

    def const(self, outer: Value) -> Value:
        """``outer`` (loop-invariant) as a body input: an existing constant of the loop, or a new one."""
        found = self.inputs.get(outer.cls)
        if found is not None:
            return found
        for j in range(self.ncon):
            if self.args[j].cls == outer.cls and self.args[j].aval == outer.aval:
                found = self.param(j)
                break
        else:
            i = self.m.fresh_index(self.scope)
            found = self.m.param(self.scope, i, outer.aval)
            self.consts.append((i, outer))
        if outer.cls is not None:
            self.inputs[outer.cls] = found
        return found

    def xs_input(self, outer: Value) -> Value:
        """``outer`` (stacked along the loop's axis) as a per-step body input."""
        key = ("xs", outer.cls)
        found = self.inputs.get(key)
        if found is not None:
            return found
        for j in range(self.ncon + self.nc, len(self.args)):
            if self.args[j].cls == outer.cls and self.args[j].aval == outer.aval:
                found = self.param(j)
                self.needed.add(j)
                break
        else:
            i = self.m.fresh_index(self.scope)
            found = self.m.param(self.scope, i, _step_aval(outer.aval))
            self.xs.append((i, outer))
        self.inputs[key] = found
        return found

    def carry(self, init: Value) -> tuple[int, Value]:
        """A new carry starting at ``init``; returns its position among the new carries and its body input."""
        i = self.m.fresh_index(self.scope)
        p = self.m.param(self.scope, i, init.aval)
        self.carries.append((i, init, p))  # the next value is set by set_next
        return len(self.carries) - 1, p

    def set_next(self, j: int, nxt: Value) -> None:
        i, init, _ = self.carries[j]
        self.carries[j] = (i, init, nxt)

    # ------------------------------------------------------------------ building the copy
    def build(self, drop: Sequence[int] = (), drop_xs: Sequence[int] = (), body_outs: Sequence[Value] | None = None,
              **annotations: Any) -> tuple[tuple[Value, ...], Callable[[int], int]]:
        """Insert the copy: old outputs (less ``drop``), then what was added. Returns its results and
        a map from an old output index to the copy's.

        ``drop_xs`` removes ``xs`` inputs (positions among the loop's operands); ``body_outs``
        replaces the old body's outputs (it must not read the dropped inputs).
        """
        ncon, nc, order, args = self.ncon, self.nc, self.order, self.args
        old_outs = list(self.body.outs if body_outs is None else body_outs)
        c_idx = tuple(i for i, _ in self.consts)
        k_idx = tuple(i for i, _, _ in self.carries)
        x_idx = tuple(i for i, _ in self.xs)
        xs_kept = [j for j in range(ncon + nc, len(args)) if j not in set(drop_xs)]
        new_order = (order[:ncon] + c_idx + order[ncon:ncon + nc] + k_idx + tuple(order[j] for j in xs_kept)
                     + x_idx)
        operands = (args[:ncon] + [v for _, v in self.consts] + args[ncon:ncon + nc]
                    + [v for _, v, _ in self.carries] + [args[j] for j in xs_kept] + [v for _, v in self.xs])
        old_avals = list(self.s.aval)
        kept = [i for i in range(nc, len(old_avals)) if i not in set(drop)]
        outs = old_outs[:nc] + [n for _, _, n in self.carries] + [old_outs[i] for i in kept] + self.ys
        avals = (old_avals[:nc] + [v.aval for _, v, _ in self.carries] + [old_avals[i] for i in kept]
                 + [_stacked_aval(y.aval, self.length) for y in self.ys])
        params = dict(self.sp, num_consts=ncon + len(c_idx), num_carry=nc + len(k_idx), _rw_order=new_order,
                      **annotations)
        if "linear" in params:
            lin = tuple(params["linear"])
            params["linear"] = (lin[:ncon] + (False,) * len(c_idx) + lin[ncon:ncon + nc] + (False,) * len(k_idx)
                                + tuple(lin[j] for j in xs_kept) + (False,) * len(x_idx))
        res = self.m.node("scan", operands, params, avals, bodies=[Body(self.scope, outs)])
        where = {i: i for i in range(nc)}
        where.update({i: nc + len(k_idx) + n for n, i in enumerate(kept)})
        return res, where.__getitem__

    def handover(self, res: Sequence[Value], where: Callable[[int], int], drop: Sequence[int] = ()
                 ) -> list[tuple[Value, Value]]:
        """Unions that give every output of the old loop (not dropped) to the copy."""
        return [(v, res[where(i)]) for v, i in self.projections() if i not in set(drop)]


# ---------------------------------------------------------------------- hoisting reductions
class _Reach:
    """Does a class depend on the old loop? Such a value cannot feed the loop's copy."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.memo: dict[Any, bool] = {}

    def __call__(self, v: Value) -> bool:
        stack, seen, found = [v], set(), False
        while stack and not found:
            x = stack.pop()
            if x.cls is None or x.cls in seen:
                continue
            if x.cls == self.target or self.memo.get(x.cls):
                found = True
                break
            if self.memo.get(x.cls) is False:
                continue
            seen.add(x.cls)
            for n in x.nodes:
                stack.extend(n.operands)
        if not found:
            for c in seen:
                self.memo[c] = False
        else:
            self.memo[v.cls] = True
        return found


def _pointwise(node: Any) -> bool:
    return node.spec is not None and node.spec.family in _POINTWISE


def _step_value(loop: _Loop, v: Value, stacked: dict[Any, int], reach: _Reach, memo: dict, path: set) -> Value:
    """Step ``t``'s slice of the outer value ``v`` (stacked along the loop axis), built in the body."""
    if v.cls in memo:
        return memo[v.cls]
    if v.cls in path:
        raise _Decline("cycle")
    path.add(v.cls)
    try:
        out = _step_value_uncached(loop, v, stacked, reach, memo, path)
    finally:
        path.discard(v.cls)
    memo[v.cls] = out
    return out


def _invariant(loop: _Loop, v: Value, reach: _Reach, squeeze: bool) -> Value:
    """``v``, the same at every step, as a body value; ``squeeze`` drops its leading axis (of size 1)."""
    if v.literal is not None and v.ndim == 0:
        return v  # literals belong to no scope
    if reach(v):
        raise _Decline("a loop-invariant operand depends on the loop")
    if squeeze:
        v = loop.m.trace(lambda a: lax.squeeze(a, (0,)), v)
    return loop.const(v)


def _step_value_uncached(loop: _Loop, v: Value, stacked: dict[Any, int], reach: _Reach, memo: dict,
                         path: set) -> Value:
    m, T = loop.m, loop.length
    if v.cls in stacked:
        return loop.body.outs[stacked[v.cls]]
    if v.ndim == 0 or (v.shape[0] == 1 and T != 1):
        return _invariant(loop, v, reach, squeeze=v.ndim > 0)
    if v.shape[0] != T:
        raise _Decline(f"{v} is not stacked along the loop axis")
    for node in v.nodes:
        try:
            if _pointwise(node):
                ops = [_step_value(loop, o, stacked, reach, memo, path) for o in node.operands]
                prim, params = node.primitive, node.params
                return m.trace(lambda *a: prim.bind(*a, **params), *ops)
            if node.prim == "broadcast_in_dim":
                (x,) = node.operands
                shape, dims = node.params["shape"], tuple(node.params["broadcast_dimensions"])
                rest = {k: val for k, val in node.params.items() if k not in ("shape", "broadcast_dimensions")}
                if rest.get("sharding") is not None:
                    continue
                on_axis = bool(dims) and dims[0] == 0  # the operand's first axis is the loop axis
                if on_axis and x.shape[0] == T and T != 1:
                    inner = _step_value(loop, x, stacked, reach, memo, path)
                else:  # the operand does not vary along the loop axis
                    inner = _invariant(loop, x, reach, squeeze=on_axis)
                step_dims = tuple(d - 1 for d in (dims[1:] if on_axis else dims))
                return m.trace(lambda a: lax.broadcast_in_dim(a, tuple(shape[1:]), step_dims), inner)
        except _Decline:
            continue
    if loop.recompute:
        for node in v.nodes:
            if node.ctor == "Proj":
                found = _recompute(loop, node, reach)
                if found is not None:
                    return found
    if v.cls in loop.no_leaf:
        raise _Decline(f"{v} would only be read as it is")
    if reach(v):
        raise _Decline(f"{v} depends on the loop through an operation that cannot move into it")
    return loop.xs_input(v)


def _recompute(loop: _Loop, proj: Any, reach: _Reach) -> Value | None:
    """Step ``t`` of another loop's stacked output, rebuilt in this loop's body, or ``None``.

    The other loop (same length) must compute it from its constants, its
    ``xs`` and its other stacked outputs that this loop already reads; never
    from its carry. Step ``t`` of every stacked array is row ``t``, whichever
    way either loop runs.
    """
    m = loop.m
    (tup,) = proj.operands
    k = proj.args[1]
    f = tup.node("scan")
    if f is None or reach(tup):
        return None
    fp = f.params
    fnc, fncon = int(fp["num_carry"]), int(fp["num_consts"])
    if int(fp["length"]) != loop.length or k < fnc:
        return None
    fbody = m.engine.body(f.args[0])
    fargs = f.operands
    forder = fp["_rw_order"]
    fparams = [m.param(fbody.scope, forder[p], fargs[p].aval if p < fncon + fnc else _step_aval(fargs[p].aval))
               for p in range(len(fargs))]
    read = {}  # other stacked outputs of that loop that this loop already reads: output index -> position
    for j in range(loop.ncon + loop.nc, len(loop.args)):
        for n in loop.args[j].nodes:
            if n.ctor == "Proj" and n.args[0] == tup.cls and n.args[1] >= fnc and n.args[1] != k:
                read.setdefault(n.args[1], j)
    inputs = fparams[:fncon] + fparams[fncon + fnc:] + [fbody.outs[i] for i in read]
    outer = ([(a, False) for a in fargs[:fncon]] + [(a, True) for a in fargs[fncon + fnc:]]
             + [(loop.args[j], True) for j in read.values()])
    g = m.function([fbody.outs[k]], inputs)
    if g is None:
        return None
    if loop.recompute == "cheap" and any(_CHEAP.get(e.primitive.name) is None for e in g.jaxpr.jaxpr.eqns):
        return None
    inputs = [v for v, u in zip(inputs, g.uses) if u]
    outer = [o for o, u in zip(outer, g.uses) if u]
    g = m.function([fbody.outs[k]], inputs)  # of what it reads, so nothing else is kept for it
    if g is None:
        return None
    try:
        values = [loop.xs_input(a) if stacked else _invariant(loop, a, reach, squeeze=False) for a, stacked in outer]
    except _Decline:
        return None
    return m.trace(lambda *a: g(*a)[0], *values)


#: What "cheap" recomputation may contain: arithmetic and layout, no transcendentals, contractions or loops.
_CHEAP = {spec.prim: True for spec in _terms.SPECS if spec.family in (_terms.ELEMENTWISE, _terms.LAYOUT)}


def _identity(prim: str, dtype: Any) -> Any:
    if prim == "reduce_sum":
        return 0
    if jnp.issubdtype(dtype, jnp.floating):
        return -np.inf if prim == "reduce_max" else np.inf
    info = jnp.iinfo(dtype)
    return info.min if prim == "reduce_max" else info.max


def _reductions(loop: _Loop, stacked: dict[Any, int], limit: int = 256) -> list[tuple[Value, Any]]:
    """Reductions reached from the stacked outputs through pointwise ops and broadcasts: (class, node)."""
    m, T = loop.m, loop.length
    frontier = [v for v, i in loop.projections() if i >= loop.nc]
    seen = {v.cls for v in frontier}
    found: dict[Any, tuple[Value, Any]] = {}
    while frontier and len(seen) < limit:
        v = frontier.pop()
        for parent, node in m.users(v):
            if node.prim in _ACCUMULATE:
                if parent.cls not in found:
                    found[parent.cls] = (parent, node)
            elif (_pointwise(node) or node.prim == "broadcast_in_dim") and parent.ndim and parent.shape[0] == T:
                if parent.cls not in seen:
                    seen.add(parent.cls)
                    frontier.append(parent)
    return list(found.values())


def hoist_reductions(m: Match, remat: str | None = "carries") -> Any:
    """``reduce(f(ys, ...))`` over a scan's stacked ``ys`` -> the reduction computed in a copy of the loop.

    Over the scan axis, an accumulator carry; over other axes only, a new
    per-step output. ``f`` is any chain of pointwise ops and broadcasts; its
    other operands become ``xs`` inputs (stacked along the scan axis) or loop
    constants. Every reduction of the loop's outputs moves into one copy,
    whose body is checkpointed for autodiff with the policy ``remat``.
    """
    loop = _Loop(m)
    if loop.sp.get("_rw_hoisted"):
        return None  # a loop this rule built: its own reductions are already inside
    stacked = loop.stacked()
    if not stacked:
        return None
    reach = _Reach(loop.s.cls)
    memo: dict[Any, Value] = {}
    results: list[tuple[Value, Callable[[Sequence[Value]], Value]]] = []
    for root, node in _reductions(loop, stacked):
        saved, saved_memo = loop.state(), dict(memo)
        try:
            results.append((root, _hoist_one(loop, root, node, stacked, reach, memo)))
        except _Decline:
            loop.restore(saved)
            memo = saved_memo
    if not results:
        return None
    res, where = loop.build(_rw_hoisted=True, **({"_rw_remat": remat} if remat else {}))
    pairs = loop.handover(res, where)
    for root, read in results:
        out = read(res)
        if out.aval != root.aval:
            return None
        pairs.append((root, out))
    return pairs


def _hoist_one(loop: _Loop, root: Value, node: Any, stacked: dict[Any, int], reach: _Reach, memo: dict
               ) -> Callable[[Sequence[Value]], Value]:
    """Move one reduction into the loop; returns how to read its result from the copy's results."""
    m = loop.m
    (operand,) = node.operands
    axes = tuple(node.params["axes"])
    if operand.ndim == 0 or operand.shape[0] != loop.length:
        raise _Decline("not a reduction of a stacked value")
    dtype = root.dtype
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise _Decline(f"accumulating {dtype} is not supported")
    prim, params = node.primitive, node.params
    step = _step_value(loop, operand, stacked, reach, memo, set())
    inner = tuple(a - 1 for a in axes if a != 0)
    if inner:
        step = m.trace(lambda e: prim.bind(e, **dict(params, axes=inner)), step)
    if 0 not in axes:  # each step emits its reduced slice
        loop.ys.append(step)
        k = len(loop.ys) - 1
        return lambda res: res[len(res) - len(loop.ys) + k]
    # An accumulator. Narrow floats accumulate in float32 and round once at the end.
    acc_dtype = np.dtype(np.float32) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 else dtype
    if acc_dtype != dtype:
        step = m.trace(lambda e: e.astype(acc_dtype), step)
    ident = _identity(node.prim, acc_dtype)
    init = m.trace(lambda: lax.full(root.shape, ident, acc_dtype))
    if init.aval != step.aval:
        raise _Decline(f"accumulator {init.aval} does not match the step's {step.aval}")
    j, acc = loop.carry(init)
    loop.set_next(j, m.trace(_ACCUMULATE[node.prim], acc, step))

    def read(res: Sequence[Value]) -> Value:
        final = res[loop.nc + j]
        return final if acc_dtype == dtype else m.trace(lambda a: a.astype(dtype), final)

    return read


# ---------------------------------------------------------------------- computing inputs inside the loop
def sink_inputs(m: Match) -> Any:
    """``xs`` input ``z = f(a, b, ...)`` of a scan, stacked outside -> ``z[t] = f(a[t], b[t], ...)`` inside.

    ``f`` is a chain of pointwise ops and broadcasts over arrays stacked along
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
    pairs: list[tuple[Value, Value]] = []
    seen: set = set()
    for recompute in (None, "cheap", "all"):
        found = _sink(m, recompute, depth)
        if found is not None and found[0] not in seen:
            seen.add(found[0])
            pairs += found[1]
    return pairs or None


def _sink(m: Match, recompute: str | None, depth: int) -> tuple[Any, list[tuple[Value, Value]]] | None:
    loop = _Loop(m)
    if not loop.projections():
        return None  # nothing reads this loop (a backward loop whose results are all dropped, say)
    loop.recompute = recompute
    reach = _Reach(loop.s.cls)
    memo: dict[Any, Value] = {}
    inside: dict[int, Value] = {}
    for j in range(loop.ncon + loop.nc, len(loop.args)):
        z = loop.args[j]
        saved, saved_memo = loop.state(), dict(memo)
        loop.no_leaf = {z.cls}
        try:
            inside[j] = _step_value(loop, z, {}, reach, memo, set())
        except _Decline:
            loop.restore(saved)
            memo = saved_memo
    loop.no_leaf = set()
    drop = {j: v for j, v in inside.items() if j not in loop.needed}
    if not drop:
        return None
    params = [loop.param(p) for p in range(len(loop.args))]
    body = m.function(loop.body.outs, params)
    if body is None:
        return None
    outs = m.trace(lambda *a: tuple(body(*a)), *[drop.get(p, params[p]) for p in range(len(loop.args))])
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    res, where = loop.build(drop_xs=tuple(drop), body_outs=outs, _rw_sunk=depth + 1)
    return tuple(v.name for v in res), loop.handover(res, where)


# ---------------------------------------------------------------------- lifting carry-independent outputs
def lift_independent(m: Match) -> Any:
    """Stacked ``y_t = f(consts, x_t)`` that never reads the carry -> ``vmap(f)(consts, xs)`` outside the loop.

    The copy of the loop no longer computes or stacks ``y``; when nothing
    else of the loop is used, the loop disappears.
    """
    loop = _Loop(m)
    used = sorted({i for _, i in loop.projections() if i >= loop.nc})
    if not used:
        return None
    ncon, nc = loop.ncon, loop.nc
    positions = list(range(ncon)) + list(range(ncon + nc, len(loop.args)))
    inputs = [loop.param(p) for p in positions]
    outer = [loop.args[p] for p in positions]
    in_axes = tuple(None if p < ncon else 0 for p in positions)
    lifted: dict[int, Value] = {}
    for k in used:
        f = m.function([loop.body.outs[k]], inputs)
        if f is None:
            continue
        batched = jax.vmap(lambda *a, f=f: f(*a)[0], in_axes=in_axes, axis_size=loop.length)
        y = m.trace(batched, *outer)
        if y.aval == loop.s.aval[k]:
            lifted[k] = y
    if not lifted:
        return None
    res, where = loop.build(drop=tuple(lifted))
    return loop.handover(res, where, drop=tuple(lifted)) + [
        (v, lifted[i]) for v, i in loop.projections() if i in lifted]


# ---------------------------------------------------------------------- the pack
_SCAN = Pat("scan", name="s", body="b", args="args", params="sp")


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
        rule(_SCAN, procedural(lambda m: hoist_reductions(m, remat)), name="hoist_reductions",  # reduce(f(ys, xs, c)) -> carry acc / per-step output
             example=(_mse_of_loop, (_f32(64), _f32(16, 64), _f32(16, 64)))),
    ], soundness="identity", tolerance=TOLERANCE,
        description="reductions of a scan's stacked outputs, computed inside the loop")
    sink = Ruleset("sink", [
        rule(_SCAN, procedural(sink_inputs), name="sink_inputs",  # xs = f(a, b) stacked outside -> f(a[t], b[t]) inside
             example=(_loop_into_loop, (_f32(8, 64), _f32(16, 8, 64), _f32()))),
    ], soundness="identity", tolerance=TOLERANCE,
        description="inputs of a scan computed inside it from what they are made of")
    lift = Ruleset("lift", [
        rule(_SCAN, procedural(lift_independent), name="lift_independent",  # ys[t] = f(c, xs[t]) -> vmap(f)(c, xs)
             example=(_seed, (_f32(10, 5, 8), _f32(30, 15, 12), _f32(30, 15, 12)))),
    ], soundness="identity", tolerance=TOLERANCE,
        description="per-step outputs that never read the carry, computed outside the loop at once")
    return Ruleset("scan", [hoist, sink, lift], soundness="identity", tolerance=TOLERANCE,
                   description="move reductions into scans and carry-independent work out of them")


scan = make()
hoist, sink, lift = scan.hoist, scan.sink, scan.lift
