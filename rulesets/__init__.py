"""The built-in rule packs.

Each pack is a module exporting one :class:`rewrite.Ruleset` of the same name,
loaded on first use (defining a rule traces it, which takes a moment):

* ``rulesets.algebra`` (exact): identities, shape and convert
  simplifications, constant folding. (Patterns match ``add`` and ``mul`` in
  either operand order without a commutativity rule.)
* ``rulesets.fastmath`` (fastmath): rewrites that change floating-point
  results, each toggle also usable alone (``rulesets.fastmath.reassociate``).
  No other pack includes them.
* ``rulesets.scan`` (identity): reductions of stacked scan outputs computed
  inside the loop; carry-independent work lifted out of loops.
* ``rulesets.derivatives`` (identity): identities that make autodiff's
  backward passes as fast as hand-derived ones.
* ``rulesets.nn`` (identity): the idioms of model code in their lean and
  stable forms: one-hot products as gathers, ``log_softmax``, softplus, and
  a language model's cross-entropy over ``h @ W`` computed over token blocks
  without the tokens x vocabulary logits (``rulesets/nn_lm_head.py``).
* ``rulesets.linalg`` (identity): matrix products reordered and simplified
  by their shapes (associativity, transposes, factors, distributivity,
  reductions of products).
* ``rulesets.attention`` (identity): softmax attention computed over key
  blocks (online softmax, a backward that recomputes each block), so that
  neither pass holds the N x N scores.

``BUILTIN`` maps each available pack's name to its ruleset.

>>> import rulesets
>>> sorted(rulesets.BUILTIN) == sorted(n for n in rulesets.PACKS if n in rulesets.BUILTIN)
True
>>> sorted(n for n in dir(rulesets) if not n.startswith("__")) == sorted(rulesets.PACKS + ("BUILTIN", "PACKS"))
True
"""

from __future__ import annotations

import importlib as _importlib
import sys as _sys
import types as _types
from collections.abc import Iterator as _Iterator
from collections.abc import Mapping as _Mapping
from typing import Any as _Any

PACKS = ("algebra", "fastmath", "scan", "derivatives", "nn", "linalg", "attention")


class _Packs(_types.ModuleType):
    """This package, whose pack names stay bound to their rulesets.

    Importing a submodule (``import rulesets.algebra``, as ``pytest
    --doctest-modules`` does) binds its name in the package to the module;
    here the name is bound to the pack's ruleset instead.
    """

    def __setattr__(self, name: str, value: _Any) -> None:
        if name in PACKS and isinstance(value, _types.ModuleType) and hasattr(value, name):
            value = _documented(value, getattr(value, name))
        super().__setattr__(name, value)


def _documented(module: _types.ModuleType, pack: _Any) -> _Any:
    """The pack, whose ``__doc__`` (what ``help(rulesets.attention)`` shows) is its module's page and rules."""
    pack.__doc__ = pack.describe(module.__doc__ or "")
    return pack


_sys.modules[__name__].__class__ = _Packs


def _load(name: str) -> _Any:
    try:
        module = _importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{name}":
            raise AttributeError(f"module 'rulesets' has no pack {name!r} (not built yet)") from None
        raise
    value = _documented(module, getattr(module, name))
    globals()[name] = value  # later lookups skip __getattr__
    return value


class _Builtin(_Mapping):
    """The packs by name, each loaded when it is first read: ``rewrite(f, rulesets=["nn"])`` loads ``nn`` alone
    (defining a pack's rules runs their example programs: attention's took a second, and raised where it could not
    run under a user's settings, for a program that named no attention at all)."""

    def __getitem__(self, name: str) -> _Any:
        if name not in PACKS:
            raise KeyError(name)
        try:
            return getattr(_importlib.import_module(__name__), name)
        except AttributeError:  # a pack not built yet
            raise KeyError(name) from None

    def __iter__(self) -> _Iterator[str]:
        return (n for n in PACKS if n in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def __getattr__(name: str) -> _Any:
    if name in PACKS:
        return _load(name)
    if name == "BUILTIN":
        return _Builtin()
    raise AttributeError(f"module 'rulesets' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The packs, ``PACKS`` and ``BUILTIN``, and the module's dunders: no imported helper."""
    return sorted({n for n in globals() if n.startswith("__")} | set(PACKS) | {"PACKS", "BUILTIN"})
