"""A rule's example check is kept across processes in the disk cache's directory (``rewrite.cache.store.ExampleChecks``),
and a module's memo reached by a rule's procedure does not enter the rule's key (``rewrite.cache.fingerprint.memo``)."""

import importlib

import jax
import jax.numpy as jnp
import pytest

from rewrite import Pat, rule
from rewrite import define
from rewrite.cache import store
from rewrite.cache.fingerprint import fingerprint
from rewrite.cache.key import rule_parts

_X = (jax.ShapeDtypeStruct((3,), jnp.float32),)


def _double_neg(name="double_neg_cached", rhs=lambda x: x):
    return rule(Pat("neg", Pat("neg", Pat.var("x"))), rhs, name=name,
                example_program=(lambda x: -(-x), _X))


@pytest.fixture
def pipelines(monkeypatch, tmp_path):
    """The disk cache in a fresh directory, and a count of the example checks' pipelines."""
    monkeypatch.setenv(store.ENV, str(tmp_path))
    runs = []
    real = define.run_pipeline

    def counted(*a, **k):
        runs.append(1)
        return real(*a, **k)

    monkeypatch.setattr(define, "run_pipeline", counted)
    return runs


def test_a_rule_that_passed_its_check_is_not_checked_again(pipelines):
    _double_neg()
    assert len(pipelines) == 1
    _double_neg()  # the same code defined again (a second process imports the pack again)
    assert len(pipelines) == 1


def test_a_different_rule_is_checked(pipelines):
    _double_neg()
    _double_neg(rhs=lambda x: x * 1)
    assert len(pipelines) == 2


def test_a_failing_rule_fails_at_every_definition(pipelines):
    for _ in range(2):
        with pytest.raises(ValueError, match="typo"):
            rule(Pat("sin", Pat.var("x")), lambda x: jnp.sine(x), name="typo", example_program=(jnp.sin, _X))
    assert len(pipelines) == 2


def test_a_corrupt_or_foreign_entry_is_not_trusted(pipelines):
    r = _double_neg()
    key = store.CHECKS.key(r)
    path = store.resolve(None).file(key)
    assert path.exists()
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")  # corrupt: its checksum fails
    _double_neg()
    assert len(pipelines) == 2
    header, blob = store.resolve(None).read(key)  # checked again, and written over
    assert header["meta"] == {"example_check": "passed"}
    store.resolve(None).write(key, dict(header, meta={"example_check": "failed"}), blob)
    _double_neg()
    assert len(pipelines) == 3


def test_with_the_cache_off_every_definition_is_checked(monkeypatch, pipelines):
    monkeypatch.setenv(store.ENV, "off")
    _double_neg()
    _double_neg()
    assert len(pipelines) == 2


@pytest.mark.parametrize("module, cache, rule_name", [
    ("rulesets.scan", "_NOW", "buffer_to_output"),
    ("rulesets._diagonal", "_DIAGONAL", "la_diagonal_product"),
    ("rulesets.nn_lm_head", "_KINDS", "nn_lm_head_lse_256"),
])
def test_a_procedures_memo_does_not_move_its_rules_key(module, cache, rule_name):
    import rulesets

    mod = importlib.import_module(module)
    found = [r for p in (rulesets.scan, rulesets.linalg, rulesets.nn) for r, _ in p.entries() if r.name == rule_name]
    assert found, rule_name
    before = fingerprint(rule_parts(found[0]))
    memo = getattr(mod, cache)
    memo[("a key this test put", 1)] = "a value"  # what a rewrite of some program leaves there
    try:
        assert fingerprint(rule_parts(found[0])) == before
    finally:
        del memo[("a key this test put", 1)]
