"""Where two forwards of one loss part (``rewrite/grad/marks.py``): the values both compute that the parts where
they differ read, marked so that each joint program names their cotangent, which ``pipeline.run_together`` unites;
a value is met only where uniting its cotangents is sound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks import ecosystem as eco
from benchmarks import wholestep as ws
from benchmarks.overhead import load_rulesets
from rewrite import pipeline, rewrite
from rewrite.grad import marks, together
from rewrite.grad.vjp import joint_program
from rewrite.ir.jaxapi import BUILT_DEBUG

rng = np.random.default_rng(0)
X = rng.normal(size=(8, 4)).astype(np.float32)
W = rng.normal(size=(4, 6)).astype(np.float32)


def _hidden(x, w):
    return jnp.sin(x) * x  # (its backward reads the cotangent twice, on every JAX: what uniting makes one)


def _plain(x, w):  # the head as written
    return jnp.sum(jax.nn.logsumexp(_hidden(x, w) @ w, axis=-1))


def _other(x, w):  # the same loss, its head computed another way from the same hidden states
    z = (w.T @ _hidden(x, w).T).T
    m = jnp.max(z, axis=-1, keepdims=True)
    return jnp.sum(jnp.log(jnp.sum(jnp.exp(z - m), axis=-1)) + m[:, 0])


def _closed(f):
    return jax.make_jaxpr(f)(X, W)


def test_the_value_where_two_forwards_part_is_met_as_a_variable_of_each():
    first, second = _closed(_plain), _closed(_other)
    of_first, of_second = marks.meeting(first, second)
    assert len(of_first) == len(of_second) == 1
    assert of_first[0].aval.shape == of_second[0].aval.shape == (8, 4)
    producer = {o: e for e in second.jaxpr.eqns for o in e.outvars}[of_second[0]]
    assert producer.primitive.name == "mul"  # sin(x) * x: the hidden states


def test_no_value_is_met_where_one_program_computes_it_twice_or_reads_other_values():
    def twice(x, w):  # the hidden states computed twice: each variable has its share of the cotangent
        return jnp.sum(jax.nn.logsumexp(_hidden(x, w) @ w, axis=-1)) + jnp.sum(jnp.sin(x) * x)

    def once(x, w):
        h = _hidden(x, w)
        return jnp.sum(jax.nn.logsumexp(h @ w, axis=-1)) + jnp.sum(h)

    assert marks.meeting(_closed(once), _closed(twice)) == ([], [])

    def reads_more(x, w):  # its own part reads a value the other's does not
        return _other(x, w) + jnp.sum(jnp.sin(x))

    assert marks.meeting(_closed(_plain), _closed(reads_more)) == ([], [])
    assert marks.meeting(_closed(_plain), _closed(_plain)) == ([], [])  # nothing parts


def _spied(monkeypatch) -> list:
    """Whether each :func:`marks.spliced` made the second joint (``True``) or declined (``False``)."""
    made: list = []
    splice = marks.spliced
    monkeypatch.setattr(marks, "spliced", lambda *a, **k: (lambda r: made.append(r is not None) or r)(splice(*a, **k)))
    return made


def _same_values(joint, want, *args, tol=1e-6):
    for g, w in zip(jax.core.eval_jaxpr(joint.jaxpr, joint.consts, *args),
                    jax.core.eval_jaxpr(want.jaxpr, want.consts, *args)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def test_a_marked_joint_is_the_joint_as_traced_and_names_the_values_cotangent(monkeypatch):
    """The plain forward's joint is JAX's, equation for equation; the other's is spliced from it (its own part's
    joint traced alone in the plain one's part's place) and computes what JAX's joint of it computes."""
    first, second = _closed(_plain), _closed(_other)
    made = _spied(monkeypatch)
    (joint_second, joint_first), pairs = marks.marked_joints(second, first, lambda f: joint_program(f)[0])
    assert made == [True]
    assert str(joint_first) == str(joint_program(first)[0])
    _same_values(joint_second, joint_program(second)[0], X, W, np.float32(1.0))
    assert len(pairs) == 1
    h = _hidden(X, W)
    want = jax.grad(lambda h: jnp.sum(jax.nn.logsumexp(h @ W, axis=-1)))(h)
    for joint, ct in zip((joint_second, joint_first), pairs[0]):
        named = joint.jaxpr.replace(outvars=[*joint.jaxpr.outvars, ct], debug_info=BUILT_DEBUG)
        got = jax.core.eval_jaxpr(named, joint.consts, X, W, np.float32(1.0))[-1]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_two_joints_united_at_their_cotangent_keep_their_values_and_are_smaller(monkeypatch):
    first, second = _closed(_plain), _closed(_other)
    (joint_second, joint_first), pairs = marks.marked_joints(second, first, lambda f: joint_program(f)[0])
    r = rewrite(lambda x: x, rulesets=load_rulesets(eco.CONFIGS["identity"]))

    def run(unite):
        one, two = pipeline.run_together(joint_first, joint_second, r.entries, r.cost_model, r.limits,
                                         as_loaded=True, unite=unite)
        one.release()
        return one, two

    one, two = run([(b, a) for a, b in pairs])
    for res, joint in ((one, joint_first), (two, joint_second)):
        got = jax.core.eval_jaxpr(res.after.jaxpr, res.after.consts, X, W, np.float32(1.0))
        want = jax.core.eval_jaxpr(joint.jaxpr, joint.consts, X, W, np.float32(1.0))
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert one.rows < run([])[0].rows


def test_a_steps_two_joints_united_give_the_step_they_gave_apart(monkeypatch):
    """A small linen GPT's step, whose LM head's loop fires in its loss's forward, its two joints saturated together
    (``rewrite_joints``' run_together, asked for): united at the hidden states' cotangent, they give the step's
    program as they did apart, and the rewritten step computes what the step does."""
    monkeypatch.setattr(together, "plain_first", lambda *a: False)
    monkeypatch.setattr(together, "one_joint_can_win", lambda *a: False)
    united: list = []
    run = pipeline.run_together
    monkeypatch.setattr(pipeline, "run_together",
                        lambda *a, **k: united.append(len(k.get("unite", ()))) or run(*a, **k))
    size = ws.Size(batch=2, length=128, width=64, heads=2, vocab=1024)

    def step_program() -> tuple[str, list, object]:
        flat, leaves = ws._flat(*ws.CASES["linen_gpt"](size, ws.plain, opt=optax.sgd(0.1)))
        r = rewrite(flat, rulesets=load_rulesets(eco.CONFIGS["identity"]), whole_step=True, cache=False)
        return str(r.jaxpr(*leaves)), r(*leaves), jax.jit(flat)(*leaves)

    made = _spied(monkeypatch)
    program, got, want = step_program()
    assert united and all(united)
    assert made and all(made)  # the second joint spliced from the first
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
    monkeypatch.setattr(marks, "parting", lambda first, second: None)
    united.clear()
    assert step_program()[0] == program
    assert united and not any(united)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_a_gradients_two_joints_are_united_where_the_plain_forward_is_rewritten_too(monkeypatch, dtype):
    """``jax.grad(rewrite(loss))`` of an LM head whose hidden states another rule rewrites (``tanh(h) * 1``), so
    the forward without the ``jointly`` rules is not the loss as written: ``build_vjps`` marks the two forwards and
    unites their joints at the hidden states' cotangent, and the VJP is the one they gave apart, with JAX's
    gradients, in each dtype users train with."""
    import rulesets
    from tests.corpus import lm_head_case

    loss, (h, w, y) = lm_head_case(1024, 128, 8192)
    h, w = jnp.asarray(h, dtype), jnp.asarray(w, dtype)
    scaled = lambda h, w, y: loss(jnp.tanh(h) * jnp.asarray(1.0, h.dtype), w, y)  # noqa: E731
    united: list = []
    run = pipeline.run_together
    monkeypatch.setattr(pipeline, "run_together",
                        lambda *a, **k: united.append(len(k.get("unite", ()))) or run(*a, **k))

    def built() -> tuple:
        r = rewrite(scaled, rulesets=[rulesets.nn, rulesets.algebra], cache=False)
        made = r.grad_result(h, w, y)
        grads = jax.grad(r, argnums=(0, 1))
        return str(made.fwd), str(made.bwd), made.decided, grads(h, w, y), jax.jit(grads)(h, w, y)

    got = built()
    if dtype == np.float32:  # (in half precision only nn_lm_head_label fires here: the forwards part at no value met)
        assert united and all(united), united
    want = jax.grad(scaled, argnums=(0, 1))(h, w, y)
    tol = 2e-4 if dtype == np.float32 else 2e-2
    for g, x in zip(got[3] + got[4], want + want):  # eagerly and under jit
        assert g.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(x, np.float32), rtol=tol, atol=tol / 10)
    monkeypatch.setattr(marks, "parting", lambda first, second: None)
    united.clear()
    apart = built()
    assert united and not any(united)
    assert got[:3] == apart[:3]


def test_a_spliced_lm_head_joint_computes_jax_s_joint_of_its_forward(monkeypatch):
    """``jax.grad(rewrite(loss))`` of an LM head whose forward with the ``jointly`` rules runs the token loop (a
    ``custom_vjp`` reading the hidden states, the head's weights as an input, and the labels): the joint of that
    forward, spliced from the plain forward's, computes JAX's joint of it at random inputs and cotangents."""
    import rulesets
    from tests.corpus import lm_head_case

    loss, (h, w, y) = lm_head_case(1024, 128, 8192)
    seen: list = []
    marked_joints = marks.marked_joints
    monkeypatch.setattr(marks, "marked_joints", lambda closed, plain, trace: seen.append((closed, plain))
                        or marked_joints(closed, plain, trace))
    r = rewrite(lambda h, w, y: loss(jnp.tanh(h) * jnp.asarray(1.0, h.dtype), w, y),
                rulesets=[rulesets.nn, rulesets.algebra], cache=False)
    r.grad_result(h, w, y)
    assert seen
    closed, plain = seen[0]
    assert any(e.primitive.name == "custom_vjp_call" for e in closed.jaxpr.eqns)
    made = _spied(monkeypatch)
    (joint, joint_plain), pairs = marked_joints(closed, plain, lambda f: joint_program(f)[0])
    assert made == [True] and pairs
    assert str(joint_plain) == str(joint_program(plain)[0])
    args = [jnp.asarray(rng.normal(size=a.shape), a.dtype) if jnp.issubdtype(a.dtype, jnp.floating)
            else jnp.asarray(rng.integers(0, w.shape[1], size=a.shape), a.dtype) for a in joint.in_avals]
    want = joint_program(closed)[0]
    assert len(joint.jaxpr.eqns) != len(want.jaxpr.eqns) or str(joint) != str(want)  # (made, not traced)
    _same_values(joint, want, *args, tol=2e-5)


def test_a_value_read_beside_the_part_that_differs_is_not_spliced(monkeypatch):
    """Where the hidden states are read by the common part too (an auxiliary term), the plain joint's cotangent of
    them is not the differing part's alone: no splice, the other joint traced whole (JAX's), and united."""
    def aux_first(x, w):
        h = _hidden(x, w)
        return jnp.sum(jax.nn.logsumexp(h @ w, axis=-1)) + jnp.sum(h * h)

    def aux_second(x, w):
        h = _hidden(x, w)
        z = (w.T @ h.T).T
        m = jnp.max(z, axis=-1, keepdims=True)
        return jnp.sum(jnp.log(jnp.sum(jnp.exp(z - m), axis=-1)) + m[:, 0]) + jnp.sum(h * h)

    first, second = _closed(aux_first), _closed(aux_second)
    made = _spied(monkeypatch)
    (joint_second, joint_first), pairs = marks.marked_joints(second, first, lambda f: joint_program(f)[0])
    assert made == [False] and pairs
    assert str(joint_second) == str(joint_program(second)[0])


def test_a_joint_that_cannot_be_traced_marked_is_traced_unmarked_and_not_united(monkeypatch):
    """Where JAX's autodiff does not take the markers (here: their JVP rule raises), the two joints are traced as
    they are, and nothing is united."""
    def refuses(*args, **kwargs):
        raise NotImplementedError("no markers here")

    monkeypatch.setitem(marks.ad.primitive_jvps, marks.fmark_p, refuses)
    first, second = _closed(_plain), _closed(_other)
    (joint_second, joint_first), pairs = marks.marked_joints(second, first, lambda f: joint_program(f)[0])
    assert pairs == []
    assert str(joint_first) == str(joint_program(first)[0]) and str(joint_second) == str(joint_program(second)[0])
