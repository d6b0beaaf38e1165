"""``jax.nn.softmax`` and ``jax.nn.logsumexp`` as the rewriter loads them, whichever way JAX traced them.

Since jax 0.12.1 ``jax_softmax_custom_jvp`` is on by default, so ``jax.nn.softmax`` traces as a
``custom_jvp_call`` of ``_softmax`` (``jax/_src/ops/special.py``) with JAX's own derivative rule, where jax 0.12.0
and earlier traced its body inline: the row max, ``stop_gradient`` of it, the shift, ``exp``, the row sum and the
quotient. Every rule over a softmax (``rulesets.nn``'s ``log(softmax(z)) -> log_softmax(z)``, the attention and
LM-head packs) is a pattern over that body, and the cost model prices XLA:CPU's fused attention kernel from it. Seen
as an opaque call none of them applies: on jax 0.12.1 the packs' own example checks failed and ``rulesets.nn`` and
``rulesets.attention`` raised on import.

So the loader reads JAX's softmax call as the program ``jax.nn.softmax`` traces with the setting off
(:func:`plain_softmax`): the same values, by the same operations, and a derivative that is the exact one (JAX's
with the setting off: the max's ``stop_gradient`` makes the shift a constant, as softmax does not depend on it).
XLA compiles the forward alike (the call is inlined, ``stop_gradient`` is no operation). A program the rewriter
emits holds the plain form, so its derivative is autodiff's of it, as on jax 0.12.0 by default, not JAX's rule:
on XLA:CPU (jax 0.12.1, 2026-12-07) the gradient of ``sum(log(softmax(x)) * y)`` at ``[512, 8192]`` held 0 MiB of
temporaries against 16 MiB with JAX's rule and ran 2.0x as fast, of ``sum((softmax(x) - y) ** 2)`` 1.65x; of
attention ``[8, 512, 64]`` JAX's rule ran 7% faster, with the same memory.

jax 0.12.1 also made ``logsumexp`` a ``custom_jvp_call`` (of ``_logsumexp_impl``, whose rule reads the softmax),
which optax's integer-label cross-entropy calls: its body is jax 0.12.0's ``logsumexp``, row max under
``stop_gradient`` already, and is read as it is (:func:`plain_call`). Seen as a call, no whole-step search over
such a loss proved it on jax 0.12.1 (``tests/test_wholestep.py``'s steps over that cross-entropy).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import numpy as np

#: Where JAX defines the softmax its ``jax.nn.softmax`` calls (``jax._src.ops.special._softmax``).
_SOURCE = re.compile(r"[\\/]jax[\\/]_src[\\/](ops[\\/]special|nn[\\/]functions)\.py")


def plain_call(eqn: Any) -> Any | None:
    """What the loader reads in place of ``eqn``, a ``custom_jvp_call``, where it is JAX's own softmax
    (:func:`plain_softmax`) or JAX's own log-sum-exp, which jax 0.12.1 made a ``custom_jvp_call`` of
    ``_logsumexp_impl`` (its rule reads ``jax.nn.softmax``): the body of that one is jax 0.12.0's ``logsumexp``
    as it was, its row max under ``stop_gradient``, so its derivative by autodiff is the exact one and the body is
    read as it is; ``None`` for any other call."""
    closed = eqn.params.get("call_jaxpr")
    if eqn.primitive.name != "custom_jvp_call" or closed is None:
        return None
    name = _jax_s(closed)
    if name == "_softmax":
        return plain_softmax(eqn)
    if name == "_logsumexp_impl" and not closed.jaxpr.effects and len(closed.in_avals) == len(eqn.invars):
        return closed
    return None


def _jax_s(closed: Any) -> str | None:
    """The name of a ``custom_jvp_call``'s body where JAX's own module defines it, else ``None``."""
    debug = closed.jaxpr.debug_info
    name = getattr(debug, "func_name", None)
    return name if _SOURCE.search(str(getattr(debug, "func_src_info", ""))) else None


def plain_softmax(eqn: Any) -> Any | None:
    """The closed jaxpr ``jax.nn.softmax`` traces with ``jax_softmax_custom_jvp`` off, for ``eqn`` where it is
    JAX's own softmax traced as a ``custom_jvp_call``, of the call's operands and output type; else ``None``, and
    the call is loaded as any other. Its operands: the constants its body closed over (``num_consts``), ``x``, a
    boolean ``where`` if given, and on jax 0.10 the row max's ``initial``, which ``jax.nn.softmax`` passes as
    ``-inf`` (only a literal ``-inf`` is taken); its axes are those of its body's row max. The plain program reads
    ``x`` and ``where`` alone: the constants and ``initial`` are its own."""
    params = eqn.params
    closed = params.get("call_jaxpr")
    if eqn.primitive.name != "custom_jvp_call" or closed is None or len(eqn.outvars) != 1:
        return None
    if _jax_s(closed) != "_softmax":
        return None
    axes = next((tuple(e.params["axes"]) for e in closed.jaxpr.eqns if e.primitive.name == "reduce_max"), None)
    consts = int(params.get("num_consts", 0) or 0)
    operands = list(eqn.invars[consts:])
    initial = operands[-1] if operands and operands[-1].aval.shape == () and operands[-1].aval.dtype != bool else None
    if initial is not None:  # jax 0.10's ``initial``: -inf, as jax.nn.softmax passes it
        operands.pop()
        if not np.isneginf(np.asarray(getattr(initial, "val", 0.0))).all():
            return None
    if axes is None or not 1 <= len(operands) <= 2 or (len(operands) == 2 and operands[1].aval.dtype != bool):
        return None
    avals = tuple(v.aval for v in eqn.invars)
    try:
        plain = _traced(avals, consts, len(operands) == 2, axes,
                        (jax.config.jax_enable_x64, jax.config.jax_numpy_dtype_promotion))
    except Exception:  # (an aval that cannot key the cache, or a trace JAX refuses): loaded as the call it is
        return None
    if plain is None or tuple(plain.in_avals) != avals or plain.out_avals[0] != eqn.outvars[0].aval:
        return None
    return plain


@functools.lru_cache(maxsize=256)
def _traced(avals: tuple, consts: int, masked: bool, axes: tuple, settings: tuple) -> Any:  # (settings: the trace's)
    def softmax(*args: Any) -> Any:
        x, where = args[consts], args[consts + 1] if masked else None
        with jax.softmax_custom_jvp(False):
            return jax.nn.softmax(x, axis=axes, where=where)

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in avals]
    closed = jax.make_jaxpr(softmax)(*specs)
    return closed if len(closed.out_avals) == 1 else None
