"""The cost model as a declared protocol (rewrite.CostModel): the extractor uses the parts a model
declares (node price; whole-program price; measured final choice) and guesses nothing from attributes."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from rewrite import AnalyticCost, CostModel, NodeCost, Ruleset, explain, rewrite, rule
from rewrite.cost.measure import Measured, resolve

X = jnp.linspace(0.1, 1.0, 8)
# sin(x)*2 <-> sin(x)+sin(x): both sides stay in the e-graph, so a cost model decides which is emitted
TWICE = Ruleset("twice", [rule(lambda x: x * 2.0, lambda x: x + x, name="mul_two_add")])


def prog(x):
    return jnp.sin(x) * 2.0


class CountNodes(CostModel):
    def __call__(self, node):
        return 0.0 if node.family == "special" else 1.0


class PreferAdd(CountNodes):
    """Node prices cannot tell the two sides apart; the whole-program price prefers an `add`."""

    prices_programs = True

    def __init__(self):
        self.priced = 0

    def program(self, prog):
        self.priced += 1
        return 1.0 if any(op.prim == "add" for op in prog.ops) else 2.0


class Undeclared(CountNodes):
    """Has a program price and a `fusion` attribute, but does not declare them: they must not be used."""

    fusion = True

    def __init__(self):
        self.priced = 0

    def program(self, prog):
        self.priced += 1
        return 0.0


def test_a_model_that_declares_a_program_price_decides_by_it():
    model = PreferAdd()
    report = explain(prog, X, rulesets=[TWICE], cost_model=model)
    assert model.priced > 0
    assert [e.primitive.name for e in report.after.jaxpr.eqns] == ["sin", "add"]


def test_undeclared_capabilities_are_not_guessed():
    model = Undeclared()
    report = explain(prog, X, rulesets=[TWICE], cost_model=model)
    assert model.priced == 0
    assert [e.primitive.name for e in report.after.jaxpr.eqns] == ["sin", "mul"]  # ties go to the input


def test_a_model_that_declares_measuring_makes_the_final_choice():
    class PickLast(CountNodes):
        measures = True

        def choose(self, programs):
            self.seen = len(programs)
            return programs[-1], "picked last"

    model = PickLast()
    report = explain(prog, X, rulesets=[TWICE], cost_model=model)
    assert model.seen >= 2 and report.result.timing == "picked last"
    np.testing.assert_allclose(rewrite(prog, rulesets=[TWICE], cost_model=PickLast())(X), prog(X), rtol=1e-6)


def test_a_plain_function_is_a_node_price_alone_and_says_so():
    def wrapped(node):
        return AnalyticCost()(node)

    with pytest.warns(UserWarning, match="plain function.*whole-program"):
        model = resolve(wrapped)
    assert isinstance(model, NodeCost) and not model.prices_programs and not model.measures
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve(wrapped)  # once per function
        explicit = resolve(NodeCost(wrapped))  # saying so explicitly is silent
    assert not explicit.prices_programs


def test_analytic_cost_declares_what_it_provides():
    assert AnalyticCost().prices_programs and not AnalyticCost().measures
    assert not AnalyticCost(fusion=False).prices_programs
    assert Measured().measures and Measured().prices_programs

    class Heavier(AnalyticCost):  # a subclass keeps whole-program pricing
        def __call__(self, node):
            return 2 * super().__call__(node)

    assert Heavier().prices_programs
    with pytest.raises(TypeError):
        CostModel()  # the node price is the one part every model has
    with pytest.raises(ValueError, match="cost_model="):
        resolve(42)
