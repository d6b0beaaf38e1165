"""How much the e-graph grows under the built-in packs, and what bounds it.

Commutativity alone at most doubles the add and mul nodes; add associativity
and the e-graph can hold every bracketing and order of a chain, exponential
in its length. This script measures, per program of ``tests/corpus.py`` and
per ruleset, the e-graph's rows after loading and after saturation, the
iterations, why saturation stopped, the time each stage took (the pipeline's
own stage timers), and the cost before and after. A second table grows a
synthetic sum chain to show the back-off and the limits at work.

Run it holding the benchmark lock, from the repository root::

    flock /tmp/bench.lock python -m benchmarks.growth            # writes benchmarks/results/growth.md
    flock /tmp/bench.lock python -m benchmarks.growth --quick    # a smaller chain sweep, printed only
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

import rulesets
from rewrite import Limits, Ruleset, explain

RESULTS = pathlib.Path(__file__).parent / "results" / "growth.md"


def measure(fn: Callable[..., Any], args: Sequence[Any], rs: list[Ruleset], limits: Limits | None = None) -> dict:
    """One rewrite: e-graph rows, iterations, stop reason, stage times and costs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        report = explain(fn, *args, rulesets=rs, limits=limits)
        wall = time.perf_counter() - t
    return {
        "rows": report.egraph_rows, "iterations": report.iterations, "stopped": report.stopped,
        "saturate": report.times["saturate"], "extract": report.times["extract"], "wall": wall,
        "cost_before": report.cost_before, "cost_after": report.cost_after,
        "eqns": (report.eqns_before, report.eqns_after), "fired": sum(report.fired.values()),
        "banned": sum(s.banned for s in report.result.stats.values()),
    }


def corpus_table(configs: dict[str, list[Ruleset]]) -> tuple[str, dict]:
    from tests.corpus import corpus

    return program_table(corpus(), configs)


def transformer_programs(layers: Sequence[int]) -> list[tuple[str, Callable[..., Any], Any]]:
    from benchmarks.programs import transformer_step

    return [(f"transformer step, {n} layer(s)", *transformer_step(n, kind="step")) for n in layers]


def program_table(programs: Sequence[tuple[str, Callable[..., Any], Any]],
                  configs: dict[str, list[Ruleset]]) -> tuple[str, dict]:
    lines = ["| program | eqns | rows loaded | " + " | ".join(
        f"{c}: rows, iters, stop, saturate s, cost saved" for c in configs) + " |",
             "|---|---|---|" + "---|" * len(configs)]
    totals = {c: {"rows": 0, "saturate": 0.0, "wall": 0.0, "limited": 0} for c in configs}
    for name, fn, args in programs:
        base = measure(fn, args, [])
        cells = [name, str(base["eqns"][0]), f"{base['rows']:,}"]
        for c, rs in configs.items():
            m = measure(fn, args, rs)
            saved = 1 - m["cost_after"] / m["cost_before"] if m["cost_before"] else 0.0
            cells.append(f"{m['rows']:,} ({m['rows'] / base['rows']:.1f}x), {m['iterations']}, "
                         f"{_short(m['stopped'])}, {m['saturate']:.2f}, {saved:.1%}")
            t = totals[c]
            t["rows"] += m["rows"]
            t["saturate"] += m["saturate"]
            t["wall"] += m["wall"]
            t["limited"] += m["stopped"] != "saturated"
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], file=sys.stderr)
    return "\n".join(lines), totals


def _short(stopped: str) -> str:
    return {"saturated": "sat", "iteration limit": "iters", "node limit": "nodes", "time limit": "time"}.get(stopped,
                                                                                                            stopped)


def sum_chain(n: int) -> tuple[Callable[..., Any], list[Any]]:
    """sin(x0 + x1 + ... + x(n-1)): a chain of n-1 adds, n distinct leaves."""
    def f(*xs):
        acc = xs[0]
        for x in xs[1:]:
            acc = acc + x
        return jnp.sin(acc)

    return f, [jnp.full((4,), float(i + 1)) for i in range(n)]


def chain_table(sizes: Sequence[int]) -> str:
    algebra, reassociate = rulesets.algebra, rulesets.fastmath.reassociate
    unbounded = Ruleset("reassociate_no_backoff", list(reassociate), soundness="fastmath",
                        limits=Limits(matches=10 ** 9, ban=1))
    configs = {
        "algebra (commutativity only)": ([algebra], None),
        "+ reassociate (its back-off: 200 matches/iter)": ([algebra, reassociate], None),
        "+ reassociate, no back-off, run limits only": ([algebra, unbounded], Limits(matches=10 ** 9)),
    }
    lines = ["| terms | " + " | ".join(f"{c}: rows, iters, stop, saturate s, bans" for c in configs) + " |",
             "|---|" + "---|" * len(configs)]
    for n in sizes:
        fn, args = sum_chain(n)
        cells = [str(n)]
        for c, (rs, limits) in configs.items():
            if "no back-off" in c and n > 16:
                cells.append("not run (exhausts the limits)")
                continue
            m = measure(fn, args, rs, limits)
            cells.append(f"{m['rows']:,}, {m['iterations']}, {_short(m['stopped'])}, {m['saturate']:.2f}, "
                         f"{m['banned']}")
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], file=sys.stderr)
    return "\n".join(lines)


NOTES = """
## Reading the tables

- `rulesets.algebra` alone grows a program's e-graph by a small constant factor (commutativity
  adds at most one mirrored node per add and mul) and saturates in a few iterations.
- Associativity is what explodes. Without back-off, a chain of a few terms fills the time limit,
  and the node limit, checked between iterations, is overshot by whatever one iteration adds.
- With reassociate's own back-off (200 new matches per iteration, bans doubling), the same chains
  stay small: the rules spend most iterations banned, and saturation ends at the iteration
  limit with the best program found so far. Longer chains are banned sooner, so they can end
  smaller than shorter ones.
"""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small chain sweep and no corpus; print only")
    opts = parser.parse_args(argv)
    algebra, fastmath = rulesets.algebra, rulesets.fastmath
    sizes = [4, 8] if opts.quick else [4, 8, 16, 32]
    parts = [f"# E-graph growth under the built-in packs\n\n"
             f"Machine: {platform.machine()}, {platform.python_version()}, jax {jax.__version__}; "
             f"default `Limits()` ({Limits()}). Rows are all rows of the e-graph (nodes, names, facts, "
             f"matches). Times are the pipeline's own stage timers, in seconds, on a shared 2-core machine.\n"]
    if not opts.quick:
        table, totals = corpus_table({"algebra": [algebra], "algebra + fastmath": [algebra, fastmath]})
        parts.append("## Corpus programs (tests/corpus.py)\n\nEach cell: rows after saturation (growth over the "
                     "loaded program), iterations, why it stopped (sat = saturated), saturation seconds, and the "
                     "fraction of the cost model's cost removed.\n\n" + table)
        parts.append("\n" + "\n".join(
            f"- {c}: {t['rows']:,} rows in all, {t['saturate']:.1f} s saturating, {t['wall']:.1f} s in all, "
            f"{t['limited']} program(s) stopped at a limit" for c, t in totals.items()))
    if not opts.quick:
        table, _ = program_table(transformer_programs([1, 2, 4, 8]),
                                 {"algebra": [algebra], "algebra + fastmath": [algebra, fastmath]})
        parts.append("\n## Larger programs: transformer training steps (benchmarks/programs.py)\n\n" + table)
    parts.append("\n## A chain of additions, sin(x0 + ... + x(n-1))\n\nEach cell: rows, iterations, stop reason, "
                 "saturation seconds, and how many times a rule was banned by the back-off.\n\n" + chain_table(sizes))
    parts.append(NOTES)
    text = "\n".join(parts) + "\n"
    print(text)
    if not opts.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
