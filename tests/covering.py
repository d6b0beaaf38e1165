"""Property tests that run explicit cases covering every value each dimension of their strategy draws.

A property test whose every example rewrites and compiles new programs (seconds each) runs, under the default
``ci`` profile, a list of explicit cases (``@example``) chosen so that every value of every dimension is drawn by
one of them at least, instead of random draws that left values out: the ``ci`` profile's 12 derandomised draws of
``tests/test_attention.py``'s values test never drew an array mask. The ``thorough`` profile
(``HYPOTHESIS_PROFILE=thorough``) runs the cases and draws as many examples as before besides.

``DIMS`` (dimension -> its values) builds the strategy (:func:`strategy`) and checks the cases (:func:`covers`), so
a value added to a dimension without a case to draw it fails at collection.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hypothesis import Phase, example, strategies as st

#: The phases of a covered property test: its explicit cases alone under ``ci``; drawn examples too otherwise.
PHASES = (Phase.explicit,) if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else tuple(Phase)


def strategy(dims: Mapping[str, Sequence[Any]], **others: st.SearchStrategy) -> st.SearchStrategy:
    """A dictionary drawing each dimension of ``dims`` from its values, and ``others`` (a seed) as given."""
    return st.fixed_dictionaries({**{k: st.sampled_from(list(v)) for k, v in dims.items()}, **others})


def uncovered(dims: Mapping[str, Sequence[Any]], cases: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """Each dimension's values that no case takes (a case lacking the dimension takes none of them)."""
    out = {}
    for name, values in dims.items():
        missing = [v for v in values if not any(name in c and c[name] == v for c in cases)]
        if missing:
            out[name] = missing
    return out


def covers(dims: Mapping[str, Sequence[Any]], cases: Sequence[Mapping[str, Any]],
           as_example: Callable[[Mapping[str, Any]], tuple[tuple, dict]]) -> Callable:
    """A decorator adding ``@example(*args, **kwargs)`` for each case (``as_example`` maps a case to them); raises
    ``ValueError`` if some value of ``dims`` is in no case."""
    missing = uncovered(dims, cases)
    if missing:
        raise ValueError(f"values no explicit case draws: {missing}")

    def decorate(fn: Callable) -> Callable:
        for case in reversed(cases):
            args, kwargs = as_example(case)
            fn = example(*args, **kwargs)(fn)
        return fn

    return decorate


def examples(dims: Mapping[str, Sequence[Any]], cases: Sequence[Mapping[str, Any]],
             lists: Sequence[str] = ()) -> Callable:
    """A decorator adding ``@example(case)`` for each case, a test taking one case (a dictionary); raises
    ``ValueError`` if some value of ``dims`` is in no case. A dimension named in ``lists`` is a list in each case,
    which takes each of its values. Values are compared by ``repr``, so NaN takes NaN and -0.0 is not 0.0."""
    views = [{**c, k: v} for c in cases for k in lists for v in c[k]] + list(cases)
    missing = uncovered({k: [repr(v) for v in vs] for k, vs in dims.items()},
                        [{k: repr(v) for k, v in view.items()} for view in views])
    if missing:
        raise ValueError(f"values no explicit case draws: {missing}")

    def decorate(fn: Callable) -> Callable:
        for case in reversed(cases):
            fn = example(case)(fn)
        return fn

    return decorate
