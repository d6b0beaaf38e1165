"""Which of XLA:CPU's two matrix-multiply paths a ``dot_general`` takes, and what the generic one costs more.

XLA:CPU runs a product through its library (YNN) kernels only when the left
operand contracts its minor-most dimensions, batch dimensions aside (a row-major ``[M, K]``
times anything); a left operand that contracts a major dimension (``[K, M]``,
which ``jnp.einsum("hkd,hqk->hdq", v, p)`` writes, and which ``linalg``'s rules
reach by swapping a product's operands) goes to the generic Eigen path.

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


def library_dot(params: Mapping[str, Any], in_avals: Sequence[Any]) -> bool:
    """Whether XLA:CPU runs this ``dot_general`` on its library path (or it is priced as if it did: a
    contraction shorter than :data:`MIN_CONTRACTION`).

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
    # XLA moves batch dimensions to the front (copying the operand where they are not there already);
    # what decides the path is the order of the rest: contracted dimensions after every free one.
    rest = [d for d in range(len(shape)) if d not in lb and shape[d] != 1]
    contracted = [i for i, d in enumerate(rest) if d in lc]
    return contracted == list(range(len(rest) - len(contracted), len(rest)))
