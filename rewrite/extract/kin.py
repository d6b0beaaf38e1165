"""Kin extractors: an extractor of a copy of a snapshot with some nodes left out (``Snapshot.without``), or of the
snapshot a copy was made from, reads what its kin computed where it is the same (``Extractor.share_prices`` makes two
extractors kin): the unrestricted tree pass, for the classes no node the two differ in lies below (:func:`kin_pass`),
and the ranks that bound a cycle check's walk (:func:`kin_rank`).

A ``min_saving`` copy (``extract.policy.worth_their_saving``) and the snapshot whose recomputing nodes an extraction
withheld (``extract.policy.recomputations``, which reads its tree pass after the copy's) differ from their kin in a few
classes: measured on flax_long_context_step, wholestep_equinox_gpt and flax_seq2seq_grad (benchmarks/results/log.md,
h-ext), 17-85% of their classes lie above a changed one (about 40% at the median), and each such pass equals the pass
the extractor makes alone, in its values and its order.
"""

from __future__ import annotations

import heapq
import operator
from typing import Any

from ..ir import primitives as _primitives


def nested(ctor: str) -> bool:
    """Whether a node of ``ctor`` may have bodies (:meth:`Extractor.body_classes` is empty for any other)."""
    spec = _primitives.BY_CTOR.get(ctor)
    return spec is not None and spec.family == _primitives.NESTED


def enter(ex: Any, items: Any, choice: dict, allowed: Any = None, first: dict | None = None
          ) -> tuple[list, list, dict, list, list]:
    """The tree pass's entries (``Extractor._tree_pass``, :func:`kin_pass`): ``(entries, at, parents, pending,
    heap)``, an entry ``(cls, node, kids)`` per node of ``items`` (``(cls, nodes)`` pairs) that ``allowed`` allows
    (all where ``None``), the entries that read each class, each entry's count of unsettled kids, and the heap of
    those with none, at their own prices (under ``choice``, the pass's). With ``first`` (each class's first entry's
    number in the whole pass), ``at`` holds each entry's number there."""
    entries: list[tuple[Any, tuple, list[Any]]] = []
    at: list[int] = []
    parents: dict[Any, list[int]] = {}
    pending: list[int] = []
    heap: list[tuple[float, int]] = []
    unique, all_kids, own = ex._unique_kids, ex.all_kids, ex.own
    for cls, ns in items:
        base = None if first is None else first[cls]
        for pos, node in enumerate(ns):
            if allowed is not None and not allowed(cls, node[0], node[1]):
                continue
            kids = unique.get(node)
            if kids is None:
                kids = unique[node] = list(dict.fromkeys(all_kids(node)))
            i = len(entries)
            entries.append((cls, node, kids))
            if base is not None:
                at.append(base + pos)
            pending.append(len(kids))
            if kids:
                for k in kids:
                    found = parents.get(k)
                    if found is None:
                        parents[k] = [i]
                    else:
                        found.append(i)
            else:
                heap.append((own(cls, node, choice), i))
    return entries, at, parents, pending, heap


def settle(ex: Any, entries: list, parents: dict, pending: list, heap: list, cost: dict, choice: dict,
           clean: list = (), kin_cost: dict | None = None, kin_choice: dict | None = None, first: dict | None = None,
           at: list | None = None) -> None:
    """The tree pass's settling (``Extractor._tree_pass``, :func:`kin_pass`): pop the least entry of ``heap``
    (``(price, j)`` of ``entries[j] = (cls, node, kids)``), settle its class where not settled yet (``cost``,
    ``choice``), and ready each entry that read it (``parents``) once its last kid settles (``pending``), at its own
    price and its kids' (bodies: ``Extractor._total``). With ``clean`` (:func:`kin_pass`): those classes settle as in
    the kin's pass (``kin_cost``, ``kin_choice``), in its order, each before the least entry where it comes first in
    the whole pass's order (its price, then its first entry's number ``first[c]`` against the entry's ``at[j]``)."""
    total, own = ex._total, ex.own
    bodied_by: dict[str, bool] = {}  # by constructor, for this pass (a primitive may be registered between two)
    get, heappop, heappush = cost.__getitem__, heapq.heappop, heapq.heappush
    s, last = 0, len(clean)
    while True:
        if s < last:
            c = clean[s]
            price = kin_cost[c]
            if heap:
                top, j = heap[0]
                if price > top or (price == top and first[c] > at[j]):
                    c = None
        elif heap:
            c = None
        else:
            break
        if c is not None:  # the next clean class settles
            s += 1
            cost[c] = price
            choice[c] = kin_choice[c]
        else:
            price, j = heappop(heap)
            c, node, _ = entries[j]
            if c in cost:
                continue
            cost[c] = price
            choice[c] = node
        for p in parents.get(c, ()):
            n = pending[p] - 1
            pending[p] = n
            if n == 0:
                pcls, pnode, pkids = entries[p]
                if pcls in cost:
                    continue
                pctor = pnode[0]
                bodied = bodied_by.get(pctor)
                if bodied is None:
                    bodied = bodied_by[pctor] = nested(pctor)
                if bodied:
                    heappush(heap, (total(pcls, pctor, pnode[1], pkids, cost, choice), p))
                else:
                    heappush(heap, (own(pcls, pnode, choice) + sum(map(get, pkids)), p))


def kin_pass(ex: Any) -> tuple[dict, dict] | None:
    """``ex._tree_pass`` unrestricted, read off a kin's (``Extractor._kin``) where one has made its own: the same
    costs and choices, in the same order; ``None`` where no kin has.

    The kin's snapshot holds the same classes in the same order, and the same nodes but in the classes whose
    node lists differ (``Snapshot.without`` leaves some out; a kin without them may be either). A class none
    of whose nodes reaches such a class, through any child (``clean``), has the same entries in both passes,
    in the same order, readied by the same clean classes: so the pass pops the clean entries in the same order
    in both, at the same prices, whatever the other entries do between (a pop takes the least entry of the heap,
    and the clean entries in it at any time are the same), and each clean class settles as in the kin's pass.
    The rest (the classes above a changed one) are passed here as the pass passes them: their entries, numbered
    as the whole pass numbers them, in a heap, whose least entry is taken where it is less than the next clean
    class to settle (the kin's order, keyed by its price and its first entry's number: two classes' entries are
    never numbered alike, so a tie of prices between a clean and another class goes as in the whole pass). The
    settlements are made in that merged order, so the dicts come out in the whole pass's order too."""
    nodes = ex.snap.nodes
    for ref in ex._kin:
        kin = ref()
        if kin is not None and kin._tree is not None and kin._graph is not None and kin.model is ex.model:
            break
    else:
        return None
    theirs = kin.snap.nodes
    if len(theirs) != len(nodes) or not all(map(operator.is_, theirs, nodes)):
        return None  # (not the same classes in the same order)
    changed = [c for c, ns in nodes.items() if ns is not theirs[c] and ns != theirs[c]]
    entries1, parents1 = kin._graph
    dirty = set(changed)
    stack = list(changed)
    while stack:  # up from the changed classes, through the kin's entries (a node only one side holds is of a
        for i in parents1.get(stack.pop(), ()):  # changed class: its edges add nothing)
            c = entries1[i][0]
            if c not in dirty:
                dirty.add(c)
                stack.append(c)
    ex.passes += 1
    ex.kin_dirty += len(dirty)
    kin_cost, kin_choice = kin._tree
    # the other classes' entries, numbered as ``Extractor._tree_pass`` numbers every entry (``first``: each class's
    # first); ``at[j]``: entry j's number, j counting only these (so in the same order)
    first: dict[Any, int] = {}
    n = 0
    for c, ns in nodes.items():
        first[c] = n
        n += len(ns)
    cost: dict[Any, float] = {}
    choice: dict[Any, tuple] = {}
    entries, at, parents, pending, heap = enter(ex, [(c, ns) for c, ns in nodes.items() if c in dirty], choice,
                                                first=first)
    heapq.heapify(heap)
    clean = [c for c in kin_cost if c not in dirty]  # in the order they settle, the kin's
    settle(ex, entries, parents, pending, heap, cost, choice, clean, kin_cost, kin_choice, first, at)
    return cost, choice


def kin_rank(ex: Any) -> dict[Any, int] | None:
    """A kin's ``Extractor.rank``, made already, of a snapshot of the same classes that holds every node of this one's;
    ``None`` where no kin's is."""
    nodes = ex.snap.nodes
    for ref in ex._kin:
        kin = ref()
        if kin is None or "rank" not in kin.__dict__:
            continue
        theirs = kin.snap.nodes
        if len(theirs) != len(nodes) or not all(map(operator.is_, theirs, nodes)):
            continue
        if all(ns is theirs[c] or ns == theirs[c] or set(ns) <= set(theirs[c]) for c, ns in nodes.items()):
            ex.kin_ranks += 1
            return kin.rank
    return None
