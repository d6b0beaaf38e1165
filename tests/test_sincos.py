"""``rulesets.derivatives``' ``trig_sin_stored``: ``sin(x)`` as ``select(|x| < tiny, x, sin(x))``, bitwise ``lax.sin``.

The kernel is checked bit for bit against ``lax.sin`` on random bit patterns (every NaN payload, subnormals,
signed zeros, infinities, huge values), eager and under ``jit``, in float32 and float64, and on every value of
float16 and bfloat16; its derivatives, ``vmap`` and the rule's guard (it fires only where ``cos`` of the same
argument is in the program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax._src import core

from rewrite import Ruleset, explain
from rulesets._sincos import stored_sin
from rulesets.derivatives import derivatives, derivatives_exact

_BITS = {np.float32: np.uint32, np.float64: np.uint64}


def _special(dt):
    fi = np.finfo(dt)
    return np.array([0.0, -0.0, fi.smallest_subnormal, -fi.smallest_subnormal, fi.tiny, -fi.tiny, fi.tiny / 2,
                     1e-30, 1.0, np.pi, 1e4, 3e38, fi.max, -fi.max, np.inf, -np.inf, np.nan, -np.nan], dt)


def _same_bits(got, want, dt):
    return np.array_equal(np.asarray(got).view(_BITS.get(dt, np.uint16)), np.asarray(want).view(_BITS.get(dt, np.uint16)))


@settings(deadline=None)
@given(st.sampled_from([np.float32, np.float64]), st.lists(st.integers(0, 2 ** 64 - 1), min_size=1, max_size=64),
       st.booleans())
def test_stored_sin_is_sin_bit_for_bit(dt, words, jit):
    with jax.enable_x64(True):
        raw = np.array(words, np.uint64)
        t = np.concatenate([(raw if dt == np.float64 else raw.astype(np.uint32)).view(dt), _special(dt)])
        f = jax.jit(stored_sin) if jit else stored_sin
        assert _same_bits(f(jnp.asarray(t)), jax.jit(jnp.sin)(jnp.asarray(t)), dt)
        assert _same_bits(f(jnp.asarray(t)), jnp.sin(jnp.asarray(t)), dt)


@pytest.mark.parametrize("dt", [jnp.float16, jnp.bfloat16])
def test_stored_sin_of_every_half_value(dt):
    t = jnp.asarray(np.arange(65536, dtype=np.uint16).view(dt))
    for f in (stored_sin, jax.jit(stored_sin)):
        assert _same_bits(f(t), jnp.sin(t), None)


def test_derivatives_and_vmap_of_stored_sin():
    t = jnp.concatenate([jnp.asarray(_special(np.float32)[:13]), jnp.linspace(-7.0, 7.0, 50)])
    g = jax.vmap(jax.grad(stored_sin))(t)
    assert _same_bits(jnp.where(jnp.abs(t) < jnp.finfo(jnp.float32).tiny, 1.0, g),
                      jnp.where(jnp.abs(t) < jnp.finfo(jnp.float32).tiny, 1.0, jax.vmap(jax.grad(jnp.sin))(t)), None)
    _, tangent = jax.jvp(stored_sin, (t,), (jnp.ones_like(t),))
    ok = jnp.abs(t) >= jnp.finfo(jnp.float32).tiny
    assert bool(jnp.all(jnp.where(ok, tangent == jnp.cos(t), True)))
    assert _same_bits(jax.vmap(stored_sin)(t.reshape(7, 9)), jnp.sin(t.reshape(7, 9)), None)


def _only():
    return Ruleset("only", [derivatives_exact.rule("trig_sin_stored")], soundness="exact")


@pytest.mark.parametrize("shape", [(5,), (3, 4, 6)])
def test_fires_where_sin_and_cos_of_one_argument_are_computed(shape):
    x = jnp.linspace(-2.0, 2.0, int(np.prod(shape))).reshape(shape)
    report = explain(lambda x, g: jax.vjp(lambda v: jnp.sin(v) ** 2, x)[1](g)[0], x, x, rulesets=[_only()])
    assert report.fired.get("trig_sin_stored") == 1


def test_declines_where_only_sin_is_computed():
    x = jnp.linspace(-2.0, 2.0, 12)
    assert derivatives_exact.rule("trig_sin_stored") is not None
    assert explain(lambda x: jnp.sin(x) * x, x, rulesets=[_only()]).fired.get("trig_sin_stored") is None
    assert explain(lambda x: jnp.sin(x) + jnp.cos(x + 1.0), x, rulesets=[_only()]).fired.get("trig_sin_stored") is None


def test_chosen_where_sin_is_stored_for_a_reduction_and_cos_computed_beside_it():
    """``grad(sum(sin(a x)**2 / a))``: JAX's VJP stores ``sin`` for the library reduction of ``a``'s gradient and
    computes it again beside ``cos``; stored once, the program computes two transcendentals an element, not three
    (``cost_analysis``), and holds no more than a page more (``memory_analysis``)."""
    def grad_sum(x, a):
        return jax.grad(lambda x, a: (jnp.sin(a * x) ** 2 / a).sum(), (0, 1))(x, a)

    x, a = jnp.linspace(-3.0, 3.0, 32 * 16 * 8).reshape(32, 16, 8), jnp.linspace(0.5, 2.0, 8)
    report = explain(grad_sum, x, a, rulesets=[derivatives])
    assert report.used.get("trig_sin_stored", 0) >= 1, report.summary()
    before, after = (jax.jit(core.jaxpr_as_fun(p)).lower(x, a).compile() for p in (report.before, report.after))
    assert after.cost_analysis()["transcendentals"] == before.cost_analysis()["transcendentals"] * 2 / 3
    # no more than a page (extract.FATTER_BYTES): 16,480 against 16,416 bytes at this size, the same at T=64..2048
    assert after.memory_analysis().temp_size_in_bytes <= before.memory_analysis().temp_size_in_bytes + 4096


def test_not_chosen_where_sin_and_cos_share_one_loop():
    x = jnp.linspace(-2.0, 2.0, 4096)
    report = explain(lambda x, g: (jnp.sin(x) * g, jnp.cos(x) * g), x, x, rulesets=[derivatives])
    assert report.fired.get("trig_sin_stored") == 1 and not report.used.get("trig_sin_stored"), report.summary()
