"""``LiveProgram.held`` reads the schedule a live program's price made, instead of scheduling the same kernels again.

A model that charges fresh memory (``AnalyticCost.fresh``) reads, in a program's price, the scheduled peak of its
kernels (``FusionModel.held_bytes``: ``cost.memory.fresh_peak``, ``scheduled_peak`` without a library kernel's
scratch) wherever a bound on them reaches ``fresh_at``. Where no kernel is an attention kernel (none has scratch),
that is the peak ``held`` asks for (``scheduled_peak`` of the same kernels, ``inner`` and order): the price keeps it
(``LiveFusion.scheduled``) and ``held`` answers from it. Where a kernel is one, ``held`` schedules with its scratch.
"""

import math
import random

import jax
import jax.numpy as jnp
import pytest

import rulesets
from rewrite import AnalyticCost, explain
from rewrite.cost import memory
from rewrite.cost.program import ATTENTION
from rewrite.extract import program as P
from rewrite.extract.extract import Candidate, _held
from rewrite.extract.extractor import _CONTAINERS, Extractor
from rewrite.extract.program import ProgramPricer

FRESH = {"fresh": 0.5, "fresh_at": 1.0}  # every program's temporaries charged fresh: every price schedules them


def seed_vjp(x, a, g):
    return jax.vjp(lambda x, a: jnp.sin(a * x) ** 2 / a + jnp.exp(x).sum() * jnp.cos(a * x), x, a)[1](g)


def attention(q, k, v):
    return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / 8.0, axis=-1) @ v


def _live(fn, args, **fields):
    res = explain(fn, *args, rulesets=[rulesets.algebra]).result
    model = AnalyticCost(**fields)
    ex = Extractor(res.snapshot, model)
    _, choice = ex.tree()
    pricer = ProgramPricer(ex, model)
    return pricer, pricer.live(choice, res.roots), res.roots, choice


def _counted(monkeypatch) -> list:
    calls: list = []
    real = P.scheduled_peak
    monkeypatch.setattr(P, "scheduled_peak", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _fresh(live) -> int:
    live.flush()
    f = live.fusion
    return memory.scheduled_peak(f, f.kernels(), f.model.inner)


def test_held_of_a_priced_program_is_its_price_s_schedule(monkeypatch):
    """A program priced (``LiveProgram.price``), then moved and priced again: ``held`` of each schedules nothing
    and answers the peak a fresh ``scheduled_peak`` gives; ``extract._held`` reads it without moving the live
    program there."""
    x = jnp.linspace(-1.0, 1.0, 256 * 128).reshape(256, 128)
    pricer, live, roots, choice = _live(seed_vjp, (x, 0.7, x), **FRESH)
    ex = pricer.ex
    calls = _counted(monkeypatch)
    monkeypatch.setattr(pricer, "live", lambda *a: pytest.fail("extract._held moved the live program"))
    rng = random.Random(0)
    seen = 0
    classes = [c for c in list(choice) if len(ex.snap.nodes.get(c, ())) > 1]
    rng.shuffle(classes)
    for c in [None, *classes]:
        if c is not None:
            alt = next((n for n in ex.snap.nodes[c] if n != choice[c] and n[0] not in _CONTAINERS
                        and all(k in choice for k in ex.term_kids(n)) and not ex.reaches(choice, ex.term_kids(n), {c})),
                       None)
            if alt is None or not live._ref.get(c, 0):
                continue
            live.set(c, alt)
        live.price()
        got = live.held()
        assert not calls, "held scheduled a program its price scheduled"
        assert got == _fresh(live) > 0
        assert _held(pricer, Candidate(choice, 0.0, True, live.key()[1]), roots) == got and not calls
        seen += 1
        if seen >= 4:
            break
    assert seen >= 2, seen


def test_held_schedules_where_the_price_did_not(monkeypatch):
    """Below the fresh charge's threshold the price schedules nothing (``scheduled`` is ``None``) and ``held``
    schedules once, then answers from memory."""
    x = jnp.linspace(-1.0, 1.0, 64 * 32).reshape(64, 32)
    pricer, live, _, _ = _live(seed_vjp, (x, 0.7, x))  # the table's fresh_at: 64 MiB (pricer: its live program's)
    calls = _counted(monkeypatch)
    live.price()
    assert live.fusion.scheduled is None
    got = live.held()
    assert calls == [1] and got == _fresh(live)
    assert live.held() == got and calls == [1]


def test_an_attention_kernel_s_scratch_is_scheduled_by_held(monkeypatch):
    """A program with an attention kernel: the price's schedule leaves the scores' scratch out (``fresh_peak``),
    which ``held`` holds, so the price keeps none and ``held`` schedules, with the scratch."""
    q = jnp.ones((2, 256, 64), jnp.float32)
    pricer, live, _, _ = _live(attention, (q, q, q), **FRESH)  # (pricer: kept alive)
    calls = _counted(monkeypatch)
    live.price()
    live.flush()
    assert ATTENTION in live.fusion.roots.values()
    assert live.fusion.scheduled is None
    got = live.held()
    assert calls == [1] and got == _fresh(live)
    f = live.fusion
    assert got > memory.fresh_peak(f, f.kernels(), f.model.inner)  # the scratch


@pytest.mark.parametrize("fields", [FRESH, {}])
def test_held_answers_as_a_fresh_schedule_after_any_moves(fields):
    """Whatever the price kept, every ``held`` answer is a fresh ``scheduled_peak`` of the program then."""
    x = jnp.linspace(-1.0, 1.0, 128 * 64).reshape(128, 64)
    pricer, live, _, choice = _live(seed_vjp, (x, 0.7, x), **fields)
    ex = pricer.ex
    rng = random.Random(1)
    for _ in range(20):
        c = rng.choice([c for c in choice if len(ex.snap.nodes.get(c, ())) > 1 and live._ref.get(c, 0)])
        alt = rng.choice(ex.snap.nodes[c])
        if alt[0] in _CONTAINERS or any(k not in choice for k in ex.term_kids(alt)) or ex.reaches(
                choice, ex.term_kids(alt), {c}):
            continue
        live.set(c, alt)
        live.price()
        assert live.held() == _fresh(live)


@pytest.mark.parametrize("fn, shape, fields, kept", [
    (seed_vjp, (256, 128), FRESH, True),
    (seed_vjp, (64, 32), {}, False),  # under the table's fresh_at: the price scheduled nothing
    (attention, (2, 256, 64), FRESH, False),  # an attention kernel: the price's schedule leaves its scratch out
], ids=["charged", "under the threshold", "attention"])
def test_a_program_priced_whole_keeps_its_price_s_schedule_for_held(fn, shape, fields, kept, monkeypatch):
    """A program priced whole (``ProgramPricer.__call__``: a candidate, before any search moves to it) keeps the
    schedule its fresh charge made, as a live program's price does (``LiveFusion.scheduled``): ``extract._held``
    answers it without moving the live program there or scheduling, and it is the peak a fresh ``scheduled_peak``
    of the live program gives. Not where the price scheduled nothing, nor where a kernel has scratch."""
    x = jnp.linspace(-1.0, 1.0, math.prod(shape)).reshape(shape)
    res = explain(fn, *((x, 0.7, x) if fn is seed_vjp else (x, x, x)), rulesets=[rulesets.algebra]).result
    model = AnalyticCost(**fields)
    ex = Extractor(res.snapshot, model)
    _, choice = ex.tree()
    pricer = ProgramPricer(ex, model)
    pricer(choice, res.roots)  # priced whole: no live program made
    key = pricer.last_key
    assert (("held", *key) in pricer.peaks) == kept
    if kept:
        want = _fresh(pricer.live(choice, res.roots))
        calls = _counted(monkeypatch)
        monkeypatch.setattr(pricer, "live", lambda *a: pytest.fail("extract._held moved the live program"))
        assert _held(pricer, Candidate(choice, 0.0, True, key[1]), res.roots) == want > 0 and not calls
