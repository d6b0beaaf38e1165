"""Dead-code elimination of an emitted program, with JAX's wrapper of a ``custom_jvp``'s rule mended.

``pe.dce_jaxpr`` re-wraps every ``custom_jvp_call``'s ``jvp_jaxpr_fun`` in a closure that drops the rule's unused
outputs (``_custom_jvp_call_dce``), even where every output is used. That closure keeps the rule's tangents
``[*used_outs, *used_outs]`` where the call's ``symbolic_zeros`` is off, yet a rule may return a symbolic zero
all the same (``custom_derivatives.zero_from_primal(x, symbolic_zeros=True)``, JAX's own issue 28144), and
then its JVP program has fewer outputs than that list: ``jax.jvp`` of ``jax.vmap`` of the program raised
``ValueError: foreach() argument 2 is longer than argument 1`` where the program as traced ran (JAX's
``test_symbolic_zero_under_vmap_of_jit``, routed through the rewriter). :func:`dce` replaces each such wrapper
by :func:`dce_jvp`'s, which keeps each tangent by whether the rule made it.
"""

from __future__ import annotations

from typing import Any

from jax.extend import linear_util as lu
from jax.interpreters import partial_eval as pe

from ..ir.jaxapi import core
from .edit import EqnEdit


def dce_chain(x: Any) -> tuple[Any, list] | None:
    """``(rule, [used_outs, ...])`` if ``x`` is JAX's dead-code elimination's wrapper of a ``custom_jvp_call``'s
    ``rule`` (once or more, outermost first), else ``None``.

    ``pe.dce_jaxpr`` re-wraps the rule in a fresh closure that drops the rule's unused outputs
    (``_custom_jvp_call_dce``): its cells hold the wrapped rule and ``used_outs``.
    """
    chain: list = []
    while True:
        f, seen, inner = getattr(x, "f", None), 0, None
        while callable(f) and seen < 4 and getattr(f, "__closure__", None) and inner is None:
            cells = {name: _content(c) for name, c in zip(f.__code__.co_freevars, f.__closure__)}
            if "used_outs" in cells:
                found = [v for v in cells.values() if type(v) is type(x)]
                if len(found) != 1 or not all(type(u) is bool for u in cells["used_outs"]):
                    return None
                inner = found[0]
                chain.append([bool(u) for u in cells["used_outs"]])
            f = next((v for v in cells.values() if callable(v) and hasattr(v, "__code__")), None)
            seen += 1
        if inner is None:
            return (x, chain) if chain else None
        x = inner


def _content(cell: Any) -> Any:
    """A closure cell's value; ``None`` for an empty cell (a name the function assigns later, or never)."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def dce_jvp(fun: Any, used_outs: list) -> Any:
    """``fun`` (a ``jvp_jaxpr_fun``) under dead-code elimination to ``used_outs``, as JAX's own
    ``_custom_jvp_call_dce`` wraps it, but keeping each tangent the rule made (one it returned as a symbolic
    zero is not an output of its program, whether or not the call says ``symbolic_zeros``). Its closure is laid
    out as JAX's is (the rule and ``used_outs`` among its cells), so that :func:`dce_chain` reads it."""
    used_outs = [bool(u) for u in used_outs]
    memo: dict[tuple, tuple] = {}

    def kept(*in_zeros: Any) -> tuple:
        key = tuple(bool(z) for z in in_zeros)
        if key not in memo:
            jaxpr, consts, out_zeros = fun.call_wrapped(*in_zeros)
            made = [u for u, z in zip(used_outs, out_zeros) if not z]
            program, _ = pe.dce_jaxpr(jaxpr, [*used_outs, *made], True)
            memo[key] = (program, consts, [z for u, z in zip(used_outs, out_zeros) if u])
        return memo[key]

    return lu.wrap_init(kept, debug_info=fun.debug_info)


def unwrapped_rule(fun: Any) -> Any:
    """A ``jvp_jaxpr_fun`` with JAX's dead-code elimination wrappers replaced by :func:`dce_jvp`'s, level for level
    (its JVP programs the same where JAX's ran); ``fun`` itself where it is not such a wrapper, or not one this
    module can read."""
    chain = dce_chain(fun)
    if chain is None:
        return fun
    rule, levels = chain
    for used in reversed(levels):
        rule = dce_jvp(rule, used)
    return rule


def dce(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """Drop equations and loop outputs nothing reads, keeping every input, output and effect; each
    ``custom_jvp_call``'s rule, in the program and its bodies, as :func:`unwrapped_rule` leaves it."""
    jaxpr = closed.jaxpr
    new, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    return core.ClosedJaxpr(_Unwrap().jaxpr(new), closed.consts)


class _Unwrap(EqnEdit):
    """:func:`unwrapped_rule` of every ``custom_jvp_call`` in a jaxpr and its bodies."""

    def edited(self, e: Any, params: dict) -> dict | None:
        if e.primitive.name != "custom_jvp_call" or "jvp_jaxpr_fun" not in params:
            return None
        rule = unwrapped_rule(params["jvp_jaxpr_fun"])
        return None if rule is params["jvp_jaxpr_fun"] else {**params, "jvp_jaxpr_fun": rule}
