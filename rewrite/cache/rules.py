"""A program's custom derivatives written down: rules a stored program holds that no original program does.

A ``custom_vjp_call`` or ``custom_jvp_call`` of the user's program is stored by
its place in the traced program and taken from the fresh trace on load. One a
rule built (the nn pack's ``softplus``, the attention pack's backward) or one
JAX's dead-code elimination re-wrapped is not in the original: its rule is
written as jaxprs (:func:`vjp_rule_params`, :func:`jvp_rule_fun`), or as the
original's rule under the same dead-code elimination (:func:`dce_chain`,
:func:`dce_jvp`), and rebuilt on load after its types are checked against the
call. A rule whose JVP calls the same rule again (``logaddexp``'s does) is
written once and referred to from inside itself (:class:`Forward`). A rule's
``custom_vjp`` that is a ``jax.custom_vjp`` defined at the top level of a module
(seed 000's kernel, ``rulesets.kernels.sin_squared``) is written by its module
and name instead (:func:`named_custom_vjp`): its backward is not traced to be
written (1,284 equations, 45 ms, for a program the rewrite made in 15) nor read
back, and on load it is called again at the call's types and kept only where
that trace is the written call (:func:`named_vjp_params`).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
from jax.extend import linear_util as lu

from ..ir.jaxapi import ad, core, custom_vjp_bwd
from ..jaxpr.dce import dce_chain, dce_jvp  # noqa: F401  (read here by serialise)
from ..jaxpr.trace import trace_at


class Unserialisable(Exception):
    """The chosen program holds something this module cannot write down."""


def _same_type(a: Any, b: Any) -> bool:
    """The same type up to weak typing (a rule's JVP may trace its outputs weak where its call's are not)."""
    if hasattr(a, "shape") and hasattr(b, "shape"):
        return a.shape == b.shape and a.dtype == b.dtype
    return a == b


class Forward:
    """A rule read back before it is built: the ``jvp_jaxpr_fun`` of a ``custom_jvp_call`` inside its own
    rule's JVP (``logaddexp``'s JVP calls ``logaddexp``). It is called only once the program is read."""

    def __init__(self) -> None:
        self.rule: Any = None

    def fun(self, debug: Any) -> Any:
        return lu.wrap_init(lambda *in_zeros: self.rule.call_wrapped(*in_zeros), debug_info=debug)


def residual_avals(call: core.ClosedJaxpr, fwd: core.ClosedJaxpr, fwds: Any) -> list:
    """The residuals' types, as JAX hands them to the backward: the forward's first outputs, or inputs it
    forwards (``fwds[i]``: the input's index)."""
    outs = iter(fwd.out_avals)
    res = [next(outs) if f is None else call.in_avals[f] for f in fwds]
    if list(outs) != list(call.out_avals):
        raise Unserialisable("the custom_vjp's forward does not end in the call's outputs")
    return res


def vjp_rule_params(written: tuple, call: core.ClosedJaxpr) -> dict:
    """A ``custom_vjp_call``'s rule params rebuilt from its jaxprs, once they are checked against ``call``."""
    fwd, back, out_tree, res_tree, fwds, zeros, names = written
    if not (isinstance(fwd, core.ClosedJaxpr) and isinstance(back, core.ClosedJaxpr)
            and isinstance(fwds, list) and isinstance(zeros, list)):
        raise Unserialisable("a custom_vjp rule of the wrong form")
    for j in (fwd, back):
        core.check_jaxpr(j.jaxpr)
    if len(fwds) != res_tree.num_leaves or out_tree.num_leaves != len(call.out_avals) \
            or any(f is not None and not (type(f) is int and 0 <= f < len(call.in_avals)) for f in fwds):
        raise Unserialisable("a custom_vjp's residuals do not match its forward")
    if list(fwd.in_avals) != list(call.in_avals):
        raise Unserialisable("a custom_vjp's forward takes other inputs than its call")
    res_avals = residual_avals(call, fwd, fwds)
    if list(back.in_avals) != res_avals + [a.to_ct_aval() for a in call.out_avals] \
            or len(zeros) != len(call.in_avals) \
            or list(back.out_avals) != [a.to_ct_aval() for a, z in zip(call.in_avals, zeros) if not z]:
        raise Unserialisable("a custom_vjp's backward does not match its call")
    # the functions' names, which the program's text shows
    fwd_debug, bwd_debug = (call.jaxpr.debug_info if n is None else core.DebugInfo(str(n[0]), str(n[1]), None, None)
                            for n in (names if isinstance(names, list) and len(names) == 2 else [None, None]))

    def fwd_jaxpr(*_: Any) -> tuple:
        return fwd.jaxpr, fwd.consts

    def bwd(*args: Any) -> list:
        outs = iter(core.eval_jaxpr(back.jaxpr, back.consts, *args))
        return [ad.Zero(a.to_ct_aval()) if z else next(outs) for a, z in zip(call.in_avals, zeros)]

    trees = (out_tree, res_tree, list(fwds))
    return {"fwd_jaxpr_thunk": lu.wrap_init(fwd_jaxpr, debug_info=fwd_debug),
            "bwd": lu.wrap_init(custom_vjp_bwd(bwd), debug_info=bwd_debug),
            "out_trees": lambda: trees}


def jvp_rule_fun(written: tuple, call: core.ClosedJaxpr, num_consts: Any) -> Any:
    """A ``custom_jvp_call``'s ``jvp_jaxpr_fun`` rebuilt from its JVP's jaxpr, once that is checked against
    ``call``. JAX asks it for the JVP at the tangents that are not symbolic zeros; without symbolic zeros a
    rule sees zeros there as arrays, so the jaxpr for those is the written one with zeros in their place."""
    jvp, out_zeros, name = written
    if not (isinstance(jvp, core.ClosedJaxpr) and isinstance(out_zeros, list) and type(num_consts) is int
            and 0 <= num_consts <= len(call.in_avals)):
        raise Unserialisable("a custom_jvp rule of the wrong form")
    core.check_jaxpr(jvp.jaxpr)
    primals, outs = list(call.in_avals[num_consts:]), list(call.out_avals)
    tangents = [a.to_tangent_aval() for a in primals]
    want_out = outs + [a.to_tangent_aval() for a, z in zip(outs, out_zeros) if not z]
    if len(out_zeros) != len(outs) or len(jvp.in_avals) != 2 * len(primals) or len(jvp.out_avals) != len(want_out) \
            or not all(map(_same_type, jvp.in_avals, primals + tangents)) \
            or not all(map(_same_type, jvp.out_avals, want_out)):
        raise Unserialisable("a custom_jvp's rule does not match its call")
    debug = call.jaxpr.debug_info if not (isinstance(name, tuple) and len(name) == 2) \
        else core.DebugInfo(str(name[0]), str(name[1]), None, None)

    @functools.lru_cache(maxsize=None)
    def at(in_zeros: tuple) -> tuple:
        if not any(in_zeros):
            return jvp.jaxpr, jvp.consts, list(out_zeros)

        def given(*xs: Any) -> list:
            nonzero = iter(xs[len(primals):])
            ts = [ad.zeros_like_aval(t) if z else next(nonzero) for t, z in zip(tangents, in_zeros)]
            return core.eval_jaxpr(jvp.jaxpr, jvp.consts, *xs[:len(primals)], *ts)

        closed = trace_at(given, primals + [t for t, z in zip(tangents, in_zeros) if not z])
        return closed.jaxpr, closed.consts, list(out_zeros)

    return lu.wrap_init(lambda *in_zeros: at(tuple(bool(z) for z in in_zeros)), debug_info=debug)


def named_custom_vjp(params: dict) -> tuple[str, str, Any] | None:
    """``(module, name, in_tree)`` where a ``custom_vjp_call``'s rule (``params``) is that of the ``jax.custom_vjp``
    bound to ``name`` at the top level of the imported ``module``, called with positional arguments of pytree
    ``in_tree`` (what JAX's ``_flatten_bwd`` keeps) and no ``nondiff_argnums``, and a call of it at the call's types
    traces to a call of the same types (:func:`named_vjp_params`); else ``None``. Its code is in the rewrite cache's
    key (a rule that calls it holds it: the fingerprint walks its functions). The call's own program may be the
    rules' rewrite of the kernel's forward (``x ** 2`` as ``square``): it is written as it is, as any other."""
    bwd = params.get("bwd")
    chain = dce_chain(bwd)  # JAX's dead-code elimination's wrapper, keeping every output: the rule itself
    if chain is not None:
        if not all(all(used) for used in chain[1]):
            return None
        bwd = chain[0]
    user = getattr(bwd, "f", None)
    module = sys.modules.get(getattr(user, "__module__", None) or "")
    in_tree = next((static[0] for gen, static in getattr(bwd, "transforms", ())
                    if getattr(gen, "__name__", "") == "_flatten_bwd" and static
                    and isinstance(static[0], jax.tree_util.PyTreeDef)), None)
    if module is None or in_tree is None:
        return None
    for name, obj in list(vars(module).items()):
        if isinstance(obj, jax.custom_vjp) and obj.bwd is user and not obj.nondiff_argnums:
            try:
                named_vjp_params((module.__name__, name, in_tree), params)
            except Unserialisable:
                return None
            return module.__name__, name, in_tree
    return None


def named_vjp_params(written: tuple, params: dict) -> dict:
    """The rule params of a ``custom_vjp_call`` written by :func:`named_custom_vjp`: the named ``jax.custom_vjp``
    (of a module already imported) called at the call's types, where that trace is one call of it whose inputs,
    outputs, constant count and ``symbolic_zeros`` are the written call's (its program may be the rules' rewrite of
    the one traced: :func:`named_custom_vjp`)."""
    module, name, in_tree = written
    obj = getattr(sys.modules.get(module), name, None) if type(module) is str and type(name) is str else None
    call = params["call_jaxpr"]
    if not isinstance(obj, jax.custom_vjp) or obj.nondiff_argnums or not isinstance(in_tree, jax.tree_util.PyTreeDef) \
            or in_tree.num_leaves != len(call.in_avals):
        raise Unserialisable(f"no top-level custom_vjp {module}.{name} for this call")

    def flat(*xs: Any) -> list:
        return jax.tree_util.tree_leaves(obj(*jax.tree_util.tree_unflatten(in_tree, xs)))

    try:
        traced = trace_at(flat, list(call.in_avals))
    except Exception as e:  # a call that does not trace at these types is not this one
        raise Unserialisable(f"{module}.{name} does not trace at its call's types ({type(e).__name__})") from None
    eqns = traced.jaxpr.eqns
    again = eqns[0].params if len(eqns) == 1 and eqns[0].primitive.name == "custom_vjp_call" else {}
    if not again or list(eqns[0].invars) != list(traced.jaxpr.invars) \
            or list(eqns[0].outvars) != list(traced.jaxpr.outvars) \
            or again.get("num_consts") != params.get("num_consts") \
            or again.get("symbolic_zeros") != params.get("symbolic_zeros") \
            or list(again["call_jaxpr"].in_avals) != list(call.in_avals) \
            or list(again["call_jaxpr"].out_avals) != list(call.out_avals):
        raise Unserialisable(f"{module}.{name} traces to another call than the written one")
    return {k: again[k] for k in ("fwd_jaxpr_thunk", "bwd", "out_trees")}
