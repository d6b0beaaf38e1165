"""What a match reads and builds: the views of one snapshot, new terms, and a slice read back as a function.

Procedural rules and guards see the e-graph through :class:`Builder` (held by
every :class:`Match`, :class:`Value` and :class:`Node` as ``engine``): the
nodes of a class and its users, a loop's body, a piece of the e-graph read
back as a JAX function, and the terms a replacement is built from, traced
or applied one primitive at a time. Traces of the small functions rules
build are kept for the process (:func:`_trace_key`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..cost.model import default_model
from ..extract.choice import choose_slice, preferred_computes
from ..extract.extractor import Extractor
from ..ir import primitives as _primitives
from ..ir.egraph import EGraph, Snapshot
from ..ir.intern import PARAMS, TYPES
from ..ir.walk import walk
from ..ir.jaxapi import PRIMITIVE_MODULES, core
from ..jaxpr.emit import EmitError, emit_slice
from ..jaxpr.load import load_closed
from ..jaxpr.trace import explicitly_sharded, trace_at
from .match import Body, Node, Value



def _as_jax_types_it(prim: Any, operands: Sequence[Value], params: dict[str, Any], claimed: Any) -> Any:
    """The type of a node a rule builds by hand (``Match.node``), under an explicit mesh axis, where a value's
    sharding is part of its type: JAX's own, from its sharding rule for ``prim``. A rule names its node's type by
    its root's, reshaped (``la_assoc_*``'s inner product of two matrices replicated on ``x`` was typed
    ``f32[128@x,128]``, which JAX types ``f32[128,128]``), and an emitted program so typed fails JAX's checks
    (pjit_test's ``test_fsdp_pipeline_grad``, routed). The shape and dtype must be the claimed ones; JAX raises
    ``ShardingTypeError`` where it will not build the node (the rule then declines)."""
    bound = {k: v for k, v in params.items() if not k.startswith("_rw_")}
    out = trace_at(lambda *a: prim.bind(*a, **bound), [v.aval for v in operands]).out_avals[0]
    if (out.shape, out.dtype) != (claimed.shape, claimed.dtype):
        raise ValueError(f"{prim.name} built by hand as {claimed.str_short()}, which JAX types {out.str_short()}")
    return out.update(weak_type=claimed.weak_type)

class OutOfTime(Exception):
    """A rule ran past its deadline (its time share, or the run's time limit); the engine stops it there."""


class Builder:
    """What a match reads of the e-graph and builds in it: the views of one snapshot, and new terms.

    :class:`Match`, :class:`Value` and :class:`Node` call back into it; the
    saturation loop (:class:`rewrite.rules.saturate.Engine`) owns one, moves
    it to each new snapshot, and reads ``reads`` after a procedure ran.
    """

    def __init__(self, egraph: EGraph) -> None:
        self.egraph = egraph
        self.reads: set | None = None  # while a procedure runs: the classes it read (Engine watches them)
        #: ``time.perf_counter()`` past which the running rule must stop (Engine sets it per match: the
        #: rule's time share or the run's time limit, whichever comes first)
        self.deadline = math.inf
        self.kept: dict[Any, Any] = {}  # once's terms (their names) by key, for the whole saturation
        self.snapshot = None  # type: ignore[assignment]  # (also empties the per-snapshot caches)

    @property
    def snapshot(self) -> Snapshot:
        """The e-graph as the rules of this iteration see it."""
        return self._snapshot

    @snapshot.setter
    def snapshot(self, snap: Snapshot | None) -> None:
        # What is derived from a snapshot is kept with it, and dropped with it.
        self._snapshot = snap
        self._prefer: dict | None = None  # the bottom-up choice, for Match.function: see _preferred
        self._passed: set = set()  # the classes _prefer's passes were made over (a set closed under children)
        self._prefer_ex: Extractor | None = None
        self._nodes: dict[Any, list] = {}  # nodes_of's views
        self._functions: dict[tuple, Callable[..., list]] = {}  # function's results, by output and input classes

    def release(self) -> None:
        """Drop the views of the last snapshot: they refer back to the builder (a Node to the builder that
        made it), so the e-graph goes back to its pool when the caller lets go of it, not at some later
        full collection."""
        self._nodes = {}
        self._prefer = None
        self._functions = {}
        self.kept = {}

    def value(self, x: Any) -> Value:
        """A :class:`Value` for a class of the current snapshot, or for a V id."""
        snap = self.snapshot
        if isinstance(x, int):
            cls = snap.cls_of_name[x] if x < len(snap.cls_of_name) else None
            return Value(TYPES[self.egraph.vtype[x]], x, cls, self)
        return Value(snap.aval(x), snap.name(x), x, self)

    def nodes_of(self, cls: Any) -> list[Any]:
        """The :class:`Node` views of a class of the current snapshot, built once per snapshot
        (procedural rules walk the same classes many times in one iteration)."""
        reads = self.reads
        if reads is not None:
            reads.add((cls, None))
        found = self._nodes.get(cls)
        if found is None:
            found = self._nodes[cls] = [Node(self, c, a) for c, a in self.snapshot.nodes.get(cls, [])]
        return found

    def body(self, body_cls: Any) -> Body:
        snap = self.snapshot
        (_, (scope, outs)), *_ = snap.nodes[body_cls]
        return Body(scope, [self.value(c) for c in snap.list_items(outs)])

    def users(self, v: Value) -> list[tuple[Value, Any]]:
        if v.cls is None:
            return []
        parents = self.snapshot.parents
        out = []
        seen = set()
        stack = list(parents.get(v.cls, []))
        while stack:
            parent, (ctor, args) = stack.pop()
            if ctor == "TCons":  # an operand list (a scan's args, select_n's cases): its user is what holds it
                if parent not in seen:
                    seen.add(parent)
                    stack.extend(parents.get(parent, []))
            elif ctor not in ("Body", "BCons"):  # a body's outputs are not used in this scope
                out.append((self.value(parent), Node(self, ctor, args)))
        return out

    def _fresh(self, vid: int) -> Value:
        # A node that was already in the e-graph (an existing Param, say) keeps its class.
        return self.value(vid)

    def build_param(self, scope: int, index: int, aval: Any) -> Value:
        return self._fresh(self.egraph.term("Param", [scope, index], TYPES.intern_aval(aval)))

    def build_literal(self, value: Any, aval: Any) -> Value:
        return self._fresh(self.egraph.literal(value, aval))

    def build_node(self, prim: Any, operands: Sequence[Value], params: dict[str, Any], out_avals: Sequence[Any],
                   bodies: Sequence[Body]) -> Any:
        if isinstance(prim, str):
            prim = _primitive(prim)
        eg = self.egraph
        pid = PARAMS.intern_params(prim, params)
        spec = _primitives.BY_PRIM.get(prim.name)
        args: list[Any] = []
        names = [v.name for v in operands]
        if spec is None:
            ctor, args = "Opaque", [eg.tlist(names)]
        else:
            ctor = spec.ctor
            body_refs = [eg.body(b.scope, [o.name for o in b.outs]) for b in bodies]
            it = iter(names)
            for letter in spec.layout:
                if letter == "T":
                    args.append(next(it))
                elif letter == "L":
                    args.append(eg.tlist(list(it)))
                elif letter == "B":
                    args.append(body_refs.pop(0))
                elif letter == "N":
                    args.append(eg.blist(body_refs))
                    body_refs = []
            if next(it, None) is not None:
                raise ValueError(f"{prim.name}: too many operands for layout {spec.layout!r}")
        args.append(pid)
        multi = prim.multiple_results or (spec is not None and spec.family == _primitives.NESTED)
        if not multi and not bodies and any(map(explicitly_sharded, [v.aval for v in operands] + list(out_avals))):
            out_avals = [_as_jax_types_it(prim, operands, params, out_avals[0])]
        if not multi:
            (aval,) = out_avals
            return self._fresh(eg.term(ctor, args, TYPES.intern_aval(aval)))
        tup = eg.term(ctor, args, TYPES.intern_tuple(tuple(out_avals)))
        return tuple(self._fresh(eg.term("Proj", [tup, i], TYPES.intern_aval(a))) for i, a in enumerate(out_avals))

    def fresh_index(self, scope: int) -> int:
        return self.egraph.fresh_input(scope)

    def _slice(self, outs: Sequence[Value], inputs: Sequence[Value]) -> tuple[dict, list, list] | None:
        """A node per class that computes ``outs`` from ``inputs`` (``choose_slice``), with their classes."""
        snap = self.snapshot
        out_cls = [v.cls for v in outs]
        in_cls = [v.cls for v in inputs]
        if any(c is None for c in out_cls + in_cls):
            raise ValueError("Match.function takes values that exist in the e-graph (not ones built by this match)")
        seen: set | None = set() if self.reads is not None else None
        choice = choose_slice(snap, out_cls, set(in_cls), self._preferred(out_cls, in_cls), visited=seen)
        if choice is None:
            if seen is not None:
                # No slice yet: one may come when a class it looked at gains a node (a body's output
                # found independent of the carry, say), so those classes are read, as nodes_of's are,
                # and a procedure that declines is tried again then. (A slice that was found is not
                # watched: retrying on every change inside a loop body costs much and finds nothing.)
                self.reads.update((c, None) for c in seen)
            return None
        return choice, in_cls, out_cls

    def _preferred(self, out_cls: Sequence[Any], in_cls: Sequence[Any]) -> dict:
        """The bottom-up pass's choice (the cheapest tree under the default model) where the slice search from
        ``out_cls`` to ``in_cls`` reads it: in each class of more than one node below ``out_cls`` and not below
        ``in_cls`` alone. :func:`choose_slice` tries a class's ``prefer`` node first and never looks below an input;
        a class of one node is tried in that node alone, with an entry or without (as :func:`preferred_computes`
        takes it too), so its entry is never read, and the pass is made over the classes below those of more nodes
        alone (an LM head's shift read back from its maximum: none, where the whole model lay below the shift).
        A class's cheapest tree reads only classes below it, so each gets the choice a pass over the whole e-graph
        gives it (ties too: the nodes are taken in the same order). Kept per snapshot; a later call's classes of
        more nodes not yet passed add a pass."""
        snap = self.snapshot
        if self._prefer is None:
            self._prefer, self._passed = {}, set()
            self._prefer_ex = Extractor(snap, default_model())
        ex, nodes, passed, inputs = self._prefer_ex, snap.nodes, self._passed, set(in_cls)
        kids = lambda c: [k for n in nodes.get(c, ()) for k in ex.children(*n)]  # noqa: E731
        # (below a class passed, every class is)
        read = [c for c in walk(out_cls, lambda c: () if c in inputs or c in passed else kids(c))
                if len(nodes.get(c, ())) > 1 and c not in inputs and c not in passed]
        if read:
            below = set(walk(read, kids))
            self._prefer.update(ex.tree_of(below)[1])
            passed |= below
        return self._prefer

    def computes(self, outs: Sequence[Value], inputs: Sequence[Value]) -> bool:
        """Whether the e-graph computes ``outs`` from ``inputs`` alone: :meth:`function` would find a slice (it
        may still fail to emit one that carries effects), without emitting it."""
        return self._slice(outs, inputs) is not None

    def computes_each(self, outs: Sequence[Value], inputs: Sequence[Value]) -> list[bool]:
        """:meth:`computes` of each of ``outs`` alone, with one bottom-up pass (:meth:`_preferred`) where the searches
        below them all read it, not one per output over the classes below it: a pass's choice of a class does not depend
        on which other classes it is made with (see there), so each answer is :meth:`computes`'. A loop's outputs
        share most of its body (``rulesets.scan``'s ``lift_independent`` walked 4x the classes it covered). An output
        whose preferred tree alone computes it from ``inputs`` is answered by one walk over all of theirs
        (:func:`preferred_computes`, exact where it says yes); the others by :meth:`_slice`, as before, which notes what
        a failed one read."""
        if not (all(v.cls is not None for v in outs) and all(v.cls is not None for v in inputs)):
            return [self._slice([v], inputs) is not None for v in outs]  # (which raises, as computes does)
        prefer = self._preferred([v.cls for v in outs], [v.cls for v in inputs])
        known = preferred_computes(self.snapshot, [v.cls for v in outs], {v.cls for v in inputs}, prefer)
        return [ok or self._slice([v], inputs) is not None for v, ok in zip(outs, known)]

    def function(self, outs: Sequence[Value], inputs: Sequence[Value]) -> Callable[..., list] | None:
        """``outs`` as a JAX function of ``inputs`` (classes of this snapshot), or ``None``.

        One snapshot reads the same classes back as the same function, and :meth:`insert_traced` traces
        that function once per avals: ``rulesets.scan``'s ``sink_inputs`` reads a loop's body back for each
        of its policies and for every copy of the loop that shares the body, and traced it each time."""
        key = (tuple(v.cls for v in outs), tuple(v.cls for v in inputs))
        fn = self._functions.get(key)
        if fn is None:
            fn = self._function(outs, inputs)
            if fn is not None:  # (one not found is asked again: _slice notes the classes it read)
                self._functions[key] = fn
        return fn

    def _function(self, outs: Sequence[Value], inputs: Sequence[Value]) -> Callable[..., list] | None:
        found = self._slice(outs, inputs)
        if found is None:
            return None
        choice, in_cls, out_cls = found
        snap = self.snapshot
        try:
            closed = emit_slice(snap, choice, self.egraph, in_cls, out_cls)
        except EmitError:
            return None
        fn = core.jaxpr_as_fun(closed)
        read = {a for e in closed.jaxpr.eqns for a in e.invars if isinstance(a, core.Var)}
        read |= {a for a in closed.jaxpr.outvars if isinstance(a, core.Var)}
        fn.jaxpr = closed  # type: ignore[attr-defined]
        fn.uses = tuple(v in read for v in closed.jaxpr.invars)  # type: ignore[attr-defined]
        fn.traces = {}  # type: ignore[attr-defined]  # its traces, by avals (insert_traced)
        return fn

    def once(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()``'s terms (one or a tuple) the first time ``key`` is asked for in this saturation, and the same
        terms after, where ``key`` says all they are built from (the inputs' names among it). A match the engine
        finds again after a merge (its classes' ids changed) otherwise inserts a copy: the LM head's token loops
        (``rulesets.nn_lm_head``) were traced again in the third iteration of each heavy step, custom_vjp
        closures and all. Names stay valid while the e-graph grows; they are kept until :meth:`release`."""
        names = self.kept.get(key)
        if names is None:
            built = build()
            self.kept[key] = [v.name for v in built] if isinstance(built, tuple) else built.name
            return built
        return tuple(self.value(n) for n in names) if isinstance(names, list) else self.value(names)

    def check_time(self) -> None:
        """Raise :class:`OutOfTime` once the running rule's deadline has passed."""
        if time.perf_counter() > self.deadline:
            raise OutOfTime

    def insert_traced(self, fn: Callable[..., Any], inputs: Sequence[Value]) -> Any:
        self.check_time()  # every procedure builds through here: a long one stops at its next build
        avals = [v.aval for v in inputs]
        traces = getattr(fn, "traces", None)
        remember = False
        if isinstance(traces, dict) and hasattr(fn, "jaxpr"):  # a function read back by function(): see there
            at = (tuple(avals), _config())
            closed = traces.get(at)
            if closed is None:
                closed = traces[at] = trace_at(fn, avals)
        else:
            key = _trace_key(fn, avals)
            closed = _TRACES.get(key) if key is not None else None
            if closed is None:
                closed = trace_at(fn, avals)
                if key is not None:
                    _TRACES.put(key, closed)
            remember = key is not None
        return self._insert(closed, inputs, remember)

    def insert_closed(self, closed: core.ClosedJaxpr, inputs: Sequence[Value]) -> Any:
        """Insert ``closed``, a jaxpr a rule traced itself, applied to ``inputs``, which must be of its input types;
        returns its result term(s)."""
        self.check_time()
        types = lambda avals: [(tuple(a.shape), a.dtype) for a in avals]  # noqa: E731
        if types(v.aval for v in inputs) != types(closed.in_avals):
            raise TypeError(f"a jaxpr of inputs {closed.in_avals} applied to {[v.aval for v in inputs]}")
        return self._insert(closed, inputs, False)

    def _insert(self, closed: core.ClosedJaxpr, inputs: Sequence[Value], remember: bool) -> Any:
        outs, _ = load_closed(closed, [v.name for v in inputs], self.egraph, remember=remember)
        vals = [Value(TYPES[self.egraph.vtype[o]], o, None, self) for o in outs]
        return vals[0] if len(vals) == 1 else tuple(vals)


class _Traces:
    """Traces of rule-built functions, by code, closure and avals (:func:`_trace_key`), kept for the process.

    Procedural rules build the same small functions in every program (a
    product of two factors, a sum over an axis): tracing one the first time
    is most of what a rule costs, and the trace depends on nothing but its key.
    The oldest of more than ``size`` are dropped.

    What it holds depends on what the process traced before, not on what a rule computes: a walk for the disk
    cache's key (a ruleset's module holds one, ``rulesets/scan.py``'s ``_LIFTED``, which its procedures name) leaves
    it out (``FINGERPRINT_SKIPS``), as a rule's own caches. Walked, it made a process that had traced with the scan
    rules before its first key (the packs' example checks at import, after their record was made stale) key all
    its rewrites apart from every other process's: 13 of the identity packs' 112 rules' digests differed.
    """

    FINGERPRINT_SKIPS = frozenset({"_found"})  # its traces: a cache, not in a key (rewrite/cache/fingerprint.py)

    def __init__(self, size: int = 8192) -> None:
        self._found: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self.size = size

    def get(self, key: Any) -> Any:
        return self._found.get(key)

    def put(self, key: Any, closed: Any) -> None:
        with self._lock:
            self._found[key] = closed
            while len(self._found) > self.size:
                del self._found[next(iter(self._found))]


_TRACES = _Traces()


def _trace_key(fn: Callable[..., Any], avals: Sequence[Any]) -> Any:
    """A key under which ``fn`` traced at ``avals`` is the same jaxpr every time, or ``None``.

    Procedural rules build their replacements as small closures (a sum over
    these axes, a product of these factors), and the same closure is built
    again and again across matches and iterations: tracing it is most of a
    rule's cost. The key is the function's code, its defaults and a snapshot
    of its closure, taken when it is called (so a list mutated later does not
    matter); only plain values key it: numbers, strings, dtypes, tuples and
    lists of them, functions without a closure, and objects whose class says
    what of them a trace can read (``_trace_key``, as a matched ``Product``
    does). Anything else (an e-graph ``Value``, an object) makes the trace
    uncached.
    """
    try:
        code = fn.__code__
        cells = tuple(_plain(c.cell_contents) for c in (fn.__closure__ or ()))
        defaults = _plain(fn.__defaults__ or ())
        kwdefaults = _plain(tuple(sorted((fn.__kwdefaults__ or {}).items())))
        return (code, cells, defaults, kwdefaults, tuple(avals), _config())
    except (AttributeError, TypeError, ValueError):  # not a plain function, or a closure over an object
        return None


@contextlib.contextmanager
def standard_numpy() -> Iterator[None]:
    """JAX's standard dtype promotion, and rank promotion allowed: the settings the packs' code (rules' sides and
    procedures, example programs, kernels) is written for, entered wherever that code runs under a user's settings
    (``jax_numpy_dtype_promotion="strict"``, ``jax_numpy_rank_promotion="raise"``). The programs it makes hold each
    conversion and broadcast explicitly, and a replacement of another type than its class is declined as ever."""
    import jax

    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def _config() -> tuple:
    """The settings a trace reads besides its function and avals (a weak literal's dtype, say)."""
    import jax

    c = jax.config
    return (c.jax_enable_x64, c.jax_numpy_dtype_promotion, c.jax_default_matmul_precision)


def _plain(x: Any, depth: int = 0) -> Any:
    """``x`` as a key that is equal only for values a trace cannot tell apart: each value with its type.

    Nested up to 8 levels, so that a primitive's params key it (``loopstep.bound``'s items hold a
    dot_general's dimension numbers five levels down), and a dict keyed in its order (``dict(params,
    axes=...)`` in ``rulesets.scan``); a NumPy scalar by its type and bytes (an axis number that came from
    ``np.argmax``): flax_lm_step traced 129 such closures afresh, 29 of them distinct."""
    if depth > 8:
        raise TypeError("nested too deep")
    if isinstance(x, (float, complex)):
        return (type(x), repr(x))  # 0.0 and -0.0 are equal, and NaN is not equal to itself
    if x is None or isinstance(x, (bool, int, str)):
        return (type(x), x)
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_plain(y, depth + 1) for y in x))
    if isinstance(x, dict):  # in its order: the params a primitive is bound with keep it
        return (type(x), tuple((_plain(k, depth + 1), _plain(v, depth + 1)) for k, v in x.items()))
    if isinstance(x, np.generic) and x.dtype != object:  # np.int64(0) is not the int 0: its type keys it too
        return (type(x), x.dtype.str, x.tobytes())
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        return ("dtype", np.dtype(x).str)
    keyed = getattr(type(x), "_trace_key", None)
    if keyed is not None:  # a view that says what of it a trace can read (rules/match.py Product)
        return (type(x), _plain(keyed(x), depth))  # the key stands for x: no level of its own
    if isinstance(x, core.Primitive):
        return ("primitive", x)  # one object per primitive: its identity is its meaning
    if callable(x) and getattr(x, "__closure__", 0) is None and hasattr(x, "__code__"):
        return ("fn", x)  # a module-level function: its identity is its meaning
    if callable(x) and isinstance(getattr(x, "__name__", None), str) and not hasattr(x, "__dict__"):
        return ("builtin", x)  # a builtin or ufunc-like callable without state
    raise TypeError(type(x).__name__)


@functools.lru_cache(maxsize=None)
def _primitive(name: str) -> Any:
    """The JAX primitive called ``name``: one seen in a loaded program, or one of lax's."""
    for entry in PARAMS.values():
        prim = entry[0]
        if prim.name == name:
            return prim
    for mod in PRIMITIVE_MODULES:
        for attr in dir(mod):
            p = getattr(mod, attr)
            if getattr(p, "name", None) == name and hasattr(p, "bind"):
                return p
    raise ValueError(f"no primitive named {name!r}")
