"""A program's peak temporary memory, predicted from its kernels: liveness over the buffers they write.

XLA:CPU allocates every temporary of a program (an array one kernel writes and
another reads; not the program's inputs or outputs) in one arena, and its heap
simulator lets two buffers share bytes when their lives do not overlap. A
buffer lives from the kernel that writes it to the last kernel that reads it,
in the order the kernels run. The peak is the largest sum of live buffers at
any kernel, plus what that kernel holds inside itself: a loop's body has
temporaries of its own (its peak, computed the same way, recursively), and
its carry is a buffer of the loop. This module computes that peak over the
kernels the fusion model predicts (``rewrite/cost/fusion.py``), in program order.

``tests/test_memory.py`` holds it to what ``memory_analysis()`` reports on the
attention benchmark's programs (within 25%). One kind of program is known to
be missed: XLA:CPU compiles a product, a softmax and a product into one
library (YNN) fusion, whose scratch ``memory_analysis()`` does not see (it
reports 0 bytes for plain attention's forward, which holds the N x N scores
inside the library); the model predicts the scores as stored.

The cost model charges ``AnalyticCost.memory`` per byte of this peak, and with
``AnalyticCost.memory_budget`` prices any program over the budget above every
program within it, so that the fastest program that fits is chosen.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jax.extend.core import ClosedJaxpr

from ..ir.primitives import inner_jaxpr
from .fusion import OVER_BUDGET, Fusion, FusionModel, _out_bytes, _temp
from .program import Program


def liveness_peak(prog: Any, kernels: Sequence[Fusion], inner: Callable[[Any], int] | None = None) -> int:
    """The peak of live temporaries over ``kernels`` run in program order (their roots' order).

    ``inner(op)`` is what a kernel's own op holds while it runs (a loop body's peak): added at that kernel.
    """
    outputs = set(prog.outputs)
    written = {k.root for k in kernels}
    order = sorted(kernels, key=lambda k: _position(prog, k.root))
    last: dict[Any, int] = {}
    for t, k in enumerate(order):
        for a in k.reads:
            last[_writer(prog, a)] = t
    live: dict[Any, int] = {}
    peak = 0
    for t, k in enumerate(order):
        size = _temp(prog, k.root, outputs, written)
        if size:
            live[k.root] = size
            last.setdefault(k.root, t)
        held = sum(live.values()) + (inner(prog.ops[k.root]) if inner is not None else 0)
        peak = max(peak, held)
        for x in [x for x, end in last.items() if end == t and x in live]:
            del live[x]
    return peak


def _writer(prog: Any, i: Any) -> Any:
    op = prog.ops[i]
    return op.args[0] if op.prim == "proj" else i


def _position(prog: Any, key: Any) -> Any:
    return getattr(prog, "position", lambda k: k)(key)


class InnerPeak:
    """What one op holds while it runs: the peak of its body (recursively) and, for a loop, its carry.

    Remembered per body (a search prices the same loop in many programs).
    """

    def __init__(self, fusion: FusionModel, node_cost: Callable[[Any], float] | None = None) -> None:
        self.fusion = fusion
        self.node_cost = node_cost
        self._found: dict[int, int] = {}

    def __call__(self, op: Any) -> int:
        params = getattr(op, "params", None) or {}
        j = inner_jaxpr(params)
        if j is None:
            return 0
        key = id(j)
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = self.body(j, params)
        return found

    def body(self, jaxpr: Any, params: Any) -> int:
        closed = jaxpr if hasattr(jaxpr, "consts") else ClosedJaxpr(jaxpr, ())
        prog = Program.from_jaxpr(closed, self.node_cost)
        peak = liveness_peak(prog, self.fusion.kernels(prog), self)
        carry = 0
        if "num_carry" in params:  # a scan: its carry is a buffer of the loop, beside the body's temporaries
            avals = [v.aval for v in closed.jaxpr.outvars[: params["num_carry"]]]
            carry = sum(_out_bytes(_AvalOp(a)) for a in avals)
        return peak + carry


class _AvalOp:
    __slots__ = ("out_avals", "memo")

    def __init__(self, aval: Any) -> None:
        self.out_avals = (aval,)
        self.memo = None


def over_budget(candidates: Sequence[Any], model: Any, emit: Callable[[Any], Any]) -> list[dict]:
    """The extraction's candidates (:class:`rewrite.extract.extract.Candidate`) that ``model``'s memory
    budget excluded: for each, whether it is a rewritten program, its predicted peak and the budget.

    Empty without a budget. A candidate is excluded when it is priced over the budget's penalty
    (:data:`rewrite.cost.fusion.OVER_BUDGET`); its peak is predicted again on the emitted program.
    """
    budget = getattr(model, "memory_budget", None)
    if budget is None:
        return []
    out = []
    for cand in candidates:
        if cand.cost < OVER_BUDGET:
            continue
        peak = model.predict_temp_bytes(emit(cand.choice))
        out.append({"rewritten": bool(cand.rewritten), "predicted_temp_bytes": peak, "budget": budget})
    return out
