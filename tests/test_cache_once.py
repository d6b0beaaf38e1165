"""The disk cache's key and store, a first call's fixed cost: what they read of a ruleset, an aval or a dtype is
read once per object, and what they make is what reading it each time made (the same digest, the same program).
"""

from __future__ import annotations

import builtins

import jax
import jax.numpy as jnp
import numpy as np

from rewrite import Limits, Ruleset, Tolerance, rule
from rewrite.cache import fingerprint as _fp
from rewrite.cache import key as _key
from rewrite.cache import serialise
from rewrite.cache.fingerprint import fingerprint
from rewrite.ir.jaxapi import core

from .threads import in_threads

TOL = Tolerance(1e-3, 1e-4)
RULES = [rule(lambda x: x * 1.0, lambda x: x, name="mul_one_a"),
         rule(lambda x: x + 0.0, lambda x: x, name="add_zero_a"),
         rule(lambda x: 1.0 * x, lambda x: x, name="one_mul_a")]
PACK = Ruleset("once", RULES, soundness="identity", tolerance=TOL, limits=Limits(iterations=4), min_saving=0.1)


def test_a_rulesets_part_of_the_key_is_fingerprinted_once_for_all_its_rules(monkeypatch):
    """``rules_fingerprint`` fingerprints a ruleset's tolerance and limits once, not once per rule it owns (the
    identity packs: 112 rules of 18 rulesets, 1.5 -> 0.6 ms a first call); the digest is the one of each rule's
    parts written in full."""
    entries = [(r, PACK) for r in PACK]
    for r, _ in entries:  # the rules' own fingerprints are kept per rule already
        _key.rule_fingerprint(r)
    _key._LAST.clear()  # (a digest of these entries kept by an earlier key: none is made)
    seen = []
    real = _key.fingerprint
    monkeypatch.setattr(_key, "fingerprint", lambda x, *a: seen.append(x) or real(x, *a))
    digest = _key.rules_fingerprint(entries)
    assert sum(x is TOL for x in seen) == 1 and sum(x is PACK.limits for x in seen) == 1
    monkeypatch.setattr(_key, "fingerprint", real)
    full = [(_key.rule_fingerprint(r), o.soundness, fingerprint(o.tolerance), fingerprint(o.limits), o.min_saving)
            for r, o in entries]
    assert digest == fingerprint(full)


def test_a_ruleset_changed_between_keys_is_read_afresh():
    entries = [(r, PACK) for r in PACK]
    before = _key.rules_fingerprint(entries)
    other = Ruleset("once", RULES, soundness="identity", tolerance=Tolerance(1e-2, 1e-4), limits=PACK.limits,
                    min_saving=0.1)
    assert _key.rules_fingerprint([(r, other) for r in other]) != before
    assert _key.rules_fingerprint(entries) == before


def test_a_keys_rules_digest_is_kept_for_the_same_rules_and_read_afresh_where_a_ruleset_changed(monkeypatch):
    """The rules' part of the key is kept for the last few sets of entries (a rewrite's pipelines key the same 112
    rules again and again: 0.4-0.5 ms each), and is always the digest made afresh: a ruleset whose tolerance or
    back-off is replaced on the same object, whose soundness class or floor changed, a rule put in another's place,
    or limits given as a mapping (not the library's frozen ``Limits``, so not kept) are each read again."""
    pack = Ruleset("kept", RULES, soundness="identity", tolerance=TOL, limits=Limits(iterations=4))
    entries = [(r, pack) for r in pack]
    _key._LAST.clear()
    made = []
    real = _key._rules_fingerprint
    monkeypatch.setattr(_key, "_rules_fingerprint", lambda e: made.append(1) or real(e))

    def digest() -> str:
        got = _key.rules_fingerprint(entries)
        assert got == real(entries)  # whether kept or made: the digest made afresh
        return got

    first = digest()
    assert digest() == first and len(made) == 1  # kept
    pack.tolerance = Tolerance(1e-2, 1e-4)
    assert digest() != first and len(made) == 2
    pack.tolerance = TOL  # the first object again: the first digest
    assert digest() == first
    pack.limits = Limits(iterations=5)
    assert digest() != first
    pack.limits = {"iterations": 4}  # not the library's frozen type: never kept
    n = len(made)
    digest(), digest()
    assert len(made) == n + 2
    pack.limits, pack.min_saving = Limits(iterations=4), 0.25
    assert digest() != first
    pack.min_saving, pack.soundness = 0.0, "fastmath"
    assert digest() != first
    pack.soundness = "identity"
    assert digest() == first
    other = rule(lambda x: x * 1.0, lambda x: x, name="mul_one_b")
    entries[0] = (other, pack)
    assert digest() != first


def _program():
    """A program with constants of one dtype, made afresh by each trace (so another trace holds none of them)."""
    def f(x, w):
        a, b, c = np.arange(3, dtype=np.float32), np.full(3, 2.0, np.float32), np.full(3, 0.5, np.float32)
        h = (jnp.sin(x) * 2.0 + jnp.cos(x) + a) * b - c
        return (h @ w).astype(jnp.float16).sum() + jnp.float32(1.5) * jnp.linspace(0.0, 1.0, 3).sum()

    return jax.make_jaxpr(f)(jnp.ones((4, 3)), jnp.eye(3))


def _avals_and_dtype_params(jaxpr, written=None) -> tuple[set, int]:
    """The aval objects of ``jaxpr``'s variables and literals, its bodies' too, and its dtype params' count."""
    written = set() if written is None else written
    params = 0
    written |= {id(v.aval) for v in [*jaxpr.constvars, *jaxpr.invars, *jaxpr.outvars]}
    for e in jaxpr.eqns:
        written |= {id(v.aval) for v in [*e.invars, *e.outvars]}
        for v in e.params.values():
            params += isinstance(v, np.dtype)
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                params += _avals_and_dtype_params(inner, written)[1]
    return written, params


def test_each_aval_and_dtype_is_written_once_and_the_program_reads_back_alike(monkeypatch):
    """``dumps_program`` writes an aval object once, however many variables share it, and asks numpy for a dtype's
    name (and whether the name finds it again) once per dtype object: flax_seq2seq_loss's program writes 665 avals
    of 56 objects. The program read back prints as the one written."""
    closed = _program()
    avals = [v.aval for e in closed.jaxpr.eqns for v in [*e.invars, *e.outvars]]
    assert len({id(a) for a in avals}) < len(avals)  # variables share aval objects, which this test needs
    dtypes, by_name = [], []
    real_value, real_by_name = serialise._Writer.value, serialise._dtype_by_name
    monkeypatch.setattr(serialise._Writer, "value",
                        lambda self, x: (isinstance(x, np.dtype) and dtypes.append(x)) or real_value(self, x))
    monkeypatch.setattr(serialise, "_dtype_by_name", lambda d: by_name.append(d) or real_by_name(d))
    original = _program()  # the same program, another trace: none of its constants
    blob = serialise.dumps_program(closed, original)
    written, params = _avals_and_dtype_params(closed.jaxpr)
    assert len(dtypes) <= len(written) + params < len(avals)  # an aval's dtype: written once per aval object
    assert len(closed.consts) >= 2 and len(by_name) == len({id(np.asarray(c).dtype) for c in closed.consts})
    monkeypatch.undo()
    back = serialise.loads_program(blob, original)
    assert str(back) == str(closed)


class _Written(_fp._Canon):
    """The canonical walk as it wrote an aval's key before: the key's tuple, its repr made at each occurrence."""

    def aval(self, aval):
        return _fp.aval_key(aval)

    def put_tagged(self, tag, key):
        self.put((tag.decode()[1:-3], key))  # b"'in', " -> "in"

    def put_bytes(self, key):
        if isinstance(key, tuple):  # an aval's key (the others are written as bytes alike)
            self.put(key)
        else:
            super().put_bytes(key)


def test_a_programs_fingerprint_writes_each_avals_key_once_and_the_same_bytes(monkeypatch):
    """``program_fingerprint`` makes the repr of an aval's key once per aval object (a key holds its sharding's
    repr, written at every variable and literal before), and writes the bytes the key's repr at each occurrence
    wrote: the same digest."""
    closed = _program()
    canon, written = _fp._Canon(), _Written()
    written.closed(closed)
    avals = {id(v.aval): v.aval for v in _variables(closed.jaxpr)}
    keys_made = [_fp.aval_key(a) for a in avals.values()]
    made = []

    def counted(x):
        if type(x) is tuple and len(x) == 6 and type(x[0]) is tuple and x in keys_made:
            made.append(x)
        return builtins.repr(x)

    monkeypatch.setattr(_fp, "repr", counted, raising=False)
    canon.closed(closed)
    assert bytes(canon.out) == bytes(written.out)
    assert len(made) == len(avals) < len(_variables(closed.jaxpr))  # one repr per aval object, not per variable


def _variables(jaxpr):
    return [*jaxpr.constvars, *jaxpr.invars, *(v for e in jaxpr.eqns for v in [*e.invars, *e.outvars])]


class _Afresh(_fp._Canon):
    """The canonical walk as it wrote a param's value before: each occurrence fingerprinted afresh, by a walker of
    its own, and each variable by ``put``."""

    def value(self, x):
        if isinstance(x, (core.ClosedJaxpr, core.Jaxpr)) or type(x) in (tuple, list):
            return super().value(x)
        try:
            self.put(("fp", fingerprint(x)))
        except _fp.Unstable:
            self.opaque_value(x)

    def atom(self, v, env):
        if isinstance(v, core.Literal):
            return super().atom(v, env)
        self.put(("var", env[v]))


def test_a_programs_fingerprint_walks_each_param_object_once_and_writes_the_same_bytes(monkeypatch):
    """``program_fingerprint`` walks a param's value once per object (jaxmd_lj_forces' 28 ``jit`` equations hold one
    mesh and the same shardings, each walked by a walker of its own before: a program's key 0.6x) and a plain value
    by its bytes alone, and writes the bytes a walk of each occurrence wrote: the same digest."""

    @jax.jit
    def inner(x):
        return jnp.sin(x) * 2.0

    def f(x):
        return inner(inner(x) + 1.0) + inner(jnp.cos(x))

    closed = jax.make_jaxpr(f)(jnp.ones(8))
    calls = [e for e in closed.jaxpr.eqns if e.primitive.name in ("pjit", "jit")]
    assert len(calls) == 3
    shared = [k for k, v in calls[0].params.items()
              if not isinstance(v, (tuple, list, core.ClosedJaxpr)) and _fp._plain(v) is None
              and all(e.params[k] is v for e in calls)]
    assert shared  # the calls hold the same objects (their mesh, say)
    afresh = _Afresh()
    afresh.closed(closed)
    walked = []
    real = _fp.fingerprint
    monkeypatch.setattr(_fp, "fingerprint", lambda x, *a: walked.append(x) or real(x, *a))
    canon = _fp._Canon()
    canon.closed(closed)
    assert bytes(canon.out) == bytes(afresh.out)
    for k in shared:  # one walk of each shared object, not one per equation
        assert sum(x is calls[0].params[k] for x in walked) == 1, k
    assert not any(_fp._plain(x) is not None for x in walked)  # a plain value is not walked


def test_a_rule_reached_as_a_value_keys_alike_whatever_the_process_traced_or_interned_before():
    """A rule's procedure that names a pack, a rule or a process's trace cache (``rulesets/scan.py``'s ``_LIFTED``)
    walks them by value for the key: what the cache holds, and the rule's queries (whose atoms name params by the
    ids the process's interning gave them when the rule was made), depend on what the process did before, so a
    process whose packs' example checks ran at import keyed 13 of the identity packs' 112 rules apart. Neither is
    in a key: the digest is the same with the cache filled and the queries renumbered."""
    from rewrite.rules.builder import _Traces

    traces = _Traces(size=4)
    r = rule(lambda x: jnp.log(1.0 + x), lambda x: jnp.log1p(x), name="keyed_alike")
    before = fingerprint(("procedure's globals", traces, r))
    traces.put(("key",), jax.make_jaxpr(jnp.cos)(jnp.ones(3)))
    r.queries = list(reversed(r.queries)) + r.queries  # as another numbering would write them
    r.anchor_literals = frozenset({7})
    assert fingerprint(("procedure's globals", traces, r)) == before


def test_keys_made_on_several_threads_at_once_are_each_the_digest_made_afresh():
    """Rewrites on several threads key their rules at once: more sets of entries than are kept, each thread's
    digests always the ones made afresh, and no error from the table they share."""
    packs = [Ruleset(f"t{i}", RULES, soundness="identity", tolerance=Tolerance(10.0 ** -(i + 2), 1e-4))
             for i in range(12)]
    want = {id(p): _key._rules_fingerprint([(r, p) for r in p]) for p in packs}

    def work(k: int) -> None:
        for n in range(200):
            p = packs[(k + n) % len(packs)]
            assert _key.rules_fingerprint([(r, p) for r in p]) == want[id(p)]

    errors = in_threads(work, 6)
    assert not errors, errors[:1]
