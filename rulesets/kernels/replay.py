"""A kernel's forward or backward traced once per input types and replayed: :func:`replayed`.

JAX calls a ``custom_vjp``'s Python backward afresh at every ``jax.vjp`` of a program that holds the call: the
rewrite traces the joint program of a forward several times (each joint it prices and emits), and each time the
blocked attention's backward traced its loops again (``lax.scan`` retracing their bodies: 13% of
flax_long_context_step's joint traces). :func:`replayed` traces the function once per pytree structure and input
types (the whole aval: shape, dtype, weak type, and what a ``shard_map`` body's aval carries), under the settings a
trace reads (``rewrite.rules.builder``'s, as a rule's traces are keyed), and replays the jaxpr
(``jax.extend.core.jaxpr_as_fun``) into the caller's trace: the same primitives bound with
the same params, a loop's body bound as it was traced, so the caller's program is the same.

The traces are kept with the function (a few per kernel: one per type of cotangent it is called with), and hold the
jaxprs only: a jaxpr's constants are what the function's trace closed over (scalars here). A function replayed with a
``key`` (all its trace reads of what it closed over) shares its traces with every other of that key, process-wide
(:data:`SHARED` at most): the LM head's forward is the same program for each token block where it computes its rows
by vocabulary tiles (``rulesets.nn_lm_head_kernels.blocked_loss``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

import jax
import jax.extend.core

from rewrite.cache.fingerprint import Memo
from rewrite.jaxpr.trace import trace_at
from rewrite.rules.builder import _config, standard_numpy

#: Traces kept per function; past it the oldest goes.
SIZE = 8
#: Traces kept for the functions replayed with a key, all together; past it the oldest goes.
SHARED = 64
#: Those traces: a memo, which the disk cache's key of a rule that reaches :func:`replayed` names and never walks
#: (what it holds depends on what the process traced before)
_shared = Memo("rulesets.kernels.replay._shared", most=SHARED)
_lock = threading.Lock()


def replayed(fn: Callable[..., Any], key: Hashable = None) -> Callable[..., Any]:
    """``fn`` (a function of arrays, in and out as pytrees, that reads nothing but its arguments and what it closed
    over), traced once per argument structure and types and replayed; its results as ``fn``'s. With a ``key`` (not
    ``None``) that says all that ``fn``'s trace reads of what it closed over, the traces are shared with every
    function replayed with an equal key."""
    traces: dict[Any, tuple[Any, Any]] = {} if key is None else _shared

    def call(*args: Any) -> Any:
        flat, tree = jax.tree_util.tree_flatten(args)
        avals = tuple(jax.typeof(x) for x in flat)
        at = (tree, avals, _config()) if key is None else (key, tree, avals, _config())
        found = traces.get(at)
        if found is None:
            found = _traced(fn, tree, avals)
            with _lock:
                traces[at] = found
                while len(traces) > (SIZE if key is None else SHARED):
                    del traces[next(iter(traces))]
        closed, out_tree = found
        return jax.tree_util.tree_unflatten(out_tree, jax.extend.core.jaxpr_as_fun(closed)(*flat))

    # named as ``fn``: a custom_vjp_call's printed params name its bwd (the golden programs' text)
    call.__name__, call.__qualname__ = fn.__name__, fn.__qualname__
    return call


def traced_once(fn: Callable[..., Any], *args: Any) -> tuple[Any, Callable[..., Any]]:
    """``(types, again)``: ``fn(*args)``'s result types (``fn``'s pytree of results, their avals at the leaves) and
    ``again``, which binds into the caller's trace what tracing ``fn`` there binds, at arguments of ``args``' types;
    ``fn`` traced once, at ``args``, and replayed as :func:`replayed` replays it. A loop's body that needs its
    results' types for the carry first, without a second trace (``jax.eval_shape`` then the loop's own:
    ``rulesets.nn_lm_head_kernels._block_loop``)."""
    flat, tree = jax.tree_util.tree_flatten(args)
    closed, out_tree = _traced(fn, tree, tuple(jax.typeof(x) for x in flat))
    run = jax.extend.core.jaxpr_as_fun(closed)
    return (jax.tree_util.tree_unflatten(out_tree, closed.out_avals),
            lambda *xs: jax.tree_util.tree_unflatten(out_tree, run(*jax.tree_util.tree_leaves(xs))))


def _traced(fn: Callable[..., Any], tree: Any, avals: tuple) -> tuple[Any, Any]:
    """``(closed, out_tree)``: ``fn`` traced at arguments of pytree ``tree`` with leaves of ``avals``, flat, under
    the settings the kernels are written for, whatever the caller's (JAX runs a ``custom_vjp``'s rules under those
    of the user's trace: :func:`rewrite.rules.builder.standard_numpy`)."""
    shape: list = []

    @standard_numpy()
    def flat_fn(*xs: Any) -> list:
        leaves, out_tree = jax.tree_util.tree_flatten(fn(*jax.tree_util.tree_unflatten(tree, xs)))
        shape.append(out_tree)
        return leaves

    return trace_at(flat_fn, avals), shape[0]
