"""One walk over a chosen program and one definition of a node's children (rewrite/ir/walk.py)."""

import jax
import jax.numpy as jnp
import pytest

from rewrite import explain
from rewrite.extract.choice import reachable
from rewrite.ir.walk import CycleError, children, operands, postorder, term_children, walk

GRAPH = {"r": ["a", "b"], "a": ["c"], "b": ["c", "d"], "c": [], "d": ["c"]}


def test_walk_visits_each_class_once_depth_first():
    assert list(walk(["r"], GRAPH.__getitem__)) == ["r", "b", "d", "c", "a"]
    assert list(walk(["r"], lambda c: [] if c == "b" else GRAPH[c])) == ["r", "b", "a", "c"]  # stopped at b


def test_postorder_visits_each_class_after_what_it_reads():
    order = list(postorder(["r"], GRAPH.__getitem__))
    assert sorted(order) == sorted(GRAPH)
    for c, kids in GRAPH.items():
        assert all(order.index(k) < order.index(c) for k in kids)
    assert list(postorder(["r"], GRAPH.__getitem__, done={"b"})) == ["c", "a", "r"]
    with pytest.raises(CycleError):
        list(postorder(["x"], {"x": ["y"], "y": ["x"]}.__getitem__))


def test_children_keep_lists_and_bodies_whole_and_operands_spell_lists_out():
    def f(p, x, y):  # select_n takes a predicate and a list of cases; scan has a body
        z = jax.lax.select(p, jnp.sin(x), y)
        return jax.lax.scan(lambda c, t: (c + t, c), z[0], z)[1]

    report = explain(f, jnp.ones(3, bool), jnp.ones(3), jnp.zeros(3))
    snap, choice, roots = report.result.snapshot, report.result.choice, report.result.roots
    select = next(c for c in choice if choice[c][0] == "SelectN")
    node = choice[select]
    (pred, cases) = children(node)
    assert snap.list_items(cases) and choice[cases][0] == "TCons"  # the list is a class of its own
    assert operands(snap, node) == [pred, *snap.list_items(cases)]  # spelled out for the equation
    scan = next(c for c in choice if choice[c][0] == "Scan")
    body, args = children(choice[scan])
    assert choice[body][0] == "Body" and term_children(choice[scan]) == [args]
    assert body in reachable(snap, choice, roots)  # reachability enters bodies
