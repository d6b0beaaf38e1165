"""Measured costs per backend, read from ``calibration.json``, which ``benchmarks/calibrate.py`` writes.

Nanoseconds per element (per byte, per flop, per kernel) on the machine each table names, the
fastest of several runs under the load recorded. Only ratios matter to extraction; rerun the
script on a backend to calibrate it. ``BACKENDS`` maps ``jax.default_backend()`` to its table's name.

>>> from rewrite.cost import calibration
>>> calibration.BACKENDS["cpu"], calibration.CPU["platform"]
('CPU', 'cpu')
"""

import json
import pathlib

PATH = pathlib.Path(__file__).with_name("calibration.json")
_TABLES = json.loads(PATH.read_text())

BACKENDS: dict[str, str] = _TABLES.pop("BACKENDS")
CPU: dict = _TABLES["CPU"]
GPU: dict = _TABLES["GPU"]
