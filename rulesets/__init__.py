"""The built-in rule packs.

Each pack is a module exporting one :class:`rewrite.Ruleset` of the same name,
loaded on first use (defining a rule traces it, which takes a moment):

* ``rulesets.algebra`` (exact): identities, commutation, shape and convert
  simplifications, constant folding.
* ``rulesets.fastmath`` (fastmath): rewrites that change floating-point
  results, each toggle also usable alone (``rulesets.fastmath.reassociate``).
  No other pack includes them.
* ``rulesets.scan`` (identity): reductions of stacked scan outputs computed
  inside the loop; carry-independent work lifted out of loops.
* ``rulesets.derivatives`` (identity): identities that make autodiff's
  backward passes as fast as hand-derived ones.

``BUILTIN`` maps each available pack's name to its ruleset.

>>> import rulesets
>>> sorted(rulesets.BUILTIN) == sorted(n for n in rulesets.PACKS if n in rulesets.BUILTIN)
True
"""

from __future__ import annotations

import importlib
from typing import Any

PACKS = ("algebra", "fastmath", "scan", "derivatives")


def _load(name: str) -> Any:
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{name}":
            raise AttributeError(f"module 'rulesets' has no pack {name!r} (not built yet)") from None
        raise
    value = getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __getattr__(name: str) -> Any:
    if name in PACKS:
        return _load(name)
    if name == "BUILTIN":
        out = {}
        for pack in PACKS:
            try:
                out[pack] = getattr(importlib.import_module(__name__), pack)
            except AttributeError:
                continue
        return out
    raise AttributeError(f"module 'rulesets' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(PACKS) + ["BUILTIN"])
