"""A layer loop's backward in a training step: the per-iteration VJP found, proven and rewritten.

Layers stacked with ``lax.scan`` (``nn.scan``, equinox's scan over stacked layers), differentiated inside the
step, leave two loops in its program: JAX's partial evaluation of the user's scan gives a *forward* loop ``F``
(its body the layer, with loop-invariant values moved out and the residuals the backward reads as stacked
outputs) and a *backward* loop ``B`` running the other way, whose body reads those residuals and the
cotangent carried from the next layer (under ``remat``, a body that recomputes the layer and transposes it).
Neither is the re-derivation of the whole loss (``step.py`` proves a loss's cone only up to the loop), and
``B``'s body still computes what the layer's VJP holds: an attention's N x N scores, each layer in turn.

Here the pair is recognised by its data, not its op sequence, and proven one iteration at a time:

1. **Pairs.** ``B`` is a ``scan`` that reads, as stacked inputs, stacked outputs of another ``scan`` ``F`` of
   the same length that runs the other way.
2. **One iteration, symbolically.** Fresh values stand for ``F``'s carry at some iteration (``d``), its
   stacked inputs' slices there (``p``) and the cotangent ``B`` carries into that iteration (``c``). ``F``'s
   body is applied to ``(consts, d, p)``; ``B``'s body to its own constants, ``c``, and its stacked inputs'
   slices: a slice of an array ``F`` also reads is that ``p``, a slice of ``F``'s stacked output is what
   ``F``'s body computed for it. JAX's own VJP of the layer ``f = F's body without its stacked outputs``,
   traced (``(consts, d, p, c) -> (f(...), gradients of the float inputs)``), is applied to the same values.
   Nested ``remat``/``checkpoint`` and ``jit`` calls are inlined, and the step's equations that compute the
   loops' constants are included, so that an invariant moved out of ``F``'s body and recomputed in ``B``'s
   (a mask) is one term.
3. **Proof.** All of it is loaded into one e-graph with no rule; each of ``B``'s body outputs must share a
   class with one of the re-derived gradients. Nothing is assumed about which output is which gradient. Two
   derivations of one VJP differ in the order cotangents are summed and in relabellings of size-1 axes, so
   both sides are first normalised (:func:`_commuted`): the proof holds up to a cotangent sum's order.
4. **Replacement.** ``F`` and ``B`` are replaced by two loops of the same shape over the *rewritten* layer,
   ``loss_first(layer)``: the layer rewritten with the step's rules, its VJP rewritten jointly
   (``rewrite/grad/vjp.py``). Loop invariants ``F`` took that are larger than what they are computed from (a mask
   broadcast to the scores' shape) are moved back into the layer first (:func:`_sunk`). Then:

   * where ``B`` recomputes its layer (a ``remat`` call in its body), the forward loop runs the rewritten VJP's
     forward half and stacks the layer's inputs; the backward loop runs the VJP at each of them (recomputing the
     rewritten layer, as ``remat`` does);
   * where it does not (``B`` reads the residuals ``F`` stacked: a plain ``nn.scan``), the rewritten VJP is split
     where its cotangents enter (:func:`_split_vjp`): the forward loop runs the forward half and stacks the
     residuals the backward half reads, the backward loop runs the backward half at each iteration's slice. That
     is the rewritten layer's own split, what the loss-first form runs: no memory-for-time choice is made for the
     user, and the recomputation is the rewritten layer's (the blocked attention's backward recomputing its
     blocks' scores), not the layer's.

   What ``F`` saved for ``B`` is then dead. Whether the step so replaced is kept is the cost model's decision
   (``api.py``'s step search), as for every whole-step replacement.

Declined, with why: a ``B`` reading a stacked value that is neither ``F``'s input nor output, ``F``'s stacked
outputs read by something other than ``B`` (the layer's own per-iteration outputs, whose cotangents ``B`` would
read too), carries that do not pair one to one (a constant with a gradient, which ``B`` accumulates), and any
output of ``B``'s body not proven.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Sequence

import jax

from ..ir.jaxapi import BUILT_DEBUG, core, scan_counts
from ..ir.primitives import is_float
from ..jaxpr.dce import dce
from ..jaxpr.edit import CALLS, body_of, in_order, inline, read, substitute
from ..jaxpr.trace import spec_of
from .vjp import joint_program

log = logging.getLogger("rewrite")

class _Pair:
    """A forward loop ``F`` and the backward loop ``B`` that reads its stacked outputs, at top-level positions
    ``kf`` and ``kb`` of the step."""

    def __init__(self, step: core.ClosedJaxpr, kf: int, kb: int) -> None:
        eqns = step.jaxpr.eqns
        self.kf, self.kb = kf, kb
        self.F, self.B = eqns[kf], eqns[kb]

    def f_split(self) -> tuple[list, list, list]:
        return _split(self.F)

    def b_split(self) -> tuple[list, list, list]:
        return _split(self.B)


def _split(e: Any) -> tuple[list, list, list]:
    """A scan equation's inputs: ``(constants, carries, stacked inputs)``."""
    nc, nk = scan_counts(e.params)
    return e.invars[:nc], e.invars[nc:nc + nk], e.invars[nc + nk:]


def pairs(step: core.ClosedJaxpr) -> list[_Pair]:
    """Backward loops and their forward loops, by data: ``B`` reads as a stacked input a stacked output of ``F``;
    the same length, running the other way."""
    eqns = step.jaxpr.eqns
    producer = {w: k for k, e in enumerate(eqns) for w in e.outvars}
    found = []
    for kb, B in enumerate(eqns):
        if B.primitive.name != "scan":
            continue
        xs = _split(B)[2]
        forwards = {producer[a] for a in xs if isinstance(a, core.Var) and a in producer}
        for kf in sorted(forwards):
            F = eqns[kf]
            if (F.primitive.name != "scan" or F.params["length"] != B.params["length"]
                    or F.params["reverse"] == B.params["reverse"]):
                continue
            ys = F.outvars[scan_counts(F.params)[1]:]
            if any(a in ys for a in xs):
                found.append(_Pair(step, kf, kb))
    return found


def _nbytes(a: Any) -> int:
    aval = a.aval
    return int(getattr(aval, "size", 1)) * getattr(getattr(aval, "dtype", None), "itemsize", 0)


#: Primitives computing a loop's invariant that may be moved back into the layer (no loops, no effects).
_NOT_SUNK = frozenset({"scan", "while", "cond", "custom_vjp_call", "custom_jvp_call", "shard_map"})


def _cheaper_recomputed(e: core.JaxprEqn) -> bool:
    """Whether ``e`` may be recomputed where its outputs are read instead of being held: no effects, no loop or
    custom derivative, and outputs larger than the values it reads (a value broadcast)."""
    return (not e.effects and e.primitive.name not in _NOT_SUNK
            and sum(_nbytes(w) for w in e.outvars) > sum(_nbytes(a) for a in e.invars if isinstance(a, core.Var)))


def _sunk(step: core.ClosedJaxpr, consts: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """The forward loop's constants, with the step's equations that computed them from smaller values moved back
    into the layer: ``(the layer's constants, those equations' positions in program order)``. JAX's partial
    evaluation moved loop invariants out of the layer (a causal mask broadcast to every head, a fill value
    broadcast to the scores' shape); an invariant larger than what it is computed from is cheaper recomputed
    in the body than held as the loop's input, and the layer so written is the user's."""
    eqns = step.jaxpr.eqns
    producer = {w: k for k, e in enumerate(eqns) for w in e.outvars}
    leaves = [a for a in consts if isinstance(a, core.Var)]
    sunk: set[int] = set()
    changed = True
    while changed:
        changed = False
        for v in list(leaves):
            k = producer.get(v)
            if k is None or k in sunk:
                continue
            e = eqns[k]
            if not _cheaper_recomputed(e):
                continue
            sunk.add(k)
            leaves = [x for x in leaves if x not in e.outvars]
            leaves += [a for a in e.invars if isinstance(a, core.Var) and a not in leaves]
            changed = True
    return leaves, sorted(sunk)


def _layer(step: core.ClosedJaxpr, pair: _Pair) -> tuple[core.ClosedJaxpr, list[Any]]:
    """``F``'s body without its stacked outputs, its invariants moved back in (:func:`_sunk`): the layer,
    ``(constants, carry, slices) -> carry``; and its constants, values of the step."""
    fconsts, fcarry, fxs = pair.f_split()
    leaves, sunk = _sunk(step, fconsts)
    body = pair.F.params["jaxpr"]
    nf, nk = len(fconsts), scan_counts(pair.F.params)[1]
    ins = [core.Var(v.aval) for v in leaves]
    env = dict(zip(leaves, ins))
    eqns: list = []
    constvars, cvals = [], []
    for k in sunk:
        e = step.jaxpr.eqns[k]
        outs = [core.Var(w.aval) for w in e.outvars]
        eqns.append(e.replace(invars=[read(env, a) for a in e.invars], outvars=outs))
        env.update(zip(e.outvars, outs))
    d = [core.Var(v.aval) for v in body.jaxpr.invars[nf:]]
    outs = inline(eqns, body.jaxpr, body.consts, [read(env, a) for a in fconsts] + d, constvars, cvals, CALLS)
    jaxpr = core.new_jaxpr(constvars, ins + d, outs[:nk], eqns, core.no_effects, BUILT_DEBUG)
    return dce(core.ClosedJaxpr(jaxpr, cvals)), leaves


def _check(step: core.ClosedJaxpr, pair: _Pair) -> str:
    """Why the pair is not handled, or ``""``."""
    F, B = pair.F, pair.B
    if F.effects or B.effects or F.params["jaxpr"].jaxpr.effects or B.params["jaxpr"].jaxpr.effects:
        return "a loop has effects"
    nkf = scan_counts(F.params)[1]
    ys = F.outvars[nkf:]
    readers = {}
    for k, e in enumerate(step.jaxpr.eqns):
        for a in e.invars:
            if isinstance(a, core.Var):
                readers.setdefault(a, set()).add(k)
    outs = set(a for a in step.jaxpr.outvars if isinstance(a, core.Var))
    for y in ys:
        if y in outs or readers.get(y, set()) - {pair.kb}:
            return "the forward loop's stacked outputs are read by something other than its backward"
    _, fcarry, fxs = pair.f_split()
    _, bcarry, bxs = pair.b_split()
    if len(bcarry) != sum(is_float(v.aval) for v in F.outvars[:nkf]):
        return "the backward loop's carries do not pair with the forward loop's float carries"
    for a in bxs:
        if not isinstance(a, core.Var) or (a not in ys and a not in fxs):
            return "the backward loop reads a stacked value that is neither the forward loop's input nor output"
    return ""


#: Operations whose two operands commute exactly (``add_any`` is ``add``: the sum of two cotangents).
COMMUTE = frozenset({"add", "mul", "add_any", "max", "min"})


def _commuted(eqns: list, inputs: Sequence[Any]) -> tuple[list, dict]:
    """``eqns`` with the operands of each commutative operation in a fixed order, by a hash of the terms they
    compute (not of their names): JAX's transposes sum a value's cotangents in the order they reach it, which
    differs between a backward recomputed under ``remat`` and one derived afresh. ``a + b`` and ``b + a`` are
    then one term. A sum of cotangents (``add_any``) is written as the sum of its terms in that fixed order: the
    proof holds up to the order in which a value's cotangents are summed (which rounds differently; JAX's own
    two derivations differ so). Operations that only relabel elements (size-1 axes added or dropped) are one
    reshape of the value they start from, or that value itself (``alias``: the values so replaced)."""
    key: dict[Any, str] = {v: f"in{i}" for i, v in enumerate(inputs)}

    def of(a: Any) -> str:
        if isinstance(a, core.Var):
            return key.get(a, f"free{id(a)}")
        return f"lit{a.val!r}{a.aval}"

    def keyed(e: Any) -> Any:
        ins = list(e.invars)
        keys = [of(a) for a in ins]
        if e.primitive.name in COMMUTE and len(ins) == 2 and keys[1] < keys[0]:
            ins, keys = ins[::-1], keys[::-1]
            e = e.replace(invars=ins)
        h = hashlib.blake2b(f"{e.primitive.name}|{sorted(e.params.items(), key=lambda kv: kv[0])!r}|{keys}"
                            .encode(), digest_size=16).hexdigest()
        for j, w in enumerate(e.outvars):
            if isinstance(w, core.Var):
                key[w] = f"{h}.{j}"
        return e

    origin: dict[Any, Any] = {}  # a reshape's operand, through reshapes
    terms: dict[Any, list] = {}  # an add_any's value: the cotangents it sums
    alias: dict[Any, Any] = {}  # a value that is another one's elements in the same order, of the same shape
    out = []
    for e in eqns:
        if alias and any(isinstance(a, core.Var) and a in alias for a in e.invars):
            e = e.replace(invars=[alias.get(a, a) if isinstance(a, core.Var) else a for a in e.invars])
        root = _relabelled(e)
        if root is not None:
            root = alias.get(root, root)
            while root in origin:
                root = origin[root]
            w = e.outvars[0]
            if tuple(root.aval.shape) == tuple(w.aval.shape):
                alias[w] = root
                continue
            origin[w] = root
            out.append(keyed(_reshape(root, w)))
            continue
        if e.primitive.name == "add_any" and len(e.invars) == 2 and all(isinstance(a, core.Var) for a in e.invars):
            summed = sorted((t for a in e.invars for t in terms.get(a, [(of(a), a)])), key=lambda t: t[0])
            acc = summed[0][1]
            for j, (_, a) in enumerate(summed[1:]):
                w = e.outvars[0] if j == len(summed) - 2 else core.Var(e.outvars[0].aval)
                out.append(keyed(e.replace(invars=[acc, a], outvars=[w])))
                acc = w
            terms[e.outvars[0]] = summed
            continue
        out.append(keyed(e))
    return out, alias


def _relabelled(e: Any) -> Any:
    """The operand of ``e`` if ``e`` only relabels its elements in row-major order (a reshape, a broadcast or a
    sum that adds or drops axes of size 1: what batching and transposing leave around a vmapped layer), else
    ``None``."""
    name = e.primitive.name
    if len(e.invars) != 1 or len(e.outvars) != 1 or not isinstance(e.invars[0], core.Var):
        return None
    a, w = e.invars[0], e.outvars[0]
    if a.aval.dtype != w.aval.dtype or int(a.aval.size) != int(w.aval.size):
        return None
    if name == "reshape" and e.params.get("dimensions") is None:
        return a
    if name in ("broadcast_in_dim", "reduce_sum", "squeeze", "expand_dims"):
        return a
    return None


def _reshape(a: Any, w: Any) -> Any:
    """The equation ``w = reshape(a)``, as JAX writes it."""
    traced = jax.make_jaxpr(lambda x: jax.lax.reshape(x, tuple(w.aval.shape)))(spec_of(a.aval))
    return traced.jaxpr.eqns[0].replace(invars=[a], outvars=[w])


#: Primitives by which a backward recomputes what its forward computed (``jax.checkpoint``, ``nn.remat``,
#: ``eqx.filter_checkpoint``).
REMAT = frozenset({"remat2", "checkpoint", "remat"})


def _recomputes(jaxpr: core.Jaxpr) -> bool:
    """Does ``jaxpr`` (a backward loop's body) recompute its layer: does it hold a ``remat`` call?"""
    for e in jaxpr.eqns:
        if e.primitive.name in REMAT:
            return True
        for v in e.params.values():
            inner = v.jaxpr if isinstance(v, core.ClosedJaxpr) else v
            if isinstance(inner, core.Jaxpr) and _recomputes(inner):
                return True
    return False


def prove_pair(step: core.ClosedJaxpr, pair: _Pair, proof: Callable[[core.ClosedJaxpr], list[Any]]
               ) -> tuple[str, list[int] | None, tuple | None]:
    """Is each output of ``B``'s body, one iteration, a value of the layer's VJP? ``("", [derived position of each
    B body output], (layer, its constants))`` or ``(why not, None, None)``. The derived program is ``joint_program(layer)``:
    ``(constants, carry, slices, cotangents of the float carries) -> (carries, gradients of the float inputs)``."""
    why = _check(step, pair)
    if why:
        return why, None, None
    F, B = pair.F, pair.B
    layer, lconsts = _layer(step, pair)
    fconsts, fcarry, fxs = pair.f_split()
    bconsts, bcarry, bxs = pair.b_split()
    fbody, bbody = F.params["jaxpr"], B.params["jaxpr"]
    nf = len(fconsts)
    # one iteration's fresh values: F's carry in, its slices, the cotangents B carries in
    d = [core.Var(v.aval) for v in fbody.jaxpr.invars[nf:nf + len(fcarry)]]
    p = [core.Var(v.aval) for v in fbody.jaxpr.invars[nf + len(fcarry):]]
    c = [core.Var(v.aval) for v in bbody.jaxpr.invars[len(bconsts):len(bconsts) + len(bcarry)]]
    jaxpr = step.jaxpr
    graph_producer = {w: k for k, e in enumerate(jaxpr.eqns) for w in e.outvars}
    # the step's equations that compute the loops' constants
    need: set[int] = set()
    stack = [a for a in list(fconsts) + list(bconsts) + list(lconsts) if isinstance(a, core.Var)]
    seen: set = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        k = graph_producer.get(v)
        if k is not None and k not in need:
            need.add(k)
            stack.extend(a for a in jaxpr.eqns[k].invars if isinstance(a, core.Var))
    constvars, cvals = list(jaxpr.constvars), list(step.consts)
    eqns: list = []
    env: dict = {}
    for k in sorted(need):
        e = jaxpr.eqns[k]
        key = "jaxpr" if "jaxpr" in e.params else None
        ins = [read(env, a) for a in e.invars]
        if e.primitive.name in CALLS and key is not None and not e.effects:
            inner, inner_consts = body_of(e.params[key])
            outs = inline(eqns, inner, inner_consts, ins, constvars, cvals, CALLS)
            env.update(zip(e.outvars, outs))
        else:
            eqns.append(e.replace(invars=ins))
    fc = [read(env, a) for a in fconsts]
    bc = [read(env, a) for a in bconsts]
    fouts = inline(eqns, fbody.jaxpr, fbody.consts, fc + d + p, constvars, cvals, CALLS)
    ys = F.outvars[scan_counts(F.params)[1]:]
    fys = fouts[scan_counts(F.params)[1]:]
    slices = []
    for a in bxs:
        if a in ys:
            slices.append(fys[ys.index(a)])
        else:
            slices.append(p[list(fxs).index(a)])
    bouts = inline(eqns, bbody.jaxpr, bbody.consts, bc + c + slices, constvars, cvals, CALLS)
    try:
        joint = joint_program(layer)[0]
    except Exception as e:  # a layer JAX cannot differentiate
        return f"its VJP could not be re-derived ({type(e).__name__}: {e})", None, None
    lc = [read(env, a) for a in lconsts]
    derived = inline(eqns, joint.jaxpr, joint.consts, lc + d + p + c, constvars, cvals, CALLS)
    invars = list(jaxpr.invars) + d + p + c
    if any(not isinstance(o, core.Var) for o in bouts):
        return "the backward loop's body has a constant output", None, None
    # a literal among the derived values (a zero) is no class: it is matched by nothing
    kept = [j for j, o in enumerate(derived) if isinstance(o, core.Var)]
    outs = list(bouts) + [derived[j] for j in kept]
    eqns, alias = _commuted(eqns, constvars + invars)
    outs = [alias.get(o, o) for o in outs]
    program = core.ClosedJaxpr(core.new_jaxpr(constvars, invars, outs, eqns, core.no_effects, BUILT_DEBUG), cvals)
    classes = proof(program)
    bcls, dcls = classes[:len(bouts)], classes[len(bouts):]
    # the derived values are the layer's outputs, then the gradients: B's outputs are cotangents, so gradients
    nout = len(layer.out_avals)
    grads: dict = {}
    for j, cl in zip(kept, dcls):
        if j >= nout:
            grads.setdefault(cl, j)
    where = [grads.get(cl) for cl in bcls]
    if any(w is None for w in where):
        missing = sum(w is None for w in where)
        return (f"{missing} of the backward loop's {len(where)} body outputs not proven a gradient of the layer",
                None, None)
    return "", where, (layer, lconsts)


def _split_vjp(vjp: core.ClosedJaxpr, n_consts: int, n_layer_in: int, nk: int, where: Sequence[int]
               ) -> tuple[core.ClosedJaxpr, core.ClosedJaxpr, list[int]]:
    """The rewritten layer's VJP ``(constants, carry, slices, cotangents) -> (carries, gradients)`` split where its
    cotangents enter: ``fwd: (constants, carry, slices) -> (carries, residuals it computes)`` and ``bwd:
    (constants, residuals, cotangents) -> the outputs at where``; with the positions among ``(carry, slices)`` of
    the residuals that are the layer's inputs (they come first in ``bwd``'s residuals).

    An equation belongs to the backward half if it reads a cotangent (through any other), to the forward half if
    it reads the carry or a slice, otherwise it is loop-invariant (it reads the constants alone), and each half
    computes what it needs of those. A residual is a value of the forward half that the backward reads: the
    split that keeps every value the backward reads; a loop (the blocked attention's backward) is one equation,
    whole in the half it belongs to. A residual larger than what it is computed from (a value broadcast) is
    recomputed by the backward from those instead, as :func:`_sunk` does for the loop's constants; a loop or a
    call is never so moved."""
    jaxpr = vjp.jaxpr
    ins = list(jaxpr.invars)
    consts, state, cts = ins[:n_consts], ins[n_consts:n_layer_in], ins[n_layer_in:]
    kind: dict[Any, int] = {v: 0 for v in list(jaxpr.constvars) + consts}  # 0 invariant, 1 forward, 2 backward
    kind.update({v: 1 for v in state})
    kind.update({v: 2 for v in cts})
    part: list[int] = []
    for e in jaxpr.eqns:
        k = max((kind[a] for a in e.invars if isinstance(a, core.Var)), default=0)
        if k == 0 and e.effects:
            k = 1
        part.append(k)
        kind.update({w: k for w in e.outvars})
    if any(isinstance(o, core.Var) and kind[o] == 2 for o in jaxpr.outvars[:nk]):
        raise ValueError("the layer's carry depends on a cotangent")
    producer = {w: k for k, e in enumerate(jaxpr.eqns) for w in e.outvars}
    picked = [jaxpr.outvars[j] for j in where]
    moved: set[int] = set()  # forward equations the backward recomputes
    while True:
        reads = [a for k, e in enumerate(jaxpr.eqns) if part[k] == 2 or k in moved for a in e.invars] + picked
        residuals = list(dict.fromkeys(a for a in reads if isinstance(a, core.Var) and kind[a] == 1
                                       and producer.get(a) not in moved))
        more = False
        for r in residuals:
            k = producer.get(r)
            if k is None:
                continue
            e = jaxpr.eqns[k]
            if not _cheaper_recomputed(e) or any(isinstance(v, (core.ClosedJaxpr, core.Jaxpr))
                                                 for v in e.params.values()):
                continue
            moved.add(k)
            more = True
        if not more:
            break
    fwd_eqns = [e for k, e in enumerate(jaxpr.eqns) if part[k] < 2]
    bwd_eqns = [e for k, e in enumerate(jaxpr.eqns) if part[k] != 1 or k in moved]
    outer = [r for r in residuals if r in state]
    inner = [r for r in residuals if r not in state]
    fwd = core.new_jaxpr(list(jaxpr.constvars), consts + state, list(jaxpr.outvars[:nk]) + inner, fwd_eqns,
                         core.no_effects, BUILT_DEBUG)
    bwd = core.new_jaxpr(list(jaxpr.constvars), consts + outer + inner + cts, picked, bwd_eqns, core.no_effects,
                         BUILT_DEBUG)
    return dce(core.ClosedJaxpr(fwd, vjp.consts)), dce(core.ClosedJaxpr(bwd, vjp.consts)), [state.index(r) for r in outer]


def _recomputing(run: Callable, cts: list, nk: int, nbk: int, where: list[int], length: int, f_reverse: bool,
                 b_reverse: bool) -> Callable:
    """The two loops of a backward that recomputes its layer (``remat``): the forward runs the rewritten VJP's
    forward and stacks the layer's carry-in; the backward runs the whole VJP at each of them."""
    def both(consts, init, ps, ct0):
        def forward(carry, sl):  # the layer's forward: the cotangents' terms are dead, and dropped
            outs = run(*consts, *carry, *sl, *[jax.numpy.zeros(a.shape, a.dtype) for a in cts])
            return list(outs[:nk]), list(carry)

        out, hs = jax.lax.scan(forward, list(init), list(ps), length=length, reverse=f_reverse)

        def backward(carry, xs):
            sl, h = xs
            outs = run(*consts, *h, *sl, *carry)
            picked = [outs[j] for j in where]
            return picked[:nbk], picked[nbk:]

        grads = jax.lax.scan(backward, list(ct0), (list(ps), hs), length=length, reverse=b_reverse)
        return out, grads

    return both


def _split_loops(fwd: core.ClosedJaxpr, bwd: core.ClosedJaxpr, outer: list[int], nk: int, nbk: int, length: int,
                 f_reverse: bool, b_reverse: bool) -> Callable:
    """The two loops of a backward that reads what its forward saved (no ``remat``): the forward runs the rewritten
    VJP's forward half and stacks the residuals it computes (and the carry-ins the backward half reads); the
    backward runs the backward half at each iteration's residuals (:func:`_split_vjp`)."""
    run_f, run_b = core.jaxpr_as_fun(fwd), core.jaxpr_as_fun(bwd)

    def both(consts, init, ps, ct0):
        def forward(carry, sl):
            outs = run_f(*consts, *carry, *sl)
            return list(outs[:nk]), ([carry[i] for i in outer if i < nk], list(outs[nk:]))

        out, (hs, rs) = jax.lax.scan(forward, list(init), list(ps), length=length, reverse=f_reverse)

        def backward(carry, xs):
            sl, h, r = xs
            h = iter(h)
            state = [next(h) if i < nk else sl[i - nk] for i in outer]
            picked = run_b(*consts, *state, *r, *carry)
            return list(picked[:nbk]), list(picked[nbk:])

        grads = jax.lax.scan(backward, list(ct0), (list(ps), hs, rs), length=length, reverse=b_reverse)
        return out, grads

    return both


def replace_pair(step: core.ClosedJaxpr, pair: _Pair, where: list[int], layer: tuple,
                 loss_first: Callable[[core.ClosedJaxpr], core.ClosedJaxpr], remat: bool
                 ) -> tuple[core.ClosedJaxpr, list]:
    """``step`` with ``F`` and ``B`` two loops over the rewritten layer, and ``B'``'s outputs. Under ``remat``
    ``F'`` runs its forward and stacks its carry-in, ``B'`` its VJP at each carry-in (:func:`_recomputing`);
    without, ``F'`` runs its VJP's forward half and stacks the residuals, ``B'`` the backward half at each
    (:func:`_split_loops`). What ``B`` read of ``F`` is then dead."""
    layer, lconsts = layer
    F, B = pair.F, pair.B
    vjp = loss_first(layer)  # (constants, carry, slices, cotangents) -> (carries, gradients), rewritten
    _, fcarry, fxs = pair.f_split()
    _, bcarry, _ = pair.b_split()
    nk, nbk, length = scan_counts(F.params)[1], len(bcarry), F.params["length"]
    if remat:
        both = _recomputing(core.jaxpr_as_fun(vjp), list(vjp.in_avals[len(layer.in_avals):]), nk, nbk, where, length,
                            F.params["reverse"], B.params["reverse"])
    else:
        fwd, bwd, outer = _split_vjp(vjp, len(lconsts), len(layer.in_avals), nk, where)
        both = _split_loops(fwd, bwd, outer, nk, nbk, length, F.params["reverse"], B.params["reverse"])
    args = (list(lconsts), list(fcarry), list(fxs), list(bcarry))
    specs = jax.tree.map(lambda a: spec_of(a.aval), args, is_leaf=lambda a: isinstance(a, (core.Var, core.Literal)))
    program = jax.make_jaxpr(both)(*specs)
    jaxpr = step.jaxpr
    eqns: list = []
    constvars, cvals = list(jaxpr.constvars), list(step.consts)
    outs = inline(eqns, program.jaxpr, program.consts, [a for group in args for a in group], constvars, cvals)
    env = dict(zip(F.outvars[:nk], outs[:nk]))
    env.update(zip(B.outvars, outs[nk:]))
    # B read of F only its stacked outputs (checked), so F's carries are all it gives the rest of the step
    rest = [substitute(e, env) for k, e in enumerate(jaxpr.eqns) if k not in (pair.kf, pair.kb)]
    new = core.new_jaxpr(constvars, list(jaxpr.invars), [read(env, a) for a in jaxpr.outvars],
                         in_order(eqns + rest), jaxpr.effects, jaxpr.debug_info)
    return dce(core.ClosedJaxpr(new, cvals)), [o for o in outs[nk:] if isinstance(o, core.Var)]


def find_loop_vjps(step: core.ClosedJaxpr, proof: Callable[[core.ClosedJaxpr], list[Any]],
                   loss_first: Callable[[core.ClosedJaxpr], core.ClosedJaxpr],
                   replaced: list[str], declined: list[str]) -> core.ClosedJaxpr | None:
    """``step`` with each proven backward layer loop's body read from the rewritten layer's VJP; ``None`` if
    none was. What was replaced and declined is appended to the lists."""
    changed = False
    done: set = set()
    while True:
        progress = False
        for pair in pairs(step):
            if pair.B.outvars[0] in done:  # tried, or a replacement's own loop
                continue
            done.add(pair.B.outvars[0])
            said = f"a backward layer loop of {pair.B.params['length']} iterations"
            try:
                why, where, layer = prove_pair(step, pair, proof)
                if where is None:
                    declined.append(f"{said}: {why}")
                    continue
                remat = _recomputes(pair.B.params["jaxpr"].jaxpr)
                step, made = replace_pair(step, pair, where, layer, loss_first, remat)
            except Exception as e:  # a layer the proof or the rewrite cannot build: declined, the step as it was
                declined.append(f"{said}: not replaced ({type(e).__name__}: {e})")
                log.debug("layer loop declined", exc_info=True)
                continue
            done.update(made)
            how = "" if remat else ", split at its residuals"
            replaced.append(f"{said} with the rewritten layer's VJP{how} ({len(where)} outputs proven)")
            changed = progress = True
            break
        if not progress:
            return step if changed else None


__all__ = ["find_loop_vjps", "pairs", "prove_pair", "replace_pair"]
