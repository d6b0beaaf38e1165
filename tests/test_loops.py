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
from rewrite.report.report import equations
from rewrite.ir.jaxapi import scan_counts

from . import covering

#: A rule that raises is a bug (it must decline instead); the engine only warns, so make the warning fail here.
pytestmark = pytest.mark.filterwarnings("error::rewrite.RewriteWarning")

PACK = rulesets.scan
TOL = dict(rtol=PACK.tolerance.rtol, atol=PACK.tolerance.atol)
#: Random programs are tiny: price the memory a stacked output holds so that extraction takes the rewritten
#: loops, which is what is tested (see tests/test_scan.py).
BYTE_HEAVY = AnalyticCost(stacked=1000.0)


def scans(closed):
    return [e for e in equations(closed) if e.primitive.name in ("scan", "while")]


def stacked_shapes(closed, length):
    """Shapes of every loop output stacked along an axis of the loop's length."""
    return [v.aval.shape for e in scans(closed) if e.primitive.name == "scan"
            for v in e.outvars[scan_counts(e.params)[1]:] if v.aval.shape[:1] == (length,)]


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


def normals(seed, *shapes):
    """Standard normal float32 arrays of these shapes, drawn one after another from numpy's generator at ``seed``:
    not ``jax.random``, each of whose shapes is an XLA compile (0.2-1 s of CPU; the random programs draw many)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in shapes]


# ---------------------------------------------------------------------- readouts
T, B, H, I = 8, 4, 5, 3


def lstm_params(seed):
    W, b, V, c = normals(seed, (H + I, 4 * H), (4 * H,), (H, 2), (2,))
    return dict(W=W * 0.3, b=b * 0.1, V=V * 0.3, c=c)


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
    args = (lstm_params(seed), *normals(seed + 1, (length, B, I), (length, B, 2)))
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
    p = lstm_params(0)
    xs, ys = normals(1, (T, B, I))[0], jnp.zeros((T, B, 2))

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
    assert any(v.aval.shape == (H, 2) for v in loop.invars[:scan_counts(loop.params)[0]])


def test_readout_of_an_output_used_elsewhere_is_only_hoisted_when_it_pays():
    p = lstm_params(0)
    xs, ys = normals(1, (T, B, I))[0], jnp.zeros((T, B, 2))

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
    xs, ys = normals(1, (T, B, I))[0], jnp.ones((T, B, 1))
    params = net.init(jax.random.PRNGKey(0), xs, ys)
    report = check(net.apply, params, xs, ys, grad=True)
    assert report.used.get("hoist_reductions") and stacked_shapes(report.after, T) == []


@pytest.mark.parametrize("cell", ["LSTMCell", "GRUCell"])
def test_flax_rnn_dense_loss(cell):
    """A flax ``nn.RNN`` with a ``Dense`` readout and MSE: no array stacked over time is left (issue 31's GRU
    case held 17% of the forward's temp memory; with the GRU cell at T=256, batch 64, hidden 128 the rewritten
    loss holds 2.29 of 16.0 MiB, what the loop-free hand-written loss holds)."""
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, xs):
            return nn.Dense(1)(nn.RNN(getattr(nn, cell)(H))(xs))

    model = Model()
    xs, ys = normals(1, (B, T, I))[0], jnp.ones((B, T, 1))
    params = model.init(jax.random.PRNGKey(0), xs)

    def loss(params, xs, ys):
        return jnp.mean((model.apply(params, xs) - ys) ** 2)

    report = check(loss, params, xs, ys, grad=cell == "LSTMCell")  # the readout's gradient: once is enough
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


# ---------------------------------------------------------------------- fori_loop buffers
#: the buffer programs' dimensions; under ``ci`` each value is taken by one of the cases (``reads_buffer`` only
#: where ``length > 1``, ``start`` at most ``extra``; sum_sq of a whole buffer not read by the body twice)
BUFFER_DIMS = {"length": [1, 2, 3, 4, 5, 6], "extra": [0, 2], "start": [0, 1, 2], "write": ["at_set", "dus"],
               "form": ["fori", "scan_reverse", "while"], "reads_buffer": [False, True],
               "loss": ["sum_sq", "max", "returned"]}
BUFFER_CASES = [
    dict(length=1, extra=0, start=0, write="at_set", form="fori", reads_buffer=False, loss="sum_sq", seed=0),
    dict(length=2, extra=2, start=1, write="dus", form="scan_reverse", reads_buffer=True, loss="max", seed=1),
    dict(length=3, extra=2, start=2, write="at_set", form="while", reads_buffer=False, loss="returned", seed=2),
    dict(length=4, extra=0, start=0, write="dus", form="fori", reads_buffer=True, loss="max", seed=3),
    dict(length=5, extra=2, start=0, write="at_set", form="scan_reverse", reads_buffer=False, loss="sum_sq", seed=4),
    dict(length=6, extra=0, start=0, write="dus", form="while", reads_buffer=False, loss="sum_sq", seed=5),
]


@st.composite
def buffer_cases(draw):
    """A case of :func:`buffer_program`, drawn."""
    length = draw(st.integers(1, 6))
    extra = draw(st.sampled_from([0, 0, 2]))          # buffer rows the loop does not write
    return dict(length=length, extra=extra, start=draw(st.integers(0, extra)),
                write=draw(st.sampled_from(["at_set", "dus"])),
                form=draw(st.sampled_from(["fori", "scan_reverse", "while"])),
                reads_buffer=draw(st.booleans() if length > 1 else st.just(False)),  # the body also reads the buffer
                loss=draw(st.sampled_from(["sum_sq", "max", "returned"])), seed=draw(st.integers(0, 2 ** 16)))


def buffer_program(case):
    """A counted loop writing one row of a carried buffer per step: (fn, args, what is expected)."""
    length, extra, start, write = case["length"], case["extra"], case["start"], case["write"]
    form, reads_buffer, loss, seed = case["form"], case["reads_buffer"], case["loss"], case["seed"]
    n_rows = length + extra

    def put(buf, i, v):
        if write == "at_set":
            return buf.at[i].set(v)
        return lax.dynamic_update_slice(buf, v[None], (i,) + (0,) * v.ndim)

    def step(i, c, w):
        x, buf = c
        new = jnp.tanh(x * w + 0.1 * i.astype(x.dtype))
        if reads_buffer:
            new = new + buf[jnp.maximum(i - 1, 0)]
        return new, put(buf, i, x * 2.0 - w)

    def fn(x, w):
        buf0 = jnp.full((n_rows,) + x.shape, 0.5, x.dtype)
        if form == "fori":
            _, buf = lax.fori_loop(start, start + length, lambda i, c: step(i, c, w), (x, buf0))
        elif form == "while":
            _, _, buf = lax.while_loop(lambda c: c[0] < start + length,
                                       lambda c: (c[0] + 1, *step(c[0], c[1:], w)), (start, x, buf0))
        else:  # a counter in a reverse scan: step j still writes row start + j
            def body(c, _):
                i, x, buf = c
                return (i + 1, *step(i, (x, buf), w)), None
            _, _, buf = lax.scan(body, (start, x, buf0), None, length=length, reverse=True)[0]
        if loss == "sum_sq":
            return jnp.sum(buf ** 2)
        if loss == "max":
            return jnp.max(buf)
        return buf

    fn.__qualname__ = (f"buffer(length={length}, extra={extra}, start={start}, write={write}, form={form}, "
                       f"reads_buffer={reads_buffer}, loss={loss})")
    x, w = normals(seed, (2, 3), ())
    args = (x, w * 0.5 + 1.0)
    return fn, args, dict(reads_buffer=reads_buffer, loss=loss, form=form, whole=extra == 0)


#: A while loop's trip count is priced as ``while_trips``; at least the programs' own makes the comparison fair.
FAIR_WHILE = AnalyticCost(stacked=1000.0, while_trips=10.0)


@settings(max_examples=10, phases=covering.PHASES)
@given(buffer_cases())
@covering.examples(BUFFER_DIMS, BUFFER_CASES)
def test_random_buffers_become_stacked_outputs(case):
    fn, args, what = buffer_program(case)
    # jax.grad cannot differentiate the original while loop (its trip count is dynamic to JAX)
    report = check(fn, *args, cost_model=FAIR_WHILE, grad=what["loss"] != "returned" and what["form"] != "while")
    if what["form"] == "while":
        assert report.fired.get("while_to_scan")
    if what["reads_buffer"]:
        assert not report.used.get("buffer_to_output")
    else:
        assert report.fired.get("buffer_to_output")
        if what["whole"] and what["loss"] == "sum_sq":  # the whole buffer is written, then only reduced
            assert report.used.get("hoist_reductions")
            assert all(v.aval.ndim < 3 for e in scans(report.after) for v in e.outvars)


def test_fori_buffer_loss_holds_no_buffer():
    def loss(x):
        buf = jnp.zeros((16,) + x.shape)
        _, buf = lax.fori_loop(0, 16, lambda i, c: (jnp.tanh(c[0]), c[1].at[i].set(c[0] * 2.0)), (x, buf))
        return jnp.sum(buf ** 2)

    x = jnp.linspace(-1.0, 1.0, 64)
    report = check(loss, x, cost_model=None, grad=True)
    assert report.used.get("hoist_reductions")
    (loop,) = scans(report.after)
    assert [v.aval.shape for v in loop.outvars] == [(64,), ()]  # the state and the accumulator
    assert "scatter" not in {e.primitive.name for e in loop.params["jaxpr"].jaxpr.eqns}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_the_rows_a_fori_loop_writes_are_computed_in_numpy_and_nothing_is_compiled(dtype):
    """``buffer_to_output`` reads which row each step writes off the index's program at every counter value: in
    NumPy (``rulesets._numpy_eval``), where XLA's compile of ``lax.map`` of it was 28-39 ms of a fori_loop's first
    rewrite. The rewrite asks XLA for no compile, and the program's values are the original's."""
    from .rewritten import compiles_during

    def loss(x):
        buf = jnp.zeros((37,) + x.shape, x.dtype)  # a length no other test writes
        _, buf = lax.fori_loop(0, 37, lambda i, c: (jnp.tanh(c[0]), c[1].at[i].set(c[0] * 2)), (x, buf))
        return jnp.sum(buf.astype(jnp.float32) ** 2)

    x = jnp.linspace(-1.0, 1.0, 24, dtype=dtype)
    r = rewrite(loss, rulesets=[rulesets.scan], cache=False)
    result, compiles = compiles_during(r.result, x)
    assert result.stats["buffer_to_output"].fired and compiles == 0
    np.testing.assert_allclose(r(x), loss(x), rtol=1e-2 if dtype != jnp.float32 else 1e-5)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int16, jnp.uint8])
def test_numpy_evaluates_an_index_program_over_every_step_as_lax_map_does(dtype):
    """The batched evaluation (``batch=(T,)``: the program mapped over the steps) of an index's program, with a
    wrap below 0, a sum that overflows its integer type, a conversion and a broadcast, is ``lax.map``'s, bit for bit;
    a program with an equation outside its forms (a ``rem``) is not evaluated."""
    from rulesets._numpy_eval import evaluated

    n = int(jnp.iinfo(dtype).max) // 2 + 3

    def index(i):
        j = lax.select(i < 0, i + dtype(n), i) + dtype(n)  # overflows past the type's largest value
        return [lax.broadcast_in_dim(j.astype(jnp.int32), (1,), ()), (i + dtype(1)).astype(jnp.float32)]

    steps = np.arange(-5, 40, dtype=dtype) if jnp.issubdtype(dtype, jnp.signedinteger) else np.arange(40, dtype=dtype)
    closed = jax.make_jaxpr(index)(dtype(0))
    got = evaluated(closed, [steps], batch=(len(steps),))
    want = jax.jit(lambda s: lax.map(lambda i: index(i), s))(jnp.asarray(steps))
    assert got is not None
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, np.asarray(w))
    assert evaluated(jax.make_jaxpr(lambda i: [i % dtype(3)])(dtype(0)), [steps], batch=(len(steps),)) is None


# ---------------------------------------------------------------------- saying why
def test_explain_prices_a_loop_rewrite_it_did_not_choose():
    p = lstm_params(0)
    xs, ys = normals(1, (T, B, I))[0], jnp.zeros((T, B, 2))

    def loss(p, xs, ys):
        hs = lstm(p, xs)
        return jnp.mean((hs @ p["V"] - ys) ** 2), hs  # hs is stacked anyway: hoisting only adds work

    report = explain(loss, p, xs, ys, rulesets=[PACK])
    assert report.fired.get("hoist_reductions") and not report.used.get("hoist_reductions")
    why = report.why("hoist_reductions")
    assert why.kept == pytest.approx(report.cost_after, rel=1e-6)  # the price extraction chose
    assert why.declined != why.kept and why.drivers  # the operations whose prices differ
    assert why.verdict == ("declined" if why.declined > why.kept else "missed")
    assert f"hoist_reductions: kept {why.kept:,.0f}, with it {why.declined:,.0f}" in report.summary()
    # A rewrite that was chosen is not listed; a rule that built nothing has nothing to price.
    chosen = explain(lambda p, xs, ys: loss(p, xs, ys)[0], p, xs, ys, rulesets=[PACK], cost_model=BYTE_HEAVY)
    assert chosen.used.get("hoist_reductions") and "hoist_reductions: kept" not in chosen.summary()
    assert report.why("lift_independent") is None
# ---------------------------------------------------------------------- bodies behind custom derivatives
MUL_ONE = Ruleset("mul_one", [rule(lambda x: x * 1.0, lambda x: x, name="mul_one")], soundness="exact")


def _custom(kind, inner):
    """``inner`` behind a custom derivative (whose derivative is deliberately not inner's) or a checkpoint."""
    if kind == "jvp":
        f = jax.custom_jvp(inner)
        f.defjvp(lambda p, t: (f(p[0]), 3.0 * t[0]))  # not inner's derivative: it must survive the rewrite
        return f
    if kind == "vjp":
        f = jax.custom_vjp(inner)
        f.defvjp(lambda x: (f(x), x), lambda x, g: (g * x * 2.0,))
        return f
    return jax.checkpoint(inner)


#: the custom-call programs' dimensions (``kinds`` and ``bodies`` are lists of their values, a body for each call);
#: under ``ci`` each value is taken by one of the cases
CUSTOM_DIMS = {"kinds": ["jvp", "vjp", "checkpoint"], "bodies": ["sin", "tanh_sq", "scan_sum"],
               "nested": [False, True]}
CUSTOM_CASES = [dict(kinds=["jvp", "vjp", "checkpoint"], bodies=["sin", "tanh_sq", "scan_sum"], nested=False, seed=0),
                dict(kinds=["checkpoint"], bodies=["sin"], nested=True, seed=1),
                dict(kinds=["vjp", "jvp"], bodies=["scan_sum", "tanh_sq"], nested=True, seed=2)]


@st.composite
def custom_cases(draw):
    """A case of :func:`custom_program`, drawn."""
    kinds = draw(st.lists(st.sampled_from(["jvp", "vjp", "checkpoint"]), min_size=1, max_size=3))
    return dict(kinds=kinds, bodies=[draw(st.sampled_from(["sin", "tanh_sq", "scan_sum"])) for _ in kinds],
                nested=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)))  # nested: a call in another's body


def custom_program(case):
    kinds, bodies, nested, seed = case["kinds"], case["bodies"], case["nested"], case["seed"]

    def inner_of(body):
        if body == "sin":
            return lambda x: jnp.sin(x * 1.0) * 1.0
        if body == "tanh_sq":
            return lambda x: jnp.tanh(x) ** 2 * 1.0
        return lambda x: x * 1.0 + lax.scan(lambda c, v: (c + v * 1.0, c), jnp.zeros(x.shape[1:]), x)[1]

    fs = [_custom(k, inner_of(b)) for k, b in zip(kinds, bodies)]
    if nested:
        outer = fs[0]
        fs[0] = _custom("vjp", lambda x: outer(x) * 1.0 + 0.5)

    def fn(x):
        return sum(jnp.sum(f(x) ** 2) for f in fs)

    fn.__qualname__ = f"custom(kinds={kinds}, bodies={bodies}, nested={nested})"
    return fn, tuple(normals(seed, (3, 4)))


def _muls_by_one(closed):
    return sum(e.primitive.name == "mul" and any(isinstance(v, core.Literal) and v.val == 1.0 for v in e.invars)
               for e in equations(closed))


@settings(max_examples=10, phases=covering.PHASES)
@given(custom_cases())
@covering.examples(CUSTOM_DIMS, CUSTOM_CASES, lists=("kinds", "bodies"))
def test_rules_act_inside_custom_derivative_and_checkpoint_bodies(case):
    fn, args = custom_program(case)
    report = explain(fn, *args, rulesets=[MUL_ONE])
    assert report.fired.get("mul_one") and _muls_by_one(report.before) > 0
    assert _muls_by_one(report.after) == 0  # every x * 1.0, in every body, is gone
    calls = {e.primitive.name for e in report.after.jaxpr.eqns}
    assert calls & {"custom_jvp_call", "custom_vjp_call", "remat2"}  # the calls are still there
    fast = rewrite(fn, rulesets=[MUL_ONE])
    close(jax.jit(fast)(*args), jax.jit(fn)(*args), dict(rtol=1e-6, atol=1e-6))
    # the user's derivative rules (3 * t, g * 2x) are what jax.grad uses, not the bodies' derivatives
    close(jax.jit(jax.grad(fast))(*args), jax.jit(jax.grad(fn))(*args), dict(rtol=1e-6, atol=1e-6))


def test_scan_pack_acts_inside_a_custom_vjp_body():
    def inner(xs):
        _, ys = lax.scan(lambda h, x: (jnp.tanh(h + x), h * x), jnp.zeros(xs.shape[1:]), xs)
        return jnp.mean(ys ** 2)

    f = jax.custom_vjp(inner)
    f.defvjp(lambda xs: (f(xs), xs), lambda xs, g: (g * jnp.ones_like(xs),))
    (xs,) = normals(0, (16, 64))
    report = check(f, xs)
    assert report.used.get("hoist_reductions")
    (call,) = [e for e in report.after.jaxpr.eqns if e.primitive.name == "custom_vjp_call"]
    assert stacked_shapes(call.params["call_jaxpr"], 16) == []
    fast = rewrite(f, rulesets=[PACK], cost_model=BYTE_HEAVY)
    np.testing.assert_array_equal(jax.grad(fast)(xs), jnp.ones_like(xs))  # the custom rule, not the body's


def test_custom_jvp_rule_is_kept_when_its_body_is_rewritten():
    # The jvp rule returns a marker (42 * t), far from the body's own derivative: jax.grad of the rewritten
    # program must still give the marker, while the body's x * 1.0 is gone.
    f = jax.custom_jvp(lambda x: jnp.sin(x * 1.0) * 1.0)
    f.defjvp(lambda p, t: (f(p[0]), 42.0 * t[0]))
    x = jnp.linspace(-2.0, 2.0, 5)
    report = explain(lambda x: jnp.sum(f(x)), x, rulesets=[MUL_ONE])
    assert _muls_by_one(report.before) == 2 and _muls_by_one(report.after) == 0
    fast = rewrite(lambda x: jnp.sum(f(x)), rulesets=[MUL_ONE])
    np.testing.assert_allclose(fast(x), jnp.sum(jnp.sin(x)), rtol=1e-6)
    np.testing.assert_array_equal(jax.grad(fast)(x), jnp.full_like(x, 42.0))


def test_a_fori_loop_that_writes_a_buffer_read_by_a_loss_is_rewritten():
    """Issue 50: ``buf.at[i].set(h @ V)`` in a ``fori_loop`` that slices its inputs with the counter, the loss
    the buffer's mean squared error. The loop's copy (``buffer_to_output``, then ``hoist_reductions``) reads
    the inputs through the same slices as the loop, but was priced as reading them whole every step
    ("scan (its own work) 1.82M -> 19.4M"), and declined: the forward held the whole buffer."""
    T, B, H, I = 1024, 128, 32, 8  # the buffer (512 KiB) far larger than the loop's own temporaries
    W, U, V, xs, ys = normals(0, (H, H), (I, H), (H, 1), (T, B, I), (T, B, 1))
    p = dict(W=W / H ** 0.5, U=U / I ** 0.5, V=V / H ** 0.5)

    def loss(p, xs, ys):
        def body(i, c):
            h, buf = c
            h = jnp.tanh(h @ p["W"] + xs[i] @ p["U"])
            return h, buf.at[i].set(h @ p["V"])

        _, out = lax.fori_loop(0, T, body, (jnp.zeros((B, H)), jnp.zeros((T, B, 1))))
        return jnp.mean((out - ys) ** 2)

    packs = [r for name, r in rulesets.BUILTIN.items() if name != "fastmath"]
    report = explain(loss, p, xs, ys, rulesets=packs)
    assert report.used.get("hoist_reductions") or report.used.get("buffer_to_output"), report.fired
    g = rewrite(loss, rulesets=packs)
    temp = lambda fn: jax.jit(fn).lower(p, xs, ys).compile().memory_analysis().temp_size_in_bytes
    assert temp(g) <= 0.15 * temp(loss), (temp(g), temp(loss))
    np.testing.assert_allclose(float(g(p, xs, ys)), float(loss(p, xs, ys)), rtol=1e-5)
