"""Patterns: what a rule's left-hand side looks for, and the check that a match is real.

A left-hand side is a JAX function. Tracing it and walking the jaxpr with the
loader, but with a :class:`QueryBuilder` instead of an inserter, gives an
egglog query whose variables are the function's arguments. Parameters that
depend on shapes (axes, broadcast shapes, slice bounds, ...) are left as
wildcards, so one query serves inputs of any shape.

A query is only a filter. Before a rewrite is applied, the :class:`Verifier`
traces the left-hand side again at the matched classes' actual shapes and
dtypes, and looks every resulting node up in the e-graph, read-only. The
rewrite goes ahead only if the traced term is present and lands in the
matched class. So ``lhs(inputs)`` is provably what was matched, and
``rhs(inputs)`` is then what the rule claims it equals. A loose query can cost
time, never correctness.

:class:`Pat` is the lower-level pattern language, for rules whose right-hand
side is a plain function of the pattern's bindings (the variables, ``name=``
and ``params=`` bindings by name) or Python code over the whole match
(procedural, tinygrad style). It reaches
what a JAX function cannot spell: a scan's body, a projection, any params.
One :class:`Pat` can stand for a group of primitives (``Pat(ops.REDUCE, x)``,
see :data:`ops`): it compiles to one query per member.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import Any, Iterable, Sequence


from ..ir import primitives as _primitives
from ..ir import terms as _terms
from ..ir.intern import LITERALS, TYPES, content_hash, in_dtype, pinned
from ..ir.jaxapi import core
from ..ir.primitives import GROUPS
from ..jaxpr.load import load_closed

#: Families whose params are shapes, axes or bounds: wildcards in queries.
_SHAPE_FAMILIES = {_primitives.LAYOUT, _primitives.TRANSPOSE, _primitives.REDUCE, _primitives.CONTRACT, _primitives.INDEX}


class PatternError(ValueError):
    """A left-hand side that cannot be a pattern."""


# ---------------------------------------------------------------------- operation groups
def _group(name: str) -> frozenset[str]:
    """A group of the table of primitives (:data:`rewrite.GROUPS`), read when asked: a primitive
    registered later (``register_primitive``) is a member from then on."""
    return frozenset(GROUPS.get(name, ()))


class Ops:
    """Groups of primitives, for one :class:`Pat` that stands for every member of a group.

    Each group is a ``frozenset`` of primitive names, read from the table of
    primitives (:data:`rewrite.GROUPS`, one fact in one place), so groups
    combine with set operations (``ops.REDUCE - ops.ARG_REDUCE``). A pattern
    over a group binds the matched primitive and its params with ``params=``
    (a :class:`Params`, whose :meth:`Params.bind` applies the same primitive).

    >>> from rewrite import ops
    >>> sorted(ops.COMPARISON)
    ['eq', 'ge', 'gt', 'le', 'lt', 'ne']
    >>> {"reduce_sum", "argmax"} <= ops.REDUCE, "argmax" in ops.REDUCE - ops.ARG_REDUCE
    (True, False)
    >>> "sin" in ops.UNARY_TRANSCENDENTAL and "add" in ops.BINARY
    True
    """

    #: Cheap elementwise primitives of one operand (``neg``, ``abs``, ``sign``, ``integer_pow``...).
    UNARY = property(lambda self: _group("unary_elementwise"))
    #: Elementwise primitives of two operands: arithmetic, comparisons, bitwise, shifts.
    BINARY = property(lambda self: _group("binary_elementwise"))
    #: Transcendental functions of one operand (``sin``, ``exp``, ``log``, ``sqrt``...).
    UNARY_TRANSCENDENTAL = property(lambda self: _group("unary_transcendental"))
    #: Transcendental functions of two operands (``pow``, ``atan2``...).
    BINARY_TRANSCENDENTAL = property(lambda self: _group("binary_transcendental"))
    #: Every reduction over axes, ``argmax`` and ``argmin`` included.
    REDUCE = property(lambda self: _group("reduce"))
    #: The reductions that return an index.
    ARG_REDUCE = property(lambda self: _group("arg_reduction"))
    #: The six comparisons.
    COMPARISON = property(lambda self: _group("comparison"))
    #: Arithmetic of two operands that folds exactly: ``add sub mul div rem max min``.
    ARITHMETIC = property(lambda self: _group("exact_arithmetic") & self.BINARY)
    #: Bitwise and logical operations of two operands.
    BITWISE = property(lambda self: _group("logical") & self.BINARY)
    #: Shape-only operations of one operand (broadcast, reshape, squeeze, rev).
    LAYOUT = property(lambda self: _group("layout"))

    def __repr__(self) -> str:
        return "<rewrite.ops: " + " ".join(n for n in vars(Ops) if n.isupper()) + ">"


ops = Ops()


@dataclasses.dataclass
class Query:
    """An egglog query. ``atoms`` bind the variables; ``root`` and ``binds`` name what a match records."""

    atoms: list[str]
    root: str
    binds: list[tuple[str, str]]  # (egglog variable, sort), in the order the match relation stores them

    @property
    def text(self) -> str:
        return " ".join(self.atoms)


def _egg_var(name: str) -> str:
    return "v_" + "".join(ch if ch.isalnum() else "_" for ch in name)


#: A ``pvary_literals`` variant: the cast literal is then converted (JAX 0.11+ casts a Python int literal with
#: ``pvary`` as ``int32`` and converts it to the float it multiplies: ``convert_element_type(pvary(2))``).
CONVERTED = "converted"


class QueryBuilder:
    """A loader builder that writes egglog query atoms instead of inserting nodes."""

    def __init__(self, pvary_literals: bool | str = False) -> None:
        self.atoms: list[str] = []
        self._memo: dict[tuple, str] = {}
        self._n = 0
        # Inside a shard_map body JAX casts literals with pvary before combining them with
        # varying values; this variant of the query looks through that cast.
        self.pvary_literals = pvary_literals

    def fresh(self, prefix: str) -> str:
        self._n += 1
        return f"_{prefix}{self._n}"

    def term(self, ctor: str, args: Sequence[Any], type_id: int, source: Any = None) -> str:
        spec = _primitives.BY_CTOR.get(ctor)
        parts = [str(a) for a in args]
        if spec is not None and spec.family in _SHAPE_FAMILIES:
            parts[-1] = self.fresh("p")
        key = (ctor, tuple(parts))
        found = self._memo.get(key)
        if found is not None:
            return found
        v = self.fresh("t")
        self.atoms.append(f"(= {v} ({ctor} {' '.join(parts)}))")
        self._memo[key] = v
        return v

    def tlist(self, refs: Sequence[str]) -> str:
        return _terms.tlist_text(refs)

    def literal(self, value: Any, aval: Any) -> str:
        # Literals match by value, whatever their dtype: a pattern traced in
        # float32 also matches a float64 or int32 program. Two literals of one
        # value but different types (weak and strong 0.0, say) stay distinct.
        value = in_dtype(value, aval.dtype)  # as the e-graph keeps a program's literals (EGraph.literal)
        key = ("Lit", LITERALS.intern_value(value), TYPES.intern_aval(aval))
        found = self._memo.get(key)
        if found is not None:
            return found
        v = self.fresh("t")
        self.atoms.append(f"(= {v} (Lit {LITERALS.intern_value(value)} {self.fresh('d')}))")
        if self.pvary_literals:
            cast = self.fresh("t")
            self.atoms.append(f"(= {cast} (Opaque (TCons {v} (TNil)) {self.fresh('p')}))")
            v = cast
            if self.pvary_literals == CONVERTED:
                converted = self.fresh("t")
                self.atoms.append(f"(= {converted} (ConvertElementType {v} {self.fresh('p')}))")
                v = converted
        self._memo[key] = v
        return v

    def const(self, array: Any, aval: Any) -> str:
        return self.term("Const", [content_hash(array)], 0)

    def body(self, scope: int, outs: Sequence[str]) -> str:
        raise PatternError("a left-hand side cannot contain a primitive with a body (scan, cond, while...); "
                           "write it as a procedural rule with Pat")

    blist = body

    def new_scope(self) -> int:
        raise PatternError("a left-hand side cannot contain a primitive with a body (scan, cond, while...); "
                           "write it as a procedural rule with Pat")


def compile_traced(closed: core.ClosedJaxpr, names: Sequence[str], pvary_literals: bool | str = False) -> Query:
    """The query for a traced left-hand side whose inputs are the pattern variables ``names``.

    With ``pvary_literals``, every literal may also sit under a one-operand cast
    (``pvary`` in a shard_map body), and with :data:`CONVERTED` under a conversion
    of that cast; the verifier checks the real structure.
    """
    qb = QueryBuilder(pvary_literals)
    inputs = [_egg_var(n) for n in names]
    with pinned():  # the query holds the params ids of its nodes for as long as its rule lives
        (out,), token = load_closed(closed, inputs, qb)
    if out in inputs:
        raise PatternError("the left-hand side is a bare pattern variable; it would match every term")
    if not qb.atoms:
        raise PatternError("the left-hand side has no operation to match")
    tokens = set(" ".join(qb.atoms).replace("(", " ").replace(")", " ").split())
    missing = [n for n, v in zip(names, inputs) if v not in tokens]
    if missing:
        raise PatternError(f"pattern variable {missing[0]!r} is not used by the left-hand side, "
                           "so a match could not bind it")
    return Query(qb.atoms, out, [(v, "Term") for v in inputs])


_LIT_ATOM = re.compile(r"^\(= (\S+) \(Lit (\S+) (\S+)\)\)$")
#: a node whose last argument is a params id: ``(= _t5 (Opaque (TCons v_A (TNil)) 17))``
_PARAMS_ATOM = re.compile(r"^\(= (\S+) (\(\S+ .*) (\d+)\)\)$")


def generalize(query: Query, other: Query) -> Query | None:
    """``query`` with a wildcard for each literal or params whose value differs in ``other``, or ``None``.

    ``query`` and ``other`` are one left-hand side traced at two sizes. A
    literal that changes with the size (a mean's divisor, ``x.shape[0]``) is
    derived from shapes, and so are params that hold programs typed at the
    size (``lu``, ``custom_linear_solve``): the query must not fix them. The
    verifier retraces the left side at the matched shapes, which checks them.
    ``None`` when nothing differs, or when the two traces differ in more than
    literal values and params (then nothing is generalized).
    """
    if len(query.atoms) != len(other.atoms) or query.root != other.root or query.binds != other.binds:
        return None
    atoms, changed = [], 0
    for a, b in zip(query.atoms, other.atoms):
        if a == b:
            atoms.append(a)
            continue
        ma, mb = _LIT_ATOM.match(a), _LIT_ATOM.match(b)
        if ma and mb and ma.group(1) == mb.group(1) and ma.group(3) == mb.group(3):
            changed += 1
            atoms.append(f"(= {ma.group(1)} (Lit _shape{changed} {ma.group(3)}))")
            continue
        pa, pb = _PARAMS_ATOM.match(a), _PARAMS_ATOM.match(b)
        if pa and pb and pa.group(1) == pb.group(1):  # the same node with other params: they carry shapes
            changed += 1
            atoms.append(f"(= {pa.group(1)} {pa.group(2)} _shape{changed}))")
            continue
        return None
    return Query(atoms, query.root, query.binds) if changed else None


_BINARY_ATOM = re.compile(r"^\(= (\S+) \((\S+) (\S+) (\S+) (\S+)\)\)$")
_ATOM_HEAD = re.compile(r"^\(= (\S+) \((\S+)")
_TERM_VAR = re.compile(r"(?<![\w])_t\d+\b")


_LIT_ID = re.compile(r"\(Lit (\d+) ")


def literal_ids(query: Query) -> frozenset[int]:
    """The ids of the literals (``LITERALS``) a match of ``query`` must hold: an e-graph without one has no match.

    >>> sorted(literal_ids(Query(["(= _t1 (Lit 7 _d2))", "(= _t3 (Mul v_x _t1 0))"], "_t3", [("v_x", "Term")])))
    [7]
    """
    return frozenset(int(m) for atom in query.atoms for m in _LIT_ID.findall(atom))


def anchored(query: Query, ctor: str) -> Query | None:
    """The part of ``query`` that matches on a node of ``ctor``: the smallest subterm that holds one and binds
    every variable (its atoms, rooted at that subterm), or ``None`` if no subterm does.

    A match of the part is not one of the whole: the engine looks the whole left side up at the part's
    bindings (:func:`present`, which verifies every match anyway) to find its root. Every match of the whole
    holds a match of the part, so nothing is lost, and a part rooted at a rare node is a small join where
    the whole may be a large one (a VJP's twenty products).

    >>> q = Query(["(= _t1 (Tanh v_x 0))", "(= _t2 (Mul _t1 v_y 0))", "(= _t3 (Add _t2 v_y 0))"], "_t3",
    ...           [("v_x", "Term"), ("v_y", "Term")])
    >>> a = anchored(q, "Tanh"); a.root, a.atoms
    ('_t2', ['(= _t1 (Tanh v_x 0))', '(= _t2 (Mul _t1 v_y 0))'])
    """
    defined: dict[str, tuple[str, str, set[str]]] = {}  # term var -> (ctor, atom, the term vars it reads)
    for atom in query.atoms:
        head = _ATOM_HEAD.match(atom)
        if head is None:
            return None
        defined[head.group(1)] = (head.group(2), atom, set(_TERM_VAR.findall(atom[len(head.group(0)):])))

    @functools.cache
    def below(var: str) -> frozenset[str]:
        return frozenset({var}).union(*(below(v) for v in defined[var][2] if v in defined))

    binds = {v for v, _ in query.binds}
    best = None
    for var in defined:
        part = below(var)
        if not any(defined[v][0] == ctor for v in part):
            continue
        text = " ".join(defined[v][1] for v in part)
        binds_all = all(re.search(rf"(?<![\w]){re.escape(b)}\b", text) for b in binds)
        if binds_all and (best is None or len(part) < len(best[1])):
            best = (var, part)
    del below  # a recursive closure is a reference cycle
    if best is None:
        return None
    var, part = best
    return Query([a for a in query.atoms if _ATOM_HEAD.match(a).group(1) in part], var, list(query.binds))


def anchored_queries(queries: list[Query], ctor: str) -> tuple[list[Query], frozenset[int]] | None:
    """Each query's part around ``ctor`` (:func:`anchored`) and the literal ids every part holds (what an e-graph
    must hold before any can match); ``None`` if a query has no such part."""
    parts = [anchored(q, ctor) for q in queries]
    if not parts or any(p is None for p in parts):
        return None
    return parts, frozenset.intersection(*map(literal_ids, parts))


#: At most this many commutative operations of one query are matched in both orders (2**n variants).
MAX_COMMUTED = 4


def commuted(query: Query) -> list[Query]:
    """``query`` and its variants with the operands of commutative operations (``add``, ``mul``) swapped.

    The e-graph keeps the order a program or a rule wrote (no commutativity
    rule doubles it), so a pattern ``x * 2`` must also find ``2 * x``: each
    variant is one more egglog rule recording into the same match relation.
    The verifier accepts either order (:class:`Verifier`). The first
    :data:`MAX_COMMUTED` commutative operations of a query get both orders;
    variants that read the same (``x + x``) are dropped.

    >>> q = Query(["(= _t1 (Mul v_x _t2 _p3))", "(= _t2 (Lit 5 _d4))"], "_t1", [("v_x", "Term")])
    >>> [v.atoms[0] for v in commuted(q)]
    ['(= _t1 (Mul v_x _t2 _p3))', '(= _t1 (Mul _t2 v_x _p3))']
    """
    return list(_commuted(tuple(query.atoms), query.root, tuple(query.binds), _commutative_ctors()))


@functools.lru_cache(maxsize=4096)
def _commuted(atoms: tuple, root: str, binds: tuple, ctors: frozenset) -> tuple[Query, ...]:
    # ``ctors`` is part of the key: a primitive registered later may be commutative too
    spots = []
    for i, atom in enumerate(atoms):
        m = _BINARY_ATOM.match(atom)
        if m and m.group(2) in ctors and m.group(3) != m.group(4):
            spots.append((i, m))
    out, seen = [], set()
    for flips in itertools.product((False, True), repeat=min(len(spots), MAX_COMMUTED)):
        variant = list(atoms)
        for (i, m), flip in zip(spots, flips):
            if flip:
                variant[i] = f"(= {m.group(1)} ({m.group(2)} {m.group(4)} {m.group(3)} {m.group(5)}))"
        if tuple(variant) not in seen:
            seen.add(tuple(variant))
            out.append(Query(variant, root, list(binds)))
    return tuple(out)


def _commutative_ctors() -> frozenset[str]:
    return frozenset(_primitives.BY_PRIM[p].ctor for p in _group("commutative"))


class NotPresent(Exception):
    pass


class Verifier:
    """A loader builder that looks every node up, read-only, and fails if one is absent."""

    def __init__(self, egraph: Any) -> None:
        self.egraph = egraph

    def _find(self, ctor: str, values: list[Any]) -> Any:
        found = self.egraph.lookup(ctor, values)
        if found is None and len(values) == 3 and ctor in _commutative_ctors():
            # the other order computes the same bits (see ``commuted``)
            found = self.egraph.lookup(ctor, [values[1], values[0], values[2]])
        if found is None:
            raise NotPresent(ctor)
        return found

    def term(self, ctor: str, args: Sequence[Any], type_id: int, source: Any = None) -> Any:
        sorts = _terms.ctor_arg_sorts(ctor)
        values = [self.egraph.int_value(a) if s == "i64" else a for s, a in zip(sorts, args)]
        return self._find(ctor, values)

    def tlist(self, refs: Sequence[Any]) -> Any:
        lst = self._find("TNil", [])
        for r in reversed(refs):
            lst = self._find("TCons", [r, lst])
        return lst

    def literal(self, value: Any, aval: Any) -> Any:
        value = in_dtype(value, aval.dtype)  # as the e-graph keeps a program's literals (EGraph.literal)
        return self.term("Lit", [LITERALS.intern_value(value), TYPES.intern_aval(aval)], 0)

    def const(self, array: Any, aval: Any) -> Any:
        return self.term("Const", [content_hash(array)], 0)

    def body(self, scope: int, outs: Sequence[Any]) -> Any:
        raise NotPresent("body")

    blist = body

    def new_scope(self) -> int:
        raise NotPresent("body")


def present(egraph: Any, closed: core.ClosedJaxpr, inputs: Sequence[Any]) -> Any:
    """The class of ``closed(*inputs)`` if every node of it is in the e-graph, else ``None``."""
    try:
        (out,), _ = load_closed(closed, list(inputs), Verifier(egraph), remember=True)
    except NotPresent:
        return None
    return out


# ---------------------------------------------------------------------- Pat
class Pat:
    """A pattern over the e-graph's operations, for a :func:`rewrite.rule`'s left-hand side.

    Its right-hand side is a plain function that takes the pattern's bindings
    by name (``lambda x, r: ...`` for ``Pat.var("x")`` and ``params="r"``), or
    a :func:`rewrite.procedural` function of the whole :class:`rewrite.Match`.

    ``Pat.var("x")`` matches any term and binds it. ``Pat("reduce_sum", x,
    name="r", params="p")`` matches a ``reduce_sum`` of whatever ``x``
    matches, with any params; ``name`` binds the node's class and ``params``
    its params. Primitives with list operands (``select_n``, ``concatenate``)
    take a Python list or a single ``Pat.var`` bound to the whole list.
    ``Pat.lit(2.0)`` matches a literal of that value (of any dtype), and
    ``Pat.lit(name="c")`` any literal, for rules that compute with constants.
    Primitives with bodies take ``body=``/``bodies=`` names. ``Pat.proj(p, i)``
    matches component ``i`` (an int, or a name to bind it) of a multi-result
    node. ``Pat.optional(prim, p)`` matches ``prim`` applied to what ``p``
    matches, or what ``p`` matches alone (a convert or a squeeze that some
    programs write and others do not).

    >>> from rewrite import Pat
    >>> p = Pat("reduce_sum", Pat.proj(Pat("scan", name="s", body="b", args="xs"), "k"), name="r", params="rp")
    >>> sorted(p.names())
    ['b', 'k', 'r', 'rp', 's', 'xs']
    """

    def __init__(self, prim: str | Iterable[str], *operands: Any, name: str | None = None,
                 params: str | None = None, body: str | None = None, bodies: Sequence[str] | str | None = None,
                 args: str | None = None) -> None:
        if isinstance(prim, str):
            members: tuple[str, ...] = (prim,)
            if prim not in _primitives.BY_PRIM and prim not in ("proj", "var", "lit", "opaque"):
                raise PatternError(f"Pat: unknown primitive {prim!r}; the term language has no constructor for it")
        else:
            members = tuple(sorted(prim))
            unknown = [p for p in members if p not in _primitives.BY_PRIM]
            if not members or unknown:
                raise PatternError(f"Pat: a group needs known primitives; unknown: {unknown or 'empty group'}")
            if len({_primitives.BY_PRIM[p].layout for p in members}) != 1:
                raise PatternError("Pat: the primitives of a group must take their operands alike "
                                   f"(one layout); {members} do not")
            prim = members[0] if len(members) == 1 else "{" + ",".join(members) + "}"
        self.prim = prim
        #: The primitives this pattern matches at its root: one, or the members of a group.
        self.members = members
        self.operands = operands
        self.name = name
        self.params = params
        self.body = body
        self.bodies = bodies
        self.args = args
        self.index: Any = None
        self.value: Any = None
        #: Whether the node may be absent (:meth:`optional`).
        self.is_optional = False

    @property
    def is_group(self) -> bool:
        return len(self.members) > 1

    def ctors(self) -> set[str]:
        """The constructors of the nodes this pattern matches at its root."""
        special = {"proj": "Proj", "lit": "Lit", "opaque": "Opaque", "var": "V"}
        if self.prim in special:
            return {special[self.prim]}
        return {_primitives.BY_PRIM[p].ctor for p in self.members}

    def param_names(self) -> set[str]:
        """The names that bind a node's params (``params=``), as opposed to a projection index."""
        out = {self.params} if self.params else set()
        for o in self.operands:
            for x in (o if isinstance(o, (list, tuple)) else [o]):
                if isinstance(x, Pat):
                    out |= x.param_names()
        return out

    @classmethod
    def var(cls, name: str) -> "Pat":
        p = cls("var", name=name)
        return p

    @classmethod
    def proj(cls, of: "Pat", index: int | str, name: str | None = None) -> "Pat":
        p = cls("proj", of, name=name)
        p.index = index
        return p

    @classmethod
    def optional(cls, prim: str | Iterable[str], operand: "Pat", *, name: str | None = None,
                 params: str | None = None) -> "Pat":
        """``prim`` applied to what ``operand`` matches, or what ``operand`` matches alone: one pattern for
        the programs that write a wrapper (a ``convert_element_type``, a ``squeeze``) and those that do not.

        Where the wrapper is absent, ``params`` is bound to nothing (:meth:`rewrite.Match.params` and a right
        side's argument give ``None``) and ``name`` to what ``operand`` matched. A rule's queries double with
        each optional wrapper: one with it, one without.

        >>> from rewrite import Pat
        >>> p = Pat.optional("convert_element_type", Pat("exp", Pat.var("x")), params="c")
        >>> p.is_optional, sorted(p.names())
        (True, ['c', 'x'])
        """
        if not isinstance(operand, Pat):
            raise PatternError("Pat.optional wraps one pattern")
        p = cls(prim, operand, name=name, params=params)
        if len(p.members) != 1 or _primitives.BY_PRIM[p.members[0]].layout != "T":
            raise PatternError(f"Pat.optional: {p.prim!r} must be one primitive of one operand")
        p.is_optional = True
        return p

    @classmethod
    def lit(cls, value: Any = None, name: str | None = None) -> "Pat":
        """A literal scalar: of this value, or any literal when ``value`` is ``None``."""
        p = cls("lit", name=name)
        p.value = value
        return p

    def names(self) -> set[str]:
        out = {n for n in (self.name, self.params, self.body, self.args) if n}
        if isinstance(self.index, str):
            out.add(self.index)
        if isinstance(self.bodies, str):
            out.add(self.bodies)
        for o in self.operands:
            if isinstance(o, Pat):
                out |= o.names()
            elif isinstance(o, (list, tuple)):
                for x in o:
                    out |= x.names()
        return out

    def __repr__(self) -> str:
        if self.prim == "var":
            return f"Pat.var({self.name!r})"
        return f"Pat({self.prim!r}, {', '.join(map(repr, self.operands))})"

    def groups(self) -> list["Pat"]:
        """The group and optional patterns in this pattern, in the order a query is built."""
        out = [self] if self.is_group or self.is_optional else []
        for o in self.operands:
            for x in (o if isinstance(o, (list, tuple)) else [o]):
                if isinstance(x, Pat):
                    out += x.groups()
        return out


#: What an optional wrapper's ``params=`` is bound to where the wrapper is absent (params ids are never negative).
ABSENT = -1


def compile_pats(pat: Pat) -> tuple[list[Query], list[str]]:
    """The queries for a :class:`Pat`, one per choice of a member for each group in it and of present or absent
    for each optional wrapper, and the names they bind, in the order a match stores them (the same for every
    query)."""
    groups = pat.groups()
    queries: list[Query] = []
    names: list[str] | None = None
    for choice in itertools.product(*[g.members + ((None,) if g.is_optional else ()) for g in groups]):
        query, these = compile_pat(pat, {id(g): m for g, m in zip(groups, choice)})
        assert names is None or these == names, "a group's members bind names in one order"
        names = these
        queries.append(query)
    return queries, names or []


def compile_pat(pat: Pat, choice: dict[int, str] | None = None) -> tuple[Query, list[str]]:
    """The query for a :class:`Pat`, and the names it binds in the order the match stores them.

    ``choice`` picks the member of each group pattern (by ``id``), ``None`` for an optional wrapper left
    out; see :func:`compile_pats`.
    """
    choice = choice or {}
    if pat.prim == "var":
        raise PatternError("a pattern cannot be a bare variable; it would match every term")
    qb = QueryBuilder()
    binds: dict[str, tuple[str, str]] = {}

    def bind(name: str | None, v: str, sort: str) -> str:
        if name is None:
            return v
        if name in binds:
            if binds[name][1] != sort:
                raise PatternError(f"name {name!r} is bound both as {binds[name][1]} and {sort}")
            qb.atoms.append(f"(= {binds[name][0]} {v})")
            return binds[name][0]
        binds[name] = (v, sort)
        return v

    def walk(p: Any, sort: str = "Term") -> str:
        if isinstance(p, (list, tuple)):
            return _terms.tlist_text([walk(x) for x in p])
        if p.prim == "var":
            if p.name in binds:
                return binds[p.name][0]
            v = _egg_var(p.name)
            binds[p.name] = (v, sort)
            return v
        if p.prim == "lit":
            v = qb.fresh("t")
            value = qb.fresh("k") if p.value is None else LITERALS.intern_value(p.value)
            qb.atoms.append(f"(= {v} (Lit {value} {qb.fresh('d')}))")
            return bind(p.name, v, "Term")
        if p.prim == "proj":
            of = walk(p.operands[0])
            idx = str(p.index) if isinstance(p.index, int) else _name_var(p.index, "i64")
            v = qb.fresh("t")
            qb.atoms.append(f"(= {v} (Proj {of} {idx}))")
            return bind(p.name, v, "Term")
        member = choice.get(id(p), p.members[0])
        if member is None:  # an optional wrapper left out: its operand, its names bound as they would be
            v = walk(p.operands[0])
            if p.params:
                qb.atoms.append(f"(= {_name_var(p.params, 'i64')} {ABSENT})")
            return bind(p.name, v, "Term")
        # "opaque": a primitive the term language has no constructor for (gather, say), its operands one list
        spec = _primitives.DEFAULT if member == "opaque" else _primitives.BY_PRIM[member]
        parts: list[str] = []
        ops = list(p.operands)
        body_names = iter([p.body] if p.body else list(p.bodies) if isinstance(p.bodies, (list, tuple)) else [])
        for letter in spec.layout:
            if letter == "T":
                parts.append(walk(ops.pop(0)) if ops else qb.fresh("a"))
            elif letter == "L":
                if p.args is not None:
                    parts.append(_name_var(p.args, "TList"))
                elif ops:
                    rest = ops.pop(0)
                    parts.append(walk(rest, "TList") if isinstance(rest, Pat) else walk(rest))
                else:
                    parts.append(qb.fresh("l"))
            elif letter == "B":
                nm = next(body_names, None)
                parts.append(_name_var(nm, "Region") if nm else qb.fresh("b"))
            elif letter == "N":
                parts.append(_name_var(p.bodies, "BList") if isinstance(p.bodies, str) else qb.fresh("n"))
        parts.append(_name_var(p.params, "i64") if p.params else qb.fresh("p"))
        v = qb.fresh("t")
        qb.atoms.append(f"(= {v} ({spec.ctor} {' '.join(parts)}))")
        return bind(p.name, v, "Term")

    def _name_var(name: str, sort: str) -> str:
        if name in binds:
            if binds[name][1] != sort:
                raise PatternError(f"name {name!r} is bound both as {binds[name][1]} and {sort}")
            return binds[name][0]
        v = _egg_var(name)
        binds[name] = (v, sort)
        return v

    try:
        root = walk(pat)
    finally:
        del walk  # a recursive closure is a reference cycle
    return Query(qb.atoms, root, [(v, s) for _, (v, s) in binds.items()]), list(binds)
