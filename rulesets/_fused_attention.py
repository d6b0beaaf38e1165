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
from rulesets.kernels.attention import FusedAxes, fused_attention


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


def fused(logits: Sliced, p_first: bool, pv_dn: Any, v_aval: Any, squeezed: tuple, out_aval: Any,
          impl: str):
    """``fn(*leaves, v)``: the attention as one ``jax.nn.dot_product_attention`` call, or ``None``.

    ``pv_dn`` is the dimension numbers of the weights' product with ``v`` (of ``v_aval``; ``p_first``: the
    weights on the left), whose weights are the logits less their axes ``squeezed``."""
    v_rank, v_dtype = len(v_aval.shape), v_aval.dtype
    form = _logits_form(logits)
    if form is None:
        return None
    scale, bias, causal, top = form.scale, form.bias, form.causal, form.top
    dot = logits.steps[form.dot.index]
    dparams, (a_ref, b_ref), d_aval, key = dot.params, dot.args, dot.aval, dot.axis
    (lc, rc), (lb, rb) = dparams["dimension_numbers"]
    nb, rank = len(lb), len(d_aval.shape)
    q_lhs = key == rank - 1  # the query is the product's left operand
    q_dots = [d for d in range(nb, rank) if d != key]
    if nb > 2 or len(lc) != 1 or len(q_dots) not in (1, 2) or (not q_lhs and key != nb):
        return None
    # The query's free axes are its sequence (T) and at most one more, a group of heads sharing a key head
    # (jax's grouped-query attention, G): T is the axis a causal mask compares, else the longer.
    t_dot = causal if causal is not None else max(q_dots, key=lambda d: (d_aval.shape[d], -d))
    if causal is not None and d_aval.shape[t_dot] != d_aval.shape[key]:
        return None  # queries and keys of different lengths: how a kernel aligns its causal mask varies
    g_dot = next((d for d in q_dots if d != t_dot), None)
    q_ref, k_ref = (a_ref, b_ref) if q_lhs else (b_ref, a_ref)
    qb, kb = (lb, rb) if q_lhs else (rb, lb)
    qc, kc = (lc[0], rc[0]) if q_lhs else (rc[0], lc[0])
    q_rank, k_rank = len(logits.aval(q_ref).shape), len(logits.aval(k_ref).shape)
    dtype = logits.aval(q_ref).dtype
    # the call computes in the query's dtype: k, v and the result must be of it too (no rounding the
    # original does not do)
    if q_rank != rank or k_rank != nb + 2 or dtype != logits.aval(k_ref).dtype or dtype != v_dtype \
            or dtype != out_aval.dtype:
        return None
    if g_dot is not None and bias:
        return None  # a bias over grouped heads: not mapped
    # A bias term goes to the fused call in the query's dtype: only where that rounds nothing (values of the
    # query's dtype, widened and broadcast, scaled by a power of two that cannot overflow the narrower dtype).
    for term in bias:
        w = term.factor
        if not logits.exact_in(term.ref, dtype) or math.frexp(abs(w))[0] != 0.5 or (
                abs(w) != 1.0 and jnp.finfo(dtype).maxexp < jnp.finfo(logits.aval(term.ref).dtype).maxexp):
            return None
    # The weights (the logits less ``squeezed``) times v: the product's batch axes are the logits' batch
    # axes that the weights keep, its contraction the key axis, its free axes the query's; v has one more
    # axis, the head dimension.
    (pc_l, pc_r), (pb_l, pb_r) = pv_dn
    p_batch, v_batch = (pb_l, pb_r) if p_first else (pb_r, pb_l)
    v_c = (pc_r if p_first else pc_l)[0]
    kept = [d for d in range(len(top)) if d not in squeezed]   # the weights' axes, as the logits'
    p_dot = [top[d] for d in kept]                              # ... as the product's (None: size one)
    if any(p_dot[p] is None or p_dot[p] >= nb for p in p_batch):
        return None
    v_axes: list[int | None] = []  # v's axis for each of the product's batch axes (None: v lacks it)
    for i in range(nb):
        if i in p_dot and p_dot.index(i) in p_batch:
            v_axes.append(int(v_batch[list(p_batch).index(p_dot.index(i))]))
        elif i in p_dot or d_aval.shape[i] != 1:
            return None
        else:
            v_axes.append(None)
    free = [p for p in range(len(kept)) if p not in p_batch and p_dot[p] != key]
    v_free = [d for d in range(v_rank) if d not in v_batch and d != v_c]
    free_dots = [p_dot[p] for p in free]
    if len(v_free) != 1 or t_dot not in free_dots or any(d not in (t_dot, g_dot, None) for d in free_dots) \
            or (g_dot is not None and g_dot not in free_dots and d_aval.shape[g_dot] != 1):
        return None
    q_axis_of = dict(zip(q_dots, [d for d in range(q_rank) if d not in qb and d != qc]))
    q_free, q_group = q_axis_of[t_dot], (q_axis_of[g_dot] if g_dot is not None else None)
    k_free = next(d for d in range(k_rank) if d not in kb and d != kc)

    def pad(batch: Sequence[int | None], seq: int, head: int) -> tuple:
        return (batch[0] if nb > 0 else None, seq, batch[1] if nb > 1 else None, head)

    # Where each axis of the weights' product comes from in the call's output as [b0, T, b1, G, H]
    # (None: an axis of size one that it lacks).
    five = {t_dot: 1, g_dot: 3, None: None}
    src = [(0, 2)[p_dot[p]] for p in p_batch]
    src += [five[d] for d in free_dots] + [4] if p_first else [4] + [five[d] for d in free_dots]
    axes = FusedAxes(q=(qb[0] if nb > 0 else None, q_free, qb[1] if nb > 1 else None, q_group, qc),
                     k=pad(kb, k_free, kc), v=pad(v_axes, v_c, v_free[0]), bias=pad(list(range(nb)), t_dot, key),
                     out=tuple(src))

    def fn(*args: Any) -> Any:
        *leaves, v = args
        memo: dict = {}
        q = logits.value(leaves, q_ref, memo)
        k = logits.value(leaves, k_ref, memo)
        b = None
        for term in bias:
            t, w = logits.value(leaves, term.ref, memo), term.factor
            t = _as_product(t if w == 1.0 else t * jnp.asarray(w, t.dtype), term.shape, term.axes).astype(q.dtype)
            b = t if b is None else b + t
        return fused_attention(q, k, v, b, axes=axes, scale=scale, causal=causal is not None, implementation=impl,
                               dtype=out_aval.dtype)

    return fn
