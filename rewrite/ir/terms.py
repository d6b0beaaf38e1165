"""The term language: how a jaxpr is spelled inside the e-graph.

This module is only data, derived from the table of primitives
(``rewrite/ir/primitives.py``: one record per primitive, which names its egglog
constructor and says how it lays out its operands). It adds the structural
constructors and generates the egglog declarations (sorts, constructors,
fact relations and the rules that derive facts). The table itself (``SPECS``,
``BY_PRIM``, ``BY_CTOR``, the families) has one home, ``rewrite.ir.primitives``.

Every operation constructor ends in an ``i64`` that names its parameters
(``P``): an id into :data:`rewrite.ir.intern.PARAMS`, which holds the primitive
object and its params dict. Two equations are the same e-node exactly when
their constructor, operand classes and params id agree, so common
subexpressions merge on insertion. Shapes and dtypes live on the Python side,
one abstract value per e-class, set when a node is inserted.

Layout letters: ``T`` is one ``Term`` operand, ``L`` a ``TList`` of operands,
``B`` one ``Region`` (a body, built by the ``Body`` constructor), ``N`` a ``BList`` of them.
"""

from __future__ import annotations

from typing import Sequence

from . import primitives as _primitives

#: Structural constructors: (name, argument sorts, result sort). They carry no
#: params id. ``V`` names an e-class for the Python side and is never extracted.
STRUCTURAL: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("V", ("i64",), "Term"),
    ("Lit", ("i64", "i64"), "Term"),      # literal value id, scalar type id
    ("Const", ("i64",), "Term"),          # content hash of a constant array
    ("Param", ("i64", "i64"), "Term"),    # scope id, input index
    ("Tok", ("i64",), "Term"),            # the effect token a scope starts with
    ("Proj", ("Term", "i64"), "Term"),    # component of a multi-result node
    ("Opaque", ("TList", "i64"), "Term"),  # any other primitive, params kept whole
    ("Effect", ("Term", "TList", "i64"), "Term"),  # effectful: token in, token is the last result
    ("TNil", (), "TList"),
    ("TCons", ("Term", "TList"), "TList"),
    ("Body", ("i64", "TList"), "Region"),  # scope id, outputs
    ("BNil", (), "BList"),
    ("BCons", ("Region", "BList"), "BList"),
)

SORTS = ("Term", "TList", "Region", "BList")

#: The structural constructors that are values with no operands, and the op a cost model sees for each.
LEAVES = {"Lit": "literal", "Const": "const", "Param": "param", "Tok": "token"}

#: Facts the engine derives about values. Guards read them. Each is a claim
#: about every element of a tensor, and NaN never contradicts one (a guard must
#: not make a rule unsound on NaN inputs):
#:   NonNeg  - the sign bit is clear, or NaN: +0.0, positive, +inf.
#:   Pos     - at least the smallest normal number, or +inf, or NaN.
#:   NonZero - magnitude at least the smallest normal number, or infinite, or NaN.
#: Pos and NonZero exclude subnormals because XLA:CPU flushes them to zero: on
#: that backend 1e-45 + 0 is 0, so a subnormal cannot be relied on to be nonzero.
FACTS = ("NonNeg", "Pos", "NonZero")

#: The rule every fact implies; the rest come from the primitives' records (``OpSpec.facts``).
_GENERIC_FACT_RULES = '(rule ((Pos x)) ((NonNeg x) (NonZero x)) :ruleset facts :name "pos-implies")'


def fact_rules() -> str:
    """The rules that derive facts, in egglog syntax, from the table (registered primitives included)."""
    return "\n".join([_GENERIC_FACT_RULES] + [r for spec in _primitives.BY_PRIM.values() if (r := spec.fact_rules())]) + "\n"


#: The fact rules of the built-in table (``fact_rules()`` is current after registrations).
FACT_RULES = fact_rules()


def param_relations() -> list[str]:
    """The relations on params ids that records seed (``OpSpec.param_facts``): ``EvenPow``, ..."""
    return list(dict.fromkeys(r for spec in _primitives.BY_PRIM.values() for r in spec.param_facts))


def schema() -> str:
    """The egglog declarations shared by every e-graph.

    Made once per state of the primitive table (every e-graph asks for it,
    and writing it takes a third of a millisecond): the key is the records
    themselves, so a primitive registered or replaced makes a new schema.
    """
    specs, made = _SCHEMA
    if len(specs) != len(_primitives.BY_PRIM) or not all(a is b for a, b in zip(specs, _primitives.BY_PRIM.values())):
        made = _schema()
        _SCHEMA[:] = [tuple(_primitives.BY_PRIM.values()), made]
    return made


_SCHEMA: list = [(), ""]  # (the records it was made from, the schema)


def _schema() -> str:
    lines = [f"(sort {s})" for s in SORTS]
    for name, args, out in STRUCTURAL:
        lines.append(f"(constructor {name} ({' '.join(args)}) {out})")
    for spec in _primitives.BY_PRIM.values():
        lines.append(f"(constructor {spec.ctor} ({' '.join(spec.arg_sorts)}) Term)")
    for fact in FACTS:
        lines.append(f"(relation {fact} (Term))")
    # relations on params ids (an even integer_pow's), seeded when such a node is inserted
    for rel in param_relations():
        lines.append(f"(relation {rel} (i64))")
    lines.append("(ruleset facts)")
    lines.append(fact_rules())
    return "\n".join(lines)


def flat_ctors() -> list[str]:
    """The ``Term`` constructors whose arguments are all ``Term`` or ``i64`` (loaded from rows: ``ir/loader.py``'s ``loader_program``)."""
    ctors = [name for name, _, out in STRUCTURAL if out == "Term" and name != "V"] + [spec.ctor for spec in _primitives.BY_PRIM.values()]
    return [c for c in dict.fromkeys(ctors) if all(s in ("Term", "i64") for s in ctor_arg_sorts(c))]


def ctor_arg_sorts(ctor: str) -> tuple[str, ...]:
    """Argument sorts of any constructor, structural or operation."""
    found = _ARG_SORTS.get(ctor)
    if found is None:
        spec = _primitives.BY_CTOR.get(ctor)
        found = _ARG_SORTS[ctor] = spec.arg_sorts if spec is not None else _STRUCTURAL_ARGS[ctor]
    return found


_ARG_SORTS = _primitives.ARG_SORTS  # extraction asks this hundreds of thousands of times; emptied when the table changes


def tlist_text(items: Sequence[str]) -> str:
    """The egglog text of a ``TList`` of the given items (``(TCons a (TCons b (TNil)))``)."""
    expr = "(TNil)"
    for item in reversed(items):
        expr = f"(TCons {item} {expr})"
    return expr


def ctor_sort(ctor: str) -> str:
    if ctor in _primitives.BY_CTOR:
        return "Term"
    return _STRUCTURAL_OUT[ctor]


_STRUCTURAL_ARGS = {name: args for name, args, _ in STRUCTURAL}
_STRUCTURAL_OUT = {name: out for name, _, out in STRUCTURAL}
EXTRACTABLE_SORTS = frozenset(SORTS)
