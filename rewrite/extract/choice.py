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
