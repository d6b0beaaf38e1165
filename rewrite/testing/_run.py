"""Running a rule's two programs: values op by op, derivatives compiled once per program.

Values run eagerly, one primitive at a time, as the program runs outside ``jit`` (XLA's simplifier could
hide a rule's error under ``jit``). Derivatives are new programs on both sides, compiled once per case and
reused for every example: under ``jit``, or, for programs that compute a 16-bit float, traced once and run
op by op (:func:`_op_by_op`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..ir.jaxapi import core
from ._strategies import _is_complex, _is_float


def _evaluate(closed: core.ClosedJaxpr, args: Sequence[Any]) -> list[np.ndarray]:
    """Run a jaxpr eagerly, one primitive at a time, as the program itself would run outside jit."""
    return [np.asarray(o) for o in core.eval_jaxpr(closed.jaxpr, closed.consts, *args)]


def _differentiable(dtype: Any) -> bool:
    return _is_float(dtype) or _is_complex(dtype)


def _at(closed: core.ClosedJaxpr, idx: Sequence[int], others: Sequence[Any]) -> Callable[..., list[Any]]:
    """``closed`` run as a function of its inputs at ``idx``, the rest fixed at ``others``."""
    def at(*xs: Any) -> list[Any]:
        full, it, rest = [], iter(xs), iter(others)
        for i in range(len(closed.in_avals)):
            full.append(next(it) if i in idx else next(rest))
        return core.eval_jaxpr(closed.jaxpr, closed.consts, *full)
    return at


def _op_by_op(fn: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``fn`` traced once at ``args``' shapes and run eagerly, one primitive at a time, as the values are.

    Under jit XLA may compute a bf16 product cast up to f32 in f32 in one program and not in the other (1.13
    against 1.63 on the attention pack's reverse mode; ``xla_allow_excess_precision=False`` did not stop it);
    eagerly each primitive rounds as written. Traced once, a loop's derivative keeps its identity between
    examples, so its compiled body is reused where a fresh ``jax.vjp`` compiled it anew every example.
    """
    closed = jax.make_jaxpr(fn)(*args)
    tree = jax.tree_util.tree_structure(jax.eval_shape(fn, *args))

    def run(*xs: Any) -> Any:
        flat = jax.tree_util.tree_leaves(xs)
        return jax.tree_util.tree_unflatten(tree, core.eval_jaxpr(closed.jaxpr, closed.consts, *flat))
    return run


def _derivative(closed: core.ClosedJaxpr, mode: str, fn: Callable[..., Any], eager: bool,
                args: tuple) -> list[np.ndarray]:
    """``fn(*args)``, compiled once per program and mode: under jit, or traced once and run op by op
    (``_op_by_op``) where ``eager`` (a program that computes a 16-bit float)."""
    key = (id(closed), jax.config.jax_enable_x64, mode, eager)
    if key not in _JVPS:
        _JVPS[key] = (closed, None, _op_by_op(fn, *args) if eager else jax.jit(fn))
    return [np.asarray(t) for t in _JVPS[key][2](*args)]


def _tangents(closed: core.ClosedJaxpr, args: Sequence[Any], tangents: Sequence[Any],
              eager: bool = False) -> list[np.ndarray]:
    """The output tangents of ``closed`` at ``args`` along ``tangents`` of its float inputs (``jax.jvp``),
    under jit or op by op where ``eager`` (``_derivative``)."""
    idx = [i for i, a in enumerate(closed.in_avals) if _differentiable(a.dtype)]

    def jvp(primals: list[Any], tans: list[Any], others: list[Any]) -> Any:
        return jax.jvp(_at(closed, idx, others), primals, tans)[1]

    return _derivative(closed, "jvp", jvp, eager, (
        [jnp.asarray(args[i]) for i in idx], [jnp.asarray(tangents[i]) for i in idx],
        [jnp.asarray(a) for i, a in enumerate(args) if i not in idx]))


def _cotangents(closed: core.ClosedJaxpr, args: Sequence[Any], cotangents: Sequence[Any],
                eager: bool = False) -> list[np.ndarray]:
    """The cotangents of ``closed``'s float inputs at ``args`` for ``cotangents`` of its float outputs (reverse
    mode, which a replacement with its own backward defines), under jit or op by op where ``eager``."""
    idx = [i for i, a in enumerate(closed.in_avals) if _differentiable(a.dtype)]
    outs = [i for i, a in enumerate(closed.out_avals) if _differentiable(a.dtype)]

    def vjp(primals: list[Any], cts: list[Any], others: list[Any]) -> Any:
        run = _at(closed, idx, others)
        return jax.vjp(lambda *xs: [run(*xs)[i] for i in outs], *primals)[1](cts)

    return _derivative(closed, "vjp", vjp, eager, (
        [jnp.asarray(args[i]) for i in idx], [jnp.asarray(cotangents[i]) for i in outs],
        [jnp.asarray(a) for i, a in enumerate(args) if i not in idx]))


#: Compiled JVPs by program (the program is kept alive beside its entry, so its id is not reused).
_JVPS: dict[tuple, tuple[Any, Any, Any]] = {}
