"""How a loop body computes one step of a stacked value: the ``loop_step`` hook of a primitive's record.

:meth:`rewrite.loops.Loop.per_step` builds step ``t`` of a value stacked along
an axis of the loop (its rows, one per step) inside the loop's body. Each
primitive whose work can move into a loop says how, in its record
(``OpSpec.loop_step`` in ``rewrite/ir/primitives.py``, which sets the ones
here): ``loop_step(loop, node, v, axis, step)`` returns step ``t`` of ``v``
computed by ``node`` (one of ``v``'s e-nodes), where ``step(x, a)`` gives step
``t`` of an operand stacked along its axis ``a`` and ``loop`` is the
:class:`rewrite.loops.Loop` being built (``loop.invariant(x)`` for an operand
that is the same at every step, ``loop.m.trace`` to build). It raises
:class:`Decline` when the node keeps the loop's axis in a way it cannot follow.
Elementwise primitives get :func:`pointwise_step` unless their record says
otherwise.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from jax import lax


class Decline(Exception):
    """This match cannot be rewritten: raised inside :meth:`Loop.attempt`, or caught by the rule."""


def _drop(dims: Sequence[int], axis: int) -> tuple[int, ...]:
    """Axis numbers after ``axis`` is removed (``axis`` itself must not be among them)."""
    return tuple(d - (d > axis) for d in dims)


def pointwise_step(loop: Any, node: Any, v: Any, axis: int, step: Callable) -> Any:
    ops = [step(o, axis) if o.ndim == v.ndim else loop.invariant(o) if o.ndim == 0 else _no(o)
           for o in node.operands]
    return loop.m.trace(bound(node.primitive, node.params), *ops)


def bound(prim: Any, params: dict) -> Callable[..., Any]:
    """``prim`` applied with ``params``. Its closure holds only the primitive and the params' items, so that
    ``Match.trace`` keeps its trace per avals (``rewrite/rules/builder.py``'s ``_trace_key``) where the params
    are plain values: a loop's steps apply the same few primitives at the same shapes again and again."""
    items = tuple(params.items())
    return lambda *a: prim.bind(*a, **dict(items))


def _no(v: Any) -> Any:
    raise Decline(f"operand {v} of a pointwise op has another rank")


def broadcast_in_dim_step(loop: Any, node: Any, v: Any, axis: int, step: Callable) -> Any:
    (x,) = node.operands
    shape, dims = tuple(node.params["shape"]), tuple(node.params["broadcast_dimensions"])
    if node.params.get("sharding") is not None:
        raise Decline("a sharded broadcast")
    if axis in dims:
        k = dims.index(axis)
        inner = step(x, k) if x.shape[k] == loop.length and loop.length != 1 else loop.invariant(x, squeeze=k)
        step_dims = _drop(dims[:k] + dims[k + 1:], axis)
    else:  # the operand does not vary along the loop axis
        inner, step_dims = loop.invariant(x), _drop(dims, axis)
    out_shape = shape[:axis] + shape[axis + 1:]
    return loop.m.trace(lambda a: lax.broadcast_in_dim(a, out_shape, step_dims), inner)


def transpose_step(loop: Any, node: Any, v: Any, axis: int, step: Callable) -> Any:
    (x,) = node.operands
    perm = tuple(node.params["permutation"])
    src = perm[axis]
    inner = step(x, src)
    new = _drop(perm[:axis] + perm[axis + 1:], src)
    return loop.m.trace(lambda a: lax.transpose(a, new), inner)


def reshape_step(loop: Any, node: Any, v: Any, axis: int, step: Callable) -> Any:
    (x,) = node.operands[:1]
    if len(node.operands) != 1 or node.params.get("dimensions") is not None:
        raise Decline("a reshape with dynamic shape or a dimension order")
    before = int(np.prod(v.shape[:axis], dtype=np.int64))
    for b in range(x.ndim):
        if int(np.prod(x.shape[:b], dtype=np.int64)) == before and x.shape[b] == v.shape[axis]:
            inner = step(x, b)  # row-major order: the loop's axis is the same axis on both sides
            new = tuple(v.shape[:axis] + v.shape[axis + 1:])
            return loop.m.trace(lambda a: lax.reshape(a, new), inner)
    raise Decline("a reshape that mixes the loop's axis with others")


def squeeze_step(loop: Any, node: Any, v: Any, axis: int, step: Callable) -> Any:
    (x,) = node.operands
    dims = tuple(d % x.ndim for d in node.params["dimensions"])
    kept = [d for d in range(x.ndim) if d not in dims]
    src = kept[axis]
    inner = step(x, src)
    return loop.m.trace(lambda a: lax.squeeze(a, _drop(dims, src)), inner)


def reduce_step(loop: Any, node: Any, v: Any, axis: int, step: Callable) -> Any:
    (x,) = node.operands
    axes = tuple(node.params["axes"])
    kept = [d for d in range(x.ndim) if d not in axes]
    src = kept[axis]
    inner = step(x, src)
    return loop.m.trace(bound(node.primitive, dict(node.params, axes=_drop(axes, src))), inner)


def dot_general_step(loop: Any, node: Any, v: Any, axis: int, step: Callable) -> Any:
    lhs, rhs = node.operands
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    lfree = [d for d in range(lhs.ndim) if d not in lc + lb]
    rfree = [d for d in range(rhs.ndim) if d not in rc + rb]
    if axis < len(lb):  # a batch axis of both operands
        la, ra = lb[axis], rb[axis]
        a, b = step(lhs, la), step(rhs, ra)
        nb = ((_drop(lc, la), _drop(rc, ra)), (_drop(lb[:axis] + lb[axis + 1:], la), _drop(rb[:axis] + rb[axis + 1:], ra)))
    elif axis < len(lb) + len(lfree):  # a free axis of the left operand; the right one is the same every step
        la = lfree[axis - len(lb)]
        a, b = step(lhs, la), loop.invariant(rhs)
        nb = ((_drop(lc, la), rc), (_drop(lb, la), rb))
    else:
        ra = rfree[axis - len(lb) - len(lfree)]
        a, b = loop.invariant(lhs), step(rhs, ra)
        nb = ((lc, _drop(rc, ra)), (lb, _drop(rb, ra)))
    return loop.m.trace(bound(node.primitive, dict(node.params, dimension_numbers=nb)), a, b)


def slice_step(loop: Any, node: Any, v: Any, axis: int, step: Callable) -> Any:
    (x,) = node.operands
    start, limit = tuple(node.params["start_indices"]), tuple(node.params["limit_indices"])
    strides = tuple(node.params["strides"] or (1,) * x.ndim)
    if (start[axis], limit[axis], strides[axis]) != (0, x.shape[axis], 1):
        raise Decline("a slice along the loop's axis")
    inner = step(x, axis)
    cut = lambda t: t[:axis] + t[axis + 1:]  # noqa: E731
    return loop.m.trace(lambda a: lax.slice(a, cut(start), cut(limit), cut(strides)), inner)
