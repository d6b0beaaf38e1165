"""Shared test setup.

* Internal rewriter errors raise instead of falling back (``REWRITE_STRICT``),
  so a bug cannot hide behind the graceful path that users get.
* Eight host devices, for the sharding tests; this must precede JAX's start.
* The disk cache of rewritten programs is off, so no test reads what another
  (or an earlier run) stored; ``tests/test_cache.py`` gives it directories.
* Hypothesis profiles: ``ci`` (the default, quick) and ``thorough``, chosen
  with ``HYPOTHESIS_PROFILE=thorough``.
"""

import os

os.environ.setdefault("REWRITE_STRICT", "1")
os.environ["JAX_REWRITE_CACHE_DIR"] = "off"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
