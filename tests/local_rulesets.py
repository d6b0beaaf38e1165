"""A small ruleset of every kind of rule, so the contract and fuzz tests exercise something before the packs land.

It mixes the three shapes a rule can take (two JAX functions, a procedural
right-hand side, a :class:`Pat` with an example program), guards on facts
and on shapes, and two soundness classes. Every rule here is sound in its
class; ``tests/test_testing.py`` shows that the checker rejects the unsound
ones next door.
"""

import math

import jax
import jax.numpy as jnp

from rewrite import Pat, Ruleset, procedural, rule


@procedural
def _halve(m):
    """x / 2 -> x * 0.5: exact, since 0.5 is a power of two; declined for integers."""
    x = m["x"]
    return m.trace(lambda v: v * 0.5, x) if x.is_floating else None


@procedural
def _sum_of_broadcast(m):
    """sum(broadcast(s)) -> s * n, when every element of the broadcast scalar is summed."""
    s, total = m["s"], m.root
    if s.ndim != 0 or total.ndim != 0:
        return None
    n = math.prod(m.params("bp")["shape"])
    return m.trace(lambda s: s * jnp.asarray(n, s.dtype), s)


exact = Ruleset("local_exact", [
    rule(lambda x: x * 1, lambda x: x, name="mul_one"),                        # x*1 -> x
    rule(lambda x: -(-x), lambda x: x, name="neg_neg"),                        # -(-x) -> x
    rule(lambda x: x + (-0.0), lambda x: x, name="add_neg_zero"),              # x + -0.0 -> x
    rule(lambda x: jnp.abs(x), lambda x: x, name="abs_nonneg", when=lambda x: x.nonneg),  # |x| -> x, x >= 0
    rule(lambda x: x / 2.0, _halve, name="div_two"),                           # x/2 -> x*0.5
    rule(lambda x: x.T.T, lambda x: x, name="transpose_twice", when=lambda x: x.ndim == 2),  # (x^T)^T -> x
])

identity = Ruleset("local_identity", [
    rule(lambda x, y: jnp.exp(x) * jnp.exp(y), lambda x, y: jnp.exp(x + y), name="exp_add"),  # e^x e^y -> e^(x+y)
    rule(lambda x: 2 * jnp.sin(x) * jnp.cos(x), lambda x: jnp.sin(2 * x), name="double_angle"),
    rule(lambda x: jnp.log(jnp.exp(x)), lambda x: x, name="log_exp"),          # log(e^x) -> x
    rule(lambda a, b, c: a * b + a * c, lambda a, b, c: a * (b + c), name="factor"),  # ab+ac -> a(b+c)
    rule(Pat("reduce_sum", Pat("broadcast_in_dim", Pat.var("s"), params="bp")), _sum_of_broadcast,
         name="sum_of_broadcast", example_program=(lambda a: jnp.sum(jnp.broadcast_to(a, (4, 5))),
                                           (jax.ShapeDtypeStruct((), jnp.float32),))),
], soundness="identity")

local = Ruleset("local", [exact, identity])


def without_kernels(pack):
    """``pack`` without its ``jointly`` parts (``rulesets.derivatives``' ``derivatives_kernels``): what the tests of
    the VJP's residual split and of the stored ``sin`` read, which the kernel's backward would replace where it is
    chosen (``rulesets/_sin2.py``)."""
    return Ruleset(f"{pack.name}_without_kernels", [p for p in pack.parts if not p.jointly] + list(pack.rules),
                   soundness=pack.soundness, tolerance=pack.tolerance)
