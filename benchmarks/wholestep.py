"""Whole training steps, as each library's examples write them: ``jit(step)``, ``jit(rewrite(step))``, loss first.

Every case is a GPT-style (or encoder) training step built from a library's own modules and an optax
optimizer, written the way that library's examples write it. Each is measured in three forms, side by
side in one process (``benchmarks/harness.py``: compiled, warmed up, timed in interleaved rounds):

* ``standard``: ``jax.jit(step)``, the baseline; ``aa``: the same again, compiled apart (the A/A control);
* ``whole``: ``jax.jit(rewrite(step))``, what a user writes (every built-in pack but ``fastmath``);
* ``loss_first``: the step with ``jax.value_and_grad(rewrite(loss_fn))`` in it (the loss rewritten before
  differentiation, docs/training.md), the same packs.

Temp memory is ``memory_analysis().temp_size_in_bytes`` of the compiled program. The values column is the
largest difference of the loss and of the updated parameters between ``whole`` and ``standard``, relative to
the largest parameter update (Adam moves every parameter by about its learning rate).

Cases (``--cases a,b``; ``--small`` runs them at N=128, V=1024, width 64, for a quick check):

* ``linen_gpt``: flax linen, ``TrainState`` + ``optax.adamw``, 2 blocks of causal
  ``nn.MultiHeadDotProductAttention`` and an MLP, a V=16384 head, integer-label cross-entropy; B=2,
  N=1024, width 256, 4 heads;
* ``nnx_gpt``: the same model in flax nnx, a functional step (``nnx.split``/``nnx.merge``) with
  ``nnx.value_and_grad``;
* ``haiku_gpt``: the same in haiku (``hk.MultiHeadAttention``, ``hk.transform``);
* ``equinox_gpt``: the same in equinox (``eqx.nn.MultiheadAttention``, ``eqx.filter_value_and_grad``);
* ``linen_scan_remat``: ``linen_gpt`` with its blocks stacked by ``nn.scan`` over ``nn.remat``;
* ``equinox_scan_remat``: ``equinox_gpt`` with its blocks stacked (``eqx.filter_vmap`` of their constructor) and
  scanned by ``lax.scan`` over ``eqx.filter_checkpoint`` of the block;
* ``linen_scan`` and ``equinox_scan``: the same two without ``remat`` (``nn.scan`` over the plain block;
  ``lax.scan`` over the stacked blocks, not checkpointed): the step's backward loop reads the residuals its
  forward loop stacked;
* ``haiku_encoder``: a BERT-like haiku encoder with a padding mask and a classifier head;
* ``linen_cross``: a linen encoder-decoder, the decoder cross-attending to a source of another length;
* ``linen_accumulate``: ``linen_gpt`` with its gradients accumulated over micro-batches of one sequence by a
  ``lax.scan``;
* ``linen_unroll2`` and ``linen_unroll4``: ``linen_gpt`` with its gradients accumulated by a Python loop (unrolled:
  each micro-batch's ``value_and_grad`` at the top level of the step, the losses and gradients summed in the
  step's own order) over 2 and 4 micro-batches, each of ``linen_gpt``'s B sequences;
* ``linen_master16``: ``linen_gpt`` with f32 master weights, the loss and its gradients taken at their bf16
  copies (cast back to f32 for the update).

Run holding the benchmark lock::

    flock /tmp/bench.lock python -m benchmarks.wholestep --write
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import rulesets
from benchmarks.harness import MiB, measure, write_results
from rewrite import rewrite

RESULTS = Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True)
class Size:
    batch: int = 2
    length: int = 1024
    width: int = 256
    heads: int = 4
    vocab: int = 16384


FULL = Size()
SMALL = Size(length=128, width=64, vocab=1024)


def packs() -> list[Any]:
    """Every built-in pack but ``fastmath`` (which changes results)."""
    return [getattr(rulesets, n) for n in rulesets.PACKS if n != "fastmath"]


def loss_first(fn: Callable[..., Any]) -> Callable[..., Any]:
    return rewrite(fn, rulesets=packs(), cache=False)


def plain(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


CASES: dict[str, Callable[..., Any]] = {}


def case(fn: Callable[..., Any]) -> Callable[..., Any]:
    CASES[fn.__name__.lstrip("_")] = fn
    return fn


def _tokens(s: Size, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), (s.batch, s.length + 1), 0, s.vocab)


# ---------------------------------------------------------------------- flax linen
def _linen_model(s: Size, scan: bool = False, cross: bool = False, remat: bool = True) -> Any:
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask, src=None):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=s.heads)(h, h, mask=mask)
            if src is not None:
                h = nn.LayerNorm()(x)
                x = x + nn.MultiHeadDotProductAttention(num_heads=s.heads)(h, src)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(s.width)(nn.gelu(nn.Dense(4 * s.width)(h)))

    class ScanBlock(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            return (nn.remat(Block) if remat else Block)()(x, mask), None

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens, src=None):
            pos = self.param("pos", nn.initializers.normal(0.02), (tokens.shape[-1], s.width))
            x = nn.Embed(s.vocab, s.width)(tokens) + pos
            mask = nn.make_causal_mask(tokens)
            if src is not None:
                src = nn.Dense(s.width)(src)
            if scan:
                x, _ = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                               in_axes=nn.broadcast, length=2)()(x, mask)
            else:
                for _ in range(2):
                    x = Block()(x, mask, src)
            return nn.Dense(s.vocab)(nn.LayerNorm()(x))

    return GPT()


def _linen(s: Size, wrap: Callable, scan: bool = False, cross: bool = False, opt: Any = None,
           form: str = "plain", remat: bool = True) -> tuple[Callable, tuple]:
    import optax
    from flax.training import train_state

    model = _linen_model(s, scan, cross, remat)
    tokens = _tokens(s)
    src = jax.random.normal(jax.random.PRNGKey(3), (s.batch, s.length // 2, 32)) if cross else None
    variables = model.init(jax.random.PRNGKey(1), tokens[:, :-1], src)
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                          tx=opt or optax.adamw(1e-3))

    def train_step(state, tokens, src=None):
        def loss_fn(params, tokens, src):
            logits = state.apply_fn({"params": params}, tokens[:, :-1], src)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()
        if form == "accumulate":  # one sequence per micro-batch, gradients summed by a scan
            def micro(acc, seq):
                loss, grads = jax.value_and_grad(wrap(loss_fn))(state.params, seq[None], src)
                return jax.tree.map(jnp.add, acc, (loss, grads)), None
            zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
            total, _ = jax.lax.scan(micro, zero, tokens)
            loss, grads = jax.tree.map(lambda a: a / tokens.shape[0], total)
        elif form.startswith("unroll"):  # micro-batches of B sequences, gradients summed by a Python loop
            loss, grads = 0.0, jax.tree.map(jnp.zeros_like, state.params)
            micro = int(form[len("unroll"):])
            for seq in jnp.split(tokens, micro):
                l, g = jax.value_and_grad(wrap(loss_fn))(state.params, seq, src)
                loss, grads = loss + l, jax.tree.map(jnp.add, grads, g)
            loss, grads = jax.tree.map(lambda a: a / micro, (loss, grads))
        elif form == "master16":  # f32 master weights, the loss and its gradients at their bf16 copies
            params16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), state.params)
            loss, grads16 = jax.value_and_grad(wrap(loss_fn))(params16, tokens, src)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads16)
        else:
            loss, grads = jax.value_and_grad(wrap(loss_fn))(state.params, tokens, src)
        return state.apply_gradients(grads=grads), loss

    return train_step, (state, tokens, src)


@case
def _linen_gpt(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    return _linen(s, wrap, opt=opt)


@case
def _linen_scan_remat(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    return _linen(s, wrap, scan=True, opt=opt)


@case
def _linen_scan(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    return _linen(s, wrap, scan=True, opt=opt, remat=False)


@case
def _linen_cross(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    return _linen(s, wrap, cross=True, opt=opt)


@case
def _linen_accumulate(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    return _linen(s, wrap, opt=opt, form="accumulate")


@case
def _linen_unroll2(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    return _linen(dataclasses.replace(s, batch=2 * s.batch), wrap, opt=opt, form="unroll2")


@case
def _linen_unroll4(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    return _linen(dataclasses.replace(s, batch=4 * s.batch), wrap, opt=opt, form="unroll4")


@case
def _linen_master16(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    return _linen(s, wrap, opt=opt, form="master16")


# ---------------------------------------------------------------------- flax nnx
@case
def _nnx_gpt(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1, self.ln2 = nnx.LayerNorm(s.width, rngs=rngs), nnx.LayerNorm(s.width, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=s.heads, in_features=s.width, decode=False, rngs=rngs)
            self.fc1, self.fc2 = nnx.Linear(s.width, 4 * s.width, rngs=rngs), nnx.Linear(4 * s.width, s.width,
                                                                                          rngs=rngs)

        def __call__(self, x, mask):
            h = self.ln1(x)
            x = x + self.attn(h, h, mask=mask)
            return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(s.vocab, s.width, rngs=rngs)
            self.pos = nnx.Param(jax.random.normal(jax.random.PRNGKey(2), (s.length, s.width)) * 0.02)
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])
            self.ln = nnx.LayerNorm(s.width, rngs=rngs)
            self.head = nnx.Linear(s.width, s.vocab, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens) + self.pos[...]
            mask = nnx.make_causal_mask(tokens)
            for b in self.blocks:
                x = b(x, mask)
            return self.head(self.ln(x))

    model = GPT(nnx.Rngs(1))
    tx = opt or optax.adamw(1e-3)
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = tx.init(params)

    def train_step(params, opt_state, tokens):
        model = nnx.merge(graphdef, params)

        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()
        loss, grads = nnx.value_and_grad(wrap(loss_fn))(model)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, (params, opt_state, _tokens(s))


# ---------------------------------------------------------------------- haiku

def _hk_blocks(x, s, mask):
    """Two pre-norm haiku transformer blocks (attention under ``mask``, then a GELU MLP), as haiku's examples write them."""
    import haiku as hk

    for _ in range(2):
        h = hk.LayerNorm(-1, True, True)(x)
        x = x + hk.MultiHeadAttention(s.heads, s.width // s.heads, w_init=hk.initializers.VarianceScaling())(
            h, h, h, mask=mask)
        h = hk.LayerNorm(-1, True, True)(x)
        x = x + hk.Linear(s.width)(jax.nn.gelu(hk.Linear(4 * s.width)(h)))
    return x

def _haiku_gpt_net(s: Size) -> Callable:
    import haiku as hk

    def forward(tokens):
        n = tokens.shape[-1]
        x = hk.Embed(s.vocab, s.width)(tokens) + hk.get_parameter("pos", (n, s.width), init=jnp.zeros)
        mask = jnp.tril(jnp.ones((1, 1, n, n), bool))
        x = _hk_blocks(x, s, mask)
        return hk.Linear(s.vocab)(hk.LayerNorm(-1, True, True)(x))

    return forward


@case
def _haiku_gpt(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    import haiku as hk
    import optax

    net = hk.without_apply_rng(hk.transform(_haiku_gpt_net(s)))
    tokens = _tokens(s)
    params = net.init(jax.random.PRNGKey(1), tokens[:, :-1])
    opt = opt or optax.adamw(1e-3)

    def loss_fn(params, tokens):
        logits = net.apply(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()

    def update(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(wrap(loss_fn))(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return update, (params, opt.init(params), tokens)


@case
def _haiku_encoder(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    """A BERT-like encoder classifier: a padding mask from each sequence's length, mean-pooled, 4 classes."""
    import haiku as hk
    import optax

    def forward(tokens, lengths):
        n = tokens.shape[-1]
        valid = jnp.arange(n)[None, :] < lengths[:, None]
        mask = (valid[:, None, None, :] & valid[:, None, :, None])
        x = hk.Embed(s.vocab, s.width)(tokens) + hk.get_parameter("pos", (n, s.width), init=jnp.zeros)
        x = _hk_blocks(x, s, mask)
        pooled = (x * valid[..., None]).sum(1) / lengths[:, None]
        return hk.Linear(4)(pooled)

    net = hk.without_apply_rng(hk.transform(forward))
    tokens = _tokens(s)[:, :-1]
    lengths = jnp.array([s.length, s.length * 3 // 4])[: s.batch]
    labels = jnp.arange(s.batch) % 4
    params = net.init(jax.random.PRNGKey(1), tokens, lengths)
    opt = opt or optax.adamw(1e-3)

    def loss_fn(params, tokens, lengths, labels):
        return optax.softmax_cross_entropy_with_integer_labels(
            net.apply(params, tokens, lengths).astype(jnp.float32), labels).mean()

    def update(params, opt_state, tokens, lengths, labels):
        loss, grads = jax.value_and_grad(wrap(loss_fn))(params, tokens, lengths, labels)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return update, (params, opt.init(params), tokens, lengths, labels)


# ---------------------------------------------------------------------- equinox
@case
def _equinox_gpt(s: Size, wrap: Callable, opt: Any = None, scan: bool = False, remat: bool = True
                 ) -> tuple[Callable, tuple]:
    import equinox as eqx
    import optax

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(s.width), eqx.nn.LayerNorm(s.width)
            self.attn = eqx.nn.MultiheadAttention(s.heads, s.width, key=k1)
            self.mlp = eqx.nn.MLP(s.width, s.width, 4 * s.width, 1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x, mask):
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h, mask=mask)
            return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))

    class GPT(eqx.Module):
        embed: eqx.nn.Embedding
        pos: jax.Array
        blocks: list
        ln: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            ks = jax.random.split(key, 4)
            self.embed = eqx.nn.Embedding(s.vocab, s.width, key=ks[0])
            self.pos = jax.random.normal(ks[1], (s.length, s.width)) * 0.02
            keys = jax.random.split(ks[2], 2)
            # stacked: one Block whose arrays have a leading layer axis, scanned over
            self.blocks = eqx.filter_vmap(Block)(keys) if scan else [Block(k) for k in keys]
            self.ln = eqx.nn.LayerNorm(s.width)
            self.head = eqx.nn.Linear(s.width, s.vocab, key=ks[3])

        def __call__(self, tokens):
            x = jax.vmap(self.embed)(tokens) + self.pos
            mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), bool))
            if scan:
                arrays, rest = eqx.partition(self.blocks, eqx.is_array)

                def layer(x, b):
                    return eqx.combine(b, rest)(x, mask)

                if remat:
                    layer = eqx.filter_checkpoint(layer)

                x, _ = jax.lax.scan(lambda x, b: (layer(x, b), None), x, arrays)
            else:
                for b in self.blocks:
                    x = b(x, mask)
            return jax.vmap(self.head)(jax.vmap(self.ln)(x))

    model = GPT(jax.random.PRNGKey(1))
    opt = opt or optax.adamw(1e-3)
    params, static = eqx.partition(model, eqx.is_array)

    def loss_fn(model, tokens):
        logits = jax.vmap(model)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()

    def make_step(params, opt_state, tokens):
        model = eqx.combine(params, static)
        loss, grads = eqx.filter_value_and_grad(wrap(loss_fn))(model, tokens)
        updates, opt_state = opt.update(eqx.filter(grads, eqx.is_array), opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    return make_step, (params, opt.init(params), _tokens(s))


@case
def _equinox_scan_remat(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    return _equinox_gpt(s, wrap, opt, scan=True)


@case
def _equinox_scan(s: Size, wrap: Callable, opt: Any = None) -> tuple[Callable, tuple]:
    return _equinox_gpt(s, wrap, opt, scan=True, remat=False)


# ---------------------------------------------------------------------- measuring
def _flat(step: Callable, args: tuple) -> tuple[Callable, list]:
    """``step`` as a function of its arguments' array leaves (what ``jax.jit`` and the harness take)."""
    leaves, tree = jax.tree.flatten(args)
    leaves = [jnp.asarray(x) for x in leaves]
    return (lambda *xs: jax.tree.leaves(step(*jax.tree.unflatten(tree, xs)))), leaves


def values_error(a: Callable, b: Callable, args: list) -> tuple[float, float]:
    """(loss difference, largest parameter difference) of ``b`` against ``a``, each relative."""
    import numpy as np  # (the module deletes its own ``np`` at its end)

    # compared in numpy, in each array's dtype as XLA would (an eager jnp operation compiles at each new shape)
    outs_a, outs_b = ([np.asarray(o) for o in jax.jit(f)(*args)] for f in (a, b))
    args = [np.asarray(x) for x in args]
    worst = 0.0
    moved = max(float(np.max(np.abs(o - x))) for o, x in zip(outs_a, args)
                if o.shape == x.shape and o.dtype == x.dtype and jnp.issubdtype(o.dtype, jnp.floating)) or 1.0
    for x, y in zip(outs_a, outs_b):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.size > 1:
            worst = max(worst, float(np.max(np.abs(x.astype(np.float32) - y.astype(np.float32)))) / moved)
    losses = [(x, y) for x, y in zip(outs_a, outs_b) if x.shape == () and jnp.issubdtype(x.dtype, jnp.floating)]
    loss_err = max((abs(float(x) - float(y)) / max(abs(float(x)), 1e-9) for x, y in losses), default=0.0)
    return loss_err, worst


def run_case(name: str, size: Size, rounds: int, round_seconds: float = 0.02) -> dict[str, Any]:
    build = CASES[name]
    step, args = build(size, plain)
    first, first_args = build(size, loss_first)  # its own modules (equinox's classes are made per build)
    t = time.perf_counter()
    whole = rewrite(step, rulesets=packs(), cache=False)
    flat_step, leaves = _flat(step, args)
    flat_whole, _ = _flat(whole, args)
    flat_first, _ = _flat(first, first_args)  # the same leaves, in the same order
    jax.jit(flat_whole).lower(*leaves)  # rewrites
    rewrite_s = time.perf_counter() - t
    res = whole.result(*args)
    row = measure(name, {"standard": flat_step, "aa": lambda *a: flat_step(*a), "whole": flat_whole,
                         "loss_first": flat_first}, leaves, rounds=rounds, min_round_seconds=round_seconds,
                  same_count=True)
    loss_err, param_err = values_error(flat_step, flat_whole, leaves)
    d = row.as_dict()
    d.update(rewrite_seconds=rewrite_s, loss_error=loss_err, param_error=param_err,
             found=str(getattr(res, "step", None)), size=dataclasses.asdict(size))
    return d


def memory_case(name: str, size: Size) -> str:
    """Temp memory only (compiled, not run: needs no benchmark lock): one Markdown row."""
    from benchmarks.harness import compile_stats

    build = CASES[name]
    step, args = build(size, plain)
    first, first_args = build(size, loss_first)
    whole = rewrite(step, rulesets=packs(), cache=False)
    flat_step, leaves = _flat(step, args)
    t = time.perf_counter()
    mem = {}
    for k, f in (("standard", flat_step), ("whole", _flat(whole, args)[0]), ("loss_first", _flat(first, first_args)[0])):
        mem[k] = compile_stats(f, *leaves)[1].temp_bytes
        if k == "whole":
            rewrite_s = time.perf_counter() - t
    res = whole.result(*args)
    loss_err, param_err = values_error(flat_step, _flat(whole, args)[0], leaves)
    b = mem["standard"]
    return (f"| {name} | {b / MiB:.1f} MiB | {mem['whole'] / MiB:.1f} MiB (x{mem['whole'] / b:.2f}) | "
            f"{mem['loss_first'] / MiB:.1f} MiB (x{mem['loss_first'] / b:.2f}) | "
            f"x{mem['whole'] / max(mem['loss_first'], 1):.2f} | {loss_err:.1e}, {param_err:.1e} | {rewrite_s:.0f} s | "
            f"{getattr(res, 'step', None)} |")


def line(d: dict[str, Any]) -> str:
    v = d["variants"]
    base = v["standard"]["temp_bytes"]

    def cell(k: str) -> str:
        mem = f"{v[k]['temp_bytes'] / MiB:.1f} MiB (x{v[k]['temp_bytes'] / max(base, 1):.2f})"
        if "paired" not in v[k]:  # a row an older run wrote
            return f"{v[k]['ratio']:.2f}x, {mem}"
        mid, lo, hi = v[k]["paired"]
        return f"{mid:.2f}x [{lo:.2f}, {hi:.2f}], {mem}"

    whole, first = v["whole"], v["loss_first"]
    return (f"| {d['case']} | {v['standard']['seconds'] * 1e3:.1f} ms, {base / MiB:.1f} MiB | {cell('aa')} | "
            f"{cell('whole')} | {cell('loss_first')} | {first['seconds'] / whole['seconds']:.2f}x, "
            f"x{whole['temp_bytes'] / max(first['temp_bytes'], 1):.2f} | {d['loss_error']:.1e}, "
            f"{d['param_error']:.1e} | {d['rewrite_seconds']:.0f} s |")


HEADER = ("| case | standard | A/A | whole: `jit(rewrite(step))` | loss first | whole vs loss first (speed, memory) "
          "| values (loss, params) | rewrite |\n|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--small", action="store_true", help="N=128, V=1024, width 64")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--round-seconds", type=float, default=0.02,
                   help="the least time one variant's timed block lasts in a round (it repeats the step to fill it)")
    p.add_argument("--write", action="store_true", help="write benchmarks/results/wholestep[_small].md and .json")
    p.add_argument("--memory", action="store_true", help="temp memory and values only, compiled and not timed")
    a = p.parse_args(argv)
    size = SMALL if a.small else FULL
    if a.memory:
        print("| case | standard | whole | loss first | whole vs loss first | values (loss, params) | rewrite + "
              "compile | found |\n|---|---|---|---|---|---|---|---|")
        for name in a.cases.split(","):
            print(memory_case(name, size), flush=True)
        return []
    rows = []
    print(HEADER)
    for name in a.cases.split(","):
        d = run_case(name, size, a.rounds, a.round_seconds)
        rows.append(d)
        print(line(d), flush=True)
        print(f"  found: {d['found']}", flush=True)
        if a.write:  # after each case, so that a long run keeps what it measured
            _write(rows, size, a.rounds, a.round_seconds)
    return rows


def _write(rows: list[dict[str, Any]], size: Size, rounds: int, round_seconds: float = 0.02) -> None:
    """The results file: these rows, after the rows of other cases an earlier run wrote (``--cases`` runs some)."""
    import json

    old = RESULTS / ("wholestep_small.json" if size == SMALL else "wholestep.json")
    ran = {d["case"] for d in rows}
    kept = [d for d in (json.loads(old.read_text()) if old.exists() else []) if d["case"] not in ran]
    rows = kept + rows
    setup = (f"B={size.batch}, N={size.length}, width {size.width}, {size.heads} heads, V={size.vocab}; every "
             "built-in pack but fastmath. Ratios are speed against `standard` (higher is faster): the median over "
             "rounds of each round's ratio, with its 90% bootstrap interval where measured so (every variant "
             "repeated as often in a round); memory is XLA's temp memory and its ratio to `standard`'s.")
    command = (f"python -m benchmarks.wholestep{' --small' if size == SMALL else ''} --rounds {rounds}"
               + (f" --round-seconds {round_seconds:g}" if round_seconds != 0.02 else ""))
    write_results(RESULTS, "wholestep_small" if size == SMALL else "wholestep",
                  "Whole training steps: jit(step), jit(rewrite(step)), loss first", setup, rounds, HEADER,
                  [line(d) for d in rows] + [""] + [f"- {d['case']}: {d['found']}" for d in rows], rows, command)


if __name__ == "__main__":
    main()
del np
