"""The rule DSL: definition-time validation, matching semantics, guards, procedural rules."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.core import jaxpr_as_fun

from rewrite import Params, Pat, Rule, Ruleset, explain, ops, procedural, rewrite, rule
from rewrite.testing import check_ruleset
from rewrite.report.report import primitive_counts

from .local_rulesets import _sum_of_broadcast


# ---------------------------------------------------------------- malformed rules fail when defined
@pytest.mark.parametrize("make,message", [
    (lambda: rule(lambda x: x.sum(0), lambda x: x, name="shape"), r"rule 'shape': rhs gives f32\[3\], lhs gives f32\[\]"),
    (lambda: rule(lambda x: jnp.sin(x), lambda x: x > 0, name="dtype"), r"rule 'dtype': rhs gives bool\[\], lhs gives f32\[\]"),
    (lambda: rule(1, lambda x: x, name="lhs"), r"rule 'lhs': lhs is not callable"),
    (lambda: rule(lambda x: jnp.sin(x), "x", name="rhs"), r"rule 'rhs': rhs is not callable"),
    (lambda: rule(lambda x: jnp.sin(x), lambda x: x.reshape(7), name="trace"), r"rule 'trace': rhs cannot be traced"),
    (lambda: rule(lambda x: x, lambda x: x + 0, name="bare"), r"rule 'bare': .*bare pattern variable"),
    (lambda: rule(lambda x, y: jnp.sin(x), lambda x, y: jnp.sin(y), name="unused"),
     r"rule 'unused': pattern variable 'y' is not used"),
    (lambda: rule(lambda x, y: x * y, lambda x: x, name="arity"), r"rule 'arity': lhs takes 2 pattern variables"),
    (lambda: rule(lambda *xs: xs[0], lambda x: x, name="varargs"), r"rule 'varargs': lhs must name its pattern variables"),
    (lambda: rule(lambda x: jnp.sin(x), lambda x: x, name=""), r"name= must be a non-empty string"),
    (lambda: rule(lambda x: lax.scan(lambda c, a: (c + a, a), 0.0, x)[0], lambda x: x.sum(), name="body"),
     r"rule 'body': .*body"),
    (lambda: rule(Pat("sin", Pat.var("x")), lambda y: y, name="pat"), r"rule 'pat': rhs takes 'y', which the pattern does not bind"),
    (lambda: rule(Pat("sin", Pat.var("x")), 1.0, name="pat2"), r"rule 'pat2': a Pat left-hand side needs a right-hand side"),
    (lambda: rule(Pat("scan", name="s", body="b"), lambda b: b, name="pat3"), r"rule 'pat3': rhs takes the body 'b'"),
    (lambda: rule(Pat({"neg", "add"}, Pat.var("x")), lambda x: x, name="grp"), r"Pat: the primitives of a group must take their operands alike"),
    (lambda: rule(lambda x: jnp.sin(x), lambda x: x, name="guard", when=3), r"rule 'guard': when= must be a callable"),
    (lambda: rule(lambda x: jnp.sin(x), lambda x: (x, x), name="tuple"), r"rule 'tuple': rhs must return one array"),
    (lambda: rule(Pat("sin", Pat.var("x")), procedural(lambda m: None), name="pex", example_program=(jnp.ones(3),)),
     r"rule 'pex': a Pat rule's example_program= is a pair \(fn, args\)"),
    (lambda: rule(Pat("sin", Pat.var("x")), procedural(lambda m: None), name="pex2",
                  example_program=(lambda x: x.reshape(7), (jnp.ones(3),))), r"rule 'pex2': the example program cannot be traced"),
])
def test_malformed_rules_fail_at_definition(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_duplicate_names_in_a_ruleset():
    r1 = rule(lambda x: x * 1.0, lambda x: x, name="same")
    r2 = rule(lambda x: x + 0.0, lambda x: x, name="same")
    with pytest.raises(ValueError, match="rule name 'same' appears twice"):
        Ruleset("dup", [r1, r2])


# ---------------------------------------------------------------- matching
def test_user_rule_rewrites_and_report_names_it():
    softplus_rule = rule(lambda x: jnp.log(1.0 + jnp.exp(x)), lambda x: jnp.logaddexp(x, 0.0), name="stable_softplus")
    rs = Ruleset("mine", [softplus_rule], soundness="identity")

    def f(x):
        return jnp.log(1.0 + jnp.exp(x)) * 2

    x = jnp.array([-100.0, 0.0, 100.0])
    report = explain(f, x, rulesets=[rs])
    assert report.fired == {"stable_softplus": 1}
    assert "stable_softplus" in str(report)
    out = rewrite(f, rulesets=[rs])(x)
    assert np.isfinite(np.asarray(out)).all()  # the rewritten program no longer overflows at 100


def test_literals_match_across_dtypes():
    # Written with a Python int, the literal is 1.0 in float programs and 1 in int programs.
    # (``x * 1.0`` at an int32 x is a float multiplication in JAX, and rightly does not match.)
    rs = Ruleset("one", [rule(lambda x: x * 1, lambda x: x, name="mul_one")])
    ints = rewrite(lambda i: i * 1 + 3, rulesets=[rs])
    assert "mul" not in primitive_counts(ints.jaxpr(jnp.arange(4)))
    with jax.enable_x64(True):
        doubles = rewrite(lambda x: x * 1.0, rulesets=[rs])
        x = jnp.arange(3, dtype=jnp.float64)
        assert "mul" not in primitive_counts(doubles.jaxpr(x))
        np.testing.assert_array_equal(doubles(x), x)


def test_negative_zero_is_not_zero():
    # x + (-0.0) -> x is exact; x + 0.0 -> x is not (it turns -0.0 into +0.0). The literal keys differ.
    rs = Ruleset("zero", [rule(lambda x: x + (-0.0), lambda x: x, name="add_neg_zero")])
    r = rewrite(lambda x: x + 0.0, rulesets=[rs])
    x = jnp.array([-0.0])
    assert np.signbit(np.asarray(r(x)))[0] == False  # noqa: E712  (kept: +0.0 result)
    assert primitive_counts(r.jaxpr(x))["add"] == 1


def test_shape_dependent_patterns_are_verified():
    rs = Ruleset("sum", [rule(lambda x: jnp.sum(x * 2.0, axis=0), lambda x: 2.0 * jnp.sum(x, axis=0), name="pull")],
                 soundness="identity")
    x = jnp.ones((3, 4, 5))
    axis1 = explain(lambda x: jnp.sum(x * 2.0, axis=1), x, rulesets=[rs])
    assert axis1.fired == {} and axis1.rejected["pull"].get("unverified", 0) >= 1  # wildcard axes, exact check
    axis0 = explain(lambda x: jnp.sum(x * 2.0, axis=0), x, rulesets=[rs])
    assert axis0.fired == {"pull": 1}


def test_jnp_helpers_match_at_any_rank():
    rs = Ruleset("relu", [rule(lambda x: jnp.where(x > 0, x, 0.0), lambda x: jnp.maximum(x, 0.0), name="relu")],
                 soundness="identity")
    for shape in [(), (4,), (2, 3, 4, 5)]:
        x = jnp.linspace(-1, 1, math.prod(shape)).reshape(shape)
        r = explain(lambda x: jnp.where(x > 0, x, 0.0), x, rulesets=[rs])
        assert r.fired == {"relu": 1}, shape


def test_patterns_match_inside_bodies():
    rs = Ruleset("one", [rule(lambda x: x * 1.0, lambda x: x, name="mul_one")])

    def f(xs):
        return lax.scan(lambda c, x: (c + x * 1.0, lax.cond(c.sum() > 0, lambda v: v * 1.0, lambda v: v, x)), 0.0, xs)

    xs = jnp.arange(4.0) - 1
    r = rewrite(f, rulesets=[rs])
    assert primitive_counts(r.jaxpr(xs))["mul"] == 0
    for a, b in zip(r(xs), f(xs)):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- guards
def test_guards_see_facts():
    rs = Ruleset("abs", [rule(lambda x: jnp.abs(x), lambda x: x, name="abs_nonneg", when=lambda x: x.nonneg)])
    y = jnp.linspace(-2, 2, 5)
    known = explain(lambda y: jnp.abs(jnp.exp(y)), y, rulesets=[rs])
    assert known.fired == {"abs_nonneg": 1}
    unknown = explain(lambda y: jnp.abs(jnp.sin(y)), y, rulesets=[rs])
    assert unknown.fired == {}
    squares = explain(lambda y: jnp.abs(y * y + 1.0), y, rulesets=[rs])  # y*y >= 0, 1 >= 0: the sum too
    assert squares.fired == {"abs_nonneg": 1}


def test_guards_see_shapes_and_dtypes():
    rs = Ruleset("g", [rule(lambda x: x * 1.0, lambda x: x, name="only_matrices", when=lambda x: x.ndim == 2)])
    assert explain(lambda x: x * 1.0, jnp.ones((2, 2)), rulesets=[rs]).fired == {"only_matrices": 1}
    assert explain(lambda x: x * 1.0, jnp.ones(3), rulesets=[rs]).fired == {}


def test_facts_are_never_claimed_for_integers():
    # abs(INT_MIN) is negative: a fact derived for integers would make this rule unsound.
    rs = Ruleset("abs", [rule(lambda x: jnp.abs(x), lambda x: x, name="abs_nonneg", when=lambda x: x.nonneg)])
    i = jnp.array([-(2 ** 31)], dtype=jnp.int32)
    r = rewrite(lambda i: jnp.abs(jnp.abs(i)), rulesets=[rs])
    np.testing.assert_array_equal(r(i), jnp.abs(jnp.abs(i)))
    assert primitive_counts(r.jaxpr(i))["abs"] == 2


# ---------------------------------------------------------------- procedural rules
def test_procedural_rule_with_pat():
    r = rule(Pat("reduce_sum", Pat("broadcast_in_dim", Pat.var("s"), params="bp")), _sum_of_broadcast,
             name="sum_of_broadcast")
    rs = Ruleset("proc", [r], soundness="identity")

    def f(a):
        return jnp.sum(jnp.broadcast_to(a, (4, 5)))

    a = jnp.float32(1.5)
    report = explain(f, a, rulesets=[rs])
    assert report.fired == {"sum_of_broadcast": 1}
    assert "reduce_sum" not in primitive_counts(report.after)
    np.testing.assert_allclose(rewrite(f, rulesets=[rs])(a), 30.0)


def test_a_procedure_declined_for_want_of_a_function_is_tried_again_when_one_can_be_read():
    # fold_sin reads x back as a function of nothing (a constant). At first x is x*0 of an input, so it
    # declines; times_zero then gives x's class a constant node, and the declined match must run again.
    calls = []

    @procedural
    def fold_sin(m):
        f = m.function([m["x"]], [])
        calls.append(f is not None)
        return None if f is None else m.trace(lambda: jnp.sin(f()[0]))

    rs = Ruleset("fold", [rule(lambda x: x * 0.0, lambda x: jnp.zeros_like(x), name="times_zero"),
                          rule(Pat("sin", Pat.var("x")), fold_sin, name="fold_sin")], soundness="fastmath")
    report = explain(lambda x: jnp.sin(x * 0.0) + x, jnp.ones(3), rulesets=[rs])
    assert calls == [False, True]
    assert report.fired == {"times_zero": 1, "fold_sin": 1}


def test_procedural_rhs_with_traced_lhs():
    @procedural
    def halve_if_even(m):
        x = m["x"]
        return m.trace(lambda v: v * 0.5, x) if x.shape and x.shape[-1] % 2 == 0 else None

    rs = Ruleset("div", [rule(lambda x: x / 2.0, halve_if_even, name="div2")], soundness="identity")
    assert explain(lambda x: x / 2.0, jnp.ones(4), rulesets=[rs]).fired == {"div2": 1}
    assert explain(lambda x: x / 2.0, jnp.ones(3), rulesets=[rs]).fired == {}


def test_a_procedure_reading_only_its_root_runs_once_per_root():
    """Two matches at one class in one snapshot: a procedure that read only ``m.root`` would act the
    same on the second, so it is not run again; one that read a binding is."""
    from rewrite.jaxpr.load import load_closed
    from rewrite import Limits
    from rewrite.rules.saturate import Engine
    from rewrite.ir.egraph import EGraph
    from rewrite.ir.intern import TYPES

    calls = {"root": 0, "binding": 0}

    @procedural
    def root_only(m):
        calls["root"] += 1
        assert m.root.shape == (3,)
        return None

    @procedural
    def reads_x(m):
        calls["binding"] += 1
        assert m["x"].shape == (3,)
        return None

    rules = [rule(Pat("mul", Pat.var("x"), Pat.var("y")), root_only, name="root_only"),
             rule(Pat("mul", Pat.var("x"), Pat.var("y")), reads_x, name="reads_x")]
    owner = Ruleset("probe", rules)
    closed = jax.make_jaxpr(lambda a, b: a * b)(jnp.ones(3), jnp.ones(3))
    eg = EGraph()
    ins = [eg.term("Param", [0, i], TYPES.intern_aval(v)) for i, v in enumerate(closed.in_avals)]
    (out,), _ = load_closed(closed, ins, eg)
    eg.flush()
    engine = Engine(eg, [(r, owner) for r in rules], Limits())
    engine.snapshot = eg.snapshot()
    acts = {a.rule.name: a for a in engine.active}
    root = engine.snapshot.cls_of_name[out]
    a, b = (engine.snapshot.cls_of_name[v] for v in ins)
    for name in ("root_only", "reads_x"):
        for x, y in ((a, b), (b, a)):  # the same root, matched two ways
            engine._apply_procedure(acts[name], root, {"x": x, "y": y}, {"x": "Term", "y": "Term"})
    assert calls == {"root": 1, "binding": 2}
    assert engine.stats["root_only"].rejected == {"declined": 1, "same root": 1}
    engine.snapshot = eg.snapshot()  # a new snapshot: the class may have changed, so it runs again
    engine._apply_procedure(acts["root_only"], root, {"x": a, "y": b}, {"x": "Term", "y": "Term"})
    assert calls["root"] == 2


def test_a_declined_procedure_acts_again_when_a_class_it_read_changes():
    """A procedure that declined because an operand was not a literal yet is acted on again once another
    rule has made it one (z - z -> 0 for integers), though no new match of its own pattern appeared."""
    import rulesets

    literals = []

    @procedural
    def times_zero(m):
        literals.append(m["y"].literal)
        if m["y"].literal != 0:
            return None
        return m.trace(lambda x: jnp.zeros_like(x), m["x"])

    rules = Ruleset("t", [rulesets.algebra.rule("sub_self_int"),
                          rule(Pat("mul", Pat.var("x"), Pat.var("y")), times_zero, name="times_zero")])
    report = explain(lambda x, z: x * (z - z), jnp.int32(3), jnp.int32(5), rulesets=[rules])
    assert literals[0] is None and 0 in literals  # declined first, acted on again after the fold
    assert report.fired == {"sub_self_int": 1, "times_zero": 1}
    assert report.after.eqns == [] and int(rewrite(lambda x, z: x * (z - z), rulesets=[rules])(3, 5)) == 0
    # a procedure whose classes did not change is not run again
    calls = []

    @procedural
    def never(m):
        calls.append(m.root.name)
        assert m["y"].literal is None  # reads the operand's class, which no rule changes
        return None

    explain(lambda x, y: jnp.sin(x * y) * 2.0, jnp.ones(3), jnp.ones(3),
            rulesets=[Ruleset("n", [rule(Pat("sin", Pat("mul", Pat.var("x"), Pat.var("y"))), never, name="never")])])
    assert len(calls) == 2  # once per operand order, in the first iteration only


def test_a_symmetric_rule_acts_once_per_site_and_an_asymmetric_one_on_both_orders():
    """Patterns match a product in both operand orders. exp(x)*exp(y) -> exp(x+y) reads the same with x and y
    swapped, so one of the two matches is acted on; a rule that is not symmetric acts on both."""
    sym = rule(lambda x, y: jnp.exp(x) * jnp.exp(y), lambda x, y: jnp.exp(x + y), name="exp_add")
    asym = rule(lambda x, y: jnp.exp(x) * jnp.exp(y), lambda x, y: jnp.exp(x) * jnp.exp(y) * 1.0, name="asym",
                when=lambda x, y: True)
    assert sym.symmetries == ((1, 0),) and asym.symmetries == ()
    a, b = jnp.linspace(-1.0, 1.0, 5), jnp.linspace(0.0, 2.0, 5)
    report = explain(lambda a, b: jnp.exp(a) * jnp.exp(b), a, b, rulesets=[Ruleset("s", [sym], soundness="identity")])
    assert report.fired == {"exp_add": 1} and report.result.stats["exp_add"].matched == 1
    np.testing.assert_allclose(rewrite(lambda a, b: jnp.exp(a) * jnp.exp(b), rulesets=[Ruleset("s", [sym],
                               soundness="identity")])(a, b), jnp.exp(a) * jnp.exp(b), rtol=1e-6)
    report = explain(lambda a, b: jnp.exp(a) * jnp.exp(b), a, b, rulesets=[Ruleset("a", [asym], soundness="identity")])
    assert report.result.stats["asym"].matched == 2


def test_ill_typed_procedure_is_skipped_with_a_warning():
    @procedural
    def wrong(m):
        return m.trace(lambda v: v.sum(), m["x"])

    rs = Ruleset("w", [rule(lambda x: jnp.sin(x), wrong, name="wrong")])
    with pytest.warns(UserWarning, match="rule 'wrong' built f32"):
        out = rewrite(lambda x: jnp.sin(x), rulesets=[rs], strict=False)(jnp.ones(3))  # strict would raise
    np.testing.assert_allclose(out, jnp.sin(jnp.ones(3)))


# ---------------------------------------------------------------- rules over named bindings and groups
X = Pat.var("x")


def _ops_in(report):
    return [e.primitive.name for e in report.after.eqns]


def test_a_function_of_named_bindings_rewrites_at_any_axes():
    r = rule(Pat("reduce_sum", Pat("neg", X), params="p"), lambda x, p: -p.bind(x), name="sum_neg",
             example_program=(lambda x: jnp.sum(-x, axis=(0, 2)), (jax.ShapeDtypeStruct((2, 3, 4), jnp.float32),)))
    rs = Ruleset("named", [r], soundness="identity")  # sum(-0.0, +0.0) is +0.0, -sum is -0.0
    for axes in [(0,), (1, 2), (0, 1, 2)]:
        report = explain(lambda a: jnp.sum(-a, axis=axes), jnp.ones((2, 3, 4)), rulesets=[rs])
        assert report.fired == {"sum_neg": 1}
        assert _ops_in(report) == ["reduce_sum", "neg"]
        assert report.after.eqns[0].params["axes"] == axes
    assert set(check_ruleset(rs).rules) == {"sum_neg"}


def test_one_pattern_stands_for_a_group_of_primitives():
    unit = rule(Pat(ops.REDUCE - ops.ARG_REDUCE, X, params="p"),
                lambda x, p: lax.reshape(x, tuple(d for i, d in enumerate(x.shape) if i not in p.axes)),
                when=lambda x, p: all(x.shape[a] == 1 for a in p.axes), name="unit_axes")
    assert len(unit.queries) == len(ops.REDUCE - ops.ARG_REDUCE)
    rs = Ruleset("g", [unit], soundness="exact")
    report = explain(lambda a: (jnp.max(a, axis=1), jnp.prod(a, axis=1), jnp.sum(a, axis=0)), jnp.ones((2, 1, 4)),
                     rulesets=[rs])
    assert report.fired == {"unit_axes": 2}  # max and prod over the size-1 axis; not the sum over axis 0
    assert sorted(_ops_in(report)) == ["reduce_sum", "reshape"]


def test_params_bind_the_matched_member_of_a_group():
    seen = []

    def swap(x, y, p):
        seen.append(p.prim)
        assert isinstance(p, Params) and p.primitive.name == p.prim
        return p.bind(y, x)

    r = rule(Pat({"add", "mul", "max"}, X, Pat.var("y"), params="p"), swap, name="swap_any")
    report = explain(lambda a, b: (a + b) * jnp.maximum(a, b), jnp.ones(3), jnp.ones(3),
                     rulesets=[Ruleset("s", [r], soundness="exact")])
    assert sorted(set(seen)) == ["add", "max", "mul"]
    assert report.fired["swap_any"] >= 3


def test_an_optional_wrapper_matches_with_and_without_it():
    """``Pat.optional``: one pattern for ``log(exp(x))`` and ``log(convert(exp(x)))``; absent, its params are
    ``None`` (in a right side, a guard and a procedure) and its name is the operand's class."""
    seen = []

    def back(x, c):
        seen.append(None if c is None else c.prim)
        return x if c is None else c.bind(x)

    r = rule(Pat("log", Pat.optional("convert_element_type", Pat("exp", X), params="c", name="w")), back,
             when=lambda w, c: c is not None or w.ndim == 1, name="log_exp")
    assert len(r.queries) == 2 and set(r.var_names) == {"x", "c", "w"}
    rs = Ruleset("o", [r], soundness="identity")
    plain = explain(lambda a: jnp.log(jnp.exp(a)), jnp.ones(3), rulesets=[rs])
    assert set(seen) == {None}
    wide = explain(lambda a: jnp.log(jnp.exp(a).astype(jnp.float32)), jnp.ones(3, jnp.bfloat16), rulesets=[rs])
    assert plain.fired == wide.fired == {"log_exp": 1} and set(seen) == {None, "convert_element_type"}
    assert _ops_in(plain) == [] and _ops_in(wide) == ["convert_element_type"]
    assert not explain(lambda a: jnp.log(jnp.exp(a)), jnp.ones((2, 3)), rulesets=[rs]).fired  # the guard: w is exp(a)
    assert not explain(lambda a: jnp.log(jnp.sin(a)), jnp.ones(3), rulesets=[rs]).fired
    kinds = []

    @procedural
    def read(m):
        kinds.append((m.params("c"), m["w"].shape))
        return None

    explain(lambda a: jnp.log(jnp.exp(a)), jnp.ones(4), rulesets=[Ruleset("p", [
        rule(Pat("log", Pat.optional("convert_element_type", Pat("exp", X), params="c", name="w")), read,
             name="read")], soundness="identity")])
    assert kinds == [(None, (4,))]
    with pytest.raises(ValueError, match="one primitive of one operand"):
        Pat.optional("add", X)


def test_a_function_right_side_declines_with_none_and_guards_name_bindings():
    calls = []
    r = rule(Pat("reduce_sum", X, params="p"), lambda x, p: None if calls.append(p.axes) is None else x,
             name="never")
    report = explain(lambda a: a.sum(0), jnp.ones((2, 3)), rulesets=[Ruleset("n", [r], soundness="exact")])
    assert report.fired == {} and calls == [(0,)]
    guarded = rule(Pat("neg", X, name="n"), lambda x: x, when=lambda n, x: n.ndim > 5, name="guarded")
    report = explain(lambda a: -a, jnp.ones(3), rulesets=[Ruleset("g", [guarded], soundness="fastmath")])
    assert report.fired == {}


def test_a_match_whose_params_carry_a_sharding_is_declined():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
    sh = NamedSharding(mesh, P())
    r = rule(Pat("reshape", Pat("neg", X), params="p"), lambda x, p: -p.bind(x), name="reshape_neg")
    rs = Ruleset("r", [r], soundness="exact")
    assert explain(lambda a: (-a).reshape(6), jnp.ones((2, 3)), rulesets=[rs]).fired == {"reshape_neg": 1}
    report = explain(lambda a: lax.reshape_p.bind(-a, new_sizes=(6,), dimensions=None, sharding=sh),
                     jnp.ones((2, 3)), rulesets=[rs])
    assert report.fired == {} and report.rejected == {"reshape_neg": {"declined": 1}}


def test_shape_derived_literals_match_at_every_size():
    r = rule(lambda x: x.sum(0) / x.shape[0], lambda x: x.sum(0) * (1.0 / x.shape[0]), name="mean_mul")
    rs = Ruleset("m", [r], soundness="identity")
    for n in (2, 3, 7):
        assert explain(lambda a: a.mean(0), jnp.ones((n, 4)), rulesets=[rs]).fired == {"mean_mul": 1}
    # the literal must still be the shape's: a sum divided by another number is not a mean
    assert explain(lambda a: a.sum(0) / 5.0, jnp.ones((7, 4)), rulesets=[rs]).fired == {}
    # constant literals stay exact in the query
    one = rule(lambda x: x * 1, lambda x: x, name="mul_one")
    assert all("_shape" not in q.text for q in one.queries)


# ---------------------------------------------------------------------- sides traced once for every shape
def _traced_rules():
    import rulesets

    out = []
    for pack in (rulesets.algebra, rulesets.derivatives, rulesets.fastmath, rulesets.nn, rulesets.linalg):
        for r, _ in pack.entries():
            if not r.is_pat:
                out.append(r)
    return out


def test_elementwise_sides_at_a_new_shape_are_the_sides_traced_there():
    """``Rule.traced`` gives a rule's sides at a new shape by retyping those traced at another, where both were
    elementwise there (``_rules._retyped``). For every traced rule of the built-in packs, at shapes, dtypes and
    weak types that its traces see, the retyped programs must be the programs tracing gives there, equation
    for equation; the sides that are not elementwise are traced."""
    from jax._src import core

    from rewrite.jaxpr.trace import trace_at

    retyped = traced = 0
    for r in _traced_rules():
        n = len(r.var_names)
        for dtype, weak in ((jnp.float32, False), (jnp.float32, True), (jnp.int32, False)):
            first = tuple(core.ShapedArray((3,), dtype, weak_type=weak) for _ in range(n))
            fresh = Rule.__new__(Rule)
            fresh.__dict__.update({**r.__dict__, "_traced": {}, "_elementwise": {}})
            try:
                fresh.traced(first)
            except Exception:
                continue
            for shape in ((2, 5), (1,), (4, 1, 2)):
                avals = tuple(core.ShapedArray(shape, dtype, weak_type=weak) for _ in range(n))
                was_retyped = bool(fresh._elementwise)
                try:
                    got = fresh.traced(avals)
                except Exception:
                    continue
                want = (trace_at(r.lhs, avals), None if r.is_procedural else trace_at(r.rhs, avals))
                for g, w in zip(got, want):
                    assert (g is None) == (w is None)
                    if g is not None:
                        assert str(g.jaxpr) == str(w.jaxpr), (r.name, shape, dtype, weak)
                        assert [v.aval for v in g.jaxpr.outvars] == [v.aval for v in w.jaxpr.outvars]
                retyped += was_retyped
                traced += not was_retyped
    assert retyped >= 50 and traced >= 20, (retyped, traced)


def test_a_rule_traced_elementwise_at_one_shape_is_still_an_identity_at_another():
    """A rule whose Python branches on the shape is elementwise at one shape and not at another; after a rewrite
    at the first, the sides used at the second are those of the first, retyped (tracing there would not match),
    and the rewrite must keep every value there."""
    def lhs(x):
        if x.shape[0] < 5:
            return x * 2.0 * 0.5
        return jnp.broadcast_to(x.sum(0, keepdims=True), x.shape) * 0.0 + x * 2.0 * 0.5

    mine = Ruleset("mine", [rule(lhs, lambda x: x, name="double")])

    def f(a):
        return jnp.sin(a * 2.0 * 0.5)

    small = jnp.linspace(-2.0, 2.0, 12).reshape(2, 6)
    big = jnp.linspace(-3.0, 3.0, 48).reshape(8, 6)
    assert explain(f, small, rulesets=[mine]).fired == {"double": 1}
    report = explain(f, big, rulesets=[mine])
    assert report.fired == {"double": 1}  # from the sides retyped: traced at (8, 6), the left side has a sum
    assert "mul" not in str(report.after)
    np.testing.assert_array_equal(np.asarray(rewrite(f, rulesets=[mine], cache=False)(big)), np.asarray(f(big)))


# ---------------------------------------------------------------- example_inputs= and example_program=
def test_example_is_split_into_inputs_and_a_program_and_the_old_spelling_still_works():
    """``example=`` meant the pattern variables' shapes for a rule of two functions and a program
    ``(fn, args)`` for a Pat rule; each now has its own name, and ``example=`` warns and means what it did."""
    f32 = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    sides = (lambda x: jnp.log(1.0 + x), lambda x: jnp.log1p(x))
    new = rule(*sides, name="log1p", example_inputs=(f32,))
    assert new.example == new.probes[0] and new.probes[0][0].shape == (2, 3)
    pat, program = Pat("neg", Pat("neg", Pat.var("x"))), (lambda x: -(-x), (f32,))
    made = rule(pat, lambda x: x, name="neg_neg", example_program=program)
    assert made.program[0] is program[0] and made.program[1][0].shape == (2, 3)

    with pytest.warns(DeprecationWarning, match=r"example= is deprecated.*example_inputs=.*example_program=") as w:
        old = rule(*sides, name="log1p", example=(f32,))
    assert w[0].filename == __file__  # it points at the line that used it
    assert old.example == new.example and old.probes == new.probes
    with pytest.warns(DeprecationWarning):
        old = rule(pat, lambda x: x, name="neg_neg", example=program)
    assert old.program == made.program

    with pytest.raises(ValueError, match="example_program= is for a Pat rule"):
        rule(*sides, name="log1p", example_program=program)
    with pytest.raises(ValueError, match="a Pat rule has no function to trace at example_inputs="):
        rule(pat, lambda x: x, name="neg_neg", example_inputs=(f32,))
    with pytest.raises(ValueError, match="not also example="), pytest.warns(DeprecationWarning):
        rule(*sides, name="log1p", example=(f32,), example_inputs=(f32,))


# ---------------------------------------------------------------- Match.product: the product rules' prologue
def test_a_product_rule_reads_its_match_as_an_einsum_and_declines_mixed_dtypes():
    from rewrite.rules.builder import _trace_key

    seen = []

    @procedural
    def swap(m):  # (a b)^T -> b^T a^T for matrices
        p = m.product("p")
        seen.append(None if p is None else p.labels)
        if p is None or tuple(m.params("t")["permutation"]) != (1, 0) or p.dimension_numbers[1][0]:
            return None
        (lc, rc), _ = p.dimension_numbers
        fn = lambda a, b: p.dot(b, a, ((rc, lc), ((), ())))  # noqa: E731
        assert _trace_key(fn, (p.rhs.aval, p.lhs.aval)) is not None  # a closure over p is traced once
        return m.trace(fn, p.lhs, p.rhs)

    rs = Ruleset("s", [rule(Pat("transpose", Pat("dot_general", Pat.var("a"), Pat.var("b"), params="p"), params="t"),
                            swap, name="swap")], soundness="identity")
    a, b = jnp.arange(12.0).reshape(3, 4), jnp.arange(20.0).reshape(4, 5)
    f = lambda a, b: (a @ b).T  # noqa: E731
    assert explain(f, a, b, rulesets=[rs]).fired == {"swap": 1}
    assert seen == [((0, 1), (1, 3), (0, 3))]  # ij,jk->ik, labels i=0 j=1 k=3
    np.testing.assert_array_equal(rewrite(f, rulesets=[rs])(a, b), f(a, b))

    seen.clear()  # int8 operands accumulated in int32: left alone
    g = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32).T  # noqa: E731
    r = explain(g, a.astype(jnp.int8), b.astype(jnp.int8), rulesets=[rs])
    assert seen == [None] and not r.fired


def test_a_rule_keeps_its_traces_for_the_shapes_used_last(monkeypatch):
    # Rules live as long as the process: a trace kept per new input shape grew without bound (issue 48).
    import rewrite.rules.rule as rule_module

    monkeypatch.setattr(rule_module, "TRACED_KEEP", 4)
    r = rule(lambda x: jnp.sum(x @ x.T), lambda x: jnp.sum(jnp.sum(x, 0) ** 2), name="sum_gram")
    avals = [(jax.core.ShapedArray((n, 3), jnp.float32),) for n in range(2, 12)]
    first = str(r.traced(avals[0])[1])
    for a in avals:
        r.traced(a)
    r.traced(avals[-4])  # used again: the last to go
    r.traced(avals[0])  # traced again, and the same program
    assert list(r._traced) == [avals[-3], avals[-2], avals[-1], avals[-4], avals[0]][-4:]
    assert str(r.traced(avals[0])[1]) == first


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_value_terms_along_reads_the_terms_an_add_or_sub_broadcasts_along_an_axis(dtype):
    """``Value.terms_along``: ``(b + (z - a)) - c`` along axis 1 is ``z`` and the terms ``-c``, ``+b``, ``-a``
    (outermost first) where ``a``, ``b``, ``c`` are of size 1 there; a full-size operand, an operand of another
    rank, and the ``most`` limit end the walk. ``log_softmax``'s two subtracted terms are read so too."""
    seen = []

    @procedural
    def look(m):
        x = m["x"]
        for most in (8, 2):
            base, terms = x.terms_along(1, most=most)
            seen.append((most, base.shape, [(s, t.shape) for s, t in terms], base.node("exp") is not None))
        return None

    pack = Ruleset("look", [rule(Pat("reduce_max", Pat.var("x"), params="r"), look, name="look")])
    one, full, row = jnp.ones((4, 1), dtype), jnp.ones((4, 5), dtype), jnp.ones((5,), dtype)
    explain(lambda z, a, b, c: jnp.max((b + (z - a)) - c, axis=1), full, one, one, one, rulesets=[pack])
    assert seen == [(8, (4, 5), [(-1, (4, 1)), (1, (4, 1)), (-1, (4, 1))], False),
                    (2, (4, 5), [(-1, (4, 1)), (1, (4, 1))], False)]
    seen.clear()
    explain(lambda z, a, c: jnp.max((z - a) - c, axis=1), full, one, full, rulesets=[pack])  # c full: no term
    explain(lambda z, r: jnp.max(z - r, axis=1), full, row, rulesets=[pack])  # r of another rank: no term
    assert seen == [(8, (4, 5), [], False), (2, (4, 5), [], False)] * 2
    seen.clear()
    explain(lambda z: jnp.max(jax.nn.log_softmax(jnp.exp(z), axis=1), axis=1), full, rulesets=[pack])
    assert [(signs, from_exp) for most, _, terms, from_exp in seen if most == 8 and (signs := [s for s, _ in terms])] \
        == [([-1, -1], True)]  # (exp(z) - max) - log(sum); the max inside it reads exp(z), no term


def test_value_max_under_finds_the_row_max_a_shift_is_made_from():
    """``Value.max_under``: the shift ``jax.nn.softmax`` makes (``stop_gradient``, ``max(-inf, .)``, broadcast) and
    a converted, reshaped max lead to ``max(z, 1)``; a max over the other axis, of another value, or a shift
    with another operand in it is not the row max."""
    seen = []

    @procedural
    def look(m):
        z, shift = m["z"], m["s"]
        if z.ndim == 2 and shift.ndim == 2:
            found = shift.max_under(z, 1)
            seen.append(None if found is None else (found.shape, found.node("reduce_max").operands[0].name == z.name))
        return None

    pack = Ruleset("look", [rule(Pat("sub", Pat.var("z"), Pat.var("s")), look, name="look")])
    z, y = jnp.ones((4, 5)), jnp.ones((4, 5))
    max_of = lambda a, axis: jnp.max(a, axis=axis, keepdims=True)
    explain(lambda z: z - jax.lax.stop_gradient(max_of(z, 1)), z, rulesets=[pack])
    explain(lambda z: z - jnp.maximum(-jnp.inf, max_of(z, 1)), z, rulesets=[pack])
    explain(lambda z: z - jnp.max(z, axis=1).astype(jnp.bfloat16).astype(jnp.float32).reshape(4, 1), z,
            rulesets=[pack])
    assert seen == [((4,), True)] * 3
    seen.clear()
    explain(lambda z: z - max_of(z, 0), z, rulesets=[pack])
    explain(lambda z, y: z - max_of(y, 1), z, y, rulesets=[pack])
    explain(lambda z, y: z - (max_of(z, 1) + y[:, :1]), z, y, rulesets=[pack])
    assert seen and set(seen) == {None}


def test_value_max_under_rows_follows_each_axis_back_to_its_own_row():
    """``Value.max_under(..., rows=True)``: the max put back on its own rows (``keepdims``, a broadcast, a
    transpose there and back, ``max(-inf, .)``, several axes, the max of a transposed operand) is found; a max
    put on other rows (transposed once), over another axis, of another value, or reached through a reshape is
    not."""
    seen = []

    @procedural
    def look(m):
        z, shift = m["z"], m["s"]
        if z.ndim == 3 and shift.ndim == 3:
            found = shift.max_under(z, seen_axes[0], rows=True)
            seen.append(None if found is None else found.shape)
        return None

    pack = Ruleset("look", [rule(Pat("sub", Pat.var("z"), Pat.var("s")), look, name="look")])
    z = jnp.arange(48.0).reshape(4, 4, 3) % 7
    max_of = lambda a, axis: jnp.max(a, axis=axis, keepdims=True)
    seen_axes = [2]
    explain(lambda z: z - jax.lax.stop_gradient(max_of(z, 2)), z, rulesets=[pack])
    explain(lambda z: z - jnp.maximum(-jnp.inf, jnp.broadcast_to(max_of(z, 2), z.shape)), z, rulesets=[pack])
    explain(lambda z: z - jnp.swapaxes(jnp.swapaxes(max_of(z, 2), 0, 1), 0, 1), z, rulesets=[pack])
    explain(lambda z: jnp.swapaxes(z, 0, 1) - max_of(jnp.swapaxes(z, 0, 1), 2), z, rulesets=[pack])
    assert seen == [(4, 4)] * 4
    seen.clear()
    explain(lambda z: z - jnp.swapaxes(max_of(z, 2), 0, 1), z, rulesets=[pack])  # row (i, j) gets max of (j, i)
    explain(lambda z: z - max_of(z, 1), z, rulesets=[pack])
    explain(lambda z: z - max_of(z + 1.0, 2), z, rulesets=[pack])
    explain(lambda z: z - jnp.max(z, axis=2).reshape(4, 4, 1), z, rulesets=[pack])
    assert seen and set(seen) == {None}
    seen.clear()
    seen_axes[0] = (1, 2)
    explain(lambda z: z - max_of(z, (1, 2)), z, rulesets=[pack])
    explain(lambda z: z - max_of(z, 2), z, rulesets=[pack])
    assert seen == [(4,), None]


def test_params_takes_along_last_reads_a_label_gather_only():
    """``Params.takes_along_last``: ``take_along_axis`` along the last axis (2-D and 3-D, and with a batch of
    one, which JAX writes as an offset axis) is one element per row; along the first axis, a gather of whole
    rows (``x[i]``), and a slice of two are not."""
    def gathers(fn, *args):
        found = []

        def walk(jaxpr):
            for e in jaxpr.eqns:
                if e.primitive.name == "gather":
                    found.append(Params(e.primitive, e.params).takes_along_last(e.invars[0].aval.shape,
                                                                                e.invars[1].aval.shape))
                if "jaxpr" in e.params:  # take_along_axis is a jit of its own
                    walk(getattr(e.params["jaxpr"], "jaxpr", e.params["jaxpr"]))
        walk(jax.make_jaxpr(fn)(*args).jaxpr)
        return found

    i2, i3 = jnp.zeros(4, jnp.int32), jnp.zeros((2, 4), jnp.int32)
    assert gathers(lambda x, i: jnp.take_along_axis(x, i[:, None], axis=-1), jnp.ones((4, 5)), i2) == [True]
    assert gathers(lambda x, i: jnp.take_along_axis(x, i[..., None], axis=-1), jnp.ones((2, 4, 5)), i3) == [True]
    assert gathers(lambda x, i: jnp.take_along_axis(x, i[..., None], axis=-1), jnp.ones((1, 4, 5)), i3[:1]) == [True]
    assert gathers(lambda x, i: jnp.take_along_axis(x, i[None, :], axis=0), jnp.ones((5, 4)), i2) == [False]
    assert gathers(lambda x, i: x[i], jnp.ones((5, 4)), i2) == [False]
    assert gathers(lambda x, i: jnp.take_along_axis(x, jnp.stack([i, i], 1), axis=-1), jnp.ones((4, 5)), i2) \
        == [False]


# ---------------------------------------------------------------- anchored rules (rule(..., anchor=))
def _declared(monkeypatch) -> list:
    """Every egglog program declared into an e-graph from now on: the preludes taken from the pool, and what an
    engine declares on its own (an anchored rule whose primitive a rule built)."""
    from rewrite.ir import egraph as _egraph

    texts: list = []
    take, declare = _egraph._Pool.take, _egraph.EGraph.declare
    monkeypatch.setattr(_egraph._Pool, "take", lambda self, schema, prelude: texts.append(prelude)
                        or take(self, schema, prelude))
    monkeypatch.setattr(_egraph.EGraph, "declare", lambda self, program: texts.append(program)
                        or declare(self, program))
    return texts


def _tanh_factor():
    return rule(lambda x, y: jnp.tanh(x) * y + y, lambda x, y: (jnp.tanh(x) + 1.0) * y, name="tanh_factor",
                anchor="tanh")  # tanh(x)·y + y -> (tanh(x) + 1)·y


def test_an_anchored_rule_queries_the_part_of_its_left_side_around_the_anchor():
    """The query is the smallest part of the left side that holds the anchor and binds every variable; the match
    of the whole is found by looking it up, so the rule fires where the whole is, with the same value."""
    from rewrite.rules.pattern import commuted

    r = _tanh_factor()
    plain = rule(r.lhs, r.rhs, name="tanh_factor_plain")
    assert [len(q.atoms) for q in r.queries] == [2] and [len(q.atoms) for q in plain.queries] == [3]
    assert sum(len(commuted(q)) for q in r.queries) < sum(len(commuted(q)) for q in plain.queries)
    f = lambda x, y: jnp.tanh(x) * y + y  # noqa: E731
    x, y = jnp.linspace(-2.0, 2.0, 6), jnp.linspace(1.0, 3.0, 6)
    rep = explain(f, x, y, rulesets=[Ruleset("a", [r], soundness="identity")])
    assert rep.fired == {"tanh_factor": 1} and rep.result.stats["tanh_factor"].matched == 1
    np.testing.assert_allclose(jaxpr_as_fun(rep.after)(x, y)[0], f(x, y), rtol=1e-6)
    # the part alone (a product with a tanh, no "+ y") is no match
    assert explain(lambda x, y: jnp.tanh(x) * y, x, y, rulesets=[Ruleset("a", [r], soundness="identity")]).fired == {}
    with pytest.raises(ValueError, match="anchor='exp': no part of the left side holds a exp"):
        rule(r.lhs, r.rhs, name="no_exp", anchor="exp")
    with pytest.raises(ValueError, match="anchor= names a primitive"):
        rule(Pat("tanh", Pat.var("x")), lambda x: x, name="pat_anchor", anchor="tanh")


def test_an_anchored_rule_is_declared_only_once_its_anchor_is_in_the_egraph(monkeypatch):
    """A program without a tanh never declares the anchored rule's query. Where another rule's replacement builds
    the first tanh, the engine declares it then, and it fires on what that replacement made, in a second rewrite
    too (the declaration is undone when the pooled e-graph goes back). The pooled e-graph's own queries (its
    prelude) never hold it, so programs with and without a tanh share one."""
    from rewrite.rules.pattern import commuted

    texts = _declared(monkeypatch)
    r = _tanh_factor()
    ours = [v.text for q in r.queries for v in commuted(q)]
    to_tanh = rule(lambda x: 2.0 * jax.nn.sigmoid(2.0 * x) - 1.0, lambda x: jnp.tanh(x), name="sigmoid_to_tanh")
    pack = Ruleset("lazy", [to_tanh, r], soundness="identity")
    x, y = jnp.linspace(-2.0, 2.0, 6), jnp.linspace(1.0, 3.0, 6)
    assert explain(lambda x, y: jnp.sin(x) * y + y, x, y, rulesets=[pack]).fired == {}
    assert texts and not any(q in t for t in texts for q in ours)  # never declared
    f = lambda x, y: (2.0 * jax.nn.sigmoid(2.0 * x) - 1.0) * y + y  # noqa: E731
    for _ in range(2):
        del texts[:]
        rep = explain(f, x, y, rulesets=[pack])
        assert rep.fired == {"sigmoid_to_tanh": 1, "tanh_factor": 1}, rep.fired
        assert not any(q in texts[0] for q in ours) and any(q in t for t in texts[1:] for q in ours)
        np.testing.assert_allclose(jaxpr_as_fun(rep.after)(x, y)[0], f(x, y), rtol=1e-5)
    del texts[:]
    assert explain(lambda x, y: jnp.tanh(x) * y + y, x, y, rulesets=[pack]).fired == {"tanh_factor": 1}
    # a program with a tanh declares it up front, in the e-graph it borrows: the pooled one's queries are the same
    assert not any(q in texts[0] for q in ours) and any(q in t for t in texts[1:] for q in ours)


def test_an_anchored_match_waits_for_the_rest_of_its_left_side():
    """The part matches before a later rule builds the rest of the left side over the same classes (nothing the
    part binds changes): the match is looked at again each iteration, and fires once the whole is there."""
    r = _tanh_factor()
    sub_neg = rule(lambda a, b: a - (-b), lambda a, b: a + b, name="sub_neg_l")  # a - (-b) -> a + b
    pack = Ruleset("wait", [sub_neg, r], soundness="identity")
    f = lambda x, y: jnp.tanh(x) * y - (-y)  # noqa: E731
    x, y = jnp.linspace(-2.0, 2.0, 6), jnp.linspace(1.0, 3.0, 6)
    rep = explain(f, x, y, rulesets=[pack])
    assert rep.fired == {"sub_neg_l": 1, "tanh_factor": 1}, rep.fired
    np.testing.assert_allclose(jaxpr_as_fun(rep.after)(x, y)[0], f(x, y), rtol=1e-6)


def test_the_rules_that_match_one_product_in_a_snapshot_read_it_once():
    """``Match.product`` answers from the saturation's memo of the snapshot (the linalg rules each read the same
    ``dot_general``s): every answer is the one :meth:`Match._product` computes afresh for that match, and two rules
    matching one product share it. ``a @ b`` and ``a @ c`` have the same params and left operand, so a memo keyed
    without the right one answers the second with the first's; one keyed without the left, ``a @ b`` and ``d @ b``."""
    got = []

    def probe(tag):
        @procedural
        def read(m):
            p, fresh = m.product("p"), m._product("p", "a", "b", (), ())
            got.append((tag, m.root.name, p, (p.lhs.name, p.rhs.name, p.labels, p.dimension_numbers),
                        (fresh.lhs.name, fresh.rhs.name, fresh.labels, fresh.dimension_numbers), (m["a"].name, m["b"].name)))
        return read

    pat = Pat("dot_general", Pat.var("a"), Pat.var("b"), params="p")
    rs = Ruleset("probes", [rule(pat, probe(t), name=f"probe_{t}") for t in ("one", "two")], soundness="exact")
    a, b = jnp.ones((3, 4)), jnp.ones((4, 5))
    explain(lambda a, b, c, d: (a @ b, a @ c, d @ b), a, b, b + 1, a + 1, rulesets=[rs])
    roots = {root for _, root, *_ in got}
    assert len(roots) == 3 and len(got) == 6, got
    for tag, root, p, read, fresh, bound in got:
        assert read == fresh and read[:2] == bound, (tag, read, fresh, bound)
    for root in roots:
        one, two = [p for _, r, p, *_ in got if r == root]
        assert one is two  # the second rule's answer is the first's, read once
