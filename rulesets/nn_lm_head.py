"""``rulesets.nn``'s language-model head: a cross-entropy over ``h @ W (+ b)`` without the tokens x vocabulary logits.

A language model's loss reads from its logits ``h @ W + b`` (tokens x V) only per-token quantities: the
log-normaliser, the label's logit, the logits' row sums (smoothed labels), a dense target's weighted sum
(labels smoothed outside the loss, a teacher's probabilities). XLA keeps the logits whole, forward and
backward. The rules below read those quantities from the product instead:

* the label's logit is a row of the product, ``h . W[:, y] + b[y]``, through a ``log_softmax`` too;
* smoothed labels ``p * one_hot(y) + q`` need the logits' row sums, ``h @ W.sum(-1) + sum(b)``;
* the normaliser ``sum(exp(logits - shift))`` (shift from ``max(logits)`` under ``stop_gradient``), with the label,
  row sums or a dense target beside it, is a loop (:func:`rulesets.nn_lm_head_kernels.blocked_loss`).

One rule per token block of :data:`BLOCKS` offers its loop where the block divides the tokens (at least two
blocks); the cost model chooses (in a step, on the loss's joint program: ``jointly=True``), the block too. A dense
target ``t`` (``optax.softmax_cross_entropy(logits, t)`` with ``t`` an input) is read a block of rows per step,
``sum(t * ((z - shift) - log(sum)))`` elementwise as ``log_softmax`` computes it, in blocks of 128 tokens only:
XLA:CPU copies each block of ``t`` out of it (two blocks held), and 128 tokens measured fastest too. On a GPU
the loop is not offered by default (:func:`offered`). The part is ``identity`` class with the tolerance of
``linalg``: the products sum their contraction in another order, ``dW`` over blocks, the forward each row's
exponentials by vocabulary tiles (:func:`~rulesets.nn_lm_head_kernels.combine_tiles`); infinite and NaN logits
come out as the original computes them. ``docs/nn.md`` says more; ``tests/test_lm_head.py`` holds losses and gradients to it.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rewrite import Params, Pat, Ruleset, Tolerance, Value, procedural, rule
from rewrite.cache.fingerprint import Memo
from rewrite.rules.match import SHIFT_OPS
from rulesets._examples import f32, i32
from rulesets.nn_lm_head_kernels import COLUMNS, WHOLE_BYTES, Layout, Reads, Stats, blocked_loss, known_shift_kind, \
    label_logit, label_plus_terms, row_sums, shift_kind, smoothed_sum

__all__ = ["nn_lm_head", "lm_head_rules", "BLOCKS", "offered"]

#: Token blocks of the backward, one rule each (the forward is one program for all: a forward alone takes the
#: first; under ``jax.grad`` at N=2048, C=512, V=32,768 128 prices 21% above JAX's VJP and is declined, 256 17%).
BLOCKS = (256, 128, 512)

D, S, I, X, Y = Pat.var("d"), Pat.var("s"), Pat.var("i"), Pat.var("x"), Pat.var("y")
#: A gather: the term language keeps it as an opaque node over its operands (the procedures check the primitive).
_GATHER = Pat("opaque", [D, I], params="g")
_SUM_PRODUCT = Pat("reduce_sum", Pat("mul", X, Y), params="r")
_NORMALISER = Pat("reduce_sum", Pat("exp", Pat("sub", D, S)), params="r")


def offered(loop: bool | None = None) -> bool:
    """Whether the pack offers its token loop: ``loop`` where given, else everywhere but on a GPU (there it
    measured slower than XLA's whole logits, ``benchmarks/results/gpu.md``)."""
    return jax.default_backend() != "gpu" if loop is None else bool(loop)


# ---------------------------------------------------------------------- reading the program
class Head(NamedTuple):
    """Logits ``cast(h @ W + bias)``: the values, and their :class:`~rulesets.nn_lm_head_kernels.Layout`."""
    h: Value
    w: Value
    bias: Value | None
    layout: Layout

    def values(self) -> list[Value]:
        return [self.h, self.w] + ([self.bias] if self.bias is not None else [])


def _vector_bias(b: Value, shape: tuple) -> Value | None:
    """``b`` as a bias along the last axis of ``shape``: itself (size 1 elsewhere), or the vector it broadcasts."""
    if b.ndim == len(shape) and b.shape[-1] == shape[-1] and all(d == 1 for d in b.shape[:-1]):
        return b
    node = b.node("broadcast_in_dim")
    if node is None or node.params.get("sharding") is not None or b.shape != shape:
        return None
    o, dims, last = node.operands[0], tuple(node.params["broadcast_dimensions"]), len(shape) - 1
    ok = last in dims and o.shape[dims.index(last)] == shape[-1]
    return o if ok and all(o.shape[i] == 1 for i, d in enumerate(dims) if d != last) else None


def head_of(d: Value) -> Head | None:
    """The product ``d`` is, ``[convert](dot_general(h, W) [+ bias])`` with the vocabulary last, or ``None``."""
    if not d.is_floating or d.ndim < 2:
        return None
    conv, cast, x, bias = d.node("convert_element_type"), None, d, None
    if conv is not None and conv.operands[0].is_floating and conv.params.get("sharding") is None:
        cast, x = d.dtype, conv.operands[0]
    prod = x
    if x.node("dot_general") is None:
        add = x.node("add")
        pairs = [] if add is None else [add.operands, add.operands[::-1]]
        found = [(p, b) for p, b in pairs if p.shape == x.shape and p.node("dot_general") is not None
                 and b.dtype == x.dtype and _vector_bias(b, x.shape) is not None]
        if not found:
            return None
        prod, bias = found[0][0], _vector_bias(found[0][1], x.shape)
    params = dict(prod.node("dot_general").params)
    h, w = prod.node("dot_general").operands
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    hfree = [a for a in range(h.ndim) if a not in lc]
    wfree = [a for a in range(w.ndim) if a not in rc]
    if params.get("out_sharding") is not None or lb or rb or len(wfree) != 1 or not hfree or h.dtype != w.dtype:
        return None
    dot = tuple(sorted((k, params[k]) for k in ("precision", "preferred_element_type") if k in params))
    layout = Layout(tuple(hfree) + tuple(lc), tuple(rc) + (wfree[0],), tuple(h.shape[a] for a in hfree),
                    int(np.prod([h.shape[a] for a in lc], dtype=np.int64)), w.shape[wfree[0]], bias is not None,
                    cast, dot)
    return Head(h, w, bias, layout)


def _shift_kind(shift_of: Any, shape: tuple, dtype: Any) -> str | None:
    """:func:`~rulesets.nn_lm_head_kernels.shift_kind` of the program's shift, as a function of the rows'
    maxima. The answer is kept by the function's jaxpr where that holds every operation (no constants, no
    inner jaxprs), so the rules for each block size, and later rewrites of the same head, run the probe once."""
    key = _shift_key(shift_of, shape, dtype)
    if key is not None and all(e.primitive.name != "stop_gradient" for e in shift_of.jaxpr.jaxpr.eqns):
        # Made of the shift operations alone and not under stop_gradient: where it returns the maximum (both
        # kinds do, at every finite row) it selects its input, whose derivative there is 1, not 0
        return None
    if key is not None and key in _KINDS:
        return _KINDS[key]
    kind = (key is not None and known_shift_kind(key[0], shape, dtype)) or shift_kind(shift_of, shape, dtype)
    return kind if key is None else _KINDS.keep(key, kind)


#: :func:`_shift_kind`'s answers by :func:`_shift_key`
_KINDS = Memo("rulesets.nn_lm_head._KINDS")


def _shift_key(shift_of: Any, shape: tuple, dtype: Any) -> tuple | None:
    """The shift's jaxpr text with the probe's shape and dtype, where that text says all it computes."""
    closed = getattr(shift_of, "jaxpr", None)
    if closed is None or closed.consts or any(e.primitive.name not in SHIFT_OPS for e in closed.jaxpr.eqns):
        return None
    return str(closed.jaxpr), tuple(shape), np.dtype(dtype).str, jax.config.jax_enable_x64


def _log_of(m: Any, total: Value) -> Value | None:
    """The program's ``log(total)``, through ``abs`` (optax) or a broadcast that keeps the rows, or ``None``."""
    rows, frontier = total.shape, [total]
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


class Site(NamedTuple):
    """A normaliser ``sum(exp(d - shift))`` that a token loop computes: the logits, the shift's kind, the program's
    ``max(d)``, its ``log`` of the sum (or ``None``), the sum, the value the loop's second result stands for (the log,
    else the sum), and whether a backward as written reads the exponentials whole (``Match.read_whole``) of logits of
    at most :data:`~rulesets.nn_lm_head_kernels.WHOLE_BYTES`: no loop is built there."""
    head: Head
    kind: str
    rmax: Value
    log: Value | None
    total: Value
    target: Value
    whole: bool


def _site(m: Any, d: Value, shift: Value, total: Value, axes: tuple, blocks: tuple, loop: bool | None) -> Site | None:
    if not offered(loop) or tuple(axes) != (d.ndim - 1,):
        return None
    r = None if (head := head_of(d)) is None else head.layout.tokens
    if r is None or not any(r % block == 0 and r // block >= 2 for block in blocks) or \
            shift.shape != d.shape[:-1] + (1,) or shift.dtype != d.dtype:
        return None
    rmax = shift.max_under(d, d.ndim - 1)
    shift_of = None if rmax is None else m.function([shift], [rmax])
    kind = None if shift_of is None else _shift_kind(shift_of, rmax.shape, rmax.dtype)
    if kind is None:
        return None
    log = _log_of(m, total)
    whole = d.size * d.dtype.itemsize <= WHOLE_BYTES and any(
        m.read_whole(n.operands[0]) for n in total.nodes if n.prim == "reduce_sum" and n.operands[0].node("exp"))
    return Site(head, kind, rmax, log, total, total if log is None else log, whole)


def _sites(m: Any, d: Value, blocks: tuple, loop: bool | None) -> Iterator[tuple[Value, Site]]:
    """``(shift, site)`` for each normaliser over ``d`` that a loop over one of ``blocks`` computes."""
    for sub, node in m.users(d):
        if node.prim != "sub" or len(node.operands) != 2 or node.operands[0].name != d.name:
            continue
        for ex, en in [(u, n) for u, n in m.users(sub) if n.prim == "exp"]:
            for total, rn in m.users(ex):
                if rn.prim == "reduce_sum" and not Params(rn.primitive, rn.params).sharded:
                    site = _site(m, d, node.operands[1], total, tuple(rn.params["axes"]), blocks, loop)
                    if site is not None:
                        yield node.operands[1], site


def _loop(m: Any, site: Site, block: int, reads: Reads, columns: int, idx: Value | None = None,
          target: Value | None = None, shapes: dict | None = None) -> tuple[list, list]:
    """Trace the loop for ``site`` into the e-graph: the pairs to union (maximum, normaliser, the sum), and the
    loop's results (:class:`~rulesets.nn_lm_head_kernels.Stats`' fields in order, those read)."""
    head = site.head
    shapes = Stats(site.rmax.shape, site.target.shape)._replace(**(shapes or {}))
    kernel = blocked_loss(layout=head.layout, block=block, reads=reads._replace(shift=site.kind), columns=columns,
                          shapes=shapes)

    def fn(*args: Any) -> tuple:
        args = list(args)
        b = args[2] if head.bias is not None else None
        t = args.pop() if target is not None else None
        return tuple(x for x in kernel(args[0], args[1], b, args[-1].reshape(-1) if idx is not None else None, t)
                     if x is not None)

    inputs = [*head.values(), *([] if idx is None else [idx]), *([] if target is None else [target])]
    # a function of these alone: one loop per saturation (a match found again after a merge reuses it)
    outs = m.engine.once(("nn_lm_head loop", head.layout, block, reads, site.kind, columns, shapes,
                          tuple(v.name for v in inputs)), lambda: m.trace(fn, *inputs))
    pairs = [(site.target, outs[1]), (site.rmax, outs[0])]
    if site.log is not None:  # the sum itself, for any other reader (a function of its shape alone: traced once)
        pairs.append((site.total, m.trace(lambda t, shape=site.total.shape: jnp.exp(t).reshape(shape), outs[1])))
    return pairs, outs


def _label_gather(m: Any) -> tuple | None:
    """``(logits, idx, fills, fill)`` where the match's gather takes one logit per row along the vocabulary
    with a scalar fill (``fills``: out-of-range labels read ``fill``, else the clamped column), or ``None``."""
    g, d, idx = m.params("g"), m["d"], m["i"]
    if not g.takes_along_last(d.shape, idx.shape):
        return None
    fill = g.get("fill_value")
    if fill is not None and not np.isscalar(fill):
        return None
    return d, idx, "FILL" in str(g.get("mode")), None if fill is None else float(fill)


def _smoothed(lab: Value) -> tuple[Value, Value | None, Value] | None:
    """``(a, p, q)`` when ``lab`` is ``p * a + q`` (``p`` may be absent) with scalar ``p`` and ``q``, as
    ``optax.smooth_labels`` writes ``(1 - alpha) * labels + alpha / V``; else ``None``."""
    scalar = lambda v: v.size == 1 and v.ndim == 0 and v.dtype == lab.dtype  # noqa: E731
    add = lab.node("add")
    for a, q in [] if add is None or len(add.operands) != 2 else [add.operands, add.operands[::-1]]:
        if a.shape != lab.shape or not scalar(q):
            continue
        mul = a.node("mul")
        for x, p in [] if mul is None or len(mul.operands) != 2 else [mul.operands, mul.operands[::-1]]:
            if x.shape == lab.shape and scalar(p):
                return x, p, q
        return a, None, q
    return None


def _smoothed_over(m: Any, d: Value) -> bool:
    """Whether the program sums smoothed labels against ``d`` or ``d`` less row terms along the vocabulary
    (``nn_lm_head_smooth`` then reads the logits' row sums)."""
    frontier, seen = [d], set()
    for _ in range(3):  # d, d - shift, d - shift - log(sum): the terms log_softmax subtracts
        nxt = []
        for x in frontier:
            for user, node in m.users(x):
                if user.name in seen or not user.is_array or user.shape != d.shape:
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


def _one_hot_like(t: Value) -> bool:
    """Whether ``t`` is a comparison converted to floats (``jax.nn.one_hot``), or labels smoothed from one:
    the label rules read those without the target."""
    found = _smoothed(t)
    t = found[0] if found is not None else t
    conv = t.node("convert_element_type")
    return conv is not None and conv.operands[0].dtype == jnp.bool_


def _same_rows(a: Value, b: Value | None) -> bool:
    """Whether ``a`` is ``b`` with the rows kept (itself, or a broadcast that adds a unit axis)."""
    if b is None:
        return False
    node = a.node("broadcast_in_dim") or a.node("reshape")
    return a.name == b.name or (node is not None and node.operands[0].name == b.name and a.size == b.size)


# ---------------------------------------------------------------------- the rules' right sides
def _lse(block: int, columns: int, loop: bool | None):
    """``sum(exp(h @ W - shift))``: the loop's maximum and normaliser."""
    @procedural
    def build(m: Any) -> Any:
        site = None if (r := m.params("r")).sharded else _site(m, m["d"], m["s"], m.root, r.axes, (block,), loop)
        return None if not site or site.whole else _loop(m, site, block, Reads(log=site.log is not None), columns)[0]

    return build


def _lse_label(block: int, columns: int, loop: bool | None):
    """The label's logit (and, for smoothed labels, the row sums) from the loop with its normaliser, found from
    the label's gather: the backward forms ``softmax - one_hot`` per block, as autodiff of the original does."""
    @procedural
    def build(m: Any) -> Any:
        gather = _label_gather(m)
        found = next((f for f in _sites(m, gather[0], (block,), loop) if not f[1].whole), None) if gather else None
        if found is None:
            return None
        (d, idx, fills, fill), site = gather, found[1]
        rows = _smoothed_over(m, d)
        reads = Reads(log=site.log is not None, label=True, fills=fills, fill=fill, row_sums=rows)
        shapes = {"label": m.root.shape} | ({"row_sums": (site.head.layout.tokens,)} if rows else {})
        pairs, outs = _loop(m, site, block, reads, columns, idx=idx, shapes=shapes)
        pairs.append((m.root, outs[2]))
        if rows:  # the row sums nn_lm_head_smooth traced (the same term), from the loop
            pairs.append((m.trace(_row_sums_of(site.head.layout), *site.head.values()), outs[3]))
        return pairs

    return build


def _lse_target(block: int, columns: int, loop: bool | None):
    """``sum(t * log_softmax(h @ W))`` against a dense target ``t``: the loop reads ``t``'s rows per block."""
    @procedural
    def build(m: Any) -> Any:
        r = m.params("r")
        if r.sharded or m["x"].ndim < 2 or tuple(r.axes) != (m["x"].ndim - 1,):
            return None
        for t, x in ((m["x"], m["y"]), (m["y"], m["x"])):
            base, terms = x.terms_along(x.ndim - 1)
            if len(terms) != 2 or [s for s, _ in terms] != [-1, -1] or t.shape != x.shape or t.dtype != x.dtype \
                    or not x.is_floating or _one_hot_like(t):
                continue
            # the loop computes (z - shift) - log(sum) as log_softmax does: the terms must be those two
            for shift, site in _sites(m, base, (block,), loop):
                if terms[1][1].name == shift.name and _same_rows(terms[0][1], site.log) and not site.whole:
                    reads = Reads(log=True, target=True)
                    pairs, outs = _loop(m, site, block, reads, columns, target=t, shapes={"target": m.root.shape})
                    return pairs + [(m.root, outs[2])]
        return None

    return build


def _label(loop: bool | None):
    """``(h @ W + b)[y]``: the label's column of ``W`` per token, unless a loop reads it with its normaliser."""
    @procedural
    def build(m: Any) -> Any:
        gather = _label_gather(m)
        head = None if gather is None else head_of(gather[0])
        if head is None or next(_sites(m, gather[0], BLOCKS, loop), None) is not None:
            return None
        d, idx, fills, fill = gather

        def fn(*args: Any) -> Any:
            b = args[2] if head.bias is not None else None
            return label_logit(args[0], args[1], b, args[-1], layout=head.layout, fills=fills, fill=fill) \
                .reshape(m.root.shape)

        return m.trace(fn, *head.values(), idx)

    return build


@procedural
def _label_peel(m: Any) -> Any:
    """``log_softmax(z)[y]``: the gather moved onto ``z``, less the terms, as the program subtracts them."""
    g, x, idx = m.params("g"), m["d"], m["i"]
    if not x.is_floating or not g.takes_along_last(x.shape, idx.shape):
        return None
    base, terms = x.terms_along(x.ndim - 1)
    if not terms or head_of(base) is None:
        return None
    signs, fills, fill = tuple(s for s, _ in terms), "FILL" in str(g.get("mode")), g.get("fill_value")
    return m.trace(lambda base, idx, *ts: label_plus_terms(base, idx, ts, gather=g.bind, signs=signs, fills=fills,
                                                           fill=fill), base, idx, *[t for _, t in terms])


def _row_sums_of(layout: Layout):
    return lambda h, w, *b: row_sums(h, w, b[0] if b else None, layout=layout)


@procedural
def _smooth(m: Any) -> Any:
    """``sum((p a + q) * x)`` along the vocabulary is ``p sum(a * x) + q sum(x)``, where ``x`` is the logits
    less row terms, and ``sum(x)`` is their row sums plus ``V`` times the terms (summed in at least f32)."""
    r, root = m.params("r"), m.root
    if r.sharded or m["x"].ndim < 2 or tuple(r.axes) != (m["x"].ndim - 1,):
        return None
    for lab, w in ((m["x"], m["y"]), (m["y"], m["x"])):
        found = _smoothed(lab)
        base, terms = w.terms_along(w.ndim - 1)
        head = head_of(base) if found is not None and lab.shape == w.shape and w.is_floating and \
            w.dtype == root.dtype else None
        if head is None:
            continue
        (a, p, q), signs = found, tuple(s for s, _ in terms)

        def fn(a: Any, x: Any, *rest: Any) -> Any:
            p, (q, rows, *values) = (None, rest) if len(rest) == len(terms) + 2 else (rest[0], rest[1:])
            return smoothed_sum(a, x, q, rows, values, p=p, signs=signs, vocab=head.layout.vocab)

        rows = m.trace(_row_sums_of(head.layout), *head.values())
        return m.trace(fn, a, w, *([] if p is None else [p]), q, rows, *[t for _, t in terms])
    return None


# ---------------------------------------------------------------------- examples and the pack
def _ce_int(h: Any, w: Any, y: Any) -> Any:
    logits = h @ w
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0])


def _ce_log_softmax(h: Any, w: Any, b: Any, y: Any) -> Any:
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h @ w + b, axis=-1), y[:, None], axis=-1))


def _ce_smooth(h: Any, w: Any, y: Any) -> Any:
    labels = 0.9 * jax.nn.one_hot(y, w.shape[-1]) + 0.1 / w.shape[-1]  # optax.smooth_labels(one_hot, 0.1)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(h @ w), axis=-1))


def _ce_target(h: Any, w: Any, t: Any) -> Any:  # optax.softmax_cross_entropy(h @ w, t): a dense target
    return -jnp.mean(jnp.sum(t * jax.nn.log_softmax(h @ w), axis=-1))


def _int_at(block: int) -> tuple:
    return _ce_int, (f32(2 * block, 8), f32(8, 16), i32(2 * block))


def _target_at(block: int) -> tuple:
    return _ce_target, (f32(2 * block, 8), f32(8, 16), f32(2 * block, 16))


def lm_head_rules(*, columns: int = COLUMNS, loop: bool | None = None) -> Ruleset:
    """The pack, configured: ``dW`` added ``columns`` columns at a time in the backward
    (:func:`~rulesets.nn_lm_head_kernels.add_by_columns`), and the token loop offered where ``loop`` says
    (:func:`offered`: by default everywhere but on a GPU).
    ``nn_lm_head`` is the default.

    >>> lm_head_rules(loop=True).rule("nn_lm_head_lse_128").name
    'nn_lm_head_lse_128'
    """
    c, g = columns, loop
    return Ruleset("nn_lm_head", [
        rule(_GATHER, _label(g), name="nn_lm_head_label",  # (h @ W + b)[y] -> h . W[:, y] + b[y]
             example_program=(_ce_int, (f32(8, 4), f32(4, 16), i32(8)))),
        rule(_GATHER, _label_peel, name="nn_lm_head_label_peel",  # log_softmax(z)[y] -> z[y] - max - log(sum)
             example_program=(_ce_log_softmax, (f32(8, 4), f32(4, 16), f32(16), i32(8)))),
        rule(_SUM_PRODUCT, _smooth, name="nn_lm_head_smooth",  # sum((p a + q) * (h @ W - t)) -> p sum(a * ...) + q (h @ sum(W) - V t)
             example_program=(_ce_smooth, (f32(8, 4), f32(4, 16), i32(8)))),
        rule(_GATHER, _lse_label(256, c, g), name="nn_lm_head_lse_label_256",  # lse(h @ W) and (h @ W)[y] -> one scan over token blocks
             example_program=_int_at(256)),
        rule(_GATHER, _lse_label(128, c, g), name="nn_lm_head_lse_label_128",  # lse(h @ W) and (h @ W)[y] -> one scan over token blocks
             example_program=_int_at(128)),
        rule(_GATHER, _lse_label(512, c, g), name="nn_lm_head_lse_label_512",  # lse(h @ W) and (h @ W)[y] -> one scan over token blocks
             example_program=_int_at(512)),
        rule(_SUM_PRODUCT, _lse_target(128, c, g), name="nn_lm_head_lse_target_128",  # sum(t * log_softmax(h @ W)) -> one scan reading t per token block
             example_program=_target_at(128)),
        rule(_NORMALISER, _lse(256, c, g), name="nn_lm_head_lse_256",  # sum(exp(h @ W - shift)) -> scan over token blocks
             example_program=_int_at(256)),
        rule(_NORMALISER, _lse(128, c, g), name="nn_lm_head_lse_128",  # sum(exp(h @ W - shift)) -> scan over token blocks
             example_program=_int_at(128)),
        rule(_NORMALISER, _lse(512, c, g), name="nn_lm_head_lse_512",  # sum(exp(h @ W - shift)) -> scan over token blocks
             example_program=_int_at(512)),
    ], soundness="identity", tolerance=Tolerance(rtol=2e-4, atol=2e-5), jointly=True,
        description="a cross-entropy over a product h @ W computed over token blocks, never holding the logits")


nn_lm_head = lm_head_rules()
