"""The memory model against XLA over the decision corpus: every program of every decision, its predicted temp
memory beside the ``memory_analysis().temp_size_in_bytes`` XLA compiles it to.

Each case of ``benchmarks/decisions.py`` is decided (its programs built, nothing timed); each program is
compiled once and predicted by each of ``predictors`` (by default the default model's ``predict_temp_bytes``,
``predicted``, and the same with the kernels queued in the order of XLA's lists of users, ``users_order``).
:func:`count` says, for one predictor, on how many programs the prediction is within 25% of XLA's and within
4 KiB, and of the decision's pairs whose two programs XLA sizes more than 1% apart, on how many the predictor
says the same one holds more (a tie is wrong)::

    python -m benchmarks.memory_corpus /tmp/corpus.jsonl                 # every case, about ten minutes
    python -m benchmarks.memory_corpus /tmp/corpus.jsonl --cases ecosystem_equinox_mlp_grad
    python -m benchmarks.memory_corpus /tmp/corpus.jsonl --count         # the counts of a file written before

Records are appended one case a line; a case already in the file is skipped, so a run can be resumed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from typing import Any, Callable, Iterable

#: How far apart XLA must size a pair's programs for the side that holds more to count.
APART = 0.01


def collect(out: str, names: list[str] | None, predictors: dict[str, Callable[[Any], int]]) -> None:
    """Append one record per case to ``out``: its decision, its pairs and, per program, XLA's temp bytes and
    each predictor's (-1 where one raised)."""
    import jax

    from benchmarks import decisions as D
    from rewrite.ir.jaxapi import core

    done = set()
    if os.path.exists(out):
        with open(out) as f:
            done = {json.loads(line)["case"] for line in f if line.strip()}
    for case in D.select(names):
        if case.name in done:
            continue
        t = time.time()
        try:
            d = D.decide(case, programs=True, declined=True)
        except Exception as e:  # a case that cannot be decided here is reported, not counted
            print(case.name, "not decided:", e, flush=True)
            continue
        progs = {}
        for name, fn in d.variants.items():
            if name == "aa":
                continue
            closed = jax.make_jaxpr(fn)(*d.args)
            try:
                xla = jax.jit(core.jaxpr_as_fun(closed)).lower(*d.args).compile().memory_analysis()
                rec = {"xla": int(xla.temp_size_in_bytes)}
            except Exception:
                rec = {"xla": -1}
            for key, predict in predictors.items():
                try:
                    rec[key] = int(predict(closed))
                except Exception:
                    rec[key] = -1
            progs[name] = rec
        line = {"case": case.name, "decision": d.decision,
                "pairs": [[p.name, p.first, p.second] for p in d.pairs], "progs": progs,
                "secs": round(time.time() - t, 1)}
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
        print(case.name, line["secs"], {k: tuple(v.values()) for k, v in progs.items()}, flush=True)


def count(records: Iterable[dict], key: str = "predicted") -> dict:
    """For predictor ``key``: programs predicted within 25% of XLA and within 4 KiB, and the pairs XLA sizes
    more than :data:`APART` apart with how many of them the predictor orders as XLA does."""
    progs = within = near = pairs = right = 0
    for r in records:
        got = r["progs"]
        for p in got.values():
            if p["xla"] >= 0 and p.get(key, -1) >= 0:
                progs += 1
                within += abs(p[key] - p["xla"]) <= 0.25 * p["xla"]
                near += abs(p[key] - p["xla"]) <= 4096
        for pair in r["pairs"]:
            a, b = got.get(pair[1]), got.get(pair[2])
            if a is None or b is None or min(a["xla"], b["xla"], a.get(key, -1), b.get(key, -1)) < 0:
                continue
            if abs(a["xla"] - b["xla"]) <= APART * max(a["xla"], b["xla"]):
                continue
            pairs += 1
            right += a[key] != b[key] and (b[key] > a[key]) == (b["xla"] > a["xla"])
    return {"programs": progs, "within_25pct": within, "within_4KiB": near, "pairs": pairs, "right": right}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory_corpus", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="a JSON-lines file of records, appended to")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: every case)")
    ap.add_argument("--count", action="store_true", help="only count the records already in OUT")
    args = ap.parse_args(argv)
    if not args.count:
        from rewrite.cost.model import default_model

        model = default_model()
        collect(args.out, args.cases.split(",") if args.cases else None,
                {"predicted": model.predict_temp_bytes, "users_order": functools.partial(_in_users_order, model)})
    with open(args.out) as f:
        records = [json.loads(line) for line in f if line.strip()]
    for key in ("predicted", "users_order"):
        print(key, json.dumps(count(records, key)))


def _in_users_order(model: Any, closed: Any) -> int:
    """``model.predict_temp_bytes(closed)`` with the kernels queued in the order of XLA's lists of users
    (``rewrite/cost/memory.py``'s ``_users_rank``), not the default order."""
    from rewrite.cost.memory import scheduled_peak

    _, fusion, _, prog, kernels = model._replayed(closed)
    return scheduled_peak(prog, kernels, fusion.inner, users=True)


if __name__ == "__main__":
    main()
