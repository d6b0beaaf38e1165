"""A small local helper for the rule-pack tests: inputs with special values, and exact or tolerant comparison.

Random inputs come from ``rewrite.testing``'s strategies (``arrays(shape, dtype)``
draws exact-class values); :func:`special_array` cycles through the same
special values, so the pack tests and ``check_ruleset`` try the same ones.

``exact`` means bitwise-equal results where any NaN equals any NaN. XLA:CPU
flushes subnormals to zero at run time (FTZ/DAZ, see
``test_xla_cpu_flushes_subnormals_at_run_time``) but not when it simplifies
or folds at compile time, so a program run op by op (eagerly) and the same
program under ``jax.jit`` can already disagree on subnormals. Exact rules are
therefore checked bitwise under ``jit``, where both programs get XLA's
compile-time treatment, and bitwise up to flushing subnormals when run eagerly.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax.extend.core  # noqa: F401  (jaxpr_as_fun)

from rewrite import Ruleset
from rewrite.jaxpr.trace import is_traced_leaf
from rewrite.testing import derivative_mismatch
from rewrite.testing._strategies import _specials

from .corpus import corpus


def examples(ci: int) -> int:
    """Hypothesis examples for a test whose every example checks many rules at once.

    ``ci`` under the quick default profile; the ``thorough`` profile's count otherwise.
    """
    from hypothesis import settings

    return ci if settings.default.max_examples <= 25 else settings.default.max_examples


def specials(dtype: Any) -> list[Any]:
    """Values every exact rule must survive: ``rewrite.testing``'s list for the exact class (signed zeros,
    infinities, NaN, subnormals, extremes), which its strategies draw from too."""
    return _specials(dtype, "exact")


def special_array(dtype: Any, shape: Sequence[int], shift: int = 0) -> np.ndarray:
    """An array holding every special value of ``dtype`` (cycled), rotated by ``shift``."""
    vals = specials(dtype)
    n = int(np.prod(shape))
    idx = (np.arange(n) + shift) % len(vals)
    with np.errstate(all="ignore"):
        return np.asarray([vals[i] for i in idx]).astype(dtype).reshape(shape)


# ---------------------------------------------------------------------- comparison
def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def flush_subnormals(a: np.ndarray) -> np.ndarray:
    a = np.array(a)
    if jnp.issubdtype(a.dtype, jnp.floating):
        tiny = float(jnp.finfo(a.dtype).tiny)
        with np.errstate(all="ignore"):
            small = np.abs(a.astype(np.float64)) < tiny
        a[small] = np.copysign(0.0, a.astype(np.float64)[small]).astype(a.dtype)
    return a


def assert_same_bits(got: Any, want: Any, *, flush: bool = False, context: str = "") -> None:
    """Bitwise equality of every leaf, any NaN equal to any NaN; ``flush`` first flushes subnormals."""
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, f"{context}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        if flush:
            g, w = flush_subnormals(g), flush_subnormals(w)
        if jnp.issubdtype(g.dtype, jnp.inexact):
            nan = np.isnan(g) & np.isnan(w)
            differ = (_bits(g) != _bits(w)) & ~nan
        else:
            differ = g != w
        if differ.any():
            i = np.flatnonzero(differ)[:5]
            raise AssertionError(f"{context}: results differ at {i.tolist()}: got {g.ravel()[i]} want {w.ravel()[i]}")


def assert_close(got: Any, want: Any, rtol: float, atol: float, context: str = "") -> None:
    """Equal as numbers within ``rtol``/``atol`` (so -0.0 == 0.0), NaN where the other is NaN."""
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, equal_nan=True, err_msg=context)


# ---------------------------------------------------------------------- running a ruleset
_REFERENCE: dict[tuple, list[Any]] = {}


class Side:
    """Many programs, each before and after its rewrite, evaluated side by side in one program per side.

    ``reports`` are :func:`rewrite.explain` reports; ``specs`` holds one
    entry per input of each program; ``names`` label failures. Compiling is
    the slow part of these tests, so all programs share two compilations.
    """

    def __init__(self, reports: Sequence[Any], specs: Sequence[Sequence[Any]], names: Sequence[str],
                 reference: str | None = None) -> None:
        self._setup([jax.extend.core.jaxpr_as_fun(r.before) for r in reports],
                    [jax.extend.core.jaxpr_as_fun(r.after) for r in reports], specs, names)
        # Programs with fixed inputs (the corpus) give the same original outputs
        # to every pack's test: computed once per session under this key.
        self.reference = None if reference is None else (reference, tuple(names))

    @classmethod
    def of_functions(cls, befores: Sequence[Callable[..., Any]], afters: Sequence[Callable[..., Any]],
                     specs: Sequence[Sequence[Any]], names: Sequence[str]) -> "Side":
        side = cls.__new__(cls)
        side._setup(befores, afters, specs, names)
        return side

    def _setup(self, befores: Sequence[Callable[..., Any]], afters: Sequence[Callable[..., Any]],
               specs: Sequence[Sequence[Any]], names: Sequence[str]) -> None:
        self.names = list(names)
        self.sizes = [len(s) for s in specs]
        self.reference = None
        self.before = self._join(befores)
        self.after = self._join(afters)
        self.jit_before = jax.jit(self.before)
        self.jit_after = jax.jit(self.after)
        self._jvps: dict[tuple[int, ...], tuple[Callable[..., Any], Callable[..., Any]]] = {}

    def _join(self, fns: Sequence[Callable[..., Any]]) -> Callable[..., Any]:
        sizes = self.sizes

        def joined(*flat: Any) -> list[Any]:
            outs, k = [], 0
            for fn, n in zip(fns, sizes):
                outs.append(fn(*flat[k:k + n]))
                k += n
            return outs

        return joined

    def _flat(self, args: Sequence[Sequence[Any]]) -> list[Any]:
        return [a for per in args for a in per]

    def _want(self, flat: list[Any]) -> list[Any]:
        if self.reference is None:
            return self.jit_before(*flat)
        if self.reference not in _REFERENCE:
            _REFERENCE[self.reference] = self.jit_before(*flat)
        return _REFERENCE[self.reference]

    def check_exact(self, args: Sequence[Sequence[Any]], *, eager: bool = False) -> None:
        """Bitwise under jit; with ``eager``, also op by op, up to flushed subnormals."""
        flat = self._flat(args)
        for name, got, want in zip(self.names, self.jit_after(*flat), self._want(flat)):
            assert_same_bits(got, want, context=f"{name} (jit)")
        if eager:
            for name, got, want in zip(self.names, self.after(*flat), self.before(*flat)):
                assert_same_bits(got, want, flush=True, context=f"{name} (eager)")

    def check_derivatives(self, args: Sequence[Sequence[Any]], tolerance: Any = None) -> None:
        """JAX's forward-mode derivatives (``jax.jvp`` under ``jit``) of every program before and after, compared
        by :func:`rewrite.testing.derivative_mismatch`: at kinks (0, -0.0) too, a rule keeps the derivative JAX
        computes. Tangents are fixed ordinary numbers of both signs (no zeros, which would hide a difference)."""
        flat = self._flat(args)
        idx = tuple(i for i, a in enumerate(flat) if jnp.issubdtype(np.asarray(a).dtype, jnp.inexact))
        rng = np.random.default_rng(len(flat))
        tangents = [(rng.uniform(0.5, 2.0, np.shape(flat[i])) * rng.choice([-1.0, 1.0], np.shape(flat[i])))
                    .astype(np.asarray(flat[i]).dtype) for i in idx]
        if idx not in self._jvps:
            def jvp_of(fn: Callable[..., Any]) -> Callable[..., Any]:
                def run(primals: list[Any], tans: list[Any], rest: list[Any]) -> Any:
                    def at(*xs: Any) -> Any:
                        full, it, other = [], iter(xs), iter(rest)
                        for i in range(len(flat)):
                            full.append(next(it) if i in idx else next(other))
                        return fn(*full)
                    return jax.jvp(at, primals, tans)
                return jax.jit(run)
            self._jvps[idx] = (jvp_of(self.before), jvp_of(self.after))
        before, after = self._jvps[idx]
        primals, rest = [flat[i] for i in idx], [a for i, a in enumerate(flat) if i not in idx]
        values, want = before(primals, tangents, rest)
        _, got = after(primals, tangents, rest)
        for name, v, w, g in zip(self.names, values, want, got):
            for vl, wl, gl in zip(*(jax.tree_util.tree_leaves(t) for t in (v, w, g)), strict=True):
                why = derivative_mismatch(vl, wl, gl, tolerance=tolerance)
                assert why is None, f"{name}: JAX's derivative changed (jit): {why}"

    def check_close(self, args: Sequence[Sequence[Any]], tolerances: Sequence[tuple[float, float] | None]) -> None:
        flat = self._flat(args)
        for name, tol, got, want in zip(self.names, tolerances, self.jit_after(*flat), self._want(flat)):
            if tol is not None:  # None: not compared
                assert_close(got, want, *tol, context=name)


def array_leaves(args: Any) -> list[Any]:
    """The leaves of ``args`` that a traced program takes as inputs (arrays; the rest is static)."""
    return [x for x in jax.tree_util.tree_leaves(args) if is_traced_leaf(x)]


def corpus_programs() -> list[tuple[str, Callable[..., Any], tuple]]:
    """The corpus of real programs (tests/corpus.py), built once per session.

    Building it compiles dozens of small XLA programs (random inputs, equinox
    models), so the round-trip test's copy is reused when it was imported.
    """
    global _CORPUS
    if _CORPUS is None:
        roundtrip = sys.modules.get(f"{__package__}.test_roundtrip")
        _CORPUS = list(getattr(roundtrip, "CORPUS", None) or corpus())
    return _CORPUS


_CORPUS: list | None = None


def only(pack: Ruleset, name: str, *also: str) -> Ruleset:
    """A ruleset of one of ``pack``'s rules (and the rules named in ``also``), with the class of its owner."""
    owners = {r.name: (r, owner) for r, owner in pack.entries()}
    r, owner = owners[name]
    return Ruleset(name, [r] + [owners[a][0] for a in also], soundness=owner.soundness, tolerance=owner.tolerance,
                   limits=owner.limits)
