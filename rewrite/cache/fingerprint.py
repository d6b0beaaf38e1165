"""Stable fingerprints of Python values, for the disk cache's keys (``rewrite/cache/store.py``).

A fingerprint must be the same in every process that would compute the same
thing, and differ where the thing differs. Numbers, strings, containers and
arrays are hashed by value. A function is hashed by what decides its
behaviour: its bytecode, constants, defaults, the values in its closure and
the globals its code names, followed recursively; a function, class or module
of a library whose version is part of the key (JAX, NumPy, the standard
library, egglog, this library and its built-in packs) by its name; a module of
the user's by its source file. Objects that only carry state of the process, not of the
computation, are named, never walked: a logger by its name (walking it reaches
``logging``'s manager and its locks), a lock or an event by its kind. An object
whose identity cannot be hashed stably (a generator, anything whose ``repr``
holds a memory address and that offers nothing else) raises :class:`Unstable`,
and the caller does not cache.

>>> from rewrite.cache.fingerprint import fingerprint
>>> fingerprint(lambda x: x + 1) == fingerprint(lambda x: x + 1), fingerprint(lambda x: x + 1) == fingerprint(lambda x: x + 2)
(True, False)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import os
import pathlib
import sys
import threading
import types
from typing import Any, Callable

import numpy as np

from ..ir.jaxapi import body_closed, core, is_prng_key, key_parts, neutral_params

#: Top-level packages whose objects are named, not hashed: their versions are in the key (this library's by a hash
#: of its sources as well, :func:`rewrite.cache.key.environment`). The built-in packs too, where they are this
#: library's own (:func:`own_packs`).
VERSIONED = frozenset({"jax", "jaxlib", "numpy", "egglog", "ml_dtypes", "opt_einsum", "scipy", "rewrite",
                       "builtins", "__future__"}) | frozenset(getattr(sys, "stdlib_module_names", ()))

#: The built-in packs' folder, beside ``rewrite`` in this distribution: its sources are hashed into the key's
#: environment with this library's.
PACKS = pathlib.Path(__file__).resolve().parents[2] / "rulesets"


def own_packs() -> bool:
    """Whether the ``rulesets`` loaded are the ones in :data:`PACKS`, whose sources the key hashes: their module-level
    helpers are then named, not walked, as this library's are (a process's first key walked them for every rule
    that reached them: 0.038 -> 0.019 s for the benchmarks' packs). A rule's own functions (lambdas, functions made
    in another) are walked as any are, with what their closures hold."""
    m = sys.modules.get("rulesets")
    return m is not None and by_identity(_OWN, m, _in_packs)  # asked once per module object


def _in_packs(module: types.ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and pathlib.Path(path).resolve().parent == PACKS


_OWN: dict[int, tuple[Any, bool]] = {}


#: Code flags that say where a function was defined (inside another, say), not what it does.
_WHERE_DEFINED = 0x10 | 0x40  # CO_NESTED, CO_NOFREE


#: The kinds of synchronisation object a function may hold: its output never depends on their state.
_SYNC = tuple({type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Event,
               threading.Semaphore, threading.Barrier})


#: A class's attributes that cache what its others decide, named in a class attribute of this name, are left out
#: of a walk (as is any ``functools.cached_property``'s value): a rule a function reaches is the same rule before
#: and after it traced its sides at new shapes (``Rule.FINGERPRINT_SKIPS``), so a key does not depend on what the
#: process rewrote before. A rule's skips are its caches, its file, and its queries (its left side compiled, whose
#: atoms name params and literals by the ids the process's interning gave them when the rule was made: a rule made
#: after others had interned more, the packs' example checks at import, wrote other numbers, and nn's rules, which
#: the procedures of its pack reach, keyed 9 of the identity packs' rules apart in such a process); its sides,
#: walked, say what it matches.
SKIPS = "FINGERPRINT_SKIPS"

class Memo(dict):
    """A module's memo of a function's values (a rule procedure's cache, reached through its globals), of at most
    ``most`` entries (:meth:`keep` drops the oldest), which a walk writes by its ``name``, never by its content: what
    it holds depends on what the process computed before, not on what the rule computes, so a rule's key is the same
    in a fresh process and after any number of rewrites, as with :data:`SKIPS`.

    >>> cache = Memo("example cache", most=2)
    >>> before = fingerprint(("rule", cache))
    >>> [cache.keep(k, k * 2) for k in (1, 2, 3)], sorted(cache)
    ([2, 4, 6], [2, 3])
    >>> fingerprint(("rule", cache)) == before
    True
    """

    def __init__(self, name: str, most: int = 256) -> None:
        super().__init__()
        self.name, self.most = name, most

    def keep(self, key: Any, value: Any) -> Any:
        """``value``, kept under ``key``; the oldest entries dropped beyond ``most``."""
        self[key] = value
        while len(self) > self.most:
            del self[next(iter(self))]
        return value


#: The primitives whose ``callback`` param is a host function, entered in a program's fingerprint by its type and
#: place, never by value (:meth:`_Canon.opaque_value`). The rewriter never calls one or reads into it (rules match
#: primitives and params; the cost model prices a callback by its avals; ``guard=True`` and
#: ``cost_model="measure"`` only time it), and an entry never holds one: the serialiser refers to it by its place in
#: the traced program and a hit takes it from this process's fresh trace (``rewrite/cache/serialise.py``; a
#: callback not found there is not written, and no entry is stored). So a hit runs this process's callback, and
#: what a callback carries of its process does not part two processes' keys: equinox's ``error_if`` (so every
#: equinox and diffrax program) closes over ``filter_jit``'s random 16-byte call id (``os.urandom``) in its
#: ``stack`` cell, and diffrax's entries were never read by another process.
CALLBACKS = frozenset({"pure_callback", "io_callback", "debug_callback"})


class Unstable(Exception):
    """This value has no fingerprint that another process would reproduce."""


def fingerprint(obj: Any, memo: dict | None = None) -> str:
    """A hex digest of ``obj`` that another process computes alike; raises :class:`Unstable`. ``memo``, where
    given, keeps what the functions and objects walked wrote (:meth:`_Walker._memoised`) for the next call that
    passes it: a ruleset's rules share their module's helpers and reach each other, which are then walked once for
    all of them. The digest is the
    same with it or without it."""
    w = _Walker({} if memo is None else memo)
    w.walk(obj)
    return hashlib.sha256(w.out).hexdigest()


def _key_order(key: Any) -> str:
    """:func:`fingerprint` of a dict's key, which orders its items: a plain value's made here, without a walker
    (most keys are an object's attribute names: 12,600 of them in a process's first cache key)."""
    b = _plain(key)
    return _plain_digest(b) if b is not None else fingerprint(key)


def _versioned(module: str | None) -> bool:
    if not module:
        return False
    top = module.split(".")[0]
    return top in VERSIONED or top == "rulesets" and own_packs()


_SOURCES: dict[tuple[str, float], str] = {}


def _module_source(module: types.ModuleType) -> str:
    path = getattr(module, "__file__", None)
    if not path or not os.path.exists(path):
        raise Unstable(f"module {module.__name__} has no source file")
    mtime = os.stat(path).st_mtime
    found = _SOURCES.get((path, mtime))
    if found is None:
        with open(path, "rb") as f:
            found = _SOURCES[(path, mtime)] = hashlib.sha256(f.read()).hexdigest()
    return found


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


#: The types written by value, each with its name as :meth:`_Walker.put` writes it.
_PLAIN = {t: len(t.__name__).to_bytes(8, "little") + t.__name__.encode()
          for t in (bool, int, float, complex, str, bytes, type(None))}


def _plain(x: Any) -> bytes | None:
    """What a walk writes of ``x`` where its type is written by value (as ``put(type(x).__name__, repr(x))``
    writes it), else ``None``."""
    tag = _PLAIN.get(type(x))
    if tag is None:
        return None
    b = repr(x).encode()
    return tag + len(b).to_bytes(8, "little") + b


@functools.lru_cache(maxsize=4096)
def _plain_digest(b: bytes) -> str:
    """:func:`fingerprint` of a plain value, from its bytes :func:`_plain` (all that its walk writes): a program's
    params repeat a few (a ``False``, an axis, a ``None``) and the walks' dicts their keys (attribute names), each
    hashed again before."""
    return hashlib.sha256(b).hexdigest()


class _Walker:
    """Writes a value down, into ``out`` (the bytes hashed). An object reached again while it is being walked (a
    cycle) is written as how many objects up the path it is: so what a function writes depends on the function
    alone, but for the objects it reaches that are being walked above it. A function or object walked by its
    attributes is written as the digest of what its walk wrote, so an object reached from many is hashed once.
    ``memo`` keeps, per such function or object (by id, the object kept with it), that digest and the ids of the
    objects its walk reached (``trail``), where no cycle in it led above it (``low``): written again wherever none
    of those objects is being walked above it, where a walk would write the same (a process's first cache key:
    0.36 -> 0.12 s for the benchmarks' packs with functions kept; with objects too, the nn pack's rules that its
    other rules' procedures reach are walked once, 0.14-0.16 -> 0.09 s CPU; with digests, 0.06 -> 0.04 s)."""

    def __init__(self, memo: dict) -> None:
        self.out = bytearray()
        self.active: dict[int, int] = {}  # objects being walked, by id: their depths on the path
        self.memo = memo
        self.trail: list[int] = []  # the ids of the objects walked, in order
        self.low = 1 << 62  # the least depth a cycle led to, since a function's walk began

    def put(self, *parts: Any) -> None:
        out = self.out
        for p in parts:
            b = p if isinstance(p, bytes) else str(p).encode()
            out += len(b).to_bytes(8, "little")
            out += b

    def walk(self, x: Any) -> None:
        b = _plain(x)
        if b is not None:
            self.out += b
            return
        if type(x) is Memo:
            self.put("memo", x.name)
            return
        depth = self.active.get(id(x))
        self.trail.append(id(x))
        if depth is not None:
            self.put("cycle", len(self.active) - depth)
            self.low = min(self.low, depth)
            return
        self.active[id(x)] = len(self.active)
        try:
            self._walk(x)
        finally:
            del self.active[id(x)]

    def _walk(self, x: Any) -> None:
        if type(x) in (tuple, list):
            self.put(type(x).__name__, len(x))
            for v in x:
                self.walk(v)
        elif type(x) is dict:
            self.put("dict", len(x))
            for k, v in sorted(x.items(), key=lambda kv: _key_order(kv[0])):
                self.walk(k)
                self.walk(v)
        elif type(x) in (set, frozenset):
            self.put("set", *sorted(fingerprint(v) for v in x))
        elif isinstance(x, core.Tracer):
            raise Unstable("a tracer")
        elif _is_array(x) and is_prng_key(x):  # a PRNG key: its implementation and data (no NumPy array holds it)
            impl, data = key_parts(x)
            self.put("key", str(impl))
            self.walk(data)
        elif isinstance(x, (np.ndarray, np.generic)) or _is_array(x):
            a = np.asarray(x)
            if a.dtype == object:
                raise Unstable("an object array")
            self.put("array", str(a.dtype), a.shape, hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())
        elif isinstance(x, np.dtype):
            self.put("dtype", str(x))
        elif isinstance(x, core.Primitive):
            self.put("primitive", x.name)
        elif isinstance(x, (core.ClosedJaxpr, core.Jaxpr)):
            self.put("jaxpr", program_fingerprint(x))
        elif isinstance(x, enum.Enum):
            self.put("enum", type(x).__module__, type(x).__qualname__, x.name)
        elif isinstance(x, (logging.Logger, logging.LoggerAdapter)):
            # where a function reports, not what it computes; its handlers and manager hold locks
            logger = x.logger if isinstance(x, logging.LoggerAdapter) else x
            self.put("logger", logger.name)
        elif isinstance(x, _SYNC):
            self.put("sync", type(x).__qualname__)
        elif isinstance(x, types.FunctionType):
            self._function(x)
        elif isinstance(x, types.MethodType):
            self.put("method")
            self.walk(x.__func__)
            self.walk(x.__self__)
        elif isinstance(x, types.ModuleType):
            self.put("module", x.__name__)
            if not _versioned(x.__name__):
                self.put(_module_source(x))
        elif isinstance(x, type):
            self.put("class", x.__module__, x.__qualname__)
            if not _versioned(x.__module__):
                mod = sys.modules.get(x.__module__)
                if mod is None:
                    raise Unstable(f"class {x.__qualname__}: module {x.__module__} is not loaded")
                self.put(_module_source(mod))
        elif isinstance(x, types.CodeType):
            self._code(x)
        elif callable(x) and hasattr(x, "__qualname__") and _versioned(getattr(x, "__module__", None)):
            # a library's function object (jnp.sin is a jitted function, np.sin a ufunc)
            self.put("named", x.__module__, x.__qualname__)
        elif isinstance(x, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            self.put("builtin", getattr(x, "__module__", None), x.__qualname__)
            if x.__self__ is not None and not isinstance(x.__self__, types.ModuleType):
                self.walk(x.__self__)
        elif hasattr(x, "shape") and hasattr(x, "dtype") and type(x).__name__ == "ShapeDtypeStruct":
            self.put("sds", tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                     repr(getattr(x, "sharding", None)))
        else:
            self._memoised(x, self._instance)

    def _instance(self, x: Any) -> None:
        cls = type(x)
        self.walk(cls)
        if isinstance(x, (dict, list, set, frozenset)):
            # a container's subclass (``OrderedDict``, ``Counter``, a user's): its items, in their order, as well as
            # what the branches below write (its attributes): they are not in its ``__dict__``
            self.put("items")
            self.walk(list(x.items()) if isinstance(x, dict) else list(x) if isinstance(x, list)
                      else sorted(fingerprint(v) for v in x))
        if dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                self.put(f.name)
                self.walk(getattr(x, f.name))
        elif isinstance(x, tuple):  # a NamedTuple
            self.walk(tuple(x))
        elif cls.__module__ == "functools" and cls.__name__ == "partial":
            self.walk((x.func, x.args, x.keywords))
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            skip = getattr(cls, SKIPS, frozenset())
            self.walk({k: v for k, v in vars(x).items()
                       if k not in skip and not isinstance(getattr(cls, k, None), functools.cached_property)})
        else:
            r = repr(x)
            if " at 0x" in r or "object at" in r:
                raise Unstable(f"{cls.__qualname__} object has no stable identity")
            self.put("repr", r)

    def _function(self, fn: types.FunctionType) -> None:
        if _versioned(fn.__module__) and "<lambda>" not in fn.__qualname__ and "<locals>" not in fn.__qualname__:
            self.put("named", fn.__module__, fn.__qualname__)
            return
        self._memoised(fn, self._function_body)

    def _memoised(self, x: Any, body: Callable[[Any], None]) -> None:
        """``body(x)``, or what it wrote before where none of the objects it reached is being walked above it."""
        found = self.memo.get(id(x))
        here = self.active[id(x)]
        if found is not None and found[0] is x and not any(i in found[2] for i in self.active if i != id(x)):
            self.out += found[1]  # what a walk from here writes: none of the objects it reached is above it
            self.trail.extend(found[2])  # (reached by what encloses it too)
            return
        start, trail, low = len(self.out), len(self.trail), self.low
        self.low = 1 << 62
        body(x)
        # what it wrote, as its digest: an object reached from many (a pack's ruleset, reached from its rules'
        # examples) is hashed once, not copied into each walk that reaches it (nn_log_softmax's walk wrote 1.7 MB)
        written = b"digest" + hashlib.sha256(self.out[start:]).digest()
        del self.out[start:]
        self.out += written
        if self.low >= here:  # no cycle led above it: its walk depends on it and on what is above it
            self.memo[id(x)] = (x, written, frozenset(self.trail[trail:]))
        self.low = min(low, self.low)

    def _function_body(self, fn: types.FunctionType) -> None:
        self.put("function")
        self._code(fn.__code__)
        self.walk(fn.__defaults__)
        self.walk(fn.__kwdefaults__)
        cells = []
        for c in fn.__closure__ or ():
            try:
                cells.append(c.cell_contents)
            except ValueError:  # an empty cell
                cells.append(("<empty cell>",))
        self.walk(cells)
        g = fn.__globals__
        for name in sorted(_code_names(fn.__code__)):
            if name in g:
                self.put("global", name)
                self.walk(g[name])

    def _code(self, code: types.CodeType) -> None:
        self.put("code", code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                 code.co_argcount, code.co_kwonlyargcount, code.co_posonlyargcount,
                 code.co_flags & ~_WHERE_DEFINED)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                self._code(c)
            else:
                self.walk(c)


def _is_array(x: Any) -> bool:
    import jax

    return isinstance(x, jax.Array)


def by_identity(table: dict[int, tuple[Any, Any]], x: Any, make: Any) -> Any:
    """``make(x)``, made once per object ``x`` while ``table`` lives: ``table`` maps ``id(x)`` to ``(x, make(x))``,
    holding ``x`` so that its id is not reused by another object meanwhile (a walk's memo of what it wrote of an
    aval or dtype met many times: the fingerprint's avals, the serialiser's avals and dtypes)."""
    found = table.get(id(x))
    if found is None or found[0] is not x:
        found = table[id(x)] = (x, make(x))
    return found[1]


def aval_key(aval: Any) -> tuple:
    if not hasattr(aval, "shape"):
        return (type(aval).__name__, str(aval))
    return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)),
            repr(getattr(aval, "sharding", None)), repr(getattr(aval, "manual_axis_type", None)),
            str(getattr(aval, "memory_space", None)))


_NO_EFFECTS = (2).to_bytes(8, "little") + b"[]"  # what ``put(sorted(map(str, effects)))`` writes of none


@functools.lru_cache(maxsize=None)
def _param_bytes(name: str) -> bytes:
    """``repr(("param", name)).encode()``, made once per param name."""
    return repr(("param", name)).encode()


def program_fingerprint(closed: Any) -> str:
    """A digest of a program's canonical form: equations, params, avals, shardings, constants."""
    canon = _Canon()
    canon.closed(body_closed(closed))  # an open one's constants' variables read as inputs
    return hashlib.sha256(canon.out).hexdigest()


class _Canon:
    """Writes a program down canonically: variables by number, params by value, opaque params by position.

    A body that appears again (the same ``Jaxpr`` object: a solver's step, a custom rule's function, called in
    several places) is written again from what its first walk wrote, and an aval's key is made once: the bytes,
    and so the digest, are the ones a walk of every occurrence writes (``diffrax_neural_ode``: 251 bodies, 135
    apart)."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.opaque: dict[int, int] = {}
        self.bodies: dict[int, tuple[Any, bytes]] = {}  # id -> (the body, kept alive; what its walk wrote)
        self.avals: dict[int, tuple[Any, bytes]] = {}
        self.digests: dict[int, tuple[Any, bytes | None]] = {}  # id -> (a param's value, kept alive; its digest)
        self.memo: dict = {}  # :func:`fingerprint`'s, shared by the params' walks

    def put(self, x: Any) -> None:
        b = repr(x).encode()
        self.out += len(b).to_bytes(8, "little")
        self.out += b

    def aval(self, aval: Any) -> bytes:
        """``repr(aval_key(aval))`` as bytes, made once per aval object: what :meth:`put` writes of the key (a
        key holds its sharding's repr, whose repr again costs most of a variable's write)."""
        return by_identity(self.avals, aval, lambda a: repr(aval_key(a)).encode())

    def put_tagged(self, tag: bytes, key: bytes) -> None:
        """``put((tag, key))`` of a key :meth:`aval` wrote: a pair's repr is its items' joined (``tag``: the
        tag's repr and the separator)."""
        n = len(tag) + len(key) + 2
        self.out += n.to_bytes(8, "little")
        self.out += b"(" + tag + key + b")"

    def put_bytes(self, b: bytes) -> None:
        self.out += len(b).to_bytes(8, "little")
        self.out += b

    def closed(self, closed: core.ClosedJaxpr) -> None:
        self.put(("consts", len(closed.consts)))
        for c in closed.consts:
            self.value(c)
        self.jaxpr(closed.jaxpr)

    def jaxpr(self, jaxpr: core.Jaxpr) -> None:
        # what a walk writes depends on the body alone (its variables are numbered from 0, an opaque param keeps
        # the number its first sight gave it), so a second walk writes the first's bytes again
        found = self.bodies.get(id(jaxpr))
        if found is not None and found[0] is jaxpr:
            self.out += found[1]
            return
        start = len(self.out)
        self._jaxpr(jaxpr)
        self.bodies[id(jaxpr)] = (jaxpr, bytes(self.out[start:]))

    def _jaxpr(self, jaxpr: core.Jaxpr) -> None:
        env: dict[Any, int] = {}
        for v in list(jaxpr.constvars) + list(jaxpr.invars):
            env[v] = len(env)
            self.put_tagged(b"'in', ", self.aval(v.aval))
        for e in jaxpr.eqns:
            self.put(("eqn", e.primitive.name, len(e.invars), len(e.outvars)))
            for v in e.invars:
                self.atom(v, env)
            params = neutral_params(e.primitive, e.params)  # a scan's input groups as counts on every JAX
            for k in sorted(params):
                self.put_bytes(_param_bytes(k))
                if k == "callback" and e.primitive.name in CALLBACKS:
                    self.opaque_value(params[k])
                else:
                    self.value(params[k])
            for v in e.outvars:
                env[v] = len(env)
                self.put_bytes(self.aval(v.aval))
            if e.effects:
                self.put(sorted(map(str, e.effects)))
            else:
                self.out += _NO_EFFECTS
        self.put(("out", len(jaxpr.outvars)))
        for v in jaxpr.outvars:
            self.atom(v, env)
        self.put(sorted(map(str, jaxpr.effects)))

    def atom(self, v: Any, env: dict) -> None:
        if isinstance(v, core.Literal):
            self.put_tagged(b"'lit', ", self.aval(v.aval))
            self.value(v.val)
        else:
            self.put_bytes(b"('var', %d)" % env[v])  # what ``put(("var", n))`` writes

    def value(self, x: Any) -> None:
        if isinstance(x, core.ClosedJaxpr):
            self.put("closed")
            self.closed(x)
        elif isinstance(x, core.Jaxpr):
            self.put("jaxpr")
            self.jaxpr(x)
        elif type(x) in (tuple, list):
            self.put((type(x).__name__, len(x)))
            for v in x:
                self.value(v)
        else:
            digest = self.digest(x)
            if digest is not None:
                self.put_bytes(b"('fp', '" + digest + b"')")  # what ``put(("fp", fingerprint(x)))`` writes
            else:
                # Never looked into by the rewriter, and taken from the fresh trace on load: its place is
                # its identity here.
                self.opaque_value(x)

    def digest(self, x: Any) -> bytes | None:
        """:func:`fingerprint` of a param's value, ``None`` where it is :class:`Unstable`: a plain value's from its
        bytes (the walk writes them alone), any other made once per object while this walk lives (the same
        object writes the same digest; its walk shares :attr:`memo` with the others, which leaves a digest as it
        is). A program's params repeat their objects: jaxmd_lj_forces' 28 ``jit`` equations hold one mesh, one
        tuple of shardings' singletons, each walked afresh before."""
        b = _plain(x)
        if b is not None:
            return _plain_digest(b).encode()
        found = self.digests.get(id(x))
        if found is None or found[0] is not x:
            try:
                d: bytes | None = fingerprint(x, self.memo).encode()
            except Unstable:
                d = None
            found = self.digests[id(x)] = (x, d)
        return found[1]

    def opaque_value(self, x: Any) -> None:
        """``x`` by its type and its place: the number of distinct opaque objects written before it."""
        n = self.opaque.setdefault(id(x), len(self.opaque))
        self.put(("opaque", type(x).__module__, type(x).__qualname__, n))
