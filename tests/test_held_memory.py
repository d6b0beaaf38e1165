"""What a process keeps after rewriting and differentiating many signatures (issue 48, item 1).

Each new input signature under ``jit(grad)`` used to keep its joint e-graph (some 90 MB of egglog's
native memory), and JAX's params-keyed caches kept a function's signatures after the function was
gone. The measurement runs in a fresh process (``benchmarks/held_memory.py``), so that what this
test session already holds does not blur the reading.
"""

import sys

import jax
import jax.numpy as jnp
import pytest

import rulesets
from benchmarks.held_memory import measure
from rewrite import rewrite

#: MiB a signature may keep: its programs and statistics, and JAX's own compiled programs (plain
#: ``jax.jit(jax.grad(loss))`` keeps 1.7 MiB a shape). One e-graph kept would be some 90.
PER_SIGNATURE_MB = 4.0


@pytest.mark.parametrize("modes", [("jit_grad", "jit_vjp"), ("jit_jvp", "new_function")])
def test_memory_held_stays_flat_across_new_signatures_and_functions(modes):
    for row in measure(modes, 20, python=sys.executable):
        assert row["per_signature_mb"] < PER_SIGNATURE_MB, row


_BOUNDED = """
import jax
import jax.numpy as jnp
import numpy as np

import rulesets
from rewrite import rewrite
from rewrite.ir.intern import PARAMS, TYPES


def loss(x):
    return jnp.sum(jnp.sin(x) ** 2) + jnp.sum(jnp.tanh(x @ x.T))


f = rewrite(loss, rulesets=[rulesets.derivatives], cache=False)
grad = jax.jit(jax.grad(f))
for n in (3, 4):  # warm up: the packs' rules compiled, their entries pinned
    grad(jnp.ones((n, 4)))
PARAMS.keep = TYPES.keep = 4
start = len(PARAMS), len(TYPES)
want = jax.jit(jax.grad(loss))  # JAX's gradient compiled once a shape, not op by op (58% of this script's CPU s)
for n in range(5, 17):
    x = jnp.linspace(-1, 1, n * 4, dtype=jnp.float32).reshape(n, 4)
    np.testing.assert_allclose(grad(x), want(x), rtol=2e-5, atol=2e-5)
assert len(PARAMS) <= start[0] + 4 and len(TYPES) <= start[1] + 4, (start, len(PARAMS), len(TYPES))
"""


def test_interning_tables_stay_bounded_across_new_signatures():
    """The params and type tables kept ~2 and ~3 entries (about 3 KB) for every new input signature, for good.
    With a small bound they stay within it past the entries compiled rules pin, and every result stays right.
    In a fresh process: an e-graph another test keeps alive (a report's) rightly keeps its entries."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _BOUNDED], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _egraphs_alive() -> int:
    import gc

    from rewrite.ir.egraph import EGraph

    gc.collect()
    return sum(isinstance(o, EGraph) for o in gc.get_objects())


def test_a_blocked_attention_keeps_no_e_graph_alive_once_its_function_is_gone():
    """The blocked kernel's per-block function outlives the match (JAX's caches keep the programs that call
    it); it must not hold the matched values, each of which holds its builder and the whole e-graph."""

    def attention(q, k, v):
        return jax.nn.softmax(q @ k.T / 8.0, axis=-1) @ v

    before = _egraphs_alive()
    for n in (512, 1024):
        x = jnp.ones((n, 64))
        f = rewrite(attention, rulesets=[rulesets.attention])
        assert any("attn" in k for k, s in f.result(x, x, x).stats.items() if s.fired), "the blocked form is built"
        jax.jit(f)(x, x, x).block_until_ready()
        jax.jit(jax.grad(lambda q: f(q, x, x).sum()))(x).block_until_ready()  # noqa: B023
        del f
    assert _egraphs_alive() <= before



def test_a_released_report_keeps_no_e_graph_and_still_reads():
    """``Report.release``: a cache of reports (a loop over programs, a test's cache) keeps the programs and the
    counts, not every report's e-graph."""
    from rewrite import explain

    before = _egraphs_alive()
    sizes = (5, 6, 7)
    reports = [explain(lambda x: jnp.sum(jnp.tanh(x @ x.T)) * 1.0, jnp.ones((n, 4)),
                       rulesets=[rulesets.algebra, rulesets.linalg]) for n in sizes]
    assert _egraphs_alive() >= before + len(sizes)  # each report keeps its own, for why() and to_dot()
    text = [str(r) for r in reports]
    for r in reports:
        r.release()
    assert _egraphs_alive() <= before
    for n, r, t in zip(sizes, reports, text):
        assert str(r) == t and r.fired.get("mul_one") == 1
        assert r.why("mul_one") is None and r.forced("mul_one") is None and r.declined() == []
        with pytest.raises(ValueError, match="kept no e-graph"):
            r.to_dot()
        x = jnp.arange(n * 4.0).reshape(n, 4) / 10
        got = jax.extend.core.jaxpr_as_fun(r.after)(x)[0]
        assert float(got) == pytest.approx(float(jnp.sum(jnp.tanh(x @ x.T))), rel=1e-6)


def test_a_first_call_leaves_no_reference_cycle_of_its_own_for_the_collector(tmp_path):
    """A recursive closure is a reference cycle (the function holds itself through its cell), so whatever it
    reads (a program priced, its kernels' order, a stored program's objects) outlives the call until a collection
    finds it: 84,700 objects of flax_long_context_step's first call were such garbage, and 1,400 more hung from a
    fusion model and its ``InnerPeak``, which held each other. Each closure is cleared when its function returns,
    and ``InnerPeak`` holds its model weakly; what a rewrite keeps then leaves its window in the oldest generation
    (``jaxpr.trace.collect_young_only``), and what it drops is freed at once. Read on a small ecosystem program
    (numpyro's mixture, priced with the memory model's XLA order and stored in the cache)."""
    import gc

    ecosystem = pytest.importorskip("benchmarks.ecosystem")
    pytest.importorskip("numpyro")
    prog = ecosystem.PROGRAMS["numpyro_mixture_logp"]
    fn, args = prog.build()
    flat, leaves = ecosystem._flat(fn, args)
    packs = ecosystem.load_rulesets(ecosystem.CONFIGS["identity"])
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # whatever any collection finds from here on is kept in gc.garbage, to be read
    try:
        f = rewrite(flat, rulesets=packs, cache=str(tmp_path))
        (f.grad_result if prog.grad else f.result)(*leaves)
        gc.collect()
        ours = sorted({_named(o) for o in gc.garbage if _named(o).startswith(("rewrite.", "rulesets."))})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not ours, ours


def _named(o) -> str:
    """A function's module and name, or another object's class's."""
    if type(o).__name__ == "function":
        return f"{o.__module__}.{o.__qualname__}"
    return f"{type(o).__module__}.{type(o).__qualname__}"
