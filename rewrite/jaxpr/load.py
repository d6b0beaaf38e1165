"""Load: every equation of a jaxpr becomes an e-node.

The walk is the textbook jaxpr interpreter (an environment, ``read``, a loop
over equations) with the table of primitives (``rewrite/ir/primitives.py``). A
primitive becomes its record's constructor; a record's ``load`` hook builds
nodes with bodies (scan, while, cond, jit, shard_map: each body loaded in a
scope of its own, through :class:`_Loading`); a primitive without a record
gets the default one, an ``Opaque`` node with its params kept whole, so an
unknown primitive is never an error. Equations with effects are threaded on
a token so that nothing can drop, duplicate or reorder them.

The loader talks to a *builder*. The same walk therefore inserts a program
(:class:`rewrite.ir.egraph.EGraph`), compiles a rule's left-hand side into an
egglog query (:mod:`rewrite.rules.pattern`), and checks that a traced term is
present in the e-graph (:class:`rewrite.rules.pattern.Verifier`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence

import numpy as np

from ..ir import primitives as _primitives
from ..ir.intern import EFFECTS, LITERALS, PARAMS, TYPES, content_hash, in_dtype, types_agree
from ..ir.jaxapi import AbstractRef, core, held_as_is, missing_param
from ..ir.primitives import Unsupported  # noqa: F401  (raised by builders and load hooks)

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


def load_closed(closed: core.ClosedJaxpr, inputs: Sequence[Any], b: Builder, token: Any = None, *,
                remember: bool = False, names: dict | None = None) -> tuple[list[Any], Any]:
    return load_jaxpr(closed.jaxpr, closed.consts, inputs, b, token, remember=remember, names=names)


def load_jaxpr(jaxpr: core.Jaxpr, consts: Sequence[Any], inputs: Sequence[Any], b: Builder,
               token: Any = None, *, remember: bool = False, names: dict | None = None) -> tuple[list[Any], Any]:
    """Load ``jaxpr`` with its inputs bound to ``inputs``. Returns output refs and the final token.

    ``remember``: the jaxpr is loaded again and again (a rule's traced side),
    so what each plain equation becomes is kept (:data:`_PLAIN`). ``names``, where given, receives what each of
    ``jaxpr``'s variables was loaded as.
    """
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
        args = [read(a) for a in eqn.invars]
        plain = _PLAIN.get(id(eqn)) if remember else None
        if plain is not None and plain[0] is eqn and _still_interned(plain[1]):
            outs = _load_plain(plain[1], args, b)
        else:
            outs, token = load_eqn(eqn, args, b, token, remember=remember)
        for v, r in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = r
    if names is not None:
        names.update(env)
    return [read(a) for a in jaxpr.outvars], token


def _constant(b: Builder, value: Any, aval: Any) -> Any:
    if held_as_is(value):  # a sharded array, a PRNG key (``jax.random.key`` at a module's top): the very object
        return b.const(value, aval)
    arr = np.asarray(value)
    if arr.shape == () and not getattr(aval, "weak_type", False) and arr.dtype != object:
        return b.literal(arr, aval)
    return b.const(arr, aval)


#: id of an equation of a rule's traced side -> (the equation, what it loads as: see _load_plain). The
#: equation is kept so its id stays its own; a few thousand are enough for every rule's sides.
_PLAIN: dict[int, tuple[core.JaxprEqn, tuple]] = {}
_PLAIN_SIZE = 16384


def _still_interned(plain: tuple) -> bool:
    """Whether a remembered equation's params and type ids are still in their tables, each restamped as used
    now (the tables drop what no live e-graph holds: rewrite/ir/intern.py); if not, it is loaded afresh."""
    _, _, _, pid, type_id, proj, _ = plain
    return (PARAMS.touch(pid) and TYPES.touch(type_id)
            and (proj is None or all(TYPES.touch(t) for t in proj)))


def _load_plain(plain: tuple, args: list[Any], b: Builder) -> list[Any]:
    """An equation without effects or a load hook, loaded as ``load_eqn`` would, from its remembered parts."""
    ctor, fixed, listed, pid, type_id, proj, source = plain
    cargs: list[Any] = list(args[:fixed])
    if listed:
        cargs.append(b.tlist(args[fixed:]))
    cargs.append(pid)
    node = b.term(ctor, cargs, type_id, source)
    if _twin_of_another_type(b, node, type_id):
        cargs[-1] = PARAMS.intern_params(PARAMS.prim(pid), {**PARAMS.params(pid), "_rw_type": TYPES[type_id]})
        node = b.term(ctor, cargs, type_id, source)
    if proj is not None:
        return [b.term("Proj", [node, i], t, source) for i, t in enumerate(proj)]
    return [node]


def _twin_of_another_type(b: Builder, node: Any, type_id: int) -> bool:
    """Is ``node`` one the e-graph already held, for the same operands and params, at a type JAX tells apart from
    ``type_id``? An equation whose result takes its type from the mesh it was traced under, not from its operands
    (``iota``; a literal broadcast), makes two types from the same params and operands under an explicit mesh and
    inside a ``jit`` traced under ``Auto`` axes. Held as one node of the first one's type, the emitted program fed
    the explicit one to an equation under the other mesh ("context mesh ... should match the aval mesh":
    ``jax.random.multivariate_normal(..., out_sharding=s)`` under ``jax.set_mesh``, JAX's
    ``RandomOutShardingTest`` routed through the rewriter). The second is then loaded with its type among its
    params (``_rw_type``, which the emitter drops), a node of its own."""
    vtype = getattr(b, "vtype", None)  # (an e-graph; a recorder of bodies holds no types)
    if vtype is None or not isinstance(node, int) or node >= len(vtype) or vtype[node] == type_id:
        return False
    return not types_agree(TYPES[vtype[node]], TYPES[type_id])


def load_eqn(eqn: core.JaxprEqn, args: list[Any], b: Builder, token: Any, *,
             remember: bool = False) -> tuple[list[Any], Any]:
    prim = eqn.primitive
    name = prim.name
    source = Origin(eqn.source_info, eqn.ctx)
    out_avals = [v.aval for v in eqn.outvars]
    if any(type(a) is AbstractRef for a in out_avals):  # (new_ref; the pipeline declines one passed in, too)
        raise Unsupported("the program makes mutable arrays (jax.new_ref), which the rewriter leaves as they are")

    if eqn.effects and side_effects(eqn.effects):  # (most equations have no effects at all)
        if token is None:
            raise Unsupported(f"effectful '{name}' where no effect token is threaded")
        pid = PARAMS.intern_params(prim, eqn.params)
        EFFECTS.setdefault(pid, eqn.effects)
        tup = b.term("Effect", [token, b.tlist(args), pid], TYPES.intern_tuple(tuple(out_avals) + (TOKEN_AVAL,)), source)
        outs = [b.term("Proj", [tup, i], TYPES.intern_aval(a), source) for i, a in enumerate(out_avals)]
        new_token = b.term("Proj", [tup, len(out_avals)], TYPES.intern_aval(TOKEN_AVAL), source)
        return outs, new_token

    spec = own = _primitives.spec_of(name)
    if spec.load is not None:
        try:
            outs = spec.load(_Loading(eqn, args, b, source))
        except Unsupported:
            spec = _primitives.DEFAULT  # kept whole, as an opaque node
        except KeyError as e:  # a param the hook reads is not there: a JAX whose equations differ
            raise missing_param(name, eqn.params, e) from e
        else:
            if outs is not None:
                return outs, token
    if spec.family == _primitives.NESTED or not _fits(spec, args):
        spec = _primitives.DEFAULT
    pid = _intern(eqn)
    multiple = prim.multiple_results
    plain = (spec.ctor, spec.layout.count("T"), "L" in spec.layout, pid,
             TYPES.intern_tuple(tuple(out_avals)) if multiple else TYPES.intern_aval(out_avals[0]),
             tuple(TYPES.intern_aval(a) for a in out_avals) if multiple else None, source)
    if remember and own.load is None:  # what it loads as depends on the equation alone
        if len(_PLAIN) >= _PLAIN_SIZE:
            _PLAIN.clear()
        _PLAIN[id(eqn)] = (eqn, plain)
    return _load_plain(plain, args, b), token


def side_effects(effects: Any) -> set[Any]:
    """The effects that order matters for. A ``NamedAxisEffect`` only records that a
    collective names a mesh axis (``psum`` inside ``shard_map``): such equations are pure."""
    return {e for e in effects if not isinstance(e, core.NamedAxisEffect)}


def _fits(spec: _primitives.OpSpec, args: list[Any]) -> bool:
    fixed = spec.layout.count("T")
    return len(args) >= fixed if "L" in spec.layout else len(args) == fixed


def _intern(eqn: core.JaxprEqn) -> int:
    pid = PARAMS.intern_params(eqn.primitive, eqn.params)
    if eqn.effects:
        EFFECTS.setdefault(pid, eqn.effects)  # axis-name effects, re-attached when emitted
    return pid


def _project(b: Builder, tup: Any, avals: Sequence[Any], source: Any) -> list[Any]:
    return [b.term("Proj", [tup, i], TYPES.intern_aval(a), source) for i, a in enumerate(avals)]


# ---------------------------------------------------------------------- bodies
def _load_body(b: Builder, jaxpr: core.Jaxpr, consts: Sequence[Any], avals: Sequence[Any]) -> Any:
    share = getattr(b, "shared_bodies", None)
    if share is None:
        return _body_into(b, jaxpr, consts, avals)
    rec = _Recorder()
    return share.body(b, rec, _body_into(rec, jaxpr, consts, avals))


def _body_into(b: Builder, jaxpr: core.Jaxpr, consts: Sequence[Any], avals: Sequence[Any]) -> Any:
    scope = b.new_scope()
    params = [b.term("Param", [scope, i], TYPES.intern_aval(a)) for i, a in enumerate(avals)]
    outs, _ = load_jaxpr(jaxpr, consts, params, b)
    return b.body(scope, outs)


class SharedBodies:
    """Bodies shared between the programs one e-graph loads in turn (``pipeline.run_together``'s two joint
    programs): the ``k``-th body of a later program that is, term for term, the ``k``-th such body of the first is
    that body, not loaded again in a scope of its own, so that the two programs' loops (and all that reads them)
    are one. Two bodies are one only where the loader built them alike (:meth:`_Recorder.key`): the same
    constructors over the same operands, params (interned: a param compared only by identity, a ``custom_vjp``'s
    ``bwd``, say, is the same object), types, literals and constants. Within one program nothing is shared, and
    the first program is loaded exactly as alone (each body replayed as the loader made it); a later one is too,
    but for the bodies it takes from the first."""

    def __init__(self) -> None:
        self.first = True  # loading the first program: its bodies are kept, by key, in order
        self._bodies: dict[Any, list[Any]] = {}
        self._taken: dict[Any, int] = {}

    def next_program(self) -> None:
        self.first, self._taken = False, {}

    def body(self, b: Builder, rec: "_Recorder", ref: "_Ref") -> Any:
        key = rec.key(ref)
        if not self.first:
            kept, k = self._bodies.get(key, ()), self._taken.get(key, 0)
            if k < len(kept):
                self._taken[key] = k + 1
                return kept[k]
        made = rec.replay(b, ref)
        if self.first:
            self._bodies.setdefault(key, []).append(made)
        return made


def literal_key(value: Any, aval: Any) -> tuple:
    """What a literal ``value`` typed ``aval`` loads as: its literal id and type, of which ``EGraph.literal`` makes
    its ``Lit`` node, for any value JAX gives (a ``TypedInt`` too)."""
    return LITERALS.intern_value(in_dtype(value, aval.dtype)), aval


class _Ref(NamedTuple):
    """What a :class:`_Recorder` returns for a call: the index of the call."""
    k: int


class _Scope(NamedTuple):
    """A scope a :class:`_Recorder` made: the index of the ``new_scope`` call."""
    k: int


class _Recorder:
    """A builder that builds nothing: it records a body's loading, call by call, for :class:`SharedBodies` to key
    it and to replay it into the e-graph in the same order (so that a body replayed is the body loaded)."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []

    def _op(self, *op: Any) -> _Ref:
        self.ops.append(op)
        return _Ref(len(self.ops) - 1)

    def term(self, ctor: str, args: Sequence[Any], type_id: int, source: Any = None) -> _Ref:
        return self._op("term", ctor, tuple(args), type_id, source)

    def tlist(self, refs: Sequence[Any]) -> _Ref:
        return self._op("tlist", tuple(refs))

    def body(self, scope: Any, outs: Sequence[Any]) -> _Ref:
        return self._op("body", scope, tuple(outs))

    def blist(self, bodies: Sequence[Any]) -> _Ref:
        return self._op("blist", tuple(bodies))

    def literal(self, value: Any, aval: Any) -> _Ref:
        return self._op("literal", value, aval)

    def const(self, array: Any, aval: Any) -> _Ref:
        return self._op("const", array, aval)

    def new_scope(self) -> _Scope:
        self.ops.append(("scope",))
        return _Scope(len(self.ops) - 1)

    def key(self, ref: _Ref) -> tuple:
        """What the body ``ref`` is, as a hashable value: every call with its arguments, the recorded ones by
        index, a literal as what it loads as, a constant by its content."""
        parts: list[Any] = [ref.k]
        for op in self.ops:
            kind = op[0]
            if kind == "term":
                parts.append((op[1], op[2], op[3]))  # (_Ref and _Scope are tuples of their own types: hashable)
            elif kind == "literal":
                parts.append(("literal", literal_key(op[1], op[2])))
            elif kind == "const":
                parts.append(("const", content_hash(op[1]), op[2]))
            else:
                parts.append(op)
        return tuple(parts)

    def replay(self, b: Builder, ref: _Ref) -> Any:
        """The recorded calls made on ``b``, in order: what loading the body into ``b`` returns."""
        got: list[Any] = []

        def v(a: Any) -> Any:
            return got[a.k] if type(a) is _Ref or type(a) is _Scope else a

        for op in self.ops:
            kind = op[0]
            if kind == "term":
                got.append(b.term(op[1], [v(a) for a in op[2]], op[3], op[4]))
            elif kind == "tlist":
                got.append(b.tlist([v(a) for a in op[1]]))
            elif kind == "body":
                got.append(b.body(v(op[1]), [v(a) for a in op[2]]))
            elif kind == "blist":
                got.append(b.blist([v(a) for a in op[1]]))
            elif kind == "literal":
                got.append(b.literal(op[1], op[2]))
            elif kind == "const":
                got.append(b.const(op[1], op[2]))
            else:
                got.append(b.new_scope())
        return got[ref.k]


def _closed_body(b: Builder, closed: core.ClosedJaxpr) -> Any:
    return _load_body(b, closed.jaxpr, closed.consts, closed.in_avals)


class _Loading:
    """What a record's ``load`` hook (``rewrite/ir/primitives.py``) works with: the equation, its operand
    refs, and the ways to load bodies and build the node."""

    def __init__(self, eqn: core.JaxprEqn, args: list[Any], b: Builder, source: Any) -> None:
        self.eqn, self.args, self.b, self.source = eqn, args, b, source

    def body(self, jaxpr: core.Jaxpr, consts: Sequence[Any], avals: Sequence[Any]) -> Any:
        """``jaxpr`` loaded as a body in a scope of its own, its inputs ``Param`` nodes of that scope."""
        return _load_body(self.b, jaxpr, consts, avals)

    def closed_body(self, closed: core.ClosedJaxpr) -> Any:
        return _closed_body(self.b, closed)

    def blist(self, bodies: Sequence[Any]) -> Any:
        return self.b.blist(bodies)

    def literal(self, value: Any, aval: Any) -> Any:
        return self.b.literal(value, aval)

    def inline(self, closed: core.ClosedJaxpr) -> list[Any]:
        """The outputs of ``closed`` loaded in place, its inputs bound to the operands (no node of its own)."""
        outs, _ = load_closed(closed, self.args, self.b)
        return outs

    def nested(self, bodies: list[Any], extra: dict[str, Any] | None = None, params: dict | None = None) -> list[Any]:
        """The node over ``bodies`` (in layout order) and the operands; its params (the equation's, or
        ``params``) lose the body params and gain ``extra``. Returns one projection per result."""
        eqn, b = self.eqn, self.b
        spec = _primitives.BY_PRIM[eqn.primitive.name]
        params = {k: v for k, v in (eqn.params if params is None else params).items() if k not in spec.body_params}
        params.update(extra or {})
        pid = PARAMS.intern_params(eqn.primitive, params)
        out_avals = [v.aval for v in eqn.outvars]
        tup = b.term(spec.ctor, [*bodies, b.tlist(self.args), pid], TYPES.intern_tuple(tuple(out_avals)), self.source)
        return _project(b, tup, out_avals, self.source)
