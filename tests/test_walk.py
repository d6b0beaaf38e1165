"""One walk over a chosen program and one definition of a node's children (rewrite/ir/walk.py)."""

import jax
import jax.numpy as jnp
import pytest

from rewrite import explain
from rewrite.extract.choice import reachable
from rewrite.ir.walk import CycleError, children, operands, postorder, postorder_list, term_children, walk

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


def test_the_listed_postorder_is_the_generators_order_and_finds_its_cycles():
    """``postorder_list`` (what ``Program.from_choice`` walks) is ``list(postorder(...))`` exactly: the same classes
    in the same order on random graphs with shared children, repeated children, several roots (one read by another,
    one repeated) and leaves, and a cycle raised wherever the generator raises one."""
    import random

    rng = random.Random(0)
    for trial in range(300):
        n = rng.randrange(1, 40)
        graph = {i: [rng.randrange(i) for _ in range(rng.choice([0, 1, 1, 2, 3]))] if i else [] for i in range(n)}
        if trial % 3 == 0 and n > 2:  # a back edge: a cycle where the walk reaches it
            a = rng.randrange(1, n)
            graph[rng.randrange(a)].append(a)
        roots = [rng.randrange(n) for _ in range(rng.randrange(1, 4))]
        try:
            want = list(postorder(roots, graph.__getitem__))
        except CycleError:
            with pytest.raises(CycleError):
                postorder_list(roots, graph.__getitem__)
            continue
        assert postorder_list(roots, graph.__getitem__) == want
    assert postorder_list(["r"], GRAPH.__getitem__) == list(postorder(["r"], GRAPH.__getitem__))
    with pytest.raises(CycleError):
        postorder_list(["x"], {"x": ["x"]}.__getitem__)


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
