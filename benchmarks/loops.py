"""Loops as libraries write them (issue 14): readouts, ``fori_loop`` buffers, rollouts; rewritten vs standard vs by hand.

Each case is a loss over a loop, in three variants with the same arguments:
``standard`` (the library's code under ``jax.jit``), ``rewritten``
(``rewrite(loss, rulesets=[rulesets.scan])``) and ``hand-written`` (the
same loss with an accumulator in the loop's carry, written by hand), forward
and ``jax.grad``. Temp memory is from ``memory_analysis()``; times are
interleaved medians (``benchmarks/harness.py``). The cases:

* ``haiku``: ``hk.LSTM`` run by ``hk.dynamic_unroll``, an ``hk.Linear`` readout, MSE
  (T=256, batch 64, hidden 128, input 32);
* ``flax``: ``nn.RNN(nn.LSTMCell)`` and ``nn.Dense``, batch-major, MSE (same sizes);
* ``fori``: a ``fori_loop`` storing each step's hidden state in row ``i`` of a buffer, a readout and MSE after it;
* ``rollout``: gymnax CartPole, 32 environments, 200 steps, summed rewards; ``explain`` says whether
  hoisting the sum was chosen, and why not.

Run ``python -m benchmarks.loops [cases] [--rounds N] [--out benchmarks/results/loops.md]``.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

import rulesets
from benchmarks.harness import MiB, Row, measure
from rewrite import explain, rewrite

T, B, H, I = 256, 64, 128, 32
PACK = [rulesets.scan]


def _data(batch_major: bool = False) -> tuple[Any, Any]:
    k = jax.random.split(jax.random.PRNGKey(1), 2)
    shape = (B, T) if batch_major else (T, B)
    return jax.random.normal(k[0], shape + (I,)), jax.random.normal(k[1], shape + (1,))


# ---------------------------------------------------------------------- haiku
def haiku_case() -> tuple[tuple, dict[str, Callable]]:
    import haiku as hk

    def loss(xs, ys):
        core = hk.LSTM(H)
        hs, _ = hk.dynamic_unroll(core, xs, core.initial_state(B))
        return jnp.mean((hk.Linear(1)(hs) - ys) ** 2)

    def by_hand(xs, ys):  # the same modules, the loss accumulated in the carry
        core, readout = hk.LSTM(H), hk.Linear(1)

        def step(carry, inp):
            state, acc = carry
            out, state = core(inp[0], state)
            return (state, acc + jnp.sum((readout(out) - inp[1]) ** 2)), None

        (_, acc), _ = hk.scan(step, (core.initial_state(B), jnp.float32(0.0)), (xs, ys))
        return acc / ys.size

    net, hand = hk.without_apply_rng(hk.transform(loss)), hk.without_apply_rng(hk.transform(by_hand))
    xs, ys = _data()
    params = net.init(jax.random.PRNGKey(0), xs, ys)
    return (params, xs, ys), {"standard": net.apply, "rewritten": rewrite(net.apply, rulesets=PACK),
                              "hand-written": hand.apply}


# ---------------------------------------------------------------------- flax
def flax_case() -> tuple[tuple, dict[str, Callable]]:
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, xs):
            return nn.Dense(1)(nn.RNN(nn.LSTMCell(H))(xs))

    model = Model()
    xs, ys = _data(batch_major=True)
    params = model.init(jax.random.PRNGKey(0), xs)

    def loss(params, xs, ys):
        return jnp.mean((model.apply(params, xs) - ys) ** 2)

    def by_hand(params, xs, ys):
        cell, dense = nn.LSTMCell(H), nn.Dense(1)
        p = params["params"]

        def step(carry, inp):
            state, acc = carry
            state, h = cell.apply({"params": p["LSTMCell_0"]}, state, inp[0])
            return (state, acc + jnp.sum((dense.apply({"params": p["Dense_0"]}, h) - inp[1]) ** 2)), None

        zeros = jnp.zeros((B, H))
        (_, acc), _ = lax.scan(step, ((zeros, zeros), jnp.float32(0.0)),
                               (jnp.swapaxes(xs, 0, 1), jnp.swapaxes(ys, 0, 1)))
        return acc / ys.size

    return (params, xs, ys), {"standard": loss, "rewritten": rewrite(loss, rulesets=PACK), "hand-written": by_hand}


# ---------------------------------------------------------------------- fori_loop buffer
def fori_case() -> tuple[tuple, dict[str, Callable]]:
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    p = dict(W=jax.random.normal(k[0], (H, H)) / H ** 0.5, U=jax.random.normal(k[1], (I, H)) / I ** 0.5,
             V=jax.random.normal(k[2], (H, 1)) / H ** 0.5)
    xs, ys = _data()

    def loss(p, xs, ys):  # the hidden states stored row by row, read out after the loop
        def body(i, c):
            h, buf = c
            h = jnp.tanh(h @ p["W"] + xs[i] @ p["U"])
            return h, buf.at[i].set(h)

        _, hs = lax.fori_loop(0, T, body, (jnp.zeros((B, H)), jnp.zeros((T, B, H))))
        return jnp.mean((hs @ p["V"] - ys) ** 2)

    def by_hand(p, xs, ys):
        def body(i, c):
            h, acc = c
            h = jnp.tanh(h @ p["W"] + xs[i] @ p["U"])
            return h, acc + jnp.sum((h @ p["V"] - ys[i]) ** 2)

        return lax.fori_loop(0, T, body, (jnp.zeros((B, H)), jnp.float32(0.0)))[1] / ys.size

    return (p, xs, ys), {"standard": loss, "rewritten": rewrite(loss, rulesets=PACK), "hand-written": by_hand}


# ---------------------------------------------------------------------- gymnax rollout
ENVS, STEPS = 32, 200


def rollout_case() -> tuple[tuple, dict[str, Callable]]:
    import gymnax

    env, env_params = gymnax.make("CartPole-v1")

    def start(key):
        keys = jax.random.split(key, ENVS)
        return jax.vmap(env.reset, in_axes=(0, None))(keys, env_params)

    def returns(key, w):  # a linear policy's summed rewards over all environments and steps
        obs, state = start(key)

        def step(carry, k):
            obs, state = carry
            action = (obs @ w > 0).astype(jnp.int32)
            obs, state, reward, *_ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(k, ENVS), state, action, env_params)
            return (obs, state), reward

        _, rewards = lax.scan(step, (obs, state), jax.random.split(key, STEPS))
        return jnp.sum(rewards)

    def by_hand(key, w):
        obs, state = start(key)

        def step(carry, k):
            obs, state, acc = carry
            action = (obs @ w > 0).astype(jnp.int32)
            obs, state, reward, *_ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(k, ENVS), state, action, env_params)
            return (obs, state, acc + jnp.sum(reward)), None

        return lax.scan(step, (obs, state, jnp.float32(0.0)), jax.random.split(key, STEPS))[0][2]

    args = (jax.random.PRNGKey(0), jnp.array([0.1, -0.3, 1.0, 0.5]))
    return args, {"standard": returns, "rewritten": rewrite(returns, rulesets=PACK), "hand-written": by_hand}


CASES = {"haiku": haiku_case, "flax": flax_case, "fori": fori_case, "rollout": rollout_case}
#: Cases whose gradient is measured (the rollout's reward has none worth taking).
GRAD = {"haiku", "flax", "fori"}


def _agree(variants: dict[str, Callable], args: tuple, rtol: float = 2e-4) -> None:
    want = jax.tree.leaves(jax.jit(variants["standard"])(*args))
    for name, fn in variants.items():
        for g, w in zip(jax.tree.leaves(jax.jit(fn)(*args)), want):
            scale = float(jnp.max(jnp.abs(w))) or 1.0
            err = float(jnp.max(jnp.abs(g - w)))
            if err > rtol * scale:
                raise AssertionError(f"{name}: differs from standard by {err:.3g} (scale {scale:.3g})")


def table(row: Row) -> str:
    lines = [f"**{row.case}** ({row.rounds} interleaved rounds)", "",
             "| variant | ms | vs standard | temp MiB | temp vs standard |", "|---|---|---|---|---|"]
    base = row.stats[row.baseline].temp_bytes or 1
    for v, s in row.seconds.items():
        st = row.stats[v]
        lines.append(f"| {v} | {s * 1e3:.2f} | {row.ratio(v):.2f}x | {st.temp_bytes / MiB:.2f} | "
                     f"{st.temp_bytes / base:.0%} |")
    return "\n".join(lines)


def why(name: str, variants: dict[str, Callable], args: tuple) -> str:
    """What ``explain`` says about the loop rewrites of a case."""
    report = explain(variants["standard"], *args, rulesets=PACK)
    lines = [ln for ln in report.summary().splitlines() if not ln.startswith("time:")]
    return f"`explain` on {name}:\n\n```\n" + "\n".join(lines) + "\n```"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=list(CASES), help=f"any of {list(CASES)}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="write the tables (markdown) here")
    opts = ap.parse_args(argv)
    out = [f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}); "
           f"T={T}, batch {B}, hidden {H}, input {I}; rollout: {ENVS} envs, {STEPS} steps"]
    for name in opts.cases:
        args, fwd = CASES[name]()
        kinds = [("forward", fwd)]
        if name in GRAD:
            kinds.append(("jax.grad", {k: jax.grad(f) for k, f in fwd.items()}))
        for kind, variants in kinds:
            _agree(variants, args)
            row = measure(f"{name} {kind}", variants, args, rounds=opts.rounds, warmup=2)
            out.append(table(row))
            print(out[-1] + "\n", flush=True)
        out.append(why(name, fwd, args))
        print(out[-1] + "\n", flush=True)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write("# Loops as libraries write them (`python -m benchmarks.loops`)\n\n" + "\n\n".join(out) + "\n")


if __name__ == "__main__":
    main()
