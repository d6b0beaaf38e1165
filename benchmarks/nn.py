"""Cross-entropy against one-hot labels, as training scripts write it, against the integer-label form.

Two programs, each in the variants below, timed side by side (interleaved
rounds after warm-up, ``benchmarks/harness.py``), with temp memory from
``memory_analysis()``:

* ``lm``: a language-model loss, ``optax.softmax_cross_entropy(logits,
  jax.nn.one_hot(labels, V)).mean()`` at N=1024 tokens and a vocabulary of
  V=32,000, alone (``forward``) and under ``jax.value_and_grad``
  (``value_and_grad``).
* ``mlp``: a classifier trained with one-hot labels as the flax examples
  write it: a flax ``nn.Dense`` MLP (784-512-512-C, ReLU), the loss
  ``optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, C)).mean()``,
  and one SGD step (``value_and_grad`` and the update), batch 256, with
  C = 10 classes (flax's MNIST example) and C = 1,000 (an ImageNet head).

Variants, all taking the same arguments:

* ``one_hot``: the program as written (the baseline; ratios are its time over theirs).
* ``one_hot_aa``: the same program again, compiled apart: an A/A control, whose
  ratio shows how far noise alone moves a ratio in this run.
* ``rewritten``: ``rewrite(loss, rulesets=[rulesets.nn])``, then ``jax.value_and_grad``
  of it where there is a gradient (JAX differentiates the rewritten loss).
* ``rewritten_program``: the whole gradient program (or training step) rewritten,
  ``rewrite(jax.value_and_grad(loss), rulesets=[rulesets.nn])``.
* ``rewritten_program_derivatives``: the same with ``rulesets.derivatives`` too,
  whose rules simplify the backward pass JAX built for the one-hot form.
* ``integer``: the hand-written integer-label form,
  ``optax.softmax_cross_entropy_with_integer_labels(logits, labels)``.

Run holding the benchmark lock::

    flock /tmp/bench.lock python -m benchmarks.nn --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.harness import MiB, Row, format_variants, measure
from rewrite import rewrite
from rewrite.report.report import primitive_counts
from rulesets.derivatives import derivatives
from rulesets.nn import nn

N, V = 1024, 32_000
BATCH, FEATURES = 256, 784


# ---------------------------------------------------------------------- language-model loss
def lm_one_hot(logits, labels):
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, logits.shape[-1])).mean()


def lm_integer(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def lm_cases():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    args = (jax.random.normal(k1, (N, V), jnp.float32), jax.random.randint(k2, (N,), 0, V))
    vg = jax.value_and_grad
    forward = {"one_hot": lm_one_hot, "one_hot_aa": _again(lm_one_hot), "rewritten": rewrite(lm_one_hot, rulesets=[nn]),
               "integer": lm_integer}
    grads = {"one_hot": vg(lm_one_hot), "one_hot_aa": _again(vg(lm_one_hot)),
             "rewritten": vg(rewrite(lm_one_hot, rulesets=[nn])),
             "rewritten_program": rewrite(vg(lm_one_hot), rulesets=[nn]),
             "rewritten_program_derivatives": rewrite(vg(lm_one_hot), rulesets=[nn, derivatives]),
             "integer": vg(lm_integer)}
    return [(f"lm N={N} V={V} forward", forward, args), (f"lm N={N} V={V} value_and_grad", grads, args)]


# ---------------------------------------------------------------------- flax classifier
def mlp_cases(classes: int = 10):
    import flax.linen as fnn

    CLASSES = classes  # noqa: N806 (the flax example's constant)

    class MLP(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            x = fnn.relu(fnn.Dense(512)(x))
            x = fnn.relu(fnn.Dense(512)(x))
            return fnn.Dense(CLASSES)(x)

    model = MLP()
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(k1, (BATCH, FEATURES), jnp.float32)
    y = jax.random.randint(k2, (BATCH,), 0, CLASSES)
    params = model.init(k3, x)

    def loss_one_hot(params, x, y):  # as flax's MNIST example writes it
        logits = model.apply(params, x)
        return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=jax.nn.one_hot(y, CLASSES)))

    def loss_integer(params, x, y):
        logits = model.apply(params, x)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=y))

    def step(loss):
        def train_step(params, x, y):
            value, grads = jax.value_and_grad(loss)(params, x, y)
            return value, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        return train_step

    variants = {"one_hot": step(loss_one_hot), "one_hot_aa": _again(step(loss_one_hot)),
                "rewritten": step(rewrite(loss_one_hot, rulesets=[nn])),
                "rewritten_program": rewrite(step(loss_one_hot), rulesets=[nn]),
                "rewritten_program_derivatives": rewrite(step(loss_one_hot), rulesets=[nn, derivatives]),
                "integer": step(loss_integer)}
    return [(f"flax MLP train step, batch {BATCH}, {CLASSES} classes", variants, (params, x, y))]


def _again(fn):
    """``fn`` under another identity, so that ``jax.jit`` compiles and caches it apart (the A/A control)."""
    def again(*args):
        return fn(*args)
    return again


def gathers(fn, args) -> bool:
    """Whether the program ``fn`` runs reads the labels with a gather (the rewrite was taken)."""
    return primitive_counts(jax.make_jaxpr(fn)(*args))["gather"] > 0


def _agree(variants, args) -> None:
    """Every variant computes the same thing (loss to 1e-5, gradients to 1e-4) before anything is timed."""
    outs = {k: jax.tree_util.tree_leaves(jax.jit(f)(*args)) for k, f in variants.items()}
    ref = outs["one_hot"]
    for k, o in outs.items():
        for a, b in zip(ref, o):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5, err_msg=k)


def report(rows: list[Row], rounds: int, load: tuple, taken: dict[str, dict[str, bool]]) -> str:
    lines = [
        "# `rulesets.nn`: cross-entropy against one-hot labels, rewritten",
        "",
        f"Generated by `benchmarks/nn.py` on {datetime.date.today().isoformat()}: jax {jax.__version__}, "
        f"{jax.devices()[0].platform.upper()} ({platform.machine()}, {os.cpu_count()} cores shared with other users; "
        f"load average {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f} when the run started). "
        f"{rounds} interleaved rounds per case after warm-up; each time is a median. Ratios are the one-hot "
        "program's time over the variant's (above 1: faster). Temp memory is XLA's `memory_analysis()`.",
        "",
        "Caveat: two cores shared with other engineers' jobs, so absolute times drift between runs; read the "
        "ratios and the memory, which are exact.",
        "",
        "## Summary",
        "",
        "| case | temp MiB: one_hot / rewritten / integer | ms: one_hot / rewritten / integer | rewritten vs one_hot "
        "| A/A | gather taken |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        st, s = row.stats, row.seconds
        lines.append(f"| {row.case} | {st['one_hot'].temp_bytes / MiB:.1f} / {st['rewritten'].temp_bytes / MiB:.1f} / "
                     f"{st['integer'].temp_bytes / MiB:.1f} | {s['one_hot'] * 1e3:.1f} / {s['rewritten'] * 1e3:.1f} / "
                     f"{s['integer'] * 1e3:.1f} | {row.ratio('rewritten'):.2f}x | {row.ratio('one_hot_aa'):.2f}x | "
                     + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in taken[row.case].items()) + " |")
    lines += [
        "",
        "\"gather taken\" says whether the program each rewritten variant runs reads the labels with a gather "
        "(the cost model took `nn_one_hot_sum`'s form) or still compares them with an `iota`. With 10 classes "
        "the one-hot array is 10 values a row and the cost model keeps the program as written: the rewritten "
        "variants are then the original program, and their ratios are noise (compare the A/A control). With "
        "1,000 classes the loss is a small part of a step that the matrix products dominate.",
        "",
    ]
    for row in rows:
        lines += [f"## {row.case}", "", format_variants(row), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/nn.md and nn.json")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    rows = []
    taken = {}
    for case, variants, inputs in lm_cases() + mlp_cases(10) + mlp_cases(1000):
        _agree(variants, inputs)
        taken[case] = {k: gathers(f, inputs) for k, f in variants.items() if k.startswith("rewritten")}
        row = measure(case, variants, inputs, baseline="one_hot", rounds=args.rounds, warmup=2,
                      progress=lambda s: print(s, file=sys.stderr, flush=True))
        rows.append(row)
        print(format_variants(row) + "\n", flush=True)
    text = report(rows, args.rounds, load, taken)
    print(text)
    if args.write:
        out = Path(__file__).resolve().parent / "results"
        (out / "nn.md").write_text(text)
        (out / "nn.json").write_text(json.dumps({"load": load, "rows": [r.as_dict() for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
