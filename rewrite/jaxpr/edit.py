"""Editing a jaxpr's equations in place of others: what the whole-step search does to a step.

A step's equations are rebuilt around a replacement: another program's equations are appended with its
inputs bound to the step's values (:func:`inline`, fresh variables each time, so one program may be inlined
twice), equations are re-pointed at the replacement's outputs (:func:`substitute`), and the whole is put back
in an order where each equation follows those it reads (:func:`in_order`).
"""

from __future__ import annotations

import heapq
from typing import Any, Sequence

from ..ir.jaxapi import core

#: Call-like primitives whose body :func:`inline` can inline in turn (their value is their body's).
CALLS = frozenset({"remat2", "checkpoint", "remat", "jit", "pjit", "closed_call", "core_call"})


def read(env: dict, a: Any) -> Any:
    """``a`` renamed by ``env`` (a literal is itself)."""
    return env.get(a, a) if isinstance(a, core.Var) else a


def substitute(e: Any, env: dict) -> Any:
    """The equation ``e`` reading ``env``'s values in place of its inputs (``e`` itself where none is renamed)."""
    if not env or not any(isinstance(a, core.Var) and a in env for a in e.invars):
        return e
    return e.replace(invars=[read(env, a) for a in e.invars])


def body_of(p: Any) -> tuple[core.Jaxpr, list[Any]]:
    """A call's or loop's body param as ``(jaxpr, its constants)``, closed or not."""
    if isinstance(p, core.ClosedJaxpr):
        return p.jaxpr, list(p.consts)
    return p, []


def inline(eqns: list, jaxpr: core.Jaxpr, consts: Sequence[Any], args: Sequence[Any], constvars: list,
           cvals: list, calls: frozenset[str] = frozenset()) -> list[Any]:
    """Append ``jaxpr``'s equations to ``eqns`` with fresh outputs and its inputs bound to ``args``; its constants
    become fresh ``constvars`` (their values appended to ``cvals``); its equations of the call-like primitives in
    ``calls`` (see :data:`CALLS`) are inlined in turn. Returns its outputs."""
    env: dict[Any, Any] = dict(zip(jaxpr.invars, args))
    for v, c in zip(jaxpr.constvars, consts):
        w = core.Var(v.aval)
        constvars.append(w)
        cvals.append(c)
        env[v] = w
    for e in jaxpr.eqns:
        ins = [read(env, a) for a in e.invars]
        key = "jaxpr" if "jaxpr" in e.params else "call_jaxpr" if "call_jaxpr" in e.params else None
        if e.primitive.name in calls and key is not None and not e.effects:
            inner, inner_consts = body_of(e.params[key])
            outs = inline(eqns, inner, inner_consts, ins, constvars, cvals, calls)
            env.update((o, r) for o, r in zip(e.outvars, outs) if isinstance(o, core.Var))
            continue
        outs = [core.Var(v.aval) if isinstance(v, core.Var) else v for v in e.outvars]
        env.update((o, r) for o, r in zip(e.outvars, outs) if isinstance(o, core.Var))
        eqns.append(e.replace(invars=ins, outvars=outs))
    return [read(env, a) for a in jaxpr.outvars]


def in_order(eqns: list) -> list:
    """``eqns`` reordered so that each comes after the equations it reads (a replacement put first may read
    values computed after it), otherwise keeping their order."""
    producer = {w: k for k, e in enumerate(eqns) for w in e.outvars}
    waits = [0] * len(eqns)
    readers: dict[int, list[int]] = {}
    for k, e in enumerate(eqns):
        for d in {producer[a] for a in e.invars if isinstance(a, core.Var) and a in producer}:
            waits[k] += 1
            readers.setdefault(d, []).append(k)
    ready = [k for k, n in enumerate(waits) if n == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        k = heapq.heappop(ready)
        out.append(eqns[k])
        for r in readers.get(k, ()):
            waits[r] -= 1
            if not waits[r]:
                heapq.heappush(ready, r)
    assert len(out) == len(eqns), "the equations read each other in a cycle"
    return out


def without_empty_mesh(e: Any) -> Any:
    """``e`` with a sharding on the empty mesh that shards nothing (what JAX's transposes put on a
    ``convert_element_type`` or a ``broadcast_in_dim``) written as ``None`` (what user code writes): the two
    compute the same, and are then one term."""
    def plain(s: Any) -> bool:
        mesh = getattr(s, "mesh", None)
        return getattr(mesh, "empty", False) and all(p is None for p in getattr(s, "spec", (0,)))

    changed = {k: None for k in ("sharding", "out_sharding") if k in e.params and e.params[k] is not None
               and plain(e.params[k])}
    return e.replace(params={**e.params, **changed}) if changed else e


def loads_alike(eqns: Sequence[Any], before: Sequence[Any]) -> bool:
    """Whether ``eqns`` (a step's top-level equations, :func:`without_empty_mesh` of ``before``) load into the
    terms ``before`` loads into, each with the same operands, but for the ``sharding`` param of the converts made
    plain, so that a whole program's price (``program_cost``) is the same float for both.

    Only a ``convert_element_type`` may have changed: no price reads a convert's sharding (the cost model reads
    ``sharding`` of a ``broadcast_in_dim`` alone, ``cost/memory.py`` and ``cost/simplify.py``). And no term may
    merge that did not: a changed convert is hash-consed with another convert of its scope (the top level) only
    where that one converts to the same dtype from an operand of the same type, so none may be unchanged, and the
    changed ones that may meet had one sharding before. numpyro_eight_schools' step (six such converts from JAX's
    transposes) was priced again apart, loaded into a fresh e-graph (``program_cost``, 15-20 ms), for the price
    read here off the proofs' load (5-6 ms): the same float."""
    def key(e: Any) -> tuple:
        return e.params.get("new_dtype"), e.params.get("weak_type"), e.invars[0].aval

    changed: dict[tuple, Any] = {}
    for e, f in zip(eqns, before):
        if e is f:
            continue
        if e.primitive.name != "convert_element_type" or len(e.invars) != 1:
            return False
        if changed.setdefault(key(f), f.params.get("sharding")) != f.params.get("sharding"):
            return False  # two shardings of one conversion, made one: their terms merge
    return not any(e is f and e.primitive.name == "convert_element_type" and key(f) in changed
                   for e, f in zip(eqns, before))


_BODIES = (core.Jaxpr, core.ClosedJaxpr)


class EqnEdit:
    """An edit of some equations' params throughout a jaxpr and its bodies: :meth:`edited` gives the params an
    equation takes instead (``None``: as it is). A body that changes is a new object, one that does not is the same,
    and each body is read once (``dce._Unwrap``, ``relink._Relink``)."""

    def __init__(self) -> None:
        self.done: dict[int, tuple[Any, Any]] = {}  # id -> (the body, kept alive; what it became)

    def edited(self, e: Any, params: dict) -> dict | None:
        """The params ``e`` takes instead of ``params`` (its own, with its bodies edited), or ``None``."""
        raise NotImplementedError

    def jaxpr(self, jaxpr: Any) -> Any:
        eqns = [self.eqn(e) for e in jaxpr.eqns]
        if all(a is b for a, b in zip(eqns, jaxpr.eqns)):
            return jaxpr
        return jaxpr.replace(eqns=eqns)

    def eqn(self, e: Any) -> Any:
        params = e.params  # a copy, made once something in it changes
        for k, v in e.params.items():
            if isinstance(v, _BODIES) or (type(v) in (tuple, list) and any(isinstance(x, _BODIES) for x in v)):
                new = self.value(v)
                if new is not v:
                    params = dict(params) if params is e.params else params
                    params[k] = new
        params = self.edited(e, params) or params
        return e if params is e.params else e.replace(params=params)

    def value(self, v: Any) -> Any:
        if isinstance(v, (tuple, list)):
            out = [self.value(x) for x in v]
            return v if all(a is b for a, b in zip(out, v)) else type(v)(out)
        if not isinstance(v, _BODIES):
            return v
        if id(v) not in self.done:
            if isinstance(v, core.Jaxpr) and not hasattr(v, "consts"):
                new = self.jaxpr(v)
            else:  # a ClosedJaxpr (on JAX 0.11+ a Jaxpr with its consts)
                inner = self.jaxpr(v.jaxpr)
                new = v if inner is v.jaxpr else core.ClosedJaxpr(inner, v.consts)
            self.done[id(v)] = (v, new)
        return self.done[id(v)][1]
