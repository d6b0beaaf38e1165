"""Reading a choice (one node per e-class) back: what it reaches, and a slice of it as a function.

:func:`reachable` is every class a chosen program uses; :func:`choose_slice`
chooses the nodes that compute some classes from others alone, for
``Match.function`` and the reports.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Sequence

from ..ir.egraph import Snapshot
from ..ir.walk import children, walk


def choose_slice(snap: Snapshot, roots: Sequence[Any], inputs: set[Any], prefer: dict[Any, tuple],
                 visited: set | None = None) -> dict[Any, tuple] | None:
    """A node per class that computes ``roots`` from ``inputs`` alone, or ``None`` if there is none.

    Used to read a piece of the e-graph back as a function (``Match.function``).
    ``prefer`` (a whole-graph choice, such as the bottom-up pass's) is tried
    first in each class. A ``Param`` is allowed only inside a body that the
    slice itself enters, so the slice never reads an input it was not given;
    effects are never chosen. Each choice is acyclic (a class is never chosen
    through itself). ``visited``, if given, receives every class whose nodes
    were looked at (the answer may change when one of them gains a node).
    """
    choice: dict[Any, tuple] = {}
    done: dict[Any, bool] = {}
    on_path: set[Any] = set()

    def visit(c: Any, scopes: frozenset) -> bool:
        if c in inputs:
            return True
        if c in done:
            return done[c]
        if c in on_path:
            return False
        on_path.add(c)
        nodes = snap.nodes.get(c, [])
        first = prefer.get(c)
        ok = False
        for ctor, args in ([first] if first in nodes else []) + [n for n in nodes if n != first]:
            if ctor in ("Tok", "Effect") or (ctor == "Param" and args[0] not in scopes):
                continue
            if ctor == "Body":
                kids = [(args[1], scopes | {args[0]})]
            else:
                kids = [(a, scopes) for a in children((ctor, args))]
            if all(visit(k, sc) for k, sc in kids):
                choice[c] = (ctor, args)
                ok = True
                break
        on_path.discard(c)
        done[c] = ok
        return ok

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        found = all(visit(r, frozenset()) for r in roots)
        del visit  # the recursive closure's cycle would hold the snapshot: see Extractor.dag_cost
    finally:
        sys.setrecursionlimit(limit)
    if visited is not None:
        visited.update(done)
    return choice if found else None


def reachable(snap: Snapshot, choice: dict[Any, tuple], roots: Iterable[Any]) -> set[Any]:
    """Every class the chosen program uses, inside bodies too."""
    return set(walk(roots, lambda c: children(choice[c])))



def preferred_computes(snap: Snapshot, roots: Sequence[Any], inputs: set[Any], prefer: dict[Any, tuple]) -> list[bool]:
    """Per root, whether its ``prefer`` tree alone computes it from ``inputs``: where it says ``True``,
    :func:`choose_slice` of that root alone finds a slice; ``False`` says only that this shortcut cannot tell.

    ``choose_slice`` tries each class's ``prefer`` node first, with a fresh walk per call, so roots that share most
    of their classes (a loop body's outputs, asked one by one by ``Builder.computes_each``) were walked again for
    each root: flax_lm_step's 25 body outputs, 200-460 classes each. This walks each class once for all roots (once
    per scopes it is reached in), following ``prefer``'s node alone, under ``choose_slice``'s tests: no effect, a
    ``Param`` only of a body entered, a ``Body`` entered with its scope added.

    Its ``True`` is exact. A root proven here has every class its ``prefer`` nodes reach proven, in the scopes they
    are reached in; so ``choose_slice`` of that root alone takes each class's ``prefer`` node first and succeeds with
    it, never trying another node (what it keeps per class, whatever the scopes it first came in, is a success).
    And it never meets a class on its own path: the classes a proven one reaches lie on no cycle of ``prefer``
    nodes (the first of a cycle's classes to be proven would have reached itself through the others, a class on the
    path, which this walk, keyed by class as ``choose_slice``'s is, answers ``False``). A root not proven (a
    ``Param`` of a carry, a cycle, a class whose ``prefer`` node it lacks) is left to ``choose_slice``, which may
    still find it through another node."""
    proven: dict[tuple[Any, frozenset], bool] = {}
    on_path: set[Any] = set()
    nodes = snap.nodes

    def visit(c: Any, scopes: frozenset) -> bool:
        if c in inputs:
            return True
        found = proven.get((c, scopes))
        if found is not None:
            return found
        if c in on_path:
            return False  # a cycle of prefer nodes: choose_slice must decide
        ns = nodes.get(c, ())
        first = prefer.get(c)
        if first is None and len(ns) == 1:
            first = ns[0]  # (choose_slice tries a class of one node in that node, with an entry or without)
        ok = False
        if first is not None and first in ns:
            ctor, args = first
            if ctor == "Body":
                kids = [(args[1], scopes | {args[0]})]
            elif ctor in ("Tok", "Effect") or (ctor == "Param" and args[0] not in scopes):
                kids = None
            else:
                kids = [(k, scopes) for k in children(first)]
            if kids is not None:
                on_path.add(c)
                ok = all(visit(k, sc) for k, sc in kids)
                on_path.discard(c)
        proven[(c, scopes)] = ok
        return ok

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        out = [visit(r, frozenset()) for r in roots]
        del visit  # (the recursive closure's cycle: see choose_slice)
    finally:
        sys.setrecursionlimit(limit)
    return out
