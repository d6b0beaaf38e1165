"""``rulesets.algebra``: rewrites that never change a single bit of any result.

Every rule here is exact: for all inputs, including -0.0, infinities, NaN,
subnormals and huge values, the rewritten program returns the same bits as
the original under ``jax.jit`` (any NaN equals any NaN), and
``tests/test_algebra.py`` checks each rule on such inputs. The pack holds
identities (``x*1``, ``x+(-0.0)``, double negation, ``select_n`` with equal
branches), ``integer_pow`` foldings
that repeat XLA's own repeated squaring, broadcast/reshape/transpose
simplifications, convert round trips that lose nothing, reductions over
size-1 axes, and constant folding of correctly rounded operations. It has
no commutativity rules: every pattern matches ``add`` and ``mul`` in either
operand order (``rewrite.rules.pattern.commuted``), which finds the same matches
without storing both orders of every sum and product in the e-graph.

What is left out is left out on purpose. ``x+0.0`` turns -0.0 into +0.0.
Folding ``(x^a)^b`` is exact only when ``a`` is a power of two. XLA:CPU
flushes subnormals to zero at run time (FTZ/DAZ) but not when it simplifies
or folds at compile time, so a program run op by op can already differ from
the same program under ``jit`` on subnormals; rules like ``x*1 -> x`` agree
with ``jit`` there, and constant folding declines subnormal operands and
results altogether. Folding also declines float16/bfloat16, which XLA may
compute with excess precision. Anything only approximately true belongs in
``rulesets.fastmath``.

>>> import jax.numpy as jnp, rulesets
>>> from rewrite import explain
>>> report = explain(lambda x: -(-x) * 1 + (x ** 2) ** 2, jnp.ones(3), rulesets=[rulesets.algebra])
>>> sorted(report.fired)
['add_neg', 'mul_one', 'neg_neg', 'pow_pow', 'pow_two', 'sub_neg']
>>> [e.primitive.name for e in report.after.eqns]
['integer_pow', 'add']
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rewrite import Pat, Ruleset, Value, ops, procedural, rule

__all__ = ["algebra", "own_power"]

X = Pat.var("x")


def _f32_args(*shape: int) -> tuple[jax.ShapeDtypeStruct]:
    """The arguments of a ``Pat`` rule's example program: one float32 array of this shape."""
    return (jax.ShapeDtypeStruct(shape, jnp.float32),)


_V, _M, _M1, _SCALAR = _f32_args(7), _f32_args(3, 5), _f32_args(1, 3, 5), _f32_args()
_INT = jax.ShapeDtypeStruct((3,), jnp.int32)
_BOOL_F32 = (jax.ShapeDtypeStruct((3,), jnp.bool_), jax.ShapeDtypeStruct((3,), jnp.float32))


def _real(x: Value) -> bool:
    # complex square is lowered differently from complex multiplication
    return not jnp.issubdtype(x.dtype, jnp.complexfloating)


def _integer(x: Value) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.integer))


def _integer_or_nonzero(x: Value) -> bool:
    """Integers, or floats known non-zero: JAX's derivative of ``|-x|`` at ±0 is -1, of ``|x|`` +1.

    (``abs``'s JVP is ``select(x >= 0, t, -t)``, and ``-0.0 >= 0``.) An exact
    rule keeps the derivatives JAX computes, not only the values.
    """
    return _integer(x) or x.nonzero


def _reshape(x: Any, shape: tuple[int, ...]) -> Any:
    return x if tuple(x.shape) == tuple(shape) else lax.reshape(x, tuple(shape))


def _without(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _unit(x: Value, p: dict) -> bool:
    return all(x.shape[a] == 1 for a in p["axes"])


# ---------------------------------------------------------------------- layout: reshape, squeeze, broadcast, transpose
# JAX drops a reshape, squeeze or transpose that changes nothing when it traces one, so such
# ops only come from other rewrites or from binding the primitive directly (the examples do).
_RESHAPE_LIKE = frozenset({"reshape", "squeeze", "broadcast_in_dim"})


def _identity_layout(x: Value, r: Value, p: dict) -> bool:
    """A reshape, squeeze or transpose whose result has its operand's type, keeping every element in place."""
    perm = tuple(p.get("permutation", range(x.ndim)))
    transposes = p.prim == "reshape" and p.get("dimensions") is not None  # reshape's dimensions= transposes first
    return x.aval == r.aval and not transposes and perm == tuple(range(x.ndim))


def _reshape_like(params: dict, src: Value, dst: Value) -> bool:
    """Does this op only relabel the dimensions, keeping elements in row-major order?"""
    # a reshape without dimensions=, a squeeze, or a broadcast that adds no elements (only size-1 dimensions)
    return params.get("sharding") is None and (params.get("dimensions") is None if params.prim == "reshape"
                                               else params.prim == "squeeze" or src.size == dst.size)


@procedural
def _collapse(m):
    """Two reshape-like ops in a row are one reshape (or nothing, when the shape comes back)."""
    x, y, out, pi, po = m["x"], m["y"], m.root, m.params("pi"), m.params("po")
    shape = out.shape  # (the replacements close over the shape, not the term: their traces are then kept)
    if pi.prim == po.prim == "broadcast_in_dim":
        return None  # broadcast_broadcast's
    if _reshape_like(po, y, out) and _reshape_like(pi, x, y):
        return x if x.aval == out.aval else m.trace(lambda v: lax.reshape(v, shape), x)
    if pi.prim == "broadcast_in_dim" and x.ndim == 0 and pi.get("sharding") is None and po.get("sharding") is None:
        return m.trace(lambda v: lax.broadcast_in_dim(v, shape, ()), x)  # a broadcast scalar, reshaped
    return None


def _chain(outer: Any, inner: Any) -> Pat:
    return Pat(outer, Pat(inner, X, name="y", params="pi"), params="po")


def _transpose(x: Any, perm: tuple[int, ...]) -> Any:
    return x if perm == tuple(range(len(perm))) else lax.transpose(x, perm)


def _broadcast_transposed(pi: dict, po: dict) -> tuple[int, ...]:
    """A transposed broadcast's operand dimensions, in the transposed result."""
    inverse = {d: i for i, d in enumerate(po["permutation"])}
    return tuple(inverse[d] for d in pi["broadcast_dimensions"])


def _ex_layout_identity(x):
    return (lax.reshape_p.bind(x, new_sizes=x.shape, dimensions=None, sharding=None),
            lax.squeeze_p.bind(x, dimensions=()), lax.transpose_p.bind(x, permutation=(0, 1)))


def _ex_layout_chain(x, x1, s):  # every pair of reshape, squeeze and expand_dims, and a broadcast scalar
    return (x.reshape(15).reshape(5, 3), jnp.squeeze(x1, 0).reshape(5, 3), x[None].reshape(15),
            jnp.broadcast_to(s, (4, 6)).reshape(3, 8), jnp.squeeze(x.reshape(1, 15, 1), (0, 2)),
            jnp.squeeze(jnp.squeeze(x1[..., None], 0), 2), jnp.squeeze(x[None], 0),
            jnp.squeeze(jnp.broadcast_to(s, (1, 4)), 0), x.reshape(15)[None], jnp.squeeze(x1, 0)[:, None])


def _ex_transpose_transpose(x):  # one pair cancels, the other composes
    return x.transpose(1, 2, 0).transpose(2, 0, 1), x.transpose(1, 2, 0).transpose(1, 0, 2)


# ---------------------------------------------------------------------- integer_pow
# XLA lowers integer_pow by repeated squaring (jax._src.lax.lax._integer_pow):
# x^n multiplies the squares x, x^2, x^4, ... selected by n's bits, lowest
# first. So x^(2^k * b) squares x k times and then runs b's bits on the
# result: it is exactly (x^(2^k))^b. And x^(2^k + b) with b <= 2^k multiplies
# x^b by x^(2^k) last: it is exactly x^b * x^(2^k). No other foldings are exact.
#
# A class that equals its own square (1.0, a broadcast 1.0 after x*1 -> x)
# would otherwise gain x^2, x^4, x^8, ... without end, so such a base is
# declined; literals are left to constant folding; the exponent is capped.
_MAX_EXPONENT = 1 << 16


def own_power(x: Value) -> bool:
    """Is ``x``'s class already known to equal a power of itself (``x == x*x``, as for 1.0)?

    Rules that fold powers decline such a base: it would gain ``x^2, x^4, ...``
    without end. ``rulesets.fastmath.powers`` uses it too.
    """
    return any(n.prim in ("square", "integer_pow", "mul") and all(o.cls == x.cls for o in n.operands)
               and not (n.prim == "integer_pow" and n.params["y"] == 1) for n in x.nodes)


def _pow_base(x: Value, n: int) -> bool:
    return _real(x) and x.literal is None and abs(n) <= _MAX_EXPONENT and not own_power(x)


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _exact_product(x: Value, a: int, b: int) -> bool:
    """Is x^a * x^b exactly x^(a+b) under repeated squaring?"""
    a, b = max(a, b), min(a, b)
    return _power_of_two(a) and b >= 1 and _pow_base(x, a + b)


_POW_POW = Pat("integer_pow", Pat("integer_pow", X, params="p"), params="q")                  # (x^a)^b
_MUL_POWS = Pat("mul", Pat("integer_pow", X, params="p"), Pat("integer_pow", X, params="q"))  # x^a * x^b
_MUL_X_POW = Pat("mul", X, Pat("integer_pow", X, params="q"))                                 # x * x^b


# ---------------------------------------------------------------------- converts
def _exact_conversion(src: np.dtype, dst: np.dtype) -> bool:
    """Does converting every value of ``src`` to ``dst`` keep it exactly (including -0.0, inf, NaN)?"""
    if src == dst or src == np.bool_:
        return True
    if dst == np.bool_:
        return False
    if jnp.issubdtype(src, jnp.integer):
        si = jnp.iinfo(src)
        if jnp.issubdtype(dst, jnp.integer):
            di = jnp.iinfo(dst)
            return di.min <= si.min and si.max <= di.max
        if jnp.issubdtype(dst, jnp.floating) and dst in _IEEE:
            # every integer of magnitude up to 2^(mantissa bits + 1) is a float
            return max(abs(int(si.min)), int(si.max)) <= 2 ** (jnp.finfo(dst).nmant + 1)
        return False
    if src in _IEEE and dst in _IEEE:
        s, d = jnp.finfo(src), jnp.finfo(dst)
        return (d.nmant >= s.nmant and d.maxexp >= s.maxexp
                and d.minexp - d.nmant <= s.minexp - s.nmant)  # the smallest subnormal too
    return False


_IEEE = {np.dtype(t) for t in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)}
_INT8_BF16 = (jax.ShapeDtypeStruct((3,), jnp.int8), jax.ShapeDtypeStruct((3,), jnp.bfloat16))


def _convert_convert(x: Value, y: Value, po: dict) -> bool:
    """convert(convert(x, A), B) is convert(x, B) when x's type converts to A without loss.

    Not when A is a float and B another integer type than x's: converting an
    out-of-range float to an integer is not integer wrap-around, so the path
    through A could matter. Back to x's own type, every value is in range.
    """
    out = np.dtype(po["new_dtype"])
    return _exact_conversion(x.dtype, y.dtype) and not (
        jnp.issubdtype(y.dtype, jnp.floating) and jnp.issubdtype(out, jnp.integer) and out != x.dtype)


def _convert(x: Any, po: Any) -> Any:
    same = x.dtype == po["new_dtype"] and x.aval.weak_type == po["weak_type"]
    return x if same else po.bind(x)


def _ex_convert_convert(q, h):
    """Dequantize int8 through int32 (one convert instead); a bfloat16 round trip through float32 (none)."""
    return q.astype(jnp.int32).astype(jnp.float32) * 0.5, h.astype(jnp.float32).astype(jnp.bfloat16)


# ---------------------------------------------------------------------- constant folding
# Only operations IEEE 754 rounds correctly (+ - * / sqrt), sign operations,
# comparisons, integer wrap-around arithmetic and exact conversions are
# folded, computed in the operands' own dtype. Floats are float32 and float64
# only: XLA may keep float16/bfloat16 intermediates in float32 (excess
# precision), so a folded constant could differ from what it computes.
_FOLD_FLOATS = {np.dtype(np.float32), np.dtype(np.float64)}


def _foldable_dtype(d: np.dtype) -> bool:
    return d in _FOLD_FLOATS or d == np.bool_ or bool(jnp.issubdtype(d, jnp.integer))


def _tiny(x: np.ndarray) -> bool:
    """Subnormal, or so close to the subnormal range that rounding could land there."""
    if x.dtype not in _FOLD_FLOATS:
        return False
    v = abs(float(x))
    return v != 0.0 and v < 2 * float(np.finfo(x.dtype).tiny)


def _minmax(op: Callable[..., Any]) -> Callable[..., Any]:
    def compute(a: np.ndarray, b: np.ndarray) -> Any:
        if a.dtype in _FOLD_FLOATS and a == 0 and b == 0 and np.signbit(a) != np.signbit(b):
            return None  # which zero comes out differs between backends
        return op(a, b)  # NaN propagates, as through lax.max and lax.min
    return compute


# Each folded operation, and the kinds of operands it folds. Floats are computed in float64:
# exact, or one rounding that rounding again to float32 cannot spoil. Integers wrap around in
# numpy as in XLA. Comparisons are IEEE's: NaN is unordered, -0.0 == 0.0.
_NUM, _BITS, _ANY = {"float", "int"}, {"int", "bool"}, {"float", "int", "bool"}
_FOLDS: dict[str, tuple[Callable[..., Any], set[str]]] = {
    "neg": (np.negative, _NUM), "abs": (np.abs, _NUM), "sqrt": (np.sqrt, {"float"}), "square": (np.square, _NUM),
    "add": (np.add, _NUM), "sub": (np.subtract, _NUM), "mul": (np.multiply, _NUM), "div": (np.divide, {"float"}),
    "max": (_minmax(np.maximum), _NUM), "min": (_minmax(np.minimum), _NUM),
    "not": (np.invert, _BITS), "and": (np.bitwise_and, _BITS), "or": (np.bitwise_or, _BITS),
    "eq": (np.equal, _ANY), "ne": (np.not_equal, _ANY), "lt": (np.less, _ANY), "le": (np.less_equal, _ANY),
    "gt": (np.greater, _ANY), "ge": (np.greater_equal, _ANY),
}
_FOLD_UNARY = frozenset(_FOLDS) & (ops.UNARY | ops.UNARY_TRANSCENDENTAL)
_FOLD_BINARY = frozenset(_FOLDS) & ops.BINARY


@procedural
def _fold(m):
    """An operation of ``_FOLDS`` applied to literals, computed here, or declined."""
    out, operands = m.root, [m[n] for n in ("a", "b") if n in m]
    compute, kinds = _FOLDS[m.params("p").prim]
    lits = [v.literal for v in operands]
    if not all(_foldable_dtype(v.dtype) for v in operands + [out]) or any(v is None for v in lits):
        return None
    vals = [np.asarray(v, dtype=o.dtype) for v, o in zip(lits, operands)]
    kind = "float" if vals[0].dtype in _FOLD_FLOATS else "bool" if vals[0].dtype == np.bool_ else "int"
    if kind not in kinds or any(_tiny(v) for v in vals):
        return None
    with np.errstate(all="ignore"):
        result = np.asarray(compute(*[v.astype(np.float64) if kind == "float" else v for v in vals]))
        if out.dtype in _FOLD_FLOATS:
            wide = result.astype(np.float64)
            result = wide.astype(out.dtype)  # rounds once more: harmless after one float64 op
            if _tiny(wide) or _tiny(result):
                return None
        else:
            result = result.astype(out.dtype)
    return m.literal(result.item(), out.aval)


@procedural
def _fold_integer_pow(m):
    """x^n for a literal x, by the same repeated squaring XLA runs, each step in the dtype."""
    x, n, out = m["c"], m.params("p")["y"], m.root
    if x.dtype not in _FOLD_FLOATS and not (_integer(x) and n >= 0):
        return None  # an integer to a negative power divides by zero or rounds: left to XLA
    base = np.asarray(x.literal, dtype=x.dtype)
    steps, acc, k = [base], None, abs(n)
    with np.errstate(all="ignore"):
        while k > 0:  # the squares x, x^2, x^4, ... that n's bits select, multiplied in, lowest first
            if k & 1:
                acc = base if acc is None else (acc * base).astype(x.dtype)
                steps.append(acc)
            k >>= 1
            if k > 0:
                base = (base * base).astype(x.dtype)
                steps.append(base)
        one = np.ones((), x.dtype)
        result = one if acc is None else acc if n > 0 else (one / acc).astype(x.dtype)
    if any(_tiny(np.asarray(s)) for s in steps + [result]):
        return None
    return m.literal(np.asarray(result).item(), out.aval)


@procedural
def _fold_convert(m):
    """convert(c) for a literal c, with XLA's conversion semantics.

    Float to integer truncates toward zero and saturates, NaN becoming 0, as
    XLA:CPU does at run time and when it folds. This fold must not decline
    such conversions: JAX itself folds a convert of a literal with numpy when
    it traces the rewritten program, and numpy's cast of an out-of-range float
    is not XLA's, so a literal left in front of a convert could change a value.
    """
    c, out = m["c"], m.root
    if not (_foldable_dtype(c.dtype) and _foldable_dtype(out.dtype)) or c.literal is None:
        return None
    v = np.asarray(c.literal, dtype=c.dtype)
    with np.errstate(all="ignore"):
        if out.dtype == np.bool_:
            w = np.asarray(v != 0)
        elif c.dtype in _FOLD_FLOATS and jnp.issubdtype(out.dtype, jnp.integer):
            info = jnp.iinfo(out.dtype)
            w = np.asarray(0 if np.isnan(v) else min(max(np.trunc(float(v)), info.min), info.max))
        else:
            if _tiny(v):
                return None  # XLA:CPU reads a subnormal operand as zero at run time
            w = v.astype(out.dtype)
            if _tiny(w):
                return None
        w = w.astype(out.dtype)
    return m.literal(w.item(), out.aval)


@procedural
def _fold_select(m):
    """select_n with a literal predicate is the case it selects."""
    cases = m.list("cases")
    p = m["p"].literal
    i = int(p)
    if not 0 <= i < len(cases) or cases[i].aval != m.root.aval:
        return None
    return cases[i]


# Constant expressions inside computations, as users write them. Their literals are normal
# numbers: folding declines subnormal and near-subnormal operands and results.
def _ex_fold_unary(x, i):  # a negative slope and a mask's fill value, 1/sqrt(d), rounding down to a multiple of 8
    return (jnp.where(x > 0, x * -jnp.float32(0.5), -jnp.float32(jnp.inf)), x * jnp.abs(jnp.float32(-0.5)),
            x / jnp.sqrt(jnp.float32(2.0)), x * jnp.square(jnp.float32(0.1)), i & ~jnp.int32(7))


def _ex_fold_binary(x, i):  # every folded binary operation, and branches chosen by comparing constants
    f = jnp.float32
    outs = [x + (f(0.1) + f(0.2)), x - (f(1.0) - f(0.9)), x * (f(2.0) * f(np.pi)), x * (f(1.0) / f(3.0)),
            jnp.maximum(x, jnp.maximum(f(-1.0), f(0.5))), jnp.minimum(x, jnp.minimum(f(6.0), f(np.inf))),
            i & (jnp.int32(0xF0) & jnp.int32(0x3C)), i | (jnp.int32(1) | jnp.int32(4))]
    for op in (lax.eq, lax.ne, lax.lt, lax.le, lax.gt, lax.ge):
        outs += [jnp.where(op(f(a), f(b)), x, -x) for a, b in [(0.5, 2.0), (-0.0, 0.0), (np.nan, 1.0)]]
    return outs


# ---------------------------------------------------------------------- the pack
# Rules of two or more variables use lax, not jnp operators: jnp converts a
# weak-typed scalar operand (a literal) before an op with an array, so the
# traced left side would not be the program's ``mul 2.0 x``.
algebra = Ruleset("algebra", [
    # identities
    rule(lambda x: x * 1, lambda x: x, name="mul_one"),                                        # x * 1 -> x
    rule(lambda x: x * jnp.ones_like(x), lambda x: x, name="mul_ones", when=lambda x: x.ndim > 0),  # x * broadcast(1) -> x
    rule(lambda x: x / 1, lambda x: x, name="div_one"),                                        # x / 1 -> x
    rule(lambda x: x + (-0.0), lambda x: x, name="add_neg_zero"),                              # x + (-0.0) -> x
    rule(lambda x: x - 0, lambda x: x, name="sub_zero"),                                       # x - 0 -> x  (-0.0 - 0.0 is -0.0)
    rule(lambda x: x + 0, lambda x: x, name="add_zero_int", when=_integer, example_inputs=_INT),     # x + 0 -> x  (integers only)
    rule(lambda x: (-0.0) - x, lambda x: -x, name="neg_zero_sub"),                             # (-0.0) - x -> -x
    rule(lambda x: 0 - x, lambda x: -x, name="zero_sub_int", when=_integer, example_inputs=_INT),    # 0 - x -> -x  (integers only)
    rule(lambda x: x * 0, lambda x: jnp.zeros_like(x), name="mul_zero_int", when=_integer, example_inputs=_INT),  # x * 0 -> 0  (integers only)
    rule(lambda x: x - x, lambda x: jnp.zeros_like(x), name="sub_self_int", when=_integer, example_inputs=_INT),  # x - x -> 0  (integers only)
    rule(lambda x: x * -1, lambda x: -x, name="mul_neg_one"),                                  # x * -1 -> -x
    rule(lambda x: -(-x), lambda x: x, name="neg_neg"),                                        # -(-x) -> x
    rule(lambda x, y: lax.sub(x, -y), lambda x, y: lax.add(x, y), name="sub_neg"),             # x - (-y) -> x + y
    rule(lambda x, y: lax.add(x, -y), lambda x, y: lax.sub(x, y), name="add_neg"),             # x + (-y) -> x - y
    rule(lambda x, y: lax.mul(-x, -y), lambda x, y: lax.mul(x, y), name="neg_mul_neg"),        # (-x) * (-y) -> x * y
    rule(lambda x, y: lax.div(-x, -y), lambda x, y: lax.div(x, y), name="neg_div_neg",
         when=lambda x, y: x.is_floating),                                 # (-x) / (-y) -> x / y  (integer x/0 depends on x's sign)
    rule(lambda x: jnp.abs(-x), lambda x: jnp.abs(x), name="abs_neg", when=_integer_or_nonzero),  # |-x| -> |x|  (not at ±0: see _integer_or_nonzero)
    rule(lambda x: jnp.abs(jnp.abs(x)), lambda x: jnp.abs(x), name="abs_abs"),                 # ||x|| -> |x|
    rule(lambda x: lax.max(x, x), lambda x: x, name="max_self"),                               # max(x, x) -> x
    rule(lambda x: lax.min(x, x), lambda x: x, name="min_self"),                               # min(x, x) -> x
    rule(lambda p, x: lax.select_n(p, x, x), lambda p, x: x, name="select_same", example_inputs=_BOOL_F32),  # select_n(p, x, x) -> x
    # integer_pow, as XLA lowers it
    rule(lambda x: lax.integer_pow(x, 0), lambda x: lax.full_like(x, 1), name="pow_zero"),    # x^0 -> 1  (also for 0, inf, NaN)
    rule(lambda x: lax.integer_pow(x, 1), lambda x: x, name="pow_one"),                        # x^1 -> x
    rule(lambda x: lax.integer_pow(x, 2), lambda x: lax.square(x), name="pow_two", when=_real),  # x^2 -> square(x)
    rule(lambda x: lax.square(x), lambda x: lax.integer_pow(x, 2), name="square_pow", when=_real),  # square(x) -> x^2
    rule(lambda x: x * x, lambda x: lax.square(x), name="mul_self", when=_real),               # x * x -> square(x)
    rule(_POW_POW, lambda x, p, q: lax.integer_pow(x, p.y * q.y), name="pow_pow",              # (x^2^k)^b -> x^(2^k b)
         when=lambda x, p, q: _power_of_two(p.y) and q.y != 0 and _pow_base(x, p.y * q.y),
         example_program=(lambda x: (x ** 2) ** 3, _V)),
    rule(_MUL_POWS, lambda x, p, q: lax.integer_pow(x, p.y + q.y), name="mul_pows",            # x^2^k * x^b -> x^(2^k+b), b <= 2^k
         when=lambda x, p, q: _exact_product(x, p.y, q.y), example_program=(lambda x: x ** 4 * x ** 3, _V)),
    rule(_MUL_X_POW, lambda x, q: lax.integer_pow(x, q.y + 1), name="mul_x_pow",               # x * x^2^k -> x^(2^k+1)
         when=lambda x, q: _exact_product(x, q.y, 1), example_program=(lambda x: x * x ** 4, _V)),
    # layout
    rule(Pat({"reshape", "squeeze", "transpose"}, X, name="r", params="p"), lambda x: x,       # reshape(x) -> x  (same type, same order)
         when=_identity_layout, name="layout_identity", example_program=(_ex_layout_identity, _M)),
    rule(_chain("reshape", "reshape"), _collapse, name="reshape_reshape",                     # reshape(reshape(x)) -> reshape(x)
         example_program=(lambda x: x.reshape(15).reshape(5, 3), _M)),
    rule(_chain(_RESHAPE_LIKE, _RESHAPE_LIKE), _collapse, name="reshape_chain",                # reshape-like(reshape-like(x)) -> reshape(x)
         example_program=(_ex_layout_chain, _M + _M1 + _SCALAR)),
    rule(_chain("broadcast_in_dim", "broadcast_in_dim"), lambda x, pi, po: lax.broadcast_in_dim(  # bcast(bcast(x)) -> bcast(x)
        x, po.shape, tuple(po.broadcast_dimensions[d] for d in pi.broadcast_dimensions)), name="broadcast_broadcast",
         example_program=(lambda x: jnp.broadcast_to(jnp.broadcast_to(x, (4, 5)), (2, 4, 5)), _f32_args(5))),
    rule(_chain("transpose", "transpose"), lambda x, pi, po: _transpose(x, tuple(pi.permutation[i] for i in po.permutation)),
         name="transpose_transpose", example_program=(_ex_transpose_transpose, _f32_args(2, 3, 4))),  # transpose(transpose(x, p), q) -> transpose(x, p[q])
    rule(_chain("transpose", "broadcast_in_dim"), lambda x, pi, po: lax.broadcast_in_dim(     # transpose(bcast(x)) -> bcast(x), dims in order
        x, tuple(pi.shape[d] for d in po.permutation), _broadcast_transposed(pi, po)), name="transpose_broadcast",
         when=lambda pi, po: list(_broadcast_transposed(pi, po)) == sorted(set(_broadcast_transposed(pi, po))),
         example_program=(lambda x: jnp.broadcast_to(x, (4, 5)).T, _f32_args(5))),
    # reductions over axes of size 1 touch one element per output: a reshape (XLA's too: sum([-0.0]) is -0.0)
    rule(Pat(ops.REDUCE - ops.ARG_REDUCE, X, params="p"), lambda x, p: _reshape(x, _without(x.shape, p.axes)),
         when=_unit, name="reduce_unit_axes", example_program=(lambda x: (x.sum(1), x.prod(1), x.max(1), x.min(1),
                                                                   (x > 0).all(1), (x > 0).any(1)), _f32_args(4, 1, 3))),  # sum(x, size-1 axes) -> reshape(x)
    rule(Pat(ops.ARG_REDUCE, X, params="p"), lambda x, p: lax.full(_without(x.shape, p.axes), 0, p.index_dtype),
         when=_unit, name="arg_unit_axes", example_program=(lambda x: (jnp.argmax(x, 1), jnp.argmin(x, 1)), _f32_args(4, 1, 3))),  # argmax(x, size-1 axis) -> 0
    # converts
    rule(_chain("convert_element_type", "convert_element_type"), lambda x, po: _convert(x, po), name="convert_convert",
         when=lambda x, y, po: _convert_convert(x, y, po), example_program=(_ex_convert_convert, _INT8_BF16)),  # convert(convert(x, wider), B) -> convert(x, B)
    # constant folding (literal operands)
    rule(Pat(_FOLD_UNARY, Pat.lit(name="a"), params="p"), _fold, name="fold_unary",          # op(c) -> c'
         example_program=(_ex_fold_unary, _V + (_INT,))),
    rule(Pat(_FOLD_BINARY, Pat.lit(name="a"), Pat.lit(name="b"), params="p"), _fold, name="fold_binary",  # a op b -> c
         example_program=(_ex_fold_binary, _V + (_INT,))),
    rule(Pat("integer_pow", Pat.lit(name="c"), params="p"), _fold_integer_pow, name="fold_integer_pow",  # c^n -> c'
         example_program=(lambda x: x * jnp.float32(0.99) ** 10, _V)),                                         # (a decay over ten steps)
    rule(Pat("convert_element_type", Pat.lit(name="c")), _fold_convert, name="fold_convert",  # convert(c) -> c'
         example_program=(lambda x: jnp.clip(x, 0, 6), _V)),                                          # (relu6: jnp.clip converts its bounds)
    rule(Pat("select_n", Pat.lit(name="p"), args="cases"), _fold_select, name="fold_select",  # select_n(c, *xs) -> xs[c]
         example_program=(lambda x: jnp.where(True, jnp.maximum(x, 0.0), x), _V)),
], soundness="exact", description=__doc__.split("\n\n")[0])
