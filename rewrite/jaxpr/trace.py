"""Stage 1, trace: a Python function and its arguments become a ``ClosedJaxpr``.

Arguments and results may be any pytrees. The jaxpr takes and returns their
flattened array leaves; the tree structures are kept so stage 6 can rebuild
them. Leaves that are not arrays (Python numbers, an equinox module's
activation function, a string, a dtype) are static, as under
``eqx.filter_jit``: baked into the trace and part of the cache key. So are ``static_argnums`` and
``static_argnames``, as in ``jax.jit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax._src import core


@dataclasses.dataclass(frozen=True)
class Traced:
    closed: core.ClosedJaxpr
    in_tree: Any
    out_tree: Any
    dynamic: tuple[bool, ...]  # which leaves of the input tree are traced
    out_static: tuple[tuple[int, Any], ...] = ()  # output leaves that are not arrays: (position, value)

    def outputs(self, values: Sequence[Any]) -> Any:
        """Rebuild the output pytree from the jaxpr's results."""
        it = iter(values)
        static = dict(self.out_static)
        n = len(values) + len(static)
        return jax.tree_util.tree_unflatten(self.out_tree, [static[i] if i in static else next(it) for i in range(n)])


@dataclasses.dataclass(frozen=True)
class Static:
    """A leaf baked into the trace."""

    value: Any

    def key(self) -> Any:
        try:
            hash(self.value)
            return ("hash", type(self.value), self.value)
        except TypeError:
            return ("id", id(self.value))


def is_traced_leaf(x: Any) -> bool:
    """Arrays and tracers are traced; everything else, Python numbers included, is static.

    This is ``eqx.filter_jit``'s rule, and the right one under an outer
    transformation too: whatever the outer trace made concrete arrives here
    concrete and may steer Python control flow.
    """
    return isinstance(x, (jax.Array, np.ndarray, np.generic, core.Tracer))


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


def leaf_specs(flat: Sequence[Any]) -> tuple[list[Any], tuple]:
    """Per leaf: its aval if traced, else ``Static``. Also a hashable key for the cache."""
    specs: list[Any] = []
    key = []
    for x in flat:
        if is_traced_leaf(x):
            specs.append(jax.typeof(x))
            key.append(aval_key(x))
        else:
            s = Static(x)
            specs.append(s)
            key.append(s.key())
    return specs, tuple(key)


def trace(fn: Callable[..., Any], specs: Sequence[Any], in_tree: Any, stat_args: tuple, stat_kwargs: tuple,
          n_args: int) -> Traced:
    """Trace ``fn`` on leaves described by ``specs`` (avals for traced leaves, :class:`Static` otherwise)."""
    out_tree_box: list[Any] = []
    statics = dict(stat_args)
    dynamic = tuple(not isinstance(s, Static) for s in specs)

    def flat_fn(*dyn: Any) -> list[Any]:
        it = iter(dyn)
        leaves = [next(it) if d else s.value for s, d in zip(specs, dynamic)]
        dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        it_args = iter(dyn_args)
        args = [statics[i] if i in statics else next(it_args) for i in range(n_args)]
        out = fn(*args, **dyn_kwargs, **dict(stat_kwargs))
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        out_static = tuple((i, v) for i, v in enumerate(out_leaves) if not is_traced_leaf(v))
        out_tree_box.append((out_tree, out_static))
        return [v for v in out_leaves if is_traced_leaf(v)]

    avals = [s for s, d in zip(specs, dynamic) if d]
    with _context(avals), _collect_young_only():  # a full collection here cost a neural ODE 0.15 s of 0.33
        closed = jax.make_jaxpr(flat_fn)(*[spec_of(a) for a in avals])
    out_tree, out_static = out_tree_box[-1]
    return Traced(closed, in_tree, out_tree, dynamic, out_static)


def spec_of(aval: Any) -> Any:
    """A ``ShapeDtypeStruct`` that traces exactly like ``aval``: weak type, and inside a
    ``shard_map`` body its manual mesh and varying axes too."""
    kwargs: dict[str, Any] = {"weak_type": bool(getattr(aval, "weak_type", False))}
    mesh = _mesh_of(aval)
    if mesh is not None:
        kwargs["sharding"] = aval.sharding
        kwargs["manual_axis_type"] = getattr(aval, "manual_axis_type", None)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, **kwargs)


def _mesh_of(aval: Any) -> Any:
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return mesh if mesh is not None and getattr(mesh, "axis_names", ()) else None


@contextlib.contextmanager
def _context(avals: Sequence[Any]):
    """Enter the mesh context these avals were made in, if they carry a mesh.

    With explicit sharding, every value's type names the mesh, and values made
    inside the trace (a broadcast literal, say) take the context's mesh; inside
    a ``shard_map`` body JAX also tracks which manual axes each value varies
    over and inserts ``pvary``. Tracing without the right context gives values
    of another type than the program's.
    """
    from jax._src import config
    from jax._src.mesh import AxisType
    from jax.sharding import use_abstract_mesh

    mesh = next((m for m in map(_mesh_of, avals) if m is not None), None)
    if mesh is None:
        yield
        return
    manual = tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual)
    with contextlib.ExitStack() as stack:
        stack.enter_context(use_abstract_mesh(mesh))
        if manual:
            varying = any(getattr(getattr(a, "manual_axis_type", None), "varying", None) for a in avals)
            stack.enter_context(core.extend_axis_env_nd([(n, mesh.shape[n]) for n in manual]))
            stack.enter_context(config._check_vma(bool(varying)))
        yield


def trace_at(fn: Callable[..., Any], avals: Sequence[Any]) -> core.ClosedJaxpr:
    """``jax.make_jaxpr(fn)`` at exactly these avals (see :func:`spec_of`).

    Rules trace their sides and replacements at every new shape, hundreds of
    times in a rewrite: where no mesh is involved, the function is traced
    directly, without ``make_jaxpr``'s ``jit`` around it (which is half the
    cost of a small trace); the jaxpr is the same.
    """
    if not any(_mesh_of(a) is not None for a in avals):
        try:
            from jax._src import api_util
            from jax._src import linear_util as lu
            from jax._src.interpreters import partial_eval as pe

            in_avals = [core.ShapedArray(a.shape, a.dtype, weak_type=bool(getattr(a, "weak_type", False)))
                        for a in avals]
            # The debug info made by hand: api_util.debug_info reads the function's signature (inspect), a
            # quarter of a small trace's cost; argument names only label error messages.
            debug = core.DebugInfo("rewrite.trace_at", api_util.fun_sourceinfo(fn), None, core.initial_result_paths)
        except Exception:  # not a function these internals take: make_jaxpr's way (fn is not called twice)
            pass
        else:
            flat = lu.wrap_init(lambda *xs: jax.tree_util.tree_leaves(fn(*xs)), debug_info=debug)
            jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(flat, in_avals)
            return core.ClosedJaxpr(jaxpr, consts)
    with _context(avals):
        return jax.make_jaxpr(fn)(*[spec_of(a) for a in avals])


@contextlib.contextmanager
def _collect_young_only():
    """While the rewrite runs, the garbage collector leaves alone the objects that existed before it.

    A rewrite allocates many small objects, which triggers Python's full
    collections, and each of those walks every object in the process (JAX's
    and the user's included): on a 1,500-equation training step that was
    0.1-0.25 s of a 1.5 s rewrite. ``gc.freeze`` moves what exists now out
    of the collector's sight and ``gc.unfreeze`` puts it back afterwards, so
    nothing is leaked and later collections see everything again. A process
    that froze objects itself, or turned the collector off, is left as it is.
    """
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    # Garbage made since the last collection (an earlier rewrite's e-graph, say) is collected now: frozen,
    # it would wait for the next full collection, holding its e-graph's memory, which the collector
    # does not count. The young generations are small, so this is cheap.
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
