"""XLA:CPU's two product paths, measured over a grid of shapes: when does a left operand that contracts its
major dimension cost more than one that contracts its minor one?

For each shape ``(batch, K, M, N)`` the same product ``[M, N] = lhs . rhs`` (contraction ``K``) is timed two
ways, interleaved in one process with an A/A control (``benchmarks/harness.py``):

* ``library``: the left operand stored ``[M, K]`` (contracting its minor dimension), the path XLA:CPU runs on
  its library (YNN) kernels;
* ``major``: the left operand stored ``[K, M]`` (contracting its major dimension), which
  ``rewrite/cost/dot.py`` calls the generic path;

both outside a loop and inside a ``lax.scan`` body (``--loop``: ``trips`` products of the shape, one per step,
each step's operands sliced from stacked inputs). The ratio reported is ``time(major) / time(library)``, which
``rewrite/cost/dot.py``'s ``FALLBACK`` and ``REPACK`` are fitted to (``tests/test_dot_path.py`` holds the model
to the recorded grid)::

    python -m benchmarks.dot_paths --lock LOCKFILE              # the grid, a few minutes
    python -m benchmarks.dot_paths --lock LOCKFILE --write      # and benchmarks/results/dot_paths.md/.json
    python -m benchmarks.dot_paths --lock LOCKFILE --tiles      # a product whole against it in tiles (measure_tiles)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import pathlib
import platform
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import harness
from benchmarks.decisions import holding

RESULTS = pathlib.Path(__file__).parent / "results"

#: (batch, K, M, N): batch 0 is a plain 2-D product; flops kept under about 2.2 GFLOP per call
GRID = [
    *[(0, k, m, n) for k, m, n in itertools.product((64, 256, 1024, 2048), (256, 1024), (64, 256, 1024))],
    *[(8, k, m, n) for k, m, n in ((64, 2048, 64), (256, 1024, 64), (1024, 1024, 64), (2048, 2048, 64),
                                   (2048, 64, 2048), (1024, 256, 256))],
    # the weight gradient of a dense layer: both operands contract their major (token) dimension
    *[(0, k, m, n) for k, m, n in ((2048, 256, 1024), (2048, 1024, 256), (8192, 256, 256), (2048, 256, 16384))],
]
QUICK = [(0, 2048, 256, 1024), (0, 256, 1024, 1024), (8, 2048, 2048, 64), (8, 64, 2048, 64)]


def product(batch: int, major: bool, trips: int = 0) -> Any:
    """The product at one shape, its left operand stored ``[K, M]`` (``major``) or ``[M, K]``; ``trips`` > 0: a
    scan of that many products over stacked operands."""
    b = (0,) if batch else ()
    c = 1 if batch else 0  # the left operand's first non-batch axis
    lhs_contract = c if major else c + 1
    dn = ((((lhs_contract,), (c,)), (b, b)))

    def one(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return lax.dot_general(lhs, rhs, dn)

    if not trips:
        return one

    def looped(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        def body(acc, xs):
            return acc + one(*xs).sum(), None
        return lax.scan(body, jnp.float32(0.0), (lhs, rhs))[0]
    return looped


def shapes(batch: int, k: int, m: int, n: int, trips: int) -> tuple[tuple, tuple, tuple]:
    """(library lhs, major lhs, rhs) shapes."""
    lead = ((trips,) if trips else ()) + ((batch,) if batch else ())
    return lead + (m, k), lead + (k, m), lead + (k, n)


def measure_shape(batch: int, k: int, m: int, n: int, trips: int, rounds: int) -> dict:
    lib_s, maj_s, rhs_s = shapes(batch, k, m, n, trips)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    lib = jax.random.normal(keys[0], lib_s, jnp.float32)
    maj = jax.random.normal(keys[1], maj_s, jnp.float32)
    rhs = jax.random.normal(keys[2], rhs_s, jnp.float32)
    f_lib, f_maj = product(batch, False, trips), product(batch, True, trips)
    variants = {"library": lambda a, b, r: f_lib(a, r), "aa": lambda a, b, r: f_lib(a, r),
                "major": lambda a, b, r: f_maj(b, r)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = harness.measure(f"dot {batch} {k} {m} {n} {trips}", variants, [lib, maj, rhs], baseline="library",
                              rounds=rounds, warmup=2)
    hlo = jax.jit(f_maj).lower(maj, rhs).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    return {"batch": batch, "k": k, "m": m, "n": n, "trips": trips,
            "flops": 2.0 * max(batch, 1) * k * m * n * max(trips, 1),
            "library_ms": row.seconds["library"] * 1e3, "major_ms": row.seconds["major"] * 1e3,
            "penalty": row.seconds["major"] / row.seconds["library"], "aa": row.ratio("aa"),
            "major_on_library_path": "ynn" in entry}


#: (N, C, V) of :func:`measure_tiles`: the LM heads of ``benchmarks/decisions.py`` (``lm_head_*_small``) and one four
#: times as many tokens
TILE_SHAPES = ((512, 256, 8192), (2048, 256, 8192))
TILES = (2, 4, 16)


def _whole(h: jax.Array, w: jax.Array) -> jax.Array:
    return jax.nn.logsumexp(h @ w, axis=1).sum()


def _vocab_tiles(t: int) -> Any:
    """The head over ``t`` vocabulary tiles, a ``scan`` carrying each row's running max and sum (the nn pack's form)."""
    def f(h: jax.Array, w: jax.Array) -> jax.Array:
        c, v = w.shape

        def body(carry: tuple, wi: jax.Array) -> tuple:
            m, s = carry
            z = h @ wi
            m2 = jnp.maximum(m, z.max(1))
            return (m2, s * jnp.exp(m - m2) + jnp.exp(z - m2[:, None]).sum(1)), None
        start = (jnp.full((h.shape[0],), -jnp.inf), jnp.zeros((h.shape[0],)))
        (m, s), _ = lax.scan(body, start, w.reshape(c, t, v // t).transpose(1, 0, 2))
        return (m + jnp.log(s)).sum()
    return f


def _token_tiles(t: int) -> Any:
    """The head over ``t`` blocks of tokens, a ``scan`` (the hand-written chunked form's)."""
    def f(h: jax.Array, w: jax.Array) -> jax.Array:
        n, c = h.shape
        return lax.scan(lambda acc, hi: (acc + jax.nn.logsumexp(hi @ w, axis=1).sum(), None), jnp.float32(0.0),
                        h.reshape(t, n // t, c))[0]
    return f


def measure_tiles(n: int, c: int, v: int, rounds: int) -> list[dict]:
    """One ``[n, c] x [c, v]`` product and its rows' logsumexp against the same in :data:`TILES` vocabulary tiles and
    token blocks, timed interleaved with an A/A control, beside the cost model's prediction (with its memory term,
    as it decides, and time alone: ``memory=0``): does a product cut in tiles pay per tile (a library call's fixed
    cost), or by the tile's size (the threads it gets)? Each row keeps what else ran meanwhile."""
    from benchmarks.decisions import Contention
    from rewrite.cost.model import AnalyticCost
    from rewrite.pipeline import program_cost

    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    h = jax.random.normal(keys[0], (n, c), jnp.float32)
    w = jax.random.normal(keys[1], (c, v), jnp.float32) / 16
    variants = {"whole": _whole, "aa": lambda h, w: _whole(h, w),
                **{f"vocab{t}": _vocab_tiles(t) for t in TILES}, **{f"tokens{t}": _token_tiles(t) for t in TILES}}
    with warnings.catch_warnings(), Contention() as busy:
        warnings.simplefilter("ignore")
        row = harness.measure(f"tiles {n} {c} {v}", variants, [h, w], baseline="whole", rounds=rounds, warmup=2)
    models = {"predicted": AnalyticCost(), "predicted_time": AnalyticCost(memory=0.0)}
    price = {k: {name: program_cost(jax.make_jaxpr(f)(h, w), m) for name, f in variants.items()}
             for k, m in models.items()}
    out = []
    for name in variants:
        if name == "whole":
            continue
        paired = sorted(a / b for a, b in zip(row.samples["whole"], row.samples[name]))
        out.append({"n": n, "c": c, "v": v, "form": name, "ms": row.seconds[name] * 1e3,
                    "measured": paired[len(paired) // 2], **{k: p["whole"] / p[name] for k, p in price.items()},
                    **busy.record()})
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# XLA:CPU's product paths: a left operand contracting its major dimension against its minor one\n",
             f"`{meta['command']}`, {meta['date']}, {meta['machine']}, jax {meta['jax']}, load average "
             f"{meta['load'][0]} -> {meta['load'][1]}, {meta['rounds']} interleaved rounds per shape. penalty: "
             "time with the left operand stored [K, M] over time with it stored [M, K] (same product); A/A: the "
             "library form compiled twice. `ynn`: whether XLA ran the [K, M] form on its library kernels too.\n",
             "| batch | K | M | N | loop trips | GFLOP | library ms | major ms | penalty | A/A | ynn |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch'] or '-'} | {r['k']} | {r['m']} | {r['n']} | {r['trips'] or '-'} | "
                     f"{r['flops'] / 1e9:.2f} | {r['library_ms']:.2f} | {r['major_ms']:.2f} | {r['penalty']:.2f}x | "
                     f"{r['aa']:.2f}x | {'yes' if r['major_on_library_path'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dot_paths", description=__doc__.splitlines()[0])
    ap.add_argument("--lock", default="", help="a lock file (flock) held while timing")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="four shapes")
    ap.add_argument("--loop", type=int, default=8, help="trips of the loop form (0: no loop forms)")
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/dot_paths.md and .json")
    ap.add_argument("--tiles", action="store_true", help="time the LM head's product whole against it in vocabulary "
                    "tiles and token blocks (measure_tiles), print, write nothing")
    a = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    if a.tiles:
        found = []
        for shape in TILE_SHAPES:
            with holding(a.lock):
                found += measure_tiles(*shape, a.rounds)
            for r in found[-(2 * len(TILES) + 1):]:
                print(f"{r['n']}x{r['c']}x{r['v']} {r['form']:9s} {r['ms']:8.2f} ms  measured {r['measured']:.3f}x  "
                      f"predicted {r['predicted']:.3f}x (time alone {r['predicted_time']:.3f}x)  load {r['load']} "
                      f"others {r['others']:.0%}", flush=True)
        return found
    grid = QUICK if a.quick else GRID
    rows = []
    for shape in grid:
        for trips in (0, a.loop) if a.loop else (0,):
            if trips and 2.0 * max(shape[0], 1) * shape[1] * shape[2] * shape[3] * trips > 4.5e9:
                continue
            with holding(a.lock):
                r = measure_shape(*shape, trips, a.rounds)
            rows.append(r)
            print(f"batch {r['batch']:2d} K {r['k']:5d} M {r['m']:5d} N {r['n']:5d} trips {r['trips']:2d}: "
                  f"library {r['library_ms']:8.2f} ms, major {r['major_ms']:8.2f} ms, penalty {r['penalty']:.2f}x "
                  f"(A/A {r['aa']:.2f}x){' ynn' if r['major_on_library_path'] else ''}", flush=True)
    meta = {"command": "python -m benchmarks.dot_paths" + (" --quick" if a.quick else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": platform.processor() or platform.machine(), "jax": jax.__version__, "rounds": a.rounds,
            "load": [f"{load0:.1f}", f"{os.getloadavg()[0]:.1f}"]}
    if a.write:
        (RESULTS / "dot_paths.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (RESULTS / "dot_paths.md").write_text(markdown(rows, meta))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
