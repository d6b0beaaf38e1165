"""``rulesets.derivatives``: every rule checked on random inputs, and what the pack does to real VJPs.

Each rule is checked in the program it fires in, not only as an equation:
the program is saturated with that one rule, and for every class where the
rule built a node, a program that *uses* that node is emitted (the
extractor's choice, with that class switched to the rule's node) and run
against the original on inputs drawn by hypothesis. So a rule is tested
even where the cost model would not pick it.

* ``exact`` rules: bit for bit (any NaN equals any NaN), on inputs that
  include 0, -0.0, infinities and NaN.
* ``identity`` rules: against the same program evaluated in float64, the
  rewritten program may be no further from that reference than the
  original is, plus the pack's tolerance (relative to the output's scale);
  and where the reference is not finite (``a * (g / a)`` at ``a = 0``) it
  must not invent a finite value. A rewrite that underflows where the
  original did not (``log x + log y -> log(x*y)``) fails this; one that
  avoids the original's overflow (``log(exp(100)) -> 100``) passes.
* ``fastmath`` rules: the same, on ordinary values, without the
  non-finite condition.
"""

from __future__ import annotations

import functools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax._src import core

from rewrite import AnalyticCost, Ruleset, Tolerance, explain, rewrite
from rewrite.extract.extractor import Extractor
from rewrite.jaxpr.emit import EmitError, emit
from rewrite.report.report import primitive_counts
from rulesets.derivatives import SUMS_ITERATIONS, SUMS_MIN_SAVING, derivatives, derivatives_fastmath

F32 = np.float32

DOMAINS = {
    "any": st.floats(-50, 50, width=32),
    "sum": st.one_of(st.floats(-100, 100, width=32), st.floats(-2.0**66, 2.0**66, width=32)),
    "wide": st.one_of(st.floats(-100, 100, width=32), st.floats(-2.0**66, 2.0**66, width=32),
                      st.floats(-2.0**-66, 2.0**-66, width=32)),
    # where exp is finite and nonzero in float64, so that the float64 reference of log(exp x) is the math's x: past
    # |x| = 709 it is inf or -inf there, and a rewrite that gives x would read as a value the math has not
    "exp": st.one_of(st.floats(-100, 100, width=32), st.floats(-700, 700, width=32)),
    "moderate": st.floats(-8, 8, width=32),
    "pos": st.floats(0.015625, 64.0, width=32),
    "special": st.one_of(st.floats(-1e3, 1e3, width=32), st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan])),
}


def _rule_owner(name):
    for pack in (derivatives, derivatives_fastmath):
        for r, owner in pack.entries():
            if r.name == name:
                return r, owner
    raise KeyError(name)


def programs_using(fn, args, rule_name):
    """Programs in which a node the rule built is used, one per class it built a node in."""
    rule, owner = _rule_owner(rule_name)
    report = explain(fn, *args, rulesets=[Ruleset(rule_name, [rule], soundness=owner.soundness,
                                                  tolerance=owner.tolerance)])
    assert report.fired.get(rule_name, 0) >= 1, f"{rule_name} did not fire: {report.summary()}"
    res = report.result
    eg, snap = res.egraph, res.snapshot
    full = {**Extractor(snap, AnalyticCost()).tree()[1], **res.choice}
    out = []
    seen = set()
    for vid, origin in enumerate(eg.vorigin):
        if origin != rule_name:
            continue
        node = eg.canonical(snap, vid)
        cls = snap.cls_of_name[vid]
        if node is None or cls is None or node not in snap.nodes.get(cls, ()) or res.choice.get(cls) == node:
            continue
        choice = dict(full)
        choice[cls] = node
        try:
            prog = emit(snap, choice, eg, res.before.in_avals, res.roots, None, res.before.jaxpr.debug_info)
        except EmitError:
            continue  # this switch would make a cycle
        key = str(prog)
        if key not in seen and key != str(res.before):
            seen.add(key)
            out.append(prog)
    if str(res.after) != str(res.before) and str(res.after) not in seen:
        out.append(res.after)
    assert out, f"{rule_name} fired but no program can use what it built"
    return res.before, out, owner


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    both_nan = np.isnan(a) & np.isnan(b)
    same = a.view(np.uint32) == b.view(np.uint32)
    return bool(np.all(both_nan | same))


_JITTED: dict = {}


def _jitted(closed):
    """``closed`` under jit, compiled once for every example: ``jax.jit(jaxpr_as_fun(closed))`` anew each
    time is a new function to jit, traced and compiled again (0.05-0.3 s an example)."""
    if id(closed) not in _JITTED:
        _JITTED[id(closed)] = (closed, jax.jit(core.jaxpr_as_fun(closed)))  # holds closed: its id stays its own
    return _JITTED[id(closed)][1]


def check(before, after, owner, inputs, fn, domain):
    want = _jitted(before)(*inputs)
    got = _jitted(after)(*inputs)
    if owner.soundness == "exact":
        for w, g in zip(want, got):
            assert _bits_equal(w, g), (w, g)
        return
    with jax.enable_x64(True):
        ref = jax.tree_util.tree_leaves(jax.jit(fn)(*[np.asarray(x, np.float64) for x in inputs]))
        # A sum may be reassociated (XLA reorders sums itself): its scale is that of its terms.
        mag = jax.tree_util.tree_leaves(jax.jit(fn)(*[np.abs(np.asarray(x, np.float64)) for x in inputs])) \
            if domain == "sum" else ref
    for w, g, r, m in zip(want, got, ref, mag):
        w, g, r = np.asarray(w, np.float64), np.asarray(g, np.float64), np.asarray(r, np.float64)
        rtol, atol = owner.tolerance.for_dtype(np.float32)
        finite = np.isfinite(r)
        m = np.asarray(m, np.float64)
        scale = np.max(np.abs(np.where(np.isfinite(m), m, 0)), initial=0.0)
        with np.errstate(all="ignore"):  # inf - inf where the masks below look away
            old_err = np.where(np.isfinite(w), np.abs(w - r), np.inf)
            new_err = np.where(np.isfinite(g), np.abs(g - r), np.inf)
        bad = finite & ~(new_err <= old_err + atol + rtol * scale)
        assert not bad.any(), f"rewrite moved away from the float64 result: ref {r[bad]}, before {w[bad]}, after {g[bad]}"
        if owner.soundness == "identity":
            invented = ~finite & np.isfinite(g) & ~np.isfinite(w)
            assert not invented.any(), f"rewrite made a finite value where the math has none: {g[invented]}"


S = (3, 4)
V = (4,)
CASES = [
    # rule, function, input shapes, domain
    ("add_neg", lambda x, y: x + (-y), [S, S], "special"),
    ("sign_neg_add", lambda x, y: (-x) + y, [S, S], "special"),
    ("sub_neg", lambda x, y: x - (-y), [S, S], "special"),
    ("sign_add_any", lambda x, g: jax.vjp(lambda v: v * jnp.sin(v), x)[1](g)[0], [S, S], "special"),
    ("reduce_unit_axes", lambda x: jnp.sum(x, axis=1), [(3, 1, 4)], "special"),
    ("reshape_reshape", lambda x: x.reshape(12).reshape(2, 6), [S], "special"),
    ("red_reshape_neg", lambda x: (-(x.reshape(12))).reshape(3, 4), [S], "special"),
    ("trig_sin_stored", lambda x, g: jax.vjp(lambda v: jnp.sin(v) ** 2, x)[1](g)[0], [S, S], "special"),
    ("trig_sin_stored", lambda x, g: (jnp.sin(x) * g, jnp.cos(x) * g), [S, S], "special"),
    ("trig_cos_neg", lambda x: jnp.cos(-x), [S], "moderate"),
    ("trig_sin_neg", lambda x: jnp.sin(-x) * jnp.sin(x), [S], "moderate"),
    ("trig_pythagoras", lambda x: jnp.sin(x) ** 2 + jnp.cos(x) ** 2, [S], "moderate"),
    ("trig_pythagoras", lambda x: jnp.cos(x) ** 2 + jnp.sin(x) ** 2, [S], "moderate"),
    ("trig_one_minus_sin2", lambda x: 1.0 - jnp.sin(x) ** 2, [S], "moderate"),
    ("trig_one_minus_cos2", lambda x: 1.0 - jnp.cos(x) ** 2, [S], "moderate"),
    ("trig_cos_double", lambda x: jnp.cos(jnp.tanh(x)) ** 2 - jnp.sin(jnp.tanh(x)) ** 2, [S], "moderate"),
    ("trig_cos_double_any", lambda x: jnp.cos(x) ** 2 - jnp.sin(x) ** 2, [S], "moderate"),
    ("trig_tan", lambda x: jnp.tan(x) + jnp.sin(x) * jnp.cos(x), [S], "moderate"),
    ("trig_sin2_over", lambda x, b: jnp.sin(b[None, :] * x) ** 2 / b[None, :], [S, V], "special"),  # its kernel
    ("explog_log_exp", lambda x: jnp.log(jnp.exp(x)), [S], "exp"),
    ("explog_exp_log", lambda x: jnp.exp(jnp.log(jnp.abs(x))), [S], "wide"),
    ("explog_log_add", lambda x, y: jnp.log(jnp.abs(x)) + jnp.log(y * y), [S, S], "pos"),
    ("explog_one_minus_logistic", lambda x: 1.0 - jax.nn.sigmoid(x), [S], "wide"),
    ("prod_mul", lambda x: 2.0 * jnp.sin(jnp.tanh(x)) * jnp.cos(jnp.tanh(x)), [S], "moderate"),
    ("prod_mul", lambda x, g: (g * (2.0 * jnp.sin(jnp.sin(x)))) * jnp.cos(jnp.sin(x)) * 3.0, [S, S], "moderate"),
    ("prod_mul_cancel", lambda x: 2.0 * jnp.sin(x) * jnp.cos(x), [S], "moderate"),  # any x: fastmath
    ("prod_mul", lambda x: (x ** 2) * (x ** 3) * x, [S], "wide"),
    ("prod_mul", lambda x, y: jnp.exp(x) * jnp.exp(y) * jnp.exp(-x), [S, S], "moderate"),
    ("prod_mul", lambda x, y: (jnp.exp(x) + 1.0) * (y / (jnp.exp(x) + 1.0)), [S, S], "any"),  # exp(x) < inf
    ("prod_div", lambda x, y: (y * (jnp.abs(x) + 1.0)) / (jnp.abs(x) + 1.0), [S, S], "wide"),
    ("prod_div", lambda x: 1.0 / (jnp.sin(jnp.tanh(x)) * jnp.cos(jnp.tanh(x))), [S], "moderate"),
    ("prod_div_cancel", lambda x: 1.0 / (jnp.sin(x) * jnp.cos(x)), [S], "moderate"),
    ("prod_div", lambda x, g: (g * jnp.sinh(x)) / (2.0 * jnp.cosh(x)), [S, S], "any"),       # tanh
    ("prod_mul", lambda x, g: (g / (1.0 + jnp.exp(x))) * jnp.exp(x), [S, S], "any"),        # logistic
    ("prod_div", lambda x, g: g / (1.0 + jnp.exp(-x)) + g / (jnp.exp(x) + 1.0), [S, S], "wide"),
    ("prod_pow", lambda x: (x * x) ** 3, [S], "moderate"),
    ("red_pull", lambda x, b: jnp.sum(x * b[None, :], axis=0), [S, V], "sum"),
    ("red_pull", lambda x, b: jnp.sum(-(2.0 * x) / b[None, :] * b[None, :] ** 2, axis=0), [S, V], "pos"),
    ("red_sum_neg", lambda x: jnp.sum(-x, axis=0), [S], "sum"),
    ("red_neg_sum", lambda x, y: -jnp.sum(x, axis=0) + jnp.sum(y, axis=0), [S, S], "sum"),
    ("red_merge", lambda x, y: jnp.sum(x, axis=0) + jnp.sum(y, axis=0), [S, S], "sum"),
    ("red_merge", lambda x, y: jnp.sum(x, axis=1) - jnp.sum(y, axis=1), [S, S], "sum"),
    ("red_split", lambda x, y: jnp.sum(x + y, axis=0), [S, S], "sum"),
    ("red_split", lambda x, y: jnp.sum(x - y, axis=(0, 1)), [S, S], "sum"),
    ("prod_mul_cancel", lambda a, g: a * (g / a), [S, S], "pos"),
    ("prod_div_cancel", lambda a, g: (a * g) / a, [S, S], "pos"),
]


def _id(case):
    return case[0]


@pytest.mark.parametrize("name,fn,shapes,domain", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_keeps_values(name, fn, shapes, domain):
    args = [jnp.ones(s, F32) * 0.5 for s in shapes]
    before, programs, owner = programs_using(fn, args, name)
    elements = DOMAINS[domain]

    @settings(max_examples=8)
    @given(st.tuples(*[hnp.arrays(F32, s, elements=elements) for s in shapes]))
    def prop(inputs):
        for p in programs:
            check(before, p, owner, [jnp.asarray(x) for x in inputs], fn, domain)

    prop()


_HUGE = {np.dtype(np.float32): 3e38, np.dtype(np.float16): 6e4, np.dtype(jnp.bfloat16): 3e38}


@pytest.mark.parametrize("fn", [
    lambda x: 2.0 * jnp.sin(x) * jnp.cos(x),
    lambda x: jnp.cos(x) ** 2 - jnp.sin(x) ** 2,
    lambda x: 1.0 / (jnp.sin(x) * jnp.cos(x)),
    lambda x, g: (g * (2.0 * jnp.sin(x))) * jnp.cos(x) * 3.0,
], ids=["2 sin cos", "cos2 - sin2", "1 / (sin cos)", "g 2 sin cos 3"])
@pytest.mark.parametrize("dtype", list(_HUGE), ids=lambda d: d.name)
def test_double_angles_keep_values_where_2x_overflows(fn, dtype):
    """Issue 29: sin(2x) and cos(2x) are NaN at x = 3e38 (float32), where 2 sin x cos x is a number."""
    huge = _HUGE[dtype]
    n = fn.__code__.co_argcount
    x = jnp.asarray(np.asarray([huge, -huge, huge / 1.5, 1.0, -0.5], np.float64).astype(dtype))
    args = (x,) + (jnp.ones_like(x),) * (n - 1)
    want = fn(*args)
    assert np.isfinite(np.asarray(want, np.float64)[:3]).all()
    got = rewrite(fn, rulesets=[derivatives])(*args)
    rtol, atol = (derivatives.tolerance or Tolerance()).for_dtype(dtype)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)
    # 2x computed in a type where it cannot overflow, or bounded by 1, still earns the rewrite
    bounded = explain(lambda *a: fn(jnp.tanh(a[0]), *a[1:]), *args, rulesets=[derivatives])
    assert set(bounded.fired) & {"prod_mul", "prod_div", "trig_cos_double"}, bounded.fired


@settings(max_examples=25)
@given(hnp.arrays(F32, (6,), elements=st.floats(float(np.float32(1e38)), float(np.finfo(np.float32).max), width=32)))
def test_double_angle_keeps_values_at_any_huge_float32(x):
    fn = lambda x: 2.0 * jnp.sin(x) * jnp.cos(x) - (jnp.cos(x) ** 2 - jnp.sin(x) ** 2)  # noqa: E731
    x = jnp.asarray(x)
    got, want = rewrite(fn, rulesets=[derivatives])(x), fn(x)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_doubles_safely_knows_bounded_and_narrow_arguments():
    from rulesets.derivatives import doubles_safely

    def fires(f, x):
        return "prod_mul" in explain(f, x, rulesets=[derivatives]).fired

    two_sin_cos = lambda t: 2.0 * jnp.sin(t) * jnp.cos(t)  # noqa: E731
    x32, x16, i32 = jnp.ones(3), jnp.ones(3, jnp.float16), jnp.ones(3, jnp.int32)
    assert not fires(two_sin_cos, x32)
    assert fires(lambda x: two_sin_cos(jnp.tanh(x)), x32)
    assert fires(lambda x: two_sin_cos(x.astype(jnp.float32)), x16)           # float16's 65504 doubles in float32
    assert fires(lambda x: two_sin_cos(x.astype(jnp.float32)), i32)           # so does any int32
    assert not fires(lambda x: two_sin_cos(x.astype(jnp.float32)), x32.astype(jnp.bfloat16))  # 3.4e38 does not
    assert not fires(lambda x: two_sin_cos(x * 0.5), x32)                     # products are not tracked
    assert doubles_safely.__doc__


@pytest.mark.parametrize("fn", [
    lambda x: (x * 2.0) / 0.0,                       # a literal 0 to a negative power
    lambda x: 3.0 / (x * 0.0) * 2.0,
    lambda x: jnp.sum(x * 0.0 / 0.0 * x, 0),
    lambda x: (x * 1e30) ** 20 * 2.0,                # literals whose product overflows
], ids=["div_zero", "reciprocal_zero", "sum_of_div_zero", "overflow"])
def test_a_literal_the_product_rules_cannot_power_is_declined_not_raised(fn):
    # Found by the thorough hypothesis profile: prod_div raised ZeroDivisionError on 0.0 ** -1.
    report = explain(fn, jnp.ones((3, 2)), rulesets=[derivatives])
    assert not report.warnings, report.warnings


def test_every_rule_has_a_case():
    names = {r.name for r, _ in derivatives.entries()} | {r.name for r, _ in derivatives_fastmath.entries()}
    assert names == {c[0] for c in CASES}


def test_fastmath_cancellations_stay_out_of_the_identity_pack():
    # a * (g / a) -> g turns the NaN at a = 0 into g: without a fact, only the fastmath part does it.
    def f(a, g):
        return a * (g / a)

    a = jnp.array([0.0, 2.0])
    g = jnp.array([3.0, 3.0])
    kept = rewrite(f, rulesets=[derivatives])
    assert primitive_counts(kept.jaxpr(a, g))["div"] == 1
    assert np.isnan(kept(a, g)[0])
    fast = rewrite(f, rulesets=[derivatives, derivatives_fastmath])
    assert fast.jaxpr(a, g).eqns == []
    assert derivatives.soundness == "identity" and derivatives_fastmath.soundness == "fastmath"
    # With a fact that a is non-zero, the identity pack cancels too.
    pos = rewrite(lambda z, g: f(jnp.exp(z) + 1.0, g), rulesets=[derivatives])
    assert primitive_counts(pos.jaxpr(a, g)).get("div", 0) == 0


# ---------------------------------------------------------------- the seed's VJP
def seed(x, a):
    return jnp.sin(a * x) ** 2 / a


def seed_vjp(x, a, g):
    return jax.vjp(seed, x, a)[1](g)


def test_seed_vjp_is_simplified():
    # Large enough for XLA:CPU's library reductions, whose limits decide what the cost model prefers.
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 64, 32))
    a = jnp.linspace(0.5, 2.0, 32)
    g = jax.random.normal(jax.random.PRNGKey(1), x.shape)
    r = rewrite(seed_vjp, rulesets=[derivatives, derivatives_fastmath])  # sin(ax) may be huge: 2ax is fastmath
    before = primitive_counts(jax.make_jaxpr(seed_vjp)(x, a, g))
    after = primitive_counts(r.jaxpr(x, a, g))
    assert before["div"] == 2 and after["div"] <= 1          # the dead primal division is gone
    assert after["reduce_sum"] <= 2 < before["reduce_sum"]  # no sums over size-1 axes, no reshape round trips
    assert "cos" not in after and after["sin"] == 2           # 2 sin(ax) cos(ax) is sin(2ax)
    assert "add_any" not in after and "neg" not in after
    for p, q in zip(r(x, a, g), seed_vjp(x, a, g)):
        np.testing.assert_allclose(p, q, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- sums reordered only where that pays
_SUMS = {"red_pull", "red_merge", "red_split"}


def _seed_args(dtype=jnp.float32, shape=(32, 8, 64)):
    """The seed's VJP inputs at the golden files' size (large enough for XLA:CPU's library reductions)."""
    x = jax.random.normal(jax.random.PRNGKey(0), shape).astype(dtype)
    a = jnp.linspace(0.5, 2.0, shape[-1]).astype(dtype)
    g = jax.random.normal(jax.random.PRNGKey(1), shape).astype(dtype)
    return x, a, g


def test_sums_are_reordered_only_where_that_saves_the_floor():
    # The seed's VJP: pulling a**-2 out of a's sum saves a multiply per element in a fused reduction, priced
    # 0.5% of the program (measured 0.80-0.93x of the program as written): under SUMS_MIN_SAVING, so kept.
    seed_report = explain(seed_vjp, *_seed_args(), rulesets=[derivatives])
    assert _SUMS & set(seed_report.fired), seed_report.summary()  # they fire ...
    assert not _SUMS & set(seed_report.used), seed_report.summary()  # ... and their sums are not used
    # Where the factor is most of the program, the saving is over the floor: it is pulled out.
    x, b = jax.random.normal(jax.random.PRNGKey(0), (512, 64)), jnp.linspace(0.5, 2.0, 64)
    pulled = explain(lambda x, b: (x * b).sum(0), x, b, rulesets=[derivatives])
    assert "red_pull" in pulled.used and pulled.predicted_speedup > 1.0 + SUMS_MIN_SAVING
    # Two sums of arrays the cache holds are each a library reduction read from the cache (``reduce_cached``);
    # one sum of their fused sum is not cheaper: merged, x.sum(0) + y.sum(0) at [512, 64] ran 0.95x (A/A 1.00x,
    # 15 interleaved rounds), at [2048, 512] 0.89x (A/A 0.98x). So it is kept as written.
    merged = explain(lambda x, y: x.sum(0) + y.sum(0), x, x + 1.0, rulesets=[derivatives])
    assert "red_merge" in merged.fired and "red_merge" not in merged.used, merged.summary()


def test_a_sum_over_a_long_chain_of_additions_is_split_in_the_sums_first_rounds_only():
    """``red_split`` goes one addition deeper into a chain a round (each partial sum it builds is a new class to
    split in the next): a sum over the batch of twelve added terms kept the saturation going for 13 rounds, the
    last ones firing only ``red_split`` and ``red_merge``, as a residual stream's gradient did in the decision
    corpus's language-model steps (17 rounds). The sums' rules run in their first ``SUMS_ITERATIONS`` rounds."""
    def chain(x, w):
        h = x * w[0]
        for i in range(1, 12):
            h = h + jnp.sin(x * w[i])
        return h.sum(0)

    x, w = jax.random.normal(jax.random.PRNGKey(0), (4, 8)), jnp.linspace(0.5, 2.0, 12)
    report = explain(chain, x, w, rulesets=[derivatives])
    assert "red_split" in report.fired
    assert report.result.iterations <= SUMS_ITERATIONS + 1 < 12, report.summary()  # 13 when the sums ran every round
    np.testing.assert_allclose(rewrite(chain, rulesets=[derivatives])(x, w), chain(x, w), rtol=1e-6, atol=1e-6)


def test_the_gradients_alone_keep_the_floor_too():
    """``jax.vjp(rewrite(seed))`` runs the split of one of two extractions of the joint program, the joint one or
    the gradients' alone (``grad/vjp.py``'s ``_joint_choices``); the second is held to the rulesets'
    ``min_saving`` as the first is, so a's sums stay as JAX writes them there too: no reduction's result is then
    multiplied by the pulled factor (before, the gradients' extraction pulled ``a**-2`` out of a's sum)."""
    x, a, _ = _seed_args()
    built = rewrite(seed, rulesets=[derivatives]).grad_result(x, a)
    # the backward and the bodies in it (the kernel's blocks run as a scan JAX unrolls), each a scope of its own
    scopes = [built.bwd.jaxpr] + [e.params["jaxpr"].jaxpr for e in built.bwd.jaxpr.eqns if e.primitive.name == "scan"]
    summed = {v for j in scopes for e in j.eqns if e.primitive.name == "reduce_sum" for v in e.outvars}
    assert summed
    pulled = [e for j in scopes for e in j.eqns
              if e.primitive.name == "mul" and any(v in summed for v in e.invars if isinstance(v, core.Var))]
    assert not pulled, (built.split.policy, built.bwd)


_SEED_SPECIALS = st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 3e38, -3e38, 1e-45, -1.0])


def _same_or_as_close(got, want, ref, dt):
    """float32 and float64: JAX's values (zeros of either sign, NaN where it has NaN). float16 and bfloat16, whose
    sums XLA:CPU rounds where its fusions end (and those moved): NaN and infinities where JAX has them, and no
    further from the float64 evaluation than JAX's own VJP is, plus eight ulps of the output's scale."""
    got, want, ref = (np.asarray(v, np.float64) for v in (got, want, ref))
    if dt in (jnp.float32, jnp.float64):
        np.testing.assert_array_equal(got, want)
        return
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = np.isfinite(want) & np.isfinite(ref)
    scale = np.abs(ref[ok]).max(initial=0.0)
    assert np.all(np.abs(got - ref)[ok] <= np.abs(want - ref)[ok] + 8 * float(jnp.finfo(dt).eps) * scale)


def _second_order(f, x, a, g):
    """The derivative of the sum of ``f``'s second output (the seed's ``grad a``) with respect to ``x`` and ``a``."""
    return jax.grad(lambda x, a: f(x, a, g)[1].sum(), (0, 1))(x, a)


#: The float64 evaluations the test below holds values to, under ``jit`` (compiled once for all its examples, where
#: op by op compiled each primitive): JAX's own programs, read only for the distance of a value from float64's.
_SEED_BATCHED_JIT = jax.jit(jax.vmap(seed_vjp, (0, None, 0)))
_SEED_SECOND_ORDER_JIT = jax.jit(functools.partial(_second_order, seed_vjp))


@functools.lru_cache(maxsize=None)
def _seed_rewritten():
    """``rewrite(seed_vjp)`` under the default packs, one for every example of the test below: its program at a dtype
    depends on nothing an example draws (the inputs' values), so it is rewritten, and compiled under ``jit``, once a
    dtype, not once an example (26 rewrites and their compilations, most of the test's CPU s)."""
    return rewrite(seed_vjp, rulesets=[derivatives])


@settings(max_examples=25, deadline=None)
@example(dtype="float32", scale=1e-3, where=[])  # grad a's second derivative cancels here (2.5% off in float32)
@given(dtype=st.sampled_from(["float32", "bfloat16", "float16", "float64"]),
       scale=st.sampled_from([1.0, 1e-3, 1e3]),
       where=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 32 * 8 * 64 - 1), _SEED_SPECIALS), max_size=6))
def test_seed_vjp_under_the_default_packs_gives_jax_vjp_values(dtype, scale, where):
    """With the sums kept as written, the default packs' rewrite of the seed's VJP computes JAX's VJP
    (:func:`_same_or_as_close`), at every float dtype, with zeros, infinities, NaN and 3e38 among the inputs
    (sin(2ax) overflows there: the double angle is fastmath's), eagerly, under jit and under vmap; and its
    own derivative is as close to the float64 evaluation as JAX's float32 one: its largest error at most twice
    JAX's largest, plus eight ulps of the value's scale. (Not JAX's value at a relative tolerance: at scale 1e-3
    ``grad a``'s second derivative cancels, and JAX's float32 value and the rewrite's are both 2.5% from float64's,
    3.69e-11 and 3.79e-11 apart from it, where the values' scale is 1.5e-9.)"""
    with jax.enable_x64(True):
        dt = jnp.dtype(dtype)
        x, a, g = (np.array(v, np.float64) for v in _seed_args(jnp.float64))
        x *= scale
        for arg, i, v in where:  # special values in x, g and a (a twice as likely: it has fewer elements)
            target = (x, g, a, a)[arg]
            target.flat[i % target.size] = v
        ref = jax.jit(seed_vjp)(x, a, g)
        x, a, g = (jnp.asarray(v, dt) for v in (x, a, g))
        r = _seed_rewritten()
        want = jax.jit(seed_vjp)(x, a, g)
        for got in (r(x, a, g), jax.jit(r)(x, a, g)):
            for p, q, f in zip(got, want, ref):
                assert p.dtype == q.dtype == dt
                _same_or_as_close(p, q, f, dt)
        xs, gs = jnp.stack([x, -x]), jnp.stack([g, g])
        refs = _SEED_BATCHED_JIT(*(jnp.asarray(v, jnp.float64) for v in (xs, a, gs)))
        for p, q, f in zip(jax.vmap(r, (0, None, 0))(xs, a, gs), jax.vmap(seed_vjp, (0, None, 0))(xs, a, gs), refs):
            _same_or_as_close(p, q, f, dt)
        if dt == jnp.float32 and not where:  # second order, on ordinary values
            d = _second_order
            refs = _SEED_SECOND_ORDER_JIT(*(jnp.asarray(v, jnp.float64) for v in (x, a, g)))
            for p, q, f in zip(d(r, x, a, g), d(seed_vjp, x, a, g), refs):
                p, q, f = (np.asarray(v, np.float64) for v in (p, q, f))
                ulps = 8 * float(jnp.finfo(dt).eps) * np.abs(f).max()
                assert np.abs(p - f).max() <= 2 * np.abs(q - f).max() + ulps, (np.abs(p - f).max(), np.abs(q - f).max())



def _bits(v):
    """The bit patterns of a float array, every NaN as one (so ``-0.0`` and ``0.0`` differ, NaN payloads do not)."""
    v = np.asarray(v)
    return np.where(np.isnan(v), np.array(np.nan, v.dtype), v).view(f"u{v.dtype.itemsize}")


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from(["float32", "float64"]),
       where=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 32 * 8 * 64 - 1), _SEED_SPECIALS), max_size=6))
def test_the_seed_forms_benchmarks_time_are_jax_vjp(dtype, where):
    """``benchmarks/derivatives.py``'s hand-written forms of the seed's VJP (``--forms``: one ``sin`` stored as a
    ``select``, ``t`` and ``u`` as one complex array, ``sin`` and ``cos`` from one complex ``exp``) compute JAX's VJP
    bit for bit under ``jit``, with zeros, infinities, NaN, 3e38 and subnormals among the inputs; those whose
    ``grad a`` sums in another order (``CHANGED_SUMS``: ``one_sum``, the interleaved, blocked and chained forms) have
    ``grad x`` bit for bit and ``grad a`` as close to the float64 evaluation as JAX's, plus the rounding of a changed
    sum."""
    from benchmarks.derivatives import CHANGED_SUMS, SEED_FORMS

    with jax.enable_x64(True):
        dt = jnp.dtype(dtype)
        x, a, g = (np.array(v, np.float64) for v in _seed_args(jnp.float64))
        tiny = float(jnp.finfo(dt).tiny)
        x.flat[:12] = [0.0, -0.0, math.inf, -math.inf, math.nan, 3e38, -3e38, tiny, -tiny / 3, tiny / 2 ** 20,
                       1e-45, -1.5e-323]  # in every example: the values the forms' selects are for, and their edges
        for arg, i, v in where:
            target = (x, g, a, a)[arg]
            target.flat[i % target.size] = v
        ref = jax.jit(seed_vjp)(x, a, g)
        x, a, g = (jnp.asarray(v, dt) for v in (x, a, g))
        want = jax.jit(seed_vjp)(x, a, g)
        for name, form in SEED_FORMS.items():
            got = jax.jit(form)(x, a, g)
            np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]), err_msg=name)
            if name in CHANGED_SUMS:  # as close to the float64 evaluation as JAX's, plus the rounding of a changed sum
                p, q, r = (np.asarray(v, np.float64) for v in (got[1], want[1], ref[1]))
                np.testing.assert_array_equal(np.isfinite(p), np.isfinite(q), err_msg=name)
                np.testing.assert_array_equal(np.isnan(p), np.isnan(q), err_msg=name)
                ok = np.isfinite(q) & np.isfinite(r)
                scale = np.abs(r[ok]).max(initial=0.0)
                assert np.all(np.abs(p - r)[ok] <= np.abs(q - r)[ok] + 64 * float(jnp.finfo(dt).eps) * scale), name
            else:
                np.testing.assert_array_equal(_bits(got[1]), _bits(want[1]), err_msg=name)


def _gelu_chain(x, t, g):
    """The tanh-GELU's derivative term as jax 0.11+ traces it: tanh's factor one product (``one_minus_square``),
    so the ``x`` of ``x * (...)`` and the ``3 x^2`` of ``d(x^3)`` meet in one chain of products."""
    return x ** 3, ((g * x) * (1.0 - t * t)) * (3.0 * x ** 2)


def _gelu_summed(x, t, g):
    """The same as jax 0.10 traces it: tanh's factor ``g + g t``, so ``3 x^2`` multiplies a sum, not ``x``."""
    return x ** 3, ((g + g * t) * (1.0 - t)) * (3.0 * x ** 2)


def test_a_square_multiplied_by_its_base_is_the_cube_the_forward_computed():
    """Why ``pow_two`` drops out of the flax steps' decisions on jax 0.11+ (``tests/golden/decisions.programs.json``):
    both JAX versions trace ``integer_pow[y=2]`` in the GELU's derivative, but where it sits in one chain of
    products with its base (0.11+'s form) ``prod_mul`` gathers ``x * x^2`` into ``x^3``, the class of the
    forward's own cube, and the chosen program computes no square at all; where it multiplies a sum (0.10's
    form) the square is still computed, and ``pow_two`` makes it ``square``."""
    from rulesets import algebra

    x = jnp.linspace(-2.0, 2.0, 64).reshape(4, 16)
    t, g = jnp.tanh(x), jnp.cos(x)
    packs = [algebra, derivatives]
    chain = rewrite(_gelu_chain, rulesets=packs)
    after = chain.jaxpr(x, t, g).jaxpr
    assert primitive_counts(jax.make_jaxpr(_gelu_chain)(x, t, g))["integer_pow"] == 2
    pows = [e.params["y"] for e in after.eqns if e.primitive.name == "integer_pow"]
    assert pows == [3], after  # the forward's cube, read twice; no x^2
    assert not any(e.primitive.name == "square" and e.invars[0] is after.invars[0] for e in after.eqns), after
    summed = explain(_gelu_summed, x, t, g, rulesets=packs)
    assert "pow_two" in summed.used and "square" in primitive_counts(summed.after)
    for fn, r in ((_gelu_chain, chain), (_gelu_summed, rewrite(_gelu_summed, rulesets=packs))):
        for p, q in zip(r(x, t, g), fn(x, t, g)):  # products reassociated: float32 rounding of a few products
            np.testing.assert_allclose(p, q, rtol=8 * float(jnp.finfo(jnp.float32).eps), atol=0)



@pytest.mark.parametrize("fn,fired,after", [
    (lambda t: jnp.sin(jnp.tanh(t)) * jnp.cos(jnp.tanh(t)), "prod_mul", ["tanh", "mul", "sin", "mul"]),
    (lambda t: jnp.sinh(t) / jnp.cosh(t), "prod_div", ["tanh"]),
    (lambda t: jnp.exp(t) / (1.0 + jnp.exp(t)), "prod_div", ["logistic"]),
    (lambda t: 1.0 / (1.0 + jnp.exp(t)), "prod_div", ["neg", "logistic"]),
    (lambda t: jnp.exp(t) * jnp.exp(2.0 * t), "prod_mul", ["mul", "add", "exp"]),
    (lambda t: t * jnp.tanh(t), None, ["tanh", "mul"]),
], ids=["sin cos", "sinh / cosh", "exp / (1 + exp)", "1 / (1 + exp)", "exp exp", "x tanh x"])
def test_the_product_rules_combine_each_kind_of_base_past_powers(fn, fired, after):
    """``simplify`` skips its steps past the powers of one base where no base's class holds a primitive they
    combine (``sin``, ``cos``, ``sinh``, ``cosh``, ``add``, ``exp``): each case needs one of them, and the last none.
    Fails where ``add`` or ``exp`` is left out of the primitives checked, or both of ``sin`` and ``cos``, or both of
    ``sinh`` and ``cosh`` (a pair needs both bases, so either one of a pair is enough)."""
    r = explain(fn, jnp.linspace(0.1, 0.9, 6), rulesets=[derivatives])
    assert r.fired == ({fired: 1} if fired else {}) | ({"trig_sin_stored": 1} if "sin" in after else {})
    assert [e.primitive.name for e in r.after.eqns] == after


def _mlp(params, x, y):
    h = x
    for w, b in params[:-1]:
        h = jax.nn.gelu(h @ w + b)
    w, b = params[-1]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(h @ w + b) * y, axis=-1))


def _layernorm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return ((x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b).sum()


def _rand(*shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def test_pack_on_gradients_keeps_values():
    sizes = [8, 16, 4]
    params = [(_rand(m, n, seed=i), _rand(n, seed=10 + i)) for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))]
    cases = [
        (jax.grad(lambda x, a: seed(x, a).sum(), (0, 1)), (_rand(4, 8, 16), jnp.linspace(0.5, 2.0, 16))),
        (jax.grad(_mlp), (params, _rand(5, 8, seed=4), jax.nn.one_hot(jnp.arange(5) % 4, 4))),
        (jax.grad(_layernorm, (0, 1, 2)), (_rand(4, 8), _rand(8, seed=1), _rand(8, seed=2))),
        (jax.grad(lambda x, w: jax.nn.log_sigmoid(x * w).sum(), (0, 1)), (_rand(6, 8), _rand(8, seed=3))),
    ]
    for fn, args in cases:
        r = rewrite(fn, rulesets=[derivatives])
        got, want = jax.tree_util.tree_leaves(jax.jit(r)(*args)), jax.tree_util.tree_leaves(jax.jit(fn)(*args))
        res = r.result(*args)
        assert res.cost_after <= res.cost_before
        for p, q in zip(got, want):
            np.testing.assert_allclose(p, q, rtol=1e-4, atol=1e-5)


def test_add_any_of_a_weak_and_a_strong_value_is_left_as_it_is():
    """``add_any(x, y)`` has ``x``'s type, weak or not, and ``x + y`` is weak only where both are: ``sign_add_any``
    built a strong sum for a weak match, the engine skipped it with a warning, and ``strict=True`` raised."""
    from jax._src.ad_util import add_jaxvals

    def f(x, y):
        return add_jaxvals(jnp.sin(x), jnp.sin(y)) * 3

    r = rewrite(f, rulesets=[derivatives], strict=True)
    for x, y in ((1.0, jnp.float32(2.0)), (jnp.float32(1.0), 2.0), (1.0, 2.0), (jnp.float32(1.0), jnp.float32(2.0))):
        got, want = r(x, y), f(x, y)
        assert got.dtype == want.dtype and got.weak_type == want.weak_type
        np.testing.assert_array_equal(got, want)


def test_add_any_of_a_users_element_type_is_left_as_it_is():
    """``add_any`` of an extended dtype adds by the dtype's own rule, and ``lax.add`` refuses such values:
    ``sign_add_any`` raised ``TypeError`` building ``x + y`` and the engine skipped it with a warning (dtypes_test's
    test_custom_tangent_dtype_with_scan, routed: the cotangent of a custom_vjp's scale of element type scale32)."""
    import dataclasses

    from jax._src import dtypes
    from jax._src.ad_util import add_jaxvals

    class Rules:  # a float32 in disguise whose sum is the larger of the two
        allow_conversion = True
        physical_element_aval = staticmethod(lambda dtype: core.ShapedArray((), jnp.float32))
        add = staticmethod(lambda dt, x, y: jax.lax.convert_element_type(
            jax.lax.max(jax.lax.convert_element_type(x, jnp.float32), jax.lax.convert_element_type(y, jnp.float32)), dt))

    class scale(dtypes.extended):
        pass

    @dataclasses.dataclass(frozen=True)
    class ScaleDType(dtypes.ExtendedDType):
        _rules: type = Rules
        type: type = scale
        name = "scale32"

    def f(x, y):
        s = add_jaxvals(jax.lax.convert_element_type(jnp.sin(x), ScaleDType()),
                        jax.lax.convert_element_type(jnp.sin(y), ScaleDType()))
        return jax.lax.convert_element_type(s, jnp.float32)

    x, y = jnp.float32(1.0), jnp.float32(2.0)
    got = jax.jit(rewrite(f, rulesets=[derivatives], strict=True))(x, y)
    np.testing.assert_array_equal(got, jax.jit(f)(x, y))
    np.testing.assert_array_equal(got, jnp.sin(2.0))  # the dtype's own add: the larger, not the sum


def _pme_energy(k, s, v):
    """jax-md's PME reciprocal energy in small (``energy.coulomb_recip_pme``): the k = 0 term, where ``k2`` is 0 and
    ``c * exp(-k2) / k2`` infinite, masked out by a 0/1 mask, which XLA computes as a select."""
    k2 = jnp.sum(k ** 2, axis=-1)
    mask = (k2 != 0).astype(k2.dtype)
    c = 1.0 / (6.28 * v)
    return jnp.sum(mask * (c * jnp.exp(-k2) / k2) * s ** 2)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2), (jnp.float16, 2e-3),
                                        (jnp.float64, 1e-12)])
@pytest.mark.parametrize("which", ["red_pull", "derivatives"])
def test_a_product_under_a_mask_is_taken_whole(which, dtype, tol):
    """A product with a 0/1 mask is one factor (``product_tree``): ``red_pull`` had pulled the scalar out of
    jax-md's PME energy and rebuilt the rest as ``mask * exp * s**2 / k2``, the division past the mask, and
    ``jax.jit`` of it gave NaN where the program's gave the energy (jax-md's ``test_coulomb_recip_octions``, routed
    through the rewriter: energy and forces NaN). Under ``jit``: the value, the gradient, a JVP and ``vmap``."""
    rs = Ruleset("red_pull_alone", [derivatives.rule("red_pull")], soundness="identity") if which == "red_pull" \
        else derivatives
    with jax.enable_x64(dtype == jnp.float64):
        k = jnp.stack(jnp.meshgrid(jnp.arange(4.0), jnp.arange(4.0), indexing="ij"), -1).astype(dtype)
        s = jnp.linspace(0.5, 2.0, 16, dtype=dtype).reshape(4, 4)
        v = jnp.asarray(3.0, dtype)
        r = rewrite(_pme_energy, rulesets=[rs], strict=True, cache=False)
        want, got = jax.jit(_pme_energy)(k, s, v), jax.jit(r)(k, s, v)
        # (in bfloat16 XLA multiplies the mask as a float, so the program itself is NaN: so must the rewrite be)
        assert np.isfinite(np.float64(want)) == (dtype != jnp.bfloat16)
        np.testing.assert_allclose(np.float64(got), np.float64(want), rtol=tol)  # NaN where it is NaN
        for g, w in zip(jax.jit(jax.grad(r, argnums=(1, 2)))(k, s, v),
                        jax.jit(jax.grad(_pme_energy, argnums=(1, 2)))(k, s, v)):
            np.testing.assert_allclose(np.float64(g), np.float64(w), rtol=tol, atol=tol)
        jvp = [jax.jit(lambda *a, f=f: jax.jvp(f, a, (k, s, v))[1])(k, s, v) for f in (r, _pme_energy)]
        np.testing.assert_allclose(np.float64(jvp[0]), np.float64(jvp[1]), rtol=tol * 10, atol=tol)
        batched = [jax.jit(jax.vmap(f, in_axes=(None, 0, None)))(k, jnp.stack([s, 2 * s]), v) for f in (r, _pme_energy)]
        np.testing.assert_allclose(np.float64(batched[0]), np.float64(batched[1]), rtol=tol)
