"""Cost models: what extraction minimises.

A cost model is any callable from :class:`NodeInfo` to a non-negative float.
It sees one node at a time: its primitive, params, operand and result avals,
and, for nodes with bodies, what one execution of each body costs. The
extractor adds node costs over the chosen program, counting a shared node
once.

The default, :class:`AnalyticCost`, counts flops, weights transcendentals,
and charges bytes where XLA materialises arrays: reductions and contractions
read their inputs, transposes and copies write their outputs, loops write
their stacked outputs. Elementwise chains are treated as fused, so they cost
their arithmetic only. The weights are calibrated for XLA:CPU
(``benchmarks/calibrate.py``); any consistent scale works, since only
comparisons matter.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np

from . import _terms


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What a cost model sees of one e-node.

    ``op`` is the primitive name (``"sin"``, ``"scan"``, ...), or one of
    ``"literal"``, ``"const"``, ``"param"``, ``"token"``, ``"proj"`` for
    structural nodes. For ``"proj"``, ``of`` is the projected node's op,
    ``params`` its params, and ``index`` which result is taken. For nodes with
    bodies (scan, while, cond, jit, shard_map), ``body_costs`` holds the cost of
    one execution of each body. A cost model is any callable from ``NodeInfo``
    to a non-negative float:

    >>> import jax.numpy as jnp
    >>> from jax.core import ShapedArray
    >>> from rewrite import AnalyticCost, NodeInfo
    >>> def adds_are_ruinous(node):
    ...     return 1e9 if node.op == "add" else AnalyticCost()(node)
    >>> v = ShapedArray((8,), jnp.float32)
    >>> adds_are_ruinous(NodeInfo("add", "elementwise", {}, (v, v), (v,)))
    1000000000.0
    >>> adds_are_ruinous(NodeInfo("exp", "transcendental", {}, (v,), (v,)))
    129.0
    """

    op: str
    family: str
    params: Mapping[str, Any]
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    body_costs: tuple[float, ...] = ()
    index: int | None = None
    of: str | None = None


CostModel = Callable[[NodeInfo], float]


def size(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    return 0 if shape is None else int(math.prod(shape))


def nbytes(aval: Any) -> int:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    itemsize = getattr(dtype, "itemsize", None)  # extended dtypes (PRNG keys) carry their own
    return size(aval) * (itemsize if isinstance(itemsize, int) else np.dtype(dtype).itemsize)


_SLOW_ELEMENTWISE = {"div": 4.0, "rem": 6.0, "integer_pow": 2.0, "sqrt": 1.0, "rsqrt": 1.0}


@dataclasses.dataclass(frozen=True)
class AnalyticCost:
    """The default cost model: flops, weighted transcendentals and materialised bytes.

    >>> import jax.numpy as jnp
    >>> from jax.core import ShapedArray
    >>> from rewrite import AnalyticCost, NodeInfo
    >>> a = ShapedArray((1000,), jnp.float32)
    >>> m = AnalyticCost()
    >>> m(NodeInfo("sin", "transcendental", {}, (a,), (a,))) > m(NodeInfo("mul", "elementwise", {}, (a, a), (a,)))
    True
    """

    flop: float = 1.0
    transcendental: float = 16.0
    byte: float = 0.35
    #: a fixed charge per node; it breaks ties in favour of fewer equations
    node: float = 1.0
    #: per loop iteration, for the loop's own bookkeeping
    iteration: float = 40.0
    #: assumed trip count of a while loop
    while_trips: float = 10.0
    #: extra charge per byte of a loop's stacked output, on top of writing it: the memory it
    #: holds (in a backward program, until the backward loop reads it). Raise it to trade
    #: recomputation for memory; 0 prices time only.
    stacked: float = 0.0

    def __call__(self, n: NodeInfo) -> float:
        fam = n.family
        out = n.out_avals
        if fam == _terms.SPECIAL:
            if n.op == "proj":
                if n.of == "scan" and n.index is not None and n.index >= n.params.get("num_carry", 0):
                    return self.node + (self.byte + self.stacked) * nbytes(out[0])  # the stacked output is written
                return 0.0
            return 0.0
        if fam == _terms.ELEMENTWISE:
            return self.node + self.flop * _SLOW_ELEMENTWISE.get(n.op, 1.0) * sum(size(a) for a in out)
        if fam == _terms.TRANSCENDENTAL:
            return self.node + self.transcendental * sum(size(a) for a in out)
        if fam == _terms.LAYOUT:
            return self.node + 0.05 * self.flop * sum(size(a) for a in out)
        if fam == _terms.TRANSPOSE:
            return self.node + self.byte * sum(nbytes(a) for a in out)
        if fam == _terms.REDUCE:
            return self.node + self.flop * sum(size(a) for a in n.in_avals) + self.byte * sum(nbytes(a) for a in n.in_avals)
        if fam == _terms.CONTRACT:
            return self.node + self.flop * _dot_flops(n) + self.byte * (sum(nbytes(a) for a in n.in_avals) + nbytes(out[0]))
        if fam == _terms.INDEX:
            return self.node + self.byte * sum(nbytes(a) for a in out)
        if fam == _terms.NESTED:
            return self.node + self._nested(n)
        # opaque or effectful: it reads its operands and writes its results
        return self.node + self.flop * sum(size(a) for a in out) + self.byte * (
            sum(nbytes(a) for a in n.in_avals) + sum(nbytes(a) for a in out))

    def _nested(self, n: NodeInfo) -> float:
        bodies = n.body_costs
        if n.op == "scan":
            length = n.params.get("length", 1)
            carry = sum(nbytes(a) for a in n.out_avals[: n.params.get("num_carry", 0)])
            return length * (bodies[0] + self.iteration + self.byte * carry)
        if n.op == "while":
            return self.while_trips * (sum(bodies) + self.iteration)
        if n.op == "cond":
            return max(bodies, default=0.0) + self.iteration
        return sum(bodies)


def _dot_flops(n: NodeInfo) -> float:
    (lc, rc), (lb, rb) = n.params["dimension_numbers"]
    lhs, rhs = n.in_avals[:2]
    contract = math.prod(lhs.shape[d] for d in lc)
    return 2.0 * size(n.out_avals[0]) * contract


DEFAULT = AnalyticCost()


def resolve(model: Any) -> CostModel:
    """``None`` or ``"analytic"`` gives the default model; a callable is used as is."""
    if model is None or model == "analytic":
        return DEFAULT
    if callable(model):
        return model
    raise ValueError(f"cost_model= must be None, 'analytic' or a callable NodeInfo -> float, got {model!r}")
