"""No dtype test in ``rewrite/`` or ``rulesets/`` asks numpy whether a dtype is a float (issue 29).

``np.issubdtype(d, np.inexact)`` and ``np.issubdtype(d, np.floating)`` are
False for bfloat16 and the float8 types, which are ``ml_dtypes`` extensions
numpy does not know as floats; such a test silently treats a bfloat16 value
as an integer (no gradient, no rule). ``jnp.issubdtype`` knows them. This
test reads the sources, so a new such test fails here, naming its place.
"""

from __future__ import annotations

import ast
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from rewrite.cost.measure import synthetic_inputs

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Float classes numpy does not put the ml_dtypes in.
_FLOAT_CLASSES = {"inexact", "floating"}


def _numpy_names(tree: ast.AST) -> set[str]:
    """The names a module binds to numpy (``import numpy as np``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name == "numpy"}
    return names


def numpy_float_tests(source: str) -> list[int]:
    """Lines of ``source`` that call numpy's ``issubdtype`` with ``np.inexact`` or ``np.floating``."""
    tree = ast.parse(source)
    np_names = _numpy_names(tree)

    def is_np(node: ast.AST, attr: set[str]) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in attr
                and isinstance(node.value, ast.Name) and node.value.id in np_names)

    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and is_np(node.func, {"issubdtype"}) and len(node.args) == 2
            and is_np(node.args[1], _FLOAT_CLASSES)]


def test_the_search_finds_numpy_float_tests_and_nothing_else():
    source = ("import numpy as np\nimport numpy\nimport jax.numpy as jnp\n"
              "a = np.issubdtype(d, np.inexact)\n"
              "b = numpy.issubdtype(\n    d,\n    numpy.floating)\n"
              "c = jnp.issubdtype(d, jnp.floating)\n"
              "e = np.issubdtype(d, np.integer)\n")
    assert numpy_float_tests(source) == [4, 5]
    assert np.issubdtype(np.dtype(jnp.bfloat16), np.inexact) is False  # why the test exists
    assert jnp.issubdtype(jnp.bfloat16, jnp.inexact)


def test_no_dtype_test_asks_numpy_whether_a_dtype_is_a_float():
    found = []
    for path in sorted([*ROOT.joinpath("rewrite").rglob("*.py"), *ROOT.joinpath("rulesets").rglob("*.py")]):
        found += [f"{path.relative_to(ROOT)}:{line}" for line in numpy_float_tests(path.read_text())]
    assert not found, ("np.issubdtype(..., np.inexact | np.floating) is False for bfloat16 and float8; "
                       "use jnp.issubdtype: " + ", ".join(found))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, ml_dtypes.float8_e4m3fn, jnp.float16, jnp.float32])
def test_synthetic_inputs_of_every_float_dtype_are_random(dtype):
    from jax import ShapeDtypeStruct

    x, = synthetic_inputs([ShapeDtypeStruct((64,), dtype)])
    assert x.dtype == dtype and np.count_nonzero(np.asarray(x, np.float32)) > 32  # was all zeros for float8
