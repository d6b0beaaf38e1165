"""``rulesets.nn``: the idioms of model code in their lean and stable forms.

Model code often computes a quantity in a form that is wasteful or that
overflows, and XLA keeps it as written. Cross-entropy against one-hot labels
(``optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, V))``) builds
an N x V array of zeros and ones, multiplies the log-probabilities by it and
adds the products up, where a gather of N values would do; and
``jnp.log(jax.nn.softmax(x))`` underflows to ``-inf`` where
``jax.nn.log_softmax(x)`` is finite. The rules here rewrite such forms:

* **One-hot products are gathers.** ``sum(one_hot(y) * v, axis)`` becomes
  ``v`` gathered at ``y`` along ``axis`` (:func:`one_hot_of` reads the
  one-hot array off the program: ``convert(eq(labels, iota))``, the way
  ``jax.nn.one_hot`` and ``y[:, None] == jnp.arange(V)`` trace). A label
  out of range, for which the one-hot row is all zeros, gives 0 here too.
  The one-hot array is never built, for the loss and for its gradient.
* **Logarithms of normalised exponentials** keep their logarithm outside the
  exponential: ``log(softmax(x)) -> log_softmax(x)``,
  ``log(sum(exp(x))) -> logsumexp(x)``.
* **Logarithms of sigmoids are softplus**: ``log(sigmoid(z)) -> -softplus(-z)``;
  with ``1 - sigmoid(z) -> sigmoid(-z)`` (shared with ``rulesets.derivatives``)
  that makes ``log(1 - sigmoid(z))`` into ``-softplus(z)``, and binary
  cross-entropy on probabilities, ``-(y log p + (1-y) log(1-p))`` with
  ``p = sigmoid(z)``, into ``y softplus(-z) + (1-y) softplus(z)``, on logits.
* **Near one**, ``log(1 + x) -> log1p(x)``, ``exp(x) - 1 -> expm1(x)``,
  ``log(1 + exp(x))`` and ``log1p(exp(x))`` are ``softplus(x)``.

The pack is ``identity`` class: each rule is true in real arithmetic, and
the rewritten program is *more* accurate than the written one, not bit for
bit equal (``tests/test_nn.py`` checks each rule at the class tolerance on
finite inputs, and on inputs where the written form overflows or
underflows checks that the rewritten one is finite and within 1e-4 of a
float64 result; ``docs/nn.md`` shows both). The gathers (on
arrays of more than a few thousand elements) are taken because they save
work. The stable forms are rules made with ``prefer=True``: the cost model
prices time, and some of them cost more than what they replace (``log1p``
is slower than ``log`` on XLA:CPU, ``logsumexp`` adds a pass for the
maximum), so where one fires the written form is barred from extraction
and the stable form runs (``docs/nn.md``).

Rule names start with ``nn_``, but for the rule shared with ``rulesets.derivatives``.

>>> import jax, jax.numpy as jnp
>>> from rewrite import explain
>>> from rulesets.nn import nn
>>> def loss(logits, labels):
...     return -jnp.sum(jax.nn.one_hot(labels, 512) * jax.nn.log_softmax(logits), axis=-1)
>>> r = explain(loss, jnp.zeros((32, 512)), jnp.arange(32), rulesets=[nn])
>>> r.fired["nn_one_hot_sum"]
1
>>> "gather" in {e.primitive.name for e in r.after.eqns}
True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rewrite import Params, Pat, Ruleset, Value, procedural, rule
from rulesets._examples import f32, i32
from rulesets.derivatives import derivatives as _derivatives
from rulesets.nn_lm_head import nn_lm_head

__all__ = ["nn", "one_hot_of"]

X, Y = Pat.var("x"), Pat.var("y")


# ---------------------------------------------------------------------- one-hot arrays
def _iota_axis(v: Value) -> tuple[int, int] | None:
    """``(axis, n)`` when ``v`` counts 0, 1, ..., n-1 along ``axis`` and is constant along every other axis."""
    node = v.node("iota")
    if node is not None:
        p = node.params
        if p.get("sharding") is not None or tuple(p["shape"]) != v.shape:
            return None
        return int(p["dimension"]), int(v.shape[int(p["dimension"])])
    node = v.node("broadcast_in_dim")  # jnp.arange(n) broadcast against the labels
    if node is None or node.params.get("sharding") is not None:
        return None
    src = node.operands[0]
    inner = src.node("iota")
    dims = tuple(node.params["broadcast_dimensions"])
    if inner is None or src.ndim != 1 or len(dims) != 1 or len(node.operands) != 1:
        return None
    if inner.params.get("sharding") is not None:
        return None
    axis = dims[0]
    if any(d != 1 for i, d in enumerate(v.shape) if i != axis):
        return None
    return axis, int(src.shape[0])


def one_hot_of(v: Value) -> tuple[Value, int, int] | None:
    """``(labels, axis, n)`` when ``v`` is a one-hot array: ``labels == iota`` along ``axis``, converted.

    ``labels`` is the integer operand of the comparison, of ``v``'s rank,
    with size 1 along ``axis``; ``n`` is the number of classes. This is how
    ``jax.nn.one_hot(y, n)`` traces (``eq`` of the labels, broadcast to a
    trailing axis of size 1, against an ``iota``, then ``convert``), and
    how ``(y[:, None] == jnp.arange(n)).astype(...)`` does. ``None`` for
    anything else: another comparison, labels that are not integers, a
    one-hot array not along one axis.
    """
    if not v.is_floating:
        return None
    conv = v.node("convert_element_type")
    if conv is None or conv.params.get("sharding") is not None:
        return None
    b = conv.operands[0]
    eq = b.node("eq") if b.dtype == np.bool_ else None
    if eq is None or len(eq.operands) != 2:
        return None
    for labels, counter in (eq.operands, eq.operands[::-1]):
        if not jnp.issubdtype(labels.dtype, jnp.integer) or labels.dtype != counter.dtype:
            continue
        found = _iota_axis(counter)
        if found is None:
            continue
        axis, n = found
        if labels.ndim != v.ndim or counter.ndim != v.ndim or labels.shape[axis] != 1 or v.shape[axis] != n:
            continue
        if any(d not in (1, s) for d, s in zip(labels.shape, v.shape)):
            continue
        return labels, axis, n
    return None


#: How many additions, subtractions and normalisers a gather is moved through, at most.
_MAX_TERMS = 8


def _terms_through_log_softmax(w: Value, axis: int) -> tuple[Value, list[tuple[int, bool, Value]]]:
    """``w`` as ``base + sum(sign * term)``, each term constant along ``axis``: the terms an ``add`` or ``sub``
    broadcasts (:meth:`rewrite.Value.terms_along`), and the normaliser of ``log(softmax(z))`` (``flag`` true: the
    term is the log of the value). Gathering ``w`` along ``axis`` is then gathering ``base`` and adding the
    terms, so a gather from ``log_softmax(x)`` reads ``x`` itself and the log-probabilities are never stored:
    ``x[y] - max(x) - log(sum(exp(x - max(x))))``.
    """
    terms: list[tuple[int, bool, Value]] = []
    while len(terms) < _MAX_TERMS:
        w, added = w.terms_along(axis, most=_MAX_TERMS - len(terms))
        terms += [(sign, False, t) for sign, t in added]
        found = _log_of_softmax(w, axis) if len(terms) < _MAX_TERMS else None
        if found is None:
            break
        w, normaliser = found
        terms.append((-1, True, normaliser))
    return w, terms


def _log_of_softmax(w: Value, axis: int) -> tuple[Value, Value] | None:
    """``(z, s)`` when ``w`` is ``log(exp(z) / s)``, ``s = sum(exp(z), axis)`` kept as size 1 along ``axis``,
    and ``z`` is shifted by its maximum (so ``log(s)`` cannot overflow): ``w = z - log(s)``."""
    log = w.node("log")
    div = log.operands[0].node("div") if log is not None else None
    if div is None:
        return None
    e, s = div.operands
    ex, b = e.node("exp"), s.node("broadcast_in_dim")
    if ex is None or b is None or len(b.operands) != 1 or s.shape[axis] != 1 or s.ndim != w.ndim:
        return None
    red = b.operands[0].node("reduce_sum")
    if red is None or tuple(red.params["axes"]) != (axis,) or red.operands[0].name != e.name:
        return None
    if not _keeps_axes(b.params, (axis,), w.shape):
        return None
    z = ex.operands[0]
    return (z, s) if _max_shifted(z, (axis,)) else None


def _unsigned(dtype: Any) -> Any:
    """The unsigned integer dtype of ``dtype``'s width."""
    return np.dtype(f"uint{np.dtype(dtype).itemsize * 8}")


def _gathered(axis: int, n: int, full: tuple[int, ...], axes: tuple[int, ...], kinds: tuple[tuple[int, bool], ...]):
    """``sum(one_hot(labels) * w, axes)`` as a gather: ``w`` at the labels, 0 where a label is out of range.

    ``w`` is ``base + sum(sign * term)`` (:func:`_terms_through_log_softmax`); only ``base`` is gathered.
    """
    at = tuple(1 if i == axis else d for i, d in enumerate(full))

    def fn(labels: Any, base: Any, *terms: Any) -> Any:
        labels = jnp.broadcast_to(labels, at)
        # The program compares each label with an iota in the labels' dtype, which wraps where n exceeds
        # its range (int8 labels, 200 classes: position 156 is -100). So a label's one position is its
        # bits read as unsigned (-100 -> 156; a negative label in a dtype that holds n - 1 reads past n),
        # compared in that unsigned dtype, which holds n - 1 (_one_hot_sum declines where it does not).
        position = lax.bitcast_convert_type(labels, _unsigned(labels.dtype))
        last = jnp.full((), n - 1, position.dtype)
        inside = position <= last
        index = lax.min(position, last).astype(jnp.int32)
        picked = jnp.take_along_axis(base, index, axis=axis, mode="clip")
        # innermost term first: the order the program subtracts them in (x - max, then - log(sum)), so
        # that the label's own value rounds as it did, not as (x[y] - log(sum)) - max would
        for (sign, log), term in reversed(list(zip(kinds, terms))):
            term = jnp.log(term) if log else term
            picked = picked + term if sign > 0 else picked - term
        picked = jnp.where(inside, picked, jnp.zeros((), base.dtype))
        return jnp.sum(picked, axis=axes)

    return fn


@procedural
def _one_hot_sum(m):
    """``sum(one_hot(y) * w, axes) -> sum(w[y], axes)``, when the one-hot axis is among ``axes``."""
    p = m.params("r")
    if p.sharded:
        return None
    axes = tuple(p["axes"])
    prod = m.root
    x, y = m["x"], m["y"]
    for oh, w in ((x, y), (y, x)):
        found = one_hot_of(oh)
        if found is None:
            continue
        labels, axis, n = found
        if n - 1 > jnp.iinfo(_unsigned(labels.dtype)).max or n - 1 > jnp.iinfo(jnp.int32).max:
            return None  # the iota wraps more than once: a label is hot at several positions
        if axis not in axes or oh.shape != w.shape or w.dtype != oh.dtype or not w.is_floating:
            continue
        if prod.dtype != w.dtype:
            return None
        base, terms = _terms_through_log_softmax(w, axis)
        kinds = tuple((sign, log) for sign, log, _ in terms)
        return m.trace(_gathered(axis, n, w.shape, axes, kinds), labels, base, *[t for _, _, t in terms])
    return None


def _one_hot_ce(logits: Any, labels: Any) -> Any:
    return -jnp.sum(jax.nn.one_hot(labels, logits.shape[-1]) * jax.nn.log_softmax(logits), axis=-1)


# ---------------------------------------------------------------------- normalised exponentials
def _max_shifted(x: Value, axes: tuple[int, ...]) -> bool:
    """Whether ``x`` is ``a - max(a, axes)`` (by any ``sub`` of its class) with the max put back on ``a``'s rows
    (``stop_gradient``, the guards ``max(-inf, .)`` and ``where(isfinite(m), m, 0)``, broadcasts): the shift
    ``jax.nn.softmax`` and ``jax.nn.logsumexp`` make (:meth:`rewrite.Value.max_under`)."""
    return any(n.prim == "sub" and n.operands[1].max_under(n.operands[0], axes, rows=True) is not None
               for n in x.nodes)


def _keeps_axes(bcast: dict[str, Any], axes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a broadcast puts a reduction over ``axes`` of an array of ``shape`` back where it was:
    its kept axes in order, the reduced ones of size 1 (``keepdims``) or full."""
    kept = tuple(i for i in range(len(shape)) if i not in axes)
    out = tuple(bcast["shape"])
    return (tuple(bcast["broadcast_dimensions"]) == kept and bcast.get("sharding") is None and len(out) == len(shape)
            and all(o == s or (i in axes and o == 1) for i, (o, s) in enumerate(zip(out, shape))))


def _log_softmax_from(axes: tuple[int, ...], shifted: bool):
    def fn(z: Any) -> Any:
        if not shifted:
            return jax.nn.log_softmax(z, axis=axes)
        # z is already x - max(x): its log-normaliser cannot overflow, as in jax.nn.log_softmax.
        return z - jnp.log(jnp.sum(jnp.exp(z), axis=axes, keepdims=True))

    return fn


@procedural
def _log_softmax(m):
    """``log(exp(z) / sum(exp(z))) -> z - log(sum(exp(z)))``, shifting ``z`` by its maximum first if it is not."""
    r, b = m.params("r"), m.params("b")
    z = m["x"]
    if r.sharded or not z.is_floating:
        return None
    axes = tuple(r["axes"])
    if not _keeps_axes(b, axes, z.shape):
        return None
    return m.trace(_log_softmax_from(axes, _max_shifted(z, axes)), z)


def _logsumexp_ok(x: Value, r: Params) -> bool:
    """``log(sum(exp(z)))`` of a ``z`` not already shifted by its maximum (that form cannot overflow)."""
    return not r.sharded and x.is_floating and not _max_shifted(x, tuple(r.axes))


def _softmax_log(x: Any) -> Any:
    return jnp.log(jax.nn.softmax(x, axis=-1))


def _softplus(x: Any) -> Any:
    # A plain module-level function, not jax.nn.softplus itself (a custom_jvp object): the engine caches
    # traces of right sides by their code, which a custom_jvp object does not have.
    return jax.nn.softplus(x)


def _not_softplus_body(x: Value) -> bool:
    """Whether ``x`` is real and not ``-|d|``: ``log1p(exp(-|d|))`` is how ``softplus`` itself is computed
    (inside ``logaddexp``), stable already; rewriting it to ``softplus`` would nest one in another. A
    complex ``x`` is left alone: complex ``logaddexp`` has another body (``log1p(exp(a + b - 2 max(a, b)))``)
    and wraps its imaginary part into [-pi, pi), where ``log1p`` keeps (-pi, pi]."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return False
    neg = x.node("neg")
    return neg is None or neg.operands[0].node("abs") is None


# ---------------------------------------------------------------------- the pack
#: ``1 - σ(z) -> σ(-z)`` is ``rulesets.derivatives``' rule, shared (one rule object, so the packs compose):
#: with ``nn_log_sigmoid`` it turns ``log(1 - σ(z))`` into ``-softplus(z)``, and binary cross-entropy
#: on probabilities into ``y softplus(-z) + (1 - y) softplus(z)``, on logits. A rule from ``log(1 - σ(z))``
#: itself could not be checked against the program in float64, which cancels to ``log(0)`` there too.
_ONE_MINUS_SIGMOID = _derivatives.rule("explog_one_minus_logistic")

nn_one_hot = Ruleset("nn_one_hot", [
    rule(Pat("reduce_sum", Pat("mul", X, Y), params="r"), _one_hot_sum, name="nn_one_hot_sum",  # sum(one_hot(y) * w) -> w[y]
         example_program=(_one_hot_ce, (f32(4, 8), i32(4)))),
], soundness="identity",
    description="one-hot products as gathers")

nn_stable = Ruleset("nn_stable", [
    rule(Pat("log", Pat("div", Pat("exp", X),                                                                # log(softmax(z)) -> log_softmax(z)
                        Pat("broadcast_in_dim", Pat("reduce_sum", Pat("exp", X), params="r"), params="b"))),
         _log_softmax, prefer=True, name="nn_log_softmax", example_program=(_softmax_log, (f32(4, 8),))),
    rule(Pat("log", Pat("reduce_sum", Pat("exp", X), params="r")),                                           # log(sum(exp(z))) -> logsumexp(z)
         lambda x, r: jax.nn.logsumexp(x, axis=tuple(r.axes)), when=_logsumexp_ok, prefer=True, name="nn_logsumexp",
         example_program=(lambda z: jnp.log(jnp.sum(jnp.exp(z), axis=-1)), (f32(4, 8),))),
    rule(lambda z: jnp.log(lax.logistic(z)), lambda z: -_softplus(-z), prefer=True, name="nn_log_sigmoid"),  # log(σ(z)) -> -softplus(-z)
    _ONE_MINUS_SIGMOID,                                                                                      # 1 - σ(z) -> σ(-z), so log(1 - σ(z)) -> -softplus(z)
    rule(lambda x: jnp.log(1.0 + x), lambda x: jnp.log1p(x), prefer=True, name="nn_log1p"),                  # log(1 + x) -> log1p(x)
    rule(lambda x: jnp.exp(x) - 1.0, lambda x: jnp.expm1(x), prefer=True, name="nn_expm1"),                  # exp(x) - 1 -> expm1(x)
    rule(lambda x: jnp.log(1.0 + jnp.exp(x)), _softplus, prefer=True, name="nn_softplus"),                   # log(1 + exp(x)) -> softplus(x)
    rule(lambda x: jnp.log1p(jnp.exp(x)), _softplus, prefer=True, name="nn_softplus_log1p",                  # log1p(exp(x)) -> softplus(x)
         when=_not_softplus_body),
], soundness="identity",
    description="model idioms in their stable forms: log_softmax, logsumexp, softplus, log1p, expm1")


def _gelu_tanh(x: Any) -> Any:
    return jax.nn.gelu(x, approximate=True)


def _gelu_tanh_vjp(x: Any, g: Any) -> Any:
    """JAX's VJP of the tanh GELU: its backward reads the forward's tanh and polynomial terms."""
    return jax.vjp(_gelu_tanh, x)[1](g)[0]


def _gelu_tanh_remat_vjp(x: Any, g: Any) -> Any:
    """JAX's VJP of the tanh GELU under ``jax.checkpoint``: the same operations, recomputed from ``x``.
    (Module-level functions, not closures over a checkpointed function, so that the disk cache can key them.)"""
    return jax.vjp(jax.checkpoint(_gelu_tanh), x)[1](g)[0]


#: The literals of the tanh GELU are rounded to the dtype, so its VJP is a different term at each: one rule a dtype.
#: Each matches around the GELU's tanh (anchor=): the whole VJP, 27 nodes, is a costly query to declare and run.
_GELU_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
nn_remat = Ruleset("nn_remat", [
    rule(_gelu_tanh_vjp, _gelu_tanh_remat_vjp, name=f"nn_remat_gelu_tanh_{d}",  # gelu'(x)·g -> recompute gelu from x
         example_inputs=(jax.ShapeDtypeStruct((3, 4), t),) * 2, anchor="tanh") for d, t in _GELU_DTYPES.items()
], soundness="exact", recomputes=True,
    description="backward passes that recompute an activation from its input instead of holding its intermediates")

nn = Ruleset("nn", [nn_one_hot, nn_stable, nn_lm_head, nn_remat], soundness="identity",
            description="the idioms of model code in their lean and stable forms")
