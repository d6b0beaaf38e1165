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


def test_a_vjp_s_residual_search_is_a_part_of_its_own():
    """A gradient program's residual search (``grad.vjp.choose_residuals``, its splits priced whole) is named, not
    left in ``other``; so is JAX's derivative of the loss as written (``grad.vjp.as_written_vjp``), as a joint trace."""
    import jax.numpy as jnp
    import numpy as np

    import rewrite.grad.vjp as V
    from rewrite import rewrite
    from rulesets.algebra import algebra

    def loss(x, w):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    x, w = np.ones((4, 8), np.float32), np.ones((8, 3), np.float32)
    search, written = V.choose_residuals, V.as_written_vjp
    with F.Parts().wrapped() as parts:
        assert V.choose_residuals is not search and V.as_written_vjp is not written
        rewrite(loss, rulesets=[algebra], cache=False).grad_result(x, w)
    assert V.choose_residuals is search and V.as_written_vjp is written
    assert "residual search" in parts.seconds, parts.seconds
