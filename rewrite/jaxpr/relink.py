"""A ``custom_jvp``'s rule that closes over values of the trace it was called in, given them as operands.

``jax.custom_jvp(f, nondiff_argnums=...)`` closes ``f`` and its JVP rule over the non-differentiable arguments.
Where one is a traced array (a PRNG key made inside the function: distrax's von Mises sampler), ``f``'s jaxpr takes
it as one of the call's first ``num_consts`` operands, but the rule (``jvp_jaxpr_fun``, traced only when the call
is differentiated) still holds the tracer of the trace the call was made in. A rewritten program is traced first
and differentiated after that trace has ended, so the rule's jaxpr read a dead tracer: ``jax.jvp`` and
``jax.grad`` of the rewritten sampler raised ``TracerArrayConversionError`` (loading the JVP program, whose
constant it was) and then ``UnexpectedTracerError``, where the function called as written runs. (JAX's own
``jax.jvp(jax.jit(f))`` fails so, JAX's issue 20889; ``jax.jit(jax.jvp(f))`` and eager calls do not.)

:func:`relinked` gives each such call, in a program as JAX traced it and in its bodies, every operand as an
argument (``num_consts=0``) and a rule that reads the operand where the original rule read the tracer of it: the
tracer stands for the very variable the call takes (:func:`rewrite.ir.jaxapi.staged_var`). The call computes
what it did, and a tangent of one of those operands is dropped as JAX drops it. A rule that reads a tracer the call
does not take keeps it (JAX's error, as before).
"""

from __future__ import annotations

from typing import Any

from jax.extend import linear_util as lu

from ..ir.jaxapi import core, staged_var
from .edit import EqnEdit


def relinked(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """``closed`` with every ``custom_jvp_call`` that has constant operands given a rule that reads them
    (the module's docstring); ``closed`` itself where it has none."""
    jaxpr = _Relink().jaxpr(closed.jaxpr)
    return closed if jaxpr is closed.jaxpr else core.ClosedJaxpr(jaxpr, closed.consts)


def relinked_rule(fun: Any, operands: list, avals: list) -> Any:
    """``fun`` (a ``jvp_jaxpr_fun`` of a call whose first ``len(operands)`` operands are the variables
    ``operands``, of types ``avals``) as the rule of the call with those operands as arguments: its JVP program
    takes them (and their tangents, unread) first, in place of the constants that were tracers of them."""
    k = len(operands)
    memo: dict[tuple, tuple] = {}

    def rule(*in_zeros: Any) -> tuple:
        key = tuple(bool(z) for z in in_zeros)
        if key not in memo:
            jaxpr, consts, out_zeros = fun.call_wrapped(*key[k:])
            # the variables ``consts`` bind lead the jaxpr's inputs: its constvars on jax 0.10, on jax 0.11+ (a jaxpr
            # with no consts attached has none) its first invars
            leading = [*jaxpr.constvars, *jaxpr.invars]
            constvars, rest = leading[:len(consts)], leading[len(consts):]
            at = {id(v): j for j, v in enumerate(operands)}
            read: dict[int, Any] = {}  # operand position -> the constant variable that stood for it
            kept_vars, kept = [], []
            for v, c in zip(constvars, consts):
                j = at.get(id(staged_var(c)), -1) if isinstance(c, core.Tracer) else -1
                if j >= 0 and j not in read:
                    read[j] = v
                else:
                    kept_vars.append(v)
                    kept.append(c)
            n = len(rest) - (len(key) - k - sum(key[k:]))  # the rule's primals, then its tangents
            primals = [read[j] if j in read else core.Var(a) for j, a in enumerate(avals)]
            tangents = [core.Var(a.to_tangent_aval()) for a, z in zip(avals, key[:k]) if not z]
            invars = [*primals, *rest[:n], *tangents, *rest[n:]]
            debug = jaxpr.debug_info.with_unknown_names() if jaxpr.debug_info is not None else None
            new = jaxpr.replace(constvars=kept_vars, invars=invars, debug_info=debug)
            memo[key] = (_Relink().jaxpr(new), kept, out_zeros)  # the rule's own calls, for a second derivative
        return memo[key]

    return lu.wrap_init(rule, debug_info=fun.debug_info)


class _Relink(EqnEdit):
    """:func:`relinked_rule` for every ``custom_jvp_call`` with constant operands in a jaxpr and its bodies."""

    def edited(self, e: Any, params: dict) -> dict | None:
        n = params.get("num_consts") if e.primitive.name == "custom_jvp_call" else 0
        if not (type(n) is int and n > 0 and "jvp_jaxpr_fun" in params):
            return None
        rule = relinked_rule(params["jvp_jaxpr_fun"], list(e.invars[:n]), [v.aval for v in e.invars[:n]])
        return {**params, "num_consts": 0, "jvp_jaxpr_fun": rule}
