"""A VJP's split priced as it runs: each use of it (a training step, ``jax.grad``) is one program XLA compiles.

Under ``jit`` the two halves of a split inline into the program around them: ``jax.value_and_grad`` compiles the
forward's outputs and the gradients as one program, ``jax.grad`` (``jax.vjp``'s pullback alone) the gradients
alone, and XLA fuses, stores and recomputes across the residuals as it does anywhere else, so that a residual is
stored only where XLA would store it. What ``build_vjp`` (``grad/vjp.py``) chooses between, the splits of the joint
extraction and of the gradients' alone, is therefore priced here as those two programs, each whole
(:func:`uses_prices`), where ``choose_residuals`` prices the halves apart to choose each one's residuals.

One more split is offered where the two extractions differ (:func:`emit_parts`): the outputs as the joint
extraction computes them and the residuals and backward as the gradients' extraction does, each class the two
choose alike computed once. A form that pays in the gradients alone and costs in the outputs (seed 000's
``sin(a x)``, computed as a ``select`` that XLA stores once for the gradients, but copies into every loop that
also computes the output: ``rulesets._sincos``) then runs where it pays: the gradients read it, and the outputs
read ``sin`` as written.

A training step that holds a loss's backward (``rewrite(step)``, ``grad/step.py``) reads the loss's VJP as one
program rewritten (``grad.vjp.rewrite_joint``), which it inlines: that program is chosen among the same three
(:func:`joint_as_run`), priced in the use the step makes of it (the loss read too, or its gradients alone). A step
that reads the loss runs the joint program whole, as its joint extraction priced it: the gradients are then not
extracted apart (``grad.vjp._joint_choices``), and the joint extraction's program is the one taken.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax

from ..extract.choice import reachable
from ..extract.extract import bounds_memory, fatter
from ..ir.jaxapi import core
from ..ir.walk import children, postorder
from ..jaxpr.dce import dce
from ..jaxpr.emit import Emitter, _Scope, emit
from ..jaxpr.trace import same_program, spec_of
from ..pipeline import programs_cost


def agreeing(snap: Any, a: dict, b: dict, roots: Sequence[Any]) -> set:
    """The classes reachable from ``roots`` under choice ``a`` whose programs ``a`` and ``b`` choose alike: the
    same node, and alike in every class it reads (bodies and operand lists included)."""
    same: set = set()
    for c in postorder(list(roots), lambda c: children(a[c])):
        node = a[c]
        if b.get(c) == node and all(k in same for k in children(node)):
            same.add(c)
    return same


def emit_parts(snap: Any, egraph: Any, in_avals: Sequence[Any], parts: Sequence[tuple[dict, Sequence[Any]]],
               debug_info: Any) -> core.ClosedJaxpr:
    """One program from ``in_avals`` whose outputs are each part's roots, in order, each computed under the part's
    own choice (``(choice, roots)``); a class an earlier part computed is read from it where the two choose alike
    (:func:`agreeing`), so that what both compute is computed once."""
    invars = {i: core.Var(a) for i, a in enumerate(in_avals)}
    done: list[tuple[dict, Sequence[Any], _Scope]] = []
    outs: list[Any] = []
    for choice, roots in parts:
        sc = _Scope(Emitter(snap, choice, egraph), 0, invars)
        for before, their_roots, theirs in done:
            same = agreeing(snap, before, choice, their_roots)
            sc.env.update({c: v for c, v in theirs.env.items() if c in same})
        outs += sc.atoms(list(roots))
        done.append((choice, roots, sc))
    eqns = [e for *_, sc in done for e in sc.eqns]
    jaxpr = core.new_jaxpr([v for *_, sc in done for v in sc.constvars], [invars[i] for i in range(len(in_avals))],
                           outs, eqns, core.join_effects(*(e.effects for e in eqns)) if eqns else core.no_effects,
                           debug_info)
    return core.ClosedJaxpr(jaxpr, [x for *_, sc in done for x in sc.consts])


def inlined(fwd: core.ClosedJaxpr, bwd: core.ClosedJaxpr, n_res: int, outputs: bool = True) -> core.ClosedJaxpr:
    """The program a caller of both halves of a split runs under ``jit``, which inlines them:
    ``(primals, cotangents) -> (outputs, gradients)``, or, without ``outputs``, ``-> gradients`` (``jax.grad``,
    whose program drops the outputs and the forward work only they read)."""
    n_in, n_out = len(fwd.in_avals), len(fwd.out_avals) - n_res

    def joint(*args: Any) -> list[Any]:
        outs = core.eval_jaxpr(fwd.jaxpr, fwd.consts, *args[:n_in])
        grads = core.eval_jaxpr(bwd.jaxpr, bwd.consts, *outs[n_out:], *args[n_in:])
        return (list(outs[:n_out]) if outputs else []) + list(grads)

    closed = jax.make_jaxpr(joint)(*[spec_of(a) for a in (*fwd.in_avals, *bwd.in_avals[n_res:])])
    return closed if outputs else dce(closed)


def sliced(joint: core.ClosedJaxpr, n_out: int, dif: Sequence[int], wrt: Sequence[int]) -> core.ClosedJaxpr:
    """``grad.step.rederive``'s ``joint`` (``(leaves, cotangent) -> (outputs, gradients at dif)``) with the gradients of
    the leaves at ``wrt`` alone and nothing else they do not read: the program JAX's joint at ``wrt`` computes, as
    XLA compiles either (its dead code dropped), which the memory hold of the loss-first program reads for it
    without a second trace (``grad.decide.held_alone``; 14 ms of numpyro_eight_schools' 0.2 s first call), and
    which a whole step's joint decision holds its candidates to and runs where JAX's is kept (``Rewritten.
    _loss_first``): flax's encoder-decoder step's joint at 60 of its 61 float leaves is, equation for equation, JAX's
    traced at the 60 less its dead code (874 of 940 equations; the same price and peak), and is not traced again
    (about 80 ms)."""
    keep = set(wrt)
    outs = joint.jaxpr.outvars
    chosen = list(outs[:n_out]) + [v for i, v in zip(dif, outs[n_out:]) if i in keep]
    return dce(core.ClosedJaxpr(joint.jaxpr.replace(outvars=chosen), joint.consts))


def without_outputs(joint: core.ClosedJaxpr, n_out: int) -> core.ClosedJaxpr:
    """A joint program ``(primals, cotangents) -> (outputs, gradients)`` with its outputs dropped (and what only
    they read): the gradients alone."""
    j = joint.jaxpr
    return dce(core.ClosedJaxpr(j.replace(outvars=j.outvars[n_out:]), joint.consts))


def as_run(n_out: int, value: bool | None) -> Callable[[core.ClosedJaxpr], core.ClosedJaxpr]:
    """A joint program as a step that reads it runs it: where the step reads only the gradients (``value`` False)
    without its ``n_out`` outputs (:func:`without_outputs`: XLA drops what only they read), else as it is."""
    if value is False:
        return lambda joint: without_outputs(joint, n_out)
    return lambda joint: joint


@dataclasses.dataclass
class Uses:
    """One split's two uses under ``jit``, each one program: ``train`` (outputs and gradients) and ``alone``
    (gradients alone), their prices (``price``: the sum) and, where asked, predicted peaks of temporaries."""

    train: core.ClosedJaxpr
    alone: core.ClosedJaxpr
    price: float
    train_price: float
    peaks: tuple[float, float] | None = None


def uses_prices(halves: Sequence[tuple[core.ClosedJaxpr, core.ClosedJaxpr, int]], model: Any,
                seen: list[tuple[core.ClosedJaxpr, float]]) -> list[Uses]:
    """:class:`Uses` of each split ``(fwd, bwd, n_res)`` of ``halves``: each use priced whole (``program_cost``, as
    the pipeline prices an input program), the two weighted alike. The uses not priced before (``seen``: two
    splits share their gradients alone) are priced in one load (:func:`rewrite.pipeline.programs_cost`: each at
    the float it has alone; one e-graph borrowed, and the forward they all compute loaded once)."""
    pairs = []
    for fwd, bwd, n_res in halves:
        train = inlined(fwd, bwd, n_res)  # its gradients alone: the program without the outputs (what only they read)
        pairs.append((train, without_outputs(train, len(fwd.out_avals) - n_res)))
    _priced([p for pair in pairs for p in pair], model, seen)
    return [priced_uses(train, alone, model, seen) for train, alone in pairs]  # (each one priced now)


def priced_uses(train: core.ClosedJaxpr, alone: core.ClosedJaxpr, model: Any,
                seen: list[tuple[core.ClosedJaxpr, float]], value: bool | None = None) -> Uses:
    """:class:`Uses` of the programs ``train`` and ``alone``, each priced whole unless ``seen`` holds it priced;
    ``value``, where given, says which one runs (``train`` where the outputs are read): that one alone is priced,
    and only it is held to memory (:func:`cheapest_use`). Two priced here are priced in one load
    (:func:`rewrite.pipeline.programs_cost`: the same floats as each alone; one e-graph borrowed, not two, and the
    forward both compute loaded once)."""
    train, alone = run_uses(train, alone, value)
    prices = _priced(runs_of(train, alone, value), model, seen)
    return Uses(train, alone, sum(prices), prices[0])


def _priced(programs: Sequence[core.ClosedJaxpr], model: Any, seen: list[tuple[core.ClosedJaxpr, float]]
            ) -> list[float]:
    """Each of ``programs``' price whole: ``seen``'s where it holds the same program (:func:`same_program`), the
    others priced in one load (:func:`rewrite.pipeline.programs_cost`: the same floats as each alone), each once,
    and added to ``seen``."""
    def known(closed: core.ClosedJaxpr) -> float | None:
        return next((got for other, got in seen if same_program(other, closed)), None)

    unpriced: list[core.ClosedJaxpr] = []
    for p in programs:
        if known(p) is None and not any(same_program(q, p) for q in unpriced):
            unpriced.append(p)
    seen.extend(zip(unpriced, programs_cost(unpriced, model)))  # (one alone is program_cost's; none, no load)
    return [known(p) for p in programs]  # type: ignore[misc]


def runs_of(train: core.ClosedJaxpr, alone: core.ClosedJaxpr, value: bool | None) -> list[core.ClosedJaxpr]:
    """The programs of the uses that run (:func:`run_uses`), each once: what :func:`priced_uses` prices."""
    train, alone = run_uses(train, alone, value)
    return [train] if value is not None else [train, alone]


def run_uses(train: core.ClosedJaxpr, alone: core.ClosedJaxpr, value: bool | None) -> tuple[Any, Any]:
    """The programs of the uses that run, as :class:`Uses` holds them: ``(train, alone)``, or where ``value`` says
    which one runs (``train`` where the outputs are read), that one twice."""
    if value is None:
        return train, alone
    return (train, train) if value else (alone, alone)


def cheapest_use(uses: Sequence[Uses], written: tuple[core.ClosedJaxpr, core.ClosedJaxpr], model: Any,
                 held: Callable[[int], bool] = lambda i: i > 0) -> int:
    """The index of the cheapest of ``uses`` (the first of a tie), leaving out, where the model bounds memory
    (``extract.bounds_memory``), each one ``held(i)`` says to hold that is predicted (``predict_temp_bytes``) to hold
    more temporaries than ``written`` (JAX's VJP of the program: its training step and its gradients alone) in
    either use (``extract.fatter``), as ``extract.policy.no_fatter`` holds a rewrite to its input. The first is the
    joint extraction's, which the pipeline held to the written training step already."""
    predict = getattr(model, "predict_temp_bytes", None)
    bounded = bounds_memory(model) and predict is not None

    def peaks(train: core.ClosedJaxpr, alone: core.ClosedJaxpr) -> tuple[float, float]:
        first = float(predict(train))  # type: ignore[misc]
        return first, first if alone is train else float(predict(alone))  # type: ignore[misc]

    limits: tuple[float, ...] = ()
    best = 0
    for i, u in enumerate(uses):
        if bounded and held(i):
            if not limits:
                limits = peaks(*written)
            u.peaks = peaks(u.train, u.alone)
            if any(fatter(p, w) for p, w in zip(u.peaks, limits)):
                continue
        if u.price < uses[best].price and not math.isnan(u.price):
            best = i
    return best


def same_choice(snap: Any, a: dict, b: dict, roots: Sequence[Any]) -> bool:
    """Whether choices ``a`` and ``b`` make one program from ``roots``: the same node in every class ``a``'s
    program uses, inside bodies too (``extract.choice.reachable``). What is read of a choice from those roots
    (a split's classes, frontier and prices) is then the same for both: ``grad.vjp._joint_choices``' extraction for
    the gradients alone often chooses as the joint one did, and its residual search is not made twice."""
    return a is b or all(a[c] == b.get(c) for c in reachable(snap, a, roots))


def joint_as_run(snap: Any, eg: Any, joint: core.ClosedJaxpr, roots: Sequence[Any], before: core.ClosedJaxpr,
                 f_roots: Sequence[Any], choices: Sequence[dict], model: Any, value: bool | None = None,
                 seen: list[tuple[core.ClosedJaxpr, float]] | None = None,
                 extracted: tuple[core.ClosedJaxpr, float] | None = None, emitted: bool = False
                 ) -> core.ClosedJaxpr:
    """``grad.vjp.rewrite_joint``'s program from the e-graph of ``joint`` (``roots``: outputs, then gradients) and
    its two extractions ``choices`` (the joint one first): the cheapest of each emitted whole and, where the two
    compute the outputs apart, the outputs as the first and the gradients as the second (:func:`emit_parts`), in
    the uses that run (``value``: :func:`priced_uses`), held to ``before`` (``joint`` as written) as
    :func:`cheapest_use` holds a split. ``seen``, where given, receives each program priced with its price
    (:func:`priced_uses`), for a caller that prices the program returned again.

    ``extracted``, where given, is the program the pipeline extracted from that e-graph and its price there
    (``Result.after``, ``cost_after``): where the joint extraction alone is returned and it is that program (its
    text), it goes into ``seen`` at that price, so that ``grad.vjp.decided_jointly`` does not load and price it
    again (``program_cost``: 0.11 s each of flax_long_context_step's two rewritten joints, 8% of its rewrite). That
    is the extraction's price in the saturated e-graph, not the program's loaded afresh: they agree within 1.7e-5
    (flax_long_context_step's 1.6e-5 and 5e-6, the GPT steps' 0-1.6e-6, flax_lm_step's equal), and every decision
    of the 24 ecosystem programs and of the decision corpus comes out the same (``benchmarks/results/log.md``,
    h-long2). A joint left as loaded is priced as loaded either way, the same float.

    ``emitted``: ``extracted``'s program is the one the pipeline emitted from ``choices[0]`` (its ``Result.choice``)
    from these ``roots`` with this ``joint``'s types (:func:`as_emitted`). Emission is a function of those, so where
    the joint extraction alone is returned that program is it, the same text: it is returned, not emitted again and
    its text compared with the pipeline's (:func:`rewrite.jaxpr.trace.same_program` prints both: 0.06-0.17 s of a
    whole step's rewrite, its joints', 2-5%)."""
    first, grads = choices
    n_out = len(f_roots)
    debug = joint.jaxpr.debug_info
    alone = same_choice(snap, first, grads, roots)  # one program: nothing to choose
    if alone and emitted and extracted is not None:
        if seen is not None and extracted[1] == extracted[1]:
            seen.append(extracted)
        return extracted[0]
    made = emit(snap, first, eg, joint.in_avals, roots, None, debug)
    if alone:
        if seen is not None and extracted is not None and extracted[1] == extracted[1] and same_program(
                made, extracted[0]):  # (``made`` is emitted just now: no entry of ``seen`` can be it)
            seen.append((made, extracted[1]))
        return made
    programs = [made, emit(snap, grads, eg, joint.in_avals, roots, None, debug)]
    if not same_choice(snap, first, grads, f_roots):  # otherwise that program is the second
        parts = [(first, f_roots), (grads, roots[n_out:])]
        programs.append(dce(emit_parts(snap, eg, joint.in_avals, parts, debug)))
    priced: list = []
    alones = [without_outputs(p, n_out) for p in programs]
    # the uses that run, of every program here, priced in one load (_priced: each the float it has alone), not one
    # load a program (equinox's scanned layer's VJP: its three in 85 ms)
    _priced([q for p, a in zip(programs, alones) for q in runs_of(p, a, value)], model, priced)
    uses = [priced_uses(p, a, model, priced, value) for p, a in zip(programs, alones)]
    if seen is not None:  # (priced_uses compares programs by their text: only this call's, as before)
        seen.extend(priced)
    return programs[cheapest_use(uses, run_uses(before, without_outputs(before, n_out), value), model)]


def as_emitted(res: Any) -> bool:
    """Whether ``res.after`` is the program the pipeline emitted from ``res.choice`` (``res.snapshot``, ``res.roots``,
    ``res.before``'s types and debug info: ``pipeline._extracted``'s emitter), as a kept result of
    :func:`rewrite.pipeline.run_pipeline` or :func:`rewrite.pipeline.run_together` holds it: every ``after`` they
    make is the emission of the extraction they keep (``Result.choice``; ``extract.policy.no_fatter``'s fallback
    replaces both), but for the input itself kept (``extract.tie.on_xla_count``'s tie, the pipeline's ``as_loaded``
    floor), which is ``res.before``, and a program the backend timed (``res.timing``), which may be another
    candidate. ``tests/test_together.py`` checks it against a fresh emission on a step's two joints."""
    return res.after is not res.before and res.timing is None and res.choice is not None
