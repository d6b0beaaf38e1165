"""``rulesets.linalg``: matrix products ordered and simplified by their shapes.

XLA computes a product of matrices in the order it is written. Linear
attention written ``(Q K^T) V`` builds an N x N matrix that ``Q (K^T V)``
never needs (N=4096, d=64: 64 ms against 0.8 ms), and ``(A B) x`` multiplies
two matrices where ``A (B x)`` multiplies two vectors. The rules here put every
equivalent form of a product into the e-graph, and the cost model, which
prices a ``dot_general`` by its flops and the bytes it reads and writes, picks
the cheapest: a chain of products ends up in the order of fewest flops (the
matrix-chain order) wherever flops dominate, and a program already in its best
form keeps it. At small sizes the bytes of a temporary and a kernel launch per
product weigh more than flops, and a reorder must save ``MIN_SAVING`` of the
price, so a small chain may keep more flops than the fewest (the
fuzz in ``tests/test_linalg.py`` checks each rewrite against the model's own
cheapest bracketing).

Every rule reads a ``dot_general`` as an einsum: each dimension of its
operands gets a label, shared labels are batch or contracted dimensions.
That is how the rules understand every form JAX writes a product in (``@``,
``jnp.matmul``, ``jnp.dot``, ``jnp.einsum``, ``jnp.tensordot``, with batch
dimensions such as attention heads) and how they build the replacement's
dimension numbers; a rule declines whenever its replacement is not a
``dot_general`` (a label that one operand alone would have to sum, say).

* **Associativity**: ``(A B) C`` and ``A (B C)``, and for contractions that
  are not chains, the pairing of the outer operand with the other inner one.
  A chain of n products has Catalan-many bracketings, but they share their
  sub-products: the e-graph holds one class per contiguous sub-chain, O(n^2)
  classes and O(n^3) nodes, and extraction over it is the classic
  matrix-chain dynamic programme.
* **Transposes** fold into the dimension numbers of the product that reads
  them (``A @ K.T`` contracts ``K``'s last axis), and a transposed product is
  the product of the operands swapped (``(A B)^T = B^T A^T``).
* **Factors** constant along some dimensions move in and out of products:
  scalars (``(s A) B = s (A B) = A (s B)``, attention's ``/ sqrt(d)``), and
  arrays broadcast along an operand's dimensions (row scalings move to the
  result, column scalings to the other operand). A factor only moves to a
  smaller array than the one it scales, so it never moves back; and one computed from the
  operand it scales (a softmax's normaliser, ``e / sum(e)``) stays before the product where
  nothing else reads that operand.
* **Distributivity**: ``A x + A y -> A (x + y)``, ``A x + B x -> (A + B) x``,
  and the same for ``-``.
* **Reductions of products**: a sum over a dimension of one operand is taken
  before the product (``sum(A B, 0) = sum(A, 0) B``), a sum over a batch
  dimension becomes a contraction, ``trace(A B) = sum(A * B^T)``, and
  ``diagonal(A B) = sum(A * B^T, 1)``. ``jnp.diagonal`` is a ``cond`` over the
  platform (a gather, or a masked sum for Mosaic); the rule checks that each
  branch is linear in the matrix and agrees with its diagonal on random
  integer matrices, a randomised identity test, before it replaces the
  ``cond``.

The pack is ``identity`` class: every rule is an identity of real (and of
integer wrap-around) arithmetic, and reordering a float product changes its
rounding, hence the tolerance (``tests/test_linalg.py`` also checks every rule
exactly, on small integers in float64). Products that mix dtypes (``int8``
operands accumulated in ``int32``, say) are left alone. Rule names start with
``la_``.

>>> import jax.numpy as jnp
>>> from rewrite import explain
>>> from rulesets.linalg import linalg
>>> def f(a, b, x):
...     return (a @ b) @ x
>>> report = explain(f, jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.ones(64), rulesets=[linalg])
>>> report.fired["la_assoc_left"]
1
>>> [e.params["dimension_numbers"] for e in report.after.eqns]   # a @ (b @ x): two matrix-vector products
[(((1,), (0,)), ((), ())), (((1,), (0,)), ((), ()))]
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Sequence

import jax.numpy as jnp
from jax import lax

from rewrite import Pat, Ruleset, Tolerance, Value, procedural, rule
from rulesets._diagonal import _all_diagonal, _branch
from rulesets._examples import f32

__all__ = ["linalg"]

A, B, C, F = Pat.var("a"), Pat.var("b"), Pat.var("c"), Pat.var("f")

Labels = tuple  # one label (an int) per dimension


# ---------------------------------------------------------------------- a dot_general as an einsum
class _Einsum:
    """Labels for the operands and results of one or two nested ``dot_general``.

    Each operand gets fresh labels; :meth:`dot` unifies the labels that a
    product's dimension numbers pair, and gives the labels of its result
    (batch, then the lhs's free dimensions, then the rhs's, as
    ``dot_general`` lays it out).
    """

    def __init__(self) -> None:
        self._fresh = itertools.count()
        self._parent: dict[int, int] = {}

    def operand(self, ndim: int) -> list[int]:
        return [next(self._fresh) for _ in range(ndim)]

    def find(self, label: int) -> int:
        while self._parent.get(label, label) != label:
            label = self._parent[label]
        return label

    def dot(self, lhs: Sequence[int], rhs: Sequence[int], dn: Any) -> list[int]:
        (lc, rc), (lb, rb) = dn
        for i, j in zip(tuple(lc) + tuple(lb), tuple(rc) + tuple(rb)):
            a, b = self.find(lhs[i]), self.find(rhs[j])
            if a != b:
                self._parent[b] = a
        paired_l, paired_r = set(lc) | set(lb), set(rc) | set(rb)
        return ([lhs[i] for i in lb] + [lhs[i] for i in range(len(lhs)) if i not in paired_l]
                + [rhs[j] for j in range(len(rhs)) if j not in paired_r])

    def resolve(self, labels: Sequence[int]) -> Labels:
        return tuple(self.find(x) for x in labels)


def _dims(x: Labels, y: Labels, out: Sequence[int]) -> tuple[Any, Labels] | None:
    """Dimension numbers contracting operands labelled ``x`` and ``y`` into a result with the labels ``out``.

    Returns the dimension numbers and the labels of the ``dot_general``'s own
    result (``out`` up to a permutation; batch dimensions are ordered as in
    ``out``), or ``None`` when no ``dot_general`` computes it: a label of one
    operand that the result lacks (it would have to be summed first), a label
    of the result that neither operand has, or a label twice in one operand.
    """
    keep = set(out)
    if len(set(x)) != len(x) or len(set(y)) != len(y) or len(keep) != len(out):
        return None
    if not keep <= set(x) | set(y):
        return None
    if any(l not in keep for l in x if l not in y) or any(l not in keep for l in y if l not in x):
        return None
    batch = [l for l in out if l in x and l in y]
    contract = [l for l in x if l in y and l not in keep]
    dn = ((tuple(x.index(l) for l in contract), tuple(y.index(l) for l in contract)),
          (tuple(x.index(l) for l in batch), tuple(y.index(l) for l in batch)))
    natural = tuple(batch) + tuple(l for l in x if l not in y) + tuple(l for l in y if l not in x)
    return dn, natural


def _perm(natural: Labels, out: Sequence[int]) -> tuple[int, ...] | None:
    """The transpose taking a result laid out as ``natural`` to ``out``; ``None`` when there is nothing to do."""
    perm = tuple(natural.index(l) for l in out)
    return None if perm == tuple(range(len(perm))) else perm


def _flops(x: Labels, y: Labels, out: Sequence[int], size: dict[int, int]) -> int:
    """Multiply-adds of contracting ``x`` and ``y`` into ``out``, doubled (as XLA counts flops)."""
    contracted = [l for l in set(x) & set(y) if l not in set(out)]
    return 2 * math.prod(size[l] for l in out) * math.prod(size[l] for l in contracted)


# Every procedure starts from Match.product: the matched dot_general as an einsum (its operands, labels,
# dimension numbers), or None where a product must be left alone (sharded, mixed dtypes such as int8
# accumulated in int32, or products of different precisions rebuilt as one).


def _of_product(body: Callable[[Any, Any], Any]) -> Any:
    """``body(m, p)`` as a procedure, ``p`` the matched product ``"p"`` (:meth:`Match.product`); where that is
    no product this plain form reads, the match is declined."""

    def run(m: Any) -> Any:
        p = m.product("p")
        return None if p is None else body(m, p)

    run.__name__, run.__doc__ = body.__name__, body.__doc__
    return procedural(run)


def _each(root: Any, found: list) -> Any:
    """No replacement, the one found, or every one found as an alternative for ``root``."""
    return None if not found else found[0] if len(found) == 1 else [(root, t) for t in found]


# ---------------------------------------------------------------------- associativity
def _pairings(m: Any, nested: str) -> Any:
    """The other bracketings of a product of a product (the procedure of ``la_assoc_*``).

    ``nested`` says which operand of the outer product is the inner product.
    The three operands are read in the order they are written; each pair of
    them that shares a contracted label (so that pairing them is not an
    outer product) is multiplied first, the pair in that order, and the result
    with the third operand in the order the program has them. Declines a pair
    whose contraction is not a ``dot_general``.
    """
    inner = ("a", "b", "c") if nested == "lhs" else ("b", "c", "a")
    if m.product("pi", inner[0], inner[1], same=("po",), operands=inner[2:]) is None:
        return None
    a, b, c, out = m["a"], m["b"], m["c"], m.root
    e = _Einsum()
    la, lb, lc = e.operand(a.ndim), e.operand(b.ndim), e.operand(c.ndim)
    if nested == "lhs":  # (a b) c
        lo = e.dot(e.dot(la, lb, m.params("pi")["dimension_numbers"]), lc, m.params("po")["dimension_numbers"])
    else:                # a (b c)
        lo = e.dot(la, e.dot(lb, lc, m.params("pi")["dimension_numbers"]), m.params("po")["dimension_numbers"])
    la, lb, lc, lo = e.resolve(la), e.resolve(lb), e.resolve(lc), e.resolve(lo)
    operands = [(a, la), (b, lb), (c, lc)]
    # the pairs that are not the program's own: (b, c) after (a b) c, (a, b) after a (b c), and (a, c)
    pairs = [(1, 2, 0), (0, 2, 1)] if nested == "lhs" else [(0, 1, 2), (0, 2, 1)]
    found = []
    for i, j, k in pairs:
        (x, lx), (y, ly), (z, lz) = operands[i], operands[j], operands[k]
        shared = set(lx) & set(ly)
        keep = set(lz) | set(lo)
        if not any(l not in keep for l in shared):
            continue  # an outer product (or a batched one): never the cheaper order
        inner = _dims(lx, ly, list(dict.fromkeys(l for l in lx + ly if l in keep)))
        if inner is None:
            continue
        dn_in, lxy = inner
        z_first = k < i  # the third operand is written before the pair: it stays on the left
        outer = _dims(lz, lxy, lo) if z_first else _dims(lxy, lz, lo)
        if outer is None:
            continue
        dn_out, natural = outer
        perm = _perm(natural, lo)
        # Built node by node rather than traced: a chain meets each of its O(n^2) sub-products at
        # shapes of its own, and tracing each would be most of saturation's time.
        size = {l: d for v, lv in operands for l, d in zip(lv, v.shape)}
        xy = m.node("dot_general", [x, y], {**m.params("po"), "dimension_numbers": dn_in},
                    [out.aval.update(shape=tuple(size[l] for l in lxy), weak_type=False)])
        r = m.node("dot_general", [z, xy] if z_first else [xy, z], {**m.params("po"), "dimension_numbers": dn_out},
                   [out.aval.update(shape=tuple(size[l] for l in natural), weak_type=False)])
        if perm is not None:
            r = m.node("transpose", [r], {"permutation": perm}, [out.aval])
        found.append(r)
    return _each(out, found)


@procedural
def _assoc_left(m):
    """``(a b) c -> a (b c)`` (and ``(a c) b`` where ``c`` contracts with ``a``)."""
    return _pairings(m, "lhs")


@procedural
def _assoc_right(m):
    """``a (b c) -> (a b) c`` (and ``(a c) b`` where ``a`` contracts with ``c``)."""
    return _pairings(m, "rhs")


# ---------------------------------------------------------------------- transposes
def _fold_transpose(side: str) -> Callable:
    """A transposed operand read by a product is the untransposed one, with the product's dimension numbers
    relabelled; declines when the result would need a transpose of its own instead."""

    @_of_product
    def fold(m, p):
        la, lb, lo = p.labels
        src = la if side == "lhs" else lb  # the labels of the transposed value; its operand's follow perm
        untransposed = [0] * len(src)
        for i, axis in enumerate(m.params("t")["permutation"]):
            untransposed[axis] = src[i]
        untransposed = tuple(untransposed)
        found = _dims(untransposed, lb, lo) if side == "lhs" else _dims(la, untransposed, lo)
        if found is None or _perm(found[1], lo) is not None:
            return None
        dn = found[0]
        return m.trace(lambda x, y: p.dot(x, y, dn), p.lhs, p.rhs)

    fold.__name__ = f"fold_transpose_{side}"
    return fold


@_of_product
def _transpose_of_product(m, p):
    """``transpose(a b)`` is ``a b`` or ``b a`` with other dimension numbers, when one lays the result out so."""
    a, b, (la, lb, lo) = p.lhs, p.rhs, p.labels
    want = [lo[i] for i in m.params("t")["permutation"]]
    for (x, lx), (y, ly) in (((a, la), (b, lb)), ((b, lb), (a, la))):
        found = _dims(lx, ly, want)
        if found is not None and _perm(found[1], want) is None:
            dn = found[0]
            return m.trace(lambda u, v: p.dot(u, v, dn), x, y)
    return None


# ---------------------------------------------------------------------- factors
def _factor(f: Value, like: Value) -> tuple[Value, tuple[int | None, ...]] | None:
    """``f`` as a factor of an array shaped like ``like``: a small value and, per dimension of it, the
    dimension of ``like`` it runs along (``None`` for a size-1 dimension); ``None`` if ``f`` is not constant
    along any dimension of ``like``.

    A factor is a scalar, an array of ``like``'s rank with size-1 dimensions (``mul`` broadcasts those), or a
    ``broadcast_in_dim`` of a smaller array.
    """
    if f.dtype != like.dtype or like.ndim == 0:
        return None
    if f.ndim == 0:
        return f, ()
    if f.ndim != like.ndim:
        return None
    if f.shape != like.shape:
        if any(s not in (1, t) for s, t in zip(f.shape, like.shape)):
            return None
        return f, tuple(d if s != 1 else None for d, s in enumerate(f.shape))
    for n in f.nodes:
        if n.prim == "broadcast_in_dim" and n.params.get("sharding") is None:
            (src,) = n.operands[:1]
            if src.size < f.size:
                dims = n.params["broadcast_dimensions"]
                return src, tuple(d if s != 1 else None for d, s in zip(dims, src.shape))
    return None


def _placement(v: Value, along: Sequence[int | None], target: Sequence[int], shape: Sequence[int]) -> tuple:
    """Plain data for :func:`_place`: put a factor ``v`` whose dimensions carry the labels ``along`` (``None``:
    size 1) beside an array labelled ``target`` of this ``shape``."""
    kept = [i for i, l in enumerate(along) if l is not None]
    squeezed = tuple(v.shape[i] for i in kept)
    pos = [target.index(along[i]) for i in kept]
    order = tuple(sorted(range(len(pos)), key=lambda k: pos[k]))
    dims = tuple(sorted(pos))
    out_shape = tuple(shape[j] if j in dims else 1 for j in range(len(shape)))
    return (squeezed if squeezed != tuple(v.shape) else None,
            order if order != tuple(range(len(order))) else None,
            (out_shape, dims) if kept or v.ndim else None)


def _place(v: Any, how: tuple) -> Any:
    squeezed, order, bcast = how
    if squeezed is not None:
        v = lax.reshape(v, squeezed)
    if order is not None:
        v = lax.transpose(v, order)
    if bcast is not None and (len(bcast[0]) != v.ndim or bcast[1] != tuple(range(v.ndim))):
        v = lax.broadcast_in_dim(v, *bcast)
    return v


def _scale(op: str, g: Any, x: Any) -> Any:
    return lax.mul(g, x) if op == "mul" else lax.div(x, g)


def _factors_of(x: Value) -> list[tuple[str, Value, Value, tuple]]:
    """Each way ``x`` is a factor times (or over) another array: ``(op, rest, factor, its labels' dims)``."""
    out = []
    for n in x.nodes:
        ops = n.operands
        if n.prim == "mul" and len(ops) == 2:
            candidates = [(ops[0], ops[1]), (ops[1], ops[0])]
        elif n.prim == "div" and len(ops) == 2 and x.is_floating:
            candidates = [(ops[1], ops[0])]
        else:
            continue
        for f, rest in candidates:
            if rest.aval.shape != x.shape or rest.dtype != x.dtype:
                continue
            found = _factor(f, x)
            if found is not None:
                out.append((n.prim, rest, found[0], found[1]))
    return out


def _computed_from(f: Value, x: Value, depth: int = 6) -> bool:
    """Whether some way of computing ``f`` reads ``x`` within ``depth`` operations (``sum(x, axis)``, or
    ``1 / sum(x, axis)`` accumulated in float32 for a bfloat16 ``x``)."""
    seen, stack = set(), [(f, 0)]
    while stack:
        v, d = stack.pop()
        if d >= depth or v.name in seen or v.literal is not None:
            continue
        seen.add(v.name)
        for n in v.nodes:
            for o in n.operands:
                if o.name == x.name:
                    return True
                stack.append((o, d + 1))
    return False


def _forks(m: Any, rest: Value, x: Value, f: Value) -> bool:
    """Whether moving ``f`` (in ``x = f rest``) past the product leaves ``rest`` read by the product and by the
    computation of ``f`` alone: ``f`` is computed from ``rest``, and nothing but products, ``x`` and that
    computation reads ``rest`` (followed through arrays of ``rest``'s size on the way, ``rest`` converted, say).
    A gradient's residual, or another reduction of ``rest``, is a reader elsewhere."""
    if not _computed_from(f, rest):
        return False
    seen, stack = {rest.name}, [rest]
    while stack:
        for user, node in m.users(stack.pop()):
            if node.prim == "dot_general" or user.name in (x.name, f.name) or user.name in seen:
                continue
            if not _computed_from(f, user) or not user.is_array:  # (a loop or a call reading rest: elsewhere)
                return False
            if user.size >= rest.size:  # rest in another dtype or layout, on the way to f: who else reads it?
                seen.add(user.name)
                stack.append(user)
    return True


def _factor_out(side: str) -> Callable:
    """A factor of one operand that runs along the result's dimensions moves to the result; one that runs
    along contracted (or batch) dimensions moves to the other operand.

    A factor only ever moves to a smaller array than the one it scales (here and in :func:`_factor_in`):
    that is where it can be cheaper, and it keeps a factor from moving back and forth, and from
    settling on every operand of every sub-product of a chain.

    A factor computed from the operand it scales (a softmax's normaliser, ``e / sum(e)``) does not move to
    the result where nothing else reads that operand. There the operand is reduced first and scaled in the
    pass that reads it for the product, so the move saves no pass over it, only the scaling's arithmetic;
    moved, the operand is read by the product and by its own reduction, whose results meet only after the
    product. XLA:CPU fuses an operand into a product's library (YNN) fusion when all its readers are in that
    fusion, so a forward attention's scores, softmax and second product become one fusion, and it ran 3-7.5x
    slower in the moved form. Where something else reads the operand (a gradient's residual), it is stored
    anyway and the move saves the scaled copy: a long-context training step ran 1.30x faster with it
    (``benchmarks/results/log.md``, issue 50).
    """

    @_of_product
    def factor_out(m, p):
        la, lb, lo = p.labels
        x, lx, other, lother = (p.lhs, la, p.rhs, lb) if side == "lhs" else (p.rhs, lb, p.lhs, la)
        found = []
        for op, rest, f, dims in _factors_of(x):
            along = tuple(None if d is None else lx[d] for d in dims)
            used = {l for l in along if l is not None}
            if used <= set(lo) and m.root.size < x.size and not _forks(m, rest, x, f):  # (f a) b -> f (a b)
                how = _placement(f, along, lo, m.root.shape)

                def fn(f, r, o, how=how, op=op, lhs=side == "lhs"):
                    return _scale(op, _place(f, how), p.dot(r, o) if lhs else p.dot(o, r))

                found.append(m.trace(fn, f, rest, other))
            if used <= set(lother) and other.size < x.size:  # along contracted or batch dims: (f a) b -> a (f b)
                how = _placement(f, along, lother, other.shape)

                def fn(f, r, o, how=how, op=op, lhs=side == "lhs"):
                    o = _scale(op, _place(f, how), o)
                    return p.dot(r, o) if lhs else p.dot(o, r)

                found.append(m.trace(fn, f, rest, other))
        return _each(m.root, found)

    factor_out.__name__ = f"factor_out_{side}"
    return factor_out


def _factor_in(op: str) -> Callable:
    """A factor of a product's result moves into the operand whose dimensions it runs along."""

    @_of_product
    def factor_in(m, p):
        f, d = m["f"], m["d"]
        if op == "div" and not d.is_floating:
            return None
        a, b, (la, lb, lo) = p.lhs, p.rhs, p.labels
        found = _factor(f, d)
        if found is None or m.root.aval.shape != d.shape:
            return None
        small, dims = found
        along = tuple(None if k is None else lo[k] for k in dims)
        used = {l for l in along if l is not None}
        out = []
        for lhs, (x, lx) in ((True, (a, la)), (False, (b, lb))):
            if not used <= set(lx) or x.size >= d.size:
                continue
            how = _placement(small, along, lx, x.shape)

            def fn(f, a, b, how=how, lhs=lhs):
                g = _place(f, how)
                return p.dot(_scale(op, g, a), b) if lhs else p.dot(a, _scale(op, g, b))

            out.append(m.trace(fn, small, a, b))
        return _each(m.root, out)

    factor_in.__name__ = f"factor_in_{op}"
    return factor_in


# ---------------------------------------------------------------------- distributivity
def _common(op: str, shared: str) -> Callable:
    """``a b + a c -> a (b + c)`` (``shared="lhs"``) and ``a c + b c -> (a + b) c``, also for ``-``."""

    @procedural
    def common(m):
        lhs, rhs, third = ("a", "b", "c") if shared == "lhs" else ("a", "c", "b")
        p = m.product("p", lhs, rhs, same=("q",), operands=(third,))
        if p is None or p.dimension_numbers != m.params("q")["dimension_numbers"]:
            return None
        a, b, c = m["a"], m["b"], m["c"]
        x, y = (b, c) if shared == "lhs" else (a, b)
        if x.aval.shape != y.aval.shape or m.root.dtype != a.dtype:
            return None
        combine = lax.add if op == "add" else lax.sub
        if shared == "lhs":
            return m.trace(lambda a, b, c: p.dot(a, combine(b, c)), a, b, c)
        return m.trace(lambda a, b, c: p.dot(combine(a, b), c), a, b, c)

    common.__name__ = f"common_{shared}_{op}"
    return common


# ---------------------------------------------------------------------- reductions of products
@_of_product
def _sum_of_product(m, p):
    """``sum(a b)`` over dimensions of one operand sums that operand first; over a batch dimension, contracts it."""
    r = m.params("r")
    if r.sharded:
        return None
    a, b, (la, lb, lo) = p.lhs, p.rhs, p.labels
    summed = {lo[i] for i in r["axes"]}
    want = [l for l in lo if l not in summed]
    sum_a = tuple(i for i, l in enumerate(la) if l in summed and l not in lb)
    sum_b = tuple(i for i, l in enumerate(lb) if l in summed and l not in la)
    ra = tuple(l for l in la if l not in summed or l in lb)
    rb = tuple(l for l in lb if l not in summed or l in la)
    found = _dims(ra, rb, want)
    if found is None:
        return None
    dn, perm = found[0], _perm(found[1], want)

    def fn(a, b):
        if sum_a:
            a = jnp.sum(a, axis=sum_a)
        if sum_b:
            b = jnp.sum(b, axis=sum_b)
        out = p.dot(a, b, dn)
        return out if perm is None else lax.transpose(out, perm)

    return m.trace(fn, a, b)


# ---------------------------------------------------------------------- the diagonal of a product
@procedural
def _diagonal_of_product(m):
    """``diagonal(a b) -> sum(a * b^T, 1)``: ``jnp.diagonal`` is a ``cond`` over the platform, checked branch by branch."""
    p = m.product("p")
    a, b, w, q, i = m["a"], m["b"], m["w"], m["q"], m["i"]
    (lc, rc), (lb, _) = p.dimension_numbers if p is not None else ((None, None), (None, None))
    if p is None or lb or a.ndim != 2 or b.ndim != 2 or q.shape[0] != q.shape[1] or not q.is_floating \
            or i.node("platform_index") is None:
        return None
    if q.size > 1 << 22:
        return None  # the check evaluates the branches at q's size
    bodies = m.bodies("br")
    fmask = m.function([w], [])
    if fmask is None or len(bodies) != 2:
        return None
    branches = [_branch(m, body, w, q) for body in bodies]
    if any(g is None for g in branches) or not _all_diagonal(branches, fmask, q):
        return None
    a_rows, b_cols = 1 - lc[0], 1 - rc[0]  # the free dimension of each

    def fn(a, b):
        a = a if a_rows == 0 else a.T
        b = b.T if b_cols == 1 else b
        return jnp.sum(a * b, axis=1)

    # a cond's results are projections of it: the diagonal is its only one
    out = [u for u, node in m.users(m.root) if node.ctor == "Proj" and node.args[1] == 0]
    if len(out) != 1 or out[0].aval != q.aval.update(shape=q.shape[:1]):
        return None
    return [(out[0], m.trace(fn, a, b))]


# ---------------------------------------------------------------------- guards and examples
def _numeric(*vs: Value) -> bool:
    return all(jnp.issubdtype(v.dtype, jnp.number) for v in vs)


_M34, _M45, _M53, _M43, _V5 = f32(3, 4), f32(4, 5), f32(5, 3), f32(4, 3), f32(5)
_HEADS = (f32(2, 3, 6, 4), f32(2, 3, 6, 4), f32(2, 3, 6, 5))   # (batch, heads, N, d) queries, keys, values


def _ex_attention(q, k, v):
    """Linear attention with heads, as einsum writes it, scaled."""
    s = jnp.einsum("bhnd,bhmd->bhnm", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    return s @ v


# ---------------------------------------------------------------------- the pack
#: Reordering a sum of products moves its result by the rounding of its largest partial sums, which
#: depends on the terms, not on the result: ``64*64 - 64*64 + 1e-5`` is ``1e-5`` in one order and ``0`` in
#: another. So the tolerance is relative to the magnitude of the terms, ``|A| |B|`` for a product ``A B``
#: (``Tolerance.terms``: the original run on its inputs' magnitudes, a difference adding its operands'),
#: 64 roundings of it. On 100 drawn examples per rule, the largest change a rule made was 1.7 roundings
#: (``check_ruleset``, every compared element); 64 leaves room for the longer contractions of the contract
#: tests' programs. No absolute tolerance: a product of small operands is held to its own small terms
#: (an absolute tolerance would accept any error on a small result). The exact checks in
#: ``tests/test_linalg.py`` are what pin the rules down.
_REORDERING = Tolerance(rtol=1e-5, atol=0.0, terms=64)

#: Reordering a float product changes its rounding, so a reorder must pay for that: the pack's nodes are
#: used only where they save at least this fraction of the program's cost beyond what the program saves
#: without them (``Ruleset.min_saving``). Inside ``jax.scipy.linalg.solve_sylvester`` the 4x4 by 4x6
#: products reorder for 0.03% of the modelled cost (method "schur") or 7.4% (method "eigen"; 50x50 by
#: 50x7: 3.6%) and moved results by up to 1e-6 relative, where ``jit`` is bit-identical (JAX's own test
#: asks 1e-6); the chains this pack is for save tens of percent or more.
MIN_SAVING = 0.1

_PRODUCT = Pat("dot_general", A, B, params="p")

linalg = Ruleset("linalg", [
    # associativity
    rule(Pat("dot_general", Pat("dot_general", A, B, params="pi"), C, params="po"), _assoc_left,
         name="la_assoc_left", example_program=(lambda a, b, x: (a @ b) @ x, (_M34, _M45, _V5))),          # (a b) c -> a (b c)
    rule(Pat("dot_general", A, Pat("dot_general", B, C, params="pi"), params="po"), _assoc_right,
         name="la_assoc_right", example_program=(lambda x, a, b: x @ (a @ b), (f32(3), _M34, _M45))),     # a (b c) -> (a b) c
    # transposes
    rule(Pat("dot_general", Pat("transpose", A, params="t"), B, params="p"), _fold_transpose("lhs"),
         name="la_fold_transpose_lhs", example_program=(lambda a, b: a.T @ b, (_M43, _M45))),              # a^T b -> dot(a, b), other dims
    rule(Pat("dot_general", A, Pat("transpose", B, params="t"), params="p"), _fold_transpose("rhs"),
         name="la_fold_transpose_rhs", example_program=(lambda q, k: q @ jnp.swapaxes(k, -1, -2), _HEADS[:2])),                        # a b^T -> dot(a, b), other dims
    rule(Pat("transpose", _PRODUCT, params="t"), _transpose_of_product,
         name="la_transpose_product", example_program=(lambda a, b: (a @ b).T, (_M34, _M45))),            # (a b)^T -> b^T a^T
    # factors
    rule(Pat("dot_general", A, B, params="p"), _factor_out("lhs"), name="la_factor_out_lhs",
         example_program=(lambda s, r, c, a, b: ((s * a) @ b, (r[:, None] * a) @ b, (a * c[None, :]) @ b),
                  (f32(), f32(3), f32(8), f32(3, 8), f32(8, 2)))),                                                 # (f a) b -> f (a b) or a (f b)
    rule(Pat("dot_general", A, B, params="p"), _factor_out("rhs"), name="la_factor_out_rhs",
         example_program=(lambda a, b, c: a @ (b / 2.0) + a @ (b * c[None, :]), (_M34, _M45, _V5))),       # a (f b) -> f (a b) or (f a) b
    rule(Pat("mul", F, Pat("dot_general", A, B, params="p", name="d")), _factor_in("mul"), name="la_factor_in_mul",
         example_program=(lambda s, a, b: s * (a @ b), (f32(), _M34, _M45))),                            # f (a b) -> (f a) b or a (f b)
    rule(Pat("div", Pat("dot_general", A, B, params="p", name="d"), F), _factor_in("div"), name="la_factor_in_div",
         example_program=(_ex_attention, _HEADS)),                                                         # (a b) / f -> (a / f) b or a (b / f)
    # distributivity
    rule(Pat("add", Pat("dot_general", A, B, params="p"), Pat("dot_general", A, C, params="q")), _common("add", "lhs"),
         name="la_common_lhs_add", example_program=(lambda a, x, y: a @ x + a @ y, (_M34, _M45, _M45))),   # a b + a c -> a (b + c)
    rule(Pat("sub", Pat("dot_general", A, B, params="p"), Pat("dot_general", A, C, params="q")), _common("sub", "lhs"),
         name="la_common_lhs_sub", example_program=(lambda a, x, y: a @ x - a @ y, (_M34, f32(4), f32(4)))),  # a b - a c -> a (b - c)
    rule(Pat("add", Pat("dot_general", A, C, params="p"), Pat("dot_general", B, C, params="q")), _common("add", "rhs"),
         name="la_common_rhs_add", example_program=(lambda a, b, x: a @ x + b @ x, (_M34, _M34, f32(4)))),  # a c + b c -> (a + b) c
    rule(Pat("sub", Pat("dot_general", A, C, params="p"), Pat("dot_general", B, C, params="q")), _common("sub", "rhs"),
         name="la_common_rhs_sub", example_program=(lambda a, b, x: a @ x - b @ x, (_M34, _M34, _M45))),   # a c - b c -> (a - b) c
    # reductions of products
    rule(Pat("reduce_sum", _PRODUCT, params="r"), _sum_of_product, name="la_sum_product",
         example_program=(lambda a, b: (jnp.sum(a @ b, axis=0), jnp.sum(jnp.einsum("bij,bjk->bik", a[None], b[None]), (0, 2))),
                  (_M34, _M45))),                                                                 # sum(a b, 0) -> sum(a, 0) b
    rule(Pat("cond", [Pat.var("i"), Pat.var("w"), Pat("dot_general", A, B, params="p", name="q")], bodies="br"),
         _diagonal_of_product, name="la_diagonal_product",
         example_program=(lambda a, b: jnp.diagonal(a @ b), (_M34, _M43))),                                # diagonal(a b) -> sum(a * b^T, 1)
    rule(lambda a, b: jnp.trace(a @ b), lambda a, b: jnp.sum(a * b.T), name="la_trace_product",
         when=lambda a, b: _numeric(a, b), example_inputs=(_M34, _M43)),                                  # trace(a b) -> sum(a * b^T)
], soundness="identity", tolerance=_REORDERING, min_saving=MIN_SAVING, description=__doc__.split("\n\n")[0])
