"""``rulesets.fastmath``: rewrites that may change floating-point results, each a named toggle.

These are the rewrites a C compiler makes under ``-ffast-math``. Each toggle
is a ruleset of its own with soundness ``"fastmath"`` and a stated
tolerance, usable alone (``rulesets.fastmath.reassociate``) or all together
as ``rulesets.fastmath``; no other pack includes them, so they only run when
a user names them. They do most when combined with ``rulesets.algebra``,
whose constant folding they build on::

    rulesets.algebra + rulesets.fastmath.reassociate

Tolerances are for float32 (they scale with the dtype's epsilon) and hold on
*ordinary values*: finite, of moderate magnitude (no overflow or underflow
in the rewritten form), and, for the toggles that reorder sums, of one sign.
Cancellation can make the relative error of any reordered sum unbounded, so
no tolerance is claimed there. Infinities and NaN may change: ``x - x -> 0``
is wrong for ``x = inf``, which is what the ``cancel`` toggle accepts.

Merging sums (``sum(a) + sum(b) -> sum(a + b)``) is not here: it only
reassociates additions, as XLA's own reductions do, so it is ``identity``
class and lives in ``rulesets.derivatives`` (docs/rules.md, section 6).

>>> import jax.numpy as jnp, rulesets
>>> from rewrite import explain
>>> report = explain(lambda x: (x * 2.0) * 3.0, jnp.ones(3),
...                  rulesets=[rulesets.algebra + rulesets.fastmath.reassociate])
>>> [(e.primitive.name, float(e.invars[1].val)) for e in report.after.eqns]
[('mul', 6.0)]
>>> rulesets.fastmath.cancel.soundness, rulesets.fastmath.cancel.tolerance
('fastmath', Tolerance(rtol=0.0, atol=0.0))
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from rewrite import Limits, Pat, Ruleset, Tolerance, procedural, rule
from rulesets._examples import f32
from rulesets.algebra import _MUL_POWS, _MUL_X_POW, _POW_POW, own_power

__all__ = ["fastmath", "reassociate", "reciprocal", "cancel", "distribute", "powers", "signed_zeros"]

X = Pat.var("x")


def _floating(*xs) -> bool:
    return all(jnp.issubdtype(x.dtype, jnp.floating) for x in xs)


# Zero is an ordinary value, and a division by it is not: x/x -> 1 would turn 0/0 (NaN) into
# 1, and a/c + b/c -> (a + b)/c turns 0/0 + 1/0 (NaN) into 1/0 (inf). Rules that cancel or
# merge divisions ask for a divisor that the facts prove nonzero.
def _nonzero_divisor(a, b, c) -> bool:
    return _floating(a, b, c) and c.nonzero


# ---------------------------------------------------------------------- reassociate
# Associativity in both directions, with patterns matching add and mul in either
# operand order, reaches every bracketing and order of a chain: exponential in its length. So these
# rules get a small allowance of new matches per iteration; past it a rule is
# banned for a while, with allowance and ban doubling each time (egg's back-off),
# and they run in the first 4 iterations only: what they find that pays (a
# constant folded across a chain) takes two or three, and each more multiplies
# the bracketings that the other rules then match (benchmarks/growth.py).
reassociate = Ruleset("reassociate", [
    rule(lambda a, b, c: lax.add(lax.add(a, b), c), lambda a, b, c: lax.add(a, lax.add(b, c)),
         name="add_assoc_right", when=_floating),                              # (a + b) + c -> a + (b + c)
    rule(lambda a, b, c: lax.add(a, lax.add(b, c)), lambda a, b, c: lax.add(lax.add(a, b), c),
         name="add_assoc_left", when=_floating),                               # a + (b + c) -> (a + b) + c
    rule(lambda a, b, c: lax.mul(lax.mul(a, b), c), lambda a, b, c: lax.mul(a, lax.mul(b, c)),
         name="mul_assoc_right", when=_floating),                              # (a * b) * c -> a * (b * c)
    rule(lambda a, b, c: lax.mul(a, lax.mul(b, c)), lambda a, b, c: lax.mul(lax.mul(a, b), c),
         name="mul_assoc_left", when=_floating),                               # a * (b * c) -> (a * b) * c
], soundness="fastmath", tolerance=Tolerance(rtol=1e-5, atol=1e-6), limits=Limits(matches=200, ban=2, iterations=4),
    description="reorder chains of + and *: values of one sign, within 1e-5 relative")


# ---------------------------------------------------------------------- reciprocal
@procedural
def _div_by_constant(m):
    """x / c -> x * (1/c), with 1/c computed once, here, when it is a normal number."""
    x, c = m["x"], m["c"]
    if not _floating(x, c) or c.literal is None:
        return None
    v = float(c.literal)
    if v == 0.0 or not np.isfinite(v):
        return None
    r = np.asarray(1.0 / v).astype(c.dtype)
    if not np.isfinite(r) or abs(float(r)) < float(jnp.finfo(c.dtype).tiny):
        return None
    return m.trace(lax.mul, x, m.literal(float(r), c.aval))


def _not_reciprocal(x, y) -> bool:
    # 1/y is already a reciprocal; rewriting it to 1 * (1/y) would feed itself
    return _floating(x, y) and x.literal != 1


reciprocal = Ruleset("reciprocal", [
    rule(Pat("div", X, Pat.lit(name="c")), _div_by_constant, name="div_const",
         example_program=(lambda x: jnp.mean(x, axis=-1), (f32(4, 5),))),                   # x / c -> x * (1/c)  (a mean's count)
    # 1.0 / y with jnp, as users write it: its literal is strong, lax.div's is weak, and only
    # the same literal makes the same class
    rule(lambda x, y: lax.div(x, y), lambda x, y: lax.mul(x, 1.0 / y),
         name="div_reciprocal", when=_not_reciprocal),                                 # x / y -> x * (1/y): pays when 1/y is shared
], soundness="fastmath", tolerance=Tolerance(rtol=5e-7, atol=0.0),
    description="divide by multiplying with a reciprocal: two roundings instead of one")


# ---------------------------------------------------------------------- cancel
def _cancellable(x) -> bool:
    """Fastmath may assume finite values, but not against a constant that is plainly inf or NaN."""
    c = x.constant
    return _floating(x) and (c is None or bool(np.all(np.isfinite(c))))


cancel = Ruleset("cancel", [
    rule(lambda x: x - x, lambda x: jnp.zeros_like(x), name="sub_self", when=_cancellable),   # x - x -> 0  (not for inf, NaN)
    rule(lambda x: x / x, lambda x: jnp.ones_like(x), name="div_self", when=lambda x: _cancellable(x) and x.nonzero),  # x / x -> 1, x != 0  (not for inf, NaN)
    rule(lambda x: x * 0, lambda x: jnp.zeros_like(x), name="mul_zero", when=_cancellable),   # x * 0 -> 0  (not for inf, NaN; sign of zero)
], soundness="fastmath", tolerance=Tolerance(rtol=0.0, atol=0.0),
    description="cancel x-x, x/x, x*0: exact on finite nonzero values, wrong for inf and NaN")


# ---------------------------------------------------------------------- distribute
# Matched in either operand order, a sum of products factors every way its terms share a factor: the same
# small allowance as reassociate, so a long sum is banned early (and retired once the e-graph
# has grown, Limits.growth) instead of filling it. And its first 8 rounds only: later, each doubled
# allowance after a ban lets through a burst of factorings (in a neural ODE's solver step, many times
# the rest of saturation) that no program's choice uses.
distribute = Ruleset("distribute", [
    rule(lambda a, b, c: lax.add(lax.mul(a, b), lax.mul(a, c)), lambda a, b, c: lax.mul(a, lax.add(b, c)),
         name="factor_add", when=_floating),  # a*b + a*c -> a*(b + c)
    rule(lambda a, b, c: lax.sub(lax.mul(a, b), lax.mul(a, c)), lambda a, b, c: lax.mul(a, lax.sub(b, c)),
         name="factor_sub", when=_floating),  # a*b - a*c -> a*(b - c)
    rule(lambda a, b, c: lax.add(lax.div(a, c), lax.div(b, c)), lambda a, b, c: lax.div(lax.add(a, b), c),
         name="factor_div", when=_nonzero_divisor),  # a/c + b/c -> (a + b)/c, c != 0
    rule(Pat("reduce_sum", Pat("mul", X, Pat.var("s")), params="p"), lambda x, s, p: lax.mul(p.bind(x), s),
         when=lambda x, s: s.ndim == 0 and _floating(x, s), name="sum_scalar_mul",            # sum(x * s) -> sum(x) * s  (scalar s: one multiplication)
         example_program=(lambda x, s: jnp.sum(x * s, axis=-1), (f32(4, 5), f32()))),
], soundness="fastmath", tolerance=Tolerance(rtol=1e-5, atol=1e-6), limits=Limits(matches=200, ban=2, iterations=8),
    description="factor common multiplicands and divisors: values of one sign, within 1e-5 relative")


# ---------------------------------------------------------------------- powers
# rulesets.algebra folds only the powers whose rounding XLA's repeated
# squaring reproduces exactly; these fold any, within a few roundings.
_MAX_EXPONENT = 64


def _base(x, n: int) -> bool:
    """Can x^n replace the product, within the tolerance and without feeding itself?"""
    return _floating(x) and x.literal is None and n != 0 and abs(n) <= _MAX_EXPONENT and not own_power(x)


powers = Ruleset("powers", [
    rule(_POW_POW, lambda x, p, q: lax.integer_pow(x, p.y * q.y), when=lambda x, p, q: _base(x, p.y * q.y),
         name="pow_pow_any", example_program=(lambda x: (x ** 3) ** 2, (f32(7),))),                  # (x^a)^b -> x^(a*b)
    rule(_MUL_POWS, lambda x, p, q: lax.integer_pow(x, p.y + q.y), when=lambda x, p, q: _base(x, p.y + q.y),
         name="mul_pows_any", example_program=(lambda x: x ** 2 * x ** 3, (f32(7),))),                # x^a * x^b -> x^(a+b)
    rule(_MUL_X_POW, lambda x, q: lax.integer_pow(x, q.y + 1), when=lambda x, q: _base(x, q.y + 1),
         name="mul_x_pow_any", example_program=(lambda x: x * x ** 6, (f32(7),))),                    # x * x^a -> x^(a+1)
], soundness="fastmath", tolerance=Tolerance(rtol=2e-6, atol=0.0),
    description="fold products and powers of powers: a few roundings, exponents up to 64")


# ---------------------------------------------------------------------- signed_zeros
signed_zeros = Ruleset("signed_zeros", [
    rule(lambda x: x + 0.0, lambda x: x, name="add_zero", when=_floating),                 # x + 0.0 -> x  (-0.0 + 0.0 is +0.0)
    rule(lambda x: 0.0 - x, lambda x: -x, name="zero_sub", when=_floating),                # 0.0 - x -> -x  (0.0 - 0.0 is +0.0)
    rule(lambda a, b: -lax.sub(a, b), lambda a, b: lax.sub(b, a), name="neg_sub", when=_floating),       # -(a - b) -> b - a  (differs when a == b)
], soundness="fastmath", tolerance=Tolerance(rtol=0.0, atol=0.0),
    description="ignore the sign of zero: equal as numbers, -0.0 may become +0.0")


fastmath = Ruleset("fastmath", [reassociate, reciprocal, cancel, distribute, powers, signed_zeros],
                   soundness="fastmath", tolerance=Tolerance(rtol=1e-5, atol=1e-6),
                   description="every fastmath toggle")
