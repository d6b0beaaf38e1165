"""Attention as one fused call (:func:`rulesets.kernels.attention.fused_attention`) where the backend has one:
where the logits :meth:`rewrite.Match.sliced` reads are ``scale * (q k^T) + bias`` under at most a causal mask,
with a masked logit's weight exactly 0 in the call and in the original (``docs/attention.md``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from rewrite import Sliced
from rulesets.kernels.attention import ValueProduct, fused_attention, fused_axes


# ---------------------------------------------------------------------- a fused kernel where the backend has one
#: The logits' fill value under a mask must send its weight to exactly 0 in the fused kernel and the original.
_FILL_AT_MOST = -1e4


def implementation() -> str | None:
    """``jax.nn.dot_product_attention``'s implementation: cuDNN's on a GPU, else ``None`` (the blocked form)."""
    return "cudnn" if jax.default_backend() == "gpu" else None


def blocked() -> bool:
    """Whether the pack builds its blocked form: not on a GPU, where XLA's own attention measured faster
    (``docs/attention.md``)."""
    return jax.default_backend() != "gpu"


def fused(logits: Sliced, product: ValueProduct, v_aval: Any, impl: str):
    """``fn(*leaves, v)``: the attention as one ``jax.nn.dot_product_attention`` call, or ``None``; the logits
    ``scale * (q k^T) + bias`` under at most a causal mask (:meth:`rewrite.Sliced.affine`), the weights (the logits
    less the axes ``product.squeezed``) meeting ``v`` (of ``v_aval``) in ``product``."""
    form = logits.affine("dot_general")
    if form is None or (form.fill is not None and not form.fill <= _FILL_AT_MOST):
        return None
    dot = logits.steps[form.product.index]
    nb = len(dot.params["dimension_numbers"][1][0])
    if form.mask is not None and (form.mask[1] != dot.axis or form.mask[0] < nb):
        return None  # not query position >= key position
    ranks = tuple(len(logits.aval(a).shape) for a in dot.args)
    layout = fused_axes(dot.params["dimension_numbers"], dot.aval.shape, ranks, dot.axis, form.axes, product,
                        causal_axis=None if form.mask is None else form.mask[0], biased=bool(form.terms))
    if layout is None:
        return None
    axes, q_lhs = layout
    q_ref, k_ref = dot.args if q_lhs else dot.args[::-1]
    dtype = logits.aval(q_ref).dtype
    # the call computes in the query's dtype: k, v and the result must be of it too (no rounding the original
    # does not do); a bias term too, where that rounds nothing (values of the query's dtype, widened and
    # broadcast, scaled by a power of two that cannot overflow the narrower dtype)
    if any(d != dtype for d in (logits.aval(k_ref).dtype, v_aval.dtype, product.out.dtype)):
        return None
    for term in form.terms:
        w = term.factor
        if not logits.exact_in(term.ref, dtype) or math.frexp(abs(w))[0] != 0.5 or (
                abs(w) != 1.0 and jnp.finfo(dtype).maxexp < jnp.finfo(logits.aval(term.ref).dtype).maxexp):
            return None

    def fn(*args: Any) -> Any:
        *leaves, v = args
        memo: dict = {}
        q, k = logits.value(leaves, q_ref, memo), logits.value(leaves, k_ref, memo)
        b = None
        for term in form.terms:
            t, w = logits.value(leaves, term.ref, memo), term.factor
            t = term.as_product(t if w == 1.0 else t * jnp.asarray(w, t.dtype)).astype(q.dtype)
            b = t if b is None else b + t
        return fused_attention(q, k, v, b, axes=axes, scale=form.scale, causal=form.mask is not None,
                               implementation=impl, dtype=product.out.dtype)

    return fn
