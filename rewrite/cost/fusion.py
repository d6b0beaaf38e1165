"""What XLA will actually run: a whole program's cost after fusion, predicted from its structure.

A node-by-node cost cannot see fusion. XLA compiles elementwise chains into one loop per *materialised* value, and
the cost of a program is the cost of those loops: the arithmetic each does (an operation duplicated into two loops
is paid twice) plus the bytes each reads and writes. Whether a value is materialised or recomputed depends on all of
its consumers, so it is a property of the chosen program, not of a node. This module replays the decisions XLA:CPU's
fusion passes make (``cpu_instruction_fusion.cc``, ``instruction_fusion.cc`` and the library reduction fusion), on a
jaxpr or on an extractor's choice:

* Cheap elementwise operations (``IsExpensive`` is false: ``mul``, ``add``,
  ``select_n``, broadcasts, and, for real numbers, ``sin``, ``cos``,
  ``tan``) are duplicated into every loop that reads them.
* Expensive ones (``exp``, ``log``, ``tanh``, float ``div``, ``sqrt``, ...)
  read by more than one loop are computed once and stored.
* An operation whose inputs are larger than its output and that some
  consumer cannot absorb is stored, not duplicated (``ComputeGloballyUnfusible``).
* A floating ``reduce_sum``/``reduce_max``/``reduce_min`` of 4096 elements
  or more becomes a library (YNN) reduction that absorbs only plain
  arithmetic (``mul``, ``add``, ``sub``, ``neg``, broadcasts) that it alone
  reads; a transcendental feeding it is computed in a loop of its own and
  stored, even when another loop recomputes it. This is why JAX's VJP of
  ``sin(a*x)**2/a`` evaluates ``sin(a*x)`` twice. (Smaller reductions are
  loop fusions that absorb anything, and fuse into their one consumer loop;
  XLA may also merge sibling ones, which the model does not.)
* ``sin`` and ``cos`` of one argument in one loop cost about one of them
  (LLVM merges them into ``sincos``), and so do ``sinh`` and ``cosh`` of one
  argument: both are lowered to ``exp(x - ln 2)`` and ``exp(-x - ln 2)``, which
  XLA computes once, and stores for both where they are in two kernels
  (``rewrite/cost/transcendental.py``).
* A product whose result a softmax reads, row by row, for a second product (``softmax(q k^T) v``, as
  ``jax.nn.softmax`` traces it) is one library (YNN) kernel with both products and the softmax, where every
  operation between them is read only there and XLA's library matcher takes each: float32, every one of
  4096 elements or more (``kMinElements`` of ``IsInstructionPreferredByYnn``: the row maxima and sums,
  b x h x nq, are the smallest), and no size-1 axis among the scores' batch axes (layout assignment then
  copies the probabilities into another layout, which the matcher does not absorb):
  ``rewrite/cost/attention.py``'s ``attention_chain``. It stores no scores: its scratch holds them
  outside the temporaries ``memory_analysis`` counts, mapped fresh at every call from ``SCRATCH_FRESH_AT``
  bytes (``scratch_bytes``).
* A reshape that keeps row-major order (``reshape`` without ``dimensions``,
  ``squeeze``, a broadcast that only adds axes of size 1) is a ``bitcast``:
  no kernel, no bytes read or written. A kernel that reads it reads its
  operand's buffer, and an output that is one is its operand's allocation
  (:func:`rewrite.cost.program.bitcast`, :func:`buffer_of`, :func:`output_buffers`).
* A reduction of a broadcast it absorbs reduces the broadcast's operand, where it reduces only axes the broadcast
  kept, and nothing where that operand is a literal (XLA's simplifier: ``rewrite/cost/simplify.py``).

Costs are nanoseconds per element and per byte from
``benchmarks/calibrate.py``. The prediction is a model: ``cost_model="measure"``
times the best candidates on the real backend instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Container, Iterable, Mapping, Sequence

import numpy as np

from ..ir import primitives as _primitives
from ..ir.jaxapi import body_closed
from ..ir.primitives import inner_jaxpr, spec_of
from ..ir.scanread import SLICES
from .dot import library_dot
from .prices import keep_facts, kept_facts
from .attention import SCORES_CACHED, attention_price, keep_readers, kept_chain, scratch_bytes
from .program import (ATTENTION, LEAF, LIBRARY, LOOP, OTHER, REDUCE, TIEBREAK, VIEW, Op, Program, _kind, _size,
                      bitcast, fused_update, kernel_members, remembered_kernel, sliced_parts, unrolled_bodies)
from .simplify import folded_reduction
from .spill import cached_reduction, spilled as _spilled, with_bytes
from .transcendental import SHARED, SHARED_ACROSS, add_shared, chained, shared_across, shared_group


#: What a program over the memory budget pays, plus this per byte over: more than any program's time.
OVER_BUDGET = 1e15


def _nbytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        return int(math.prod(shape)) * np.dtype(dtype).itemsize
    except TypeError:
        return 0


def ns_key(prim: str, out_avals: Sequence[Any]) -> str:
    """The calibration table's key for ``prim`` with these results: ``exp_complex`` for ``exp`` of complex
    numbers (an ``exp``, a ``sin`` and a ``cos`` an element, priced as measured), else the primitive's name."""
    if prim == "exp" and out_avals and np.issubdtype(getattr(out_avals[0], "dtype", np.float32), np.complexfloating):
        return "exp_complex"
    return prim


def _true_rank(aval: Any) -> int:
    return sum(1 for d in getattr(aval, "shape", ()) if d != 1)


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
    ``memory`` is charged per byte of :func:`peak_temp_bytes`, and ``fresh`` more per byte of the
    temporaries XLA allocates for a call where they are ``fresh_at`` bytes or more (a buffer mapped fresh
    at each call): ``held(prog, kernels, inner)``, the peak of the buffers live at once as XLA shares and
    schedules them (``rewrite/cost/memory.py``'s ``scheduled_peak``), or without it :func:`peak_temp_bytes`, which counts an
    elementwise kernel's input and the output XLA writes over it twice. ``inner(op)`` is what an op holds
    inside itself while it runs (a loop body's temporaries), and a program whose peak is over ``budget``
    bytes is priced above every program within it. A loop kernel of ``parallel_at`` elements or more has
    its work priced at ``parallel`` times the per-element prices, a smaller one at ``serial`` times
    (:meth:`parallel_share`). A loop in which a transcendental reads another's result pays ``chain`` times the
    prices of the dearest such chain more (:func:`rewrite.cost.transcendental.chained`). A loop (``scan``,
    ``while``) pays, at each trip, ``loop_launch`` for each loop kernel of its body, ``loop_split`` more for each of
    ``parallel_at`` elements or more, and ``loop_library`` for each library kernel (:meth:`launches`); a ``while``
    loop is taken to run ``while_trips`` trips.
    """

    def __init__(self, ns: Mapping[str, float], *, byte: float, reduce: float, launch: float, default: float,
                 cheap: float, node: float = 0.0, library_op: float | None = None,
                 tiebreak: Callable[[Op], float] | None = None, memory: float = 0.0,
                 inner: Callable[[Op], int] | None = None, budget: float | None = None,
                 cache: float = math.inf, spill: float = 0.0, fresh: float = 0.0, fresh_at: float = math.inf,
                 near: float = math.inf, tier: float = 0.0, scores_cached: float = SCORES_CACHED,
                 held: Callable[[Any, Sequence[Fusion], Callable[[Op], int] | None, float], int] | None = None,
                 parallel: float = 1.0, parallel_at: float = math.inf, chain: float = 0.0,
                 serial: float = 1.0, loop_launch: float = 0.0, loop_library: float = 0.0, loop_split: float = 0.0,
                 while_trips: float = 10.0, kernel_product: Callable[[Op], float] | None = None,
                 reduce_cached: float | None = None, overlap: bool = False, loop_bytes: bool = False) -> None:
        self.ns = dict(ns)
        #: where an op's memo keeps its facts for this model (:meth:`_facts`): one memo may meet two models
        self._facts_key = ("facts", id(self))
        #: whether :meth:`_facts` are kept by node key (``prices.kept``): set by ``AnalyticCost`` itself, whose
        #: tie-break reads the node's ``NodeInfo`` alone (its kept node price); another model's may read anything
        self.keeps_facts = False
        #: the price of a product inside one attention kernel (``attention.py``'s ``attention_price``), where it is
        #: not its own node price (``Op.own``): ``AnalyticCost``'s product at its one-core rate
        self.kernel_product = kernel_product
        self.loop_launch, self.loop_library, self.loop_split = loop_launch, loop_library, loop_split
        self.while_trips = while_trips
        self.serial, self.chain = serial, chain
        self.parallel, self.parallel_at = parallel, parallel_at
        self.fresh, self.fresh_at = fresh, fresh_at
        self.held = held
        self.cache = cache
        #: the scores of a softmax between two products, in bytes, up to which it is priced as one attention kernel
        #: where XLA makes three (``attention.py``'s ``SCORES_CACHED``: the cache holds the stored scores)
        self.scores_cached = scores_cached
        self.spill, self.near, self.tier = spill, near, tier  # (AnalyticCost.near)
        self.memory, self.inner, self.budget, self.node = memory, inner, budget, node
        self.library_op, self.tiebreak = library_op, tiebreak
        self.byte, self.overlap, self.loop_bytes = byte, overlap, loop_bytes  # (AnalyticCost.overlap, .loop_bytes)
        self.reduce, self.reduce_cached = reduce, reduce_cached  # (spill.py's cached_reduction)
        self.launch, self.default, self.cheap = launch, default, cheap

    # ------------------------------------------------------------------ fusion decisions
    def fuse(self, prog: Program) -> tuple[dict[int, set[int]], dict[int, str]]:
        """Which kernels compute each op (``homes``), and the kind of each kernel root."""
        ops = prog.ops
        users: list[list[int]] = [[] for _ in ops]
        for i, op in enumerate(ops):
            for a in set(op.args):
                users[a].append(i)
        keep_readers(prog, users)  # (attention's ``_readers``: the same, not found again)
        outputs = output_buffers(prog)
        homes: dict[int, set[int]] = {}
        roots: dict[int, str] = {}
        for i in range(len(ops) - 1, -1, -1):
            kind = _kind(ops[i])
            if kind in (LEAF, VIEW):
                continue
            need: set[int] = set()
            for u in users[i]:
                need.update(homes.get(u, ()))
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
        if len(need) == 1:
            r = next(iter(need))
            if roots[r] == ATTENTION and i in (kept_chain(prog, r, self.scores_cached) or ()):
                return need, None  # the library kernel of the product that reads the softmax computes it
        if prog.ops[i].prim == "dot_general" and kept_chain(prog, i, self.scores_cached) is not None:
            return {i}, ATTENTION
        if kind == REDUCE and not output:
            # A small reduction is a loop XLA can fuse into its one consumer loop (never duplicated).
            if not need:
                return None, None
            if len(need) == 1 and roots[next(iter(need))] in (LOOP, REDUCE):
                return need, None
        if kind != LOOP:
            return (need, None) if fused_update(prog.ops[i], need, output, roots) else ({i}, kind)
        if bitcast(prog.ops[i]) and not (output and copied(prog, i)):
            # XLA bitcasts it: it is read where its readers are, none of them writes it, and a kernel that
            # cannot absorb it (a product, a loop) reads its operand's buffer as it is; an output's operand is
            # written into the output's allocation (output_buffers)
            return need or None, None
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
            return sum(self.op_ns(o) for o in inner)  # per element: ``node`` is per op, the kernel's
        if op.family == _primitives.OPAQUE or spec.inlined:
            return self._inner_ns(inner_jaxpr(op.params))
        found = self.ns.get(ns_key(op.prim, op.out_avals))
        if found is not None:
            return found
        return self.default if op.family == _primitives.TRANSCENDENTAL or _expensive(op) else self.cheap

    def _inner_ns(self, jaxpr: Any) -> float:
        total = 0.0
        for e in jaxpr.eqns:
            spec = _primitives.spec_of(e.primitive.name)
            inner = inner_jaxpr(e.params)
            if (spec is _primitives.DEFAULT or spec.inlined) and inner is not None:
                total += self._inner_ns(inner)
                continue
            op = Op(e.primitive.name, spec.family, e.params, (),
                    tuple(v.aval for v in e.invars), tuple(v.aval for v in e.outvars))
            total += self.op_ns(op)
        return total

    def kernels(self, prog: Program) -> list[Fusion]:
        """The kernels the program compiles to, each with its predicted cost."""
        homes, roots = self.fuse(prog)
        members = kernel_members(homes, roots)
        out, kernel = [], self.kernel if getattr(prog, "kernel_prices", None) is None else remembered_kernel(self)
        for r, kind in roots.items():
            comp = members[r]
            cost, reads = kernel(prog, r, kind, comp)
            out.append(Fusion(r, kind, sorted(comp), sorted(reads), cost))
        return out

    def launches(self, op: Op, trip: bool = False) -> float:
        """What the kernels of a loop's bodies cost per execution of the loop beyond their work: at each trip,
        ``loop_launch`` per loop kernel (``loop_split`` more where XLA:CPU splits it across the cores: ``parallel_at``
        elements or more) and ``loop_library`` per library kernel (a product on the library path, a library
        reduction), the loops and calls nested in them included; for a call (``custom_vjp_call``, ``jit``), what the
        loops in its body cost so; 0 for any other op, for a scan JAX unrolls (:meth:`own`), or with no such price.
        XLA:CPU runs a body's kernels one after another at every trip (``calibrate.py --loop-kernels-only``,
        ``--loop-split-only``); a body's node prices hold only their work: with ``loop_bytes`` its loop kernels pay
        their bytes at each trip, else under ``overlap`` the term's share (:func:`~rewrite.cost.spill.with_bytes`:
        the kernel's price less its price summed); ``trip``: a call in a loop's body. Kept in the op's memo."""
        if unrolled_bodies(op):
            return 0.0
        loop, bytes_ = op.prim in ("scan", "while"), self.overlap or self.loop_bytes
        each = loop or trip  # (its bodies' kernels run at every trip of a loop)
        priced = self.loop_launch or self.loop_library or self.loop_split or (each and bytes_)
        if not priced or (not loop and op.family != _primitives.NESTED and inner_jaxpr(op.params) is None):
            return 0.0
        memo = op.memo
        key = ("launches", id(self), trip)
        if memo is not None and key in memo:
            return memo[key]
        bodies = memo.get("bodies") if memo else None
        if not bodies:
            names = ("jaxpr",) if op.prim == "scan" else ("cond_jaxpr", "body_jaxpr") if loop else ()
            found_bodies = [op.params.get(n) for n in names] if loop else [inner_jaxpr(op.params)]
            bodies = tuple(Program.from_jaxpr(body_closed(b), None) for b in found_bodies if b is not None)
        per_trip = 0.0
        for body in bodies:
            homes, roots = self.fuse(body)
            for r, kind in roots.items():
                if each and kind == LOOP and bytes_:  # its bytes, which its members' node prices leave out
                    comp = [i for i, hs in homes.items() if r in hs]
                    per_trip += (self.kernel(body, r, kind, comp, summed=None)[0] if self.loop_bytes else
                                 self.kernel(body, r, kind, comp)[0] - self.kernel(body, r, kind, comp, summed=True)[0])
                root = body.ops[r]
                if each:  # a call's own kernels run as the program's (``launch``); the loops in it are charged
                    library = kind == LIBRARY or (root.prim == "dot_general"
                                                  and library_dot(root.params, root.in_avals))
                    per_trip += self.loop_library if library else self.loop_launch
                    if kind == LOOP and self.loop_split and _size(root.out_avals[0]) >= self.parallel_at:
                        per_trip += self.loop_split
                if kind == OTHER:
                    per_trip += self.launches(root, each)
        trips = (op.params.get("length", 1) if op.prim == "scan" else self.while_trips) if loop else 1
        found = float(trips) * per_trip
        if memo is not None:
            memo[key] = found
        return found

    def own(self, op: Op) -> float:
        """An unfused op's own price: its node price; a scan JAX unrolls (``program.unrolled_bodies``), ``length``
        times its body's :meth:`work` (its kernels with their launches): no loop. Kept in its memo."""
        bodies, key = unrolled_bodies(op), ("unrolled", id(self))
        if bodies and key not in op.memo:
            op.memo[key] = op.params.get("length", 1) * math.fsum([self.work(b) for b in bodies])
        return op.memo[key] if bodies else op.own

    def kernel(self, prog: Any, r: Any, kind: str, comp: Iterable[Any], summed: bool | None = False) -> tuple:
        """The cost of the kernel rooted at ``r`` that computes ``comp``, and the ops it reads (``summed``: its work
        and bytes summed, whatever ``overlap``; ``None``: its bytes' price alone, spill included: :meth:`launches`)."""
        ops = prog.ops
        root_op = ops[r]
        if kind == ATTENTION:
            return attention_price(self, prog, r, comp)
        if kind == OTHER:
            # what else it holds is bitcasts it reads (``place``): no work, but an equation each, as in a loop
            cost = self.own(root_op) + self.launch + self.node + self.launches(root_op)
            for i in comp:
                if i != r:
                    cost += self.node + (TIEBREAK * self._facts(ops[i], prog)[1] if self.tiebreak is not None else 0.0)
            return cost, set(root_op.args)
        inside = comp if isinstance(comp, (set, frozenset)) else set(comp)
        reads: set = set()
        facts = self._facts
        whole: set = set()        # read as a whole by some member
        sliced: dict[Any, int] = {}  # read by slices only: the bytes of the slices
        # members computed only where slices read them, and the part of each (program.sliced_parts)
        part = sliced_parts(prog, inside, r, slices)
        for i in inside:
            for a in (op := ops[i]).args:
                if a in inside or ops[a].prim == "literal":
                    continue
                reads.add(a)
                if i in part or slices(op, a):
                    read = part[i] * facts(ops[a], prog)[6] if i in part else facts(op, prog)[6]
                    sliced[a] = sliced.get(a, 0) + read
                else:
                    whole.add(a)
        cost = self.launch + self.node * len(inside)
        found = [facts(ops[i], prog) for i in comp]  # (each member's, read twice below)
        if self.tiebreak is not None:
            cost += TIEBREAK * sum(f[1] for f in found)
        sincos: dict[tuple, set[str]] = {}
        # Each op's share: its reduction, its pass in a library reduction, or its elementwise work.
        share = 4 if kind == LIBRARY and self.library_op is not None else 5
        par = self.parallel_share(root_op, kind)
        work = cost if par == 1.0 else 0.0  # (summed as before where the term is off: equal prices stay equal)
        reduced = 0.0  # a reduction's share where ``par`` scales the rest: its price is measured on one core
        for i, f in zip(comp, found):
            if f[2]:
                sincos.setdefault((f[2], ops[i].args[0]), set()).add(ops[i].prim)
                continue
            if (i == r and kind in (LIBRARY, REDUCE)) or f[7]:
                if par == 1.0:
                    work += f[3]
                else:
                    reduced += f[3]
            else:
                work += f[share] * part.get(i, 1.0)
        work = add_shared(work, self, ops, sincos)
        if self.chain and kind in (LOOP, REDUCE):
            work += self.chain * chained(self, prog, inside)
        cost = work if par == 1.0 else cost + par * work + reduced
        moved = self.byte * (sum(facts(ops[a], prog)[6] if a in whole else min(facts(ops[a], prog)[6], sliced[a])
                                 for a in reads if ops[a].out_avals)
                             + facts(root_op, prog)[8])
        cost = moved if summed is None else with_bytes(self, kind, cost, moved, overlap=False if summed else None)
        if self.spill:  # a slice of an array beyond the cache is streamed once, as any array read
            cost += (sum(facts(ops[a], prog)[9] for a in reads if ops[a].out_avals and a in whole)
                     + facts(root_op, prog)[10])
        less = folded_reduction(self, prog, r, kind, inside) + cached_reduction(self, prog, r, kind, inside)
        return cost - less, reads

    def parallel_share(self, root: Op, kind: str) -> float:
        """What a kernel's elementwise work costs, as a multiple of its per-element prices: ``parallel`` for a loop
        kernel (one that reduces too) of ``parallel_at`` elements or more (XLA:CPU splits one that large across the
        cores), ``serial`` for a smaller one (which runs on one core, where the prices were measured on split loops:
        ``AnalyticCost.loop_serial``); 1 for other kernels. A reduction in the loop is priced as measured."""
        if (self.parallel == 1.0 and self.serial == 1.0) or kind not in (LOOP, REDUCE) or not root.out_avals:
            return 1.0
        # a loop that reduces runs over its operand's elements
        return self.loop_share(_size(root.in_avals[0] if kind == REDUCE and root.in_avals else root.out_avals[0]))

    def loop_share(self, elems: float) -> float:
        """The multiple of its per-element prices a loop kernel of ``elems`` elements pays (:meth:`parallel_share`)."""
        return self.parallel if elems >= self.parallel_at else self.serial

    def _facts(self, op: Op, prog: Any) -> tuple:
        """What :meth:`kernel` reads of an op, kept in its memo (per model): nothing (a place kept), its
        tie-break price, the ``SHARED`` group it is a member of (or ``None``), its share of a kernel's cost
        as a reduction, as a pass of a library reduction and as elementwise work, the bytes of its first output,
        whether it is a reduction, the bytes of all its outputs, and what moving them costs beyond ``byte``
        (:meth:`spilled`, ns) for the first output and for all. (Of the program they read only the sizes of the op's
        arguments, which its node fixes: an op's facts are the same in every program of one extraction,
        though its arguments' positions are not.) Where the model :attr:`keeps_facts`, they are kept by node key
        too, for later extractions (``prices.kept_facts``)."""
        memo = op.memo
        if memo is None:
            memo = op.memo = {}
        key = self._facts_key
        found = memo.get(key)
        if found is None and self.keeps_facts:
            found = kept_facts(self, memo)
        if found is not None:
            return found
        ins, outs = op.in_avals, op.out_avals
        kind = _kind(op)
        found = memo[key] = (None,
                 self._tiebreak(op) if self.tiebreak is not None else 0.0,
                 shared_group(op),
                 _size(ins[0]) * self.reduce if ins else 0.0,
                 _size(outs[0]) * self.library_op if self.library_op is not None and outs and not bitcast(op)
                 else 0.0,
                 _size(outs[0]) * self.op_ns(op, prog) if outs and kind == LOOP else 0.0,  # only loops fuse others
                 _nbytes(outs[0]) if outs else 0, kind == REDUCE, _out_bytes(op),
                 self.spilled(_nbytes(outs[0])) if outs else 0.0,
                 sum(self.spilled(_nbytes(a)) for a in outs))
        if self.keeps_facts:
            keep_facts(self, memo, found)
        return found

    def spilled(self, b: float) -> float:
        """What moving ``b`` bytes once costs beyond ``byte``'s, in ns (``rewrite/cost/spill.py``'s ``spilled``)."""
        return _spilled(b, self.cache, self.spill, self.near, self.tier)

    def _tiebreak(self, op: Op) -> float:
        memo = op.memo
        if memo is None:
            return self.tiebreak(op)  # type: ignore[misc]
        key = ("tiebreak", id(self))  # one memo may meet two models (a search and a report, say)
        found = memo.get(key)
        if found is None:
            found = memo[key] = self.tiebreak(op)  # type: ignore[misc]
        return found

    def work(self, prog: Program, kernels: Sequence[Fusion] | None = None) -> float:
        """A program's price but for its memory's: its kernels' (:meth:`kernels`, or those given)."""
        kernels = self.kernels(prog) if kernels is None else kernels
        # loops' stacked outputs are priced as views; the sum is exact (``math.fsum``): the kernels' order is moot
        cost = math.fsum([*(k.cost for k in kernels), *(op.own for op in prog.ops if op.prim == "proj")])
        return cost - shared_across(self, prog.ops, self.across(prog, kernels)) if self.prices_across else cost

    def __call__(self, prog: Program, peaks: list | None = None) -> float:
        kernels = self.kernels(prog)
        cost = self.work(prog, kernels)
        if self.prices_peak:
            peak = max(temps := kernel_temps(prog, kernels, self.inner), default=0)
            cost += self.memory_price(peak, held := self.held_bytes(prog, kernels, sum(temps)))
            if peaks is not None:  # the peak charged, and the held where no kernel has scratch (ProgramPricer.price)
                peaks.extend((peak, held if held and all(k.kind != ATTENTION for k in kernels) else None))
        return float(cost)

    def across(self, prog: Any, kernels: Iterable[Fusion]) -> dict[tuple, int]:
        """(group, argument) -> how many of the kernels compute a member of a ``SHARED_ACROSS`` group of that
        argument (``rewrite/cost/transcendental.py``'s ``shared_across``)."""
        found: dict[tuple, int] = {}
        for k in kernels:
            for key in self.kernel_across(prog, k.computes):
                found[key] = found.get(key, 0) + 1
        return found

    def kernel_across(self, prog: Any, comp: Iterable[Any]) -> set[tuple]:
        """The (group, argument) of the ``SHARED_ACROSS`` groups whose members the kernel computing ``comp``
        computes."""
        ops = prog.ops
        groups = ((shared_group(ops[i]), ops[i].args[0]) for i in comp if ops[i].prim in SHARED)
        return {(group, arg) for group, arg in groups if group in SHARED_ACROSS}

    @property
    def prices_across(self) -> bool:
        """Whether the table prices a ``SHARED_ACROSS`` group (``shared_across`` is 0 where it does not)."""
        return any(g in self.ns for g in SHARED_ACROSS)

    @property
    def prices_peak(self) -> bool:
        """Whether a program's price reads its peak of temporaries (:meth:`memory_price`)."""
        return bool(self.memory or self.fresh or self.budget is not None)

    def memory_price(self, peak: float, held: float | None = None) -> float:
        """The price of holding ``peak`` bytes of temporaries (:func:`peak_temp_bytes`), and of touching the
        ``held`` bytes XLA allocates for them (:meth:`held_bytes`; ``None``: ``peak``) fresh at each call where
        that buffer is ``fresh_at`` bytes or more; past the budget, dearer than any time saved."""
        held = peak if held is None else held
        over = 0.0 if self.budget is None else max(0.0, peak - self.budget)
        touched = self.fresh * held if held >= self.fresh_at else 0.0
        return self.memory * peak + touched + (OVER_BUDGET * (1.0 + over) if over else 0.0)

    def held_bytes(self, prog: Any, kernels: Sequence[Fusion] | Callable[[], Sequence[Fusion]], most: float
                   ) -> float | None:
        """The bytes of temporaries XLA allocates for a call of ``prog``, as the fresh charge reads them
        (``held``), where they can reach ``fresh_at``: ``most`` bounds them (every kernel's temporaries,
        summed), so below ``fresh_at`` nothing is computed and 0 returned. ``None`` without ``held``.
        ``kernels``: the program's kernels, or a function that lists them (called only where they are read)."""
        if self.held is None:
            return None
        if not self.fresh or most < self.fresh_at:
            return 0.0
        return float(self.held(prog, kernels() if callable(kernels) else kernels, self.inner, self.fresh_at))

    def describe(self, prog: Program) -> str:
        """One line per predicted kernel: what it computes and what it costs (for reports and tests)."""
        lines = []
        for k in sorted(self.kernels(prog), key=lambda k: k.root):
            names = [prog.ops[i].prim for i in k.computes]
            lines.append(f"{k.kind:8s} {prog.ops[k.root].prim:14s} {k.cost:12.1f}  computes {' '.join(names)}; "
                         f"reads {len(k.reads)}")
        return "\n".join(lines)


def peak_temp_bytes(prog: Program, kernels: Sequence[Fusion], inner: Callable[[Op], int] | None = None) -> int:
    """The predicted peak of temporary memory: the largest, over kernels, of the temporaries one
    kernel reads plus the one it writes.

    A temporary is an array one kernel writes and another reads; the program's
    inputs and outputs are not (``memory_analysis`` counts them apart). Every
    array a kernel reads or writes is alive while it runs, whatever order
    the compiler schedules kernels in; XLA's scheduler, which frees each
    array after its last reader, usually needs no more than that. Two
    reductions merged into one kernel, for instance, keep both of their
    inputs alive at once, where two kernels would hold one each. ``inner``
    adds what a kernel's op holds inside itself (a loop body's temporaries).
    """
    return max(kernel_temps(prog, kernels, inner), default=0)


def kernel_temps(prog: Program, kernels: Sequence[Fusion], inner: Callable[[Op], int] | None = None) -> list[int]:
    """Per kernel, the temporaries it reads and writes and what its op holds inside itself: their largest is
    :func:`peak_temp_bytes`; their sum bounds every buffer live at once (each is written by one kernel)."""
    outputs = output_buffers(prog)
    written = {k.root for k in kernels}
    return [sum(_temp(prog, a, outputs, written)
                for a in {a if a in written else buffer_of(prog, a, written) for a in k.reads})
            + _temp(prog, k.root, outputs, written)
            + (inner(prog.ops[k.root]) if inner is not None else 0) + scratch_bytes(prog, k)
            for k in kernels]


def _temp(prog: Any, i: Any, outputs: Container[Any], written: Container[Any]) -> int:
    """The bytes of op ``i`` if it is a temporary: written by a kernel (``written``: their roots), not an output."""
    op = prog.ops[i]
    made_by = op.args[0] if op.prim == "proj" else i  # a loop's output is written by the loop
    if i in outputs or made_by not in written or op.prim in ("param", "literal", "const", "token"):
        return 0
    return _out_bytes(op)


def buffer_of(prog: Any, i: Any, written: Container[Any]) -> Any:
    """The op whose buffer op ``i``'s value is: a bitcast (:func:`rewrite.cost.program.bitcast`) that no kernel
    writes is its operand's bytes, so a kernel that reads it reads, and keeps alive, its operand's buffer."""
    op = prog.ops[i]
    while i not in written and op.args and op.prim != "proj" and bitcast(op):
        i = op.args[0]
        op = prog.ops[i]
    return i


#: the kinds of op (:func:`rewrite.cost.program._kind`) that an output which is a bitcast of one stays a kernel of
#: its own for: an input's is copied into the output, and elementwise work is computed into the output's loop
COPIED = (LEAF, LOOP)


def output_buffers(prog: Any, visited: set | None = None) -> set:
    """The program's outputs, and the values XLA writes into their allocations: where an output is a bitcast (of
    a bitcast...) of a value a kernel of its own computes (a product, a loop, a reduction), that value and the
    bitcasts between. Where it is one of an input, XLA copies the input into the output, and where it is one of
    elementwise work, that work is fused into the output's loop: the output stays a kernel (:func:`copied`).
    ``visited`` (where given) gets every op read to find them: only an edit of one of those changes them."""
    found = set(prog.outputs)
    for i in prog.outputs:
        chain, base = _bitcasts_from(prog, i, visited)
        if chain and _kind(base) not in COPIED:
            found.update(chain)
    return found


def copied(prog: Any, i: Any) -> bool:
    """Whether op ``i``, a bitcast, is one of a program input (or a literal), which XLA copies into an output, or of
    elementwise work, which it computes into the output's loop: as an output, a kernel of its own."""
    return _kind(_bitcasts_from(prog, i)[1]) in COPIED


def _bitcasts_from(prog: Any, i: Any, visited: set | None = None) -> tuple[list, Any]:
    """The ops a chain of bitcasts from op ``i`` reads down to the first op that is not one (``i``'s operand, its
    operand, ...), and that op; ``visited``, where given, gets ``i`` and each of them."""
    chain = []
    op = prog.ops[i]
    if visited is not None:
        visited.add(i)
    while op.args and bitcast(op):
        i = op.args[0]
        op = prog.ops[i]
        chain.append(i)
        if visited is not None:
            visited.add(i)
    return chain, op


def slices(op: "Op", a: Any) -> bool:
    """Whether ``op`` reads ``a`` only as the operand it slices: a kernel that reads an array only through slices
    reads those (a loop body's block of keys), not the whole array."""
    return op.prim in SLICES and op.args[0] == a and a not in op.args[1:]


def _out_bytes(op: "Op") -> int:
    """The bytes of all of ``op``'s results, kept in its memo where it has one."""
    memo = op.memo
    if memo is None:
        return sum(_nbytes(a) for a in op.out_avals)
    found = memo.get("bytes")
    if found is None:
        found = memo["bytes"] = sum(_nbytes(a) for a in op.out_avals)
    return found
