"""What a scan body reads of its loop-invariant operands, for the cost model's price of a loop.

A body that reads a loop-invariant operand whole (the LM head's weight, read
by each block's product) reads it again in every iteration, and
``_scan_price`` (``rewrite/ir/primitives.py``) charges that; a body that only
slices it (attention's keys and values, a block per iteration) reads a block,
which the body's own price already counts. The loader marks each scan's params
with the second kind (``_rw_sliced``).

Likewise a carry that the body updates in place (``buf.at[i].set(...)``, a block
of a gradient's columns written per step) is not moved whole by each iteration:
XLA writes the update into the carried buffer, and the body's price counts the
update's bytes. The loader marks which carries are so (``_rw_inplace``).
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


#: The updates XLA makes in place, and which operand is the update: the buffer updated (operand 0) is not read
#: again (a loop's carried buffer, a gradient's fresh zeros), so XLA writes the update into it and moves the
#: update's bytes, not the buffer's.
IN_PLACE = {"dynamic_update_slice": 1, "scatter": 2, "scatter-add": 2, "scatter-mul": 2, "scatter-min": 2,
            "scatter-max": 2}


def in_place_carries(closed: Any, num_consts: int, num_carry: int) -> tuple[bool, ...]:
    """Per carry of a scan body, whether the body returns it updated in place: the carry itself, an in-place
    update (:data:`IN_PLACE`) of it or of such an update, or a nested scan's carry that its own body updates so,
    started from it. Each iteration then moves the update's bytes (the body's price), not the whole carry."""
    jaxpr = closed.jaxpr
    made: dict[Any, Any] = {}
    for e in jaxpr.eqns:
        for k, v in enumerate(e.outvars):
            made[v] = (e, k)

    def rooted(v: Any, carry: Any) -> bool:
        while True:
            if v is carry:
                return True
            found = made.get(v)
            if found is None:
                return False
            e, k = found
            name = e.primitive.name
            if name in IN_PLACE and k == 0 and len(e.invars) > IN_PLACE[name]:
                v = e.invars[0]
                continue
            if name == "scan":
                inner = e.params.get("_rw_inplace")
                nc, ncarry = scan_counts(e.params)
                if inner is None:
                    inner = in_place_carries(e.params["jaxpr"], nc, ncarry)
                if k < ncarry and inner[k]:
                    v = e.invars[nc + k]
                    continue
            return False

    carries = jaxpr.invars[num_consts:num_consts + num_carry]
    return tuple(not isinstance(out, core.Literal) and rooted(out, c)
                 for out, c in zip(jaxpr.outvars[:num_carry], carries))


def moved_per_trip(params: Any, in_avals: Any, out_avals: Any) -> tuple[Any, ...]:
    """What a scan moves whole in each iteration, beyond its body's kernels (``_scan_price``): the carries it does
    not update in place, and the consts its body reads whole (an LM-head block reads all of ``W``), not those it
    slices. From the loader's marks (``_rw_sliced``, ``_rw_inplace``), else from the body in ``params``."""
    nc, ncarry = scan_counts(params)
    sliced, kept = params.get("_rw_sliced"), params.get("_rw_inplace")
    if sliced is None:
        sliced = sliced_consts(params["jaxpr"], nc) if "jaxpr" in params else ()
    if kept is None and "jaxpr" in params:
        kept = in_place_carries(params["jaxpr"], nc, ncarry)
    if kept is None or len(kept) != ncarry:
        kept = (False,) * ncarry
    return (tuple(a for a, inplace in zip(out_avals[:ncarry], kept) if not inplace)
            + tuple(a for i, a in enumerate(in_avals[:nc]) if i not in sliced))
