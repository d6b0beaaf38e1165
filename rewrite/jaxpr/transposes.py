"""Whether JAX can still differentiate a rewritten program where it differentiates the input.

A rewritten forward runs inside the user's ``jax.jit``, and JAX's autodiff transposes it there as it transposes
any program. For nearly every program a replacement that computes the same values transposes as the match did.
Under an explicit mesh with *reduced* axes (``P(reduced={'x'})``: each device holds the whole value, and its
cotangent is an unreduced partial sum) it need not: JAX types the cotangent of a reduced value as unreduced, and
only an operation that meets an ``x``-sharded operand where the transpose contracts it can produce one. ``sum(sin(x) @
sin(y))`` with ``x`` reduced and ``y`` sharded on ``x`` transposes; ``la_sum_product``'s ``sum(sin(x), 0) .
sum(sin(y), 1)``, the same values, meets ``y`` only after ``y``'s sum, and JAX's transpose of its product raises
``ShardingTypeError`` (pjit_test's ``test_reduced_sin_fwd_mul_bwd``, routed). So where a program holds such
values, the rewritten program is checked once, by tracing its VJP, and the input is kept where only the input
transposes (:func:`rewrite.pipeline._held_to_input`). Other programs are not traced again: the check is for the
one kind of type known to part a program's values from its transposability.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from ..ir.intern import TYPES
from ..ir.jaxapi import core, has_reduced_axes
from ..ir.primitives import is_float
from ..ir.walk import any_value
from .trace import no_cotangents, spec_of

log = logging.getLogger(__name__)


def reads_reduced(closed: core.ClosedJaxpr) -> bool:
    """Does ``closed`` hold a value typed with reduced or unreduced mesh axes, an input or any equation's output,
    bodies included?"""
    return any_value(closed, has_reduced_axes)


def vjp_error(closed: core.ClosedJaxpr) -> Exception | None:
    """The error JAX raises tracing the VJP of ``closed`` (its float inputs against its float outputs, each output's
    cotangent typed as the output), or ``None`` where it traces. Traced in the caller's context (its mesh)."""
    in_avals, out_avals = closed.in_avals, closed.out_avals
    dif_in = [i for i, a in enumerate(in_avals) if is_float(a)]
    dif_out = [i for i, a in enumerate(out_avals) if is_float(a)]
    fn = core.jaxpr_as_fun(closed)

    def pullback(*args: Any) -> Any:
        def of_floats(*xs: Any) -> list[Any]:
            full = list(args)
            for i, x in zip(dif_in, xs):
                full[i] = x
            return list(fn(*full))

        outs, vjp = jax.vjp(of_floats, *[args[i] for i in dif_in])
        cts = no_cotangents(out_avals)
        for i in dif_out:
            cts[i] = outs[i]
        return vjp(cts)

    try:
        jax.make_jaxpr(pullback)(*[spec_of(a) for a in in_avals])
    except Exception as e:  # any: the question is only whether JAX can differentiate it
        return e
    return None


def transposes_as_input(before: core.ClosedJaxpr, after: core.ClosedJaxpr) -> bool:
    """Is ``after`` differentiable by JAX wherever ``before`` is? Checked only where ``before`` holds values with
    reduced mesh axes (the module's docstring); elsewhere ``True`` without a trace, and in a process that has loaded
    no such value (``TYPES.any_reduced``) without a walk of the program."""
    if after is before or not TYPES.any_reduced or not reads_reduced(before):
        return True
    error = vjp_error(after)
    if error is None or vjp_error(before) is not None:
        return True
    log.info("the rewritten program is kept out: JAX cannot differentiate it where it differentiates the input "
             "(%s: %s)", type(error).__name__, error)
    return False
