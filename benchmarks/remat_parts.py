"""The remat'd gelu's kernels against the stored one's, each alone: what ``nn_remat_gelu_tanh_f32`` changes in a step.

The rule replaces a gelu's backward that reads the forward's stored ``tanh`` with one that recomputes it from the
pre-activation (``rulesets/nn.py``). In ``flax_transformer_step`` (its MLP ``[8, 31, 64] -> 128 -> 64``) the kept
program runs three loop kernels per block where the rewrite runs two:

- kept: ``tanh`` (``z + b -> t``, stored), the forward's ``gelu`` from ``t``, the backward from ``(z, b, t, da)``;
- remat: the forward's ``gelu`` with its ``tanh``, the backward from ``(z, b, da)`` with its ``tanh`` again.

Each kernel is compiled alone at ``[rows, 128]`` and timed interleaved with the others (the fastest of ``--rounds``
medians, an A/A copy of the ``tanh`` kernel as the control), beside the cost model's price of the same kernel under
the table in force (``AnalyticCost().fusion_model()``), and whether XLA:CPU split it across the cores (its compiled
program's ``outer_dimension_partitions``; the model's ``loop_parallel_at`` is 64K elements)::

    flock /tmp/bench.lock python -m benchmarks.remat_parts --rows 248,496,1024,4096 --rounds 21
    python -m benchmarks.remat_parts --model-only        # the prices alone, nothing timed

Nothing is written: the figures go to ``results/log.md`` by hand (h-spear2's section).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from benchmarks.harness import interleaved

C0, C1 = 0.7978845834732056, 0.044714998453855515  # gelu's sqrt(2/pi) and its cubic's coefficient


def _tanh(h: jax.Array) -> jax.Array:
    return jnp.tanh(C0 * (h + C1 * h * h * h))


def _back(h: jax.Array, t: jax.Array, da: jax.Array) -> jax.Array:
    """gelu'(h) da, given t = tanh(sqrt(2/pi) (h + c h^3))."""
    return da * 0.5 * (1 + t) + da * 0.5 * h * (1 - t) * (1 + t) * C0 * (1 + 3 * C1 * h * h)


#: kernel -> (function, argument names), each one loop kernel once compiled; the kept form's three, then the remat's two
KERNELS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "tanh": (lambda z, b: _tanh(z + b), ("z", "b")),
    "fwd_from_t": (lambda z, b, t: 0.5 * (z + b) * (1 + t), ("z", "b", "t")),
    "back_from_t": (lambda z, b, t, da: _back(z + b, t, da), ("z", "b", "t", "da")),
    "fwd_recompute": (lambda z, b: 0.5 * (z + b) * (1 + _tanh(z + b)), ("z", "b")),
    "back_recompute": (lambda z, b, da: _back(z + b, _tanh(z + b), da), ("z", "b", "da")),
}
KEPT, REMAT = ("tanh", "fwd_from_t", "back_from_t"), ("fwd_recompute", "back_recompute")


def _arrays(rows: int) -> dict[str, jax.Array]:
    k = jax.random.split(jax.random.key(0), 3)
    z, da = jax.random.normal(k[0], (rows, 128)), jax.random.normal(k[1], (rows, 128))
    b = jax.random.normal(k[2], (128,))
    return {"z": z, "b": b, "da": da, "t": _tanh(z + b)}


def split(text: str) -> bool:
    """Whether XLA:CPU split a loop fusion of this compiled program across the cores."""
    return any("outer_dimension_partitions" in line and " fusion(" in line for line in text.splitlines())


def prices(rows: int, model: Any = None) -> dict[str, float]:
    """The cost model's price (us) of each of :data:`KERNELS` at ``[rows, 128]``, its fusion model's kernels summed."""
    from rewrite.cost.model import AnalyticCost
    from rewrite.cost.program import Program

    model = AnalyticCost() if model is None else model
    fusion, arrays = model.fusion_model(), _arrays(rows)
    out = {}
    for name, (fn, names) in KERNELS.items():
        prog = Program.from_jaxpr(jax.make_jaxpr(fn)(*(arrays[n] for n in names)), model)
        out[name] = sum(k.cost for k in fusion.kernels(prog)) / 1e3
    return out


def timed(rows: int, rounds: int) -> tuple[dict[str, float], dict[str, bool]]:
    """Each kernel's median time (us) over ``rounds`` interleaved rounds, the A/A control's as ``tanh_aa``, and
    whether XLA:CPU split it."""
    arrays = _arrays(rows)
    fns = {**{n: (f, names) for n, (f, names) in KERNELS.items()},
           "tanh_aa": (lambda z, b: _tanh(z + b) * 1.0, ("z", "b"))}
    args = {n: tuple(arrays[a] for a in names) for n, (_, names) in fns.items()}
    comp = {n: jax.jit(f).lower(*args[n]).compile() for n, (f, _) in fns.items()}
    times = interleaved({n: (c, args[n]) for n, c in comp.items()}, rounds, warmup=3)
    return ({n: sorted(v)[len(v) // 2] * 1e6 for n, v in times.items()},
            {n: split(c.as_text()) for n, c in comp.items()})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.remat_parts", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="248,496,1024,4096", help="comma-separated rows of the [rows, 128] arrays")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--model-only", action="store_true", help="print the model's prices, time nothing")
    opts = ap.parse_args(argv)
    print(f"load: {os.getloadavg()[0]:.2f}", flush=True)
    for rows in (int(r) for r in opts.rows.split(",")):
        price = prices(rows)
        got, parts = ({}, {}) if opts.model_only else timed(rows, opts.rounds)
        for n in KERNELS:
            clock = (f"measured {got[n]:8.2f} us (split {int(parts[n])}), model/clock {price[n] / got[n]:.2f}"
                     if got else "")
            print(f"rows {rows} {n:15s} model {price[n]:8.2f} us  {clock}", flush=True)
        kept, remat = sum(price[n] for n in KEPT), sum(price[n] for n in REMAT)
        line = f"rows {rows}: kept/remat model {kept / remat:.3f}"
        if got:
            line += (f", measured {sum(got[n] for n in KEPT) / sum(got[n] for n in REMAT):.3f} "
                     f"(A/A {got['tanh'] / got['tanh_aa']:.3f})")
        print(line, flush=True)
    print(f"load: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
