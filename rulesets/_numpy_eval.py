"""A few jaxprs evaluated by NumPy where a rule needs their values while it rewrites: :func:`evaluated`.

A rule that computes a value to decide (``rulesets._diagonal``'s check of ``jnp.diagonal``'s branches,
``rulesets.scan``'s rows a loop writes) would otherwise ask XLA to compile what it evaluates, once per shape: 30-55
ms of a first call whose own XLA compile is 30 ms. Only equations whose NumPy meaning is XLA's are evaluated (each
result checked against the equation's type); any other makes the answer ``None``, and the rule compiles as before.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np


def evaluated(closed: Any, args: Sequence[np.ndarray], batch: tuple[int, ...] = ()) -> list | None:
    """``closed`` (a ``ClosedJaxpr``) evaluated by NumPy at ``args``, each equation by :data:`FORMS`; ``None`` where
    one is of another form. ``batch``: leading axes every argument and value has beyond its type (``lax.map`` of the
    program over them), where each equation is elementwise or a broadcast."""
    jaxpr, env = closed.jaxpr, {}
    if len(jaxpr.invars) != len(args) or (batch and closed.consts):
        return None

    def read(v: Any) -> np.ndarray:
        return np.asarray(v.val, v.aval.dtype) if isinstance(v, jax.extend.core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, (np.asarray(c) for c in closed.consts)))
    env.update(zip(jaxpr.invars, args))
    with np.errstate(all="ignore"):  # integers wrap, as XLA's do
        for e in jaxpr.eqns:
            form = FORMS.get(e.primitive.name)
            out = None if form is None or len(e.outvars) != 1 else form([read(v) for v in e.invars], e.params,
                                                                        len(batch))
            aval = e.outvars[0].aval
            if out is None or np.shape(out) != batch + tuple(aval.shape) or np.asarray(out).dtype != aval.dtype:
                return None
            env[e.outvars[0]] = np.asarray(out)
    return [np.broadcast_to(read(v), batch + tuple(v.aval.shape)) for v in jaxpr.outvars]


def _iota(_: list, p: dict, b: int) -> np.ndarray | None:
    shape, d = tuple(p["shape"]), p["dimension"]
    if p.get("sharding") is not None or b:
        return None
    return np.broadcast_to(np.arange(shape[d], dtype=p["dtype"]).reshape(
        [n if i == d else 1 for i, n in enumerate(shape)]), shape)


def _broadcast(a: list, p: dict, b: int) -> np.ndarray | None:
    (x,), shape, dims = a, tuple(p["shape"]), tuple(p["broadcast_dimensions"])
    if p.get("sharding") is not None:
        return None
    lead = x.shape[:b]
    return np.broadcast_to(x.reshape(lead + tuple(x.shape[b + dims.index(i)] if i in dims else 1
                                                  for i in range(len(shape)))), lead + shape)


def _point_gather(a: list, p: dict, b: int) -> np.ndarray | None:
    """A gather of single elements: ``operand[indices[..., 0], indices[..., 1], ...]``, every index in bounds."""
    (x, idx), dn = a, p["dimension_numbers"]
    every = tuple(range(x.ndim))
    if b or (tuple(dn.offset_dims), tuple(dn.collapsed_slice_dims), tuple(dn.start_index_map)) != ((), every, every) \
            or tuple(dn.operand_batching_dims) or tuple(dn.start_indices_batching_dims) \
            or tuple(p["slice_sizes"]) != (1,) * x.ndim or idx.shape[-1:] != (x.ndim,) \
            or not np.issubdtype(idx.dtype, np.integer) or (idx < 0).any() or (idx >= np.asarray(x.shape)).any():
        return None
    return x[tuple(np.moveaxis(idx, -1, 0))]


def _convert(a: list, p: dict, _: int) -> np.ndarray | None:
    """From bools or integers to an integer (wrapping, as XLA's conversion does) or a float (rounded to nearest,
    as XLA's)."""
    (x,), to = a, np.dtype(p["new_dtype"])
    to_number = jnp.issubdtype(to, jnp.floating) or (np.issubdtype(to, np.integer) and to != bool)
    return x.astype(to) if (x.dtype == bool or np.issubdtype(x.dtype, np.integer)) and to_number else None


def _select(a: list, *_: Any) -> np.ndarray | None:
    return np.where(a[0], a[2], a[1]) if len(a) == 3 and a[0].dtype == bool else None


def _same_dtypes(fn: Callable[..., Any]) -> Callable[[list, dict, int], np.ndarray | None]:
    """An elementwise operation of operands of one dtype (a jaxpr's are), the result in it or bool."""
    return lambda a, *_: fn(*a) if len({x.dtype for x in a}) == 1 else None


def _sum(a: list, p: dict, b: int) -> np.ndarray | None:
    if p.get("out_sharding") is not None:
        return None
    return np.sum(a[0], axis=tuple(b + ax for ax in p["axes"]), dtype=a[0].dtype)


#: The equations :func:`evaluated` evaluates, by primitive, as ``(operands, params, batch axes) -> result or None``.
FORMS: dict[str, Callable[[list, dict, int], np.ndarray | None]] = {
    "mul": _same_dtypes(np.multiply), "add": _same_dtypes(np.add), "lt": _same_dtypes(np.less),
    "eq": _same_dtypes(np.equal), "select_n": _select, "iota": _iota, "broadcast_in_dim": _broadcast,
    "gather": _point_gather, "convert_element_type": _convert,
    "concatenate": lambda a, p, b: np.concatenate(a, axis=b + p["dimension"]), "reduce_sum": _sum,
}
