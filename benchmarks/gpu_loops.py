"""Loops on a GPU: what one trip of a loop costs there, and whether the cost model, so priced, ranks the
packs' loops against XLA's whole-array programs as they measure.

On a GPU the packs do not offer their loops by default (``rulesets.nn_lm_head.lm_head_rules(loop=)``,
``rulesets.attention.attention_with(blocked=)``): the LM head's token-block loop and attention's key-block loop
measured slower there than the programs they replace, and the model, whose loop trip was an estimate
(``AnalyticCost.iteration``, 1 us), predicted them faster. This benchmark measures the trip
(``benchmarks.calibrate.measure_loop``) and then, with the loops offered, reports for each case:

* ``chosen``: what extraction picks with the measured trip price (the program kept, or the loop);
* ``predicted``: the model's time ratio, original over loop, with the estimated trip and with the
  measured one (``memory=0``: time alone, a call's fixed cost included);
* ``measured``: the loop (the pack's form, forced by a memory budget) against the original, interleaved
  in one process after a warm-up, with an A/A control; temp memory from ``memory_analysis()``.

Run on a GPU machine (prints one JSON line per case; ``--write FILE`` stores them)::

    python -m benchmarks.gpu_loops --rounds 5
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp

import rulesets
from benchmarks import attention_gpu, calibrate, lm_head
from benchmarks.harness import MiB, measure
from rewrite import AnalyticCost, Ruleset, explain, rewrite
from rewrite.cost import calibration
from rewrite.cost.model import ITERATION_ESTIMATE, priced_with
from rulesets.attention import attention_with
from rulesets.nn_lm_head import lm_head_rules

#: attention's blocked form on every backend, and its fused call off (so its loop is the form)
BLOCKED = attention_with(fused=None, blocked=True)


def price(fn: Callable, args: list, **kw: float) -> float:
    """The model's time price of ``fn``'s program as written, a call's fixed cost included."""
    r = explain(fn, *args, rulesets=[], cost_model=AnalyticCost(memory=0.0, **kw))
    return r.cost_before + r.fixed_cost


def cases() -> list[tuple[str, Callable, Any, list, Callable]]:
    """(name, program, pack, arguments, wrap): ``wrap`` is the identity or the gradient."""
    out = []
    lm_args = lm_head.args_at(2048, 512, 32768)
    nn = Ruleset("nn", [rulesets.nn.nn_one_hot, rulesets.nn.nn_stable, lm_head_rules(loop=True)], soundness="identity")
    for mode, wrap in (("loss", lambda g: g), ("grad", lm_head.grad_of)):
        out.append((f"lm_head {mode} N=2048 C=512 V=32768 float32", lm_head.loss, nn, lm_args, wrap))
    b, h, d, n = 4, 16, 64, 4096
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    for dtype, causal, mode in ((jnp.float32, False, "forward"), (jnp.float32, False, "grad"),
                                (jnp.bfloat16, False, "forward"), (jnp.bfloat16, True, "forward")):
        args = [jax.random.normal(kk, (b, h, n, d), jnp.float32).astype(dtype) for kk in ks]
        wrap = (lambda g: g) if mode == "forward" else attention_gpu.grad_of
        name = f"attention {'causal ' if causal else ''}{jnp.dtype(dtype).name} {mode} N={n}"
        out.append((name, attention_gpu.plain(causal), BLOCKED, args, wrap))
    return out


def run_case(name: str, f: Callable, pack: Any, args: list, wrap: Callable, table: dict, rounds: int) -> dict:
    # The loop, forced: a budget far below the original's temporaries leaves only the loop.
    temp = AnalyticCost().predict_temp_bytes(jax.make_jaxpr(wrap(f))(*args))
    forced = rewrite(f, rulesets=[pack], cost_model=AnalyticCost(memory_budget=max(temp // 8, 1)), cache=False)
    # The trip at the estimate every backend had before it was measured (the GPU table now holds one).
    estimated = price(wrap(f), args, iteration=ITERATION_ESTIMATE) / price(wrap(forced), args,
                                                                           iteration=ITERATION_ESTIMATE)
    with priced_with(table):
        base_m = price(wrap(f), args)
        measured_price = base_m / price(wrap(forced), args)
        r = explain(f, *args, rulesets=[pack])
        chosen = "loop" if r.result.rewritten else "kept"
    row = {"case": name, "chosen": chosen, "predicted_estimated_trip": round(estimated, 3),
           "predicted_measured_trip": round(measured_price, 3)}
    m = measure(name, {"standard": wrap(f), "aa": wrap(lambda *a: f(*a)), "loop": wrap(forced)}, args,
                rounds=rounds)
    d = m.as_dict()["variants"]
    row.update({"ms": {k: round(1e3 * x["seconds"], 3) for k, x in d.items()},
                "ratio": {k: round(x["ratio"], 3) for k, x in d.items()},
                "temp_mib": {k: round(s.temp_bytes / MiB, 1) for k, s in m.stats.items()}})
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated indices into the case list")
    ap.add_argument("--write", default="", help="a file for the JSON lines")
    a = ap.parse_args(argv)
    backend = jax.default_backend().upper()
    table = dict(getattr(calibration, calibration.BACKENDS[jax.default_backend()]))
    loop = calibrate.measure_loop(9, False, table["launch"])
    table.update(loop)
    rows = [{"backend": backend, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
             "launch_ns": table["launch"], **{k: round(v, 1) for k, v in loop.items()}}]
    print(json.dumps(rows[0]), flush=True)
    only = {int(i) for i in a.only.split(",") if i}
    for i, case in enumerate(cases()):
        if only and i not in only:
            continue
        try:
            row = run_case(*case, table=table, rounds=a.rounds)
        except Exception as e:  # noqa: BLE001 - one failing case is reported, the others still run
            row = {"case": case[0], "error": f"{type(e).__name__}: {str(e)[:400]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.write:
        with open(a.write, "w") as fh:
            fh.write("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
