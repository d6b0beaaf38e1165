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


#: ``pythag`` is chosen (its ``ones_like`` is cheaper), ``tan_quotient`` fires and is not (two transcendentals and a
#: division for one), ``log_exp``'s ``x + y`` is a node the program already had: none of them counts as used
TRIG = Ruleset("trig", [rule(lambda x: jnp.sin(x) ** 2 + jnp.cos(x) ** 2, lambda x: jnp.ones_like(x), name="pythag"),
                        rule(lambda x: jnp.log(jnp.exp(x)), lambda x: x, name="log_exp"),
                        rule(lambda x: jnp.tan(x), lambda x: jnp.sin(x) / jnp.cos(x), name="tan_quotient")],
               soundness="identity")


def test_ran_reads_the_rules_used_as_explain_reports_them():
    """``Result.used``, recorded before the pipeline releases its e-graph, is ``explain``'s ``Report.used`` (read off
    the e-graph ``explain`` keeps): the rules whose nodes the chosen program holds, not every rule that fired."""
    def h(x, y):
        return (jnp.sin(x) ** 2 + jnp.cos(x) ** 2) * jnp.tan(y) + jnp.log(jnp.exp(x + y))

    x, y = jnp.ones(3), jnp.full(3, 2.0)
    want = explain(h, x, y, rulesets=[TRIG])
    assert want.fired == {"pythag": 1, "log_exp": 1, "tan_quotient": 1} and want.used == {"pythag": 2}, want.used
    report = ran(rewrite(h, rulesets=[TRIG], cache=False), x, y)
    assert report.used == want.used and report.fired == want.fired
