"""Measured costs per backend, read from ``calibration.json``, which ``benchmarks/calibrate.py`` writes.

Nanoseconds per element (per byte, per flop, per kernel) on the machine each table names, the
fastest of several runs under the load recorded. Only ratios matter to extraction; rerun the
script on a backend to calibrate it. ``BACKENDS`` maps ``jax.default_backend()`` to its table's name.

XLA's kernels change with jaxlib: ``OVERLAYS`` holds, per table and per jaxlib ``major.minor``, the
entries measured again on that jaxlib where they differ from the table's own (which names the JAX it
was measured on); ``CPU`` and ``GPU`` are the tables with the installed jaxlib's overlay applied.

>>> from rewrite.cost import calibration
>>> calibration.BACKENDS["cpu"], calibration.CPU["platform"]
('CPU', 'cpu')
>>> calibration.table_for("CPU", "0.0")["jax"] == calibration.CPU["jax"]  # no overlay for a jaxlib 0.0
True
"""

import json
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jaxlib

PATH = pathlib.Path(__file__).with_name("calibration.json")
_TABLES = json.loads(PATH.read_text())

BACKENDS: dict[str, str] = _TABLES.pop("BACKENDS")
#: table name -> jaxlib ``major.minor`` -> the entries measured on that jaxlib in place of the table's
OVERLAYS: dict[str, dict[str, dict[str, Any]]] = _TABLES.pop("OVERLAYS", {})
#: the installed jaxlib's ``major.minor``, whose overlays apply
JAXLIB = ".".join(jaxlib.__version__.split(".")[:2])


def table_for(name: str, xla: str = JAXLIB) -> dict:
    """Table ``name`` as measured for jaxlib ``xla`` (``major.minor``): its entries with that jaxlib's overlay."""
    return {**_TABLES[name], **OVERLAYS.get(name, {}).get(xla, {})}


def base(name: str) -> dict:
    """Table ``name`` as ``calibration.json`` holds it, without any overlay (what ``benchmarks/calibrate.py`` writes
    back)."""
    return dict(_TABLES[name])


CPU: dict = table_for("CPU")
GPU: dict = table_for("GPU")

#: tables pinned by ``rewrite.cost.model.priced_with``, the innermost last
PINNED: list[Mapping[str, Any]] = []


def active() -> Mapping[str, Any]:
    """The table prices come from: the one ``priced_with`` pins, else the default backend's (``BACKENDS``), else
    the CPU's."""
    if PINNED:
        return PINNED[-1]
    return globals()[BACKENDS.get(jax.default_backend(), BACKENDS["cpu"])]
