"""The two joint programs of a whole step's loss (``rewrite/grad/together.py``): saturated in one e-graph for at most
``JOINT_ITERATIONS`` iterations, which leaves the step's program as the saturated joints give it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import ecosystem as eco
from benchmarks import wholestep as ws
from benchmarks.overhead import load_rulesets
from rewrite import pipeline, rewrite
from rewrite.grad import together
from .corpus import spy_joint_programs


def _spy_decisions(monkeypatch) -> tuple[list, list]:
    """``(built, why)``, filled as a step is rewritten: the notes of the ``Alone`` joints built, and the decisions'
    reasons in words (``api.decided_jointly``)."""
    import rewrite.api as api

    built: list = []
    build = together.Alone.build
    monkeypatch.setattr(together.Alone, "build", lambda self: built.append(self.note) or build(self))
    why: list = []
    decided_jointly = api.decided_jointly
    monkeypatch.setattr(api, "decided_jointly", lambda *a, **k: (lambda out: why.append(out[1]) or out)(
        decided_jointly(*a, **k)))
    return built, why


def _count_joints(monkeypatch) -> list:
    """``pipeline.run_together`` spied on: the list it fills with each run's (iterations, stop reason)."""
    ran: list = []
    run = pipeline.run_together

    def counted(*args, **kwargs):
        results = run(*args, **kwargs)
        ran.append((results[0].iterations, results[0].stopped))
        return results

    monkeypatch.setattr(pipeline, "run_together", counted)
    return ran


def _step_program(monkeypatch, bound: int, run: bool = True) -> tuple[str, list, object]:
    """A small linen GPT's training step rewritten whole (the LM head's ``jointly`` rules fire in its loss's forward,
    so its two joint programs are saturated together) with the ecosystem suite's rules (``benchmarks.rewrite_time``),
    the joints bounded at ``bound`` iterations: the step's
    program as text, the joints' (iterations, stop reason), and (``run``; else None) the rewritten step's outputs at
    its arguments, run op by op, with the step's as written."""
    monkeypatch.setattr(together, "JOINT_ITERATIONS", bound)
    ran = _count_joints(monkeypatch)
    flat, leaves = ws._flat(*ws.CASES["linen_gpt"](_SIZE, ws.plain, opt=optax.sgd(0.1)))
    r = rewrite(flat, rulesets=load_rulesets(eco.CONFIGS["identity"]), whole_step=True, cache=False)
    return str(r.jaxpr(*leaves)), ran, (r(*leaves), _step_as_written()) if run else None


#: the small linen GPT's size (:func:`_step_program`)
_SIZE = ws.Size(batch=2, length=128, width=64, heads=2, vocab=1024)


@functools.lru_cache(maxsize=None)
def _step_as_written() -> list:
    """The outputs of :func:`_step_program`'s step as written at its arguments, under ``jax.jit`` (one compilation,
    where op by op compiled each of its primitives: 2.2 against 5.1 CPU s): the same in each of the calls that run
    it (its parameters are drawn from fixed keys), so run once a run. (The step is built afresh for each rewrite, as
    before: the tests count what its rewrite traces, loads and saturates.)"""
    flat, leaves = ws._flat(*ws.CASES["linen_gpt"](_SIZE, ws.plain, opt=optax.sgd(0.1)))
    return jax.jit(flat)(*leaves)


def test_the_joints_are_bounded_and_the_step_is_what_saturation_gives(monkeypatch):
    """Bounded, the joints stop at ``JOINT_ITERATIONS``; saturated (a bound above what they take) they run longer, and
    the step's program is the same text either way; its values are the step's as written."""
    bound = together.JOINT_ITERATIONS
    bounded, ran, (got, want) = _step_program(monkeypatch, bound)
    assert ran and all(it <= bound for it, _ in ran), ran
    saturated, ran_all, _ = _step_program(monkeypatch, 1000, run=False)  # the same text: its values are those above
    assert ran_all and max(it for it, _ in ran_all) > bound, ran_all
    assert all(stopped == "saturated" for _, stopped in ran_all), ran_all
    assert bounded == saturated
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-4, atol=2e-5)


def _gradient_program(monkeypatch, bound: int, run: bool = True) -> tuple[str, list, list, list]:
    """A small flax encoder-decoder's ``jax.grad(rewrite(loss))`` (the LM head's ``jointly`` rules fire in its forward,
    so :func:`rewrite.grad.together.build_vjps` saturates its two joint programs together) with the ecosystem suite's
    rules, the joints bounded at ``bound`` iterations: the VJP's forward and backward as text, the joints' (iterations,
    stop reason), and (``run``; else None, None: two gradient programs fewer to compile) the gradients and JAX's."""
    monkeypatch.setattr(together, "VJPS_ITERATIONS", bound)
    ran = _count_joints(monkeypatch)
    loss, args = eco.flax_seq2seq_loss(nq=64, nk=256, width=32, heads=2, vocab=512, batch=1)
    flat, leaves = eco._flat(loss, args)
    r = rewrite(flat, rulesets=load_rulesets(eco.CONFIGS["identity"]), cache=False)
    built = r.grad_result(*leaves)
    if not run:
        return f"{built.fwd}\n{built.bwd}", ran, None, None
    got = jax.jit(eco.gradient(r, leaves))(*leaves)
    return f"{built.fwd}\n{built.bwd}", ran, list(got), list(jax.jit(eco.gradient(flat, leaves))(*leaves))


def test_a_gradients_joints_are_bounded_and_its_vjp_is_what_saturation_gives(monkeypatch):
    """``jax.grad(rewrite(loss))``'s two joint programs (``build_vjps``) stop at ``VJPS_ITERATIONS``; saturated they
    run longer (10 iterations here), and the VJP's forward and backward are the same text either way; the gradients
    are JAX's."""
    bound = together.VJPS_ITERATIONS
    bounded, ran, got, want = _gradient_program(monkeypatch, bound)
    assert ran and all(it <= bound for it, _ in ran), ran
    saturated, ran_all, _, _ = _gradient_program(monkeypatch, 1000, run=False)  # the same VJP: its values above
    assert ran_all and max(it for it, _ in ran_all) > bound, ran_all
    assert all(stopped == "saturated" for _, stopped in ran_all), ran_all
    assert bounded == saturated
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-4, atol=2e-5)


def test_a_step_that_reads_its_loss_takes_the_joint_extraction_alone(monkeypatch):
    """A training step that reads its loss runs each joint program whole, as its joint extraction priced it, so the
    gradients are not extracted apart (``vjp._joint_choices`` with ``value`` true: no ``extract_by_policy`` of the
    gradients' roots); the step's values are the step's as written. Main extracted them twice a step, 0.1-0.35 s of
    a heavy step's rewrite, and the program so made was kept in one of the 24 ecosystem programs (0.2% cheaper)."""
    from rewrite.grad import vjp

    apart: list = []
    extract_by_policy = vjp.extract_by_policy

    def spied(*args, **kwargs):
        apart.append(args[3])
        return extract_by_policy(*args, **kwargs)

    monkeypatch.setattr(vjp, "extract_by_policy", spied)
    read: list = []
    choices = vjp._joint_choices
    monkeypatch.setattr(vjp, "_joint_choices", lambda *a, **k: read.append(a[5:] or k) or choices(*a, **k))
    _, ran, (got, want) = _step_program(monkeypatch, together.JOINT_ITERATIONS)
    assert ran and read and all(v == (True,) for v in read), read  # the step's joints, each asked with value=True
    assert not apart, len(apart)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-4, atol=2e-5)


def test_a_forward_that_is_the_loss_as_written_is_not_traced_again(monkeypatch):
    """The forward rewritten without the LM head's ``jointly`` rules is the loss as written in wholestep_linen_gpt (as
    in flax_lm_step and wholestep_equinox_gpt): its joint program is the one the proof's re-derivation traced
    (``grad.step.rederive``), not traced again for the two joints' e-graph (``vjp.joint_at``); main traced it twice,
    0.16-0.19 s of those steps' first call (the forward is the loss's program itself, ``plain_program``'s input kept).
    Each program's joint is traced once, and the step's program is the text it is where each is traced anew."""
    traced, spied = spy_joint_programs(monkeypatch)
    flat, leaves = eco._flat(*eco.PROGRAMS["wholestep_linen_gpt"].build())

    def program() -> str:
        return str(rewrite(flat, rulesets=load_rulesets(eco.CONFIGS["identity"]), whole_step=True,
                           cache=False).jaxpr(*leaves))

    reused = program()
    assert len(traced) == 2, [len(t) for t, _ in traced]  # the loss as written, the forward with the rules
    assert len(set(traced)) == len(traced)
    traced.clear()
    import rewrite.api as api

    monkeypatch.setattr(api, "joint_at", lambda closed, wrt=None, written=None: spied(closed, wrt)[0])  # all anew
    assert program() == reused
    assert len(traced) == 4 and len(set(traced)) == 2, [len(t) for t, _ in traced]


def test_a_gradients_two_derivatives_are_split_only_where_the_choice_reaches_them(monkeypatch):
    """``jax.grad(rewrite(loss))`` where the LM head's ``jointly`` rules fire: ``build_vjps`` saturates the two joint
    programs together and returns them unsplit (``Pending``); ``decided_jointly`` orders them by their joint
    extractions and searches the residuals of the one it holds to JAX's derivative first, the other only where that
    one is not taken. Where the first is kept (V=8192: the head's loop) one split is searched, not two, and the VJP and
    the decision in words are what splitting both gives; where JAX's is kept (V=4096), both are split, as before."""
    import rulesets
    import rewrite.grad.primitive as primitive
    from tests.corpus import lm_head_case

    searched: list = []
    split = together._vjp_of

    def counted(*args, **kwargs):
        searched.append(1)
        return split(*args, **kwargs)

    monkeypatch.setattr(together, "_vjp_of", counted)
    eager = primitive.build_vjps

    def built(case: tuple, lazy: bool) -> tuple:
        searched.clear()
        monkeypatch.setattr(primitive, "build_vjps", eager if lazy else (
            lambda *args, lazy=False, **kwargs: eager(*args, **kwargs)))
        loss, (h, w, y) = lm_head_case(*case)
        made = rewrite(loss, rulesets=[rulesets.nn], cache=False).grad_result(h, w, y)
        return str(made.fwd), str(made.bwd), made.decided, len(searched)

    for case, kept, splits in (((1024, 128, 8192), "kept the forward rewritten with", 1),
                               ((512, 128, 4096), "kept JAX's derivative", 2)):
        got, want = built(case, True), built(case, False)
        assert got[2].startswith(kept), got[2]
        assert got[:3] == want[:3], (case, got[2], want[2])
        assert (got[3], want[3]) == (splits, 2), (case, got[3], want[3])


def test_a_gradients_plain_forward_that_is_the_loss_as_written_is_traced_and_loaded_once(monkeypatch):
    """``jax.grad(rewrite(loss))`` where the forward without the ``jointly`` rules is the loss as written (here no
    other rule: flax_seq2seq_grad's plain forward comes out as written too): its joint program is JAX's as written,
    which ``as_written_vjp`` traces for the decision (the same text as ``joint_program``'s), so ``build_vjps`` loads
    that program rather than tracing it again, and its price is ``run_together``'s of it as loaded rather than a load
    of its own (``program_cost``). One VJP trace of ``joint_program`` (the forward with the rules') where there were
    two, one e-graph load fewer; the VJP, the decision in words and the prices are those of the joint traced and
    priced anew (the as-written joint's price the same float both ways)."""
    import rewrite.grad.primitive as primitive
    from jax.extend.core import jaxpr_as_fun
    from rewrite.cost.measure import resolve
    from rewrite.grad import vjp
    from rewrite.records import Limits
    from rulesets.nn_lm_head import nn_lm_head
    from tests.corpus import lm_head_case

    counts = {"traced": 0, "loaded": 0}
    joint_program, load = vjp.joint_program, pipeline._load

    def traced(*args, **kwargs):
        counts["traced"] += 1
        return joint_program(*args, **kwargs)

    def loaded(*args, **kwargs):
        counts["loaded"] += 1
        return load(*args, **kwargs)

    monkeypatch.setattr(vjp, "joint_program", traced)
    monkeypatch.setattr(pipeline, "_load", loaded)
    written_as = primitive.written_as
    made = vjp.as_written_vjp
    prices: list = []

    def as_written(*args, **kwargs):
        built = made(*args, **kwargs)
        prices.append(built)
        return built

    monkeypatch.setattr(primitive, "as_written_vjp", as_written)

    def built(known: bool) -> tuple:
        for k in counts:
            counts[k] = 0
        prices.clear()
        monkeypatch.setattr(primitive, "written_as", written_as if known else lambda program, closed: False)
        made = rewrite(loss, rulesets=[nn_lm_head], cache=False).grad_result(h, w, y)
        (aw,) = prices
        return str(made.fwd), str(made.bwd), made.decided, dict(counts), (aw.split.cost, aw.joint.cost_before)

    # an LM head's loss as the pipeline emits it (optax's nested jits inlined), so that the plain forward (no rule)
    # comes out as the loss's own text, as flax_seq2seq_grad's does
    written, (h, w, y) = lm_head_case(1024, 128, 8192)
    inlined = pipeline.run_pipeline(jax.make_jaxpr(written)(h, w, y), [], resolve(None), Limits(),
                                    price_input=False).after
    loss = lambda h, w, y: jaxpr_as_fun(inlined)(h, w, y)[0]  # noqa: E731
    got, want = built(True), built(False)
    assert got[2] and got[:3] == want[:3], (got[2], want[2])
    # the forward's joint traced alone (JAX's as written is traced by as_written_vjp, not joint_program); traced
    # anew, the plain forward's joint and the loop's own, the other joint spliced from them (grad.marks.spliced)
    assert (got[3]["traced"], want[3]["traced"]) == (1, 2), (got[3], want[3])
    assert got[3]["loaded"] == want[3]["loaded"] - 1, (got[3], want[3])  # as_written_vjp's program_cost
    assert got[4] == want[4] and got[4][0] == got[4][0], (got[4], want[4])


def _negations_between_reshapes(closed) -> int:
    """How many ``neg`` equations of ``closed`` (top level) read a ``reshape``'s result and are read by one."""
    made = {id(v): e.primitive.name for e in closed.jaxpr.eqns for v in e.outvars}
    read_by: dict = {}
    for e in closed.jaxpr.eqns:
        for v in e.invars:
            read_by.setdefault(id(v), []).append(e.primitive.name)
    return sum(1 for e in closed.jaxpr.eqns if e.primitive.name == "neg"
               and made.get(id(e.invars[0])) == "reshape" and "reshape" in read_by.get(id(e.outvars[0]), ()))


def test_a_gradients_joints_stop_before_an_iteration_that_buys_only_reshapes(monkeypatch):
    """``VJPS_ITERATIONS`` (3; 4 before): flax_seq2seq_grad's joints' fifth iteration (1,181 of 16,912 rows, about a
    tenth of their saturation's CPU s) bought only a negation put between two reshapes in the VJP's backward, six
    reshapes that XLA removes (the compiled gradient's instructions and temp memory the same, its run time 1.004x
    against an A/A of 1.0125x); bounded at 3 or 4 the backward negates without them."""
    ran = _count_joints(monkeypatch)
    fn, args = eco.PROGRAMS["flax_seq2seq_grad"].build()
    flat, leaves = eco._flat(fn, args)
    built = rewrite(flat, rulesets=load_rulesets(eco.CONFIGS["identity"]), cache=False).grad_result(*leaves)
    assert ran and all(it <= together.VJPS_ITERATIONS for it, _ in ran), ran
    assert _negations_between_reshapes(built.bwd) == 0


def test_the_joints_run_without_the_rules_that_cannot_cheapen_them(monkeypatch):
    """``together.joint_rules``: the joints are saturated without ``hoist_reductions`` (which in a joint copies JAX's
    backward loops around the backward's sums: never extracted on the corpus, a third of the whole steps' joint
    rows), without ``red_split`` (the backward's sums split one addition deeper a round: 9-17% of the whole steps'
    joint rows, which no joint's program took but wholestep_equinox_gpt's, then dearer) and without the attention
    pack (a blocked form recomputes weights the forward holds). A small linen GPT's step, whose joints the identity
    packs (all included) saturate: none is among the rules its joints ran, the other sums rules are, and the step's
    values are the step's as written."""
    ran_rules: list = []
    run = pipeline.run_together

    def spied(first, second, entries, *args, **kwargs):
        ran_rules.append({r.name for r, _ in entries})
        return run(first, second, entries, *args, **kwargs)

    monkeypatch.setattr(pipeline, "run_together", spied)
    packs = load_rulesets(eco.CONFIGS["identity"])
    names = {r.name for p in packs for r, _ in p.entries()}
    assert {"hoist_reductions", "attn_blocked", "attn_blocked_vp", "red_split", "red_pull", "sink_inputs"} <= names
    _, ran, (got, want) = _step_program(monkeypatch, together.JOINT_ITERATIONS)
    assert ran_rules and ran, (ran_rules, ran)
    for names in ran_rules:
        assert not names & {"hoist_reductions", "red_split", "attn_blocked", "attn_blocked_vp", "attn_blocked_wide",
                            "attn_blocked_wide_vp"}, names
        assert {"red_pull", "red_merge", "sink_inputs", "lift_independent"} <= names  # the rest run
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-4, atol=2e-5)


def test_the_joints_rules_leave_out_red_split_alone_of_the_sums_rules():
    """``together.joint_rules`` of the identity packs (what a whole step's joints and a gradient's, ``build_vjps``,
    are saturated with): ``red_split`` is left out, since in a joint it only grows the backward's split sums (rows no
    joint's program took but wholestep_equinox_gpt's, priced 0.38% dearer with them: ``JOINT_WITHOUT``), and the
    other rules of its ruleset (``red_merge``, ``red_pull``, which the GPT steps' joints take) and every rule not in
    ``JOINT_WITHOUT`` are kept, in their order."""
    entries = [e for p in load_rulesets(eco.CONFIGS["identity"]) for e in p.entries()]
    names = [r.name for r, _ in entries]
    assert "red_split" in names
    kept = [r.name for r, _ in together.joint_rules(entries)]
    assert "red_split" not in kept
    assert {"red_merge", "red_pull", "red_sum_neg", "red_neg_sum"} <= set(kept)
    assert kept == [n for n in names if n not in together.JOINT_WITHOUT]


def test_a_joint_that_saves_less_than_its_floor_is_left_as_loaded(monkeypatch):
    """Two programs rewritten together (as a step's two joint programs are) whose cheapest extraction takes
    ``linalg``'s reordered product for less than its floor (``min_saving``, 10%): each is left as loaded, and the
    program without the floored rules' nodes is not extracted (``extract.policy.floored``: flax_long_context_step's
    two joints, about a tenth of its rewrite), nor are the lean band's peaks read for a candidate so left
    (``extract.extract``'s ``floored``). The same program through ``run_pipeline``, or ``run_together`` without
    ``as_loaded`` (a VJP's two joints, whose split searches residuals over the extraction), extracts it again, and
    keeps the input too."""
    import jax.numpy as jnp
    import rulesets as packs
    from rewrite.extract import extract as extract_module, policy

    args = (jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.ones((64, 60)))
    first = jax.make_jaxpr(lambda a, b, c: (a @ b) @ c)(*args)
    second = jax.make_jaxpr(lambda a, b, c: ((a @ b) @ c) * 2.0)(*args)
    r = rewrite(lambda a, b, c: (a @ b) @ c, rulesets=[packs.linalg])
    seconds: list = []
    extract = policy.extract

    def counted(*a, **k):
        seconds.append(1)
        return extract(*a, **k)

    bands: list = []
    leanest = extract_module._leanest

    def banded(*a, **k):
        bands.append(1)
        return leanest(*a, **k)

    monkeypatch.setattr(policy, "extract", counted)
    monkeypatch.setattr(extract_module, "_leanest", banded)
    alone = pipeline.run_pipeline(first, r.entries, r.cost_model, r.limits, price_input=True)
    assert not alone.rewritten and len(seconds) == 1  # the floor declined the reorder: extracted without it
    assert bands  # the cheapest (the reorder) held to the lean band
    seconds.clear()
    bands.clear()
    apart = pipeline.run_together(first, second, r.entries, r.cost_model, r.limits, price_input=True)
    try:  # without ``as_loaded`` (a VJP's joint and gradients alone: build_vjps), each is extracted again
        assert len(seconds) == 2 and bands
        assert all(not res.rewritten for res in apart)
    finally:
        apart[0].egraph.release()
    seconds.clear()
    bands.clear()
    both = pipeline.run_together(first, second, r.entries, r.cost_model, r.limits, price_input=True, as_loaded=True)
    try:
        assert seconds == [] and bands == []
        for res, closed in zip(both, (first, second)):
            assert not res.rewritten and res.cost_after == res.cost_before
            assert str(res.after) == str(closed)
    finally:
        both[0].egraph.release()


def test_one_joint_is_built_alone_only_past_a_margin_wider_than_any_saturation_bought():
    """``decide.ONE_JOINT_MARGIN``: the plain joint can be kept over the one with the ``jointly`` rules where it comes
    out within the far lean band (0.2) above it, so the margin must leave room for the most a plain joint's saturation
    was measured to take off its input (wholestep_equinox_gpt: 15.9%). Under the golden table flax_lm_step's inputs
    are 23.4% apart (its plain joint's saturation took 14.0% off there): both are built; on the CPU table 35.3%."""
    import dataclasses

    from rewrite import AnalyticCost
    from rewrite.grad import decide

    model = AnalyticCost()
    assert (1 - decide.ONE_JOINT_MARGIN) * (1 + model.lean_band_far) <= 1 - 0.159, decide.ONE_JOINT_MARGIN
    assert not decide.one_joint_can_win(0.766, 1.0, model)
    assert not decide.one_joint_can_win(0.71, 1.0, model)
    assert decide.one_joint_can_win(0.647, 1.0, model)
    assert not decide.one_joint_can_win(0.647, 1.0, dataclasses.replace(model, lean_band_far=0.3))
    assert decide.one_joint_can_win(0.647, 1.0, dataclasses.replace(model, lean_band=0.0))  # no band: price alone
    measured = type("Measured", (), {"measures": True, "lean_band": 0.03, "lean_band_far": 0.2})()
    assert not decide.one_joint_can_win(0.1, 1.0, measured)


def _lm_step_decided(monkeypatch, margin: float) -> tuple[str, list, list, list]:
    """flax_lm_step rewritten whole under the golden table with ``ONE_JOINT_MARGIN`` at ``margin``: its program as
    text, the decision in words, the two joints' e-graphs (``run_together``) and the joints rewritten alone."""
    import json
    import pathlib

    from rewrite.cost.model import priced_with
    from rewrite.grad import decide

    monkeypatch.setattr(decide, "ONE_JOINT_MARGIN", margin)
    ran = _count_joints(monkeypatch)
    alone, why = _spy_decisions(monkeypatch)
    table = json.loads((pathlib.Path(__file__).parent / "golden" / "cost_table.json").read_text())
    flat, leaves = eco._flat(*eco.PROGRAMS["flax_lm_step"].build())
    with priced_with(table):
        program = str(rewrite(flat, rulesets=load_rulesets(eco.CONFIGS["identity"]), whole_step=True,
                              cache=False).jaxpr(*leaves))
    return program, why, ran, alone


def test_a_steps_joint_far_under_the_plain_one_is_built_alone(monkeypatch):
    """flax_lm_step's joint with the LM head's ``jointly`` rules is priced 23.4% under its plain joint as traced
    (the golden table): at the default margin both are saturated together; with the margin at 20% only that one is
    built and extracted (no ``run_together``; the plain one, which cannot be kept, is never rewritten), and the
    same joint is kept, priced alike: within 0.1%, since the pair leaves a joint whose extraction cannot clear its
    floors as loaded (``extract.policy.floored``) where ``run_pipeline`` alone keeps the program without the floored
    rules' nodes (9.752e7 against 9.755e7 as loaded)."""
    import re

    both, why_both, ran_both, alone_both = _lm_step_decided(monkeypatch, 0.3)
    assert len(ran_both) == 1 and not alone_both, (ran_both, alone_both)
    one, why_one, ran_one, alone_one = _lm_step_decided(monkeypatch, 0.2)
    assert not ran_one and alone_one == [" (its joint as traced)"], (ran_one, alone_one)
    kept = [re.match(r"kept (the forward rewritten with [^(]*)\(priced ([^,]*),", w[0]).groups() for w in (why_both,
                                                                                                          why_one)]
    assert kept[0][0] == kept[1][0], (why_both, why_one)
    assert abs(float(kept[0][1]) / float(kept[1][1]) - 1) < 1e-3, (why_both, why_one)


def test_the_plain_joint_built_alone_is_rewritten_only_where_the_other_is_not_kept():
    """``together.Alone`` under ``vjp.held_pending``: ordered by their inputs' prices, the one with the ``jointly``
    rules is rewritten first; the plain one only where that one is not taken against JAX's as written, and then
    held to it as the pair's would be."""
    from rewrite import AnalyticCost
    from rewrite.grad import vjp
    from rewrite.grad.decide import Joint

    model = AnalyticCost()
    progs = {k: jax.make_jaxpr(lambda x, k=k: x * float(k))(np.float32(1.0)) for k in range(5)}
    built: list = []

    def run(written_cost: float, out: dict[int, float]) -> tuple[str, list]:
        built.clear()
        priced = [(progs[2 + i], c) for i, c in out.items()] + [(progs[4], written_cost)]
        pending = [together.Alone(progs[i], c, lambda i=i: built.append(i) or progs[2 + i], note)
                   for i, c, note in ((0, 60.0, " (its joint as traced)"), (1, 100.0, " (not rewritten)"))]
        written = Joint("JAX's", progs[4], model, lambda b: b, priced)
        chosen, why = vjp.held_pending(pending, ["with", "without"], written, model, lambda b: b, priced)
        return chosen.name, list(built)

    assert run(80.0, {0: 55.0, 1: 70.0}) == ("with", [0])  # the first kept: the plain one never rewritten
    assert run(50.0, {0: 55.0, 1: 45.0}) == ("without", [0, 1])  # the first not kept: the plain one rewritten
    assert run(40.0, {0: 55.0, 1: 45.0}) == ("JAX's", [0, 1])


def test_a_steps_three_joints_are_priced_in_one_load_at_the_prices_each_has_alone(monkeypatch):
    """``decided_jointly``'s candidates (JAX's derivative as written and the two rewritten joints) are priced in one
    load (``decide.priced_joints``, ``pipeline.programs_cost``), not three: with no rule nothing merges, so each is
    priced the float ``program_cost`` gives it alone, and the step's program is the text it is so. Main loaded each
    afresh (wholestep_linen_gpt: 637, 529 and 494 equations, most of them shared)."""
    from rewrite.grad import decide, vjp

    batches: list = []
    alone: list = []
    together_cost, alone_cost = decide.programs_cost, decide.program_cost

    def spied(programs, model):
        prices = together_cost(programs, model)
        batches.append((list(programs), model, prices))
        return prices

    # The rewritten joints' prices as their pipeline gave them (``uses.joint_as_run``'s ``extracted``) withheld, so
    # that all three are unpriced, as where a rewritten joint is a split of two extractions, which no pipeline priced.
    as_run = vjp.joint_as_run
    monkeypatch.setattr(vjp, "joint_as_run", lambda *a, **k: as_run(*a[:10], **{**k, "extracted": None}))
    monkeypatch.setattr(decide, "programs_cost", spied)
    monkeypatch.setattr(decide, "program_cost", lambda p, m: alone.append(p) or alone_cost(p, m))
    text, ran, (got, want) = _step_program(monkeypatch, together.JOINT_ITERATIONS)
    assert ran and len(batches) == 1 and len(batches[0][0]) == 3, [len(b[0]) for b in batches]
    assert not alone, len(alone)  # no joint of the decision loaded alone
    programs, model, prices = batches[0]
    assert prices == [pipeline.program_cost(p, model) for p in programs]  # bit for bit
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-4, atol=2e-5)
    # each priced alone, as main did: the same step
    monkeypatch.setattr(decide, "programs_cost", lambda ps, m: [alone_cost(p, m) for p in ps])
    assert _step_program(monkeypatch, together.JOINT_ITERATIONS, run=False)[0] == text
    # programs of other inputs are priced alone
    other = jax.make_jaxpr(lambda x: x * 2.0)(np.ones(3, np.float32))
    assert pipeline.programs_cost([programs[0], other], model) == [pipeline.program_cost(programs[0], model),
                                                                    pipeline.program_cost(other, model)]

def test_a_steps_rewritten_joints_are_priced_as_their_pipeline_priced_them(monkeypatch):
    """``decided_jointly`` holds a step's two joints, rewritten in one e-graph (``pipeline.run_together``), to JAX's
    as written at the prices their pipeline gave the programs it extracted (``uses.joint_as_run`` puts each in ``seen``),
    not loaded and priced again (``program_cost``: 0.11 s each of flax_long_context_step's two). Only JAX's joint as
    written is priced afresh; the step's values are the step's as written."""
    from rewrite.grad import decide, vjp

    afterwards: list = []
    run = pipeline.run_together

    def spied_run(*args, **kwargs):
        results = run(*args, **kwargs)
        afterwards.extend(r.cost_after for r in results)
        return results

    priced: list = []
    program_cost = decide.program_cost
    monkeypatch.setattr(decide, "program_cost", lambda p, m: priced.append(len(p.jaxpr.eqns)) or program_cost(p, m))
    joints: list = []

    class Spy(decide.Joint):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            joints.append(self)

    monkeypatch.setattr(vjp, "Joint", Spy)
    monkeypatch.setattr(decide, "Joint", Spy)  # decide.priced_joints makes them too
    monkeypatch.setattr(pipeline, "run_together", spied_run)
    _, _, (got, want) = _step_program(monkeypatch, together.JOINT_ITERATIONS)
    rewritten = [j for j in joints if j.name.startswith("the forward rewritten")]
    assert len(afterwards) == 2 and len(rewritten) == 2, (afterwards, [j.name for j in joints])
    assert sorted(j.cost for j in rewritten) == sorted(afterwards)
    assert len(priced) == 1, priced  # JAX's joint as written alone
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-4, atol=2e-5)

def test_a_steps_joints_are_the_programs_their_pipeline_emitted_not_emitted_again(monkeypatch):
    """A step's two rewritten joints, each its joint extraction alone (the step reads its loss), are the programs
    their pipeline emitted (``Result.after``, the same objects: ``uses.joint_as_run``'s ``emitted``), not emitted again
    and their texts compared with the pipeline's (``same_program`` prints both); each is the text a fresh emission of
    its pipeline's choice makes (``vjp.as_emitted``), and the step's values are the step's as written."""
    from rewrite.grad import uses, vjp
    from rewrite.jaxpr.emit import emit

    made: list = []
    as_run = together._as_run

    def spied(res, *args, **kwargs):
        fresh = emit(res.snapshot, res.choice, res.egraph, res.before.in_avals, res.roots, None,
                     res.before.jaxpr.debug_info)
        got = as_run(res, *args, **kwargs)
        made.append((got, res.after, fresh, vjp.as_emitted(res)))
        return got

    compared: list = []
    same = uses.same_program
    monkeypatch.setattr(uses, "same_program", lambda a, b: compared.append(1) or same(a, b))
    monkeypatch.setattr(together, "_as_run", spied)
    _, _, (got, want) = _step_program(monkeypatch, together.JOINT_ITERATIONS)
    assert len(made) == 2, len(made)
    for program, after, fresh, emitted in made:
        assert emitted and program is after
        assert str(fresh.jaxpr) == str(after.jaxpr) and same(fresh, after)
    assert not compared, len(compared)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-4, atol=2e-5)

def test_a_forward_rewritten_for_its_vjp_reads_its_plain_forward_off_its_own_egraph(monkeypatch):
    """A loss rewritten for its VJP (``grad_result``, or called under ``jax.grad``: ``grad.primitive.differentiating``)
    whose forward uses the ``jointly`` rules' nodes reads the forward without them off its own saturated e-graph
    (``run_pipeline(plain=True)``), so ``decided_jointly`` does not saturate the loss a second time without them
    (flax_seq2seq_grad's plain forward pipeline, which finds nothing). The VJP and its decision are those of the
    plain forward saturated apart (here both the loss as written). A loss rewritten only to run (``result``) does not
    pay the plain forward's extraction."""
    import rewrite.api as api
    import rewrite.grad.primitive as primitive
    from jax.extend.core import jaxpr_as_fun
    from rewrite.cost.measure import resolve
    from rewrite.grad import vjp
    from rewrite.records import Limits
    from rulesets.nn_lm_head import nn_lm_head
    from tests.corpus import lm_head_case

    saturated: list = []  # the plain forwards decided_jointly saturates apart
    apart = vjp.run_pipeline
    monkeypatch.setattr(vjp, "run_pipeline", lambda *a, **k: saturated.append(1) or apart(*a, **k))
    written, (h, w, y) = lm_head_case(1024, 128, 8192)
    inlined = pipeline.run_pipeline(jax.make_jaxpr(written)(h, w, y), [], resolve(None), Limits(),
                                    price_input=False).after
    loss = lambda h, w, y: jaxpr_as_fun(inlined)(h, w, y)[0]  # noqa: E731

    def built(read_off: bool) -> tuple:
        saturated.clear()
        monkeypatch.setattr(api, "differentiating", primitive.differentiating if read_off else lambda: False)
        made = rewrite(loss, rulesets=[nn_lm_head], cache=False).grad_result(h, w, y)
        return str(made.fwd), str(made.bwd), made.decided, len(saturated)

    got, want = built(True), built(False)
    assert got[2] and got[:3] == want[:3], (got[2], want[2])
    assert (got[3], want[3]) == (0, 1), (got[3], want[3])
    # jax.grad(rewrite(loss)) asks for it the same way (a differentiating trace), and a plain call does not
    saturated.clear()
    monkeypatch.setattr(api, "differentiating", primitive.differentiating)
    r = rewrite(loss, rulesets=[nn_lm_head], cache=False)
    g = jax.grad(r, argnums=(0, 1))(h, w, y)
    assert not saturated and all(np.isfinite(np.asarray(x)).all() for x in g)
    forward = rewrite(loss, rulesets=[nn_lm_head], cache=False)
    forward(h, w, y)
    (entry,) = forward._cache.values()
    assert entry[1].jointly_chosen and entry[1].plain is None


def test_a_plain_forward_saturated_apart_that_saves_less_than_its_floor_is_the_loss_as_written(monkeypatch, tmp_path):
    """``decided_jointly``'s plain forward saturated apart (the forward read back from the disk cache has none:
    flax_seq2seq_grad in the suite's order, after flax_seq2seq_loss) is extracted ``as_loaded``: where its cheapest
    program takes ``linalg``'s reordered product for less than its floor, the program without the floored rules'
    nodes is not extracted, and the program is the loss as written itself (the same object, so its joint is JAX's as
    written: ``grad.primitive.written_as``), not the input's candidate emitted again. Without ``as_loaded`` the
    second extraction is made (and comes out as written)."""
    import jax.numpy as jnp
    import rulesets as packs
    from rewrite.extract import policy
    from rewrite.grad import vjp
    from rulesets.nn_lm_head import nn_lm_head
    from tests.corpus import lm_head_case

    args = (jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.ones((64, 60)))
    closed = jax.make_jaxpr(lambda a, b, c: (a @ b) @ c)(*args)
    r = rewrite(lambda a, b, c: (a @ b) @ c, rulesets=[packs.linalg])
    seconds: list = []
    extract = policy.extract
    monkeypatch.setattr(policy, "extract", lambda *a, **k: seconds.append(1) or extract(*a, **k))
    apart = pipeline.run_pipeline(closed, r.entries, r.cost_model, r.limits, price_input=False)
    assert not apart.rewritten and len(seconds) == 1  # the floor declined the reorder: extracted without it
    seconds.clear()
    loaded = pipeline.run_pipeline(closed, r.entries, r.cost_model, r.limits, price_input=False, as_loaded=True)
    assert not loaded.rewritten and not seconds and loaded.after is closed
    assert loaded.cost_after == apart.cost_after or abs(loaded.cost_after / apart.cost_after - 1) < 1e-6
    # the VJP path's plain forward asks for it where the forward (read back from the disk cache) has no plain one
    asked: list = []
    run = vjp.run_pipeline
    monkeypatch.setattr(vjp, "run_pipeline", lambda *a, **k: asked.append(k.get("as_loaded")) or run(*a, **k))
    loss, (h, w, y) = lm_head_case(1024, 128, 8192)
    rewrite(loss, rulesets=[nn_lm_head], cache=str(tmp_path)).result(h, w, y)  # stored, as flax_seq2seq_loss is
    made = rewrite(loss, rulesets=[nn_lm_head], cache=str(tmp_path)).grad_result(h, w, y)
    assert made is not None and made.decided and asked == [True], (asked, made.decided)


def test_the_jointly_joint_cannot_win_only_where_no_saturation_within_its_margins_lets_it():
    """``decide.jointly_cannot_win`` on the figures measured (2026-12-04, CPU table: a joint's input as run and the
    plain joint extracted, prices and MiB predicted): wholestep_linen_gpt's and wholestep_equinox_gpt's other joint
    cannot be kept at any saturation within the margins (priced 20% and 17% over the plain one as traced, 30% and 26%
    leaner, less than the cache apart); flax_long_context_step's can (0.8% over, its 30% peak margin leaner than the
    plain one's 3/4: the near band), as can flax_lm_step's under the golden table (under the plain one as traced),
    and either where its peak could fall past the cache's width below the plain one's."""
    import dataclasses

    from rewrite import AnalyticCost
    from rewrite.grad import decide

    mib = 2 ** 20
    model = dataclasses.replace(AnalyticCost(), cache=16 * mib)
    linen = (2.96051e7, 20.443 * mib, 2.46104e7, 29.293 * mib)
    equinox = (2.93911e7, 22.687 * mib, 2.51277e7, 30.555 * mib)
    assert decide.jointly_cannot_win(*linen, model) and decide.jointly_cannot_win(*equinox, model)
    assert not decide.jointly_cannot_win(2.95423e8, 47.260 * mib, 2.93083e8, 47.242 * mib, model)  # long context
    assert not decide.jointly_cannot_win(9.77313e7, 40.884 * mib, 1.09637e8, 106.586 * mib, model)  # lm, golden
    # linen's other joint, could its saturation cut its peak by 36% (past the cache's 16 MiB below the plain one's)
    assert not decide.jointly_cannot_win(linen[0], linen[1] * 0.64 / 0.7, linen[2], linen[3], model)
    # ... or its price by 17% (under the plain one's price)
    assert not decide.jointly_cannot_win(linen[2] * 0.98 / 0.95, *linen[1:], model)
    assert not decide.jointly_cannot_win(*linen, dataclasses.replace(model, lean_band_far=0.3))
    measured = type("Measured", (), {"measures": True, "lean_band": 0.03, "lean_band_far": 0.2})()
    assert not decide.jointly_cannot_win(*linen, measured)
    assert not decide.jointly_cannot_win(linen[0], None, *linen[2:], model)


def _joints_of(monkeypatch, build, table: bool = False) -> dict:
    """The step ``build()`` returns rewritten whole (``table``: under the golden table): its program as text, the
    decision in words, the ``run_together`` runs, the pipelines run alone on a joint program (``run_pipeline`` from
    ``grad/together.py``) and the ``Alone`` joints built."""
    import json
    import pathlib

    from rewrite.cost.model import priced_with

    ran = _count_joints(monkeypatch)
    alone: list = []
    run_pipeline = pipeline.run_pipeline
    monkeypatch.setattr(pipeline, "run_pipeline", lambda *a, **k: alone.append(1) or run_pipeline(*a, **k))
    built, why = _spy_decisions(monkeypatch)
    fn, args = build()
    flat, leaves = eco._flat(fn, args)
    table_ = json.loads((pathlib.Path(__file__).parent / "golden" / "cost_table.json").read_text()) if table else None
    import contextlib

    with priced_with(table_) if table else contextlib.nullcontext():
        program = str(rewrite(flat, rulesets=load_rulesets(eco.CONFIGS["identity"]), cache=False).jaxpr(*leaves))
    monkeypatch.undo()
    return {"program": program, "why": why, "together": ran, "alone": alone, "built": built}


def test_a_steps_joint_that_cannot_win_is_neither_traced_into_the_pair_nor_saturated(monkeypatch):
    """wholestep_linen_gpt (CPU table): the LM head's loop takes 9.1% off its forward (``together.plain_first``), so
    its plain joint is rewritten first, alone, and the other, priced 17% over it as traced and less than the cache
    leaner, cannot be kept (``decide.jointly_cannot_win``): no ``run_together``, one joint pipeline, the other joint
    never built (``Alone``), and the plain one kept, as when the two are rewritten together (priced within 1e-5: the
    plain joint alone is not barred from the forms only the other's input held, ``together._first``)."""
    import re

    build = eco.PROGRAMS["wholestep_linen_gpt"].build
    cut = _joints_of(monkeypatch, build)
    assert not cut["together"] and len(cut["alone"]) == 1 and cut["built"] == [""], cut  # the plain one read alone
    monkeypatch.setattr(together, "PLAIN_FIRST_GAP", 1.0)  # never first: the two together, as main builds them
    both = _joints_of(monkeypatch, build)
    assert len(both["together"]) == 1 and not both["alone"], both
    kept = [re.match(r"kept (the forward rewritten without them) \(priced ([^,]*),", w["why"][0]) for w in (cut, both)]
    assert all(kept), (cut["why"], both["why"])
    assert abs(float(kept[0].group(2)) / float(kept[1].group(2)) - 1) < 1e-5, (cut["why"], both["why"])


def test_a_steps_joint_that_can_win_is_still_built_and_kept(monkeypatch):
    """transformer_step (golden table), its plain joint made to be rewritten first (``PLAIN_FIRST_GAP`` below its
    forwards' 1.4%): the joint with the LM head's rules comes out 0.9% under the plain one as traced and is kept, so
    ``jointly_cannot_win`` does not hold and the two are rewritten together as before: the same program, the same
    decision, the plain one's pipeline alone spent for nothing."""
    from benchmarks import decisions as D

    case = D.select(["transformer_step"])[0]
    plain = _joints_of(monkeypatch, case.build, table=True)
    assert len(plain["together"]) == 1 and not plain["alone"], plain
    monkeypatch.setattr(together, "PLAIN_FIRST_GAP", -1.0)
    first = _joints_of(monkeypatch, case.build, table=True)
    assert len(first["together"]) == 1 and len(first["alone"]) == 1 and not first["built"], first
    assert first["why"] == plain["why"] and first["why"][0].startswith("kept the forward rewritten with"), first["why"]
    assert first["program"] == plain["program"]


def test_a_plain_joint_cannot_lead_only_where_no_saturation_within_its_margin_lets_it():
    """``decide.plain_cannot_lead`` on the figures measured (2026-12-07, CPU table: the plain joint's input as run
    and the other joint extracted, MiB predicted): the full-size linen GPT step's plain joint (472.3 MiB as traced,
    456.3 rewritten) cannot be ordered before the one with the LM head's loop (122.3 MiB) at any saturation within
    the margin; the ecosystem's small one's (34.8 MiB against 19.4) can, as can any where the two may come within
    the cache's width, or where the model times programs, bounds no memory or predicts no peak."""
    import dataclasses

    from rewrite import AnalyticCost
    from rewrite.grad import decide

    mib = 2 ** 20
    model = dataclasses.replace(AnalyticCost(), cache=16 * mib)
    assert decide.plain_cannot_lead(472.305 * mib, 122.337 * mib, model)
    assert decide.plain_cannot_lead(232.145 * mib, 80.161 * mib, model)  # linen_accumulate, full size
    assert not decide.plain_cannot_lead(34.805 * mib, 19.442 * mib, model)  # wholestep_linen_gpt
    least = 122.337 * mib + 16 * mib  # the plain one's least peak just the cache's width over the other's
    edge = least / (1 - decide.PLAIN_PEAK_MARGIN)
    assert not decide.plain_cannot_lead(edge, 122.337 * mib, model)
    assert decide.plain_cannot_lead(edge * 1.01, 122.337 * mib, model)
    assert not decide.plain_cannot_lead(472.305 * mib, 122.337 * mib, dataclasses.replace(model, cache=400 * mib))
    measured = type("Measured", (), {"measures": True, "lean_band": 0.03, "lean_band_far": 0.2})()
    assert not decide.plain_cannot_lead(472.305 * mib, 122.337 * mib, measured)
    assert not decide.plain_cannot_lead(472.305 * mib, 122.337 * mib, dataclasses.replace(model, memory=0.0))
    assert not decide.plain_cannot_lead(None, 122.337 * mib, model)
    assert not decide.plain_cannot_lead(472.305 * mib, None, model)


def test_a_steps_plain_joint_that_cannot_lead_is_never_built(monkeypatch):
    """A linen GPT step at 512 tokens and a 4,096-word vocabulary (CPU table): the LM head's loop takes more than
    ``together.PLAIN_FIRST_GAP`` off its forward, and the plain joint's input is predicted to hold so much more than
    the other's that no saturation within ``decide.PLAIN_PEAK_MARGIN`` brings it within the cache's width
    (``decide.plain_cannot_lead``). So the joint with the loop is rewritten first, alone, and kept; the plain one is
    never built: no ``run_together``, one joint pipeline, only the ``Built`` one read. The program and the decision
    are the ones the two give rewritten together (the full-size whole steps' emitted text is byte-identical either
    way)."""
    import re

    build = functools.partial(ws.CASES["linen_gpt"], ws.Size(length=512, width=64, vocab=4096), ws.plain)
    cut = _joints_of(monkeypatch, build)
    assert not cut["together"] and len(cut["alone"]) == 1 and cut["built"] == [""], cut  # the other one read alone
    monkeypatch.setattr(together, "PLAIN_FIRST_GAP", 1.0)  # never first: the two together
    both = _joints_of(monkeypatch, build)
    assert len(both["together"]) == 1 and not both["alone"], both
    assert cut["program"] == both["program"]
    kept = [re.match(r"kept (the forward rewritten with [^(]*) \(priced ([^,]*),", w["why"][0]) for w in (cut, both)]
    assert all(kept), (cut["why"], both["why"])
    assert abs(float(kept[0].group(2)) / float(kept[1].group(2)) - 1) < 1e-5, (cut["why"], both["why"])


def test_a_steps_plain_joint_left_alone_is_built_where_the_other_is_not_kept(monkeypatch):
    """The step above, its joint with the LM head's loop made not to be kept against JAX's as written (``decide._held``
    refusing it, the test's stand-in for a joint that holds more): the plain one, left ``Alone`` when the other was
    rewritten first, is then rewritten alone and kept, as when the two are rewritten together (priced within 1e-5:
    alone, it is not barred from the forms only the other's input held)."""
    import re

    from rewrite.grad import decide

    held = decide._held

    def refusing(r, than, model, slack=0.0):
        if str(r).startswith("the forward rewritten with ") and str(than).startswith("JAX's"):
            return f"{r} is refused by the test"
        return held(r, than, model, slack)

    build = functools.partial(ws.CASES["linen_gpt"], ws.Size(length=512, width=64, vocab=4096), ws.plain)
    monkeypatch.setattr(decide, "_held", refusing)
    cut = _joints_of(monkeypatch, build)  # (which undoes every patch when it returns)
    note = " (its joint as traced, rewritten only where the other is not kept)"
    assert not cut["together"] and len(cut["alone"]) == 2 and cut["built"] == ["", note], cut
    monkeypatch.setattr(decide, "_held", refusing)
    monkeypatch.setattr(together, "PLAIN_FIRST_GAP", 1.0)  # never first: the two together
    both = _joints_of(monkeypatch, build)
    assert len(both["together"]) == 1 and not both["alone"], both
    kept = [re.match(r"kept (the forward rewritten without them)[^(]*\(priced ([^,]*),", w["why"][0])
            for w in (cut, both)]
    assert all(kept), (cut["why"], both["why"])
    assert "refused by the test" in cut["why"][0] and "refused by the test" in both["why"][0]
    assert abs(float(kept[0].group(2)) / float(kept[1].group(2)) - 1) < 1e-5, (cut["why"], both["why"])


def test_jaxs_joint_at_the_gradients_a_step_reads_is_not_traced_again(monkeypatch):
    """A step that reads the gradient of one of its loss's three float inputs, whose LM head's ``jointly`` rules
    fire: JAX's joint of the loss as written at that one gradient (the candidate every rewritten joint is held to)
    is read off the one ``grad.step.rederive`` traced at all three, its unread gradients dropped (``uses.sliced``:
    the text of JAX's traced at the one less its dead code), not traced again. The loss as written is traced once;
    the step still computes what it computes as written."""
    from .corpus import spy_joint_programs

    def loss(w, h, scale, y):
        logits = (h * scale) @ w
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(w, h, scale, y):
        value, g = jax.value_and_grad(loss)(w, h, scale, y)  # the gradient of w alone
        return value, w - 0.1 * g

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    args = (0.05 * jax.random.normal(k[0], (64, 4096)), jax.random.normal(k[1], (512, 64)), jnp.float32(1.5),
            jax.random.randint(k[2], (512,), 0, 4096))
    traced, _ = spy_joint_programs(monkeypatch)
    rewritten = rewrite(step, rulesets=load_rulesets(eco.CONFIGS["identity"]), cache=False)
    got = jax.jit(rewritten)(*args)
    written = [t for t in traced if t[1] is None or len(t[1]) == 3]
    assert len(written) == 1, traced  # rederive's, at every float input
    assert [t for t in traced if t[0] == written[0][0]] == written, traced
    assert any(w != (0,) for _, w in traced) and any(w == (0,) for _, w in traced), traced  # the rewritten forwards'
    want = jax.jit(step)(*args)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
