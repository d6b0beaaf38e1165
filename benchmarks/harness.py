"""How every benchmark here measures: side by side, in one process, interleaved, after a warm-up.

A *case* is one program in several variants (``standard``, ``rewritten``,
``hand-written``, ...) that take the same arguments. :func:`measure` compiles
every variant with ``jax.jit``, reads temp memory from
``compiled.memory_analysis()`` and flops/transcendentals/bytes from
``compiled.cost_analysis()``, warms each up, then times them in rounds; each
round runs every variant once in a shuffled order, so drift in the machine's
speed hits all variants alike. Ratios are ``time(baseline) / time(variant)``
over the per-round medians: above 1 means faster than the baseline.

Timing runs should hold ``/tmp/bench.lock`` (``flock``) so two benchmarks on
this shared machine never time each other.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import platform
import random
import statistics
import time
from typing import Any, Callable, Sequence

import jax

MiB = 1024 * 1024


@dataclasses.dataclass
class Stats:
    """Compile-time facts about one variant."""

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    flops: float
    transcendentals: float
    bytes_accessed: float
    #: the library (YNN) fusions' scratch, which ``temp_bytes`` does not count (``benchmarks/library_scratch.py``)
    scratch_bytes: int = 0


@dataclasses.dataclass
class Row:
    """One case measured: per variant, the median time and the compile-time stats."""

    case: str
    baseline: str
    seconds: dict[str, float]
    spread: dict[str, float]  # (p75 - p25) / median of the per-round times
    stats: dict[str, Stats]
    rounds: int
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # per variant, one time per round

    def ratio(self, variant: str) -> float:
        return self.seconds[self.baseline] / self.seconds[variant]

    def paired(self, variant: str, level: float = 0.9, resamples: int = 4000, seed: int = 0
               ) -> tuple[float, float, float]:
        """(median, low, high) of the per-round ratios ``time(baseline) / time(variant)``, with a bootstrap interval.

        Each round ran every variant once, back to back, so a ratio within one round cancels the drift between
        rounds that the ratio of the two medians (:meth:`ratio`) keeps. The interval is the percentile bootstrap
        of the median over rounds, at ``level``; with the A/A control's interval beside it, it says whether a
        difference of a few percent is there at all.
        """
        base, var = self.samples[self.baseline], self.samples[variant]
        ratios = [b / v for b, v in zip(base, var)]
        rng = random.Random(seed)
        meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
        tail = (1.0 - level) / 2
        return (statistics.median(ratios), meds[int(tail * resamples)],
                meds[min(resamples - 1, int((1.0 - tail) * resamples))])

    def as_dict(self) -> dict[str, Any]:
        return {
            "case": self.case, "baseline": self.baseline, "rounds": self.rounds,
            "variants": {
                v: {"seconds": self.seconds[v], "ratio": self.ratio(v), "spread": self.spread[v],
                    **({"samples": self.samples[v], "paired": self.paired(v)} if self.samples else {}),
                    **dataclasses.asdict(self.stats[v])}
                for v in self.seconds
            },
        }


def compile_stats(fn: Callable[..., Any], *args: Any) -> tuple[Any, Stats]:
    """Compile ``fn`` and read what XLA says about it."""
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX returned one dict per device
        cost = cost[0] if cost else {}
    cost = cost or {}
    return compiled, Stats(
        temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0) or 0),
        argument_bytes=int(getattr(mem, "argument_size_in_bytes", 0) or 0),
        output_bytes=int(getattr(mem, "output_size_in_bytes", 0) or 0),
        flops=float(cost.get("flops", 0.0)),
        transcendentals=float(cost.get("transcendentals", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        scratch_bytes=_scratch(compiled),
    )


def _scratch(compiled: Any) -> int:
    """The compiled program's library scratch (``benchmarks.library_scratch.scratch_bytes``), 0 where its HLO
    cannot be read."""
    from benchmarks.library_scratch import scratch_bytes

    try:
        return scratch_bytes(compiled)
    except Exception:
        return 0


def _run_once(compiled: Any, args: Sequence[Any], inner: int) -> float:
    t = time.perf_counter()
    for _ in range(inner):
        out = compiled(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / inner


def interleaved(runs: dict[Any, tuple[Any, Sequence[Any]]], rounds: int, *, warmup: int = 2,
                min_round_seconds: float = 0.02) -> dict[Any, list[float]]:
    """Seconds per call of each compiled program with its own arguments (``runs``: key -> ``(compiled, args)``),
    one sample a round over ``rounds`` rounds in a fixed order, after ``warmup`` calls each; a sample repeats the
    call often enough to last ``min_round_seconds``. For programs that take different arguments (:func:`measure`
    times variants of one call, in a shuffled order)."""
    inner = {}
    for k, (c, args) in runs.items():
        for _ in range(warmup):
            _run_once(c, args, 1)
        inner[k] = max(1, int(min_round_seconds / max(_run_once(c, args, 1), 1e-6)))
    times: dict[Any, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, (c, args) in runs.items():
            times[k].append(_run_once(c, args, inner[k]))
    return times


def measure(case: str, variants: dict[str, Callable[..., Any]], args: Sequence[Any], *, baseline: str = "standard",
            rounds: int = 15, warmup: int = 3, min_round_seconds: float = 0.02, seed: int = 0,
            progress: Callable[[str], None] | None = None, same_count: bool = False,
            more: Callable[[dict[str, list[float]]], bool] | None = None, most_rounds: int = 0) -> Row:
    """Time ``variants`` (same arguments) interleaved; see the module docstring.

    Each timed block repeats a variant's call often enough to last ``min_round_seconds``; with ``same_count``
    every variant repeats it as often as the fastest needs, so that programs of a few milliseconds, whose
    per-block overheads (dispatch, the last call's wait) are a few per cent of a block, are timed alike.
    ``more``, where given, reads the per-round samples after the ``rounds`` rounds: while it says they have not
    settled, ``rounds`` more are timed, up to ``most_rounds`` in all (``Row.rounds``: how many ran)."""
    if baseline not in variants:
        raise ValueError(f"baseline {baseline!r} is not one of {list(variants)}")
    compiled: dict[str, Any] = {}
    stats: dict[str, Stats] = {}
    for name, fn in variants.items():
        if progress is not None:
            progress(f"{case}: compiling {name}")
        compiled[name], stats[name] = compile_stats(fn, *args)
    # Pick a repetition count per call so that each timed block is long enough to trust.
    inner: dict[str, int] = {}
    for name, c in compiled.items():
        if progress is not None:
            progress(f"{case}: warming up {name}")
        for _ in range(warmup):
            _run_once(c, args, 1)
        one = max(_run_once(c, args, 1), 1e-6)
        inner[name] = max(1, int(min_round_seconds / one))
    if same_count:
        inner = dict.fromkeys(inner, max(inner.values()))
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {n: [] for n in variants}
    order = list(variants)
    done, target = 0, rounds
    while True:
        for r in range(done, target):
            rng.shuffle(order)
            for name in order:
                samples[name].append(_run_once(compiled[name], args, inner[name]))
            if progress is not None:
                progress(f"{case}: round {r + 1}/{target}")
        done = target
        if more is None or target >= most_rounds or not more(samples):
            break
        target = min(most_rounds, target + rounds)
    med = {n: statistics.median(s) for n, s in samples.items()}
    spread = {}
    for n, s in samples.items():
        q = statistics.quantiles(s, n=4) if len(s) >= 4 else [s[0], s[0], s[-1]]
        spread[n] = (q[2] - q[0]) / med[n] if med[n] else 0.0
    return Row(case, baseline, med, spread, stats, done, samples)


def format_variants(row: Row) -> str:
    """One case as a Markdown table, variants down: time, ratio to the baseline, spread, temp memory, cost."""
    lines = [f"| variant | ms | vs {row.baseline} | spread | temp MiB | GFLOP | transc. M |",
             "|---|---|---|---|---|---|---|"]
    for v, s in row.seconds.items():
        st = row.stats[v]
        lines.append(f"| {v} | {s * 1e3:.3f} | {row.ratio(v):.2f}x | {row.spread[v]:.0%} | "
                     f"{st.temp_bytes / MiB:.1f} | {st.flops / 1e9:.3f} | {st.transcendentals / 1e6:.2f} |")
    return "\n".join(lines)


def format_rows(rows: Sequence[Row], variants: Sequence[str] | None = None) -> str:
    """A Markdown table: time, ratio to the baseline, temp memory, flops and transcendentals per variant."""
    if not rows:
        return ""
    names = list(variants or rows[0].seconds)
    head = ["case"] + [f"{v} {k}" for v in names for k in ("ms", "ratio", "temp MiB", "GFLOP", "transc. M")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.case]
        for v in names:
            if v not in row.seconds:
                cells += ["-"] * 5
                continue
            st = row.stats[v]
            cells += [f"{row.seconds[v] * 1e3:.3f}", f"{row.ratio(v):.2f}x", f"{st.temp_bytes / MiB:.1f}",
                      f"{st.flops / 1e9:.3f}", f"{st.transcendentals / 1e6:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: The heading of a results file's hand-written section, which ``write_results`` keeps when it rewrites the file.
HAND_NOTES = "## Notes (written by hand"


def write_results(folder: pathlib.Path, name: str, title: str, setup: str, rounds: int, header: str,
                  lines: Sequence[str], rows: Any, command: str | None = None) -> None:
    """``folder/name.json`` (``rows``) and ``folder/name.md``: ``title``, the command and the machine that ran
    it (``command``; by default ``python -m benchmarks.<name> --rounds <rounds>``), ``setup`` (what was measured,
    how to read it), then the table ``header`` and ``lines``. A section of the old ``name.md`` from a heading
    ``## Notes (written by hand...`` on is kept after the new table."""
    folder.mkdir(exist_ok=True)
    old = folder / f"{name}.md"
    old = old.read_text() if old.exists() else ""
    kept = old[old.index(HAND_NOTES):] if HAND_NOTES in old else ""
    (folder / f"{name}.json").write_text(json.dumps(rows, indent=1, default=float))
    default = f"python -m benchmarks.{name} --rounds {rounds}"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = [f"# {title}\n",
            f"`{command or default}`, {stamp}, {platform.processor() or platform.machine()}, "
            f"{jax.devices()[0].device_kind}, jax {jax.__version__}. {setup}\n", header, *lines]
    (folder / f"{name}.md").write_text("\n".join(text) + "\n" + (f"\n{kept}" if kept else ""))


def peak_rss_since() -> Callable[[], int] | None:
    """Reset this process's peak resident memory (Linux's ``VmHWM``, by ``/proc/self/clear_refs``) and return a
    function that reads its growth since, in bytes; None where the kernel does not allow it. What
    ``memory_analysis()`` does not see (the scratch of XLA:CPU's library fusions) shows here
    (``benchmarks/attention.py --rss``, ``benchmarks/library_scratch.py``)."""
    def status(key: str) -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        base = status("VmRSS:")
        return lambda: status("VmHWM:") - base
    except OSError:
        return None
