"""The lean band: when the cost model keeps the leaner of two programs though it is priced no lower.

Two whole programs priced within the model's ``lean_band`` of each other are taken as equally fast, and of those
the :func:`leaner` wins; within ``lean_band_far``, one that holds at most half the other's temporaries and drops
arrays larger than the cache (:func:`far_leaner`). Extraction's candidates and searches
(``rewrite/extract/extract.py``, ``program.py``), a derivative's joint programs (``rewrite/grad/vjp.py``) and a
training step's whole programs (``rewrite/api.py``) are chosen so.
"""

from __future__ import annotations

import math
from typing import Any, Callable

#: A program is leaner than another when its predicted peak of temporaries is at most this fraction of
#: the other's, and at least :data:`LEAN_BYTES` less.
LEAN_RATIO = 0.75
LEAN_BYTES = 2 ** 20


def lean_band(model: Any) -> float:
    """The fraction within which ``model`` takes two programs' prices as equal, so that the leaner wins
    (``AnalyticCost.lean_band``); 0 where it prices time only (``memory=0``) or has no band."""
    if not float(getattr(model, "memory", 0.0) or 0.0):
        return 0.0
    return max(0.0, float(getattr(model, "lean_band", 0.0) or 0.0))


def leaner(peak: float | None, than: float | None) -> bool:
    """Whether a predicted peak of ``peak`` bytes is leaner than one of ``than`` (:data:`LEAN_RATIO`)."""
    return peak is not None and than is not None and peak <= LEAN_RATIO * than and than - peak >= LEAN_BYTES


def far_leaner(peak: float | None, than: float | None, model: Any) -> bool:
    """Whether a predicted peak of ``peak`` bytes holds at most half of ``than`` and more than ``model.cache`` bytes
    less, so that the arrays it drops stream from memory (``AnalyticCost.lean_band_far``)."""
    cache = getattr(model, "cache", None)
    return (peak is not None and than is not None and cache is not None and math.isfinite(cache)
            and peak <= than / 2 and than - peak > cache)


def keeps_leaner(cost: float, peak: float | None, than_cost: float, than_peak: float | None, model: Any) -> bool:
    """The cost model's own rule between two whole programs priced ``cost`` and ``than_cost``, predicted to hold
    ``peak`` and ``than_peak`` bytes at their peaks: whether the first is kept though it is priced no lower. It is
    where it is priced within the model's ``lean_band`` and :func:`leaner`, or within ``lean_band_far`` and
    :func:`far_leaner` (``AnalyticCost.lean_band_far``); never where the model has no band."""
    band = lean_band(model)
    if not band:
        return False
    far = max(band, float(getattr(model, "lean_band_far", 0.0) or 0.0))
    if cost > than_cost * (1 + far):
        return False
    if cost <= than_cost * (1 + band) and leaner(peak, than_peak):
        return True
    return far_leaner(peak, than_peak, model)


def peaks_keep_leaner(cost: float, peak: Callable[[], float | None], than_cost: float,
                      than_peak: Callable[[], float | None], model: Any) -> bool:
    """:func:`keeps_leaner` of two programs priced ``cost`` and ``than_cost``, their peaks asked of ``peak()`` and
    ``than_peak()`` only where the model has a lean band and they are priced close enough for any peak to keep the
    first (a peak of nothing against one of everything tells; two programs' liveness: 0.04 s of an LM step)."""
    if not lean_band(model) or not keeps_leaner(cost, 0.0, than_cost, math.inf, model):
        return False
    return keeps_leaner(cost, peak(), than_cost, than_peak(), model)
