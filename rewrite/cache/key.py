"""The disk cache's key: a SHA-256 of everything a rewrite's result depends on.

The program in a canonical form (:func:`rewrite.cache.fingerprint.program_fingerprint`),
each rule's code and its ruleset's soundness class, tolerance and back-off,
the cost model, the limits, and the versions of Python, jax, jaxlib, egglog
and this library (its version and a hash of its source, the built-in packs' included).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import pathlib
import sys
import threading
import weakref
from typing import Any, Sequence


from ..ir.jaxapi import core
from ..records import Limits
from ..rules.ruleset import Tolerance
from .fingerprint import PACKS, Unstable, fingerprint, program_fingerprint
from .serialise import FORMAT


@functools.lru_cache(maxsize=1)
def environment() -> dict[str, str]:
    """The versions a stored program depends on, this library's sources included."""
    import jax
    import jaxlib

    h = hashlib.sha256()
    root = pathlib.Path(__file__).parent.parent  # the rewrite package, not this folder
    # and the built-in packs, beside it in this distribution, whose module-level helpers a key names
    # (``fingerprint.own_packs``)
    for prefix, folder in (("", root), ("rulesets/", PACKS)):
        for p in sorted(folder.rglob("*.py")):
            h.update((prefix + str(p.relative_to(folder))).encode())
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


def rule_fingerprint(rule: Any, memo: dict | None = None) -> str:
    """A rule's code: its two sides, its guard and its example (and its anchor, which decides the operand orders
    it matches). Raises :class:`Unstable`. ``memo``: :func:`rewrite.cache.fingerprint.fingerprint`'s, shared by
    rules fingerprinted together (the digest is the same with it or without it)."""
    found = _RULES.get(rule)
    if found is None:
        found = _RULES[rule] = fingerprint(rule_parts(rule), memo)
    return found


def rule_parts(rule: Any) -> tuple:
    """What :func:`rule_fingerprint` hashes of a rule."""
    return (("rule", rule.name, rule.lhs, rule.rhs, rule.when, rule.example, rule.program)
            + (("prefer",) if getattr(rule, "prefer", False) else ())
            + ((("anchor", rule.anchor),) if getattr(rule, "anchor", None) else ()))


#: The last few :func:`rules_fingerprint` digests, by what decides them (:func:`_entries_key`), each with the objects
#: its key names by identity, held so that those identities stay theirs (a rewrite's pipelines key the same rules again
#: and again: the identity packs' 112 rules, 0.4-0.5 ms a key, about 4% of a small program's first call).
_LAST: collections.OrderedDict[tuple, tuple[tuple, str, tuple]] = collections.OrderedDict()
_LAST_SIZE = 8
_LAST_LOCK = threading.Lock()  # (rewrites on several threads key their rules alike)


def _entries_key(entries: Sequence[tuple[Any, Any]]) -> tuple[tuple, tuple] | None:
    """``(key, held)``: what :func:`rules_fingerprint`'s digest of ``entries`` depends on, as a dict key, and the
    objects it names by identity. Each rule by identity (its own digest is kept by identity already,
    ``rule_fingerprint``); each ruleset by identity and what it adds, read now (a ruleset changed between two keys
    is read afresh): its soundness class, floor and flags, and its tolerance and back-off by identity, where each is
    ``None`` or the library's own frozen :class:`~rewrite.Tolerance` or :class:`~rewrite.Limits` (of numbers only,
    so the same object is the same value). ``None`` for any other kind (a mapping of limits, a user's own type):
    its digest is made afresh each time."""
    held: list = []
    owners: dict[int, tuple] = {}
    key = []
    for r, o in entries:
        part = owners.get(id(o))
        if part is None:
            tol, lim = o.tolerance, o.limits
            if not (tol is None or type(tol) is Tolerance) or not (lim is None or type(lim) is Limits):
                return None
            part = owners[id(o)] = (id(o), str(o.soundness), id(tol), id(lim), float(getattr(o, "min_saving", 0.0)),
                                    bool(getattr(o, "recomputes", False)), bool(getattr(o, "jointly", False)))
            held += [o, tol, lim]
        key.append((id(r), part))
        held.append(r)
    return tuple(key), tuple(held)


def rules_fingerprint(entries: Sequence[tuple[Any, Any]]) -> str:
    """Every rule in order, with its ruleset's soundness class, tolerance and back-off. Raises :class:`Unstable`.

    The last few digests are kept (:data:`_LAST`), by the rules' and rulesets' identities and what each ruleset
    adds as read at this call (:func:`_entries_key`), with the objects that key names by identity, and each rule's
    own digest (:func:`rule_fingerprint`'s table): a rule whose digest is made again (dropped from that table: what
    it reaches changed) is read afresh."""
    made = _entries_key(entries)
    if made is None:
        return _rules_fingerprint(entries)
    key, held = made
    with _LAST_LOCK:
        found = _LAST.get(key)
        if found is not None:
            _LAST.move_to_end(key)
    # (a key found names the objects its entry holds alive by their ids, so they are these: no other lives there)
    if found is not None and all(_RULES.get(r) == d for (r, _), d in zip(entries, found[2])):
        return found[1]
    digest = _rules_fingerprint(entries)
    # with each rule's own digest as made: one dropped from (or made again in) the rules' table is read afresh
    mine = tuple(_RULES.get(r) for r, _ in entries)
    with _LAST_LOCK:
        _LAST[key] = (held, digest, mine)
        while len(_LAST) > _LAST_SIZE:
            _LAST.popitem(last=False)
    return digest


def _rules_fingerprint(entries: Sequence[tuple[Any, Any]]) -> str:
    parts = []
    memo: dict = {}  # a pack's rules share its helpers: each is walked once for all of them
    # a ruleset's own part, once for all its rules (18 rulesets own the identity packs' 112 rules): read in this
    # call, so a ruleset changed between rewrites is read afresh
    owners: dict[int, tuple] = {}
    for r, owner in entries:
        try:
            own = owners.get(id(owner))
            if own is None:
                own = owners[id(owner)] = (
                    (owner.soundness, fingerprint(owner.tolerance), fingerprint(owner.limits),
                     getattr(owner, "min_saving", 0.0))
                    + (("recomputes",) if getattr(owner, "recomputes", False) else ())
                    + (("jointly",) if getattr(owner, "jointly", False) else ()))
            parts.append((rule_fingerprint(r, memo),) + own)
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
