"""Node prices kept across extractions (``rewrite/cost/prices.py``) are the prices the model computes, bit for bit.

:class:`rewrite.AnalyticCost` keeps a node's price under ``Extractor.node_key`` (its constructor, params id,
operands' and class's avals; a projection's index and projected node): an extraction from another snapshot, or
another class with the same term, takes it instead of pricing the node again. These tests price random programs'
nodes both ways (kept, and by a model that keeps nothing) and compare them, every node, under random choices; and
whole-program prices, whose tie-break reads kept prices through the ops' keys.
"""

import random
import struct

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import rulesets
from rewrite import AnalyticCost, OpSpec, explain, register_primitive
from rewrite.cost import prices
from rewrite.cost import program as cost_program
from rewrite.extract.extractor import _CONTAINERS, Extractor
from rewrite.extract.program import ProgramPricer
from rewrite.ir.primitives import unregister
from rulesets.derivatives import derivatives


class Fresh(AnalyticCost):
    """The same prices, none kept (only ``AnalyticCost`` itself keeps them)."""


def _bits(x):
    return struct.pack("<d", float(x))


_UNARY = [jnp.sin, jnp.exp, jnp.tanh, lambda x: x * x, lambda x: jnp.maximum(x, 0.0), lambda x: x ** 3]
_BINARY = [jnp.add, jnp.multiply, jnp.subtract, lambda a, b: a / (1.0 + b * b)]


def _random_jax_program(seed):
    """A random program over a (n, m) and a (m, k) input: pointwise chains, products, transposes, reductions."""
    rng = random.Random(seed)
    n, m, k = rng.choice([8, 16, 32]), rng.choice([8, 24]), rng.choice([8, 16])

    def fn(x, w):
        rng = random.Random(seed)  # (the same program at every trace)
        vals = [x, jnp.sin(x) + 1.0]
        for _ in range(rng.randint(4, 9)):
            kind = rng.random()
            a = rng.choice(vals)
            if kind < 0.35:
                vals.append(rng.choice(_UNARY)(a))
            elif kind < 0.65:
                vals.append(rng.choice(_BINARY)(a, rng.choice(vals)))
            elif kind < 0.8:
                vals.append((a @ w) @ w.T)
            elif kind < 0.9:
                vals.append(a.T.T * 2.0)
            else:
                vals.append(a - a.sum(axis=rng.choice([0, 1]), keepdims=True))
        return vals[-1].sum() + vals[-2].max(), vals[-3]

    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    return fn, (jax.random.normal(keys[0], (n, m)), jax.random.normal(keys[1], (m, k)))


def _scan_program():
    def loss(p, xs):
        def step(h, x):
            h = jnp.tanh(h @ p + x)
            return h, h * 2.0

        h, os = lax.scan(step, jnp.zeros((4, 6)), xs)
        return jnp.mean(os ** 2) + h.sum()

    args = (jnp.eye(6) * 0.5, jnp.linspace(-1.0, 1.0, 5 * 4 * 6).reshape(5, 4, 6))
    return jax.grad(loss), args


def _snapshot(fn, args, packs):
    return explain(fn, *args, rulesets=packs).result


def _random_choice(snap, rng):
    return {c: rng.choice(ns) for c, ns in snap.nodes.items()}


def _priced(ex, choice):
    """Every node without bodies of ``ex``'s snapshot (containers left out) with its price under ``choice``."""
    out = []
    for c, ns in ex.snap.nodes.items():
        for node in ns:
            if node[0] not in _CONTAINERS and not ex.body_classes(*node):
                out.append(((c, node), ex.own(c, node, choice)))
    return out


CASES = [(f"random{s}", *_random_jax_program(s), [rulesets.algebra, derivatives]) for s in range(4)]
CASES.append(("scan_grad", *_scan_program(), [rulesets.scan, derivatives]))


def test_kept_prices_are_the_models_prices_bit_for_bit():
    """Every node of every program, priced by an extractor whose model keeps prices across the programs' snapshots
    (most prices of the later ones are kept ones), under three random choices each (a projection's price reads the
    node it projects), is the price the same model computes from the node's info, bit for bit."""
    model, rng = AnalyticCost(), random.Random(0)
    kept = priced = 0
    for name, fn, args, packs in CASES:
        snap = _snapshot(fn, args, packs).snapshot
        for _ in range(3):
            ex = Extractor(snap, model)
            ex._own = {}  # (not the snapshot's: each node priced here, by its kept price where there is one)
            choice = _random_choice(snap, rng)
            for c, ns in snap.nodes.items():
                for node in ns:
                    if node[0] in _CONTAINERS or ex.body_classes(*node):
                        continue
                    kept += ex.node_key(c, node[0], node[1], choice) in prices.kept(model)
                    priced += 1
                    price, want = ex.own(c, node, choice), model(ex.info(c, node[0], node[1], choice))
                    assert _bits(price) == _bits(want), (name, node, price, want)
    assert kept > priced / 2, (kept, priced)


def test_a_second_snapshot_prices_no_node_again(monkeypatch):
    """The same program's second snapshot (another e-graph) asks the model for no node price: each is kept by its
    key from the first; a model that keeps nothing (a subclass) asks for every one."""
    fn, args, packs = CASES[0][1:]
    first, second = _snapshot(fn, args, packs).snapshot, _snapshot(fn, args, packs).snapshot
    model = AnalyticCost()
    _, choice = Extractor(first, model).tree()
    _priced(Extractor(first, model), choice)
    calls = []
    real = AnalyticCost.__call__
    monkeypatch.setattr(AnalyticCost, "__call__", lambda self, n: calls.append(n) or real(self, n))
    ex = Extractor(second, model)
    ex._own = {}
    _priced(ex, ex.tree()[1])
    assert not [n for n in calls if not n.body_costs]
    fresh = Extractor(second, Fresh())
    _priced(fresh, fresh.tree()[1])
    assert len(calls) > 10 and "_kept_prices" not in Fresh().__dict__


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_whole_program_prices_are_unchanged(name):
    """A whole program's price, whose tie-break reads its ops' node prices through their keys (kept, or asked of
    the model once), equals a model's that keeps nothing, bit for bit, for the program chosen and random ones."""
    _, fn, args, packs = next(c for c in CASES if c[0] == name)
    res = _snapshot(fn, args, packs)
    model, fresh = AnalyticCost(), Fresh()
    kept_ex, fresh_ex = Extractor(res.snapshot, model), Extractor(res.snapshot, fresh)
    _, choice = kept_ex.tree()
    choices = [choice]
    rng = random.Random(1)
    for _ in range(3):  # the tree choice with some classes moved (a program: acyclic, every class it reads chosen)
        moved = dict(choice)
        for c, ns in res.snapshot.nodes.items():
            if rng.random() < 0.3 and len(ns) > 1:
                alt = rng.choice(ns)
                if all(k in moved for k in kept_ex.term_kids(alt)) and not kept_ex.reaches(
                        {**moved, c: alt}, kept_ex.term_kids(alt), {c}):
                    moved[c] = alt
        choices.append(moved)
    for ch in choices:
        a = model.program(ProgramPricer(kept_ex, model).program(ch, res.roots))
        b = fresh.program(ProgramPricer(fresh_ex, fresh).program(ch, res.roots))
        assert _bits(a) == _bits(b)
    assert len(prices.kept(model)) > 0


def test_kept_prices_are_bounded_and_dropped_when_the_table_of_primitives_changes(monkeypatch):
    """At most ``LIMIT`` prices are kept per model (the table is emptied when full), and none survives a change to
    the table of primitives (a replaced record may price its node otherwise)."""
    monkeypatch.setattr(prices, "LIMIT", 8)
    model = AnalyticCost()
    _, fn, args, packs = CASES[1]
    snap = _snapshot(fn, args, packs).snapshot
    ex = Extractor(snap, model)
    choice = ex.tree()[1]
    ex._own = {}
    prices.kept(model).clear()
    sizes = []
    for c, ns in snap.nodes.items():
        for node in ns:
            if node[0] not in _CONTAINERS and not ex.body_classes(*node):
                ex.own(c, node, choice)
                sizes.append(len(prices.kept(model)))
    assert max(sizes) == 8 and min(sizes[8:]) < 8, sizes
    table = prices.kept(model)
    register_primitive(OpSpec("test_prices_twice", "T", "elementwise"))
    try:
        assert prices.kept(model) is not table and not prices.kept(model)
    finally:
        unregister("test_prices_twice")


def test_a_second_snapshots_program_takes_its_ops_fusion_facts_as_kept():
    """The fusion model's per-op facts (``FusionModel._facts``: sizes, shares, tie-break) are kept by node key too: the
    same program's second snapshot (another e-graph, other templates) computes none afresh, and its whole-program
    price is a model's that keeps nothing, bit for bit. A subclass's fusion model keeps none."""
    fn, args, packs = CASES[0][1:]
    first, second = _snapshot(fn, args, packs), _snapshot(fn, args, packs)
    model = AnalyticCost()
    fusion = model.program_fusion()
    ex = Extractor(first.snapshot, model)
    model.program(ProgramPricer(ex, model).program(ex.tree()[1], first.roots))
    kept = dict(prices.kept(fusion))
    ex = Extractor(second.snapshot, model)
    choice = ex.tree()[1]
    prog = ProgramPricer(ex, model).program(choice, second.roots)
    price = model.program(prog)
    keyed = [op for op in prog.ops if op.memo and prices.NODE_KEY in op.memo and fusion._facts_key in op.memo]
    assert len(keyed) > 5 and prices.kept(fusion) == kept
    assert all(op.memo[fusion._facts_key] is kept[op.memo[prices.NODE_KEY]] for op in keyed)
    fresh = Fresh()
    fresh_ex = Extractor(second.snapshot, fresh)
    assert _bits(price) == _bits(fresh.program(ProgramPricer(fresh_ex, fresh).program(choice, second.roots)))
    assert not fresh.program_fusion().keeps_facts


def test_an_ops_facts_read_with_its_key_are_those_read_apart(monkeypatch):
    """``Extractor.keyed_info`` (the node key and the info of a node without bodies, its avals read once, which the
    whole-program price's ops' facts take: ``cost/program.py``'s ``_template``) gives the key ``node_key`` gives and
    the info ``info`` gives, the same avals and params objects, for every such node of every case under random
    choices; and the tree pass's program's ops built with it are those built without it (``keyed_info`` hidden), field
    by field, each op's kind as its memo holds it the kind read off it, and priced the same, bit for bit."""
    model, rng = AnalyticCost(), random.Random(1)
    checked = 0
    for name, fn, args, packs in CASES:
        res = _snapshot(fn, args, packs)
        snap = res.snapshot
        ex = Extractor(snap, model)
        choice = _random_choice(snap, rng)
        for c, ns in snap.nodes.items():
            for ctor, a in ns:
                if ctor in _CONTAINERS or ctor in ("Lit", "Const", "Param", "Tok", "Proj") or ex.body_classes(ctor, a):
                    continue
                key, info = ex.keyed_info(c, ctor, a)
                want = ex.info(c, ctor, a, choice)
                assert key == ex.node_key(c, ctor, a, choice), (name, ctor)
                assert all(x is y for x, y in zip(key, ex.node_key(c, ctor, a, choice)))
                assert (info.op, info.family, info.body_costs) == (want.op, want.family, want.body_costs), (name, ctor)
                assert info.params is want.params and len(info.in_avals) == len(want.in_avals)
                assert all(x is y for x, y in zip(info.in_avals + info.out_avals, want.in_avals + want.out_avals))
                assert len(info.out_avals) == len(want.out_avals), (name, ctor)
                checked += 1

        def ops(hidden, snap, choice, roots):
            if hidden:
                monkeypatch.delattr(Extractor, "keyed_info")
            try:
                fresh = Extractor(snap, model)
                prog = ProgramPricer(fresh, model).program(choice, roots)
                return prog, model.program(prog)
            finally:
                monkeypatch.undo()

        tree_choice = ex.tree()[1]  # (a random choice may make a cycle)
        (with_key, price), (apart, price_apart) = (ops(h, snap, tree_choice, res.roots) for h in (False, True))
        assert _bits(price) == _bits(price_apart), name
        fields = lambda op: (op.prim, op.family, op.params, op.args, op.in_avals, op.out_avals, op.own,  # noqa: E731
                             (op.memo or {}).get(prices.NODE_KEY))
        assert [fields(op) for op in with_key.ops] == [fields(op) for op in apart.ops], name
        assert all(cost_program._kind(op) == cost_program._kind_of(op) for op in with_key.ops), name  # (as kept)
    assert checked > 100, checked
