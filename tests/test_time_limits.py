"""Rewrite time is bounded: each rule's time share, the run's time limit inside a long procedure, and the
cost of walking a loop's consumers (``rulesets.scan``) in an e-graph full of equivalent forms (issue 48.3)."""

import jax.numpy as jnp
import pytest
from jax import lax

import rulesets
from rewrite import Ruleset, explain, rule
from rewrite.loops import Loop


# ---------------------------------------------------------------------- hoist_reductions' walk
def _walks(levels: int) -> int:
    """How many values ``Loop.per_step`` built (or failed to build) for a reduction over ``levels`` doublings of
    a loop's stacked output times a value that cannot move into the loop. ``x * 2 -> x + x`` gives every
    level two equivalent nodes, both reading the level below; the loop appears (``buffer_to_output``) only
    after they exist, so ``hoist_reductions`` walks all of them."""
    twice = Ruleset("twice", [rule(lambda x: x * 2.0, lambda x: x + x, name="twice")], soundness="identity")

    def loss(h0):
        buf = jnp.zeros((16,) + h0.shape)
        _, ys = lax.fori_loop(0, 16, lambda i, c: (jnp.tanh(c[0]), c[1].at[i].set(c[0] * 3.0)), (h0, buf))
        a = ys * jnp.cumsum(ys, axis=0)  # a running sum over the loop's axis cannot move into the loop
        for _ in range(levels):
            a = a * 2.0
        return jnp.sum(a)

    calls = [0]
    walk = Loop._step_uncached

    def counted(self, *args):
        calls[0] += 1
        return walk(self, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Loop, "_step_uncached", counted)
        report = explain(loss, jnp.ones((4, 8)), rulesets=[twice, rulesets.scan.hoist, rulesets.scan.buffers])
    assert report.fired.get("twice") == levels and report.fired.get("buffer_to_output")
    assert report.result.stats["hoist_reductions"].matched >= 1
    return calls[0]


def test_hoist_reductions_walks_each_value_once():
    # A dead end met below k levels of two equivalent nodes each was walked 3 * 2^k times (768 at k = 8,
    # 3,072 at k = 10; the seq2seq of issue 48 spent 535 s there): a decline is now remembered.
    small, large = _walks(4), _walks(10)
    assert large <= small + 6 * 3  # linear in the depth: a few values per level
