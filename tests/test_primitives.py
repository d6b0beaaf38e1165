"""The table of primitives (rewrite/ir/primitives.py): one record per primitive, a default for unknown ones,
and a new primitive, one with a body included, added by one entry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core
from jax._src.interpreters import mlir
from jax.extend.core import Primitive

import rulesets

from rewrite import GROUPS, AnalyticCost, NodeInfo, OpSpec, Ruleset, explain, register_primitive, rewrite, rule
from rewrite.ir import primitives as _primitives, terms as _terms
from rewrite.ir.primitives import BY_PRIM, DEFAULT, Fact, spec_of, unregister


def _prims(closed):
    return [e.primitive.name for e in closed.jaxpr.eqns]


# ---------------------------------------------------------------- a primitive the table does not know
unknown_p = Primitive("test_unknown_halve")
unknown_p.def_impl(lambda x: x / 2)
unknown_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(unknown_p, mlir.lower_fun(lambda x: x / 2, multiple_results=False))


def test_an_unknown_primitive_gets_the_default_record_and_comes_back_unchanged():
    assert spec_of("test_unknown_halve") is DEFAULT and DEFAULT.ctor == "Opaque" and DEFAULT.family == "opaque"

    def f(x):
        return jnp.sin(unknown_p.bind(x * 1.0))

    mul_one = rule(lambda x: x * 1.0, lambda x: x, name="mul_one")
    report = explain(f, jnp.ones(3), rulesets=[Ruleset("t", [mul_one])])
    assert report.fired == {"mul_one": 1}
    assert _prims(report.after) == ["test_unknown_halve", "sin"]
    x = jnp.linspace(-1, 1, 3)
    np.testing.assert_allclose(rewrite(f, rulesets=[Ruleset("t", [mul_one])])(x), f(x))
    snap, choice = report.result.snapshot, report.result.choice
    assert any(choice[c][0] == "Opaque" for c in choice)
    assert not any(n[0] == "TestUnknownHalve" for ns in snap.nodes.values() for n in ns)


# ---------------------------------------------------------------- one entry: an elementwise primitive
twice_p = Primitive("test_twice")
twice_p.def_impl(lambda x: 2 * x)
twice_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(twice_p, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))
TWICE = OpSpec("test_twice", "T", "elementwise", groups=("scaling",),
               facts=(Fact("test-twice-nonneg", "NonNeg", "(NonNeg x)"),))


def test_a_registered_primitive_is_matched_priced_grouped_and_given_facts():
    spec = BY_PRIM["test_twice"]
    assert spec.ctor == "TestTwice" and _terms.ctor_arg_sorts("TestTwice") == ("Term", "i64")
    assert "test_twice" in GROUPS["scaling"] and "test_twice" in GROUPS["unary"]
    assert "(TestTwice x p)" in _terms.fact_rules() and "TestTwice" in _terms.schema()
    v = jax.core.ShapedArray((10,), jnp.float32)
    assert AnalyticCost()(NodeInfo("test_twice", spec.family, {}, (v,), (v,))) > 0
    halve = rule(lambda x: twice_p.bind(x) * 0.5, lambda x: x, name="halve_twice")
    report = explain(lambda x: jnp.cos(twice_p.bind(x) * 0.5), jnp.ones(4), rulesets=[Ruleset("t", [halve])])
    assert report.fired == {"halve_twice": 1} and _prims(report.after) == ["cos"]
    # its fact rule fires: twice(|x|) is known non-negative, so the abs of it goes
    abs_nonneg = rule(lambda v: jnp.abs(v), lambda v: v, name="abs_nonneg", when=lambda v: v.nonneg)
    report = explain(lambda x: jnp.abs(twice_p.bind(jnp.abs(x))), jnp.ones(4),
                     rulesets=[Ruleset("t", [abs_nonneg])])
    assert report.fired == {"abs_nonneg": 1}


def test_register_primitive_refuses_what_it_cannot_add():
    with pytest.raises(ValueError, match="already in the table"):
        register_primitive(OpSpec("sin", "T", "transcendental"))
    with pytest.raises(ValueError, match="is taken"):
        register_primitive(OpSpec("test_other", "T", "elementwise", ctor="Sin"))
    with pytest.raises(ValueError, match="nested"):
        register_primitive(OpSpec("test_loop", "BL", "nested"))
    with pytest.raises(ValueError, match="family"):
        register_primitive(OpSpec("test_fam", "T", "no such family"))


def test_a_replaced_record_with_another_layout_is_read_afresh():
    # ctor_arg_sorts is memoised for extraction; replacing a record must not leave its old layout behind
    from rewrite.ir.terms import ctor_arg_sorts

    register_primitive(OpSpec("test_layout", "T", "elementwise", ctor="TestLayout"))
    try:
        assert ctor_arg_sorts("TestLayout") == ("Term", "i64")
        assert "(constructor TestLayout (Term i64) Term)" in _terms.schema()  # the schema is remade, not kept
        register_primitive(OpSpec("test_layout", "TT", "elementwise", ctor="TestLayout"), replace=True)
        assert ctor_arg_sorts("TestLayout") == ("Term", "Term", "i64")
        assert "(constructor TestLayout (Term Term i64) Term)" in _terms.schema()
    finally:
        unregister("test_layout")


# ---------------------------------------------------------------- one entry: a primitive with a body
call_p = Primitive("test_call")
call_p.multiple_results = True


def _call_impl(*args, jaxpr):
    return core.jaxpr_as_fun(jaxpr)(*args)


call_p.def_impl(_call_impl)
call_p.def_abstract_eval(lambda *avals, jaxpr: jaxpr.out_avals)
mlir.register_lowering(call_p, mlir.lower_fun(_call_impl, multiple_results=True))


def _call_emit(em, params, bodies, n_out, n_in):
    params["jaxpr"] = em.body(bodies[0], tuple(range(n_in)), closed=True)
    return params


CALL = OpSpec("test_call", "BL", "nested", body_params=("jaxpr",),
              load=lambda ld: ld.nested([ld.closed_body(ld.eqn.params["jaxpr"])]),
              emit=_call_emit,
              price=lambda model, node: 2.0 * sum(node.body_costs))


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The two entries, in the table for this module's tests only (the table is global)."""
    register_primitive(TWICE)
    register_primitive(CALL)
    yield
    unregister("test_twice")
    unregister("test_call")
    assert "test_twice" not in GROUPS["unary"]


def _called(x, y):
    body = jax.make_jaxpr(lambda a, b: [jnp.sin(a * 1.0) + b])(x, y)
    return call_p.bind(x, y, jaxpr=body)[0]


def test_a_nested_primitive_added_by_one_entry_round_trips_and_rules_reach_its_body():
    x, y = jnp.linspace(-1, 1, 5), jnp.ones(5)
    mul_one = rule(lambda x: x * 1.0, lambda x: x, name="mul_one")
    report = explain(_called, x, y, rulesets=[Ruleset("t", [mul_one])])
    assert report.fired == {"mul_one": 1}
    (eqn,) = report.after.jaxpr.eqns
    assert eqn.primitive is call_p and _prims(eqn.params["jaxpr"]) == ["sin", "add"]
    f = rewrite(_called, rulesets=[Ruleset("t", [mul_one])])
    np.testing.assert_allclose(f(x, y), _called(x, y))
    np.testing.assert_allclose(jax.jit(f)(x, y), _called(x, y))
    # its price hook is what the cost model charges
    snap, choice = report.result.snapshot, report.result.choice
    node = next(c for c in choice if choice[c][0] == "TestCall")
    from rewrite.extract.extractor import Extractor

    ex = Extractor(snap, AnalyticCost())
    info = ex.info(node, *choice[node], choice, (10.0,))
    assert AnalyticCost()(info) == AnalyticCost().node + 20.0


def test_families_and_groups_come_from_the_table():
    assert GROUPS["comparison"] == frozenset("eq ne lt le gt ge".split())
    assert GROUPS["reduction"] == frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or".split())
    assert {"sin", "exp", "log"} <= GROUPS["unary_transcendental"] and "pow" not in GROUPS["unary_transcendental"]
    assert {"add", "mul", "div", "max"} <= GROUPS["binary_arithmetic"]
    for spec in _primitives.SPECS:
        assert spec.prim in GROUPS[spec.family]
    assert all(_primitives.BY_PRIM[p].family in ("elementwise", "transcendental") for p in GROUPS["binary"])
    with pytest.raises(TypeError):
        GROUPS["mine"] = frozenset()  # read-only: register_primitive keeps it


# ---------------------------------------------------------------- a record's loop_step: its work moves into a loop
halve_p = Primitive("test_layout_halve")
halve_p.def_impl(lambda x: x / 2)
halve_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(halve_p, mlir.lower_fun(lambda x: x / 2, multiple_results=False))


def test_a_records_loop_step_says_how_its_work_moves_into_a_loop():
    """``Loop.per_step`` reads the hook from the primitive's record (``OpSpec.loop_step``): without one a
    non-elementwise primitive stays outside the loop; with one, registered with the rest of its record,
    its work moves in."""
    from rewrite.ir import loopstep
    from rewrite.loops import SCAN, Loop
    from rewrite.rules.rule import procedural

    assert BY_PRIM["dot_general"].loop_step is loopstep.dot_general_step
    assert BY_PRIM["sin"].loop_step is loopstep.pointwise_step and BY_PRIM["scan"].loop_step is None
    steps = []

    def halve_step(loop, node, v, axis, step):
        steps.append(axis)
        (x,) = node.operands
        return loop.m.trace(lambda a: halve_p.bind(a), step(x, axis))

    @procedural
    def sum_inside(m):
        loop = Loop(m)
        found = [(v, n) for v, n in loop.consumers() if n.prim == "reduce_sum" and n.params["axes"] == (0, 1)]
        if loop.params.get("_rw_test") or not found:
            return None
        root, node = found[0]
        with loop.attempt():
            step = loop.per_step(node.operands[0])
            j, acc = loop.add_carry(m.trace(lambda: jnp.zeros((), root.dtype)))
            loop.set_carry_next(j, m.trace(lambda a, s: a + jnp.sum(s), acc, step))
            res = loop.build(_rw_test=True)
            return loop.handover(res) + [(root, loop.carry_result(res, j))]

    rs = Ruleset("t", [rule(SCAN, sum_inside, name="sum_inside")], soundness="identity")

    def f(h, xs):
        return jnp.sum(halve_p.bind(jax.lax.scan(lambda c, x: (c + x, c * x), h, xs)[1]))

    h, xs = jnp.ones(3), jnp.arange(15.0).reshape(5, 3)
    for spec, fires in ((OpSpec("test_layout_halve", "T", "layout"), False),
                        (OpSpec("test_layout_halve", "T", "layout", loop_step=halve_step), True)):
        register_primitive(spec, replace=True)
        try:
            report = explain(f, h, xs, rulesets=[rs])
            assert bool(report.fired) is fires
            if fires:
                assert steps and _prims(report.after) == ["scan"]
                np.testing.assert_allclose(rewrite(f, rulesets=[rs])(h, xs), f(h, xs), rtol=1e-6)
        finally:
            unregister("test_layout_halve")


# ---------------------------------------------------------------- JAX's "hijax" primitive objects
def _hijax_searchsorted():
    """``jax._src.numpy.hijax.searchsorted``: a ``call_hi_primitive`` equation holding a ``SearchSorted`` object
    (what ``jnp.searchsorted``, ``jnp.interp`` and ``jnp.histogram`` stage on jax 0.12; older JAX expands it)."""
    hijax = pytest.importorskip("jax._src.numpy.hijax")
    if not hasattr(hijax, "searchsorted"):
        pytest.skip("this JAX has no hijax searchsorted")
    return hijax.searchsorted


def _two_searches(ss):
    def h(x, q1, q2):  # (``x * 1.0 + 0.0``: a program emitted from the e-graph, not handed back as traced)
        return ss(x * 1.0 + 0.0, q1).sum() * 100 + ss(x * 1.0 + 0.0, q2)
    return h


@pytest.mark.parametrize("jit", [False, True])
def test_hijax_primitives_made_for_other_types_stay_apart(jit):
    """JAX compares hijax primitive objects by their params alone (``HiPrim.__eq__``), not the types they were made
    for, which their abstract evaluation reads. Two searches of one array, for a scalar and a ``[2]`` query, are
    equal objects: interned as one, the ``[2]`` search was emitted with the scalar's, and ``jax.jit(rewrite(h))``
    failed (``AssertionError: ((2,), ())``), as did JAX's own ``testInterp``, ``testHistogram`` and
    ``testInsertSlice`` routed through the rewriter on jax 0.12."""
    h = _two_searches(_hijax_searchsorted())
    x, q1, q2 = jnp.arange(10.0), jnp.float32(3.5), jnp.array([1.5, 7.5, 9.5], jnp.float32)
    f = rewrite(h, rulesets=[rulesets.algebra])
    run = jax.jit(f) if jit else f
    np.testing.assert_array_equal(run(x, q1, q2), jax.jit(h)(x, q1, q2))
    # and a second function, after the first, searching for queries of yet another shape
    def both(x, q):
        return h(x, q, q[:1])

    g = rewrite(both, rulesets=[rulesets.algebra])
    q = jnp.array([[0.5, 4.5], [8.5, 2.5]], jnp.float32)
    np.testing.assert_array_equal((jax.jit(g) if jit else g)(x, q), jax.jit(both)(x, q))


@pytest.mark.parametrize("jit", [False, True])
def test_a_loop_body_holding_a_hijax_primitive_stays_high(jit):
    """A body the emitter assembles is marked high where an equation in it is (``Jaxpr.is_high``), as JAX's own
    tracer marks it, so that JAX lowers it to plain primitives before compiling: a ``scan`` whose body searched
    with ``call_hi_primitive`` failed ("MLIR translation rule for primitive 'call_hi_primitive' not found")."""
    ss = _hijax_searchsorted()

    def h(x, qs):
        def body(c, q):
            return c + ss(x * 1.0 + 0.0, q), None

        return jax.lax.scan(body, jnp.int32(0), qs)[0]

    x, qs = jnp.arange(10.0), jnp.array([0.5, 3.5, 9.5], jnp.float32)
    assert jax.make_jaxpr(h)(x, qs).jaxpr.eqns[-1].params["jaxpr"].jaxpr.is_high, "the body JAX traces is high"
    f = rewrite(h, rulesets=[rulesets.algebra], strict=True)
    assert f.result(x, qs).after.jaxpr.eqns[-1].params["jaxpr"].jaxpr.is_high
    np.testing.assert_array_equal((jax.jit(f) if jit else f)(x, qs), jax.jit(h)(x, qs))


def test_a_scanned_custom_vjp_of_the_hijax_kind_runs_and_differentiates():
    """JAX's ``test_custom_vjp_scan_batching_edge_case`` under ``jax_custom_vjp3`` (a ``custom_vjp`` staged as a
    ``call_hi_primitive``), routed through the rewriter: the emitted scan body was not marked high and did not
    compile; its VJP then met ``add_any`` of a weak and a strong value (``sign_add_any``'s guard)."""
    from jax._src import config

    if not hasattr(config, "custom_vjp3"):
        pytest.skip("this JAX has no jax_custom_vjp3")
    with config.custom_vjp3(True):
        @jax.custom_vjp
        def mul(x, coeff):
            return x * coeff

        mul.defvjp(lambda x, coeff: (mul(x, coeff), (x, coeff)),
                   lambda res, g: (g * res[1], (res[0] * g).sum()))

        def scanned(x, coeff):
            return jax.lax.scan(lambda c, _: (mul(c, coeff), None), x, jnp.arange(3))[0]

        batched = jax.vmap(scanned, in_axes=(0, None))
        x, ct, coeff = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2), jnp.linspace(0.5, 2.0, 6).reshape(3, 2), jnp.array(0.9)
        r = rewrite(batched, rulesets=[rulesets.algebra, rulesets.derivatives, rulesets.nn], strict=True)
        np.testing.assert_allclose(jax.jit(r)(x, coeff), batched(x, coeff), rtol=1e-6)
        got, want = jax.vjp(r, x, coeff)[1](ct), jax.vjp(batched, x, coeff)[1](ct)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6)
