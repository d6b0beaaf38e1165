"""The disk cache's key: a SHA-256 of everything a rewrite's result depends on.

The program in a canonical form (:func:`rewrite.cache.fingerprint.program_fingerprint`),
each rule's code and its ruleset's soundness class, tolerance and back-off,
the cost model, the limits, and the versions of Python, jax, jaxlib, egglog
and this library (its version and a hash of its source, the built-in packs' included).
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import sys
import weakref
from typing import Any, Sequence


from ..ir.jaxapi import core
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


def rules_fingerprint(entries: Sequence[tuple[Any, Any]]) -> str:
    """Every rule in order, with its ruleset's soundness class, tolerance and back-off. Raises :class:`Unstable`."""
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
