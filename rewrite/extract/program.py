"""Whole-program extraction: pricing a choice as XLA would compile it, and improving it by single switches.

When the cost model prices whole programs (``AnalyticCost.program``: what XLA fuses, stores and recomputes),
:class:`ProgramPricer` prices a choice that way, :class:`LiveProgram` keeps one program's price up to date as
single classes switch node, and :class:`ProgramSearch` refines a choice under that price.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Sequence

from ..cost.live import LiveFusion
from ..cost.floor import peak_floor
from ..cost.memory import fresh_peak, scheduled_peak
from ..cost.model import CostModel
from ..cost.program import Program, chosen_op, of_one_result, one_result, projected_op
from ..ir import primitives as _primitives
from ..ir.intern import PARAMS
from ..ir.walk import operands, walk
from ..records import out_of_time
from .extractor import _CONTAINERS, _LEAVES, Extractor, _crossings, _signature
from .lean import lean_band, leaner, leaner_at_most, time_price


def prices_programs(model: Any) -> bool:
    """Does ``model`` declare a whole-program price (:attr:`rewrite.CostModel.prices_programs`)?"""
    return isinstance(model, CostModel) and bool(model.prices_programs)


class ProgramPricer:
    """The whole-program price of a choice under ``model.program``, with per-node work cached."""

    def __init__(self, ex: "Extractor", model: Any) -> None:
        self.ex, self.model = ex, model
        self._templates, self._bodies = {}, {}  # by id(choice), with the choice kept in _pins
        #: the per-node facts every choice's programs share (``cost/program.py``'s ``chosen_op``): the extractor's
        #: (every pricer of its snapshot builds the same ops), where they are priced by its model; a projection's
        #: are this pricer's (:meth:`templates`)
        self._shared: dict = ex.templates if model is ex.model else {}
        self._plain = _ChoiceTemplates(ex, self._shared)
        self._nested: bool | None = None
        self._pins: dict[int, dict] = {}  # every choice a price is keyed by ``id`` of, kept alive: no other gets its id
        self._known: dict[tuple, float] = {}
        #: the programs counted as priced where what was asked was answered without their price (:meth:`count`)
        self._floored: set[tuple] = set()
        #: whole-program prices (not live sums, in another order) of the programs priced whole, by key: the extractor's
        self.exact: dict[tuple, float] = ex.whole_prices if model is ex.model else {}
        #: the program the last price was asked for (its roots and signature)
        self.last_key: tuple | None = None
        self.evaluations = 0
        #: how many prices were asked for, and how many of those were of a program priced before
        self.asked = 0
        #: the one program every price moves to (:meth:`live`), once one is made
        self._live: LiveProgram | None = None
        #: the peaks its live program was read at, by key (``LiveProgram.peak``, ``extract._peak``): the extractor's
        self.peaks: dict[tuple, int] = ex.peaks if model is ex.model else {}

    def own(self, c: Any, node: tuple, choice: dict[Any, tuple], read: frozenset | None = None) -> float:
        """The node price of ``node`` in class ``c``, its bodies priced under ``choice``; ``read``: the outputs read
        of a call XLA inlines, whose body is priced at what they need (``None``: every output)."""
        ctor, args = node
        bodies = self.ex.body_classes(ctor, args)
        if not bodies:
            return self.ex.own(c, node, choice)
        costs = []
        for b in bodies:
            # A body's cost depends on the choice inside it, which differs between candidates (searches
            # switch classes of the program's own scope only, so it is fixed within one search).
            key = (id(choice), b, read)
            if key not in self._bodies:
                self._pins[id(choice)] = choice
                _, (_, outs) = choice[b]
                items = self.ex.snap.list_items(outs)
                if read is not None and len(bodies) == 1:
                    items = [x for k, x in enumerate(items) if k in read]
                self._bodies[key] = self.ex.dag_cost(choice, items)
            costs.append(self._bodies[key])
        return float(self.model(self.ex.info(c, ctor, args, choice, tuple(costs))))

    def program(self, choice: dict[Any, tuple], roots: Sequence[Any]) -> Any:
        # A live program (the search's moves) prices such calls whole: the search does not move a projection
        # to a second call (ProgramSearch._adds_loop), so only the programs priced whole read one in part.
        return Program.from_choice(self.ex, choice, roots, lambda c, n: self.own(c, n, choice),
                                   self.templates(choice, roots), partial=lambda c, n, read: self.own(c, n, choice, read))

    def templates(self, choice: dict[Any, tuple], roots: Sequence[Any]) -> dict:
        """Per-node facts of the programs ``choice`` makes (a projection's shared by all choices if no node has a body)."""
        if not self._has_bodies(choice, roots):
            return self._plain
        found = self._templates.get(id(choice))
        if found is None:
            found = self._templates[id(choice)] = _ChoiceTemplates(self.ex, self._shared)
            self._pins[id(choice)] = choice
        return found

    def remember(self, key: tuple, price: Callable[[], float]) -> float:
        """The price of the program ``key`` names (``_signature``), from memory or from ``price()``."""
        self.asked += 1
        self.last_key = key
        found = self._known.get(key)
        if found is None:
            if key not in self._floored:  # (counted already where it was answered without it: count)
                self.evaluations += 1
            found = self._known[key] = price()
        return found

    def priced(self, key: tuple) -> bool:
        """Whether the program ``key`` names was priced (its price is remembered)."""
        return key in self._known

    def count(self, key: tuple) -> None:
        """Count the program ``key`` names as priced, as :meth:`remember` counts it (once), where what the caller asks
        was answered without its price (``LiveProgram.price_unless``, ``ProgramSearch._lean``): a search's budget
        (``evaluations``) runs out where it did with every price read, so it makes the same moves."""
        self.asked += 1
        self.last_key = key
        if key not in self._known and key not in self._floored:
            self.evaluations += 1
            self._floored.add(key)

    def live(self, choice: dict[Any, tuple], roots: Sequence[Any]) -> "LiveProgram | None":
        """A :class:`LiveProgram` over ``choice`` (kept up to date in place), if the model can price one.

        There is one per pricer: asked again, it moves to the new choice (:meth:`LiveProgram.jump`), re-placing
        and re-pricing only the kernels where the two programs differ. The searches of one extraction start from
        programs that differ in few classes, and building the kernels of a program afresh costs about twice as
        much as pricing it whole. A peak read is remembered (:attr:`peaks`): a program's kernels, and so its
        peak, are the same whatever moves brought the live program there."""
        live = self._live
        if live is not None and live._roots == tuple(roots):
            live.jump(choice)
            return live
        fusion = getattr(self.model, "program_fusion", None)
        fusion = fusion() if fusion is not None else None
        if fusion is None:
            return None
        live = self._live = LiveProgram(self, fusion, choice, roots)
        return live

    def _has_bodies(self, choice: dict[Any, tuple], roots: Sequence[Any]) -> bool:
        """Whether the program has nested nodes, whose prices depend on the choice (so no sharing of prices)."""
        if self._nested is None:
            nested = lambda ctor: getattr(_primitives.BY_CTOR.get(ctor), "family", None) == _primitives.NESTED  # noqa: E731
            self._nested = any(nested(ctor) for ns in self.ex.snap.nodes.values() for ctor, _ in ns)
        return self._nested

    def __call__(self, choice: dict[Any, tuple], roots: Sequence[Any]) -> float:
        """The price of the program ``choice`` makes at ``roots``; each distinct program is priced once.

        A program is the set of chosen nodes it uses (bodies included), so a search that tries a move it tried
        before, or that reaches from another start a program it priced already, is answered from memory."""
        key = (tuple(roots), _signature(self.ex, choice, roots))
        return self.remember(key, lambda: self.exact_price(choice, roots, key))

    def exact_price(self, choice: dict[Any, tuple], roots: Sequence[Any], key: tuple) -> float:
        """The whole-program price of ``choice`` (whose key is ``key``), remembered from an earlier one if any."""
        found = self.exact.get(key)
        if found is None:
            found = self.exact[key] = self.price(self.program(choice, roots), key)
        return found

    def price(self, prog: Any, key: tuple | None = None) -> float:
        """The model's whole-program price of ``prog``; where ``key`` names it and the price is its fusion model's
        (``program_fusion``), the peak that price charges is remembered as its live program's (:attr:`peaks`,
        ``LiveProgram.peak``: the same kernels' largest temporaries), and where its fresh charge scheduled the kernels
        (none an attention kernel, with scratch) that schedule as the live program's (``LiveProgram.held``), so that a
        caller reading them does not move the live program there (``extract._peak``, ``extract._held``)."""
        fusion = None if key is None else getattr(self.model, "program_fusion", None)
        fusion = fusion() if fusion is not None else None
        if fusion is None:
            return float(self.model.program(prog))
        charged: list = []
        price = fusion(prog, charged)
        if charged:
            self.peaks.setdefault(key, charged[0])
            if charged[1] is not None and fusion.held is fresh_peak:
                self.peaks.setdefault(("held", *key), int(charged[1]))
        return float(price)

    def price_fused(self, fusion: Any) -> float:
        """The model's price of the program a :class:`rewrite.cost.live.LiveFusion` holds."""
        return float(fusion.price())


class _ChoiceTemplates(dict):
    """The per-node facts (``cost/program.py``'s ``chosen_op``) of the programs one choice makes, where nodes have
    bodies (where none has, of every choice one pricer prices).

    Only a projection (its price reads the projected node) has facts kept here; the facts of every other node are
    kept in ``shared``, for every choice and every pricer of the extractor: a node with bodies (its price reads its
    bodies' choice) keeps the choices it read with its facts, which are used only where those are the same.
    """

    __slots__ = ("ex", "shared")

    def __init__(self, ex: "Extractor", shared: dict) -> None:
        super().__init__()
        self.ex = ex
        self.shared = shared

    def get(self, key: tuple, default: Any = None) -> Any:
        found = dict.get(self, key)
        return self.shared.get(key, default) if found is None else found

    def __setitem__(self, key: tuple, value: Any) -> None:
        if key[1][0] == "Proj":
            dict.__setitem__(self, key, value)
        else:
            self.shared[key] = value


class LiveProgram:
    """The program a choice makes, kept up to date as single classes switch node: what :class:`ProgramSearch` prices.

    Reference counts over what each chosen node reads tell which classes a move brings into the program and which
    it leaves behind: over its own scope for the kernels (a :class:`rewrite.cost.live.LiveFusion`, which re-places
    and re-prices only what the move touches), and over bodies too for the program's signature (``_signature``), so
    that a move to a program priced before is answered from the pricer's memory. ``choice`` is updated in place.
    Prices equal the pricer's whole-program ones up to the order of the sums."""

    def __init__(self, pricer: ProgramPricer, fusion: Any, choice: dict[Any, tuple], roots: Sequence[Any]) -> None:
        # A proxy: the pricer keeps this program (ProgramPricer.live), and a cycle would keep the e-graph
        # from its pool until a full collection.
        self.pricer = pricer = weakref.proxy(pricer) if not isinstance(pricer, weakref.ProxyType) else pricer
        self.ex = pricer.ex
        self.roots = list(roots)
        self._roots = tuple(roots)
        self.fusion = LiveFusion(fusion, self.roots)
        self._bind(choice)
        self._ref: dict[Any, int] = {}   # own scope: what the kernels are made of
        self._sig: dict[Any, int] = {}   # bodies included: the signature
        self._ids: set[int] = set()
        self._fused: dict[Any, tuple] = {}  # the node each class has in self.fusion
        self._touched: set[Any] = set()
        #: classes whose op inlines a call's body, with the classes of that body (a move there changes the op)
        self._inlined: dict[Any, set] = {}
        #: classes whose op is built again at the next flush though their node is the same (see jump)
        self._stale: set[Any] = set()
        #: a call of one result -> the class of its value, whose op is the call's (``cost.program.one_result``), and
        #: that class -> the call's node its op was built from
        self._one: dict[Any, Any] = {}
        self._via: dict[Any, tuple] = {}
        for r in self.roots:
            self._inc(r)
            self._inc_sig(r)

    def _bind(self, choice: dict[Any, tuple]) -> None:
        pricer = self.pricer
        self.choice = choice
        self._own = lambda c, n: pricer.own(c, n, choice)
        self._templates = pricer.templates(choice, self.roots)

    def jump(self, choice: dict[Any, tuple]) -> None:
        """Become the program ``choice`` makes (updated in place from now on): any choice, not one move away.

        The reference counts are counted afresh; the kernels are edited where a class's node differs, and where an op
        reads the choice beyond its own node (a nested node's bodies, a projection's loop, an inlined call's body),
        which is built again.
        """
        if choice is self.choice:
            return
        old = self.choice
        self._bind(choice)
        ex, fused = self.ex, self._fused
        ref: dict[Any, int] = {}
        sig: dict[Any, int] = {}
        touched = self._touched
        for r in self.roots:
            touched.update(_crossings(ref, choice, ex.operands, r, 1))
            for _ in _crossings(sig, choice, ex.all_kids, r, 1):
                pass
        touched.update(fused)
        self._ref, self._sig = ref, sig
        self._ids = {ex.pair_id(x, choice[x]) for x in sig}
        if self.pricer.templates(old, self.roots) is not self._templates:
            # Ops whose facts read the choice (ProgramPricer.templates): built again under the new one.
            self._stale.update(x for x, node in fused.items()
                               if node[0] == "Proj" or x in self._inlined or ex.body_classes(*node))

    def _inc(self, c: Any) -> None:
        self._touched.update(_crossings(self._ref, self.choice, self.ex.operands, c, 1))

    def _dec(self, c: Any) -> None:
        self._touched.update(_crossings(self._ref, self.choice, self.ex.operands, c, -1))

    def _inc_sig(self, c: Any) -> None:
        self._ids.update(
            self.ex.pair_id(x, self.choice[x]) for x in _crossings(self._sig, self.choice, self.ex.all_kids, c, 1))

    def _dec_sig(self, c: Any) -> None:
        self._ids.difference_update(
            self.ex.pair_id(x, self.choice[x]) for x in _crossings(self._sig, self.choice, self.ex.all_kids, c, -1))

    def set(self, c: Any, node: tuple) -> None:
        """Switch class ``c`` (one the program uses) to ``node``; the caller has checked that no cycle results."""
        old = self.choice[c]
        if old == node:
            return
        ex = self.ex
        for k in ex.operands(node):
            self._inc(k)
        for k in ex.all_kids(node):
            self._inc_sig(k)
        if self._sig.get(c, 0) > 0:
            self._ids.discard(ex.pair_id(c, old))
            self._ids.add(ex.pair_id(c, node))
        self.choice[c] = node
        self._touched.add(c)
        for k in ex.operands(old):
            self._dec(k)
        for k in ex.all_kids(old):
            self._dec_sig(k)
        for x, body in self._inlined.items():
            if c in body:
                self._touched.add(x)
                self._fused.pop(x, None)  # its op is built again

    def key(self) -> tuple:
        """The pricer's key for the current program (its roots and signature)."""
        return self._roots, frozenset(self._ids)

    def price(self) -> float:
        """The current program's price, from the pricer's memory or from the kernels the moves touched."""
        return self.pricer.remember(self.key(), self._price)

    def price_unless(self, above: float) -> float:
        """:meth:`price`; or, where the program was not priced before and a floor of its price read without
        scheduling its kernels (``LiveFusion.price_floor``) is ``above`` or more, that floor: a search that keeps
        only a program priced below ``above`` learns the same from it (a search that only confirms its start
        scheduled every program it tried: most of its time)."""
        key = self.key()
        if not self.pricer.priced(key):
            self.flush()
            floor = self.fusion.price_floor()
            if floor is not None and floor >= above:
                self.pricer.count(key)
                return floor
        return self.pricer.remember(key, self._price)

    def count(self) -> None:
        """Count the current program as priced (``ProgramPricer.count``), its price not read."""
        self.pricer.count(self.key())

    def _price(self) -> float:
        self.flush()
        price = self.pricer.price_fused(self.fusion)
        if self.fusion.scheduled is not None:  # the kernels' schedule :meth:`held` reads (``LiveFusion.price``)
            self.pricer.peaks[("held", *self.key())] = self.fusion.scheduled
        return price

    def peak(self) -> int:
        """The current program's predicted peak of temporaries (the fusion model's, as its price reads it)."""
        self.flush()
        found = self.pricer.peaks[self.key()] = self.fusion.peak()
        return found

    def held(self, most: float = math.inf) -> int:
        """The temporaries held at once in the order XLA:CPU runs the kernels (``cost.memory.scheduled_peak``), which
        the lean band compares: :meth:`peak` cannot see a kernel write over an operand that dies there. Where
        ``cost.floor.peak_floor`` is over ``most``, that floor, nothing scheduled (what the lean pass asks)."""
        key = ("held", *self.key())  # a program read or priced before (:meth:`_price`; extract._held reads it too)
        if (found := self.pricer.peaks.get(key)) is None:
            self.flush()
            fusion, kernels = self.fusion, self.fusion.kernels()
            if most < math.inf and (floor := peak_floor(fusion, kernels, fusion.model.inner, most)) > most:
                return floor
            found = self.pricer.peaks[key] = scheduled_peak(fusion, kernels, fusion.model.inner)
        return found

    def holds_over(self, most: float) -> bool | None:
        """Whether :meth:`held` is over ``most``, as told by what each kernel holds itself (``cost.floor.peak_floor``
        without the buffers live across kernels): ``False`` where that does not tell; ``None``, not asked, where the
        program was priced before (its price is remembered, and its peak most often: nothing to save)."""
        if self.pricer.priced(self.key()):
            return None
        self.flush()
        fusion = self.fusion
        return peak_floor(fusion, fusion.kernels(), fusion.model.inner, most, across=False) > most

    def flush(self) -> None:
        """Bring the kernels up to date with the moves made since the last price."""
        ex, choice, ref, fused, stale, via = self.ex, self.choice, self._ref, self._fused, self._stale, self._via
        changes: dict[Any, Any] = {}
        touched = self._touched
        touched.update([self._one[x] for x in touched if x in self._one])  # a call of one result: its value's op
        for x in touched:
            want = choice[x] if ref.get(x, 0) > 0 else None
            tup = None if want is None else one_result(ex, want)
            node = want if tup is None else choice[tup]  # what the op is built from
            same = via.get(x) == (None if tup is None else node)
            if want == fused.get(x) and (want is None or x not in stale) and same:
                continue
            if want is None:
                fused.pop(x, None)
                via.pop(x, None)
                self._inlined.pop(x, None)
                changes[x] = None
                continue
            if want[0] != "Proj" and of_one_result(ex, x):
                continue  # the call's op is its value's class's (Program.from_choice)
            fused[x] = want
            if tup is None:
                via.pop(x, None)
                op = chosen_op(ex, x, want, choice, self._own, self._templates, tuple(ex.operands(want)))
            else:
                via[x], self._one[tup] = node, x
                op = projected_op(ex, x, want, choice, self._own, self._templates, tuple(ex.operands(node)))
            if op.memo and "inner" in op.memo:
                self._inlined[x] = set(walk(ex.body_classes(*node), lambda b: ex.all_kids(choice[b])))
            else:
                self._inlined.pop(x, None)
            changes[x] = op
        self._touched.clear()
        stale.clear()
        if changes:
            self.fusion.edit(changes)


class ProgramSearch:
    """Improve a choice under a whole-program price by switching one class at a time.

    A move is priced from the kernels it touches (:class:`LiveProgram`; under a model that prices programs its own
    way, by pricing the whole program again). The search runs only on programs of at most ``max_classes`` classes,
    for at most ``max_evaluations`` prices of distinct programs, and at most ``per_class`` per class of the program
    it starts from (at least 64): on the ecosystem suite the last improving move came within one price per class,
    and the moves after it only confirmed that none improves; and only while the running rewrite has time left
    (``records.out_of_time``, ``Limits.seconds``). A move is kept when it lowers the price and keeps the program
    acyclic. Bodies keep their choice.

    Searches from several starts may share ``visited``, the programs every search has passed through: a search
    that reaches a program another one passed through stops there, since the other went on from it (and the
    extractor keeps the best of all searches)."""

    def __init__(self, ex: "Extractor", pricer: ProgramPricer, choice: dict[Any, tuple], roots: Sequence[Any], *,
                 max_classes: int = 400, max_evaluations: int = 3000, per_class: float = 1.0,
                 visited: set | None = None) -> None:
        self.per_class = per_class
        self.visited = set() if visited is None else visited
        self.ex = ex
        self.pricer = pricer
        self.choice = dict(choice)
        self.roots = list(roots)
        self.max_classes = max_classes
        self.max_evaluations = max_evaluations

    def _kids(self, node: tuple) -> list[Any]:
        return self.ex.term_kids(node)

    def _program_classes(self) -> list[Any]:
        return list(walk(self.roots, lambda c: self._kids(self.choice[c])))

    def run(self, passes: int = 3, known: float | None = None) -> tuple[dict[Any, tuple], float]:
        """Improve the choice; ``known`` is the starting choice's price, if the pricer computed it already."""
        self._live: LiveProgram | None | bool = None
        #: the result's key for the pricer (``None``: not known), set by the search
        self.key: tuple | None = None
        choice, best = self._run(passes, known)
        band = lean_band(self.pricer.model)
        if band:
            best = self._lean(best, band)
        if self._live is False:
            self.key = None  # moves priced whole: the last key asked for need not be the result's
        elif self._live:
            self.key = self._live.key()
        return choice, best

    def _switch(self, c: Any, node: tuple) -> None:
        """Choose ``node`` for ``c`` (the program is priced by :meth:`_price`)."""
        if self._live is None:  # made on the first move: a search over too large a program makes none
            self._live = self.pricer.live(self.choice, self.roots) or False
        if self._live:
            self._live.set(c, node)
        else:
            self.choice[c] = node

    def _price(self) -> float:
        return self._live.price() if self._live else self.pricer(self.choice, self.roots)

    def _price_below(self, above: float) -> float:
        """:meth:`_price`, where a move is kept only if priced below ``above``: a floor of it at ``above`` or more
        (``LiveProgram.price_unless``) answers that no less, so the program's kernels need not be scheduled."""
        return self._live.price_unless(above) if self._live else self.pricer(self.choice, self.roots)

    def _adds_loop(self, cur: tuple, alt: tuple) -> bool:
        """Whether moving a projection from ``cur`` to ``alt`` runs a second loop and keeps the first.

        ``alt`` reads a loop the program does not run, and the loop ``cur``
        reads stays for its other outputs: the move adds a whole loop to save
        one output (on the ecosystem suite and the golden programs, 554 such
        moves, none cheaper). Moving all of a loop's outputs at once is
        :class:`LocalSearch`'s group move. Like a move from a literal, which
        costs nothing (264 moves, none cheaper), it is not priced.
        """
        live = self._live
        if not live or cur[0] != "Proj" or alt[0] != "Proj":
            return False
        ref = live._ref
        return ref.get(alt[1][0], 0) == 0 and ref.get(cur[1][0], 0) > 1

    def _reblocks(self, cur: tuple, alt: tuple) -> bool:
        """Whether a group move from ``cur`` to ``alt`` swaps a loop for the same computation in other blocks.

        Both read loops of one operation, over the same operands, with the same results (the LM head's
        normaliser over 256 or 512 tokens, attention over key blocks of two sizes): the work in their
        bodies is the same, so the model's price of bodies is not what tells them apart, and a larger
        block that raises the peak may be taken where it is cheaper. A swap whose loop has other results
        (a reduction hoisted into the body, an output fewer) moves work into a body, and stays under the
        peak guard of :meth:`_group_move`."""
        a, b = _loop_of(self.ex, self.choice, cur), _loop_of(self.ex, self.choice, alt)
        if a is None or b is None or a[1][0] != b[1][0]:
            return False
        (ta, na), (tb, nb) = a, b
        snap = self.ex.snap
        return (PARAMS.prim(na[1][-1]).name == PARAMS.prim(nb[1][-1]).name and snap.aval(ta) == snap.aval(tb)
                and operands(snap, na) == operands(snap, nb))

    def _may_move(self, cur: tuple, alt: tuple) -> bool:
        """Whether a class choosing ``cur`` may be priced with ``alt`` instead: another node, not a container,
        whose operands the choice computes, not ``cur``'s operation on its operands in another order (a*b for
        b*a: the same program price), and not a move away from a literal (which costs nothing)."""
        if alt == cur or alt[0] in _CONTAINERS or any(k not in self.choice for k in self._kids(alt)):
            return False
        return not _permuted(self.ex, alt, cur) and cur[0] != "Lit"

    def _budget(self, classes: Sequence[Any]) -> int:
        """How many distinct programs one pass over ``classes`` may price (see the class's docstring)."""
        return min(self.max_evaluations, max(64, int(self.per_class * len(classes))))

    def _spent(self, start: int, budget: int) -> bool:
        """Whether a pass that started at ``start`` evaluations has priced its ``budget``, or the rewrite's time is
        spent (``records.out_of_time``): the search then keeps the best program it found."""
        return self.pricer.evaluations - start >= budget or out_of_time()

    def _run(self, passes: int, known: float | None) -> tuple[dict[Any, tuple], float]:
        nodes = self.ex.snap.nodes
        best = self.pricer(self.choice, self.roots) if known is None else known
        here = self.key = self.pricer.last_key  # the starting program's key: the pricer was last asked for it
        if here in self.visited:
            return self.choice, best
        self.visited.add(here)
        start = self.pricer.evaluations
        classes = self._program_classes()
        budget = self._budget(classes)
        self._tried_groups: set = set()
        for n in range(passes):
            if n:
                classes = self._program_classes()
            if len(classes) > self.max_classes:
                break
            improved = False
            live = set(classes)
            for c in classes:
                alts = nodes.get(c, ())
                if len(alts) < 2 or c not in live:
                    continue  # a class an earlier move left out of the program: no move of it changes the price
                for alt in alts:
                    if self._spent(start, budget):
                        return self.choice, best
                    move = self._movable(c, alt)
                    if move is None:
                        continue
                    cur, swap = move
                    price = math.inf  # a swap is priced only as a group move, below
                    if not swap:
                        self._switch(c, alt)
                        price = self._price_below(_below(best))
                    if price < _below(best):
                        best = price
                        improved = True
                        self._tried_groups.clear()
                        if self.pricer.last_key in self.visited:
                            return self.choice, best  # another search went on from here
                        self.visited.add(self.pricer.last_key)
                        live = set(self._program_classes())
                        if c not in live:
                            break
                    else:
                        if not swap:
                            self._switch(c, cur)
                        group = self._siblings(c, alt, live)
                        if not group:
                            continue
                        if self._spent(start, budget):
                            return self.choice, best
                        if self._group_move(c, alt, cur, group, best):
                            best = self._price()
                            improved = True
                            self._tried_groups.clear()
                            if self.pricer.last_key in self.visited:
                                return self.choice, best
                            self.visited.add(self.pricer.last_key)
                            live = set(self._program_classes())
                            if c not in live:
                                break
            if not improved:
                break
        return self.choice, best

    def _movable(self, c: Any, alt: tuple) -> tuple[tuple, bool] | None:
        """``(the class's current node, whether the move swaps one loop for another)`` for a move of class
        ``c`` to ``alt`` that may be tried; ``None`` where it may not (a swap moves all a loop's outputs
        at once, so only a plain move that would make a cycle is refused here)."""
        cur = self.choice[c]
        if not self._may_move(cur, alt):
            return None
        swap = self._adds_loop(cur, alt)
        if not swap and self.ex.reaches(self.choice, self._kids(alt), {c}):
            return None
        return cur, swap

    def _lean(self, best: float, band: float) -> float:
        """From the search's result (priced ``best``), move to leaner programs priced within ``band`` of it.

        Programs that close are equally fast as far as the model can tell (``AnalyticCost.lean_band``), and
        of those the one that holds less memory is the better: the LM head's loss at N=8192 in blocks of 256
        tokens against 512. One pass over the program's classes; a move, or a loop swapped for another (a
        group move), is kept when the price and the time (``lean.time_price``: the price less its memory charge)
        stay within the band of ``best``'s and the program becomes :func:`leaner` than it was
        (:meth:`LiveProgram.held`). Each kept move lowers the peak by a quarter."""
        if len(self._program_classes()) > self.max_classes:
            return best
        if self._live is None:
            self._live = self.pricer.live(self.choice, self.roots) or False
        if not self._live:
            return best  # the model prices programs its own way: no peak to read
        ceiling = best * (1 + band)
        model = self.pricer.model
        fastest = time_price(best, self._live.peak(), model) * (1 + band)
        peak = self._live.held()
        if not leaner(0, peak):
            return best  # no move below would be kept (see accept)
        start = self.pricer.evaluations
        nodes = self.ex.snap.nodes
        classes = self._program_classes()
        budget = self._budget(classes)
        live = set(classes)
        # A move is kept where the program is leaner (``leaner(0, peak)``: a pass that starts where none can is left
        # above, 82 of the suite's 124, 0.08 s, no new price) and its price within the band. Nearly every move tried
        # is priced within the band and is no leaner (the whole steps' forwards: all of them), and what each of its
        # kernels holds itself (``LiveProgram.holds_over``) most often tells that before the price schedules the
        # kernels for its fresh charge; a program declined so counts as priced (``LiveProgram.count``). Else the
        # price first, whose schedule the peak reads where it can. That floor is asked while it tells often enough
        # to pay (:data:`FLOOR_PAYS`; a loop's program holds most across its kernels, which it does not see). The
        # time is read from the kernels' peak the price was computed with (the price flushed them).
        asked = [0, 0]  # floors asked, and those that told

        def accept(price: Callable[[], float], new_peak: Callable[[float], int]) -> bool:
            most = leaner_at_most(peak)
            over = not leaner(0, peak)
            if not over and (asked[0] < FLOOR_TRIES or asked[1] >= FLOOR_PAYS * asked[0]):
                told = self._live.holds_over(most)
                if told is not None:
                    over = told
                    asked[0] += 1
                    asked[1] += told
            if over:
                self._live.count()
                return False
            got = price()
            return (got <= ceiling and leaner(new_peak(most), peak)
                    and time_price(got, self._live.peak(), model) <= fastest)

        self._tried_groups = set()
        for c in classes:
            alts = nodes.get(c, ())
            if len(alts) < 2 or c not in live:
                continue
            for alt in alts:
                if self._spent(start, budget):
                    return best
                move = self._movable(c, alt)
                if move is None:
                    continue
                cur, swap = move
                kept = False
                if not swap:
                    self._switch(c, alt)
                    kept = accept(self._price, self._live.held)
                    if not kept:
                        self._switch(c, cur)
                if not kept:
                    group = self._siblings(c, alt, live)
                    kept = bool(group) and self._group_move(c, alt, cur, group, best, accept)
                if not kept:
                    continue
                self._tried_groups.clear()
                best, peak = self._price(), self._live.held()
                self.visited.add(self.pricer.last_key)
                live = set(self._program_classes())
                if c not in live:
                    break
        return best

    def _siblings(self, c: Any, alt: tuple, live: set) -> list[tuple[Any, tuple]]:
        """The other classes of the program that ``alt``'s node offers, each with its projection: a move to
        ``alt`` that adds a loop the program does not run pays only when every output of that loop moves
        with it (one loop computing two of the program's values, a maximum and a sum, say)."""
        if alt[0] != "Proj":
            return []
        tup = alt[1][0]
        if self._live and self._live._ref.get(tup, 0):
            return []  # the loop runs already: the single move was the whole move
        out = []
        for parent, node in self.ex.snap.parents.get(tup, ()):
            if parent != c and parent in live and node[0] == "Proj" and self.choice.get(parent) != node:
                out.append((parent, node))
        return out

    def _group_move(self, c: Any, alt: tuple, cur: tuple, group: list, best: float,
                    accept: Callable[[Callable[[], float], Callable[[float], int]], bool] | None = None) -> bool:
        """Move ``c`` to ``alt`` and ``group`` to their projections at once; kept when cheaper, acyclic,
        and not holding more temporaries (or, given ``accept(price, peak)``, ``peak`` a function that reads
        it, :meth:`LiveProgram.held`, and ``price`` one that reads the price: acyclic and accepted).

        A group move swaps one loop for another. The model prices a loop body from its operations, not from the
        kernels XLA makes of them on every iteration, so a swap that only moves work into a body is priced too
        cheap: a reduction of an output the program returns anyway (stacked either way) hoisted into its loop was
        predicted 8.0% and 0.005% cheaper on two RNNs and measured 0.82x both (``tests/test_scan.py``,
        ``tests/test_loops.py``). The swaps that pay lower the predicted peak (a loop over token blocks in place of
        the LM head's logits), so a swap that raises it is not made, unless it swaps a loop for the same loop in
        other blocks (:meth:`_reblocks`), whose bodies do the same work.
        """
        # The same move comes from every class of the program that the new loop offers (each of a loop's
        # outputs, moving all of them to the other loop): one declined since the search last moved is declined
        # again, with the same prices (the pricer remembers them), so it is not made and undone again.
        tried = frozenset([(c, alt), *group])
        if tried in self._tried_groups:
            return False
        peak = self._live.peak() if self._live and accept is None else None  # (``accept`` reads its own)
        moved = [(c, cur)]
        self._switch(c, alt)
        for x, node in group:
            if self._live and not self._live._ref.get(x, 0):
                continue  # the first move took it out of the program
            moved.append((x, self.choice[x]))
            self._switch(x, node)
        kids = [k for x, _ in moved for k in self._kids(self.choice[x])]
        ok = not self.ex.reaches(self.choice, kids, {x for x, _ in moved})
        if ok and accept is not None:
            if accept(self._price, self._live.held):
                return True
        elif ok and self._price_below(_below(best)) < _below(best) and (
                peak is None or self._live.peak() <= peak or self._reblocks(cur, alt)):
            return True
        for x, old in reversed(moved):
            self._switch(x, old)
        self._tried_groups.add(tried)
        return False


#: :meth:`ProgramSearch._lean` asks each move's floor first (``LiveProgram.holds_over``) for its first
#: ``FLOOR_TRIES`` moves, then while at least ``FLOOR_PAYS`` of those asked told that the move is no leaner: a floor
#: costs a tenth to a quarter of the price it saves where it tells (0.10-0.16 ms against 0.55-1.41 ms a program on
#: the whole steps; every floor told on their forwards, 28 of 78 on equinox's scanned remainder).
FLOOR_TRIES = 16
FLOOR_PAYS = 0.15


def _below(best: float) -> float:
    """What a search's move must be priced below to be kept: ``best`` less a relative hair (rounding)."""
    return best - 1e-9 * max(1.0, abs(best))


def _loop_of(ex: "Extractor", choice: dict[Any, tuple], proj: tuple) -> tuple[Any, tuple] | None:
    """The class and node of the loop (a nested operation) that a projection ``proj`` reads, if any."""
    if proj[0] != "Proj":
        return None
    tup = proj[1][0]
    node = choice.get(tup)
    if node is None or node[0] in _LEAVES or node[0] == "Proj" or not ex.body_classes(*node):
        return None
    return tup, node


def _permuted(ex: "Extractor", a: tuple, b: tuple) -> bool:
    """Whether two nodes apply one primitive, with the same parameters, to the same operands in another order."""
    if a[0] != b[0] or a[0] in _LEAVES or a[0] == "Proj" or a[1][-1] != b[1][-1]:
        return False
    ka, kb = ex.term_kids(a), ex.term_kids(b)
    return len(ka) == len(kb) and sorted(ka, key=hash) == sorted(kb, key=hash)  # (a class's repr is an address)
