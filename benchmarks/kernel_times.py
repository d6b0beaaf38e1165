"""Time a decision case's programs kernel by kernel: what each of XLA's compiled kernels takes per call.

A pair of the decision corpus (``benchmarks/decisions.py``) measured against its prediction says which program
is faster, not why. This script compiles the case's programs as ``decisions.py`` does and traces each alone
with JAX's profiler: on XLA:CPU every kernel (a thunk: a loop fusion, a library (YNN) fusion, a product) is one
trace event named as in the compiled HLO (``jax.jit(f).lower(...).compile().as_text()``), so the two programs
can be compared kernel by kernel, against the kernels the fusion model predicts (``FusionModel.describe``).
Run it holding the benchmark lock (``flock``, as every timing here)::

    python -m benchmarks.kernel_times ising_vjp_T256 --calls 200

Per kernel: its time per call (the sum of its events over the calls; kernels on two threads may overlap, so the
sum is not the call's time), and its median and least single time. Take the least on a shared machine: the
median moves with the load, the least much less.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import tempfile
import warnings

import jax
from jax.profiler import ProfileData

from benchmarks import decisions as D


def kernel_times(compiled, args: list, calls: int) -> dict[str, list[float]]:
    """Each kernel's event durations (ns) over ``calls`` calls of ``compiled``, traced alone."""
    for _ in range(5):
        jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir):
            for _ in range(calls):
                jax.block_until_ready(compiled(*args))
        (path,) = pathlib.Path(logdir).rglob("*.xplane.pb")
        data = ProfileData.from_file(str(path))
    out: dict[str, list[float]] = collections.defaultdict(list)
    for plane in data.planes:
        for line in plane.lines:
            if line.name == "python":  # the host's own calls (dispatch), not kernels
                continue
            for ev in line.events:
                if not ev.name.startswith(("end:", "Threadpool", "ThunkExecutor", "SlinkyThreadPool")):
                    out[ev.name].append(ev.duration_ns)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernel_times", description=__doc__.splitlines()[0])
    ap.add_argument("case", help="a case of benchmarks/decisions.py (--list there lists them)")
    ap.add_argument("--calls", type=int, default=200, help="calls traced per program")
    ap.add_argument("--programs", default="", help="comma-separated variants (original, rewritten, hand, "
                    "declined:<rule>, block:<keys>); default every one but the A/A copy")
    opts = ap.parse_args(argv)
    (case,) = D.select([opts.case])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = D.decide(case)
    want = [p for p in opts.programs.split(",") if p] or [k for k in d.variants if k != "aa"]
    print(f"{case.name}: load {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for p in d.pairs:
        print(f"  pair {p.name}: predicted {p.predicted:.3f}x ({p.first} over {p.second})")
    for name in want:
        compiled = jax.jit(d.variants[name]).lower(*d.args).compile()
        times = kernel_times(compiled, d.args, opts.calls)
        print(f"== {name}")
        for kernel, v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
            v = sorted(v)
            print(f"  {kernel[:48]:48s} per call {sum(v) / opts.calls / 1e3:9.1f} us   median {v[len(v) // 2] / 1e3:8.1f}"
                  f"   least {v[0] / 1e3:8.1f}")
    print(f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
