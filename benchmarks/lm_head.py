"""A language-model head's cross-entropy, against ``rulesets.nn``'s token-block form: time and temp memory.

The program is ``optax.softmax_cross_entropy_with_integer_labels(h @ W, y).mean()`` (f32), at N tokens,
width C and vocabulary V; each case times the loss or ``jax.grad`` of it with respect to ``W`` and ``h``, in
the variants ``standard`` (as written, the baseline), ``aa`` (the same again: the A/A control),
``rewritten`` (``rewrite(f, rulesets=[rulesets.nn])``, and its gradient) and ``chunked`` (the issue's
hand-written reference: a ``lax.scan`` over blocks of 256 tokens, the body under ``jax.checkpoint``).
Times are medians of interleaved rounds after warm-up (``benchmarks/harness.py``); temp memory from
``memory_analysis()``. The large case (N=8192, C=1024, V=65536) is compiled, not run. ``--step`` times the
ecosystem suite's language-model training step instead (``flax_lm_step``): as written, rewritten whole, and
with its loss rewritten before differentiation. ``--target`` times a cross-entropy against a dense target
passed in (a teacher's probabilities; labels smoothed outside the loss are the same program),
``optax.softmax_cross_entropy(h @ W + b, t).mean()``: the loss, its gradient with respect to W, b and h
(``jax.grad(rewrite(loss))``), and an SGD step with ``jax.value_and_grad`` inside, as written
(``standard``), rewritten whole (``rewritten``) and with its loss rewritten first (``loss_first``).

Run holding the benchmark lock::

    flock /tmp/bench.lock python -m benchmarks.lm_head --write
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

import rulesets
from benchmarks.harness import MiB, compile_stats, measure, write_results
from rewrite import explain, rewrite

RESULTS = Path(__file__).parent / "results"


def loss(h: Any, w: Any, y: Any) -> Any:
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean()


def chunked(h: Any, w: Any, y: Any, block: int = 256) -> Any:
    """The issue's hand-written reference: token blocks in a scan, the body checkpointed."""
    n = h.shape[0]

    @jax.checkpoint
    def body(total: Any, xs: Any) -> tuple:
        hb, yb = xs
        z = hb @ w
        lse = jax.nn.logsumexp(z, axis=-1)
        return total + jnp.sum(lse - jnp.take_along_axis(z, yb[:, None], axis=-1)[:, 0]), None

    total, _ = lax.scan(body, jnp.zeros((), h.dtype),
                        (h.reshape(n // block, block, -1), y.reshape(n // block, block)))
    return total / n


def grad_of(f: Callable) -> Callable:
    return jax.grad(f, argnums=(0, 1))


def _again(f: Callable) -> Callable:
    return lambda *a: f(*a)


def variants(mode: str) -> dict[str, Callable]:
    wrap = (lambda g: g) if mode == "loss" else grad_of
    return {"standard": wrap(loss), "aa": wrap(_again(loss)), "rewritten": wrap(rewrite(loss, rulesets=[rulesets.nn])),
            "chunked": wrap(chunked)}


def args_at(n: int, c: int, v: int) -> list:
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return [jax.random.normal(k[0], (n, c), jnp.float32), jax.random.normal(k[1], (c, v), jnp.float32) / c ** 0.5,
            jax.random.randint(k[2], (n,), 0, v)]


def chosen(n: int, c: int, v: int) -> str:
    """What the rewrite chose: the loop's token block (the backward's; the forward computes by vocabulary
    tiles), from the ``nn_lm_head_lse_*`` rule it uses, or ``kept``."""
    args = [jnp.zeros((n, c), jnp.float32), jnp.zeros((c, v), jnp.float32), jnp.zeros((n,), jnp.int32)]
    r = explain(loss, *args, rulesets=[rulesets.nn])
    used = sorted(k for k in r.used if k.startswith("nn_lm_head_lse"))
    return f"{n // int(used[0].rsplit('_', 1)[1])} blocks" if used else "kept"


def run(cases: list[tuple[str, int, int, int, bool]], rounds: int) -> list[dict]:
    out = []
    for mode, n, c, v, compiled_only in cases:
        vs = variants(mode)
        case = f"{mode} N={n} C={c} V={v}"
        how = chosen(n, c, v)
        if compiled_only:
            args = [jax.ShapeDtypeStruct((n, c), jnp.float32), jax.ShapeDtypeStruct((c, v), jnp.float32),
                    jax.ShapeDtypeStruct((n,), jnp.int32)]
            stats = {k: compile_stats(fn, *args)[1] for k, fn in vs.items() if k != "aa"}
            out.append({"case": case, "chosen": how, "compiled_only": True,
                        "temp_mib": {k: s.temp_bytes / MiB for k, s in stats.items()}})
        else:
            row = measure(case, vs, args_at(n, c, v), rounds=rounds)
            out.append({"case": case, "chosen": how, "compiled_only": False, **row.as_dict(),
                        "temp_mib": {k: s.temp_bytes / MiB for k, s in row.stats.items()}})
        print(_line(out[-1]), flush=True)
    return out


def _line(r: dict) -> str:
    temp = r["temp_mib"]
    base = temp["standard"]
    share = f"{100 * temp['rewritten'] / base:.1f}%" if base else "n/a"
    ch = f"chunked {temp['chunked']:.1f}"
    if r["compiled_only"]:
        return f"| {r['case']} | {r['chosen']} | compiled only | | | | {base:.1f} -> {temp['rewritten']:.1f} ({share}) | {ch} |"
    v = r["variants"]
    return (f"| {r['case']} | {r['chosen']} | {1e3 * v['standard']['seconds']:.1f} | {v['rewritten']['ratio']:.2f}x | "
            f"{v['chunked']['ratio']:.2f}x | {v['aa']['ratio']:.2f}x | {base:.1f} -> {temp['rewritten']:.1f} ({share}) | "
            f"{ch} |")


HEADER = ("| case | rewrite chose | standard ms | rewritten | chunked | A/A | temp MiB standard -> rewritten | "
          "chunked temp MiB |\n|---|---|---|---|---|---|---|---|")

def dense_loss(h: Any, w: Any, b: Any, t: Any) -> Any:
    import optax

    return optax.softmax_cross_entropy(h @ w + b, t).mean()


def dense_args(n: int, c: int, v: int) -> list:
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    teacher = jax.nn.softmax(3 * jax.random.normal(k[3], (n, v), jnp.float32), axis=-1)
    return [jax.random.normal(k[0], (n, c), jnp.float32), jax.random.normal(k[1], (c, v), jnp.float32) / c ** 0.5,
            0.1 * jax.random.normal(k[2], (v,), jnp.float32), teacher]


def dense_step(loss_fn: Callable) -> Callable:
    """An SGD step on ``W`` and ``b``, the gradient taken inside as training code writes it."""
    def step(h: Any, w: Any, b: Any, t: Any) -> tuple:
        value, (gw, gb) = jax.value_and_grad(lambda w, b: loss_fn(h, w, b, t), argnums=(0, 1))(w, b)
        return value, w - 0.1 * gw, b - 0.1 * gb

    return step


def dense_variants(mode: str) -> dict[str, Callable]:
    packs = [rulesets.nn]
    if mode == "step":
        return {"standard": dense_step(dense_loss), "aa": dense_step(_again(dense_loss)),
                "rewritten": rewrite(dense_step(dense_loss), rulesets=packs),
                "loss_first": dense_step(rewrite(dense_loss, rulesets=packs))}
    wrap = (lambda g: g) if mode == "loss" else (lambda f: jax.grad(f, argnums=(0, 1, 2)))
    return {"standard": wrap(dense_loss), "aa": wrap(_again(dense_loss)),
            "rewritten": wrap(rewrite(dense_loss, rulesets=packs))}


def run_dense(n: int, c: int, v: int, rounds: int) -> list[str]:
    lines = []
    for mode in ("loss", "grad", "step"):
        row = measure(f"target {mode} N={n} C={c} V={v}", dense_variants(mode), dense_args(n, c, v), rounds=rounds)
        temp = {k: s.temp_bytes / MiB for k, s in row.stats.items()}
        ratios = " | ".join(f"{row.ratio(k):.2f}x" for k in row.spread if k != "standard")
        shares = ", ".join(f"{k} {temp[k]:.1f} ({100 * temp[k] / temp['standard']:.1f}%)"
                           for k in temp if k not in ("standard", "aa"))
        lines.append(f"| {row.case} | {1e3 * row.seconds['standard']:.1f} | "
                     f"{', '.join(k for k in row.spread if k != 'standard')}: {ratios} | {temp['standard']:.1f} -> {shares} |")
        print(lines[-1], flush=True)
    return lines


FULL = [("loss", 2048, 512, 32768, False), ("grad", 2048, 512, 32768, False),
        ("loss", 2048, 512, 256, False), ("grad", 2048, 512, 256, False),
        ("loss", 8192, 1024, 65536, True), ("grad", 8192, 1024, 65536, True)]


def run_step(rounds: int) -> str:
    """The ecosystem suite's language-model training step (``flax_lm_step``): ``ecosystem.step_table`` with
    ``rulesets.nn`` as the loss's pack (rewritten whole, the head is kept: differentiated first)."""
    from benchmarks import ecosystem

    return ecosystem.step_table("flax_lm_step", ecosystem.flax_lm_loss()[0], "nn", rounds)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated indices into the case list")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--step", action="store_true", help="the ecosystem suite's LM training step instead (printed)")
    ap.add_argument("--target", default="", help="N,C,V: a dense target's cross-entropy instead (printed)")
    a = ap.parse_args(argv)
    if a.step:
        print(run_step(a.rounds), flush=True)
        return
    if a.target:
        print("| case | standard ms | variants: time ratios | temp MiB standard -> variants |\n|---|---|---|---|")
        run_dense(*(int(x) for x in a.target.split(",")), a.rounds)
        return
    cases = [c for i, c in enumerate(FULL) if not a.only or str(i) in a.only.split(",")]
    print(HEADER)
    rows = run(cases, a.rounds)
    if a.write:
        write_results(RESULTS, "lm_head", "LM head: `rulesets.nn`'s token blocks against the original",
                      "f32, `optax.softmax_cross_entropy_with_integer_labels(h @ W, y).mean()`; `grad` is with respect "
                      "to W and h. Ratios are time(standard) / time(variant) over per-round medians (above 1: faster). "
                      "`aa` is the standard program again (the A/A noise control).", a.rounds, HEADER,
                      [_line(r) for r in rows], rows)


if __name__ == "__main__":
    main()
