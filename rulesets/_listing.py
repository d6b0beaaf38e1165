"""``docs/packs.md``: every built-in pack's rules, listed from the packs themselves.

Run ``python -m rulesets._listing`` after changing a pack; ``tests/test_packs_doc.py`` fails while the
page differs from what the packs say.
"""

from __future__ import annotations

import pathlib
import sys

import rulesets
from rewrite.report.listing import ruleset_markdown

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "packs.md"

HEAD = """# The built-in rule packs

Each pack is a `rewrite.Ruleset` exported by `rulesets` (`rulesets.algebra`, ...), made of smaller
rulesets that can be used alone. The soundness class says what a rule keeps: `exact` rules keep
every bit, `identity` rules are equal in real arithmetic (within the pack's tolerance), `fastmath`
rules change floating-point results and run only where named. Each rule is listed with the
`lhs -> rhs` its author wrote beside it. This page is made from the packs by
`python -m rulesets._listing`; the test suite checks that it is current. A rule is found by its
name, and `rewrite.report.listing.ruleset_markdown` lists a user's pack the same way:

```python
import rulesets
from rewrite.report.listing import ruleset_markdown

assert rulesets.algebra.rule("mul_one").name == "mul_one"
assert "| `mul_one` | x * 1 -> x |" in ruleset_markdown(rulesets.algebra)
```
"""


def page() -> str:
    return HEAD + "\n" + "\n".join(ruleset_markdown(getattr(rulesets, name)) for name in rulesets.PACKS)


if __name__ == "__main__":
    PAGE.write_text(page())
    sys.stdout.write(f"wrote {PAGE}\n")
