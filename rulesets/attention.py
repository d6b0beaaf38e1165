"""``rulesets.attention``: softmax attention computed block by block, never holding the N x N scores.

Every way of writing ``softmax(Q K^T * scale + bias/mask) V`` (``jnp``, ``einsum`` in any axis order, flax's,
haiku's and equinox's layers, masks by ``jnp.where``, a bias) traces to one term: ``exp(s - max(s)) / sum(exp(s
- max(s)))`` times ``v``, the logits ``s`` a computation that reads one product ``q k^T``. One rule per operand
order, and per softmax that sums in float32, matches it (the weights' casts and squeezes are optional wrappers);
it reads ``s`` a block of keys at a time (:meth:`rewrite.Match.sliced`) and builds the kernel
:func:`rulesets.kernels.attention.blocked_attention`, an online softmax over blocks of keys (and of queries) whose
backward recomputes each block; on a GPU, one fused call (``rulesets/_fused_attention.py``). Key axes of 256 or
less are kept; the cost model chooses among the blocks offered (:func:`attention_with`). The pack is
``identity`` class (the blocked sums reorder the original's additions); ``docs/attention.md`` says what a rule
reads and declines, and why. Rule names start with ``attn_``.

>>> import jax, jax.numpy as jnp
>>> from rewrite import explain
>>> from rulesets.attention import attention
>>> def f(q, k, v):
...     return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / 8.0, axis=-1) @ v
>>> x = jnp.ones((2, 4096, 64))  # 128 MiB of scores: past the cache (at 32 MiB jaxlib 0.12's one kernel is kept)
>>> r = explain(f, x, x, x, rulesets=[attention])
>>> sorted(r.fired)[0].startswith("attn_")
True
>>> [e.primitive.name for e in r.after.eqns]   # the scan over key blocks, inside its custom VJP
['custom_vjp_call']
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from rewrite import Pat, Ruleset, Tolerance, procedural, rule
from rulesets import _fused_attention as _fused
from rulesets._attention_plan import Plan
from rulesets.kernels.attention import BLOCKS, SCORES_BAND, Blocking, ValueProduct

__all__ = ["attention", "attention_with", "BLOCKS", "SCORES_BAND"]

_log = logging.getLogger(__name__)


class _Config(NamedTuple):
    """What :func:`attention_with` configures (its docstring says what each is)."""

    blocking: Blocking
    min_keys: int
    fused: str | None
    blocked: bool | None


X, V = Pat.var("x"), Pat.var("v")
_SOFTMAX = Pat("div", Pat("exp", X), Pat("broadcast_in_dim", Pat("reduce_sum", Pat("exp", X), params="r"),
                                         params="b"))
#: ``jax.nn.softmax`` of half-precision logits: the exponentials summed in float32, the sum rounded back.
_SOFTMAX_WIDE = Pat("div", Pat("exp", X), Pat("convert_element_type", Pat("broadcast_in_dim", Pat(
    "reduce_sum", Pat("convert_element_type", Pat("exp", X), params="w"), params="r"), params="b"), params="n"))


def _blocked(config: _Config, p_first: bool, widened: bool = False):
    """The procedure of the rules: softmax(s) v (``p_first``; else v softmax(s)) as the fused call or as loops over
    key blocks; ``widened``: the softmax sums in a wider dtype (``_SOFTMAX_WIDE``)."""

    @procedural
    def build(m: Any) -> Any:
        r, pv = m.params("r"), m.params("p")
        x, v = m["x"], m["v"]
        sq, c = m.params("sq"), None if widened else m.params("c")
        squeezed = () if sq is None else tuple(sq["dimensions"])
        cast = None if c is None else c["new_dtype"]
        wide = m.params("w")["new_dtype"] if widened else None
        if widened and (m.params("n")["new_dtype"] != x.aval.dtype
                        or jnp.promote_types(wide, x.aval.dtype) != jnp.dtype(wide)):
            return None  # the sum is not rounded back to the logits' dtype, or is summed narrower
        if r.sharded or len(r.axes) != 1 or not x.is_floating:
            return None
        axis = int(r.axes[0])
        n = x.shape[axis]
        if n <= config.min_keys:
            return None
        sub = x.node("sub")
        if sub is None:
            return None
        s, shift = sub.operands
        if s.shape != x.shape or shift.max_under(s, axis, rows=True) is None:
            return None
        if not ValueProduct.contracts(p_first, pv["dimension_numbers"], squeezed, axis):
            return None
        logits = m.sliced(s, axis, limit={"dot_general": 1})  # one product, q k^T
        if logits is None or logits.passed.get("dot_general") != 1:
            return None
        product = ValueProduct.of(p_first, pv, x, v, cast=cast, squeezed=squeezed, wide=wide)
        impl = _fused.implementation() if config.fused == "auto" else config.fused
        if impl is not None:
            call = _fused.fused(logits, product, v.aval, impl)
            if call is not None:
                try:
                    return m.trace(call, *logits.leaves, v)
                except Exception as e:  # noqa: BLE001 - the fused kernel does not take this: the blocked form
                    _log.info("attention: %s declined (%s: %s); blocked form", impl, type(e).__name__, e)
        if not (_fused.blocked() if config.blocked is None else config.blocked):
            return None
        # One loop per key block that fits, and one per query block too, all equal to the matched product:
        # extraction prices each. The queries are cut where every value carries them in one place.
        s_q = product.query_axis(x.shape)
        nq = 0 if s_q is None or logits.place(s_q) is None else x.shape[s_q]
        offers = config.blocking.offers(n, nq, x.aval.size // n)
        # one trace per plan, loop and types, for every layer alike (rulesets/_attention_plan.py)
        plan = Plan(logits, s_q if any(o.query_block or o.backward_query_block for o in offers) else None, product)
        return [(m.root, m.trace(plan.kernel(o), *logits.leaves, v)) for o in offers] or None

    return build


def _pv(q: Any, k: Any, v: Any) -> Any:
    return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) * 0.125, axis=-1) @ v


def _vp(q: Any, k: Any, v: Any) -> Any:
    return jnp.einsum("bkd,bqk->bdq", v, jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) * 0.125, axis=-1))


def _example(fn: Any, dtype: Any, config: _Config) -> tuple:
    """A rule's example: two of the smallest key block (of ``min_keys`` if smaller) and of the smallest query block
    (larger blocks run the same code, checked at their own sizes in ``tests/test_attention.py``)."""
    keys = jax.ShapeDtypeStruct((2, 2 * max(min(config.blocking.blocks), config.min_keys), 8), dtype)
    return fn, (jax.ShapeDtypeStruct((2, 2 * min(config.blocking.query_blocks, default=256), 8), dtype), keys, keys)


#: The weights as a program hands them to the product: maybe rounded (bf16 weights of an f32 softmax), maybe with
#: a size-1 batch axis squeezed (``@`` with a batch of one); and a half-precision softmax that sums in float32.
_WEIGHTS = Pat.optional("squeeze", Pat.optional("convert_element_type", _SOFTMAX, params="c"), params="sq")
_WEIGHTS_WIDE = Pat.optional("squeeze", _SOFTMAX_WIDE, params="sq")


def attention_with(*, blocks: Sequence[int] = (256,), query_blocks: Sequence[int] = (512,),
                   whole_queries: bool = True, min_keys: int = 256, fused: str | None = "auto",
                   blocked: bool | None = None, backward_query_block: int | None = 512,
                   scores_band: tuple[float, float] | None = None) -> Ruleset:
    """The attention pack, configured; ``rulesets.attention`` is ``attention_with()``.

    * ``blocks``: the key blocks offered to the cost model, each that divides the key axis into two blocks or
      more; extraction takes the cheapest. 256 alone by default. ``scores_band``: bytes, low and high: only loops
      whose one trip's scores are within them are offered (else the nearest; ``None``: all); ``blocks=BLOCKS,
      scores_band=SCORES_BAND`` offers 128-1024 where a trip's scores are 3-8 MiB, measured fastest (opt-in).
    * ``query_blocks``: the query blocks offered to the forward (each that makes two blocks or more): the loop
      over key blocks then runs once per block of queries, each block of scores ``[.., 512, 256]``.
    * ``whole_queries``: whether the loop over every query at once is offered beside the query blocks.
    * ``min_keys``: key axes this long or shorter are kept as written.
    * ``fused``: ``jax.nn.dot_product_attention``'s implementation to build where the logits allow it
      (``"cudnn"``, ``"xla"``), ``None`` for none, ``"auto"`` for cuDNN's on a GPU only.
    * ``blocked``: whether the blocked form is built (``None``: on every backend but a GPU).
    * ``backward_query_block``: the backward recomputes the scores a block of keys by a block of this many
      queries at a time (512 by default), where it makes two blocks or more (``None``: every query at once).
      It holds a few blocks of ``[.., backward_query_block, block]``, where the key blocks alone would hold
      ``[.., Nq, block]``.

    >>> from rulesets.attention import attention_with
    >>> pack = attention_with(blocks=(128, 256), query_blocks=(), scores_band=None)
    >>> pack.name, [r.name for r in pack.rules]
    ('attention', ['attn_blocked', 'attn_blocked_vp', 'attn_blocked_wide', 'attn_blocked_wide_vp'])
    """
    c = _Config(Blocking(tuple(blocks), tuple(query_blocks), whole_queries, backward_query_block,
                         None if scores_band is None else tuple(scores_band)), min_keys, fused, blocked)
    f32, bf16 = jnp.float32, jnp.bfloat16
    return Ruleset("attention", [
        rule(Pat("dot_general", _WEIGHTS, V, params="p"),  # softmax(s) v -> loops over blocks
             _blocked(c, True), name="attn_blocked", example_program=_example(_pv, f32, c)),
        rule(Pat("dot_general", V, _WEIGHTS, params="p"),  # v softmax(s) -> loops over blocks
             _blocked(c, False), name="attn_blocked_vp", example_program=_example(_vp, f32, c)),
        rule(Pat("dot_general", _WEIGHTS_WIDE, V, params="p"),  # softmax(s) v, summed in f32 -> loops over blocks
             _blocked(c, True, True), name="attn_blocked_wide", example_program=_example(_pv, bf16, c)),
        rule(Pat("dot_general", V, _WEIGHTS_WIDE, params="p"),  # v softmax(s), summed in f32 -> loops over blocks
             _blocked(c, False, True), name="attn_blocked_wide_vp", example_program=_example(_vp, bf16, c)),
    ], soundness="identity", tolerance=Tolerance(rtol=2e-4, atol=2e-5, terms=16),
        description="softmax attention over key blocks with an online softmax and a recomputing backward")


attention = attention_with()
