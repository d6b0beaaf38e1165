"""The LM head's loop holds no more temporary memory than the loss as written, by XLA's own ``memory_analysis()``.

Issue 50's memory target on the LM head's blocked form: flax's encoder-decoder loss
(``benchmarks.ecosystem.flax_seq2seq_loss``) rewritten with every built-in pack but fastmath took
``nn_lm_head_lse_label_*`` and held 135,216 bytes more than as written at 256 x 1024 tokens (65,536 at the
sizes below): the loop's inputs computed from the program's inputs alone (the label columns of ``W``, the wrapped
labels, the loop's zeroed results), which XLA:CPU computes first and held across the cross-attention's peak
(``rulesets/nn_lm_head_kernels.py``, ``_block_loop``)."""

import warnings

import jax
import pytest

from benchmarks.decisions import packs
from rewrite import explain
from rewrite.ir.jaxapi import core

#: What XLA:CPU's loop itself adds to the temporaries: the tuple of its operands' buffers (8 bytes each: the
#: head's loop has 9, 72 bytes), which its buffer assignment placed past the original's end. Any array the
#: head's loop holds is at least a block of per-token statistics, 128 tokens x 4 bytes.
LOOP_TUPLE_BYTES = 128


def _temp(closed, args) -> int:
    return jax.jit(core.jaxpr_as_fun(closed)).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_flax_seq2seq_loss_with_the_head_holds_no_more_than_as_written():
    pytest.importorskip("flax.linen")
    from benchmarks.ecosystem import _flat, flax_seq2seq_loss

    fn, args = flax_seq2seq_loss(nq=128, nk=128, vocab=256)  # 2 x 128 target tokens: the head's blocks of 128
    flat, leaves = _flat(fn, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = explain(flat, *leaves, rulesets=packs())
    assert any(r.startswith("nn_lm_head_lse_label_") for r in report.used), sorted(report.used)
    before, after = _temp(report.before, leaves), _temp(report.after, leaves)
    assert after <= before + LOOP_TUPLE_BYTES, (before, after)
