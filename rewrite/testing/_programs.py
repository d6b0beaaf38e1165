"""Random JAX programs for fuzz tests: the :func:`programs` strategy and the :class:`RandomProgram` it draws.

A program is a list of operations over a growing pool of float values, each
operation drawn from what the rewriter supports: elementwise primitives and
literals, broadcasting, reductions, ``dot_general``, transposes, ``where``,
compositions that the built-in packs rewrite (``log(1 + x)``, ``(x @ x.T) @ x``),
and a ``scan`` and a ``cond`` with small random bodies. It is data, so
hypothesis shrinks a failing program to a short one, and its ``repr`` reads
as a listing. :mod:`rewrite.testing` re-exports both names; the checks there
run these programs against their rewrites.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax

# In the order draws favour, and shrink towards: the operations rules most often mention first.
_UNARY: dict[str, Callable[[Any], Any]] = {
    "sin": lax.sin, "exp": lax.exp, "log": lax.log, "neg": lax.neg, "tanh": lax.tanh, "abs": lax.abs,
    "sqrt": lax.sqrt, "logistic": lax.logistic, "cos": lax.cos, "square": lax.square, "rsqrt": lax.rsqrt,
    "log1p": lax.log1p, "expm1": lax.expm1, "floor": lax.floor, "sign": lax.sign,
}
_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "mul": jnp.multiply, "add": jnp.add, "sub": jnp.subtract, "div": jnp.divide,
    "max": jnp.maximum, "min": jnp.minimum, "pow": jnp.power,
}
_REDUCE: dict[str, Callable[..., Any]] = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "prod": jnp.prod}


def _mT(x: Any) -> Any:
    return jnp.swapaxes(x, -1, -2)


#: Compositions model code writes, as one operation each: the forms the built-in packs exist to rewrite
#: (``rulesets.nn``'s stable forms, ``rulesets.linalg``'s products), which independent draws of their
#: parts almost never line up. Each: (the least rank it takes, its result's shape from its operand's,
#: the function, how the listing writes it).
_IDIOMS: dict[str, tuple[int, Callable[[tuple], tuple], Callable[[Any], Any], str]] = {
    "log1p": (0, lambda s: s, lambda x: jnp.log(1.0 + x), "log(1 + {})"),
    "expm1": (0, lambda s: s, lambda x: jnp.exp(x) - 1.0, "exp({}) - 1"),
    "softplus": (0, lambda s: s, lambda x: jnp.log(1.0 + jnp.exp(x)), "log(1 + exp({}))"),
    "log_sigmoid": (0, lambda s: s, lambda x: jnp.log(lax.logistic(x)), "log(logistic({}))"),
    "logsumexp": (1, lambda s: s[:-1], lambda x: jnp.log(jnp.sum(jnp.exp(x), axis=-1)), "log(sum(exp({}), -1))"),
    "gram_chain": (2, lambda s: s, lambda x: (x @ _mT(x)) @ x, "({0} @ {0}.T) @ {0}"),
    "scaled_gram": (2, lambda s: s[:-1] + s[-2:-1], lambda x: 0.5 * (x @ _mT(x)), "0.5 * ({0} @ {0}.T)"),
    "sum_gram": (2, lambda s: s[:-2] + s[-1:], lambda x: jnp.sum(_mT(x) @ x, axis=-2), "sum({0}.T @ {0}, -2)"),
}
#: Attention's key axis must be long enough for ``rulesets.attention`` to block it (more than 256 keys).
_KEYS = 512


def _attention(x: Any) -> Any:
    """``softmax(q k^T / 2) v`` over ``_KEYS`` keys made from ``x``'s rows (repeated), as attention code writes it."""
    rows = jnp.reshape(x, (-1, x.shape[-1]))
    k = jnp.resize(rows, (_KEYS, x.shape[-1]))
    return jax.nn.softmax((k * 0.5) @ _mT(k) / 2.0, axis=-1) @ k


_IDIOMS["attention"] = (1, lambda s: (_KEYS, s[-1]), _attention, "softmax(q k^T / 2) v over 512 rows of {}")

_LITERALS = (1.0, 0.0, 2.0, -1.0, 0.5, -0.0)
_SHAPES = ((3,), (), (2, 3), (3, 3), (2, 2, 3))
_KINDS = ("unary", "binary", "literal", "broadcast", "reduce", "dot", "transpose", "where", "scan", "cond", "idiom")
_ELEMENTWISE_KINDS = ("unary", "binary", "literal", "where")
_PAIR = ("pair",)  # the shape slot of a scan's (carry, ys) result


@dataclasses.dataclass(frozen=True)
class _Op:
    kind: str
    name: str
    args: tuple[int, ...]
    params: tuple = ()


@dataclasses.dataclass(frozen=True)
class _Body:
    """A loop or branch body: ``n_in`` inputs, operations over them, and which values it returns."""

    n_in: int
    ops: tuple[_Op, ...]
    outs: tuple[int, ...]

    def run(self, *xs: Any) -> list[Any]:
        env = list(xs)
        for op in self.ops:
            env.append(_apply(op, env))
        return [env[i] for i in self.outs]


def _apply(op: _Op, env: list[Any]) -> Any:
    a = [env[i] for i in op.args]
    k = op.kind
    if k == "unary":
        return _UNARY[op.name](a[0])
    if k == "binary":
        return _BINARY[op.name](a[0], a[1])
    if k == "literal":
        c, left = op.params
        return _BINARY[op.name](c, a[0]) if left else _BINARY[op.name](a[0], c)
    if k == "broadcast":
        return jnp.broadcast_to(a[0], op.params)
    if k == "reduce":
        axis, keepdims = op.params
        return _REDUCE[op.name](a[0], axis=axis, keepdims=keepdims)
    if k == "dot":
        ax, bx = op.params
        return jnp.tensordot(a[0], a[1], axes=([ax], [bx]))
    if k == "transpose":
        return jnp.swapaxes(a[0], -1, -2)
    if k == "idiom":
        return _IDIOMS[op.name][2](a[0])
    if k == "where":
        return jnp.where(a[0] > 0, a[0], a[1])
    if k == "take0":
        return a[0][0]
    if k == "scan":
        body, reverse = op.params
        extra = a[2:]

        def step(c: Any, x: Any) -> Any:
            new_c, y = body.run(c, x, *extra)
            return new_c, y

        return lax.scan(step, a[0], a[1], reverse=reverse)
    if k == "cond":
        yes, no = op.params
        return lax.cond(jnp.sum(a[0]) > 0, lambda v: yes.run(v)[0], lambda v: no.run(v)[0], a[1])
    if k == "proj":
        return a[0][op.params]
    raise ValueError(f"unknown operation {k!r}")


def _broadcast_shape(a: tuple, b: tuple) -> tuple | None:
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        return None


@st.composite
def _draw_ops(draw: Any, shapes: list[tuple], n_ops: int, kinds: Sequence[str], depth: int,
              idioms: Sequence[str] = tuple(_IDIOMS)) -> list[_Op]:
    """Append ``n_ops`` operations over values of ``shapes`` (extended in place); returns them."""
    ops: list[_Op] = []

    def add(op: _Op, *out: tuple) -> None:
        ops.append(op)
        shapes.extend(out)

    def values() -> list[int]:  # a scan's pair of results is only reachable through its projections
        return [j for j, t in enumerate(shapes) if t != _PAIR]

    for _ in range(n_ops):
        kind = draw(st.sampled_from(kinds))
        i = draw(st.sampled_from(values()))
        s = shapes[i]
        if kind == "unary":
            add(_Op("unary", draw(st.sampled_from(tuple(_UNARY))), (i,)), s)
        elif kind == "binary":
            partners = [j for j in values() if _broadcast_shape(s, shapes[j]) is not None
                        and len(_broadcast_shape(s, shapes[j])) <= 3]  # type: ignore[arg-type]
            j = draw(st.sampled_from(partners))
            add(_Op("binary", draw(st.sampled_from(tuple(_BINARY))), (i, j)), _broadcast_shape(s, shapes[j]))
        elif kind == "literal":
            c = draw(st.sampled_from(_LITERALS))
            add(_Op("literal", draw(st.sampled_from(tuple(_BINARY))), (i,), (c, draw(st.booleans()))), s)
        elif kind == "where":
            partners = [j for j in values() if _broadcast_shape(s, shapes[j]) == s]
            add(_Op("where", "where", (i, draw(st.sampled_from(partners)))), s)
        elif kind == "broadcast" and len(s) < 3:
            new = (draw(st.sampled_from((2, 3))),) + s
            add(_Op("broadcast", "broadcast", (i,), new), new)
        elif kind == "reduce" and s:
            axis = draw(st.one_of(st.none(), st.integers(0, len(s) - 1)))
            keep = draw(st.booleans())
            out = tuple(1 if keep and (axis is None or d == axis) else n
                        for d, n in enumerate(s) if keep or not (axis is None or d == axis))
            add(_Op("reduce", draw(st.sampled_from(tuple(_REDUCE))), (i,), (axis, keep)), out)
        elif kind == "dot" and s:
            partners = [(j, k) for j, t in enumerate(shapes) for k in range(len(t))
                        if t[k] == s[-1] and len(s) + len(t) - 2 <= 3]
            if partners:
                j, k = draw(st.sampled_from(partners))
                t = shapes[j]
                add(_Op("dot", "dot", (i, j), (len(s) - 1, k)), s[:-1] + t[:k] + t[k + 1:])
        elif kind == "idiom" and (fits := [n for n in idioms if len(s) >= _IDIOMS[n][0]]):
            name = draw(st.sampled_from(fits))
            add(_Op("idiom", name, (i,)), _IDIOMS[name][1](s))
        elif kind == "transpose" and len(s) >= 2:
            add(_Op("transpose", "transpose", (i,)), s[:-2] + (s[-1], s[-2]))
        elif kind == "scan" and s and depth == 0:
            inner = s[1:]
            inits = [j for j, t in enumerate(shapes) if t == inner]
            if inits:
                init = draw(st.sampled_from(inits))
            else:
                add(_Op("take0", "take0", (i,)), inner)
                init = len(shapes) - 1
            outer = [j for j, t in enumerate(shapes) if t in (inner, ())]
            extra = tuple(draw(st.lists(st.sampled_from(outer), max_size=1))) if outer else ()
            body_shapes = [inner, inner] + [shapes[j] for j in extra]
            body_ops = draw(_draw_ops(body_shapes, draw(st.integers(1, 3)), _ELEMENTWISE_KINDS, depth + 1))
            fits = [j for j, t in enumerate(body_shapes) if t == inner]
            body = _Body(len(extra) + 2, tuple(body_ops), (draw(st.sampled_from(fits)), draw(st.sampled_from(fits))))
            add(_Op("scan", "scan", (init, i) + extra, (body, draw(st.booleans()))), _PAIR)
            pair = len(shapes) - 1
            add(_Op("proj", "carry", (pair,), 0), inner)
            add(_Op("proj", "ys", (pair,), 1), s)
        elif kind == "cond" and depth == 0:
            branches = []
            for _ in range(2):
                body_shapes = [s]
                body_ops = draw(_draw_ops(body_shapes, draw(st.integers(1, 2)), _ELEMENTWISE_KINDS, depth + 1))
                fits = [j for j, t in enumerate(body_shapes) if t == s]
                branches.append(_Body(1, tuple(body_ops), (draw(st.sampled_from(fits)),)))
            p = draw(st.sampled_from(values()))
            add(_Op("cond", "cond", (p, i), tuple(branches)), s)
        else:  # the drawn kind does not apply to this value: a unary op keeps the program growing
            add(_Op("unary", draw(st.sampled_from(tuple(_UNARY))), (i,)), s)
    return ops


@dataclasses.dataclass(frozen=True)
class RandomProgram:
    """A random JAX program drawn by :func:`programs`. Call it like a function; ``args`` gives its inputs.

    Its ``repr`` is a listing, so a failing fuzz example reads as a program.

    >>> from hypothesis import find, settings
    >>> p = find(programs(), lambda p: len(p.ops) >= 2, settings=settings(database=None, max_examples=100))
    >>> outs = p(*p.example_args())
    >>> print(repr(p).splitlines()[0])  # doctest: +ELLIPSIS
    RandomProgram(v0: float32[...
    """

    inputs: tuple[tuple[int, ...], ...]
    dtype: Any
    ops: tuple[_Op, ...]
    outputs: tuple[int, ...]

    @property
    def __name__(self) -> str:  # noqa: D401 - for messages and rewrite's function name
        return "random_program"

    @property
    def args(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The program's inputs as ``jax.ShapeDtypeStruct`` (``assert_equivalent`` and ``inputs_like`` take them)."""
        return tuple(jax.ShapeDtypeStruct(s, self.dtype) for s in self.inputs)

    def example_args(self) -> tuple[Any, ...]:
        """Concrete inputs: evenly spaced values in [-2, 2]."""
        return tuple(jnp.linspace(-2.0, 2.0, math.prod(s) or 1, dtype=self.dtype)[: math.prod(s)].reshape(s)
                     for s in self.inputs)

    def __call__(self, *xs: Any) -> Any:
        env = list(xs)
        for op in self.ops:
            env.append(_apply(op, env))
        outs = tuple(env[i] for i in self.outputs)
        return outs[0] if len(outs) == 1 else outs

    def __repr__(self) -> str:
        dt = np.dtype(self.dtype).name
        lines = [f"RandomProgram({', '.join(f'v{i}: {dt}{list(s)}' for i, s in enumerate(self.inputs))}):"]
        lines += _listing(self.ops, len(self.inputs), "  ")
        lines.append(f"  return {', '.join(f'v{i}' for i in self.outputs)}")
        return "\n".join(lines)


def _listing(ops: Sequence[_Op], start: int, indent: str) -> list[str]:
    lines = []
    for n, op in enumerate(ops, start):
        args = ", ".join(f"v{i}" for i in op.args)
        if op.kind == "literal":
            c, left = op.params
            args = f"{c!r}, {args}" if left else f"{args}, {c!r}"
        if op.kind in ("scan", "cond"):
            bodies = [op.params[0]] if op.kind == "scan" else list(op.params)
            extra = f", reverse={op.params[1]}" if op.kind == "scan" else ""
            lines.append(f"{indent}v{n} = {op.kind}({args}{extra}):")
            for b in bodies:
                lines.append(f"{indent}    body({', '.join(f'v{i}' for i in range(b.n_in))}):")
                lines += _listing(b.ops, b.n_in, indent + "      ")
                lines.append(f"{indent}      return {', '.join(f'v{i}' for i in b.outs)}")
            continue
        if op.kind == "where":
            args = f"v{op.args[0]} > 0, v{op.args[0]}, v{op.args[1]}"
        params = "" if op.kind in ("unary", "binary", "literal", "where", "transpose", "take0", "dot") \
            else f", {op.params!r}"
        if op.kind == "proj":
            lines.append(f"{indent}v{n} = v{op.args[0]}.{op.name}")
            continue
        if op.kind == "idiom":
            lines.append(f"{indent}v{n} = {_IDIOMS[op.name][3].format(args)}")
            continue
        lines.append(f"{indent}v{n} = {op.name}({args}{params})")
    return lines


@st.composite
def programs(draw: Any, max_ops: int = 6, max_inputs: int = 3, dtype: Any = np.float32,
             control_flow: bool = True, idioms: Sequence[str] | None = None) -> RandomProgram:
    """Random JAX programs over float inputs, for fuzz tests; they shrink to short programs.

    Operations: elementwise unary and binary primitives (``sin``, ``exp``,
    ``div``, ``pow``, ...), operations with a literal (``x * 2.0``),
    implicit and explicit broadcasting, reductions over one axis or all,
    ``dot_general`` (``tensordot``), transposes, ``where`` (comparison and
    ``select_n``), compositions model code writes as one operation each
    (``log(1 + x)``, ``log(sum(exp(x), -1))``, ``(x @ x.T) @ x``, ...: the
    forms the built-in packs rewrite), and with ``control_flow`` a ``scan``
    over a value's leading axis and a ``cond``, each with a small random
    body. The program returns every value nothing else uses. ``idioms``
    restricts the compositions drawn to those names (``_IDIOMS``; all by
    default), for a test of a pack that rewrites only some of them.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10, deadline=None)
    ... @given(programs(max_ops=4))
    ... def runs(p):
    ...     out = p(*p.example_args())
    >>> runs()
    """
    n_in = draw(st.integers(1, max_inputs))
    shapes: list[tuple] = [draw(st.sampled_from(_SHAPES)) for _ in range(n_in)]
    kinds = _KINDS if control_flow else tuple(k for k in _KINDS if k not in ("scan", "cond"))
    unknown = set(idioms or ()) - set(_IDIOMS)
    if unknown:
        raise ValueError(f"programs(idioms=...): no composition named {sorted(unknown)}; known: {sorted(_IDIOMS)}")
    ops = draw(_draw_ops(shapes, draw(st.integers(1, max_ops)), kinds, 0, tuple(idioms or _IDIOMS)))
    used = {i for op in ops for i in op.args}
    outputs = tuple(i for i, s in enumerate(shapes) if i not in used and s != _PAIR and i >= n_in)
    return RandomProgram(tuple(shapes[:n_in]), np.dtype(dtype), tuple(ops), outputs or (len(shapes) - 1,))
