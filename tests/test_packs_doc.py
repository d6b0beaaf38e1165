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
