"""``rulesets.derivatives``' kernel part: ``sin(b x)**2 / b`` as :func:`rulesets.kernels.sin_squared.sin_squared_over`,
a ``jax.custom_vjp`` whose backward computes both gradients from one ``sin`` and one ``cos`` an element
(``derivatives_kernels``, ``jointly=True``: whether it pays is decided on the joint program of a gradient, since its
forward is the program's own operations and its backward is what changes).

The rule declines (offers nothing) for dtypes other than float32 and float64 (bfloat16 measured 0.25x and 0.31x
of JAX's VJP at seed 000's T=512, 2048; float16 ran faster but its half-precision block sums were not checked
against the tolerance), for shapes the kernel does not cover (:func:`rulesets.kernels.sin_squared.covers`), off
the CPU (not measured there), and where the program reads ``b x`` or ``sin(b x)`` elsewhere (:func:`_read_elsewhere`:
a step that JAX differentiated itself, whose backward would compute ``sin`` again beside the kernel's, measured
0.78x and 0.91x at T=512, 2048). The kernel's forward divides by ``reduce_precision(b)``, so the pattern is not
found again in its own body.

The rule is ``prefer=True``: its forward is the program's own operations (the ``reduce_precision`` XLA drops), priced
as they are, so a forward's extraction alone would never take it over the matched form and the joint programs
would never be compared; preferred, the forward takes it wherever it fires, and ``jax.grad``/``jax.vjp`` of the
rewritten function keep it only where its joint program is taken over the one without it and JAX's
(``rewrite.grad.vjp.decided_jointly``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rewrite import Pat, Ruleset, Tolerance, procedural, rule
from rulesets._examples import f32
from rulesets.kernels.sin_squared import covers, sin_squared_over

__all__ = ["derivatives_kernels"]

B, X = Pat.var("b"), Pat.var("x")
_SIN2_OVER = Pat("div", Pat("integer_pow", Pat("sin", Pat("mul", B, X)), params="p"), B)
_DTYPES = frozenset(("float32", "float64"))


def _read_elsewhere(m: Any) -> bool:
    """Whether ``b x`` or ``sin(b x)`` has a reader besides ``sin`` and the square (a ``cos`` of a backward that
    JAX derived, say): the kernel's forward computes them again apart from that reader."""
    num = next(n.operands[0] for n in m.root.nodes if n.prim == "div" and n.operands[1].name == m["b"].name)
    s = num.node("integer_pow").operands[0]
    bx = s.node("sin").operands[0]
    return any(u.name != s.name for u, _ in m.users(bx)) or any(u.name != num.name for u, _ in m.users(s))


@procedural
def _sin2_over(m: Any) -> Any:
    """``sin(b x)**2 / b -> sin_squared_over(x, b)`` where the kernel covers it and pays (the module's list)."""
    x, b, p = m["x"], m["b"], m.params("p")
    if p.y != 2 or jax.default_backend() != "cpu" or np.dtype(x.dtype).name not in _DTYPES:
        return None
    if x.dtype != b.dtype or x.weak_type or b.weak_type or x.shape != m.root.shape or not covers(x.shape, b.shape):
        return None
    if _read_elsewhere(m):
        return None
    return m.trace(sin_squared_over, x, b)


def _seed(x: Any, a: Any) -> Any:
    return jax.numpy.sin(a * x) ** 2 / a


derivatives_kernels = Ruleset("derivatives_kernels", [
    rule(_SIN2_OVER, _sin2_over, name="trig_sin2_over", prefer=True,  # sin(b x)**2 / b -> sin_squared_over(x, b)
         example_program=(_seed, (f32(64, 64), f32(64)))),
], soundness="identity", tolerance=Tolerance(terms=64), jointly=True,
    description="sin(b x)**2 / b as a kernel whose backward reads one sin and one cos an element")
