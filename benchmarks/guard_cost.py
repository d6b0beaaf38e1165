"""What the guard costs at a first call: the near-tie guard against the plain decorator and plain ``jit``.

``Guard(near_tie=f)`` times a rewrite on the backend only where the cost model
predicts it within ``f`` of the original's speed; ``guard=True`` times every
rewrite. Either compiles both programs and times them side by side on the
first call's arguments, so the first call pays for it. This measures that
first call, for each forward program of the ecosystem suite
(``benchmarks/ecosystem.py``), with every built-in pack but ``fastmath``:

* ``jit``: ``jax.jit(fn)(*args)``, XLA's compile and one run;
* ``rewrite``: ``jax.jit(rewrite(fn))(*args)``, the rewrite, its compile and one run;
* ``near-tie``: the same with ``guard=Guard(near_tie=f)``;
* ``guard``: the same with ``guard=True``.

Under ``jax.jit`` the guard times on random inputs of the arguments' shapes and dtypes (the call's own are
not concrete there), as it does for any user who writes ``jax.jit(rewrite(fn, guard=...))``.

Each variant is a fresh function (no cache, no executable reused) and the
variants run in shuffled order per program, after one untimed warm-up of
the library's own code. It also says, per program, whether the near-tie
band timed it and which program each guard kept.

Run: ``python -m benchmarks.guard_cost [--programs a,b] [--near-tie 0.15]``; writes
``benchmarks/results/guard_cost.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import random
import statistics
import time
import warnings
from typing import Any, Callable

import jax

from benchmarks.ecosystem import CONFIGS, PROGRAMS, TIME_ONLY
from benchmarks.overhead import load_rulesets
from rewrite import rewrite
from rewrite.cost.guard import Guard

RESULTS = pathlib.Path(__file__).parent / "results"


def first_call(make: Callable[[], Callable[..., Any]], args: tuple) -> tuple[float, Any]:
    """Seconds of ``make()(*args)`` to a ready result, and the function made."""
    fn = make()
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t, fn


def measure(name: str, packs: list, near_tie: float) -> dict:
    fn, args = PROGRAMS[name].build()

    def fresh() -> Callable[..., Any]:
        return lambda *a: fn(*a)

    variants = {
        "jit": lambda: jax.jit(fresh()),
        "rewrite": lambda: jax.jit(rewrite(fresh(), rulesets=packs, cache=False)),
        "near-tie": lambda: jax.jit(rewrite(fresh(), rulesets=packs, cache=False, guard=Guard(near_tie=near_tie))),
        "guard": lambda: jax.jit(rewrite(fresh(), rulesets=packs, cache=False, guard=True)),
    }
    order = list(variants)
    random.shuffle(order)
    row: dict[str, Any] = {"program": name}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for v in order:
            seconds, made = first_call(variants[v], args)
            row[v] = seconds
            if v in ("near-tie", "guard"):
                res = made.__wrapped__.result(*args)
                row[f"{v} kept"] = res.guard.kept if res.guard is not None else "unchanged"
                row[f"{v} reason"] = res.guard.reason if res.guard is not None else ""
                row["rewritten"] = res.rewritten
    return row


def report(rows: list[dict], near_tie: float, load: tuple, end_load: tuple) -> str:
    lines = [
        "# The guard's cost at a first call",
        "",
        f"`python -m benchmarks.guard_cost --near-tie {near_tie}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
        f"UTC, jax {jax.__version__}, {jax.default_backend()}; load average {load[0]:.1f} at the start, "
        f"{end_load[0]:.1f} at the end (a shared 2-core machine: read the ratios, not the seconds). Each cell is "
        "one first call of a fresh function: trace, rewrite (if any), compile, one run. Ratios are over `jit`'s.",
        "",
        "| program | jit s | rewrite | near-tie | guard | rewritten | near-tie kept | guard kept |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['program']} | {r['jit']:.2f} | {r['rewrite'] / r['jit']:.2f}x | "
                     f"{r['near-tie'] / r['jit']:.2f}x | {r['guard'] / r['jit']:.2f}x | {r['rewritten']} | "
                     f"{r['near-tie kept']} | {r['guard kept']} |")
    med = {v: statistics.median(r[v] / r["jit"] for r in rows) for v in ("rewrite", "near-tie", "guard")}
    timed = [r for r in rows if r["rewritten"] and "not timed" not in r["near-tie reason"]]
    lines += ["", f"Median first call over `jit`'s: rewrite {med['rewrite']:.2f}x, near-tie guard "
              f"{med['near-tie']:.2f}x, full guard {med['guard']:.2f}x. The near-tie band timed "
              f"{len(timed)} of {sum(r['rewritten'] for r in rows)} rewritten programs."]
    return "\n".join(lines) + "\n"


def main() -> None:
    names = [n for n, p in PROGRAMS.items() if not p.grad and n not in TIME_ONLY]
    ap = argparse.ArgumentParser(prog="python -m benchmarks.guard_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--programs", default=",".join(names))
    ap.add_argument("--near-tie", type=float, default=0.15)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    packs = load_rulesets(CONFIGS["identity"])
    chosen = args.programs.split(",")
    measure(chosen[0], packs, args.near_tie)  # warm-up: the library's own first use (its rules' queries)
    load = os.getloadavg()
    rows = []
    for name in chosen:
        rows.append(measure(name, packs, args.near_tie))
        print(rows[-1], flush=True)
    text = report(rows, args.near_tie, load, os.getloadavg())
    pathlib.Path(args.out, "guard_cost.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
