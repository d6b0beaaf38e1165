"""Property-based checks for rules and rewritten programs, built on hypothesis.

No rewrite is trusted until it has been tested. :func:`check_ruleset` takes
each rule on its own, treats its left-hand side (or, for a :class:`Pat` rule,
its example program) as a program, rewrites that program with the one rule,
insists that the rule really fired and that the emitted program really uses
what it built, and compares the two programs on inputs that hypothesis draws
and shrinks. :func:`assert_equivalent` does the same for a whole program
and the rulesets it is rewritten with. What "equal" means, and which inputs
are drawn, follows the soundness class each rule declares: ``exact`` rules
are compared bit for bit on every value a float can hold, ``identity`` rules
within a tolerance on finite values, and ``fastmath`` rules within their
stated tolerance on ordinary values (see ``docs/testing.md``). The package
also offers the strategies it is built from: :func:`elements`,
:func:`arrays`, :func:`inputs_like` and :func:`programs`, which draws random
JAX programs for fuzz tests. Every check follows the active hypothesis
profile unless it is given ``max_examples``.

One module per job, each importing only those before it:
``_strategies`` (what is drawn), ``_compare`` (what counts as equal),
``_magnitude`` (:func:`magnitudes`, the terms a tolerance with ``terms`` is
relative to), ``_run`` (running a rule's two programs, and :func:`as_written`,
every operation rounded as written), ``_check_rule`` (:func:`check_ruleset`) and ``_check_program``
(:func:`assert_equivalent`, :func:`assert_same_results`); random programs
come from ``rewrite.testing._programs``. Import the public names from here.
"""

from ._check_program import VacuousCheckWarning, assert_equivalent, assert_same_results
from ._check_rule import CheckReport, RuleCheck, check_ruleset
from ._compare import derivative_mismatch, mismatch, soundness_of
from ._magnitude import magnitudes
from ._programs import RandomProgram, programs
from ._run import as_written
from ._strategies import ORDINARY_BOUND, arrays, elements, inputs_like, value_bound

__all__ = [
    "CheckReport",
    "RandomProgram",
    "RuleCheck",
    "VacuousCheckWarning",
    "arrays",
    "as_written",
    "assert_equivalent",
    "assert_same_results",
    "check_ruleset",
    "derivative_mismatch",
    "elements",
    "inputs_like",
    "magnitudes",
    "mismatch",
    "programs",
    "soundness_of",
    "value_bound",
]
