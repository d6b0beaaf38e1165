"""``Builder.computes_each``'s shortcut (``rewrite.extract.choice.preferred_computes``): the outputs of a loop body
whose preferred trees compute them from the body's inputs are answered with one walk over all of them, and its yes
is ``choose_slice``'s for each output alone; and the bottom-up pass those searches prefer is made only where they have a
choice to make (``Builder._preferred``)."""

from __future__ import annotations

import random
import sys

import jax.numpy as jnp
import numpy as np

from rewrite import explain
from rewrite.extract import choice as _choice
from rewrite.rules import builder as _builder
from rewrite.rules.match import Match

from .test_rewrite_time_paths import explain_a_loop_of_four_outputs


class _Snap:
    """What the two walks read of a snapshot: its nodes per class."""

    def __init__(self, nodes):
        self.nodes = nodes


def _graph(rng: random.Random, n: int):
    """A random e-graph of ``n`` term classes (0..n-1), list classes and two bodies, with cycles, ``Param`` s of the
    bodies' two scopes, effects, and calls of the bodies, and a random ``prefer`` (sometimes a node the class lacks)."""
    nodes: dict = {}
    lists = []
    for j in range(3):  # list classes n.., each a one-item TList or empty
        c = n + j
        nodes[c] = [("TCons", (rng.randrange(n), n + 3)), ("TNil", ())] if j < 2 else [("TNil", ())]
        lists.append(c)
    nodes[n + 3] = [("TNil", ())]
    regions = [n + 4, n + 5]  # bodies of scopes 1 and 2, over the first two lists
    nodes[n + 4] = [("Body", (1, n))]
    nodes[n + 5] = [("Body", (2, n + 1))]
    for c in range(n):
        ns = []
        for _ in range(rng.randint(1, 3)):
            kind = rng.random()
            if kind < 0.35:
                ns.append(("Add", (rng.randrange(n), rng.randrange(n), 0)))
            elif kind < 0.6:
                ns.append(("Sin", (rng.randrange(n), 0)))
            elif kind < 0.72:
                ns.append(("Param", (rng.choice((1, 2)), rng.randrange(3))))
            elif kind < 0.8:
                ns.append(("Lit", (rng.randrange(3), 0)))
            elif kind < 0.85:
                ns.append(("Tok", (0,)))
            elif kind < 0.92:
                ns.append(("Opaque", (rng.choice(lists), 7)))
            else:
                ns.append(("Jit", (rng.choice(regions), rng.choice(lists), 7)))
        nodes[c] = list(dict.fromkeys(ns))
    prefer = {}
    for c, ns in nodes.items():
        r = rng.random()
        if r < 0.8:
            prefer[c] = rng.choice(ns)
        elif r < 0.9:
            prefer[c] = ("Sin", (rng.randrange(n), 0))  # perhaps not a node of c
    return nodes, prefer


def test_its_yes_is_choose_slice_s_for_each_root_alone():
    """On random graphs (cycles, ``Param`` s in and out of their bodies, effects, lists), every root the shared walk proves is one
    ``choose_slice`` finds a slice for, walked alone with a fresh memo; and it proves some."""
    rng = random.Random(7)
    proven = 0
    for _ in range(400):
        n = rng.randint(3, 14)
        nodes, prefer = _graph(rng, n)
        snap = _Snap(nodes)
        inputs = set(rng.sample(range(n), rng.randint(0, 3)))
        roots = rng.sample(range(n), rng.randint(1, n))
        said = _choice.preferred_computes(snap, roots, inputs, prefer)
        for r, ok in zip(roots, said):
            if ok:
                proven += 1
                assert _choice.choose_slice(snap, [r], inputs, prefer) is not None, (nodes, prefer, inputs, r)
    assert proven > 100, proven


def test_a_body_is_entered_with_its_scope_and_a_cycle_is_not_proven():
    """A ``Param`` is proven only inside a ``Body`` of its scope (as ``choose_slice`` takes it), and a class on a
    cycle of preferred nodes never is, though ``choose_slice`` may find it through another node."""
    nodes = {
        0: [("Param", (5, 0))],
        1: [("Sin", (0, 0))],
        2: [("TCons", (1, 3))], 3: [("TNil", ())],
        4: [("Body", (5, 2))],
        5: [("Add", (6, 7, 0))], 6: [("Sin", (5, 0)), ("Lit", (0, 0))], 7: [("Lit", (1, 0))],
    }
    prefer = {c: ns[0] for c, ns in nodes.items()}
    snap = _Snap(nodes)
    assert _choice.preferred_computes(snap, [4, 1, 5, 7], set(), prefer) == [True, False, False, True]
    assert _choice.choose_slice(snap, [4], set(), prefer) is not None
    assert _choice.choose_slice(snap, [5], set(), prefer) is not None  # (through 6's literal)
    # a class proven inside a body is not taken as proven outside it, where another root reads it
    nodes = {0: [("Param", (5, 0))], 1: [("TCons", (0, 2))], 2: [("TNil", ())], 3: [("Body", (5, 1))],
             4: [("Jit", (3, 2, 0))], 6: [("Sin", (0, 0))]}
    prefer = {c: ns[0] for c, ns in nodes.items()}
    assert _choice.preferred_computes(_Snap(nodes), [4, 6], set(), prefer) == [True, False]
    assert _choice.choose_slice(_Snap(nodes), [6], set(), prefer) is None


def test_a_loop_s_outputs_that_share_a_body_are_walked_once(monkeypatch):
    """``lift_independent`` asks of each stacked output whether the body's inputs compute it. Asked one by one, each
    output's ``choose_slice`` walked the body's shared classes again (flax_lm_step's joint: 25 outputs of 200-460
    classes each, 0.04 s). Those the preferred trees compute are answered by one shared walk; only the output that
    reads the carry is walked alone. The answers, and the classes a declined procedure is watched on, are those
    asked one by one."""
    walks: list = []
    asked: list = []
    slice_ = _builder.choose_slice

    def counted(snap, roots, *a, **k):
        f = sys._getframe(1)
        while f is not None and f.f_code.co_name != "computes_each":
            f = f.f_back
        if f is not None:
            walks.append(tuple(roots))
        return slice_(snap, roots, *a, **k)

    each = Match.computes_each

    def checked(self, outs, inputs):
        engine = self._engine
        before = None if engine.reads is None else set(engine.reads)
        alone = [engine._slice([v], inputs) is not None for v in outs]
        read_alone = None if engine.reads is None else set(engine.reads)
        if before is not None:
            engine.reads.clear()
            engine.reads.update(before)
        del walks[:]
        got = each(self, outs, inputs)
        asked.append((got, alone, list(walks), read_alone == (None if engine.reads is None else set(engine.reads))))
        return got

    monkeypatch.setattr(_builder, "choose_slice", counted)
    monkeypatch.setattr(Match, "computes_each", checked)

    report, _, _ = explain_a_loop_of_four_outputs()
    assert report.fired.get("lift_independent"), report.fired
    assert asked and all(got == alone and same_reads for got, alone, _, same_reads in asked), asked
    big = [(got, w) for got, _, w, _ in asked if len(got) >= 4]
    assert big, asked
    for got, w in big:
        assert sum(got) >= 3 and len(w) == got.count(False), (got, w)  # only the carry's output walked alone


def test_an_lm_head_s_search_is_preferred_only_where_it_has_a_choice(monkeypatch):
    """``nn_lm_head``'s site reads the shift back as a function of the rows' maximum (``Match.function``), whose
    search (``choose_slice``) tries the bottom-up pass's node first in each class it meets above its inputs. A class
    of one node has no choice to make, so the pass is made only below the classes of more than one node it may meet:
    it covered every class below the shift, the whole model under the logits (0.04 s a site on
    flax_long_context_step). Each slice is still the one the whole e-graph's pass gives."""
    from rewrite.cost.model import default_model
    from rewrite.extract.extractor import Extractor
    from rewrite.ir.walk import children, walk

    from .test_lm_head import NN, inputs, make

    def in_site() -> bool:
        f = sys._getframe(2)
        while f is not None and f.f_code.co_name != "_site":
            f = f.f_back
        return f is not None

    pending: list = []
    calls: list = []

    class Counted(Extractor):
        def tree_of(self, classes):
            if in_site():
                pending.extend(classes)
            return super().tree_of(classes)

    slice_ = _builder.choose_slice

    def recorded(snap, roots, inputs, prefer, visited=None):
        got = slice_(snap, roots, inputs, prefer, visited=visited)
        if in_site():
            whole = Extractor(snap, default_model()).tree()[1]
            kids = lambda c: [k for n in snap.nodes.get(c, ()) for k in children(n)]  # noqa: E731
            met = [c for c in walk(roots, lambda c: () if c in inputs else kids(c))
                   if c not in inputs and len(snap.nodes.get(c, ())) > 1]
            calls.append((got, slice_(snap, roots, inputs, whole), set(pending), set(walk(met, kids)),
                          set(walk(roots, kids))))
        del pending[:]
        return got

    monkeypatch.setattr(_builder, "Extractor", Counted)
    monkeypatch.setattr(_builder, "choose_slice", recorded)

    def loss(x, W1, W, b, y, w):
        return make("optax_int", "mean", False, 0, False)(jnp.tanh(x @ W1), W, b, y, w)

    h, W, b, y, w = inputs(np.random.default_rng(0), 1024, 64, 8192)
    report = explain(loss, h, jnp.eye(64) * 0.5, W, b, y, w, rulesets=[NN])
    assert any(k.startswith("nn_lm_head_lse_label_") for k in report.used), report.used
    assert calls
    for got, want, passed, may_meet, below in calls:
        assert got is not None and got == want  # the whole pass's slice
        assert passed <= may_meet < below, (len(passed), len(may_meet), len(below))


def test_a_restricted_pass_gives_the_whole_pass_s_choice_where_it_decides_the_slice(monkeypatch):
    """Where a class the slice search meets holds two nodes, the bottom-up pass over the classes below it alone
    (``Builder._preferred``) picks the node the whole e-graph's pass picks, and that choice decides the function read
    back. Here ``x * 2`` (one product) is also ``exp(log(x) + log 2)`` (two transcendentals), which a search without
    the pass takes first; the function read back is the product."""
    from rewrite import Pat, Ruleset, procedural, rule
    from rewrite.extract import extractor as _extractor

    passes: list = []
    reads: list = []

    class Counted(_extractor.Extractor):
        def _tree_pass(self, allowed, items=None):
            cost, choice = super()._tree_pass(allowed, items)
            if allowed is None and items is None:
                passes.append(None)
            else:
                whole = super()._tree_pass(None)[1]
                passes.append((self.snap, {c: (n, whole[c]) for c, n in choice.items()
                                           if len(self.snap.nodes.get(c, ())) > 1}))
            return cost, choice

    @procedural
    def read_back(m):
        f = m.function([m["y"]], [m["x"]])
        reads.append((m["y"].cls, m["x"].cls, None if f is None else [e.primitive.name for e in f.jaxpr.eqns]))
        return None

    rs = Ruleset("mine", [
        rule(lambda x: x * 2.0, lambda x: jnp.exp(jnp.log(x) + 0.6931471805599453), name="double_as_exp"),
        rule(Pat("tanh", Pat("exp", Pat("add", Pat("log", Pat.var("x")), Pat.lit(name="c")), name="y")), read_back,
             name="read_back"),
    ])
    monkeypatch.setattr(_builder, "Extractor", Counted)
    report = explain(lambda x: jnp.tanh(x * 2.0), jnp.ones(8), rulesets=[rs])
    assert report.fired.get("double_as_exp") and reads, (report.fired, reads)
    assert passes and None not in passes, passes  # a restricted pass, not the whole e-graph's
    (y, x, prims), = reads
    snap, met = passes[-1]
    assert y in met and all(n == whole for n, whole in met.values()), met  # the whole pass's choice, class by class
    assert sorted(ctor for ctor, _ in snap.nodes[y]) == ["Exp", "Mul"] and met[y][0][0] == "Mul"
    assert prims == ["mul"], prims  # the function read back takes the pass's node
    # and the pass decides it: a search without it takes the other node
    first = _choice.choose_slice(snap, [y], {x}, {})
    assert first is not None and first[y][0] == "Exp", first
