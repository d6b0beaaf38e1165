"""Where two forwards of one loss meet: the values they share, marked so that their joint programs name one cotangent.

:func:`rewrite.grad.vjp.decided_jointly`'s two forwards of a loss (with and without a ``jointly`` ruleset's rules)
differ only where those rules acted (the LM head's loop over token blocks); what they read there (the hidden
states ``h``) both compute alike. JAX's joint program of each reads, below that place, the cotangent of what the
differing parts read. That cotangent is the same value in both (the derivative of the loss with respect to a value
both forwards compute is the same, whichever way the forward goes on from it), but each joint computes it by terms
of its own, so nothing of the two backwards below it would be one term in ``pipeline.run_together``'s e-graph.

Here those values are found (:func:`meeting`: the two forwards loaded, hash-consed, their loops' bodies shared:
a variable of one that loads as a term of the other is that value), marked before each joint program is traced
(``fmark``: an identity whose tangent goes through ``bmark``, linear and its own transpose, so the joint's
backward holds ``bmark`` of each marked value's whole cotangent) and the markers taken out after
(:func:`unmarked`: the joint program as JAX traces it unmarked, equation for equation, with the variable of each
cotangent named). ``run_together`` then unites each pair of cotangents, and the two backwards below them are one.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Sequence

from jax.interpreters import batching, mlir

from ..ir.intern import TYPES, content_hash
from ..ir.jaxapi import ad, core
from ..ir.primitives import is_float
from ..jaxpr.edit import read, substitute
from ..jaxpr.load import SharedBodies, literal_key, load_closed
from ..jaxpr.trace import same_program
from .vjp import joint_at

log = logging.getLogger("rewrite")

fmark_p = core.Primitive("rewrite_fmark")
bmark_p = core.Primitive("rewrite_bmark")


def _identity(x: Any, *, tag: int) -> Any:
    return x


def _batch(p: Any) -> Callable:
    return lambda args, dims, *, tag: (p.bind(args[0], tag=tag), dims[0])


for _p in (fmark_p, bmark_p):
    _p.def_impl(_identity)
    _p.def_abstract_eval(lambda x, *, tag: x)
    mlir.register_lowering(_p, mlir.lower_fun(_identity, multiple_results=False))
    batching.primitive_batchers[_p] = _batch(_p)


def _fmark_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, tag: int) -> tuple[Any, Any]:
    t = tangents[0]
    return primals[0], t if type(t) is ad.Zero else bmark_p.bind(t, tag=tag)


ad.primitive_jvps[fmark_p] = _fmark_jvp
ad.deflinear2(bmark_p, lambda ct, x, *, tag: [bmark_p.bind(ct, tag=tag)])


class _HashCons:
    """A builder that only hash-conses (``jaxpr.load.Builder``): each distinct term an int, as the e-graph's own
    memo would make it one class with no rule run."""

    def __init__(self) -> None:
        self.memo: dict[Any, int] = {}
        self.scopes = 0
        self.shared_bodies = SharedBodies()

    def _id(self, key: Any) -> int:
        return self.memo.setdefault(key, len(self.memo))

    def term(self, ctor: str, args: Sequence[Any], type_id: int, source: Any = None) -> int:
        return self._id(("term", ctor, tuple(args), type_id))

    def tlist(self, refs: Sequence[Any]) -> int:
        return self._id(("tlist", tuple(refs)))

    def body(self, scope: int, outs: Sequence[Any]) -> int:
        return self._id(("body", scope, tuple(outs)))

    def blist(self, bodies: Sequence[Any]) -> int:
        return self._id(("blist", tuple(bodies)))

    def literal(self, value: Any, aval: Any) -> int:
        return self._id(("literal", literal_key(value, aval)))

    def const(self, array: Any, aval: Any) -> int:
        return self._id(("const", content_hash(array), aval))

    def new_scope(self) -> int:
        self.scopes += 1
        return self.scopes


def meeting(first: core.ClosedJaxpr, second: core.ClosedJaxpr) -> tuple[list[Any], list[Any]]:
    """``(of_first, of_second)``: the values where the two programs part, each as a variable of either, in
    ``second``'s order; empty lists where they cannot be united (below) or loaded so (effects).

    The two are loaded hash-consed (:class:`_HashCons`, their loops' bodies shared; a ``custom_vjp_call`` by its
    primal body: its ``fwd``/``bwd`` are made again each time a program is emitted); each program's *own*
    equations are those with a result the other does not compute. The values are the float results of common
    equations that each program's own equations read. They are united only where both programs' own equations read
    the same terms, inputs included, and each of those terms is one variable in each program: then each program
    computes its outputs from those values by its own equations alone, one function of the same arguments (the
    rules' replacements hold for any values of their operands), whose derivative with respect to each value, the
    cotangent a marker names, is the same in both. (A value computed twice, as two variables, would have each
    its own share of the cotangent.) Where a replacement holds only for the values the common equations can give
    (a fact about a value: ``abs(x) -> x`` for ``x = relu(z)``), the two cotangents can differ, by a vector normal
    to those values: the common backward maps it to zero only together with the same program's own derivatives with
    respect to the inputs its own equations read, so ``run_together`` extracts each program from its own part
    alone (``pipeline._views_apart``)."""
    if first.in_avals != second.in_avals or first.jaxpr.effects or second.jaxpr.effects:
        return [], []
    try:
        return _met(first, second)
    except Exception as e:  # (a program the hash-consing load cannot read: nothing united, nothing lost)
        log.debug("meeting: %s: %s; the joints are not united", type(e).__name__, e)
        return [], []


def _met(first: core.ClosedJaxpr, second: core.ClosedJaxpr) -> tuple[list[Any], list[Any]]:
    hc = _HashCons()
    inputs = [hc.term("Param", [0, i], TYPES.intern_aval(a)) for i, a in enumerate(first.in_avals)]
    names: list[dict[Any, int]] = [{}, {}]
    for i, closed in enumerate((first, second)):
        if i:
            hc.shared_bodies.next_program()
        load_closed(_primal_calls(closed), inputs, hc, names=names[i])
    terms = [set(n.values()) for n in names]
    reads: list[list[int]] = []
    for closed, n, other in ((first, names[0], terms[1]), (second, names[1], terms[0])):
        read_terms: list[int] = []
        for e in closed.jaxpr.eqns:
            if all(isinstance(o, core.DropVar) or n.get(o) in other for o in e.outvars):
                continue
            for a in e.invars:
                if isinstance(a, core.Var) and n[a] in other and n[a] not in read_terms:
                    read_terms.append(n[a])
        reads.append(read_terms)
    if set(reads[0]) != set(reads[1]):
        return [], []
    single = [collections.Counter(n.values()) for n in names]
    if any(c[t] != 1 for c in single for t in reads[1]):
        return [], []
    var_of = [{t: v for v, t in n.items()} for n in names]
    ins = [set(c.jaxpr.invars) | set(c.jaxpr.constvars) for c in (first, second)]
    met = [t for t in reads[1] if var_of[1][t] not in ins[1] and var_of[0][t] not in ins[0]
           and is_float(var_of[1][t].aval)]
    return [var_of[0][t] for t in met], [var_of[1][t] for t in met]


#: the params of a ``custom_vjp_call`` made again each time a program is emitted (the primal is its body)
_REMADE = ("fwd_jaxpr_thunk", "bwd")


def _primal_calls(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """``closed`` with each top-level ``custom_vjp_call``'s remade params replaced by their names: for
    :func:`meeting`, which asks only whether two values are the same (its primal is its body's)."""
    if not any(e.primitive.name == "custom_vjp_call" for e in closed.jaxpr.eqns):
        return closed
    eqns = [e.replace(params={**e.params, **{k: k for k in _REMADE if k in e.params}})
            if e.primitive.name == "custom_vjp_call" else e for e in closed.jaxpr.eqns]
    return core.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)


def marked(closed: core.ClosedJaxpr, values: Sequence[Any]) -> core.ClosedJaxpr:
    """``closed`` with ``fmark`` (tagged by position in ``values``) on each of ``values`` where it is computed, its
    readers reading the mark."""
    tags = {v: i for i, v in enumerate(values)}
    env: dict[Any, Any] = {}
    eqns: list[Any] = []
    for e in closed.jaxpr.eqns:
        eqns.append(substitute(e, env))
        for o in e.outvars:
            if o in tags:
                w = core.Var(o.aval)
                eqns.append(core.new_jaxpr_eqn([o], [w], fmark_p, {"tag": tags[o]}, core.no_effects,
                                               e.source_info))
                env[o] = w
    jaxpr = closed.jaxpr.replace(eqns=eqns, outvars=[read(env, a) for a in closed.jaxpr.outvars])
    return core.ClosedJaxpr(jaxpr, closed.consts)


def unmarked(joint: core.ClosedJaxpr, n: int) -> tuple[core.ClosedJaxpr, list[Any]] | None:
    """``joint`` (traced from a :func:`marked` program) without its markers, and for each of the ``n`` tags the
    variable of its cotangent (``None`` where the joint holds none: the loss does not depend on it); ``None``
    where a marker is not one top-level equation per tag (then the joint is traced again unmarked)."""
    env: dict[Any, Any] = {}
    eqns: list[Any] = []
    cts: list[Any] = [None] * n
    for e in joint.jaxpr.eqns:
        if e.primitive is bmark_p or e.primitive is fmark_p:
            x = read(env, e.invars[0])
            env[e.outvars[0]] = x
            if e.primitive is bmark_p:
                tag = e.params["tag"]
                if cts[tag] is not None or not isinstance(x, core.Var):
                    return None
                cts[tag] = x
            continue
        if any(_holds_marks(j) for j in core.jaxprs_in_params(e.params)):
            return None
        eqns.append(substitute(e, env))
    jaxpr = joint.jaxpr.replace(eqns=eqns, outvars=[read(env, a) for a in joint.jaxpr.outvars])
    return core.ClosedJaxpr(jaxpr, joint.consts), cts


def _holds_marks(jaxpr: Any) -> bool:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return any(e.primitive is bmark_p or e.primitive is fmark_p
               or any(_holds_marks(j) for j in core.jaxprs_in_params(e.params)) for e in jaxpr.eqns)


def marked_joints(closed: core.ClosedJaxpr, plain: core.ClosedJaxpr, trace: Callable[[core.ClosedJaxpr], Any]
                  ) -> tuple[list[core.ClosedJaxpr], list[tuple[Any, Any]]]:
    """``([joint of closed, joint of plain], pairs)``: the two joint programs as ``trace`` makes them (``plain``'s
    first), each traced once with :func:`meeting`'s values marked and the markers taken out, and ``pairs``, the
    variables of the cotangents of each value met, ``(of closed's joint, of plain's)``, that both joints hold."""
    of_plain, of_closed = meeting(plain, closed)
    found_plain = found_closed = None
    if of_closed:
        try:
            found_plain = unmarked(trace(marked(plain, of_plain)), len(of_plain))
            found_closed = unmarked(trace(marked(closed, of_closed)), len(of_closed))
        except Exception as e:  # (a JAX whose autodiff the markers do not go through: an error unmarked raises below)
            log.debug("marked_joints: %s: %s; the joints traced again unmarked", type(e).__name__, e)
            found_plain = None
        if found_plain is None or found_closed is None:
            log.debug("marked_joints: the markers are not one top-level equation each; the joints traced unmarked")
    if found_plain is None or found_closed is None:  # nothing met, or the markers not taken: traced as they are
        plain_joint = trace(plain)
        return [trace(closed), plain_joint], []
    pairs = [(a, b) for a, b in zip(found_closed[1], found_plain[1]) if a is not None and b is not None]
    return [found_closed[0], found_plain[0]], pairs


def traces_anew(trace: Callable[[core.ClosedJaxpr], Any], closed: core.ClosedJaxpr) -> bool:
    """Whether ``trace`` traces ``closed``'s joint program anew: not where it is :func:`rewrite.grad.vjp.joint_at`
    holding that program's joint traced already (the loss as written's, ``written``), which a marked program
    would not reuse."""
    written = trace.keywords.get("written") if getattr(trace, "func", None) is joint_at else None
    return written is None or not (closed is written[0] or same_program(closed, written[0]))
