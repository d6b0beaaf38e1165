"""One walk over a chosen program, and one definition of an e-node's children.

An e-node is ``(ctor, args)``: its arguments are e-classes (of the sorts
``Term``, ``TList``, ``Region``, ``BList``) and ``i64`` ids. Every stage that
follows a program from its roots (extraction, emission, the fusion model, the
VJP split, the report) reads it through the functions here:

* :func:`children`: the node's e-class arguments, in constructor order. A
  list of operands (``TList``) and a body (``Region``) are classes of their
  own and are *not* expanded: this is the e-graph's view, in which a list is
  chosen like any other class. Extraction and reachability use it.
* :func:`term_children`: the same without bodies: what the node reads in its
  own scope (a body runs in a scope of its own). Extraction's searches use it.
* :func:`operands`: what the emitted equation reads: ``Term`` arguments, and
  the members of each list spelled out (bodies excluded). Emission, the
  fusion model and the VJP split use it.

:func:`walk` visits each class reachable from the roots once, depth first
(the order every caller relies on: a root's last child first), and
:func:`postorder` visits each after everything it reads, which is the order
equations are emitted in.
"""

from __future__ import annotations

from typing import Any, Callable, Container, Iterable, Iterator, Sequence

import jax.numpy as jnp

from . import terms as _terms
from .jaxapi import ad, core
from .primitives import inner_jaxpr

Node = tuple  # (ctor, args)


class CycleError(RuntimeError):
    """The chosen program reads a class through itself."""


def children(node: Node) -> list[Any]:
    """The e-class arguments of ``node`` (lists and bodies as classes of their own), in order."""
    ctor, args = node
    return [a for s, a in zip(_terms.ctor_arg_sorts(ctor), args) if s != "i64"]


def term_children(node: Node) -> list[Any]:
    """The ``Term`` and ``TList`` arguments of ``node``: its children in its own scope (bodies left out)."""
    ctor, args = node
    return [a for s, a in zip(_terms.ctor_arg_sorts(ctor), args) if s == "Term" or s == "TList"]


def operands(snap: Any, node: Node) -> list[Any]:
    """The term classes ``node`` reads, list members spelled out (bodies are not read)."""
    ctor, args = node
    out: list[Any] = []
    for s, a in zip(_terms.ctor_arg_sorts(ctor), args):
        if s == "Term":
            out.append(a)
        elif s == "TList":
            out.extend(snap.list_items(a))
    return out


def walk(roots: Iterable[Any], kids: Callable[[Any], Iterable[Any]]) -> Iterator[Any]:
    """Each class reachable from ``roots`` through ``kids``, once, depth first.

    A class is yielded before its kids are asked for, so a caller can stop
    the walk early, and ``kids`` can return nothing to stop it at a class.

    >>> g = {"a": ["b", "c"], "b": ["c"], "c": []}
    >>> list(walk(["a"], g.__getitem__))
    ['a', 'c', 'b']
    """
    seen: set[Any] = set()
    stack = list(roots)
    pop, push, add = stack.pop, stack.extend, seen.add
    while stack:
        c = pop()
        if c in seen:
            continue
        add(c)
        yield c
        push(kids(c))


def postorder(roots: Sequence[Any], kids: Callable[[Any], Sequence[Any]],
              done: Container[Any] = frozenset()) -> Iterator[Any]:
    """Each class reachable from ``roots``, after every class it reads; classes in ``done`` (which the
    caller may fill as it goes) are skipped. Raises :class:`CycleError` on a cycle.

    >>> g = {"a": ["b", "c"], "b": ["c"], "c": []}
    >>> list(postorder(["a"], g.__getitem__))
    ['c', 'b', 'a']
    """
    finished: set[Any] = set()
    on_path: set[Any] = set()
    stack: list[tuple[Any, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        c, after = stack.pop()
        if c in finished or c in done:
            continue
        if after:
            on_path.discard(c)
            finished.add(c)
            yield c
            continue
        if c in on_path:
            raise CycleError("the chosen program has a cycle")
        on_path.add(c)
        stack.append((c, True))
        for k in reversed(kids(c)):
            if k not in finished and k not in done:
                stack.append((k, False))


def postorder_list(roots: Sequence[Any], kids: Callable[[Any], Iterable[Any]]) -> list[Any]:
    """``list(postorder(roots, kids))``, the same classes in the same order (each after every class it reads, a
    root's first child's first), made without a generator: ``Program.from_choice`` builds every program a price
    reads so, and reads the whole walk. Each class's children are read once, from one iterator kept on the path, not
    pushed all at once. Raises :class:`CycleError` on a cycle, as :func:`postorder` does.

    >>> g = {"a": ["b", "c"], "b": ["c"], "c": []}
    >>> postorder_list(["a"], g.__getitem__)
    ['c', 'b', 'a']
    """
    finished: set[Any] = set()
    on_path: set[Any] = set()
    out: list[Any] = []
    done, enter, leave, emit = finished.add, on_path.add, on_path.discard, out.append
    for r in roots:
        if r in finished:
            continue
        enter(r)
        path = [(r, iter(kids(r)))]
        push, pop = path.append, path.pop
        while path:
            c, rest = path[-1]
            for k in rest:
                if k not in finished:
                    if k in on_path:
                        raise CycleError("the chosen program has a cycle")
                    enter(k)
                    push((k, iter(kids(k))))
                    break
            else:
                pop()
                leave(c)
                done(c)
                emit(c)
    return out


def _any_eqn(jaxpr: Any, pred: Callable[[Any], bool]) -> bool:
    """Whether ``pred`` holds of an equation of ``jaxpr`` or of a call-like body in it (``inner_jaxpr``)."""
    for e in jaxpr.eqns:
        if pred(e):
            return True
        inner = inner_jaxpr(e.params)
        if inner is not None and _any_eqn(inner, pred):
            return True
    return False


def _has_jvp(prim: Any) -> bool:
    return prim in ad.primitive_jvps or prim in ad.primitive_linearizations


def _without_jvp(jaxpr: Any) -> set[str]:
    """The names of what JAX cannot differentiate in forward mode in ``jaxpr`` or a body in it: a ``jax.custom_vjp``
    call, and a primitive with no body of its own and no JVP rule (cuDNN's fused attention, say). A
    ``jax.custom_jvp``'s body is not read: its rule differentiates it."""
    found: set[str] = set()

    def walk(j: Any) -> None:
        for e in j.eqns:
            inner = inner_jaxpr(e.params)
            if e.primitive.name == "custom_vjp_call" or (inner is None and not _has_jvp(e.primitive)):
                found.add(e.primitive.name)
            elif inner is not None and e.primitive.name != "custom_jvp_call":
                walk(inner)

    try:
        walk(jaxpr)
    finally:
        del walk  # a recursive closure is a reference cycle
    return found


def loses_forward_mode(before: Any, *after: Any) -> bool:
    """Whether the jaxprs ``after`` (a rewrite of ``before``) hold something JAX cannot differentiate in forward mode
    that ``before`` does not: a backward of their own (``jax.custom_vjp``), a primitive with no JVP rule. Forward
    mode then differentiates ``before`` (``rewrite.grad.primitive.Signature.jvp_source``)."""
    return bool(set().union(*map(_without_jvp, after)) - _without_jvp(before))


def computes_half_precision(jaxpr: Any) -> bool:
    """Whether ``jaxpr``, or a body in it, computes a 16-bit float (bfloat16 or float16)."""
    return _any_eqn(jaxpr, lambda e: any(getattr(v.aval, "dtype", None) in (jnp.bfloat16, jnp.float16)
                                         for v in e.outvars))


def any_value(jaxpr: Any, pred: Callable[[Any], bool]) -> bool:
    """Whether ``pred`` holds of the type of a constant, an input or an equation's output of ``jaxpr`` (closed or
    not) or of any body in it (every value a jaxpr holds is one of those)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    if any(pred(v.aval) for v in (*jaxpr.constvars, *jaxpr.invars)):
        return True
    return any(any(pred(v.aval) for v in e.outvars) or any(any_value(b, pred) for b in core.jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


def holds_high_values(jaxpr: Any) -> bool:
    """Does ``jaxpr``, or a body in it, hold a value of a hijax type (a ``Box``, a user's ``HiType``), whose terms
    would not be arrays? A hijax primitive of arrays (``call_hi_primitive`` of ``jnp.searchsorted``) holds none: it
    is loaded as any primitive is. JAX marks both high (``Jaxpr.is_high``), and a plain program neither."""
    return jaxpr.is_high and any_value(jaxpr, lambda a: getattr(a, "is_high", False))
