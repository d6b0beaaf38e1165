"""Programs the rewriter must handle: jax.nn, jax.numpy, optax, equinox, their gradients, and nesting.

Each entry is ``(name, fn, args)``. The round-trip test rewrites each with
no rules; rule-pack tests reuse the corpus.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

_key = jax.random.PRNGKey(0)


def _rand(*shape, seed=0, dtype=jnp.float32):
    # numpy's generator, not jax.random: each jax.random shape is an XLA compile, and the corpus
    # has dozens of shapes (most of the corpus's build time went there).
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def lm_head_case(n: int = 256, c: int = 128, v: int = 1024):
    """An LM head's loss (optax's integer-label cross-entropy of ``h @ w``, averaged) and its inputs ``(h, w, y)``:
    hidden states ``[n, c]``, a weight ``[c, v]`` and labels in ``[0, v)``."""
    rng = np.random.default_rng(0)
    h = rng.standard_normal((n, c)).astype(np.float32)
    w = (rng.standard_normal((c, v)) * 0.1).astype(np.float32)
    y = jnp.asarray(rng.integers(0, v, n))

    def loss(h, w, y):
        return optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean()

    return loss, (h, w, y)


def seed000(x, a):
    return jnp.sin(a * x) ** 2 / a


def seed001(x1, x2, y):
    return jnp.square(y - lax.scan(lambda c, xs: (jnp.sin(c), jnp.cos(xs)), x1, x2)[1]).mean()


def mlp_loss(params, x, y):
    h = x
    for w, b in params[:-1]:
        h = jax.nn.gelu(h @ w + b)
    w, b = params[-1]
    logits = h @ w + b
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))


def binary_cross_entropy(z, t):
    return -(t * jnp.log(jax.nn.sigmoid(z)) + (1 - t) * jnp.log(1 - jax.nn.sigmoid(z)))


def _mlp_params():
    sizes = [8, 16, 16, 4]
    return [(_rand(m, n, seed=i), _rand(n, seed=10 + i)) for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))]


def layernorm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-5) * g + b


def attention(q, k, v):
    s = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    s = jnp.where(mask, s, -1e9)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


def numpy_mix(x, i):
    y = jnp.cumsum(x, axis=0) + jnp.sort(x, axis=1)
    z = jnp.concatenate([x[:2], x[2:]], axis=0)
    w = lax.dynamic_slice(x, (i, 0), (2, x.shape[1]))
    w = lax.dynamic_update_slice(z, w * 2, (i, 0))
    p = jnp.pad(x, ((1, 1), (0, 2)))
    r = jnp.flip(x, 0).T @ jnp.arange(x.shape[0], dtype=x.dtype)
    return y.sum() + w.sum() + p.sum() + r.sum() + jnp.argmax(x) + x[jnp.array([0, 2])].sum() + jnp.clip(x, -1, 1).max()


def rnn_mse(params, xs, ys):
    W, U, V = params

    def step(h, x):
        h = jnp.tanh(h @ W + x @ U)
        return h, h @ V

    _, os_ = lax.scan(step, jnp.zeros((xs.shape[1], W.shape[0])), xs)
    return jnp.mean((os_ - ys) ** 2)


def nested(x):
    def inner(c, xi):
        c2, _ = lax.scan(lambda d, e: (d * 0.5 + e, d), c, xi)
        return c2, c2.sum()

    c, s = lax.scan(inner, jnp.zeros(x.shape[-1]), x, reverse=True, unroll=2)
    y = jax.jit(lambda z: jnp.sin(z) * 2.0, donate_argnums=())(c)
    z = lax.cond(s.sum() > 0, lambda v: v + 1, lambda v: v * 2, y)
    w = lax.while_loop(lambda t: t[0] < 5, lambda t: (t[0] + 1, t[1] * 1.5), (0, z))[1]
    return w.sum() + s.mean()


@jax.custom_jvp
def _softclip(x):
    return jnp.tanh(x) * 3.0


_softclip.defjvp(lambda p, t: (_softclip(p[0]), t[0] * (1 - jnp.tanh(p[0]) ** 2) * 3.0))


@jax.custom_vjp
def _clipgrad(x):
    return x * 1.0


_clipgrad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))


def custom_and_remat(x):
    y = jax.checkpoint(lambda v: jnp.sin(v) * jnp.cos(v))(x)
    return (_softclip(y) + _clipgrad(y)).sum()


def optax_step(params, grads, state):
    opt = optax.adam(1e-3)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def _adam_args():
    params = {"w": _rand(4, 3), "b": _rand(3, seed=1)}
    grads = {"w": _rand(4, 3, seed=2), "b": _rand(3, seed=3)}
    return params, grads, optax.adam(1e-3).init(params)


def eqx_mlp(model, x):
    return jax.vmap(model)(x).sum()


def eqx_attention(model, x):
    return model(x, x, x).sum()


def eqx_gru_scan(cell, xs):
    h, hs = lax.scan(lambda h, x: (cell(x, h), cell(x, h)), jnp.zeros(cell.hidden_size), xs)
    return (hs ** 2).mean() + h.sum()


def _eqx_models():
    k1, k2, k3 = jax.random.split(_key, 3)
    mlp = eqx.nn.MLP(6, 3, 16, 2, key=k1)
    att = eqx.nn.MultiheadAttention(2, 8, key=k2)
    gru = eqx.nn.GRUCell(4, 8, key=k3)
    return mlp, att, gru


def _grad(f, argnums=0):
    g = jax.grad(f, argnums=argnums)
    g.__name__ = f"grad_{f.__name__}"
    return g


@functools.cache
def corpus():
    x = _rand(32, 16, 8)
    a = jnp.asarray(np.random.default_rng(0).uniform(0.5, 2.0, (8,)), jnp.float32)
    params = _mlp_params()
    xm, ym = _rand(5, 8, seed=4), jax.nn.one_hot(jnp.arange(5) % 4, 4)
    rnn_p = (_rand(6, 6, seed=5) * 0.3, _rand(3, 6, seed=6) * 0.3, _rand(6, 2, seed=7) * 0.3)
    xs, ys = _rand(7, 4, 3, seed=8), _rand(7, 4, 2, seed=9)
    mlp, att, gru = _eqx_models()
    entries = [
        ("seed000", seed000, (x, a)),
        ("seed000_grad", _grad(lambda x, a: seed000(x, a).sum(), (0, 1)), (x, a)),
        ("seed001", seed001, (_rand(10, 5, 8), _rand(30, 15, 12, seed=1), _rand(30, 15, 12, seed=2))),
        ("seed001_grad", _grad(seed001, 1), (_rand(10, 5, 8), _rand(30, 15, 12, seed=1), _rand(30, 15, 12, seed=2))),
        ("mlp_loss", mlp_loss, (params, xm, ym)),
        ("mlp_grad", _grad(mlp_loss), (params, xm, ym)),
        ("layernorm", layernorm, (_rand(4, 8), _rand(8, seed=1), _rand(8, seed=2))),
        ("layernorm_grad", _grad(lambda x, g, b: layernorm(x, g, b).sum(), (0, 1, 2)),
         (_rand(4, 8), _rand(8, seed=1), _rand(8, seed=2))),
        ("attention", attention, (_rand(2, 5, 4), _rand(2, 5, 4, seed=1), _rand(2, 5, 4, seed=2))),
        ("attention_grad", _grad(lambda q, k, v: attention(q, k, v).sum()),
         (_rand(2, 5, 4), _rand(2, 5, 4, seed=1), _rand(2, 5, 4, seed=2))),
        ("binary_cross_entropy", binary_cross_entropy,
         (_rand(6, seed=11) * 100.0, jnp.asarray(np.random.default_rng(12).uniform(0, 1, (6,)), jnp.float32))),
        ("jax_nn", lambda x: (jax.nn.relu(x) + jax.nn.silu(x) + jax.nn.softplus(x) + jax.nn.sigmoid(x)
                              + jax.nn.logsumexp(x, axis=-1, keepdims=True) + jax.nn.elu(x)).sum(), (_rand(4, 6),)),
        ("numpy_mix", numpy_mix, (_rand(6, 5), jnp.int32(1))),
        ("rnn_mse", rnn_mse, (rnn_p, xs, ys)),
        ("rnn_mse_grad", _grad(rnn_mse), (rnn_p, xs, ys)),
        ("nested", nested, (_rand(3, 4, 5),)),
        ("custom_and_remat", custom_and_remat, (_rand(6),)),
        ("custom_and_remat_grad", _grad(custom_and_remat), (_rand(6),)),
        ("optax_adam", optax_step, _adam_args()),
        ("eqx_mlp", eqx_mlp, (mlp, _rand(3, 6))),
        ("eqx_mlp_grad", eqx.filter_grad(eqx_mlp), (mlp, _rand(3, 6))),
        ("eqx_attention", eqx_attention, (att, _rand(5, 8))),
        ("eqx_gru_scan", eqx_gru_scan, (gru, _rand(6, 4))),
        ("eqx_gru_scan_grad", eqx.filter_grad(eqx_gru_scan), (gru, _rand(6, 4))),
        ("int_and_bool", lambda i, b: jnp.where(b, i * 2 + 1, i >> 1).sum() + (i % 3), (jnp.arange(6), jnp.arange(6) % 2 == 0)),
        ("float64_free_literals", lambda x: x * 0.1 + x / 3.0 - (-0.0) + jnp.float32(np.inf) * 0, (_rand(3),)),
    ]
    return entries


def spy_joint_programs(monkeypatch, key=str):
    """Each JAX joint program traced (``rewrite.grad.vjp.joint_program``, which ``grad.step`` calls too), recorded as
    ``(key(closed), wrt)``: that list, and the spy."""
    from rewrite.grad import step, vjp

    traced: list = []
    real = vjp.joint_program

    def spied(closed, wrt=None):
        traced.append((key(closed), None if wrt is None else tuple(wrt)))
        return real(closed, wrt)

    monkeypatch.setattr(vjp, "joint_program", spied)
    monkeypatch.setattr(step, "joint_program", spied)
    return traced, spied
