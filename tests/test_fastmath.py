"""rulesets.fastmath: each toggle fires on its left side and stays within its stated tolerance on ordinary values.

Ordinary values are what each toggle's tolerance is stated for (see the
module docstring of ``rulesets/fastmath.py``): finite and of moderate
magnitude, and of one sign for toggles that reorder sums. Each rule runs
with ``rulesets.algebra`` (whose commutativity and folding the toggles
build on); the test asserts that it fired and lowered the cost, then
compares the programs on random ordinary inputs within the toggle's
tolerance. The whole pack also runs over the corpus.
"""

from __future__ import annotations

import functools
import warnings

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rulesets
from rewrite import Limits, Ruleset, explain, rewrite, rule

from .packcheck import Side, array_leaves, corpus_programs, examples, only

ALGEBRA = rulesets.algebra
FASTMATH = rulesets.fastmath
TOGGLES = ["reassociate", "reciprocal", "cancel", "distribute", "powers", "signed_zeros"]
V, M = (7,), (4, 5)


# ---------------------------------------------------------------------- the pack's shape
def test_toggles_are_named_rulesets_and_compose():
    assert [p.name for p in FASTMATH.parts] == TOGGLES
    for name in TOGGLES:
        part = getattr(FASTMATH, name)
        assert isinstance(part, Ruleset) and part.soundness == "fastmath" and part.tolerance is not None
        assert len(part) >= 1
    assert FASTMATH.soundness == "fastmath"
    assert len(FASTMATH) == sum(len(getattr(FASTMATH, n)) for n in TOGGLES)
    both = ALGEBRA + FASTMATH.reassociate
    assert both.reassociate is FASTMATH.reassociate and both.soundness == "fastmath"


def test_no_other_pack_includes_them():
    fast = {r.name for r in FASTMATH}
    for name, pack in rulesets.BUILTIN.items():
        if name != "fastmath":
            assert not fast & {r.name for r in pack}, name
            assert all(owner.soundness != "fastmath" for _, owner in pack.entries()), name


# ---------------------------------------------------------------------- values
def ordinary(shape, *, signed=True, lo=2.0 ** -20, hi=2.0 ** 20):
    """Finite float32 arrays of moderate magnitude (no overflow, underflow or subnormals), of one sign unless ``signed``."""
    mag = st.floats(lo, hi, width=32)
    el = st.tuples(st.booleans(), mag).map(lambda t: -t[1] if t[0] else t[1]) if signed else mag
    return hnp.arrays(np.float32, shape, elements=el)


def positive(shape):
    return ordinary(shape, signed=False, lo=0.5, hi=2.0)


# (rule, program, input shapes, value strategy, expect)  -- expect: "cheaper" or "fires"
CASES = [
    ("mul_assoc_right", lambda x: (x * 2.0) * 3.0, [V], ordinary, "cheaper"),  # with folding: x * 6
    ("mul_assoc_left", lambda x: 2.0 * (3.0 * x), [V], ordinary, "cheaper"),
    ("add_assoc_right", lambda x: (x + 1.0) + 2.0, [V], positive, "cheaper"),  # with folding: x + 3
    ("add_assoc_left", lambda x: 1.0 + (2.0 + x), [V], positive, "cheaper"),
    ("div_const", lambda x: x / 3.0, [V], ordinary, "cheaper"),
    ("div_const", lambda x: jnp.sin(x) / -7.0 + x / 0.1, [V], ordinary, "cheaper"),
    # Three divisions by y would be cheaper as one reciprocal and three multiplications, but the
    # extractor moves one class at a time and no single move pays: it fires, the cost stays.
    # (positive: the programs add the quotients, and a sum of mixed signs amplifies any error)
    ("div_reciprocal", lambda x, y: x / y + jnp.sin(x) / y + jnp.cos(x) / y, [V, V], positive, "fires"),
    ("div_reciprocal", lambda x, y: x / y + 1.0 / y, [V, V], positive, "cheaper"),  # 1/y is there already
    ("sub_self", lambda x: jnp.sin(x) - jnp.sin(x) + x, [V], ordinary, "cheaper"),
    ("div_self", lambda x: jnp.maximum(x, 1e-3) / jnp.maximum(x, 1e-3) * 3.0, [V], ordinary, "cheaper"),  # x != 0
    ("mul_zero", lambda x: x * 0.0 + jnp.cos(x), [V], ordinary, "cheaper"),
    ("factor_add", lambda a, b, c: a * b + a * c, [V, V, V], positive, "cheaper"),
    ("factor_sub", lambda a, b, c: a * b - a * c, [V, V, V], positive, "cheaper"),
    ("factor_div", lambda a, b, c: a / jnp.maximum(c, 1e-3) + b / jnp.maximum(c, 1e-3), [V, V, V], positive,
     "cheaper"),  # c != 0
    ("sum_scalar_mul", lambda x, s: jnp.sum(x * s[0]), [M, (1,)], positive, "cheaper"),
    ("pow_pow_any", lambda x: (x ** 3) ** 2, [V], positive, "cheaper"),
    ("pow_pow_any", lambda x: (x ** -2) ** 3, [V], positive, "cheaper"),
    ("mul_pows_any", lambda x: x ** 2 * x ** 3, [V], positive, "cheaper"),
    ("mul_x_pow_any", lambda x: x * x ** 6, [V], positive, "cheaper"),
    ("add_zero", lambda x: x + 0.0, [V], ordinary, "cheaper"),
    ("zero_sub", lambda x: 0.0 - x, [V], ordinary, "fires"),
    ("neg_sub", lambda a, b: -(a - b), [V, V], ordinary, "cheaper"),
]


def test_every_rule_has_a_case():
    assert {r.name for r in FASTMATH} - {c[0] for c in CASES} == set()


def _ids(cases):
    return [f"{c[0]}-{i}" for i, c in enumerate(cases)]


def _tolerance(name):
    for r, owner in FASTMATH.entries():
        if r.name == name:
            return owner.tolerance.for_dtype(np.float32)
    raise KeyError(name)


def _args(specs, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(0.5, 2.0, s).astype(np.float32) for s in specs]


@functools.lru_cache(maxsize=None)
def _report(i):
    name, fn, specs, _, _ = CASES[i]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = explain(fn, *_args(specs), rulesets=[ALGEBRA + only(FASTMATH, name)])
    report.release()  # cached for the session: keep the programs and counts, not each e-graph
    return report


@pytest.mark.parametrize("i", range(len(CASES)), ids=_ids(CASES))
def test_rule_fires(i):
    name, _, _, _, expect = CASES[i]
    report = _report(i)
    assert report.fired.get(name, 0) >= 1, report
    assert report.cost_after <= report.cost_before
    if expect == "cheaper":
        assert report.cost_after < report.cost_before, report


@functools.lru_cache(maxsize=None)
def _all_cases():
    return Side([_report(i) for i in range(len(CASES))], [c[2] for c in CASES], [c[0] for c in CASES])


@settings(max_examples=examples(15))
@given(data=st.data())
def test_rules_stay_within_tolerance_on_ordinary_values(data):
    args = [[data.draw(c[3](s)) for s in c[2]] for c in CASES]
    _all_cases().check_close(args, [_tolerance(c[0]) for c in CASES])


def test_cancel_and_signed_zeros_are_exact_on_finite_nonzero_values():
    """Their tolerance is zero: equal as numbers (-0.0 == 0.0) wherever the value is finite and nonzero."""
    side = _all_cases()
    exact = {"sub_self", "div_self", "mul_zero", "add_zero", "zero_sub", "neg_sub"}
    picked = [i for i, c in enumerate(CASES) if c[0] in exact]
    args = [[np.linspace(-1e6, 1e6, int(np.prod(s)), dtype=np.float32).reshape(s) + 0.25 for s in c[2]]
            for c in CASES]
    outs_after, outs_before = side.jit_after(*side._flat(args)), side.jit_before(*side._flat(args))
    for i in picked:
        np.testing.assert_array_equal(np.asarray(outs_after[i][0]), np.asarray(outs_before[i][0]), err_msg=CASES[i][0])


def test_cancel_is_wrong_for_infinities_as_documented():
    """x - x -> 0 changes inf - inf (NaN) to 0: why cancel is a fastmath toggle and not in algebra."""
    i = next(i for i, c in enumerate(CASES) if c[0] == "sub_self")
    x = np.array([np.inf, 1.0, np.nan, 0, 0, 0, 0], np.float32)
    side = _all_cases()
    args = [[np.ones(s, np.float32) for s in c[2]] for c in CASES]
    args[i] = [x]
    got = np.asarray(side.jit_after(*side._flat(args))[i][0])
    want = np.asarray(side.jit_before(*side._flat(args))[i][0])
    assert np.isnan(want[0]) and got[0] == np.inf  # sin(inf) - sin(inf) + inf: NaN before, inf after


@pytest.mark.parametrize("name,fn", [
    ("div_self", lambda x, y, z: x / x),
    ("factor_div", lambda x, y, z: y / x + z / x),
], ids=["div_self", "factor_div"])
def test_divisions_by_what_may_be_zero_are_left_alone(name, fn):
    """Regression: x/x -> 1 and a/c + b/c -> (a + b)/c fired on any divisor, so 0/0 (NaN) became 1, and
    0/0 + 1/0 (NaN) became inf; check_ruleset found both at a zero divisor. Zero is an ordinary value:
    they now need a divisor the facts prove nonzero."""
    x, y, z = np.zeros(3, np.float32), np.zeros(3, np.float32), np.ones(3, np.float32)
    report = explain(fn, x, y, z, rulesets=[ALGEBRA + only(FASTMATH, name)])
    assert name not in report.fired and report.rejected[name].get("guard", 0) >= 1, report
    after = np.asarray(jax.extend.core.jaxpr_as_fun(report.after)(x, y, z)[0])
    assert np.isnan(after).all()


# ---------------------------------------------------------------------- growth
def test_reassociation_is_bounded_by_backoff_and_limits():
    """A 12-term sum under commutativity and associativity stops at a limit, not at memory exhaustion."""
    def f(*xs):
        return jnp.sin(sum(xs[1:], xs[0]))

    xs = [jnp.full((3,), float(i + 1)) for i in range(12)]
    # a user's commutativity rule (patterns match either order without one): it has the run's allowance
    commute = Ruleset("commute", [rule(lambda a, b: a + b, lambda a, b: b + a, name="add_comm")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = explain(f, *xs, rulesets=[ALGEBRA + FASTMATH.reassociate + commute], limits=Limits(seconds=5.0))
    st_ = report.result.stats
    # reassociate's own allowance (200 new matches per iteration) bans it sooner than the run's (2000)
    assert st_["add_assoc_right"].banned > st_["add_comm"].banned
    assert report.stopped in ("iteration limit", "node limit", "time limit", "saturated")
    assert report.egraph_rows < 500_000
    assert report.cost_after <= report.cost_before


def test_a_twelve_term_sum_saturates_with_associativity_retired_in_a_grown_egraph():
    """Limits.growth: once the e-graph has grown 16-fold, a rule outrunning its allowance is retired, so the
    run ends saturated (and says which rules were retired) instead of at a limit; with growth off it does not."""
    def f(*xs):
        return jnp.sin(sum(xs[1:], xs[0]))

    xs = [jnp.full((3,), float(i + 1)) for i in range(12)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tamed = explain(f, *xs, rulesets=[ALGEBRA + FASTMATH.reassociate], limits=Limits(seconds=20.0))
        unscheduled = Ruleset("unscheduled", FASTMATH.reassociate.rules, soundness="fastmath")  # no rounds, no allowance
        wild = explain(f, *xs, rulesets=[ALGEBRA + unscheduled],
                       limits=Limits(seconds=5.0, growth=float("inf"), iterations=8))
    assert tamed.stopped == "saturated" and any(st.retired for st in tamed.result.stats.values())
    assert "retired in a grown e-graph" in tamed.summary()
    assert wild.stopped in ("iteration limit", "time limit", "node limit"), wild.stopped
    assert tamed.egraph_rows < wild.egraph_rows
    assert tamed.cost_after <= tamed.cost_before


def test_a_rulesets_rounds_bound_when_its_rules_run():
    """A ruleset's ``limits.iterations`` runs its rules in its first rounds only; the other rules go on."""
    comm = rule(lambda a, b: jax.lax.add(a, b), lambda a, b: jax.lax.add(b, a), name="comm_once")
    neg = rule(lambda x: -(-x), lambda x: x, name="negneg_late")
    once = Ruleset("once", [comm], limits=Limits(iterations=0))
    report = explain(lambda x, y: -(-(x + y)), jnp.ones(2), jnp.ones(2), rulesets=[once, Ruleset("rest", [neg])])
    assert "comm_once" not in report.fired and report.fired.get("negneg_late") == 1


def test_ruleset_limits_set_the_backoff_of_their_own_rules():
    comm = rule(lambda a, b: jax.lax.add(a, b), lambda a, b: jax.lax.add(b, a), name="comm")
    tight = Ruleset("tight", [comm], limits=Limits(matches=1, ban=1))
    loose = Ruleset("loose", [comm])

    def f(x, y, z):
        return (x + y) * (y + z) * (x + z)

    args = [jnp.ones(2)] * 3
    assert explain(f, *args, rulesets=[tight]).result.stats["comm"].banned >= 1
    assert explain(f, *args, rulesets=[loose]).result.stats["comm"].banned == 0


# ---------------------------------------------------------------------- the corpus
def test_corpus_stays_close_and_never_raises_cost():
    """On real programs (mixed signs, so no tolerance is promised): never costlier, and close in practice.

    ``float64_free_literals`` computes ``inf * 0``; ``cancel`` turns its NaN
    into 0, as documented, so only its cost is checked.
    """
    programs = corpus_programs()
    reports = []
    for name, fn, args in programs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = explain(fn, *args, rulesets=[ALGEBRA + FASTMATH], limits=Limits(seconds=0.5))
        assert report.cost_after <= report.cost_before, name
        reports.append(report)
    assert sum(r.cost_after < r.cost_before for r in reports) >= len(reports) // 2
    args = [array_leaves(a) for _, _, a in programs]
    names = [n for n, _, _ in programs]
    close = [None if n == "float64_free_literals" else (1e-3, 1e-3) for n in names]
    Side(reports, args, names, reference="corpus").check_close(args, close)


def test_cancel_leaves_visible_infinities_alone():
    # fastmath may assume finite values, but not for a constant that is plainly inf or NaN
    report = explain(lambda x: x * 0 + jnp.float32(jnp.inf) * 0 + (jnp.float32(jnp.nan) - jnp.float32(jnp.nan)),
                     jnp.ones(3), rulesets=[rulesets.fastmath.cancel])
    assert report.fired == {"mul_zero": 1}  # only x * 0
    assert np.isnan(np.asarray(rewrite(lambda x: jnp.float32(jnp.inf) * 0 + x, rulesets=[rulesets.fastmath.cancel])(
        jnp.ones(3)))).all()
