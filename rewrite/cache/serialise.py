"""A chosen program written down and read back, for the disk cache.

Equations by primitive name, avals and params; an object the program holds
that is not plain data (a ``custom_jvp``'s rule, a mesh) is written as its
place among the original program's objects and taken from the fresh trace
on load. A ``custom_vjp`` that a rule built (attention's recomputing
backward, the LM head's) is in no original program: its forward and backward
are written as the jaxprs they trace to, with the pytree structures of its
outputs and residuals, and rebuilt on load as a rule that evaluates them; a
load checks them (``check_jaxpr``) and their types against the call they
belong to. One that is a ``jax.custom_vjp`` defined at a module's top level
(seed 000's kernel) is written by its module and name, and on load called
again, from a module already imported, at the call's types: it is kept only
where that trace is the written call (``rules.named_vjp_params``). What is
left must be plain data of a known kind (numbers, strings, tuples, dtypes,
arrays, jaxprs, and enums, named tuples and dataclasses of jax, numpy or
ml_dtypes), written by a schema: an entry names no function to call but such
a ``custom_vjp``, and the container that holds it is read by an unpickler
that refuses every global. A param of any other kind means no entry.
:data:`FORMAT` is this serialisation's version, part of every entry's
header and key.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import io
import pickle
import sys
from typing import Any

import jax
import numpy as np
from jax.extend import source_info_util

from jax.extend import linear_util as lu

from ..ir.jaxapi import (UNSPECIFIED, SaveOnlyTheseNames, UnspecifiedValue, ad, call_custom_vjp_bwd, constant_array,
                         core, empty_concrete_mesh, literals, neutral_params, params_for_jax, prng_impl_of,
                         save_only_these_names)
from ..jaxpr.trace import trace_at
from .fingerprint import CALLBACKS, by_identity
from .rules import (Forward, Unserialisable, dce_chain, dce_jvp, jvp_rule_fun, named_custom_vjp, named_vjp_params,
                    residual_avals, vjp_rule_params)


FORMAT = 6  # 2: the modules moved into subpackages; 3: params by schema, nothing pickled with globals;
#            4: a rule's custom_vjp written as its forward and backward jaxprs; 5: a custom_jvp's rule as its jaxpr;
#            6: a rule's custom_vjp defined at a module's top level written by its name


#: A ``custom_vjp_call``'s params that hold its rule as Python functions.
_VJP_RULE = ("fwd_jaxpr_thunk", "bwd", "out_trees")
#: The param name under which a rule written as jaxprs stands for those (no primitive has a param so named).
_VJP_WRITTEN = "<custom_vjp rule>"
#: The same for a ``custom_jvp_call``'s rule (its ``jvp_jaxpr_fun``), written as the jaxpr of its JVP.
_JVP_WRITTEN = "<custom_jvp rule>"


class ForeignCallback(Unserialisable):
    """The program calls back into a function that its traced original does not hold: a hit could not take it
    from the fresh trace, so no entry is written (with a warning: ``DiskCache.store``)."""


def _original_objects(closed: core.ClosedJaxpr) -> list[Any]:
    """Every object a program's equations hold, in a fixed order; a stored program refers to these by place."""
    out: list[Any] = []
    seen: set[int] = set()

    def add(x: Any) -> None:
        if isinstance(x, (bool, int, float, str, type(None))) and type(x) in (bool, int, float, str, type(None)):
            return
        if id(x) in seen:
            return
        seen.add(id(x))
        out.append(x)
        if type(x) in (tuple, list):
            for v in x:
                add(v)
        elif type(x) is dict:
            for k in sorted(x, key=repr):
                add(x[k])
        elif isinstance(x, core.ClosedJaxpr):
            for c in x.consts:
                add(c)
            jaxpr(x.jaxpr)
        elif isinstance(x, core.Jaxpr):
            jaxpr(x)

    def extended_dtypes(vs: Any) -> None:
        # an extended dtype (a PRNG key's) holds its implementation's functions, and a sharding its mesh's
        # devices: found by place, not written
        for v in vs:
            aval = getattr(v, "aval", None)
            dtype = getattr(aval, "dtype", None)
            if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
                add(dtype)
                if prng_impl_of(dtype) is not None:  # (a random_wrap[impl=...] the rewrite may emit reads it)
                    add(prng_impl_of(dtype))
            sharding = getattr(aval, "sharding", None)
            if sharding is not None and getattr(getattr(sharding, "mesh", None), "axis_names", ()):
                add(sharding)
                add(sharding.mesh)

    def jaxpr(j: core.Jaxpr) -> None:
        add(j.debug_info)
        extended_dtypes(j.constvars)
        extended_dtypes(j.invars)
        for e in j.eqns:
            extended_dtypes(e.invars)  # literals' types too
            extended_dtypes(e.outvars)
            add(e.primitive)
            add(e.ctx)
            add(e.source_info)
            for k in sorted(e.params):
                add(e.params[k])
            for eff in sorted(e.effects, key=str):
                add(eff)
            for v in e.invars:
                if isinstance(v, core.Literal):
                    add(v.val)

    try:
        add(closed)
        return out
    finally:
        del add, extended_dtypes, jaxpr  # recursive closures are reference cycles: they would hold the program


@functools.lru_cache(maxsize=1)
def _primitives_by_name() -> dict[str, Any]:
    found: dict[str, Any] = {}
    dup: set[str] = set()
    for name, m in list(sys.modules.items()):
        if not name.startswith(("jax", "rewrite")) or m is None:
            continue
        for v in list(vars(m).values()):
            if isinstance(v, core.Primitive):
                if v.name in found and found[v.name] is not v:
                    dup.add(v.name)
                found.setdefault(v.name, v)
    return {k: v for k, v in found.items() if k not in dup}


#: how many modules were loaded when :func:`_primitives_by_name` last scanned them
_SCANNED = [-1]


def _primitive(name: str) -> Any:
    found = _primitives_by_name().get(name)
    if found is None and len(sys.modules) != _SCANNED[0]:
        # A module imported since the last scan may define it; only then is every module scanned again. A
        # library's own primitive (equinox defines some) is never found by name, and scanning for each of its
        # equations was most of storing a diffrax program.
        _primitives_by_name.cache_clear()
        _SCANNED[0] = len(sys.modules)
        found = _primitives_by_name().get(name)
    return found


class _Writer:
    def __init__(self, original: core.ClosedJaxpr) -> None:
        objects = _original_objects(original)
        self.objects = {id(x): i for i, x in enumerate(objects)}
        # The params table interns params by equality, so a program may hold an equal object from another
        # trace (a custom_jvp's rule traced twice): equal objects of the same type stand for each other.
        self.equal: dict[Any, int] = {}
        for i, x in enumerate(objects):
            try:
                self.equal.setdefault((type(x), x), i)
            except TypeError:
                pass
        self.keep = original  # the ids above stay valid while it lives
        self.writing: dict[tuple, int] = {}  # custom_jvp rules being written, to their number (see jvp_rule)
        self.writing_vjp: set[int] = set()  # the backward functions of the custom_vjp rules being written (vjp_rule)
        self.rules = 0
        #: each aval written once: id -> (the aval, kept alive; what it is written as). A program's variables
        #: share few aval objects (flax_seq2seq_loss's 665 written, 56 apart), and writing one reads its dtype's
        #: name, compares its sharding, manual axes and memory space with a default's
        self.avals: dict[int, tuple[Any, Any]] = {}
        #: each dtype's name once: id -> (the dtype, kept alive; its name). numpy's ``str`` of a dtype is Python
        #: code, met once per dtype param and constant; and of a constant's, whether the name finds it again
        self.dtypes: dict[int, tuple[Any, str]] = {}
        self.by_name: dict[int, tuple[Any, bool]] = {}

    def dtype_name(self, dtype: Any) -> str:
        return by_identity(self.dtypes, dtype, str)

    def written_by_name(self, dtype: Any) -> bool:
        """An array of ``dtype`` can be written: not of objects, and its dtype found again by its name
        (:func:`_dtype_by_name`), asked once per dtype object."""
        return by_identity(self.by_name, dtype, lambda d: not (d == object or not _dtype_by_name(d)))

    def find(self, x: Any) -> int | None:
        i = self.objects.get(id(x))
        if i is None:
            try:
                i = self.equal.get((type(x), x))
            except TypeError:
                return None
        if i is None:  # JAX's dead-code elimination's wrapper of a rule, keeping every output: the rule itself
            chain = dce_chain(x)
            if chain is not None and all(all(used) for used in chain[1]):
                return self.find(chain[0])
        return i

    def value(self, x: Any) -> Any:
        t = type(x)
        if t in (bool, int, float, str, bytes, type(None)):  # bytes: a pytree's structure in a scan's flat trees
            return x
        if t in (tuple, list):
            return (t.__name__, [self.value(v) for v in x])
        if t is dict:
            return ("dict", [(self.value(k), self.value(v)) for k, v in x.items()])
        if isinstance(x, core.ClosedJaxpr):
            return ("closed", self.jaxpr(x.jaxpr), [self.array(c) for c in x.consts])
        if isinstance(x, core.Jaxpr):
            return ("jaxpr", self.jaxpr(x))
        if isinstance(x, core.Primitive):
            if _primitive(x.name) is x:
                return ("prim", x.name)
            i = self.find(x)  # a library's own primitive (equinox has some) that the original uses
            if i is None:
                raise Unserialisable(f"primitive {x.name!r} cannot be found by name")
            return ("orig", i)
        if isinstance(x, np.dtype):
            return ("dtype", self.dtype_name(x))
        if isinstance(x, (np.ndarray, np.generic)) or _jax_array(x):
            return self.array(x)
        if isinstance(x, (literals.TypedInt, literals.TypedFloat, literals.TypedComplex)):
            return ("typed", t.__name__, t.__mro__[1](x), str(x.dtype))
        # what is not plain data (a custom_jvp's rule, a mesh, a source location) by its place in the original
        i = self.find(x)
        if i is not None:
            return ("orig", i)
        if isinstance(x, core.JaxprEqnContext):
            return ("ctx", x.compute_type, x.threefry_partitionable, self.value(x.cur_abstract_mesh),
                    x.remove_size_one_mesh_axis, self.value(None if x.xla_metadata is None
                                                            else tuple(sorted(x.xla_metadata.items()))))
        if isinstance(x, source_info_util.SourceInfo):  # a new location (the traceback object cannot be written)
            return ("source", str(x.name_stack))  # in its name scopes, as one: rewrite.loops.laid_out's is read there
        return self.typed_value(x)

    def params(self, e: Any) -> list:
        params = neutral_params(e.primitive, e.params, trees=True)  # the same entry whichever JAX traced it
        if e.primitive.name in CALLBACKS and self.find(params.get("callback")) is None:
            # the key holds a callback by its place (fingerprint.CALLBACKS): an entry may refer to none but the
            # traced program's, which a hit takes from its own fresh trace
            raise ForeignCallback(f"a {e.primitive.name} whose callback is not one of the traced program's")
        if e.primitive.name not in ("custom_vjp_call", "custom_jvp_call"):
            return [(k, self.value(v)) for k, v in params.items()]
        try:  # a custom derivative of the original program (the user's): its rule by place
            return [(k, self.value(v)) for k, v in params.items()]
        except Unserialisable:
            pass
        if e.primitive.name == "custom_jvp_call":
            return [(k, self.value(v)) for k, v in params.items() if k != "jvp_jaxpr_fun"] + [
                (_JVP_WRITTEN, self.jvp_rule(params))]
        return [(k, self.value(v)) for k, v in params.items() if k not in _VJP_RULE] + [
            (_VJP_WRITTEN, self.vjp_rule(params))]

    def vjp_rule(self, params: dict) -> Any:
        """A ``custom_vjp``'s forward and backward as jaxprs: a rule's, which no original program holds."""
        call = params["call_jaxpr"]
        if params.get("symbolic_zeros") or params.get("num_consts"):
            raise Unserialisable("a custom_vjp with symbolic zeros or constants")
        named = named_custom_vjp(params)  # a kernel at a module's top level: by its name, its backward not traced
        if named is not None:
            return ("vjp_name", named[0], named[1], _tree_skeleton(named[2]))
        # a rule met again inside its own forward (one that calls the custom_vjp itself) would be written again
        # and again, to Python's recursion limit: refused at once
        own = id(getattr(params["bwd"], "f", params["bwd"]))
        if own in self.writing_vjp:
            raise Unserialisable("a custom_vjp rule that calls itself")
        self.writing_vjp.add(own)
        try:
            return self._vjp_rule(params, call)
        finally:
            self.writing_vjp.discard(own)

    def _vjp_rule(self, params: dict, call: Any) -> Any:
        try:
            # every input differentiable: without symbolic zeros the forward is the same for any
            fwd_jaxpr, fwd_consts = params["fwd_jaxpr_thunk"].call_wrapped(*([True] * len(call.in_avals)))
            fwd = core.ClosedJaxpr(fwd_jaxpr, fwd_consts)
            out_tree, res_tree, fwds = params["out_trees"]()
            if out_tree.num_leaves != len(call.out_avals):  # outputs pruned after tracing: the tree is the traced one
                raise Unserialisable("a custom_vjp whose unused outputs were removed")
            res_avals = residual_avals(call, fwd, fwds)
            zeros: list[bool] = []

            def bwd(*args: Any) -> list:
                outs = call_custom_vjp_bwd(params["bwd"], *args)
                zeros[:] = [type(o) is ad.Zero for o in outs]
                return [o for o in outs if type(o) is not ad.Zero]

            back = trace_at(bwd, res_avals + [a.to_ct_aval() for a in call.out_avals])
        except Unserialisable:
            raise
        except Exception as e:  # a rule that does not trace at its own types: not written
            raise Unserialisable(f"custom_vjp rule does not trace ({type(e).__name__}: {e})") from None
        names = [(d.traced_for, d.func_src_info) if isinstance(getattr(d, "func_src_info", None), str) else None
                 for d in (params["fwd_jaxpr_thunk"].debug_info, params["bwd"].debug_info)]
        return ("vjp_rule", self.value(fwd), self.value(back), _tree_skeleton(out_tree), _tree_skeleton(res_tree),
                self.value(list(fwds)), self.value(zeros), self.value(names))

    def jvp_rule(self, params: dict) -> Any:
        """A ``custom_jvp``'s rule that the original program does not hold: the original's under dead-code
        elimination (``jvp_dce``), else the jaxpr of its JVP with every tangent given, one a rule built (the nn
        pack's ``softplus``). A rule met again inside its own JVP is written as a reference (``jvp_ref``)."""
        fun = params["jvp_jaxpr_fun"]
        chain = dce_chain(fun)
        place = None if chain is None else self.find(chain[0])
        if place is not None:
            return ("jvp_dce", ("orig", place), self.value(chain[1]), bool(params["symbolic_zeros"]))
        if params.get("symbolic_zeros"):
            raise Unserialisable("a custom_jvp with symbolic zeros")
        d = fun.debug_info
        name = (d.traced_for, d.func_src_info) if isinstance(getattr(d, "func_src_info", None), str) else None
        key = (name, str(params["call_jaxpr"]))
        if key in self.writing:
            return ("jvp_ref", self.writing[key])
        n = self.writing[key] = self.rules
        self.rules += 1
        try:
            jaxpr, consts, out_zeros = fun.call_wrapped(*([False] * (len(params["call_jaxpr"].in_avals)
                                                                      - params["num_consts"])))
            body = self.value(core.ClosedJaxpr(jaxpr, list(consts)))
        except Unserialisable:
            raise
        except Exception as e:  # a rule that does not trace at its own types: not written
            raise Unserialisable(f"custom_jvp rule does not trace ({type(e).__name__}: {e})") from None
        finally:
            del self.writing[key]
        return ("jvp_rule", n, body, self.value(list(out_zeros)), self.value(name))

    def typed_value(self, x: Any) -> Any:
        """A value of one of the kinds of plain data that primitives' params hold, by its schema: a
        complex number, a set, an enum member, a named tuple or a dataclass of a library (jax, numpy,
        ml_dtypes) with plain fields. Anything else is not written (no cache entry): a stored entry
        never names a function or a class to call but these."""
        t = type(x)
        if t is complex:
            return ("complex", x.real, x.imag)
        if t is frozenset:
            return ("frozenset", [self.value(v) for v in sorted(x, key=repr)])
        if x is empty_concrete_mesh:  # a jit's mesh, traced outside any mesh (a concrete one holds devices)
            return ("empty_mesh",)
        if t is UnspecifiedValue:  # "no sharding given", in a jit's params that a rule's backward traced
            return ("unspecified",)
        if t is SaveOnlyTheseNames:  # the emitter's checkpoint policy on JAX 0.11+ (a closure of JAX's there)
            return ("save_only", sorted(str(n) for n in x.saveable_names))
        if t is core.ManualAxisType:  # the manual axes a value of a shard_map body varies over
            return ("manual_axis", self.value(x.varying), self.value(x.unreduced), self.value(x.reduced))
        where = _library_class(t)
        if where is None:
            raise Unserialisable(f"{t.__module__}.{t.__qualname__} is not a library's plain data")
        if isinstance(x, enum.Enum):
            return ("enum", *where, x.name)
        if isinstance(x, tuple) and hasattr(t, "_fields"):
            return ("namedtuple", *where, [self.value(v) for v in x])
        if dataclasses.is_dataclass(x):
            fields = [f.name for f in dataclasses.fields(x) if f.init]
            return ("dataclass", *where, [(f, self.value(getattr(x, f))) for f in fields])
        raise Unserialisable(f"{t.__module__}.{t.__qualname__} is not plain data of a kind the cache writes")

    def array(self, x: Any) -> Any:
        i = self.objects.get(id(x))  # arrays by identity only: equality is elementwise
        if i is not None:
            return ("orig", i)
        a = np.asarray(x)
        if not self.written_by_name(a.dtype):
            raise Unserialisable(f"an array of {a.dtype}")
        return ("array", self.dtype_name(a.dtype), a.shape, np.ascontiguousarray(a).tobytes(), _jax_array(x))

    def aval(self, a: Any) -> Any:
        return by_identity(self.avals, a, self._aval)

    def _aval(self, a: Any) -> Any:
        if isinstance(a, core.ShapedArray):
            default = core.ShapedArray(a.shape, a.dtype, a.weak_type)
            shard = None if a.sharding == default.sharding else self.value(a.sharding)
            mat = None if a.manual_axis_type == default.manual_axis_type else self.value(a.manual_axis_type)
            space = None if a.memory_space == default.memory_space else self.value(a.memory_space)
            try:
                dtype = self.value(np.dtype(a.dtype))
            except TypeError:
                dtype = self.value(a.dtype)
            return ("shaped", tuple(a.shape), dtype, bool(a.weak_type), shard, mat, space)
        if isinstance(a, core.AbstractToken):
            return ("token",)
        return ("aval", self.value(a))

    def jaxpr(self, j: core.Jaxpr) -> Any:
        env: dict[Any, int] = {}

        def bind(v: Any) -> Any:
            env[v] = len(env)
            return self.aval(v.aval)

        def atom(v: Any) -> Any:
            if isinstance(v, core.Literal):
                return ("lit", self.value(v.val), self.aval(v.aval))
            return ("var", env[v])

        consts = [bind(v) for v in j.constvars]
        ins = [bind(v) for v in j.invars]
        eqns = []
        for e in j.eqns:
            prim = self.value(e.primitive)
            invars = [atom(v) for v in e.invars]
            params = self.params(e)
            eqns.append((prim, invars, [bind(v) for v in e.outvars], params,
                         [self.value(x) for x in e.effects], self.value(e.ctx), self.value(e.source_info)))
        outs = [atom(v) for v in j.outvars]
        return (consts, ins, eqns, outs, [self.value(x) for x in j.effects], self.value(j.debug_info))


def _tree_skeleton(tree: Any) -> Any:
    """A pytree structure as plain containers with ``0`` leaves (tuples, lists, dicts, ``None``); raises
    :class:`Unserialisable` for any other node."""
    skeleton = jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)

    def plain(x: Any) -> Any:
        if x is None or (type(x) is int and x == 0):
            return x
        if type(x) in (tuple, list):
            return (type(x).__name__, [plain(v) for v in x])
        if type(x) is dict and all(type(k) is str for k in x):
            return ("dict", [(k, plain(v)) for k, v in x.items()])
        raise Unserialisable(f"a custom_vjp's pytree holds a {type(x).__qualname__}")

    try:
        return ("tree", plain(skeleton))
    finally:
        del plain  # a recursive closure is a reference cycle


def _dtype_by_name(dtype: Any) -> bool:
    """Can this dtype be found again by its name (bfloat16 and the other ml_dtypes too)?"""
    import jax.numpy as jnp

    try:
        return jnp.dtype(str(dtype)) == dtype
    except TypeError:
        return False


def _jax_array(x: Any) -> bool:
    import jax

    return isinstance(x, jax.Array) and not isinstance(x, core.Tracer)


class _Reader:
    def __init__(self, original: core.ClosedJaxpr) -> None:
        self.objects = _original_objects(original)
        self.forwards: dict[int, Forward] = {}  # custom_jvp rules by number, each built once its call is read

    def value(self, x: Any) -> Any:
        if not isinstance(x, tuple):
            return x
        tag = x[0]
        if tag == "orig":
            return self.objects[x[1]]
        if tag == "tuple":
            return tuple(self.value(v) for v in x[1])
        if tag == "list":
            return [self.value(v) for v in x[1]]
        if tag == "dict":
            return {self.value(k): self.value(v) for k, v in x[1]}
        if tag == "closed":
            return core.ClosedJaxpr(self.jaxpr(x[1]), [self.value(c) for c in x[2]])
        if tag == "jaxpr":
            return self.jaxpr(x[1])
        if tag == "prim":
            p = _primitive(x[1])
            if p is None:
                raise Unserialisable(f"no primitive named {x[1]!r} in this process")
            return p
        if tag == "dtype":
            import jax.numpy as jnp

            return jnp.dtype(x[1])
        if tag == "array":
            _, dtype, shape, data, on_device = x
            import jax.numpy as jnp

            a = np.frombuffer(data, dtype=jnp.dtype(dtype)).reshape(shape).copy()
            if on_device:  # a jax.Array again (an emitted program's constants are: emit.const_array)
                return constant_array(a)
            return a if shape else a[()]
        if tag == "typed":
            if x[1] not in ("TypedInt", "TypedFloat", "TypedComplex"):
                raise Unserialisable(f"unknown typed literal {x[1]!r}")
            return getattr(literals, x[1])(x[2], self._dtype(x[3]))
        if tag == "ctx":
            meta = self.value(x[5])
            return core.JaxprEqnContext._create(x[1], x[2], self.value(x[3]), x[4],
                                                None if meta is None else tuple(meta))
        if tag == "source":
            new = source_info_util.new_source_info()
            return new.replace(name_stack=source_info_util.new_name_stack(x[1])) if x[1:] and x[1] else new
        if tag == "empty_mesh":
            return empty_concrete_mesh
        if tag == "unspecified":
            return UNSPECIFIED
        if tag == "tree":
            return jax.tree_util.tree_structure(self.value(x[1]))
        if tag == "vjp_rule":
            return tuple(self.value(v) for v in x[1:])
        if tag == "vjp_name":  # (tag, module, name, the arguments' pytree): rules.named_vjp_params
            return (tag, self.value(x[1]), self.value(x[2]), self.value(x[3]))
        if tag == "jvp_rule":  # its number is known before its body, which may refer to it, is read
            self.forwards.setdefault(x[1], Forward())
            return (tag, x[1], *(self.value(v) for v in x[2:]))
        if tag in ("jvp_ref", "jvp_dce"):
            return (tag, *(self.value(v) for v in x[1:]))
        if tag == "complex":
            return complex(float(x[1]), float(x[2]))
        if tag == "frozenset":
            return frozenset(self.value(v) for v in x[1])
        if tag == "save_only" and isinstance(x[1], list) and all(type(n) is str for n in x[1]):
            return save_only_these_names(*x[1])
        if tag == "manual_axis":
            return core.ManualAxisType(varying=self.value(x[1]), unreduced=self.value(x[2]), reduced=self.value(x[3]))
        if tag in ("enum", "namedtuple", "dataclass"):
            cls = _find_library_class(x[1], x[2])
            if tag == "enum" and isinstance(cls, type) and issubclass(cls, enum.Enum):
                return cls[x[3]]
            if tag == "namedtuple" and isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields"):
                return cls(*[self.value(v) for v in x[3]])
            if tag == "dataclass" and isinstance(cls, type) and dataclasses.is_dataclass(cls):
                return cls(**{str(k): self.value(v) for k, v in x[3]})
            raise Unserialisable(f"{x[1]}.{x[2]} is not a {tag}")
        raise Unserialisable(f"unknown tag {tag!r}")

    def jvp_fun(self, written: Any, params: dict) -> Any:
        """A ``custom_jvp_call``'s ``jvp_jaxpr_fun`` from what :meth:`_Writer.jvp_rule` wrote."""
        kind = written[0] if isinstance(written, tuple) and written else None
        if kind == "jvp_dce" and isinstance(written[1], lu.WrappedFun) and isinstance(written[2], list) \
                and all(isinstance(u, list) and all(type(b) is bool for b in u) for u in written[2]):
            fun = written[1]
            for used in reversed(written[2]):
                fun = dce_jvp(fun, used)
            return fun
        if kind == "jvp_ref" and written[1] in self.forwards:
            return self.forwards[written[1]].fun(params["call_jaxpr"].jaxpr.debug_info)
        if kind == "jvp_rule" and written[1] in self.forwards:
            rule = jvp_rule_fun(written[2:], params["call_jaxpr"], params["num_consts"])
            self.forwards[written[1]].rule = rule
            return rule
        raise Unserialisable("a custom_jvp rule of the wrong form")

    @staticmethod
    def _dtype(name: str) -> Any:
        import jax.numpy as jnp

        return jnp.dtype(name)

    def aval(self, x: Any) -> Any:
        if x[0] == "shaped":
            _, shape, dtype, weak, shard, mat, space = x
            kwargs: dict[str, Any] = {}
            if shard is not None:
                kwargs["sharding"] = self.value(shard)
            if mat is not None:
                kwargs["manual_axis_type"] = self.value(mat)
            if space is not None:
                kwargs["memory_space"] = self.value(space)
            return core.ShapedArray(shape, self.value(dtype), weak, **kwargs)
        if x[0] == "token":
            return core.abstract_token
        return self.value(x[1])

    def jaxpr(self, x: Any) -> core.Jaxpr:
        consts, ins, eqns, outs, effects, debug = x
        env: list[Any] = []

        def bind(a: Any) -> Any:
            v = core.Var(self.aval(a))
            env.append(v)
            return v

        def atom(a: Any) -> Any:
            if a[0] == "lit":
                return core.Literal(self.value(a[1]), self.aval(a[2]))
            return env[a[1]]

        constvars = [bind(a) for a in consts]
        invars = [bind(a) for a in ins]
        new_eqns = []
        for prim, invs, outs_, params, effs, ctx, src in eqns:
            p = self.value(prim)
            args = [atom(a) for a in invs]
            outvars = [bind(a) for a in outs_]
            if p.name in CALLBACKS and not any(k == "callback" and isinstance(v, tuple) and v[:1] == ("orig",)
                                               for k, v in params):
                raise Unserialisable(f"a {p.name} whose callback is not one of this process's trace")
            new_params = {k: self.value(v) for k, v in params}
            if _VJP_WRITTEN in new_params:
                written = new_params.pop(_VJP_WRITTEN)
                new_params.update(named_vjp_params(written[1:], new_params) if written[:1] == ("vjp_name",)
                                  else vjp_rule_params(written, new_params["call_jaxpr"]))
            if _JVP_WRITTEN in new_params:
                new_params["jvp_jaxpr_fun"] = self.jvp_fun(new_params.pop(_JVP_WRITTEN), new_params)
            new_params = params_for_jax(p, new_params)
            new_eqns.append(core.new_jaxpr_eqn(args, outvars, p, new_params,
                                               set(self.value(e) for e in effs), self.value(src), self.value(ctx)))
        return core.new_jaxpr(constvars, invars, [atom(a) for a in outs], new_eqns,
                              set(self.value(e) for e in effects), self.value(debug))


#: the libraries whose plain-data classes (enums, named tuples, dataclasses) an entry may name
_LIBRARIES = ("jax", "jaxlib", "numpy", "ml_dtypes")


def _library_class(t: type) -> tuple[str, str] | None:
    """``(module, qualname)`` of a class of one of :data:`_LIBRARIES` that is found again by them."""
    module, qualname = getattr(t, "__module__", ""), getattr(t, "__qualname__", "")
    if module.split(".")[0] not in _LIBRARIES or "<" in qualname:
        return None
    try:
        return (module, qualname) if _find_library_class(module, qualname) is t else None
    except Unserialisable:
        return None


def _find_library_class(module: str, qualname: str) -> Any:
    """The class an entry names: only in a library's module that this process has imported already,
    reached by public attribute names (nothing is imported, and no dunder is read, on the entry's word)."""
    if not isinstance(module, str) or not isinstance(qualname, str) or module.split(".")[0] not in _LIBRARIES:
        raise Unserialisable(f"an entry names {module!r}, not one of {_LIBRARIES}")
    obj = sys.modules.get(module)
    if obj is None:
        raise Unserialisable(f"module {module!r} is not imported")
    for part in qualname.split("."):
        if part.startswith("__"):
            raise Unserialisable(f"{qualname!r} reads a dunder")
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise Unserialisable(f"{module}.{qualname} is not a class")
    return obj


class _NoGlobals(pickle.Unpickler):
    """An unpickler of plain containers only: it refuses every global, so a planted entry cannot name a
    function to call (``os.system`` through ``__reduce__``)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a cache entry may not name {module}.{name}")


def _plain_loads(data: bytes) -> Any:
    return _NoGlobals(io.BytesIO(data)).load()


def dumps_program(closed: core.ClosedJaxpr, original: core.ClosedJaxpr) -> bytes:
    """``closed`` written down; objects it shares with ``original`` (the traced program) by their place there.

    Raises :class:`Unserialisable` when a param can neither be written nor found in ``original``.
    """
    w = _Writer(original)
    data = ("closed", w.jaxpr(closed.jaxpr), [w.array(c) for c in closed.consts])
    blob = pickle.dumps(data, protocol=5)
    _plain_loads(blob)  # what cannot be read back without globals is not written
    return blob


def loads_program(data: bytes, original: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """The inverse of :func:`dumps_program`, against a fresh trace of the same program."""
    r = _Reader(original)
    try:
        _, jaxpr, consts = _plain_loads(data)
    except pickle.UnpicklingError as e:
        raise Unserialisable(str(e)) from None
    return core.ClosedJaxpr(r.jaxpr(jaxpr), [r.value(c) for c in consts])
