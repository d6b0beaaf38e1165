"""``rewrite(fn, vjp=True)`` (deprecated; the plain decorator runs the same split, see test_grad.py):
gradients equal JAX's under jit and vmap, the residuals are the cost model's choice, and programs
that already contain ``jax.grad`` (training steps) rewrite correctly."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rewrite import RewriteWarning, rewrite
from rewrite.report.report import primitive_counts
from rulesets.algebra import algebra
from rulesets.derivatives import derivatives, derivatives_fastmath

from .corpus import lm_head_case
from .local_rulesets import without_kernels

#: the pack without its kernel (``derivatives_kernels``): these tests read JAX's VJP split, which the kernel's
#: backward replaces where the joint decision takes it (``tests/test_sin_squared.py`` tests that)
DERIVATIVES = without_kernels(derivatives)

pytestmark = pytest.mark.filterwarnings(r"ignore:rewrite\(\.\.\., vjp=True\) is deprecated:DeprecationWarning")


def seed(x, a):
    return jnp.sin(a * x) ** 2 / a


def _rand(*shape, seed=0):
    # numpy's generator, not jax.random: each of jax.random's shapes is an XLA compile (0.2-1 s of CPU)
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _close(got, want, tol=2e-5):
    for p, q in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(p, q, rtol=tol, atol=tol)


X, A = _rand(4, 8, 16), jnp.linspace(0.5, 2.0, 16)


def test_seed_vjp_equals_jax_and_reads_the_forward():
    # Large enough that XLA:CPU reduces with its library kernels (tiny arrays are launch-bound).
    X, A = _rand(8, 64, 32), jnp.linspace(0.5, 2.0, 32)
    # sin(ax) may have a huge argument, where sin(2ax) overflows (issue 29): its double angle is fastmath
    r = rewrite(seed, rulesets=[derivatives, derivatives_fastmath], vjp=True)
    g = _rand(8, 64, 32, seed=1)
    out, pb = jax.vjp(r, X, A)
    want_out, want_pb = jax.vjp(seed, X, A)
    _close(out, want_out)
    _close(pb(g), want_pb(g))
    fwd, bwd = r.vjp_jaxprs(X, A)
    # The backward pass reads sin(ax)**2 from the forward and needs one transcendental, sin(2ax).
    assert primitive_counts(bwd).get("cos", 0) == 0 and primitive_counts(bwd)["sin"] == 1
    res = r.result(X, A)
    assert {"joint:recompute", "joint:reuse", "gradients:recompute", "gradients:reuse"} <= {
        s.policy for s in res.splits_considered}
    assert res.split.cost == min(s.cost for s in res.splits_considered)
    assert not res.split.policy.endswith("recompute")  # recomputing sin(ax) costs more than reading it
    # Without differentiation only the forward runs.
    assert "cos" not in primitive_counts(r.jaxpr(X, A))


def test_grad_under_jit_and_vmap():
    r = rewrite(seed, rulesets=[derivatives], vjp=True)
    loss_r = lambda x, a: r(x, a).sum()  # noqa: E731
    loss = lambda x, a: seed(x, a).sum()  # noqa: E731
    _close(jax.jit(jax.grad(loss_r, (0, 1)))(X, A), jax.grad(loss, (0, 1))(X, A))
    per_example = jax.vmap(jax.grad(loss_r, (0, 1)), in_axes=(0, None))
    _close(per_example(X, A), jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None))(X, A))
    _close(jax.jit(jax.vmap(r, in_axes=(0, None)))(X, A), seed(X, A))


def test_residuals_are_chosen_by_cost():
    # Only inputs are worth keeping for x*y: recomputing is free, storing a product is not.
    r = rewrite(lambda x, y: jnp.sin(x) * y, rulesets=[derivatives], vjp=True)
    x, y = _rand(64, 64), _rand(64, 64, seed=1)
    res = r.result(x, y)
    assert res.split.cost == min(s.cost for s in res.splits_considered)
    fwd, _ = r.vjp_jaxprs(x, y)
    assert len(fwd.out_avals) == 1 + len(res.split.residuals)
    _close(jax.grad(lambda x, y: r(x, y).sum(), (0, 1))(x, y),
           jax.grad(lambda x, y: (jnp.sin(x) * y).sum(), (0, 1))(x, y))


def test_integer_inputs_and_several_outputs():
    def f(x, n, w):
        y = jnp.tanh(x @ w) * n
        return {"y": y, "count": n + 1, "s": jnp.exp(-y).sum()}

    r = rewrite(f, rulesets=[derivatives], vjp=True)
    x, w, n = _rand(5, 3), _rand(3, 3, seed=1), jnp.int32(2)
    _close(r(x, n, w), f(x, n, w))
    loss = lambda f: lambda x, w: f(x, n, w)["s"] + f(x, n, w)["y"].sum()  # noqa: E731
    _close(jax.grad(loss(r), (0, 1))(x, w), jax.grad(loss(f), (0, 1))(x, w))


def _mlp_loss(params, x, y):
    h = x
    for w, b in params[:-1]:
        h = jax.nn.gelu(h @ w + b)
    w, b = params[-1]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(h @ w + b) * y, axis=-1))


def _params():
    sizes = [8, 16, 4]
    return [(_rand(m, n, seed=i) * 0.3, _rand(n, seed=10 + i) * 0.1) for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))]


def _step(loss, opt=None):
    opt = opt or optax.adam(1e-2)

    def step(params, state, x, y):
        l, g = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, l

    return step, opt


def trains_alike(fast) -> None:
    """Three SGD steps with ``fast`` (a rewritten ``_mlp_loss``) give the losses and parameters of the original."""
    params, x, y = _params(), _rand(6, 8, seed=4), jax.nn.one_hot(jnp.arange(6) % 4, 4)
    step_r, opt = _step(fast)
    step, _ = _step(_mlp_loss)
    sr = s = opt.init(params)
    pr = p = params
    for _ in range(3):
        pr, sr, lr = jax.jit(step_r)(pr, sr, x, y)
        p, s, l = jax.jit(step)(p, s, x, y)
        np.testing.assert_allclose(lr, l, rtol=1e-5, atol=1e-6)
    _close(pr, p, tol=1e-4)


def test_training_step_with_a_rewritten_loss():
    trains_alike(rewrite(_mlp_loss, rulesets=[derivatives], vjp=True))


def test_training_step_containing_grad_is_rewritten():
    params, x, y = _params(), _rand(6, 8, seed=4), jax.nn.one_hot(jnp.arange(6) % 4, 4)
    step, opt = _step(_mlp_loss, optax.sgd(1e-2, momentum=0.9))
    state = opt.init(params)
    r = rewrite(step, rulesets=[derivatives])
    _close(jax.jit(r)(params, state, x, y), jax.jit(step)(params, state, x, y), tol=1e-5)
    res = r.result(params, state, x, y)
    assert res.cost_after <= res.cost_before and any(s.fired for s in res.stats.values())


def test_vjp_of_a_function_that_contains_grad():
    # A meta-gradient: differentiate through one SGD step; JAX's VJP of it is second order.
    def inner_step(w, x):
        g = jax.grad(lambda w: (jnp.sin(x @ w) ** 2).sum())(w)
        return w - 0.1 * g

    def outer(w, x):
        return (inner_step(w, x) ** 2).sum()

    w, x = _rand(3, 2) * 0.5, _rand(4, 3, seed=1)
    r = rewrite(outer, rulesets=[derivatives], vjp=True)
    np.testing.assert_allclose(jax.jit(r)(w, x), jax.jit(outer)(w, x), rtol=1e-5)
    _close(jax.jit(jax.grad(r))(w, x), jax.jit(jax.grad(outer))(w, x), tol=1e-4)


def test_failure_falls_back_to_jax(monkeypatch):
    import rewrite.grad.vjp as vjp_mod

    def broken(*a, **k):
        raise RuntimeError("simulated")

    monkeypatch.setattr(vjp_mod, "choose_residuals", broken)
    r = rewrite(seed, rulesets=[derivatives], vjp=True, strict=False)
    with pytest.warns(RewriteWarning, match="simulated"):
        g = jax.grad(lambda x, a: r(x, a).sum())(X, A)
    _close(g, jax.grad(lambda x, a: seed(x, a).sum())(X, A))
    strict = rewrite(seed, rulesets=[derivatives], vjp=True, strict=True)
    with pytest.raises(RuntimeError, match="simulated"):
        strict(X, A)


def test_effects_are_refused():
    def f(x):
        jax.debug.callback(lambda v: None, x[0])
        return jnp.sin(x)

    r = rewrite(f, vjp=True, strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.testing.assert_allclose(jax.grad(lambda x: r(x).sum())(jnp.ones(3)), jnp.cos(jnp.ones(3)))
    assert any("effects" in str(w.message) for w in caught)


def test_the_gradients_alone_are_extracted_from_the_pipelines_copy(monkeypatch):
    """A VJP extracts its joint program, then its gradients alone, both without the recomputing rules' nodes
    (``extract.policy.withheld``): from one copy of the snapshot, whose nodes are priced and passed over once."""
    from rewrite.ir.egraph import Snapshot
    from rulesets.nn import nn

    copies = []
    real = Snapshot.without

    def without(self, drop):
        copies.append(self)
        return real(self, drop)

    monkeypatch.setattr(Snapshot, "without", without)

    def loss(x, w):
        return jnp.sum(jax.nn.gelu(x @ w, approximate=True))

    import rewrite.grad.primitive as primitive

    made = []  # the VJP built (which is then held to JAX's as written: decide.held_alone)
    build = primitive.build_vjp
    monkeypatch.setattr(primitive, "build_vjp", lambda *a, **k: made.append(build(*a, **k)) or made[-1])
    x, w = jnp.linspace(-2.0, 2.0, 32).reshape(4, 8), jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)
    r = rewrite(loss, rulesets=[nn])
    got = jax.grad(r, argnums=(0, 1))(x, w)
    assert len(made) == 1 and made[0].joint.stats["nn_remat_gelu_tanh_f32"].fired  # nodes to withhold were built
    assert len(copies) == 1, len(copies)
    for a, b in zip(got, jax.grad(loss, argnums=(0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_floors_copy_is_made_once_per_snapshot_and_takes_its_input_tree(monkeypatch):
    """Where a chosen program uses ``derivatives_sums``' nodes (the seed's VJP: pulling ``a**-2`` out of a's sum,
    in the joint program and in the gradients' alone), it is extracted again without them
    (``extract.policy.worth_their_saving``): from one copy of each snapshot, so the gradients' extraction takes the
    joint one's copy, whose nodes are priced and passed over once; and the copy's tree pass over the input program's
    nodes is the snapshot's (``same_original_tree``), so its extractor makes one pass, the unrestricted one; and no
    program of the snapshot is priced whole twice (the input program, a candidate of both extractions, is priced
    once: ``Extractor.share_prices``)."""
    from rewrite.extract.choice import reachable
    from rewrite.extract.program import ProgramPricer
    from rewrite.ir.egraph import Snapshot

    copied, copies, priced = [], [], []
    real, exact_price = Snapshot.without, ProgramPricer.exact_price

    def without(self, drop):
        copied.append(self)
        copies.append(real(self, drop))
        return copies[-1]

    def pricing(self, choice, roots, key):
        if key not in self.exact:  # priced now: the snapshot's tables, the roots and the chosen nodes they reach
            snap = self.ex.snap
            priced.append((id(snap.frozen), tuple(roots),
                           frozenset((c, choice[c]) for c in reachable(snap, choice, roots))))
        return exact_price(self, choice, roots, key)

    monkeypatch.setattr(Snapshot, "without", without)
    monkeypatch.setattr(ProgramPricer, "exact_price", pricing)
    r = rewrite(seed, rulesets=[DERIVATIVES], cache=False)
    built = r.grad_result(X, A)
    assert copies and len(copied) == len(set(map(id, copied))), len(copied)  # no snapshot copied twice
    assert any(len(c.extractors) == 1 and c.extractors[0][1].passes == 1 for c in copies), [
        [e.passes for _, e in c.extractors] for c in copies]
    assert all(e.passes <= 1 for c in copies for _, e in c.extractors), [
        [e.passes for _, e in c.extractors] for c in copies]
    assert len(priced) == len(set(priced)), len(priced) - len(set(priced))
    _close(jax.grad(lambda x, a: r(x, a).sum(), argnums=(0, 1))(X, A),
           jax.grad(lambda x, a: seed(x, a).sum(), argnums=(0, 1))(X, A))
    assert built.split is not None


def test_a_peak_read_is_not_read_again_by_moving_the_live_program_back(monkeypatch):
    """An extraction compares candidates by their predicted peaks (``extract._leanest``, ``_no_fatter``); most are
    programs a search read already (its result), and those are answered from the pricer's memory
    (``ProgramPricer.peaks``), not by moving its live program back and re-placing the kernels where they differ: in
    the seed's VJP's extractions, no program's peak is read twice after a jump. The memory is sound because a
    program's peak is the same whatever moves brought the live program there (checked here on every read)."""
    from rewrite.extract.program import LiveProgram, ProgramPricer

    lives, reads, jumped = [], [], [False]
    jump, peak = LiveProgram.jump, LiveProgram.peak

    def jumping(self, choice):
        jumped[0] = True
        return jump(self, choice)

    def reading(self):
        got = peak(self)
        lives.append(self)  # (kept, so that no other live program takes its id)
        if jumped[0]:
            reads.append((id(self), self.key()))
        jumped[0] = False
        pricer = ProgramPricer(self.ex, self.pricer.model)  # (held: a live program holds its pricer weakly)
        assert peak(pricer.live(dict(self.choice), self.roots)) == got
        return got

    monkeypatch.setattr(LiveProgram, "jump", jumping)
    monkeypatch.setattr(LiveProgram, "peak", reading)
    r = rewrite(seed, rulesets=[derivatives], cache=False)
    r.grad_result(X, A)
    assert reads and len(reads) == len(set(reads)), len(reads) - len(set(reads))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_jax_s_own_vjp_as_written_is_jax_s_split_at_every_dtype_and_under_vmap(dtype):
    """``grad.vjp.as_written_vjp`` (the derivative ``decided_jointly`` falls back to) splits a function where
    ``jax.vjp`` does: its forward returns the pullback's residuals and its backward is that pullback, so the two
    give JAX's own outputs and gradients bit for bit, at each training dtype, with zeros, infinities and NaN among
    the inputs, eagerly, under ``jit`` and under ``vmap``; an integer input gets no gradient."""
    from jax.extend.core import jaxpr_as_fun

    from rewrite import AnalyticCost
    from rewrite.grad.vjp import as_written_vjp
    from rewrite.jaxpr.trace import Traced

    def f(x, w, k):
        return jnp.sum(jnp.tanh(x @ w) * jnp.exp(-x[:, :1]) + k.astype(x.dtype)), jnp.log1p(jnp.abs(w))

    dt = jnp.dtype(dtype)
    x = jnp.linspace(-3.0, 3.0, 24, dtype=dt).reshape(4, 6).at[0, 0].set(0.0).at[1, 2].set(jnp.inf)
    x = x.at[2, 3].set(jnp.nan)
    w, k = jnp.linspace(-1.0, 1.0, 18, dtype=dt).reshape(6, 3), jnp.arange(3)
    built = as_written_vjp(Traced(jax.make_jaxpr(f)(x, w, k), None, None, None), AnalyticCost())
    assert built.as_written and built.dif_in == [0, 1] and built.dif_out == [0, 1]
    fwd, bwd = jaxpr_as_fun(built.fwd), jaxpr_as_fun(built.bwd)
    n_res = len(built.split.residuals)
    cts = (jnp.ones((), dt), jnp.full((6, 3), 0.5, dt))

    def split(x, w):
        outs = fwd(x, w, k)
        return outs[:-n_res], bwd(*outs[-n_res:], *cts)

    def jax_s(x, w):
        outs, pullback = jax.vjp(lambda x, w: f(x, w, k), x, w)
        return list(outs), pullback(cts)

    def same(a, b):
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert u.dtype == v.dtype and np.array_equal(np.asarray(u, np.float64), np.asarray(v, np.float64),
                                                         equal_nan=True), (dtype, u, v)

    for wrap in (lambda g: g, jax.jit):
        same(wrap(split)(x, w), wrap(jax_s)(x, w))
        xs = jnp.stack([x, -x, jnp.zeros_like(x)])
        same(wrap(jax.vmap(split, in_axes=(0, None)))(xs, w), wrap(jax.vmap(jax_s, in_axes=(0, None)))(xs, w))


def test_decided_jointly_traces_and_prices_jax_s_split_once(monkeypatch):
    """Where a ``jointly`` rule fires (``rulesets.nn``'s LM head), ``decided_jointly`` builds three derivatives
    and prices each one's joint program once: JAX's split of the loss as written (``as_written_vjp``) is traced as
    the split runs it (``split_joint``) and priced as it is made, and that is the program and price the decision
    reads; it is not traced again as ``joint_program`` and priced beside it (3 prices and 2 VJP traces for the 3
    candidates, where there were 4 and 3: the plain forward's joint, and the loop's own, from which with it the
    other joint is spliced, ``grad.marks.spliced``). Its joint gives ``jax.vjp``'s outputs and gradients bit for
    bit."""
    import collections

    import rulesets
    import rewrite.grad.decide as decide
    import rewrite.grad.vjp as vjp
    from jax.extend.core import jaxpr_as_fun
    from rewrite.grad import together

    counts: collections.Counter = collections.Counter()

    def counting(name, f):
        def counted(*args, **kwargs):
            counts[name] += 1
            return f(*args, **kwargs)
        return counted

    monkeypatch.setattr(vjp, "program_cost", counting("priced", vjp.program_cost))  # as_written_vjp's
    monkeypatch.setattr(decide, "program_cost", counting("priced", decide.program_cost))  # each Joint's
    monkeypatch.setattr(vjp, "joint_program", counting("traced", vjp.joint_program))
    joints = []
    made = vjp.Joint.__init__

    def joint(self, *args, **kwargs):
        made(self, *args, **kwargs)
        joints.append(self)

    monkeypatch.setattr(vjp.Joint, "__init__", joint)
    # 512 tokens, V=4096: the forward takes the head's loop, priced cheaper (at V=2048 it is priced 5% slower in time
    # and the lean band no longer takes it for its memory; at 256 x 1024 its vocabulary tiles price above the logits)
    loss, (h, w, y) = lm_head_case(512, 128, 4096)

    built = rewrite(loss, rulesets=[rulesets.nn], cache=False).grad_result(h, w, y)
    # (the two rewritten are ordered by their joint extractions first, priced as their pipeline priced them:
    # grad/together.py's Pending; here both are split, the first not being taken over JAX's)
    joints = [j for j in joints if not isinstance(j.built, together.Pending)]
    assert built.decided and len(joints) == 3, (built.decided, [str(j) for j in joints])
    assert counts["priced"] == 3 and counts["traced"] == 2, counts
    written = [j for j in joints if j.built.as_written]
    assert len(written) == 1 and written[0].program is written[0].built.joint.before, joints
    assert written[0].cost == written[0].built.joint.cost_after == written[0].built.split.cost
    got = jaxpr_as_fun(written[0].program)(h, w, y, jnp.float32(0.75))
    outs, pullback = jax.vjp(lambda h, w: loss(h, w, y), h, w)
    for a, b in zip(got, [outs, *pullback(jnp.float32(0.75))]):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), (a, b)


def test_the_forward_without_its_jointly_rules_takes_the_forwards_input_tree(monkeypatch):
    """The forward without the ``jointly`` rules' nodes (``pipeline.plain_program``, ``Result.plain``) is extracted
    from a copy of the forward's snapshot without them, which takes the forward's tree pass over the input program's
    nodes (``extract.policy.same_original_tree``: the nodes they built are none of the input's): its extractor makes
    one pass, the unrestricted one (two before), and the program is the one its own pass gives."""
    import rulesets
    import rewrite.pipeline as pipeline
    from rewrite.ir.egraph import Snapshot
    from rewrite.jaxpr.trace import same_program

    copies, real = [], Snapshot.without

    def without(self, drop):
        copies.append(real(self, drop))
        return copies[-1]

    monkeypatch.setattr(Snapshot, "without", without)
    # 512 tokens, V=4096: the forward takes the head's loop (the test above), so its plain twin is extracted
    loss, (h, w, y) = lm_head_case(512, 128, 4096)
    g = rewrite(loss, rulesets=[rulesets.nn], cache=False)
    closed = jax.make_jaxpr(loss)(h, w, y)
    res = pipeline.run_pipeline(closed, g.entries, g.cost_model, g.limits, price_input=False, plain=True)
    assert res.jointly_chosen and res.plain is not None and len(copies) == 1, (res.jointly_chosen, len(copies))
    assert [e.passes for _, e in copies[0].extractors] == [1], [e.passes for _, e in copies[0].extractors]
    copies.clear()
    monkeypatch.setattr(pipeline, "same_original_tree", lambda *args: None)  # the copy's own pass, as before
    again = pipeline.run_pipeline(closed, g.entries, g.cost_model, g.limits, price_input=False, plain=True)
    assert [e.passes for _, e in copies[0].extractors] == [2], [e.passes for _, e in copies[0].extractors]
    assert same_program(again.plain, res.plain) and str(again.plain) == str(res.plain)


def test_the_forward_without_its_jointly_rules_is_not_searched_again(monkeypatch):
    """``pipeline.plain_program`` reads the forward without the ``jointly`` rules' nodes off without a whole-program
    search (``extract_by_policy(refine=False)``): its joint program's own pipeline searches again. No
    ``ProgramSearch`` runs while it is read, where the forward's own extraction is searched; and here the plain
    forward so read is the program the search would have left (it confirmed its start)."""
    import rulesets
    from rewrite import pipeline
    from rewrite.extract import search

    searches: list[bool] = []  # each search run: whether it was one of plain_program's
    inside, run, read_off = [False], search.ProgramSearch.run, pipeline.plain_program

    def counted(self, *args, **kwargs):
        searches.append(inside[0])
        return run(self, *args, **kwargs)

    def plain_program(*args, **kwargs):
        inside[0] = True
        try:
            return read_off(*args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(search.ProgramSearch, "run", counted)
    monkeypatch.setattr(pipeline, "plain_program", plain_program)
    loss, (h, w, y) = lm_head_case(512, 128, 4096)  # the forward takes the head's loop: its plain twin is read off
    g = rewrite(loss, rulesets=[rulesets.nn], cache=False)
    closed = jax.make_jaxpr(loss)(h, w, y)
    res = pipeline.run_pipeline(closed, g.entries, g.cost_model, g.limits, price_input=False, plain=True)
    assert res.jointly_chosen and res.plain is not None
    assert searches and not any(searches), searches
    by_policy = pipeline.extract_by_policy
    monkeypatch.setattr(pipeline, "extract_by_policy", lambda *a, **k: by_policy(*a, **{**k, "refine": True}))
    searches.clear()
    again = pipeline.run_pipeline(closed, g.entries, g.cost_model, g.limits, price_input=False, plain=True)
    assert any(searches), searches  # searched, as before this change
    assert str(again.plain) == str(res.plain) and again.plain_cost == res.plain_cost


def _count_plain_forwards(monkeypatch) -> list:
    """Every program ``rewrite.grad.vjp`` runs the pipeline on without the ``jointly`` rulesets (the forward rewritten
    again without them), appended to the list returned, as the pipeline is patched to record them."""
    import rewrite.grad.vjp as vjp

    run, plain = vjp.run_pipeline, []

    def counted(program, entries, *args, **kwargs):
        if not any(getattr(owner, "jointly", False) for _, owner in entries):  # the forward without them
            plain.append(program)
        return run(program, entries, *args, **kwargs)

    monkeypatch.setattr(vjp, "run_pipeline", counted)
    return plain


def test_a_jointly_rule_the_forward_does_not_choose_is_not_saturated_again(monkeypatch):
    """Where a ``jointly`` rule fired in the forward (``rulesets.nn``'s ``nn_lm_head_label`` on a small head) but the
    forward as chosen uses nothing it built (``Result.jointly_chosen``), the forward rewritten without the
    ``jointly`` rules is that forward: ``decided_jointly`` does not saturate it again, through
    ``jax.grad(rewrite(loss))`` nor in a training step's loss-first program, and decides as it did (JAX's
    derivative of the loss as written kept, against the derivative of that one forward). Saturated again, it is
    the same program: the shortcut is the second saturation's answer here, not a guess."""
    import rulesets
    import rewrite.grad.vjp as vjp
    from rewrite.jaxpr.trace import same_program

    run, plain = vjp.run_pipeline, _count_plain_forwards(monkeypatch)
    loss, (h, w, y) = lm_head_case(16, 32, 64)

    def step(h, w, y):
        value, grad = jax.value_and_grad(loss, argnums=1)(h, w, y)
        return value, w - 0.1 * grad

    g = rewrite(loss, rulesets=[rulesets.nn], cache=False)
    forward = g.result(h, w, y)
    assert forward.stats["nn_lm_head_label"].fired and forward.jointly_chosen == frozenset(), forward.jointly_chosen
    built = g.grad_result(h, w, y)
    assert built.decided.startswith("kept JAX's derivative of the loss as written"), built.decided
    assert "without" not in built.decided and plain == [], (built.decided, len(plain))
    rest = [(r, owner) for r, owner in g.entries if not owner.jointly]
    assert same_program(run(forward.before, rest, g.cost_model, g.limits).after, forward.after)
    stepped = rewrite(step, rulesets=[rulesets.nn], cache=False, whole_step=True).result(h, w, y)
    assert stepped.step.replaced and len(stepped.step.decided) == 1, str(stepped.step)
    assert stepped.step.decided[0].startswith("kept JAX's derivative of the loss as written"), stepped.step.decided
    assert plain == [], len(plain)


def test_a_cached_forward_keeps_what_its_jointly_rules_chose(monkeypatch, tmp_path):
    """A forward read from the disk cache keeps ``Result.jointly_chosen`` (``rewrite/cache/store.py``), so that
    ``jax.grad`` of it does not saturate the forward without the ``jointly`` rules again where a fresh forward does
    not (the case of the test above), and builds the same derivative. An entry whose field does not read as the
    names of rules that fired is not taken at its word: the set is unknown, and the forward is rewritten again."""
    import rulesets
    from rewrite.cache.store import DiskCache

    plain = _count_plain_forwards(monkeypatch)
    loss, (h, w, y) = lm_head_case(16, 32, 64)
    fresh = rewrite(loss, rulesets=[rulesets.nn], cache=tmp_path)
    assert fresh.result(h, w, y).cached is None and fresh.result(h, w, y).jointly_chosen == frozenset()
    want = fresh.grad_result(h, w, y)
    assert plain == [], len(plain)
    loaded = rewrite(loss, rulesets=[rulesets.nn], cache=tmp_path)
    forward = loaded.result(h, w, y)
    assert forward.cached is not None and forward.jointly_chosen == frozenset(), forward.jointly_chosen
    got = loaded.grad_result(h, w, y)
    assert plain == [] and got.decided == want.decided, (len(plain), got.decided, want.decided)
    assert str(got.fwd) == str(want.fwd) and str(got.bwd) == str(want.bwd)

    (path,) = sorted(tmp_path.rglob("*.rwx"))
    cache = DiskCache(tmp_path)
    for bad in (["no_such_rule"], "nn_lm_head_label", [1]):
        header, blob = cache.read(path.stem)
        header["meta"]["jointly_chosen"] = bad
        cache.write(path.stem, header, blob)  # a valid checksum: only the field is wrong
        again = rewrite(loss, rulesets=[rulesets.nn], cache=tmp_path)
        assert again.result(h, w, y).cached is not None and again.result(h, w, y).jointly_chosen is None, bad
        plain.clear()
        built = again.grad_result(h, w, y)
        assert len(plain) == 1 and built.decided == want.decided, (bad, len(plain), built.decided)
        assert str(built.fwd) == str(want.fwd) and str(built.bwd) == str(want.bwd)


def test_a_gradients_extraction_that_chooses_the_joint_s_program_is_not_searched_again(monkeypatch):
    """``build_vjp`` searches a split of two extractions, the joint one and the gradients' alone; where the second
    chooses the same node in every class the first's program uses (``grad.vjp.same_choice``: the seed's VJP under
    ``rulesets.algebra``), its splits are the first's at the same prices, so the residual search runs once and both
    are listed as priced. The split kept is the joint's, as the first of a tie, and the gradients are JAX's. (Under
    ``derivatives`` the two differ here: pulling ``a**-2`` out of a's sum saves more than ``derivatives_sums``'
    floor of the gradients' program alone, and less than it of the joint one.)"""
    import rewrite.grad.vjp as vjp

    searches = []
    search = vjp.choose_residuals

    def counted(*args, **kwargs):
        searches.append(args[1])
        return search(*args, **kwargs)

    monkeypatch.setattr(vjp, "choose_residuals", counted)
    r = rewrite(seed, rulesets=[algebra], cache=False)
    built = r.grad_result(X, A)
    assert len(searches) == 1, len(searches)
    joint = [s for s in built.splits_considered if s.policy.startswith("joint:")]
    grads = [s for s in built.splits_considered if s.policy.startswith("gradients:")]
    assert joint and [(s.policy[6:], s.cost, s.residuals) for s in joint] == [
        (s.policy[10:], s.cost, s.residuals) for s in grads], built.splits_considered
    assert built.split.policy.startswith("joint:") and built.split.cost == min(s.cost for s in joint)
    _close(jax.grad(lambda x, a: r(x, a).sum(), argnums=(0, 1))(X, A),
           jax.grad(lambda x, a: seed(x, a).sum(), argnums=(0, 1))(X, A))


# ---------------------------------------------------------------------- a split chosen as jit runs it (grad/uses.py)
def _every_pack_but_fastmath():
    """Every pack but fastmath, ``derivatives`` without its kernel (``without_kernels``): where the model takes
    ``trig_sin2_over``'s kernel (here since ``kernel_serial``), its ``grad a`` is within the pack's tolerance, not
    bit for bit, and ``tests/test_sin_squared.py`` checks it; these tests read the stored ``sin``'s split."""
    import rulesets

    return [without_kernels(rulesets.derivatives) if p == "derivatives" else getattr(rulesets, p)
            for p in ("algebra", "derivatives", "scan", "linalg", "nn", "attention")]


def test_jax_vjp_of_seed_000_computes_two_transcendentals_an_element_where_jax_s_computes_three():
    """Issue 50's seed 000 under every pack but fastmath: ``sin`` stored as a ``select`` (``trig_sin_stored``) is
    stored once by XLA for the gradients, where JAX's VJP stores ``sin`` for the reduction and computes it again
    beside ``cos``; with the primal output too, that output reads ``sin`` as written, where the ``select`` would be
    copied into its loop. So ``jax.vjp``'s pullback under ``jit`` computes 2 transcendentals an element (JAX: 3),
    a training step 3 (JAX: 4), holding no more temporaries, bit for bit JAX's results, special values included.
    At arrays of 2 MiB, past the lean band's 1 MiB (``extract.lean.LEAN_BYTES``)."""
    shape = (32, 256, 64)
    x = jnp.linspace(-4.0, 4.0, int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
    special = jnp.asarray([0.0, -0.0, 1e-45, -1e-45, 1.2e-38, 3e38, -3e38, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    x = x.at[0, 0, :10].set(special)
    a, g = jnp.linspace(0.5, 2.0, shape[-1]), jnp.cos(x * 3.0)
    f = rewrite(seed, rulesets=_every_pack_but_fastmath(), cache=False)

    def grads(fn):
        return lambda x, a, g: jax.vjp(fn, x, a)[1](g)

    def step(fn):
        return lambda x, a, g: (lambda out, pullback: (out, *pullback(g)))(*jax.vjp(fn, x, a))

    n = x.size
    for use, (ours_per, jax_per) in ((grads, (2, 3)), (step, (3, 4))):
        ours, theirs = (jax.jit(use(fn)).lower(x, a, g).compile() for fn in (f, seed))
        assert ours.cost_analysis()["transcendentals"] == ours_per * n, use.__name__
        assert theirs.cost_analysis()["transcendentals"] == jax_per * n, use.__name__
        assert ours.memory_analysis().temp_size_in_bytes <= theirs.memory_analysis().temp_size_in_bytes, use.__name__
        for p, q in zip(jax.jit(use(f))(x, a, g), jax.jit(use(seed))(x, a, g)):
            assert np.array_equal(np.asarray(p).view(np.uint32), np.asarray(q).view(np.uint32)), use.__name__
    assert f.grad_result(x, a).split.policy.startswith("joint+gradients:")


@pytest.mark.filterwarnings("ignore::rewrite.testing.VacuousCheckWarning")  # the forward is unchanged: its VJP is not
def test_seed_000_s_split_of_two_extractions_keeps_jax_s_gradients_on_drawn_inputs():
    """The split that computes the outputs as the joint extraction does and the gradients as their own extraction
    does (``grad/uses.py``), on drawn inputs and cotangents, within ``derivatives``' tolerance. (In float64 and
    the half types the model prices the stored ``sin`` no lower here, and the joint extraction's split is kept.)"""
    from rewrite.testing import assert_equivalent

    x, a = jnp.ones((8, 64, 64)), jnp.ones(64)
    policy = rewrite(seed, rulesets=[DERIVATIVES], cache=False).grad_result(x, a).split.policy
    assert policy.startswith("joint+gradients:"), policy
    assert_equivalent(seed, x, a, rulesets=[DERIVATIVES], grads=True, max_examples=25)


def test_the_splits_uses_are_priced_in_one_load_at_the_floats_each_has_alone(monkeypatch):
    """The splits' training steps and gradients alone (``uses.uses_prices``) are priced in one load
    (``pipeline.programs_cost``: one e-graph borrowed, the forward they all compute loaded once; a pool's borrow and
    return were a quarter of a small gradient's residual search), each at the float ``program_cost`` gives it
    alone and each once (two splits share their gradients alone), so the split chosen and its programs are the
    same."""
    from rewrite import pipeline
    from rewrite.grad import uses
    from rewrite.jaxpr.trace import same_program

    together_cost, alone_cost, run_uses = uses.programs_cost, pipeline.program_cost, uses.run_uses
    batches, pairs = [], []

    def spied(programs, model):
        prices = together_cost(programs, model)
        batches.append((list(programs), model, prices))
        return prices

    def recorded(train, alone, value):
        pairs.append(run_uses(train, alone, value)[:1 if value is not None else 2])
        return run_uses(train, alone, value)

    monkeypatch.setattr(uses, "programs_cost", spied)
    monkeypatch.setattr(uses, "run_uses", recorded)
    x, a = jnp.linspace(-3.0, 3.0, 8 * 64 * 64).reshape(8, 64, 64), jnp.linspace(0.5, 2.0, 64)
    built = rewrite(seed, rulesets=_every_pack_but_fastmath(), cache=False).grad_result(x, a)
    loads = [b for b in batches if b[0]]
    assert len(pairs) >= 2 and any(len(ps) > 2 for ps, _, _ in loads)  # more than one split's uses in a load
    priced = [p for ps, _, _ in loads for p in ps]
    assert not any(same_program(p, q) for i, p in enumerate(priced) for q in priced[:i])  # each priced once
    assert all(any(same_program(p, q) for q in priced) for pair in pairs for p in pair)  # every use priced
    for programs, model, prices in loads:
        assert prices == [pipeline.program_cost(p, model) for p in programs]  # bit for bit
    monkeypatch.setattr(uses, "programs_cost", lambda ps, m: [alone_cost(p, m) for p in ps])
    again = rewrite(seed, rulesets=_every_pack_but_fastmath(), cache=False).grad_result(x, a)
    assert again.split.policy == built.split.policy
    assert str(again.fwd) == str(built.fwd) and str(again.bwd) == str(built.bwd)


def test_a_joint_s_programs_are_priced_in_one_load_at_the_floats_each_has_alone(monkeypatch):
    """The programs a caller of both halves may run (``uses.joint_as_run``: the joint extraction, the gradients',
    and the outputs of the one with the gradients of the other), each in the uses that run, are priced in one load
    (``pipeline.programs_cost``), not one load a program: each at the float ``program_cost`` gives it alone, so the
    program chosen is the one pricing each alone chooses."""
    from rewrite import pipeline
    from rewrite.grad import uses, vjp

    together_cost, alone_cost = uses.programs_cost, pipeline.program_cost
    batches = []

    def spied(programs, model):
        prices = together_cost(programs, model)
        batches.append((list(programs), model, prices))
        return prices

    monkeypatch.setattr(uses, "programs_cost", spied)
    x, a = jnp.linspace(-3.0, 3.0, 8 * 64 * 64).reshape(8, 64, 64), jnp.linspace(0.5, 2.0, 64)
    g = rewrite(seed, rulesets=_every_pack_but_fastmath(), cache=False)
    closed = jax.make_jaxpr(seed)(x, a)
    program = vjp.rewrite_joint(closed, g.entries, g.cost_model, g.limits)  # both uses weighted alike
    loads = [b for b in batches if b[0]]
    assert len(loads) == 1 and len(loads[0][0]) >= 4, [len(b[0]) for b in loads]  # two programs' uses, or more
    for programs, model, prices in loads:
        assert prices == [pipeline.program_cost(p, model) for p in programs]  # bit for bit
    monkeypatch.setattr(uses, "programs_cost", lambda ps, m: [alone_cost(p, m) for p in ps])
    again = vjp.rewrite_joint(closed, g.entries, g.cost_model, g.limits)
    assert str(again) == str(program)


def test_a_split_s_gradients_alone_are_its_training_step_without_the_outputs_not_traced_again(monkeypatch):
    """``uses.uses_prices`` traces each split's training step once and reads its gradients alone off it (the outputs
    and what only they read dropped: ``uses.without_outputs``), the program JAX's trace of the gradients alone
    is: the same text and constants, so the same prices and the same split."""
    from rewrite.grad import uses
    from rewrite.jaxpr.trace import same_program

    traced, wanted, got = [], [], []
    inlined, priced_uses = uses.inlined, uses.priced_uses

    def counted(fwd, bwd, n_res, outputs=True):
        traced.append(outputs)
        if outputs:
            wanted.append(inlined(fwd, bwd, n_res, outputs=False))  # as traced alone
        return inlined(fwd, bwd, n_res, outputs)

    def read(train, alone, model, seen, value=None):
        got.append(alone)
        return priced_uses(train, alone, model, seen, value)

    monkeypatch.setattr(uses, "inlined", counted)
    monkeypatch.setattr(uses, "priced_uses", read)
    x, a = jnp.linspace(-3.0, 3.0, 8 * 64 * 64).reshape(8, 64, 64), jnp.linspace(0.5, 2.0, 64)
    rewrite(seed, rulesets=_every_pack_but_fastmath(), cache=False).grad_result(x, a)
    assert traced and all(traced) and len(got) == len(wanted) == len(traced)
    assert all(same_program(g, w) for g, w in zip(got, wanted))


def test_a_split_s_training_step_is_the_forward_s_ops_priced_at_the_split_s_outputs(monkeypatch):
    """The residual search's price of a split (``grad.vjp.split_pricer``) builds the forward's program once: each
    split's training step is its ops at that split's outputs, their kernels priced once (``cost.program``'s
    ``remembered_kernel``). Every price is the float main's pricer made building the three programs afresh."""
    import rewrite.grad.vjp as vjp
    from rewrite.cost.program import Program
    from rewrite.extract.program import ProgramPricer

    built, prices, inside = [], [], [False]
    from_choice = Program.from_choice.__func__

    def counted(cls, *args, **kwargs):
        if inside[0]:
            built.append(args[2])
        return from_choice(cls, *args, **kwargs)

    def afresh(snap, model, choice, f_roots, b_roots, residuals):
        ex = vjp.shared(snap, model)
        pricer = ProgramPricer(ex, model)
        templates = pricer.templates(choice, f_roots)

        def program(roots, inputs=frozenset()):
            return pricer.price(from_choice(Program, ex, choice, roots, lambda c, nd: pricer.own(c, nd, choice),
                                            templates, inputs=inputs))
        alone = program(list(residuals)) if residuals else 0.0
        return program(list(f_roots) + list(residuals)) + alone + 2 * program(b_roots, frozenset(residuals))

    split_pricer = vjp.split_pricer

    def checked(snap, model, choice, f_roots, b_roots):
        price = split_pricer(snap, model, choice, f_roots, b_roots)

        def priced(residuals):
            inside[0] = True
            cost = price(residuals)
            inside[0] = False
            prices.append((cost, afresh(snap, model, choice, f_roots, b_roots, residuals)))
            return cost
        return priced

    monkeypatch.setattr(Program, "from_choice", classmethod(counted))
    monkeypatch.setattr(vjp, "split_pricer", checked)
    rewrite(seed, rulesets=[algebra], cache=False).grad_result(X, A)
    assert len(prices) >= 2 and all(a == b for a, b in prices), prices
    # per split: the backward and the residuals alone are built, not the training step (three, before)
    assert len(built) <= 2 * len(prices), (len(built), len(prices))


def test_a_split_s_backward_and_residuals_alone_keep_the_last_ones_kernel_prices_the_same_floats(monkeypatch):
    """The residual search prices a split's backward and its residuals alone as moves from the last ones it priced
    (``grad.vjp.split_pricer``): the kernels before the first op the two programs build apart keep their prices
    (``cost.program``'s ``shared_prefix``, ``prices_before``). Splits drawn at random (each a set of classes
    recomputed: ``frontier``), priced in turn by one pricer, are each the float of the three programs built and
    priced afresh; and some kernels' prices were kept."""
    import random

    import rewrite.grad.vjp as vjp
    from rewrite.cost import program as P
    from rewrite.extract.program import ProgramPricer

    def loss(x, w1, w2):
        h = jnp.tanh(x @ w1)
        return jnp.sum(jnp.sin(h @ w2) ** 2) + jnp.sum(jnp.exp(-h.mean(axis=-1)))

    x, w1, w2 = _rand(8, 16), _rand(16, 32, seed=1), _rand(32, 4, seed=2)
    searches = []
    split_pricer = vjp.split_pricer

    def recorded(snap, model, choice, f_roots, b_roots):
        searches.append((snap, model, choice, list(f_roots), list(b_roots)))
        return split_pricer(snap, model, choice, f_roots, b_roots)

    monkeypatch.setattr(vjp, "split_pricer", recorded)
    rewrite(loss, rulesets=[algebra], cache=False).grad_result(x, w1, w2)
    monkeypatch.setattr(vjp, "split_pricer", split_pricer)
    assert searches
    kept = []
    prices_before = P.prices_before
    monkeypatch.setattr(vjp, "prices_before", lambda prices, upto: kept.append(prices_before(prices, upto)) or kept[-1])

    def afresh(snap, model, choice, f_roots, b_roots, residuals):
        ex = vjp.shared(snap, model)
        pricer = ProgramPricer(ex, model)
        templates = pricer.templates(choice, f_roots)

        def program(roots, inputs=frozenset()):
            return pricer.price(P.Program.from_choice(ex, choice, roots, lambda c, nd: pricer.own(c, nd, choice),
                                                      templates, inputs=inputs))
        alone = program(list(residuals)) if residuals else 0.0
        return program(list(f_roots) + list(residuals)) + alone + 2 * program(b_roots, frozenset(residuals))

    draw = random.Random(0)
    priced = 0
    for snap, model, choice, f_roots, b_roots in searches:
        forward = vjp.scope_classes(snap, choice, f_roots)
        computed = sorted((c for c in forward if choice[c][0] not in ("Param", "Lit", "Const", "Tok")), key=str)
        price = vjp.split_pricer(snap, model, choice, f_roots, b_roots)
        for _ in range(24):
            expand = set(draw.sample(computed, draw.randint(0, len(computed))))
            residuals = vjp.frontier(snap, choice, b_roots, forward, expand=expand)
            assert price(residuals) == afresh(snap, model, choice, f_roots, b_roots, residuals), residuals
            priced += 1
    assert priced >= 24 and any(kept), [len(k) for k in kept]


def test_the_residual_search_tries_at_most_twelve_recomputations():
    """The greedy descent over residuals (``choose_residuals``) stops after ``GREEDY_STEPS`` (12) trials, each a
    split priced whole: a measured decision (flax_seq2seq_grad's search priced 26 splits, about 11 ms each, for
    gains after the 12th trial of 0.21% of the predicted price together, its gradient's run time and temp memory
    the same). A chain of 16 layers has more candidates than that; its split is still the cheapest considered."""
    import collections

    def f(x, w):
        h = x
        for i in range(16):
            h = jnp.tanh(h * w[i]) + h
        return h

    x, w = _rand(64, 64), _rand(16, 64, 64, seed=1)
    r = rewrite(f, rulesets=[derivatives], vjp=True, cache=False)
    res = r.result(x, w)
    greedy = collections.Counter(s.policy.split(":")[0] for s in res.splits_considered if s.policy.endswith("greedy"))
    assert greedy and set(greedy.values()) == {12}, greedy
    assert res.split.cost == min(s.cost for s in res.splits_considered)
    # the split just read, not a second instance's search of the same
    _close(jax.grad(lambda x, w: r(x, w).sum(), (0, 1))(x, w), jax.grad(lambda x, w: f(x, w).sum(), (0, 1))(x, w))


def test_a_vjp_held_to_jax_s_is_kept_where_only_one_schedule_predicts_it_holds_more():
    """Ising's free energy (``benchmarks/derivatives.py``) under ``jax.vjp(rewrite(f))`` with every pack but
    fastmath: no ``jointly`` rule fires, so the VJP of the forward rewritten is held to JAX's as written
    (``grad.decide.held_alone``). It is priced below JAX's; the model reads it as holding more in the order XLA's
    fusion pass made the kernels (4.0 MiB against 2.0) but not in that of XLA's lists of users (4.0 against 4.0), and
    XLA holds it in 4.0 MiB against JAX's 6.0. So it is kept, with JAX's values, holding less than JAX's VJP."""
    from benchmarks.decisions import packs
    from benchmarks.derivatives import inputs, ising

    x, a, g = inputs(256)
    f = rewrite(ising, rulesets=packs(), cache=False)
    decided = f.grad_result(x, a).decided
    assert decided.startswith("kept the forward rewritten") and "one order" in decided, decided

    def vjp_of(fn):
        return jax.jit(lambda x, a, g: (lambda y, pull: (y,) + pull(g))(*jax.vjp(fn, x, a)))

    temp = [vjp_of(fn).lower(x, a, g).compile().memory_analysis().temp_size_in_bytes for fn in (f, ising)]
    assert temp[0] < temp[1], temp
    for got, want in zip(vjp_of(f)(x, a, g), vjp_of(ising)(x, a, g)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)
