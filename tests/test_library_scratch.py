"""The library (YNN) fusions' scratch, which ``memory_analysis`` does not count, read from the compiled HLO
(``benchmarks/library_scratch.py``), and the decision corpus's temp gate counting it (``benchmarks/decisions.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import decisions as D
from benchmarks import harness
from benchmarks import library_scratch as L
from rewrite.cost import calibration


def _plain(q, k, v):
    return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.float32(8.0), axis=-1) @ v


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def _on_cpu() -> None:
    if jax.default_backend() != "cpu":
        pytest.skip("the library (YNN) fusions are XLA:CPU's")


def test_plain_attention_holds_its_scores_in_the_library_scratch_that_memory_analysis_does_not_count():
    _on_cpu()
    b, h, n, d = 2, 4, 512, 64
    qkv = [jax.random.normal(jax.random.PRNGKey(i), (b, h, n, d), jnp.float32) for i in range(3)]
    c = _compiled(_plain, *qkv)
    if not L.library_fusions(c.as_text()):
        pytest.skip("this XLA makes no library fusion of plain attention")
    scores = b * h * n * n * 4
    assert c.memory_analysis().temp_size_in_bytes < scores  # what the gate counted before: not the scores
    # all of them on jaxlib 0.10; jaxlib 0.12's library holds a share at once, measured by resident memory
    held = int(scores * calibration.CPU.get("attention_scratch", 1.0))
    assert L.scratch_bytes(c) == held
    _, stats = harness.compile_stats(_plain, *qkv)
    assert stats.scratch_bytes == held


def test_a_program_without_library_fusions_or_whose_chains_stream_holds_no_scratch():
    _on_cpu()
    x = jnp.ones((256, 512), jnp.float32)
    assert L.scratch_bytes(_compiled(lambda a: jnp.sin(a) * 2 + 1, x)) == 0
    # an LM head's exp(z - m) streams into its row sum: a library fusion, nothing held whole
    h, w = jnp.ones((512, 256), jnp.float32), jnp.ones((256, 4096), jnp.float32)
    assert L.scratch_bytes(_compiled(lambda h, w: jax.nn.logsumexp(h @ w, axis=-1), h, w)) <= 64 * 1024


_FUSION = """
%fused_computation (p0: f32[8,1024], p1: f32[1024,4096]) -> RESULT {
  %p0 = f32[8,1024]{1,0} parameter(0)
  %p1 = f32[1024,4096]{1,0} parameter(1)
  %s = f32[8,4096]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %c = f32[] constant(-inf)
  %m = f32[8]{0} reduce(%s, %c), dimensions={1}, to_apply=%max
  %b = f32[8,4096]{1,0} broadcast(%m), dimensions={0}
  %d = f32[8,4096]{1,0} subtract(%s, %b)
  ROOT %r = f32[8]{0} reduce(%d, %c), dimensions={1}, to_apply=%max
}

ENTRY %main (a: f32[8,1024], w: f32[1024,4096]) -> RESULT {
  %a = f32[8,1024]{1,0} parameter(0)
  %w = f32[1024,4096]{1,0} parameter(1)
  ROOT %f = RESULT fusion(%a, %w), kind=kCustom, calls=%fused_computation, BACKEND
}
""".replace("BACKEND", 'backend_config={"fusion_config":{"kind":"__ynn_fusion"}}')


def test_a_value_read_twice_inside_a_library_fusion_is_its_scratch():
    hlo = _FUSION.replace("RESULT", "f32[8]{0}")
    assert L.fusion_scratch(hlo) == {"fused_computation": 8 * 4096 * 4}  # the scores, read by the max and the sub
    assert L.scratch_bytes(hlo.replace("__ynn_fusion", "__other")) == 0  # not a library fusion
    # a result as large as the held value: computed in the result's buffer (dot_product_attention(xla)'s fusion)
    whole = hlo.replace("ROOT %r = f32[8]{0} reduce(%d, %c), dimensions={1}, to_apply=%max", "%r = f32[8]{0} "
                        "reduce(%d, %c), dimensions={1}, to_apply=%max").replace(
        "%d = f32[8,4096]{1,0} subtract(%s, %b)", "ROOT %d = f32[8,4096]{1,0} subtract(%s, %b)")
    assert L.scratch_bytes(whole) == 0


def test_the_temp_gate_counts_the_library_scratch():
    # plain attention against its blocked form: memory_analysis reads 0 -> 12.6 MiB, the scores are 32 MiB
    rec = {"temp_first": 0, "temp_second": int(12.6 * 2 ** 20), "scratch_first": 32 * 2 ** 20, "scratch_second": 0}
    assert D.holds_more(rec, scratch=False)
    assert not D.holds_more(rec)
    assert D.held(rec, "first") == 32 * 2 ** 20
    # declined though measured faster: right only where the second holds more, the scratch counted
    declined = {**rec, "prefers": "first", "measured": 1.5, "noise": 0.0}
    assert D.wrong_side(declined)
    assert not D.wrong_side({**declined, "scratch_second": 40 * 2 ** 20})
