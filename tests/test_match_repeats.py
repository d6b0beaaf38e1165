"""``benchmarks/match_repeats.py``: a match's structural key is the same for the same terms in two e-graphs and
tells other terms apart; repeats are counted across pipelines and within one; the recorder logs every application of
a real rewrite and puts the engine back."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import match_repeats as M
from rewrite.ir.egraph import EGraph
from rewrite.ir.intern import TYPES
from rewrite.jaxpr.load import load_closed
from rewrite.jaxpr.trace import trace_at


def _loaded(fn, *avals):
    """``fn`` traced at ``avals`` and loaded into a new e-graph: the e-graph, a snapshot and its output's class."""
    eg = EGraph()
    inputs = [eg.term("Param", [0, i], TYPES.intern_aval(a)) for i, a in enumerate(avals)]
    (out,), _ = load_closed(trace_at(fn, list(avals)), inputs, eg)
    eg.flush()
    snap = eg.snapshot()
    return eg, snap, snap.cls_of_name[out]


def test_the_same_terms_in_two_egraphs_have_one_key_and_other_terms_another():
    f32 = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    _, a, ca = _loaded(lambda x, y: jnp.sin(x) * y, f32, f32)
    _, pad, _ = _loaded(lambda x: jnp.cos(x) + 1.0, f32)  # a second e-graph, made first, so ids differ
    _, b, cb = _loaded(lambda x, y: jnp.sin(x) * y, f32, f32)
    _, c, cc = _loaded(lambda x, y: jnp.cos(x) * y, f32, f32)
    for d in (0, 1, 2, 3):
        assert M.structural_key(a, ca, d, {}) == M.structural_key(b, cb, d, {})
    assert M.structural_key(a, ca, 0, {}) == M.structural_key(c, cc, 0, {})  # the type alone
    assert M.structural_key(a, ca, 1, {}) == M.structural_key(c, cc, 1, {})  # mul of two f32[4,3]
    assert M.structural_key(a, ca, 2, {}) != M.structural_key(c, cc, 2, {})  # sin against cos, below the mul
    _, e, ce = _loaded(lambda x, y: jnp.sin(x) * y, jax.ShapeDtypeStruct((3, 4), jnp.float32),
                       jax.ShapeDtypeStruct((3, 4), jnp.float32))
    assert M.structural_key(a, ca, 0, {}) != M.structural_key(e, ce, 0, {})
    # an operand list (concatenate's) is a class without a name or a type: it is keyed as a container
    _, g, cg = _loaded(lambda x: jnp.concatenate([x, jnp.sin(x)]), f32)
    assert "container" in repr(M.structural_key(g, cg, 3, {}))


def test_repeats_count_unfired_unbuilt_matches_seen_before_with_the_same_verdict():
    A = M.Applied
    first = [A(("r", "k1"), "declined", 1.0, 0), A(("r", "k2"), "fired", 1.0, 3), A(("s", "k1"), "guard", 1.0, 0)]
    second = [A(("r", "k1"), "declined", 0.5, 0),   # declined before: a repeat
              A(("r", "k2"), "fired", 0.5, 3),      # fired: a union of the new e-graph, never carried
              A(("s", "k1"), "declined", 0.5, 0),   # another verdict than before
              A(("r", "k3"), "declined", 0.5, 2),   # new
              A(("r", "k3"), "declined", 0.25, 2)]  # built terms: not carried
    across = M.repeats([first, second], 0)
    assert [(r.applied, r.repeats, r.repeat_seconds) for r in across] == [(3, 0, 0.0), (5, 1, 0.5)]
    assert across[1].by_rule == {"r": 0.5}
    within = M.repeats([first + first[:1]], 0, within=True)
    assert [(r.repeats, r.repeat_seconds) for r in within] == [(1, 1.0)]


def test_the_recorder_logs_a_rewrite_s_applications_and_puts_the_engine_back():
    from rewrite import rewrite
    from rewrite.rules import saturate

    before = saturate.Engine.__init__, saturate.Engine._apply
    x = jnp.ones((8,), jnp.float32)
    with M.recording((0, 1)) as engines:
        rewrite(lambda x: jnp.exp(jnp.log(x)) * 1.0 + jnp.sin(x) * 0.0, rulesets=["algebra", "derivatives"]).jaxpr(x)
    assert (saturate.Engine.__init__, saturate.Engine._apply) == before
    logged = [a for e in engines for a in e]
    assert logged and all(len(a.keys) == 2 and a.seconds >= 0 and a.built >= 0 for a in logged)
    assert any(a.verdict == "fired" for a in logged)
    assert {a.keys[0][0] for a in logged} >= {"mul_one"}
