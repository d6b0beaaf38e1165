"""Trace: a Python function and its arguments become a ``ClosedJaxpr``.

Arguments and results may be any pytrees. The jaxpr takes and returns their
flattened array leaves; the tree structures are kept so the call (``api.py``) can rebuild
them. A Python float or complex number passed as an argument is traced, as
``jax.jit`` traces it (a weakly typed scalar), so a learning-rate schedule
does not rewrite on every new value. Other leaves that are not arrays
(numbers inside a pytree, Python ints and bools, an equinox module's
activation function, a string, a dtype) are static, as under ``eqx.filter_jit``: baked into the trace and
part of the cache key, floats in it by their bits (``-0.0`` is not ``0.0``,
and a NaN finds itself). So are ``static_argnums`` and ``static_argnames``,
resolved against the function's signature as ``jax.jit`` resolves them.

A function that closes over a value of an outer trace (a parameter being
differentiated, a value of the jitted function around it) has that value
as a constant of its jaxpr; such constants become trailing inputs of the
program (``Traced.captured``), so the rewritten program reads the outer
trace's value and derivatives flow to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import operator
import struct
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend import linear_util as lu
from jax.interpreters import partial_eval as pe
from jax.sharding import AxisType, use_abstract_mesh

from ..ir.jaxapi import AbstractRef, ad, check_vma, core, fun_sourceinfo, primal_arrays, trace_context
from ..ir.walk import holds_high_values
from . import state as _state
from .metadata import array_metadata
from .relink import relinked


@dataclasses.dataclass(frozen=True)
class Traced:
    closed: core.ClosedJaxpr
    in_tree: Any
    out_tree: Any
    dynamic: tuple[bool, ...]  # which leaves of the input tree are traced
    out_static: tuple[tuple[int, Any], ...] = ()  # output leaves that are not arrays: (position, value)
    #: values of outer traces the function closed over: the program's last ``len(captured)`` inputs
    captured: tuple[Any, ...] = dataclasses.field(default=(), compare=False)
    #: how many such inputs the program has (kept where the values themselves are not: in the cache)
    captured_count: int = 0
    #: the outputs are ``(result, state.Updates)``: the new values of the nnx Variables the call replaced
    carries_state: bool = False
    #: traced again at each call, its rewrite reused for the same program only: it closed over outer traces' values,
    #: or holds hijax values (a Box's type is that of what it holds now: a program for Box([]) reads no list)
    retraced = functools.cached_property(lambda self: bool(self.captured_count) or holds_high_values(self.closed.jaxpr))

    @property
    def jitted(self) -> bool:
        """Is the whole program one ``jit`` call (``jax.jit``, ``eqx.filter_jit``, ``nnx.jit`` of the
        function)? The rewriter sees through it; the rewritten program is then run under ``jit`` too."""
        eqns = self.closed.jaxpr.eqns
        return len(eqns) == 1 and eqns[0].primitive.name in ("jit", "pjit")

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
        return static_key(self.value)


class _Identity:
    """A cache key part for an unhashable static value: equal only to itself, and it keeps the value alive
    (an ``id`` alone can be reused by a new object once the old one is collected)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Identity) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def static_key(v: Any) -> Any:
    """A hashable key that tells apart every two static values that can trace differently.

    ``==`` does not: ``-0.0 == 0.0`` (``x / s`` is ``-inf`` at one and ``inf`` at the other), ``1 == 1.0
    == True``, and a NaN equals nothing, itself included. Floats are keyed by their bits, containers
    element by element, and a value that cannot be hashed by its identity.
    """
    if isinstance(v, float):
        return ("float", struct.pack("<d", v))
    if isinstance(v, complex):
        return ("complex", struct.pack("<dd", v.real, v.imag))
    if type(v) in (tuple, list):
        return (type(v), tuple(static_key(x) for x in v))
    if type(v) is dict:
        return (dict, tuple((static_key(k), static_key(x)) for k, x in v.items()))
    try:
        hash(v)
    except TypeError:
        return ("id", _Identity(v))
    return ("hash", type(v), v)


def is_traced_leaf(x: Any) -> bool:
    """Arrays and tracers are traced; everything else, Python numbers included, is static.

    This is ``eqx.filter_jit``'s rule, and the right one under an outer
    transformation too: whatever the outer trace made concrete arrives here
    concrete and may steer Python control flow.
    """
    return isinstance(x, (jax.Array, np.ndarray, np.generic, core.Tracer, core.Ref, core.Token))


def _traced_output(x: Any) -> bool:
    """Is this output leaf one of the program's outputs? A token closed over and returned is not: it is returned as
    it is, as before tokens were traced (no program holds a token constant)."""
    return is_traced_leaf(x) and not isinstance(x, core.Token)


#: what JAX raises where traced values steer Python control flow
CONCRETIZATION_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                         jax.errors.TracerIntegerConversionError)


class PyScalar:
    """A Python float or complex passed as an argument itself, traced as ``jax.jit`` traces it: a weakly
    typed scalar. A number inside a pytree (an equinox module's ``Dropout(p=0.0)``, a config) stays
    static, as ``eqx.filter_jit`` keeps it: libraries branch on such fields in Python. Python ints and
    bools stay static too: they pick shapes, axes and loop counts far more often than floats do."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def flatten_args(args: tuple, kwargs: dict, static_argnums: Sequence[int], static_argnames: Sequence[str],
                 trace_floats: bool = True) -> tuple[list[Any], Any, list[Any], tuple, tuple, tuple, tuple]:
    """A call's arguments as the tracer takes them: ``(leaves, in_tree, specs, key, static args, static
    kwargs, nnx nodes)``; ``specs`` and ``key`` as :func:`leaf_specs` makes them. With ``trace_floats``,
    Python float and complex arguments (not numbers nested in a pytree) are traced (:class:`PyScalar`).
    The nnx graph nodes among the dynamic arguments are replaced by their state (``state.lift``), and
    returned so that the call can write their new state back (``state.apply``)."""
    dyn_args, dyn_kwargs, stat_args, stat_kwargs = split_static(args, kwargs, static_argnums, static_argnames)
    dyn_args, dyn_kwargs, nodes = _state.lift(dyn_args, dyn_kwargs)
    if trace_floats:
        wrap = lambda v: PyScalar(v) if type(v) in (float, complex) else v  # noqa: E731
        dyn_args, dyn_kwargs = tuple(map(wrap, dyn_args)), {k: wrap(v) for k, v in dyn_kwargs.items()}
    leaves, in_tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
    traced = [isinstance(x, PyScalar) for x in leaves]
    leaves = [x.value if isinstance(x, PyScalar) else x for x in leaves]
    specs, key = leaf_specs(leaves, traced)
    # (trace_context: a program traced under `jax.default_matmul_precision("highest")` is not the one to run
    # outside it, nor the reverse; jax.jit keys on it too)
    key = (in_tree, key, tuple((i, static_key(v)) for i, v in stat_args),
           tuple((k, static_key(v)) for k, v in stat_kwargs), trace_context())
    return leaves, in_tree, specs, key, stat_args, stat_kwargs, nodes


def check_function(fn: Any) -> None:
    """Refuse, where :func:`rewrite.rewrite` is applied, what ``jax.jit`` refuses there: no callable, a generator
    function (its call makes a generator, not arrays) and a ``staticmethod`` or ``classmethod`` object (under a
    class, the decorator would bind it as a method: ``@staticmethod`` goes above ``@rewrite``)."""
    if isinstance(fn, (staticmethod, classmethod)):
        raise TypeError(f"rewrite() of a {type(fn).__name__} object is not supported: put @{type(fn).__name__} above "
                        "@rewrite, so that the function is rewritten first")
    if not callable(fn):
        raise TypeError(f"rewrite() takes a function, got {type(fn).__name__}")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn) or inspect.iscoroutinefunction(fn):
        raise TypeError(f"rewrite() takes a function that returns arrays, got a generator or coroutine function "
                        f"{getattr(fn, '__qualname__', fn)!r}")


def as_operand(x: Any) -> Any:
    """A Python float or complex argument (traced, as ``jax.jit`` traces it) as the weakly typed array it
    was traced as; a NumPy array, or one under a tracer, as a JAX array (:func:`primal_arrays`). A 64-bit array
    made inside ``jax.enable_x64()`` and passed outside it is converted to the 32-bit type it was traced as
    (``spec_of`` canonicalizes its type; ``jax.jit`` converts it in its program)."""
    if type(x) in (float, complex):
        return jax.numpy.asarray(x)
    x = primal_arrays(x)
    dtype = getattr(x, "dtype", None)
    if getattr(dtype, "itemsize", 0) >= 8:  # (a PRNG key's dtype, extended, is its own)
        canonical = jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)
        if canonical != dtype:
            return jax.lax.convert_element_type(x, canonical)
    return x


def concrete_operands(leaves: Sequence[Any], traced: Traced) -> list[Any] | None:
    """The program's operands for this call, if all are concrete arrays (the guard times on them); else None."""
    flat = [as_operand(x) for x, d in zip(leaves, traced.dynamic) if d] + list(traced.captured)
    return None if any(isinstance(x, core.Tracer) or not hasattr(x, "shape") for x in flat) else flat


def resolve_static(fn: Callable[..., Any], static_argnums: Any, static_argnames: Any
                   ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``static_argnums`` and ``static_argnames`` completed and checked against ``fn``'s signature, as
    ``jax.jit`` does: either may be one int or name; the names of the numbered positional-or-keyword
    parameters are static too (so is the number of a named one), and a number or name the signature
    does not have is an error."""
    nums = _index_tuple(static_argnums, "static_argnums")
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)
    names = tuple(static_argnames or ())
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"static_argnames must be a name or a sequence of names, got {static_argnames!r}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (some builtins): taken as given, like jax.jit
        return nums, names
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not any(p.kind == p.VAR_POSITIONAL for p in params) and nums and (
            max(nums) >= len(positional) or -min(nums) > len(positional)):
        raise ValueError(f"static_argnums={nums}, but {getattr(fn, '__name__', 'the function')} takes only "
                         f"{len(positional)} positional argument(s)")
    by_name = [p.name for p in positional]
    if names and not any(p.kind == p.VAR_KEYWORD for p in params):
        unknown = [n for n in names if n not in {p.name for p in params if p.kind != p.POSITIONAL_ONLY}]
        if unknown:
            raise ValueError(f"static_argnames={names}, but {getattr(fn, '__name__', 'the function')} has no "
                             f"keyword parameter(s) {unknown}")
    nums_all = set(nums) | {by_name.index(n) for n in names if n in by_name
                            and positional[by_name.index(n)].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD}
    names_all = list(names) + [by_name[i] for i in sorted(nums) if -len(by_name) <= i < len(by_name)
                               and positional[i].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
                               and by_name[i] not in names]
    return tuple(sorted(nums_all)), tuple(names_all)


def _index_tuple(x: Any, what: str) -> tuple[int, ...]:
    if x is None:
        return ()
    try:
        return (operator.index(x),)
    except TypeError:
        pass
    try:
        return tuple(operator.index(i) for i in x)
    except TypeError:
        raise TypeError(f"{what} must be an int or a sequence of ints, got {x!r}") from None


def split_static(args: tuple, kwargs: dict, static_argnums: Sequence[int], static_argnames: Sequence[str]
                 ) -> tuple[tuple, dict, tuple, tuple]:
    """Separate static arguments; returns (dynamic args, dynamic kwargs, static args key, static kwargs key).

    As in ``jax.jit``: a negative number counts from the end of this call's positional arguments, and a
    number past them names nothing (its argument, if passed by name, is static through its name).
    """
    nums = {i + len(args) if i < 0 else i for i in static_argnums}
    dyn_args = tuple(a for i, a in enumerate(args) if i not in nums)
    stat_args = tuple((i, a) for i, a in enumerate(args) if i in nums)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_argnames}
    stat_kwargs = tuple(sorted((k, v) for k, v in kwargs.items() if k in static_argnames))
    return dyn_args, dyn_kwargs, stat_args, stat_kwargs


def aval_key(aval: Any) -> Any:
    # the dtype itself, not its name: str(dtype) is a third of a cached call's cost on a model's parameters
    if not hasattr(aval, "shape"):  # a type with no shape (a token under jit): it is its own key
        return (aval,)
    return (tuple(aval.shape), aval.dtype, bool(getattr(aval, "weak_type", False)),
            getattr(aval, "sharding", None), getattr(aval, "vma", None), getattr(aval, "memory_space", None))


def leaf_specs(flat: Sequence[Any], traced: Sequence[bool] = ()) -> tuple[list[Any], tuple]:
    """Per leaf: its aval if traced (an array, or marked in ``traced``), else ``Static``. Also a hashable
    key for the cache."""
    specs: list[Any] = []
    key = []
    for i, x in enumerate(flat):
        if is_traced_leaf(x) or (i < len(traced) and traced[i]):
            # (a hijax value under an outer trace, a Box, is no array: closed over, as a Box passed eagerly is, its
            # program is left as it is, by the pipeline; keyed by its type, the cache keeps no tracer)
            high = (aval := jax.typeof(x)).is_high
            specs.append(Static(x) if high else aval)
            key.append(("hijax", aval) if high else aval_key(aval))
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
    name = getattr(fn, "__name__", "function")
    carries: list[bool] = []

    def flat_fn(*dyn: Any) -> list[Any]:
        it = iter(dyn)
        leaves = [next(it) if d else s.value for s, d in zip(specs, dynamic)]
        dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        dyn_args, dyn_kwargs, live = _state.enter(dyn_args, dyn_kwargs)
        it_args = iter(dyn_args)
        args = [statics[i] if i in statics else next(it_args) for i in range(n_args)]
        kwargs = {**dyn_kwargs, **dict(stat_kwargs)}
        # What the function could change in place, to check afterwards that it did not (state.check_unchanged).
        seen_leaves, seen_tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_state._is_node)
        untraced = [(v, f"static argument {i}") for i, v in stat_args] + [
            (v, f"static argument {k!r}") for k, v in stat_kwargs] + [
            (s.value, f"<{type(s.value).__name__} argument>")
            for s, d in zip(specs, dynamic) if not d]
        tracers_before = _state.tracers_in(untraced)
        out = fn(*args, **kwargs)
        _state.check_unchanged(name, (args, kwargs), seen_leaves, seen_tree, untraced, tracers_before, out)
        if live is not None:
            out = (out, _state.leave(live, name))
        carries.append(live is not None)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        out_static = tuple((i, v) for i, v in enumerate(out_leaves) if not _traced_output(v))
        out_tree_box.append((out_tree, out_static))
        return [v for v in out_leaves if _traced_output(v)]

    avals = [s for s, d in zip(specs, dynamic) if d]
    leaf_specs_ = [spec_of(a) for a in avals]
    named = _as_called(fn, flat_fn, leaf_specs_, dynamic, in_tree, statics, stat_kwargs, n_args)
    # (a large model's trace triggers full collections; jvp_rules_unnamed: the same program, traced sooner). In the
    # caller's mesh context, as jax.jit traces: entering the inputs' mesh (_context) made a trace JAX refuses succeed
    # (an einsum's out_sharding= with no mesh set), and a shard_map body that checkify traces met an Auto context.
    with collect_young_only(), jvp_rules_unnamed():
        if named is None:
            closed = jax.make_jaxpr(flat_fn)(*leaf_specs_)
        else:
            closed = jax.make_jaxpr(named[0])(*named[1], **named[2])
    out_tree, out_static = out_tree_box[-1]
    closed, captured = _capture(relinked(closed))  # (a custom_jvp rule's tracers of this trace: see relink.py)
    return Traced(closed, in_tree, out_tree, dynamic, out_static, captured, len(captured), carries[-1])


def _as_called(fn: Callable[..., Any], flat_fn: Callable[..., Any], leaves: Sequence[Any], dynamic: Sequence[bool],
               in_tree: Any, statics: dict, stat_kwargs: tuple, n_args: int) -> Any:
    """``flat_fn`` as ``jax.make_jaxpr`` should trace it so that JAX's errors name what the user wrote.

    A tracing error (``TracerBoolConversionError``, a ``Ref`` returned, ...) names the function traced and the
    argument a value came from. Traced as ``flat_fn(*leaves)``, that is this module's ``flat_fn`` and ``dyn[0]``.
    Traced here, it is ``fn`` and, as ``jax.jit(fn)`` names them, ``params['w']``: ``fn``'s own arguments, each a
    pytree of the leaves' specs with ``None`` where a leaf or argument is static, handed to a function with
    ``fn``'s signature and source that calls ``flat_fn`` on their leaves. ``None`` where that cannot be built (a
    signature unread, a pytree that does not rebuild with specs or flattens them otherwise, or holds an array in its
    metadata: ``metadata.array_metadata``): then ``flat_fn`` is traced as it is, with the same program."""
    try:
        signature = inspect.signature(fn)
        it = iter(leaves)
        dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(
            in_tree, [next(it) if d else None for d in dynamic])
        it_args = iter(dyn_args)
        args = tuple(None if i in statics else next(it_args) for i in range(n_args))
        kwargs = {**dyn_kwargs, **{k: None for k, _ in stat_kwargs}}
        again, tree = jax.tree_util.tree_flatten((args, kwargs))
        if len(again) != len(leaves) or any(a is not b for a, b in zip(again, leaves)) or array_metadata(tree):
            return None
        source = fn
        while isinstance(source, functools.partial):
            source = source.func
    except Exception:  # a user's pytree or signature this cannot read: traced unnamed
        return None

    def called(*args: Any, **kwargs: Any) -> list[Any]:
        return flat_fn(*jax.tree_util.tree_leaves((args, kwargs)))

    called.__signature__ = signature  # type: ignore[attr-defined]
    called.__wrapped__ = source  # type: ignore[attr-defined]  # JAX's source info unwraps to it
    called.__name__ = called.__qualname__ = getattr(fn, "__name__", "function")
    return called, args, kwargs


def _capture(closed: core.ClosedJaxpr) -> tuple[core.ClosedJaxpr, tuple[Any, ...]]:
    """Constants that are tracers of an outer trace become the program's last inputs.

    They are values the function closed over (``lambda x: model(params, x)`` under ``jax.grad`` of
    ``params``, or inside a jitted function): not known now, and not the same on the next call.
    """
    moved = [i for i, c in enumerate(closed.consts) if isinstance(c, core.Tracer)]
    if not moved:
        return closed, ()
    jaxpr, consts = closed.jaxpr, closed.consts
    keep = [i for i in range(len(consts)) if i not in set(moved)]
    debug = jaxpr.debug_info
    if debug is not None and debug.arg_names is not None:
        debug = debug._replace(arg_names=tuple(debug.arg_names) + tuple(f"captured{k}" for k in range(len(moved))))
    new = jaxpr.replace(constvars=[jaxpr.constvars[i] for i in keep],
                        invars=list(jaxpr.invars) + [jaxpr.constvars[i] for i in moved], debug_info=debug)
    return core.ClosedJaxpr(new, [consts[i] for i in keep]), tuple(consts[i] for i in moved)


#: each jaxpr's text (``str``), kept while the jaxpr lives (a jaxpr is not changed once made)
_TEXTS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _text(jaxpr: Any) -> str:
    found = _TEXTS.get(jaxpr)
    if found is None:
        found = _TEXTS[jaxpr] = str(jaxpr)
    return found


def same_program(a: core.ClosedJaxpr, b: core.ClosedJaxpr) -> bool:
    """Are these two traces of a function the same program, constants included (bit for bit)?

    The texts are compared only where the counts of inputs, equations and outputs, which they print, agree, and
    each jaxpr's is printed once (:func:`_text`): a search compares each program it prices with every one it priced
    before (``grad/uses.py``'s ``priced_uses``).
    """
    ja, jb = a.jaxpr, b.jaxpr
    if len(a.consts) != len(b.consts):
        return False
    if ja is not jb and (len(ja.invars) != len(jb.invars) or len(ja.eqns) != len(jb.eqns)
                         or len(ja.outvars) != len(jb.outvars) or _text(ja) != _text(jb)):
        return False
    for x, y in zip(a.consts, b.consts):
        if x is y:
            continue
        if isinstance(x, core.Tracer) or isinstance(y, core.Tracer):
            return False
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True


def program_key(closed: core.ClosedJaxpr) -> tuple | None:
    """A hashable key two traces share exactly where :func:`same_program` calls them the same program (their texts,
    and their constants bit for bit), for a store of what is made from a program; ``None`` where a constant is a
    tracer (no other program is the same).

    >>> import jax, jax.numpy as jnp
    >>> one, again, other = (jax.make_jaxpr(lambda x: jnp.sin(x) * k)(jnp.ones(3)) for k in (2.0, 2.0, 3.0))
    >>> program_key(one) == program_key(again), program_key(one) == program_key(other)
    (True, False)
    """
    consts = []
    for x in closed.consts:
        if isinstance(x, core.Tracer):
            return None
        x = np.asarray(x)
        consts.append((x.dtype, x.shape, x.tobytes()))
    return _text(closed.jaxpr), tuple(consts)


#: the memory space of an array in device memory, JAX's default (``ShapedArray.memory_space``)
_DEVICE_MEMORY = getattr(core.ShapedArray((), np.float32), "memory_space", None)


def spec_of(aval: Any) -> Any:
    """A ``ShapeDtypeStruct`` that traces exactly like ``aval``: weak type, and inside a
    ``shard_map`` body its manual mesh and varying axes too."""
    if isinstance(aval, AbstractRef) or not hasattr(aval, "shape"):  # a mutable array (jax.new_ref), a token
        return aval
    if getattr(aval, "memory_space", None) not in (None, _DEVICE_MEMORY):  # (host memory: no spec names it)
        return aval
    kwargs: dict[str, Any] = {"weak_type": bool(getattr(aval, "weak_type", False))}
    mesh = _mesh_of(aval)
    if mesh is not None:
        kwargs["sharding"] = aval.sharding
        kwargs["manual_axis_type"] = getattr(aval, "manual_axis_type", None)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, **kwargs)


def no_cotangents(out_avals: Sequence[Any]) -> list[Any]:
    """A pullback's cotangents where none flows: ``float0`` zeros (a token's is a token, as JAX's pullbacks
    take it)."""
    return [np.zeros(a.shape, jax.dtypes.float0) if hasattr(a, "shape") else jax.lax.create_token()
            for a in out_avals]


def explicitly_sharded(aval: Any) -> bool:
    """Is ``aval`` typed on a mesh with an explicit axis (its sharding is part of its type)?"""
    mesh = _mesh_of(aval)
    return mesh is not None and any(t == AxisType.Explicit for t in mesh.axis_types)


def _mesh_of(aval: Any) -> Any:
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return mesh if mesh is not None and getattr(mesh, "axis_names", ()) else None


@contextlib.contextmanager
def _context(avals: Sequence[Any]):
    """Enter the mesh context these avals were made in, if they carry a mesh, to trace a rule's side over them.
    (Not the user's function: :func:`trace` traces it in the caller's context, as ``jax.jit`` does.)

    With explicit sharding, every value's type names the mesh, and values made
    inside the trace (a broadcast literal, say) take the context's mesh; inside
    a ``shard_map`` body JAX also tracks which manual axes each value varies
    over and inserts ``pvary``. Tracing without the right context gives values
    of another type than the program's.
    """

    mesh = next((m for m in map(_mesh_of, avals) if m is not None), None)
    if mesh is None or (all(t == AxisType.Auto for t in mesh.axis_types) and jax.sharding.get_abstract_mesh().empty):
        # (a rule's side over values of a mesh of Auto axes alone is traced as the program was: outside it where no
        # mesh is set, and in it inside an explicit one, whose Auto regions made them: auto_axes, out_sharding=)
        yield
        return
    manual = tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual)
    with contextlib.ExitStack() as stack:
        stack.enter_context(use_abstract_mesh(mesh))
        if manual:
            varying = any(getattr(getattr(a, "manual_axis_type", None), "varying", None) for a in avals)
            stack.enter_context(core.extend_axis_env_nd([(n, mesh.shape[n]) for n in manual]))
            stack.enter_context(check_vma(bool(varying)))
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
            in_avals = [core.ShapedArray(a.shape, a.dtype, weak_type=bool(getattr(a, "weak_type", False)))
                        for a in avals]
            # The debug info made by hand: api_util.debug_info reads the function's signature (inspect), a
            # quarter of a small trace's cost; argument names only label error messages.
            debug = core.DebugInfo("rewrite.trace_at", fun_sourceinfo(fn), None, core.initial_result_paths)
        except Exception:  # not a function these internals take: make_jaxpr's way (fn is not called twice)
            pass
        else:
            flat = lu.wrap_init(lambda *xs: jax.tree_util.tree_leaves(fn(*xs)), debug_info=debug)
            jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(flat, in_avals)
            return core.ClosedJaxpr(jaxpr, consts)
    with _context(avals):
        return jax.make_jaxpr(fn)(*[spec_of(a) for a in avals])


_UNNAMED_LOCK = threading.Lock()
_unnamed_depth = 0
_named_debug_info: Any = None  # JAX's own, put back when the last window closes


def _unnamed_jvp_debug_info(traced_for: str, fun: Any, args: Any, kwargs: Any, *rest: Any, **named: Any) -> Any:
    """``ad.debug_info`` as JAX's fallback linearization reads it: its function and source, without argument names."""
    found = getattr(fun, "__fun_debug_info__", None)
    if traced_for != "linearize_prim_jvp" or rest or named or found is not None:
        return _named_debug_info(traced_for, fun, args, kwargs, *rest, **named)
    return core.DebugInfo(traced_for, fun_sourceinfo(fun), None, core.initial_result_paths)


@contextlib.contextmanager
def jvp_rules_unnamed():
    """JAX traces here without naming the arguments of each primitive's JVP rule it linearizes through.

    ``jax.vjp`` linearizes a primitive that has no linearization rule of its own through its JVP rule
    (``ad.fallback_linearize_rule``), and first makes that rule's debug info: the rule's signature
    (``inspect.signature``) and a name for every leaf of its primals and params (``keystr``). JAX drops
    those names at once (``linearize_from_jvp`` makes the rule's jaxpr ``with_unknown_names``, evaluates it
    and discards it), so the program traced is the same, equation for equation, source locations and name
    stacks included; the names were 16% of a joint program's trace (three of ``flax_long_context_step``'s
    first call: 0.188 -> 0.158 s CPU). Inside this window ``ad.debug_info`` gives that rule its function and
    source without the names; every other call goes to JAX's. Windows nest and may overlap across threads
    (a lock and a count): JAX's own is put back when the last one closes.
    """
    global _unnamed_depth, _named_debug_info
    if not hasattr(ad, "debug_info"):  # a JAX whose linearization reads no debug_info here: nothing to leave out
        yield
        return
    with _UNNAMED_LOCK:
        if _unnamed_depth == 0:
            _named_debug_info = ad.debug_info
            ad.debug_info = _unnamed_jvp_debug_info
        _unnamed_depth += 1
    try:
        yield
    finally:
        with _UNNAMED_LOCK:
            _unnamed_depth -= 1
            if _unnamed_depth == 0:
                ad.debug_info = _named_debug_info


_FROZEN_AT_IMPORT = gc.get_freeze_count()
#: How many windows of :func:`collect_young_only` this process has open. One opened inside another (a pipeline
#: inside a whole-step search, the cache's stages) finds the objects frozen already and asks nothing of the
#: collector: ``gc.get_freeze_count`` walks the frozen list, 24 ms a call with a process's 600k objects frozen.
_open_windows = 0

#: The collector's thresholds inside a window: a young collection every 200,000 net allocations instead of 700, and
#: no full one (its third threshold is never reached there). What a rewrite makes is nearly all alive until it
#: ends (e-graph snapshots, programs, choices) and freed by its reference counts then, so each young collection in
#: a window walks objects that are not garbage; at 200,000 none of the ecosystem programs' first calls collects
#: inside its window (the most alive at once: 153,000 objects, flax_seq2seq_grad), and a larger rewrite still
#: collects its cycles every 200,000 objects (some tens of MB). Measured on flax_long_context_step's first call:
#: 26 young collections, 0.036 s, at 10,000; at 200,000 only the one after the window, 0.016 s, which the window's
#: end now spares too (what it keeps goes to the oldest generation: :func:`collect_young_only`).
RARE_THRESHOLDS = (200_000, 50, 1_000)


@contextlib.contextmanager
def collect_young_only():
    """While the rewrite runs, the garbage collector leaves alone the objects that existed before it.

    A rewrite allocates many small objects, which triggers Python's full
    collections, and each of those walks every object in the process (JAX's
    and the user's included): on a 1,500-equation training step that was
    0.1-0.25 s of a 1.5 s rewrite. ``gc.freeze`` moves what exists now out
    of the collector's sight and ``gc.unfreeze`` puts it back afterwards, so
    nothing is leaked and later collections see everything again. A process
    that froze objects itself, or turned the collector off, is left as it is.
    (CPython 3.12 starts with some hundreds of objects frozen already: what
    was frozen when this module was imported is not the process's doing.)
    A first call runs under one window from its cache key to its store
    (``Rewritten._rewrite``, decorated): a full collection that fell in the
    disk cache's store cost diffrax_neural_ode 0.41 of 0.45 s. A derivative's
    build opens another; a pipeline or a trace opens its own where nothing
    encloses it (``explain``, the proofs).

    Inside a window the collector runs young collections rarely and no full
    one (``RARE_THRESHOLDS``; the thresholds are put back after, and a process
    that set higher ones keeps them). At CPython's thresholds a full
    collection fell every few hundred thousand allocations, walking what the
    rewrite made, most of it alive until the rewrite ends (e-graph snapshots,
    programs, choices): ``flax_long_context_step``'s first call made 7 full,
    94 middle and 1,023 young collections, 0.38 s of a loaded machine's time;
    at thresholds of 10,000, 50 and 1,000 none, 3 and 61, 0.11 s
    (``flax_seq2seq_grad``'s gradient alone in a process: 13 full, then
    none). The rewrite's own recursive closures are cleared when they return
    (``del``), so what it drops is freed by its reference counts, not left as
    cycles for a collection to find; at the thresholds now no ecosystem
    program's first call collects inside its window, and what a window keeps
    leaves it in the oldest generation (``gc.freeze`` then ``gc.unfreeze``),
    not walked by a young collection once more: long context's first call
    runs no collection (0.045 s at 10,000). The resident memory those runs
    peaked at did not rise (0.75-0.82 GB either way).
    """
    global _open_windows
    if _open_windows or gc.get_freeze_count() > _FROZEN_AT_IMPORT or not gc.isenabled():
        yield
        return
    # Garbage made since the last collection (an earlier rewrite's e-graph, say) is collected now: frozen,
    # it would wait for the next full collection, holding its e-graph's memory, which the collector
    # does not count. The young generations are small, so this is cheap.
    gc.collect(1)
    gc.freeze()
    _open_windows += 1
    thresholds = gc.get_threshold()
    if thresholds[0]:
        gc.set_threshold(*(max(a, b) for a, b in zip(thresholds, RARE_THRESHOLDS)))
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        _open_windows -= 1
        # What the rewrite made and keeps (its program, the caches it filled) goes to the oldest generation with
        # what was frozen: a young collection would walk it all once more (flax_long_context_step: 86,000
        # objects, 0.016 s), only to promote it. What it dropped was freed by its reference counts (no cycle of
        # its own is left: tests/test_held_memory.py); a cycle some library made waits for a full collection.
        gc.freeze()
        gc.unfreeze()


def trace_call(fn: Any, args: tuple, kwargs: dict, static_argnums: Sequence[int], static_argnames: Sequence[str]
               ) -> tuple[Traced, float]:
    """``fn`` traced at a call's arguments, and the seconds it took. Python float arguments are traced as
    ``jax.jit`` traces them, unless one steers control flow: then they are static, as ``rewrite`` keeps them."""
    static_argnums, static_argnames = resolve_static(fn, static_argnums, static_argnames)
    t = time.perf_counter()
    try:
        _, in_tree, specs, _, stat_args, stat_kwargs, _ = flatten_args(args, kwargs, static_argnums, static_argnames)
        traced = trace(fn, specs, in_tree, stat_args, stat_kwargs, len(args))
    except CONCRETIZATION_ERRORS:  # a float argument steers control flow: static, as ``rewrite`` keeps it then
        _, in_tree, specs, _, stat_args, stat_kwargs, _ = flatten_args(args, kwargs, static_argnums, static_argnames,
                                                                    trace_floats=False)
        t = time.perf_counter()
        traced = trace(fn, specs, in_tree, stat_args, stat_kwargs, len(args))
    return traced, time.perf_counter() - t
