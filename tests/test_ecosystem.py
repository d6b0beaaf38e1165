"""A quick subset of the ecosystem suite (``benchmarks/ecosystem.py``): real library programs keep their values.

Each program is built from a library's own modules and rewritten with the
identity packs; its outputs must match the original under ``jit`` within the
identity tolerance or ten times the original's own variation between ``jit``
and op by op. Timing is left to the benchmark.
"""

import pytest

ecosystem = pytest.importorskip("benchmarks.ecosystem")

#: small programs that cover a loop (haiku), a probabilistic model (numpyro) and an optimizer chain (optax)
QUICK = ["numpyro_mixture_logp", "optax_clip_adamw", "haiku_lstm_grad"]


@pytest.mark.parametrize("name", QUICK)
def test_values_kept(name):
    prog = ecosystem.PROGRAMS[name]
    pytest.importorskip({"dm-haiku": "haiku"}.get(prog.library, prog.library))
    packs = ecosystem.load_rulesets(ecosystem.CONFIGS["identity"])
    error, control, kept = ecosystem.check_values(prog, packs, ecosystem.TOLERANCE["identity"])
    assert kept, f"{name}: error {error:.2e} against a control of {control:.2e}"


def test_relative_error_sees_differences():
    import numpy as np

    a = {"x": np.array([1.0, 2.0, np.nan]), "n": np.array([1, 2])}
    assert ecosystem.relative_error(a, a) == 0.0
    assert ecosystem.relative_error(a, {"x": np.array([1.0, 2.5, np.nan]), "n": np.array([1, 2])}) == 0.25
    assert np.isnan(ecosystem.relative_error(a, {"x": np.array([1.0, 2.0, 0.0]), "n": np.array([1, 2])}))
    assert ecosystem.relative_error(a, {"x": a["x"], "n": np.array([1, 3])}) == np.inf
