"""The memory tie: where the model prices the chosen program and its rival alike, XLA's own count of their
temporaries decides.

The model predicts a program's peak of temporaries (``cost/memory.py``), but not always the order XLA runs its
kernels in, which its simplifier's choice of a canonical form can move: ``eqx.nn.MLP``'s gradient, rewritten,
is priced 0.02% below JAX's with the same predicted peak, and XLA holds 3.67 MiB of temporaries for it against
3.15 for JAX's; a recurrent network's gradient, rewritten, priced 0.3% below, holds 870,916 B against 1,312,004.
The model is blind both ways, so neither side can be preferred on a tie by rule (``benchmarks/results/log.md``,
"A time tie, measured and not kept"). Instead, where a rewrite was chosen priced within the model's
``memory_tie`` (0.1%) of the input, and either is predicted to hold at least :data:`TIE_BYTES`, both are compiled
for abstract inputs (nothing runs) and ``memory_analysis()`` is read: the input replaces the rewrite only where
the rewrite holds more by ``extract.fatter`` (a page and 2%); on an equal count the price decides, as everywhere
else. On the decision corpus with the tie widened to 3%, 21 cases compiled 34 pairs (93 s); only the equinox
gradient's rewrite held more; every pair XLA sized apart beyond 0.1% held less for the rewrite, so the tie is
0.1% wide: 14 cases, 16 pairs, 27 s (``benchmarks/results/log.md``).

Each verdict (the two counts) is kept for the life of the process and, where the disk cache is on
(``rewrite/cache/store.py``, ``JAX_REWRITE_CACHE_DIR``), on disk beside the rewritten programs, keyed by the two
programs and the versions, so that a second process does not compile them again (:func:`xla_temps`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from typing import Any, Callable

from .extract import bounds_memory, fatter
from .program import prices_programs

log = logging.getLogger("rewrite")

#: Either program must be predicted to hold at least this many bytes of temporaries for the tie to compile them:
#: below it a difference costs little, and a compile of a small program costs as much as a large one's rewrite.
TIE_BYTES = 2 ** 20

_COUNTS: dict[str, tuple[int, int]] = {}
_LOCK = threading.Lock()
#: How many pairs this process compiled, and how many it read from the caches (for ``benchmarks``' counts).
COMPILED: dict[str, float] = {"compiled": 0, "cached": 0, "switched": 0, "seconds": 0.0}


def tie_width(model: Any) -> float:
    """``model.memory_tie`` where the model prices whole programs and bounds memory (``extract.bounds_memory``),
    and does not time its candidates (``cost_model="measure"`` decides by the clock); else 0 (off)."""
    if getattr(model, "measures", False) or not prices_programs(model) or not bounds_memory(model):
        return 0.0
    return max(0.0, float(getattr(model, "memory_tie", 0.0) or 0.0))


def on_xla_count(ex: Any, before: Any, after: Any, emit_choice: Callable[[dict], Any], model: Any
                 ) -> tuple[Any, Any]:
    """``(ex, after)``, or the input and ``before`` where a rewrite was chosen priced within the tie of the input
    and XLA says it holds more temporaries (see the module docstring). ``ex`` is an ``Extraction`` after
    ``policy.no_fatter``, ``after`` its emitted program, ``before`` the input program as written, which is what is
    compared and kept (the input's candidate, emitted again, may be ordered otherwise, and XLA may hold more for
    it: ``eqx.nn.MLP``'s gradient so emitted holds 3.67 MiB, as written 3.15). ``emit_choice`` is not called:
    the input kept on a tie is not compared with a rewrite (the decision corpus's five such pairs, priced exactly
    alike, held the same, and took 14 s to compile), since the input can hold no more than itself."""
    width = tie_width(model)
    if not width or not ex.rewritten or getattr(ex, "lean", False):
        return ex, after
    orig = next((c for c in ex.candidates if not c.rewritten), None)
    if orig is None or not (0 < orig.cost < float("inf")) or abs(orig.cost - ex.cost) > width * orig.cost:
        return ex, after  # (no input candidate: preferred rules barred its forms, there is nothing to go back to)
    predict = getattr(model, "predict_temp_bytes", None)
    if predict is None or max(predict(after), predict(before)) < TIE_BYTES:
        return ex, after
    counts = xla_temps(after, before)
    if counts is None or not fatter(counts[0], counts[1]):
        return ex, after
    COMPILED["switched"] += 1
    return (dataclasses.replace(ex, choice=orig.choice, cost=orig.cost, rewritten=False, lean=False,
                                leaner_fallback=None, xla_temps=(counts[1], counts[0])), before)


def _key(first: Any, second: Any) -> str:
    from ..cache.fingerprint import Unstable, program_fingerprint

    h = hashlib.sha256(b"memory tie\0")
    for p in (first, second):
        try:
            h.update(program_fingerprint(p).encode())
        except Unstable:
            h.update(str(p).encode())
        h.update(b"\0")
    return h.hexdigest()


def xla_temps(first: Any, second: Any) -> tuple[int, int] | None:
    """XLA's temporaries (``memory_analysis().temp_size_in_bytes``) of two ``ClosedJaxpr`` of one signature,
    compiled for abstract inputs (``jax.ShapeDtypeStruct``: nothing runs), outside any trace (as
    ``cost/measure.py`` times); read from this process's cache or the disk cache where they were counted before.
    ``None`` where either cannot be compiled so (effects, sharded inputs, a failed compile)."""
    from ..cost.measure import measurable

    if not (measurable(first) and measurable(second)):
        return None
    key = _key(first, second)
    with _LOCK:
        found = _COUNTS.get(key)
    if found is None:
        found = _from_disk(key)
    if found is not None:
        COMPILED["cached"] += 1
        with _LOCK:
            _COUNTS[key] = found
        return found
    from ..cost.measure import _outside_traces

    t = time.perf_counter()
    try:
        found = _outside_traces(_compile_both, first, second)
    except Exception as e:  # a program XLA will not compile for abstract inputs: the price decides
        log.info("memory tie: could not compile: %s: %s", type(e).__name__, e)
        return None
    finally:
        COMPILED["seconds"] += time.perf_counter() - t
    COMPILED["compiled"] += 1
    with _LOCK:
        _COUNTS[key] = found
    _to_disk(key, found)
    return found


def _compile_both(first: Any, second: Any) -> tuple[int, int]:
    import jax

    from ..ir.jaxapi import core

    def temp(p: Any) -> int:
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in p.in_avals]
        return int(jax.jit(core.jaxpr_as_fun(p)).lower(*args).compile().memory_analysis().temp_size_in_bytes)

    return temp(first), temp(second)


def _disk() -> Any:
    from ..cache.store import resolve

    try:
        return resolve(None)
    except Exception:
        return None


def _from_disk(key: str) -> tuple[int, int] | None:
    cache = _disk()
    if cache is None:
        return None
    try:
        found = cache.read(key)
    except Exception:  # unusable or untrusted: compiled again, and written over
        return None
    temps = None if found is None else found[0].get("meta", {}).get("xla_temps")
    if isinstance(temps, list) and len(temps) == 2 and all(isinstance(t, int) for t in temps):
        return temps[0], temps[1]
    return None


def _to_disk(key: str, temps: tuple[int, int]) -> None:
    from ..cache.key import environment
    from ..cache.serialise import FORMAT

    cache = _disk()
    if cache is None:
        return
    try:
        cache.write(key, {"format": FORMAT, "key": key, "env": environment(), "meta": {"xla_temps": list(temps)}},
                    b"")
    except Exception as e:  # a directory it cannot write: counted again next time
        log.debug("memory tie: not stored: %s: %s", type(e).__name__, e)
