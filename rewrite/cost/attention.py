"""Attention as XLA:CPU runs it where it can: one library (YNN) kernel with both products and the softmax.

XLA:CPU's library matcher (``ynn_matcher.h``) grows a fusion from a product through every operation it supports
and prefers: each must touch ``kMinElements`` (4096) elements or more in its result or an operand
(``IsInstructionPreferredByYnn``), may not be read outside the fusion, and may not be a copy into another
layout of a value the fusion computes. ``softmax(q k^T) v`` so meets it as one kernel: both products, the
softmax's maxima, exponentials, sums and division, no scores stored (``memory_analysis`` reports 0 bytes for
plain attention). The library holds the scores in a scratch of its own instead, as large as the scores, which
the process maps fresh at every call from 32 MiB (its resident memory grows by the scores: ``benchmarks/results/
attention_rss.md``); jaxlib 0.12's holds a share of them at once and maps them a head at a time (the table's
``attention_scratch`` and ``attention_fresh_unit``: :func:`held_scores`, :func:`mapped_fresh`). Read from XLA's
compiled programs (``jax.jit(f).lower(...).compile().as_text()``) over three forms and 28 shapes
(``benchmarks/results/decisions.md``, h-fuse's note): one kernel where the row
statistics (batch x heads x queries) are 4096 or more and no batch axis of the scores has size 1 (layout
assignment then copies the probabilities into another layout); three kernels with the scores stored
otherwise. :func:`attention_chain` says which ops one such kernel computes, ``FusionModel`` (``cost/fusion.py``)
places them there and prices the kernel with :func:`attention_price`, and the peak holds its scratch
(:func:`scratch_bytes`, ``cost/memory.py``).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from . import calibration as _calibration
from .program import ATTENTION, LEAF, LIBRARY_MIN_ELEMENTS, TIEBREAK, Program, _kind, _size, bitcast


#: A library kernel's scratch of this many bytes or more is mapped fresh from the system at every call, and its
#: pages fault on first touch: glibc's ``malloc`` maps every request at or above its mmap threshold, which never
#: rises past ``DEFAULT_MMAP_THRESHOLD_MAX`` (32 MiB on 64-bit). Measured on plain attention's one kernel (minor
#: faults per call, ``getrusage``): 0-3.5 MiB at 18 MiB of scores, 32-39 MiB at 32 MiB, 128 MiB at 128 MiB.
SCRATCH_FRESH_AT = 32 * 2 ** 20

#: Scores of this many bytes or fewer stay in the last-level cache between the kernels of a softmax that XLA:CPU
#: does not make one kernel (its row statistics under the library's floor, a batch axis of size 1): half this
#: machine's 32 MiB L3, as ``benchmarks/calibrate.py`` measures ``cache_bytes`` (the model's ``cache`` where the
#: table has it). There the scores' passes cost what they cost inside the one kernel, not memory traffic, and
#: :func:`attention_chain` takes them (``cached``): flax's cross-attention (b=2, h=2, d=32, 256 x 1024 keys, 1,024
#: rows, 4 MiB of scores) runs its three kernels in 1.1 ms, its blocked form 1.4x that (``benchmarks/results/log.md``).
SCORES_CACHED = 16 * 2 ** 20

#: What may sit between the two products of one attention kernel (``attention_chain``), by primitive.
SOFTMAX_OPS = frozenset({"mul", "div", "reduce_max", "max", "broadcast_in_dim", "stop_gradient", "sub", "exp",
                          "reduce_sum"})


def _readers(prog: Any, i: Any) -> Any:
    """The ops that read op ``i``: a live program keeps them (``users``); a :class:`Program`'s are found once, or
    read off the lists ``FusionModel.fuse`` made of them (``_reader_lists``: the same readers, in program order)."""
    users = getattr(prog, "users", None)
    if users is None:
        users = prog.__dict__.get("_readers")
        if users is None:
            lists = prog.__dict__.get("_reader_lists")
            if lists is not None:
                return set(lists[i])
            users = prog.__dict__["_readers"] = {}
            for j, op in enumerate(prog.ops):
                for a in set(op.args):
                    users.setdefault(a, set()).add(j)
    return users.get(i, frozenset())


def _scalar(prog: Any, i: Any) -> bool:
    op = prog.ops[i]
    return _kind(op) == LEAF and _size(op.out_avals[0] if op.out_avals else None) == 1


def keep_readers(prog: Any, users: list) -> None:
    """Keep with a :class:`Program` the readers ``FusionModel.fuse`` listed of each of its ops (``users[i]``: the ops
    that read op ``i``, in program order, each once), for :func:`_readers` to read off, not find again."""
    if type(prog) is Program:
        prog.__dict__.setdefault("_reader_lists", users)


def attention_chain(prog: Any, i: Any, cached: float = 0.0) -> frozenset | None:
    """The ops XLA:CPU computes in one library (YNN) kernel with ``dot_general`` op ``i``, ``softmax(s) v`` (or
    ``v softmax(s)``) with the logits ``s`` a product ``q k^T`` maybe scaled by a scalar: the first product, the
    softmax's operations and ``i``; ``None`` where XLA makes no such kernel (see the module docstring).

    The softmax is the one ``jax.nn.softmax`` traces: ``exp(s - max(s)) / sum(exp(s - max(s)))``, its maximum maybe
    through ``max(-inf, .)``, a broadcast and ``stop_gradient``. Every operation between the two products must be
    read only by the others (a value read elsewhere is stored, and the library does not absorb it), none of them
    an output, all float32 (the dtype measured), the row statistics of ``LIBRARY_MIN_ELEMENTS`` or more, and the
    scores' batch axes longer than 1; or, with scores of ``cached`` bytes or fewer, whatever their rows and batch
    axes: XLA then runs the softmax in three kernels, but over scores the cache holds, priced as the one
    (:data:`SCORES_CACHED`; :func:`one_kernel` says which)."""
    ops = prog.ops
    d2 = ops[i]
    if d2.prim != "dot_general" or len(d2.args) != 2:
        return None
    for p_at in (0, 1):
        found = _softmax_of(prog, d2.args[p_at], cached)
        if found is not None:
            break
    else:
        return None
    members, scores = found
    out = getattr(prog, "_outputs", None)
    outs = out if out is not None else set(prog.outputs)
    for m in members:
        if m in outs or not _readers(prog, m) <= members | {i}:
            return None
    return frozenset(members | {i})


def kept_chain(prog: Any, i: Any, cached: float = 0.0) -> frozenset | None:
    """:func:`attention_chain`, kept with a :class:`Program` (by op and ``cached``): its ops and outputs do not change
    once built, and ``FusionModel.fuse`` asks for a product's chain where it places the product and again for each
    op it reads (``FusionModel.place``). A live program (``cost/live.py``), which edits its ops, is asked afresh."""
    if type(prog) is not Program:
        return attention_chain(prog, i, cached)
    kept = prog.__dict__.get("_chains")
    if kept is None:
        kept = prog.__dict__["_chains"] = {}
    key = (i, cached)
    if key in kept:
        return kept[key]
    found = kept[key] = attention_chain(prog, i, cached)
    return found


def _softmax_of(prog: Any, n: Any, cached: float = 0.0) -> tuple[set, Any] | None:
    """(the ops of ``div(exp(s - max(s)), sum(exp(s - max(s))))`` at op ``n`` back to the product that makes ``s``,
    the scores ``s``), or ``None``."""
    ops = prog.ops

    def is_(x: Any, prim: str) -> bool:
        return ops[x].prim == prim

    def strip(x: Any, *prims: str) -> Any:
        while ops[x].prim in prims and ops[x].args:
            x = ops[x].args[0]
        return x

    div = ops[n]
    if div.prim != "div" or len(div.args) != 2:
        return None
    e, m = div.args
    if not is_(e, "exp") or not is_(m, "broadcast_in_dim") or not is_(ops[m].args[0], "reduce_sum"):
        return None
    total = ops[m].args[0]
    if ops[total].args[0] != e or not is_(ops[e].args[0], "sub"):
        return None
    sub = ops[e].args[0]
    s, shift = ops[sub].args
    stats = strip(shift, "stop_gradient", "broadcast_in_dim")
    if is_(stats, "max"):
        a, b = ops[stats].args
        stats = a if _scalar(prog, b) else b if _scalar(prog, a) else None
        if stats is None:
            return None
    if not is_(stats, "reduce_max") or ops[stats].args[0] != s:
        return None
    members = {n, e, m, total, sub, stats}
    x = shift
    while x != stats:  # the broadcast, stop_gradient and max between the maxima and the subtraction
        members.add(x)
        x = ops[x].args[0] if ops[x].prim != "max" else next(a for a in ops[x].args if not _scalar(prog, a))
    d1 = s
    if ops[s].prim in ("mul", "div") and len(ops[s].args) == 2 and _scalar(prog, ops[s].args[1]):
        members.add(s)
        d1 = ops[s].args[0]
    elif ops[s].prim == "mul" and len(ops[s].args) == 2 and _scalar(prog, ops[s].args[0]):
        members.add(s)
        d1 = ops[s].args[1]
    if not is_(d1, "dot_general"):
        return None
    members.add(d1)
    scores = ops[s].out_avals[0] if ops[s].out_avals else None
    shape = getattr(scores, "shape", ())
    axis = ops[stats].params.get("axes", ())
    if (getattr(scores, "dtype", None) != np.float32 or len(shape) < 2 or tuple(axis) != (len(shape) - 1,)
            or any(ops[x].prim not in SOFTMAX_OPS for x in members if x != d1)):
        return None
    if _size(scores) * 4 > cached and (any(d == 1 for d in shape[:-2]) or shape[-2] == 1
                                       or _size(ops[stats].out_avals[0]) < LIBRARY_MIN_ELEMENTS):
        return None
    return members, s


def one_kernel(prog: Any, i: Any) -> bool:
    """Whether XLA:CPU makes product ``i`` and the softmax it reads one library kernel (:func:`attention_chain`
    without ``cached``)."""
    return attention_chain(prog, i) is not None


def scratch_bytes(prog: Any, k: Any) -> int:
    """The bytes a kernel holds outside the temporaries ``memory_analysis`` counts while it runs: an attention
    kernel's (``ATTENTION``) scores, in the library's scratch; 0 for any other (``k``: a ``Fusion``)."""
    if k.kind != ATTENTION:
        return 0
    return held_scores(prog, k.root)


def held_scores(prog: Any, r: Any) -> int:
    """The bytes of its scores the library holds at once while the attention kernel rooted at product ``r`` runs:
    :func:`scores_bytes` times the table's ``attention_scratch``, the share measured (``benchmarks/calibrate.py
    --attention-scratch-only``: a call's growth of the resident memory over its scores' bytes); all of them where the
    table has none. jaxlib 0.10's library holds them all (1.03-1.10 measured); 0.12's runs a few heads at a time
    (0.4 at N=2048 and 4096 on 2 cores, 8 heads: its plain attention held 54 MiB where 0.10's held 145 MiB)."""
    return int(scores_bytes(prog, r) * _calibration.active().get("attention_scratch", 1.0))


def scores_bytes(prog: Any, r: Any, per_head: bool = False) -> int:
    """The bytes of the scores of the attention kernel rooted at product ``r``: its probabilities'; ``per_head``: of
    one of their ``queries x keys`` slices (one batch element's one head)."""
    for a in prog.ops[r].args:
        op = prog.ops[a]
        if op.prim == "div" and op.out_avals:
            aval = op.out_avals[0]
            n = aval.shape[-2] * aval.shape[-1] if per_head and len(aval.shape) >= 2 else _size(aval)
            return n * np.dtype(aval.dtype).itemsize
    return 0


def mapped_fresh(prog: Any, r: Any) -> bool:
    """Whether the library maps the scratch of the attention kernel rooted at ``r`` fresh at every call: where one
    allocation of it is ``SCRATCH_FRESH_AT`` bytes or more. jaxlib 0.10's library allocates the scores whole
    (minor faults a call at N=1024, 2048, 4096, 8 heads: 37.5, 130, 512 MiB, the scores'); jaxlib 0.12's a head's
    at a time, the table's ``attention_fresh_unit`` ``"head"`` (2, 0 and 282 MiB: a head's scores are 4, 16 and 64
    MiB; ``benchmarks/calibrate.py --attention-scratch-only`` reports the faults)."""
    per_head = _calibration.active().get("attention_fresh_unit") == "head"
    return scores_bytes(prog, r, per_head) >= SCRATCH_FRESH_AT


def attention_price(self: Any, prog: Any, r: Any, comp: Iterable[Any]) -> tuple[float, set]:
    """The price of the kernel of the fusion model ``self`` rooted at ``r`` of kind ``ATTENTION`` (computing
    ``comp``), and what it reads: its two products at their own prices (``kernel_product``'s, where the model
    gives one: a product at the one-core rate) but for the scores they write
    and read, which stay in the library's tiles; each softmax operation a pass over its tiles (``library_op``
    per element) and each reduction its elements (``reduce``); and, where the library maps the scores' scratch
    fresh at every call (:func:`mapped_fresh`), ``fresh`` per byte of what of them it holds at once
    (:func:`held_scores`: its pages fault at every call)."""
    ops = prog.ops
    inside = set(comp)
    facts = self._facts  # (the fusion model's, per op: see FusionModel._facts)
    cost = self.launch + self.node * len(inside)
    reads: set = set()
    scores = scores_bytes(prog, r)
    for i in inside:
        op = ops[i]
        f = facts(op, prog)
        if self.tiebreak is not None:
            cost += TIEBREAK * f[1]
        if op.prim == "dot_general":  # the first writes the scores (and spills them), the second reads them
            own = op.own if self.kernel_product is None else self.kernel_product(op)
            cost += own - self.byte * scores - (self.spilled(scores) if i != r else 0.0)
        elif f[7]:
            cost += f[3]
        elif not bitcast(op):
            cost += _size(op.out_avals[0]) * (self.library_op if self.library_op is not None else self.cheap)
        reads.update(a for a in op.args if a not in inside and ops[a].prim != "literal")
    if self.fresh and mapped_fresh(prog, r):
        cost += self.fresh * held_scores(prog, r)
    return cost, reads
