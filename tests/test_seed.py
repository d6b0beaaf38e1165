"""``rewrite.grad.seed.seeded_edit``: a loss's joint program seeded with 1, built from the joint's equations, is the
program ``jax.make_jaxpr`` of the joint at a cotangent of one gives (``grad.step.seeded_by_trace``), equation by
equation: the same text, primitives, params (the same objects), literals (value and type), types, effects,
tracebacks, name stacks and contexts. Where the trace could make another program, it declines and the trace runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rulesets
from rewrite import rewrite
from rewrite.grad import seed as seed_mod
from rewrite.grad import step as step_mod
from rewrite.grad.vjp import joint_program
from rewrite.ir.jaxapi import core


def _same(a, b):
    """``None`` where ``a`` and ``b`` are the same program as far as anything reading them can tell; else where
    they differ."""
    if str(a) != str(b):
        return "text"
    if len(a.consts) != len(b.consts) or a.jaxpr.effects != b.jaxpr.effects:
        return "consts or effects"
    names: dict = {}

    def atom(x, y, where):
        if isinstance(x, core.Literal) or isinstance(y, core.Literal):
            ok = (isinstance(x, core.Literal) and isinstance(y, core.Literal) and type(x.val) is type(y.val)
                  and x.aval == y.aval and np.asarray(x.val).dtype == np.asarray(y.val).dtype
                  and np.array_equal(np.asarray(x.val), np.asarray(y.val)))
            return None if ok else f"{where}: literal {x} {y}"
        if x.aval != y.aval or type(x) is not type(y) or names.setdefault(x, y) is not y:
            return f"{where}: variable"
        return None

    for x, y in zip(a.jaxpr.invars, b.jaxpr.invars):
        if r := atom(x, y, "input"):
            return r
    if len(a.jaxpr.eqns) != len(b.jaxpr.eqns):
        return "equations"
    for i, (e, f) in enumerate(zip(a.jaxpr.eqns, b.jaxpr.eqns)):
        if e.primitive is not f.primitive or e.params.keys() != f.params.keys():
            return f"{i}: primitive"
        for k in e.params:
            if e.params[k] is not f.params[k] and not (type(e.params[k]) is type(f.params[k])
                                                       and e.params[k] == f.params[k]):
                return f"{i}: {e.primitive}'s {k}"
        for x, y in [*zip(e.invars, f.invars), *zip(e.outvars, f.outvars)]:
            if r := atom(x, y, f"{i} {e.primitive}"):
                return r
        if e.effects != f.effects or e.source_info.traceback is not f.source_info.traceback:
            return f"{i}: effects or traceback"
        if e.source_info.name_stack != f.source_info.name_stack:
            return f"{i}: name stack"
        if e.ctx is not f.ctx and any(getattr(e.ctx, k, None) != getattr(f.ctx, k, None)
                                      for k in type(e.ctx).__slots__ if k != "__weakref__"):
            return f"{i}: context"
    for x, y in zip(a.jaxpr.outvars, b.jaxpr.outvars):
        if r := atom(x, y, "output"):
            return r
    return None


def _mlp(w1, b1, w2, x, y):
    h = jax.nn.gelu(x @ w1 + b1)
    z = h @ w2
    return jnp.mean((jax.nn.log_softmax(z)[jnp.arange(y.shape[0]), y]) * -1.0) + 1e-3 * jnp.sum(w1 ** 2)


def _logp(mu, log_sigma, theta, x):
    sigma = jnp.exp(log_sigma)
    prior = -0.5 * jnp.sum(((theta - mu) / sigma) ** 2) - theta.shape[0] * log_sigma
    lik = jnp.sum(jnp.where(x > 0, -0.5 * (x - theta) ** 2, jnp.log1p(jnp.exp(-jnp.abs(theta)))))
    return -(prior + lik)


def _pairwise(r, sigma, eps):
    d = jnp.sqrt(jnp.sum((r[:, None, :] - r[None, :, :]) ** 2, -1) + 1e-6)
    s = (sigma / d) ** 6
    return 0.5 * jnp.sum(jnp.where(d < 2.5, 4 * eps * (s * s - s), 0.0))


rng = np.random.default_rng(0)
CONES = {
    "mlp": (_mlp, (rng.standard_normal((8, 16), np.float32), np.zeros(16, np.float32),
                   rng.standard_normal((16, 4), np.float32), rng.standard_normal((5, 8), np.float32),
                   np.array([0, 1, 2, 3, 0], np.int32))),
    "logp": (_logp, (np.float32(0.1), np.float32(0.2), rng.standard_normal(6).astype(np.float32),
                     rng.standard_normal(6).astype(np.float32))),
    "pairwise": (_pairwise, (rng.standard_normal((7, 3)).astype(np.float32), np.float32(1.0), np.float32(1.0))),
}


@pytest.mark.parametrize("name", sorted(CONES))
def test_a_joint_seeded_from_its_equations_is_the_traced_program(name):
    """The joint program of a loss (as ``rederive`` traces it) seeded by the edit is the traced seeding, equation
    by equation; and ``seeded_from`` gives the edit, not a trace."""
    fn, args = CONES[name]
    cone = jax.make_jaxpr(fn)(*args)
    joint = joint_program(cone)[0]
    edited = seed_mod.seeded_edit(joint, cone)
    assert edited is not None
    assert _same(edited, step_mod.seeded_by_trace(joint, cone)) is None, _same(edited, step_mod.seeded_by_trace(
        joint, cone))


def test_a_cotangent_the_tracer_would_fold_is_left_to_the_trace():
    """A loss whose backward casts its cotangent first (a ``convert_element_type`` of the literal one, which the
    tracer folds into a literal): the edit declines, and ``seeded_from`` traces it."""
    def loss(x):
        return (x.astype(jnp.bfloat16) * x.astype(jnp.bfloat16)).astype(jnp.float32)

    cone = jax.make_jaxpr(loss)(np.float32(1.5))
    joint = joint_program(cone)[0]
    assert any(e.primitive.name == "convert_element_type" and joint.jaxpr.invars[-1] in e.invars
               for e in joint.jaxpr.eqns), joint
    assert seed_mod.seeded_edit(joint, cone) is None
    assert _same(step_mod.seeded_from(joint, cone), step_mod.seeded_by_trace(joint, cone)) is None


def test_a_steps_rewrite_seeds_its_joints_without_a_trace(monkeypatch):
    """A training step's rewrite (the loss re-derived and proven, then replaced by the loss-first program) seeds
    both joint programs (``rederive``'s and ``replace``'s) from their equations: no ``jax.make_jaxpr`` runs inside
    ``seeded_from``."""
    fn, args = CONES["mlp"]

    def step(w1, b1, w2, x, y):
        value, grads = jax.value_and_grad(fn, argnums=(0, 1, 2))(w1, b1, w2, x, y)
        return value, w1 - 0.1 * grads[0], b1 - 0.1 * grads[1], w2 - 0.1 * grads[2]

    inside = [False]
    traced: list = []
    seeded: list = []
    make_jaxpr = jax.make_jaxpr
    seeded_from = step_mod.seeded_from

    def counting(*a, **k):
        if inside[0]:
            traced.append(1)
        return make_jaxpr(*a, **k)

    def wrapped(*a):
        inside[0] = True
        seeded.append(1)
        try:
            return seeded_from(*a)
        finally:
            inside[0] = False

    # The literal a trace stages for ``jnp.ones((), float32)`` is probed once per process and dtype
    # (``seed._one``, cached): made here, so that the count below reads the seedings alone whichever test ran first.
    assert seed_mod._one(np.dtype(np.float32)) is not None
    monkeypatch.setattr(jax, "make_jaxpr", counting)
    monkeypatch.setattr(step_mod, "seeded_from", wrapped)
    res = rewrite(step, rulesets=[rulesets.nn], cache=False, whole_step=True).result(*args)
    assert res.step.replaced, str(res.step)
    assert len(seeded) == 2 and not traced, (len(seeded), len(traced))
