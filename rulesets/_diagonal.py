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
from rulesets._numpy_eval import evaluated


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
    :func:`rulesets._numpy_eval.evaluated`'s forms. ``jnp.diagonal``'s branches and mask are (iotas, comparisons,
    a select, a point gather; a product and a sum), and XLA's compile of the check was most of a rewrite that
    meets one (54 of 73 ms at 1024 x 1024, against XLA's 30 ms for the whole program)."""
    (mask,) = evaluated(closed[0], []) or [None]
    if mask is None:
        return None
    got = [evaluated(c, [mask, x]) for c in closed[1:] for x in xs]
    return None if any(g is None or len(g) != 1 for g in got) else [g[0] for g in got]


#: :func:`_all_diagonal`'s verdicts, by the mask's and the branches' jaxprs and ``q``'s type
_DIAGONAL = Memo("rulesets._diagonal._DIAGONAL")
