"""Every fact rule the engine uses (rewrite.ir.terms.FACT_RULES) holds on real values.

Guards trust facts: a fact rule that is wrong on -0.0, an infinity or NaN makes every rule guarded
by it unsound. For each fact rule this draws float32 inputs that satisfy its premises, computes its
conclusion's subject with XLA (the backend the program runs on), and checks the conclusion. A table
below maps each rule name to its check, and a coverage test fails when a rule has none.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewrite import Ruleset, explain, rule
from rewrite.ir.terms import FACT_RULES
from rewrite.testing import arrays

def floats():
    # Every float32 value, the special ones (signed zeros, infinities, NaN, subnormals, extremes) often.
    # A fixed length keeps each check to one compilation.
    return arrays((16,), np.float32, "exact")


TINY = np.finfo(np.float32).tiny  # the smallest normal float32; XLA:CPU flushes anything smaller to zero


# The facts' meaning, as predicates on values (see rewrite.ir.terms.FACTS).
def nonneg(a):
    return bool(np.all(~np.signbit(a) | np.isnan(a)))


def pos(a):
    return bool(np.all((a >= TINY) | np.isnan(a)))


def nonzero(a):
    return bool(np.all((np.abs(a) >= TINY) | np.isnan(a)))


# Draws that satisfy a premise, from arbitrary floats (subnormals included in the raw draws).
def make_nonneg(a):
    return np.where(np.isnan(a), a, np.abs(a)).astype(np.float32)


def make_pos(a):
    b = make_nonneg(a)
    return np.where(b < TINY, TINY, b).astype(np.float32)


def make_nonzero(a):
    return np.where(np.abs(a) < TINY, np.where(np.signbit(a), -TINY, TINY), a).astype(np.float32)


ANY = lambda a: a  # noqa: E731


def both_orders(op):
    """``a op b`` and ``b op a``, the second behind a barrier so that XLA cannot compute them as one."""
    barrier = jax.lax.optimization_barrier
    return lambda a, b: jnp.stack([op(a, b), op(barrier(b), barrier(a))])


def same_bits(out):
    """The two rows agree bit for bit (any NaN equals any NaN)."""
    a, b = np.asarray(out)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


# rule name -> (function of XLA ops, premise makers per input, conclusion)
CHECKS = {
    "pos-implies": (lambda x: x, [make_pos], [nonneg, nonzero]),
    "abs-nonneg": (jnp.abs, [ANY], [nonneg]),
    "abs-pos": (jnp.abs, [make_nonzero], [pos]),
    "square-nonneg": (jnp.square, [ANY], [nonneg]),
    "self-mul-nonneg": (lambda x: x * x, [ANY], [nonneg]),
    "exp-nonneg": (jnp.exp, [ANY], [nonneg]),
    "exp2-nonneg": (jnp.exp2, [ANY], [nonneg]),
    "logistic-nonneg": (jax.nn.sigmoid, [ANY], [nonneg]),
    "cosh-pos": (jnp.cosh, [ANY], [pos]),
    "sqrt-nonneg": (jnp.sqrt, [make_nonneg], [nonneg]),
    "sqrt-pos": (jnp.sqrt, [make_pos], [pos]),
    "rsqrt-nonneg": (jax.lax.rsqrt, [make_nonneg], [nonneg]),
    "add-nonneg": (jnp.add, [make_nonneg, make_nonneg], [nonneg]),
    "add-pos-l": (jnp.add, [make_pos, make_nonneg], [pos]),
    "add-pos-r": (jnp.add, [make_nonneg, make_pos], [pos]),
    "mul-nonneg": (jnp.multiply, [make_nonneg, make_nonneg], [nonneg]),
    "div-nonneg": (jnp.divide, [make_nonneg, make_nonneg], [nonneg]),
    "max-nonneg": (jnp.maximum, [make_nonneg, make_nonneg], [nonneg]),
    "max-pos-l": (jnp.maximum, [make_pos, ANY], [pos]),
    "max-pos-r": (jnp.maximum, [ANY, make_pos], [pos]),
    "min-pos": (jnp.minimum, [make_pos, make_pos], [pos]),
    "min-nonneg": (jnp.minimum, [make_nonneg, make_nonneg], [nonneg]),
    "sum-nonneg": (lambda x: jnp.sum(x, keepdims=True), [make_nonneg], [nonneg]),
    "rmin-nonneg": (lambda x: jnp.min(x, keepdims=True), [make_nonneg], [nonneg]),
    "rmin-pos": (lambda x: jnp.min(x, keepdims=True), [make_pos], [pos]),
    "bcast-nonneg": (lambda x: jnp.broadcast_to(x, (2,) + x.shape), [make_nonneg], [nonneg]),
    "bcast-pos": (lambda x: jnp.broadcast_to(x, (2,) + x.shape), [make_pos], [pos]),
    "bcast-nonzero": (lambda x: jnp.broadcast_to(x, (2,) + x.shape), [make_nonzero], [nonzero]),
    "reshape-nonneg": (lambda x: x.reshape(-1, 1), [make_nonneg], [nonneg]),
    "reshape-pos": (lambda x: x.reshape(-1, 1), [make_pos], [pos]),
    "reshape-nonzero": (lambda x: x.reshape(-1, 1), [make_nonzero], [nonzero]),
    "transpose-nonneg": (lambda x: x.reshape(1, -1).T, [make_nonneg], [nonneg]),
    "transpose-pos": (lambda x: x.reshape(1, -1).T, [make_pos], [pos]),
    "transpose-nonzero": (lambda x: x.reshape(1, -1).T, [make_nonzero], [nonzero]),
    "squeeze-nonneg": (lambda x: x.reshape(1, -1).squeeze(0), [make_nonneg], [nonneg]),
    "squeeze-pos": (lambda x: x.reshape(1, -1).squeeze(0), [make_pos], [pos]),
    "squeeze-nonzero": (lambda x: x.reshape(1, -1).squeeze(0), [make_nonzero], [nonzero]),
    "neg-nonzero": (jnp.negative, [make_nonzero], [nonzero]),
    "even-pow-nonneg": (lambda x: x ** 4, [ANY], [nonneg]),
    # not facts: the rules that merge a op b with b op a (OpSpec.commutative)
    "add-commuted": (both_orders(jnp.add), [ANY, ANY], [same_bits]),
    "mul-commuted": (both_orders(jnp.multiply), [ANY, ANY], [same_bits]),
}


def test_every_fact_rule_has_a_check():
    names = set(re.findall(r':name "([^"]+)"', FACT_RULES))
    assert names == set(CHECKS), f"unchecked: {sorted(names - set(CHECKS))}, stale: {sorted(set(CHECKS) - names)}"


@pytest.mark.parametrize("name", sorted(CHECKS))
@given(data=st.data())
def test_fact_rule_holds(name, data):
    fn, makers, conclusions = CHECKS[name]
    inputs = []
    for make in makers:
        a = data.draw(floats())
        inputs.append(make(a))
    out = np.asarray(jax.jit(fn)(*inputs))
    for conclusion in conclusions:
        assert conclusion(out), f"fact rule {name!r} fails for inputs {inputs}: result {out}"


@pytest.mark.parametrize("expr,derived", [
    (lambda x: x ** 2 + 1.0, True),            # even power, plus a positive literal
    (lambda x: jnp.sqrt(jnp.abs(x)) * jnp.exp(x), True),
    (lambda x: x ** 3, False),
    (lambda x: jnp.maximum(jnp.exp(x), -1.0), False),
])
def test_facts_reach_guards(expr, derived):
    probe = Ruleset("probe", [rule(lambda v: jnp.abs(v), lambda v: v, name="abs_of_nonneg", when=lambda v: v.nonneg)])
    report = explain(lambda x: jnp.abs(expr(x)), jnp.linspace(-2.0, 2.0, 5), rulesets=[probe])
    assert (report.fired == {"abs_of_nonneg": 1}) == derived


@pytest.mark.parametrize("c", [1e-50, 1e39])
def test_literals_are_read_as_their_dtype_holds_them(c):
    """A literal made from a Python number keeps the number (``lax.mul(x, 1e-50)`` is typed float32, holding
    1e-50); XLA rounds it to the dtype. Facts and rules must see the rounded value: 1e-50 is a float32 zero,
    so ``(x * 1e-50) / 1e-50`` is 0/0 (NaN), not ``x``; and 1e39 is an infinity, so ``(x * 1e39) / 1e39`` is not
    ``x`` either."""
    import rulesets
    from jax import lax

    from rewrite import rewrite

    def f(v):
        return lax.div(lax.mul(v, c), c)

    x = jnp.array([1.0, -2.0, 0.5, 3.0], jnp.float32)
    want = np.asarray(jax.jit(f)(x))
    assert np.isnan(want).all()  # the premise: the literal rounds to 0 or to inf in float32
    got = jax.jit(rewrite(f, rulesets=[rulesets.algebra, rulesets.derivatives], cache=False))(x)
    np.testing.assert_array_equal(np.asarray(got), want)
