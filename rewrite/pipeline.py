"""The whole rewrite of one program: load, saturate, extract, emit, choose.

:func:`run_pipeline` is the one entry point, and the function to read first.
It takes a traced function (``jaxpr/trace.py`` traces one, with its tree
structure and static arguments) or a bare ``ClosedJaxpr``, and returns a
:class:`rewrite.records.Result`. Every caller goes through it: the decorator
(``api.py``, which adds the per-signature and disk caches and the guard),
``explain``, the derivative programs (``grad/``), rule definition
(``define.py``) and the rule checks (``testing/``).

The stages live in the folders named for their roles: ``jaxpr/load.py``,
``rules/saturate.py``, ``extract/`` (with its policy, ``extract/policy.py``),
``jaxpr/emit.py``, and the cost model in ``cost/``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import numpy as np

from .cost.memory import over_budget
from .cost.model import CostModel
from .extract.choice import reachable
from .extract.extract import extract, input_cost
from .extract.extractor import shared
from .extract.policy import (as_written, bar_preferred, copy_without, floor_test, made_by, no_fatter, provenance,
                             recomputations, same_original_tree, withheld, worth_their_saving)
from .extract.tie import on_xla_count
from .ir.egraph import BodyRef, EGraph, ListRef
from .ir.intern import LITERALS, TYPES, in_dtype
from .ir.terms import ctor_arg_sorts
from .ir.walk import holds_high_values, operands, walk
from .ir.jaxapi import BUILT_DEBUG, AbstractRef, core
from .ir.primitives import Unsupported
from .jaxpr.emit import check_signature, emitter
from .jaxpr.load import TOKEN_AVAL, SharedBodies, load_closed
from .jaxpr.trace import Traced, collect_young_only
from .jaxpr.transposes import transposes_as_input
from .records import Budget, Limits, Result
from .rules.rule import Rule
from .rules.ruleset import Ruleset
from .rules.saturate import Engine, Held, match_program

log = logging.getLogger("rewrite")


def limits_met(result: Result, budget: Budget | None = None) -> list[str]:
    """What a limit cut short in this rewrite, in words: the run stopped at one, or rules stopped at their
    time share (``Limits.rule_share``). Each is a :class:`rewrite.RewriteLimitWarning` at the user's call.
    Where the rewrite ran under ``budget`` (``Limits.seconds`` for all its saturations), the time limit is said by
    it, once for the rewrite and whichever pass stopped (:meth:`rewrite.records.Budget.tell`)."""
    out = []
    told = budget.tell() if budget is not None else None
    if told:
        out.append(told)
    if result.stopped in ("node limit", "iteration limit") or (result.stopped == "time limit" and budget is None):
        out.append(f"stopped at the {result.stopped} after {result.iterations} iterations ({result.rows} e-graph "
                   f"rows); using the best program found so far")
    slow = {k: s.seconds for k, s in result.stats.items() if getattr(s, "timed_out", False)}
    if slow:
        out.append("rules stopped at their time share (Limits.rule_share), keeping what they built: "
                   + ", ".join(f"{k} ({v:.1f} s)" for k, v in slow.items()))
    return out


def run_pipeline(program: Traced | core.ClosedJaxpr, entries: Sequence[tuple[Rule, Ruleset]], model: CostModel,
                 limits: Limits, keep: bool = False, price_input: bool = True,
                 input_price: float | None = None, plain: bool = False, as_loaded: bool = False) -> Result:
    """Rewrite one program with the given rules: load, saturate, extract, emit, choose.

    ``program`` is a traced function or a bare ``ClosedJaxpr``. The program
    that comes out has the same signature (checked). Stage times are in
    ``Result.times``; ``keep`` keeps the e-graph and the choice in the result
    for reports that look deeper (provenance, the VJP's split), otherwise the
    e-graph goes back to the pool before this returns. Without ``price_input`` the input program is not
    priced (``cost_before`` is NaN, and ``why`` says nothing of it): for a caller that reads only the program
    that comes out (the whole-step search's inner rewrites), whose extraction prices the input anyway.
    ``input_price``, where given, is the input's price as :func:`program_cost` gives it, which the caller has
    already (the whole-step search prices the step as written before it decides to rewrite it): it is
    ``cost_before``, and the input is not priced again. ``plain``: where the program that comes out uses nodes of
    ``jointly`` rulesets' rules, the program without them is read off the same e-graph too (``Result.plain``).
    ``as_loaded``: a program that saves less than its floored rules' ``min_saving`` is left as loaded
    (:func:`extract_by_policy`), as :func:`run_together`'s joints are (``grad/vjp.py``'s plain forward).
    """
    closed = program.closed if isinstance(program, Traced) else program
    if any(isinstance(v.aval, AbstractRef) for v in (*closed.jaxpr.invars, *closed.jaxpr.constvars)):
        # (its equations' effects name those inputs; a constant one would be read as an array, element by element)
        raise Unsupported("the program reads and writes mutable arrays (jax.new_ref) passed in or closed over, "
                          "which the rewriter leaves as they are")
    if holds_high_values(closed.jaxpr):  # (a Box closed over was loaded as a NumPy object array)
        raise Unsupported("the program holds hijax values (a Box, a value of a HiType), which the rewriter leaves as "
                          "they are")
    with collect_young_only():
        result = _run(closed, entries, model, limits, keep, price_input, input_price, plain, as_loaded)
    check_signature(closed, result.after)
    return result


def _run(closed: core.ClosedJaxpr, entries: Sequence[tuple[Rule, Ruleset]], model: CostModel, limits: Limits,
         keep: bool, price_input: bool = True, input_price: float | None = None, plain: bool = False,
         as_loaded: bool = False) -> Result:
    times = {"trace": 0.0}

    t = time.perf_counter()
    eg, outs, token, held = _load(closed, entries)
    program_names = eg.num_names
    if input_price is not None:
        cost_before = input_price
    else:
        cost_before = input_cost(eg.snapshot(), outs, token, model) if price_input else float("nan")
    times["load"] = time.perf_counter() - t

    # Saturate, under limits.
    t = time.perf_counter()
    engine = Engine(eg, entries, limits, manual=held.manual, held=held)
    stopped = engine.run()
    times["saturate"] = time.perf_counter() - t

    # Extract the cheapest program under the extraction policy (the input program is always a candidate), and emit
    # a ClosedJaxpr with the same signature: each candidate at most once.
    t = time.perf_counter()
    snap = eg.snapshot()
    jointly = {r.name for r, owner in entries if getattr(owner, "jointly", False)}
    theirs = [n for n in engine.preferred if n.rule in jointly]
    forced = bar_preferred(snap, eg, [n for n in engine.preferred if n.rule not in jointly], model)
    # the forward without the jointly rules (``plain``) is read without their bars too: the form one barred is its own
    unbarred = snap.without(lambda cls, node: False) if plain and theirs else snap
    forced.update(bar_preferred(snap, eg, theirs, model))
    original = {key for vid in range(program_names) if (key := eg.canonical(snap, vid)) is not None}
    roots = [snap.cls_of_name[o] for o in outs]
    token_root = snap.cls_of_name[token] if token is not None else None
    all_roots = roots + ([token_root] if token_root is not None else [])
    times["extract"] = time.perf_counter() - t
    ex, after, emit_choice = _extracted(snap, eg, entries, closed, roots, token_root, model, original, times,
                                        as_loaded)
    if as_loaded and not ex.rewritten and not ex.lean and ex.candidates and ex.candidates[0].rewritten:
        after = closed  # the cheapest, a rewrite, left as loaded by its floor: the input itself, not its emitted copy

    # Choose: cost_model="measure" times the best candidates on the backend (rewrite/cost/measure.py);
    # a memory budget reports the candidates it excluded.
    timing = None
    if isinstance(model, CostModel) and model.measures and len(ex.candidates) > 1:
        t = time.perf_counter()
        after, timing = model.choose([emit_choice(cand.choice) for cand in ex.candidates])
        times["measure"] = time.perf_counter() - t
    excluded = over_budget(ex.candidates, model, emit_choice)

    result = Result(
        before=closed, after=after, cost_before=cost_before, cost_after=ex.cost, stopped=stopped,
        iterations=engine.iterations, rows=snap.num_rows, times=times, stats=dict(engine.stats),
        rewritten=ex.rewritten, warnings=list(engine.warnings),
        egraph=eg if keep else None, choice=ex.choice if keep else None, snapshot=snap if keep else None,
        roots=roots if keep else None, original=original if keep else None, out_names=list(outs) if keep else None,
        timing=timing, preferred=forced, over_budget=excluded,
        # a program the backend timed may be another candidate than ex's
        jointly_chosen=None if timing is not None else jointly_chosen(snap, eg, entries, engine.stats, ex.choice,
                                                                      all_roots, original),
        used=None if timing is not None else provenance(snap, eg, ex.choice, roots, original),  # ~0.5% of a pipeline
    )
    result.why = why_chosen(result, ex.lean)
    if plain and result.jointly_chosen:
        t = time.perf_counter()
        result.plain, result.plain_cost = plain_program(unbarred, eg, entries, all_roots, model, original, closed,
                                                        emit_choice)
        times["plain"] = time.perf_counter() - t
    if not keep:
        eg.release()  # to the pool now, even if something the rewrite made holds the e-graph in a cycle
    return result


def run_together(first: core.ClosedJaxpr, second: core.ClosedJaxpr, entries: Sequence[tuple[Rule, Ruleset]],
                 model: CostModel, limits: Limits, price_input: bool = False,
                 input_prices: Sequence[float | None] = (None, None), as_loaded: bool = False,
                 unite: Sequence[tuple[Any, Any]] = ()) -> tuple[Result, Result]:
    """Two programs of the same inputs rewritten in one e-graph: ``first`` loaded, then ``second`` (the terms they
    share are one, the loops whose bodies are the same too: ``jaxpr.load.SharedBodies``), saturated once with
    ``entries``, and each extracted from its own roots under the extraction policy and held to itself
    (``no_fatter``), as :func:`run_pipeline` with ``keep`` would.
    ``first`` is extracted without the nodes only ``second`` holds as loaded, so a form only ``second``'s input
    has is not taken into ``first``'s program; what the rules built is, where it is equal (a merge): as
    ``extract.policy.copy_without`` leaves what other rules built from a ruleset's nodes. The two joint programs of
    a forward rewritten with and without a ``jointly`` ruleset's rules (``grad/vjp.py``'s ``decided_jointly``)
    share most of their equations, which are saturated once so. Both results keep the e-graph: the caller
    releases it (once) after reading both. Not for ``cost_model="measure"`` (the backend times one program).
    ``input_prices``: where one is given, ``price_input``'s price of that program, known already
    (:func:`program_cost`'s of the same program: ``grad/together.py``'s ``build_vjps``), not priced again.
    ``as_loaded`` (a whole step's two joints, ``grad/together.py``'s ``rewrite_joints``): a program whose extraction
    saves less than its floored rules' ``min_saving`` is left as loaded, the one without them not extracted
    (:func:`extract_by_policy`'s ``as_loaded``: a decision for those joint programs alone). Not for a VJP's joint
    and gradients alone (``build_vjps``): their split searches its residuals over the program extracted, and over
    the joint as loaded flax_seq2seq_grad's search took 0.5-0.6 s more for the same program (2026-12-03).
    ``unite``: pairs of variables, of ``first`` and of ``second``, that hold the same value (``grad/marks.py``: the
    cotangents of the values where two forwards part), whose classes are united before saturation, so that what
    each program computes from them is one; each is then extracted without what only the other reached
    (:func:`_views_apart`)."""
    if first.in_avals != second.in_avals or first.jaxpr.effects or second.jaxpr.effects:
        raise ValueError("run_together: two programs of the same inputs, with no effects")
    with collect_young_only():
        t = time.perf_counter()
        named: list[dict] = [{}, {}] if unite else []
        eg, loaded, held, names = _load_all((first, second), entries, share=True, named=named)
        for a, b in unite:
            eg.union(named[0][a], named[1][b])
        if unite:
            eg.flush()
        (outs_first, _), (outs_second, _) = loaded
        n_first, n_both = names
        # one snapshot for both (one no one holds is made again, its node table too, and its nodes' facts)
        at_load = eg.snapshot() if price_input and None in input_prices else None
        before = [known if known is not None else input_cost(at_load, outs, None, model) if price_input
                  else float("nan") for outs, known in zip((outs_first, outs_second), input_prices)]
        del at_load
        load_s = time.perf_counter() - t
        t = time.perf_counter()
        engine = Engine(eg, entries, limits, manual=held.manual, held=held)
        stopped = engine.run()
        saturate_s = time.perf_counter() - t
        snap = eg.snapshot()
        forced = bar_preferred(snap, eg, engine.preferred, model)
        keys = [eg.canonical(snap, vid) for vid in range(n_both)]
        own_first = {k for k in keys[:n_first] if k is not None}
        own_second = {keys[v] for v in _names_of(eg, outs_second, range(n_first, n_both)) if keys[v] is not None}
        if unite:
            apart, alone = _views_apart(snap, own_first, own_second)
        else:
            only_second = {k for k in keys[n_first:] if k is not None} - own_first
            apart = snap.without(lambda cls, node: node in only_second) if only_second else snap
            alone = snap
        for view in {id(v): v for v in (apart, alone) if v is not snap}.values():
            shared(view, model).share_prices(shared(snap, model))
        results = []
        for closed, view, outs, original, cost_before in ((first, apart, outs_first, own_first, before[0]),
                                                          (second, alone, outs_second, own_second, before[1])):
            times = {"trace": 0.0, "load": load_s, "saturate": saturate_s}
            load_s = saturate_s = 0.0  # counted once, on the first
            roots = [view.cls_of_name[o] for o in outs]
            ex, after, emit_choice = _extracted(view, eg, entries, closed, roots, None, model, original, times,
                                                as_loaded=as_loaded)
            result = Result(
                before=closed, after=after, cost_before=cost_before, cost_after=ex.cost, stopped=stopped,
                iterations=engine.iterations, rows=snap.num_rows, times=times, stats=dict(engine.stats),
                rewritten=ex.rewritten, warnings=list(engine.warnings), egraph=eg, choice=ex.choice, snapshot=view,
                roots=roots, original=original, out_names=list(outs), preferred=forced,
                over_budget=over_budget(ex.candidates, model, emit_choice),
                jointly_chosen=jointly_chosen(view, eg, entries, engine.stats, ex.choice, roots, original))
            result.why = why_chosen(result, ex.lean)
            check_signature(closed, result.after)
            results.append(result)
    return results[0], results[1]


def _views_apart(snap: Any, own_first: set, own_second: set) -> tuple[Any, Any]:
    """The views :func:`run_together` extracts two united programs from: each without the nodes only the other
    loaded, nor any node of a class only the other reached (a class holding a node one loaded and none the other
    did), so that neither program's extraction reads what only the other computes, through a form the rules built
    from it either (a node's children must all be extractable); a class only rules made is in both."""
    reached = [{c for c, ns in snap.nodes.items() if any(n in own for n in ns)} for own in (own_first, own_second)]
    first_only, second_only = reached[0] - reached[1], reached[1] - reached[0]
    only_first, only_second = own_first - own_second, own_second - own_first
    return (snap.without(lambda cls, node: cls in second_only or node in only_second),
            snap.without(lambda cls, node: cls in first_only or node in only_first))


def _extracted(snap: Any, eg: EGraph, entries: Sequence[tuple[Rule, Ruleset]], closed: core.ClosedJaxpr,
               roots: list, token_root: Any, model: CostModel, original: set, times: dict[str, float],
               as_loaded: bool = False) -> tuple[Any, core.ClosedJaxpr, Any]:
    """``(ex, after, emit_choice)``: the program of ``closed`` from ``roots`` (and ``token_root``, its final token,
    where it has effects) under the extraction policy (:func:`extract_by_policy`), emitted with ``closed``'s
    signature and held to it (``no_fatter``), and the emitter of choices of ``snap`` (which may be a view of
    ``eg``'s snapshot). ``times`` receives the seconds of ``extract`` (added to any there) and ``emit``:
    :func:`_run`'s and :func:`run_together`'s sequence, the same for each program (``as_loaded``:
    :func:`extract_by_policy`'s, :func:`run_together`'s)."""
    t = time.perf_counter()
    ex = extract_by_policy(snap, eg, entries, roots + ([token_root] if token_root is not None else []), model,
                           original, as_loaded)
    times["extract"] = times.get("extract", 0.0) + time.perf_counter() - t
    t = time.perf_counter()
    emit_choice = emitter(snap, eg, closed.in_avals, roots, token_root, closed.jaxpr.debug_info)
    ex, after = _held_to_input(ex, closed, emit_choice, model)
    times["emit"] = time.perf_counter() - t
    return ex, after, emit_choice


def _names_of(eg: EGraph, outs: Sequence[int], new: Sequence[int]) -> set[int]:
    """The names a program loaded after another uses: those it made (``new``) and those they and its outputs read,
    through lists and bodies (``EGraph.defs``): the terms it shares with the first program."""
    seen: set[int] = set()
    stack = list(outs) + list(new)
    while stack:
        vid = stack.pop()
        if vid in seen:
            continue
        seen.add(vid)
        ctor, args = eg.defs[vid]
        for sort, a in zip(ctor_arg_sorts(ctor), args):
            if sort == "Term":
                stack.append(a)
            elif isinstance(a, (ListRef, BodyRef)):
                stack.extend(a.names())
    return seen


def jointly_chosen(snap: Any, eg: Any, entries: Sequence[tuple[Rule, Ruleset]], stats: dict, choice: dict,
                   roots: list, original: set) -> frozenset:
    """Of the rules of ``jointly=True`` rulesets that fired (``stats``), those that built a node the program
    ``choice`` makes from ``roots`` uses (``extract.policy.made_by``): ``Result.jointly_chosen``. Where none did,
    the forward rewritten without them is the forward as chosen (``grad/vjp.py``'s ``decided_jointly``
    does not saturate it again)."""
    fired = {r.name for r, owner in entries if getattr(owner, "jointly", False)
             and getattr(stats.get(r.name), "fired", 0)}
    if not fired:
        return frozenset()
    made = made_by(snap, eg, fired, original)
    return frozenset(made[n] for n in (choice[c] for c in reachable(snap, choice, roots)) if n in made)


def plain_program(snap: Any, eg: Any, entries: Sequence[tuple[Rule, Ruleset]], roots: list, model: CostModel,
                  original: set, closed: core.ClosedJaxpr, emit_choice: Any) -> tuple[core.ClosedJaxpr, float]:
    """The program extracted from ``snap`` without the nodes the rules of ``jointly`` rulesets built
    (``extract.policy.copy_without``), under the policy of the other rules (:func:`extract_by_policy`,
    ``no_fatter``): the forward rewritten without them (``grad/vjp.py``'s ``decided_jointly``), read off the
    e-graph saturated with them instead of a second load and saturation. That e-graph may hold merges the one
    saturated without them lacks, so the program may differ from that saturation's. The copy takes ``snap``'s tree
    pass over the input program's nodes (``extract.policy.same_original_tree``: the nodes they built are none of
    the input's), which the forward's extraction made where it read ``snap`` itself (no ``jointly`` rule barred a
    form, :func:`_run`'s ``unbarred``, and no recomputing rule's node was withheld, ``extract_by_policy``). With its
    price as extracted (``Result.plain_cost``).

    No whole-program search refines it (``refine=False``): it is read off to be traced into its joint program, which
    a pipeline of its own rewrites and extracts again, search and all (``grad/together.py``'s ``rewrite_joints``), and
    its price only steers which of the two joints is priced or rewritten first there. Those searches were 127 of
    wholestep_full_linen_cross's 1,410 ms and 88 of equinox_gpt's; without them all 84 programs of
    ``benchmarks.rewrite_time``'s three sets come out byte for byte the same (2026-12-08, ``log.md``)."""
    jointly = frozenset(r.name for r, owner in entries if getattr(owner, "jointly", False))
    rest = [(r, owner) for r, owner in entries if r.name not in jointly]
    without, made = copy_without(snap, eg, jointly, original)
    if without is not snap:
        full, copy = shared(snap, model), shared(without, model)
        copy.share_prices(full)
        same_original_tree(full, copy, made, original)
    ex = extract_by_policy(without, eg, rest, roots, model, original, refine=False)
    ex, after = _held_to_input(ex, closed, emit_choice, model)
    return after, ex.cost


def _held_to_input(ex: Any, closed: core.ClosedJaxpr, emit_choice: Any, model: CostModel
                   ) -> tuple[Any, core.ClosedJaxpr]:
    """``(ex, after)``: the extraction ``ex``'s program emitted and held to the input ``closed``: no fatter than it
    (``no_fatter``), where the two are priced alike the one XLA holds fewer temporaries for (``on_xla_count``), and
    differentiable by JAX where the input is (``transposes_as_input``: checked where values have reduced mesh axes;
    else the input, as written)."""
    ex, after = no_fatter(ex, closed, emit_choice(ex.choice), emit_choice, model)
    ex, after = on_xla_count(ex, closed, after, emit_choice, model)
    if ex.rewritten and not transposes_as_input(closed, after):  # (values with reduced mesh axes only)
        written = as_written(ex)
        if written is not None:
            ex, after = written, closed
    return ex, after


def extract_by_policy(snap: Any, eg: Any, entries: Sequence[tuple[Rule, Ruleset]], roots: list, model: CostModel,
                      original: set, as_loaded: bool = False, refine: bool = True) -> Any:
    """The program from ``roots`` under the extraction policy: the cheapest without the recomputing rules' nodes
    (``extract.policy.withheld``), held to the rulesets' ``min_saving`` (``worth_their_saving``), then with the
    recomputing nodes where they free memory (``recomputations``). A pipeline's extraction, and a VJP's of its
    gradients alone (``grad/vjp.py``), which must hold the same policy. ``as_loaded`` (:func:`run_together`'s joint
    programs): a program that saves less than its floored rules' ``min_saving`` is left as loaded, the program
    without them not extracted (``extract.policy.floored``). ``refine=False``: no whole-program search refines the
    candidates (``extract.extract``'s ``refine``: :func:`plain_program`'s)."""
    plain, recomputing = withheld(snap, eg, entries, original)
    if plain is not snap:  # one key names one program in both: recomputations prices the copy's program again
        shared(plain, model).share_prices(shared(snap, model))
    ex = extract(plain, roots, model, original, floor_test(plain, eg, entries, roots, original) if as_loaded else None,
                 refine)
    ex = worth_their_saving(ex, plain, eg, entries, roots, model, original, as_loaded, refine)
    return recomputations(ex, snap, recomputing, roots, model)


def _load(closed: core.ClosedJaxpr, entries: Sequence[tuple[Rule, Ruleset]], priced: bool = False
          ) -> tuple[EGraph, list, Any, Held]:
    """A new e-graph holding ``closed``: it, the outputs' names, the final token's, and what the program holds
    (with ``pvary`` it is inside a ``shard_map`` body), for the engine to declare the anchored rules it admits
    (``Rule.anchor``). The program's inputs are the Params of scope 0; its effects, if any, are threaded on a
    token that starts at (Tok 0). ``priced``: :func:`_load_all`'s."""
    eg, ((outs, token),), held, _ = _load_all((closed,), entries, priced)
    return eg, outs, token, held


def _load_all(programs: Sequence[core.ClosedJaxpr], entries: Sequence[tuple[Rule, Ruleset]], priced: bool = False,
              share: bool = False, named: Sequence[dict] = ()
              ) -> tuple[EGraph, list[tuple[list, Any]], Held, list[int]]:
    """A new e-graph holding ``programs`` (of the same inputs, the Params of scope 0), loaded in order, so that the
    terms they share are one: the e-graph, each program's outputs' names and final token's (:func:`_load`), what
    they hold together (:func:`_held`), and the e-graph's count of names after each was loaded (the names below
    the first count are the first program's, and so on). ``priced`` (a load only to price or prove, with no rule):
    what they hold is not read (an empty :class:`Held`): with no rule the match program is one text whatever they
    hold (``rules.saturate.match_program``), and nothing is saturated. ``share``: a later program's loops take the
    first's bodies where they are the same (``jaxpr.load.SharedBodies``), so that what reads them is one too; else
    each body is loaded in a scope of its own, and two programs' terms are one only up to their first loop.
    ``named``: a dict for each program, which receives what each of its variables was loaded as."""
    if priced and entries:
        raise ValueError("_load_all: a load to price only has no rules")
    held = Held(frozenset()) if priced else _held(programs[0], entries)
    for other in programs[1:] if not priced else ():
        more = _held(other, entries)
        held = Held(held.primitives | more.primitives, held.literals | more.literals)
    eg = EGraph(match_program(entries, held.manual)[0])  # with the rules' queries: ir/egraph.py's _POOL
    inputs = [eg.term("Param", [0, i], TYPES.intern_aval(a)) for i, a in enumerate(programs[0].in_avals)]
    loaded, names = [], []
    eg.shared_bodies = SharedBodies() if share and len(programs) > 1 else None
    for i, closed in enumerate(programs):
        if i and eg.shared_bodies is not None:
            eg.shared_bodies.next_program()
        token = eg.term("Tok", [0], TYPES.intern_aval(TOKEN_AVAL)) if closed.jaxpr.effects else None
        loaded.append(load_closed(closed, inputs, eg, token, names=named[i] if named else None))
        names.append(eg.num_names)
    eg.flush()
    eg.shared_bodies = None  # (the rules build bodies as they always do)
    return eg, loaded, held, names


def program_cost(closed: core.ClosedJaxpr, model: CostModel) -> float:
    """What ``run_pipeline`` reports as ``cost_before``: ``closed`` as loaded, priced, with no rule run (the
    whole-step search prices the step as written so, where it does not rewrite it)."""
    with collect_young_only():
        eg, outs, token, _ = _load(closed, (), priced=True)
        try:
            return input_cost(eg.snapshot(), outs, token, model)
        finally:
            eg.release()


def programs_cost(programs: Sequence[core.ClosedJaxpr], model: CostModel) -> list[float]:
    """:func:`program_cost` of each of ``programs``, read off one load of them all where they take the same inputs
    and have no effects: with no rule nothing merges (a class is a hash-consed term: :class:`ProofGraph`'s price
    reads one program off a load that holds others so), each program's classes and the price read from its outputs
    are those it has loaded alone, the same floats, and the terms the programs share are loaded once (a step's
    three joint programs, ``grad/decide.py``'s ``priced_joints``, share most of theirs). Where the load holds a
    class of two nodes (a price read of it would choose between them), each is priced alone."""
    same = all(p.in_avals == programs[0].in_avals and not p.jaxpr.effects for p in programs)
    if len(programs) > 1 and same:
        with collect_young_only():
            eg, loaded, _, _ = _load_all(programs, (), priced=True)
            try:
                snap = eg.snapshot()
                if all(len(ns) == 1 for ns in snap.nodes.values()):
                    return [input_cost(snap, outs, None, model) for outs, _ in loaded]
            finally:
                eg.release()
    return [program_cost(p, model) for p in programs]


def saturated_classes(closed: core.ClosedJaxpr, entries: Sequence[tuple[Rule, Ruleset]], limits: Limits) -> list:
    """The e-classes of ``closed``'s outputs once loaded and saturated with ``entries``: what a proof that two
    of its values are equal reads. Nothing is extracted or emitted, and the e-graph goes back to the pool."""
    with collect_young_only():
        eg, outs, _, held = _load(closed, entries)
        try:
            Engine(eg, entries, limits, manual=held.manual, held=held).run()
            snap = eg.snapshot()
            return [snap.cls_of_name[o] for o in outs]
        finally:
            eg.release()


class ProofGraph:
    """``closed`` loaded once, with no rule, for several proofs over its values (the whole-step search's candidate
    losses, ``rewrite/grad/step.py``): each proof loads another program into the same e-graph, its inputs bound to
    values of ``closed``, and reads classes. With no rule nothing is merged (a class is a hash-consed term, and
    each body loaded is a scope of its own), so the classes read are those that loading ``closed`` and that
    program together into a fresh e-graph gives (:func:`saturated_classes`); only ``closed`` is loaded once for
    all of them, not once per proof. ``closed`` has no effects. ``model``, where given, prices ``closed`` as
    loaded (:meth:`price`)."""

    def __init__(self, closed: core.ClosedJaxpr, model: CostModel | None = None) -> None:
        jaxpr = closed.jaxpr
        values = list(jaxpr.constvars) + list(jaxpr.invars)
        values += [w for e in jaxpr.eqns for w in e.outvars if not isinstance(w, core.DropVar)]
        every = core.ClosedJaxpr(core.new_jaxpr(jaxpr.constvars, jaxpr.invars, values, jaxpr.eqns, jaxpr.effects,
                                                BUILT_DEBUG),
                                 closed.consts)
        with collect_young_only():
            self.egraph, outs, _, _ = _load(every, (), priced=True)
        self.ref = dict(zip(values, outs))
        self.model = model
        #: ``closed`` alone as loaded, before any proof's program: the snapshot the first proof's
        #: :meth:`body_between` reads (kept, not made again), which :meth:`price` reads
        self.first = self.egraph.snapshot() if model is not None else None

    def price(self, outs: Sequence[Any]) -> float | None:
        """:func:`program_cost` of ``closed`` with the outputs ``outs`` (its values), read off its load here rather
        than loaded again (the same program, loaded alone into a fresh e-graph with no rule, as ``program_cost``
        loads it: the same terms, and a whole program's price reads the program alone); ``None`` without a model
        or where an output is not one of its values (a literal)."""
        if self.first is None or not all(isinstance(v, core.Var) and v in self.ref for v in outs):
            return None
        with collect_young_only():
            return input_cost(self.first, [self.ref[v] for v in outs], None, self.model)

    def classes(self, values: Sequence[Any], program: core.ClosedJaxpr, args: Sequence[Any]) -> tuple[list, list]:
        """The classes of ``values`` (of the program loaded at first) and of ``program``'s outputs, ``program``
        loaded with its inputs bound to the values ``args``."""
        eg = self.egraph
        with collect_young_only():
            outs, _ = load_closed(program, [self.ref[a] for a in args], eg)
            snap = eg.snapshot()
            return [snap.cls_of_name[self.ref[v]] for v in values], [snap.cls_of_name[o] for o in outs]

    def body_between(self, value: Any, leaves: Sequence[Any]) -> str | None:
        """The constructor of a node with a body (a ``cond``'s branches, a ``jit`` or ``custom_jvp_call`` kept as a
        call) that ``value``'s term, of the program loaded at first, runs through before it reaches ``leaves``;
        ``None`` if there is none. A program loaded later with its inputs bound to ``leaves`` then never computes
        ``value``'s class: each body it loads is a scope of its own (``Body`` names its scope), so none of its
        terms above its inputs is one that holds a body of the first program, and with no rule a class is one
        term. A proof that would read it is known to fail before that program is made."""
        snap = self.egraph.snapshot()
        stop = {snap.cls_of_name[self.ref[a]] for a in leaves}
        nodes = snap.nodes

        def kids(c: Any) -> list[Any]:
            return [] if c in stop else [a for node in nodes.get(c, ()) for a in operands(snap, node)]

        for c in walk([snap.cls_of_name[self.ref[value]]], kids):
            if c in stop:
                continue
            for ctor, _ in nodes.get(c, ()):
                if any(sort in ("Region", "BList") for sort in ctor_arg_sorts(ctor)):
                    return ctor
        return None

    def release(self) -> None:
        """The e-graph goes back to the pool: no proof is read from this one again."""
        if self.egraph is not None:
            self.first = None
            self.egraph.release()
            self.egraph = None


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


def _held(closed: core.ClosedJaxpr, entries: Sequence[tuple[Rule, Ruleset]]) -> Held:
    """The primitives ``closed`` holds, in its bodies too, and, if an anchored rule's primitive is among them,
    the ids of its literals as the e-graph will hold them (scalar literals and constants, rounded to their
    dtypes: ``jaxpr/load.py``). A literal missed here only defers a rule to the engine's own check."""
    prims: set[str] = set()
    bodies = [closed]
    stack, seen = [closed.jaxpr], {id(closed.jaxpr)}
    while stack:
        for e in stack.pop().eqns:
            prims.add(e.primitive.name)
            for b in core.jaxprs_in_params(e.params):
                j = getattr(b, "jaxpr", b)
                if id(j) not in seen:  # a body several equations share is read once
                    seen.add(id(j))
                    stack.append(j)
                    bodies.append(b)
    if not any(rule.anchor in prims for rule, _ in entries):
        return Held(frozenset(prims))
    values: dict[tuple, tuple] = {}  # each distinct (value, dtype) once: a program repeats its few literals
    for b in bodies:
        for c in getattr(b, "consts", ()):
            arr = np.asarray(c)
            if arr.shape == () and arr.dtype != object:
                values.setdefault((arr.item(), arr.dtype), (arr, arr.dtype))
        for e in getattr(b, "jaxpr", b).eqns:
            for a in e.invars:
                if isinstance(a, core.Literal):
                    try:
                        values.setdefault((a.val, a.aval.dtype), (a.val, a.aval.dtype))
                    except TypeError:  # an unhashable value (an array scalar): read as it is
                        values[(id(a), None)] = (a.val, a.aval.dtype)
    return Held(frozenset(prims), frozenset(LITERALS.intern_value(in_dtype(v, d)) for v, d in values.values()))
