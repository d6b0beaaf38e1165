"""What a process keeps after rewriting and differentiating many signatures (issue 48, item 1).

Each new input signature under ``jit(grad)`` used to keep its joint e-graph (some 90 MB of egglog's
native memory), and JAX's params-keyed caches kept a function's signatures after the function was
gone. The measurement runs in a fresh process (``benchmarks/held_memory.py``), so that what this
test session already holds does not blur the reading.
"""

import sys

import pytest

from benchmarks.held_memory import measure

#: MiB a signature may keep: its programs and statistics, and JAX's own compiled programs (plain
#: ``jax.jit(jax.grad(loss))`` keeps 1.7 MiB a shape). One e-graph kept would be some 90.
PER_SIGNATURE_MB = 4.0


@pytest.mark.parametrize("modes", [("jit_grad", "jit_vjp"), ("jit_jvp", "new_function")])
def test_memory_held_stays_flat_across_new_signatures_and_functions(modes):
    for row in measure(modes, 20, python=sys.executable):
        assert row["per_signature_mb"] < PER_SIGNATURE_MB, row
