"""``benchmarks/fit_corpus.py``: which of the corpus's recorded pairs it rebuilds to re-price without timing."""

from __future__ import annotations

import json
import types


def test_the_pairs_rebuilt_include_what_rewrite_step_runs(monkeypatch, tmp_path):
    """A whole step's ``runs`` pair (``decisions.decide``: the step with its losses read from the loss-first program,
    what ``rewrite(step)`` runs) is rebuilt beside its ``chosen`` pair, so that ``fit_corpus --write`` re-prices it
    with the rest; it was left with its old prediction (flax_lm_step runs 1.40 where the table in force says 1.54)."""
    import rewrite
    from benchmarks import decisions as D
    from benchmarks import fit_corpus

    (tmp_path / "decisions.json").write_text(json.dumps({"meta": {}, "records": [
        {"case": "step", "pair": "chosen"}, {"case": "step", "pair": "runs"}]}))
    case = types.SimpleNamespace(name="step", mode="forward", blocks=(), build=lambda: (lambda x: x, (1.0,)))
    report = types.SimpleNamespace(before="as written", after="rewritten", runs="runs", step_used=True,
                                   result=types.SimpleNamespace(rewritten=True, after="rewritten"),
                                   declined=lambda: [])
    monkeypatch.setattr(D, "RESULTS", tmp_path)
    monkeypatch.setattr(D, "cases", lambda: [case])
    monkeypatch.setattr(D, "_flat", lambda fn, args: (fn, list(args)))
    monkeypatch.setattr(rewrite, "explain", lambda *a, **k: report)
    assert fit_corpus.pairs() == {("step", "chosen"): ("as written", "rewritten"), ("step", "runs"): ("as written", "runs")}
