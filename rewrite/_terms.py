"""The term language: how a jaxpr is spelled inside the e-graph.

This module is only data. It names one egglog constructor per supported JAX
primitive, says how each constructor lays out its operands, and generates the
egglog declarations (sorts, constructors, fact relations and the rules that
derive facts). The loader, the saturation loop, the extractor and the emitter
all read this table; none of them hard-codes a primitive.

Every operation constructor ends in an ``i64`` that names its parameters
(``P``): an id into :data:`rewrite._intern.PARAMS`, which holds the primitive
object and its params dict. Two equations are the same e-node exactly when
their constructor, operand classes and params id agree, so common
subexpressions merge on insertion. Shapes and dtypes live on the Python side,
one abstract value per e-class, set when a node is inserted.

Layout letters: ``T`` is one ``Term`` operand, ``L`` a ``TList`` of operands,
``B`` one ``Region`` (a body, built by the ``Body`` constructor), ``N`` a ``BList`` of them.
"""

from __future__ import annotations

import dataclasses

#: Cost/semantic families, used by the cost model and by rule compilation.
ELEMENTWISE = "elementwise"   # cheap pointwise arithmetic; fuses
TRANSCENDENTAL = "transcendental"  # pointwise, but costs much more than a flop
LAYOUT = "layout"             # broadcast/reshape/squeeze/convert: metadata or fused copies
TRANSPOSE = "transpose"
REDUCE = "reduce"
CONTRACT = "contract"         # dot_general
INDEX = "index"               # slices, concatenation, iota, padding
NESTED = "nested"             # owns bodies: scan, while, cond, jit, shard_map
OPAQUE = "opaque"
SPECIAL = "special"           # names, literals, params, lists: not operations


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """How one JAX primitive is represented as an egglog constructor."""

    prim: str
    ctor: str
    layout: str
    family: str
    #: The primitive's own params, with these keys removed, are what ``P`` names.
    #: Nested primitives keep their bodies as e-graph children instead.
    body_params: tuple[str, ...] = ()

    @property
    def arg_sorts(self) -> tuple[str, ...]:
        return tuple(_LAYOUT_SORT[c] for c in self.layout) + ("i64",)


_LAYOUT_SORT = {"T": "Term", "L": "TList", "B": "Region", "N": "BList"}


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace("-", "_").split("_"))


def _specs(names: str, layout: str, family: str) -> list[OpSpec]:
    return [OpSpec(n, _camel(n), layout, family) for n in names.split()]


_UNARY = """neg abs sign floor ceil round is_finite not square integer_pow real imag conj
population_count clz reduce_precision copy convert_element_type"""
_UNARY_TRANSCENDENTAL = """sin cos tan asin acos atan sinh cosh tanh asinh acosh atanh exp exp2 log
log1p expm1 logistic sqrt rsqrt cbrt erf erfc erf_inv lgamma digamma bessel_i0e bessel_i1e"""
_BINARY = """add sub mul div rem max min and or xor eq ne lt le gt ge shift_left
shift_right_arithmetic shift_right_logical add_any nextafter complex"""
_BINARY_TRANSCENDENTAL = "pow atan2 igamma igammac zeta"
_LAYOUT_OPS = "broadcast_in_dim reshape squeeze rev"
_REDUCE = "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin"

SPECS: tuple[OpSpec, ...] = tuple(
    _specs(_UNARY, "T", ELEMENTWISE)
    + _specs(_UNARY_TRANSCENDENTAL, "T", TRANSCENDENTAL)
    + _specs(_BINARY, "TT", ELEMENTWISE)
    + _specs(_BINARY_TRANSCENDENTAL, "TT", TRANSCENDENTAL)
    + _specs(_LAYOUT_OPS, "T", LAYOUT)
    + _specs("transpose", "T", TRANSPOSE)
    + _specs(_REDUCE, "T", REDUCE)
    + _specs("dot_general", "TT", CONTRACT)
    + _specs("clamp", "TTT", ELEMENTWISE)
    + _specs("select_n", "TL", ELEMENTWISE)
    + _specs("slice", "T", INDEX)
    + _specs("pad", "TT", INDEX)
    + _specs("concatenate", "L", INDEX)
    + _specs("iota", "", INDEX)
    + _specs("dynamic_slice", "TL", INDEX)
    + _specs("dynamic_update_slice", "TTL", INDEX)
    + [
        OpSpec("scan", "Scan", "BL", NESTED, ("jaxpr",)),
        OpSpec("while", "While", "BBL", NESTED, ("cond_jaxpr", "body_jaxpr")),
        OpSpec("cond", "Cond", "NL", NESTED, ("branches",)),
        OpSpec("jit", "Jit", "BL", NESTED, ("jaxpr",)),
        OpSpec("shard_map", "ShardMap", "BL", NESTED, ("jaxpr",)),
    ]
)

BY_PRIM: dict[str, OpSpec] = {s.prim: s for s in SPECS}
BY_CTOR: dict[str, OpSpec] = {s.ctor: s for s in SPECS}

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

#: Facts the engine derives about values. Guards read them. Each is a claim
#: about every element of a tensor, and NaN never contradicts one (a guard must
#: not make a rule unsound on NaN inputs):
#:   NonNeg  - the sign bit is clear, or NaN: +0.0, positive, +inf.
#:   Pos     - at least the smallest normal number, or +inf, or NaN.
#:   NonZero - magnitude at least the smallest normal number, or infinite, or NaN.
#: Pos and NonZero exclude subnormals because XLA:CPU flushes them to zero: on
#: that backend 1e-45 + 0 is 0, so a subnormal cannot be relied on to be nonzero.
FACTS = ("NonNeg", "Pos", "NonZero")

#: The rules that derive facts, in egglog syntax. Every one is sound under the
#: definitions above for all floating inputs including -0.0, +-inf and NaN;
#: tests/test_facts.py checks each on random inputs. Underflow is why products
#: and quotients never derive Pos or NonZero; ``max(+0.0, -0.0)`` may be -0.0 on
#: some backends, so max derives NonNeg only from two NonNeg operands; and
#: reduce_max over an empty axis is -inf, so it derives nothing.
FACT_RULES = r"""
(rule ((Pos x)) ((NonNeg x) (NonZero x)) :ruleset facts :name "pos-implies")
(rule ((= e (Abs x p))) ((NonNeg e)) :ruleset facts :name "abs-nonneg")
(rule ((= e (Abs x p)) (NonZero x)) ((Pos e)) :ruleset facts :name "abs-pos")
(rule ((= e (Square x p))) ((NonNeg e)) :ruleset facts :name "square-nonneg")
(rule ((= e (Mul x x p))) ((NonNeg e)) :ruleset facts :name "self-mul-nonneg")
(rule ((= e (Exp x p))) ((NonNeg e)) :ruleset facts :name "exp-nonneg")
(rule ((= e (Exp2 x p))) ((NonNeg e)) :ruleset facts :name "exp2-nonneg")
(rule ((= e (Logistic x p))) ((NonNeg e)) :ruleset facts :name "logistic-nonneg")
(rule ((= e (Cosh x p))) ((Pos e)) :ruleset facts :name "cosh-pos")
(rule ((= e (Sqrt x p)) (NonNeg x)) ((NonNeg e)) :ruleset facts :name "sqrt-nonneg")
(rule ((= e (Sqrt x p)) (Pos x)) ((Pos e)) :ruleset facts :name "sqrt-pos")
(rule ((= e (Rsqrt x p)) (NonNeg x)) ((NonNeg e)) :ruleset facts :name "rsqrt-nonneg")
(rule ((= e (Add a b p)) (NonNeg a) (NonNeg b)) ((NonNeg e)) :ruleset facts :name "add-nonneg")
(rule ((= e (Add a b p)) (Pos a) (NonNeg b)) ((Pos e)) :ruleset facts :name "add-pos-l")
(rule ((= e (Add a b p)) (NonNeg a) (Pos b)) ((Pos e)) :ruleset facts :name "add-pos-r")
(rule ((= e (Mul a b p)) (NonNeg a) (NonNeg b)) ((NonNeg e)) :ruleset facts :name "mul-nonneg")
(rule ((= e (Div a b p)) (NonNeg a) (NonNeg b)) ((NonNeg e)) :ruleset facts :name "div-nonneg")
(rule ((= e (Max a b p)) (NonNeg a) (NonNeg b)) ((NonNeg e)) :ruleset facts :name "max-nonneg")
(rule ((= e (Max a b p)) (Pos a)) ((Pos e)) :ruleset facts :name "max-pos-l")
(rule ((= e (Max a b p)) (Pos b)) ((Pos e)) :ruleset facts :name "max-pos-r")
(rule ((= e (Min a b p)) (Pos a) (Pos b)) ((Pos e)) :ruleset facts :name "min-pos")
(rule ((= e (Min a b p)) (NonNeg a) (NonNeg b)) ((NonNeg e)) :ruleset facts :name "min-nonneg")
(rule ((= e (ReduceSum x p)) (NonNeg x)) ((NonNeg e)) :ruleset facts :name "sum-nonneg")
(rule ((= e (ReduceMin x p)) (NonNeg x)) ((NonNeg e)) :ruleset facts :name "rmin-nonneg")
(rule ((= e (ReduceMin x p)) (Pos x)) ((Pos e)) :ruleset facts :name "rmin-pos")
(rule ((= e (BroadcastInDim x p)) (NonNeg x)) ((NonNeg e)) :ruleset facts :name "bcast-nonneg")
(rule ((= e (BroadcastInDim x p)) (Pos x)) ((Pos e)) :ruleset facts :name "bcast-pos")
(rule ((= e (BroadcastInDim x p)) (NonZero x)) ((NonZero e)) :ruleset facts :name "bcast-nonzero")
(rule ((= e (Reshape x p)) (NonNeg x)) ((NonNeg e)) :ruleset facts :name "reshape-nonneg")
(rule ((= e (Reshape x p)) (Pos x)) ((Pos e)) :ruleset facts :name "reshape-pos")
(rule ((= e (Reshape x p)) (NonZero x)) ((NonZero e)) :ruleset facts :name "reshape-nonzero")
(rule ((= e (Transpose x p)) (NonNeg x)) ((NonNeg e)) :ruleset facts :name "transpose-nonneg")
(rule ((= e (Transpose x p)) (Pos x)) ((Pos e)) :ruleset facts :name "transpose-pos")
(rule ((= e (Transpose x p)) (NonZero x)) ((NonZero e)) :ruleset facts :name "transpose-nonzero")
(rule ((= e (Squeeze x p)) (NonNeg x)) ((NonNeg e)) :ruleset facts :name "squeeze-nonneg")
(rule ((= e (Squeeze x p)) (Pos x)) ((Pos e)) :ruleset facts :name "squeeze-pos")
(rule ((= e (Squeeze x p)) (NonZero x)) ((NonZero e)) :ruleset facts :name "squeeze-nonzero")
(rule ((= e (Neg x p)) (NonZero x)) ((NonZero e)) :ruleset facts :name "neg-nonzero")
(rule ((= e (IntegerPow x p)) (EvenPow p)) ((NonNeg e)) :ruleset facts :name "even-pow-nonneg")
"""


def schema() -> str:
    """The egglog declarations shared by every e-graph."""
    lines = [f"(sort {s})" for s in SORTS]
    for name, args, out in STRUCTURAL:
        lines.append(f"(constructor {name} ({' '.join(args)}) {out})")
    for spec in SPECS:
        lines.append(f"(constructor {spec.ctor} ({' '.join(spec.arg_sorts)}) Term)")
    for fact in FACTS:
        lines.append(f"(relation {fact} (Term))")
    # params ids of integer_pow with an even exponent, seeded when such a node is inserted
    lines.append("(relation EvenPow (i64))")
    lines.append("(ruleset facts)")
    lines.append(FACT_RULES)
    return "\n".join(lines)


def ctor_arg_sorts(ctor: str) -> tuple[str, ...]:
    """Argument sorts of any constructor, structural or operation."""
    found = _ARG_SORTS.get(ctor)
    if found is None:
        spec = BY_CTOR.get(ctor)
        found = _ARG_SORTS[ctor] = spec.arg_sorts if spec is not None else _STRUCTURAL_ARGS[ctor]
    return found


_ARG_SORTS: dict[str, tuple[str, ...]] = {}  # extraction asks this hundreds of thousands of times


def ctor_sort(ctor: str) -> str:
    if ctor in BY_CTOR:
        return "Term"
    return _STRUCTURAL_OUT[ctor]


_STRUCTURAL_ARGS = {name: args for name, args, _ in STRUCTURAL}
_STRUCTURAL_OUT = {name: out for name, _, out in STRUCTURAL}
EXTRACTABLE_SORTS = frozenset(SORTS)
