"""What moving an array costs beyond ``byte`` per byte where it outgrows the cache: one formula for the node price
(``AnalyticCost.spilled``) and the whole-program price (``FusionModel.spilled``, its kernels and attention's); and
what a library reduction of an array the cache holds costs less than one streamed from memory
(:func:`cached_reduction`); and how a kernel's bytes add to its work (:func:`with_bytes`).
"""

from __future__ import annotations

from typing import Any, Container

from .program import LIBRARY, LOOP, _size


def spilled(nbytes: float, cache: float, spill: float, near: float, tier: float) -> float:
    """Nanoseconds that writing or reading an array of ``nbytes`` bytes once costs beyond ``byte`` per byte:
    ``spill`` per byte past ``cache`` (it streams from memory) and ``tier`` per byte past ``near`` (a kernel's input
    and output as large no longer both fit its share of the cache: ``AnalyticCost.near``); 0 where ``spill`` is 0
    (the tier is priced only beside the spill).

    >>> spilled(1000.0, cache=400.0, spill=0.5, near=100.0, tier=0.1)
    390.0
    >>> spilled(1000.0, cache=400.0, spill=0.0, near=100.0, tier=0.1)
    0.0
    """
    if not spill:
        return 0.0
    return spill * max(0.0, nbytes - cache) + (tier * max(0.0, nbytes - near) if tier else 0.0)


def with_bytes(model: Any, kind: str, cost: float, moved: float, overlap: bool | None = None) -> float:
    """A kernel's price of ``cost`` for its work and ``moved`` for its bytes (at ``byte``), for the whole-program
    price (``FusionModel.kernel``, a loop body's kernels in ``FusionModel.launches`` too) and the search's
    (``LiveFusion``) alike: their sum, or where ``model.overlap`` holds (``AnalyticCost.overlap``; ``overlap``, where
    given, in its place) a loop kernel's larger of the two, its bytes hiding its arithmetic (plus its launch, which
    ``cost`` holds).

    >>> from types import SimpleNamespace as M
    >>> [with_bytes(M(overlap=on, launch=2.0), "loop", 10.0, 6.0) for on in (False, True)]
    [16.0, 10.0]
    >>> with_bytes(M(overlap=True, launch=2.0), "loop", 10.0, 6.0, overlap=False)
    16.0
    """
    on = model.overlap if overlap is None else overlap
    return max(cost, moved + model.launch) if on and kind == LOOP else cost + moved


def cached_reduction(model: Any, prog: Any, r: Any, kind: str, inside: Container[Any]) -> float:
    """What library reduction ``r`` (of ``kind``, computing ``inside``) is priced above what XLA:CPU runs, where it
    reads its operand whole from the cache: ``reduce`` per element and ``byte`` per byte of an operand of ``cache``
    bytes or fewer (the prices of a reduction streamed from memory, measured on 16 MiB), against ``reduce_cached``
    per element, its reading included; 0 elsewhere (an operand the kernel computes, or beyond the cache), and where
    the model has no ``reduce_cached``. Read by ``FusionModel.kernel`` and ``LiveFusion._kernel`` alike.

    >>> import jax.numpy as jnp
    >>> from jax import core
    >>> from rewrite.ir import primitives as P
    >>> from rewrite.cost.fusion import FusionModel
    >>> from rewrite.cost.program import Op, Program
    >>> x, s = core.ShapedArray((1024, 256), jnp.float32), core.ShapedArray((1024,), jnp.float32)
    >>> prog = Program([Op("param", P.SPECIAL, {}, (), (), (x,)),
    ...                 Op("reduce_max", P.REDUCE, {"axes": (1,)}, (0,), (x,), (s,))], [1])
    >>> fm = FusionModel({}, byte=0.25, reduce=0.5, launch=0.0, default=1.0, cheap=0.25, reduce_cached=0.125,
    ...                  cache=2 ** 20)
    >>> cached_reduction(fm, prog, 1, LIBRARY, {1}) == (0.5 + 4 * 0.25 - 0.125) * 1024 * 256
    True
    """
    if model.reduce_cached is None or kind != LIBRARY:
        return 0.0
    root = prog.ops[r]
    if not root.args or root.args[0] in inside or not root.in_avals:
        return 0.0
    src = prog.ops[root.args[0]]
    if src.prim == "literal" or not src.out_avals:
        return 0.0
    read = model._facts(src, prog)[6]
    if read > model.cache:
        return 0.0
    return model._facts(root, prog)[3] + model.byte * read - _size(root.in_avals[0]) * model.reduce_cached
