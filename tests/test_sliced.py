"""``Match.sliced``: a matched term read as a program that computes it a block at a time along one axis.

A procedural rule reads the summand of ``sum(s, axis)`` sliced along the summed axis and rebuilds the sum as a
loop over blocks: values must equal the original's for every way the summand is written (elementwise work,
broadcasts, transposes, an ``iota`` mask, a product), the leaves must be what the walk reached, and a second
axis placed by ``Sliced.place`` must cut the same values."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

from rewrite import Pat, Ruleset, Sliced, explain, procedural, rewrite, rule
from rewrite.rules.sliced import Ref, Term, scalar_literal

BLOCK = 4
seen: list = []


@procedural
def blocked_sum(m):
    """sum(s, axis) -> a loop over blocks of ``BLOCK`` along the axis, each block computed from the sliced leaves."""
    (axis,) = m.params("r").axes
    s = m.sliced(m["s"], axis, limit={"dot_general": 1})
    if s is None or m["s"].shape[axis] % BLOCK or m["s"].shape[axis] == BLOCK:
        return None
    seen.append(s)
    n = m["s"].shape[axis] // BLOCK

    def fn(*leaves):
        def body(acc, j):
            return acc + jnp.sum(s.block(leaves, j * BLOCK, BLOCK), axis=axis), None
        return lax.scan(body, jnp.zeros(m.root.shape, m.root.dtype), jnp.arange(n))[0]

    return m.trace(fn, *s.leaves)


PACK = Ruleset("sliced", [rule(Pat("reduce_sum", Pat.var("s"), params="r"), blocked_sum, name="blocked_sum")],
               soundness="identity")

FORMS = {
    "elementwise": lambda x, y: jnp.sum(jnp.exp(x) * y + 1.0, axis=1),
    "broadcast": lambda x, y: jnp.sum(jnp.tanh(x) + y[0][None, :], axis=1),        # y's row read per block
    "transpose": lambda x, y: jnp.sum(jnp.swapaxes(x * 2.0, 0, 1) - y.T, axis=0),
    "iota_mask": lambda x, y: jnp.sum(jnp.where(jnp.arange(16)[None, :] >= jnp.arange(8)[:, None], x, -y), axis=1),
    "product": lambda x, y: jnp.sum(jnp.tanh(x[:, :4] @ y.T[:4, :]), axis=1),        # x read whole, y per block
}


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(sorted(FORMS)), st.integers(0, 2 ** 16))
def test_a_sum_rebuilt_block_by_block_keeps_its_values(form, seed):
    rng = np.random.default_rng(seed)
    x, y = (jnp.asarray(rng.standard_normal((8, 16)), jnp.float32) for _ in range(2))
    f = FORMS[form]
    seen.clear()
    report = explain(f, x, y, rulesets=[PACK])
    assert report.fired == {"blocked_sum": 1}, report.fired
    s = seen[0]
    assert isinstance(s, Sliced) and len(s.leaves) == len(s.leaf_axes)
    n = s.aval(s.out).shape[s.axis]
    assert all(a is None or leaf.shape[a] == n for leaf, a in zip(s.leaves, s.leaf_axes))
    assert any(a is not None for a in s.leaf_axes)  # something is read a block at a time
    g = rewrite(f, rulesets=[PACK], cache=False)
    for run in (lambda h: h, jax.jit):
        np.testing.assert_allclose(run(g)(x, y), f(x, y), rtol=1e-5, atol=1e-5)
    grads = lambda h: jax.grad(lambda x, y: jnp.sum(jnp.sin(h(x, y))), argnums=(0, 1))(x, y)
    for a, b in zip(grads(g), grads(f)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_leaves_value_place_and_limit():
    x, y = jnp.ones((8, 4)), jnp.ones((16, 4))
    seen.clear()
    explain(lambda x, y: jnp.sum(jnp.exp(x @ y.T) * 0.5 + x @ (2.0 * y).T, axis=1), x, y, rulesets=[PACK])
    (s,) = seen
    assert s.passed["dot_general"] == 1  # the limit: the second product is a leaf, sliced per block
    assert sorted((leaf.shape, a) for leaf, a in zip(s.leaves, s.leaf_axes) if leaf.ndim) == [
        ((8, 4), None), ((8, 16), 1), ((16, 4), 0)]
    rng = np.random.default_rng(0)
    leaves = [jnp.asarray(rng.standard_normal(leaf.shape), leaf.dtype) if leaf.literal is None
              else jnp.asarray(leaf.literal, leaf.dtype) for leaf in s.leaves]
    whole = s.value(leaves)
    assert whole.shape == (8, 16)
    np.testing.assert_allclose(s.block(leaves, jnp.int32(4), 4), whole[:, 4:8], rtol=1e-5, atol=1e-6)
    placed = s.place(0)  # the rows: a second axis, on the other side of the product
    assert placed is not None
    cut = [x if a is None or k is not None else lax.dynamic_slice_in_dim(x, 2, 3, axis=a)
           for x, a, k in zip(leaves, placed.leaf_axes, s.leaf_axes)]
    np.testing.assert_allclose(s.block(cut, jnp.int32(8), 4, placed.window(jnp.int32(2), 3)), whole[2:5, 8:12],
                               rtol=1e-5, atol=1e-6)
    assert s.place(1) is None  # the sliced axis itself lies on the side of the product it slices


def test_an_axis_the_walk_cannot_follow_is_a_leaf():
    seen.clear()
    explain(lambda x: jnp.sum(jnp.cumsum(x, axis=1) * 2.0, axis=1), jnp.ones((4, 8)), rulesets=[PACK])
    (s,) = seen
    assert [leaf.shape for leaf in s.leaves if leaf.ndim] == [(4, 8)] and 1 in s.leaf_axes  # cumsum's result, sliced
    with pytest.raises(AttributeError):
        s.leaves = ()  # a record: read, not changed


def test_readers_of_the_steps_say_what_a_value_is_made_of():
    """``Sliced.path_to``, ``axes_along``, ``literal``, ``position_axis``, ``positions_ge`` and ``exact_in`` on
    masked, scaled, biased logits ``where(rows >= cols, (k q^T)^T * 0.5 + b, -1e9)``, sliced along the keys."""
    def f(q, k, b):
        rows, cols = (lax.broadcasted_iota(jnp.int32, (8, 16), d) for d in (0, 1))
        return jnp.sum(jnp.where(rows >= cols, (k @ q.T).T * 0.5 + b.astype(jnp.float32), -1e9), axis=1)

    seen.clear()
    explain(f, jnp.ones((8, 4)), jnp.ones((16, 4)), jnp.ones((8, 16), jnp.bfloat16), rulesets=[PACK])
    (s,) = seen
    path = s.path_to("dot_general")
    steps = [s.steps[ref.index] for ref, _ in path]
    assert steps[-1].primitive.name == "dot_general" and path[-1][1] is None and path[0][0] == s.out
    assert all(s.steps[ref.index].args[i] == below for (ref, i), (below, _) in zip(path, path[1:]))
    assert s.axes_along(path)[0] == [1, 0]  # the logits' axes as the product's: transposed
    assert s.path_to("cumsum") is None
    select = next(step for step in steps if step.primitive.name == "select_n")
    assert s.literal(select.args[1]) == np.float32(-1e9) and s.literal(select.args[2]) is None
    compare = s.steps[select.args[0].index]
    assert compare.primitive.name == "ge" and [s.position_axis(a) for a in compare.args] == [0, 1]
    assert s.positions_ge(select.args[0], 0, 1) is True and s.positions_ge(select.args[0], 1, 0) is None
    scaled = next(step for step in steps if step.primitive.name == "mul")
    assert [s.literal(a) for a in scaled.args] == [None, 0.5]
    added = next(step for step in steps if step.primitive.name == "add")
    bias = next(a for a in added.args if not s.reads(a, "dot_general"))
    assert s.exact_in(bias, jnp.bfloat16) and not s.exact_in(added.args[0], jnp.bfloat16)


@pytest.mark.parametrize("scale, dtype, moves", [
    (lambda s: s / 8.0, jnp.float32, True), (lambda s: 0.125 * s, jnp.float32, True),
    (lambda s: s / 3.0, jnp.float32, True), (lambda s: s / 3.0, jnp.bfloat16, False),  # rounds a half-precision q
    (lambda s: s / 8.0, jnp.bfloat16, True), (lambda s: s / 0.5, jnp.float32, False),  # makes q larger
    (lambda s: s * 3.0, jnp.float32, False)])
def test_hoist_scale_applies_a_literal_scale_of_the_product_to_its_operand_read_whole(scale, dtype, moves):
    """``Sliced.hoist_scale``: the program with the scale on ``x`` (the product's operand read whole), given as a
    leaf after its own, computes each block as the original does; a scale that makes ``x`` larger, or rounds a
    half-precision ``x``, stays where it is."""
    seen.clear()
    x, y = (jnp.asarray(np.random.default_rng(i).standard_normal(s), dtype) for i, s in enumerate([(8, 4), (16, 4)]))
    explain(lambda x, y: jnp.sum(scale(x @ y.T), axis=1), x, y, rulesets=[PACK])
    (s,) = seen
    hoisted, added = s.hoist_scale()
    assert len(added) == moves and len(hoisted.leaves) == len(s.leaves) + moves
    if not moves:
        assert hoisted is s
        return
    (h,) = added
    assert s.leaf_axes[h.operand] is None and hoisted.leaf_axes[-1] is None and s.literal(Ref("leaf", h.scale))
    leaves = [x if leaf.shape == x.shape else y if leaf.shape == y.shape else jnp.asarray(leaf.literal, leaf.dtype)
              for leaf in s.leaves]
    got = hoisted.block(leaves + [h.of(leaves)], jnp.int32(4), 4)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(s.block(leaves, jnp.int32(4), 4), np.float32),
                               rtol=1e-6 if dtype == jnp.float32 else 1e-2)


def _arrays(s, named):
    """One array per leaf of ``s``: a literal's value, else the input of that shape and dtype in ``named``."""
    return [named[(leaf.shape, leaf.dtype)] if scalar_literal(leaf) is None else
            jnp.asarray(scalar_literal(leaf), leaf.dtype) for leaf in s.leaves]


SCALES = ["none", "mul", "div", "negative", "divided_by_s", "mul_by_array"]
TERMS = ["none", "add", "sub", "s_subtracted"]
MASKS = ["none", "ge", "lt_flipped", "scaled_after", "array", "after_term", "not_causal"]
AFFINE = st.fixed_dictionaries({"scale": st.sampled_from(SCALES), "term": st.sampled_from(TERMS),
                                "mask": st.sampled_from(MASKS), "transpose": st.booleans(),
                                "seed": st.integers(0, 2 ** 16)})
#: each way that is read, and each way that is declined beside ways that are read
EACH = [dict(scale=a, term=b, mask=c, transpose=t, seed=i) for i, (a, b, c, t) in enumerate([
    ("none", "add", "ge", True), ("mul", "sub", "lt_flipped", False), ("div", "none", "none", True),
    ("div", "add", "lt_flipped", False), ("negative", "add", "ge", False), ("divided_by_s", "none", "none", True),
    ("mul_by_array", "sub", "ge", False), ("mul", "s_subtracted", "ge", True), ("div", "add", "array", False),
    ("mul", "add", "after_term", True), ("mul", "none", "not_causal", False), ("div", "sub", "scaled_after", True)])]


@pytest.mark.parametrize("case", EACH, ids=lambda c: f"{c['scale']}-{c['term']}-{c['mask']}")
def test_affine_reads_each_way_of_writing_the_logits(case):
    check_affine(case)


@settings(max_examples=8, deadline=None)
@given(AFFINE)
def test_affine_reads_a_scaled_biased_masked_product_or_declines(case):
    check_affine(case)


def check_affine(case):
    """``Sliced.affine``: logits written as a product scaled by a positive literal, plus terms, under a mask that
    compares positions, read as ``where(mask, scale * product + terms, fill)``: the form recomputes the value from
    its parts (``Term.as_product`` lays a term out as the product); a negative scale, a division by the logits,
    a term the logits are subtracted from, a mask given as an array, a term added after the mask: ``None``."""
    def f(q, k, b, m):
        rows, cols = (lax.broadcasted_iota(jnp.int32, (8, 16), d) for d in (0, 1))
        s = (k @ q.T).T if case["transpose"] else q @ k.T
        s = {"none": s, "mul": 0.5 * s, "div": s / 4.0, "negative": s * -2.0, "divided_by_s": 2.0 / s,
             "mul_by_array": s * b}[case["scale"]]
        s = {"none": s, "add": s + b.astype(jnp.float32), "sub": s - b, "s_subtracted": b - s}[case["term"]]
        s = {"none": s, "ge": jnp.where(rows >= cols, s, -1e9), "lt_flipped": jnp.where(rows < cols, -jnp.inf, s),
             "scaled_after": jnp.where(rows >= cols, s, -1e9) * 0.5, "array": jnp.where(m, s, -1e9),
             "after_term": jnp.where(rows >= cols, s, -1e9) + b,
             "not_causal": jnp.where(rows + cols >= 3, s, -1e9)}[case["mask"]]
        return jnp.sum(s, axis=1)

    rng = np.random.default_rng(case["seed"])
    q, k, b = (jnp.asarray(rng.standard_normal(sh), jnp.float32) for sh in [(8, 4), (16, 4), (8, 16)])
    m = jnp.asarray(rng.random((8, 16)) < 0.5)
    seen.clear()
    explain(f, q, k, b, m, rulesets=[PACK])
    (s,) = seen
    form = s.affine("dot_general")
    declines = case["scale"] in ("negative", "divided_by_s", "mul_by_array") or case["term"] == "s_subtracted" or \
        case["mask"] in ("array", "after_term", "not_causal")
    assert (form is None) == declines, form
    if form is None:
        return
    assert s.steps[form.product.index].primitive.name == "dot_general"
    after = 0.5 if case["mask"] == "scaled_after" else 1.0  # a scale of the masked value scales all below it
    assert form.scale == after * {"none": 1.0, "mul": 0.5, "div": 0.25}[case["scale"]]
    assert [t.factor for t in form.terms] == {"none": [], "add": [after], "sub": [-after]}[case["term"]]
    leaves = _arrays(s, {((8, 4), q.dtype): q, ((4, 8), q.dtype): q.T, ((16, 4), k.dtype): k, ((8, 16), b.dtype): b})
    value = form.scale * s.value(leaves, form.product)
    for t in form.terms:
        value = value + t.factor * t.as_product(s.value(leaves, t.ref))
    if form.mask is not None:
        assert form.fill == {"ge": -1e9, "lt_flipped": -np.inf, "scaled_after": -5e8}[case["mask"]]
        a, c = form.mask  # kept where the position along the product's axis a >= along c
        pos = lambda d: lax.broadcasted_iota(jnp.int32, value.shape, d)
        value = jnp.where(pos(a) >= pos(c), value, form.fill)
    whole = s.value(leaves)
    np.testing.assert_allclose(Term(None, 1.0, whole.shape, form.axes).as_product(whole), value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_blocks_cut_both_axes_hoist_the_scale_and_keep_literals_constant(dtype):
    """``Sliced.blocks``: a block along the sliced axis and a window of a second one equals that part of the whole
    value, with the literal scale applied once, before the loop (``hoist``), and a literal scalar leaf (the mask's
    fill) a constant of the block, not read from its operand."""
    def f(q, k, b):
        rows, cols = (lax.broadcasted_iota(jnp.int32, (8, 16), d) for d in (0, 1))
        return jnp.sum(jnp.where(rows >= cols, (q @ k.T) / 8.0 + b, -1e9), axis=1)

    rng = np.random.default_rng(0)
    q, k, b = (jnp.asarray(rng.standard_normal(sh), dtype) for sh in [(8, 4), (16, 4), (8, 16)])
    seen.clear()
    explain(f, q, k, b, rulesets=[PACK])
    (s,) = seen
    leaves = _arrays(s, {((8, 4), q.dtype): q, ((16, 4), k.dtype): k, ((8, 16), b.dtype): b})
    whole = s.value(leaves)
    Window = collections.namedtuple("Window", "start size")
    for hoist in (False, True):
        blocks = s.blocks(0, hoist=hoist)  # the rows: on the other side of the product from the keys
        ready = blocks.prepare(leaves)
        assert len(ready) == len(leaves) + hoist and len(blocks.leaf_axes) == len(blocks.across_axes) == len(ready)
        assert s.blocks(1).across_axes is None  # the keys' own side of the product: not cut
        cut = [x if a is None or ka is not None else lax.dynamic_slice_in_dim(x, 2, 3, axis=a)
               for x, a, ka in zip(ready, blocks.across_axes, blocks.leaf_axes)]
        got = blocks.block(cut, Window(jnp.int32(8), 4), Window(jnp.int32(2), 3))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(whole[2:5, 8:12], np.float32),
                                   rtol=1e-5 if dtype == jnp.float32 else 1e-2, atol=1e-6)
        np.testing.assert_allclose(np.asarray(blocks.block(ready, Window(jnp.int32(4), 4)), np.float32),
                                   np.asarray(whole[:, 4:8], np.float32), rtol=1e-5 if dtype == jnp.float32 else 1e-2)
        jaxpr = jax.make_jaxpr(lambda *ls: blocks.block(ls, Window(jnp.int32(4), 4)))(*ready).jaxpr
        literals = [v for v, leaf in zip(jaxpr.invars, s.leaves) if leaf.shape == () and leaf.literal is not None]
        used = {id(a) for e in jaxpr.eqns for a in e.invars}
        assert literals and not any(id(v) in used for v in literals)  # each literal scalar: the block's constant
