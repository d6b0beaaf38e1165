"""Rewrite JAX programs with user-written rules, checked by property tests.

A function's jaxpr is loaded into an egglog e-graph, saturated with rulesets,
and the cheapest equivalent program under a cost model is emitted back as a
jaxpr that runs under ``jit``, ``grad``, ``vmap`` and sharding like any JAX
code. ``pipeline.run_pipeline`` reads the stages top to bottom; each folder
is one role (``ir``: the data; ``jaxpr``: trace, load, emit; ``rules``;
``extract``; ``cost``; ``grad``; ``cache``; ``report``), and imports run one
way, from the public entry points (``api``) down to ``ir``. The public
surface is this module's names, :mod:`rewrite.testing` and
:mod:`rewrite.loops`; everything else is internal.
"""

import os as _os

from .ir.jaxapi import hide_from_tracebacks as _hide

# JAX's errors and filtered tracebacks name the user's code, not this package's frames around it (as JAX's own)
_hide(_os.path.dirname(_os.path.abspath(__file__)) + _os.sep)

from . import loops  # noqa: E402  (the loop API: rewrite.loops.Loop, rewrite.loops.SCAN)
from .api import Rewritten, explain, rewrite
from .cost.guard import Guard
from .cost.model import AnalyticCost, CostModel, NodeCost, NodeInfo
from .define import rule
from .errors import RewriteLimitWarning, RewriteWarning
from .ir.primitives import GROUPS, OpSpec, register_primitive
from .jaxpr.state import StateError
from .report.report import Report
from .rules.match import Match, Params, Value
from .rules.pattern import Ops, Pat, ops
from .rules.rule import Rule, procedural
from .rules.sliced import Sliced
from .rules.ruleset import Ruleset, Tolerance
from .records import Limits

__all__ = [
    "AnalyticCost",
    "CostModel",
    "GROUPS",
    "Guard",
    "Limits",
    "Match",
    "NodeCost",
    "NodeInfo",
    "OpSpec",
    "Ops",
    "Params",
    "Pat",
    "Report",
    "RewriteLimitWarning",
    "RewriteWarning",
    "Rewritten",
    "Rule",
    "Ruleset",
    "Sliced",
    "StateError",
    "Tolerance",
    "Value",
    "explain",
    "loops",
    "ops",
    "procedural",
    "register_primitive",
    "rewrite",
    "rule",
]


def __dir__() -> list[str]:
    """The public names, ``testing`` once it is imported, and the module's dunders: not the internal
    subpackages, whose names (``rules``, ``report``, ...) would read as public."""
    return sorted({n for n in globals() if n.startswith("__") or n == "testing"} | set(__all__))
