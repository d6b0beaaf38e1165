"""Emit: turn the chosen nodes back into a ``ClosedJaxpr``.

Each scope (the program, and every loaded body) is emitted on its own:
post-order from its outputs, one equation per chosen operation node, in an
order that respects data and the effect token. A body becomes the
``ClosedJaxpr`` its primitive's params expect, with its inputs in the order
the node records. Avals come from the e-graph's per-class types, params from
the params table, and source locations from the equation that first made
each class, so profiles and errors still point at the user's code.

JAX's own dead-code elimination then removes loop outputs that nothing reads
(a scan's stacked output that a rewrite made redundant, say).

One annotation changes what is emitted: a scan whose params carry
``_rw_remat`` (set by the rule that built the loop) gets its body wrapped in
``jax.checkpoint`` (:func:`checkpointed`), which decides what ``jax.grad`` of
the emitted program stores per step. Other ``_rw_*`` params are dropped.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import numpy as np
from jax.extend import source_info_util

from ..ir import primitives as _primitives
from ..ir.egraph import Snapshot
from ..ir.intern import EFFECTS, PARAMS, TYPES, TupleType, literal_value
from ..ir.jaxapi import BUILT_DEBUG, constant_array, core, held_as_is, literals, primitives, save_only_these_names
from ..ir.walk import CycleError, operands, postorder
from .dce import dce
from .load import side_effects


class EmitError(RuntimeError):
    pass


_TOKEN = object()  # the effect token is an ordering edge only; jaxprs thread effects themselves


class _Scope:
    def __init__(self, em: "Emitter", scope: int, params: dict[int, core.Var]) -> None:
        self.em = em
        self.scope = scope
        self.params = params
        self.env: dict[Any, Any] = {}
        self.eqns: list[core.JaxprEqn] = []
        self.constvars: list[core.Var] = []
        self.consts: list[Any] = []
        self.effects: set[Any] = set()
        self._const_index: dict[int, core.Var] = {}

    def atoms(self, roots: Sequence[Any]) -> list[Any]:
        self._emit_all(roots)
        return [self.env[r] for r in roots]

    def _emit_all(self, roots: Sequence[Any]) -> None:
        choice, snap = self.em.choice, self.em.snap
        try:
            for cls in postorder(roots, lambda c: operands(snap, choice[c]), done=self.env):
                self.env[cls] = self._emit(cls, *choice[cls])
        except CycleError as e:
            raise EmitError(str(e)) from None

    def _emit(self, cls: Any, ctor: str, args: tuple) -> Any:
        em = self.em
        snap = em.snap
        if ctor == "Param":
            scope, index = args
            if scope != self.scope or index not in self.params:
                raise EmitError(f"input {index} of scope {scope} used in scope {self.scope}")
            return self.params[index]
        if ctor == "Lit":
            lit_id, type_id = args
            aval = TYPES[type_id]
            # TypedNdArray, as JAX's own tracer makes literals: it keeps the exact dtype and weak type.
            value = literals.TypedNdArray(np.asarray(literal_value(lit_id, aval.dtype), dtype=aval.dtype), aval)
            return core.Literal(value, aval)
        if ctor == "Const":
            (h,) = args
            var = self._const_index.get(h)
            if var is None:
                var = self._const_index[h] = core.Var(snap.aval(cls))
                self.constvars.append(var)
                self.consts.append(const_array(em.egraph, h))
            return var
        if ctor == "Tok":
            return _TOKEN
        if ctor == "Proj":
            tup, index = args
            return self.env[tup][index]
        pid = args[-1]
        prim = PARAMS.prim(pid)
        params = dict(PARAMS.params(pid))
        source, ctx = em.origin(cls)
        out_t = snap.aval(cls)
        out_avals = list(out_t) if isinstance(out_t, TupleType) else [out_t]
        effects: Any = EFFECTS.get(pid, core.no_effects)
        if ctor == "Effect":
            invars = [self.env[a] for a in snap.list_items(args[1])]
            out_avals = out_avals[:-1]
        else:
            spec = _primitives.BY_CTOR.get(ctor, _primitives.DEFAULT)
            invars = [self.env[a] for a in operands(snap, (ctor, args))]
            if spec.emit is not None:  # a primitive with bodies: its hook rebuilds them from their classes
                params = spec.emit(em, params, self._bodies(spec, args), len(out_avals), len(invars))
                effects = _nested_effects(spec, params)
        # Keys starting with _rw_ are annotations that rules keep on nodes; JAX never sees them.
        params = {k: v for k, v in params.items() if not k.startswith("_rw_")}
        outvars = [core.Var(a) for a in out_avals]
        self.effects |= set(effects)
        self.eqns.append(core.new_jaxpr_eqn(invars, outvars, prim, params, effects, source, ctx))
        if ctor == "Effect":
            return outvars + [_TOKEN]
        if isinstance(out_t, TupleType):
            return outvars
        return outvars[0]

    def _bodies(self, spec: _primitives.OpSpec, args: tuple) -> list[Any]:
        """The body arguments of a nested node, one per ``B`` (a class) or ``N`` (a list of classes)."""
        list_items = self.em.snap.list_items
        return [a if letter == "B" else list_items(a) for letter, a in zip(spec.layout, args) if letter in "BN"]


_ARRAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # an e-graph -> {a constant's hash: JAX array}


def const_array(egraph: Any, h: int) -> Any:
    """The e-graph's constant ``h`` (kept as a NumPy array) as the JAX array an emitted program holds, made once
    per e-graph. ``jax.jit`` makes each of its arguments one; a program whose ``jit`` the rewrite inlined runs its
    ``custom_vjp`` eagerly under ``jax.grad``, handing the backward any constant it forwards as a residual, and a
    NumPy one there cannot be indexed by a traced index (``jax.experimental.ode``'s backward:
    ``TracerArrayConversionError``, JAX's ``ode_test``'s ``test_grad_closure`` routed through the rewriter). A value
    JAX cannot hold as an array stays as it is, and so do an array laid out on a mesh and a PRNG key
    (``jaxapi.held_as_is``): the program holds the very object it closed over, as ``jax.jit``'s program does, on its
    devices, and the disk cache stores it as the original's constant (``cache/serialise.py``: arrays by identity)."""
    arrays = _ARRAYS.setdefault(egraph, {})
    found = arrays.get(h)
    if found is None:
        try:
            found = egraph.consts[h] if held_as_is(egraph.consts[h]) else constant_array(egraph.consts[h])
        except (TypeError, ValueError):
            found = egraph.consts[h]
        arrays[h] = found
    return found


class Emitter:
    def __init__(self, snap: Snapshot, choice: dict[Any, tuple], egraph: Any) -> None:
        self.snap = snap
        self.choice = choice
        self.egraph = egraph
        self.consts = egraph.consts

    def origin(self, cls: Any) -> tuple[Any, Any]:
        origin = self.egraph.vsource[self.snap.name(cls)]
        if origin is None:
            return source_info_util.new_source_info(), None
        return origin.source_info, origin.ctx

    def param_aval(self, scope: int, index: int) -> Any:
        cls = self.egraph.lookup("Param", [self.egraph.int_value(scope), self.egraph.int_value(index)])
        if cls is None:
            raise EmitError(f"scope {scope} has no input {index}")
        return self.snap.aval(cls)

    @staticmethod
    def checkpointed(body: core.ClosedJaxpr, num_carry: int, num_consts: int, what: str) -> core.ClosedJaxpr:
        return checkpointed(body, num_carry, num_consts, what)

    def body(self, body_cls: Any, order: Sequence[int], *, closed: bool) -> Any:
        ctor, (scope, outs) = self.choice[body_cls]
        params = {i: core.Var(self.param_aval(scope, i)) for i in order}
        sc = _Scope(self, scope, params)
        outvars = sc.atoms(self.snap.list_items(outs))
        if any(o is _TOKEN for o in outvars):
            raise EmitError("a body cannot return an effect token")
        if side_effects(sc.effects):
            raise EmitError("a loaded body acquired side effects")
        effects = core.join_effects(*(e.effects for e in sc.eqns)) if sc.eqns else core.no_effects
        invars = [params[i] for i in order]
        if not closed:
            if sc.constvars:
                raise EmitError("a shard_map body cannot hold constants")
            return core.new_jaxpr([], invars, outvars, sc.eqns, effects, BUILT_DEBUG)
        jaxpr = core.new_jaxpr(sc.constvars, invars, outvars, sc.eqns, effects, BUILT_DEBUG)
        return core.ClosedJaxpr(jaxpr, sc.consts)

    def program(self, in_avals: Sequence[Any], outs: Sequence[Any], token: Any, debug_info: Any) -> core.ClosedJaxpr:
        invars = {i: core.Var(a) for i, a in enumerate(in_avals)}
        sc = _Scope(self, 0, invars)
        roots = list(outs) + ([token] if token is not None else [])
        atoms = sc.atoms(roots)
        outvars = atoms[: len(outs)]
        jaxpr = core.new_jaxpr(sc.constvars, [invars[i] for i in range(len(in_avals))], outvars, sc.eqns,
                               core.join_effects(*(e.effects for e in sc.eqns)) if sc.eqns else core.no_effects,
                               debug_info or BUILT_DEBUG)
        return core.ClosedJaxpr(jaxpr, sc.consts)


def _nested_effects(spec: _primitives.OpSpec, params: dict) -> Any:
    """A nested equation's effects: its bodies', less the axes it binds itself (a shard_map's manual axes)."""
    effects = set()
    for k in spec.body_params:
        for b in params[k] if isinstance(params[k], (tuple, list)) else (params[k],):
            effects |= set(b.effects)
    bound = params.get("newly_manual_axes", frozenset())
    return {e for e in effects if not (isinstance(e, core.NamedAxisEffect) and e.name in bound)}


#: What a loop body built by a rule may ask autodiff to keep (``_rw_remat`` on a scan's params).
REMAT_POLICIES = ("carries", "nothing")
_CARRY_NAME = "_rw_carry"


def checkpointed(body: core.ClosedJaxpr, num_carry: int, num_consts: int, what: str) -> core.ClosedJaxpr:
    """``body`` (a scan body) wrapped in ``jax.checkpoint``.

    A rule that builds a loop knows which of its per-step values are cheap to
    recompute; ``jax.grad`` of the emitted program would otherwise stack every
    residual of every step. ``"carries"`` saves each step's new carry (or
    the operand of the one-operand operation that makes it, see
    :func:`_name_carries`) and recomputes the rest from it; ``"nothing"`` saves only the body's inputs.
    Without differentiation the checkpoint lowers to the body itself.
    """
    import jax

    if what not in REMAT_POLICIES:
        raise EmitError(f"unknown remat policy {what!r}; expected one of {REMAT_POLICIES}")
    if what == "carries":
        body = core.ClosedJaxpr(_name_carries(body.jaxpr, num_carry), body.consts)
        policy = save_only_these_names(_CARRY_NAME)
    else:
        policy = None
    return jax.make_jaxpr(jax.checkpoint(core.jaxpr_as_fun(body), prevent_cse=False, policy=policy))(
        *body.in_avals)


def _name_carries(jaxpr: core.Jaxpr, num_carry: int) -> core.Jaxpr:
    """Name what the backward program keeps of each new carry, and make every later use read the named value.

    A checkpoint policy saves named values only; naming the outputs alone
    would leave the uses inside the body (the ones autodiff needs) unnamed.
    A carry made by a one-operand elementwise operation of the same type
    (``h = tanh(h @ W + x @ U)``) has that operand named instead: the
    operation's derivative reads its own output (``1 - tanh**2``), which a
    name on the carry does not save, so autodiff would recompute the whole
    step (both products) to get it; from the saved operand it recomputes only
    the operation. The bytes saved are the same.
    """
    targets = {v for v in jaxpr.outvars[:num_carry] if isinstance(v, core.Var)} - set(jaxpr.invars)
    inputs = set(jaxpr.invars)
    named = set(targets)
    for e in jaxpr.eqns:
        (o, *more) = e.outvars
        if more or o not in targets or len(e.invars) != 1:
            continue
        spec = _primitives.BY_PRIM.get(e.primitive.name)
        (x,) = e.invars
        if (spec is not None and spec.family in (_primitives.ELEMENTWISE, _primitives.TRANSCENDENTAL)
                and isinstance(x, core.Var) and x.aval.shape == o.aval.shape and x.aval.dtype == o.aval.dtype):
            named.discard(o)
            if x not in inputs:  # a body input is saved as one anyway
                named.add(x)
    sub: dict[core.Var, core.Var] = {}

    def read(a: Any) -> Any:
        return sub.get(a, a) if isinstance(a, core.Var) else a

    eqns = []
    for e in jaxpr.eqns:
        eqns.append(e.replace(invars=[read(a) for a in e.invars]))
        for o in e.outvars:
            if o in named and o not in sub:
                sub[o] = core.Var(o.aval)
                eqns.append(core.new_jaxpr_eqn([o], [sub[o]], primitives.name_p, {"name": _CARRY_NAME}, core.no_effects,
                                               e.source_info))
    return jaxpr.replace(eqns=eqns, outvars=[read(a) for a in jaxpr.outvars])


def emit_slice(snap: Snapshot, choice: dict[Any, tuple], egraph: Any, inputs: Sequence[Any],
               roots: Sequence[Any]) -> core.ClosedJaxpr:
    """The chosen nodes that compute ``roots`` from the classes ``inputs``, as a closed jaxpr."""
    em = Emitter(snap, choice, egraph)
    sc = _Scope(em, -1, {})
    invars = [core.Var(snap.aval(c)) for c in inputs]
    for c, v in zip(inputs, invars):
        sc.env.setdefault(c, v)
    outvars = sc.atoms(list(roots))
    if sc.effects or any(o is _TOKEN for o in outvars):
        raise EmitError("a slice of the program cannot carry effects")
    jaxpr = core.new_jaxpr(sc.constvars, invars, outvars, sc.eqns, core.no_effects, BUILT_DEBUG)
    return core.ClosedJaxpr(jaxpr, sc.consts)


def emit(snap: Snapshot, choice: dict[Any, tuple], egraph: Any, in_avals: Sequence[Any], outs: Sequence[Any],
         token: Any, debug_info: Any) -> core.ClosedJaxpr:
    return dce(Emitter(snap, choice, egraph).program(in_avals, outs, token, debug_info))


def emitter(snap: Snapshot, egraph: Any, in_avals: Sequence[Any], outs: Sequence[Any], token: Any,
            debug_info: Any) -> Callable[[dict], core.ClosedJaxpr]:
    """:func:`emit` of one e-graph's choices for these outputs, each choice (by identity) emitted at most once."""
    emitted: dict[int, tuple[dict, core.ClosedJaxpr]] = {}  # the choice kept beside its program: its id stays its

    def emit_choice(choice: dict) -> core.ClosedJaxpr:
        if id(choice) not in emitted:
            emitted[id(choice)] = (choice, emit(snap, choice, egraph, in_avals, outs, token, debug_info))
        return emitted[id(choice)][1]

    return emit_choice


def _out_type(aval: Any) -> Any:
    return (aval.shape, aval.dtype, aval.weak_type) if hasattr(aval, "shape") else aval  # (a token: itself)


def check_signature(before: core.ClosedJaxpr, after: core.ClosedJaxpr) -> None:
    if list(before.in_avals) != list(after.in_avals):
        raise RuntimeError(f"rewritten program takes {after.in_avals}, not {before.in_avals}")
    if [_out_type(x) for x in after.out_avals] != [_out_type(x) for x in before.out_avals]:
        raise RuntimeError(f"rewritten program returns {after.out_avals}, not {before.out_avals}")


def jitted_program(closed: core.ClosedJaxpr, like: Any) -> Callable[..., Any]:
    """``closed`` compiled by ``jax.jit``, as a function of its inputs named as ``like`` (the user's function):
    ``jax.jit`` names the program it compiles after its function (the HLO module, XLA's dumps, the profiler's
    traces), so the rewritten program of ``rewrite(jax.jit(train_step))`` shows as ``jit_train_step`` there, as the
    program it replaces does, not as ``jit_jaxpr_as_fun``. The constants it holds as they are (a PRNG key, a
    sharded array: ``jaxapi.held_as_is``) are passed to the jit as arguments, as ``jax.jit`` passes the arrays a
    function closes over: JAX's key-reuse checker (``jax_debug_key_reuse``) follows a key through a jit's arguments
    only, and a key a nested jit's program closes over raised ``KeyReuseError`` (``sink 0 out of range``; JAX's own
    nested jits do so too)."""
    import jax

    jaxpr, consts = closed.jaxpr, list(closed.consts)
    held = [i for i, c in enumerate(consts) if held_as_is(c)]
    lead = [consts[i] for i in held]
    if held:
        jaxpr = jaxpr.replace(constvars=[v for i, v in enumerate(jaxpr.constvars) if i not in held],
                              invars=[jaxpr.constvars[i] for i in held] + list(jaxpr.invars))
        consts = [c for i, c in enumerate(consts) if i not in held]
    run = core.jaxpr_as_fun(core.ClosedJaxpr(jaxpr, consts))

    def program(*args: Any) -> Any:
        return run(*args)

    program.__name__ = program.__qualname__ = getattr(like, "__name__", "program")
    jitted = jax.jit(program)
    return (lambda *args: jitted(*lead, *args)) if lead else jitted
