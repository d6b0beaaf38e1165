"""What XLA's algebraic simplifier changes of a program before it fuses it, for the price and the memory alike.

A reduction over axes that a broadcast did not add is the broadcast of the reduction of the broadcast's operand
(``reduce(broadcast(y)) -> broadcast(reduce(y))``), and a reduction of a broadcast literal is a constant: XLA reduces
``y``, never the broadcast array, or nothing at all. distrax's flow log-density sums ``[2048, 16]`` broadcasts of
``[16]`` vectors and of ``0.0`` over an axis; its mixture gradient reduces a ``[N, K]`` value broadcast to
``[N, K, D]`` over ``N``. The memory model rewrites the jaxpr so (``memory.as_xla_simplifies``); the fusion model
prices the kernel so (:func:`folded_reduction`, read by ``FusionModel.kernel`` and ``LiveFusion._kernel`` alike).
"""

from __future__ import annotations

from typing import Any, Container

from .program import LIBRARY, _size

#: The reductions XLA's algebraic simplifier moves before a broadcast they read.
REDUCE_BEFORE_BROADCAST = frozenset({"reduce_sum", "reduce_max", "reduce_min"})


def folded_reduction(model: Any, prog: Any, r: Any, kind: str, inside: Container[Any]) -> float:
    """What kernel ``r`` (of ``kind``, computing ``inside``) is priced above what XLA runs, where its root reduces a
    broadcast the kernel absorbs: the reduction of the broadcast's elements and the broadcast's own pass, less the
    reduction of its operand's elements (nothing where the operand is a literal: XLA folds the constant); 0 elsewhere.

    >>> import jax.numpy as jnp
    >>> from jax import core
    >>> from rewrite.ir import primitives as P
    >>> from rewrite.cost.fusion import FusionModel
    >>> from rewrite.cost.program import Op, Program
    >>> y, b, s = (core.ShapedArray(shape, jnp.float32) for shape in ((16,), (2048, 16), (2048,)))
    >>> prog = Program([Op("param", P.SPECIAL, {}, (), (), (y,)),
    ...                 Op("broadcast_in_dim", P.LAYOUT, {"broadcast_dimensions": (1,), "shape": (2048, 16)},
    ...                    (0,), (y,), (b,)),
    ...                 Op("reduce_sum", P.REDUCE, {"axes": (1,)}, (1,), (b,), (s,))], [2])
    >>> fm = FusionModel({}, byte=0.0, reduce=0.5, launch=0.0, default=1.0, cheap=0.25)
    >>> folded_reduction(fm, prog, 2, LIBRARY, {1, 2}) == 0.5 * (2048 * 16 - 16)
    True
    """
    ops = prog.ops
    root = ops[r]
    if root.prim not in REDUCE_BEFORE_BROADCAST or not root.args or root.args[0] not in inside:
        return 0.0
    src = ops[root.args[0]]
    if src.prim != "broadcast_in_dim" or not src.args or src.params.get("sharding") is not None:
        return 0.0
    literal = ops[src.args[0]].prim == "literal"
    dims, axes = tuple(src.params.get("broadcast_dimensions", ())), tuple(root.params.get("axes", ()))
    if not literal and not (axes and all(a in dims for a in axes)):
        return 0.0
    share = 4 if kind == LIBRARY and model.library_op is not None else 5
    facts = model._facts
    kept = 0.0 if literal else _size(src.in_avals[0]) * model.reduce
    return facts(root, prog)[3] - kept + model.parallel_share(root, kind) * facts(src, prog)[share]
