"""Test programs for overhead benchmarks: transformer training steps of chosen depth."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _init(key, d, layers, vocab=64):
    keys = jax.random.split(key, 6 * layers + 2)
    k = iter(keys)
    s = 0.05
    params = {"embed": jax.random.normal(next(k), (vocab, d)) * s, "layers": []}
    for _ in range(layers):
        params["layers"].append({
            "wq": jax.random.normal(next(k), (d, d)) * s, "wk": jax.random.normal(next(k), (d, d)) * s,
            "wv": jax.random.normal(next(k), (d, d)) * s, "wo": jax.random.normal(next(k), (d, d)) * s,
            "w1": jax.random.normal(next(k), (d, 4 * d)) * s, "w2": jax.random.normal(next(k), (4 * d, d)) * s,
            "g1": jnp.ones(d), "b1": jnp.zeros(d), "g2": jnp.ones(d), "b2": jnp.zeros(d),
        })
    params["out"] = jax.random.normal(next(k), (d, vocab)) * s
    return params


def _ln(x, g, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b


def _block(p, x, heads):
    B, T, D = x.shape
    h = _ln(x, p["g1"], p["b1"])
    q, k, v = (jnp.einsum("btd,de->bte", h, p[w]).reshape(B, T, heads, D // heads) for w in ("wq", "wk", "wv"))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D // heads)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(B, T, D)
    x = x + a @ p["wo"]
    h = _ln(x, p["g2"], p["b2"])
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def loss(params, tokens, heads=4):
    x = params["embed"][tokens[:, :-1]]
    for p in params["layers"]:
        x = _block(p, x, heads)
    logits = x @ params["out"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()


def train_step(params, tokens, lr=1e-2):
    l, g = jax.value_and_grad(loss)(params, tokens)
    return jax.tree_util.tree_map(lambda p, gp: p - lr * gp, params, g), l


def transformer_step(layers: int, d: int = 32, batch: int = 4, seq: int = 16, kind: str = "step"):
    """``(fn, args)`` for a transformer of ``layers`` blocks: kind is "forward", "grad" or "step"."""
    params = _init(jax.random.PRNGKey(0), d, layers)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq + 1), 0, 64)
    fn = {"forward": loss, "grad": jax.grad(loss), "step": train_step}[kind]
    return fn, (params, tokens)
