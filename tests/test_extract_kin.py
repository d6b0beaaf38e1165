"""``Extractor._kin_pass`` and ``extract.kin.kin_rank``: an extraction from a copy of a snapshot with fewer nodes
(``Snapshot.without``: a ``min_saving`` copy, the snapshot without its recomputing nodes) reads the tree pass and the
ranks its kin made already, where they are the same, and passes again only the classes above a node the two differ in.
Each such pass is the pass the extractor would have made alone, in the same order, and the programs come out the
same."""

import jax
import jax.numpy as jnp
import pytest

import rulesets
from rewrite import rewrite
from rewrite import pipeline
from rewrite.extract.extractor import Extractor


def _gelu_vjp(x, g):
    return jax.vjp(lambda v: jax.nn.gelu(v, approximate=True), x)[1](g)[0]


CASES = {
    # linalg's reorder (floor 10%) saves less than its floor: extracted again from a copy without linalg's nodes
    "floored_reorder": (lambda a, b, c: (a @ b) @ c, (jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.ones((64, 60))),
                        [rulesets.linalg]),
    # the GELU's backward, which nn_remat recomputes: extracted without its nodes, then priced with them
    "gelu_backward": (_gelu_vjp, (jnp.ones((512, 1024)), jnp.ones((512, 1024))), [rulesets.nn]),
}


def _run(name):
    fn, args, packs = CASES[name]
    r = rewrite(fn, rulesets=packs, cache=False)
    closed = jax.make_jaxpr(fn)(*args)
    return pipeline.run_pipeline(closed, r.entries, r.cost_model, r.limits, price_input=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_copys_tree_pass_is_read_off_its_kins_as_its_own_pass_makes_it(name, monkeypatch):
    """Every pass read off a kin's equals the extractor's own pass, made afresh by a new extractor of the same
    snapshot (its costs and choices, in the same order); at least one is read so (a count: none before); and the
    program extracted is the one extracted with every pass made afresh."""
    real = Extractor._kin_pass
    read: list = []

    def checked(self):
        got = real(self)
        if got is not None:
            fresh = Extractor(self.snap, self.model)._tree_pass(None)
            read.append((list(got[0].items()) == list(fresh[0].items()),
                         list(got[1].items()) == list(fresh[1].items()), self.kin_dirty, len(self.snap.nodes)))
        return got

    monkeypatch.setattr(Extractor, "_kin_pass", checked)
    kin = _run(name)
    assert read and all(costs and choices for costs, choices, _, _ in read), read
    assert all(dirty < classes for _, _, dirty, classes in read), read  # only the classes above a change passed again
    monkeypatch.setattr(Extractor, "_kin_pass", lambda self: None)
    alone = _run(name)
    assert str(kin.after) == str(alone.after) and kin.cost_after == alone.cost_after
    assert kin.rewritten == alone.rewritten


def test_a_copy_with_fewer_nodes_takes_its_kins_ranks_and_reaches_alike():
    """A copy of a snapshot without some nodes (here those nn_remat built, as ``extract.policy.withheld``'s copy) takes the ranks its
    kin made (a count: it makes none of its own), and every cycle check of a move (``Extractor.reaches``: from the
    kids of each node of each class, to that class, under the copy's tree choice) answers as under the copy's own
    ranks."""
    from rewrite import explain
    from rewrite.extract.policy import made_by

    fn, args, packs = CASES["gelu_backward"]
    report = explain(fn, *args, rulesets=packs)
    r = report.result
    full = Extractor(r.snapshot, report.model)
    ranks = full.rank
    made = made_by(r.snapshot, r.egraph, {n for n in r.stats if n.startswith("nn_remat")}, r.original)
    copy = r.snapshot.without(lambda cls, node: node in made)
    lent, own = Extractor(copy, report.model), Extractor(copy, report.model)
    lent.share_prices(full)
    assert made and lent.rank is ranks and lent.kin_ranks == 1 and own.kin_ranks == 0
    assert own.rank is not ranks and own.kin_ranks == 0
    _, choice = own.tree()
    asked = 0
    for cls, nodes in copy.nodes.items():
        for node in nodes:
            kids = [k for k in own.term_kids(node) if k in choice]
            if cls in choice and kids:
                asked += 1
                assert lent.reaches(choice, kids, {cls}) == own.reaches(choice, kids, {cls}), (cls, node)
    assert asked > 10, asked
    report.release()


def test_rules_that_built_nothing_take_the_same_copy():
    """``extract.policy.copy_without``: two sets of rules that differ only in rules that built no name of the e-graph
    withhold the same nodes (``made_by``'s dict, its order too) and take one copy, as a VJP's gradients alone, extracted
    under the pipeline's rules, take their joint's copy from an e-graph saturated without some of them
    (``grad/vjp.py``'s ``_joint_choices``, ``grad/together.py``'s ``joint_rules``); a rule that built a node takes
    another copy, without that node too."""
    from rewrite import explain
    from rewrite.extract.policy import copy_without, made_by

    report = explain(lambda a, b, c, d: ((a @ b) @ c, a @ (b @ d)), jnp.ones((64, 64)), jnp.ones((64, 64)),
                     jnp.ones((64, 60)), jnp.ones((64, 60)), rulesets=[rulesets.linalg])
    r = report.result
    snap, eg, original = r.snapshot, r.egraph, r.original
    built = {o for o in eg.vorigin if o is not None}
    assert {"la_assoc_left", "la_assoc_right"} <= built, built
    idle = sorted(n for n in r.stats if n not in built)[:3]  # rules of the run that made no name
    assert idle
    left = frozenset({"la_assoc_left"})
    copy, made = copy_without(snap, eg, left, original)
    assert made and copy is not snap
    again, made_again = copy_without(snap, eg, left | set(idle), original)
    assert again is copy and made_again is made
    assert list(made.items()) == list(made_by(snap, eg, set(left | set(idle)), original).items())
    both, made_both = copy_without(snap, eg, left | {"la_assoc_right"}, original)
    assert both is not copy and set(made) < set(made_both)
    assert all(node not in ns for ns in both.nodes.values() for node in made_both)
    assert any(node in ns for ns in copy.nodes.values() for node in made_both if node not in made)
    report.release()
