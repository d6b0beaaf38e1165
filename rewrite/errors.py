"""The warnings the rewriter issues, and whether an internal error raises instead.

A failure inside the rewriter never reaches a user's program: the original
program runs and a :class:`RewriteWarning` says why, unless ``strict=True``
or ``REWRITE_STRICT=1`` asks for the error itself (the test suite sets it).
"""

from __future__ import annotations

import os


class RewriteWarning(UserWarning):
    """The rewriter could not finish and kept (part of) the original program.

    Issued for an internal failure (the original program then runs; with
    ``strict=True`` or ``REWRITE_STRICT=1`` it raises instead) and for a rule
    that built a value of the wrong type or raised (skipped at that match).

    >>> import warnings
    >>> import jax.numpy as jnp
    >>> from rewrite import RewriteWarning, procedural, rewrite, rule
    >>> wrong = rule(lambda x: jnp.sin(x), procedural(lambda m: m.trace(lambda v: v.sum(), m["x"])), name="wrong")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     out = rewrite(jnp.sin, rulesets=[wrong], strict=False)(jnp.zeros(3))  # (strict=True would raise)
    >>> [w.category.__name__ for w in caught], out.tolist()
    (['RewriteWarning'], [0.0, 0.0, 0.0])
    """


class RewriteLimitWarning(RewriteWarning):
    """Saturation stopped at a limit; the best program found so far is used.

    Issued once per rewritten function and reason (``iteration limit``,
    ``node limit``, ``time limit``).

    >>> import warnings
    >>> import jax.numpy as jnp
    >>> from rewrite import Limits, RewriteLimitWarning, rewrite, rule
    >>> comm = rule(lambda a, b: a + b, lambda a, b: b + a, name="comm")
    >>> f = rewrite(lambda x, y, z: x + y + z, rulesets=[comm], limits=Limits(iterations=1))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     out = f(jnp.ones(2), jnp.ones(2), jnp.ones(2))
    >>> [w.category is RewriteLimitWarning for w in caught], f.result(jnp.ones(2), jnp.ones(2), jnp.ones(2)).stopped
    ([True], 'iteration limit')
    """


def _strict(flag: bool | None) -> bool:
    """Raise instead of falling back? What ``strict`` covers: a failure of the rewriter (the program
    would run unchanged), and a rule, or its guard, that raised or built a value of the wrong type at
    a match (the match would be skipped), for the function and for the derivative programs made for it."""
    if flag is not None:
        return flag
    return os.environ.get("REWRITE_STRICT", "") not in ("", "0", "false", "False")
