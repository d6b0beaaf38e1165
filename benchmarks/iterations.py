"""What each saturation's iterations buy: per pipeline, per iteration, the rows added, the seconds, the rules that
fired, and whether the program extracted after that iteration is already the final one.

Every pipeline a rewrite runs (``rewrite.pipeline._run`` and ``run_together``, as ``benchmarks.rewrite_time``
counts them) is watched: its engine's iterations are marked where each one starts (the e-graph's rows, the rules'
firings, the time, this script's own reading left out), and after it returns it is run again with its
``Limits.iterations`` cut to 1, 2, ... one less than it ran, outside the rewrite's time budget, and each program
that comes out (both, for ``run_together``) compared with the final one as text. "Final from" is the first
iteration after which every cut gives the final program: the iterations after it bought nothing that extraction
took. Saturation is deterministic, so a run cut at ``k`` holds what the full run held after ``k`` iterations.

Run ``python -m benchmarks.iterations [--programs a,b] [--cases c,d] [--json FILE]``: the ecosystem programs with
the identity packs (``benchmarks/ecosystem.py``), and the decision corpus's cases (``benchmarks/decisions.py``,
without the hand-written ones, which saturate nothing); a markdown table on stdout. Its seconds are a run's
shares only: time the rewrite with ``benchmarks.rewrite_time``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import warnings
from typing import Any, Callable, Iterator


@dataclasses.dataclass
class Pipeline:
    """One pipeline's saturation, iteration by iteration (``rows``, ``seconds``, ``fired``: one entry each)."""

    kind: str  # "run" (one program) or "joint" (``run_together``: two programs in one e-graph)
    stopped: str
    limit: int
    loaded: int  # rows when the first iteration starts
    rows: list[int] = dataclasses.field(default_factory=list)  # rows when each iteration ended
    seconds: list[float] = dataclasses.field(default_factory=list)
    fired: list[dict[str, int]] = dataclasses.field(default_factory=list)
    same: list[bool] = dataclasses.field(default_factory=list)  # per iteration: its program is the final one

    @property
    def iterations(self) -> int:
        return len(self.rows)

    @property
    def final_from(self) -> int:
        """The first iteration after which every cut gives the final program."""
        k = self.iterations
        while k > 1 and self.same[k - 2]:
            k -= 1
        return k

    @property
    def seconds_after_final(self) -> float:
        return sum(self.seconds[self.final_from:])


@contextlib.contextmanager
def watched() -> Iterator[list[Pipeline]]:
    """Every top-level pipeline run while the block runs, measured (a pipeline inside a rule's procedure is left
    alone), in a list the block can read after."""
    from rewrite import pipeline, records
    from rewrite.rules import saturate

    found: list[Pipeline] = []
    marks: list[list | None] = []  # the innermost watched pipeline's iteration marks, or None (a rerun, inside)
    run, together, engine_run = pipeline._run, pipeline.run_together, saturate.Engine.run

    def marked_run(self: Any) -> str:
        into = marks[-1] if marks else None
        if into is None:
            return engine_run(self)
        own = [0.0]

        def mark() -> None:
            t = time.perf_counter()
            rows = self.egraph.snapshot().num_rows
            into.append((t - own[0], rows, {k: s.fired for k, s in self.stats.items()}))
            own[0] += time.perf_counter() - t

        raw = self.egraph.run

        def run_marked(ruleset: str, *, saturate: bool = False) -> Any:
            if ruleset == "match":  # each iteration runs every query once (after the facts', which the literal-led
                mark()  # rules' rounds between two iterations run too: saturate.Engine._eager_rounds)
            return raw(ruleset, saturate=saturate)

        self.egraph.run = run_marked
        try:
            return engine_run(self)
        finally:
            del self.egraph.run
            mark()

    def outside_budget(fn: Callable[[], Any]) -> Any:
        """``fn()`` as a bare pipeline, its time given back to the rewrite's budget."""
        budget = records._BUDGET.get()
        token = records._BUDGET.set(None)
        t = time.perf_counter()
        try:
            return fn()
        finally:
            records._BUDGET.reset(token)
            if budget is not None and budget._inside:
                budget._since += time.perf_counter() - t

    def measured(kind: str, call: Callable[[Any], Any], texts: Callable[[Any], Any], limits: Any,
                 release: Callable[[Any], None]) -> Any:
        if marks:  # inside a watched pipeline or a rerun
            marks.append(None)
            try:
                return call(limits)
            finally:
                marks.pop()
        into: list = []
        marks.append(into)
        try:
            result = call(limits)
        finally:
            marks.pop()
        first = result[0] if isinstance(result, tuple) else result
        p = Pipeline(kind, first.stopped, limits.iterations, into[0][1] if into else first.rows)
        for (t0, _, f0), (t1, rows, f1) in zip(into, into[1:]):
            p.rows.append(rows)
            p.seconds.append(t1 - t0)
            p.fired.append({k: v - f0.get(k, 0) for k, v in f1.items() if v - f0.get(k, 0)})
        final = texts(result)
        marks.append(None)
        try:
            for k in range(1, first.iterations):
                cut = outside_budget(lambda: call(dataclasses.replace(limits, iterations=k)))
                p.same.append(texts(cut) == final)
                release(cut)
        finally:
            marks.pop()
        found.append(p)
        return result

    def watched_run(closed, entries, model, limits, keep, *rest, **kw):
        if len(entries) <= 1:  # a rule's own check (``rewrite.define``), made once at its first use: not a rewrite
            marks.append(None)
            try:
                return run(closed, entries, model, limits, keep, *rest, **kw)
            finally:
                marks.pop()
        return measured("run", lambda lim: run(closed, entries, model, lim, keep, *rest, **kw),
                        lambda r: str(r.after), limits, lambda r: None)

    def watched_together(first, second, entries, model, limits, *rest, **kw):
        return measured("joint", lambda lim: together(first, second, entries, model, lim, *rest, **kw),
                        lambda rs: (str(rs[0].after), str(rs[1].after)), limits, lambda rs: rs[0].egraph.release())

    pipeline._run, pipeline.run_together, saturate.Engine.run = watched_run, watched_together, marked_run
    try:
        yield found
    finally:
        pipeline._run, pipeline.run_together, saturate.Engine.run = run, together, engine_run


def table(rows: list[tuple[str, int, Pipeline]]) -> str:
    lines = ["| program | # | kind | stop | iterations / limit | rows loaded -> end | final from | saturation s | "
             "s after final | rows added each | firings each |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, i, p in rows:
        added = [b - a for a, b in zip([p.loaded] + p.rows, p.rows)]
        lines.append(f"| {name} | {i} | {p.kind} | {p.stopped} | {p.iterations}/{p.limit} | {p.loaded:,} -> "
                     f"{p.rows[-1] if p.rows else p.loaded:,} | {p.final_from} | {sum(p.seconds):.3f} | "
                     f"{p.seconds_after_final:.3f} | {', '.join(map(str, added))} | "
                     f"{', '.join(str(sum(f.values())) for f in p.fired)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from benchmarks import decisions, ecosystem as eco
    from rewrite import rewrite

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default="", help="ecosystem programs (comma-separated; 'all' for every one)")
    ap.add_argument("--cases", default="", help="decision-corpus cases (comma-separated; 'all' for every one)")
    ap.add_argument("--json", default="", help="also write the measurements here")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    sys.setrecursionlimit(10000)
    packs = eco.load_rulesets(eco.CONFIGS["identity"])  # loaded before watching: a pack's rule checks are not a rewrite
    programs = list(eco.PROGRAMS) if args.programs == "all" else [p for p in args.programs.split(",") if p]
    cases = ([c.name for c in decisions.cases() if c.mode != "hand"] if args.cases == "all"
             else [c for c in args.cases.split(",") if c])
    rows: list[tuple[str, int, Pipeline]] = []
    for name in programs + cases:
        with watched() as found:
            if name in programs:
                prog = eco.PROGRAMS[name]
                fn, leaves = eco._flat(*prog.build())
                r = rewrite(fn, rulesets=packs, cache=False)
                r.grad_result(*leaves) if prog.grad else r.result(*leaves)
            else:
                (case,) = decisions.select([name])
                decisions.decide(case, programs=False)
        rows += [(name, i, p) for i, p in enumerate(found)]
        print(f"{name}: {len(found)} pipelines", file=sys.stderr, flush=True)
    print(table(rows))
    total, after = sum(sum(p.seconds) for _, _, p in rows), sum(p.seconds_after_final for _, _, p in rows)
    print(f"\n{len(rows)} pipelines: saturation {total:.2f} s, after the final program {after:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"program": n, "index": i, **dataclasses.asdict(p)} for n, i, p in rows], f)


if __name__ == "__main__":
    main()
