"""Preferred rules: a replacement that must be taken wherever it was built, whatever it costs.

The cost model prices time, so a rewrite that is only *better* in another
sense (``log(1 + x) -> log1p(x)`` is more accurate, and dearer) would never
be chosen. A rule made with ``rule(..., prefer=True)`` says its matched form
is a worse program. Saturation notes each of its unions (:class:`rewrite.records.Barred`):
the class, the constructors of the rule's left-hand side at its root, and the
node the rule built. Before extraction, ``extract/policy.py`` takes out of
that class every node with those constructors other than the one built
(commuted copies of the matched form included: they compute it the same way),
so extraction must choose among the rest.
"""

from __future__ import annotations

from typing import Any

from ..ir import primitives as _primitives


def lhs_ctors(rule: Any, lhs_jaxpr: Any = None) -> frozenset:
    """The constructors of the nodes ``rule`` matches at its root."""
    if rule.is_pat:
        return frozenset(rule.lhs.ctors())
    if lhs_jaxpr is not None and lhs_jaxpr.eqns:
        spec = _primitives.BY_PRIM.get(lhs_jaxpr.eqns[-1].primitive.name)
        if spec is not None:
            return frozenset({spec.ctor})
    return frozenset()
