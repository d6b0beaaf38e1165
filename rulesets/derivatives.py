"""``rulesets.derivatives``: identities that make autodiff's backward passes as cheap as hand-derived ones.

JAX builds a VJP mechanically: every primitive's transpose rule is applied
in turn, so the backward pass of ``sin(a*x)**2 / a`` multiplies ``2*sin``
by ``cos`` where one ``sin(2ax)`` would do, divides by ``a`` and multiplies
by ``a`` again, keeps the gradient of ``a`` as two full-size reductions
glued together by reshapes, negations and sums over size-1 axes, and still
computes the primal output nobody reads. The rules here undo that.

* **Products** are rewritten as a whole. :func:`product_tree` reads a tree
  of ``mul``, ``div``, ``neg`` and ``integer_pow``; :func:`simplify`
  combines its leaves: equal bases add their exponents (``x**-2 * x**2``; a
  cancellation only where the base is known non-zero), ``sin(x)*cos(x)``
  becomes ``sin(2x)/2`` where ``2x`` cannot overflow (:func:`doubles_safely`),
  ``sinh(x)/cosh(x)`` becomes ``tanh(x)``,
  ``exp(x)/(1+exp(x))`` becomes ``logistic(x)`` (the derivatives of
  ``log cosh`` and ``softplus``), several ``exp`` become one, literals fold; and the
  replacement keeps every subtree the change did not touch (:func:`pieces`),
  so the rest of the program, and what XLA stores, stays as it was. One
  procedural rule per product primitive does this, so no commutativity or
  associativity rule is needed to find ``2*sin*cos`` spread over a chain.
* **Reductions**: a factor constant along the reduced axes moves out of
  ``reduce_sum``; sums over the same axes merge (and split), where that
  saves 1% of the program or more (``SUMS_MIN_SAVING``: less is a multiply
  moved out of a fused reduction, not worth a changed rounding); ``neg``
  commutes with ``reduce_sum``; reductions over size-1 axes are reshapes
  (``rulesets.algebra``'s rule, as are ``x + -y -> x - y``, ``x - -y -> x + y``
  and ``reshape(reshape(x))``: this pack includes those rules, and no copy).
* **Trigonometry, exp and log**: Pythagoras, ``cos(-x)``, double angles,
  ``tan`` as ``sin/cos`` (so it shares them), ``log(exp(x))``,
  ``exp(log(x))`` for non-negative ``x``, ``1 - logistic(x)``.
* **A sin stored once**: where ``cos(x)`` is computed too, ``sin(x)`` may become
  ``select(|x| < tiny, x, sin x)``, bitwise the same, which XLA:CPU stores once
  instead of computing ``sin`` again in each loop that reads it
  (``rulesets/_sincos.py``; ``derivatives_exact``).
* **A kernel**: ``sin(b x)**2 / b`` (seed 000) may become a ``jax.custom_vjp`` with the same forward whose
  backward computes both gradients from one ``sin`` and one ``cos`` an element, over blocks of the leading
  axis (``rulesets/_sin2.py``; ``derivatives_kernels``, decided on a gradient's joint program: ``jointly``).
* **Dead primal code** needs no rule: extraction starts from the outputs, so
  a primal value that no gradient reads is never emitted.

The pack is ``identity`` class: true in real arithmetic, and on finite
inputs never further from the exact result than the original program, up
to the tolerance (``tests/test_derivatives.py`` checks each rule against
the program evaluated in float64). Its ``derivatives_exact`` part changes
no bit of any result. Rewrites that fail that test live in
:data:`derivatives_fastmath` (``fastmath`` class), which no other pack
includes: cancellations without a fact that the value is non-zero
(``a * (g / a) -> g`` turns the NaN at ``a = 0`` into a number), double
angles of an argument that may be huge (``sin(2x)`` is NaN at ``x = 3e38``
in float32, where ``2 sin x cos x`` is a number), and
``log x + log y -> log(x*y)``, whose product underflows where the sum of
logs does not.

Rule names carry a topic prefix (``trig_``, ``explog_``, ``prod_``, ``red_``,
``sign_``) so they never collide with another pack's names.

>>> import jax, jax.numpy as jnp
>>> from rewrite import rewrite
>>> from rulesets.derivatives import derivatives
>>> from rulesets.derivatives import derivatives_fastmath
>>> def f(x):
...     return 2.0 * jnp.sin(x) * jnp.cos(x)
>>> [e.primitive.name for e in rewrite(f, rulesets=[derivatives]).jaxpr(jnp.ones(3)).eqns]  # 2x may overflow
['sin', 'mul', 'cos', 'mul']
>>> [e.primitive.name for e in rewrite(lambda t: f(jnp.tanh(t)), rulesets=[derivatives]).jaxpr(jnp.ones(3)).eqns]
['tanh', 'mul', 'sin']
>>> [e.primitive.name for e in rewrite(f, rulesets=[derivatives + derivatives_fastmath]).jaxpr(jnp.ones(3)).eqns]
['mul', 'sin']
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import rulesets
from rewrite import Limits, Pat, Ruleset, Tolerance, Value, procedural, rule
from rulesets._examples import f32
from rulesets._sin2 import derivatives_kernels
from rulesets._sincos import sin_stored

__all__ = ["derivatives", "derivatives_fastmath", "doubles_safely", "product_tree", "simplify", "pieces", "Factor"]

X, Y = Pat.var("x"), Pat.var("y")
_algebra = rulesets.algebra


_S = f32(3, 4)  # the shape the Pat rules' example programs run at

#: How far :func:`product_tree` looks: product nodes walked, and leaves kept.
_MAX_NODES = 24
_MAX_FACTORS = 10


# ---------------------------------------------------------------------- products as trees of factors
@dataclasses.dataclass(eq=False)
class Factor:
    """A node of a product tree: a value raised to ``e`` in the whole product.

    ``op`` is ``"leaf"`` (a value that is not a product), ``"lit"`` (a scalar
    literal ``lit``), or the product primitive that made ``value``
    (``"mul"``, ``"div"``, ``"neg"``, ``"integer_pow"``) with its
    ``children``.
    """

    value: Value
    e: int
    op: str
    children: list["Factor"] = dataclasses.field(default_factory=list)
    lit: float = 1.0

    def leaves(self) -> list["Factor"]:
        if not self.children:
            return [self]
        return [leaf for c in self.children for leaf in c.leaves()]


_PRODUCTS = frozenset(("mul", "div", "neg", "integer_pow"))


def _product_node(v: Value) -> Any:
    """The node that makes ``v`` a product, preferring the oldest (the program's own) of several."""
    found = [n for n in v.nodes if n.prim in _PRODUCTS]
    if len(found) < 2:
        return found[0] if found else None
    return min(found, key=lambda n: max((o.name for o in n.operands), default=0))


def _lit_power(lit: float, e: int) -> float | None:
    """``lit ** e`` if it is a finite number; ``None`` for 0 to a negative power, an overflow, inf or NaN."""
    try:
        v = lit ** e
    except (ZeroDivisionError, OverflowError):
        return None
    return v if math.isfinite(v) else None


def _is_mask(v: Value) -> bool:
    """Is ``v`` a 0/1 mask: a float converted from a bool (``(k2 != 0).astype(jnp.float32)``)?"""
    n = v.node("convert_element_type")
    return n is not None and n.operands[0].dtype == np.bool_


def product_tree(v: Value) -> Factor | None:
    """The tree of ``mul``, ``div``, ``neg`` and ``integer_pow`` at ``v`` (at most ``_MAX_NODES`` of them).

    ``None`` when ``v`` is not a floating product. Of several product nodes
    in one class the oldest is followed, so that a class rewritten before is
    read the way the program wrote it. A product with a 0/1 mask (:func:`_is_mask`) is a leaf, taken whole:
    XLA computes ``mask * x`` as ``select(mask, x, 0)``, so a program may mask out a term that is infinite or NaN
    there (jax-md's PME energy: ``(k2 != 0) * (c * exp(-k2 / 4a^2) / k2)``, whose ``k2`` is 0 at ``k = 0``), and a
    product rebuilt with that division outside the mask (``mask * exp * s / k2``) is NaN under ``jit`` where the
    program is not.
    """
    if not v.is_floating or v.weak_type or _product_node(v) is None:
        return None
    budget = [_MAX_NODES]

    def walk(w: Value, e: int) -> Factor:
        lit = w.literal if w.ndim == 0 else None
        if isinstance(lit, float) and _lit_power(lit, e) is not None:
            return Factor(w, e, "lit", lit=lit)
        node = _product_node(w) if budget[0] > 0 else None
        if node is None or (node.prim == "mul" and any(_is_mask(o) for o in node.operands)):
            return Factor(w, e, "leaf")
        budget[0] -= 1
        powers = {"mul": (e, e), "div": (e, -e), "neg": (e,)}.get(node.prim) or (e * int(node.params["y"]),)
        return Factor(w, e, node.prim, [walk(o, k) for o, k in zip(node.operands, powers)])

    tree = walk(v, 1)
    del walk  # a recursive closure is a reference cycle: unbroken, it keeps the e-graph from its pool
    return None if len(tree.leaves()) > _MAX_FACTORS else tree


def pieces(tree: Factor, drop: Callable[[Factor], bool]) -> tuple[float, list[tuple[Value, int]]]:
    """What is left of the product without the dropped leaves: maximal untouched subtrees, and a coefficient.

    Subtrees that contain no dropped leaf are kept whole, as the values the
    program already has, so a rewrite changes as little of the program as it
    can (XLA decides what to store by the shape of the expression). Literals
    and negations on the paths to dropped leaves fold into the coefficient.
    """
    coeff, kept, _ = split(tree, lambda f: not drop(f), into_no=True)
    return coeff, kept


def split(tree: Factor, pred: Callable[[Factor], bool], *, into_no: bool = False
          ) -> tuple[float, list[tuple[Value, int]], list[tuple[Value, int]]]:
    """Split a product into maximal subtrees whose leaves all satisfy ``pred``, and those whose leaves none do.

    Literals and negations on mixed paths fold into the coefficient. With
    ``into_no``, subtrees whose leaves all fail ``pred`` are taken apart too
    (their negations fold into the coefficient, their leaves go to the second list).
    """
    coeff = 1.0
    yes: list[tuple[Value, int]] = []
    no: list[tuple[Value, int]] = []

    def go(n: Factor) -> None:
        nonlocal coeff
        marks = {pred(f) for f in n.leaves()}
        if marks == {True}:
            if n.op == "lit":
                coeff *= n.lit ** n.e
            else:
                yes.append((n.value, n.e))
        elif marks == {False} and not (into_no and n.children):
            no.append((n.value, n.e))
        else:
            if n.op == "neg":
                coeff *= (-1.0) ** n.e
            for c in n.children:
                go(c)

    go(tree)
    del go  # a recursive closure is a reference cycle, and this one holds the matched values
    return coeff, yes, no


@dataclasses.dataclass
class Simplified:
    """A product tree after :func:`simplify`: leaves to drop, what replaces them, and the coefficient."""

    drop: set[int]
    new: list[tuple[str, Any, int]]   # (kind, value or [(k, value)], power); kind "exp" or one of _DERIVED
    coeff: float
    changes: list[str]


def _pairs(power: dict[int, tuple[Value, int, int]], prim: str, partner: str) -> Any:
    """``(name, partner's name, x)`` for each base ``prim(x)`` whose ``partner(x)`` is a base of the same type."""
    partners = {n.operands[0].name: name for name, (v, _, _) in power.items() if (n := v.node(partner)) is not None}
    for name, (v, _, _) in list(power.items()):
        n = v.node(prim)
        if n is not None and n.operands[0].name in partners and power[partners[n.operands[0].name]][0].aval == v.aval:
            yield name, partners[n.operands[0].name], n.operands[0]


#: Primitives whose results are at most 1 in magnitude (or NaN).
_AT_MOST_ONE = frozenset(("sin", "cos", "tanh", "logistic", "erf"))


def doubles_safely(x: Value) -> bool:
    """Is ``2 * x`` known not to overflow, whatever the inputs? (Then ``sin(2x)`` is ``2 sin x cos x``.)

    The double-angle forms compute ``2x``, which overflows to infinity where
    ``|x|`` exceeds half the largest float, and ``sin(inf)`` is NaN where
    ``sin(x)*cos(x)`` is a number: an identity rule must hold for every
    finite input. Known here: a literal of at most half the largest float, a
    value of at most 1 (``sin``, ``cos``, ``tanh``, ``logistic``, ``erf``),
    a value converted from a type whose values are that small (``float16``
    or ``int32`` to ``float32``). Anything else, an input say, may be huge.

    >>> import jax.numpy as jnp
    >>> from rewrite import explain
    >>> from rulesets.derivatives import derivatives
    >>> def f(x):
    ...     return 2.0 * jnp.sin(x) * jnp.cos(x)
    >>> explain(f, jnp.ones(3), rulesets=[derivatives]).fired.get("prod_mul")  # x may be 3e38
    >>> explain(lambda t: f(jnp.tanh(t)), jnp.ones(3), rulesets=[derivatives]).fired["prod_mul"]
    1
    """
    if not x.is_floating:
        return False
    half = float(jnp.finfo(x.dtype).max) / 2
    lit = x.literal
    if isinstance(lit, (int, float)):
        return abs(lit) <= half
    for n in x.nodes:
        if n.prim in _AT_MOST_ONE:
            return True
        if n.prim == "convert_element_type" and n.operands:
            src = np.dtype(n.operands[0].dtype)
            if src == np.bool_:
                return True
            info = jnp.iinfo(src) if jnp.issubdtype(src, jnp.integer) else jnp.finfo(src)
            if max(abs(float(info.min)), float(info.max)) <= half:
                return True
    return False


def simplify(tree: Factor, *, fastmath: bool = False) -> Simplified:
    """Combine a product's leaves: powers of one base, ``sin(x)*cos(x)``, ``sinh(x)/cosh(x)``,
    ``exp(x)/(1+exp(x))``, several ``exp``, literals.

    Powers of opposite signs cancel only when the base is known to be
    non-zero (a fact), or under ``fastmath``; otherwise the positive and the
    negative powers combine separately. ``sin(x)*cos(x)`` becomes
    ``sin(2x)/2`` only where ``2x`` cannot overflow (:func:`doubles_safely`),
    or under ``fastmath``.
    """
    leaves = tree.leaves()
    out = Simplified(set(), [], 1.0, [])
    lits = [f for f in leaves if f.op == "lit"]
    if len(lits) >= 2:
        out.drop.update(id(f) for f in lits)
        out.coeff = math.prod(f.lit ** f.e for f in lits)
        out.changes.append("literals")
    bases: dict[int, list[Factor]] = {}
    for f in (f for f in leaves if f.op == "leaf"):
        bases.setdefault(f.value.name, []).append(f)
    # Powers of one base.
    power = {name: (fs[0].value, sum(f.e for f in fs if f.e > 0), -sum(f.e for f in fs if f.e < 0))
             for name, fs in bases.items()}  # name -> (value, positive power, negative power)
    for name, (v, pos, neg) in list(power.items()):
        fs = bases[name]
        if pos and neg and (fastmath or v.nonzero):
            k = min(pos, neg)
            power[name] = (v, pos - k, neg - k)
            out.changes.append("cancel")
        elif sum(1 for f in fs if f.e > 0) < 2 and sum(1 for f in fs if f.e < 0) < 2:
            continue
        else:
            out.changes.append("power")
        out.drop.update(id(f) for f in fs)
    # The steps below combine bases of these primitives alone: one read of each base's class (in the order the
    # steps read them) says whether any is there; a product of other bases (most of a gradient's) skips them.
    if any(n.prim in ("sin", "cos", "sinh", "cosh", "add", "exp") for v, _, _ in power.values() for n in v.nodes):
        # sin(x)^p * cos(x)^q: a pair is sin(2x)/2 (a pair of reciprocals, 2/sin(2x)). Only where 2x cannot
        # overflow (doubles_safely): at x = 3e38 (float32) sin(2x) is NaN and sin(x)*cos(x) a number.
        for name, sname, arg in _pairs(power, "cos", "sin"):
            (v, pos, neg), (sv, spos, sneg) = power[name], power[sname]
            kp, kn = min(spos, pos), min(sneg, neg)
            if not (kp or kn) or not (fastmath or doubles_safely(arg)):
                continue
            power[sname] = (sv, spos - kp, sneg - kn)
            power[name] = (v, pos - kp, neg - kn)
            out.drop.update(id(f) for f in bases[sname] + bases[name])
            if kp:
                out.new.append(("sin2", arg, kp))
                out.coeff *= 0.5 ** kp
            if kn:
                out.new.append(("sin2", arg, -kn))
                out.coeff *= 2.0 ** kn
            out.changes.append("double_angle" if doubles_safely(arg) else "double_angle_unbounded")
        # sinh(x) / cosh(x) = tanh(x), one cheap function for two costly ones.
        for name, cname, arg in _pairs(power, "sinh", "cosh"):
            (v, pos, neg), (cv, cpos, cneg) = power[name], power[cname]
            k, k2 = min(pos, cneg), min(neg, cpos)
            if not (k or k2):
                continue
            power[name] = (v, pos - k, neg - k2)
            power[cname] = (cv, cpos - k2, cneg - k)
            out.drop.update(id(f) for f in bases[name] + bases[cname])
            if k - k2:
                out.new.append(("tanh", arg, k - k2))
            out.changes.append("tanh")
        # exp(x) / (1 + exp(x)) = logistic(x), and 1 / (1 + exp(x)) = logistic(-x).
        for name, (v, pos, neg) in list(power.items()):
            add = v.node("add") if neg else None
            if add is None or len(add.operands) != 2:
                continue
            a, b = add.operands
            other = b if a.literal == 1.0 else a if b.literal == 1.0 else None
            ex = other.node("exp") if other is not None and other.aval == v.aval else None
            if ex is None:
                continue
            arg = ex.operands[0]
            k = min(neg, power[other.name][1]) if other.name in power else 0
            out.drop.update(id(f) for f in bases[name])
            if k:
                ov, opos, oneg = power[other.name]
                power[other.name] = (ov, opos - k, oneg)
                out.drop.update(id(f) for f in bases[other.name])
                out.new.append(("logistic", arg, k))
            if neg - k:
                inner = arg.node("neg")
                # 1 / (1 + exp(-y)) is logistic(y) itself
                out.new.append(("logistic", inner.operands[0], neg - k) if inner is not None
                               else ("logistic_neg", arg, neg - k))
            power[name] = (v, pos, 0)
            out.changes.append("logistic")
        # Every exp in one: exp(a)^i * exp(b)^j = exp(i*a + j*b).
        exps = [(name, ex.operands[0], pos - neg) for name, (v, pos, neg) in power.items()
                if (ex := v.node("exp")) is not None and (pos or neg)]
        if len(exps) >= 2:
            for name, _, _ in exps:
                power[name] = (power[name][0], 0, 0)
                out.drop.update(id(f) for f in bases[name])
            out.new.append(("exp", [(k, a) for _, a, k in exps], 1))
            out.changes.append("exp")
    for name, fs in bases.items():
        if id(fs[0]) in out.drop:
            v, pos, neg = power[name]
            out.new.extend(("v", v, e) for e in (pos, -neg) if e)
    return out


# The replacements below are written with ``lax``, not ``jnp``: each ``jnp`` function is a ``jit`` of its
# own, which costs several times as much to trace at a shape met for the first time, and a rewrite
# traces a few dozen replacements at new shapes. Their
# operands share a dtype (a product's factors do), and a number is a constant of that dtype (``_k``),
# as ``jnp`` promotes it: the jaxprs are the ones ``jnp`` makes, literal for literal.


def _k(c: float, like: Any) -> Any:
    """The number ``c`` as a constant of ``like``'s dtype (``jnp``'s promotion of a Python number)."""
    return np.asarray(c, like.dtype)


#: How a replacement factor is computed from its argument.
_DERIVED: dict[str, Callable[[Any], Any]] = {
    "v": lambda x: x, "sin2": lambda x: lax.sin(lax.mul(_k(2, x), x)), "tanh": lax.tanh, "logistic": lax.logistic,
    "logistic_neg": lambda x: lax.logistic(lax.neg(x))}


def _power(b: Any, k: int) -> Any:
    return b if k == 1 else lax.integer_pow(b, k)


def _broadcast(x: Any, shape: tuple[int, ...]) -> Any:
    """``jnp.broadcast_to(x, shape)``, without its ``jit``."""
    if tuple(x.shape) == tuple(shape):
        return x
    return lax.broadcast_in_dim(x, shape, tuple(range(len(shape) - x.ndim, len(shape))))


def build(m: Any, coeff: float, kept: list[tuple[Value, int]], new: list[tuple[str, Any, int]],
          shape: tuple[int, ...], dtype: Any) -> Any:
    """Insert ``coeff * prod(kept) * prod(new)`` (negative powers divide) as a term of ``shape`` and ``dtype``."""
    inputs: list[Value] = [v for v, _ in kept]
    for kind, v, _ in new:
        inputs.extend([a for _, a in v] if kind == "exp" else [v])
    # The closure holds plain data only (exponents, kinds, shapes), so that the
    # same replacement met again (in another layer, say) reuses its trace.
    kept_e = [e for _, e in kept]
    new_e = [(kind, [k for k, _ in v] if kind == "exp" else None, e) for kind, v, e in new]

    def fn(*vals: Any) -> Any:
        it = iter(vals)
        num, den = [], []
        for e, x in zip(kept_e, it):
            (num if e > 0 else den).append(_power(x, abs(e)))
        for kind, ks, e in new_e:
            if kind == "exp":
                terms = [a if k == 1 else lax.neg(a) if k == -1 else lax.mul(_k(k, a), a) for k, a in zip(ks, it)]
                base = lax.exp(functools.reduce(lax.add, terms))
            else:
                x = next(it)
                base = _DERIVED[kind](x)
            (num if e > 0 else den).append(_power(base, abs(e)))
        top, bottom = _prod(num), _prod(den)
        if top is None and bottom is None:
            return lax.full(shape, coeff, dtype)
        if top is None:
            out = lax.div(_k(coeff, bottom), bottom)
        else:
            out = _scaled(coeff, top if bottom is None else lax.div(top, bottom))
        return _broadcast(lax.convert_element_type(out, dtype), shape)

    return m.trace(fn, *inputs)


def _prod(xs: list[Any]) -> Any:
    return functools.reduce(lax.mul, xs) if xs else None


def _scaled(coeff: float, x: Any) -> Any:
    return lax.neg(x) if coeff == -1.0 else x if coeff == 1.0 else lax.mul(_k(coeff, x), x)


def _normalize(fastmath: bool) -> Any:
    @procedural
    def normalize(m):
        root = m.root
        tree = product_tree(root)
        if tree is None:
            return None
        simp = simplify(tree, fastmath=fastmath)
        if not simp.changes or (fastmath and not {"cancel", "double_angle_unbounded"} & set(simp.changes)):
            return None  # nothing saved (under fastmath: the identity pack makes the rest)
        coeff, kept = pieces(tree, lambda f: id(f) in simp.drop)
        if not math.isfinite(coeff * simp.coeff):
            return None  # literals whose product overflows
        return build(m, coeff * simp.coeff, kept, simp.new, root.shape, root.dtype)

    return normalize


# ---------------------------------------------------------------------- reductions
@procedural
def _sum_pull(m):
    """``sum(b * x) -> b * sum(x)`` when ``b`` is broadcast along the reduced axes (and coefficients)."""
    p, x, out = m.params("p"), m["x"], m.root
    axes = tuple(p.axes)
    if p.sharded or not x.is_floating:
        return None
    tree = product_tree(x)
    if tree is None:
        return None
    ndim = x.ndim

    def const(f: Factor) -> bool:
        shape = f.value.shape
        return f.op == "lit" or len(shape) == 0 or (len(shape) == ndim and all(shape[a] == 1 for a in axes))

    coeff, outer, inner = split(tree, const)
    if not inner or (not outer and coeff == 1.0) or not math.isfinite(coeff):
        return None
    keep = [a for a in range(ndim) if a not in axes]
    inner_v = build(m, 1.0, inner, [], x.shape, x.dtype)
    outer_e = [e for _, e in outer]
    out_shape, out_dtype = out.shape, out.dtype  # plain data in the closure: see build

    def fn(s: Any, *cs: Any) -> Any:
        total = lax.reduce_sum_p.bind(s, axes=axes, out_sharding=None)  # the matched sum (unsharded: see above)
        num, den = [], []
        for e, c in zip(outer_e, cs):
            if c.ndim:
                c = lax.reshape(c, tuple(c.shape[a] for a in keep))
            (num if e > 0 else den).append(_power(c, abs(e)))
        if num:
            total = lax.mul(_prod(num), total)
        if den:
            total = lax.div(total, _prod(den))
        return _broadcast(lax.convert_element_type(_scaled(coeff, total), out_dtype), out_shape)

    return m.trace(fn, inner_v, *[v for v, _ in outer])


# ---------------------------------------------------------------------- guards
def _floating(*vs: Value) -> bool:
    return all(v.is_floating for v in vs)


def _nonneg(x: Value) -> bool:
    return x.is_floating and x.nonneg


# ---------------------------------------------------------------------- the rules
# A Pat rule has no function to trace, so each names an example program it fires in (for
# rewrite.testing.check_ruleset): two float32 arrays of _S's shape unless said otherwise.
def _vjp_of(f):
    return lambda x, g: jax.vjp(f, x)[1](g)[0]


_sum0, _sum1 = (lambda x: jnp.sum(x, axis=0)), (lambda x: jnp.sum(x, axis=1))
_SUM_SUM = Pat({"add", "sub"}, Pat("reduce_sum", X, params="p"), Pat("reduce_sum", Y, params="q"), params="op")
_SUM_OF = Pat("reduce_sum", Pat({"add", "sub"}, X, Y, name="s", params="op"), params="p")
_SINCOS = _vjp_of(lambda x: jnp.sin(x) ** 2)  # sin x and cos x of one x
_COS2_SIN2 = Pat("sub", Pat("integer_pow", Pat("cos", X), params="p"), Pat("integer_pow", Pat("sin", X), params="q"))

# Bitwise exact: IEEE defines x - y as x + (-y), add_any is add, and a sum over size-1 axes adds
# nothing. x + -y, x - -y, reshape(reshape(x)) and reductions over size-1 axes are algebra's rules,
# used here as they are.
derivatives_exact = Ruleset("derivatives_exact", [
    *[_algebra.rule(n) for n in ("add_neg", "sub_neg", "reduce_unit_axes", "reshape_reshape")],  # x + -y -> x - y; ...
    rule(lambda x, y: lax.add(-x, y), lambda x, y: y - x, name="sign_neg_add", when=_floating),  # -x + y -> y - x
    rule(Pat("add_any", X, Y), lambda x, y: lax.add(x, y), name="sign_add_any",                   # add_any(x, y) -> x + y
         # add_any is typed as x, x + y weak only if both are; an extended dtype (a user's element type) adds by
         # its own rule, and lax.add refuses it
         when=lambda x, y: (not x.weak_type or y.weak_type) and jnp.issubdtype(x.dtype, jnp.number),
         example_program=(_vjp_of(lambda v: v * jnp.sin(v)), (_S, _S))),
    rule(Pat("reshape", Pat("neg", X), params="p"), lambda x, p: lax.neg(p.bind(x)), name="red_reshape_neg",  # reshape(-x) -> -reshape(x)
         when=lambda p: p.dimensions is None, example_program=(lambda x: (-(x.reshape(12))).reshape(3, 4), (_S,))),
    rule(Pat("sin", X), sin_stored, name="trig_sin_stored", example_program=(_SINCOS, (_S, _S))),  # sin x -> select(|x| < tiny, x, sin x)
], soundness="exact", description="sign and product identities that keep every bit")
trig = Ruleset("derivatives_trig", [
    rule(lambda x: jnp.cos(-x), lambda x: jnp.cos(x), name="trig_cos_neg"),                                 # cos(-x) -> cos(x)
    rule(lambda x: jnp.sin(-x), lambda x: -jnp.sin(x), name="trig_sin_neg"),                                # sin(-x) -> -sin(x)
    rule(lambda x: jnp.sin(x) ** 2 + jnp.cos(x) ** 2, lambda x: jnp.ones_like(x), name="trig_pythagoras"),  # sin²x + cos²x -> 1
    rule(lambda x: 1.0 - jnp.sin(x) ** 2, lambda x: jnp.cos(x) ** 2, name="trig_one_minus_sin2"),         # 1 - sin²x -> cos²x
    rule(lambda x: 1.0 - jnp.cos(x) ** 2, lambda x: jnp.sin(x) ** 2, name="trig_one_minus_cos2"),         # 1 - cos²x -> sin²x
    rule(_COS2_SIN2, lambda x: jnp.cos(2 * x), name="trig_cos_double",                                   # cos²x - sin²x -> cos 2x
         when=lambda x, p, q: p.y == q.y == 2 and doubles_safely(x),                                   # (2x must not overflow)
         example_program=(lambda x: jnp.cos(jnp.tanh(x)) ** 2 - jnp.sin(jnp.tanh(x)) ** 2, (_S,))),
    rule(lambda x: jnp.tan(x), lambda x: jnp.sin(x) / jnp.cos(x), name="trig_tan"),                         # tan x -> sin x / cos x (shares them)
], soundness="identity",
    description="sin, cos and tan of the same argument, paired into one transcendental")

explog = Ruleset("derivatives_explog", [
    rule(lambda x: jnp.log(jnp.exp(x)), lambda x: x, name="explog_log_exp"),                                # log(exp x) -> x
    rule(lambda x: jnp.exp(jnp.log(x)), lambda x: x, name="explog_exp_log", when=_nonneg),                  # exp(log x) -> x, x >= 0
    rule(lambda x: 1.0 - lax.logistic(x), lambda x: lax.logistic(-x), name="explog_one_minus_logistic"),   # 1 - σ(x) -> σ(-x)
], soundness="identity",
    description="exp and log inverses and sigmoid forms")

products = Ruleset("derivatives_products", [
    rule(Pat("mul", X, Y), _normalize(False), name="prod_mul",        # x*y: powers of a base; sin·cos -> sin 2x / 2; sinh/cosh -> tanh
         example_program=(lambda x, g: g * (2.0 * jnp.sin(jnp.tanh(x))) * jnp.cos(jnp.tanh(x)), (_S, _S))),  # exp/(1+exp) -> σ; exp·exp -> exp(+)
    rule(Pat("div", X, Y), _normalize(False), name="prod_div",        # x/y -> the same normal forms, across the division
         example_program=(lambda x, g: (g * jnp.sinh(x)) / (2.0 * jnp.cosh(x)), (_S, _S))),
    rule(Pat("integer_pow", X), _normalize(False), name="prod_pow",   # (x*x)**3 -> x**6
         example_program=(lambda x: (x * x) ** 3, (_S,))),
], soundness="identity",
    description="products and quotients normalised: powers of a base gathered, pairs made one function")

#: What reordering sums must save, as a fraction of the program's price, before its nodes are used
#: (``Ruleset.min_saving``). Pulling a factor out of a sum, or merging and splitting sums, changes the
#: rounding; where it saves only a multiply or an add per element inside a fused reduction, which XLA:CPU
#: runs at the speed of memory, the gain is within the model's error: seed 000's VJP, rewritten so, was
#: priced 0.5% cheaper and measured 0.80-0.93x
#: of the program as written on two idle cores (benchmarks/results/log.md). Below the floor the sums stay
#: as written; above it they are still taken (``(x * b).sum(0)`` pulled, priced 1.14x; ``x.sum(0) + y.sum(0)``
#: merged, 1.11x: tests/test_derivatives.py).
SUMS_MIN_SAVING = 0.01

#: The rounds the sums' rules run in (``Ruleset.limits``). ``red_split`` splits ``sum(a + b)`` into ``sum a + sum b``;
#: over a chain of additions it goes one addition deeper a round, since each partial sum it builds is a new class
#: for the next round to split (``red_merge`` and, over size-1 axes, ``reduce_unit_axes`` take it up): a sum over
#: the batch of a residual stream's gradient (16 added terms) kept the decision corpus's language-model steps
#: saturating for 17-18 rounds, their last seven to nine firing those three rules alone (``ecosystem_flax_long_context_step``'s
#: program final from round 6). Eight rounds: no emitted program of the ecosystem suite, golden file or golden
#: decision moves, and those saturations take 0.71x of their CPU time (benchmarks/results/log.md, h-tail).
SUMS_ITERATIONS = 8

sums = Ruleset("derivatives_sums", [
    rule(Pat("reduce_sum", X, params="p"), _sum_pull, name="red_pull",                             # sum(b*x) -> b*sum(x), b broadcast on the axes
         example_program=(lambda x, b: _sum0(x * b[None, :]), (_S, f32(4)))),
    rule(_SUM_SUM, lambda x, y, p, op: p.bind(op.bind(x, y)), name="red_merge",                    # sum x ± sum y -> sum(x ± y)  (identity: docs/rules.md)
         when=lambda x, y, p, q: p.axes == q.axes and x.aval == y.aval,
         example_program=(lambda x, y: (_sum0(x) + _sum0(y), _sum1(x) - _sum1(y)), (_S, _S))),
    rule(_SUM_OF, lambda x, y, p, op: op.bind(p.bind(x), p.bind(y)), name="red_split",            # sum(x ± y) -> sum x ± sum y
         when=lambda x, y, s: x.aval == s.aval == y.aval,
         example_program=(lambda x, y: (_sum0(x + y), jnp.sum(x - y, axis=(0, 1))), (_S, _S))),
], soundness="identity", tolerance=Tolerance(terms=64), min_saving=SUMS_MIN_SAVING,
    limits=Limits(iterations=SUMS_ITERATIONS),
    description="sums reordered (factors pulled out, sums merged and split) where that saves 1% or more")

reductions = Ruleset("derivatives_reductions", [
    rule(Pat("reduce_sum", Pat("neg", X), params="p"), lambda x, p: lax.neg(p.bind(x)), name="red_sum_neg",  # sum(-x) -> -sum(x)
         example_program=(lambda x: _sum0(-x), (_S,))),
    rule(Pat("neg", Pat("reduce_sum", X, params="p")), lambda x, p: p.bind(lax.neg(x)), name="red_neg_sum",  # -sum(x) -> sum(-x): merges with a sum
         example_program=(lambda x, y: -_sum0(x) + _sum0(y), (_S, _S))),
    sums,
], soundness="identity", tolerance=Tolerance(terms=64),
    description="sums pulled through negations and factors constant along the summed axes, merged and split")

#: Cancellations without a non-zero fact, double angles whose 2x may overflow, and log x + log y: not part
#: of ``derivatives``.
derivatives_fastmath = Ruleset("derivatives_fastmath", [
    rule(Pat("mul", X, Y), _normalize(True), name="prod_mul_cancel",                               # x * (y / x) -> y, x unknown;
         example_program=(lambda a, g: a * (g / a), (_S, _S))),                                             # 2 sin x cos x -> sin 2x, any x
    rule(lambda x: jnp.cos(x) ** 2 - jnp.sin(x) ** 2, lambda x: jnp.cos(2 * x), name="trig_cos_double_any"),  # cos²x - sin²x -> cos 2x, any x
    rule(Pat("div", X, Y), _normalize(True), name="prod_div_cancel",                               # (x * y) / x -> y, x unknown
         example_program=(lambda a, g: (a * g) / a, (_S, _S))),
    # one log instead of two, but x*y underflows where log x + log y does not (1e-7 * 1e-32)
    rule(lambda x, y: jnp.log(x) + jnp.log(y), lambda x, y: jnp.log(x * y), name="explog_log_add",  # log x + log y -> log(xy), x, y >= 0
         when=lambda x, y: _nonneg(x) and _nonneg(y)),
], soundness="fastmath")

derivatives = Ruleset("derivatives", [derivatives_exact, trig, explog, products, reductions, derivatives_kernels],
                      soundness="identity",
                      description="identities that make autodiff's backward passes as fast as hand-derived ones")
