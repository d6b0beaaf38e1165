"""``cost_model="measure"``: time the best candidate programs on the backend and keep the fastest.

The analytic model predicts what XLA will do; this mode asks. Extraction
ranks its distinct candidate programs (``Extraction.candidates``) by the
whole-program model; the best ``top_k`` are compiled with ``jax.jit`` on
random inputs of the program's shapes and timed side by side: each round
runs every candidate once, in a shuffled order, so drift in the machine's
speed hits all alike, and the candidate with the lowest median wins. With
``steer=True`` a variant of the predicted best is timed too, in which every
transcendental the model expects XLA to recompute in several loops is
computed once behind ``lax.optimization_barrier``.

The choice is cached per backend and per set of candidate programs, for the
life of the process, so a program is timed once. Programs with effects are
never run here (a callback must not fire during timing), nor programs whose
inputs carry shardings; for those the analytic choice stands.

>>> import jax.numpy as jnp
>>> from rewrite import rewrite
>>> f = rewrite(lambda x: jnp.sin(x) * 2.0, cost_model="measure")
>>> bool(jnp.allclose(f(jnp.ones(4)), 2 * jnp.sin(1.0)))
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import logging
import random
import statistics
import threading
import time
from typing import Any, Callable, ClassVar, Sequence

import jax
import numpy as np

from ..ir import primitives as _primitives
from ..ir.jaxapi import core, optimization_barrier_p
from .model import AnalyticCost, CostModel, as_cost_model, check_memory_budget, default_model
from .program import Program

log = logging.getLogger("rewrite")

_CACHE: dict[tuple, int] = {}
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Measured(AnalyticCost):
    """The analytic model for search, and the backend's own timings for the final choice.

    ``top_k`` candidates are timed for ``rounds`` rounds, each call repeated
    until a round lasts ``min_round_seconds``; measuring stops early after
    ``max_seconds``.
    """

    measures: ClassVar[bool] = True

    top_k: int = 4
    rounds: int = 7
    min_round_seconds: float = 0.02
    max_seconds: float = 30.0
    steer: bool = True

    def choose(self, programs: Sequence[core.ClosedJaxpr]) -> tuple[core.ClosedJaxpr, "Timing"]:
        """Time the best ``programs`` and keep the fastest (see :func:`choose`)."""
        return choose(self, programs)


@dataclasses.dataclass
class Timing:
    """What measuring found: each timed program's median seconds (``None`` if it failed) and the winner."""

    seconds: list[float | None]
    chosen: int
    labels: list[str]
    cached: bool = False


def measurable(closed: core.ClosedJaxpr) -> bool:
    """Can this program be run on synthetic inputs? Not with effects, nor with sharded inputs."""
    if closed.jaxpr.effects:
        return False
    for a in closed.in_avals:
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            return False
        sharding = getattr(a, "sharding", None)
        if sharding is not None and getattr(getattr(sharding, "mesh", None), "shape_tuple", ()) != ():
            return False
    return True


def synthetic_inputs(avals: Sequence[Any], seed: int = 0) -> list[Any]:
    """Random inputs of these shapes: normal floats, zero integers, ``False`` booleans."""
    rng = np.random.default_rng(seed)
    out = []
    for a in avals:
        dt = np.dtype(a.dtype)
        if jax.numpy.issubdtype(dt, jax.numpy.floating):  # numpy's test misses bfloat16 and float8
            out.append(jax.numpy.asarray(rng.standard_normal(a.shape).astype(np.float32), dtype=a.dtype))
        elif jax.numpy.issubdtype(dt, jax.numpy.complexfloating):
            out.append(jax.numpy.asarray(rng.standard_normal(a.shape) + 1j * rng.standard_normal(a.shape), dtype=a.dtype))
        else:
            out.append(jax.numpy.zeros(a.shape, a.dtype))
    return out


def _key(programs: Sequence[core.ClosedJaxpr]) -> tuple:
    h = hashlib.sha256()
    for p in programs:
        h.update(str(p).encode())
        h.update(b"\0")
    return (jax.default_backend(), h.hexdigest())


def _once(fn: Callable[..., Any], args: Sequence[Any], inner: int) -> float:
    t = time.perf_counter()
    for _ in range(inner):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / inner


def time_programs(programs: Sequence[core.ClosedJaxpr], model: Measured, seed: int = 0,
                  args: Sequence[Any] | None = None) -> list[float | None]:
    """Median seconds per call of each program, interleaved, on ``args`` (else random inputs of the
    programs' types); ``None`` for a program that fails to compile or to run."""
    if args is None:
        args = synthetic_inputs(programs[0].in_avals, seed)
    compiled: list[Any] = []
    for p in programs:
        try:
            compiled.append(jax.jit(core.jaxpr_as_fun(p)).lower(*args).compile())
        except Exception:
            compiled.append(None)
    inner = []
    for i, c in enumerate(compiled):
        if c is None:
            inner.append(0)
            continue
        try:  # a program may reject these inputs at run time (its own checks: eqx.error_if, checkify)
            _once(c, args, 1)
            inner.append(max(1, int(model.min_round_seconds / max(_once(c, args, 1), 1e-6))))
        except Exception as e:
            log.info("timing: program %d failed to run: %s: %s", i, type(e).__name__, e)
            compiled[i] = None
            inner.append(0)
    samples: list[list[float]] = [[] for _ in programs]
    order = [i for i, c in enumerate(compiled) if c is not None]
    rng = random.Random(seed)
    start = time.perf_counter()
    for _ in range(model.rounds):
        rng.shuffle(order)
        for i in order:
            samples[i].append(_once(compiled[i], args, inner[i]))
        if time.perf_counter() - start > model.max_seconds:
            break
    return [statistics.median(s) if s else None for s in samples]


def pin_duplicates(closed: core.ClosedJaxpr, model: AnalyticCost) -> core.ClosedJaxpr | None:
    """A variant that computes, once, each transcendental the fusion model expects in several loops.

    Each such value is passed through ``lax.optimization_barrier``, which
    XLA does not fuse through; ``None`` if the model predicts no duplicate.
    """
    prog = Program.from_jaxpr(closed, model)
    homes, _ = model.fusion_model().fuse(prog)
    jaxpr = closed.jaxpr
    pinned = {prog.ops[i].key.outvars[0] for i, hs in homes.items()
              if len(hs) > 1 and prog.ops[i].family == _primitives.TRANSCENDENTAL
              and isinstance(prog.ops[i].key, core.JaxprEqn)}
    if not pinned:
        return None
    subst: dict[Any, Any] = {}
    eqns = []
    for e in jaxpr.eqns:
        ins = [subst.get(v, v) if not isinstance(v, core.Literal) else v for v in e.invars]
        eqns.append(e.replace(invars=ins))
        for v in e.outvars:
            if v in pinned:
                nv = core.Var(v.aval)
                eqns.append(core.new_jaxpr_eqn([v], [nv], optimization_barrier_p, {}, core.no_effects,
                                               e.source_info))
                subst[v] = nv
    outs = [subst.get(v, v) if not isinstance(v, core.Literal) else v for v in jaxpr.outvars]
    new = core.new_jaxpr(jaxpr.constvars, jaxpr.invars, outs, eqns, jaxpr.effects, jaxpr.debug_info)
    return core.ClosedJaxpr(new, closed.consts)


@contextlib.contextmanager
def _collector_paused():
    """Collect garbage here, then not while timing: a collection on the timing thread would drop
    e-graphs of earlier rewrites there, which egglog forbids (they belong to this thread), and would
    add its pauses to the times."""
    if not gc.isenabled():
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _outside_traces(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` on a fresh thread: a rewrite often happens while an outer ``jit`` or ``grad`` is tracing,
    and JAX's trace state is per thread, so arrays made there are concrete and programs really run.
    The collector is paused meanwhile (:func:`_collector_paused`)."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    with _collector_paused():
        t = threading.Thread(target=work, name="rewrite-measure")
        t.start()
        t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def choose(model: Measured, programs: Sequence[core.ClosedJaxpr]) -> tuple[core.ClosedJaxpr, Timing]:
    """Time ``programs`` (cheapest predicted first), plus a pinned variant of the first; return the fastest."""
    programs = list(programs[: model.top_k])
    labels = [f"candidate {i}" for i in range(len(programs))]
    if model.steer and programs:
        pinned = pin_duplicates(programs[0], model)
        if pinned is not None:
            programs.append(pinned)
            labels.append("candidate 0, transcendentals pinned")
    timing = fastest(model, programs, labels)
    return programs[timing.chosen], timing


def fastest(model: Measured, programs: Sequence[core.ClosedJaxpr], labels: Sequence[str]) -> Timing:
    """``programs`` (of one signature) timed side by side (:func:`time_programs`, outside any trace) and the fastest
    chosen; a choice made before for the same programs is read from the cache (``Timing.cached``, no seconds).
    Nothing is timed, and the first chosen, where there are fewer than two or the first cannot run
    (:func:`measurable`)."""
    labels = list(labels)
    if len(programs) < 2 or not measurable(programs[0]):
        return Timing([None] * len(programs), 0, labels)
    key = _key(programs)
    with _LOCK:
        found = _CACHE.get(key)
    if found is not None:
        return Timing([None] * len(programs), found, labels, cached=True)
    seconds = _outside_traces(time_programs, programs, model)
    ok = [(s, i) for i, s in enumerate(seconds) if s is not None]
    chosen = min(ok)[1] if ok else 0
    with _LOCK:
        _CACHE[key] = chosen
    return Timing(seconds, chosen, labels)


def resolve(model: Any) -> CostModel:
    """``None`` or ``"analytic"`` gives the default model, ``"measure"`` times candidates on the backend
    (:class:`Measured`); a :class:`rewrite.CostModel` is used as is, and a plain function as a node price
    alone (:func:`rewrite.cost.model.as_cost_model`)."""
    if model is None or (isinstance(model, str) and model == "analytic"):
        return default_model()
    if isinstance(model, str) and model == "measure":
        return Measured()
    resolved = as_cost_model(model)
    # a custom model's budget is read by attribute (rewrite/cost/memory.py): check it at rewrite(...) time
    check_memory_budget(getattr(resolved, "memory_budget", None))
    return resolved
