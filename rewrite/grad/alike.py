"""Micro-batches' losses that are one program: the loss-first program built once for all of them.

A step that accumulates gradients over micro-batches in a Python loop (``for mb in range(k): value_and_grad(loss)(
params, batch[mb])``, summed in the step's own order) holds ``k`` copies of one loss, each reading its own part of the
batch. The whole-step search (``grad/step.py``) replaces each with a loss-first program; each loss's cone is the same
program but where it reads its micro-batch (``split``'s ``k``-th output, a ``slice`` at another start) or a constant
made apart, so each was saturated, extracted and decided afresh: ``k`` times one loss's rewrite
(``benchmarks.wholestep``'s ``linen_unroll4``: twelve pipelines, four copies of ``linen_gpt``'s three).

:func:`lockstep` walks two losses' cones from their roots together. Where their equations are the same (primitive,
params compared as values, literals, types) and read their operands alike, they are one program; where they part, the
two values are leaves. The first micro-batch's cone is cut there, and its loss-first program built on that core;
each later part whose cone computes that same core, equation for equation, on values of its own (:func:`parted`,
both found then) is proven at once, in the same step and on the same re-derivation, and reads the same loss-first
program with its own leaves (:func:`reused`, from ``grad/step.py``'s ``find_losses``). Each pair of equations is
compared whole, so the two compute one function of their leaves: the program built for the first is the second's.
The loops that hold loss-first programs are pinned for the step's rest (:func:`new_loops`), and a sum's parts
(:func:`parts`) are found here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from ..ir.jaxapi import BUILT_DEBUG, core
from ..ir.primitives import is_float


@dataclasses.dataclass(frozen=True)
class Core:
    """A loss's cone cut where it parts from another's: the step's equations (their positions, in program order) and
    the leaves, the step's values the equations read and do not compute (in the step's order)."""

    eqns: list[int]
    leaves: list[Any]


@dataclasses.dataclass
class Built:
    """A micro-batch loss replaced on its core: what a later loss of the same core reuses. ``cone``: the core as a
    program of ``lifted`` (``grad/step.py``'s ``flat_cone``); ``dif``, ``joint`` and ``derived`` its re-derivation."""

    cone: core.ClosedJaxpr
    lifted: list[Any]
    consts: frozenset
    dif: list[int]
    joint: core.ClosedJaxpr | None
    derived: core.ClosedJaxpr


def _same_value(a: Any, b: Any) -> bool:
    try:
        x, y = np.asarray(a), np.asarray(b)
    except Exception:
        return a is b
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def same_eqn(a: core.JaxprEqn, b: core.JaxprEqn) -> bool:
    """The same operation, whatever its variables: primitive, params (equal as values: a body or a function is equal
    only to itself), types, literal operands, effects."""
    if a is b:
        return True
    if (a.primitive is not b.primitive or len(a.invars) != len(b.invars) or len(a.outvars) != len(b.outvars)
            or a.effects != b.effects or any(x.aval != y.aval for x, y in zip(a.outvars, b.outvars))):
        return False
    if a.params.keys() != b.params.keys() or not all(_same_param(a.params[k], b.params[k]) for k in a.params):
        return False
    for x, y in zip(a.invars, b.invars):
        lx, ly = isinstance(x, core.Literal), isinstance(y, core.Literal)
        if lx != ly or (lx and (x.aval != y.aval or not _same_value(x.val, y.val))):
            return False
    return True


def _same_param(x: Any, y: Any) -> bool:
    """Params equal as values; a body equal to another written alike (:func:`same_jaxpr`: the step's bodies are
    made anew where an edit of the step rewrites them, ``jaxpr/dce.py``)."""
    if x is y:
        return True
    if isinstance(x, core.ClosedJaxpr) and isinstance(y, core.ClosedJaxpr):
        return (len(x.consts) == len(y.consts) and all(_same_value(c, d) for c, d in zip(x.consts, y.consts))
                and same_jaxpr(x.jaxpr, y.jaxpr))
    if isinstance(x, core.Jaxpr) and isinstance(y, core.Jaxpr):
        return same_jaxpr(x, y)
    if type(x) in (tuple, list) and type(y) is type(x):
        return len(x) == len(y) and all(_same_param(a, b) for a, b in zip(x, y))
    try:
        return bool(x == y)
    except Exception:  # (an array, whose == is not one truth value)
        return False


def same_jaxpr(a: core.Jaxpr, b: core.Jaxpr) -> bool:
    """Two bodies that are one program: their equations the same operations (:func:`same_eqn`), in the same order,
    reading values in the same places."""
    if (len(a.constvars) != len(b.constvars) or len(a.invars) != len(b.invars) or len(a.eqns) != len(b.eqns)
            or len(a.outvars) != len(b.outvars) or a.effects != b.effects):
        return False
    env: dict[Any, Any] = {}
    for x, y in zip(list(a.constvars) + list(a.invars), list(b.constvars) + list(b.invars)):
        if x.aval != y.aval:
            return False
        env[x] = y
    for ea, eb in zip(a.eqns, b.eqns):
        if not same_eqn(ea, eb) or any(not isinstance(x, core.Literal) and env.get(x) is not y
                                        for x, y in zip(ea.invars, eb.invars)):
            return False
        env.update(zip(ea.outvars, eb.outvars))
    return all(env.get(x) is y if not isinstance(x, core.Literal) else
               isinstance(y, core.Literal) and x.aval == y.aval and _same_value(x.val, y.val)
               for x, y in zip(a.outvars, b.outvars))


def lockstep(eqns: Sequence[core.JaxprEqn], made: dict, a_root: Any, b_root: Any
             ) -> tuple[dict[int, int], dict[Any, Any], list[Any]] | None:
    """Two values' cones in one program (``eqns``; ``made``: each value's equation) walked from ``a_root`` and
    ``b_root`` together: ``(pairs, leaves, values)``, the equations of ``a``'s cone paired one to one with ``b``'s that
    are the same operation on operands paired alike, the values where they part (``a``'s to ``b``'s, one to one),
    and for each of ``b``'s equations paired a value of it the walk read (the step keeps such a value whatever
    edits drop of its other outputs); ``None`` where the walk pairs one value or equation with two."""
    pairs: dict[int, int] = {}
    taken: dict[int, Any] = {}  # b's equations paired, each with the value of it the walk met first
    leaves: dict[Any, Any] = {}
    leaf_of: dict[Any, Any] = {}
    stack = [(a_root, b_root)]
    while stack:
        va, vb = stack.pop()
        if isinstance(va, core.Literal) or isinstance(vb, core.Literal):
            continue  # (compared with their equation)
        ka, kb = made.get(va), made.get(vb)
        if ka is not None and kb is not None:
            ea, eb = eqns[ka], eqns[kb]
            at = ea.outvars.index(va)
            if ka in pairs:
                if pairs[ka] != kb or eb.outvars.index(vb) != at:
                    return None
                continue
            if kb not in taken and eb.outvars.index(vb) == at and same_eqn(ea, eb):
                pairs[ka] = kb
                taken[kb] = vb
                stack.extend(zip(ea.invars, eb.invars))
                continue
        if va in leaves or vb in leaf_of:
            if leaves.get(va) is not vb:
                return None
            continue
        if va.aval != vb.aval:
            return None
        leaves[va], leaf_of[vb] = vb, va
    return pairs, leaves, list(taken.values())


@dataclasses.dataclass(frozen=True)
class Twin:
    """A later part of the sum found, in the step the first part's core was cut from, to compute that core:
    ``values``, a value of each of its equations that do (the step keeps them whatever a replacement edits), and
    ``leaves``, the first part's leaves to its own."""

    values: list[Any]
    leaves: dict[Any, Any]


def parted(eqns: Sequence[core.JaxprEqn], made: dict, root: Any, others: Sequence[Any], cone: Sequence[int],
           ordered: Callable[[set], list]) -> tuple[Core | None, dict[Any, Twin]]:
    """``root``'s cone (the step's equations ``cone``) cut where it parts from the first of ``others`` (the sum's
    other parts, :func:`lockstep`), where the two compute at least half of it apart (an equation paired with itself,
    read by both, stays in each), and those of ``others`` whose cones compute that core: walked from the two roots
    together, they pair exactly its equations and part exactly at its leaves (the first among them). ``(None, {})``
    where there is no such core. ``ordered``: the step's values of a set in the step's order (``_Graph.ordered``)."""
    first = lockstep(eqns, made, root, others[0]) if others else None
    if first is None:
        return None, {}
    pairs, leaves, _ = first
    order = ordered(set(leaves))
    own = set(pairs) - set(pairs.values())
    if len(own) < max(2, len(cone) // 2) or not set(pairs) <= set(cone) or len(order) != len(leaves):
        return None, {}
    part = Core(sorted(pairs), order)
    walks = [(others[0], first)] + [(o, lockstep(eqns, made, root, o)) for o in others[1:]]
    return part, {o: Twin(w[2], w[1]) for o, w in walks
                  if w is not None and set(w[0]) == set(part.eqns) and set(w[1]) == set(part.leaves)}


def reused(step: core.ClosedJaxpr, graph: Any, root: Any, built: Built, twin: Twin, consts: dict, made: set,
           proof: Callable, shared: Callable[[], Any] | None, prove: Callable) -> tuple | None:
    """``(its equations, its inputs, the cone so, the gradients found)`` for ``root``, a ``twin`` of the part whose
    core is ``built``: its core in the step it was found in, proven on ``built``'s re-derivation (``prove``,
    ``grad/step.py``'s, over ``shared()``, the step loaded for the first part's proof: one load for all the parts);
    else ``None`` (it is tried later as any other loss). Not where it reads a value an earlier replacement made
    (``made``): its loss would be that program's own."""
    if any(v not in graph.producer or v in made for v in twin.values) or any(v in made for v in twin.leaves.values()):
        return None
    eqns = sorted({graph.producer[v] for v in twin.values})
    lifted = [twin.leaves[v] for v in built.lifted]
    known = graph.inputs | set(graph.producer)
    if any(w not in known or (v in built.consts) != (w in consts) for v, w in zip(built.lifted, lifted)):
        return None
    if shared is not None and shared().body_between(root, lifted) is not None:
        return None
    flat = core.ClosedJaxpr(core.new_jaxpr([], lifted, [root], [graph.jaxpr.eqns[k] for k in eqns], core.no_effects,
                                           BUILT_DEBUG), [])
    same, found = prove(step, graph, root, flat, lifted, built.dif, built.derived, proof,
                        None if shared is None else shared())
    return (eqns, lifted, flat, found) if same and found else None


def new_loops(before: core.ClosedJaxpr, after: core.ClosedJaxpr, loops: Any) -> list[Any]:
    """The values of ``after``'s loops (primitives of ``loops``) that ``before`` does not hold: the loops a search
    made or whose bodies it edited (``grad/loops.py``'s pair over the rewritten layer, a body's loss replaced). Their
    bodies hold loss-first programs, each rewritten jointly with its forward already: the step's rest pins them as
    it pins a top-level one (``grad/pinned.py``), not saturated again."""
    old = {id(e) for e in before.jaxpr.eqns}
    return [w for e in after.jaxpr.eqns if e.primitive.name in loops and id(e) not in old for w in e.outvars]


def _scalar_float(v: Any) -> bool:
    return isinstance(v, core.Var) and getattr(v.aval, "shape", None) == () and is_float(v.aval)


#: Scalar arithmetic that sums losses (gradient accumulation unrolled by a Python loop: ``total = total + loss``),
#: and that scales a sum (``total / micro``) without being a loss's own (a mean's ``reduce_sum / n`` is not walked).
SUMS = frozenset({"add", "sub", "add_any"})
SCALES = frozenset({"div", "mul", "neg", "convert_element_type"})


def parts(graph: Any, v: Any) -> list[Any]:
    """The scalars ``v`` sums, where it is a sum of scalars (possibly scaled by constants), in program order:
    ``[l0, l1, l2]`` for ``((0 + l0) + l1 + l2) / 3``; ``[]`` where it is not. A step that sums its micro-batches'
    losses in its own order holds no gradient of the sum (it sums the micro-batches' gradients, in that order), so
    the sum is never proven; each micro-batch's loss is."""
    def scalars(w: Any) -> tuple[str, list[Any]] | None:  # its equation's primitive and scalar operands
        k = graph.producer.get(w) if isinstance(w, core.Var) else None
        if k is None or not _scalar_float(w):
            return None
        e = graph.jaxpr.eqns[k]
        ins = [a for a in e.invars if isinstance(a, core.Var)]
        return (e.primitive.name, ins) if all(_scalar_float(a) for a in ins) else None

    def a_sum(w: Any) -> bool:  # a sum, possibly scaled
        while (made := scalars(w)) is not None and made[0] in SCALES and len(made[1]) == 1:
            w = made[1][0]
        return made is not None and made[0] in SUMS

    if not a_sum(v):
        return []
    found: dict = {}  # in the order met (a dict: a set's order would vary between runs)
    stack = [v]  # walked without recursion: a sum may have thousands of terms
    while stack:
        w = stack.pop()
        made = scalars(w)
        if made is not None and made[0] in SUMS:
            stack.extend(made[1])
        elif made is not None and made[0] in SCALES and len(made[1]) == 1 and a_sum(made[1][0]):
            stack.append(made[1][0])
        elif w is not v and _scalar_float(w):
            found[w] = None
    order = {w: k for k, e in enumerate(graph.jaxpr.eqns) for w in e.outvars if w in found}
    return sorted(found, key=lambda w: order.get(w, -1)) if len(found) >= 2 else []  # a stable sort


__all__ = ["Built", "Core", "Twin", "lockstep", "new_loops", "parted", "parts", "reused", "same_eqn"]
