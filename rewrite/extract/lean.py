"""The lean band: when the cost model keeps the leaner of two programs though it is priced no lower.

A whole program's price (``AnalyticCost.program``) is its predicted time plus a memory charge: ``memory`` per byte
of its kernels' peak of temporaries (``cost/fusion.py``'s ``FusionModel.memory_price``). Two programs whose times
are within the model's ``lean_band`` of each other are taken as equally fast, and of those the :func:`leaner`
wins; within ``lean_band_far``, one that holds at most half the other's temporaries and drops arrays larger than
the cache (:func:`far_leaner`). The near band compares time alone (:func:`time_price`: a price less the memory
charge it holds, read from the peak it was computed with), as well as the whole prices: a band over prices that
already hold the charge credits the leaner program's memory twice, and takes a program up to the charge plus the
band slower in time (the gradients of ``benchmarks.derivatives.ising`` at T=256: a program holding 2 of 4 MiB
priced 2.1% dearer was taken, 6.2% slower in time alone). The far band reads whole prices, as its width was
measured (``benchmarks/results/wholestep.md``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

#: A program is leaner than another when its predicted peak of temporaries is at most this fraction of
#: the other's, and at least :data:`LEAN_BYTES` less.
LEAN_RATIO = 0.75
LEAN_BYTES = 2 ** 20


def memory_rate(model: Any) -> float:
    """What ``model`` charges per byte of a program's peak of temporaries (``AnalyticCost.memory``; 0: time only)."""
    return float(getattr(model, "memory", 0.0) or 0.0)


def lean_band(model: Any) -> float:
    """The fraction within which ``model`` takes two programs' times as equal, so that the leaner wins
    (``AnalyticCost.lean_band``); 0 where it prices time only (``memory=0``) or has no band."""
    if not memory_rate(model):
        return 0.0
    return max(0.0, float(getattr(model, "lean_band", 0.0) or 0.0))


def time_price(price: float, peak: float, model: Any) -> float:
    """A whole program's ``price`` under ``model`` less its memory charge, read from ``peak``, the kernels' peak of
    temporaries that price was computed with (``LiveFusion.peak``): the time the model predicts for it, which the
    lean band compares. The fresh charge (pages touched at each call) and a budget's overrun stay in it.

    >>> from rewrite import AnalyticCost
    >>> time_price(1000.0, 200.0, AnalyticCost(memory=0.5)), time_price(1000.0, 200.0, AnalyticCost(memory=0.0))
    (900.0, 1000.0)
    """
    return price - memory_rate(model) * peak


def closed_peaks(model: Any, closed: Any) -> tuple[float, float] | None:
    """``(held, charged)`` of a ``ClosedJaxpr`` priced whole by ``model``: the temporaries it is predicted to hold
    (``predict_temp_bytes``, which the band's :func:`leaner` compares) and the kernels' peak its price charges
    (``AnalyticCost.predict_peaks``; 0 for a model that predicts only the first); ``None`` for one that predicts
    neither."""
    both = getattr(model, "predict_peaks", None)
    if both is not None:
        held, charged = both(closed)
        return float(held), float(charged)
    predict = getattr(model, "predict_temp_bytes", None)
    return None if predict is None else (float(predict(closed)), 0.0)


def leaner(peak: float | None, than: float | None) -> bool:
    """Whether a predicted peak of ``peak`` bytes is leaner than one of ``than`` (:data:`LEAN_RATIO`)."""
    return peak is not None and than is not None and peak <= LEAN_RATIO * than and than - peak >= LEAN_BYTES


def leaner_at_most(than: float) -> float:
    """The most bytes a peak :func:`leaner` than one of ``than`` holds: ``leaner(p, than)`` is ``p <= this``.

    >>> [leaner(p, 8 * 2 ** 20) for p in (leaner_at_most(8 * 2 ** 20), leaner_at_most(8 * 2 ** 20) + 1)]
    [True, False]
    """
    return min(LEAN_RATIO * than, than - LEAN_BYTES)


def far_leaner(peak: float | None, than: float | None, model: Any) -> bool:
    """Whether a predicted peak of ``peak`` bytes holds at most half of ``than`` and more than ``model.cache`` bytes
    less, so that the arrays it drops stream from memory (``AnalyticCost.lean_band_far``)."""
    cache = getattr(model, "cache", None)
    return (peak is not None and than is not None and cache is not None and math.isfinite(cache)
            and peak <= than / 2 and than - peak > cache)


def keeps_leaner(cost: float, peak: float | None, than_cost: float, than_peak: float | None, model: Any,
                 time: float, than_time: float) -> bool:
    """The cost model's own rule between two whole programs priced ``cost`` and ``than_cost`` (``time`` and
    ``than_time`` of it time: :func:`time_price`), predicted to hold ``peak`` and ``than_peak`` bytes at their
    peaks: whether the first is kept though it is priced no lower. It is where it is :func:`leaner` and both its
    price and its time are within the model's ``lean_band`` of the other's, or where it is :func:`far_leaner` and
    priced within ``lean_band_far`` (``AnalyticCost.lean_band_far``, whose width was measured on whole prices:
    ``benchmarks/results/wholestep.md``); never where the model has no band."""
    band = lean_band(model)
    if not band:
        return False
    far = max(band, float(getattr(model, "lean_band_far", 0.0) or 0.0))
    if cost > than_cost * (1 + far):
        return False
    if cost <= than_cost * (1 + band) and time <= than_time * (1 + band) and leaner(peak, than_peak):
        return True
    return far_leaner(peak, than_peak, model)


def peaks_keep_leaner(cost: float, peak: Callable[[], float | None], than_cost: float,
                      than_peak: Callable[[], float | None], model: Any,
                      time: Callable[[], float], than_time: Callable[[], float]) -> bool:
    """:func:`keeps_leaner` of two programs priced ``cost`` and ``than_cost``, their peaks asked of ``peak()`` and
    ``than_peak()`` only where the model has a lean band and they are priced close enough for any peak to keep the
    first (a peak of nothing against one of everything tells; two programs' liveness: 0.04 s of an LM step), and
    their times of ``time()`` and ``than_time()`` only where the near band can keep it by its peaks."""
    if not lean_band(model) or not keeps_leaner(cost, 0.0, than_cost, math.inf, model, 0.0, math.inf):
        return False
    p, q = peak(), than_peak()
    if far_leaner(p, q, model):
        return keeps_leaner(cost, p, than_cost, q, model, math.inf, 0.0)  # the far band reads no time
    return leaner(p, q) and keeps_leaner(cost, p, than_cost, q, model, time(), than_time())


def closed_keep_leaner(model: Any, cost: float, program: Any, than_cost: float, than: Any) -> bool:
    """:func:`peaks_keep_leaner` of two ``ClosedJaxpr`` programs, their peaks and the memory charges of their prices
    predicted by ``model`` (:func:`closed_peaks`), each program's once (never where it predicts none)."""
    if getattr(model, "predict_temp_bytes", None) is None:
        return False
    found: dict[int, Any] = {}  # closed_peaks is never None here: the model predicts temporaries

    def peaks(p: Any) -> tuple[float, float]:
        if id(p) not in found:
            found[id(p)] = closed_peaks(model, p)
        return found[id(p)]

    return peaks_keep_leaner(cost, lambda: peaks(program)[0], than_cost, lambda: peaks(than)[0], model,
                             lambda: time_price(cost, peaks(program)[1], model),
                             lambda: time_price(than_cost, peaks(than)[1], model))
