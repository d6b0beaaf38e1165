"""Cost models: what extraction minimises.

A cost model is a :class:`CostModel`, a protocol of up to three parts, each
one declared:

1. a *node price* (always): ``model(node)``, from :class:`NodeInfo` (one node:
   its primitive, params, operand and result avals, and for nodes with
   bodies what one execution of each body costs) to a non-negative float.
   The extractor adds node prices over the chosen program, counting a shared
   node once;
2. a *whole-program price* (if ``prices_programs``): ``model.program(prog)``
   prices a whole candidate program (a :class:`rewrite.cost.program.Program`),
   which a sum of node prices cannot: what XLA fuses, stores and recomputes.
   The extractor then chooses among candidates, and refines the best, by it;
3. a *measured final choice* (if ``measures``): ``model.choose(programs)``
   picks among the best candidates, cheapest predicted first, after they are
   emitted (timing them on the backend, say).

A plain function ``NodeInfo -> float`` is accepted as a node price alone
(:class:`NodeCost`), with a warning: it cannot price whole programs, so it
turns that part off. Wrap it in :class:`NodeCost` to say that is meant, or
subclass :class:`AnalyticCost` to keep whole-program pricing.

The default, :class:`AnalyticCost`, prices in nanoseconds measured on the
backend (``benchmarks/calibrate.py`` writes the table to
``rewrite/cost/calibration.json``): each elementwise primitive at its own measured
price (on XLA:CPU ``sin`` costs fifty multiplications and ``exp`` five),
bytes where XLA materialises arrays, and flops of contractions. Elementwise
chains are treated as fused, so they cost their arithmetic only. A node
cost cannot see which values XLA stores and which it recomputes in every
loop that reads them, so :meth:`AnalyticCost.program` also prices whole
candidate programs the way XLA fuses them (``rewrite/cost/fusion.py``); the
extractor uses it to choose among candidates and to refine the best.
``cost_model="measure"`` goes further and times the best candidates on the
backend itself (``rewrite/cost/measure.py``).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import math
import numbers
import os
import sys
import warnings
import weakref
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

import jax

from ..ir import primitives as _primitives
from ..ir.scanread import IN_PLACE
from ..ir.primitives import BY_PRIM, DEFAULT as _OPAQUE_SPEC, NodeInfo, inner_jaxpr, nbytes, size  # noqa: F401
from . import calibration as _calibration
from .attention import SCORES_CACHED
from .dispatch import contraction_flops, dispatched
from .dot import FALLBACK as _DOT_FALLBACK, REPACK as _DOT_REPACK, copied as dot_copied, library_dot
from .dot import ALIASED, STRIDED, turns as dot_turns
from .fusion import FusionModel, ns_key, peak_temp_bytes
from .memory import InnerPeak, fresh_peak, kernel_layout, scheduled_peak, without_dead, xla_simplified
from .prices import NODE_KEY, price_of
from .program import Program, library_reduction
from .spill import spilled as _spilled


class CostModel(abc.ABC):
    """The cost-model protocol: a node price, and, when declared, a whole-program price and a measured choice.

    Subclass it and define ``__call__``; set ``prices_programs = True`` and
    define :meth:`program`, or ``measures = True`` and define :meth:`choose`,
    to provide those parts. The extractor uses exactly what the flags
    declare, nothing else.

    >>> import jax.numpy as jnp
    >>> from rewrite import CostModel, rewrite
    >>> class CountNodes(CostModel):  # every operation costs one: the fewest equations win
    ...     def __call__(self, node):
    ...         return 0.0 if node.family == "special" else 1.0
    >>> CountNodes().prices_programs, CountNodes().measures
    (False, False)
    >>> f = rewrite(lambda x: jnp.sin(x) * 1.0, cost_model=CountNodes())
    >>> float(f(jnp.float32(0.5))) == float(jnp.sin(jnp.float32(0.5)))
    True
    """

    #: whether :meth:`program` prices whole programs (the extractor then chooses by it)
    prices_programs: ClassVar[bool] = False
    #: whether :meth:`choose` makes the final choice among emitted candidates
    measures: ClassVar[bool] = False

    @abc.abstractmethod
    def __call__(self, node: NodeInfo) -> float:
        """The price of one node: a non-negative float; only comparisons matter."""

    def program(self, prog: Any) -> float:
        """The price of a whole program (a :class:`rewrite.cost.program.Program`); used when ``prices_programs``."""
        raise NotImplementedError(f"{type(self).__name__} does not price whole programs")

    def choose(self, programs: Sequence[Any]) -> tuple[Any, Any]:
        """The program to emit, of ``programs`` (closed jaxprs, cheapest predicted first), and a report of
        how it was chosen (:class:`rewrite.cost.measure.Timing`, say); used when ``measures``."""
        raise NotImplementedError(f"{type(self).__name__} does not choose among measured programs")


class NodeCost(CostModel):
    """A node price alone, from a function ``NodeInfo -> float``: no whole-program price, no measuring.

    >>> import jax.numpy as jnp
    >>> from rewrite import AnalyticCost, NodeCost, rewrite
    >>> model = NodeCost(lambda node: 1e9 if node.op == "add" else AnalyticCost()(node))
    >>> model.prices_programs
    False
    >>> f = rewrite(lambda x: x + 1.0, cost_model=model)
    >>> float(f(jnp.float32(1.0)))
    2.0
    """

    def __init__(self, fn: Callable[[NodeInfo], float]) -> None:
        if not callable(fn):
            raise TypeError(f"NodeCost takes a function NodeInfo -> float, got {fn!r}")
        self.fn = fn

    def __call__(self, node: NodeInfo) -> float:
        return self.fn(node)

    def __repr__(self) -> str:
        return f"NodeCost({getattr(self.fn, '__qualname__', self.fn)})"


#: A table that prices in place of the backend's while :func:`priced_with` holds it.
_PINNED = _calibration.PINNED
#: The table prices come from: the one :func:`priced_with` pins, else the calibration table of the default backend
#: (``rewrite/cost/calibration.json``, with the installed jaxlib's overlay), else the CPU's.
_table = _calibration.active


@contextlib.contextmanager
def priced_with(table: Mapping[str, Any]) -> Iterator[None]:
    """Within the block, :class:`AnalyticCost`'s defaults (and the default model) come from ``table``, a
    table of the form ``rewrite/cost/calibration.json`` holds, not from this machine's calibration.

    For results that must not move when the machine's table is measured again: the golden files
    (``tests/golden``) are priced with a fixed table kept beside them.

    >>> from rewrite import AnalyticCost
    >>> from rewrite.cost import calibration
    >>> table = {**calibration.CPU, "launch": 1.0}
    >>> with priced_with(table):
    ...     AnalyticCost().launch, default_model().launch
    (1.0, 1.0)
    >>> AnalyticCost().launch == calibration.CPU["launch"]  # on a CPU backend
    True
    """
    _PINNED.append(table)
    try:
        yield
    finally:
        _PINNED.pop()


def check_memory_budget(budget: Any) -> None:
    """Raise ``ValueError`` unless ``budget`` is ``None`` or a positive number of bytes (``inf`` is no
    budget): a negative, zero or NaN budget would otherwise price every program over it, silently.

    >>> check_memory_budget(-1)
    Traceback (most recent call last):
    ...
    ValueError: memory_budget must be None or a positive number of bytes, got -1
    """
    if budget is None:
        return
    ok = isinstance(budget, numbers.Real) and not isinstance(budget, bool)
    if not ok or math.isnan(float(budget)) or float(budget) <= 0:
        raise ValueError(f"memory_budget must be None or a positive number of bytes, got {budget!r}")


#: A loop trip's price where the backend's table has no measured one (ns; a GPU's measured 8.1 us).
ITERATION_ESTIMATE = 1000.0


@dataclasses.dataclass(frozen=True)
class AnalyticCost(CostModel):
    """The default cost model: measured per-element prices, materialised bytes and flops, in nanoseconds.

    It provides a node price (``__call__``) and, with ``fusion=True`` (the
    default), a whole-program price (:meth:`program`: XLA's fusion replayed,
    ``rewrite/cost/fusion.py``). In the whole-program price the node price only
    breaks ties and prices the kernels the fusion model does not fuse (dots,
    loops, calls); a subclass that changes ``__call__`` so that it decides
    more should pass ``fusion=False`` or override :meth:`program` as well.

    ``ops`` maps a primitive to nanoseconds per element inside a fused loop;
    primitives missing from it cost ``flop`` (cheap elementwise) or
    ``transcendental``. ``byte`` prices a byte that XLA writes or reads where
    an array materialises, ``dot`` a flop of a contraction, ``reduce`` an
    element a reduction adds up, ``launch`` one kernel. Defaults come from
    the calibration table of this backend.

    >>> import jax.numpy as jnp
    >>> from jax.core import ShapedArray
    >>> from rewrite import AnalyticCost, NodeInfo
    >>> a = ShapedArray((1000,), jnp.float32)
    >>> m = AnalyticCost()
    >>> m(NodeInfo("sin", "transcendental", {}, (a,), (a,))) > m(NodeInfo("exp", "transcendental", {}, (a,), (a,)))
    True
    """

    flop: float = dataclasses.field(default_factory=lambda: _table()["elementwise_ns"].get("mul", 0.02))
    transcendental: float = 2.0
    byte: float = dataclasses.field(default_factory=lambda: _table()["byte"])
    #: an array larger than ``cache`` bytes does not stay in the last-level cache between the kernel that
    #: writes it and the ones that read it: each byte of it beyond ``cache`` costs ``spill`` more, each time
    #: it is written or read (``benchmarks/calibrate.py``, ``measure_cache``). The table's, where measured;
    #: else no such term (``spill=0``).
    cache: float = dataclasses.field(default_factory=lambda: _table().get("cache_bytes", math.inf))
    spill: float = dataclasses.field(default_factory=lambda: _table().get("spill", 0.0))
    #: a kernel that reads an array of more than ``near`` bytes and writes another as large does not keep both in
    #: the part of the last-level cache it gets (the cache is shared with the other core and the machine's other
    #: processes): each byte of an array beyond ``near`` costs ``tier`` more, each time it is written or read, on
    #: top of ``spill`` beyond ``cache`` (``benchmarks/calibrate.py``, ``measure_tier``: ``x * c + 1`` into a
    #: second buffer costs ~0.009 ns per byte moved from 2 to 8 MiB and 1.5-6 times that from 12 to 24 MiB, more
    #: the busier the machine). Only where ``spill`` is priced. The table's, where stored; the tables leave it off
    #: (it moved two LM-head decisions, one to a rewrite measured slower: ``benchmarks/calibrate.py``'s note).
    near: float = dataclasses.field(default_factory=lambda: _table().get("near_bytes", math.inf))
    tier: float = dataclasses.field(default_factory=lambda: _table().get("tier", 0.0))
    #: a softmax between two products that XLA:CPU runs in three kernels over scores of ``scores_cached`` bytes or
    #: fewer is priced as the one attention kernel (``rewrite/cost/attention.py``'s ``SCORES_CACHED``): the cache
    #: holds the stored scores. The table's ``cache_bytes``, else ``SCORES_CACHED``; 0 prices them stored always.
    scores_cached: float = dataclasses.field(
        default_factory=lambda: _table().get("cache_bytes", SCORES_CACHED))
    #: a fixed charge per node; it breaks ties in favour of fewer equations
    node: float = 5.0
    #: per loop iteration, for the loop's own bookkeeping beyond its body's kernels: the table's
    #: ``iteration`` where it was measured (``benchmarks/calibrate.py --loop-only``), else 1 us
    iteration: float = dataclasses.field(default_factory=lambda: _table().get("iteration", ITERATION_ESTIMATE))
    #: assumed trip count of a while loop
    while_trips: float = 10.0
    #: what a kernel of a loop body costs at each trip beyond its work, in the whole-program price: a loop kernel
    #: ``loop_launch``, a library kernel (a product on the library path, a library reduction) ``loop_launch_library``
    #: (``benchmarks/calibrate.py --loop-kernels-only``: 166 and 115 ns on this CPU; ``rewrite/cost/fusion.py``'s
    #: ``FusionModel.launches``). The table's, where it has them; else 0 (a body's kernels priced by their work alone).
    #: The tables leave them off: so priced, the scan pack's hoisting was declined where it measured faster as well as
    #: where it measured slower (``benchmarks/results/decisions.md``, h-loop's note).
    loop_launch: float = dataclasses.field(default_factory=lambda: _table().get("loop_launch", 0.0))
    loop_launch_library: float = dataclasses.field(default_factory=lambda: _table().get("loop_launch_library", 0.0))
    #: what a loop kernel of a loop body that XLA:CPU splits across the cores (``loop_parallel_at`` elements or more)
    #: costs more at each trip than one it runs on one core, beyond the price of its work (``benchmarks/calibrate.py
    #: --loop-split-only``: the pool's hand-off and join at every trip; ``FusionModel.launches``). Attention's query
    #: blocks run eight times the trips of its key blocks alone, each trip's kernels split. The table's, where it has
    #: it; else 0.
    loop_split: float = dataclasses.field(default_factory=lambda: _table().get("loop_split", 0.0))
    #: extra charge per byte of a loop's stacked output, on top of writing it: the memory it
    #: holds (in a backward program, until the backward loop reads it). Raise it to trade
    #: recomputation for memory; 0 prices time only.
    stacked: float = 0.0
    #: charge per byte of the program's predicted peak of temporaries (arrays that kernels
    #: write and other kernels read, outputs and inputs excluded; see ``cost/fusion.py``'s ``peak_temp_bytes``),
    #: with whole-program pricing. The default is ``byte``: holding an array at the peak costs
    #: as much as writing it once more, so of two programs about as fast the one that holds
    #: less memory wins. 0 prices time only; raise it to trade time for memory.
    memory: float = dataclasses.field(default_factory=lambda: _table()["byte"])
    #: a program whose predicted temporaries are ``fresh_at`` bytes or more pays ``fresh`` per byte of them at
    #: every call: the C library maps an allocation that large fresh from the system, so each page of the buffer XLA
    #: allocates for a call's temporaries faults on first touch (``benchmarks/calibrate.py``, ``measure_fresh``).
    #: glibc maps one from 32 MiB only where its heap lacks that much free at its top, which it keeps up to 64 MiB
    #: (twice the mmap threshold, which a freed mapping raises to at most 32 MiB): from 64 MiB always, between by
    #: what the process held before, so the table's 64 MiB (the corpus agrees: at 32 MiB its rank correlation
    #: falls). Read from the liveness peak in XLA's order (``cost/memory.py``'s ``scheduled_peak``: what
    #: ``memory_analysis`` reports), not the kernels' peak that ``memory`` reads. The table's, where measured;
    #: else no such term (``fresh=0``).
    fresh: float = dataclasses.field(default_factory=lambda: _table().get("fresh", 0.0))
    fresh_at: float = dataclasses.field(default_factory=lambda: _table().get("fresh_bytes", math.inf))
    #: the most bytes of temporaries the chosen program may hold (predicted: ``rewrite/cost/memory.py``,
    #: a loop body's own included), or ``None``: a program over it is priced above every program
    #: within it, so the fastest program that fits is chosen (the input program too, if it does not fit).
    memory_budget: float | None = None
    #: programs priced within this fraction of each other, in their prices and in their times (a price less its
    #: memory charge, ``memory`` per byte of the peak: the charge is not counted twice), are taken as equally
    #: fast, and of those the leaner wins (at most 3/4 of the other's predicted peak, and 1 MiB less:
    #: ``rewrite/extract/lean.py``, :func:`rewrite.extract.lean.leaner`). The model's error between two forms of
    #: one loop is of this order: the LM head's loss at N=8192 in blocks of 256 tokens is priced 2.5% above blocks
    #: of 512 and measured 3.6% slower, holding half the memory. 0 prices by the sum alone, and so does ``memory=0``.
    lean_band: float = 0.03
    #: whole programs priced within this fraction of each other are taken as equally fast where one is predicted
    #: to hold at most half the other's temporaries and more than ``cache`` bytes less (arrays that stream from
    #: memory, whose traffic the sum underprices): a training step with its loss and gradients read from the
    #: loss-first program against the step as written (``rewrite/api.py``; measured in
    #: ``benchmarks/results/wholestep.md``). 0 turns it off; it is off wherever ``lean_band`` is.
    lean_band_far: float = 0.2
    #: a rewrite chosen priced within this fraction of the input, where either is predicted to hold 1 MiB of
    #: temporaries or more, gives way to the input: within ``tie.ALIKE`` (0.01%, the default here) without a
    #: compile, beyond it where XLA says the rewrite holds more temporaries (``memory_analysis``, both compiled for
    #: abstract inputs): the model does not always see the order XLA runs kernels in (``rewrite/extract/tie.py``;
    #: XLA was never seen to hold more for a rewrite priced further off, so it is not asked by default). 0 turns
    #: it off; it is off with ``memory=0`` and under a ``memory_budget``.
    memory_tie: float = 1e-4
    ops: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(_table()["elementwise_ns"]))
    dot: float = dataclasses.field(default_factory=lambda: _table()["dot_flop"])
    #: a product of ``dot_parallel_at`` flops or more costs ``dot_parallel`` per flop in place of ``dot``: on XLA:CPU
    #: a small product runs on one core and a large one on every core (``benchmarks/calibrate.py``,
    #: ``measure_dot_sizes``: about 100 GFLOP/s below ~1e8 flops on this 2-core machine, 180-200 above). The
    #: table's, where measured; else one rate for every product (``dot_parallel_at=inf``).
    dot_parallel_at: float = dataclasses.field(default_factory=lambda: _table().get("dot_parallel_at", math.inf))
    dot_parallel: float = dataclasses.field(
        default_factory=lambda: _table().get("dot_parallel_flop", _table()["dot_flop"]))
    #: ns per flop of the two products inside one attention kernel (``softmax(q k^T) v`` that XLA:CPU's library runs
    #: as one fusion, ``rewrite/cost/attention.py``), whatever their size; ``None``: the rate by size that a product
    #: alone gets (:meth:`dot_rate`). Measured, that kernel runs its products at the rate by size once the scratch it
    #: maps fresh is priced apart (``attention_price``'s ``fresh``): plain attention at N=768 (18 MiB of scores, none
    #: mapped fresh) ran 1.2 GFLOP in 7.88 ms, 153 GFLOP/s with its softmax; at N=1024 25.06 ms, of which its 32 MiB
    #: mapped fresh at 0.27-0.33 ns a byte are 9-11 ms (``benchmarks/results/log.md``, h-rate's and h-fresh's
    #: sections). The table's ``attention_dot_flop``, else ``None``.
    attention_dot: float | None = dataclasses.field(default_factory=lambda: _table().get("attention_dot_flop"))
    #: XLA:CPU splits an elementwise loop (a fused loop kernel, in a loop body too) of ``loop_parallel_at`` elements or
    #: more across the cores (its compiled program names the split, ``outer_dimension_partitions``: from 64K float32
    #: elements on this machine), and runs a smaller one on one core. The table's per-element prices are measured on
    #: split loops (``benchmarks/calibrate.py``'s 4M elements), so an elementwise operation in a smaller loop is priced
    #: at ``loop_serial`` times them (``calibrate.py --serial-only``, timed on a quiet machine: 1.8 on these two cores;
    #: ``scan_seed_hand_vectorised``: one ``cos`` over 2M elements at 4.2 ns each, 64 loop trips of 32K at 7.5), in
    #: the fusion model's kernels and in the node price of a loop body's operations. ``loop_parallel`` prices a split
    #: loop's work at that share of the table's instead (the tables leave it at 1: priced so, with loop bodies at 1,
    #: seed 001's accumulator lost to its vectorised form at the demo's size, ``tests/test_scan.py``). Both off (1)
    #: where the table has no ``loop_parallel_at``.
    loop_parallel: float = dataclasses.field(default_factory=lambda: _table().get("loop_parallel", 1.0))
    loop_parallel_at: float = dataclasses.field(default_factory=lambda: _table().get("loop_parallel_at", math.inf))
    loop_serial: float = dataclasses.field(default_factory=lambda: _table().get("loop_serial", 1.0))
    #: a loop kernel costs the larger of its arithmetic and the bytes it moves (at ``byte``), not their sum: the CPU
    #: hides cheap arithmetic under the memory traffic (``benchmarks/remat_parts.py``: gelu's backward reading four
    #: 2 MiB arrays with sixteen operations priced 283 + 238 us, measured 276; kept/remat at 248 rows measured
    #: 0.82-0.85, priced 1.025 summed, 0.859 overlapped); a loop body's loop kernels take it too, at every trip
    #: (``FusionModel.launches``). Off (``False``) unless a table's ``overlap`` turns it on, and no table does: on in
    #: this CPU's, the corpus's Spearman over the same 111 pairs goes 0.887 -> 0.904 on measurement, but it rewrites
    #: ``lm_head_loss_small``'s head (``nn_lm_head_lse_label_256``, predicted 1.01x), measured 0.88x, and
    #: ``gymnax_cartpole_rollout``'s choice takes a hoist measured 0.92x (log.md, h-overlap and h-spear3).
    overlap: bool = dataclasses.field(default_factory=lambda: bool(_table().get("overlap", False)))
    #: a loop body's loop kernels pay their bytes at every trip, summed with their work (its node prices hold the work
    #: alone), not ``overlap``'s share (``remat_parts.py --bodies``; ``FusionModel.launches``). The table's, else off.
    loop_bytes: bool = dataclasses.field(default_factory=lambda: bool(_table().get("loop_bytes", False)))
    #: a loop kernel in which a transcendental reads another's result (``log(2 cosh(x))``) pays ``chain`` times the
    #: prices of the dearest such chain more: each waits for the other's latency (``benchmarks/calibrate.py
    #: --chain-only``; ``rewrite/cost/transcendental.py``'s ``chained``). The table's, where measured; else 0.
    chain: float = dataclasses.field(default_factory=lambda: _table().get("chain", 0.0))
    #: how much dearer a flop is on the backend's generic product path than on its library path, and what
    #: that path costs beyond it per element of the left operand, in flops (``rewrite/cost/dot.py``: on
    #: XLA:CPU, a left operand that contracts a major dimension)
    dot_fallback: float = dataclasses.field(default_factory=lambda: _DOT_FALLBACK.get(jax.default_backend(), 1.0))
    dot_repack: float = dataclasses.field(default_factory=lambda: _DOT_REPACK.get(jax.default_backend(), 0.0))
    #: ns per element of a product's operand that XLA copies with its minor-most dimension moved down a page-multiple
    #: stride (``rewrite/cost/dot.py``'s ``turns``, aliased: flax's ``v^T p^T`` transposes its 32 MiB of scores), its
    #: reading and writing included, in place of the copy's bytes. The table's ``transpose_copy``, else ``None``.
    transpose_copy: float | None = dataclasses.field(default_factory=lambda: _table().get("transpose_copy"))
    #: ns per element of any other copy of a product's operand that moves its minor-most dimension
    #: (``rewrite/cost/dot.py``'s ``turns``: the ``STRIDED`` regime), its reading and writing included, in place of
    #: the copy's bytes: measured 3-9x a copy, 1.1-1.2 ns (``benchmarks/calibrate.py --transpose-strided-only``).
    #: The table's ``transpose_strided``, else ``None`` (priced as a copy). The tables leave it off: it moves the
    #: decision corpus by nothing (``benchmarks/results/log.md``, h-spear's section). A ``transpose`` equation is
    #: priced as a copy whatever it moves: XLA folds those that products read into them.
    transpose_strided: float | None = dataclasses.field(default_factory=lambda: _table().get("transpose_strided"))
    reduce: float = dataclasses.field(default_factory=lambda: _table()["reduce_per_element"])
    #: ns per element of a library (YNN) reduction whose operand the cache holds (``cache`` bytes or fewer), its
    #: reading included, in place of ``reduce`` and ``byte`` (measured streamed): a block of attention's scores
    #: that the product before it wrote (``rewrite/cost/spill.py``'s ``cached_reduction``). The table's
    #: ``reduce_cached``, else ``None`` (priced as streamed).
    reduce_cached: float | None = dataclasses.field(default_factory=lambda: _table().get("reduce_cached"))
    launch: float = dataclasses.field(default_factory=lambda: _table()["launch"])
    #: per element of each operation fused into a library (YNN) reduction
    library_op: float = dataclasses.field(default_factory=lambda: _table().get("library_op", 0.3))
    #: price whole programs as XLA fuses them (:meth:`program`); ``False`` sums node costs only
    fusion: bool = True
    #: the fixed cost of one call of a compiled program, of each buffer it takes or returns (``calibrate.py``'s
    #: ``measure_call``), and ``dispatch`` more where XLA's client runs it on a worker thread (``cost/dispatch.py``):
    #: part of a predicted speed-up (:meth:`fixed`, ``Report.predicted_speedup``), where it dominates small programs,
    #: never of the price extraction compares (only ``dispatch`` differs between programs, and for small ones only).
    call: float = dataclasses.field(default_factory=lambda: _table().get("call", 0.0))
    buffer: float = dataclasses.field(default_factory=lambda: _table().get("buffer", 0.0))
    dispatch: float = dataclasses.field(default_factory=lambda: _table().get("dispatch", 0.0))
    #: the least saving, as a fraction of the input program's price (fixed costs left out), for
    #: which the rewritten program is used; below it the input program is kept, since a smaller
    #: saving is within the model's error (a program predicted a few per cent faster may measure
    #: the same). The default, 0, keeps any saving: the built-in packs' small rewrites (``square`` for
    #: ``integer_pow``, a folded constant), which the golden files show, are kept. Set it for
    #: production use, e.g. ``AnalyticCost(min_saving=0.03)``.
    min_saving: float = 0.0

    def __post_init__(self) -> None:
        check_memory_budget(self.memory_budget)

    def spilled(self, avals: Any) -> float:
        """What moving these arrays once costs beyond ``byte`` per byte: ``spill`` per byte of each beyond
        ``cache`` (an array that outgrows the last-level cache streams from memory) and ``tier`` beyond ``near``
        (``rewrite/cost/spill.py``'s ``spilled``); 0 without the term.

        >>> import jax.numpy as jnp
        >>> from jax.core import ShapedArray
        >>> from rewrite import AnalyticCost
        >>> m = AnalyticCost(cache=1000.0, spill=0.5)
        >>> m.spilled([ShapedArray((100,), jnp.float32)]), m.spilled([ShapedArray((1000,), jnp.float32)])
        (0.0, 1500.0)
        >>> AnalyticCost(cache=1000.0, spill=0.5, near=100.0, tier=0.1).spilled([ShapedArray((1000,), jnp.float32)])
        1890.0
        """
        return sum(_spilled(nbytes(a), self.cache, self.spill, self.near, self.tier) for a in avals)

    def fixed(self, buffers: int, program: Any = None) -> float:
        """The fixed cost of calling a program of ``buffers`` arrays in and out; with the ``program``, ``dispatch`` more
        where XLA:CPU runs it on a worker thread (``cost/dispatch.py``: ``AnalyticCost(call=3e3).fixed(0)`` is 3000)."""
        return self.call + self.buffer * buffers + (dispatched(self.dispatch, program) if program is not None else 0.0)

    def elementwise(self, op: str, family: str, params: Mapping[str, Any] | None = None) -> float:
        """Nanoseconds per element of ``op`` inside a fused loop.

        Arithmetic too cheap to measure apart from noise (XLA's cheap
        operations) is counted in ``flop``: one each, and ``integer_pow`` one
        more than its multiplications (it is never cheaper than writing them
        out). The rest is priced as measured.
        """
        spec = BY_PRIM.get(op, _OPAQUE_SPEC)
        if spec.unrolled is not None:
            muls, divs = spec.unrolled(params or {})
            return self.flop * (muls + 1) + divs * self.ops.get("div", self.flop)
        if spec.cheap:
            return self.flop
        found = self.ops.get(op)
        if found is not None:
            return found
        return self.transcendental if family == _primitives.TRANSCENDENTAL else self.flop

    def __call__(self, n: NodeInfo) -> float:
        if n.op in IN_PLACE and len(n.in_avals) > IN_PLACE[n.op]:
            return self._in_place(n)
        spec = BY_PRIM.get(n.op)
        if spec is not None and spec.price is not None and n.family == spec.family:
            return self.node + spec.price(self, n)
        return _BY_FAMILY.get(n.family, AnalyticCost._opaque)(self, n)

    def _special(self, n: NodeInfo) -> float:
        if n.op == "proj" and n.index is not None:
            of = _primitives.BY_PRIM.get(n.of or "")
            if of is not None and of.stacks is not None and of.stacks(n.params, n.index):
                out = n.out_avals[0]  # the stacked output is written
                return self.node + (self.byte + self.stacked) * nbytes(out) + self.spilled((out,))
        return 0.0

    def _pointwise(self, n: NodeInfo) -> float:
        per = self.elementwise(ns_key(n.op, n.out_avals), n.family, n.params)
        elems = sum(size(a) for a in n.out_avals)
        if self.loop_serial != 1.0 and elems < self.loop_parallel_at:
            per *= self.loop_serial  # a loop too small to split: one core (a loop body's operations are priced here)
        return self.node + per * elems

    def _layout(self, n: NodeInfo) -> float:
        return self.node + 0.05 * self.flop * sum(size(a) for a in n.out_avals)

    def _written(self, n: NodeInfo) -> float:
        return self.node + self.byte * sum(nbytes(a) for a in n.out_avals) + self.spilled(n.out_avals)

    def _reduce(self, n: NodeInfo) -> float:
        read = sum(nbytes(a) for a in n.in_avals)
        if self.reduce_cached is not None and read <= self.cache and library_reduction(n.op, n.in_avals):
            return self.node + self.reduce_cached * sum(size(a) for a in n.in_avals)  # (spill.py's cached_reduction)
        return self.node + self.reduce * sum(size(a) for a in n.in_avals) + self.byte * read + self.spilled(n.in_avals)

    def dot_rate(self, flops: float) -> float:
        """Nanoseconds per flop of a product of ``flops`` flops: ``dot_parallel`` from ``dot_parallel_at`` flops
        (a product large enough to run on every core), ``dot`` below.

        >>> from rewrite import AnalyticCost
        >>> m = AnalyticCost(dot=0.01, dot_parallel=0.005, dot_parallel_at=1e8)
        >>> m.dot_rate(5e7), m.dot_rate(2e8)
        (0.01, 0.005)
        """
        return self.dot_parallel if flops >= self.dot_parallel_at else self.dot

    def _contract(self, n: NodeInfo, rate: float | None = None) -> float:
        flops = _dot_flops(n)
        rate = self.dot_rate(flops) if rate is None else rate
        if not library_dot(n.params, n.in_avals):
            flops = self.dot_fallback * flops + self.dot_repack * size(n.in_avals[0])
        # An operand XLA copies into the product's canonical layout first is read and written once more
        # (``cost/dot.py``'s ``copied``).
        # One whose copy moves its minor-most dimension (``turns``) at ``transpose_copy`` down a page-multiple
        # stride, ``transpose_strided`` down any other (each where the table has it).
        copied = dot_copied(n.params, n.in_avals)
        per = {ALIASED: self.transpose_copy, STRIDED: self.transpose_strided}
        turns = [per.get(t) for t in dot_turns(n.params, n.in_avals)] if any(per.values()) else [None, None]
        moved = [a for a, c in zip(n.in_avals, copied) if c]
        turned = [(a, t) for a, t in zip(n.in_avals, turns) if t is not None]
        copies = [a for a, c, t in zip(n.in_avals, copied, turns) if c and t is None]
        # Its output spills like any array; its operands do not: a library product reads them tile by tile,
        # each tile many times from the cache.
        return (self.node + rate * flops + self.byte * (sum(nbytes(a) for a in n.in_avals) + nbytes(n.out_avals[0]))
                + self.spilled(n.out_avals[:1]) + 2.0 * (self.byte * sum(nbytes(a) for a in copies)
                                                        + self.spilled(moved))
                + sum(t * size(a) for a, t in turned))

    def _in_place(self, n: NodeInfo) -> float:
        # reads the update and the indices, writes the update into the buffer it is given
        update = n.in_avals[IN_PLACE[n.op]]
        moved = 2 * nbytes(update) + sum(nbytes(a) for a in n.in_avals[1:IN_PLACE[n.op]])
        return self.node + self.flop * size(update) + self.byte * moved + self.spilled((update,))

    def _nested(self, n: NodeInfo) -> float:
        return self.node + sum(n.body_costs)  # a call (jit, shard_map): what its bodies cost

    def _opaque(self, n: NodeInfo) -> float:
        inner = inner_jaxpr(n.params) if n.family == _primitives.OPAQUE else None
        if inner is not None:
            # a call XLA inlines (custom_jvp_call, custom_vjp_call, remat): what its body costs
            return self.node + self._body(inner)
        # opaque or effectful: it reads its operands and writes its results
        out = n.out_avals
        return self.node + self.flop * sum(size(a) for a in out) + self.byte * (
            sum(nbytes(a) for a in n.in_avals) + sum(nbytes(a) for a in out)) + self.spilled((*n.in_avals, *out))

    def _body(self, jaxpr: Any) -> float:
        total = 0.0
        for e in jaxpr.eqns:
            family = _primitives.family_of(e.primitive.name)
            if family == _primitives.NESTED:
                family = _primitives.OPAQUE  # a nested call's bodies are priced through inner_jaxpr
            total += self(NodeInfo(e.primitive.name, family, e.params, tuple(v.aval for v in e.invars),
                                   tuple(v.aval for v in e.outvars)))
        return total

    @property
    def prices_programs(self) -> bool:  # type: ignore[override]
        return self.fusion

    def fusion_model(self) -> FusionModel:
        """The whole-program model with this model's prices (see ``rewrite/cost/fusion.py``)."""
        fm = FusionModel(self.ops, byte=self.byte, cache=self.cache, spill=self.spill, reduce=self.reduce,
                         near=self.near, tier=self.tier, scores_cached=self.scores_cached, launch=self.launch,
                         default=self.transcendental, cheap=self.flop, node=self.node,
                         library_op=self.library_op, tiebreak=self._op_price, memory=self.memory,
                         budget=self.memory_budget, fresh=self.fresh, fresh_at=self.fresh_at,
                         held=fresh_peak,
                         parallel=self.loop_parallel, parallel_at=self.loop_parallel_at, chain=self.chain,
                         serial=self.loop_serial, loop_launch=self.loop_launch, loop_library=self.loop_launch_library,
                         loop_split=self.loop_split, overlap=self.overlap, loop_bytes=self.loop_bytes,
                         while_trips=self.while_trips, reduce_cached=self.reduce_cached,
                         kernel_product=(self._kernel_product if self.attention_dot is not None
                                         and (self.attention_dot != self.dot or self.dot_parallel_at != math.inf)
                                         else None))
        fm.inner = InnerPeak(fm)
        fm.keeps_facts = type(self) is AnalyticCost  # (its node prices are kept by node key: cost/prices.py)
        return fm

    def predict_temp_bytes(self, closed: Any, users: bool = False) -> int:
        """The predicted ``memory_analysis().temp_size_in_bytes`` of a ``ClosedJaxpr`` compiled for this
        backend (``rewrite/cost/memory.py``; ``users``: in the order of XLA's lists of users, ``scheduled_peak``).

        >>> import jax, jax.numpy as jnp
        >>> from rewrite import AnalyticCost
        >>> x = jnp.ones((1024, 1024))
        >>> f = lambda x: jnp.exp(x) @ x                       # exp(x) is stored for the product
        >>> compiled = jax.jit(f).lower(x).compile().memory_analysis().temp_size_in_bytes
        >>> AnalyticCost().predict_temp_bytes(jax.make_jaxpr(f)(x)) == compiled
        True
        """
        return self._replayed(without_dead(closed), users)[0]

    def _replayed(self, live: Any, users: bool = False) -> tuple[int, Any, Any, Any, Any]:
        """:meth:`predict_temp_bytes`'s replay of a program's kernels as XLA simplifies it (``live``: the program
        without its dead code, ``memory.without_dead``): ``(the peak, the fusion model, the simplified jaxpr, its
        program, its kernels)``, the kernels unpriced (``memory.kernel_layout``: a peak reads no price); the peak in
        XLA's users' order where ``users``."""
        fusion = self.fusion_model()
        fusion.tiebreak = None  # sizes only: no node prices (a loop's would need its body's)
        simple = xla_simplified(live)
        prog = Program.from_jaxpr(simple, None)
        kernels = kernel_layout(fusion, prog)
        return scheduled_peak(prog, kernels, fusion.inner, users=users), fusion, simple, prog, kernels

    def predict_peaks(self, closed: Any) -> tuple[int, int]:
        """``(predict_temp_bytes(closed), charged)``: the temporaries the backend allocates, and the kernels' peak of
        temporaries that ``closed``'s whole-program price charges ``memory`` per byte of (``cost/fusion.py``'s
        ``peak_temp_bytes``), from one replay of its kernels where XLA's simplifier stores nothing else. The lean
        band takes the charge off a price to compare times (``rewrite/extract/lean.py``'s ``time_price``).

        >>> import jax, jax.numpy as jnp
        >>> from rewrite import AnalyticCost
        >>> x = jnp.ones((1024, 1024))
        >>> closed = jax.make_jaxpr(lambda x: jnp.exp(x) @ x)(x)
        >>> AnalyticCost().predict_peaks(closed) == (AnalyticCost().predict_temp_bytes(closed), 4 * 2 ** 20)
        True
        """
        live = without_dead(closed)
        held, fusion, simple, prog, kernels = self._replayed(live)
        if simple is not live:  # the price reads the program as written (what its outputs read)
            prog = Program.from_jaxpr(live, None)
            kernels = kernel_layout(fusion, prog)
        return held, peak_temp_bytes(prog, kernels, fusion.inner)

    def _kernel_product(self, op: Any) -> float:
        """A product's price inside one attention kernel: at ``attention_dot`` per flop (kept in its memo), where the
        model sets a rate of its own for them."""
        memo = op.memo
        key = ("kernel_product", id(self))
        if memo is not None and key in memo:
            return memo[key]
        found = self._contract(NodeInfo(op.prim, op.family, op.params, op.in_avals, op.out_avals), rate=self.attention_dot)
        if memo is not None:
            memo[key] = found
        return found

    def _op_price(self, op: Any) -> float:
        if op.family == _primitives.NESTED and op.own:
            return op.own  # its node price with its bodies' (Program.from_choice): a NodeInfo alone has none
        key = op.memo.get(NODE_KEY) if op.memo and type(self) is AnalyticCost else None  # (kept: cost/prices.py)
        return price_of(self, key, lambda: self(NodeInfo(op.prim, op.family, op.params, op.in_avals, op.out_avals)))

    @functools.cached_property
    def _fusion(self) -> FusionModel:
        return self.fusion_model()

    def program(self, prog: Any) -> float:
        """The predicted cost of a whole program (a :class:`rewrite.cost.program.Program`), fusion included."""
        return self._fusion(prog)

    def program_fusion(self) -> FusionModel | None:
        """The fusion model :meth:`program` prices with, or ``None`` where a subclass prices programs its own way.

        The extractor's search uses it to price a program move by move
        (``rewrite.cost.live.LiveFusion``) instead of whole for every move.
        """
        return self._fusion if type(self).program is AnalyticCost.program and self.prices_programs else None


def _dot_flops(n: NodeInfo) -> float:
    return contraction_flops(n.params["dimension_numbers"], n.in_avals[0], n.out_avals[0])


#: How :class:`AnalyticCost` prices a node of each family, unless its record has a ``price`` hook.
_BY_FAMILY: dict[str, Callable[[AnalyticCost, NodeInfo], float]] = {
    _primitives.SPECIAL: AnalyticCost._special,
    _primitives.ELEMENTWISE: AnalyticCost._pointwise,
    _primitives.TRANSCENDENTAL: AnalyticCost._pointwise,
    _primitives.LAYOUT: AnalyticCost._layout,
    _primitives.TRANSPOSE: AnalyticCost._written,
    _primitives.REDUCE: AnalyticCost._reduce,
    _primitives.CONTRACT: AnalyticCost._contract,
    _primitives.INDEX: AnalyticCost._written,
    _primitives.NESTED: AnalyticCost._nested,
    _primitives.OPAQUE: AnalyticCost._opaque,
}

_DEFAULTS: dict[int, tuple[Mapping[str, Any], AnalyticCost]] = {}


def default_model() -> AnalyticCost:
    """The model ``cost_model=None`` means: ``AnalyticCost()`` over the table in force (:func:`_table`),
    made once per table."""
    table = _table()
    found = _DEFAULTS.get(id(table))
    if found is None or found[0] is not table:
        found = _DEFAULTS[id(table)] = (table, AnalyticCost())
    return found[1]


_warned: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _outside_package() -> int:
    """The stack level of the first caller outside this package (where a warning should point)."""
    here = os.path.dirname(os.path.dirname(__file__))  # the rewrite package, not this folder
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(here):
        frame, level = frame.f_back, level + 1
    return level


def as_cost_model(model: Any) -> CostModel:
    """``model`` as a :class:`CostModel`: a plain function becomes a node price alone (:class:`NodeCost`),
    with a warning, once per function, that whole-program pricing is off."""
    if isinstance(model, CostModel):
        return model
    if not callable(model):
        raise ValueError(f"cost_model= must be None, 'analytic', 'measure' or a CostModel (or a function "
                         f"NodeInfo -> float), got {model!r}")
    try:
        first = model not in _warned
        _warned.add(model)
    except TypeError:  # not weakly referable: warn every time
        first = True
    if first:
        warnings.warn(f"cost_model={getattr(model, '__qualname__', model)} is a plain function: it prices nodes "
                      "only, so whole-program (fusion) pricing is off. Pass NodeCost(fn) to say that is meant, or "
                      "subclass AnalyticCost to keep whole-program pricing.", UserWarning,
                      stacklevel=_outside_package())
    return NodeCost(model)
