"""Matrix products ordered by ``rulesets.linalg``: flops against opt_einsum's optimum, and time.

Four groups, each program written the way a user would write it:

* **chains**: ``m1 @ m2 @ ... @ mn`` left to right, n = 3..8, with sizes drawn
  at random from 1..512 (seeded). For each: XLA's flops (``cost_analysis``) as
  written, after the rewrite, and of ``jnp.einsum(..., optimize="optimal")``,
  opt_einsum's own optimal contraction cost, and what saturation took (time,
  iterations, e-graph rows). The target: the rewrite's flops equal the
  optimum for every chain. At these sizes flops dominate the cost model's
  price; for small chains, where the bytes of temporaries and a launch per
  product weigh more, ``tests/test_linalg.py`` fuzzes the rewrite against the
  model's own cheapest bracketing (issue 31; ``results/log.md``).
* **attention**: linear attention with heads ``(batch, heads, N, d)``,
  ``(Q K^T / sqrt(d)) V`` as ``einsum`` writes it, against ``Q (K^T V)``.
* **low rank**: ``x (A B)`` and ``(x A) B``, in the regime where the rank is
  small (``(x A) B`` is best) and where it is large and ``x`` is tall
  (``x (A B)`` is best).
* **reductions**: ``trace(A B)``, ``diagonal(A B)``, ``sum(A B, 0)``.
* **never worse**: products already in their best order, and programs
  without products, keep their flops and time.

Variants: ``standard`` (as written, the baseline), ``rewritten``
(``rewrite(f, rulesets=[linalg])``), ``best`` (the best order written by
hand, or ``jnp.einsum(optimize="optimal")`` for chains), and ``aa`` (the
standard program again: an A/A control for the noise). Times are medians of
interleaved rounds after warm-up (``benchmarks/harness.py``).

Run holding the benchmark lock::

    flock /tmp/bench.lock python -m benchmarks.linalg --write
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import opt_einsum

from benchmarks.harness import Row, compile_stats, measure
from rewrite import explain, rewrite
from rulesets.linalg import linalg

def dot_flops(jaxpr: Any) -> int:
    """The flops of a jaxpr's ``dot_general`` (2 per multiply-add, as XLA and opt_einsum count), exactly."""
    total = 0
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            (lc, _), _ = e.params["dimension_numbers"]
            k = int(np.prod([e.invars[0].aval.shape[i] for i in lc]))
            total += 2 * int(np.prod(e.outvars[0].aval.shape)) * k
    return total


def _rand(rng: np.random.Generator, *shape: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0] if shape else 1), jnp.float32)


# ---------------------------------------------------------------------- chains
def chain(*ms: Any) -> Any:
    out = ms[0]
    for m in ms[1:]:
        out = out @ m
    return out


def chain_spec(n: int) -> str:
    sym = opt_einsum.get_symbol
    return ",".join(sym(i) + sym(i + 1) for i in range(n)) + "->" + sym(0) + sym(n)


def chains(per_length: int, seed: int) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(seed)
    return [(f"chain{n}.{k}", [int(x) for x in rng.integers(1, 513, size=n + 1)])
            for n in range(3, 9) for k in range(per_length)]


def run_chains(cases: list[tuple[str, list[int]]], rounds: int, progress: bool) -> tuple[list[dict], list[Row]]:
    rows, timed = [], []
    rng = np.random.default_rng(1)
    for name, dims in cases:
        n = len(dims) - 1
        args = [_rand(rng, dims[i], dims[i + 1]) for i in range(n)]
        spec = chain_spec(n)
        _, info = opt_einsum.contract_path(spec, *args, optimize="optimal")
        start = time.perf_counter()
        report = explain(chain, *args, rulesets=[linalg])
        seconds = time.perf_counter() - start
        rewritten = rewrite(chain, rulesets=[linalg])
        best = lambda *ms, spec=spec: jnp.einsum(spec, *ms, optimize="optimal")  # noqa: E731
        flops = {k: compile_stats(f, *args)[1].flops for k, f in
                 (("standard", chain), ("rewritten", rewritten), ("best", best))}
        rows.append({"case": name, "dims": dims, "opt_einsum": int(info.opt_cost), **flops,
                     "jaxpr": dot_flops(report.after),
                     "explain_s": seconds, "saturate_s": report.result.times["saturate"],
                     "iterations": report.iterations, "rows": report.egraph_rows, "stopped": report.stopped})
        if progress:
            print(rows[-1], flush=True)
        timed.append(measure(name, {"standard": chain, "rewritten": rewritten, "best": best, "aa": chain}, args,
                             rounds=rounds, min_round_seconds=0.01))
    return rows, timed


def run_long(lengths: list[int], seed: int) -> list[dict]:
    """Saturation of longer chains (no timing of the programs): how the e-graph and its time grow past 8."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        dims = [int(x) for x in rng.integers(1, 513, size=n + 1)]
        args = [jax.ShapeDtypeStruct((dims[i], dims[i + 1]), jnp.float32) for i in range(n)]
        _, info = opt_einsum.contract_path(chain_spec(n), *[a.shape for a in args], shapes=True, optimize="optimal"
                                           if n <= 10 else "dp")
        start = time.perf_counter()
        report = explain(chain, *[jnp.zeros(a.shape) for a in args], rulesets=[linalg])
        out.append({"n": n, "dims": dims, "jaxpr": dot_flops(report.after), "opt_einsum": int(info.opt_cost),
                    "explain_s": time.perf_counter() - start, "saturate_s": report.result.times["saturate"],
                    "iterations": report.iterations, "rows": report.egraph_rows, "stopped": report.stopped})
    return out


# ---------------------------------------------------------------------- the other programs
def attention(q: Any, k: Any, v: Any) -> Any:
    s = jnp.einsum("bhnd,bhmd->bhnm", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    return jnp.einsum("bhnm,bhme->bhne", s, v)


def attention_best(q: Any, k: Any, v: Any) -> Any:
    kv = jnp.einsum("bhmd,bhme->bhde", k, v)
    return jnp.einsum("bhnd,bhde->bhne", q / jnp.sqrt(jnp.float32(q.shape[-1])), kv)


def programs(rng: np.random.Generator) -> list[tuple[str, Callable, Callable, list]]:
    """(case, as written, best written by hand, args)."""
    out = []
    b, h, n, d = 2, 4, 2048, 64
    out.append((f"attention b={b} h={h} N={n} d={d}", attention, attention_best,
                [_rand(rng, b, h, n, d) for _ in range(3)]))
    qkv = [_rand(rng, 4096, 64) for _ in range(3)]
    out.append(("attention as in the issue: (Q K^T) V, N=4096 d=64", lambda q, k, v: (q @ k.T) @ v,
                lambda q, k, v: q @ (k.T @ v), qkv))
    x_small = lambda x, a, b: x @ (a @ b)   # noqa: E731
    x_left = lambda x, a, b: (x @ a) @ b    # noqa: E731
    # small rank: (x A) B is best
    lr = [_rand(rng, 2048, 1024), _rand(rng, 1024, 16), _rand(rng, 16, 1024)]
    out.append(("low rank r=16: x (A B)", x_small, x_left, lr))
    out.append(("low rank r=16: (x A) B", x_left, x_left, lr))
    # a wide inner dimension and a tall x: precomputing A B is best
    wide = [_rand(rng, 4096, 64), _rand(rng, 64, 1024), _rand(rng, 1024, 64)]
    out.append(("wide r=1024: x (A B)", x_small, x_small, wide))
    out.append(("wide r=1024: (x A) B", x_left, x_small, wide))
    ab = [_rand(rng, 1024, 1024), _rand(rng, 1024, 1024)]
    out.append(("trace(A B) 1024", lambda a, b: jnp.trace(a @ b), lambda a, b: jnp.sum(a * b.T), ab))
    out.append(("diagonal(A B) 1024", lambda a, b: jnp.diagonal(a @ b), lambda a, b: jnp.sum(a * b.T, axis=1), ab))
    out.append(("sum(A B, 0) 1024", lambda a, b: jnp.sum(a @ b, axis=0), lambda a, b: jnp.sum(a, axis=0) @ b, ab))
    # never worse
    mv = [_rand(rng, 2048, 2048), _rand(rng, 2048, 2048), _rand(rng, 2048)]
    best_mv = lambda a, b, x: a @ (b @ x)   # noqa: E731
    out.append(("(A B) x 2048", lambda a, b, x: (a @ b) @ x, best_mv, mv))
    out.append(("best order: A (B x) 2048", best_mv, best_mv, mv))
    mlp = [_rand(rng, 512, 512), _rand(rng, 512, 512), _rand(rng, 512)]
    dense = lambda x, w, c: jax.nn.relu(x @ w + c)   # noqa: E731
    out.append(("one product: relu(x W + c) 512", dense, dense, mlp))
    ew = [_rand(rng, 1024, 1024), _rand(rng, 1024, 1024)]
    plain = lambda a, b: jnp.tanh(a) * b + jnp.exp(-a)   # noqa: E731
    out.append(("no product: tanh(a) b + exp(-a)", plain, plain, ew))
    return out


def run_programs(rounds: int, progress: bool) -> tuple[list[Row], dict[str, bool]]:
    rows, same = [], {}
    for case, fn, best, args in programs(np.random.default_rng(2)):
        rewritten = rewrite(fn, rulesets=[linalg])
        seen = explain(fn, *args, rulesets=[linalg])
        same[case] = str(seen.before) == str(seen.after)
        np.testing.assert_allclose(np.asarray(jax.jit(rewritten)(*args)), np.asarray(jax.jit(fn)(*args)),
                                   rtol=2e-3, atol=2e-3)
        rows.append(measure(case, {"standard": fn, "rewritten": rewritten, "best": best, "aa": fn}, args,
                            rounds=rounds, min_round_seconds=0.02))
        if progress:
            print(case, {k: f"{v * 1e3:.2f} ms" for k, v in rows[-1].seconds.items()}, flush=True)
    return rows, same


# ---------------------------------------------------------------------- report
NOTE = ("Any time difference between such a program's `written` and `rewritten` columns is therefore the "
        "machine's noise, of the size the `aa` column (the written program against itself) shows; the flops "
        "columns are what the rewrite changes.")
def _g(x: float) -> str:
    return f"{x / 1e6:.3f}"


def report(chain_rows: list[dict], chain_times: list[Row], rows: list[Row], same: dict[str, bool], rounds: int,
           load: tuple, long: list[dict] = ()) -> str:
    date = datetime.date.today().isoformat()
    equal = sum(r["jaxpr"] == r["opt_einsum"] and r["rewritten"] == r["best"] for r in chain_rows)
    lines = [
        "# Matrix products ordered by `rulesets.linalg`", "",
        f"Generated by `benchmarks/linalg.py` on {date}: jax {jax.__version__}, {jax.default_backend().upper()} "
        f"({platform.machine()}, {os.cpu_count()} cores shared with other users; load average "
        f"{', '.join(f'{x:.1f}' for x in load)} when the run started). {rounds} interleaved rounds per case after "
        "warm-up; times are medians. Flops are XLA's (`compiled.cost_analysis()`); `aa` is the standard program "
        "again, an A/A control: its distance from 1.00x is the noise.", "",
        "## Chains `m1 @ m2 @ ... @ mn`, written left to right, sizes drawn from 1..512", "",
        f"The rewrite's flops equal opt_einsum's optimal contraction cost on **{equal} of {len(chain_rows)}** "
        "chains: counted exactly from the rewritten jaxpr's products (`rewritten, exact`), and as XLA counts "
        "them, equal to XLA's count for `best`, `jnp.einsum(..., optimize=\"optimal\")` (XLA reports flops as a "
        "float, so its figures can be a few flops off opt_einsum's integers). MFLOP:", "",
        "| chain | sizes | written (XLA) | rewritten (XLA) | rewritten, exact | opt_einsum optimal | best (XLA) | = | "
        "saturate s | iterations | e-graph rows | ms written | ms rewritten | ms best | aa |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, t in zip(chain_rows, chain_times):
        ok = "yes" if r["jaxpr"] == r["opt_einsum"] and r["rewritten"] == r["best"] else "**no**"
        lines.append(f"| {r['case']} | {'x'.join(map(str, r['dims']))} | {_g(r['standard'])} | {_g(r['rewritten'])} | "
                     f"{r['jaxpr']} | {r['opt_einsum']} | {_g(r['best'])} | {ok} | {r['saturate_s']:.2f} | {r['iterations']} | "
                     f"{r['rows']} | {t.seconds['standard'] * 1e3:.2f} | {t.seconds['rewritten'] * 1e3:.2f} | "
                     f"{t.seconds['best'] * 1e3:.2f} | {t.ratio('aa'):.2f}x |")
    by_n: dict[int, list[dict]] = {}
    for r in chain_rows:
        by_n.setdefault(len(r["dims"]) - 1, []).append(r)
    lines += ["", "Saturation by chain length (the bracketings of a chain of n grow as the Catalan numbers; "
              "the e-graph holds one class per contiguous sub-chain):", "",
              "| n | bracketings | e-graph rows | saturate s (max) | explain s (max) |", "|---|---|---|---|---|"]
    for n, rs in sorted(by_n.items()):
        catalan = int(round(np.prod([(n - 1 + k) / k for k in range(2, n)])))
        lines.append(f"| {n} | {catalan} | {max(r['rows'] for r in rs)} | {max(r['saturate_s'] for r in rs):.2f} | "
                     f"{max(r['explain_s'] for r in rs):.2f} |")
    if long:
        lines += ["", "Longer chains (saturation only; `optimal` is opt_einsum's `optimal` up to 10 matrices, its "
                  "dynamic programme `dp` beyond):", "",
                  "| n | bracketings | e-graph rows | iterations | stopped | saturate s | explain s | rewritten MFLOP "
                  "| optimal MFLOP | = |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in long:
            n = r["n"]
            catalan = int(round(np.prod([(n - 1 + k) / k for k in range(2, n)])))
            lines.append(f"| {n} | {catalan} | {r['rows']} | {r['iterations']} | {r['stopped']} | "
                         f"{r['saturate_s']:.2f} | {r['explain_s']:.2f} | {_g(r['jaxpr'])} | {_g(r['opt_einsum'])} | "
                         f"{'yes' if r['jaxpr'] == r['opt_einsum'] else '**no**'} |")
    lines += ["", "## Attention, low rank, reductions, and programs that must not get worse", "",
              "`unchanged`: the rewritten program is the written one, equation for equation. " + NOTE, "",
              "| case | ms written | ms rewritten | ms best | rewritten vs written | aa | GFLOP written | "
              "GFLOP rewritten | GFLOP best | unchanged |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        s, st = row.seconds, row.stats
        lines.append(f"| {row.case} | {s['standard'] * 1e3:.3f} | {s['rewritten'] * 1e3:.3f} | {s['best'] * 1e3:.3f} | "
                     f"{row.ratio('rewritten'):.2f}x | {row.ratio('aa'):.2f}x | {st['standard'].flops / 1e9:.4f} | "
                     f"{st['rewritten'].flops / 1e9:.4f} | {st['best'].flops / 1e9:.4f} | "
                     f"{'yes' if same[row.case] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-length", type=int, default=3, help="chains per length 3..8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/linalg.md")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--long", default="10,12,16", help="longer chains to saturate (no timing); empty for none")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    chain_rows, chain_times = run_chains(chains(args.per_length, args.seed), args.rounds, args.progress)
    long = run_long([int(n) for n in args.long.split(",") if n], args.seed)
    rows, same = run_programs(args.rounds, args.progress)
    text = report(chain_rows, chain_times, rows, same, args.rounds, load, long)
    print(text)
    if args.write:
        out = Path(__file__).resolve().parent / "results"
        out.mkdir(exist_ok=True)
        (out / "linalg.md").write_text(text)


if __name__ == "__main__":
    main()
