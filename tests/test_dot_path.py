"""The cost model knows which of XLA:CPU's two product paths a ``dot_general`` takes (``rewrite/cost/dot.py``)."""

import itertools

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from rewrite import AnalyticCost, NodeInfo
from rewrite.cost.dot import library_dot

H, M, K, N = 2, 512, 512, 64


def _product(lhs_t: bool, rhs_t: bool):
    a = (H, K, M) if lhs_t else (H, M, K)
    b = (H, N, K) if rhs_t else (H, K, N)
    dn = (((1 if lhs_t else 2,), (2 if rhs_t else 1,)), ((0,), (0,)))
    return jax.ShapeDtypeStruct(a, jnp.float32), jax.ShapeDtypeStruct(b, jnp.float32), dn


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's paths")
@pytest.mark.parametrize("lhs_t, rhs_t", list(itertools.product([False, True], [False, True])))
def test_library_path_is_what_xla_compiles(lhs_t, rhs_t):
    a, b, dn = _product(lhs_t, rhs_t)
    hlo = jax.jit(lambda x, y: lax.dot_general(x, y, dn)).lower(a, b).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    assert library_dot({"dimension_numbers": dn}, (a, b)) == ("ynn" in entry)
    assert library_dot({"dimension_numbers": dn}, (a, b)) == (not lhs_t)


def test_generic_path_is_priced_dearer():
    model = AnalyticCost()
    prices = []
    for lhs_t in (False, True):
        a, b, dn = _product(lhs_t, False)
        out = jax.ShapeDtypeStruct((H, M, N), jnp.float32)
        prices.append(model(NodeInfo("dot_general", "contract", {"dimension_numbers": dn}, (a, b), (out,))))
    assert prices[1] > 1.5 * prices[0]
    short = ((jax.ShapeDtypeStruct((H, 64, M), jnp.float32), jax.ShapeDtypeStruct((H, 64, N), jnp.float32)))
    assert library_dot({"dimension_numbers": (((1,), (1,)), ((0,), (0,)))}, short)  # a short contraction: alike


def test_batch_axes_aside():
    # flax's layout [B, N, H, D]: the heads are a batch axis in the middle; v contracts its key axis,
    # which comes before its free axis d: the generic path.
    v = jax.ShapeDtypeStruct((2, 2048, 8, 64), jnp.float32)
    p = jax.ShapeDtypeStruct((2, 8, 2048, 2048), jnp.float32)
    assert not library_dot({"dimension_numbers": (((1,), (3,)), ((0, 2), (0, 1)))}, (v, p))
    assert library_dot({"dimension_numbers": (((3,), (1,)), ((0, 1), (0, 2)))}, (p, v))
