"""A loss's joint program seeded with 1, as JAX traces it, without the trace.

``grad/step.py``'s ``seeded_from(joint, cone)`` is ``jax.make_jaxpr`` of ``joint`` (``(leaves, cotangent) -> (L,
gradients)``, traced by JAX) evaluated at a cotangent of one: ``core.eval_jaxpr`` binds each of ``joint``'s
equations again, in order, into a fresh trace (which drops nothing: ``make_jaxpr`` traces without dead-code
elimination). Where nothing in that trace can stage an equation other than the one it binds, the result is
``joint``'s equations with fresh variables and the cotangent the literal ``1.0``; :func:`seeded_edit` builds that
program directly (1-2 ms against the trace's 6-70 ms on the step programs). It declines (``None``: the caller
traces) wherever the trace could make another program:

- the loss is not a scalar whose one a trace stages as a literal of the cotangent's type (``jnp.ones((), dtype)``);
- ``joint`` has constants (the trace stages them anew: scalars become literals) or effects, or its inputs are not
  the cone's types;
- an equation is not bound as a plain primitive (a call, ``custom_jvp``/``custom_vjp``, a ``shard_map``: their bind
  traces or wraps a body, new objects in the params), or has a staging rule other than the pass-through ones (``jit``
  not inlined, ``broadcast_in_dim``, ``reshape``, ``iota``, ``dynamic_slice``);
- an equation the tracer folds where an input is a constant (``convert_element_type``, ``device_put``:
  ``jaxapi.const_fold_rules``) has a literal input (the cotangent's ``1.0`` among them);
- a literal's value is not one the trace stages as a literal, or an equation has no traceback (the trace would
  record its own) or a dropped output.

A forwarding rule (``broadcast_in_dim``, ``convert_element_type`` to their input's type) reads only types, which
are the joint's, so it decides as it did in the joint's own trace. What is kept is what the trace keeps: each
equation's params (the same dict: a staging rule passes the same values), its source info (the same traceback; the
name stack is the equation's own, a fresh trace's being empty), a fresh context made under the equation's (entered,
as ``eval_jaxpr`` enters it), each literal's value with its own type. ``tests/test_seed.py`` holds the edit to the
trace, equation by equation, on step programs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from ..ir.jaxapi import BUILT_DEBUG, const_fold_rules, core, custom_staging_rules, jit_inlined_when_staged

#: Primitives whose staging rule binds them as a plain primitive is bound (the same params' values).
_PASS_THROUGH = frozenset({"broadcast_in_dim", "reshape", "iota", "dynamic_slice"})


@functools.cache
def _one(dtype: Any) -> Any:
    """The literal ``jnp.ones((), dtype)`` is in a trace, or ``None`` where it is not one."""
    out = jax.make_jaxpr(lambda: jax.numpy.ones((), dtype))()
    (v,) = out.jaxpr.outvars
    return v if isinstance(v, core.Literal) and not out.jaxpr.eqns and not out.consts else None


def _plain_bind(eqn: Any) -> bool:
    """Is ``eqn`` bound again, in a trace, as the same equation (no body traced, no params made anew)?"""
    p = eqn.primitive
    kind = type(p)
    if (kind.bind is not core.Primitive.bind or kind.bind_with_trace is not core.Primitive.bind_with_trace
            or kind.get_bind_params is not core.Primitive.get_bind_params):
        return False
    if p in custom_staging_rules:
        if p.name == "jit":
            return not jit_inlined_when_staged(eqn.params.get("inline", False)) and not any(
                isinstance(c, core.Ref) for c in eqn.params["jaxpr"].consts)
        return p.name in _PASS_THROUGH
    return True


def _literal(v: Any) -> Any:
    """A fresh literal of ``v``'s value, as a trace stages it; ``None`` where it would not be a literal."""
    return core.Literal(v.val, core.typeof(v.val)) if core.is_literalable(v.val, False) else None


def seeded_edit(joint: core.ClosedJaxpr, cone: core.ClosedJaxpr) -> core.ClosedJaxpr | None:
    """``grad/step.py``'s ``seeded_from(joint, cone)`` built from ``joint``'s equations, or ``None`` where the
    trace could make another program (the module's docstring says where)."""
    L = cone.out_avals[0]
    jaxpr = joint.jaxpr
    n = len(cone.in_avals)
    if L.shape != () or joint.consts or jaxpr.constvars or jaxpr.effects or len(jaxpr.invars) != n + 1:
        return None
    one = _one(L.dtype)
    ct = jaxpr.invars[-1]
    if one is None or one.aval != ct.aval or any(a != v.aval for a, v in zip(cone.in_avals, jaxpr.invars)):
        return None
    env: dict[Any, Any] = {v: core.Var(v.aval) for v in jaxpr.invars[:-1]}
    env[ct] = core.Literal(one.val, one.aval)
    eqns = []
    for e in jaxpr.eqns:
        if not _plain_bind(e) or e.source_info.traceback is None:
            return None
        ins = [_literal(v) if isinstance(v, core.Literal) else env[v] for v in e.invars]
        if any(v is None for v in ins) or (e.primitive in const_fold_rules
                                           and any(isinstance(v, core.Literal) for v in ins)):
            return None
        outs = []
        for w in e.outvars:
            if isinstance(w, core.DropVar):
                return None
            outs.append(env.setdefault(w, core.Var(w.aval)))
        with e.ctx.manager:
            ctx = core.current_jaxpr_eqn_context()
        eqns.append(core.new_jaxpr_eqn(ins, outs, e.primitive, e.params, e.effects, e.source_info, ctx))
    outvars = [_literal(v) if isinstance(v, core.Literal) else env[v] for v in jaxpr.outvars]
    if any(v is None for v in outvars):
        return None
    return core.ClosedJaxpr(core.new_jaxpr([], [env[v] for v in jaxpr.invars[:-1]], outvars, eqns, core.no_effects,
                                           BUILT_DEBUG), [])
