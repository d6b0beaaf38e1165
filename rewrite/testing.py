"""Property-based checks for rules and rewritten programs, built on hypothesis.

No rewrite is trusted until it has been tested. :func:`check_ruleset` takes
each rule on its own, treats its left-hand side (or, for a :class:`Pat` rule,
its example program) as a program, rewrites that program with the one rule,
insists that the rule really fired and that the emitted program really uses
what it built, and compares the two programs on inputs that hypothesis draws
and shrinks. :func:`assert_equivalent` does the same for a whole program
and the rulesets it is rewritten with. What "equal" means, and which inputs
are drawn, follows the soundness class each rule declares: ``exact`` rules
are compared bit for bit on every value a float can hold, ``identity`` rules
within a tolerance on finite values, and ``fastmath`` rules within their
stated tolerance on ordinary values (see ``docs/testing.md``). The module
also offers the strategies it is built from: :func:`elements`,
:func:`arrays`, :func:`inputs_like` and :func:`programs`, which draws random
JAX programs for fuzz tests. Every check follows the active hypothesis
profile unless it is given ``max_examples``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax import lax
from jax._src import core

from . import _terms
from ._1_trace import is_traced_leaf, trace
from ._3_saturate import Limits
from ._4_extract import _CONTAINERS, Extractor
from ._5_emit import emit
from ._6_evaluate import entries_of, rewrite
from ._cost import AnalyticCost
from ._intern import TupleType
from ._pipeline import Result, run_pipeline
from ._programs import RandomProgram, programs
from ._rules import SOUNDNESS, Procedure, Rule, Ruleset, Tolerance, Value, _short

__all__ = [
    "CheckReport",
    "RandomProgram",
    "RuleCheck",
    "VacuousCheckWarning",
    "arrays",
    "assert_equivalent",
    "assert_same_results",
    "check_ruleset",
    "elements",
    "inputs_like",
    "mismatch",
    "programs",
    "soundness_of",
    "value_bound",
]


class VacuousCheckWarning(UserWarning):
    """A check ran but compared a program with itself: no rule changed it.

    >>> import warnings, jax.numpy as jnp
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = assert_equivalent(jnp.sin, jnp.ones(2), max_examples=2)
    >>> caught[0].category.__name__
    'VacuousCheckWarning'
    """


# ====================================================================== values
#: What an exact comparison means, quoted in failure messages.
_EXACT_NOTE = "exact: equal bits, any NaN equal to any NaN, a subnormal equal to the zero of its sign"

#: fastmath rules are checked on "ordinary" values: normal floats of magnitude at most this, and zero.
ORDINARY_BOUND = 4.0


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.floating))


def _is_complex(dtype: Any) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.complexfloating))


def _float_width(dtype: Any) -> int:
    bits = np.dtype(dtype).itemsize * 8
    return bits if bits in (16, 32, 64) and np.dtype(dtype) != jnp.bfloat16 else 32


def value_bound(dtype: Any, soundness: str) -> float:
    """The largest magnitude drawn for a float ``dtype`` in a soundness class.

    ``exact`` draws every value (the bound is the largest finite float).
    ``identity`` draws finite values up to the largest power of two whose
    ``exp`` is still finite (64 for float32 and bfloat16, 8 for float16, 512
    for float64), so an identity is tested where real arithmetic and
    floating point agree, overflow aside. ``fastmath`` draws ordinary values,
    at most :data:`ORDINARY_BOUND`.

    >>> import numpy as np
    >>> value_bound(np.float32, "identity"), value_bound(np.float32, "fastmath")
    (64.0, 4.0)
    """
    info = jnp.finfo(np.dtype(dtype))
    if soundness == "exact":
        return float(info.max)
    if soundness == "identity":
        return float(2.0 ** math.floor(math.log2(math.log(float(info.max)))))
    if soundness == "fastmath":
        return ORDINARY_BOUND
    raise ValueError(f"soundness must be one of {SOUNDNESS}, got {soundness!r}")


def _specials(dtype: Any, soundness: str) -> list[float]:
    """Values every class must be tried on; hypothesis's own floats add the rest."""
    info = jnp.finfo(np.dtype(dtype))
    tiny, sub = float(info.smallest_normal), float(info.smallest_subnormal)
    common = [0.0, 1.0, -1.0, 0.5, -2.0]
    if soundness == "exact":
        big = float(info.max)
        return [0.0, -0.0, math.inf, -math.inf, math.nan, sub, -sub, tiny, -tiny, big, -big] + common[1:]
    if soundness == "identity":
        bound = value_bound(dtype, soundness)
        return [0.0, -0.0] + common[1:] + [sub, -sub, tiny, -tiny, bound, -bound]
    return common + [ORDINARY_BOUND, -ORDINARY_BOUND]


def elements(dtype: Any, soundness: str = "exact") -> st.SearchStrategy:
    """Scalars (Python numbers) of ``dtype`` as a soundness class draws them.

    Floats: ``exact`` draws everything a float can hold, and makes sure of
    0, -0.0, +-inf, NaN, subnormals, the largest finite values and negatives;
    ``identity`` draws finite values within :func:`value_bound` (zeros and
    subnormals included); ``fastmath`` draws ordinary values: zero and normal
    floats of magnitude at most :data:`ORDINARY_BOUND`. Integers and booleans
    are drawn over their whole range in every class; complex numbers take
    each part from the float rule.

    >>> import numpy as np
    >>> from hypothesis import given
    >>> @given(elements(np.float32, "identity"))
    ... def finite(v):
    ...     assert np.isfinite(v) and abs(v) <= 64
    >>> finite()
    """
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return st.booleans()
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        lo, hi = int(info.min), int(info.max)
        special = sorted({0, 1, hi, lo} | ({-1} if lo < 0 else set()))
        return st.one_of(st.sampled_from(special), st.integers(lo, hi))
    if _is_complex(dtype):
        part = np.dtype(np.float64 if dtype == np.complex128 else np.float32)
        return st.builds(complex, elements(part, soundness), elements(part, soundness))
    if not _is_float(dtype):
        raise TypeError(f"no values known for dtype {dtype}")
    width = _float_width(dtype)
    specials = [float(np.asarray(v, dtype)) for v in _specials(dtype, soundness)]
    if soundness == "exact":
        floats = st.floats(width=width, allow_nan=True, allow_infinity=True, allow_subnormal=True)
    else:
        bound = float(np.asarray(value_bound(dtype, soundness), dtype))
        floats = st.floats(-bound, bound, width=width, allow_nan=False, allow_infinity=False,
                           allow_subnormal=soundness == "identity")
    if dtype == jnp.bfloat16:  # drawn as float32, then rounded to the nearest bfloat16
        floats = floats.map(lambda v: float(np.asarray(v, dtype)))
    return st.one_of(st.sampled_from(specials), floats)


def _into_domain(x: Any, domain: str, abs_: Callable, maximum: Callable, neg: Callable) -> Any:
    """Move values into a domain with the given operations: ``|x|``, ``max(|x|, tiny)`` or its negation.

    Drawn values (numpy, :func:`_domain_values`) and traced inputs (``_wrap``)
    go through this one function, so the two always agree.
    """
    if domain == "any" or not _is_float(x.dtype):
        return x
    tiny = np.asarray(jnp.finfo(x.dtype).smallest_normal, x.dtype)
    if domain == "nonneg":
        return abs_(x)
    if domain == "positive":
        return maximum(abs_(x), tiny)
    if domain == "negative":
        return neg(maximum(abs_(x), tiny))
    raise ValueError(f"unknown domain {domain!r}")


def _domain_values(a: np.ndarray, domain: str) -> np.ndarray:
    """Move drawn values into a domain, the same way ``_wrap`` does in the program, so both agree."""
    return _into_domain(a, domain, np.abs, np.maximum, np.negative)


def arrays(shape: Sequence[int], dtype: Any, soundness: str = "exact", domain: str = "any") -> st.SearchStrategy:
    """Numpy arrays of this shape and dtype, elements drawn by :func:`elements`.

    ``domain`` restricts floats to ``"nonneg"`` (sign bit clear: +0.0,
    positives, +inf, NaN), ``"positive"`` (at least the smallest normal
    float, or +inf or NaN) or ``"negative"`` (the negations of those).

    >>> import numpy as np
    >>> from hypothesis import given
    >>> @given(arrays((2, 3), np.float32, "exact", domain="nonneg"))
    ... def signs(a):
    ...     assert a.shape == (2, 3) and not np.signbit(a).any()
    >>> signs()
    """
    shape = tuple(int(d) for d in shape)
    dtype = np.dtype(dtype)
    n = math.prod(shape)
    elem = elements(dtype, soundness)
    if n <= _EXPLICIT:
        flat = st.lists(elem, min_size=n, max_size=n)
    else:
        # Drawing every element of a large array overruns hypothesis's budget per example, so a
        # large array is a short drawn pattern repeated, with a few drawn values at drawn places.
        flat = st.builds(_tiled, st.just(n), st.lists(elem, min_size=1, max_size=_EXPLICIT),
                         st.lists(st.tuples(st.integers(0, n - 1), elem), max_size=8))
    return flat.map(lambda xs: _domain_values(np.asarray(xs, dtype=dtype).reshape(shape), domain))


#: Arrays up to this many elements are drawn element by element.
_EXPLICIT = 32


def _tiled(n: int, pattern: list, spots: list) -> list:
    out = [pattern[i % len(pattern)] for i in range(n)]
    for i, v in spots:
        out[i] = v
    return out


def inputs_like(example_args: Any, soundness: str = "exact") -> st.SearchStrategy:
    """Pytrees shaped like ``example_args``: array leaves are drawn, other leaves kept as they are.

    A leaf counts as an array as in :func:`rewrite.rewrite` (jax and numpy
    arrays, and ``jax.ShapeDtypeStruct``); Python numbers and other objects
    are static and kept. Drawn leaves keep the example's array type and
    weak type, so the rewrite sees the same signature.

    >>> import jax.numpy as jnp
    >>> from hypothesis import given
    >>> @given(inputs_like({"w": jnp.ones((2, 2)), "scale": 3.0}, "identity"))
    ... def shaped(args):
    ...     assert args["w"].shape == (2, 2) and args["scale"] == 3.0
    >>> shaped()
    """
    leaves, treedef = jax.tree_util.tree_flatten(example_args)
    parts = []
    for leaf in leaves:
        if isinstance(leaf, jax.ShapeDtypeStruct) or is_traced_leaf(leaf):
            parts.append(arrays(leaf.shape, leaf.dtype, soundness).map(functools.partial(_like, leaf)))
        else:
            parts.append(st.just(leaf))
    return st.tuples(*parts).map(lambda xs: jax.tree_util.tree_unflatten(treedef, list(xs)))


def _like(example: Any, a: np.ndarray) -> Any:
    """``a`` as the same kind of array as ``example`` (numpy stays numpy; jax keeps its weak type)."""
    if isinstance(example, (np.ndarray, np.generic)):
        return a
    weak = example.weak_type if isinstance(example, jax.ShapeDtypeStruct) else jax.typeof(example).weak_type
    out = jnp.asarray(a)
    if weak:
        from jax._src.lax.lax import _convert_element_type

        out = _convert_element_type(out, out.dtype, weak_type=True)
    return out


# ====================================================================== comparison
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
    return near | (g == r) | (np.isnan(g) & np.isnan(r))


#: Inputs are nudged by this many ulps (relative, each way) to measure a program's own conditioning.
_NUDGE_ULPS = 8


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


def mismatch(want: Any, got: Any, *, soundness: str = "exact", tolerance: Tolerance | None = None,
             reference: Any = None, spread: Any = None) -> str | None:
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
    Where ``spread`` is given (how far the original's result moves when its
    inputs move by a few ulps), an element also passes if the rewrite moved
    it no further than that: a rounding difference that the program's own
    conditioning amplifies (``sin`` of a large argument, a cancellation) is
    not the rule's fault.

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
    else:
        rtol, atol = tolerance.for_dtype(want.dtype)
        w, g = _as_real(want), _as_real(got)
        ok = _close(w, g, rtol, atol)
        note = f"{soundness}: rtol {rtol:.3g}, atol {atol:.3g}"
        if not ok.all() and reference is not None and np.shape(reference) == want.shape:
            ok = ok | _no_worse(w, g, _as_real(np.asarray(reference)), rtol, atol)
            note += ", or no further than the original from the float64 result"
        if not ok.all() and spread is not None and np.shape(spread) == want.shape:
            d = np.asarray(spread)
            d = np.stack([d, d], axis=-1) if _is_complex(want.dtype) else d
            ok = ok | _within_spread(w, g, d, rtol, atol)
            note += f", or within the original's own spread under {_NUDGE_ULPS}-ulp input changes"
    if inexact and _is_complex(want.dtype):
        ok = ok.all(axis=-1)
    if np.all(ok):
        return None
    bad = np.argwhere(~np.asarray(ok))
    n = len(bad)
    idx = tuple(int(i) for i in bad[0])
    where = f"[{', '.join(map(str, idx))}]" if idx else "[]"
    line = f"at {where}: original {_scalar(want[idx])}, rewritten {_scalar(got[idx])}"
    if reference is not None and inexact and np.shape(reference) == want.shape:
        line += f", float64 result {_scalar(np.asarray(reference)[idx])}"
    if spread is not None and inexact and np.shape(spread) == want.shape:
        line += f", spread {_scalar(np.asarray(spread)[idx])}"
    more = f"; {n - 1} more element(s) differ" if n > 1 else ""
    return f"{line} ({note}){more}"


def _scalar(v: Any) -> str:
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
    return _tolerance(entries_of(rulesets))


def _tolerance(entries: Sequence[tuple[Rule, Ruleset]]) -> tuple[str, Tolerance | None]:
    owners = {id(o): o for _, o in entries}.values()
    if not owners:
        return "exact", None
    weakest = max((o.soundness for o in owners), key=SOUNDNESS.index)
    if weakest == "exact":
        return weakest, None
    tols = [o.tolerance for o in owners if o.tolerance is not None and o.soundness != "exact"]
    return weakest, Tolerance(max(t.rtol for t in tols), max(t.atol for t in tols))


# ====================================================================== running programs
def _settings(max_examples: int | None) -> settings:
    """The active profile, with what a check needs on top (no deadline: a rewrite takes a while)."""
    base = settings.default
    # The explain phase re-runs a failure many times to say which draws mattered; the error
    # message already shows the whole shrunk example, so it would only add seconds per failure.
    phases = [p for p in base.phases if p != Phase.explain]
    return settings(base, max_examples=max_examples if max_examples is not None else base.max_examples,
                    deadline=None, database=None, suppress_health_check=list(HealthCheck),
                    report_multiple_bugs=False, phases=phases)


def _evaluate(closed: core.ClosedJaxpr, args: Sequence[Any]) -> list[np.ndarray]:
    """Run a jaxpr eagerly, one primitive at a time, as the program itself would run outside jit."""
    return [np.asarray(o) for o in core.eval_jaxpr(closed.jaxpr, closed.consts, *args)]


def _trace_at(fn: Callable[..., Any], avals: Sequence[Any]):
    in_tree = jax.tree_util.tree_structure((tuple(range(len(avals))), {}))
    return trace(fn, list(avals), in_tree, (), (), len(avals))


def _wide(dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    if _is_complex(dtype):
        return np.dtype(np.complex128)
    if _is_float(dtype):
        return np.dtype(np.float64)
    return dtype


class _Reference:
    """A program traced again at float64, for the true result; ``None`` results where that is impossible."""

    def __init__(self, fn: Callable[..., Any], avals: Sequence[Any]) -> None:
        self.fn = fn
        self.avals = tuple(avals)
        self._closed: Any = None
        self._failed = not any(_wide(a.dtype) != np.dtype(a.dtype) for a in avals)  # nothing to widen

    def __call__(self, args: Sequence[Any]) -> list[Any] | None:
        if self._failed:
            return None
        try:
            with jax.enable_x64(True):
                if self._closed is None:
                    wide = [core.ShapedArray(a.shape, _wide(a.dtype), weak_type=False) for a in self.avals]
                    self._closed = jax.make_jaxpr(self.fn)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in wide])
                outs = _evaluate(self._closed, [np.asarray(a).astype(_wide(np.asarray(a).dtype)) for a in args])
        except Exception:
            self._failed = True
            return None
        return outs


class _Evidence:
    """What settles a tolerance mismatch, computed only once one is found: the float64 result
    and how far the original moves when its inputs are nudged by a few ulps."""

    def __init__(self, reference: Callable[[], list[Any] | None] | None,
                 spreads: Callable[[], list[Any]] | None) -> None:
        self._reference = reference
        self._spreads = spreads
        self._got: tuple[list[Any], list[Any]] | None = None

    def mismatch(self, i: int, want: Any, got: Any, soundness: str, tolerance: Tolerance | None) -> str | None:
        why = mismatch(want, got, soundness=soundness, tolerance=tolerance)
        if why is None or tolerance is None or soundness == "exact":
            return why
        if self._got is None:
            refs = (self._reference() if self._reference is not None else None) or []
            spreads = self._spreads() if self._spreads is not None else []
            self._got = (refs, spreads)
        refs, spreads = self._got
        ref = refs[i] if i < len(refs) and hasattr(refs[i], "shape") else None
        spread = spreads[i] if i < len(spreads) else None
        return mismatch(want, got, soundness=soundness, tolerance=tolerance, reference=ref, spread=spread)


# ====================================================================== check_ruleset
@dataclasses.dataclass
class RuleCheck:
    """How one rule was checked: the cases it was rewritten in, examples compared, cases skipped and why.

    A case is one program the rule was exercised on: its inputs' shapes and
    dtypes, and the domain drawn for each (``nonneg``, ``positive``,
    ``negative`` when a guard asks for facts), or ``as constants``.

    >>> from rewrite import rule, Ruleset
    >>> r = rule(lambda x: abs(x), lambda x: x, name="abs_nonneg", when=lambda x: x.nonneg)
    >>> check_ruleset(Ruleset("r", [r]), max_examples=2).rules["abs_nonneg"].cases[0]
    '(x: f32[] nonneg)'
    """

    rule: str
    ruleset: str
    soundness: str
    cases: list[str] = dataclasses.field(default_factory=list)
    examples: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{self.rule} [{self.ruleset}, {self.soundness}]: {self.examples} examples over "
                 f"{len(self.cases)} case(s): {'; '.join(self.cases)}"]
        lines += [f"    not exercised: {s}" for s in self.skipped]
        return "\n".join(lines)


@dataclasses.dataclass
class CheckReport:
    """What :func:`check_ruleset` checked, rule by rule (each a :class:`RuleCheck`). ``str(report)`` lists it.

    >>> from rewrite import rule, Ruleset
    >>> report = check_ruleset(Ruleset("r", [rule(lambda x: -(-x), lambda x: x, name="neg_neg")]), max_examples=3)
    >>> print(report)
    check_ruleset('r'): 1 rule(s), 3 examples
      neg_neg [r, exact]: 3 examples over 4 case(s): (x: f32[]); (x: f32[3]); (x: f32[3,3]); (x: f32[3,3,3])
    """

    ruleset: str
    rules: dict[str, RuleCheck] = dataclasses.field(default_factory=dict)

    @property
    def examples(self) -> int:
        return sum(r.examples for r in self.rules.values())

    def __str__(self) -> str:
        head = f"check_ruleset({self.ruleset!r}): {len(self.rules)} rule(s), {self.examples} examples"
        return "\n".join([head] + [f"  {r}" for r in self.rules.values()])


class _NotExercised(Exception):
    """The rule did not act on a case's program; the reason says why."""


@dataclasses.dataclass
class _Case:
    """One program a rule is checked on: inputs' avals and domains, the original and the forced rewrite."""

    fn: Callable[..., Any]
    avals: tuple[Any, ...]
    names: tuple[str, ...]
    domains: tuple[str, ...]
    before: Any = None
    after: Any = None
    constant: bool = False
    reference: Any = None
    rhs: Callable[..., Any] | None = None  # the right side as a program, for rules whose rhs contains the lhs
    _as_params: Any = None

    def __repr__(self) -> str:  # hypothesis shows the drawn case
        return self.describe()

    def original(self, args: Sequence[Any]) -> list[Any]:
        """The original program's results as a function of the drawn values (constants or not)."""
        if self.constant:
            if self._as_params is None:
                self._as_params = _trace_at(self.fn, self.avals).closed
            return _evaluate(self._as_params, args)
        return _evaluate(self.before, args)

    def describe(self) -> str:
        parts = []
        for n, a, d in zip(self.names, self.avals, self.domains):
            parts.append(f"{n}: {_short(a)}" + ("" if d == "any" else f" {d}"))
        return "(" + ", ".join(parts) + ")" + (" as constants" if self.constant else "")


_FACTS_OF = {"any": frozenset(), "nonneg": frozenset({"NonNeg"}), "nonzero": frozenset({"NonZero"}),
             "positive": frozenset({"Pos", "NonNeg", "NonZero"})}
_WEAKER = {"any": set(), "nonneg": {"any"}, "nonzero": {"any"}, "positive": {"any", "nonneg", "nonzero"}}


class _GuardView(Value):
    """What a guard sees while we ask it which facts it needs: the facts we choose, and no nodes."""

    def __init__(self, aval: Any, facts: frozenset) -> None:
        super().__init__(aval)
        self._given = facts
        self.wants_nodes = False

    def _fact(self, fact: str) -> bool:
        self.read_facts = True
        return self.is_floating and fact in self._given

    @property
    def nodes(self) -> list:  # literal, constant and node() read this too
        self.wants_nodes = True
        return []


def _guard_domains(rule: Rule, avals: tuple[Any, ...]) -> tuple[list[tuple[str, ...]], bool]:
    """The weakest fact domains per variable under which the guard accepts these avals, and whether it reads nodes.

    ``nonzero`` is split into ``positive`` and ``negative``: no derivation
    rule gives NonZero to a tensor of mixed signs.
    """
    if rule.when is None:
        return [("any",) * len(avals)], False
    choices = [tuple(_FACTS_OF) if _is_float(a.dtype) else ("any",) for a in avals]
    passing = []
    wants_nodes = False
    for combo in itertools.product(*choices):
        views = [_GuardView(a, _FACTS_OF[d]) for a, d in zip(avals, combo)]
        try:
            ok = bool(rule.when(*views))
        except Exception:
            ok = False
        wants_nodes |= any(v.wants_nodes for v in views)
        if ok:
            passing.append(combo)

    def weaker(a: tuple, b: tuple) -> bool:  # a strictly weaker than b
        return a != b and all(x == y or x in _WEAKER[y] for x, y in zip(a, b))

    minimal = [c for c in passing if not any(weaker(o, c) for o in passing)]
    out: list[tuple[str, ...]] = []
    for combo in minimal:
        options = [("positive", "negative") if d == "nonzero" else (d,) for d in combo]
        for expanded in itertools.product(*options):
            if expanded not in out:
                out.append(expanded)
    return out, wants_nodes


def _wrap(domain: str, x: Any) -> Any:
    """Establish the fact a domain stands for, by operations the fact rules know; the identity on its values."""
    return _into_domain(x, domain, lax.abs, jnp.maximum, lax.neg)


def _recording(rule: Rule) -> tuple[Rule, list[int]]:
    """A copy of a procedural rule that notes the class names it replaces, for the forced extraction."""
    roots: list[int] = []
    proc = rule.rhs

    def record(m: Any) -> Any:
        out = proc(m)
        if isinstance(out, list):
            # A rule that replaces a loop hands its outputs over (the pairs), and the loop itself
            # (the matched class, a tuple) is what must not be taken any more.
            roots.extend([m.root.name] * bool(out) + [a.name for a, _ in out])
        elif out is not None:
            roots.append(m.root.name)
        return out

    twin = copy.copy(rule)
    twin.rhs = Procedure(record)
    return twin, roots


def _forced(result: Result, closed: core.ClosedJaxpr, vids: Sequence[int], ctor: set[str] | None = None
            ) -> core.ClosedJaxpr | None:
    """The program with the rule's work taken wherever it acted, even where it costs more.

    Normal extraction keeps the input program on ties and when a rewrite
    costs more, so a rule such as ``x*y -> y*x`` would be compared with
    itself. Here the matched node is barred from each matched class, so the
    class must be computed another way, which only the rule can have added.
    The matched node is the node each name in ``vids`` was made for; for a
    :class:`Pat` rule, whose recorded names are whatever names the matched
    classes had, it is every node of the input program in those classes
    with the pattern's constructor ``ctor``. ``None`` when no matched class
    has another way.
    """
    eg, snap = result.egraph, result.snapshot
    barred: dict[Any, set] = {}
    for vid in vids:
        cls = snap.cls_of_name[vid]
        nodes = snap.nodes.get(cls, ())
        if ctor is not None:
            bar = {n for n in nodes if n[0] in ctor and n in (result.original or ())}
        else:
            node = eg.canonical(snap, vid)
            bar = {node} if node is not None else set()
        # A multi-result node (a loop) is barred even though its class has no other node: its
        # projections must then come from what the rule built, or the roots cannot be computed.
        if bar and (len(nodes) > len(bar) or isinstance(snap.aval(cls), TupleType)):
            barred.setdefault(cls, set()).update(bar)
    if not barred:
        return None
    ex = Extractor(snap, AnalyticCost())
    _, choice = ex.tree(lambda cls, ctor, args: ctor in _CONTAINERS or (ctor, args) not in barred.get(cls, ()))
    if any(r not in choice for r in result.roots or []):
        return None
    return emit(snap, choice, eg, closed.in_avals, result.roots, None, closed.jaxpr.debug_info)


def _pat_ctor(pat: Any) -> set[str]:
    """The constructors of the nodes a :class:`Pat` matches at its root."""
    return pat.ctors()


def _rewrite_case(rule: Rule, owner: Ruleset, fn: Callable[..., Any], avals: tuple[Any, ...],
                  rhs_program: Callable[..., Any] | None = None) -> tuple[Any, Any]:
    """Rewrite ``fn`` at ``avals`` with ``rule`` alone; return (original, forced rewrite) or raise _NotExercised.

    A right-hand side that contains the left-hand side (``abs(x) -> abs(abs(x))``) puts a node in
    the matched class that needs the class itself, which no extraction can take. When the rule
    fired but cannot be forced for that reason, ``rhs_program`` (the right side as a function of
    the same inputs) is traced and compared instead.
    """
    traced = _trace_at(fn, avals)
    if traced.closed.jaxpr.effects:
        raise _NotExercised("the program has effects")
    checked, roots = _recording(rule) if rule.is_pat else (rule, [])
    result = run_pipeline(traced, [(checked, owner)], AnalyticCost(), owner.limits or Limits(), keep=True)
    problems = [w for w in result.warnings if f"rule {rule.name!r}" in w]
    if problems:
        raise AssertionError(f"rule {rule.name!r} [{owner.name}, {owner.soundness}] failed while rewriting "
                             f"at ({', '.join(_short(a) for a in avals)}): " + "; ".join(problems))
    stats = result.stats[rule.name]
    if not stats.fired:
        why = ", ".join(f"{n} {k}" for k, n in sorted(stats.rejected.items())) or "no match"
        raise _NotExercised(f"did not fire ({why})")
    vids = roots if rule.is_pat else list(result.out_names or [])
    after = _forced(result, traced.closed, vids, _pat_ctor(rule.lhs) if rule.is_pat else None)
    if after is None and rhs_program is not None:
        after = _trace_at(rhs_program, avals).closed
    if after is None:
        raise _NotExercised("fired, but what it built can only be computed through the matched value itself")
    try:
        core.check_jaxpr(after.jaxpr)
    except Exception as e:
        raise AssertionError(f"rule {rule.name!r} [{owner.name}]: the rewritten program is ill-formed: {e}") from None
    return traced.closed, after


def _cases(rule: Rule, owner: Ruleset) -> tuple[list[_Case], list[str], bool]:
    """Every program the rule can be checked on with drawn inputs, the cases it could not act on, and
    whether a guard reads the matched nodes (so inputs must be constants)."""
    cases: list[_Case] = []
    skipped: list[str] = []
    wants_nodes = False
    if rule.is_pat:
        if rule.program is None:
            return [], ["a Pat rule needs an example program: rule(..., example=(fn, args))"], False
        fn, avals = rule.program
        candidates = [_Case(fn, avals, tuple(f"arg{i}" for i in range(len(avals))), ("any",) * len(avals))]
    else:
        candidates = []
        for avals in rule.probes:
            domains, nodes = _guard_domains(rule, avals)
            wants_nodes |= nodes
            if not domains:
                skipped.append(f"({', '.join(_short(a) for a in avals)}): the guard rejects every domain")
            for combo in domains:
                def program(*xs: Any, _combo: tuple = combo, _side: Callable = rule.lhs) -> Any:
                    return _side(*[_wrap(d, x) for d, x in zip(_combo, xs)])

                case = _Case(program, avals, tuple(rule.var_names), combo)
                if not rule.is_procedural:
                    case.rhs = functools.partial(program, _side=rule.rhs)
                candidates.append(case)
    for case in candidates:
        try:
            case.before, case.after = _rewrite_case(rule, owner, case.fn, case.avals, case.rhs)
        except _NotExercised as e:
            skipped.append(f"{case.describe()}: {e}")
            continue
        case.reference = _Reference(case.fn, case.avals)
        cases.append(case)
    return cases, skipped, wants_nodes


def _constant_cases(rule: Rule) -> list[_Case]:
    """Cases whose inputs are baked in as constants, drawn anew each example, for guards that read values."""
    if rule.is_pat:
        fn, avals = rule.program  # type: ignore[misc]
        names = tuple(f"arg{i}" for i in range(len(avals)))
        return [_Case(fn, avals, names, ("any",) * len(avals), constant=True, reference=_Reference(fn, avals))]
    return [_Case(rule.lhs, avals, tuple(rule.var_names), ("any",) * len(avals), constant=True,
                  reference=_Reference(rule.lhs, avals)) for avals in rule.probes]


def _failure(rule: Rule, owner: Ruleset, case: _Case, vals: Sequence[Any], want: Sequence[Any],
             got: Sequence[Any], why: str) -> AssertionError:
    lines = [f"rule {rule.name!r} [{owner.name}, {owner.soundness}] does not hold: {why}",
             f"  case {case.describe()}" + (" (inputs of the rule's example program)" if rule.is_pat else "")]
    for n, v in zip(case.names, vals):
        lines.append(f"    {n} = {_show(v, 7 + len(n))}")
    for i, (w, g) in enumerate(zip(want, got)):
        tag = f"[{i}]" if len(want) > 1 else ""
        lines.append(f"  original{tag}  = {_show(w, 14 + len(tag))}")
        lines.append(f"  rewritten{tag} = {_show(g, 14 + len(tag))}")
    if case.after is not None:
        lines.append("  rewritten program: " + str(case.after).replace("\n", "\n    "))
    return AssertionError("\n".join(lines))


def _check_rule(rule: Rule, owner: Ruleset, max_examples: int | None) -> RuleCheck:
    report = RuleCheck(rule.name, owner.name, owner.soundness)
    cases, skipped, wants_nodes = _cases(rule, owner)
    report.skipped = skipped
    constant = False
    if not cases and (wants_nodes or rule.is_procedural) and (not rule.is_pat or rule.program is not None):
        # The rule may need to see values (a guard reading .constant, a procedure that declines
        # unknown inputs): try again with inputs baked in as constants, rewritten per example.
        cases = _constant_cases(rule)
        constant = True
    if not cases:
        raise AssertionError(
            f"rule {rule.name!r} [{owner.name}, {owner.soundness}] was never exercised, so it cannot be checked:\n"
            + "\n".join(f"  {s}" for s in skipped)
            + "\n  Give example= with shapes and dtypes where it applies (for a Pat rule, example=(fn, args)).")
    soundness, tolerance = owner.soundness, owner.tolerance
    fired = [0]

    def run(data: Any) -> None:
        case = data.draw(st.sampled_from(cases), label="case") if len(cases) > 1 else cases[0]
        vals = [data.draw(arrays(a.shape, a.dtype, soundness, d), label=n)
                for n, a, d in zip(case.names, case.avals, case.domains)]
        if case.constant:
            bound = [jnp.asarray(v) for v in vals]  # jax arrays, so the program's operations are traced
            try:
                before, after = _rewrite_case(rule, owner, functools.partial(case.fn, *bound), ())
            except _NotExercised:
                return
            shown, args = dataclasses.replace(case, before=before, after=after), []
        else:
            shown, before, after, args = case, case.before, case.after, vals
        fired[0] += 1
        want = _evaluate(before, args)
        got = _evaluate(after, args)
        evidence = _Evidence(lambda: case.reference(vals), lambda: _spreads(case.original, vals, want))
        for i, (w, g) in enumerate(zip(want, got)):
            why = evidence.mismatch(i, w, g, soundness, tolerance)
            if why is not None:
                raise _failure(rule, owner, shown, vals, want, got, why)

    _settings(max_examples)(given(st.data())(run))()
    if constant and not fired[0]:
        raise AssertionError(
            f"rule {rule.name!r} [{owner.name}, {owner.soundness}] was never exercised: it did not fire on "
            "parameters nor on any drawn constant inputs:\n" + "\n".join(f"  {s}" for s in skipped))
    report.cases = [c.describe() for c in cases]
    report.examples = fired[0]
    return report


def check_ruleset(ruleset: Any, *, max_examples: int | None = None) -> CheckReport:
    """Check every rule of ``ruleset`` on drawn inputs; raise ``AssertionError`` naming each rule that fails.

    Each rule is checked on its own, in its owner's soundness class. Its
    left-hand side, traced at the shapes and dtypes it was defined at (its
    probes, or ``example=``) and that its guard allows, is a program; that
    program is rewritten with this rule alone, and the rewrite is forced to
    use what the rule built even where the cost model would not. A rule that
    never fires fails the check: a check that compares a program with itself
    proves nothing. Guards that ask for facts (``x.positive``) are met by
    drawing inputs through operations that establish the fact; guards and
    procedures that read values (``x.constant``) get their inputs as
    constants. A :class:`Pat` rule is checked on its ``example=(fn, args)``
    program. The original and the rewritten program are then compared on
    inputs hypothesis draws, shrinking any failure to a small
    counterexample, which the error shows with both results.

    ``max_examples`` is per rule; the active hypothesis profile decides when
    it is ``None``. Returns a :class:`CheckReport` of what was checked.

    >>> import jax.numpy as jnp
    >>> from rewrite import rule, Ruleset
    >>> good = Ruleset("good", [rule(lambda x: -(-x), lambda x: x, name="neg_neg")])
    >>> print(check_ruleset(good, max_examples=5).rules["neg_neg"].examples)
    5
    >>> bad = Ruleset("bad", [rule(lambda x: x - x, lambda x: jnp.zeros_like(x), name="sub_self")])
    >>> check_ruleset(bad, max_examples=50)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    AssertionError: check_ruleset('bad'): 1 of 1 rule(s) failed...
    rule 'sub_self' [bad, exact] does not hold: at []: original nan, rewritten 0.0 ...
    """
    entries = entries_of(ruleset)
    name = getattr(ruleset, "name", None) or "+".join(o.name for o in {id(o): o for _, o in entries}.values())
    report = CheckReport(name)
    failures = []
    for rule, owner in entries:
        try:
            report.rules[rule.name] = _check_rule(rule, owner, max_examples)
        except AssertionError as e:
            failures.append(str(e))
    if failures:
        raise AssertionError(f"check_ruleset({name!r}): {len(failures)} of {len(entries)} rule(s) failed\n"
                             + "\n\n".join(failures))
    return report


# ====================================================================== assert_equivalent
def _float_leaf(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape") and _is_float(x.dtype)


def _widened(args: Any) -> Any:
    """Inexact array leaves in float64 (numpy stays numpy, jax stays jax); call with x64 enabled."""
    def widen(x: Any) -> Any:
        if not (is_traced_leaf(x) and hasattr(x, "dtype")):
            return x
        wide = np.asarray(x).astype(_wide(x.dtype))
        return wide if isinstance(x, (np.ndarray, np.generic)) else jnp.asarray(wide)

    return jax.tree_util.tree_map(widen, args)


def _reference_outputs(fn: Callable[..., Any], args: Any) -> list[Any] | None:
    """``fn`` run in float64 on the same inputs: the true result, for the identity and fastmath classes."""
    try:
        with jax.enable_x64(True):
            out = fn(*_widened(args))
            return [np.asarray(x) if hasattr(x, "dtype") else x for x in jax.tree_util.tree_leaves(out)]
    except Exception:
        return None


class _Equivalence:
    """Runs a program and its rewrite on given inputs and raises ``AssertionError`` on a difference."""

    def __init__(self, fn: Callable[..., Any], rewritten: Callable[..., Any], soundness: str,
                 tolerance: Tolerance | None, grads: bool, name: str, fired: dict[str, int] | None = None) -> None:
        self.fn = fn
        self.fired = fired or {}
        self.rewritten = rewritten
        self.soundness = soundness
        self.tolerance = tolerance
        self.grads = grads
        self.name = name

    def fail(self, args: Any, what: str, why: str, want: Any = None, got: Any = None) -> AssertionError:
        lines = [f"{self.name}: the rewritten program differs from the original in {what}: {why}", "  inputs:"]
        for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
            key = f"    args{jax.tree_util.keystr(path)} = "
            lines.append(key + (_show(leaf, len(key)) if hasattr(leaf, "dtype") else repr(leaf)))
        if want is not None:
            lines.append(f"  original  = {_show(want, 14)}")
            lines.append(f"  rewritten = {_show(got, 14)}")
        if self.fired:
            lines.append("  rules that fired: " + ", ".join(f"{k} ({n})" for k, n in self.fired.items()))
        if isinstance(self.fn, RandomProgram) or isinstance(getattr(self.fn, "program", None), RandomProgram):
            lines.append("  program: " + repr(self.fn).replace("\n", "\n  "))  # a drawn program lists itself
        return AssertionError("\n".join(lines))

    def compare(self, args: Any, want: Any, got: Any, what: str, evidence: _Evidence) -> None:
        w_leaves, w_tree = jax.tree_util.tree_flatten_with_path(want)
        g_leaves, g_tree = jax.tree_util.tree_flatten(got)
        if w_tree != g_tree:
            raise self.fail(args, what, f"structure {g_tree} instead of {w_tree}")
        soundness, tolerance = self.soundness, self.tolerance
        for i, ((path, w), g) in enumerate(zip(w_leaves, g_leaves)):
            where = f"{what}{jax.tree_util.keystr(path)}"
            if not hasattr(w, "dtype"):
                if w != g:
                    raise self.fail(args, where, f"{g!r} instead of {w!r}")
                continue
            why = evidence.mismatch(i, w, g, soundness, tolerance)
            if why is not None:
                raise self.fail(args, where, why, w, g)

    def check(self, args: Any, draw_cotangent: Callable[[Any], Any] | None = None) -> None:
        want = self.fn(*args)
        got = self.rewritten(*args)

        def outputs(a: Any) -> list[Any]:
            return [np.asarray(x) if hasattr(x, "dtype") else x for x in jax.tree_util.tree_leaves(self.fn(*a))]

        evidence = _Evidence(lambda: _reference_outputs(self.fn, args),
                             lambda: _spreads(outputs, args, jax.tree_util.tree_leaves(want)))
        self.compare(args, want, got, "the result", evidence)
        if not self.grads:
            return
        leaves, treedef = jax.tree_util.tree_flatten(args)
        idx = [i for i, x in enumerate(leaves) if is_traced_leaf(x) and _float_leaf(x)]
        if not idx:
            return

        def pullback(f: Callable[..., Any], a: Any) -> tuple[list[Any], Callable[..., Any]]:
            ls0 = jax.tree_util.tree_leaves(a)

            def g(*xs: Any) -> list[Any]:
                ls = list(ls0)
                for i, x in zip(idx, xs):
                    ls[i] = x
                return [o for o in jax.tree_util.tree_leaves(f(*jax.tree_util.tree_unflatten(treedef, ls)))
                        if _float_leaf(o)]

            return jax.vjp(g, *[ls0[i] for i in idx])

        outs, vjp_want = pullback(self.fn, args)
        _, vjp_got = pullback(self.rewritten, args)
        cts = [draw_cotangent(o) if draw_cotangent is not None else jnp.ones_like(o) for o in outs]
        grads_want = [np.asarray(x) for x in vjp_want(cts)]
        grads_got = [np.asarray(x) for x in vjp_got(cts)]

        def original_grads(a: Any) -> list[Any]:
            return [np.asarray(x) for x in pullback(self.fn, a)[1](cts)]

        # Gradients are new programs (JAX differentiates each side), so even exact rules meet
        # them within a tolerance; at kinks (abs, max) two sound forms may differ outright.
        soundness = self.soundness if self.soundness != "exact" else "identity"
        tolerance = self.tolerance or Tolerance()
        evidence = _Evidence(None, lambda: _spreads(original_grads, args, grads_want))
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
        for k, i in enumerate(idx):
            why = evidence.mismatch(k, grads_want[k], grads_got[k], soundness, tolerance)
            if why is not None:
                raise self.fail(args, f"the gradient for args{jax.tree_util.keystr(paths[i])}", why,
                                grads_want[k], grads_got[k])


def _classes(entries: Sequence[tuple[Rule, Ruleset]], rtol: float | None, atol: float | None
             ) -> tuple[str, Tolerance | None]:
    soundness, tolerance = _tolerance(entries)
    if rtol is not None or atol is not None:
        base = tolerance or Tolerance(0.0, 0.0)
        tolerance = Tolerance(base.rtol if rtol is None else rtol, base.atol if atol is None else atol)
        soundness = soundness if soundness != "exact" else "identity"
    return soundness, tolerance


def _rewritten(fn: Callable[..., Any], args: tuple, rulesets: Any, limits: Limits | None) -> tuple[Any, Result, dict]:
    rewritten = rewrite(fn, rulesets=rulesets, limits=limits, strict=True)
    result = rewritten.result(*args)
    fired = {k: s.fired for k, s in result.stats.items() if s.fired}
    return rewritten, result, fired


def assert_equivalent(fn: Callable[..., Any], *example_args: Any, rulesets: Any = (), rtol: float | None = None,
                      atol: float | None = None, max_examples: int | None = None, grads: bool = False,
                      limits: Limits | None = None) -> Result:
    """Check that rewriting ``fn`` with ``rulesets`` keeps its results, on inputs drawn like ``example_args``.

    Inputs are drawn with the example's tree structure, shapes and dtypes
    (non-array leaves are kept; see :func:`inputs_like`), with values from
    the weakest soundness class among the rulesets (:func:`elements`). The
    original and ``rewrite(fn, rulesets=...)`` run on each, and their results
    are compared by :func:`mismatch`: bit for bit when every rule is
    ``exact``, otherwise within the widest tolerance of the weakest class,
    unless ``rtol``/``atol`` are given. With ``grads=True`` the gradients
    (a vector-Jacobian product with a drawn cotangent) are compared too,
    within a tolerance even for exact rules. A difference raises
    ``AssertionError`` with the shrunk inputs, both results and the rules
    that fired. A rewrite that changes nothing proves nothing, and warns
    with :class:`VacuousCheckWarning`.

    Returns the rewrite's result at the example's signature (``cost_before``,
    ``cost_after``, ``stopped``, ``times``, per-rule ``stats``).

    >>> import jax.numpy as jnp
    >>> from rewrite import rule, Ruleset
    >>> wrong = Ruleset("mine", [rule(lambda x, y: (x * y) / y, lambda x, y: x, name="cancel")],
    ...                 soundness="identity")
    >>> def f(a, b):
    ...     return jnp.sum((a * b) / b)
    >>> assert_equivalent(f, jnp.ones(3), jnp.ones(3), rulesets=[wrong])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    AssertionError: f: the rewritten program differs from the original in the result: at []: original nan...
    """
    soundness, tolerance = _classes(entries_of(rulesets), rtol, atol)
    name = getattr(fn, "__name__", "function")
    rewritten, result, fired = _rewritten(fn, example_args, rulesets, limits)
    if not fired or str(result.after) == str(result.before):
        warnings.warn(VacuousCheckWarning(
            f"assert_equivalent({name}): no rule changed the program, so it was compared with itself"), stacklevel=2)
    check = _Equivalence(fn, rewritten, soundness, tolerance, grads, name, fired)

    def run(data: Any) -> None:
        args = data.draw(inputs_like(example_args, soundness), label="args")
        check.check(args, lambda o: jnp.asarray(data.draw(arrays(o.shape, o.dtype, "fastmath"), label="cotangent")))

    _settings(max_examples)(given(st.data())(run))()
    return result


def assert_same_results(fn: Callable[..., Any], *args: Any, rulesets: Any = (), rtol: float | None = None,
                        atol: float | None = None, grads: bool = False, limits: Limits | None = None) -> Result:
    """One step of :func:`assert_equivalent`: rewrite ``fn`` and compare it with the original on these ``args``.

    For fuzz tests that draw the program and its inputs in one hypothesis
    test (nesting :func:`assert_equivalent` inside ``@given`` would nest two
    searches). Comparison and tolerances are as in :func:`assert_equivalent`;
    gradients use a cotangent of ones. Returns the rewrite's result.

    >>> from hypothesis import given, settings, strategies as st
    >>> from rewrite import rule, Ruleset
    >>> mine = Ruleset("mine", [rule(lambda x: -(-x), lambda x: x, name="neg_neg")])
    >>> @settings(max_examples=5, deadline=None)
    ... @given(programs(max_ops=4), st.data())
    ... def fuzz(program, data):
    ...     args = data.draw(inputs_like(program.args, "exact"))
    ...     assert_same_results(program, *args, rulesets=[mine])
    >>> fuzz()
    """
    soundness, tolerance = _classes(entries_of(rulesets), rtol, atol)
    rewritten, result, fired = _rewritten(fn, args, rulesets, limits)
    _Equivalence(fn, rewritten, soundness, tolerance, grads, getattr(fn, "__name__", "function"), fired).check(args)
    return result
