"""The cost model knows which of XLA:CPU's two product paths a ``dot_general`` takes (``rewrite/cost/dot.py``)."""

import itertools
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from rewrite import AnalyticCost, NodeInfo
from rewrite.cost.dot import MIN_CONTRACTION, canonical, copied, heads_between, library_dot

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


def _penalty(model, batch, k, m, n):
    """The model's price of a product with its left operand stored ``[K, M]`` over the same stored ``[M, K]``."""
    lead = (batch,) if batch else ()
    b = (0,) if batch else ()
    c = 1 if batch else 0
    rhs = jax.ShapeDtypeStruct(lead + (k, n), jnp.float32)
    out = jax.ShapeDtypeStruct(lead + (m, n), jnp.float32)
    prices = []
    for major in (False, True):
        lhs = jax.ShapeDtypeStruct(lead + ((k, m) if major else (m, k)), jnp.float32)
        dn = (((c if major else c + 1,), (c,)), (b, b))
        prices.append(model(NodeInfo("dot_general", "contract", {"dimension_numbers": dn}, (lhs, rhs), (out,))))
    return prices[1] / prices[0]


def test_generic_path_is_priced_dearer():
    model = AnalyticCost()
    assert _penalty(model, H, K, M, N) > 1.5
    short = ((jax.ShapeDtypeStruct((H, 64, M), jnp.float32), jax.ShapeDtypeStruct((H, 64, N), jnp.float32)))
    assert library_dot({"dimension_numbers": (((1,), (1,)), ((0,), (0,)))}, short)  # a short contraction: alike


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's paths")
def test_generic_path_price_follows_the_measured_grid():
    # benchmarks/dot_paths.py timed both layouts of each product on this CPU: the model's ratio of the two is
    # within 2x of the measured one wherever the measurement's own A/A control was steady, plain or batched,
    # in a loop or not, at every contraction length it prices apart and output width, within 35% in the root mean square
    # of the log: a dense layer's weight gradient (N >= 1024) is about as fast either way, attention's
    # v^T p^T (N = 64) about three times slower.
    rows = json.loads((pathlib.Path(__file__).parent.parent / "benchmarks/results/dot_paths.json").read_text())["rows"]
    model = AnalyticCost(byte=0.0, spill=0.0, node=0.0)
    steady = [r for r in rows if 0.8 <= r["aa"] <= 1.25 and r["library_ms"] >= 0.3 and r["k"] >= MIN_CONTRACTION]
    assert len(steady) >= 20
    errors = []
    for r in steady:
        predicted = _penalty(model, r["batch"], r["k"], r["m"], r["n"])
        assert 1 / 2 <= predicted / r["penalty"] <= 2, (r, predicted)
        errors.append(math.log(predicted / r["penalty"]) ** 2)
    assert math.sqrt(sum(errors) / len(errors)) <= math.log(1.35)


def test_batch_axes_aside():
    # flax's layout [B, N, H, D]: the heads are a batch axis in the middle, which XLA's DotDecomposer does not
    # leave as written: it copies v into [B, H, D, N] first, and the product takes the library path.
    v = jax.ShapeDtypeStruct((2, 2048, 8, 64), jnp.float32)
    p = jax.ShapeDtypeStruct((2, 8, 2048, 2048), jnp.float32)
    assert library_dot({"dimension_numbers": (((1,), (3,)), ((0, 2), (0, 1)))}, (v, p))
    assert copied({"dimension_numbers": (((1,), (3,)), ((0, 2), (0, 1)))}, (v, p)) == (True, False)
    assert library_dot({"dimension_numbers": (((3,), (1,)), ((0, 1), (0, 2)))}, (p, v))


#: (left, right, dimension numbers): products XLA does not leave as written (DotDecomposer's IsCanonical) and one
#: it does, each with a left operand that contracts a major dimension as written.
LAYOUTS = [
    ((2, 2048, 8, 64), (2, 8, 2048, 2048), (((1,), (3,)), ((0, 2), (0, 1)))),  # flax's v^T p^T
    ((2, 1024, 2, 32), (2, 2, 256, 1024), (((1,), (3,)), ((0, 2), (0, 1)))),   # its cross-attention's
    ((4, 256, 64), (4, 256, 128), (((0, 1), (0, 1)), ((), ()))),              # two contracted axes
    ((512, 8, 64), (8, 512, 128), (((0,), (1,)), ((1,), (0,)))),              # the batch axis second
    ((8, 512, 64), (8, 512, 128), (((1,), (1,)), ((0,), (0,)))),              # as written: [B, K, M], generic
]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's paths")
@pytest.mark.parametrize("a, b, dn", LAYOUTS)
def test_a_product_xla_rewrites_takes_the_library_after_a_copy(a, b, dn):
    a, b = jax.ShapeDtypeStruct(a, jnp.float32), jax.ShapeDtypeStruct(b, jnp.float32)
    hlo = jax.jit(lambda x, y: lax.dot_general(x, y, dn)).lower(a, b).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    params = {"dimension_numbers": dn}
    assert ("ynn" in entry) == (not canonical(params, (a, b)))
    assert ("copy" in entry) == (not canonical(params, (a, b)))
    if heads_between(params, (a, b)) or canonical(params, (a, b)):  # two contracted axes: priced as fitted
        assert library_dot(params, (a, b)) == ("ynn" in entry)
        assert copied(params, (a, b))[0] == ("copy" in entry)
