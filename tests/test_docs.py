"""The documentation's examples run: every ```python block of docs/*.md and README.md.

The blocks of one file run in order, in one namespace, as a reader would
run them. A block right after a line ``<!-- no-test -->`` is skipped (for
examples that need a GPU, a network, or minutes).
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
SKIP = "<!-- no-test -->"


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(first line number, code, skipped) for each ```python block of a Markdown text."""
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").splitlines()
        skipped = bool(before) and before[-1].strip() == SKIP
        out.append((text.count("\n", 0, m.start(1)) + 1, m.group(1), skipped))
    return out


def test_block_extraction():
    text = "intro\n```python\na = 1\n```\n<!-- no-test -->\n```python\nraise SystemExit\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n", False), (7, "raise SystemExit\n", True)]


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_examples_run(path, capsys):
    blocks = python_blocks(path.read_text())
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    ran = 0
    for line, code, skipped in blocks:
        if skipped:
            continue
        # Padding keeps line numbers in tracebacks equal to the file's.
        exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)
        ran += 1
    if path.parent.name == "docs":
        assert ran, f"{path.name} has no runnable example"
