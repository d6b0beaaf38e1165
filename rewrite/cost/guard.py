"""``rewrite(..., guard=True)``: the rewritten program is kept only if it runs faster than the original.

A cost model predicts; it can be wrong (issue 16 found savings that XLA
made anyway). With the guard on, the first time a signature is rewritten,
the original and the rewritten program are compiled with ``jax.jit`` and
timed side by side on that first call's own arguments (or, where the call
is traced by an outer ``jit`` or ``grad`` and its arguments are not concrete,
on random inputs of their shapes and dtypes): after a warm-up, each round
runs both once in a shuffled order, so drift in the machine's speed hits
both alike (as ``benchmarks/harness.py`` and ``cost_model="measure"`` do),
and the one with the lower median is kept. The decision is recorded in
``Rewritten.result(...).guard`` and, with the disk cache on, stored with the
entry, so a later process does not time again.

A guard that cannot time both programs keeps the original, and a
``RewriteWarning`` says why: a program with effects (timing would repeat
them), sharded inputs that are not concrete, or a program that fails on the
inputs it was given (random inputs can fail a program's own checks, such as
diffrax's ``saveat.ts must be increasing``). The guard covers the program a
call runs; the derivative programs that ``jax.grad``/``jax.jvp`` of a
rewritten function run (``rewrite/grad/primitive.py``) are not timed.

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
import math
from typing import Any, Sequence


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
    #: time only near-ties: rewrites the model predicts within this fraction of the original's speed (a
    #: predicted speed-up between ``1 / (1 + near_tie)`` and ``1 + near_tie``), the band the model's error
    #: on the decision corpus spans (``benchmarks/results/decisions.md``); beyond it the model's choice
    #: stands untimed, and the first call pays no timing. ``None`` times every rewrite.
    near_tie: float | None = None

    def untimed(self, predicted: float) -> str | None:
        """Why a rewrite predicted ``predicted`` times as fast is kept without timing, or ``None`` to time it.

        >>> Guard(near_tie=0.15).untimed(1.5) is not None, Guard(near_tie=0.15).untimed(1.05), Guard().untimed(9.0)
        (True, None, None)
        """
        if self.near_tie is None or not (predicted > 0 and math.isfinite(predicted)):
            return None
        if 1 / (1 + self.near_tie) <= predicted <= 1 + self.near_tie:
            return None
        return (f"not timed: the model predicts {predicted:.2f}x, outside the near-tie band of "
                f"{self.near_tie:.0%} where it is timed")


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


def guard(before: core.ClosedJaxpr, after: core.ClosedJaxpr, settings: Guard | None = None,
          args: Sequence[Any] | None = None) -> tuple[core.ClosedJaxpr, GuardDecision]:
    """Time ``before`` and ``after`` side by side and return the faster, with the decision.

    ``args`` are the call's own arguments (concrete arrays), when the first call had them; else random
    inputs of the programs' types are used. A guard that cannot time both programs keeps the original.
    """
    settings = settings or Guard()
    if after is before:
        return before, GuardDecision("original", None, None, "the rewrite changed nothing")
    if before.jaxpr.effects or after.jaxpr.effects:
        return _unmeasured(before, "not timed: the program has effects, which timing would repeat")
    if args is None and not measurable(before):
        return _unmeasured(before, "not timed: its inputs are sharded and the call's own were not concrete")
    on = "the call's arguments" if args is not None else "random inputs"
    # time_programs reads rounds, min_round_seconds and max_seconds from its model argument
    t_before, t_after = _outside_traces(time_programs, [before, after], settings, 0, args)
    if t_before is None or t_after is None:
        failed = " and ".join(n for n, t in (("the original", t_before), ("the rewritten program", t_after))
                              if t is None)
        return _unmeasured(before, f"not timed: {failed} failed to compile or run on {on}")
    kept = "original" if t_before <= t_after else "rewritten"
    decision = GuardDecision(kept, t_before, t_after, f"timed on {on}")
    log.info("%s", decision)
    return (before if kept == "original" else after), decision


def _unmeasured(before: core.ClosedJaxpr, reason: str) -> tuple[core.ClosedJaxpr, GuardDecision]:
    """A guard that could not time keeps the original program, and says so (a warning names the reason)."""
    decision = GuardDecision("original", None, None, reason)
    log.warning("%s", decision)
    return before, decision
