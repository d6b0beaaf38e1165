"""What a guard or a procedural rule sees of a match: values, nodes, bodies, params, and the match itself.

A :class:`Match` reads its bindings as :class:`Value`, :class:`Node`,
:class:`Body` and :class:`Params` views of the current snapshot, and builds
replacement terms by calling back into the saturation's builder
(``rules/builder.py``), which it holds as ``engine``.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..ir import primitives as _primitives
from ..ir import terms as _terms
from ..ir.intern import PARAMS, as_numpy, literal_value
from .sliced import Sliced, slice_along


class Params(dict):
    """The params of a matched node, bound by a :class:`Pat`'s ``params=``: a dict that also knows its primitive.

    Keys read as attributes too (``p.axes`` for ``p["axes"]``). :meth:`bind`
    applies the same primitive with the same params to new operands, which is
    how one rule over a group of primitives (``Pat(ops.REDUCE, ...)``)
    rebuilds whichever member it matched.

    >>> import jax.numpy as jnp
    >>> from jax import lax
    >>> from rewrite import Params
    >>> p = Params(lax.reduce_sum_p, {"axes": (0,), "out_sharding": None})
    >>> p.prim, p.axes, p.bind(jnp.ones((2, 3))).shape
    ('reduce_sum', (0,), (3,))
    """

    def __init__(self, primitive: Any, params: dict[str, Any]) -> None:
        super().__init__(params)
        self.primitive = primitive

    @property
    def prim(self) -> str:
        """The primitive's name, e.g. ``"reduce_sum"``."""
        return self.primitive.name

    @property
    def sharded(self) -> bool:
        """Does the node carry an explicit sharding (which a replacement traced by JAX would lose)?"""
        return self.get("sharding") is not None or self.get("out_sharding") is not None

    def bind(self, *operands: Any) -> Any:
        """This primitive with these params, applied to ``operands`` (inside a right side's trace)."""
        return self.primitive.bind(*operands, **{k: v for k, v in self.items() if not k.startswith("_rw_")})

    def takes_along_last(self, shape: tuple, index_shape: tuple) -> bool:
        """Is this a ``gather`` that takes one element per row along the last axis of an array of ``shape``, as
        ``jnp.take_along_axis(x, i[..., None], axis=-1)`` writes it (indices of shape ``(..., 1, 1)``)? Every
        other axis is a batching axis or, as JAX writes an axis of size 1 (a batch of one), an offset axis of
        slice 1.

        >>> import jax, jax.numpy as jnp
        >>> from rewrite import Params
        >>> def gather(x, i):
        ...     eqn = jax.make_jaxpr(lambda x, i: jnp.take_along_axis(x, i[..., None], axis=-1))(x, i)
        ...     take = eqn.eqns[-1].params["jaxpr"].eqns[-1]
        ...     return Params(take.primitive, take.params), take.invars[1].aval.shape
        >>> g, index = gather(jnp.ones((4, 5)), jnp.zeros(4, jnp.int32))
        >>> g.takes_along_last((4, 5), index), g.takes_along_last((4, 5, 1), index)
        (True, False)
        >>> g, index = gather(jnp.ones((1, 4, 5)), jnp.zeros((1, 4), jnp.int32))
        >>> g.takes_along_last((1, 4, 5), index)
        True
        """
        if self.prim != "gather":
            return False
        dn, axis = self["dimension_numbers"], len(shape) - 1
        batch = tuple(a for a in range(axis) if a not in dn.offset_dims or shape[a] != 1)
        return (all(a < axis and shape[a] == 1 for a in dn.offset_dims) and tuple(dn.collapsed_slice_dims) == (axis,)
                and tuple(dn.start_index_map) == (axis,) and tuple(dn.operand_batching_dims) == batch
                and tuple(dn.start_indices_batching_dims) == tuple(range(len(batch)))
                and set(self["slice_sizes"]) == {1} and len(index_shape) == len(batch) + 2
                and tuple(index_shape[-2:]) == (1, 1))

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__") or key == "primitive":
            raise AttributeError(key)
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"{self.primitive.name} has no param {key!r}") from None

    def __repr__(self) -> str:
        return f"Params({self.prim}, {dict.__repr__(self)})"


class Product:
    """A matched ``dot_general`` read as an einsum, for a rule that rebuilds products: :meth:`Match.product`.

    ``lhs`` and ``rhs`` are its operands (:class:`Value`), ``params`` its :class:`Params`;
    ``dimension_numbers``, ``precision`` and ``preferred_element_type`` are read from them.
    ``labels`` names each dimension with an int, as an einsum does: ``(lhs, rhs, result)``, where a
    contracted or batch dimension of ``rhs`` has the label of the ``lhs`` dimension it pairs with
    and the result is laid out as ``dot_general`` lays it out (batch, ``lhs``'s free dimensions,
    ``rhs``'s). :meth:`dot` is ``lax.dot_general`` with this product's precision and accumulation
    type, for the functions a right side traces.

    >>> import jax
    >>> from jax import lax
    >>> from rewrite import Params, Value
    >>> a, b = (Value.from_aval(jax.core.ShapedArray(s, "float32")) for s in ((2, 3, 4), (2, 4, 5)))
    >>> p = Product(a, b, Params(lax.dot_general_p, {"dimension_numbers": (((2,), (1,)), ((0,), (0,))),
    ...                                            "precision": None, "preferred_element_type": None}))
    >>> p.labels  # bij,bjk->bik
    ((0, 1, 2), (0, 2, 5), (0, 1, 5))
    """

    def __init__(self, lhs: "Value", rhs: "Value", params: "Params") -> None:
        self.lhs, self.rhs, self.params = lhs, rhs, params
        self.dimension_numbers = params["dimension_numbers"]
        self.precision = params.get("precision")
        self.preferred_element_type = params.get("preferred_element_type")
        (lc, rc), (lb, rb) = self.dimension_numbers
        la = tuple(range(lhs.ndim))
        paired = dict(zip(tuple(rc) + tuple(rb), tuple(lc) + tuple(lb)))
        lr = tuple(la[paired[j]] if j in paired else lhs.ndim + j for j in range(rhs.ndim))
        out = [la[i] for i in lb] + [la[i] for i in range(lhs.ndim) if i not in set(lc) | set(lb)]
        out += [lr[j] for j in range(rhs.ndim) if j not in paired]
        self.labels = (la, lr, tuple(out))

    def dot(self, x: Any, y: Any, dimension_numbers: Any = None) -> Any:
        """``lax.dot_general(x, y)`` with this product's dimension numbers (or others), precision and type."""
        return lax.dot_general(x, y, self.dimension_numbers if dimension_numbers is None else dimension_numbers,
                               precision=self.precision, preferred_element_type=self.preferred_element_type)

    def _trace_key(self) -> tuple:
        # what a function that closes over the product can read while traced: its params and its
        # operands' types (rules/builder.py caches such traces by their closures' plain contents)
        return (self.dimension_numbers, repr(self.precision), repr(self.preferred_element_type),
                _short(self.lhs.aval), _short(self.rhs.aval))

    def __repr__(self) -> str:
        return f"Product({_short(self.lhs.aval)}, {_short(self.rhs.aval)}, {self.dimension_numbers})"


def _short(aval: Any) -> str:
    try:
        return _short_cached(aval)
    except TypeError:  # an aval that cannot be hashed
        return _short_uncached(aval)


@functools.lru_cache(maxsize=4096)
def _short_cached(aval: Any) -> str:
    return _short_uncached(aval)


def _short_uncached(aval: Any) -> str:
    s = aval.str_short(short_dtypes=True) if hasattr(aval, "str_short") else str(aval)
    return s + (" (weak)" if getattr(aval, "weak_type", False) else "")


class Value:
    """A matched term as a guard or a procedural rule sees it.

    Shape and dtype are exact. Facts (``positive``, ``nonneg``, ``nonzero``)
    hold for floating values only and are never true of integers, where
    overflow breaks them. NaN never contradicts a fact, and ``positive`` and
    ``nonzero`` exclude subnormals, which XLA:CPU treats as zero (see
    ``rewrite.ir.terms.FACTS``). NaN never contradicts a fact.

    >>> import jax.numpy as jnp
    >>> from rewrite import Ruleset, explain, rule
    >>> seen = []
    >>> def guard(v):
    ...     seen.append((v.shape, v.ndim, v.nonneg, v.positive))
    ...     return v.nonneg
    >>> r = rule(lambda v: jnp.abs(v), lambda v: v, name="abs_nonneg", when=guard)
    >>> seen.clear()  # the calls made while the rule was defined
    >>> explain(lambda t: jnp.abs(jnp.exp(t)), jnp.ones((2, 5)), rulesets=[Ruleset("a", [r])]).fired
    {'abs_nonneg': 1}
    >>> sorted(set(seen))  # exp(t) is never negative, but it may underflow to zero
    [((2, 5), 2, True, False)]
    """

    def __init__(self, aval: Any, name: int | None = None, cls: Any = None, engine: Any = None) -> None:
        self.aval = aval
        self.name = name          # the V id naming the class
        self.cls = cls            # egglog class id in the current snapshot, if it existed then
        self._engine = engine
        self.read_facts = False

    @classmethod
    def from_aval(cls, aval: Any) -> "Value":
        v = cls(aval)
        v._assume_facts = True  # type: ignore[attr-defined]
        return v

    #: whether this is an array: a multi-result node's class (a loop, a call reading a value: ``Match.users``) is not
    is_array = property(lambda self: hasattr(self.aval, "shape"))
    shape = property(lambda self: tuple(self.aval.shape))
    dtype = property(lambda self: self.aval.dtype)
    ndim = property(lambda self: len(self.aval.shape))
    size = property(lambda self: int(np.prod(self.aval.shape, dtype=np.int64)))
    weak_type = property(lambda self: bool(getattr(self.aval, "weak_type", False)))
    is_floating = property(lambda self: _is_floating(self.aval.dtype))

    def _fact(self, fact: str) -> bool:
        self.read_facts = True
        if getattr(self, "_assume_facts", False):
            return True
        if self._engine is None or self.cls is None or not self.is_floating:
            return False
        found = self._engine.snapshot.has_fact(fact, self.cls)
        reads = getattr(self._engine, "reads", None)
        if reads is not None and not found:  # a procedure that read an absent fact is woken when it appears
            reads.add((self.cls, fact))
        return found

    positive = property(lambda self: self._fact("Pos"))
    nonneg = property(lambda self: self._fact("NonNeg"))
    nonzero = property(lambda self: self._fact("NonZero"))

    @property
    def nodes(self) -> list["Node"]:
        """The e-nodes in this class: every known way to compute it."""
        if self._engine is None or self.cls is None:
            return []
        return list(self._engine.nodes_of(self.cls))

    def node(self, prim: str) -> "Node | None":
        """One e-node of this class that applies ``prim``, if there is one."""
        for n in self.nodes:
            if n.prim == prim:
                return n
        return None

    @property
    def literal(self) -> Any:
        """The scalar value if this class contains a literal, else ``None``."""
        for n in self.nodes:
            if n.ctor == "Lit":
                return literal_value(n.args[0], self.dtype)
        return None

    @property
    def constant(self) -> Any:
        """The value (numpy) if this class is a literal or constant array, else ``None``."""
        for n in self.nodes:
            if n.ctor == "Lit":
                return np.asarray(literal_value(n.args[0], self.dtype), dtype=self.dtype)
            if n.ctor == "Const":
                return None if (c := self._engine.egraph.consts.get(n.args[0])) is None else as_numpy(c)
        return None

    def terms_along(self, axis: int, most: int = 8) -> tuple["Value", list[tuple[int, "Value"]]]:
        """This value as ``base + sum(sign * term)``: the operands of ``add`` and ``sub`` that are of size 1 along
        ``axis`` (so the operation broadcasts them along it) and of this value's rank and dtype, outermost first,
        ``sign`` -1 for a subtracted one; at most ``most`` of them. Gathering along ``axis`` is then gathering
        ``base`` and adding the terms (``log_softmax(z)[y]`` is ``z[y] - max(z) - log(sum)``), and a sum along it
        is ``base``'s plus ``n`` times each term. ``(self, [])`` where there is none."""
        v, terms = self, []
        while len(terms) < most:
            node = v.node("sub") or v.node("add")
            if node is None or len(node.operands) != 2:
                break
            a, b = node.operands
            if _broadcast_term(b, a, v, axis):
                terms.append((1 if node.prim == "add" else -1, b))
                v = a
            elif node.prim == "add" and _broadcast_term(a, b, v, axis):
                terms.append((1, a))
                v = b
            else:
                break
        return v, terms

    def max_under(self, of: "Value", axis: "int | Sequence[int]", *, rows: bool = False) -> "Value | None":
        """The ``max(of, axis)`` (a ``reduce_max`` over ``axis`` alone) that this value is computed from through
        the operations a softmax's shift is made of (:data:`SHIFT_OPS`: ``stop_gradient``, broadcasts, reshapes,
        converts, the ``max(-inf, .)`` guard, ``select_n`` on ``is_finite``), or ``None`` when some path reaches
        another value or a ``reduce_max`` of anything else. Literals and single elements end a path.

        ``rows=True``: this value is that max put back on ``of``'s own rows (``axis`` may then be several axes),
        each axis followed through ``stop_gradient``, unsharded broadcasts, transposes and the guards
        ``max(-inf, .)`` and ``where(isfinite(m), m, 0)`` (``jax.nn.logsumexp``'s) alone, and the max may be of
        ``f`` where ``of`` is ``f`` transposed (as ``jax.nn.dot_product_attention`` writes it under ``vmap``); a
        max whose rows land on other rows, or a value of another size than ``of`` but along ``axis`` (where it may
        be 1), is refused."""
        if rows:
            return _row_max(self, of, (axis,) if isinstance(axis, int) else tuple(axis))
        seen, stack, found = set(), [(self, 0)], None
        while stack:
            v, depth = stack.pop()
            if depth > 8 or v.name in seen or v.literal is not None or v.size == 1:
                continue
            seen.add(v.name)
            rm = v.node("reduce_max")
            if rm is not None:
                if rm.operands[0].name != of.name or tuple(rm.params["axes"]) != (axis,):
                    return None
                found = v
                continue
            node = next((n for n in v.nodes if n.prim in SHIFT_OPS), None)
            if node is None:
                return None
            stack.extend((o, depth + 1) for o in node.operands)
        return found

    def __repr__(self) -> str:
        return f"<value {_short(self.aval)}>"


SHIFT_OPS = frozenset({"stop_gradient", "broadcast_in_dim", "max", "min", "select_n", "is_finite", "reshape",
                       "convert_element_type", "squeeze", "expand_dims"})
"""The primitives :meth:`Value.max_under` walks through: those a softmax's shift is made of from its row max."""


def _same(a: Value, b: Value) -> bool:
    """Whether two values are one class (or, outside a snapshot, one name)."""
    return a.cls == b.cls if a.cls is not None and b.cls is not None else (a.cls, a.name) == (b.cls, b.name)


def _inverse(perm: Sequence[int]) -> list[int]:
    """Where each axis of a transpose's operand lands in its result."""
    return [list(perm).index(j) for j in range(len(perm))]


def _row_max(shift: Value, of: Value, axes: tuple[int, ...]) -> Value | None:
    """:meth:`Value.max_under` with ``rows=True``: ``pos`` says where each axis of the value walked lies in ``of``."""
    if shift.ndim != of.ndim or any(d != n and not (i in axes and d == 1)
                                    for i, (d, n) in enumerate(zip(shift.shape, of.shape))):
        return None
    sources = [(of, list(range(of.ndim)))]  # what the max may be taken of, with its axes' places in ``of``
    node = of.node("transpose")
    if node is not None:
        sources.append((node.operands[0], _inverse([int(d) for d in node.params["permutation"]])))
    v, pos = shift, list(range(of.ndim))
    for _ in range(8):
        for prim in ("stop_gradient", "broadcast_in_dim", "transpose", "max", "select_n", "reduce_max"):
            node = v.node(prim)
            if node is None:
                continue
            ops = node.operands
            if prim == "select_n":  # the guard where(isfinite(m), m, 0)
                if not _finite_guard(ops):
                    continue
                v = ops[2]
                break
            if prim == "reduce_max":
                reduced = [int(a) for a in node.params["axes"]]
                for src, place in sources:
                    kept = [j for j in range(src.ndim) if j not in reduced]
                    if _same(ops[0], src) and sorted(place[a] for a in reduced) == sorted(axes) and all(
                            pos[i] == place[j] or src.shape[j] == 1 for i, j in enumerate(kept)):
                        return v
                return None
            if prim == "max":  # the guard max(-inf, m)
                lit = [o for o in ops if o.literal is not None]
                rest = [o for o in ops if o.literal is None]
                if len(lit) != 1 or len(rest) != 1 or float(lit[0].literal) != -np.inf:
                    continue
                v = rest[0]
            elif prim == "broadcast_in_dim":
                if node.params.get("sharding") is not None:
                    return None
                v, pos = ops[0], [pos[int(d)] for d in node.params["broadcast_dimensions"]]
            elif prim == "transpose":
                v, pos = ops[0], [pos[d] for d in _inverse([int(d) for d in node.params["permutation"]])]
            else:
                v = ops[0]
            break
        else:
            return None
    return None


def _finite_guard(ops: Sequence[Value]) -> bool:
    """Whether a ``select_n``'s operands are ``where(isfinite(m), m, 0)``'s: ``jax.nn.logsumexp``'s shift, which is 0
    where the row max is infinite."""
    if len(ops) != 3:
        return False
    test = ops[0].node("is_finite")
    return test is not None and _same(test.operands[0], ops[2]) and _zeros(ops[1])


def _zeros(v: Value, depth: int = 0) -> bool:
    """Whether ``v`` is a literal 0 or a broadcast of one (the loader may give broadcasts of broadcasts)."""
    if v.literal is not None:
        return float(v.literal) == 0.0
    node = v.node("broadcast_in_dim")
    return node is not None and depth < 4 and len(node.operands) == 1 and _zeros(node.operands[0], depth + 1)


def _broadcast_term(term: Value, rest: Value, of: Value, axis: int) -> bool:
    """Whether ``term`` is one that ``of = rest +/- term`` broadcasts along ``axis`` (see :meth:`Value.terms_along`)."""
    return term.ndim == of.ndim and term.shape[axis] == 1 and rest.shape == of.shape and term.dtype == of.dtype


@functools.lru_cache(maxsize=None)
def _is_floating(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))  # jnp knows bfloat16 and the other ml_dtypes


class Node:
    """One e-node: a primitive applied to classes."""

    def __init__(self, engine: Any, ctor: str, args: tuple) -> None:
        self._engine = engine
        self.ctor = ctor
        self.args = args
        spec = _primitives.BY_CTOR.get(ctor)
        self.spec = spec
        sorts = _terms.ctor_arg_sorts(ctor)
        self._sorts = sorts
        if spec is not None or ctor in ("Opaque", "Effect"):
            pid = args[-1]
            self.prim = PARAMS.prim(pid).name
            self.params = PARAMS.params(pid)
            self.pid = pid
        else:
            self.prim = ctor.lower()
            self.params = {}
            self.pid = None

    @property
    def primitive(self) -> Any:
        """The JAX primitive this node applies (``None`` for structural nodes), ready to ``bind``."""
        return None if self.pid is None else PARAMS.prim(self.pid)

    @property
    def operands(self) -> list[Value]:
        """Operand values, with list operands spread out in order."""
        found = self.__dict__.get("_operands")
        if found is None:  # a node view lives one snapshot (Engine.nodes_of): its operands are read once
            found = []
            snap = self._engine.snapshot
            for s, a in zip(self._sorts, self.args):
                if s == "Term":
                    found.append(self._engine.value(a))
                elif s == "TList":
                    found.extend(self._engine.value(x) for x in snap.list_items(a))
            self._operands = found
        return list(found)

    def __repr__(self) -> str:
        return f"<node {self.prim}>"


class Term(Value):
    """A term built during a procedural rule (or an existing class). Hand it back, or build on it."""


class Body:
    """A loaded body (of scan, while, cond, jit): its scope id and output values."""

    def __init__(self, scope: int, outs: list[Value]) -> None:
        self.scope = scope
        self.outs = outs

    def __repr__(self) -> str:
        return f"<body scope={self.scope} outs={len(self.outs)}>"


class Match:
    """One match of a procedural rule: its bindings, and the means to build a replacement.

    ``m[name]`` is a term binding (a :class:`Value`); ``m.params(name)``,
    ``m.int(name)``, ``m.list(name)``, ``m.body(name)`` read the other kinds of
    :class:`Pat` binding; ``m.root`` is the matched class. :meth:`trace`,
    :meth:`node`, :meth:`literal` and :meth:`param` build new terms.

    >>> import math
    >>> import jax.numpy as jnp
    >>> from rewrite import Pat, Ruleset, explain, procedural, rule
    >>> @procedural
    ... def sum_of_broadcast(m):
    ...     s = m["s"]
    ...     if s.ndim != 0 or m.root.ndim != 0:
    ...         return None
    ...     n = math.prod(m.params("bp")["shape"])
    ...     return m.trace(lambda s: s * jnp.asarray(n, s.dtype), s)
    >>> r = rule(Pat("reduce_sum", Pat("broadcast_in_dim", Pat.var("s"), params="bp")), sum_of_broadcast,
    ...          name="sum_of_broadcast")
    >>> report = explain(lambda a: jnp.sum(jnp.broadcast_to(a, (4, 5))), jnp.float32(1.5),
    ...                  rulesets=[Ruleset("p", [r], soundness="identity")])
    >>> report.fired, [e.primitive.name for e in report.after.eqns]
    ({'sum_of_broadcast': 1}, ['mul'])
    """

    def __init__(self, engine: Any, rule: Any, bindings: dict[str, Any], sorts: dict[str, str], root: Any,
                 products: dict | None = None) -> None:
        self._engine = engine
        self.rule = rule
        self._bindings = bindings
        self._sorts = sorts
        self.root = engine.value(root)
        self._products = products  # product's answers in this snapshot, by what they read (the saturation's)
        #: Whether the rule read a binding (not only the root): a rule that did not would act the
        #: same on every match at this root, so the engine acts on the first one only.
        self.read_bindings = False

    def _bound(self, name: str) -> Any:
        self.read_bindings = True
        return self._bindings[name]

    def __getitem__(self, name: str) -> Value:
        if self._sorts.get(name) != "Term":
            raise KeyError(f"{name!r} is not a term binding of rule {self.rule.name!r}")
        return self._engine.value(self._bound(name))

    def __contains__(self, name: str) -> bool:
        return name in self._bindings

    def params(self, name: str) -> "Params | None":
        """The params bound by ``params=name``, as a :class:`Params` (a dict that knows its primitive); ``None``
        where the node is a :meth:`Pat.optional` wrapper this match does not have."""
        pid = self._bound(name)
        return None if pid < 0 else Params(PARAMS.prim(pid), PARAMS.params(pid))

    def product(self, params: str, lhs: str = "a", rhs: str = "b", *, same: Sequence[str] = (),
                operands: Sequence[str] = ()) -> "Product | None":
        """The ``dot_general`` bound by ``params=params`` over the terms ``lhs`` and ``rhs``, as a
        :class:`Product`; ``None`` where a rule that rebuilds products should decline.

        It declines a product that carries a sharding (a traced replacement would drop it), one whose
        operands, with ``operands`` (more term bindings the replacement mixes in), differ in dtype or
        are accumulated in another (``int8`` into ``int32``), and one whose precision or accumulation
        type differs from that of the products bound by ``same`` (params names), since its
        replacement builds them all as one. Every product rule of ``rulesets.linalg`` begins here:

        >>> import jax.numpy as jnp
        >>> from rewrite import Pat, Ruleset, explain, procedural, rule
        >>> @procedural
        ... def sum_rows_first(m):  # sum(a b, 0) -> sum(a, 0) b, for matrices
        ...     p = m.product("p")
        ...     if p is None or tuple(m.params("r").axes) != (0,):
        ...         return None
        ...     la, lb, lo = p.labels
        ...     if lo[0] not in la or lo[0] in lb:
        ...         return None  # only a sum over a free dimension of a
        ...     k = la.index(lo[0])
        ...     return m.trace(lambda a, b: p.dot(jnp.sum(a, axis=k, keepdims=True), b)[0], p.lhs, p.rhs)
        >>> r = rule(Pat("reduce_sum", Pat("dot_general", Pat.var("a"), Pat.var("b"), params="p"), params="r"),
        ...          sum_rows_first, name="sum_rows_first")
        >>> f = lambda a, b: jnp.sum(a @ b, axis=0)
        >>> explain(f, jnp.ones((8, 3)), jnp.ones((3, 2)), rulesets=[Ruleset("s", [r], soundness="identity")]).fired
        {'sum_rows_first': 1}
        """
        memo, got = self._products, self._bindings.get  # (the linalg rules read each product of a snapshot alike)
        key = (tuple(got(n) for n in (params, *same)), got(lhs), got(rhs), tuple(got(o) for o in operands))
        if memo is not None and key in memo:
            self.read_bindings = True  # (as the params' reads below do)
            return memo[key]
        found = self._product(params, lhs, rhs, same, operands)
        if memo is not None:
            memo[key] = found
        return found

    def _product(self, params: str, lhs: str, rhs: str, same: Sequence[str], operands: Sequence[str]) -> Any:
        ps = [self.params(n) for n in (params, *same)]
        first = ps[0]
        if first.prim != "dot_general" or any(
                p.sharded or p.get("precision") != first.get("precision")
                or p.get("preferred_element_type") != first.get("preferred_element_type") for p in ps):
            return None
        a, b = self[lhs], self[rhs]
        dtypes = {v.dtype for v in (a, b, *(self[o] for o in operands))}
        acc = first.get("preferred_element_type")
        if len(dtypes) != 1 or (acc is not None and acc not in dtypes):
            return None
        return Product(a, b, first)

    def int(self, name: str) -> int:
        return int(self._bound(name))

    def list(self, name: str) -> list[Value]:
        return [self._engine.value(c) for c in self._engine.snapshot.list_items(self._bound(name))]

    def body(self, name: str) -> Body:
        return self._engine.body(self._bound(name))

    def bodies(self, name: str) -> list[Body]:
        return [self._engine.body(b) for b in self._engine.snapshot.list_items(self._bound(name))]

    @property
    def engine(self) -> Any:
        return self._engine

    @property
    def time_left(self) -> float:
        """Seconds this rule may still run: its share of the saturation's time limit, or what is left of the
        limit, whichever is less (``Limits.seconds``, ``Limits.rule_share``). Every :meth:`trace` checks it."""
        return self._engine.deadline - time.perf_counter()

    def check_time(self) -> None:
        """Stop here if the rule's time is up: a long procedure calls it in its loops. What the procedure
        built so far stays in the e-graph; the match is declined and the rule runs no more in this rewrite."""
        self._engine.check_time()

    def trace(self, fn: Callable[..., Any], *inputs: Value) -> Any:
        """Insert ``fn(*inputs)``, traced at the inputs' avals; returns its result term(s)."""
        return self._engine.insert_traced(fn, inputs)

    def insert(self, closed: Any, *inputs: Value) -> Any:
        """Insert a closed jaxpr already traced at the inputs' avals (``rewrite.jaxpr.trace.trace_at``), applied to
        ``inputs``: what :meth:`trace` of the function it was traced from inserts, for a rule that read the trace
        first (to decline on what it holds, say) and would otherwise trace it twice. Returns its result term(s)."""
        return self._engine.insert_closed(closed, inputs)

    def param(self, scope: int, index: int, aval: Any) -> Value:
        """Input ``index`` of body scope ``scope`` (a new index adds an input to that body)."""
        return self._engine.build_param(scope, index, aval)

    def fresh_index(self, scope: int) -> int:
        """An input index of body ``scope`` that nothing uses yet: pass it to :meth:`param`.

        A rule that adds an input to a body (an accumulator carry, a new
        ``xs``) takes its index from here, so that two rules adding inputs to
        one shared body never give the same ``Param`` two meanings.
        """
        return self._engine.fresh_index(scope)

    def literal(self, value: Any, aval: Any) -> Value:
        return self._engine.build_literal(value, aval)

    def function(self, outs: Sequence[Value], inputs: Sequence[Value]) -> Callable[..., list] | None:
        """The terms ``outs`` read back as a JAX function of the terms ``inputs``, or ``None``.

        Both are values of the e-graph as it stood when the match was made
        (a body's outputs and its ``Param`` inputs, say). The function takes
        one array per input and returns a list, one per output; it uses
        nothing but its inputs, so ``None`` means the outputs depend on
        something else (a loop's carry, for instance). Its ``jaxpr`` attribute
        is the closed jaxpr it runs, and ``uses`` says, per input, whether
        the outputs read it. Asked again in one snapshot for the same
        classes, it is the same function, and :meth:`trace` of it directly
        traces it once per avals. Trace it into the
        e-graph with :meth:`trace`, under ``jax.vmap`` or ``jax.checkpoint``
        if need be::

            f = m.function([body.outs[k]], xs_params)          # one step's output from its xs
            ys = m.trace(lambda *xs: jax.vmap(f)(*xs)[0], *xs)  # all steps at once
        """
        return self._engine.function(outs, inputs)

    def sliced(self, v: Value, axis: int, limit: dict[str, int] | None = None) -> Sliced | None:
        """``v`` read as a program that computes it a block at a time along ``axis`` (a :class:`Sliced`), or
        ``None`` where the walk down the e-graph went too deep.

        The walk follows the axis through elementwise operations, broadcasts, transposes, ``iota`` and products
        that carry it on one side; what it reaches without the axis is a leaf read whole, what carries the axis
        and is none of those a leaf sliced per block. ``limit``: at most this many nodes of a primitive are
        passed (``{"dot_general": 1}``: one product; a further one is a leaf). Trace the blocks into the
        e-graph with :meth:`trace`, inside a loop over them::

            s = m.sliced(m["s"], axis=2)                   # the logits, along the keys
            rows = lambda *leaves: lax.map(lambda j: s.block(leaves, j * 256, 256).sum(2),
                                           jnp.arange(n // 256))
            m.trace(rows, *s.leaves)

        ``rulesets/attention.py`` computes attention's logits so, a block of keys (and of queries,
        :meth:`Sliced.place`) at a time.
        """
        return slice_along(v, axis, limit)

    def computes(self, outs: Sequence[Value], inputs: Sequence[Value]) -> bool:
        """Whether ``outs`` can be computed from ``inputs`` alone: what ``function(outs, inputs) is not None``
        says, without building the function (it may still be ``None`` for a slice that carries effects)."""
        return self._engine.computes(outs, inputs)

    def computes_each(self, outs: Sequence[Value], inputs: Sequence[Value]) -> list[bool]:
        """``[m.computes([v], inputs) for v in outs]``, the same answers for less work where the outputs share
        classes (a loop body's outputs)."""
        return self._engine.computes_each(outs, inputs)

    def node(self, prim: Any, operands: Sequence[Value], params: dict[str, Any], out_avals: Sequence[Any], *,
             bodies: Sequence[Body] = ()) -> Any:
        """Insert one application of ``prim`` (a primitive or its name) and return its result(s).

        For primitives with bodies, pass ``bodies`` (each a :class:`Body`,
        e.g. ``Body(scope, outs)``) and params without the body jaxprs; a
        scan's params carry ``_rw_order``, the body's input indices in jaxpr order. Params whose
        names start with ``_rw_`` are annotations for rules and are dropped when the program is emitted.
        Multi-result primitives return a tuple.
        """
        return self._engine.build_node(prim, operands, params, out_avals, bodies)

    def users(self, v: Value) -> list[tuple[Value, Node]]:
        """Every e-node that uses ``v`` directly, with the class it computes (a loop's: no array, ``is_array``)."""
        return self._engine.users(v)

    def read_whole(self, v: Value, but: str = "reduce_sum") -> bool:
        """Whether a node of ``v``'s shape reads ``v`` other than by ``but``: ``v`` is then computed whole for it,
        whatever a rule builds in place of ``but`` (``rulesets.nn_lm_head`` offers no token loop where a backward
        as written, ``softmax - one_hot``, reads the exponentials whole that the loop would sum by blocks)."""
        return any(u.is_array and u.shape == v.shape and n.prim != but for u, n in self.users(v))
