"""Rules that act on loops: read a ``lax.scan``'s body, add inputs, outputs and carries, move work in or out.

A loop rule matches a scan with :data:`SCAN` and wraps the match in a
:class:`Loop`. The ``Loop`` reads the old loop (its outputs, its body's
inputs, which outer values stay the same at every step) and describes a copy
of it being built: :meth:`Loop.add_const`, :meth:`Loop.add_xs`,
:meth:`Loop.add_carry` and :meth:`Loop.add_output` extend it,
:meth:`Loop.per_step` moves outer work that acts step by step into the body
(elementwise chains, broadcasts, ``dot_general``, ``reshape``, ``transpose``,
slices and reductions that leave the loop's axis alone), and :meth:`Loop.build`
inserts the copy next to the old loop. :meth:`Loop.handover` then gives
every output of the old loop to the copy, so extraction can keep whichever
program the cost model prefers. The copy shares the old body's scope: the
inputs it adds are fresh body inputs, so the rest of the body is reused.

Bookkeeping that every rule would otherwise repeat lives here: the body's
input order (constants, carries, ``xs``), ``linear`` flags, step avals,
reverse loops (row ``t`` of a stacked array is step ``t`` whichever way the
loop runs, so nothing changes), unrolling (kept as it is), and nested loops
(each body is its own scope, and new input indices come from
:meth:`Match.fresh_index`, so two rules never give one input two meanings).

A rule that cannot build what it wants raises :class:`Decline` inside a
``with loop.attempt():`` block (which undoes what the attempt added) or
returns ``None``.

A loop rule that counts steps: each step's ``x * x`` becomes a new stacked
output, and the old loop's stacked output is handed over unchanged.

>>> import jax, jax.numpy as jnp
>>> from jax import lax
>>> from rewrite import Ruleset, explain, procedural, rule
>>> from rewrite.loops import SCAN, Loop
>>> @procedural
... def sum_squares_inside(m):
...     loop = Loop(m)
...     found = [(v, n) for v, n in loop.consumers() if n.prim == "reduce_sum" and n.params["axes"] == (0, 1)]
...     if loop.params.get("_rw_demo") or not found:
...         return None
...     root, node = found[0]
...     (stacked,) = node.operands
...     with loop.attempt():
...         step = loop.per_step(stacked)                    # ys_t ** 2, built in the body
...         j, acc = loop.add_carry(m.trace(lambda: jnp.zeros((), root.dtype)))
...         loop.set_carry_next(j, m.trace(lambda a, s: a + jnp.sum(s), acc, step))
...         res = loop.build(_rw_demo=True)
...         return loop.handover(res) + [(root, loop.carry_result(res, j))]
>>> r = rule(SCAN, sum_squares_inside, name="sum_squares_inside")
>>> def f(h, xs):
...     return jnp.sum(lax.scan(lambda c, x: (c + x, c * x), h, xs)[1] ** 2)
>>> report = explain(f, jnp.ones(3), jnp.ones((5, 3)), rulesets=[Ruleset("demo", [r], soundness="identity")])
>>> sorted(report.fired), [e.primitive.name for e in report.after.eqns]
(['sum_squares_inside'], ['scan'])
"""

from typing import Any, ContextManager

import jax

from .ir.jaxapi import LAID_OUT_SCOPE
from .rules.loops import SCAN, WHILE, Body, Decline, Loop, adds_one, is_pointwise, stacked_aval, step_aval

__all__ = ["SCAN", "WHILE", "Body", "Decline", "Loop", "adds_one", "is_pointwise", "laid_out", "stacked_aval",
           "step_aval"]


def laid_out() -> ContextManager[Any]:
    """The scope in which a pack's kernel traces a loop it laid out by hand.

    A ``lax.scan`` traced inside it (or, through ``jax.custom_vjp``, the
    backward loops JAX traces from a kernel's ``bwd`` inside it) is loaded
    with ``_rw_laid_out`` in its params, and loop rules that choose which
    inputs a loop reads (``rulesets.scan``'s ``sink_inputs``) leave it as the
    kernel wrote it. The LM head's kernels (``rulesets.nn``) use it: their
    backward loop over token blocks reads a copy of every token's hidden
    state and cotangent by design, and sinking the work that makes those into
    it built copies of a 57-operand body that no chosen program used (three
    times the joint e-graph's rows on a GPT step).

    >>> import jax, jax.numpy as jnp
    >>> from jax import lax
    >>> from rewrite.loops import laid_out
    >>> def f(xs):
    ...     with laid_out():
    ...         return lax.scan(lambda c, x: (c + x, c * x), 0.0, xs)[1]
    >>> "rewrite_laid_out" in str(jax.make_jaxpr(f)(jnp.ones(3)).eqns[0].source_info.name_stack)
    True
    """
    return jax.named_scope(LAID_OUT_SCOPE)
