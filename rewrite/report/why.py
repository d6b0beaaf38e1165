"""Why a rewrite that fired was not chosen: the price of the program with it, next to the price kept.

A rule adds alternatives to the e-graph; extraction keeps whichever program
the cost model prices lowest. When a rule fired and nothing it built is in
the result, :func:`declined` rebuilds the chosen program with the rule's
nodes forced in (every class that holds a node the rule built takes that
node; the rest stays as chosen, or as the cheapest node where the chosen
program had none), prices it as extraction did, and breaks both prices down
by operation, loop bodies counted once per trip. The largest differences
are what drove the choice. A user can tell a declined rewrite (built,
priced, and dearer) from a missed one: never built (the rule did not fire,
and ``explain`` counts why per match), or built and cheaper but not reached
by extraction's search (``verdict == "missed"``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from ..extract.extractor import Extractor
from ..extract.program import ProgramPricer, prices_programs
from ..ir import primitives as _primitives
from ..ir.walk import CycleError, postorder, walk


@dataclasses.dataclass
class Declined:
    """One rule's rewrite that extraction did not keep: both prices and what differs between them."""

    rule: str
    kept: float                  # the price of the program extraction chose
    declined: float              # the price of the same program with the rule's nodes in it
    #: (operation, price in the kept program, price with the rule's nodes): the largest differences first
    drivers: list[tuple[str, float, float]]
    note: str = ""

    def __str__(self) -> str:
        if self.note:
            return f"{self.rule}: {self.note}"
        parts = ", ".join(f"{op} {a:,.0f} -> {b:,.0f}" for op, a, b in self.drivers[:3])
        change = f" ({self.declined / self.kept - 1:+.1%})" if self.kept else ""
        return (f"{self.rule}: kept {self.kept:,.0f}, with it {self.declined:,.0f}{change}, {self.verdict}; "
                f"by operation: {parts}")

    @property
    def verdict(self) -> str:
        """``"declined"`` when the model prices the rewrite higher, else ``"missed"``: the model prices it
        lower, and extraction's search did not reach that program."""
        return "declined" if self.declined >= self.kept else "missed"


def built_nodes(result: Any, rule: str) -> dict[Any, tuple]:
    """Class -> a node that ``rule`` built there, over the final e-graph."""
    eg, snap = result.egraph, result.snapshot
    out: dict[Any, tuple] = {}
    for vid, origin in enumerate(eg.vorigin):
        if origin != rule:
            continue
        key = eg.canonical(snap, vid)
        cls = snap.cls_of_name[vid] if vid < len(snap.cls_of_name) else None
        if key is not None and cls is not None and key in snap.nodes.get(cls, ()) and cls not in out:
            out[cls] = key
    return out


def builds_loops(result: Any, rule: str) -> bool:
    """Whether ``rule`` built a node with bodies (a loop, a cond...)."""
    return any(_primitives.BY_CTOR.get(ctor) is not None and _primitives.BY_CTOR[ctor].family == _primitives.NESTED
               for ctor, _ in built_nodes(result, rule).values())


def forced_choice(result: Any, model: Any, rule: str) -> tuple[Extractor, dict, dict] | None:
    """The chosen program with ``rule``'s nodes forced in: ``(extractor, choice, the forced nodes)``, the
    choice a node per class (the rule's where it built one, else as chosen, else the cheapest); ``None``
    if the rule built nothing or the result kept no e-graph."""
    if result.egraph is None or result.choice is None:
        return None
    forced = built_nodes(result, rule)
    if not forced:
        return None
    ex = Extractor(result.snapshot, model)
    _, tree = ex.tree()
    return ex, {**tree, **dict(result.choice), **forced}, forced


def declined(result: Any, model: Any, rule: str) -> Declined | None:
    """The price of the result with ``rule``'s nodes forced in; ``None`` if the rule built nothing."""
    made = forced_choice(result, model, rule)
    if made is None:
        return None
    ex, alt, forced = made
    kept = dict(result.choice)
    roots = list(result.roots)
    if _cyclic(ex, alt, roots):
        return Declined(rule, 0.0, 0.0, [], note="its nodes cannot be put in the chosen program alone "
                        "(they depend on each other through other rules' nodes)")
    if not any(c in _reach(ex, alt, roots) for c in forced):
        return Declined(rule, 0.0, 0.0, [], note="what it built is not reached from the program's outputs")
    price = ProgramPricer(ex, model) if prices_programs(model) else None
    cost = (lambda ch: price(ch, roots)) if price is not None else (lambda ch: ex.dag_cost(ch, roots))
    a, b = _breakdown(ex, kept, roots), _breakdown(ex, alt, roots)
    drivers = sorted(((op, a.get(op, 0.0), b.get(op, 0.0)) for op in set(a) | set(b)),
                     key=lambda t: -abs(t[2] - t[1]))
    return Declined(rule, float(cost(kept)), float(cost(alt)), [d for d in drivers if d[1] != d[2]])


def _kids(ex: Extractor, choice: dict) -> Any:
    return lambda c: ex.children(*choice[c]) if c in choice else ()


def _reach(ex: Extractor, choice: dict, roots: list) -> set:
    return {c for c in walk(roots, _kids(ex, choice)) if c in choice}


def _cyclic(ex: Extractor, choice: dict, roots: list) -> bool:
    try:
        for _ in postorder(roots, _kids(ex, choice)):
            pass
    except CycleError:
        return True
    return False


def _breakdown(ex: Extractor, choice: dict, roots: list) -> dict[str, float]:
    """Node prices summed per operation; a body's nodes count once per trip of the loop that runs them. A call XLA
    inlines counts the part of its body that the outputs read need (``Program.from_choice``'s ``partial``)."""
    out: collections.Counter = collections.Counter()
    read: dict[Any, set] = {}
    for c in walk(roots, lambda c: ex.children(*choice[c]) if c in choice else ()):
        if c in choice and choice[c][0] == "Proj":
            tup, index = choice[c][1]
            read.setdefault(tup, set()).add(index)

    def visit(c: Any, times: float) -> list:
        """Count ``c``'s price (a nested node's bodies, ``times`` its trips); return the classes it reads."""
        if c not in choice:
            return []
        ctor, args = choice[c]
        bodies = ex.body_classes(ctor, args)
        if not bodies:
            price = ex.own(c, (ctor, args), choice)
            if price:
                out[ex.info(c, ctor, args, choice).op] += times * price
            return ex.children(ctor, args)
        info0 = ex.info(c, ctor, args, choice, tuple(0.0 for _ in bodies))
        info1 = ex.info(c, ctor, args, choice, tuple(1.0 for _ in bodies))
        own = float(ex.model(info0))
        # how often each body runs, as the model counts it
        trips = (float(ex.model(info1)) - own) / len(bodies)
        out[f"{info0.op} (its own work)"] += times * own
        spec = _primitives.BY_CTOR.get(ctor)
        for b in bodies:
            _, (_, outs) = choice[b]
            items = list(ex.snap.list_items(outs))
            if spec is not None and spec.inlined and len(bodies) == 1 and c in read:
                items = [x for k, x in enumerate(items) if k in read[c]]
            scope(items, times * trips)
        return ex.term_kids((ctor, args))  # what it reads in its own scope (its bodies were priced above)

    def scope(start: list, times: float) -> None:
        for _ in walk(start, lambda c: visit(c, times)):
            pass

    try:
        scope(roots, 1.0)
    finally:
        del visit, scope  # recursive closures are reference cycles: they would hold the extractor and its e-graph
    return dict(out)
