"""Running a rule's two programs: values op by op, derivatives compiled once per program.

Values run eagerly, one primitive at a time, as the program runs outside ``jit`` (XLA's simplifier could
hide a rule's error under ``jit``). Derivatives are new programs on both sides, compiled once per case and
reused for every example: under ``jit`` (the original and the rewrite in one executable, :func:`_both`), or,
for programs that compute a 16-bit float, traced once and run op by op (:func:`_op_by_op`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..ir.jaxapi import core, scan_counts
from ._magnitude import _CALLS, _bind, interpret
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


def _op_by_op(fn: Callable[..., Any], args: tuple, written: bool = False) -> Callable[..., Any]:
    """``fn`` traced once at ``args``' shapes and run eagerly, one primitive at a time, as the values are.

    Under jit XLA may compute a bf16 product cast up to f32 in f32 in one program and not in the other (1.13
    against 1.63 on the attention pack's reverse mode; ``xla_allow_excess_precision=False`` did not stop it);
    eagerly each primitive rounds as written. Traced once, a loop's derivative keeps its identity between
    examples, so its compiled body is reused where a fresh ``jax.vjp`` compiled it anew every example.
    ``written``: loops and calls run op by op too (:func:`as_written`).
    """
    closed = jax.make_jaxpr(fn)(*args)
    tree = jax.tree_util.tree_structure(jax.eval_shape(fn, *args))

    def run(*xs: Any) -> Any:
        flat = jax.tree_util.tree_leaves(xs)
        out = (_run_written(closed.jaxpr, closed.consts, flat) if written
               else core.eval_jaxpr(closed.jaxpr, closed.consts, *flat))
        return jax.tree_util.tree_unflatten(tree, out)
    return run


def _derivative(closed: core.ClosedJaxpr, mode: str, fn: Callable[..., Any], how: str,
                args: tuple) -> list[np.ndarray]:
    """``fn(*args)``, compiled once per program and mode, ``how``: ``"jit"``, ``"op"`` (traced once and run op
    by op, ``_op_by_op``: for a program that computes a 16-bit float) or ``"written"`` (loops too)."""
    run = _compiled((id(closed), jax.config.jax_enable_x64, mode, how), closed,
                    lambda: jax.jit(fn) if how == "jit" else _op_by_op(fn, args, how == "written"))
    return [np.asarray(t) for t in run(*args)]


def _compiled(key: tuple, kept: Any, build: Callable[[], Any]) -> Any:
    """The function ``_JVPS`` holds for ``key`` (``build()`` on a miss), now the most recently used; ``kept``
    (the programs the key names by id) stays alive beside it."""
    entry = _JVPS.pop(key, None)
    if entry is None:
        entry = (kept, build())
        while len(_JVPS) >= _JVPS_KEPT:
            del _JVPS[next(iter(_JVPS))]  # the least recently used
    _JVPS[key] = entry  # last: the most recently used
    return entry[1]


def _jvp(closed: core.ClosedJaxpr, args: Sequence[Any], tangents: Sequence[Any]) -> tuple[Callable[..., Any], tuple]:
    """``jax.jvp``'s output tangents of ``closed`` as a function of (float inputs, their tangents, the other
    inputs), and those arguments at ``args`` along ``tangents``."""
    idx = [i for i, a in enumerate(closed.in_avals) if _differentiable(a.dtype)]

    def jvp(primals: list[Any], tans: list[Any], others: list[Any]) -> Any:
        return jax.jvp(_at(closed, idx, others), primals, tans)[1]

    return jvp, ([jnp.asarray(args[i]) for i in idx], [jnp.asarray(tangents[i]) for i in idx],
                 [jnp.asarray(a) for i, a in enumerate(args) if i not in idx])


def _vjp(closed: core.ClosedJaxpr, args: Sequence[Any], cotangents: Sequence[Any]
         ) -> tuple[Callable[..., Any], tuple]:
    """``jax.vjp``'s input cotangents of ``closed`` as a function of (float inputs, float outputs' cotangents,
    the other inputs), and those arguments at ``args`` for ``cotangents``."""
    idx = [i for i, a in enumerate(closed.in_avals) if _differentiable(a.dtype)]
    outs = [i for i, a in enumerate(closed.out_avals) if _differentiable(a.dtype)]

    def vjp(primals: list[Any], cts: list[Any], others: list[Any]) -> Any:
        run = _at(closed, idx, others)
        return jax.vjp(lambda *xs: [run(*xs)[i] for i in outs], *primals)[1](cts)

    return vjp, ([jnp.asarray(args[i]) for i in idx], [jnp.asarray(cotangents[i]) for i in outs],
                 [jnp.asarray(a) for i, a in enumerate(args) if i not in idx])


def _tangents(closed: core.ClosedJaxpr, args: Sequence[Any], tangents: Sequence[Any],
              how: str = "jit") -> list[np.ndarray]:
    """The output tangents of ``closed`` at ``args`` along ``tangents`` of its float inputs (``jax.jvp``),
    run ``how`` :func:`_derivative` says."""
    fn, xs = _jvp(closed, args, tangents)
    return _derivative(closed, "jvp", fn, how, xs)


def _cotangents(closed: core.ClosedJaxpr, args: Sequence[Any], cotangents: Sequence[Any],
                how: str = "jit") -> list[np.ndarray]:
    """The cotangents of ``closed``'s float inputs at ``args`` for ``cotangents`` of its float outputs (reverse
    mode, which a replacement with its own backward defines), run ``how`` :func:`_derivative` says."""
    fn, xs = _vjp(closed, args, cotangents)
    return _derivative(closed, "vjp", fn, how, xs)


def _both(before: core.ClosedJaxpr, after: core.ClosedJaxpr, mode: str, args: Sequence[Any],
          directions: Sequence[Any], group: Sequence[tuple[Any, Any, str]] = ()
          ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """:func:`_tangents` (``mode`` ``"jvp"``) or :func:`_cotangents` (``"vjp"``) of a program and its rewrite
    (the same inputs and outputs) under ``jit``, from one executable for the two, or for every
    ``(before, after, mode)`` of ``group`` (the rule's other cases, run at zeros), compiled once.

    A small program's compile is mostly XLA's fixed cost: one executable for both sides compiles in about
    0.6 of the time of two, one for a rule's cases in about half (the algebra pack's 108 cases: 8.0 CPU s one
    per side, 4.7 one per case, 3.9 one per rule). Each side computes what it computes on its own: each takes
    its inputs as parameters of its own, so XLA neither merges work common to two nor fuses across them (with
    shared parameters 6 of the packs' 3,497 pairs differed by an ulp; apart, every one is bitwise what its own
    executable gives).
    Where the group cannot be compiled together (a case that cannot be differentiated), the pair alone is.
    """
    group = list(group) or [(before, after, mode)]
    k = next(i for i, (b, a, _) in enumerate(group) if b is before and a is after)
    key = (tuple((id(b), id(a), m) for b, a, m in group), jax.config.jax_enable_x64, "both")

    def build() -> tuple[Any, list[Any]]:
        fns, zeros = [], []
        for b, a, m in group:
            make = _jvp if m == "jvp" else _vjp
            at = [np.zeros(v.shape, v.dtype) for v in b.in_avals]
            along = [np.zeros(v.shape, v.dtype) for v in (b.in_avals if m == "jvp" else b.out_avals)]
            fb, xs = make(b, at, along)
            fns.append((fb, make(a, at, along)[0]))
            zeros.append(xs)
        return jax.jit(lambda xs: [(fb(*xb), fa(*xa)) for (fb, fa), (xb, xa) in zip(fns, xs)]), zeros

    entry = _compiled(key, group, build)
    if entry is _APART:  # this group failed to compile together before: the pair alone
        return _both(before, after, mode, args, directions)
    run, zeros = entry
    xs = (_jvp if mode == "jvp" else _vjp)(before, args, directions)[1]
    try:
        want, got = run([(xs, xs) if i == k else (z, z) for i, z in enumerate(zeros)])[k]
    except Exception:
        if len(group) == 1:
            raise
        _JVPS[key] = (group, _APART)  # not together: each pair on its own from now on
        return _both(before, after, mode, args, directions)
    return [np.asarray(t) for t in want], [np.asarray(t) for t in got]


#: What ``_JVPS`` holds for a group of cases that cannot be compiled together (:func:`_both`).
_APART = object()


#: Compiled derivatives by program, least recently used first (the program is kept alive beside its entry, so
#: its id is not reused while the entry lives). Bounded: a rule checked with its inputs as constants makes a
#: program per example, and a long run would otherwise keep every one and its executable.
_JVPS: dict[tuple, tuple[Any, Any]] = {}

#: How many compiled derivatives ``_JVPS`` keeps.
_JVPS_KEPT = 256


def as_written(closed: core.ClosedJaxpr, args: Sequence[Any]) -> list[np.ndarray]:
    """``closed`` at ``args`` with every operation rounded as written: one primitive at a time, loops and calls
    included (a ``scan``'s or ``while``'s body run step by step, a branch or a call's body in place).

    Compiled, XLA:CPU contracts a product and a sum into one fused multiply-add, which rounds once: in
    float32, ``a * b + c * d`` is 8.6e37 under ``jit`` where the product ``a * b`` alone overflows to inf.
    Which product a fusion keeps unrounded depends on the fusion, so a rewrite that moves work into a loop
    can overflow where the original did not, or the reverse, with neither program changed in value as
    written. Outside loops the values already run op by op; a loop's body is compiled whole. Run on a
    mismatch only: it dispatches every operation of every step.

    >>> import jax, numpy as np
    >>> def loop(a, b, c, d):  # one step: a * b + c * d, where a * b alone overflows float32
    ...     return jax.lax.scan(lambda s, x: (s + (x[0] * x[1] + x[2] * x[3]), None), a[0] * 0, (a, b, c, d))[0]
    >>> args = [np.full((3, 4), v, np.float32) for v in (-93841.06, -3.6623268e33, 123.39553, -2.0850995e36)]
    >>> closed = jax.make_jaxpr(loop)(*args)
    >>> as_written(closed, args)[0].tolist()  # jax.jit(loop)(*args) is 2.87e38 where XLA fuses a * b + c * d
    [inf, inf, inf, inf]
    """
    return [np.asarray(o) for o in _run_written(closed.jaxpr, closed.consts, args)]


def _run_written(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    return interpret(jaxpr, consts, args, _written_step)


def _written_step(eqn: Any, ins: list[Any]) -> list[Any]:
    name, p = eqn.primitive.name, eqn.params
    if name == "scan":
        body, (nc, ncarry) = p["jaxpr"], scan_counts(p)
        consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        steps = range(p["length"] - 1, -1, -1) if p["reverse"] else range(p["length"])
        ys: dict[int, list[Any]] = {}
        for i in steps:
            out = _run_written(body.jaxpr, body.consts, [*consts, *carry, *[x[i] for x in xs]])
            carry, ys[i] = out[:ncarry], out[ncarry:]
        n = p["length"]
        stacked = [jnp.stack([ys[i][k] for i in range(n)]) if n else jnp.zeros(v.aval.shape, v.aval.dtype)
                   for k, v in enumerate(eqn.outvars[ncarry:])]
        return [*carry, *stacked]
    if name == "while":
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]
        cc, bc = ins[:p["cond_nconsts"]], ins[p["cond_nconsts"]:p["cond_nconsts"] + p["body_nconsts"]]
        carry = ins[p["cond_nconsts"] + p["body_nconsts"]:]
        while bool(_run_written(cond.jaxpr, cond.consts, [*cc, *carry])[0]):
            carry = _run_written(body.jaxpr, body.consts, [*bc, *carry])
        return list(carry)
    if name == "cond":
        branches = p["branches"]
        branch = branches[min(max(int(ins[0]), 0), len(branches) - 1)]
        return _run_written(branch.jaxpr, branch.consts, ins[1:])
    body = p.get(_CALLS.get(name, ""), None)
    if body is not None:
        return _run_written(getattr(body, "jaxpr", body), getattr(body, "consts", ()), ins)
    return _bind(eqn, ins)
