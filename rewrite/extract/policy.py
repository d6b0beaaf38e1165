"""Extraction policy: what is taken out of the e-graph before the cheapest program is read off it.

Two policies sit between saturation and extraction. Preferred rules
(``rule(..., prefer=True)``, ``rules/prefer.py``) bar the forms they replaced,
so extraction must take their replacement wherever it was built: a bar that
would leave a class of the program without a finite-cost choice is lifted
again and reported as lifted, so a preference never makes a program
unextractable. A ruleset's ``min_saving`` keeps the program its rules built
only if it saves at least that fraction of the input program's cost over the
best program without them.

After emission, :func:`no_fatter` keeps a rewritten program only if it is not predicted to hold more
temporaries than the input program.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from ..cost.model import CostModel
from ..ir.egraph import EGraph
from ..records import Barred
from .choice import reachable
from .extract import extract, fatter
from .extractor import Extractor


def worth_their_saving(ex: Any, snap: Any, eg: EGraph, entries: Sequence[tuple[Any, Any]], roots: list,
                        model: CostModel, original: set) -> Any:
    """A ruleset's ``min_saving``: if the chosen program uses nodes built by rules of rulesets that ask
    for one, the program is extracted again without any node those rules built, and that program is
    used unless theirs saves at least the largest such fraction of the input program's cost more."""
    floors = {r.name: owner.min_saving for r, owner in entries if getattr(owner, "min_saving", 0.0) > 0}
    if not floors or not ex.rewritten or not (0 < ex.original_cost < float("inf")):
        return ex
    made: dict[tuple, str] = {}
    for vid, origin in enumerate(eg.vorigin):
        if origin in floors:
            key = eg.canonical(snap, vid)
            if key is not None and key not in original:
                made.setdefault(key, origin)
    used = {made[n] for n in (ex.choice[c] for c in reachable(snap, ex.choice, roots)) if n in made}
    if not used:
        return ex
    without = snap.without(lambda cls, node: node in made)
    alt = extract(without, roots, model, original)
    if alt.cost - ex.cost < max(floors[r] for r in used) * ex.original_cost:
        return alt
    return ex


def no_fatter(ex: Any, before: Any, after: Any, emit_choice: Callable[[dict], Any], model: CostModel
              ) -> tuple[Any, Any]:
    """``(ex, after)``, unless the chosen rewrite is predicted to hold more temporaries at its peak than the input
    program ``before`` (``extract.fatter``): then ``ex.leaner_fallback`` (the cheapest candidate that holds
    no more, the input at worst) and its program.

    Two estimates must agree that it holds more: the extraction's live peak (``Extraction.leaner_fallback`` is set
    only where it says so) and the emitted programs' (``AnalyticCost.predict_temp_bytes``, ``cost/memory.py``).
    Each misses on some programs (a batched LM head's blocks, attention's gradient), where the other does not, and
    a guard that fired on either alone moved decisions measured right. A rewrite trades memory for time only
    where the user asks for it (``memory=0`` prices time alone; ``memory_budget`` bounds it): a faster program
    that holds more is a regression a user cannot see coming. Merging two reductions into one, which keeps both
    operands alive together, was the usual cause (a distrax mixture's gradient held one more ``[N, K, D]``
    array, 424 -> 552 KiB, for no measured speed). Where preferred rules barred the input's forms (a stable form
    for an unstable one) there is no input candidate, and no fallback.
    """
    fallback = getattr(ex, "leaner_fallback", None)  # set only for a model that bounds memory (extract.bounds_memory)
    predict = getattr(model, "predict_temp_bytes", None)
    if fallback is None or predict is None or not fatter(predict(after), predict(before)):
        return ex, after
    return (dataclasses.replace(ex, choice=fallback.choice, cost=fallback.cost, rewritten=fallback.rewritten,
                                lean=False, leaner_fallback=None), emit_choice(fallback.choice))


def bar_preferred(snap: Any, eg: EGraph, notes: list, model: CostModel) -> dict[str, int]:
    """Take the forms preferred rules replaced out of extraction (rewrite/rules/prefer.py); per rule, the classes forced."""
    if not notes:
        return {}
    ex = Extractor(snap, model)
    barred, forced = bar(snap, eg, notes, lambda allowed: ex.tree(allowed)[1])
    for cls, drop in barred.items():
        snap.nodes[cls] = [n for n in snap.nodes[cls] if n not in drop]
    return forced


def bar(snap: Any, egraph: Any, notes: list[Barred],
        tree: Callable[[Callable[[Any, str, tuple], bool]], dict]) -> tuple[dict[Any, set], dict[str, int]]:
    """The nodes to leave out of extraction, by class, and per rule how many classes it forced.

    ``tree(allowed)`` is extraction's bottom-up pass restricted to the allowed
    nodes; it returns the classes that keep a finite-cost choice. A bar that
    leaves a class the program needs without one is lifted, class by class,
    until every class computable before stays computable.
    """
    barred: dict[Any, set] = {}
    owner: dict[Any, set] = {}
    for n in notes:
        cls = snap.cls_of_name[n.root] if n.root < len(snap.cls_of_name) else None
        if cls is None or not n.ctors:
            continue
        built = egraph.canonical(snap, n.built)
        nodes = snap.nodes.get(cls, ())
        drop = {x for x in nodes if x[0] in n.ctors and x != built}
        if drop and len(drop) < len(nodes):
            barred.setdefault(cls, set()).update(drop)
            owner.setdefault(cls, set()).add(n.rule)
    if not barred:
        return {}, {}
    before = set(tree(lambda cls, ctor, args: True))
    while barred:
        after = set(tree(lambda cls, ctor, args: (ctor, args) not in barred.get(cls, ())))
        lost = before - after
        if not lost:
            break
        # A barred class that keeps a choice keeps its users' too, so some lost class is barred.
        lift = [c for c in lost if c in barred] or list(barred)
        for c in lift:
            barred.pop(c, None)
            owner.pop(c, None)
    forced: dict[str, int] = {}
    for rules in owner.values():
        for r in rules:
            forced[r] = forced.get(r, 0) + 1
    return barred, forced
