"""rewrite.testing: the checker must reject unsound rules by name, accept sound ones, and never pass vacuously.

Also: the value strategies give each soundness class what it promises, the
comparison means what the docs say, assert_equivalent catches a program
broken by an unsound rule (in values and in gradients), and random programs
cover the primitives they claim and survive the round trip bit for bit.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st
from jax import lax
from jax._src import core

from rewrite import Pat, Ruleset, Tolerance, procedural, rule
from rewrite.report.report import count_eqns, primitive_counts
from rewrite.testing import (
    VacuousCheckWarning,
    arrays,
    assert_equivalent,
    assert_same_results,
    check_ruleset,
    elements,
    inputs_like,
    mismatch,
    programs,
    value_bound,
)


def _one(name, lhs, rhs, soundness="exact", **kw):
    return Ruleset(f"user_{name}", [rule(lhs, rhs, name=name, **kw)], soundness=soundness)


# ---------------------------------------------------------------- the list
UNSOUND = [
    ("cancel_div", lambda x, y: (x * y) / y, lambda x, y: x),
    ("sqrt_square", lambda x: jnp.sqrt(x * x), lambda x: x),
    ("exp_log", lambda x: jnp.exp(jnp.log(x)), lambda x: x),
    ("sub_self", lambda x: x - x, lambda x: jnp.zeros_like(x)),
]


@pytest.mark.parametrize("name,lhs,rhs", UNSOUND, ids=[u[0] for u in UNSOUND])
def test_unsound_exact_rules_are_rejected_by_name(name, lhs, rhs):
    with pytest.raises(AssertionError) as info:
        check_ruleset(_one(name, lhs, rhs))
    text = str(info.value)
    assert f"rule {name!r} [user_{name}, exact] does not hold" in text
    # the shrunk counterexample and both results are shown
    assert "    x = float32" in text and "  original  = " in text and "  rewritten = " in text


@pytest.mark.parametrize("soundness", ["identity", "fastmath"])
@pytest.mark.parametrize("name,lhs,rhs", UNSOUND[:3], ids=[u[0] for u in UNSOUND[:3]])
def test_rules_false_in_real_arithmetic_fail_every_class(name, lhs, rhs, soundness):
    with pytest.raises(AssertionError, match=f"rule {name!r} .* does not hold"):
        check_ruleset(_one(name, lhs, rhs, soundness))


@pytest.mark.parametrize("factor", [1.01, 1.0])
def test_a_rule_is_compared_in_its_one_step_not_in_forms_its_repeats_built(factor):
    """Associativity 1% off, as fastmath's ``mul_assoc_right`` written wrong: saturated, the rule's own repeated
    applications (matched in both operand orders) built ``c * (a * b)`` in the matched class, which the check then
    compared with ``(a * b) * c`` and passed. Checked in its one step, only its own right side can stand in for
    the match. The sound rule (factor 1) still passes."""
    ruleset = Ruleset("user_assoc", [rule(lambda a, b, c: lax.mul(lax.mul(a, b), c),
                                          lambda a, b, c: lax.mul(a, lax.mul(b, c)) * factor,
                                          name="mul_assoc_right")], soundness="fastmath")
    if factor == 1.0:
        check_ruleset(ruleset)
    else:
        with pytest.raises(AssertionError, match="rule 'mul_assoc_right' .* does not hold"):
            check_ruleset(ruleset)


@pytest.mark.parametrize("factor", [1.01, 1.0])
def test_a_rule_over_a_gather_is_compared_at_indices_in_range(factor):
    """The LM head's label rules written 1% off passed (the mutation audit): integer inputs drawn over their whole
    range put nearly every index out of bounds, the gather filled NaN, and a sum over the 8 tokens was NaN on both
    sides in every example. Half the draws now move each integer input into the range of the case's axes."""
    at = (jax.ShapeDtypeStruct((16,), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.int32))
    ruleset = _one("sum_take", lambda x, i: jnp.sum(jnp.take(x, i, axis=0, mode="fill")),
                   lambda x, i: jnp.sum(jnp.take(x, i, axis=0, mode="fill")) * factor, "identity", example_inputs=at)
    if factor == 1.0:
        check_ruleset(ruleset)
    else:
        with pytest.raises(AssertionError, match="rule 'sum_take' .* does not hold"):
            check_ruleset(ruleset)


@pytest.mark.parametrize("sound", [False, True])
def test_a_16_bit_case_is_compared_within_a_tenth_at_most(sound):
    """A tolerance scales with the dtype's epsilon, 65536 times float32's for bfloat16: attention's
    Tolerance(2e-4, 2e-5) became 13 relative, and a bfloat16 rule with its sign flipped kept its values (the mutation
    audit). A check compares values within rewrite.testing._compare.MOST (0.1) at most, as it does derivatives."""
    at = (jax.ShapeDtypeStruct((3,), jnp.bfloat16),)
    rhs = (lambda x: x + x) if sound else (lambda x: x * -2.0)
    ruleset = Ruleset("user_bf16", [rule(lambda x: x * 2.0, rhs, name="double", example_inputs=at)],
                      soundness="identity", tolerance=Tolerance(rtol=2e-4, atol=2e-5))
    if sound:
        check_ruleset(ruleset, derivatives=False)
    else:
        with pytest.raises(AssertionError, match="rule 'double' .* does not hold: at"):
            check_ruleset(ruleset, derivatives=False)


@jax.custom_jvp
def _steep(v):
    return v


_steep.defjvp(lambda p, t: (p[0], t[0] * 1.01))  # the value kept, its derivative 1% off


@pytest.mark.parametrize("wrong", [True, False])
def test_a_rule_checked_with_constants_keeps_its_derivatives_along_its_parameters(wrong):
    """``x / c -> x * (1 / c)`` for a constant ``c`` is checked with its inputs as constants (the procedure reads
    ``c.constant``), where the program has no derivative: a replacement whose derivative along ``x`` was 1% off
    passed (the mutation audit). Each input the rule still fires with as a parameter is now differentiated."""
    @procedural
    def times_reciprocal(m):
        c = m["c"].constant
        if c is None or c == 0:
            return None
        return m.trace(lambda x: (_steep if wrong else (lambda v: v))(x * (np.float32(1) / c).astype(x.dtype)), m["x"])

    at = (jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))
    ruleset = _one("div_const", lambda x, c: x / c, times_reciprocal, "fastmath", example_inputs=at)
    if wrong:
        with pytest.raises(AssertionError, match="rule 'div_const' .* does not hold: JAX's derivative changed"):
            check_ruleset(ruleset, max_examples=10)
        check_ruleset(ruleset, max_examples=10, derivatives=False)  # the values are kept
    else:
        assert all("as constants" in c for c in check_ruleset(ruleset, max_examples=10).rules["div_const"].cases)


# ---------------------------------------------------------------- derivatives (issue 29)
KINKED = [  # each keeps every value and changes JAX's derivative somewhere
    ("abs_neg", lambda x: jnp.abs(-x), lambda x: jnp.abs(x), "exact"),                       # at ±0: -1 vs +1
    ("relu_where", lambda x: jnp.maximum(x, 0.0), lambda x: jnp.where(x > 0, x, 0.0), "identity"),  # at 0: 0.5 vs 0
    ("clip_minmax", lambda x: jnp.clip(x, -1.0, 1.0), lambda x: jnp.where(x > 1.0, 1.0, jnp.where(x < -1.0, -1.0, x)),
     "identity"),                                                                              # at ±1: 0.5 vs 1
]


@pytest.mark.parametrize("name,lhs,rhs,soundness", KINKED, ids=[k[0] for k in KINKED])
def test_rules_that_change_a_derivative_at_a_kink_are_rejected(name, lhs, rhs, soundness):
    ruleset = _one(name, lhs, rhs, soundness)
    with pytest.raises(AssertionError) as info:
        check_ruleset(ruleset)
    text = str(info.value)
    assert f"rule {name!r} [user_{name}, {soundness}] does not hold: JAX's derivative changed" in text, text
    assert "    tangent of x = float32" in text and "  original tangent  = " in text
    check_ruleset(ruleset, derivatives=False)  # the values are kept


def _square_with_backward(backward):
    @jax.custom_vjp
    def square(x):
        return x * x
    square.defvjp(lambda x: (x * x, x), lambda x, g: (backward(x, g),))
    return square


def test_a_loop_rounded_as_written_undoes_xla_s_fused_multiply_adds():
    """``as_written`` runs a loop's body one operation at a time: compiled, XLA:CPU computes ``a * b + c * d``
    as one fused multiply-add (finite here), as written ``a * b`` overflows first. A derivative that differs
    from the original's only so passes ``derivative_mismatch`` given the as-written one, and not without."""
    from rewrite.testing import derivative_mismatch
    from rewrite.testing._run import _evaluate, as_written

    def loop(a, b, c, d):
        return lax.scan(lambda s, x: (s + (x[0] * x[1] + x[2] * x[3]), None), jnp.zeros_like(a[0]),
                        (a, b, c, d))[0]

    args = [np.full((3, 4), v, np.float32) for v in (-93841.06, -3.6623268e33, 123.39553, -2.0850995e36)]
    closed = jax.make_jaxpr(loop)(*args)
    compiled, written = _evaluate(closed, args)[0], as_written(closed, args)[0]
    assert np.isposinf(written).all()
    fused = np.full(4, 3 * (-93841.06 * -3.6623268e33 + 123.39553 * -2.0850995e36), np.float32)  # rounded once
    if np.isfinite(compiled).all():  # XLA:CPU contracts (x86-64 with FMA): the compiled loop is the fused one
        np.testing.assert_allclose(compiled, fused, rtol=1e-5)
    value = np.ones(4, np.float32)
    assert derivative_mismatch(value, fused, written) is not None
    assert derivative_mismatch(value, fused, written, written=written) is None
    # only where the rewrite is what the original computes as written
    assert derivative_mismatch(value, fused, np.zeros(4, np.float32), written=written) is not None


def test_compiled_derivatives_are_kept_least_recently_used_first(monkeypatch):
    """A rule checked with its inputs as constants makes a program per example: the derivatives compiled for
    them are not all kept (a long run kept every program and its executable); the one in use stays."""
    from rewrite.testing import _run

    monkeypatch.setattr(_run, "_JVPS", {})
    monkeypatch.setattr(_run, "_JVPS_KEPT", 3)
    x = [np.ones(3, np.float32)]
    used = jax.make_jaxpr(lambda x: jnp.sin(x) * x)(*x)
    for i in range(5):
        _run._tangents(used, x, x)
        _run._tangents(jax.make_jaxpr(lambda x, i=i: jnp.sin(x) * x + i)(*x), x, x)
    assert len(_run._JVPS) == 3
    assert any(entry[0] is used for entry in _run._JVPS.values())
    np.testing.assert_allclose(_run._tangents(used, x, x)[0], np.cos(1.0) + np.sin(1.0), rtol=1e-6)


def test_a_rules_cases_that_cannot_compile_together_are_each_run_alone(monkeypatch):
    """A rule's derivative cases are compiled as one executable; where one case cannot be differentiated in
    reverse mode (a while loop), the others are still run, each alone, and the group is not tried again."""
    from rewrite.testing import _run

    monkeypatch.setattr(_run, "_JVPS", {})
    x = [np.full(3, 0.5, np.float32)]
    good = jax.make_jaxpr(lambda x: jnp.sin(x) * x)(*x)
    bad = jax.make_jaxpr(lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0),
                                                  (0, x))[1])(*x)
    group = [(good, good, "vjp"), (bad, bad, "vjp")]
    traces = []
    jit = jax.jit

    def counted(f, *a, **k):  # each trace of what _both compiles
        return jit(lambda *xs: traces.append(f) or f(*xs), *a, **k)

    monkeypatch.setattr(_run.jax, "jit", counted)
    want = (np.cos(0.5) * 0.5 + np.sin(0.5)) * 0.5  # the cotangent is x
    for _ in range(2):
        before, after = _run._both(good, good, "vjp", x, x, group)
        np.testing.assert_allclose(before[0], want, rtol=1e-6)
        np.testing.assert_array_equal(before[0], after[0])
    assert len(traces) == 2, traces  # the group once, then the pair alone once: the group is not traced again
    with pytest.raises(Exception):  # the case that cannot be differentiated still raises alone
        _run._both(bad, bad, "vjp", x, x, group)


def test_a_replacement_with_a_wrong_backward_of_its_own_is_rejected_in_reverse_mode():
    # Forward values are exact and forward mode differentiates the program as written, so only jax.vjp
    # of the rewritten program can show a hand-written backward's mistake (here: d(x*x) = x, not 2x).
    wrong = _one("square_half_vjp", lambda x: x * x, lambda x: _square_with_backward(lambda x, g: x * g)(x))
    with pytest.raises(AssertionError) as info:
        check_ruleset(wrong, max_examples=10)
    text = str(info.value)
    assert "does not hold: JAX's reverse-mode derivative (vjp) changed" in text, text
    assert "    cotangent of output 0 = float32" in text and "  original cotangent  = " in text
    check_ruleset(wrong, derivatives=False)  # the values are kept
    right = _one("square_own_vjp", lambda x: x * x, lambda x: _square_with_backward(lambda x, g: 2.0 * x * g)(x))
    assert check_ruleset(right, max_examples=10).rules["square_own_vjp"].examples == 10


def test_derivative_mismatch_skips_nan_values_and_lets_a_rewrite_do_better():
    from rewrite.testing import derivative_mismatch

    value, want = np.float32([np.nan, 1.0, np.inf, 2.0]), np.float32([1.0, np.nan, 3.0, 1.0])
    assert derivative_mismatch(value, want, np.float32([-1.0, 0.5, -3.0, 1.0])) is None
    assert "at [3]" in derivative_mismatch(value, want, np.float32([-1.0, 0.5, -3.0, np.nan]))
    assert derivative_mismatch(value, want, np.float32([1.0, 1.0, 3.0, 1.0 + 1e-6])) is None  # within tolerance


def test_sub_self_is_an_identity_but_not_exact():
    # x - x is 0 for every finite x; only inf and NaN tell it apart.
    check_ruleset(_one("sub_self", lambda x: x - x, lambda x: jnp.zeros_like(x), "identity"))
    with pytest.raises(AssertionError, match=r"original nan, rewritten 0\.0"):
        check_ruleset(_one("sub_self", lambda x: x - x, lambda x: jnp.zeros_like(x)))


SOUND = [
    ("mul_one", lambda x: x * 1, lambda x: x),
    ("mul_comm", lambda x, y: x * y, lambda x, y: y * x),
    ("neg_neg", lambda x: -(-x), lambda x: x),
]


@pytest.mark.parametrize("name,lhs,rhs", SOUND, ids=[s[0] for s in SOUND])
def test_sound_exact_rules_are_accepted(name, lhs, rhs):
    report = check_ruleset(_one(name, lhs, rhs))
    check = report.rules[name]
    assert check.examples == settings.default.max_examples  # the active profile decides
    assert len(check.cases) == 4 and not check.skipped  # scalar, vector, matrix, rank 3


def test_equal_cost_rewrites_are_compared_not_skipped():
    # Extraction would keep x - y (same cost as y - x): the checker must force the rule's side.
    with pytest.raises(AssertionError, match="rule 'sub_comm' .* does not hold"):
        check_ruleset(_one("sub_comm", lambda x, y: x - y, lambda x, y: y - x))
    # ...and a rewrite the cost model would refuse is still compared.
    with pytest.raises(AssertionError, match="rule 'grow' .* does not hold"):
        check_ruleset(_one("grow", lambda x: jnp.sin(x), lambda x: jnp.sin(x) * 2.0 + 1.0))


def test_a_rule_that_never_fires_fails_loudly():
    @procedural
    def never(m):
        return None

    with pytest.raises(AssertionError, match=r"rule 'never' .* was never exercised"):
        check_ruleset(_one("never", lambda x: jnp.sin(x), never))


def test_max_examples_overrides_the_profile():
    report = check_ruleset(_one("neg_neg", lambda x: -(-x), lambda x: x), max_examples=7)
    assert report.rules["neg_neg"].examples == 7
    assert "neg_neg [user_neg_neg, exact]: 7 examples over 4 case(s)" in str(report)


def test_every_failing_rule_is_listed():
    rs = Ruleset("mixed", [rule(lambda x: -(-x), lambda x: x, name="fine"),
                           rule(lambda x: x - x, lambda x: jnp.zeros_like(x), name="bad_one"),
                           rule(lambda x: jnp.sqrt(x * x), lambda x: x, name="bad_two")])
    with pytest.raises(AssertionError, match="2 of 3 rule") as info:
        check_ruleset(rs)
    assert "'bad_one'" in str(info.value) and "'bad_two'" in str(info.value) and "'fine'" not in str(info.value)


# ---------------------------------------------------------------- guards, procedures, Pat rules
def test_fact_guards_get_inputs_that_establish_the_fact():
    report = check_ruleset(_one("abs_nonneg", lambda x: jnp.abs(x), lambda x: x, when=lambda x: x.nonneg))
    assert all("nonneg" in c for c in report.rules["abs_nonneg"].cases)
    # nonzero is met with positive and negative inputs; +inf/+inf is NaN, so this "identity" is unsound
    with pytest.raises(AssertionError, match=r"rule 'div_self' .* original nan, rewritten 1\.0"):
        check_ruleset(_one("div_self", lambda x: x / x, lambda x: jnp.ones_like(x), when=lambda x: x.nonzero))
    report = check_ruleset(_one("div_self", lambda x: x / x, lambda x: jnp.ones_like(x), "fastmath",
                                when=lambda x: x.nonzero))
    cases = report.rules["div_self"].cases
    assert any("positive" in c for c in cases) and any("negative" in c for c in cases)


def test_shape_guards_limit_the_shapes_checked():
    report = check_ruleset(_one("mat", lambda x: x.T.T, lambda x: x, when=lambda x: x.ndim == 2))
    assert report.rules["mat"].cases == ["(x: f32[3,3])"]


def test_procedures_that_read_values_get_constants():
    @procedural
    def double_const(m):
        x = m["x"]
        return m.trace(lambda v: v + v, x) if x.constant is not None else None

    report = check_ruleset(_one("double", lambda x: x * 2.0, double_const), max_examples=5)
    assert report.rules["double"].examples == 5
    assert all("as constants" in c for c in report.rules["double"].cases)

    @procedural
    def drop_const(m):
        x = m["x"]
        return x if x.constant is not None else None

    with pytest.raises(AssertionError, match="rule 'drop' .* does not hold"):
        check_ruleset(_one("drop", lambda x: x * 2.0, drop_const), max_examples=10)


@procedural
def _halve_if_even(m):
    x = m["x"]
    return m.trace(lambda v: v * 0.5, x) if x.shape and x.shape[-1] % 2 == 0 else None


def test_procedural_rules_are_instantiated_on_drawn_inputs():
    # at the default probe shapes (last dimension 3) the procedure always declines
    with pytest.raises(AssertionError, match=r"rule 'div2' .* never exercised[\s\S]*declined"):
        check_ruleset(_one("div2", lambda x: x / 2.0, _halve_if_even))
    report = check_ruleset(_one("div2", lambda x: x / 2.0, _halve_if_even, example_inputs=(jnp.ones((2, 4)),)))
    assert report.rules["div2"].cases == ["(x: f32[2,4])"]

    @procedural
    def off_by_one(m):
        return m.trace(lambda v: v * 0.5 + 1e-3, m["x"])

    with pytest.raises(AssertionError, match="rule 'div2_wrong' .* does not hold"):
        check_ruleset(_one("div2_wrong", lambda x: x / 2.0, off_by_one, "fastmath"))


def test_a_procedure_that_raises_fails_the_check():
    @procedural
    def broken(m):
        raise RuntimeError("boom")

    with pytest.raises(AssertionError, match="rule 'broken' .* raised RuntimeError: boom"):
        check_ruleset(_one("broken", lambda x: jnp.sin(x), broken))


@procedural
def _sum_of_broadcast(m):
    s, total = m["s"], m.root
    if s.ndim != 0 or total.ndim != 0:
        return None
    return m.trace(lambda s: s * jnp.asarray(math.prod(m.params("bp")["shape"]), s.dtype), s)


def _pat_rule(**kw):
    return rule(Pat("reduce_sum", Pat("broadcast_in_dim", Pat.var("s"), params="bp")), _sum_of_broadcast,
                name="sum_of_broadcast", **kw)


def test_pat_rules_are_checked_on_their_example_program():
    example = (lambda a: jnp.sum(jnp.broadcast_to(a, (4, 5))) + 1.0, (jax.ShapeDtypeStruct((), jnp.float32),))
    report = check_ruleset(Ruleset("pat", [_pat_rule(example_program=example)], soundness="identity"))
    assert report.rules["sum_of_broadcast"].cases == ["(arg0: f32[])"]
    # a sum of twenty -0.0 is +0.0 (the sum starts at +0.0), but -0.0 * 20 is -0.0: not exact
    with pytest.raises(AssertionError, match=r"original 1\.0|original 0\.0, rewritten -0\.0"):
        check_ruleset(Ruleset("pat", [_pat_rule(example_program=(lambda a: jnp.sum(jnp.broadcast_to(a, (4, 5))),
                                                         (jnp.float32(0),)))], soundness="exact"))
    with pytest.raises(AssertionError, match=r"needs an example program: rule\(\.\.\., example_program=\(fn, args\)\)"):
        check_ruleset(Ruleset("pat", [_pat_rule()], soundness="identity"))


def test_pat_rules_are_checked_inside_loop_bodies():
    # The rule fires twice in the body: once on x * 1.0, and again after that class has merged
    # with x. The check must take x, not bar both ways to compute it.
    body = (lambda c0, xs: lax.scan(lambda c, x: (c + x * 1.0, jnp.sin(x * 1.0)), c0, xs),
            (jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((4, 3), jnp.float32)))
    drop = procedural(lambda m: m["x"])
    check_ruleset(Ruleset("g", [rule(Pat("mul", Pat.var("x"), Pat.lit(1.0)), drop, name="mul_one", example_program=body)]))
    shift = procedural(lambda m: m.trace(lambda v: v + 1.0, m["x"]))
    with pytest.raises(AssertionError, match=r"rule 'shift' .* does not hold[\s\S]*scan\["):
        check_ruleset(Ruleset("b", [rule(Pat("mul", Pat.var("x"), Pat.lit(1.0)), shift, name="shift",
                                         example_program=body)], soundness="fastmath"))


# ---------------------------------------------------------------- values and comparison
@pytest.mark.parametrize("value", [0.0, -0.0, math.inf, -math.inf, math.nan, "subnormal", "huge", "negative"])
def test_exact_values_include_every_special(value):
    f32 = np.float32
    info = np.finfo(f32)
    condition = {
        "subnormal": lambda v: 0 < abs(v) < info.tiny,
        "huge": lambda v: abs(v) >= 1e38,
        "negative": lambda v: v < 0,
    }.get(value, lambda v: (math.isnan(v) if isinstance(value, float) and math.isnan(value)
                            else v == value and math.copysign(1, v) == math.copysign(1, value)))
    find(elements(f32, "exact"), condition, settings=settings(max_examples=200, database=None))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16, np.float64])
@given(data=st.data())
def test_identity_and_fastmath_values_stay_in_range(dtype, data):
    v = data.draw(elements(dtype, "identity"))
    assert math.isfinite(v) and abs(v) <= value_bound(dtype, "identity")
    assert math.exp(value_bound(dtype, "identity")) < float(jnp.finfo(dtype).max)
    w = data.draw(elements(dtype, "fastmath"))
    assert math.isfinite(w) and abs(w) <= 4.0 and (w == 0 or abs(w) >= float(jnp.finfo(dtype).tiny))


@given(arrays((40, 3), np.float32, "exact", domain="positive"))
def test_large_arrays_and_domains(a):
    assert a.shape == (40, 3) and a.dtype == np.float32
    assert np.all(np.isnan(a) | (a >= np.finfo(np.float32).tiny))


def test_mismatch_semantics():
    f = np.float32
    assert mismatch(f([np.nan]), f([-np.nan])) is None                 # any NaN equals any NaN
    assert mismatch(f([1e-45]), f([0.0])) is None                      # subnormal == zero of its sign
    assert mismatch(f([-1e-45]), f([0.0])) is not None                 # ...but not the other zero
    assert "original 0.0, rewritten -0.0" in mismatch(f([0.0]), f([-0.0]))
    assert "int32[2], original float32[2]" in mismatch(f([1, 2]), np.int32([1, 2]))
    tol = Tolerance(1e-5, 1e-6)
    assert mismatch(f([1.0, np.inf]), f([1.000001, np.inf]), soundness="identity", tolerance=tol) is None
    assert mismatch(f([np.inf]), f([-np.inf]), soundness="identity", tolerance=tol) is not None
    assert mismatch(f([np.nan]), f([1.0]), soundness="identity", tolerance=tol) is not None
    # more accurate than the original is fine: the original overflowed, the true result is 100
    assert mismatch(f([np.inf]), f([100.0]), soundness="identity", tolerance=tol, reference=[100.0]) is None
    assert mismatch(f([np.inf]), f([90.0]), soundness="identity", tolerance=tol, reference=[100.0]) is not None
    # the original cancelled catastrophically; the rewrite may be as far off, no further
    assert mismatch(f([0.0]), f([1e-3]), soundness="identity", tolerance=tol, reference=[5e-4]) is None
    assert mismatch(f([0.0]), f([1e-2]), soundness="identity", tolerance=tol, reference=[5e-4]) is not None
    assert mismatch(np.int32([3]), np.int32([4]), soundness="fastmath", tolerance=tol) is not None
    # a difference the program's own conditioning explains (its result moves that much under
    # a few ulps of input change) passes; one beyond it does not
    assert mismatch(f([1.0]), f([1.1]), soundness="identity", tolerance=tol, spread=[0.2]) is None
    assert "spread 0.01" in mismatch(f([1.0]), f([1.1]), soundness="identity", tolerance=tol, spread=[0.01])
    assert mismatch(f([1.0]), f([np.nan]), soundness="identity", tolerance=tol, spread=[np.inf]) is not None


@given(inputs_like(({"w": jnp.ones((2, 3)), "n": 3}, jnp.asarray(1.0), np.ones(2, np.int32)), "identity"))
def test_inputs_like_keeps_structure_types_and_weak_types(args):
    tree, weak, ints = args
    assert tree["n"] == 3 and tree["w"].shape == (2, 3) and isinstance(tree["w"], jax.Array)
    assert jax.typeof(weak).weak_type and isinstance(ints, np.ndarray) and ints.dtype == np.int32


# ---------------------------------------------------------------- assert_equivalent
def _program(x, params):
    h = jnp.tanh(x @ params["w"])
    return {"out": jnp.sum((h * params["s"]) / params["s"], axis=-1), "scale": params["k"] * 2.0}


_ARGS = (jnp.ones((2, 3)), {"w": jnp.ones((3, 4)), "s": jnp.ones(4), "k": 1.5})


def test_assert_equivalent_catches_an_unsound_user_rule():
    cancel = _one("cancel", lambda x, y: (x * y) / y, lambda x, y: x, "identity")
    with pytest.raises(AssertionError) as info:
        assert_equivalent(_program, *_ARGS, rulesets=[cancel])
    text = str(info.value)
    assert "_program: the rewritten program differs from the original in the result['out']" in text
    assert "rules that fired: cancel" in text and "args[1]['s'] = float32[4]" in text


def test_assert_equivalent_passes_a_sound_rewrite_and_reports_it():
    factor = _one("factor", lambda a, b, c: a * b + a * c, lambda a, b, c: a * (b + c), "identity")

    def f(a, b, c):
        return jnp.sin(a * b + a * c)

    result = assert_equivalent(f, jnp.ones(3), jnp.ones(3), jnp.ones(3), rulesets=[factor], grads=True)
    # a*c + a*b matches too (patterns match add in either order), but the rule is symmetric in b and c
    assert result.cost_after < result.cost_before and result.stats["factor"].fired == 1


def test_ill_conditioned_programs_do_not_fail_sound_rules():
    # sin of a large argument amplifies one rounding difference in a*b + a*c vs a*(b+c) beyond
    # rtol, and here the original happens to be closer to the true result: found by the thorough
    # profile. The original moves as much when its inputs move by a few ulps, so this passes.
    factor = _one("factor", lambda a, b, c: a * b + a * c, lambda a, b, c: a * (b + c), "identity")
    args = (jnp.float32([0.0, 9.0, 0.0]), jnp.float32([0.0, -63.358784, 0.0]), jnp.float32([0.0, -1.0, 0.0]))
    assert_same_results(lambda a, b, c: jnp.sin(a * b + a * c), *args, rulesets=[factor])


def test_assert_equivalent_compares_gradients():
    # sqrt(x*x) and |x| agree in value, but not in slope at 0: d/dx sqrt(x*x) is 0/0 there.
    rs = _one("abs_form", lambda x: jnp.sqrt(x * x), lambda x: jnp.abs(x), "identity")

    def f(x):
        return jnp.sqrt(x * x) * 3.0

    assert_equivalent(f, jnp.ones(3), rulesets=[rs])
    with pytest.raises(AssertionError, match=r"in the gradient for args\[0\]"):
        assert_equivalent(f, jnp.ones(3), rulesets=[rs], grads=True)


def test_assert_equivalent_warns_when_nothing_changed():
    rs = _one("neg_neg", lambda x: -(-x), lambda x: x)
    with pytest.warns(VacuousCheckWarning, match="compared with itself"):
        assert_equivalent(lambda x: jnp.sin(x), jnp.ones(3), rulesets=[rs], max_examples=2)


def test_assert_equivalent_is_bitwise_for_exact_rules():
    rs = _one("add_zero", lambda x: x + 0.0, lambda x: x)  # wrong for -0.0 only
    with pytest.raises(AssertionError, match=r"original 0\.0, rewritten -0\.0"):
        assert_equivalent(lambda x: jnp.exp(x + 0.0) * (x + 0.0), jnp.ones(3), rulesets=[rs])
    assert_equivalent(lambda x: jnp.exp(x + 0.0) * (x + 0.0), jnp.ones(3), rulesets=[rs], atol=1e-6,
                      max_examples=5)  # with a tolerance -0.0 == 0.0


# ---------------------------------------------------------------- random programs
def test_random_programs_cover_the_primitives():
    seen = set()

    @settings(max_examples=150, derandomize=True, database=None)
    @given(programs())
    def collect(p):
        seen.update(primitive_counts(jax.make_jaxpr(p)(*p.args)))

    collect()
    wanted = {"scan", "cond", "dot_general", "reduce_sum", "reduce_max", "broadcast_in_dim", "select_n",
              "transpose", "pow", "logistic", "sin", "exp", "log", "div", "max"}
    assert wanted <= seen, sorted(wanted - seen)


@given(programs(), st.data())
def test_round_trip_of_random_programs_is_bitwise(program, data):
    args = data.draw(inputs_like(program.args, "exact"), label="args")
    result = assert_same_results(program, *args)  # no rules: exact, so bit for bit
    core.check_jaxpr(result.after.jaxpr)
    assert count_eqns(result.after) <= count_eqns(result.before)
    assert result.stopped == "saturated" and result.cost_after <= result.cost_before


def test_a_broken_random_program_names_itself():
    @procedural
    def off(m):
        return m.trace(lambda v: v + 1.0, m["x"])

    rs = _one("sin_plus_one", lambda x: jnp.sin(x), off, "fastmath")
    program = find(programs(), lambda p: any(op.name == "sin" for op in p.ops),
                   settings=settings(max_examples=1000, database=None))
    with pytest.raises(AssertionError, match=r"(?s)random_program: the rewritten .*rules that fired: sin_plus_one"
                                             r".*program: RandomProgram\(v0"):
        assert_same_results(program, *program.example_args(), rulesets=[rs])


def test_random_programs_write_the_forms_the_packs_rewrite():
    """Compositions no independent draws line up (``log(1 + exp(x))``, ``(x @ x.T) @ x``, attention over
    512 keys) come as one operation each, so that every built-in pack has something to act on
    (``tests/test_contract.py``); each traces at the shapes its listing line says, and reads as written."""
    from rewrite.testing._programs import _IDIOMS

    drawn = {}
    for name in _IDIOMS:
        p = find(programs(), lambda p: any(op.name == name for op in p.ops),
                 settings=settings(max_examples=1000, database=None))
        primitive_counts(jax.make_jaxpr(p)(*p.args))  # it traces, at the shapes the listing says
        drawn[name] = repr(p)
    assert re.search(r"= sum\(v(\d+)\.T @ v\1, -2\)", drawn["sum_gram"]), drawn["sum_gram"]
    assert re.search(r"= softmax\(q k\^T / 2\) v over 512 rows of v\d+", drawn["attention"]), drawn["attention"]


def test_random_program_listing_reads():
    p = find(programs(), lambda p: any(op.kind == "scan" for op in p.ops),
             settings=settings(max_examples=1000, database=None))
    text = repr(p)
    assert text.startswith("RandomProgram(v0: float32") and "scan(" in text and "return v" in text


def test_check_rule_builds_each_draws_strategy_once_and_draws_the_same_examples(monkeypatch):
    """check_ruleset draws each example's inputs and tangents from strategies built once, not per example
    (their construction and hypothesis's validation were 12-21% of test_rules_hold's time), and draws exactly the
    examples a fresh strategy per draw gave: ``x - -y``'s two exact inputs must not share one object (the
    generator would copy one into the other)."""
    from rewrite.testing import _check_rule

    sub_neg = Ruleset("r", [rule(lambda x, y: x - (-y), lambda x, y: x + y, name="sub_neg")])

    evaluate = _check_rule._evaluate

    def drawn(strategies):
        seen = []
        monkeypatch.setattr(_check_rule, "_evaluate", lambda closed, args: seen.append(
            [np.asarray(a).tobytes() for a in args]) or evaluate(closed, args))
        monkeypatch.setattr(_check_rule, "arrays", strategies)
        report = check_ruleset(sub_neg, max_examples=10)
        return seen, report

    built = []
    fresh = _check_rule._fresh_arrays
    monkeypatch.setattr(_check_rule, "_fresh_arrays", lambda *a: built.append(a) or fresh(*a))
    _check_rule._built.cache_clear()
    cached, report = drawn(_check_rule.arrays)
    cases = len(report.rules["sub_neg"].cases)
    assert report.examples == 10 and cases >= 2
    assert len(built) <= 4 * cases, len(built)  # x, y and their two tangents, per case: not per example
    assert drawn(arrays)[0] == cached  # a fresh strategy per draw, as before: the same examples
