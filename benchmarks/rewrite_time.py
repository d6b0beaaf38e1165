"""The rewrite's time against XLA's compile, per ecosystem program: no speed or value runs, so it is quick.

For each program of ``benchmarks/ecosystem.py`` (a gradient program as
``jax.grad(rewrite(loss))`` makes it the first time), in the suite's order
and in one process as the suite runs them: XLA's ``lower().compile()`` of
the program (median of two), then the rewrite's first-call time (``explain``,
trace to emit, with its disk cache in a fresh folder for each program, so
nothing is read back, its own or another program's), its stages and its
slowest rule. The ratio of the two is the suite's
overhead column.

Run ``python -m benchmarks.rewrite_time [--configs identity] [--set ecosystem] [--programs a,b]
[--out benchmarks/results/rewrite_time.md] [--emitted DIR] [--runs N]``.

Issue 48's item 3 holds every program "in the ecosystem suite or ``benchmarks/``" to XLA's compile. ``--set``
chooses which (:data:`SETS`): ``ecosystem`` (the default), ``corpus`` (the decision corpus's own programs,
``benchmarks/decisions.py``'s forward and gradient cases: the seeds, every pack's cases, the transformer; its
ecosystem cases are the suite's) or ``wholestep`` (``benchmarks/wholestep.py``'s training steps at their full
size). A gradient case whose output is not a scalar loss is held to XLA's compile of what a caller of
``jax.vjp`` runs: the outputs and the pullback at cotangents given as arguments (:func:`xla_program`).

A first call can be timed once per process, and on a shared 2-core host one program's ratio moves 20-50% from
process to process (jaxmd_lj_forces read 0.65x and 1.69x on jax 0.12 in two runs of one hour). ``--runs N`` runs the
whole measurement in N fresh processes, one after another, and reports each program's median over them, its
range, and in how many runs it was over 1.0x: a verdict on the medians, not on one draw.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from benchmarks import ecosystem as eco
from benchmarks.overhead import load_rulesets, xla_compile_times

RESULTS = pathlib.Path(__file__).parent / "results"
#: The program sets ``--set`` chooses (:func:`programs_of`).
SETS = ("ecosystem", "corpus", "wholestep")


def programs_of(which: str) -> dict[str, eco.Program]:
    """The programs of one of :data:`SETS`, by name, as :class:`benchmarks.ecosystem.Program`\\ s: the ecosystem
    suite's; the decision corpus's forward and gradient cases but its ecosystem ones (``benchmarks/decisions.py``,
    by their case names); ``benchmarks/wholestep.py``'s steps at full size (``wholestep_full_NAME``)."""
    if which == "ecosystem":
        return dict(eco.PROGRAMS)
    if which == "corpus":
        from benchmarks import decisions

        return {c.name: eco.Program(c.name, "benchmarks", c.mode, c.build, c.mode == "grad")
                for c in decisions.cases() if c.mode != "hand" and not c.name.startswith("ecosystem_")}
    if which == "wholestep":
        from benchmarks import wholestep

        return {f"wholestep_full_{n}": eco.Program(f"wholestep_full_{n}", "benchmarks", "training step",
                                                   functools.partial(build, wholestep.FULL, wholestep.plain))
                for n, build in wholestep.CASES.items()}
    raise ValueError(f"no program set {which!r}: one of {', '.join(SETS)}")


def xla_program(prog: eco.Program, flat: Callable[..., Any], leaves: list) -> tuple[Callable[..., Any], list]:
    """What XLA's compile is timed on, and its arguments: the program itself; for a gradient program, JAX's
    gradient of its scalar loss (:func:`benchmarks.ecosystem.gradient`), or, where its output is not one float
    scalar, what a caller of ``jax.vjp`` runs (the VJP's first call builds that: ``grad_result``): the outputs,
    and the pullback at the float inputs, at cotangents given as arguments."""
    if not prog.grad:
        return flat, leaves
    out = jax.eval_shape(flat, *leaves)
    if isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating):
        return eco.gradient(flat, leaves), leaves
    outs, tree = jax.tree_util.tree_flatten(out)
    at = [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    n = len(leaves)

    def vjp(*xs_cts: Any) -> Any:
        xs, cts = list(xs_cts[:n]), xs_cts[n:]

        def of_floats(*fl: Any) -> Any:
            full = list(xs)
            for i, v in zip(at, fl):
                full[i] = v
            return flat(*full)
        value, pull = jax.vjp(of_floats, *[xs[i] for i in at])
        return value, pull(jax.tree_util.tree_unflatten(tree, list(cts)))
    return vjp, list(leaves) + [jnp.ones(o.shape, o.dtype) for o in outs]


@contextlib.contextmanager
def counted_pipelines():
    """The rows of every pipeline run (saturation) while the block runs, in a list the block can read after: a
    count that the machine's load does not move, beside the seconds it does (``run_pipeline`` calls ``_run`` once
    a rewrite; the whole-step search, the derivative builds and their candidates each run their own;
    ``run_together`` saturates two programs in one e-graph, once)."""
    from rewrite import pipeline

    rows: list[int] = []
    run, together = pipeline._run, pipeline.run_together

    def counting(*args, **kwargs):
        result = run(*args, **kwargs)
        rows.append(result.rows)
        return result

    def counting_together(*args, **kwargs):  # two programs in one e-graph, saturated once: one pipeline
        results = together(*args, **kwargs)
        rows.append(results[0].rows)
        return results

    pipeline._run, pipeline.run_together = counting, counting_together
    try:
        yield rows
    finally:
        pipeline._run, pipeline.run_together = run, together


def prepared(name: str, programs: dict[str, eco.Program] | None = None) -> tuple:
    """``(prog, flat, leaves, compile_s, compile_cpu_s)``: the program ``name`` (of ``programs``, by default the
    suite's) built and flattened, and XLA's compile of it (of its gradient where it is a gradient program:
    :func:`xla_program`; the median of two), which a first call's rewrite is held to, in wall seconds and in the
    process's CPU seconds (:func:`xla_compile_times`)."""
    prog = (eco.PROGRAMS if programs is None else programs)[name]
    fn, args = prog.build()
    flat, leaves = eco._flat(fn, args)
    program, at = xla_program(prog, flat, leaves)
    times = [xla_compile_times(program, at) for _ in range(2)]
    return prog, flat, leaves, statistics.median(w for w, _ in times), statistics.median(c for _, c in times)


def measure(name: str, packs: list, via: str = "rewrite", emitted: str = "",
            programs: dict[str, eco.Program] | None = None) -> dict:
    """One program: XLA's compile seconds, the rewrite's, its stages and its slowest rule.

    ``via="rewrite"``: the first call's rewrite of ``rewrite(fn)`` (``Rewritten.result``: trace to emit, the
    disk cache's key and store included; for a gradient program, ``grad_result``: the forward's rewrite and its
    VJP's, what ``jax.grad(rewrite(fn))`` builds at its first call). ``via="explain"``: ``explain``, which also
    rewrites a training step as written for its report where ``rewrite`` need not. ``emitted``: a folder where
    the programs that come out are written as text (``NAME.txt``), so that two versions of the code can be
    compared program by program (``diff -r``): a change meant only to save time must leave them byte-identical.
    ``programs``: where ``name`` is found (:func:`programs_of`), by default the ecosystem suite.
    """
    from rewrite import explain, rewrite

    prog, flat, leaves, compile_s, compile_cpu_s = prepared(name, programs)
    with warnings.catch_warnings(), counted_pipelines() as pipelines:
        warnings.simplefilter("ignore")
        cpu0, t = time.process_time(), time.perf_counter()

        def elapsed() -> tuple[float, float]:  # the rewrite's seconds and its CPU seconds, so far
            return time.perf_counter() - t, time.process_time() - cpu0

        if via == "explain":
            report = explain(flat, *leaves, rulesets=packs, grad=prog.grad)
            rewrite_s, cpu = elapsed()
            result, times, stopped, rows = report.result, report.times, report.stopped, report.egraph_rows
        else:
            r = rewrite(flat, rulesets=packs)
            if prog.grad:
                built = r.grad_result(*leaves)
                rewrite_s, cpu = elapsed()
                result = built.joint
                times = {**{f"forward {k}": v for k, v in r.result(*leaves).times.items()}, **built.times}
            else:
                result = r.result(*leaves)
                rewrite_s, cpu = elapsed()
                times = result.times
            stopped, rows = result.stopped, result.rows
            if emitted:
                _write_emitted(pathlib.Path(emitted) / f"{name}.txt", r, leaves, prog.grad)
    stats = result.stats
    slow = max(stats.items(), key=lambda kv: kv[1].seconds) if stats else None
    return {"program": name, "compile_s": compile_s, "rewrite_s": rewrite_s, "ratio": rewrite_s / compile_s,
            "compile_cpu_s": compile_cpu_s, "cpu_s": cpu, "pipelines": len(pipelines),
            "pipeline_rows": sum(pipelines), "rows_each": list(pipelines),
            "stages": {k: v for k, v in times.items() if v >= 0.005}, "stopped": stopped,
            "rows": rows,
            "slowest_rule": None if slow is None else (slow[0], slow[1].seconds)}


def _write_emitted(path: pathlib.Path, r, leaves: tuple, grad: bool) -> None:
    """What ``rewrite(fn)`` runs for these arguments, as text: the program, and for a gradient program the
    VJP's forward and backward as ``jax.grad`` runs them; a training step's decisions come out in its program."""
    parts = [("program", r.jaxpr(*leaves))]
    if grad:
        built = r.grad_result(*leaves)
        parts += [("vjp forward", built.fwd), ("vjp backward", built.bwd)] if built is not None else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"# {label}\n{jaxpr}\n" for label, jaxpr in parts))


def _set_flag(which: str) -> str:
    return "" if which == "ecosystem" else f" --set {which}"


def markdown(rows: list[dict], config: str, load: tuple, via: str = "rewrite", which: str = "ecosystem") -> str:
    ratios = [r["ratio"] for r in rows]
    cpu_ratios = [r["cpu_s"] / r["compile_cpu_s"] for r in rows]
    lines = [
        f"# Rewrite time against XLA's compile ({config}, {which})",
        "",
        f"`python -m benchmarks.rewrite_time{_set_flag(which)}` on {jax.default_backend()}, jax {jax.__version__}, "
        f"{datetime.date.today().isoformat()}; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        f"(1 / 5 / 15 min) at the start, on {os.cpu_count()} cores. One process, the set's order; each "
        "rewrite is its first call (a fresh disk cache for each program). Ratio: rewrite seconds over XLA's. "
        "CPU s: the rewrite's "
        "`time.process_time` (XLA CPU s: the process's during XLA's compile, median of two; CPU ratio: the one over "
        "the other); pipelines: the saturations it ran (`run_pipeline`), with their e-graph rows summed (two "
        "counts the load does not move; where there are several, each one's rows in the order they ran). The "
        "rewrite timed: "
        + ("`explain`'s." if via == "explain" else "`rewrite(fn)`'s first call (`result`; for a gradient program "
                                                   "`grad_result`, what `jax.grad(rewrite(fn))` builds)."),
        "",
        f"Median ratio {statistics.median(ratios):.2f}x, worst {max(ratios):.2f}x "
        f"({max(rows, key=lambda r: r['ratio'])['program']}); {sum(x <= 1 for x in ratios)} of {len(rows)} "
        f"at or under 1.0x. In CPU seconds (XLA's compile runs on several threads, the rewrite on one): median "
        f"{statistics.median(cpu_ratios):.2f}x, worst {max(cpu_ratios):.2f}x; XLA's compile used "
        f"{statistics.median(r['compile_cpu_s'] / r['compile_s'] for r in rows):.2f} CPU seconds a second (median).",
        "",
        "| program | XLA compile s | rewrite s | ratio | XLA CPU s | CPU s | CPU ratio | pipelines (rows) | stages (s) "
        "| slowest rule (s) | stopped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stages = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["stages"].items(), key=lambda kv: -kv[1]))
        slow = "-" if r["slowest_rule"] is None else f"{r['slowest_rule'][0]} {r['slowest_rule'][1]:.2f}"
        lines.append(f"| {r['program']} | {r['compile_s']:.2f} | {r['rewrite_s']:.2f} | {r['ratio']:.2f}x | "
                     f"{r['compile_cpu_s']:.2f} | {r['cpu_s']:.2f} | {r['cpu_s'] / r['compile_cpu_s']:.2f}x | "
                     f"{r['pipelines']} ({_rows(r)}) | "
                     f"{stages} | {slow} | {r['stopped'].split(',')[0]} |")
    return "\n".join(lines) + "\n"


def _rows(r: dict) -> str:
    """The pipelines' rows summed, and each one's where there are several (which of a training step's pipelines
    grew: its forward, its joint, the forward without the ``jointly`` rules and its joint, the step's rest)."""
    each = r.get("rows_each", [])
    return f"{r['pipeline_rows']:,}" + (f": {' + '.join(f'{n:,}' for n in each)}" if len(each) > 1 else "")


def aggregate(runs: list[list[dict]]) -> list[dict]:
    """Each program's rows over several runs (each a list of :func:`measure`'s rows, in the suite's order), as one
    row: the medians of XLA's seconds, the rewrite's, the ratio and the CPU ratio; the ratio's range; and
    ``over``, the runs in which the ratio passed 1.0x. A program missing from a run (it failed there) is
    aggregated over the runs that have it (``n``)."""
    names = list(dict.fromkeys(r["program"] for run in runs for r in run))
    out = []
    for name in names:
        rows = [r for run in runs for r in run if r["program"] == name]
        ratios = [r["ratio"] for r in rows]
        out.append({"program": name, "n": len(rows), "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                    "ratio_max": max(ratios), "over": sum(x > 1 for x in ratios),
                    "cpu_ratio": statistics.median(r["cpu_s"] / r["compile_cpu_s"] for r in rows),
                    **{k: statistics.median(r[k] for r in rows) for k in ("compile_s", "rewrite_s", "compile_cpu_s",
                                                                          "cpu_s")}})
    return out


def markdown_runs(rows: list[dict], runs: int, config: str, load: tuple, via: str = "rewrite",
                  which: str = "ecosystem") -> str:
    """The report of :func:`aggregate`'s rows: the verdict on the medians, and per program its range."""
    ratios = [r["ratio"] for r in rows]
    every = sum(r["over"] == 0 for r in rows)
    lines = [
        f"# Rewrite time against XLA's compile ({config}, {which}), {runs} runs",
        "",
        f"`python -m benchmarks.rewrite_time{_set_flag(which)} --runs {runs}` on {jax.default_backend()}, "
        f"jax {jax.__version__}, "
        f"{datetime.date.today().isoformat()}; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the "
        f"start, on {os.cpu_count()} cores. {runs} fresh processes one after another, each the set's order as one "
        "run times it (each rewrite its first call, a fresh disk cache for each program; XLA's compile the median "
        "of two); per "
        "program the median over the runs, the ratio's range, and the runs over 1.0x. The rewrite timed: "
        + ("`explain`'s." if via == "explain" else "`rewrite(fn)`'s first call."),
        "",
        f"On the medians: ratio median {statistics.median(ratios):.2f}x, worst {max(ratios):.2f}x "
        f"({max(rows, key=lambda r: r['ratio'])['program']}); **{sum(x <= 1 for x in ratios)} of {len(rows)}** at "
        f"or under 1.0x, {every} of {len(rows)} in every run. In CPU seconds: median "
        f"{statistics.median(r['cpu_ratio'] for r in rows):.2f}x, worst {max(r['cpu_ratio'] for r in rows):.2f}x.",
        "",
        "| program | XLA compile s | rewrite s | ratio (median) | ratio (range) | runs over 1.0x | CPU ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:  # the medians over 1.0x in bold
        bold = "**" if r["ratio"] > 1 else ""
        lines.append(f"| {r['program']} | {r['compile_s']:.2f} | {r['rewrite_s']:.2f} | {bold}{r['ratio']:.2f}x{bold}"
                     f" | {r['ratio_min']:.2f}-{r['ratio_max']:.2f}x | {r['over']} of {r['n']} | "
                     f"{r['cpu_ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def _in_processes(args: argparse.Namespace) -> list[list[dict]]:
    """The measurement run ``args.runs`` times, each in a fresh process, one after another: their rows."""
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.runs):
            out = pathlib.Path(folder) / f"run{i}.json"
            cmd = [sys.executable, "-m", "benchmarks.rewrite_time", "--set", args.set, "--programs", args.programs,
                   "--configs", args.configs, "--via", args.via, "--out", "", "--json", str(out)]
            print(f"run {i + 1} of {args.runs}", flush=True)
            subprocess.run(cmd, check=True)
            runs.append(json.loads(out.read_text()))
    return runs


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.rewrite_time", description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="ecosystem", choices=SETS, help="which programs: the ecosystem suite's, the "
                    "decision corpus's own, or benchmarks.wholestep's steps at full size (see the module's text)")
    ap.add_argument("--programs", default="", help="names of the set's programs (comma-separated); all by default")
    ap.add_argument("--configs", default="identity", help=f"one of {','.join(eco.CONFIGS)}")
    ap.add_argument("--out", default=str(RESULTS / "rewrite_time.md"), help="the report ('' for none)")
    ap.add_argument("--via", default="rewrite", choices=("rewrite", "explain"), help="what is timed (see measure)")
    ap.add_argument("--emitted", default="", help="a folder to write each program's emitted programs to (text)")
    ap.add_argument("--runs", type=int, default=1, help="fresh processes to run it in, one after another; per "
                    "program the median over them is reported, with its range")
    ap.add_argument("--json", default="", help="also write the rows to this file (JSON)")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    if args.runs > 1:
        if args.emitted:
            ap.error("--emitted writes one run's programs: give it without --runs")
        runs = _in_processes(args)
        rows = aggregate(runs)
        print(f"medians over {args.runs} runs: median {statistics.median(r['ratio'] for r in rows):.2f}x, worst "
              f"{max(r['ratio'] for r in rows):.2f}x, {sum(r['ratio'] <= 1 for r in rows)} of {len(rows)} at or "
              "under 1.0x")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(runs))
        if args.out:
            pathlib.Path(args.out).write_text(markdown_runs(rows, args.runs, args.configs, load, args.via, args.set))
        return rows
    packs = load_rulesets(eco.CONFIGS[args.configs])
    programs = programs_of(args.set)
    names = [n for n in args.programs.split(",") if n] or list(programs)
    unknown = [n for n in names if n not in programs]
    if unknown:
        ap.error(f"not programs of the set {args.set!r}: {', '.join(unknown)}")
    rows = []
    for name in names:
        # a first call: nothing stored before, by this program or by another of the set (the corpus's gradient of
        # a loss whose forward an earlier case rewrote would read that forward back: nn_lm_one_hot_grad)
        with tempfile.TemporaryDirectory() as folder:
            os.environ["JAX_REWRITE_CACHE_DIR"] = folder
            rows.append(measure(name, packs, args.via, args.emitted, programs))
            r = rows[-1]
            print(f"{name:36s} compile {r['compile_s']:6.2f} s  rewrite {r['rewrite_s']:6.2f} s  "
                  f"ratio {r['ratio']:5.2f}x  cpu {r['cpu_s']:5.2f} s (XLA's {r['compile_cpu_s']:5.2f} s)  "
                  f"pipelines {r['pipelines']} ({_rows(r)} rows)  slowest rule {r['slowest_rule']}", flush=True)
    print(f"median {statistics.median(r['ratio'] for r in rows):.2f}x, worst {max(r['ratio'] for r in rows):.2f}x")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows))
    if args.out:
        pathlib.Path(args.out).write_text(markdown(rows, args.configs, load, args.via, args.set))
    return rows


if __name__ == "__main__":
    main()
