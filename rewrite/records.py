"""The records a rewrite produces and reads: its limits, each rule's statistics, and its result.

Data only: no stage runs here. The stages fill these in (``rules/saturate.py`` the statistics,
``pipeline.py`` the result), and the cache, the reports and the public entry points read them.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import contextvars
import dataclasses
import math
import threading
import time
from typing import Any, Iterator

from .ir.jaxapi import core


@dataclasses.dataclass
class Barred:
    """One union made by a preferred rule: where, which forms it bars, and what it built."""

    rule: str
    root: int              # a name in the matched class
    ctors: frozenset       # the left-hand side's constructors at its root
    built: int             # the name of the replacement


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on saturation. When one is hit, the best program found so far is used.

    ``iterations``: rounds of matching. ``nodes``: rows in the e-graph
    (nodes, names, facts and matches together). ``seconds``: wall time for
    all the saturations of one signature's rewrite together: its program, the
    passes of a training step's search, and the derivative programs ``jax.grad``
    or ``jax.jvp`` of it asks for (a :class:`Budget`); each saturation gets what
    the earlier ones left, at least :data:`FLOOR`. ``matches``: new matches a rule may act on in one iteration
    before it is banned for ``ban`` iterations (both double on each ban).
    ``growth`` retires a rule that outruns its allowance in an e-graph grown
    past that many times its starting size, instead of banning it for a while.
    A :class:`Ruleset` given ``limits=`` uses its ``matches`` and ``ban`` for
    its own rules instead, and runs them in its first ``iterations`` rounds
    only (rules that reach every bracketing of a chain, such as
    associativity, grow the e-graph exponentially in the rounds they run);
    the run's limits bound everything else.

    >>> from rewrite import Limits
    >>> Limits(seconds=2.0).iterations
    30
    """

    iterations: int = 30
    nodes: int = 500_000
    seconds: float = 20.0
    matches: int = 2_000
    ban: int = 2
    #: a rule that outruns its allowance once the e-graph holds more than ``growth`` times the rows it
    #: started with is retired for the rest of the run, not banned for a while: past that size the
    #: rules that keep matching more are the ones reaching every order and bracketing of a chain
    #: (commutativity, associativity, and what merges and splits along them), whose matches grow
    #: exponentially while the rewrites worth having were found early (benchmarks/growth.py).
    growth: float = 16.0
    #: the share of ``seconds`` one rule may spend in one saturation: a rule past it stops at once (a procedure at its next
    #: build or ``Match.check_time``), keeps what it built, fires no more in this rewrite, and is reported
    #: (``RuleStats.timed_out``, a :class:`RewriteLimitWarning`). One rule cannot take the whole budget.
    rule_share: float = 0.25

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"Limits.{f.name} must be a number >= 0, got {v!r}")

    @classmethod
    def of(cls, limits: Any) -> "Limits":
        """``limits=`` as a :class:`Limits`: ``None`` for the defaults, a ``Limits``, or a mapping of its fields.

        >>> Limits.of({"iterations": 3}).iterations
        3
        >>> Limits.of({"iteration": 3})
        Traceback (most recent call last):
        TypeError: limits=: Limits has no field 'iteration'; its fields are iterations, nodes, seconds, matches, ban, growth, rule_share
        """
        if limits is None:
            return cls()
        if isinstance(limits, cls):
            return limits
        if isinstance(limits, collections.abc.Mapping):
            names = [f.name for f in dataclasses.fields(cls)]
            unknown = [k for k in limits if k not in names]
            if unknown:
                raise TypeError(f"limits=: Limits has no field {unknown[0]!r}; its fields are {', '.join(names)}")
            return cls(**limits)
        raise TypeError(f"limits= takes a Limits or a mapping of its fields, got {type(limits).__name__}")


#: the least time a saturation is given once its rewrite's :class:`Budget` is spent: each later pass (a training
#: step's remainder, a derivative program) still runs a little, and stops at the time limit with what it found
FLOOR = 0.02


class Budget:
    """The time one signature's rewrite may saturate in all (``Limits.seconds``): its program, a training step's
    passes and the derivative programs asked for later share it. Only the time spent inside the rewrite counts
    (:meth:`spending`), so a gradient asked for long after the forward gets what the forward left. ``passes``:
    each saturation's (what, seconds given, seconds taken, why it stopped), in order; ``cut``: the passes whose
    extraction stopped searching once the time was spent (:func:`out_of_time`), each named once.

    >>> b = Budget(1.0)
    >>> with b.spending("forward"):
    ...     given = b.allow(20.0)
    ...     b.record(given, 1.01, "time limit")
    >>> given <= 1.0, b.ran_out, b.passes[0][0]
    (True, True, 'forward')
    >>> Budget(0.0).allow(20.0) == FLOOR  # spent: a later saturation still gets the floor
    True
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spent = 0.0  # while nothing is inside spending()
        self.passes: list[tuple[str, float, float, str]] = []
        self.told = False  # its time limit was said to the user (once a rewrite: :meth:`tell`)
        self.cut: list[str] = []
        self._inside = 0  # spending() blocks open, in any thread: the wall time they cover is counted once
        self._since = 0.0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def spending(self, what: str | None = None) -> Iterator["Budget"]:
        """Count the time inside as spent, and make this budget the one saturations read (:func:`budget_now`);
        ``what`` names the saturations inside (``passes``). Nested calls, and calls in other threads at the same
        time (a signature's VJP and JVP built at once), count the time once."""
        with self._lock:
            if not self._inside:
                self._since = time.perf_counter()
            self._inside += 1
        tokens = _BUDGET.set(self), _STAGE.set(what or _STAGE.get())
        try:
            yield self
        finally:
            _BUDGET.reset(tokens[0])
            _STAGE.reset(tokens[1])
            with self._lock:
                self._inside -= 1
                if not self._inside:
                    self.spent += time.perf_counter() - self._since

    def left(self) -> float:
        running = time.perf_counter() - self._since if self._inside else 0.0
        return self.seconds - self.spent - running

    def allow(self, seconds: float) -> float:
        """The seconds a saturation bounded by ``seconds`` may take now: what is left, at least :data:`FLOOR`."""
        return min(seconds, max(self.left(), FLOOR))

    def record(self, given: float, took: float, stopped: str) -> None:
        self.passes.append((_STAGE.get(), given, took, stopped))

    @property
    def ran_out(self) -> bool:
        return bool(self.cut) or any(p[3] == "time limit" for p in self.passes)

    def said(self) -> str:
        """Which pass stopped at the time limit, and each saturation's seconds, in words."""
        first = next((i for i, p in enumerate(self.passes) if p[3] == "time limit"), None)
        each = ", ".join(f"{w} {took:.2f} s" + (" (stopped)" if why == "time limit" else "")
                         for w, _, took, why in self.passes)
        where = (f"{self.passes[first][0]}, saturation {first + 1} of {len(self.passes)}" if first is not None
                 else f"{self.cut[0]}'s extraction")
        cut = f"; extraction cut short in {', '.join(self.cut)}" if self.cut else ""
        return (f"stopped at the time limit (Limits.seconds = {self.seconds:g} s for the whole rewrite) in "
                f"{where}; using the best program found so far. Saturations: {each}{cut}")

    def tell(self) -> str | None:
        """:meth:`said`, the first time it is asked for after the budget ran out; else ``None``."""
        if self.told or not self.ran_out:
            return None
        self.told = True
        return self.said()


_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("rewrite_budget", default=None)
_STAGE: contextvars.ContextVar[str] = contextvars.ContextVar("rewrite_stage", default="the program")


def budget_now() -> Budget | None:
    """The budget of the rewrite running in this context (:meth:`Budget.spending`), else ``None`` (a bare
    pipeline, whose saturation is bounded by ``Limits.seconds`` alone)."""
    return _BUDGET.get()


def out_of_time() -> bool:
    """Whether the running rewrite's time (:class:`Budget`, ``Limits.seconds``) is spent: an extraction's searches
    (``extract/program.py``'s ``ProgramSearch``, a ruleset's ``min_saving`` check, a VJP's gradients alone) then
    keep the best program found so far instead of searching on, and the pass is named in ``Budget.cut`` (so
    ``limits_met`` warns). ``False`` outside a rewrite's budget (a bare pipeline) and while time is left: far
    under the limit an extraction is the same as with no budget."""
    budget = _BUDGET.get()
    if budget is None or budget.left() > 0:
        return False
    what = _STAGE.get()
    if what not in budget.cut:
        budget.cut.append(what)
    return True


@contextlib.contextmanager
def stage(what: str) -> Iterator[None]:
    """Name the saturations inside ``what`` in the running rewrite's budget, if any."""
    budget = budget_now()
    if budget is None:
        yield
        return
    with budget.spending(what):
        yield


@dataclasses.dataclass
class RuleStats:
    fired: int = 0
    matched: int = 0
    rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    banned: int = 0
    #: retired for the rest of the run for outrunning its allowance in a grown e-graph (``Limits.growth``)
    retired: bool = False
    seconds: float = 0.0
    #: stopped for the rest of the run for spending its time share (``Limits.rule_share``)
    timed_out: bool = False
    examples: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)  # (avals, root source)


#: the pipeline's stages, as ``Result.times`` names them
STAGES = ("trace", "load", "saturate", "extract", "emit")
#: the whole-step search's parts (``Rewritten._whole_step``), as ``Result.times`` names them beside ``whole_step``,
#: their sum: the candidates, their re-derivations, proofs and replacement; each loss's forward rewritten, its VJP
#: rewritten jointly, the two built again without a ``jointly`` ruleset (where one fired); the step so changed,
#: rewritten and priced; the step as written, priced
STEP_STAGES = ("step find", "step forward", "step joint", "step jointly", "step rest", "step price")


def lap(spent: dict[str, float], stage: str, since: float) -> float:
    """Add the seconds since ``since`` to ``spent[stage]`` (one of :data:`STEP_STAGES`); return now."""
    now = time.perf_counter()
    spent[stage] = spent.get(stage, 0.0) + now - since
    return now


@dataclasses.dataclass
class Result:
    before: core.ClosedJaxpr
    after: core.ClosedJaxpr
    cost_before: float
    cost_after: float
    stopped: str
    iterations: int
    rows: int
    times: dict[str, float]
    stats: dict[str, RuleStats]
    rewritten: bool
    warnings: list[str]
    # kept for reports that look deeper (explain's provenance, to_dot)
    egraph: Any = None
    choice: dict | None = None
    snapshot: Any = None
    roots: list | None = None
    original: set | None = None
    out_names: list | None = None  # the V names of the program's outputs, for checks that extract their own way
    #: what cost_model="measure" timed (rewrite/cost/measure.py), else None
    timing: Any = None
    #: the disk cache's file this result was read from (rewrite/cache/store.py), else None
    cached: str | None = None
    #: with rewrite(guard=True): which program the guard kept and the two times (rewrite/cost/guard.py)
    guard: Any = None
    #: preferred rules (rule(..., prefer=True)) -> how many classes' choice they forced (rewrite/rules/prefer.py)
    preferred: dict[str, int] = dataclasses.field(default_factory=dict)
    #: with AnalyticCost(memory_budget=...): the candidates the budget excluded (rewrite/cost/memory.py)
    over_budget: list = dataclasses.field(default_factory=list)
    #: why the program that runs was chosen (see :func:`why_chosen`); "" when the input program is kept
    why: str = ""
    #: a training step: the losses whose gradients were found, proven and replaced, or why not
    #: (:class:`rewrite.grad.step.StepFinding`), else None
    step: Any = None
    #: of the rules of ``jointly=True`` rulesets that fired, those whose nodes the program that comes out uses
    #: (``rewrite.grad.vjp.decided_jointly`` builds the forward again without them only where there are some);
    #: None where that is not known (a program timed by ``cost_model="measure"``, one the guard replaced, an entry of
    #: the disk cache that does not keep it: ``rewrite/cache/store.py``)
    jointly_chosen: frozenset | None = None
    #: where asked (``run_pipeline(plain=True)``) and ``jointly_chosen`` is not empty: the program read off the same
    #: saturated e-graph without the nodes those rules built (``pipeline.plain_program``), which
    #: ``decided_jointly`` takes for the forward rewritten without them instead of saturating it again; else None
    plain: core.ClosedJaxpr | None = None
    #: ``plain``'s price as its extraction priced it (NaN where there is no ``plain``): ``grad/together.py``'s
    #: ``rewrite_joints`` reads it beside ``cost_after`` (``one_joint_can_win``)
    plain_cost: float = math.nan
    #: how many of the chosen program's nodes each rule built (``extract.policy.provenance``, as ``explain``'s
    #: ``Report.used``), recorded before the e-graph is released; None where not known (a program timed by
    #: ``cost_model="measure"`` or replaced by the guard, a training step's losses replaced, a disk cache entry)
    used: dict[str, int] | None = None
    #: the time budget this signature's rewrite shared among its saturations (:class:`Budget`); None for a bare
    #: pipeline's result or one read from the disk cache
    budget: Budget | None = None

    def release(self) -> None:
        """Drop what is kept for deeper reports (the e-graph, its snapshot and the choice over it) and give the
        e-graph back to the pool: with the built-in packs it holds tens of MB of native memory."""
        eg = self.egraph
        self.egraph = self.snapshot = self.choice = self.roots = self.original = self.out_names = None
        if eg is not None:
            eg.release()


