"""Whether XLA:CPU runs a call on the caller's thread or hands it to a worker: a program's flop count as XLA counts it.

XLA:CPU's PjRt client runs a compiled program on the calling thread where ``HloCostAnalysis`` counts it under
``DISPATCH_FLOPS`` flops (``cpu_client.cc``: ``cheap_computation_ = flop_count() < 1000``, "a crude heuristic to
find computation less than the thread context switch time"), and hands any other to a worker thread. The hand-off
costs a call several microseconds (``benchmarks/calibrate.py --dispatch-only``: ``((x * 2 + 1) * 3 + 1)`` over 256
floats, 1,024 flops, against 240, 960 flops). A rewrite that takes a small program under the line saves it: the docs'
RNN at 16 x 128 (``scan_docs_rnn_16x128``), its loss summed in the loop, counts 643 flops against the program as
written's 6,402 (its ``[16, 128]`` stacked outputs reduced after the loop), and runs 1.74x faster for it, where the
kernels' work is priced alike. :func:`hlo_flops` estimates that count from a jaxpr, as ``HloCostAnalysis`` counts the
program XLA compiles: a flop an element of each cheap elementwise operation (a transcendental counts none), a
reduction's operand elements less its results', two a multiply-add of a product, a loop's bodies once (XLA does
not know its trips; a scan JAX unrolls, each trip's), a conditional's dearest branch. ``AnalyticCost.fixed``
charges ``AnalyticCost.dispatch`` on a program counted at ``DISPATCH_FLOPS`` or more.
"""

from __future__ import annotations

import math
from typing import Any

from ..ir import primitives as _primitives
from ..ir.primitives import inner_jaxpr, size
from .program import unrolled

#: the flop count from which XLA:CPU's client runs a program on a worker thread
DISPATCH_FLOPS = 1000.0


def hlo_flops(closed: Any) -> float:
    """The flops ``HloCostAnalysis`` counts for the program ``closed`` (a ``ClosedJaxpr`` or ``Jaxpr``) compiles to,
    estimated from its equations (the module docstring says how).

    >>> import jax, jax.numpy as jnp
    >>> f = lambda x, y: jnp.sum((x - y) ** 2)
    >>> hlo_flops(jax.make_jaxpr(f)(jnp.ones((16, 128)), jnp.ones((16, 128))))
    6143.0
    >>> hlo_flops(jax.make_jaxpr(jnp.tanh)(jnp.ones(2048)))  # a transcendental: no flops
    0.0
    """
    jaxpr = getattr(closed, "jaxpr", closed)
    total = 0.0
    for e in jaxpr.eqns:
        total += _eqn_flops(e)
    return total


def _eqn_flops(e: Any) -> float:
    prim, params = e.primitive.name, e.params
    if prim == "scan":  # a loop XLA does not know the trips of, or the trips JAX writes out for it
        return (params.get("length", 1) if unrolled(prim, params) else 1) * hlo_flops(params["jaxpr"])
    if prim == "while":
        return hlo_flops(params["cond_jaxpr"]) + hlo_flops(params["body_jaxpr"])
    if prim == "cond":
        return max((hlo_flops(b) for b in params["branches"]), default=0.0)
    inner = inner_jaxpr(params)
    if inner is not None:
        return hlo_flops(inner)
    outs = [v.aval for v in e.outvars]
    family = _primitives.family_of(prim)
    if prim == "integer_pow":
        muls, divs = _primitives.spec_of(prim).unrolled(params) if _primitives.spec_of(prim).unrolled else (1, 0)
        return float((muls + divs) * sum(size(a) for a in outs))
    if family == _primitives.ELEMENTWISE or prim == "convert_element_type":
        return float(sum(size(a) for a in outs))
    if family == _primitives.REDUCE:
        return float(max(sum(size(v.aval) for v in e.invars[:1]) - sum(size(a) for a in outs[:1]), 0))
    if family == _primitives.CONTRACT and outs:
        return contraction_flops(params["dimension_numbers"], e.invars[0].aval, outs[0])
    return 0.0


def contraction_flops(dimension_numbers: Any, lhs: Any, out: Any) -> float:
    """A ``dot_general``'s flops, a multiply and an add for each output element and contracted index: as
    ``HloCostAnalysis`` counts them, and as the cost model prices a product's work (``model._dot_flops``)."""
    (lc, _), _ = dimension_numbers
    return 2.0 * size(out) * math.prod(lhs.shape[d] for d in lc)


def dispatched(dispatch: float, program: Any) -> float:
    """``dispatch`` where XLA:CPU's client hands ``program`` (a closed jaxpr) to a worker thread, counting it at
    ``DISPATCH_FLOPS`` flops or more (:func:`hlo_flops`); else 0 (and 0 at once where ``dispatch`` is).

    >>> import jax, jax.numpy as jnp
    >>> small, large = (jax.make_jaxpr(lambda x: x * 2.0)(jnp.ones(n)) for n in (999, 1000))
    >>> dispatched(6000.0, small), dispatched(6000.0, large), dispatched(0.0, large)
    (0.0, 6000.0, 0.0)
    """
    if not dispatch:
        return 0.0
    return dispatch if hlo_flops(program) >= DISPATCH_FLOPS else 0.0
