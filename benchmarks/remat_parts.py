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

Two loop-body probes beside them (h-spear4): ``--bodies`` times the LM head's block kernel (``exp(z - m)`` over
``[rows, 512]`` and its row sums) as one long kernel over every block and trip by trip in a ``lax.scan``, and
``--stacked`` the docs' RNN loop with and without its stacked output; each form's cost of one trip more (its time
at 16 trips less at 4), beside the model's with ``AnalyticCost.overlap`` off and on::

    flock /tmp/bench.lock python -m benchmarks.remat_parts --bodies 64,256,512,1024,4096 --stacked 128,1024,8192

Nothing is written: the figures go to ``results/log.md`` by hand (h-spear2's and h-spear4's sections).
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


# ---------------------------------------------------------------------------------------------- loop bodies
#: A kernel of the LM head's block loop (``nn_lm_head_lse_label_*``: ``exp(z - m)`` over a ``[rows, 512]`` logit
#: block, then its row sums), run over ``trips`` blocks two ways: as one long kernel over ``[trips, rows, 512]``
#: (``whole``), and trip by trip in a ``lax.scan`` whose body holds the same kernel (``loop``). Each form's cost of
#: one block more is its time at :data:`TRIPS` ``[1]`` trips less its time at ``[0]``, over the trips between:
#: what the model prices the same way (:func:`body_prices`), with and without ``AnalyticCost.overlap``.
TRIPS = (4, 16)
WIDTH = 512


def _whole(xs: jax.Array, m: jax.Array) -> jax.Array:
    return jnp.sum(jnp.exp(xs - m[None, :, None]), axis=2)


def _loop(xs: jax.Array, m: jax.Array) -> jax.Array:
    def body(c, x):
        return c + jnp.sum(jnp.exp(x - m[:, None]), axis=1), None
    return jax.lax.scan(body, jnp.zeros(m.shape, xs.dtype), xs)[0]


BODIES: dict[str, Callable] = {"whole": _whole, "loop": _loop}


def _blocks(trips: int, rows: int) -> tuple[jax.Array, jax.Array]:
    k = jax.random.split(jax.random.key(1), 2)
    return jax.random.normal(k[0], (trips, rows, WIDTH)), jax.random.normal(k[1], (rows,))


def _carried(h0: jax.Array, xs: jax.Array) -> jax.Array:
    """``docs/api.md``'s RNN loop without its stacked output: the carry alone comes out."""
    return jax.lax.scan(lambda h, x: (jnp.tanh(h + x), None), h0, xs)[0]


def _stacked(h0: jax.Array, xs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The same loop stacking ``2 h`` at every trip, as ``docs/api.md``'s RNN does (``scan_docs_rnn_*``)."""
    return jax.lax.scan(lambda h, x: (jnp.tanh(h + x), 2.0 * h), h0, xs)


#: the docs' RNN loop with and without its stacked output (``--stacked``): what one trip's stacked slice costs
STACKED: dict[str, Callable] = {"carried": _carried, "stacked": _stacked}


def _rnn(trips: int, width: int) -> tuple[jax.Array, jax.Array]:
    return jnp.zeros(width), jax.random.normal(jax.random.key(2), (trips, width))


def body_prices(rows: int, model: Any = None, forms: dict | None = None, make: Callable = _blocks) -> dict:
    """The model's price (us) of one block more in each of ``forms`` (:data:`BODIES`) at ``[rows, 512]`` blocks
    (``make``'s arguments): the whole program's price (``rewrite.pipeline.program_cost``) at :data:`TRIPS` ``[1]``
    trips less at ``[0]``, per trip."""
    from rewrite.cost.model import AnalyticCost
    from rewrite.pipeline import program_cost

    model = AnalyticCost() if model is None else model
    (lo, hi), out = TRIPS, {}
    for name, fn in (BODIES if forms is None else forms).items():
        at = [program_cost(jax.make_jaxpr(fn)(*make(t, rows)), model) for t in (lo, hi)]
        out[name] = (at[1] - at[0]) / (hi - lo) / 1e3
    return out


def body_timed(rows: int, rounds: int, forms: dict | None = None, make: Callable = _blocks) -> tuple[dict, float]:
    """The clock's cost (us) of one block more in each of ``forms`` (:data:`BODIES`; medians over ``rounds``
    interleaved rounds of every form at both trip counts, and an A/A copy of the last form at the most trips),
    and the A/A ratio."""
    (lo, hi), forms = TRIPS, BODIES if forms is None else forms
    last = list(forms)[-1]
    runs = {}
    for name, fn in {**forms, "aa": lambda a, b: forms[last](a, b)}.items():  # (another function: compiled apart)
        for t in (lo, hi):
            args = make(t, rows)
            runs[(name, t)] = (jax.jit(fn).lower(*args).compile(), args)
    times = interleaved({k: v for k, v in runs.items() if k != ("aa", lo)}, rounds, warmup=3)
    med = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in times.items()}
    return ({n: (med[(n, hi)] - med[(n, lo)]) / (hi - lo) for n in forms}, med[(last, hi)] / med[("aa", hi)])


def bodies(rows: list[int], rounds: int, model_only: bool, stacked: bool = False) -> None:
    """Print :func:`body_prices` under the table with ``overlap`` off and on, beside :func:`body_timed`; with
    ``stacked``, of :data:`STACKED` at ``rows`` wide, else of :data:`BODIES` at ``[rows, 512]`` blocks."""
    from rewrite.cost.model import AnalyticCost

    forms, make = (STACKED, _rnn) if stacked else (BODIES, _blocks)
    for r in rows:
        off, on = (body_prices(r, AnalyticCost(overlap=o), forms, make) for o in (False, True))
        got, aa = ({}, 0.0) if model_only else body_timed(r, rounds, forms, make)
        for n in forms:
            clock = f"  measured {got[n]:8.2f} us: summed/clock {off[n] / got[n]:.2f}, overlapped/clock " \
                    f"{on[n] / got[n]:.2f}" if got else ""
            print(f"rows {r} {n:6s} per block: summed {off[n]:8.2f} us, overlapped {on[n]:8.2f} us{clock}", flush=True)
        if got and stacked:
            print(f"width {r}: a stacked slice per trip, clock {got['stacked'] - got['carried']:.3f} us, summed "
                  f"{off['stacked'] - off['carried']:.3f}, overlapped {on['stacked'] - on['carried']:.3f} "
                  f"(A/A {aa:.3f})", flush=True)
        elif got:
            print(f"rows {r}: loop/whole per block, clock {got['loop'] / got['whole']:.3f}, summed "
                  f"{off['loop'] / off['whole']:.3f}, overlapped {on['loop'] / on['whole']:.3f} (A/A {aa:.3f})",
                  flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.remat_parts", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="248,496,1024,4096", help="comma-separated rows of the [rows, 128] arrays")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--model-only", action="store_true", help="print the model's prices, time nothing")
    ap.add_argument("--bodies", default="", help="comma-separated rows of the [rows, 512] blocks of the loop-body "
                    "probe (BODIES) to time instead of the gelu's kernels")
    ap.add_argument("--stacked", default="", help="comma-separated widths of the docs' RNN loop (STACKED) to time")
    opts = ap.parse_args(argv)
    print(f"load: {os.getloadavg()[0]:.2f}", flush=True)
    if opts.bodies or opts.stacked:
        if opts.bodies:
            bodies([int(r) for r in opts.bodies.split(",")], opts.rounds, opts.model_only)
        if opts.stacked:
            bodies([int(r) for r in opts.stacked.split(",")], opts.rounds, opts.model_only, stacked=True)
        print(f"load: {os.getloadavg()[0]:.2f}", flush=True)
        return
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
