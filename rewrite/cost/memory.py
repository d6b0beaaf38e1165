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
kernels the fusion model predicts (``rewrite/cost/fusion.py``), in the order XLA:CPU runs them (breadth first,
:func:`xla_order`), after the rewrites of XLA's simplifier that change what is stored (:func:`as_xla_simplifies`);
a loop body's own peak is read in program order.

``tests/test_memory.py`` holds it to what ``memory_analysis()`` reports on the
attention benchmark's programs (within 25%). One kind of program is predicted apart from it on purpose:
XLA:CPU compiles a product, a softmax and a product into one library (YNN) kernel
(``cost/attention.py``'s ``attention_chain``), which stores no scores but holds them in its scratch,
which ``memory_analysis()`` does not see (it reports 0 bytes for plain attention's forward; the
process's resident memory grows by the scores, ``benchmarks/results/attention_rss.md``): the peak
holds that scratch at that kernel, as memory the program holds.

The cost model charges ``AnalyticCost.fresh`` per byte of this peak where it is large enough for the C
library to map it fresh at each call (``AnalyticCost.fresh_at``), ``AnalyticCost.memory`` per byte of the
kernels' peak (``cost/fusion.py``'s ``peak_temp_bytes``), and with
``AnalyticCost.memory_budget`` prices any program over the budget above every
program within it, so that the fastest program that fits is chosen.
"""

from __future__ import annotations

import collections
import math
import weakref
from typing import Any, Callable, Mapping, Sequence

from jax.extend.core import ClosedJaxpr, Var
from jax.interpreters import partial_eval as pe

from ..ir.jaxapi import body_closed, scan_counts
from ..ir.primitives import inner_jaxpr
from .attention import scratch_bytes
from .fusion import OVER_BUDGET, Fusion, FusionModel, _out_bytes, _scaled_by_small, _temp, buffer_of, output_buffers
from .program import LIBRARY, OTHER, Program, bitcast, kernel_members
from .simplify import REDUCE_BEFORE_BROADCAST
from .transcendental import as_exponentials


def kernel_layout(fusion: FusionModel, prog: Any) -> list[Fusion]:
    """``fusion.kernels(prog)`` without their prices (each ``cost`` NaN): the same roots, kinds, members and reads,
    in the same order, which are all a peak reads (:func:`liveness_peak`, :func:`scheduled_peak`,
    ``fusion.py``'s ``kernel_temps``). A kernel's price is most of what ``kernels`` spends (its members' facts, its
    bytes, the reductions it folds), and the peaks' replays (``AnalyticCost.predict_peaks``, :class:`InnerPeak`)
    never read it. A kernel reads what its members read outside it, literals aside (``FusionModel.kernel``,
    ``attention.attention_price``); one of an op the model does not fuse (``OTHER``), all its op's operands."""
    homes, roots = fusion.fuse(prog)
    members = kernel_members(homes, roots)
    ops, out = prog.ops, []
    for r, kind in roots.items():
        comp = members[r]
        if kind == OTHER:
            reads = set(ops[r].args)
        else:
            inside = set(comp)
            reads = {a for i in inside for a in ops[i].args if a not in inside and ops[a].prim != "literal"}
        out.append(Fusion(r, kind, sorted(comp), sorted(reads), math.nan))
    return out


def liveness_peak(prog: Any, kernels: Sequence[Fusion], inner: Callable[[Any], int] | None = None) -> int:
    """The peak of live temporaries over ``kernels`` run in program order (their roots' order): a loop body's
    (:class:`InnerPeak`); a program's is read in XLA's order (:func:`scheduled_peak`).

    A buffer is one value a kernel writes (each output of a loop is one). It lives from the kernel that
    writes it to the last kernel that reads it, and it shares its bytes with another where XLA's buffer
    assignment does (:func:`_shares`): an elementwise kernel writes in place over an operand of its shape
    that dies there, and a loop's carry is its initial value's buffer. A group of shared buffers that
    holds a program output is the output's allocation, not a temporary. ``inner(op)`` is what a kernel's
    own op holds while it runs (a loop body's peak): added at that kernel.
    """
    at = _position_of(prog)
    order = sorted(kernels, key=lambda k: at(k.root))
    return _peak_in(prog, order, _held_inside(prog, order, inner), *_buffers(prog, kernels))


def scheduled_peak(prog: Any, kernels: Sequence[Fusion], inner: Callable[[Any], int] | None = None,
                   below: float = 0.0, scratch: bool = True, users: bool = False) -> int:
    """The peak of live temporaries with the kernels run in the order XLA:CPU runs them (:func:`xla_order`), and a
    temporary that dies before an output is written held in that output's allocation, as XLA's buffer assignment
    places it: what ``memory_analysis`` reports, and what the predictions (``AnalyticCost.predict_temp_bytes``)
    and the fresh charge (``AnalyticCost.fresh``) read.

    XLA:CPU schedules a program breadth first, not in the order its program lists its kernels: JAX's VJP of
    ``sin(a x)**2 / a`` with ``sin`` stored as a ``select`` (``rulesets._sincos``) lists the ``cos`` kernel, which
    writes a full array, before the reduction that last reads the stored ``select``; XLA runs the reduction first, so
    the ``cos`` kernel writes over the ``select`` (524,544 bytes, where program order holds both: 1,048,576). And
    XLA gives a temporary that dies before an output is written the output's bytes: JAX's training step of the same
    function holds ``sin**2`` for the reduction in the allocation of the gradient written after it.

    ``below``: where every temporary held at once (each buffer once) with the most any kernel holds inside
    stays under it, so must the peak, and 0 is returned without scheduling (what the fresh charge reads below
    its threshold: ``FusionModel.held_bytes``).

    ``users``: the kernels a kernel makes ready are queued in the order of XLA's list of its users
    (:func:`_users_rank`), not in the order the fusion pass made them (see :func:`xla_order`).

    ``scratch``: whether a library kernel's scratch (``cost/attention.py``'s ``scratch_bytes``: attention's scores in
    its one kernel) is held at that kernel. It is memory the program holds, which ``memory_analysis`` does not
    count; the fresh charge leaves it out, since it is not in the temporaries' allocation (the kernel pays for its
    own pages: ``cost/attention.py``'s ``attention_price``).
    """
    buffers = _buffers(prog, kernels)
    held = _held_inside(prog, kernels, inner, scratch)  # (by root, and the bound's sums: in any order)
    if below and _all_at_once(prog, kernels, held, *buffers) < below:
        return 0  # (before the kernels are put in order: a live program's postorder is not walked for it)
    at = _position_of(prog)
    order = sorted(kernels, key=lambda k: at(k.root))
    return _peak_in(prog, xla_order(prog, order, *buffers, users=users), held, *buffers, in_outputs=True)


def fresh_peak(prog: Any, kernels: Sequence[Fusion], inner: Callable[[Any], int] | None = None,
               below: float = 0.0) -> int:
    """:func:`scheduled_peak` without a library kernel's scratch: the temporaries' allocation the fresh charge reads
    (``AnalyticCost``'s ``held``; 0 where it is under ``below``). Where no kernel is an attention kernel (none has
    scratch) and it is not 0, it is ``scheduled_peak(prog, kernels, inner)``, which a live program's price
    hands on (``cost.live.LiveFusion.scheduled``)."""
    return scheduled_peak(prog, kernels, inner, below, scratch=False)


def _all_at_once(prog: Any, kernels: Sequence[Fusion], held: dict, projs: dict, outputs: set, written: set) -> int:
    """A bound on :func:`_peak_in` in any order: every buffer a kernel writes, each once (a group that shares
    one holds the largest of its members, no more than their sum), with the most any kernel holds inside."""
    return (sum(_temp(prog, b, outputs, written) for k in kernels for b in projs.get(k.root, {0: k.root}).values())
            + max(held.values(), default=0))


def _held_inside(prog: Any, kernels: Sequence[Fusion], inner: Callable[[Any], int] | None,
                 scratch: bool = True) -> dict:
    """What each kernel's op holds inside itself while it runs (``inner``), by the kernel's root, and (``scratch``)
    a library kernel's scratch."""
    held = {k.root: inner(prog.ops[k.root]) for k in kernels} if inner is not None else {}
    if scratch:
        for k in kernels:
            extra = scratch_bytes(prog, k)
            if extra:
                held[k.root] = held.get(k.root, 0) + extra
    return held


def _buffers(prog: Any, kernels: Sequence[Fusion]) -> tuple[dict, set, set]:
    """What the peaks read of a program: each loop's buffers (the output index of each of its outputs the
    program reads), the program's outputs, and the kernels' roots (what is written)."""
    projs: dict[Any, dict] = {}
    ops = prog.ops
    for i, op in _items(ops):
        if op.prim == "proj":
            outs = projs.setdefault(op.args[0], {})
            outs[op.params.get("index", len(outs))] = i
    return projs, output_buffers(prog), {k.root for k in kernels}


def _items(ops: Any) -> Any:
    return ops.items() if isinstance(ops, Mapping) else enumerate(ops)  # a live program's: by class


def _peak_in(prog: Any, order: Sequence[Fusion], held: dict, projs: dict, outputs: set, written: set,
             in_outputs: bool = False) -> int:
    """The peak of live temporaries with the kernels run in ``order`` (see :func:`liveness_peak`); ``held``: what
    each kernel holds inside itself, by its root. ``in_outputs``: a temporary of an output allocation's size that
    lives only while the allocation is free (before the output's group is first written) is placed there, the
    largest first, as XLA's buffer assignment reuses an output's bytes (:func:`scheduled_peak`)."""
    step: dict[Any, int] = {}  # buffer -> the step that writes it
    last: dict[Any, int] = {}  # buffer -> the last step that reads it
    for t, k in enumerate(order):
        outs = projs.get(k.root)
        if outs is None:
            step[k.root] = t
        else:
            for b in outs.values():
                step[b] = t
        for a in k.reads:
            last[a if a in written else buffer_of(prog, a, written)] = t  # a bitcast read keeps its operand's buffer
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
        groups.setdefault(find(b) if parent else b, []).append(b)
    temps: list[tuple[int, int, int]] = []
    free: list[tuple[int, list[tuple[int, int]]]] = []  # an output allocation: its size, the steps it is taken
    ops = prog.ops
    for members in groups.values():
        if len(members) == 1:  # (most buffers share with none: the same sums, read once)
            b = members[0]
            first = step[b]
            if b in outputs:  # the program output's allocation
                if in_outputs:
                    free.append((_out_bytes(ops[b]), [(first, len(order))]))
                continue
            size = _temp(prog, b, outputs, written)
            if size:
                end = last.get(b, first)
                temps.append((size, first, end if end > first else first))
            continue
        first = min(step[b] for b in members)
        if any(b in outputs for b in members):  # the program output's allocation
            if in_outputs:
                free.append((max(_out_bytes(ops[b]) for b in members if b in outputs), [(first, len(order))]))
            continue
        size = max(_temp(prog, b, outputs, written) for b in members)
        if size:
            temps.append((size, first, max(max(last.get(b, step[b]), step[b]) for b in members)))
    # what is live at each step, as the steps where each buffer starts and stops being held (the same sums)
    delta = [0] * (len(order) + 1)
    rooms: dict[int, list] = {}  # the output allocations by size, in their order
    for bytes_, taken in free:
        rooms.setdefault(bytes_, []).append(taken)
    if rooms:
        temps.sort(key=lambda t: (-t[0], t[1]))
    for size, first, end in temps:
        same = rooms.get(size)
        if same is not None:
            room = next((taken for taken in same if all(end < a or first > b for a, b in taken)), None)
            if room is not None:
                room.append((first, end))
                continue
        delta[first] += size
        delta[end + 1] -= size
    peak = live = 0
    for t, k in enumerate(order):
        live += delta[t]
        here = live + held.get(k.root, 0)
        if here > peak:
            peak = here
    return peak


def xla_order(prog: Any, order: Sequence[Fusion], projs: dict, outputs: set, written: set,
              users: bool = False) -> list[Fusion]:
    """The kernels (``order``: in program order) in the order XLA:CPU runs them: breadth first from the program's
    inputs, as its scheduler does, each kernel queued once everything it reads is computed; the inputs first, then
    what each one computed makes ready, in the order XLA's fusion pass made those kernels (:func:`_made_at`; the
    library reductions, made by a later pass, after the loops). A division by an array smaller than its result is
    a multiplication by a reciprocal that XLA computes in a small kernel of its own, which the kernel then waits for
    too. Checked kernel for kernel against the schedules XLA:CPU compiled (``--xla_dump_to``'s live ranges) for JAX's
    VJP of seed 000, its gradients alone, both with ``sin`` stored, and a VJP whose two reductions are merged; on
    the decision corpus's 154 programs (``benchmarks/decisions.py``) the peak so read is within 25% of
    ``memory_analysis`` on 91 (program order: 88) and says which of a pair holds more on 52 of 71 (48).

    XLA:CPU schedules with its ``BFScheduler`` (``--xla_cpu_enable_concurrency_optimized_scheduler``, on by
    default), not the least-memory of the list, DFS and post-order schedules its other backends try: a FIFO
    queue seeded with what reads nothing, and a popped instruction's ``users()`` pushed, in that list's order, once
    they wait for nothing else. With ``users`` the queue follows that list as :func:`_users_rank` replays it;
    without, the order the fusion pass made the kernels (which agrees with it where each kernel has one reader)."""
    made = _made_at(prog)
    at = _position_of(prog)
    rank = _users_rank(prog, order, made, at) if users else None  # before ``users`` names the readers below
    writer: dict[Any, tuple] = {}  # buffer -> the node of the kernel that writes it
    kernel_nodes = [("kernel", n) for n in range(len(order))]
    for n, k in enumerate(order):
        outs = projs.get(k.root)
        if outs is None:
            writer[k.root] = kernel_nodes[n]
        else:
            for b in outs.values():
                writer[b] = kernel_nodes[n]
    ops = prog.ops
    found: dict[Any, frozenset] = {}

    def sources(a: Any) -> frozenset:  # the kernels and inputs ``a`` is (or is computed from, outside kernels)
        got = found.get(a)
        if got is None:
            if a in writer:
                got = frozenset((writer[a],))
            elif ops[a].prim == "param":
                got = frozenset((("input", a),))
            else:
                found[a] = frozenset()  # a cycle guard while its operands are read
                got = frozenset().union(*(sources(x) for x in getattr(ops[a], "args", ())))
            found[a] = got
        return got

    # each node: (when XLA made it, what it waits for); a library kernel is made after every loop kernel
    nodes: dict[tuple, tuple[tuple, frozenset]] = {
        ("input", a): ((-1, at(a)), frozenset()) for a, op in _items(ops) if op.prim == "param"}
    inf = math.inf
    for n, k in enumerate(order):
        waits: set = set().union(*[found[a] if a in found else sources(a) for a in k.reads])
        for i in k.computes:
            op = ops[i]
            if op.prim == "div" and _scaled_by_small(prog, op):
                node = ("reciprocal", op.args[1])
                then = (0, made.get(i, inf) + 0.5)
                nodes[node] = (min(nodes[node][0], then) if node in nodes else then, sources(op.args[1]))
                waits.add(node)
        me = kernel_nodes[n]
        waits.discard(me)
        nodes[me] = ((int(k.kind == LIBRARY), made.get(k.root, inf)), waits)
    del sources  # a recursive closure is a reference cycle: it would hold the program until a collection
    users: dict[tuple, list] = {node: [] for node in nodes}
    waiting: dict[tuple, int] = {}
    when: dict[tuple, tuple] = {}  # each node's sort key: when XLA made it
    for node, (made_when, waits) in nodes.items():
        when[node] = made_when
        waiting[node] = len(waits)
        for w in waits:
            users[w].append(node)
    key = when.__getitem__
    queue = collections.deque(sorted((node for node in nodes if not waiting[node]), key=key))
    out: list[Fusion] = []
    while queue:
        node = queue.popleft()
        if node[0] == "kernel":
            out.append(order[node[1]])
        ready = users[node]
        if len(ready) > 1:
            ready = sorted(ready, key=key) if rank is None else sorted(ready, key=lambda u: (rank(node, u), key(u)))
        for u in ready:
            waiting[u] -= 1
            if not waiting[u]:
                queue.append(u)
    if len(out) != len(order):
        return list(order)
    index = {k.root: n for n, k in enumerate(order)}
    # A kernel of literals alone (or of such kernels) is XLA's constant, folded or fused into each reader; where it
    # is made at all, it is made for its first reader, not before everything that reads the inputs.
    const: set = set()
    for k in out:
        node = kernel_nodes[index[k.root]]
        if const.issuperset(nodes[node][1]):
            const.add(node)
    if not const:
        return out
    at_step = {k.root: float(t) for t, k in enumerate(out)}
    for k in reversed(out):
        node = kernel_nodes[index[k.root]]
        if node in const:
            readers = [at_step[order[u[1]].root] for u in users[node] if u[0] == "kernel"]
            at_step[k.root] = min(readers, default=at_step[k.root]) - 0.5 ** 20
    return sorted(out, key=lambda k: at_step[k.root])


def _made_at(prog: Any) -> dict:
    """Each op's place in the order XLA's fusion pass makes kernels: the reverse of the post order from the
    outputs (operands in order), so that a kernel nearer the outputs is made first. A live program
    (``cost/live.py``'s ``LiveFusion``) has walked that postorder for its positions already (``made_at``)."""
    shared = getattr(prog, "made_at", None)
    if shared is not None:
        return shared()
    ops = prog.ops
    post: list[Any] = []
    seen: set = set()
    for r in prog.outputs:
        stack = [(r, False)]
        push = stack.append
        while stack:
            c, done = stack.pop()
            if done:
                post.append(c)
            elif c not in seen:
                seen.add(c)
                push((c, True))
                for a in reversed(tuple(getattr(ops[c], "args", ()))):
                    if a not in seen:
                        push((a, False))
    last = len(post) - 1
    return {c: last - i for i, c in enumerate(post)}


def _users_rank(prog: Any, order: Sequence[Fusion], made: dict, at: Callable[[Any], Any]) -> Callable:
    """``rank(node, user)``: where kernel ``user`` stands among the readers of ``node`` (an input or a kernel) in
    XLA's list of its users, which its BFS scheduler walks: a reader is added at the end of the list when it is
    made, and removed by moving the last reader into its slot. The lists are replayed as XLA's fusion pass makes
    the kernels: each op's readers in program order, then kernel by kernel (:func:`_made_at`; library kernels
    last), the root first and its producers after, each fused op's slot taken over (or, for a producer another
    kernel still reads, the kernel appended)."""
    ops = prog.ops
    users: dict[Any, list] = {}
    for i in sorted((key for key, _ in _items(ops)), key=at):
        for x in dict.fromkeys(getattr(ops[i], "args", ())):
            users.setdefault(x, []).append(i)
    rep: dict[Any, Any] = {}

    def drop(lst: list, u: Any) -> None:
        j = lst.index(u)
        last = lst.pop()
        if j < len(lst):
            lst[j] = last

    def absorb(i: Any, f: tuple) -> None:
        mine = users.get(i)
        if mine and f in mine:
            drop(mine, f)
        args = [rep.get(x, x) for x in dict.fromkeys(getattr(ops[i], "args", ()))]
        for x in args:
            ux = users.setdefault(x, [])
            if f not in ux:
                ux.append(f)
        if not users.get(i):
            users.pop(i, None)
            for x in args:
                if i in users.get(x, ()):
                    drop(users[x], i)

    inf = math.inf
    for k in sorted(order, key=lambda k: (int(k.kind == LIBRARY), made.get(k.root, inf))):
        f = ("k", k.root)
        users[f] = users.pop(k.root, [])
        rep[k.root] = f
        absorb(k.root, f)
        for i in sorted((i for i in k.computes if i != k.root), key=at, reverse=True):
            absorb(i, f)
    ranks: dict[Any, dict] = {}

    def ranked(x: Any) -> dict:
        got = ranks.get(x)
        if got is None:
            got = ranks[x] = {}
            seen: set = set()
            stack = list(reversed(users.get(x, ())))
            while stack:
                u = stack.pop()
                if u in seen:
                    continue
                seen.add(u)
                if isinstance(u, tuple):
                    got.setdefault(u[1], len(got))
                else:  # an op outside every kernel (a bitcast, a loop's output): its readers in its place
                    stack.extend(reversed(users.get(u, ())))
        return got

    def rank(node: tuple, user: tuple) -> float:
        if user[0] != "kernel":
            return inf
        src = ("k", order[node[1]].root) if node[0] == "kernel" else node[1] if node[0] == "input" else None
        return inf if src is None else ranked(src).get(order[user[1]].root, inf)

    return rank

#: What an elementwise kernel may compute and still write in place over an operand of its shape.
_IN_PLACE = frozenset({"elementwise", "transcendental"})


def loop_carries(op: Any) -> tuple[int, int] | None:
    """``(first, n)``: where a ``scan``'s or ``while``'s carries start among its operands and how many there are;
    ``None`` for any other op."""
    if op.prim == "scan":
        return scan_counts(op.params)
    if op.prim == "while":
        return op.params.get("body_nconsts", 0) + op.params.get("cond_nconsts", 0), len(op.out_avals)
    return None


def _shares(prog: Any, k: Fusion, outs: Mapping[int, Any] | None, last: dict, step: dict, t: int,
            written: set) -> list[tuple]:
    """The buffers kernel ``k`` (at step ``t``) writes into an operand's bytes: (its buffer, the operand).

    XLA:CPU lets a loop fusion's output reuse an operand's buffer when the operand has the output's
    shape, dies at the fusion and is read elementwise (through what XLA reads as stored included:
    :func:`_read_as_stored`); a ``dynamic_update_slice`` writes over its operand's
    buffer where the operand dies there; a ``scan``/``while`` keeps its carry in one
    buffer, which is its initial value's where that value dies at the loop.
    """
    op = prog.ops[k.root]
    found = []
    if outs is not None:  # a loop: carry i is the buffer of init i when init i dies here
        if (carries := loop_carries(op)) is None:
            return found
        first, n = carries
        for i in range(n):  # (``outs``: the loop's outputs the program reads, by index)
            a = buffer_of(prog, op.args[first + i], written)
            if i in outs and a in step and last.get(a) == t and _same(prog, a, outs[i]):
                found.append((outs[i], a))
        return found
    if op.prim == "dynamic_update_slice":  # a kernel of its own that writes its update over its operand's buffer
        a = buffer_of(prog, op.args[0], written)
        return [(k.root, a)] if a in step and last.get(a) == t and _same(prog, a, k.root) else found
    if not _writes_in_place(prog, k, op):
        return found
    # the first operand in program order: a live program's kernels list their reads in another order
    for a in sorted(dict.fromkeys(buffer_of(prog, a, written) for a in k.reads), key=_position_of(prog)):
        if a in step and last.get(a) == t and (_same(prog, a, k.root) or _transposed_product(prog, a, k.root)):
            found.append((k.root, a))
            break
    return found


def _writes_in_place(prog: Any, k: Fusion, op: Any) -> bool:
    """Whether kernel ``k`` (of one result, root op ``op``, neither a loop nor an update) may write over an operand
    that dies there (:func:`_shares`): a loop kernel of elementwise work on what it reads as stored."""
    if k.kind != "loop" or len(op.out_avals) != 1:
        return False
    ops = prog.ops
    return not any(ops[i].family not in _IN_PLACE and ops[i].prim != "broadcast_in_dim"
                   and not _read_as_stored(prog, ops[i]) for i in k.computes)


def _read_as_stored(prog: Any, op: Any) -> bool:
    """Whether a loop kernel reads through ``op`` as it would read its operand's bytes, so that it can still write
    in place: a bitcast (``cost/program.py``'s ``bitcast``), a transpose that moves only axes of size 1 (XLA's
    simplifier makes it a bitcast), or a transpose of a product's result, which XLA's simplifier folds into the
    product (``transpose(dot(a, b)) -> dot(b, a)``: the product is stored in the transposed order)."""
    if bitcast(op):
        return True
    if op.prim != "transpose" or len(op.in_avals) != 1:
        return False
    shape = getattr(op.in_avals[0], "shape", None)
    perm = op.params.get("permutation")
    if shape is None or perm is None:
        return False
    kept = [a for a in perm if shape[a] != 1]
    if kept == sorted(kept):
        return True
    src = op.args[0] if getattr(op, "args", ()) else None
    return src is not None and prog.ops[src].prim == "dot_general" and len(shape) == 2


def _transposed_product(prog: Any, a: Any, b: Any) -> bool:
    """Whether ``a`` is a rank-2 product stored as ``b``'s transpose (which XLA stores in ``b``'s order:
    :func:`_read_as_stored`)."""
    x, y = prog.ops[a].out_avals, prog.ops[b].out_avals
    if prog.ops[a].prim != "dot_general" or len(x) != 1 or len(y) != 1:
        return False
    shape = tuple(getattr(x[0], "shape", ()))
    return (len(shape) == 2 and shape[::-1] == tuple(getattr(y[0], "shape", ()))
            and getattr(x[0], "dtype", None) == getattr(y[0], "dtype", None))


def _same(prog: Any, a: Any, b: Any) -> bool:
    x, y = prog.ops[a].out_avals, prog.ops[b].out_avals
    return len(x) == len(y) == 1 and getattr(x[0], "shape", None) == getattr(y[0], "shape", None) and \
        getattr(x[0], "dtype", None) == getattr(y[0], "dtype", None)


def _position_of(prog: Any) -> Callable[[Any], Any]:
    """Where each op is in ``prog``, as a sort key: a live program's postorder position (``LiveFusion.positions``,
    walked once per version), else the op's key itself (a program's ops are in program order)."""
    positions = getattr(prog, "positions", None)
    if positions is None:
        return _itself
    at = positions()
    missing = len(at)
    return lambda key: at.get(key, missing)


def _itself(key: Any) -> Any:
    return key


def as_xla_simplifies(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with the rewrites of XLA's algebraic simplifier that change what a program stores: a reduction
    over axes a broadcast did not add is the broadcast of the reduction of the broadcast's operand (``reduce(
    broadcast(y)) -> broadcast(reduce(y))``), so the broadcast array is never made. (distrax's mixture gradient
    reduces a ``[N, K]`` value broadcast to ``[N, K, D]`` over ``N``: XLA reduces the ``[N, K]`` value, where the
    model stored the ``[N, K, D]`` one; ``tests/test_memory.py``.) And each real ``sinh`` and ``cosh`` as XLA:CPU
    computes it, from two exponentials it stores (``transcendental.as_exponentials``). What the peak is predicted of
    (``AnalyticCost.predict_temp_bytes``); the equations are not evaluated, only sized. Equations nothing reads (and
    with no effect) are dropped first, as XLA's dead-code elimination drops them (:func:`without_dead`)."""
    return xla_simplified(without_dead(closed))


def xla_simplified(live: ClosedJaxpr) -> ClosedJaxpr:
    """:func:`as_xla_simplifies` of a program without dead code (:func:`without_dead`): ``live`` itself where the
    simplifier changes nothing that is stored."""
    jaxpr = live.jaxpr
    made: dict[Any, Any] = {}
    eqns: list[Any] = []
    changed = False
    for e in jaxpr.eqns:
        src = made.get(e.invars[0]) if e.invars and isinstance(e.invars[0], Var) else None
        if (e.primitive.name in REDUCE_BEFORE_BROADCAST and src is not None
                and src.primitive.name == "broadcast_in_dim" and src.params.get("sharding") is None):
            y, dims, axes = src.invars[0], tuple(src.params["broadcast_dimensions"]), tuple(e.params["axes"])
            if axes and all(a in dims for a in axes) and not src.params.get("out_sharding"):
                kept = [d for d in range(len(dims)) if dims[d] not in axes]
                aval = y.aval.update(shape=tuple(y.aval.shape[d] for d in kept), weak_type=False)
                reduced = Var(aval)
                out = e.outvars[0]
                to = tuple(dims[d] - sum(1 for a in axes if a < dims[d]) for d in kept)
                eqns.append(e.replace(invars=[y], outvars=[reduced],
                                      params={**e.params, "axes": tuple(dims.index(a) for a in axes)}))
                eqns.append(src.replace(invars=[reduced], outvars=[out],
                                        params={**src.params, "shape": tuple(out.aval.shape), "broadcast_dimensions": to}))
                changed = True
                continue
        eqns.append(e)
        for v in e.outvars:
            made[v] = e
    if (expanded := as_exponentials(eqns)) is not None:
        eqns, changed = expanded, True
    return ClosedJaxpr(jaxpr.replace(eqns=eqns), live.consts) if changed else live


def without_dead(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` as XLA compiles it after its dead-code elimination (JAX's ``dce_jaxpr``, every input kept; ``closed``
    itself where nothing is dropped): without the equations no output reads and the outputs of a call (``jit``) or
    loop nothing reads. JAX's trace of a joint program holds some: flax's encoder-decoder step's joint at the
    gradients it reads, 66 of 940 equations and ``jit`` calls of 4 outputs of which 2 are read, was predicted to hold
    778 MB where the program without them holds 711. A peak a rewrite is held to must not size them."""
    jaxpr = closed.jaxpr
    new, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    same = len(new.eqns) == len(jaxpr.eqns) and all(a is b for a, b in zip(new.eqns, jaxpr.eqns))
    return closed if same else ClosedJaxpr(new, closed.consts)


class InnerPeak:
    """What one op holds while it runs: the peak of its body's own temporaries (recursively).

    Remembered per body (a search prices the same loop in many programs).
    """

    def __init__(self, fusion: FusionModel, node_cost: Callable[[Any], float] | None = None) -> None:
        # the model holds this one (``FusionModel.inner``): a strong reference back would be a reference cycle,
        # which would keep the model and the programs its memos hold until a full collection
        self._fusion = weakref.ref(fusion)
        self.node_cost = node_cost
        self._found: dict[int, tuple[Any, int]] = {}  # id(body) -> (the body, kept alive so its id is not reused; peak)

    @property
    def fusion(self) -> FusionModel:
        fusion = self._fusion()
        if fusion is None:
            raise ReferenceError("InnerPeak: its FusionModel is gone (read it as that model's .inner)")
        return fusion

    def __call__(self, op: Any) -> int:
        memo = getattr(op, "memo", None)
        bodies = memo.get("bodies") if memo else None
        if bodies:  # an extractor's op: its chosen bodies (``rewrite.cost.program._chosen_bodies``)
            key = ("inner peak", id(self))  # kept with the bodies, which the memo holds for this op alone
            found = memo.get(key)
            if found is None:
                found = memo[key] = max(liveness_peak(b, kernel_layout(self.fusion, b), self) for b in bodies)
            return found
        if memo is not None:  # an op of one node, whose params are the node's: its peak kept with it
            found = memo.get(self)  # (keyed by this object, which the key keeps alive: no other gets its id)
            if found is None:
                found = memo[self] = self._params_peak(op)
            return found
        return self._params_peak(op)

    def _params_peak(self, op: Any) -> int:
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
        closed = body_closed(jaxpr)
        prog = Program.from_jaxpr(closed, self.node_cost)
        return liveness_peak(prog, kernel_layout(self.fusion, prog), self)


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
