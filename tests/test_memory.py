"""The memory model (``rewrite/cost/memory.py``) against ``memory_analysis()``, and the memory budget."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.library_scratch import scratch_bytes
from rewrite import AnalyticCost, CostModel, Ruleset, explain, rewrite
from rewrite.cost import calibration
from rewrite.cost.program import Program
from rulesets.attention import attention, attention_with
from rulesets.derivatives import derivatives
from tests.test_cost_model import ARGS, B, C, T, jax_vjp

N, HEADS, D = 1024, 4, 64


def plain(q, k, v):
    return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / 8.0, axis=-1) @ v


def flax_layout(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla")


def grad(f):
    return jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))


def _xla(f, args):
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


BHND = [jax.ShapeDtypeStruct((2, HEADS, N, D), jnp.float32)] * 3
BNHD = [jax.ShapeDtypeStruct((2, N, HEADS, D), jnp.float32)] * 3

# The attention benchmark's programs (benchmarks/attention.py) at N=1024. Predicted vs XLA (MiB), 2026-11-26:
#   dot_product_attention forward 66.0 vs 64.0, [b,n,h,d] 64.0 vs 64.0; the blocked forward 16.1 vs 16.6 and
#   its gradient 27.1 vs 26.6 (a loop's carry shares its initial value's buffer, an elementwise kernel writes
#   over an operand that dies there, and a carry that flows into an output is the output's allocation).
#   The plain gradient, 98.1 vs 128.0 in XLA's order (70.1 in program order), short of it because XLA:CPU fuses the
#   scale and the softmax's division into library (YNN) product fusions and materialises their broadcast operands
#   at N x N (a broadcast of 0.125 among them), which the model, fusing nothing into a product, does not.
#   Misses (xfail): dot_product_attention's gradient, 128.1 vs 100.1 (134.1 in program order). Plain attention's
#   forward, 34.0 vs 0.0 by memory_analysis alone: XLA compiles its product, softmax and product into one library
#   fusion whose scratch memory_analysis does not count (the process's resident memory does: 40 MiB a call at
#   N=1024, benchmarks/results/library_scratch.md); XLA's side counts it (benchmarks.library_scratch, read from the
#   compiled HLO: 32 MiB), so 34.0 vs 32.0 (the model's k^T, 2 MiB, XLA's product reads as it is). The blocked
#   gradient whose backward runs over blocks of 512 queries by 256 keys (the pack's default): 20.6 vs 14.6, the
#   model above.
CASES = [
    ("dpa forward [b,h,n,d]", lambda q, k, v: jnp.swapaxes(flax_layout(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v))), 1, 2),
     BHND, True),
    ("dpa forward [b,n,h,d]", flax_layout, BNHD, True),
    ("plain gradient", grad(plain), BHND, True),
    ("dpa gradient [b,n,h,d]", grad(flax_layout), BNHD, False),
    ("plain forward (one YNN fusion)", plain, BHND, True),
    ("blocked forward", rewrite(plain, rulesets=[attention]), BHND, True),
    ("blocked gradient, key blocks", grad(rewrite(plain, rulesets=[attention_with(backward_query_block=None)])),
     BHND, True),
    # (a miss where the library holds all its scores; jaxlib 0.12's share of them held brings it within a quarter)
    ("blocked gradient", grad(rewrite(plain, rulesets=[attention])), BHND, "attention_scratch" in calibration.CPU),
]


_MISS = pytest.mark.xfail(strict=True, reason="a known miss of the memory model (see the comment above CASES)")


@pytest.mark.parametrize("name, fn, args", [pytest.param(n, f, a, marks=() if holds else _MISS, id=n)
                                            for n, f, a, holds in CASES])
def test_predicted_peak_is_within_a_quarter_of_xla(name, fn, args):
    # The misses run too, as strict xfails: a model that comes to hold them fails here until they are moved.
    # XLA's side: memory_analysis's temp and the library fusions' scratch it does not count (0 but for plain forward)
    want = _xla(fn, args) + scratch_bytes(jax.jit(fn).lower(*args).compile())
    got = AnalyticCost().predict_temp_bytes(jax.make_jaxpr(fn)(*args))
    assert abs(got - want) <= 0.25 * want, (got / 2 ** 20, want / 2 ** 20)


def test_seed_programs_exactly():
    # the seed benchmark's VJP: two full-size temporaries, as XLA allocates them
    assert AnalyticCost().predict_temp_bytes(jax.make_jaxpr(jax_vjp)(*ARGS)) == _xla(jax_vjp, ARGS)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_sinh_and_cosh_hold_the_two_exponentials_xla_makes_them_of(dtype):
    """JAX's VJP of ising's free energy, ``-log(2 cosh(b h)) / b`` (``benchmarks/derivatives.py``): XLA:CPU
    computes ``cosh`` and ``sinh`` of one argument from ``exp(x + log(1/2))`` and ``exp(log(1/2) - x)`` (in float32
    for a 16-bit argument), and stores both for the two kernels that read them, where the model stored ``cosh``
    alone: 2.0 MiB predicted against XLA's 4.0 at ``[32, 256, 64]`` float32 (``cost.transcendental.as_exponentials``).
    (The VJP with the forward's value XLA holds in 6.0 MiB, which the model reads as 2.0 in the order the kernels
    were made and 4.0 in that of their users: ``grad.decide.held_alone``.)"""
    from benchmarks.derivatives import ising

    x, a, g = (v.astype(dtype) for v in (jnp.ones((32, 256, 64)) * 0.3, jnp.full((64,), 1.5), jnp.ones((32, 256, 64))))

    def vjp(x, a, g):
        return jax.vjp(ising, x, a)[1](g)

    want = _xla(vjp, (x, a, g))
    got = AnalyticCost().predict_temp_bytes(jax.make_jaxpr(vjp)(x, a, g))
    assert abs(got - want) <= 1024, (got, want)


def _written(closed):
    """The variables each equation of ``closed`` writes, in order (a variable twice: a program that is not one)."""
    return [v for e in closed.jaxpr.eqns for v in e.outvars]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_each_argument_of_sinh_and_cosh_has_its_own_exponentials(dtype):
    """Two arguments of one type, each read by ``sinh`` and ``cosh``, under ``jax.grad``: the program the memory
    model sizes (``memory.as_xla_simplifies``) makes two exponentials per argument, each written once. JAX hands back
    one trace for a function traced again at the same types, and the forms were inlined with its variables, so the
    second argument's wrote the first's again (JAX's VJP of this held 0.44 MiB predicted, 0.31 so)."""
    from rewrite.cost.memory import as_xla_simplifies

    def f(x, y):
        return jnp.sum(jnp.cosh(x) * jnp.sinh(y) + jnp.cosh(y) - jnp.sinh(x))

    x = jax.ShapeDtypeStruct((64, 128), dtype)
    for closed in (jax.make_jaxpr(f)(x, x), jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, x)):
        simple = as_xla_simplifies(closed)
        written = _written(simple)
        assert len(written) == len(set(written))
        assert sum(e.primitive.name == "exp" for e in simple.jaxpr.eqns) == 4  # two for each argument
        assert not any(e.primitive.name in ("sinh", "cosh") for e in simple.jaxpr.eqns)


def test_sinh_and_cosh_whose_forms_hold_constants_are_sized_as_written(monkeypatch):
    """A form that cannot be inlined (here a ``sinh`` whose trace holds a constant) leaves its argument's members as
    written and makes none of its exponentials, which nothing would read."""
    from rewrite.cost import transcendental
    from rewrite.cost.memory import as_xla_simplifies

    table = np.arange(64 * 128, dtype=np.float32).reshape(64, 128)
    monkeypatch.setattr(transcendental, "_sinh_of", lambda x, up, down: (up - down + jnp.asarray(table) * 0))
    forgotten = getattr(transcendental, "_forms", None)  # (the forms traced once per type, forgotten around it)
    forgotten = forgotten.cache_clear if forgotten is not None else lambda: None
    forgotten()
    try:
        closed = jax.make_jaxpr(lambda x: jnp.sum(jnp.cosh(x) + jnp.sinh(x)))(jnp.ones((64, 128)))
        simple = as_xla_simplifies(closed)
        names = [e.primitive.name for e in simple.jaxpr.eqns]
        assert "sinh" in names and "cosh" in names and "exp" not in names
    finally:
        forgotten()


def test_memory_budget_picks_the_fastest_program_that_fits():
    # Priced on time alone the rewritten VJP merges its two reductions and holds two full-size temporaries;
    # a budget of one and a half keeps it to one, whatever the time.
    full = B * T * C * 4
    # (at the table's prices as measured, on loops split across the cores: its loops, 8K elements, run on one, and
    # with their arithmetic priced so, loop_serial, time alone keeps the reductions apart too)
    time_only = rewrite(jax_vjp, rulesets=[derivatives], cost_model=AnalyticCost(memory=0.0, loop_serial=1.0))
    budget = rewrite(jax_vjp, rulesets=[derivatives],
                     cost_model=AnalyticCost(memory=0.0, memory_budget=1.5 * full, loop_serial=1.0))
    assert _xla(time_only, ARGS) >= 2 * full
    assert _xla(budget, ARGS) <= 1.5 * full
    np.testing.assert_allclose(jax.jit(budget)(*ARGS)[1], jax_vjp(*ARGS)[1], rtol=2e-5)


def test_a_budget_nothing_fits_chooses_the_leanest():
    tiny = AnalyticCost(memory=0.0, memory_budget=1.0)
    f = rewrite(jax_vjp, rulesets=[derivatives], cost_model=tiny)
    assert _xla(f, ARGS) <= _xla(jax_vjp, ARGS)


def test_explain_names_what_the_budget_excluded():
    # The merged reductions are the candidate over the budget; derivatives takes merges only where they save 1%
    # (SUMS_MIN_SAVING), and then extracts again without them, so its rules are taken here without that floor.
    full = B * T * C * 4
    anywhere = Ruleset("derivatives_without_floor", list(derivatives), soundness="identity",
                       tolerance=derivatives.tolerance)
    report = explain(jax_vjp, *ARGS, rulesets=[anywhere], cost_model=AnalyticCost(memory=0.0, memory_budget=1.5 * full))
    assert report.excluded_by_budget and all(c["predicted_temp_bytes"] > 1.5 * full for c in report.excluded_by_budget)
    assert "excluded by the memory budget" in report.summary()
    assert explain(jax_vjp, *ARGS, rulesets=[derivatives]).excluded_by_budget == []


def test_extraction_prices_a_loop_bodys_temporaries():
    # In the e-graph a loop's body is a class, not a jaxpr in its params: extraction must still count the
    # blocked body's scores. A budget below them excludes the blocked program too, and says so.
    q = k = v = jnp.ones((1, 1024, 64))
    tight = explain(plain, q, k, v, rulesets=[attention], cost_model=AnalyticCost(memory_budget=2 ** 20))
    blocked = [c for c in tight.excluded_by_budget if c["rewritten"]]
    assert blocked and blocked[0]["predicted_temp_bytes"] > 2 ** 20
    fits = explain(plain, q, k, v, rulesets=[attention], cost_model=AnalyticCost(memory_budget=4 * 2 ** 20))
    assert fits.result.rewritten and [c["rewritten"] for c in fits.excluded_by_budget] == [False]


@pytest.mark.parametrize("bad", [-1, -1.5e9, 0, 0.0, float("nan"), -float("inf"), "1GB", True])
def test_a_budget_that_is_not_a_positive_byte_count_is_refused(bad):
    # a negative, zero or NaN budget used to be accepted silently: every program priced over it
    with pytest.raises(ValueError, match="memory_budget"):
        AnalyticCost(memory_budget=bad)

    class Custom(CostModel):  # a model of the user's own, whose budget memory.py reads by attribute
        memory_budget = bad

        def __call__(self, node):
            return 1.0

    with pytest.raises(ValueError, match="memory_budget"):
        rewrite(jnp.sin, rulesets=[derivatives], cost_model=Custom())


@pytest.mark.parametrize("ok", [None, 1, 2.5e9, float("inf")])
def test_a_positive_budget_is_accepted(ok):
    f = rewrite(jnp.sin, rulesets=[derivatives], cost_model=AnalyticCost(memory_budget=ok))
    np.testing.assert_allclose(f(jnp.ones(3)), jnp.sin(jnp.ones(3)))


def test_a_loop_read_by_a_kernel_is_sized_without_its_price():
    """A kernel that reads a one-output loop's result: the peak is predicted from sizes alone (a loop's node price
    needs its body's, which a prediction from a jaxpr does not have), and agrees with XLA's to a kilobyte."""
    def fn(x):
        return jnp.sin(jax.lax.scan(lambda c, y: (c, jnp.cos(y)), (), x)[1]) * 2.0

    x = jnp.ones((64, 4096))
    assert abs(AnalyticCost().predict_temp_bytes(jax.make_jaxpr(fn)(x)) - _xla(fn, (x,))) <= 1024


# ---------------------------------------------------------------------- never more memory than the input
def _seed000_grad():
    from tests.corpus import corpus

    return next((f, a) for n, f, a in corpus() if n == "seed000_grad")


def test_a_cheaper_rewrite_that_holds_more_is_not_chosen():
    """Seed 000's gradient at a small size: merging its two reductions into one is priced cheaper, but it
    keeps ``sin`` and the ``grad x`` product alive together (XLA: 32,800 bytes of temporaries against the input
    program's 16,416). The input's peak bounds the choice, so the two reductions stay (``_no_fatter``)."""
    from rewrite.cost.model import priced_with
    from tests.golden import cost_table

    fn, args = _seed000_grad()
    with priced_with(cost_table()):
        kept = rewrite(fn, rulesets=[derivatives], cache=False)
        time_only = rewrite(fn, rulesets=[derivatives], cost_model=AnalyticCost(memory=0.0), cache=False)
        assert _xla(kept, args) <= _xla(fn, args) + 4096
        # Priced for time alone the merged reduction is chosen, and it holds more: what the bound prevents.
        assert _xla(time_only, args) > _xla(fn, args) + 4096
    np.testing.assert_allclose(jax.jit(kept)(*args)[1], jax.jit(fn)(*args)[1], rtol=1e-5, atol=1e-5)


def test_a_mixtures_gradient_holds_no_more_than_jaxs():
    """distrax's ``MixtureSameFamily`` negative log-likelihood, differentiated: the rewrite that merges its
    three ``[N, K, D]`` reductions held one more such array (424 -> 552 KiB) for no measured speed."""
    distrax = pytest.importorskip("distrax")
    from benchmarks.wholestep import packs

    K, Dm, Nm = 8, 4, 1024
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"logits": jax.random.normal(k[0], (K,)), "loc": jax.random.normal(k[1], (K, Dm)),
         "log_scale": 0.1 * jax.random.normal(k[2], (K, Dm))}
    x = jax.random.normal(k[3], (Nm, Dm))

    def nll(p, x):
        mix = distrax.MixtureSameFamily(distrax.Categorical(logits=p["logits"]),
                                        distrax.MultivariateNormalDiag(p["loc"], jnp.exp(p["log_scale"])))
        return -jnp.mean(mix.log_prob(x))

    got = jax.grad(rewrite(nll, rulesets=packs(), cache=False))
    assert _xla(got, (p, x)) <= _xla(jax.grad(nll), (p, x))
    for a, b in zip(jax.tree_util.tree_leaves(jax.jit(got)(p, x)), jax.tree_util.tree_leaves(jax.grad(nll)(p, x))):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------------- a reshape that keeps row-major order
RN, RV, RC, RB = 512, 8192, 64, 4


def _blocks(x):  # a row-major reshape into token blocks (the LM head's loop over a dense target reads one)
    return x.reshape(RB, x.shape[0] // RB, x.shape[1])


def _stacked(x, w):  # a loop over token blocks whose stacked output is reshaped back and read by a product
    ys = jax.lax.scan(lambda c, xb: (c, jnp.exp(xb) * 2.0), (), _blocks(x))[1]
    return ys.reshape(x.shape) @ w


# (name, the input's shape, with the reshape, the same program without it): XLA bitcasts the reshape
BITCASTS = [
    ("an input reshaped for a product", (RN, RV), lambda x, w: _blocks(x) @ w, lambda x, w: x @ w),
    ("a computed value reshaped for a product", (RN, RV), lambda x, w: _blocks(jnp.exp(x)) @ w,
     lambda x, w: jnp.exp(x) @ w),
    ("an axis of size 1 added", (RN, RV), lambda x, w: jnp.exp(x)[None] @ w, lambda x, w: jnp.exp(x) @ w),
    ("an axis of size 1 squeezed", (1, RN, RV), lambda x, w: jnp.squeeze(jnp.exp(x), 0) @ w, None),
    ("a loop's stacked output reshaped back", (RN, RV), _stacked, None),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name, shape, fn, without", BITCASTS, ids=[c[0] for c in BITCASTS])
def test_a_reshape_that_keeps_row_major_order_holds_nothing(name, shape, fn, without, dtype):
    """XLA makes a ``bitcast`` of a reshape that keeps row-major order: no kernel, its operand's bytes. The
    model predicts the peak ``memory_analysis`` reports (before, a kernel copied the reshape into a buffer of
    its own: an input's reshape held 16 MiB where XLA holds none) and prices the program as the one without
    the reshape. (In half precision XLA:CPU widens a product's operands, which the model does not: there the
    two programs are compared, not XLA.)"""
    args = (jnp.ones(shape, dtype), jnp.ones((RV, RC), dtype))
    model = AnalyticCost()
    got = model.predict_temp_bytes(jax.make_jaxpr(fn)(*args))
    if dtype == "float32":
        assert "bitcast(" in jax.jit(fn).lower(*args).compile().as_text()
        want = _xla(fn, args)
        assert abs(got - want) <= 0.02 * want + 64 * 1024, (got / 2 ** 20, want / 2 ** 20)
    if without is not None:
        price = lambda f: model.program(Program.from_jaxpr(jax.make_jaxpr(f)(*args), model))  # noqa: E731
        assert got == model.predict_temp_bytes(jax.make_jaxpr(without)(*args))
        # the same kernels: only the node model's tie-break price of one more equation between them
        assert price(without) <= price(fn) <= price(without) * 1.001, (price(fn), price(without))


def test_a_loop_s_stacked_output_reshaped_as_an_output_is_not_copied():
    """A loop's stacked output reshaped back to ``[n, v]`` and returned: XLA writes the loop's output into the
    program's output (a bitcast), where the model copied it into an output of its own and held the stacked
    array as a temporary (256 MiB predicted at this size, against XLA's 132 bytes)."""
    def fn(x):
        return jax.lax.scan(lambda c, xb: (c, jnp.exp(xb) * 2.0), (), _blocks(x))[1].reshape(x.shape)

    x = jnp.ones((4 * RN, 2 * RV))
    assert abs(AnalyticCost().predict_temp_bytes(jax.make_jaxpr(fn)(x)) - _xla(fn, (x,))) <= 1024


@pytest.mark.parametrize("name, fn, args", [pytest.param(n, f, a, id=n) for n, f, a, _ in CASES[:6]])
def test_the_fresh_charge_schedules_no_program_that_cannot_reach_its_threshold(name, fn, args, monkeypatch):
    """``scheduled_peak(..., below=)`` (what ``FusionModel.held_bytes`` asks, with the fresh charge's threshold)
    gives the peak it gives without a threshold, or 0 where that peak is under the threshold; it schedules
    nothing (no ``_peak_in``) where every temporary held at once, each once, stays under it."""
    from rewrite.cost import memory

    model = AnalyticCost()
    fm = model.fusion_model()
    prog = Program.from_jaxpr(jax.make_jaxpr(fn)(*args), model)
    kernels = fm.kernels(prog)
    full = memory.scheduled_peak(prog, kernels, fm.inner)
    assert full > 0, name
    calls = []
    real = memory._peak_in
    monkeypatch.setattr(memory, "_peak_in", lambda *a, **k: calls.append(1) or real(*a, **k))
    for below in (full / 2, full, full + 1, 4 * full, 64 * full):
        got = memory.scheduled_peak(prog, kernels, fm.inner, below)
        assert got in (full, 0) and (got == full or full < below), (name, below, got, full)
    calls.clear()
    assert memory.scheduled_peak(prog, kernels, fm.inner, 2 ** 62) == 0 and not calls
    assert memory.scheduled_peak(prog, kernels, fm.inner, full) == full and calls


def test_which_operand_a_kernel_writes_over_does_not_depend_on_the_order_it_lists_its_reads():
    """An elementwise kernel writes in place over the first operand of its shape that dies there, first in program
    order: extraction's live program lists a kernel's reads in the order its edits made them, the whole program in
    op order, and both must predict one peak (on jax 0.12 they differed by one buffer after a move)."""
    from jax import core

    from rewrite.cost.fusion import Fusion
    from rewrite.cost.memory import liveness_peak, scheduled_peak
    from rewrite.cost.program import Op
    from rewrite.ir import primitives as P

    n, k, m = (core.ShapedArray(s, jnp.float32) for s in ((256,), (64,), (64, 256)))

    def op(prim, family, args, out):
        return Op(prim, family, {}, tuple(args), tuple(out for _ in args), (out,))

    # t = exp(x); w = sin(y); u = w.sum(1); d = u @ z; out = t + d. Written over t, t is the output's buffer and
    # holds nothing while w is alive; written over d (a product's output, which writes over nothing itself), t is
    # a temporary alive across w's kernels: 1,024 bytes more at the peak
    prog = Program([op("param", P.SPECIAL, (), n), op("param", P.SPECIAL, (), m), op("param", P.SPECIAL, (), m),
                    op("exp", P.TRANSCENDENTAL, (0,), n), op("sin", P.TRANSCENDENTAL, (1,), m),
                    op("reduce_sum", P.REDUCE, (4,), k), op("dot_general", P.CONTRACT, (5, 2), n),
                    op("add", P.ELEMENTWISE, (3, 6), n)], [7])
    kernels = [Fusion(3, "loop", [3], [0], 0.0), Fusion(4, "loop", [4], [1], 0.0),
               Fusion(5, "reduce", [5], [4], 0.0), Fusion(6, "dot", [6], [5, 2], 0.0)]
    for reads in ([3, 6], [6, 3]):
        ks = kernels + [Fusion(7, "loop", [7], reads, 0.0)]
        assert liveness_peak(prog, ks) == 64 * 256 * 4 + 64 * 4, reads
        assert scheduled_peak(prog, ks) == 64 * 256 * 4 + 64 * 4, reads


# ---------------------------------------------------------------------- the order XLA:CPU runs a program's kernels in
def _seed_vjp_sin_stored(x, a, g, value=False):
    """JAX's VJP of seed 000 with ``sin`` stored as ``rulesets._sincos`` stores it (a ``select`` no loop copies):
    the ``cos`` loop is listed before the reduction that last reads the stored ``select``."""
    from rulesets._sincos import stored_sin

    d = a[None, None, :]
    e = d * x
    s, c = stored_sin(e), jnp.cos(e)
    h = s * s
    sc = g / d * (2 * s) * c
    grads = d * sc, (sc * x).sum((0, 1)) - (g * d ** -2 * h).sum((0, 1))
    return (h / d, *grads) if value else grads


_SEED = (jnp.linspace(-3.0, 3.0, 32 * 16 * 64).reshape(32, 16, 64), jnp.linspace(0.5, 2.0, 64),
         jnp.cos(jnp.linspace(-3.0, 3.0, 32 * 16 * 64)).reshape(32, 16, 64))


def _program_order(fn, args):
    from rewrite.cost.memory import liveness_peak

    fm = AnalyticCost().fusion_model()
    fm.tiebreak = None
    prog = Program.from_jaxpr(jax.make_jaxpr(fn)(*args), None)
    return liveness_peak(prog, fm.kernels(prog), fm.inner)


def test_the_peak_is_read_in_the_order_xla_runs_the_kernels():
    """XLA:CPU runs a program's kernels breadth first from its inputs (``cost.memory.xla_order``), not in the order
    the program lists them: here the reduction that last reads the stored ``select`` runs before the ``cos`` loop,
    which then writes over it. In program order both are held (262,144 bytes at this size); XLA holds one
    (131,328), and so is the peak predicted."""
    want = _xla(_seed_vjp_sin_stored, _SEED)
    assert AnalyticCost().predict_temp_bytes(jax.make_jaxpr(_seed_vjp_sin_stored)(*_SEED)) == want
    assert _program_order(_seed_vjp_sin_stored, _SEED) >= 2 * want - 1024


def test_a_temporary_that_dies_before_an_output_is_written_holds_the_output_s_bytes():
    """With the primal output too, ``sin**2`` is stored for the reduction and dies before the gradient of ``x`` is
    written: XLA gives it that output's allocation, so it is no temporary (131,328 bytes, program order 262,144)."""
    fn = lambda *v: _seed_vjp_sin_stored(*v, value=True)  # noqa: E731
    want = _xla(fn, _SEED)
    assert AnalyticCost().predict_temp_bytes(jax.make_jaxpr(fn)(*_SEED)) == want
    assert _program_order(fn, _SEED) >= 2 * want - 1024


def test_a_reduction_of_a_broadcast_reduces_before_it_broadcasts():
    """XLA's simplifier reduces a broadcast over the axes it did not add as the broadcast of the reduction of its
    operand (``cost.memory.as_xla_simplifies``): the ``[N, K, D]`` broadcast is never made, and the ``[N, K]``
    value is stored for the two reductions (32,768 bytes, 32,800 on jax 0.12; 131,072 predicted before)."""
    def fn(y, w):
        z = jnp.broadcast_to(jax.lax.select(y > 0, jnp.exp(y), y)[:, :, None], (*y.shape, 4))
        return z.sum(0), (z * w).sum(0)

    args = (jnp.linspace(-1.0, 1.0, 1024 * 8).reshape(1024, 8), jnp.ones((1024, 8, 4)))
    want = _xla(fn, args)
    assert abs(AnalyticCost().predict_temp_bytes(jax.make_jaxpr(fn)(*args)) - want) <= 4096
    assert _program_order(fn, args) >= 4 * want - 4096  # the broadcast, as program order prices it


def _dead_equation(x):
    jnp.tanh(x @ x.T)  # read by nothing
    return jnp.exp(x) @ x  # exp(x) is stored for the product


def _dead_call_output(x):
    _, e = jax.jit(lambda x: (jnp.tanh(x @ x.T), jnp.exp(x)))(x)  # the call's first output read by nothing
    return e @ x


@pytest.mark.parametrize("fn", [_dead_equation, _dead_call_output])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_equation_nothing_reads_holds_nothing(fn, dtype):
    """JAX's trace keeps equations whose values nothing reads (a joint program traced at some of its inputs holds
    dozens, and ``jit`` calls some of whose outputs nothing reads); XLA drops them. So does the peak
    (``cost.memory.without_dead``): a dead ``[512, 512]`` product and its ``tanh``, as an equation or a call's
    output, were predicted to hold 1 MiB more (0.5 MiB in bfloat16) than XLA's temporaries, the stored ``exp``.
    The charge a price reads (``predict_peaks``' second) drops them too, as the price itself does: the program's
    price, and both peaks, are the program's without them."""
    from rewrite.jaxpr.dce import dce
    from rewrite.pipeline import program_cost

    args = (jnp.linspace(-1.0, 1.0, 512 * 512, dtype=dtype).reshape(512, 512),)
    closed = jax.make_jaxpr(fn)(*args)
    live = dce(closed)
    assert str(live) != str(closed)
    model = AnalyticCost()
    assert model.predict_peaks(closed) == model.predict_peaks(live)
    assert model.predict_temp_bytes(closed) == 512 * 512 * jnp.dtype(dtype).itemsize
    if dtype == jnp.float32:  # (XLA:CPU runs a bfloat16 product in float32, with temporaries of its own)
        assert model.predict_temp_bytes(closed) == _xla(fn, args)
    assert program_cost(closed, model) == program_cost(live, model)


@pytest.mark.parametrize("fn, args", [pytest.param(_seed_vjp_sin_stored, _SEED, id="seed vjp"),
                                      pytest.param(CASES[2][1], CASES[2][2], id="plain attention gradient")])
def test_a_live_program_s_peak_walks_it_once_per_version(fn, args, monkeypatch):
    """``scheduled_peak`` of extraction's live program (``cost.live.LiveFusion``) reads the order XLA's fusion pass
    makes kernels in (``memory._made_at``) from the postorder its positions walked: one walk per version of the
    program (it walked twice: for the positions, then ``_made_at``'s own), giving the order and the peak the
    separate walk gives; and none where the schedule is asked under a threshold (``below``) that every temporary held
    at once stays under (``memory._all_at_once``: the fresh charge's 0, read before the kernels are put in order)."""
    from types import SimpleNamespace

    from rewrite.cost import memory
    from rewrite.cost.live import LiveFusion

    fm = AnalyticCost().fusion_model()
    prog = Program.from_jaxpr(jax.make_jaxpr(fn)(*args), AnalyticCost())
    live = LiveFusion(fm, prog.outputs)
    live.edit(dict(enumerate(prog.ops)))
    peak = memory.scheduled_peak(live, live.kernels(), fm.inner)
    assert peak > 0 and live.walks == 1
    assert memory.scheduled_peak(live, live.kernels(), fm.inner) == peak and live.walks == 1  # the same version
    assert memory._made_at(live) == memory._made_at(SimpleNamespace(ops=live.ops, outputs=live.outputs))
    monkeypatch.setattr(LiveFusion, "made_at", None)  # the walk of its own, as before
    assert memory.scheduled_peak(live, live.kernels(), fm.inner) == peak
    live.edit({prog.outputs[0]: prog.ops[prog.outputs[0]]})  # a new version: walked again
    # but not for a schedule under a threshold no peak of its temporaries can reach (the fresh charge's, below)
    assert memory.scheduled_peak(live, live.kernels(), fm.inner, 2 ** 62) == 0 and live.walks == 1
    live.positions()
    assert live.walks == 2


@pytest.mark.parametrize("fresh_at", [0.0, float("inf")], ids=["charged", "under the threshold"])
def test_a_live_program_lists_its_kernels_for_the_fresh_charge_only_where_it_is_charged(fresh_at, monkeypatch):
    """``LiveFusion.price`` hands ``FusionModel.held_bytes`` a function that lists its kernels, called only where
    the temporaries can reach the fresh charge's threshold (``fresh_at``): a search prices hundreds of programs
    under it, each of which listed every kernel for nothing. The price is the whole program's either way."""
    from rewrite.cost.live import LiveFusion

    fm = AnalyticCost().fusion_model()
    assert fm.fresh and fm.held is not None
    fm.fresh_at = fresh_at
    prog = Program.from_jaxpr(jax.make_jaxpr(_seed_vjp_sin_stored)(*_SEED), AnalyticCost())
    live = LiveFusion(fm, prog.outputs)
    live.edit(dict(enumerate(prog.ops)))
    listed = []
    kernels = LiveFusion.kernels
    monkeypatch.setattr(LiveFusion, "kernels", lambda self: listed.append(1) or kernels(self))
    assert live.price() == pytest.approx(fm(prog), rel=1e-12)
    assert len(listed) == (1 if fresh_at == 0.0 else 0)


@pytest.mark.parametrize("T", [64, 512])
def test_a_dynamic_update_slice_writes_its_update_in_place(T):
    """Seed 000's kernel backward (``rulesets/kernels/sin_squared.py``): 32 blocks, each a ``[..., 3]`` array reduced
    and its first slot put into ``grad x`` with ``dynamic_update_slice``. Each update is a kernel of its own that
    writes over its operand's buffer, so one block's array is held at a time; where the updates fused into one
    kernel at the end, every block's array was held: 12 MiB predicted at T=512 against 0.38 compiled."""
    from benchmarks.derivatives import inputs
    from rulesets.kernels.sin_squared import sin_squared_over

    x, a, g = inputs(T)
    fn = lambda x, a, g: jax.vjp(sin_squared_over, x, a.reshape(1, 1, -1))[1](g)  # noqa: E731
    want = _xla(fn, (x, a, g))
    got = AnalyticCost().predict_temp_bytes(jax.make_jaxpr(fn)(x, a, g))
    assert abs(got - want) <= 0.5 * want, (got / 2 ** 20, want / 2 ** 20)


def test_a_dynamic_update_slice_chain_read_by_one_loop_is_fused_into_it():
    """The same kernel in a step that updates ``x`` with its gradient (``x - 0.01 * grad x``, issue 50's form C):
    XLA:CPU fuses the 32 updates into that one loop (``multiply_subtract_fusion``), which reads every block's
    ``[..., 3]`` array, so all 32 are held until it runs: 12.02 MiB at T=512 (48 at 2048, 192 at 8192), predicted
    0.52 MiB as 32 in-place updates (8 at T=8192, where the step took the kernel and ran 0.85-0.89x as written)."""
    from rulesets.kernels.sin_squared import sin_squared_over

    def step(a, x):
        l, (ga, gx) = jax.value_and_grad(lambda a, x: jnp.sum(sin_squared_over(x, a.reshape(1, 1, -1))), (0, 1))(a, x)
        return a - 0.01 * ga, x - 0.01 * gx, l

    k = jax.random.key(0)
    a, x = jax.random.uniform(k, (64,), minval=0.5, maxval=2.0), jax.random.normal(k, (32, 512, 64))
    want = _xla(step, (a, x))
    got = AnalyticCost().predict_temp_bytes(jax.make_jaxpr(step)(a, x))
    assert want > 2 * x.nbytes and abs(got - want) <= 0.25 * want, (got / 2 ** 20, want / 2 ** 20)



def _dense_transposed(w, x, b, v):  # JAX's dense layer under vmap: the product as [out, batch], then transposed
    return jnp.tanh(jax.lax.dot_general(w, x, (((1,), (1,)), ((), ()))).T + b) @ v


def _unit_transposed(x, w, p, v):  # a [1, N] input read as [N, 1]: a transpose of an axis of size 1
    return jnp.tanh(x @ w + p.T) @ v


def _unit_reshaped(x, w, p, v):
    return jnp.tanh(x @ w + p.reshape(512, 1)) @ v


_K = jax.random.split(jax.random.PRNGKey(0), 4)


@pytest.mark.parametrize("fn, shapes", [
    (_dense_transposed, [(256, 32), (512, 32), (256,), (256, 64)]),
    (_unit_transposed, [(512, 32), (32, 256), (1, 512), (256, 64)]),
    (_unit_reshaped, [(512, 32), (32, 256), (1, 512), (256, 64)]),
], ids=["a product transposed", "an axis of size 1 moved", "a bitcast"])
def test_an_elementwise_kernel_writes_in_place_through_what_xla_reads_as_stored(fn, shapes):
    """An elementwise kernel writes over an operand of its size that dies there even where it reads it through a
    transpose XLA does not compute: a product's result transposed (XLA's simplifier folds it into the product,
    stored as ``[512, 256]``), a transpose that moves only an axis of size 1, a bitcast. XLA holds one
    ``[512, 256]`` array (524,288 bytes); the model held two (1,048,576) before."""
    args = [jax.random.normal(k, s) for k, s in zip(_K, shapes)]
    want = _xla(fn, args)
    assert want == 512 * 256 * 4
    assert AnalyticCost().predict_temp_bytes(jax.make_jaxpr(fn)(*args)) == want

def _scheduled(closed, users):
    from rewrite.cost.memory import as_xla_simplifies, scheduled_peak

    fm = AnalyticCost().fusion_model()
    fm.tiebreak = None
    prog = Program.from_jaxpr(as_xla_simplifies(closed), None)
    return scheduled_peak(prog, fm.kernels(prog), fm.inner, users=users)


def test_the_schedule_can_follow_xla_s_lists_of_users():
    """XLA:CPU's ``BFScheduler`` pushes a kernel's readers in the order of its ``users()`` list, which the fusion
    pass leaves in no creation order: a kernel appended as a reader, the op it absorbs removed by moving the last
    reader into its slot (``cost.memory._users_rank``). The flax classifier's chosen program (the decision
    corpus's ``ecosystem_flax_classifier_onehot``): 2,072,576 bytes compiled; read in the order the kernels were
    made, 1,813,504 (-12.5%); in the users' order, XLA's own figure. Not the default: over the corpus it orders
    the pairs no better (``benchmarks/results/log.md``, branch h-sched)."""
    from benchmarks import decisions as D

    d = D.decide(D.select(["ecosystem_flax_classifier_onehot"])[0], programs=True, declined=False)
    closed = jax.make_jaxpr(d.variants["rewritten"])(*d.args)
    want = jax.jit(d.variants["rewritten"]).lower(*d.args).compile().memory_analysis().temp_size_in_bytes
    assert abs(_scheduled(closed, users=True) - want) <= 4096
    assert _scheduled(closed, users=False) < 0.9 * want


def _random_program(draw):
    """A program of elementwise work, reductions, broadcasts, products, transposes, reshapes, in-place updates and
    loops (two carries from one value among them), and a value read again after kernels that depend on it but do not
    read it (live across them in every order), on a few shapes (one 16 times the others), returning some of its
    values."""
    from hypothesis import strategies as st

    s = 16
    pool = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((s, s), (s, s), (s,), (s, 2 * s), (4 * s, 4 * s))]
    steps = draw(st.lists(st.tuples(st.integers(0, 11), st.integers(0, 10 ** 6), st.integers(0, 10 ** 6)),
                          min_size=1, max_size=14))
    outs = draw(st.lists(st.integers(0, 10 ** 6), min_size=1, max_size=3))
    summed = draw(st.booleans())  # a loss: temporaries of every size but a scalar's

    def fn(*args):
        vals = list(args)

        def pick(i, shape=None):
            of = [v for v in vals if shape is None or v.shape == shape]
            return of[i % len(of)] if of else None

        for kind, i, j in steps:
            a = pick(i)
            b = pick(j, a.shape)
            if kind == 0:
                vals.append(jnp.sin(a))
            elif kind == 1:
                vals.append(a * b + 1.0)
            elif kind == 2 and a.ndim == 2:
                vals.append(jnp.sum(a, axis=j % 2))
            elif kind == 3 and a.ndim == 1:
                m = pick(j, (a.shape[0], s))
                vals.append(a[:, None] * m if m is not None else jnp.exp(a))
            elif kind == 4 and a.ndim == 2 and a.shape[1] == s:
                vals.append(a @ pick(j, (s, s)))
            elif kind == 5 and a.ndim == 2:
                vals.append(a.T)
            elif kind == 6:
                vals.append(a.reshape(-1))
            elif kind == 7:
                def body(c, _):
                    return (jnp.tanh(c[0]) + c[1], c[1] * 0.5), None

                c0, c1 = jax.lax.scan(body, (a, a if j % 2 else b), None, length=3)[0]
                vals += [c0, c1]
            elif kind == 8 and a.ndim == 2:
                vals.append(jax.lax.dynamic_update_slice(a, jnp.ones((2, 2), a.dtype), (1, 1)))
            elif kind >= 10:  # t is live across the kernels between its reduction and its next reader
                t = jnp.sin(a if kind == 10 else pick(i, (4 * s, 4 * s)))
                m = pick(j, (s, s))
                vals.append(t * jnp.sum((m * jnp.sum(t)) @ m))
            else:
                vals.append(jnp.cos(a) * a)
        return tuple(jnp.sum(vals[k % len(vals)]) if summed else vals[k % len(vals)] for k in [*outs, -1])

    return fn, pool


def test_the_peak_s_floor_is_under_the_peak_of_random_programs():
    """``cost.floor.peak_floor``, which the lean pass reads before it schedules a moved program
    (``LiveProgram.held``), is at most the scheduled peak, in either order XLA's schedule is read in, and at most the
    peak in program order, on random programs; with ``above``, it returns at once with a floor over it, or the
    floor. Its buffers live across a kernel that neither reads nor writes them (``floor._across``) are in it: the
    random programs read earlier values again, and in some the floor is over what the kernels read and write."""
    from hypothesis import given, settings, strategies as st

    from rewrite.cost import floor as F, memory

    fm = AnalyticCost().fusion_model()
    fm.tiebreak = None
    across = []

    @settings(max_examples=200, deadline=None)
    @given(st.data())
    def check(data):
        fn, args = _random_program(data.draw)
        prog = Program.from_jaxpr(jax.make_jaxpr(fn)(*args), None)
        kernels = fm.kernels(prog)
        floor = F.peak_floor(prog, kernels, fm.inner)
        assert floor <= memory.scheduled_peak(prog, kernels, fm.inner)
        assert floor <= memory.scheduled_peak(prog, kernels, fm.inner, users=True)
        assert floor <= memory.liveness_peak(prog, kernels, fm.inner)
        for above in (0, floor - 1, floor):
            got = F.peak_floor(prog, kernels, fm.inner, above)
            assert got <= floor and (got > above) == (floor > above)
        real = F._across
        try:
            F._across = lambda *a: []
            across.append(F.peak_floor(prog, kernels, fm.inner) < floor)
        finally:
            F._across = real

    check()
    assert sum(across) >= 5, (sum(across), len(across))


def test_the_peak_s_floor_counts_once_a_size_a_loop_carries_twice_from_one_value():
    """A loop that starts two carries from one value that dies there gives that value's bytes to both
    (``cost.memory._shares``): the two are one group, held once, though a later kernel reads both. The floor
    (``peak_floor``) then counts each size once, or it would be over the peak (32 KiB against 16), the carries live
    across a kernel too."""
    from rewrite.cost import floor as F, memory

    def body(c, _):
        return (jnp.tanh(c[0]) + c[1], c[1] * 0.5), None

    def fn(x):
        a = jnp.sin(x)
        c0, c1 = jax.lax.scan(body, (a, a), None, length=3)[0]
        return jnp.sum(c0 * c1)

    fm = AnalyticCost().fusion_model()
    fm.tiebreak = None
    prog = Program.from_jaxpr(jax.make_jaxpr(fn)(jnp.ones((64, 64))), None)
    kernels = fm.kernels(prog)
    peak = memory.scheduled_peak(prog, kernels, fm.inner)
    assert F.peak_floor(prog, kernels, fm.inner) == peak == 64 * 64 * 4

    def across(x):  # the second carry is live across the reduction of the first (``floor._across``): still once
        c0, c1 = jax.lax.scan(body, (jnp.sin(x), jnp.sin(x)), None, length=3)[0]
        return jnp.sum(c1 * jnp.sum(c0, axis=0))

    prog = Program.from_jaxpr(jax.make_jaxpr(across)(jnp.ones((64, 64))), None)
    kernels = fm.kernels(prog)
    peak = memory.scheduled_peak(prog, kernels, fm.inner)
    assert F.peak_floor(prog, kernels, fm.inner) == peak == 64 * 64 * 4 + 64 * 4


def test_the_peak_s_floor_holds_a_buffer_live_across_kernels_that_do_not_read_it():
    """A language model head's logits are live across kernels that neither read nor write them: written before the
    row maximum, read again after a product that depends on it (flax_lm_step's 32 MiB logits across its
    ``stop_gradient`` and ``select_n`` kernels). The floor (``cost.floor.peak_floor``) counts a buffer written by
    an ancestor of a kernel and read by a descendant of it (``floor._across``), live there in every order: here it
    is the peak, two [256, 2048] arrays and a small one; without that term it was one and the small one, about half
    the peak, and the lean pass
    scheduled each move it weighed (flax_lm_step: 57 of 104 reads scheduled, 7 with it)."""
    from rewrite.cost import floor as F, memory

    def fn(x, w):
        logits = x @ w
        m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        other = jnp.sum((x * m) @ w, axis=-1)
        return jnp.sum(logits * other[:, None])

    fm = AnalyticCost().fusion_model()
    fm.tiebreak = None
    prog = Program.from_jaxpr(jax.make_jaxpr(fn)(jnp.ones((256, 64)), jnp.ones((64, 2048))), None)
    kernels = fm.kernels(prog)
    peak = memory.scheduled_peak(prog, kernels, fm.inner)
    assert F.peak_floor(prog, kernels, fm.inner) == peak == 2 * 256 * 2048 * 4 + 256 * 64 * 4
    assert F.peak_floor(prog, kernels, fm.inner, 0.75 * peak) > 0.75 * peak


def test_the_peaks_kernel_layout_is_the_fusion_models_kernels_without_prices():
    """``memory.kernel_layout``, which the peaks' replays read (``AnalyticCost.predict_peaks``, ``InnerPeak``) in place
    of ``FusionModel.kernels``, lists the same kernels: roots, kinds, members and reads, in the same order (only the
    prices are left out). On the attention benchmark's programs (library and attention kernels, products, loops of
    the blocked ones) and on random programs (reductions, in-place updates, loops); and the peaks read off it are
    the peaks read off the priced kernels."""
    from hypothesis import given, settings, strategies as st

    from rewrite.cost import memory

    fm = AnalyticCost().fusion_model()
    fm.tiebreak = None
    seen: set = set()

    def same(closed):
        prog = Program.from_jaxpr(closed, None)
        got, want = memory.kernel_layout(fm, prog), fm.kernels(prog)
        assert [(k.root, k.kind, k.computes, k.reads) for k in got] == [
            (k.root, k.kind, k.computes, k.reads) for k in want]
        assert memory.scheduled_peak(prog, got, fm.inner) == memory.scheduled_peak(prog, want, fm.inner)
        seen.update(k.kind for k in want)

    for _, fn, args, _ in CASES:
        same(jax.make_jaxpr(fn)(*args))

    @settings(max_examples=100, deadline=None)
    @given(st.data())
    def check(data):
        fn, args = _random_program(data.draw)
        same(jax.make_jaxpr(fn)(*args))

    check()
    assert {"loop", "reduce", "other", "attention"} <= seen, seen
