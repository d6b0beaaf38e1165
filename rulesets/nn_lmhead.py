"""``rulesets.nn``'s language-model head: a cross-entropy over a product, without the tokens x vocabulary logits.

A language model's loss projects the hidden states ``h`` (tokens x width)
onto the vocabulary, ``logits = h @ W (+ b)`` (tokens x V), and reads from the
logits only two things per token: their log-normaliser ``logsumexp`` and the
label's logit. XLA keeps the N x V logits (and their exponentials, and in the
gradient their softmax) whole. ``optax.softmax_cross_entropy_with_integer_labels``,
``optax.softmax_cross_entropy`` against ``jax.nn.one_hot`` labels (through
``nn_one_hot_sum``), and a hand-written ``log_softmax`` with
``take_along_axis`` all trace to the same three readers of the logits, and
this part rewrites each:

* **The label's logit is a row of the product.** ``take_along_axis(h @ W + b,
  y)`` is ``sum(h * W[:, y]) + b[y]``: the label's column of ``W`` per token,
  a tokens x width array (``nn_lm_head_label``), with the gather's own
  out-of-range behaviour (NaN for optax's ``fill``, the clamped column for
  ``clip``). A gather from ``log_softmax(logits)`` first gathers the logits
  and subtracts the normaliser (``nn_lm_head_label_peel``, as
  ``nn_one_hot_sum`` does).
* **Smoothed labels.** ``optax.smooth_labels`` gives ``p * one_hot(y) + q``
  with scalars ``p = 1 - alpha``, ``q = alpha / V``; the cross-entropy's
  ``sum((p a + q) * x)`` over the vocabulary, ``x`` the logits less row
  terms (``log_softmax``'s), is ``p sum(a * x) + q sum(x)``, and ``sum(x)`` is
  ``h @ W.sum(-1) + sum(b)`` less ``V`` times the terms, summed in at least
  float32 (``nn_lm_head_smooth``). Only ``sum(a * x)`` reads the logits then,
  a gather where ``a`` is one-hot (``nn_one_hot_sum``, then the rule above).
* **The normaliser over token blocks.** ``sum(exp(logits - shift))`` along the
  vocabulary, with ``shift`` made from ``max(logits)`` under ``stop_gradient``
  (``max(-inf, m)`` as ``jax.nn.log_softmax`` shifts, or ``m`` where finite
  and 0 elsewhere as ``jax.nn.logsumexp`` and optax do: :func:`_shift_kind`
  reads which), becomes a ``lax.scan`` over blocks of tokens, inside a
  ``jax.custom_vjp``, that computes each block's logits, their maximum, the
  program's shift and the sum as the program does, row by row, and keeps none
  of them (``nn_lm_head_lse_<block>``). The maximum and the sum (or its log,
  where the program takes one) are the two results of that node: the rule
  unions them with the program's ``max(logits)`` and its sum (or log), so
  everything else that reads the maximum (the shift added back, the
  ``log_softmax``'s subtraction) reads it from the loop.
* **A backward that recomputes each block** and keeps nothing of the forward:
  each block's logits, maximum, shift and sum are computed again, and their
  cotangent ``g exp(logits - shift) / sum`` (plus the maximum's own, shared
  among ties as jax's rule for ``max`` does; 0 under the usual
  ``stop_gradient``) goes through the product: the block's rows of ``dh``,
  and ``dW`` and ``db`` summed over blocks in float32 (each block's ``dW`` added
  in place, :data:`COLUMNS` columns at a time, so no second width x V array is
  held). Under ``jax.grad`` the forward's values are not read, so XLA drops the
  forward loop and the gradient costs the original's three products.

* **The label with its normaliser.** Where the program also reads the label's
  logit (and, for smoothed labels, the logits' row sums), the same loop has it
  as a third (and fourth) result (``nn_lm_head_lse_label_<block>``, found from
  the label's gather; ``nn_lm_head_label`` then declines), and the backward adds
  their cotangents to each block's before the products: ``softmax - one_hot``
  in one array, as autodiff of the original does. Apart, an infinite weight in
  the label's column gave ``0 * inf - inf`` (NaN) where the original has ``-inf``.

So the program holds one block of logits (block x V) at a time, forward and
backward. The tokens are every axis of the logits but the last (the
vocabulary, ``W``'s one free axis), taken in order; the rule declines when
their number is not a multiple of the block or is under two blocks, when
``W`` has more than one free axis or sits left of ``h``, when the product has
batch axes, and when the shift is not computed from the logits' maximum.
The cost model chooses, the block too: one rule per block of :data:`BLOCKS`
(128, 256 and 512 tokens) adds its loop wherever the block divides the
tokens, and extraction takes the cheapest. The model weighs each loop's
iterations, each of which reads the whole ``W`` again, against the block of
logits it holds (a byte held at the peak is priced as one written,
``AnalyticCost.memory``), so a small ``W`` takes the smallest block, a large
one larger blocks (256 tokens at width 512 and V=32,768), dearer iterations
larger ones still and ``memory_budget`` the one that fits. With a small
vocabulary the logits are small and every loop is priced above them, so the
program is kept. On a GPU the loop is not offered
(:func:`offered`: it measured slower there). A shift read without
``stop_gradient`` is declined (its derivative would need the maximum's whole
share).

The part is ``identity`` class, with the tolerance of ``linalg`` and
``attention``, ``Tolerance(rtol=2e-4, atol=2e-5)`` at float32 (scaled by
machine epsilon for other dtypes): the per-block products and the gathered
row products sum the contraction in another order than the whole product,
and ``dW`` is summed over blocks; nothing else changes (the maximum, the
shift, the sum over the vocabulary and every elementwise operation are the
original's, so infinite and NaN logits come out as the original computes
them). ``tests/test_lm_head.py`` holds losses and gradients to it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rewrite import Params, Pat, Ruleset, Tolerance, Value, procedural
from rewrite import rule as _rule
from rulesets._lmhead_loop import _label_column, _label_logit, _normaliser, _row_sums, _sigma

# Every rule's example program is rewritten by the contract test (tests/test_contract.py), not on import.
rule = functools.partial(_rule, check=False)

__all__ = ["nn_lm_head", "BLOCKS"]

#: Token blocks offered to the cost model: one rule each, ``nn_lm_head_lse_<block>``; extraction chooses.
BLOCKS = (128, 256, 512)

D, S, I, X, Y = Pat.var("d"), Pat.var("s"), Pat.var("i"), Pat.var("x"), Pat.var("y")
#: A gather: the term language keeps it as an opaque node over its operands (the procedures check the primitive).
_GATHER = Pat("opaque", [D, I], params="g")


# ---------------------------------------------------------------------- the logits as a product
class _Head:
    """``logits = cast(h @ W + b)`` with the vocabulary last: what the rules need to compute it by blocks.

    ``h_perm`` puts ``h``'s token axes first and its contracted axes last, ``w_perm`` puts ``W``'s
    contracted axes first (in ``h``'s order) and its vocabulary axis last; ``bias`` is a value whose
    every axis but the last has size 1 (or that broadcasts along the vocabulary only), or ``None``.
    """

    def __init__(self, h: Value, w: Value, bias: Value | None, bias_from_vector: bool, cast: Any, dot: dict,
                 h_perm: tuple, w_perm: tuple, rows: tuple, c: int, v: int) -> None:
        self.h, self.w, self.bias, self.bias_from_vector = h, w, bias, bias_from_vector
        self.cast, self.dot, self.h_perm, self.w_perm = cast, dot, h_perm, w_perm
        self.rows, self.c, self.v = rows, c, v
        self.r = int(np.prod(rows, dtype=np.int64))

    def values(self) -> list[Value]:
        return [self.h, self.w] + ([self.bias] if self.bias is not None else [])

    def spec(self) -> tuple:
        """Plain data (hashable) that, with the values, rebuilds the logits: what the traced functions close over."""
        return (self.h_perm, self.w_perm, self.rows, self.c, self.v, self.bias is not None, self.cast,
                tuple(sorted(self.dot.items())))


def _vector_bias(b: Value, shape: tuple) -> tuple[Value, bool] | None:
    """``b`` as a bias along the last axis of ``shape``: itself (size 1 elsewhere), or the vector it broadcasts."""
    if b.ndim == len(shape) and b.shape[-1] == shape[-1] and all(d == 1 for d in b.shape[:-1]):
        return b, False
    node = b.node("broadcast_in_dim")
    if node is None or node.params.get("sharding") is not None or b.shape != shape:
        return None
    (o,) = node.operands[:1]
    dims = tuple(node.params["broadcast_dimensions"])
    if all(o.shape[i] == 1 for i, d in enumerate(dims) if d != len(shape) - 1) and \
            (len(shape) - 1) in dims and o.shape[dims.index(len(shape) - 1)] == shape[-1]:
        return o, True
    return None


def head_of(d: Value) -> _Head | None:
    """The product ``d`` is, or ``None``: ``[convert](dot_general(h, W) [+ bias])``, vocabulary last."""
    if not d.is_floating or d.ndim < 2:
        return None
    cast = None
    conv = d.node("convert_element_type")
    x = d
    if conv is not None and conv.operands[0].is_floating and conv.params.get("sharding") is None:
        cast, x = d.dtype, conv.operands[0]
    bias = None
    from_vector = False
    prod = x
    if x.node("dot_general") is None:
        add = x.node("add")
        if add is None:
            return None
        for p, b in (add.operands, add.operands[::-1]):
            if p.shape == x.shape and p.node("dot_general") is not None and b.dtype == x.dtype:
                found = _vector_bias(b, x.shape)
                if found is not None:
                    prod, (bias, from_vector) = p, found
                    break
        else:
            return None
    node = prod.node("dot_general")
    params = dict(node.params)
    if params.get("out_sharding") is not None:
        return None
    h, w = node.operands
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    if lb or rb:
        return None
    hfree = [a for a in range(h.ndim) if a not in lc]
    wfree = [a for a in range(w.ndim) if a not in rc]
    if len(wfree) != 1 or not hfree or h.dtype != w.dtype:
        return None
    rows = tuple(h.shape[a] for a in hfree)
    c = int(np.prod([h.shape[a] for a in lc], dtype=np.int64))
    dot = {k: params[k] for k in ("precision", "preferred_element_type") if k in params}
    return _Head(h, w, bias, from_vector, cast, dot, tuple(hfree) + tuple(lc), tuple(rc) + (wfree[0],), rows, c,
                 w.shape[wfree[0]])


# ---------------------------------------------------------------------- the normaliser over token blocks
def _shift_kind(shift_of: Any, shape: tuple, dtype: Any) -> str | None:
    """Which shift ``shift_of`` (the program's, read back as a function of the rows' maxima) is, or ``None``.

    ``"max"``: the maximum itself (``jax.nn.log_softmax``'s ``max(-inf, m)``); ``"finite"``: the maximum
    where finite, 0 elsewhere (``jax.nn.logsumexp``, optax). Found by running it on maxima that differ in
    every row, the infinities and NaN among them (it is made of per-row operations only, see
    :func:`_max_under`), and only where its derivative is 0 (the shift is under ``stop_gradient``). The
    answer is kept by the function's jaxpr where that holds every operation (no constants, no inner
    jaxprs), so the rules for each block size, and later rewrites of the same head, run the probe once.
    """
    key = _shift_key(shift_of, shape, dtype)
    if key is not None and all(e.primitive.name != "stop_gradient" for e in shift_of.jaxpr.jaxpr.eqns):
        # Made of the shift operations alone and not under stop_gradient: where it returns the maximum (both
        # kinds do, at every finite row) it selects its input, whose derivative there is 1, not 0
        return None
    if key is not None and key in _KINDS:
        return _KINDS[key]
    kind = _probe_shift(shift_of, shape, dtype)
    if key is not None:
        _KINDS[key] = kind
        while len(_KINDS) > 256:
            del _KINDS[next(iter(_KINDS))]
    return kind


#: :func:`_shift_kind`'s answers by :func:`_shift_key`
_KINDS: dict[tuple, str | None] = {}


def _shift_key(shift_of: Any, shape: tuple, dtype: Any) -> tuple | None:
    """The shift's jaxpr text with the probe's shape and dtype, where that text says all it computes."""
    closed = getattr(shift_of, "jaxpr", None)
    if closed is None or closed.consts or any(e.primitive.name not in _SHIFT_OPS for e in closed.jaxpr.eqns):
        return None
    return str(closed.jaxpr), tuple(shape), np.dtype(dtype).str, jax.config.jax_enable_x64


def _probe_shift(shift_of: Any, shape: tuple, dtype: Any) -> str | None:
    size = int(np.prod(shape))
    specials = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, 1.5, -2.25, 3e4], np.float64)
    probe = np.arange(size, dtype=np.float64) * 0.37 - size * 0.1
    probe[: min(size, specials.size)] = specials[: min(size, specials.size)]

    def run(x: Any) -> tuple:  # one compiled program, not one per operation
        out, tangent = jax.jvp(lambda t: shift_of(t)[0], (x,), (jnp.ones_like(x),))
        return out, tangent, {kind: _sigma(kind, x) for kind in ("max", "finite")}

    try:  # compiled ahead and called on an array: it runs even while the program is traced (under jit, say)
        x = np.asarray(probe.reshape(shape), dtype)
        out, tangent, want = jax.jit(run).lower(jax.ShapeDtypeStruct(x.shape, x.dtype)).compile()(x)
    except Exception:  # noqa: BLE001  (a function the probe cannot run is not a known shift)
        return None
    out = np.asarray(out, np.float64).reshape(shape)
    if np.any(np.asarray(tangent, np.float64) != 0):
        return None
    for kind in ("max", "finite"):
        if np.array_equal(out, np.asarray(want[kind], np.float64), equal_nan=True):
            return kind
    return None


def _log_of(m: Any, total: Value) -> Value | None:
    """The program's ``log`` of the sum ``total``: ``log(total)``, through ``abs`` (optax) or a broadcast
    that keeps the rows (``keepdims``, ``jax.nn.log_softmax``), or ``None``."""
    rows = total.shape
    frontier = [total]
    for _ in range(2):
        nxt = []
        for v in frontier:
            for user, node in m.users(v):
                if node.prim == "log" and user.shape in (rows, rows + (1,)):
                    return user
                if node.prim == "abs" or (node.prim == "broadcast_in_dim" and user.shape == rows + (1,)
                                          and tuple(node.params["broadcast_dimensions"]) == tuple(range(len(rows)))):
                    nxt.append(user)
        frontier = nxt
    return None


_SHIFT_OPS = frozenset({"stop_gradient", "broadcast_in_dim", "max", "min", "select_n", "is_finite", "reshape",
                        "convert_element_type", "squeeze", "expand_dims"})


def _max_under(shift: Value, d: Value, axis: int) -> Value | None:
    """The ``max(d, axis)`` that ``shift`` is computed from (through the ops a shift is made of), or ``None``."""
    seen: set = set()
    stack = [(shift, 0)]
    found = None
    while stack:
        v, depth = stack.pop()
        if depth > 8 or v.name in seen:
            continue
        seen.add(v.name)
        if v.literal is not None or v.size == 1:
            continue
        rm = v.node("reduce_max")
        if rm is not None:
            if rm.operands[0].name != d.name or tuple(rm.params["axes"]) != (axis,):
                return None
            found = v
            continue
        for node in v.nodes:
            if node.prim in _SHIFT_OPS:
                stack.extend((o, depth + 1) for o in node.operands)
                break
        else:
            return None
    return found


def _exp_as(shape: tuple):
    def fn(t: Any) -> Any:
        return jnp.exp(t).reshape(shape)

    return fn


def offered() -> bool:
    """Whether the pack offers its token-block loop (the rules below decline where it does not).

    Not on a GPU: there the loop measured slower than XLA's whole logits (H200, jax 0.11.2, f32, N=2048,
    width 512, V=32,768: the loss 0.48-0.65x and its gradient 0.18-0.29x, though they hold 17-22% and 13-15%
    of the original's temporaries). With the GPU's measured loop trip (8.1 us) the model prices them 0.80x
    and 0.19x by time, but extraction's memory price and lean band still take a loop of 4 blocks for the
    loss (``benchmarks/results/gpu.md``, ``benchmarks/gpu_loops.py``). A GPU model of loop bodies would let
    extraction decide there, and a memory budget choose the loop.
    """
    return jax.default_backend() != "gpu"


def _site(m: Any, d: Value, shift: Value, total: Value, axes: tuple, blocks: tuple) -> tuple | None:
    """A normaliser ``total = sum(exp(d - shift))`` along the vocabulary that a loop over blocks of tokens (one
    of ``blocks``) can compute: ``(head, kind, rmax, log, target)``, or ``None``.

    ``rmax`` is the program's ``max(d)`` the shift is made from, ``kind`` which shift (:func:`_shift_kind`),
    ``log`` the program's ``log(total)`` where it takes one (``None`` else), and ``target`` the value the
    loop's second result stands for (the log, else the sum).
    """
    if not offered() or tuple(axes) != (d.ndim - 1,):
        return None
    head = head_of(d)
    if head is None or not any(head.r % block == 0 and head.r // block >= 2 for block in blocks):
        return None
    if shift.shape != d.shape[:-1] + (1,) or shift.dtype != d.dtype:
        return None
    rmax = _max_under(shift, d, d.ndim - 1)
    if rmax is None:
        return None
    shift_of = m.function([shift], [rmax])
    if shift_of is None:
        return None
    kind = _shift_kind(shift_of, rmax.shape, rmax.dtype)
    if kind is None:
        return None
    # The sum's log where the program takes it: the backward then needs nothing of the forward (the log's
    # derivative, 1 / sum, is computed in each block), and under jax.grad the forward loop is dropped.
    log = _log_of(m, total)
    return head, kind, rmax, log, (total if log is None else log)


def _loop(m: Any, site: tuple, total: Value, block: int, label: tuple | None = None, idx: Value | None = None):
    """Trace the loop for ``site`` (:func:`_site`) into the e-graph: the pairs to union, and the loop's results."""
    head, kind, rmax, log, target = site
    outs = m.trace(_normaliser(head.spec(), block, kind, log is not None, target.shape, label),
                   *head.values(), *([] if idx is None else [idx]))
    pairs = [(target, outs[1]), (rmax, outs[0])]
    if log is not None:  # the sum itself, for any other reader (and for a check of this rule alone)
        pairs.append((total, m.trace(_exp_as(total.shape), outs[1])))
    return pairs, outs


def _lse_rule(block: int):
    @procedural
    def build(m: Any) -> Any:
        r = m.params("r")
        if r.sharded:
            return None
        site = _site(m, m["d"], m["s"], m.root, r.axes, (block,))
        return None if site is None else _loop(m, site, m.root, block)[0]

    return build


def _normalisers_of(m: Any, d: Value) -> list[tuple[Value, Value, tuple]]:
    """Each ``sum(exp(d - shift))`` the e-graph holds over ``d``: ``(shift, the sum, its axes)``."""
    found = []
    for sub, node in m.users(d):
        if node.prim != "sub" or len(node.operands) != 2 or node.operands[0].name != d.name:
            continue
        for ex, en in m.users(sub):
            if en.prim != "exp":
                continue
            for total, rn in m.users(ex):
                if rn.prim == "reduce_sum" and not Params(rn.primitive, rn.params).sharded:
                    found.append((node.operands[1], total, tuple(rn.params["axes"])))
    return found


def _joint_site(m: Any, d: Value, blocks: tuple) -> tuple | None:
    """``(site, total)`` for the first normaliser over ``d`` that a loop over blocks of tokens (one of ``blocks``)
    computes, or ``None``."""
    for shift, total, axes in _normalisers_of(m, d):
        site = _site(m, d, shift, total, axes, blocks)
        if site is not None:
            return site, total
    return None


def _smoothed_over(m: Any, d: Value) -> bool:
    """Whether the program sums smoothed labels against ``d`` (or ``log_softmax(d)``): ``sum((p a + q) * x)``
    along the vocabulary, ``x`` made of ``d`` and row terms (:func:`_peel`), which ``nn_lm_head_smooth``
    rewrites to read the logits' row sums."""
    frontier, seen = [d], set()
    for _ in range(3):  # d, d - shift, d - shift - log(sum): the terms log_softmax subtracts
        nxt = []
        for x in frontier:
            for user, node in m.users(x):
                if user.name in seen or user.shape != d.shape:
                    continue
                seen.add(user.name)
                if node.prim in ("sub", "add") and node.operands[0].name == x.name:
                    nxt.append(user)
                elif node.prim == "mul" and len(node.operands) == 2:
                    other = node.operands[1] if node.operands[0].name == x.name else node.operands[0]
                    if _smoothed(other) is not None and any(
                            n.prim == "reduce_sum" and tuple(n.params["axes"]) == (d.ndim - 1,) for _, n in m.users(user)):
                        return True
        frontier = nxt
    return False


def _joint_rule(block: int):
    """The loop with the label's logit as its third result (:func:`_normaliser`'s ``label``), found from the
    label's gather: the backward then forms ``softmax - one_hot`` per block, as autodiff of the original
    does, where the normaliser's loop and the label's product (``nn_lm_head_label``) would add their terms
    of ``dh`` apart (NaN, not the original's ``-inf``, through a column of ``W`` that holds an infinity)."""
    @procedural
    def build(m: Any) -> Any:
        gather = _label_gather(m)
        if gather is None:
            return None
        d, idx, fills, fill = gather
        found = _joint_site(m, d, (block,))
        if found is None:
            return None
        site, total = found
        head = site[0]
        rows = _smoothed_over(m, d)
        pairs, outs = _loop(m, site, total, block, (fills, fill, m.root.shape, rows), idx)
        pairs.append((m.root, outs[2]))
        if rows:  # the row sums nn_lm_head_smooth traced (the same term), from the loop
            pairs.append((m.trace(_row_sums(head.spec()), *head.values()), outs[3]))
        return pairs

    return build


# ---------------------------------------------------------------------- the label's logit
def _take_along_last(g: dict, d_ndim: int, idx_shape: tuple) -> bool:
    """Whether a gather's params are ``take_along_axis`` along the last axis (one element per row)."""
    dn = g["dimension_numbers"]
    axis = d_ndim - 1
    batch = tuple(range(axis))
    return (tuple(dn.offset_dims) == () and tuple(dn.collapsed_slice_dims) == (axis,)
            and tuple(dn.start_index_map) == (axis,) and tuple(dn.operand_batching_dims) == batch
            and tuple(dn.start_indices_batching_dims) == batch and tuple(g["slice_sizes"]) == (1,) * d_ndim
            and len(idx_shape) == d_ndim + 1 and idx_shape[-2:] == (1, 1))


def _mode(g: dict) -> tuple[bool, Any]:
    """``(fills, fill)``: whether an out-of-range label gives ``fill`` (else the clamped column)."""
    mode = g.get("mode")
    fills = "FILL" in str(mode)
    return fills, g.get("fill_value")


def _label_gather(m: Any) -> tuple | None:
    """``(logits, idx, fills, fill)`` where the match's gather takes one logit per row along the vocabulary
    (``take_along_axis``) with a scalar fill, or ``None``."""
    g = m.params("g")
    d, idx = m["d"], m["i"]
    if g.prim != "gather" or not _take_along_last(g, d.ndim, idx.shape):
        return None
    fills, fill = _mode(g)
    if fill is not None and not np.isscalar(fill):
        return None
    return d, idx, fills, None if fill is None else float(fill)


@procedural
def _label(m: Any) -> Any:
    gather = _label_gather(m)
    if gather is None:
        return None
    d, idx, fills, fill = gather
    head = head_of(d)
    if head is None:
        return None
    if _joint_site(m, d, BLOCKS) is not None:
        # The loop computes the label with its normaliser (nn_lm_head_lse_label_*), so that the backward adds
        # their terms before the product, as the original's does (their sum apart is NaN where it is -inf).
        return None
    return m.trace(_label_logit(head.spec(), fills, fill, m.root.shape), *head.values(), idx)


def _peel(w: Value, axis: int, most: int = 8) -> tuple[Value, list[tuple[int, Value]]]:
    """``w`` as ``base + sum(sign * term)``, each term of size 1 along ``axis`` (added or subtracted, broadcast):
    ``log_softmax(z)`` is ``(z - max) - log(sum)``, so a gather from it is a gather from ``z`` and two terms.
    (``nn_one_hot_sum`` peels the same way, and through ``log(softmax(z))``, which ``nn_log_softmax`` rewrites
    into this form.)"""
    terms: list[tuple[int, Value]] = []
    sign = 1
    for _ in range(most):
        node = w.node("sub") or w.node("add")
        if node is None or len(node.operands) != 2:
            break
        a, b = node.operands
        if b.ndim == w.ndim and b.shape[axis] == 1 and a.shape == w.shape and b.dtype == w.dtype:
            terms.append((sign if node.prim == "add" else -sign, b))
            w = a
            continue
        if node.prim == "add" and a.ndim == w.ndim and a.shape[axis] == 1 and b.shape == w.shape and a.dtype == w.dtype:
            terms.append((sign, a))
            w = b
            continue
        break
    return w, terms


def _peel_gather(g: Any, signs: tuple, fills: bool, v: int):
    def fn(base: Any, idx: Any, *terms: Any) -> Any:
        picked = g.bind(base, idx)
        # innermost term first, as the program subtracts them (x - max, then - log(sum)): see nn._gathered
        for sign, term in reversed(list(zip(signs, terms))):
            picked = picked + term if sign > 0 else picked - term
        if fills:
            _, inside = _label_column(idx.reshape(picked.shape), v)
            fill = g.get("fill_value")
            value = jnp.nan if fill is None else fill
            picked = jnp.where(inside, picked, jnp.asarray(value, picked.dtype))
        return picked

    return fn


@procedural
def _label_peel(m: Any) -> Any:
    g = m.params("g")
    x, idx = m["d"], m["i"]
    if g.prim != "gather" or not x.is_floating or not _take_along_last(g, x.ndim, idx.shape):
        return None
    base, terms = _peel(x, x.ndim - 1)
    if not terms or head_of(base) is None:
        return None
    fills, _ = _mode(g)
    return m.trace(_peel_gather(g, tuple(sign for sign, _ in terms), fills, x.shape[-1]), base, idx,
                   *[t for _, t in terms])


# ---------------------------------------------------------------------- smoothed labels
def _scalar(v: Value) -> bool:
    return v.size == 1 and v.ndim == 0


def _smoothed(lab: Value) -> tuple[Value, Value | None, Value] | None:
    """``(a, p, q)`` when ``lab`` is ``p * a + q`` (``p`` may be absent) with ``p`` and ``q`` scalars, as
    ``optax.smooth_labels`` writes ``(1 - alpha) * labels + alpha / V``; else ``None``."""
    add = lab.node("add")
    if add is None or len(add.operands) != 2:
        return None
    for a, q in (add.operands, add.operands[::-1]):
        if a.shape != lab.shape or not _scalar(q) or q.dtype != lab.dtype:
            continue
        mul = a.node("mul")
        if mul is not None and len(mul.operands) == 2:
            for x, p in (mul.operands, mul.operands[::-1]):
                if x.shape == lab.shape and _scalar(p) and p.dtype == lab.dtype:
                    return x, p, q
        return a, None, q
    return None


def _smooth_sum(signs: tuple, has_p: bool, v: int, out_shape: tuple, dtype: Any):
    """``fn(a, x, [p], q, rows, *terms) = p * sum(a * x) + q * sum(x)`` along the vocabulary, where
    ``x = logits + sum(sign * term)``: ``sum(x)`` is the logits' row sums ``rows`` (:func:`_row_sums`) plus
    ``V`` times the terms, so only ``sum(a * x)`` reads ``x`` (a one-hot ``a`` makes it a gather:
    ``nn_one_hot_sum``)."""

    def fn(a: Any, x: Any, *rest: Any) -> Any:
        p, rest = (rest[0], rest[1:]) if has_p else (None, rest)
        q, rows, *terms = rest
        total = rows.astype(dtype).reshape(out_shape)
        for sign, term in reversed(list(zip(signs, terms))):  # innermost first, as the program subtracts them
            t = jnp.asarray(v, dtype) * term.reshape(out_shape)
            total = total + t if sign > 0 else total - t
        picked = jnp.sum(a * x, axis=-1)
        return (picked if p is None else p * picked) + q * total

    return fn


@procedural
def _smooth(m: Any) -> Any:
    r = m.params("r")
    x, y = m["x"], m["y"]
    if r.sharded or x.ndim < 2 or tuple(r.axes) != (x.ndim - 1,):
        return None
    for lab, w in ((x, y), (y, x)):
        found = _smoothed(lab)
        if found is None or lab.shape != w.shape or not w.is_floating or w.dtype != m.root.dtype:
            continue
        base, terms = _peel(w, w.ndim - 1)
        head = head_of(base)
        if head is None:
            continue
        a, p, q = found
        fn = _smooth_sum(tuple(sign for sign, _ in terms), p is not None, head.v, m.root.shape, m.root.dtype)
        scalars = [q] if p is None else [p, q]
        rows = m.trace(_row_sums(head.spec()), *head.values())
        return m.trace(fn, a, w, *scalars, rows, *[t for _, t in terms])
    return None


# ---------------------------------------------------------------------- examples and the part
def _ce_int(h: Any, w: Any, y: Any) -> Any:
    logits = h @ w
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(lse - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0])


def _ce_log_softmax(h: Any, w: Any, b: Any, y: Any) -> Any:
    logp = jax.nn.log_softmax(h @ w + b, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))


def _ce_smooth(h: Any, w: Any, y: Any) -> Any:
    labels = 0.9 * jax.nn.one_hot(y, w.shape[-1]) + 0.1 / w.shape[-1]  # optax.smooth_labels(one_hot, 0.1)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(h @ w), axis=-1))


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _i32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _example(block: int) -> tuple:
    return _ce_int, (_f32(2 * block, 8), _f32(8, 16), _i32(2 * block))


nn_lm_head = Ruleset("nn_lm_head", [
    rule(_GATHER, _label, name="nn_lm_head_label",                                  # (h @ W + b)[y] -> h . W[:, y] + b[y]
         example_program=(_ce_int, (_f32(8, 4), _f32(4, 16), _i32(8)))),
    rule(_GATHER, _label_peel, name="nn_lm_head_label_peel",                        # log_softmax(z)[y] -> z[y] - max - log(sum)
         example_program=(_ce_log_softmax, (_f32(8, 4), _f32(4, 16), _f32(16), _i32(8)))),
    rule(Pat("reduce_sum", Pat("mul", X, Y), params="r"), _smooth, name="nn_lm_head_smooth",  # sum((p a + q) * (h @ W - t)) -> p sum(a * ...) + q (h @ sum(W) - V t)
         example_program=(_ce_smooth, (_f32(8, 4), _f32(4, 16), _i32(8)))),
] + [
    rule(_GATHER, _joint_rule(blk), name=f"nn_lm_head_lse_label_{blk}",             # lse(h @ W) and (h @ W)[y] -> one scan over token blocks
         example_program=_example(blk))
    for blk in BLOCKS
] + [
    rule(Pat("reduce_sum", Pat("exp", Pat("sub", D, S)), params="r"), _lse_rule(blk),                       # sum(exp(h @ W - shift)) -> scan over token blocks
         name=f"nn_lm_head_lse_{blk}", example_program=_example(blk))
    for blk in BLOCKS
], soundness="identity", tolerance=Tolerance(rtol=2e-4, atol=2e-5),
    description="a cross-entropy over a product h @ W computed over token blocks, never holding the logits")
