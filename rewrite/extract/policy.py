"""Extraction policy: what is taken out of the e-graph before the cheapest program is read off it.

Two policies sit between saturation and extraction. Preferred rules
(``rule(..., prefer=True)``, ``rules/prefer.py``) bar the forms they replaced,
so extraction must take their replacement wherever it was built: a bar that
would leave a class of the program without a finite-cost choice is lifted
again and reported as lifted, so a preference never makes a program
unextractable. A ruleset's ``min_saving`` keeps the program its rules built
only if it saves at least that fraction of the input program's cost over the
best program without them. Recomputing rules (``Ruleset(recomputes=True)``) are withheld
from the choice, and their forms are then taken together as one whole-program candidate, kept
only where it prices no higher and frees memory (:func:`recomputations`).

After emission, :func:`no_fatter` keeps a rewritten program only if it is not predicted to hold more
temporaries than the input program.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np

from ..cost.model import CostModel
from ..ir.egraph import EGraph
from ..ir.walk import children, operands
from ..records import Barred, out_of_time
from .choice import reachable
from .extract import Candidate, _peak, extract, fatter
from .extractor import _CONTAINERS, Extractor, shared
from .program import ProgramPricer, prices_programs


def worth_their_saving(ex: Any, snap: Any, eg: EGraph, entries: Sequence[tuple[Any, Any]], roots: list,
                        model: CostModel, original: set, as_loaded: bool = False, refine: bool = True) -> Any:
    """A ruleset's ``min_saving``: if the chosen program uses nodes built by rules of rulesets that ask
    for one, the program is extracted again without any node those rules built, and that program is
    used unless theirs saves at least the largest such fraction of the input program's cost more. Where the
    rewrite's time is spent (``records.out_of_time``, ``Limits.seconds``), the chosen program is kept unchecked.

    The program without them is extracted from one copy of ``snap`` per input program (:func:`copy_without`), so
    a VJP's joint program and its gradients alone (``grad/vjp.py``) take one, whose nodes are priced and passed
    over once, and the copy takes the input program's own tree pass from ``snap``'s extractor where it is the same
    pass (:func:`same_original_tree`).

    ``as_loaded``: where the chosen program saves less than that fraction of the input's cost, the program without
    those rules is what is used whatever it is (it prices no less than the chosen one, and the input program is one
    of its candidates), and it saves less than the floor too; it is then not extracted, and the input program is
    kept as loaded (:func:`floored`). A decision for a whole step's joint programs only
    (:func:`rewrite.pipeline.run_together` with ``as_loaded``, from ``grad/together.py``'s ``rewrite_joints``).
    ``refine``: as ``extract.extract``'s, for the program without them."""
    floors = _floors(entries)
    if not floors or not ex.rewritten or not (0 < ex.original_cost < float("inf")):
        return ex
    floor = _floor_of(ex.choice, snap, eg, floors, roots, original)
    if floor is None or out_of_time():  # (the rewrite's time spent: the program found is kept, not extracted again)
        return ex
    kept = floored(ex, floor) if as_loaded else None
    if kept is not None:
        return kept
    without, made = copy_without(snap, eg, frozenset(floors), original)
    full, copy = shared(snap, model), shared(without, model)
    copy.share_prices(full)  # the input program, priced by the first extraction, is a candidate of the second
    same_original_tree(full, copy, made, original)
    alt = extract(without, roots, model, original, refine=refine)
    if alt.cost - ex.cost < floor * ex.original_cost:
        return alt
    return ex


def _floors(entries: Sequence[tuple[Any, Any]]) -> dict[str, float]:
    """Each rule's ``min_saving``, of the rules whose rulesets ask for one."""
    return {r.name: owner.min_saving for r, owner in entries if getattr(owner, "min_saving", 0.0) > 0}


def _floor_of(choice: dict, snap: Any, eg: EGraph, floors: dict[str, float], roots: list, original: set
              ) -> float | None:
    """The largest ``min_saving`` of the rules whose nodes (those the input program does not hold) the program
    ``choice`` takes from ``roots`` uses, or ``None`` where it uses none."""
    made = _withholding(snap, eg, frozenset(floors), original)[1][1]
    used = {made[n] for n in (choice[c] for c in reachable(snap, choice, roots)) if n in made}
    return max(floors[r] for r in used) if used else None


def floor_test(snap: Any, eg: EGraph, entries: Sequence[tuple[Any, Any]], roots: list, original: set
               ) -> Callable[[Any, float], bool] | None:
    """``extract.extract``'s ``floored``: whether :func:`worth_their_saving` with ``as_loaded`` would leave a
    rewritten candidate (priced against the input's ``input_cost``) as loaded (:func:`floored`): it uses nodes of
    rules with a ``min_saving`` and saves less than the largest of theirs. ``None`` where no ruleset sets a floor."""
    floors = _floors(entries)
    if not floors:
        return None

    def test(cand: Any, input_cost: float) -> bool:
        if not (0 < input_cost < float("inf")) or out_of_time():
            return False
        floor = _floor_of(cand.choice, snap, eg, floors, roots, original)
        return floor is not None and input_cost - cand.cost < floor * input_cost
    return test


def floored(ex: Any, floor: float) -> Any:
    """``ex``'s input program as an extraction of its own (not rewritten), where ``ex`` saves less than ``floor``
    of the input's price, else ``None``: :func:`worth_their_saving`'s ``as_loaded``.

    Where the cheapest program found with the floored rules' nodes saves less than their floor, the program
    extracted without them is used (it cannot be cheaper than the input by more than ``ex`` is, up to the search's
    own misses); what it could still save is under the floor too, found by rules that set none. A whole step's two
    joint programs (:func:`rewrite.pipeline.run_together`) are JAX's transposes of a forward rewritten already:
    their first extractions take ``linalg``'s factored products (floor 10%) and come out 1-2% under their inputs
    (flax_long_context_step: 1.9% and 1.4%), and the programs without them at the inputs' prices exactly
    (benchmarks/results/log.md, h-seedj and h-long): that second extraction, about a tenth of the step's rewrite,
    bought nothing there. A measured decision: of the 24 ecosystem programs only flax_lm_step's moves (its joint
    with the LM head's loop: the program without them saved 0.07% of its input, 9.4451e7 against 9.4518e7), at the
    same temp memory (32,825,608 bytes) and run time (0.98x, A/A 0.93-1.04); no golden decision moves."""
    if ex.original_cost - ex.cost >= floor * ex.original_cost:
        return None
    return as_written(ex)


def as_written(ex: Any) -> Any:
    """``ex``'s input program as an extraction of its own (not rewritten), or ``None`` where it has no such
    candidate (preferred rules barred the input's forms)."""
    written = next((cand for cand in ex.candidates if not cand.rewritten), None)
    if written is None:
        return None
    return dataclasses.replace(ex, choice=written.choice, cost=written.cost, rewritten=False, lean=False,
                               leaner_fallback=None)


def same_original_tree(ex: Extractor, copy: Extractor, made: dict, original: set) -> None:
    """Give ``copy`` (the extractor of a copy of ``ex``'s snapshot without the nodes ``made``) ``ex``'s tree pass
    over the input program's nodes (``Extractor.original_tree``), where the two passes are one: that pass takes the
    nodes of ``original`` and the containers, in the snapshot's order, and the copy leaves out only nodes of
    ``made``, which holds none of ``original``'s (:func:`made_by`); so where ``made`` holds no container either,
    each pass sees the same nodes in the same order, and chooses alike."""
    if any(node[0] in _CONTAINERS for node in made):
        return
    copy.adopt_original_tree(original, ex.original_tree(original))


#: A program that recomputes (``Ruleset(recomputes=True)``) must no longer compute at least this many bytes of values
#: that the program without its recomputations computes: recomputing costs work, so it pays only in memory.
RECOMPUTE_BYTES = 2 ** 20


def made_by(snap: Any, eg: EGraph, rules: set[str], original: set) -> dict[tuple, str]:
    """The nodes (canonicalised) that the rules named ``rules`` built and the input program does not hold, each with
    the first of those rules that made it, as the e-graph's record of the rule that made each name says
    (``EGraph.vorigin``)."""
    made: dict[tuple, str] = {}
    for vid, origin in enumerate(eg.vorigin):
        if origin in rules:
            key = eg.canonical(snap, vid)
            if key is not None and key not in original:
                made.setdefault(key, origin)
    return made


def provenance(snap: Any, eg: EGraph, choice: dict, roots: Sequence[Any], original: set) -> dict[str, int]:
    """How many of the nodes ``choice`` makes from ``roots`` each rule built (the first rule that made each, by
    ``EGraph.vorigin``; nodes the input program already had are not counted): ``Result.used``, ``Report.used``."""
    first: dict[tuple, str] = {}
    for vid, origin in enumerate(eg.vorigin):
        if origin is not None:
            key = eg.canonical(snap, vid)
            if key is not None and key not in first:
                first[key] = origin
    used: dict[str, int] = {}
    for cls in reachable(snap, choice, roots):
        node = choice[cls]
        if node not in original and (origin := first.get(node)) is not None:
            used[origin] = used.get(origin, 0) + 1
    return used


def withheld(snap: Any, eg: EGraph, entries: Sequence[tuple[Any, Any]], original: set) -> tuple[Any, dict]:
    """``(snap, made)``: the snapshot to extract from without the recomputing rules' nodes (``snap`` itself where
    none were built), and those nodes (:func:`copy_without`)."""
    return copy_without(snap, eg, frozenset(r.name for r, owner in entries if getattr(owner, "recomputes", False)),
                        original)


def copy_without(snap: Any, eg: EGraph, rules: frozenset, original: set) -> tuple[Any, dict]:
    """``(copy, made)``: the nodes (canonicalised) that the rules named ``rules`` built and the input program does
    not hold (:func:`made_by`), and a copy of ``snap`` without them (``snap`` itself where there are none). Asked
    again for the same rules and input program (a VJP's pipeline, then its gradients alone, ``grad/vjp.py``), the
    same copy: its extractor (``extractor.shared``) has priced its nodes and made its bottom-up passes already. The
    same rules are those that built a name of the e-graph (:func:`_withholding`): a joint's e-graph saturated without
    a rule (``grad/together.py``'s ``joint_rules``) whose gradients are then extracted under the pipeline's rules
    (``grad/vjp.py``'s ``_joint_choices``) takes the copy its joint extraction took."""
    key, (copy, made, _) = _withholding(snap, eg, rules, original)
    if copy is _UNMADE:
        copy = snap.without(lambda cls, node: node in made) if made else None  # (None: snap itself, without a cycle)
        snap.withholding[key] = (copy, made, original)  # original kept with it, so that its id stays its
    return (snap if copy is None else copy), made


#: A copy :func:`copy_without` has not made yet (its nodes were asked for, ``_withholding``).
_UNMADE = object()


def _withholding(snap: Any, eg: EGraph, rules: frozenset, original: set) -> tuple[tuple, tuple[Any, dict, Any]]:
    """``snap``'s entry for the copy without ``rules``' nodes (``Snapshot.withholding``), and its key: the nodes are
    found once per input program, the copy made only where an extraction needs it (:func:`copy_without`). Keyed by
    those of ``rules`` that built a name (``EGraph.vorigin``): :func:`made_by` reads only the names ``rules`` made, so
    a rule that made none adds nothing to the nodes, nor to their order or their first rules (the same dict)."""
    key = (rules & frozenset(eg.vorigin), id(original), len(eg.vorigin))
    found = snap.withholding.get(key)
    if found is None or found[2] is not original:
        found = snap.withholding[key] = (_UNMADE, made_by(snap, eg, set(rules), original), original)
    return key, found


def recomputations(ex: Any, snap: Any, made: dict, roots: list, model: CostModel) -> Any:
    """``ex`` (extracted without the recomputing nodes ``made``), or the program that takes every one of them
    where ``ex`` can (each class ``ex``'s program uses that holds one), as one whole-program candidate.

    It is kept if it prices no higher, is not predicted to hold more at its peak (``extract.fatter``), and no longer
    computes at least :data:`RECOMPUTE_BYTES` of the values the program without it computes (:func:`held_for`):
    the residuals a backward read from its forward, now recomputed inside the checkpoint from its inputs.
    The fusion model's peak does not see every residual a step holds from its forward to its backward (in a
    haiku encoder's step it predicts 3.0 MiB of 8.5 at N=256 either way), so the values dropped are counted too.

    Only a model that prices whole programs and memory can tell: a recomputation costs time, so under a price of
    time alone, or a node model that does not see what a program holds, it is never taken. What counts as a
    recomputation is the rule that built a node, never the node's shape: a loop rule's checkpointed body
    (``rulesets.scan``) is chosen as any other node is.
    """
    if not made or not prices_programs(model) or not float(getattr(model, "memory", 0.0) or 0.0):
        return ex
    full = shared(snap, model)
    _, tree = full.tree()
    base = {**tree, **ex.choice}
    used = reachable(snap, base, roots)
    swaps = {c: n for c in used for n in snap.nodes.get(c, ()) if n in made and base.get(c) != n}
    if not swaps:
        return ex
    cand = {**base, **swaps}
    if held_for(snap, base, cand, swaps, used - reachable(snap, cand, roots)) < RECOMPUTE_BYTES:
        return ex
    price = ProgramPricer(full, model)
    before, key_before = price(base, roots), price.last_key
    after, key_after = price(cand, roots), price.last_key
    # (read from the whole prices where they charged one: the live program is moved only where not)
    peak_before = _peak(price, Candidate(base, before, True, key_before[1]), roots)
    peak_after = _peak(price, Candidate(cand, after, True, key_after[1]), roots)
    if peak_before is None or peak_after is None or after > before or fatter(peak_after, peak_before):
        return ex
    return dataclasses.replace(ex, choice=cand, cost=after, rewritten=True, lean=False,
                               candidates=[Candidate(cand, after, True), *ex.candidates])


def held_for(snap: Any, base: dict, cand: dict, swaps: dict, dropped: set) -> int:
    """The bytes of the residuals the recomputing nodes ``swaps`` free: of the values the program ``base`` computes
    and the program with ``swaps`` does not (``dropped``), those that a recomputation does not compute from all of
    its operands. A backward recomputed from ``(x, g)`` drops both the forward's residuals, which read ``x`` alone
    (``tanh(...)``, ``3 x**2``), and its own intermediates, which read the cotangent ``g`` as well and were never
    held; only the first are counted."""
    def recomputing(n: tuple) -> tuple:  # the node a projection of a multi-result recomputation projects
        return recomputing(cand[n[1][0]]) if n[0] == "Proj" else n

    ops = [frozenset(operands(snap, recomputing(n))) for n in swaps.values()]
    found: dict[Any, frozenset] = {}

    def reads(c: Any) -> frozenset:  # the swaps' operands that dropped class c is computed from
        if c not in found:
            found[c] = frozenset()  # a class inside a body reached again through its scope reads nothing more
            if c in dropped:
                found[c] = frozenset().union(*(reads(k) for k in children(base[c]))) if c in base else frozenset()
            else:
                found[c] = frozenset({c})
        return found[c]

    total = 0
    try:
        for c in dropped:
            if c not in snap.name_of_cls:  # a container (an operand list, a body): no array of its own
                continue
            aval = snap.aval(c)
            shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
            if shape is not None and dtype is not None and not any(o <= reads(c) for o in ops):
                total += math.prod(shape) * np.dtype(dtype).itemsize
        return total
    finally:
        del recomputing, reads  # recursive closures are reference cycles (see Extractor.dag_cost)


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
