"""The compatibility layer over JAX's scan params (rewrite/ir/jaxapi.py): both layouts, and a clear error on others."""

import jax
import jax.numpy as jnp
import pytest

import rewrite
from rewrite.ir import jaxapi


def _scan_params():
    f = lambda c, x: jax.lax.scan(lambda c, x: (c + x, c * x), c, x)  # noqa: E731
    return jax.make_jaxpr(f)(0.0, jnp.ones(3)).eqns[0].params


def test_scan_counts_read_the_running_jax_layout_and_round_trip():
    params = _scan_params()
    assert jaxapi.scan_counts(params) == (0, 1)
    counted = jaxapi.scan_counted(params)
    assert (counted["num_consts"], counted["num_carry"]) == (0, 1)
    assert "ft_in" not in counted and "ft_out" not in counted
    back = jaxapi.scan_for_jax(counted)
    assert sorted(back) == sorted(params)
    assert jaxapi.scan_counts(back) == (0, 1)


def test_an_unknown_scan_layout_names_the_jax_version():
    params = {k: v for k, v in _scan_params().items() if k not in ("num_consts", "num_carry", "ft_in", "ft_out")}
    params["groups_in"] = (0, 1, 1)  # a layout no JAX this project knows uses
    with pytest.raises(jaxapi.UnsupportedJax, match=f"jax {jax.__version__}: scan's params"):
        jaxapi.scan_counts(params)


def test_loading_a_scan_of_an_unknown_layout_fails_clearly(monkeypatch):
    def f(c, x):
        return jax.lax.scan(lambda c, x: (c + x, c * x), c, x)

    monkeypatch.setattr(jaxapi, "scan_counts", lambda p: (_ for _ in ()).throw(jaxapi._unknown("scan's", p)))
    from rewrite.ir import primitives
    monkeypatch.setattr(primitives, "scan_counts", jaxapi.scan_counts)
    with pytest.raises(jaxapi.UnsupportedJax, match=jax.__version__):
        rewrite.rewrite(f, rulesets=[])(0.0, jnp.ones(3))
