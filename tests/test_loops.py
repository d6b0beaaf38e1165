"""Loops as real code writes them: readouts between a loop and its loss, ``fori_loop`` buffers, the loop API.

Each test rewrites a program with :mod:`rulesets.scan`, checks that the rule
fired and what the emitted program looks like (no stacked hidden states, the
reduction inside the loop), and compares values, and gradients where the
rule touches them, with the original within the pack's tolerance. Random
programs come from hypothesis: recurrent loops with random readouts (weights
contracted with ``dot_general``, biases broadcast, transposes to batch-major,
reshapes), random ``fori_loop`` bodies writing a buffer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax._src import core

import rulesets
from rewrite import AnalyticCost, Ruleset, explain, procedural, rewrite, rule
from rewrite.loops import SCAN, Decline, Loop

PACK = rulesets.scan
TOL = dict(rtol=PACK.tolerance.rtol, atol=PACK.tolerance.atol)
#: Random programs are tiny: price the memory a stacked output holds so that extraction takes the rewritten
#: loops, which is what is tested (see tests/test_scan.py).
BYTE_HEAVY = AnalyticCost(stacked=1000.0)


def scans(closed):
    jaxpr = closed.jaxpr if isinstance(closed, core.ClosedJaxpr) else closed
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name in ("scan", "while"):
            out.append(e)
        for sub in core.jaxprs_in_params(e.params):
            out.extend(scans(sub))
    return out


def stacked_shapes(closed, length):
    """Shapes of every loop output stacked along an axis of the loop's length."""
    return [v.aval.shape for e in scans(closed) if e.primitive.name == "scan"
            for v in e.outvars[e.params["num_carry"]:] if v.aval.shape[:1] == (length,)]


def close(got, want, tol=TOL):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), **tol)


def check(fn, *args, cost_model=BYTE_HEAVY, grad=False):
    report = explain(fn, *args, rulesets=[PACK], cost_model=cost_model)
    close(jax.jit(core.jaxpr_as_fun(report.after))(*jax.tree.leaves(args)), jax.jit(fn)(*args))
    if grad:
        fast = rewrite(fn, rulesets=[PACK], cost_model=cost_model)
        close(jax.jit(jax.grad(fast))(*args), jax.jit(jax.grad(fn))(*args), dict(rtol=2e-4, atol=2e-5))
    return report


# ---------------------------------------------------------------------- readouts
T, B, H, I = 8, 4, 5, 3


def lstm_params(key):
    k = jax.random.split(key, 4)
    return dict(W=jax.random.normal(k[0], (H + I, 4 * H)) * 0.3, b=jax.random.normal(k[1], (4 * H,)) * 0.1,
                V=jax.random.normal(k[2], (H, 2)) * 0.3, c=jax.random.normal(k[3], (2,)))


def lstm(p, xs, reverse=False, unroll=1):
    def step(carry, x):
        h, c = carry
        i, f, g, o = jnp.split(jnp.concatenate([x, h], -1) @ p["W"] + p["b"], 4, axis=-1)
        c = jax.nn.sigmoid(f + 1.0) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    zeros = jnp.zeros((xs.shape[1], H))
    return lax.scan(step, (zeros, zeros), xs, reverse=reverse, unroll=unroll)[1]


@st.composite
def readout_programs(draw):
    """A loss over a readout of an LSTM's stacked hidden states: (fn, args, whether they are only reduced)."""
    length = draw(st.integers(2, 6))
    reverse, unroll = draw(st.booleans()), draw(st.sampled_from([1, 2]))
    batch_major = draw(st.booleans())      # flax's nn.RNN: (batch, time, features)
    readout = draw(st.sampled_from(["dense", "dense_bias", "scale", "reshape", "einsum_left"]))
    loss_kinds = draw(st.lists(st.sampled_from(["mse", "l1", "max", "per_step"]), min_size=1, max_size=2))
    also_return = draw(st.booleans())
    nested = draw(st.booleans())
    seed = draw(st.integers(0, 2 ** 16))

    def one(p, xs, ys):
        hs = lstm(p, xs, reverse, unroll)
        if batch_major:
            hs = jnp.swapaxes(hs, 0, 1)
        if readout == "dense":
            out = hs @ p["V"]
        elif readout == "dense_bias":
            out = hs @ p["V"] + p["c"]
        elif readout == "scale":
            out = jnp.tanh(hs[..., :2] * p["c"])
        elif readout == "reshape":
            out = (hs.reshape(hs.shape[:2] + (H, 1)) * 2.0)[..., :2, 0]
        else:  # weights on the left: out[..., o] = sum_h V[h, o] h[..., h]
            out = jnp.einsum("ho,...h->...o", p["V"], hs)
        target = jnp.swapaxes(ys, 0, 1) if batch_major else ys
        total = 0.0
        for kind in loss_kinds:
            if kind == "mse":
                total = total + jnp.mean((out - target) ** 2)
            elif kind == "l1":
                total = total + jnp.mean(jnp.abs(out - target))
            elif kind == "max":
                total = total + jnp.max(out)
            else:
                total = total + jnp.sum(jnp.sum(out ** 2, axis=(0, 2)) * jnp.arange(out.shape[1]))
        return (total, hs) if also_return else total

    if nested:
        def fn(p, xs, ys):
            def outer(acc, scale):
                r = one(p, xs * scale, ys)
                return acc + (r[0] if also_return else r), None
            return lax.scan(outer, 0.0, jnp.array([1.0, -0.5]))[0]
    else:
        fn = one
    fn.__qualname__ = (f"readout(length={length}, reverse={reverse}, unroll={unroll}, batch_major={batch_major}, "
                       f"readout={readout!r}, loss={loss_kinds}, also_return={also_return}, nested={nested})")
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    args = (lstm_params(k[0]), jax.random.normal(k[1], (length, B, I)), jax.random.normal(k[2], (length, B, 2)))
    simple = not also_return and not nested and "per_step" not in loss_kinds
    return fn, args, simple


@settings(max_examples=6)  # each example saturates an LSTM body and compiles its gradient
@given(readout_programs())
def test_random_readouts_move_into_the_loop(program):
    fn, args, simple = program
    report = check(fn, *args, grad=simple)
    assert report.fired.get("hoist_reductions")
    if simple:  # the hidden states are only read out and reduced: none are stacked any more
        assert report.used.get("hoist_reductions")
        assert stacked_shapes(report.after, args[1].shape[0]) == []


def test_readout_with_weights_contracts_inside_the_body():
    p = lstm_params(jax.random.PRNGKey(0))
    xs, ys = jax.random.normal(jax.random.PRNGKey(1), (T, B, I)), jnp.zeros((T, B, 2))

    def loss(p, xs, ys):
        return jnp.mean((lstm(p, xs) @ p["V"] + p["c"] - ys) ** 2)

    report = check(loss, p, xs, ys, grad=True)
    assert report.used.get("hoist_reductions")
    (loop,) = scans(report.after)
    # outside the loop: only the bias reshaped to a step's shape, the initial state, the mean's division
    assert [e.primitive.name for e in report.after.jaxpr.eqns if e.primitive.name not in ("broadcast_in_dim",
                                                                                          "squeeze")] == ["scan", "div"]
    assert stacked_shapes(report.after, T) == []
    assert loop.params["jaxpr"].jaxpr.eqns  # the readout's weights entered the loop as constants
    assert any(v.aval.shape == (H, 2) for v in loop.invars[:loop.params["num_consts"]])


def test_readout_of_an_output_used_elsewhere_is_only_hoisted_when_it_pays():
    p = lstm_params(jax.random.PRNGKey(0))
    xs, ys = jax.random.normal(jax.random.PRNGKey(1), (T, B, I)), jnp.zeros((T, B, 2))

    def loss(p, xs, ys):
        hs = lstm(p, xs)
        return jnp.mean((hs @ p["V"] - ys) ** 2), hs

    report = check(loss, p, xs, ys, cost_model=None)
    assert report.fired.get("hoist_reductions")
    assert not report.used.get("hoist_reductions")  # hs is stacked anyway


def test_haiku_lstm_readout_loss():
    hk = pytest.importorskip("haiku")

    def f(xs, ys):
        core_ = hk.LSTM(H)
        out, _ = hk.dynamic_unroll(core_, xs, core_.initial_state(B))
        return jnp.mean((hk.Linear(1)(out) - ys) ** 2)

    net = hk.without_apply_rng(hk.transform(f))
    xs, ys = jax.random.normal(jax.random.PRNGKey(1), (T, B, I)), jnp.ones((T, B, 1))
    params = net.init(jax.random.PRNGKey(0), xs, ys)
    report = check(net.apply, params, xs, ys, grad=True)
    assert report.used.get("hoist_reductions") and stacked_shapes(report.after, T) == []


def test_flax_rnn_dense_loss():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, xs):
            return nn.Dense(1)(nn.RNN(nn.LSTMCell(H))(xs))

    model = Model()
    xs, ys = jax.random.normal(jax.random.PRNGKey(1), (B, T, I)), jnp.ones((B, T, 1))
    params = model.init(jax.random.PRNGKey(0), xs)

    def loss(params, xs, ys):
        return jnp.mean((model.apply(params, xs) - ys) ** 2)

    report = check(loss, params, xs, ys, grad=True)
    assert report.used.get("hoist_reductions") and stacked_shapes(report.after, T) == []


# ---------------------------------------------------------------------- the loop API
def test_loop_api_adds_an_output_and_a_carry_and_declines_cleanly():
    seen = {}

    @procedural
    def count(m):
        loop = Loop(m)
        if loop.params.get("_rw_counted"):
            return None
        seen["reverse"], seen["length"] = loop.reverse, loop.length
        with loop.attempt():
            loop.add_output(loop.body.outs[loop.num_carry])
            raise Decline("undone")
        assert loop.build(_rw_counted=True)[-1].shape == loop.scan.aval[-1].shape  # nothing was added
        with loop.attempt():
            j, acc = loop.add_carry(m.trace(lambda: jnp.zeros((), jnp.int32)))
            loop.set_carry_next(j, m.trace(lambda a: a + 1, acc))
        res = loop.build(_rw_counted=True)
        seen["count"] = loop.carry_result(res, j)
        return loop.handover(res)

    def f(c, xs):
        return lax.scan(lambda c, x: (c + x, c * x), c, xs, reverse=True)

    c, xs = jnp.ones(3), jnp.arange(12.0).reshape(4, 3)
    report = explain(f, c, xs, rulesets=[Ruleset("count", [rule(SCAN, count, name="count")], soundness="identity")])
    assert report.fired.get("count") and seen["reverse"] and seen["length"] == 4
    assert seen["count"].shape == () and seen["count"].dtype == jnp.int32
    close(jax.jit(core.jaxpr_as_fun(report.after))(c, xs), f(c, xs))
