"""A step with its losses replaced, cut at its loss-first programs so that only the remainder is rewritten.

Each loss-first program that ``rewrite/grad/step.py`` puts in a step was already rewritten jointly with its
forward; a large step (from :data:`PIN_FROM` top-level equations) is saturated again only in what remains, its
loss-first programs pinned (``Rewritten._whole_step``): :func:`split_pinned` cuts the step, :func:`join_pinned`
puts the rewritten remainder back.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..ir.jaxapi import BUILT_DEBUG, core
from ..ir.primitives import ELEMENTWISE, LAYOUT, REDUCE, family_of
from ..jaxpr.dce import dce
from ..jaxpr.edit import in_order, read, substitute
from ..pipeline import program_cost
from ..records import Result

#: From how many top-level equations a step with its losses replaced has only its remainder saturated, its
#: loss-first programs (each already rewritten jointly with its forward) pinned (:func:`split_pinned`). A smaller
#: step is saturated whole: there it is cheap, and a second saturation of a loss-first program can still find a
#: form its first extraction missed (numpyro_mixture_logp's step prices 2% lower so).
PIN_FROM = 400


@dataclasses.dataclass
class Pinned:
    """A step cut at its loss-first programs (already rewritten, each jointly with its forward): ``rest`` is the
    remainder as a program ``(step inputs, what it reads of them) -> (step outputs, what they read of it)``."""

    step: core.ClosedJaxpr
    rest: core.ClosedJaxpr
    kept: list  # the loss-first programs' equations, in program order
    taken: list  # the values of theirs the remainder reads (its inputs after the step's own)
    given: list  # the remainder's values they read (its outputs after the step's own)


def split_pinned(step: core.ClosedJaxpr, pinned: set) -> Pinned | None:
    """``step`` cut at the equations that compute ``pinned`` values, or ``None`` where the step is smaller than
    :data:`PIN_FROM`, there are none, or nothing else (an equation computing some pinned values and some not is
    not cut)."""
    jaxpr = step.jaxpr
    if len(jaxpr.eqns) < PIN_FROM:
        return None
    kept, rest = [], []
    for e in jaxpr.eqns:
        ins = [w in pinned for w in e.outvars]
        if ins and all(ins):
            kept.append(e)
        elif any(ins):
            return None
        else:
            rest.append(e)
    if not kept or not rest:
        return None
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    made_by_rest = {w for e in rest for w in e.outvars}
    taken, given = [], []
    seen: set = set()
    for a in [a for e in rest for a in e.invars] + list(jaxpr.outvars):
        if isinstance(a, core.Var) and a in pinned and a not in seen:
            seen.add(a)
            taken.append(a)
    for a in (a for e in kept for a in e.invars):
        if isinstance(a, core.Var) and a in made_by_rest and a not in seen:
            seen.add(a)
            given.append(a)
    if not all(a in pinned or a in made_by_rest or a in inputs
               for e in kept for a in e.invars if isinstance(a, core.Var)):
        return None
    program = core.new_jaxpr(list(jaxpr.constvars), list(jaxpr.invars) + taken, list(jaxpr.outvars) + given, rest,
                             jaxpr.effects, BUILT_DEBUG)
    return Pinned(step, core.ClosedJaxpr(program, list(step.consts)), kept, taken, given)


def wholly_pinned(step: core.ClosedJaxpr, pinned: set) -> bool:
    """Whether every equation of ``step`` computes only ``pinned`` values: the step with its losses replaced is
    its loss-first programs and nothing else (a step that is ``jax.value_and_grad`` of its loss, as
    numpyro_eight_schools' is). Each was rewritten jointly with its forward already, so ``Rewritten._rewrite_rest``
    prices such a step as it is instead of saturating it whole again, whatever its size. A measured decision: the
    second saturation is a second pass of the rules over a joint's extraction, and on numpyro_eight_schools it
    found a program priced 1.6% lower (2572 against 2615), whose run time measured the same (interleaved, A/A:
    the log's h-resid section) at the same temp memory, for about a fifth of that step's first call."""
    return bool(step.jaxpr.eqns) and all(w in pinned for e in step.jaxpr.eqns for w in e.outvars)


#: The families of the operations a step's remainder may hold and still be left as it is (:func:`fused_only`).
FUSED = frozenset({ELEMENTWISE, LAYOUT, REDUCE})
#: The transcendental operations it may hold besides: an optimizer's roots and powers. The others (``exp``,
#: ``log``, ``logistic``, ``tanh`` ...) are what the packs' stable forms are made of (``nn_log_sigmoid``,
#: ``nn_softplus``, ``nn_log1p``), which must fire in a remainder as anywhere (a metric's ``-log(sigmoid(z))``).
FUSED_TRANSCENDENTAL = frozenset({"sqrt", "rsqrt", "pow"})
#: And ``split``: the batch cut into its micro-batches where each one's loss is a loss-first program
#: (``grad/alike.py``), an operation no rule reads (the loader keeps it whole) and XLA slices into its readers.
FUSED_SPLIT = frozenset({"split"})


def packs_only(entries: Any, packs: Any) -> bool:
    """Whether every rule of ``entries`` (``(rule, owner)`` pairs) is one of the built-in ``packs``' (a mapping of
    name to ruleset: those loaded, as a pack not loaded has no rule here) other than fastmath: what
    :func:`fused_only`'s decision was measured on. A user's own rules may be written for the update itself, and a
    fastmath pack a user named buys what XLA does not make."""
    ours = {id(r) for p in packs.values() if p.soundness != "fastmath" for r in p}
    return all(id(r) in ours for r, _ in entries)


def fused_only(rest: core.ClosedJaxpr) -> bool:
    """Whether ``rest`` (a step's remainder, :func:`split_pinned`'s) holds only pointwise, layout and reduction
    operations (:data:`FUSED`, :data:`FUSED_TRANSCENDENTAL`, :data:`FUSED_SPLIT`, inside ``jit`` calls too): an
    optimizer's update, which XLA computes in loop and reduction fusions whatever its form.
    ``Rewritten._rewrite_rest`` then prices the step as it is, without saturating the remainder, where that can win
    (see there) and the rules are the built-in packs' (:func:`packs_only`). A measured decision (2026-12-04): on the
    four whole steps where it is taken, what the rules did to the remainder was ``pow_one``'s and ``pow_two``'s
    ``x ** 1`` and ``x ** 2`` (wholestep_linen_gpt, wholestep_equinox_gpt; 0.015-0.018% of its price), which XLA makes
    itself, and nothing on flax_long_context_step and flax_lm_step (extracted as loaded); the compiled steps' temp
    bytes, flops and bytes accessed are the same either way, for 0.10-0.23 s of each first call.
    flax_transformer_step and flax_bf16_step, whose loss-first programs are JAX's as written, still have theirs
    saturated: only that brings them under the step as written."""
    def only(jaxpr: core.Jaxpr) -> bool:
        for e in jaxpr.eqns:
            if e.primitive.name in ("jit", "pjit"):
                if not only(e.params["jaxpr"].jaxpr):
                    return False
            elif (family_of(e.primitive.name) not in FUSED and e.primitive.name not in FUSED_TRANSCENDENTAL
                  and e.primitive.name not in FUSED_SPLIT):
                return False
        return True

    try:
        return only(rest.jaxpr)
    finally:
        del only  # a recursive closure is a reference cycle


def as_is(step: core.ClosedJaxpr, model: Any, stopped: str) -> Result:
    """``Rewritten._rewrite_rest``'s result for ``step`` not saturated (:func:`wholly_pinned`, ``stopped="pinned"``;
    its remainder :func:`fused_only`, ``"fused"``): the step itself, priced as it is."""
    t = time.perf_counter()
    cost = program_cost(step, model)
    return Result(before=step, after=step, cost_before=float("nan"), cost_after=cost, stopped=stopped, iterations=0,
                  rows=0, times={"price": time.perf_counter() - t}, stats={}, rewritten=True, warnings=[])


def join_pinned(cut: Pinned, rest: core.ClosedJaxpr) -> core.ClosedJaxpr | None:
    """The step again, its remainder now ``rest`` (``cut.rest`` rewritten), or ``None`` where ``rest`` computes
    what the loss-first programs read from what they compute (it cannot run before them)."""
    jaxpr, n_out, n_in = cut.step.jaxpr, len(cut.step.jaxpr.outvars), len(cut.step.jaxpr.invars)
    rj = rest.jaxpr
    after_taken = set(rj.invars[n_in:])
    for e in rj.eqns:  # values of rest that read what the loss-first programs compute
        if any(isinstance(a, core.Var) and a in after_taken for a in e.invars):
            after_taken.update(e.outvars)
    if any(isinstance(a, core.Var) and a in after_taken for a in rj.outvars[n_out:]):
        return None
    env: dict[Any, Any] = dict(zip(rj.invars, list(jaxpr.invars) + cut.taken))
    constvars, consts = list(jaxpr.constvars), list(cut.step.consts)
    for v, c in zip(rj.constvars, rest.consts):
        w = core.Var(v.aval)
        constvars.append(w)
        consts.append(c)
        env[v] = w
    eqns = [substitute(e, env) for e in rj.eqns]
    back = {g: read(env, o) for g, o in zip(cut.given, rj.outvars[n_out:])}
    eqns = in_order(eqns + [substitute(e, back) for e in cut.kept])
    new = core.new_jaxpr(constvars, list(jaxpr.invars), [read(env, o) for o in rj.outvars[:n_out]], eqns,
                         jaxpr.effects, jaxpr.debug_info)
    return dce(core.ClosedJaxpr(new, consts))


__all__ = ["FUSED", "FUSED_SPLIT", "FUSED_TRANSCENDENTAL", "PIN_FROM", "Pinned", "as_is", "fused_only", "join_pinned",
           "packs_only", "split_pinned", "wholly_pinned"]
