"""Two derivatives of one loss built together: :func:`rewrite.grad.vjp.decided_jointly`'s joint programs of the
forward rewritten with and without a ``jointly`` ruleset's rules share most of their equations, so they are loaded
into one e-graph and saturated once (:func:`rewrite.pipeline.run_together`), each extracted from its own roots, the
plain one without the terms only the other holds as loaded. The rules they are saturated with are the other rules:
those of ``jointly`` rulesets are decided on the forward, where they act (they replace a forward computation
together with its backward), and a joint program of the forward they rewrote holds none of the sites they match
(of the five ecosystem programs where they fire in the forward, none fired in a joint program: where one did, the
joint with them would differ from saturating it alone with all the rules)."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

from ..ir.jaxapi import core
from ..jaxpr.trace import Traced
from .. import pipeline  # run_together looked up at each call: benchmarks.rewrite_time counts its rows
from . import marks, vjp  # its joint_program looked up at each call, as vjp's own callers do (a test counts the traces)
from ..extract.lean import closed_peaks
from ..pipeline import program_cost, programs_cost
from .decide import ONE_JOINT_MARGIN, jointly_cannot_win, one_joint_can_win, plain_cannot_lead
from .uses import as_run
from .vjp import VJPResult, _as_run, _vjp_of


class Pending:
    """One of :func:`build_vjps`' two derivatives before its split is searched: its joint program's pipeline result
    ``res`` (kept: the e-graph is the two's), whose joint extraction ``program`` is priced ``cost`` (``res.cost_after``),
    split (:func:`rewrite.grad.vjp._vjp_of`) at the first :meth:`build` only. :func:`decided_jointly` orders the two
    by their joint extractions and splits the one it holds to JAX's derivative first, the other only where that one
    is not taken: each split's residual search prices some 26 whole programs (flax_seq2seq_grad: 0.35-0.4 s each)."""

    #: nothing added to its name in the decision's words (:class:`Alone` says how it was built)
    note = ""

    def __init__(self, res: Any, closed: core.ClosedJaxpr, dif_in: list[int], dif_out: list[int], model: Any,
                 entries: Sequence[Any], times: dict[str, float]) -> None:
        self.res, self.program, self.cost = res, res.after, res.cost_after
        self._split = (closed, dif_in, dif_out, model, entries, times)
        self._built: VJPResult | None = None

    def build(self) -> VJPResult:
        if self._built is None:
            closed, dif_in, dif_out, model, entries, times = self._split
            self._built = _vjp_of(self.res, closed, dif_in, dif_out, model, entries, dict(times), False, True)
        return self._built

    def release(self) -> None:
        """The e-graph back to the pool (once both are read: the two share it)."""
        self.res.release()


def build_vjps(traced: Traced, plain: Traced, entries: Sequence[Any], model: Any, limits: Any,
               lazy: bool = False, plain_joint: tuple[core.ClosedJaxpr, float | None] | None = None
               ) -> tuple[Any, Any]:
    """:func:`build_vjp` of two forwards of one function (``primal=False``, not kept), their joint programs
    rewritten in one e-graph (:func:`rewrite.pipeline.run_together`, ``plain``'s without the terms only
    ``traced``'s holds): :func:`decided_jointly`'s two, with and without a ``jointly`` ruleset's rules, saturated for
    at most :data:`VJPS_ITERATIONS` iterations. ``lazy``: the two as :class:`Pending`, split where asked; the caller
    releases them. ``plain_joint``, where given, is ``plain``'s joint program traced already, with its price where
    known (where ``plain`` is the loss as written: :func:`rewrite.grad.vjp.as_written_vjp`'s joint, which is
    :func:`rewrite.grad.vjp.joint_program`'s program of it, the same text): not traced again, nor priced again
    where its price is given."""
    t0 = time.perf_counter()
    pairs: list = []  # the cotangents where the two forwards part (grad/marks.py), united
    if plain_joint is None:
        (joint, other), pairs = marks.marked_joints(traced.closed, plain.closed, lambda f: vjp.joint_program(f)[0])
        dif_in, dif_out = vjp.float_positions(traced.closed)
    else:
        joint, dif_in, dif_out = vjp.joint_program(traced.closed)
        other = plain_joint[0]
    traced_s = time.perf_counter() - t0
    bounded = dataclasses.replace(limits, iterations=min(limits.iterations, VJPS_ITERATIONS))
    res_plain, res = pipeline.run_together(other, joint, joint_rules(entries), model, bounded, price_input=True,
                                           input_prices=(None if plain_joint is None else plain_joint[1], None),
                                           unite=[(p, c) for c, p in pairs])
    pending = tuple(Pending(r, c, dif_in, dif_out, model, entries, {"trace_vjp": traced_s / 2})
                    for r, c in ((res, traced.closed), (res_plain, plain.closed)))
    if lazy:
        return pending  # type: ignore[return-value]
    try:
        return tuple(p.build() for p in pending)  # type: ignore[return-value]
    finally:
        for p in pending:
            p.release()


#: :func:`rewrite_joints` saturates the two joint programs for at most this many iterations (and for no more than
#: the run's ``Limits.iterations``). Their forward halves are the forward already rewritten; what the joint adds
#: (the backward's sums pulled, factored and merged) is found in its first few iterations, and the rest grows
#: variants of it: flax_lm_step's two joints hold 10,963 e-graph rows after 4 iterations and 12,593 after 6 (about a
#: tenth of a whole step's CPU seconds between the two). The programs emitted for the 24 ecosystem programs
#: (``benchmarks.rewrite_time --emitted``) are the same at 4, 6 or 10 iterations as saturated; at 3
#: flax_long_context_step's differs, at 2 three steps' (a negation not yet pulled out of a layer norm's backward sum).
#: A bound tuned on that corpus, one iteration above where it first differs, not a proof that nothing new would be
#: found: past it the joints' stop reason is ``"iteration limit"``, which no caller of the whole step reports.
JOINT_ITERATIONS = 4

#: :func:`build_vjps` saturates the two joint programs of a gradient program (``jax.grad(rewrite(loss))``) for at most
#: this many iterations, for :data:`JOINT_ITERATIONS`' reason: flax_seq2seq_grad's two joints saturated in 12 iterations
#: (18,403 rows; the last eight added 2,672 of them). A measured decision: its fifth iteration (1,181 of 16,912 rows,
#: 0.91x of the joints' CPU s without it against an A/A of 1.00x) bought only a negation put between two reshapes in the
#: backward (three of them, six reshapes), which XLA removes: the compiled gradient's instructions (2,771, 317 fusions)
#: and temp memory (79.2 MB) are the same at 4 and 5, its run time 1.004x against an A/A of 1.0125x. The other 23
#: ecosystem programs and the decision corpus's cases do not build through here. Its fourth iteration (10,613 rows
#: against 9,550 at 3) bought nothing: the programs emitted for the 24 ecosystem programs are byte-identical at 3 and
#: 4, and the first call's CPU s 0.94x at 3 (2026-12-04, in process, eight each alternated); at 2 flax_seq2seq_grad's
#: differs (a broadcast for a reshape, its backward's outputs in another order; compiled, the same temp bytes and
#: 6,144 more flops, 2,778 instructions against 2,772). So 3, one above where it differs.
VJPS_ITERATIONS = 3


#: Rules the joint programs are not saturated with (:func:`joint_rules`), by name (a rule's name is unique among a
#: rewrite's rules; ``rulesets.attention_with`` keeps them). They cannot make a joint cheaper:
#:
#: * ``hoist_reductions`` (``rulesets.scan``): in a joint the loops it finds are the forward's, which the forward's
#:   own pipeline offered it already (a loop it built declines), and JAX's transposes of them, whose consumers'
#:   sums it would move into a copy of the backward loop (flax_lm_step: 42 of the layer norms' backward sums into
#:   the LM head's backward loop). On the four whole steps and flax_seq2seq_grad it built 538-651 e-graph names in
#:   the joints' first iteration, and a third of their rows once the other rules had worked on the copies' bodies
#:   (flax_lm_step 11,617 -> 8,270 rows), none of which either joint's extraction took. A measured decision:
#:   without it two steps' programs move (flax_lm_step, wholestep_equinox_gpt; the commit says by what).
#: * the attention pack's blocked forms: a joint's forward is the forward as its pipeline chose it, so an
#:   attention it left as written computes and holds its weights (``softmax(s)``) for the backward, which reads
#:   them; a blocked form of a product that reads them (the forward's ``softmax(s) v``, the backward's
#:   ``v softmax(s)``) recomputes them block by block beside the copy held: more flops, no lower peak.
#:   flax_seq2seq_grad's joints built 339 names and about 1,050 rows for ``attn_blocked_vp`` (6 firings), none
#:   extracted; its program is the same without them.
#: * ``red_split`` (``rulesets.derivatives``' sums: ``sum(x ± y) -> sum x ± sum y``): in a joint it splits the
#:   backward's sums of added cotangents one addition deeper a round, each part a new sum for ``red_merge``,
#:   ``red_pull`` and the layout rules to work on: 9-17% of the joints' rows (flax_long_context_step 9,455 -> 8,164,
#:   flax_lm_step 4,700 -> 4,037, wholestep_linen_gpt 4,587 -> 3,809, wholestep_equinox_gpt 5,225 -> 4,609,
#:   flax_seq2seq_grad 9,550 -> 8,672); the programs emitted for 23 of the 24 ecosystem programs are byte-identical
#:   without it, and the decision corpus's cases pass as recorded. A measured decision: wholestep_equinox_gpt's
#:   joint took it to pull a layer norm's mean through the product before it (the sum of ``x W + b`` over the
#:   features as ``x`` times W's summed rows plus ``b``'s sum); without it the mean is summed as written, that joint
#:   priced 0.38% lower, and XLA compiles the step to the same temp bytes, 85,248 fewer flops and 58,368 fewer bytes
#:   accessed (run time 0.98x against an A/A of 1.00x; benchmarks/results/log.md, h-joint). The other sums rules
#:   (``red_merge``, ``red_pull``) still run: without them wholestep_linen_gpt's and wholestep_equinox_gpt's joints
#:   are dearer.
JOINT_WITHOUT = frozenset({"hoist_reductions", "red_split", "attn_blocked", "attn_blocked_vp", "attn_blocked_wide",
                           "attn_blocked_wide_vp"})


def joint_rules(entries: Sequence[Any]) -> list:
    """``entries`` without the rules the joints are not saturated with (:data:`JOINT_WITHOUT`): the rules
    :func:`rewrite_joints`, :func:`rewrite_alone` and :func:`build_vjps` saturate with (read at each call)."""
    return [(r, owner) for r, owner in entries if r.name not in JOINT_WITHOUT]


def joint_limits(limits: Any) -> Any:
    """``limits`` with at most :data:`JOINT_ITERATIONS` iterations: a whole step's joint programs' saturation."""
    return dataclasses.replace(limits, iterations=min(limits.iterations, JOINT_ITERATIONS))


def rewrite_alone(closed: core.ClosedJaxpr, entries: Sequence[Any], model: Any, limits: Any,
                  wrt: Sequence[int] | None = None, value: bool | None = None,
                  seen: list[tuple[core.ClosedJaxpr, float]] | None = None,
                  trace: Callable[[core.ClosedJaxpr], core.ClosedJaxpr] | None = None) -> core.ClosedJaxpr:
    """:func:`rewrite.grad.vjp.rewrite_joint` of one forward of a whole step's loss (``Rewritten._loss_first``'s
    ``build``: where no ``jointly`` rule's node is in the forward, its only joint; and each of :func:`rewrite_joints`'
    two it rewrites alone, :class:`Alone`), saturated as :func:`rewrite_joints` saturates two: with
    :func:`joint_rules` for at most :data:`JOINT_ITERATIONS` iterations. The forward half of the
    joint is the forward already rewritten, whatever the joints beside it. Measured (2026-12-05): the programs emitted
    for the 24 ecosystem programs are byte-identical to those of the joint saturated with every rule to the run's own
    limit, and the decision corpus's cases hold; flax_transformer_step's joint holds 3,926 e-graph rows, not 5,414,
    flax_bf16_step's 2,125, not 2,338."""
    return vjp.rewrite_joint(closed, joint_rules(entries), model, joint_limits(limits), wrt, value, seen, trace)


class Alone:
    """One of :func:`rewrite_joints`' two joints, rewritten alone where asked (:meth:`build`), as :class:`Pending`
    stands for a VJP not split yet: ``program`` its input (the joint program as traced, as the caller runs it) and
    ``cost`` that input's price, which :func:`rewrite.grad.vjp.held_pending` orders the two by. ``note`` says so in
    the decision's words."""

    def __init__(self, program: core.ClosedJaxpr, cost: float, make: Callable[[], core.ClosedJaxpr], note: str
                 ) -> None:
        self.program, self.cost, self._make, self.note = program, cost, make, note
        self._built: core.ClosedJaxpr | None = None
        #: ``program``'s ``(held, charged)`` peaks (``extract.lean.closed_peaks``) where predicted already
        self.peaks: tuple[float, float] | None = None

    def build(self) -> core.ClosedJaxpr:
        if self._built is None:
            self._built = self._make()
        return self._built

    def release(self) -> None:
        """Nothing held: each is rewritten in an e-graph of its own, released once read."""


def rewrite_joints(closed: core.ClosedJaxpr, plain: core.ClosedJaxpr, entries: Sequence[Any], model: Any,
                   limits: Any, wrt: Sequence[int] | None = None, value: bool | None = None,
                   seen: list[tuple[core.ClosedJaxpr, float]] | None = None,
                   trace: Callable[[core.ClosedJaxpr], core.ClosedJaxpr] | None = None,
                   forwards: tuple[float, float] | None = None) -> tuple[Any, Any]:
    """:func:`rewrite_joint` of two forwards of one loss, their joint programs rewritten in one e-graph
    (:func:`rewrite.pipeline.run_together`, ``plain``'s without the terms only ``closed``'s holds):
    :func:`decided_jointly`'s two, with and without a ``jointly`` ruleset's rules, saturated for at most
    :data:`JOINT_ITERATIONS` iterations. ``trace``, where given, makes a forward's joint program (at ``wrt``:
    :func:`rewrite.grad.vjp.joint_at`, which reuses one traced already).

    Where only ``closed``'s joint can be kept (:func:`rewrite.grad.decide.one_joint_can_win` of the two joints'
    inputs, each priced whole as run and added to ``seen``), the two are returned as :class:`Alone`: each rewritten
    alone only where :func:`rewrite.grad.vjp.held_pending` reaches it (``plain``'s only where ``closed``'s is not
    held to JAX's as written). ``forwards``, the two forwards' prices where known, asks for that only where
    ``closed`` is priced under ``plain`` by the same margin: a joint is its forward and JAX's backward of it, and where
    the forwards are close so were their joints (the four whole steps: forwards apart 0.6-9.6%, joints 0.5-2.2%;
    flax_lm_step 55% and 35%), which are then not priced for nothing (0.03-0.06 s each). Where the forwards are
    apart by less (:func:`plain_first`), one joint is rewritten first, alone (:func:`_one_first`), and the other is
    built only where it can still be kept or ordered first: the one with the rules first where the plain one's input
    is predicted to hold far more (:func:`rewrite.grad.decide.plain_cannot_lead`), else the plain one
    (:func:`rewrite.grad.decide.jointly_cannot_win`), :func:`_first`; the other is then
    :class:`Alone`, rewritten only where the first is not kept against JAX's as written."""
    bounded = joint_limits(limits)
    trace = trace or (lambda f: vjp.joint_program(f, wrt)[0])
    rules, n_out = joint_rules(entries), len(closed.out_avals)
    inputs = None  # the two joints as traced, where traced to be priced first: not traced again for run_together
    if forwards is not None and one_joint_can_win(forwards[0], forwards[1], model):
        inputs = [trace(closed), trace(plain)]
        runs = [as_run(n_out, value)(j) for j in inputs]
        prices = programs_cost(runs, model)  # in one load: the same floats (pipeline.programs_cost)
        if seen is not None:  # the plain one is JAX's as written where plain is the loss: not priced again
            seen.extend((j, p) for j, r, p in zip(inputs, runs, prices) if r is j)
        if one_joint_can_win(prices[0], prices[1], model):
            def alone(joint: core.ClosedJaxpr) -> core.ClosedJaxpr:  # the joints' rules, extracted by them too
                return rewrite_alone(joint, entries, model, limits, value=value, seen=seen, trace=lambda j: j)
            notes = (" (its joint as traced)", " (its joint as traced, rewritten only where the other is not kept)")
            return tuple(Alone(j, p, functools.partial(alone, j), n)  # type: ignore[return-value]
                         for j, p, n in zip(inputs, prices, notes))
    pairs: list = []  # the cotangents where the two forwards part, of each joint (grad/marks.py), united
    if inputs is None:
        first = forwards is not None and plain_first(forwards[0], forwards[1], model)
        # (not where the plain forward is the loss as written, whose joint vjp.joint_at holds traced already)
        if not first and marks.traces_anew(trace, plain):
            inputs, pairs = marks.marked_joints(closed, plain, trace)
        else:
            plain_joint = trace(plain)  # traced first, as before: run_together loads it first
            inputs = [trace(closed), plain_joint]
        if first:
            found = _one_first(inputs, rules, entries, model, bounded, n_out, value, seen)
            if found is not None:
                return found
    res_plain, res = pipeline.run_together(inputs[1], inputs[0], rules, model, bounded, as_loaded=True,
                                           unite=[(p, c) for c, p in pairs])
    try:
        return (_as_run(res, n_out, model, entries, value, seen), _as_run(res_plain, n_out, model, entries, value,
                                                                          seen))
    finally:
        res.egraph.release()


#: :func:`plain_first`: one of a whole step's two joints is rewritten first, alone (:func:`_one_first`), where the
#: forward with the ``jointly`` rules is priced under the plain forward by more than this fraction (and by less than
#: :data:`rewrite.grad.decide.ONE_JOINT_MARGIN`, past which the other is tried alone first). A bet on time only: where
#: the test that the other cannot be kept then fails, the two are rewritten together as before (the first one's
#: pipeline spent for nothing: 0.3 s of flax_long_context_step's 2.2). Measured (2026-12-04): the LM head's loop took
#: 9.1% and 9.6% off the forward of wholestep_linen_gpt and wholestep_equinox_gpt, whose plain joints' saturation then
#: took 15-16% off and left the other 17-20% dearer (the test holds: the other is not built); 0.6% and 1.4% off
#: flax_long_context_step's and transformer_step's (golden table), whose two joints came out 0.5% and 0.9% apart with
#: the one with the rules 16% and 4% leaner: the test cannot hold there at its margins. At the full size of
#: ``benchmarks/wholestep.py`` (1,024 tokens, 16,384 words) the nine steps with an LM head are past this fraction too,
#: but there the joint with the loop is the cheaper and far the leaner (the plain joints as traced hold 2.6-3.8 times
#: its peak): the plain-first test failed on all nine, 0.3-0.67 s each spent for nothing (2026-12-07), and the other
#: one now goes first there (:func:`_one_first`).
PLAIN_FIRST_GAP = 0.05


def plain_first(jointly_forward: float, plain_forward: float, model: Any) -> bool:
    """Whether :func:`rewrite_joints` rewrites one of its two joints first, alone (:data:`PLAIN_FIRST_GAP`,
    :func:`_one_first`), from the two forwards' prices."""
    return (not getattr(model, "measures", False)
            and plain_forward * (1 - ONE_JOINT_MARGIN) <= jointly_forward < plain_forward * (1 - PLAIN_FIRST_GAP))


class Built(Alone):
    """A joint rewritten already, standing beside an :class:`Alone` not built yet (:func:`_one_first`)."""

    def __init__(self, program: core.ClosedJaxpr, cost: float) -> None:
        super().__init__(program, cost, lambda: program, "")


def _rewritten_alone(joint: core.ClosedJaxpr, rules: list, entries: Sequence[Any], model: Any, bounded: Any,
                     n_out: int, value: bool | None, seen: list[tuple[core.ClosedJaxpr, float]] | None
                     ) -> core.ClosedJaxpr:
    """``joint`` rewritten in an e-graph of its own, as run; the programs priced whole on the way go to ``seen``
    (with their prices)."""
    res = pipeline.run_pipeline(joint, rules, model, bounded, keep=True, price_input=False, as_loaded=True)
    try:
        return _as_run(res, n_out, model, entries, value, seen)
    finally:
        res.egraph.release()


def _one_first(inputs: list[core.ClosedJaxpr], rules: list, entries: Sequence[Any], model: Any, bounded: Any,
               n_out: int, value: bool | None, seen: list[tuple[core.ClosedJaxpr, float]] | None
               ) -> tuple[Any, Any] | None:
    """:func:`rewrite_joints`' two where one of them, rewritten alone first, leaves the other no way to be kept: the
    one with the ``jointly`` rules (``inputs[0]``) first where the plain one's input is predicted to hold so much
    more that its saturation could not bring it within the model's ``cache`` of the other's
    (:func:`rewrite.grad.decide.plain_cannot_lead`; the full-size whole steps of ``benchmarks/wholestep.py`` whose
    LM head's loop is kept: their plain joints' inputs are predicted to hold 2.9-4.1 times the other's peak
    rewritten, ``benchmarks/results/log.md``, the seventy-eighth session), else the plain one
    (:func:`rewrite.grad.decide.jointly_cannot_win`); :func:`_first`. ``None`` where neither holds: the two are then
    rewritten together."""
    runs = [as_run(n_out, value)(j) for j in inputs]
    peaks = [closed_peaks(model, r) for r in runs]  # each read again by decide.Joint.peak, not predicted
    if plain_cannot_lead(*(None if f is None else f[0] for f in (peaks[1], peaks[0])), model):
        found = _first(0, inputs, runs, peaks, rules, entries, model, bounded, n_out, value, seen)
        if found is not None:
            return found
    return _first(1, inputs, runs, peaks, rules, entries, model, bounded, n_out, value, seen)


def _first(first: int, inputs: list[core.ClosedJaxpr], runs: list[core.ClosedJaxpr], peaks: list, rules: list,
           entries: Sequence[Any], model: Any, bounded: Any, n_out: int, value: bool | None,
           seen: list[tuple[core.ClosedJaxpr, float]] | None) -> tuple[Any, Any] | None:
    """:func:`rewrite_joints`' two where the joint ``inputs[first]``, rewritten alone first, leaves the other (as run
    ``runs[other]``, its peaks ``peaks[other]``) no way to be taken before it: the first one :class:`Built`, the other
    :class:`Alone`, rewritten alone only where :func:`rewrite.grad.vjp.held_pending` reaches it (the first not kept
    against JAX's as written). The one with the ``jointly`` rules first (0): the plain one cannot be ordered before
    it (:func:`rewrite.grad.decide.plain_cannot_lead`); the plain one first (1): the other cannot be kept
    (:func:`rewrite.grad.decide.jointly_cannot_win`). ``None`` where it may: the other one first, or the two
    rewritten together. The plain one alone is its pipeline's program without what only the other held as loaded
    barred (``pipeline.run_together``'s ``first``): wholestep_linen_gpt's and wholestep_equinox_gpt's differ so (a
    mask's broadcast and a constant's conversion folded), priced 1e-6 lower and holding alike."""
    other, kept = 1 - first, []
    program = _rewritten_alone(inputs[first], rules, entries, model, bounded, n_out, value, kept)
    cost = next((c for p, c in kept if p is program), None)
    cost = program_cost(program, model) if cost is None else cost
    found = closed_peaks(model, program)
    peak, other_peak = (None if f is None else f[0] for f in (found, peaks[other]))
    price = program_cost(runs[other], model)
    if not (plain_cannot_lead(other_peak, peak, model) if first == 0
            else jointly_cannot_win(price, other_peak, cost, peak, model)):
        return None
    if seen is not None:
        seen.extend(kept)
        if runs[other] is inputs[other]:
            seen.append((runs[other], price))

    def alone() -> core.ClosedJaxpr:  # only where the first one is not kept: as run_together's
        return _rewritten_alone(inputs[other], rules, entries, model, bounded, n_out, value, seen)

    pair: list[Any] = [None, None]
    pair[first], pair[other] = Built(program, cost), Alone(
        runs[other], price, alone, " (its joint as traced, rewritten only where the other is not kept)")
    pair[first].peaks, pair[other].peaks = found, peaks[other]
    return tuple(pair)  # type: ignore[return-value]
