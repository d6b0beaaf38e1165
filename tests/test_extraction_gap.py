"""``benchmarks/extraction_gap.py``: the price extraction leaves on the table is found where it is left, and a
ruleset's ``min_saving`` is kept as extraction keeps it."""

import dataclasses

import jax.numpy as jnp
import pytest

import rulesets
from benchmarks.extraction_gap import gap
from rewrite import explain
from rewrite.extract.extractor import shared


def test_a_choice_left_worse_than_it_need_be_is_found():
    """From the input program (a product chain in its costly order), the search finds the reordered one that
    extraction chose; from extraction's own choice it finds nothing."""
    report = explain(lambda a, b, x: (a @ b) @ x, jnp.ones((256, 256)), jnp.ones((256, 256)), jnp.ones((256, 1)),
                     rulesets=[rulesets.linalg])
    r = report.result
    assert r.rewritten
    own = gap(r, report.model, report.rulesets, kicks=4)
    assert own["left"] == 0.0 and own["chosen"] == pytest.approx(r.cost_after)
    orig = shared(r.snapshot, report.model).original_tree(r.original)
    worse = gap(dataclasses.replace(r, choice={**r.choice, **orig}), report.model, report.rulesets, kicks=4)
    assert worse["chosen"] == pytest.approx(r.cost_before)
    assert worse["left"] == pytest.approx(1 - r.cost_after / r.cost_before)
    report.release()


def test_a_saving_below_the_rulesets_floor_is_not_counted():
    """(a b) c at 64 x 64 x 64 x 60 reorders for less than linalg's ``min_saving``: extraction keeps the input,
    the search finds the cheaper order, and the gap does not count it."""
    report = explain(lambda a, b, c: (a @ b) @ c, jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.ones((64, 60)),
                     rulesets=[rulesets.linalg])
    r = report.result
    assert not r.rewritten
    g = gap(r, report.model, report.rulesets, kicks=4)
    assert g["below_floor"] < g["chosen"]
    assert g["floored"] and g["left"] == 0.0
    report.release()
