"""A VJP's split priced as it runs: each use of it (a training step, ``jax.grad``) is one program XLA compiles.

Under ``jit`` the two halves of a split inline into the program around them: ``jax.value_and_grad`` compiles the
forward's outputs and the gradients as one program, ``jax.grad`` (``jax.vjp``'s pullback alone) the gradients
alone, and XLA fuses, stores and recomputes across the residuals as it does anywhere else, so that a residual is
stored only where XLA would store it. What ``build_vjp`` (``grad/vjp.py``) chooses between, the splits of the joint
extraction and of the gradients' alone, is therefore priced here as those two programs, each whole
(:func:`uses_price`), where ``choose_residuals`` prices the halves apart to choose each one's residuals.

One more split is offered where the two extractions differ (:func:`emit_parts`): the outputs as the joint
extraction computes them and the residuals and backward as the gradients' extraction does, each class the two
choose alike computed once. A form that pays in the gradients alone and costs in the outputs (seed 000's
``sin(a x)``, computed as a ``select`` that XLA stores once for the gradients, but copies into every loop that
also computes the output: ``rulesets._sincos``) then runs where it pays: the gradients read it, and the outputs
read ``sin`` as written.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax

from ..extract.extract import bounds_memory, fatter
from ..ir.jaxapi import core
from ..ir.walk import children, postorder
from ..jaxpr.emit import Emitter, _Scope, dce
from ..jaxpr.trace import same_program, spec_of
from ..pipeline import program_cost


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
    jaxpr = core.Jaxpr([v for *_, sc in done for v in sc.constvars], [invars[i] for i in range(len(in_avals))],
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


def without_outputs(joint: core.ClosedJaxpr, n_out: int) -> core.ClosedJaxpr:
    """A joint program ``(primals, cotangents) -> (outputs, gradients)`` with its outputs dropped (and what only
    they read): the gradients alone."""
    j = joint.jaxpr
    return dce(core.ClosedJaxpr(j.replace(outvars=j.outvars[n_out:]), joint.consts))


@dataclasses.dataclass
class Uses:
    """One split's two uses under ``jit``, each one program: ``train`` (outputs and gradients) and ``alone``
    (gradients alone), their prices (``price``: the sum) and, where asked, predicted peaks of temporaries."""

    train: core.ClosedJaxpr
    alone: core.ClosedJaxpr
    price: float
    train_price: float
    peaks: tuple[float, float] | None = None


def uses_price(fwd: core.ClosedJaxpr, bwd: core.ClosedJaxpr, n_res: int, model: Any,
               seen: list[tuple[core.ClosedJaxpr, float]]) -> Uses:
    """:class:`Uses` of the split ``fwd``/``bwd``: each use priced whole (``program_cost``, as the pipeline prices an
    input program), the two weighted alike; a program priced already (``seen``: two splits share their
    gradients alone) is not priced again."""
    def price(closed: core.ClosedJaxpr) -> float:
        for other, got in seen:
            if same_program(other, closed):
                return got
        got = program_cost(closed, model)
        seen.append((closed, got))
        return got

    train, alone = inlined(fwd, bwd, n_res), inlined(fwd, bwd, n_res, outputs=False)
    train_price = price(train)
    return Uses(train, alone, train_price + price(alone), train_price)


def cheapest_use(uses: Sequence[Uses], written: tuple[core.ClosedJaxpr, core.ClosedJaxpr], model: Any,
                 held: Callable[[int], bool] = lambda i: i > 0) -> int:
    """The index of the cheapest of ``uses`` (the first of a tie), leaving out, where the model bounds memory
    (``extract.bounds_memory``), each one ``held(i)`` says to hold that is predicted (``predict_temp_bytes``) to hold
    more temporaries than ``written`` (JAX's VJP of the program: its training step and its gradients alone) in
    either use (``extract.fatter``), as ``extract.policy.no_fatter`` holds a rewrite to its input. The first is the
    joint extraction's, which the pipeline held to the written training step already."""
    predict = getattr(model, "predict_temp_bytes", None)
    bounded = bounds_memory(model) and predict is not None
    limits: list[float] = []
    best = 0
    for i, u in enumerate(uses):
        if bounded and held(i):
            if not limits:
                limits = [float(predict(p)) for p in written]
            u.peaks = (float(predict(u.train)), float(predict(u.alone)))
            if any(fatter(p, w) for p, w in zip(u.peaks, limits)):
                continue
        if u.price < uses[best].price and not math.isnan(u.price):
            best = i
    return best
