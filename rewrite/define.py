"""Defining a rule, checked as far as its definition allows.

:func:`rule` is :func:`rewrite.rules.rule.build_rule` plus one check that needs the whole
pipeline, which the rule layer sits below: a :class:`Pat` rule given an
example program (``example_program=(fn, args)``) is run on that program once, so a
right side that raises, or builds a value of another shape or dtype, fails
where the rule is written, naming it, instead of being skipped with a warning
at every rewrite.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Mapping

from .cache.store import CHECKS
from .cost.model import AnalyticCost
from .jaxpr.trace import trace_at
from .pipeline import run_pipeline
from .rules.builder import standard_numpy
from .rules.match import _short
from .rules.pattern import Pat
from .rules.rule import Rule, _one_example, build_rule
from .rules.ruleset import Ruleset
from .records import Limits


def rule(lhs: Any, rhs: Any, *, name: str, when: Callable[..., bool] | None = None, example_inputs: Any = None,
         example_program: Any = None, prefer: bool = False, check: bool = True,
         check_inputs: Mapping[str, Callable[[Any], Any]] | None = None, example: Any = None,
         anchor: str | None = None) -> Rule:
    # the deprecated spelling is resolved here, so that its warning points at the caller's line
    example = _one_example(name, isinstance(lhs, Pat), example_inputs, example_program, example)
    is_pat = isinstance(lhs, Pat)
    with standard_numpy():  # its sides traced at the probes, as the packs' code is written, whatever the user's
        r = build_rule(lhs, rhs, name=name, when=when, example_inputs=None if is_pat else example,
                       example_program=example if is_pat else None, prefer=prefer, anchor=anchor)
    r.defined_at = _call_site()
    if check_inputs:
        unknown = [k for k in check_inputs if k not in r.var_names]
        if unknown or not all(callable(f) for f in check_inputs.values()):
            raise ValueError(f"rule {name!r}: check_inputs= maps pattern variables {r.var_names} to functions; "
                             f"got {sorted(check_inputs)}")
        r.check_inputs = dict(check_inputs)
    if check and r.is_pat and r.program is not None:
        check_example(r)
    return r


def _call_site() -> tuple[str, int] | None:
    """Where the user's code called :func:`rule` (the first frame outside this package and functools), for
    listings that quote the rule's line (``rewrite.report.listing``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        path = os.path.abspath(name)
        if not path.startswith(here + os.sep) and os.path.basename(path) != "functools.py":
            return name, frame.f_lineno  # as linecache knows it (a doctest's examples have no file)
        frame = frame.f_back
    return None


rule.__doc__ = (build_rule.__doc__ or "") + """
    ``check_inputs``: for a rule valid only on part of its inputs' values (a
    non-singular matrix, a positive scale that no guard can see), a function
    per pattern variable that maps a drawn array into that part;
    :func:`rewrite.testing.check_ruleset` applies it to every input it draws
    for the variable. It changes what is checked, not what is rewritten: say
    the assumption in the rule's docs too.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> inv_solve = rule(lambda a, b: jnp.linalg.inv(a) @ b, lambda a, b: jnp.linalg.solve(a, b), name="inv_solve",
    ...                  example_inputs=(jax.ShapeDtypeStruct((3, 3), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.float32)),
    ...                  check_inputs={"a": lambda a: a @ a.T + 3 * np.eye(a.shape[-1], dtype=a.dtype)})
    >>> sorted(inv_solve.check_inputs)
    ['a']

    ``check`` (default ``True``): a :class:`Pat` rule with an example program
    is rewritten on it once when it is defined (a fraction of a second), and a
    right side or guard that raises there, a right side that builds a value of
    the wrong shape or dtype, or a pattern with no match in its own example,
    is a ``ValueError`` naming the rule. The built-in packs keep it on, as a
    new pack should (it costs some 25-40 ms a rule, once, when the pack is
    loaded); ``check=False`` skips it. A pass is kept in the disk cache's
    directory (``rewrite/cache/store.py``'s ``ExampleChecks``, keyed by the
    rule's code as the cache hashes it, and this library's versions), so a
    later process that defines the same rule does not check it again (the
    built-in packs load in 0.5 s of CPU instead of 2.7); a rule that fails is
    checked, and fails, every time.

    >>> import jax, jax.numpy as jnp
    >>> from rewrite import Pat, rule
    >>> rule(Pat("sin", Pat.var("x")), lambda x: jnp.sine(x), name="typo",
    ...      example_program=(jnp.sin, (jax.ShapeDtypeStruct((3,), jnp.float32),)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: rule 'typo': on its example program ...module 'jax.numpy' has no attribute 'sine'...
"""


def check_example(r: Rule) -> None:
    """Rewrite ``r``'s example program with ``r`` alone; raise ``ValueError`` on what would be skipped later."""
    key = CHECKS.key(r)  # a rule of the same code passed in an earlier process (the disk cache's directory)
    if key is not None and CHECKS.passed(key):
        return
    fn, avals = r.program
    log = logging.getLogger("rewrite")
    disabled, log.disabled = log.disabled, True  # what the check finds is raised, not also logged
    try:
        with standard_numpy():  # the example is the rule's code, as its sides are
            result = run_pipeline(trace_at(fn, avals), [(r, Ruleset(r.name, [r]))], AnalyticCost(),
                                  Limits(iterations=2))
    finally:
        log.disabled = disabled
    at = f"on its example program ({', '.join(_short(a) for a in avals)})"
    problems = [w for w in result.warnings if f"rule {r.name!r}" in w]
    if problems:
        raise ValueError(f"rule {r.name!r}: {at}: " + "; ".join(problems))
    if not result.stats[r.name].matched:
        raise ValueError(f"rule {r.name!r}: the pattern has no match {at}; the example should be a program the "
                         "rule applies in")
    if key is not None:
        CHECKS.write(key)
