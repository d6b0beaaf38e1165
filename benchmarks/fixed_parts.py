"""Where a first call's rewrite spends its CPU, per part, against XLA's compile: the fixed parts and the rules' work.

Issue 48 item 3 / issue 50 ask for a median of 0.3x XLA's compile. This splits each program's first rewrite (as
``benchmarks.rewrite_time`` times it: the suite's order in one process, a fresh disk-cache folder, XLA's compile
measured first) into parts, each the *exclusive* ``time.process_time`` of the functions that make it (a part's
time less the time of the other parts called inside it), so the parts add up to the rewrite's CPU s with
``other`` (the search's own logic, bookkeeping, what no part names). Wrappers, not a profiler: cProfile inflates
JAX tracing about 6x, and a sampling profiler pauses the process; a wrapper costs a few microseconds a call and
the parts wrapped are called at most a few hundred times a rewrite.

The parts: the user's function traced (``trace``, what any rewrite of the function pays), the programs loaded
into egglog (``load``) and the e-graphs taken from and given back to the pool (``pool``: egglog's push and pop),
the input program priced (``input price``), saturation, extraction (``emit`` apart, and ``min_saving``: the
program extracted again without the nodes of rulesets that ask for a ``min_saving``; ``plain extraction``: a loss's
forward extracted again without the ``jointly`` rules' nodes, ``pipeline.plain_program``), the memory tie's predictions
(``tie``), the whole-step search's JAX traces of joints (``joint trace``, ``rederive``; a gradient program's JAX
derivative of its loss as written, ``grad.vjp.as_written_vjp``, is a joint trace too) and its proofs, a VJP's
``residual search`` (``grad.vjp.choose_residuals``: its splits priced whole, the cost model's work), the peaks
its decision predicts of the joints it compares (``decision peaks``, ``grad.decide.Joint.peak``), the disk cache's key
and store. ``floor`` is trace + load + pool + emit: what a rewrite of this design pays with no rule
work and no decision made.

Run ``python -m benchmarks.fixed_parts [--programs a,b] [--jsonl FILE]`` (hold the bench lock): a markdown table,
slowest ratio last, then what the median ratio would be with the rules' work scaled down
(``benchmarks/results/log.md``, h-median of the fortieth session).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Iterator

#: (part, module, attribute, method of) for each function wrapped; a module-level function is replaced wherever a
#: module of ``rewrite`` or ``rulesets`` holds it by name (``from .x import f`` copies)
PARTS = (
    ("trace", "rewrite.jaxpr.trace", "trace", None),
    ("cache key", "rewrite.api", "_disk_key", "Rewritten"),
    ("cache store", "rewrite.cache.store", "store", "DiskCache"),
    ("pool", "rewrite.ir.egraph", "take", "_Pool"),
    ("pool", "rewrite.ir.egraph", "give", "_Pool"),
    ("load", "rewrite.pipeline", "_load_all", None),
    ("input price", "rewrite.extract.extract", "input_cost", None),
    ("saturation", "rewrite.rules.saturate", "run", "Engine"),
    ("extraction", "rewrite.pipeline", "_extracted", None),
    ("min_saving", "rewrite.extract.policy", "worth_their_saving", None),
    ("plain extraction", "rewrite.pipeline", "plain_program", None),
    ("tie", "rewrite.extract.tie", "on_xla_count", None),
    ("emit", "rewrite.jaxpr.emit", "emit", None),
    ("rederive", "rewrite.grad.step", "rederive", None),
    ("joint trace", "rewrite.grad.vjp", "joint_program", None),
    ("joint trace", "rewrite.grad.vjp", "as_written_vjp", None),
    ("residual search", "rewrite.grad.vjp", "choose_residuals", None),
    ("prove", "rewrite.grad.step", "prove", None),
    ("decision peaks", "rewrite.grad.decide", "peak", "Joint"),
)
FLOOR = ("trace", "load", "pool", "emit")
WORK = ("saturation", "extraction", "min_saving", "plain extraction", "rederive", "joint trace", "prove")


class Parts:
    """Exclusive CPU seconds by part, while :meth:`wrapped` is entered."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[float] = []

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.process_time()
            self._stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.process_time() - t
                inner = self._stack.pop()
                self.seconds[part] = self.seconds.get(part, 0.0) + spent - inner
                if self._stack:
                    self._stack[-1] += spent
        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    @contextlib.contextmanager
    def wrapped(self, parts: tuple = PARTS) -> Iterator["Parts"]:
        import importlib

        undo: list[tuple[Any, str, Any]] = []
        try:
            for part, module, name, owner in parts:
                mod = importlib.import_module(module)
                if owner is not None:
                    cls = getattr(mod, owner)
                    undo.append((cls, name, cls.__dict__[name]))
                    setattr(cls, name, self.wrap(part, cls.__dict__[name]))
                    continue
                orig = getattr(mod, name)
                new = self.wrap(part, orig)
                for m in list(sys.modules.values()):
                    if getattr(m, "__name__", "").split(".")[0] in ("rewrite", "rulesets"):
                        for key, value in list(vars(m).items()):
                            if value is orig:
                                undo.append((m, key, orig))
                                setattr(m, key, new)
            yield self
        finally:
            for target, key, value in reversed(undo):
                setattr(target, key, value)


def measure(name: str, packs: list, parts: Parts) -> dict:
    """One program's first rewrite, as ``rewrite_time.measure`` times it: XLA's compile (median of two), the
    rewrite's CPU s and its parts."""
    from benchmarks.rewrite_time import prepared
    from rewrite import rewrite

    prog, flat, leaves, compile_s, _ = prepared(name)
    parts.seconds.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.process_time()
        r = rewrite(flat, rulesets=packs)
        r.grad_result(*leaves) if prog.grad else r.result(*leaves)
        cpu = time.process_time() - t
    row = {"program": name, "xla": compile_s, "cpu": cpu, **parts.seconds}
    row["other"] = cpu - sum(parts.seconds.values())
    return row


def table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(p for p, *_ in PARTS)) + ["other"]
    out = ["| program | XLA s | CPU s | ratio | " + " | ".join(names) + " | floor (ratio) |",
           "|---" * (len(names) + 5) + "|"]
    for r in sorted(rows, key=lambda r: r["cpu"] / r["xla"]):
        floor = sum(r.get(p, 0.0) for p in FLOOR)
        out.append(f"| {r['program']} | {r['xla']:.2f} | {r['cpu']:.3f} | {r['cpu'] / r['xla']:.2f}x | "
                   + " | ".join(f"{r.get(p, 0.0):.3f}" for p in names) + f" | {floor:.3f} ({floor / r['xla']:.2f}x) |")
    return "\n".join(out)


def median_if(rows: list[dict], work: float, fixed: float = 1.0) -> float:
    """The median ratio were the rules' work (:data:`WORK`) ``work`` times what it is, and the parts neither work nor
    floor ``fixed`` times."""
    out = []
    for r in rows:
        w = sum(r.get(p, 0.0) for p in WORK)
        f = sum(r.get(p, 0.0) for p in FLOOR)
        out.append((w * work + f + (r["cpu"] - w - f) * fixed) / r["xla"])
    return statistics.median(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", default="", help="comma-separated (default: the suite, in its order)")
    ap.add_argument("--jsonl", default="", help="also write each row as a JSON line here")
    a = ap.parse_args(argv)
    sys.setrecursionlimit(10000)
    from benchmarks import ecosystem as eco

    packs = eco.load_rulesets(eco.CONFIGS["identity"])
    names = [n for n in a.programs.split(",") if n] or list(eco.PROGRAMS)
    rows = []
    with tempfile.TemporaryDirectory() as folder, Parts().wrapped() as parts:
        os.environ["JAX_REWRITE_CACHE_DIR"] = folder  # a first call: nothing stored before
        for name in names:
            rows.append(measure(name, packs, parts))
            if a.jsonl:
                with open(a.jsonl, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    print(table(rows))
    print(f"\nmedian {statistics.median(r['cpu'] / r['xla'] for r in rows):.2f}x; were the rules' work "
          + ", ".join(f"x{w}: {median_if(rows, w):.2f}x" for w in (0.5, 0.2, 0.1, 0.0))
          + f"; the floor alone: {median_if(rows, 0.0, 0.0):.2f}x")


if __name__ == "__main__":
    main()
