"""``explain``: what a rewrite did, in a form a person can read.

A :class:`Report` holds the program before and after, their costs under the
model, which rules fired (matched, verified and applied) and how many of the
nodes they built made it into the result, why saturation stopped, and the
time each stage took. ``str(report)`` gives a summary and then a diff of the
two jaxprs; :meth:`Report.rules` lists each rule with its two sides;
:meth:`Report.to_dot` draws a small e-graph.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Iterator, Sequence

import jax

from ..extract.policy import provenance as _provenance
from ..ir.jaxapi import core, user_frame
from ..ir.primitives import nbytes
from ..jaxpr.emit import emit
from ..jaxpr.trace import same_program, spec_of
from ..pipeline import program_cost
from ..records import STAGES, STEP_STAGES, Result
from ..rules.match import _short
from ..rules.rule import Rule
from ..rules.ruleset import Ruleset
from .diff import unified
from .dot import to_dot, to_svg
from .why import builds_loops, declined, forced_choice


def equations(closed: Any) -> Iterator[core.JaxprEqn]:
    """Every equation of a jaxpr, each before those inside its bodies (scan, cond, jit, custom calls, ...)."""
    jaxpr = closed.jaxpr if isinstance(closed, core.ClosedJaxpr) else closed
    for e in jaxpr.eqns:
        yield e
        for sub in core.jaxprs_in_params(e.params):
            yield from equations(sub)


def count_eqns(closed: Any) -> int:
    """Equations in a jaxpr, counting those inside bodies (scan, cond, jit, ...) too."""
    return sum(1 for _ in equations(closed))


def primitive_counts(closed: Any) -> collections.Counter:
    """How often each primitive occurs in a jaxpr, bodies included."""
    return collections.Counter(e.primitive.name for e in equations(closed))


@dataclasses.dataclass
class Report:
    """What :func:`explain` found. ``str(report)`` reads well; the fields are for programs.

    ``fired`` counts each rule's applications and ``used`` the nodes it built that
    are in ``after``; ``rejected`` counts, per rule and reason, the matches it did
    not act on (``guard``, ``unverified``, ``type``, ``declined``, ...).

    >>> import jax.numpy as jnp
    >>> from rewrite import explain, rule, Ruleset
    >>> clamp = rule(lambda v: jnp.maximum(v, 0.0), lambda v: v, name="clamp_nonneg", when=lambda v: v.nonneg)
    >>> report = explain(lambda x: jnp.maximum(jnp.exp(x), 0.0), jnp.ones(3), rulesets=[Ruleset("c", [clamp])])
    >>> report.fired, report.stopped, (report.eqns_before, report.eqns_after)
    ({'clamp_nonneg': 1}, 'saturated', (2, 1))
    >>> explain(lambda x: jnp.maximum(x, 0.0), jnp.ones(3), rulesets=[Ruleset("c", [clamp])]).rejected
    {'clamp_nonneg': {'guard': 1}}
    """

    before: core.ClosedJaxpr
    after: core.ClosedJaxpr
    cost_before: float
    cost_after: float
    fired: dict[str, int]
    used: dict[str, int]
    stopped: str
    times: dict[str, float]
    iterations: int
    egraph_rows: int
    rejected: dict[str, dict[str, int]]
    warnings: list[str]
    rulesets: list[tuple[Rule, Ruleset]]
    result: Result = dataclasses.field(repr=False)
    #: what one call of the program costs whatever it computes (dispatch, and each buffer in or out),
    #: in the model's units: :meth:`rewrite.AnalyticCost.fixed`; 0 for models that do not say
    fixed_cost: float = 0.0
    model: Any = dataclasses.field(default=None, repr=False)  # the cost model, to price what was declined
    #: with ``explain(..., grad=True)``: the VJP's forward/backward split (:class:`rewrite.grad.vjp.VJPResult`)
    gradient: Any = dataclasses.field(default=None, repr=False)
    #: a training step: the losses whose gradients ``rewrite(step)`` found, proved and read from the loss-first
    #: program, or why not (:class:`rewrite.grad.step.StepFinding`), and whether the step so changed is what
    #: ``rewrite`` runs (the report's ``after`` is the step rewritten as written either way)
    step: Any = None
    step_used: bool = False
    #: where ``step_used``: the program ``rewrite`` runs (the step with its losses read from the loss-first
    #: program, rewritten) and its price; ``None`` and NaN where it runs ``after``
    runs: Any = dataclasses.field(default=None, repr=False)
    runs_cost: float = math.nan

    @property
    def excluded_by_budget(self) -> list[dict]:
        """The candidate programs the cost model's ``memory_budget`` excluded: whether each is a rewritten
        program, and its predicted peak of temporaries in bytes (``rewrite/cost/memory.py``)."""
        return list(self.result.over_budget)

    @property
    def preferred(self) -> dict[str, int]:
        """Preferred rules (``rule(..., prefer=True)``) -> in how many classes they barred the matched form,
        so that extraction took their replacement whatever the model's price."""
        return dict(self.result.preferred)

    @property
    def eqns_before(self) -> int:
        return count_eqns(self.before)

    @property
    def eqns_after(self) -> int:
        return count_eqns(self.after)

    @property
    def saved(self) -> float:
        """The fraction of the model's cost the rewrite removed."""
        if not self.cost_before or math.isnan(self.cost_before) or math.isinf(self.cost_before):
            return 0.0
        return 1.0 - self.cost_after / self.cost_before

    @property
    def predicted_speedup(self) -> float:
        """The speed-up the model predicts for one call: the prices before and after, each with the fixed
        cost of a call (:attr:`fixed_cost`) added, which no rewrite removes and which dominates small
        programs. ``saved`` leaves it out.

        >>> import jax.numpy as jnp
        >>> from rewrite import explain
        >>> report = explain(lambda x: x * 1.0, jnp.ones(3))
        >>> report.predicted_speedup
        1.0
        """
        return self._speedup(self.cost_after, self.after)

    @property
    def runs_speedup(self) -> float:
        """:attr:`predicted_speedup` of the program ``rewrite`` runs: :attr:`runs` where ``step_used``, else
        ``after``."""
        return self._speedup(*((self.runs_cost, self.runs) if self.step_used else (self.cost_after, self.after)))

    def fixed_cost_of(self, program: Any) -> float:
        """:attr:`fixed_cost` for a call of ``program`` in place of the input (its buffers counted as the input's):
        the model's ``dispatch`` may differ between them (``rewrite/cost/dispatch.py``: XLA:CPU runs a program of
        under 1,000 flops on the caller's thread), where the model prices it."""
        fixed = getattr(self.model, "fixed", None)
        if program is None or program is self.before or not callable(fixed):
            return self.fixed_cost
        try:
            return self.fixed_cost - float(fixed(0, self.before)) + float(fixed(0, program))
        except TypeError:  # a model whose ``fixed`` takes the buffers alone
            return self.fixed_cost

    def _speedup(self, cost_after: float, program: Any = None) -> float:
        before, after = self.cost_before + self.fixed_cost, cost_after + self.fixed_cost_of(program)
        if not after or math.isnan(before) or math.isinf(before):
            return 1.0
        return before / after

    def _retired(self) -> str:
        retired = [k for k, st in self.result.stats.items() if getattr(st, "retired", False)]
        return f" ({len(retired)} rule(s) retired in a grown e-graph: {', '.join(retired)})" if retired else ""

    def _slowest(self) -> str:
        """Which rules took the saturation's time: those stopped at their time share, and the slowest one."""
        stats = self.result.stats
        out = [f"rule {k} stopped at its time share after {st.seconds:.1f} s" for k, st in stats.items()
               if getattr(st, "timed_out", False)]
        if stats:
            k, st = max(stats.items(), key=lambda kv: kv[1].seconds)
            if st.seconds >= 0.01:
                out.append(f"slowest rule {k} ({st.seconds * 1e3:,.0f} ms, {st.matched} matches)")
        return "rule time: " + "; ".join(out) if out else ""

    def summary(self, verbose: bool = False) -> str:
        """The report's text without the diff. Matches not applied for an ordinary reason (a guard said
        no, a procedure declined, a root already seen, a rule's own replacement) are counted in one line
        unless ``verbose``; the others (the left side not really there, a side that cannot be traced at
        those shapes, a wrong type, an error, an unsupported operation) are listed per rule."""
        lines = [
            f"cost {self.cost_before:,.0f} -> {self.cost_after:,.0f} ({self.saved:+.1%} saved), "
            f"equations {self.eqns_before} -> {self.eqns_after}",
            f"predicted speed-up per call: {self.predicted_speedup:.2f}x (a call's fixed cost, "
            f"{self.fixed_cost:,.0f}, included)",
            f"stopped: {self.stopped}{self._retired()} after {self.iterations} iteration(s), {self.egraph_rows:,} e-graph rows",
            "time: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.times.items()),
        ]
        why = getattr(self.result, "why", "")
        if why and why != "cheaper":
            lines.insert(1, f"the rewritten program is used though not predicted cheaper: {_WHY.get(why, why)}")
        if self.step is not None:
            lines.append(f"whole step: {self.step}" + (" (the program rewrite runs)" if self.step_used else ""))
        if self.step_used:  # the figures above are the step rewritten as written's, which rewrite does not run
            lines.append(f"the program rewrite runs: cost {self.cost_before:,.0f} -> {self.runs_cost:,.0f}, predicted "
                         f"speed-up per call {self.runs_speedup:.2f}x (the lines above are the step rewritten as "
                         "written)")
        if self._slowest():
            lines.append(self._slowest())
        budget = getattr(self.result, "budget", None)
        if budget is not None and budget.ran_out:  # which of the rewrite's saturations used Limits.seconds up
            lines.append(f"time limit: {budget.said()}")
        if self.fired:
            width = max(len(k) for k in self.fired)
            lines.append("rules fired (nodes they built that the result uses):")
            for name, n in sorted(self.fired.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {name:<{width}}  {n:>4} ({self.used.get(name, 0)})")
        else:
            lines.append("no rule fired")
        shown = {k: {why: n for why, n in v.items() if verbose or why not in ORDINARY_DECLINES}
                 for k, v in self.rejected.items()}
        shown = {k: v for k, v in shown.items() if v}
        if shown:
            lines.append("matches not applied: " + "; ".join(
                f"{k}: " + ", ".join(f"{n} {why}" for why, n in sorted(v.items())) for k, v in shown.items()))
        hidden = sum(n for v in self.rejected.values() for why, n in v.items() if why in ORDINARY_DECLINES)
        if hidden and not verbose:
            rules = sorted(k for k, v in self.rejected.items() if any(w in ORDINARY_DECLINES for w in v))
            lines.append(f"ordinary declines: {hidden} match(es) of {', '.join(rules)} (a guard said no or a "
                         "procedure declined; summary(verbose=True) lists them)")
        if self.result.preferred:
            lines.append("preferred rules forced the choice (matched form barred): " + ", ".join(
                f"{k} in {n} class(es)" for k, n in sorted(self.result.preferred.items())))
        for c in self.result.over_budget:
            lines.append(f"excluded by the memory budget ({c['budget'] / 2**20:,.1f} MiB): the "
                         f"{'rewritten' if c['rewritten'] else 'input'} program, predicted to hold "
                         f"{c['predicted_temp_bytes'] / 2**20:,.1f} MiB")
        not_chosen = self.declined()
        if not_chosen:
            lines.append("loop rewrites built and not chosen (the model's prices):")
            lines.extend(f"  {d}" for d in not_chosen)
        if self.gradient is not None:
            g = self.gradient
            held = sum(nbytes(v.aval) for v in g.fwd.jaxpr.outvars[len(g.fwd.out_avals) - len(g.split.residuals):])
            if g.as_written:
                lines.append(f"gradient: JAX's own VJP of the function as written; residuals: {len(g.split.residuals)} "
                             f"value(s), {held / 2**20:.2f} MiB (where JAX splits it)")
            else:
                how = "the cheapest" if math.isnan(g.split.uses) else "the cheapest as jit runs it"
                lines.append(f"gradient: forward and backward rewritten together; residuals: {len(g.split.residuals)} "
                             f"value(s), {held / 2**20:.2f} MiB ({g.split.policy}, {how} of "
                             f"{len(g.splits_considered)} splits priced)")
            if g.decided:
                lines.append(f"gradient decided on its joint program: {g.decided}")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)

    def why(self, rule: str) -> Any:
        """Why ``rule``'s rewrite is not in the result: a :class:`rewrite.report.why.Declined` with the price kept,
        the price with the rule's nodes in the program, and the operations whose prices differ most;
        ``None`` if the rule built nothing or the report kept no e-graph."""
        if self.model is None:
            return None
        cache = self.__dict__.setdefault("_why", {})
        if rule not in cache:
            cache[rule] = declined(self.result, self.model, rule)
        return cache[rule]

    def release(self) -> None:
        """Let go of the e-graph this report keeps for :meth:`why`, :meth:`forced`, :meth:`declined` and
        :meth:`to_dot`: with the built-in packs it holds tens of MB of native memory, for as long as the
        report lives. The programs, counts, prices and the text stay; afterwards :meth:`why` and
        :meth:`forced` answer ``None``, :meth:`declined` ``[]``, and :meth:`to_dot` raises. Call it on
        reports you keep many of (a loop over programs, a cache of reports).

        >>> import jax.numpy as jnp
        >>> import rulesets
        >>> from rewrite import explain
        >>> report = explain(lambda x: jnp.exp(x) * 1.0, jnp.ones(3), rulesets=[rulesets.algebra])
        >>> report.release()
        >>> report.fired, report.eqns_after, report.forced("mul_one")
        ({'mul_one': 1}, 1, None)
        """
        self.result.release()
        self.__dict__.pop("_why", None)

    def forced(self, rule: str) -> core.ClosedJaxpr | None:
        """The program extraction chose, with ``rule``'s nodes forced in (as :meth:`why` prices it), emitted:
        a candidate that was built and not chosen, to run or time beside :attr:`result`'s ``after``
        (``benchmarks/decisions.py`` does). ``None`` if the rule built nothing, its nodes cannot stand in
        the chosen program alone, or the program has effects. With ``grad=True`` both are the joint
        program ``(primals, cotangents) -> (outputs, gradients)``, unsplit.

        >>> import jax.numpy as jnp
        >>> from rewrite import explain, rule, Ruleset
        >>> rs = Ruleset("mine", [rule(lambda x: jnp.exp(x) * jnp.exp(x), lambda x: jnp.exp(x + x), name="exp_sum")])
        >>> report = explain(lambda x: jnp.exp(x) * jnp.exp(x), jnp.ones(3), rulesets=[rs])
        >>> str(report.forced("exp_sum")).count("exp")
        1
        """
        result = self.result
        if self.model is None or result.before.jaxpr.effects:
            return None
        made = forced_choice(result, self.model, rule)
        if made is None:
            return None
        _, choice, _ = made
        try:
            out = emit(result.snapshot, choice, result.egraph, result.before.in_avals, list(result.roots), None,
                       result.before.jaxpr.debug_info)
        except Exception:  # its nodes reach each other through other rules' nodes: no program holds them alone
            return None
        return out

    def declined(self) -> list[Any]:
        """:meth:`why` for every rule that fired, built a loop, and has nothing in the result."""
        if self.model is None or self.result.egraph is None:
            return []
        names = [k for k in self.fired if not self.used.get(k) and builds_loops(self.result, k)]
        # a rule whose nodes reach nothing when forced in was superseded (a later rewrite built on it);
        # one whose program prices the same as the kept one was a tie, which goes to what was kept
        return [d for d in (self.why(k) for k in names) if d is not None and not d.note and d.drivers]

    def diff(self, context: int = 2) -> str:
        """A unified diff of the programs, the rewritten one printed with the original's variable names
        where its equations are the original's (``rewrite/report/diff.py``): only what changed shows."""
        return unified(self.before, self.after, context)

    def rules(self) -> str:
        """Each rule that fired, with its left and right sides as jaxprs at a shape it fired at."""
        out = []
        stats = self.result.stats
        for rule, owner in self.rulesets:
            if not self.fired.get(rule.name):
                continue
            st = stats[rule.name]
            out.append(f"{rule.name} [{owner.name}, {owner.soundness}]: fired {st.fired}, "
                       f"{self.used.get(rule.name, 0)} node(s) in the result")
            if st.examples and not rule.is_pat:
                avals, src = st.examples[0]
                try:
                    lhs, rhs = rule.traced(avals)
                except Exception:
                    continue
                where = _where(src)
                out.append(f"  at ({', '.join(_short(a) for a in avals)}){where}")
                out.append("  before: " + _indent(lhs))
                if rhs is not None:
                    out.append("  after:  " + _indent(rhs))
        return "\n".join(out) if out else "no rule fired"

    def to_dot(self, max_classes: int = 200) -> str:
        """The final e-graph in Graphviz DOT: clusters are classes, chosen nodes are bold."""
        return to_dot(self.result, max_classes)

    def to_svg(self, max_classes: int = 200) -> str:
        """:meth:`to_dot`, rendered by Graphviz's ``dot`` program (which must be installed)."""
        return to_svg(self.to_dot(max_classes))

    def __str__(self) -> str:
        parts = [self.summary()]
        d = self.diff()
        if d:
            parts.append(d)
        return "\n".join(parts)



def _where(src: Any) -> str:
    try:
        frame = user_frame(src.source_info.traceback) if src is not None else None
        return f" in {frame.file_name}:{frame.start_line}" if frame is not None else ""
    except Exception:
        return ""


def _indent(closed: core.ClosedJaxpr) -> str:
    return str(closed).replace("\n", "\n          ")


def provenance(result: Result) -> dict[str, int]:
    """How many chosen nodes each rule built (nodes the input program already had are not counted): as its pipeline
    recorded them (``Result.used``), else off the e-graph ``result`` kept (``keep=True``); none without either."""
    if result.used is not None:
        return dict(result.used)
    eg, snap, choice = result.egraph, result.snapshot, result.choice
    if eg is None or choice is None:
        return {}
    return _provenance(snap, eg, choice, result.roots or [], result.original or set())


#: what ``Result.why`` means, for a program used though not predicted cheaper (rewrite/pipeline.py)
_WHY = {
    "preferred": "preferred rules forced their forms (listed below), which cost more here",
    "leaner": "it is priced within the model's lean_band of the cheapest and predicted to hold less memory",
    "memory budget": "the input program is over the model's memory_budget",
    "measured": "cost_model='measure' timed it faster",
    "unexplained": "no reason recorded (please report this)",
}


def report_of(result: Result, entries: Sequence[tuple[Rule, Ruleset]], model: Any, step: Any = None,
              runs: Result | None = None) -> Report:
    """The report of one rewrite (:func:`rewrite.explain`): ``result`` kept its e-graph (``keep=True``);
    ``step`` is what ``rewrite(step)`` found of a training step's losses, ``runs`` the step so changed where that
    is what ``rewrite`` runs."""
    # the whole-step search's time and its parts (``Rewritten._whole_step``), where it ran
    times = {k: result.times.get(k, 0.0) for k in (*STAGES, "whole_step", *STEP_STAGES)
             if k in STAGES or k in result.times}
    return Report(
        before=result.before, after=result.after, cost_before=result.cost_before, cost_after=_kept_cost(result, model),
        step=step, step_used=runs is not None, runs=None if runs is None else runs.after,
        runs_cost=math.nan if runs is None else runs.cost_after,
        fired={k: s.fired for k, s in result.stats.items() if s.fired},
        used=provenance(result), stopped=result.stopped, times=times, iterations=result.iterations,
        egraph_rows=result.rows, rejected={k: dict(s.rejected) for k, s in result.stats.items()},
        warnings=result.warnings, rulesets=entries, result=result, model=model,
        fixed_cost=_fixed_cost(model, result.before),
    )


def _kept_cost(result: Result, model: Any) -> float:
    """``result.cost_after``, but where no rule's node is used (``rewritten`` False) on ``cost_before``'s footing: the
    program that runs, as loaded, priced. The extraction prices the input's own terms in the saturated e-graph, whose
    facts can price the same program lower (optax_clip_adamw on jax 0.11+: 924,533 as loaded, 903,075 so, the same
    equations), which the report would call a saving. The program that runs is the input, or the input made leaner by
    its own terms (a term it computes twice computed once, ``x * 1.0`` read as ``x``): only the second saves."""
    if result.rewritten or model is None or math.isnan(result.cost_before) or math.isnan(result.cost_after):
        return result.cost_after
    if same_program(result.after, result.before):  # the input itself, or its text again: priced already
        return result.cost_before
    try:
        return program_cost(result.after, model)
    except Exception:  # (a model that cannot price a program as loaded: the extraction's figure, as before)
        return result.cost_after


def gradient_report(gradient: Any, entries: Sequence[tuple[Rule, Ruleset]], model: Any) -> Report:
    """The report of a rewritten VJP (``explain(..., grad=True)``): ``gradient`` kept its joint e-graph."""
    result = gradient.joint
    t = gradient.times
    # trace: the function and its VJP; residuals: choosing the forward/backward split
    times = {"trace": t.get("trace", 0.0) + t.get("trace_vjp", 0.0),
             **{k: t.get(k, 0.0) for k in ("load", "saturate", "extract", "emit", "residuals")}}
    return Report(
        before=result.before, after=_composed(gradient), cost_before=result.cost_before,
        # the split's own training step where it is not the joint extraction's (grad/uses.py)
        cost_after=result.cost_after if math.isnan(getattr(gradient, "composed_cost", math.nan))
        else gradient.composed_cost, fired={k: s.fired for k, s in result.stats.items() if s.fired},
        used=provenance(result), stopped=result.stopped, times=times, iterations=result.iterations,
        egraph_rows=result.rows, rejected={k: dict(s.rejected) for k, s in result.stats.items()},
        warnings=result.warnings, rulesets=entries, result=result, gradient=gradient, model=model,
        # the fixed cost of a call of the program that runs: primals and cotangents in, outputs and
        # gradients out (the forward report's is of the forward program's inputs and outputs)
        fixed_cost=_fixed_cost(model, result.before),
    )


def _composed(gradient: Any) -> core.ClosedJaxpr:
    """The forward and backward programs as one: ``(primals, cotangents) -> (outputs, gradients)``."""
    fwd, bwd, before = gradient.fwd, gradient.bwd, gradient.joint.before
    n_in = len(fwd.in_avals)
    n_out = len(fwd.out_avals) - len(gradient.split.residuals)

    def both(*args: Any) -> list[Any]:
        outs = core.eval_jaxpr(fwd.jaxpr, fwd.consts, *args[:n_in])
        grads = core.eval_jaxpr(bwd.jaxpr, bwd.consts, *outs[n_out:], *args[n_in:])
        return list(outs[:n_out]) + list(grads)

    return jax.make_jaxpr(both)(*[spec_of(a) for a in before.in_avals])


#: why a match is not applied that says nothing is wrong: the rule looked and chose not to
ORDINARY_DECLINES = frozenset({"guard", "declined", "same root", "own replacement"})


def _fixed_cost(model: Any, closed: core.ClosedJaxpr) -> float:
    """The model's fixed cost of one call of ``closed`` (its inputs and outputs), if the model has one."""
    fixed = getattr(model, "fixed", None)
    if not callable(fixed):
        return 0.0
    buffers = len(closed.in_avals) + len(closed.out_avals)
    try:
        return float(fixed(buffers, closed))  # its dispatch too (rewrite/cost/dispatch.py)
    except TypeError:  # a model whose ``fixed`` takes the buffers alone
        try:
            return float(fixed(buffers))
        except Exception:
            return 0.0
    except Exception:
        return 0.0
