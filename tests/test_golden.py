"""Each built-in pack still does to the seed and corpus programs what its golden file says.

A failure prints which sections differ (before, rules fired, after, ...) and a
unified diff. If the change is meant, regenerate the files with
``python -m tests.golden --update`` and commit them with the change, so that
review sees what the packs now do. ``GOLDEN_PROGRAMS_ONLY=1`` ignores which
rules fired (for a change that renames rules and claims the programs are the same).
"""

from __future__ import annotations

import os

import pytest

from .golden import HERE, cases, check, compare, on_backend, stale

PROGRAMS_ONLY = os.environ.get("GOLDEN_PROGRAMS_ONLY", "") not in ("", "0")


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.key)
def test_golden(case):
    if on_backend() is not None:
        pytest.skip(on_backend())
    report = check(case, programs_only=PROGRAMS_ONLY)
    if report is not None:
        pytest.fail(report + "\n\nIf this change is meant: python -m tests.golden --update " + case.key, pytrace=False)


def test_every_pack_has_golden_files_and_none_is_stale():
    import rulesets

    assert {c.pack for c in cases()} == set(rulesets.PACKS)
    assert not stale(), f"golden files no case writes (python -m tests.golden --update removes them): {stale()}"
    assert all(c.path.parent.parent == HERE for c in cases())


def test_a_changed_program_is_reported_with_a_diff():
    case = next(c for c in cases() if c.key == "algebra/seed000")
    text = case.path.read_text()
    changed = text.replace(" sin ", " cos ", 1)
    assert changed != text
    report = compare(text, changed, name=case.key)
    assert report.startswith("golden algebra/seed000 differs in: before")
    assert "-" in report and "+" in report and " cos " in report
    renamed = text.replace("## rules fired\n", "## rules fired\nrenamed_rule 1\n")
    assert compare(text, renamed) is not None
    assert compare(text, renamed, programs_only=True) is None


def test_golden_files_are_priced_with_their_own_table_not_the_machines(monkeypatch):
    """Calibrating the machine again (here: a table where transcendentals are cheap and arithmetic is dear)
    changes what ``rewrite`` chooses, but not a golden file, which ``tests/golden/cost_table.json`` prices."""
    if on_backend() is not None:
        pytest.skip(on_backend())
    from rewrite.cost import calibration
    from rewrite.cost.model import AnalyticCost

    from .golden import _render

    case = next(c for c in cases() if c.key == "derivatives/softplus_vjp")
    cheap = {"sin", "cos", "exp", "log", "tanh"}
    recalibrated = {**calibration.CPU, "launch": 0.0,
                    "elementwise_ns": {k: 1.0 if k in cheap else 50.0 for k in calibration.CPU["elementwise_ns"]}}
    monkeypatch.setattr(calibration, "CPU", recalibrated)
    assert AnalyticCost().launch == 0.0  # the machine's table is the new one
    text = case.path.read_text()
    assert compare(text, _render(case)) is not None, "priced with the machine's table, the program would change"
    assert check(case) is None


def test_a_newer_jax_gets_a_file_of_its_own_only_where_its_program_differs(tmp_path, monkeypatch):
    """``--update`` on a JAX newer than the base files' writes ``<program>.jax-X.Y.txt`` only where what it
    makes differs from the file it would otherwise compare with; later versions inherit it; a file that
    repeats the one before it is stale."""
    from tests import golden

    if on_backend() is not None:
        pytest.skip(on_backend())
    case = golden.Case("pack", "prog", "test", build=None)
    monkeypatch.setattr(golden, "HERE", tmp_path)
    monkeypatch.setattr(golden, "cases", lambda: [case])
    (tmp_path / "pack").mkdir()
    case.base_path.write_text("made on the base JAX\n")
    made = {"text": "made on the base JAX\n"}
    monkeypatch.setattr(golden, "render", lambda c: made["text"])

    monkeypatch.setattr(golden, "_jax_minor", lambda: (0, 11))
    assert golden.update(case) is False and golden.versioned(case) == {}
    made["text"] = "jax 0.11 traces it differently\n"
    assert golden.update(case) is True
    assert case.path == tmp_path / "pack" / "prog.jax-0.11.txt" and golden.check(case) is None
    monkeypatch.setattr(golden, "_jax_minor", lambda: (0, 12))
    assert case.path.name == "prog.jax-0.11.txt" and golden.update(case) is False  # inherited
    monkeypatch.setattr(golden, "_jax_minor", lambda: (0, 10))
    assert case.path == case.base_path and golden.check(case) is not None
    assert golden.stale() == []
    (tmp_path / "pack" / "prog.jax-0.12.txt").write_text(made["text"])
    assert golden.stale() == [tmp_path / "pack" / "prog.jax-0.12.txt"]
