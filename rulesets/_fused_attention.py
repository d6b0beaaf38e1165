"""Attention as one fused call (:func:`rulesets.kernels.attention.fused_attention`) where the backend has one:
where the logits :meth:`rewrite.Match.sliced` reads are ``scale * (q k^T) + bias`` under at most a causal mask,
with a masked logit's weight exactly 0 in the call and in the original (``docs/attention.md``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rewrite import Sliced
from rewrite.rules.sliced import Ref
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


class _Bias(NamedTuple):
    """A bias term: its value, the factor it is added with, the shape and axes (as the product's) it is added at."""

    ref: Ref
    factor: float
    shape: tuple
    axes: list


class _Form(NamedTuple):
    """The logits as ``scale * (q k^T) + bias`` under at most one causal mask: the product's step, the scale,
    the bias terms, the product's query axis that a causal mask compares (``None``: no mask), and the logits'
    axes as the product's."""

    dot: Ref
    scale: float
    bias: list
    causal: int | None
    top: list


def _logits_form(logits: Sliced) -> _Form | None:
    """The logits as a :class:`_Form`, or ``None`` where they are anything else (a mask given as an array)."""
    path = logits.path_to("dot_general")
    maps = logits.axes_along(path) if path is not None else None
    if maps is None:
        return None
    dot = path[-1][0]
    dparams, key = logits.steps[dot.index].params, logits.steps[dot.index].axis
    nb = len(dparams["dimension_numbers"][1][0])
    q_dots = [d for d in range(nb, len(maps[-1])) if d != key]  # the query's free axes in the product
    scale, bias, causal, fill = 1.0, [], None, None
    for (ref, i), amap in zip(path[:-1], maps):
        step = logits.steps[ref.index]
        name, args, aval = step.primitive.name, step.args, step.aval
        if name in ("broadcast_in_dim", "transpose") or (name == "convert_element_type"
                                                           and jnp.issubdtype(aval.dtype, jnp.floating)):
            continue
        if name in ("mul", "div") and len(args) == 2:
            c = logits.literal(args[1 - i])
            if c is None or not math.isfinite(c) or c <= 0 or (name == "div" and i == 1):
                return None
            scale *= c if name == "mul" else 1.0 / c  # scales what lies below: the product, a bias added there
        elif name in ("add", "sub") and len(args) == 2 and not (name == "sub" and i == 1):
            bias.append(_Bias(args[1 - i], scale if name == "add" else -scale, tuple(aval.shape), amap))
        elif name == "select_n" and len(args) == 3 and i != 0 and causal is None:
            lo = logits.literal(args[3 - i])
            # a bias added after the mask would move the masked logits: the fused call adds it before
            if lo is None or bias or key not in amap:
                return None
            for q_dot in (d for d in q_dots if d in amap):
                keep = logits.positions_ge(args[0], amap.index(q_dot), amap.index(key))
                if keep is not None:
                    break
            if keep is None or keep != (i == 2):  # select_n picks its last operand where the mask is true
                return None
            causal, fill = q_dot, lo * scale  # the masked logit as the softmax sees it
        else:
            return None
    if fill is not None and not (fill == -math.inf or fill <= _FILL_AT_MOST):
        return None
    return _Form(dot, scale, bias, causal, maps[0])


def _as_product(x: Any, shape: tuple, amap: Sequence[int | None]) -> Any:
    """A bias term of ``shape`` (maybe broadcast to it) with its axes ``amap``, in the product's layout."""
    x = jnp.broadcast_to(x, shape)
    unit = tuple(d for d, a in enumerate(amap) if a is None)
    x = lax.squeeze(x, unit) if unit else x
    kept = [a for a in amap if a is not None]
    perm = tuple(int(j) for j in np.argsort(kept))
    return lax.transpose(x, perm) if list(perm) != sorted(perm) else x


def fused(logits: Sliced, product: ValueProduct, v_aval: Any, impl: str):
    """``fn(*leaves, v)``: the attention as one ``jax.nn.dot_product_attention`` call, or ``None``; the weights
    (``logits`` less the axes ``product.squeezed``) meet ``v`` (of ``v_aval``) in ``product``."""
    form = _logits_form(logits)
    if form is None:
        return None
    dot = logits.steps[form.dot.index]
    ranks = tuple(len(logits.aval(a).shape) for a in dot.args)
    layout = fused_axes(dot.params["dimension_numbers"], dot.aval.shape, ranks, dot.axis, form.top, product,
                        causal_axis=form.causal, biased=bool(form.bias))
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
    for term in form.bias:
        w = term.factor
        if not logits.exact_in(term.ref, dtype) or math.frexp(abs(w))[0] != 0.5 or (
                abs(w) != 1.0 and jnp.finfo(dtype).maxexp < jnp.finfo(logits.aval(term.ref).dtype).maxexp):
            return None

    def fn(*args: Any) -> Any:
        *leaves, v = args
        memo: dict = {}
        q, k = logits.value(leaves, q_ref, memo), logits.value(leaves, k_ref, memo)
        b = None
        for term in form.bias:
            t, w = logits.value(leaves, term.ref, memo), term.factor
            t = _as_product(t if w == 1.0 else t * jnp.asarray(w, t.dtype), term.shape, term.axes).astype(q.dtype)
            b = t if b is None else b + t
        return fused_attention(q, k, v, b, axes=axes, scale=form.scale, causal=form.causal is not None,
                               implementation=impl, dtype=product.out.dtype)

    return fn
