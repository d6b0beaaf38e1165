"""Which of XLA:CPU's two matrix-multiply paths a ``dot_general`` takes, for the cost model.

XLA:CPU runs a product through its library (YNN) kernels only when the left
operand contracts its minor-most dimensions, batch dimensions aside (a row-major ``[M, K]``
times anything); a left operand that contracts a major dimension (``[K, M]``,
which ``jnp.einsum("hkd,hqk->hdq", v, p)`` writes, and which ``linalg``'s rules
reach by swapping a product's operands) goes to the generic Eigen path, or,
inside a library fusion, runs slower there too. Measured on this 2-core
CPU (8 heads, interleaved medians; ``benchmarks/attention.py --dots``):
``[2048, 2048] x [2048, 64]`` takes 156-186 ms as a library product and
399-454 ms as the transposed-left one (2.4x); with a contraction of 64 the two
paths take the same time. So a transposed left operand is priced at
``AnalyticCost.dot_fallback`` times the flops, for contractions of
:data:`MIN_CONTRACTION` or more.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

#: The contraction length below which both paths measured alike.
MIN_CONTRACTION = 256

#: How much slower the generic path is than the library path, per backend (1.0: no difference known).
FALLBACK = {"cpu": 2.4}


def library_dot(params: Mapping[str, Any], in_avals: Sequence[Any]) -> bool:
    """Whether XLA:CPU runs this ``dot_general`` on its library path (or the two paths cost alike).

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
