"""The e-graph runtime's shortcuts keep their promises: a lent e-graph comes back empty and is never
shared by two live ones, nodes loaded from rows are the nodes actions would have made, and a rule's
function traced directly is the jaxpr make_jaxpr gives, its function called once."""

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core

from rewrite import _egraph, _terms
from rewrite._1_trace import trace_at
from rewrite._intern import PARAMS, TYPES

F32 = core.ShapedArray((3,), jnp.float32)


def _mul(eg, a, b):
    return eg.term(_terms.BY_PRIM["mul"].ctor, [a, b, PARAMS.intern_params(jax.lax.mul_p, {})], TYPES.intern_aval(F32))


def _rows(eg):
    snap = eg.snapshot()
    return {name: len(f.rows) for name, f in snap.functions.items() if f.rows}


def test_a_lent_egraph_comes_back_empty_and_is_lent_again():
    prelude = "(relation TestOnly (i64))"
    gc.collect()  # earlier tests' e-graphs go back to the pool now, not in the middle of this test
    first = _egraph.EGraph(prelude)
    inner = first.eg
    x = first.term("Param", [0, 0], TYPES.intern_aval(F32))
    _mul(first, x, x)
    first.assert_fact("NonZero", x)
    assert _rows(first)["V"] == 2
    del first  # nothing else refers to it: it goes back to the pool at once
    again = _egraph.EGraph(prelude)
    assert again.eg is inner  # the pool lent it again ...
    assert _rows(again) == {}  # ... empty: nodes, names, facts and loader rows popped
    y = again.term("Param", [0, 0], TYPES.intern_aval(F32))
    assert y == 0 and _rows(again)["V"] == 1  # names start afresh, the loader rules still work


def test_two_live_egraphs_never_share_an_instance():
    a, b = _egraph.EGraph(), _egraph.EGraph()
    assert a.eg is not b.eg
    a.term("Param", [0, 0], TYPES.intern_aval(F32))
    assert _rows(b) == {}


def test_egraphs_lent_across_threads_stay_apart():
    seen, errors = [], []

    def work(i):
        try:
            eg = _egraph.EGraph()
            x = eg.term("Param", [0, i], TYPES.intern_aval(F32))
            for _ in range(20):
                x = _mul(eg, x, x)
            seen.append((_rows(eg)["V"], id(eg.eg)))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and [n for n, _ in seen] == [21] * 4


def test_rows_make_the_nodes_actions_make():
    eg = _egraph.EGraph()
    x = eg.term("Param", [0, 0], TYPES.intern_aval(F32))
    y = eg.term("Param", [0, 1], TYPES.intern_aval(F32))
    m = _mul(eg, x, y)
    opaque = eg.term("Opaque", [eg.tlist([m, x]), PARAMS.intern_params(jax.lax.sin_p, {})], TYPES.intern_aval(F32))
    eg.union(opaque, y)
    snap = eg.snapshot()
    assert snap.cls_of_name[opaque] == snap.cls_of_name[y]  # a union from a row
    ctor, args = eg.canonical(snap, m)
    assert snap.egraph.lookup(ctor, list(args[:2]) + [eg.int_value(args[2])]) == snap.cls_of_name[m]
    assert snap.num_rows == sum(len(f.rows) for n, f in snap.functions.items() if not n.startswith("L_"))
    loaded = {name for name, f in snap.functions.items() if name.startswith("L_") and f.rows}
    assert loaded >= {"L_Param", "L_union"}  # these came as rows; the Opaque node (a list) as an action
    assert {c for cls in snap.nodes for c, _ in snap.nodes[cls]} >= {"Param", "Opaque", _terms.BY_PRIM["mul"].ctor}


def test_a_failed_command_leaves_the_pool_usable():
    eg = _egraph.EGraph()
    with pytest.raises(Exception):
        eg.eg.run_program(*eg.eg.parse_program("(relation Broken (NoSuchSort))"))
    del eg
    gc.collect()
    fresh = _egraph.EGraph()
    assert _rows(fresh) == {}
    fresh.term("Param", [0, 0], TYPES.intern_aval(F32))
    assert _rows(fresh)["V"] == 1


@pytest.mark.parametrize("fn", [
    lambda x, y: jnp.sin(x) * y + 2.0 * x,
    lambda x, y: (x, 3),
    lambda x, y: jnp.full((3,), 1.0, jnp.float32),
    lambda x, y: np.ones(3, np.float32) + 0 * y,
    lambda x, y: jax.lax.reduce_sum_p.bind(x * y, axes=(0,)),
])
def test_a_rule_function_traces_as_make_jaxpr_does(fn):
    made = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.float32))
    traced = trace_at(fn, [F32, F32])
    assert str(traced) == str(made) and traced.in_avals == made.in_avals and traced.out_avals == made.out_avals
    assert [np.asarray(c).tolist() for c in traced.consts] == [np.asarray(c).tolist() for c in made.consts]


def test_a_rule_function_that_raises_is_called_once():
    calls = []

    def fn(x):
        calls.append(1)
        raise LookupError("declined")

    with pytest.raises(LookupError):
        trace_at(fn, [F32])
    assert calls == [1]


def test_without_a_folder_to_write_rows_the_nodes_go_as_actions(monkeypatch):
    def unwritable(rows):
        raise OSError("read-only")

    monkeypatch.setattr(_egraph._Rows, "commands", staticmethod(unwritable))
    eg = _egraph.EGraph()
    x = eg.term("Param", [0, 0], TYPES.intern_aval(F32))
    y = eg.term("Param", [0, 1], TYPES.intern_aval(F32))
    m = _mul(eg, x, y)
    eg.union(m, y)
    eg.assert_fact("Pos", x)
    snap = eg.snapshot()
    assert snap.cls_of_name[m] == snap.cls_of_name[y] and snap.has_fact("Pos", snap.cls_of_name[x])
    assert not any(name.startswith("L_") and f.rows for name, f in snap.functions.items())
