"""How many of a rewrite's rule applications repeat a match an earlier one acted on, with the same verdict.

A heavy training step runs three saturations (``rewrite/grad/step.py``): the loss's forward, the changed step
jointly, the rest. The joint holds the rewritten forward, so one may expect many of its matches to be ones the
forward's pipeline already declined; a declined verdict that is a pure function of what the rule read could then be
carried to the later pipeline with no new run. This probe measures the most such a carry could save, before any
proof that a rule qualifies: each match's *structural key* (the rule, and for each bound class its type and, down to
``depth``, its nodes: constructor, integer arguments, the children's keys; class ids and names never enter) is
logged with its verdict (fired, a rejection's reason, nothing), its seconds and whether it built terms. A match
*repeats* when a match with the same key and the same verdict came before it: in an earlier pipeline of the same
rewrite (``across``), or earlier in its own pipeline (``within``). Only repeats that did not fire and built nothing
count: those are the runs a carried verdict would skip.

The key is an upper bound on what an exact carry keys by: a rule reads its match's classes whole (every node, at
whatever depth its procedure walks), and some read more than the key holds (a class's users, a slice's choice, a
fact that is present). Depth 0 is the rule and its bindings' types alone.

Run ``python -m benchmarks.match_repeats [--programs a,b] [--depths 0,1,2]``; each program is rewritten twice in
one process (with its disk cache off) and the second rewrite is the one logged, so first-call tracing is not counted.
The seconds are the logged rewrite's, whose keys are built after each match (their memos make the process slower:
read the shares, and the unlogged rewrite's CPU s and rule-application seconds printed beside them).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import time
from typing import Any, Iterator

#: the programs whose rewrite runs several pipelines (issue 48 item 3): the heavy training steps, and seq2seq's grad
HEAVY = ("flax_lm_step", "flax_long_context_step", "wholestep_linen_gpt", "wholestep_equinox_gpt",
         "flax_transformer_step", "flax_seq2seq_grad")


def structural_key(snap: Any, cls: Any, depth: int, memo: dict) -> tuple:
    """``cls``'s type (``"container"`` for an operand list or a body) and, down to ``depth``, its nodes (constructor, ints as they are, children by their keys),
    as a frozenset: the same for two classes of two e-graphs that hold the same terms to that depth. A class met
    again below itself (a cycle) reads ``("cycle",)`` there. ``memo`` is per snapshot."""
    at = (cls, depth)
    found = memo.get(at)
    if found is not None:
        return found
    memo[at] = ("cycle",)
    name = snap.name_of_cls.get(cls)  # a list or a body has none, and no type
    kind = snap.egraph.vtype[name] if name is not None else "container"
    if depth == 0:
        key: tuple = (kind,)
    else:
        key = (kind, frozenset(
            (ctor, tuple(a if isinstance(a, int) else structural_key(snap, a, depth - 1, memo) for a in args))
            for ctor, args in snap.nodes.get(cls, ())))
    memo[at] = key
    return key


@dataclasses.dataclass
class Applied:
    """One rule application (``Engine._apply``): its keys by depth, verdict, seconds and the terms it built."""

    keys: tuple
    verdict: str
    seconds: float
    built: int


@contextlib.contextmanager
def recording(depths: tuple[int, ...] = (0, 1, 2)) -> Iterator[list[list[Applied]]]:
    """While the block runs, every saturation's applications, one list per engine in the order they were made."""
    from rewrite.rules import saturate

    engines: list[list[Applied]] = []
    init, apply = saturate.Engine.__init__, saturate.Engine._apply

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._probe_log, self._probe_memo = [], (None, {})
        engines.append(self._probe_log)

    def recording_apply(self, act, binds, inputs):
        stats = self.stats[act.rule.name]
        fired, rejected, matched, made = stats.fired, dict(stats.rejected), stats.matched, len(self.egraph.defs)
        t = time.perf_counter()
        settled = apply(self, act, binds, inputs)
        seconds = time.perf_counter() - t
        snap = self.snapshot
        if self._probe_memo[0] is not snap:
            self._probe_memo = (snap, {})
        memo = self._probe_memo[1]
        sorts = ["Term"] + [s for _, s in binds]
        keys = tuple((act.rule.name,) + tuple(
            structural_key(snap, v, d, memo) if s == "Term" else (s, v if s == "i64" else None)
            for v, s in zip(inputs, sorts)) for d in depths)
        why = [k for k, n in stats.rejected.items() if n > rejected.get(k, 0)]
        verdict = ("fired" if stats.fired > fired else ",".join(why) if why
                   else "nothing" if stats.matched > matched else "waiting")
        self._probe_log.append(Applied(keys, verdict, seconds, len(self.egraph.defs) - made))
        return settled

    saturate.Engine.__init__, saturate.Engine._apply = recording_init, recording_apply
    try:
        yield engines
    finally:
        saturate.Engine.__init__, saturate.Engine._apply = init, apply


@dataclasses.dataclass
class Repeats:
    applied: int = 0
    seconds: float = 0.0
    repeats: int = 0
    repeat_seconds: float = 0.0
    by_rule: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def repeats(engines: list[list[Applied]], level: int, within: bool = False) -> list[Repeats]:
    """Per engine, its applications and the repeats among them at key ``level`` (an index into the depths
    recorded): a match whose key and verdict an earlier engine's match had (``within``: an earlier match of the
    same engine), that did not fire and built nothing."""
    out = []
    earlier: dict = {}
    for log in engines:
        mine: dict = {}
        r = Repeats(applied=len(log), seconds=sum(a.seconds for a in log))
        for a in log:
            key = a.keys[level]
            before = (mine if within else earlier).get(key)
            if before == a.verdict and a.verdict != "fired" and not a.built:
                r.repeats += 1
                r.repeat_seconds += a.seconds
                r.by_rule[key[0]] += a.seconds
            mine.setdefault(key, a.verdict)
        for key, verdict in mine.items():
            earlier.setdefault(key, verdict)
        out.append(r)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", default=",".join(HEAVY))
    parser.add_argument("--depths", default="0,1,2")
    args = parser.parse_args(argv)
    os.environ["JAX_REWRITE_CACHE_DIR"] = "off"
    from benchmarks import ecosystem as eco
    from benchmarks.rewrite_time import measure

    depths = tuple(int(d) for d in args.depths.split(","))
    packs = eco.load_rulesets(eco.CONFIGS["identity"])
    measure("flax_seq2seq_loss", packs)  # the imports and first traces
    print("| program | depth | pipelines' applications (s) | across: repeats (s, share) | within: repeats (s, share) "
          "| unlogged rewrite CPU s |\n|---|---|---|---|---|---|")
    for name in args.programs.split(","):
        plain = measure(name, packs)["cpu_s"]
        with recording(depths) as engines:
            measure(name, packs)
        for level, d in enumerate(depths):
            cells = []
            for within in (False, True):
                rs = repeats(engines, level, within)
                n, s = sum(r.repeats for r in rs), sum(r.repeat_seconds for r in rs)
                total = sum(r.seconds for r in rs)
                top = collections.Counter()
                for r in rs:
                    top.update(r.by_rule)
                cells.append(f"{n} ({s:.3f}, {s / total:.1%}; " + ", ".join(f"{k} {v:.3f}" for k, v in top.most_common(3))
                             + ")")
            applied = " + ".join(f"{len(e)} ({sum(a.seconds for a in e):.3f})" for e in engines)
            print(f"| {name} | {d} | {applied} | {cells[0]} | {cells[1]} | {plain:.2f} |", flush=True)


if __name__ == "__main__":
    main()
