"""The node model: every class's cheapest node bottom-up, and a local search under the true DAG cost.

:class:`Extractor` prices nodes under a cost model and chooses, bottom up,
every class's cheapest node given its children's costs (acyclic by
construction); :class:`LocalSearch` improves a choice under the DAG cost
(each class once per scope, a body once per execution of its loop).
"""

from __future__ import annotations

import functools
import heapq
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from ..cost.model import AnalyticCost, CostModel, NodeInfo
from ..cost.prices import price_of
from ..ir import primitives as _primitives
from ..ir import terms as _terms
from ..ir.egraph import Snapshot
from ..ir.intern import PARAMS, TupleType
from ..ir.walk import children, operands, term_children, walk
from .kin import enter, kin_pass, kin_rank, settle


_CONTAINERS = {"TNil", "TCons", "Body", "BNil", "BCons"}


_LEAVES = _terms.LEAVES


def shared(snap: Snapshot, model: CostModel) -> "Extractor":
    """The extractor of ``snap`` under ``model`` that every extraction from that snapshot uses (a VJP extracts its
    joint program and its gradients alone, and prices its splits, from one): each node is priced and the tree
    pass made once. It lives as long as the snapshot, which it reads through a weak proxy (no cycle keeps the
    snapshot's native tables alive till a full collection). Only for a snapshot whose nodes no longer change."""
    for m, ex in snap.extractors:
        if m is model:
            return ex
    ex = Extractor(weakref.proxy(snap), model)
    snap.extractors.append((model, ex))
    return ex


def _prices(snap: Snapshot, model: CostModel) -> dict[tuple, float]:
    """The node prices under ``model`` that the extractors of ``snap`` share (``Snapshot.prices``)."""
    shelf = getattr(snap, "prices", None)
    if shelf is None:  # (a stand-in for a snapshot)
        return {}
    for m, prices in shelf:
        if m is model:
            return prices
    prices = {}
    shelf.append((model, prices))
    return prices


class Extractor:
    def __init__(self, snap: Snapshot, model: CostModel) -> None:
        self.snap = snap
        self.model = model
        self._own: dict[tuple, float] = _prices(snap, model)
        #: whether ``model`` keeps node prices across snapshots by :meth:`node_key` (``cost/prices.py``)
        self._keeps = type(model) is AnalyticCost
        self._unique_kids: dict[tuple, list[Any]] = {}
        self._class_order: dict[Any, int] | None = None
        self._kids: dict[tuple, list[Any]] = {}
        self._operands: dict[tuple, list[Any]] = {}
        self._all_kids: dict[tuple, list[Any]] = {}
        self._pair_ids: dict[tuple, int] = {}
        #: the whole-program prices of this snapshot's programs by key (roots, signature), for every pricer of this
        #: extractor (``ProgramPricer.exact``): a price reads the program alone, not what else the snapshot holds
        self.whole_prices: dict[tuple, float] = {}
        #: and the predicted peaks its pricers' live programs read (``ProgramPricer.peaks``), by key alike
        self.peaks: dict[tuple, int] = {}
        #: the per-node facts of the ops its pricers' programs are made of (``ProgramPricer.templates``)
        self.templates: dict[tuple, tuple] = {}
        self._tree: tuple[dict, dict] | None = None
        #: the tree pass restricted to a program's own nodes, by that set (kept alive here, so its id stays its)
        self._original_trees: dict[int, tuple[set, dict]] = {}
        #: how many tree passes this extractor made, unrestricted and restricted (a test reads it)
        self.passes = 0
        #: the unrestricted pass's entries ``(cls, node, kids)`` and, per class, the entries that read it: what
        #: :meth:`_kin_pass` walks up from the classes a kin's nodes differ in
        self._graph: tuple[list, dict] | None = None
        #: extractors of snapshots of the same classes in the same order whose nodes differ in a few classes
        #: (:meth:`share_prices`: ``Snapshot.without``'s copies, both ways), weakly: their tree passes seed this one's
        self._kin: list[weakref.ref] = []
        #: how many classes the unrestricted passes read off a kin's (:meth:`_kin_pass`) passed again (a test reads it)
        self.kin_dirty = 0
        #: whether :attr:`rank` was a kin's (a test reads it)
        self.kin_ranks = 0

    # ------------------------------------------------------------------ node facts
    def term_kids(self, node: tuple) -> list[Any]:
        """The ``Term``/``TList`` children of ``node`` (not bodies), memoised: searches ask often."""
        found = self._kids.get(node)
        if found is None:
            found = self._kids[node] = term_children(node)
        return found

    def operands(self, node: tuple) -> list[Any]:
        """The term classes ``node`` reads, list members spelled out (``ir/walk.py``'s ``operands``), memoised."""
        found = self._operands.get(node)
        if found is None:
            found = self._operands[node] = operands(self.snap, node)
        return found

    def all_kids(self, node: tuple) -> list[Any]:
        """Every child class of ``node``, bodies included (``ir/walk.py``'s ``children``), memoised."""
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
        """A rank per class such that a class can reach another (bodies included), under any choice, only if its rank
        is at least the other's (equal ranks: one strongly connected component of the e-graph).

        Tarjan's algorithm numbers the components sinks first; searches use it to stop a walk
        early when it checks that a move keeps the program acyclic (:meth:`reaches`, its one reader).

        A kin (:attr:`_kin`) whose snapshot holds every node of this one's (``Snapshot.without``'s copy is this
        one's kin so) lends its ranks where it has them: a class reaches through fewer nodes only what it reached
        through more, so its ranks bound this snapshot's reach as well (two classes of a rank need not be one
        component here), and :meth:`reaches`, which only stops a walk where no target can lie below, answers alike.
        """
        lent = kin_rank(self)
        if lent is not None:
            return lent
        nodes = self.snap.nodes
        edges = {c: list({k for n in ns for k in self.all_kids(n)}) for c, ns in nodes.items()}
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
        """Whether the program ``choice`` makes reaches a class of ``targets`` from ``start`` (a cycle check).

        The walk goes into bodies: one choice serves every scope, and a class that a body reads and its own scope
        reads too (a constant's: zeros in a loop's body, and the zeros that loop stacks, proven equal to it) is a
        cycle when it is moved to that loop's output (the loop's program then held itself: a RecursionError)."""
        rank = self.rank
        lo = min(rank.get(t, -1) for t in targets)  # nothing ranked below every target reaches one
        kids = self.all_kids
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
            return NodeInfo(_LEAVES[ctor], _primitives.SPECIAL, {}, (), outs)
        if ctor == "Proj":
            tup, index = args
            of_ctor, of_args = choice[tup]
            of_params = PARAMS.params(of_args[-1]) if of_ctor not in _LEAVES and of_ctor != "Proj" else {}
            of_op = PARAMS.prim(of_args[-1]).name if of_ctor not in _LEAVES and of_ctor != "Proj" else of_ctor
            return NodeInfo("proj", _primitives.SPECIAL, of_params, (snap.aval(tup),), outs, index=index, of=of_op)
        return self._op_info(args[-1], ctor, self._in_avals(ctor, args), outs, body_costs)

    def own(self, cls: Any, node: tuple, choice: dict[Any, tuple]) -> float:
        """The own price of ``node`` (``(ctor, args)``) in class ``cls``, for nodes without bodies, under ``choice``
        (a projection's price reads the node it projects). :meth:`ProgramPricer.own` is the same with bodies."""
        ctor, args = node
        if ctor in _CONTAINERS:
            return 0.0
        key = (cls, ctor, args, choice[args[0]] if ctor == "Proj" else None)
        found = self._own.get(key)
        if found is None:  # (a node of another snapshot, or of another class, may be the same term: kept by its key)
            same = self.node_key(cls, ctor, args, choice) if self._keeps else None
            found = self._own[key] = price_of(self.model, same, lambda: self._priced(cls, ctor, args, choice))
        return found

    def _priced(self, cls: Any, ctor: str, args: tuple, choice: dict[Any, tuple]) -> float:
        """The model's price of a node without bodies, asked afresh; a price that is not a non-negative number is
        refused."""
        found = float(self.model(self.info(cls, ctor, args, choice)))
        if not found >= 0.0:
            raise ValueError(f"cost model returned {found!r} for {ctor}; costs must be non-negative numbers")
        return found

    def keyed_info(self, cls: Any, ctor: str, args: tuple) -> tuple[tuple, NodeInfo]:
        """``(node_key, info)`` of a node without bodies that is neither a leaf nor a projection (neither reads the
        choice then): the avals of its class and operands read once for both, the same objects :meth:`info` and
        :meth:`node_key` read (``cost/program.py``'s op facts take both; 4,876 of flax_long_context_step's first
        call)."""
        out_t, ins = self.snap.aval(cls), self._in_avals(ctor, args)
        outs = tuple(out_t) if isinstance(out_t, TupleType) else (out_t,)
        return (ctor, args[-1], out_t, *ins), self._op_info(args[-1], ctor, ins, outs, ())

    def _in_avals(self, ctor: str, args: tuple) -> tuple:
        """The avals of the operands of node ``(ctor, args)`` (not a leaf nor a projection), as :meth:`info` and
        :meth:`node_key` read them: not an effect's token."""
        reads = self.operands((ctor, args))  # (memoised: a loop's operand list is long, and its price asked often)
        return tuple([self.snap.aval(a) for a in (reads[1:] if ctor == "Effect" else reads)])

    @staticmethod
    def _op_info(pid: Any, ctor: str, ins: tuple, outs: tuple, body_costs: tuple) -> NodeInfo:
        family = _primitives.BY_CTOR.get(ctor, _primitives.DEFAULT).family
        return NodeInfo(PARAMS.prim(pid).name, family, PARAMS.params(pid), ins, outs, body_costs)

    def node_key(self, cls: Any, ctor: str, args: tuple, choice: dict[Any, tuple]) -> tuple:
        """What :meth:`info` reads of node ``(ctor, args)`` in ``cls`` without bodies, as a key: equal keys, equal
        infos (``cost/prices.py`` says why). Its constructor; its params id (one primitive and params for the
        process); its operands' and its class's avals; for a projection, the index and the projected node's
        constructor, params id and aval."""
        snap = self.snap
        if ctor in _LEAVES:
            return (ctor, snap.aval(cls))
        if ctor == "Proj":
            tup, index = args
            of_ctor, of_args = choice[tup]
            of = of_args[-1] if of_ctor not in _LEAVES and of_ctor != "Proj" else None
            return (ctor, index, of_ctor, of, snap.aval(tup), snap.aval(cls))
        return (ctor, args[-1], snap.aval(cls), *self._in_avals(ctor, args))

    def body_classes(self, ctor: str, args: tuple) -> list[Any]:
        """The Body classes of a nested node, in order."""
        spec = _primitives.BY_CTOR.get(ctor)
        if spec is None or spec.family != _primitives.NESTED:
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
        """Cheapest node per class (children settled first). Returns (cost, choice): new dicts, the pass over
        every node made once per extractor where ``allowed`` is ``None``."""
        if allowed is None:
            if self._tree is None:
                self._tree = self._kin_pass() or self._tree_pass(None)
            return dict(self._tree[0]), dict(self._tree[1])
        return self._tree_pass(allowed)

    def original_tree(self, original: set[tuple]) -> dict:
        """:meth:`tree` over the input program's nodes alone (``original``, canonicalised ``(ctor, args)``, and
        the containers): its choice, a new dict. The pass is made once per ``original`` set: a VJP extracts its
        joint program, its gradients alone and its forward from one snapshot, each with the input program as a
        candidate."""
        found = self._original_trees.get(id(original))
        if found is None or found[0] is not original:
            choice = self._tree_pass(lambda cls, ctor, args: ctor in _CONTAINERS or (ctor, args) in original)[1]
            found = self._original_trees[id(original)] = (original, choice)
        return dict(found[1])

    def adopt_original_tree(self, original: set[tuple], choice: dict) -> None:
        """Take ``choice`` as :meth:`original_tree`'s pass over ``original``: the same pass made by another extractor
        over the same nodes in the same order (``extract.policy.same_original_tree``)."""
        self._original_trees.setdefault(id(original), (original, dict(choice)))

    def share_prices(self, of: "Extractor") -> None:
        """Number choices as ``of`` does (:meth:`pair_id`) and share its whole-program prices, peaks and ops' facts
        (:attr:`whole_prices`, :attr:`peaks`, :attr:`templates`): this extractor's snapshot is a copy of ``of``'s with
        fewer nodes (``Snapshot.without``), whose classes are the same, so one key names one program in both, and one
        node the same op. Only before this extractor numbered any choice."""
        if not self._pair_ids and not self.whole_prices and not self.peaks and not self.templates:
            self._pair_ids, self.whole_prices, self.peaks = of._pair_ids, of.whole_prices, of.peaks
            self.templates = of.templates
        if not any(ref() is of for ref in self._kin):  # each seeds the other's tree pass (:meth:`_kin_pass`)
            self._kin.append(weakref.ref(of))
            of._kin.append(weakref.ref(self))
        # a node's children are its own (``ir/walk.py``: read off its constructor and arguments alone), whichever
        # snapshot of the e-graph holds it: asked once for both (not ``_operands``, which reads the snapshot's lists)
        if not self._kids and not self._all_kids and not self._unique_kids:
            self._kids, self._all_kids, self._unique_kids = of._kids, of._all_kids, of._unique_kids

    def tree_of(self, classes: set[Any]) -> tuple[dict, dict]:
        """:meth:`tree` restricted to ``classes`` (a set closed under children), every node of theirs allowed: the
        same choice as ``tree(lambda cls, ctor, args: cls in classes)`` (the classes are taken in the snapshot's
        order, so ties go alike), for the work of those classes alone, not of a test of every node."""
        order = self._class_order
        if order is None:
            order = self._class_order = {c: i for i, c in enumerate(self.snap.nodes)}
        nodes = self.snap.nodes
        return self._tree_pass(None, [(c, nodes[c]) for c in sorted((c for c in classes if c in order),
                                                                    key=order.__getitem__)])

    def _tree_pass(self, allowed: Callable[[Any, str, tuple], bool] | None,
                   items: Sequence[tuple[Any, list]] | None = None) -> tuple[dict, dict]:
        # (its lookups bound once and a nested node told by its constructor: the same entries, prices, sums and heap
        # as :meth:`_total` per entry)
        self.passes += 1
        cost: dict[Any, float] = {}
        choice: dict[Any, tuple] = {}
        entries, _, parents, pending, heap = enter(self, self.snap.nodes.items() if items is None else items, choice,
                                                   allowed)
        if allowed is None and items is None:
            self._graph = (entries, parents)
        heapq.heapify(heap)
        settle(self, entries, parents, pending, heap, cost, choice)
        return cost, choice

    def _kin_pass(self) -> tuple[dict, dict] | None:
        """:meth:`_tree_pass` unrestricted, read off a kin's (:attr:`_kin`) where one has made its own, for the classes
        no changed node lies below (``extract/kin.py``'s ``kin_pass``); ``None`` where no kin has."""
        return kin_pass(self)

    def _total(self, cls: Any, ctor: str, args: tuple, kids: list[Any], cost: dict, choice: dict) -> float:
        bodies = self.body_classes(ctor, args)
        if bodies:
            info = self.info(cls, ctor, args, choice, tuple(cost[b] for b in bodies))
            own = float(self.model(info))
            skip = set(bodies) | {a for s, a in zip(_terms.ctor_arg_sorts(ctor), args) if s == "BList"}
            return own + sum(cost[k] for k in kids if k not in skip)
        return self.own(cls, (ctor, args), choice) + sum(cost[k] for k in kids)

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
                    total += self.own(c, (ctor, args), choice)
            return total

        try:
            return scope(roots)
        finally:
            del scope  # a recursive closure is a reference cycle; it would hold this extractor (and the
            # e-graph, which then goes back to its pool, ir.egraph._POOL, only at a full collection)


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

    def _own(self, c: Any, node: tuple) -> float:
        """``node``'s price in class ``c`` under this search's choice, bodies included (memoised)."""
        ctor, args = node
        if ctor == "Proj":  # its price reads the node it projects
            return self.ex.own(c, node, self.choice)
        found = self._costs.get((c, node))
        if found is not None:
            return found
        bodies = self.ex.body_classes(ctor, args)
        if not bodies:
            found = self.ex.own(c, node, self.choice)
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
        self._count(c, 1)

    def _dec(self, c: Any) -> None:
        self._count(c, -1)

    def _count(self, c: Any, step: int) -> None:
        # _crossings written out (the search's innermost loop): the same walk, the same order of sums; a node's
        # cost is added where its count rises to 1 and taken off where it falls to 0 (``step`` -1: ``cost + -v``
        # is ``cost - v`` exactly)
        ref, choice, kids, costs, own = self.ref, self.choice, self.ex.term_kids, self._costs, self._own
        memo = self.ex._kids
        cost = self.cost
        edge = 1 if step > 0 else 0
        stack = [c]
        while stack:
            x = stack.pop()
            n = ref.get(x, 0) + step
            ref[x] = n
            if n == edge:
                node = choice[x]
                found = costs.get((x, node)) if node[0] != "Proj" else None
                cost += step * (own(x, node) if found is None else found)
                known = memo.get(node)
                stack.extend(kids(node) if known is None else known)
        self.cost = cost

    def _set(self, c: Any, node: tuple) -> None:
        old = self.choice[c]
        ref = self.ref
        for k in self.kids(node):
            n = ref.get(k, 0)
            if n:
                ref[k] = n + 1  # in use already: nothing below it changes
            else:
                self._inc(k)
        self.cost -= self._own(c, old)
        self.choice[c] = node
        self.cost += self._own(c, node)
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


def _signature(ex: "Extractor", choice: dict[Any, tuple], roots: Sequence[Any]) -> frozenset:
    """The chosen nodes a program uses (their :meth:`Extractor.pair_id`): equal signatures are the same program."""
    kids, pid = ex.all_kids, ex.pair_id
    return frozenset(pid(c, choice[c]) for c in walk(roots, lambda c: kids(choice[c])))
