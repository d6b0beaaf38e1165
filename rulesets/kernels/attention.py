"""Softmax attention over blocks of keys, never holding the N x N scores: the kernel ``rulesets.attention`` builds.

:func:`attention` is the kernel for arrays laid out as model code lays them out: ``q`` ``[..., Nq, D]``,
``k`` ``[..., Nk, D]``, ``v`` ``[..., Nk, Dv]``, with the logits described by a :class:`Scores` record (a
scale, a bias, a mask, a causal mask). It computes ``softmax(scale * q k^T + bias, masked) v``:

>>> import jax, jax.numpy as jnp
>>> from rulesets.kernels.attention import Scores, attention
>>> q, k, v = (jax.random.normal(jax.random.key(i), (2, 512, 16)) for i in range(3))
>>> out = attention(q, k, v, scores=Scores(scale=0.25, causal=True), block=128)
>>> s = jnp.where(jnp.tril(jnp.ones((512, 512), bool)), q @ k.mT * 0.25, -jnp.inf)
>>> bool(jnp.allclose(out, jax.nn.softmax(s, axis=-1) @ v, atol=1e-5))
True

:func:`blocked_attention` is the general form the pack builds from a matched program: the logits are any
function that computes one block of them from its operands (a :class:`Logits` record), and the weights
meet ``v`` in the program's own ``dot_general`` (a :class:`ValueProduct` record: its dimension numbers,
the weights' rounding and squeezed axes, the output's layout).

The forward is an online softmax over key blocks in a ``lax.scan`` (flash attention's): a running
maximum, a running sum and a rescaled accumulator. A block whose scores so far are all ``-inf`` is
shifted by 0, not by ``-inf``, so a row masked in one block and not in the next comes out as the
unblocked form computes it; a row masked everywhere is ``0/0 = NaN``, as in ``jax.nn.softmax``; a row
masked with ``finfo.min`` averages uniformly; a NaN or ``+inf`` score makes its row NaN. With a
``query_block``, the loop over key blocks runs once per block of queries, each holding a block by a
block of scores. The forward computes its own product with the weights first and ``v`` read as
``[batch, keys, rest]`` (transposed once, before the loop), and puts the output in the program's order
once, after it.

The backward (``jax.custom_vjp``) keeps only the operands, the output and each row's shift and sum; it
computes each block's scores again (a block of keys by a block of ``backward_query_block`` queries, where
given: :func:`attention` uses its ``query_block``), and the gradient of the logits' own computation is that
computation's VJP on the block. The block's weights, their gradient and the sums of the operands'
gradients over the blocks are kept in the accumulator's precision (float32 for half precision), each
gradient rounded to its dtype once, at the end. In half precision the row term of the softmax's backward
is ``sum(p * dp) / sum(p)`` over the loop's own weights and rounded cotangents, in one more pass over the
key blocks, so that each row of the logits' gradient sums to zero as the unblocked form's does. The backward's
accumulators start from zeros made from the cotangent, so that XLA makes them when the backward starts, not at the
program's start (where it schedules arrays that read no operand), held through the forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rulesets.kernels.replay import replayed

__all__ = ["Window", "Logits", "ValueProduct", "blocked_attention", "Offer", "Blocking", "Scores", "attention",
           "FusedAxes", "fused_attention", "fused_axes"]


class Window(NamedTuple):
    """``size`` positions from ``start`` (a traced index) along one axis: the keys or the queries of a block."""

    start: Any
    size: int


@dataclasses.dataclass(frozen=True)
class Logits:
    """The attention's logits (``s`` of ``softmax(s) v``), computed a block at a time from some operands.

    ``block(operands, keys, queries)`` is the logits at the keys of the :class:`Window` ``keys`` (along
    ``key_axis``), and, when ``queries`` is a window, at those queries only (along ``query_axis``); the
    operands it is given have their query axis already cut to the window where they carry the queries
    but not the keys. ``key_axes`` says, per operand, which axis carries the keys (``None``: none; such an
    operand's gradient is summed over the blocks). The forward may read other operands than the
    backward: ``prepare`` computes them once, before the loops (a scale applied to ``q``, say), and
    ``forward_block``, ``forward_key_axes`` and ``forward_query_axes`` describe them; by default the
    forward reads the operands as the backward does."""

    shape: tuple[int, ...]
    dtype: Any
    key_axis: int
    block: Callable[[Sequence[Any], Window, Window | None], Any]
    key_axes: tuple[int | None, ...]
    #: The logits' query axis, where the forward may also run over blocks of queries, and each prepared
    #: operand's (``None``: it does not carry the queries).
    query_axis: int | None = None
    forward_query_axes: tuple[int | None, ...] | None = None
    #: Each operand's query axis as the backward reads them (``None``: it does not carry the queries), where
    #: the backward may run over blocks of queries too.
    query_axes: tuple[int | None, ...] | None = None
    prepare: Callable[[Sequence[Any]], list] | None = None
    forward_block: Callable[[Sequence[Any], Window, Window | None], Any] | None = None
    forward_key_axes: tuple[int | None, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ValueProduct:
    """How the softmax's weights meet ``v``: the program's own ``dot_general`` of them.

    ``weights_first``: the weights are its left operand. ``dimension_numbers`` and ``params``
    (``precision``, ``preferred_element_type``) are the product's; ``v_key`` is ``v``'s contracted axis
    and ``out`` the product's result (a ``jax.ShapeDtypeStruct``). ``cast``: the dtype the weights are
    rounded to before the product (bf16 weights of an f32 softmax), else ``None``; ``squeezed``: the
    logits' size-1 axes the weights drop (``@`` with a batch of one); ``wide``: the dtype the softmax
    sums its exponentials in, where wider than the logits' (``jax.nn.softmax`` of bf16 logits)."""

    weights_first: bool
    dimension_numbers: Any
    params: dict
    v_key: int
    out: Any
    cast: Any = None
    squeezed: tuple[int, ...] = ()
    wide: Any = None

    @classmethod
    def of(cls, weights_first: bool, params: dict, logits: Any, v: Any, *, cast: Any = None,
           squeezed: Sequence[int] = (), wide: Any = None) -> "ValueProduct":
        """The record of a program's ``dot_general(weights, v, **params)`` (``weights_first``; else of ``v`` and
        the weights): ``logits`` and ``v`` have ``shape`` and ``dtype`` (avals), the weights are the logits
        rounded to ``cast`` and less their axes ``squeezed``."""
        kept = {k: params[k] for k in ("dimension_numbers", "precision", "preferred_element_type") if k in params}
        weights = jax.ShapeDtypeStruct(tuple(d for i, d in enumerate(logits.shape) if i not in squeezed),
                                       cast or logits.dtype)
        pair = (weights, jax.ShapeDtypeStruct(v.shape, v.dtype))
        out = jax.eval_shape(lambda a, b: lax.dot_general(a, b, **kept), *(pair if weights_first else pair[::-1]))
        (lc, rc), _ = kept["dimension_numbers"]
        return cls(weights_first, kept["dimension_numbers"], kept, int((rc if weights_first else lc)[0]), out,
                   cast, tuple(squeezed), wide)

    def query_axis(self, logits_shape: Sequence[int]) -> int | None:
        """The logits' query axis: the weights' longest free axis (grouped-query heads have a group axis beside
        it), as the logits' (of ``logits_shape``); ``None`` where the weights have no free axis."""
        (lc, rc), (lb, rb) = self.dimension_numbers
        key, batch = (lc[0], lb) if self.weights_first else (rc[0], rb)
        axes = [d for d in range(len(logits_shape)) if d not in self.squeezed]  # the weights' axes as the logits'
        free = [d for d in range(len(axes)) if d != key and d not in batch]
        return axes[max(free, key=lambda d: (logits_shape[axes[d]], d))] if free else None

    @staticmethod
    def contracts(weights_first: bool, dimension_numbers: Any, squeezed: Sequence[int], key_axis: int) -> bool:
        """Whether a ``dot_general`` of the weights and ``v`` (``weights_first``; else of ``v`` and the weights) with
        ``dimension_numbers``, the weights the logits less their axes ``squeezed``, contracts the weights along the
        logits' axis ``key_axis`` (one they keep) and along it alone, as attention's product does (the record,
        :meth:`of`, is of such a product only)."""
        (lc, rc), _ = dimension_numbers
        pc, vc = (lc, rc) if weights_first else (rc, lc)
        p_axis = key_axis - sum(1 for e in squeezed if e < key_axis)  # as the weights'
        return key_axis not in squeezed and tuple(pc) == (p_axis,) and len(vc) == 1


def _zeros_after(x: Any, shape: Sequence[int], dtype: Any) -> Any:
    """Zeros of ``shape`` and ``dtype`` that XLA makes only once ``x`` is computed: a loop's initial value.

    XLA:CPU schedules an array of zeros, which has no operands, at the program's start, and there copies it into
    each loop that carries it: the backward's accumulators of every attention layer were held through the whole
    forward. ``(x[0] > 0) * 0`` is an exact zero (a boolean times zero is never NaN) that XLA does not fold."""
    x = jnp.asarray(x)
    if x.size == 0 or not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        return jnp.zeros(shape, dtype)
    first = lax.reshape(lax.slice(x, (0,) * x.ndim, (1,) * x.ndim), ())
    zero = lax.convert_element_type(first > 0, dtype) * jnp.zeros((), dtype)
    return jnp.broadcast_to(zero, tuple(shape))


def blocked_attention(logits: Logits, product: ValueProduct, *, block: int, query_block: int | None = None,
                      backward_query_block: int | None = None) -> Callable[..., Any]:
    """``fn(*operands, v)``: ``softmax(s) v`` over blocks of ``block`` keys (and of ``query_block`` queries in
    the forward, where given), ``s`` the :class:`Logits` of the operands, with a recomputing backward (over
    blocks of ``backward_query_block`` queries by blocks of keys, where given and the logits say where each
    operand carries the queries: ``Logits.query_axes``).

    The key axis must be a multiple of ``block``, and the query axis of ``query_block`` and of
    ``backward_query_block``."""
    s_shape, s_dtype, axis = tuple(logits.shape), logits.dtype, logits.key_axis
    key_axes = tuple(logits.key_axes)
    forward_keys = key_axes if logits.forward_key_axes is None else tuple(logits.forward_key_axes)
    forward_block = logits.block if logits.forward_block is None else logits.forward_block
    prepare = (lambda ops: list(ops)) if logits.prepare is None else logits.prepare
    out_aval, cast, squeezed, wide = product.out, product.cast, product.squeezed, product.wide
    p_first, v_key = product.weights_first, product.v_key
    pv_params = dict(product.params, dimension_numbers=product.dimension_numbers)
    nblocks = s_shape[axis] // block
    s_rank = len(s_shape)
    l_dtype = s_dtype if wide is None else wide
    (pc_l, pc_r), (pb_l, pb_r) = product.dimension_numbers
    p_batch = pb_l if p_first else pb_r
    # The weights as the product reads them: the logits' layout less the size-1 axes ``squeezed``.
    p_of = {d: d - sum(1 for e in squeezed if e < d) for d in range(s_rank) if d not in squeezed}
    p_axis = p_of[axis]
    p_rank = s_rank - len(squeezed)
    p_free = [d for d in range(p_rank) if d != p_axis and d not in p_batch]
    out_rank = len(out_aval.shape)
    nb = len(p_batch)

    def layout(weights_first: bool) -> tuple[list, list, tuple]:
        """Where each of the weights' axes but the key axis lands in the product's output, with the weights as
        its first operand or its second; the order that sorts them, and the sorted places."""
        positions = []
        for d in range(p_rank):
            if d == p_axis:
                continue
            if d in p_batch:
                positions.append(list(p_batch).index(d))
            else:
                off = nb if weights_first else nb + (out_rank - nb - len(p_free))
                positions.append(off + p_free.index(d))
        return positions, list(np.argsort(positions)), tuple(sorted(positions))

    positions, order, sorted_pos = layout(p_first)  # the original's, which the backward keeps
    # The forward's own product: the weights first, v read as [batch, keys, free] (transposed once, before the
    # loops), so that a block of v is contiguous and the output and accumulator come in the order XLA's product
    # writes them; the output is put in the original's order once, after the loops.
    v_batch = pb_r if p_first else pb_l
    v_rank = out_rank - len(p_free) + 1
    v_free = [d for d in range(v_rank) if d != v_key and d not in v_batch]
    v_perm = tuple(v_batch) + (v_key,) + tuple(v_free)
    fwd_params = dict(pv_params, dimension_numbers=(((p_axis,), (nb,)), (tuple(p_batch), tuple(range(nb)))))
    # the original output's axis i is the forward product's axis out_perm[i]
    out_perm = tuple(range(out_rank)) if p_first else (tuple(range(nb)) + tuple(
        nb + len(p_free) + j for j in range(len(v_free))) + tuple(nb + i for i in range(len(p_free))))
    f_out_shape = tuple(out_aval.shape[out_perm.index(i)] for i in range(out_rank))
    f_positions, f_order, f_sorted = layout(True)
    acc_dtype = jnp.promote_types(out_aval.dtype, jnp.float32)

    row_squeezed = tuple(e - (e > axis) for e in squeezed)
    row_shape = tuple(d for i, d in enumerate(s_shape) if i != axis)
    s_q = logits.query_axis
    if s_q is not None and s_q in p_of:  # where the queries lie in the per-row values and in the outputs
        row_q = s_q - (s_q > axis)
        q_place = [d for d in range(p_rank) if d != p_axis].index(p_of[s_q])
        out_q, g_q = f_positions[q_place], positions[q_place]  # in the forward's output, in the original's
    if query_block is not None:
        forward_q = tuple(logits.forward_query_axes)
    bq = backward_query_block
    if logits.query_axes is None or s_q is None or s_q not in p_of:
        bq = None  # the backward runs over every query at once
    pairs = nblocks * (1 if bq is None else s_shape[s_q] // bq)

    def to_out(row: Any, shape: tuple) -> Any:  # a per-row value in the forward's output's layout
        row = lax.squeeze(row, row_squeezed) if row_squeezed else row
        row = lax.transpose(row, tuple(f_order)) if f_order != sorted(f_order) else row
        return lax.broadcast_in_dim(row, shape, f_sorted)

    def from_out(x: Any) -> Any:  # the output's per-row sums, in the logits' order
        other = tuple(d for d in range(out_rank) if d not in sorted_pos)
        r = jnp.sum(x, axis=other)
        inv = list(np.argsort(order))
        r = lax.transpose(r, tuple(inv)) if inv != sorted(inv) else r
        return lax.expand_dims(r, row_squeezed) if row_squeezed else r

    def product_of(p: Any, vb: Any, own: bool = False) -> Any:
        # the weights as the original rounds them before its product (bf16 weights of an f32 softmax); ``own``:
        # the forward's product (weights first, v transposed to v_perm)
        p = p if cast is None else p.astype(cast)
        p = lax.squeeze(p, squeezed) if squeezed else p
        if own:
            return lax.dot_general(p, vb, **fwd_params)
        args = (p, vb) if p_first else (vb, p)
        return lax.dot_general(*args, **pv_params)

    narrow = jnp.dtype(out_aval.dtype) != jnp.dtype(acc_dtype)

    def wide_product(p: Any, vb: Any) -> Any:
        # the backward's product, summed in the accumulator's precision: the weights' value rounded as the
        # original rounds them (bf16 weights of an f32 softmax), their cotangent not rounded (the rounding's
        # transpose rounds it, and XLA, which allows excess precision, dropped that in one loop and not the other)
        if cast is not None:
            p = p + lax.stop_gradient(p.astype(cast).astype(p.dtype) - p)
        p = lax.squeeze(p, squeezed) if squeezed else p
        p, vb = p.astype(acc_dtype), vb.astype(acc_dtype)
        params = dict(pv_params, preferred_element_type=acc_dtype)
        return lax.dot_general(*((p, vb) if p_first else (vb, p)), **params)

    def expand(row: Any) -> Any:
        return jnp.expand_dims(row, axis)

    def over_keys(ahead: Sequence[Any], v: Any, qstart: Any = None) -> tuple[Any, Any, Any]:
        """The online softmax over key blocks for every query, or for ``query_block`` queries from ``qstart``
        (the operands already cut to them): the output, the rows' shift and sum."""
        cut = (lambda shape, ax: shape) if qstart is None else (
            lambda shape, ax: tuple(query_block if i == ax else d for i, d in enumerate(shape)))
        m0 = jnp.full(cut(row_shape, None if query_block is None else row_q), -jnp.inf, s_dtype)
        l0 = jnp.zeros(m0.shape, l_dtype)
        o_shape = cut(f_out_shape, None if query_block is None else out_q)
        a0 = jnp.zeros(o_shape, acc_dtype)
        queries = None if qstart is None else Window(qstart, query_block)

        def body(carry: tuple, j: Any) -> tuple:
            m, l, acc = carry
            start = j * block
            s = forward_block(ahead, Window(start, block), queries).astype(s_dtype)
            m_new = jnp.maximum(m, jnp.max(s, axis=axis))
            # A row whose scores so far are all -inf is shifted by 0: exp(-inf - 0) = 0, not NaN.
            shift = jnp.where(m_new == -jnp.inf, jnp.zeros((), s_dtype), m_new)
            p = jnp.exp(s - expand(shift))
            alpha = jnp.exp(m - shift)
            vb = lax.dynamic_slice_in_dim(v, start, block, axis=nb)
            pv = product_of(p, vb, own=True).astype(acc_dtype)
            acc = acc * to_out(alpha, o_shape).astype(acc_dtype) + pv
            return (m_new, l * alpha.astype(l_dtype) + jnp.sum(p.astype(l_dtype), axis=axis), acc), None

        (m, l, acc), _ = lax.scan(body, (m0, l0, a0), jnp.arange(nblocks))
        out = (acc / to_out(l, o_shape).astype(acc_dtype)).astype(out_aval.dtype)
        # The backward's weights are exp(s - shift) / l: kept apart, since m + log(l) loses log(l) when m is
        # finfo.min (a row masked everywhere with finfo.min, which averages uniformly).
        return out, jnp.where(m == -jnp.inf, jnp.zeros((), s_dtype), m), l

    def forward(operands: Sequence[Any], v: Any) -> tuple[Any, Any]:
        ahead = prepare(operands)
        v = lax.transpose(v, v_perm) if v_perm != tuple(range(v_rank)) else v
        back = (lambda o: lax.transpose(o, out_perm)) if out_perm != tuple(range(out_rank)) else (lambda o: o)
        if query_block is None:
            out, shift, l = over_keys(ahead, v)
            return back(out), (shift, l)

        def body(carry: tuple, i: Any) -> tuple:  # one block of queries: its operands cut, its rows written in place
            out, shift, l = carry
            qstart = i * query_block
            # the operands with queries and no keys cut here, once; those with both in the loop, a block of each
            cut = [x if a is None or k is not None else lax.dynamic_slice_in_dim(x, qstart, query_block, axis=a)
                   for x, a, k in zip(ahead, forward_q, forward_keys)]
            o, sh, lb = over_keys(cut, v, qstart)
            return (lax.dynamic_update_slice_in_dim(out, o, qstart, axis=out_q),
                    lax.dynamic_update_slice_in_dim(shift, sh, qstart, axis=row_q),
                    lax.dynamic_update_slice_in_dim(l, lb, qstart, axis=row_q)), None

        init = (jnp.zeros(f_out_shape, out_aval.dtype), jnp.zeros(row_shape, s_dtype), jnp.zeros(row_shape, l_dtype))
        (out, shift, l), _ = lax.scan(body, init, jnp.arange(s_shape[s_q] // query_block))
        return back(out), (shift, l)

    # traced once for the call and replayed for the fwd JAX traces at each joint program (replay.py)
    once = replayed(forward)

    @jax.custom_vjp
    def attend(operands: tuple, v: Any) -> Any:
        return once(operands, v)[0]

    def fwd(operands: tuple, v: Any) -> tuple:
        out, (shift, l) = once(operands, v)
        return out, (operands, v, out, shift, l)

    def bwd(res: tuple, g: Any) -> tuple:
        operands, v, out, shift, l = res
        floating = [jnp.issubdtype(x.dtype, jnp.inexact) for x in operands]
        query_axes = (None,) * len(operands) if bq is None else tuple(logits.query_axes)

        def window(t: Any) -> tuple[Any, Window | None]:
            """Pair ``t``'s first key and its window of queries (``None``: every query)."""
            if bq is None:
                return t * block, None
            return (t % nblocks) * block, Window((t // nblocks) * bq, bq)

        def rows(x: Any, queries: Window | None, axis_: int | None = None) -> Any:
            """A per-row value (or an array along ``axis_``) cut to the window of queries."""
            return x if queries is None else lax.dynamic_slice_in_dim(
                x, queries.start, bq, axis=row_q if axis_ is None else axis_)

        def add_rows(x: Any, y: Any, queries: Window | None, axis_: int | None = None) -> Any:
            """``x`` plus ``y``, which covers the window of queries only where one is given."""
            if queries is None:
                return x + y
            ax = row_q if axis_ is None else axis_
            return lax.dynamic_update_slice_in_dim(x, rows(x, queries, ax) + y, queries.start, axis=ax)

        def recompute(t: Any) -> tuple:
            """Pair ``t``'s weights as the backward uses them, their cotangent, v's block's cotangent and the
            scores' VJP (with respect to the operands, those that carry the queries and not the keys cut)."""
            start, queries = window(t)
            ops = [x if a is None or k is not None else rows(x, queries, a)
                   for x, a, k in zip(operands, query_axes, key_axes)]

            def s_of(*fl: Any) -> Any:
                it = iter(fl)
                full = [next(it) if f else x for x, f in zip(ops, floating)]
                return logits.block(full, Window(start, block), queries).astype(s_dtype).astype(acc_dtype)

            # The gradient is taken with respect to the whole float operands, under jit only the block is read.
            s, vjp_s = jax.vjp(s_of, *[x for x, f in zip(ops, floating) if f])
            # the sum as the program rounds it, then widened
            p = (jnp.exp(s - expand(rows(shift, queries).astype(acc_dtype)))
                 / expand(rows(l, queries).astype(s_dtype).astype(acc_dtype)))
            vb = lax.dynamic_slice_in_dim(v, start, block, axis=v_key)
            gb = g if queries is None else rows(g, queries, g_q)
            if narrow:
                # The weights' cotangent from the cotangent and v as the original rounds them, summed in the
                # accumulator's precision and not rounded after: rounded to the output's dtype in the gradient's
                # loop and not in the row term's (XLA allows excess precision), the row term would not match.
                _, vjp_pv = jax.vjp(wide_product, p, vb)
                dp, dvb = vjp_pv(gb.astype(out_aval.dtype).astype(acc_dtype))
            else:
                _, vjp_pv = jax.vjp(product_of, p, vb)
                dp, dvb = vjp_pv(gb.astype(out_aval.dtype))
            return start, queries, p, dp.astype(acc_dtype), dvb, vjp_s

        if not narrow:
            d_row = from_out(g.astype(acc_dtype) * out.astype(acc_dtype))
        else:
            # In half precision the row term is sum(p * dp) over the very weights and cotangents the loop below
            # uses (one more pass over the blocks), not sum(g * out): the weights' cotangent is rounded to
            # the output's dtype per element, so the two differ by those roundings, and the logits' gradient
            # rows, which must sum to zero, would not.
            def rows_body(carry: tuple, t: Any) -> tuple:
                d, total = carry
                _, queries, p, dp, _, _ = recompute(t)
                return (add_rows(d, jnp.sum(p * dp, axis=axis), queries),
                        add_rows(total, jnp.sum(p, axis=axis), queries)), None

            zero = _zeros_after(g, row_shape, acc_dtype)
            (d_row, total), _ = lax.scan(rows_body, (zero, zero), jnp.arange(pairs))
            # over the weights' own sum, which the sum rounded to the logits' dtype leaves off 1 by its rounding:
            # the rows of p * (dp - d_row) then sum to zero as the exact weights' do
            d_row = d_row / jnp.where(total == 0, jnp.ones((), acc_dtype), total)
        # An operand without the key axis (q, a scale) sums its gradient over the key blocks: in the accumulator's
        # precision. The others' blocks are disjoint (each element written once), so they stay in their dtype.
        # made from the cotangent, so that XLA makes them when the backward starts (_zeros_after)
        grads0 = tuple(_zeros_after(g, x.shape, x.dtype if k is not None else jnp.promote_types(x.dtype, acc_dtype))
                       if f else None for x, f, k in zip(operands, floating, key_axes))
        dv0 = _zeros_after(g, v.shape, v.dtype)

        def body(carry: tuple, t: Any) -> tuple:
            grads, dv = carry
            start, queries, p, dp, dvb, vjp_s = recompute(t)
            ds = p * (dp - expand(rows(d_row, queries)))
            dl = iter(vjp_s(ds))
            # an operand cut to the queries gets its window's gradient; the others, a whole one
            grads = tuple(None if gr is None else add_rows(gr, next(dl).astype(gr.dtype),
                                                            None if a is None or k is not None else queries, a)
                          for gr, a, k in zip(grads, query_axes, key_axes))
            cur = lax.dynamic_slice_in_dim(dv, start, block, axis=v_key)
            dv = lax.dynamic_update_slice_in_dim(dv, cur + dvb.astype(dv.dtype), start, axis=v_key)
            return (grads, dv), None

        (grads, dv), _ = lax.scan(body, (grads0, dv0), jnp.arange(pairs))
        return tuple(None if gr is None else gr.astype(x.dtype) for gr, x in zip(grads, operands)), dv

    attend.defvjp(fwd, replayed(bwd))  # traced once per types, however many joint programs JAX traces (replay.py)

    def fn(*args: Any) -> Any:
        *operands, v = args
        return attend(tuple(operands), v)

    return fn


class Offer(NamedTuple):
    """One loop of :func:`blocked_attention` (its keyword arguments): over blocks of ``block`` keys, in the forward
    over blocks of ``query_block`` queries (``None``: every query at once), in the backward over blocks of
    ``backward_query_block`` queries (``None``: every query at once)."""

    block: int
    query_block: int | None
    backward_query_block: int | None


#: The key blocks to offer with :data:`SCORES_BAND` (each that makes two blocks or more and whose scores fit it).
BLOCKS = (128, 256, 512, 1024)
#: The bytes of one trip's block of scores the pack's loops are offered within (``attention_with``'s
#: ``scores_band``). On this 2-core CPU (1 MiB L2 each, 32 MiB L3 shared) the loops of 128-1024 keys, with query
#: blocks of 512 or without, that hold 4 MiB a trip measured fastest or within a few per cent at every shape timed;
#: 8 MiB as fast on a quiet machine (every query by 256 keys at [2, 4, 1024]); 2 MiB or less (one head's query blocks,
#: whose products are small) 1.03-1.34x the best, 16 MiB or more 1.08-2.3x (``benchmarks/results/attention.md``,
#: 2026-12-01). The cost model chooses among those within it; fewer loops also keep the rewrite's time. Opt-in:
#: ``attention_with(blocks=BLOCKS, scores_band=SCORES_BAND)``.
SCORES_BAND = (3.0 * 2 ** 20, 8.0 * 2 ** 20)


@dataclasses.dataclass(frozen=True)
class Blocking:
    """Which loops of :func:`blocked_attention` to build for a length of keys and of queries (:meth:`offers`): one
    per key block of ``blocks`` that makes two blocks or more, each over every query at once (``whole_queries``,
    or where no query block fits) and over each block of ``query_blocks`` that makes two or more; the backward
    over blocks of ``backward_query_block`` queries where that makes two blocks or more. With ``band`` (bytes,
    low and high) and the scores' rows known, only the loops whose block of scores (a trip's, float32) is within it,
    or where none is, the one nearest it (:meth:`scores_bytes`)."""

    blocks: tuple[int, ...] = (256,)
    query_blocks: tuple[int, ...] = (512,)
    whole_queries: bool = True
    backward_query_block: int | None = 512
    band: tuple[float, float] | None = None

    def offers(self, keys: int, queries: int, rows: int = 0) -> list[Offer]:
        """The loops for ``keys`` keys and ``queries`` queries (0: the queries cannot be cut into blocks), the logits
        ``rows`` rows in all (batch x heads x queries; 0: not known, no band)."""
        fits = lambda b, n: b is not None and n % b == 0 and n // b >= 2  # noqa: E731
        q_blocks = [b for b in self.query_blocks if fits(b, queries)]
        back = self.backward_query_block if fits(self.backward_query_block, queries) else None
        found = [Offer(b, qb, back) for b in self.blocks if fits(b, keys)
                 for qb in [None] * (self.whole_queries or not q_blocks) + q_blocks]
        if self.band is None or not rows or not found:
            return found
        lo, hi = self.band
        inside = [o for o in found if lo <= self.scores_bytes(o, queries, rows) <= hi]
        off = lambda o: abs(np.log(self.scores_bytes(o, queries, rows) / np.sqrt(lo * hi)))  # noqa: E731
        return inside or [min(found, key=off)]

    @staticmethod
    def scores_bytes(offer: Offer, queries: int, rows: int) -> int:
        """The bytes of one trip's block of scores (float32): its rows (a query block's share of ``rows`` where the
        queries are cut) by the key block."""
        share = rows if offer.query_block is None or not queries else rows // queries * offer.query_block
        return 4 * share * offer.block


@dataclasses.dataclass(frozen=True)
class Scores:
    """The logits of :func:`attention`: ``scale * q k^T + bias``, where ``mask`` and ``causal`` keep, else ``fill``.

    ``scale``: a number (``None``: 1). ``bias``: an array that broadcasts to the logits ``[..., Nq, Nk]``
    (``None``: none). ``mask``: a boolean array that broadcasts to them, true where a logit is kept.
    ``causal``: query ``i`` sees keys ``0 .. i`` only (``jnp.tril`` of the ``[Nq, Nk]`` ones). ``fill``:
    what a masked logit becomes; with ``-inf`` a row masked everywhere is NaN, as in ``jax.nn.softmax``."""

    scale: float | None = None
    bias: Any = None
    mask: Any = None
    causal: bool = False
    fill: float = -np.inf


def _leading(x: Any, rank: int) -> Any:
    return jnp.reshape(x, (1,) * (rank - x.ndim) + tuple(x.shape))


def attention(q: Any, k: Any, v: Any, *, scores: Scores = Scores(), block: int = 256,
              query_block: int | None = None) -> Any:
    """``softmax(s) v`` over blocks of ``block`` keys, ``s`` the logits ``scores`` describes; differentiable, with
    a backward that recomputes each block. ``q`` ``[..., Nq, D]``, ``k`` ``[..., Nk, D]``, ``v`` ``[..., Nk,
    Dv]`` (leading axes broadcast); ``Nk`` a multiple of ``block`` and ``Nq`` of ``query_block`` (the forward
    then also runs over blocks of queries). Half-precision logits are summed in float32, as ``jax.nn.softmax``
    sums them."""
    batch = tuple(jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    q, k, v = (jnp.broadcast_to(x, batch + tuple(x.shape[-2:])) for x in (q, k, v))
    nq, nk = q.shape[-2], k.shape[-2]
    rank = len(batch) + 2
    dtype = jnp.result_type(q, k)
    if nk % block or (query_block is not None and nq % query_block):
        raise ValueError(f"attention: {nk} keys in blocks of {block}, {nq} queries in blocks of {query_block}")
    extra = [_leading(jnp.asarray(x), rank) for x in (scores.bias, scores.mask) if x is not None]
    operands = [q, k] + extra
    key_axes = (None, rank - 2) + tuple(rank - 1 if x.shape[-1] != 1 else None for x in extra)
    query_axes = (rank - 2, None) + tuple(rank - 2 if x.shape[-2] != 1 else None for x in extra)

    def cut(x: Any, kax: int | None, qax: int | None, keys: Window, queries: Window | None) -> Any:
        x = x if kax is None else lax.dynamic_slice_in_dim(x, keys.start, keys.size, axis=kax)
        if queries is not None and kax is not None and qax is not None:  # those without the keys come cut
            x = lax.dynamic_slice_in_dim(x, queries.start, queries.size, axis=qax)
        return x

    def block_of(ops: Sequence[Any], keys: Window, queries: Window | None) -> Any:
        q, k, *rest = [cut(x, ka, qa, keys, queries) for x, ka, qa in zip(ops, key_axes, query_axes)]
        s = (q @ jnp.swapaxes(k, -1, -2)).astype(dtype)
        if scores.scale is not None:
            s = s * jnp.asarray(scores.scale, dtype)
        rest = iter(rest)
        if scores.bias is not None:
            s = s + next(rest).astype(dtype)
        keep = next(rest) if scores.mask is not None else None
        if scores.causal:
            rows = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0) + (0 if queries is None else queries.start)
            causal = rows >= lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1) + keys.start
            keep = causal if keep is None else keep & causal
        return s if keep is None else jnp.where(keep, s, jnp.asarray(scores.fill, dtype))

    logits = Logits(batch + (nq, nk), dtype, rank - 1, block_of, key_axes, query_axis=rank - 2,
                    forward_query_axes=query_axes, query_axes=query_axes)
    half = jnp.finfo(dtype).bits < 32
    product = ValueProduct(True, (((rank - 1,), (rank - 2,)), (tuple(range(rank - 2)),) * 2),
                           {"precision": None, "preferred_element_type": v.dtype}, rank - 2,
                           jax.ShapeDtypeStruct(batch + (nq, v.shape[-1]), v.dtype),
                           cast=None if v.dtype == dtype else v.dtype, wide=jnp.dtype(jnp.float32) if half else None)
    return blocked_attention(logits, product, block=block, query_block=query_block,
                             backward_query_block=query_block)(*operands, v)


class FusedAxes(NamedTuple):
    """Where :func:`fused_attention`'s operands keep the axes of ``jax.nn.dot_product_attention``'s layout
    (``None``: an axis of size one they lack, inserted). Batch axes ``b0`` and ``b1``, queries ``T``, keys
    ``S``, a group of query heads sharing a key head ``G``, the head dimension ``H``."""
    q: tuple  #: ``q``'s axes as ``[b0, T, b1, G, H]``
    k: tuple  #: ``k``'s axes as ``[b0, S, b1, H]``
    v: tuple  #: ``v``'s axes as ``[b0, S, b1, H]``
    bias: tuple  #: the bias's axes as ``[b0, T, b1, S]``
    out: tuple  #: for each axis of the result, its axis of ``[b0, T, b1, G, H]`` (``None``: a new axis of size one)


def fused_axes(dimension_numbers: Any, shape: tuple, ranks: tuple[int, int], key_axis: int,
               logits_axes: Sequence[int | None], product: ValueProduct, *, causal_axis: int | None = None,
               biased: bool = False) -> tuple[FusedAxes, bool] | None:
    """Where attention written as two ``dot_general`` products keep the axes of :func:`fused_attention`'s layout.

    The scores are a ``dot_general`` of ``q`` and ``k`` (either on the left; operands of ``ranks``) with
    ``dimension_numbers``, of ``shape``, the keys at ``key_axis``; the logits are the scores with their axes as
    ``logits_axes`` says (for each, the scores' axis; ``None``: one of size one they add); the weights (the
    logits less ``product.squeezed``) meet ``v`` in ``product``. ``causal_axis``: the scores' query axis that a
    causal mask compares (the queries are else the longer of at most two free axes, the other a group of query
    heads sharing a key head). Returns the :class:`FusedAxes` and whether ``q`` is the left operand, or
    ``None`` where the layout is not one the call takes (more than two batch axes, a bias over grouped heads, a
    causal mask over queries and keys of different lengths, ...)."""
    (lc, rc), (lb, rb) = dimension_numbers
    nb, rank = len(lb), len(shape)
    q_lhs = key_axis == rank - 1  # the query is the scores' left operand
    q_dots = [d for d in range(nb, rank) if d != key_axis]
    if nb > 2 or len(lc) != 1 or len(q_dots) not in (1, 2) or (not q_lhs and key_axis != nb):
        return None
    t_dot = causal_axis if causal_axis is not None else max(q_dots, key=lambda d: (shape[d], -d))
    if causal_axis is not None and shape[t_dot] != shape[key_axis]:
        return None  # queries and keys of different lengths: how a kernel aligns its causal mask varies
    g_dot = next((d for d in q_dots if d != t_dot), None)
    qb, kb = (lb, rb) if q_lhs else (rb, lb)
    qc, kc = (lc[0], rc[0]) if q_lhs else (rc[0], lc[0])
    q_rank, k_rank = ranks if q_lhs else ranks[::-1]
    if q_rank != rank or k_rank != nb + 2 or (g_dot is not None and biased):
        return None
    # The weights times v: the product's batch axes are the logits' batch axes that the weights keep, its
    # contraction the key axis, its free axes the query's; v has one more axis, the head dimension.
    (pc_l, pc_r), (pb_l, pb_r) = product.dimension_numbers
    p_first = product.weights_first
    p_batch, v_batch = (pb_l, pb_r) if p_first else (pb_r, pb_l)
    v_c = (pc_r if p_first else pc_l)[0]
    kept = [d for d in range(len(logits_axes)) if d not in product.squeezed]  # the weights' axes, as the logits'
    p_dot = [logits_axes[d] for d in kept]                                  # ... as the scores' (None: size one)
    if any(p_dot[p] is None or p_dot[p] >= nb for p in p_batch):
        return None
    v_axes: list[int | None] = []  # v's axis for each of the scores' batch axes (None: v lacks it)
    for i in range(nb):
        if i in p_dot and p_dot.index(i) in p_batch:
            v_axes.append(int(v_batch[list(p_batch).index(p_dot.index(i))]))
        elif i in p_dot or shape[i] != 1:
            return None
        else:
            v_axes.append(None)
    free = [p for p in range(len(kept)) if p not in p_batch and p_dot[p] != key_axis]
    v_rank = len(product.out.shape) - len(free) + 1
    v_free = [d for d in range(v_rank) if d not in v_batch and d != v_c]
    free_dots = [p_dot[p] for p in free]
    if len(v_free) != 1 or t_dot not in free_dots or any(d not in (t_dot, g_dot, None) for d in free_dots) \
            or (g_dot is not None and g_dot not in free_dots and shape[g_dot] != 1):
        return None
    q_axis_of = dict(zip(q_dots, [d for d in range(q_rank) if d not in qb and d != qc]))
    q_free, q_group = q_axis_of[t_dot], (q_axis_of[g_dot] if g_dot is not None else None)
    k_free = next(d for d in range(k_rank) if d not in kb and d != kc)

    def pad(batch: Sequence[int | None], seq: int, head: int) -> tuple:
        return (batch[0] if nb > 0 else None, seq, batch[1] if nb > 1 else None, head)

    # where each axis of the weights' product comes from in the call's output as [b0, T, b1, G, H]
    five = {t_dot: 1, g_dot: 3, None: None}
    src = [(0, 2)[p_dot[p]] for p in p_batch]
    src += [five[d] for d in free_dots] + [4] if p_first else [4] + [five[d] for d in free_dots]
    return FusedAxes(q=(qb[0] if nb > 0 else None, q_free, qb[1] if nb > 1 else None, q_group, qc),
                     k=pad(kb, k_free, kc), v=pad(v_axes, v_c, v_free[0]),
                     bias=pad(list(range(nb)), t_dot, key_axis), out=tuple(src)), q_lhs


def _arrange(x: Any, axes: Sequence[int | None]) -> Any:
    """``x`` with its axes in the order ``axes`` (``[b0, seq, b1, head]``, say); an axis given as ``None`` is
    inserted, of size one."""
    present = [a for a in axes if a is not None]
    y = lax.transpose(x, tuple(present)) if present != sorted(present) else x
    missing = tuple(i for i, a in enumerate(axes) if a is None)
    return lax.expand_dims(y, missing) if missing else y


def fused_attention(q: Any, k: Any, v: Any, bias: Any = None, *, axes: FusedAxes, scale: float | None = None,
                    causal: bool = False, implementation: str | None = None, dtype: Any = None) -> Any:
    """Attention as one ``jax.nn.dot_product_attention`` call (cuDNN's fused kernel where ``implementation``
    is ``"cudnn"``) on operands in any layout: each is put in the call's layout as ``axes`` says, the query
    heads of a group ``G`` run as heads of their own, and the result is laid out as ``axes.out`` says, of
    ``dtype`` (the query's by default).

    >>> import jax, jax.numpy as jnp
    >>> q, k, v = (jax.random.normal(jax.random.key(i), (16, 2, 8)) for i in range(3))  # [T, b0, H]
    >>> out = fused_attention(q, k, v, axes=FusedAxes(q=(1, 0, None, None, 2), k=(1, 0, None, 2),
    ...                       v=(1, 0, None, 2), bias=(), out=(1, 0, 4)), scale=0.5, implementation="xla")
    >>> ref = jax.nn.softmax(jnp.einsum("tbh,sbh->bts", q, k) * 0.5, axis=-1)
    >>> bool(jnp.allclose(out, jnp.einsum("bts,sbh->tbh", ref, v), atol=1e-6))
    True
    """
    b = None if bias is None else jnp.swapaxes(_arrange(bias, axes.bias), 1, 2)  # [b0, b1, T, S]
    q5 = _arrange(q, axes.q)
    n0, t, n1, g, h = q5.shape
    o = jax.nn.dot_product_attention(q5.reshape(n0, t, n1 * g, h), _arrange(k, axes.k), _arrange(v, axes.v),
                                     bias=b, scale=scale, is_causal=causal, implementation=implementation)
    o = o.reshape(n0, t, n1, g, h)
    present = [a for a in axes.out if a is not None]
    dropped = tuple(a for a in range(5) if a not in present)
    perm = tuple(sorted(present).index(a) for a in present)
    inserted = tuple(i for i, a in enumerate(axes.out) if a is None)
    o = lax.squeeze(o, dropped) if dropped else o
    o = lax.transpose(o, perm) if list(perm) != sorted(perm) else o
    o = lax.expand_dims(o, inserted) if inserted else o
    return o.astype(q.dtype if dtype is None else dtype)
