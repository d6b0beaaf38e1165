"""``benchmarks.rewrite_time --runs N``: the verdict on the medians of N fresh processes, not on one draw."""

from __future__ import annotations

import json
import pathlib

import pytest

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


def test_a_gradient_case_whose_output_is_not_a_loss_is_held_to_what_a_vjp_caller_compiles():
    """``--set corpus`` holds ``jax.vjp(rewrite(seed))`` (outputs of the inputs' shape) to XLA's compile of what a
    caller of ``jax.vjp`` runs: the outputs, and the pullback at cotangents given as arguments; a scalar loss to
    ``jax.grad``'s, as the ecosystem suite's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import ecosystem

    f = lambda x, a, n: jnp.sin(a * x) ** 2 * n  # noqa: E731  (an integer input: no gradient)
    leaves = [jnp.linspace(-1.0, 1.0, 6).reshape(3, 2), jnp.array([0.5, 2.0]), jnp.array(3)]
    fn, args = rewrite_time.xla_program(ecosystem.Program("p", "l", "k", lambda: None, grad=True), f, leaves)
    assert len(args) == 4 and args[3].shape == (3, 2)  # the cotangent, an argument
    ct = jnp.arange(6.0).reshape(3, 2)
    out, grads = jax.jit(fn)(*leaves, ct)
    want, pull = jax.vjp(lambda x, a: f(x, a, leaves[2]), *leaves[:2])
    np.testing.assert_allclose(out, want)
    for g, w in zip(grads, pull(ct)):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    loss = lambda x, a: jnp.sum(jnp.sin(a * x))  # noqa: E731
    fn, args = rewrite_time.xla_program(ecosystem.Program("p", "l", "k", lambda: None, grad=True), loss, leaves[:2])
    assert args == leaves[:2] and len(fn(*args)) == 2
    plain = ecosystem.Program("p", "l", "k", lambda: None)
    assert rewrite_time.xla_program(plain, loss, leaves[:2]) == (loss, leaves[:2])


def test_the_sets_are_the_corpus_own_programs_and_the_full_size_steps():
    """``--set corpus``: the decision corpus's forward and gradient cases, not its hand-written pairs nor its
    ecosystem cases (the suite's own); ``--set wholestep``: every step of ``benchmarks.wholestep``."""
    from benchmarks import decisions, wholestep

    corpus = rewrite_time.programs_of("corpus")
    modes = {c.name: c.mode for c in decisions.cases()}
    assert corpus and all(modes[n] in ("forward", "grad") and not n.startswith("ecosystem_") for n in corpus)
    assert corpus["seed000_vjp_T64"].grad and not corpus["seed000_forward_T512"].grad
    steps = rewrite_time.programs_of("wholestep")
    assert sorted(steps) == sorted(f"wholestep_full_{n}" for n in wholestep.CASES)
    with pytest.raises(ValueError, match="no program set"):
        rewrite_time.programs_of("nope")
