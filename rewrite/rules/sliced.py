"""A matched term read as a function that computes it a block at a time along one axis: :meth:`Match.sliced`.

A rule that rebuilds a large value as a loop over blocks (attention's logits over blocks of keys) needs the
value as a program it can run per block: from the value, :func:`slice_along` walks down the e-graph
following the axis, through elementwise operations, broadcasts, transposes, ``iota`` and products that
carry the axis on one side, and records each value it passes as a :class:`Step` with the axis's place in
it. What it reaches without the axis is a leaf read whole; what carries the axis and is none of those is
a leaf sliced per block. :meth:`Sliced.block` then runs the steps for one block, each ``iota`` and
``shape`` param cut to it, reading only that block of each sliced leaf; :meth:`Sliced.place` follows a
second axis through the same steps, so that a block may be cut along two axes at once, and
:meth:`Sliced.blocks` gives what a loop over such blocks reads. Readers of the steps (:meth:`Sliced.literal`,
:meth:`Sliced.position_axis`, :meth:`Sliced.positions_ge`, :meth:`Sliced.path_to`, :meth:`Sliced.affine`, ...)
say what a value is made of.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np
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


class Hoisted(NamedTuple):
    """A leaf that :meth:`Sliced.hoist_scale` adds after a program's own: leaf ``operand`` scaled by the literal
    leaf ``scale`` (``prim``: ``"div"`` or ``"mul"``), computed once, before a loop over blocks."""

    operand: int
    scale: int
    prim: str

    def of(self, leaves: Sequence[Any]) -> Any:
        """The added leaf's value, from arrays of the program's own leaves."""
        x, c = leaves[self.operand], leaves[self.scale]
        return x / c if self.prim == "div" else x * c


class Blocks(NamedTuple):
    """A :class:`Sliced` as a loop over its blocks reads it (:meth:`Sliced.blocks`). ``block(leaves, along,
    across)``: the value at the window ``along`` of the sliced axis (a ``start`` and a ``size``) and, where
    ``across`` is a window too, at those positions of the second axis only; the leaves that carry the second axis
    and not the sliced one come cut to it already. ``leaf_axes`` and ``across_axes``: where each leaf carries each
    axis (``None``: it does not; ``across_axes`` ``None``: no second axis). ``prepare(leaves)``: the leaves
    ``block`` reads, from the program's own (those a hoisted scale adds, :meth:`Sliced.hoist_scale`, after them)."""

    block: Callable[[Sequence[Any], Any, Any], Any]
    leaf_axes: tuple[int | None, ...]
    across_axes: tuple[int | None, ...] | None
    prepare: Callable[[Sequence[Any]], list]


class Term(NamedTuple):
    """A term of an :class:`Affine` value: the value of ``ref`` times ``factor``, added to a value of ``shape`` whose
    axes are ``axes`` (for each, the product's axis; ``None``: one of size one that the product lacks)."""

    ref: Ref
    factor: float
    shape: tuple
    axes: list

    def as_product(self, x: Any) -> Any:
        """``x``, the value of ``ref``, broadcast to ``shape`` and laid out as the product's axes."""
        x = jnp.broadcast_to(x, self.shape)
        unit = tuple(d for d, a in enumerate(self.axes) if a is None)
        x = lax.squeeze(x, unit) if unit else x
        perm = tuple(int(j) for j in np.argsort([a for a in self.axes if a is not None]))
        return lax.transpose(x, perm) if list(perm) != sorted(perm) else x


class Affine(NamedTuple):
    """A value as ``where(mask, scale * product + sum of terms, fill)`` (:meth:`Sliced.affine`): ``product`` the step
    of the primitive, ``scale`` a positive literal, ``terms`` the :class:`Term` s; ``mask`` ``(a, b)``: the value
    is kept where the position along the product's axis ``a`` is at least that along ``b`` (``None``: no mask),
    ``fill`` the masked value as the result holds it; ``axes``: the value's axes as the product's."""

    product: Ref
    scale: float
    terms: tuple[Term, ...]
    mask: tuple[int, int] | None
    fill: float | None
    axes: list


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
        return self.leaves[ref.index].aval if ref.kind == "leaf" else self.steps[ref.index].aval

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

        try:
            return read(self.out)
        finally:
            del read, run  # the two closures call each other, a reference cycle: it would hold the traced values

    def value(self, leaves: Sequence[Any], ref: Ref | None = None, memo: dict | None = None) -> Any:
        """The whole value of ``ref`` (``out`` by default), no block: the steps it needs, each once."""
        ref, memo = self.out if ref is None else ref, {} if memo is None else memo
        if ref.kind == "leaf":
            return leaves[ref.index]
        if ref not in memo:
            step = self.steps[ref.index]
            res = step.primitive.bind(*[self.value(leaves, a, memo) for a in step.args], **step.params)
            memo[ref] = res[0] if isinstance(res, (list, tuple)) else res
        return memo[ref]

    def place(self, axis: int) -> Placed | None:
        """Where ``axis`` of the value lies in every leaf and step (a :class:`Placed`), or ``None`` where a value
        would carry it in two places, or a product carries it as a batch axis or on the side of the sliced axis."""
        leaf_q: dict[int, int | None] = {}
        step_q: dict[int, int | None] = {self.out.index: axis} if self.out.kind == "step" else {}
        if self.out.kind == "leaf":
            leaf_q[self.out.index] = axis

        def put(ref: Ref, ax: int | None) -> bool:
            table = leaf_q if ref.kind == "leaf" else step_q
            if ref.index in table and table[ref.index] != ax:
                return False
            table[ref.index] = ax
            return True

        for i in reversed(range(len(self.steps))):
            if i not in step_q:
                continue
            step = self.steps[i]
            prim, params, args, aval, key = step.primitive, step.params, step.args, step.aval, step.axis
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


    def hoist_scale(self) -> tuple["Sliced", tuple[Hoisted, ...]]:
        """This program with a literal scale of its product, ``(a b) / c`` or ``(a b) * c``, applied to the product's
        operand read whole, ``a``, as a leaf after the program's own (a :class:`Hoisted`): computed once, before a
        loop over blocks, where in the loop the scale is a pass of its own over each block (attention's ``q k^T /
        sqrt(d)``). The scale moves where it is a finite literal that makes ``a`` no larger (a divisor of magnitude
        1 or more, a factor of at most 1), so nothing overflows where the original does not; a power of two moves
        exactly, any other scale in float32 and float64 only (it rounds ``a`` once). One scale moves, the first
        (a second would read this step as the product, over a leaf that is not the program's). Without one:
        the program as it is, and no leaf."""
        steps = list(self.steps)
        uses = collections.Counter(a.index for step in steps for a in step.args if a.kind == "step")
        for j, step in enumerate(steps):
            if step.primitive.name not in ("div", "mul") or len(step.args) != 2:
                continue
            a, b = step.args
            for d_ref, c_ref in [(a, b)] if step.primitive.name == "div" else [(a, b), (b, a)]:
                if d_ref.kind != "step" or c_ref.kind != "leaf" or uses[d_ref.index] != 1:
                    continue
                product, value = steps[d_ref.index], self.literal(c_ref)
                dtype = product.aval.dtype
                if product.primitive.name != "dot_general" or value is None or not np.isfinite(value) or value == 0:
                    continue
                if (abs(value) < 1) if step.primitive.name == "div" else (abs(value) > 1):
                    continue
                if math.frexp(abs(value))[0] != 0.5 and jnp.finfo(dtype).nmant < 23:
                    continue  # not a power of two: rounding a half-precision operand once more
                whole = [k for k, r in enumerate(product.args) if r.kind == "leaf" and self.leaf_axes[r.index] is None]
                if len(whole) != 1:
                    continue
                q_ref = product.args[whole[0]]
                if any(x.dtype != dtype for x in (self.leaves[q_ref.index], self.leaves[c_ref.index], step.aval)):
                    continue
                args = list(product.args)
                args[whole[0]] = q_ref._replace(index=len(self.leaves))  # the scaled operand, the added leaf
                steps[j] = product._replace(args=tuple(args))  # the scale's step: the product of the scaled operand
                hoisted = Hoisted(q_ref.index, c_ref.index, step.primitive.name)
                return dataclasses.replace(self, steps=tuple(steps), leaves=self.leaves + (self.leaves[q_ref.index],),
                                           leaf_axes=self.leaf_axes + (None,)), (hoisted,)
        return self, ()


    def blocks(self, across: int | None = None, hoist: bool = False) -> Blocks:
        """This value as a loop over blocks reads it (a :class:`Blocks`): along the sliced axis, and along the
        value's axis ``across`` too where every value carries it in one place (:meth:`place`; else the blocks are
        cut along the sliced axis only). ``hoist``: the program with a literal scale of its product applied once,
        before the loop (:meth:`hoist_scale`). A literal scalar leaf (a mask's fill, a scale) is the block's
        constant, as it is the program's: XLA can then fold it (a division by 8 into a product by 0.125)."""
        placed = None if across is None else self.place(across)
        program, hoisted = self.hoist_scale() if hoist else (self, ())
        consts = {i: np.asarray(x.literal, x.dtype) for i, x in enumerate(self.leaves)
                  if x.shape == () and x.literal is not None}
        own = lambda leaves: [consts.get(i, x) for i, x in enumerate(leaves)]  # noqa: E731
        axes = None if placed is None else placed.leaf_axes + tuple(placed.leaf_axes[h.operand] for h in hoisted)
        # the loop's function outlives the match (JAX's caches keep the programs that call it): it holds the steps
        # and not the matched values, each of which holds its builder and with it the whole e-graph
        program = dataclasses.replace(program, leaves=tuple(None for _ in program.leaves))

        def block(leaves: Sequence[Any], along: Any, window: Any = None) -> Any:
            cut = None if window is None or axes is None else Cut(axes, placed.step_axes, window.start, window.size)
            return program.block(own(leaves), along.start, along.size, cut)

        prepare = lambda leaves: list(leaves) + [h.of(own(leaves)) for h in hoisted]  # noqa: E731
        return Blocks(block, program.leaf_axes, axes, prepare)

    def affine(self, prim: str) -> Affine | None:
        """The value as an :class:`Affine` form of its one step of ``prim`` (attention's logits: ``q k^T`` scaled,
        biased, causally masked), through broadcasts, transposes and conversions to a floating dtype; ``None``
        where it is anything else: a scale that is not a positive finite literal, a mask that is not a
        comparison of positions (:meth:`positions_ge`) or whose fill is not a literal, a term added after it."""
        path = self.path_to(prim)
        maps = self.axes_along(path) if path is not None else None
        if maps is None:
            return None
        scale, terms, mask, fill = 1.0, [], None, None
        for (ref, i), amap in zip(path[:-1], maps):
            step = self.steps[ref.index]
            name, args, aval = step.primitive.name, step.args, step.aval
            if name in ("broadcast_in_dim", "transpose") or (name == "convert_element_type"
                                                               and jnp.issubdtype(aval.dtype, jnp.floating)):
                continue
            if name in ("mul", "div") and len(args) == 2:
                c = self.literal(args[1 - i])
                if c is None or not math.isfinite(c) or c <= 0 or (name == "div" and i == 1):
                    return None
                scale *= c if name == "mul" else 1.0 / c  # scales what lies below: the product, a term added there
            elif name in ("add", "sub") and len(args) == 2 and not (name == "sub" and i == 1):
                terms.append(Term(args[1 - i], scale if name == "add" else -scale, tuple(aval.shape), amap))
            elif name == "select_n" and len(args) == 3 and i != 0 and mask is None and not terms:
                pairs = [(a, b) for a in amap for b in amap if a is not None and b is not None and a != b]
                # select_n picks its last operand where the predicate holds
                mask = next((p for p in pairs if self.positions_ge(
                    args[0], amap.index(p[0]), amap.index(p[1])) == (i == 2)), None)
                fill = self.literal(args[3 - i])
                if mask is None or fill is None:
                    return None
                fill *= scale  # the masked value as the result holds it
            else:
                return None
        return Affine(path[-1][0], scale, tuple(terms), mask, fill, maps[0])

    def literal(self, ref: Ref) -> float | None:
        """The Python value of ``ref`` where it is a literal scalar (a leaf, maybe converted to another dtype: a
        Python float under ``jnp.where``; or a broadcast of one), else ``None``."""
        step = self.steps[ref.index] if ref.kind == "step" else None
        if step is None:
            return scalar_literal(self.leaves[ref.index])
        return self.literal(step.args[0]) if step.primitive.name == "broadcast_in_dim" else None

    def position_axis(self, ref: Ref, depth: int = 0) -> int | None:
        """The axis along which ``ref`` is each element's own position (an ``iota``, maybe broadcast, converted
        from an integer, or plus a literal 0, as ``jnp.tril`` writes it), each position exact in its dtype;
        else ``None``."""
        if ref.kind == "leaf":
            return position_axis(self.leaves[ref.index])
        step = self.steps[ref.index]
        name, params, args, aval = step.primitive.name, step.params, step.args, step.aval
        if depth > 8:
            return None
        if name == "iota":
            return _own_position(aval.dtype, aval.shape, int(params["dimension"]))
        if name == "convert_element_type" and jnp.issubdtype(aval.dtype, jnp.integer):
            return _own_position(aval.dtype, aval.shape, self.position_axis(args[0], depth + 1))
        if name in ("add", "sub") and len(args) == 2 and self.literal(args[1]) == 0.0:
            return self.position_axis(args[0], depth + 1)
        if name == "broadcast_in_dim":
            inner, dims = self.position_axis(args[0], depth + 1), params["broadcast_dimensions"]
            if inner is not None and self.aval(args[0]).shape[inner] == aval.shape[dims[inner]]:
                return int(dims[inner])
        return None

    def positions_ge(self, ref: Ref, axis: int, other: int, depth: int = 0) -> bool | None:
        """``True`` where the mask ``ref`` is ``position along axis >= position along other`` (a causal mask, with
        ``axis`` the queries), ``False`` where it is ``<``, else ``None``: a comparison of two positions
        (:meth:`position_axis`), maybe broadcast over more axes (flax's ``[b, 1, q, k]``), as 0/1 numbers read
        back by ``!= 0``, under ``ones & mask`` or as ``where(mask, 1, 0)`` (``jnp.tril`` of ones) or its negation."""
        if ref.kind == "leaf" or depth > 8:
            return None
        step = self.steps[ref.index]
        name, params, args, aval = step.primitive.name, step.params, step.args, step.aval
        literals = [self.literal(a) for a in args]
        if name == "broadcast_in_dim":
            src, dims = self.aval(args[0]), tuple(params["broadcast_dimensions"])
            if axis not in dims or other not in dims:
                return None
            i, j = dims.index(axis), dims.index(other)
            if src.shape[i] != aval.shape[axis] or src.shape[j] != aval.shape[other]:
                return None
            return self.positions_ge(args[0], i, j, depth + 1)
        if name == "convert_element_type":
            return self.positions_ge(args[0], axis, other, depth + 1)
        if name in ("ne", "and") and len(args) == 2:  # mask != 0, ones & mask
            unit = [i for i, c in enumerate(literals) if c == (0.0 if name == "ne" else 1.0)]
            return self.positions_ge(args[1 - unit[0]], axis, other, depth + 1) if len(unit) == 1 else None
        if name == "select_n" and len(args) == 3:  # select_n picks its last operand where the mask is true
            if (literals[2], literals[1]) not in ((1.0, 0.0), (0.0, 1.0)):
                return None
            inner = self.positions_ge(args[0], axis, other, depth + 1)
            return inner if inner is None or literals[2] == 1.0 else not inner
        if name not in ("ge", "le", "gt", "lt"):
            return None
        a, b = (self.position_axis(x) for x in args)
        if (a, b) == (other, axis):
            name = {"ge": "le", "le": "ge", "gt": "lt", "lt": "gt"}[name]
        elif (a, b) != (axis, other):
            return None
        return {"ge": True, "lt": False}.get(name)

    def reads(self, ref: Ref, prim: str) -> bool:
        """Whether the value of ``ref`` is computed through a step of ``prim``."""
        step = self.steps[ref.index] if ref.kind == "step" else None
        return step is not None and (step.primitive.name == prim or any(self.reads(a, prim) for a in step.args))

    def path_to(self, prim: str) -> list[tuple[Ref, int | None]] | None:
        """The steps from ``out`` down to the one step of ``prim`` (attention's logits down to ``q k^T``), each
        with the index of its operand that leads there (``None`` for that last step); ``None`` where no step of
        ``prim`` is reached, or a step reaches it through two operands."""
        path, ref = [], self.out
        for _ in range(32):
            if ref.kind == "leaf":
                return None
            args = self.steps[ref.index].args
            if self.steps[ref.index].primitive.name == prim:
                return path + [(ref, None)]
            leading = [i for i, a in enumerate(args) if self.reads(a, prim)]
            if len(leading) != 1:
                return None
            path.append((ref, leading[0]))
            ref = args[leading[0]]
        return None

    def axes_along(self, path: Sequence[tuple[Ref, int | None]]) -> list[list[int | None]] | None:
        """For each step of ``path`` (:meth:`path_to`), its axes as the last step's (``None``: an axis of size one
        it inserts): through broadcasts that add such axes only, transposes and steps that keep the rank; else
        ``None``."""
        maps = [list(range(len(self.aval(path[-1][0]).shape)))]
        for ref, _ in reversed(path[:-1]):
            step, below = self.steps[ref.index], maps[0]
            shape = step.aval.shape
            if step.primitive.name == "broadcast_in_dim":
                dims = tuple(step.params["broadcast_dimensions"])
                if any(d not in dims and shape[d] != 1 for d in range(len(shape))):
                    return None  # a copy along a new axis
                maps.insert(0, [below[dims.index(d)] if d in dims else None for d in range(len(shape))])
            elif step.primitive.name == "transpose":
                maps.insert(0, [below[int(d)] for d in step.params["permutation"]])
            elif len(shape) == len(below):
                maps.insert(0, list(below))
            else:
                return None
        return maps

    def exact_in(self, ref: Ref, dtype: Any, depth: int = 0) -> bool:
        """Whether every value of ``ref`` is one of ``dtype``: of it, or values of it widened, broadcast or moved."""
        if self.aval(ref).dtype == dtype:
            return True
        if ref.kind == "leaf" or depth > 8:
            return False
        step = self.steps[ref.index]
        moves = ("convert_element_type", "broadcast_in_dim", "transpose", "reshape", "squeeze")
        return step.primitive.name in moves and self.exact_in(step.args[0], dtype, depth + 1)


def scalar_literal(v: Any, depth: int = 0) -> float | None:
    """A literal scalar's value (of a matched :class:`rewrite.Value`), maybe converted to another dtype."""
    if v.shape != () or depth > 4:
        return None
    if v.literal is not None:
        return float(v.literal)
    node = v.node("convert_element_type")
    inner = None if node is None else scalar_literal(node.operands[0], depth + 1)
    return None if inner is None else float(np.asarray(inner).astype(node.params["new_dtype"]))


def _own_position(dtype: Any, shape: tuple, axis: int | None) -> int | None:
    """``axis`` where ``dtype`` holds every position along it (an int8 iota over 512 wraps at 128), else ``None``."""
    if axis is None:
        return None
    dtype, last = np.dtype(dtype), shape[axis] - 1
    if jnp.issubdtype(dtype, jnp.integer):
        return axis if int(jnp.iinfo(dtype).max) >= last else None
    return axis if jnp.issubdtype(dtype, jnp.floating) and last <= 2 ** (jnp.finfo(dtype).nmant + 1) else None


def position_axis(v: Any, depth: int = 0) -> int | None:
    """:meth:`Sliced.position_axis` of a matched :class:`rewrite.Value`: an ``iota``, maybe broadcast or converted
    from an integer."""
    if depth > 8:
        return None
    node = v.node("iota")
    if node is not None:
        return _own_position(v.dtype, v.shape, int(node.params["dimension"]))
    node = v.node("convert_element_type")
    if node is not None and jnp.issubdtype(node.operands[0].dtype, jnp.integer):
        return _own_position(v.dtype, v.shape, position_axis(node.operands[0], depth + 1))
    node = v.node("broadcast_in_dim")
    if node is not None:
        inner = position_axis(node.operands[0], depth + 1)
        if inner is not None and node.operands[0].shape[inner] == v.shape[node.params["broadcast_dimensions"][inner]]:
            return int(node.params["broadcast_dimensions"][inner])
    return None


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
