"""A program's peak temporary memory, predicted from its kernels: liveness over the buffers they write.

XLA:CPU allocates every temporary of a program (an array one kernel writes and
another reads; not the program's inputs or outputs) in one arena, and its heap
simulator lets two buffers share bytes when their lives do not overlap. A
buffer lives from the kernel that writes it to the last kernel that reads it,
in the order the kernels run. The peak is the largest sum of live buffers at
any kernel, plus what that kernel holds inside itself: a loop's body has
temporaries of its own (its peak, computed the same way, recursively), and
its carry is a buffer of the loop. A bitcast (a reshape that keeps row-major
order) has no buffer: a kernel that reads it keeps its operand's alive. This module computes that peak over the
kernels the fusion model predicts (``rewrite/cost/fusion.py``), in program order.

``tests/test_memory.py`` holds it to what ``memory_analysis()`` reports on the
attention benchmark's programs (within 25%). One kind of program is known to
be missed: XLA:CPU compiles a product, a softmax and a product into one
library (YNN) fusion, whose scratch ``memory_analysis()`` does not see (it
reports 0 bytes for plain attention's forward, which holds the N x N scores
inside the library); the model predicts the scores as stored.

The cost model charges ``AnalyticCost.fresh`` per byte of this peak where it is large enough for the C
library to map it fresh at each call (``AnalyticCost.fresh_at``), ``AnalyticCost.memory`` per byte of the
kernels' peak (``cost/fusion.py``'s ``peak_temp_bytes``), and with
``AnalyticCost.memory_budget`` prices any program over the budget above every
program within it, so that the fastest program that fits is chosen.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from jax.extend.core import ClosedJaxpr

from ..ir.jaxapi import scan_counts
from ..ir.primitives import inner_jaxpr
from .fusion import OVER_BUDGET, Fusion, FusionModel, _temp, buffer_of, output_buffers
from .program import Program


def liveness_peak(prog: Any, kernels: Sequence[Fusion], inner: Callable[[Any], int] | None = None) -> int:
    """The peak of live temporaries over ``kernels`` run in program order (their roots' order).

    A buffer is one value a kernel writes (each output of a loop is one). It lives from the kernel that
    writes it to the last kernel that reads it, and it shares its bytes with another where XLA's buffer
    assignment does (:func:`_shares`): an elementwise kernel writes in place over an operand of its shape
    that dies there, and a loop's carry is its initial value's buffer. A group of shared buffers that
    holds a program output is the output's allocation, not a temporary. ``inner(op)`` is what a kernel's
    own op holds while it runs (a loop body's peak): added at that kernel.
    """
    order = sorted(kernels, key=lambda k: _position(prog, k.root))
    return _peak_in(prog, order, _held_inside(prog, order, inner), *_buffers(prog, kernels))


def scheduled_peak(prog: Any, kernels: Sequence[Fusion], inner: Callable[[Any], int] | None = None,
                   below: float = 0.0) -> int:
    """:func:`liveness_peak` in the order of the two that needs less: program order or a greedy list schedule
    (:func:`_ready_order`). What the fresh charge reads (``AnalyticCost.fresh``).

    XLA schedules a program's kernels for memory and keeps the least peak of several schedulers (a list
    scheduler among them), where an extractor's program lists its kernels in the order its outputs reach
    them: the LM head's loss reads the logits in its normaliser's ``exp`` and in the label's gather; XLA runs
    the gather first, so that ``exp`` writes over the logits, where the extractor's order holds both (512
    against the 256 MiB ``memory_analysis`` reports at N=2048, V=32768). On the attention gradients of
    ``tests/test_memory.py`` the list schedule is both nearer XLA and further from it, so the memory
    predictions (:func:`liveness_peak`) keep program order.

    ``below``: where every temporary held at once (each buffer once) with the most any kernel holds inside
    stays under it, so must the peak, and 0 is returned without scheduling (what the fresh charge reads below
    its threshold: ``FusionModel.held_bytes``).
    """
    order = sorted(kernels, key=lambda k: _position(prog, k.root))
    buffers = _buffers(prog, kernels)
    held = _held_inside(prog, order, inner)
    if below and _all_at_once(prog, order, held, *buffers) < below:
        return 0
    peak = _peak_in(prog, order, held, *buffers)
    if len(order) > 2 and peak:
        peak = min(peak, _peak_in(prog, _ready_order(prog, order, *buffers), held, *buffers))
    return peak


def _all_at_once(prog: Any, kernels: Sequence[Fusion], held: dict, projs: dict, outputs: set, written: set) -> int:
    """A bound on :func:`_peak_in` in any order: every buffer a kernel writes, each once (a group that shares
    one holds the largest of its members, no more than their sum), with the most any kernel holds inside."""
    return (sum(_temp(prog, b, outputs, written) for k in kernels for b in projs.get(k.root, {0: k.root}).values())
            + max(held.values(), default=0))


def _held_inside(prog: Any, kernels: Sequence[Fusion], inner: Callable[[Any], int] | None) -> dict:
    """What each kernel's op holds inside itself while it runs (``inner``), by the kernel's root."""
    return {k.root: inner(prog.ops[k.root]) for k in kernels} if inner is not None else {}


def _buffers(prog: Any, kernels: Sequence[Fusion]) -> tuple[dict, set, set]:
    """What the peaks read of a program: each loop's buffers (the output index of each of its outputs the
    program reads), the program's outputs, and the kernels' roots (what is written)."""
    projs: dict[Any, dict] = {}
    ops = prog.ops
    for i, op in (ops.items() if isinstance(ops, Mapping) else enumerate(ops)):  # a live program's: by class
        if op.prim == "proj":
            outs = projs.setdefault(op.args[0], {})
            outs[op.params.get("index", len(outs))] = i
    return projs, output_buffers(prog), {k.root for k in kernels}


def _peak_in(prog: Any, order: Sequence[Fusion], held: dict, projs: dict, outputs: set, written: set) -> int:
    """The peak of live temporaries with the kernels run in ``order`` (see :func:`liveness_peak`); ``held``: what
    each kernel holds inside itself, by its root."""
    step: dict[Any, int] = {}  # buffer -> the step that writes it
    last: dict[Any, int] = {}  # buffer -> the last step that reads it
    for t, k in enumerate(order):
        for b in projs.get(k.root, {0: k.root}).values():
            step[b] = t
        for a in k.reads:
            last[buffer_of(prog, a, written)] = t  # a bitcast read keeps its operand's buffer alive
    parent: dict[Any, Any] = {}

    def find(b: Any) -> Any:
        while b in parent:
            b = parent[b]
        return b

    for t, k in enumerate(order):
        for b, donor in _shares(prog, k, projs.get(k.root), last, step, t, written):
            if find(donor) != find(b):
                parent[find(b)] = find(donor)
    groups: dict[Any, list] = {}
    for b in step:
        groups.setdefault(find(b), []).append(b)
    live_at = [0] * len(order)
    for members in groups.values():
        if any(b in outputs for b in members):
            continue  # the program output's allocation
        size = max(_temp(prog, b, outputs, written) for b in members)
        if not size:
            continue
        first = min(step[b] for b in members)
        end = max(max(last.get(b, step[b]), step[b]) for b in members)
        for t in range(first, end + 1):
            live_at[t] += size
    peak = 0
    for t, k in enumerate(order):
        peak = max(peak, live_at[t] + held.get(k.root, 0))
    return peak


def _ready_order(prog: Any, order: Sequence[Fusion], projs: dict, outputs: set, written: set) -> list[Fusion]:
    """The kernels in the order a greedy list scheduler runs them, as XLA's does: of the kernels whose inputs
    are written, the one that frees the most bytes of temporaries (those it is the last to read) less the
    bytes it writes; ties in program order. A kernel that reads a view reads what the view is of."""
    writer: dict[Any, int] = {}
    for n, k in enumerate(order):
        for b in projs.get(k.root, {0: k.root}).values():
            writer[b] = n
    ops = prog.ops
    found: dict[Any, frozenset] = {}

    def sources(a: Any) -> frozenset:  # the buffers ``a`` is (or is a view of)
        got = found.get(a)
        if got is None:
            if a in writer:
                got = frozenset((a,))
            else:
                got = found[a] = frozenset()  # a leaf, or a cycle guard while its operands are read
                got = frozenset().union(*(sources(x) for x in getattr(ops[a], "args", ())))
            found[a] = got
        return got

    reads = [frozenset().union(*(sources(a) for a in k.reads)) for k in order]
    readers: dict[Any, int] = {}
    for rs in reads:
        for b in rs:
            readers[b] = readers.get(b, 0) + 1
    waiting = [len({writer[b] for b in rs} - {n}) for n, rs in enumerate(reads)]
    users: dict[int, list[int]] = {}
    for n, rs in enumerate(reads):
        for w in {writer[b] for b in rs} - {n}:
            users.setdefault(w, []).append(n)
    size = {b: _temp(prog, b, outputs, written) for b in writer}
    writes = [sum(size[b] for b in projs.get(k.root, {0: k.root}).values()) for k in order]
    ready = {n for n, w in enumerate(waiting) if not w}
    out: list[Fusion] = []
    while ready:
        n = max(ready, key=lambda n: (sum(size[b] for b in reads[n] if readers[b] == 1) - writes[n], -n))
        ready.discard(n)
        out.append(order[n])
        for b in reads[n]:
            readers[b] -= 1
        for u in users.get(n, ()):
            waiting[u] -= 1
            if not waiting[u]:
                ready.add(u)
    return out if len(out) == len(order) else list(order)


#: What an elementwise kernel may compute and still write in place over an operand of its shape.
_IN_PLACE = frozenset({"elementwise", "transcendental"})


def _shares(prog: Any, k: Fusion, outs: Mapping[int, Any] | None, last: dict, step: dict, t: int,
            written: set) -> list[tuple]:
    """The buffers kernel ``k`` (at step ``t``) writes into an operand's bytes: (its buffer, the operand).

    XLA:CPU lets a loop fusion's output reuse an operand's buffer when the operand has the output's
    shape, dies at the fusion and is read elementwise; a ``scan``/``while`` keeps its carry in one
    buffer, which is its initial value's where that value dies at the loop.
    """
    op = prog.ops[k.root]
    found = []
    if outs is not None:  # a loop: carry i is the buffer of init i when init i dies here
        if op.prim == "scan":
            first, n = scan_counts(op.params)
        elif op.prim == "while":
            first, n = op.params.get("body_nconsts", 0) + op.params.get("cond_nconsts", 0), len(op.out_avals)
        else:
            return found
        for i in range(n):  # (``outs``: the loop's outputs the program reads, by index)
            a = buffer_of(prog, op.args[first + i], written)
            if i in outs and a in step and last.get(a) == t and _same(prog, a, outs[i]):
                found.append((outs[i], a))
        return found
    if k.kind != "loop" or len(op.out_avals) != 1:
        return found
    if any(prog.ops[i].family not in _IN_PLACE and prog.ops[i].prim != "broadcast_in_dim" for i in k.computes):
        return found
    # the first operand in program order: a live program's kernels list their reads in another order
    for a in sorted(dict.fromkeys(buffer_of(prog, a, written) for a in k.reads), key=lambda a: _position(prog, a)):
        if a in step and last.get(a) == t and _same(prog, a, k.root):
            found.append((k.root, a))
            break
    return found


def _same(prog: Any, a: Any, b: Any) -> bool:
    x, y = prog.ops[a].out_avals, prog.ops[b].out_avals
    return len(x) == len(y) == 1 and getattr(x[0], "shape", None) == getattr(y[0], "shape", None) and \
        getattr(x[0], "dtype", None) == getattr(y[0], "dtype", None)


def _position(prog: Any, key: Any) -> Any:
    return getattr(prog, "position", lambda k: k)(key)


class InnerPeak:
    """What one op holds while it runs: the peak of its body's own temporaries (recursively).

    Remembered per body (a search prices the same loop in many programs).
    """

    def __init__(self, fusion: FusionModel, node_cost: Callable[[Any], float] | None = None) -> None:
        self.fusion = fusion
        self.node_cost = node_cost
        self._found: dict[int, tuple[Any, int]] = {}  # id(body) -> (the body, kept alive so its id is not reused; peak)

    def __call__(self, op: Any) -> int:
        memo = getattr(op, "memo", None)
        bodies = memo.get("bodies") if memo else None
        if bodies:  # an extractor's op: its chosen bodies (``rewrite.cost.program._chosen_bodies``)
            key = ("inner peak", id(self))  # kept with the bodies, which the memo holds for this op alone
            found = memo.get(key)
            if found is None:
                found = memo[key] = max(liveness_peak(b, self.fusion.kernels(b), self) for b in bodies)
            return found
        params = getattr(op, "params", None) or {}
        j = inner_jaxpr(params)
        if j is None:
            return 0
        found = self._found.get(id(j))
        if found is None or found[0] is not j:
            found = self._found[id(j)] = (j, self.body(j))
        return found[1]

    def body(self, jaxpr: Any) -> int:
        """The peak of a body's own temporaries. A loop's carry is not among them: it is the loop's
        output buffer (or its initial value's), which the program around the loop counts."""
        closed = jaxpr if hasattr(jaxpr, "consts") else ClosedJaxpr(jaxpr, ())
        prog = Program.from_jaxpr(closed, self.node_cost)
        return liveness_peak(prog, self.fusion.kernels(prog), self)


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
