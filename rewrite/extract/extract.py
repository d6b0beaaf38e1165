"""Extract: choose one node per e-class, minimising the cost model.

The extractor reads the frozen e-graph, not egglog's own extractor: egglog's
default counts a shared node once per use (tree cost) and overflows on large
DAGs, and its DAG-aware extractor is too slow at our sizes (see
``docs/design.md``).

1. A bottom-up pass in the style of Knuth's generalisation of Dijkstra's
   algorithm gives every class its cheapest node, given its children's
   costs. A node is only considered once all its children are settled, so
   the choice is acyclic by construction.
2. The same pass over the input program's own nodes gives the input program
   (after common-subexpression elimination).
3. :class:`LocalSearch` improves the first under the true DAG cost (each
   class once per scope, a body once per execution of its loop), switching
   one class, or all the outputs of one loop, at a time.
4. When the cost model also prices whole programs (``AnalyticCost.program``:
   what XLA fuses, stores and recomputes, ``rewrite/cost/fusion.py``), the
   candidates are priced that way, and :class:`ProgramSearch` refines the
   better rewritten one, and the input program, with single-class switches
   under that price: whether a value is stored or recomputed in every loop
   that reads it depends on the whole program, which no sum of node costs
   sees. A switch re-prices only the kernels it touches (:class:`LiveProgram`,
   one per extraction, moved between the searches' starts).
5. The cheapest candidate wins, and the input program is one of them, so the
   result never costs more than the input; with no rules it is the input.
   The distinct candidates stay available, cheapest first, for
   ``cost_model="measure"`` to time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from ..cost.model import CostModel
from ..ir.egraph import Snapshot
from .extractor import Extractor, _signature, search, shared
from .lean import lean_band, leaner, leaner_at_most, time_price
from .program import ProgramPricer, prices_programs
from .search import ProgramSearch


@dataclasses.dataclass
class Candidate:
    """One candidate program: a node per class, its price, and whether it is a rewrite of the input."""

    choice: dict[Any, tuple]     # class -> chosen e-node (ctor, args)
    cost: float
    rewritten: bool              # False for the input program
    #: the program's key for the whole-program pricer (its roots' signature), kept to ask for it once; None: not asked
    signature: frozenset | None = None


@dataclasses.dataclass
class Extraction:
    choice: dict[Any, tuple]     # class -> chosen e-node (ctor, args)
    cost: float
    original_cost: float
    rewritten: bool              # False when the input program was kept
    #: the distinct candidate programs, cheapest first
    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    #: chosen over the cheapest for a lower peak of live memory, within the model's ``lean_band``
    lean: bool = False
    #: where the chosen rewrite is predicted (by the extraction's live peak) to hold more temporaries than the input
    #: program, the cheapest candidate that holds no more, the input at worst (``extract.policy.no_fatter``)
    leaner_fallback: "Candidate | None" = None
    #: where the memory tie (``extract.tie``) replaced the choice: XLA's temporaries of the program kept and of the
    #: one it replaced
    xla_temps: "tuple[int, int] | None" = None


def input_cost(snap: Snapshot, outs: Sequence[int], token: int | None, model: CostModel) -> float:
    """The cost of the program as loaded (before any rule ran), under ``model``.

    Where every class holds one node (nothing to choose), the snapshot's shared extractor prices it: programs priced
    from one load (``run_together``'s two joints, ``pipeline.programs_cost``, ``ProofGraph.price``'s losses) share
    most of their nodes, whose ops' facts (``ProgramPricer.templates``: a node's, read off its class and itself, and
    a nested node's with the choice inside its bodies, which it checks) are then made once. No pass is made on it."""
    roots = [snap.cls_of_name[o] for o in outs] + ([snap.cls_of_name[token]] if token is not None else [])
    if all(len(ns) == 1 for ns in snap.nodes.values()):
        ex = shared(snap, model)
        choice = {c: ns[0] for c, ns in snap.nodes.items()}  # as loaded, nothing to choose (no class reaches itself)
    else:
        ex = Extractor(snap, model)
        _, choice = ex.tree()
    if prices_programs(model):
        pricer = ProgramPricer(ex, model)
        return pricer.price(pricer.program(choice, roots))
    return ex.dag_cost(choice, roots)


#: A second ``ProgramSearch`` starts from the input program only where the input prices at most this
#: fraction above the best rewritten candidate: a rewrite that pays only from the input program shows
#: where the input is already as cheap as the best rewrite (a backward pass, an optimizer chain), and
#: where it prices more the search from the rewritten start finds as much for less time
#: (``benchmarks/results/log.md``).
INPUT_START = 1e-3


def extract(snap: Snapshot, roots: Sequence[Any], model: CostModel, original: set[tuple] | None,
            floored: Callable[[Candidate, float], bool] | None = None, refine: bool = True) -> Extraction:
    """Choose the program to emit. ``original`` holds the input program's nodes, canonicalised.

    ``floored(candidate, input_cost)``, where given, says whether a rewritten candidate would be left as loaded
    after (``extract.policy.floored``): where the cheapest and every rewritten candidate the lean band could take
    instead would be, the input program is returned, unrewritten, and the band's peaks (``_leanest``) and the
    leaner fallback (``_no_fatter``) are not read: whichever of them they chose, the input is what comes out
    (where the band would have taken the input itself, the same program, not marked ``lean``).

    ``refine=False``: the candidates are not refined by :class:`ProgramSearch` (a program read off for another
    pipeline to rewrite again, which refines its own: ``pipeline.plain_program``)."""
    ex = shared(snap, model)
    _, tree_choice = ex.tree()
    missing = [r for r in roots if r not in tree_choice]
    if missing:
        raise RuntimeError("extraction found no finite-cost program for an output; the e-graph is malformed")
    candidates = [Candidate(search(ex, tree_choice, roots), math.nan, True)]
    orig_choice = None
    if original is not None:
        orig_choice = ex.original_tree(original)
        if all(r in orig_choice for r in roots):
            # A rewrite that pays off only from the input program is found by the ProgramSearch from there
            # (below), so the input is not also locally searched under the node model: that third
            # candidate found next to nothing for its time (benchmarks/results/log.md).
            candidates.append(Candidate(orig_choice, math.nan, False))
        else:
            orig_choice = None
    price: ProgramPricer | None = None
    if prices_programs(model):
        price = ProgramPricer(ex, model)  # each distinct program is priced once
        for cand in candidates:
            cand.cost = price(cand.choice, roots)
            cand.signature = price.last_key[1]
        # Refine the best rewritten candidate under the whole-program price, and the input where it is a
        # start as good (see INPUT_START).
        starts = sorted([cand for cand in candidates if cand.rewritten], key=lambda cand: cand.cost)[:1]
        if orig_choice is not None:
            # The input program again: it reaches only classes of orig_choice (a closed choice), so it is the same program.
            orig = next(cand for cand in candidates if not cand.rewritten)
            if not starts or orig.cost <= starts[0].cost * (1 + INPUT_START):
                starts.append(Candidate({**tree_choice, **orig_choice}, orig.cost, True, orig.signature))
        refined_from: set[frozenset] = set()
        visited: set = set()
        for start in starts if refine else ():
            if start.signature in refined_from:
                continue
            refined_from.add(start.signature)
            price.last_key = (tuple(roots), start.signature)  # the search starts from the program the pricer was asked for
            refine = ProgramSearch(ex, price, start.choice, roots, visited=visited)
            refined, cost = refine.run(known=start.cost)
            candidates.append(Candidate(refined, cost, True, None if refine.key is None else refine.key[1]))
    else:
        for cand in candidates:
            cand.cost = ex.dag_cost(cand.choice, roots)
    distinct: dict[frozenset, Candidate] = {}
    for cand in candidates:
        key = _signature(ex, cand.choice, roots) if cand.signature is None else cand.signature
        old = distinct.get(key)
        if old is None or (old.rewritten and not cand.rewritten):  # the same program as the input is the input
            distinct[key] = cand
    ranked = sorted(distinct.values(), key=lambda cand: (cand.cost, cand.rewritten))
    best = ranked[0]
    orig_cost = next((cand.cost for cand in ranked if not cand.rewritten), math.inf)
    # Ties go to the input program, and so do savings smaller than the model's ``min_saving``.
    keep_below = max(0.0, float(getattr(model, "min_saving", 0.0) or 0.0))
    for cand in ranked:
        if not cand.rewritten and cand.cost <= best.cost * (1 + 1e-9) + keep_below * cand.cost:
            best = cand
    band = lean_band(model)
    if floored is not None and best.rewritten and orig_cost < math.inf:
        reach = [best] + ([cand for cand in ranked if cand is not best and cand.rewritten
                           and cand.cost <= ranked[0].cost * (1 + band)] if price is not None and band else [])
        if all(floored(cand, orig_cost) for cand in reach):
            written = next(cand for cand in ranked if not cand.rewritten)
            return Extraction(written.choice, written.cost, orig_cost, False, ranked)
    cheapest = best
    if price is not None and band:
        best = _leanest(ranked, best, price, roots, band)
    fallback = (_no_fatter(ranked, best, price, roots)
                if price is not None and best.rewritten and bounds_memory(model) else None)
    return Extraction(best.choice, best.cost, orig_cost, best.rewritten, ranked, lean=best is not cheapest,
                      leaner_fallback=fallback)


#: A rewritten program predicted to hold at least this many bytes of temporaries more than the input program, and
#: at least this fraction of the input's more, may not be used (``extract.policy.no_fatter``): a page, below which
#: XLA's allocations round, and 2%, below which the estimates do not tell two programs apart (blocked attention at
#: N=512 in bfloat16 was predicted 0.2% over the plain program by both, and held 23% less).
FATTER_BYTES = 4096
FATTER_RATIO = 0.02


def bounds_memory(model: Any) -> bool:
    """Whether ``model`` holds a rewrite to the input program's memory: it prices memory (``memory=0`` prices
    time alone) and sets no ``memory_budget`` (which bounds it instead)."""
    return bool(float(getattr(model, "memory", 0.0) or 0.0)) and getattr(model, "memory_budget", None) is None


def _peak(price: ProgramPricer, cand: Candidate, roots: Sequence[Any]) -> int | None:
    """``cand``'s predicted peak of temporaries, as the extraction's live program reads it: remembered where a
    search read it already (``ProgramPricer.peaks``), which saves moving the live program back there."""
    found = None if cand.signature is None else price.peaks.get((tuple(roots), cand.signature))
    if found is not None:
        return found
    live = price.live(cand.choice, roots)
    return live.peak() if live else None


def _held(price: ProgramPricer, cand: Candidate, roots: Sequence[Any], most: float = math.inf) -> int | None:
    """``cand``'s temporaries held at once in the order XLA runs its kernels (``LiveProgram.held``), remembered as
    :func:`_peak` remembers a peak: what the lean band compares. Where it is over ``most``, any bound over it (the
    floor ``held(most)`` reads before it schedules)."""
    found = None if cand.signature is None else price.peaks.get(("held", tuple(roots), cand.signature))
    if found is not None:
        return found
    live = price.live(cand.choice, roots)
    return live.held(most) if live else None


def _time(price: ProgramPricer, cand: Candidate, roots: Sequence[Any]) -> float | None:
    """``cand``'s price less its memory charge (``lean.time_price``), read from the kernels' peak its price was
    computed with (:func:`_peak`); ``None`` where no peak is read."""
    peak = _peak(price, cand, roots)
    return None if peak is None else time_price(cand.cost, peak, price.model)


def fatter(peak: float, than: float) -> bool:
    """Whether a predicted peak of ``peak`` bytes holds more than one of ``than`` (:data:`FATTER_BYTES`,
    :data:`FATTER_RATIO`)."""
    return peak - than >= max(FATTER_BYTES, FATTER_RATIO * than)


def _no_fatter(ranked: list[Candidate], best: Candidate, price: ProgramPricer, roots: Sequence[Any]
               ) -> Candidate | None:
    """``None`` if ``best`` is not predicted to hold more temporaries at its peak than the input program (by
    :func:`fatter`); else the cheapest candidate that holds no more, the input at worst."""
    orig = next((cand for cand in ranked if not cand.rewritten), None)
    if orig is None:
        return None
    limit = _peak(price, orig, roots)
    top = _peak(price, best, roots)
    if limit is None or top is None or not fatter(top, limit):
        return None
    for cand in ranked:
        if cand is orig:
            return orig
        p = _peak(price, cand, roots)
        if p is not None and not fatter(p, limit):
            return cand
    return orig


def _leanest(ranked: list[Candidate], best: Candidate, price: ProgramPricer, roots: Sequence[Any],
             band: float) -> Candidate:
    """Of the candidates priced within ``band`` of the cheapest, and whose times (``lean.time_price``: a price less
    its memory charge) are within ``band`` of ``best``'s, the leanest, where it is :func:`leaner` than ``best``
    (``AnalyticCost.lean_band``: the model cannot tell their times apart). A candidate's peak is scheduled only
    where its floor (``LiveProgram.held``) is at most both the most a leaner peak holds and the least so far: one
    over either is neither the leanest (ties: the cheaper, then the first) nor leaner, so none is skipped that
    could be chosen."""
    within = [cand for cand in ranked if cand is not best and cand.cost <= ranked[0].cost * (1 + band)]
    if not within:
        return best
    top = _held(price, best, roots)
    if not leaner(0, top):
        return best  # nothing holds less than nothing: no candidate's peak need be read
    fastest = _time(price, best, roots)
    if fastest is None:
        return best
    within = [cand for cand in within if (t := _time(price, cand, roots)) is not None and t <= fastest * (1 + band)]
    chosen, bar = None, leaner_at_most(top)
    for i, cand in enumerate(within):
        most = bar if chosen is None else min(bar, chosen[0])
        if (p := _held(price, cand, roots, most)) is not None and p <= most and (
                chosen is None or (p, cand.cost, i) < chosen[:3]):
            chosen = (p, cand.cost, i, cand)
    return best if chosen is None else chosen[3]
