"""Stage 2, load: every equation of a jaxpr becomes an e-node.

The walk is the textbook jaxpr interpreter (an environment, ``read``, a loop
over equations) with a table keyed by primitive name. A primitive in the
term table becomes its typed constructor; one that owns bodies (scan, while,
cond, jit, shard_map) gets its bodies loaded too, each in a scope of its own;
everything else becomes an ``Opaque`` node with its params kept whole, so an
unknown primitive is never an error. Equations with effects are threaded on
a token so that nothing can drop, duplicate or reorder them.

The loader talks to a *builder*. The same walk therefore inserts a program
(:class:`rewrite._egraph.EGraph`), compiles a rule's left-hand side into an
egglog query (:mod:`rewrite._pattern`), and checks that a traced term is
present in the e-graph (:class:`rewrite._pattern.Verifier`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence

import numpy as np
from jax._src import core

from . import _terms
from ._intern import EFFECTS, PARAMS, TYPES

TOKEN_AVAL = core.abstract_token


class Origin(NamedTuple):
    """Where an equation came from, kept so that what is emitted from it can say the same:
    its source location, and its context (the abstract mesh inside a shard_map body, say),
    which ``eval_jaxpr`` re-enters when it binds the equation."""

    source_info: Any
    ctx: Any


class Builder(Protocol):
    def term(self, ctor: str, args: Sequence[Any], type_id: int, source: Any = None) -> Any: ...
    def tlist(self, refs: Sequence[Any]) -> Any: ...
    def body(self, scope: int, outs: Sequence[Any]) -> Any: ...
    def blist(self, bodies: Sequence[Any]) -> Any: ...
    def literal(self, value: Any, aval: Any) -> Any: ...
    def const(self, array: Any, aval: Any) -> Any: ...
    def new_scope(self) -> int: ...


class Unsupported(Exception):
    """A jaxpr construct a builder cannot express (patterns reject bodies, say)."""


def load_closed(closed: core.ClosedJaxpr, inputs: Sequence[Any], b: Builder, token: Any = None) -> tuple[list[Any], Any]:
    return load_jaxpr(closed.jaxpr, closed.consts, inputs, b, token)


def load_jaxpr(jaxpr: core.Jaxpr, consts: Sequence[Any], inputs: Sequence[Any], b: Builder,
               token: Any = None) -> tuple[list[Any], Any]:
    """Load ``jaxpr`` with its inputs bound to ``inputs``. Returns output refs and the final token."""
    env: dict[core.Var, Any] = {}

    def read(atom: Any) -> Any:
        if isinstance(atom, core.Literal):
            return b.literal(atom.val, atom.aval)
        return env[atom]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = _constant(b, c, v.aval)
    if len(inputs) != len(jaxpr.invars):
        raise ValueError(f"jaxpr takes {len(jaxpr.invars)} inputs, got {len(inputs)}")
    for v, r in zip(jaxpr.invars, inputs):
        env[v] = r
    for eqn in jaxpr.eqns:
        outs, token = load_eqn(eqn, [read(a) for a in eqn.invars], b, token)
        for v, r in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = r
    return [read(a) for a in jaxpr.outvars], token


def _constant(b: Builder, value: Any, aval: Any) -> Any:
    arr = np.asarray(value)
    if arr.shape == () and not getattr(aval, "weak_type", False) and arr.dtype != object:
        return b.literal(arr, aval)
    return b.const(arr, aval)


def load_eqn(eqn: core.JaxprEqn, args: list[Any], b: Builder, token: Any) -> tuple[list[Any], Any]:
    prim = eqn.primitive
    name = prim.name
    source = Origin(eqn.source_info, eqn.ctx)
    out_avals = [v.aval for v in eqn.outvars]

    if side_effects(eqn.effects):
        if token is None:
            raise Unsupported(f"effectful '{name}' where no effect token is threaded")
        pid = PARAMS.intern_params(prim, eqn.params)
        EFFECTS.setdefault(pid, eqn.effects)
        tup = b.term("Effect", [token, b.tlist(args), pid], TYPES.intern_tuple(tuple(out_avals) + (TOKEN_AVAL,)), source)
        outs = [b.term("Proj", [tup, i], TYPES.intern_aval(a), source) for i, a in enumerate(out_avals)]
        new_token = b.term("Proj", [tup, len(out_avals)], TYPES.intern_aval(TOKEN_AVAL), source)
        return outs, new_token

    if name == "jit" and _transparent_jit(eqn.params):
        outs, _ = load_closed(eqn.params["jaxpr"], args, b)
        return outs, token

    loader = _NESTED.get(name)
    spec = _terms.BY_PRIM.get(name)
    if loader is not None:
        try:
            return loader(eqn, args, b, source), token
        except Unsupported:
            spec = None  # kept whole, as an opaque node

    if spec is not None and _fits(spec, args):
        if name == "convert_element_type" and _is_literal_retype(eqn):
            lit = eqn.invars[0]
            return [b.literal(np.asarray(lit.val, dtype=out_avals[0].dtype), out_avals[0])], token
        pid = _intern(eqn)
        fixed = spec.layout.count("T")
        cargs: list[Any] = list(args[:fixed])
        if "L" in spec.layout:
            cargs.append(b.tlist(args[fixed:]))
        cargs.append(pid)
        if prim.multiple_results:
            return _project(b, b.term(spec.ctor, cargs, TYPES.intern_tuple(tuple(out_avals)), source), out_avals, source), token
        return [b.term(spec.ctor, cargs, TYPES.intern_aval(out_avals[0]), source)], token

    pid = _intern(eqn)
    if prim.multiple_results:
        tup = b.term("Opaque", [b.tlist(args), pid], TYPES.intern_tuple(tuple(out_avals)), source)
        return _project(b, tup, out_avals, source), token
    return [b.term("Opaque", [b.tlist(args), pid], TYPES.intern_aval(out_avals[0]), source)], token


def side_effects(effects: Any) -> set[Any]:
    """The effects that order matters for. A ``NamedAxisEffect`` only records that a
    collective names a mesh axis (``psum`` inside ``shard_map``): such equations are pure."""
    return {e for e in effects if not isinstance(e, core.NamedAxisEffect)}


def _fits(spec: _terms.OpSpec, args: list[Any]) -> bool:
    fixed = spec.layout.count("T")
    return len(args) >= fixed if "L" in spec.layout else len(args) == fixed


def _is_literal_retype(eqn: core.JaxprEqn) -> bool:
    """``convert_element_type`` of a literal that only drops weak typing: fold it into the literal."""
    x = eqn.invars[0]
    out = eqn.outvars[0].aval
    return (isinstance(x, core.Literal) and x.aval.dtype == out.dtype and x.aval.shape == out.shape == ()
            and eqn.params.get("sharding") is None)


def _intern(eqn: core.JaxprEqn) -> int:
    pid = PARAMS.intern_params(eqn.primitive, eqn.params)
    if eqn.effects:
        EFFECTS.setdefault(pid, eqn.effects)  # axis-name effects, re-attached when emitted
    return pid


def _project(b: Builder, tup: Any, avals: Sequence[Any], source: Any) -> list[Any]:
    return [b.term("Proj", [tup, i], TYPES.intern_aval(a), source) for i, a in enumerate(avals)]


def _transparent_jit(params: dict[str, Any]) -> bool:
    """A nested ``jit`` that only groups equations: no shardings, layouts, donation or compiler options.

    Inlining it keeps the program's meaning and lets rules see through helpers
    such as ``jnp.where`` and ``jnp.clip``, which ``jax.numpy`` wraps in ``jit``.
    """
    from jax._src.sharding_impls import UnspecifiedValue

    return (all(isinstance(s, UnspecifiedValue) for s in params.get("in_shardings", ()))
            and all(isinstance(s, UnspecifiedValue) for s in params.get("out_shardings", ()))
            and all(l is None for l in params.get("in_layouts", ()))
            and all(l is None for l in params.get("out_layouts", ()))
            and not any(params.get("donated_invars", ()))
            and not params.get("compiler_options_kvs"))


# ---------------------------------------------------------------------- bodies
def _load_body(b: Builder, jaxpr: core.Jaxpr, consts: Sequence[Any], avals: Sequence[Any]) -> Any:
    scope = b.new_scope()
    params = [b.term("Param", [scope, i], TYPES.intern_aval(a)) for i, a in enumerate(avals)]
    outs, _ = load_jaxpr(jaxpr, consts, params, b)
    return b.body(scope, outs)


def _closed_body(b: Builder, closed: core.ClosedJaxpr) -> Any:
    return _load_body(b, closed.jaxpr, closed.consts, closed.in_avals)


def _nested(b: Builder, eqn: core.JaxprEqn, ctor: str, bodies: list[Any], args: list[Any], extra: dict[str, Any],
            source: Any) -> list[Any]:
    spec = _terms.BY_CTOR[ctor]
    params = {k: v for k, v in eqn.params.items() if k not in spec.body_params}
    params.update(extra)
    pid = PARAMS.intern_params(eqn.primitive, params)
    out_avals = [v.aval for v in eqn.outvars]
    tup = b.term(ctor, [*bodies, b.tlist(args), pid], TYPES.intern_tuple(tuple(out_avals)), source)
    return _project(b, tup, out_avals, source)


def _load_scan(eqn: core.JaxprEqn, args: list[Any], b: Builder, source: Any) -> list[Any]:
    body = _closed_body(b, eqn.params["jaxpr"])
    n = len(eqn.params["jaxpr"].in_avals)
    # The body's jaxpr takes its Params in this order. Rules that add a carry
    # append a Param and insert its index here, so the rest of the body stays
    # shared. Params named _rw_* are annotations the emitter drops.
    return _nested(b, eqn, "Scan", [body], args, {"_rw_order": tuple(range(n))}, source)


def _load_while(eqn: core.JaxprEqn, args: list[Any], b: Builder, source: Any) -> list[Any]:
    cond = _closed_body(b, eqn.params["cond_jaxpr"])
    body = _closed_body(b, eqn.params["body_jaxpr"])
    return _nested(b, eqn, "While", [cond, body], args, {}, source)


def _load_cond(eqn: core.JaxprEqn, args: list[Any], b: Builder, source: Any) -> list[Any]:
    branches = b.blist([_closed_body(b, br) for br in eqn.params["branches"]])
    return _nested(b, eqn, "Cond", [branches], args, {}, source)


def _load_jit(eqn: core.JaxprEqn, args: list[Any], b: Builder, source: Any) -> list[Any]:
    return _nested(b, eqn, "Jit", [_closed_body(b, eqn.params["jaxpr"])], args, {}, source)


def _load_shard_map(eqn: core.JaxprEqn, args: list[Any], b: Builder, source: Any) -> list[Any]:
    jaxpr = eqn.params["jaxpr"]
    if jaxpr.constvars:
        raise Unsupported("shard_map body with constants")
    body = _load_body(b, jaxpr, (), [v.aval for v in jaxpr.invars])
    return _nested(b, eqn, "ShardMap", [body], args, {}, source)


_NESTED = {
    "scan": _load_scan,
    "while": _load_while,
    "cond": _load_cond,
    "jit": _load_jit,
    "shard_map": _load_shard_map,
}
