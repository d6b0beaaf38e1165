"""Stage 4, extract: choose one node per e-class, minimising the cost model.

The extractor reads the frozen e-graph, not egglog's own extractor: egglog's
default counts a shared node once per use (tree cost) and overflows on large
DAGs, and its DAG-aware extractor is too slow at our sizes (see
``docs/design.md``).

1. A bottom-up pass in the style of Knuth's generalisation of Dijkstra's
   algorithm gives every class its cheapest node, given its children's
   costs. A node is only considered once all its children are settled, so
   the choice is acyclic by construction.
2. The same pass over the input program's own nodes gives the input program
   (after common-subexpression elimination).
3. :class:`LocalSearch` improves the first under the true DAG cost (each
   class once per scope, a body once per execution of its loop), switching
   one class, or all the outputs of one loop, at a time.
4. When the cost model also prices whole programs (``AnalyticCost.program``:
   what XLA fuses, stores and recomputes, ``rewrite/cost/fusion.py``), the
   candidates are priced that way, and :class:`ProgramSearch` refines the
   better rewritten one, and the input program, with single-class switches
   under that price: whether a value is stored or recomputed in every loop
   that reads it depends on the whole program, which no sum of node costs
   sees. A switch re-prices only the kernels it touches (:class:`LiveProgram`,
   one per extraction, moved between the searches' starts).
5. The cheapest candidate wins, and the input program is one of them, so the
   result never costs more than the input; with no rules it is the input.
   The distinct candidates stay available, cheapest first, for
   ``cost_model="measure"`` to time.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from ..ir import terms as _terms
from ..cost.model import CostModel, NodeInfo
from ..ir.egraph import Snapshot
from ..ir.intern import PARAMS, TupleType
from ..ir.walk import children, operands, term_children, walk

_CONTAINERS = {"TNil", "TCons", "Body", "BNil", "BCons"}
_LEAVES = _terms.LEAVES


@dataclasses.dataclass
class Extraction:
    choice: dict[Any, tuple]     # class -> chosen e-node (ctor, args)
    cost: float
    original_cost: float
    rewritten: bool              # False when the input program was kept
    #: distinct candidate programs, cheapest first: (choice, cost, rewritten)
    candidates: list[tuple[dict[Any, tuple], float, bool]] = dataclasses.field(default_factory=list)


class Extractor:
    def __init__(self, snap: Snapshot, model: CostModel) -> None:
        self.snap = snap
        self.model = model
        self._own: dict[tuple, float] = {}
        self._kids: dict[tuple, list[Any]] = {}
        self._operands: dict[tuple, list[Any]] = {}
        self._all_kids: dict[tuple, list[Any]] = {}
        self._pair_ids: dict[tuple, int] = {}

    # ------------------------------------------------------------------ node facts
    def term_kids(self, node: tuple) -> list[Any]:
        """The ``Term``/``TList`` children of ``node`` (not bodies), memoised: searches ask often."""
        found = self._kids.get(node)
        if found is None:
            found = self._kids[node] = term_children(node)
        return found

    def operands(self, node: tuple) -> list[Any]:
        """The term classes ``node`` reads, list members spelled out (``_walk.operands``), memoised."""
        found = self._operands.get(node)
        if found is None:
            found = self._operands[node] = operands(self.snap, node)
        return found

    def all_kids(self, node: tuple) -> list[Any]:
        """Every child class of ``node``, bodies included (``_walk.children``), memoised."""
        found = self._all_kids.get(node)
        if found is None:
            found = self._all_kids[node] = children(node)
        return found

    def pair_id(self, cls: Any, node: tuple) -> int:
        """A number for the choice of ``node`` in ``cls``: a program's signature is the set of its choices'."""
        key = (cls, node)
        found = self._pair_ids.get(key)
        if found is None:
            found = self._pair_ids[key] = len(self._pair_ids)
        return found

    @functools.cached_property
    def rank(self) -> dict[Any, int]:
        """A rank per class such that a class can reach another, under any choice, only if its rank
        is at least the other's (equal ranks: one strongly connected component of the e-graph).

        Tarjan's algorithm numbers the components sinks first; searches use it to stop a walk
        early when it checks that a move keeps the program acyclic.
        """
        nodes = self.snap.nodes
        edges = {c: list({k for n in ns for k in self.term_kids(n)}) for c, ns in nodes.items()}
        index: dict[Any, int] = {}
        low: dict[Any, int] = {}
        on_stack: set[Any] = set()
        stack: list[Any] = []
        rank: dict[Any, int] = {}
        counter = components = 0
        for start in nodes:
            if start in index:
                continue
            work = [(start, iter(edges.get(start, ())))]
            index[start] = low[start] = counter
            counter += 1
            stack.append(start)
            on_stack.add(start)
            while work:
                v, it = work[-1]
                advanced = False
                for w in it:
                    if w not in index:
                        index[w] = low[w] = counter
                        counter += 1
                        stack.append(w)
                        on_stack.add(w)
                        work.append((w, iter(edges.get(w, ()))))
                        advanced = True
                        break
                    if w in on_stack:
                        low[v] = min(low[v], index[w])
                if advanced:
                    continue
                work.pop()
                if work:
                    u = work[-1][0]
                    low[u] = min(low[u], low[v])
                if low[v] == index[v]:
                    comp = components
                    components += 1
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        rank[w] = comp
                        if w == v:
                            break
        return rank

    def reaches(self, choice: dict[Any, tuple], start: Iterable[Any], targets: set[Any]) -> bool:
        """Whether the program ``choice`` makes reaches a class of ``targets`` from ``start`` (a cycle check)."""
        rank = self.rank
        lo = min(rank.get(t, -1) for t in targets)  # nothing ranked below every target reaches one
        kids = self.term_kids
        # nothing below the targets' rank is walked through
        return any(x in targets for x in walk(start, lambda x: () if rank.get(x, lo) < lo else kids(choice[x])))

    def children(self, ctor: str, args: tuple) -> list[Any]:
        """:meth:`all_kids` of the node ``(ctor, args)``."""
        return self.all_kids((ctor, args))

    def info(self, cls: Any, ctor: str, args: tuple, choice: dict[Any, tuple], body_costs: tuple = ()) -> NodeInfo:
        snap = self.snap
        out_t = snap.aval(cls)
        outs = tuple(out_t) if isinstance(out_t, TupleType) else (out_t,)
        if ctor in _LEAVES:
            return NodeInfo(_LEAVES[ctor], _terms.SPECIAL, {}, (), outs)
        if ctor == "Proj":
            tup, index = args
            of_ctor, of_args = choice[tup]
            of_params = PARAMS.params(of_args[-1]) if of_ctor not in _LEAVES and of_ctor != "Proj" else {}
            of_op = PARAMS.prim(of_args[-1]).name if of_ctor not in _LEAVES and of_ctor != "Proj" else of_ctor
            return NodeInfo("proj", _terms.SPECIAL, of_params, (snap.aval(tup),), outs, index=index, of=of_op)
        pid = args[-1]
        reads = operands(snap, (ctor, args))
        ins = [snap.aval(a) for a in (reads[1:] if ctor == "Effect" else reads)]  # not an effect's token
        family = _terms.BY_CTOR.get(ctor, _terms.DEFAULT).family
        return NodeInfo(PARAMS.prim(pid).name, family, PARAMS.params(pid), tuple(ins), outs, body_costs)

    def own(self, cls: Any, ctor: str, args: tuple, choice: dict[Any, tuple]) -> float:
        """A node's own cost, for nodes without bodies."""
        if ctor in _CONTAINERS:
            return 0.0
        key = (cls, ctor, args, choice[args[0]] if ctor == "Proj" else None)
        found = self._own.get(key)
        if found is None:
            found = self._own[key] = float(self.model(self.info(cls, ctor, args, choice)))
            if not found >= 0.0:
                raise ValueError(f"cost model returned {found!r} for {ctor}; costs must be non-negative numbers")
        return found

    def body_classes(self, ctor: str, args: tuple) -> list[Any]:
        """The Body classes of a nested node, in order."""
        spec = _terms.BY_CTOR.get(ctor)
        if spec is None or spec.family != _terms.NESTED:
            return []
        out = []
        for letter, a in zip(spec.layout, args):
            if letter == "B":
                out.append(a)
            elif letter == "N":
                out.extend(self.snap.list_items(a))
        return out

    # ------------------------------------------------------------------ tree pass
    def tree(self, allowed: Callable[[Any, str, tuple], bool] | None = None) -> tuple[dict, dict]:
        """Cheapest node per class (children settled first). Returns (cost, choice)."""
        entries: list[tuple[Any, str, tuple, list[Any]]] = []
        parents: dict[Any, list[int]] = {}
        pending: list[int] = []
        heap: list[tuple[float, int]] = []
        cost: dict[Any, float] = {}
        choice: dict[Any, tuple] = {}
        for cls, ns in self.snap.nodes.items():
            for ctor, args in ns:
                if allowed is not None and not allowed(cls, ctor, args):
                    continue
                kids = list(dict.fromkeys(self.children(ctor, args)))
                i = len(entries)
                entries.append((cls, ctor, args, kids))
                pending.append(len(kids))
                for k in kids:
                    parents.setdefault(k, []).append(i)
                if not kids:
                    heap.append((self.own(cls, ctor, args, choice), i))
        heapq.heapify(heap)
        while heap:
            c, i = heapq.heappop(heap)
            cls, ctor, args, _ = entries[i]
            if cls in cost:
                continue
            cost[cls] = c
            choice[cls] = (ctor, args)
            for p in parents.get(cls, ()):
                pending[p] -= 1
                if pending[p] == 0:
                    pcls, pctor, pargs, pkids = entries[p]
                    if pcls not in cost:
                        heapq.heappush(heap, (self._total(pcls, pctor, pargs, pkids, cost, choice), p))
        return cost, choice

    def _total(self, cls: Any, ctor: str, args: tuple, kids: list[Any], cost: dict, choice: dict) -> float:
        bodies = self.body_classes(ctor, args)
        if bodies:
            info = self.info(cls, ctor, args, choice, tuple(cost[b] for b in bodies))
            own = float(self.model(info))
            skip = set(bodies) | {a for s, a in zip(_terms.ctor_arg_sorts(ctor), args) if s == "BList"}
            return own + sum(cost[k] for k in kids if k not in skip)
        return self.own(cls, ctor, args, choice) + sum(cost[k] for k in kids)

    # ------------------------------------------------------------------ DAG cost
    def dag_cost(self, choice: dict[Any, tuple], roots: Iterable[Any]) -> float:
        """Each class once per scope; a body once per execution of its node."""
        body_memo: dict[Any, float] = {}

        def scope(start: Iterable[Any]) -> float:
            total = 0.0
            for c in walk(start, lambda c: self.term_kids(choice[c])):
                ctor, args = choice[c]
                bodies = self.body_classes(ctor, args)
                if bodies:
                    bcosts = []
                    for b in bodies:
                        if b not in body_memo:
                            _, (_, outs) = choice[b]
                            body_memo[b] = scope(self.snap.list_items(outs))
                        bcosts.append(body_memo[b])
                    total += float(self.model(self.info(c, ctor, args, choice, tuple(bcosts))))
                else:
                    total += self.own(c, ctor, args, choice)
            return total

        try:
            return scope(roots)
        finally:
            del scope  # a recursive closure is a reference cycle; it would hold this extractor (and the
            # e-graph, which then goes back to its pool, _egraph._POOL, only at a full collection)


def _crossings(ref: dict[Any, int], choice: Mapping[Any, tuple], kids: Callable[[tuple], Any], c: Any,
              delta: int) -> Iterator[Any]:
    """Count one more (``delta=1``) or one fewer (``-1``) reader of class ``c`` in ``ref``, and yield each
    class that comes into the program or leaves it: ``c`` when its count crosses between 0 and 1, then,
    through the chosen nodes (``kids`` of ``choice[x]``), what only it read. A class is yielded before
    its kids are walked, so a caller's sums run in one fixed order."""
    stack = [c]
    while stack:
        x = stack.pop()
        n = ref.get(x, 0) + 1 if delta > 0 else ref[x] - 1
        ref[x] = n
        if n == (1 if delta > 0 else 0):
            yield x
            stack.extend(kids(choice[x]))


class LocalSearch:
    """Improve a choice under the true DAG cost by switching one class, or one loop, at a time.

    Reference counts over the chosen program give each move's cost change
    without re-costing the whole program. A *group move* switches every chosen
    projection of one multi-result node (a scan, say) to the matching
    projections of another: a rewrite that replaces a loop pays off only when
    all of the old loop's outputs move at once, which no single move sees.
    Moves are only taken when they lower the cost and keep the program acyclic.
    Every projection of a loop offers the same group move; one that failed is
    not made again until a move is taken. Only the program's own scope is
    searched; bodies keep the bottom-up pass's choice.
    """

    def __init__(self, ex: Extractor, choice: dict[Any, tuple], roots: Sequence[Any]) -> None:
        self.ex = ex
        self.choice = dict(choice)
        self.roots = list(roots)
        self.ref: dict[Any, int] = {}
        self.cost = 0.0
        self._body_memo: dict[Any, float] = {}
        self._costs: dict[tuple, float] = {}
        #: moves (their targets) that failed since the last improvement -> whether adopting could add to them
        self._failed: dict[frozenset, bool] = {}
        #: after a failed move of a projection: whether the same move with ``adopt`` would differ
        self.adopts = True
        for r in self.roots:
            self._inc(r)

    def kids(self, node: tuple) -> list[Any]:
        return self.ex.term_kids(node)

    def own(self, c: Any, node: tuple) -> float:
        ctor, args = node
        if ctor == "Proj":  # its price reads the node it projects
            return self.ex.own(c, ctor, args, self.choice)
        found = self._costs.get((c, node))
        if found is not None:
            return found
        bodies = self.ex.body_classes(ctor, args)
        if not bodies:
            found = self.ex.own(c, ctor, args, self.choice)
        else:
            costs = []
            for b in bodies:
                if b not in self._body_memo:
                    _, (_, outs) = self.choice[b]
                    self._body_memo[b] = self.ex.dag_cost(self.choice, self.ex.snap.list_items(outs))
                costs.append(self._body_memo[b])
            found = float(self.ex.model(self.ex.info(c, ctor, args, self.choice, tuple(costs))))
        # Bodies keep their choice during the search (their costs are remembered above), so a node's cost is fixed.
        self._costs[(c, node)] = found
        return found

    def _inc(self, c: Any) -> None:
        for x in _crossings(self.ref, self.choice, self.ex.term_kids, c, 1):
            self.cost += self.own(x, self.choice[x])

    def _dec(self, c: Any) -> None:
        for x in _crossings(self.ref, self.choice, self.ex.term_kids, c, -1):
            self.cost -= self.own(x, self.choice[x])

    def _set(self, c: Any, node: tuple) -> None:
        old = self.choice[c]
        ref = self.ref
        for k in self.kids(node):
            n = ref.get(k, 0)
            if n:
                ref[k] = n + 1  # in use already: nothing below it changes
            else:
                self._inc(k)
        self.cost -= self.own(c, old)
        self.choice[c] = node
        self.cost += self.own(c, node)
        for k in self.kids(old):
            n = ref[k]
            if n > 1:
                ref[k] = n - 1  # still in use
            else:
                self._dec(k)

    def _try(self, c: Any, alt: tuple, adopt: bool = False) -> bool:
        """Switch ``c`` to ``alt``; if ``alt`` projects a multi-result node, move that node's siblings too.

        With ``adopt``, every class in use that the new node offers moves to
        it as well: a loop that computes several of the program's results
        (two reductions hoisted into one loop, say) pays only when all of
        them move at once.
        """
        before = self.cost
        applied: list[tuple[Any, tuple]] = []

        def apply(x: Any, node: tuple) -> None:
            applied.append((x, self.choice[x]))
            self._set(x, node)

        apply(c, alt)
        key = None
        self.adopts = True
        if alt[0] == "Proj":
            new_tup = alt[1][0]
            parents = self.ex.snap.parents.get(new_tup, ())
            olds = []
            for parent, node in parents:
                cur = self.choice.get(parent)
                if (node[0] == "Proj" and cur is not None and cur[0] == "Proj" and cur[1][0] != new_tup
                        and self.ref.get(parent, 0) > 0 and cur[1][0] not in olds):
                    olds.append(cur[1][0])
            if not adopt and len(olds) <= 1:
                # The moves are known before they are made (one group, listed in this state), and every
                # projection of a loop leads to the same ones: a move that failed since the last improvement fails.
                group = self._group(olds[0], new_tup) if olds else []
                key = frozenset([(c, alt), *group])
                if key in self._failed:
                    self.adopts = self._failed[key]
                    self._set(c, applied[0][1])
                    return False
            for old_tup in olds:
                for x, node in self._group(old_tup, new_tup):
                    apply(x, node)
            if adopt:
                for parent, node in parents:
                    if node[0] == "Proj" and self.ref.get(parent, 0) > 0 and self.choice.get(parent) != node:
                        apply(parent, node)
        moved = {x for x, _ in applied}
        new_kids = [k for x, _ in applied for k in self.kids(self.choice[x])]
        cheaper = self.cost < before - 1e-9 * max(1.0, abs(before))
        cyclic = self.ex.reaches(self.choice, new_kids, moved) if cheaper or key is not None else False
        if cheaper and not cyclic:
            self._failed.clear()
            return True
        if key is not None:
            # Whether the same move with ``adopt`` would move more: none left to adopt is the same move. (With a
            # cycle the reference counts depend on the order of the moves, so that is left to the move itself.)
            self.adopts = cyclic or any(
                node[0] == "Proj" and self.ref.get(parent, 0) > 0 and self.choice.get(parent) != node
                for parent, node in parents)
            self._failed[key] = self.adopts
        for x, node in reversed(applied):
            self._set(x, node)
        return False

    def run(self, passes: int = 4) -> dict[Any, tuple]:
        nodes = self.ex.snap.nodes
        for _ in range(passes):
            improved = False
            for c in [c for c in list(self.ref) if len(nodes.get(c, ())) > 1]:
                for alt in nodes[c]:
                    if self.ref.get(c, 0) == 0:
                        break
                    if alt == self.choice[c] or alt[0] in _CONTAINERS or any(
                            k not in self.choice for k in self.kids(alt)):
                        continue
                    if self._try(c, alt) or (alt[0] == "Proj" and self.adopts and self._try(c, alt, adopt=True)):
                        improved = True
            if not improved:
                break
        return self.choice

    def _group(self, old_tup: Any, new_tup: Any) -> list[tuple[Any, tuple]]:
        """Chosen projections of ``old_tup`` still in use, each with ``new_tup``'s matching projection."""
        moves = []
        for parent, node in self.ex.snap.parents.get(old_tup, ()):
            if node[0] != "Proj" or self.choice.get(parent) != node or self.ref.get(parent, 0) == 0:
                continue
            for alt in self.ex.snap.nodes[parent]:
                if alt[0] == "Proj" and alt[1][0] == new_tup:
                    moves.append((parent, alt))
                    break
        return moves


def search(ex: Extractor, choice: dict[Any, tuple], roots: Sequence[Any]) -> dict[Any, tuple]:
    """Local search over the program's scope, then inside the bodies it runs (innermost first), then again.

    A rewrite inside a loop body (a loop nested in a loop, say) is decided
    there: the body's own choice is improved under the body's DAG cost, which
    the outer loop multiplies by its trip count.
    """
    choice = LocalSearch(ex, choice, roots).run()
    before = dict(choice)
    choice = _search_bodies(ex, choice, roots, set())
    if choice != before:
        choice = LocalSearch(ex, choice, roots).run()
    return choice


def _search_bodies(ex: Extractor, choice: dict[Any, tuple], roots: Sequence[Any], done: set[Any]) -> dict[Any, tuple]:
    bodies: list[Any] = []
    for c in walk(roots, lambda c: ex.term_kids(choice[c])):  # the nested nodes of this scope, not their bodies
        bodies.extend(ex.body_classes(*choice[c]))
    for b in bodies:
        if b in done:
            continue
        done.add(b)
        outs = ex.snap.list_items(choice[b][1][1])
        choice = _search_bodies(ex, choice, outs, done)
        choice = LocalSearch(ex, choice, outs).run()
    return choice


def prices_programs(model: Any) -> bool:
    """Does ``model`` declare a whole-program price (:attr:`rewrite.CostModel.prices_programs`)?"""
    return isinstance(model, CostModel) and bool(model.prices_programs)


class ProgramPricer:
    """The whole-program price of a choice under ``model.program``, with per-node work cached."""

    def __init__(self, ex: "Extractor", model: Any) -> None:
        self.ex = ex
        self.model = model
        self._templates: dict = {}
        self._shared: dict = {}
        self._nested: bool | None = None
        self._bodies: dict = {}
        self._known: dict[tuple, float] = {}
        #: whole-program prices (not live sums, in another order) of the programs priced whole, by key
        self.exact: dict[tuple, float] = {}
        #: the program the last price was asked for (its roots and signature)
        self.last_key: tuple | None = None
        self.evaluations = 0
        #: how many prices were asked for, and how many of those were of a program priced before
        self.asked = 0
        #: the one program every price moves to (:meth:`live`), once one is made
        self._live: LiveProgram | None = None

    def own(self, c: Any, node: tuple, choice: dict[Any, tuple]) -> float:
        ctor, args = node
        bodies = self.ex.body_classes(ctor, args)
        if not bodies:
            return self.ex.own(c, ctor, args, choice)
        costs = []
        for b in bodies:
            # A body's cost depends on the choice inside it, which differs between candidates (searches
            # switch classes of the program's own scope only, so it is fixed within one search).
            key = (id(choice), b)
            if key not in self._bodies:
                _, (_, outs) = choice[b]
                self._bodies[key] = self.ex.dag_cost(choice, self.ex.snap.list_items(outs))
            costs.append(self._bodies[key])
        return float(self.model(self.ex.info(c, ctor, args, choice, tuple(costs))))

    def program(self, choice: dict[Any, tuple], roots: Sequence[Any]) -> Any:
        from ..cost.fusion import Program

        return Program.from_choice(self.ex, choice, roots, lambda c, n: self.own(c, n, choice),
                                   self.templates(choice, roots))

    def templates(self, choice: dict[Any, tuple], roots: Sequence[Any]) -> dict:
        """Per-node facts of the programs ``choice`` makes (shared by all choices when no node has a body)."""
        if not self._has_bodies(choice, roots):
            return self._shared
        found = self._templates.get(id(choice))
        if found is None:
            found = self._templates[id(choice)] = _ChoiceTemplates(self.ex, self._shared)
        return found

    def remember(self, key: tuple, price: Callable[[], float]) -> float:
        """The price of the program ``key`` names (``_signature``), from memory or from ``price()``."""
        self.asked += 1
        self.last_key = key
        found = self._known.get(key)
        if found is None:
            self.evaluations += 1
            found = self._known[key] = price()
        return found

    def live(self, choice: dict[Any, tuple], roots: Sequence[Any]) -> "LiveProgram | None":
        """A :class:`LiveProgram` over ``choice`` (kept up to date in place), if the model can price one.

        There is one per pricer: asked again, it moves to the new choice
        (:meth:`LiveProgram.jump`), re-placing and re-pricing only the kernels
        where the two programs differ. The searches of one extraction start
        from programs that differ in few classes, and building the kernels
        of a program afresh costs about twice as much as pricing it whole.
        """
        live = self._live
        if live is not None and live._roots == tuple(roots):
            live.jump(choice)
            return live
        fusion = getattr(self.model, "program_fusion", None)
        fusion = fusion() if fusion is not None else None
        if fusion is None:
            return None
        live = self._live = LiveProgram(self, fusion, choice, roots)
        return live

    def _has_bodies(self, choice: dict[Any, tuple], roots: Sequence[Any]) -> bool:
        """Whether the program has nested nodes, whose prices depend on the choice (so no sharing of prices)."""
        if self._nested is None:
            self._nested = any(_terms.BY_CTOR.get(ctor) is not None and _terms.BY_CTOR[ctor].family == _terms.NESTED
                               for ns in self.ex.snap.nodes.values() for ctor, _ in ns)
        return self._nested

    def __call__(self, choice: dict[Any, tuple], roots: Sequence[Any]) -> float:
        """The price of the program ``choice`` makes at ``roots``; each distinct program is priced once.

        A program is the set of chosen nodes it uses (bodies included), so
        a search that tries a move it tried before, or that reaches from
        another start a program it priced already, is answered from memory.
        """
        key = (tuple(roots), _signature(self.ex, choice, roots))
        return self.remember(key, lambda: self.exact_price(choice, roots, key))

    def exact_price(self, choice: dict[Any, tuple], roots: Sequence[Any], key: tuple) -> float:
        """The whole-program price of ``choice`` (whose key is ``key``), remembered from an earlier one if any."""
        found = self.exact.get(key)
        if found is None:
            found = self.exact[key] = self.price(self.program(choice, roots))
        return found

    def price(self, prog: Any) -> float:
        """The model's whole-program price of ``prog``."""
        return float(self.model.program(prog))

    def price_fused(self, fusion: Any) -> float:
        """The model's price of the program a :class:`rewrite.cost.fusion.LiveFusion` holds."""
        return float(fusion.price())


class _ChoiceTemplates(dict):
    """The per-node facts (``_fusion.chosen_op``) of the programs one choice makes, where nodes have bodies.

    Only a node with bodies (its price reads its bodies' choice) or a projection (its price reads the
    projected node) has facts that depend on the choice; the facts of every other node are kept in
    ``shared``, for every choice.
    """

    __slots__ = ("ex", "shared")

    def __init__(self, ex: "Extractor", shared: dict) -> None:
        super().__init__()
        self.ex = ex
        self.shared = shared

    def get(self, key: tuple, default: Any = None) -> Any:
        found = dict.get(self, key)
        return self.shared.get(key, default) if found is None else found

    def __setitem__(self, key: tuple, value: Any) -> None:
        node = key[1]
        if node[0] == "Proj" or self.ex.body_classes(*node):
            dict.__setitem__(self, key, value)
        else:
            self.shared[key] = value


class LiveProgram:
    """The program a choice makes, kept up to date as single classes switch node: what :class:`ProgramSearch` prices.

    Reference counts over what each chosen node reads tell which classes a
    move brings into the program and which it leaves behind: over its own
    scope for the kernels (a :class:`rewrite.cost.fusion.LiveFusion`, which
    re-places and re-prices only what the move touches), and over bodies too
    for the program's signature (``_signature``), so that a move to a program
    priced before is answered from the pricer's memory. ``choice`` is
    updated in place. Prices equal the pricer's whole-program ones up to the
    order of the sums.
    """

    def __init__(self, pricer: ProgramPricer, fusion: Any, choice: dict[Any, tuple], roots: Sequence[Any]) -> None:
        from ..cost.fusion import LiveFusion

        # A proxy: the pricer keeps this program (ProgramPricer.live), and a cycle would keep the e-graph
        # from its pool until a full collection.
        self.pricer = pricer = weakref.proxy(pricer) if not isinstance(pricer, weakref.ProxyType) else pricer
        self.ex = pricer.ex
        self.roots = list(roots)
        self._roots = tuple(roots)
        self.fusion = LiveFusion(fusion, self.roots)
        self._bind(choice)
        self._ref: dict[Any, int] = {}   # own scope: what the kernels are made of
        self._sig: dict[Any, int] = {}   # bodies included: the signature
        self._ids: set[int] = set()
        self._fused: dict[Any, tuple] = {}  # the node each class has in self.fusion
        self._touched: set[Any] = set()
        #: classes whose op inlines a call's body, with the classes of that body (a move there changes the op)
        self._inlined: dict[Any, set] = {}
        #: classes whose op is built again at the next flush though their node is the same (see jump)
        self._stale: set[Any] = set()
        for r in self.roots:
            self._inc(r)
            self._inc_sig(r)

    def _bind(self, choice: dict[Any, tuple]) -> None:
        pricer = self.pricer
        self.choice = choice
        self._own = lambda c, n: pricer.own(c, n, choice)
        self._templates = pricer.templates(choice, self.roots)

    def jump(self, choice: dict[Any, tuple]) -> None:
        """Become the program ``choice`` makes (updated in place from now on): any choice, not one move away.

        The reference counts are counted afresh; the kernels are edited
        where a class's node differs, and where an op reads the choice
        beyond its own node (a nested node's bodies, a projection's loop,
        an inlined call's body), which is built again.
        """
        if choice is self.choice:
            return
        old = self.choice
        self._bind(choice)
        ex, fused = self.ex, self._fused
        ref: dict[Any, int] = {}
        sig: dict[Any, int] = {}
        touched = self._touched
        for r in self.roots:
            touched.update(_crossings(ref, choice, ex.operands, r, 1))
            for _ in _crossings(sig, choice, ex.all_kids, r, 1):
                pass
        touched.update(fused)
        self._ref, self._sig = ref, sig
        self._ids = {ex.pair_id(x, choice[x]) for x in sig}
        if self.pricer.templates(old, self.roots) is not self._templates:
            # Ops whose facts read the choice (ProgramPricer.templates): built again under the new one.
            self._stale.update(x for x, node in fused.items()
                               if node[0] == "Proj" or x in self._inlined or ex.body_classes(*node))

    def _inc(self, c: Any) -> None:
        self._touched.update(_crossings(self._ref, self.choice, self.ex.operands, c, 1))

    def _dec(self, c: Any) -> None:
        self._touched.update(_crossings(self._ref, self.choice, self.ex.operands, c, -1))

    def _inc_sig(self, c: Any) -> None:
        self._ids.update(
            self.ex.pair_id(x, self.choice[x]) for x in _crossings(self._sig, self.choice, self.ex.all_kids, c, 1))

    def _dec_sig(self, c: Any) -> None:
        self._ids.difference_update(
            self.ex.pair_id(x, self.choice[x]) for x in _crossings(self._sig, self.choice, self.ex.all_kids, c, -1))

    def set(self, c: Any, node: tuple) -> None:
        """Switch class ``c`` (one the program uses) to ``node``; the caller has checked that no cycle results."""
        old = self.choice[c]
        if old == node:
            return
        ex = self.ex
        for k in ex.operands(node):
            self._inc(k)
        for k in ex.all_kids(node):
            self._inc_sig(k)
        if self._sig.get(c, 0) > 0:
            self._ids.discard(ex.pair_id(c, old))
            self._ids.add(ex.pair_id(c, node))
        self.choice[c] = node
        self._touched.add(c)
        for k in ex.operands(old):
            self._dec(k)
        for k in ex.all_kids(old):
            self._dec_sig(k)
        for x, body in self._inlined.items():
            if c in body:
                self._touched.add(x)
                self._fused.pop(x, None)  # its op is built again

    def key(self) -> tuple:
        """The pricer's key for the current program (its roots and signature)."""
        return self._roots, frozenset(self._ids)

    def price(self) -> float:
        """The current program's price, from the pricer's memory or from the kernels the moves touched."""
        return self.pricer.remember(self.key(), self._price)

    def _price(self) -> float:
        self.flush()
        return self.pricer.price_fused(self.fusion)

    def flush(self) -> None:
        """Bring the kernels up to date with the moves made since the last price."""
        from ..cost.fusion import chosen_op

        ex, choice, ref, fused, stale = self.ex, self.choice, self._ref, self._fused, self._stale
        changes: dict[Any, Any] = {}
        for x in self._touched:
            want = choice[x] if ref.get(x, 0) > 0 else None
            if want == fused.get(x) and (want is None or x not in stale):
                continue
            if want is None:
                fused.pop(x, None)
                self._inlined.pop(x, None)
                changes[x] = None
                continue
            fused[x] = want
            op = chosen_op(ex, x, want, choice, self._own, self._templates, tuple(ex.operands(want)))
            if op.memo and "inner" in op.memo:
                self._inlined[x] = set(walk(ex.body_classes(*want), lambda b: ex.all_kids(choice[b])))
            else:
                self._inlined.pop(x, None)
            changes[x] = op
        self._touched.clear()
        stale.clear()
        if changes:
            self.fusion.edit(changes)


class ProgramSearch:
    """Improve a choice under a whole-program price by switching one class at a time.

    A move is priced from the kernels it touches (:class:`LiveProgram`; under
    a model that prices programs its own way, by pricing the whole program
    again). The search runs only on programs of at most ``max_classes``
    classes, for at most ``max_evaluations`` prices of distinct programs, and at most
    ``per_class`` per class of the program it starts from (at least 64): on
    the ecosystem suite the last improving move came within one price per
    class, and the moves after it only confirmed that none improves. A move
    is kept when it lowers the price and keeps the program acyclic. Bodies
    keep their choice.

    Searches from several starts may share ``visited``, the programs every
    search has passed through: a search that reaches a program another one
    passed through stops there, since the other went on from it (and the
    extractor keeps the best of all searches).
    """

    def __init__(self, ex: "Extractor", pricer: ProgramPricer, choice: dict[Any, tuple], roots: Sequence[Any], *,
                 max_classes: int = 400, max_evaluations: int = 3000, per_class: float = 1.0,
                 visited: set | None = None) -> None:
        self.per_class = per_class
        self.visited = set() if visited is None else visited
        self.ex = ex
        self.pricer = pricer
        self.choice = dict(choice)
        self.roots = list(roots)
        self.max_classes = max_classes
        self.max_evaluations = max_evaluations

    def _kids(self, node: tuple) -> list[Any]:
        return self.ex.term_kids(node)

    def _program_classes(self) -> list[Any]:
        return list(walk(self.roots, lambda c: self._kids(self.choice[c])))

    def run(self, passes: int = 3, known: float | None = None) -> tuple[dict[Any, tuple], float]:
        """Improve the choice; ``known`` is the starting choice's price, if the pricer computed it already."""
        self._live: LiveProgram | None | bool = None
        #: the result's key for the pricer (``None``: not known), set by the search
        self.key: tuple | None = None
        choice, best = self._run(passes, known)
        if self._live is False:
            self.key = None  # moves priced whole: the last key asked for need not be the result's
        elif self._live:
            self.key = self._live.key()
        return choice, best

    def _switch(self, c: Any, node: tuple) -> None:
        """Choose ``node`` for ``c`` (the program is priced by :meth:`_price`)."""
        if self._live is None:  # made on the first move: a search over too large a program makes none
            self._live = self.pricer.live(self.choice, self.roots) or False
        if self._live:
            self._live.set(c, node)
        else:
            self.choice[c] = node

    def _price(self) -> float:
        return self._live.price() if self._live else self.pricer(self.choice, self.roots)

    def _adds_loop(self, cur: tuple, alt: tuple) -> bool:
        """Whether moving a projection from ``cur`` to ``alt`` runs a second loop and keeps the first.

        ``alt`` reads a loop the program does not run, and the loop ``cur``
        reads stays for its other outputs: the move adds a whole loop to save
        one output (on the ecosystem suite and the golden programs, 554 such
        moves, none cheaper). Moving all of a loop's outputs at once is
        :class:`LocalSearch`'s group move. Like a move from a literal, which
        costs nothing (264 moves, none cheaper), it is not priced.
        """
        live = self._live
        if not live or cur[0] != "Proj" or alt[0] != "Proj":
            return False
        ref = live._ref
        return ref.get(alt[1][0], 0) == 0 and ref.get(cur[1][0], 0) > 1

    def _run(self, passes: int, known: float | None) -> tuple[dict[Any, tuple], float]:
        nodes = self.ex.snap.nodes
        best = self.pricer(self.choice, self.roots) if known is None else known
        here = self.key = self.pricer.last_key  # the starting program's key: the pricer was last asked for it
        if here in self.visited:
            return self.choice, best
        self.visited.add(here)
        start = self.pricer.evaluations
        classes = self._program_classes()
        budget = min(self.max_evaluations, max(64, int(self.per_class * len(classes))))
        for n in range(passes):
            if n:
                classes = self._program_classes()
            if len(classes) > self.max_classes:
                break
            improved = False
            live = set(classes)
            for c in classes:
                alts = nodes.get(c, ())
                if len(alts) < 2 or c not in live:
                    continue  # a class an earlier move left out of the program: no move of it changes the price
                for alt in alts:
                    if self.pricer.evaluations - start >= budget:
                        return self.choice, best
                    cur = self.choice[c]
                    if alt == cur or alt[0] in _CONTAINERS or any(k not in self.choice for k in self._kids(alt)):
                        continue
                    if _permuted(self.ex, alt, cur):
                        continue  # the same operation on the same operands (a*b for b*a): the same program price
                    if cur[0] == "Lit" or self._adds_loop(cur, alt):
                        continue
                    if self.ex.reaches(self.choice, self._kids(alt), {c}):
                        continue
                    self._switch(c, alt)
                    price = self._price()
                    if price < best - 1e-9 * max(1.0, abs(best)):
                        best = price
                        improved = True
                        if self.pricer.last_key in self.visited:
                            return self.choice, best  # another search went on from here
                        self.visited.add(self.pricer.last_key)
                        live = set(self._program_classes())
                        if c not in live:
                            break
                    else:
                        self._switch(c, cur)
            if not improved:
                break
        return self.choice, best


def _permuted(ex: "Extractor", a: tuple, b: tuple) -> bool:
    """Whether two nodes apply one primitive, with the same parameters, to the same operands in another order."""
    if a[0] != b[0] or a[0] in _LEAVES or a[0] == "Proj" or a[1][-1] != b[1][-1]:
        return False
    ka, kb = ex.term_kids(a), ex.term_kids(b)
    return len(ka) == len(kb) and sorted(ka, key=repr) == sorted(kb, key=repr)


def input_cost(snap: Snapshot, outs: Sequence[int], token: int | None, model: CostModel) -> float:
    """The cost of the program as loaded (before any rule ran), under ``model``."""
    roots = [snap.cls_of_name[o] for o in outs] + ([snap.cls_of_name[token]] if token is not None else [])
    ex = Extractor(snap, model)
    if all(len(ns) == 1 for ns in snap.nodes.values()):
        choice = {c: ns[0] for c, ns in snap.nodes.items()}  # as loaded, nothing to choose (no class reaches itself)
    else:
        _, choice = ex.tree()
    if prices_programs(model):
        pricer = ProgramPricer(ex, model)
        return pricer.price(pricer.program(choice, roots))
    return ex.dag_cost(choice, roots)


def _signature(ex: "Extractor", choice: dict[Any, tuple], roots: Sequence[Any]) -> frozenset:
    """The chosen nodes a program uses (their :meth:`Extractor.pair_id`): equal signatures are the same program."""
    kids, pid = ex.all_kids, ex.pair_id
    return frozenset(pid(c, choice[c]) for c in walk(roots, lambda c: kids(choice[c])))


#: A second ``ProgramSearch`` starts from the input program only where the input prices at most this
#: fraction above the best rewritten candidate. Where it prices more, the search from the rewritten
#: start ended as cheap or cheaper on every one of the 34 ecosystem runs (the input's searches took
#: 4-11 ms of a median program's 90 ms rewrite); where it is as cheap (seed 000's backward pass, an
#: optimizer chain under fastmath), the search from the input found the cheapest program.
INPUT_START = 1e-3


def extract(snap: Snapshot, roots: Sequence[Any], model: CostModel, original: set[tuple] | None) -> Extraction:
    """Choose the program to emit. ``original`` holds the input program's nodes, canonicalised."""
    ex = Extractor(snap, model)
    _, tree_choice = ex.tree()
    missing = [r for r in roots if r not in tree_choice]
    if missing:
        raise RuntimeError("extraction found no finite-cost program for an output; the e-graph is malformed")
    candidates = [(search(ex, tree_choice, roots), True)]
    orig_choice = None
    if original is not None:
        _, orig_choice = ex.tree(lambda cls, ctor, args: ctor in _CONTAINERS or (ctor, args) in original)
        if all(r in orig_choice for r in roots):
            # A rewrite that pays off only from the input program is found by the ProgramSearch from there
            # (below). A local search from it under the node model as a third candidate found the same
            # prices on the golden programs and a 0.002% cheaper one on one of the 34 ecosystem runs, at
            # 5-10% of extraction's time.
            candidates.append((orig_choice, False))
        else:
            orig_choice = None
    if prices_programs(model):
        price = ProgramPricer(ex, model)  # each distinct program is priced once
        # (choice, cost, rewritten, signature): a program's signature is its key for the pricer, kept to be asked once
        priced = []
        for c, r in candidates:
            cost = price(c, roots)
            priced.append((c, cost, r, price.last_key[1]))
        # Refine the best rewritten candidate under the whole-program price, and the input where it is a
        # start as good (see INPUT_START).
        starts = [(c, cost, sig) for c, cost, _, sig in sorted([p for p in priced if p[2]], key=lambda p: p[1])[:1]]
        if orig_choice is not None:
            # The input program again: it reaches only classes of orig_choice (a closed choice), so it is the same program.
            _, cost, _, sig = next(p for p in priced if not p[2])
            if not starts or cost <= starts[0][1] * (1 + INPUT_START):
                starts.append(({**tree_choice, **orig_choice}, cost, sig))
        refined_from: set[frozenset] = set()
        visited: set = set()
        for c, cost, sig in starts:
            if sig in refined_from:
                continue
            refined_from.add(sig)
            price.last_key = (tuple(roots), sig)  # the search starts from the program the pricer was asked for
            refine = ProgramSearch(ex, price, c, roots, visited=visited)
            refined, cost = refine.run(known=cost)
            priced.append((refined, cost, True, None if refine.key is None else refine.key[1]))
    else:
        priced = [(c, ex.dag_cost(c, roots), r, None) for c, r in candidates]
    distinct: dict[frozenset, tuple[dict, float, bool]] = {}
    for choice, cost, rewritten, sig in priced:
        key = _signature(ex, choice, roots) if sig is None else sig
        old = distinct.get(key)
        if old is None or (old[2] and not rewritten):  # the same program as the input is the input
            distinct[key] = (choice, cost, rewritten)
    ranked = sorted(distinct.values(), key=lambda t: (t[1], t[2]))
    best = ranked[0]
    orig_cost = next((c for _, c, r in ranked if not r), math.inf)
    # Ties go to the input program, and so do savings smaller than the model's ``min_saving``.
    keep_below = max(0.0, float(getattr(model, "min_saving", 0.0) or 0.0))
    for choice, cost, rewritten in ranked:
        if not rewritten and cost <= best[1] * (1 + 1e-9) + keep_below * cost:
            best = (choice, cost, rewritten)
    return Extraction(best[0], best[1], orig_cost, best[2], ranked)


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
    import sys

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
