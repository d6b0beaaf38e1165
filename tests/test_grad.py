"""The plain ``@rewrite`` under differentiation: every transformation gives JAX's derivatives, reverse
mode runs the jointly rewritten forward/backward split, forward mode the rewritten JVP, each built
once per signature and transformation, and only when a derivative is taken (rewrite/grad/primitive.py)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

from rewrite import RewriteWarning, Ruleset, explain, rewrite, rule
from rewrite.report.report import primitive_counts
from rulesets.derivatives import derivatives, derivatives_fastmath

from .local_rulesets import without_kernels

#: The seed's sin(ax) has an argument that may be huge, where sin(2ax) overflows (issue 29): its double angle
#: is a fastmath rewrite, so the tests of the seed's backward pass take both parts of the pack.
#: the packs these tests read the split of: derivatives without its kernel (``derivatives_kernels``, whose backward
#: replaces JAX's split where the joint decision takes it: tests/test_sin_squared.py), and the double angle of fastmath
SEED_PACKS = [without_kernels(derivatives), derivatives_fastmath]


def seed(x, a):
    return jnp.sin(a * x) ** 2 / a


def _rand(*shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def _close(got, want, tol=2e-5):
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got) == len(want)
    for p, q in zip(got, want):
        if jnp.result_type(q) == jax.dtypes.float0:  # an integer output's tangent
            assert jnp.result_type(p) == jax.dtypes.float0 and np.shape(p) == np.shape(q)
            continue
        np.testing.assert_allclose(p, q, rtol=tol, atol=tol)


X, A = _rand(4, 8, 16), jnp.linspace(0.5, 2.0, 16)
# Large enough that XLA:CPU reduces with its library kernels (tiny arrays are launch-bound).
X2, A2 = _rand(8, 64, 32), jnp.linspace(0.5, 2.0, 32)
loss = lambda x, a: seed(x, a).sum()  # noqa: E731


def _rewritten():
    r = rewrite(seed, rulesets=SEED_PACKS)
    return r, (lambda x, a: r(x, a).sum())


def test_reverse_mode_runs_the_rewritten_split_and_builds_it_once():
    r, loss_r = _rewritten()
    _ = r(X, A)
    assert r.derivative_rewrites == {}  # lazy: calling the function rewrites no derivative
    _close(jax.grad(loss_r, (0, 1))(X, A), jax.grad(loss, (0, 1))(X, A))
    assert r.derivative_rewrites == {"vjp": 1}
    _close(jax.value_and_grad(loss_r, (0, 1))(X, A), jax.value_and_grad(loss, (0, 1))(X, A))
    g = _rand(4, 8, 16, seed=1)
    out, pb = jax.vjp(r, X, A)
    want_out, want_pb = jax.vjp(seed, X, A)
    _close(out, want_out)
    _close(pb(g), want_pb(g))
    _close(jax.jit(jax.grad(loss_r, (0, 1)))(X, A), jax.grad(loss, (0, 1))(X, A))
    assert r.derivative_rewrites == {"vjp": 1}  # one signature, one reverse-mode rewrite
    _ = jax.grad(loss_r)(X[:2], A)
    assert r.derivative_rewrites == {"vjp": 2}  # a new signature is a new rewrite
    # What jax.grad runs is the split. At a size where XLA:CPU reduces with its library kernels the
    # backward reads sin(ax)**2 and needs one more sine (sin(2ax)) and no cosine; JAX's own has a cosine.
    fwd, bwd = r.vjp_jaxprs(X2, A2)
    ran = primitive_counts(jax.make_jaxpr(jax.grad(loss_r, (0, 1)))(X2, A2))
    for p in ("sin", "cos"):
        assert ran[p] == primitive_counts(fwd)[p] + primitive_counts(bwd)[p]
    assert ran["cos"] == 0 and ran["sin"] == 2
    assert primitive_counts(jax.make_jaxpr(jax.grad(loss, (0, 1)))(X2, A2))["cos"] == 1
    built = r.grad_result(X, A)
    assert built.split.cost == min(s.cost for s in built.splits_considered)
    assert "cos" not in primitive_counts(r.jaxpr(X, A))  # without differentiation only the forward runs


def test_forward_mode_runs_the_rewritten_jvp():
    r, _ = _rewritten()
    t = (_rand(4, 8, 16, seed=2), _rand(16, seed=3))
    _close(jax.jvp(r, (X, A), t), jax.jvp(seed, (X, A), t))
    assert r.derivative_rewrites == {"jvp": 1}
    jvp = r.jvp_jaxpr(X, A)
    assert [v.aval.shape for v in jvp.jaxpr.invars] == [(4, 8, 16), (16,), (4, 8, 16), (16,)]
    ran = primitive_counts(jax.make_jaxpr(lambda x, a, tx, ta: jax.jvp(r, (x, a), (tx, ta)))(X, A, *t))
    assert ran == primitive_counts(jvp)
    x1, a1 = X[0, 0, :4], A[:4]
    _close(jax.jacfwd(r, (0, 1))(x1, a1), jax.jacfwd(seed, (0, 1))(x1, a1), tol=1e-4)
    _close(jax.jacrev(r, (0, 1))(x1, a1), jax.jacrev(seed, (0, 1))(x1, a1), tol=1e-4)
    lin_out, lin = jax.linearize(r, X, A)  # linearize evaluates its linear part: the JVP's, not a transpose
    _close((lin_out, lin(*t)), jax.jvp(seed, (X, A), t))


def test_higher_order():
    r, loss_r = _rewritten()
    x1, a1 = X[0, 0, :5], A[:5]
    _close(jax.hessian(loss_r)(x1, a1), jax.hessian(loss)(x1, a1), tol=1e-4)
    _close(jax.hessian(loss_r, (0, 1))(x1, a1), jax.hessian(loss, (0, 1))(x1, a1), tol=1e-4)
    gg_r = jax.grad(lambda x, a: jax.grad(loss_r)(x, a).sum(), (0, 1))
    gg = jax.grad(lambda x, a: jax.grad(loss)(x, a).sum(), (0, 1))
    _close(jax.jit(gg_r)(X, A), gg(X, A), tol=1e-4)
    assert r.derivative_rewrites["vjp"] >= 1


# A rule whose replacement JAX cannot differentiate in forward mode, as cuDNN's fused attention on a GPU: a
# custom_vjp around a primitive with no JVP rule. Its VJP program holds the primitive bare.
_sin_without_jvp_p = Primitive("test_sin_without_jvp")
_sin_without_jvp_p.def_impl(jnp.sin)
_sin_without_jvp_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(_sin_without_jvp_p, mlir.lower_fun(jnp.sin, multiple_results=False))


@jax.custom_vjp
def _vjp_only_sin(x):
    return _sin_without_jvp_p.bind(x)


_vjp_only_sin.defvjp(lambda x: (_sin_without_jvp_p.bind(x), x), lambda x, g: (g * jnp.cos(x),))
VJP_ONLY = Ruleset("vjp_only", [rule(jnp.sin, _vjp_only_sin, name="sin_vjp_only", prefer=True)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("order", ["hvp", "jit_hvp", "vmap_hvp", "grad_of_grad", "hessian"])
def test_a_replacement_without_forward_mode_is_differentiated_twice_as_written(order, dtype):
    """Differentiated again (jax.jvp of jax.grad, grad of grad), a VJP whose program holds what JAX cannot
    differentiate in forward mode gives way to JAX's derivative of the program as written (on a GPU, bf16
    attention's hvp raised NotImplementedError for cuDNN's fused call); plain grad still runs the rule's."""
    f = lambda x: jnp.sum(jnp.sin(x) * x)  # noqa: E731
    g = rewrite(f, rulesets=[VJP_ONLY])
    x, t = jnp.linspace(-1.0, 1.0, 5, dtype=dtype), jnp.linspace(0.5, 1.5, 5, dtype=dtype)
    assert "test_sin_without_jvp" in str(g.grad_result(x).fwd)
    hvp = lambda h, x, t: jax.jvp(jax.grad(h), (x,), (t,))[1]  # noqa: E731
    run = {"hvp": lambda h: hvp(h, x, t), "jit_hvp": lambda h: jax.jit(lambda x, t: hvp(h, x, t))(x, t),
           "vmap_hvp": lambda h: jax.vmap(lambda t: hvp(h, x, t))(jnp.eye(5, dtype=dtype)),
           "grad_of_grad": lambda h: jax.grad(lambda x: jax.grad(h)(x).sum())(x),
           "hessian": lambda h: jax.hessian(h)(x)}[order]
    tol = 1e-6 if dtype == "float32" else 1e-2  # (the same derivative program; half precision rounds its fusions)
    _close(run(g), run(f), tol=tol)
    _close(jax.grad(g)(x), jax.grad(f)(x), tol=tol)


def test_vmap_jit_and_nesting():
    r, loss_r = _rewritten()
    per_example = jax.vmap(jax.grad(loss_r, (0, 1)), in_axes=(0, None))
    want = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None))(X, A)
    _close(per_example(X, A), want)
    _close(jax.jit(per_example)(X, A), want)
    # grad of a jitted call, a vmapped call, and a call inside scan
    _close(jax.grad(lambda x, a: jax.jit(r)(x, a).sum(), (0, 1))(X, A), jax.grad(loss, (0, 1))(X, A))
    _close(jax.grad(lambda x, a: jax.vmap(r, (0, None))(x, a).sum(), (0, 1))(X, A), jax.grad(loss, (0, 1))(X, A))

    def scanned(f):
        return lambda x, a: jax.lax.scan(lambda c, xi: (c + f(xi, a).sum(), None), 0.0, x)[0]

    _close(jax.grad(scanned(r), (0, 1))(X, A), jax.grad(scanned(seed), (0, 1))(X, A), tol=1e-4)
    # checkpoint and scan differentiate by JVP and partial evaluation: the rewritten JVP, transposed by JAX
    _close(jax.grad(lambda x, a: jax.checkpoint(r)(x, a).sum(), (0, 1))(X, A), jax.grad(loss, (0, 1))(X, A))
    _close(jax.jit(jax.vmap(r, in_axes=(0, None)))(X, A), seed(X, A))
    # Staged without differentiation, the call is its equations, not an opaque primitive.
    assert "rewritten" not in primitive_counts(jax.make_jaxpr(r)(X, A))
    assert "rewritten" not in primitive_counts(jax.make_jaxpr(jax.grad(loss_r))(X, A))


def test_integer_inputs_several_outputs_and_partial_argnums():
    def f(x, n, w):
        y = jnp.tanh(x @ w) * n
        return {"y": y, "count": n + 1, "s": jnp.exp(-y).sum()}

    r = rewrite(f, rulesets=[derivatives])
    x, w, n = _rand(5, 3), _rand(3, 3, seed=1), jnp.int32(2)
    obj = lambda f: lambda x, w: f(x, n, w)["s"] + f(x, n, w)["y"].sum()  # noqa: E731
    _close(jax.grad(obj(r), (0, 1))(x, w), jax.grad(obj(f), (0, 1))(x, w))
    _close(jax.grad(obj(r), 1)(x, w), jax.grad(obj(f), 1)(x, w))  # x's gradient is not asked for
    t = (_rand(5, 3, seed=5), np.zeros((), jax.dtypes.float0), _rand(3, 3, seed=6))
    _close(jax.jvp(r, (x, n, w), t), jax.jvp(f, (x, n, w), t))


def test_effects_are_differentiated_by_jax_and_run_once():
    log = []

    def f(x):
        jax.debug.callback(lambda v: log.append(float(v)), x[0])
        return jnp.sin(x) ** 2

    r = rewrite(f, rulesets=[derivatives])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewriteWarning)
        g = jax.grad(lambda x: r(x).sum())(jnp.ones(3))
    jax.effects_barrier()
    np.testing.assert_allclose(g, jnp.sin(2 * jnp.ones(3)), rtol=1e-6)
    assert log == [1.0] and r.derivative_rewrites == {}


def test_failure_warns_and_falls_back(monkeypatch):
    import rewrite.grad.vjp as vjp_mod

    def broken(*a, **k):
        raise RuntimeError("simulated")

    monkeypatch.setattr(vjp_mod, "choose_residuals", broken)
    r = rewrite(seed, rulesets=[derivatives], strict=False)
    with pytest.warns(RewriteWarning, match="simulated"):
        g = jax.grad(lambda x, a: r(x, a).sum(), (0, 1))(X, A)
    _close(g, jax.grad(loss, (0, 1))(X, A))
    strict = rewrite(seed, rulesets=[derivatives], strict=True)
    with pytest.raises(RuntimeError, match="simulated"):
        jax.grad(lambda x, a: strict(x, a).sum())(X, A)


def test_explain_shows_the_gradient_program():
    report = explain(seed, X2, A2, rulesets=SEED_PACKS, grad=True)
    assert report.gradient is not None and report.gradient.split.residuals is not None
    assert "cos" in primitive_counts(report.before) and "cos" not in primitive_counts(report.after)
    assert "residuals" in report.summary()
    r, loss_r = _rewritten()
    _ = jax.grad(loss_r)(X, A)
    again = explain(r, X, A, grad=True)  # a rewritten function: its own rules and cached program
    assert again.gradient is r.grad_result(X, A) and r.derivative_rewrites == {"vjp": 1}
    # jax.grad built that program without keeping its e-graph: the rules it used are what its pipeline recorded,
    # as a report that kept the e-graph reads them
    assert again.used and again.used == explain(seed, X, A, rulesets=SEED_PACKS, grad=True).used, again.used


def test_vjp_flag_is_deprecated_and_still_works():
    with pytest.warns(DeprecationWarning, match="vjp=True"):
        r = rewrite(seed, rulesets=[derivatives], vjp=True)
    _close(jax.grad(lambda x, a: r(x, a).sum(), (0, 1))(X, A), jax.grad(loss, (0, 1))(X, A))


def test_training_step_with_a_plain_rewritten_loss():
    from tests.test_vjp import _mlp_loss, trains_alike

    fast = rewrite(_mlp_loss, rulesets=[derivatives])
    trains_alike(fast)
    assert fast.derivative_rewrites == {"vjp": 1}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (set by tests/conftest.py)")
def test_sharded_inputs():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    x = jax.device_put(_rand(8, 16), NamedSharding(mesh, P("data", "model")))
    a = jax.device_put(jnp.linspace(0.5, 2.0, 16), NamedSharding(mesh, P("model")))
    r, loss_r = _rewritten()
    got = jax.jit(jax.grad(loss_r, (0, 1)))(x, a)
    want = jax.jit(jax.grad(loss, (0, 1)))(x, a)
    _close(got, want)
    for p, q in zip(got, want):
        assert p.sharding.is_equivalent_to(q.sharding, p.ndim)
    assert r.derivative_rewrites == {"vjp": 1}


def test_a_first_call_collects_rarely_and_puts_the_collector_back(monkeypatch):
    """A first call's rewrite and a derivative's build run with the collector's thresholds raised
    (``jaxpr.trace.collect_young_only``: no full collection walks what the rewrite made, young ones are rarer), and
    only then; a process that turned automatic collection off keeps it off. Read where each pipeline extracts."""
    import gc

    import rewrite.pipeline as pipeline
    from rewrite.jaxpr.trace import RARE_THRESHOLDS

    seen = []
    real = pipeline.extract

    def spy(*a, **k):
        seen.append(gc.get_threshold())
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "extract", spy)
    before = gc.get_threshold()
    x = jnp.linspace(0.0, 1.0, 8)
    f = rewrite(lambda x: jnp.sin(x) ** 2 * 3.0, rulesets=[derivatives])
    f(x)
    forward = len(seen)
    jax.grad(lambda x: f(x).sum())(x)
    assert 0 < forward < len(seen) and f.derivative_rewrites["vjp"] == 1
    assert all(all(a >= b for a, b in zip(t, RARE_THRESHOLDS)) for t in seen), seen  # the forward's and the VJP's
    assert gc.get_threshold() == before  # put back after

    seen.clear()
    gc.set_threshold(0)
    try:
        rewrite(lambda x: jnp.cos(x) * 2.0 + 1.0, rulesets=[derivatives])(x)
        assert seen and all(t[0] == 0 for t in seen)
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)


def test_a_branch_whose_call_holds_a_constant_is_differentiated_rewritten():
    """A ``jit`` inside a ``cond`` branch that holds a constant (``jnp.array([1., 2.])``): the body the memory model
    sized was the closed call's jaxpr read without its constants, and ``ClosedJaxpr(jaxpr, ())`` asserted, so the
    VJP's rewrite fell back (a ``RewriteWarning``; raised under ``strict=True``): JAX's ``testCondGrad2`` and
    ``testScanGrad`` with ``check_grads`` routed through the rewriter, eighteen cases."""
    import rulesets
    from jax import lax

    def inner(x):
        return lax.cond(x[0] < 2, lambda x: jnp.array([1.0, 2.0], x.dtype) * x, jnp.sin, x)

    def f(x):
        return jax.jit(inner)(x).sum()

    r = rewrite(f, rulesets=[rulesets.algebra, rulesets.derivatives, rulesets.nn], strict=True)
    for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2), (jnp.float16, 1e-3)):
        for v in (2.14, 1.72):
            x = (v * jnp.ones(2)).astype(dtype)
            for differentiate in (jax.grad, lambda g: jax.jit(jax.grad(g))):
                got = differentiate(r)(x)
                assert got.dtype == dtype
                np.testing.assert_allclose(np.float32(got), np.float32(jax.grad(f)(x)), rtol=tol)
            np.testing.assert_allclose(np.float32(jax.jvp(r, (x,), (jnp.ones(2, dtype),))[1]),
                                       np.float32(jax.jvp(f, (x,), (jnp.ones(2, dtype),))[1]), rtol=tol)
        rows = jnp.array([[2.14, 2.14], [1.72, 1.72]], dtype)  # one row per branch, mapped
        np.testing.assert_allclose(np.float32(jax.vmap(jax.grad(r))(rows)), np.float32(jax.vmap(jax.grad(f))(rows)),
                                   rtol=tol)


@pytest.mark.parametrize("order", [1, 2])
def test_a_python_float_primal_differentiated_in_forward_mode(order):
    """``jax.jvp`` keeps a Python float primal as it is; ``jnp.arcsinh`` converts it before its operation, but the
    rewritten program, traced at an array, holds no such conversion, and jax 0.12's JVP rule of ``asinh`` reads its
    primal's ``dtype`` (``AttributeError``: JAX's ``testOpGradSpecialValue`` with ``check_grads`` routed through
    the rewriter). The rewritten function's weakly typed inputs are made arrays before its derivative rules run."""
    from jax.test_util import check_grads

    def f(x):
        return jnp.arcsinh(x) * 1.0

    r = rewrite(f, rulesets=[derivatives], strict=True)
    for x in (1000.0, -0.5, 0.0):
        t = jax.jvp(r, (x,), (1.0,))
        np.testing.assert_allclose(t, jax.jvp(f, (x,), (1.0,)), rtol=1e-6)
        h = jax.jvp(lambda y: jax.jvp(r, (y,), (1.0,))[1], (x,), (1.0,))
        np.testing.assert_allclose(h, jax.jvp(lambda y: jax.jvp(f, (y,), (1.0,))[1], (x,), (1.0,)), rtol=1e-5)
        check_grads(r, (x,), order=order, modes=["fwd", "rev"])


def _scaled_custom_vjp():
    """A ``custom_vjp`` whose backward indexes a residual it forwards (its input ``ts``) with a traced index, as
    ``jax.experimental.ode``'s does, inside a ``jit``, which makes ``ts`` a JAX array, and which the rewrite
    inlines."""
    from jax import lax

    @jax.custom_vjp
    def scaled(ts, y):
        return y * jnp.sum(ts)

    def scaled_bwd(res, g):
        ts, y = res
        total = lax.scan(lambda c, i: (c + ts[i], None), jnp.zeros((), ts.dtype), jnp.arange(ts.shape[0]))[0]
        return jnp.full_like(ts, 1.0) * jnp.sum(g * y), g * total

    scaled.defvjp(lambda ts, y: (scaled(ts, y), (ts, y)), scaled_bwd)
    return jax.jit(lambda ts, y: jnp.sin(scaled(ts, y)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_custom_vjp_whose_backward_indexes_a_forwarded_numpy_input(dtype):
    """``jax.vjp`` keeps a NumPy primal as it is, and differentiated twice the ``custom_vjp`` ran under the outer
    trace and handed its backward the NumPy input, which a traced index cannot index
    (``TracerArrayConversionError``): JAX's ``ode_test`` under ``check_grads(order=2)``, routed."""
    import rulesets
    from jax.test_util import check_grads

    inner = _scaled_custom_vjp()

    def f(ts, y):
        return inner(ts, y) * 2.0

    r = rewrite(f, rulesets=[rulesets.algebra, rulesets.derivatives, rulesets.nn], strict=True)
    ts, y = np.linspace(0.1, 0.4, 4).astype(dtype), np.linspace(0.5, 1.0, 3).astype(dtype)
    check_grads(r, (ts, y), order=2, modes=["rev"], atol=1e-2, rtol=1e-2)

    def second(g):
        return jax.grad(lambda ts, y: jnp.sum(jax.grad(lambda t: jnp.sum(g(t, y)))(ts) ** 2), argnums=(0, 1))

    for got, want in zip(second(r)(ts, y), second(f)(ts, y)):
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_custom_vjp_whose_backward_indexes_a_forwarded_numpy_constant(tmp_path):
    """The same backward, its ``ts`` a NumPy constant the function closes over (JAX's ``ode_test``'s
    ``test_grad_closure``: ``odeint(model, 1., np.arange(0, 10, 0.1))``): the e-graph kept constants as NumPy
    arrays, and the rewritten program, its ``jit`` inlined, handed one to the backward. Read back from the disk
    cache, too."""
    import rulesets
    from jax.test_util import check_grads

    inner, ts = _scaled_custom_vjp(), np.linspace(0.1, 0.4, 4).astype(np.float32)

    def f(y):
        return inner(ts, y) * 2.0

    y = np.linspace(0.5, 1.0, 3).astype(np.float32)
    want = jax.grad(lambda y: jnp.sum(f(y)))(y)
    for _ in range(2):  # written, then read back
        r = rewrite(f, rulesets=[rulesets.algebra, rulesets.derivatives, rulesets.nn], strict=True, cache=tmp_path)
        check_grads(r, (y,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)
        np.testing.assert_allclose(jax.grad(lambda y: jnp.sum(r(y)))(y), want, rtol=1e-6)
        np.testing.assert_allclose(jax.jit(jax.grad(lambda y: jnp.sum(r(y))))(y), want, rtol=1e-6)
    assert r.loaded == 1
