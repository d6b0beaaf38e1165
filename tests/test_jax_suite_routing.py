"""The routing of benchmarks/jax_suite.py, without JAX's test sources."""

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
