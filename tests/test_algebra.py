"""rulesets.algebra is exact: every rule fires on a program holding its left side, and results keep every bit.

Each rule is run alone on a small program built around its left side; the
test asserts that it fired (and, where the rule saves work, that the cost
fell), then compares original and rewritten program bitwise on an array of
special values (signed zeros, infinities, NaN, subnormals, extremes) and on
random arrays from hypothesis. Two-function rules are also checked directly:
``lhs(x)`` against ``rhs(x)``, at several dtypes. Constant folding is checked
on a grid of special literals. Then the whole pack runs over the corpus.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import rulesets
from rewrite import RewriteLimitWarning, Ruleset, explain, rewrite, rule
from rewrite.report.report import primitive_counts
from rewrite.testing import arrays

from .packcheck import Side, array_leaves, assert_same_bits, corpus_programs, examples, only, special_array, specials

ALGEBRA = rulesets.algebra
F32, I32, BF16, F16, I8, BOOL = (np.dtype(t) for t in (np.float32, np.int32, jnp.bfloat16, np.float16, np.int8,
                                                       np.bool_))


# ---------------------------------------------------------------------- cases: (rule, program, input dtypes and shapes)
def _bind(prim, **params):
    return lambda x: prim.bind(x, **params)


V, M = (7,), (3, 5)  # a vector and a matrix

# expect: "cheaper" (fires and lowers the cost), "fires" (fires; the cost may stay), "declines" (must not
# fire). A fifth entry names rules run alongside.
CASES = [
    ("mul_one", lambda x: x * 1, [(F32, V)], "cheaper"),
    ("mul_one", lambda x: x * 1, [(I32, V)], "cheaper"),
    ("mul_one", lambda x: 1.0 * jnp.sin(x), [(F32, V)], "cheaper"),  # 1 on the left: patterns match either order
    ("mul_ones", lambda x: x * jnp.ones_like(x), [(F32, M)], "cheaper"),
    ("div_one", lambda x: x / 1.0, [(F32, V)], "cheaper"),
    ("add_neg_zero", lambda x: x + (-0.0), [(F32, V)], "cheaper"),
    ("add_neg_zero", lambda x: x + 0.0, [(F32, V)], "declines"),
    ("sub_zero", lambda x: x - 0.0, [(F32, V)], "cheaper"),
    ("sub_zero", lambda x: x - 0, [(I32, V)], "cheaper"),
    ("add_zero_int", lambda x: x + 0, [(I32, V)], "cheaper"),
    ("add_zero_int", lambda x: x + 0, [(F32, V)], "declines"),
    ("neg_zero_sub", lambda x: -0.0 - x, [(F32, V)], "fires"),
    ("zero_sub_int", lambda x: 0 - x, [(I32, V)], "fires"),
    ("zero_sub_int", lambda x: 0.0 - x, [(F32, V)], "declines"),
    ("mul_zero_int", lambda x: x * 0, [(I32, V)], "cheaper"),
    ("mul_zero_int", lambda x: x * 0.0, [(F32, V)], "declines"),  # inf * 0 is NaN
    ("sub_self_int", lambda x: (x + 3) - (x + 3), [(I32, V)], "cheaper"),
    ("sub_self_int", lambda x: x - x, [(F32, V)], "declines"),  # inf - inf is NaN
    ("mul_neg_one", lambda x: x * -1.0, [(F32, V)], "fires"),
    ("mul_neg_one", lambda x: x * -1, [(I32, V)], "fires"),
    ("neg_neg", lambda x: -(-x), [(F32, V)], "cheaper"),
    ("neg_neg", lambda x: -(-x), [(I32, V)], "cheaper"),
    ("sub_neg", lambda x, y: x - (-y), [(F32, V), (F32, V)], "cheaper"),
    ("add_neg", lambda x, y: x + (-y), [(F32, V), (F32, V)], "cheaper"),
    ("neg_mul_neg", lambda x, y: (-x) * (-y), [(F32, V), (F32, V)], "cheaper"),
    ("neg_mul_neg", lambda x, y: (-x) * (-y), [(I32, V), (I32, V)], "cheaper"),
    ("neg_div_neg", lambda x, y: (-x) / (-y), [(F32, V), (F32, V)], "cheaper"),
    ("neg_div_neg", lambda x, y: lax.div(-x, -y), [(I32, V), (I32, V)], "declines"),  # integer x/0 depends on x's sign
    ("abs_neg", lambda x: jnp.abs(-x), [(F32, V)], "declines"),  # JAX's derivative at ±0 is -1 for |-x|, +1 for |x|
    ("abs_neg", lambda x: jnp.abs(-jnp.maximum(x, 1.0)), [(F32, V)], "cheaper"),  # known non-zero
    ("abs_neg", lambda x: jnp.abs(-x), [(I32, V)], "cheaper"),
    ("abs_abs", lambda x: jnp.abs(jnp.abs(x)), [(F32, V)], "cheaper"),
    ("max_self", lambda x: jnp.maximum(x, x), [(F32, V)], "cheaper"),
    ("min_self", lambda x: jnp.minimum(x, x), [(F32, V)], "cheaper"),
    ("select_same", lambda p, x: jnp.where(p, x, x), [(BOOL, V), (F32, V)], "cheaper"),
    ("select_same", lambda p, x: lax.select_n(p, x, x), [(BOOL, ()), (I32, V)], "cheaper"),
    ("pow_zero", lambda x: x ** 0, [(F32, V)], "cheaper"),
    ("pow_zero", lambda x: x ** 0, [(I32, V)], "cheaper"),
    ("pow_one", lambda x: x ** 1, [(F32, V)], "cheaper"),
    ("pow_two", lambda x: x ** 2, [(F32, V)], "cheaper"),
    ("pow_two", lambda x: x ** 2, [(I32, V)], "cheaper"),
    ("square_pow", lambda x: jnp.square(x), [(F32, V)], "fires"),
    ("mul_self", lambda x: x * x, [(F32, V)], "fires"),
    ("pow_pow", lambda x: (x ** 2) ** 3, [(F32, V)], "cheaper"),
    ("pow_pow", lambda x: (x ** 4) ** 2, [(F32, V)], "cheaper"),
    ("pow_pow", lambda x: (x ** 2) ** -3, [(F32, V)], "cheaper"),
    ("pow_pow", lambda x: (x ** 4) ** 5, [(I32, V)], "cheaper"),
    ("pow_pow", lambda x: (x ** 3) ** 2, [(F32, V)], "declines"),  # x^6 is x^2 * x^4, not (x^3)^2
    ("pow_pow", lambda x: (x ** -2) ** 2, [(F32, V)], "declines"),  # 1/(1/x^2)^2 rounds twice
    ("mul_pows", lambda x: x ** 4 * x ** 3, [(F32, V)], "cheaper"),
    ("mul_pows", lambda x: x ** 3 * x ** 4, [(F32, V)], "cheaper"),
    ("mul_pows", lambda x: x ** 8 * x ** 8, [(F32, V)], "cheaper"),
    ("mul_pows", lambda x: x ** 2 * x ** 3, [(F32, V)], "declines"),  # x^5 is x * x^4
    ("mul_x_pow", lambda x: x * x ** 4, [(F32, V)], "cheaper"),
    ("mul_x_pow", lambda x: x * x ** 2, [(I32, V)], "cheaper"),
    ("layout_identity", _bind(lax.reshape_p, new_sizes=M, dimensions=None, sharding=None), [(F32, M)], "cheaper"),
    ("layout_identity", _bind(lax.squeeze_p, dimensions=()), [(F32, M)], "cheaper"),
    ("layout_identity", _bind(lax.transpose_p, permutation=(0, 1)), [(F32, M)], "cheaper"),
    ("reshape_reshape", lambda x: x.reshape(15).reshape(5, 3), [(F32, M)], "cheaper"),
    ("reshape_reshape", lambda x: x.reshape(15).reshape(3, 5), [(I32, M)], "cheaper"),
    ("reshape_chain", lambda x: jnp.squeeze(x, 0).reshape(5, 3), [(F32, (1, 3, 5))], "cheaper"),
    ("reshape_chain", lambda x: x[None].reshape(15), [(F32, M)], "cheaper"),
    ("reshape_chain", lambda x: jnp.broadcast_to(x, (4, 6)).reshape(3, 8), [(F32, ())], "cheaper"),
    ("reshape_chain", lambda x: jnp.broadcast_to(x, (4, 3, 5)).reshape(12, 5), [(F32, M)], "declines"),
    ("reshape_chain", lambda x: jnp.squeeze(x.reshape(1, 15, 1), (0, 2)), [(F32, M)], "cheaper"),
    ("reshape_chain", lambda x: jnp.squeeze(jnp.squeeze(x, 0), 1), [(F32, (1, 3, 1, 5))], "cheaper"),
    ("reshape_chain", lambda x: jnp.squeeze(x[None], 0), [(F32, M)], "cheaper"),
    ("reshape_chain", lambda x: x.reshape(15)[None], [(F32, M)], "cheaper"),
    ("reshape_chain", lambda x: jnp.squeeze(x, 0)[:, None], [(F32, (1, 3, 5))], "cheaper"),
    ("broadcast_broadcast", lambda x: jnp.broadcast_to(jnp.broadcast_to(x, (4, 5)), (2, 4, 5)), [(F32, (5,))],
     "cheaper"),
    ("transpose_transpose", lambda x: x.transpose(1, 2, 0).transpose(2, 0, 1), [(F32, (2, 3, 4))], "cheaper"),
    ("transpose_transpose", lambda x: x.transpose(1, 2, 0).transpose(1, 0, 2), [(F32, (2, 3, 4))], "cheaper"),
    ("transpose_broadcast", lambda x: jnp.broadcast_to(x, (4, 5)).T, [(F32, (5,))], "cheaper"),
    ("transpose_broadcast", lambda x: jnp.broadcast_to(x, (4, 3, 5)).transpose(0, 2, 1), [(F32, M)], "declines"),
    ("reduce_unit_axes", lambda x: x.sum(axis=1), [(F32, (5, 1))], "cheaper"),
    ("reduce_unit_axes", lambda x: x.sum(axis=(0, 2)), [(I32, (1, 5, 1))], "cheaper"),
    ("reduce_unit_axes", lambda x: x.sum(axis=0), [(F32, M)], "declines"),
    ("reduce_unit_axes", lambda x: x.prod(axis=1), [(F32, (5, 1))], "cheaper"),
    ("reduce_unit_axes", lambda x: x.max(axis=0), [(F32, (1, 5))], "cheaper"),
    ("reduce_unit_axes", lambda x: x.min(axis=0), [(F32, (1, 5))], "cheaper"),
    ("reduce_unit_axes", lambda x: x.all(axis=0), [(BOOL, (1, 5))], "cheaper"),
    ("reduce_unit_axes", lambda x: x.any(axis=0), [(BOOL, (1, 5))], "cheaper"),
    ("arg_unit_axes", lambda x: jnp.argmax(x, axis=1), [(F32, (5, 1))], "cheaper"),
    ("arg_unit_axes", lambda x: jnp.argmin(x, axis=0), [(F32, (1, 5))], "cheaper"),
    ("convert_convert", lambda x: x.astype(jnp.float32).astype(jnp.bfloat16), [(BF16, V)], "cheaper"),
    ("convert_convert", lambda x: x.astype(jnp.float32).astype(jnp.bfloat16), [(F16, V)], "cheaper"),
    ("convert_convert", lambda x: x.astype(jnp.int32).astype(jnp.float32), [(I8, V)], "cheaper"),
    ("convert_convert", lambda x: x.astype(jnp.float32).astype(jnp.int8), [(I8, V)], "cheaper"),
    ("convert_convert", lambda x: x.astype(jnp.int32).astype(jnp.int8), [(I32, V)], "declines"),  # narrows first
    ("convert_convert", lambda x: x.astype(jnp.float32).astype(jnp.int16), [(I8, V)], "declines"),  # float -> int
    ("convert_convert", lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), [(F32, V)], "declines"),
]


def _ids(cases):
    return [f"{c[0]}-{'-'.join(f'{d.name}{list(s)}' for d, s in c[2])}-{c[3]}" for c in cases]


def _special_args(specs, shift=0):
    return [special_array(d, s, shift=shift * (k + 1)) for k, (d, s) in enumerate(specs)]


def test_importing_a_pack_module_keeps_the_pack_name_bound_to_its_ruleset():
    import importlib
    import sys

    importlib.import_module("rulesets.algebra")
    setattr(rulesets, "algebra", sys.modules["rulesets.algebra"])  # what the import system does
    assert rulesets.algebra is ALGEBRA and isinstance(rulesets.BUILTIN["algebra"], Ruleset)


def test_every_rule_has_a_case():
    covered = {c[0] for c in CASES} | {r.name for r in _FOLD_RULES}
    assert {r.name for r in ALGEBRA} - covered == set()


@functools.lru_cache(maxsize=None)
def _report(i: int):
    name, fn, specs, _, *also = CASES[i]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = explain(fn, *_special_args(specs), rulesets=[only(ALGEBRA, name, *(also[0] if also else ()))])
    report.release()  # cached for the session: keep the programs and counts, not each e-graph
    return report


@pytest.mark.parametrize("i", range(len(CASES)), ids=_ids(CASES))
def test_rule_fires(i):
    name, fn, specs, expect, *_ = CASES[i]
    report = _report(i)
    if expect == "declines":
        assert name not in report.fired, report
        assert report.cost_after == report.cost_before
    else:
        assert report.fired.get(name, 0) >= 1, report
        if expect == "cheaper":
            assert report.cost_after < report.cost_before, report


# Compiling is what costs time here (XLA takes ~0.3 s a program on this
# machine), so every case's original and rewritten programs are compared
# inside one program each: two compilations for all rules.
@functools.lru_cache(maxsize=None)
def _all_cases() -> Side:
    return Side([_report(i) for i in range(len(CASES))], [c[2] for c in CASES], [c[0] for c in CASES])


def test_rules_keep_every_bit_on_special_values():
    side = _all_cases()
    for shift in range(3):  # every special value meets every other in the binary rules
        side.check_exact([_special_args(c[2], shift) for c in CASES], eager=True)


def test_rules_keep_jax_derivatives_on_special_values():
    """Equal values are not enough: at a kink (0, -0.0) two forms of one value can differ in derivative."""
    side = _all_cases()
    for shift in range(3):
        side.check_derivatives([_special_args(c[2], shift) for c in CASES])


def test_abs_neg_keeps_the_derivative_at_signed_zeros():
    """Issue 29: |-x| -> |x| kept the value and flipped jax.grad at ±0 from -1 to +1."""
    f = lambda x: jnp.abs(-x).sum()  # noqa: E731
    x = jnp.array([0.0, -0.0, 1.0, -1.0])
    want = jax.grad(f)(x)
    for transform in (jax.grad, lambda g: jax.jit(jax.grad(g))):
        np.testing.assert_array_equal(transform(rewrite(f, rulesets=[ALGEBRA]))(x), want)


@settings(max_examples=examples(10))
@given(data=st.data())
def test_rules_keep_every_bit_on_random_inputs(data):
    args = [[data.draw(arrays(s, d)) for d, s in c[2]] for c in CASES]
    _all_cases().check_exact(args)


@pytest.mark.parametrize("folded,direct", [
    (lambda x: (x ** 3) ** 2, lambda x: x ** 6),
    (lambda x: x ** 2 * x ** 3, lambda x: x ** 5),
    (lambda x: (x ** -2) ** 2, lambda x: x ** -4),
], ids=["(x^3)^2 vs x^6", "x^2*x^3 vs x^5", "(x^-2)^2 vs x^-4"])
def test_integer_pow_foldings_left_out_are_not_exact(folded, direct):
    """Why pow_pow and mul_pows decline these: XLA's repeated squaring rounds them differently."""
    x = jax.random.uniform(jax.random.PRNGKey(0), (4096,), minval=0.5, maxval=2.0)
    both = jax.jit(lambda x: (folded(x), direct(x)))(x)
    assert (np.asarray(both[0]) != np.asarray(both[1])).any()


# ---------------------------------------------------------------------- two-function rules, side by side
# lhs(x) against rhs(x) under jit at several dtypes: the rule's claim itself,
# whatever the extractor picks. All rules of one dtype share two compilations.
_DTYPES = {"float32": F32, "bfloat16": BF16, "float16": F16, "int32": I32, "int8": I8}


@functools.lru_cache(maxsize=None)
def _sides(dtype_name: str):
    from rewrite import Value

    d = _DTYPES[dtype_name]
    names, lhss, rhss, arity = [], [], [], []
    for r in ALGEBRA:
        if r.is_pat or r.is_procedural or (r.example is not None and r.example[0].dtype == np.bool_):
            continue  # procedural rules and select_same (a bool operand) are covered by CASES
        avals = tuple(jax.core.ShapedArray((11,), d) for _ in r.var_names)
        if r.when is not None and not r.when(*[Value.from_aval(a) for a in avals]):
            continue
        try:
            lhs, rhs = r.traced(avals)
        except Exception:
            continue
        if lhs.out_avals != rhs.out_avals:
            continue  # jnp promotes this dtype: no program holds this left side
        names.append(r.name)
        lhss.append(jax.extend.core.jaxpr_as_fun(lhs))
        rhss.append(jax.extend.core.jaxpr_as_fun(rhs))
        arity.append(len(avals))
    specs = [[None] * n for n in arity]
    side = Side.of_functions(lhss, rhss, specs, names)
    return side, arity


@pytest.mark.parametrize("dtype", list(_DTYPES))
@settings(max_examples=examples(5))
@given(data=st.data())
def test_two_function_rule_sides_agree(dtype, data):
    side, arity = _sides(dtype)
    d = _DTYPES[dtype]
    assert len(arity) >= 10, side.names
    side.check_exact([[special_array(d, (11,), shift=3 * k) for k in range(n)] for n in arity])
    side.check_exact([[data.draw(arrays((11,), d)) for _ in range(n)] for n in arity])


# ---------------------------------------------------------------------- constant folding
def test_xla_cpu_flushes_subnormals_at_run_time():
    """The measured fact behind folding's subnormal guard: run time flushes, compile time does not."""
    if jax.default_backend() != "cpu":
        pytest.skip("a fact of XLA:CPU (a GPU keeps subnormals at run time)")
    tiny = np.float32(np.finfo(np.float32).tiny)
    x = jnp.asarray([tiny, np.float32(1e-40)])
    run_time = jax.jit(lambda x, y: x * y)(x, jnp.float32(0.5))
    assert (np.asarray(run_time) == 0).all()  # FTZ: tiny/2 is subnormal, flushed; DAZ: 1e-40 read as 0
    compile_time = jax.jit(lambda: jnp.float32(tiny) * jnp.float32(0.5))()
    assert float(compile_time) == float(tiny) / 2  # folded by XLA at compile time, not flushed


_FOLD_UNARY = [("neg", lax.neg), ("abs", lax.abs), ("sqrt", lax.sqrt), ("square", lax.square)]
_FOLD_BINARY = [("add", lax.add), ("sub", lax.sub), ("mul", lax.mul), ("div", lax.div),
                ("max", lax.max), ("min", lax.min), ("eq", lax.eq), ("ne", lax.ne),
                ("lt", lax.lt), ("le", lax.le), ("gt", lax.gt), ("ge", lax.ge)]
_FOLD_INT = [("and", lax.bitwise_and), ("or", lax.bitwise_or)]
_FOLD_RULES = Ruleset("folding", [r for r in ALGEBRA if r.name.startswith("fold_")])


def _folding_program(values, dtype):
    """Every folding rule applied to literals made from ``values`` (pairs cycle through them)."""
    n = len(values)

    def program(x):
        lit = [jnp.asarray(v, dtype) for v in values]  # staged: these become literals in the jaxpr
        outs = []
        for i in range(n):
            a, b = lit[i], lit[(i * 7 + 3) % n]
            if jnp.issubdtype(dtype, jnp.floating):
                outs += [f(a) for _, f in _FOLD_UNARY]
            else:
                outs += [lax.neg(a), lax.abs(a), lax.square(a), lax.bitwise_not(a)]
                outs += [f(a, b) for _, f in _FOLD_INT]
            outs += [f(a, b) for name, f in _FOLD_BINARY if not (name == "div" and not
                                                               jnp.issubdtype(dtype, jnp.floating))]
            outs += [lax.integer_pow(a, k) for k in (0, 2, 3, 5, -1, -2)
                     if k >= 0 or jnp.issubdtype(dtype, jnp.floating)]
            # a convert of a concrete value runs at trace time; of a folded neg, it is staged
            outs += [lax.convert_element_type(lax.neg(a), t) for t in (jnp.float32, jnp.int32, jnp.int8, jnp.bool_)]
            outs.append(lax.select_n(lit[i] > lit[(i + 1) % n], a, b))
        return outs

    return program


def _explain_quietly(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # JAX's own casts of NaN and inf, at trace time
        return explain(*args, **kwargs)


@pytest.mark.parametrize("dtype", [F32, I32])
def test_folding_on_a_grid_of_special_literals(dtype):
    with np.errstate(all="ignore"):
        values = [np.asarray(v).astype(dtype) for v in specials(dtype)]
    program = _folding_program(values, dtype)
    x = jnp.zeros((), dtype)
    report = _explain_quietly(program, x, rulesets=[_FOLD_RULES])
    fired = set(report.fired)
    assert {r.name for r in _FOLD_RULES} <= fired, {r.name for r in _FOLD_RULES} - fired
    # every operation the group rules fold is folded somewhere (floats: no bitwise ops; integers: no sqrt, div)
    folded = {n for n, _ in _FOLD_UNARY + _FOLD_BINARY + _FOLD_INT} | {"not"}
    folded -= {"and", "or", "not"} if dtype == F32 else {"sqrt", "div"}
    before_n, after_n = primitive_counts(report.before), primitive_counts(report.after)
    assert {n for n in folded if after_n[n] < before_n[n]} == folded, {n: (before_n[n], after_n[n]) for n in folded}
    after = jax.extend.core.jaxpr_as_fun(report.after)
    before = jax.extend.core.jaxpr_as_fun(report.before)
    assert_same_bits(jax.jit(after)(x), jax.jit(before)(x), context="folding (jit)")
    assert_same_bits(after(x), before(x), context="folding (eager)")  # no subnormal is ever folded
    assert len(report.after.eqns) < len(report.before.eqns) // 2  # all but subnormal operands fold


@settings(max_examples=examples(6))
@given(values=st.lists(st.floats(width=32), min_size=3, max_size=3))
def test_folding_random_float_literals(values):
    values = [np.float32(v) for v in values]
    program = _folding_program(values, F32)
    x = jnp.zeros((), F32)
    report = _explain_quietly(program, x, rulesets=[_FOLD_RULES])
    tiny = 2 * float(np.finfo(np.float32).tiny)
    if all(v == 0 or not abs(v) < tiny for v in values):  # near-subnormal operands are declined
        assert report.fired.get("fold_binary", 0) >= 1
    after = jax.extend.core.jaxpr_as_fun(report.after)
    before = jax.extend.core.jaxpr_as_fun(report.before)
    assert_same_bits(jax.jit(after)(x), jax.jit(before)(x), context="folding (jit)")
    assert_same_bits(after(x), before(x), context="folding (eager)")


def test_float64_programs():
    """With x64 enabled: float64 folding, the f32 -> f64 -> f32 round trip, identities at float64."""
    with jax.enable_x64(True):
        def f(x, y):
            wide = x.astype(jnp.float64).astype(jnp.float32)          # convert_convert -> x
            folded = y * (jnp.float64(0.1) + jnp.float64(0.2))       # fold_add, in float64
            return wide, -(-folded) * 1, jnp.float64(1e300) * jnp.float64(1e10) + y  # overflow folds to inf

        x = special_array(F32, (24,))
        y = special_array(np.float64, (24,), shift=5)
        report = explain(f, x, y, rulesets=[ALGEBRA])
        assert {"convert_convert", "fold_binary", "neg_neg", "mul_one"} <= set(report.fired), report.fired
        assert report.after.eqns and all(e.primitive.name != "convert_element_type" for e in report.after.eqns)
        after = jax.jit(jax.extend.core.jaxpr_as_fun(report.after))
        before = jax.jit(jax.extend.core.jaxpr_as_fun(report.before))
        assert_same_bits(after(x, y), before(x, y), context="float64")


# ---------------------------------------------------------------------- composition
def test_user_rule_matches_through_commutation():
    """A user rule written for 2*sin(x)*cos(x) matches cos(x)*(sin(x)*2): patterns match add and mul in
    either operand order, on their own and with algebra's rules alongside."""
    double_angle = rule(lambda x: 2 * jnp.sin(x) * jnp.cos(x), lambda x: jnp.sin(2 * x), name="double_angle")
    trig = Ruleset("trig", [double_angle], soundness="identity")

    def f(x):
        return jnp.cos(x) * (jnp.sin(x) * 2)

    x = jnp.linspace(-3.0, 3.0, 11)
    for packs in ([trig], [ALGEBRA + trig]):
        report = explain(f, x, rulesets=packs)
        assert report.fired["double_angle"] == 1
        assert "double_angle" in str(report) and "double_angle" in report.rules()
        assert primitive_counts(report.after) == {"mul": 1, "sin": 1}
        got = jax.extend.core.jaxpr_as_fun(report.after)(x)[0]
        np.testing.assert_allclose(got, f(x), rtol=1e-6, atol=1e-6)


def test_either_order_keeps_the_rule_exact():
    """A match in the other operand order is verified in that order: x * 1 -> x fires on 1 * x, and a
    pattern over a - b (not commutative) does not fire on b - a."""
    one = rule(lambda x: x * 1.0, lambda x: x, name="mul1")
    sub = rule(lambda x: x - jnp.sin(x), lambda x: -jnp.sin(x) + x, name="sub_sin")
    x = jnp.array([0.0, -0.0, 1.5, -jnp.inf, jnp.nan], jnp.float32)
    assert explain(lambda x: 1.0 * jnp.exp(x), x, rulesets=[Ruleset("m", [one])]).fired == {"mul1": 1}
    assert explain(lambda x: jnp.sin(x) - x, x, rulesets=[Ruleset("s", [sub], soundness="identity")]).fired == {}


def test_both_orders_in_one_program_are_one_class():
    """x*y and y*x written in one program are one value (a fact rule merges them), so it is computed once."""
    report = explain(lambda x, y: jnp.sin(x * y) + jnp.cos(y * x), jnp.ones(3), jnp.ones(3), rulesets=[ALGEBRA])
    assert primitive_counts(report.after)["mul"] == 1
    assert report.cost_after < report.cost_before


def test_literal_wildcard_pattern():
    """``Pat.lit()`` with no value matches any literal, and binds it for the procedure."""
    r = ALGEBRA.rule("fold_binary")
    report = explain(lambda x: x + (jnp.float32(2.5) + jnp.float32(0.25)), jnp.ones(3), rulesets=[Ruleset("f", [r])])
    assert report.fired == {"fold_binary": 1}
    assert [e.primitive.name for e in report.after.eqns] == ["add"]
    assert float(report.after.eqns[0].invars[1].val) == 2.75


# ---------------------------------------------------------------------- the corpus
def test_corpus_keeps_every_bit_and_never_raises_cost():
    programs = corpus_programs()
    reports = []
    for name, fn, args in programs:
        report = explain(fn, *args, rulesets=[ALGEBRA])
        assert report.stopped == "saturated", f"{name}: {report.summary()}"
        assert report.cost_after <= report.cost_before, name
        reports.append(report)
    args = [array_leaves(a) for _, _, a in programs]
    Side(reports, args, [n for n, _, _ in programs], reference="corpus").check_exact(args)


def _constant_chain(x, links=40):
    """numpyro's ``betaln`` of two constants: a chain of operations on literals, folded a link at a time."""
    c = lax.min(jnp.float32(0.2), jnp.float32(1.1))
    for _ in range(links):
        c = lax.add(lax.mul(c, jnp.float32(0.5)), jnp.float32(1.0))
    return x * c


@pytest.mark.parametrize("packs", [[rulesets.algebra], "every"])
def test_a_chain_of_constants_folds_whole_without_reaching_the_iteration_limit(packs):
    # Each link of the chain was folded in an iteration of its own: numpyro's Beta(0.2, 1.1).log_prob stopped at
    # the iteration limit (30) with a RewriteLimitWarning at every new shape, the chain half folded.
    packs = [rulesets.algebra, rulesets.nn, rulesets.linalg, rulesets.scan, rulesets.derivatives] \
        if packs == "every" else packs
    x = jnp.linspace(-3.0, 3.0, 7, dtype=jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewriteLimitWarning)
        report = explain(_constant_chain, x, rulesets=packs)
        got = rewrite(_constant_chain, rulesets=packs, strict=True)(x)
    assert report.stopped.startswith("saturated"), report.stopped
    assert report.iterations <= 4
    assert primitive_counts(report.after) == {"mul": 1}  # the 81 operations on literals are one literal
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(_constant_chain)(x)))
