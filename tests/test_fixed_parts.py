"""``benchmarks/fixed_parts.py``: the parts are exclusive (a part called inside another is not counted twice, so
they add up to the rewrite's CPU s with ``other``), and the wrappers are taken off again."""

import time

from benchmarks import fixed_parts as F


def _spin(seconds: float) -> None:
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


def test_a_part_called_inside_another_is_counted_once():
    parts = F.Parts()
    inner = parts.wrap("inner", lambda: _spin(0.02))

    def outer_fn():
        _spin(0.02)
        inner()

    parts.wrap("outer", outer_fn)()
    assert 0.015 < parts.seconds["inner"] < 0.04
    assert 0.015 < parts.seconds["outer"] < 0.04  # its own 0.02 s, not the inner's as well


def test_the_wrappers_are_taken_off_and_the_parts_add_up_to_the_rewrite():
    import rewrite.pipeline as P
    import rewrite.rules.saturate as S

    load, run = P._load_all, S.Engine.__dict__["run"]
    with F.Parts().wrapped() as parts:
        assert P._load_all is not load and S.Engine.__dict__["run"] is not run
        row = F.measure("lineax_cg_solve", [], parts)
    assert P._load_all is load and S.Engine.__dict__["run"] is run
    assert row["load"] > 0 and row["trace"] > 0
    named = sum(v for k, v in row.items() if k not in ("program", "xla", "cpu", "other"))
    assert abs(named + row["other"] - row["cpu"]) < 1e-9
    assert "lineax_cg_solve" in F.table([row])
