"""What XLA will actually run: a whole program's cost after fusion, predicted from its structure.

A node-by-node cost cannot see fusion. XLA compiles elementwise chains into
one loop per *materialised* value, and the cost of a program is the cost of
those loops: the arithmetic each does (an operation duplicated into two
loops is paid twice) plus the bytes each reads and writes. Whether a value
is materialised or recomputed depends on all of its consumers, so it is a
property of the chosen program, not of a node. This module replays the
decisions XLA:CPU's fusion passes make (``cpu_instruction_fusion.cc``,
``instruction_fusion.cc`` and the library reduction fusion), on a jaxpr or on
an extractor's choice:

* Cheap elementwise operations (``IsExpensive`` is false: ``mul``, ``add``,
  ``select_n``, broadcasts, and, for real numbers, ``sin``, ``cos``,
  ``tan``) are duplicated into every loop that reads them.
* Expensive ones (``exp``, ``log``, ``tanh``, float ``div``, ``sqrt``, ...)
  read by more than one loop are computed once and stored.
* An operation whose inputs are larger than its output and that some
  consumer cannot absorb is stored, not duplicated
  (``ComputeGloballyUnfusible``).
* A floating ``reduce_sum``/``reduce_max``/``reduce_min`` of 4096 elements
  or more becomes a library (YNN) reduction that absorbs only plain
  arithmetic (``mul``, ``add``, ``sub``, ``neg``, broadcasts) that it alone
  reads; a transcendental feeding it is computed in a loop of its own and
  stored, even when another loop recomputes it. This is why JAX's VJP of
  ``sin(a*x)**2/a`` evaluates ``sin(a*x)`` twice. (Smaller reductions are
  loop fusions that absorb anything, and fuse into their one consumer loop;
  XLA may also merge sibling ones, which the model does not.)
* ``sin`` and ``cos`` of one argument in one loop cost about one of them
  (LLVM merges them into ``sincos``).

Costs are nanoseconds per element and per byte from
``benchmarks/calibrate.py``. The prediction is a model: ``cost_model="measure"``
times the best candidates on the real backend instead.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, Callable, Container, Iterable, Mapping, Sequence

import numpy as np

from ..ir import terms as _terms
from ..ir.primitives import NodeInfo, inner_jaxpr, is_float as _is_float, spec_of
from ..ir.walk import operands, postorder

# What XLA:CPU does with each primitive (expensive, cheap, what a library reduction absorbs) lives in its
# record (rewrite/ir/primitives.py), which the functions below read.
#: Smaller reductions stay ordinary loop fusions (measured: 2048 elements do, 4096 do not).
LIBRARY_MIN_ELEMENTS = 4096

LEAF, VIEW, LOOP, LIBRARY, REDUCE, OTHER = "leaf", "view", "loop", "library", "reduce", "other"
#: The weight of the node-by-node price that breaks ties between programs that fuse alike.
TIEBREAK = 1e-3


@dataclasses.dataclass
class Op:
    """One operation of a program, as the fusion model sees it."""

    prim: str
    family: str
    params: Mapping[str, Any]
    args: tuple[int, ...]
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    #: For ops the model does not fuse (dots, loops, opaque calls): their cost from the node model.
    own: float = 0.0
    #: The class (or variable) this op computes, for reading the decisions back.
    key: Any = None
    #: Facts about the op that do not depend on the program around it (its kind, its tie-break price),
    #: shared by every program an extraction builds with this node: a search prices hundreds of them.
    memo: dict | None = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class Program:
    """Operations in topological order, and which of them the program returns."""

    ops: list[Op]
    outputs: list[int]

    @classmethod
    def from_jaxpr(cls, closed: Any, node_cost: Callable[[Any], float] | None = None) -> "Program":
        """The top-level equations of a ``ClosedJaxpr`` (bodies are costed whole by ``node_cost``).

        Equal equations are one operation, as after XLA's common-subexpression
        elimination: ``sin(a*x) * cos(a*x)`` traces ``a*x`` twice, and XLA
        computes it once, and the two functions of it as one ``sincos``.
        """
        from jax._src import core

        from ..ir.intern import PARAMS

        ops: list[Op] = []
        env: dict[Any, int] = {}
        seen: dict[tuple, int] = {}

        lits: dict[tuple, int] = {}

        def read(atom: Any) -> int:
            if isinstance(atom, core.Literal):
                key = (repr(atom.val), str(atom.aval))
                if key not in lits:
                    ops.append(Op("literal", _terms.SPECIAL, {}, (), (), (atom.aval,)))
                    lits[key] = len(ops) - 1
                return lits[key]
            return env[atom]

        jaxpr = closed.jaxpr
        for v in list(jaxpr.constvars) + list(jaxpr.invars):
            ops.append(Op("param", _terms.SPECIAL, {}, (), (), (v.aval,), key=v))
            env[v] = len(ops) - 1
        for eqn in jaxpr.eqns:
            args = tuple(read(a) for a in eqn.invars)
            if not eqn.effects and len(eqn.outvars) == 1:
                key = (PARAMS.intern_params(eqn.primitive, eqn.params), args)
                if key in seen:
                    env[eqn.outvars[0]] = seen[key]
                    continue
                seen[key] = len(ops)
            family = _terms.family_of(eqn.primitive.name)
            outs = tuple(v.aval for v in eqn.outvars)
            op = Op(eqn.primitive.name, family, eqn.params, args, tuple(a.aval for a in eqn.invars), outs, key=eqn)
            if _kind_of(op) == OTHER and node_cost is not None:
                op.own = float(node_cost(NodeInfo(op.prim, family, eqn.params, op.in_avals, outs)))
            ops.append(op)
            tup = len(ops) - 1
            if len(eqn.outvars) == 1:
                env[eqn.outvars[0]] = tup
            else:
                for i, v in enumerate(eqn.outvars):
                    ops.append(Op("proj", _terms.SPECIAL, {}, (tup,), (), (v.aval,), key=i))
                    env[v] = len(ops) - 1
        outputs = [read(a) for a in jaxpr.outvars]
        return cls(ops, outputs)


    @classmethod
    def from_choice(cls, ex: Any, choice: Mapping[Any, tuple], roots: Sequence[Any],
                    own: Callable[[Any, tuple], float], cache: dict | None = None,
                    inputs: frozenset | set = frozenset()) -> "Program":
        """The program an extractor's ``choice`` makes at ``roots`` (its own scope; bodies costed by ``own``).

        Classes in ``inputs`` are the program's inputs: read, not computed.
        """
        cache = {} if cache is None else cache
        index: dict[Any, int] = {}
        ops: list[Op] = []
        snap = ex.snap
        reads = getattr(ex, "operands", None) or (lambda node: operands(snap, node))
        order = list(postorder(list(roots), lambda c: () if c in inputs else reads(choice[c])))
        for c in order:
            if c in inputs:
                index[c] = len(ops)
                ops.append(Op("param", _terms.SPECIAL, {}, (), (), (ex.snap.aval(c),), key=c))
                continue
            node = choice[c]
            index[c] = len(ops)
            ops.append(chosen_op(ex, c, node, choice, own, cache, tuple(index[k] for k in reads(node))))
        return cls(ops, [index[r] for r in roots])


def chosen_op(ex: Any, c: Any, node: tuple, choice: Mapping[Any, tuple], own: Callable[[Any, tuple], float],
              cache: dict, args: tuple) -> Op:
    """The op class ``c`` computes with ``node``, reading ``args``; its facts are kept in ``cache`` per node."""
    key = (c, node)
    tmpl = cache.get(key)
    if tmpl is None:
        tmpl = _template(ex, c, node, choice, own)
        if "inner" not in tmpl[6]:  # a fused call's body may differ between choices: not kept
            cache[key] = tmpl
    prim, family, params, in_avals, out_avals, own_cost, memo = tmpl
    return Op(prim, family, params, args, in_avals, out_avals, own_cost, key=c, memo=memo)


_LEAF_CTORS = _terms.LEAVES


def _template(ex: Any, c: Any, node: tuple, choice: Mapping[Any, tuple], own: Callable[[Any, tuple], float]) -> tuple:
    ctor, args = node
    if ctor in _LEAF_CTORS:
        return _LEAF_CTORS[ctor], _terms.SPECIAL, {}, (), (ex.snap.aval(c),), 0.0, {}
    if ctor == "Proj":
        # What the node model charges a projection: a loop's stacked output is written (and,
        # with ``stacked``, held); fusion has no say in that, so it is added as it is.
        return "proj", _terms.SPECIAL, {}, (), (ex.snap.aval(c),), float(own(c, node)), {}
    info = ex.info(c, ctor, args, choice)
    op = Op(info.op, info.family, info.params, (), info.in_avals, info.out_avals)
    inner = _inlined_body(ex, ctor, args, choice, own) if len(info.out_avals) == 1 else None
    if inner is not None:
        return info.op, info.family, info.params, info.in_avals, info.out_avals, 0.0, {"kind": LOOP, "inner": inner}
    cost = float(own(c, node)) if _kind_of(op) == OTHER else 0.0
    return info.op, info.family, info.params, info.in_avals, info.out_avals, cost, {}


def _inlined_body(ex: Any, ctor: str, args: tuple, choice: Mapping[Any, tuple],
                  own: Callable[[Any, tuple], float]) -> tuple["Op", ...] | None:
    """The chosen body of a call XLA inlines (``OpSpec.inlined``), when every operation in it is elementwise.

    Such a call fuses like one elementwise operation (its price: its body's), not as a kernel boundary.
    """
    spec = _terms.BY_CTOR.get(ctor)
    if spec is None or not spec.inlined:
        return None
    bodies = ex.body_classes(ctor, args)
    if len(bodies) != 1:
        return None
    outs = ex.snap.list_items(choice[bodies[0]][1][1])
    if len(outs) != 1:
        return None
    body = Program.from_choice(ex, choice, outs, own)
    if not all(_kind(op) in (LEAF, LOOP) for op in body.ops):
        return None
    return tuple(op for op in body.ops if _kind(op) == LOOP)


def _nbytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        return int(math.prod(shape)) * np.dtype(dtype).itemsize
    except TypeError:
        return 0


def _add_sincos(cost: float, model: Any, ops: Sequence[Any], sincos: dict) -> float:
    """``cost`` plus the transcendentals of ``sincos`` (argument -> which of sin and cos a kernel takes of
    it): both of one argument are one ``sincos`` call. Added one by one, in order, so that the whole and the
    live price (``LiveFusion._kernel``) sum them alike."""
    for arg, which in sincos.items():
        elems = _size(ops[arg].out_avals[0])
        if len(which) == 2:
            cost += elems * model.ns.get("sincos", model.ns.get("sin", model.default) * 1.3)
        else:
            cost += elems * model.ns.get(next(iter(which)), model.default)
    return cost


def _size(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    return 0 if shape is None else int(math.prod(shape))


def _true_rank(aval: Any) -> int:
    return sum(1 for d in getattr(aval, "shape", ()) if d != 1)


def elementwise_call(op: Op) -> bool:
    """A call XLA inlines whose body is elementwise only: it fuses like one elementwise operation."""
    if len(op.out_avals) != 1 or not (op.family == _terms.OPAQUE or spec_of(op.prim).inlined):
        return False
    j = inner_jaxpr(op.params)
    if j is None:
        return False
    return all(_elementwise_eqn(e) for e in j.eqns)


def _elementwise_eqn(e: Any) -> bool:
    spec = _terms.BY_PRIM.get(e.primitive.name)
    if spec is not None and not spec.inlined:
        return spec.fusion == "loop"
    j = inner_jaxpr(e.params)
    return j is not None and len(e.outvars) == 1 and all(_elementwise_eqn(x) for x in j.eqns)


def _kind_of(op: Op) -> str:
    if op.prim in ("param", "literal", "const", "token"):
        return LEAF
    if op.prim == "proj":
        return VIEW
    spec = spec_of(op.prim)
    if spec.fusion == "loop" or elementwise_call(op):
        return LOOP
    if op.family == _terms.REDUCE:
        if (spec.library_reduction and op.in_avals and _is_float(op.in_avals[0])
                and _size(op.in_avals[0]) >= LIBRARY_MIN_ELEMENTS):
            return LIBRARY
        return REDUCE
    return OTHER


def _kind(op: Op) -> str:
    """``_kind_of(op)``, remembered in the op's memo when it has one."""
    memo = op.memo
    if memo is None:
        return _kind_of(op)
    found = memo.get("kind")
    if found is None:
        found = memo["kind"] = _kind_of(op)
    return found


def _scaled_by_small(prog: "Program", op: Op) -> bool:
    """``x / b`` with ``b`` smaller than the result: XLA multiplies by the reciprocal of ``b`` instead."""
    return (op.prim == "div" and len(op.args) == 2
            and _size(prog.ops[op.args[1]].out_avals[0]) < _size(op.out_avals[0]))


def _expensive(op: Op, prog: "Program | None" = None) -> bool:
    if prog is not None and _scaled_by_small(prog, op):
        return False
    return spec_of(op.prim).is_expensive(op.params, op.out_avals)


def _library_ok(prog: "Program", i: int) -> bool:
    op = prog.ops[i]
    return spec_of(op.prim).library_absorbs(op.params, op.out_avals) or _scaled_by_small(prog, op)


@dataclasses.dataclass
class Fusion:
    """One kernel the model predicts: its root, what it computes, reads and writes, and its cost."""

    root: int
    kind: str
    computes: list[int]
    reads: list[int]
    cost: float


class FusionModel:
    """Price whole programs the way XLA:CPU fuses them. See the module docstring.

    ``ns`` maps a primitive to nanoseconds per element inside a fused loop
    (``"sincos"`` prices a ``sin`` and ``cos`` of one argument in one loop);
    ``byte`` is nanoseconds per byte a kernel reads or writes, ``reduce`` per
    element a reduction adds up, ``library_op`` per element of each
    operation a library reduction runs (it works tile by tile, one operation
    at a time, so a broadcast or a multiply there costs a pass over a
    tile), ``launch`` per kernel, ``default`` the
    price of a transcendental missing from ``ns`` and ``cheap`` of any other
    elementwise primitive. ``node`` is charged per operation evaluated, so
    that of two programs XLA runs alike the one with fewer equations wins,
    and ``tiebreak`` (a node price, weighted by ``TIEBREAK``) so that of two
    programs that fuse alike the one a node-by-node model prefers wins
    (``x * (1/3)`` over ``x / 3``, which XLA compiles to the same loop).
    ``memory`` is charged per byte of :func:`peak_temp_bytes`.
    """

    def __init__(self, ns: Mapping[str, float], *, byte: float, reduce: float, launch: float, default: float,
                 cheap: float, node: float = 0.0, library_op: float | None = None,
                 tiebreak: Callable[[Op], float] | None = None, memory: float = 0.0) -> None:
        self.ns = dict(ns)
        self.memory = memory
        self.node = node
        self.library_op = library_op
        self.tiebreak = tiebreak
        self.byte = byte
        self.reduce = reduce
        self.launch = launch
        self.default = default
        self.cheap = cheap

    # ------------------------------------------------------------------ fusion decisions
    def fuse(self, prog: Program) -> tuple[dict[int, set[int]], dict[int, str]]:
        """Which kernels compute each op (``homes``), and the kind of each kernel root."""
        ops = prog.ops
        users: list[list[int]] = [[] for _ in ops]
        for i, op in enumerate(ops):
            for a in set(op.args):
                users[a].append(i)
        outputs = set(prog.outputs)
        homes: dict[int, set[int]] = {}
        roots: dict[int, str] = {}
        for i in range(len(ops) - 1, -1, -1):
            kind = _kind(ops[i])
            if kind in (LEAF, VIEW):
                continue
            need: set[int] = set()
            for u in users[i]:
                need |= homes.get(u, set())
            home, root = self.place(prog, i, kind, need, i in outputs, roots)
            if home is not None:
                homes[i] = home
            if root is not None:
                roots[i] = root
        return homes, roots

    def place(self, prog: Any, i: Any, kind: str, need: set, output: bool, roots: Mapping[Any, str]
              ) -> tuple[set | None, str | None]:
        """Where op ``i`` (of ``kind``, not a leaf or view) is computed, given the kernels that read it.

        ``need`` holds the kernels (their roots) that read ``i``, ``roots`` every kernel's kind. Returns
        the kernels that compute ``i`` (``None``: dead) and, if ``i`` roots a kernel of its own, that
        kernel's kind. One decision of :meth:`fuse`, shared with :class:`LiveFusion`.
        """
        if kind == REDUCE and not output:
            # A small reduction is a loop XLA can fuse into its one consumer loop (never duplicated).
            if not need:
                return None, None
            if len(need) == 1 and roots[next(iter(need))] in (LOOP, REDUCE):
                return need, None
        if kind != LOOP:
            return {i}, kind
        if not need and not output:
            return None, None  # every reader is dead
        accept = {r for r in need if self._absorbs(roots[r], prog, i, len(need))}
        if output or not need:
            return {i}, LOOP
        if len(need) > 1 and _expensive(prog.ops[i], prog):
            return {i}, LOOP
        if len(accept) < len(need):
            if self._duplicable(prog, i):
                return accept | {i}, LOOP  # stored for some, recomputed by the rest
            return {i}, LOOP
        return accept, None

    @staticmethod
    def _absorbs(root_kind: str, prog: Program, i: int, readers: int) -> bool:
        """Can a kernel of this kind compute op ``i`` itself? (``readers``: how many kernels need it.)"""
        if root_kind in (LOOP, REDUCE):
            return True
        if root_kind == LIBRARY:
            # A library reduction takes plain arithmetic it alone reads; it never duplicates.
            return readers == 1 and _library_ok(prog, i)
        return False

    @staticmethod
    def _duplicable(prog: Program, i: int) -> bool:
        """XLA's test for duplicating a producer that some consumer cannot absorb."""
        op = prog.ops[i]
        out_rank = max((_true_rank(a) for a in op.out_avals), default=0)
        large = 0
        in_elems = 0
        for a in set(op.args):
            src = prog.ops[a]
            aval = src.out_avals[0] if src.out_avals else None
            in_elems += _size(aval)
            if src.prim in ("literal", "iota", "broadcast_in_dim"):
                continue
            if _true_rank(aval) >= out_rank:
                large += 1
        if large <= 1 or op.prim == "broadcast_in_dim":
            return True
        return in_elems <= sum(_size(a) for a in op.out_avals)

    # ------------------------------------------------------------------ prices
    def op_ns(self, op: Op, prog: Program | None = None) -> float:
        """Nanoseconds per element of one op inside a fused loop."""
        spec = spec_of(op.prim)
        if spec.free or op.prim == "literal":
            return 0.0
        if spec.unrolled is not None:
            muls, divs = spec.unrolled(op.params)
            return muls * self.cheap + divs * self.ns.get("div", self.cheap)
        if spec.cheap or (prog is not None and _scaled_by_small(prog, op)):
            return self.cheap
        inner = op.memo.get("inner") if op.memo else None
        if inner is not None:  # a call fused as its chosen body
            return sum(self.op_ns(o) + self.node for o in inner)
        if op.family == _terms.OPAQUE or spec.inlined:
            return self._inner_ns(inner_jaxpr(op.params))
        found = self.ns.get(op.prim)
        if found is not None:
            return found
        return self.default if op.family == _terms.TRANSCENDENTAL or _expensive(op) else self.cheap

    def _inner_ns(self, jaxpr: Any) -> float:
        total = 0.0
        for e in jaxpr.eqns:
            spec = _terms.spec_of(e.primitive.name)
            inner = inner_jaxpr(e.params)
            if (spec is _terms.DEFAULT or spec.inlined) and inner is not None:
                total += self._inner_ns(inner)
                continue
            op = Op(e.primitive.name, spec.family, e.params, (),
                    tuple(v.aval for v in e.invars), tuple(v.aval for v in e.outvars))
            total += self.op_ns(op) + self.node
        return total

    def kernels(self, prog: Program) -> list[Fusion]:
        """The kernels the program compiles to, each with its predicted cost."""
        homes, roots = self.fuse(prog)
        members: dict[int, list[int]] = {r: [] for r in roots}
        for i, hs in homes.items():
            for r in hs:
                if r in members:
                    members[r].append(i)
        out = []
        for r, kind in roots.items():
            comp = members[r]
            cost, reads = self.kernel(prog, r, kind, comp)
            out.append(Fusion(r, kind, sorted(comp), sorted(reads), cost))
        return out

    def kernel(self, prog: Any, r: Any, kind: str, comp: Iterable[Any]) -> tuple[float, set]:
        """The cost of the kernel rooted at ``r`` that computes ``comp``, and the ops it reads."""
        ops = prog.ops
        root_op = ops[r]
        if kind == OTHER:
            return root_op.own + self.launch + self.node, set(root_op.args)
        inside = comp if isinstance(comp, (set, frozenset)) else set(comp)
        reads: set = set()
        facts = self._facts
        for i in inside:
            for a in ops[i].args:
                if a in inside:
                    continue
                if ops[a].prim == "literal":
                    continue
                reads.add(a)
        cost = self.launch + self.node * len(inside)
        if self.tiebreak is not None:
            cost += TIEBREAK * sum(facts(ops[i], prog)[1] for i in comp)
        sincos: dict[Any, set[str]] = {}
        # Each op's share: its reduction, its pass in a library reduction, or its elementwise work.
        share = 4 if kind == LIBRARY and self.library_op is not None else 5
        for i in comp:
            f = facts(ops[i], prog)
            if f[2]:
                sincos.setdefault(ops[i].args[0], set()).add(ops[i].prim)
                continue
            cost += f[3] if (i == r and kind in (LIBRARY, REDUCE)) or f[7] else f[share]
        cost = _add_sincos(cost, self, ops, sincos)
        cost += self.byte * (sum(facts(ops[a], prog)[6] for a in reads if ops[a].out_avals)
                             + facts(root_op, prog)[8])
        return cost, reads

    def _facts(self, op: Op, prog: Any) -> tuple:
        """What :meth:`kernel` reads of an op, kept in its memo (per model): nothing (a place kept), its
        tie-break price, whether it is a ``sin``/``cos``, its share of a kernel's cost as a reduction, as a
        pass of a library reduction and as elementwise work, the bytes of its first output, whether it is a
        reduction, the bytes of all its outputs. (Of the program they read only the sizes of the op's
        arguments, which its node fixes: an op's facts are the same in every program of one extraction,
        though its arguments' positions are not.)"""
        memo = op.memo
        if memo is None:
            memo = op.memo = {}
        key = ("facts", id(self))
        found = memo.get(key)
        if found is not None:
            return found
        ins, outs = op.in_avals, op.out_avals
        kind = _kind(op)
        found = memo[key] = (None,
                 self._tiebreak(op) if self.tiebreak is not None else 0.0,
                 op.prim in ("sin", "cos") and bool(op.args),
                 _size(ins[0]) * self.reduce if ins else 0.0,
                 _size(outs[0]) * self.library_op if self.library_op is not None and outs else 0.0,
                 _size(outs[0]) * self.op_ns(op, prog) if outs and kind == LOOP else 0.0,  # only loops fuse others
                 _nbytes(outs[0]) if outs else 0,
                 kind == REDUCE,
                 _out_bytes(op))
        return found

    def _tiebreak(self, op: Op) -> float:
        memo = op.memo
        if memo is None:
            return self.tiebreak(op)  # type: ignore[misc]
        key = ("tiebreak", id(self))  # one memo may meet two models (a search and a report, say)
        found = memo.get(key)
        if found is None:
            found = memo[key] = self.tiebreak(op)  # type: ignore[misc]
        return found

    def __call__(self, prog: Program) -> float:
        views = sum(op.own for op in prog.ops if op.prim == "proj")  # loops' stacked outputs
        kernels = self.kernels(prog)
        cost = sum(k.cost for k in kernels) + views
        if self.memory:
            cost += self.memory * peak_temp_bytes(prog, kernels)
        return float(cost)

    def describe(self, prog: Program) -> str:
        """One line per predicted kernel: what it computes and what it costs (for reports and tests)."""
        lines = []
        for k in sorted(self.kernels(prog), key=lambda k: k.root):
            names = [prog.ops[i].prim for i in k.computes]
            lines.append(f"{k.kind:8s} {prog.ops[k.root].prim:14s} {k.cost:12.1f}  computes {' '.join(names)}; "
                         f"reads {len(k.reads)}")
        return "\n".join(lines)


class LiveFusion:
    """The kernels of a program kept up to date as its ops change, for searches that price many close programs.

    The program is keyed by e-class: an op's ``args`` are the keys of the ops
    it reads, and ``outputs`` the keys it returns. :meth:`edit` adds, replaces
    and removes ops. Where an op is computed depends only on the kernels that
    read it (:meth:`FusionModel.place`), so an edit places again only the ops
    below it, readers before producers (each op's *height* is above every
    op it reads), and stops where a placement comes out as before; only
    the kernels whose members, or whose members' inputs, changed are priced
    again. :meth:`price` is ``model(program)`` of the same program, up to
    the order of the sums.

    >>> import jax.numpy as jnp
    >>> from jax import core
    >>> v = core.ShapedArray((1024,), jnp.float32)
    >>> fm = FusionModel({"exp": 2.0}, byte=0.1, reduce=0.5, launch=100.0, default=3.0, cheap=0.25)
    >>> live = LiveFusion(fm, ["y"])
    >>> live.edit({"x": Op("param", _terms.SPECIAL, {}, (), (), (v,)),
    ...            "e": Op("exp", _terms.TRANSCENDENTAL, {}, ("x",), (v,), (v,)),
    ...            "y": Op("mul", _terms.ELEMENTWISE, {}, ("e", "e"), (v, v), (v,))})
    >>> prog = Program([Op("param", _terms.SPECIAL, {}, (), (), (v,)),
    ...                 Op("exp", _terms.TRANSCENDENTAL, {}, (0,), (v,), (v,)),
    ...                 Op("mul", _terms.ELEMENTWISE, {}, (1, 1), (v, v), (v,))], [2])
    >>> live.price() == fm(prog)
    True
    """

    def __init__(self, model: FusionModel, outputs: Sequence[Any]) -> None:
        self.model = model
        self.ops: dict[Any, Op] = {}
        self.outputs = list(outputs)
        self._outputs = set(outputs)
        #: the ops that read each op
        self.users: dict[Any, set] = {}
        self.homes: dict[Any, set] = {}
        #: each kernel's root and kind
        self.roots: dict[Any, str] = {}
        self._height: dict[Any, int] = {}
        self._members: dict[Any, set] = {}
        self._cost: dict[Any, float] = {}
        self._temp: dict[Any, int] = {}
        #: per kernel, the sums its price is made of (see _kernel)
        self._sums: dict[Any, _KernelSums] = {}
        self._moved: set = set()
        self._views: dict[Any, float] = {}
        self._order = 0

    def edit(self, changes: Mapping[Any, "Op | None"]) -> None:
        """Set the op of each key of ``changes`` (``None`` removes it), and bring the kernels up to date.

        An edit leaves a whole program: every op's arguments are ops of it.
        """
        ops, users, homes, roots, members = self.ops, self.users, self.homes, self.roots, self._members
        seeds: set = set()
        dirty: set = set()
        #: ops that joined or left a kernel
        moved = self._moved = set()
        for c in changes:
            old = ops.get(c)
            if old is not None:
                for a in set(old.args):
                    users[a].discard(c)
                    seeds.add(a)
        for c, new in changes.items():
            if new is None:
                ops.pop(c, None)
                self._views.pop(c, None)
                old_home = homes.pop(c, None)
                if old_home:
                    for r in old_home:
                        if r in members:
                            members[r].discard(c)
                    moved.add(c)
                    dirty |= old_home
                if roots.pop(c, None) is not None:
                    dirty.add(c)
                continue
            ops[c] = new
            if new.prim == "proj":
                self._views[c] = new.own  # a loop's stacked output (see FusionModel.__call__)
            else:
                self._views.pop(c, None)
            for a in set(new.args):
                users.setdefault(a, set()).add(c)
                seeds.add(a)
            seeds.add(c)
            dirty.update(homes.get(c, ()))
        for c in changes:
            # Readers of a changed op see what it is: a literal is not read, a leaf is no temporary.
            seeds.update(users.get(c, ()))
            dirty |= self._reading(c)
        self._lift([c for c, new in changes.items() if new is not None])
        self._place(seeds, changes, dirty)
        self._price(dirty, changes)

    def _reading(self, x: Any) -> set:
        """The kernels that read ``x``, or a projection of it."""
        found: set = set()
        for u in self.users.get(x, ()):
            found.update(self.homes.get(u, ()))
            op = self.ops.get(u)
            if op is not None and op.prim == "proj":
                for w in self.users.get(u, ()):
                    found.update(self.homes.get(w, ()))
        return found

    def _lift(self, changed: list) -> None:
        """Give the changed ops heights above their arguments', and raise their readers' above theirs."""
        ops, height, users = self.ops, self._height, self.users
        inside = set(changed)
        for c in postorder(changed, lambda c: [a for a in ops[c].args if a in inside]):
            height[c] = 1 + max((height[a] for a in ops[c].args), default=0)
        stack = list(changed)
        while stack:
            x = stack.pop()
            hx = height[x]
            for u in users.get(x, ()):
                if height.get(u, -1) <= hx:
                    height[u] = hx + 1
                    stack.append(u)

    def _place(self, seeds: set, changes: Mapping[Any, Any], dirty: set) -> None:
        ops, users, homes, roots, members, height = (self.ops, self.users, self.homes, self.roots, self._members,
                                                      self._height)
        heap: list = []
        queued: set = set()

        def push(x: Any) -> None:
            if x in ops and x not in queued:
                queued.add(x)
                self._order += 1
                heapq.heappush(heap, (-height[x], self._order, x))

        for x in seeds:
            push(x)
        while heap:
            x = heapq.heappop(heap)[2]
            op = ops[x]
            kind = _kind(op)
            old_home, old_root = homes.get(x), roots.get(x)
            if kind in (LEAF, VIEW):
                home, root = None, None
            else:
                need: set = set()
                for u in users.get(x, ()):
                    h = homes.get(u)
                    if h:
                        need |= h
                home, root = self.model.place(self, x, kind, need, x in self._outputs, roots)
            if home != old_home:
                self._moved.add(x)
                for r in old_home or ():
                    if r in members:
                        members[r].discard(x)
                if home:
                    homes[x] = home
                    for r in home:
                        members.setdefault(r, set()).add(x)
                else:
                    homes.pop(x, None)
                dirty.update(old_home or ())
                dirty.update(home or ())
                for a in op.args:
                    push(a)
            elif x in changes:
                dirty.update(home or ())
            if root != old_root:
                for m in members.get(x, ()):  # their placement read this kernel's kind
                    push(m)
                if root is None:
                    del roots[x]
                else:
                    roots[x] = root
                dirty.add(x)
                dirty |= self._reading(x)
                for a in op.args:
                    push(a)

    def _price(self, dirty: set, changes: Mapping[Any, Any]) -> None:
        incremental = type(self.model).kernel is FusionModel.kernel
        for r in dirty:
            kind = self.roots.get(r)
            if kind is None:
                self._cost.pop(r, None)
                self._temp.pop(r, None)
                self._sums.pop(r, None)
                continue
            if incremental and kind != OTHER:
                cost, reads = self._kernel(r, kind, changes)
            else:
                cost, reads = self.model.kernel(self, r, kind, self._members[r])
                self._sums.pop(r, None)  # not kept up to date while priced whole
            self._cost[r] = cost
            self._temp[r] = (sum(_temp(self, a, self._outputs, self.roots) for a in reads)
                             + _temp(self, r, self._outputs, self.roots))

    def _kernel(self, r: Any, kind: str, changes: Mapping[Any, Any]) -> tuple[float, Iterable]:
        """:meth:`FusionModel.kernel` of kernel ``r``, from its sums at its last price and the members that
        came, went or changed op since (up to the order of the sums).

        A kernel's sums: its members' tie-break prices and shares of the work, its ``sin``/``cos`` by
        argument, how many of its members read each op (what it reads: those read and not computed
        in it, literals aside) and the bytes of what it reads.
        """
        model, ops, members = self.model, self.ops, self._members[r]
        facts = model._facts
        k = self._sums.get(r)
        if k is None or k.kind != kind:
            k = self._sums[r] = _KernelSums(kind)
        share = 4 if kind == LIBRARY and model.library_op is not None else 5
        reducing = kind in (LIBRARY, REDUCE)
        had = k.ops
        touched: set = set()
        edges, sincos = k.edges, k.sincos
        tiebreak, work = k.tiebreak, k.work
        # Only ops that joined or left a kernel, or changed, can be counted wrong (a fresh kernel: all of them).
        if had:
            came = []
            for x in (*self._moved, *changes):
                old = had.get(x)
                if old is not None and (x not in members or old is not ops[x]):
                    came.append((x, old, -1))
                    del had[x]
            for x in (*self._moved, *changes):
                if x in members and x not in had:
                    had[x] = ops[x]
                    came.append((x, ops[x], 1))
        else:
            for x in members:
                had[x] = ops[x]
            came = [(x, op, 1) for x, op in had.items()]
        for x, op, sign in came:
            f = facts(op, self)
            tiebreak += sign * f[1]
            if f[2]:
                prims = sincos.setdefault(op.args[0], {})
                prims[op.prim] = prims.get(op.prim, 0) + sign
                if not prims[op.prim]:
                    del prims[op.prim]
                    if not prims:
                        del sincos[op.args[0]]
            else:
                work += sign * (f[3] if (x == r and reducing) or f[7] else f[share])
            for a in set(op.args):
                n = edges.get(a, 0) + sign
                if n:
                    edges[a] = n
                else:
                    del edges[a]
                touched.add(a)
            touched.add(x)
        k.tiebreak, k.work = tiebreak, work
        touched.update(x for x in changes if x in edges)  # a read op that became a literal, or stopped being one
        reads = k.reads
        for a in touched:
            op = ops.get(a)
            want = edges.get(a, 0) > 0 and a not in members and op is not None and op.prim != "literal"
            if want != (a in reads):
                if want:
                    size = reads[a] = facts(op, self)[6] if op.out_avals else 0
                    k.read_bytes += size
                else:
                    k.read_bytes -= reads.pop(a)
        cost = model.launch + model.node * len(members)
        if model.tiebreak is not None:
            cost += TIEBREAK * k.tiebreak
        cost += k.work
        cost = _add_sincos(cost, model, ops, sincos)
        cost += model.byte * (k.read_bytes + facts(ops[r], self)[8])
        return cost, reads

    def price(self) -> float:
        """The program's cost, as :meth:`FusionModel.__call__` prices it."""
        cost = sum(self._cost.values()) + sum(self._views.values())
        if self.model.memory:
            cost += self.model.memory * max(self._temp.values(), default=0)
        return float(cost)


class _KernelSums:
    """What :meth:`LiveFusion._kernel` keeps of one kernel between prices."""

    __slots__ = ("kind", "ops", "tiebreak", "work", "sincos", "edges", "reads", "read_bytes")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.ops: dict[Any, Op] = {}        # each member, with the op it was counted with
        self.tiebreak = 0.0
        self.work = 0.0
        self.sincos: dict[Any, dict[str, int]] = {}
        self.edges: dict[Any, int] = {}     # op -> how many members read it
        self.reads: dict[Any, int] = {}     # op read -> its bytes
        self.read_bytes = 0


def peak_temp_bytes(prog: Program, kernels: Sequence[Fusion]) -> int:
    """The predicted peak of temporary memory: the largest, over kernels, of the temporaries one
    kernel reads plus the one it writes.

    A temporary is an array one kernel writes and another reads; the program's
    inputs and outputs are not (``memory_analysis`` counts them apart). Every
    array a kernel reads or writes is alive while it runs, whatever order
    the compiler schedules kernels in; XLA's scheduler, which frees each
    array after its last reader, usually needs no more than that. Two
    reductions merged into one kernel, for instance, keep both of their
    inputs alive at once, where two kernels would hold one each.
    """
    outputs = set(prog.outputs)
    written = {k.root for k in kernels}
    return max((sum(_temp(prog, a, outputs, written) for a in k.reads) + _temp(prog, k.root, outputs, written)
                for k in kernels), default=0)


def _temp(prog: Any, i: Any, outputs: Container[Any], written: Container[Any]) -> int:
    """The bytes of op ``i`` if it is a temporary: written by a kernel (``written``: their roots), not an output."""
    op = prog.ops[i]
    made_by = op.args[0] if op.prim == "proj" else i  # a loop's output is written by the loop
    if i in outputs or made_by not in written or op.prim in ("param", "literal", "const", "token"):
        return 0
    return _out_bytes(op)


def _out_bytes(op: "Op") -> int:
    """The bytes of all of ``op``'s results, kept in its memo where it has one."""
    memo = op.memo
    if memo is None:
        return sum(_nbytes(a) for a in op.out_avals)
    found = memo.get("bytes")
    if found is None:
        found = memo["bytes"] = sum(_nbytes(a) for a in op.out_avals)
    return found


def ops_in(prog: Program, kernels: Iterable[Fusion]) -> dict[str, int]:
    """How many times each primitive is evaluated across kernels (duplicates counted)."""
    counts: dict[str, int] = {}
    for k in kernels:
        for i in k.computes:
            p = prog.ops[i].prim
            counts[p] = counts.get(p, 0) + 1
    return counts
