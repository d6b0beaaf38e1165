"""The e-graph runtime's shortcuts keep their promises: a lent e-graph comes back empty and is never
shared by two live ones, nodes loaded from rows are the nodes actions would have made, and a rule's
function traced directly is the jaxpr make_jaxpr gives, its function called once."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core

from rewrite.ir import egraph as _egraph, loader as _loader_mod, primitives as _primitives, terms as _terms
from rewrite.jaxpr.trace import trace_at
from rewrite.ir.intern import PARAMS, TYPES

from .threads import in_threads

F32 = core.ShapedArray((3,), jnp.float32)


def _mul(eg, a, b):
    return eg.term(_primitives.BY_PRIM["mul"].ctor, [a, b, PARAMS.intern_params(jax.lax.mul_p, {})], TYPES.intern_aval(F32))


def _rows(eg):
    snap = eg.snapshot()
    return {name: len(f.rows) for name, f in snap.functions.items() if f.rows}


def _loaded_kinds(eg, snap):
    loader = _loader_mod._loader(_terms.schema())
    return {loader.kinds[eg.eg.value_to_i64(r.inputs[0])] for r in snap.rows(_loader_mod.LOAD)}


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


def test_an_egraph_no_longer_kept_for_its_rules_is_lent_to_other_rules_without_them():
    """The pool keeps few sets of rules; an e-graph it stops keeping for one goes back to the schema alone
    (declaring the schema is most of a new e-graph's cost) and is lent for the next set, which may declare
    the same names again."""
    pool = _egraph._Pool(per_text=1, texts=1)
    schema = _terms.schema()
    first = pool.take(schema, "(relation PoolA (i64))")
    first.run_program(*first.parse_program("(PoolA 1)"))
    pool.give(schema, "(relation PoolA (i64))", first, True)
    assert pool.take(schema, "(relation PoolA (i64))") is first  # kept for its own rules
    pool.give(schema, "(relation PoolA (i64))", first, True)
    second = pool.take(schema, "(relation PoolB (i64))")
    assert second is not first  # the first is still kept for its rules
    pool.give(schema, "(relation PoolB (i64))", second, True)  # ... and no longer: the pool keeps one set
    third = pool.take(schema, "(relation PoolA (i64)) (relation PoolC (i64))")
    assert third is first  # lent again, without PoolA's declaration (declared again here) or its row
    third.run_program(*third.parse_program("(PoolC 2)"))
    assert [r for r in third.freeze().functions["PoolA"].rows] == []


def test_a_new_egraph_parses_its_texts_a_form_at_a_time_and_once_per_process(monkeypatch):
    """A pool miss declares the schema, the loader and the rules' queries: each text is parsed a top-level form
    at a time (a text parsed whole hands every command a copy of it: the benchmarks' packs' queries took 0.2 s
    to parse and run, 0.05 s so), and once per process: a second miss runs the commands parsed for the first."""
    parsed: list[str] = []
    real = _egraph.eb.EGraph

    class Counting:
        def __init__(self):
            self.inner = real()

        def parse_program(self, text, *args, **kwargs):
            parsed.append(text)
            return self.inner.parse_program(text, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    bindings = type("Bindings", (), {k: getattr(_egraph.eb, k) for k in dir(_egraph.eb) if not k.startswith("_")})
    bindings.EGraph = Counting
    monkeypatch.setattr(_egraph, "eb", bindings)
    monkeypatch.setattr(_loader_mod, "_PARSED", {})
    pool = _egraph._Pool()
    schema = _terms.schema()
    prelude = "(relation ParsedA (i64))\n(relation ParsedB (i64 i64))"
    first = pool.take(schema, prelude)
    assert parsed and all(_loader_mod.forms(t) == [t.strip()] for t in parsed), parsed[:3]  # one form each
    assert "(relation ParsedB (i64 i64))" in parsed
    parsed.clear()
    second = pool.take(schema, prelude)  # a second miss: first is still lent
    assert second is not first and parsed == []
    second.run_program(*second.parse_program("(ParsedB 1 2)"))
    assert len(second.freeze().functions["ParsedB"].rows) == 1 and first.freeze().functions["ParsedB"].rows == []


def test_forms_reads_strings_and_comments_as_egglog_does():
    assert _loader_mod.forms('(a "x)" ; c)\n b)\n(c)') == ['(a "x)" ; c)\n b)', "(c)"]
    assert _loader_mod.forms("") == [] and _loader_mod.forms("x (a)") is None and _loader_mod.forms("(a") is None
    assert _loader_mod.forms('(a "\\")" ")") (b)') == ['(a "\\")" ")")', "(b)"]  # an escaped quote


def test_two_live_egraphs_never_share_an_instance():
    a, b = _egraph.EGraph(), _egraph.EGraph()
    assert a.eg is not b.eg
    a.term("Param", [0, 0], TYPES.intern_aval(F32))
    assert _rows(b) == {}


def test_egraphs_lent_across_threads_stay_apart():
    seen = []

    def work(i):
        eg = _egraph.EGraph()
        x = eg.term("Param", [0, i], TYPES.intern_aval(F32))
        for _ in range(20):
            x = _mul(eg, x, x)
        seen.append((_rows(eg)["V"], id(eg.eg)))

    errors = in_threads(work, 4)
    assert not errors and [n for n, _ in seen] == [21] * 4


def test_rows_make_the_nodes_actions_make():
    eg = _egraph.EGraph()
    x = eg.term("Param", [0, 0], TYPES.intern_aval(F32))
    y = eg.term("Param", [0, 1], TYPES.intern_aval(F32))
    m = _mul(eg, x, y)
    opaque = eg.term("Opaque", [eg.tlist([m, x, m, x]), PARAMS.intern_params(jax.lax.sin_p, {})],
                     TYPES.intern_aval(F32))  # (four operands: not a length LIST_ROWS loads from rows)
    eg.union(opaque, y)
    snap = eg.snapshot()
    assert snap.cls_of_name[opaque] == snap.cls_of_name[y]  # a union from a row
    ctor, args = eg.canonical(snap, m)
    assert snap.egraph.lookup(ctor, list(args[:2]) + [eg.int_value(args[2])]) == snap.cls_of_name[m]
    assert snap.num_rows == sum(len(f.rows) for n, f in snap.functions.items() if n != _loader_mod.LOAD)
    kinds = _loaded_kinds(eg, snap)
    assert kinds >= {"Param", "union"} and "Opaque" not in kinds  # rows; the Opaque node (a list) an action
    assert {c for cls in snap.nodes for c, _ in snap.nodes[cls]} >= {"Param", "Opaque", _primitives.BY_PRIM["mul"].ctor}


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
    def unwritable(*args):
        raise OSError("read-only")

    monkeypatch.setattr(_loader_mod._Rows, "commands", staticmethod(unwritable))
    eg = _egraph.EGraph()
    x = eg.term("Param", [0, 0], TYPES.intern_aval(F32))
    y = eg.term("Param", [0, 1], TYPES.intern_aval(F32))
    m = _mul(eg, x, y)
    eg.union(m, y)
    eg.assert_fact("Pos", x)
    snap = eg.snapshot()
    assert snap.cls_of_name[m] == snap.cls_of_name[y] and snap.has_fact("Pos", snap.cls_of_name[x])
    assert not snap.rows(_loader_mod.LOAD)


def _even_pow(eg, x):
    params = PARAMS.intern_params(jax.lax.integer_pow_p, {"y": 2})
    return eg.term(_primitives.BY_PRIM["integer_pow"].ctor, [x, params], TYPES.intern_aval(F32)), params


@pytest.mark.parametrize("writable", [True, False])
def test_every_kind_of_row_loads_from_the_one_relation_or_as_actions(monkeypatch, writable):
    if not writable:
        monkeypatch.setattr(_loader_mod._Rows, "commands", staticmethod(lambda *args: (_ for _ in ()).throw(OSError())))
    eg = _egraph.EGraph()
    x = eg.term("Param", [0, 0], TYPES.intern_aval(F32))
    lit = eg.literal(np.float32(2.0), core.ShapedArray((), jnp.float32))  # i64 arguments, and facts (Pos...)
    m = _mul(eg, x, x)
    p, params = _even_pow(eg, x)
    eg.union(m, p)
    assert eg.flush() is True and eg.flush() is False
    snap = eg.snapshot()
    assert snap.cls_of_name[m] == snap.cls_of_name[p]
    assert snap.has_fact("Pos", snap.cls_of_name[lit]) and snap.has_fact("NonZero", snap.cls_of_name[lit])
    assert eg.eg.lookup_function("EvenPow", [eg.int_value(params)]) is not None  # a relation on params ids
    lit_node = [n for n in snap.nodes[snap.cls_of_name[lit]] if n[0] == "Lit"]
    assert lit_node and lit_node[0][1] == tuple(eg.defs[lit][1])  # i64 columns taken as they are
    rows = snap.rows(_loader_mod.LOAD)
    widths = {len(r.inputs) for r in rows}
    # as wide as the widest kind: a flat constructor's name and arguments, or a LIST_ROWS node's name, other
    # arguments and items (the kind's id first)
    widest = max([1 + len(_terms.ctor_arg_sorts(c)) for c in _terms.flat_ctors()]
                 + [len(_terms.ctor_arg_sorts(c)) + n for c, n in _loader_mod.LIST_ROWS])
    assert (widths == {1 + widest}) if writable else not rows
    if writable:
        assert _loaded_kinds(eg, snap) == {"Param", "Lit", "union", "Pos", "NonNeg", "NonZero", "EvenPow",
                                           _primitives.BY_PRIM["mul"].ctor, _primitives.BY_PRIM["integer_pow"].ctor}


def test_the_loader_has_one_relation_and_a_rule_per_kind():
    loader = _loader_mod._loader(_terms.schema())
    text = _loader_mod.loader_program(_terms.schema())
    assert text.count("(relation ") == 1 and text.count("(rule ") == len(loader.kinds)
    assert set(loader.kinds) >= set(_terms.flat_ctors()) | {"union"} | set(_terms.FACTS) | set(_terms.param_relations())
    assert [loader.ids[k] for k in loader.kinds] == list(range(len(loader.kinds)))


def test_a_snapshot_is_taken_again_only_after_a_change():
    eg = _egraph.EGraph()
    x = eg.term("Param", [0, 0], TYPES.intern_aval(F32))
    first = eg.snapshot()
    assert eg.snapshot() is first  # nothing changed
    eg.union(x, x)  # a union of a name with itself is no row
    assert eg.snapshot() is first
    y = _mul(eg, x, x)
    second = eg.snapshot()
    assert second is not first and second.cls_of_name[y] is not None and first.cls_of_name[0] is not None
    eg.run("facts")
    assert eg.snapshot() is not second  # a run may change it
    del first, second
    gc.collect()
    ref = eg.snapshot()
    assert ref.cls_of_name[y] is not None


def test_an_egraph_held_by_its_snapshot_alone_goes_back_to_the_pool():
    gc.collect()
    prelude = "(relation TestOnlyToo (i64))"
    eg = _egraph.EGraph(prelude)
    inner = eg.eg
    snap = eg.snapshot()
    del eg
    assert snap.egraph.eg is inner
    del snap  # no cycle through the e-graph's memory of its last snapshot: it goes back at once
    assert _egraph.EGraph(prelude).eg is inner


def test_small_i64_values_are_the_same_in_every_egraph():
    # EGraph.int_value keeps these for the process (egglog stores them in the value itself)
    a, b = _egraph.EGraph(), _egraph.EGraph()
    b.term("Const", [2**40 + 5], TYPES.intern_aval(F32))  # an interned i64 in one of them only
    b.flush()
    for n in (0, 1, 12345, 2**31 - 1):
        va, vb = a.eg.eval_expr(_loader_mod.int_lit(n))[1], b.eg.eval_expr(_loader_mod.int_lit(n))[1]
        assert va == vb and hash(va) == hash(vb) and b.eg.value_to_i64(va) == n
        assert a.int_value(n) == vb
    assert a.int_value(2**40 + 7) == a.eg.eval_expr(_loader_mod.int_lit(2**40 + 7))[1]
    assert 2**40 + 7 not in _egraph._UNBOXED and b.int_value(-3) == b.eg.eval_expr(_loader_mod.int_lit(-3))[1]


def test_queries_of_one_signature_share_a_relation_and_are_read_apart():
    from rewrite import Ruleset, explain, rule
    from rewrite.rules.saturate import match_program
    from rewrite.rules.ruleset import entries_of

    pack = Ruleset("shared", [rule(lambda x: x * 1.0, lambda x: x, name="mul_one_s"),
                              rule(lambda x: x + 0.0, lambda x: x, name="add_zero_s"),
                              rule(lambda x, y: x * y + x, lambda x, y: x * (y + 1.0), name="factor_s")],
                   soundness="exact")
    entries = entries_of([pack])
    text, relations = match_program(entries)
    assert match_program(entries) == (text, relations) and match_program(list(entries))[0] is text  # made once
    (r1,), (r2,), (r3,) = relations
    assert r1[0][0] == r2[0][0] != r3[0][0]  # one relation for the two one-variable queries, another for x, y
    assert sorted(q for (_, q), _ in (r1, r2, r3)) == [0, 1, 2]
    from rewrite.rules.pattern import commuted
    assert text.count("(relation ") == 2  # each query's operand orders (``commuted``) record in its relation
    assert text.count("(rule ") == sum(len(commuted(q)) for r, _ in entries for q in r.queries)

    def fn(a, b):
        return (a * 1.0) * b + (a * 1.0) + (b + 0.0)

    x = jnp.arange(3.0, dtype=jnp.float32)
    report = explain(fn, x, x + 1.0, rulesets=[pack])
    assert report.fired.get("mul_one_s") == 1 and report.fired.get("add_zero_s") == 1
    assert report.fired.get("factor_s")  # (a*1)*b + (a*1): a two-variable query's matches, read apart


def test_a_released_egraph_is_lent_again_while_its_object_lives_on():
    gc.collect()
    prelude = "(relation TestOnlyReleased (i64))"
    eg = _egraph.EGraph(prelude)
    inner = eg.eg
    eg.term("Param", [0, 0], TYPES.intern_aval(F32))
    held = [eg]  # as a rule's closure in a cycle would hold it
    eg.release()
    again = _egraph.EGraph(prelude)
    assert again.eg is inner and _rows(again) == {}  # back in the pool, emptied
    with pytest.raises(AttributeError):
        held[0].flush() if held[0]._rows else held[0].eg.freeze()  # never used again
    del eg, held
    gc.collect()
    assert again.eg is inner  # the finalizer that already ran does not give it back twice


def test_a_rewrite_gives_its_egraph_back_even_when_a_rule_keeps_a_cycle(monkeypatch):
    from rewrite import Ruleset, procedural, rewrite, rule

    kept = []

    def rhs(m):
        def walk():  # a closure that refers to itself: a cycle, holding the match (and through it the e-graph)
            return walk, m
        kept.append(walk)
        return None

    pack = Ruleset("cyclic", [rule(lambda x: x * 2.0, procedural(rhs), name="cyclic_rule")], soundness="exact")
    x = jnp.arange(3.0, dtype=jnp.float32)
    gc.collect()
    gc.disable()  # the cycle is not collected while the test runs
    try:
        made = []
        monkeypatch.setattr(_egraph.EGraph, "release", lambda self, _r=_egraph.EGraph.release: (made.append(self.eg), _r(self))[1])
        np.testing.assert_allclose(rewrite(lambda v: v * 2.0 + 1.0, rulesets=[pack])(x), x * 2.0 + 1.0)
        assert kept and made
        free = [eg for (_, _), egs in _egraph._POOL._free.items() for eg in egs]
        assert any(eg is made[-1] for eg in free)  # back in the pool although the cycle still holds the EGraph
    finally:
        kept.clear()
        gc.enable()


def test_an_explained_rewrite_leaves_no_cycle_that_holds_its_egraph():
    """explain keeps its e-graph for the report; once the report is dropped, the e-graph goes back to the
    pool at once, without a garbage collection: the extractor's and the rules' recursive helpers (a loop
    body's cost, a product's tree of factors) leave no reference cycle behind."""
    import weakref

    import rulesets
    from rewrite import explain

    def f(x, a):
        def step(h, xs):
            h = jnp.tanh(h * a + jnp.sin(xs) ** 2 * jnp.cos(xs) * 2.0)
            return h, h * h
        return jax.lax.scan(step, x[0], x)[1].sum() * (a * x).sum() / a.sum()

    x, a = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), jnp.linspace(0.5, 1.5, 3)
    made = []
    real = _egraph.EGraph.__init__

    def remember(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(weakref.ref(self))

    _egraph.EGraph.__init__ = remember
    gc.collect()
    gc.disable()
    try:
        report = explain(f, x, a, rulesets=[rulesets.algebra, rulesets.derivatives, rulesets.scan])
        assert report.fired and made
        del report
        assert all(w() is None for w in made)
    finally:
        gc.enable()
        _egraph.EGraph.__init__ = real


@pytest.mark.parametrize("writable", [True, False])
def test_nodes_with_a_short_list_load_from_rows_as_actions_would_make_them(monkeypatch, writable):
    if not writable:
        monkeypatch.setattr(_loader_mod._Rows, "commands", staticmethod(lambda *args: (_ for _ in ()).throw(OSError())))
    eg = _egraph.EGraph()
    f32, b = TYPES.intern_aval(F32), TYPES.intern_aval(core.ShapedArray((3,), jnp.bool_))
    x = eg.term("Param", [0, 0], f32)
    y = eg.term("Param", [0, 1], f32)
    p = eg.term("Param", [0, 2], b)
    select = _primitives.BY_PRIM["select_n"].ctor
    two = eg.term(select, [p, eg.tlist([x, y]), PARAMS.intern_params(jax.lax.select_n_p, {})], f32)  # a row
    three = eg.term(select, [p, eg.tlist([x, y, x]), PARAMS.intern_params(jax.lax.select_n_p, {})], f32)  # an action
    opaque = eg.term("Opaque", [eg.tlist([y]), PARAMS.intern_params(jax.lax.cos_p, {})], f32)  # a row
    opaque3 = eg.term("Opaque", [eg.tlist([y, x, y]), PARAMS.intern_params(jax.lax.cos_p, {})], f32)  # a row
    i = eg.term("Param", [0, 3], TYPES.intern_aval(core.ShapedArray((), jnp.int32)))
    dyn, upd = _primitives.BY_PRIM["dynamic_slice"].ctor, _primitives.BY_PRIM["dynamic_update_slice"].ctor
    sliced = {n: eg.term(dyn, [x, eg.tlist([i, p, i, x][:n]), PARAMS.intern_params(jax.lax.dynamic_slice_p, {})], f32)
              for n in (2, 3, 4)}  # rows at 3 and 4 indices, an action at 2
    updated = {n: eg.term(upd, [x, y, eg.tlist([i, x, p, i][:n]), PARAMS.intern_params(jax.lax.dynamic_update_slice_p, {})],
                          f32) for n in (2, 3, 4)}  # rows at 2 and 4 indices, an action at 3
    made = [two, three, opaque, opaque3, *sliced.values(), *updated.values()]
    snap = eg.snapshot()
    for vid in made:  # each name's class holds the node made for it, lists included
        ctor, args = eg.canonical(snap, vid)
        assert (ctor, args) in snap.nodes[snap.cls_of_name[vid]]
    assert len({snap.cls_of_name[v] for v in made + [x, y, i]}) == len(made) + 3
    assert snap.list_items(eg.canonical(snap, two)[1][1]) == [snap.cls_of_name[x], snap.cls_of_name[y]]
    assert snap.list_items(eg.canonical(snap, updated[4])[1][2]) == [snap.cls_of_name[v] for v in (i, x, p, i)]
    if writable:
        assert _loaded_kinds(eg, snap) >= {"SelectN/2", "Opaque/1", "Opaque/3", f"{dyn}/3", f"{dyn}/4", f"{upd}/2",
                                           f"{upd}/4"}
        assert not {"SelectN/3", f"{dyn}/2", f"{upd}/3"} & _loaded_kinds(eg, snap)
    else:
        assert not snap.rows(_loader_mod.LOAD)


def test_a_literal_read_again_is_rounded_and_keyed_once(monkeypatch):
    """A program reads the same few literals again and again: each value and type is rounded to its dtype once
    (in a process: ``_LITERALS_MADE`` keeps what a literal makes, emptied here so that what other tests loaded
    before does not count), and gives the node a fresh read gives; values that differ in sign, type or dtype stay
    apart."""
    monkeypatch.setattr(_egraph, "_LITERALS_MADE", {})
    rounded = []
    real = _egraph.in_dtype
    monkeypatch.setattr(_egraph, "in_dtype", lambda v, d: rounded.append(v) or real(v, d))
    f32 = core.ShapedArray((), jnp.float32)
    eg = _egraph.EGraph()
    one = eg.literal(1.0, f32)
    assert [eg.literal(1.0, f32) for _ in range(3)] == [one] * 3 and len(rounded) == 1
    assert eg.literal(np.float32(1.0), f32) == one and len(rounded) == 2  # another value, the same node
    assert eg.literal(np.asarray(1.0, np.float32), f32) == one
    zero, minus = eg.literal(0.0, f32), eg.literal(-0.0, f32)
    assert zero != minus and eg.literal(-0.0, f32) == minus
    assert eg.literal(1, core.ShapedArray((), jnp.int32)) != one
    assert eg.literal(1.0, core.ShapedArray((), jnp.float32, weak_type=True)) != one
    eg.release()


def test_the_node_memo_keys_a_body_by_its_scope_and_outputs_and_a_list_by_its_items():
    """``EGraph.term`` gives the name it gave before for the same node: the same constructor, ids, lists and bodies.
    Two bodies of other scopes that return the same names are two nodes, as are two lists of other items."""
    eg = _egraph.EGraph()
    x, y = (eg.term("Param", [0, i], TYPES.intern_aval(F32)) for i in range(2))
    jit, pid, tup = _primitives.BY_PRIM["jit"].ctor, PARAMS.intern_params(jax.lax.sin_p, {}), TYPES.intern_tuple((F32,))
    s1, s2 = eg.new_scope(), eg.new_scope()
    one = eg.term(jit, [eg.body(s1, [x]), eg.tlist([x]), pid], tup)
    assert eg.term(jit, [eg.body(s1, [x]), eg.tlist([x]), pid], tup) == one  # equal refs, made anew: the same node
    assert eg.term(jit, [eg.body(s2, [x]), eg.tlist([x]), pid], tup) != one  # another scope
    assert eg.term(jit, [eg.body(s1, [y]), eg.tlist([x]), pid], tup) != one  # another output
    assert eg.term(jit, [eg.body(s1, [x]), eg.tlist([y]), pid], tup) != one  # another operand
    assert len({eg.term(jit, [eg.body(s1, [x]), eg.tlist(ops), pid], tup) for ops in ([], [x], [x, x])}) == 3
    eg.snapshot()  # they load
    eg.release()


def test_a_literal_loads_alike_in_every_egraph():
    """``EGraph.literal`` keeps what it made of a literal (its literal id and its value's facts) for the process: a
    later e-graph given the same value and aval makes the node and facts a first load makes."""
    scalar = core.ShapedArray((), jnp.float32)
    values = [1.0, 0.0, -0.0, -2.0, np.float32(1e-45), np.array(3.0, np.float32), 7]
    avals = [scalar] * 6 + [core.ShapedArray((), jnp.int32)]

    def load():
        eg = _egraph.EGraph()
        vids = [eg.literal(v, a) for v, a in zip(values, avals)]
        snap = eg.snapshot()
        facts = [{f for f in _terms.FACTS if snap.cls_of_name[v] in snap.with_fact(f)} for v in vids]
        out = [eg.defs[v] for v in vids], [eg.vtype[v] for v in vids], facts
        eg.release()
        return out

    _egraph._LITERALS_MADE.clear()
    first = load()  # made afresh
    assert len(_egraph._LITERALS_MADE) == len(values)
    assert load() == first  # read back
    assert first[2][:4] == [{"Pos", "NonNeg", "NonZero"}, {"NonNeg"}, set(), {"NonZero"}]
    assert first[2][4] == {"NonNeg"}  # a subnormal counts as zero
