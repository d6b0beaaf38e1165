"""The disk cache across processes: what a second process pays for a program the first one rewrote.

For each program, three fresh Python processes run one after another on an
empty cache directory: the first rewrites and stores, the second and third
find the entry. Each reports the time of its first ``f.jaxpr(*args)`` (trace,
then rewrite or load; JAX's own compile is not included) and whether it
loaded; the second and third are an A/A pair. A fourth process with the
cache off is the control for the trace time alone. Programs: seed 000's
value-and-gradient with the derivatives pack, the overhead benchmark's
6-layer transformer training step with ``algebra`` and ``derivatives``, and
softmax attention (B=2, H=4, N=1024, D=64, float32) with ``attention``, whose
entry holds the rule's custom_vjp written as jaxprs.

Run: ``python -m benchmarks.cache [--layers 6]``. Writes ``benchmarks/results/cache.md``.

``python -m benchmarks.cache --ecosystem [--programs a,b]`` checks instead
that every ecosystem program (``benchmarks/ecosystem.py``, its identity packs)
is stored after its first rewrite and reads back as the same program: for each,
in one process, a rewrite with a fresh cache directory, then a second
``rewrite`` of it that must load the entry, compared by XLA's optimised HLO
(source metadata left out; a loaded program's shared sub-jaxprs print apart,
and a literal read back as a typed array lowers a no-op ``convert`` less). It
prints a table and exits non-zero if any program is not stored, not loaded or
not the same; nothing is written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

RESULTS = pathlib.Path(__file__).parent / "results"


def child(program: str, layers: int) -> dict:
    """Run in a fresh process: build the program, time its first rewrite (or load)."""
    t0 = time.perf_counter()
    import jax

    import rulesets
    from rewrite import rewrite

    if program == "seed000":
        from benchmarks.derivatives import as_value_and_grad, inputs, seed

        fn, args, rs = as_value_and_grad(seed), inputs(64), [rulesets.derivatives]
    elif program == "attention":
        import jax.numpy as jnp

        def fn(q, k, v):
            return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / 8.0, axis=-1) @ v

        keys = jax.random.split(jax.random.key(0), 3)
        args = tuple(jax.random.normal(k, (2, 4, 1024, 64), jnp.float32) for k in keys)
        rs = [rulesets.attention]
    else:
        from benchmarks.programs import transformer_step

        fn, args = transformer_step(layers, kind="step")
        rs = [rulesets.algebra, rulesets.derivatives]
    imported = time.perf_counter() - t0
    f = rewrite(fn, rulesets=rs)
    t = time.perf_counter()
    f.jaxpr(*args)
    first = time.perf_counter() - t
    result = f.result(*args)
    out = jax.jit(f)(*args)
    jax.block_until_ready(out)
    want = jax.jit(fn)(*args)
    ok = all(bool(jax.numpy.allclose(a, b, rtol=1e-4, atol=1e-5))
             for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(want)))
    return {"first_call_s": first, "imports_s": imported, "loaded": f.loaded, "rewrites": f.rewrites,
            "stages": {k: round(v, 4) for k, v in result.times.items()}, "stopped": result.stopped,
            "values_match": ok, "cached": result.cached is not None}


def spawn(program: str, layers: int, cache: str) -> dict:
    env = dict(os.environ, JAX_REWRITE_CACHE_DIR=cache)
    done = subprocess.run([sys.executable, "-m", "benchmarks.cache", "--child", program, "--layers", str(layers)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def ecosystem_round_trip(names: list[str]) -> list[dict]:
    """Each ecosystem program rewritten with a fresh cache directory, then loaded by a second ``rewrite``."""
    import logging
    import re
    import warnings

    import jax

    from benchmarks import ecosystem as eco
    from benchmarks.overhead import load_rulesets
    from rewrite import rewrite
    from rewrite.ir.jaxapi import core

    refused: list[str] = []

    class Refusals(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "not storing" in record.getMessage():
                refused.append(record.getMessage())

    logger = logging.getLogger("rewrite")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Refusals())
    packs = load_rulesets(eco.CONFIGS["identity"])

    def hlo(closed):
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
        text = jax.jit(core.jaxpr_as_fun(closed)).lower(*avals).compile().as_text()
        text = text.split("\nFileNames")[0]  # the source locations' tables, after the computations
        return re.sub(r", metadata=\{[^}]*\}", "", text)

    rows = []
    for name in names:
        fn, args = eco.PROGRAMS[name].build()
        flat, leaves = eco._flat(fn, args)
        refused.clear()
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            first = rewrite(flat, rulesets=packs, cache=d).result(*leaves)
            rewrite_s = time.perf_counter() - t
            second_fn = rewrite(flat, rulesets=packs, cache=d)
            t = time.perf_counter()
            second = second_fn.result(*leaves)
            load_s = time.perf_counter() - t
        same = (first.after is None) == (second.after is None) and (
            first.after is None or hlo(first.after) == hlo(second.after))
        rows.append({"program": name, "stored": not refused, "loaded": second_fn.loaded == 1, "same": same,
                     "rewrite_s": rewrite_s, "load_s": load_s, "why": refused[0] if refused else ""})
        print(f"{name}: stored {not refused}, loaded {second_fn.loaded == 1}, same {same}, "
              f"{rewrite_s:.2f} s -> {load_s:.2f} s", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--ecosystem", action="store_true", help="check every ecosystem program's round trip")
    ap.add_argument("--programs", default="", help="with --ecosystem: these programs only (comma-separated)")
    args = ap.parse_args()
    if args.ecosystem:
        import jax

        from benchmarks import ecosystem as eco

        rows = ecosystem_round_trip([p for p in args.programs.split(",") if p] or list(eco.PROGRAMS))
        print(f"jax {jax.__version__}, {datetime.date.today()}\n\n| program | stored | loaded | same program | "
              "rewrite s | load s |\n|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['program']} | {r['stored']} | {r['loaded']} | {r['same']} | {r['rewrite_s']:.2f} | "
                  f"{r['load_s']:.2f} |" + (f" {r['why']}" if r["why"] else ""))
        sys.exit(0 if all(r["stored"] and r["loaded"] and r["same"] for r in rows) else 1)
    if args.child:
        print(json.dumps(child(args.child, args.layers)))
        return
    rows = []
    for program, label in (("seed000", "seed 000, value and gradient, T=64 (derivatives)"),
                           ("step", f"training step, {args.layers} layers (algebra, derivatives)"),
                           ("attention", "softmax attention, B=2 H=4 N=1024 D=64 f32 (attention)")):
        with tempfile.TemporaryDirectory() as d:
            runs = [spawn(program, args.layers, d) for _ in range(3)]
            entries = sorted(p.name for p in pathlib.Path(d).rglob("*.rwx"))
            size = sum(p.stat().st_size for p in pathlib.Path(d).rglob("*.rwx"))
        control = spawn(program, args.layers, "off")
        rows.append({"program": label, "runs": runs, "control": control, "entries": len(entries), "bytes": size})
        print(label, [round(r["first_call_s"], 3) for r in runs], "control", round(control["first_call_s"], 3),
              file=sys.stderr)
    lines = [f"# The disk cache across processes ({datetime.date.today()})", "",
             "Time of the first `f.jaxpr(*args)` in a fresh process (trace, then rewrite or load from the disk "
             "cache; JAX's compile not included). Process 1 starts from an empty cache directory and stores the "
             "entry; processes 2 and 3 load it (an A/A pair). The control runs with the cache off, so it traces and "
             "rewrites. Taken on a shared machine (2 cores, other jobs running). `python -m benchmarks.cache`.", "",
             "| program | process 1 (rewrite + store) s | process 2 s | process 3 s | cache off s | 1 / 2 | "
             "load stage s | entry KiB | values match |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p1, p2, p3 = r["runs"]
        assert not p1["loaded"] and p2["loaded"] and p3["loaded"], r
        lines.append(f"| {r['program']} | {p1['first_call_s']:.3f} | {p2['first_call_s']:.3f} | "
                     f"{p3['first_call_s']:.3f} | {r['control']['first_call_s']:.3f} | "
                     f"{p1['first_call_s'] / p2['first_call_s']:.1f}x | {p2['stages'].get('cache_load', 0):.3f} | "
                     f"{r['bytes'] / 1024:.0f} | {all(x['values_match'] for x in r['runs'])} |")
    lines += ["", "Stage times (s) per process:", ""]
    for r in rows:
        for i, p in enumerate(r["runs"], 1):
            lines.append(f"- {r['program']}, process {i}: {p['stages']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cache.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
