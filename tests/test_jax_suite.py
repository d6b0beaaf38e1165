"""A slice of JAX's own test suite with every ``jax.jit`` routed through ``rewrite`` (benchmarks/jax_suite.py).

Slow, and skipped unless JAX's test sources are extracted into ``third_party/jax_tests`` (``python -m
benchmarks.jax_suite extract --git-dir <a clone of jax>``) and absl-py is installed (the ``jaxsuite`` extra).
The tests chosen here went through the rewriter and once failed or fell back; each must pass as it does
under plain ``jit``, with no fallback.
"""

import pytest

from benchmarks import jax_suite

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not jax_suite.available(), reason="JAX's test sources are not extracted")]

#: (file, -k selection): tests that go through the rewriter.
SLICES = [
    ("nn_test", "Standardize or OneHot or DotProductAttentionBiasGradient", False),
    ("lax_numpy_reducers_test", "testReducer", False),
]


@pytest.mark.parametrize("name,select,grads", SLICES + [
    # check_grads routed too: its function rewritten, differentiated eagerly in every order and mode
    ("lax_autodiff_test", "testOpGrad or testClampGrad or testSplitGrad or testDotGrad", True)])
def test_routed_jit_passes_what_jit_passes(name, select, grads, tmp_path, monkeypatch):
    if grads:
        monkeypatch.setenv("JAX_SUITE_ROUTE_GRADS", "1")
    plain = jax_suite.run_file(name, False, cases=1, select=select, timeout=1200, out_dir=tmp_path)["results"]
    routed = jax_suite.run_file(name, True, cases=1, select=select, timeout=1200, out_dir=tmp_path)["results"]
    figures = jax_suite.compare(plain, routed)
    assert figures["tests"] > 0 and figures["through_rewriter"] > 0
    assert figures["newly_failing"] == {}
    assert figures["fallbacks"] == {} and figures["limits"] == {}
