"""A whole training step: the loss's value and gradients, found in the step's program and proven.

A user writes ``jax.jit(rewrite(step))``, where ``step`` calls
``jax.value_and_grad(loss)`` (or ``grad``, ``vjp``, ``nnx.value_and_grad``,
``eqx.filter_value_and_grad``) and then updates the parameters. Its program
already holds JAX's backward pass, with the residuals that make it large (an
attention's N x N scores, an LM head's N x V logits). The forward rules
(``rulesets.attention``, ``rulesets.nn``'s LM head) rewrite the forward, but
the backward still reads what the original forward computed. What
``jax.value_and_grad(rewrite(loss))`` does instead (the *loss-first* form:
the loss's VJP rewritten as one program, ``rewrite/grad/vjp.py``) cannot
apply, since the loss is no longer a function of its own.

Here it is recovered, and checked:

1. **Candidates.** Each scalar float value ``L`` the step computes, with its
   *cone*: the equations ``L`` depends on, back to the step's inputs (the
   cone's *leaves*). Values that only scalar arithmetic reads come first (a
   loss is returned or logged; a gradient's global norm scales the update),
   then the larger cones.
2. **Re-derivation.** The cone, as a function of its leaves, is
   differentiated by JAX itself: ``jax.vjp`` of it, traced, seeded with 1.
3. **Proof.** The step and the re-derived ``(L, dL/dleaves)`` are loaded
   into one e-graph, the re-derived program's inputs being the step's own.
   Hash-consing makes equal terms one e-class: a value of the step that is
   in the same class as the re-derived gradient of leaf ``i`` *is* that
   gradient. Nothing is assumed about which values of the step are
   gradients, nor about the op sequence that computed them: only values
   proven equal are replaced.
4. **Replacement.** The proven loss and gradients are replaced by the
   loss-first program: the cone's forward rewritten with the step's rules
   and differentiated by JAX (``jax.vjp``, seeded with 1), so that the
   backward reads what the rewritten forward computes, the memory-shaped
   rules' blocked forward and recomputing backward included. The old
   forward and backward are then dead, unless something else reads them
   (an ``aux`` output), and dropped. The step so changed is rewritten as
   one program (by the caller), which rewrites that backward jointly with
   its forward, as ``jax.value_and_grad(rewrite(loss))`` rewrites a loss's
   VJP; no forward/backward split is chosen, since none is kept.

Where the whole cone runs through a loop whose forward JAX's partial
evaluation reshaped (residual outputs, invariants moved out, a ``remat``
backward that recomputes the original body), the cone is tried again cut at
the loop's outputs, which become leaves; the loop's backward is then proven and replaced one iteration at a
time (``rewrite/grad/loops.py``). A loop's body that holds a loss and
its gradients (gradient accumulation) is searched as a step of its own. Gradient accumulation unrolled by a Python
loop sums the micro-batches' losses, and their gradients, in the step's own order: the sum is not proven (the
step holds no gradient of it), and its parts (:func:`parts`), each a micro-batch's loss, are tried next. Only
candidates that fail count against :data:`MAX_TRIES`, so that each loss replaced leaves the budget for the next.

Where the proof fails (the step's backward is not the VJP of its forward: a
``stop_gradient`` applied to a use the cone does not stop, a ``custom_vjp``
or hand-modified gradient), nothing is replaced, and :class:`StepFinding`
says why. The caller (``Rewritten._whole_step``) rewrites the step with the
replacement, and keeps it where its cost model prices it below the step as
written; otherwise it rewrites the step as written too and keeps the one it
prices lower (or the leaner within its lean band).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ..ir.jaxapi import BUILT_DEBUG, core
from ..ir.primitives import is_float
from ..jaxpr.dce import dce
from ..jaxpr.edit import in_order, inline, loads_alike, read, substitute, without_empty_mesh
from ..jaxpr.trace import spec_of
from ..pipeline import ProofGraph
from .alike import Built, _scalar_float, new_loops, parted, parts, reused
from .loops import find_loop_vjps
from .seed import seeded_edit
from .uses import sliced
from .vjp import float_positions, joint_program

log = logging.getLogger("rewrite")

#: How many candidate losses are re-derived and tried without being proven, at most, per step (those proven and
#: replaced are not counted: a step accumulating micro-batches unrolled holds a loss each).
MAX_TRIES = 4
#: Primitives whose outputs a cone is cut at when the whole cone is not proven: JAX's partial evaluation gives a
#: loop in the step residual outputs (and, under ``remat``, a backward that recomputes its body) that the
#: re-derivation's does not have, so the gradient is sought at the loop's outputs instead.
LOOPS = frozenset({"scan", "while"})
#: How many losses (micro-batches of gradient accumulation) are replaced, at most.
MAX_LOSSES = 8


#: the rulesets whose presence turns on the whole-step search by default (``rewrite(..., whole_step=None)``)
WHOLE_STEP_PACKS = frozenset({"attention", "nn_lm_head"})


def searches_steps(entries: Sequence[tuple[Any, Any]], whole_step: bool | None) -> bool:
    """``whole_step=`` decided: ``None`` searches when the rules hold a memory-shaped pack's."""
    return any(owner.name in WHOLE_STEP_PACKS for _, owner in entries) if whole_step is None else bool(whole_step)


class AsWritten(Exception):
    """Raised by a loss-first build (``Rewritten._loss_first``) to leave its loss as written: in a small step (under
    ``grad.pinned.PIN_FROM`` equations, saturated whole again after its losses are replaced) a loss whose forward no
    rule rewrote gets JAX's own VJP of it back, saturated once apart and once again in the step (on jaxmd_lj_forces
    three pipelines for the step as written's program). :func:`find_losses` records the decline and goes on to the
    step's other losses, which may be rewritten (a loop's layers, :func:`rewrite.grad.loops.find_loop_vjps`, decline
    it as any layer the rewrite cannot build): a step where none is replaced is rewritten as written."""


@dataclasses.dataclass
class StepFinding:
    """What the search found in one step: the losses replaced and the candidates declined, with why."""

    replaced: list[str] = dataclasses.field(default_factory=list)
    declined: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    #: for each loss-first program decided on its joint program (``rewrite.grad.vjp.decided_jointly``), which was kept
    decided: list[str] = dataclasses.field(default_factory=list)
    #: the step as given, priced as ``program_cost`` prices it, read off the proofs' load where :func:`find_losses`
    #: was asked to (``price``) and a loss of the step as given was replaced; else ``None``
    price: float | None = None

    def __str__(self) -> str:
        parts = ([f"replaced {r}" for r in self.replaced] + [f"declined {d}" for d in self.declined]
                 + [f"loss-first VJP decided jointly: {d}" for d in self.decided])
        return "; ".join(parts) or "no loss with its gradients found"


# ---------------------------------------------------------------------- the flat program
def unwrap(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """``closed`` with a lone top-level ``jit`` call (``jax.jit``, ``nnx.jit``, ``eqx.filter_jit`` of the step)
    inlined, repeatedly, so that the step's equations are at the top level."""
    while True:
        eqns = closed.jaxpr.eqns
        if len(eqns) != 1 or eqns[0].primitive.name not in ("jit", "pjit") or eqns[0].effects:
            return closed
        eqn = eqns[0]
        inner = eqn.params["jaxpr"]
        env: dict[Any, Any] = dict(zip(inner.jaxpr.invars, eqn.invars))
        constvars = list(closed.jaxpr.constvars)
        consts = list(closed.consts)
        for v, c in zip(inner.jaxpr.constvars, inner.consts):
            constvars.append(v)
            consts.append(c)
        new_eqns = [substitute(e, env) for e in inner.jaxpr.eqns]
        outer = dict(zip(eqn.outvars, [read(env, a) for a in inner.jaxpr.outvars]))
        outvars = [read(outer, a) for a in closed.jaxpr.outvars]
        jaxpr = core.new_jaxpr(constvars, list(closed.jaxpr.invars), outvars, new_eqns, closed.jaxpr.effects,
                               closed.jaxpr.debug_info)
        closed = core.ClosedJaxpr(jaxpr, consts)


class _Graph:
    """The step's top-level equations: who produces each value, who reads it."""

    def __init__(self, jaxpr: core.Jaxpr) -> None:
        self.jaxpr = jaxpr
        self.producer: dict[Any, int] = {}
        for k, e in enumerate(jaxpr.eqns):
            for v in e.outvars:
                self.producer[v] = k
        self.readers: dict[Any, list[int]] = {}
        for k, e in enumerate(jaxpr.eqns):
            for a in e.invars:
                if isinstance(a, core.Var):
                    self.readers.setdefault(a, []).append(k)
        self.inputs = set(jaxpr.invars) | set(jaxpr.constvars)
        self._bits: tuple[list[int], list[int], list[Any]] | None = None
        self._readers: list[int] | None = None

    def _cones(self) -> tuple[list[int], list[int], list[Any]]:
        """Each equation's cone as bit sets, made once in one pass in program order: the equations it depends on
        (bit ``k`` for equation ``k``, itself included) and the inputs it reaches (bit ``i`` for ``inputs[i]``)."""
        if self._bits is None:
            inputs = list(self.jaxpr.constvars) + list(self.jaxpr.invars)
            index = {v: i for i, v in enumerate(inputs)}
            eqn_bits: list[int] = []
            leaf_bits: list[int] = []
            for k, e in enumerate(self.jaxpr.eqns):
                b, leaf = 1 << k, 0
                for a in e.invars:
                    if not isinstance(a, core.Var):
                        continue
                    j = self.producer.get(a)
                    if j is not None:
                        b |= eqn_bits[j]
                        leaf |= leaf_bits[j]
                    elif a in index:
                        leaf |= 1 << index[a]
                eqn_bits.append(b)
                leaf_bits.append(leaf)
            self._bits = eqn_bits, leaf_bits, inputs
        return self._bits

    def reader_bits(self) -> list[int]:
        """For each equation, the equations that read any of its outputs, as a bit set (made once)."""
        if self._readers is None:
            self._readers = [0] * len(self.jaxpr.eqns)
            for v, ks in self.readers.items():
                k = self.producer.get(v)
                if k is not None:
                    for k2 in ks:
                        self._readers[k] |= 1 << k2
        return self._readers

    def cone(self, root: Any, cut: frozenset[str] = frozenset()) -> tuple[list[int], set]:
        """The equations ``root`` depends on (in program order) and the inputs it reaches; the outputs of
        equations whose primitive is in ``cut`` are leaves too, their equations not followed."""
        if not cut:
            k = self.producer.get(root) if isinstance(root, core.Var) else None
            if k is None:
                return [], ({root} if root in self.inputs else set())
            eqn_bits, leaf_bits, inputs = self._cones()
            return _positions(eqn_bits[k]), {inputs[i] for i in _positions(leaf_bits[k])}
        eqns: set[int] = set()
        leaves: set = set()
        stack = [root]
        seen: set = set()
        while stack:
            v = stack.pop()
            if not isinstance(v, core.Var) or v in seen:
                continue
            seen.add(v)
            k = self.producer.get(v)
            if k is not None and self.jaxpr.eqns[k].primitive.name in cut:
                leaves.add(v)
                continue
            if k is None:
                if v in self.inputs:
                    leaves.add(v)
                continue
            if k not in eqns:
                eqns.add(k)
                stack.extend(self.jaxpr.eqns[k].invars)
        return sorted(eqns), leaves

    def ordered(self, leaves: set) -> list[Any]:
        """``leaves`` in a fixed order: the step's constants and inputs as it takes them, then computed values
        in program order."""
        order = list(self.jaxpr.constvars) + list(self.jaxpr.invars)
        order += [w for e in self.jaxpr.eqns for w in e.outvars]
        return [x for x in order if x in leaves]


def _positions(bits: int) -> list[int]:
    """The positions of the set bits of ``bits``, ascending (``bin``'s digits, lowest first, read at once)."""
    return np.flatnonzero(np.frombuffer(bin(bits)[:1:-1].encode(), np.uint8) == ord("1")).tolist()


def _backward_shaped(graph: _Graph, root: Any, cone: set, shapes: set) -> bool:
    """Does a value outside the cone, computed from what the cone computed (not from ``root`` alone: JAX's
    backward reads the forward's residuals), have the shape and dtype of a float leaf, as a gradient would?"""
    jaxpr = graph.jaxpr
    eqns, readers = jaxpr.eqns, graph.readers
    # the equations outside the cone that read a value of it other than root: each equation's readers as a bit
    # set (made once), OR-ed over the cone, less the cone; root's producer's other outputs are read one by one
    read_by = graph.reader_bits()
    made = graph.producer.get(root)
    bits = 0
    inside = 0
    for k in cone:
        inside |= 1 << k
        if k != made:
            bits |= read_by[k]
    if made is not None:
        for w in eqns[made].outvars:
            if w is not root:
                for k2 in readers.get(w, ()):
                    bits |= 1 << k2
    frontier = _positions(bits & ~inside)
    seen: set[int] = set()
    while frontier:
        k = frontier.pop()
        if k in seen:
            continue
        seen.add(k)
        for w in jaxpr.eqns[k].outvars:
            if (tuple(w.aval.shape), w.aval.dtype) in shapes:
                return True
            frontier.extend(k2 for k2 in graph.readers.get(w, ()) if k2 not in cone)
    return False


def _scales_an_array(graph: _Graph, v: Any) -> bool:
    """Does ``v``, through scalar arithmetic, reach an operation that computes an array?"""
    jaxpr, frontier, seen = graph.jaxpr, [v], set()
    while frontier:
        for k in graph.readers.get(frontier.pop(), ()):
            if k in seen:
                continue
            seen.add(k)
            outs = jaxpr.eqns[k].outvars
            if any(w.aval.shape for w in outs):
                return True
            frontier.extend(outs)
    return False


def candidates(graph: _Graph) -> list[tuple[Any, list[int], list[Any]]]:
    """Scalar float values that may be a loss with its gradients in the step, most likely first:
    ``(value, cone equations, leaves in input order)``."""
    jaxpr = graph.jaxpr
    order = list(jaxpr.constvars) + list(jaxpr.invars)
    found = []
    for e in jaxpr.eqns:
        for v in e.outvars:
            if not _scalar_float(v):
                continue
            eqns, leaves = graph.cone(v)
            if len(eqns) < 2:
                continue
            float_leaves = [x for x in order if x in leaves and is_float(x.aval)]
            if not float_leaves:
                continue
            shapes = {(tuple(x.aval.shape), x.aval.dtype) for x in float_leaves}
            if not _backward_shaped(graph, v, set(eqns), shapes):
                continue
            # a loss is read only by scalar arithmetic (logged, returned, averaged); a gradient's norm (or a
            # partial sum of one) scales the update, an array, through scalar arithmetic: such values are tried
            # last
            found.append((_scales_an_array(graph, v), -len(eqns), v, eqns, [x for x in order if x in leaves]))
    found.sort(key=lambda t: (t[0], t[1]))
    return [(v, eqns, leaves) for _, _, v, eqns, leaves in found]


# ---------------------------------------------------------------------- re-derivation and proof
def cone_program(graph: _Graph, root: Any, eqns: Sequence[int], leaves: Sequence[Any],
                 consts: dict) -> core.ClosedJaxpr:
    """The cone as a program of its leaves (the step's constants among them stay constants)."""
    cvars = [v for v in leaves if v in consts]
    ivars = [v for v in leaves if v not in consts]
    jaxpr = core.new_jaxpr(cvars, ivars, [root], [graph.jaxpr.eqns[k] for k in eqns], core.no_effects, BUILT_DEBUG)
    return core.ClosedJaxpr(jaxpr, [consts[v] for v in cvars])


def rederive(cone: core.ClosedJaxpr, dif: Sequence[int]) -> tuple[core.ClosedJaxpr, core.ClosedJaxpr | None]:
    """``leaves -> (L, dL/dleaf for the leaves at dif)``: JAX's own VJP of the cone, traced, seeded with 1; and the
    joint program it was seeded from, ``(leaves, cotangent) -> (L, gradients)`` as :func:`joint_program` traces it
    (``None`` where it was traced seeded instead).

    A cone of one float, not weakly typed, output, differentiated at every float leaf (``dif``, as the caller
    makes it), is traced once as that joint program, which the loss-first program's decision between derivatives
    holds JAX's as written to (``grad.vjp.decided_jointly``), and seeded by evaluating it at a cotangent of 1: the
    same program, bit for bit, as ``jax.vjp`` seeded with 1 as it is traced (checked on the LM steps, the
    transformer step, numpyro's and jax_md's), for a trace of the joint's equations rather than a second of
    ``jax.vjp`` (flax_lm_step: 0.06-0.09 s of its first call). Other cones are traced seeded, as before."""
    specs = [spec_of(a) for a in cone.in_avals]
    (L,) = cone.out_avals if len(cone.out_avals) == 1 else (None,)
    if L is None or not is_float(L) or getattr(L, "weak_type", False) or list(dif) != float_positions(cone)[0]:
        return jax.make_jaxpr(value_and_grads(core.jaxpr_as_fun(cone), dif))(*specs), None
    joint = joint_program(cone, dif)[0]
    return seeded_from(joint, cone), joint


def seeded_from(joint: core.ClosedJaxpr, cone: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """``leaves -> (L, gradients)``: the joint program ``joint`` of ``cone`` (``(leaves, cotangent) -> (L,
    gradients)``) evaluated at a cotangent of 1, traced. A function of ``joint`` and of the cone's types alone: the
    same ``joint`` and ``cone`` give the same program (:func:`rederive` and :func:`replace` trace it so), which is
    why :func:`replace` reads :func:`rederive`'s where the loss-first program is the same ``joint``. Built from
    ``joint``'s equations where that is the program the trace makes (:func:`rewrite.grad.seed.seeded_edit`)."""
    edited = seeded_edit(joint, cone)
    return edited if edited is not None else seeded_by_trace(joint, cone)


def seeded_by_trace(joint: core.ClosedJaxpr, cone: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """:func:`seeded_from`'s program, traced: ``jax.make_jaxpr`` of ``joint`` evaluated at a cotangent of 1."""
    L = cone.out_avals[0]

    def seeded(*xs: Any) -> list[Any]:
        return core.jaxpr_as_fun(joint)(*xs, jax.numpy.ones(L.shape, L.dtype))

    return jax.make_jaxpr(seeded)(*[spec_of(a) for a in cone.in_avals])


def value_and_grads(fn: Callable[..., Any], positions: Sequence[int]) -> Callable[..., list[Any]]:
    """``xs -> [L, dL/dxs[i] for i in positions]`` for ``L = fn(*xs)[0]``, by ``jax.vjp`` seeded with 1."""
    def joint(*xs: Any) -> list[Any]:
        def of(*fl: Any) -> Any:
            ys = list(xs)
            for i, v in zip(positions, fl):
                ys[i] = v
            return fn(*ys)[0]
        out, pullback = jax.vjp(of, *[xs[i] for i in positions])
        return [out] + list(pullback(jax.numpy.ones_like(out)))

    return joint


def prove(step: core.ClosedJaxpr, graph: _Graph, root: Any, cone: core.ClosedJaxpr, leaves: Sequence[Any],
          dif: Sequence[int], derived: core.ClosedJaxpr, proof: Callable[[core.ClosedJaxpr], list[Any]],
          shared: ProofGraph | None = None) -> tuple[bool, dict[Any, int]]:
    """Is ``root`` the re-derived loss, and which of the step's values are its re-derived gradients?

    ``proof(program)`` loads a program into an e-graph, saturates it, and returns its outputs' e-classes.
    ``shared``, where given, is the step (its equations as :func:`proof_graph` makes them) loaded once with no
    rule for all the proofs over it: the re-derived program is loaded into it instead (``proof`` saturates with no
    rule too, so the classes are the same). Returns ``(loss proven, {step value: position in dif})``.
    """
    jaxpr = step.jaxpr
    inside = {w for e in cone.jaxpr.eqns for w in e.outvars}
    shapes = {(tuple(leaves[i].aval.shape), leaves[i].aval.dtype) for i in dif}
    candidates = [w for e in jaxpr.eqns for w in e.outvars
                  if w not in inside and isinstance(w, core.Var) and (tuple(w.aval.shape), w.aval.dtype) in shapes]
    if shared is not None:
        plain = derived.jaxpr.replace(eqns=[without_empty_mesh(e) for e in derived.jaxpr.eqns])
        mine, derived_cls = shared.classes([root] + candidates, core.ClosedJaxpr(plain, derived.consts), leaves)
        loss_cls, cand_cls = mine[0], mine[1:]
        grads = {c: j for j, c in enumerate(derived_cls[1:])}
        found = {w: grads[c] for w, c in zip(candidates, cand_cls) if c in grads}
        return loss_cls == derived_cls[0], found
    eqns = list(jaxpr.eqns)
    constvars, consts = list(jaxpr.constvars), list(step.consts)
    outs = inline(eqns, derived.jaxpr, derived.consts, list(leaves), constvars, consts)
    eqns = [without_empty_mesh(e) for e in eqns]
    program = core.ClosedJaxpr(core.new_jaxpr(constvars, list(jaxpr.invars), [root] + candidates + outs, eqns,
                                              jaxpr.effects, BUILT_DEBUG), consts)
    classes = proof(program)
    loss_cls, cand_cls, derived_cls = classes[0], classes[1:1 + len(candidates)], classes[1 + len(candidates):]
    grads = {c: j for j, c in enumerate(derived_cls[1:])}
    found = {w: grads[c] for w, c in zip(candidates, cand_cls) if c in grads}
    return loss_cls == derived_cls[0], found


def proof_graph(step: core.ClosedJaxpr, model: Any = None) -> ProofGraph:
    """``step`` loaded once, as :func:`prove` loads it, for every proof over it (:class:`ProofGraph`); ``model``,
    where given, prices it as loaded (``ProofGraph.price``), where that is ``step``'s price: no sharding made
    plain, or only converts' that merge no term (:func:`rewrite.jaxpr.edit.loads_alike`)."""
    jaxpr = step.jaxpr
    eqns = [without_empty_mesh(e) for e in jaxpr.eqns]
    same = all(a is b for a, b in zip(eqns, jaxpr.eqns)) or loads_alike(eqns, jaxpr.eqns)
    return ProofGraph(core.ClosedJaxpr(jaxpr.replace(eqns=eqns), step.consts), model if same else None)


#: How a micro-batch's loss built on its core is named (:func:`rewrite.grad.alike.parted`).
PARTED = ", its cone cut where the micro-batches part"


# ---------------------------------------------------------------------- replacement
def replace(step: core.ClosedJaxpr, root: Any, leaves: Sequence[Any], consts: dict, cone: core.ClosedJaxpr,
            dif: Sequence[int], found: dict[Any, int], loss_first: Callable[[core.ClosedJaxpr], core.ClosedJaxpr],
            made: set, joint: core.ClosedJaxpr | None = None,
            derived: core.ClosedJaxpr | None = None) -> core.ClosedJaxpr:
    """``step`` with ``root`` and the values in ``found`` read from the loss-first program instead:
    ``loss_first(cone, wrt=..., value=...)``, the VJP of the cone's forward rewritten, ``(leaves, cotangent) ->
    (L, gradients)``, seeded with 1, chosen for what the step reads of it: the gradients of those float leaves
    alone, and ``L`` or not (``jax.grad`` drops it, ``jax.value_and_grad`` keeps it). ``joint``, where given, is
    JAX's joint program of the cone as written at every float leaf (:func:`rederive`'s): where the step reads
    every gradient it is that of ``wrt``, and ``loss_first`` receives it as ``written`` rather than tracing it.
    ``derived``, where given, is :func:`rederive`'s program seeded from ``joint``: where ``loss_first`` keeps
    ``joint`` itself (its decision kept JAX's derivative of the loss as written: flax_transformer_step,
    flax_bf16_step), that is the program seeded here, not traced again (:func:`seeded_from`)."""
    reads = sorted(set(found.values()))  # positions among ``dif``
    wrt = [dif[j] for j in reads]
    written = {"written": joint} if joint is not None and wrt == list(dif) else {}
    if joint is not None and not written:  # (uses.sliced: numpyro_eight_schools reads four of five gradients)
        written = {"held": sliced(joint, len(cone.out_avals), dif, wrt)}
    vjp = loss_first(cone, wrt=wrt, value=root in _read(step.jaxpr, {root, *found}), **written)
    # the cone program takes its constants first as inputs here, so that all leaves are arguments
    lifted = [v for v in leaves if v in consts] + [v for v in leaves if v not in consts]
    program = derived if derived is not None and vjp is joint else seeded_from(vjp, cone)
    jaxpr = step.jaxpr
    eqns: list = []
    constvars, cvals = list(jaxpr.constvars), list(step.consts)
    outs = inline(eqns, program.jaxpr, program.consts, lifted, constvars, cvals)
    made.update(w for e in eqns for w in e.outvars)
    env = {root: outs[0]}
    for w, j in found.items():
        env[w] = outs[1 + reads.index(j)]
    eqns = in_order(eqns + [substitute(e, env) for e in jaxpr.eqns])
    new = core.new_jaxpr(constvars, list(jaxpr.invars), [read(env, a) for a in jaxpr.outvars], eqns, jaxpr.effects,
                         jaxpr.debug_info)
    return dce(core.ClosedJaxpr(new, cvals))


def _read(jaxpr: core.Jaxpr, cut: set) -> set:
    """The values ``jaxpr``'s outputs read once the values in ``cut`` are read from elsewhere: an equation that
    makes only such values is not walked through."""
    need = {v for v in jaxpr.outvars if isinstance(v, core.Var)}
    for e in reversed(jaxpr.eqns):
        if any(w in need and w not in cut for w in e.outvars):
            need.update(v for v in e.invars if isinstance(v, core.Var))
    return need


def _attempt(step: core.ClosedJaxpr, graph: _Graph, root: Any, eqns: list[int], leaves: list[Any], consts: dict,
             proof: Callable[[core.ClosedJaxpr], list[Any]], shared: Callable[[], ProofGraph] | None = None,
             left_as_written: Callable[[core.ClosedJaxpr], None] | None = None) -> tuple[str, tuple | None]:
    """Re-derive the cone ``eqns`` of ``root`` over ``leaves`` and prove it: ``("", (lifted leaves, cone program,
    differentiable positions, {step value: gradient position}, its joint program or None, its seeded program:
    :func:`rederive`))``, or why not and ``None``. ``shared()``, where given, is the step loaded once for all the
    proofs over it (:func:`proof_graph`). ``left_as_written(cone)``, where given (:func:`find_losses`'s), raises
    :class:`AsWritten` before the re-derivation where the loss-first build would leave the cone as written whatever
    the proof says: its forward, rewritten first, comes out as written (jaxmd_lj_forces:
    the trace of its joint and its proof, a quarter of its first call, were spent on a loss then left as written).
    Not for a cone cut at loop outputs, tried where the whole cone failed its proof: there the proof fails again
    more often than not, and a forward rewritten before it is spent (blackjax_hmc_step: five pipelines)."""
    cone = cone_program(graph, root, eqns, leaves, consts)
    lifted = [v for v in leaves if v in consts] + [v for v in leaves if v not in consts]
    flat_cone = core.ClosedJaxpr(core.new_jaxpr([], lifted, cone.jaxpr.outvars, cone.jaxpr.eqns, core.no_effects,
                                                BUILT_DEBUG), [])
    dif = [i for i, v in enumerate(lifted) if is_float(v.aval)]
    body = None if shared is None else shared().body_between(root, lifted)
    if body is not None:  # its re-derivation's loss could never be proven the step's: not made
        return (f"not proven equal to its re-derivation, which was not made: its cone runs through a {body} body, "
                "which the proof cannot match yet (jax.grad(rewrite(loss)) rewrites such a loss's derivative)"), None
    if left_as_written is not None:
        left_as_written(flat_cone)
    try:
        derived, joint = rederive(flat_cone, dif)
        same, found = prove(step, graph, root, flat_cone, lifted, dif, derived, proof,
                            None if shared is None else shared())
    except Exception as e:  # a cone JAX cannot differentiate (an integer loss, a custom rule)
        return f"its VJP could not be re-derived ({type(e).__name__}: {e})", None
    if not same:
        return "not proven equal to its re-derivation", None
    if not found:
        return "the step holds no value proven to be its gradient", None
    return "", (lifted, flat_cone, dif, found, joint, derived)


def find_losses(closed: core.ClosedJaxpr, proof: Callable[[core.ClosedJaxpr], list[Any]],
                loss_first: Callable[[core.ClosedJaxpr], core.ClosedJaxpr], pinned: set | None = None,
                over: Callable[[core.ClosedJaxpr], ProofGraph] | None = None, price: bool = False,
                left_as_written: Callable[[core.ClosedJaxpr], Any] | None = None
                ) -> tuple[core.ClosedJaxpr | None, StepFinding]:
    """The step with each proven loss and its gradients read from the loss-first program; ``None`` if none was
    proven. ``loss_first(cone)`` is the loss-first program of a loss's forward program (its leaves the inputs):
    ``(leaves, cotangent) -> (L, gradients of the float leaves)``. ``pinned``, where given, receives the values
    the returned step's top-level equations from a loss-first program compute
    (:func:`rewrite.grad.pinned.split_pinned`). ``over``, where ``proof`` saturates with no rule, is
    :func:`proof_graph`: the candidates' proofs then load the step once (per step, as its losses are replaced),
    not once each. ``price``: where the first loss replaced is in ``closed`` as given, ``StepFinding.price`` is its
    price read off that load (``ProofGraph.price``; its caller prices the step as written: not loaded again).
    ``left_as_written(cone)``, where given, raises :class:`AsWritten` where ``loss_first`` would leave ``cone`` as
    written: asked of a whole cone before its re-derivation and proof (:func:`_attempt`); not of a loop's body."""
    t0 = time.perf_counter()
    finding = StepFinding()
    if closed.jaxpr.effects:
        finding.declined.append("the step has effects")
        return None, finding
    step = unwrap(closed)
    changed = False
    tried: set = set()
    made: set = set()  # the values the replacements compute
    left: set = set()  # the values of the losses left as written (``AsWritten``): no scalar among them is tried
    failed = 0  # candidates tried and not proven: a replaced loss does not spend the budget finding the next needs
    queued: list = []  # the parts of the sums tried (:func:`parts`), tried before the other candidates
    shared: list[ProofGraph] = []  # the step as it is now, loaded for the proofs over it (at the first)

    def loaded() -> ProofGraph:
        if not shared:
            shared.append(over(step))  # type: ignore[misc]
        return shared[0]

    def unload() -> None:  # the step is replaced, or the search is over
        while shared:
            shared.pop().release()

    built: dict[tuple, tuple[Any, Any]] = {}  # (core, wrt, value) -> (the core, kept alive; its loss-first program)

    def loss_first_once(cone: core.ClosedJaxpr, base: Any = None, **kw: Any) -> core.ClosedJaxpr:
        """``loss_first``, once per core: ``base``, where given, the core ``cone`` computes (grad/alike.py)."""
        base = cone if base is None else base
        key = (id(base), tuple(kw.get("wrt") or ()), kw.get("value"))
        if key not in built:
            built[key] = (base, loss_first(cone, **kw))
        return built[key][1]

    try:
        graph: _Graph | None = None
        while len(finding.replaced) < MAX_LOSSES and failed < MAX_TRIES:
            if graph is None:  # the step as it is now, and its candidates
                graph = _Graph(step.jaxpr)
                consts = dict(zip(step.jaxpr.constvars, step.consts))
                found = {c[0]: c for c in candidates(graph)}
                order = list(found)
            # the parts of a sum that failed come first, then the candidates in their order; one not tried whose
            # cone reads no replacement (its loss is the loss-first program's own)
            root = next((v for v in queued + order if v in found and v not in tried and v not in left
                         and not any(w in made for k in found[v][1] for w in graph.jaxpr.eqns[k].outvars)), None)
            if root is None:
                break
            _, eqns, leaves = found[root]
            tried.add(root)
            cut = graph.cone(root, LOOPS)
            tries_here = [(eqns, leaves, "")]
            if cut[0] != eqns and len(cut[0]) >= 2:  # a loop in the cone: its outputs as leaves, if the whole fails
                tries_here.append((cut[0], graph.ordered(cut[1]), ", its cone cut at loop outputs"))
            others = [v for v in queued if v is not root and v in found and v not in tried]  # the sum's other parts
            part, later = parted(graph.jaxpr.eqns, graph.producer, root, others, eqns, graph.ordered)
            if part is not None:  # a micro-batch's loss: built on what it computes alike with the next (grad/alike.py)
                tries_here[0] = (part.eqns, part.leaves, PARTED)
            for cone_eqns, cone_leaves, how in tries_here:
                found_grads: dict = {}  # (none known where the loss is left as written before its proof)
                try:
                    said, done = _attempt(step, graph, root, cone_eqns, cone_leaves, consts, proof,
                                          None if over is None else loaded,
                                          None if how and how != PARTED else left_as_written)
                    if done is None:
                        finding.declined.append(f"a scalar of {len(cone_eqns)} equations{how}: {said}")
                        continue
                    lifted, flat_cone, dif, found_grads, joint, derived = done
                    if price and step is closed and shared:  # the step as given, loaded for its proofs: priced so
                        finding.price = shared[0].price(closed.jaxpr.outvars)
                    twins_done: list = []  # the later parts that compute this core, proven on this step's load
                    if how == PARTED:
                        b = Built(flat_cone, lifted, frozenset(v for v in lifted if v in consts), dif, joint, derived)
                        twins_done = [(o, again) for o, tw in later.items() if (again := reused(
                            step, graph, o, b, tw, consts, made, proof, None if over is None else loaded, prove))]
                    unload()
                    step = replace(step, root, lifted, consts, flat_cone, dif, found_grads, loss_first_once, made,
                                   joint, derived)
                    for o, (_, o_lifted, flat, o_grads) in twins_done:  # each reads the core's program
                        step = replace(step, o, o_lifted, consts, flat, b.dif, o_grads,
                                       functools.partial(loss_first_once, base=b.cone), made, b.joint, b.derived)
                        tried.add(o)
                except AsWritten as e:  # this loss is left as written, and the scalars its forward and its
                    # gradients compute (whose own gradients the step does not hold): the search goes on to the rest
                    finding.declined.append(f"a scalar of {len(cone_eqns)} equations{how}: {e}")
                    # its forward and JAX's backward of it, as the step holds them, and its twins' (the same program)
                    for v in [root, *found_grads, *(later if how == PARTED else ())]:
                        left.update(w for k in graph.cone(v)[0] for w in graph.jaxpr.eqns[k].outvars)
                    if not found_grads:  # left before its proof: the backward's unknown, what reads its forward left
                        left.update(w for e in graph.jaxpr.eqns if any(x in left for x in e.invars if
                                                                       isinstance(x, core.Var)) for w in e.outvars)
                    break
                finding.replaced.append(f"a loss of {len(cone_eqns)} equations{how} and its gradients with "
                                        f"respect to {len(set(found_grads.values()))} of {len(dif)} float inputs")
                finding.replaced += [f"a loss of {len(e)} equations, an earlier micro-batch's program, and its "
                                     f"gradients with respect to {len(set(g.values()))} of {len(dif)} float inputs"
                                     for _, (e, _, _, g) in twins_done]
                changed, graph = True, None
                break
            else:  # not proven: a sum of losses is tried as its parts next
                failed += 1
                queued[:0] = parts(graph, root)
    finally:
        unload()
    for search in (lambda s: find_loop_vjps(s, proof, loss_first, finding.replaced, finding.declined),
                   lambda s: _in_loops(s, proof, loss_first, finding, over)):
        found_in = search(step)
        if found_in is not None:  # the loops made or edited hold loss-first programs: pinned as they are
            made.update(new_loops(step, found_in, BODIES))
            step, changed = found_in, True
    if pinned is not None and changed:
        pinned.update(made)
    finding.seconds = time.perf_counter() - t0
    log.info("whole step: %s (%.2f s)", finding, finding.seconds)
    return (step if changed else None), finding


#: The param that holds a loop's body, by primitive: a loss and its gradients inside one (gradient accumulation over
#: micro-batches, a ``scan`` or ``fori_loop`` that sums ``jax.grad`` of the loss) are sought there.
BODIES = {"scan": "jaxpr", "while": "body_jaxpr"}


def _in_loops(step: core.ClosedJaxpr, proof: Callable[[core.ClosedJaxpr], list[Any]],
              loss_first: Callable[[core.ClosedJaxpr], core.ClosedJaxpr], finding: StepFinding,
              over: Callable[[core.ClosedJaxpr], ProofGraph] | None = None) -> core.ClosedJaxpr | None:
    """``step`` with the losses found in its loops' bodies replaced there (a body is searched as a step of its
    own: its inputs are the leaves), or ``None`` if none was."""
    eqns = list(step.jaxpr.eqns)
    changed = False
    for k, e in enumerate(eqns):
        key = BODIES.get(e.primitive.name)
        if key is None:
            continue
        # (without ``left_as_written``: a body's whole cone fails its proof more often, blackjax_hmc_step's two)
        body, inner = find_losses(e.params[key], proof, loss_first, over=over)
        if body is None:
            continue
        where = f", in a {e.primitive.name} body"
        finding.replaced += [r + where for r in inner.replaced]
        finding.declined += [d + where for d in inner.declined]
        eqns[k] = e.replace(params={**e.params, key: body})
        changed = True
    if not changed:
        return None
    jaxpr = step.jaxpr
    return core.ClosedJaxpr(core.new_jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqns, jaxpr.effects,
                                           jaxpr.debug_info), step.consts)


__all__ = ["StepFinding", "find_losses", "unwrap"]
