"""The memory tie: where the model prices a rewrite and the input alike, XLA's own count of their temporaries
decides.

The model predicts a program's peak of temporaries (``cost/memory.py``), but not always the order XLA runs its
kernels in, which its simplifier's choice of a canonical form can move: ``eqx.nn.MLP``'s gradient, rewritten,
is priced 0.003% below JAX's with the same predicted peak, and XLA holds 3.67 MiB of temporaries for it against
3.15 for JAX's; a recurrent network's gradient, rewritten, priced 0.3% below, holds 870,916 B against 1,312,004.
The model is blind both ways, so neither side can be preferred on a tie by rule (``benchmarks/results/log.md``,
"A time tie, measured and not kept"). Instead, where a rewrite was chosen priced within the model's
``memory_tie`` (0.1%) of the input, and either is predicted to hold at least :data:`TIE_BYTES`, both are compiled
for abstract inputs (nothing runs) and ``memory_analysis()`` is read: the input replaces the rewrite only where
the rewrite holds more by ``extract.fatter`` (a page and 2%); on an equal count the price decides, as everywhere
else. On the decision corpus with the tie widened to 3%, 21 cases compiled 34 pairs (93 s); only the equinox
gradient's rewrite held more; every pair XLA sized apart beyond 0.1% held less for the rewrite, so the tie is
0.1% wide: 9 cases, 11 pairs, 13 s (``benchmarks/results/log.md``, "The memory tie"; ``docs/design.md`` says
what it costs a first call). Since a rewrite priced within :data:`ALIKE` gives way without a compile, the band
beyond it compiled one pair on the decision corpus and the ecosystem suite, which switched nothing: the tie is
``ALIKE`` wide by default (``AnalyticCost.memory_tie``), and XLA is asked only where a caller widens it.

Each program's count is kept for the life of the process and, where the disk cache is on
(``rewrite/cache/store.py``, ``JAX_REWRITE_CACHE_DIR``), on disk beside the rewritten programs, keyed by the
program and the versions, so that a second process does not compile it again (:func:`xla_temps`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax

from ..cost.measure import _outside_traces, measurable
from ..ir.jaxapi import core
from .extract import bounds_memory, fatter
from .program import prices_programs

log = logging.getLogger("rewrite")

#: Either program must be predicted to hold at least this many bytes of temporaries for the tie to compile them:
#: below it a difference costs little, and a compile of a small program costs as much as a large one's rewrite.
TIE_BYTES = 2 ** 20

#: A rewrite priced this close to the input (relative) is priced *alike*: the model sees nothing gained, and the
#: input as written is kept without compiling either program. On the ecosystem suite every rewrite the tie compiled
#: was priced 0.0002-0.003% below its input (six of 24 programs, 5.4 s of compiles at a first call), and XLA held
#: as much or more for each (``benchmarks/results/log.md``, "The memory tie, priced alike").
ALIKE = 1e-4

_COUNTS: dict[str, int] = {}
#: Where counts are kept across processes: ``rewrite/cache/store.py`` (a layer above this one) sets a
#: ``TieCounts`` here as it is imported, with ``key(program)``, ``read(key)`` and ``write(key, count)``; ``None``:
#: this process's cache alone.
STORE: Any = None
_LOCK = threading.Lock()
#: How many programs this process compiled for the tie and read from the caches, the seconds, the rewrites given up.
COMPILED: dict[str, float] = {"compiled": 0, "cached": 0, "switched": 0, "alike": 0, "seconds": 0.0}


def tie_width(model: Any) -> float:
    """``model.memory_tie`` where the model prices whole programs and bounds memory (``extract.bounds_memory``),
    and does not time its candidates (``cost_model="measure"`` decides by the clock); else 0 (off)."""
    if getattr(model, "measures", False) or not prices_programs(model) or not bounds_memory(model):
        return 0.0
    return max(0.0, float(getattr(model, "memory_tie", 0.0) or 0.0))


def on_xla_count(ex: Any, before: Any, after: Any, emit_choice: Callable[[dict], Any], model: Any
                 ) -> tuple[Any, Any]:
    """``(ex, after)``, or the input and ``before`` where a rewrite was chosen priced within the tie of the input
    and XLA says it holds more temporaries (see the module docstring), or priced alike (:data:`ALIKE`: kept
    without a compile). ``ex`` is an ``Extraction`` after
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
    # (either predicted over TIE_BYTES decides it, so the input is not predicted where the rewrite is: a replay of
    # its kernels, 10 ms of jaxmd_lj_forces' first rewrite)
    if predict is None or (predict(after) < TIE_BYTES and predict(before) < TIE_BYTES):
        return ex, after
    if abs(orig.cost - ex.cost) <= ALIKE * orig.cost:  # priced alike: nothing to gain, nothing to compile
        COMPILED["alike"] += 1
        return _the_input(ex, orig, before, None)
    counts = xla_temps(after, before)
    if counts is None or not fatter(counts[0], counts[1]):
        return ex, after
    COMPILED["switched"] += 1
    return _the_input(ex, orig, before, (counts[1], counts[0]))


def _the_input(ex: Any, orig: Any, before: Any, counts: tuple[int, int] | None) -> tuple[Any, Any]:
    return (dataclasses.replace(ex, choice=orig.choice, cost=orig.cost, rewritten=False, lean=False,
                                leaner_fallback=None, xla_temps=counts), before)


def _key(program: Any) -> str:
    key = getattr(STORE, "key", None)
    found = key(program) if key is not None else None
    return found or hashlib.sha256(b"memory tie\0" + str(program).encode()).hexdigest()


def xla_temps(first: Any, second: Any) -> tuple[int, int] | None:
    """XLA's temporaries (``memory_analysis().temp_size_in_bytes``) of two ``ClosedJaxpr`` of one signature,
    compiled for abstract inputs (``jax.ShapeDtypeStruct``: nothing runs), outside any trace (as
    ``cost/measure.py`` times), the two at once (XLA's compiler lets go of Python's lock); each read from this
    process's cache or the disk cache where it was counted before (the input as written, held to several
    rewrites, is compiled once). ``None`` where either cannot be compiled so (effects, sharded inputs, a failed
    compile)."""
    if not (measurable(first) and measurable(second)):
        return None
    keys = [_key(first), _key(second)]
    counts: list[int | None] = []
    for key in keys:
        with _LOCK:
            found = _COUNTS.get(key)
        if found is None and STORE is not None and (found := STORE.read(key)) is not None:
            with _LOCK:
                _COUNTS[key] = found
        counts.append(found)
    missing = [p for p, c in zip((first, second), counts) if c is None]
    COMPILED["cached"] += 2 - len(missing)
    if missing:
        t = time.perf_counter()
        try:
            made = iter(_outside_traces(_compile_all, missing))
        except Exception as e:  # a program XLA will not compile for abstract inputs: the price decides
            log.info("memory tie: could not compile: %s: %s", type(e).__name__, e)
            return None
        finally:
            COMPILED["seconds"] += time.perf_counter() - t
        COMPILED["compiled"] += len(missing)
        for i, key in enumerate(keys):
            if counts[i] is None:
                counts[i] = next(made)
                with _LOCK:
                    _COUNTS[key] = counts[i]
                if STORE is not None:
                    STORE.write(key, counts[i])
    return counts[0], counts[1]  # type: ignore[return-value]


def _compile(p: Any) -> int:
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in p.in_avals]
    return int(jax.jit(core.jaxpr_as_fun(p)).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def _compile_all(programs: list) -> list[int]:
    """Each program's count (:func:`_compile`), the programs compiled on threads of their own at once."""
    if len(programs) == 1:
        return [_compile(programs[0])]
    with ThreadPoolExecutor(len(programs), thread_name_prefix="rewrite-tie") as pool:
        return list(pool.map(_compile, programs))
