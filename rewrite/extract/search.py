"""Whole-program search: a choice improved by single switches under the whole-program price.

:class:`ProgramSearch` refines a choice under :class:`rewrite.extract.program.ProgramPricer`'s price, moving one class
(or all the outputs of one loop) at a time in the pricer's :class:`rewrite.extract.program.LiveProgram`, then, where
the model has a lean band, to leaner programs priced within it (``ProgramSearch._lean``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from ..ir.intern import PARAMS
from ..ir.walk import operands, walk
from ..records import out_of_time
from .extractor import _CONTAINERS, _LEAVES, Extractor
from .lean import lean_band, leaner, leaner_at_most, time_price
from .program import LiveProgram, ProgramPricer


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
        self._band = band = lean_band(self.pricer.model)
        #: (:meth:`_price_below`) the programs moves reached that hold more than a bound, by key: none is leaner than
        #: a program of at least that bound's; and the bound of the program it starts from (``None``: not read yet)
        self._declined: dict[tuple, float] = {}
        self._most: float | None = None
        self._asked = [0, 0]  # (:meth:`_holds_over`) the floors asked, and those that told
        choice, best = self._run(passes, known)
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
        """:meth:`_price`, where a move is kept only if priced below ``above``: a floor of the price at ``above`` or
        more (``LiveProgram.floor``) answers that no less, and the program's kernels are not scheduled. Where the
        search has a lean pass, which weighs the same moves again, only where what the moved program's kernels hold
        themselves shows it no leaner than the current one could keep (``LiveProgram.holds_over``), which that pass
        then reads (``_declined``); else it is priced now, as that pass would price it (a loop's program holds most
        across its kernels, which the floor does not see: equinox's scanned remainders)."""
        live = self._live
        if not live:
            return self.pricer(self.choice, self.roots)
        key = live.key()
        if not self.pricer.priced(key) and (floor := live.floor()) is not None and floor >= above:
            most = self._most
            if most is None or most == -math.inf or self._holds_over(most):
                if most is not None and most > -math.inf:
                    self._declined[key] = max(most, self._declined.get(key, most))
                self.pricer.count(key)
                return floor
        return live.price()

    def _holds_over(self, most: float) -> bool:
        """``LiveProgram.holds_over(most)`` of the current program, asked while it tells often enough to pay
        (:data:`FLOOR_PAYS`); ``False`` where not asked, or where the program was priced before."""
        asked = self._asked
        if asked[0] >= FLOOR_TRIES and asked[1] < FLOOR_PAYS * asked[0]:
            return False
        told = self._live.holds_over(most)
        if told is None:
            return False
        asked[0] += 1
        asked[1] += told
        return told

    def _lean_bound(self) -> None:
        """Before the first move of :meth:`_run`: where the search has a lean pass, the most a program leaner than
        the one it starts from holds (``leaner_at_most`` of its :meth:`LiveProgram.held`), for :meth:`_price_below`;
        ``-inf`` where every buffer its kernels hold, summed, is leaner than nothing (``LiveFusion.held_at_most``):
        its peak is not read (nor is it by the lean pass, whose programs then cannot be leaner either)."""
        if self._band and self._most is None:
            if self._live is None:
                self._live = self.pricer.live(self.choice, self.roots) or False
            if self._live:
                self._live.flush()
                self._most = (leaner_at_most(self._live.held()) if leaner(0, self._live.fusion.held_at_most())
                              else -math.inf)

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
                    self._lean_bound()
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
        def accept(price: Callable[[], float], new_peak: Callable[[float], int]) -> bool:
            most = leaner_at_most(peak)
            over = (not leaner(0, peak) or self._declined.get(self._live.key(), -math.inf) >= most  # (told already)
                    or self._holds_over(most))
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
