"""The whole rewrite, one stage after another: trace, load, saturate, extract, emit.

:func:`run_pipeline` is the function to read first. The stages live in the
folders named for their roles: ``jaxpr/trace.py``, ``jaxpr/load.py``,
``rules/saturate.py``, ``extract/extract.py``, ``jaxpr/emit.py``. The public
entry points that call it, with caching per input signature, are in
``api.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Any, Sequence


from .cost.memory import over_budget
from .cost.model import CostModel
from .extract.choice import reachable
from .extract.extract import extract, input_cost
from .extract.extractor import Extractor
from .ir.egraph import EGraph
from .ir.intern import TYPES
from .ir.jaxapi import core
from .jaxpr.emit import emit
from .jaxpr.load import TOKEN_AVAL, load_closed
from .jaxpr.trace import Traced, _collect_young_only
from .rules import prefer as _prefer
from .rules.rule import Rule
from .rules.ruleset import Ruleset
from .rules.saturate import Engine, Limits, RuleStats, match_program

log = logging.getLogger("rewrite")


def limits_met(result: "Result") -> list[str]:
    """What a limit cut short in this rewrite, in words: the run stopped at one, or rules stopped at their
    time share (``Limits.rule_share``). Each is a :class:`rewrite.RewriteLimitWarning` at the user's call."""
    out = []
    if result.stopped in ("time limit", "node limit", "iteration limit"):
        out.append(f"stopped at the {result.stopped} after {result.iterations} iterations ({result.rows} e-graph "
                   f"rows); using the best program found so far")
    slow = {k: s.seconds for k, s in result.stats.items() if getattr(s, "timed_out", False)}
    if slow:
        out.append("rules stopped at their time share (Limits.rule_share), keeping what they built: "
                   + ", ".join(f"{k} ({v:.1f} s)" for k, v in slow.items()))
    return out


@dataclasses.dataclass
class Result:
    before: core.ClosedJaxpr
    after: core.ClosedJaxpr
    cost_before: float
    cost_after: float
    stopped: str
    iterations: int
    rows: int
    times: dict[str, float]
    stats: dict[str, RuleStats]
    rewritten: bool
    warnings: list[str]
    # kept for reports that look deeper (explain's provenance, to_dot)
    egraph: EGraph | None = None
    choice: dict | None = None
    snapshot: Any = None
    roots: list | None = None
    original: set | None = None
    out_names: list | None = None  # the V names of the program's outputs, for checks that extract their own way
    #: what cost_model="measure" timed (rewrite/cost/measure.py), else None
    timing: Any = None
    #: the disk cache's file this result was read from (rewrite/cache/store.py), else None
    cached: str | None = None
    #: with rewrite(guard=True): which program the guard kept and the two times (rewrite/cost/guard.py)
    guard: Any = None
    #: preferred rules (rule(..., prefer=True)) -> how many classes' choice they forced (rewrite/rules/prefer.py)
    preferred: dict[str, int] = dataclasses.field(default_factory=dict)
    #: with AnalyticCost(memory_budget=...): the candidates the budget excluded (rewrite/cost/memory.py)
    over_budget: list = dataclasses.field(default_factory=list)
    #: why the program that runs was chosen (see :func:`why_chosen`); "" when the input program is kept
    why: str = ""
    #: a training step: the losses whose gradients were found, proven and replaced, or why not
    #: (:class:`rewrite.grad.step.StepFinding`), else None
    step: Any = None


def run_pipeline(traced: Traced, entries: Sequence[tuple[Rule, Ruleset]], model: CostModel, limits: Limits,
                 keep: bool = False) -> Result:
    """Rewrite one traced program with the given rules. Stage times are recorded in ``Result.times``."""
    with _collect_young_only():
        return _run(traced, entries, model, limits, keep)


def _run(traced: Traced, entries: Sequence[tuple[Rule, Ruleset]], model: CostModel, limits: Limits,
         keep: bool) -> Result:
    times = {"trace": 0.0}
    closed = traced.closed

    # Stage 2: load. The program's inputs are the Params of scope 0; its
    # effects, if any, are threaded on a token that starts at (Tok 0).
    t = time.perf_counter()
    manual = _has_primitive(closed.jaxpr, "pvary")
    eg = EGraph(match_program(entries, manual)[0])  # declared with the rules' queries: see _egraph._POOL
    inputs = [eg.term("Param", [0, i], TYPES.intern_aval(a)) for i, a in enumerate(closed.in_avals)]
    token = eg.term("Tok", [0], TYPES.intern_aval(TOKEN_AVAL)) if closed.jaxpr.effects else None
    outs, token = load_closed(closed, inputs, eg, token)
    program_names = eg.num_names
    eg.flush()
    cost_before = input_cost(eg.snapshot(), outs, token, model)
    times["load"] = time.perf_counter() - t

    # Stage 3: saturate, under limits.
    t = time.perf_counter()
    engine = Engine(eg, entries, limits, manual=manual)
    stopped = engine.run()
    times["saturate"] = time.perf_counter() - t

    # Stage 4: extract the cheapest program; the input program is always a candidate.
    t = time.perf_counter()
    snap = eg.snapshot()
    forced = _bar_preferred(snap, eg, engine.preferred, model)
    original = {key for vid in range(program_names) if (key := eg.canonical(snap, vid)) is not None}
    roots = [snap.cls_of_name[o] for o in outs]
    token_root = snap.cls_of_name[token] if token is not None else None
    ex = extract(snap, roots + ([token_root] if token_root is not None else []), model, original)
    ex = _worth_their_saving(ex, snap, eg, entries, roots + ([token_root] if token_root is not None else []),
                             model, original)
    times["extract"] = time.perf_counter() - t

    # Stage 5: emit a ClosedJaxpr with the same signature.
    t = time.perf_counter()
    after = emit(snap, ex.choice, eg, closed.in_avals, roots, token_root, closed.jaxpr.debug_info)
    times["emit"] = time.perf_counter() - t

    # cost_model="measure": the best candidates are timed on the backend (rewrite/cost/measure.py).
    timing = None
    if isinstance(model, CostModel) and model.measures and len(ex.candidates) > 1:
        t = time.perf_counter()
        programs = [emit(snap, cand.choice, eg, closed.in_avals, roots, token_root, closed.jaxpr.debug_info)
                    if cand.choice is not ex.choice else after for cand in ex.candidates]
        after, timing = model.choose(programs)
        times["measure"] = time.perf_counter() - t

    excluded = over_budget(ex.candidates, model,
                           lambda c: emit(snap, c, eg, closed.in_avals, roots, token_root, closed.jaxpr.debug_info))

    result = Result(
        before=closed, after=after, cost_before=cost_before, cost_after=ex.cost, stopped=stopped,
        iterations=engine.iterations, rows=snap.num_rows, times=times, stats=dict(engine.stats),
        rewritten=ex.rewritten, warnings=list(engine.warnings),
        egraph=eg if keep else None, choice=ex.choice if keep else None, snapshot=snap if keep else None,
        roots=roots if keep else None, original=original if keep else None, out_names=list(outs) if keep else None,
        timing=timing, preferred=forced, over_budget=excluded,
    )
    result.why = why_chosen(result, ex.lean)
    if not keep:
        eg.release()  # to the pool now, even if something the rewrite made holds the e-graph in a cycle
    return result


def why_chosen(result: Result, lean: bool = False) -> str:
    """Why a rewritten program is used: ``"cheaper"`` (its predicted cost is below the input's), or one of
    the reasons that can make it cost more: ``"preferred"`` (preferred rules barred the forms they
    replace, ``result.preferred``), ``"leaner"`` (priced within the model's ``lean_band`` of the
    cheapest and predicted to hold less memory at its peak), ``"memory budget"`` (the input program was
    over the model's ``memory_budget``), ``"measured"`` (``cost_model="measure"`` timed it faster).
    ``""`` for the input program."""
    if not result.rewritten:
        return ""
    if result.timing is not None and getattr(result.timing, "seconds", None) and any(
            s is not None for s in result.timing.seconds):
        return "measured"
    if any(not c["rewritten"] for c in result.over_budget):
        return "memory budget"
    if result.cost_after < result.cost_before:
        return "cheaper"
    if result.preferred:
        return "preferred"
    if lean:
        return "leaner"
    return "unexplained"


def _worth_their_saving(ex: Any, snap: Any, eg: EGraph, entries: Sequence[tuple[Rule, Ruleset]], roots: list,
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
    without = copy.copy(snap)
    without._nodes = {cls: [n for n in ns if n not in made] for cls, ns in snap.nodes.items()}
    without._parents = None
    alt = extract(without, roots, model, original)
    if alt.cost - ex.cost < max(floors[r] for r in used) * ex.original_cost:
        return alt
    return ex


def _bar_preferred(snap: Any, eg: EGraph, notes: list, model: CostModel) -> dict[str, int]:
    """Take the forms preferred rules replaced out of extraction (rewrite/rules/prefer.py); per rule, the classes forced."""
    if not notes:
        return {}
    ex = Extractor(snap, model)
    barred, forced = _prefer.bar(snap, eg, notes, lambda allowed: ex.tree(allowed)[1])
    _prefer.apply(snap, barred)
    return forced


def _has_primitive(jaxpr: core.Jaxpr, name: str) -> bool:
    return any(e.primitive.name == name or any(_has_primitive(getattr(j, "jaxpr", j), name)
                                               for j in core.jaxprs_in_params(e.params))
               for e in jaxpr.eqns)
