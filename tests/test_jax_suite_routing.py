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
