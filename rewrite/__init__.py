"""Rewrite JAX programs with user-written rules, checked by property tests.

A function's jaxpr is loaded into an egglog e-graph, saturated with rulesets,
and the cheapest equivalent program under a cost model is emitted back as a
jaxpr that runs under ``jit``, ``grad``, ``vmap`` and sharding like any JAX
code. The pipeline's stages are the numbered modules ``_1_trace`` to
``_6_evaluate``; ``_pipeline.run_pipeline`` reads them top to bottom.
"""

from ._3_saturate import Limits
from ._6_evaluate import RewriteLimitWarning, RewriteWarning, Rewritten, rewrite
from ._cost import AnalyticCost, CostModel, NodeCost, NodeInfo
from ._primitives import GROUPS, OpSpec, register_primitive
from ._pattern import Ops, Pat, ops
from ._guard import Guard
from ._report import Report, explain
from ._rules import Match, Params, Rule, Ruleset, Tolerance, Value, procedural
from ._define import rule
from . import loops  # noqa: E402  (the loop API: rewrite.loops.Loop, rewrite.loops.SCAN)

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
