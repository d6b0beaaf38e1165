"""The routing of benchmarks/jax_suite.py, without JAX's test sources."""

import os
import subprocess
import sys
import warnings

import pytest

from benchmarks import jax_suite


def test_a_warning_of_a_routed_call_that_raises_is_passed_on():
    """A routed call records its warnings and passes on all but the rewriter's; one that raised lost them:
    diffrax's test_event_backsolve checks for a deprecation warning of a solve that then raises, and failed routed
    ("DID NOT WARN") though the rewriter never ran."""
    def f(x):
        warnings.warn("deprecated spelling", DeprecationWarning)
        raise NotImplementedError("not with this adjoint")

    routed = jax_suite._counted(f, f)
    with pytest.warns(DeprecationWarning, match="deprecated spelling"), pytest.raises(NotImplementedError):
        routed(1.0)


def test_jit_of_the_same_function_again_reuses_its_rewrite(monkeypatch):
    """``jax.jit(f)`` called again for the same ``f`` reuses ``f``'s traces and executables; routed, each call made a
    new ``rewrite(f)``, rewritten afresh (blackjax's meanfield test calls ``jax.jit(step)`` 15,000 times: 600 s
    against 16 s). The routing keeps the last few functions' rewrites, so the same ``f`` is rewritten once, and a
    new function, or the same one with other static arguments, is not mistaken for it."""
    import jax
    import jax.numpy as jnp

    import rewrite

    made = []
    real_rewrite = rewrite.rewrite
    monkeypatch.setattr(rewrite, "rewrite", lambda fun, **kw: made.append(fun) or real_rewrite(fun, **kw))
    monkeypatch.setattr(jax_suite, "_ROUTED", type(jax_suite._ROUTED)())
    route = jax_suite._routed(jax.jit, [], jax_suite._jit_statics)

    def f(x, n):
        return jnp.sin(x) * n

    x = jnp.arange(4.0)
    for _ in range(3):
        assert jnp.allclose(route(f, static_argnums=1)(x, 2), jnp.sin(x) * 2)
    assert made == [f]
    assert jnp.allclose(route(f, static_argnums=(1,))(x, 3), jnp.sin(x) * 3)  # the same statics, spelled so
    assert made == [f]
    route(f)(x, 2.0)  # other static arguments: another rewrite
    def g(x, n):
        return jnp.cos(x) * n

    assert jnp.allclose(route(g, static_argnums=1)(x, 2), jnp.cos(x) * 2)
    assert made == [f, f, g]


def test_installing_the_routing_leaves_the_devices_unset():
    """The plugin routes ``jax.jit`` before pytest imports a test module, and must not start JAX's backend then: flax's
    spmd and bridge tests set ``XLA_FLAGS`` (four host devices) at their top, and routed, all 29 of spmd_test were
    skipped and bridge's test_metadata failed (one device), because loading the packs traced their examples."""
    code = ("import os\n"
            "from benchmarks import jax_suite\n"
            "jax_suite._install()\n"
            "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'\n"
            "import jax\n"
            "assert jax.device_count() == 4, jax.devices()\n"
            "assert jax.jit(lambda x: x * 2.0)(3.0) == 6.0\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(jax_suite.ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=jax_suite.ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_file_stopped_at_its_timeout_keeps_the_outcomes_it_had(tmp_path):
    # The outcomes were written when the file's pytest ended, so one stopped at --timeout lost every one of them
    # (numpyro's test_distributions, diffrax's test_basic).
    (tmp_path / "slow_test.py").write_text(
        "import time\n\n"
        "def test_quick():\n    assert True\n\n"
        "def test_wrong():\n    assert 1 == 2\n\n"
        "def test_forever():\n    time.sleep(600)\n\n"
        "def test_never_reached():\n    assert True\n")
    run = jax_suite.run_file("slow_test.py", False, cases=1, select=None, timeout=8, out_dir=tmp_path / "out",
                             root=tmp_path)
    results = run["results"]
    assert run["seconds"] < 40
    assert {t.split("::")[-1]: r["outcome"] for t, r in results.items()} == {
        "test_quick": "passed", "test_wrong": "failed", "test_forever": "failed"}
    assert "timed out" in results["slow_test.py::test_forever"]["error"]
    assert not (tmp_path / "out" / "slow_test.plain.json.partial").exists()
