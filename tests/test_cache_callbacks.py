"""The disk cache of a program that calls back into Python (``rewrite/cache/fingerprint.py``'s ``CALLBACKS``).

A callback enters the key by its type and place, never by value: equinox's ``error_if`` closes over
``filter_jit``'s random call id, so by value every process made a new key and never read an entry (every diffrax
and equinox program). A hit takes each callback from this process's fresh trace, so the loaded program calls
this process's check and raises where the original raises; a program whose callback is not the trace's is not
stored, with a warning.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rewrite import RewriteWarning, Ruleset, rewrite, rule
from rewrite.cache.fingerprint import program_fingerprint
from rewrite.cache.store import DiskCache

TRIG = Ruleset("trig", [
    rule(lambda x: 2 * jnp.sin(x) * jnp.cos(x), lambda x: jnp.sin(2 * x), name="double_angle"),
], soundness="identity")

X = jnp.linspace(0.0, 1.0, 8)


def _checked(x):
    import equinox as eqx

    return eqx.error_if(2 * jnp.sin(x) * jnp.cos(x), x > 1.5, "x is over 1.5")


def _retraced() -> None:
    """Drop what JAX and equinox keep of earlier traces, so the next trace runs ``filter_jit`` again (a new random
    call id, as another process would make)."""
    import equinox as eqx

    jax.clear_caches()
    eqx.clear_caches()


def _callbacks(closed) -> list:
    found = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name in ("pure_callback", "io_callback", "debug_callback"):
                found.append(e.params["callback"])
            for v in e.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(closed.jaxpr)
    return found


def test_an_equinox_checks_fingerprint_is_the_same_when_traced_again():
    """Fails on main: the check's callback held ``filter_jit``'s new random id in its ``stack`` cell."""
    pytest.importorskip("equinox")
    first = program_fingerprint(jax.make_jaxpr(_checked)(X))
    _retraced()
    again = jax.make_jaxpr(_checked)(X)
    assert program_fingerprint(again) == first
    assert _callbacks(again), "the check is a callback in the program"


def test_a_diffrax_solves_fingerprint_is_the_same_when_traced_again():
    """The ecosystem suite's neural ODE (its solver checks its steps with ``error_if``): main's key was new in
    every process, so its entry was never read again."""
    pytest.importorskip("diffrax")
    from benchmarks.ecosystem import PROGRAMS

    fn, args = PROGRAMS["diffrax_neural_ode"].build()
    first = program_fingerprint(jax.make_jaxpr(fn)(*args))
    _retraced()
    fn, args = PROGRAMS["diffrax_neural_ode"].build()
    assert program_fingerprint(jax.make_jaxpr(fn)(*args)) == first


def test_a_hit_runs_this_traces_check_and_raises_where_the_original_raises(tmp_path):
    """The entry written by one trace is read by a trace with another call id; the loaded program holds the new
    trace's callback objects (none of the first's) and its check passes and fails where the original's does."""
    pytest.importorskip("equinox")
    first = rewrite(_checked, rulesets=[TRIG], cache=tmp_path)
    want = first(X)
    assert first.result(X).stats["double_angle"].fired == 1
    old = {id(c) for c in _callbacks(first.result(X).after)}
    _retraced()
    second = rewrite(_checked, rulesets=[TRIG], cache=tmp_path)
    got = second(X)
    result = second.result(X)
    assert second.loaded == 1 and result.cached, "the second trace read the first's entry"
    fresh = _callbacks(result.before)
    loaded = _callbacks(result.after)
    assert loaded and {id(c) for c in loaded} <= {id(c) for c in fresh} and not old & {id(c) for c in loaded}
    np.testing.assert_array_equal(got, want)
    bad = X + 1.0  # over 1.5 at the end: the original raises
    with pytest.raises(Exception, match="x is over 1.5"):
        jax.block_until_ready(_checked(bad))
    with pytest.raises(Exception, match="x is over 1.5"):
        jax.block_until_ready(second(bad))


def test_a_user_callbacks_key_ignores_its_value_and_the_hit_calls_this_processs(tmp_path):
    """Two functions that differ only in what their callback computes share a key (the rewrite never looks into a
    callback); the second's hit calls its own callback, not the one the entry was written with."""

    def make(scale):
        def f(x):
            y = jax.pure_callback(lambda v: np.asarray(v * scale, v.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            return 2 * jnp.sin(y) * jnp.cos(y)
        return f

    first = rewrite(make(1.0), rulesets=[TRIG], cache=tmp_path)
    np.testing.assert_allclose(first(X), jnp.sin(2 * X), rtol=1e-6)
    second = rewrite(make(3.0), rulesets=[TRIG], cache=tmp_path)
    np.testing.assert_allclose(second(X), jnp.sin(6 * X), rtol=1e-6)
    assert second.loaded == 1


def test_a_program_whose_callback_is_not_the_traces_is_not_stored_and_says_so(tmp_path):
    """The writer finds each callback in the traced program; one that is not there (a program made around
    another callback) writes no entry, with a warning naming the cause, not a debug line."""
    mine = jax.make_jaxpr(lambda x: jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((8,), jnp.float32), x))(X)
    other = jax.make_jaxpr(lambda x: jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((8,), jnp.float32), x))(X)
    cache = DiskCache(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.store("ab" * 32, other, {}, original=mine) is False
    assert any(issubclass(w.category, RewriteWarning) and "callback" in str(w.message) for w in caught)
    assert not list(tmp_path.rglob("*.rwx"))
    assert cache.store("cd" * 32, mine, {}, original=mine) is True
    program, _ = cache.load("cd" * 32, original=mine)
    assert _callbacks(program) == _callbacks(mine)
