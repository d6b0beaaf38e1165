"""Rewritten programs keep running on JAX's distributed machinery (8 host devices, see conftest).

Sharded inputs and sharding constraints keep their values and output shardings; rules act inside
shard_map bodies and keep their specs and varying-axes types; jit shardings and donation survive.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from rewrite import Ruleset, explain, rewrite, rule
from rewrite.report.report import primitive_counts

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (set by tests/conftest.py)")

TRIG = Ruleset("trig", [
    rule(lambda x: 2 * jnp.sin(x) * jnp.cos(x), lambda x: jnp.sin(2 * x), name="double_angle"),
    rule(lambda x: jnp.sin(x) * jnp.sin(x) + jnp.cos(x) * jnp.cos(x), lambda x: jnp.ones_like(x), name="pythagoras"),
], soundness="identity")


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def _x(shape=(8, 4)):
    return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) / 10


def test_sharded_inputs_and_constraints(mesh):
    def f(x, w):
        y = 2 * jnp.sin(x) * jnp.cos(x) @ w
        return jax.lax.with_sharding_constraint(y * 3, NamedSharding(mesh, P("data", None)))

    x = jax.device_put(_x(), NamedSharding(mesh, P("data", "model")))
    w = jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P("model", None)))
    r = rewrite(f, rulesets=[TRIG])
    want, got = jax.jit(f)(x, w), jax.jit(r)(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    assert primitive_counts(r.jaxpr(x, w))["sharding_constraint"] == 1
    assert r.result(x, w).stats["double_angle"].fired == 1


def test_rules_act_inside_shard_map(mesh):
    def body(xb, wb):
        y = (jnp.sin(xb) * jnp.sin(xb) + jnp.cos(xb) * jnp.cos(xb) + 2 * jnp.sin(xb) * jnp.cos(xb)) @ wb
        return jax.lax.psum(y, "model")

    def f(x, w):
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data", "model"), P("model", None)),
                             out_specs=P("data", None))(x, w)

    x, w = _x(), jnp.ones((4, 3))
    report = explain(f, x, w, rulesets=[TRIG])
    assert report.fired == {"pythagoras": 1, "double_angle": 1}  # the literal 2 is pvary-cast in the body
    before, after = report.before.jaxpr.eqns[0], report.after.jaxpr.eqns[0]
    assert after.primitive.name == "shard_map"
    for key in ("in_specs", "out_specs", "mesh", "check_vma", "newly_manual_axes"):
        assert after.params[key] == before.params[key], key
    body_before, body_after = before.params["jaxpr"], after.params["jaxpr"]
    assert [v.aval for v in body_after.invars] == [v.aval for v in body_before.invars]  # varying axes kept
    assert [v.aval for v in body_after.outvars] == [v.aval for v in body_before.outvars]
    core.check_jaxpr(report.after.jaxpr)
    r = rewrite(f, rulesets=[TRIG])
    np.testing.assert_allclose(r(x, w), f(x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(r)(x, w), jax.jit(f)(x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.grad(lambda x: r(x, w).sum())(x), jax.grad(lambda x: f(x, w).sum())(x),
                               rtol=1e-4, atol=1e-4)


def test_nested_jit_shardings_and_donation_are_kept(mesh):
    inner = jax.jit(lambda a: 2 * jnp.sin(a) * jnp.cos(a), in_shardings=NamedSharding(mesh, P("data")),
                    out_shardings=NamedSharding(mesh, P(None, "model")), donate_argnums=0)

    def f(x):
        return inner(x + 1.0)

    x = _x()
    report = explain(f, x, rulesets=[TRIG])
    (jit_before,) = [e for e in report.before.jaxpr.eqns if e.primitive.name == "jit"]
    (jit_after,) = [e for e in report.after.jaxpr.eqns if e.primitive.name == "jit"]
    for key in ("in_shardings", "out_shardings", "donated_invars", "in_layouts", "out_layouts"):
        assert jit_after.params[key] == jit_before.params[key], key
    assert report.fired == {"double_angle": 1}  # rules act inside the kept jit
    out = jax.jit(rewrite(f, rulesets=[TRIG]))(x)
    np.testing.assert_allclose(out, jax.jit(f)(x), rtol=1e-5, atol=1e-6)
    assert out.sharding.is_equivalent_to(jax.jit(f)(x).sharding, 2)


def test_outer_jit_shardings_and_donation(mesh):
    r = rewrite(lambda x: 2 * jnp.sin(x) * jnp.cos(x), rulesets=[TRIG])
    shard = NamedSharding(mesh, P("data", "model"))
    step = jax.jit(r, in_shardings=shard, out_shardings=shard, donate_argnums=0)
    x = jax.device_put(_x(), shard)
    want = np.asarray(jnp.sin(2 * _x()))
    out = step(x)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert out.sharding.spec == P("data", "model")
    assert x.is_deleted()  # the donated buffer was taken
    other = jax.jit(r, in_shardings=shard, out_shardings=NamedSharding(mesh, P("data")))(jax.device_put(_x(), shard))
    assert other.sharding.spec == P("data")


def test_explicit_sharding_mode():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    with jax.set_mesh(mesh):
        x = jax.device_put(_x(), NamedSharding(mesh, P("data", "model")))
        r = rewrite(lambda x: (2 * jnp.sin(x) * jnp.cos(x)).sum(axis=1), rulesets=[TRIG])
        out = jax.jit(r)(x)
        want = jax.jit(lambda x: (2 * jnp.sin(x) * jnp.cos(x)).sum(axis=1))(x)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        assert out.sharding.spec == want.sharding.spec
        assert r.result(x).stats["double_angle"].fired == 1
