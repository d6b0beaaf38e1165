"""``benchmarks/iterations.py``: each pipeline's saturation watched iteration by iteration, and cut at each
iteration to see whether the program extracted then is already the final one."""

from __future__ import annotations

from benchmarks import decisions, iterations as it
from rewrite import explain


def test_a_pipeline_is_measured_per_iteration_and_cut_at_each():
    """The watched rewrite is the unwatched one; its pipeline's iterations, rows and stop reason are the result's;
    the decision corpus's attention product (``linalg_00``: its products reassociated and factored over three
    iterations, the fourth finding nothing) cut after one or two iterations gives another program, after three the
    final one."""
    (case,) = decisions.select(["linalg_00_attention_b_2_h_4_n_2048_d_64"])
    fn, args = case.build()
    plain = explain(fn, *args, rulesets=decisions.packs())
    with it.watched() as found:
        watched = explain(fn, *args, rulesets=decisions.packs())
    assert str(watched.after) == str(plain.after)
    (p,) = found
    res = watched.result
    assert (p.kind, p.stopped, p.iterations, p.rows[-1]) == ("run", res.stopped, res.iterations, res.rows)
    assert len(p.same) == p.iterations - 1 and len(p.seconds) == len(p.fired) == p.iterations
    assert (p.same, p.final_from, p.stopped) == ([False, False, True], 3, "saturated"), p
    assert not p.fired[-1] and all(p.fired[:-1])
    assert p.seconds_after_final == sum(p.seconds[3:])
    assert "| linalg | 0 | run | saturated | 4/30 |" in it.table([("linalg", 0, p)])
