"""What a new user's mistakes get: a clear error where the mistake is made, naming it (issue 31, items 2, 3,
5 and 6)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rulesets
from rewrite import Limits, Pat, RewriteWarning, Ruleset, explain, procedural, rewrite, rule

S = jax.ShapeDtypeStruct
F32 = jnp.float32
X = jnp.linspace(-1.0, 1.0, 5)


# ---------------------------------------------------------------------- rulesets= and limits=
@pytest.mark.parametrize("given", ["algebra", ["algebra"], ("nn", "algebra"), ["algebra", rulesets.nn]])
def test_a_built_in_pack_may_be_named(given):
    f = lambda x: jnp.abs(-x)  # noqa: E731
    ints = jnp.arange(-2, 3)  # abs_neg keeps JAX's derivative at 0 only where x is an integer or non-zero
    assert rewrite(f, rulesets=given).result(ints).stats["abs_neg"].fired == 1
    assert "abs_neg" in explain(f, ints, rulesets=given).fired


@pytest.mark.parametrize("given, error, match", [
    (None, TypeError, r"got NoneType \(pass \[\] for no rules\)"),
    (3, TypeError, "got int"),
    ("algbra", ValueError, "no built-in pack is named 'algbra'"),
    ([b"algebra"], TypeError, "got bytes"),
])
def test_a_wrong_rulesets_argument_says_what_it_takes(given, error, match):
    with pytest.raises(error, match=match):
        rewrite(jnp.sin, rulesets=given)


def test_a_ruleset_of_one_rule_needs_no_list():
    r = rule(lambda x: jnp.abs(-x), lambda x: jnp.abs(x), name="my_abs_neg")
    assert Ruleset("one", r).rules == [r]
    with pytest.raises(TypeError, match="rules must be a list"):
        Ruleset("text", "my_abs_neg")


def test_limits_are_validated():
    assert rewrite(jnp.sin, limits={"iterations": 3}).limits == Limits(iterations=3)
    with pytest.raises(TypeError, match="no field 'iteration'"):
        rewrite(jnp.sin, limits={"iteration": 3})
    with pytest.raises(ValueError, match="Limits.seconds must be a number >= 0"):
        Limits(seconds=-1.0)
    with pytest.raises(ValueError, match="Limits.nodes"):
        Limits(nodes=float("nan"))
    with pytest.raises(TypeError, match="limits= takes a Limits"):
        rewrite(jnp.sin, limits=5)


# ---------------------------------------------------------------------- guards that raise
def test_a_guard_with_a_typo_shows_its_own_error():
    with pytest.raises(ValueError, match=r"rule 'g'.*guard.*AttributeError.*non_neg"):
        rule(lambda x: jnp.abs(x), lambda x: x, name="g", when=lambda x: x.non_neg)
    with pytest.raises(ValueError, match=r"rule 'g'.*guard.*AttributeError.*example's inputs"):
        rule(lambda x: jnp.abs(x), lambda x: x, name="g", when=lambda x: x.non_neg, example_inputs=(S((3,), F32),))


def test_a_guard_that_raises_at_some_shapes_only_is_fine_where_it_answers():
    r = rule(lambda x: jnp.abs(x), lambda x: x, name="g", when=lambda x: x.shape[1] > 0 and x.nonneg)
    assert r.queries


def test_a_guard_that_raises_at_a_match_is_reported_and_strict_raises():
    def guard(x):
        if x.shape == (5,):
            raise RuntimeError("guard boom")
        return True

    r = rule(lambda x: jnp.abs(-x), lambda x: jnp.abs(x), name="g", when=guard)
    f = lambda x: jnp.abs(-x)  # noqa: E731
    with pytest.warns(RewriteWarning, match=r"rule 'g' \(its guard\) raised RuntimeError: guard boom"):
        out = rewrite(f, rulesets=[r], strict=False)(X)
    np.testing.assert_array_equal(out, f(X))
    with pytest.raises(RuntimeError, match="guard boom"):
        rewrite(f, rulesets=[r], strict=True)(X)


# ---------------------------------------------------------------------- strict covers the user's rules
def test_strict_raises_when_a_users_rule_raises():
    boom = rule(lambda x: jnp.sin(x), procedural(lambda m: (_ for _ in ()).throw(RuntimeError("kaboom"))),
                name="boom")
    with pytest.warns(RewriteWarning, match="kaboom"):
        np.testing.assert_array_equal(rewrite(jnp.sin, rulesets=[boom], strict=False)(X), jnp.sin(X))
    with pytest.raises(RuntimeError, match="rule 'boom' raised RuntimeError: kaboom"):
        rewrite(jnp.sin, rulesets=[boom], strict=True)(X)


def test_strict_raises_when_a_right_side_has_the_wrong_shape():
    wrong = rule(lambda x: jnp.sin(x), procedural(lambda m: m.trace(lambda v: v.sum(), m["x"])), name="wrong")
    with pytest.raises(RuntimeError, match="rule 'wrong' built f32"):
        rewrite(jnp.sin, rulesets=[wrong], strict=True)(X)


def test_strict_covers_the_derivative_programs_too():
    boom = rule(lambda x: jnp.cos(x), procedural(lambda m: (_ for _ in ()).throw(RuntimeError("in the VJP"))),
                name="boom_cos")
    f = rewrite(jnp.sin, rulesets=[boom], strict=True)
    np.testing.assert_array_equal(f(X), jnp.sin(X))  # the forward program has no cos
    with pytest.raises(RuntimeError, match="in the VJP"):
        jax.grad(lambda x: f(x).sum())(X)


# ---------------------------------------------------------------------- Pat rules checked on their example
EXAMPLE = (jnp.sin, (S((3,), F32),))


def test_a_pat_rules_right_side_with_a_typo_fails_where_it_is_defined():
    with pytest.raises(ValueError, match=r"rule 'typo': on its example program.*no attribute 'sine'"):
        rule(Pat("sin", Pat.var("x")), lambda x: jnp.sine(x), name="typo", example_program=EXAMPLE)


def test_a_pat_rules_right_side_of_the_wrong_shape_fails_where_it_is_defined():
    with pytest.raises(ValueError, match=r"rule 'shape': on its example program.*built f32\[\] for a match of"):
        rule(Pat("sin", Pat.var("x")), lambda x: jnp.sin(x).sum(), name="shape", example_program=EXAMPLE)


def test_a_pat_rule_whose_example_has_no_match_fails():
    with pytest.raises(ValueError, match="rule 'nomatch': the pattern has no match on its example"):
        rule(Pat("cos", Pat.var("x")), lambda x: x, name="nomatch", example_program=EXAMPLE)


def test_a_correct_pat_rule_is_accepted_and_check_false_skips_the_check():
    assert rule(Pat("sin", Pat.var("x")), lambda x: jnp.sin(x), name="ok", example_program=EXAMPLE).program
    assert rule(Pat("sin", Pat.var("x")), lambda x: jnp.sine(x), name="unchecked", example_program=EXAMPLE, check=False)


def test_a_rule_is_traced_under_jaxs_default_numpy_promotion():
    """A rule's jnp code is written for JAX's default promotion. Under a user's rank_promotion="raise" (equinox's
    and diffrax's test suites set it, with dtype_promotion="strict") its example program could not be traced:
    loading the derivatives pack raised at trig_sin2_over, and every routed jit of those suites crashed."""
    x, b = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4), jnp.linspace(0.5, 2.0, 4)
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
        r = rule(Pat("sin", Pat.var("x")), lambda x: jnp.sin(x) * jnp.ones(x.shape[-1:], x.dtype), name="sin_ones",
                 example_program=(lambda x, b: jnp.sin(b * x), (S((4, 4), F32), S((4,), F32))))
        f = rewrite(lambda x, b: jnp.sin(x * b[None, :]), rulesets=[Ruleset("r", [r])], strict=True)
        np.testing.assert_allclose(f(x, b), jnp.sin(x * b[None, :]), rtol=1e-6)
        assert f.result(x, b).stats["sin_ones"].fired == 1
        with pytest.raises(ValueError, match="rank_promotion"):  # the user's own program is traced as they set
            f(x, b[:, None, None])


def test_no_warning_is_logged_while_a_rule_is_checked(caplog):
    with caplog.at_level("WARNING", logger="rewrite"), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError):
            rule(Pat("sin", Pat.var("x")), lambda x: jnp.sine(x), name="typo", example_program=EXAMPLE)
    assert not caplog.records


# ---------------------------------------------------------------------- pricing values of extended dtypes
def test_an_extended_dtype_without_itemsize_is_sized_by_its_physical_representation():
    from jax._src import dtypes
    from jax.core import ShapedArray

    from rewrite.ir.primitives import nbytes

    class FooRules:
        @staticmethod
        def physical_element_aval(dtype):
            return ShapedArray((2,), jnp.int32)

    class FooTy(dtypes.ExtendedDType):  # as lax_test's custom element type: no itemsize of its own
        type = dtypes.extended
        name = "foo"
        _rules = FooRules

    class Unknown(dtypes.ExtendedDType):
        type = dtypes.extended
        name = "unknown"

    assert nbytes(ShapedArray((3,), FooTy())) == 3 * 2 * 4
    assert nbytes(ShapedArray((3,), Unknown())) == 0
    assert nbytes(jax.typeof(jax.random.split(jax.random.key(0), 3))) == 3 * 8


# ---------------------------------------------------------------------- preferred rules are bounded
def test_a_preferred_rule_never_rewrites_inside_its_own_replacement():
    # The replacement holds a new match of the rule (sin of a new term): preferred, it was forced into the
    # result once per iteration, a nest as deep as the iteration limit.
    nest = rule(lambda x: jnp.sin(x), lambda x: jnp.sin(x * 1.0), name="nest", prefer=True)
    report = explain(lambda x: jnp.sin(x) + jnp.sin(2 * x), X, rulesets=[nest])
    assert report.stopped == "saturated"
    assert report.fired == {"nest": 2}
    assert report.rejected["nest"].get("own replacement", 0) >= 1
    assert len(report.after.eqns) <= 6


def test_softplus_keeps_complex_logaddexp_as_it_is():
    z = jnp.array([1 + 2j, -0.5 + 0.1j], jnp.complex64)
    for f in (lambda x: jnp.log1p(jnp.exp(x)), lambda a: jnp.logaddexp(a, 2 * a)):
        report = explain(f, z, rulesets=[rulesets.nn])
        assert report.stopped == "saturated" and not report.fired
        assert len(report.after.eqns) == len(jax.make_jaxpr(f)(z).eqns)


# ---------------------------------------------------------------------- patterns through opaque operations
@pytest.mark.parametrize("n", [3, 4, 5, 8, 16])
def test_a_pattern_through_linalg_inv_matches_at_every_size(n):
    inv_solve = rule(lambda A, b: jnp.linalg.inv(A) @ b, lambda A, b: jnp.linalg.solve(A, b), name="inv_solve",
                     example_inputs=(S((4, 4), F32), S((4,), F32)))
    A = jnp.eye(n) * 2.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(n), (n, n))
    b = jnp.arange(n, dtype=F32)
    f = lambda A, b: jnp.linalg.inv(A) @ b  # noqa: E731
    report = explain(f, A, b, rulesets=[Ruleset("s", [inv_solve], soundness="identity")])
    assert report.fired == {"inv_solve": 1}
    np.testing.assert_allclose(rewrite(f, rulesets=[Ruleset("s", [inv_solve], soundness="identity")])(A, b),
                               jnp.linalg.solve(A, b), rtol=1e-5, atol=1e-5)


def test_a_loose_opaque_pattern_is_verified_at_the_matched_program():
    # pinv runs other opaque operations (svd): the loosened params must not let it match.
    inv_solve = rule(lambda A, b: jnp.linalg.inv(A) @ b, lambda A, b: jnp.linalg.solve(A, b), name="inv_solve",
                     example_inputs=(S((4, 4), F32), S((4,), F32)))
    A = jnp.eye(5) * 2.0
    report = explain(lambda A, b: jnp.linalg.pinv(A) @ b, A, jnp.ones(5),
                     rulesets=[Ruleset("s", [inv_solve], soundness="identity")])
    assert not report.fired


# ---------------------------------------------------------------------- assert_equivalent
def test_a_rewrite_that_is_finite_where_the_original_and_float64_overflow_is_accepted():
    from rewrite.testing import assert_equivalent

    f = lambda x, w: jnp.sum(jnp.log(1.0 + jnp.exp(x @ w)))  # noqa: E731
    assert_equivalent(f, jnp.ones((4, 8)), jnp.ones((8, 3)), rulesets=[rulesets.nn], max_examples=25)


def test_a_finite_but_wrong_rewrite_is_still_caught_where_nothing_overflows():
    from rewrite.testing import assert_equivalent

    wrong = Ruleset("wrong", [rule(lambda x: jnp.log(1.0 + jnp.exp(x)), lambda x: jnp.maximum(x, 0.0),
                                   name="softplus_as_relu")], soundness="identity")
    with pytest.raises(AssertionError, match="softplus_as_relu"):
        assert_equivalent(lambda x: jnp.log(1.0 + jnp.exp(x)), jnp.ones(4), rulesets=[wrong], max_examples=25)


def test_assert_equivalent_runs_both_sides_compiled():
    from rewrite.testing import assert_equivalent

    calls = []

    def rnn(h, xs, w):
        calls.append(1)

        def step(h, x):  # a new body each call: run eagerly, the scan recompiled on every call (0.57 s)
            h = jnp.tanh(h @ w + x)
            return h, h.sum()
        return jax.lax.scan(step, h, xs)[1].sum()

    assert_equivalent(rnn, jnp.ones((2, 4)), jnp.ones((10, 2, 4)), jnp.eye(4) * 0.1, rulesets=[rulesets.scan],
                      max_examples=10)
    # Python runs the function when it is traced (the rewrite, one compilation per side), not once per example
    assert len(calls) <= 4


# ---------------------------------------------------------------------- what explain says
def test_ordinary_declines_are_counted_and_listed_only_when_asked():
    from jax import lax

    def loss(x1, x2, y):
        _, ys = lax.scan(lambda c, x: (jnp.sin(c), jnp.cos(x)), x1, x2)
        return jnp.square(y - ys).mean()

    r = explain(loss, jnp.ones(4), jnp.linspace(0, 1, 120).reshape(30, 4), jnp.zeros((30, 4)),
                rulesets=[rulesets.scan])
    assert "matches not applied" not in r.summary()
    assert "ordinary declines:" in r.summary()
    assert "matches not applied: " in r.summary(verbose=True) and "declined" in r.summary(verbose=True)


def test_the_gradient_report_prices_a_calls_fixed_cost_too():
    g = explain(lambda x: jnp.sin(x) ** 2, jnp.ones(3), rulesets=[rulesets.derivatives], grad=True)
    assert g.fixed_cost > 0
    assert f"a call's fixed cost, {g.fixed_cost:,.0f}, included" in g.summary()


# ---------------------------------------------------------------------- restricting what a property check draws
def _inv_inv(**kw):
    return Ruleset("inverses", [rule(lambda a: jnp.linalg.inv(jnp.linalg.inv(a)), lambda a: a, name="inv_inv",
                                     example_inputs=(S((3, 3), F32),), **kw)], soundness="identity")


def test_a_rule_for_non_singular_matrices_fails_its_check_on_all_matrices():
    from rewrite.testing import check_ruleset

    with pytest.raises(AssertionError, match="inv_inv"):
        check_ruleset(_inv_inv(), max_examples=25)


def test_check_inputs_restricts_what_the_check_draws():
    from rewrite.testing import check_ruleset

    well_conditioned = lambda a: (4 * np.eye(a.shape[-1]) + 0.1 * np.tanh(a)).astype(a.dtype)  # noqa: E731
    check_ruleset(_inv_inv(check_inputs={"a": well_conditioned}), max_examples=25)


def test_check_inputs_names_pattern_variables():
    with pytest.raises(ValueError, match="check_inputs= maps pattern variables"):
        _inv_inv(check_inputs={"b": np.abs})


# ---------------------------------------------------------------------- a failed rewrite: strict raises, else falls back
def test_a_failed_rewrite_raises_under_strict_and_otherwise_falls_back_with_a_warning():
    from rewrite import NodeCost

    def boom(node):
        raise ZeroDivisionError("a cost model that fails")

    f = lambda x: jnp.sin(x) * 1.0  # noqa: E731
    x = jnp.linspace(-1.0, 1.0, 3)
    with pytest.raises(ZeroDivisionError):
        rewrite(f, cost_model=NodeCost(boom), strict=True, cache=False)(x)
    with pytest.warns(RewriteWarning, match=r"rewrite of '<lambda>' failed \(ZeroDivisionError: .*running it unchanged"):
        np.testing.assert_allclose(rewrite(f, cost_model=NodeCost(boom), strict=False, cache=False)(x), f(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # vjp=True
        g = rewrite(f, cost_model=NodeCost(boom), strict=False, cache=False, vjp=True)
        with pytest.warns(RewriteWarning, match=r"rewrite of the VJP of '<lambda>' failed .*using JAX's own"):
            np.testing.assert_allclose(jax.grad(lambda x: g(x).sum())(x), jnp.cos(x), rtol=1e-6)
        h = rewrite(f, cost_model=NodeCost(boom), strict=True, cache=False, vjp=True)
        with pytest.raises(ZeroDivisionError):
            jax.grad(lambda x: h(x).sum())(x)


# ---------------------------------------------------------------------- JAX's tracing errors name the user's code
def _branches_on(params, x, n=2, *, scale=None):
    return x * n if params["w"] > 0 else -x


def _tracing_line(error: Exception) -> str:
    return next(line for line in str(error).splitlines() if "while tracing the function" in line)


@pytest.mark.parametrize("wrap, call", [
    (lambda f: rewrite(f), lambda g: g({"w": jnp.ones(()), "b": 1.0}, X)),
    (lambda f: rewrite(f, static_argnums=2), lambda g: g({"b": "a string leaf", "w": jnp.ones(())}, X, 3)),
    (lambda f: rewrite(f), lambda g: g({"w": jnp.ones(())}, x=X, scale=jnp.ones(2))),
    (lambda f: jax.jit(rewrite(f)), lambda g: g({"w": jnp.ones(())}, X)),
    (lambda f: jax.grad(rewrite(lambda params, x: jnp.sum(f(params, x)))), lambda g: g({"w": jnp.ones(())}, X)),
])
def test_a_tracing_error_names_the_users_function_and_argument_as_jit_does(wrap, call):
    """JAX's tracing errors (a Python branch on a traced value, here) say which function was traced and
    which argument the value came from; through the rewriter they name what the user wrote, as `jax.jit`'s
    do, not the rewriter's own flattened function and `dyn[0]`."""
    with pytest.raises(jax.errors.TracerBoolConversionError) as rewritten:
        call(wrap(_branches_on))
    line = _tracing_line(rewritten.value)
    assert "the argument params['w']" in line, line
    assert "flat_fn" not in line and "dyn[" not in line, line
    if "lambda" not in line:  # (under jax.grad the function traced is the test's lambda around it)
        assert "_branches_on at " in line and __file__.rsplit("/", 1)[-1] in line, line


def test_the_tracing_error_is_the_one_jax_jit_gives():
    args = ({"w": jnp.ones(()), "b": 1.0}, X)
    with pytest.raises(jax.errors.TracerBoolConversionError) as rewritten:
        rewrite(_branches_on)(*args)
    with pytest.raises(jax.errors.TracerBoolConversionError) as jitted:
        jax.jit(_branches_on)(*args)
    assert _tracing_line(rewritten.value) == _tracing_line(jitted.value)


class _Rebuilt:
    """A pytree that checks its children when rebuilt: it cannot hold the specs the names are read from."""

    def __init__(self, w):
        if not isinstance(w, jax.Array):
            raise TypeError("w must be an array")
        self.w = w


jax.tree_util.register_pytree_node(_Rebuilt, lambda p: ((p.w,), None), lambda _, c: _Rebuilt(*c))


def test_a_pytree_that_cannot_hold_specs_is_traced_all_the_same():
    f = rewrite(lambda p, x: jnp.sin(x) * p.w)
    assert jnp.allclose(f(_Rebuilt(jnp.float32(2.0)), X), jnp.sin(X) * 2.0)
    with pytest.raises(jax.errors.TracerBoolConversionError):  # still JAX's error, its arguments unnamed
        rewrite(lambda p, x: x if p.w > 0 else -x)(_Rebuilt(jnp.float32(2.0)), X)


# ---------------------------------------------------------------------- what the decorator refuses, as jax.jit does
def _generator(x):
    yield x


async def _coroutine(x):
    return x


@pytest.mark.parametrize("fn, match", [
    (_generator, "generator or coroutine function '_generator'"),
    (_coroutine, "generator or coroutine function '_coroutine'"),
    (staticmethod(jnp.sin), "put @staticmethod above @rewrite"),
    (classmethod(jnp.sin), "put @classmethod above @rewrite"),
    (3, "takes a function, got int"),
])
def test_the_decorator_refuses_what_cannot_be_rewritten_where_it_is_applied(fn, match):
    with pytest.raises(TypeError, match=match):
        rewrite(fn)
    with pytest.raises(TypeError, match=match):
        rewrite(rulesets=["algebra"])(fn)


def test_a_static_method_rewritten_below_staticmethod_works():
    class A:
        @staticmethod
        @rewrite(rulesets=["algebra"])
        def shifted(x):
            return x * 1.0 + 2.0

    np.testing.assert_allclose(A.shifted(X), X + 2.0)
    np.testing.assert_allclose(A().shifted(X), X + 2.0)


@pytest.mark.parametrize("vjp", [False, True])
def test_inside_disable_jit_the_function_runs_as_written_each_call(vjp):
    """`jax.disable_jit()` is how a JAX user debugs: prints and breakpoints see values. Inside it a rewritten
    function, like a jitted one, runs its Python each call; outside it, the rewritten program runs again."""
    calls = []

    def f(x):
        calls.append(type(x))
        return jnp.sin(x) * 1.0

    g = rewrite(f, rulesets=["algebra"])
    if vjp:
        with pytest.warns(DeprecationWarning):
            g = rewrite(f, rulesets=["algebra"], vjp=True)
    with jax.disable_jit():
        np.testing.assert_allclose(g(X), jnp.sin(X))
        np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(g(x)))(X), jnp.cos(X), rtol=1e-6)
        g(X)
    assert len(calls) == 3 and calls[0] is type(X)  # run each time, on the values themselves
    assert g.rewrites == 0
    g(X)
    g(X)
    assert len(calls) == 4 and g.rewrites == 1  # traced once, then the rewritten program runs


def test_jax_names_the_users_frames_not_the_rewriters():
    """The rewriter's package is left out of JAX's filtered tracebacks and of the frames JAX calls the user's,
    as JAX's own files are: the traceback of an error in the user's function under `jax.jit(rewrite(f))`
    goes from the call to the line, and a leaked tracer's message lists the user's frames."""
    import os
    import traceback

    import rewrite as package

    ours = os.path.dirname(os.path.abspath(package.__file__)) + os.sep
    with pytest.raises(jax.errors.TracerBoolConversionError) as raised:
        jax.jit(rewrite(_branches_on))({"w": jnp.ones(())}, X)
    files = [f.filename for f in traceback.extract_tb(raised.value.__traceback__)]
    assert __file__ in files and not any(f.startswith(ours) for f in files), files

    leaked = []
    rewrite(lambda x: leaked.append(x * 2) or x)(X)
    with pytest.raises(jax.errors.UnexpectedTracerError) as raised:
        rewrite(lambda x: x + leaked[0])(X)
    message = str(raised.value)
    assert "test_api_errors.py" in message and ours not in message, message
