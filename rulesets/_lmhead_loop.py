"""The loop of ``rulesets.nn``'s language-model head (:mod:`rulesets.nn_lmhead`): the logits by token blocks.

:func:`_normaliser` builds the ``jax.custom_vjp`` function the head's rules trace into the e-graph: a
``lax.scan`` over blocks of tokens that computes each block's logits, their maximum and the sum of their
exponentials (and, where the rule found the program's labels, the label's logit), and a backward that
computes each block again and keeps nothing of the forward.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _canonical(spec: tuple, h: Any, w: Any, b: Any) -> tuple[Any, Any, Any]:
    """``h`` as tokens x width, ``W`` as width x V, the bias as a vector (or ``None``)."""
    h_perm, w_perm, rows, c, v, _, _, _ = spec
    hc = lax.reshape(lax.transpose(h, h_perm) if h_perm != tuple(range(h.ndim)) else h, (int(np.prod(rows)), c))
    wc = lax.reshape(lax.transpose(w, w_perm) if w_perm != tuple(range(w.ndim)) else w, (c, v))
    return hc, wc, (None if b is None else jnp.reshape(b, (v,)))


def _logits(spec: tuple, hb: Any, wc: Any, b: Any) -> Any:
    """One block of logits, as the original computes them: the product, the bias added, the cast."""
    _, _, _, _, _, _, cast, dot = spec
    z = lax.dot_general(hb, wc, (((1,), (0,)), ((), ())), **dict(dot))
    if b is not None:
        z = z + b[None, :]
    return z if cast is None else z.astype(cast)


def _shift(m: Any) -> Any:
    """The shift the loop's sum uses: the maximum where finite, else 0 (so that ``-inf`` rows sum to 0)."""
    return jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))


# ---------------------------------------------------------------------- the normaliser over token blocks
def _sigma(kind: str, m: Any) -> Any:
    """The program's shift of a row whose maximum is ``m``: ``m`` itself, or ``m`` where finite and 0 elsewhere."""
    return m if kind == "max" else _shift(m)


def _normaliser(spec: tuple, block: int, kind: str, log: bool, out_shape: tuple, label: tuple | None = None):
    """``fn(h, W, [b]) -> (max(logits), s)`` over token blocks, ``s = sum(exp(logits - shift))`` or its log.

    One ``jax.custom_vjp`` function with both results, so that the program's maximum and its normaliser are
    the two results of one node (extraction moves both at once). Every row's logits are in one block, so
    each block computes the maximum, the program's shift (``kind``, see :func:`_shift_kind`) and the sum as
    the program does, row by row. The backward keeps nothing from the forward: it computes each block
    again, sum included, so under ``jax.grad`` (where the forward's values are not read) XLA drops the
    forward loop, and the gradient costs three products, as the original's does.

    With ``label = (fills, fill, shape, rows)``, ``fn(h, W, [b], idx)`` also returns the label's logit
    (:func:`_label_logit`: ``fill``, or NaN, for an index outside the vocabulary where ``fills``, else the
    clamped column, as the program's gather does) and, where ``rows``, the logits' row sums
    (:func:`_row_sums`, for smoothed labels); the backward adds their cotangents to each block's ``dz``
    before the products (the label's at its column, the row sums' to every column): ``softmax - labels`` in
    one array, as autodiff of the original adds them, so a column of ``W`` that holds an infinity gives the
    original's ``-inf`` (``-1 * inf``) where the terms apart would give ``0 * inf - inf``, NaN.
    """
    h_perm, w_perm, rows, c, v, has_bias, cast, dot = spec
    r = int(np.prod(rows))
    n = r // block
    h_inv = tuple(int(i) for i in np.argsort(h_perm))
    w_inv = tuple(int(i) for i in np.argsort(w_perm))
    dot = dict(dot)
    precision = dot.get("precision")
    fills, fill, label_shape, with_rows = label if label is not None else (False, None, None, False)

    def stats(z: Any) -> tuple[Any, Any]:
        m = jnp.max(z, axis=1)
        return m, jnp.sum(jnp.exp(z - _sigma(kind, m)[:, None]), axis=1)

    def column(y: Any) -> Any:
        """Each row's label column as the gather reads it; -1 (no column) where it fills instead."""
        safe, inside = _label_column(y, v)
        return jnp.where(inside, safe, -1) if fills else safe

    def forward(h: Any, w: Any, b: Any, y: Any) -> tuple:
        hc, wc, bv = _canonical(spec, h, w, b)

        def body(_: Any, hb: Any) -> tuple:
            return None, stats(_logits(spec, hb, wc, bv))

        _, (m, total) = lax.scan(body, None, lax.reshape(hc, (n, block, c)))
        # the log after the loop: in its body, log(sum(exp(z - shift))) is what nn_logsumexp rewrites
        res = (m.reshape(rows), (jnp.log(total) if log else total).reshape(out_shape))
        if y is None:
            return res
        # the label's logit from its column of W, for all tokens at once (a gather from each block's logits
        # would read the block, as the cost model prices a gather)
        head = (h, w) + ((b,) if has_bias else ())
        res = res + (_label_logit(spec, fills, fill, label_shape)(*head, y),)
        return res + (_row_sums(spec)(*head),) if with_rows else res

    @jax.custom_vjp
    def normaliser(h: Any, w: Any, b: Any, y: Any) -> tuple:
        return forward(h, w, b, y)

    def fwd(h: Any, w: Any, b: Any, y: Any) -> tuple:
        return forward(h, w, b, y), (h, w, b, y)

    def bwd(res: tuple, g: tuple) -> tuple:
        h, w, b, y = res
        gm, gs = g[:2]
        hc, wc, bv = _canonical(spec, h, w, b)
        # The maximum's own cotangent (jax's rule for max shares it among the ties): 0 where the program reads
        # the maximum only under stop_gradient, as it shifts; its term is skipped then.
        with_max = jnp.any(gm != 0)
        labels = None if y is None else (y.reshape(n, block), g[2].reshape(n, block),
                                         g[3].reshape(n, block) if with_rows else None)
        xs = (lax.reshape(hc, (n, block, c)), gm.reshape(n, block), gs.reshape(n, block), labels)
        acc = jnp.promote_types(wc.dtype, jnp.float32)  # dW summed over blocks in f32, rounded once at the end

        def body(carry: tuple, x: tuple) -> tuple:
            dw, db = carry
            hb, gmb, gsb, lab = x
            pre = lax.dot_general(hb, wc, (((1,), (0,)), ((), ())), **dot)
            if bv is not None:
                pre = pre + bv[None, :]
            z = pre if cast is None else pre.astype(cast)
            m = jnp.max(z, axis=1)
            e = jnp.exp(z - _sigma(kind, m)[:, None])
            scale = gsb / jnp.sum(e, axis=1) if log else gsb
            dz = e * scale[:, None]

            def plus_max(dz: Any) -> Any:
                ties = z == m[:, None]
                share = gmb / jnp.sum(ties, axis=1).astype(gmb.dtype)
                return dz + jnp.where(ties, share[:, None], jnp.zeros((), z.dtype))

            dz = lax.cond(with_max, plus_max, lambda dz: dz, dz)
            if lab is not None:  # the label's cotangent at its column (none where the gather filled)
                yb, glb, grb = lab
                col = column(yb)
                hit = lax.broadcasted_iota(col.dtype, z.shape, 1) == col[:, None]  # (col's dtype holds v - 1)
                dz = dz + jnp.where(hit, glb.astype(z.dtype)[:, None], jnp.zeros((), z.dtype))
                if grb is not None:
                    dz = dz + grb.astype(z.dtype)[:, None]
            dz = dz.astype(pre.dtype)
            # The products' transposes written out: h's block transposed first, so that the left operand of
            # dW's product contracts its minor dimension (XLA:CPU's library path; rewrite/cost/dot.py).
            dhb = lax.dot_general(dz, wc, (((1,), (1,)), ((), ())), precision=precision,
                                  preferred_element_type=hb.dtype)
            dw = _add_by_columns(dw, lax.transpose(hb, (1, 0)), dz, precision, acc)
            return (dw, None if db is None else db + jnp.sum(dz.astype(acc), axis=0)), dhb

        zero_b = None if bv is None else jnp.zeros(bv.shape, acc)
        (dwc, dbv), dhc = lax.scan(body, (jnp.zeros(wc.shape, acc), zero_b), xs)
        dh = lax.transpose(dhc.reshape(tuple(h.shape[i] for i in h_perm)), h_inv)
        dw = lax.transpose(dwc.astype(wc.dtype).reshape(tuple(w.shape[i] for i in w_perm)), w_inv)
        db = None if b is None else dbv.astype(bv.dtype).reshape(b.shape)
        return dh, dw, db, None

    normaliser.defvjp(fwd, bwd)

    def fn(h: Any, w: Any, *rest: Any) -> tuple:
        b = rest[0] if has_bias else None
        return normaliser(h, w, b, rest[-1].reshape(-1) if label is not None else None)

    return fn


def _holding(dtype: Any, v: int) -> Any:
    """An integer dtype that holds every value of ``dtype`` and ``v - 1``: ``dtype`` itself, or int32 for
    labels narrower than the vocabulary (int8 labels with 200 classes: ``v - 1`` in int8 would wrap)."""
    return dtype if jnp.iinfo(dtype).max >= v - 1 else jnp.int32


def _label_column(y: Any, v: int) -> tuple[Any, Any]:
    """``(safe, inside)``: each label clamped into the vocabulary (the column a ``clip`` gather reads), and
    whether it was in it (where a ``fill`` gather reads a column at all). Compared as the gather reads an
    index, by its value: in a dtype that holds ``v - 1`` (:func:`_holding`)."""
    y = y.astype(_holding(y.dtype, v))
    last = jnp.full((), v - 1, y.dtype)
    return lax.clamp(jnp.zeros((), y.dtype), y, last), (y >= 0) & (y <= last)


def _label_logit(spec: tuple, fills: bool, fill: Any, out_shape: tuple):
    """``fn(h, W, [b], idx)``: the logits at ``idx`` (one per row), from the label's column of ``W``."""
    has_bias, v = spec[5], spec[4]

    def fn(*args: Any) -> Any:
        h, w, *rest = args
        b = rest[0] if has_bias else None
        idx = rest[-1].reshape(-1)
        hc, wc, bv = _canonical(spec, h, w, b)
        safe, inside = _label_column(idx, v)
        cols = jnp.take(wc, safe, axis=1, mode="clip")  # width x tokens: the label's column per token
        _, _, _, _, _, _, cast, dot = spec
        z = lax.dot_general(hc, cols, (((1,), (0,)), ((0,), (1,))), **dict(dot))
        if bv is not None:
            z = z + jnp.take(bv, safe, mode="clip")
        z = z if cast is None else z.astype(cast)
        if fills:
            value = jnp.nan if fill is None else fill
            z = jnp.where(inside, z, jnp.asarray(value, z.dtype))
        return z.reshape(out_shape)

    return fn


def _row_sums(spec: tuple):
    """``fn(h, W, [b])``: the logits' sums over the vocabulary, ``h @ W.sum(-1) + sum(b)``, in at least float32,
    one per token (``nn_lm_head_smooth``'s ``sum(x)``; the loop returns them where the program smooths its
    labels)."""
    has_bias, cast = spec[5], spec[6]

    def fn(h: Any, w: Any, *rest: Any) -> Any:
        hc, wc, bv = _canonical(spec, h, w, rest[0] if has_bias else None)
        wide = jnp.promote_types(cast or wc.dtype, jnp.float32)
        rows = lax.dot_general(hc.astype(wide), jnp.sum(wc.astype(wide), axis=1), (((1,), (0,)), ((), ())))
        return rows if bv is None else rows + jnp.sum(bv.astype(wide))

    return fn


#: The widest column block of ``dW`` that the backward adds in one product (:func:`_add_by_columns`).
COLUMNS = 2048


def _add_by_columns(dw: Any, ht: Any, dz: Any, precision: Any, acc: Any) -> Any:
    """``dw + ht @ dz``, the block's product added column block by column block, in place.

    Added whole, the block's ``ht @ dz`` is a second width x V array beside the carried ``dw`` (XLA does not
    add a product into its operand), which would make the weight gradient hold two of them. Blocks of at most
    :data:`COLUMNS` columns, each sliced out of ``dw``, added and written back (``dynamic_update_slice`` in a
    ``fori_loop``, which XLA does in place), hold one width x ``COLUMNS`` block instead. Each column of the
    result is the same dot product as the whole product's; a remainder narrower than a block is done last.
    """
    v = dz.shape[1]

    def product(cols: Any) -> Any:
        return lax.dot_general(ht, cols, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=acc)

    def add_at(dw: Any, at: Any, width: int) -> Any:
        cols = lax.dynamic_slice_in_dim(dz, at, width, 1)
        return lax.dynamic_update_slice_in_dim(dw, lax.dynamic_slice_in_dim(dw, at, width, 1) + product(cols), at, 1)

    if v <= COLUMNS:
        return dw + product(dz)
    k, tail = divmod(v, COLUMNS)
    dw = lax.fori_loop(0, k, lambda j, dw: add_at(dw, j * COLUMNS, COLUMNS), dw)
    return add_at(dw, k * COLUMNS, tail) if tail else dw
