"""Loop rules' implementation: :class:`Loop` and its helpers, public as :mod:`rewrite.loops` (whose page says how a
loop rule reads and rebuilds a scan)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from jax import lax

from ..ir import primitives as _primitives
from ..ir.jaxapi import core
from ..ir.loopstep import Decline
from .match import Body, Match, Node, Value
from .pattern import Pat

__all__ = ["SCAN", "WHILE", "Body", "Decline", "Loop", "adds_one", "is_pointwise", "stacked_aval", "step_aval"]

#: The pattern a loop rule matches: any scan. Its bindings (``s``, ``b``, ``args``, ``sp``) are what :class:`Loop` reads.
SCAN = Pat("scan", name="s", body="b", args="args", params="sp")
#: The pattern of a ``while`` loop: ``cb`` and ``bb`` bind its condition and body, ``args`` its operands (the
#: condition's constants, the body's constants, then the carries), ``wp`` its params.
WHILE = Pat("while", name="w", bodies=["cb", "bb"], args="args", params="wp")

_POINTWISE = (_primitives.ELEMENTWISE, _primitives.TRANSCENDENTAL)

#: What ``recompute="cheap"`` may rebuild in a loop: arithmetic and layout, no transcendentals, contractions or loops.
CHEAP = frozenset(spec.prim for spec in _primitives.SPECS if spec.family in (_primitives.ELEMENTWISE, _primitives.LAYOUT))


def step_aval(aval: Any, axis: int = 0) -> Any:
    """The aval of one step's slice of an array stacked along ``axis``, as ``lax.scan`` types it.

    >>> from jax.core import ShapedArray
    >>> import numpy as np
    >>> step_aval(ShapedArray((5, 3), np.float32)).shape
    (3,)
    """
    return core.mapped_aval(aval.shape[axis], axis, aval)


def stacked_aval(aval: Any, length: int) -> Any:
    """The aval of ``length`` steps of ``aval`` stacked along a new leading axis.

    >>> from jax.core import ShapedArray
    >>> import numpy as np
    >>> stacked_aval(ShapedArray((3,), np.float32), 5).shape
    (5, 3)
    """
    return core.unmapped_aval(length, 0, aval)


def is_pointwise(node: Node) -> bool:
    """Whether ``node`` applies its operation element by element (arithmetic, comparisons, ``exp``...).

    >>> from rewrite.loops import is_pointwise
    >>> callable(is_pointwise)
    True
    """
    return node.spec is not None and node.spec.family in _POINTWISE


def _moves(node: Node) -> Callable[..., Value] | None:
    """How step ``t`` of ``node``'s value is built in a loop body: its primitive record's ``loop_step`` hook
    (``rewrite/ir/loopstep.py``), or ``None`` where its work cannot move into a loop."""
    return node.spec.loop_step if node.spec is not None else None


def adds_one(v: Value, of: Value) -> bool:
    """Whether the e-graph knows ``v`` as ``of + 1`` (a loop counter's next value).

    >>> from rewrite.loops import adds_one
    >>> callable(adds_one)
    True
    """
    for n in v.nodes:
        if n.prim == "add" and len(n.operands) == 2:
            a, b = n.operands
            if (a.cls == of.cls and b.literal == 1) or (b.cls == of.cls and a.literal == 1):
                return True
    return False


def _key(v: Value) -> Any:
    """What names ``v`` in a rule's memo: its class, or for a term built during the rule (no class yet) its name."""
    return v.cls if v.cls is not None else ("new", v.name)


class _Reach:
    """Does a class depend on the loop? Such a value cannot feed the loop's copy."""

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


class Loop:
    """One matched scan, and a copy of it being built. See the module docstring.

    ``Loop(m)`` reads the bindings of :data:`SCAN`; a rule with another
    pattern names its bindings: ``Loop(m, scan="s", body="b", args="args", params="sp")``.
    """

    def __init__(self, m: Match, scan: str = "s", body: str = "b", args: str = "args", params: str = "sp") -> None:
        self.m = m
        self.scan = m[scan]
        self.params = m.params(params)
        self.length = int(self.params["length"])
        self.reverse = bool(self.params.get("reverse", False))
        self.num_carry = int(self.params["num_carry"])
        self.num_consts = int(self.params["num_consts"])
        self.body = m.body(body)
        self.args = m.list(args)
        self.scope = self.body.scope
        self._order = tuple(self.params["_rw_order"])
        self._consts: list[tuple[int, Value]] = []         # (body input index, outer value)
        self._carries: list[tuple[int, Value, Value]] = []  # (index, initial value, next value)
        self._xs: list[tuple[int, Value]] = []
        self._ys: list[Value] = []                          # per-step values of new stacked outputs
        self._inputs: dict[Any, Value] = {}                 # outer class -> the body input it became
        self._memo: dict[Any, Value] = {}                   # (outer class, axis) -> its step value
        #: (outer class, axis, what the walk may read) -> the Decline it met. A walk that declines does so
        #: whatever the copy holds so far, so unlike ``_memo`` this survives an undone :meth:`attempt`;
        #: without it every alternative node of every class above a dead end walks down to it again,
        #: which grows exponentially with the e-graph's depth of equivalent forms.
        self._declined: dict[Any, Decline] = {}
        self._cycles = 0                                    # cycles met so far: a decline that met one is not kept
        self._context: Any = None                           # what the current per_step walk may read
        #: Positions of old ``xs`` inputs that what was added reads (a rule dropping inputs keeps these).
        self.needed: set[int] = set()
        #: Whether :meth:`per_step` may rebuild another loop's stacked output here: ``None``, ``"cheap"`` or ``"all"``.
        self.recompute: str | None = None
        #: Outer classes that :meth:`per_step` must not take in as they are (as a new ``xs`` input).
        self.no_leaf: set[Any] = set()
        self.depends_on_loop = _Reach(self.scan.cls)
        self._input_names: set[Any] = set()

    # ------------------------------------------------------------------ reading the loop
    def outputs(self) -> list[tuple[Value, int]]:
        """Every output of the loop that the e-graph holds: (its value, which output; carries come first)."""
        return [(user, node.args[1]) for user, node in self.m.users(self.scan) if node.ctor == "Proj"]

    def stacked(self) -> dict[Any, int]:
        """Class of each stacked output (``ys``) of the loop -> its output index."""
        return {v.cls: i for v, i in self.outputs() if i >= self.num_carry}

    def input(self, position: int) -> Value:
        """The body input at jaxpr position ``position`` (consts, carries, xs), as the body sees it."""
        arg = self.args[position]
        aval = arg.aval if position < self.num_consts + self.num_carry else step_aval(arg.aval)
        return self._seen_input(self.m.param(self.scope, self._order[position], aval))

    def is_input(self, v: Value) -> bool:
        """Whether ``v`` is a body input, old or added: nothing was computed to get it."""
        return v.name in self._input_names

    def _seen_input(self, v: Value) -> Value:
        self._input_names.add(v.name)
        return v

    def counters(self) -> dict[int, int]:
        """Carries that count steps: carry number -> its value at the first step (a known integer).

        A counter starts at a constant and its next value is itself plus one,
        as ``fori_loop`` writes it; at step ``j`` (in the order the loop runs,
        which for a reverse loop is not row order) it holds ``start + j``.
        """
        found = {}
        for k in range(self.num_carry):
            init = self.args[self.num_consts + k]
            start = init.constant
            if start is None or init.ndim or not np.issubdtype(init.dtype, np.integer):
                continue
            if adds_one(self.body.outs[k], self.input(self.num_consts + k)):
                found[k] = int(start)
        return found

    def consumers(self, limit: int = 256) -> list[tuple[Value, Node]]:
        """Uses of the stacked outputs reached through work that :meth:`per_step` can move into the loop.

        Each is (the class a node computes, the node); a rule picks those it
        acts on (reductions, say) and moves their operands in with
        :meth:`per_step`. The walk passes through pointwise ops, broadcasts,
        ``dot_general``, reshapes, transposes and reductions of values that
        still have an axis of the loop's length.
        """
        T = self.length
        frontier = [v for v, i in self.outputs() if i >= self.num_carry]
        seen = {v.cls for v in frontier}
        found: dict[Any, tuple[Value, Node]] = {}
        while frontier and len(seen) < limit:
            v = frontier.pop()
            for parent, node in self.m.users(v):
                if node.ctor in ("Proj", "Scan") or node.spec is None or not parent.is_array:
                    continue
                found.setdefault((parent.cls, node.ctor, node.pid), (parent, node))
                if T in parent.shape and parent.cls not in seen and _moves(node) is not None:
                    seen.add(parent.cls)
                    frontier.append(parent)
        return list(found.values())

    # ------------------------------------------------------------------ adding to the copy
    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Undo what the block added if it raises :class:`Decline` (which it swallows)."""
        saved = (len(self._consts), len(self._carries), len(self._xs), len(self._ys), dict(self._inputs),
                 set(self.needed), dict(self._memo))
        try:
            yield
        except Decline as e:
            # its traceback holds the frames it came through, this match's among them; on Python 3.12 the
            # frame of the context manager's __exit__ is one, and it holds the exception: a cycle
            e.__traceback__ = None
            nc, ncar, nx, ny, inputs, needed, memo = saved
            del self._consts[nc:], self._carries[ncar:], self._xs[nx:], self._ys[ny:]
            self._inputs, self.needed, self._memo = inputs, needed, memo

    def add_const(self, outer: Value) -> Value:
        """``outer`` (the same at every step) as a body input: an existing constant of the loop, or a new one."""
        found = self._inputs.get(_key(outer))
        if found is not None:
            return found
        for j in range(self.num_consts):
            if self.args[j].cls == outer.cls and self.args[j].aval == outer.aval:
                found = self.input(j)
                break
        else:
            i = self.m.fresh_index(self.scope)
            found = self._seen_input(self.m.param(self.scope, i, outer.aval))
            self._consts.append((i, outer))
        self._inputs[_key(outer)] = found
        return found

    def add_xs(self, outer: Value) -> Value:
        """``outer`` (stacked along the loop's axis) as a per-step body input: an existing ``xs`` or a new one."""
        key = ("xs", _key(outer))
        found = self._inputs.get(key)
        if found is not None:
            return found
        for j in range(self.num_consts + self.num_carry, len(self.args)):
            if self.args[j].cls == outer.cls and self.args[j].aval == outer.aval:
                found = self.input(j)
                self.needed.add(j)
                break
        else:
            i = self.m.fresh_index(self.scope)
            found = self._seen_input(self.m.param(self.scope, i, step_aval(outer.aval)))
            self._xs.append((i, outer))
        self._inputs[key] = found
        return found

    def add_carry(self, init: Value) -> tuple[int, Value]:
        """A new carry starting at ``init``: its number (for :meth:`set_carry_next`) and its body input."""
        i = self.m.fresh_index(self.scope)
        p = self.m.param(self.scope, i, init.aval)
        self._carries.append((i, init, p))
        return len(self._carries) - 1, p

    def set_carry_next(self, j: int, nxt: Value) -> None:
        """The body value that new carry ``j`` takes for the next step."""
        i, init, _ = self._carries[j]
        self._carries[j] = (i, init, nxt)

    def add_output(self, step: Value) -> int:
        """A new stacked output whose row ``t`` is the body value ``step``; its number (for :meth:`output_result`)."""
        self._ys.append(step)
        return len(self._ys) - 1

    def invariant(self, v: Value, squeeze: int | None = None) -> Value:
        """``v``, the same at every step, as a body value; ``squeeze`` drops that axis (of size 1) first."""
        if v.literal is not None and v.ndim == 0:
            return v  # literals belong to no scope
        if self.depends_on_loop(v):
            raise Decline("a loop-invariant operand depends on the loop")
        if squeeze is not None:
            v = self.m.trace(lambda a: lax.squeeze(a, (squeeze,)), v)
        return self.add_const(v)

    def per_step(self, v: Value, axis: int = 0, stacked: dict[Any, int] | None = None) -> Value:
        """Step ``t``'s slice (along ``axis``) of the outer value ``v``, computed in the body.

        The loop's own stacked outputs are read from the body; pointwise
        work, broadcasts, ``dot_general``, reshapes, transposes and
        reductions that keep the loop's axis move in, their loop-invariant
        operands (weights) becoming constants; any other value stacked along
        ``axis`` becomes a new ``xs`` input. ``stacked`` maps the classes of
        outputs to read from the body (default: all of the loop's stacked
        outputs). Raises :class:`Decline` when ``v`` cannot be built per step.
        """
        if stacked is None:
            stacked = self.stacked()
        saved = self._context
        self._context = (frozenset(stacked.items()), frozenset(self.no_leaf), self.recompute)
        try:
            return self._step(v, axis, stacked, set())
        finally:
            self._context = saved

    # ------------------------------------------------------------------ building the copy
    def build(self, drop: Sequence[int] = (), drop_xs: Sequence[int] = (), body_outs: Sequence[Value] | None = None,
              drop_carries: Sequence[int] = (), **annotations: Any) -> tuple[Value, ...]:
        """Insert the copy and return its results: the old outputs (less ``drop``), then what was added.

        ``drop_xs`` removes ``xs`` inputs (positions among the loop's operands), ``drop_carries``
        carries (numbers among the carries; nothing the copy computes may read them); ``body_outs``
        replaces the old body's outputs (they must not read the dropped inputs). ``annotations``
        (names starting with ``_rw_``) are params for rules to read, dropped when the program is
        emitted; a rule marks the loops it built with one so as not to act on them again.
        """
        ncon, nc, order, args = self.num_consts, self.num_carry, self._order, self.args
        old_outs = list(self.body.outs if body_outs is None else body_outs)
        c_idx = tuple(i for i, _ in self._consts)
        k_idx = tuple(i for i, _, _ in self._carries)
        x_idx = tuple(i for i, _ in self._xs)
        xs_kept = [j for j in range(ncon + nc, len(args)) if j not in set(drop_xs)]
        ck = [k for k in range(nc) if k not in set(drop_carries)]  # carries kept
        nk = len(ck)
        new_order = (order[:ncon] + c_idx + tuple(order[ncon + k] for k in ck) + k_idx
                     + tuple(order[j] for j in xs_kept) + x_idx)
        operands = (args[:ncon] + [v for _, v in self._consts] + [args[ncon + k] for k in ck]
                    + [v for _, v, _ in self._carries] + [args[j] for j in xs_kept] + [v for _, v in self._xs])
        old_avals = list(self.scan.aval)
        kept = [i for i in range(nc, len(old_avals)) if i not in set(drop)]
        outs = ([old_outs[k] for k in ck] + [n for _, _, n in self._carries] + [old_outs[i] for i in kept]
                + self._ys)
        avals = ([old_avals[k] for k in ck] + [v.aval for _, v, _ in self._carries] + [old_avals[i] for i in kept]
                 + [stacked_aval(y.aval, self.length) for y in self._ys])
        params = dict(self.params, num_consts=ncon + len(c_idx), num_carry=nk + len(k_idx), _rw_order=new_order,
                      **annotations)
        if "_rw_inplace" in self.params:  # the carries kept keep their body outputs; those added are priced whole
            params["_rw_inplace"] = tuple(self.params["_rw_inplace"][k] for k in ck) + (False,) * len(k_idx)
        # The loop's consts keep their positions, and the copy's body is the loop's own (the same scope): a const
        # the loop reads only through slices (rewrite/ir/scanread.py) is read so by the copy too, and its price
        # must not charge it whole every step where the loop's does not. Consts added here are priced whole.
        if "linear" in params:
            lin = tuple(params["linear"])
            params["linear"] = (lin[:ncon] + (False,) * len(c_idx) + tuple(lin[ncon + k] for k in ck)
                                + (False,) * len(k_idx) + tuple(lin[j] for j in xs_kept) + (False,) * len(x_idx))
        res = self.m.node("scan", operands, params, avals, bodies=[Body(self.scope, outs)])
        self._where = {k: n for n, k in enumerate(ck)}
        self._where.update({i: nk + len(k_idx) + n for n, i in enumerate(kept)})
        self._new_carries_at = nk
        return res

    def result(self, res: Sequence[Value], i: int) -> Value:
        """Old output ``i`` among the copy's results ``res``."""
        return res[self._where[i]]

    def carry_result(self, res: Sequence[Value], j: int) -> Value:
        """The final value of new carry ``j`` among the copy's results ``res``."""
        return res[self._new_carries_at + j]

    def output_result(self, res: Sequence[Value], k: int) -> Value:
        """New stacked output ``k`` among the copy's results ``res``."""
        return res[len(res) - len(self._ys) + k]

    def handover(self, res: Sequence[Value], drop: Sequence[int] = ()) -> list[tuple[Value, Value]]:
        """Unions that give every output of the old loop (not dropped, nor a dropped carry) to the copy."""
        return [(v, self.result(res, i)) for v, i in self.outputs() if i not in set(drop) and i in self._where]

    # ------------------------------------------------------------------ moving work in
    def _step(self, v: Value, axis: int, stacked: dict[Any, int], path: set) -> Value:
        key = (_key(v), axis)
        if key in self._memo:
            return self._memo[key]
        self.m.check_time()  # a walk over a large e-graph stops at the rule's deadline
        dead = (key, self._context)
        failed = self._declined.get(dead)
        if failed is not None:
            raise copy.copy(failed)  # a copy: the kept one never holds a traceback, whose frames hold this walk
        if key in path:
            self._cycles += 1
            raise Decline("cycle")
        path.add(key)
        cycles = self._cycles
        try:
            out = self._step_uncached(v, axis, stacked, path)
        except Decline as e:
            if self._cycles == cycles:  # a decline that met a cycle may hold on this path only
                self._declined[dead] = copy.copy(e)  # without e's traceback (a cycle through this walk's frames)
            raise
        finally:
            path.discard(key)
        self._memo[key] = out
        return out

    def _step_uncached(self, v: Value, axis: int, stacked: dict[Any, int], path: set) -> Value:
        m, T = self.m, self.length
        if v.cls in stacked:
            if axis != 0:
                raise Decline("a stacked output read along another axis")
            return self.body.outs[stacked[v.cls]]
        if v.ndim == 0:
            return self.invariant(v)
        if v.shape[axis] == 1 and T != 1:
            return self.invariant(v, squeeze=axis)
        if v.shape[axis] != T:
            raise Decline(f"{v} is not stacked along axis {axis}")
        for node in v.nodes:
            mover = _moves(node)
            if mover is None:
                continue
            try:
                return mover(self, node, v, axis, lambda x, a: self._step(x, a, stacked, path))
            except Decline:
                continue
        if self.recompute and axis == 0:
            for node in v.nodes:
                if node.ctor == "Proj":
                    found = self._recompute(node)
                    if found is not None:
                        return found
        if v.cls in self.no_leaf:
            raise Decline(f"{v} would only be read as it is")
        if self.depends_on_loop(v):
            raise Decline(f"{v} depends on the loop through an operation that cannot move into it")
        if axis != 0:
            v = m.trace(lambda a: lax.transpose(a, (axis,) + tuple(d for d in range(a.ndim) if d != axis)), v)
        return self.add_xs(v)

    def _recompute(self, proj: Node) -> Value | None:
        """Step ``t`` of another loop's stacked output, rebuilt in this loop's body, or ``None``.

        The other loop (same length) must compute it from its constants, its
        ``xs`` and its other stacked outputs that this loop already reads; never
        from its carry. Step ``t`` of every stacked array is row ``t``, whichever
        way either loop runs.
        """
        m = self.m
        (tup,) = proj.operands
        k = proj.args[1]
        f = next((n for n in tup.nodes if n.ctor == "Scan"), None)  # not an effectful one (an Effect: no body class)
        if f is None or self.depends_on_loop(tup):
            return None
        fp = f.params
        fnc, fncon = int(fp["num_carry"]), int(fp["num_consts"])
        if int(fp["length"]) != self.length or k < fnc:
            return None
        fbody = m.engine.body(f.args[0])
        fargs = f.operands
        forder = fp["_rw_order"]
        fparams = [m.param(fbody.scope, forder[p], fargs[p].aval if p < fncon + fnc else step_aval(fargs[p].aval))
                   for p in range(len(fargs))]
        read = {}  # other stacked outputs of that loop that this loop already reads: output index -> position
        for j in range(self.num_consts + self.num_carry, len(self.args)):
            for n in self.args[j].nodes:
                if n.ctor == "Proj" and n.args[0] == tup.cls and n.args[1] >= fnc and n.args[1] != k:
                    read.setdefault(n.args[1], j)
        inputs = fparams[:fncon] + fparams[fncon + fnc:] + [fbody.outs[i] for i in read]
        outer = ([(a, False) for a in fargs[:fncon]] + [(a, True) for a in fargs[fncon + fnc:]]
                 + [(self.args[j], True) for j in read.values()])
        g = m.function([fbody.outs[k]], inputs)
        if g is None:
            return None
        if self.recompute == "cheap" and any(e.primitive.name not in CHEAP for e in g.jaxpr.jaxpr.eqns):
            return None
        inputs = [v for v, u in zip(inputs, g.uses) if u]
        outer = [o for o, u in zip(outer, g.uses) if u]
        g = m.function([fbody.outs[k]], inputs)  # of what it reads, so nothing else is kept for it
        if g is None:
            return None
        try:
            values = [self.add_xs(a) if is_stacked else self.invariant(a) for a, is_stacked in outer]
        except Decline:
            return None
        return m.trace(lambda *a: g(*a)[0], *values)


