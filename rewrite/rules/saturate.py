"""Stage 3, saturate: run the rulesets over the e-graph, under limits.

Each iteration:

1. egglog derives facts (``NonNeg``, ``Pos``, ``NonZero``) to saturation;
2. egglog runs every rule's query once, recording matches in a relation;
3. the Python side reads the new matches, checks guards, verifies each match
   by looking the left-hand side up at the real shapes, and builds the
   right-hand side (a JAX function traced at those shapes, or a procedure);
4. everything built is inserted in one batch.

It stops when an iteration changes nothing (saturated), or at a limit: the
iteration count, the e-graph's size in rows, or wall time. A rule that
matches too often is banned for a few iterations, with its allowance and ban
doubling each time (egg's back-off scheduler), so one explosive rule cannot
starve the rest. Stopping early is always safe: the e-graph still holds the
input program, so extraction finds a program at least as good.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import logging
import threading
import time
from typing import Any, Sequence


from ..ir.egraph import EGraph, Snapshot
from ..ir.intern import TYPES
from ..jaxpr.load import Unsupported, load_closed
from .builder import Builder, OutOfTime
from .match import Match, _short
from .pattern import commuted, present
from .prefer import Barred, lhs_ctors
from .rule import Rule
from .ruleset import Ruleset

log = logging.getLogger("rewrite")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on saturation. When one is hit, the best program found so far is used.

    ``iterations``: rounds of matching. ``nodes``: rows in the e-graph
    (nodes, names, facts and matches together). ``seconds``: wall time for
    saturation. ``matches``: new matches a rule may act on in one iteration
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
    #: the share of ``seconds`` one rule may spend in all: a rule past it stops at once (a procedure at its next
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


@dataclasses.dataclass
class _Active:
    rule: Rule
    ruleset: Ruleset
    relations: list[tuple[tuple[str, int], list[tuple[str, str]]]]  # (relation, query id), binds (var, sort)
    seen: set = dataclasses.field(default_factory=set)
    allowance: int = 0
    ban_length: int = 0
    banned_until: int = -1
    #: the rule runs in iterations below this one only (its ruleset's ``limits.iterations``)
    last: int | None = None
    #: declined matches to act on again this iteration: what they read has changed (``Engine._watch``)
    retry: list = dataclasses.field(default_factory=list)
    #: the rule's symmetries, when its queries match in several operand orders (``Rule.symmetries``)
    symmetries: tuple = ()
    #: the matches acted on, by their names with the bindings in a canonical order (``Engine._mirrored``)
    mirrors: set = dataclasses.field(default_factory=set)


def match_program(entries: Sequence[tuple[Rule, Ruleset]], manual: bool = False
                  ) -> tuple[str, list[list[tuple[tuple[str, int], list[tuple[str, str]]]]]]:
    """The egglog declarations of the rules' queries (ruleset ``match``), and per rule its relations and binds.

    Every query records its matches in the relation of its signature (the
    sorts of its root and binds), ``M<k>``, each row led by the query's id;
    a rule's relations are ``(relation, query id)`` pairs, read with
    ``Snapshot.matches``. One relation per signature, not per query: every
    declaration costs at each ``push`` and ``pop`` of a pooled e-graph.
    The text depends on the rules only, so an e-graph declared with it can be
    made once and lent to every rewrite with the same rules (``_egraph._POOL``),
    and it is made once per list of rules (the last few are kept).
    """
    key = (tuple((id(rule), id(owner)) for rule, owner in entries), manual)
    with _MATCH_LOCK:
        found = _MATCH_TEXTS.get(key)
    if found is not None and len(found[0]) == len(entries) and all(
            a[0] is b[0] and a[1] is b[1] for a, b in zip(found[0], entries)):
        return found[1]
    lines = ["(ruleset match)"]
    signatures: dict[tuple[str, ...], str] = {}
    relations = []
    query = 0
    for rule, _ in entries:
        rels = []
        for q in rule.queries + (rule.manual_queries if manual else []):
            sorts = ("Term",) + tuple(s for _, s in q.binds)
            rel = signatures.get(sorts)
            if rel is None:
                rel = signatures[sorts] = f"M{len(signatures)}"
                lines.append(f"(relation {rel} (i64 {' '.join(sorts)}))")
            args = " ".join([str(query), q.root] + [v for v, _ in q.binds])
            for k, variant in enumerate(commuted(q)):  # either order of add and mul
                lines.append(f'(rule ({variant.text}) (({rel} {args})) :ruleset match :name "M{query}_{k}")')
            rels.append(((rel, query), q.binds))
            query += 1
        relations.append(rels)
    made = ("\n".join(lines), relations)
    with _MATCH_LOCK:
        _MATCH_TEXTS[key] = (list(entries), made)  # the entries kept: their ids stay theirs
        while len(_MATCH_TEXTS) > 8:
            del _MATCH_TEXTS[next(iter(_MATCH_TEXTS))]
    return made


_MATCH_TEXTS: dict[tuple, tuple[list, tuple]] = {}
_MATCH_LOCK = threading.Lock()


class Engine:
    """The state of one saturation: the e-graph, the active rules and their stats; what the rules see and
    build goes through its :class:`Builder`."""

    def __init__(self, egraph: EGraph, entries: Sequence[tuple[Rule, Ruleset]], limits: Limits,
                 manual: bool = False) -> None:
        self.egraph = egraph
        self.limits = limits
        self.stats: dict[str, RuleStats] = collections.OrderedDict()
        self.active: list[_Active] = []
        self.builder = Builder(egraph)
        self.snapshot = None  # type: ignore[assignment]  # (also empties the per-snapshot caches)
        self.iterations = 0
        self.warnings: list[str] = []
        #: The unions made by preferred rules (rule(..., prefer=True)), barred before extraction.
        self.preferred: list[Barred] = []
        #: Per preferred rule, a name of each class it rewrote (``_own_replacement`` reads them).
        self._rewrote: dict[str, list[int]] = {}
        #: Declined matches of procedural rules, by a name of each class they read: (node count, facts
        #: absent then, entries). A match is acted on again when one of those classes gains a node or a
        #: fact (a factor folded into a literal, say), not only when a new match appears.
        self._watched: dict[int, list] = {}
        text, relations = match_program(entries, manual)
        for (rule, owner), rels in zip(entries, relations):
            # A ruleset may set its own back-off (say, a tighter allowance for
            # associativity); the run's limits govern everything else.
            backoff = owner.limits if owner.limits is not None else limits
            last = owner.limits.iterations if owner.limits is not None else None
            self.active.append(_Active(rule, owner, rels, allowance=backoff.matches, ban_length=backoff.ban,
                                       last=last, symmetries=rule.symmetries))
            self.stats[rule.name] = RuleStats()
        if egraph.prelude != text:  # an e-graph made without them (EGraph(match_program(...)[0]) has them)
            egraph.declare(text)

    # ------------------------------------------------------------------ the loop
    @property
    def snapshot(self) -> Snapshot:
        """The e-graph as the rules of this iteration see it."""
        return self.builder.snapshot

    @snapshot.setter
    def snapshot(self, snap: Snapshot | None) -> None:
        # What is derived from a snapshot is kept with it, and dropped with it.
        self.builder.snapshot = snap
        self._root_only: set[tuple[int, Any]] = set()  # (rule, root) pairs done reading the root alone
        self._unioned: set[tuple[Any, int]] = set()  # (class, name) unions made since: one is made once

    def run(self) -> str:
        """Saturate; returns why it stopped."""
        try:
            return self._run()
        finally:
            self.builder.release()  # the e-graph goes back to its pool (ir.egraph._POOL) with the engine

    def _run(self) -> str:
        start = time.perf_counter()
        limits = self.limits
        end = start + limits.seconds
        share = limits.seconds * limits.rule_share
        if not self.active:
            self.snapshot = self.egraph.snapshot()
            return "saturated"
        start_rows: int | None = None
        for it in range(limits.iterations):
            self.iterations = it + 1
            self.egraph.run("facts", saturate=True)
            self.egraph.run("match")
            self.snapshot = self.egraph.snapshot()
            if start_rows is None:
                start_rows = self.snapshot.num_rows
            grown = self.snapshot.num_rows > limits.growth * start_rows
            self._wake()
            if self.snapshot.num_rows > limits.nodes:
                return "node limit"
            if time.perf_counter() - start > limits.seconds:
                return "time limit"
            waiting = False
            matches = self.snapshot.matches
            for act in self.active:
                if act.last is not None and it >= act.last:
                    continue  # its ruleset's rounds are over
                if it < act.banned_until:
                    waiting = True
                    continue
                seen = act.seen
                new = [(rel, binds, r) for rel, binds in act.relations for r in matches(*rel) if (rel, r) not in seen]
                if not new and not act.retry:
                    continue
                retry, act.retry = act.retry, []
                if len(new) > act.allowance and grown:
                    act.last = it  # retired: see Limits.growth
                    self.stats[act.rule.name].retired = True
                    self.stats[act.rule.name].banned += 1
                    log.debug("rule %r retired at iteration %d (%d new matches in a grown e-graph)",
                              act.rule.name, it, len(new))
                    continue
                if len(new) > act.allowance:
                    act.banned_until = it + act.ban_length
                    act.allowance *= 2
                    act.ban_length *= 2
                    self.stats[act.rule.name].banned += 1
                    log.debug("rule %r banned until iteration %d (%d new matches)", act.rule.name, act.banned_until, len(new))
                    waiting = True
                    continue
                stats = self.stats[act.rule.name]
                t = time.perf_counter()
                for rel, binds, inputs in new + retry:
                    if rel is not None and act.symmetries and self._mirrored(act, inputs):
                        act.seen.add((rel, tuple(inputs)))  # its mirror image was acted on: the same program
                        continue
                    now = time.perf_counter()
                    self.builder.deadline = min(end, now + share - stats.seconds - (now - t))
                    try:
                        if self._apply(act, binds, inputs) and rel is not None:  # (a retried match is seen already)
                            act.seen.add((rel, tuple(inputs)))
                    except OutOfTime:
                        stats.rejected["out of time"] += 1
                    finally:
                        self.builder.deadline = float("inf")
                    now = time.perf_counter()
                    if stats.seconds + (now - t) > share:
                        # Past its share (a procedure cut off mid-way, or many matches): what it built stays.
                        act.last = it
                        stats.timed_out = True
                        log.debug("rule %r stopped at iteration %d: past its time share (%.3f s)",
                                  act.rule.name, it, share)
                        break
                    if now > end:
                        stats.seconds += now - t
                        self.egraph.flush()
                        return "time limit"
                stats.seconds += time.perf_counter() - t
                if time.perf_counter() > end:
                    self.egraph.flush()
                    return "time limit"
            changed = self.egraph.flush()
            if not changed and not waiting:
                self.snapshot = self.egraph.snapshot()
                return "saturated"  # rules retired in a grown e-graph say so in their stats (``RuleStats.retired``)
        return "iteration limit"

    # ------------------------------------------------------------------ one match
    def _apply(self, act: _Active, binds: list[tuple[str, str]], inputs: Sequence[Any]) -> bool:
        """Act on one match. Returns whether it is settled (never to be looked at again)."""
        rule, stats = act.rule, self.stats[act.rule.name]
        stats.matched += 1
        root, vals = inputs[0], inputs[1:]
        snap = self.snapshot
        eg = self.egraph
        if rule.prefer and self._own_replacement(rule, root, vals, binds):
            # A preferred rule never rewrites a term its own replacement built: that replacement is
            # forced into the result, so one that holds a match of the rule (jax.nn.softplus of a
            # complex x holds log1p(exp(.))) would nest itself once per iteration, without bound.
            stats.rejected["own replacement"] += 1
            return True
        eg.origin = rule.name
        eg.source = eg.vsource[snap.name(root)]
        try:
            if rule.is_pat:
                sorts = {n: s for n, (_, s) in zip(rule.var_names, binds)}
                to_int = eg.eg.value_to_i64
                bound = {n: (to_int(v) if sorts[n] == "i64" else v) for n, v in zip(rule.var_names, vals)}
                return self._apply_procedure(act, root, bound, sorts, binds, inputs)
            values = [self.builder.value(c) for c in vals]
            if rule.when is not None:
                try:
                    ok = rule.when(*values)
                except Unsupported:
                    raise
                except Exception as e:
                    self._raised(rule, stats, e, "its guard")
                    return True
                if not ok:
                    stats.rejected["guard"] += 1
                    return not any(v.read_facts for v in values)
            avals = tuple(v.aval for v in values)
            try:
                lhs, rhs = rule.traced(avals)
            except Exception as e:
                stats.rejected["untraceable"] += 1
                log.debug("rule %r cannot be traced at %s: %s", rule.name, avals, e)
                return True
            if present(eg, lhs, list(vals)) != root:
                stats.rejected["unverified"] += 1
                return True
            if rule.is_procedural:
                return self._apply_procedure(act, root, dict(zip(rule.var_names, vals)),
                                             {n: "Term" for n in rule.var_names}, binds, inputs)
            (out,), _ = load_closed(rhs, [snap.name(c) for c in vals], eg, remember=True)
            self._union(rule, snap.name(root), out, avals, lhs)
            return True
        except Unsupported as e:
            stats.rejected["unsupported"] += 1
            log.debug("rule %r: %s", rule.name, e)
            return True
        finally:
            eg.origin = None
            eg.source = None

    def _apply_procedure(self, act: _Active, root: Any, bindings: dict[str, Any], sorts: dict[str, str],
                         binds: list[tuple[str, str]] | None = None, inputs: Sequence[Any] | None = None) -> bool:
        """Run a procedural rule on one match; ``binds`` and ``inputs`` (the match's row) let a declined match
        be watched (``_watch``)."""
        rule, stats = act.rule, self.stats[act.rule.name]
        if (id(rule), root) in self._root_only:
            # Another match at this root already ran this rule in this snapshot, reading the root
            # alone: it would do the same again (the union is made, or the rule declined).
            stats.rejected["same root"] += 1
            return True
        m = Match(self.builder, rule, bindings, sorts, root)
        self.builder.reads = set()
        declined = sum(stats.rejected.values())
        try:
            return self._run_procedure(m, stats)
        finally:
            reads, self.builder.reads = self.builder.reads, None
            if not m.read_bindings:
                self._root_only.add((id(rule), root))
            if sum(stats.rejected.values()) > declined and reads and inputs is not None:
                self._watch(act, binds, inputs, reads)

    def _run_procedure(self, m: Match, stats: RuleStats) -> bool:
        rule = m.rule
        try:
            if rule.is_pat and rule.when is not None and not rule.when(m):
                stats.rejected["guard"] += 1
                return True
        except (Unsupported, OutOfTime):
            raise
        except Exception as e:
            self._raised(rule, stats, e, "its guard")
            return True
        try:
            result = rule.rhs(m)
        except (Unsupported, OutOfTime):
            raise
        except Exception as e:
            self._raised(rule, stats, e)
            return True
        if result is None:
            stats.rejected["declined"] += 1
            return True
        pairs = result if isinstance(result, list) else [(m.root, result)]
        for a, b in pairs:
            self._union(rule, a.name, b.name, None)
        return True

    def _own_replacement(self, rule: Rule, root: Any, vals: Sequence[Any], binds: list[tuple[str, str]]) -> bool:
        """Does this match lie inside a replacement that ``rule`` built?

        Either its root is a class the rule made (the replacement holds a match below its top), or it
        binds a term the rule made *at a class the rule already rewrote* (the replacement's top is itself
        a match, over a new operand). A bound term the rule made is not enough alone: another rule's
        replacement may share it (``1 - sigmoid(z) -> sigmoid(-z)`` reuses the ``-z`` that
        ``log(sigmoid(z)) -> -softplus(-z)`` built), and that second match is independent."""
        snap, made_by = self.snapshot, self.egraph.vorigin
        if made_by[snap.name(root)] == rule.name:
            return True
        sorts = [s for _, s in binds] if rule.is_pat else ["Term"] * len(vals)
        if not any(made_by[snap.name(v)] == rule.name for v, s in zip(vals, sorts) if s == "Term"):
            return False
        known = snap.cls_of_name
        return any(n < len(known) and known[n] == root for n in self._rewrote.get(rule.name, ()))

    def _raised(self, rule: Rule, stats: RuleStats, e: Exception, part: str = "") -> None:
        """A rule (or its guard) raised at a match: the match is skipped, and the run's warnings say so
        (``strict`` turns them into an error)."""
        stats.rejected["error"] += 1
        msg = f"rule {rule.name!r}{' (' + part + ')' if part else ''} raised {type(e).__name__}: {e}"
        if msg not in self.warnings:
            self.warnings.append(msg)
            log.warning(msg)

    def _union(self, rule: Rule, root_name: int, out: int, avals: Any, lhs: Any = None) -> None:
        """Put ``out`` in the class of ``root_name``, if their types agree."""
        stats = self.stats[rule.name]
        known = self.snapshot.cls_of_name
        if out < len(known) and known[out] is not None and known[out] == known[root_name]:
            return  # already one class: a match seen again after a merge
        if (known[root_name], out) in self._unioned:
            return  # the same replacement built again (by a match in the other operand order, say)
        self._unioned.add((known[root_name], out))
        want = TYPES[self.egraph.vtype[root_name]]
        got = TYPES[self.egraph.vtype[out]]
        if want != got:
            stats.rejected["type"] += 1
            g, w = (_short(got), _short(want)) if _short(got) != _short(want) else (repr(got), repr(want))
            msg = (f"rule {rule.name!r} built {g} for a match of type {w}"
                   + (f" at inputs ({', '.join(_short(a) for a in avals)})" if avals else "") + "; skipped")
            if msg not in self.warnings:
                self.warnings.append(msg)
                log.warning(msg)
            return
        self.egraph.union(root_name, out)
        stats.fired += 1
        if rule.prefer:
            self.preferred.append(Barred(rule.name, root_name, lhs_ctors(rule, lhs), out))
            self._rewrote.setdefault(rule.name, []).append(root_name)
        if avals is not None and len(stats.examples) < 3:
            stats.examples.append((avals, self.egraph.vsource[root_name]))


    def _mirrored(self, act: _Active, inputs: Sequence[Any]) -> bool:
        """Whether a match equal to this one up to a symmetry of its rule (``Rule.symmetries``) was acted on.

        Bindings are compared by name, so the check holds across snapshots."""
        snap = self.snapshot
        names = tuple(snap.name(v) for v in inputs)
        key = min([names] + [(names[0],) + tuple(names[1 + p[i]] for i in range(len(p))) for p in act.symmetries])
        if key in act.mirrors:
            return True
        act.mirrors.add(key)
        return False

    def _watch(self, act: _Active, binds: list[tuple[str, str]], inputs: Sequence[Any], reads: set) -> None:
        """Keep a declined match, to act on again when a class it read changes (see ``_watched``)."""
        if any(sort not in ("Term", "i64") for _, sort in binds):
            return  # a list or a body: no name to find its class by in a later snapshot
        snap = self.snapshot
        # class ids are canonical for one snapshot only: the match is kept by names (i64 values stay)
        entry = (act, binds, [snap.name(inputs[0])] + [snap.name(v) if sort == "Term" else v
                                                       for v, (_, sort) in zip(inputs[1:], binds)])
        for cls, fact in reads:
            name = snap.name(cls)
            slot = self._watched.get(name)
            if slot is None:
                slot = self._watched[name] = [len(snap.nodes.get(cls, ())), set(), []]
            if fact is not None:
                slot[1].add(fact)
            slot[2].append(entry)

    def _wake(self) -> None:
        """Queue the watched matches whose classes gained a node or a fact since they were read."""
        if not self._watched:
            return
        snap = self.snapshot
        nodes, by_name = snap.nodes, snap.cls_of_name
        woken: dict[int, tuple] = {}
        for name in list(self._watched):
            count, facts, entries = self._watched[name]
            cls = by_name[name]
            if len(nodes.get(cls, ())) == count and not any(cls in snap.with_fact(f) for f in facts):
                continue
            del self._watched[name]
            for e in entries:
                woken[id(e)] = e
        for act, binds, named in woken.values():
            inputs = [by_name[named[0]]] + [by_name[v] if sort == "Term" else v for v, (_, sort) in zip(named[1:], binds)]
            act.retry.append((None, binds, inputs))
