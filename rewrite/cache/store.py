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
cannot be hashed stably turns the cache off for that function, with a
:class:`RewriteWarning` (once per function and reason). A callback (of
``pure_callback``, ``io_callback``, ``jax.debug.callback``; equinox's and
diffrax's checks) enters the key by type and position only, as does any
other param the rewriter never looks into (a ``custom_jvp``'s rule) that
cannot be hashed: the stored program refers to them by position, and takes
them from the fresh trace on load, so a hit runs this process's callback. A
program whose callback is not its trace's is not stored, with a warning.

**An entry** is the chosen program in a serialisation of this module's own
(equations by primitive name, avals, params; see :func:`dumps_program`;
a custom derivative a rule built, or one dead-code elimination re-wrapped,
as jaxprs or as the original's rule under that elimination:
``rewrite/cache/rules.py``), what the report needs (costs, stop reason, the rules that fired, the
guard's decision) and a checksum. The entry is written to a temporary file
and renamed into place, so concurrent writers never leave a torn file. On
load the checksum, the format and the versions are checked, the program is
type-checked (``jax.core.check_jaxpr``) and its signature compared with the
fresh trace's; any failure warns (:class:`RewriteWarning`) and rewrites
afresh, and the new result replaces the entry. Entries of other versions
are not found (the versions are in the key) and stay on disk until the
directory is emptied.

**Trust.** An entry is read as data: params by a schema of the kinds JAX's
primitives hold, and nothing that names a function to call
(``rewrite/cache/serialise.py``), so a planted entry cannot run code. The
directories are made 0700, and an entry is loaded only if this process's
user owns it and the directories above it, and neither group nor others can
write them; otherwise a :class:`RewriteWarning` says why and the program is
rewritten afresh.

Beside the programs it keeps a mark per rule that passed the check of its
example when it was defined (:class:`ExampleChecks`), and XLA's count of a
program's temporaries for the memory tie (:class:`TieCounts`).

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
import hashlib
import json
import logging
import os
import pathlib
import tempfile
import threading
import time
import warnings
from typing import Any


from ..cost.guard import GuardDecision
from ..errors import RewriteWarning
from ..extract import tie as _tie
from ..ir.jaxapi import core
from ..jaxpr.emit import check_signature
from ..records import Result, RuleStats
from .fingerprint import aval_key, fingerprint, program_fingerprint
from .key import environment, rule_parts
from .serialise import FORMAT, ForeignCallback, dumps_program, loads_program

log = logging.getLogger("rewrite")

ENV = "JAX_REWRITE_CACHE_DIR"
MAGIC = b"JAXRW\x00\x01\n"
_OFF = ("", "0", "off", "false", "none", "no")


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
        """Write an entry atomically: to a temporary file in the same directory, then renamed into place.

        Not synced to the disk (as JAX's compilation cache is not): an ``fsync`` cost a first call 1-30 ms, as
        the disk was busy, and an entry a power loss leaves torn fails its checksum on load, which warns and
        rewrites afresh."""
        head = json.dumps(header, sort_keys=True).encode()
        payload = len(head).to_bytes(8, "little") + head + blob
        data = MAGIC + hashlib.sha256(payload).digest() + payload
        target = self.file(key)
        _private_dirs(self.path, target.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read(self, key: str) -> tuple[dict, bytes] | None:
        """``(header, blob)``, or ``None`` if there is no entry; raises :class:`CacheError` if it is unusable,
        and :class:`UntrustedEntry` if another user owns it or could have written it."""
        target = self.file(key)
        try:
            data = target.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        why = _untrusted(target, target.parent, self.path)
        if why is not None:
            raise UntrustedEntry(why)
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
        except ForeignCallback as e:  # the key holds callbacks by place: an entry must take them from the trace
            self._warn(f"the rewrite of this program is not kept in the rewrite cache: {e}, so a later process "
                       "could not run its own; each process rewrites it afresh", once=f"callback {e}")
            return False
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
        except UntrustedEntry as e:
            self._warn(f"not loading rewrite cache entry {self.file(key)}: {e}; whoever can write there could run "
                       "code in this process. Rewriting afresh (set JAX_REWRITE_CACHE_DIR to a directory of your own)",
                       once=f"untrusted {self.file(key).parent}")
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


class UntrustedEntry(Exception):
    """A cache entry, or a directory above it, that another user owns or that others can write."""


def _private_dirs(root: pathlib.Path, leaf: pathlib.Path) -> None:
    """Make ``root`` and ``leaf`` (below it) as directories only their owner can enter (0700)."""
    for d in (root, leaf):
        if not d.is_dir():
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                os.chmod(d, 0o700)  # mkdir's mode is reduced by the umask, and parents= ignores it


def _untrusted(*paths: pathlib.Path) -> str | None:
    """Why these paths are not to be trusted (another owner, or writable by group or others), or ``None``."""
    if not hasattr(os, "geteuid"):  # no POSIX owners (Windows): the directory's ACLs are the user's to set
        return None
    me = os.geteuid()
    for p in paths:
        st = os.stat(p)
        if st.st_uid != me:
            return f"{p} is owned by user {st.st_uid}, not by this process's user {me}"
        if st.st_mode & 0o022:
            return f"{p} is writable by {'group and others' if st.st_mode & 0o002 else 'its group'}"
    return None


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
            "guard": None if guard is None else guard.as_dict(), "why": getattr(result, "why", ""),
            "preferred": dict(getattr(result, "preferred", {}) or {}), "written": time.time(),
            "jointly_chosen": _jointly_chosen_meta(result)}


def _jointly_chosen_meta(result: Any) -> list[str] | None:
    """``Result.jointly_chosen`` as an entry keeps it: the names sorted, or ``None`` where it is not known or does
    not describe the stored program as the forward of a derivative (a step whose losses were replaced is rewritten
    again by ``grad.vjp.decided_jointly`` whatever the set says)."""
    chosen = getattr(result, "jointly_chosen", None)
    if chosen is None or getattr(getattr(result, "step", None), "replaced", None):
        return None
    return sorted(chosen)


def _jointly_chosen_of(meta: dict, fired: dict) -> frozenset | None:
    """The stored ``jointly_chosen`` (:func:`_jointly_chosen_meta`), or ``None`` (not known: ``decided_jointly``
    then rewrites the forward without the ``jointly`` rules again) unless it is a list of names of rules the entry
    says fired: an entry from before this field, or one whose field does not read so, is not taken at its word."""
    found = meta.get("jointly_chosen")
    if not isinstance(found, list) or not all(isinstance(n, str) and fired.get(n) for n in found):
        return None
    return frozenset(found)


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
    result.why = meta.get("why", "") if result.rewritten else ""
    result.preferred = dict(meta.get("preferred", {}))
    # where the stored program is the one the entry's jointly_chosen was read off (not the original, kept instead)
    result.jointly_chosen = (_jointly_chosen_of(meta, meta.get("fired") or {})
                             if program is not None or not meta.get("rewritten") else None)
    return result


# ---------------------------------------------------------------------- for the memory tie


class TieCounts:
    """Where ``extract.tie`` keeps XLA's count of a program's temporaries across processes: an entry with no
    program and the count in its header, in the default directory (:func:`default_dir`; none where it is off),
    keyed by the program's fingerprint and this library's versions (:func:`environment`, checked on read)."""

    def key(self, program: core.ClosedJaxpr) -> str | None:
        try:
            found = program_fingerprint(program)
        except Exception:  # a param that cannot be hashed stably: this process's cache alone
            return None
        return hashlib.sha256(f"memory tie\0{found}".encode()).hexdigest()

    def read(self, key: str) -> int | None:
        count = _read_mark(key, "xla_temps")  # unusable or untrusted: compiled again, and written over
        return count if isinstance(count, int) and not isinstance(count, bool) else None

    def write(self, key: str, count: int) -> None:
        _write_mark(key, {"xla_temps": count}, "memory tie")  # a directory it cannot write: counted again next time


_tie.STORE = TieCounts()


def _read_mark(key: str, field: str) -> Any:
    """The ``field`` of the mark under ``key`` (an entry with no program, its value in the header's ``meta``) in the
    default directory (:func:`default_dir`); ``None`` where there is none, or it is unusable or untrusted."""
    try:
        cache = resolve(None)
        found = None if cache is None else cache.read(key)
    except Exception:
        return None
    return None if found is None else found[0].get("meta", {}).get(field)


def _write_mark(key: str, meta: dict, what: str) -> None:
    """A mark of ``meta`` under ``key`` in the default directory (none where it is off); where it cannot be written,
    a debug line on ``what``."""
    try:
        cache = resolve(None)
        if cache is not None:
            cache.write(key, {"format": FORMAT, "key": key, "env": environment(), "meta": meta}, b"")
    except Exception as e:
        log.debug("%s: not stored: %s: %s", what, type(e).__name__, e)


# ---------------------------------------------------------------------- for a rule's example check


class ExampleChecks:
    """Where ``rewrite.define.check_example`` keeps across processes that a rule passed the check of its example:
    an entry with no program, in the default directory (:func:`default_dir`; none where it is off), keyed by the
    rule's code (``rewrite.cache.key.rule_parts``, as the rewrite cache hashes it: its sides, guard and example, and
    what they reach) and checked on read against this library's versions and source (:func:`environment`). Only a
    pass is kept: a rule that fails is checked, and fails, at each definition. What cannot be read (absent,
    corrupt, untrusted, other versions) is checked again."""

    def key(self, rule: Any) -> str | None:
        if default_dir() is None:
            return None
        try:
            found = fingerprint(rule_parts(rule))
        except Exception:  # a part that cannot be hashed stably: checked in each process
            return None
        return hashlib.sha256(f"example check\0{found}".encode()).hexdigest()

    def passed(self, key: str) -> bool:
        return _read_mark(key, "example_check") == "passed"  # unusable or untrusted: checked again, written over

    def write(self, key: str) -> None:
        _write_mark(key, {"example_check": "passed"}, "example check")  # unwritable: checked again next time


CHECKS = ExampleChecks()
