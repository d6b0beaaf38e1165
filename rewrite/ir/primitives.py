"""The table of primitives: everything the rewriter knows about one JAX primitive, in one record.

JAX's interpreters keep a table per transformation, keyed by primitive
(``ad.primitive_jvps``, ``batching.primitive_batchers``, ...). Here the
transformations are the rewriter's stages, and one :class:`OpSpec` per
primitive holds what each of them needs:

* the term language (``rewrite/ir/terms.py``): the egglog constructor, named
  from the primitive (``reduce_sum`` becomes ``ReduceSum``), and its operand
  *layout*;
* its *family* (how rules and the cost model treat it) and its *groups*
  (:data:`GROUPS`: all comparisons, all binary arithmetic, ... for rules
  that stand for a group of operations);
* what XLA:CPU's fusion passes do with it (``rewrite/cost/fusion.py``);
* the facts it implies (``NonNeg``, ``Pos``, ``NonZero``), and facts about
  its params (``EvenPow`` for ``integer_pow``);
* for a primitive with bodies (scan, while, cond, jit, shard_map): how its
  bodies are loaded, emitted and priced, as three hooks.

A primitive missing from the table gets :data:`DEFAULT`: an ``Opaque`` node
that keeps its params whole and comes back unchanged. Adding a primitive,
one with bodies included, is one entry in :data:`SPECS` below, or a call to
:func:`register_primitive` from user code:

>>> from rewrite import OpSpec, register_primitive, GROUPS
>>> "lt" in GROUPS["comparison"], "reduce_max" in GROUPS["reduction"]
(True, True)
>>> spec = OpSpec("my_erfcx", "T", "transcendental", groups=("unary_transcendental",))
>>> spec.ctor, spec.arg_sorts
('MyErfcx', ('Term', 'i64'))

This module imports nothing else of the rewriter: every stage reads it, and
the hooks receive what they need from the stage that calls them.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import jax.numpy as jnp

from . import loopstep as _loopstep
from .scanread import in_place_carries as _in_place_carries, moved_per_trip as _moved_per_trip
from .scanread import sliced_consts as _sliced_consts
from .softmax import plain_call as _plain_call
from .jaxapi import UnspecifiedValue, core, laid_out_mark, params_for_jax, scan_counts, scan_kept

#: Families: how the cost model prices a primitive, and whether its params are wildcards in patterns.
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
FAMILIES = (ELEMENTWISE, TRANSCENDENTAL, LAYOUT, TRANSPOSE, REDUCE, CONTRACT, INDEX, NESTED, OPAQUE)

#: What XLA does with an operation of each family when it fuses a program (``rewrite/cost/fusion.py``):
#: ``loop`` operations are computed inside elementwise loops, ``reduce`` ones are reductions, and
#: ``other`` ones (dots, loops, calls) are kernels of their own.
FUSION_KIND = {ELEMENTWISE: "loop", TRANSCENDENTAL: "loop", LAYOUT: "loop", TRANSPOSE: "loop", INDEX: "loop",
               REDUCE: "reduce", CONTRACT: "other", NESTED: "other", OPAQUE: "other"}

_LAYOUT_SORT = {"T": "Term", "L": "TList", "B": "Region", "N": "BList"}


class Unsupported(Exception):
    """A jaxpr construct a builder cannot express (patterns reject bodies, say); a load hook that raises
    it makes the equation an opaque node."""


class Fact(NamedTuple):
    """A fact rule: the primitive's result has fact ``then`` when every premise in ``when`` holds.

    Operands are named ``x`` (one operand) or ``a b`` (two), the params id ``p``
    and the result ``e``; ``term`` overrides the matched term (``(Mul x x p)``).
    """

    name: str
    then: str
    when: str = ""
    term: str | None = None


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What a cost model sees of one e-node.

    ``op`` is the primitive name (``"sin"``, ``"scan"``, ...), or one of
    ``"literal"``, ``"const"``, ``"param"``, ``"token"``, ``"proj"`` for
    structural nodes. For ``"proj"``, ``of`` is the projected node's op,
    ``params`` its params, and ``index`` which result is taken. For nodes with
    bodies (scan, while, cond, jit, shard_map), ``body_costs`` holds the cost of
    one execution of each body. A cost model's node price is a function of it
    (see :class:`rewrite.CostModel`):

    >>> import jax.numpy as jnp
    >>> from jax.core import ShapedArray
    >>> from rewrite import AnalyticCost, NodeInfo
    >>> class AddsAreRuinous(AnalyticCost):
    ...     def __call__(self, node):
    ...         return 1e9 if node.op == "add" else super().__call__(node)
    >>> v = ShapedArray((8,), jnp.float32)
    >>> AddsAreRuinous(fusion=False)(NodeInfo("add", "elementwise", {}, (v, v), (v,)))
    1000000000.0
    """

    op: str
    family: str
    params: Mapping[str, Any]
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    body_costs: tuple[float, ...] = ()
    index: int | None = None
    of: str | None = None


Flag = bool | Callable[[Mapping[str, Any], Sequence[Any]], bool]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One primitive: how it is spelled in the e-graph, how each stage treats it.

    ``prim`` is JAX's primitive name. ``layout`` says how the constructor takes
    its operands: ``T`` one term, ``L`` a list of terms (the rest of the
    operands), ``B`` a body, ``N`` a list of bodies; ``"TT"`` is a binary
    operation, ``select_n`` is ``"TL"``. ``family`` is one of :data:`FAMILIES`;
    ``groups`` adds the primitive to groups of :data:`GROUPS` beyond the ones
    derived from its family and arity.

    Fusion (what XLA:CPU does with it; ``rewrite/cost/fusion.py``): ``cheap`` (XLA's
    ``IsExpensive`` is false and its price is below what can be measured: one
    ``flop``), ``expensive`` (XLA will not duplicate it into two loops),
    ``free`` (a view: no arithmetic per element), ``library`` (a library
    reduction absorbs it), ``library_reduction`` (a floating reduction of it
    over many elements becomes a library call: XLA's YNN fusion), ``unrolled``
    (it is lowered to cheap arithmetic: its multiplications and divisions per
    element, from its params). A flag is a bool or a function of the params
    and result avals.

    Facts: ``facts`` (:class:`Fact` rules about its result), ``param_facts``
    (relations on its params id, seeded when a node is inserted, that fact
    rules may test: ``EvenPow`` for an even ``integer_pow``).

    Hooks, for primitives with bodies (``body_params`` names the params that
    hold them, which become e-graph children instead of params):

    * ``load(ld)``: builds the node from the equation through the loader's
      context ``ld`` (``rewrite/jaxpr/load.py``: ``ld.eqn``, ``ld.closed_body``,
      ``ld.body``, ``ld.blist``, ``ld.nested``, ``ld.inline``); returns its
      output refs, or ``None`` for the generic node. Raising
      :class:`Unsupported` keeps the equation whole, as an opaque node.
    * ``emit(em, params, bodies, n_out, n_in)``: the params of the emitted
      equation, its bodies rebuilt with ``em.body(cls, order, closed=...)``
      (``rewrite/jaxpr/emit.py``; ``em.checkpointed`` wraps a scan body in
      ``jax.checkpoint``); ``bodies`` has one entry per ``B`` (a class) or
      ``N`` (a list of classes) of the layout.
    * ``price(model, node)``: the node's price under :class:`rewrite.AnalyticCost`
      ``model`` (without its fixed ``node`` charge), from ``node.body_costs``.
    * ``stacks(params, index)``: whether result ``index`` is an array the node
      writes step by step (a scan's stacked outputs), which the cost model
      charges as written.
    * ``loop_step(loop, node, v, axis, step)``: step ``t`` of the node's value
      ``v``, stacked along ``axis``, built inside a loop body, for
      :meth:`rewrite.loops.Loop.per_step` (``rewrite/ir/loopstep.py`` says
      how, and has the built-in ones); ``None`` where the work cannot move
      into a loop. Elementwise records get the pointwise one by default.
    """

    prim: str
    layout: str
    family: str
    groups: tuple[str, ...] = ()
    ctor: str = ""
    body_params: tuple[str, ...] = ()
    cheap: bool = False
    expensive: Flag = False
    free: bool = False
    library: Flag = False
    library_reduction: bool = False
    unrolled: Callable[[Mapping[str, Any]], tuple[int, int]] | None = None
    facts: tuple[Fact, ...] = ()
    param_facts: Mapping[str, Callable[[Mapping[str, Any]], bool]] = dataclasses.field(default_factory=dict)
    load: Callable[[Any], Any] | None = None
    emit: Callable[..., dict] | None = None
    price: Callable[[Any, NodeInfo], float] | None = None
    stacks: Callable[[Mapping[str, Any], int], bool] | None = None
    loop_step: Callable[..., Any] | None = None
    #: ``loop``, ``reduce`` or ``other``; by default its family's (:data:`FUSION_KIND`)
    fusion: str = ""
    #: A nested call XLA inlines (``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``): the fusion
    #: model fuses it as its body's operations, an elementwise call like an elementwise operation.
    inlined: bool = False
    #: Its two operands commute exactly (``add``, ``mul``): a pattern over it matches either operand order
    #: (``rules/pattern.py``'s ``commuted``), so no rule has to store the other order, and a fact rule merges the
    #: classes of ``a op b`` and ``b op a`` where both are in the e-graph (common subexpressions).
    commutative: bool = False

    def __post_init__(self) -> None:
        if not self.ctor:
            object.__setattr__(self, "ctor", _camel(self.prim))
        if not self.fusion:
            object.__setattr__(self, "fusion", FUSION_KIND.get(self.family, "other"))
        if self.loop_step is None and self.family in (ELEMENTWISE, TRANSCENDENTAL):
            object.__setattr__(self, "loop_step", _loopstep.pointwise_step)

    @property
    def arg_sorts(self) -> tuple[str, ...]:
        return tuple(_LAYOUT_SORT[c] for c in self.layout) + ("i64",)

    def is_expensive(self, params: Mapping[str, Any], out_avals: Sequence[Any]) -> bool:
        return _flag(self.expensive, params, out_avals)

    def library_absorbs(self, params: Mapping[str, Any], out_avals: Sequence[Any]) -> bool:
        return _flag(self.library, params, out_avals)

    def fact_rules(self) -> str:
        """This primitive's fact rules, in egglog syntax."""
        operands = {"T": "x", "TT": "a b"}.get(self.layout, "x")
        lines = []
        for f in self.facts:
            term = f.term or f"({self.ctor} {operands} p)"
            when = " ".join([f"(= e {term})"] + ([f.when] if f.when else []))
            lines.append(f'(rule ({when}) (({f.then} e)) :ruleset facts :name "{f.name}")')
        if self.commutative and self.layout == "TT":
            lines.append(f'(rule ((= e ({self.ctor} a b p)) (= f ({self.ctor} b a p))) ((union e f)) '
                         f':ruleset facts :name "{self.prim}-commuted")')
        return "\n".join(lines)


def _flag(flag: Flag, params: Mapping[str, Any], out_avals: Sequence[Any]) -> bool:
    return bool(flag(params, out_avals)) if callable(flag) else flag


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace("-", "_").split("_"))


#: The record of a primitive the table does not know: an ``Opaque`` node over a list of operands.
DEFAULT = OpSpec("", "L", OPAQUE, ctor="Opaque")


# ---------------------------------------------------------------------- helpers the hooks use
def size(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    return 0 if shape is None else int(math.prod(shape))


def nbytes(aval: Any) -> int:
    """The bytes ``aval`` holds; 0 where its dtype has no size this can find (it is then priced as opaque)."""
    dtype = getattr(aval, "dtype", None)
    return 0 if dtype is None else size(aval) * itemsize(dtype)


def itemsize(dtype: Any) -> int:
    """Bytes per element. An extended dtype (a PRNG key, a user's element type) may carry its own
    ``itemsize``; one that does not is sized by its physical representation (``uint32[2]`` for a
    threefry key), and one whose representation is unknown counts 0."""
    size_ = getattr(dtype, "itemsize", None)
    if isinstance(size_, int):
        return size_
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        pass
    try:
        physical = dtype._rules.physical_element_aval(dtype)  # jax's extended-dtype protocol
        return int(math.prod(physical.shape)) * itemsize(physical.dtype)
    except Exception:
        return 0


def is_inexact_dtype(dtype: Any) -> bool:
    """Is ``dtype`` a real or complex floating type, the ml_dtypes (bfloat16, float8_*) included?

    numpy's issubdtype against its inexact kind is False for bfloat16 and the float8
    types (numpy does not know them as floating), and a derivative that
    skipped them was silently zero; ``jnp.issubdtype`` knows them. Extended
    dtypes (PRNG keys) and ``float0`` are not inexact.
    """
    try:
        return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:
        return False


def is_float(aval: Any) -> bool:
    """Does ``aval`` hold real or complex floats (a value a derivative flows through)?"""
    return is_inexact_dtype(getattr(aval, "dtype", None))


def inner_jaxpr(params: Mapping[str, Any]) -> Any:
    """The jaxpr a call-like primitive (``custom_jvp_call``, ``custom_vjp_call``, ``remat``) evaluates, if any."""
    for k in ("call_jaxpr", "jaxpr", "fun_jaxpr"):
        j = params.get(k)
        if j is not None and hasattr(j, "eqns" if not hasattr(j, "jaxpr") else "jaxpr"):
            return j.jaxpr if hasattr(j, "jaxpr") else j
    return None


# ---------------------------------------------------------------------- elementwise records
def _integer_pow_muls(params: Mapping[str, Any]) -> tuple[int, int]:
    """``x ** y`` by repeated squaring, as jax lowers it: its multiplications, and one division when ``y`` is
    negative (``x ** 1`` is ``x`` itself and ``x ** 0`` a constant one: no multiplication)."""
    y = params.get("y", 2)
    n = abs(int(y))
    if n == 0:
        return 0, 0
    return n.bit_length() - 1 + bin(n).count("1") - 1, 1 if y < 0 else 0


def _float_result(params: Mapping[str, Any], out_avals: Sequence[Any]) -> bool:
    return is_float(out_avals[0])


_EXTRA: dict[str, dict[str, Any]] = {}


def _add(names: str, **attrs: Any) -> None:
    """Set ``attrs`` on the records of ``names`` (facts accumulate)."""
    for n in names.split():
        _EXTRA[n] = _merge(_EXTRA.get(n, {}), attrs)


def _merge(*dicts: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = tuple(out.get(k, ())) + tuple(v) if k in ("facts", "groups") else v
    return out


# XLA's cheap elementwise operations (IsExpensive is false, for reals)
_add("""add sub mul neg max min abs sign floor ceil round select_n clamp and or xor not eq ne lt le gt ge square
     copy convert_element_type shift_left shift_right_arithmetic shift_right_logical add_any is_finite""", cheap=True)
# IEEE addition and multiplication commute exactly (NaN payloads aside, which JAX does not define)
_add("add mul", commutative=True)
# XLA's IsExpensive: never duplicated into two loops
_add("""exp exp2 expm1 log log1p logistic tanh sqrt rsqrt cbrt pow atan2 erf erfc erf_inv lgamma digamma igamma
     igammac zeta sinh cosh asin acos atan asinh acosh atanh bessel_i0e bessel_i1e""", expensive=True)
_add("div rem", expensive=_float_result)
_add("integer_pow", unrolled=_integer_pow_muls, expensive=lambda p, o: p.get("y", 2) < 0,
     library=lambda p, o: p.get("y", 2) > 0, param_facts={"EvenPow": lambda p: p.get("y", 1) % 2 == 0})
# views: no arithmetic per element
_add("broadcast_in_dim reshape squeeze convert_element_type copy iota", free=True)
# what a library (YNN) reduction fusion absorbs from its producers; the reductions that can be one.
# (jax lowers ``square`` to HLO's ``multiply``: the compiled fusion holds ``multiply(x, x)``)
_add("add sub mul neg max min square broadcast_in_dim reshape squeeze convert_element_type", library=True)
_add("reduce_sum reduce_max reduce_min", library_reduction=True)
# what moves into a loop body step by step (rewrite/ir/loopstep.py): views, products, slices, reductions
for _p in "slice broadcast_in_dim transpose reshape squeeze dot_general".split():
    _add(_p, loop_step=getattr(_loopstep, f"{_p}_step"))
_add("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or", loop_step=_loopstep.reduce_step)
# Facts. Every one is sound under the definitions in rewrite/ir/terms.py for all floating inputs
# including -0.0, +-inf and NaN; tests/test_facts.py checks each on random inputs. Underflow is
# why products and quotients never derive Pos or NonZero; max(+0.0, -0.0) may be -0.0 on some
# backends, so max derives NonNeg only from two NonNeg operands; and reduce_max over an empty
# axis is -inf, so it derives nothing.
_add("abs", facts=(Fact("abs-nonneg", "NonNeg"), Fact("abs-pos", "Pos", "(NonZero x)")))
_add("square", facts=(Fact("square-nonneg", "NonNeg"),))
_add("mul", facts=(Fact("self-mul-nonneg", "NonNeg", term="(Mul x x p)"),))
_add("exp", facts=(Fact("exp-nonneg", "NonNeg"),))
_add("exp2", facts=(Fact("exp2-nonneg", "NonNeg"),))
_add("logistic", facts=(Fact("logistic-nonneg", "NonNeg"),))
_add("cosh", facts=(Fact("cosh-pos", "Pos"),))
_add("sqrt", facts=(Fact("sqrt-nonneg", "NonNeg", "(NonNeg x)"), Fact("sqrt-pos", "Pos", "(Pos x)")))
_add("rsqrt", facts=(Fact("rsqrt-nonneg", "NonNeg", "(NonNeg x)"),))
_add("add", facts=(Fact("add-nonneg", "NonNeg", "(NonNeg a) (NonNeg b)"),
                   Fact("add-pos-l", "Pos", "(Pos a) (NonNeg b)"), Fact("add-pos-r", "Pos", "(NonNeg a) (Pos b)")))
_add("mul", facts=(Fact("mul-nonneg", "NonNeg", "(NonNeg a) (NonNeg b)"),))
_add("div", facts=(Fact("div-nonneg", "NonNeg", "(NonNeg a) (NonNeg b)"),))
_add("max", facts=(Fact("max-nonneg", "NonNeg", "(NonNeg a) (NonNeg b)"), Fact("max-pos-l", "Pos", "(Pos a)"),
                   Fact("max-pos-r", "Pos", "(Pos b)")))
_add("min", facts=(Fact("min-pos", "Pos", "(Pos a) (Pos b)"), Fact("min-nonneg", "NonNeg", "(NonNeg a) (NonNeg b)")))
_add("reduce_sum", facts=(Fact("sum-nonneg", "NonNeg", "(NonNeg x)"),))
_add("reduce_min", facts=(Fact("rmin-nonneg", "NonNeg", "(NonNeg x)"), Fact("rmin-pos", "Pos", "(Pos x)")))
_add("neg", facts=(Fact("neg-nonzero", "NonZero", "(NonZero x)"),))
_add("integer_pow", facts=(Fact("even-pow-nonneg", "NonNeg", "(EvenPow p)"),))
# A view keeps every fact of its operand.
for _p, _short in (("broadcast_in_dim", "bcast"), ("reshape", "reshape"), ("transpose", "transpose"),
                   ("squeeze", "squeeze")):
    _add(_p, facts=tuple(Fact(f"{_short}-{suffix}", fact, f"({fact} x)")
                         for suffix, fact in (("nonneg", "NonNeg"), ("pos", "Pos"), ("nonzero", "NonZero"))))


def _row(names: str, layout: str, family: str, *groups: str) -> list[OpSpec]:
    out = []
    for n in names.split():
        extra = _merge({"groups": groups}, _EXTRA.get(n, {}))
        out.append(OpSpec(n, layout, family, **extra))
    return out


# ---------------------------------------------------------------------- nested records: the hooks
def _scan_load(ld: Any) -> list[Any]:
    p = ld.eqn.params  # _rw_* params are annotations the emitter drops. _rw_order: the body's Params in jaxpr order
    # (a rule adding a carry appends a Param and inserts its index); _rw_sliced, _rw_inplace: rewrite/ir/scanread.py;
    nc, ncarry = scan_counts(p)  # _rw_laid_out: a loop a pack's kernel wrote (jaxapi.laid_out_mark)
    return ld.nested([ld.closed_body(p["jaxpr"])], {"_rw_order": tuple(range(len(p["jaxpr"].in_avals))),
                     **laid_out_mark(ld.eqn), "_rw_sliced": _sliced_consts(p["jaxpr"], nc),
                     "_rw_inplace": _in_place_carries(p["jaxpr"], nc, ncarry)}, params=scan_kept(p))


def _scan_emit(em: Any, params: dict, bodies: list, n_out: int, n_in: int) -> dict:
    order = params.pop("_rw_order")
    params["jaxpr"] = em.body(bodies[0], order, closed=True)
    if params.get("_rw_remat"):
        params["jaxpr"] = em.checkpointed(params["jaxpr"], params["num_carry"], params["num_consts"],
                                          params["_rw_remat"])
    return params_for_jax("scan", params)


def _scan_price(m: Any, n: NodeInfo) -> float:
    moved = _moved_per_trip(n.params, n.in_avals, n.out_avals)
    return n.params.get("length", 1) * (n.body_costs[0] + m.iteration + m.byte * sum(nbytes(a) for a in moved))


def _while_load(ld: Any) -> list[Any]:
    cond = ld.closed_body(ld.eqn.params["cond_jaxpr"])
    body = ld.closed_body(ld.eqn.params["body_jaxpr"])
    return ld.nested([cond, body])


def _while_emit(em: Any, params: dict, bodies: list, n_out: int, n_in: int) -> dict:
    params["cond_jaxpr"] = em.body(bodies[0], tuple(range(params["cond_nconsts"] + n_out)), closed=True)
    params["body_jaxpr"] = em.body(bodies[1], tuple(range(params["body_nconsts"] + n_out)), closed=True)
    return params


def _cond_load(ld: Any) -> list[Any]:
    return ld.nested([ld.blist([ld.closed_body(br) for br in ld.eqn.params["branches"]])])


def _cond_emit(em: Any, params: dict, bodies: list, n_out: int, n_in: int) -> dict:
    order = tuple(range(n_in - 1))
    params["branches"] = tuple(em.body(b, order, closed=True) for b in bodies[0])
    return params


def _transparent_jit(params: Mapping[str, Any]) -> bool:
    """A nested ``jit`` that only groups equations: no shardings, layouts, donation or compiler options.

    Inlining it keeps the program's meaning and lets rules see through helpers
    such as ``jnp.where`` and ``jnp.clip``, which ``jax.numpy`` wraps in ``jit``.
    """
    return (all(isinstance(s, UnspecifiedValue) for s in params.get("in_shardings", ()))
            and all(isinstance(s, UnspecifiedValue) for s in params.get("out_shardings", ()))
            and all(l is None for l in params.get("in_layouts", ()))
            and all(l is None for l in params.get("out_layouts", ()))
            and not any(params.get("donated_invars", ()))
            and not params.get("compiler_options_kvs"))


def _jit_load(ld: Any) -> list[Any]:
    if _transparent_jit(ld.eqn.params):
        return ld.inline(ld.eqn.params["jaxpr"])
    return ld.nested([ld.closed_body(ld.eqn.params["jaxpr"])])


def _call_emit(em: Any, params: dict, bodies: list, n_out: int, n_in: int) -> dict:
    params["jaxpr"] = em.body(bodies[0], tuple(range(n_in)), closed=True)
    return params


def _shard_map_load(ld: Any) -> list[Any]:
    jaxpr = ld.eqn.params["jaxpr"]
    if jaxpr.constvars:
        raise Unsupported("shard_map body with constants")
    return ld.nested([ld.body(jaxpr, (), [v.aval for v in jaxpr.invars])])


def _shard_map_emit(em: Any, params: dict, bodies: list, n_out: int, n_in: int) -> dict:
    params["jaxpr"] = em.body(bodies[0], tuple(range(n_in)), closed=False)
    return params


def _custom_load(ld: Any) -> list[Any]:
    # The derivative rule (``jvp_jaxpr_fun``, ``fwd_jaxpr_thunk``, ``bwd``) stays in the params, so ``jax.grad`` of
    # the rewritten program uses it; the body's debug info names the call in printed jaxprs, kept for the emitter.
    # JAX's own softmax and log-sum-exp, custom_jvp_calls from jax 0.12.1 on, are read plain (``ir/softmax.py``).
    closed, plain = ld.eqn.params["call_jaxpr"], _plain_call(ld.eqn)
    return ld.inline(plain) if plain is not None else ld.nested([ld.closed_body(closed)],
                                                                {"_rw_debug": closed.jaxpr.debug_info})


def _custom_emit(em: Any, params: dict, bodies: list, n_out: int, n_in: int) -> dict:
    body = em.body(bodies[0], tuple(range(n_in)), closed=True)
    debug = params.get("_rw_debug")
    params["call_jaxpr"] = body if debug is None else body.replace(jaxpr=body.jaxpr.replace(debug_info=debug))
    return params


def _checkpoint_load(ld: Any) -> list[Any]:
    jaxpr = ld.eqn.params["jaxpr"]
    if jaxpr.constvars or jaxpr.effects:
        raise Unsupported("checkpoint body with constants or effects")
    outs = ld.nested([ld.body(jaxpr, (), [v.aval for v in jaxpr.invars])], {"_rw_debug": jaxpr.debug_info})
    # A result that is an input of the body is that operand: checkpointing changes what is saved, not what is computed.
    # (A backward loop's body often hands a cotangent on this way; read as the operand, its rules see the carry kept.)
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    return [ld.args[position[v]] if isinstance(v, core.Var) and v in position else out
            for v, out in zip(jaxpr.outvars, outs)]


def _checkpoint_emit(em: Any, params: dict, bodies: list, n_out: int, n_in: int) -> dict:
    body = em.body(bodies[0], tuple(range(n_in)), closed=False)
    debug = params.get("_rw_debug")
    params["jaxpr"] = body if debug is None else body.replace(debug_info=debug)
    return params


def _convert_load(ld: Any) -> list[Any] | None:
    """``convert_element_type`` of a literal that only drops weak typing: fold it into the literal."""
    eqn = ld.eqn
    x, out = eqn.invars[0], eqn.outvars[0].aval
    if (isinstance(x, core.Literal) and x.aval.dtype == out.dtype and x.aval.shape == out.shape == ()
            and eqn.params.get("sharding") is None):
        return [ld.literal(np.asarray(x.val, dtype=out.dtype), out)]
    return None


_add("convert_element_type", load=_convert_load)

_UNARY = """neg abs sign floor ceil round is_finite not square integer_pow real imag conj
population_count clz reduce_precision copy convert_element_type"""
_UNARY_TRANSCENDENTAL = """sin cos tan asin acos atan sinh cosh tanh asinh acosh atanh exp exp2 log
log1p expm1 logistic sqrt rsqrt cbrt erf erfc erf_inv lgamma digamma bessel_i0e bessel_i1e"""
_BINARY = """add sub mul div rem max min and or xor eq ne lt le gt ge shift_left
shift_right_arithmetic shift_right_logical add_any nextafter complex"""
_BINARY_TRANSCENDENTAL = "pow atan2 igamma igammac zeta"

#: The built-in table. Adding a primitive is one entry here (or :func:`register_primitive`).
SPECS: tuple[OpSpec, ...] = tuple(
    _row(_UNARY, "T", ELEMENTWISE)
    + _row(_UNARY_TRANSCENDENTAL, "T", TRANSCENDENTAL)
    + _row(_BINARY, "TT", ELEMENTWISE) + _row(_BINARY_TRANSCENDENTAL, "TT", TRANSCENDENTAL)
    + _row("broadcast_in_dim reshape squeeze rev", "T", LAYOUT)
    + _row("transpose", "T", TRANSPOSE)
    + _row("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or", "T", REDUCE, "reduction")
    + _row("argmax argmin", "T", REDUCE, "arg_reduction")
    + _row("dot_general", "TT", CONTRACT)
    + _row("clamp", "TTT", ELEMENTWISE)
    + _row("select_n", "TL", ELEMENTWISE)
    + _row("slice", "T", INDEX) + _row("pad", "TT", INDEX)
    + _row("concatenate", "L", INDEX) + _row("iota", "", INDEX)
    + _row("dynamic_slice", "TL", INDEX)
    + _row("dynamic_update_slice", "TTL", INDEX)
    + [
        OpSpec("scan", "BL", NESTED, body_params=("jaxpr",), load=_scan_load, emit=_scan_emit, price=_scan_price,
               stacks=lambda p, i: i >= p.get("num_carry", 0)),
        OpSpec("while", "BBL", NESTED, body_params=("cond_jaxpr", "body_jaxpr"), load=_while_load, emit=_while_emit,
               price=lambda m, n: m.while_trips * (sum(n.body_costs) + m.iteration)),
        OpSpec("cond", "NL", NESTED, body_params=("branches",), load=_cond_load, emit=_cond_emit,
               price=lambda m, n: max(n.body_costs, default=0.0) + m.iteration),
        OpSpec("jit", "BL", NESTED, body_params=("jaxpr",), load=_jit_load, emit=_call_emit),
        OpSpec("shard_map", "BL", NESTED, body_params=("jaxpr",), load=_shard_map_load, emit=_shard_map_emit),
        # calls with a user's derivative rule, and jax.checkpoint (``remat2``): the primal body is loaded so
        # rules act there; the call costs what its body costs and fuses as its body does
        OpSpec("custom_jvp_call", "BL", NESTED, body_params=("call_jaxpr",), load=_custom_load, emit=_custom_emit,
               inlined=True),
        OpSpec("custom_vjp_call", "BL", NESTED, body_params=("call_jaxpr",), load=_custom_load, emit=_custom_emit,
               inlined=True),
        OpSpec("remat2", "BL", NESTED, ctor="Checkpoint", body_params=("jaxpr",), load=_checkpoint_load,
               emit=_checkpoint_emit, inlined=True),
    ]
)

#: Every record by primitive name and by constructor, registered ones included.
BY_PRIM: dict[str, OpSpec] = {s.prim: s for s in SPECS}
BY_CTOR: dict[str, OpSpec] = {s.ctor: s for s in SPECS}

#: Groups named by hand (beyond family and arity), for rules that stand for a group of operations.
_NAMED_GROUPS = {
    "comparison": "eq ne lt le gt ge",
    "binary_arithmetic": "add add_any sub mul div rem max min pow atan2 nextafter",
    "bitwise": "and or xor not shift_left shift_right_arithmetic shift_right_logical population_count clz",
    # arithmetic whose constant folding is exact (``ops.ARITHMETIC``) and the logical operations (``ops.BITWISE``)
    "exact_arithmetic": "add sub mul div rem max min",
    "logical": "and or xor",
}


def _groups_of(spec: OpSpec) -> set[str]:
    out = {spec.family, *spec.groups}
    if spec.family in (ELEMENTWISE, TRANSCENDENTAL):
        arity = {"T": "unary", "TT": "binary"}.get(spec.layout)
        if arity is not None:
            out.add(arity)
            out.add(f"{arity}_{spec.family}")
    out.update(g for g, names in _NAMED_GROUPS.items() if spec.prim in names.split())
    if spec.commutative and spec.layout == "TT":
        out.add("commutative")
    return out


_GROUPS: dict[str, frozenset[str]] = {}

#: Operation groups: group name -> the primitive names in it. Every family is a group
#: (``"reduce"``, ``"transcendental"``, ...), and so are ``"unary"`` and ``"binary"`` (one or two
#: operands, elementwise or transcendental), ``"unary_transcendental"``, ``"binary_elementwise"``, ...,
#: ``"comparison"``, ``"binary_arithmetic"``, ``"exact_arithmetic"``, ``"bitwise"``, ``"logical"``, ``"reduction"`` (the ``reduce_*``
#: primitives), ``"arg_reduction"`` and ``"commutative"`` (``OpSpec.commutative``). Read-only; :func:`register_primitive` keeps it current.
GROUPS: Mapping[str, frozenset[str]] = types.MappingProxyType(_GROUPS)


#: Argument sorts by constructor, as ``ir/terms.py``'s ``ctor_arg_sorts`` memoises them; state derived from the table,
#: so it is emptied whenever the table changes (a replaced record may have another layout). ``CHANGES[0]`` counts the
#: changes: the node prices ``cost/prices.py`` keeps are dropped at each (a record's hooks decide prices).
ARG_SORTS: dict[str, tuple[str, ...]] = {}
CHANGES = [0]


def _rebuild_groups() -> None:
    """Refresh what is derived from the table: the groups, and the memoised argument sorts; count the change."""
    ARG_SORTS.clear()
    CHANGES[0] += 1
    acc: dict[str, set[str]] = {}
    for spec in BY_PRIM.values():
        for g in _groups_of(spec):
            acc.setdefault(g, set()).add(spec.prim)
    _GROUPS.clear()
    _GROUPS.update({g: frozenset(ps) for g, ps in sorted(acc.items())})


_rebuild_groups()


def spec_of(prim: str) -> OpSpec:
    """The record of primitive ``prim``: its table entry, or :data:`DEFAULT` (an opaque node)."""
    return BY_PRIM.get(prim, DEFAULT)


def family_of(prim: str) -> str:
    return BY_PRIM.get(prim, DEFAULT).family


def register_primitive(spec: OpSpec, *, replace: bool = False) -> OpSpec:
    """Add ``spec`` to the table, for every e-graph made from now on. Returns it.

    Rules can then match the primitive and the cost model prices it by its
    family (or its ``price`` hook). ``replace=True`` replaces the record of a
    primitive already in the table (the constructor must keep its name).

    >>> import jax.numpy as jnp
    >>> from jax.extend.core import Primitive
    >>> from rewrite import OpSpec, Ruleset, explain, register_primitive, rule
    >>> twice_p = Primitive("doc_twice")
    >>> _ = twice_p.def_impl(lambda x: 2 * x)
    >>> _ = twice_p.def_abstract_eval(lambda x: x)
    >>> _ = register_primitive(OpSpec("doc_twice", "T", "elementwise"))
    >>> halve = rule(lambda x: twice_p.bind(x) * 0.5, lambda x: x, name="halve_twice")
    >>> explain(lambda x: twice_p.bind(x) * 0.5, jnp.ones(3), rulesets=[Ruleset("doc", [halve])]).fired
    {'halve_twice': 1}
    >>> from rewrite.ir.primitives import unregister
    >>> unregister("doc_twice")  # leave the table as the other examples expect it
    """
    if not isinstance(spec, OpSpec):
        raise TypeError(f"register_primitive takes an OpSpec, got {type(spec).__name__}")
    if not spec.prim or set(spec.layout) - set(_LAYOUT_SORT) or spec.layout.count("L") > 1:
        raise ValueError(f"{spec.prim!r}: a primitive needs a name and a layout of T, B, N and at most one L")
    if spec.family not in FAMILIES or spec.family == OPAQUE:
        raise ValueError(f"{spec.prim!r}: family must be one of {FAMILIES[:-1]}, got {spec.family!r}")
    if spec.fusion not in ("loop", "reduce", "other"):
        raise ValueError(f"{spec.prim!r}: fusion must be 'loop', 'reduce' or 'other', got {spec.fusion!r}")
    if (spec.family == NESTED) != bool(set(spec.layout) & {"B", "N"}):
        raise ValueError(f"{spec.prim!r}: a primitive has bodies (B or N in its layout) exactly when it is nested")
    if spec.family == NESTED and (spec.load is None or spec.emit is None or not spec.body_params):
        raise ValueError(f"{spec.prim!r}: a nested primitive needs body_params and load and emit hooks")
    old = BY_PRIM.get(spec.prim)
    if old is not None and not replace:
        raise ValueError(f"primitive {spec.prim!r} is already in the table (replace=True replaces it)")
    if old is not None and old.ctor != spec.ctor:
        raise ValueError(f"{spec.prim!r}: a replacement keeps the constructor {old.ctor!r}")
    other = BY_CTOR.get(spec.ctor)
    if (other is not None and other.prim != spec.prim) or spec.ctor in _RESERVED_CTORS:
        raise ValueError(f"constructor {spec.ctor!r} is taken; pass ctor= to name another")
    BY_PRIM[spec.prim], BY_CTOR[spec.ctor] = spec, spec
    _rebuild_groups()
    return spec


def unregister(prim: str) -> None:
    """Remove a primitive :func:`register_primitive` added (tests and examples clean up with it)."""
    spec = BY_PRIM.get(prim)
    if spec is None or spec in SPECS:
        raise ValueError(f"{prim!r} is not a registered primitive")
    del BY_PRIM[prim], BY_CTOR[spec.ctor]
    _rebuild_groups()


# The term language's structural constructors (rewrite/ir/terms.py), which no primitive may take.
_RESERVED_CTORS = frozenset("V Lit Const Param Tok Proj Opaque Effect TNil TCons Body BNil BCons".split())
