"""The blocked attention kernel traced once per plan (``rulesets/_attention_plan.py``): layers alike share one trace,
layers that differ in what the trace reads do not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rulesets
from rewrite import rewrite
from rewrite.rules import builder


def _layers(second_scale):
    def f(q, k, v, w):
        a = jax.nn.softmax(q @ k.T * 0.125, axis=-1) @ v
        return jax.nn.softmax((a @ w) @ k.T * second_scale, axis=-1) @ v
    return f


def _operands(n=512, d=16):
    q, k, v, w = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(n, d)] * 3 + [(d, d)]))
    return q, k, v, w / 4


@pytest.fixture
def kernel_traces(monkeypatch):
    """The names of the functions rules trace at the test's shapes (the packs' example checks, which a test may run
    first, trace theirs), counted afresh (the process-wide traces emptied for the test)."""
    seen = []
    trace_at = builder.trace_at

    def counted(fn, avals):
        if any(tuple(a.shape) == (512, 16) for a in avals):
            seen.append(getattr(fn, "__qualname__", ""))
        return trace_at(fn, avals)

    monkeypatch.setattr(builder, "trace_at", counted)
    monkeypatch.setattr(builder, "_TRACES", builder._Traces())
    return seen


@pytest.mark.parametrize("second_scale, traces", [(0.125, 1), (0.25, 2)])
def test_alike_layers_share_one_kernel_trace_and_others_do_not(kernel_traces, second_scale, traces):
    """Two layers whose logits are the same steps over leaves of the same types and literals build one kernel,
    traced once; a layer whose scale is another literal (read by the kernel as a constant) is traced apart, and each
    layer computes its own values and gradients."""
    f = _layers(second_scale)
    ops = _operands()
    g = rewrite(f, rulesets=[rulesets.attention], cache=False)
    got = g.result(*ops)
    assert sum(s.fired for k, s in got.stats.items() if k.startswith("attn_")) == 2, "both layers are blocked"
    assert sum("Plan.kernel" in name for name in kernel_traces) == traces, kernel_traces
    np.testing.assert_allclose(g(*ops), f(*ops), rtol=2e-5, atol=2e-5)
    loss = lambda fn: lambda *xs: jnp.sum(fn(*xs) ** 2)  # noqa: E731
    for a, b in zip(jax.grad(loss(g), argnums=(0, 1, 2, 3))(*ops), jax.grad(loss(f), argnums=(0, 1, 2, 3))(*ops)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
