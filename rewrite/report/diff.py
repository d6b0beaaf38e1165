"""``explain``'s diff: the rewritten program printed with the original's variable names.

JAX names a jaxpr's variables in the order it prints them, so one equation added near the top
renames every variable below it, and a diff of the two texts shows every line. Here each equation
of the rewritten program that is an equation of the original (the same primitive and params, on
operands already known to be the same) takes the original's names for its results, inputs take
theirs by position, bodies of matched equations are matched the same way, and every new variable
gets a name the original does not use: the diff shows what changed and nothing else.
"""

from __future__ import annotations

import collections
import difflib
from typing import Any

from ..ir.jaxapi import core, neutral_jaxpr, pretty_named


def _jaxpr(x: Any) -> Any:
    return x.jaxpr if isinstance(x, core.ClosedJaxpr) else x


def _split(params: dict) -> tuple[dict, list]:
    """An equation's params without its bodies, and its bodies in order."""
    plain, bodies = {}, []
    for k in sorted(params):
        v = params[k]
        items = v if isinstance(v, (tuple, list)) else (v,)
        if items and all(isinstance(i, (core.Jaxpr, core.ClosedJaxpr)) for i in items):
            bodies.extend(_jaxpr(i) for i in items)
        else:
            plain[k] = v
    return plain, bodies


def _same(a: dict, b: dict) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays among the params: compare their text
        return repr(a) == repr(b)


def _atom(atom: Any, names: dict) -> Any:
    if isinstance(atom, core.Literal):
        return ("literal", repr(atom.val), str(atom.aval))
    return names.get(atom, ("new", id(atom)))


class _Names:
    """Which variable of the rewritten program takes which name of the original's text."""

    def __init__(self, named: dict) -> None:
        self.named = named  # a variable of the original -> its name
        self.mapping: dict = {}  # a variable of the rewritten program -> the name it takes
        self.used: set = set()
        self.paired: set = set()  # ids of the equations of both programs paired so far

    def bind(self, new: Any, old: Any) -> None:
        name = self.named.get(old) if isinstance(old, core.Var) else None
        if (isinstance(new, core.Var) and not isinstance(new, core.DropVar) and new not in self.mapping
                and name is not None and name not in self.used):
            self.mapping[new] = name
            self.used.add(name)

    def like(self, old: Any, eqn: Any) -> bool:
        """Could ``eqn`` be ``old`` (the same operation, its operands aside)?"""
        plain, bodies = _split(eqn.params)
        old_plain, old_bodies = _split(old.params)
        return (id(old) not in self.paired and old.primitive.name == eqn.primitive.name
                and len(old.invars) == len(eqn.invars) and len(old.outvars) == len(eqn.outvars)
                and len(old_bodies) == len(bodies) and _same(plain, old_plain)
                and all(str(o.aval) == str(n.aval) for o, n in zip(old.outvars, eqn.outvars)))

    def pair(self, old: Any, eqn: Any) -> None:
        self.paired.update((id(old), id(eqn)))
        for o, n in zip(old.outvars, eqn.outvars):
            self.bind(n, o)
        for o, n in zip(old.invars, eqn.invars):
            self.bind(n, o)
        for ob, nb in zip(_split(old.params)[1], _split(eqn.params)[1]):
            self.match(ob, nb)

    def match(self, before: Any, after: Any) -> None:
        """Pair the equations of ``after`` with those of ``before``: forward from the inputs (the same
        operation on the same operands), backward from the outputs (the same operation making the same
        value), and forward again from what that named."""
        if len(before.invars) == len(after.invars):
            for o, n in zip(before.invars, after.invars):
                self.bind(n, o)
        if len(before.outvars) == len(after.outvars):
            for o, n in zip(before.outvars, after.outvars):
                self.bind(n, o)
        self._forward(before, after)
        producer = {self.named[v]: eqn for eqn in before.eqns for v in eqn.outvars if v in self.named}
        for eqn in reversed(after.eqns):
            if id(eqn) in self.paired:
                continue
            for v in eqn.outvars:
                old = producer.get(self.mapping.get(v))
                if old is not None and self.like(old, eqn):
                    self.pair(old, eqn)
                    break
        self._forward(before, after)

    def _forward(self, before: Any, after: Any) -> None:
        index: dict[Any, list] = collections.defaultdict(list)
        for eqn in before.eqns:
            index[(eqn.primitive.name, tuple(_atom(v, self.named) for v in eqn.invars))].append(eqn)
        for eqn in after.eqns:
            if id(eqn) in self.paired:
                continue
            for old in index.get((eqn.primitive.name, tuple(_atom(v, self.mapping) for v in eqn.invars)), ()):
                if self.like(old, eqn):
                    self.pair(old, eqn)
                    break


def texts(before: Any, after: Any) -> tuple[str, str]:
    """The two programs' texts, the second with the first's names where its equations are the first's; params
    in the form that reads the same whichever JAX traced or transformed each (:func:`neutral_jaxpr`)."""
    before, after = neutral_jaxpr(_jaxpr(before)), neutral_jaxpr(_jaxpr(after))
    text_before, named = pretty_named(_jaxpr(before))
    named = {v: n for v, n in named.items() if n != "_"}
    names = _Names(named)
    names.match(_jaxpr(before), _jaxpr(after))
    text_after, _ = pretty_named(_jaxpr(after), names.mapping, avoid=named.values())
    return text_before, text_after


def unified(before: Any, after: Any, context: int = 2) -> str:
    """A unified diff of the two programs, printed by :func:`texts`."""
    a, b = texts(before, after)
    return "\n".join(difflib.unified_diff(a.splitlines(), b.splitlines(), "before", "after", lineterm="", n=context))
