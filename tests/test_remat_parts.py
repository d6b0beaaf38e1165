"""``benchmarks/remat_parts.py``: the kernels it times are the gelu and its derivative, in the kept form (the
``tanh`` stored) and the remat'd one (recomputed), and the cost model prices each as one loop kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import remat_parts as R

from .golden import cost_table


def test_the_kernels_compute_the_gelu_and_its_derivative_both_ways():
    a = R._arrays(8)
    z, b, t, da = a["z"], a["b"], a["t"], a["da"]
    want_fwd = jax.nn.gelu(z + b, approximate=True)
    want_back = jax.vjp(lambda h: jax.nn.gelu(h, approximate=True), z + b)[1](da)[0]
    kernels = {n: f for n, (f, _) in R.KERNELS.items()}
    np.testing.assert_allclose(kernels["fwd_from_t"](z, b, t), want_fwd, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernels["fwd_recompute"](z, b), want_fwd, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernels["back_from_t"](z, b, t, da), want_back, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(kernels["back_recompute"](z, b, da), want_back, rtol=1e-4, atol=1e-5)
    assert set(R.KEPT) | set(R.REMAT) == set(R.KERNELS)


def test_each_kernel_is_priced_as_one_loop_kernel():
    from rewrite.cost.model import AnalyticCost
    from rewrite.cost.program import Program

    model = AnalyticCost()
    a = R._arrays(248)
    for name, (fn, names) in R.KERNELS.items():
        prog = Program.from_jaxpr(jax.make_jaxpr(fn)(*(a[n] for n in names)), model)
        assert len(model.fusion_model().kernels(prog)) == 1, name
    price = R.prices(248, model)
    assert all(p > 0 for p in price.values()) and set(price) == set(R.KERNELS)
    # the remat's forward does the kept forward's work and the tanh's: it is priced above the kept forward alone
    assert price["fwd_recompute"] > price["fwd_from_t"]


def test_split_reads_the_compiled_programs_partitions():
    assert R.split('  %f = f32[8]{0} fusion(%p), kind=kLoop, backend_config={"outer_dimension_partitions":["2"]}')
    assert not R.split("  %f = f32[8]{0} fusion(%p), kind=kLoop")
    assert not R.split(jax.jit(lambda x: x + 1.0).lower(jnp.ones((4,))).compile().as_text())


def test_overlap_prices_a_loop_kernel_the_larger_of_its_arithmetic_and_its_bytes():
    """``AnalyticCost.overlap``: gelu's kept backward, four 2 MiB arrays and sixteen cheap operations, measured
    276 us where the sum prices it 283 (bytes) + 238 (arithmetic); with the term, the larger."""
    from rewrite.cost.model import AnalyticCost

    summed = R.prices(4096, AnalyticCost(overlap=False))
    work_only = R.prices(4096, AnalyticCost(byte=0.0, overlap=False))
    over = R.prices(4096, AnalyticCost(overlap=True))
    launch = AnalyticCost().launch / 1e3
    for name in R.KERNELS:
        moved = summed[name] - work_only[name]
        assert abs(over[name] - max(work_only[name], moved + launch)) < 1e-6, name
    assert over["back_from_t"] < 0.6 * summed["back_from_t"]
    # at the flax block's 248 rows the kept form is priced below the remat's, as measured (0.82-0.85)
    small = R.prices(248, AnalyticCost(overlap=True))
    assert sum(small[n] for n in R.KEPT) < sum(small[n] for n in R.REMAT)


def test_no_table_turns_overlap_on():
    """On, the term declines ``rulesets.scan``'s hoist of ``docs/api.md``'s RNN loss, measured 1.60x faster hoisted
    (log.md, h-overlap): this CPU's table and the golden files' leave it off until loop bodies take it too."""
    from rewrite.cost import calibration
    from rewrite.cost.model import AnalyticCost, priced_with

    for table in (calibration.CPU, calibration.GPU, cost_table()):
        assert "overlap" not in table
        with priced_with(table):
            assert not AnalyticCost().overlap


def test_the_searches_live_price_takes_the_overlap_as_the_fusion_model_does():
    """``LiveFusion`` (the price extraction's searches keep up to date) prices a loop kernel as
    ``FusionModel.kernel`` does, with the term on and off: else a search ranks programs by another price."""
    from rewrite.cost.live import LiveFusion
    from rewrite.cost.model import AnalyticCost
    from rewrite.cost.program import Program

    a = R._arrays(4096)
    for overlap in (False, True):
        model = AnalyticCost(overlap=overlap)
        fm = model.fusion_model()
        for name, (fn, names) in R.KERNELS.items():
            prog = Program.from_jaxpr(jax.make_jaxpr(fn)(*(a[n] for n in names)), model)
            live = LiveFusion(fm, prog.outputs)
            live.edit(dict(enumerate(prog.ops)))
            assert abs(live.price() - fm(prog)) <= 1e-9 * fm(prog), (name, overlap)
