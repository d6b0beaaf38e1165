"""Stage 1, trace: a Python function and its arguments become a ``ClosedJaxpr``.

Arguments and results may be any pytrees. The jaxpr takes and returns their
flattened leaves; the tree structures are kept so stage 6 can rebuild them.
Static arguments (``static_argnums``/``static_argnames``, as in ``jax.jit``)
are baked into the trace and become part of the cache key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
from jax._src import core


@dataclasses.dataclass(frozen=True)
class Traced:
    closed: core.ClosedJaxpr
    in_tree: Any
    out_tree: Any


def split_static(args: tuple, kwargs: dict, static_argnums: Sequence[int], static_argnames: Sequence[str]
                 ) -> tuple[tuple, dict, tuple, tuple]:
    """Separate static arguments; returns (dynamic args, dynamic kwargs, static args key, static kwargs key)."""
    nums = {i % len(args) if args else i for i in static_argnums}
    dyn_args = tuple(a for i, a in enumerate(args) if i not in nums)
    stat_args = tuple((i, a) for i, a in enumerate(args) if i in nums)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_argnames}
    stat_kwargs = tuple(sorted((k, v) for k, v in kwargs.items() if k in static_argnames))
    return dyn_args, dyn_kwargs, stat_args, stat_kwargs


def aval_key(x: Any) -> Any:
    aval = jax.typeof(x)
    return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)),
            getattr(aval, "sharding", None), getattr(aval, "vma", None))


def trace(fn: Callable[..., Any], flat_avals: Sequence[Any], in_tree: Any, stat_args: tuple, stat_kwargs: tuple,
          n_args: int) -> Traced:
    """Trace ``fn`` on inputs of the given avals (the leaves of ``(dynamic args, dynamic kwargs)``)."""
    out_tree_box: list[Any] = []
    statics = dict(stat_args)

    def flat_fn(*flat: Any) -> list[Any]:
        dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(in_tree, flat)
        it = iter(dyn_args)
        args = [statics[i] if i in statics else next(it) for i in range(n_args)]
        out = fn(*args, **dyn_kwargs, **dict(stat_kwargs))
        leaves, out_tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(out_tree)
        return leaves

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in flat_avals]
    closed = jax.make_jaxpr(flat_fn)(*specs)
    return Traced(closed, in_tree, out_tree_box[-1])
