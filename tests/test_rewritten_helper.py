"""``tests/rewritten.py``'s ``ran``: what ``explain`` reports of fired rules and the program, read off the rewrite a
test runs, without rewriting the program again."""

import jax.numpy as jnp

import rewrite.api as api
from rewrite import Ruleset, explain, rewrite, rule

from .rewritten import ran

MUL_ONE = Ruleset("mine", [rule(lambda x: x * 1.0, lambda x: x, name="mul_one")], soundness="identity")


def f(x):
    return jnp.sin(x * 1.0)


def test_ran_reads_explain_s_fired_and_program_off_the_one_rewrite_the_test_runs(monkeypatch):
    x = jnp.ones(3)
    want = explain(f, x, rulesets=[MUL_ONE])
    runs = []
    real = api.run_pipeline
    monkeypatch.setattr(api, "run_pipeline", lambda *a, **k: runs.append(1) or real(*a, **k))
    explain(f, x, rulesets=[MUL_ONE])
    assert len(runs) == 1  # what a test paid besides its own rewrite, which ran spares
    runs.clear()
    g = rewrite(f, rulesets=[MUL_ONE], cache=False)
    report = ran(g, x)
    g(x)
    ran(g, x)
    assert len(runs) == 1 and g.rewrites == 1  # rewritten once: ran's, which g(x) and the second ran read
    assert report.fired == want.fired == {"mul_one": 1}
    assert str(report.after) == str(want.after)
