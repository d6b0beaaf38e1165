"""``benchmarks/remat_parts.py``: the kernels it times are the gelu and its derivative, in the kept form (the
``tanh`` stored) and the remat'd one (recomputed), and the cost model prices each as one loop kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import remat_parts as R


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
