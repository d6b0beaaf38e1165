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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None)
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args()
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
