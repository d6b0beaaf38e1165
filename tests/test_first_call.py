"""``benchmarks.first_call``: a script's first call, plain and rewritten, each in a fresh process."""

from __future__ import annotations

import json
import pathlib

from benchmarks import first_call


def _row(program: str, variant: str, seconds: float, import_s: float = 0.0) -> dict:
    return {"program": program, "variant": variant, "seconds": seconds, "import_s": import_s}


def test_the_extra_is_each_runs_rewritten_call_less_its_plain_one_and_the_verdict_is_on_its_median():
    rows = [_row("a", "plain", 1.0), _row("a", "rewritten", 1.5, 0.4),
            _row("a", "rewritten", 2.5, 0.5), _row("a", "plain", 1.2),  # run 2: extra 1.3, over 1.0x
            _row("a", "plain", 0.8), _row("a", "rewritten", 1.2, 0.6),
            _row("b", "plain", 0.2), _row("b", "rewritten", 0.5)]
    a, b = first_call.aggregate(rows)
    assert (a["program"], a["n"], a["over"]) == ("a", 3, 1)
    assert abs(a["extra_s"] - 0.5) < 1e-12  # extras 0.5, 1.3, 0.4
    assert abs(a["ratio"] - 0.5) < 1e-12 and abs(a["ratio_max"] - 1.3 / 1.2) < 1e-12  # 0.5, 1.08, 0.5
    assert (a["plain_s"], a["rewritten_s"], a["import_s"]) == (1.0, 1.5, 0.5)
    assert abs(b["ratio"] - 1.5) < 1e-12 and b["over"] == 1
    text = first_call.markdown([a, b], 3, "identity", (1.0, 1.0, 1.0))
    assert "**1 of 2** at or under 1.0x" in text
    assert "| a | 1.00 | 1.50 | 0.50 | 0.50x | 0.50-1.08x | 1 of 3 | 0.50 |" in text
    assert "| b | 0.20 | 0.50 | 0.30 | **1.50x** |" in text


def test_each_first_call_is_a_fresh_process_with_a_primed_cache_and_plain_and_rewritten_alternate(monkeypatch,
                                                                                                 tmp_path):
    calls = []

    def fake_run(cmd, check, env):
        calls.append((cmd, env["JAX_REWRITE_CACHE_DIR"]))
        if "--child" not in cmd:  # the priming process: the packs imported once, their marks kept
            pathlib.Path(env["JAX_REWRITE_CACHE_DIR"]).mkdir(parents=True)
            (pathlib.Path(env["JAX_REWRITE_CACHE_DIR"]) / "mark").write_text("passed")
            return
        assert (pathlib.Path(env["JAX_REWRITE_CACHE_DIR"]) / "mark").exists()  # a copy of the primed cache
        variant = cmd[cmd.index("--variant") + 1]
        out = pathlib.Path(cmd[cmd.index("--json") + 1])
        out.write_text(json.dumps(_row(cmd[cmd.index("--child") + 1], variant, 1.0 if variant == "plain" else 1.4)))

    monkeypatch.setattr(first_call.subprocess, "run", fake_run)
    report = tmp_path / "report.md"
    rows = first_call.main(["--programs", "x,y", "--runs", "2", "--out", str(report)])
    children = [(c, d) for c, d in calls if "--child" in c]
    assert len(calls) == 9 and "--child" not in calls[0][0]  # primed first, then two pairs a program
    assert [(c[c.index("--child") + 1], c[c.index("--variant") + 1]) for c, _ in children] == [
        ("x", "plain"), ("x", "rewritten"), ("x", "rewritten"), ("x", "plain"),
        ("y", "plain"), ("y", "rewritten"), ("y", "rewritten"), ("y", "plain")]
    assert len({d for _, d in children}) == 8  # a cache of its own each
    assert [r["program"] for r in rows] == ["x", "y"] and all(abs(r["extra_s"] - 0.4) < 1e-12 for r in rows)
    assert "2 runs" in report.read_text()


def test_a_child_times_one_first_call_in_its_own_process(tmp_path):
    out = tmp_path / "row.json"
    (row,) = first_call.main(["--child", "lineax_cg_solve", "--variant", "plain", "--json", str(out)])
    assert json.loads(out.read_text()) == row and row["variant"] == "plain" and row["seconds"] > 0
