"""How ``rulesets.attention`` reads a matched program's logits: a small plan over leaves, walked off the e-graph.

From the logits ``s`` the walk follows the key axis (the softmax's axis) down
the term, through elementwise operations, broadcasts, transposes, ``iota`` and
the one product ``q k^T``, and records each value it passes as a step with the
key axis's place in it; what it reaches without the key axis is a leaf read
whole, what carries it and is none of those a leaf sliced per block. The
query axis is then placed in every step and leaf (:func:`_query_axes`), so
that the forward can run over blocks of queries too. :func:`_evaluate` runs
the plan for one block of keys (and of queries).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from rewrite import Value
from rulesets import _fused_attention as _fused

#: Elementwise primitives the walk passes through (their operands have the result's shape, or are scalars).
_ELEMENTWISE = frozenset("""add sub mul div neg max min select_n convert_element_type eq ne lt le gt ge and or not
    exp log tanh logistic abs sign integer_pow sqrt rsqrt square stop_gradient copy copy_p pow""".split())


# ---------------------------------------------------------------------- reading the logits off the e-graph
class _Plan:
    """The logits as a small program over leaves, with the key axis of every value it computes.

    ``steps`` are ``(prim, params, args, aval, key)``; an arg is ``("leaf", i)`` or ``("step", j)``;
    ``key`` is the position of the key axis in the value (``None``: it has none). ``leaves`` are the
    values read from outside, each with its key axis (sliced per block) or ``None`` (read whole).
    """

    def __init__(self) -> None:
        self.steps: list[tuple] = []
        self.leaves: list[Value] = []
        self.leaf_keys: list[int | None] = []
        self._seen: dict[Any, tuple] = {}
        self.dots = 0

    def aval(self, ref: tuple) -> Any:
        """The aval of what ``ref`` (a leaf or a step) names."""
        return self.leaves[ref[1]].aval if ref[0] == "leaf" else self.steps[ref[1]][3]

    def leaf(self, v: Value, key: int | None) -> tuple:
        ident = (_ident(v), key)
        if ident not in self._seen:
            self.leaves.append(v)
            self.leaf_keys.append(key)
            self._seen[ident] = ("leaf", len(self.leaves) - 1)
        return self._seen[ident]


def _ident(v: Value) -> Any:
    return v.cls if v.cls is not None else ("name", v.name)


class _Decline(Exception):
    pass


def _walk(plan: _Plan, v: Value, key: int | None, depth: int = 0) -> tuple:
    """The plan's reference to ``v``, whose key axis is at ``key`` (``None``: it has none)."""
    if depth > 64:
        raise _Decline
    if key is None:
        return plan.leaf(v, None)
    memo = (_ident(v), key, "walk")
    if memo in plan._seen:
        return plan._seen[memo]
    shape = v.shape
    ref = None
    for node in v.nodes:
        ref = _step(plan, v, node, key, shape, depth)
        if ref is not None:
            break
    if ref is None:
        ref = plan.leaf(v, key)
    plan._seen[memo] = ref
    return ref


def _operand_axes(prim: str, params: dict, shapes: Sequence[tuple], shape: tuple, ax: int) -> list | None:
    """Where axis ``ax`` of a value of ``shape`` that ``prim`` computes lies in each operand (of ``shapes``):
    an axis, or ``None`` where the operand does not carry it (a scalar, a size-1 axis jax broadcasts, the other
    side of the product); ``None`` for a primitive the walk does not pass through, or an axis it cannot follow
    (a batch axis of the product)."""
    if prim in _ELEMENTWISE:
        # jax broadcasts scalars and size-1 axes of elementwise operands
        if not all(sh == () or (len(sh) == len(shape) and all(a in (b, 1) for a, b in zip(sh, shape)))
                   for sh in shapes):
            return None
        return [ax if sh != () and sh[ax] == shape[ax] else None for sh in shapes]
    if prim == "broadcast_in_dim":
        dims = tuple(params["broadcast_dimensions"])
        return [dims.index(ax) if ax in dims and shapes[0][dims.index(ax)] != 1 else None]
    if prim == "transpose":
        return [tuple(params["permutation"])[ax]]
    if prim == "iota":
        return []
    if prim == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        nb = len(lb)
        lfree = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
        rfree = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
        if ax < nb:
            return None
        return [lfree[ax - nb], None] if ax < nb + len(lfree) else [None, rfree[ax - nb - len(lfree)]]
    return None


def _step(plan: _Plan, v: Value, node: Any, key: int, shape: tuple, depth: int) -> tuple | None:
    if node.prim == "dot_general" and plan.dots:
        return None  # one product q k^T: a second one is read as it is
    params = dict(node.params)
    axes = _operand_axes(node.prim, params, [o.shape for o in node.operands], shape, key)
    if axes is None:
        return None  # not a primitive the walk passes, or the key axis is a batch axis of the product
    if node.prim == "dot_general":
        plan.dots += 1
    args = [_walk(plan, o, a, depth + 1) for o, a in zip(node.operands, axes)]
    return _add(plan, node.primitive, params, args, v.aval, key)


def _add(plan: _Plan, prim: Any, params: dict, args: list, aval: Any, key: int | None) -> tuple:
    plan.steps.append((prim, params, tuple(args), aval, key))
    return ("step", len(plan.steps) - 1)


def _evaluate(steps: Sequence[tuple], leaves: Sequence[Any], leaf_keys: Sequence[Any],
              start: Any, block: int, out: tuple, rows: tuple | None = None) -> Any:
    """The logits for keys ``start .. start + block``: the plan run with every key axis cut to the block (the
    steps that ``out`` reads, each once). ``rows``: ``(step_q, qstart, qblock, leaf_q)``, for the queries ``qstart ..
    qstart + qblock`` (see :func:`_query_axes`): the steps' query axes are cut to them, and so are the leaves that
    carry both axes (a mask, a bias: one block of each at once); the leaves without the key axis come cut."""
    vals: dict[int, Any] = {}

    def read(ref: tuple) -> Any:
        kind, i = ref
        if kind == "leaf":
            x = leaves[i]
            k = leaf_keys[i]
            qa = None if rows is None or k is None else rows[3][i]
            if qa is not None:
                at, size = [jnp.zeros((), start.dtype)] * x.ndim, list(x.shape)
                at[k], at[qa], size[k], size[qa] = start, rows[1].astype(start.dtype), block, rows[2]
                return lax.dynamic_slice(x, at, size)
            return x if k is None else lax.dynamic_slice_in_dim(x, start, block, axis=k)
        if i not in vals:
            vals[i] = run(i, *steps[i])
        return vals[i]

    def run(i: int, p: Any, params: dict, args: tuple, aval: Any, key: int | None) -> Any:
        ops = [read(a) for a in args]
        params = dict(params)
        qax = None if rows is None else rows[0][i]
        if "shape" in params:
            shape = list(params["shape"])
            for ax, size in ((key, block), (qax, None if rows is None else rows[2])):
                if ax is not None:
                    shape[ax] = size
            params["shape"] = tuple(shape)
        if p.name == "iota":
            for ax, first in ((key, start), (qax, None if rows is None else rows[1])):
                if ax is not None and params["dimension"] == ax:
                    return p.bind(**params) + first.astype(params["dtype"])
        res = p.bind(*ops, **params)
        return res[0] if isinstance(res, (list, tuple)) else res

    return read(out)


def _query_axes(plan: _Plan, out: tuple, axis: int) -> tuple[list, list] | None:
    """Where the query axis (``axis`` of the logits ``out``) lies in every leaf and step of the plan: ``(leaf_q,
    step_q)``, each an axis or ``None`` (the value does not carry it: read whole, or broadcast along it). ``None``
    where a value would carry it in two places, or the product's batch axis or key side carries it."""
    leaf_q: dict[int, int | None] = {}
    step_q: dict[int, int | None] = {out[1]: axis} if out[0] == "step" else {}
    if out[0] == "leaf":
        leaf_q[out[1]] = axis

    def put(ref: tuple, ax: int | None) -> bool:
        table = leaf_q if ref[0] == "leaf" else step_q
        if ref[1] in table and table[ref[1]] != ax:
            return False
        table[ref[1]] = ax
        return True

    for i in reversed(range(len(plan.steps))):
        if i not in step_q:
            continue
        prim, params, args, aval, key = plan.steps[i]
        ax = step_q[i]
        shapes = [plan.aval(a).shape for a in args]
        axes = [None] * len(args) if ax is None else _operand_axes(prim.name, params, shapes, aval.shape, ax)
        if axes is None:
            return None  # the queries are a batch axis of the product
        if prim.name == "dot_general" and any(a is not None and k is not None for a, k in zip(
                axes, _operand_axes(prim.name, params, shapes, aval.shape, key))):
            return None  # the queries are on the keys' side of the product
        if not all(put(a, x) for a, x in zip(args, axes)):
            return None
    return ([leaf_q.get(i) for i in range(len(plan.leaves))], [step_q.get(i) for i in range(len(plan.steps))])


def _inverse(perm: Sequence[int]) -> list[int]:
    """Where each axis of a transpose's operand lands in its result."""
    return [list(perm).index(j) for j in range(len(perm))]


def _shift_is_own_max(shift: Value, s: Value, axis: int) -> bool:
    """``shift`` is ``max(s)`` along ``axis``, row by row (maybe under ``max(-inf, .)``, broadcasts,
    transposes and ``stop_gradient``; or the max of ``f`` where ``s`` is ``f`` transposed, as
    ``jax.nn.dot_product_attention`` writes it under ``vmap``)."""
    sources = [(s, list(range(s.ndim)))]  # what the max may be taken of, with its axes' places in s
    node = s.node("transpose")
    if node is not None:
        perm = [int(d) for d in node.params["permutation"]]
        sources.append((node.operands[0], _inverse(perm)))
    v, pos = shift, list(range(s.ndim))  # pos: where each axis of v lies in s
    for _ in range(8):
        for prim in ("stop_gradient", "broadcast_in_dim", "transpose", "max", "reduce_max"):
            node = v.node(prim)
            if node is None:
                continue
            ops = node.operands
            if prim == "reduce_max":
                if len(node.params["axes"]) != 1:
                    return False
                a = int(node.params["axes"][0])
                for src, place in sources:
                    if _ident(ops[0]) != _ident(src) or place[a] != axis:
                        continue
                    rows = [j for j in range(src.ndim) if j != a]
                    if all(pos[i] == place[j] or src.shape[j] == 1 for i, j in enumerate(rows)):
                        return True
                return False
            if prim == "max":
                lit = [o for o in ops if o.literal is not None]
                rest = [o for o in ops if o.literal is None]
                if len(lit) != 1 or len(rest) != 1 or float(lit[0].literal) != -math.inf:
                    continue
                v = rest[0]
            elif prim == "broadcast_in_dim":
                dims = [int(d) for d in node.params["broadcast_dimensions"]]
                v, pos = ops[0], [pos[d] for d in dims]
            elif prim == "transpose":
                perm = [int(d) for d in node.params["permutation"]]
                v, pos = ops[0], [pos[d] for d in _inverse(perm)]
            else:
                v = ops[0]
            break
        else:
            return False
    return False


def _scale_outside(plan: _Plan) -> tuple[tuple, tuple]:
    """The forward's steps with a literal scale of the product ``(q k^T) / c`` (or ``* c``) applied to ``q``, the
    operand read whole: ``(steps, scaled)``, each of ``scaled`` ``(q's leaf, c's leaf, prim)`` an extra leaf
    after the plan's own, computed once before the loop.

    In the loop the scale is its own pass over each block's scores: XLA:CPU's library product does not take
    it in, so the scaled block is written and read again (haiku's ``attn_logits / sqrt(key_size)``: 16 MiB
    per block at N=2048, B=2, H=4). The scale moves where it is a finite literal that makes ``q`` no larger
    (a divisor of magnitude 1 or more, a factor of at most 1), so no element overflows where the original's
    would not; a power of two moves exactly, and any other scale rounds ``q`` once, within the pack's
    tolerance (in float32 and float64 only: in a half-precision dtype it stays in the loop). The backward
    keeps the scale in its loop: with ``q`` scaled outside, haiku's layer's gradient measured 6-10% slower
    (one process, 15 rounds, either order), though its loop makes one pass fewer.
    """
    steps = list(plan.steps)
    scaled: list[tuple[int, int, str]] = []
    uses: dict[int, int] = {}
    for _, _, args, _, _ in steps:
        for a in args:
            if a[0] == "step":
                uses[a[1]] = uses.get(a[1], 0) + 1
    for j, (prim, params, args, aval, key) in enumerate(steps):
        if prim.name not in ("div", "mul") or len(args) != 2:
            continue
        pairs = [(args[0], args[1])] if prim.name == "div" else [(args[0], args[1]), (args[1], args[0])]
        for d_ref, c_ref in pairs:
            if d_ref[0] != "step" or c_ref[0] != "leaf" or uses.get(d_ref[1]) != 1:
                continue
            c = plan.leaves[c_ref[1]]
            dprim, dparams, dargs, daval, dkey = steps[d_ref[1]]
            value = _fused._scalar_value(c)
            if dprim.name != "dot_general" or value is None or not np.isfinite(value) or value == 0:
                continue
            if (abs(value) < 1) if prim.name == "div" else (abs(value) > 1):
                continue
            exact = math.frexp(abs(value))[0] == 0.5  # a power of two scales every element exactly
            if not exact and jnp.finfo(daval.dtype).nmant < 23:
                continue  # rounding q to a half-precision dtype once more is not within the logits' own rounding
            whole = [k for k, a in enumerate(dargs) if a[0] == "leaf" and plan.leaf_keys[a[1]] is None]
            if len(whole) != 1:
                continue
            q = plan.leaves[dargs[whole[0]][1]]
            if q.dtype != daval.dtype or c.dtype != daval.dtype or aval.dtype != daval.dtype:
                continue
            new_args = list(dargs)
            new_args[whole[0]] = ("leaf", len(plan.leaves) + len(scaled))
            scaled.append((dargs[whole[0]][1], c_ref[1], prim.name))
            # the scale's step becomes the product of the scaled q (the unscaled product is read no more).
            # One scale moves, the first: the plan has one product, and a second scale of it (a soft cap's
            # ``tanh(s / 20)`` after ``s = q k^T / 8``) would read this step as the product, over a leaf that
            # is not the plan's (an IndexError, found on Gemma's soft-capped logits).
            steps[j] = (dprim, dparams, tuple(new_args), daval, dkey)
            return tuple(steps), tuple(scaled)
    return tuple(steps), tuple(scaled)
