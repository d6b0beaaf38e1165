"""``python -m benchmarks`` (``benchmarks/demo.py``) runs end to end and writes its report and plots."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from benchmarks import demo  # noqa: E402


def test_smoke_run_writes_report_and_plots(tmp_path, capsys):
    out = demo.main(["--smoke", "--out", str(tmp_path)])
    assert out == tmp_path
    report = (tmp_path / "demo.md").read_text()
    for png in ("demo_seed000_speedup.png", "demo_scan_memory.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
        assert f"]({png})" in report
    rows = json.loads((tmp_path / "demo.json").read_text())["rows"]
    assert len(rows) == 5  # seed000, seed001 forward and grad, rnn forward and grad
    for row in rows:
        names = list(row["variants"])
        assert names[0] == "standard" and "rewritten" in names and any(n.startswith("hand") for n in names)
        assert row["variants"]["standard"]["temp_bytes"] >= 0
        for name in names:  # every variant is in the report's table for its case
            assert f"| {name} |" in report
    for variant in (*demo.SEED000_VARIANTS, demo.AA):
        assert f"| {variant} |" in report
    assert "| A/A |" in report.splitlines()[report.splitlines().index("## Summary") + 2]  # the noise band's column
    # the explain section shows which rules fired
    assert "rules fired" in report and "lift_independent" in report
    assert "/work/" not in report and str(tmp_path) not in report  # nothing of this machine's paths
    captured = capsys.readouterr()
    assert "Summary" in captured.out and str(tmp_path) in captured.out  # prints where it wrote
    assert "compiling rewritten" in captured.err and "round 1/1" in captured.err  # progress, one line per step


def test_rejects_unknown_case(tmp_path):
    with pytest.raises(SystemExit):
        demo.main(["--smoke", "--cases", "nope", "--out", str(tmp_path)])


def test_wrong_variant_fails_loudly(tmp_path, monkeypatch):
    """A variant that disagrees with the standard program stops the demo before anything is timed."""
    build = demo._seed000

    def broken(T):
        args, vs = build(T)
        vs["rewritten"] = lambda x, a, g: tuple(2 * v for v in vs["standard"](x, a, g))
        return args, vs

    monkeypatch.setattr(demo, "_seed000", broken)
    with pytest.raises(SystemExit, match="rewritten differs"):
        demo.main(["--smoke", "--cases", "seed000", "--out", str(tmp_path), "--quiet"])
    assert not (tmp_path / "demo.md").exists()


def test_rewritten_results_keep_their_hand_written_notes(tmp_path):
    # `--write` regenerates a results file's table; the notes written beside it must survive (a run on
    # 2026-11-27 dropped 240 lines of them from benchmarks/results/attention.md)
    from benchmarks.harness import HAND_NOTES, write_results

    (tmp_path / "x.md").write_text(f"# old\n| old table |\n\n{HAND_NOTES} beside the table)\n- kept\n")
    write_results(tmp_path, "x", "Title", "How to read it.", 3, "| case |", ["| new row |"], [{"case": 1}])
    text = (tmp_path / "x.md").read_text()
    assert "| new row |" in text and "| old table |" not in text
    assert text.endswith(f"{HAND_NOTES} beside the table)\n- kept\n")
    write_results(tmp_path, "y", "Title", "", 3, "| case |", [], [])  # no old file: no notes
    assert HAND_NOTES not in (tmp_path / "y.md").read_text()
