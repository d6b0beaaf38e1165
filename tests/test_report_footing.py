"""A report's ``cost_after`` of a program that kept the input's own terms is priced on ``cost_before``'s footing.

The extraction prices the input's terms in the saturated e-graph, whose facts can price the same program lower than
it priced as loaded: on jax 0.11+, optax's clipped AdamW step came out with its input's text, ``rewritten`` False,
and a report of ``924,533 -> 903,075 (+2.3% saved)`` and a predicted 1.02x. A report must not call a program that
runs as written a saving.
"""

import dataclasses

import jax.numpy as jnp
import pytest

import rulesets
from rewrite import explain
from rewrite.ir.jaxapi import core
from rewrite.pipeline import program_cost
from rewrite.report.report import report_of


def test_a_program_left_leaner_by_its_input_terms_reports_that_saving_as_loaded():
    """``x * 1.0`` is ``x``: no node of a rule's is used (``rewritten`` False) and the product is gone."""
    report = explain(lambda x: jnp.sum(x * 1.0), jnp.ones(256), rulesets=[rulesets.algebra])
    assert not report.result.rewritten and report.eqns_after < report.eqns_before
    assert report.cost_after == pytest.approx(program_cost(report.after, report.model))
    assert report.cost_after < report.cost_before


def _kept():
    """A program no rule rewrites, explained: the report and its result."""
    report = explain(lambda x, y: jnp.sin(x) * y + jnp.cos(y), jnp.ones(256), jnp.ones(256),
                     rulesets=[rulesets.algebra])
    assert not report.result.rewritten
    return report


def test_a_kept_program_reports_its_price_as_loaded_not_the_saturated_one():
    report = _kept()
    res = report.result
    # the same program emitted again (a new object, its text the input's), priced lower by the saturated e-graph's
    # facts: the report prices what runs as the input was priced
    again = core.ClosedJaxpr(res.before.jaxpr, res.before.consts)
    lower = dataclasses.replace(res, after=again, cost_after=0.9 * res.cost_before)
    shown = report_of(lower, report.rulesets, report.model)
    assert shown.cost_after == pytest.approx(program_cost(again, report.model))
    assert shown.cost_after == pytest.approx(res.cost_before)
    assert shown.saved == pytest.approx(0.0)
    assert shown.predicted_speedup == pytest.approx(1.0)
    # the input itself: its own price, not priced again
    same = report_of(dataclasses.replace(res, after=res.before, cost_after=0.9 * res.cost_before), report.rulesets,
                     report.model)
    assert same.cost_after == res.cost_before


def test_a_rewritten_program_keeps_the_extractions_price():
    """The figure its choice was made by."""
    report = explain(lambda x: jnp.log(jnp.exp(x) + 1.0), jnp.ones(256), rulesets=[rulesets.nn])  # (softplus)
    res = report.result
    assert res.rewritten
    assert report.cost_after == res.cost_after
    shown = report_of(dataclasses.replace(res, cost_after=0.5 * res.cost_after), report.rulesets, report.model)
    assert shown.cost_after == 0.5 * res.cost_after


def test_an_ecosystem_step_that_runs_as_written_reports_no_saving():
    ecosystem = pytest.importorskip("benchmarks.ecosystem")
    pytest.importorskip("optax")
    prog = ecosystem.PROGRAMS["optax_clip_adamw"]
    fn, args = prog.build()
    flat, leaves = ecosystem._flat(fn, args)
    report = explain(flat, *leaves, rulesets=ecosystem.load_rulesets(ecosystem.CONFIGS["identity"]))
    if report.result.rewritten:
        pytest.skip("this JAX's program is rewritten: the report's figures are the extraction's")
    assert report.cost_after == pytest.approx(program_cost(report.after, report.model))
    if str(report.after) == str(report.before):
        assert report.saved == pytest.approx(0.0) and report.predicted_speedup == pytest.approx(1.0)
