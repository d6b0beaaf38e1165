"""``rulesets.attention`` as one fused ``jax.nn.dot_product_attention`` call (cuDNN's on a GPU).

On a CPU the pack never builds the fused call (``implementation()`` is ``None``). These tests configure it
to build ``"xla"`` (``attention_with(fused="xla")``), the reference implementation of the same call, to check on any backend how a matched program
is mapped onto the call's layout, scale, bias and causal mask: values and gradients against the original.
The rules are made preferred here (the matched form barred), so that the fused form is what runs, and
saturation stops after one round: the XLA implementation is itself attention, which a second round would
match again (cuDNN's call is one opaque kernel).
The last test runs cuDNN itself, on a GPU only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rewrite import Limits, Ruleset, explain, rewrite, rule
from rulesets import _fused_attention as fused_mod
from rulesets.attention import attention, attention_with

from . import covering
from .rewritten import ran
from .test_attention import close, inputs, make

#: The pack's rules building the fused call's XLA implementation, preferred: where a rule built the fused call,
#: the matched form cannot be chosen.
PREFERRED = Ruleset("attention_preferred", [
    rule(r.lhs, r.rhs, name=r.name + "_pref", example_program=r.program, prefer=True)
    for r in attention_with(fused="xla").rules], soundness="identity", tolerance=attention.tolerance)
ONE_ROUND = Limits(iterations=1)
pytestmark = pytest.mark.filterwarnings("ignore:rewrite of 'f' stopped at the iteration limit")


@pytest.fixture
def xla_call(monkeypatch):
    """The list of what each match of ``PREFERRED`` built: the fused call (``True``) or not."""
    built = []
    real = fused_mod.fused

    def spy(*args, **kwargs):
        fn = real(*args, **kwargs)
        built.append(fn is not None)
        return fn

    monkeypatch.setattr(fused_mod, "fused", spy)
    return built


def _grads(fn, args):
    return jax.jit(jax.grad(lambda q, k, v, b: jnp.sum(jnp.sin(fn(q, k, v, args[3], b).astype(jnp.float32))),
                            argnums=(0, 1, 2, 3)))(*args[:3], args[4])


#: The values test's dimensions (tests/covering.py): each a list of the values drawn.
DIMS = {
    "layout": ["bhnd", "bnhd"],
    "mask": ["none", "causal"],
    "fill": ["finfo", "-1e30", "-inf", "-1e30py"],
    "scale_on": ["q", "logits"],
    "bias": [False, True],
    "b": [1, 2], "h": [1, 2],
    # float16: XLA:CPU has no float16 product accumulating in float32, which the XLA implementation asks for
    "dtype": ["float32", "bfloat16"],
}
CASES = covering.strategy(DIMS, seed=st.integers(0, 2 ** 16))

#: Four cases that take every value of every dimension, two float32 (whose gradients are checked: both layouts,
#: masks, scales and biases among them) and two bfloat16.
EXAMPLES = [
    dict(layout="bhnd", mask="none", fill="finfo", scale_on="q", bias=False, b=1, h=1, dtype="float32", seed=0),
    dict(layout="bnhd", mask="causal", fill="-inf", scale_on="logits", bias=True, b=1, h=2, dtype="float32",
         seed=1),
    dict(layout="bhnd", mask="causal", fill="-1e30", scale_on="logits", bias=True, b=2, h=2, dtype="bfloat16",
         seed=2),
    dict(layout="bnhd", mask="none", fill="-1e30py", scale_on="q", bias=False, b=2, h=1, dtype="bfloat16",
         seed=3),
]


# the fixture's list is cleared by each example; ci: the four explicit cases alone (12 draws were 13-20 s of CPU)
@settings(max_examples=max(10, settings.default.max_examples // 2), phases=covering.PHASES,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=CASES)
@covering.covers(DIMS, EXAMPLES, lambda c: ((), {"case": c}))
def test_fused_call_keeps_values_and_gradients(xla_call, case):
    xla_call.clear()
    dtype = jnp.dtype(case["dtype"])
    cast = dtype != jnp.float32
    f = make(case["layout"], case["mask"], case["fill"], case["scale_on"], case["bias"], cast)
    args = inputs(np.random.default_rng(case["seed"]), case["layout"], case["b"], case["h"], 512, 8, dtype,
                  case["mask"])
    g = rewrite(f, rulesets=[PREFERRED], limits=ONE_ROUND)
    after = [e.primitive.name for e in ran(g, *args).after.eqns]
    assert any(xla_call), "no match was mapped onto the fused call"
    assert "custom_vjp_call" not in after, "the blocked form was built where the fused call applies"
    # compiled (op by op, each of the rewritten program's operations was compiled apart, some 30 an example; a
    # rewritten function run eagerly is tests/test_attention.py's values test's)
    close(jax.jit(g)(*args), jax.jit(f)(*args), dtype)
    if dtype != jnp.bfloat16:
        for a, b in zip(_grads(g, args), _grads(f, args)):
            close(a, b, dtype)


@pytest.mark.parametrize("form", ["padding", "array", "small_fill", "offset_causal", "bias_after_mask",
                                  "strict_causal", "causal_fewer_queries", "int8_positions"])
def test_what_the_fused_call_cannot_compute_keeps_the_blocked_form(xla_call, form):
    """A mask the call does not take (an array, a diagonal-less or shifted causal mask, positions that wrap in
    their dtype), a fill that does
    not zero a weight, or a bias added after the mask: the blocked form, which computes it as written."""
    n = 512

    def f(q, k, v, m, b):
        s = q @ jnp.swapaxes(k, -1, -2) * 0.125
        qi, ki = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
        if form in ("padding", "array"):
            s = jnp.where(m, s, -1e30)
        elif form == "small_fill":
            s = jnp.where(qi >= ki, s, -10.0)
        elif form == "offset_causal":
            s = jnp.where(qi + 3 >= ki, s, -jnp.inf)
        elif form == "strict_causal":
            s = jnp.where(qi > ki, s, -1e30)
        elif form == "int8_positions":  # an int8 iota wraps at 128: not query >= key past there
            qi, ki = (jax.lax.broadcasted_iota(jnp.int8, (n, n), d) for d in (0, 1))
            s = jnp.where(qi >= ki, s, -1e30)
        elif form == "causal_fewer_queries":  # 256 queries over 512 keys
            s = jnp.where(jnp.arange(256)[:, None] >= ki, s, -1e30)
        else:
            s = jnp.where(qi >= ki, s, -1e30) + b
        return jax.nn.softmax(s, axis=-1) @ v

    mask = "padding" if form == "padding" else "array"
    args = inputs(np.random.default_rng(5), "bhnd", 1, 2, n, 8, jnp.float32, mask)
    if form == "causal_fewer_queries":
        args[0] = args[0][:, :, :256]
    g = rewrite(f, rulesets=[PREFERRED], limits=ONE_ROUND)
    fired = ran(g, *args).fired
    assert any(name.startswith("attn_") for name in fired), fired
    assert xla_call and not any(xla_call), xla_call
    close(g(*args), jax.jit(f)(*args), jnp.float32)


def test_fused_call_and_blocked_form_by_backend():
    # On this backend (no cuDNN), the pack builds the blocked form; on a GPU it is cuDNN's call.
    if jax.default_backend() == "gpu":
        assert fused_mod.implementation() == "cudnn" and not fused_mod.blocked()
        return
    assert fused_mod.implementation() is None and fused_mod.blocked()
    args = inputs(np.random.default_rng(6), "bhnd", 1, 2, 512, 8, jnp.float32, "none")
    f = make("bhnd", "causal", "finfo", "logits", False, False)
    after = [e.primitive.name for e in explain(f, *args, rulesets=[attention]).after.eqns]
    assert "custom_vjp_call" in after, after


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a GPU")
@pytest.mark.parametrize("layout,mask,dtype", [("bnhd", "causal", "bfloat16"), ("bhnd", "none", "float16"),
                                               ("bnhd", "none", "float32")])
def test_cudnn_on_a_gpu(layout, mask, dtype):
    """The pack unchanged: cuDNN's call where it takes the dtype (half precision), else the program kept
    (on a GPU the blocked form measured slower than XLA's attention)."""
    dtype = jnp.dtype(dtype)
    f = make(layout, mask, "finfo", "logits", False, dtype != jnp.float32)
    args = inputs(np.random.default_rng(7), layout, 2, 4, 1024, 64, dtype, mask)
    g = rewrite(f, rulesets=[attention])
    text = str(jax.jit(g).lower(*args).as_text())
    assert ("cudnn" in text.lower()) == (dtype != jnp.float32), "cuDNN's call where it applies, only there"
    if dtype == jnp.float32:  # kept as written: nothing to compare
        assert not explain(f, *args, rulesets=[attention]).result.rewritten
        return
    close(g(*args), jax.jit(f)(*args), dtype)
    for a, b in zip(_grads(g, args), _grads(f, args)):
        close(a, b, dtype)


@pytest.mark.parametrize("library", ["flax_mha", "haiku_mha", "equinox_mha", "flax_causal"])
def test_library_layers_map_onto_the_fused_call(xla_call, library):
    """The libraries' attention layers (benchmarks/attention.py builds them) and flax's causal mask made
    inside the model (``nn.make_causal_mask``, iota comparisons): each becomes the fused call."""
    pytest.importorskip({"flax_mha": "flax", "haiku_mha": "haiku", "equinox_mha": "equinox",
                         "flax_causal": "flax"}[library])
    bench = pytest.importorskip("benchmarks.attention")
    if library == "flax_causal":
        import flax.linen as nn

        def f(q, k, v):
            return nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones(q.shape[:2])))

        rng = np.random.default_rng(8)
        args = [jnp.asarray(rng.standard_normal((2, 512, 2, 16)), jnp.float32) for _ in range(3)]
    else:
        f, x = bench.layers(512)[library]
        args = [x]
    g = rewrite(f, rulesets=[PREFERRED], limits=ONE_ROUND)
    ran(g, *args)
    assert xla_call and all(xla_call), xla_call
    close(jax.jit(g)(*args), jax.jit(f)(*args), jnp.float32)
    loss = lambda fn: (lambda *a: jnp.sum(jnp.sin(fn(*a))))  # noqa: E731
    # both gradients compiled (op by op, each operation was compiled apart: 100 compiles for flax's layer; a
    # rewritten function's gradient eagerly is tests/test_attention.py's test_gradient_under_jit_and_vmap's)
    for a, b in zip(jax.jit(jax.grad(loss(g), argnums=tuple(range(len(args)))))(*args),
                    jax.jit(jax.grad(loss(f), argnums=tuple(range(len(args)))))(*args)):
        close(a, b, jnp.float32)


@pytest.mark.parametrize("form", ["f32_values", "f32_result"])
def test_the_fused_call_rounds_nothing_the_original_does_not(xla_call, form):
    """The call computes in the query's dtype: a v of a wider dtype, or a product asked to return a wider
    dtype, would be rounded by it where the original is not: the blocked form."""

    def f(q, k, v):
        p = jax.nn.softmax((q @ jnp.swapaxes(k, -1, -2)).astype(jnp.float32) * 0.125, axis=-1)
        if form == "f32_values":
            return p @ v.astype(jnp.float32)
        return jnp.matmul(p.astype(q.dtype), v, preferred_element_type=jnp.float32)

    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 512, 8)), jnp.bfloat16) for _ in range(3))
    fired = explain(f, q, k, v, rulesets=[PREFERRED], limits=ONE_ROUND).fired
    assert any(name.startswith("attn_") for name in fired), fired
    assert xla_call and not any(xla_call), xla_call


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a GPU")
@pytest.mark.parametrize("special", ["nan_q", "inf_k", "nan_v"])
def test_cudnn_special_values_as_the_original(special):
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((1, 1024, 2, 64)).astype(np.float32) for _ in range(3))
    {"nan_q": q, "inf_k": k, "nan_v": v}[special][0, 5, 1, 3] = np.inf if special == "inf_k" else np.nan
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    f = lambda q, k, v: make("bnhd", "causal", "finfo", "logits", False, True)(q, k, v, None, None)  # noqa: E731
    g = rewrite(f, rulesets=[attention])
    assert "cudnn" in jax.jit(g).lower(*args).as_text().lower()
    close(g(*args), jax.jit(f)(*args), jnp.bfloat16)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads,dtype", [(4, "float32"), (2, "bfloat16"), (1, "float32")])
def test_jax_dot_product_attention_maps_onto_the_fused_call(xla_call, causal, kv_heads, dtype):
    """``jax.nn.dot_product_attention`` as XLA computes it (its default): the query reshaped into groups of
    heads per key head and the core vmapped over the group (grouped-query and multi-query attention), the
    causal mask as ``tril`` of ones. On a GPU this is where the fused call replaces XLA's attention."""
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((2, 512, 4, 16)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((2, 512, kv_heads, 16)), dtype) for _ in range(2))

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

    g = rewrite(f, rulesets=[PREFERRED], limits=ONE_ROUND)
    ran(g, q, k, v)
    assert xla_call and all(xla_call), xla_call
    close(jax.jit(g)(q, k, v), jax.jit(f)(q, k, v), dtype)
    if dtype == "float32":
        loss = lambda fn: (lambda *a: jnp.sum(jnp.sin(fn(*a))))  # noqa: E731
        # both compiled (a rewritten function's gradient eagerly is test_attention's test_gradient_under_jit_and_vmap's)
        for a, b in zip(jax.jit(jax.grad(loss(g), argnums=(0, 1, 2)))(q, k, v),
                        jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v)):
            close(a, b, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_call_under_jvp_vmap_and_jit(xla_call, dtype):
    """The fused form under forward mode, vmap and jit, eagerly and compiled, as the original computes (compiled,
    once: op by op, each of its operations was compiled apart for the eager comparison)."""
    f = make("bnhd", "causal", "finfo", "logits", False, dtype != "float32")
    rng = np.random.default_rng(12)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 1, 512, 2, 8)), dtype) for _ in range(3))
    attend = lambda fn: (lambda q, k, v: fn(q, k, v, None, None))  # noqa: E731
    g = rewrite(attend(f), rulesets=[PREFERRED], limits=ONE_ROUND)
    ran(g, q[0], k[0], v[0])
    assert xla_call and all(xla_call), xla_call
    t = tuple(jnp.ones_like(x[0]) for x in (q, k, v))
    want_jvp = jax.jit(lambda *p: jax.jvp(attend(f), p, t))(q[0], k[0], v[0])
    want_vmap = jax.jit(jax.vmap(attend(f)))(q, k, v)
    for wrap in (lambda h: h, jax.jit):
        for a, b in zip(wrap(lambda *p: jax.jvp(g, p, t))(q[0], k[0], v[0]), want_jvp):
            close(a, b, dtype)
        close(wrap(jax.vmap(g))(q, k, v), want_vmap, dtype)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a GPU")
@pytest.mark.parametrize("transform", ["jvp", "vmap"])
def test_cudnn_under_jvp_vmap_and_jit(transform):
    """cuDNN's call (no XLA stand-in) under forward mode and vmap, eagerly and under jit."""
    f = make("bnhd", "causal", "finfo", "logits", False, True)
    rng = np.random.default_rng(13)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 1, 1024, 2, 64)), jnp.bfloat16) for _ in range(3))
    attend = lambda fn: (lambda q, k, v: fn(q, k, v, None, None))  # noqa: E731
    g = rewrite(attend(f), rulesets=[attention])
    assert "cudnn" in jax.jit(g).lower(q[0], k[0], v[0]).as_text().lower()
    t = tuple(jnp.ones_like(x[0]) for x in (q, k, v))
    for wrap in (lambda h: h, jax.jit):
        if transform == "jvp":
            for a, b in zip(wrap(lambda *p: jax.jvp(g, p, t))(q[0], k[0], v[0]),
                            wrap(lambda *p: jax.jvp(attend(f), p, t))(q[0], k[0], v[0])):
                close(a, b, jnp.bfloat16)
        else:
            close(wrap(jax.vmap(g))(q, k, v), wrap(jax.vmap(attend(f)))(q, k, v), jnp.bfloat16)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_cudnn_replaces_jax_dot_product_attention_with_grouped_heads(causal, kv_heads):
    """``jax.nn.dot_product_attention`` as XLA computes it, with grouped and multi-query heads: cuDNN's call,
    values and gradients as the original's (bfloat16)."""
    rng = np.random.default_rng(14)
    q = jnp.asarray(rng.standard_normal((2, 1024, 4, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((2, 1024, kv_heads, 64)), jnp.bfloat16) for _ in range(2))

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

    g = rewrite(f, rulesets=[attention])
    assert "cudnn" in jax.jit(g).lower(q, k, v).as_text().lower()
    close(jax.jit(g)(q, k, v), jax.jit(f)(q, k, v), jnp.bfloat16)
    loss = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32))), argnums=(0, 1, 2)))  # noqa: E731
    for a, b in zip(loss(g)(q, k, v), loss(f)(q, k, v)):
        close(a, b, jnp.bfloat16)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a GPU")
def test_the_half_precision_rules_hold_on_a_gpu():
    """On a GPU the pack's half-precision rules build cuDNN's fused call (the blocked form is off there), and
    ``check_ruleset`` holds its values and, in reverse mode, its backward to the original's autodiff
    (``benchmarks/results/gpu.md`` has the runs on an H200)."""
    from rewrite.testing import check_ruleset

    half = [r for r in attention.rules if "_wide" in r.name]
    assert len(half) == 2
    report = check_ruleset(Ruleset("attention_half", half, soundness=attention.soundness,
                                   tolerance=attention.tolerance))
    assert set(report.rules) == {r.name for r in half}
