"""Preferred rules: a replacement that must be taken wherever it was built, whatever it costs.

The cost model prices time, so a rewrite that is only *better* in another
sense (``log(1 + x) -> log1p(x)`` is more accurate, and dearer) would never
be chosen. A rule made with ``rule(..., prefer=True)`` says its matched form
is a worse program. Saturation notes each of its unions (:class:`Barred`):
the class, the constructors of the rule's left-hand side at its root, and the
node the rule built. Before extraction, :func:`bar` takes out of that class
every node with those constructors other than the one built (commuted copies
of the matched form included: they compute it the same way), so extraction
must choose among the rest. A bar that would leave any class of the program
without a finite-cost choice is lifted again and reported as lifted: a
preference never makes a program unextractable.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..ir import primitives as _primitives


@dataclasses.dataclass
class Barred:
    """One union made by a preferred rule: where, which forms it bars, and what it built."""

    rule: str
    root: int              # a name in the matched class
    ctors: frozenset       # the left-hand side's constructors at its root
    built: int             # the name of the replacement


def lhs_ctors(rule: Any, lhs_jaxpr: Any = None) -> frozenset:
    """The constructors of the nodes ``rule`` matches at its root."""
    if rule.is_pat:
        return frozenset(rule.lhs.ctors())
    if lhs_jaxpr is not None and lhs_jaxpr.eqns:
        spec = _primitives.BY_PRIM.get(lhs_jaxpr.eqns[-1].primitive.name)
        if spec is not None:
            return frozenset({spec.ctor})
    return frozenset()


def bar(snap: Any, egraph: Any, notes: list[Barred],
        tree: Callable[[Callable[[Any, str, tuple], bool]], dict]) -> tuple[dict[Any, set], dict[str, int]]:
    """The nodes to leave out of extraction, by class, and per rule how many classes it forced.

    ``tree(allowed)`` is extraction's bottom-up pass restricted to the allowed
    nodes; it returns the classes that keep a finite-cost choice. A bar that
    leaves a class the program needs without one is lifted, class by class,
    until every class computable before stays computable.
    """
    barred: dict[Any, set] = {}
    owner: dict[Any, set] = {}
    for n in notes:
        cls = snap.cls_of_name[n.root] if n.root < len(snap.cls_of_name) else None
        if cls is None or not n.ctors:
            continue
        built = egraph.canonical(snap, n.built)
        nodes = snap.nodes.get(cls, ())
        drop = {x for x in nodes if x[0] in n.ctors and x != built}
        if drop and len(drop) < len(nodes):
            barred.setdefault(cls, set()).update(drop)
            owner.setdefault(cls, set()).add(n.rule)
    if not barred:
        return {}, {}
    before = set(tree(lambda cls, ctor, args: True))
    while barred:
        after = set(tree(lambda cls, ctor, args: (ctor, args) not in barred.get(cls, ())))
        lost = before - after
        if not lost:
            break
        # A barred class that keeps a choice keeps its users' too, so some lost class is barred.
        lift = [c for c in lost if c in barred] or list(barred)
        for c in lift:
            barred.pop(c, None)
            owner.pop(c, None)
    forced: dict[str, int] = {}
    for rules in owner.values():
        for r in rules:
            forced[r] = forced.get(r, 0) + 1
    return barred, forced


def apply(snap: Any, barred: dict[Any, set]) -> None:
    """Leave the barred nodes out of the snapshot's node table, which every extraction walk reads."""
    for cls, drop in barred.items():
        snap.nodes[cls] = [n for n in snap.nodes[cls] if n not in drop]
