"""Whole-program extraction: pricing a choice as XLA would compile it, and improving it by single switches.

When the cost model prices whole programs (``AnalyticCost.program``: what XLA fuses, stores and recomputes),
:class:`ProgramPricer` prices a choice that way, and :class:`LiveProgram` keeps one program's price up to date as
single classes switch node: what ``extract/search.py``'s ``ProgramSearch`` refines a choice with.
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
from ..ir.walk import walk
from .extractor import Extractor, _crossings, _signature


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
        was answered without its price (``ProgramSearch._price_below``, ``ProgramSearch._lean``): a search's budget
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

    def floor(self) -> float | None:
        """A floor of :meth:`price` read without scheduling the kernels (``LiveFusion.price_floor``), or ``None``
        where the price schedules none."""
        self.flush()
        return self.fusion.price_floor()

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
