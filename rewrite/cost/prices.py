"""Node prices kept across extractions, by a key that names what the price reads.

A rewrite extracts from many snapshots (each pipeline's, the plain twin, the ``min_saving`` copies, a VJP's joint
and its gradients, a training step's forward, joint and rest), and each extraction prices its e-nodes under the cost
model: :meth:`rewrite.extract.extractor.Extractor.own`, and the fusion model's tie-break price of every op of a
candidate program (``AnalyticCost._op_price``). Most of those nodes are the same terms in each: on flax_lm_step
14,320 node prices were computed for 1,640 distinct keys.

What :class:`rewrite.cost.model.AnalyticCost` reads to price a node without bodies is its :class:`NodeInfo`, and
``Extractor.info`` builds that from (``Extractor.node_key`` says it as a key):

* the node's constructor, which gives its family (the table of primitives, ``ir/primitives.py``);
* its params id, which names one ``(primitive, params)`` for the process (``ir/intern.py``: ids are never reused,
  so an id of a dropped entry is never met again);
* the avals of the classes it reads and of its own class (by value: equal avals have the same shape and dtype,
  all a price reads of them);
* for a projection, the index it takes, the projected node's constructor and params id, and that node's aval.

The model reads nothing else: its own fields (a frozen dataclass), the records of the table of primitives (their
``price``, ``unrolled``, ``cheap`` and ``stacks`` hooks: the kept prices are dropped whenever the table changes,
``primitives.CHANGES``) and constant tables. So a kept price is the same float the model would compute, which
``tests/test_prices.py`` checks node by node. Only :class:`AnalyticCost` itself keeps prices: a subclass (or any
other model) may price by anything, so it is asked every time, as before.

Bounded: at most :data:`LIMIT` prices per model, emptied when full (a long-lived process that rewrites new
signatures holds no more). A key holds a constructor name, ints and avals: no params, no arrays.
"""

from __future__ import annotations

from typing import Any, Callable

from ..ir import primitives as _primitives

#: The most node prices kept per model (~200 bytes each); the table is emptied when it is full.
LIMIT = 1 << 14

#: The key under which a program op's facts (``cost/program.py``'s template memo) hold its node's key.
NODE_KEY = "node_key"


def kept(model: Any) -> dict:
    """The node prices kept for ``model`` (an :class:`AnalyticCost`, not a subclass: the caller checks), by key;
    a new table once the table of primitives has changed. For a fusion model (``cost/fusion.py``'s
    ``FusionModel._facts``, where ``keeps_facts``): its ops' facts, by the same keys."""
    found = model.__dict__.get("_kept_prices")
    if found is None or found[0] != _primitives.CHANGES[0]:
        found = model.__dict__["_kept_prices"] = (_primitives.CHANGES[0], {})
    return found[1]


def keep(table: dict, key: Any, price: float) -> None:
    """Keep ``price`` under ``key`` in ``table`` (:func:`kept`), emptying the table first when it is full."""
    if len(table) >= LIMIT:
        table.clear()
    table[key] = price


def price_of(model: Any, key: Any, price: Callable[[], float]) -> float:
    """``float(price())``, kept in ``model``'s table under ``key``; ``None`` keeps nothing."""
    if key is None:
        return price()
    table = kept(model)
    found = table.get(key)
    if found is None:
        found = float(price())
        keep(table, key, found)
    return found


def kept_facts(fusion: Any, memo: dict) -> Any:
    """The fusion facts (``cost/fusion.py``'s ``FusionModel._facts``) kept in ``fusion``'s table (:func:`kept`) by
    the node key in an op's ``memo``, put in the memo too; ``None``: no key, or none kept. Only a fusion model whose
    facts read its ops' ``NodeInfo`` alone keeps them (``keeps_facts``: ``AnalyticCost``'s own, whose tie-break is its
    kept node price): equal keys, equal infos, the operands' avals among them (all the facts read of the program)."""
    node = memo.get(NODE_KEY)
    found = None if node is None else kept(fusion).get(node)
    if found is not None:
        memo[fusion._facts_key] = found
    return found


def keep_facts(fusion: Any, memo: dict, found: tuple) -> None:
    """Keep the fusion facts ``found`` of an op whose ``memo`` holds its node key (:func:`kept_facts`)."""
    node = memo.get(NODE_KEY)
    if node is not None:
        keep(kept(fusion), node, found)
