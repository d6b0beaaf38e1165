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
from rewrite.cost.dot import ALIASED, MIN_CONTRACTION, canonical, copied, heads_between, library_dot, turns

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


#: flax's v^T p^T (``[b, k, h, d] x [b, h, q, k]``) at a batch of 1 (the long-context step), of 2, and with one head,
#: and a product whose scores are contracted in their major dimension: XLA copies ``p`` where a batch dimension is 1
#: (it drops it first), and reads it as stored where none is.
RIGHT = [
    ((1, 2048, 2, 64), (1, 2, 2048, 2048), (((1,), (3,)), ((0, 2), (0, 1))), True),
    ((1, 1024, 4, 32), (1, 4, 256, 1024), (((1,), (3,)), ((0, 2), (0, 1))), True),
    ((2, 2048, 1, 64), (2, 1, 2048, 2048), (((1,), (3,)), ((0, 2), (0, 1))), True),
    ((2, 2048, 2, 64), (2, 2, 2048, 2048), (((1,), (3,)), ((0, 2), (0, 1))), False),
    ((2, 1024, 4, 64), (2, 4, 1024, 1024), (((1,), (2,)), ((0, 2), (0, 1))), False),
]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's copies")
@pytest.mark.parametrize("a, b, dn, right", RIGHT)
def test_the_right_operand_is_copied_where_xla_copies_it(a, b, dn, right):
    a, b = jax.ShapeDtypeStruct(a, jnp.float32), jax.ShapeDtypeStruct(b, jnp.float32)
    hlo = jax.jit(lambda x, y: lax.dot_general(x, y, dn)).lower(a, b).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    assert ("fusion(%y" in entry) == right
    assert copied({"dimension_numbers": dn}, (a, b)) == (True, right)


def test_a_transposing_copy_of_the_scores_is_priced_as_it_runs():
    """The long-context step's v^T p^T (batch 1, two heads): XLA transposes ``p``, 2 x 2048 x 2048 floats, before
    the library product, a copy that reads rows of 8 KiB down a column; timed at 6.9-9.2 ns per element where the
    model priced it as two passes over its bytes (0.27 ns). With ``transpose_copy`` it is priced per element in
    place of those passes; ``v``'s copy (rows of 512 bytes) and a product whose copies keep their minor dimension
    are priced as before."""
    v = jax.core.ShapedArray((1, 2048, 2, 64), jnp.float32)
    p = jax.core.ShapedArray((1, 2, 2048, 2048), jnp.float32)
    params = {"dimension_numbers": (((1,), (3,)), ((0, 2), (0, 1)))}
    assert tuple(t == ALIASED for t in turns(params, (v, p))) == (False, True)
    node = NodeInfo("dot_general", "contract", params, (v, p), (jax.core.ShapedArray((1, 2, 64, 2048), jnp.float32),))
    off = AnalyticCost(transpose_copy=None, transpose_strided=None, spill=0.0)
    on = AnalyticCost(transpose_copy=7.0, transpose_strided=None, spill=0.0)
    assert on(node) - off(node) == pytest.approx(7.0 * p.size - 2 * off.byte * p.size * 4, rel=1e-9)
    # the blocked form's products (a block of 256 keys) and p v copy no scores down such a stride
    k = jax.core.ShapedArray((1, 256, 2, 64), jnp.float32)
    for dn, args, out in [((((3,), (3,)), ((0, 2), (0, 2))), (v, k), (1, 2, 2048, 256)),
                          ((((3,), (1,)), ((0, 1), (0, 2))), (p, v), (1, 2, 2048, 64))]:
        node = NodeInfo("dot_general", "contract", {"dimension_numbers": dn}, args,
                        (jax.core.ShapedArray(out, jnp.float32),))
        assert on(node) == off(node)


def test_a_copy_that_moves_the_minor_dimension_off_a_page_stride_is_priced_per_element():
    """The long-context step's ``v^T p^T``: XLA copies ``v`` (``[1, 2048, 2, 64]``) into ``[2, 64, 2048]`` too, a
    transpose down rows of 512 bytes (the strided regime: 3-9x a copy, 1.1-1.2 ns per element measured, h-spear's
    ``calibrate.py --transpose-strided-only``). With ``transpose_strided`` it is priced per element in place of
    two passes over its bytes; ``p``'s copy stays at ``transpose_copy``; a copy that keeps its minor dimension (``v``
    in ``p v``: the heads moved ahead of the keys) is priced as a copy still. Off (``None``) it is priced as before."""
    v = jax.core.ShapedArray((1, 2048, 2, 64), jnp.float32)
    p = jax.core.ShapedArray((1, 2, 2048, 2048), jnp.float32)
    params = {"dimension_numbers": (((1,), (3,)), ((0, 2), (0, 1)))}
    assert turns(params, (v, p)) == ("strided", "aliased")
    node = NodeInfo("dot_general", "contract", params, (v, p), (jax.core.ShapedArray((1, 2, 64, 2048), jnp.float32),))
    off = AnalyticCost(transpose_copy=7.0, transpose_strided=None, spill=0.0)
    on = AnalyticCost(transpose_copy=7.0, transpose_strided=1.2, spill=0.0)
    assert on(node) - off(node) == pytest.approx((1.2 - 2 * off.byte * 4) * v.size, rel=1e-9)
    pv = {"dimension_numbers": (((3,), (1,)), ((0, 1), (0, 2)))}  # p v: v copied to [2, 2048, 64], rows kept
    assert copied(pv, (p, v)) == (False, True) and turns(pv, (p, v)) == (None, None)
    node = NodeInfo("dot_general", "contract", pv, (p, v), (jax.core.ShapedArray((1, 2, 2048, 64), jnp.float32),))
    assert on(node) == off(node)
