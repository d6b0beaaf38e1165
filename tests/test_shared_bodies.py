"""Bodies shared between the programs one e-graph loads in turn (``rewrite/jaxpr/load.py``'s ``SharedBodies``):
``pipeline.run_together``'s two joint programs hold the same loops, and a loop of the second that is, term for term,
one of the first's is that one, so that what reads it is one term too. Only what the loader built alike is shared."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import ecosystem as eco
from benchmarks.overhead import load_rulesets
from rewrite import pipeline, rewrite

X = np.linspace(-2.0, 2.0, 12, dtype=np.float32).reshape(6, 2)


def _scan(f):
    """A scan over ``x``'s rows that sums ``f`` of each."""
    return lambda x: jax.lax.scan(lambda c, a: (c + f(a), c), jnp.zeros(2, x.dtype), x)[0]


def _loaded(*fns, share=True):
    """Each program's output names, loaded into one e-graph in turn (``pipeline._load_all``)."""
    programs = [jax.make_jaxpr(f)(X) for f in fns]
    eg, loaded, _, _ = pipeline._load_all(programs, (), share=share)
    try:
        return [outs for outs, _ in loaded]
    finally:
        eg.release()


def test_a_later_programs_loop_is_the_first_programs_where_its_body_is_the_same():
    reads = _loaded(_scan(jnp.sin), _scan(jnp.sin))
    assert reads[0] == reads[1]  # the same loop over the same input: one term
    apart = _loaded(_scan(jnp.sin), _scan(jnp.sin), share=False)
    assert apart[0] != apart[1]  # as each body had a scope of its own


def test_a_loop_whose_body_differs_is_not_shared():
    for other in (jnp.cos, lambda a: jnp.sin(a) + 1.0, lambda a: jnp.sin(a * 2.0)):
        a, b = _loaded(_scan(jnp.sin), _scan(other))
        assert a != b


def test_within_one_program_nothing_is_shared_and_a_later_one_takes_the_first_programs_loops_in_order():
    two = lambda x: (_scan(jnp.sin)(x), _scan(jnp.sin)(x))  # noqa: E731  (two loops alike, over the same input)
    (a, b), (c, d) = _loaded(two, two)
    assert a != b  # the first program is loaded as alone: its two loops are two bodies, so two terms
    assert (c, d) == (a, b)  # the second's k-th loop is the first's k-th
    (e, f), = _loaded(two)
    assert e != f


def _custom(scale: float):
    @jax.custom_vjp
    def f(a):
        return jnp.sin(a)

    f.defvjp(lambda a: (jnp.sin(a), a), lambda a, g: (g * scale * jnp.cos(a),))
    return f


def test_a_body_holding_a_custom_vjp_is_not_shared_with_another():
    """The two print alike (their ``bwd`` is a callable, compared only by identity): a body is the same only
    where the loader interned the same params. (Each trace wraps even one ``custom_vjp``'s ``bwd`` anew, so two
    traces of it are not shared either: a body is shared only where it is certainly the same.)"""
    a, b = _loaded(_scan(_custom(1.0)), _scan(_custom(-1.0)))
    assert a != b
    a, b = _loaded(_scan(jnp.sin), _scan(jnp.sin))
    assert a == b


def test_two_programs_saturated_together_share_their_loops_and_keep_their_values(monkeypatch):
    """``run_together`` with the identity packs' rules: each program comes out computing what it did (and its
    gradient), and the e-graph holds fewer rows than with each body loaded apart."""
    fns = [lambda x: jnp.sum(_scan(jnp.sin)(x) ** 2), lambda x: jnp.sum(_scan(jnp.sin)(x) * 3.0)]
    first, second = [jax.make_jaxpr(f)(X) for f in fns]
    r = rewrite(lambda x: x, rulesets=load_rulesets(eco.CONFIGS["identity"]))

    def together() -> tuple:
        one, two = pipeline.run_together(first, second, r.entries, r.cost_model, r.limits)
        one.release()
        return one, two

    one, two = together()
    for res, f in ((one, fns[0]), (two, fns[1])):
        run = lambda x, res=res: jax.core.eval_jaxpr(res.after.jaxpr, res.after.consts, x)[0]  # noqa: E731
        np.testing.assert_allclose(run(X), f(X), rtol=1e-5)
        np.testing.assert_allclose(jax.grad(run)(X), jax.grad(f)(X), rtol=1e-5)
    load_all = pipeline._load_all
    monkeypatch.setattr(pipeline, "_load_all", lambda *a, share=False, **k: load_all(*a, **k))
    assert one.rows < together()[0].rows
