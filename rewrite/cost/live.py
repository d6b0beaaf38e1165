"""The fusion model kept up to date as an extractor's search switches single classes.

:class:`LiveFusion` holds the kernels of one program and, on each move,
re-places and re-prices only the kernels the move touches; its prices
equal :class:`rewrite.cost.fusion.FusionModel`'s whole-program ones up to
the order of the sums.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Iterable, Mapping, Sequence

from ..ir import primitives as _primitives
from ..ir.scanread import SLICES
from ..ir.walk import postorder, postorder_list
from .attention import SOFTMAX_OPS, held_scores
from .fusion import TIEBREAK, Fusion, FusionModel, _temp, buffer_of, output_buffers, slices
from .memory import fresh_peak
from .program import ATTENTION, LEAF, LIBRARY, LOOP, OTHER, REDUCE, VIEW, Op, _kind, bitcast, sliced_parts
from .simplify import folded_reduction
from .spill import cached_reduction, with_bytes
from .transcendental import SHARED_ACROSS, add_shared, chained, shared_across


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
    >>> from rewrite.cost.program import Program
    >>> v = core.ShapedArray((1024,), jnp.float32)
    >>> fm = FusionModel({"exp": 2.0}, byte=0.1, reduce=0.5, launch=100.0, default=3.0, cheap=0.25)
    >>> live = LiveFusion(fm, ["y"])
    >>> live.edit({"x": Op("param", _primitives.SPECIAL, {}, (), (), (v,)),
    ...            "e": Op("exp", _primitives.TRANSCENDENTAL, {}, ("x",), (v,), (v,)),
    ...            "y": Op("mul", _primitives.ELEMENTWISE, {}, ("e", "e"), (v, v), (v,))})
    >>> prog = Program([Op("param", _primitives.SPECIAL, {}, (), (), (v,)),
    ...                 Op("exp", _primitives.TRANSCENDENTAL, {}, (0,), (v,), (v,)),
    ...                 Op("mul", _primitives.ELEMENTWISE, {}, (1, 1), (v, v), (v,))], [2])
    >>> live.price() == fm(prog)
    True
    """

    def __init__(self, model: FusionModel, outputs: Sequence[Any]) -> None:
        self.model = model
        self.ops: dict[Any, Op] = {}
        self.outputs = list(outputs)
        self._outputs = set(outputs)
        #: the outputs and the values written into their allocations (``output_buffers``), and the ops read to
        #: find them
        self._held_outputs = set(outputs)
        self._output_chains: set = set(outputs)
        #: the ops that read each op
        self.users: dict[Any, set] = {}
        self.homes: dict[Any, set] = {}
        #: each kernel's root and kind
        self.roots: dict[Any, str] = {}
        self._height: dict[Any, int] = {}
        self._members: dict[Any, set] = {}
        self._cost: dict[Any, float] = {}
        self._temp: dict[Any, int] = {}
        self._temp_sum = 0  # of ``_temp``'s values: bounds the buffers live at once (``FusionModel.held_bytes``)
        self._reads: dict[Any, Iterable] = {}  # per kernel, the ops it reads (for the liveness of ``held``)
        #: the last :meth:`price`'s ``scheduled_peak`` of the kernels, where it scheduled them (see :meth:`price`)
        self.scheduled: int | None = None
        #: per kernel, its :class:`Fusion` as :meth:`kernels` lists it, till an edit prices the kernel again
        self._fusions: dict[Any, Fusion] = {}
        #: per kernel, the sums its price is made of (see _kernel)
        self._sums: dict[Any, _KernelSums] = {}
        self._moved: set = set()
        #: per kernel, the (group, argument) of the ``SHARED_ACROSS`` groups it computes members of; and per (group,
        #: argument), how many kernels do (``FusionModel.across``)
        self._across: dict[Any, set] = {}
        self._across_count: dict[tuple, int] = {}
        self._views: dict[Any, float] = {}
        #: the ops that slice (``SLICES``): a kernel with none of them among its members is not :meth:`_sliced`
        self._slicing: set = set()
        #: the products (``dot_general``): an edit of a program with none makes or unmakes no attention kernel
        self._products: set = set()
        self._order = 0
        self._version = 0  # edits so far: the positions (``position``) of an older program are out of date
        #: (version, each op's postorder position, its place in XLA's fusion order or None till asked)
        self._positions: tuple[int, dict, dict | None] | None = None
        #: the postorders walked (:meth:`positions`): one per version of the program read (a test reads it)
        self.walks = 0

    def edit(self, changes: Mapping[Any, "Op | None"]) -> None:
        """Set the op of each key of ``changes`` (``None`` removes it), and bring the kernels up to date.

        An edit leaves a whole program: every op's arguments are ops of it.
        """
        self._version += 1
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
                self._slicing.discard(c)
                self._products.discard(c)
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
            if new.prim in SLICES:
                self._slicing.add(c)
            else:
                self._slicing.discard(c)
            if new.prim == "dot_general":
                self._products.add(c)
            else:
                self._products.discard(c)
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
        if not self._output_chains.isdisjoint(changes):
            self._rechain(seeds, dirty)
        self._lift([c for c, new in changes.items() if new is not None])
        seeds |= self._products_above(seeds)
        self._place(seeds, changes, dirty)
        self._price(dirty, changes)

    def _products_above(self, seeds: set) -> set:
        """The products whose attention kernel (``FusionModel.place``: ``ATTENTION``) an edit at ``seeds`` may make
        or unmake: those that read them through a softmax's operations. Such a product is placed by what is below
        it, so it is placed again even where nothing it reads directly changed. (None where the program has no
        product: nothing is walked.)"""
        found: set = set()
        if not self._products:
            return found
        stack, seen = [x for x in seeds if x in self.ops], set(seeds)
        while stack:
            x = stack.pop()
            for u in self.users.get(x, ()):
                op = self.ops.get(u)
                if op is None or u in seen:
                    continue
                seen.add(u)
                if op.prim == "dot_general":
                    found.add(u)
                if op.prim in SOFTMAX_OPS:
                    stack.append(u)
        return found

    def _rechain(self, seeds: set, dirty: set) -> None:
        """After an edit of an output or of a bitcast an output is of: the values written into the outputs'
        allocations again; each op that joined or left them is placed again, and the kernels that write or read
        it priced again (their temporaries)."""
        visited: set = set()
        held = output_buffers(self, visited)
        self._output_chains = visited
        moved = held ^ self._held_outputs
        self._held_outputs = held
        for x in (moved | self._outputs) if moved else ():
            if x in self.ops:
                seeds.add(x)
                dirty.update(self.homes.get(x, ()))
                if x in self.roots:
                    dirty.add(x)
                dirty |= self._reading(x)

    def _reading(self, x: Any) -> set:
        """The kernels that read ``x``, a projection of it, or a bitcast of either (which reads its buffer)."""
        found: set = set()
        stack, seen = [x], {x}
        while stack:
            for u in self.users.get(stack.pop(), ()):
                found.update(self.homes.get(u, ()))
                op = self.ops.get(u)
                if op is not None and u not in seen and (op.prim == "proj" or bitcast(op)):
                    seen.add(u)
                    stack.append(u)
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
        heappush, place, held = heapq.heappush, self.model.place, self._held_outputs
        users_get, homes_get = users.get, homes.get

        def push(x: Any) -> None:
            if x in ops and x not in queued:
                queued.add(x)
                self._order += 1
                heappush(heap, (-height[x], self._order, x))

        for x in seeds:
            push(x)
        while heap:
            x = heapq.heappop(heap)[2]
            op = ops[x]
            kind = _kind(op)
            old_home, old_root = homes_get(x), roots.get(x)
            if kind in (LEAF, VIEW):
                home, root = None, None
            else:
                need: set = set()
                for u in users_get(x, ()):
                    h = homes_get(u)
                    if h:
                        need |= h
                home, root = place(self, x, kind, need, x in held, roots)
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
            else:
                if x in changes:
                    dirty.update(home or ())
                if root is None and home and bitcast(op):
                    # its operand is placed by the kinds of its readers' kernels, which may have changed
                    for a in op.args:
                        push(a)
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
        model = self.model
        incremental = type(model).kernel is FusionModel.kernel
        roots, held, inner, across = self.roots, self._held_outputs, model.inner, model.prices_across
        costs, temps, reads_of, sums, fusions = self._cost, self._temp, self._reads, self._sums, self._fusions
        for r in dirty:
            fusions.pop(r, None)  # (its members, reads or kind may have changed: a kernel that kept them is not dirty)
            kind = roots.get(r)
            if kind is None:
                costs.pop(r, None)
                self._temp_sum -= temps.pop(r, 0)
                reads_of.pop(r, None)
                sums.pop(r, None)
                self._count_across(r, set())
                continue
            if incremental and kind not in (OTHER, ATTENTION) and not self._sliced(r):
                cost, reads = self._kernel(r, kind, changes)
            else:
                cost, reads = model.kernel(self, r, kind, self._members[r])
                sums.pop(r, None)  # not kept up to date while priced whole
            if across:
                k = sums.get(r)
                self._count_across(r, {key for key in k.sincos if key[0] in SHARED_ACROSS} if k is not None
                                   else model.kernel_across(self, self._members[r]))
            costs[r] = cost
            reads_of[r] = reads
            temp = (sum(_temp(self, a, held, roots)
                        for a in {a if a in roots else buffer_of(self, a, roots) for a in reads})
                    + _temp(self, r, held, roots)
                    + (inner(self.ops[r]) if inner is not None else 0)
                    + (held_scores(self, r) if kind == ATTENTION else 0))
            self._temp_sum += temp - temps.get(r, 0)
            temps[r] = temp

    def _sliced(self, r: Any) -> bool:
        """Whether kernel ``r`` computes a member only where slices read it (``program.sliced_parts``): its sums do
        not follow that part, so it is priced whole. (``sliced_parts`` is empty at once where no member slices: the
        members are tested against the program's slicing ops, which are few, not walked.)"""
        members = self._members[r]
        return not members.isdisjoint(self._slicing) and bool(sliced_parts(self, members, r, slices))

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
        tiebreak, work, reduced = k.tiebreak, k.work, k.reduced
        # Only ops that joined or left a kernel, or changed, can be counted wrong (a fresh kernel: all of them).
        if had:
            came = []
            moved = (*self._moved, *changes)
            for x in moved:
                old = had.get(x)
                if old is not None and (x not in members or old is not ops[x]):
                    came.append((x, old, -1))
                    del had[x]
            for x in moved:
                if x in members and x not in had:
                    had[x] = ops[x]
                    came.append((x, ops[x], 1))
        else:
            for x in members:
                had[x] = ops[x]
            came = [(x, op, 1) for x, op in had.items()]
        transcendental = _primitives.TRANSCENDENTAL
        slice_edges, slice_bytes = k.slice_edges, k.slice_bytes
        edges_get, touch = edges.get, touched.add
        for x, op, sign in came:
            f = facts(op, self)
            tiebreak += sign * f[1]
            if op.family == transcendental:
                k.transcendentals += sign
            if f[2]:
                key = (f[2], op.args[0])
                prims = sincos.setdefault(key, {})
                prims[op.prim] = prims.get(op.prim, 0) + sign
                if not prims[op.prim]:
                    del prims[op.prim]
                    if not prims:
                        del sincos[key]
            else:
                if (x == r and reducing) or f[7]:
                    reduced += sign * f[3]  # apart: a loop's share (parallel_share) scales only the rest
                else:
                    work += sign * f[share]
            slicing = op.prim in SLICES  # (``slices(op, a)``, asked of each argument, is false for every one)
            for a in set(op.args):
                n = edges_get(a, 0) + sign
                if n:
                    edges[a] = n
                else:
                    del edges[a]
                if slicing and slices(op, a):
                    slice_edges[a] = slice_edges.get(a, 0) + sign
                    slice_bytes[a] = slice_bytes.get(a, 0) + sign * f[6]
                touch(a)
            touch(x)
        k.tiebreak, k.work, k.reduced = tiebreak, work, reduced
        touched.update(x for x in changes if x in edges)  # a read op that became a literal, or stopped being one
        reads, spilled = k.reads, k.spilled
        spill = model.spill
        for a in touched:
            op = ops.get(a)
            want = edges_get(a, 0) > 0 and a not in members and op is not None and op.prim != "literal"
            if a in reads:  # counted afresh: a member that slices it may have come or gone
                k.read_bytes -= reads.pop(a)
                k.read_spilled -= spilled.pop(a, 0.0)
            if want:
                f = facts(op, self)
                size = f[6] if op.out_avals else 0
                whole = slice_edges.get(a, 0) < edges[a]  # FusionModel.kernel: read by slices only, their bytes
                size = reads[a] = size if whole else min(size, slice_bytes[a])
                k.read_bytes += size
                if spill and op.out_avals and f[9] and whole:
                    spilled[a] = f[9]
                    k.read_spilled += f[9]
        cost = model.launch + model.node * len(members)
        if model.tiebreak is not None:
            cost += TIEBREAK * k.tiebreak
        par = model.parallel_share(ops[r], kind)
        chain = (model.chain * chained(model, self, members)
                 if model.chain and k.transcendentals >= 2 and kind in (LOOP, REDUCE) else 0.0)
        if par == 1.0:
            cost += k.work + k.reduced
            cost = add_shared(cost, model, ops, sincos)
            if chain:
                cost += chain
        else:
            cost += par * (add_shared(k.work, model, ops, sincos) + chain) + k.reduced
        moved = model.byte * (k.read_bytes + facts(ops[r], self)[8])
        cost = with_bytes(model, kind, cost, moved)  # as FusionModel.kernel adds them
        if model.spill:
            cost += k.read_spilled + facts(ops[r], self)[10]
        return (cost - folded_reduction(model, self, r, kind, members)
                - cached_reduction(model, self, r, kind, members)), reads

    def price(self) -> float:
        """The program's cost, as :meth:`FusionModel.__call__` prices it. Where its fresh charge scheduled the kernels
        (``FusionModel.held_bytes``: not where a bound on them is under ``fresh_at``, then 0), :attr:`scheduled`
        keeps their ``memory.scheduled_peak`` (scratch held), which ``extract.program.LiveProgram.held`` reads instead
        of scheduling them again: the model's ``held`` is ``memory.fresh_peak`` (no scratch) and no kernel is an
        attention kernel (none has scratch), so the two are one schedule of the same kernels, ``inner`` and order."""
        cost = self._kernels_sum()
        self.scheduled = None
        if self.model.prices_peak:
            held = self.model.held_bytes(self, self.kernels, self._temp_sum)
            cost += self.model.memory_price(self.peak(), held)
            if held and self.model.held is fresh_peak and ATTENTION not in self.roots.values():
                self.scheduled = int(held)
        return float(cost)

    def held_at_most(self) -> int:
        """A bound on the temporaries held at once in any order (``memory.scheduled_peak``, scratch held): every
        kernel's reads, writes and what it holds inside, summed (each buffer at least once)."""
        return self._temp_sum

    def price_floor(self) -> float | None:
        """A floor of :meth:`price` read without scheduling the kernels, where :meth:`price` would schedule them
        (``FusionModel.held_bytes``): the same sums, and the memory charge at nothing held (``memory_price`` never
        falls as what is held rises, and every float step of the two is monotone, so the floor is at most the
        price, bit for bit). ``None`` where the price schedules nothing, and so costs no more than the floor."""
        model = self.model
        if not model.prices_peak or model.held is None or not model.fresh > 0 or self._temp_sum < model.fresh_at:
            return None  # (a negative fresh charge would fall as what is held rises)
        return float(self._kernels_sum() + model.memory_price(self.peak(), 0.0))

    def _kernels_sum(self) -> float:
        """The kernels' and views' prices summed, less what the ``SHARED_ACROSS`` groups share: :meth:`price` without
        the memory charge, as ``FusionModel.__call__`` sums it."""
        cost = math.fsum([*self._cost.values(), *self._views.values()])
        if self._across_count:
            cost -= shared_across(self.model, self.ops, self._across_count)
        return cost

    def _count_across(self, r: Any, keys: set) -> None:
        """Kernel ``r`` now computes members of the ``SHARED_ACROSS`` groups ``keys``: the counts follow."""
        old = self._across.get(r, set())
        if old == keys:
            return
        count = self._across_count
        for key in old - keys:
            count[key] -= 1
            if not count[key]:
                del count[key]
        for key in keys - old:
            count[key] = count.get(key, 0) + 1
        if keys:
            self._across[r] = keys
        else:
            self._across.pop(r, None)

    def peak(self) -> int:
        """The program's predicted peak of temporaries, as :meth:`price` reads it."""
        return max(self._temp.values(), default=0)

    def kernels(self) -> list[Fusion]:
        """The program's kernels (their costs left out), for what reads them whole (``FusionModel.held``): each
        listed once and kept till an edit prices it again (its members, reads and kind are what they were), so that
        a search that reads the kernels of each program it prices lists only the kernels its moves touched."""
        fusions, members, reads = self._fusions, self._members, self._reads
        out = []
        for r, kind in self.roots.items():
            k = fusions.get(r)
            if k is None:
                k = fusions[r] = Fusion(r, kind, list(members.get(r, ())), list(reads.get(r, ())), 0.0)
            out.append(k)
        return out

    def position(self, key: Any) -> int:
        """Where op ``key`` is in the program :meth:`rewrite.cost.program.Program.from_choice` makes of the same
        choice (its roots' postorder), which is the order the kernels run in for their liveness."""
        at = self.positions()
        return at.get(key, len(at))

    def positions(self) -> dict:
        """:meth:`position` of every op of the program, in one dict: the postorder from the outputs (operands in
        order), walked once per version of the program, for the position and for :meth:`made_at` alike."""
        found = self._positions
        if found is None or found[0] != self._version:
            self.walks += 1
            ops = self.ops
            at = {c: i for i, c in enumerate(postorder_list(self.outputs, lambda c: ops[c].args))}
            found = self._positions = (self._version, at, None)
        return found[1]

    def made_at(self) -> dict:
        """Each op's place in the order XLA's fusion pass makes kernels (``cost/memory.py``'s ``_made_at``): the
        reverse of the postorder :meth:`positions` walked, so the scheduled peak walks the program once, not twice."""
        at = self.positions()
        version, _, made = self._positions
        if made is None:
            last = len(at) - 1
            made = {c: last - i for c, i in at.items()}
            self._positions = (version, at, made)
        return made


class _KernelSums:
    """What :meth:`LiveFusion._kernel` keeps of one kernel between prices."""

    __slots__ = ("kind", "ops", "tiebreak", "work", "reduced", "sincos", "transcendentals", "edges", "reads",
                 "read_bytes", "spilled", "read_spilled", "slice_edges", "slice_bytes")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.ops: dict[Any, Op] = {}        # each member, with the op it was counted with
        self.tiebreak = 0.0
        self.work = 0.0
        self.reduced = 0.0                  # the reductions' shares (apart from ``work``, which a loop's share scales)
        self.sincos: dict[tuple, dict[str, int]] = {}  # (SHARED group, argument) -> its members here, counted
        self.transcendentals = 0            # members of the transcendental family (transcendental.chained)
        self.edges: dict[Any, int] = {}     # op -> how many members read it
        self.reads: dict[Any, int] = {}     # op read -> its bytes
        self.read_bytes = 0
        self.spilled: dict[Any, float] = {}  # op read -> what moving it costs past the cache (FusionModel.spilled)
        self.read_spilled = 0.0             # their sum
        self.slice_edges: dict[Any, int] = {}  # op -> how many members read it only as the operand they slice
        self.slice_bytes: dict[Any, int] = {}  # op -> the bytes those slices return
