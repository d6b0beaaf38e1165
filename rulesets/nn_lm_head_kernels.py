"""The kernels of ``rulesets.nn_lm_head``: a language model's loss over token blocks, as plain JAX functions.

A cross-entropy over ``logits = cast(h @ W + b)`` (tokens x vocabulary) reads from the logits, per token,
their maximum, the sum of their exponentials (or its log), and maybe the label's logit, the logits' row
sums or a dense target's weighted sum. :func:`blocked_forward` computes those over blocks of tokens and keeps
no block; :func:`blocked_backward` computes each block again and keeps nothing of the forward;
:func:`blocked_loss` joins them as one ``jax.custom_vjp`` function, the node the pack's rules trace into the
e-graph. :func:`label_logit` and :func:`row_sums` read the same quantities from the product without a loop.
The forward computes a block's logits a vocabulary tile at a time and sums each row's exponentials by
tiles, rescaled to the row's shift (:func:`combine_tiles`); every other statistic is computed as the
original program does, elementwise operation for elementwise operation, and the products sum their
contraction in another order.

>>> import jax, jax.numpy as jnp
>>> h, w = jnp.ones((256, 8)), jnp.ones((8, 32)) / 8
>>> layout = Layout(h_perm=(0, 1), w_perm=(0, 1), rows=(256,), width=8, vocab=32)
>>> out = blocked_forward(h, w, layout=layout, block=128, reads=Reads(shift="finite", log=True))
>>> bool(jnp.allclose(out.normaliser, jax.nn.logsumexp(h @ w - out.max[:, None], axis=-1)))
True
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rewrite.loops import laid_out
from rewrite.rules.builder import standard_numpy
from rulesets.kernels.replay import replayed, traced_once

__all__ = ["Layout", "Reads", "Stats", "COLUMNS", "TILE", "ROWS_BYTES", "WHOLE_BYTES", "forward_rows",
           "blocked_forward", "blocked_backward", "blocked_loss", "combine_tiles", "label_logit", "row_sums",
           "label_column", "row_shift", "shift_kind", "known_shift_kind", "add_by_columns", "plus_terms",
           "label_plus_terms", "smoothed_sum"]

#: The widest column block of ``dW`` that the backward adds in one product (:func:`add_by_columns`).
COLUMNS = 2048

#: The vocabulary columns of a forward block's logits computed at a time (:func:`blocked_forward`): 512 columns
#: of 512 tokens hold 1 MiB (f32), read twice while in the cache.
TILE = 512

#: The bytes of ``h``'s rows, and of their logits' tile, that the forward computes at once (:func:`forward_rows`).
ROWS_BYTES = 4 * 2 ** 20

#: ``rulesets.nn_lm_head`` offers no loop where the program reads the exponentials ``exp(d - shift)`` whole besides
#: their sum (a backward as written: ``jax.value_and_grad``'s ``softmax - one_hot``, for which the logits are computed
#: whole, so the loop cannot hold less) and the logits take at most this many bytes. There the loops of the decision
#: corpus were never chosen, and measured slower or within 10% (flax_classifier_onehot, 256 x 1,000 f32: 0.78x and
#: 0.79x; nn_flax_mlp_step, 256 x 10: 1.06x and 1.10x); they were 465 of the classifier's 944 e-graph rows and a
#: quarter of its first call. Larger logits keep the loop offered beside a backward as written: it measured even at
#: flax_long_context_step's 2,048 x 512 (4 MiB, 0.99x-1.02x), and there its rows move the extraction of the step as
#: written (``benchmarks/results/log.md``, the fifty-first session, h-gate).
WHOLE_BYTES = 2 ** 20


class Layout(NamedTuple):
    """Where the logits' axes lie: ``h`` transposed by ``h_perm`` is tokens (``rows``) then width; ``W``
    transposed by ``w_perm`` is width then the vocabulary. ``bias`` says whether a bias vector is added,
    ``cast`` the dtype the sum is converted to (or ``None``), ``dot`` the product's ``precision`` and
    ``preferred_element_type`` as sorted items."""
    h_perm: tuple
    w_perm: tuple
    rows: tuple
    width: int
    vocab: int
    bias: bool = False
    cast: Any = None
    dot: tuple = ()

    @property
    def tokens(self) -> int:
        return int(np.prod(self.rows, dtype=np.int64))


class Reads(NamedTuple):
    """What the loop computes per token. ``shift`` is the program's shift of a row with maximum ``m``:
    ``"max"`` (``m``, as ``jax.nn.log_softmax``) or ``"finite"`` (``m`` where finite, else 0, as
    ``jax.nn.logsumexp``); ``log`` whether the normaliser is the sum's log. ``label``: the logit at an index
    (``fills``: an index outside the vocabulary reads ``fill``, NaN if ``None``; else the clamped column).
    ``row_sums``: the logits' sums over the vocabulary. ``target``: a dense target's ``sum(t * log_softmax)``,
    ``(logits - shift) - log(sum)`` weighted elementwise as the program does (needs ``log``)."""
    shift: str = "finite"
    log: bool = True
    label: bool = False
    fills: bool = False
    fill: float | None = None
    row_sums: bool = False
    target: bool = False


class Stats(NamedTuple):
    """Per token (flat): the logits' maximum, the normaliser, and what :class:`Reads` asked for (else ``None``)."""
    max: Any
    normaliser: Any
    label: Any = None
    row_sums: Any = None
    target: Any = None


def canonical(layout: Layout, h: Any, w: Any, b: Any) -> tuple[Any, Any, Any]:
    """``h`` as tokens x width, ``W`` as width x V, the bias as a vector (or ``None``)."""
    hc = lax.transpose(h, layout.h_perm) if layout.h_perm != tuple(range(h.ndim)) else h
    wc = lax.transpose(w, layout.w_perm) if layout.w_perm != tuple(range(w.ndim)) else w
    bv = None if b is None else jnp.reshape(b, (layout.vocab,))
    return lax.reshape(hc, (layout.tokens, layout.width)), lax.reshape(wc, (layout.width, layout.vocab)), bv


def _product(layout: Layout, hb: Any, wc: Any, bv: Any) -> Any:
    z = lax.dot_general(hb, wc, (((1,), (0,)), ((), ())), **dict(layout.dot))
    return z if bv is None else z + bv[None, :]


def _cast(layout: Layout, z: Any) -> Any:
    return z if layout.cast is None else z.astype(layout.cast)


def row_shift(kind: str, m: Any) -> Any:
    """The program's shift of rows whose maximum is ``m``: ``m`` itself, or ``m`` where finite and 0 elsewhere."""
    return m if kind == "max" else jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))


def shift_kind(shift_of: Any, shape: tuple, dtype: Any) -> str | None:
    """Which :func:`row_shift` ``shift_of`` computes (``"max"`` or ``"finite"``), run on rows' maxima of
    ``shape`` and ``dtype`` that differ in every row, infinities and NaN among them; ``None`` where it is
    neither, where its derivative is not 0 (it is not under ``stop_gradient``) or where it does not run."""
    size = int(np.prod(shape))
    specials = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, 1.5, -2.25, 3e4], np.float64)
    probe = np.arange(size, dtype=np.float64) * 0.37 - size * 0.1
    probe[: min(size, specials.size)] = specials[: min(size, specials.size)]

    def run(x: Any) -> tuple:  # one compiled program, not one per operation
        out, tangent = jax.jvp(lambda t: shift_of(t)[0], (x,), (jnp.ones_like(x),))
        return out, tangent, {kind: row_shift(kind, x) for kind in ("max", "finite")}

    try:  # compiled ahead and called on an array: it runs even while the program is traced (under jit, say)
        x = np.asarray(probe.reshape(shape), dtype)
        out, tangent, want = jax.jit(run).lower(jax.ShapeDtypeStruct(x.shape, x.dtype)).compile()(x)
    except Exception:  # noqa: BLE001  (a function the probe cannot run is not a known shift)
        return None
    out = np.asarray(out, np.float64).reshape(shape)
    if np.any(np.asarray(tangent, np.float64) != 0):
        return None
    return next((k for k in ("max", "finite") if np.array_equal(out, np.asarray(want[k], np.float64), equal_nan=True)),
                None)


def _unit(x: Any) -> Any:
    return lax.broadcast_in_dim(x, x.shape + (1,), tuple(range(x.ndim)))


def _finite(m: Any) -> Any:
    return lax.stop_gradient(lax.select(lax.is_finite(m), m, lax.full_like(m, 0)))


#: Shifts (functions of the rows' maxima) whose :func:`shift_kind` is ``"finite"``
#: by construction, in the dtypes of :data:`_IEEE`: ``jax.nn.logsumexp``'s (the maximum, guarded by
#: ``max(-inf, .)``, 0 where not finite, under ``stop_gradient``, as a column), and the same without the guard.
#: Every element of ``stop_gradient(where(isfinite(g(m)), g(m), 0))`` is the probe's ``row_shift("finite", m)``
#: of it: ``g(m)`` is ``m`` where ``m`` is finite, and not finite (``-inf``, or NaN where ``max`` returns
#: it) where ``m`` is not, so both give 0 there; the probe's first row is ``-inf``, so it is not ``"max"``,
#: and its tangent is 0.
_FINITE_SHIFTS = (lambda m: _unit(_finite(lax.max(jnp.asarray(-jnp.inf, m.dtype), m))), lambda m: _unit(_finite(m)))
#: Shifts whose :func:`shift_kind` is ``"max"`` by construction: ``jax.nn.log_softmax``'s (optax's
#: ``softmax_cross_entropy``: the maximum guarded by ``max(-inf, .)``, as a column, under ``stop_gradient``).
#: ``max(-inf, m)`` is ``m`` at every element, infinities and NaN among them (``lax.max`` propagates NaN), so it is
#: the probe's ``row_shift("max", m)``, and its tangent is 0. Read without the probe's compile: 46 ms of CPU in
#: flax_classifier_onehot's first call.
_MAX_SHIFTS = (lambda m: lax.stop_gradient(_unit(lax.max(jnp.asarray(-jnp.inf, m.dtype), m))),)
#: The dtypes with infinities and NaN (``float8_e4m3fn`` has no ``-inf``: its guard is NaN, and the probe says
#: something else there)
_IEEE = ("float16", "bfloat16", "float32", "float64")


def known_shift_kind(text: str, shape: tuple, dtype: Any) -> str | None:
    """``"finite"`` (``"max"``) where a shift's jaxpr ``text`` (over rows' maxima of ``shape`` and ``dtype``, no
    constants) is that of one of :data:`_FINITE_SHIFTS` (:data:`_MAX_SHIFTS`) there: the same program, so
    :func:`shift_kind`'s answer, read without compiling its probe (85-110 ms of CPU in each of flax_lm_step,
    flax_long_context_step and wholestep_linen_gpt, the first time their shape is seen); else ``None`` (then run
    :func:`shift_kind`)."""
    if np.dtype(dtype).name not in _IEEE:
        return None
    arg = jax.ShapeDtypeStruct(tuple(shape), dtype)
    among = lambda shifts: any(str(jax.make_jaxpr(f)(arg).jaxpr) == text for f in shifts)  # noqa: E731
    return "finite" if among(_FINITE_SHIFTS) else "max" if among(_MAX_SHIFTS) else None


def label_column(y: Any, vocab: int) -> tuple[Any, Any]:
    """``(safe, inside)``: each label clamped into the vocabulary (the column a ``clip`` gather reads), and
    whether it was in it. Compared by value in a dtype that holds ``vocab - 1`` (int8 labels with 200
    classes would wrap in int8)."""
    y = y.astype(y.dtype if jnp.iinfo(y.dtype).max >= vocab - 1 else jnp.int32)
    last = jnp.full((), vocab - 1, y.dtype)
    return lax.clamp(jnp.zeros((), y.dtype), y, last), (y >= 0) & (y <= last)


def label_logit(h: Any, w: Any, b: Any = None, labels: Any = None, *, layout: Layout, fills: bool = False,
                fill: float | None = None) -> Any:
    """The logits at ``labels`` (one per token, flat), from each label's column of ``W``: a tokens x width
    gather, never the logits."""
    hc, wc, bv = canonical(layout, h, w, b)
    safe, inside = label_column(labels.reshape(-1), layout.vocab)
    z = _label_rows(layout, hc, wc, bv, safe)
    return jnp.where(inside, z, jnp.asarray(jnp.nan if fill is None else fill, z.dtype)) if fills else z


def _label_rows(layout: Layout, hc: Any, wc: Any, bv: Any, safe: Any) -> Any:
    """The logits of rows ``hc`` (tokens x width) at the columns ``safe`` (one per row, in the vocabulary)."""
    cols = jnp.take(wc, safe, axis=1, mode="clip")  # width x tokens: the label's column per token
    z = lax.dot_general(hc, cols, (((1,), (0,)), ((0,), (1,))), **dict(layout.dot))
    if bv is not None:
        z = z + jnp.take(bv, safe, mode="clip")
    return _cast(layout, z)


def row_sums(h: Any, w: Any, b: Any = None, *, layout: Layout) -> Any:
    """The logits' sums over the vocabulary, ``h @ W.sum(-1) + sum(b)``, in at least float32, per token (flat)."""
    hc, wc, bv = canonical(layout, h, w, b)
    wide = jnp.promote_types(layout.cast or wc.dtype, jnp.float32)
    sums = lax.dot_general(hc.astype(wide), jnp.sum(wc.astype(wide), axis=1), (((1,), (0,)), ((), ())))
    return sums if bv is None else sums + jnp.sum(bv.astype(wide))


def plus_terms(x: Any, terms: Any, signs: tuple) -> Any:
    """``x`` plus each ``sign * term``, the last (innermost) first, as ``log_softmax(z)`` is ``(z - max) - log``."""
    for sign, term in reversed(list(zip(signs, terms))):
        x = x + term if sign > 0 else x - term
    return x


def label_plus_terms(base: Any, idx: Any, terms: Any, *, gather: Any, signs: tuple, fills: bool = False,
                     fill: float | None = None) -> Any:
    """``gather(base + terms, idx)`` for terms of size 1 along the vocabulary, as ``gather(base, idx) + terms``: a
    label gathered from ``log_softmax(z)`` is one gathered from ``z`` less the row's terms. Where ``fills``, an
    index outside the vocabulary reads ``fill`` (NaN if ``None``), as the gather does."""
    picked = plus_terms(gather(base, idx), terms, signs)
    if not fills:
        return picked
    inside = label_column(idx.reshape(picked.shape), base.shape[-1])[1]
    return jnp.where(inside, picked, jnp.asarray(jnp.nan if fill is None else fill, picked.dtype))


def smoothed_sum(a: Any, x: Any, q: Any, rows: Any, terms: Any, *, p: Any = None, signs: tuple, vocab: int) -> Any:
    """``sum((p a + q) * x)`` along the last axis, where ``x`` is logits plus ``sum(sign * term)`` (terms of size
    1 there) and ``rows`` the logits' row sums (:func:`row_sums`): ``p sum(a * x) + q (rows + V sum(sign * term))``.
    Only ``sum(a * x)`` reads ``x`` (a gather where ``a`` is one-hot)."""
    shape = x.shape[:-1]
    total = plus_terms(rows.astype(x.dtype).reshape(shape),
                       [jnp.asarray(vocab, x.dtype) * t.reshape(shape) for t in terms], signs)
    picked = jnp.sum(a * x, axis=-1)
    return (picked if p is None else p * picked) + q * total


def _blocks(x: Any, n: int, block: int) -> Any:
    return None if x is None else x.reshape((n, block) + x.shape[1:])


def _tile_stats(hb: Any, wc: Any, bv: Any, cols: Any = None, *, layout: Layout, tile: int) -> tuple:
    """Each vocabulary tile's ``(max, sum(exp(z - finite max)), z at cols)`` of the logits ``z = cast(hb @ W +
    b)``, tiles of ``tile`` columns (a ``lax.scan``, the remainder last), stacked: tiles x rows (the third
    ``None`` without ``cols``; each row's column is read from every tile, clamped into it). The tile's own
    shift is its maximum where finite, else 0, so that a tile masked with ``-inf`` sums to 0 and one holding
    ``+inf`` to ``inf``."""
    k, tail = divmod(layout.vocab, tile)

    def stats(wj: Any, bj: Any, at: Any) -> tuple:
        z = _cast(layout, _product(layout, hb, wj, bj))
        m = jnp.max(z, axis=1)
        total = jnp.sum(jnp.exp(z - row_shift("finite", m)[:, None]), axis=1)
        if cols is None:
            return m, total, None
        # the logit at the column by a masked sum, a pass over the tile beside its maximum's (a gather from each
        # tile measured 0.79x of the whole loss): x + -0.0 is x for every x, NaN and -0.0 included (a masked
        # maximum turned a NaN logit into -inf: XLA:CPU's vectorised max drops NaN)
        hit = lax.broadcasted_iota(cols.dtype, z.shape, 1) == (cols - at)[:, None]
        return m, total, jnp.sum(jnp.where(hit, z, jnp.full((), -0.0, z.dtype)), axis=1)

    def step(_: Any, j: Any) -> tuple:
        at = j * tile
        return None, stats(lax.dynamic_slice_in_dim(wc, at, tile, 1),
                           None if bv is None else lax.dynamic_slice_in_dim(bv, at, tile), at.astype(cols.dtype)
                           if cols is not None else at)

    one = lambda x: None if x is None else x[None]  # noqa: E731
    if k > 1:
        parts = [lax.scan(step, None, jnp.arange(k))[1]]
    else:
        parts = [tuple(one(x) for x in stats(wc[:, :tile], None if bv is None else bv[:tile], 0))]
    if tail:
        parts.append(tuple(one(x) for x in stats(wc[:, k * tile:], None if bv is None else bv[k * tile:], k * tile)))
    return tuple(None if x[0] is None else jnp.concatenate(x) if len(parts) > 1 else x[0] for x in zip(*parts))


def _tiled_rows(hb: Any, wc: Any, bv: Any, cols: Any, *, layout: Layout, tile: int, kind: str) -> tuple:
    """``(max, normaliser, logit at cols or None)`` of rows ``hb``, their logits computed by vocabulary tiles:
    the label's logit is the one its tile read."""
    m, s, picked = _tile_stats(hb, wc, bv, cols, layout=layout, tile=tile)
    rows, total = combine_tiles(m, s, kind)
    label = None if cols is None else jnp.take_along_axis(picked, (cols // tile)[None], axis=0, mode="clip")[0]
    return rows, total, label


def forward_rows(layout: Layout, block: int, itemsize: int, tile: int = TILE) -> int:
    """The tokens the forward computes at once: the most, a multiple of ``block`` that divides the tokens,
    whose rows of ``h`` and whose rows x ``tile`` logits each fit in :data:`ROWS_BYTES` (``block`` where none
    does). At N=2048, width 512, V=32,768 (f32) that is all 2048 tokens, ``W`` read once: measured 1.32x
    against 1.17x for 512-token blocks (``benchmarks/results/lm_head.md``)."""
    cap = ROWS_BYTES // (max(layout.width, tile) * itemsize)
    fits = [r for r in range(block, layout.tokens + 1, block) if layout.tokens % r == 0 and r <= cap]
    return max(fits, default=block)


def combine_tiles(m: Any, s: Any, kind: str) -> tuple[Any, Any]:
    """Rows' ``(max, sum(exp(z - row_shift(kind, max))))`` from their tiles' :func:`_tile_stats` (tiles first).

    Each tile's sum is rescaled by ``exp(tile shift - row shift)`` (at most 1 where the row's maximum is finite)
    and the tiles summed in at least float32. A tile that sums to 0 (every logit ``-inf``) adds 0. Where the
    row's maximum is not finite the rescaled sums give what the whole row gives: ``"finite"`` shifts by 0, so a
    ``+inf`` tile's sum is ``inf`` and a NaN tile's NaN, every tile ``-inf`` sums to 0; ``"max"`` shifts by the
    infinity or NaN itself, which makes every such row's sum NaN, as ``inf - inf`` and ``-inf + inf`` do.
    """
    rows = jnp.max(m, axis=0)
    shift = row_shift(kind, rows)
    wide = jnp.promote_types(s.dtype, jnp.float32)
    scaled = s.astype(wide) * jnp.exp(row_shift("finite", m).astype(wide) - shift.astype(wide)[None])
    total = jnp.sum(jnp.where(s == 0, jnp.zeros((), wide), scaled), axis=0).astype(s.dtype)
    if kind == "max":
        total = jnp.where(jnp.isfinite(rows), total, jnp.full((), jnp.nan, total.dtype))
    return rows, total


def blocked_forward(h: Any, w: Any, b: Any = None, labels: Any = None, target: Any = None, *, layout: Layout,
                    block: int, reads: Reads, tile: int = TILE, rows: int | None = None) -> Stats:
    """:class:`Stats` of ``logits = cast(h @ W + b)``, computed over blocks of ``block`` tokens (a ``lax.scan``
    that keeps no block). ``labels`` (any shape, one per token) is read where ``reads.label``; ``target``
    (the logits' shape) where ``reads.target``, a block of its rows per step.

    Without a target the logits are computed ``tile`` vocabulary columns at a time (:func:`_tile_stats`,
    :func:`combine_tiles`) for ``rows`` tokens at once (:func:`forward_rows` where ``None``), not ``block``: a
    rows x tile array is read twice (maximum, then sum; the label's column beside the maximum) while it is in
    the cache, where a block's whole logits are written out and read back from memory twice, and ``W`` is read
    once per rows, not per block. The rows' maxima and labels are the original's; their sums are each tile's,
    rescaled, so they differ from the original's by rounding. The backward keeps ``block`` (its logits'
    cotangent is what a block holds). A dense target reads ``(z - shift) - log(sum)`` elementwise, which needs
    the row's shift before the first tile: its blocks of ``block`` tokens hold their logits whole."""
    hc, wc, bv = canonical(layout, h, w, b)
    tc = target.reshape(layout.tokens, layout.vocab) if reads.target else None
    if _tiled(layout, reads, tile):
        rows = forward_rows(layout, block, jnp.dtype(hc.dtype).itemsize, tile) if rows is None else rows
        cols, inside = label_column(labels.reshape(-1), layout.vocab) if reads.label else (None, None)
        run = lambda hb, cb: _tiled_rows(hb, wc, bv, cb, layout=layout, tile=tile, kind=reads.shift)  # noqa: E731
        if rows == layout.tokens:
            m, total, label = run(hc, cols)
        else:
            n = layout.tokens // rows
            _, (m, total, label) = lax.scan(lambda _, x: (None, run(*x)), None,
                                            (_blocks(hc, n, rows), None if cols is None else cols.reshape(n, rows)))
        label = None if label is None else _filled(label.reshape(-1), inside, reads)
        weighted = None
    else:
        m, total, label, weighted = _block_loop(hc, wc, bv, labels, tc, layout=layout, block=block, reads=reads)
    # the log after the loop: in its body, log(sum(exp(z - shift))) is what nn_logsumexp rewrites
    stats = Stats(m.reshape(-1), (jnp.log(total) if reads.log else total).reshape(-1))
    if label is not None:
        stats = stats._replace(label=label.reshape(-1))
    if reads.row_sums:
        stats = stats._replace(row_sums=row_sums(h, w, b, layout=layout))
    return stats if weighted is None else stats._replace(target=weighted.reshape(-1))


def _tiled(layout: Layout, reads: Reads, tile: int) -> bool:
    """Does :func:`blocked_forward` compute the logits by vocabulary tiles (for rows of tokens, where it reads
    ``block`` only through :func:`forward_rows`)?"""
    return not reads.target and tile < layout.vocab


def _filled(label: Any, inside: Any, reads: Reads) -> Any:
    """``label`` where the index was ``inside`` the vocabulary, else the gather's fill, where ``reads.fills``."""
    if not reads.fills:
        return label
    return jnp.where(inside, label, jnp.asarray(jnp.nan if reads.fill is None else reads.fill, label.dtype))


def _block_loop(hc: Any, wc: Any, bv: Any, labels: Any, tc: Any, *, layout: Layout, block: int, reads: Reads) -> tuple:
    """``(max, normaliser, label, weighted)`` (the last two ``None`` unless read), ``block`` tokens x
    ``n`` blocks, of rows ``hc``: a loop over token blocks, each block's logits whole.

    The loop reads nothing computed from the inputs alone, which XLA:CPU computes first (its list scheduler takes
    the smallest allocations first) and holds until the loop: flax's seq2seq loss held its label columns of ``W``
    (tokens x width, gathered before the loop), its labels wrapped into the vocabulary, the loop's zeroed stacked
    results and its block index across its cross-attention's peak, 135,216 bytes more than its program as written.
    So the label's column is gathered and clamped a block at a time, the stacked results are carried, and what
    the loop starts from (the labels, the zeros, the index) is selected by :func:`_late`, made from ``hc``."""
    n = layout.tokens // block
    late = _late(hc)

    def stats(hb: Any, tb: Any, yb: Any) -> tuple:
        z = _cast(layout, _product(layout, hb, wc, bv))
        m = jnp.max(z, axis=1)
        shifted = z - row_shift(reads.shift, m)[:, None]
        total = jnp.sum(jnp.exp(shifted), axis=1)
        label = None
        if yb is not None:
            safe, inside = label_column(yb, layout.vocab)
            label = _filled(_label_rows(layout, hb, wc, bv, safe), inside, reads)
        weighted = None if tb is None else jnp.sum(tb * (shifted - jnp.log(total)[:, None]), axis=1)
        return m, total, label, weighted

    yl = None if not reads.label else jnp.where(late, jnp.zeros((), labels.dtype), labels).reshape(n, block)
    xs = (_blocks(hc, n, block), _blocks(tc, n, block), yl)
    types, again = traced_once(stats, *(None if x is None else x[0] for x in xs))

    def body(carry: tuple, x: tuple) -> tuple:
        i, out = carry
        put = lambda a, v: None if a is None else lax.dynamic_update_index_in_dim(a, v, i, 0)  # noqa: E731
        return (i + 1, tuple(put(a, v) for a, v in zip(out, again(*x)))), None

    init = tuple(None if t is None else jnp.broadcast_to(late.astype(t.dtype), (n, block)) for t in types)
    return lax.scan(body, (late.astype(jnp.int32), init), xs)[0][1]


def _late(hc: Any) -> Any:
    """``False``, computed from ``hc``'s first element (never both NaN and infinite): what the head's loop
    starts from is selected by it, so that XLA:CPU computes it once ``hc`` is, not first (:func:`_block_loop`)."""
    first = hc[0, 0]
    return jnp.isnan(first) & jnp.isinf(first)


def blocked_backward(h: Any, w: Any, b: Any, labels: Any, target: Any, cotangents: Stats, *, layout: Layout,
                     block: int, reads: Reads, columns: int = COLUMNS) -> tuple:
    """``(dh, dW, db, dtarget)``: the VJP of :func:`blocked_forward` at ``cotangents`` (a :class:`Stats`; the
    maximum's cotangent shared among ties as jax's rule for ``max`` does), each block's logits computed again.
    The cotangents of the label, the row sums and the target join each block's before the products:
    ``softmax - labels`` in one array, as autodiff of the original adds them (apart, a column of ``W`` that
    holds an infinity would give ``0 * inf - inf``, NaN, where the original has ``-inf``). ``dW`` and ``db``
    are summed over blocks in at least float32, ``dW`` added in place :func:`add_by_columns`. ``dtarget`` is
    ``None`` unless ``reads.target``."""
    n = layout.tokens // block
    hc, wc, bv = canonical(layout, h, w, b)
    dot = dict(layout.dot)
    precision = dot.get("precision")
    acc = jnp.promote_types(wc.dtype, jnp.float32)
    with_max = jnp.any(cotangents.max != 0)  # 0 where the program reads the maximum under stop_gradient only
    flat = lambda x: None if x is None else x.reshape(n, block)  # noqa: E731  (one value per token)
    xs = (_blocks(hc, n, block), flat(cotangents.max), flat(cotangents.normaliser),
          flat(labels) if reads.label else None, flat(cotangents.label) if reads.label else None,
          flat(cotangents.row_sums) if reads.row_sums else None,
          _blocks(target.reshape(layout.tokens, layout.vocab), n, block) if reads.target else None,
          flat(cotangents.target) if reads.target else None)

    def body(carry: tuple, x: tuple) -> tuple:
        dw, db = carry
        hb, gm, gs, yb, gl, gr, tb, gt = x
        pre = _product(layout, hb, wc, bv)
        z = _cast(layout, pre)
        m = jnp.max(z, axis=1)
        shifted = z - row_shift(reads.shift, m)[:, None]
        e = jnp.exp(shifted)
        total = jnp.sum(e, axis=1)
        if tb is not None:  # sum(t * (shifted - log)): the log's cotangent takes -g sum(t), shifted's g t
            gs = gs - gt * jnp.sum(tb, axis=1)
        dz = e * (gs / total if reads.log else gs)[:, None]

        def plus_max(dz: Any) -> Any:
            ties = z == m[:, None]
            share = gm / jnp.sum(ties, axis=1).astype(gm.dtype)
            return dz + jnp.where(ties, share[:, None], jnp.zeros((), z.dtype))

        dz = lax.cond(with_max, plus_max, lambda dz: dz, dz)
        if yb is not None:  # the label's cotangent at its column (none where the gather filled)
            safe, inside = label_column(yb, layout.vocab)
            col = jnp.where(inside, safe, -1) if reads.fills else safe
            hit = lax.broadcasted_iota(col.dtype, z.shape, 1) == col[:, None]
            dz = dz + jnp.where(hit, gl.astype(z.dtype)[:, None], jnp.zeros((), z.dtype))
        if gr is not None:
            dz = dz + gr.astype(z.dtype)[:, None]
        dt = None
        if tb is not None:
            dz = dz + gt[:, None] * tb
            dt = (gt[:, None] * (shifted - jnp.log(total)[:, None])).astype(tb.dtype)
        dz = dz.astype(pre.dtype)
        # h's block transposed first, so that the left operand of dW's product contracts its minor dimension
        dhb = lax.dot_general(dz, wc, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=hb.dtype)
        dw = add_by_columns(dw, lax.transpose(hb, (1, 0)), dz, precision=precision, acc=acc, columns=columns)
        return (dw, None if db is None else db + jnp.sum(dz.astype(acc), axis=0)), (dhb, dt)

    zero_b = None if bv is None else jnp.zeros(bv.shape, acc)
    with laid_out():  # the loop reads every token's h and cotangents as written: the scan pack sinks nothing in
        (dwc, dbv), (dhc, dtc) = lax.scan(body, (jnp.zeros(wc.shape, acc), zero_b), xs)
    dh = lax.transpose(dhc.reshape(tuple(h.shape[i] for i in layout.h_perm)), tuple(np.argsort(layout.h_perm)))
    dw = lax.transpose(dwc.astype(wc.dtype).reshape(tuple(w.shape[i] for i in layout.w_perm)),
                       tuple(np.argsort(layout.w_perm)))
    db = None if b is None else dbv.astype(bv.dtype).reshape(b.shape)
    return dh, dw, db, None if dtc is None else dtc.reshape(target.shape)


def blocked_loss(*, layout: Layout, block: int, reads: Reads, columns: int = COLUMNS, shapes: Stats | None = None):
    """``fn(h, W, b, labels, target) -> Stats``: :func:`blocked_forward` with :func:`blocked_backward` as its
    VJP (``b``, ``labels`` and ``target`` may be ``None``), each result reshaped to its entry of ``shapes``
    where given. The backward needs nothing of the forward, so under
    ``jax.grad``, where the forward's values are not read, XLA drops the forward loop. A target that is not
    differentiated has its cotangent dropped with the unread loop output (no tokens x vocabulary array)."""

    def once(itemsize: int) -> Any:
        """The forward, traced once for the call and replayed for the fwd of each joint program. Where it computes
        the logits by tiles it reads ``block`` only through its rows: it is called with those as its block, and
        its traces are shared by every block (and loss) of that forward (flax_lm_step's three blocks, one trace)."""
        tiled = _tiled(layout, reads, TILE)
        rows = forward_rows(layout, block, itemsize) if tiled else None
        kw = dict(layout=layout, block=block if rows is None else rows, reads=reads, tile=TILE, rows=rows)

        def stats_of(h: Any, w: Any, b: Any, labels: Any, target: Any) -> tuple:
            stats = blocked_forward(h, w, b, labels, target, **kw)
            # a plain tuple across the custom_vjp (what the rewrite cache writes), the Stats outside it
            return tuple(None if x is None else x.reshape(shape) for x, shape in zip(stats, shapes or stats_shapes))

        return replayed(stats_of, key=("nn_lm_head forward", tuple(sorted(kw.items())), shapes or stats_shapes))

    def forward(h: Any, w: Any, b: Any, labels: Any, target: Any) -> tuple:
        return once(jnp.dtype(h.dtype).itemsize)(h, w, b, labels, target)

    def fwd(h: Any, w: Any, b: Any, labels: Any, target: Any) -> tuple:
        return forward(h, w, b, labels, target), (h, w, b, labels, target)

    @standard_numpy()  # JAX runs it under the user's settings: strict promotion raised in bfloat16
    def bwd(res: tuple, g: tuple) -> tuple:
        dh, dw, db, dt = blocked_backward(*res, Stats(*g), layout=layout, block=block, reads=reads, columns=columns)
        return dh, dw, db, None, dt

    stats_shapes = Stats(*[(layout.tokens,)] * len(Stats._fields))
    fn = jax.custom_vjp(forward)
    fn.defvjp(fwd, bwd)
    return lambda h, w, b=None, labels=None, target=None: Stats(*fn(h, w, b, labels, target))


def add_by_columns(dw: Any, ht: Any, dz: Any, *, precision: Any, acc: Any, columns: int = COLUMNS) -> Any:
    """``dw + ht @ dz``, added ``columns`` columns at a time, in place.

    Added whole, ``ht @ dz`` is a second width x V array beside the carried ``dw`` (XLA does not add a product
    into its operand). Blocks sliced out of ``dw``, added and written back (``dynamic_update_slice`` in a
    ``fori_loop``, done in place) hold one width x ``columns`` block instead. Each column is the same dot
    product as the whole product's; a remainder narrower than a block is done last.
    """
    v = dz.shape[1]

    def product(cols: Any) -> Any:
        return lax.dot_general(ht, cols, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=acc)

    def add_at(dw: Any, at: Any, width: int) -> Any:
        cols = lax.dynamic_slice_in_dim(dz, at, width, 1)
        return lax.dynamic_update_slice_in_dim(dw, lax.dynamic_slice_in_dim(dw, at, width, 1) + product(cols), at, 1)

    if v <= columns:
        return dw + product(dz)
    k, tail = divmod(v, columns)
    dw = lax.fori_loop(0, k, lambda j, dw: add_at(dw, j * columns, columns), dw)
    return add_at(dw, k * columns, tail) if tail else dw
