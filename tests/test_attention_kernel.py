"""``rulesets.kernels.attention``: the blocked kernel alone equals plain softmax attention, values and gradients.

Hypothesis draws shapes (queries and keys of different lengths, broadcast batch axes), blocks of keys and of
queries, a scale, a bias, a mask and a causal mask, and a dtype; the kernel is compared with
``jax.nn.softmax(s) @ v`` written out, in float64 for a reference, under ``jit`` and eagerly, and its
gradients (``grad``, ``vjp``, under ``vmap``) with the plain form's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rulesets.kernels.attention import Scores, attention

#: rtol, atol by dtype, against the float64 reference, times the plain form's own error where that is larger.
TOL = {"float64": 1e-10, "float32": 3e-5, "bfloat16": 3e-2, "float16": 4e-3}


def plain(q, k, v, scores):
    """Softmax attention written out, the kernel's reference."""
    s = q @ jnp.swapaxes(k, -1, -2)
    if scores.scale is not None:
        s = s * jnp.asarray(scores.scale, s.dtype)
    if scores.bias is not None:
        s = s + scores.bias.astype(s.dtype)
    keep = scores.mask
    if scores.causal:
        tril = jnp.tril(jnp.ones(s.shape[-2:], bool))
        keep = tril if keep is None else keep & tril
    if keep is not None:
        s = jnp.where(keep, s, jnp.asarray(scores.fill, s.dtype))
    return jax.nn.softmax(s, axis=-1) @ v


CASES = st.fixed_dictionaries({
    "batch": st.sampled_from([(), (2,), (2, 3)]),
    "nq": st.sampled_from([16, 32, 48]),
    "nk": st.sampled_from([32, 64]),
    "d": st.sampled_from([4, 8]),
    "block": st.sampled_from([8, 16]),
    "query_block": st.sampled_from([None, 8, 16]),
    "scale": st.sampled_from([None, 0.25, 0.3]),
    "bias": st.sampled_from([None, "full", "keys"]),   # [Nq, Nk], or [1, Nk] broadcast over the queries
    "mask": st.sampled_from([None, "random", "padding"]),
    "causal": st.booleans(),
    "fill": st.sampled_from([-np.inf, "finfo"]),
    "seed": st.integers(0, 2 ** 16),
})


def draw(case, dtype):
    rng = np.random.default_rng(case["seed"])
    b, nq, nk, d = case["batch"], case["nq"], case["nk"], case["d"]
    q, k, v = (jnp.asarray(rng.standard_normal(b + (n, d)), dtype) for n in (nq, nk, nk))
    bias = None if case["bias"] is None else jnp.asarray(
        rng.standard_normal((nq if case["bias"] == "full" else 1, nk)), dtype)
    mask = None
    if case["mask"] is not None:
        mask = rng.random((nq, nk)) < 0.7
        mask[:, 0] = True  # no row masked everywhere: the NaN rows are checked apart
        if case["mask"] == "padding":
            mask[:, nk // 2:] = False
        mask = jnp.asarray(mask)
    fill = jnp.finfo(dtype).min if case["fill"] == "finfo" else case["fill"]
    return q, k, v, Scores(scale=case["scale"], bias=bias, mask=mask, causal=case["causal"], fill=float(fill))


def wide(x):
    return None if x is None else (x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x)


def check(new, old, ref, dtype):
    """``new`` within the dtype's tolerance of ``ref``, or within twice ``old``'s own error (half precision)."""
    new, old, ref = (np.asarray(x, np.float64) for x in (new, old, ref))
    assert np.array_equal(np.isnan(new), np.isnan(ref))
    ok = ~np.isnan(ref)
    scale = max(1.0, float(np.abs(ref[ok]).max(initial=0.0)))
    err_new, err_old = (float(np.abs(x - ref)[ok].max(initial=0.0)) for x in (new, old))
    assert err_new <= 2 * err_old + TOL[jnp.dtype(dtype).name] * scale, (err_new, err_old)


@settings(max_examples=max(8, settings.default.max_examples // 3), deadline=None)
@given(CASES, st.sampled_from(["float32", "bfloat16", "float16", "float64"]))
def test_values_and_gradients_are_plain_attention_s(case, dtype):
    with jax.enable_x64(dtype == "float64"):
        q, k, v, scores = draw(case, jnp.dtype(dtype))
        qb = case["query_block"] if case["nq"] % (case["query_block"] or 1) == 0 else None
        blocked = lambda q, k, v: attention(q, k, v, scores=scores, block=case["block"], query_block=qb)
        with jax.enable_x64(True):
            ref_scores = Scores(case["scale"], wide(scores.bias), scores.mask, scores.causal, scores.fill)
            operands = [wide(x) for x in (q, k, v)]
            shape = jax.eval_shape(lambda q, k, v: plain(q, k, v, ref_scores), *operands).shape
            ct = jnp.asarray(np.random.default_rng(1).standard_normal(shape))
            # compiled (op by op, the float64 reference's VJP was 1.3-1.7 s of CPU an example, each new shape's
            # operations compiled one at a time; compiled 0.2-0.4 s), its value and VJP in one program
            ref, ref_grads = value_and_vjp(lambda q, k, v: plain(q, k, v, ref_scores), *operands, ct=ct)
        cot = ct.astype(dtype)
        new, new_grads = value_and_vjp(blocked, q, k, v, ct=cot)
        old, old_grads = value_and_vjp(lambda q, k, v: plain(q, k, v, scores), q, k, v, ct=cot)
        check(new, old, ref, dtype)
        for a, b, r in zip(new_grads, old_grads, ref_grads):
            check(a, b, r, dtype)


def value_and_vjp(f, *args, ct):
    """``jax.jit(f)(*args)`` and ``f``'s VJP at ``ct`` (the pullback of ``jax.vjp``) as one compiled program: the
    call itself (for the kernel, its ``custom_vjp``'s primal, not the VJP's forward) beside the pullback, so one
    compile an example, not two."""
    return jax.jit(lambda *a: (f(*a), jax.vjp(f, *a)[1](ct)))(*args)


def test_eagerly_under_grad_and_vmap():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((3, n, 8)), jnp.float32) for n in (24, 32, 32))
    bias = jnp.asarray(rng.standard_normal((24, 32)), jnp.float32)
    scores = Scores(scale=0.5, bias=bias, causal=True)
    loss = lambda f: (lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))))
    blocked = lambda q, k, v: attention(q, k, v, scores=scores, block=8, query_block=8)
    ref = lambda q, k, v: plain(q, k, v, scores)
    np.testing.assert_allclose(blocked(q, k, v), ref(q, k, v), rtol=1e-5, atol=1e-5)  # eagerly
    for got, want in zip(jax.grad(loss(blocked), (0, 1, 2))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    per_row = lambda f: jax.vmap(jax.grad(loss(f), (0, 1, 2)))(q, k, v)  # each batch row alone
    for got, want in zip(per_row(blocked), per_row(ref)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_rows_masked_everywhere_are_nan_as_in_jax_nn_softmax():
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((16, 4)), jnp.float32) for _ in range(3))
    mask = np.ones((16, 16), bool)
    mask[2] = False
    mask[5, :8] = False  # masked in the first block only
    for fill in (-np.inf, float(np.finfo(np.float32).min)):
        scores = Scores(mask=jnp.asarray(mask), fill=fill)
        got, want = attention(q, k, v, scores=scores, block=8), plain(q, k, v, scores)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.isnan(np.asarray(attention(q, k, v, scores=Scores(mask=jnp.asarray(mask)), block=8))[2]).all()


def test_only_a_block_of_scores_is_held():
    """At N=2048 the forward's temporaries hold blocks of scores, not the N x N scores plain attention holds."""
    x = jnp.zeros((1, 2048, 16), jnp.float32)
    temp = lambda f: jax.jit(f).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes
    blocked = temp(lambda q, k, v: attention(q, k, v, scores=Scores(scale=0.25), block=256, query_block=512))
    assert blocked < 2048 * 2048 * 4 // 8 < temp(lambda q, k, v: plain(q, k, v, Scores(scale=0.25)))


def test_the_backward_holds_blocks_of_queries_by_keys():
    """With a query block the backward recomputes the scores a block of queries by a block of keys: its
    temporaries hold a few ``[query_block, block]`` blocks, not ``[Nq, block]`` ones."""
    x = jnp.zeros((1, 2048, 16), jnp.float32)

    def temp(query_block):
        f = lambda q, k, v: jnp.sum(attention(q, k, v, scores=Scores(scale=0.25), block=256, query_block=query_block))
        return jax.jit(jax.grad(f, (0, 1, 2))).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    rows_block = 2048 * 256 * 4  # one block of every query's scores
    assert temp(256) < rows_block < temp(None)


def test_blocks_must_divide_the_axes():
    x = jnp.zeros((24, 4))
    with pytest.raises(ValueError, match="blocks of"):
        attention(x, x, x, block=16)


@settings(max_examples=6, deadline=None)
@given(st.permutations(range(5)), st.permutations(range(4)), st.permutations(range(4)), st.permutations(range(5)),
       st.sampled_from([(2, 1), (1, 2), (2, 2)]), st.booleans(), st.booleans(),
       st.sampled_from(["float32", "bfloat16"]))  # XLA:CPU has no float16 product with a float32 sum
def test_fused_attention_in_any_layout_is_plain_attention(q_perm, k_perm, v_perm, out, heads, causal, biased, dtype):
    """``fused_attention`` (``implementation="xla"``) with its operands and result in any order of axes,
    grouped query heads, a bias and a causal mask: values and the query's gradient as softmax attention
    written out in float32, rounded once."""
    from rulesets.kernels.attention import FusedAxes, fused_attention
    n1, g = heads
    biased = biased and g == 1  # a bias over grouped heads is not the call's
    b0, t, h = 2, 16, 8
    keys = jax.random.split(jax.random.key(sum(q_perm) + 7 * n1 + g), 4)
    q5 = jax.random.normal(keys[0], (b0, t, n1, g, h), dtype)
    k4, v4 = (jax.random.normal(kk, (b0, t, n1, h), dtype) for kk in keys[1:3])
    bias = jax.random.normal(keys[3], (b0, t, n1, t), dtype) if biased else None
    inv = lambda p: tuple(int(i) for i in np.argsort(p))  # noqa: E731
    axes = FusedAxes(q=inv(q_perm), k=inv(k_perm), v=inv(v_perm), bias=(0, 1, 2, 3), out=tuple(out))

    def call(q):
        return fused_attention(q, k4.transpose(k_perm), v4.transpose(v_perm), bias, axes=axes, scale=0.3,
                               causal=causal, implementation="xla")

    def plain_(q):
        q = q.transpose(inv(q_perm)).astype(jnp.float32)
        s = jnp.einsum("btngh,bsnh->bngts", q, k4.astype(jnp.float32)) * 0.3
        if biased:
            s = s + bias.astype(jnp.float32).transpose(0, 2, 1, 3)[:, :, None]
        if causal:
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        o = jnp.einsum("bngts,bsnh->btngh", jax.nn.softmax(s, axis=-1), v4.astype(jnp.float32))
        return o.transpose(out).astype(dtype)

    q = q5.transpose(q_perm)
    tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    # each compiled, its value and the query's gradient in one program (the reference op by op was 2-2.5 s of CPU an
    # example, compiled 0.7-0.9; the call's gradient op by op compiled each of its operations for each new layout)
    grad = lambda f: jax.grad(lambda q: f(q).astype(jnp.float32).sum())  # noqa: E731
    both = lambda f: jax.jit(lambda q: (f(q), grad(f)(q)))(q)  # noqa: E731
    (got, got_grad), (want, want_grad) = both(call), both(plain_)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got_grad, np.float32), np.asarray(want_grad, np.float32),
                               rtol=10 * tol, atol=10 * tol)


#: Attention as two ``dot_general`` products: (scores' dimension numbers, q on the left, the logits' axes as the
#: scores', the weights' product's dimension numbers, weights first, a causal mask over the logits' last two axes).
LAYOUTS = {
    "flax": ((((3,), (3,)), ((0, 2), (0, 2))), True, (0, 1, 2, 3), (((3,), (1,)), ((0, 1), (0, 2))), True, False),
    "flax_causal": ((((3,), (3,)), ((0, 2), (0, 2))), True, (0, 1, 2, 3), (((3,), (1,)), ((0, 1), (0, 2))), True,
                    True),
    "q_right_v_first": ((((3,), (3,)), ((0, 2), (0, 2))), False, (0, 1, 3, 2), (((1,), (3,)), ((0, 2), (0, 1))),
                        False, True),
    "no_batch": ((((1,), (1,)), ((), ())), True, (0, 1), (((1,), (0,)), ((), ())), True, False),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_fused_axes_maps_attention_written_as_two_products(name):
    """``fused_axes`` reads the two products' dimension numbers; ``fused_attention`` in that layout computes what
    the products and a softmax between them compute."""
    from jax import lax

    from rulesets.kernels.attention import ValueProduct, fused_attention, fused_axes
    qk, q_left, logits_axes, pv, weights_first, causal = LAYOUTS[name]
    rank = len(logits_axes)
    q_shape, k_shape = ((2, 16, 3, 8), (2, 16, 3, 8)) if rank == 4 else ((16, 8), (16, 8))
    q, k, v = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate((q_shape, k_shape, k_shape)))
    scores = lax.dot_general(q, k, qk) if q_left else lax.dot_general(k, q, qk)
    logits = jnp.transpose(scores, logits_axes) * 0.5
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    want = lax.dot_general(weights, v, pv) if weights_first else lax.dot_general(v, weights, pv)
    v_key = pv[0][1][0] if weights_first else pv[0][0][0]
    product = ValueProduct(weights_first, pv, {}, v_key, jax.ShapeDtypeStruct(want.shape, want.dtype))
    key_axis = logits_axes[-1]
    query_axis = logits_axes[-2] if causal else None
    found = fused_axes(qk, scores.shape, (len(q_shape), len(k_shape)), key_axis, logits_axes, product,
                       causal_axis=query_axis)
    assert found is not None and found[1] == q_left
    got = fused_attention(q, k, v, axes=found[0], scale=0.5, causal=causal, implementation="xla")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # a causal mask over queries and keys of different lengths: how a kernel aligns it varies, so it is refused
    longer = tuple(32 if d == logits_axes[-2] else n for d, n in enumerate(scores.shape))
    assert fused_axes(qk, longer, (len(q_shape), len(k_shape)), key_axis, logits_axes, product,
                      causal_axis=logits_axes[-2]) is None


def test_value_product_of_a_programs_product_and_its_query_axis():
    """``ValueProduct.of`` records a program's ``dot_general`` of the weights and ``v`` (either first, the
    weights rounded and squeezed): its output as the product computes it and ``v``'s key axis;
    ``query_axis`` is the weights' longest free axis, as the logits'."""
    from jax import lax

    from rulesets.kernels.attention import ValueProduct
    logits = jax.ShapeDtypeStruct((1, 4, 32, 16), jnp.float32)   # [1, h, q, k], the batch of one squeezed
    v = jax.ShapeDtypeStruct((4, 16, 8), jnp.bfloat16)             # [h, k, d]
    dn = (((2,), (1,)), ((0,), (0,)))
    p = ValueProduct.of(True, {"dimension_numbers": dn, "precision": None, "preferred_element_type": None,
                               "unrelated": 1}, logits, v, cast=jnp.bfloat16, squeezed=(0,))
    want = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dn), jax.ShapeDtypeStruct((4, 32, 16), jnp.bfloat16), v)
    assert (p.out.shape, p.out.dtype, p.v_key, p.squeezed, "unrelated" in p.params) == (
        want.shape, want.dtype, 1, (0,), False)
    assert p.query_axis(logits.shape) == 2
    # v first, the weights' free axes a group of 2 heads beside 32 queries: the queries are the longer
    grouped = jax.ShapeDtypeStruct((4, 2, 32, 16), jnp.float32)  # [h, g, q, k]
    vg = jax.ShapeDtypeStruct((4, 16, 8), jnp.float32)
    dn_vp = (((1,), (3,)), ((0,), (0,)))
    q = ValueProduct.of(False, {"dimension_numbers": dn_vp}, grouped, vg)
    assert q.v_key == 1 and q.out.shape == (4, 8, 2, 32) and q.query_axis(grouped.shape) == 2
    assert ValueProduct.of(True, {"dimension_numbers": (((0,), (0,)), ((), ()))}, jax.ShapeDtypeStruct(
        (1, 16), jnp.float32), jax.ShapeDtypeStruct((16, 8), jnp.float32), squeezed=(0,)).query_axis((1, 16)) is None


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from([64, 128, 256, 512]), min_size=1, max_size=3, unique=True),
       st.lists(st.sampled_from([64, 128, 512]), max_size=2, unique=True), st.booleans(),
       st.sampled_from([None, 128, 512]), st.sampled_from([256, 512, 768, 1024]), st.sampled_from([0, 256, 1024]))
def test_blocking_offers_each_loop_whose_blocks_divide_the_axes_in_two_or_more(blocks, query_blocks, whole, back,
                                                                                keys, queries):
    """``Blocking.offers``: one loop per key block that makes two blocks or more, each over every query at once
    (where asked, or where no query block fits) and over each query block that makes two or more; the
    backward's query block where it makes two or more (no queries, 0: none fits)."""
    from rulesets.kernels.attention import Blocking, Offer

    fits = lambda b, n: b is not None and n % b == 0 and n // b >= 2
    offers = Blocking(tuple(blocks), tuple(query_blocks), whole, back).offers(keys, queries)
    q_fit = [b for b in query_blocks if fits(b, queries)]
    assert sorted(offers, key=str) == sorted(
        [Offer(b, qb, back if fits(back, queries) else None) for b in blocks if fits(b, keys)
         for qb in ([None] if whole or not q_fit else []) + q_fit], key=str)
    assert len(set(offers)) == len(offers) and all(isinstance(o, Offer) for o in offers)
    assert Blocking().offers(1024, 1024) == [Offer(256, None, 512), Offer(256, 512, 512)]
    assert Blocking().offers(256, 1024) == []  # one block of keys: nothing to loop over


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([512, 1024, 2048, 4096]), st.sampled_from([0, 512, 1024, 2048, 4096]),
       st.sampled_from([1, 2, 8, 32]), st.sampled_from([(1, 4), (2, 8), (4, 16), (0.25, 0.5)]), st.booleans())
def test_the_scores_band_offers_the_loops_whose_scores_fit_or_the_nearest(keys, queries, heads, band_mib, whole):
    """``Blocking.offers`` with a ``band``: of the loops it offers without one, those whose block of scores (one
    trip's, float32: its rows by the key block) is within the band; where none is, the one nearest it (by the ratio
    to the band's geometric middle); every loop where the rows are not known."""
    from rulesets.kernels.attention import Blocking

    lo, hi = (x * 2 ** 20 for x in band_mib)
    rows = heads * (queries or 1024)
    plain = Blocking((128, 256, 512, 1024), (512,), whole, 512)
    banded = Blocking((128, 256, 512, 1024), (512,), whole, 512, (lo, hi))
    every = plain.offers(keys, queries)
    got = banded.offers(keys, queries, rows)
    assert banded.offers(keys, queries) == every  # no rows: no band
    size = lambda o: Blocking.scores_bytes(o, queries, rows)  # noqa: E731
    inside = [o for o in every if lo <= size(o) <= hi]
    if inside:
        assert got == inside
    elif every:
        assert len(got) == 1 and got[0] in every
        mid = (lo * hi) ** 0.5
        assert all(abs(np.log(size(got[0]) / mid)) <= abs(np.log(size(o) / mid)) for o in every)
    else:
        assert got == []
    for o in got:
        want = 4 * o.block * (rows if o.query_block is None else rows // queries * o.query_block)
        assert size(o) == want


def test_the_band_offers_the_blocks_whose_scores_are_3_to_8_mib():
    """``attention_with(blocks=BLOCKS, scores_band=SCORES_BAND)`` offers 128-1024 keys, over every query and over
    query blocks of 512, where a trip's block of scores is 3-8 MiB, for the model to choose among: at ``[2, 4, 2048]`` (16K rows) 128 keys over every
    query and 256 and 512 over query blocks; at one head of 4096, 256 and 512 over every query (not 1024 over query
    blocks, 2 MiB); at ``[2, 4, 1024]`` four; a small attention, whose loops all hold less, the one nearest."""
    from rulesets.attention import BLOCKS, SCORES_BAND
    from rulesets.kernels.attention import Blocking, Offer

    assert SCORES_BAND == (3 * 2 ** 20, 8 * 2 ** 20) and BLOCKS == (128, 256, 512, 1024)
    b = Blocking(BLOCKS, (512,), True, 512, SCORES_BAND)
    assert b.offers(2048, 2048, 2 * 4 * 2048) == [Offer(128, None, 512), Offer(256, 512, 512), Offer(512, 512, 512)]
    assert b.offers(4096, 4096, 4096) == [Offer(256, None, 512), Offer(512, None, 512)]
    assert b.offers(1024, 1024, 2 * 4 * 1024) == [Offer(128, None, 512), Offer(256, None, 512), Offer(256, 512, 512),
                                                   Offer(512, 512, 512)]
    assert b.offers(512, 512, 2 * 512) == [Offer(256, None, None)]


def test_value_product_contracts_the_weights_along_the_key_axis_alone():
    """``ValueProduct.contracts``: the weights' product with ``v`` contracts them along the logits' key axis (as
    the weights', less a squeezed axis before it), either operand first; not along another axis, not along two,
    not along none, not along an axis the weights squeeze."""
    from rulesets.kernels.attention import ValueProduct

    bhqk_v = (((3,), (2,)), ((0, 1), (0, 1)))  # [b, h, q, k] x [b, h, k, d]
    assert ValueProduct.contracts(True, bhqk_v, (), 3)
    assert not ValueProduct.contracts(True, bhqk_v, (), 2)  # the queries contracted: not attention's product
    assert not ValueProduct.contracts(False, bhqk_v, (), 3)  # v's axis 3 is contracted, not the weights'
    assert ValueProduct.contracts(False, (((2,), (3,)), ((0, 1), (0, 1))), (), 3)  # v first
    assert ValueProduct.contracts(True, (((2,), (1,)), ((0,), (0,))), (0,), 3)  # [1, h, q, k] squeezed to [h, q, k]
    assert not ValueProduct.contracts(True, (((0,), (0,)), ((), ())), (0,), 0)  # the squeezed axis itself
    assert not ValueProduct.contracts(True, (((2, 3), (1, 2)), ((0,), (0,))), (), 3)  # two axes
    assert not ValueProduct.contracts(True, (((), ()), ((0,), (0,))), (), 3)  # none: an outer product


def test_the_backward_makes_its_accumulators_when_it_starts():
    """The backward's accumulators (the operands' gradients, zero at first) are made when the backward starts. Made
    from a constant zero, XLA:CPU made them at the program's start, held through the rest of the forward and the
    backward of what follows the attention: the gradient of attention followed by a stack of layers then held more
    than the layers' own gradient, by more than an accumulator (a 2-block haiku encoder's step held 12 MiB more)."""
    n, d = 512, 128
    x, w = jnp.zeros((1, n, d), jnp.float32), jnp.zeros((d, d), jnp.float32)

    def layers(o, w):
        for _ in range(6):
            o = jnp.tanh(o @ w)
        return jnp.sum(o)

    def temp(f, *args):
        grad = jax.jit(jax.grad(f, tuple(range(len(args)))))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    attended = lambda q, k, v, w: layers(attention(q, k, v, scores=Scores(scale=0.25), block=128, query_block=128), w)
    assert temp(attended, x, x, x, w) - temp(layers, x, w) < n * d * 4
