"""``rulesets.derivatives``: a class's product tree, and the product rules' verdict on it, made once per snapshot.

``prod_mul``, ``prod_div`` and ``prod_pow`` run one procedure at whichever product node of a class they match,
and ``red_pull`` reads the product tree of a sum's operand; ``Value.once`` (``Builder.once``) lets the first
make the tree and the verdict and the others take them. These tests check that the work is done once, that the
tree and the verdict are the ones each rule would have made itself, and that nothing a report shows moves: the
rules' stats, what a declined match is watched on, and the program that comes out.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest

from rewrite import Limits, Ruleset, explain
from rewrite.ir.egraph import EGraph
from rewrite.ir.intern import TYPES
from rewrite.jaxpr.load import load_closed
from rewrite.rules.builder import Builder
from rewrite.rules.saturate import Engine
from rulesets.derivatives import derivatives

D = sys.modules["rulesets.derivatives"]  # the module (``rulesets.derivatives`` the attribute is the pack)


def _unshared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``once`` computes afresh: the code as it was before the work was shared."""
    monkeypatch.setattr(Builder, "once", lambda self, key, fn: fn())


def _walks(monkeypatch: pytest.MonkeyPatch) -> list:
    """The product trees walked (``_product_tree``'s calls), each as (snapshot, class, the tree's shape)."""
    walked = []
    inner = D._product_tree

    def counting(v):
        tree = inner(v)
        walked.append((id(v._engine.snapshot), v.cls, _shape(tree)))
        return tree

    monkeypatch.setattr(D, "_product_tree", counting)
    return walked


def _shape(f) -> tuple | None:
    """A tree as plain data: each factor's kind, power, class name and literal, with its children."""
    if f is None:
        return None
    return (f.op, f.e, f.value.name, f.lit, tuple(_shape(c) for c in f.children))


def _engine_at(first, second) -> tuple[Engine, dict, int]:
    """An engine over one class holding both ``first(a, b)`` and ``second(a, b)`` (unioned: they are equal), at its
    first snapshot; returns it, its active rules by name, and the class."""
    eg = EGraph()
    avals = [jax.core.ShapedArray((3,), jnp.float32)] * 2
    ins = [eg.term("Param", [0, i], TYPES.intern_aval(v)) for i, v in enumerate(avals)]
    outs = []
    for f in (first, second):
        closed = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3))
        (out,), _ = load_closed(closed, ins, eg)
        outs.append(out)
    eg.union(*outs)
    eg.flush()
    rules = [r for r in D.products.rules]
    engine = Engine(eg, [(r, D.products) for r in rules], Limits())
    engine.snapshot = eg.snapshot()
    return engine, {a.rule.name: a for a in engine.active}, engine.snapshot.cls_of_name[outs[0]]


def _act_on(engine: Engine, acts: dict, root, names) -> None:
    for name in names:  # as the saturation loop does: the match's bindings do not matter to these rules
        engine._apply_procedure(acts[name], root, {}, {}, [], [root])


def _stats(engine: Engine) -> dict:
    return {k: (s.fired, dict(s.rejected)) for k, s in engine.stats.items()}


@pytest.mark.parametrize("order", [("prod_div", "prod_mul"), ("prod_mul", "prod_div")])
def test_one_walk_and_one_verdict_per_class_whichever_rule_matches(monkeypatch, order):
    """A class holding a ``div`` and a ``mul`` (``(a*a)/b`` and ``a*(a/b)``), matched by both product rules in one
    snapshot: its tree is walked once and its verdict (``a**2 / b``, built) made once, in either order; without the
    sharing each rule walks it, and the two walks are the same tree (the oldest product node's, whichever rule
    matched), and the stats are the same: the replacement fires once, in the rule that made it."""
    walked = _walks(monkeypatch)
    built = []
    inner_build = D.build
    monkeypatch.setattr(D, "build", lambda *a: built.append(1) or inner_build(*a))
    engine, acts, root = _engine_at(lambda a, b: (a * a) / b, lambda a, b: a * (a / b))
    _act_on(engine, acts, root, order)
    shared = list(walked)
    assert len(shared) == 1 and len(built) == 1
    assert shared[0][2][0] == "div"  # the oldest node's tree: (a*a)/b, not a*(a/b)
    stats = _stats(engine)
    assert stats[order[0]] == (1, {}) and stats[order[1]] == (0, {})

    _unshared(monkeypatch)
    walked.clear()
    built.clear()
    engine, acts, root = _engine_at(lambda a, b: (a * a) / b, lambda a, b: a * (a / b))
    _act_on(engine, acts, root, order)
    assert len(walked) == 2 and len(built) == 2  # each rule walked and built it
    assert walked[0][2] == walked[1][2] == shared[0][2]  # one tree, whichever rule matched
    assert _stats(engine) == stats


def test_a_shared_decline_is_counted_and_watched_in_each_rule(monkeypatch):
    """``a * (1/b)`` and ``a / b``: nothing to save, so both rules decline. Each counts its decline, and each is
    watched on the classes the verdict read (the second rule never walked them itself), as without the sharing."""
    def run():
        engine, acts, root = _engine_at(lambda a, b: a * (1.0 / b), lambda a, b: a / b)
        _act_on(engine, acts, root, ("prod_mul", "prod_div"))
        watched = {name: {c for c, slot in engine._watched.items() for act, _, _ in slot[2] if act is acts[name]}
                   for name in ("prod_mul", "prod_div")}
        return _stats(engine), watched

    walked = _walks(monkeypatch)
    stats, watched = run()
    assert len(walked) == 1
    assert stats["prod_mul"] == stats["prod_div"] == (0, {"declined": 1})
    assert watched["prod_mul"] and watched["prod_div"] == watched["prod_mul"]
    _unshared(monkeypatch)
    walked.clear()
    assert run() == (stats, watched) and len(walked) == 2


_PROGRAMS = {  # programs where red_pull reads a product the product rules read in the same snapshot
    "sum_of_products": (lambda x, b, g: jnp.sum(g * x * b[None, :] * jnp.sin(x), axis=0),
                        (jnp.ones((3, 4)), jnp.ones(4), jnp.ones((3, 4)))),
    "grad_log_cosh": (jax.grad(lambda x: jnp.sum(jnp.log(jnp.cosh(x)) * x * x)), (jnp.ones((3, 4)),)),
}


@pytest.mark.parametrize("name", sorted(_PROGRAMS))
def test_shared_trees_leave_the_rewrite_as_it_was(monkeypatch, name):
    """A whole rewrite with the pack: some tree is asked for twice in a snapshot and walked once, never twice; and
    with each walked afresh the rules' stats and the program that comes out are the same."""
    fn, args = _PROGRAMS[name]
    walked = _walks(monkeypatch)
    asked = []
    inner = D.product_tree
    monkeypatch.setattr(D, "product_tree", lambda v: asked.append(1) or inner(v))
    report = explain(fn, *args, rulesets=[derivatives])
    keys = [(s, c) for s, c, _ in walked]
    assert len(set(keys)) == len(keys) < len(asked)  # once per class per snapshot, and asked for more often
    _unshared(monkeypatch)
    walked.clear()
    asked.clear()
    again = explain(fn, *args, rulesets=[derivatives])
    assert len(walked) == len(asked) > len(set((s, c) for s, c, _ in walked))  # unshared: each ask walks again
    assert str(again.after) == str(report.after)
    assert ({k: (s.fired, dict(s.rejected)) for k, s in again.result.stats.items()}
            == {k: (s.fired, dict(s.rejected)) for k, s in report.result.stats.items()})


def test_once_outside_a_snapshot_computes_each_time():
    """A value with no class in a snapshot (a rule's example, a value built by the match) is not kept."""
    from rewrite import Value

    v = Value.from_aval(jax.core.ShapedArray((3,), jnp.float32))
    calls = []
    assert v.once("t", lambda w: calls.append(w) or 7) == 7 and v.once("t", lambda w: calls.append(w) or 7) == 7
    assert calls == [v, v]
