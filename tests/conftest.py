"""Shared test setup.

* Internal rewriter errors raise instead of falling back (``REWRITE_STRICT``),
  so a bug cannot hide behind the graceful path that users get.
* Eight host devices, for the sharding tests; this must precede JAX's start.
* The disk cache of rewritten programs is off, so no test reads what another
  (or an earlier run) stored; ``tests/test_cache.py`` gives it directories.
* Hypothesis profiles: ``ci`` (the default, quick) and ``thorough``, chosen
  with ``HYPOTHESIS_PROFILE=thorough``.
* XLA's persistent compilation cache is on, in a directory of the system's
  temporary folder (``JAX_REWRITE_TEST_XLA_CACHE`` names another, or ``off``):
  tests compile the same programs many times over (an original and its
  gradient, at the same shapes, in test after test and in both workers), and
  compiling is most of the suite's time. From a cold cache the suite runs
  about 15% faster, from a warm one about half the time (``tests/test_nn.py``
  and ``tests/test_lm_head.py``: 202 s cold without it, 172 s cold with it,
  86 s warm). It changes what is compiled by nothing: an entry is XLA's own
  executable for the same program and compile options, found by its key.
"""

import os
import shutil
import tempfile

os.environ.setdefault("REWRITE_STRICT", "1")
os.environ["JAX_REWRITE_CACHE_DIR"] = "off"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest
from hypothesis import HealthCheck, settings  # noqa: E402

_XLA_CACHE = os.environ.get("JAX_REWRITE_TEST_XLA_CACHE") or os.path.join(
    tempfile.gettempdir(), f"jax-rewrite-tests-xla-{getattr(os, 'getuid', lambda: 0)()}")
#: Past this size the cache is emptied when a run starts (JAX bounds it only with the ``filelock`` package).
_XLA_CACHE_BYTES = 2 ** 30


def _cache_bytes(path: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file()) if os.path.isdir(path) else 0


if _XLA_CACHE != "off":
    if os.environ.get("PYTEST_XDIST_WORKER") is None and _cache_bytes(_XLA_CACHE) > _XLA_CACHE_BYTES:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)  # before any worker starts
    jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def jaxlib_10_table():
    """Price with the CPU table as measured on jaxlib 0.10, whose library holds all of an attention kernel's scores
    at once: for tests whose figures were measured there (jaxlib 0.12's overlay prices a share of them,
    ``rewrite/cost/calibration.json``'s ``OVERLAYS``)."""
    from rewrite.cost import calibration
    from rewrite.cost.model import priced_with

    with priced_with(calibration.table_for("CPU", "0.10")):
        yield
