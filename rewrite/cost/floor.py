"""A floor under a program's scheduled peak of temporaries, read without ordering its kernels.

The lean pass (``rewrite/extract/program.py``'s ``LiveProgram.held``) asks whether a moved program can be leaner
than the current one before it schedules the moved program (``cost.memory.scheduled_peak``): where
:func:`peak_floor` is already over the most a leaner peak holds, the move is declined unscheduled.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from .attention import scratch_bytes
from .fusion import Fusion, _out_bytes, _temp, buffer_of
from .memory import _buffers, _position_of, _writes_in_place, loop_carries


def peak_floor(prog: Any, kernels: Sequence[Fusion], inner: Callable[[Any], int] | None = None,
               above: float = math.inf, across: bool = True) -> int:
    """A lower bound on ``cost.memory.scheduled_peak`` (``scratch`` held) of the same kernels, read without ordering
    them: the most, over kernels, of what a kernel holds inside (its ``inner`` and scratch) and the buffers of sizes
    no program output has (``_out_bytes``) that it reads, writes or that are live across it in every order
    (:func:`_across`: written by an ancestor of it, read by a descendant), each read once and each written one that
    may write over a read of its size not at all. The first bound over ``above`` is returned at once (whether it
    exceeds ``above`` is all a caller that passes it reads), before the buffers live across are sought (a
    reachability pass). It costs a fraction of the peak (no order, no sharing). ``across=False``: those buffers are
    not sought at all (a lower floor still, for a quarter of the cost or less: what a kernel holds itself).

    Why it bounds the peak in every order the kernels can run in (``xla_order`` gives one where each kernel comes
    after the kernels it reads, or program order, which does too): ``_peak_in`` holds a group of buffers that share
    bytes (``_shares``) at every step from its first write to its last read, at the group's size, unless the group
    holds an output (the output's allocation) or is placed in an output allocation of exactly its size. A buffer
    shares only with one of the same bytes (``_same``, ``_transposed_product``: one value each), so a group's
    members all have one size S, and its size, the most ``_temp`` of them, is S where any member is a temporary. A
    buffer of a size no output has is then in a group that holds no output and fits no output's allocation: held at
    S from its write to its last read. A kernel's step lies in that span for each buffer it writes and each it reads
    (written by a kernel that ran before it, read again no earlier), and for each buffer written by an ancestor of
    it (run before it) and read by a descendant (run after it). Buffers of different sizes are in different groups.
    Of one size: each buffer takes at most one donor, an operand that dies where it is written (a loop's carry: its
    initial value, read by the loop), so strictly before, and a donor gives its bytes to one buffer but where a loop
    carries one value in two carries (checked here: then every size is counted once). So a group is a chain whose
    members' lives [w0, w1], [w1, w2], ... (w0 < w1 < ...) meet only where one dies and the next is written: at a
    kernel's step t, the members with w_i < t <= w_i+1 (its reads, the buffers live across it) are at most one a
    group, and each buffer it writes (w_i = t) is in a group of its own or in one read's (the member before it), so
    a size S held by r reads and w writes is held max(r, w) times at least, and each buffer live across it (w_i < t <
    w_i+1, neither read nor written there) once more.
    """
    projs, outputs, written = _buffers(prog, kernels)
    ops = prog.ops
    taken = {_out_bytes(ops[o]) for o in outputs}  # sizes a buffer may share with an output or be placed in
    mine = {k.root: (k.root,) if k.root not in projs else tuple(projs[k.root].values()) for k in kernels}
    buffers = {b for bs in mine.values() for b in bs}  # what ``_peak_in`` holds: a loop's are its outputs
    once = any(_carries_one_twice(prog, ops[r], written) for r in projs)
    found = 0
    heres: list[int] = []
    sizes: list[set] = []  # (``once``) the sizes each kernel holds
    for k in kernels:
        wrote: dict[int, int] = {}
        for b in mine[k.root]:
            if (s := _temp(prog, b, outputs, written)) and s not in taken:
                wrote[s] = wrote.get(s, 0) + 1
        read: dict[int, int] = {}
        for b in {a if a in written else buffer_of(prog, a, written) for a in k.reads}:
            if b in buffers and (s := _temp(prog, b, outputs, written)) and s not in taken:
                read[s] = read.get(s, 0) + 1
        if once:
            sizes.append(wrote.keys() | read.keys())
            here = sum(sizes[-1])
        elif k.root in projs or ops[k.root].prim == "dynamic_update_slice" or _writes_in_place(prog, k, ops[k.root]):
            here = sum(s * max(wrote.get(s, 0), read.get(s, 0)) for s in wrote.keys() | read.keys())
        else:  # it writes over no operand (:func:`_shares`)
            here = sum(s * n for s, n in wrote.items()) + sum(s * n for s, n in read.items())
        if inner is not None:
            here += inner(ops[k.root])
        here += scratch_bytes(prog, k)
        heres.append(here)
        if here > found:
            found = here
            if found > above:
                return found
    for n, more in _across(prog, kernels, mine, written, outputs, taken) if across else ():
        here = heres[n] + (sum(s for s in {s for s, _ in more} - sizes[n]) if once else sum(s for s, _ in more))
        if here > found:
            found = here
            if found > above:
                return found
    return found


def _across(prog: Any, kernels: Sequence[Fusion], mine: dict, written: set, outputs: set,
            taken: set) -> list[tuple[int, list]]:
    """The buffers of sizes no output has (not in ``taken``) that a kernel neither reads nor writes but that are live
    at it in every order the kernels run in: written by an ancestor of it and read by a descendant. For the kernels
    that have any, ``(index in kernels, [(size, buffer), ...])``. A kernel's parents are the writers of what it
    reads that come before it in program order (all of them, where the order is one the kernels can run in), so
    what is found is never more than the true sets. One pass each way, a bitset of buffers a kernel."""
    at = _position_of(prog)
    order = sorted(range(len(kernels)), key=lambda n: at(kernels[n].root))
    writer = {b: n for n in order for b in mine[kernels[n].root]}
    bit: dict[Any, int] = {}
    sized: list[tuple[int, Any]] = []
    for b in writer:
        if (s := _temp(prog, b, outputs, written)) and s not in taken:
            bit[b] = 1 << len(sized)
            sized.append((s, b))
    if not sized:
        return []
    place = [0] * len(kernels)
    for t, n in enumerate(order):
        place[n] = t
    parents: list[set] = [set() for _ in kernels]
    wrote = [0] * len(kernels)  # the sized buffers each kernel writes
    touched = [0] * len(kernels)  # ... reads or writes
    for n in order:
        k = kernels[n]
        got = 0
        for b in mine[k.root]:
            got |= bit.get(b, 0)
        wrote[n] = got
        for a in k.reads:
            b = a if a in written else buffer_of(prog, a, written)
            w = writer.get(b)
            if w is not None:
                got |= bit.get(b, 0)
                if place[w] < place[n]:
                    parents[n].add(w)
        touched[n] = got
    up = [0] * len(kernels)  # the sized buffers its ancestors write
    for n in order:
        got = 0
        for p in parents[n]:
            got |= up[p] | wrote[p]
        up[n] = got
    down = [0] * len(kernels)  # the sized buffers its descendants read (or write: none an ancestor writes)
    for n in reversed(order):
        for p in parents[n]:
            down[p] |= down[n] | touched[n]
    found = []
    for n in order:
        live = up[n] & down[n] & ~touched[n]
        if live:
            more = []
            while live:
                low = live & -live
                more.append(sized[low.bit_length() - 1])
                live ^= low
            found.append((n, more))
    return found


def _carries_one_twice(prog: Any, op: Any, written: set) -> bool:
    """Whether loop ``op`` starts two of its carries from one buffer (which :func:`_shares` may give to both)."""
    if (carries := loop_carries(op)) is None:
        return False
    first, n = carries
    inits = [buffer_of(prog, a, written) for a in op.args[first:first + n]]
    return len(set(inits)) < len(inits)


