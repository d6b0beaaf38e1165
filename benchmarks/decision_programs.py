"""Golden decisions for an input program other than the one ``tests/golden/decisions.json`` was measured on.

A decision is the cost model's choice on one input program. Where a JAX traces a case's builder into another
program (its own derivatives change between releases: jax 0.11 differentiates ``tanh`` through
``one_minus_square``, which puts the GELU derivative's ``x^2`` in one chain of products with ``x``, so
``prod_mul`` makes it the forward's own ``x^3`` and no ``pow_two`` is left to choose; tests/test_derivatives.py,
``test_a_square_multiplied_by_its_base_is_the_cube_the_forward_computed``), the decision recorded for the first
program does not apply. ``tests/golden/decisions.programs.json`` holds, per case, the decisions measured on
such other programs, each under its :func:`program_key`: the hash of the program's text with its params in
the version-neutral form (``rewrite.ir.jaxapi.neutral_jaxpr``), so that two JAX versions that trace the same
program share one entry and no entry is chosen by a version number. A program that has none is held to
``decisions.json``. The one exception: a training step whose whole-step search (``rewrite/grad/step.py``) traces
its loss's VJP with the installed JAX, so one input program can decide otherwise on another JAX; its decision
there is recorded under the key and that JAX's minor version (:func:`jax_key`, ``--this-jax``), which is read
first.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
from typing import Any

PROGRAMS = pathlib.Path(__file__).parent.parent / "tests" / "golden" / "decisions.programs.json"
REGENERATE_PROGRAM = ("python -m benchmarks.decisions --write --this-program "
                      "--cases {cases}")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def program_key(closed: Any) -> str:
    """A key of ``closed`` that is the same whichever supported JAX traced it and differs where the programs do."""
    from rewrite.ir.jaxapi import neutral_jaxpr

    text = _ADDRESS.sub(" at 0x...", str(neutral_jaxpr(closed)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _recorded() -> dict:
    return json.loads(PROGRAMS.read_text())["cases"] if PROGRAMS.exists() else {}


def jax_key(program: str) -> str:
    """``program``'s key qualified by the installed JAX's minor version (``<key>@jax 0.12``)."""
    import jax

    return f"{program}@jax {'.'.join(jax.__version__.split('.')[:2])}"


def golden_for(name: str, program: str, base: dict | None) -> tuple[dict | None, bool]:
    """The golden decision of case ``name`` on input program ``program``: the one recorded for that program on
    this JAX, else for that program, if any (and True), else ``base`` (and False)."""
    recorded = _recorded().get(name, {})
    found = recorded.get(jax_key(program), recorded.get(program))
    return (found, True) if found is not None else (base, False)


def measured_pairs(name: str, decided: dict, records: list[dict]) -> dict:
    """Case ``name``'s pairs in ``decided`` (a decision of ``decisions.decisions``), each with the side the model
    prefers and the ratios ``records`` measured for it (``None`` where none was)."""
    by_pair = {r["pair"]: r for r in records if r["case"] == name}
    pairs = {}
    for pair, side in decided["pairs"].items():
        r = by_pair.get(pair)
        pairs[pair] = {"prefers": side, "measured": None if r is None else round(r["measured"], 3),
                       "aa": None if r is None else round(r["aa"], 3),
                       "predicted_here": None if r is None else round(r["predicted"], 3)}
    return pairs


def write(golden: dict[str, dict], records: list[dict], traced_on: str, by_jax: bool = False) -> None:
    """Record each case's decision in ``golden`` (with its ``program``) for that program (``by_jax``: and this
    JAX's minor version), with the ratios ``records`` measured for its pairs."""
    cases = _recorded()
    for name, g in golden.items():
        key = jax_key(g["program"]) if by_jax else g["program"]
        cases.setdefault(name, {})[key] = {"traced_on": traced_on, "decision": g["decision"],
                                           "pairs": measured_pairs(name, g, records)}
    PROGRAMS.write_text(json.dumps({
        "note": "Golden decisions on input programs other than decisions.json's (benchmarks/decision_programs.py), "
                "by program key; regenerate only with a new measurement: "
                + REGENERATE_PROGRAM.format(cases="<the cases>"),
        "cases": {k: dict(sorted(v.items())) for k, v in sorted(cases.items())}}, indent=1) + "\n")
