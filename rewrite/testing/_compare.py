"""What "the same result" means in each soundness class, and the evidence that settles a close call.

:func:`mismatch` compares one original result with its rewrite: bit for bit
for ``exact`` (any NaN equal to any NaN, a subnormal equal to the zero of its
sign), within a tolerance for ``identity`` and ``fastmath``. Where a
tolerance is exceeded, evidence may still acquit the rewrite: the true
result computed in float64 (the rewrite may be the more accurate one), how
far the original itself moves when its inputs move by a few ulps (its own
conditioning), and, for a tolerance with ``terms``, the magnitude of the
terms summed into each element (a reordered sum's rounding is relative to
them, ``rewrite/testing/_magnitude.py``). ``_Evidence`` computes them only
once a mismatch is found. :func:`soundness_of` gives the class and tolerance a set
of rulesets is compared under.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..api import builtin_packs
from ..rules.rule import Rule
from ..rules.ruleset import Ruleset, SOUNDNESS, Tolerance, entries_of
from ._strategies import _is_complex, _is_float, _like, _wide

#: What an exact comparison means, quoted in failure messages.
_EXACT_NOTE = "exact: equal bits, any NaN equal to any NaN, a subnormal equal to the zero of its sign"


def _as_real(a: np.ndarray) -> np.ndarray:
    """Complex values as pairs of reals, so one comparison serves both."""
    if _is_complex(a.dtype):
        part = np.float64 if a.dtype == np.complex128 else np.float32
        return np.stack([a.real.astype(part), a.imag.astype(part)], axis=-1)
    return a


def _bitwise_equal(want: np.ndarray, got: np.ndarray) -> np.ndarray:
    # float64 holds every narrower float exactly, so equal float64 values and sign bits mean equal bits,
    # NaN payloads aside. XLA on CPU flushes subnormal results to zero, and its own simplifier drops
    # x*1 under jit, so a subnormal and the zero of its sign are one value here.
    tiny = float(jnp.finfo(want.dtype).smallest_normal)
    w, g = want.astype(np.float64), got.astype(np.float64)
    w = np.where(np.abs(w) < tiny, np.copysign(0.0, w), w)
    g = np.where(np.abs(g) < tiny, np.copysign(0.0, g), g)
    return (np.isnan(w) & np.isnan(g)) | ((w == g) & (np.signbit(w) == np.signbit(g)))


def _close(want: np.ndarray, got: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    w, g = want.astype(np.float64), got.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        near = np.isfinite(w) & np.isfinite(g) & (np.abs(w - g) <= atol + rtol * np.abs(w))
    return (np.isnan(w) & np.isnan(g)) | (w == g) | near


def _no_worse(want: np.ndarray, got: np.ndarray, ref: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """Where the rewrite is within tolerance of the true result (``ref``), or no further from it than the original."""
    w, g, r = want.astype(np.float64), got.astype(np.float64), ref.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        slack = np.where(np.isfinite(w), np.abs(w - r), 0.0)
        near = np.isfinite(r) & np.isfinite(g) & (np.abs(g - r) <= atol + rtol * np.abs(r) + slack)
    # The original overflowed, and so did its float64 run: the float64 result cannot judge the rewrite
    # there, and a rewrite that avoids the overflow (softplus for log(1 + exp(x))) is finite. A finite
    # value passes; the rule is checked at the inputs where the original does not overflow.
    overflowed = np.isinf(w) & (w == r) & np.isfinite(g)
    return near | (g == r) | (np.isnan(g) & np.isnan(r)) | overflowed


#: Inputs are nudged by this many ulps (relative, each way) to measure a program's own conditioning.
_NUDGE_ULPS = 8

#: The most a rule's check lets a tolerance (or the terms' bound) allow, relative or absolute, once scaled to the
#: dtype: for bfloat16 ``Tolerance()`` scales to 0.66 and attention's to 13, which passed a sign flip.
MOST = 0.1


def _nudged(args: Any, sign: int) -> Any:
    """Every inexact array leaf scaled by ``1 + sign * _NUDGE_ULPS * eps``, keeping its kind of array."""
    def nudge(x: Any) -> Any:
        if not (hasattr(x, "dtype") and hasattr(x, "shape") and (_is_float(x.dtype) or _is_complex(x.dtype))):
            return x
        a = np.asarray(x)
        eps = float(jnp.finfo(a.dtype).eps)
        out = (a.astype(_wide(a.dtype)) * (1.0 + sign * _NUDGE_ULPS * eps)).astype(a.dtype)
        return out if isinstance(x, (np.ndarray, np.generic)) else _like(x, out)

    return jax.tree_util.tree_map(nudge, args)


def _spreads(run: Callable[[Any], list[Any]], args: Any, want: Sequence[Any]) -> list[Any]:
    """Per output, how far the original's result moves when its inputs are nudged (non-finite moves count 0)."""
    out: list[Any] = [None] * len(want)
    try:
        runs = [run(_nudged(args, s)) for s in (1, -1)]
    except Exception:
        return out
    for i, w in enumerate(want):
        w = np.asarray(w)
        if not (_is_float(w.dtype) or _is_complex(w.dtype)):
            continue
        moved = np.zeros(_as_real(w).shape)
        for r in runs:
            o = np.asarray(r[i])
            if o.shape != w.shape:
                break
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.abs(_as_real(o).astype(np.float64) - _as_real(w).astype(np.float64))
            moved = np.maximum(moved, np.where(np.isfinite(d), d, 0.0))
        else:
            out[i] = moved if not _is_complex(w.dtype) else moved.max(axis=-1, keepdims=False)
    return out


def _within_spread(want: np.ndarray, got: np.ndarray, spread: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """Where the rewrite moved the result no more than nudging the inputs by a few ulps moves the original."""
    w, g, d = want.astype(np.float64), got.astype(np.float64), spread.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.isfinite(w) & np.isfinite(g) & (np.abs(g - w) <= atol + rtol * np.abs(w) + d)


def _terms(magnitude: Any, want: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The terms' magnitude and underflow growth (``rewrite/testing/_magnitude.py``) shaped like ``want``
    (as real pairs for a complex ``want``); a magnitude alone grows an underflow by 1."""
    m, u = magnitude if isinstance(magnitude, tuple) else (magnitude, np.ones(np.shape(magnitude)))
    if np.shape(m) != want.shape or np.shape(u) != want.shape:
        return None
    m, u = np.asarray(m, np.float64), np.asarray(u, np.float64)
    if _is_complex(want.dtype):
        m, u = np.stack([m, m], axis=-1), np.stack([u, u], axis=-1)
    return m, u


def _within_terms(want: np.ndarray, got: np.ndarray, terms: tuple[np.ndarray, np.ndarray], rtol: float,
                  atol: float, bound: tuple[float, float]) -> np.ndarray:
    """Where the rewrite moved the result by at most ``bound[0]`` times the magnitude of its terms plus
    ``bound[1]`` times the growth of an underflow (``Tolerance.terms_for``)."""
    w, g = want.astype(np.float64), got.astype(np.float64)
    m, u = terms
    with np.errstate(invalid="ignore", over="ignore"):
        return np.isfinite(w) & np.isfinite(g) & np.isfinite(m) & np.isfinite(u) & (
            np.abs(g - w) <= atol + rtol * np.abs(w) + bound[0] * m + bound[1] * u)


#: How a mismatch's note names the as-written evidence.
_WRITTEN_NOTE = ", or as the original gives it rounded as written (no fused multiply-adds)"


def mismatch(want: Any, got: Any, *, soundness: str = "exact", tolerance: Tolerance | None = None,
             reference: Any = None, spread: Any = None, magnitude: Any = None, written: Any = None,
             most: float | None = None) -> str | None:
    """Why ``got`` does not stand in for ``want`` under a soundness class, or ``None`` if it does.

    ``exact`` (and any comparison without ``tolerance``) asks for equal bits,
    counting any NaN equal to any NaN and a subnormal equal to the zero of its
    sign (XLA on CPU flushes subnormal results). ``identity`` and ``fastmath``
    ask for floats within ``tolerance`` (scaled to the dtype), NaN where the
    original has NaN and the same infinities; integers and booleans stay
    exact. Where ``reference``, the true result computed in higher
    precision, is given, an element also passes if the rewrite is within
    tolerance of it, or no further from it than the original is: a rewrite
    may be more accurate than the program it replaces (no overflow where the
    original overflowed, no cancellation where the original cancelled).
    Where the original overflows to an infinity and its float64 result is the
    same infinity, that reference overflowed too and cannot judge: a finite
    rewritten value passes there (the rule is checked where nothing
    overflows).
    Where ``spread`` is given (how far the original's result moves when its
    inputs move by a few ulps), an element also passes if the rewrite moved
    it no further than that: a rounding difference that the program's own
    conditioning amplifies (``sin`` of a large argument, a cancellation) is
    not the rule's fault.
    Where the tolerance has ``terms`` and ``magnitude`` (the magnitude of the
    terms summed into each element, or that and how much an underflow grows on
    its way to it, as ``rewrite/testing/_magnitude.py`` computes them) is
    given, an element also passes if the rewrite moved it by at most ``terms``
    roundings of its terms (``Tolerance.terms_for``): the bound of a reordered
    sum, which holds for a result of any size.
    Where ``written`` is given (the original with every operation rounded as
    written, loops step by step), an element also passes if the rewrite gives
    what it gives, as the class compares: compiled, XLA contracts a product
    and a sum into one fused multiply-add where a fusion allows it, which a
    rewrite can change without changing the program as written.

    >>> import numpy as np
    >>> mismatch(np.float32([0.0, np.nan]), np.float32([0.0, -np.nan])) is None
    True
    >>> print(mismatch(np.float32([0.0]), np.float32([-0.0])))
    at [0]: original 0.0, rewritten -0.0 (exact: equal bits, any NaN equal to any NaN, a subnormal equal to the zero of its sign)
    >>> from rewrite import Tolerance
    >>> mismatch(np.float32([1.0]), np.float32([1.000001]), soundness="identity", tolerance=Tolerance()) is None
    True
    """
    want, got = np.asarray(want), np.asarray(got)
    if want.shape != got.shape or want.dtype != got.dtype:
        return f"rewritten gives {got.dtype}{list(got.shape)}, original {want.dtype}{list(want.shape)}"
    inexact = _is_float(want.dtype) or _is_complex(want.dtype)
    if not inexact:
        ok = want == got
        note = "exact"
    elif tolerance is None or soundness == "exact":
        ok = _bitwise_equal(_as_real(want), _as_real(got))
        note = _EXACT_NOTE
        if not ok.all() and written is not None and np.shape(written) == want.shape:
            ok = ok | _bitwise_equal(_as_real(np.asarray(written)), _as_real(got))
            note += _WRITTEN_NOTE
    else:
        rtol, atol = tolerance.for_dtype(want.dtype)
        if most is not None:  # scaled to a 16-bit float, a tolerance may otherwise pass a sign flip
            rtol, atol = min(rtol, most), min(atol, most)
        w, g = _as_real(want), _as_real(got)
        ok = _close(w, g, rtol, atol)
        note = f"{soundness}: rtol {rtol:.3g}, atol {atol:.3g}"
        if not ok.all() and written is not None and np.shape(written) == want.shape:
            ok = ok | _close(_as_real(np.asarray(written)), g, rtol, atol)
            note += _WRITTEN_NOTE
        if not ok.all() and reference is not None and np.shape(reference) == want.shape:
            ok = ok | _no_worse(w, g, _as_real(np.asarray(reference)), rtol, atol)
            note += ", or no further than the original from the float64 result"
        if not ok.all() and spread is not None and np.shape(spread) == want.shape:
            d = np.asarray(spread)
            d = np.stack([d, d], axis=-1) if _is_complex(want.dtype) else d
            ok = ok | _within_spread(w, g, d, rtol, atol)
            note += f", or within the original's own spread under {_NUDGE_ULPS}-ulp input changes"
        bound = tolerance.terms_for(want.dtype)
        bound = bound if most is None else (min(bound[0], most), min(bound[1], most))
        terms = _terms(magnitude, want) if bound[0] > 0 and magnitude is not None else None
        if not ok.all() and terms is not None:
            ok = ok | _within_terms(w, g, terms, rtol, atol, bound)
            note += f", or within {tolerance.terms:g} roundings of the terms' magnitude"
    if inexact and _is_complex(want.dtype):
        ok = ok.all(axis=-1)
    if np.all(ok):
        return None
    bad = np.argwhere(~np.asarray(ok))
    n = len(bad)
    idx = tuple(int(i) for i in bad[0])
    where = f"[{', '.join(map(str, idx))}]" if idx else "[]"
    line = f"at {where}: original {_number_text(want[idx])}, rewritten {_number_text(got[idx])}"
    if reference is not None and inexact and np.shape(reference) == want.shape:
        line += f", float64 result {_number_text(np.asarray(reference)[idx])}"
    if spread is not None and inexact and np.shape(spread) == want.shape:
        line += f", spread {_number_text(np.asarray(spread)[idx])}"
    if magnitude is not None and inexact and _terms(magnitude, want) is not None:
        line += f", terms' magnitude {_number_text(np.asarray(magnitude[0] if isinstance(magnitude, tuple) else magnitude)[idx])}"
    more = f"; {n - 1} more element(s) differ" if n > 1 else ""
    return f"{line} ({note}){more}"


def derivative_mismatch(value: Any, want: Any, got: Any, *, tolerance: Tolerance | None = None,
                        reference: Any = None, spread: Any = None, magnitude: Any = None,
                        written: Any = None) -> str | None:
    """Why the tangent ``got`` does not stand in for ``want``, the original's, or ``None`` if it does.

    A rule must keep the derivatives JAX computes, not only the values: at a
    kink (``abs`` and ``max`` at 0, a ``where`` at its switch) two forms of
    one value can have different derivatives. Derivatives are new programs
    (JAX differentiates each side), so even an exact rule meets them within
    ``tolerance`` (``Tolerance()`` if none), scaled to the dtype. Where
    ``spread`` (how far the original's tangent moves when its inputs move by
    a few ulps: its rounding noise where it cancels) is given, an element
    also passes within it, but only where it is under 1% of the tangent: at a
    kink the derivative jumps by as much as it is, and an allowance that large
    would excuse exactly the change looked for. Where ``reference``, the
    true derivative computed in float64, is given, an element also passes if
    the rewrite is within tolerance of it or no further from it than the
    original (an underflow in JAX's derivative of the original, say). Elements whose
    ``value`` (the original's output) is not finite are not compared: there
    is no derivative at a NaN, and at a value that overflowed JAX's tangent
    is an accident of the order of operations (``0 * (2 * x)`` is NaN where
    ``0 * x + x * 0`` is 0). A rewrite may also be finite where JAX's
    derivative of the original is not (an overflow, ``0 * inf`` or ``0/0``
    that another order of operations or a stable form avoids): as with
    values, a rewrite may do better than the original, never worse. With a
    tolerance that has ``terms``, ``magnitude`` (of the terms of the
    derivative program's sums) acquits as it does for values. Where
    ``written``, the original's derivative with every operation rounded as
    written (:func:`rewrite.testing.as_written`: loops step by step), is
    given, an element also passes if the rewrite is within tolerance of it or
    the same infinity or NaN: compiled, XLA contracts a product and a sum into
    one fused multiply-add, so which of two products overflows is the fusion's
    choice, not the rule's.

    >>> import numpy as np
    >>> derivative_mismatch(np.float32([0.0, 1.0]), np.float32([-1.0, 1.0]), np.float32([-1.0, 1.0])) is None
    True
    >>> print(derivative_mismatch(np.float32([0.0]), np.float32([-1.0]), np.float32([1.0])))
    at [0]: original -1.0, rewritten 1.0 (derivative: rtol 1e-05, atol 1e-06)
    """
    value, want, got = np.asarray(value), np.asarray(want), np.asarray(got)
    if want.dtype == jax.dtypes.float0:
        return None
    if want.shape != got.shape or want.dtype != got.dtype:
        return f"rewritten gives a tangent {got.dtype}{list(got.shape)}, original {want.dtype}{list(want.shape)}"
    rtol, atol = (tolerance or Tolerance()).for_dtype(want.dtype)
    rtol, atol = min(rtol, MOST), min(atol, MOST)  # scaled to a 16-bit float, still far below a sign flip
    w, g = _as_real(want), _as_real(got)
    ok = _close(w, g, rtol, atol)
    note = f"derivative: rtol {rtol:.3g}, atol {atol:.3g}"
    ok = ok | ~np.isfinite(w.astype(np.float64))
    if not ok.all() and reference is not None and np.shape(reference) == want.shape:
        ok = ok | _no_worse(w, g, _as_real(np.asarray(reference)), rtol, atol)
        note += ", or no further than the original from the float64 derivative"
    if not ok.all() and written is not None and np.shape(written) == want.shape:
        ok = ok | _close(_as_real(np.asarray(written)), g, rtol, atol)
        note += _WRITTEN_NOTE
    if not ok.all() and spread is not None and np.shape(spread) == want.shape:
        d = np.asarray(spread, np.float64)
        d = np.stack([d, d], axis=-1) if _is_complex(want.dtype) else d
        with np.errstate(invalid="ignore", over="ignore"):
            noise = d <= 1e-2 * np.abs(w.astype(np.float64))
        ok = ok | (_within_spread(w, g, d, rtol, atol) & noise)
        note += f", or within the original's own spread under {_NUDGE_ULPS}-ulp input changes (under 1%)"
    bound = tolerance.terms_for(want.dtype) if tolerance is not None else (0.0, 0.0)
    bound = (min(bound[0], MOST), min(bound[1], MOST))
    terms = _terms(magnitude, want) if bound[0] > 0 and magnitude is not None else None
    if not ok.all() and terms is not None:
        ok = ok | _within_terms(w, g, terms, rtol, atol, bound)
        note += f", or within {tolerance.terms:g} roundings of the terms' magnitude"
    if value.shape == want.shape and (_is_float(value.dtype) or _is_complex(value.dtype)):
        with np.errstate(invalid="ignore"):
            off = ~np.isfinite(_as_real(value).astype(np.float64))
        ok = ok | (off if off.shape == ok.shape else off.any(axis=-1, keepdims=True))
    if _is_complex(want.dtype):
        ok = ok.all(axis=-1)
    if np.all(ok):
        return None
    bad = np.argwhere(~np.asarray(ok))
    idx = tuple(int(i) for i in bad[0])
    where = f"[{', '.join(map(str, idx))}]" if idx else "[]"
    more = f"; {len(bad) - 1} more element(s) differ" if len(bad) > 1 else ""
    return f"at {where}: original {_number_text(want[idx])}, rewritten {_number_text(got[idx])} ({note}){more}"


def _number_text(v: Any) -> str:
    v = np.asarray(v)
    if _is_float(v.dtype):
        return repr(float(v))
    return repr(v.item())


def _show(a: Any, indent: int = 6) -> str:
    """An array as ``dtype[shape] values``, continuation lines indented to line up under the values."""
    a = np.asarray(a)
    head = f"{a.dtype}{list(a.shape)} "
    body = np.array2string(a, threshold=24, max_line_width=110, separator=", ", floatmode="maxprec",
                           prefix=" " * (indent + len(head)))
    return head + body


def soundness_of(rulesets: Any) -> tuple[str, Tolerance | None]:
    """The weakest soundness class among the rulesets' rules, and the widest tolerance of that class.

    This is what :func:`assert_equivalent` draws values for and compares
    with; ``None`` means bit for bit. Give it to :func:`inputs_like` when
    drawing inputs for a program rewritten with these rulesets.

    >>> from rewrite import rule, Ruleset, Tolerance
    >>> a = Ruleset("a", [rule(lambda x: -(-x), lambda x: x, name="neg_neg")])
    >>> b = Ruleset("b", [rule(lambda x: x - x, lambda x: 0 * x, name="sub_self")], soundness="identity",
    ...             tolerance=Tolerance(1e-4, 0.0))
    >>> soundness_of([a]), soundness_of([a, b])
    (('exact', None), ('identity', Tolerance(rtol=0.0001, atol=0.0)))
    """
    return _tolerance(entries_of(rulesets, builtin_packs))


def _tolerance(entries: Sequence[tuple[Rule, Ruleset]]) -> tuple[str, Tolerance | None]:
    owners = {id(o): o for _, o in entries}.values()
    if not owners:
        return "exact", None
    weakest = max((o.soundness for o in owners), key=SOUNDNESS.index)
    if weakest == "exact":
        return weakest, None
    tols = [o.tolerance for o in owners if o.tolerance is not None and o.soundness != "exact"]
    return weakest, Tolerance(max(t.rtol for t in tols), max(t.atol for t in tols), max(t.terms for t in tols))


class Float64Results(list):
    """A program's results computed in float64 (empty where that is impossible), and how to compute the
    magnitude of their terms (:func:`rewrite.testing._magnitude.magnitudes`) should a tolerance ask."""

    def __init__(self, outs: Sequence[Any], magnitudes: Callable[[], list[Any] | None]) -> None:
        super().__init__(outs)
        self.magnitudes = magnitudes


class _Evidence:
    """What settles a tolerance mismatch, computed only once one is found: the float64 result,
    how far the original moves when its inputs are nudged by a few ulps, and (for a tolerance with
    ``terms``) the magnitude of the terms summed into each result, from ``magnitudes`` or else from
    the float64 results when they are :class:`Float64Results`."""

    def __init__(self, reference: Callable[[], list[Any] | None] | None,
                 spreads: Callable[[], list[Any]] | None,
                 magnitudes: Callable[[], list[Any] | None] | None = None,
                 written: Callable[[], list[Any]] | None = None, most: float | None = None) -> None:
        self._reference = reference
        self._most = most
        self._spreads = spreads
        self._magnitudes = magnitudes
        self._written = written
        self._got: tuple[list[Any], list[Any], list[Any]] | None = None
        self._as_written: list[Any] | None = None

    def mismatch(self, i: int, want: Any, got: Any, soundness: str, tolerance: Tolerance | None) -> str | None:
        most = self._most
        why, written = mismatch(want, got, soundness=soundness, tolerance=tolerance, most=most), None
        if why is not None and self._written is not None:
            if self._as_written is None:
                self._as_written = self._written()
            written = self._as_written[i] if i < len(self._as_written) else None
            why = mismatch(want, got, soundness=soundness, tolerance=tolerance, written=written, most=most)
        if why is None or tolerance is None or soundness == "exact":
            return why
        if self._got is None:
            found = self._reference() if self._reference is not None else None
            refs = found or []
            spreads = self._spreads() if self._spreads is not None else []
            terms = self._magnitudes or (found.magnitudes if isinstance(found, Float64Results) else None)
            mags = (terms() if terms is not None and tolerance.terms > 0 else None) or []
            self._got = (refs, spreads, mags)
        refs, spreads, mags = self._got
        ref = refs[i] if i < len(refs) and hasattr(refs[i], "shape") else None
        spread = spreads[i] if i < len(spreads) else None
        mag = mags[i] if i < len(mags) else None
        return mismatch(want, got, soundness=soundness, tolerance=tolerance, reference=ref, spread=spread,
                        magnitude=mag, written=written, most=most)

