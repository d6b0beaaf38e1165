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

The second joint is then made from the first where it can be (:func:`spliced`): the plain joint with its own part,
forward and backward, replaced by the joint program of the other forward's own part traced alone. JAX's trace of
the whole second joint (flax_long_context_step: 615 equations, 55-65 ms) becomes a trace of some tens of equations
and an edit.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, NamedTuple, Sequence

from jax.interpreters import batching, mlir

from ..ir.intern import TYPES, content_hash
from ..ir.jaxapi import BUILT_DEBUG, ad, core
from ..ir.primitives import is_float
from ..jaxpr.edit import in_order, read, substitute
from ..jaxpr.load import SharedBodies, literal_key, load_closed
from ..jaxpr.trace import same_program
from . import vjp
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
    # the primal marked too, so that the joint names the value itself (``unmarked``'s ``primals``)
    t = tangents[0]
    return fmark_p.bind(primals[0], tag=tag), t if type(t) is ad.Zero else bmark_p.bind(t, tag=tag)


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
    found = parting(first, second)
    return ([], []) if found is None else (found.floats(0), found.floats(1))


class Parting(NamedTuple):
    """Where two programs part (:func:`parting`): for each, its own equations (positions) and the values they read
    that both compute (in ``second``'s order), program inputs included, as its variables; ``met`` the positions of
    those values :func:`meeting` names (floats, not inputs)."""

    own: tuple[list[int], list[int]]
    reads: tuple[list[Any], list[Any]]
    met: list[int]

    def floats(self, i: int) -> list[Any]:
        return [self.reads[i][k] for k in self.met]


def parting(first: core.ClosedJaxpr, second: core.ClosedJaxpr) -> Parting | None:
    """:func:`meeting`'s finding in full, or ``None`` where it names no value."""
    if first.in_avals != second.in_avals or first.jaxpr.effects or second.jaxpr.effects:
        return None
    try:
        found = _met(first, second)
    except Exception as e:  # (a program the hash-consing load cannot read: nothing united, nothing lost)
        log.debug("meeting: %s: %s; the joints are not united", type(e).__name__, e)
        return None
    return found if found is not None and found.met else None


def _met(first: core.ClosedJaxpr, second: core.ClosedJaxpr) -> Parting | None:
    hc = _HashCons()
    inputs = [hc.term("Param", [0, i], TYPES.intern_aval(a)) for i, a in enumerate(first.in_avals)]
    names: list[dict[Any, int]] = [{}, {}]
    for i, closed in enumerate((first, second)):
        if i:
            hc.shared_bodies.next_program()
        load_closed(_primal_calls(closed), inputs, hc, names=names[i])
    terms = [set(n.values()) for n in names]
    reads: list[list[int]] = []
    own: list[list[int]] = []
    for closed, n, other in ((first, names[0], terms[1]), (second, names[1], terms[0])):
        read_terms: list[int] = []
        own.append([])
        for k, e in enumerate(closed.jaxpr.eqns):
            if all(isinstance(o, core.DropVar) or n.get(o) in other for o in e.outvars):
                continue
            own[-1].append(k)
            for a in e.invars:
                if isinstance(a, core.Var) and n[a] in other and n[a] not in read_terms:
                    read_terms.append(n[a])
        reads.append(read_terms)
    if set(reads[0]) != set(reads[1]):
        return None
    single = [collections.Counter(n.values()) for n in names]
    if any(c[t] != 1 for c in single for t in reads[1]):
        return None
    var_of = [{t: v for v, t in n.items()} for n in names]
    ins = [set(c.jaxpr.invars) | set(c.jaxpr.constvars) for c in (first, second)]
    met = [k for k, t in enumerate(reads[1]) if var_of[1][t] not in ins[1] and var_of[0][t] not in ins[0]
           and is_float(var_of[1][t].aval)]
    return Parting((own[0], own[1]), ([var_of[0][t] for t in reads[1]], [var_of[1][t] for t in reads[1]]), met)


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


def unmarked(joint: core.ClosedJaxpr, n: int, primals: list | None = None
             ) -> tuple[core.ClosedJaxpr, list[Any]] | None:
    """``joint`` (traced from a :func:`marked` program) without its markers, and for each of the ``n`` tags the
    variable of its cotangent (``None`` where the joint holds none: the loss does not depend on it); ``None``
    where a marker is not one top-level equation per tag (then the joint is traced again unmarked). ``primals``,
    where given, receives each tag's value as the joint's variable (``None`` where it is not one marker's)."""
    env: dict[Any, Any] = {}
    eqns: list[Any] = []
    cts: list[Any] = [None] * n
    prims: list[Any] = [None] * n
    twice: set[int] = set()
    for e in joint.jaxpr.eqns:
        if e.primitive is bmark_p or e.primitive is fmark_p:
            x = read(env, e.invars[0])
            env[e.outvars[0]] = x
            tag = e.params["tag"]
            if e.primitive is bmark_p:
                if cts[tag] is not None or not isinstance(x, core.Var):
                    return None
                cts[tag] = x
            elif prims[tag] is not None or not isinstance(x, core.Var):
                twice.add(tag)
            else:
                prims[tag] = x
            continue
        if any(_holds_marks(j) for j in core.jaxprs_in_params(e.params)):
            return None
        eqns.append(substitute(e, env))
    jaxpr = joint.jaxpr.replace(eqns=eqns, outvars=[read(env, a) for a in joint.jaxpr.outvars])
    if primals is not None:
        primals[:] = [None if k in twice else v for k, v in enumerate(prims)]
    return core.ClosedJaxpr(jaxpr, joint.consts), cts


def _holds_marks(jaxpr: Any) -> bool:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return any(e.primitive is bmark_p or e.primitive is fmark_p
               or any(_holds_marks(j) for j in core.jaxprs_in_params(e.params)) for e in jaxpr.eqns)


def marked_joints(closed: core.ClosedJaxpr, plain: core.ClosedJaxpr, trace: Callable[[core.ClosedJaxpr], Any]
                  ) -> tuple[list[core.ClosedJaxpr], list[tuple[Any, Any]]]:
    """``([joint of closed, joint of plain], pairs)``: the two joint programs as ``trace`` makes them (``plain``'s
    first), each traced once with :func:`meeting`'s values marked and the markers taken out, and ``pairs``, the
    variables of the cotangents of each value met, ``(of closed's joint, of plain's)``, that both joints hold.

    ``closed``'s joint is made from ``plain``'s where it can be (:func:`spliced`): ``plain``'s with the equations
    of ``plain``'s own part, forward and backward, replaced by the joint program of ``closed``'s own part traced
    alone (the LM head's loop: some tens of equations, where the whole joint is some hundreds)."""
    found = parting(plain, closed)
    found_plain = found_closed = None
    if found is not None:
        values = _marked_values(found, plain, closed)
        try:
            primals: list = []
            found_plain = unmarked(trace(marked(plain, values[0])), len(values[0]), primals)
            made = None if found_plain is None else spliced(plain, closed, found, values, found_plain, primals, trace)
            found_closed = made if made is not None else unmarked(trace(marked(closed, values[1])), len(values[1]))
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


def _marked_values(found: Parting, plain: core.ClosedJaxpr, closed: core.ClosedJaxpr) -> tuple[list, list]:
    """The values each program's own part reads that both compute and that are not inputs, in one order (their
    tags): :func:`meeting`'s floats first, then the rest (labels, say: a splice reads them, no cotangent)."""
    ins = set(plain.jaxpr.invars) | set(plain.jaxpr.constvars)
    rest = [k for k, v in enumerate(found.reads[0]) if k not in found.met and v not in ins]
    order = list(found.met) + rest
    return [found.reads[0][k] for k in order], [found.reads[1][k] for k in order]


def spliced(plain: core.ClosedJaxpr, closed: core.ClosedJaxpr, found: Parting, values: tuple[list, list],
            plain_joint: tuple[core.ClosedJaxpr, list], primals: list, trace: Callable[[core.ClosedJaxpr], Any]
            ) -> tuple[core.ClosedJaxpr, list[Any]] | None:
    """``closed``'s joint program (``(joint, cotangent of each tag)``, as :func:`unmarked` gives it) made from
    ``plain``'s, ``plain_joint``, or ``None`` where it cannot be.

    The two programs compute their outputs from the same values by their own parts, ``R`` (:func:`parting`). Where
    every float value ``R`` reads, input or not, is read by ``R`` alone in both programs, ``plain``'s joint is its
    common part's forward and backward, ``R``'s, and the common backward reads from ``R``'s only the cotangents of
    the values ``R`` reads (the markers name them). ``closed``'s joint is then the same with ``closed``'s ``R`` in
    its place: its joint program traced alone (``joint_program``), reading the values and the cotangents of
    ``R``'s outputs where ``plain``'s read them, its cotangents of the values read where ``plain``'s were, its
    outputs and its inputs' gradients written where ``plain``'s were. Each is a function of the same values, so
    the program computes what ``closed``'s joint computes."""
    joint, cts = plain_joint
    n, n_out = len(plain.in_avals), len(plain.out_avals)
    dif_out = [k for k, a in enumerate(plain.out_avals) if is_float(a)]
    floats_in = [k for k, a in enumerate(plain.in_avals) if is_float(a)]
    wrt = getattr(trace, "keywords", {}).get("wrt") if getattr(trace, "func", None) is joint_at else None
    dif_in = floats_in if wrt is None else [k for k in floats_in if k in set(wrt)]
    if len(joint.jaxpr.invars) != n + len(dif_out) or len(joint.jaxpr.outvars) != n_out + len(dif_in):
        return _declined("the plain joint is not of the forward's inputs and outputs")
    parts = []
    for i, program in enumerate((plain, closed)):
        part = _own_part(program, found.own[i], values[i], found.reads[i])
        if part is None:
            return _declined("a value a program's own part reads or makes is read beside it, or is an output")
        parts.append(part)
    (_, p_outs, p_inputs), (r_closed, c_outs, c_inputs) = parts
    if p_outs != c_outs or p_inputs != c_inputs or any(p is None for p, _ in zip(primals, values[0])):
        return _declined("the two own parts read other inputs or write other outputs, or a value is not named")
    # R's joint at what the plain joint differentiates: the values whose cotangents it holds, the inputs at dif_in
    tagged = len(values[1])
    r_wrt = [k for k in range(tagged) if cts[k] is not None] + [tagged + i for i, j in enumerate(c_inputs)
                                                                  if j in dif_in]
    r_joint, r_dif_in, r_dif_out = vjp.joint_program(r_closed, r_wrt)  # (looked up here: what the tests count)
    # what R's joint reads, as the plain joint's variables: the values read (tags, then inputs), the cotangents
    reads = [primals[k] for k in range(tagged)] + [joint.jaxpr.invars[j] for j in c_inputs]
    reads += [joint.jaxpr.invars[n + dif_out.index(c_outs[k])] for k in r_dif_out]
    # R's own equations in the plain joint: those that read (through others) the float values R reads or the
    # cotangents of R's outputs, up to the cotangents of the values it reads, and that R's outputs, those
    # cotangents or its inputs' gradients read (not a residual of the common part computed from a value met: the
    # derivative of a tanh reads the tanh)
    stop = {v for v in cts if v is not None}
    seeds = {primals[k] for k in range(tagged) if is_float(values[0][k].aval)}
    seeds |= {joint.jaxpr.invars[j] for j in c_inputs if is_float(plain.in_avals[j])}
    seeds |= {joint.jaxpr.invars[n + dif_out.index(k)] for k in c_outs if k in dif_out}
    reached, reaching = set(seeds), []
    for k, e in enumerate(joint.jaxpr.eqns):
        if any(isinstance(a, core.Var) and a in reached for a in e.invars):
            reaching.append(k)
            reached.update(o for o in e.outvars if o not in stop)
    need = stop | {joint.jaxpr.outvars[k] for k in c_outs}
    need |= {joint.jaxpr.outvars[n_out + dif_in.index(j)] for j in c_inputs if j in dif_in}
    region = []
    for k in reversed(reaching):
        e = joint.jaxpr.eqns[k]
        if any(o in need for o in e.outvars):
            region.append(k)
            need.update(a for a in e.invars if isinstance(a, core.Var))
    region.reverse()
    made = {o for k in region for o in joint.jaxpr.eqns[k].outvars}
    inside = set(region)
    # where R's joint writes: R's outputs, its inputs' gradients, and the cotangents of the values it reads
    at = dict(zip(r_joint.jaxpr.invars, reads))
    constvars = list(joint.jaxpr.constvars)
    consts = list(joint.consts)
    for v, c in zip(r_joint.jaxpr.constvars, r_joint.consts):
        w = core.Var(v.aval)
        at[v], constvars, consts = w, constvars + [w], consts + [c]
    r_out = [read(at, o) for o in r_joint.jaxpr.outvars]
    written: dict[int, Any] = dict(zip(c_outs, r_out))
    env: dict[Any, Any] = {}
    new_cts = [None] * len(cts)
    for i, pos in enumerate(r_dif_in):
        g = r_out[len(c_outs) + i]
        if pos < tagged:
            env[cts[pos]] = g
            new_cts[pos] = g
        else:
            written[n_out + dif_in.index(c_inputs[pos - tagged])] = g
    outvars = list(joint.jaxpr.outvars)
    for k, o in enumerate(outvars):
        if (k in written) != (isinstance(o, core.Var) and o in made and o not in stop):
            return _declined("the plain joint's own part writes other outputs")
    outvars = [written[k] if k in written else read(env, o) for k, o in enumerate(outvars)]
    own_eqns = [substitute(e, at) for e in r_joint.jaxpr.eqns]
    first = region[0] if region else len(joint.jaxpr.eqns)  # (R's joint where R's equations began)
    common = [substitute(e, env) for k, e in enumerate(joint.jaxpr.eqns) if k not in inside]
    eqns = _live(in_order(common[:first] + own_eqns + common[first:]), outvars)
    gone = made - stop  # what only R's equations computed: nothing left may read it
    if any(isinstance(a, core.Var) and a in gone for e in eqns for a in e.invars) or any(
            isinstance(o, core.Var) and o in gone for o in outvars):
        return _declined("the plain joint's common part reads more of its own part than the cotangents")
    jaxpr = joint.jaxpr.replace(constvars=constvars, eqns=eqns, outvars=outvars)
    return core.ClosedJaxpr(jaxpr, consts), new_cts


def _own_part(program: core.ClosedJaxpr, own: list[int], values: list[Any], reads: list[Any]
              ) -> tuple[core.ClosedJaxpr, list[int], list[int]] | None:
    """``(R, outputs, inputs)``: ``program``'s own equations ``own`` as a program of ``values`` and then of the
    program inputs at ``inputs`` (those of ``reads``, all it reads that both programs compute: :func:`parting`),
    computing ``program``'s outputs at ``outputs``; ``None`` where a float it reads is read by another equation or
    is an output, or a value it makes is read by another equation."""
    jaxpr = program.jaxpr
    eqns = [jaxpr.eqns[k] for k in own]
    made = {o for e in eqns for o in e.outvars}
    invars = list(jaxpr.invars)
    consts = dict(zip(jaxpr.constvars, program.consts))
    inputs = sorted(invars.index(v) for v in reads if v in invars)
    constvars = [v for v in reads if v in consts]
    read_floats = {v for v in values if is_float(v.aval)} | {invars[j] for j in inputs if is_float(invars[j].aval)}
    mine = set(own)
    others = {a for k, e in enumerate(jaxpr.eqns) if k not in mine for a in e.invars if isinstance(a, core.Var)}
    if others & (read_floats | made):  # the floats R reads are read by R alone, and R's values too (or are outputs)
        return None
    if any(isinstance(o, core.Var) and o in read_floats for o in jaxpr.outvars):
        return None
    outputs = [k for k, o in enumerate(jaxpr.outvars) if isinstance(o, core.Var) and o in made]
    r = core.new_jaxpr(constvars, list(values) + [invars[j] for j in inputs], [jaxpr.outvars[k] for k in outputs], eqns,
                       core.no_effects, BUILT_DEBUG)
    return core.ClosedJaxpr(r, [consts[v] for v in constvars]), outputs, inputs


def _declined(why: str) -> None:
    log.debug("spliced: %s; the joint is traced whole", why)
    return None


def _live(eqns: list, outvars: Sequence[Any]) -> list:
    """``eqns`` (in order: each after what it reads) without those whose results nothing reads (none has effects
    here: ``parting`` loads none)."""
    need = {v for v in outvars if isinstance(v, core.Var)}
    kept = []
    for e in reversed(eqns):
        if e.effects or any(o in need for o in e.outvars):
            kept.append(e)
            need.update(a for a in e.invars if isinstance(a, core.Var))
    return kept[::-1]


def traces_anew(trace: Callable[[core.ClosedJaxpr], Any], closed: core.ClosedJaxpr) -> bool:
    """Whether ``trace`` traces ``closed``'s joint program anew: not where it is :func:`rewrite.grad.vjp.joint_at`
    holding that program's joint traced already (the loss as written's, ``written``), which a marked program
    would not reuse."""
    written = trace.keywords.get("written") if getattr(trace, "func", None) is joint_at else None
    return written is None or not (closed is written[0] or same_program(closed, written[0]))
