"""Saturate: run the rulesets over the e-graph, under limits.

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

from ..ir import primitives as _primitives
from ..ir.egraph import EGraph, Snapshot
from ..ir.jaxapi import core
from ..ir.intern import TYPES, sharded_apart, types_agree
from ..jaxpr.load import Unsupported, load_closed
from .builder import Builder, OutOfTime, standard_numpy
from .match import Match, _short
from .pattern import Pat, commuted, present
from .prefer import lhs_ctors
from .rule import Rule
from .ruleset import Ruleset
from ..records import Barred, Limits, RuleStats, budget_now

log = logging.getLogger("rewrite")


@dataclasses.dataclass
class _Active:
    rule: Rule
    ruleset: Ruleset
    relations: list[tuple[tuple[str, int], list[tuple[str, str]]]]  # (relation, query id), binds (var, sort)
    #: the matches acted on for good, by relation: each its row (the query's bindings)
    seen: dict = dataclasses.field(default_factory=dict)
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
    #: an anchored rule's matches whose left side is not all in the e-graph yet: looked at again each
    #: iteration, and not counted against its allowance (they are not new)
    pending: set = dataclasses.field(default_factory=set)


def _new_matches(act: _Active, matches: Any) -> list[tuple[Any, Any, tuple]]:
    """``act``'s rule's matches in a snapshot (``matches``: ``Snapshot.matches``) that it has not acted on for good:
    ``(relation, binds, row)`` each."""
    new = []
    for rel, binds in act.relations:
        done = act.seen.get(rel)
        new += ([(rel, binds, r) for r in matches(*rel) if r not in done] if done
                else [(rel, binds, r) for r in matches(*rel)])
    return new


@dataclasses.dataclass(frozen=True)
class Held:
    """What a program holds that an anchored rule (``Rule.anchor``) needs before its queries can match: the
    names of its primitives, and the ids of its literals (``LITERALS``)."""

    primitives: frozenset[str]
    literals: frozenset[int] = frozenset()

    @property
    def manual(self) -> bool:
        """Whether the program is inside a ``shard_map`` body (it holds ``pvary``): its rules' manual queries run."""
        return "pvary" in self.primitives

    def admits(self, rule: Rule) -> bool:
        return rule.anchor is None or (rule.anchor in self.primitives and rule.anchor_literals <= self.literals)


def match_program(entries: Sequence[tuple[Rule, Ruleset]], manual: bool = False
                  ) -> tuple[str, list[list[tuple[tuple[str, int], list[tuple[str, str]]]]]]:
    """The egglog declarations of the rules' queries (ruleset ``match``), and per rule its relations and binds.

    Every query records its matches in the relation of its signature (the
    sorts of its root and binds), ``M<k>``, each row led by the query's id;
    a rule's relations are ``(relation, query id)`` pairs, read with
    ``Snapshot.matches``. One relation per signature, not per query: every
    declaration costs at each ``push`` and ``pop`` of a pooled e-graph.
    The text depends on the rules only, so an e-graph declared with it can be
    made once and lent to every rewrite with the same rules (``ir/egraph.py``'s ``_POOL``),
    and it is made once per list of rules (the last few are kept).

    An anchored rule's queries (``Rule.anchor``) are left out: the engine declares them in the e-graph it
    borrows, where it holds what they need (:func:`anchored_rules`). Whether a program holds a primitive is
    no part of the text, so every program shares the one pooled e-graph (a second text would be a second
    e-graph, its schema declared anew: some 0.15 s, where the queries of an anchored rule take 10 ms).
    """
    decl = _declarations(entries, manual)
    if decl.text is None:
        decl.text = "\n".join(decl.head + [line for (rule, _), lines in zip(entries, decl.lines)
                                            if rule.anchor is None for line in lines])
    return decl.text, decl.relations


def anchored_rules(entries: Sequence[tuple[Rule, Ruleset]], manual: bool) -> list[tuple[Rule, str, str]]:
    """The anchored rules :func:`match_program` leaves out: each with its anchor's constructor and the egglog
    declarations of its queries (their relations are declared with the rest)."""
    decl = _declarations(entries, manual)
    return [(rule, _primitives.BY_PRIM[rule.anchor].ctor, "\n".join(lines))
            for (rule, _), lines in zip(entries, decl.lines) if rule.anchor is not None]


@dataclasses.dataclass
class _Declarations:
    head: list[str]  # the ruleset and the relations
    lines: list[list[str]]  # per rule, its queries' egglog rules
    relations: list[list[tuple[tuple[str, int], list[tuple[str, str]]]]]
    text: str | None = None  # the rules' but for the anchored ones'


def _declarations(entries: Sequence[tuple[Rule, Ruleset]], manual: bool) -> _Declarations:
    key = (tuple((id(rule), id(owner)) for rule, owner in entries), manual)
    with _MATCH_LOCK:
        found = _MATCH_TEXTS.get(key)
    if found is not None and len(found[0]) == len(entries) and all(
            a[0] is b[0] and a[1] is b[1] for a, b in zip(found[0], entries)):
        return found[1]
    head = ["(ruleset match)", f"(ruleset {EAGER})"]
    signatures: dict[tuple[str, ...], str] = {}
    lines, relations = [], []
    query = 0
    for rule, _ in entries:
        rels, mine = [], []
        for q in rule.queries + (rule.manual_queries if manual else []):
            sorts = ("Term",) + tuple(s for _, s in q.binds)
            rel = signatures.get(sorts)
            if rel is None:
                rel = signatures[sorts] = f"M{len(signatures)}"
                head.append(f"(relation {rel} (i64 {' '.join(sorts)}))")
            args = " ".join([str(query), q.root] + [v for v, _ in q.binds])
            for k, variant in enumerate(commuted(q)):  # either order of add and mul
                mine.append(f'(rule ({variant.text}) (({rel} {args})) :ruleset match :name "M{query}_{k}")')
                if literal_led(rule):  # its query again, alone in a ruleset of its own: Engine._eager_rounds
                    mine.append(f'(rule ({variant.text}) (({rel} {args})) :ruleset {EAGER} :name "E{query}_{k}")')
            rels.append(((rel, query), q.binds))
            query += 1
        lines.append(mine)
        relations.append(rels)
    made = _Declarations(head, lines, relations)
    with _MATCH_LOCK:
        _MATCH_TEXTS[key] = (list(entries), made)  # the entries kept: their ids stay theirs
        while len(_MATCH_TEXTS) > 8:
            del _MATCH_TEXTS[next(iter(_MATCH_TEXTS))]
    return made


#: The egglog ruleset of the literal-led rules' queries (:func:`literal_led`), run alone between iterations.
EAGER = "match_eager"
#: At most this many rounds of the literal-led rules after an iteration (a chain of folds is one round a link).
EAGER_ROUNDS = 64


def literal_led(rule: Rule) -> bool:
    """Whether ``rule``'s left side is one operation whose operands are all literals (``Pat.lit``; a list of
    cases may follow, as ``select_n``'s): constant folding. Such a rule builds a literal or picks an operand, so
    a program's chain of constant operations (numpyro's ``betaln``: some 35 links of ``add``, ``mul`` and ``div``
    of its two concentrations) folds a link a round, and those rounds are run at once between two iterations,
    with these rules' queries alone (:meth:`Engine._eager_rounds`), not one iteration a link."""
    p = rule.lhs
    if not isinstance(p, Pat) or rule.anchor is not None or p.prim in ("var", "lit", "proj", "opaque"):
        return False
    if p.body or p.bodies or p.is_optional:
        return False
    operands = [x for o in p.operands for x in (o if isinstance(o, (list, tuple)) else [o])]
    return bool(operands) and all(isinstance(x, Pat) and x.prim == "lit" for x in operands)


_MATCH_TEXTS: dict[tuple, tuple[list, _Declarations]] = {}
_MATCH_LOCK = threading.Lock()


class Engine:
    """The state of one saturation: the e-graph, the active rules and their stats; what the rules see and
    build goes through its :class:`Builder`."""

    def __init__(self, egraph: EGraph, entries: Sequence[tuple[Rule, Ruleset]], limits: Limits,
                 manual: bool = False, held: Held | None = None) -> None:
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
        #: anchored rules whose primitive or literals the program lacked (``held``): declared if they appear
        self._deferred: list[tuple[str, frozenset[int], str]] = []
        for (rule, owner), rels in zip(entries, relations):
            # A ruleset may set its own back-off (say, a tighter allowance for
            # associativity); the run's limits govern everything else.
            backoff = owner.limits if owner.limits is not None else limits
            last = owner.limits.iterations if owner.limits is not None else None
            self.active.append(_Active(rule, owner, rels, allowance=backoff.matches, ban_length=backoff.ban,
                                       last=last, symmetries=rule.symmetries))
            self.stats[rule.name] = RuleStats()
        self._eager = [a for a in self.active if literal_led(a.rule)]  # run again between iterations
        if egraph.prelude != text:  # an e-graph made without them (EGraph(match_program(...)[0]) has them)
            egraph.declare(text)
        for rule, ctor, queries in anchored_rules(entries, manual):
            if held is None or held.admits(rule):
                egraph.declare(queries)  # above the pooled e-graph's push: gone when it goes back
            else:
                self._deferred.append((ctor, rule.anchor_literals, queries))

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
        self._products: dict = {}  # Match.product's answers, by the params and classes they read

    def run(self) -> str:
        """Saturate; returns why it stopped."""
        budget = budget_now()
        # the run's seconds are what its rewrite's budget has left (Limits.seconds bounds all its saturations)
        seconds = self.limits.seconds if budget is None or not self.active else budget.allow(self.limits.seconds)
        start = time.perf_counter()
        try:
            stopped = self._run(seconds)
            if budget is not None and self.active:
                budget.record(seconds, time.perf_counter() - start, stopped)
            return stopped
        finally:
            self.builder.release()  # the e-graph goes back to its pool (ir.egraph._POOL) with the engine
            self._products = {}  # (its products' values refer to the builder, as the views release drops do)

    def _run(self, seconds: float) -> str:
        start = time.perf_counter()
        limits = self.limits
        end = start + seconds
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
            declared = bool(self._deferred) and self._declare_deferred()
            if self.snapshot.num_rows > limits.nodes:
                return "node limit"
            if time.perf_counter() - start > seconds:
                return "time limit"
            waiting = False
            matches = self.snapshot.matches
            for act in self.active:
                if act.last is not None and it >= act.last:
                    continue  # its ruleset's rounds are over
                if it < act.banned_until:
                    waiting = True
                    continue
                pending = act.pending
                new = _new_matches(act, matches)
                if not new and not act.retry:
                    continue
                retry, act.retry = act.retry, []
                fresh = sum((rel, r) not in pending for rel, _, r in new) if pending else len(new)
                if fresh > act.allowance and grown:
                    act.last = it  # retired: see Limits.growth
                    self.stats[act.rule.name].retired = True
                    self.stats[act.rule.name].banned += 1
                    log.debug("rule %r retired at iteration %d (%d new matches in a grown e-graph)",
                              act.rule.name, it, len(new))
                    continue
                if fresh > act.allowance:
                    act.banned_until = it + act.ban_length
                    act.allowance *= 2
                    act.ban_length *= 2
                    self.stats[act.rule.name].banned += 1
                    log.debug("rule %r banned until iteration %d (%d new matches)", act.rule.name, act.banned_until, len(new))
                    waiting = True
                    continue
                if self._act_on(act, new + retry, end, share) is not None:
                    self.egraph.flush()
                    return "time limit"
            changed = self.egraph.flush()
            if changed and self._eager and self._eager_rounds(it, end, share) is not None:
                return "time limit"
            if not changed and not waiting and not declared:
                self.snapshot = self.egraph.snapshot()
                return "saturated"  # rules retired in a grown e-graph say so in their stats (``RuleStats.retired``)
        return "iteration limit"

    def _eager_rounds(self, it: int, end: float, share: float) -> str | None:
        """After iteration ``it`` changed the e-graph: the literal-led rules (:func:`literal_led`) alone, round
        after round, until a round finds no new match (at most :data:`EAGER_ROUNDS`; "time limit" where the
        run's time is out). What they act on is what the next iteration would have, a chain of constants in one
        go; a rule whose new matches pass its allowance is left to the iterations and their back-off."""
        for _ in range(EAGER_ROUNDS):
            self.egraph.run("facts", saturate=True)
            self.egraph.run(EAGER)
            self.snapshot = self.egraph.snapshot()
            if self.snapshot.num_rows > self.limits.nodes:
                return None  # the next iteration stops at the node limit
            acted = False
            matches = self.snapshot.matches
            for act in self._eager:
                if (act.last is not None and it >= act.last) or it < act.banned_until:
                    continue
                new = _new_matches(act, matches)
                if not new or len(new) > act.allowance:
                    continue
                acted = True
                if self._act_on(act, new, end, share) is not None:
                    self.egraph.flush()
                    return "time limit"
            if not acted or not self.egraph.flush():
                return None
        return None

    def _act_on(self, act: _Active, todo: list, end: float, share: float) -> str | None:
        """Act on a rule's matches ``todo`` (``(relation, binds, row)``); "time limit" where the run's time ran
        out (the caller flushes and stops), else ``None``."""
        seen, pending = act.seen, act.pending
        stats = self.stats[act.rule.name]
        t = time.perf_counter()
        for rel, binds, inputs in todo:
            if rel is not None and act.symmetries and self._mirrored(act, inputs):
                # its mirror image was acted on: the same program
                seen.setdefault(rel, set()).add(tuple(inputs))
                continue
            now = time.perf_counter()
            self.builder.deadline = min(end, now + share - stats.seconds - (now - t))
            try:
                settled = self._apply(act, binds, inputs)
                if rel is not None:  # (a retried match is seen already)
                    key = (rel, tuple(inputs))
                    if settled:
                        seen.setdefault(rel, set()).add(key[1])
                        pending.discard(key)
                    elif act.rule.anchor is not None:
                        pending.add(key)
            except OutOfTime:
                stats.rejected["out of time"] += 1
            finally:
                self.builder.deadline = float("inf")
            now = time.perf_counter()
            if now > end:  # the run's limit (a rule cut off by it did not outrun its own share)
                stats.seconds += now - t
                return "time limit"
            if stats.seconds + (now - t) > share:
                # Past its share (a procedure cut off mid-way, or many matches): what it built stays.
                act.last = self.iterations - 1
                stats.timed_out = True
                log.debug("rule %r stopped at iteration %d: past its time share (%.3f s)",
                          act.rule.name, act.last, share)
                break
        stats.seconds += time.perf_counter() - t
        return "time limit" if time.perf_counter() > end else None

    def _declare_deferred(self) -> bool:
        """Declare the queries of the anchored rules whose primitive and literals the e-graph now holds (a rule's
        replacement built them); returns whether any were, so that they run in the next iteration."""
        snap, now, literals = self.snapshot, [], None
        for item in self._deferred:
            ctor, needs, text = item
            if not snap.rows(ctor):
                continue
            if needs and literals is None:
                to_int = self.egraph.eg.value_to_i64
                literals = {to_int(r.inputs[0]) for r in snap.rows("Lit")}
            if needs <= (literals or set()):
                self.egraph.declare(text)
                now.append(item)
        self._deferred = [item for item in self._deferred if item not in now]
        return bool(now)

    # ------------------------------------------------------------------ one match
    def _apply(self, act: _Active, binds: list[tuple[str, str]], inputs: Sequence[Any]) -> bool:
        """Act on one match. Returns whether it is settled (never to be looked at again)."""
        rule, stats = act.rule, self.stats[act.rule.name]
        root, vals = inputs[0], inputs[1:]
        snap = self.snapshot
        eg = self.egraph
        if rule.anchor is not None:
            # The match is of a part of the left side (``Rule.anchor``): the whole, looked up at its
            # bindings, is the match's root; until all of it is in the e-graph, the match waits.
            try:
                lhs, _ = rule.traced(tuple(snap.aval(c) for c in vals))
            except Exception:
                pass  # the steps below say why it cannot be traced
            else:
                root = present(eg, lhs, list(vals))
                if root is None:
                    return False
        stats.matched += 1
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
        m = Match(self.builder, rule, bindings, sorts, root, self._products)
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
            with standard_numpy():  # the replacement is the rule's code, whatever the user's promotion settings
                result = rule.rhs(m)
        except (Unsupported, OutOfTime):
            raise
        except core.ShardingTypeError as e:
            # JAX will not build the replacement under the program's explicit mesh axes (a gather whose result
            # sharding it cannot resolve): the rule cannot build it, so it declines
            stats.rejected["sharding"] += 1
            log.debug("rule %r declined: %s", rule.name, e)
            return True
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
        if not types_agree(want, got) and sharded_apart(want, got):  # (intern.sharded_apart): it declines
            stats.rejected["sharding"] += 1
            log.debug("rule %r declined: it built %s for a match of type %s", rule.name, got, want)
            return
        if not types_agree(want, got):
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
