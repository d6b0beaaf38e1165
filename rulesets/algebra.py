"""``rulesets.algebra``: rewrites that never change a single bit of any result.

Every rule here is exact: for all inputs, including -0.0, infinities, NaN,
subnormals and huge values, the rewritten program returns the same bits as
the original under ``jax.jit`` (any NaN equals any NaN), and
``tests/test_algebra.py`` checks each rule on such inputs. The pack holds
identities (``x*1``, ``x+(-0.0)``, double negation, ``select_n`` with equal
branches), commutativity of ``add`` and ``mul``, ``integer_pow`` foldings
that repeat XLA's own repeated squaring, broadcast/reshape/transpose
simplifications, convert round trips that lose nothing, reductions over
size-1 axes, and constant folding of correctly rounded operations.

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
['add_comm', 'add_neg', 'mul_comm', 'mul_one', 'neg_neg', 'pow_pow', 'pow_two']
>>> [e.primitive.name for e in report.after.eqns]
['integer_pow', 'add']
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rewrite import Pat, Ruleset, Value, procedural, rule

__all__ = ["algebra"]

X = Pat.var("x")
_INT = jax.ShapeDtypeStruct((3,), jnp.int32)
_BOOL_F32 = (jax.ShapeDtypeStruct((3,), jnp.bool_), jax.ShapeDtypeStruct((3,), jnp.float32))


def _f32(*shape: int) -> tuple[jax.ShapeDtypeStruct]:
    """The arguments of a ``Pat`` rule's example program: one float32 array of this shape."""
    return (jax.ShapeDtypeStruct(shape, jnp.float32),)


def _example_at(args: tuple) -> Callable[[Callable], tuple[Callable, tuple]]:
    """Make a function the ``example=(fn, args)`` of a ``Pat`` rule: a program it applies in, at ``args``.

    A Pat rule has no left-side function to trace, so ``check_ruleset`` checks it
    on such a program; each section below defines its rules' examples.
    """
    return lambda fn: (fn, args)


_V = _f32(7)


def _real(x: Value) -> bool:
    # complex square is lowered differently from complex multiplication
    return not jnp.issubdtype(x.dtype, jnp.complexfloating)


def _integer(x: Value) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.integer))


# ---------------------------------------------------------------------- layout: reshape, squeeze, broadcast, transpose
def _reshape_like(prim: str, params: dict, src: Value, dst: Value) -> bool:
    """Does this op only relabel the dimensions, keeping elements in row-major order?"""
    if params.get("sharding") is not None:
        return False
    if prim == "reshape":
        return params.get("dimensions") is None
    if prim == "squeeze":
        return True
    # a broadcast that adds no elements only inserts size-1 dimensions
    return prim == "broadcast_in_dim" and src.size == dst.size


def _reshape_to(m: Any, x: Value, shape: tuple[int, ...]) -> Value:
    if x.shape == tuple(shape) and x.aval == m.root.aval:
        return x
    return m.trace(lambda v: lax.reshape(v, tuple(shape)), x)


def _collapse(outer: str, inner: str) -> Callable:
    """Two reshape-like ops in a row are one reshape (or nothing, when the shape comes back)."""

    @procedural
    def collapse(m):
        x, y, out = m["x"], m["y"], m.root
        if _reshape_like(outer, m.params("po"), y, out) and _reshape_like(inner, m.params("pi"), x, y):
            return _reshape_to(m, x, out.shape)
        if inner == "broadcast_in_dim" and x.ndim == 0 and m.params("pi").get("sharding") is None \
                and m.params("po").get("sharding") is None:
            # a broadcast scalar reshaped is that scalar broadcast to the new shape
            return m.trace(lambda v: lax.broadcast_in_dim(v, out.shape, ()), x)
        return None

    collapse.__name__ = f"{outer}_of_{inner}"
    return collapse


def _chain(outer: str, inner: str) -> Pat:
    return Pat(outer, Pat(inner, X, name="y", params="pi"), params="po")


@procedural
def _drop_if_same_type(m):
    """A reshape or squeeze whose result has its operand's type is the identity.

    (JAX's own ``bind`` already drops identity broadcasts and converts, so
    traced programs never hold them, and the rules here never build them.)
    """
    x, out, p = m["x"], m.root, m.params("p")
    if x.aval != out.aval or p.get("sharding") is not None:
        return None
    if "new_sizes" in p and p.get("dimensions") is not None:
        return None  # a reshape with dimensions= transposes first
    return x


@procedural
def _transpose_identity(m):
    perm = tuple(m.params("p")["permutation"])
    return m["x"] if perm == tuple(range(len(perm))) else None


@procedural
def _transpose_transpose(m):
    p, q = m.params("pi")["permutation"], m.params("po")["permutation"]
    perm = tuple(p[i] for i in q)
    if perm == tuple(range(len(perm))):
        return m["x"]
    return m.trace(lambda v: lax.transpose(v, perm), m["x"])


@procedural
def _broadcast_broadcast(m):
    pi, po = m.params("pi"), m.params("po")
    if pi.get("sharding") is not None or po.get("sharding") is not None:
        return None
    dims = tuple(po["broadcast_dimensions"][d] for d in pi["broadcast_dimensions"])
    out = m.root
    return m.trace(lambda v: lax.broadcast_in_dim(v, out.shape, dims), m["x"])


@procedural
def _transpose_broadcast(m):
    """A transposed broadcast is a broadcast, when the operand's dimensions keep their order."""
    pi, perm = m.params("pi"), m.params("po")["permutation"]
    if pi.get("sharding") is not None:
        return None
    inverse = {d: i for i, d in enumerate(perm)}
    dims = tuple(inverse[d] for d in pi["broadcast_dimensions"])
    if list(dims) != sorted(set(dims)):
        return None
    out = m.root
    return m.trace(lambda v: lax.broadcast_in_dim(v, out.shape, dims), m["x"])


_M, _M1, _SCALAR = _f32(3, 5), _f32(1, 3, 5), _f32()


# JAX drops a reshape, squeeze or transpose that changes nothing when it traces one, so such
# ops only come from other rewrites or from binding the primitive directly, as here.
@_example_at(_M)
def _ex_reshape_identity(x):
    return lax.reshape_p.bind(x, new_sizes=x.shape, dimensions=None, sharding=None)


@_example_at(_M)
def _ex_squeeze_identity(x):
    return lax.squeeze_p.bind(x, dimensions=())


@_example_at(_M)
def _ex_transpose_identity(x):
    return lax.transpose_p.bind(x, permutation=(0, 1))


@_example_at(_M + _SCALAR)
def _ex_reshape_broadcast(x, s):  # both cases: an expand_dims, and a broadcast scalar
    return x[None].reshape(15), jnp.broadcast_to(s, (4, 6)).reshape(3, 8)


@_example_at(_M + _SCALAR)
def _ex_squeeze_broadcast(x, s):
    return jnp.squeeze(x[None], 0), jnp.squeeze(jnp.broadcast_to(s, (1, 4)), 0)


@_example_at(_f32(2, 3, 4))
def _ex_transpose_transpose(x):  # one pair cancels, the other composes
    return x.transpose(1, 2, 0).transpose(2, 0, 1), x.transpose(1, 2, 0).transpose(1, 0, 2)


# ---------------------------------------------------------------------- reductions over size-1 axes
@procedural
def _reduce_unit_axes(m):
    """Reducing over axes of size 1 touches one element per output: the reduction is a reshape.

    XLA rewrites such reductions to reshapes itself, so even ``sum([-0.0])``
    stays -0.0; the tests check that this holds for every reduction here.
    """
    x, p = m["x"], m.params("p")
    if p.get("out_sharding") is not None or any(x.shape[a] != 1 for a in p["axes"]):
        return None
    return _reshape_to(m, x, m.root.shape)


@procedural
def _arg_unit_axes(m):
    """argmax/argmin over an axis of size 1 is index 0 everywhere, NaN or not."""
    x, p, out = m["x"], m.params("p"), m.root
    if any(x.shape[a] != 1 for a in p["axes"]):
        return None
    return m.trace(lambda v: lax.full(out.shape, 0, out.dtype), x)


def _unit_axis(reduce: Callable, dtype: Any = jnp.float32) -> tuple[Callable, tuple]:
    """An example program for a reduction rule: ``reduce`` over the size-1 middle axis of a (4, 1, 3) array."""
    return (lambda x: reduce(x, axis=1)), (jax.ShapeDtypeStruct((4, 1, 3), dtype),)


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


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _own_power(m: Any, x: Value) -> bool:
    """Is ``x``'s class already known to equal a power of itself?"""
    for cls, node in m.users(x):
        if cls.cls == x.cls and (node.prim == "square" or (node.prim == "integer_pow" and node.params["y"] != 1)
                                 or (node.prim == "mul" and all(o.cls == x.cls for o in node.operands))):
            return True
    return False


def _pow_base(m: Any, n: int) -> Value | None:
    x = m["x"]
    if not _real(x) or x.literal is not None or abs(n) > _MAX_EXPONENT or _own_power(m, x):
        return None
    return x


@procedural
def _pow_pow(m):
    a, b = m.params("pi")["y"], m.params("po")["y"]
    x = _pow_base(m, a * b)
    if x is None or not _power_of_two(a) or b == 0:
        return None
    return m.trace(lambda v: lax.integer_pow(v, a * b), x)


def _pow_product(m: Any, a: int, b: int) -> Any:
    a, b = max(a, b), min(a, b)
    x = _pow_base(m, a + b)
    if x is None or not _power_of_two(a) or b < 1:
        return None
    return m.trace(lambda v: lax.integer_pow(v, a + b), x)


@procedural
def _mul_pows(m):
    return _pow_product(m, m.params("p")["y"], m.params("q")["y"])


@procedural
def _mul_x_pow(m):
    return _pow_product(m, m.params("q")["y"], 1)


@_example_at(_V)
def _ex_pow_pow(x):
    return (x ** 2) ** 3


@_example_at(_V)
def _ex_mul_pows(x):
    return x ** 4 * x ** 3


@_example_at(_V)
def _ex_mul_x_pow(x):
    return x * x ** 4


# ---------------------------------------------------------------------- converts
def _exact_conversion(src: np.dtype, dst: np.dtype) -> bool:
    """Does converting every value of ``src`` to ``dst`` keep it exactly (including -0.0, inf, NaN)?"""
    if src == dst:
        return True
    if src == np.bool_:
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


@_example_at(_INT8_BF16)
def _ex_convert_convert(q, h):
    """Dequantize int8 through int32 (one convert instead); a bfloat16 round trip through float32 (none)."""
    return q.astype(jnp.int32).astype(jnp.float32) * 0.5, h.astype(jnp.float32).astype(jnp.bfloat16)


@procedural
def _convert_convert(m):
    """convert(convert(x, A), B) is convert(x, B) when x's type converts to A without loss.

    Not when A is a float and B another integer type than x's: converting an
    out-of-range float to an integer is not integer wrap-around, so the path
    through A could matter. Back to x's own type, every value is in range.
    """
    x, y, out = m["x"], m["y"], m.root
    if not _exact_conversion(x.dtype, y.dtype):
        return None
    if jnp.issubdtype(y.dtype, jnp.floating) and jnp.issubdtype(out.dtype, jnp.integer) and out.dtype != x.dtype:
        return None
    params = m.params("po")
    if params.get("sharding") is not None:
        return None
    if x.aval == out.aval:
        return x
    return m.node("convert_element_type", [x], params, [out.aval])


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


def _fold(compute: Callable[..., Any], names: tuple[str, ...]) -> Callable:
    """A procedure that folds a primitive applied to literals, or declines."""

    @procedural
    def fold(m):
        out = m.root
        ops = [m[n] for n in names]
        if not all(_foldable_dtype(v.dtype) for v in ops + [out]):
            return None
        lits = [v.literal for v in ops]
        if any(v is None for v in lits):
            return None
        vals = [np.asarray(v, dtype=o.dtype) for v, o in zip(lits, ops)]
        if any(_tiny(v) for v in vals):
            return None
        with np.errstate(all="ignore"):
            result = compute(*vals)
            if result is None:
                return None
            result = np.asarray(result)
            if out.dtype in _FOLD_FLOATS:
                wide = result.astype(np.float64)
                result = wide.astype(out.dtype)  # rounds once more: harmless after one float64 op
                if _tiny(wide) or _tiny(result):
                    return None
            else:
                result = result.astype(out.dtype)
        return m.literal(result.item(), out.aval)

    return fold


def _float_op(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` computed in float64 for float operands (exact, or one rounding that float64->float32 cannot spoil)."""

    def compute(*vals: np.ndarray) -> Any:
        if vals[0].dtype in _FOLD_FLOATS:
            if vals[0].dtype == np.float32:
                return op(*[v.astype(np.float64) for v in vals])
            return op(*vals)
        if jnp.issubdtype(vals[0].dtype, jnp.integer):
            return op(*vals)  # numpy integer arithmetic wraps around, as XLA's does
        return None

    return compute


def _float_only(op: Callable[..., Any]) -> Callable[..., Any]:
    def compute(*vals: np.ndarray) -> Any:
        return _float_op(op)(*vals) if vals[0].dtype in _FOLD_FLOATS else None
    return compute


def _minmax(pick_max: bool) -> Callable[..., Any]:
    def compute(a: np.ndarray, b: np.ndarray) -> Any:
        if a.dtype == np.bool_:
            return None
        if a.dtype in _FOLD_FLOATS:
            if np.isnan(a) or np.isnan(b):
                return np.asarray(np.nan, a.dtype)  # lax.max and lax.min propagate NaN
            if a == 0 and b == 0 and np.signbit(a) != np.signbit(b):
                return None  # which zero comes out differs between backends
        return np.maximum(a, b) if pick_max else np.minimum(a, b)
    return compute


def _int_or_bool_op(op: Callable[..., Any]) -> Callable[..., Any]:
    def compute(*vals: np.ndarray) -> Any:
        d = vals[0].dtype
        return op(*vals) if d == np.bool_ or jnp.issubdtype(d, jnp.integer) else None
    return compute


def _compare(op: Callable[..., Any]) -> Callable[..., Any]:
    def compute(a: np.ndarray, b: np.ndarray) -> Any:
        return op(a, b)  # IEEE comparisons: NaN is unordered, -0.0 == 0.0
    return compute


@procedural
def _fold_integer_pow(m):
    """x^n for a literal x, by the same repeated squaring XLA runs, each step in the dtype."""
    x, n, out = m["c"], m.params("p")["y"], m.root
    if x.dtype not in _FOLD_FLOATS and not _integer(x):
        return None
    v = np.asarray(x.literal, dtype=x.dtype)
    if _tiny(v):
        return None
    with np.errstate(all="ignore"):
        steps = []
        if n == 0:
            result = np.ones((), x.dtype)
        else:
            acc, base, k = None, v, abs(n)
            while k > 0:
                if k & 1:
                    acc = base if acc is None else (acc * base).astype(x.dtype)
                    steps.append(acc)
                k >>= 1
                if k > 0:
                    base = (base * base).astype(x.dtype)
                    steps.append(base)
            result = acc
            if n < 0:
                if _integer(x):
                    return None  # integer division by zero and rounding: leave to XLA
                result = (np.ones((), x.dtype) / acc).astype(x.dtype)
                steps.append(result)
    if any(_tiny(np.asarray(s)) for s in steps):
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


def _lit(name: str) -> Pat:
    return Pat.lit(name=name)


def _fold2(prim: str) -> Pat:
    return Pat(prim, _lit("a"), _lit("b"))


_A, _AB = ("a",), ("a", "b")


# Constant expressions inside computations, as users write them. Their literals are normal
# numbers: folding declines subnormal and near-subnormal operands and results.
@_example_at(_V)
def _ex_fold_neg(x):  # a negative slope, and a mask's fill value
    return jnp.where(x > 0, x * -jnp.float32(0.5), -jnp.float32(jnp.inf))


@_example_at(_V)
def _ex_fold_abs(x):
    return x * jnp.abs(jnp.float32(-0.5))


@_example_at(_V)
def _ex_fold_sqrt(x):  # attention's 1/sqrt(d)
    return x / jnp.sqrt(jnp.float32(2.0))


@_example_at(_V)
def _ex_fold_square(x):
    return x * jnp.square(jnp.float32(0.1))


@_example_at(_V)
def _ex_fold_integer_pow(x):  # a decay over ten steps
    return x * jnp.float32(0.99) ** 10


@_example_at(_V)
def _ex_fold_convert(x):  # relu6: jnp.clip converts its integer bounds
    return jnp.clip(x, 0, 6)


@_example_at(_V)
def _ex_fold_add(x):
    return x + (jnp.float32(0.1) + jnp.float32(0.2))


@_example_at(_V)
def _ex_fold_sub(x):
    return x - (jnp.float32(1.0) - jnp.float32(0.9))


@_example_at(_V)
def _ex_fold_mul(x):
    return x * (jnp.float32(2.0) * jnp.float32(np.pi))


@_example_at(_V)
def _ex_fold_div(x):
    return x * (jnp.float32(1.0) / jnp.float32(3.0))


@_example_at(_V)
def _ex_fold_max(x):
    return jnp.maximum(x, jnp.maximum(jnp.float32(-1.0), jnp.float32(0.5)))


@_example_at(_V)
def _ex_fold_min(x):
    return jnp.minimum(x, jnp.minimum(jnp.float32(6.0), jnp.float32(np.inf)))


def _ex_compare(op: Callable[[Any, Any], Any]) -> tuple[Callable, tuple]:
    """An example for a comparison: branches chosen by comparing constants (ordinary, signed zeros, NaN)."""

    def program(x):
        pairs = [(0.5, 2.0), (-0.0, 0.0), (np.nan, 1.0)]
        return [jnp.where(op(jnp.float32(a), jnp.float32(b)), x, -x) for a, b in pairs]

    return program, _V


@_example_at((_INT,))
def _ex_fold_and(x):
    return x & (jnp.int32(0xF0) & jnp.int32(0x3C))


@_example_at((_INT,))
def _ex_fold_or(x):
    return x | (jnp.int32(1) | jnp.int32(4))


@_example_at((_INT,))
def _ex_fold_not(x):  # round down to a multiple of 8
    return x & ~jnp.int32(7)


@_example_at(_V)
def _ex_fold_select(x):  # a flag fixed when the program is written
    return jnp.where(True, jnp.maximum(x, 0.0), x)


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
    rule(lambda x: x + 0, lambda x: x, name="add_zero_int", when=_integer, example=_INT),     # x + 0 -> x  (integers only)
    rule(lambda x: (-0.0) - x, lambda x: -x, name="neg_zero_sub"),                             # (-0.0) - x -> -x
    rule(lambda x: 0 - x, lambda x: -x, name="zero_sub_int", when=_integer, example=_INT),    # 0 - x -> -x  (integers only)
    rule(lambda x: x * 0, lambda x: jnp.zeros_like(x), name="mul_zero_int", when=_integer, example=_INT),  # x * 0 -> 0  (integers only)
    rule(lambda x: x - x, lambda x: jnp.zeros_like(x), name="sub_self_int", when=_integer, example=_INT),  # x - x -> 0  (integers only)
    rule(lambda x: x * -1, lambda x: -x, name="mul_neg_one"),                                  # x * -1 -> -x
    rule(lambda x: -(-x), lambda x: x, name="neg_neg"),                                        # -(-x) -> x
    rule(lambda x, y: lax.sub(x, -y), lambda x, y: lax.add(x, y), name="sub_neg"),             # x - (-y) -> x + y
    rule(lambda x, y: lax.add(x, -y), lambda x, y: lax.sub(x, y), name="add_neg"),             # x + (-y) -> x - y
    rule(lambda x, y: lax.mul(-x, -y), lambda x, y: lax.mul(x, y), name="neg_mul_neg"),        # (-x) * (-y) -> x * y
    rule(lambda x, y: lax.div(-x, -y), lambda x, y: lax.div(x, y), name="neg_div_neg",
         when=lambda x, y: x.is_floating),                                 # (-x) / (-y) -> x / y  (integer x/0 depends on x's sign)
    rule(lambda x: jnp.abs(-x), lambda x: jnp.abs(x), name="abs_neg"),                         # |-x| -> |x|
    rule(lambda x: jnp.abs(jnp.abs(x)), lambda x: jnp.abs(x), name="abs_abs"),                 # ||x|| -> |x|
    rule(lambda x: lax.max(x, x), lambda x: x, name="max_self"),                               # max(x, x) -> x
    rule(lambda x: lax.min(x, x), lambda x: x, name="min_self"),                               # min(x, x) -> x
    rule(lambda p, x: lax.select_n(p, x, x), lambda p, x: x, name="select_same", example=_BOOL_F32),  # select_n(p, x, x) -> x
    # commutativity
    rule(lambda a, b: lax.add(a, b), lambda a, b: lax.add(b, a), name="add_comm"),             # a + b -> b + a
    rule(lambda a, b: lax.mul(a, b), lambda a, b: lax.mul(b, a), name="mul_comm"),             # a * b -> b * a
    # integer_pow, as XLA lowers it
    rule(lambda x: lax.integer_pow(x, 0), lambda x: lax.full_like(x, 1), name="pow_zero"),    # x^0 -> 1  (also for 0, inf, NaN)
    rule(lambda x: lax.integer_pow(x, 1), lambda x: x, name="pow_one"),                        # x^1 -> x
    rule(lambda x: lax.integer_pow(x, 2), lambda x: lax.square(x), name="pow_two", when=_real),  # x^2 -> square(x)
    rule(lambda x: lax.square(x), lambda x: lax.integer_pow(x, 2), name="square_pow", when=_real),  # square(x) -> x^2
    rule(lambda x: x * x, lambda x: lax.square(x), name="mul_self", when=_real),               # x * x -> square(x)
    rule(Pat("integer_pow", Pat("integer_pow", X, params="pi"), params="po"), _pow_pow, name="pow_pow",
         example=_ex_pow_pow),                                                                     # (x^2^k)^b -> x^(2^k b)
    rule(Pat("mul", Pat("integer_pow", X, params="p"), Pat("integer_pow", X, params="q")), _mul_pows,
         name="mul_pows", example=_ex_mul_pows),                                                   # x^2^k * x^b -> x^(2^k+b), b <= 2^k
    rule(Pat("mul", X, Pat("integer_pow", X, params="q")), _mul_x_pow, name="mul_x_pow",
         example=_ex_mul_x_pow),                                                                   # x * x^2^k -> x^(2^k+1)
    # layout
    rule(Pat("reshape", X, params="p"), _drop_if_same_type, name="reshape_identity",
         example=_ex_reshape_identity),                                                            # reshape(x) -> x  (same shape)
    rule(Pat("squeeze", X, params="p"), _drop_if_same_type, name="squeeze_identity",
         example=_ex_squeeze_identity),                                                            # squeeze(x, ()) -> x
    rule(Pat("transpose", X, params="p"), _transpose_identity, name="transpose_identity",
         example=_ex_transpose_identity),                                                          # transpose(x, id) -> x
    rule(_chain("reshape", "reshape"), _collapse("reshape", "reshape"), name="reshape_reshape",
         example=(lambda x: x.reshape(15).reshape(5, 3), _M)),                                     # reshape(reshape(x)) -> reshape(x)
    rule(_chain("reshape", "squeeze"), _collapse("reshape", "squeeze"), name="reshape_squeeze",
         example=(lambda x: jnp.squeeze(x, 0).reshape(5, 3), _M1)),                                # reshape(squeeze(x)) -> reshape(x)
    rule(_chain("reshape", "broadcast_in_dim"), _collapse("reshape", "broadcast_in_dim"),
         name="reshape_broadcast", example=_ex_reshape_broadcast),  # reshape(expand_dims(x)) -> reshape(x); reshape(bcast(s)) -> bcast(s)
    rule(_chain("squeeze", "reshape"), _collapse("squeeze", "reshape"), name="squeeze_reshape",
         example=(lambda x: jnp.squeeze(x.reshape(1, 15, 1), (0, 2)), _M)),                        # squeeze(reshape(x)) -> reshape(x)
    rule(_chain("squeeze", "squeeze"), _collapse("squeeze", "squeeze"), name="squeeze_squeeze",
         example=(lambda x: jnp.squeeze(jnp.squeeze(x, 0), 1), _f32(1, 3, 1, 5))),                 # squeeze(squeeze(x)) -> reshape(x)
    rule(_chain("squeeze", "broadcast_in_dim"), _collapse("squeeze", "broadcast_in_dim"),
         name="squeeze_broadcast", example=_ex_squeeze_broadcast),  # squeeze(expand_dims(x)) -> reshape(x); squeeze(bcast(s)) -> bcast(s)
    rule(_chain("broadcast_in_dim", "reshape"), _collapse("broadcast_in_dim", "reshape"),
         name="expand_reshape", example=(lambda x: x.reshape(15)[None], _M)),                      # expand_dims(reshape(x)) -> reshape(x)
    rule(_chain("broadcast_in_dim", "squeeze"), _collapse("broadcast_in_dim", "squeeze"),
         name="expand_squeeze", example=(lambda x: jnp.squeeze(x, 0)[:, None], _M1)),              # expand_dims(squeeze(x)) -> reshape(x)
    rule(_chain("broadcast_in_dim", "broadcast_in_dim"), _broadcast_broadcast, name="broadcast_broadcast",
         example=(lambda x: jnp.broadcast_to(jnp.broadcast_to(x, (4, 5)), (2, 4, 5)), _f32(5))),   # bcast(bcast(x)) -> bcast(x)
    rule(_chain("transpose", "transpose"), _transpose_transpose, name="transpose_transpose",
         example=_ex_transpose_transpose),  # transpose(transpose(x, p), q) -> transpose(x, p[q])
    rule(_chain("transpose", "broadcast_in_dim"), _transpose_broadcast, name="transpose_broadcast",
         example=(lambda x: jnp.broadcast_to(x, (4, 5)).T, _f32(5))),                              # transpose(bcast(x)) -> bcast(x)
    # reductions over axes of size 1
    rule(Pat("reduce_sum", X, params="p"), _reduce_unit_axes, name="sum_unit_axes",
         example=_unit_axis(jnp.sum)),                                                             # sum(x, size-1 axes) -> reshape(x)
    rule(Pat("reduce_prod", X, params="p"), _reduce_unit_axes, name="prod_unit_axes",
         example=_unit_axis(jnp.prod)),                                                            # prod(x, size-1 axes) -> reshape(x)
    rule(Pat("reduce_max", X, params="p"), _reduce_unit_axes, name="max_unit_axes",
         example=_unit_axis(jnp.max)),                                                             # max(x, size-1 axes) -> reshape(x)
    rule(Pat("reduce_min", X, params="p"), _reduce_unit_axes, name="min_unit_axes",
         example=_unit_axis(jnp.min)),                                                             # min(x, size-1 axes) -> reshape(x)
    rule(Pat("reduce_and", X, params="p"), _reduce_unit_axes, name="and_unit_axes",
         example=_unit_axis(jnp.all, jnp.bool_)),                                                  # all(x, size-1 axes) -> reshape(x)
    rule(Pat("reduce_or", X, params="p"), _reduce_unit_axes, name="or_unit_axes",
         example=_unit_axis(jnp.any, jnp.bool_)),                                                  # any(x, size-1 axes) -> reshape(x)
    rule(Pat("argmax", X, params="p"), _arg_unit_axes, name="argmax_unit_axes",
         example=_unit_axis(jnp.argmax)),                                                          # argmax(x, size-1 axis) -> 0
    rule(Pat("argmin", X, params="p"), _arg_unit_axes, name="argmin_unit_axes",
         example=_unit_axis(jnp.argmin)),                                                          # argmin(x, size-1 axis) -> 0
    # converts
    rule(Pat("convert_element_type", Pat("convert_element_type", X, name="y"), params="po"), _convert_convert,
         name="convert_convert", example=_ex_convert_convert),  # convert(convert(x, wider), B) -> convert(x, B); -> x when B is x's type
    # constant folding (literal operands)
    rule(Pat("neg", _lit("a")), _fold(_float_op(np.negative), _A), name="fold_neg", example=_ex_fold_neg),  # -c -> c'
    rule(Pat("abs", _lit("a")), _fold(_float_op(np.abs), _A), name="fold_abs", example=_ex_fold_abs),  # |c| -> c'
    rule(Pat("sqrt", _lit("a")), _fold(_float_only(np.sqrt), _A), name="fold_sqrt", example=_ex_fold_sqrt),  # sqrt(c) -> c'
    rule(Pat("square", _lit("a")), _fold(_float_op(lambda a: a * a), _A), name="fold_square",
         example=_ex_fold_square),                                                                 # square(c) -> c'
    rule(Pat("integer_pow", Pat.lit(name="c"), params="p"), _fold_integer_pow, name="fold_integer_pow",
         example=_ex_fold_integer_pow),                                                            # c^n -> c'
    rule(Pat("convert_element_type", Pat.lit(name="c")), _fold_convert, name="fold_convert",
         example=_ex_fold_convert),                                                                # convert(c) -> c'
    rule(_fold2("add"), _fold(_float_op(np.add), _AB), name="fold_add", example=_ex_fold_add),     # a + b -> c
    rule(_fold2("sub"), _fold(_float_op(np.subtract), _AB), name="fold_sub", example=_ex_fold_sub),  # a - b -> c
    rule(_fold2("mul"), _fold(_float_op(np.multiply), _AB), name="fold_mul", example=_ex_fold_mul),  # a * b -> c
    rule(_fold2("div"), _fold(_float_only(np.divide), _AB), name="fold_div", example=_ex_fold_div),  # a / b -> c  (floats)
    rule(_fold2("max"), _fold(_minmax(True), _AB), name="fold_max", example=_ex_fold_max),         # max(a, b) -> c
    rule(_fold2("min"), _fold(_minmax(False), _AB), name="fold_min", example=_ex_fold_min),        # min(a, b) -> c
    rule(_fold2("eq"), _fold(_compare(np.equal), _AB), name="fold_eq", example=_ex_compare(lax.eq)),  # a == b -> bool
    rule(_fold2("ne"), _fold(_compare(np.not_equal), _AB), name="fold_ne", example=_ex_compare(lax.ne)),  # a != b -> bool
    rule(_fold2("lt"), _fold(_compare(np.less), _AB), name="fold_lt", example=_ex_compare(lax.lt)),  # a < b -> bool
    rule(_fold2("le"), _fold(_compare(np.less_equal), _AB), name="fold_le", example=_ex_compare(lax.le)),  # a <= b -> bool
    rule(_fold2("gt"), _fold(_compare(np.greater), _AB), name="fold_gt", example=_ex_compare(lax.gt)),  # a > b -> bool
    rule(_fold2("ge"), _fold(_compare(np.greater_equal), _AB), name="fold_ge", example=_ex_compare(lax.ge)),  # a >= b -> bool
    rule(_fold2("and"), _fold(_int_or_bool_op(np.bitwise_and), _AB), name="fold_and", example=_ex_fold_and),  # a & b -> c
    rule(_fold2("or"), _fold(_int_or_bool_op(np.bitwise_or), _AB), name="fold_or", example=_ex_fold_or),  # a | b -> c
    rule(Pat("not", _lit("a")), _fold(_int_or_bool_op(np.invert), _A), name="fold_not", example=_ex_fold_not),  # ~a -> c
    rule(Pat("select_n", Pat.lit(name="p"), args="cases"), _fold_select, name="fold_select",
         example=_ex_fold_select),                                                                 # select_n(c, *xs) -> xs[c]
], soundness="exact", description=__doc__.split("\n\n")[0])
