"""A ruleset listed for people: each rule with its ``lhs -> rhs``, by pack and soundness class.

The ``lhs -> rhs`` line is the comment a rule's author wrote beside it, on the
line that names the rule (the packs' house style, ``# |-x| -> |x|``), read
from the source where :func:`rewrite.rule` was called. ``docs/packs.md`` is
this listing of the built-in packs, made by ``python -m rulesets._listing``
and checked against the packs by the test suite, so it cannot go stale.

>>> import jax.numpy as jnp
>>> from rewrite import Ruleset, rule
>>> mine = Ruleset("mine", [
...     rule(lambda x: jnp.abs(jnp.abs(x)), lambda x: jnp.abs(x), name="abs_abs"),  # ||x|| -> |x|
... ], description="what I use")
>>> print(ruleset_markdown(mine))
## `mine` (exact)
<BLANKLINE>
what I use
<BLANKLINE>
| rule | rewrite |
|---|---|
| `abs_abs` | \\|\\|x\\|\\| -> \\|x\\| |
<BLANKLINE>
"""

from __future__ import annotations

import linecache
import re

from ..rules.rule import Rule
from ..rules.ruleset import Ruleset


def _lines(path: str) -> list[str]:
    # linecache: it also knows code that has no file (a doctest's examples)
    return [line.rstrip("\n") for line in linecache.getlines(path)]


def rule_summary(r: Rule) -> str | None:
    """The first ``# lhs -> rhs`` comment among the lines of the call that defined ``r``, or ``None``.

    The call runs from the line :func:`rewrite.rule` was called on to the line before the next call
    (or the end of the list), at most eight lines."""
    if r.defined_at is None:
        return None
    path, line = r.defined_at
    lines = _lines(path)
    start = min(line - 1, len(lines) - 1)
    if start < 0:
        return None
    while start > 0 and start > line - 8 and not _STARTS.search(lines[start]):
        start -= 1  # a multi-line call may report one of its later lines
    for i, text in enumerate(lines[start:start + 8]):
        if i and (_STARTS.search(text) or text.lstrip().startswith("]")):
            break
        code, sep, comment = text.partition("  # ")
        if sep and "->" in comment:
            return comment.strip()
    return None


_STARTS = re.compile(r"^\s*rule\(")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def ruleset_markdown(rs: Ruleset, level: int = 2) -> str:
    """``rs`` as Markdown: a heading with its soundness class, its description, and a table of its own rules;
    then each part ruleset the same way, one level down."""
    out = [f"{'#' * level} `{rs.name}` ({rs.soundness})", ""]
    if rs.description:
        out += [rs.description, ""]
    if rs.rules:
        out += ["| rule | rewrite |", "|---|---|"]
        for r in rs.rules:
            summary = rule_summary(r)
            out.append(f"| `{r.name}` | {_cell(summary) if summary else '(no summary)'} |")
        out.append("")
    for part in rs.parts:
        out.append(ruleset_markdown(part, level + 1))
    return "\n".join(out)
