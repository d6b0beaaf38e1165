"""``rewrite(..., guard=True)``: the rewritten program is kept only if it runs faster than the original.

A cost model predicts; it can be wrong (issue 16 found savings that XLA
made anyway). With the guard on, the first time a signature is rewritten,
the original and the rewritten program are compiled with ``jax.jit`` and
timed side by side on random inputs of the real inputs' shapes and dtypes:
after a warm-up, each round runs both once in a shuffled order, so drift in
the machine's speed hits both alike (as ``benchmarks/harness.py`` and
``cost_model="measure"`` do), and the one with the lower median is kept.
The decision is recorded in ``Rewritten.result(...).guard`` and, with the
disk cache on, stored with the entry, so a later process does not time
again. Programs with effects or sharded inputs cannot be run on made-up
inputs; for those the rewritten program stands and the decision says so.

>>> import jax.numpy as jnp
>>> from rewrite import rewrite
>>> f = rewrite(lambda x: jnp.sin(x) * 2.0 + jnp.sin(x) * 2.0, guard=True, cache=False)
>>> out = f(jnp.ones(1000))
>>> f.result(jnp.ones(1000)).guard.kept in ("original", "rewritten")
True
"""

from __future__ import annotations

import dataclasses
import logging


from ..ir.jaxapi import core
from .measure import _outside_traces, measurable, time_programs

log = logging.getLogger("rewrite")


@dataclasses.dataclass(frozen=True)
class Guard:
    """How the guard times: ``rounds`` interleaved rounds, each call repeated until a round lasts
    ``min_round_seconds``, stopping early after ``max_seconds``. ``rewrite(guard=True)`` uses the defaults."""

    rounds: int = 9
    min_round_seconds: float = 0.02
    max_seconds: float = 20.0


@dataclasses.dataclass(frozen=True)
class GuardDecision:
    """Which program the guard kept, and the two median times per call (seconds; ``None`` if not timed).

    >>> from rewrite.cost.guard import GuardDecision
    >>> print(GuardDecision("original", 0.002, 0.003, "timed"))
    guard kept the original: 2.000 ms per call against 3.000 ms for the rewritten program (timed)
    """

    kept: str  # "original" or "rewritten"
    seconds_original: float | None
    seconds_rewritten: float | None
    reason: str
    cached: bool = False  # read from the disk cache, not timed in this process

    def __str__(self) -> str:
        if self.seconds_original is None or self.seconds_rewritten is None:
            return f"guard kept the {self.kept} program ({self.reason})"
        mine, other = ((self.seconds_original, self.seconds_rewritten) if self.kept == "original"
                       else (self.seconds_rewritten, self.seconds_original))
        what = "the rewritten program" if self.kept == "original" else "the original"
        kept = "the original" if self.kept == "original" else "the rewritten program"
        return (f"guard kept {kept}: {mine * 1e3:.3f} ms per call against {other * 1e3:.3f} ms for {what} "
                f"({self.reason}{', from the cache' if self.cached else ''})")

    def as_dict(self) -> dict:
        return {"kept": self.kept, "seconds_original": self.seconds_original,
                "seconds_rewritten": self.seconds_rewritten, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict, cached: bool = False) -> "GuardDecision":
        return cls(d["kept"], d.get("seconds_original"), d.get("seconds_rewritten"), d.get("reason", ""), cached)


def guard(before: core.ClosedJaxpr, after: core.ClosedJaxpr, settings: Guard | None = None
          ) -> tuple[core.ClosedJaxpr, GuardDecision]:
    """Time ``before`` and ``after`` side by side and return the faster, with the decision."""
    settings = settings or Guard()
    if after is before:
        return before, GuardDecision("original", None, None, "the rewrite changed nothing")
    if not measurable(before):
        return after, GuardDecision("rewritten", None, None, "not timed: the program has effects or sharded inputs")
    # time_programs reads rounds, min_round_seconds and max_seconds from its model argument
    t_before, t_after = _outside_traces(time_programs, [before, after], settings)
    if t_after is None and t_before is None:
        return after, GuardDecision("rewritten", None, None, "not timed: neither program compiled on its own")
    if t_after is None or (t_before is not None and t_before <= t_after):
        decision = GuardDecision("original", t_before, t_after, "timed")
        log.info("%s", decision)
        return before, decision
    decision = GuardDecision("rewritten", t_before, t_after, "timed")
    log.info("%s", decision)
    return after, decision
