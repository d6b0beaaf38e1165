"""``check_ruleset``: each rule on its own, forced to act, compared on drawn inputs.

A rule's left side (or a :class:`Pat` rule's example program) is traced at
the shapes and dtypes the rule was defined at, with inputs routed through
operations that establish the facts its guard asks for; the program is
rewritten with that rule alone; extraction is forced to take what the rule
built, so that a rewrite the cost model would refuse is still checked; and
the two programs are run eagerly on inputs hypothesis draws in the owner's
soundness class. A rule that never fires fails: a check that compares a
program with itself proves nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

from ..api import builtin_packs
from ..cost.model import AnalyticCost
from ..extract.extractor import Extractor, _CONTAINERS
from ..ir.intern import TupleType
from ..ir.jaxapi import core
from ..ir.walk import computes_half_precision, loses_forward_mode
from ..jaxpr.emit import emit
from ..jaxpr.trace import trace
from ..pipeline import run_pipeline
from ..records import Limits, Result
from ..rules.match import Value, _short
from ..rules.rule import Procedure, Rule
from ..rules.ruleset import Ruleset, Tolerance, entries_of
from ._compare import MOST, _Evidence, _show, _spreads, derivative_mismatch
from ._magnitude import jvp_magnitudes, vjp_magnitudes
from ._reference import _Reference
from ._run import _both, _cotangents, _differentiable, _evaluate, _tangents, as_written
from ._strategies import _into_domain, _is_float, _settings
from ._strategies import arrays as _fresh_arrays

try:  # hypothesis's private handle on the example being built (hypothesis.control since 2016); where a version
    # lacks it, every draw builds its strategy afresh, as before the reuse (the same examples, more slowly)
    from hypothesis.control import _current_build_context
except ImportError:  # pragma: no cover - depends on the installed hypothesis
    _current_build_context = None

#: The least relative tolerance on derivatives outside the exact class (for float32; scaled by epsilon).
_DERIVATIVE_RTOL = 1e-3


def arrays(shape: tuple[int, ...], dtype: Any, soundness: str = "exact", domain: str = "any") -> Any:
    """:func:`rewrite.testing.arrays`, built once and reused by every example, as the example's n-th draw of
    its signature.

    A strategy is a pure function of its four arguments, so the same object draws the same values from the
    same choices; a fresh one per example cost its construction and hypothesis's validation at its first
    draw. One object per draw of an example, not per signature: hypothesis's generator copies values between
    draws whose strategies have the same label, and an ``exact`` strategy's label hashes its NaN special,
    which hashes by identity, so two fresh strategies never share one; a shared object would, and would
    draw other examples (``x - -y``'s ``x`` copied into ``y``). The name stays ``arrays`` so that
    ``_check_rule``'s ``run`` reads as before: a derandomized profile seeds each test from its source.
    """
    key = (tuple(shape), np.dtype(dtype), soundness, domain)
    context = None if _current_build_context is None else getattr(_current_build_context, "value", None)
    if context is None or not hasattr(context, "data"):
        return _fresh_arrays(*key)
    if _DRAWS[0] is not context.data:
        _DRAWS[:] = [context.data, {}]
    nth = _DRAWS[1][key] = _DRAWS[1].get(key, -1) + 1
    return _built(*key, nth)


@functools.lru_cache(maxsize=1024)
def _built(shape: tuple[int, ...], dtype: Any, soundness: str, domain: str, nth: int) -> Any:
    """The strategy for an example's ``nth`` draw with this signature (bounded: least recently used go)."""
    return _fresh_arrays(shape, dtype, soundness, domain)


#: The example whose draws ``arrays`` counts (its ``ConjectureData``), and the draws so far by signature.
_DRAWS: list[Any] = [None, {}]


def _trace_at(fn: Callable[..., Any], avals: Sequence[Any]):
    in_tree = jax.tree_util.tree_structure((tuple(range(len(avals))), {}))
    return trace(fn, list(avals), in_tree, (), (), len(avals))


@dataclasses.dataclass
class RuleCheck:
    """How one rule was checked: the cases it was rewritten in, examples compared, cases skipped and why.

    A case is one program the rule was exercised on: its inputs' shapes and
    dtypes, and the domain drawn for each (``nonneg``, ``positive``,
    ``negative`` when a guard asks for facts), or ``as constants``.

    >>> from rewrite import rule, Ruleset
    >>> r = rule(lambda x: abs(x), lambda x: x, name="abs_nonneg", when=lambda x: x.nonneg)
    >>> check_ruleset(Ruleset("r", [r]), max_examples=2).rules["abs_nonneg"].cases[0]
    '(x: f32[] nonneg)'
    """

    rule: str
    ruleset: str
    soundness: str
    cases: list[str] = dataclasses.field(default_factory=list)
    examples: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{self.rule} [{self.ruleset}, {self.soundness}]: {self.examples} examples over "
                 f"{len(self.cases)} case(s): {'; '.join(self.cases)}"]
        lines += [f"    not exercised: {s}" for s in self.skipped]
        return "\n".join(lines)


@dataclasses.dataclass
class CheckReport:
    """What :func:`check_ruleset` checked, rule by rule (each a :class:`RuleCheck`). ``str(report)`` lists it.

    >>> from rewrite import rule, Ruleset
    >>> report = check_ruleset(Ruleset("r", [rule(lambda x: -(-x), lambda x: x, name="neg_neg")]), max_examples=3)
    >>> print(report)
    check_ruleset('r'): 1 rule(s), 3 examples
      neg_neg [r, exact]: 3 examples over 4 case(s): (x: f32[]); (x: f32[3]); (x: f32[3,3]); (x: f32[3,3,3])
    """

    ruleset: str
    rules: dict[str, RuleCheck] = dataclasses.field(default_factory=dict)

    @property
    def examples(self) -> int:
        return sum(r.examples for r in self.rules.values())

    def __str__(self) -> str:
        head = f"check_ruleset({self.ruleset!r}): {len(self.rules)} rule(s), {self.examples} examples"
        return "\n".join([head] + [f"  {r}" for r in self.rules.values()])


class _NotExercised(Exception):
    """The rule did not act on a case's program; the reason says why."""


@dataclasses.dataclass
class _Case:
    """One program a rule is checked on: inputs' avals and domains, the original and the forced rewrite."""

    fn: Callable[..., Any]
    avals: tuple[Any, ...]
    names: tuple[str, ...]
    domains: tuple[str, ...]
    before: Any = None
    after: Any = None
    constant: bool = False
    reference: Any = None
    rhs: Callable[..., Any] | None = None  # the right side as a program, for rules whose rhs contains the lhs
    group: Sequence[Any] = ()  # the rule's cases whose derivatives compile together (``_run._both``)
    _as_params: Any = None

    def __repr__(self) -> str:  # hypothesis shows the drawn case
        return self.describe()

    @functools.cached_property
    def own_backward(self) -> bool:
        """Whether the rewrite brought a backward of its own (``jax.custom_vjp``), or anything else JAX cannot
        differentiate in forward mode, that the original lacks (forward mode then differentiates the original)."""
        return loses_forward_mode(self.before.jaxpr, self.after.jaxpr)

    @functools.cached_property
    def half_precision(self) -> bool:
        """Whether either program computes a 16-bit float (its reverse mode then runs eagerly: ``_cotangents``)."""
        return computes_half_precision(self.before.jaxpr) or computes_half_precision(self.after.jaxpr)

    def original(self, args: Sequence[Any]) -> list[Any]:
        """The original program's results as a function of the drawn values (constants or not)."""
        if self.constant:
            if self._as_params is None:
                self._as_params = _trace_at(self.fn, self.avals).closed
            return _evaluate(self._as_params, args)
        return _evaluate(self.before, args)

    def describe(self) -> str:
        parts = []
        for n, a, d in zip(self.names, self.avals, self.domains):
            parts.append(f"{n}: {_short(a)}" + ("" if d == "any" else f" {d}"))
        return "(" + ", ".join(parts) + ")" + (" as constants" if self.constant else "")


_FACTS_OF = {"any": frozenset(), "nonneg": frozenset({"NonNeg"}), "nonzero": frozenset({"NonZero"}),
             "positive": frozenset({"Pos", "NonNeg", "NonZero"})}
_WEAKER = {"any": set(), "nonneg": {"any"}, "nonzero": {"any"}, "positive": {"any", "nonneg", "nonzero"}}


class _GuardView(Value):
    """What a guard sees while we ask it which facts it needs: the facts we choose, and no nodes."""

    def __init__(self, aval: Any, facts: frozenset) -> None:
        super().__init__(aval)
        self._given = facts
        self.wants_nodes = False

    def _fact(self, fact: str) -> bool:
        self.read_facts = True
        return self.is_floating and fact in self._given

    @property
    def nodes(self) -> list:  # literal, constant and node() read this too
        self.wants_nodes = True
        return []


def _guard_domains(rule: Rule, avals: tuple[Any, ...]) -> tuple[list[tuple[str, ...]], bool]:
    """The weakest fact domains per variable under which the guard accepts these avals, and whether it reads nodes.

    ``nonzero`` is split into ``positive`` and ``negative``: no derivation
    rule gives NonZero to a tensor of mixed signs.
    """
    if rule.when is None:
        return [("any",) * len(avals)], False
    choices = [tuple(_FACTS_OF) if _is_float(a.dtype) else ("any",) for a in avals]
    passing = []
    wants_nodes = False
    for combo in itertools.product(*choices):
        views = [_GuardView(a, _FACTS_OF[d]) for a, d in zip(avals, combo)]
        try:
            ok = bool(rule.when(*views))
        except Exception:
            ok = False
        wants_nodes |= any(v.wants_nodes for v in views)
        if ok:
            passing.append(combo)

    def weaker(a: tuple, b: tuple) -> bool:  # a strictly weaker than b
        return a != b and all(x == y or x in _WEAKER[y] for x, y in zip(a, b))

    minimal = [c for c in passing if not any(weaker(o, c) for o in passing)]
    out: list[tuple[str, ...]] = []
    for combo in minimal:
        options = [("positive", "negative") if d == "nonzero" else (d,) for d in combo]
        for expanded in itertools.product(*options):
            if expanded not in out:
                out.append(expanded)
    return out, wants_nodes


def _into_rule_domain(rule: Rule, name: str, x: Any) -> Any:
    """A drawn input for pattern variable ``name``, mapped by the rule's ``check_inputs`` if it has one."""
    f = rule.check_inputs.get(name)
    if f is None:
        return x
    y = np.asarray(f(np.asarray(x)))
    if y.shape != np.shape(x) or y.dtype != np.asarray(x).dtype:
        raise AssertionError(f"rule {rule.name!r}: check_inputs[{name!r}] gave {y.dtype}{list(y.shape)} for an "
                             f"input of {np.asarray(x).dtype}{list(np.shape(x))}; it must keep the shape and dtype")
    return y


def _as_indices(data: Any, name: str, case: "_Case", x: Any) -> Any:
    """An integer input, drawn over its whole range, as often moved into the range of the case's axes.

    Drawn over the whole range, nearly every element of an index array is out of bounds: a gather fills
    (NaN) or clamps, so a rule over gathers (the LM head's label logit) compared NaN with NaN and passed
    1% off. ``((x + k) mod 2k) - k`` with ``k`` the case's longest axis keeps ``0, 1, 2, 3, 7, -1`` as drawn.
    """
    dtype = np.asarray(x).dtype
    if not np.issubdtype(dtype, np.integer) or not data.draw(st.booleans(), label=f"{name} as indices"):
        return x
    k = max([int(d) for a in case.avals for d in a.shape] + [1])
    low = -k if np.issubdtype(dtype, np.signedinteger) else 0
    return ((np.asarray(x).astype(np.int64) - low) % (k - low) + low).astype(dtype)


def _wrap(domain: str, x: Any) -> Any:
    """Establish the fact a domain stands for, by operations the fact rules know; the identity on its values."""
    return _into_domain(x, domain, lax.abs, jnp.maximum, lax.neg)


def _recording(rule: Rule) -> tuple[Rule, list[int]]:
    """A copy of a procedural rule that notes the class names it replaces, for the forced extraction."""
    roots: list[int] = []
    proc = rule.rhs

    def record(m: Any) -> Any:
        out = proc(m)
        if isinstance(out, list):
            # A rule that replaces a loop hands its outputs over (the pairs), and the loop itself
            # (the matched class, a tuple) is what must not be taken any more.
            roots.extend([m.root.name] * bool(out) + [a.name for a, _ in out])
        elif out is not None:
            roots.append(m.root.name)
        return out

    twin = copy.copy(rule)
    twin.rhs = Procedure(record)
    return twin, roots


def _forced(result: Result, closed: core.ClosedJaxpr, vids: Sequence[int], ctor: set[str] | None = None
            ) -> core.ClosedJaxpr | None:
    """The program with the rule's work taken wherever it acted, even where it costs more.

    Normal extraction keeps the input program on ties and when a rewrite costs more, so a rule such as
    ``x*y -> y*x`` would be compared with itself. Here the matched node is barred from each matched class, so the
    class must be computed another way, which only the rule can have added: in its one step (``_rewrite_case``
    saturates one iteration). Repeated, a wrong rule's own applications fill the class with forms its error
    cancels from (``(a*b)*c -> a*(b*c)*1.01`` also built ``c*(a*b)``, which was then compared). The matched node
    is the node each name in ``vids`` was made for; for a :class:`Pat` rule, whose recorded names are whatever
    names the matched classes had, it is every node of the input program in those classes with the pattern's
    constructor ``ctor``. ``None`` when no matched class has another way.
    """
    eg, snap = result.egraph, result.snapshot
    barred: dict[Any, set] = {}
    for vid in vids:
        cls = snap.cls_of_name[vid]
        nodes = snap.nodes.get(cls, ())
        if ctor is not None:
            bar = {n for n in nodes if n[0] in ctor and n in (result.original or ())}
        else:
            node = eg.canonical(snap, vid)
            bar = {node} if node is not None else set()
        # A multi-result node (a loop) is barred even though its class has no other node: its
        # projections must then come from what the rule built, or the roots cannot be computed.
        if bar and (len(nodes) > len(bar) or isinstance(snap.aval(cls), TupleType)):
            barred.setdefault(cls, set()).update(bar)
    if not barred:
        return None
    ex = Extractor(snap, AnalyticCost())
    _, choice = ex.tree(lambda cls, ctor, args: ctor in _CONTAINERS or (ctor, args) not in barred.get(cls, ()))
    if any(r not in choice for r in result.roots or []):
        return None
    return emit(snap, choice, eg, closed.in_avals, result.roots, None, closed.jaxpr.debug_info)


def _pat_ctor(pat: Any) -> set[str]:
    """The constructors of the nodes a :class:`Pat` matches at its root (one, or a group's)."""
    return pat.ctors()


def _rewrite_case(rule: Rule, owner: Ruleset, fn: Callable[..., Any], avals: tuple[Any, ...],
                  rhs_program: Callable[..., Any] | None = None) -> tuple[Any, Any]:
    """Rewrite ``fn`` at ``avals`` with ``rule`` alone; return (original, forced rewrite) or raise _NotExercised.

    A right-hand side that contains the left-hand side (``abs(x) -> abs(abs(x))``) puts a node in
    the matched class that needs the class itself, which no extraction can take. When the rule
    fired but cannot be forced for that reason, ``rhs_program`` (the right side as a function of
    the same inputs) is traced and compared instead.
    """
    traced = _trace_at(fn, avals)
    if traced.closed.jaxpr.effects:
        raise _NotExercised("the program has effects")
    checked, roots = _recording(rule) if rule.is_pat else (rule, [])
    one = dataclasses.replace(owner.limits or Limits(), iterations=1)  # the rule's one step (_forced)
    result = run_pipeline(traced, [(checked, owner)], AnalyticCost(), one, keep=True)
    problems = [w for w in result.warnings if f"rule {rule.name!r}" in w]
    if problems:
        raise AssertionError(f"rule {rule.name!r} [{owner.name}, {owner.soundness}] failed while rewriting "
                             f"at ({', '.join(_short(a) for a in avals)}): " + "; ".join(problems))
    stats = result.stats[rule.name]
    if not stats.fired:
        why = ", ".join(f"{n} {k}" for k, n in sorted(stats.rejected.items())) or "no match"
        raise _NotExercised(f"did not fire ({why})")
    vids = roots if rule.is_pat else list(result.out_names or [])
    if result.preferred.get(rule.name):
        after = result.after  # a preferred rule's matched form was barred already (rewrite/rules/prefer.py)
    else:
        after = _forced(result, traced.closed, vids, _pat_ctor(rule.lhs) if rule.is_pat else None)
    if after is None and rhs_program is not None:
        after = _trace_at(rhs_program, avals).closed
    if after is None:
        raise _NotExercised("fired, but what it built can only be computed through the matched value itself")
    try:
        core.check_jaxpr(after.jaxpr)
    except Exception as e:
        raise AssertionError(f"rule {rule.name!r} [{owner.name}]: the rewritten program is ill-formed: {e}") from None
    return traced.closed, after


def _cases(rule: Rule, owner: Ruleset) -> tuple[list[_Case], list[str], bool]:
    """Every program the rule can be checked on with drawn inputs, the cases it could not act on, and
    whether a guard reads the matched nodes (so inputs must be constants)."""
    cases: list[_Case] = []
    skipped: list[str] = []
    wants_nodes = False
    if rule.is_pat:
        if rule.program is None:
            return [], ["a Pat rule needs an example program: rule(..., example_program=(fn, args))"], False
        fn, avals = rule.program
        candidates = [_Case(fn, avals, tuple(f"arg{i}" for i in range(len(avals))), ("any",) * len(avals))]
    else:
        candidates = []
        for avals in rule.probes:
            domains, nodes = _guard_domains(rule, avals)
            wants_nodes |= nodes
            if not domains:
                skipped.append(f"({', '.join(_short(a) for a in avals)}): the guard rejects every domain")
            for combo in domains:
                def program(*xs: Any, _combo: tuple = combo, _side: Callable = rule.lhs) -> Any:
                    return _side(*[_wrap(d, x) for d, x in zip(_combo, xs)])

                case = _Case(program, avals, tuple(rule.var_names), combo)
                if not rule.is_procedural:
                    case.rhs = functools.partial(program, _side=rule.rhs)
                candidates.append(case)
    for case in candidates:
        try:
            case.before, case.after = _rewrite_case(rule, owner, case.fn, case.avals, case.rhs)
        except _NotExercised as e:
            skipped.append(f"{case.describe()}: {e}")
            continue
        case.reference = _Reference(case.fn, case.avals)
        cases.append(case)
    return cases, skipped, wants_nodes


def _constant_cases(rule: Rule) -> list[_Case]:
    """Cases whose inputs are baked in as constants, drawn anew each example, for guards that read values."""
    if rule.is_pat:
        fn, avals = rule.program  # type: ignore[misc]
        names = tuple(f"arg{i}" for i in range(len(avals)))
        return [_Case(fn, avals, names, ("any",) * len(avals), constant=True, reference=_Reference(fn, avals))]
    return [_Case(rule.lhs, avals, tuple(rule.var_names), ("any",) * len(avals), constant=True,
                  reference=_Reference(rule.lhs, avals)) for avals in rule.probes]


def _failure(rule: Rule, owner: Ruleset, case: _Case, vals: Sequence[Any], want: Sequence[Any],
             got: Sequence[Any], why: str, tangents: Sequence[Any] | None = None,
             cotangents: Sequence[Any] | None = None) -> AssertionError:
    lines = [f"rule {rule.name!r} [{owner.name}, {owner.soundness}] does not hold: {why}",
             f"  case {case.describe()}" + (" (inputs of the rule's example program)" if rule.is_pat else "")]
    for n, v in zip(case.names, vals):
        lines.append(f"    {n} = {_show(v, 7 + len(n))}")
    for n, t in zip(case.names, tangents or ()):
        if t is not None:
            lines.append(f"    tangent of {n} = {_show(t, 18 + len(n))}")
    for i, t in enumerate(cotangents or ()):
        if t is not None:
            lines.append(f"    cotangent of output {i} = {_show(t, 26)}")
    what = " tangent" if tangents is not None else " cotangent" if cotangents is not None else ""
    for i, (w, g) in enumerate(zip(want, got)):
        tag = f"{what}[{i}]" if len(want) > 1 else what
        lines.append(f"  original{tag}  = {_show(w, 14 + len(tag))}")
        lines.append(f"  rewritten{tag} = {_show(g, 14 + len(tag))}")
    if case.after is not None:
        lines.append("  rewritten program: " + str(case.after).replace("\n", "\n    "))
    return AssertionError("\n".join(lines))


def _check_derivatives(rule: Rule, owner: Ruleset, case: _Case, vals: Sequence[Any], tangents: Sequence[Any],
                       cotangents: Sequence[Any], want: Sequence[Any]) -> None:
    """JAX's derivatives of the original and of the rewrite must agree: forward mode (the output tangents along
    ``tangents``), or, where the replacement brings its own backward (``jax.custom_vjp``), reverse mode (the input
    cotangents for the output ``cotangents``): forward mode of a rewritten program differentiates the program
    as written (``rewrite.grad.primitive.Program.jvp_source``), so a hand-written backward shows only there."""
    reverse = case.own_backward
    # Where an output overflowed, its cotangent's path is an accident of the order of operations (``0 * (2x)``
    # is NaN, ``0 * x + x * 0`` is 0); reverse mode mixes outputs: compare the cotangents finite on both sides.
    overflowed = reverse and not all(np.isfinite(np.asarray(w, np.float64)).all() for w in want
                                     if _is_float(np.asarray(w).dtype))
    how = "op" if case.half_precision else "jit"
    if reverse:
        def derive(closed: core.ClosedJaxpr, args: Sequence[Any], how: str = how) -> list[Any]:
            return _cotangents(closed, args, cotangents, how)

        def reference() -> list[Any] | None:
            return case.reference.cotangents(vals, cotangents)
        # An input's cotangent is not compared where the input itself is not finite.
        values = [v for v, a in zip(vals, case.avals) if _differentiable(a.dtype)]
        shown = {"cotangents": cotangents}
    else:
        def derive(closed: core.ClosedJaxpr, args: Sequence[Any], how: str = how) -> list[Any]:
            return _tangents(closed, args, tangents, how)

        def reference() -> list[Any] | None:
            return case.reference.tangents(vals, tangents)
        values = list(want)
        shown = {"tangents": tangents}
    # Under jit both sides come from one executable for the rule's cases (``_both``: compiled once, in about half
    # the time of one per side and case); where that raises, each side alone says which cannot be differentiated.
    directions, pair = (cotangents if reverse else tangents), None
    if how == "jit":
        try:
            pair = _both(case.before, case.after, "vjp" if reverse else "jvp", vals, directions, case.group)
        except Exception:
            pass

    def original(args: Sequence[Any]) -> list[Any]:  # from the executable that gave want_t
        return _both(case.before, case.after, "vjp" if reverse else "jvp", args, directions, case.group)[0] if pair \
            else derive(case.before, args)
    try:
        want_t = pair[0] if pair else derive(case.before, vals)
    except Exception:
        return  # the original has no derivative here (an opaque primitive): nothing to keep
    # Derivatives are new programs on both sides, so exact rules too meet them within a tolerance, at
    # least Tolerance(). Other rules may change how a derivative rounds where it cancels (tanh's 1 - tanh^2
    # against the quotient rule of sinh/cosh, near x = 4): at least 1e-3, far below a kink's jump. The
    # evidence (the float64 derivative, the original's spread) is computed only on a mismatch.
    base = owner.tolerance or Tolerance()
    floor = Tolerance.rtol if owner.soundness == "exact" else _DERIVATIVE_RTOL
    tolerance = Tolerance(max(base.rtol, floor), max(base.atol, Tolerance.atol), base.terms)
    try:
        got_t = pair[1] if pair else derive(case.after, vals)
    except Exception as e:
        raise _failure(rule, owner, case, vals, want, want, f"the rewritten program cannot be differentiated "
                       f"({type(e).__name__}: {e})") from None
    if overflowed:
        with np.errstate(invalid="ignore"):
            got_t = [np.where(np.isfinite(np.asarray(g, np.float64)), g, w).astype(np.asarray(g).dtype)
                     if np.shape(g) == np.shape(w) and _is_float(np.asarray(g).dtype) else g
                     for g, w in zip(got_t, want_t)]
    # What settles a mismatch, per output, computed once and only as far as needed: each acquits elements
    # the others may not, and the verdict with all of them is the one that counts. Cheapest and most often
    # enough first (on the attention pack: the float64 derivative settled 81 of 184 mismatches, the terms'
    # magnitude the other 102; running the original as written, step by step, is dearest and is last).
    def magnitudes() -> list[Any] | None:
        if tolerance.terms <= 0:
            return None
        return (vjp_magnitudes(case.reference.fn, vals, cotangents) if reverse
                else jvp_magnitudes(case.reference.fn, vals, tangents))

    evidence = {"reference": reference, "spread": lambda: _spreads(original, vals, want_t),
                "magnitude": magnitudes, "written": lambda: derive(case.before, vals, "written")}
    found: dict[str, list[Any]] = {}
    for i, (v, w, g) in enumerate(zip(values, want_t, got_t)):
        why = derivative_mismatch(v, w, g, tolerance=tolerance)
        shown_evidence: dict[str, Any] = {}
        for name, compute in evidence.items():
            if why is None:
                break
            if name not in found:
                found[name] = compute() or [None] * len(want_t)
            shown_evidence[name] = found[name][i]
            why = derivative_mismatch(v, w, g, tolerance=tolerance, **shown_evidence)
        if why is not None:
            kind = "reverse-mode derivative (vjp)" if reverse else "derivative"
            raise _failure(rule, owner, case, vals, want_t, got_t, f"JAX's {kind} changed: {why}", **shown)


def _derivatives_with_constants(rule: Rule, owner: Ruleset, case: _Case, vals: Sequence[Any], data: Any) -> None:
    """For a rule checked with its inputs as constants, JAX's derivatives along each float input with which, a
    parameter and the others constants, the rule still fires (``x / c`` for a constant ``c``, say): the program
    with every input a constant has no derivative to compare, and a wrong one passed (the mutation audit)."""
    for j, a in enumerate(case.avals):
        if not _differentiable(a.dtype):
            continue

        def fn(x: Any, _j: int = j) -> Any:  # input j a parameter, the others the drawn constants
            return case.fn(*[x if i == _j else jnp.asarray(v) for i, v in enumerate(vals)])
        try:
            before, after = _rewrite_case(rule, owner, fn, (a,))
        except _NotExercised:
            continue
        part = _Case(fn, (a,), (f"{case.names[j]} (the others constants)",), ("any",), before, after,
                     reference=_Reference(fn, (a,)))
        reverse = part.own_backward
        tangents = [] if reverse else [data.draw(arrays(a.shape, a.dtype, "fastmath"), label=f"tangent of {j}")]
        cotangents = [data.draw(arrays(o.shape, o.dtype, "fastmath"), label=f"cotangent of output {i}")
                      if _differentiable(o.dtype) else None for i, o in enumerate(before.out_avals)] if reverse else []
        _check_derivatives(rule, owner, part, [vals[j]], tangents, cotangents, _evaluate(before, [vals[j]]))


def _check_rule(rule: Rule, owner: Ruleset, max_examples: int | None, derivatives: bool = True) -> RuleCheck:
    report = RuleCheck(rule.name, owner.name, owner.soundness)
    cases, skipped, wants_nodes = _cases(rule, owner)
    report.skipped = skipped
    constant = False
    if not cases and (wants_nodes or rule.is_procedural) and (not rule.is_pat or rule.program is not None):
        # The rule may need to see values (a guard reading .constant, a procedure that declines
        # unknown inputs): try again with inputs baked in as constants, rewritten per example.
        cases = _constant_cases(rule)
        constant = True
    if not cases:
        raise AssertionError(
            f"rule {rule.name!r} [{owner.name}, {owner.soundness}] was never exercised, so it cannot be checked:\n"
            + "\n".join(f"  {s}" for s in skipped)
            + "\n  Give example_inputs= with shapes and dtypes where it applies (for a Pat rule, "
            "example_program=(fn, args)).")
    soundness, tolerance = owner.soundness, owner.tolerance
    fired = [0]
    together = [(c.before, c.after, "vjp" if c.own_backward else "jvp") for c in cases if derivatives and not
                c.constant and not c.half_precision and any(_differentiable(a.dtype) for a in c.avals)]
    for c in cases:  # not an argument in ``run``: hypothesis seeds a derandomized run from its source
        c.group = together

    def run(data: Any) -> None:
        case = data.draw(st.sampled_from(cases), label="case") if len(cases) > 1 else cases[0]
        vals = [_into_rule_domain(rule, n, _as_indices(data, n, case, data.draw(arrays(a.shape, a.dtype, soundness, d),
                                                                                 label=n)))
                for n, a, d in zip(case.names, case.avals, case.domains)]
        differentiate = derivatives and not case.constant and any(_differentiable(a.dtype) for a in case.avals)
        # Kinks are among the values drawn (0, -0.0, 1, -1); the tangents are ordinary numbers. Drawn
        # before anything runs, so an example hypothesis abandons (too much data) runs nothing.
        reverse = differentiate and case.own_backward
        tangents = [data.draw(arrays(a.shape, a.dtype, "fastmath"), label=f"tangent of {n}")
                    if _differentiable(a.dtype) else None
                    for n, a in zip(case.names, case.avals)] if differentiate and not reverse else []
        cotangents = [data.draw(arrays(o.shape, o.dtype, "fastmath"), label=f"cotangent of output {i}")
                      if _differentiable(o.dtype) else None
                      for i, o in enumerate(case.before.out_avals)] if reverse else []
        if case.constant:
            bound = [jnp.asarray(v) for v in vals]  # jax arrays, so the program's operations are traced
            try:
                before, after = _rewrite_case(rule, owner, functools.partial(case.fn, *bound), ())
            except _NotExercised:
                return
            shown, args = dataclasses.replace(case, before=before, after=after), []
            if derivatives:
                _derivatives_with_constants(rule, owner, case, vals, data)
        else:
            shown, before, after, args = case, case.before, case.after, vals
        fired[0] += 1
        want = _evaluate(before, args)
        got = _evaluate(after, args)
        evidence = _Evidence(lambda: case.reference(vals), lambda: _spreads(case.original, vals, want),
                             written=lambda: as_written(before, args), most=MOST)
        for i, (w, g) in enumerate(zip(want, got)):
            why = evidence.mismatch(i, w, g, soundness, tolerance)
            if why is not None:
                raise _failure(rule, owner, shown, vals, want, got, why)
        if differentiate:
            _check_derivatives(rule, owner, case, vals, tangents, cotangents, want)

    _settings(max_examples)(given(st.data())(run))()
    if constant and not fired[0]:
        raise AssertionError(
            f"rule {rule.name!r} [{owner.name}, {owner.soundness}] was never exercised: it did not fire on "
            "parameters nor on any drawn constant inputs:\n" + "\n".join(f"  {s}" for s in skipped))
    report.cases = [c.describe() for c in cases]
    report.examples = fired[0]
    return report


def check_ruleset(ruleset: Any, *, max_examples: int | None = None, derivatives: bool = True) -> CheckReport:
    """Check every rule of ``ruleset`` on drawn inputs; raise ``AssertionError`` naming each rule that fails.

    Each rule is checked on its own, in its owner's soundness class. Its
    left-hand side, traced at the shapes and dtypes it was defined at (its
    probes, or ``example_inputs=``) and that its guard allows, is a program; that
    program is rewritten with this rule alone, and the rewrite is forced to
    use what the rule built even where the cost model would not. A rule that
    never fires fails the check: a check that compares a program with itself
    proves nothing. Guards that ask for facts (``x.positive``) are met by
    drawing inputs through operations that establish the fact; guards and
    procedures that read values (``x.constant``) get their inputs as
    constants. A :class:`Pat` rule is checked on its ``example_program=(fn, args)``
    program. The original and the rewritten program are then compared on
    inputs hypothesis draws, shrinking any failure to a small
    counterexample, which the error shows with both results. With
    ``derivatives`` (the default), each example also compares the two
    programs' forward-mode derivatives (``jax.jvp``, along drawn tangents):
    a rule must keep the derivatives JAX computes, at kinks (``abs`` and
    ``max`` at 0, a ``where`` at its switch) as elsewhere, within a tolerance
    even for exact rules (:func:`rewrite.testing.derivative_mismatch`). A
    replacement with a backward of its own (``jax.custom_vjp``: a blocked
    attention, a loop over token blocks) is compared in reverse mode instead
    (``jax.vjp``, for drawn output cotangents), since its hand-written backward
    is what it can get wrong.

    ``max_examples`` is per rule; the active hypothesis profile decides when
    it is ``None``. Returns a :class:`CheckReport` of what was checked.

    >>> import jax.numpy as jnp
    >>> from rewrite import rule, Ruleset
    >>> good = Ruleset("good", [rule(lambda x: -(-x), lambda x: x, name="neg_neg")])
    >>> print(check_ruleset(good, max_examples=5).rules["neg_neg"].examples)
    5
    >>> bad = Ruleset("bad", [rule(lambda x: x - x, lambda x: jnp.zeros_like(x), name="sub_self")])
    >>> check_ruleset(bad, max_examples=50)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    AssertionError: check_ruleset('bad'): 1 of 1 rule(s) failed...
    rule 'sub_self' [bad, exact] does not hold: at ...: original nan, rewritten 0.0 ...
    """
    entries = entries_of(ruleset, builtin_packs)
    name = getattr(ruleset, "name", None) or "+".join(o.name for o in {id(o): o for _, o in entries}.values())
    report = CheckReport(name)
    failures = []
    for rule, owner in entries:
        try:
            report.rules[rule.name] = _check_rule(rule, owner, max_examples, derivatives)
        except AssertionError as e:
            failures.append(str(e))
    if failures:
        raise AssertionError(f"check_ruleset({name!r}): {len(failures)} of {len(entries)} rule(s) failed\n"
                             + "\n\n".join(failures))
    return report
