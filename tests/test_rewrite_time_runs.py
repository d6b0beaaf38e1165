"""``benchmarks.rewrite_time --runs N``: the verdict on the medians of N fresh processes, not on one draw."""

from __future__ import annotations

import json
import pathlib

from benchmarks import rewrite_time


def _row(program: str, compile_s: float, rewrite_s: float, cpu_s: float | None = None) -> dict:
    return {"program": program, "compile_s": compile_s, "rewrite_s": rewrite_s, "ratio": rewrite_s / compile_s,
            "compile_cpu_s": 1.5 * compile_s, "cpu_s": rewrite_s if cpu_s is None else cpu_s}


def test_each_program_is_reported_by_its_median_its_range_and_the_runs_over():
    runs = [[_row("a", 1.0, 0.9), _row("b", 0.2, 0.3)],
            [_row("a", 1.0, 1.2), _row("b", 0.25, 0.2)],
            [_row("a", 1.0, 0.8), _row("b", 0.2, 0.18)]]
    a, b = rewrite_time.aggregate(runs)
    assert (a["program"], a["n"], a["over"]) == ("a", 3, 1)
    assert abs(a["ratio"] - 0.9) < 1e-12 and (a["ratio_min"], a["ratio_max"]) == (0.8, 1.2)
    # b: ratios 1.5, 0.8, 0.9 -> median 0.9, once over; its seconds are medians of their own
    assert abs(b["ratio"] - 0.9) < 1e-12 and b["over"] == 1
    assert (b["compile_s"], b["rewrite_s"]) == (0.2, 0.2)
    assert abs(b["cpu_ratio"] - 0.6) < 1e-12  # 0.3 / 0.3, 0.2 / 0.375, 0.18 / 0.3
    text = rewrite_time.markdown_runs([a, b], 3, "identity", (1.0, 1.0, 1.0))
    assert "**2 of 2** at or under 1.0x, 0 of 2 in every run" in text
    assert "| a | 1.00 | 0.90 | 0.90x | 0.80-1.20x | 1 of 3 |" in text


def test_a_median_over_one_is_the_verdict_and_a_program_a_run_lost_counts_its_other_runs():
    runs = [[_row("a", 1.0, 1.1), _row("b", 1.0, 0.5)], [_row("a", 1.0, 1.3)], [_row("a", 1.0, 0.7)]]
    a, b = rewrite_time.aggregate(runs)
    assert a["ratio"] > 1 and a["over"] == 2 and b["n"] == 1
    text = rewrite_time.markdown_runs([a, b], 3, "identity", (1.0, 1.0, 1.0))
    assert "**1 of 2** at or under 1.0x, 1 of 2 in every run" in text and "| **1.10x** |" in text


def test_runs_are_fresh_processes_whose_rows_are_read_back(monkeypatch, tmp_path):
    calls = []

    def fake_run(cmd, check):  # each process writes its rows where --json says
        calls.append(cmd)
        out = pathlib.Path(cmd[cmd.index("--json") + 1])
        out.write_text(json.dumps([_row("a", 1.0, 0.5 + 0.25 * len(calls))]))

    monkeypatch.setattr(rewrite_time.subprocess, "run", fake_run)
    report = tmp_path / "report.md"
    rows = rewrite_time.main(["--programs", "a", "--runs", "3", "--out", str(report)])
    assert len(calls) == 3 and not any("--runs" in c for c in calls)  # each child runs once
    assert all(c[c.index("--out") + 1] == "" and c[1:3] == ["-m", "benchmarks.rewrite_time"] for c in calls)
    assert rows[0]["ratio"] == 1.0 and rows[0]["over"] == 1 and (rows[0]["ratio_min"], rows[0]["ratio_max"]) == (
        0.75, 1.25)
    assert "3 runs" in report.read_text()
