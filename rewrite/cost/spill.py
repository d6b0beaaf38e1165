"""What moving an array costs beyond ``byte`` per byte where it outgrows the cache: one formula for the node price
(``AnalyticCost.spilled``) and the whole-program price (``FusionModel.spilled``, its kernels and attention's).
"""

from __future__ import annotations


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
