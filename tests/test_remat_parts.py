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
    """On in this CPU's table (loop bodies taking it too), the term rewrites ``lm_head_loss_small``'s head, measured
    0.88x (the wrong side), and moves ``gymnax_cartpole_rollout`` to a program measured 0.92x (log.md, h-spear3):
    this CPU's table and the golden files' leave it off."""
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


def _docs_rnn_program(steps: int, width: int):
    from benchmarks.scan import docs_rnn, docs_rnn_args
    from rewrite.cost.program import Program

    return Program.from_jaxpr(jax.make_jaxpr(docs_rnn)(*docs_rnn_args(steps, width)), None)


def test_a_loop_bodys_loop_kernels_take_the_overlap_at_every_trip():
    """Under ``overlap`` a scan's body's loop kernels are priced as a program's are (``FusionModel.launches``: each
    kernel's price less its price summed, at every trip); off, nothing is added (the node prices sum them)."""
    from rewrite.cost.model import AnalyticCost
    from rewrite.cost.program import LOOP, Program

    prog = _docs_rnn_program(16, 128)
    (loop,) = [op for op in prog.ops if op.prim == "scan"]
    assert AnalyticCost(overlap=False).fusion_model().launches(loop) == 0.0
    fm = AnalyticCost(overlap=True).fusion_model()
    body = Program.from_jaxpr(loop.params["jaxpr"], None)
    kernels = [k for k in fm.kernels(body) if k.kind == LOOP]
    assert kernels
    saved = sum(fm.kernel(body, k.root, k.kind, k.computes, summed=True)[0] - k.cost for k in kernels)
    assert saved > 0
    assert abs(fm.launches(loop) + 16 * saved) <= 1e-9 * 16 * saved


def test_with_the_overlap_the_docs_rnn_hoist_is_still_taken():
    """``docs/api.md``'s ``rulesets.scan`` example (16 x 128), hoisted measured 1.60-1.74x faster (decisions corpus,
    ``scan_docs_rnn_16x128``): with the term on the program after the loop only, the hoist was declined at +2.3%."""
    import rulesets
    from benchmarks.scan import docs_rnn, docs_rnn_args
    from rewrite import AnalyticCost, explain

    for overlap in (False, True):
        report = explain(docs_rnn, *docs_rnn_args(16, 128), rulesets=[rulesets.scan],
                         cost_model=AnalyticCost(overlap=overlap))
        assert report.result.rewritten, overlap
        assert "hoist_reductions" in report.used, overlap


def test_the_searches_live_price_takes_a_loop_bodys_overlap_as_the_fusion_model_does():
    from rewrite.cost.live import LiveFusion
    from rewrite.cost.model import AnalyticCost

    prog = _docs_rnn_program(16, 128)
    for overlap in (False, True):
        fm = AnalyticCost(overlap=overlap).fusion_model()
        live = LiveFusion(fm, prog.outputs)
        live.edit(dict(enumerate(prog.ops)))
        assert abs(live.price() - fm(prog)) <= 1e-9 * fm(prog), overlap


def test_the_body_probe_computes_one_thing_both_ways():
    """``--bodies``: the kernel over every block at once and trip by trip in a scan give the same row sums; the
    docs' RNN loop with and without its stacked output, the same carry (``--stacked``)."""
    xs, m = R._blocks(3, 8)
    np.testing.assert_allclose(R._whole(xs, m).sum(0), R._loop(xs, m), rtol=1e-5)
    h0, xs = R._rnn(3, 16)
    np.testing.assert_allclose(R._carried(h0, xs), R._stacked(h0, xs)[0])
    assert set(R.body_prices(64)) == set(R.BODIES) and set(R.body_prices(64, None, R.STACKED, R._rnn)) == set(R.STACKED)


def test_with_loop_bytes_a_loop_bodys_loop_kernels_pay_their_bytes_at_every_trip():
    """``AnalyticCost.loop_bytes``: a scan's body's loop kernels pay, at every trip, the bytes they read and write (the
    node prices a body is priced by hold their work alone: the LM head's block body, ``exp`` over ``[rows, 512]``, was
    priced 0.29-0.55x of the clock at 64-4096 rows, ``remat_parts --bodies``), summed, not overlapped."""
    from rewrite.cost.model import AnalyticCost
    from rewrite.cost.program import LOOP, Program

    xs, m = R._blocks(16, 256)
    prog = Program.from_jaxpr(jax.make_jaxpr(R._loop)(xs, m), None)
    (loop,) = [op for op in prog.ops if op.prim == "scan"]
    body = Program.from_jaxpr(loop.params["jaxpr"], None)
    off = AnalyticCost(loop_bytes=False).fusion_model()
    free = AnalyticCost(byte=0.0).fusion_model()  # the same kernels' prices with their bytes free
    kernels = [k for k in off.kernels(body) if k.kind == LOOP]
    assert kernels
    moved = sum(off.kernel(body, k.root, LOOP, k.computes, summed=True)[0]
                - free.kernel(body, k.root, LOOP, k.computes, summed=True)[0] for k in kernels)
    assert moved > 0
    for overlap in (False, True):  # with loop_bytes, the overlap's share is not taken in a body
        on = AnalyticCost(loop_bytes=True, overlap=overlap).fusion_model()
        base = AnalyticCost(loop_bytes=False, overlap=False).fusion_model().launches(loop)
        assert abs(on.launches(loop) - base - 16 * moved) <= 1e-9 * 16 * moved, overlap


def test_the_searches_live_price_takes_a_loop_bodys_bytes_as_the_fusion_model_does():
    from rewrite.cost.live import LiveFusion
    from rewrite.cost.model import AnalyticCost
    from rewrite.cost.program import Program

    xs, m = R._blocks(16, 256)
    for prog in (_docs_rnn_program(16, 128), Program.from_jaxpr(jax.make_jaxpr(R._loop)(xs, m), None)):
        for overlap in (False, True):
            fm = AnalyticCost(loop_bytes=True, overlap=overlap).fusion_model()
            live = LiveFusion(fm, prog.outputs)
            live.edit(dict(enumerate(prog.ops)))
            assert abs(live.price() - fm(prog)) <= 1e-9 * fm(prog), overlap


def test_a_call_in_a_loop_body_runs_its_kernels_at_every_trip():
    """A call in a scan's body (the ``remat2`` that ``hoist_reductions`` wraps a body in, a ``jax.checkpoint``) runs its
    kernels at every trip as the body's own: ``FusionModel.launches`` charges them per trip (here ``loop_split``, a
    kernel of 64K elements or more, and ``loop_bytes``) as it does the same kernels unwrapped. Before, a call in a body
    was charged only for the loops in it, so a hoist's body escaped the per-trip charges its input's body paid."""
    from rewrite.cost.model import AnalyticCost
    from rewrite.cost.program import Program

    xs, m = R._blocks(8, 256)

    def wrapped(xs, m):
        body = jax.checkpoint(lambda c, x: (c + jnp.sum(jnp.exp(x - m[:, None]), axis=1), None))
        return jax.lax.scan(body, jnp.zeros(m.shape, xs.dtype), xs)[0]

    for kw in ({"loop_split": 2262.0, "loop_parallel_at": 65536.0}, {"loop_bytes": True}):
        fm = AnalyticCost(**kw).fusion_model()
        plain, inside = (Program.from_jaxpr(jax.make_jaxpr(f)(xs, m), None) for f in (R._loop, wrapped))
        (a,), (b,) = ([op for op in p.ops if op.prim == "scan"] for p in (plain, inside))
        assert fm.launches(a) > 0, kw
        assert abs(fm.launches(b) - fm.launches(a)) <= 1e-9 * fm.launches(a), kw
