"""Pytrees whose metadata holds arrays, met inside an outer trace.

A registered pytree may keep an array in a static field (jax-md's ``NeighborList`` keeps its cell size so, an array
where the cutoff given was one). ``jax.jit(f)`` compares such metadata with its cache's keys before it traces, at
the top level. ``jax.jit(rewrite(f))`` looks ``f``'s signature up and traces it inside ``jit``'s trace, where an
array compared is a staged ``eq`` that cannot be made a bool: JAX raised ``ValueError: Exception raised while
checking equality of metadata fields of pytree`` (19 of jax-md's ``smap_test`` routed through the rewriter).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..ir.jaxapi import core


class EagerKeys(dict):
    """A dict whose keys' pytree metadata is compared eagerly (``Rewritten``'s traced signatures): looked up inside
    an outer trace (``jax.jit(rewrite(f))``), a key whose static field holds an array (jax-md's ``NeighborList``) was
    compared as a staged ``eq``, and a ``ValueError`` raised where ``jax.jit(f)`` runs (:func:`array_metadata`).
    Outside any trace (an eager call, each call's lookups) the dict is read as it is: entering
    ``jax.ensure_compile_time_eval`` costs some 2.5 us a lookup, where the check costs 0.2 us."""

    def _eagerly(self, method: Any, *args: Any) -> Any:
        if core.trace_state_clean():
            return method(self, *args)
        with jax.ensure_compile_time_eval():
            return method(self, *args)

    def get(self, key: Any, default: Any = None) -> Any:
        return self._eagerly(dict.get, key, default)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._eagerly(dict.__setitem__, key, value)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return self._eagerly(dict.setdefault, key, default)


def array_metadata(tree: Any) -> bool:
    """Does a node of ``tree`` hold an array in its metadata (a static field: jax-md's ``NeighborList`` keeps its
    cell size so, an array where the cutoff given was one)? ``jax.make_jaxpr`` of such arguments compares their
    metadata with its cache's keys, and inside an outer trace (``jax.jit(rewrite(f))``) that comparison is staged:
    a ``ValueError`` where ``jax.jit(f)`` runs. Such arguments are traced flat (``rewrite.jaxpr.trace._as_called``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        data = node.node_data()
        if data is not None and any(isinstance(m, (jax.Array, np.ndarray, core.Tracer))
                                    for m in jax.tree_util.tree_leaves(data[1])):
            return True
        stack.extend(node.children())
    return False
