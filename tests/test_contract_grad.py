"""The contract over the derivative path: every pack keeps the derivatives JAX computes (issue 29).

``tests/test_contract.py`` holds every pack to its values; this holds every
built-in pack, and all of them together, to its derivatives. A rewritten
function is differentiated through the programs the rewriter builds for each
transformation (``rewrite/_grad.py``: a rewritten VJP for reverse mode, a
rewritten JVP for forward mode), so a rule can keep every value and still
change a gradient: at a kink (``|x|``, ``max`` and ``relu`` at 0, ``where``
at its switch, ``clip`` at its ends) two forms of one value can differ in
derivative, and a derivative program can lose its inputs' dtype.

Each case is one pack and one dtype (float64, float32, float16, bfloat16),
and its programs mix dtypes: an input of the dtype is computed on in float32
(float64 stays float64), one output is cast back to the dtype and one is
float32, and a float32 input feeds both. ``jax.grad``, ``jax.vjp``,
``jax.jvp``, ``jax.jacfwd`` and ``jax.value_and_grad`` of the rewritten
function, under ``jit`` and eagerly (in the default run, eagerly only
``grad`` and ``jvp``: one through each derivative program), are compared with the same
transformation of the original by :func:`rewrite.testing.derivative_mismatch`
at the tolerance of the pack's class for each result's dtype: on a program
written around kinks, at the kinks and at random points (hypothesis), and
(marked ``slow``) on random programs from :func:`rewrite.testing.programs`.
The default run takes every pack at float32 and all packs together at every
dtype (:data:`DEFAULT`); ``-m slow`` runs the rest of the matrix.

Cases the core cannot pass yet are listed once, in :data:`CORE_BUGS`, with
the reason; they are strict xfails, so a fix makes them fail until the entry
goes.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from jax import lax

import rulesets
from rewrite import RewriteLimitWarning, Tolerance, rewrite
from rewrite.testing import VacuousCheckWarning, arrays, derivative_mismatch, inputs_like, programs, soundness_of

from .packcheck import examples

#: Packs that act only on programs far larger than this file's 8-element kink program: their derivatives
#: are tested where they act (attention over more than 256 keys: tests/test_attention.py, grad, vjp,
#: value_and_grad under jit and vmap, jvp, jacfwd, linearize, special values, against the original and float64).
SIZED = {"attention"}
PACKS = sorted((name, pack) for name, pack in rulesets.BUILTIN.items() if name not in SIZED)
ALL = functools.reduce(lambda a, b: a + b, [p for _, p in PACKS])
CASES = PACKS + [("all", ALL)]
DTYPES = {"float64": np.dtype(np.float64), "float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(jnp.bfloat16)}

#: The cases that fail because of a bug in the core, by dtype; each is a strict xfail until the fix lands.
CORE_BUGS: dict[str, str] = {}  # none: bfloat16's zero derivatives (issue 29 item 1) are fixed

TRANSFORMS = ("grad", "value_and_grad", "vjp", "jvp", "jacfwd")


def _marks(dtype: str) -> list:
    return [pytest.mark.xfail(strict=True, reason=CORE_BUGS[dtype])] if dtype in CORE_BUGS else []


#: The default run's cases: every pack at float32, all packs together at every dtype. The rest are ``slow``.
DEFAULT = {(name, "float32") for name, _ in CASES} | {("all", dtype) for dtype in DTYPES}
#: Transformations run eagerly in the default run: one through each derivative program the rewriter builds
#: (reverse mode's VJP, forward mode's JVP). Every transformation runs under jit, and eagerly in ``slow``.
EAGER = ("grad", "jvp")


def _params() -> list:
    out = []
    for dtype in DTYPES:
        for name, pack in CASES:
            marks = _marks(dtype) + ([] if (name, dtype) in DEFAULT else [pytest.mark.slow])
            out.append(pytest.param(name, pack, dtype, id=f"{name}-{dtype}", marks=marks))
    return out


def _phases(dtype: str) -> tuple:
    """No shrinking where a core bug is known to fail every example: it would only spend minutes on it."""
    phases = tuple(settings.default.phases)
    return tuple(p for p in phases if p != Phase.shrink) if dtype in CORE_BUGS else phases


@contextlib.contextmanager
def _precision(dtype: str):
    """float64 needs x64 for the whole case (the rewrite, both programs and every transformation)."""
    with jax.enable_x64(dtype == "float64"), warnings.catch_warnings():
        warnings.simplefilter("ignore", VacuousCheckWarning)
        warnings.simplefilter("ignore", RewriteLimitWarning)
        yield


def _inner(dtype: np.dtype) -> np.dtype:
    """What an input of ``dtype`` is computed in: float32 for the 16-bit floats, as mixed precision does."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


# ---------------------------------------------------------------------- programs
def kinks(dtype: np.dtype):
    """A program written around kinks and around what the packs rewrite, with mixed dtypes.

    ``x`` (of ``dtype``) is computed on in float32 (float64 stays float64); ``y`` is float32; the first
    output is cast back to ``dtype``, the second is float32.
    """
    inner = _inner(dtype)

    def f(x, y):
        u = x.astype(inner)
        v = y.astype(inner)
        kinked = (jnp.abs(-u) + jnp.abs(jnp.abs(u)) + jnp.maximum(u, 0.0) + jnp.minimum(u, u)
                  + jax.nn.relu(u) + jnp.where(u > 0, u, 0.1 * u) + jnp.clip(u, -1.0, 1.0) + jnp.maximum(u, v))
        t = jnp.tanh(u)
        smooth = (2.0 * jnp.sin(t) * jnp.cos(t) + jnp.log(1.0 + jnp.exp(u)) + -(-u) * 1.0 + (u * u) * u
                  + jnp.cos(t) ** 2 - jnp.sin(t) ** 2 + 1.0 - jax.nn.sigmoid(u))
        m = (u * v).reshape(2, 4)
        mat = ((m @ m.T) @ m).sum(0) + jax.nn.log_softmax(m, axis=-1).sum(0)
        stacked = lax.scan(lambda c, r: (c + r, jnp.sin(r) * v[:4]), jnp.zeros(4, inner), m)[1].sum(0)
        out_low = (kinked * v).astype(dtype)
        out_f32 = (smooth.sum() + mat.sum() + stacked.sum()).astype(np.float32)
        return out_low, out_f32

    f.__name__ = f"kinks_{dtype.name}"
    return f


#: The kinks of the program above: ±0 (abs, max, relu, where), ±1 (clip's ends), and ordinary points.
KINK_X = [0.0, -0.0, 1.0, -1.0, 0.5, -2.0, 0.25, -0.75]
KINK_Y = [0.0, -0.0, 1.5, -1.0, 0.5, 2.0, -0.25, 0.75]  # max(u, v) ties where x == y


class Mixed:
    """A random program in its inner dtype, between inputs of ``dtype`` and outputs alternating ``dtype``/float32."""

    def __init__(self, program, dtype: np.dtype) -> None:
        self.program, self.dtype = program, dtype
        self.inner = np.dtype(program.dtype)
        self.__name__ = f"mixed_{dtype.name}"

    @property
    def args(self):
        return tuple(jax.ShapeDtypeStruct(a.shape, self.dtype) for a in self.program.args)

    def __call__(self, *xs):
        outs = jax.tree_util.tree_leaves(self.program(*[x.astype(self.inner) for x in xs]))
        return [o.astype(self.dtype if i % 2 == 0 else np.float32) for i, o in enumerate(outs)]

    def __repr__(self) -> str:
        return f"{self.program!r}\n  (inputs {self.dtype.name} cast to {self.inner.name}, outputs {self.dtype.name}/float32)"


# ---------------------------------------------------------------------- transformations
def _floats(tree):
    return [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def _loss(fn):
    return lambda *xs: sum(jnp.sum(o.astype(np.float32)) for o in _floats(fn(*xs)))


def _directions(like, seed: int):
    """Fixed tangents or cotangents shaped like ``like``: ordinary numbers of both signs, none zero."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray((rng.uniform(0.5, 2.0, np.shape(x)) * rng.choice([-1.0, 1.0], np.shape(x))).astype(x.dtype))
            for x in like]


def transform(kind: str, fn, args):
    """``kind`` of ``fn`` at ``args`` (all inputs differentiated), as a function of the inputs, for eager or jit."""
    argnums = tuple(range(len(args)))
    if kind == "grad":
        return jax.grad(_loss(fn), argnums=argnums)
    if kind == "value_and_grad":
        return jax.value_and_grad(_loss(fn), argnums=argnums)
    if kind == "jacfwd":
        return jax.jacfwd(lambda *xs: _floats(fn(*xs)), argnums=argnums)
    if kind == "jvp":
        tangents = tuple(_directions(args, 1))
        return lambda *xs: jax.jvp(lambda *a: _floats(fn(*a)), xs, tangents)
    if kind == "vjp":
        def vjp(*xs):
            outs, pullback = jax.vjp(lambda *a: _floats(fn(*a)), *xs)
            return outs, pullback(_directions(outs, 2))
        return vjp
    raise ValueError(kind)


def compare(want, got, tolerance: Tolerance, what: str) -> None:
    w_leaves, w_tree = jax.tree_util.tree_flatten(want)
    g_leaves, g_tree = jax.tree_util.tree_flatten(got)
    assert w_tree == g_tree, f"{what}: structure {g_tree} instead of {w_tree}"
    for i, (w, g) in enumerate(zip(w_leaves, g_leaves)):
        why = derivative_mismatch(w, w, g, tolerance=tolerance)
        assert why is None, f"{what}, result {i}: {why}\n  original  {np.asarray(w)!r}\n  rewritten {np.asarray(g)!r}"


def all_transforms(fn, args, kinds=TRANSFORMS):
    """One function of the inputs returning every transformation in ``kinds`` of ``fn``: one compilation under jit."""
    ts = {kind: transform(kind, fn, args) for kind in kinds}
    return lambda *xs: {kind: t(*xs) for kind, t in ts.items()}


def check_transforms(want: dict, got: dict, tolerance: Tolerance, name: str) -> None:
    """Every transformation of the rewritten function (``got``) against the same transformation of the original."""
    for kind in want:
        compare(want[kind], got[kind], tolerance, f"{name}: {kind}")


class _Composed(Tolerance):
    """A pack's tolerance (``Tolerance()`` for the exact class, whose derivatives are new programs) for a whole
    program: a few rewritten terms summed can move a result by a few times what one rule may (4x), and the
    16-bit floats' tolerances, scaled from float32's by epsilon, are capped at 10%, so that a zero or a flipped
    sign (a relative error of 1 or 2) is never within them."""

    def for_dtype(self, dtype):
        rtol, atol = super().for_dtype(dtype)
        return min(4 * rtol, 0.1), min(4 * atol, 0.1)


def _tolerance(pack) -> Tolerance:
    _, tol = soundness_of([pack])
    tol = tol or Tolerance()
    return _Composed(tol.rtol, tol.atol)


class Case:
    """One pack at one dtype on the kink program: the rewritten function and the jitted transformations of both sides.

    Built once per session (compiling is what costs time), so the kink and random-point tests share them.
    """

    def __init__(self, name: str, dtype: str) -> None:
        self.name, self.pack, self.dtype = name, dict(CASES)[name], DTYPES[dtype]
        self.fn = kinks(self.dtype)
        self.rewritten = rewrite(self.fn, rulesets=[self.pack], strict=True)
        self.args = _kink_args(self.dtype)
        self.eager = all_transforms(self.rewritten, self.args, EAGER if (name, dtype) in DEFAULT else TRANSFORMS)
        self.jit = jax.jit(all_transforms(self.rewritten, self.args))
        self.tolerance = _tolerance(self.pack)

    def fired(self) -> dict:
        return {k: s.fired for k, s in self.rewritten.result(*self.args).stats.items() if s.fired}

    def check(self, args, modes=("eager", "jit")) -> None:
        want = _original(self.dtype.name)(*args)
        for mode in modes:
            got = (self.eager if mode == "eager" else self.jit)(*args)
            check_transforms({k: want[k] for k in got}, got, self.tolerance, f"{self.name} ({self.dtype.name}, {mode})")


@functools.lru_cache(maxsize=None)
def _case(name: str, dtype: str) -> Case:
    return Case(name, dtype)


@functools.lru_cache(maxsize=None)
def _original(dtype: str):
    d = DTYPES[dtype]
    return jax.jit(all_transforms(kinks(d), _kink_args(d)))


def _kink_args(dtype: np.dtype):
    return jnp.asarray(np.asarray(KINK_X, np.float64).astype(dtype)), jnp.asarray(np.float32(KINK_Y))


# ---------------------------------------------------------------------- the tests
@pytest.mark.parametrize("name,pack,dtype", _params())
def test_derivatives_at_kinks(name, pack, dtype):
    with _precision(dtype):
        case = _case(name, dtype)
        assert case.fired(), f"no rule of {name!r} fired on the kink program: the check would be vacuous"
        case.check(case.args)


@pytest.mark.parametrize("name,pack,dtype", _params())
def test_derivatives_at_random_points(name, pack, dtype):
    soundness, _ = soundness_of([pack])
    domain = "fastmath" if soundness == "fastmath" else "identity"

    @settings(max_examples=examples(2), phases=_phases(dtype))
    @given(arrays((8,), DTYPES[dtype], domain), arrays((8,), np.float32, domain))
    def run(x, y):
        with _precision(dtype):
            _case(name, dtype).check((jnp.asarray(x), jnp.asarray(y)), modes=("jit",))

    run()


@pytest.mark.slow
@pytest.mark.parametrize("name,pack,dtype", _params())
def test_derivatives_of_random_programs(name, pack, dtype):
    soundness, _ = soundness_of([pack])

    @settings(max_examples=examples(10), phases=_phases(dtype))
    @given(programs(max_ops=5, control_flow=True, dtype=_inner(DTYPES[dtype])), st.data())
    def run(program, data):
        with _precision(dtype):
            fn = Mixed(program, DTYPES[dtype])
            args = data.draw(inputs_like(fn.args, "fastmath" if soundness == "fastmath" else "identity"), label="args")
            args = tuple(jnp.asarray(a) for a in args)
            rewritten = rewrite(fn, rulesets=[pack], strict=True)
            want = jax.jit(all_transforms(fn, args))(*args)
            for mode in ("eager", "jit"):
                t = all_transforms(rewritten, args)
                got = (jax.jit(t) if mode == "jit" else t)(*args)
                try:
                    check_transforms(want, got, _tolerance(pack), f"{name} ({dtype}, {mode})")
                except AssertionError as e:
                    raise AssertionError(f"{e}\n  program: {fn!r}") from None

    run()
