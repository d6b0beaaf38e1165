"""docs/packs.md lists every built-in pack's rules as the packs are (issue 31: a listing that cannot go stale)."""

import rulesets
from rewrite.report.listing import rule_summary
from rulesets import _listing


def _all(rs):
    yield rs
    for part in rs.parts:
        yield from _all(part)


def test_the_page_is_what_the_packs_say():
    assert _listing.PAGE.read_text() == _listing.page(), "run `python -m rulesets._listing` and commit docs/packs.md"


def test_every_built_in_rule_has_its_lhs_to_rhs_beside_it():
    missing = [r.name for name in rulesets.PACKS for r, _ in getattr(rulesets, name).entries() if not rule_summary(r)]
    assert not missing, missing


def test_every_built_in_pack_and_part_has_a_description():
    missing = [rs.name for name in rulesets.PACKS for rs in _all(getattr(rulesets, name)) if not rs.description]
    assert not missing, missing


def test_help_on_every_pack_and_part_shows_its_own_description():
    """docs/api.md sends users to help(rulesets.attention): it must describe the pack, not the Ruleset class."""
    import importlib
    import pydoc

    from rewrite import Ruleset

    generic = Ruleset.__doc__.splitlines()[0]
    for name in rulesets.PACKS:
        pack = getattr(rulesets, name)
        page = pydoc.render_doc(pack, renderer=pydoc.plaintext)
        intro = importlib.import_module(f"rulesets.{name}").__doc__.splitlines()[0]
        assert intro in pack.__doc__ and intro in page, name
        assert generic not in page, name
        for part in _all(pack):
            assert part.description in part.__doc__ and generic not in pydoc.render_doc(part), (name, part.name)
            assert all(r.name in part.__doc__ for r in part.rules), (name, part.name)
