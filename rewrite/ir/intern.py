"""Interning tables that turn Python values into the small integers the e-graph stores.

egglog keeps ``PyObject`` values as pickled copies, which loses the identity a
primitive needs to lower under ``jit``. So the e-graph stores integers and
these process-wide tables map them back: params ids to ``(primitive, params)``,
type ids to abstract values, literal ids to scalar values. Constant arrays are
named by a content hash so that equal constants from different traces (a
program and a rule) agree. Patterns compiled once are valid in every e-graph.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import hashlib
import math
import threading
from typing import Any, Hashable, Iterator

import numpy as np
from jax.dtypes import float0

from .jaxapi import HI_PRIMITIVE_TYPES, has_reduced_axes, hi_primitive_state, is_prng_key, key_parts


#: Each e-graph opens a generation (:func:`open_generation`) and keeps it open while it lives; an entry is stamped
#: with the generation current when it was last interned. Ids go into an e-graph only through interning (a hit
#: restamps the entry), so an entry stamped before the oldest open generation is in no live e-graph.
_GEN_LOCK = threading.Lock()
_generation = 0
_open: dict[int, int] = {}  # open generation -> how many live e-graphs opened it


def open_generation() -> int:
    """A new generation, open until :func:`close_generation`: entries interned from now on stay while it is open."""
    global _generation
    with _GEN_LOCK:
        _generation += 1
        _open[_generation] = _open.get(_generation, 0) + 1
        return _generation


def close_generation(gen: int) -> None:
    with _GEN_LOCK:
        left = _open.get(gen, 0) - 1
        if left > 0:
            _open[gen] = left
        else:
            _open.pop(gen, None)


_pinning = 0  # while above 0 (inside :func:`pinned`), every entry interned is kept for good


@contextlib.contextmanager
def pinned() -> Iterator[None]:
    """Keep every entry interned inside the block for good: a compiled rule pattern holds params ids in its
    query text (``(Opaque (TCons v (TNil)) 17)``) as long as the rule lives."""
    global _pinning
    with _GEN_LOCK:
        _pinning += 1
    try:
        yield
    finally:
        with _GEN_LOCK:
            _pinning -= 1


def _oldest_open() -> float:
    with _GEN_LOCK:
        return min(_open, default=math.inf)


class _Table:
    """A two-way map between hashable keys and integer ids, bounded.

    Ids are handed out in order and never reused. The readers of an id are the e-graphs it was put in (and what
    reads them: matches, extraction, emission, a kept report), so an entry that no live e-graph can hold is
    dropped once the table has more than ``keep`` entries, least recently interned first: without that each new
    input signature of a rewritten function kept its types and params for good. Reading a dropped id
    raises ``KeyError``; interning its key again gives a new id.
    """

    #: the most recently interned entries kept whatever the e-graphs alive
    keep = 1024

    def __init__(self) -> None:
        self._ids: dict[Hashable, int] = {}
        self._values: dict[int, Any] = {}
        self._keys: dict[int, Hashable] = {}
        self._stamp: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> generation, oldest first
        self._pinned: set[int] = set()  # kept for good (see :func:`pinned`)
        self._next = 0
        self._lock = threading.RLock()

    def intern(self, key: Hashable, value: Any = None) -> int:
        with self._lock:
            found = self._ids.get(key)
            if found is None:
                found = self._next
                self._next += 1
                self._values[found] = key if value is None else value
                self._keys[found] = key
                self._ids[key] = found
                self._trim()
            if found in self._pinned:
                return found
            if _pinning:
                self._pinned.add(found)
                self._stamp.pop(found, None)
                return found
            self._stamp[found] = _generation
            self._stamp.move_to_end(found)
        return found

    def touch(self, i: int) -> bool:
        """Restamp entry ``i`` as interned now (a cache that hands out an id it kept, not interning it again,
        calls this before the id goes into an e-graph); ``False`` when it has been dropped."""
        with self._lock:
            if i in self._pinned:
                return True
            if i not in self._values:
                return False
            self._stamp[i] = _generation
            self._stamp.move_to_end(i)
        return True

    def _trim(self) -> None:
        excess = len(self._stamp) - self.keep
        if excess <= 0:
            return
        oldest = _oldest_open()
        while excess > 0:
            i, gen = next(iter(self._stamp.items()))
            if gen >= oldest:
                return  # this one, and every later one, may be in a live e-graph
            self._stamp.popitem(last=False)
            del self._ids[self._keys.pop(i)]
            del self._values[i]
            self._dropped(i)
            excess -= 1

    def _dropped(self, i: int) -> None:
        """An entry left the table (a subclass drops what it keeps beside it)."""

    def __getitem__(self, i: int) -> Any:
        return self._values[i]

    def __len__(self) -> int:
        return len(self._values)

    def values(self) -> list[Any]:
        with self._lock:
            return list(self._values.values())


_IDENTITY = object()  # a param value that can only be compared by identity


def _freeze(value: Any) -> Hashable:
    """A hashable key for a param value, or ``_IDENTITY``.

    Scalars are keyed by type and repr, so that ``0.0`` and ``-0.0``, ``1`` and
    ``True``, and NaN and NaN are told apart or matched exactly as they behave.
    The values of most params (``None``, a string, a shape, a Python scalar, a
    dict with string keys) are keyed by the first tests, by their exact type;
    every other value by :func:`_freeze_any`, the same key either way.
    """
    t = type(value)
    if value is None or t is str:
        return value  # hashable: keyed by itself, as _freeze_any keys it
    if t is tuple or t is list:
        for v in value:
            if type(v) is not int:
                break
        else:  # a shape or axes (most params)
            return (t.__name__, tuple([("int", repr(v)) for v in value]))
        parts = tuple([_freeze(v) for v in value])
        for p in parts:
            if p is _IDENTITY:
                return _IDENTITY
        return (t.__name__, parts)
    if t is bool or t is int or t is float:
        return (t.__name__, repr(value))
    if t is dict:
        for k in value:
            if type(k) is not str:
                return _freeze_any(value)
        # string keys: sorted by themselves (each its own ``str``), never two alike, so no value is compared
        items = tuple([(k, _freeze(v)) for k, v in sorted(value.items())])
        for _, p in items:
            if p is _IDENTITY:
                return _IDENTITY
        return ("dict", items)
    return _freeze_any(value)


def _freeze_any(value: Any) -> Hashable:
    """:func:`_freeze` of any value, by its kind (a subclass too: a ``NamedTuple`` of dimension numbers, an enum
    that is an ``int``)."""
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return (type(value).__name__, repr(value))
    if isinstance(value, (list, tuple)):
        if all(type(v) is int for v in value):  # a shape or axes: the keys the loop below makes
            return (type(value).__name__, tuple(("int", repr(v)) for v in value))
        parts = tuple(_freeze(v) for v in value)
        return _IDENTITY if any(p is _IDENTITY for p in parts) else (type(value).__name__, parts)
    if isinstance(value, dict):
        items = tuple((str(k), _freeze(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
        return _IDENTITY if any(p is _IDENTITY for _, p in items) else ("dict", items)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if HI_PRIMITIVE_TYPES and isinstance(value, HI_PRIMITIVE_TYPES):
        return _hi_key(value)
    try:
        hash(value)
    except TypeError:
        return _IDENTITY
    return value


def _hi_key(value: Any) -> Hashable:
    """:func:`_freeze` of a hijax primitive object (``call_hi_primitive``'s ``_prim`` param): by its class, params,
    effects and the types it was made for (:func:`~rewrite.ir.jaxapi.hi_primitive_state`), not by JAX's equality,
    which leaves the types out; by identity where it holds more than those."""
    state = hi_primitive_state(value)
    if state is None:
        return _IDENTITY
    cls, params, *rest = state
    frozen = _freeze(params)
    if frozen is _IDENTITY:
        return _IDENTITY
    key = ("hijax", cls, frozen, *rest)
    try:
        hash(key)
    except TypeError:
        return _IDENTITY
    return key


_SETTLED = frozenset({type(None), bool, int, float, complex, str})


def _settled(value: Any) -> bool:
    """Whether ``value`` cannot change once made, so neither can its :func:`_freeze` key: ``None``, a Python scalar,
    a string, a NumPy scalar or dtype, an enum member (``lax.Precision``), or a tuple of them (a shape, dimension
    numbers)."""
    if type(value) in _SETTLED:
        return True
    if isinstance(value, tuple):
        for v in value:  # (most are shapes: their items settled by type, without a call each)
            if type(v) not in _SETTLED and not _settled(v):
                return False
        return True
    return isinstance(value, (np.generic, np.dtype, enum.Enum))


class ParamTable(_Table):
    """Params ids: ``(primitive, params)`` pairs. Equal params give equal ids.

    The same params dict is interned again and again (an equation loaded into each e-graph of a rewrite, priced in
    each program that holds it), so the key of a dict whose values are all :func:`_settled` is kept by the dict's
    identity, with the dict and its items: while it holds the same objects, its key is the one :func:`_freeze` would
    make again."""

    #: how many params dicts' keys are kept (all dropped at once when full)
    kept = 8192

    def __init__(self) -> None:
        super().__init__()
        self._frozen: dict[int, tuple[dict, Any, tuple, Hashable]] = {}  # id -> (params, prim, items, key)

    def intern_params(self, prim: Any, params: dict[str, Any]) -> int:
        kept = self._frozen.get(id(params))
        if kept is not None and kept[0] is params and kept[1] is prim and _same_items(params, kept[2]):
            return self.intern(kept[3], (prim, dict(params), None))
        frozen = _freeze(params if type(params) is dict else dict(params))  # (_freeze changes nothing)
        if frozen is _IDENTITY:
            key: Hashable = ("identity", prim.name, id(prim), tuple(sorted((k, id(v)) for k, v in params.items())))
            # Keep the objects alive so the ids stay unique.
            return self.intern(key, (prim, dict(params), tuple(params.values())))
        key = (prim.name, id(prim), frozen)
        if type(params) is dict and all(_settled(v) for v in params.values()):
            if len(self._frozen) >= self.kept:
                self._frozen.clear()
            self._frozen[id(params)] = (params, prim, tuple(params.items()), key)
        return self.intern(key, (prim, dict(params), None))

    def prim(self, pid: int) -> Any:
        return self[pid][0]

    def params(self, pid: int) -> dict[str, Any]:
        return self[pid][1]

    def _dropped(self, i: int) -> None:
        EFFECTS.pop(i, None)


_ABSENT = object()


def _same_items(params: dict, items: tuple) -> bool:
    """Whether ``params`` holds exactly ``items`` (its keys bound to the same objects)."""
    return len(params) == len(items) and all(params.get(k, _ABSENT) is v for k, v in items)


class TypeTable(_Table):
    """Type ids: abstract values (``ShapedArray`` with dtype, weak type, sharding), tokens and tuples of them.

    ``any_reduced`` turns true for good once a type with reduced or unreduced mesh axes is interned: until then no
    program this process loaded holds such a value, and what only they need is not checked
    (``rewrite.jaxpr.transposes``)."""

    any_reduced = False

    def intern_aval(self, aval: Any) -> int:
        with self._lock:
            fresh = self._next
            found = self.intern(("aval", aval), aval)
            if found >= fresh and not self.any_reduced and has_reduced_axes(aval):
                self.any_reduced = True
        return found

    def intern_tuple(self, avals: tuple[Any, ...]) -> int:
        with self._lock:
            fresh = self._next
            found = self.intern(("tuple", avals), TupleType(avals))
            if found >= fresh and not self.any_reduced and any(map(has_reduced_axes, avals)):
                self.any_reduced = True
        return found


class TupleType(tuple):
    """The type of a multi-result node: the avals of its components."""


def types_agree(want: Any, got: Any) -> bool:
    """Whether a replacement of type ``got`` may stand for a value of type ``want``: equal, or equal but for a
    sharding JAX itself does not tell apart (``jax._src.core.typematch``): one of the two on an empty mesh (a
    literal, which JAX types without the mesh its program runs under), or both on meshes with no explicit axis.
    Shape, dtype, weak type, varying manual axes and memory space must agree exactly.
    """
    if want == got:
        return True
    if isinstance(want, TupleType) and isinstance(got, TupleType):
        return len(want) == len(got) and all(types_agree(a, b) for a, b in zip(want, got))
    sw, sg = getattr(want, "sharding", None), getattr(got, "sharding", None)
    if sw is None or sg is None or type(want) is not type(got):
        return False
    mw, mg = getattr(sw, "mesh", None), getattr(sg, "mesh", None)
    if mw is None or mg is None:
        return False
    if not (getattr(mw, "empty", False) or getattr(mg, "empty", False)):
        if getattr(mw, "_any_axis_explicit", True) or getattr(mg, "_any_axis_explicit", True):
            return False  # an explicit axis: the shardings are part of the type
    try:
        return want.update(sharding=sg) == got
    except (AttributeError, TypeError, ValueError):
        return False


def sharded_apart(want: Any, got: Any) -> bool:
    """Whether two types that do not agree (:func:`types_agree`) differ in their sharding alone, under an explicit
    mesh axis. JAX types a replacement's result by the sharding rules of what it is built of, which are not the
    original's (a ``dot_general`` where the program summed a product: ``f32[4]`` for ``f32[4@x]``; a product of
    three matrices taken in the other order), so under explicit sharding a right replacement can come out typed on
    another sharding. It cannot stand for the match, whose type the program's readers are typed by: the rule
    declines there, and that is no fault of the rule. Inside a ``shard_map`` body the same holds of the manual
    axes a value varies over or is reduced over (``f32[8]`` for ``f32[8]{R:x}``: shard_map_test's
    ``test_shmap_bwd_rep_to_unreduced_check_vma_true``, routed)."""
    sg = getattr(got, "sharding", None)
    if sg is None or type(want) is not type(got) or getattr(want, "sharding", None) is None:
        return False
    apart = {"sharding": sg}
    if getattr(got, "manual_axis_type", None) is not None:
        apart["manual_axis_type"] = got.manual_axis_type
    try:
        return want.update(**apart) == got
    except (AttributeError, TypeError, ValueError):
        return False


def in_dtype(value: Any, dtype: Any) -> Any:
    """A literal's value as its dtype holds it.

    A literal JAX makes from a Python number (``lax.mul(x, 1e-50)``) keeps
    the number, typed ``float32`` but not rounded to it; XLA rounds it when
    it compiles. Facts, rules and keys must see the rounded value: read
    unrounded, ``1e-50`` would be a non-zero ``float32`` and ``(x * 1e-50) / 1e-50``
    would cancel to ``x``, where the program computes ``0 / 0``.
    """
    try:
        with np.errstate(all="ignore"):
            return np.asarray(value).astype(dtype)
    except (TypeError, ValueError, OverflowError):
        return value


def literal_key(value: Any) -> Hashable:
    """A dtype-independent key for a scalar literal value.

    ``2``, ``2.0`` and ``float32(2)`` share a key, so a pattern traced in one
    dtype matches a literal of another. ``-0.0`` and ``0.0`` do not, nor does
    any NaN match anything but NaN: their difference is visible to exact rules.
    """
    arr = np.asarray(value)
    if arr.dtype == float0:  # a zero tangent of an integer or boolean value: its one value has no number
        return ("float0", "")
    if arr.dtype == np.bool_:
        return ("bool", bool(arr))
    if np.issubdtype(arr.dtype, np.integer):
        i = int(arr)
        f = float(i)
        return ("num", repr(f)) if int(f) == i else ("int", i)
    if np.issubdtype(arr.dtype, np.complexfloating):
        return ("complex", repr(complex(arr)))
    f = float(arr.astype(np.float64)) if arr.dtype != np.float64 else float(arr)
    if math.isnan(f):
        return ("num", "nan")
    return ("num", repr(f))


class LiteralTable(_Table):
    """Literal ids, by value: never dropped, since compiled rule patterns hold them in their query text (one entry
    per distinct scalar value)."""

    keep = math.inf

    def intern_value(self, value: Any) -> int:
        return self.intern(literal_key(value))


def as_numpy(value: Any) -> Any:
    """A constant's value as a NumPy array, or ``None`` where none holds it (a PRNG key)."""
    return None if is_prng_key(value) else np.asarray(value)


def content_hash(array: Any) -> int:
    """A 62-bit content hash of an array (dtype, shape and bytes), for ``Const`` nodes; of a PRNG key array, its
    implementation and data."""
    h = hashlib.blake2b(digest_size=8)
    if is_prng_key(array):
        impl, array = key_parts(array)
        h.update(str(impl).encode())
    arr = np.asarray(array)
    h.update(str(arr.dtype).encode())
    h.update(repr(arr.shape).encode())
    h.update(np.ascontiguousarray(arr).tobytes())
    return int.from_bytes(h.digest(), "little") >> 2


PARAMS = ParamTable()
#: params id -> the effects of the equation it came from (only effectful equations are recorded)
EFFECTS: dict[int, Any] = {}
TYPES = TypeTable()
LITERALS = LiteralTable()


def literal_value(lit_id: int, dtype: Any) -> Any:
    kind, v = LITERALS[lit_id]
    if kind == "num":
        f = float(v)
        if np.issubdtype(np.dtype(dtype), np.integer):
            return int(f)
        return f
    if kind == "complex":
        return complex(v)
    if kind == "float0":
        return np.zeros((), float0)
    return v
