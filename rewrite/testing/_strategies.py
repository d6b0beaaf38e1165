"""Hypothesis strategies for the values each soundness class is checked on.

A class decides which inputs a check draws: ``exact`` rules meet every value
a float can hold (zeros of both signs, infinities, NaN, subnormals, the
extremes), ``identity`` rules finite values up to :func:`value_bound`, and
``fastmath`` rules ordinary values. :func:`elements`, :func:`arrays` and
:func:`inputs_like` draw scalars, arrays and whole argument trees that way;
the rule and program checks draw through them, and so can a user's own
tests. ``_settings`` is the hypothesis profile every check runs under.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from ..ir.jaxapi import convert_element_type
from ..jaxpr.trace import is_traced_leaf
from ..rules.ruleset import SOUNDNESS

#: fastmath rules are checked on "ordinary" values: normal floats of magnitude at most this, and zero.
ORDINARY_BOUND = 4.0


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.floating))


def _is_complex(dtype: Any) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.complexfloating))


def _float_width(dtype: Any) -> int:
    bits = np.dtype(dtype).itemsize * 8
    return bits if bits in (16, 32, 64) and np.dtype(dtype) != jnp.bfloat16 else 32


def _wide(dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    if _is_complex(dtype):
        return np.dtype(np.complex128)
    if _is_float(dtype):
        return np.dtype(np.float64)
    return dtype


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


def _specials(dtype: Any, soundness: str = "exact") -> list[Any]:
    """Values every class must be tried on; hypothesis's own draws add the rest.

    The ``exact`` list is also what the pack tests (``tests/packcheck.py``)
    run every rule on, cycled through arrays: signed zeros, infinities, NaN
    of both signs, subnormals, the extremes and their halves, and a few
    ordinary values. Integers and booleans have one list for every class.
    """
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return [False, True]
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        lo, hi = int(info.min), int(info.max)
        return sorted({0, 1, 2, 3, 7, lo, lo + 1, hi, hi - 1} | ({-1} if lo < 0 else set()))
    info = jnp.finfo(dtype)
    tiny, sub = float(info.smallest_normal), float(info.smallest_subnormal)
    common = [0.0, 1.0, -1.0, 0.5, -2.0]
    if soundness == "exact":
        big = float(info.max)
        return ([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, sub, -sub, tiny, -tiny, tiny / 4, -tiny / 8,
                 big, -big, big / 2] + common[1:] + [2.0, -3.0, 1.5, 1e-3, 7.25, -1e4])
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
        return st.one_of(st.sampled_from(_specials(dtype)), st.integers(int(info.min), int(info.max)))
    if _is_complex(dtype):
        part = np.dtype(np.float64 if dtype == np.complex128 else np.float32)
        return st.builds(complex, elements(part, soundness), elements(part, soundness))
    if not _is_float(dtype):
        raise TypeError(f"no values known for dtype {dtype}")
    width = _float_width(dtype)
    specials = [float(np.asarray(v, dtype)) for v in _specials(dtype, soundness)]
    if soundness == "exact" and width == 16:
        # An unbounded 16-bit draw rejects every float64 beyond float16's range, which starves a test
        # that draws a few arrays; infinities and NaN come from the specials instead.
        big = float(jnp.finfo(dtype).max)
        floats = st.floats(-big, big, width=width, allow_subnormal=True)
    elif soundness == "exact":
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
        out = convert_element_type(out, out.dtype, weak_type=True)
    return out


def _settings(max_examples: int | None) -> settings:
    """The active profile, with what a check needs on top (no deadline: a rewrite takes a while)."""
    base = settings.default
    # The explain phase re-runs a failure many times to say which draws mattered; the error
    # message already shows the whole shrunk example, so it would only add seconds per failure.
    phases = [p for p in base.phases if p != Phase.explain]
    return settings(base, max_examples=max_examples if max_examples is not None else base.max_examples,
                    deadline=None, database=None, suppress_health_check=list(HealthCheck),
                    report_multiple_bugs=False, phases=phases)

