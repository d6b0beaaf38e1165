"""``rulesets.fastmath``: rewrites that may change floating-point results, each a named toggle.

These are the rewrites a C compiler makes under ``-ffast-math``. Each toggle
is a ruleset of its own with soundness ``"fastmath"`` and a stated
tolerance, usable alone (``rulesets.fastmath.reassociate``) or all together
as ``rulesets.fastmath``; no other pack includes them, so they only run when
a user names them. They do most when combined with ``rulesets.algebra``,
whose commutativity and constant folding they build on::

    rulesets.algebra + rulesets.fastmath.reassociate

Tolerances are for float32 (they scale with the dtype's epsilon) and hold on
*ordinary values*: finite, of moderate magnitude (no overflow or underflow
in the rewritten form), and, for the toggles that reorder sums, of one sign.
Cancellation can make the relative error of any reordered sum unbounded, so
no tolerance is claimed there. Infinities and NaN may change: ``x - x -> 0``
is wrong for ``x = inf``, which is what the ``cancel`` toggle accepts.

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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rewrite import Limits, Pat, Ruleset, Tolerance, procedural, rule

__all__ = ["fastmath", "reassociate", "reciprocal", "cancel", "fuse_reductions", "distribute", "powers",
           "signed_zeros"]

X = Pat.var("x")


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _example_at(*args: jax.ShapeDtypeStruct):
    """Make a function the ``example=(fn, args)`` of a ``Pat`` rule: a program it applies in, at ``args``.

    A Pat rule has no left-side function to trace, so ``check_ruleset`` checks
    it on such a program; each toggle defines its rules' examples.
    """
    return lambda fn: (fn, args)


def _floating(*xs) -> bool:
    return all(jnp.issubdtype(x.dtype, jnp.floating) for x in xs)


# Zero is an ordinary value, and a division by it is not: x/x -> 1 would turn 0/0 (NaN) into
# 1, and a/c + b/c -> (a + b)/c turns 0/0 + 1/0 (NaN) into 1/0 (inf). Rules that cancel or
# merge divisions ask for a divisor that the facts prove nonzero.
def _nonzero_float(x) -> bool:
    return _floating(x) and x.nonzero


def _nonzero_divisor(a, b, c) -> bool:
    return _floating(a, b, c) and c.nonzero


# ---------------------------------------------------------------------- reassociate
# Associativity in both directions, with algebra's commutativity, reaches
# every bracketing and order of a chain: exponential in its length. So these
# rules get a small allowance of new matches per iteration; past it a rule is
# banned for a while, with allowance and ban doubling each time (egg's back-off),
# and the run's node and time limits bound the rest (benchmarks/growth.py).
reassociate = Ruleset("reassociate", [
    rule(lambda a, b, c: lax.add(lax.add(a, b), c), lambda a, b, c: lax.add(a, lax.add(b, c)),
         name="add_assoc_right", when=_floating),                              # (a + b) + c -> a + (b + c)
    rule(lambda a, b, c: lax.add(a, lax.add(b, c)), lambda a, b, c: lax.add(lax.add(a, b), c),
         name="add_assoc_left", when=_floating),                               # a + (b + c) -> (a + b) + c
    rule(lambda a, b, c: lax.mul(lax.mul(a, b), c), lambda a, b, c: lax.mul(a, lax.mul(b, c)),
         name="mul_assoc_right", when=_floating),                              # (a * b) * c -> a * (b * c)
    rule(lambda a, b, c: lax.mul(a, lax.mul(b, c)), lambda a, b, c: lax.mul(lax.mul(a, b), c),
         name="mul_assoc_left", when=_floating),                               # a * (b * c) -> (a * b) * c
], soundness="fastmath", tolerance=Tolerance(rtol=1e-5, atol=1e-6), limits=Limits(matches=200, ban=2),
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


@_example_at(_f32(4, 5))
def _ex_div_const(x):  # a mean divides by the count
    return jnp.mean(x, axis=-1)


def _not_reciprocal(x, y) -> bool:
    # 1/y is already a reciprocal; rewriting it to 1 * (1/y) would feed itself
    return _floating(x, y) and x.literal != 1


reciprocal = Ruleset("reciprocal", [
    rule(Pat("div", X, Pat.lit(name="c")), _div_by_constant, name="div_const", example=_ex_div_const),  # x / c -> x * (1/c)
    # 1.0 / y with jnp, as users write it: its literal is strong, lax.div's is weak, and only
    # the same literal makes the same class
    rule(lambda x, y: lax.div(x, y), lambda x, y: lax.mul(x, 1.0 / y),
         name="div_reciprocal", when=_not_reciprocal),                                 # x / y -> x * (1/y): pays when 1/y is shared
], soundness="fastmath", tolerance=Tolerance(rtol=5e-7, atol=0.0),
    description="divide by multiplying with a reciprocal: two roundings instead of one")


# ---------------------------------------------------------------------- cancel
def _not_visibly_nonfinite(x) -> bool:
    """Fastmath may assume finite values, but not against a constant that is plainly inf or NaN."""
    c = x.constant
    return c is None or bool(np.all(np.isfinite(c)))


def _cancellable(x) -> bool:
    return _floating(x) and _not_visibly_nonfinite(x)


def _cancellable_nonzero(x) -> bool:
    return _nonzero_float(x) and _not_visibly_nonfinite(x)


cancel = Ruleset("cancel", [
    rule(lambda x: x - x, lambda x: jnp.zeros_like(x), name="sub_self", when=_cancellable),   # x - x -> 0  (not for inf, NaN)
    rule(lambda x: x / x, lambda x: jnp.ones_like(x), name="div_self", when=_cancellable_nonzero),  # x / x -> 1, x != 0  (not for inf, NaN)
    rule(lambda x: x * 0, lambda x: jnp.zeros_like(x), name="mul_zero", when=_cancellable),   # x * 0 -> 0  (not for inf, NaN; sign of zero)
], soundness="fastmath", tolerance=Tolerance(rtol=0.0, atol=0.0),
    description="cancel x-x, x/x, x*0: exact on finite nonzero values, wrong for inf and NaN")


# ---------------------------------------------------------------------- fuse_reductions
def _same_sum(m) -> bool:
    a, b, p, q = m["a"], m["b"], m.params("p"), m.params("q")
    return (a.aval == b.aval and tuple(p["axes"]) == tuple(q["axes"])
            and p.get("out_sharding") is None and q.get("out_sharding") is None and _floating(a))


def _fuse(op):
    @procedural
    def fuse(m):
        """sum(a) op sum(b) -> sum(a op b): one reduction instead of two."""
        if not _same_sum(m):
            return None
        axes = tuple(m.params("p")["axes"])
        return m.trace(lambda a, b: jnp.sum(op(a, b), axis=axes), m["a"], m["b"])
    return fuse


def _sum(name: str, params: str) -> Pat:
    return Pat("reduce_sum", Pat.var(name), params=params)


@_example_at(_f32(4, 5), _f32(4, 5))
def _ex_fuse_sum_add(a, b):  # two losses, summed over the batch
    return jnp.sum(a, axis=0) + jnp.sum(b, axis=0)


@_example_at(_f32(4, 5), _f32(4, 5))
def _ex_fuse_sum_sub(a, b):
    return jnp.sum(a, axis=1) - jnp.sum(b, axis=1)


fuse_reductions = Ruleset("fuse_reductions", [
    rule(Pat("add", _sum("a", "p"), _sum("b", "q")), _fuse(lax.add), name="fuse_sum_add",
         example=_ex_fuse_sum_add),                                                                # sum(a) + sum(b) -> sum(a + b)
    rule(Pat("sub", _sum("a", "p"), _sum("b", "q")), _fuse(lax.sub), name="fuse_sum_sub",
         example=_ex_fuse_sum_sub),                                                                # sum(a) - sum(b) -> sum(a - b)
], soundness="fastmath", tolerance=Tolerance(rtol=1e-5, atol=1e-6),
    description="one reduction instead of two over equal axes: values of one sign, within 1e-5 relative")


# ---------------------------------------------------------------------- distribute
@procedural
def _pull_scalar_out_of_sum(m):
    """sum(x * s) -> sum(x) * s for a scalar s: n multiplications become one."""
    x, s, p = m["x"], m["s"], m.params("p")
    if s.ndim != 0 or not _floating(x, s) or p.get("out_sharding") is not None:
        return None
    axes = tuple(p["axes"])
    return m.trace(lambda x, s: lax.mul(jnp.sum(x, axis=axes), s), x, s)


@_example_at(_f32(4, 5), _f32())
def _ex_sum_scalar_mul(x, s):  # a scaled row sum
    return jnp.sum(x * s, axis=-1)


distribute = Ruleset("distribute", [
    rule(lambda a, b, c: lax.add(lax.mul(a, b), lax.mul(a, c)), lambda a, b, c: lax.mul(a, lax.add(b, c)),
         name="factor_add", when=_floating),  # a*b + a*c -> a*(b + c)
    rule(lambda a, b, c: lax.sub(lax.mul(a, b), lax.mul(a, c)), lambda a, b, c: lax.mul(a, lax.sub(b, c)),
         name="factor_sub", when=_floating),  # a*b - a*c -> a*(b - c)
    rule(lambda a, b, c: lax.add(lax.div(a, c), lax.div(b, c)), lambda a, b, c: lax.div(lax.add(a, b), c),
         name="factor_div", when=_nonzero_divisor),  # a/c + b/c -> (a + b)/c, c != 0
    rule(Pat("reduce_sum", Pat("mul", X, Pat.var("s")), params="p"), _pull_scalar_out_of_sum,
         name="sum_scalar_mul", example=_ex_sum_scalar_mul),                                       # sum(x * s) -> sum(x) * s  (scalar s)
], soundness="fastmath", tolerance=Tolerance(rtol=1e-5, atol=1e-6),
    description="factor common multiplicands and divisors: values of one sign, within 1e-5 relative")


# ---------------------------------------------------------------------- powers
# rulesets.algebra folds only the powers whose rounding XLA's repeated
# squaring reproduces exactly; these fold any, within a few roundings.
_MAX_EXPONENT = 64


def _base(m, n: int):
    """The base x, unless folding to x^n could loop or leave the tolerance."""
    x = m["x"]
    if not _floating(x) or x.literal is not None or n == 0 or abs(n) > _MAX_EXPONENT:
        return None
    for cls, node in m.users(x):  # a class equal to its own square would gain x^2, x^4, ... forever
        if cls.cls == x.cls and (node.prim == "square" or (node.prim == "integer_pow" and node.params["y"] != 1)
                                 or (node.prim == "mul" and all(o.cls == x.cls for o in node.operands))):
            return None
    return x


def _power(n_of):
    @procedural
    def power(m):
        n = n_of(m)
        x = _base(m, n)
        return None if x is None else m.trace(lambda v: lax.integer_pow(v, n), x)
    return power


@_example_at(_f32(7))
def _ex_pow_pow_any(x):
    return (x ** 3) ** 2


@_example_at(_f32(7))
def _ex_mul_pows_any(x):
    return x ** 2 * x ** 3


@_example_at(_f32(7))
def _ex_mul_x_pow_any(x):
    return x * x ** 6


powers = Ruleset("powers", [
    rule(Pat("integer_pow", Pat("integer_pow", X, params="p"), params="q"),
         _power(lambda m: m.params("p")["y"] * m.params("q")["y"]), name="pow_pow_any",
         example=_ex_pow_pow_any),                                                                 # (x^a)^b -> x^(a*b)
    rule(Pat("mul", Pat("integer_pow", X, params="p"), Pat("integer_pow", X, params="q")),
         _power(lambda m: m.params("p")["y"] + m.params("q")["y"]), name="mul_pows_any",
         example=_ex_mul_pows_any),                                                                # x^a * x^b -> x^(a+b)
    rule(Pat("mul", X, Pat("integer_pow", X, params="q")),
         _power(lambda m: m.params("q")["y"] + 1), name="mul_x_pow_any",
         example=_ex_mul_x_pow_any),                                                               # x * x^a -> x^(a+1)
], soundness="fastmath", tolerance=Tolerance(rtol=2e-6, atol=0.0),
    description="fold products and powers of powers: a few roundings, exponents up to 64")


# ---------------------------------------------------------------------- signed_zeros
signed_zeros = Ruleset("signed_zeros", [
    rule(lambda x: x + 0.0, lambda x: x, name="add_zero", when=_floating),                 # x + 0.0 -> x  (-0.0 + 0.0 is +0.0)
    rule(lambda x: 0.0 - x, lambda x: -x, name="zero_sub", when=_floating),                # 0.0 - x -> -x  (0.0 - 0.0 is +0.0)
    rule(lambda a, b: -lax.sub(a, b), lambda a, b: lax.sub(b, a), name="neg_sub", when=_floating),       # -(a - b) -> b - a  (differs when a == b)
], soundness="fastmath", tolerance=Tolerance(rtol=0.0, atol=0.0),
    description="ignore the sign of zero: equal as numbers, -0.0 may become +0.0")


fastmath = Ruleset("fastmath", [reassociate, reciprocal, cancel, fuse_reductions, distribute, powers, signed_zeros],
                   soundness="fastmath", tolerance=Tolerance(rtol=1e-5, atol=1e-6),
                   description="every fastmath toggle")
