"""What a scan body reads of its loop-invariant operands, for the cost model's price of a loop.

A body that reads a loop-invariant operand whole (the LM head's weight, read
by each block's product) reads it again in every iteration, and
``_scan_price`` (``rewrite/ir/primitives.py``) charges that; a body that only
slices it (attention's keys and values, a block per iteration) reads a block,
which the body's own price already counts. The loader marks each scan's params
with the second kind (``_rw_sliced``).
"""

from __future__ import annotations

from typing import Any

from .jaxapi import core, scan_counts

#: Primitives that read only the part of their first operand that they return (the cost model charges a kernel
#: that reads an array only through them the parts it returns: ``rewrite/cost/fusion.py``).
SLICES = frozenset({"dynamic_slice", "slice"})


def sliced_consts(closed: Any, num_consts: int) -> frozenset[int]:
    """The loop-invariant operands (the first ``num_consts`` inputs) that a scan body reads only as the operand of
    a slice (``dynamic_slice``, ``slice``), directly or through a nested scan that does: each iteration reads
    a block of them, not the whole array (attention's keys)."""
    jaxpr = closed.jaxpr
    uses: dict[Any, bool] = {v: True for v in jaxpr.invars[:num_consts]}
    for e in jaxpr.eqns:
        inner = e.params.get("_rw_sliced") if e.primitive.name == "scan" else None
        if e.primitive.name == "scan" and inner is None:
            inner = sliced_consts(e.params["jaxpr"], scan_counts(e.params)[0])
        for i, v in enumerate(e.invars):
            if not isinstance(v, core.Literal) and v in uses:
                ok = ((e.primitive.name in SLICES and i == 0 and all(u is not v for u in e.invars[1:]))
                      or (inner is not None and i < scan_counts(e.params)[0] and i in inner))
                uses[v] = uses[v] and ok
    uses.update({v: False for v in jaxpr.outvars if not isinstance(v, core.Literal) and v in uses})
    return frozenset(i for i, v in enumerate(jaxpr.invars[:num_consts]) if uses[v])
