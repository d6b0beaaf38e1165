"""Eager calls of ``rewrite(jax.jit(f))``: the rewritten program runs under ``jit`` as ``f`` did.

The trace of a jitted function is one ``jit`` equation, which the rewriter
sees through; the rewritten program is then run compiled (``Rewritten._compiled``)
rather than one operation at a time. This times one eager call of each, in
interleaved rounds in one process: ``jax.jit(f)`` itself, two separately made
``rewrite(jax.jit(f))`` (an A/A pair: their gap is the noise), the same with
``eqx.filter_jit``, and ``eval_jaxpr`` of the rewritten program, which is
what an eager call ran before.

Run: ``python -m benchmarks.inner_jit [--rounds 15]``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import rulesets
from benchmarks.programs import transformer_step
from rewrite import rewrite
from rewrite.ir.jaxapi import core

PACKS = [rulesets.algebra, rulesets.derivatives]


def mlp(x, w):
    for _ in range(20):
        x = jnp.tanh(x @ w) * 2 + jnp.sin(x) * jnp.cos(x)
    return jnp.sum(x ** 2)


def programs():
    for n in (32, 256):
        yield f"20-layer elementwise/matmul chain, {n}x{n}", mlp, (jnp.ones((n, n)), jnp.eye(n) * 0.1)
    fn, args = transformer_step(2)
    yield "transformer training step, 2 layers", fn, args


def _time(fn, args, inner):
    t = time.perf_counter()
    for _ in range(inner):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / inner


def measure(fn, args, rounds):
    a, b = rewrite(jax.jit(fn), rulesets=PACKS), rewrite(jax.jit(fn), rulesets=PACKS)
    closed = a.jaxpr(*args)
    flat = jax.tree.leaves(args)
    calls = {
        "jit(f)": jax.jit(fn),
        "rewrite(jit(f)) A": a,
        "rewrite(jit(f)) B": b,
        "rewrite(filter_jit(f))": rewrite(eqx.filter_jit(fn), rulesets=PACKS),
        "eval_jaxpr (before)": lambda *_: core.eval_jaxpr(closed.jaxpr, closed.consts, *flat),
    }
    for c in calls.values():
        jax.block_until_ready(c(*args))
    inner = {k: max(1, int(0.02 / max(_time(c, args, 1), 1e-6))) for k, c in calls.items()}
    samples = {k: [] for k in calls}
    for _ in range(rounds):
        for k, c in calls.items():
            samples[k].append(_time(c, args, inner[k]))
    return {k: statistics.median(s) for k, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    rounds = parser.parse_args().rounds
    names = None
    for label, fn, args in programs():
        med = measure(fn, args, rounds)
        if names is None:
            names = list(med)
            print("| program | " + " | ".join(f"{n} us (x of jit(f))" for n in names) + " |")
            print("|---" * (len(names) + 1) + "|")
        base = med["jit(f)"]
        print(f"| {label} | " + " | ".join(f"{med[n] * 1e6:,.1f} ({base / med[n]:.2f}x)" for n in names) + " |")


if __name__ == "__main__":
    main()
