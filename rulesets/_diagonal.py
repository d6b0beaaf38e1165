"""The check behind ``rulesets.linalg``'s ``la_diagonal_product``: does a branch of ``jnp.diagonal``'s
``cond(platform, w, q)`` compute the diagonal of ``q``? (Kept apart from the pack's module, which it would take
over its length.)"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from rewrite import Value
from rewrite.cache.fingerprint import Memo


#: Primitives through which a value flows linearly (``mul`` when its other operand does not read it).
_LINEAR = {"gather", "mul", "reduce_sum", "convert_element_type", "broadcast_in_dim", "reshape", "squeeze",
           "transpose"}


def _linear_in(closed: Any, k: int) -> bool:
    """Is the jaxpr's output a linear function of its input ``k`` (every other input held fixed)?"""
    jaxpr = closed.jaxpr
    dep = {jaxpr.invars[k]}
    for e in jaxpr.eqns:
        reads = [i for i, v in enumerate(e.invars) if not isinstance(v, jax.extend.core.Literal) and v in dep]
        if not reads:
            continue
        name = e.primitive.name
        if name not in _LINEAR or (name == "mul" and len(reads) != 1) or (name == "gather" and reads != [0]) \
                or (name == "convert_element_type" and not jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)):
            return False
        dep.update(e.outvars)
    return True


def _branch(m: Any, body: Any, w: Value, q: Value) -> Callable[..., list] | None:
    """This branch of ``cond(platform, w, q)`` as a function of ``(w, q)``, where it is linear in ``q`` (its jaxpr
    says so) and has one output; else ``None``."""
    try:
        g = m.function(body.outs, [m.param(body.scope, 0, w.aval), m.param(body.scope, 1, q.aval)])
    except ValueError:
        return None
    if g is None or len(body.outs) != 1 or not _linear_in(g.jaxpr, 1):
        return None
    return g


def _all_diagonal(branches: Sequence[Callable[..., list]], fmask: Callable[..., list], q: Value) -> bool:
    """Do these branches, each linear in ``q`` (:func:`_branch`), compute the diagonal of ``q``, given ``w``
    as ``fmask`` computes it?

    Each must agree with the diagonal on two random integer matrices: two linear maps that differ agree on a
    random point of a grid of 2001^(n*n) points with probability at most 1/2001, so this is a randomised
    identity test, whose two draws are exact in float32 and fixed by a seed (a rule's result depends on nothing
    but its match). Every branch at both draws, and the mask, are evaluated in one compiled call: one by one,
    each operation of ``jnp.diagonal``'s branches compiled apart in a process's first rewrite (0.99 s of CPU for
    one firing). The verdict depends on nothing but the jaxprs and ``q``'s type, so it is kept by them
    (:data:`_DIAGONAL`) where they hold no constants: a later rewrite of the same shapes asks nothing of XLA.
    """
    closed = [fmask.jaxpr, *(g.jaxpr for g in branches)]  # type: ignore[attr-defined]
    key = None if any(c.consts for c in closed) else (
        tuple(str(c.jaxpr) for c in closed), tuple(q.shape), np.dtype(q.dtype).str, jax.config.jax_enable_x64)
    if key is not None and key in _DIAGONAL:
        return _DIAGONAL[key]
    rng = np.random.default_rng(0)
    xs = [rng.integers(-1000, 1001, size=q.shape, dtype=np.int16).astype(q.dtype) for _ in range(2)]
    got = _by_numpy(closed, xs)
    if got is None:
        def check(*xs: Any) -> list:
            (mask,) = fmask()
            return [g(mask, x)[0] for g in branches for x in xs]

        try:  # compiled and run now, also while a jit traces the rewritten function (a Compiled call binds nothing)
            got = jax.jit(check).lower(*xs).compile()(*xs)
        except Exception:  # a branch that cannot run here is no diagonal we can vouch for
            got = None
    verdict = got is not None and all(np.array_equal(np.asarray(y), np.diagonal(x))
                                      for y, x in zip(got, xs * len(branches)))
    return verdict if key is None else _DIAGONAL.keep(key, verdict)


def _by_numpy(closed: Sequence[Any], xs: Sequence[np.ndarray]) -> list | None:
    """What :func:`_all_diagonal`'s compiled check computes (each branch of ``closed[1:]`` at the mask ``closed[0]``
    computes, and each draw of ``xs``), evaluated by NumPy: ``None`` unless every equation is one of
    :data:`_NUMPY`'s forms. ``jnp.diagonal``'s branches and mask are (iotas, comparisons, a select, a point
    gather; a product and a sum), and XLA's compile of the check was most of a rewrite that meets one (54 of 73 ms
    at 1024 x 1024, against XLA's 30 ms for the whole program)."""
    (mask,) = _evaluated(closed[0], []) or [None]
    if mask is None:
        return None
    got = [_evaluated(c, [mask, x]) for c in closed[1:] for x in xs]
    return None if any(g is None or len(g) != 1 for g in got) else [g[0] for g in got]


def _evaluated(closed: Any, args: Sequence[np.ndarray]) -> list | None:
    """``closed`` evaluated by NumPy, each equation by :data:`_NUMPY` (its result checked against the equation's
    type); ``None`` where one is of another form."""
    jaxpr, env = closed.jaxpr, {}
    if len(jaxpr.invars) != len(args):
        return None

    def read(v: Any) -> np.ndarray:
        return np.asarray(v.val, v.aval.dtype) if isinstance(v, jax.extend.core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, (np.asarray(c) for c in closed.consts)))
    env.update(zip(jaxpr.invars, args))
    for e in jaxpr.eqns:
        form = _NUMPY.get(e.primitive.name)
        out = None if form is None or len(e.outvars) != 1 else form([read(v) for v in e.invars], e.params)
        aval = e.outvars[0].aval
        if out is None or np.shape(out) != tuple(aval.shape) or np.asarray(out).dtype != aval.dtype:
            return None
        env[e.outvars[0]] = np.asarray(out)
    return [read(v) for v in jaxpr.outvars]


def _iota(_: list, p: dict) -> np.ndarray | None:
    shape, d = tuple(p["shape"]), p["dimension"]
    if p.get("sharding") is not None:
        return None
    return np.broadcast_to(np.arange(shape[d], dtype=p["dtype"]).reshape(
        [n if i == d else 1 for i, n in enumerate(shape)]), shape)


def _broadcast(a: list, p: dict) -> np.ndarray | None:
    (x,), shape, dims = a, tuple(p["shape"]), tuple(p["broadcast_dimensions"])
    if p.get("sharding") is not None:
        return None
    return np.broadcast_to(x.reshape([x.shape[dims.index(i)] if i in dims else 1 for i in range(len(shape))]), shape)


def _point_gather(a: list, p: dict) -> np.ndarray | None:
    """A gather of single elements: ``operand[indices[..., 0], indices[..., 1], ...]``, every index in bounds."""
    (x, idx), dn = a, p["dimension_numbers"]
    every = tuple(range(x.ndim))
    if (tuple(dn.offset_dims), tuple(dn.collapsed_slice_dims), tuple(dn.start_index_map)) != ((), every, every) \
            or tuple(dn.operand_batching_dims) or tuple(dn.start_indices_batching_dims) \
            or tuple(p["slice_sizes"]) != (1,) * x.ndim or idx.shape[-1:] != (x.ndim,) \
            or not np.issubdtype(idx.dtype, np.integer) or (idx < 0).any() or (idx >= np.asarray(x.shape)).any():
        return None
    return x[tuple(np.moveaxis(idx, -1, 0))]


def _convert(a: list, p: dict) -> np.ndarray | None:
    """From bools or integers to a float (exact for these draws, whose values are integers under 2**24)."""
    (x,), to = a, np.dtype(p["new_dtype"])
    return x.astype(to) if (x.dtype == bool or np.issubdtype(x.dtype, np.integer)) \
        and jnp.issubdtype(to, jnp.floating) else None


def _select(a: list, _: dict) -> np.ndarray | None:
    return np.where(a[0], a[2], a[1]) if len(a) == 3 and a[0].dtype == bool else None


def _same_dtypes(fn: Callable[..., Any]) -> Callable[[list, dict], np.ndarray | None]:
    """An elementwise operation of operands of one dtype (a jaxpr's are), the result in it or bool."""
    return lambda a, _: fn(*a) if len({x.dtype for x in a}) == 1 else None


#: The equations :func:`_evaluated` evaluates, by primitive, as ``(operands, params) -> result or None``.
_NUMPY: dict[str, Callable[[list, dict], np.ndarray | None]] = {
    "mul": _same_dtypes(np.multiply), "add": _same_dtypes(np.add), "lt": _same_dtypes(np.less),
    "eq": _same_dtypes(np.equal), "select_n": _select, "iota": _iota, "broadcast_in_dim": _broadcast,
    "gather": _point_gather, "convert_element_type": _convert,
    "concatenate": lambda a, p: np.concatenate(a, axis=p["dimension"]),
    "reduce_sum": lambda a, p: np.sum(a[0], axis=tuple(p["axes"]), dtype=a[0].dtype)
    if p.get("out_sharding") is None else None,
}


#: :func:`_all_diagonal`'s verdicts, by the mask's and the branches' jaxprs and ``q``'s type
_DIAGONAL = Memo("rulesets._diagonal._DIAGONAL")
