"""Which of XLA:CPU's two matrix-multiply paths a ``dot_general`` takes, and what the generic one costs more.

XLA:CPU runs a product through its library (YNN) kernels only when the left
operand contracts its minor-most dimensions, batch dimensions aside (a row-major ``[M, K]``
times anything); a left operand that contracts a major dimension (``[K, M]``,
which ``jnp.einsum("hkd,hqk->hdq", v, p)`` writes, and which ``linalg``'s rules
reach by swapping a product's operands) goes to the generic Eigen path. That holds of a product
XLA leaves as written (:func:`canonical`); any other (flax's heads between batch and sequence, two
contracted dimensions) its ``DotDecomposer`` rewrites into ``[B, M, K] x [B, K, N]`` first, copying the
operands stored otherwise (:func:`copied`), and the library takes it.

What the generic path costs more is mostly a fixed amount per element of the left
operand, not per flop: ``python -m benchmarks.dot_paths`` (results in
``benchmarks/results/dot_paths.md``) timed both layouts of 32 products (56 timings), plain and
batched, alone and inside a ``scan``, on this 2-core CPU: the generic path took
1.7-4x the library path's time at ``N = 64`` (attention's ``v^T p^T``; ``N`` the
right operand's free size), 1.3-2.5x at ``N = 256`` and 0.95-1.2x at ``N >= 1024``
(a dense layer's weight gradient). The ratio fitted is ``FALLBACK + REPACK / (2 N)``
(2.5x, 1.4x, 1.2x; RMS log error 0.24, against 0.55 for a flat 2.4x). So the generic
path is priced at ``FALLBACK`` times the flops plus ``REPACK`` flops per element
of the left operand (``AnalyticCost.dot_fallback``, ``AnalyticCost.dot_repack``), for contractions of
:data:`MIN_CONTRACTION` or more. Shorter ones are priced alike on both paths: they measured up to 3x
apart, but on products of 0.1-0.5 ms, and a recurrent cell's [16, 256] x [16, 16] weight gradient, swapped
to put the small operand on the left, ran slower (the decision corpus's ``ecosystem_flax_rnn_grad``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

#: The contraction length below which both paths are priced alike.
MIN_CONTRACTION = 256

#: How much dearer a flop is on the generic path than on the library path, per backend (1.0: no difference).
FALLBACK = {"cpu": 1.1}

#: What the generic path costs beyond that per element of its left operand, in flops, per backend.
REPACK = {"cpu": 175.0}


def canonical(params: Mapping[str, Any], in_avals: Sequence[Any]) -> bool:
    """Whether XLA leaves this ``dot_general`` as it is written (``DotDecomposer``'s ``IsCanonical``, both operands):
    one contracting dimension, at most one free one, and the batch dimensions first, in order. XLA rewrites any
    other product into ``[B, M, K] x [B, K, N]`` first, transposing each operand (:func:`copied`).

    >>> from jax.core import ShapedArray
    >>> import jax.numpy as jnp
    >>> v = ShapedArray((2, 1024, 2, 32), jnp.float32); p = ShapedArray((2, 2, 256, 1024), jnp.float32)
    >>> canonical({"dimension_numbers": (((1,), (3,)), ((0, 2), (0, 1)))}, (v, p))   # flax's heads in the middle
    False
    """
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    for aval, c, b in zip(in_avals[:2], (lc, rc), (lb, rb)):
        rank = len(getattr(aval, "shape", ()))
        if len(c) != 1 or len(b) + 2 < rank or tuple(b) != tuple(range(len(b))):
            return False
    return True


def heads_between(params: Mapping[str, Any], in_avals: Sequence[Any]) -> bool:
    """Whether XLA rewrites this product (:func:`canonical`) because an operand's batch dimensions do not come
    first (flax's ``[b, n, h, d]``: the heads between batch and sequence). The model prices only these as rewritten:
    a product XLA rewrites for two contracted dimensions (a dense layer's weight gradient over batch and sequence) is
    copied and takes the library path too, but its price is the generic path's as fitted to it
    (``benchmarks/results/dot_paths.md``: N >= 1024, 0.95-1.2x either way)."""
    _, (lb, rb) = params["dimension_numbers"]
    return any(tuple(b) != tuple(range(len(b))) for b in (lb, rb)) and not canonical(params, in_avals)


def copied(params: Mapping[str, Any], in_avals: Sequence[Any]) -> tuple[bool, bool]:
    """Which operands (left, right) XLA:CPU copies into another layout before a product it does not leave as
    written (:func:`canonical`): the left where ``[batch, free, contracted]`` is not its order, the right where
    ``[batch, contracted, free]`` is not (``DotDecomposer``'s canonical form). A right operand stored ``[B, N, K]``
    is copied too: the compiled HLO of flax's ``v^T p^T`` (``[b, k, h, d] x [b, h, q, k]``, the long-context step's
    forward) transposes ``p``, 32 MiB, in a ``copy_bitcast_fusion`` before the ``ynn`` product. Dimensions of size
    1 aside; a contraction shorter than :data:`MIN_CONTRACTION` is priced without, as its path is
    (:func:`library_dot`).

    >>> from jax.core import ShapedArray
    >>> import jax.numpy as jnp
    >>> v = ShapedArray((1, 2048, 2, 64), jnp.float32); p = ShapedArray((1, 2, 2048, 2048), jnp.float32)
    >>> copied({"dimension_numbers": (((1,), (3,)), ((0, 2), (0, 1)))}, (v, p))   # v^T p^T
    (True, True)
    """
    return tuple(order != want for order, want in _orders(params, in_avals))  # type: ignore[return-value]


#: A copy that walks its source down a dimension whose stride is a multiple of this many bytes (a page), for
#: :data:`ALIASED_ROWS` rows or more, reads every element from another page and the same cache sets
#: (:func:`regime`).
ALIASED_STRIDE = 4096

#: How many rows of such a stride a transposing copy walks before it runs at :data:`ALIASED_STRIDE`'s rate.
ALIASED_ROWS = 1024


#: How a transposing copy reads its source (:func:`regime`): down a page-multiple stride, or down any other.
ALIASED, STRIDED = "aliased", "strided"


def turns(params: Mapping[str, Any], in_avals: Sequence[Any]) -> tuple[str | None, str | None]:
    """How XLA:CPU's copy of each operand (:func:`copied`) reads its source (:func:`regime`), or ``None`` for an
    operand not copied, or copied with its minor-most dimension kept (a copy, priced as one).

    >>> from jax.core import ShapedArray
    >>> import jax.numpy as jnp
    >>> v = ShapedArray((1, 2048, 2, 64), jnp.float32); p = ShapedArray((1, 2, 2048, 2048), jnp.float32)
    >>> turns({"dimension_numbers": (((1,), (3,)), ((0, 2), (0, 1)))}, (v, p))   # v^T p^T
    ('strided', 'aliased')
    """
    out = []
    for (order, want), aval in zip(_orders(params, in_avals), in_avals):
        if order == want or len(order) < 2 or order[-1] == want[-1]:
            out.append(None)
            continue
        out.append(regime(getattr(aval, "shape", ()), want[-1], aval.dtype.itemsize))
    return out[0], out[1]


def regime(shape: Sequence[int], minor: int, itemsize: int) -> str:
    """How a copy of an array of ``shape`` that makes its dimension ``minor`` the minor-most reads it: XLA:CPU's
    loop writes the copy in its output's order, so it walks the source down ``minor``'s stride. :data:`ALIASED`
    where that stride is a multiple of :data:`ALIASED_STRIDE` bytes and the walk :data:`ALIASED_ROWS` long or more
    (each element on another page and in the same cache sets: ``AnalyticCost.transpose_copy``); else
    :data:`STRIDED` (a cache line read for each element, 3-8x a copy: ``AnalyticCost.transpose_strided``).
    Timed (``swapaxes(x * 2)`` against ``x * 2``, 9 rounds, load 5.3): ``[2, 1024, 1024]`` 18.6x the copy (6.9 ns
    per element), ``[2, 2048, 2048]`` 9.2 ns; ``[2, 1000, 1000]`` 2.2x, ``[8, 256, 1024]`` 3.7x, ``[8, 1024, 256]``
    3.8x, ``[1, 4096, 128]`` 8.1x (strides off a page, or too few rows: about 1 ns).
    A copy with work fused into it (the long-context step's ``multiply``) is the aliased kind measured: a lone
    ``[1024, 1024]`` transpose ran 1.4-4.1 ns per element where ``x * 2`` transposed ran 5.3-24 (load 5-10).

    >>> regime((1024, 1024), 0, 4), regime((4096, 64), 0, 4), regime((2, 1000, 1000), 1, 4)
    ('aliased', 'strided', 'strided')
    """
    stride = math.prod(shape[minor + 1:]) * itemsize
    return ALIASED if stride % ALIASED_STRIDE == 0 and shape[minor] >= ALIASED_ROWS else STRIDED


def _orders(params: Mapping[str, Any], in_avals: Sequence[Any]) -> list[tuple[list[int], list[int]]]:
    """Each operand's dimensions as stored and in the order XLA copies it into (:func:`copied`), sizes of 1 aside;
    both alike where it is not copied."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs = getattr(in_avals[0], "shape", ())
    as_written = not lc or math.prod(lhs[d] for d in lc) < MIN_CONTRACTION or not heads_between(params, in_avals)
    out = []
    for i, (c, b) in enumerate(((lc, lb), (rc, rb))):
        shape = getattr(in_avals[i], "shape", ())
        order = [d for d in range(len(shape)) if shape[d] != 1]
        if as_written:
            out.append((order, order))
            continue
        batch = [d for d in b if shape[d] != 1]
        free = [d for d in order if d not in b and d not in c]
        kept = [d for d in c if shape[d] != 1]
        dropped = any(shape[d] == 1 for d in b)  # a batch dimension of 1, which XLA drops first
        rest = kept + free if dropped else [d for d in order if d not in b]
        out.append((order, batch + free + kept if i == 0 else batch + rest))
    return out


def library_dot(params: Mapping[str, Any], in_avals: Sequence[Any]) -> bool:
    """Whether XLA:CPU runs this ``dot_general`` on its library path (or it is priced as if it did: a
    contraction shorter than :data:`MIN_CONTRACTION`).

    A product XLA does not leave as written (:func:`canonical`: flax's heads between the batch and the sequence,
    two contracted dimensions) is rewritten with its left operand copied into ``[B, M, K]`` first, which the
    library takes (the compiled HLO: a ``transpose_copy`` fusion, then a ``ynn`` one); one it leaves runs on
    the generic path where its left operand contracts a major dimension (``[B, K, M]``). Only the first kind is
    priced so (:func:`heads_between`).

    >>> from jax.core import ShapedArray
    >>> import jax.numpy as jnp
    >>> m = ShapedArray((8, 2048, 2048), jnp.float32); v = ShapedArray((8, 2048, 64), jnp.float32)
    >>> library_dot({"dimension_numbers": (((2,), (1,)), ((0,), (0,)))}, (m, v))   # p @ v
    True
    >>> library_dot({"dimension_numbers": (((1,), (2,)), ((0,), (0,)))}, (v, m))   # v^T p^T
    False
    """
    (lc, _), (lb, _) = params["dimension_numbers"]
    lhs = in_avals[0]
    shape = getattr(lhs, "shape", ())
    if not lc or math.prod(shape[d] for d in lc) < MIN_CONTRACTION:
        return True
    if heads_between(params, in_avals):
        return True
    rest = [d for d in range(len(shape)) if d not in lb and shape[d] != 1]
    contracted = [i for i, d in enumerate(rest) if d in lc]
    return contracted == list(range(len(rest) - len(contracted), len(rest)))
