"""The memory a process keeps after rewriting and differentiating many input signatures.

A rewritten function keeps, per signature, its programs and their statistics;
nothing else a rewrite makes (its e-graph, the egglog instance behind it)
may outlive the call that made it, nor may JAX's caches keep a function's
derivative programs once the function is gone. This script calls the loss of
issue 48 (``sum(sin(x) ** 2) + sum(tanh(x @ x.T))``, every built-in pack but
fastmath) at ``count`` new shapes ``(n, 4)`` in each of these ways, and reads
the resident memory after ``gc.collect()`` before and after:

* ``jit_grad``: ``jax.jit(jax.grad(f))``, one rewritten ``f``;
* ``jit_vjp``: ``jax.jit`` of ``jax.vjp(f, x)``'s pullback;
* ``jit_jvp``: ``jax.jit`` of ``jax.jvp(f, ...)``;
* ``new_function``: ``jax.jit(jax.grad(rewrite(loss)))`` at one shape, a new
  rewritten function each time;
* ``plain_jit_grad`` and ``forward``: ``jax.jit(jax.grad(loss))`` unrewritten
  and ``jax.jit(f)``, for reference.

Each way runs in a process of its own, so one's leftovers do not hide
another's. Run it from the repository root (it takes some minutes at 200)::

    flock /tmp/bench.lock python -m benchmarks.held_memory              # 200 signatures each
    python -m benchmarks.held_memory --count 20 --modes jit_grad        # a quick look

``tests/test_held_memory.py`` runs the same measurement at 20 signatures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Any, Callable

MODES = ("plain_jit_grad", "forward", "jit_grad", "jit_vjp", "jit_jvp", "new_function")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST = 14  # the first n of the shapes (n, 4); two smaller ones warm up first


def held_mb() -> float:
    """The resident memory, in MiB, after a full collection."""
    gc.collect()
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _loss(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.sum(jnp.sin(x) ** 2) + jnp.sum(jnp.tanh(x @ x.T))


def _step(mode: str) -> Callable[[int], Any]:
    """``mode``'s call at the ``i``-th signature."""
    import jax
    import jax.numpy as jnp

    import rulesets
    from rewrite import rewrite

    packs = [getattr(rulesets, p) for p in rulesets.PACKS if p != "fastmath"]
    f = rewrite(_loss, rulesets=packs)

    def x(i: int) -> Any:
        return jnp.ones((FIRST + i, 4), jnp.float32)

    steps: dict[str, Callable[[int], Any]] = {
        "plain_jit_grad": lambda i: jax.jit(jax.grad(_loss))(x(i)),
        "forward": lambda i: jax.jit(f)(x(i)),
        "jit_grad": lambda i: jax.jit(jax.grad(f))(x(i)),
        "jit_vjp": lambda i: jax.jit(lambda x: jax.vjp(f, x)[1](jnp.float32(1.0)))(x(i)),
        "jit_jvp": lambda i: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x(i)),
        "new_function": lambda i: jax.jit(jax.grad(rewrite(_loss, rulesets=packs)))(x(2)),
    }
    return steps[mode]


def run_mode(mode: str, count: int) -> dict:
    """``count`` signatures of ``mode`` in this process: the memory held before and after, in MiB."""
    import jax

    step = _step(mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in (-6, -5):  # warm up: the packs' first e-graph, JAX's first compilations
            jax.block_until_ready(step(i))
        before = held_mb()
        t = time.perf_counter()
        for i in range(count):
            jax.block_until_ready(step(i))
        seconds = time.perf_counter() - t
        after = held_mb()
    return {"mode": mode, "count": count, "before_mb": before, "after_mb": after,
            "per_signature_mb": (after - before) / count, "seconds": seconds}


def measure(modes: tuple[str, ...] | list[str], count: int, python: str = sys.executable) -> list[dict]:
    """Each mode in a fresh process; its row from :func:`run_mode`."""
    rows = []
    for mode in modes:
        out = subprocess.run([python, "-m", "benchmarks.held_memory", "--inside", mode, "--count", str(count)],
                             capture_output=True, text=True, check=True, cwd=ROOT)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--inside", help=argparse.SUPPRESS)  # one mode, in this process, as a JSON line
    args = p.parse_args(argv)
    if args.inside:
        print(json.dumps(run_mode(args.inside, args.count)))
        return
    print("| way | signatures | held before (MiB) | held after (MiB) | held per signature (MiB) | seconds |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        [r] = measure([mode], args.count)
        print(f"| {r['mode']} | {r['count']} | {r['before_mb']:,.0f} | {r['after_mb']:,.0f} | "
              f"{r['per_signature_mb']:.2f} | {r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
