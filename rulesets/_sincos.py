"""``sin(x)`` in a form XLA:CPU stores once rather than computes again beside ``cos(x)``, bitwise ``lax.sin``
(``rulesets.derivatives``' ``trig_sin_stored``).

Where a loop XLA cannot fuse into (a library reduction) reads ``sin(x)``, XLA stores it for that loop and
still computes it again in every other loop that reads it, beside ``cos(x)`` there: three transcendentals
an element in seed 000's VJP. ``select(|x| < tiny, x, sin(x))`` is the same value (``sin(x)`` is ``x`` where
``|x|`` is below the smallest normal: zeros of either sign and subnormals), but a ``select`` of three full
arrays is an operation XLA does not duplicate into its readers (``ComputeGloballyUnfusible``, which the
fusion model replays): it is stored once and read by every loop, and the loop with ``cos(x)`` computes
``cos`` alone: two transcendentals. The inner ``sin`` reads ``reduce_precision(x)`` at the type's own
precision, the identity on every bit pattern (NaN payloads included), so that it is a term of its own in
the e-graph rather than the class the ``select`` stands for. float16 and bfloat16, which XLA:CPU computes
in float32 and rounds, go through float32 the same way (bitwise equal on all 65536 values of each:
``tests/test_sincos.py``).

An exponential of ``complex(0, x)`` (``cos`` and ``sin`` as its real and imaginary parts) was measured
first: XLA's simplifier turns it back into the same ``cos(x)`` and ``select(x == 0, 0, sin(x))``, so it
shares nothing more than this ``select`` does, and it rounds ``-0.0`` and subnormals to ``+0.0``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax

from rewrite import procedural

#: The dtypes XLA:CPU computes ``sin`` in: float32 and float64 as they are, float16 and bfloat16 in float32.
_OWN = frozenset(("float32", "float64"))
_IN_FLOAT32 = frozenset(("float16", "bfloat16"))


def stored_sin(t: Any) -> Any:
    """``lax.sin(t)``, bitwise, as a ``select`` XLA:CPU stores once rather than duplicates into its readers.

    >>> import jax.numpy as jnp
    >>> t = jnp.array([-0.0, 1e-45, 1.0, 3e38, jnp.inf, jnp.nan], jnp.float32)
    >>> bool((stored_sin(t).view(jnp.int32) == jnp.sin(t).view(jnp.int32)).all())
    True
    """
    wide = np.dtype(t.dtype) if np.dtype(t.dtype).name in _OWN else np.dtype(np.float32)
    u = lax.convert_element_type(t, wide)
    info = np.finfo(wide)
    same = lax.reduce_precision(u, exponent_bits=info.nexp, mantissa_bits=info.nmant)  # every bit kept
    s = lax.select(lax.lt(lax.abs(u), np.asarray(info.tiny, wide)), u, lax.sin(same))
    return lax.convert_element_type(s, t.dtype)


@procedural
def sin_stored(m: Any) -> Any:
    """``sin(x) -> stored_sin(x)`` where ``cos(x)`` of the same ``x`` is in the program too (elsewhere XLA
    fuses ``sin`` into its one reader and storing it cannot pay); declined for other dtypes."""
    x = m["x"]
    if np.dtype(x.dtype).name not in _OWN | _IN_FLOAT32 or x.weak_type:
        return None
    if not any(n.prim == "cos" for _, n in m.users(x)):
        return None
    return m.trace(stored_sin, x)
