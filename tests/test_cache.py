"""The disk cache of rewritten programs (rewrite/cache/store.py) and the no-regression guard (rewrite/cost/guard.py).

A stored program loads into a program that runs like the fresh rewrite (values, grad, vmap, jit,
shardings). Every way an entry can go bad (corrupt bytes, truncation, another format or version,
another program's entry, an unwritable directory, several writers at once) gives a fresh rewrite
and a warning, never a wrong program; a rule whose identity cannot be hashed turns caching off, with a warning.
"""

import dataclasses
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src import core
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from rewrite import AnalyticCost, Guard, Limits, RewriteWarning, Ruleset, rewrite, rule
from rewrite.cache.key import make_key
from rewrite.cache.serialise import FORMAT
from rewrite.cache.store import DiskCache, default_dir, resolve
from rewrite.cache.fingerprint import Unstable, fingerprint

ROOT = pathlib.Path(__file__).resolve().parent.parent

TRIG = Ruleset("trig", [
    rule(lambda x: 2 * jnp.sin(x) * jnp.cos(x), lambda x: jnp.sin(2 * x), name="double_angle"),
], soundness="identity")


def program(x, w):
    """A scan, a custom_jvp (relu), a constant array, literals and a rule that fires."""
    h = jax.nn.relu(x) @ w + jnp.arange(3.0)
    _, ys = jax.lax.scan(lambda c, a: (c + jnp.sin(a), c * 2.0), jnp.zeros(3), h)
    return (2 * jnp.sin(ys) * jnp.cos(ys)).sum() + jnp.log1p(jnp.abs(x)).sum()


ARGS = (jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), jnp.eye(3) * 0.5)


def entries(d):
    return sorted(pathlib.Path(d).rglob("*.rwx"))


def fresh_and_loaded(fn, args, d, **kw):
    first = rewrite(fn, cache=d, **kw)
    first.jaxpr(*args)
    second = rewrite(fn, cache=d, **kw)
    second.jaxpr(*args)
    return first, second


def test_a_second_instance_loads_the_stored_program_and_it_runs_alike(tmp_path):
    first, second = fresh_and_loaded(program, ARGS, tmp_path, rulesets=[TRIG])
    assert (first.loaded, second.loaded) == (0, 1)
    assert len(entries(tmp_path)) == 1
    r1, r2 = first.result(*ARGS), second.result(*ARGS)
    assert r1.cached is None and r2.cached == str(entries(tmp_path)[0])
    assert str(r2.after) == str(r1.after)
    assert r2.stats["double_angle"].fired == r1.stats["double_angle"].fired == 1
    assert (r2.cost_before, r2.cost_after, r2.stopped) == (r1.cost_before, r1.cost_after, r1.stopped)
    x, w = ARGS
    np.testing.assert_allclose(second(x, w), program(x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(second)(x, w), jax.jit(first)(x, w), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(second)(x, w), jax.grad(program)(x, w), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(jax.vmap(second, (0, None))(jnp.stack([x, -x]), w),
                               jax.vmap(program, (0, None))(jnp.stack([x, -x]), w), rtol=1e-5, atol=1e-5)


@jax.custom_vjp
def _clipped(x):
    return x


_clipped.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))

_KEY = jax.random.key(0)  # closed over: a constant of the program (a key's dtype has no NumPy array)
_RBG_KEYS = jax.random.split(jax.random.key(1, impl="rbg"), 3)

KINDS = {
    "while": (lambda x: jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 1.5), (0, x))[1],
              (jnp.ones(3),)),
    "cond": (lambda x, p: jax.lax.cond(p > 0, jnp.sin, jnp.cos, x), (jnp.ones(3), jnp.float32(1))),
    "nested_jit": (lambda x: jax.jit(lambda y: jnp.exp(y) * 2.0)(x) + 1, (jnp.ones(3),)),
    "custom_vjp": (lambda x: _clipped(x * 2.0).sum(), (jnp.ones(3),)),
    "grad_of_custom_vjp": (jax.grad(lambda x: _clipped(jnp.sin(x)).sum()), (jnp.ones(3),)),
    "remat_grad": (jax.grad(lambda x: jax.checkpoint(lambda y: jnp.sin(jnp.sin(y)))(x).sum()), (jnp.ones(3),)),
    "bfloat16": (lambda x: (x * jnp.bfloat16(3)).astype(jnp.float32), (jnp.ones(3, jnp.bfloat16),)),
    "typed_key": (lambda k, x: x + jax.random.normal(k, x.shape), (jax.random.key(0), jnp.ones(3))),
    "closed_over_key": (lambda x: x + jax.random.normal(_KEY, x.shape) * 1.0, (jnp.ones(3),)),
    "closed_over_rbg_keys": (lambda x: x * jax.random.uniform(_RBG_KEYS[1], x.shape), (jnp.ones(3),)),
    "callback": (lambda x: (jax.debug.callback(lambda v: None, x), x * 2)[1], (jnp.ones(3),)),
    "gather_and_ints": (lambda x, i: x[i, ::2].sum() + jnp.arange(3)[i[0]], (jnp.ones((4, 5)), jnp.arange(4))),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_programs_of_every_kind_load_alike(tmp_path, kind):
    fn, args = KINDS[kind]
    first, second = fresh_and_loaded(fn, args, tmp_path, rulesets=[TRIG])
    assert second.loaded == 1
    assert str(second.jaxpr(*args)) == str(first.jaxpr(*args))
    for p, q in zip(jax.tree_util.tree_leaves(second(*args)), jax.tree_util.tree_leaves(fn(*args))):
        np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(q, np.float32))


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def _constrained(x, w):
    y = 2 * jnp.sin(x) * jnp.cos(x) @ w
    return jax.lax.with_sharding_constraint(y * 3, NamedSharding(_mesh(), P("data", None)))


def _shard_mapped(x, w):
    def body(xb, wb):
        return jax.lax.psum((2 * jnp.sin(xb) * jnp.cos(xb)) @ wb, "model")

    return jax.shard_map(body, mesh=_mesh(), in_specs=(P("data", "model"), P("model", None)),
                         out_specs=P("data", None))(x, w)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (set by tests/conftest.py)")
@pytest.mark.parametrize("fn", [_constrained, _shard_mapped], ids=["sharding_constraint", "shard_map"])
def test_sharded_programs_load_and_keep_their_shardings(tmp_path, fn):
    mesh = _mesh()
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4) / 10, NamedSharding(mesh, P("data", "model")))
    w = jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P("model", None)))
    first, second = fresh_and_loaded(fn, (x, w), tmp_path, rulesets=[TRIG])
    assert second.loaded == 1
    assert str(second.jaxpr(x, w)) == str(first.jaxpr(x, w))
    want, got = jax.jit(fn)(x, w), jax.jit(second)(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (set by tests/conftest.py)")
def test_explicit_sharding_mode_loads(tmp_path):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.arange(32.0).reshape(8, 4) / 10, NamedSharding(mesh, P("data", "model")))
        f = lambda x: (2 * jnp.sin(x) * jnp.cos(x)).sum(axis=1)  # noqa: E731
        first, second = fresh_and_loaded(f, (x,), tmp_path, rulesets=[TRIG])
        assert second.loaded == 1
        out, want = jax.jit(second)(x), jax.jit(f)(x)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        assert out.sharding.spec == want.sharding.spec


# ---------------------------------------------------------------------- failure modes


def _damaged(tmp_path, damage):
    """Store an entry, damage it, and rewrite again in a new instance: a warning and a fresh rewrite."""
    first = rewrite(program, rulesets=[TRIG], cache=tmp_path)
    want = first(*ARGS)
    (path,) = entries(tmp_path)
    damage(path)
    again = rewrite(program, rulesets=[TRIG], cache=tmp_path)
    with pytest.warns(RewriteWarning, match="unusable"):
        got = again(*ARGS)
    assert again.loaded == 0 and again.result(*ARGS).cached is None
    np.testing.assert_array_equal(got, want)
    assert str(again.jaxpr(*ARGS)) == str(first.jaxpr(*ARGS))
    # the fresh result replaced the bad entry
    third = rewrite(program, rulesets=[TRIG], cache=tmp_path)
    np.testing.assert_array_equal(third(*ARGS), want)
    assert third.loaded == 1


def test_corrupt_bytes(tmp_path):
    def flip(path):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    _damaged(tmp_path, flip)


def test_truncated_entry(tmp_path):
    _damaged(tmp_path, lambda path: path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3]))


def test_empty_entry(tmp_path):
    _damaged(tmp_path, lambda path: path.write_bytes(b""))


@pytest.mark.parametrize("field", ["format", "jax", "jax-rewrite"])
def test_entry_of_another_format_or_version(tmp_path, field):
    def restamp(path):
        cache = DiskCache(tmp_path)
        key = path.stem
        header, blob = cache.read(key)
        if field == "format":
            header["format"] = FORMAT + 1
        else:
            header["env"][field] = "0.0.0-other"
        cache.write(key, header, blob)  # a valid checksum: only the stamp is wrong

    _damaged(tmp_path, restamp)


def test_entry_of_another_program_under_this_key(tmp_path):
    def swap(path):
        other = tmp_path / "other"
        rewrite(lambda x, w: jnp.sin(x) @ w, cache=other)(*ARGS)
        (src,) = entries(other)
        path.write_bytes(src.read_bytes())

    _damaged(tmp_path, swap)


def test_unhashable_rule_turns_the_cache_off_with_a_warning(tmp_path):
    marker = object()  # a closure value with no stable identity (its repr is its address)

    def guarded(x):
        return marker is not None

    odd = Ruleset("odd", [rule(lambda x: jnp.sin(x) * 1.0, lambda x: jnp.sin(x), name="odd_mul1", when=guarded)],
                  soundness="identity")
    f = rewrite(lambda x: jnp.sin(x) * 1.0, rulesets=[odd], cache=tmp_path)
    with pytest.warns(RewriteWarning, match="cache is off.*odd_mul1"):
        np.testing.assert_allclose(f(jnp.ones(3)), jnp.sin(jnp.ones(3)))
    assert entries(tmp_path) == []
    with pytest.raises(Unstable):
        fingerprint(guarded)


def test_loggers_and_locks_are_fingerprinted_by_name():
    """A rule's procedure that logs (``rulesets.attention``'s) reaches a logger, whose manager holds locks."""
    log, other = logging.getLogger("rewrite.test.a"), logging.getLogger("rewrite.test.b")
    lock = threading.Lock()

    def reports(x):
        with lock:
            log.info("%s", x)
        return x

    assert fingerprint(reports) == fingerprint(reports)
    assert fingerprint(log) != fingerprint(other)
    assert fingerprint(logging.LoggerAdapter(log, {})) == fingerprint(log)
    assert fingerprint(threading.Lock()) == fingerprint(lock) != fingerprint(threading.RLock())


def test_unwritable_directory_warns_once_and_rewrites(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    f = rewrite(program, rulesets=[TRIG], cache=blocker / "cache")
    with pytest.warns(RewriteWarning, match="cannot write the rewrite cache"):
        got = f(*ARGS)
    np.testing.assert_allclose(got, program(*ARGS), rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(jnp.ones((2, 3)), jnp.eye(3))  # another signature: no second warning for the same directory


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_read_only_directory(tmp_path):
    tmp_path.chmod(0o500)
    try:
        f = rewrite(program, rulesets=[TRIG], cache=tmp_path / "cache")
        with pytest.warns(RewriteWarning, match="cannot write"):
            f(*ARGS)
    finally:
        tmp_path.chmod(0o700)


def test_an_entry_is_written_without_waiting_for_the_disk(tmp_path, monkeypatch):
    """A store renames a complete file into place and does not ``fsync`` it (a first call's cost, 1-30 ms on a
    busy disk): what a power loss could tear fails the checksum (test_truncated_entry, test_empty_entry)."""
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(jnp.ones(3))
    cache = DiskCache(tmp_path)
    assert cache.store("cd" * 32, closed, {"note": "doubled sine"}, original=closed)
    assert synced == []
    program, meta = cache.load("cd" * 32, original=closed)
    assert meta == {"note": "doubled sine"} and [e.primitive.name for e in program.eqns] == ["sin", "mul"]


def test_failed_rename_leaves_no_temporary_file(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(os, "replace", refuse)
    f = rewrite(program, rulesets=[TRIG], cache=tmp_path)
    with pytest.warns(RewriteWarning, match="cannot write"):
        f(*ARGS)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


WRITER = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp
    from rewrite.cache.store import DiskCache
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(jnp.ones(64))
    cache = DiskCache(sys.argv[1])
    start = float(sys.argv[2])
    while time.time() < start:
        time.sleep(0.005)
    for i in range(40):
        assert cache.store("ab" * 32, closed, {{"writer": {writer}, "i": i}}, original=closed)
""")


class _waiting_for:
    def __init__(self, procs):
        self.procs = procs

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.wait(timeout=120)


def test_concurrent_writers_of_one_key(tmp_path):
    import time

    start = time.time() + 5.0  # every writer has imported JAX by then, so their stores overlap
    # the repository first, then whatever the caller's path holds (on a machine with packages beside the install)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER.format(writer=s), str(tmp_path), str(start)],
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=path))
             for s in (1, 2, 3)]
    cache = DiskCache(tmp_path)
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(jnp.ones(64))
    seen = set()
    with _waiting_for(procs), warnings.catch_warnings():
        warnings.simplefilter("error")  # a torn entry would warn
        while any(p.poll() is None for p in procs):
            found = cache.load("ab" * 32, original=closed)
            if found is not None:
                program, meta = found
                seen.add(meta["writer"])
                x = jnp.linspace(0, 1, 64)
                np.testing.assert_allclose(core.jaxpr_as_fun(program)(x)[0], jnp.sin(x) * 2.0, rtol=1e-6)
    assert [p.returncode for p in procs] == [0, 0, 0]
    program, meta = cache.load("ab" * 32, original=closed)
    assert meta["writer"] in (1, 2, 3) and meta["i"] == 39
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [f"{'ab' * 32}.rwx"]  # no temporaries left


def test_the_cache_hashes_stores_and_loads_with_the_older_objects_out_of_the_collectors_sight(tmp_path, monkeypatch):
    """A full collection that falls while the disk cache hashes, stores or loads a first call's program walks only
    the objects made since that began, as one in the pipeline does (``jaxpr.trace.collect_young_only``): in the
    ecosystem benchmark one fell in diffrax_neural_ode's store, 0.41 of its 0.45 s. Counted: the objects such a
    collection would walk, at each of the four stages, against the process's."""
    import gc

    import rewrite.cache.fingerprint as fingerprint_module
    import rewrite.cache.key as key_module
    import rewrite.cache.store as store_module

    walked: dict[str, list[int]] = {}

    def spy(where, real):
        def counted(*a, **k):
            walked.setdefault(where, []).append(len(gc.get_objects()))
            return real(*a, **k)
        return counted

    monkeypatch.setattr(fingerprint_module._Canon, "closed",
                        spy("fingerprint", fingerprint_module._Canon.closed))
    monkeypatch.setattr(key_module, "rules_fingerprint", spy("key", key_module.rules_fingerprint))
    monkeypatch.setattr(store_module, "dumps_program", spy("store", store_module.dumps_program))
    monkeypatch.setattr(store_module, "loads_program", spy("load", store_module.loads_program))
    process = len(gc.get_objects())
    assert process > 50_000  # jax and the suite: what a full collection walks otherwise
    first, second = fresh_and_loaded(program, ARGS, tmp_path, rulesets=[TRIG])
    assert (first.loaded, second.loaded) == (0, 1) and first.result(*ARGS).rewritten
    assert sorted(walked) == ["fingerprint", "key", "load", "store"]
    assert max(n for ns in walked.values() for n in ns) < process // 4, walked
    assert gc.get_freeze_count() == 0  # put back after


# ---------------------------------------------------------------------- the key


def test_the_key_follows_rules_models_limits_and_program():
    closed = jax.make_jaxpr(program)(*ARGS)
    ents = [(r, TRIG) for r in TRIG]
    base = make_key(closed, ents, AnalyticCost(), Limits())
    assert make_key(closed, ents, AnalyticCost(), Limits()) == base
    same_code = Ruleset("trig", [rule(lambda x: 2 * jnp.sin(x) * jnp.cos(x), lambda x: jnp.sin(2 * x),
                                      name="double_angle")], soundness="identity")
    assert make_key(closed, [(r, same_code) for r in same_code], AnalyticCost(), Limits()) == base
    other_rhs = Ruleset("trig", [rule(lambda x: 2 * jnp.sin(x) * jnp.cos(x), lambda x: jnp.sin(x + x),
                                      name="double_angle")], soundness="identity")
    assert make_key(closed, [(r, other_rhs) for r in other_rhs], AnalyticCost(), Limits()) != base
    fast = Ruleset("trig", list(TRIG), soundness="fastmath")
    assert make_key(closed, [(r, fast) for r in fast], AnalyticCost(), Limits()) != base
    assert make_key(closed, ents, AnalyticCost(node=6.0), Limits()) != base
    assert make_key(closed, ents, AnalyticCost(), Limits(iterations=3)) != base
    assert make_key(closed, ents, AnalyticCost(), Limits(), guard=Guard()) != base
    other = jax.make_jaxpr(program)(ARGS[0] * 2, ARGS[1])  # same program, other values: same key
    assert make_key(other, ents, AnalyticCost(), Limits()) == base
    wider = jax.make_jaxpr(program)(jnp.ones((5, 3)), ARGS[1])
    assert make_key(wider, ents, AnalyticCost(), Limits()) != base


def test_with_the_cache_off_no_key_is_made(monkeypatch):
    """``JAX_REWRITE_CACHE_DIR=off``: a first call fingerprints no rule (the identity packs' walk is most of a
    process's first cache key)."""
    from rewrite.cache import key as _key

    made = []
    monkeypatch.setattr(_key, "rules_fingerprint", lambda *a: made.append(a) or "")
    monkeypatch.setenv("JAX_REWRITE_CACHE_DIR", "off")
    f = rewrite(lambda x: jnp.sum(jnp.sin(x) ** 2), rulesets=[TRIG])
    f(jnp.ones(4))
    assert made == [] and "cache_key" not in f.result(jnp.ones(4)).times


def test_a_key_follows_an_object_two_rules_share():
    """Rules fingerprinted together walk an object they both reach once (``_Walker._memoised``): a change to it
    changes every such rule's key, and each key is the one it has alone."""
    from rewrite.cache.key import _RULES, rules_fingerprint

    table = {"k": 2.0}
    holder = type("Holder", (), {})()
    holder.table = table
    one = Ruleset("one", [rule(lambda x: x * holder.table["k"], lambda x: x + x, name="twice_a")])
    two = Ruleset("two", [rule(lambda x: holder.table["k"] * x, lambda x: x + x, name="twice_b")])
    ents = [(r, one) for r in one] + [(r, two) for r in two]

    def walked(entries):  # not read from the process's table of rules fingerprinted before
        for r, _ in ents:
            _RULES.pop(r, None)
        return rules_fingerprint(entries)

    before = walked(ents[:1]), walked(ents[1:]), walked(ents)
    table["k"] = 3.0
    assert walked(ents) != before[2] and walked(ents[:1]) != before[0] and walked(ents[1:]) != before[1]
    table["k"] = 2.0
    assert walked(ents) == before[2]


def test_an_object_many_functions_reach_is_written_as_its_digest():
    """A function or object walked by its attributes is written into what reaches it as the digest of its walk, so
    a large object reached from many places (a pack's ruleset, from each of its rules' examples) is hashed once,
    not copied into every walk that reaches it (the nn pack's rules wrote 0.9-1.8 MB each before, and a process's
    first cache key spent a third of its time there). The digest still follows the object's contents."""
    from rewrite.cache.fingerprint import _Walker

    holder = type("Holder", (), {})()
    holder.table = [float(i) for i in range(20_000)]
    fns = [lambda x, i=i: x * holder.table[i] for i in range(3)]
    w = _Walker({})
    w.walk(fns)
    assert len(w.out) < 2_000, len(w.out)  # three functions and one holder's digest, not three copies of 20k floats
    before = fingerprint(fns)
    assert fingerprint(fns, {}) == before and fingerprint(list(fns), {}) == before
    holder.table[-1] = -1.0
    assert fingerprint(fns) != before


def test_the_packs_helpers_are_named_and_their_sources_are_in_the_key(tmp_path, monkeypatch):
    """The built-in packs are this library's: a key names their module-level helpers, as it names ``rewrite``'s,
    and hashes their sources into its environment instead (a process's first key walked the helpers for every rule
    that reached them: half its time). A rule's own function is still walked, with its closure; a module of the
    user's named ``rulesets`` elsewhere would not be named."""
    import rulesets.nn_lm_head_kernels as kernels
    from rewrite.cache import fingerprint as fp
    from rewrite.cache import key

    folder = pathlib.Path(kernels.__file__).resolve().parent
    assert fp.own_packs() and fp.PACKS == folder
    w = fp._Walker({})
    w.walk(kernels.blocked_loss)
    assert b"named" in w.out and b"blocked_loss" in w.out  # by its module and name, not its code
    def made(k):  # a rule's own function: walked, with its closure
        return lambda x: kernels.blocked_loss(x) * k

    assert fingerprint(made(2.0)) != fingerprint(made(3.0))

    copy = tmp_path / "rulesets"
    copy.mkdir()
    for p in folder.glob("*.py"):
        (copy / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(key, "PACKS", copy)
    before = key.environment.__wrapped__()["jax-rewrite"]
    (copy / "nn_lm_head_kernels.py").write_text((copy / "nn_lm_head_kernels.py").read_text() + "\n# edited\n")
    assert key.environment.__wrapped__()["jax-rewrite"] != before

    monkeypatch.setattr(fp, "PACKS", copy)  # packs loaded from elsewhere than the folder hashed: walked, not named
    fp._OWN.clear()
    try:
        assert not fp.own_packs()
        w = fp._Walker({})
        w.walk(kernels.blocked_loss)
        assert w.out.startswith(b"digest") and b"named" not in w.out  # its walk, as a digest
    finally:
        fp._OWN.clear()


def test_fingerprints_follow_closures_and_globals():
    def make(k):
        return lambda x: x * k

    assert fingerprint(make(2.0)) == fingerprint(make(2.0)) != fingerprint(make(3.0))
    assert fingerprint(np.arange(3)) != fingerprint(np.arange(3.0))
    assert fingerprint(jnp.sin) == fingerprint(jnp.sin) != fingerprint(jnp.cos)
    with pytest.raises(Unstable):
        fingerprint(iter([1, 2]))


def test_an_open_jaxpr_holding_constants_is_fingerprinted_by_its_equations():
    """A rule's procedure may close over an open ``Jaxpr`` (a library's ``closed.jaxpr``), whose constants live
    elsewhere: its constvars are read as inputs (before, ``ClosedJaxpr(jaxpr, ())`` raised ``AssertionError``)."""
    c = np.arange(3.0)

    def opened(op):
        return jax.make_jaxpr(lambda x: op(x, jnp.asarray(c)))(jnp.ones(3)).jaxpr

    added, multiplied = opened(jnp.add), opened(jnp.multiply)
    assert added.constvars, "the constant is a constvar of the open jaxpr"

    def make(body):
        return lambda x: (body, x)[1]

    assert fingerprint(make(added)) == fingerprint(make(opened(jnp.add))) != fingerprint(make(multiplied))


def test_fingerprints_follow_the_items_of_a_containers_subclass():
    """An ``OrderedDict``, a ``Counter`` or a user's list subclass keeps its items outside its ``__dict__``: two rules
    closing over two such configurations are two keys (before, one: a disk cache hit could serve the other's
    program)."""
    import collections

    class Scales(list):
        pass

    def make(config):
        return lambda x: x * config["s"]

    for kind in (collections.OrderedDict, collections.Counter):
        assert fingerprint(make(kind(s=1))) == fingerprint(make(kind(s=1))) != fingerprint(make(kind(s=3)))
    assert fingerprint(Scales([1.0])) == fingerprint(Scales([1.0])) != fingerprint(Scales([3.0]))
    assert fingerprint(collections.OrderedDict(a=1, b=2)) != fingerprint(collections.OrderedDict(b=2, a=1))


def test_where_the_cache_lives(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_REWRITE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_dir() == tmp_path / "jax-rewrite"
    monkeypatch.setenv("JAX_REWRITE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert resolve(None).path == tmp_path / "elsewhere"
    for off in ("", "0", "off", "false", "None"):
        monkeypatch.setenv("JAX_REWRITE_CACHE_DIR", off)
        assert resolve(None) is None
    assert resolve(False) is None and resolve(tmp_path).path == tmp_path
    assert rewrite(jnp.sin, cache=False).disk is None


# ---------------------------------------------------------------------- the guard

# A rule that makes a sum deliberately slow (sorting first), and a cost model that prefers it.
SLOW = Ruleset("slow", [rule(lambda x: jnp.sum(x), lambda x: jnp.cumsum(jnp.sort(x))[-1], name="sum_by_sorting",
                             example_inputs=(jax.ShapeDtypeStruct((4096,), jnp.float32),))], soundness="identity")
FAST = Ruleset("fast", [rule(lambda x: jnp.sum(jnp.sort(x)), lambda x: jnp.sum(x), name="sum_unsorted",
                             example_inputs=(jax.ShapeDtypeStruct((4096,), jnp.float32),))], soundness="identity")


def _sums_are_ruinous(node):
    return 1e12 if node.op == "reduce_sum" else AnalyticCost()(node)


QUICK = Guard(rounds=5, min_round_seconds=0.005, max_seconds=5.0)


def test_guard_keeps_the_original_when_the_rewrite_is_slower(tmp_path):
    x = jnp.linspace(-1.0, 1.0, 1 << 16)
    f = rewrite(lambda x: jnp.sum(x), rulesets=[SLOW], cost_model=_sums_are_ruinous, guard=QUICK, cache=tmp_path)
    out = f(x)
    result = f.result(x)
    assert result.stats["sum_by_sorting"].fired == 1 and result.rewritten
    g = result.guard
    assert g.kept == "original" and g.seconds_rewritten > g.seconds_original, g
    assert result.after is result.before
    np.testing.assert_array_equal(out, jnp.sum(x))
    assert "kept the original" in str(g)
    # the decision is stored with the entry: a second instance neither rewrites nor times again
    again = rewrite(lambda x: jnp.sum(x), rulesets=[SLOW], cost_model=_sums_are_ruinous, guard=QUICK, cache=tmp_path)
    r2 = again.result(x)
    assert again.loaded == 1 and "guard" not in r2.times
    assert r2.guard.kept == "original" and r2.guard.cached and r2.guard.seconds_original == g.seconds_original
    assert [e.primitive.name for e in r2.after.eqns] == ["reduce_sum"]
    # without the guard, the slow program is what runs
    assert "sort" in [e.primitive.name for e in rewrite(lambda x: jnp.sum(x), rulesets=[SLOW],
                                                        cost_model=_sums_are_ruinous, cache=False).jaxpr(x).eqns]


def test_guard_keeps_a_faster_rewrite():
    x = jnp.linspace(-1.0, 1.0, 1 << 16)
    f = rewrite(lambda x: jnp.sum(jnp.sort(x)), rulesets=[FAST], guard=QUICK, cache=False)
    result = f.result(x)
    assert result.guard.kept == "rewritten", result.guard
    assert result.guard.seconds_rewritten < result.guard.seconds_original
    assert "sort" not in [e.primitive.name for e in result.after.eqns]
    np.testing.assert_allclose(f(x), jnp.sum(x), rtol=1e-5, atol=1e-5)


def test_guard_with_nothing_rewritten_does_not_time():
    f = rewrite(lambda x: jnp.sin(x), guard=True, cache=False)
    result = f.result(jnp.ones(3))
    assert result.guard.kept == "original" and result.guard.seconds_original is None


def test_an_entry_is_refused_for_another_program_of_the_same_signature(tmp_path):
    cache = DiskCache(tmp_path)
    a = jax.make_jaxpr(lambda x: jnp.sin(x) * 3.0)(jnp.ones(4))
    b = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(jnp.ones(4))
    assert cache.store("cd" * 32, a, {}, original=a)
    with pytest.warns(RewriteWarning, match="another program"):
        assert cache.load("cd" * 32, original=b) is None
    program, _ = cache.load("cd" * 32, original=a)
    np.testing.assert_allclose(core.jaxpr_as_fun(program)(jnp.ones(4))[0], jnp.sin(1.0) * 3.0, rtol=1e-6)


def test_guard_never_runs_a_program_with_effects():
    calls = []

    def f(x):
        jax.debug.callback(lambda v: calls.append(1), x)
        return 2 * jnp.sin(x) * jnp.cos(x)

    r = rewrite(f, rulesets=[TRIG], guard=True, cache=False)
    with pytest.warns(RewriteWarning, match="could not time"):
        result = r.result(jnp.ones(3))
    assert calls == [] and result.rewritten
    # a guard that cannot time keeps the original
    assert result.guard.kept == "original" and "effects" in result.guard.reason and result.after is result.before
    r(jnp.ones(3))
    assert calls == [1]


def _increasing_only(ts):
    """A program with its own check, which random inputs fail (as diffrax's ``saveat.ts`` check does)."""
    import equinox as eqx

    ts = eqx.error_if(ts, jnp.any(ts[1:] <= ts[:-1]), "ts must be increasing")
    return 2 * jnp.sin(ts) * jnp.cos(ts)


def test_guard_times_on_the_calls_own_arguments():
    f = rewrite(_increasing_only, rulesets=[TRIG], guard=QUICK, cache=False)
    ts = jnp.linspace(0.0, 1.0, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewriteWarning)
        out = f(ts)
    np.testing.assert_allclose(out, jnp.sin(2 * ts), atol=1e-6)
    decision = f.result(ts).guard
    assert decision.seconds_original is not None and decision.seconds_rewritten is not None, decision
    assert "call's arguments" in decision.reason


def test_guard_that_cannot_time_keeps_the_original():
    """Under jit the call's arguments are tracers, random inputs fail the program's check: nothing is timed."""
    f = rewrite(_increasing_only, rulesets=[TRIG], guard=QUICK, cache=False)
    ts = jnp.linspace(0.0, 1.0, 256)
    with pytest.warns(RewriteWarning, match="could not time"):
        out = jax.jit(f)(ts)
    np.testing.assert_allclose(out, jnp.sin(2 * ts), atol=1e-6)
    result = f.result(ts)
    assert result.guard.kept == "original" and result.guard.seconds_original is None
    assert result.after is result.before  # the original is what runs


# ---------------------------------------------------------------------- trust: an entry is data, and only ours
class _Planted:
    """Pickled, this would run code when read back (as a planted entry's param would have)."""

    def __reduce__(self):
        return (exec, ("import builtins; builtins._rewrite_cache_pwned = True",))


def _plant(tmp_path, payload):
    """Replace the one stored entry's program with ``payload`` pickled, keeping a valid header and checksum."""
    import builtins
    import pickle

    first = rewrite(program, cache=tmp_path, rulesets=[TRIG])
    first.jaxpr(*ARGS)
    (path,) = entries(tmp_path)
    cache = DiskCache(tmp_path)
    key = path.stem
    header, _ = cache.read(key)
    cache.write(key, header, pickle.dumps(payload, protocol=5))
    builtins.__dict__.pop("_rewrite_cache_pwned", None)
    return path


@pytest.mark.parametrize("where", ["container", "param"])
def test_a_planted_entry_that_would_run_code_is_refused(tmp_path, where):
    import builtins

    import pickle

    # the whole entry, or a param under the old format's pickled-param tag, holding code
    payload = _Planted() if where == "container" else ("pickle", pickle.dumps(_Planted()))
    _plant(tmp_path, payload if where == "container" else ("closed", ([], [], [], [], [], None), [payload]))
    second = rewrite(program, cache=tmp_path, rulesets=[TRIG])
    with pytest.warns(RewriteWarning, match="unusable"):
        out = second(*ARGS)
    assert not hasattr(builtins, "_rewrite_cache_pwned")
    assert second.loaded == 0
    np.testing.assert_allclose(out, program(*ARGS), rtol=1e-6)


def test_params_are_written_by_schema_and_read_back(tmp_path):
    # gathers carry named tuples and enums (GatherDimensionNumbers, GatherScatterMode): written by schema
    fn, args = KINDS["gather_and_ints"]
    first, second = fresh_and_loaded(fn, args, tmp_path, rulesets=[TRIG])
    assert second.loaded == 1
    assert b"pickle" not in entries(tmp_path)[0].read_bytes()


def test_cache_directories_are_private(tmp_path):
    d = tmp_path / "cache"
    rewrite(program, cache=d, rulesets=[TRIG]).jaxpr(*ARGS)
    (path,) = entries(d)
    for p in (d, path.parent):
        assert os.stat(p).st_mode & 0o777 == 0o700
    assert os.stat(path).st_mode & 0o077 == 0


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX owners")
@pytest.mark.parametrize("how", ["group_writable_entry", "world_writable_dir", "other_owner"])
def test_an_entry_others_could_have_written_is_not_loaded(tmp_path, how):
    d = tmp_path / "cache"
    rewrite(program, cache=d, rulesets=[TRIG]).jaxpr(*ARGS)
    (path,) = entries(d)
    if how == "group_writable_entry":
        os.chmod(path, 0o660)
    elif how == "world_writable_dir":
        os.chmod(path.parent, 0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(path, 12345, -1)
    second = rewrite(program, cache=d, rulesets=[TRIG])
    with pytest.warns(RewriteWarning, match="not loading rewrite cache entry"):
        second.jaxpr(*ARGS)
    assert second.loaded == 0


def test_guard_times_only_near_ties_when_asked():
    """``Guard(near_tie=f)`` times a rewrite only where the model predicts it within ``f`` of the original's
    speed: dropping a sort is predicted far faster, so it is kept untimed under a narrow band, timed under a wide one."""
    x = jnp.linspace(-1.0, 1.0, 1 << 16)
    f = rewrite(lambda x: jnp.sum(jnp.sort(x)), rulesets=[FAST], guard=dataclasses.replace(QUICK, near_tie=0.1),
                cache=False)
    g = f.result(x).guard
    assert g.kept == "rewritten" and g.seconds_original is None and "near-tie band of 10%" in g.reason, g
    assert "sort" not in [e.primitive.name for e in f.jaxpr(x).eqns]
    wide = rewrite(lambda x: jnp.sum(jnp.sort(x)), rulesets=[FAST], guard=dataclasses.replace(QUICK, near_tie=1e6),
                   cache=False)
    assert wide.result(x).guard.seconds_original is not None


# ---------------------------------------------------------------------- the newest packs: a rule's custom_vjp


def _attention(q, k, v):
    return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) * 0.125, axis=-1) @ v


def _lm_head(h, w, y):
    return optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean()


#: attention's 2 MiB of scores stay in the cache, where the model keeps the softmax as written
#: (``cost/attention.py`` ``SCORES_CACHED``): priced as memory traffic here, so the blocked rule's VJP is chosen.
_STORED = AnalyticCost(scores_cached=0.0)


def _pack_case(name):
    rng = np.random.default_rng(3)
    if name == "attention":
        import rulesets

        args = tuple(jnp.asarray(rng.standard_normal((2, 512, 8)) + s, jnp.float32) for s in (0.0, 0.0, 1.0))
        return _attention, args, [rulesets.attention], (0, 1, 2), "attn_"
    import rulesets
    from rulesets import nn_lm_head

    h = jnp.asarray(rng.standard_normal((1024, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 8192)) / 8, jnp.float32)
    y = jnp.asarray(rng.integers(0, 8192, 1024), jnp.int32)
    assert nn_lm_head.offered() or jax.default_backend() == "gpu"
    return _lm_head, (h, w, y), [rulesets.nn], (0, 1), "lm_head"


@pytest.mark.parametrize("pack", ["attention", "lm_head"])
def test_programs_holding_a_rule_s_custom_vjp_are_stored_and_run_their_backward(tmp_path, pack):
    """A program whose rewrite holds a custom_vjp that a rule built (attention's recomputing backward, the LM
    head's loop) is written, and a new instance reads it back: the same values and gradients, bitwise, and
    jax.grad of the loaded program runs the rule's own backward (it holds no N x N / tokens x vocabulary array)."""
    fn, args, packs, argnums, prefix = _pack_case(pack)
    if pack == "lm_head" and jax.default_backend() == "gpu":
        pytest.skip("the LM head's loop is not offered on a GPU")
    first = rewrite(fn, rulesets=packs, cache=tmp_path, cost_model=_STORED)
    want, want_grad = first(*args), _grad(first, argnums)(*args)
    assert any(n.startswith(prefix) or prefix in n for n in first.result(*args).stats if
               first.result(*args).stats[n].fired), first.result(*args).stats
    assert len(entries(tmp_path)) >= 1
    second = rewrite(fn, rulesets=packs, cache=tmp_path, cost_model=_STORED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewriteWarning)  # an entry that fails to load warns
        got = second(*args)
    assert second.loaded == 1 and second.result(*args).cached is not None
    assert str(second.jaxpr(*args)) == str(first.jaxpr(*args))
    np.testing.assert_array_equal(got, want)
    for a, b in zip(_grad(second, argnums)(*args), want_grad):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.jit(_grad(second, argnums))(*args), want_grad):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    big = {(2, 512, 512)} if pack == "attention" else {(1024, 8192)}
    shapes = {tuple(a.shape) for a in _avals(jax.make_jaxpr(_grad(second, argnums))(*args).jaxpr)}
    assert not shapes & big, "the loaded program's gradient does not run the rule's backward"
    assert big & {tuple(a.shape) for a in _avals(jax.make_jaxpr(_grad(fn, argnums))(*args).jaxpr)}


def _grad(fn, argnums):
    return jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums)


def _avals(jaxpr):
    for e in jaxpr.eqns:
        for v in e.outvars:
            yield v.aval
        for sub in core.jaxprs_in_params(e.params):
            yield from _avals(sub)


def test_a_stored_custom_vjp_rule_that_does_not_match_its_call_is_refused(tmp_path, monkeypatch):
    """A stored backward whose types do not fit the call is not trusted: a warning, and a fresh rewrite."""
    from rewrite.cache import rules

    fn, args, packs, argnums, _ = _pack_case("attention")
    first = rewrite(fn, rulesets=packs, cache=tmp_path, cost_model=_STORED)
    want = _grad(first, argnums)(*args)
    real = rules.residual_avals
    calls = []

    def shifted(call, fwd, fwds):  # on load, the residuals' types read as one fewer
        calls.append(1)
        return real(call, fwd, fwds)[1:]

    monkeypatch.setattr(rules, "residual_avals", shifted)
    second = rewrite(fn, rulesets=packs, cache=tmp_path, cost_model=_STORED)
    with pytest.warns(RewriteWarning, match="unusable.*custom_vjp"):
        got = _grad(second, argnums)(*args)
    assert calls and second.loaded == 0
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_rule_s_anchor_is_part_of_its_key():
    """An anchored rule matches its left side in more operand orders than the same rule unanchored (the lookup of
    the whole accepts either order at every sum and product): a result one made is not the other's."""
    from rewrite.cache.key import rule_fingerprint

    lhs, rhs = (lambda x, y: jnp.tanh(x) * y + y), (lambda x, y: (jnp.tanh(x) + 1.0) * y)
    plain, anchored = rule(lhs, rhs, name="tf"), rule(lhs, rhs, name="tf", anchor="tanh")
    assert rule_fingerprint(plain) == rule_fingerprint(rule(lhs, rhs, name="tf"))
    assert rule_fingerprint(anchored) != rule_fingerprint(plain)


def test_a_stored_program_keeps_its_name_scopes():
    """A loop a kernel laid out (:func:`rewrite.loops.laid_out`) is still marked when its program comes back
    from the disk cache: flax_seq2seq_grad, whose forward (with the LM head's custom VJP) was read back,
    sank into the head's backward loop again (45,287 e-graph rows against 21,081 built fresh)."""
    from jax import lax

    from rewrite.cache.serialise import dumps_program, loads_program
    from rewrite.ir.jaxapi import LAID_OUT_SCOPE
    from rewrite.loops import laid_out

    def f(xs):
        with laid_out():
            return lax.scan(lambda c, x: (c + x, c * x), 0.0, xs)[1]

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    other = jax.make_jaxpr(jnp.sin)(1.0)  # the call's own program: nothing of the stored one's is shared
    back = loads_program(dumps_program(closed, other), other)
    assert LAID_OUT_SCOPE in str(back.jaxpr.eqns[0].source_info.name_stack)


def _calls_itself():
    """A custom_vjp in JAX's idiom whose forward calls it; made in a function, so that it is no module's name
    (one that is, is written by its name: the next tests)."""
    @jax.custom_vjp
    def calls_itself(x):
        return jnp.sin(x)

    calls_itself.defvjp(lambda x: (calls_itself(x), x), lambda x, g: (g * jnp.cos(x),))
    return calls_itself


def test_a_rules_custom_vjp_whose_forward_calls_itself_is_not_written_and_one_that_does_not_is():
    """A rule's custom_vjp whose forward calls the custom_vjp itself holds it again in its forward's jaxpr: the
    writer refuses it at once (written, it would write the rule again inside itself, to Python's recursion limit);
    one made in a function whose forward computes the operations is written and read back, its backward with it."""
    from rewrite.cache.rules import Unserialisable
    from rewrite.cache.serialise import dumps_program, loads_program

    other = jax.make_jaxpr(jnp.cos)(jnp.ones(3))  # the call's own program: it holds neither custom_vjp
    with pytest.raises(Unserialisable, match="calls itself"):
        dumps_program(jax.make_jaxpr(_calls_itself())(jnp.ones(3)), other)

    @jax.custom_vjp
    def local(x, b):
        return jnp.sin(b * x) ** 2 / b

    def local_bwd(r, g):
        x, b = r
        return g * jnp.sin(2 * b * x), jnp.sum(g * (x * jnp.sin(2 * b * x) / b - jnp.sin(b * x) ** 2 / b ** 2), 0)

    local.defvjp(lambda x, b: (jnp.sin(b * x) ** 2 / b, (x, b)), local_bwd)
    x, b = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4), np.float32)), jnp.linspace(0.5, 2.0, 4)
    back = loads_program(dumps_program(jax.make_jaxpr(local)(x, b), other), other)
    run = core.jaxpr_as_fun(back)
    np.testing.assert_array_equal(run(x, b)[0], local(x, b))
    got = jax.grad(lambda x, b: run(x, b)[0].sum(), (0, 1))(x, b)
    want = jax.grad(lambda x, b: local(x, b).sum(), (0, 1))(x, b)
    for p, q in zip(got, want):
        np.testing.assert_array_equal(p, q)


def _kernel_program(dtype=jnp.float32):
    from rulesets.kernels.sin_squared import sin_squared_over

    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 16), np.float32), dtype)
    b = jnp.linspace(0.5, 2.0, 16, dtype=dtype)[None]
    return jax.make_jaxpr(lambda x, b: jnp.cos(sin_squared_over(x, b)))(x, b), (x, b), sin_squared_over


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_top_level_custom_vjp_is_written_by_its_name_and_its_backward_is_not_traced(monkeypatch, dtype):
    """Seed 000's kernel (``rulesets.kernels.sin_squared.sin_squared_over``, a ``jax.custom_vjp`` at its module's
    top level) is written by its module and name: neither writing nor reading calls its backward (1,284 equations
    at seed 000's size, 45 ms to trace), and the program read back has the same text, values and gradients (and
    gradients under vmap), bit for bit, eagerly and under jit, in each dtype users train with."""
    from rewrite.cache import serialise
    from rewrite.cache.serialise import dumps_program, loads_program

    closed, (x, b), kernel = _kernel_program(dtype)
    other = jax.make_jaxpr(jnp.cos)(jnp.ones(3))
    traced_backwards = []
    real = serialise.call_custom_vjp_bwd
    monkeypatch.setattr(serialise, "call_custom_vjp_bwd", lambda *a: traced_backwards.append(1) or real(*a))
    data = dumps_program(closed, other)
    back = loads_program(data, other)
    assert not traced_backwards
    assert b"rulesets.kernels.sin_squared" in data and b"sin_squared_over" in data
    assert str(back) == str(closed)
    run = core.jaxpr_as_fun(back)
    np.testing.assert_array_equal(run(x, b)[0], jnp.cos(kernel(x, b)))
    for j in (lambda f: f, jax.jit):
        got = j(jax.grad(lambda x, b: run(x, b)[0].sum(), (0, 1)))(x, b)
        want = j(jax.grad(lambda x, b: jnp.cos(kernel(x, b)).sum(), (0, 1)))(x, b)
        for p, q in zip(got, want):
            np.testing.assert_array_equal(p, q)
        # and mapped over a leading batch, with its gradient
        xs, bs = jnp.stack([x, -x]), jnp.stack([b, b * 2])
        got = j(jax.vmap(jax.grad(lambda x, b: run(x, b)[0].sum(), (0, 1))))(xs, bs)
        want = j(jax.vmap(jax.grad(lambda x, b: jnp.cos(kernel(x, b)).sum(), (0, 1))))(xs, bs)
        for p, q in zip(got, want):
            np.testing.assert_array_equal(p, q)


@pytest.mark.parametrize("change", ["another_custom_vjp", "not_a_custom_vjp", "module_not_imported"])
def test_a_named_custom_vjp_that_is_not_the_written_call_on_load_is_refused(monkeypatch, change):
    """On load the named ``custom_vjp`` is called again at the call's types; where the name finds one whose call
    has other types, something else, or no imported module, the entry is not trusted. (A kernel whose code
    changed makes another key: the rule's fingerprint walks it.)"""
    import sys

    import rulesets.kernels.sin_squared as kernels
    from rewrite.cache.rules import Unserialisable
    from rewrite.cache.serialise import dumps_program, loads_program

    closed, _, _ = _kernel_program()
    other = jax.make_jaxpr(jnp.cos)(jnp.ones(3))
    data = dumps_program(closed, other)
    if change == "another_custom_vjp":
        fake = jax.custom_vjp(lambda x, b: (jnp.sin(b * x) ** 2 / b).sum(0))  # its output of another shape
        fake.defvjp(lambda x, b: (fake(x, b), (x, b)), lambda r, g: (jnp.zeros_like(r[0]), jnp.zeros_like(r[1])))
        monkeypatch.setattr(kernels, "sin_squared_over", fake)
    elif change == "not_a_custom_vjp":
        monkeypatch.setattr(kernels, "sin_squared_over", lambda x, b: jnp.sin(b * x) ** 2 / b)
    else:
        monkeypatch.delitem(sys.modules, "rulesets.kernels.sin_squared")
    with pytest.raises(Unserialisable):
        loads_program(data, other)


def _bitwise(a, b):
    """Equal values, NaN where NaN (half-precision values compared widened to float32, which is exact: numpy's
    comparison does not see bfloat16's NaN as NaN)."""
    def wide(x):
        x = np.asarray(x)
        return x.astype(np.float32) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4 else x

    for p, q in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert np.asarray(p).dtype == np.asarray(q).dtype
        np.testing.assert_array_equal(wide(p), wide(q))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_custom_jvp_a_rule_built_is_stored_and_differentiates_alike(tmp_path, dtype):
    """The nn pack writes ``log(sigmoid(z))`` as ``-softplus(-z)``: a ``custom_jvp`` (``logaddexp``) no original
    program holds, whose own JVP calls ``logaddexp`` again. Such entries were never written (the rule is a
    Python function), so every process rewrote afresh; now the rule is written as its JVP's jaxpr, referring
    to itself, and the loaded program's derivatives are the fresh one's exactly (NaN where NaN), at every order,
    under jit and vmap, in float32, bfloat16 and float16."""
    import rulesets
    from tests.corpus import binary_cross_entropy as bce

    z = jnp.array([-200.0, -3.0, -0.0, 1e-30, 2.0, 200.0, jnp.inf, -jnp.inf, jnp.nan], dtype)
    t = jnp.array([1.0, 0.3, 0.5, 0.0, 1.0, 0.0, 1.0, 0.0, 0.5], dtype)
    first, second = fresh_and_loaded(bce, (z, t), tmp_path, rulesets=[rulesets.nn])
    assert second.loaded == 1
    assert "custom_jvp_call" in str(second.jaxpr(z, t))
    for how in (lambda f: jax.grad(lambda z: f(z, t).sum())(z),
                lambda f: jax.jit(jax.grad(lambda z, t: f(z, t).sum(), argnums=(0, 1)))(z, t),
                lambda f: jax.jvp(lambda t: f(z, t), (t,), (jnp.ones_like(t),)),  # z's tangent a symbolic zero
                lambda f: jax.jvp(lambda z: f(z, t), (z,), (jnp.ones_like(z),)),
                lambda f: jax.grad(jax.grad(lambda s: f(s[None], t[:1]).sum()))(z[1]),  # through the JVP's own
                lambda f: jax.jit(jax.vmap(jax.grad(lambda s, u: f(s[None], u[None]).sum())))(z, t)):
        _bitwise(how(second), how(first))


@jax.custom_jvp
def _sin_and_cos(x):
    return jnp.sin(x), jnp.cos(x)


@_sin_and_cos.defjvp
def _sin_and_cos_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    s, c = _sin_and_cos(x)
    if type(t) is jax.custom_derivatives.SymbolicZero:
        return (s, c), (jnp.zeros_like(s), jnp.zeros_like(c))
    return (s, c), (c * t * 3.0, -s * t)  # not the true derivative: the rule's own answer must be kept


_sin_and_cos.defjvp(_sin_and_cos_jvp, symbolic_zeros=True)


def test_a_users_custom_jvp_with_an_output_dropped_is_stored_under_the_same_elimination(tmp_path):
    """The emitter's dead-code elimination drops a ``custom_jvp``'s unused output and wraps its rule (with
    symbolic zeros here, so its JVP cannot be written as one jaxpr): the entry names the user's rule and the
    elimination, and the loaded program runs the user's rule. Before, no entry was written (diffrax's neural ODE
    and optimistix's BFGS among the ecosystem programs)."""

    def f(x, y):
        return _sin_and_cos(x * y)[0] * 2.0

    args = (jnp.linspace(-2.0, 2.0, 5), jnp.full(5, 0.5))
    first, second = fresh_and_loaded(f, args, tmp_path)
    assert second.loaded == 1
    for how in (lambda g: jax.grad(lambda x, y: g(x, y).sum(), argnums=(0, 1))(*args),
                lambda g: jax.jvp(lambda x: g(x, args[1]), (args[0],), (jnp.ones(5),)),
                lambda g: jax.jit(jax.vmap(jax.grad(lambda x, y: g(x, y).sum())))(args[0][:, None], args[1][:, None])):
        _bitwise(how(second), how(first))
    np.testing.assert_allclose(jax.grad(lambda x: second(x, args[1]).sum())(args[0]),
                               2.0 * 3.0 * 0.5 * jnp.cos(args[0] * 0.5), rtol=1e-6)  # the rule's 3.0, kept


def test_every_corpus_program_rewritten_writes_and_reads_back_as_itself():
    """Every program of the corpus rewritten with every pack but fastmath writes down (no param the cache
    cannot write) and reads back as the same program: the same text and the same name scopes, where the
    laid-out mark lives (``rewrite.loops.laid_out``)."""
    import rulesets
    from rewrite.cache.serialise import dumps_program, loads_program
    from tests.corpus import corpus

    packs = [getattr(rulesets, n) for n in rulesets.PACKS if n != "fastmath"]

    def scopes(j, out):
        for e in j.eqns:
            out.append((e.primitive.name, str(e.source_info.name_stack)))
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                scopes(sub, out)
        return out

    for name, fn, args in corpus():
        result = rewrite(fn, rulesets=packs, cache=False).result(*args)
        back = loads_program(dumps_program(result.after, result.before), result.before)
        assert str(back) == str(result.after), name
        assert scopes(back.jaxpr, []) == scopes(result.after.jaxpr, []), name


def test_a_stored_custom_jvp_rule_that_does_not_match_its_call_is_refused(tmp_path, monkeypatch):
    """A stored JVP whose types do not fit its call is not trusted: a warning, and a fresh rewrite."""
    import rulesets
    from rewrite.cache import rules
    from tests.corpus import binary_cross_entropy as bce

    z, t = jnp.linspace(-3.0, 3.0, 7), jnp.full(7, 0.25)
    first = rewrite(bce, rulesets=[rulesets.nn], cache=tmp_path)
    want = jax.grad(lambda z: first(z, t).sum())(z)
    monkeypatch.setattr(rules, "_same_type", lambda a, b: False)  # on load, every type reads as another
    second = rewrite(bce, rulesets=[rulesets.nn], cache=tmp_path)
    with pytest.warns(RewriteWarning, match="unusable.*custom_jvp"):
        got = jax.grad(lambda z: second(z, t).sum())(z)
    assert second.loaded == 0
    np.testing.assert_array_equal(got, want)


def test_the_emitters_checkpoint_policy_is_written():
    """The emitter checkpoints a loop's carry with ``save_only_these_names``, on JAX 0.11+ a value of this
    library's (JAX's own is a closure there): an entry holding it was not written (haiku_lstm_loss on jax 0.12)."""
    from rewrite.cache.serialise import dumps_program, loads_program
    from rewrite.ir.jaxapi import SaveOnlyTheseNames

    policy = SaveOnlyTheseNames(frozenset({"carry"}))
    closed = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(jnp.sin(x)), policy=policy))(jnp.ones(3))
    other = jax.make_jaxpr(jnp.cos)(1.0)
    back = loads_program(dumps_program(closed, other), other)
    assert str(back) == str(closed)
    np.testing.assert_array_equal(jax.grad(lambda x: core.jaxpr_as_fun(back)(x)[0].sum())(jnp.ones(3)),
                                  jax.grad(lambda x: core.jaxpr_as_fun(closed)(x)[0].sum())(jnp.ones(3)))


def test_a_rules_key_does_not_depend_on_what_the_process_rewrote_before():
    """A rule's fingerprint walks the rules its functions reach; those cache their sides' traces per shape (and
    their symmetries) as they are used. Such caches were walked: the nn pack's rules read other keys after a
    rewrite had used them (9 of its 22 rules), so a process that rewrote something first missed the entries
    another had stored."""
    import rulesets
    from rewrite.cache.key import _RULES, rule_fingerprint
    from tests.corpus import binary_cross_entropy as bce

    entries = [r for r, _ in rewrite(lambda x: x, rulesets=[rulesets.nn]).entries]
    for r in entries:
        _RULES.pop(r, None)
    before = [rule_fingerprint(r) for r in entries]
    z, t = jnp.linspace(-3.0, 3.0, 7), jnp.full(7, 0.25)
    rewrite(bce, rulesets=[rulesets.nn], cache=False)(z, t)
    jax.grad(lambda z: rewrite(bce, rulesets=[rulesets.nn], cache=False)(z, t[:3]).sum())(z[:3])  # other shapes
    for r in entries:
        _RULES.pop(r, None)
    assert [rule_fingerprint(r) for r in entries] == before


def test_a_rules_key_does_not_depend_on_the_path_it_was_defined_at():
    """A rule's procedure reaches other rules through its globals (``hoist_reductions`` does, ``rulesets/scan.py``),
    and those recorded the absolute path of the file that defined them (``Rule.defined_at``, for listings): the
    same packs installed at two paths made two keys, and a cache folder was never shared between checkouts."""
    import rulesets
    from rewrite.cache.key import _RULES, rules_fingerprint

    entries = rewrite(lambda x: x, rulesets=[rulesets.scan, rulesets.nn]).entries
    rules = [r for r, _ in entries]
    assert any(r.defined_at for r in rules)
    before = rules_fingerprint(entries)
    saved = {r: r.defined_at for r in rules}
    try:
        for r in rules:
            _RULES.pop(r, None)
            if r.defined_at is not None:
                r.defined_at = ("/elsewhere/" + os.path.basename(r.defined_at[0]), r.defined_at[1])
        assert rules_fingerprint(entries) == before
    finally:
        for r, where in saved.items():
            r.defined_at = where
            _RULES.pop(r, None)
