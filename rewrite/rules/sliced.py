"""A matched term read as a function that computes it a block at a time along one axis: :meth:`Match.sliced`.

A rule that rebuilds a large value as a loop over blocks (attention's logits over blocks of keys) needs the
value as a program it can run per block: from the value, :func:`slice_along` walks down the e-graph
following the axis, through elementwise operations, broadcasts, transposes, ``iota`` and products that
carry the axis on one side, and records each value it passes as a :class:`Step` with the axis's place in
it. What it reaches without the axis is a leaf read whole; what carries the axis and is none of those is
a leaf sliced per block. :meth:`Sliced.block` then runs the steps for one block, each ``iota`` and
``shape`` param cut to it, reading only that block of each sliced leaf; :meth:`Sliced.place` follows a
second axis through the same steps, so that a block may be cut along two axes at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax.numpy as jnp
from jax import lax

#: Elementwise primitives the walk passes through (their operands have the result's shape, or are scalars).
ELEMENTWISE = frozenset("""add sub mul div neg max min select_n convert_element_type eq ne lt le gt ge and or not
    exp log tanh logistic abs sign integer_pow sqrt rsqrt square stop_gradient copy copy_p pow""".split())


class Ref(NamedTuple):
    """A value of a :class:`Sliced`: its leaf ``index`` (``kind == "leaf"``) or its step's (``"step"``)."""

    kind: str
    index: int


class Step(NamedTuple):
    """One primitive of a :class:`Sliced`: ``primitive`` with ``params`` applied to ``args``, giving a value of
    ``aval`` whose sliced axis is ``axis`` (``None``: it has none)."""

    primitive: Any
    params: dict
    args: tuple[Ref, ...]
    aval: Any
    axis: int | None


class Cut(NamedTuple):
    """A second axis to cut a block along: where it lies in each leaf and step (:class:`Placed`), and the
    window, ``size`` positions from ``start``."""

    leaf_axes: tuple[int | None, ...]
    step_axes: tuple[int | None, ...]
    start: Any
    size: int


class Placed(NamedTuple):
    """Where a second axis of a :class:`Sliced` lies in each leaf and step (``None``: the value does not carry it:
    read whole, or broadcast along it): :meth:`Sliced.place`."""

    leaf_axes: tuple[int | None, ...]
    step_axes: tuple[int | None, ...]

    def window(self, start: Any, size: int) -> Cut:
        """This axis cut to ``size`` positions from ``start``, for :meth:`Sliced.block`."""
        return Cut(self.leaf_axes, self.step_axes, start, size)


@dataclasses.dataclass(frozen=True)
class Sliced:
    """A value computed from ``leaves`` by ``steps`` (the last one that ``out`` names), each value with the place
    of the sliced ``axis`` in it. ``leaf_axes``: per leaf, its axis (sliced per block) or ``None`` (read whole).
    ``passed``: how many nodes of each primitive the walk passed through."""

    leaves: tuple[Any, ...]
    leaf_axes: tuple[int | None, ...]
    steps: tuple[Step, ...]
    out: Ref
    axis: int
    passed: dict

    def aval(self, ref: Ref) -> Any:
        """The aval of the leaf or step ``ref`` names."""
        return self.leaves[ref[1]].aval if ref[0] == "leaf" else self.steps[ref[1]].aval

    def block(self, leaves: Sequence[Any], start: Any, size: int, cut: Cut | None = None) -> Any:
        """The value at positions ``start .. start + size`` of the axis: the steps ``out`` reads, each once, with
        every leaf that carries the axis sliced to the block. ``leaves``: arrays, one per leaf (whole; where
        ``cut`` is given, those that carry its axis but not this one come cut already). ``cut``: a second window
        (:meth:`Placed.window`): the steps are cut to it, and so are the leaves that carry both."""
        vals: dict[int, Any] = {}

        def read(ref: Ref) -> Any:
            kind, i = ref
            if kind == "leaf":
                x, k = leaves[i], self.leaf_axes[i]
                qa = None if cut is None or k is None else cut.leaf_axes[i]
                if qa is not None:
                    at, shape = [jnp.zeros((), start.dtype)] * x.ndim, list(x.shape)
                    at[k], at[qa], shape[k], shape[qa] = start, cut.start.astype(start.dtype), size, cut.size
                    return lax.dynamic_slice(x, at, shape)
                return x if k is None else lax.dynamic_slice_in_dim(x, start, size, axis=k)
            if i not in vals:
                vals[i] = run(i, self.steps[i])
            return vals[i]

        def run(i: int, step: Step) -> Any:
            ops = [read(a) for a in step.args]
            params = dict(step.params)
            qax = None if cut is None else cut.step_axes[i]
            if "shape" in params:
                shape = list(params["shape"])
                for ax, n in ((step.axis, size), (qax, None if cut is None else cut.size)):
                    if ax is not None:
                        shape[ax] = n
                params["shape"] = tuple(shape)
            if step.primitive.name == "iota":
                for ax, first in ((step.axis, start), (qax, None if cut is None else cut.start)):
                    if ax is not None and params["dimension"] == ax:
                        return step.primitive.bind(**params) + first.astype(params["dtype"])
            res = step.primitive.bind(*ops, **params)
            return res[0] if isinstance(res, (list, tuple)) else res

        return read(self.out)

    def value(self, leaves: Sequence[Any], ref: Ref | None = None, memo: dict | None = None) -> Any:
        """The whole value of ``ref`` (``out`` by default), no block: the steps it needs, each once."""
        ref, memo = self.out if ref is None else ref, {} if memo is None else memo
        if ref[0] == "leaf":
            return leaves[ref[1]]
        if ref not in memo:
            step = self.steps[ref[1]]
            res = step.primitive.bind(*[self.value(leaves, a, memo) for a in step.args], **step.params)
            memo[ref] = res[0] if isinstance(res, (list, tuple)) else res
        return memo[ref]

    def place(self, axis: int) -> Placed | None:
        """Where ``axis`` of the value lies in every leaf and step (a :class:`Placed`), or ``None`` where a value
        would carry it in two places, or a product carries it as a batch axis or on the side of the sliced axis."""
        leaf_q: dict[int, int | None] = {}
        step_q: dict[int, int | None] = {self.out[1]: axis} if self.out[0] == "step" else {}
        if self.out[0] == "leaf":
            leaf_q[self.out[1]] = axis

        def put(ref: Ref, ax: int | None) -> bool:
            table = leaf_q if ref[0] == "leaf" else step_q
            if ref[1] in table and table[ref[1]] != ax:
                return False
            table[ref[1]] = ax
            return True

        for i in reversed(range(len(self.steps))):
            if i not in step_q:
                continue
            prim, params, args, aval, key = self.steps[i]
            ax = step_q[i]
            shapes = [self.aval(a).shape for a in args]
            axes = [None] * len(args) if ax is None else operand_axes(prim.name, params, shapes, aval.shape, ax)
            if axes is None:
                return None  # a batch axis of the product
            if prim.name == "dot_general" and any(a is not None and k is not None for a, k in zip(
                    axes, operand_axes(prim.name, params, shapes, aval.shape, key))):
                return None  # on the sliced axis's side of the product
            if not all(put(a, x) for a, x in zip(args, axes)):
                return None
        return Placed(tuple(leaf_q.get(i) for i in range(len(self.leaves))),
                      tuple(step_q.get(i) for i in range(len(self.steps))))


def operand_axes(prim: str, params: dict, shapes: Sequence[tuple], shape: tuple, ax: int) -> list | None:
    """Where axis ``ax`` of a value of ``shape`` that ``prim`` computes lies in each operand (of ``shapes``):
    an axis, or ``None`` where the operand does not carry it (a scalar, a size-1 axis jax broadcasts, the other
    side of a product); ``None`` for a primitive the walk does not pass through, or an axis it cannot follow
    (a batch axis of a product)."""
    if prim in ELEMENTWISE:
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


class _TooDeep(Exception):
    pass


def _ident(v: Any) -> Any:
    return v.cls if v.cls is not None else ("name", v.name)


class _Walk:
    """The walk of :func:`slice_along`: the steps and leaves so far, each value recorded once."""

    def __init__(self, limit: dict[str, int]) -> None:
        self.steps: list[Step] = []
        self.leaves: list[Any] = []
        self.leaf_axes: list[int | None] = []
        self.seen: dict[Any, Ref] = {}
        self.passed: dict[str, int] = {}
        self.limit = limit

    def leaf(self, v: Any, axis: int | None) -> Ref:
        ident = (_ident(v), axis)
        if ident not in self.seen:
            self.leaves.append(v)
            self.leaf_axes.append(axis)
            self.seen[ident] = Ref("leaf", len(self.leaves) - 1)
        return self.seen[ident]

    def value(self, v: Any, axis: int | None, depth: int) -> Ref:
        if depth > 64:
            raise _TooDeep
        if axis is None:
            return self.leaf(v, None)
        memo = (_ident(v), axis, "walk")
        if memo not in self.seen:
            ref = None
            for node in v.nodes:
                ref = self.step(v, node, axis, depth)
                if ref is not None:
                    break
            self.seen[memo] = self.leaf(v, axis) if ref is None else ref
        return self.seen[memo]

    def step(self, v: Any, node: Any, axis: int, depth: int) -> Ref | None:
        if self.passed.get(node.prim, 0) >= self.limit.get(node.prim, 1 << 30):
            return None  # read as it is
        params = dict(node.params)
        axes = operand_axes(node.prim, params, [o.shape for o in node.operands], v.shape, axis)
        if axes is None:
            return None
        self.passed[node.prim] = self.passed.get(node.prim, 0) + 1
        args = tuple(self.value(o, a, depth + 1) for o, a in zip(node.operands, axes))
        self.steps.append(Step(node.primitive, params, args, v.aval, axis))
        return Ref("step", len(self.steps) - 1)


def slice_along(v: Any, axis: int, limit: dict[str, int] | None = None) -> Sliced | None:
    """``v`` (a matched :class:`rewrite.Value`) as a :class:`Sliced` along ``axis``, or ``None`` where the walk
    went deeper than 64 values. ``limit``: at most this many nodes of a primitive are passed through (a
    further one is read as a leaf), ``{"dot_general": 1}`` for one product."""
    walk = _Walk(dict(limit or {}))
    try:
        out = walk.value(v, axis, 0)
    except _TooDeep:
        return None
    return Sliced(tuple(walk.leaves), tuple(walk.leaf_axes), tuple(walk.steps), out, axis, dict(walk.passed))
