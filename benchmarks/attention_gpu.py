"""Attention on a GPU: the original, ``rulesets.attention`` (cuDNN's fused call where it applies), the
pack's blocked form, and the hand-written references, interleaved in one process.

Programs: ``jax.nn.softmax(q k^T * scale [+ causal mask]) v`` on ``[B, H, N, D]`` (``plain``), in bf16
(cuDNN's dtypes) and f32 (which cuDNN does not take: on a GPU the pack keeps the program). Variants:

* ``standard``: the program as written; ``aa``: the same again (the A/A control);
* ``rewritten``: ``rewrite(f, rulesets=[attention])`` on this backend;
* ``blocked``: the pack's blocked form (the fused call switched off, the blocked form switched on: the
  pack does not build it on a GPU, where it measured slower than XLA's own attention);
* ``dpa_cudnn``, ``dpa_xla``: ``jax.nn.dot_product_attention`` by hand, per implementation;
* ``chunked``: the hand-written online softmax of ``benchmarks/attention.py``.

Forward and ``jax.grad`` of the output's sum with respect to q, k and v. Times are medians of
interleaved rounds after warm-up (``benchmarks/harness.py``); temp memory from ``memory_analysis()``.
Rows at N=16384 are compiled, not run. Run on a GPU machine::

    python -m benchmarks.attention_gpu --rounds 5
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.attention import chunked
from benchmarks.harness import MiB, compile_stats, measure
from rewrite import explain, rewrite
from rulesets.attention import attention, attention_with


def plain(causal: bool) -> Callable:
    def f(q: Any, k: Any, v: Any) -> Any:
        s = (q @ jnp.swapaxes(k, -1, -2)).astype(jnp.float32) / np.float32(np.sqrt(q.shape[-1]))
        if causal:
            n = s.shape[-1]
            s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, jnp.finfo(jnp.float32).min)
        return jax.nn.softmax(s, axis=-1).astype(v.dtype) @ v
    return f


def dpa(impl: str, causal: bool) -> Callable:
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731 - [B, H, N, D] <-> [B, N, H, D]
    return lambda q, k, v: t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal, implementation=impl))


def blocked(f: Callable, args: list) -> Callable:
    """The pack's blocked form: rewritten (on first call) with the fused call switched off."""
    g = rewrite(f, rulesets=[attention_with(fused=None, blocked=True)])
    jax.block_until_ready(g(*args))
    return g


def grad_of(f: Callable) -> Callable:
    return jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))


def variants(causal: bool, dtype: Any, args: list, mode: str) -> dict[str, Callable]:
    f = plain(causal)
    vs: dict[str, Callable] = {"standard": f, "aa": lambda *a: f(*a), "rewritten": rewrite(f, rulesets=[attention]),
                               "blocked": blocked(f, args), "dpa_xla": dpa("xla", causal)}
    if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        vs["dpa_cudnn"] = dpa("cudnn", causal)
    if not causal:
        vs["chunked"] = chunked
    return vs if mode == "forward" else {k: grad_of(g) for k, g in vs.items()}


def run(b: int, h: int, d: int, cases: list[tuple], rounds: int) -> list[dict]:
    rows = []
    for n, dtype, causal, mode in cases:
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        args = [jax.random.normal(kk, (b, h, n, d), jnp.float32).astype(dtype) for kk in ks]
        name = f"plain {'causal ' if causal else ''}{jnp.dtype(dtype).name} {mode} N={n}"
        try:
            r = explain(plain(causal), *args, rulesets=[attention])
            chose = ",".join(sorted(r.fired)) or "nothing"
            text = jax.jit(rewrite(plain(causal), rulesets=[attention])).lower(*args).as_text().lower()
            form = "cudnn" if "cudnn" in text else ("blocked" if r.result.rewritten else "kept")
            vs = variants(causal, dtype, args, mode)
            if n >= 16384:
                temps, errors = {}, {}
                for k, fn in vs.items():  # each alone: the original may not compile where the others do
                    if k == "aa":
                        continue
                    try:
                        temps[k] = compile_stats(fn, *args)[1].temp_bytes / MiB
                    except Exception as e:  # noqa: BLE001 - reported in the row, the other variants still compile
                        errors[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                row = {"case": name, "form": form, "fired": chose, "compiled_only": True, "temp_mib": temps,
                       **({"errors": errors} if errors else {})}
            else:
                m = measure(name, vs, args, rounds=rounds)
                row = {"case": name, "form": form, "fired": chose, "compiled_only": False,
                       "ms": {k: 1e3 * x["seconds"] for k, x in m.as_dict()["variants"].items()},
                       "ratio": {k: x["ratio"] for k, x in m.as_dict()["variants"].items()},
                       "temp_mib": {k: s.temp_bytes / MiB for k, s in m.stats.items()}}
        except Exception as e:  # noqa: BLE001 - one failing case is reported, the others still run
            row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", default="4,16,64", help="B,H,D")
    ap.add_argument("--sizes", default="2048,8192")
    ap.add_argument("--f32", type=int, default=4096, help="N of the float32 rows (0: none)")
    ap.add_argument("--compiled", type=int, default=16384, help="N of the compiled-only rows (0: none)")
    a = ap.parse_args(argv)
    b, h, d = (int(x) for x in a.shape.split(","))
    print(json.dumps({"jax": jax.__version__, "devices": [str(x) for x in jax.devices()], "B,H,D": [b, h, d]}))
    cases = []
    for n in (int(x) for x in a.sizes.split(",")):
        for mode in ("forward", "grad"):
            cases += [(n, jnp.bfloat16, True, mode), (n, jnp.bfloat16, False, mode)]
    if a.f32:
        cases += [(a.f32, jnp.float32, False, "forward"), (a.f32, jnp.float32, False, "grad")]
    if a.compiled:
        cases += [(a.compiled, jnp.bfloat16, True, "forward"), (a.compiled, jnp.bfloat16, True, "grad")]
    run(b, h, d, cases, a.rounds)


if __name__ == "__main__":
    main()
