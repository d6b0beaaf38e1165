"""A program traced again at float64: the true results and derivatives a rule's check compares against."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ._compare import Float64Results
from ._magnitude import magnitudes
from ._run import _cotangents, _evaluate, _tangents
from ._strategies import _wide


class _Reference:
    """A program traced again at float64, for the true result; ``None`` results where that is impossible."""

    def __init__(self, fn: Callable[..., Any], avals: Sequence[Any]) -> None:
        self.fn = fn
        self.avals = tuple(avals)
        self._closed: Any = None
        self._failed = not any(_wide(a.dtype) != np.dtype(a.dtype) for a in avals)  # nothing to widen

    def _trace_wide(self) -> None:
        """The program traced in float64 (once; call with x64 enabled)."""
        if self._closed is None:
            wide = [jax.ShapeDtypeStruct(a.shape, _wide(a.dtype)) for a in self.avals]
            self._closed = jax.make_jaxpr(self.fn)(*wide)

    def __call__(self, args: Sequence[Any]) -> Float64Results:
        """The float64 results at ``args`` (empty where impossible), with the terms' magnitudes on demand."""
        terms = functools.partial(magnitudes, self.fn, args)
        if self._failed:
            return Float64Results([], terms)
        try:
            with jax.enable_x64(True):
                self._trace_wide()
                outs = _evaluate(self._closed, [np.asarray(a).astype(_wide(np.asarray(a).dtype)) for a in args])
        except Exception:
            self._failed = True
            return Float64Results([], terms)
        return Float64Results(outs, terms)

    def cotangents(self, args: Sequence[Any], cotangents: Sequence[Any]) -> list[Any] | None:
        """The true input cotangents (float64) at ``args`` for output ``cotangents``, or ``None``."""
        return self._derivative(_cotangents, args, cotangents)

    def tangents(self, args: Sequence[Any], tangents: Sequence[Any]) -> list[Any] | None:
        """The true output tangents (float64) at ``args`` along ``tangents``, or ``None``."""
        return self._derivative(_tangents, args, tangents)

    def _derivative(self, derive: Callable[..., Any], args: Sequence[Any], directions: Sequence[Any]
                    ) -> list[Any] | None:
        if self._failed:
            return None

        def widen(xs: Sequence[Any]) -> list[Any]:
            return [None if a is None else np.asarray(a).astype(_wide(np.asarray(a).dtype)) for a in xs]
        try:
            with jax.enable_x64(True):
                self._trace_wide()
                return derive(self._closed, widen(args), widen(directions))
        except Exception:
            return None
