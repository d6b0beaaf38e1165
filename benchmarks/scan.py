"""Benchmarks for ``rulesets.scan`` (issue 5): the seed's example and an RNN with an MSE loss.

Every case is measured side by side in one process with :func:`benchmarks.harness.measure`:
the standard program, the rewritten one, and hand-written versions (the accumulator loop, and
for gradients the accumulator loop with a checkpointed body), forward and ``jax.grad``. The
gradient of a rewritten loss is ``jax.grad(rewrite(loss))``, which runs the loss's VJP rewritten
as one program (``rewrite/grad/primitive.py``); ``rewrite(jax.grad(loss))`` is shown next to it. Before
timing, every variant's result is checked against the standard program's.

Run it holding the benchmark lock, so that nothing else times the machine meanwhile::

    flock /tmp/bench.lock python -m benchmarks.scan            # everything (a few minutes)
    flock /tmp/bench.lock python -m benchmarks.scan --quick    # fewer rounds
    flock /tmp/bench.lock python -m benchmarks.scan rnn512     # one case by name

Results on the project machine are in ``benchmarks/results/scan.md``.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import rulesets
from benchmarks.harness import MiB, Row, measure
from rewrite import AnalyticCost, rewrite
from rulesets.scan import make

SCAN = rulesets.scan
NAMED_H = "h"


# ---------------------------------------------------------------------- the seed (JAX issue #4968)
def seed(x1, x2, y):
    """The issue's own example: a loss over a scan's stacked, carry-independent output."""
    return jnp.square(y - lax.scan(lambda c, xs: (jnp.sin(c), jnp.cos(xs)), x1, x2)[1]).mean()


def seed_accumulator(x1, x2, y):
    """Hand-written: the reduction inside the loop, as the issue proposes."""
    def step(carry, xy):
        c, acc = carry
        x, yt = xy
        return (jnp.sin(c), acc + jnp.sum(jnp.square(yt - jnp.cos(x)))), None

    (_, acc), _ = lax.scan(step, (x1, jnp.zeros((), y.dtype)), (x2, y))
    return acc / y.size


def seed_vectorised(x1, x2, y):
    """Hand-written: no loop at all; ``cos`` never read the carry."""
    return jnp.square(y - jnp.cos(x2)).mean()


def seed_case(shape1, shape2):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    args = (jax.random.normal(k[0], shape1), jax.random.normal(k[1], shape2), jax.random.normal(k[2], shape2))
    fwd = {
        "standard": seed,
        "rewritten": rewrite(seed, rulesets=[SCAN]),
        "rewritten (hoist only)": rewrite(seed, rulesets=[SCAN.hoist]),
        "hand: accumulator": seed_accumulator,
        "hand: vectorised": seed_vectorised,
    }
    grad = {k: jax.grad(f, argnums=(1, 2)) for k, f in fwd.items()}
    return args, fwd, grad


# ---------------------------------------------------------------------- the RNN
T, H, IN, OUT = 256, 128, 32, 128


def rnn_params(batch: int):
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    p = dict(W=jax.random.normal(k[0], (H, H)) * 0.1, U=jax.random.normal(k[1], (IN, H)) * 0.1,
             V=jax.random.normal(k[2], (H, OUT)) * 0.1)
    return p, jax.random.normal(k[3], (T, batch, IN)), jax.random.normal(k[4], (T, batch, OUT))


def rnn_mse(p, xs, ys):
    """The standard program: run the model, then take the loss over its stacked outputs."""
    def step(h, x):
        h = jnp.tanh(h @ p["W"] + x @ p["U"])
        return h, h @ p["V"]

    _, os = lax.scan(step, jnp.zeros((xs.shape[1], H), xs.dtype), xs)
    return jnp.mean((os - ys) ** 2)


def rnn_accumulator(p, xs, ys, remat: str | None = None):
    """Hand-written: a second copy of the model that sums the loss in its carry."""
    def step(carry, xy):
        h, acc = carry
        x, y = xy
        h = jnp.tanh(h @ p["W"] + x @ p["U"])
        if remat == "h":
            h = checkpoint_name(h, NAMED_H)
        return (h, acc + jnp.sum((h @ p["V"] - y) ** 2)), None

    if remat == "full":
        step = jax.checkpoint(step, prevent_cse=False)
    elif remat == "h":
        step = jax.checkpoint(step, prevent_cse=False, policy=jax.checkpoint_policies.save_only_these_names(NAMED_H))
    (_, acc), _ = lax.scan(step, (jnp.zeros((xs.shape[1], H), xs.dtype), jnp.zeros((), xs.dtype)), (xs, ys))
    return acc / ys.size


def docs_rnn(h0, xs, ys):
    """``docs/api.md``'s ``rulesets.scan`` example: an RNN loss over the loop's stacked output, which the hoist keeps
    from being built (the decision corpus times it at the docs' 16 x 128 and at 64 x 1024)."""
    _, outs = lax.scan(lambda h, x: (jnp.tanh(h + x), 2.0 * h), h0, xs)
    return jnp.mean((outs - ys) ** 2)


def docs_rnn_args(steps: int, width: int) -> tuple:
    """The docs' arguments at ``steps`` x ``width``: ``h0`` zeros, ``xs`` ones, ``ys`` zeros."""
    return jnp.zeros(width), jnp.ones((steps, width)), jnp.zeros((steps, width))


def rnn_case(batch: int):
    args = rnn_params(batch)
    fwd = {
        "standard": rnn_mse,
        "rewritten": rewrite(rnn_mse, rulesets=[SCAN]),
        "hand: accumulator": rnn_accumulator,
    }
    grad = {
        "standard": jax.grad(rnn_mse),
        "rewritten": jax.grad(rewrite(rnn_mse, rulesets=[SCAN])),
        # jax.grad runs the loss's VJP rewritten (rewrite/grad/primitive.py); pricing stacked memory trades
        # recomputation for it, as the checkpointed hand-written loop does.
        "rewritten, stacked=100": jax.grad(rewrite(rnn_mse, rulesets=[SCAN], cost_model=AnalyticCost(stacked=100.0))),
        "rewritten, remat=nothing": jax.grad(rewrite(rnn_mse, rulesets=[make(remat="nothing")])),
        "rewrite(grad)": rewrite(jax.grad(rnn_mse), rulesets=[SCAN]),
        "rewrite(grad), stacked=100": rewrite(jax.grad(rnn_mse), rulesets=[SCAN], cost_model=AnalyticCost(stacked=100.0)),
        "hand: accumulator": jax.grad(rnn_accumulator),
        "hand: acc + checkpoint(save h)": jax.grad(lambda *a: rnn_accumulator(*a, remat="h")),
        "hand: acc + checkpoint(full)": jax.grad(lambda *a: rnn_accumulator(*a, remat="full")),
    }
    return args, fwd, grad


CASES: dict[str, Callable[[], tuple]] = {
    "seed": lambda: seed_case((10, 5, 8), (30, 15, 12)),
    "seed_large": lambda: seed_case((10, 5, 8), (256, 512, 128)),
    "rnn64": lambda: rnn_case(64),
    "rnn512": lambda: rnn_case(512),
}


# ---------------------------------------------------------------------- running
def _agree(variants: dict[str, Callable], args: tuple, rtol: float = 2e-4) -> None:
    """Every variant computes what the standard program computes (checked before timing)."""
    want = jax.tree.leaves(jax.jit(variants["standard"])(*args))
    for name, fn in variants.items():
        got = jax.tree.leaves(jax.jit(fn)(*args))
        for g, w in zip(got, want):
            scale = float(jnp.max(jnp.abs(w))) or 1.0
            err = float(jnp.max(jnp.abs(g - w)))
            if err > rtol * scale:
                raise AssertionError(f"{name}: differs from standard by {err:.3g} (scale {scale:.3g})")


def table(row: Row) -> str:
    """Variants down, measures across: time, speed-up over standard, temp memory, flops."""
    lines = [f"**{row.case}** ({row.rounds} rounds)", "",
             "| variant | ms | vs standard | temp MiB | GFLOP | spread |", "|---|---|---|---|---|---|"]
    for v, s in row.seconds.items():
        st = row.stats[v]
        lines.append(f"| {v} | {s * 1e3:.2f} | {row.ratio(v):.2f}x | {st.temp_bytes / MiB:.1f} | "
                     f"{st.flops / 1e9:.3f} | {row.spread[v]:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=list(CASES), help=f"any of {list(CASES)}")
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--rounds", type=int, help="timing rounds (default 15, 5 with --quick)")
    ap.add_argument("--json", help="also write the rows here")
    opts = ap.parse_args(argv)
    rounds = opts.rounds or (5 if opts.quick else 15)
    rows = []
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {jax.device_count()} device(s)", flush=True)
    for name in opts.cases:
        args, fwd, grad = CASES[name]()
        for kind, variants in (("forward", fwd), ("grad", grad)):
            _agree(variants, args)
            row = measure(f"{name} {kind}", variants, args, rounds=rounds, warmup=2)
            rows.append(row)
            print(table(row) + "\n", flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump([r.as_dict() for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
