"""The blocked attention kernel of a match as a plan whose trace is kept: what ``rulesets.attention`` traces.

A model's attention layers are alike: each layer's match reads logits of the same steps, the same leaf types and
literals, and the same product with ``v``, and builds the same loops (:class:`rulesets.kernels.attention.Offer`).
Each built its own kernel and traced it (flax_long_context_step: two layers, two loops each, 4 traces of 2
programs in its first call). :class:`Plan` says everything the kernel's trace reads (``_trace_key``), so that
``Match.trace`` of :meth:`Plan.kernel` keeps one trace per plan, loop and input types
(``rewrite/rules/builder.py``'s ``_trace_key``), and the layers' kernels are one program: one ``custom_vjp``,
whose forward and backward JAX traces once per joint program for every layer that calls it.

What the trace reads of the matched logits (a :class:`rewrite.Sliced`): its steps (primitive, params, operands,
type, the sliced axis's place), its sliced axis and output, and of each leaf its type, where it carries the axis,
and its literal value (the leaf's own, and as :func:`rewrite.rules.sliced.scalar_literal` reads it through a
conversion); nothing else (:meth:`rewrite.Sliced.blocks` drops the leaves before the loop is built). A param
that is not a plain value (an enum, a jaxpr) leaves the plan without a key: traced afresh, as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rewrite.rules.sliced import Sliced, scalar_literal
from rulesets.kernels.attention import Logits, Offer, ValueProduct, blocked_attention


def _aval_key(aval: Any) -> tuple:
    return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)))


def sliced_key(s: Sliced) -> tuple:
    """What a kernel's trace reads of the matched logits ``s`` (see the module's docstring)."""
    # (a literal as it is: builder._plain keys a number by its type and value, bit for bit, or declines)
    leaves = tuple((_aval_key(v.aval), v.literal, scalar_literal(v)) for v in s.leaves)
    steps = tuple((step.primitive, step.params, step.args, _aval_key(step.aval), step.axis) for step in s.steps)
    return (leaves, s.leaf_axes, steps, s.out, s.axis)


def product_key(p: ValueProduct) -> tuple:
    """What a kernel's trace reads of the product with ``v``."""
    return (p.weights_first, p.dimension_numbers, p.params, p.v_key, (tuple(p.out.shape), str(p.out.dtype)),
            p.cast, p.squeezed, p.wide)


def logits_of(sliced: Sliced, query_axis: int | None) -> Logits:
    """The matched logits (``sliced`` along the keys) as :class:`Logits`, blocks of ``query_axis`` too (``None``:
    not cut): the backward's over their own leaves, the forward's with a literal scale applied to ``q`` before
    the loops (:meth:`rewrite.Sliced.blocks`)."""
    back, ahead = sliced.blocks(query_axis), sliced.blocks(query_axis, hoist=True)
    s = sliced.aval(sliced.out)
    return Logits(tuple(s.shape), s.dtype, sliced.axis, back.block, back.leaf_axes, query_axis=query_axis,
                  query_axes=back.across_axes, prepare=ahead.prepare, forward_block=ahead.block,
                  forward_key_axes=ahead.leaf_axes, forward_query_axes=ahead.across_axes)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A match's kernel before its loop is chosen: the logits ``sliced`` along the keys, cut along the logits' axis
    ``query_axis`` too where given (:func:`logits_of`), and the product with ``v``."""

    sliced: Sliced
    query_axis: int | None
    product: ValueProduct

    def _trace_key(self) -> tuple:
        # read by rewrite/rules/builder.py's _plain, for a closure over the plan (kernel's fn)
        return (sliced_key(self.sliced), self.query_axis, product_key(self.product))

    def kernel(self, offer: Offer) -> Callable[..., Any]:
        """``fn(*leaves, v)``: :func:`blocked_attention` over ``offer``'s blocks, built when it is traced."""
        plan = self

        def fn(*args: Any) -> Any:
            return blocked_attention(logits_of(plan.sliced, plan.query_axis), plan.product, **offer._asdict())(*args)

        return fn
