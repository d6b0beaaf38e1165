"""The magnitude of the terms a program sums: the scale that a reordering's rounding error is relative to.

Reordering a sum (``(A B) C`` against ``A (B C)``, a blocked product, a
distributed factor) moves each element of the result by a few roundings of
its largest partial sums, which are bounded by the sum of the magnitudes of
its terms, ``|A| |B|`` for a product, not by the result itself: a product whose
terms cancel to ``1e-3`` is still off by ``eps * |A| |B|``. :func:`magnitudes`
computes that bound in float64 by running a program's jaxpr with every value
paired with its magnitude: a sum adds its operands' magnitudes whatever their
signs (``a - b`` has magnitude ``|a| + |b|``), a product, a contraction, a
reduction and a change of layout act on the magnitudes as on the values, and
any other operation gives the magnitude of its own result. For a program built
of products and sums, such as every program of ``rulesets.linalg``, that is
the program run on the absolute values of its inputs with every subtraction
made an addition.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import lax

from ..ir.jaxapi import core
from ._strategies import _is_float

#: Operations that act on magnitudes as on values: the bound of each element of the result is the same
#: operation of its operands' bounds (integer operands, indices and predicates, are read as values).
_ALIKE = frozenset({"mul", "dot_general", "reduce_sum", "cumsum", "transpose", "reshape", "broadcast_in_dim",
                    "squeeze", "expand_dims", "slice", "dynamic_slice", "dynamic_update_slice", "concatenate",
                    "pad", "rev", "gather", "select_n", "convert_element_type", "copy", "copy_p",
                    "reduce_precision", "integer_pow", "square", "max", "min", "reduce_max", "reduce_min"})

#: Sums: the magnitudes add, whatever the operation does to the signs.
_SUMS = frozenset({"add", "sub", "add_any"})

#: Operations whose result has the magnitude of their operand.
_SAME = frozenset({"neg", "abs"})

#: Calls whose body is one jaxpr, run in place (the param that holds it).
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "remat": "jaxpr",
          "checkpoint": "jaxpr"}


def _inexact(x: Any) -> bool:
    return hasattr(x, "dtype") and _is_float(np.dtype(x.dtype))


def _bind(eqn: Any, args: Sequence[Any]) -> list[Any]:
    out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def interpret(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], step: Callable[[Any, list[Any]], list[Any]],
              literal: Callable[[Any], Any] = lambda x: x) -> list[Any]:
    """``jaxpr`` run by ``step(eqn, inputs) -> outputs`` on whatever its values are here (``literal`` makes one of
    a literal's value); ``consts`` and ``args`` are such values already."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return literal(v.val) if isinstance(v, core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, step(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in jaxpr.outvars]


def _paired(x: Any) -> tuple[Any, Any]:
    return x, (abs(x) if _inexact(np.asarray(x)) else None)


def _run(jaxpr: Any, consts: Sequence[Any], args: Sequence[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """``jaxpr`` on (value, magnitude) pairs; a magnitude is ``None`` for a value that is not a float."""
    return interpret(jaxpr, [(c, abs(c) if _inexact(c) else None) for c in consts], args, _step, _paired)


def _step(eqn: Any, ins: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    name = eqn.primitive.name
    if name == "cond":
        branch = eqn.params["branches"][int(ins[0][0])]
        return _run(branch.jaxpr, branch.consts, ins[1:])
    body = eqn.params.get(_CALLS.get(name, ""), None)
    if body is not None:
        inner = getattr(body, "jaxpr", body)
        return _run(inner, getattr(body, "consts", ()), ins)
    values = _bind(eqn, [v for v, _ in ins])
    if name in _SUMS:
        mags = [lax.add(*[m if m is not None else abs(v) for v, m in ins])]
    elif name in _SAME:
        mags = [ins[0][1]]
    elif name == "div":
        with np.errstate(divide="ignore", invalid="ignore"):  # a non-finite bound acquits nothing
            mags = [ins[0][1] / abs(ins[1][0])] if ins[0][1] is not None else [None]
    elif name in _ALIKE:
        mags = _bind(eqn, [m if m is not None else v for v, m in ins])
    else:
        mags = [abs(v) if _inexact(v) else None for v in values]
    return [(v, m if _inexact(v) and m is not None else (abs(v) if _inexact(v) else None))
            for v, m in zip(values, mags)]


def _run_from(closed: Any, wide: Sequence[Any], floor: float) -> list[Any]:
    start = [(a, np.maximum(abs(a), floor) if _inexact(a) else None) for a in wide]
    return [None if m is None else np.asarray(m, np.float64) for _, m in _run(closed.jaxpr, closed.consts, start)]


def magnitudes(fn: Callable[..., Any], args: Sequence[Any]) -> list[Any] | None:
    """Per output of ``fn`` at ``args`` (arrays, widened to float64 here): the magnitude of the terms summed
    into each element, and the same with every input's magnitude at least 1 (how much a result below the
    smallest normal number, flushed to zero, can grow by the time it reaches the output, for a program of
    products and sums; a division by a small number grows it more); a pair of float64 arrays, ``None``
    for an output that is not a float, or ``None`` where it cannot be computed.

    >>> import numpy as np
    >>> a, b = np.float32([[1.0, -1.0]]), np.float32([[1.0], [0.999]])   # 1 - 0.999: the terms cancel
    >>> round(float(magnitudes(lambda a, b: a @ b, [a, b])[0][0][0, 0]), 6)            # |1| |1| + |-1| |0.999|
    1.999
    >>> round(float(magnitudes(lambda a, b: a @ b - a @ b, [a, b])[0][0][0, 0]), 6)     # a difference adds its terms
    3.998
    """
    try:
        with jax.enable_x64(True):
            wide = [np.asarray(a).astype(np.float64) if _inexact(a) else np.asarray(a) for a in args]
            closed = jax.make_jaxpr(fn)(*wide)
            terms, grown = _run_from(closed, wide, 0.0), _run_from(closed, wide, 1.0)
    except Exception:
        return None
    return [None if m is None else (m, u) for m, u in zip(terms, grown)]


def _moving(fn: Callable[..., Any], primals: Sequence[Any], idx: Sequence[int]) -> Callable[..., Any]:
    """``fn`` as a function of the inputs at ``idx``, the others fixed at ``primals``."""
    def at(*moved: Any) -> Any:
        full = list(primals)
        for i, x in zip(idx, moved):
            full[i] = x
        return fn(*full)
    return at


def jvp_magnitudes(fn: Callable[..., Any], args: Sequence[Any], tangents: Sequence[Any]) -> list[Any] | None:
    """:func:`magnitudes` of ``fn``'s forward-mode derivative at ``args`` along ``tangents`` (``None`` for
    an input that has none): the derivative program's own terms, primals and tangents both its inputs."""
    idx = [i for i, t in enumerate(tangents) if t is not None]
    n = len(args)

    def derivative(*xs: Any) -> Any:
        primals = list(xs[:n])
        return jax.jvp(_moving(fn, primals, idx), [primals[i] for i in idx], list(xs[n:]))[1]

    return magnitudes(derivative, list(args) + [tangents[i] for i in idx])


def vjp_magnitudes(fn: Callable[..., Any], args: Sequence[Any], cotangents: Sequence[Any]) -> list[Any] | None:
    """:func:`magnitudes` of ``fn``'s reverse-mode derivative at ``args`` for ``cotangents`` of its float outputs
    (one per output leaf, ``None`` for an output that is not a float): per float input, the terms summed into
    its cotangent, primals and cotangents both inputs of the derivative program."""
    idx = [i for i, a in enumerate(args) if _inexact(np.asarray(a))]
    outs = [i for i, c in enumerate(cotangents) if c is not None]
    n = len(args)

    def floats(*xs: Any) -> list[Any]:
        leaves = jax.tree_util.tree_leaves(fn(*xs))
        return [leaves[i] for i in outs]

    def derivative(*xs: Any) -> Any:
        primals = list(xs[:n])
        return jax.vjp(_moving(floats, primals, idx), *[primals[i] for i in idx])[1](list(xs[n:]))

    return magnitudes(derivative, list(args) + [cotangents[i] for i in outs])


def flat(fn: Callable[..., Any], args: Any, traced: Callable[[Any], bool]) -> tuple[Callable[..., Any], list[Any]]:
    """``fn`` of a pytree of ``args`` as a function of its leaves that ``traced`` picks (the rest stay
    fixed), returning its output's leaves; and those leaves."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    idx = [i for i, x in enumerate(leaves) if traced(x)]

    def g(*xs: Any) -> list[Any]:
        full = list(leaves)
        for i, x in zip(idx, xs):
            full[i] = x
        return jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(tree, full)))

    return g, [leaves[i] for i in idx]
