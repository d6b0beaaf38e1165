"""The demonstration: the seed cases, standard JAX vs rewritten vs hand-written, measured side by side.

``python -m benchmarks`` runs it (this module's :func:`main`). For every case it

1. builds the variants (the case builders of :mod:`benchmarks.derivatives` and
   :mod:`benchmarks.scan`), all taking the same arguments;
2. runs each one once and checks it against the standard program (this is where
   the rewrite and XLA's compile happen), and stops loudly if a result differs;
3. times them with :func:`benchmarks.harness.measure`: interleaved rounds in one
   process after a warm-up, temp memory from ``memory_analysis()``, flops and
   transcendentals from ``cost_analysis()``.

It prints progress to stderr (one line per step) and the tables to stdout, and
writes ``demo.md`` (the report), ``demo.json`` (the raw rows) and PNG plots to a
fresh folder under ``benchmarks/out/`` (or ``--out DIR``), whose path it prints
last. The default is a quick run (about two minutes on two cores); ``--full``
takes the seeds' whole size ranges. Timings should hold the benchmark lock::

    flock /tmp/bench.lock python -m benchmarks                 # quick
    flock /tmp/bench.lock python -m benchmarks --full          # every size (three to four minutes on 2 cores)
    python -m benchmarks --cases seed001 --rounds 3 --out demo-out
    python -m benchmarks --smoke                               # seconds; checks the plumbing, not speed
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Callable

import jax

from benchmarks import derivatives, scan
from benchmarks.harness import MiB, Row, format_rows, format_variants, measure

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GROUPS = ("seed000", "seed001", "rnn")

# What each group shows: variant names in the demo -> the name in the module that builds it.
SEED000_VARIANTS = {
    "standard": "jax",
    "rewritten": "rewritten",
    "hand: sin(2ax) custom_vjp": "hand_sin2ax",
    "hand: shared sin/cos custom_vjp": "hand_shared",
}
SCAN_FORWARD = ("standard", "rewritten", "hand: accumulator", "hand: vectorised")
SCAN_GRAD = ("standard", "rewritten", "rewritten, stacked=100", "hand: accumulator",
             "hand: acc + checkpoint(full)", "hand: vectorised")

# Sizes: quick (the default), full (the seeds' ranges), smoke (the tiniest, for tests).
SIZES = {
    "quick": {"seed000": [512, 2048, 8192], "seed001": ["seed", "seed_large"], "rnn": [64]},
    "full": {"seed000": [512, 1024, 2048, 4096, 8192, 16384], "seed001": ["seed", "seed_large"], "rnn": [64, 512]},
    "smoke": {"seed000": [8], "seed001": ["tiny"], "rnn": [2]},
}
ROUNDS = {"quick": 7, "full": 9, "smoke": 1}
SCAN_SHAPES = {"tiny": ((4,), (6, 4)), "seed": ((10, 5, 8), (30, 15, 12)), "seed_large": ((10, 5, 8), (256, 512, 128))}


@dataclasses.dataclass
class Case:
    """One program at one size: ``build()`` returns its arguments and its variants (``standard`` first)."""

    group: str
    label: str
    build: Callable[[], tuple[tuple, dict[str, Callable]]]
    check: Callable[[dict, tuple], None]
    size: int | None = None


#: The A/A control: the standard program compiled apart, timed as one more variant (its ratio is the noise band).
AA = "standard (A/A)"


def _seed000(T: int) -> tuple[tuple, dict]:
    args, vs = derivatives.seed_case(T, extras=False, floor=False)
    out = {ours: vs[theirs] for ours, theirs in SEED000_VARIANTS.items()}
    out[AA] = derivatives.as_vjp(lambda x, a: derivatives.seed(x, a))
    return args, out


def _scan_variants(builder: Callable[[], tuple], kind: str) -> Callable[[], tuple[tuple, dict]]:
    def build():
        args, fwd, grad = builder()
        vs = fwd if kind == "forward" else grad
        keep = SCAN_FORWARD if kind == "forward" else SCAN_GRAD
        return args, {k: vs[k] for k in keep if k in vs}

    return build


def cases(sizes: dict[str, list], groups: list[str]) -> list[Case]:
    out = []
    if "seed000" in groups:
        for T in sizes["seed000"]:
            out.append(Case("seed000", f"seed000 VJP T={T}", lambda T=T: _seed000(T),
                            lambda vs, args: derivatives.check(vs, args, baseline="standard"), T))
    if "seed001" in groups:
        for name in sizes["seed001"]:
            s1, s2 = SCAN_SHAPES[name]
            builder = (lambda s1=s1, s2=s2: scan.seed_case(s1, s2))
            for kind in ("forward", "grad"):
                out.append(Case("seed001", f"seed001 {kind} xs={'x'.join(map(str, s2))}",
                                _scan_variants(builder, kind), scan._agree))
    if "rnn" in groups:
        for batch in sizes["rnn"]:
            builder = (lambda b=batch: scan.rnn_case(b))
            for kind in ("forward", "grad"):
                out.append(Case("rnn", f"rnn {kind} batch={batch}", _scan_variants(builder, kind), scan._agree,
                                batch))
    return out


# ---------------------------------------------------------------------- progress
class Progress:
    """One line per step on stderr, with the time since the start."""

    def __init__(self, stream=None, quiet: bool = False):
        self.t0 = time.perf_counter()
        self.stream = stream or sys.stderr
        self.quiet = quiet

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", file=self.stream, flush=True)


def check_each(case: Case, args: tuple, vs: dict, say: Progress) -> dict[str, float]:
    """Run every variant once (rewrite + compile + run) and check it against ``standard``; seconds per variant."""
    seconds = {}
    for name in vs:
        say(f"{case.label}: {name}: rewrite/compile/run, compare with standard")
        t = time.perf_counter()
        try:
            case.check({"standard": vs["standard"], name: vs[name]}, args)
        except AssertionError as e:
            raise SystemExit(f"error: {case.label}: {e}\nThe variant's result is wrong; nothing was timed.") from e
        seconds[name] = time.perf_counter() - t
    return seconds


# ---------------------------------------------------------------------- explain
def explain_examples() -> list[tuple[str, str]]:
    """What the rewriter did on two small programs, as ``explain`` prints it."""
    import rulesets
    from rewrite import explain
    from rewrite.report.report import primitive_counts

    out = []
    x1, x2, y = scan.seed_case(*SCAN_SHAPES["tiny"])[0]
    report = explain(scan.seed, x1, x2, y, rulesets=[rulesets.scan])
    out.append((f"Seed 001 (`benchmarks.scan.seed`, xs {tuple(x2.shape)}) with `rulesets=[rulesets.scan]`: "
                "the loss only reads the loop's stacked, carry-independent output, so the loop goes away.",
                str(report)))
    args = derivatives.inputs(8)[:2]
    report = explain(derivatives.seed, *args, rulesets=[rulesets.derivatives], grad=True)

    def transcendental(closed) -> str:
        c = primitive_counts(closed)
        return ", ".join(f"{p} {c[p]}" for p in ("sin", "cos", "exp", "log", "tanh") if c[p]) or "none"

    out.append(("Seed 000's VJP (`explain(f, x, a, rulesets=[rulesets.derivatives], grad=True)` for "
                "`f = sin(a*x)**2/a`, x of shape (32, 8, 64)): the program `jax.vjp` of `rewrite(f)` runs, "
                "JAX's VJP before and the rewritten forward and backward passes after. "
                "Transcendental equations before: "
                f"{transcendental(report.before)}; after: {transcendental(report.after)}.",
                report.summary()))
    return out


# ---------------------------------------------------------------------- tables
def fmt_bytes(n: float) -> str:
    """``0 B``, ``12 KiB``, ``64.8 MiB``: readable at every size."""
    if n < 1024:
        return f"{n:.0f} B"
    if n < MiB:
        return f"{n / 1024:.0f} KiB"
    return f"{n / MiB:.1f} MiB"


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"


def _hands(row: Row) -> list[str]:
    return [v for v in row.seconds if v.startswith("hand")]


def _rewrites(row: Row) -> list[str]:
    return [v for v in row.seconds if v.startswith("rewritten")]


def summary_table(rows: list[Row]) -> str:
    """One line per case: standard's time, the rewrite's speed-up, the best hand-written one, temp memory."""
    lines = ["| case | standard ms | rewritten | paired [90%] | A/A | best hand-written | "
             "temp memory: standard / rewritten / hand |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        hands = _hands(r)
        best = max(hands, key=r.ratio) if hands else None
        mem = lambda v: fmt_bytes(r.stats[v].temp_bytes) if v else "-"  # noqa: E731
        paired = "{:.2f}x [{:.2f}, {:.2f}]".format(*r.paired("rewritten")) if r.samples else "-"
        aa = f"{r.paired(AA)[0]:.2f}x" if AA in r.seconds and r.samples else "-"
        lines.append(f"| {r.case} | {fmt_ms(r.seconds['standard'])} | {r.ratio('rewritten'):.2f}x | {paired} | {aa} | "
                     + (f"{r.ratio(best):.2f}x ({best[len('hand: '):]})" if best else "-")
                     + f" | {mem('standard')} / {mem('rewritten')} / {mem(best)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- plots
def plot(rows: list[Row], cases_: list[Case], out: Path) -> list[str]:
    """Write the PNGs; returns their file names (none if matplotlib is missing)."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    colours = {}

    def colour(v):
        return colours.setdefault(v, f"C{len(colours) % 10}")

    seed = [(c.size, r) for c, r in zip(cases_, rows) if c.group == "seed000"]
    if seed:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        xs = [t for t, _ in seed]
        for v in seed[0][1].seconds:
            ax.plot(xs, [r.ratio(v) for _, r in seed], "o--" if v == "standard" else "o-",
                    label="standard (JAX's VJP)" if v == "standard" else v, color=colour(v))
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("T (x has shape (32, T, 64))")
        ax.set_ylabel("speed-up over JAX's VJP (higher is faster)")
        ax.set_title("Seed 000: VJP of sin(a*x)**2/a")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "demo_seed000_speedup.png", dpi=100)
        plt.close(fig)
        written.append("demo_seed000_speedup.png")

    looped = [r for c, r in zip(cases_, rows) if c.group in ("seed001", "rnn")]
    if looped:
        ncol = 2 if len(looped) > 1 else 1
        nrow = (len(looped) + ncol - 1) // ncol
        fig, axes = plt.subplots(nrow, ncol, figsize=(6.2 * ncol, 0.45 * 6 * nrow + 1.0), squeeze=False)
        for ax, r in zip(axes.flat, looped):
            names = list(r.seconds)[::-1]
            raw = [r.stats[v].temp_bytes for v in names]
            unit, scale = ("MiB", MiB) if max(raw) >= MiB else ("KiB", 1024)
            vals = [b / scale for b in raw]
            ax.barh(names, vals, color=[colour(v) for v in names])
            top = max(vals) or 1.0
            for i, (v, b) in enumerate(zip(names, raw)):
                ax.text(b / scale + top * 0.02, i, f"{fmt_bytes(b)}, {r.ratio(v):.2f}x", va="center", fontsize=8)
            ax.set_xlim(0, top * 1.6)
            ax.set_title(r.case, fontsize=10)
            ax.set_xlabel(f"temp memory, {unit} (label: memory, speed-up over standard)", fontsize=8)
            ax.tick_params(axis="y", labelsize=8)
        for ax in list(axes.flat)[len(looped):]:
            ax.axis("off")
        fig.suptitle("Seed 001 and the RNN: XLA temp memory per variant")
        fig.tight_layout()
        fig.savefig(out / "demo_scan_memory.png", dpi=100)
        plt.close(fig)
        written.append("demo_scan_memory.png")
    return written


# ---------------------------------------------------------------------- the report
def machine(load: tuple) -> str:
    dev = jax.devices()[0]
    return (f"jax {jax.__version__}, backend {dev.platform.upper()} ({getattr(dev, 'device_kind', '?')}), "
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
            + ("; no GPU was available" if dev.platform == "cpu" else "") + "; "
            f"load average {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f} at the start")


def report(rows: list[Row], cases_: list[Case], first_run: dict[str, dict[str, float]], examples, pngs: list[str],
           command: str, mode: str, rounds: int, load: tuple, elapsed: float) -> str:
    out = [
        "# jax-rewrite demo: standard JAX vs rewritten vs hand-written",
        "",
        f"`{command}` ({mode}, {rounds} timed round(s) per case), {datetime.datetime.now():%Y-%m-%d %H:%M}, "
        f"{elapsed:.0f} s in all. Machine: {machine(load)}.",
        "",
        "How to read it: every variant of a case takes the same arguments and was checked against `standard` "
        "before timing. Times are medians over rounds that run every variant once, interleaved in shuffled "
        "order after a warm-up (`benchmarks/harness.py`). **Speed-up = time(standard) / time(variant)**: above "
        "1 is faster; `paired` is the median over rounds of the per-round ratio, with its 90% bootstrap interval "
        "(`Row.paired`), and `A/A` the same for the standard program compiled apart (seed 000): the noise band. "
        "Temp memory is XLA's `memory_analysis().temp_size_in_bytes`; GFLOP and transcendentals "
        "come from `cost_analysis()`, which does not count the work inside a loop (so for `scan` programs they "
        "are not comparable between looped and unlooped variants). On a shared CPU, times drift between runs; "
        "ratios within one run are what to read, and they move by about 10% (more for tiny cases).",
        "",
        "## Summary",
        "",
        summary_table(rows),
        "",
        "Every rewritten gradient is the plain decorator under `jax.grad`/`jax.vjp` "
        "(`jax.grad(rewrite(f, rulesets=[...]))`): what runs is the VJP of the rewritten `f`, rewritten "
        "again as one program and split "
        "into forward and backward passes at the residuals the cost model prefers (`rewrite/grad/primitive.py`).",
        "",
        "* **Seed 000** (`benchmarks/derivatives.py`): the VJP of `sin(a*x)**2 / a`; standard is JAX's own "
        "VJP, rewritten is `jax.vjp(rewrite(f, rulesets=[rulesets.derivatives]), x, a)`, hand-written are the "
        "seed's hand-derived `custom_vjp`s. The rewrite replaces the forward with a kernel "
        "(`rulesets/kernels/sin_squared.py`, rule `trig_sin2_over`) whose backward computes both gradients from "
        "one `sin` and one `cos` an element over blocks of the leading axis (one block's temporaries held), "
        "`grad x` bit for bit JAX's and `a`'s sums in another order; the joint program decides it "
        "(see `benchmarks/results/derivatives.md`).",
        "* **Seed 001** (`benchmarks/scan.py`): a loss over a `lax.scan`'s stacked output; rewritten is "
        "`rewrite(loss, rulesets=[rulesets.scan])`, which computes the reduction inside the loop (or, as "
        "here, deletes a loop nothing depends on). **RNN**: an RNN with an MSE loss; the rewrite sums the "
        "loss in the loop's carry, as the hand-written accumulator does. `stacked=100` is the same with "
        "`cost_model=AnalyticCost(stacked=100.0)`, which prices the memory a loop's stacked residuals hold, "
        "so the gradient recomputes them like `jax.checkpoint` over the hand-written body.",
        "",
    ]
    for png in pngs:
        out += [f"![{png}]({png})", ""]
    out += ["## What the rewriter did", "",
            "`rewrite.explain(fn, *args, rulesets=[...])` on small versions of the seeds:", ""]
    for text, printed in examples:
        out += [text, "", "```text", printed, "```", ""]
    out += ["## Each case", ""]
    for c, r in zip(cases_, rows):
        firsts = first_run.get(r.case, {})
        out += [f"### {r.case}", "", format_variants(r), ""]
        if firsts:
            out += ["First call (rewrite + XLA compile + run + check), seconds: "
                    + ", ".join(f"{v} {s:.2f}" for v, s in firsts.items()) + ".", ""]
    seed = [r for c, r in zip(cases_, rows) if c.group == "seed000"]
    if seed:
        out += ["## Seed 000 across sizes, all figures (`harness.format_rows`)", "", format_rows(seed), ""]
    return "\n".join(out)


def _relative(text: str) -> str:
    """No absolute paths of this machine in what is written."""
    return text.replace(str(ROOT) + os.sep, "")


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the seeds' full size ranges (a few minutes)")
    size.add_argument("--smoke", action="store_true", help="the tiniest sizes, one round: checks that it all runs")
    ap.add_argument("--cases", default=",".join(GROUPS), help=f"comma-separated subset of {','.join(GROUPS)}")
    ap.add_argument("--sizes", help="seed 000's sizes T, comma-separated (overrides the mode's)")
    ap.add_argument("--rounds", type=int, help="timed rounds per case (default: quick 7, full 9, smoke 1)")
    ap.add_argument("--out", help="folder for the report and plots (default: a new one under benchmarks/out/)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    opts = ap.parse_args(argv)

    mode = "full" if opts.full else "smoke" if opts.smoke else "quick"
    sizes = dict(SIZES[mode])
    if opts.sizes:
        sizes["seed000"] = [int(s) for s in opts.sizes.split(",")]
    groups = [g.strip() for g in opts.cases.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {list(GROUPS)}")
    rounds = opts.rounds or ROUNDS[mode]
    warmup = 1 if mode == "smoke" else 2
    out = Path(opts.out) if opts.out else HERE / "out" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks" + ("" if argv is None and len(sys.argv) <= 1 else " " + " ".join(
        a for a in (sys.argv[1:] if argv is None else argv) if a != str(opts.out))).rstrip()
    if opts.out:
        command = command.replace("--out", "--out DIR")

    say = Progress(quiet=opts.quiet)
    load = os.getloadavg()
    say(f"{mode} run: {machine(load)}")
    say(f"writing to {out}")
    todo = cases(sizes, groups)
    rows: list[Row] = []
    first_run: dict[str, dict[str, float]] = {}
    for i, case in enumerate(todo, 1):
        say(f"case {i}/{len(todo)}: {case.label}: building variants")
        args, vs = case.build()
        first_run[case.label] = check_each(case, args, vs, say)
        say(f"{case.label}: all {len(vs)} variants agree with standard; timing {rounds} round(s)")
        row = measure(case.label, vs, args, rounds=rounds, warmup=warmup,
                      min_round_seconds=0.002 if mode == "smoke" else 0.02, progress=say)
        rows.append(row)
        print(f"\n{row.case}\n\n{format_variants(row)}\n", flush=True)

    say("explain: what the rewriter did on two small programs")
    examples = [(t, _relative(p)) for t, p in explain_examples()]
    say("plotting")
    pngs = plot(rows, todo, out)
    if not pngs:
        say("matplotlib is not installed: no plots (pip install -e '.[bench]')")
    elapsed = time.perf_counter() - say.t0
    text = _relative(report(rows, todo, first_run, examples, pngs, command, mode, rounds, load, elapsed))
    (out / "demo.md").write_text(text + "\n")
    (out / "demo.json").write_text(json.dumps({"mode": mode, "rounds": rounds, "load": load, "jax": jax.__version__,
                                               "rows": [r.as_dict() for r in rows]}, indent=1))
    print("Summary (speed-up = standard time / variant time; above 1 is faster)\n")
    print(summary_table(rows) + "\n")
    for t, p in examples[:1]:
        print(re.sub(r"[`*]", "", t) + "\n\n" + p + "\n")
    print(f"Report: {out / 'demo.md'}" + (f"; plots: {', '.join(pngs)}" if pngs else ""))
    print(f"Done in {elapsed:.0f} s. Output folder: {out}", flush=True)
    return out
