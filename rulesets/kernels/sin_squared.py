"""``sin(b x)**2 / b`` with a backward that computes both gradients from one ``sin`` and one ``cos`` an element.

JAX's VJP of ``sin(b x)**2 / b`` (seed 000) computes ``sin(b x)`` and ``cos(b x)`` for ``grad x`` and, apart,
``sin(b x)`` again for ``b``'s sums: XLA:CPU stores ``sin`` for the library reduction over the rows and computes
it again beside ``cos``, three transcendentals an element. :func:`sin_squared_over` is the same forward as a
``jax.custom_vjp`` whose backward writes ``grad x``, ``t * x`` and ``u`` (JAX's own terms: ``grad x = b t``,
``grad b = sum(t x) - sum(u)``) as the three slots of one ``[..., 3]`` array, which the loop that writes it fills
with one vector ``sin`` and one vector ``cos`` an element for all three slots; one library reduction sums it
over the axes ``b`` is broadcast along (:func:`interleaved`). That array is three times ``x``'s size, so the
backward runs over blocks of the leading axis (:func:`blocks`): each block's ``x`` is ``select(p, x_block,
g_block)`` with ``p`` true for every value but computed from the sums so far (:func:`always_true`), so XLA runs
the blocks one after another and holds one block's array at a time. The blocks are one ``lax.scan`` that JAX
unrolls (``unroll=True``): XLA compiles the straight-line code of 32 blocks written out (the same temporaries,
flops and bits), and a rewrite's e-graph holds one body, not 32 copies of it (seed 000's VJP rewritten in about
a third of the time; the cost model prices such a scan as its trips: ``rewrite/cost/program.py``'s ``unroll``).

``grad x`` is JAX's bit for bit (each element's operations in JAX's order); ``grad b`` sums the same terms in
another order (by block, then the two sums' difference once), within ``Tolerance(terms=64)``. The forward is
JAX's operations, the division by ``b`` through :func:`same` (``reduce_precision`` at ``b``'s own precision,
every bit kept, which XLA drops) so that the pattern ``rulesets/_sin2.py`` matches is not found again inside the
kernel; the blocks' running sum goes through it too, so that ``red_merge`` does not merge the blocks' sums back
into one. Measured against JAX's VJP at seed 000's demo sizes (``benchmarks/derivatives.py``, ``form_chained``):
1.5-1.85x with 0.4-6 MiB of temporaries against 4-64 (``benchmarks/results/log.md``).

>>> import jax, jax.numpy as jnp
>>> x, b = jax.random.normal(jax.random.key(0), (64, 64)), jnp.linspace(0.5, 2.0, 64)[None]
>>> f = lambda x, b: jnp.sin(b * x) ** 2 / b
>>> bool((sin_squared_over(x, b) == f(x, b)).all())
True
>>> grad = lambda f: jax.grad(lambda x, b: f(x, b).sum(), (0, 1))(x, b)
>>> g, want = grad(sin_squared_over), grad(f)
>>> bool((g[0] == want[0]).all()), bool(jnp.allclose(g[1], want[1], rtol=1e-5))
(True, True)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np
from jax import lax

__all__ = ["sin_squared_over", "covers", "blocks", "MIN_BLOCK", "MAX_BLOCKS"]

#: A block holds at least this many elements of ``x``: 32 blocks of 512 or 1024 elements (seed 000 at T=8, 16)
#: measured 0.38x and 0.63x of JAX's VJP (a block's three slots under 4096 elements are summed by an XLA loop, not
#: its library reduction), blocks of 2048 or more 1.27-2.1x (benchmarks/results/log.md, h-seed2).
MIN_BLOCK = 2048
#: At most this many blocks (the backward's scan is unrolled: one loop kernel and one reduction a block).
MAX_BLOCKS = 32


def covers(x_shape: tuple, b_shape: tuple) -> bool:
    """Whether the kernel computes ``sin(b x)**2 / b`` for these shapes: ``b`` of ``x``'s rank, each of its axes
    ``x``'s or 1, and 1 along the leading axis, which ``x`` has longer than 1 (the blocks are of that axis)."""
    return (len(b_shape) == len(x_shape) >= 1 and x_shape[0] > 1 and b_shape[0] == 1
            and all(d in (1, n) for d, n in zip(b_shape, x_shape)))


def blocks(x_shape: tuple) -> int:
    """How many blocks of the leading axis the backward runs: the most, of at most :data:`MAX_BLOCKS` dividing it,
    whose blocks hold :data:`MIN_BLOCK` elements or more (1 where none does)."""
    n, size = x_shape[0], math.prod(x_shape)
    return max([k for k in range(1, min(MAX_BLOCKS, n) + 1) if n % k == 0 and size // k >= MIN_BLOCK], default=1)


def same(v: Any) -> Any:
    """``v``, every bit kept (NaN payloads too), as a term of its own: ``reduce_precision`` at its own precision."""
    info = np.finfo(v.dtype)
    return lax.reduce_precision(v, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def always_true(v: Any) -> Any:
    """A ``bool`` true for every scalar ``v`` (the top bit of ``bits(v) >> 1`` is 0) that XLA does not fold."""
    b = lax.bitcast_convert_type(v, np.dtype(f"uint{8 * np.dtype(v.dtype).itemsize}"))
    return lax.shift_right_logical(b, np.asarray(1, b.dtype)) < np.asarray(1 << (8 * b.dtype.itemsize - 1), b.dtype)


def interleaved(parts: list) -> Any:
    """``parts`` (one shape) as one array with a last axis of ``len(parts)``, built so XLA:CPU stores it once.

    Each part is padded to its own slot and the slots chosen by a ``select`` on the last axis's index: a
    ``select`` of two full-size operands that are not broadcasts, which XLA does not duplicate into its readers
    when one of them (the library reduction) cannot take it, and whose loop LLVM vectorises along the slots:
    one ``sin`` and one ``cos`` an element for all of them."""
    k, nd = len(parts), parts[0].ndim
    zero = np.asarray(0, parts[0].dtype)
    pads = [lax.pad(lax.expand_dims(p, (nd,)), zero, [(0, 0, 0)] * nd + [(n, k - 1 - n, 0)])
            for n, p in enumerate(parts)]
    slot = lax.broadcasted_iota(np.int32, pads[0].shape, nd)
    out = pads[-1]
    for n in range(k - 2, -1, -1):
        out = lax.select(slot == np.int32(n), pads[n], out)
    return out


def _value(x: Any, b: Any) -> Any:
    """The forward: JAX's operations for ``sin(b x)**2 / b``, the divisor through :func:`same`."""
    return lax.div(lax.integer_pow(lax.sin(lax.mul(b, x)), 2), same(b))


def _slots(x: Any, b: Any, g: Any) -> Any:
    """``[b t, t x, u]`` of one block, each element's operations in JAX's VJP's order (``t = g / b * 2 s * c``,
    ``u = g b**-2 * s**2``)."""
    bx = lax.mul(b, x)
    s, c = lax.sin(bx), lax.cos(bx)
    # g / b, as JAX writes it (XLA computes g * (1 / b) either way): written so, 1 and 2 would be two literals of one
    # product, which prod_mul folds, reordering the product in the joint program and changing grad x's bits
    t = lax.mul(lax.mul(lax.div(g, b), lax.mul(np.asarray(2, s.dtype), s)), c)
    u = lax.mul(lax.mul(g, lax.integer_pow(b, -2)), lax.integer_pow(s, 2))
    return interleaved([lax.mul(b, t), lax.mul(t, x), u])


def _block(b: Any, red: tuple, carry: tuple, block: tuple) -> tuple:
    """One block of the backward: its slots added to the sums so far and its ``grad x`` written into its rows."""
    acc, gx = carry
    xb, gb, at = block
    # true, but read from the sums so far: XLA runs the blocks in order, one block's slots held
    xb = lax.select(lax.broadcast(always_true(acc.reshape(-1)[0]), xb.shape), xb, gb)
    y = _slots(xb, b, gb)
    # not a sum of sums (red_merge leaves it); gx's rows written in place
    return (lax.add(same(acc), lax.reduce_sum(y, red)), lax.dynamic_update_slice_in_dim(gx, y[..., 0], at, 0)), None


def _backward(x: Any, b: Any, g: Any) -> tuple:
    k = blocks(x.shape)
    red = tuple(i for i, d in enumerate(b.shape) if d == 1)
    if k == 1:
        y = _slots(x, b, g)
        gx, acc = y[..., 0], lax.reduce_sum(y, red)
    else:
        rows = x.shape[0] // k
        # a scan JAX unrolls (one body, not k copies of it: a rewrite's e-graph holds it once), the blocks' x and g
        # read as views of the leading axis, the sums and grad x carried from zeros
        xs, gs = (v.reshape((k, rows) + v.shape[1:]) for v in (x, g))
        sums = lax.full(tuple(d for i, d in enumerate(x.shape + (3,)) if i not in red), 0, x.dtype)
        (acc, gx), _ = lax.scan(functools.partial(_block, b, red), (sums, lax.full_like(x, 0)),
                                (xs, gs, np.arange(k, dtype=np.int32) * rows), unroll=True)
    return gx, lax.sub(acc[..., 1], acc[..., 2]).reshape(b.shape)


@jax.custom_vjp
def sin_squared_over(x: Any, b: Any) -> Any:
    """``sin(b x)**2 / b`` (``b`` as :func:`covers` says), whose VJP computes both gradients from one ``sin`` and
    one ``cos`` an element over blocks of the leading axis (:func:`blocks`)."""
    return _value(x, b)


def _fwd(x: Any, b: Any) -> tuple:
    return _value(x, b), (x, b)  # the operations, not sin_squared_over: its jaxpr would call itself


sin_squared_over.defvjp(_fwd, lambda res, g: _backward(*res, g))
