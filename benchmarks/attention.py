"""Attention as the libraries write it, against ``rulesets.attention``'s blocked form: time and temp memory.

Programs (f32, head dim 64; ``B=2, H=4``, the work of the issue's ``B=1, H=8``):

* ``plain``: ``jax.nn.softmax(q k^T / sqrt(d)) v`` on ``[B, H, N, D]`` with ``@``;
* ``flax``: ``flax.linen.dot_product_attention`` on ``[B, N, H, D]``;
* ``flax_mha``, ``haiku_mha``, ``equinox_mha``: the libraries' multi-head attention layers (with their
  projections) on ``[B, N, H*D]``, equinox's vmapped over the batch.

Each forward, and ``jax.grad`` of the output's sum (with respect to q, k, v, or the layer's input), in the
variants: ``standard`` (as written, the baseline), ``aa`` (the same again: the A/A control),
``rewritten`` (``rewrite(f, rulesets=[attention])``, and its gradient), ``chunked`` (a hand-written
online softmax over key blocks of 512 in a ``lax.scan``, body under ``jax.checkpoint``: the issue's
reference) and ``dpa_xla`` (``jax.nn.dot_product_attention(implementation="xla")``), the last two for the
programs over q, k, v. Times are medians of interleaved rounds after warm-up (``benchmarks/harness.py``);
temp memory from ``memory_analysis()``. At N=16384 the programs are compiled, not run. ``--blocks``
times each candidate key block (128 to 1024, over every query and over query blocks of 512) forced alone,
beside the pack's choice.

Run holding the benchmark lock::

    flock /tmp/bench.lock python -m benchmarks.attention --write
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import harness
from benchmarks.harness import MiB, Row, compile_stats, measure, write_results
from rewrite import explain, rewrite
from rulesets.attention import BLOCKS, SCORES_BAND, attention, attention_with

B, H, D = 2, 4, 64
RESULTS = Path(__file__).parent / "results"


# ---------------------------------------------------------------------- programs
def plain(q: Any, k: Any, v: Any) -> Any:
    return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]).astype(np.float32), axis=-1) @ v


def flax_dpa(q: Any, k: Any, v: Any) -> Any:
    import flax.linen as nn

    return nn.dot_product_attention(q, k, v)


def chunked(q: Any, k: Any, v: Any, block: int = 512) -> Any:
    """The issue's hand-written reference on ``[B, H, N, D]``: online softmax over key blocks."""
    n = k.shape[-2]
    block = min(block, n)
    kb = k.reshape(*k.shape[:-2], n // block, block, k.shape[-1])
    vb = v.reshape(*v.shape[:-2], n // block, block, v.shape[-1])
    q = q / np.sqrt(q.shape[-1]).astype(np.float32)

    @jax.checkpoint
    def body(carry, j):
        m, l, acc = carry
        kj, vj = kb[..., j, :, :], vb[..., j, :, :]
        s = q @ jnp.swapaxes(kj, -1, -2)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        a = jnp.exp(m - m_new)
        return (m_new, l * a + p.sum(-1), acc * a[..., None] + p @ vj), None

    m0 = jnp.full(q.shape[:-1], -jnp.inf, q.dtype)
    (m, l, acc), _ = lax.scan(body, (m0, jnp.zeros_like(m0), jnp.zeros_like(q)), jnp.arange(n // block))
    return acc / l[..., None]


def dpa_xla_bhnd(q: Any, k: Any, v: Any) -> Any:
    t = lambda x: jnp.swapaxes(x, 1, 2)
    return t(jax.nn.dot_product_attention(t(q), t(k), t(v), implementation="xla"))


def chunked_bnhd(q: Any, k: Any, v: Any) -> Any:
    t = lambda x: jnp.swapaxes(x, 1, 2)
    return t(chunked(t(q), t(k), t(v)))


def layers(n: int) -> dict[str, tuple[Callable, Any]]:
    """The libraries' attention layers at sequence length ``n``: name -> (fn of x, x)."""
    import equinox as eqx
    import flax.linen as nn
    import haiku as hk

    e = H * D
    x = jax.random.normal(jax.random.PRNGKey(0), (B, n, e), jnp.float32)
    fm = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=e)
    fp = fm.init(jax.random.PRNGKey(1), x[:, :8])
    hm = hk.without_apply_rng(hk.transform(
        lambda x: hk.MultiHeadAttention(num_heads=H, key_size=D, w_init=hk.initializers.VarianceScaling(1.0))(x, x, x)))
    hp = hm.init(jax.random.PRNGKey(2), x[:, :8])
    em = eqx.nn.MultiheadAttention(num_heads=H, query_size=e, key=jax.random.PRNGKey(3))

    def flax_mha(x):
        return fm.apply(fp, x)

    def haiku_mha(x):
        return hm.apply(hp, x)

    def equinox_mha(x):
        return jax.vmap(lambda t: em(t, t, t))(x)

    return {"flax_mha": (flax_mha, x), "haiku_mha": (haiku_mha, x), "equinox_mha": (equinox_mha, x)}


def grad_of(f: Callable, argnums: tuple) -> Callable:
    return jax.grad(lambda *a: jnp.sum(f(*a)), argnums=argnums)


def _again(f: Callable) -> Callable:
    return lambda *a: f(*a)


def variants(name: str, f: Callable, mode: str, qkv: bool, pack: Any = None) -> dict[str, Callable]:
    argnums = (0, 1, 2) if qkv else (0,)
    wrap = (lambda g: g) if mode == "forward" else (lambda g: grad_of(g, argnums))
    out = {"standard": wrap(f), "aa": wrap(_again(f)), "rewritten": wrap(rewrite(f, rulesets=[pack or attention]))}
    if qkv:
        out["chunked"] = wrap(chunked if name == "plain" else chunked_bnhd)
        out["dpa_xla"] = wrap(dpa_xla_bhnd if name == "plain" else _dpa_bnhd)
    return out


def _dpa_bnhd(q: Any, k: Any, v: Any) -> Any:
    return jax.nn.dot_product_attention(q, k, v, implementation="xla")


def qkv_args(name: str, n: int) -> list:
    shape = (B, H, n, D) if name == "plain" else (B, n, H, D)
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    return [jax.random.normal(kk, shape, jnp.float32) for kk in ks]


def blocks_chosen(f: Callable, args: list, pack: Any = None) -> str:
    fired = explain(f, *args, rulesets=[pack or attention]).result
    after = explain(f, *args, rulesets=[pack or attention]).after
    for e in after.eqns:
        if e.primitive.name == "custom_vjp_call":
            inner = e.params.get("call_jaxpr") or e.params.get("fun_jaxpr")
            for x in inner.jaxpr.eqns if inner is not None else ():
                if x.primitive.name == "scan":
                    keys = [y for y in x.params["jaxpr"].jaxpr.eqns if y.primitive.name == "scan"]
                    if keys:  # a loop over query blocks around the loop over key blocks
                        return f"{x.params['length']} x {keys[0].params['length']} blocks"
                    return f"{x.params['length']} blocks"
    return "kept" if not fired.rewritten else "?"


def forced_block(f: Callable, args: list, block: int, mode: str, argnums: tuple,
                 query_block: int | None = None) -> Callable:
    """``f`` rewritten with the key block ``block`` alone offered, over every query at once (``query_block``
    ``None``) or over blocks of ``query_block`` queries only."""
    pack = attention_with(blocks=(block,), query_blocks=() if query_block is None else (query_block,),
                          whole_queries=query_block is None)
    g = rewrite(f, rulesets=[pack], cache=False)
    wrapped = g if mode == "forward" else grad_of(g, argnums)
    jax.block_until_ready(jax.jit(wrapped)(*args))
    return wrapped


#: The key blocks ``--blocks`` forces, each alone, over every query and over blocks of ``QUERY_BLOCK`` queries
#: (the pack offers 256 alone: ``attention_with``'s default, with the query blocks of 512 beside the whole).
CANDIDATE_BLOCKS = (128, 256, 512, 1024)
QUERY_BLOCK = 512


def run_blocks(cases: list[tuple[str, str, int, tuple]], rounds: int, pack: Any = None) -> list[str]:
    """Each of ``CANDIDATE_BLOCKS`` that makes two blocks or more, forced alone over every query (``b``) and over
    query blocks (``b/q``), beside the pack's choice: one process, interleaved rounds after warm-up, the fastest
    round of each (the machine is shared: its medians move by more than the blocks differ), as a ratio over the
    fastest forced variant (1.00: the best; the A/A is the 256-key program twice). ``cases``: (program, mode,
    keys, shape); ``pack``: the attention pack whose choice is timed beside them (the default pack where None)."""
    names = [f"{b}{q}" for b in CANDIDATE_BLOCKS for q in ("", f"/q{QUERY_BLOCK}")]
    lines = ["| case | shape | A/A (256 keys twice) | chosen | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for name, mode, n, shape in cases:
        f = plain if name == "plain" else flax_dpa
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        args = [jax.random.normal(kk, shape, jnp.float32) for kk in ks]
        vs = {k: v for k, v in variants(name, f, mode, True, pack).items() if k in ("standard", "rewritten")}
        for b in CANDIDATE_BLOCKS:
            for qb in (None, QUERY_BLOCK):
                if n % b == 0 and n // b >= 2 and (qb is None or n // qb >= 2):
                    vs[f"{b}" + ("" if qb is None else f"/q{qb}")] = forced_block(f, args, b, mode, (0, 1, 2), qb)
        if "256" in vs:
            vs["256 again"] = _again(vs["256"])
        chosen = blocks_chosen(f, args, pack)
        row = measure(f"{name} {mode} N={n}", vs, args, rounds=rounds)
        fast = {k: min(t) for k, t in row.samples.items()}
        best = min(t for k, t in fast.items() if k in names)
        cells = " | ".join(f"{fast[k] / best:.2f}" if k in fast else "-" for k in names)
        aa = f"{fast['256 again'] / fast['256']:.2f}" if "256" in fast else "-"
        lines.append(f"| {name} {mode} N={n} | {list(shape)} | {aa} | {chosen} ({fast['rewritten'] / best:.2f}) "
                     f"| {cells} |")
        print(lines[-1], flush=True)
    return lines


# ---------------------------------------------------------------------- runs
def run(cases: list[tuple[str, str, int]], rounds: int) -> list[dict]:
    out = []
    for name, mode, n in cases:
        if name in ("plain", "flax"):
            f = plain if name == "plain" else flax_dpa
            args = qkv_args(name, n)
            vs = variants(name, f, mode, True)
        else:
            f, x = layers(n)[name]
            args = [x]
            vs = variants(name, f, mode, False)
        chosen = blocks_chosen(f, args)
        if n >= 16384:  # compiled, not run
            stats = {v: compile_stats(fn, *args)[1] for v, fn in vs.items() if v not in ("aa",)}
            out.append({"case": f"{name} {mode} N={n}", "chosen": chosen, "compiled_only": True,
                        "temp_mib": {v: s.temp_bytes / MiB for v, s in stats.items()}})
        else:
            row: Row = measure(f"{name} {mode} N={n}", vs, args, rounds=rounds)
            out.append({"case": row.case, "chosen": chosen, "compiled_only": False, **row.as_dict(),
                        "temp_mib": {v: s.temp_bytes / MiB for v, s in row.stats.items()}})
        print(_line(out[-1]), flush=True)
    return out


def _line(r: dict) -> str:
    temp = r["temp_mib"]
    base = temp.get("standard", 0.0)
    share = (f"{100 * temp['rewritten'] / base:.1f}%" if base else "n/a (0 B)")
    if r["compiled_only"]:
        return (f"| {r['case']} | {r['chosen']} | compiled only | | | "
                f"{base:.1f} -> {temp['rewritten']:.1f} ({share}) | "
                + " | ".join(f"{v} {t:.1f}" for v, t in temp.items() if v not in ("standard", "rewritten")) + " |")
    v = r["variants"]
    ratios = " ".join(f"{k} {x['ratio']:.2f}x" for k, x in v.items() if k not in ("standard", "rewritten", "aa"))
    return (f"| {r['case']} | {r['chosen']} | {1e3 * v['standard']['seconds']:.1f} | "
            f"{v['rewritten']['ratio']:.2f}x | {v['aa']['ratio']:.2f}x | {base:.1f} -> {temp['rewritten']:.1f} "
            f"({share}) | {ratios} |")


HEADER = ("| case | rewrite chose | standard ms | rewritten | A/A | temp MiB standard -> rewritten | others (ratio) |\n"
          "|---|---|---|---|---|---|---|")

FULL = ([("plain", "forward", n) for n in (256, 1024, 2048, 4096)]
        + [("plain", "grad", n) for n in (256, 2048)]
        + [(p, m, 2048) for p in ("flax", "flax_mha", "haiku_mha", "equinox_mha") for m in ("forward", "grad")]
        + [(p, "forward", 256) for p in ("flax_mha", "haiku_mha", "equinox_mha")]
        + [(p, m, 16384) for p in ("plain", "flax") for m in ("forward", "grad")])


def _peak_reset() -> Callable[[], float] | None:
    """``harness.peak_rss_since`` in MiB: the growth of this process's peak resident memory from now (None: the
    kernel does not allow the reset)."""
    since = harness.peak_rss_since()
    return None if since is None else (lambda: since() / MiB)


def rss(name: str, mode: str, variant: str, n: int) -> None:
    """One variant run once in this (fresh) process: print its peak resident memory's growth, in MiB.

    ``memory_analysis()`` does not count the scratch of XLA:CPU's library (YNN) fusions, which hold plain
    attention's N x N scores; the process's peak resident memory does (it also counts the output). The peak is
    reset after compiling (compiling can peak higher than the call); where it cannot be, the growth over the
    peak so far is printed, a lower bound."""
    import resource

    args = qkv_args(name, n)
    f = variants(name, plain if name == "plain" else flax_dpa, mode, True)[variant]
    c = jax.jit(f).lower(*args).compile()
    jax.block_until_ready(args)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    since = _peak_reset()
    jax.block_until_ready(c(*args))
    grown = since() if since is not None else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(json.dumps({"case": f"{name} {mode} N={n}", "variant": variant, "rss_growth_mib": grown,
                      "temp_mib": c.memory_analysis().temp_size_in_bytes / MiB}))


def rss_table(write: bool) -> None:
    import subprocess
    import sys

    lines = ["# Attention: peak resident memory of one call, in a fresh process\n",
             "`python -m benchmarks.attention --rss`. `memory_analysis()` does not see the scratch of XLA:CPU's "
             "library (YNN) fusions, which hold plain attention's N x N scores in the forward pass: the growth of "
             "the process's peak resident memory over one call does (reset after compiling; it also counts the output, "
             f"{B * 2048 * H * D * 4 / MiB:.0f} MiB at N=2048). The growth can read below the scratch where the "
             "allocator reuses pages already resident (the rewritten plain program's); the larger of the two columns "
             "is the lower bound to quote.\n",
             "| case | variant | peak RSS growth MiB | memory_analysis temp MiB |", "|---|---|---|---|"]
    for name in ("plain", "flax"):
        for n in (2048, 4096):
            for variant in ("standard", "rewritten", "chunked", "dpa_xla"):
                out = subprocess.run([sys.executable, "-m", "benchmarks.attention", "--rss-one",
                                      f"{name},forward,{variant},{n}"], capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                lines.append(f"| {r['case']} | {variant} | {r['rss_growth_mib']:.1f} | {r['temp_mib']:.1f} |")
                print(lines[-1], flush=True)
    if write:
        (RESULTS / "attention_rss.md").write_text("\n".join(lines) + "\n")


def run_step(rounds: int) -> str:
    """The ecosystem suite's long-context training step (``flax_long_context_step``): ``ecosystem.step_table``
    with ``rulesets.attention`` as the loss's pack."""
    from benchmarks import ecosystem

    return ecosystem.step_table("flax_long_context_step", ecosystem.flax_long_context_loss()[0], "attention", rounds)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated case names (plain, flax, flax_mha, ...)")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--rss", action="store_true", help="peak resident memory of each forward, one process each")
    ap.add_argument("--rss-one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--step", action="store_true", help="the ecosystem suite's long-context training step (printed)")
    ap.add_argument("--blocks", action="store_true",
                    help="each candidate key block forced alone beside the model's choice (printed)")
    ap.add_argument("--band", action="store_true", help="with --blocks: the model's choice offered BLOCKS within "
                    "SCORES_BAND (attention_with(blocks=BLOCKS, scores_band=SCORES_BAND)), not the default pack's")
    a = ap.parse_args(argv)
    if a.blocks:
        cases = [("plain", "forward", 2048, (B, H, 2048, D)), ("plain", "forward", 4096, (1, 1, 4096, D)),
                 ("plain", "forward", 2048, (1, 1, 2048, D)), ("flax", "forward", 2048, (B, 2048, H, D)),
                 ("plain", "grad", 2048, (B, H, 2048, D)), ("plain", "grad", 4096, (1, 1, 4096, D))]
        pack = attention_with(blocks=BLOCKS, scores_band=SCORES_BAND) if a.band else None
        return print("\n".join(run_blocks([c for c in cases if not a.only or c[0] in a.only.split(",")], a.rounds,
                                          pack)))
    if a.step:
        return print(run_step(a.rounds), flush=True)
    if a.rss_one:
        name, mode, variant, n = a.rss_one.split(",")
        return rss(name, mode, variant, int(n))
    if a.rss:
        return rss_table(a.write)
    cases = [c for c in FULL if not a.only or c[0] in a.only.split(",")]
    print(HEADER)
    rows = run(cases, a.rounds)
    if a.write:
        write_results(RESULTS, "attention", "Attention: `rulesets.attention` against the original", f"B={B}, H={H}, "
                      f"D={D}, f32. Ratios are time(standard) / time(variant) over per-round medians (above 1: "
                      "faster). `aa` is the standard program again (the A/A noise control).", a.rounds, HEADER,
                      [_line(r) for r in rows], rows)


if __name__ == "__main__":
    main()
