"""What a rewritten function takes as it is called: traced and static arguments, their cache keys, values
closed over from an outer trace, and ``float0`` values (issue 29, items 2, 5 and 6; issue 31, item 7)."""

import dataclasses
import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rulesets
from rewrite import RewriteWarning, rewrite
from rewrite.jaxpr.trace import static_key

X = jnp.linspace(-1.0, 2.0, 6)


# ---------------------------------------------------------------------- Python floats: traced, as jax.jit traces
def test_a_python_float_is_traced_so_its_sign_reaches_the_program():
    rf = rewrite(lambda x, s: x / s)
    np.testing.assert_array_equal(rf(X, 0.0), X / 0.0)
    np.testing.assert_array_equal(rf(X, -0.0), X / -0.0)  # was the cached program of 0.0: +inf for -inf
    assert rf.rewrites == 1


def test_a_schedule_of_python_floats_rewrites_once():
    rf = rewrite(lambda x, lr: x - lr * jnp.sin(x))
    for k in range(20):
        lr = 0.1 * 0.9 ** k
        np.testing.assert_allclose(rf(X, lr), X - lr * jnp.sin(X), rtol=1e-6)
    np.testing.assert_array_equal(rf(X, math.nan), X - math.nan * jnp.sin(X))
    assert rf.rewrites == 1


def test_a_python_float_keeps_jits_weak_type():
    rf = rewrite(lambda x, s: x * s)
    assert rf(jnp.ones(3, jnp.bfloat16), 0.5).dtype == jnp.bfloat16
    assert rf(jnp.ones(3, jnp.float16), 1 + 2j).dtype == jnp.complex64
    assert rf(jnp.ones(3, jnp.int32), 2.5).dtype == jnp.float32  # as jnp promotes an int array and a float
    g = jax.grad(lambda s: rf(X, s).sum())(0.5)
    np.testing.assert_allclose(g, X.sum(), rtol=1e-6)


def test_a_python_int_stays_static_and_can_steer_the_program():
    rf = rewrite(lambda x, n: x[:n].sum() if n else x.sum())
    assert float(rf(X, 2)) == float(X[:2].sum())
    assert float(rf(X, 0)) == float(X.sum())
    assert rf.rewrites == 2


# ---------------------------------------------------------------------- static values: keyed by what tells them apart
def test_static_floats_are_keyed_by_their_bits():
    rf = rewrite(lambda x, s: x / s, static_argnums=1)
    np.testing.assert_array_equal(rf(X, 0.0), X / 0.0)
    np.testing.assert_array_equal(rf(X, -0.0), X / -0.0)
    np.testing.assert_array_equal(rf(X, math.nan), X / math.nan)
    np.testing.assert_array_equal(rf(X, math.nan), X / math.nan)
    assert rf.rewrites == 3  # 0.0, -0.0 and one NaN, found again


@pytest.mark.parametrize("a, b", [(0.0, -0.0), ((0.0,), (-0.0,)), ({"s": 0.0}, {"s": -0.0}), (1, 1.0), (1, True),
                                  ([1.0], (1.0,)), (0j, -0j)])
def test_static_keys_tell_apart_what_traces_differently(a, b):
    assert static_key(a) != static_key(b)
    assert static_key(a) == static_key(a)


def test_an_unhashable_static_value_is_kept_alive_by_its_key():
    k = static_key([np.zeros(2)])  # a list is keyed element by element; an array in it by identity
    assert k == k
    arrays = [np.zeros(2) for _ in range(3)]
    keys = {static_key(a) for a in arrays}
    assert len(keys) == 3


# ---------------------------------------------------------------------- static_argnums and static_argnames as in jax.jit
def test_a_static_argnum_past_the_positional_arguments_names_nothing():
    def f(x, n=2):
        return x * n

    rf = rewrite(f, static_argnums=(1,))
    np.testing.assert_array_equal(rf(X), X * 2)  # the array was taken for static (i % len(args))
    np.testing.assert_array_equal(rf(X + 1), (X + 1) * 2)
    assert rf.rewrites == 1
    np.testing.assert_array_equal(rf(X, n=3), X * 3)  # static through its name, as jax.jit infers it
    assert "n" in rf.static_argnames


def test_a_bare_int_and_a_bare_name_are_accepted():
    def f(x, n, *, mode):
        return x * n if mode == "mul" else x + n

    rf = rewrite(f, static_argnums=1, static_argnames="mode")
    np.testing.assert_array_equal(rf(X, 3, mode="add"), X + 3)
    np.testing.assert_array_equal(jax.jit(rf, static_argnums=1, static_argnames="mode")(X, 3, mode="mul"), X * 3)


def test_static_argnums_a_function_cannot_take_are_an_error():
    with pytest.raises(ValueError, match="static_argnums"):
        rewrite(lambda x: x, static_argnums=(1,))
    with pytest.raises(ValueError, match="static_argnames"):
        rewrite(lambda x: x, static_argnames=("y",))
    with pytest.raises(TypeError, match="static_argnums"):
        rewrite(lambda x: x, static_argnums="0")


def test_a_negative_static_argnum_counts_from_the_end_of_the_call():
    rf = rewrite(lambda x, *rest: x * rest[-1], static_argnums=(-1,))
    np.testing.assert_array_equal(rf(X, 1.0, 3), X * 3)
    assert rf.rewrites == 1


def test_a_function_that_calls_itself_while_traced_is_rewritten():
    # flax's test_jit_recursive: a jitted method calls itself once with another static argument. The inner call
    # is a cache miss of the same rewritten function, made while the outer call holds its lock: it waited on it
    # forever (a plain Lock). Run in a thread so that a deadlock fails the test instead of hanging it.
    import threading

    @functools.partial(rewrite, static_argnames="again")
    def f(x, again=True):
        return (f(x, again=False) if again else x) + 1

    out = []
    worker = threading.Thread(target=lambda: out.append(f(X)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert out, "the recursive call deadlocked"
    np.testing.assert_array_equal(out[0], X + 2)
    assert f.rewrites == 2


# ---------------------------------------------------------------------- values closed over from an outer trace
W = 0.7
XS = jnp.linspace(0.1, 1.3, 5)  # not symmetric: the gradient in w is not zero


def _strict_no_warning():
    return warnings.catch_warnings(record=False)


@pytest.mark.parametrize("how", ["grad", "jit_grad", "jvp", "vmap", "jit", "hessian"])
def test_a_closure_over_a_traced_value_is_rewritten_with_it_as_an_input(how):
    def loss(rw):
        def outer(w):
            return rw(lambda x: jnp.sin(x * w) ** 2)(XS).sum()
        return outer

    plain = loss(lambda f: f)
    rewritten = loss(rewrite)
    ws = jnp.array([0.3, 0.7, 1.1])
    run = {"grad": lambda f: jax.grad(f)(W), "jit_grad": lambda f: jax.jit(jax.grad(f))(W),
           "jvp": lambda f: jax.jvp(f, (W,), (1.0,))[1], "vmap": lambda f: jax.vmap(f)(ws),
           "jit": lambda f: jax.jit(f)(W), "hessian": lambda f: jax.hessian(f)(W)}[how]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewriteWarning)
        got = run(rewritten)
    want = run(plain)
    assert np.all(np.asarray(want) != 0)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_closure_in_a_loop_body_of_a_jitted_function():
    def body(i, c):
        return rewrite(lambda x: jnp.sin(x + c))(XS).sum()  # c: a value of the loop's trace

    got = jax.jit(lambda c0: jax.lax.fori_loop(0, 3, body, c0))(0.5)
    want = jax.lax.fori_loop(0, 3, lambda i, c: jnp.sin(XS + c).sum(), 0.5)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_one_rewritten_closure_reuses_its_rewrite_across_the_outer_traces_values():
    box = {}

    def f(x):
        return jnp.sin(x * box["w"])

    rf = rewrite(f)

    def loss(w):
        box["w"] = w
        return rf(XS).sum()

    for w in (0.3, 0.7):
        np.testing.assert_allclose(jax.grad(loss)(w), jax.grad(lambda w: jnp.sin(XS * w).sum())(w), rtol=1e-6)
    assert rf.rewrites == 1  # the second trace is the same program: its captured value is the new input
    box["w"] = 2.0  # now a concrete value, baked in: a different program
    np.testing.assert_allclose(rf(XS), jnp.sin(XS * 2.0), rtol=1e-6)
    assert rf.rewrites == 2


# ---------------------------------------------------------------------- float0: tangents of integer and boolean values
def test_the_jvp_of_a_function_with_integer_and_boolean_outputs_is_rewritten():
    f = lambda x: (jnp.sin(x), x > 0, jnp.argmax(x))  # noqa: E731
    rf = rewrite(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewriteWarning)
        got = jax.jvp(rf, (X,), (jnp.ones(6),))
    want = jax.jvp(f, (X,), (jnp.ones(6),))
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-6)
    assert got[1][1].dtype == jax.dtypes.float0 and got[1][2].dtype == jax.dtypes.float0
    assert rf.derivative_rewrites == {"jvp": 1}


def test_a_program_holding_a_float0_literal_is_rewritten():
    f = lambda x, m: jnp.where(m, jnp.sin(x), 0.0)  # noqa: E731
    g = lambda x, m: jax.vjp(f, x, m)[1](jnp.ones(6))  # the mask's cotangent: a float0 literal  # noqa: E731
    m = X > 0
    assert "float0" in str(jax.make_jaxpr(g)(X, m))
    rg = rewrite(g)
    got, want = rg(X, m), g(X, m)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert got[1].dtype == jax.dtypes.float0 and got[1].shape == (6,)
    assert rg.result(X, m).stopped == "saturated"


def test_a_float_argument_that_steers_python_control_flow_stays_static_with_a_warning():
    def f(x, p):
        return x if p == 0 else x * p  # as equinox's Dropout branches on its rate

    rf = rewrite(f)
    with pytest.warns(RewriteWarning, match="branches in Python on a float argument"):
        np.testing.assert_array_equal(rf(X, 0.0), X)
    np.testing.assert_array_equal(rf(X, 2.0), X * 2.0)
    assert rf.rewrites == 2


def test_a_float_inside_a_pytree_stays_static():
    rf = rewrite(lambda x, cfg: x if cfg["p"] == 0 else x * cfg["p"])
    np.testing.assert_array_equal(rf(X, {"p": 0.0}), X)
    np.testing.assert_array_equal(rf(X, {"p": -0.0}), X)
    np.testing.assert_array_equal(rf(X, {"p": 3.0}), X * 3.0)
    assert rf.rewrites == 3


@pytest.mark.parametrize("jit", [False, True])
def test_a_mutable_array_argument_is_written_in_place_and_left_as_written(jit):
    """A ``Ref`` (``jax.new_ref``) was taken for a static value: the function was traced with it as a constant and
    raised ("JAX arrays are immutable"), where ``jax.jit`` writes it in place. It is traced as a ``Ref`` now, and
    the program, whose equations' effects name that input, is run as written, with a warning that says so."""
    from jax._src import core

    new_ref = getattr(jax, "new_ref", None) or core.new_ref

    def f(x_mut, y):
        x_mut[...] += y
        x_mut[0] += 1.0
        return jnp.sum(y * 2.0)

    r = rewrite(f, strict=False)  # (strict: the warning is an error)
    x, y = new_ref(jnp.zeros(3)), jnp.arange(3.0)
    with pytest.warns(RewriteWarning, match="mutable arrays"):
        out = (jax.jit(r) if jit else r)(x, y)
    np.testing.assert_allclose(x[...], [1.0, 1.0, 2.0])
    np.testing.assert_allclose(out, 6.0)
    (jax.jit(r) if jit else r)(x, y)  # again: written in place once more, without a second warning
    np.testing.assert_allclose(x[...], [2.0, 2.0, 4.0])


def test_a_program_making_a_mutable_array_is_left_as_written():
    """A ``Ref`` made inside the function (``jax.new_ref``): its program is run as written, with a warning, not
    loaded into the e-graph."""
    from jax._src import core

    new_ref = getattr(jax, "new_ref", None) or core.new_ref

    def f(x):
        acc = new_ref(jnp.zeros_like(x))
        acc[...] += jnp.sin(x)
        acc[...] += jnp.cos(x)
        return acc[...] * 2.0

    x = jnp.linspace(-1.0, 1.0, 5)
    r = rewrite(f, strict=False)
    with pytest.warns(RewriteWarning, match="mutable arrays"):
        got = r(x)
    np.testing.assert_allclose(got, f(x), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(r)(x), f(x), rtol=1e-6)


# ---------------------------------------------------------------------- hijax values: a Box
def _box(value):  # (hijax: JAX's experimental home of types above arrays)
    from jax._src import hijax

    if not hasattr(hijax, "Box"):
        pytest.skip("this JAX's hijax has no Box (jax 0.12 has none)")
    return hijax.Box(value)


def test_a_box_passed_to_a_jitted_function_is_left_as_written():
    """A ``Box`` passed under ``jax.jit`` was traced as an array: ``TypeError: Argument 'BoxTy()' ... is not a
    valid JAX type`` (hijax_test's BoxTest.test_jit_arg, routed). It is closed over, and the program, which holds
    it, is run as written, with a warning."""
    def f(box, x):
        box.set(box.get() + x)
        return x * 2.0

    r, box, other = rewrite(f, strict=False), _box(1.0), _box(10.0)
    with pytest.warns(RewriteWarning, match="hijax"):
        out = jax.jit(r)(box, 2.0)
    again = jax.jit(r)(other, 5.0)  # another trace, another Box of the same type: its program, not box's
    np.testing.assert_allclose(out, 4.0)
    np.testing.assert_allclose(again, 10.0)
    np.testing.assert_allclose(box.get(), 3.0)
    np.testing.assert_allclose(other.get(), 15.0)


def test_a_box_closed_over_is_read_and_written_as_a_box():
    """A ``Box`` closed over was loaded as a NumPy object array: the rewritten program's scan raised ``Error
    interpreting argument to scan`` (hijax_test's BoxTest.test_scan_basic, routed)."""
    box = _box(1.0)

    def double_it_3():
        def body(_, __):
            box.set(box.get() * 2)
            return None, None
        jax.lax.scan(body, None, None, length=3)

    with pytest.warns(RewriteWarning, match="hijax"):
        jax.jit(rewrite(double_it_3, strict=False))()
    np.testing.assert_allclose(box.get(), 8.0)


def test_a_box_whose_contents_change_type_is_traced_again():
    """A Box's type is that of what it holds: the program traced for ``Box([])`` was run again for ``Box([1.0])``
    and JAX raised ``ValueError: foreach() argument 2 is longer than argument 1`` (hijax_test's
    BoxTest.test_nested_jit, routed)."""
    box = _box([])

    def g():
        box.set(box.get() + [1.0])

    r = rewrite(g, strict=False)
    with pytest.warns(RewriteWarning, match="hijax"):
        jax.jit(lambda: (r(), r()))()
    np.testing.assert_allclose(box.get(), [1.0, 1.0])


# ---------------------------------------------------------------------- JAX's configuration a trace reads
def _precisions(closed):
    return {str(e.params.get("precision")) for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"}


@pytest.mark.parametrize("jit", [False, True])
def test_a_program_traced_under_one_matmul_precision_is_not_run_under_another(jit):
    """`jax.default_matmul_precision` is read as a function is traced (it becomes the `dot_general`'s
    precision). A rewritten function called first outside it and then inside ran the program traced first:
    on a GPU, float32 products at TF32 where the user asked for the highest precision."""
    f = rewrite(lambda a, b: jnp.tanh(a @ b))
    call = jax.jit(f) if jit else f
    a = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    b = jnp.linspace(0.5, -0.5, 8).reshape(4, 2)
    call(a, b)
    assert _precisions(f.jaxpr(a, b)) == {"None"}
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(call(a, b), jnp.tanh(a @ b), rtol=1e-6)
        assert _precisions(f.jaxpr(a, b)) == {"(Precision.HIGHEST, Precision.HIGHEST)"}
    assert _precisions(f.jaxpr(a, b)) == {"None"}
    assert f.rewrites == 2
    with jax.default_matmul_precision("highest"):  # and each is rewritten once
        call(a, b)
    assert f.rewrites == 2


def test_rank_promotion_raise_is_honoured_after_a_call_outside_it():
    f = rewrite(lambda x, y: x + y)
    f(jnp.ones((2, 3)), jnp.ones(3))
    with jax.numpy_rank_promotion("raise"), pytest.raises(ValueError, match="rank_promotion"):
        f(jnp.ones((2, 3)), jnp.ones(3))


@pytest.mark.parametrize("dtype, f", [
    (jnp.float64, lambda a: jnp.sin(a) * 2.0),
    (jnp.int64, lambda a: a.astype(jnp.int32) + 1),
    (jnp.complex128, lambda a: a * 1j),
])
@pytest.mark.parametrize("jit", [False, True])
def test_a_64_bit_array_made_under_enable_x64_is_taken_as_jit_takes_it(dtype, f, jit):
    """An array made inside `jax.enable_x64()` keeps its 64-bit type outside it. The rewriter traced it as the
    32-bit type (its spec canonicalized) but ran the program on the 64-bit array: `mul` of float64 and float32
    raised, and under JAX's checks the types disagreed (JAX's x64_context_test). It is converted as jit does."""
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on: nothing to canonicalize")
    with jax.enable_x64():
        x = jnp.linspace(-1.0, 1.0, 6).astype(dtype)
    g = rewrite(f, rulesets=["algebra"], strict=True)
    call = jax.jit(g) if jit else g
    got, want = call(x), jax.jit(f)(x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    if dtype == jnp.float64:
        grad = jax.grad(lambda a: jnp.sum(g(a)))(x)
        want_grad = jax.grad(lambda a: jnp.sum(jax.jit(f)(a)))(x)
        assert grad.dtype == want_grad.dtype
        np.testing.assert_allclose(grad, want_grad, rtol=1e-6)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_a_typed_prng_key_is_an_argument_and_a_result(impl):
    """`jax.random.key` arrays have an extended dtype, 8 bytes for threefry: the 64-bit conversion above must
    leave them alone (it raised `canonicalize_dtype called on extended dtype`)."""
    f = lambda k, x: (jax.random.normal(k, x.shape) * x, jax.random.split(k)[0])  # noqa: E731
    key = jax.random.key(0, impl=impl)
    for g in (rewrite(f, rulesets=["algebra"], strict=True), jax.jit(rewrite(f, rulesets=["algebra"], strict=True))):
        (y, k2), (want_y, want_k2) = g(key, X), f(key, X)
        np.testing.assert_array_equal(y, want_y)
        np.testing.assert_array_equal(jax.random.key_data(k2), jax.random.key_data(want_k2))
    grad = jax.grad(lambda x: jnp.sum(rewrite(f, strict=True)(key, x)[0]))(X)
    np.testing.assert_array_equal(grad, jax.grad(lambda x: jnp.sum(f(key, x)[0]))(X))


@pytest.mark.parametrize("jit", [False, True])
def test_an_array_in_host_memory_is_traced_in_host_memory(jit):
    """An array offloaded to host memory (`memory_kind="pinned_host"`, a memory saving on an accelerator) has a
    type of its own (`float32<host>`). The rewriter traced it as a device array (no spec names host memory), and
    its key did not tell the two apart: JAX's checks refused the program (export_test), and a function called
    first with a device array ran that program on the host one."""
    from jax.sharding import SingleDeviceSharding

    host = jax.device_put(np.linspace(-1.0, 1.0, 6, dtype=np.float32),
                          SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    f = lambda x: jnp.sin(x) * 1.0 + x  # noqa: E731
    g = rewrite(f, rulesets=["algebra"], strict=True)
    call = jax.jit(g) if jit else g
    for x in (X, host, X):
        got, want = call(x), jax.jit(f)(x)
        assert jax.typeof(got) == jax.typeof(want)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert g.rewrites == 2


_KEY = jax.random.key(3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_closed_over_prng_key_is_a_constant_of_the_rewritten_program(dtype):
    """A key made at the top of a module and read inside the function is a constant of its program, of an
    extended dtype that no NumPy array holds: the load raised `TypeError`, so the function ran as written
    with a warning (key_reuse_test, pjit_test). The program holds the very key object (``jaxapi.held_as_is``)."""
    f = lambda x: x + jax.random.normal(_KEY, x.shape, dtype) * 1.0  # noqa: E731
    x = X.astype(dtype)
    g = rewrite(f, rulesets=["algebra"], strict=True, cache=False)
    np.testing.assert_array_equal(np.asarray(g(x), np.float32), np.asarray(f(x), np.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(g)(x), np.float32), np.asarray(jax.jit(f)(x), np.float32))
    grad = jax.grad(lambda x: jnp.sum(g(x).astype(jnp.float32)))(x)
    np.testing.assert_array_equal(np.asarray(grad, np.float32), 1.0)
    assert g.result(x).stats["mul_one"].fired == 1
    assert any(c is _KEY for c in g.result(x).after.consts)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_closed_over_key_used_twice_is_caught_by_jax_key_reuse_checker(dtype):
    """Under ``jax_debug_key_reuse`` a key the function closes over, consumed by one call of its jit and passed
    again by the next, raises ``KeyReuseError``: JAX follows each key object into the programs it is passed to.
    The rewritten program held a key made again from the key's data, which JAX does not follow, so the reuse went
    unseen (key_reuse_test's ``test_closed_over_key_reuse_jit``, routed). It holds the very key now."""
    key = jax.random.key(5)
    scaled = lambda: jax.random.uniform(key, (3,), dtype) * 1.0  # noqa: E731
    # one jitted call (uniform's): run compiled eagerly, its jit nested in a caller's (JAX's own nested jits raised
    # "sink 0 out of range" where the inner one closes over the key; the rewritten program passes it as an argument)
    alone = lambda: jax.random.uniform(key, (3,), dtype)  # noqa: E731
    with jax.debug_key_reuse(True):
        for g in (jax.jit(scaled), jax.jit(rewrite(scaled, rulesets=["algebra"], strict=True, cache=False)),
                  jax.jit(rewrite(alone, rulesets=["algebra"], strict=True, cache=False)),
                  rewrite(alone, rulesets=["algebra"], strict=True, cache=False)):
            key = jax.random.key(5)
            first = g()
            with pytest.raises(jax.errors.KeyReuseError, match="Previously-consumed key"):
                g()
            np.testing.assert_array_equal(np.asarray(first, np.float32),
                                          np.asarray(jax.random.uniform(jax.random.key(5), (3,), dtype), np.float32))


def test_a_function_whose_trace_calls_its_own_rewrite_again_is_rewritten():
    """equinox's ``filter_jit`` jits one wrapper per function name, and lineax's ``linear_solve`` (GMRES) calls
    ``linear_solve`` (QR) while it is traced: routed, the one rewrite held its lock through the outer trace and the
    inner call waited on it for ever (lineax's test_gmres_large_dense hung). As ``jax.jit`` does, it is rewritten."""
    import threading

    def f(x, depth):
        return jnp.sin(x) if depth == 0 else g(x * 2.0, depth - 1) + 1.0

    g = rewrite(f, static_argnums=(1,), strict=True)
    x = jnp.linspace(-1.0, 1.0, 4)
    out = []
    worker = threading.Thread(target=lambda: out.append(g(x, 2)), daemon=True)  # a hang fails, not blocks, the run
    worker.start()
    worker.join(60)
    assert out, "the nested call never returned"
    np.testing.assert_allclose(out[0], jnp.sin(x * 4.0) + 2.0, rtol=1e-6)
    assert g.rewrites == 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Cells:
    """jax-md's ``NeighborList`` in small: a static field that holds an array (its cell size, the cutoff given)."""
    x: jax.Array
    size: Any = dataclasses.field(metadata={"static": True})


def _cell_energy(cells, s):
    return jnp.sum(jnp.sin(cells.x * s) ** 2)


def test_a_pytree_with_an_array_in_its_metadata_runs_under_an_outer_jit():
    """Inside ``jax.jit``'s trace, the rewrite's lookup of a signature and JAX's ``make_jaxpr`` of the named arguments
    compared such metadata as a staged ``eq``: ``ValueError: Exception raised while checking equality of metadata
    fields of pytree`` where ``jax.jit(f)`` runs (19 of jax-md's ``smap_test`` routed through the rewriter). Under
    ``jit``, ``grad`` and eagerly, with the metadata the same and changed between calls."""
    r = rewrite(_cell_energy, rulesets=[rulesets.algebra], strict=True, cache=False)
    x = jnp.linspace(0.0, 1.0, 8)
    for size in (0.5, 0.5, 0.7):
        cells = _Cells(x, jnp.float32(size))
        want = _cell_energy(cells, 2.0)
        np.testing.assert_allclose(jax.jit(r)(cells, 2.0), want, rtol=1e-6)
        np.testing.assert_allclose(r(cells, 2.0), want, rtol=1e-6)
        got, ref = jax.jit(jax.grad(r))(cells, 2.0), jax.grad(_cell_energy)(cells, 2.0)
        np.testing.assert_allclose(got.x, ref.x, rtol=1e-6)
    assert r.rewrites >= 1
