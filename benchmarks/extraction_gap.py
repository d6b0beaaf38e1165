"""The model price that extraction leaves on the table (issue 50, item 6).

For each program of the ecosystem suite, rewritten with the identity packs, this takes the program that
extraction chose and searches further from it under the same whole-program price
(``rewrite.extract.search.ProgramSearch``), with limits extraction does not have:

* **longer**: the same single-class and loop-group moves, with no limit on the program's classes (extraction
  searches only programs of at most ``max_classes`` = 400 classes) and a budget 50 times larger;
* **kicked**: ``--kicks`` restarts, each from the chosen program with one class switched to another of its nodes
  at random (a move extraction's search would refuse because it prices higher), then searched as above: a
  two-move search, which finds what one move cannot (a loop swapped for the ``vmap`` it became, whose single
  switches each price higher).

What it reports is a lower bound on what extraction leaves: how much cheaper, under the model's own price, a
program in the e-graph is than the one emitted. It says nothing of the clock (``benchmarks/decisions.py``).
Prices are the fixed table's (``AnalyticCost``'s defaults), as for the golden files.

Run ``python -m benchmarks.extraction_gap`` (all programs, several minutes on two cores), or
``--programs flax_lm_step,diffrax_neural_ode``; ``--out ''`` prints without writing
``benchmarks/results/extraction_gap.md``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import pathlib
import platform
import random
import statistics
import time
import warnings
from typing import Any

RESULTS = pathlib.Path(__file__).parent / "results"

#: The search's limits here: no limit on the program's size, 50 times extraction's budget per class.
LIMITS = dict(max_classes=10**9, max_evaluations=200_000, per_class=50.0)


def _search(ex: Any, price: Any, choice: dict, roots: list, known: float | None = None) -> tuple[dict, float]:
    from rewrite.extract.search import ProgramSearch

    search = ProgramSearch(ex, price, choice, roots, **LIMITS)
    return search.run(passes=20, known=known)


def _explore(ex: Any, price: Any, choice: dict, roots: list, kicks: int, rng: random.Random, seconds: float
             ) -> dict:
    """From ``choice``: the longer search, then ``kicks`` restarts each from one class switched at random."""
    from rewrite.ir.walk import walk

    t = time.perf_counter()
    best, longer = _search(ex, price, choice, roots)
    longer_s = time.perf_counter() - t
    classes = list(walk(roots, lambda c: ex.term_kids(choice[c])))
    movable = [c for c in classes if len(ex.snap.nodes.get(c, ())) > 1]
    _, tree = ex.tree()
    kicked, tried, t = longer, 0, time.perf_counter()
    for _ in range(kicks if movable else 0):
        if time.perf_counter() - t > seconds:
            break
        c = rng.choice(movable)
        alt = rng.choice([n for n in ex.snap.nodes[c] if n != choice[c]])
        start = {**tree, **choice, c: alt}
        if any(k not in start for k in ex.term_kids(alt)) or ex.reaches(start, ex.term_kids(alt), {c}):
            continue  # the switch makes a cycle, or reads a class with no finite program
        tried += 1
        found, p = _search(ex, price, start, roots)
        if p < kicked:
            best, kicked = found, p
    return {"choice": best, "price": min(longer, kicked), "pricer": price, "longer": longer, "kicked": kicked, "kicks": tried,
            "classes": len(classes), "movable": len(movable), "seconds": longer_s + time.perf_counter() - t}


def gap(result: Any, model: Any, entries: list, kicks: int, seed: int = 0, seconds: float = 120.0) -> dict | None:
    """What a longer and a kicked search find below the chosen program's price, for one rewrite's result
    (kept: ``explain``'s) under the ``(rule, ruleset)`` ``entries`` it ran, among the programs extraction may choose. ``None`` where the model does not price
    whole programs.

    A ruleset's ``min_saving`` (linalg's reorderings) is kept as extraction keeps it
    (``extract.policy.worth_their_saving``): a program using its rules' nodes counts only where it saves that
    fraction of the input's price over the cheapest program without them, which is searched for apart, in the
    e-graph without those nodes. So is a recomputing ruleset's (``Ruleset(recomputes=True)``): its nodes are
    taken only as one candidate, so the searches take none that the chosen program does not."""
    from rewrite.extract.extract import extract
    from rewrite.extract.extractor import shared
    from rewrite.extract.policy import made_by
    from rewrite.extract.program import ProgramPricer, prices_programs
    from rewrite.ir.walk import walk

    if result.snapshot is None or result.choice is None or not prices_programs(model):
        return None
    loaded, roots, choice = result.snapshot, list(result.roots), dict(result.choice)
    # A recomputing rule's nodes are taken only together, as one candidate (extract.policy.recomputations), which
    # the chosen program already answers: the searches may not take one of them the chosen program does not use.
    recomputes = {r.name for r, owner in entries if getattr(owner, "recomputes", False)}
    recomputing = made_by(loaded, result.egraph, recomputes, result.original)
    snap = loaded.without(lambda cls, node: node in recomputing and choice.get(cls) != node) if recomputing else loaded
    ex = shared(snap, model)
    price = ProgramPricer(ex, model)
    chosen = price(choice, roots)
    rng = random.Random(seed)
    full = _explore(ex, price, choice, roots, kicks, rng, seconds)
    floors = {r.name: owner.min_saving for r, owner in entries if getattr(owner, "min_saving", 0.0) > 0}
    made = {node: floors[rule] for node, rule in made_by(loaded, result.egraph, set(floors), result.original).items()}

    def floor(ch: dict) -> float:
        return max((made[n] for n in (ch[c] for c in walk(roots, lambda c: ex.term_kids(ch[c]))) if n in made),
                   default=0.0)

    best, found = full, [full]
    if made and floor(full["choice"]):
        without = snap.without(lambda cls, node: node in made)
        ex_w = shared(without, model)
        price_w = ProgramPricer(ex_w, model)
        start = extract(without, roots, model, result.original).choice  # what worth_their_saving compares with
        plain = _explore(ex_w, price_w, start, roots, kicks, rng, seconds)
        found.append(plain)
        # extraction takes the floor's program only where it saves the floor over the best program without it
        orig = ex.original_tree(result.original)  # the input program, as extraction prices it (its original_cost)
        orig_cost = price(orig, roots) if all(r in orig for r in roots) else math.inf
        # (a program cheaper than the chosen one, under a floor no higher than the chosen one's, passes the same test)
        passes = (0 < floor(full["choice"]) <= floor(choice)
                  or plain["price"] - full["price"] >= floor(full["choice"]) * orig_cost)
        best = full if passes else plain
    best_price = min(best["price"], chosen)
    live = price.live(choice, roots)
    best_live = best["pricer"].live(best["choice"], roots)
    return {"classes": full["classes"], "movable": full["movable"], "chosen": chosen,
            "longer": best["longer"], "kicked": best["kicked"], "kicks": best["kicks"],
            "floored": best is not full, "below_floor": full["price"], "seconds": sum(f["seconds"] for f in found),
            "peak": best_live.peak() / live.peak() if live and best_live and live.peak() else None,
            "left": 1 - best_price / chosen if chosen else 0.0,
            "searched_by_extraction": full["classes"] <= 400}


def measure(name: str, packs: list, kicks: int) -> dict:
    from benchmarks import ecosystem as eco
    from rewrite import explain

    prog = eco.PROGRAMS[name]
    fn, args = prog.build()
    flat, leaves = eco._flat(fn, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = explain(flat, *leaves, rulesets=packs, grad=prog.grad)
    row = gap(report.result, report.model, report.rulesets, kicks) or {}
    report.release()
    return {"program": name, **row}


def markdown(rows: list[dict], kicks: int, load: tuple) -> str:
    done = [r for r in rows if "left" in r]
    lefts = [r["left"] for r in done]
    lines = [
        "# The model price that extraction leaves on the table",
        "",
        f"`python -m benchmarks.extraction_gap --kicks {kicks}` on {platform.machine()}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; load average {load[0]:.1f} at the start "
        "(prices do not depend on it). Each program of the ecosystem suite rewritten with the identity packs "
        "(`explain`); from the program extraction chose, the same whole-program search with no size limit and "
        "50x the budget (*longer*), and restarts from the chosen program with one class switched at random "
        "(*kicked*); a ruleset's `min_saving` is kept as extraction keeps it (*floor*: the best program is searched for "
        "without that ruleset's nodes, which save less than their floor). *Left*: how much lower the best price found is than the chosen program's, a lower bound on "
        "what extraction leaves; *searched*: whether extraction's own search ran on a program of this size "
        "(at most 400 classes); *its peak*: the cheapest program's predicted peak of temporaries over the chosen's "
        "(extraction declines a rewrite that holds more).",
        "",
        (f"Median left {statistics.median(lefts):.2%}, worst {max(lefts):.2%} "
         f"({max(done, key=lambda r: r['left'])['program']}); {sum(x > 0.01 for x in lefts)} of {len(done)} "
         "programs leave more than 1%.") if done else "No program priced.",
        "",
        "| program | classes | with choices | searched | chosen price | longer | kicked (restarts) | left | its peak | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "left" not in r:
            lines.append(f"| {r['program']} | - | - | - | - | - | - | - | - | - |")
            continue
        peak = "-" if r["peak"] is None else f"x{r['peak']:.2f}"
        lines.append(f"| {r['program']} | {r['classes']} | {r['movable']} | {'yes' if r['searched_by_extraction'] else 'no'} "
                     f"| {r['chosen']:,.0f} | {r['longer']:,.0f}{' (floor)' if r['floored'] else ''} | {r['kicked']:,.0f} ({r['kicks']}) "
                     f"| {r['left']:.2%} | {peak} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    from benchmarks import ecosystem as eco
    from benchmarks.overhead import load_rulesets

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", default="", help="comma-separated names (default: every program of the suite)")
    ap.add_argument("--kicks", type=int, default=24, help="restarts from a randomly switched class, per program")
    ap.add_argument("--out", default=str(RESULTS / "extraction_gap.md"), help="Markdown report ('' to print only)")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_REWRITE_CACHE_DIR", "off")
    packs = load_rulesets(eco.CONFIGS["identity"])
    names = [n for n in args.programs.split(",") if n] or list(eco.PROGRAMS)
    load = os.getloadavg()
    rows = []
    for name in names:
        rows.append(measure(name, packs, args.kicks))
        r = rows[-1]
        print(name, "-" if "left" not in r else f"{r['classes']} classes, left {r['left']:.2%} "
              f"(longer {r['longer']:,.0f}, kicked {r['kicked']:,.0f} of {r['chosen']:,.0f})", flush=True)
    text = markdown(rows, args.kicks, load)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
