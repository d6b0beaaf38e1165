"""The runtime around one egglog e-graph: batched insertion, naming, lookups and snapshots.

Five facts about egglog 13 shape this module (see ``docs/design.md``):

* Inserting one big nested term is quadratic, and so is parsing one big
  program text. Nodes are therefore built as binding objects and inserted in
  chunks, each chunk the head of a rule with an empty body that runs once.
* A Python value cannot be spliced into an egglog expression. Every ``Term``
  e-class the Python side may need to name again therefore carries a name
  node ``(V id)``, and the Python side keeps, per name, the class's abstract
  value (its shape and dtype), where it came from in the source, and which
  rule made it.
* ``freeze()`` is fast. A :class:`Snapshot` built from it answers the
  questions the saturation loop and the extractor ask.
* Even in chunks, egglog compiles each chunk's rule, some 30 us an action.
  Most nodes, unions and facts are therefore written as rows of one loader
  relation to a file that egglog reads (``loader.py``): a tenth of the cost.
* Declaring the schema and the rules' queries costs more than saturating a
  small program (egglog compiles every rule: 40-80 ms for the built-in
  packs). An e-graph is therefore made once per schema and set of
  declarations, kept in :data:`_POOL`, and lent out behind egglog's
  ``push``; when the :class:`EGraph` that borrowed it is gone, ``pop``
  empties it again for the next rewrite. Both copy or drop every
  declaration (10-20 us a relation or rule), so there are few: one loader
  relation, and one match relation per signature of the rules' queries.
  The schema and the loader are half a new e-graph's cost (20-60 ms; the
  identity packs' 200 queries, 30-80 ms: every text parsed a form at a
  time and once per process, ``loader.commands``), so the rules' queries
  sit above a ``push`` of their own, and an e-graph the pool stops keeping
  for them is popped back to the schema and lent to the next set of rules.
  An egglog e-graph belongs to the thread that made it, so only the main
  thread's are kept.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import threading
import weakref
from typing import Any, Callable, Iterable, Sequence

import jax.numpy as jnp
import numpy as np
from egglog import bindings as eb

from . import primitives as _primitives
from . import terms as _terms
from . import intern as _intern
from .intern import LITERALS, PARAMS, TYPES, content_hash, in_dtype
from .jaxapi import held_as_is
from .loader import (LOAD, LOADER, _SPAN, _flat_ctors, _loader, _Rows, call, commands, int_lit, loader_program,
                     tlist_expr, v_expr)

_CHUNK = 200


@dataclasses.dataclass(frozen=True)
class ListRef:
    """A ``TList`` (or ``BList``) built from named classes: its key, and its egglog expression, made from the key
    only where a node is inserted as an action (most lists are of a node already made, or loaded from rows)."""

    key: tuple

    @functools.cached_property
    def expr(self) -> Any:
        kind, *items = self.key
        if kind == "T":
            return tlist_expr(items)
        expr = call("BNil")
        for scope, outs in reversed(items):
            expr = call("BCons", BodyRef(scope, ListRef(outs)).expr, expr)
        return expr

    def names(self) -> list[int]:
        """The names the list holds: a ``TList``'s items, a ``BList``'s bodies' outputs."""
        kind, *items = self.key
        if kind == "T":
            return list(items)
        return [v for _, outs in items for v in ListRef(outs).names()]


@dataclasses.dataclass(frozen=True)
class BodyRef:
    scope: int
    outs: ListRef

    @property
    def expr(self) -> Any:
        return call("Body", int_lit(self.scope), self.outs.expr)

    def names(self) -> list[int]:
        return self.outs.names()


class _Pool:
    """Empty egglog e-graphs that hold the schema and a prelude (the rules' queries), by their text.

    An e-graph is lent pushed (``push`` saves its empty state) and given back
    popped, so the next borrower finds it as declared. A few per text are kept,
    for the few texts used last: a process rewrites with one or two rule sets.
    Declaring the schema and the loader is most of what a new e-graph costs
    (a prelude of a few rules is a tenth of it), so a lent e-graph holds its
    prelude above a ``push`` of its own: one the pool no longer keeps for its
    prelude is popped back to the schema alone and kept for the next prelude
    (:meth:`_base`), a few per schema.
    An egglog e-graph may only be used by the thread that made it, so only the
    main thread's are kept; other threads make their own each time.
    """

    def __init__(self, per_text: int = 2, texts: int = 4) -> None:
        self._free: dict[tuple[str, str], list[Any]] = {}
        self._bases: dict[str, list[Any]] = {}  # schema -> e-graphs declaring it (and its loader) only
        self._lock = threading.Lock()
        self.per_text, self.texts = per_text, texts

    def take(self, schema: str, prelude: str) -> Any:
        key = (schema, prelude)
        eg = None
        if _main_thread():
            with self._lock:
                free = self._free.pop(key, [])
                eg = free.pop() if free else None
                self._free[key] = free  # most recently used last
        if eg is None:
            eg = self._base(schema)
            eg.run_program(eb.Push(1))  # the prelude's own level: popped, the e-graph declares the schema alone
            if prelude:
                eg.run_program(*commands(eg, prelude))
        eg.run_program(eb.Push(1))
        return eg

    def _base(self, schema: str) -> Any:
        """An e-graph that declares ``schema`` and its loader and nothing else: a kept one, or a new one."""
        if _main_thread():
            with self._lock:
                bases = self._bases.get(schema)
                if bases:
                    return bases.pop()
        eg = eb.EGraph()
        eg.run_program(*commands(eg, schema))
        eg.run_program(*commands(eg, loader_program(schema)))
        return eg

    def give(self, schema: str, prelude: str, eg: Any, made_on_main: bool) -> None:
        if not (made_on_main and _main_thread()):
            return  # made on (or collected on) another thread: egglog forbids using it here
        try:
            eg.run_program(eb.Pop(_SPAN, 1))
        except Exception:  # an e-graph in a state pop cannot undo is dropped, never lent again
            return
        key = (schema, prelude)
        dropped = []
        with self._lock:
            free = self._free.pop(key, [])
            if len(free) < self.per_text:
                free.append(eg)
            else:
                dropped.append((schema, eg))
            self._free[key] = free
            while len(self._free) > self.texts:
                old = next(iter(self._free))
                dropped += [(old[0], e) for e in self._free.pop(old)]
        for old_schema, e in dropped:
            self._keep_base(old_schema, e)

    def _keep_base(self, schema: str, eg: Any) -> None:
        """Pop an e-graph the pool no longer keeps for its prelude back to its schema, and keep it for another."""
        try:
            eg.run_program(eb.Pop(_SPAN, 1))
        except Exception:
            return
        with self._lock:
            bases = self._bases.pop(schema, [])
            if len(bases) < self.per_text:
                bases.append(eg)
            self._bases[schema] = bases  # most recently used last
            while len(self._bases) > self.texts:
                del self._bases[next(iter(self._bases))]


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_POOL = _Pool()


def _literal_memo_key(value: Any, aval: Any) -> tuple | None:
    """A key that determines what :meth:`EGraph.literal` makes of ``value`` typed ``aval`` (its rounding to the
    dtype, its literal id, its facts): a Python scalar by type and ``repr`` (which tells ``-0.0`` from ``0.0``), a
    NumPy scalar or array by type, dtype, shape and bytes; ``None`` for any other value (not kept). A program reads
    the same few literals again and again (``1.0``, ``0``, an epsilon), and each read would round and key it anew."""
    t = type(value)
    if t is float or t is int or t is bool or t is complex:
        return (t, repr(value), aval)
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype != object:
        return (t, value.dtype, value.shape, value.tobytes(), aval)
    return None


class EGraph:
    """One e-graph: the egglog instance plus the Python-side tables for its named classes.

    ``prelude``: egglog declarations (a saturation's match rules) to hold
    besides the schema. The egglog instance comes from :data:`_POOL`, and
    goes back to it when this object is collected.
    """

    def __init__(self, prelude: str = "") -> None:
        schema = _terms.schema()
        self.prelude = prelude
        self.eg = _POOL.take(schema, prelude)
        self._flat = _flat_ctors(schema)  # the constructors loaded from rows
        self._loader = _loader(schema)
        self._give = weakref.finalize(self, _POOL.give, schema, prelude, self.eg, _main_thread())
        self._give.atexit = False
        # the interning tables keep every entry this e-graph may hold while it lives (rewrite/ir/intern.py)
        weakref.finalize(self, _intern.close_generation, _intern.open_generation()).atexit = False
        self.vtype: list[int] = []          # V id -> type id
        self.vsource: list[Any] = []        # V id -> Origin (source_info, ctx) of the equation that made it
        self.vorigin: list[str | None] = []  # V id -> name of the rule that made it, None for the program
        self.consts: dict[int, np.ndarray] = {}
        self._memo: dict[tuple, int] = {}
        self._literals: dict[tuple, int] = {}  # a literal's value and aval, exactly (_literal_memo_key) -> V id
        self._pending: list[Any] = []      # egglog actions, run as the heads of rules
        self._rows: list[tuple[int, ...]] = []  # rows of the loader relation, kind id first (see loader_program)
        self._changes = 0  # counts the runs and flushes that may have changed the e-graph
        # The last snapshot while someone holds it (a weak reference: a snapshot refers to its e-graph,
        # which goes back to the pool when collected), and the count of changes it was taken at.
        self._snap: tuple[int, Any] = (-1, lambda: None)
        self._chunks = 0
        self._ints: dict[int, Any] = {}
        self._next_scope = 1  # scope 0 is the program's own
        self._next_input: dict[int, int] = {}  # scope -> an input index no Param of it uses yet
        self.origin: str | None = None     # rule name stamped on nodes made now
        self.source: Any = None            # Origin stamped on nodes made now (a rule's match root)
        self.defs: list[tuple[str, tuple]] = []  # V id -> the node it was made for (args as given)
        self.shared_bodies: Any = None  # loading programs in turn, bodies shared between them (jaxpr/load.py)

    def release(self) -> None:
        """Give the egglog instance back to the pool now: this e-graph is not used again.

        Otherwise it goes back when this object is collected, which an object
        made during the rewrite (a rule's closure, say) can put off until the
        collector finds the cycle it is in; meanwhile the next rewrite finds
        the pool empty and declares a new instance (50-150 ms).
        """
        self._give()
        self.eg = None

    # ------------------------------------------------------------------ building
    def new_scope(self) -> int:
        self._next_scope += 1
        return self._next_scope - 1

    def fresh_input(self, scope: int) -> int:
        """An input index of body ``scope`` that no ``Param`` uses, reserved for the caller.

        Two rules that each add an input to one shared body (an accumulator,
        say) must not both take the same index: ``Param(scope, i)`` is one
        e-node, and its type would be whichever rule made it first.
        """
        i = self._next_input.get(scope, 0)
        self._next_input[scope] = i + 1
        return i

    def term(self, ctor: str, args: Sequence[Any], type_id: int, source: Any = None) -> int:
        """Insert (lazily) a ``Term`` node and return the V id naming its class.

        ``args`` follow the constructor's sorts: V ids for ``Term``, ints for
        ``i64``, :class:`ListRef`/:class:`BodyRef` for the container sorts.
        """
        key = (ctor, tuple([a if type(a) is int else _key(a) for a in args]))  # (most arguments are ids)
        found = self._memo.get(key)
        if found is not None:
            return found
        sorts = _terms.ctor_arg_sorts(ctor)
        if len(sorts) != len(args):
            raise TypeError(f"constructor {ctor} takes {len(sorts)} arguments, got {len(args)}")
        if ctor == "Param":
            scope, index = args
            self._next_input[scope] = max(self._next_input.get(scope, 0), index + 1)
        vid = self._new_name(type_id, source)
        self.defs.append((ctor, tuple(args)))
        if ctor in self._flat:
            self._rows.append((self._loader.ids[ctor], vid, *map(int, args)))
        elif (row := self._list_row(ctor, sorts, args)) is not None:
            self._rows.append((row[0], vid, *row[1:]))
        else:
            exprs = [self._expr(sort, a) for sort, a in zip(sorts, args)]
            self._pending.append(eb.Union(_SPAN, v_expr(vid), call(ctor, *exprs)))
        spec = _primitives.BY_CTOR.get(ctor)
        if spec is not None and spec.param_facts:  # facts about its params (an even integer_pow's)
            params = PARAMS.params(args[-1])
            for rel, holds in spec.param_facts.items():
                if holds(params):
                    self._rows.append((self._loader.ids[rel], int(args[-1])))
        self._memo[key] = vid
        return vid

    def canonical(self, snap: "Snapshot", vid: int) -> tuple[str, tuple] | None:
        """The node name ``vid`` was made for, with its arguments as classes of ``snap``."""
        ctor, args = self.defs[vid]
        out = []
        for s, a in zip(_terms.ctor_arg_sorts(ctor), args):
            if s == "Term":
                out.append(snap.cls_of_name[a])
            elif s == "i64":
                out.append(a)
            else:
                c = self._container(snap, a)
                if c is None:
                    return None
                out.append(c)
        return ctor, tuple(out)

    def _container(self, snap: "Snapshot", ref: Any) -> Any:
        if isinstance(ref, BodyRef):
            outs = self._container(snap, ref.outs)
            return None if outs is None else self.lookup("Body", [self.int_value(ref.scope), outs])
        kind, *items = ref.key
        if kind == "T":
            lst = self.lookup("TNil", [])
            for vid in reversed(items):
                lst = None if lst is None else self.lookup("TCons", [snap.cls_of_name[vid], lst])
            return lst
        lst = self.lookup("BNil", [])
        for scope, outs_key in reversed(items):
            outs = self._container(snap, ListRef(outs_key))
            body = None if outs is None else self.lookup("Body", [self.int_value(scope), outs])
            lst = None if lst is None or body is None else self.lookup("BCons", [body, lst])
        return lst

    def _new_name(self, type_id: int, source: Any) -> int:
        vid = len(self.vtype)
        self.vtype.append(type_id)
        # Nodes a rule builds take the matched root's origin: errors and profiles then point
        # at the user's program, and the equation context matches the scope it lives in.
        self.vsource.append(self.source if self.source is not None else source)
        self.vorigin.append(self.origin)
        return vid

    def _list_row(self, ctor: str, sorts: Sequence[str], args: Sequence[Any]) -> tuple[int, ...] | None:
        """The loader row (kind id, then columns) of a node whose list's length is in rows (LIST_ROWS), or None."""
        lists = self._loader.lists
        if not lists:
            return None
        row: list[int] = []
        kind = None
        for srt, a in zip(sorts, args):
            if srt in ("Term", "i64"):
                row.append(int(a))
            elif srt == "TList" and kind is None and isinstance(a, ListRef) and a.key[0] == "T":
                kind = lists.get((ctor, len(a.key) - 1))
                if kind is None:
                    return None
                row.extend(a.key[1:])
            else:
                return None
        return None if kind is None else (kind, *row)

    def _expr(self, sort: str, a: Any) -> Any:
        if sort == "Term":
            return v_expr(a)
        if sort == "i64":
            return int_lit(a)
        if isinstance(a, (ListRef, BodyRef)):
            return a.expr
        raise TypeError(f"cannot use {a!r} as {sort}")

    def tlist(self, refs: Iterable[int]) -> ListRef:
        return ListRef(("T",) + tuple(refs))

    def body(self, scope: int, outs: Iterable[int]) -> BodyRef:
        return BodyRef(scope, self.tlist(outs))

    def blist(self, bodies: Iterable[BodyRef]) -> ListRef:
        return ListRef(("B",) + tuple((b.scope, b.outs.key) for b in bodies))

    def literal(self, value: Any, aval: Any) -> int:
        same = _literal_memo_key(value, aval)
        found = self._literals.get(same) if same is not None else None
        if found is not None:
            return found
        made = _LITERALS_MADE.get(same) if same is not None else None
        if made is None:  # (literal ids are never dropped: LiteralTable)
            value = in_dtype(value, aval.dtype)
            made = (LITERALS.intern_value(value), _facts_of(value))
            if same is not None:
                if len(_LITERALS_MADE) >= _LITERALS_KEEP:
                    _LITERALS_MADE.clear()
                _LITERALS_MADE[same] = made
        lit, facts = made
        n = self.num_names
        vid = self.term("Lit", [lit, TYPES.intern_aval(aval)], TYPES.intern_aval(aval))
        if vid == n:
            for fact in facts:
                self.assert_fact(fact, vid)
        if same is not None:
            self._literals[same] = vid
        return vid

    def const(self, array: Any, aval: Any) -> int:
        h = content_hash(array)
        self.consts.setdefault(h, array if held_as_is(array) else np.asarray(array))  # (emit.const_array)
        n = self.num_names
        vid = self.term("Const", [h], TYPES.intern_aval(aval))
        if vid == n:
            for fact in _facts_of(array):
                self.assert_fact(fact, vid)
        return vid

    def union(self, a: int, b: int) -> None:
        if a != b:
            self._rows.append((self._loader.ids["union"], a, b))

    def assert_fact(self, fact: str, vid: int) -> None:
        self._rows.append((self._loader.ids[fact], vid))

    @property
    def num_names(self) -> int:
        return len(self.vtype)

    def flush(self) -> bool:
        """Insert everything pending. Returns whether the e-graph changed."""
        if not self._pending and not self._rows:
            return False
        commands: list[Any] = []
        files: list[str] = []
        if self._rows:
            rows, self._rows = self._rows, []
            try:
                commands, files = _Rows.commands(rows, self._loader)
            except OSError:  # no temporary folder to write to: the rows go as actions, as nodes did
                self._pending = _Rows.actions(rows, self._loader) + self._pending
            else:
                commands.append(eb.RunSchedule(eb.Run(_SPAN, eb.RunConfig(LOADER))))
        for start in range(0, len(self._pending), _CHUNK):
            name = f"load{self._chunks}"
            self._chunks += 1
            commands += [
                eb.AddRuleset(_SPAN, name),
                eb.RuleCommand(eb.Rule(_SPAN, self._pending[start:start + _CHUNK], [], name, name)),
                eb.RunSchedule(eb.Run(_SPAN, eb.RunConfig(name))),
            ]
        self._pending = []
        try:
            outputs = self.eg.run_program(*commands)  # one call: the rows' input and run, then the actions
        finally:
            for path in files:
                os.remove(path)
        changed = any(getattr(o, "report", None) is not None and o.report.updated for o in outputs)
        self._changes += changed
        return changed

    # ------------------------------------------------------------------ running
    def declare(self, program: str) -> None:
        self._changes += 1
        self.eg.run_program(*commands(self.eg, program))

    def run(self, ruleset: str, *, saturate: bool = False) -> Any:
        sched = eb.Run(_SPAN, eb.RunConfig(ruleset))
        if saturate:
            sched = eb.Saturate(_SPAN, sched)
        self._changes += 1
        (out,) = self.eg.run_program(eb.RunSchedule(sched))
        return out.report

    # ------------------------------------------------------------------ reading
    def int_value(self, n: int) -> Any:
        """The egglog value of the ``i64`` ``n`` (to look nodes up with)."""
        v = _UNBOXED.get(n)
        if v is None:
            v = self._ints.get(n)
            if v is None:
                v = self.eg.eval_expr(int_lit(n))[1]  # some 9 us: worth remembering
                if 0 <= n <= _UNBOXED_MAX and len(_UNBOXED) < _UNBOXED_KEEP:
                    _UNBOXED[n] = v
                else:
                    self._ints[n] = v
        return v

    def lookup(self, ctor: str, args: Sequence[Any]) -> Any:
        """The class of an existing node, or ``None``. Never inserts."""
        return self.eg.lookup_function(ctor, list(args))

    def snapshot(self) -> "Snapshot":
        """The e-graph as it is now, everything pending flushed.

        Until the e-graph changes, the same :class:`Snapshot` is given again
        (its tables, the node table included, are not built twice).
        """
        self.flush()
        changes, ref = self._snap
        snap = ref() if changes == self._changes else None
        if snap is None:
            snap = Snapshot(self)
            self._snap = (self._changes, weakref.ref(snap))
        return snap


def _facts_of(value: Any) -> tuple[str, ...]:
    """The facts known from a constant's value (floating constants only; see ``ir/terms.py``'s ``FACTS``), in the
    order they are asserted."""
    if not jnp.issubdtype(value.dtype, jnp.floating):  # jnp knows bfloat16 and the other ml_dtypes (a key: none)
        return ()
    a = np.asarray(value)
    tiny = float(jnp.finfo(a.dtype).tiny)  # subnormals count as zero: XLA:CPU flushes them
    a = a.astype(np.float64)
    nan = np.isnan(a)
    holds = (np.all((a >= tiny) | nan), np.all(~np.signbit(a) | nan), np.all((np.abs(a) >= tiny) | nan))
    return tuple(fact for fact, held in zip(("Pos", "NonNeg", "NonZero"), holds) if held)


#: What :meth:`EGraph.literal` makes of a literal, by :func:`_literal_memo_key`: its literal id and its value's facts,
#: for every e-graph of the process (each loads the same few: ``1.0``, ``0``, an epsilon; flax_long_context_step's
#: first call made 136 afresh in its 5 e-graphs, 73 made in an earlier one). Ids, scalars and avals: no array, e-graph.
_LITERALS_MADE: dict[tuple, tuple[int, tuple[str, ...]]] = {}
_LITERALS_KEEP = 4096  # all dropped at once past it

#: egglog keeps an ``i64`` from 0 to 2**31 - 1 in the value itself (larger or negative ones are interned
#: per e-graph, and forgotten at ``pop``): such a value is the same in every e-graph, so the process
#: keeps the first few thousand it meets (``tests/test_egraph.py`` checks the premise).
_UNBOXED: dict[int, Any] = {}
_UNBOXED_MAX = 2**31 - 1
_UNBOXED_KEEP = 1 << 16


def _key(a: Any) -> Any:
    """What stands for argument ``a`` in the key of a node (:meth:`EGraph.term`): a list or body by its names."""
    if isinstance(a, BodyRef):
        return ("body", a.scope, a.outs.key)
    if isinstance(a, ListRef):
        return a.key
    return a


class Snapshot:
    """A frozen view of the e-graph: classes, their nodes, names and types.

    Class ids are egglog ``Value`` objects, canonical for this snapshot only.
    Node tables are converted lazily; the saturation loop usually needs only
    the names and the match relations.
    """

    def __init__(self, egraph: EGraph) -> None:
        self.egraph = egraph
        #: what the extractions from this snapshot share (``rewrite/extract/extractor.py``'s ``shared``)
        self.extractors: list[tuple[Any, Any]] = []
        #: the copies without some rules' nodes that extractions from this snapshot take (``extract/policy.py``'s
        #: ``withheld``), by what they leave out: a VJP's two extractions take one copy, and price its nodes once
        self.withholding: dict[tuple, tuple[Any, dict, Any]] = {}
        #: per cost model, the prices of nodes without bodies (``Extractor.own``), shared by every extractor of this
        #: snapshot and of its copies (:meth:`without`): a node's own price reads its class's type and its operands'
        self.prices: list[tuple[Any, dict]] = []
        self.frozen = egraph.eg.freeze()
        self.functions = self.frozen.functions
        #: each function's rows, read once: egglog makes the list and its rows anew at every read of ``rows``, and
        #: the count of rows, the node table, the match relations and the deferred queries each read them
        self._fn_rows: dict[str, list] = {}
        to_int = egraph.eg.value_to_i64
        rows = self.rows("V")
        n = egraph.num_names
        cls_of: list[Any] = [None] * n
        name_of: dict[Any, int] = {}
        for r in rows:  # (each attribute of a row is made anew when read: read once)
            vid, cls = to_int(r.inputs[0]), r.output
            cls_of[vid] = cls
            old = name_of.get(cls)
            if old is None or vid < old:
                name_of[cls] = vid
        self.cls_of_name = cls_of
        self.name_of_cls = name_of
        self._nodes: dict[Any, list[tuple]] | None = None
        self._parents: dict[Any, list[tuple]] | None = None
        self._matches: dict[str, dict[Any, list[tuple]]] = {}
        self._facts: dict[str, frozenset] = {}
        self._avals: dict[Any, Any] = {}  # class -> aval, as read (a copy, ``without``, shares it: the same classes)

    @functools.cached_property
    def num_rows(self) -> int:
        """Rows in the e-graph: nodes, names, facts and matches (the loader's are left out)."""
        return sum(len(self.rows(name)) for name in self.functions if name != LOAD)

    def rows(self, function: str) -> list[Any]:
        found = self._fn_rows.get(function)
        if found is None:
            f = self.functions.get(function)
            found = self._fn_rows[function] = [] if f is None else f.rows
        return found

    def matches(self, relation: str, query: int) -> list[tuple]:
        """The rows of a shared match relation whose first column is ``query``, without it.

        Queries of one signature record their matches in one relation, each
        row led by the query's id (``rules.saturate.match_program``): fewer
        declarations make a pooled e-graph cheaper to lend (:data:`_POOL`).
        """
        groups = self._matches.get(relation)
        if groups is None:
            by_value: dict[Any, list[tuple]] = {}
            for r in self.rows(relation):
                inputs = r.inputs
                by_value.setdefault(inputs[0], []).append(tuple(inputs[1:]))
            to_int = self.egraph.eg.value_to_i64
            groups = self._matches[relation] = {to_int(v): rows for v, rows in by_value.items()}
        return groups.get(query, [])

    def name(self, cls: Any) -> int:
        return self.name_of_cls[cls]

    def type_id(self, cls: Any) -> int:
        return self.egraph.vtype[self.name_of_cls[cls]]

    def aval(self, cls: Any) -> Any:
        found = self._avals.get(cls)  # asked for most classes many times over (an extraction's pricing)
        if found is None:
            found = self._avals[cls] = TYPES[self.egraph.vtype[self.name_of_cls[cls]]]
        return found

    def without(self, drop: Callable[[Any, tuple], bool]) -> "Snapshot":
        """A copy of this snapshot whose node table leaves out the nodes ``drop(cls, node)`` names
        (an extraction that may not use them); names, types and matches are shared."""
        out = copy.copy(self)
        out._nodes = {cls: [n for n in ns if not drop(cls, n)] for cls, ns in self.nodes.items()}
        out._parents = None
        out.extractors = []  # an extraction from the copy prices its own node table
        out.withholding = {}  # (out.prices stays this snapshot's: the copy's nodes are priced alike)
        return out

    # -- node tables (built on first use)
    @property
    def nodes(self) -> dict[Any, list[tuple]]:
        """Class -> list of e-nodes ``(ctor, args)``; args are classes or ints per the constructor's sorts."""
        if self._nodes is None:
            self._build_nodes()
        return self._nodes  # type: ignore[return-value]

    def _build_nodes(self) -> None:
        to_int = self.egraph.eg.value_to_i64
        nodes: dict[Any, list[tuple]] = {}
        for fname, fn in self.functions.items():
            if fname == "V" or fn.output_sort not in _terms.EXTRACTABLE_SORTS:
                continue
            sorts = _terms.ctor_arg_sorts(fname)
            int_pos = [i for i, s in enumerate(sorts) if s == "i64"]
            for r in self.rows(fname):
                if r.subsumed:
                    continue
                if int_pos:
                    args = list(r.inputs)
                    for i in int_pos:
                        args[i] = to_int(args[i])
                    node = (fname, tuple(args))
                else:
                    node = (fname, tuple(r.inputs))
                out = r.output
                found = nodes.get(out)
                if found is None:
                    nodes[out] = [node]
                else:
                    found.append(node)
        self._nodes = nodes

    @property
    def parents(self) -> dict[Any, list[tuple]]:
        """Class -> list of ``(parent class, e-node)`` that use it directly."""
        if self._parents is None:
            parents: dict[Any, list[tuple]] = {}
            for cls, ns in self.nodes.items():
                for node in ns:
                    for a in node[1]:
                        if not isinstance(a, int):
                            parents.setdefault(a, []).append((cls, node))
            self._parents = parents
        return self._parents

    def list_items(self, lst: Any) -> list[Any]:
        """The elements of a ``TList`` or ``BList`` class."""
        out = []
        nodes = self.nodes
        while True:
            ctor, args = nodes[lst][0]
            if ctor in ("TNil", "BNil"):
                return out
            out.append(args[0])
            lst = args[1]

    def has_fact(self, fact: str, cls: Any) -> bool:
        return self.egraph.eg.lookup_function(fact, [cls]) is not None

    def with_fact(self, fact: str) -> frozenset:
        """The classes that hold ``fact`` (``NonNeg``, ``Pos``, ``NonZero``), read once per snapshot."""
        found = self._facts.get(fact)
        if found is None:
            found = self._facts[fact] = frozenset(r.inputs[0] for r in self.rows(fact))
        return found
