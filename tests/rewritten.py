"""What a test reads of a rewrite, off the rewrite that it runs.

Many tests ask :func:`rewrite.explain` which rules fired and what program came out, then build
``rewrite(f)`` at the same arguments to compare values: two rewrites of one program. ``ran(g, *args)``
reads the fired rules and the program off ``g``'s own cached result for those arguments (the one that
``g(*args)`` then runs without rewriting again), so the program is rewritten once, and what the test
asserts of it is the program whose values it compares. Rules' provenance (``Report.used``, which needs the
e-graph) is recorded by the pipeline before it releases its e-graph (``Result.used``), so ``ran`` reads it too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rewrite.api import Rewritten


@dataclasses.dataclass(frozen=True)
class Ran:
    """The part of :class:`rewrite.Report` a test reads: ``fired`` (rule -> times it fired, those that did),
    ``used`` (rule -> how many of the chosen program's nodes it built, or None), ``before`` and ``after`` (the program
    traced, and the one that runs), ``stopped`` (why saturation stopped), with the whole ``result``."""

    fired: dict[str, int]
    used: dict[str, int] | None
    after: Any
    before: Any
    stopped: str
    result: Any


def ran(g: Rewritten, *args: Any, **kwargs: Any) -> Ran:
    """``explain(f, *args, ...).fired``, ``.used``, ``.before``, ``.after`` and ``.stopped``, read off
    ``g = rewrite(f, ...)`` (rewritten once, here or by an earlier call at the same signature, and kept for
    ``g(*args)``). ``used`` is None where the result does not know it (``Result.used``: a disk cache entry...)."""
    assert isinstance(g, Rewritten), g
    result = g.result(*args, **kwargs)
    return Ran(fired={k: s.fired for k, s in result.stats.items() if s.fired}, used=result.used, after=result.after,
               before=result.before, stopped=result.stopped, result=result)


def compiles_during(fn, *args):
    """``fn(*args)`` and the number of XLA compiles it asked for (a rewrite's own compiles are a first call's
    cost: a check compiled, a constant converted)."""
    import jax
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    n = []

    def listen(event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            n.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        out = fn(*args)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return out, len(n)
