"""Arguments that hold mutable state, and a function's side effects on its arguments.

A rewritten function runs a program that takes arrays and returns arrays, so
a change the function makes to an argument object in place would be made to
a copy rebuilt inside the trace, and lost. Two kinds of argument are handled:

- flax nnx graph nodes (modules, optimizers, ``nnx.Rngs``, Variables), whose
  Variables a training step updates in place. They are carried as
  ``nnx.jit`` carries them: all of a call's nodes are split together into a
  graph definition and a state (:func:`lift`; shared Variables stay shared),
  merged back into live objects inside the trace (:func:`enter`), and the
  Variables whose values the function replaced become extra outputs of the
  program (:func:`leave`), written back into the caller's objects after the
  call (:func:`apply`). A change of a module's structure (an attribute
  added, a Variable removed) is refused: ``nnx.jit`` is the tool for that.
- everything else: an in-place change the trace can see, which the program
  cannot carry out, is refused with an error at the first call
  (:func:`check_unchanged`): a traced leaf of an argument replaced (a dict or
  list argument updated, a mutable pytree's field set), or a traced value
  stored into an object that reached the function unflattened (a static
  argument, an object that is not a pytree). Under ``jax.jit`` such a change
  would vanish silently; eagerly it would leak a tracer. A leaf replaced in a
  container the function returns is not lost: the result holds it, and the
  caller's object is left as ``jax.jit`` leaves it.

Functional state needs nothing: equinox's ``eqx.nn.State`` and flax linen's
``apply(..., mutable=[...])`` return the new state, which is an output.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from ..ir.jaxapi import core

#: how the errors say a function should be written instead
_HOW = "return the new value from the function instead (in a new object, not the one it was passed)"
_HOW_NNX = ("write the step in the split/merge form (`nnx.split(model)` outside, `nnx.merge` inside, return "
            "`nnx.state(model)`), or put `nnx.jit` outside and rewrite the functional step inside it")


class StateError(ValueError):
    """A rewritten function changed one of its arguments in place in a way the program cannot carry out.

    The change would be lost (the rewritten program returns only the
    function's results and the state of its nnx arguments), so the call
    raises instead, at the first call, whatever ``strict`` says.

    >>> import jax.numpy as jnp
    >>> from rewrite import rewrite
    >>> from rewrite import StateError
    >>> def count(stats, x):
    ...     stats["seen"] = stats["seen"] + x.shape[0]   # in place: lost under a trace
    ...     return x * 2
    >>> try:
    ...     rewrite(count)({"seen": jnp.zeros(())}, jnp.ones(3))
    ... except StateError as e:
    ...     print(str(e).split(";")[0])
    'count' replaced the traced value at args[0]['seen'] in place
    """


def _nnx() -> Any:
    # nnx objects exist only once flax.nnx is imported: an argument is never looked at otherwise
    return sys.modules.get("flax.nnx")


#: per type, whether its objects are nnx graph nodes (a registered graph type, a Variable, an array
#: reference): asked of every node and leaf of every call's arguments, so asked of nnx once per type
_NODE_TYPES: dict[type, bool] = {}


def _is_node(x: Any) -> bool:
    t = type(x)
    known = _NODE_TYPES.get(t)
    if known is None:
        nnx = _nnx()
        if nnx is None:
            return False
        known = _NODE_TYPES[t] = bool(nnx.graph.is_graph_node(x))
    return known


@jax.tree_util.register_pytree_node_class
class Slot:
    """Stands in an argument tree for the ``index``-th nnx graph node of the call. The first slot holds
    the state of all of them, split together; its graph definition is part of the signature."""

    def __init__(self, index: int, graphdef: Any = None, state: Any = None) -> None:
        self.index, self.graphdef, self.state = index, graphdef, state

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return ((self.state,) if self.index == 0 else ()), (self.index, self.graphdef)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> "Slot":
        return cls(aux[0], aux[1], children[0] if children else None)


def lift(args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
    """The arguments with each nnx graph node replaced by a :class:`Slot`, and the nodes (``()`` if none)."""
    if _nnx() is None:
        return args, kwargs, ()
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_node)
    nodes = tuple(x for x in leaves if _is_node(x))
    if not nodes:
        return args, kwargs, ()
    graphdef, state = _nnx().split(nodes)
    k = iter([Slot(0, graphdef, state)] + [Slot(i, graphdef) for i in range(1, len(nodes))])
    args, kwargs = jax.tree_util.tree_unflatten(tree, [next(k) if _is_node(x) else x for x in leaves])
    return args, kwargs, nodes


@dataclasses.dataclass
class Live:
    """The nnx nodes merged inside a trace, with what they held when the function was called."""

    nodes: tuple
    graphdef: Any
    before: dict  # path -> the value (a tracer) each Variable held


def enter(args: Any, kwargs: Any) -> tuple[Any, Any, Live | None]:
    """Inside the trace: the slots of :func:`lift` merged back into live nnx objects."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, Slot))
    slots = [x for x in leaves if isinstance(x, Slot)]
    if not slots:
        return args, kwargs, None
    first = next(s for s in slots if s.index == 0)
    nnx = _nnx()
    nodes = nnx.merge(first.graphdef, first.state)
    before = {path: _raw(v) for path, v in nnx.to_flat_state(nnx.state(nodes))}
    args, kwargs = jax.tree_util.tree_unflatten(
        tree, [nodes[x.index] if isinstance(x, Slot) else x for x in leaves])
    return args, kwargs, Live(nodes, first.graphdef, before)


@jax.tree_util.register_pytree_node_class
class Updates:
    """The new values of the nnx Variables a call replaced, by path (the paths are static)."""

    def __init__(self, paths: tuple, values: Sequence[Any]) -> None:
        self.paths, self.values = paths, list(values)

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return tuple(self.values), self.paths

    @classmethod
    def tree_unflatten(cls, paths: tuple, values: tuple) -> "Updates":
        return cls(paths, values)


def leave(live: Live, name: str) -> Updates:
    """Inside the trace, after the function: the Variables whose values it replaced."""
    nnx = _nnx()
    if nnx.graphdef(live.nodes) != live.graphdef:
        raise StateError(f"{name!r} changed the structure of an nnx module it was passed (an attribute or "
                         f"Variable added, removed or replaced); a rewritten function carries out only new "
                         f"values of existing Variables: {_HOW_NNX}")
    changed = [(path, _raw(v)) for path, v in nnx.to_flat_state(nnx.state(live.nodes))
               if _raw(v) is not live.before.get(path)]
    return Updates(tuple(p for p, _ in changed), [v for _, v in changed])


def apply(nodes: tuple, updates: Updates) -> None:
    """After the call: the new values written into the caller's nnx objects."""
    if updates.paths:
        nnx = _nnx()
        nnx.update(nodes, nnx.from_flat_state(list(zip(updates.paths, updates.values))))


def _raw(v: Any) -> Any:
    get = getattr(v, "get_raw_value", None)
    return get() if get is not None else getattr(v, "value", v)


# --- side effects on other arguments ---------------------------------------------------------------

_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           jax.Array, np.ndarray, np.generic, str, bytes, int, float, complex, bool, type(None))


#: the most objects a walk of what a function could reach visits (:func:`_reachable`)
_VISITS = 20_000


def tracers_in(roots: Sequence[Any], limit: int = _VISITS) -> dict[int, str]:
    """The tracers reachable from ``roots`` through containers and object attributes, by id, with a
    path to each; at most ``limit`` objects are visited (a bound on the cost, not a guarantee)."""
    return {id(x): path for x, path in _reachable(roots, limit) if isinstance(x, core.Tracer)}


def _reachable(roots: Sequence[tuple[Any, str]], limit: int) -> Iterator[tuple[Any, str]]:
    """Each object reachable from ``roots`` (``(object, path)`` pairs) through lists, tuples, dicts, sets and
    object attributes, once, with a path to it; a tracer or an :data:`_OPAQUE` object is not walked into. At most
    ``limit`` objects are visited."""
    seen: set[int] = set()
    stack = list(roots)
    while stack and len(seen) < limit:
        x, path = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        yield x, path
        if isinstance(x, (core.Tracer, _OPAQUE)):
            continue
        if isinstance(x, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(x))
        elif isinstance(x, dict):
            stack.extend((v, f"{path}[{k!r}]") for k, v in x.items())
        elif isinstance(x, (set, frozenset)):
            stack.extend((v, f"{path}{{}}") for v in x)
        else:
            fields = getattr(x, "__dict__", None)
            if isinstance(fields, dict):
                stack.extend((v, f"{path}.{k}") for k, v in fields.items())
            for slot in getattr(type(x), "__slots__", ()):
                if isinstance(slot, str) and hasattr(x, slot):
                    stack.append((getattr(x, slot), f"{path}.{slot}"))


def check_unchanged(name: str, seen: tuple, before: list, tree: Any, statics: Sequence[tuple[Any, str]],
                    tracers_before: dict[int, str], out: Any = None) -> None:
    """Inside the trace, after the function: raise :class:`StateError` if it replaced a traced leaf of the
    argument tree it was given (``seen``, flattened before the call into ``before`` with ``tree``), or
    stored a traced value into an object reachable from its static arguments (``statics``). A leaf replaced in a
    dict, list or object that the function returns (``out`` reaches it: blackjax's SVGD step sets its kernel's
    ``length_scale`` in the state's dict and returns the state) is not lost: the result holds it, as under
    ``jax.jit``, which leaves the caller's own object as it was, as the rewritten program does."""
    paths_leaves, after_tree = jax.tree_util.tree_flatten_with_path(seen, is_leaf=_is_node)
    if after_tree != tree:
        where, static = _first_change(tree, after_tree, ())
        if static:
            raise StateError(f"{name!r} changed a field of {where} that is not an array (a name, a flag, a size: "
                             f"data the trace does not carry) in place; the change would be lost: {_HOW}")
        raise StateError(f"{name!r} changed the structure of {where} in place (an entry added to or removed from a "
                         f"dict or list it was passed); the change would be lost: {_HOW}")
    returned: set[int] | None = None
    for (path, new), old in zip(paths_leaves, before):
        if new is not old and (isinstance(new, core.Tracer) or isinstance(old, core.Tracer)):
            returned = {id(x) for x, _ in _reachable([(out, "")], _VISITS)} if returned is None else returned
            holder = _holder(seen, path)
            if holder is not None and id(holder) in returned:
                continue
            where = _argpath(path)
            raise StateError(f"{name!r} replaced the traced value at {where} in place; the rewritten program "
                             f"returns only the function's results, so the change would be lost: {_HOW}")
    for i, path in tracers_in(statics).items():
        if i not in tracers_before:
            raise StateError(f"{name!r} stored a traced value into {path}, an object it was passed that is not "
                             f"traced (not a pytree of arrays); the value would leak out of the rewritten "
                             f"program and the change would be lost: {_HOW}")


def _holder(root: Any, path: tuple) -> Any:
    """The container ``path`` (a key path of :func:`jax.tree_util.tree_flatten_with_path`) ends in: the dict,
    list or object whose entry is the leaf; ``None`` where a key cannot be followed (a custom pytree's flat index)."""
    x = root
    for key in path[:-1]:
        try:
            if isinstance(key, jax.tree_util.SequenceKey):
                x = x[key.idx]
            elif isinstance(key, jax.tree_util.DictKey):
                x = x[key.key]
            elif isinstance(key, jax.tree_util.GetAttrKey):
                x = getattr(x, key.name)
            else:
                return None
        except Exception:  # noqa: BLE001 - a container that does not read back as it flattened
            return None
    return x


def _argpath(path: tuple) -> str:
    """``((args, kwargs), ...)`` key paths as the user wrote the call: ``args[0]['count']``."""
    if not path:
        return "an argument"
    head, rest = path[0], path[1:]
    first = "args" if getattr(head, "idx", None) == 0 else "kwargs"
    return first + jax.tree_util.keystr(rest)


def _first_change(before: Any, after: Any, path: tuple) -> tuple[str, bool]:
    """Where the argument treedef ``after`` first differs from ``before`` (``((args, kwargs))``), as the user wrote
    the call, and whether only a node's static data differs there (not its kind or its entries)."""
    nb, na = before.node_data(), after.node_data()
    if nb is None or na is None or nb[0] is not na[0]:
        return _where(path), False
    cb, ca = before.children(), after.children()
    if len(cb) != len(ca) or (nb[0] is dict and list(nb[1]) != list(na[1])):
        return _where(path), False
    try:
        same = bool(nb[1] == na[1])
    except Exception:  # noqa: BLE001 - static data that does not compare (an array): taken as changed
        same = False
    if not same and nb[0] not in (tuple, list, dict):
        return _where(path), True
    for i, (b, a) in enumerate(zip(cb, ca)):
        if b != a:
            key = nb[1][i] if nb[0] is dict else i
            return _first_change(b, a, (*path, (nb[0], key)))
    return _where(path), not same


def _where(path: tuple) -> str:
    """A path of :func:`_first_change` as the user wrote the call: ``args[0]['stats']``, ``an argument``."""
    if not path:
        return "an argument"
    out = "args" if path[0][1] == 0 else "kwargs"
    for kind, key in path[1:]:
        out += f"[{key!r}]" if kind in (dict, list, tuple) else f"[<flat index {key}>]"
    return out
