"""A script's first call as its user pays it: each ecosystem program's first compiled call in a fresh process,
plain and rewritten.

``benchmarks.rewrite_time`` times each rewrite after other programs' rewrites in one process (the suite's order).
A script rewrites once, in a process that has rewritten nothing: it pays what a process pays once (the rules'
fingerprints for the disk cache's key, the e-graph pool's first e-graphs, the first traces of the rules' helpers),
and the plain script pays JAX's and XLA's own first-use costs. So here each program runs in two kinds of fresh
process, alternated ``--runs`` times: each builds the program (not timed), then times
``jax.jit(f).lower(*args).compile()`` from nothing, ``f`` the program as written or ``rewrite(f)`` (for a
gradient program ``jax.grad`` of either, as :func:`benchmarks.ecosystem.gradient` makes it), with a fresh disk
cache holding only the marks of the packs' example checks (a script run after the packs' first import on the
machine; the import is timed apart, ``import_s``): for the rewritten one that is its trace, its rewrite (with the
cache's key and store) and XLA's compile of what comes out. The rewrite's **extra** seconds are the one first
call less the other; the verdict is on them against the plain first call's (``rewrite_time``'s own verdict is on
the rewrite against XLA's compile alone).

Run ``python -m benchmarks.first_call [--programs a,b] [--configs identity] [--runs N] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import jax

from benchmarks import ecosystem as eco
from benchmarks.overhead import load_rulesets
from rewrite import rewrite

VARIANTS = ("plain", "rewritten")


def first_call(name: str, variant: str, config: str = "identity") -> dict:
    """In this process, which must have compiled and rewritten nothing before: program ``name`` built, then its
    first ``jax.jit(...).lower(...).compile()`` timed, as written (``variant="plain"``) or rewritten; and, apart,
    the import of the packs (``rulesets`` loads each when first named), which a script makes at its top
    (``import_s``; 0 for plain)."""
    t = time.perf_counter()
    packs = load_rulesets(eco.CONFIGS[config]) if variant == "rewritten" else []  # as a script imports them
    imported = time.perf_counter() - t
    prog = eco.PROGRAMS[name]
    fn, args = prog.build()
    flat, leaves = eco._flat(fn, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        if variant == "rewritten":
            flat = rewrite(flat, rulesets=packs)
        program = eco.gradient(flat, leaves) if prog.grad else flat
        jax.jit(program).lower(*leaves).compile()
        seconds = time.perf_counter() - t
    return {"program": name, "variant": variant, "seconds": seconds, "import_s": imported}


def _primed(folder: str, config: str) -> pathlib.Path:
    """A disk cache holding only the marks of the packs' example checks (``rewrite.cache.store.ExampleChecks``),
    made by importing them once in a process of its own: a script run after the packs' first import on the
    machine, which runs their checks once (seconds) and keeps a mark of each."""
    template = pathlib.Path(folder) / "primed"
    cmd = [sys.executable, "-c", f"from benchmarks.overhead import load_rulesets; load_rulesets({config!r})"]
    subprocess.run(cmd, check=True, env={**os.environ, "JAX_REWRITE_CACHE_DIR": str(template)})
    return template


def _in_process(name: str, variant: str, config: str, folder: str, i: int, primed: pathlib.Path) -> dict:
    """:func:`first_call` in a fresh process, with a disk cache of its own: the packs' example checks' marks
    (``primed``), and no program stored."""
    out = pathlib.Path(folder) / f"{name}.{variant}.{i}.json"
    cache = pathlib.Path(folder) / f"cache.{name}.{variant}.{i}"
    shutil.copytree(primed, cache)
    cmd = [sys.executable, "-m", "benchmarks.first_call", "--child", name, "--variant", variant, "--configs", config,
           "--json", str(out)]
    subprocess.run(cmd, check=True, env={**os.environ, "JAX_REWRITE_CACHE_DIR": str(cache)})
    shutil.rmtree(cache, ignore_errors=True)
    return json.loads(out.read_text())


def aggregate(rows: list[dict]) -> list[dict]:
    """Per program (in the order first seen), over its runs: the medians of the plain and rewritten first calls,
    and of the extra (each run's rewritten less its plain, paired by run), the extra over the plain first call
    (``ratio``, the median of the runs' ratios), its range, and ``over``, the runs where it passed 1.0x."""
    out = []
    for name in dict.fromkeys(r["program"] for r in rows):
        mine = [r for r in rows if r["program"] == name and r["variant"] == "rewritten"]
        plain = [r["seconds"] for r in rows if r["program"] == name and r["variant"] == "plain"]
        written = [r["seconds"] for r in mine]
        pairs = list(zip(plain, written))
        if not pairs:
            continue
        ratios = [(w - p) / p for p, w in pairs]
        out.append({"program": name, "n": len(pairs), "plain_s": statistics.median(plain),
                    "rewritten_s": statistics.median(written),
                    "import_s": statistics.median(r.get("import_s", 0.0) for r in mine),
                    "extra_s": statistics.median(w - p for p, w in pairs), "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios), "ratio_max": max(ratios), "over": sum(x > 1 for x in ratios)})
    return out


def markdown(rows: list[dict], runs: int, config: str, load: tuple) -> str:
    ratios = [r["ratio"] for r in rows]
    lines = [
        f"# A script's first call, plain and rewritten ({config}), {runs} runs",
        "",
        (f"`python -m benchmarks.first_call --runs {runs}` on {jax.default_backend()}, jax {jax.__version__}, "
        f"{datetime.date.today().isoformat()}; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the "
        f"start, on {os.cpu_count()} cores. Each first call in a fresh process, plain and rewritten alternated; "
        "extra: the rewritten first call less the plain one (each run's pair), and its ratio to the plain one. Import: "
        "the packs imported at the script's top (their example checks' marks kept from an earlier run), "
        "not in either first call."),
        "",
        (f"Extra over the plain first call, on the medians: median {statistics.median(ratios):.2f}x, worst "
        f"{max(ratios):.2f}x ({max(rows, key=lambda r: r['ratio'])['program']}); **{sum(x <= 1 for x in ratios)} "
        f"of {len(rows)}** at or under 1.0x."),
        "",
        ("| program | plain first call s | rewritten first call s | extra s | extra / plain (median) | range | "
        "runs over 1.0x | import s |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bold = "**" if r["ratio"] > 1 else ""
        lines.append(f"| {r['program']} | {r['plain_s']:.2f} | {r['rewritten_s']:.2f} | {r['extra_s']:.2f} | "
                     f"{bold}{r['ratio']:.2f}x{bold} | {r['ratio_min']:.2f}-{r['ratio_max']:.2f}x | "
                     f"{r['over']} of {r['n']} | {r['import_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.first_call", description=__doc__.splitlines()[0])
    ap.add_argument("--programs", default=",".join(eco.PROGRAMS))
    ap.add_argument("--configs", default="identity", help=f"one of {','.join(eco.CONFIGS)}")
    ap.add_argument("--runs", type=int, default=2, help="pairs of fresh processes per program")
    ap.add_argument("--out", default="", help="the report, as markdown ('' for none)")
    ap.add_argument("--json", default="", help="write the rows (or, with --child, the one row) to this file")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # one first call, in this process
    ap.add_argument("--variant", default="plain", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        row = first_call(args.child, args.variant, args.configs)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(row))
        return [row]
    load = os.getloadavg()
    raw = []
    with tempfile.TemporaryDirectory() as folder:
        primed = _primed(folder, eco.CONFIGS[args.configs])
        for name in [n for n in args.programs.split(",") if n]:
            for i in range(args.runs):
                order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]  # which goes first alternates
                raw += [_in_process(name, v, args.configs, folder, i, primed) for v in order]
            row = aggregate([r for r in raw if r["program"] == name])[0]
            print(f"{name:26s} plain {row['plain_s']:6.2f} s  rewritten {row['rewritten_s']:6.2f} s  extra "
                  f"{row['extra_s']:5.2f} s  {row['ratio']:5.2f}x", flush=True)
    rows = aggregate(raw)
    print(f"extra over plain: median {statistics.median(r['ratio'] for r in rows):.2f}x, worst "
          f"{max(r['ratio'] for r in rows):.2f}x, {sum(r['ratio'] <= 1 for r in rows)} of {len(rows)} at or under "
          "1.0x")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(raw))
    if args.out:
        pathlib.Path(args.out).write_text(markdown(rows, args.runs, args.configs, load))
    return rows


if __name__ == "__main__":
    main()
