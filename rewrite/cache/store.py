"""The disk cache of rewritten programs: a second process with the same program does not rewrite again.

Like JAX's compilation cache, it is on by default, in the user's cache
directory (``$XDG_CACHE_HOME/jax-rewrite``, else ``~/.cache/jax-rewrite``).
The environment variable ``JAX_REWRITE_CACHE_DIR`` moves it, or turns it off
when set to ``""``, ``0``, ``off``, ``false`` or ``none``; ``rewrite(...,
cache=...)`` takes a directory, or ``False``, for one function.

**The key** is a SHA-256 of everything the rewrite's result depends on:
the traced program in a canonical form (every equation, its params, the
avals with their shardings, the constants' bytes; static arguments are baked
into the trace), each rule's code and its ruleset's soundness class and
tolerance (``rewrite/cache/fingerprint.py``), the cost model and its settings,
the limits, the guard, and the versions of Python, jax, jaxlib, egglog and
this library (its version and a hash of its source). A rule whose identity
cannot be hashed stably turns the cache off for that function, with a debug
log. Params the rewriter never looks into (a ``custom_jvp``'s rule, a
callback) enter the key by type and position only: the stored program
refers to them by position, and takes them from the fresh trace on load.

**An entry** is the chosen program in a serialisation of this module's own
(equations by primitive name, avals, params; see :func:`dumps_program`),
what the report needs (costs, stop reason, the rules that fired, the
guard's decision) and a checksum. The entry is written to a temporary file
and renamed into place, so concurrent writers never leave a torn file. On
load the checksum, the format and the versions are checked, the program is
type-checked (``jax.core.check_jaxpr``) and its signature compared with the
fresh trace's; any failure warns (:class:`RewriteWarning`) and rewrites
afresh, and the new result replaces the entry. Entries of other versions
are not found (the versions are in the key) and stay on disk until the
directory is emptied. As with JAX's compilation cache, the directory must be
trusted: a stored program holds pickled params, so whoever can write there
can run code in the processes that read it.

Other callers store their own programs under a key derived from a
function's (:meth:`DiskCache.derive`), with :meth:`DiskCache.store` and
:meth:`DiskCache.load`:

>>> import tempfile, jax, jax.numpy as jnp
>>> from rewrite.cache.store import DiskCache
>>> closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(jnp.ones(3))
>>> cache = DiskCache(tempfile.mkdtemp())
>>> key = cache.derive("0" * 64, "example")
>>> cache.store(key, closed, {"note": "doubled sine"}, original=closed)
True
>>> program, meta = cache.load(key, original=closed)
>>> meta["note"], [e.primitive.name for e in program.eqns]
('doubled sine', ['sin', 'mul'])
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pathlib
import pickle
import sys
import tempfile
import threading
import time
import warnings
import weakref
from typing import Any, Sequence

import numpy as np
from jax._src import core

from ..cost.guard import GuardDecision
from ..errors import RewriteWarning
from ..jaxpr.emit import check_signature
from ..pipeline import Result
from ..rules.saturate import RuleStats
from .fingerprint import Unstable, aval_key, fingerprint, program_fingerprint

log = logging.getLogger("rewrite")

ENV = "JAX_REWRITE_CACHE_DIR"
FORMAT = 2  # 2: the modules moved into subpackages, so pickled and fingerprinted names changed
MAGIC = b"JAXRW\x00\x01\n"
_OFF = ("", "0", "off", "false", "none", "no")


class Unserialisable(Exception):
    """The chosen program holds something this module cannot write down."""


# ---------------------------------------------------------------------- where


def user_dir() -> pathlib.Path:
    """The user's cache directory for this library: ``$XDG_CACHE_HOME/jax-rewrite``, else ``~/.cache/jax-rewrite``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jax-rewrite"


def default_dir() -> pathlib.Path | None:
    """The cache directory when ``rewrite`` is given no ``cache=``: ``$JAX_REWRITE_CACHE_DIR``, else :func:`user_dir`."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in _OFF else pathlib.Path(env).expanduser()
    return user_dir()


def resolve(cache: Any) -> "DiskCache | None":
    """``None``: the default directory; ``False``: off; ``True``: the default, even if the variable is off;
    a path: that directory; a :class:`DiskCache`: itself."""
    if isinstance(cache, DiskCache):
        return cache
    if cache is None:
        d = default_dir()
        return None if d is None else DiskCache(d)
    if cache is False:
        return None
    if cache is True:
        return DiskCache(user_dir())
    if isinstance(cache, (str, os.PathLike)):
        return DiskCache(pathlib.Path(cache).expanduser())
    raise TypeError(f"cache= takes None, a bool, a directory or a DiskCache, got {type(cache).__name__}")


# ---------------------------------------------------------------------- the key


@functools.lru_cache(maxsize=1)
def environment() -> dict[str, str]:
    """The versions a stored program depends on, this library's sources included."""
    import jax
    import jaxlib

    h = hashlib.sha256()
    root = pathlib.Path(__file__).parent.parent  # the rewrite package, not this folder
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    devices = jax.devices()
    return {"format": str(FORMAT), "python": sys.version.split()[0], "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "egglog": _version("egglog"),
            "jax-rewrite": f"{_version('jax-rewrite')}+{h.hexdigest()[:16]}", "backend": jax.default_backend(),
            "device": f"{len(devices)}x {devices[0].device_kind}" if devices else "none"}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


_RULES: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def rule_fingerprint(rule: Any) -> str:
    """A rule's code: its two sides, its guard and its example. Raises :class:`Unstable`."""
    found = _RULES.get(rule)
    if found is None:
        found = _RULES[rule] = fingerprint(("rule", rule.name, rule.lhs, rule.rhs, rule.when, rule.example,
                                            rule.program) + (("prefer",) if getattr(rule, "prefer", False) else ()))
    return found


def rules_fingerprint(entries: Sequence[tuple[Any, Any]]) -> str:
    """Every rule in order, with its ruleset's soundness class, tolerance and back-off. Raises :class:`Unstable`."""
    parts = []
    for r, owner in entries:
        try:
            parts.append((rule_fingerprint(r), owner.soundness, fingerprint(owner.tolerance),
                          fingerprint(owner.limits)))
        except Unstable as e:
            raise Unstable(f"rule {r.name!r}: {e}") from None
    return fingerprint(parts)


def model_fingerprint(model: Any) -> str:
    """A cost model's identity: its ``cache_key()`` if it declares one, else its type and settings."""
    key = getattr(model, "cache_key", None)
    return fingerprint(("model", key() if callable(key) else model))


def make_key(closed: core.ClosedJaxpr, entries: Sequence[tuple[Any, Any]], model: Any, limits: Any,
             program: str | None = None, **extra: Any) -> str:
    """The cache key of rewriting ``closed`` so (``program``: its :func:`program_fingerprint`, if known).
    Raises :class:`Unstable` when a part cannot be hashed."""
    parts = {"program": program or program_fingerprint(closed), "rules": rules_fingerprint(entries),
             "model": model_fingerprint(model), "limits": fingerprint(limits),
             "extra": fingerprint(sorted(extra.items())), "env": environment()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------- serialising a program


def _original_objects(closed: core.ClosedJaxpr) -> list[Any]:
    """Every object a program's equations hold, in a fixed order; a stored program refers to these by place."""
    out: list[Any] = []
    seen: set[int] = set()

    def add(x: Any) -> None:
        if isinstance(x, (bool, int, float, str, type(None))) and type(x) in (bool, int, float, str, type(None)):
            return
        if id(x) in seen:
            return
        seen.add(id(x))
        out.append(x)
        if type(x) in (tuple, list):
            for v in x:
                add(v)
        elif type(x) is dict:
            for k in sorted(x, key=repr):
                add(x[k])
        elif isinstance(x, core.ClosedJaxpr):
            for c in x.consts:
                add(c)
            jaxpr(x.jaxpr)
        elif isinstance(x, core.Jaxpr):
            jaxpr(x)

    def jaxpr(j: core.Jaxpr) -> None:
        add(j.debug_info)
        for e in j.eqns:
            add(e.primitive)
            add(e.ctx)
            add(e.source_info)
            for k in sorted(e.params):
                add(e.params[k])
            for eff in sorted(e.effects, key=str):
                add(eff)
            for v in e.invars:
                if isinstance(v, core.Literal):
                    add(v.val)

    add(closed)
    return out


@functools.lru_cache(maxsize=1)
def _primitives_by_name() -> dict[str, Any]:
    found: dict[str, Any] = {}
    dup: set[str] = set()
    for name, m in list(sys.modules.items()):
        if not name.startswith(("jax", "rewrite")) or m is None:
            continue
        for v in list(vars(m).values()):
            if isinstance(v, core.Primitive):
                if v.name in found and found[v.name] is not v:
                    dup.add(v.name)
                found.setdefault(v.name, v)
    return {k: v for k, v in found.items() if k not in dup}


def _primitive(name: str) -> Any:
    found = _primitives_by_name().get(name)
    if found is None:
        _primitives_by_name.cache_clear()  # a module imported since may define it
        found = _primitives_by_name().get(name)
    return found


class _Writer:
    def __init__(self, original: core.ClosedJaxpr) -> None:
        objects = _original_objects(original)
        self.objects = {id(x): i for i, x in enumerate(objects)}
        # The params table interns params by equality, so a program may hold an equal object from another
        # trace (a custom_jvp's rule traced twice): equal objects of the same type stand for each other.
        self.equal: dict[Any, int] = {}
        for i, x in enumerate(objects):
            try:
                self.equal.setdefault((type(x), x), i)
            except TypeError:
                pass
        self.keep = original  # the ids above stay valid while it lives

    def find(self, x: Any) -> int | None:
        i = self.objects.get(id(x))
        if i is None:
            try:
                i = self.equal.get((type(x), x))
            except TypeError:
                return None
        if i is None:
            inner = _dce_wrapped(x)
            if inner is not None:
                return self.find(inner)
        return i

    def value(self, x: Any) -> Any:
        t = type(x)
        if t in (bool, int, float, str, type(None)):
            return x
        if t in (tuple, list):
            return (t.__name__, [self.value(v) for v in x])
        if t is dict:
            return ("dict", [(self.value(k), self.value(v)) for k, v in x.items()])
        if isinstance(x, core.ClosedJaxpr):
            return ("closed", self.jaxpr(x.jaxpr), [self.array(c) for c in x.consts])
        if isinstance(x, core.Jaxpr):
            return ("jaxpr", self.jaxpr(x))
        if isinstance(x, core.Primitive):
            if _primitive(x.name) is x:
                return ("prim", x.name)
            i = self.find(x)  # a library's own primitive (equinox has some) that the original uses
            if i is None:
                raise Unserialisable(f"primitive {x.name!r} cannot be found by name")
            return ("orig", i)
        if isinstance(x, np.dtype):
            return ("dtype", str(x))
        if isinstance(x, (np.ndarray, np.generic)) or _jax_array(x):
            return self.array(x)
        from jax._src import literals

        if isinstance(x, (literals.TypedInt, literals.TypedFloat, literals.TypedComplex)):
            return ("typed", t.__name__, t.__mro__[1](x), str(x.dtype))
        # what is not plain data (a custom_jvp's rule, a mesh, a source location) by its place in the original
        i = self.find(x)
        if i is not None:
            return ("orig", i)
        if isinstance(x, core.JaxprEqnContext):
            return ("ctx", x.compute_type, x.threefry_partitionable, self.value(x.cur_abstract_mesh),
                    x.remove_size_one_mesh_axis, self.value(None if x.xla_metadata is None
                                                            else tuple(sorted(x.xla_metadata.items()))))
        from jax._src import source_info_util

        if isinstance(x, source_info_util.SourceInfo):
            return ("source",)  # a new location; the traceback object cannot be written
        try:
            data = pickle.dumps(x, protocol=5)
            back = pickle.loads(data)
        except Exception as e:
            raise Unserialisable(f"{t.__qualname__}: {e}") from None
        if type(back) is not t or _unequal(back, x):
            raise Unserialisable(f"{t.__qualname__} does not survive pickling")
        return ("pickle", data)

    def array(self, x: Any) -> Any:
        i = self.objects.get(id(x))  # arrays by identity only: equality is elementwise
        if i is not None:
            return ("orig", i)
        a = np.asarray(x)
        if a.dtype == object or not _dtype_by_name(a.dtype):
            raise Unserialisable(f"an array of {a.dtype}")
        return ("array", str(a.dtype), a.shape, np.ascontiguousarray(a).tobytes(), _jax_array(x))

    def aval(self, a: Any) -> Any:
        if isinstance(a, core.ShapedArray):
            default = core.ShapedArray(a.shape, a.dtype, a.weak_type)
            shard = None if a.sharding == default.sharding else self.value(a.sharding)
            mat = None if a.manual_axis_type == default.manual_axis_type else self.value(a.manual_axis_type)
            space = None if a.memory_space == default.memory_space else self.value(a.memory_space)
            try:
                dtype = self.value(np.dtype(a.dtype))
            except TypeError:
                dtype = self.value(a.dtype)
            return ("shaped", tuple(a.shape), dtype, bool(a.weak_type), shard, mat, space)
        if isinstance(a, core.AbstractToken):
            return ("token",)
        return ("aval", self.value(a))

    def jaxpr(self, j: core.Jaxpr) -> Any:
        env: dict[Any, int] = {}

        def bind(v: Any) -> Any:
            env[v] = len(env)
            return self.aval(v.aval)

        def atom(v: Any) -> Any:
            if isinstance(v, core.Literal):
                return ("lit", self.value(v.val), self.aval(v.aval))
            return ("var", env[v])

        consts = [bind(v) for v in j.constvars]
        ins = [bind(v) for v in j.invars]
        eqns = []
        for e in j.eqns:
            prim = self.value(e.primitive)
            invars = [atom(v) for v in e.invars]
            params = [(k, self.value(v)) for k, v in e.params.items()]
            eqns.append((prim, invars, [bind(v) for v in e.outvars], params,
                         [self.value(x) for x in e.effects], self.value(e.ctx), self.value(e.source_info)))
        outs = [atom(v) for v in j.outvars]
        return (consts, ins, eqns, outs, [self.value(x) for x in j.effects], self.value(j.debug_info))


def _dce_wrapped(x: Any) -> Any:
    """The function that JAX's dead-code elimination wrapped, if ``x`` is such a wrapper keeping every output.

    ``pe.dce_jaxpr`` (which the emitter runs) re-wraps a ``custom_jvp_call``'s
    rule in a fresh closure that drops the rule's unused outputs. When it
    drops none, the wrapped rule computes the same, so the stored program may
    name the original rule instead.
    """
    f = getattr(x, "f", None)
    seen = 0
    while callable(f) and seen < 4 and getattr(f, "__closure__", None):
        cells = dict(zip(f.__code__.co_freevars, (c.cell_contents for c in f.__closure__)))
        if "used_outs" in cells:
            inner = [v for v in cells.values() if type(v) is type(x)]
            return inner[0] if len(inner) == 1 and all(cells["used_outs"]) else None
        f = next((v for v in cells.values() if callable(v) and hasattr(v, "__code__")), None)
        seen += 1
    return None


def _dtype_by_name(dtype: Any) -> bool:
    """Can this dtype be found again by its name (bfloat16 and the other ml_dtypes too)?"""
    import jax.numpy as jnp

    try:
        return jnp.dtype(str(dtype)) == dtype
    except TypeError:
        return False


def _jax_array(x: Any) -> bool:
    import jax

    return isinstance(x, jax.Array) and not isinstance(x, core.Tracer)


def _unequal(a: Any, b: Any) -> bool:
    try:
        return not bool(a == b)
    except Exception:
        return False  # no equality to check with (arrays compare elementwise); the type matched


class _Reader:
    def __init__(self, original: core.ClosedJaxpr) -> None:
        self.objects = _original_objects(original)

    def value(self, x: Any) -> Any:
        if not isinstance(x, tuple):
            return x
        tag = x[0]
        if tag == "orig":
            return self.objects[x[1]]
        if tag == "tuple":
            return tuple(self.value(v) for v in x[1])
        if tag == "list":
            return [self.value(v) for v in x[1]]
        if tag == "dict":
            return {self.value(k): self.value(v) for k, v in x[1]}
        if tag == "closed":
            return core.ClosedJaxpr(self.jaxpr(x[1]), [self.value(c) for c in x[2]])
        if tag == "jaxpr":
            return self.jaxpr(x[1])
        if tag == "prim":
            p = _primitive(x[1])
            if p is None:
                raise Unserialisable(f"no primitive named {x[1]!r} in this process")
            return p
        if tag == "dtype":
            import jax.numpy as jnp

            return jnp.dtype(x[1])
        if tag == "array":
            _, dtype, shape, data, on_device = x
            import jax.numpy as jnp

            a = np.frombuffer(data, dtype=jnp.dtype(dtype)).reshape(shape).copy()
            # numpy, even for what was a jax.Array: a load may happen while an outer jit traces, where
            # making a jax.Array would bind into that trace
            return a if shape or on_device else a[()]
        if tag == "typed":
            from jax._src import literals

            return getattr(literals, x[1])(x[2], self._dtype(x[3]))
        if tag == "ctx":
            meta = self.value(x[5])
            return core.JaxprEqnContext._create(x[1], x[2], self.value(x[3]), x[4],
                                                None if meta is None else tuple(meta))
        if tag == "source":
            from jax._src import source_info_util

            return source_info_util.new_source_info()
        if tag == "pickle":
            return pickle.loads(x[1])
        raise Unserialisable(f"unknown tag {tag!r}")

    @staticmethod
    def _dtype(name: str) -> Any:
        import jax.numpy as jnp

        return jnp.dtype(name)

    def aval(self, x: Any) -> Any:
        if x[0] == "shaped":
            _, shape, dtype, weak, shard, mat, space = x
            kwargs: dict[str, Any] = {}
            if shard is not None:
                kwargs["sharding"] = self.value(shard)
            if mat is not None:
                kwargs["manual_axis_type"] = self.value(mat)
            if space is not None:
                kwargs["memory_space"] = self.value(space)
            return core.ShapedArray(shape, self.value(dtype), weak, **kwargs)
        if x[0] == "token":
            return core.abstract_token
        return self.value(x[1])

    def jaxpr(self, x: Any) -> core.Jaxpr:
        consts, ins, eqns, outs, effects, debug = x
        env: list[Any] = []

        def bind(a: Any) -> Any:
            v = core.Var(self.aval(a))
            env.append(v)
            return v

        def atom(a: Any) -> Any:
            if a[0] == "lit":
                return core.Literal(self.value(a[1]), self.aval(a[2]))
            return env[a[1]]

        constvars = [bind(a) for a in consts]
        invars = [bind(a) for a in ins]
        new_eqns = []
        for prim, invs, outs_, params, effs, ctx, src in eqns:
            p = self.value(prim)
            args = [atom(a) for a in invs]
            outvars = [bind(a) for a in outs_]
            new_eqns.append(core.new_jaxpr_eqn(args, outvars, p, {k: self.value(v) for k, v in params},
                                               set(self.value(e) for e in effs), self.value(src), self.value(ctx)))
        return core.Jaxpr(constvars, invars, [atom(a) for a in outs], new_eqns,
                          set(self.value(e) for e in effects), self.value(debug))


def dumps_program(closed: core.ClosedJaxpr, original: core.ClosedJaxpr) -> bytes:
    """``closed`` written down; objects it shares with ``original`` (the traced program) by their place there.

    Raises :class:`Unserialisable` when a param can neither be written nor found in ``original``.
    """
    w = _Writer(original)
    data = ("closed", w.jaxpr(closed.jaxpr), [w.array(c) for c in closed.consts])
    return pickle.dumps(data, protocol=5)


def loads_program(data: bytes, original: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """The inverse of :func:`dumps_program`, against a fresh trace of the same program."""
    r = _Reader(original)
    _, jaxpr, consts = pickle.loads(data)
    return core.ClosedJaxpr(r.jaxpr(jaxpr), [r.value(c) for c in consts])


# ---------------------------------------------------------------------- the store


_WARNED: set[str] = set()  # what this process was warned of once (a directory it cannot write)
_LOCK = threading.Lock()


class CacheError(Exception):
    """An entry that cannot be used: corrupt, truncated, of another format or version, or not this program."""


class DiskCache:
    """A directory of rewritten programs, one file per key. See the module docstring."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = pathlib.Path(path)

    def __repr__(self) -> str:
        return f"<DiskCache {str(self.path)!r}>"

    def file(self, key: str) -> pathlib.Path:
        return self.path / key[:2] / f"{key}.rwx"

    @staticmethod
    def derive(key: str, *what: str) -> str:
        """The key of another program stored with the one under ``key`` (a gradient, say)."""
        return hashlib.sha256("\0".join((key,) + what).encode()).hexdigest()

    # -- bytes
    def write(self, key: str, header: dict, blob: bytes) -> None:
        """Write an entry atomically: to a temporary file in the same directory, then renamed into place."""
        head = json.dumps(header, sort_keys=True).encode()
        payload = len(head).to_bytes(8, "little") + head + blob
        data = MAGIC + hashlib.sha256(payload).digest() + payload
        target = self.file(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read(self, key: str) -> tuple[dict, bytes] | None:
        """``(header, blob)``, or ``None`` if there is no entry; raises :class:`CacheError` if it is unusable."""
        try:
            data = self.file(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not data.startswith(MAGIC):
            raise CacheError("not a cache entry of this format (bad magic)")
        digest, payload = data[len(MAGIC):len(MAGIC) + 32], data[len(MAGIC) + 32:]
        if hashlib.sha256(payload).digest() != digest:
            raise CacheError("checksum mismatch (corrupt or truncated)")
        n = int.from_bytes(payload[:8], "little")
        try:
            header = json.loads(payload[8:8 + n])
        except ValueError as e:
            raise CacheError(f"unreadable header: {e}") from None
        if header.get("format") != FORMAT:
            raise CacheError(f"format {header.get('format')}, this library writes {FORMAT}")
        if header.get("key") != key:
            raise CacheError("stored under another key")
        if header.get("env") != environment():
            raise CacheError("written by other versions: " + ", ".join(
                f"{k} {header.get('env', {}).get(k)} != {v}" for k, v in environment().items()
                if header.get("env", {}).get(k) != v))
        return header, payload[8 + n:]

    # -- programs
    def store(self, key: str, program: core.ClosedJaxpr | None, meta: dict, original: core.ClosedJaxpr,
              original_fingerprint: str | None = None) -> bool:
        """Store ``program`` (``None``: the original is the answer) with ``meta`` (JSON data). False if not stored.

        ``original`` is the traced program ``program`` was made from: what the two share is stored by place
        in it, and a load checks that it is given the same program (``original_fingerprint``, if known, is
        its :func:`program_fingerprint`)."""
        try:
            blob = b"" if program is None else dumps_program(program, original)
            header = {"format": FORMAT, "key": key, "env": environment(), "meta": meta,
                      "program": program is not None, "signature": _signature(original),
                      "original": original_fingerprint or program_fingerprint(original)}
            json.dumps(header)
        except Exception as e:  # Unserialisable, or a param object that fails in a way of its own
            log.debug("rewrite cache: not storing %s: %s: %s", key[:12], type(e).__name__, e)
            return False
        try:
            self.write(key, header, blob)
        except OSError as e:
            self._warn(f"cannot write the rewrite cache in {self.path} ({type(e).__name__}: {e}); "
                       f"rewritten programs are not kept across processes", once=str(self.path))
            return False
        return True

    def load(self, key: str, original: core.ClosedJaxpr, original_fingerprint: str | None = None
             ) -> tuple[core.ClosedJaxpr | None, dict] | None:
        """``(program, meta)`` stored under ``key``, checked against ``original``, the fresh trace;
        ``program`` is ``None`` where the original was kept. ``None`` if missing or unusable (with a warning)."""
        try:
            found = self.read(key)
            if found is None:
                return None
            header, blob = found
            if header.get("signature") != _signature(original):
                raise CacheError("stored for a program of another signature")
            if header.get("original") != (original_fingerprint or program_fingerprint(original)):
                raise CacheError("stored for another program")
            program = None
            if header.get("program"):
                try:
                    program = loads_program(blob, original)
                    core.check_jaxpr(program.jaxpr)
                except Exception as e:
                    raise CacheError(f"stored program does not load ({type(e).__name__}: {e})") from None
                check_signature(original, program)
            return program, header.get("meta", {})
        except OSError as e:
            self._warn(f"cannot read the rewrite cache in {self.path} ({type(e).__name__}: {e}); rewriting afresh",
                       once=f"read {self.path}")
            return None
        except Exception as e:  # CacheError, a signature mismatch, or anything a damaged entry provokes
            self._warn(f"rewrite cache entry {self.file(key)} is unusable ({e}); rewriting afresh")
            return None

    def _warn(self, msg: str, once: str | None = None) -> None:
        with _LOCK:
            if once is not None:
                if once in _WARNED:
                    return
                _WARNED.add(once)
        log.warning(msg)
        warnings.warn(RewriteWarning(msg), stacklevel=5)


def _signature(closed: core.ClosedJaxpr) -> list:
    """The program's input and output avals, as they read back from the entry's JSON header."""
    return json.loads(json.dumps([[aval_key(a) for a in closed.in_avals], [aval_key(a) for a in closed.out_avals]]))


# ---------------------------------------------------------------------- for Rewritten


def result_meta(result: Any) -> dict:
    """What a stored entry keeps of a pipeline :class:`Result`, for reports."""
    guard = getattr(result, "guard", None)
    return {"cost_before": _num(result.cost_before), "cost_after": _num(result.cost_after),
            "stopped": result.stopped, "iterations": result.iterations, "rows": result.rows,
            "times": result.times, "rewritten": bool(result.rewritten), "warnings": list(result.warnings),
            "fired": {k: s.fired for k, s in result.stats.items() if s.fired},
            "guard": None if guard is None else guard.as_dict(), "written": time.time()}


def _num(x: float) -> Any:
    return None if x != x else x


def result_from(traced_closed: core.ClosedJaxpr, program: core.ClosedJaxpr | None, meta: dict, where: str) -> Any:
    """A :class:`Result` rebuilt from a stored entry; ``cached`` names the file."""
    nan = float("nan")
    g = meta.get("guard")
    result = Result(before=traced_closed, after=program if program is not None else traced_closed,
                    cost_before=nan if meta.get("cost_before") is None else meta["cost_before"],
                    cost_after=nan if meta.get("cost_after") is None else meta["cost_after"],
                    stopped=meta.get("stopped", "cached"), iterations=meta.get("iterations", 0),
                    rows=meta.get("rows", 0), times={}, stats={k: RuleStats(fired=n) for k, n in
                                                               meta.get("fired", {}).items()},
                    rewritten=bool(meta.get("rewritten")) and program is not None,
                    warnings=list(meta.get("warnings", [])))
    result.cached = where
    result.guard = None if g is None else GuardDecision.from_dict(g, cached=True)
    return result
