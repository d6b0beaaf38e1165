"""The clock's own noise in the decision corpus: how high a rank correlation the measurements allow.

Most of the corpus's pairs measure within 0.95-1.05x, where two timings of the same programs already disagree on
their order. A model that predicted every pair's true ratio exactly would still rank against one run's
measurements only as well as the measurements rank against the truth. Three figures say how well that is:

* ``retest``: Spearman's rank correlation between this run's measured ratios and an earlier run's of the same pairs
  (same case, same pair, the prediction moved by under 0.5%: the same programs). Two runs that agree at ``r`` leave
  a perfect model about ``sqrt(r)`` against either (the reliability of a test, in classical test theory).
* ``halves``: the same within one run, over the medians of its odd and its even rounds (records that keep their
  per-round ratios, ``ratios``); two whole runs agree at about ``2 r / (1 + r)`` (Spearman-Brown).
* ``clear``: the model's Spearman over only the pairs whose measured ratio is clear of their noise: off 1 by more
  than the case's A/A control and more than twice the standard error of the median over rounds (from the spread
  of the per-round ratios, :func:`stderr`).

These measure the instrument; the plain Spearman over every pair stays the headline's figure.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

#: how far (relatively) a pair's prediction may have moved between two runs for them to count as the same programs
SAME_PREDICTION = 0.005


def stderr(rec: dict) -> float:
    """The standard error of a pair's measured log ratio (the median over ``rounds`` per-round ratios): the per-round
    ratios' interquartile range over their median (``spread``) taken as 1.349 standard deviations of a normal, and
    the median's error as 1.2533 times the mean's.

    >>> round(stderr({"spread": 0.1349, "rounds": 4}), 4)
    0.0627
    """
    rounds = rec.get("rounds") or 1
    return 1.2533 * (rec.get("spread") or 0.0) / 1.349 / math.sqrt(rounds)


def clear(rec: dict) -> bool:
    """Whether a pair's measured ratio is off 1 by more than its noise: the A/A control's offset and twice
    :func:`stderr`.

    >>> clear({"measured": 1.05, "aa": 1.01, "spread": 0.02, "rounds": 5})
    True
    >>> clear({"measured": 1.02, "aa": 0.97, "spread": 0.02, "rounds": 5})
    False
    """
    return abs(math.log(rec["measured"])) > max(abs(math.log(rec.get("aa") or 1.0)), 2.0 * stderr(rec))


def halves(rec: dict) -> tuple[float, float] | None:
    """The medians of a pair's per-round ratios over its odd and its even rounds, or ``None`` where it keeps fewer
    than four.

    >>> halves({"ratios": [1.0, 2.0, 1.2, 2.2]})
    (1.1, 2.1)
    """
    ratios = rec.get("ratios") or []
    if len(ratios) < 4:
        return None
    return statistics.median(ratios[0::2]), statistics.median(ratios[1::2])


def carry_retest(records: Sequence[dict], earlier: Sequence[dict], date: str) -> int:
    """Give each of ``records`` the ``earlier`` run's measurement of the same pair of the same programs
    (``retest``: measured, A/A, the run's date), replacing any it had; return how many found one.

    >>> recs = [{"case": "c", "pair": "chosen", "predicted": 1.2, "measured": 1.1}]
    >>> carry_retest(recs, [{"case": "c", "pair": "chosen", "predicted": 1.2, "measured": 1.0, "aa": 1.0}], "d")
    1
    >>> recs[0]["retest"]
    {'measured': 1.0, 'aa': 1.0, 'date': 'd'}
    >>> carry_retest(recs, [{"case": "c", "pair": "chosen", "predicted": 1.5, "measured": 1.0, "aa": 1.0}], "d")
    0
    """
    by_pair = {(r["case"], r["pair"]): r for r in earlier}
    found = 0
    for rec in records:
        rec.pop("retest", None)
        old = by_pair.get((rec["case"], rec["pair"]))
        if old is None or abs(math.log(old["predicted"] / rec["predicted"])) > SAME_PREDICTION:
            continue
        rec["retest"] = {"measured": old["measured"], "aa": old.get("aa"), "date": date}
        found += 1
    return found


def figures(records: Sequence[dict], spearman: Any) -> dict[str, Any]:
    """The noise figures of the module docstring over ``records``, each with its count (``spearman``: the rank
    correlation of two sequences, passed in by the report).

    >>> from benchmarks.decisions import spearman
    >>> recs = [{"predicted": p, "measured": m, "aa": 1.03, "spread": 0.01, "rounds": 9, "retest": {"measured": t},
    ...          "ratios": [m, t] * 2} for p, m, t in ((1.0, 1.01, 0.99), (2.0, 2.0, 2.1), (3.0, 3.1, 2.9),
    ...                                                (1.1, 1.05, 0.98))]
    >>> f = figures(recs, spearman)
    >>> f["n_retest"], round(f["retest"], 2), f["n_clear"], f["clear"], f["n_halves"], round(f["halves"], 2)
    (4, 0.8, 3, 1.0, 4, 0.8)
    """
    log = math.log
    again = [r for r in records if r.get("retest")]
    split = [(r, h) for r in records if (h := halves(r)) is not None]
    shown = [r for r in records if r.get("aa") and r.get("measured")]
    calm = [r for r in shown if clear(r)]
    retest = spearman([log(r["measured"]) for r in again], [log(r["retest"]["measured"]) for r in again])
    half = spearman([log(a) for _, (a, _) in split], [log(b) for _, (_, b) in split])
    return {
        "retest": retest, "n_retest": len(again), "retest_dates": sorted({r["retest"].get("date", "") for r in again}),
        # the model against the mean of the two runs (in log ratio): each pair's noise shrunk by about sqrt(2)
        "both": spearman([log(r["predicted"]) for r in again],
                         [log(r["measured"]) + log(r["retest"]["measured"]) for r in again]),
        "halves": half, "n_halves": len(split),
        "clear": spearman([log(r["predicted"]) for r in calm], [log(r["measured"]) for r in calm]),
        "n_clear": len(calm), "n_shown": len(shown),
    }


def headline(records: Sequence[dict], spearman: Any) -> list[str]:
    """The report's lines on the noise ceiling (none where no figure can be made)."""
    f = figures(records, spearman)
    parts = []
    if f["n_retest"] >= 3 and not math.isnan(f["retest"]):
        ceiling = math.sqrt(max(f["retest"], 0.0))
        parts.append(
            f"two timings of the same programs rank alike at Spearman **{f['retest']:.3f}** (this run's measured ratios "
            f"against the run of {', '.join(f['retest_dates'])}, the {f['n_retest']} pairs whose prediction moved by "
            f"under {SAME_PREDICTION:.1%}): a model that predicted every true ratio would reach about **{ceiling:.3f}** "
            f"against one run; the model against the two runs' mean: {f['both']:.2f}")
    if f["n_halves"] >= 3 and not math.isnan(f["halves"]):
        r = f["halves"]
        parts.append(f"the odd rounds against the even within this run: {r:.2f} over {f['n_halves']} pairs"
                     + (f" (two whole runs would agree at about {2 * r / (1 + r):.2f})" if r > 0 else ""))
    if f["n_clear"] >= 3:
        parts.append(f"over the {f['n_clear']} of {f['n_shown']} pairs whose measured ratio is clear of their noise "
                     f"(off 1 by more than the A/A and twice the standard error of the median over rounds), the model's "
                     f"Spearman is **{f['clear']:.2f}**")
    if not parts:
        return []
    return ["- **the clock's own noise**, the ceiling on the rank correlation (`benchmarks/decision_noise.py`): "
            + "; ".join(parts)]
