"""Calibrate the cost model against this backend: what one element of each operation costs, measured.

Prints, and with ``--write`` stores in ``rewrite/cost/calibration.json``, the
table :class:`rewrite.AnalyticCost` and the fusion model read: nanoseconds
per element for each elementwise primitive computed inside a fused loop,
for ``sin`` and ``cos`` of one argument in the same loop (LLVM merges them),
nanoseconds per byte that a fusion reads or writes, per element that a
reduction reads, per flop of a matrix product, and the fixed cost of
launching one fused kernel, and the fixed cost of calling a compiled program:
per call and per input or output buffer (``measure_call``), which no
rewrite removes and which dominates small programs, what a loop costs
per trip beyond its body's kernels (``measure_loop``; ``--loop-only``
measures and stores it alone), and on a CPU how large an array may be and
stay in the last-level cache and what each byte past that costs more
(``measure_cache``; ``--cache-only``), and what a byte of a buffer the C library maps
fresh for each call costs, from what size (``measure_fresh``; ``--fresh-only``).

Every figure is a difference of two programs timed side by side in one
process (``benchmarks/harness.py``): ``op(x) + 1`` against ``x + 1`` on the
same 4M-element array, so memory traffic cancels and what is left is the
operation's arithmetic. Run it on an idle machine, holding the benchmark
lock::

    flock /tmp/bench.lock python -m benchmarks.calibrate --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.harness import _run_once, interleaved
from rewrite.cost.dispatch import DISPATCH_FLOPS

MIN_NS = 0.01  # the least an elementwise operation is priced at (CPU)


def _sizes() -> tuple[int, int]:
    """Elements per array, and how many times each operation is applied per element.

    On a CPU, 4M float32 elements (16 MiB) exceed the caches and one application of an
    operation shows above the noise. A GPU's L2 holds 50 MB or more and its arithmetic is
    a hundred times faster than its memory: arrays of 64M elements (256 MiB), and each
    operation applied 32 times to distinct arguments in one fused kernel, so its arithmetic
    is seen above the memory traffic.
    """
    if jax.default_backend() == "cpu":
        return 1 << 22, 1
    return 1 << 26, 32


N, REPEAT = _sizes()

#: primitive -> (function of x, input domain) where the domain is "any", "pos" or "unit".
ELEMENTWISE = {
    "add": (lambda x: x + x * 0.5, "any"),
    "mul": (lambda x: x * x, "any"),
    "neg": (lambda x: -x, "any"),
    "max": (lambda x: jnp.maximum(x, 0.25), "any"),
    "abs": (lambda x: jnp.abs(x), "any"),
    "sign": (lambda x: jnp.sign(x), "any"),
    "floor": (lambda x: jnp.floor(x), "any"),
    "round": (lambda x: jnp.round(x), "any"),
    "select_n": (lambda x: jnp.where(x > 0, x, 0.5 * x), "any"),
    "integer_pow": (lambda x: x ** 3, "any"),
    "div": (lambda x: 1.5 / x, "pos"),
    "rem": (lambda x: jnp.fmod(x, 0.75), "any"),
    "sqrt": (lambda x: jnp.sqrt(x), "pos"),
    "rsqrt": (lambda x: lax.rsqrt(x), "pos"),
    "cbrt": (lambda x: jnp.cbrt(x), "any"),
    "exp": (lambda x: jnp.exp(x), "any"),
    "exp2": (lambda x: jnp.exp2(x), "any"),
    "log": (lambda x: jnp.log(x), "pos"),
    "log1p": (lambda x: jnp.log1p(x), "pos"),
    "expm1": (lambda x: jnp.expm1(x), "any"),
    "tanh": (lambda x: jnp.tanh(x), "any"),
    "logistic": (lambda x: lax.logistic(x), "any"),
    "sin": (lambda x: jnp.sin(x), "any"),
    "cos": (lambda x: jnp.cos(x), "any"),
    "tan": (lambda x: jnp.tan(x), "unit"),
    "asin": (lambda x: jnp.arcsin(x), "unit"),
    "acos": (lambda x: jnp.arccos(x), "unit"),
    "atan": (lambda x: jnp.arctan(x), "any"),
    "sinh": (lambda x: jnp.sinh(x), "unit"),
    "cosh": (lambda x: jnp.cosh(x), "unit"),
    "asinh": (lambda x: jnp.arcsinh(x), "any"),
    "acosh": (lambda x: jnp.arccosh(x + 1.5), "pos"),
    "atanh": (lambda x: jnp.arctanh(x * 0.5), "unit"),
    "erf": (lambda x: lax.erf(x), "any"),
    "erfc": (lambda x: lax.erfc(x), "any"),
    "erf_inv": (lambda x: lax.erf_inv(x * 0.5), "unit"),
    "lgamma": (lambda x: lax.lgamma(x), "pos"),
    "digamma": (lambda x: lax.digamma(x), "pos"),
    "pow": (lambda x: x ** (x * 0.5), "pos"),
    "atan2": (lambda x: jnp.arctan2(x, 0.75), "any"),
    "sincos": (lambda x: jnp.sin(x) * jnp.cos(x), "any"),
    "sinhcosh": (lambda x: jnp.sinh(x) * jnp.cosh(x), "unit"),
    # exp of complex numbers (rewrite.cost.fusion.ns_key); a real part that XLA cannot fold away
    "exp_complex": (lambda x: (lambda z: z.real * z.imag)(jnp.exp(lax.complex(x * 0.5, x))), "any"),
}

#: Ops whose calibration program needs more than the op itself (a multiply here).
_EXTRA_MUL = {"sincos", "sinhcosh", "exp_complex"}


def _inputs(domain: str) -> jax.Array:
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (N,), jnp.float32)
    if domain == "pos":
        return jnp.abs(x) + 0.5
    if domain == "unit":
        return jnp.tanh(x) * 0.9
    return x * 1.5  # sin/cos arguments in the range the seed programs see


def _paired(variants: dict, args: tuple, base: str, rounds: int, progress: bool) -> dict[str, float]:
    """Seconds per call of each variant minus the base's, each the fastest of ``rounds`` runs.

    On a shared machine other users slow some runs by 2-3x, and by more for
    arithmetic than for memory traffic; the fastest run of each program,
    with the base timed between every other run, is the closest to what the
    machine does alone.
    """
    compiled = {n: jax.jit(f).lower(*args).compile() for n, f in variants.items()}
    inner = {}
    for n, c in compiled.items():
        for _ in range(2):
            _run_once(c, args, 1)
        inner[n] = max(1, int(0.01 / max(_run_once(c, args, 1), 1e-6)))
    times: dict[str, list[float]] = {n: [] for n in variants}
    for r in range(rounds):
        for n in variants:
            if n == base:
                continue
            times[base].append(_run_once(compiled[base], args, inner[base]))
            times[n].append(_run_once(compiled[n], args, inner[n]))
        if progress:
            print(f"round {r + 1}/{rounds}", file=sys.stderr)
    # The fastest of many runs is the least disturbed by other users: it estimates the machine's own cost.
    fastest = {n: min(t) for n, t in times.items()}
    return {n: fastest[n] - fastest[base] for n in variants if n != base}


def measure_ops(rounds: int, progress: bool) -> dict[str, float]:
    """ns per element of each primitive inside a fused loop, net of reading and writing the array."""
    args = (_inputs("any"), _inputs("pos"), _inputs("unit"))
    slot = {"any": 0, "pos": 1, "unit": 2}
    # Each of REPEAT applications gets its own argument (x + k/1024), so XLA cannot share them;
    # the base program does the same additions without the operation.
    shifts = [k / 1024.0 for k in range(REPEAT)]

    def applied(f: Callable, i: int) -> Callable:
        def program(*xs: jax.Array) -> jax.Array:
            x = xs[i]
            if REPEAT == 1:
                return f(x) + 1.0
            return sum(f(x + s) for s in shifts)
        return program

    variants = {"base": applied(lambda x: x, 0)}
    for n, (fn, dom) in ELEMENTWISE.items():
        variants[n] = applied(fn, slot[dom])
    net = _paired(variants, args, "base", rounds, progress)
    # Cheap operations cost less than the noise; a floor keeps them above zero, so fewer is still better.
    floor = MIN_NS if REPEAT == 1 else MIN_NS / 100
    return {n: max(t / (N * REPEAT) * 1e9, floor) for n, t in net.items()}


#: Pairs of transcendentals of one argument that XLA:CPU might compute from shared work, each as the calibration
#: table's key for the pair in one loop (``rewrite/cost/transcendental.py``'s ``SHARED`` prices those it names) -> its
#: two members, as functions of ``x``. The rest are checked and found apart: ``exp`` beside ``cosh``/``sinh`` (their
#: ``exp(x - ln 2)`` is not ``exp(x)``), ``tanh`` (a rational function of its own) beside ``exp`` or ``cosh``,
#: ``expm1`` beside ``exp``; ``logistic(x)`` is ``1 / (1 + exp(-x))``, which shares its ``exp`` with an ``exp(-x)``
#: (read through a ``neg``, which the fusion model's groups of one argument do not follow).
SHARED_CANDIDATES: dict[str, tuple[tuple[str, Callable], tuple[str, Callable]]] = {
    "sincos": (("sin", jnp.sin), ("cos", jnp.cos)),
    "sinhcosh": (("sinh", jnp.sinh), ("cosh", jnp.cosh)),
    "exp_cosh": (("exp", jnp.exp), ("cosh", jnp.cosh)),
    "exp_sinh": (("exp", jnp.exp), ("sinh", jnp.sinh)),
    "exp_tanh": (("exp", jnp.exp), ("tanh", jnp.tanh)),
    "tanh_cosh": (("tanh", jnp.tanh), ("cosh", jnp.cosh)),
    "exp_expm1": (("exp", jnp.exp), ("expm1", jnp.expm1)),
    "logistic_expneg": (("logistic", lax.logistic), ("exp(-x)", lambda x: jnp.exp(-x))),
}

#: ns per element both members of a pair must cost alone for a timing to show that they share (:func:`measure_shared`).
TIMED_SHARING_NS = 1.0

#: XLA's elementwise instructions that cost more than arithmetic, as the compiled HLO names them.
_COSTLY_HLO = ("exponential-minus-one", "exponential", "log-plus-one", "log", "tanh", "logistic", "sine", "cosine",
               "divide", "power", "sqrt", "rsqrt", "cbrt", "atan2")


def costly_instructions(f: Callable, n: int = 1 << 16) -> int:
    """How many of :data:`_COSTLY_HLO` the compiled program of ``f`` on ``n`` float32 elements evaluates per element:
    a pair computed from shared work evaluates fewer than its two members apart."""
    text = jax.jit(f).lower(jax.ShapeDtypeStruct((n,), jnp.float32)).compile().as_text()
    names = "|".join(re.escape(h) for h in _COSTLY_HLO)
    return len(re.findall(r"f32\[" + str(n) + r"\](?:\{[0-9,]*\})? (?:" + names + r")\(", text))


def measure_shared(rounds: int, progress: bool) -> dict[str, dict[str, Any]]:
    """Which of :data:`SHARED_CANDIDATES` XLA:CPU computes from shared work, and what the pair costs in one loop.

    Per pair: the costly instructions of each member alone and of the two together (read from the compiled programs,
    nothing timed: ``sinh`` and ``cosh`` 4 and 2 alone, 4 together), and ns per element of each member alone and of
    the pair (``m1(x) * m2(x) + 1`` against ``x + 1``, as :func:`measure_ops`), timed in one process; ``ratio`` is the
    pair's time over its dearer member's. A pair shares where it evaluates fewer instructions than its members apart,
    or (``sin``/``cos``: LLVM merges them after XLA) where together it costs less than the cheaper member more than
    the dearer one alone (``saved`` over half the cheaper member's time), judged so only where both members cost
    :data:`TIMED_SHARING_NS` or more alone: a cheaper one hides under the loop's memory traffic (``exp``, 0.01-0.3 ns),
    and is then as free beside any other member as beside one it shares with.
    """
    x = _inputs("any")
    variants: dict[str, Callable] = {"base": lambda x: x + 1.0}
    for name, ((a, fa), (b, fb)) in SHARED_CANDIDATES.items():
        variants.setdefault(a, lambda x, f=fa: f(x) + 1.0)
        variants.setdefault(b, lambda x, f=fb: f(x) + 1.0)
        variants[name] = lambda x, f=fa, g=fb: f(x) * g(x) + 1.0
    net = _paired(variants, (x,), "base", rounds, progress)
    ns = {k: max(t / N * 1e9, MIN_NS) for k, t in net.items()}
    out = {}
    for name, ((a, fa), (b, fb)) in SHARED_CANDIDATES.items():
        apart = costly_instructions(fa) + costly_instructions(fb)
        together = costly_instructions(lambda x, f=fa, g=fb: f(x) * g(x))
        dear, cheap = sorted((ns[a], ns[b]), reverse=True)
        saved = (ns[a] + ns[b] - ns[name]) / cheap
        out[name] = {"members": [a, b], "instructions_apart": apart, "instructions_together": together,
                     "ns": {a: ns[a], b: ns[b], name: ns[name]}, "ratio": ns[name] / dear, "saved": saved,
                     "shares": together < apart or (cheap >= TIMED_SHARING_NS and saved > 0.5)}
    return out


def shared_prices(found: dict[str, dict[str, Any]], table: dict[str, float], groups: Any) -> dict[str, float]:
    """The price of each pair of ``groups`` found to share, on the scale of ``table`` (an ``elementwise_ns`` table):
    its dearer member's price there times the measured ratio of the pair to that member (the ratio, not the time, is
    what one run on a shared machine measures well), and never below that member's price: the pair computes all it
    does."""
    prices = {}
    for name in groups:
        f = found.get(name)
        if f is None or not f["shares"]:
            continue
        a, b = f["members"]
        dear = a if f["ns"][a] >= f["ns"][b] else b
        if dear in table:
            prices[name] = round(table[dear] * max(f["ratio"], 1.0), 4)
    return prices


def _pos(x: jax.Array) -> jax.Array:
    return jnp.abs(x) + 0.5


#: Chains of two transcendentals in one loop, the second reading the first's result: name -> (first, second, the
#: chain), each a function of ``x`` (``_pos`` keeps a ``log``'s argument positive in every form).
CHAINS: dict[str, tuple[Callable, Callable, Callable]] = {
    "log_cosh": (jnp.cosh, lambda x: jnp.log(_pos(x)), lambda x: jnp.log(2.0 * jnp.cosh(x))),
    "log_exp": (jnp.exp, lambda x: jnp.log(_pos(x)), lambda x: jnp.log(jnp.exp(x) + 0.5)),
    "log1p_exp": (jnp.exp, lambda x: jnp.log1p(_pos(x)), lambda x: jnp.log1p(jnp.exp(x))),
    "exp_log": (lambda x: jnp.log(_pos(x)), lambda x: jnp.exp(0.5 * x), lambda x: jnp.exp(0.5 * jnp.log(_pos(x)))),
    "tanh_log": (lambda x: jnp.log(_pos(x)), jnp.tanh, lambda x: jnp.tanh(jnp.log(_pos(x)))),
    "exp_exp": (lambda x: jnp.exp(0.1 * x), jnp.exp, lambda x: jnp.exp(jnp.exp(0.1 * x))),
}


def measure_chain(rounds: int, progress: bool) -> dict[str, Any]:
    """What a loop pays more where one transcendental reads another's result than for the two apart (``chain``).

    Per pair of :data:`CHAINS`: ns per element of each function alone, of the two side by side in one loop (``f(x) +
    g(x)``, neither reading the other) and of the chain (``g(f(x))``), each ``... + 1`` against ``x + 1`` as
    :func:`measure_ops`, in one process. The model prices a loop at its members' prices summed; a chain's excess over
    that sum, as a share of it, is what a chain pays more (``rewrite/cost/transcendental.py``'s ``chained``): ``chain``
    is its median over the pairs. Side by side they cost about their sum, so the excess is the waiting, not the work.
    """
    x = _inputs("any")
    variants: dict[str, Callable] = {"base": lambda x: x + 1.0}
    for name, (f, g, fg) in CHAINS.items():
        variants[f"{name}:first"] = lambda x, f=f: f(x) + 1.0
        variants[f"{name}:second"] = lambda x, g=g: g(x) + 1.0
        variants[f"{name}:apart"] = lambda x, f=f, g=g: f(x) + g(x) + 1.0
        variants[f"{name}:chain"] = lambda x, fg=fg: fg(x) + 1.0
    net = _paired(variants, (x,), "base", rounds, progress)
    ns = {k: t / N * 1e9 for k, t in net.items()}
    pairs = {}
    for name in CHAINS:
        alone = max(ns[f"{name}:first"], MIN_NS) + max(ns[f"{name}:second"], MIN_NS)
        pairs[name] = {"alone": alone, "apart": ns[f"{name}:apart"], "chain": ns[f"{name}:chain"],
                       "excess": (ns[f"{name}:chain"] - alone) / alone}
    return {"chain": max(statistics.median(p["excess"] for p in pairs.values()), 0.0), "pairs": pairs}


def measure_memory(rounds: int, progress: bool) -> dict[str, float]:
    """ns per byte a fused loop moves, per element a reduction reads, per flop of a dot, per extra kernel."""
    x = _inputs("any")
    y, z = x * 0.5, x * 0.25
    lead = (64, N // 64 // 64, 64)
    big = _paired({
        "copy": lambda a, b, c: a + 1.0,                        # reads 4 bytes, writes 4
        "two_in": lambda a, b, c: a * b + 1.0,                  # reads 8, writes 4
        "three_in": lambda a, b, c: a * b + c,                  # reads 12, writes 4
        "reduce_lead": lambda a, b, c: a.reshape(lead).sum((0, 1)),
        "reduce_lead2": lambda a, b, c: (a * b).reshape(lead).sum((0, 1)),
        "reduce_lead5": lambda a, b, c: (((a * b + a) * b - a) * b).reshape(lead).sum((0, 1)),
        "reduce_bcast": lambda a, b, c: (a.reshape(lead) * b[:64]).sum((0, 1)),
        "reduce_read": lambda a, b, c: a.reshape(lead).sum((0, 1)),
        "none": lambda a, b, c: a[:8] + 1.0,
    }, (x, y, z), "none", rounds, progress)
    byte = (big["three_in"] - big["copy"]) / (8 * N)
    # A kernel more: seventeen chained 8x8 products (one kernel each) against one.
    tiny = jnp.eye(8) * 0.5

    def chain(m: jax.Array, n: int) -> jax.Array:
        out = m
        for _ in range(n):
            out = out @ m
        return out

    launches = _paired({"one": lambda a: chain(a, 1), "sixteen": lambda a: chain(a, 16)}, (tiny,), "one", rounds, False)
    mm = jax.random.normal(jax.random.PRNGKey(1), (512, 512))
    dot = _paired({"none": lambda a: a[0, :8], "dot": lambda a: a @ a}, (mm,), "none", max(3, rounds // 3), False)
    return {
        "byte": max(byte * 1e9, 0.0),
        "copy_per_element": big["copy"] / N * 1e9,
        "reduce_per_element": max(big["reduce_lead2"] - big["two_in"], 0.0) / N * 1e9,
        "reduce_read_per_element": big["reduce_lead"] / N * 1e9,
        # A library (YNN) reduction runs its fused operations tile by tile: each costs about a pass over L1.
        "library_op": max(big["reduce_lead5"] - big["reduce_lead2"], 0.0) / (4 * N) * 1e9,
        "library_broadcast": max(big["reduce_bcast"] - big["reduce_read"], 0.0) / N * 1e9,
        "launch": max(launches["sixteen"] / 15 * 1e9, 0.0),
        "dot_flop": dot["dot"] * 1e9 / (2 * 512 ** 3),
    }


def measure_call(rounds: int, progress: bool) -> dict[str, float]:
    """ns per call of a compiled program, and per input or output buffer it takes or returns.

    Programs of scalars do (almost) no work, so their time is the dispatch:
    one input and output against eight of each gives the price of a buffer,
    and the one-buffer program less two buffers the price of a call.
    """
    xs = tuple(jnp.float32(k) for k in range(8))
    one = jax.jit(lambda a: a + 1.0).lower(xs[0]).compile()
    eight = jax.jit(lambda *a: tuple(v + 1.0 for v in a)).lower(*xs).compile()
    t1: list[float] = []
    t8: list[float] = []
    for _ in range(3):
        _run_once(one, xs[:1], 100), _run_once(eight, xs, 100)
    for r in range(max(rounds, 5)):
        t1.append(_run_once(one, xs[:1], 2000))
        t8.append(_run_once(eight, xs, 2000))
        if progress:
            print(f"call round {r + 1}", file=sys.stderr)
    # the fastest run is the least disturbed by other users
    buffer = max((min(t8) - min(t1)) / 14, 0.0)
    return {"call": max(min(t1) - 2 * buffer, 0.0) * 1e9, "buffer": buffer * 1e9}


def last_level_cache() -> int | None:
    """The bytes of this CPU's last-level cache (``/sys``, else ``sysconf``), or ``None`` where unknown."""
    best = None
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")) if base.exists() else ():
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        size = int(text.rstrip("KMG")) * scale
        if best is None or level > best[0]:
            best = (level, size)
    if best is not None:
        return best[1]
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        return None
    return size or None


def _streamed(n: int, rounds: int) -> float:
    """ns per byte that ``x + 1`` moves (read and written) on ``n`` floats, in place (donated): no fresh pages."""
    step = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = step(jnp.zeros((n,), jnp.float32))
    state = [x]

    def run() -> Any:
        state[0] = step(state[0])
        return state[0]

    state[0].block_until_ready()
    return _fastest(run, rounds, max(2, (1 << 28) // (4 * n))) / (8 * n) * 1e9


def _fastest(run: Callable[[], Any], rounds: int, reps: int) -> float:
    """The fewest seconds per call of ``run`` (which returns an array), ``reps`` calls a round, of ``max(rounds, 5)``
    rounds: :func:`_streamed`'s and :func:`_out_of_place`'s timing."""
    best = float("inf")
    for _ in range(max(rounds, 5)):
        t = time.perf_counter()
        for _ in range(reps):
            y = run()
        y.block_until_ready()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def measure_cache(rounds: int, progress: bool) -> dict[str, float]:
    """Where an array stops fitting in the last-level cache, and what each byte costs more beyond it (CPU).

    ``cache_bytes`` is half the last-level cache (an array stays there between the kernel that writes it
    and the one that reads it when that one's output fits beside it); ``spill`` is what a byte moved
    costs more streamed from memory than from the cache: ``x + 1`` in place on 256 MiB against 4 MiB. On
    this machine (32 MiB L3): 0.0115 ns per byte at 4 MiB, 0.018 at 16 MiB, 0.026 at 64 MiB and 0.030 at
    256 MiB. ``AnalyticCost.spill`` charges it per byte of an array beyond ``cache_bytes``.
    """
    llc = last_level_cache()
    small, large = _streamed(1 << 20, rounds), _streamed(1 << 26, rounds)
    if progress:
        print(f"streamed: {small:.4f} ns/B at 4 MiB, {large:.4f} at 256 MiB; LLC {llc}", file=sys.stderr)
    if llc is None:
        return {}
    return {"cache_bytes": float(llc // 2), "spill": max(large - small, 0.0), "streamed_cached": small,
            "streamed_memory": large}


#: A block of attention's scores as the blocked form reduces it (rows of 256 keys), in the cache (8 MiB: plain
#: attention's trip at N=1024, 2 x 4 x 1024 queries), and eight such blocks, streamed from memory.
REDUCED_ROW, REDUCED_CACHED, REDUCED_STREAMED = 256, 8 << 20, 64 << 20


def measure_reduce_cached(rounds: int, progress: bool, table: dict) -> dict[str, Any]:
    """What a library (YNN) row reduction costs per element over an array the cache holds, against one streamed
    from memory: ``max`` and ``sum`` over rows of 256 of 8 MiB (called again and again, it stays in the cache, as a
    block of scores the product before it wrote) and of 64 MiB, interleaved, the median of the rounds' ratios.
    ``reduce_cached`` is ``table``'s price of the streamed reduction per element (``reduce``, 4 bytes at ``byte``
    and what ``spill`` adds at 64 MiB) times the two reductions' median ratio: the table's rates are medians of
    other days, and a least time here would price in-cache reductions against them at another load."""
    prog = {"max": jax.jit(lambda x: x.max(-1)), "sum": jax.jit(lambda x: x.sum(-1))}
    arrays = {n: jax.random.normal(jax.random.PRNGKey(0), (b // 4 // REDUCED_ROW, REDUCED_ROW))
              for n, b in (("cached", REDUCED_CACHED), ("streamed", REDUCED_STREAMED))}
    inner = {"cached": 16, "streamed": 2}
    times: dict[tuple, list[float]] = {(f, a): [] for f in prog for a in arrays}
    for f in prog:
        for a in arrays:
            _run_once(prog[f], (arrays[a],), 2)
    for r in range(rounds):
        for key in times:
            f, a = key
            times[key].append(_run_once(prog[f], (arrays[a],), inner[a]) / (arrays[a].size) * 1e9)
        if progress:
            print(f"round {r + 1}/{rounds}", file=sys.stderr)
    ratios = {f: statistics.median(c / s for c, s in zip(times[(f, "cached")], times[(f, "streamed")])) for f in prog}
    cache = table.get("cache_bytes", math.inf)
    streamed = (table["reduce_per_element"] + 4 * table["byte"]
                + 4 * table.get("spill", 0.0) * max(0.0, 1.0 - cache / REDUCED_STREAMED))
    return {"ns_per_element": {f"{f} {a}": round(min(t), 4) for (f, a), t in times.items()},
            "median_ns_per_element": {f"{f} {a}": round(statistics.median(t), 4) for (f, a), t in times.items()},
            "ratio": {f: round(v, 3) for f, v in ratios.items()}, "streamed_priced": round(streamed, 4),
            "reduce_cached": streamed * statistics.median(ratios.values())}


#: The array ``measure_transpose_copy`` transposes: two 1024 x 1024 blocks (8 MiB, no buffer mapped fresh), rows of
#: 4 KiB (``rewrite/cost/dot.py``'s ``ALIASED_STRIDE``), 1024 of them (``ALIASED_ROWS``).
TRANSPOSED = (2, 1024, 1024)


def _transpose_over_copy(shape: tuple, perm: tuple, rounds: int, inner: int, progress: bool = False
                         ) -> tuple[float, dict[str, float]]:
    """``transpose(x * 2, perm)`` against ``x * 2`` on an array of ``shape``, interleaved, ``inner`` calls a timing:
    the median of the rounds' ratios and each program's median ns per element."""
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    prog = {"copy": jax.jit(lambda a: a * 2.0), "transpose": jax.jit(lambda a: jnp.transpose(a * 2.0, perm))}
    times: dict[str, list[float]] = {n: [] for n in prog}
    for f in prog.values():
        _run_once(f, (x,), 2)
    for r in range(rounds):
        for n, f in prog.items():
            times[n].append(_run_once(f, (x,), inner) / x.size * 1e9)
        if progress:
            print(f"round {r + 1}/{rounds}", file=sys.stderr)
    ratio = statistics.median(t / c for t, c in zip(times["transpose"], times["copy"]))
    return ratio, {n: round(statistics.median(t), 4) for n, t in times.items()}


def measure_transpose_copy(rounds: int, progress: bool, table: dict) -> dict[str, Any]:
    """What a copy that moves an array's minor-most dimension down a page-multiple stride costs per element
    (``AnalyticCost.transpose_copy``): ``swapaxes(x * 2)`` against ``x * 2`` on :data:`TRANSPOSED`, interleaved,
    the median of the rounds' ratios times ``table``'s ``copy_per_element`` (as ``reduce_cached``: a ratio at
    this load against the table's median rate, not a time at it)."""
    ratio, medians = _transpose_over_copy(TRANSPOSED, (0, 2, 1), rounds, 4, progress)
    return {"median_ns_per_element": medians, "ratio": round(ratio, 3),
            "transpose_copy": table["copy_per_element"] * ratio}


#: The transposes ``measure_transpose_strided`` times: strides off a page, or walks shorter than
#: ``rewrite/cost/dot.py``'s ``ALIASED_ROWS`` (its ``STRIDED`` regime), 2-8 MiB, each by the permutation given.
STRIDED_TRANSPOSES = (((2, 512, 512), (0, 2, 1)), ((8, 1024, 256), (0, 2, 1)), ((8, 256, 1024), (0, 2, 1)),
                      ((1, 4096, 128), (0, 2, 1)), ((2, 4, 1024, 64), (0, 1, 3, 2)))


def measure_transpose_strided(rounds: int, progress: bool, table: dict) -> dict[str, Any]:
    """What a copy that moves an array's minor-most dimension costs per element where it does not walk a
    page-multiple stride (``AnalyticCost.transpose_strided``): ``transpose(x * 2)`` against ``x * 2`` on each of
    :data:`STRIDED_TRANSPOSES`, interleaved, the median of the rounds' ratios at each shape; the median over the
    shapes times ``table``'s ``copy_per_element`` (as ``transpose_copy``: a ratio at this load against the table's
    median rate, not a time at it)."""
    ratios, medians = {}, {}
    for shape, perm in STRIDED_TRANSPOSES:
        ratio, medians[str(shape)] = _transpose_over_copy(shape, perm, rounds, max(2, (16 << 20) // math.prod(shape)))
        ratios[str(shape)] = round(ratio, 3)
        if progress:
            print(f"{shape}: {ratios[str(shape)]}", file=sys.stderr)
    ratio = statistics.median(ratios.values())
    return {"median_ns_per_element": medians, "ratio": ratios,
            "transpose_strided": table["copy_per_element"] * ratio}


def _fresh_and_kept(n: int, rounds: int, median: bool = False) -> tuple[float, float]:
    """ns per byte of ``x + 1``'s output on ``n`` floats: written to a buffer allocated for the call, and written
    in place (donated); each the fastest of ``rounds`` runs, or with ``median`` (:data:`AS_TIMED`) their median."""
    fresh = jax.jit(lambda a: a + 1.0)
    kept = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = jnp.zeros((n,), jnp.float32)
    y = kept(jnp.zeros((n,), jnp.float32))
    reps = max(2, (1 << 28) // (4 * n))
    times: list[list[float]] = [[], []]
    for _ in range(max(rounds, 5)):
        for k in (0, 1):
            out = fresh(x) if k == 0 else y
            out.block_until_ready()
            t = time.perf_counter()
            for _ in range(reps):
                if k == 0:
                    out = fresh(x)
                else:
                    y = out = kept(y)
            out.block_until_ready()
            times[k].append((time.perf_counter() - t) / reps)
    pick = statistics.median if median else min
    return pick(times[0]) / (4 * n) * 1e9, pick(times[1]) / (4 * n) * 1e9


#: ``--as-timed``: ``fresh`` and ``dispatch`` read as the decision corpus reads its pairs (``benchmarks/decisions.py``:
#: the median of interleaved rounds), not as the fastest round. Most of the table's figures barely move between the
#: two (a product under the cache: median 1.05x its fastest round, 2026-12-02, load 2.4), but these two are what
#: other processes on the machine change most: a fresh page is zeroed through the memory other processes share
#: (fresh's median excess 0.389 ns/B against the fastest rounds' 0.296 in the same run), and the hand-off to XLA's
#: worker thread waits for a core (0.9-7 us at the median over runs of 2026-12-02 where the fastest rounds read
#: 0.7). Priced at their fastest, the model's two terms sit under what the corpus clocks: plain attention's
#: fresh-mapped scores (predicted 1.15-1.19x, measured 1.47-1.69x) and the docs' RNN's hand-off
#: (``scan_docs_rnn_16x128``, predicted 1.03x, measured 1.75x).
AS_TIMED = ("fresh", "dispatch")


#: Buffer sizes (MiB) at which :func:`measure_fresh` compares a buffer allocated for the call with one kept.
FRESH_MIB = (8, 16, 24, 32, 48, 64, 128)


def measure_fresh(rounds: int, progress: bool, median: bool = False) -> dict[str, float]:
    """What a byte of a buffer allocated for one call costs beyond writing it, and from what size (CPU).

    XLA:CPU allocates a program's temporaries (one buffer of ``temp_size_in_bytes``) and outputs at each call. The
    C library maps an allocation above its threshold (glibc: at most 32 MiB) fresh from the system and returns it
    at free, so every page of it faults on first touch in every call; a smaller one is reused from the heap.
    ``x + 1`` into a fresh output against in place, over :data:`FRESH_MIB`: ``fresh_bytes`` is the smallest size
    measured whose bytes cost more than 0.1 ns each beyond the in-place write (three times what moving a byte costs), ``fresh`` the median excess at
    that size and above. On this machine: 0.00 ns per byte at 8-24 MiB, 0.2-0.25 from 32 MiB (a 4 KiB page
    fault is about a microsecond). ``AnalyticCost.fresh`` charges it per byte of a program's predicted peak of
    temporaries from ``fresh_bytes`` on.

    Between 32 and 64 MiB the answer is the process's history, not the size: glibc serves a request from its
    heap's free top before it maps one, and keeps up to twice its mmap threshold free there (the threshold rises
    to a freed mapping's size, at most 32 MiB, so at most 64 MiB). Counted in minor faults (``malloc``, touch,
    ``free``): 40-60 MiB fault every page in a fresh process and none after two 24 MiB blocks were held and freed;
    64 MiB and more fault every time. Timed so (2026-12-01, h-fresh): 32 MiB read 0.29-0.51 ns per byte in a
    fresh process and 0.06 after buffers of 8-24 MiB; so this mode reads 32 MiB or 64 MiB by the order it runs in.
    """
    excess = {}
    for mib in FRESH_MIB:
        fresh, kept = _fresh_and_kept(mib << 18, rounds, median)
        excess[mib] = fresh - kept
        if progress:
            print(f"{mib} MiB: fresh {fresh:.4f} ns/B, in place {kept:.4f} ns/B", file=sys.stderr)
    over = [mib for mib in FRESH_MIB if excess[mib] > 0.1]
    if not over:
        return {}
    return {"fresh_bytes": float(over[0] << 20), "fresh": statistics.median(excess[m] for m in over)}


#: Array sizes (MiB) at which :func:`measure_tier` times a kernel that reads one array and writes another.
TIER_MIB = (2, 4, 6, 8, 12, 16, 24)


def _out_of_place(n: int, rounds: int) -> float:
    """ns per byte that ``x * 0.125 + 1`` moves (read and written) on ``n`` floats into a second buffer (below the
    size whose output is mapped fresh at each call), the fastest of ``rounds`` runs."""
    step = jax.jit(lambda a: a * 0.125 + 1.0)
    x = jnp.ones((n,), jnp.float32)
    return _fastest(lambda: step(x), rounds, max(3, (1 << 27) // (4 * n))) / (8 * n) * 1e9


def measure_tier(rounds: int, progress: bool, cache: float, spill: float) -> dict[str, float]:
    """Where a kernel that reads one array and writes another as large stops finding both in its share of the
    last-level cache, and what each byte of an array past that costs more per pass (CPU): ``near_bytes``, the
    largest of :data:`TIER_MIB` whose rate is within 1.5x of the smallest sizes' (their median, ``base``);
    ``tier``, the median over the larger sizes of the excess over ``base`` less ``spill`` past ``cache``, per byte
    past ``near_bytes``. On this machine (2 cores, 1 MiB L2 each, 32 MiB L3 shared with other processes, load 8-12):
    0.013-0.015 ns per byte at 2-8 MiB, 0.033 at 12, 0.049 at 16, 0.084 at 24. ``AnalyticCost.tier``."""
    rates = {mib: _out_of_place(mib << 18, rounds) for mib in TIER_MIB}
    if progress:
        print("out of place: " + ", ".join(f"{m} MiB {r:.4f} ns/B" for m, r in rates.items()), file=sys.stderr)
    base = statistics.median(rates[m] for m in TIER_MIB[:3])
    near = max((m for m in TIER_MIB if rates[m] <= 1.5 * base), default=TIER_MIB[0])
    past = [m for m in TIER_MIB if m > near]
    if not past:
        return {}
    per = [((rates[m] - base) * (m << 21) - 2 * spill * max(0.0, (m << 20) - cache)) / (2 * ((m - near) << 20))
           for m in past]
    return {"near_bytes": float(near << 20), "tier": max(0.0, statistics.median(per))}


#: Trips of the loop whose per-trip cost :func:`measure_loop` takes.
TRIPS = 257


def measure_loop(rounds: int, progress: bool, launch: float) -> dict[str, float]:
    """ns per trip of a loop for its own bookkeeping, beyond the kernel its body runs (``iteration``).

    A ``lax.scan`` of ``TRIPS`` trips against one trip, each trip one small elementwise kernel on a carry
    of 1024 floats; the difference per extra trip, less ``launch`` (the price of that kernel), is what the
    loop itself costs: its counter and test, and on a GPU the trip's launches and the host's wait for the
    loop's predicate. ``AnalyticCost.iteration`` charges it once per trip (``rewrite/ir/primitives.py``).
    """
    x = jnp.linspace(0.0, 1.0, 1024, dtype=jnp.float32)

    def looped(trips: int) -> Callable:
        def program(c: jax.Array) -> jax.Array:
            return lax.scan(lambda c, _: (c * 0.999 + 1.0, None), c, None, length=trips)[0]
        return program

    net = _paired({"one": looped(1), "many": looped(TRIPS)}, (x,), "one", max(rounds, 5), progress)
    per_trip = net["many"] / (TRIPS - 1) * 1e9
    return {"iteration": max(per_trip - launch, 0.0), "iteration_trip": per_trip}


#: XLA:CPU's PjRt client runs a program whose flop count (``HloCostAnalysis``, what ``compiled.cost_analysis()``
#: reports) is under this on the caller's thread, and hands any other to a worker thread (``cpu_client.cc``'s
#: ``cheap_computation_``): ``rewrite/cost/dispatch.py``'s ``DISPATCH_FLOPS``.
def measure_dispatch(rounds: int, progress: bool, median: bool = False) -> dict[str, float]:
    """ns per call that a program of ``DISPATCH_FLOPS`` flops or more costs beyond one just under them
    (``dispatch``): the hand-off to the client's worker thread and back. Two programs of four flops an element,
    ``((x * 2 + 1) * 3 + 1)`` over 240 and over 256 floats (960 and 1,024 flops, their work ~10 ns apart), timed
    as the decision corpus times programs (calls back to back, the last one waited for: ``harness._run_once``).
    ``AnalyticCost.dispatch`` charges it in a call's fixed cost (``AnalyticCost.fixed``)."""
    def program(x: jax.Array) -> jax.Array:
        return (x * 2.0 + 1.0) * 3.0 + 1.0

    under, over = jnp.ones(240, jnp.float32), jnp.ones(256, jnp.float32)
    flops = [jax.jit(program).lower(v).compile().cost_analysis() for v in (under, over)]
    flops = [(f[0] if isinstance(f, list) else f).get("flops", 0.0) for f in flops]
    if not flops[0] < DISPATCH_FLOPS <= flops[1]:
        raise SystemExit(f"--dispatch-only: the two programs count {flops} flops, not either side of {DISPATCH_FLOPS}")
    compiled = {n: jax.jit(program).lower(v).compile() for n, v in (("under", under), ("over", over))}
    args = {"under": (under,), "over": (over,)}
    for n, c in compiled.items():
        _run_once(c, args[n], 200)
    times: dict[str, list[float]] = {n: [] for n in compiled}
    for r in range(max(rounds, 5)):
        for n, c in compiled.items():
            times[n].append(_run_once(c, args[n], 2000))
        if progress:
            print(f"dispatch round {r + 1}", file=sys.stderr)
    # the fastest run is the least disturbed by other users, as in measure_call; with ``median`` (AS_TIMED), the
    # median run, as the decision corpus reads its pairs
    pick = statistics.median if median else min
    return {"dispatch": max(pick(times["over"]) - pick(times["under"]), 0.0) * 1e9,
            "dispatch_flops": float(DISPATCH_FLOPS)}


#: Loop bodies for ``measure_loop_kernels``: name -> (step on the carry, the carry's elements). Each step is kernels
#: that the fusion model and XLA:CPU count alike (``body_kernels`` against ``FusionModel.fuse``), on so few elements
#: that their work is a few ns (the model's price of it is taken off): a sort and the loop after it (two loop
#: kernels), a product on the library path and the loop after it (a library kernel and a loop kernel). Larger ones
#: measure the model's error on their work more than what launching them costs (a sort of 32 elements: 670 ns per
#: kernel against 166 at 8; of 64K elements, 2 ms a trip).
_EYE8 = jnp.eye(8, dtype=jnp.float32)
_LOOP_STEPS = {
    "sort_8": (lambda c: jnp.sort(c) * 0.999, 8),
    "product_8x8": (lambda c: (c.reshape(-1, 8) @ _EYE8).reshape(-1) * 0.5 + 1.0, 64),
    "product_32x8": (lambda c: (c.reshape(-1, 8) @ _EYE8).reshape(-1) * 0.5 + 1.0, 256),
}
#: the trip count and the steps per trip ``measure_loop_kernels`` times
LOOP_KERNEL_TRIPS = 16
LOOP_KERNEL_STEPS = (1, 8)


def body_kernels(compiled_text: str) -> dict[str, int]:
    """The kernels (thunks) of a compiled program's first while loop's body, by kind: ``library`` (a library fusion,
    a product or a custom call) and ``loop`` (every other fusion, copy, sort or in-place update), read from
    ``compiled.as_text()``."""
    found = re.search(r" while\(.*?body=%([\w.\-]+)", compiled_text)
    if found is None:
        return {"library": 0, "loop": 0}
    body = re.search(r"\n%" + re.escape(found.group(1)) + r" .*?\n}", compiled_text, re.S).group(0)
    out = {"library": 0, "loop": 0}
    for line in body.splitlines():
        op = re.search(r"= \S+ (fusion|copy|custom-call|dot|dynamic-update-slice|dynamic-slice|sort|reduce)\(", line)
        if op is None:
            continue
        library = op.group(1) in ("custom-call", "dot") or "kind=kCustom" in line
        out["library" if library else "loop"] += 1
    return out


def model_body_kernels(closed: Any, model: Any) -> dict[str, int]:
    """The kernels the fusion model predicts for the body of the first scan in ``closed``, by the kind
    ``FusionModel.launches`` charges them as."""
    from rewrite.cost.dot import library_dot
    from rewrite.cost.program import LIBRARY, Program

    scan = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")
    body = Program.from_jaxpr(scan.params["jaxpr"], None)
    _, roots = model.fusion_model().fuse(body)
    out = {"library": 0, "loop": 0}
    for r, kind in roots.items():
        op = body.ops[r]
        library = kind == LIBRARY or (op.prim == "dot_general" and library_dot(op.params, op.in_avals))
        out["library" if library else "loop"] += 1
    return out


def measure_loop_kernels(rounds: int, progress: bool) -> dict[str, Any]:
    """ns per kernel per trip that a loop body's kernels cost beyond the model's price of their work.

    Each of ``_LOOP_STEPS`` is run ``k`` times per trip (``LOOP_KERNEL_STEPS``) in a ``lax.scan`` of
    ``LOOP_KERNEL_TRIPS`` trips, timed against a scan of one trip of one step. The time per trip less the model's
    price per trip (``AnalyticCost`` with the table in force and no loop launches) is what the model misses; its
    growth from the fewest steps to the most, over the kernels the model predicts there (``model_body_kernels``; the
    loop's own per-trip cost cancels), is fitted by least squares over the steps as ``loop_launch`` per loop kernel
    and ``loop_launch_library`` per library kernel. XLA's own count (``body_kernels``) is reported beside.
    """
    import numpy as np

    from rewrite.cost.model import AnalyticCost
    from rewrite.pipeline import program_cost

    model = AnalyticCost(loop_launch=0.0, loop_launch_library=0.0)
    steps: dict[str, dict[str, Any]] = {}
    for name, (step, n) in _LOOP_STEPS.items():
        x = jnp.linspace(0.0, 1.0, n, dtype=jnp.float32)

        def looped(k: int, trips: int, step=step) -> Callable:
            def body(c: jax.Array, _: Any) -> tuple[jax.Array, None]:
                for _ in range(k):
                    c = step(c)
                return c, None
            return lambda c: lax.scan(body, c, None, length=trips)[0]

        variants = {"base": looped(1, 1), **{f"k{k}": looped(k, LOOP_KERNEL_TRIPS) for k in LOOP_KERNEL_STEPS}}
        net = _paired(variants, (x,), "base", max(rounds, 5), progress)
        base_price = program_cost(jax.make_jaxpr(variants["base"])(x), model)
        rows = []
        for k in LOOP_KERNEL_STEPS:
            f = variants[f"k{k}"]
            closed = jax.make_jaxpr(f)(x)
            missed = (net[f"k{k}"] * 1e9 - (program_cost(closed, model) - base_price)) / LOOP_KERNEL_TRIPS
            rows.append((model_body_kernels(closed, model), body_kernels(jax.jit(f).lower(x).compile().as_text()),
                         missed))
        (m0, x0, t0), (m1, x1, t1) = rows[0], rows[-1]
        steps[name] = {"library": m1["library"] - m0["library"], "loop": m1["loop"] - m0["loop"], "missed": t1 - t0,
                       "model_kernels": f"{m0['library']}+{m0['loop']} -> {m1['library']}+{m1['loop']}",
                       "xla_kernels": f"{x0['library']}+{x0['loop']} -> {x1['library']}+{x1['loop']}",
                       "missed_per_trip": [round(t, 1) for *_, t in rows]}
    a = np.array([[v["loop"], v["library"]] for v in steps.values()], dtype=float)
    b = np.array([v["missed"] for v in steps.values()], dtype=float)
    (loop, library), *_ = np.linalg.lstsq(a, b, rcond=None)
    return {"loop_launch": max(float(loop), 0.0), "loop_launch_library": max(float(library), 0.0), "steps": steps}


#: Trips of the loops ``measure_loop_split`` times, and their carries' sizes as multiples of ``loop_parallel_at``:
#: two that XLA:CPU runs on one core, three it splits across the cores (at 3/4 of ``loop_parallel_at`` a trip
#: measured 1.5-2.7x the line through the two smaller sizes, 2026-12-01: no line through the three).
LOOP_SPLIT_TRIPS = 128
LOOP_SPLIT_SIZES = (0.25, 0.5, 1, 1.5, 2)


def _split_in_body(compiled_text: str) -> bool:
    """Whether a compiled program's first while loop's body holds a loop fusion XLA:CPU splits across the cores."""
    found = re.search(r" while\(.*?body=%([\w.\-]+)", compiled_text)
    body = found and re.search(r"\n%" + re.escape(found.group(1)) + r" .*?\n}", compiled_text, re.S)
    return bool(body) and any(_parts(line) > 1 for line in body.group(0).splitlines() if "fusion(" in line)


def _line(points: list[tuple[float, float]]) -> Callable[[float], float]:
    """The least-squares line through ``(x, y)`` points."""
    import numpy as np

    xs, ys = np.array(points, dtype=float).T
    slope, at0 = np.polyfit(xs, ys, 1)
    return lambda x: float(at0 + slope * x)


def measure_loop_split(rounds: int, progress: bool) -> dict[str, Any]:
    """ns per trip that a loop body's kernel which XLA:CPU splits across the cores costs more than its work at the
    rate it runs on one core (``loop_split``; ``AnalyticCost.loop_split``).

    A ``lax.scan`` of ``LOOP_SPLIT_TRIPS`` trips whose body is one elementwise kernel (``c * 0.999 + 1``) on a carry
    of each of ``LOOP_SPLIT_SIZES`` times ``loop_parallel_at`` elements (:func:`parallel_at`), timed against one trip
    (the fastest of ``rounds`` interleaved runs). Through the trips' times at the sizes XLA runs on one core a line in
    the carry's elements; each size XLA splits (read from the compiled body: ``split``) measures its ``excess`` over
    that line. ``loop_split`` is the excess at the smallest size split, ``loop_parallel_at``: the thread pool's
    hand-off and join, which a program that runs the kernel once pays once (in ``launch``) and a loop body at every
    trip. With the other core busy (this machine is shared) the split kernel also runs its work no faster than one
    core, so the excess grows with the size (2026-12-01, load 4: 1.7-6.6 us at 64K, 3.4-7.2 us at 128K).
    """
    at = parallel_at()["loop_parallel_at"]
    if not math.isfinite(at):
        return {}

    def looped(trips: int) -> Callable:
        return lambda c: lax.scan(lambda c, _: (c * 0.999 + 1.0, None), c, None, length=trips)[0]

    rows = {}
    for share in LOOP_SPLIT_SIZES:
        n = int(at * share)
        x = jnp.linspace(0.0, 1.0, n, dtype=jnp.float32)
        variants = {"one": looped(1), "many": looped(LOOP_SPLIT_TRIPS)}
        net = _paired(variants, (x,), "one", max(rounds, 5), progress)
        split = _split_in_body(jax.jit(variants["many"]).lower(x).compile().as_text())
        rows[n] = {"split": split, "ns_per_trip": round(net["many"] * 1e9 / (LOOP_SPLIT_TRIPS - 1), 1)}
        if progress:
            print(f"{n} elements: {rows[n]}", file=sys.stderr)
    alone = [(n, r["ns_per_trip"]) for n, r in rows.items() if not r["split"]]
    if len(alone) < 2 or not any(r["split"] for r in rows.values()):
        return {"sizes": rows}
    one_core = _line(alone)
    for n, r in rows.items():
        if r["split"]:
            r["excess"] = round(r["ns_per_trip"] - one_core(n), 1)
    return {"loop_split": max(0.0, rows[min(n for n, r in rows.items() if r["split"])]["excess"]), "sizes": rows}


def _partitions(n: int) -> int:
    """Into how many parts XLA:CPU splits a float32 elementwise loop of ``n`` elements across the cores: its
    parallel task assignment writes them into the loop fusion's ``outer_dimension_partitions`` (1: not split)."""
    shape = jax.ShapeDtypeStruct((n,), jnp.float32)
    return _parts(jax.jit(lambda x: jnp.exp(x) * 2.0).lower(shape).compile().as_text())


#: XLA:CPU's parallel task assignment of a loop fusion, in its compiled text: the parts of its outer dimensions.
_PARTITIONS = re.compile(r'outer_dimension_partitions":\[([^\]]*)\]')


def _parts(text: str) -> int:
    """Into how many parts the first loop fusion in ``text`` (a compiled program, or one line of it) is split."""
    found = _PARTITIONS.search(text)
    return math.prod(int(p.strip('" ')) for p in found.group(1).split(",")) if found and found.group(1) else 1


def parallel_at() -> dict[str, float]:
    """From what size XLA:CPU splits an elementwise loop across the cores, and into how many parts, read from the
    compiled program (nothing timed): ``loop_parallel_at``, the fewest float32 elements it splits (on this
    2-core machine 64K, 256 KiB), and ``loop_parallel``, the share of one core's time the split loop's work takes
    (one over the parts it makes of a large loop: 0.5 here). Where it splits none, no such term."""
    parts = _partitions(1 << 24)
    if parts <= 1:
        return {"loop_parallel_at": float("inf"), "loop_parallel": 1.0}
    k = next(k for k in range(10, 25) if _partitions(1 << k) > 1)
    return {"loop_parallel_at": float(1 << k), "loop_parallel": 1.0 / parts}


#: Elementwise operations whose arithmetic is large beside the bytes their loop moves (ns per element well above a
#: copy's), timed by :func:`measure_serial` on a loop XLA:CPU splits across the cores and on one it does not.
SERIAL_OPS = ("sin", "cos", "tan", "atan", "cbrt")


def measure_serial(rounds: int, progress: bool, runs: int = 1) -> dict[str, Any]:
    """What an elementwise loop too small for XLA:CPU to split across the cores pays per element, as a multiple of
    the table's prices (``loop_serial``), and from what size it is split (``loop_parallel_at``, :func:`parallel_at`).

    The table's per-element prices (:func:`measure_ops`) are measured on loops of ``N`` elements, which XLA:CPU splits
    across the cores (its compiled program's ``outer_dimension_partitions``); a loop under ``loop_parallel_at``
    elements (a loop body's kernel, a small program's) runs on one. Each of :data:`SERIAL_OPS` is timed as in
    :func:`measure_ops` on ``N`` elements and on half of ``loop_parallel_at`` (in the cache: its arithmetic, not its
    bytes), ``runs`` times; ``loop_serial`` is the median over the operations of the small loop's least ns per element
    over the large one's. The split pays only while the other cores are idle: with them busy the two cost about the
    same per element, so the least of several runs (the least disturbed) is taken, as :func:`measure_ops` takes its
    prices. On this 2-core machine the loop body of ``scan_seed_hand_vectorised`` (32K elements a trip) runs ``cos``
    at 7.5 ns an element, the vectorised form's one loop of 2M at 4.2.
    """
    at = parallel_at()["loop_parallel_at"]
    if not math.isfinite(at):
        return {"loop_parallel_at": at, "loop_serial": 1.0}
    small = int(at) // 2
    key = jax.random.PRNGKey(0)
    least: dict[int, dict[str, float]] = {N: {}, small: {}}
    for _ in range(runs):
        for n in (N, small):
            x = jax.random.normal(key, (n,), jnp.float32) * 1.5
            variants = {"base": lambda x: x + 1.0,
                        **{op: (lambda x, f=ELEMENTWISE[op][0]: f(x) + 1.0) for op in SERIAL_OPS}}
            for op, t in _paired(variants, (x,), "base", rounds, progress).items():
                least[n][op] = min(t / n * 1e9, least[n].get(op, math.inf))
    ratios = {op: least[small][op] / least[N][op] for op in SERIAL_OPS}
    if progress:
        print(f"least ns per element at {N} and {small} elements: {least}", file=sys.stderr)
    return {"loop_parallel_at": at, "loop_serial": max(statistics.median(ratios.values()), 1.0), "ratios": ratios}


#: Products timed by ``measure_dot_sizes``: (batch, M, K, N), row-major ``[M, K] x [K, N]`` (the library path), from
#: 8M to 2G flops; attention's block products among them (``[2, 4]`` heads, head width 64).
DOT_SIZES = ((8, 128, 64, 256), (8, 256, 64, 256), (8, 512, 64, 128), (8, 512, 64, 256), (8, 512, 256, 64),
             (8, 1024, 64, 128), (8, 1024, 64, 256), (8, 1024, 256, 64), (8, 1024, 64, 512), (8, 2048, 64, 256),
             (8, 2048, 64, 512), (8, 2048, 64, 1024), (1, 1024, 1024, 1024), (1, 2048, 512, 2048))


def _dot_seconds(shapes: Any, rounds: int, least: bool = False) -> dict[Any, float]:
    """Seconds per call of each product, the median of ``rounds`` interleaved runs after a warm-up (``least``: the
    fastest, the run least disturbed by other users of the cores)."""
    key = jax.random.PRNGKey(0)
    progs = {}
    for b, m, k, n in shapes:
        x = jax.random.normal(key, (b, m, k), jnp.float32)
        y = jax.random.normal(key, (b, k, n), jnp.float32)
        c = jax.jit(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y)).lower(x, y).compile()
        progs[(b, m, k, n)] = (c, (x, y))
    times = interleaved(progs, rounds)
    return {s: (min(t) if least else statistics.median(t)) for s, t in times.items()}


def fit_dot_sizes(flops_seconds: dict[float, float]) -> dict[str, float]:
    """The two product rates and the size between them that fit ``flops -> seconds`` best (least squares in log
    time): ``dot_flop`` (ns per flop below ``dot_parallel_at``, one core) and ``dot_parallel_flop`` (from it)."""
    import math

    points = sorted(flops_seconds.items())
    best = None
    for i in range(1, len(points)):
        at = math.sqrt(points[i - 1][0] * points[i][0])
        lo = [math.log(t * 1e9 / f) for f, t in points[:i]]
        hi = [math.log(t * 1e9 / f) for f, t in points[i:]]
        a, b = sum(lo) / len(lo), sum(hi) / len(hi)
        err = sum((x - a) ** 2 for x in lo) + sum((x - b) ** 2 for x in hi)
        if best is None or err < best[0]:
            best = (err, at, math.exp(a), math.exp(b))
    assert best is not None
    _, at, small, large = best
    if large >= small:  # no faster regime for large products: one rate
        rate = statistics.median(t * 1e9 / f for f, t in points)
        return {"dot_flop": rate, "dot_parallel_flop": rate}
    return {"dot_flop": small, "dot_parallel_flop": large, "dot_parallel_at": at}


def measure_dot_sizes(rounds: int, progress: bool) -> dict[str, float]:
    """ns per flop of a product by its size (``AnalyticCost.dot_rate``): ``DOT_SIZES`` timed interleaved, and two
    rates fitted, one below a size and one above it (``fit_dot_sizes``). On this 2-core CPU a product under about
    1e8 flops runs on one core (about 100 GFLOP/s) and a larger one on both (180-200)."""
    seconds = _dot_seconds(DOT_SIZES, max(rounds, 5))
    flops = {s: 2.0 * s[0] * s[1] * s[2] * s[3] for s in seconds}
    for s in sorted(seconds, key=flops.get):
        print(f"dot {s}: {flops[s]:.3g} flops, {seconds[s] * 1e3:.3f} ms, {flops[s] / seconds[s] / 1e9:.0f} GFLOP/s",
              file=sys.stderr)
    by_flops: dict[float, list[float]] = {}
    for s, t in seconds.items():
        by_flops.setdefault(flops[s], []).append(t)
    return fit_dot_sizes({f: statistics.median(t) for f, t in by_flops.items()})


#: A product whose output is at most this many bytes: its time is its flops, not its output's traffic to memory
#: (which ``AnalyticCost.spilled`` prices apart); ``measure_dot_parallel`` fits its rates on these only.
DOT_IN_CACHE = 8 << 20


def measure_dot_parallel(rounds: int, progress: bool, runs: int = 3) -> dict[str, Any]:
    """The product rate from the size at which XLA:CPU runs a product on every core (``dot_parallel_at``, and the
    ratio of the two rates), measured where the other core is free: the :data:`DOT_SIZES` whose output stays in the
    cache (:data:`DOT_IN_CACHE`), timed interleaved ``runs`` times, each product's least time over the runs and
    rounds (with the cores busy a large product runs at the one-core rate, and the median reads the load), fitted
    by :func:`fit_dot_sizes`. Its two rates are least times; :func:`parallel_rate` reads them as a ratio."""
    shapes = [s for s in DOT_SIZES if 4 * s[0] * s[1] * s[3] <= DOT_IN_CACHE]
    least: dict[Any, float] = {}
    for _ in range(runs):
        for s, t in _dot_seconds(shapes, max(rounds, 5), least=True).items():
            least[s] = min(t, least.get(s, math.inf))
    flops = {s: 2.0 * s[0] * s[1] * s[2] * s[3] for s in least}
    gflops = {str(s): round(flops[s] / least[s] / 1e9) for s in sorted(least, key=flops.get)}
    if progress:
        print(f"GFLOP/s, least over {runs} runs: {gflops}", file=sys.stderr)
    by_flops: dict[float, list[float]] = {}
    for s, t in least.items():
        by_flops.setdefault(flops[s], []).append(t)
    fit = fit_dot_sizes({f: statistics.median(t) for f, t in by_flops.items()})
    return {**fit, "gflops": gflops}


def parallel_rate(found: dict[str, float], dot_flop: float) -> dict[str, float]:
    """What ``--dot-parallel-only`` stores from :func:`measure_dot_parallel`'s fit: ``dot_parallel_at`` as fitted, and
    ``dot_parallel_flop`` the table's ``dot_flop`` times the fitted ratio of the fast rate to the one-core rate. The
    fit reads least times, faster than the table's median ``dot_flop`` (0.0066 and 0.0035 ns/flop against 0.00995,
    2026-12-01): stored as fitted, a large product would be priced 2.8x faster than a small one where it ran 1.9x.

    >>> parallel_rate({"dot_flop": 0.006, "dot_parallel_flop": 0.003, "dot_parallel_at": 1e8}, 0.01)
    {'dot_parallel_at': 100000000.0, 'dot_parallel_flop': 0.005}
    """
    return {"dot_parallel_at": found["dot_parallel_at"],
            "dot_parallel_flop": dot_flop * found["dot_parallel_flop"] / found["dot_flop"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--runs", type=int, default=1, help="repeat, keeping each figure's lowest value")
    ap.add_argument("--write", action="store_true", help="store the table in rewrite/cost/calibration.json")
    ap.add_argument("--merge", action="store_true",
                    help="combine with the stored table: each elementwise price's lowest value over runs, and the "
                         "median over runs of each memory figure")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--call-only", action="store_true",
                    help="measure only the per-call and per-buffer cost, and store it in this backend's table")
    ap.add_argument("--dispatch-only", action="store_true",
                    help="measure only what a call costs more from DISPATCH_FLOPS flops (the hand-off to XLA:CPU's "
                         "worker thread), and store it in this backend's table")
    ap.add_argument("--loop-only", action="store_true",
                    help="measure only the per-trip cost of a loop, and store it in this backend's table")
    ap.add_argument("--cache-only", action="store_true",
                    help="measure only the last-level cache's size and price (CPU), and store them in its table")
    ap.add_argument("--dot-only", action="store_true",
                    help="measure only the product rates by size (dot_flop, dot_parallel_flop, dot_parallel_at)")
    ap.add_argument("--dot-parallel-only", action="store_true",
                    help="measure only the rate of the products XLA:CPU runs on every core, and from what size "
                    "(dot_parallel_at; dot_parallel_flop: the table's dot_flop times the fitted ratio of the rates)")
    ap.add_argument("--parallel-only", action="store_true",
                    help="read only from what size and into how many parts XLA:CPU splits a loop across the cores "
                         "(loop_parallel_at, loop_parallel: from the compiled program, nothing timed); printed, "
                         "not stored (the tables leave the term off)")
    ap.add_argument("--shared-only", action="store_true",
                    help="measure only which pairs of transcendentals of one argument XLA computes from shared work, "
                         "and (with --write) store the price of each of --groups found to share (SHARED_CANDIDATES)")
    ap.add_argument("--groups", default="sinhcosh",
                    help="with --shared-only --write: the pairs whose price is stored (comma-separated)")
    ap.add_argument("--serial-only", action="store_true",
                    help="measure only what an elementwise loop too small for XLA:CPU to split across the cores pays "
                         "per element more (loop_serial) and from what size it splits (loop_parallel_at); store them")
    ap.add_argument("--chain-only", action="store_true",
                    help="measure only what a loop pays more where a transcendental reads another's result (chain), "
                         "and store it in this backend's table")
    ap.add_argument("--loop-kernels-only", action="store_true",
                    help="measure only what a loop body's kernels cost per trip beyond the model's price of their work "
                         "(loop_launch, loop_launch_library); printed, not stored (the tables leave the term off)")
    ap.add_argument("--tier-only", action="store_true",
                    help="measure only from what array size a kernel's input and output outgrow their share of the "
                         "cache, and what a byte past it costs (CPU): near_bytes, tier; printed, not stored")
    ap.add_argument("--loop-split-only", action="store_true",
                    help="measure only what a loop body's kernel that XLA:CPU splits across the cores costs more per "
                         "trip than one it runs on one core (loop_split), and store it in this backend's table")
    ap.add_argument("--reduce-cached-only", action="store_true",
                    help="measure only what a library row reduction of an array the cache holds costs per element "
                         "against one streamed (reduce_cached), and store it in this backend's table")
    ap.add_argument("--transpose-strided-only", action="store_true",
                    help="measure only what a copy that moves the minor-most dimension down a stride off a page costs "
                         "per element (transpose_strided), and store it in this backend's table")
    ap.add_argument("--transpose-copy-only", action="store_true",
                    help="measure only what a product operand's copy that moves its minor-most dimension down a "
                         "page-multiple stride costs per element (transpose_copy), and store it in this backend's table")
    ap.add_argument("--as-timed", action="store_true",
                    help="with --fresh-only or --dispatch-only: the median of the rounds, as the decision corpus "
                         "reads its pairs, in place of the fastest round (AS_TIMED)")
    ap.add_argument("--attention-scratch-only", action="store_true",
                    help="measure only the share of its scores XLA:CPU's attention kernel holds at once, and store it "
                         "in the overlay for the installed jaxlib (CPU)")
    ap.add_argument("--fresh-only", action="store_true",
                    help="measure only what a byte of a buffer allocated per call costs, and from what size (CPU)")
    args = ap.parse_args(argv)
    if args.attention_scratch_only:
        _attention_scratch_only(args)
        return
    if args.call_only:
        _call_only(args)
        return
    if args.dispatch_only:
        _store_only(args, measure_dispatch(args.rounds, args.progress, args.as_timed), "dispatch",
                    note=_as_timed_note(args, "dispatch"))
        return
    if args.loop_only:
        _loop_only(args)
        return
    if args.loop_kernels_only:
        # Printed, never stored: priced so (166 ns a loop kernel, 114.7 a library kernel, 2026-11-30), the model
        # declined the scan pack's hoisting where it measured faster (docs/api.md's RNN loss, 16 trips of 128: 1.75x
        # hoisted, A/A 0.79x; at 256 trips of 1024 1.33x, chosen still) as well as where it measured slower
        # (tests/test_scan.py's RNN summed over its batch: 0.80x), and the corpus's Spearman went 0.753 -> 0.742
        # (decisions.md, h-loop's note): the tables leave the term off.
        runs = [measure_loop_kernels(args.rounds, args.progress) for _ in range(args.runs)]
        for r in runs:
            print(json.dumps(r, indent=1), file=sys.stderr)
        print(json.dumps({k: statistics.median(r[k] for r in runs) for k in ("loop_launch", "loop_launch_library")},
                         indent=1))
        return
    if args.cache_only:
        _cache_only(args)
        return
    if args.dot_only:
        _store_only(args, measure_dot_sizes(args.rounds, args.progress), "dot")
        return
    if args.dot_parallel_only:
        from rewrite.cost import calibration as _c  # (read here: the table the ratio is applied to)

        found = measure_dot_parallel(args.rounds, args.progress, max(args.runs, 1))
        print(json.dumps(found, indent=1), file=sys.stderr)
        if "dot_parallel_at" not in found:
            raise SystemExit("no faster rate for large products measured (the other core busy?): nothing stored")
        _store_only(args, parallel_rate(found, _c.CPU["dot_flop"]), "dot_parallel",
                    note=f"python -m benchmarks.calibrate --dot-parallel-only --runs {args.runs} --rounds "
                    f"{args.rounds}: least GFLOP/s by product (batch, M, K, N): {found['gflops']}; fitted "
                    f"{found['dot_flop']:.4g} and {found['dot_parallel_flop']:.4g} ns/flop, stored the table's "
                    f"dot_flop times their ratio")
        return
    if args.parallel_only:
        # Printed, never stored: with the split priced, the model chose the vectorised seed 001 over its accumulator
        # (scan_seed at xs 256x512x128: 0.99x and 64 MiB against main's 1.56x and 0.5 MiB, load 6), so the
        # tables leave the term off (decisions.md, 2026-11-29 notes).
        print(json.dumps(parallel_at(), indent=1))
        return
    if args.shared_only:
        _shared_only(args)
        return
    if args.serial_only:
        found = measure_serial(args.rounds, args.progress, args.runs)
        print(json.dumps(found, indent=1), file=sys.stderr)
        _store_only(args, {"loop_parallel_at": found["loop_parallel_at"], "loop_serial": found["loop_serial"]},
                    "serial",
                    note=f"python -m benchmarks.calibrate --serial-only, {args.runs} runs: least ns per element at "
                         f"{int(found['loop_parallel_at']) // 2} elements over at {N}: "
                         + ", ".join(f"{op} {v:.2f}" for op, v in found.get("ratios", {}).items())
                         + "; the split pays only with the other cores idle (with them busy the ratio is about 1)")
        return
    if args.chain_only:
        runs = [measure_chain(args.rounds, args.progress) for _ in range(args.runs)]
        for r in runs:
            print(json.dumps(r, indent=1), file=sys.stderr)
        # the median over the runs: an excess is a difference of times, which the load moves either way
        excess = {n: statistics.median(r["pairs"][n]["excess"] for r in runs) for n in CHAINS}
        _store_only(args, {"chain": statistics.median(r["chain"] for r in runs)}, "chain",
                    note=f"python -m benchmarks.calibrate --chain-only, {len(runs)} runs: each chain's excess over its "
                         "two functions each alone, summed (a share of that sum), median over the runs: "
                         + ", ".join(f"{n} {v:.2f}" for n, v in excess.items()) + "; stored: the runs' median of "
                         "the chains' median")
        return
    if args.tier_only:
        # Printed, never stored: priced so (near_bytes 8 MiB, tier 0.018 ns/B, 2026-12-01, load 6.5 falling to 1.9),
        # the model would rewrite lm_head_loss_small with nn_lm_head_lse_label_256 (measured 0.97x, decisions.md)
        # and lm_head_grad_small, and it still did not choose attention's block within 5% of the best (its query
        # blocks' per-trip cost is the larger error: benchmarks/results/log.md, h-block): the tables leave it off.
        from rewrite.cost import calibration as _c  # (read here: the table the figures are measured against)

        cpu = _c.CPU
        runs = [measure_tier(args.rounds, args.progress, cpu.get("cache_bytes", math.inf), cpu.get("spill", 0.0))
                for _ in range(args.runs)]
        runs = [r for r in runs if r]
        print(json.dumps({k: statistics.median(r[k] for r in runs) for k in ("near_bytes", "tier")} if runs else {},
                         indent=1))
        return
    if args.loop_split_only:
        runs = [measure_loop_split(args.rounds, args.progress) for _ in range(args.runs)]
        for r in runs:
            print(json.dumps(r, indent=1), file=sys.stderr)
        found = [r["loop_split"] for r in runs if "loop_split" in r]
        # the median over the runs: a difference of times, which the load moves either way
        _store_only(args, {"loop_split": statistics.median(found)} if found else {}, "loop_split",
                    note=f"python -m benchmarks.calibrate --loop-split-only, {len(runs)} runs of {args.rounds} rounds: "
                         "ns per trip by the carry's elements (excess over the one-core line where split): "
                         + "; ".join(", ".join(f"{n}: {v['ns_per_trip']}" + (f" ({v['excess']})" if "excess" in v
                                                                              else "")
                                               for n, v in r["sizes"].items()) for r in runs)
                         + "; stored: the runs' median excess at the smallest size split")
        return
    if args.reduce_cached_only:
        from rewrite.cost import calibration as _c  # (read here: the table the figures are measured against)

        runs = [measure_reduce_cached(args.rounds, args.progress, _c.CPU) for _ in range(args.runs)]
        for r in runs:
            print(json.dumps(r, indent=1), file=sys.stderr)
        _store_only(args, {"reduce_cached": statistics.median(r["reduce_cached"] for r in runs)}, "reduce_cached",
                    note=f"python -m benchmarks.calibrate --reduce-cached-only, {len(runs)} runs of {args.rounds} "
                         "rounds: cached (8 MiB) over streamed (64 MiB) row max / sum: "
                         + "; ".join(f"{r['ratio']['max']} / {r['ratio']['sum']}" for r in runs)
                         + " (least ns per element: " + "; ".join(str(r["ns_per_element"]) for r in runs)
                         + f"); times the table's streamed price {runs[0]['streamed_priced']}; stored: the median")
        return
    if args.transpose_copy_only:
        from rewrite.cost import calibration as _c

        runs = [measure_transpose_copy(args.rounds, args.progress, _c.CPU) for _ in range(args.runs)]
        for r in runs:
            print(json.dumps(r), file=sys.stderr)
        _store_only(args, {"transpose_copy": statistics.median(r["transpose_copy"] for r in runs)}, "transpose_copy",
                    note=f"python -m benchmarks.calibrate --transpose-copy-only, {len(runs)} runs of {args.rounds} "
                         f"rounds: swapaxes(x * 2) over x * 2 on {TRANSPOSED}: "
                         + "; ".join(str(r["ratio"]) for r in runs)
                         + " (median ns per element: " + "; ".join(str(r["median_ns_per_element"]) for r in runs)
                         + f"); times the table's copy_per_element {_c.CPU['copy_per_element']}; stored: the median")
        return
    if args.transpose_strided_only:
        from rewrite.cost import calibration as _c

        start = [round(x, 2) for x in os.getloadavg()]
        runs = [measure_transpose_strided(args.rounds, args.progress, _c.CPU) for _ in range(args.runs)]
        for r in runs:
            print(json.dumps(r), file=sys.stderr)
        _store_only(args, {"transpose_strided": statistics.median(r["transpose_strided"] for r in runs)},
                    "transpose_strided",
                    note=f"python -m benchmarks.calibrate --transpose-strided-only, {len(runs)} runs of {args.rounds} "
                         "rounds: transpose(x * 2) over x * 2, by shape: " + "; ".join(str(r["ratio"]) for r in runs)
                         + f"; the median over shapes times the table's copy_per_element {_c.CPU['copy_per_element']};"
                         f" stored: the runs' median (load average at the start {start})")
        return
    if args.fresh_only:
        if jax.default_backend() != "cpu":
            raise SystemExit("--fresh-only measures a CPU's allocator")
        _store_only(args, measure_fresh(args.rounds, args.progress, args.as_timed), "fresh",
                    note=_as_timed_note(args, "fresh"))
        return
    ops: dict[str, float] = {}
    mem: dict[str, float] = {}
    call = measure_call(args.rounds, args.progress)
    for _ in range(args.runs):  # the lowest of several runs: the least disturbed by other users
        for k, v in measure_ops(args.rounds, args.progress).items():
            ops[k] = min(v, ops.get(k, v))
        for k, v in measure_memory(args.rounds, args.progress).items():
            mem[k] = min(v, mem.get(k, v))
    loop = measure_loop(args.rounds, args.progress, mem["launch"])
    if jax.default_backend() == "cpu":
        loop.update(measure_cache(args.rounds, args.progress))
        loop.update(measure_fresh(args.rounds, args.progress))
    table = {
        "platform": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "machine": platform.processor() or platform.machine(),
        "date": datetime.date.today().isoformat(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "jax": jax.__version__,
        "elementwise_ns": {k: float(f"{v:.4g}") for k, v in sorted(ops.items())},
        **{k: float(f"{v:.6g}") for k, v in mem.items()},
        **_rounded(call),
        **_rounded(loop),
    }
    history = [{k: round(v, 6) for k, v in mem.items()}]

    key = table["platform"].upper()
    tables = _base_tables()
    if args.merge:
        old = tables.get(key, {"elementwise_ns": {}})
        for k, v in old["elementwise_ns"].items():
            table["elementwise_ns"][k] = min(v, table["elementwise_ns"].get(k, v))
        history = _memory_history(old, mem) + history
        table["runs"] = old.get("runs", 1) + args.runs
    else:
        table["runs"] = args.runs
    # Memory figures are differences of times, so the fastest run is not the truth: take the median run.
    for k in mem:
        table[k] = round(statistics.median(h[k] for h in history if k in h), 6)
    if len(history) > 1:  # one run's figures are the table's own: stored once
        table["memory_runs"] = history
    print(json.dumps(table, indent=1))
    if args.write:
        tables[key] = table
        _write(tables)


def _memory_history(table: dict, keys: Any) -> list[dict]:
    """The memory figures of each run a stored table was made from: its ``memory_runs``, or, for a table of
    one run (which stores them once, as its own figures), that run."""
    runs = table.get("memory_runs")
    if runs:
        return list(runs)
    one = {k: table[k] for k in keys if k in table}
    return [one] if one else []


#: Figures stored to one decimal (nanoseconds of a call, a buffer or a trip; the cache's bytes); the rest of
#: the call, loop and cache figures to four significant digits.
_TO_ONE_DECIMAL = ("call", "buffer", "dispatch", "dispatch_flops", "iteration", "iteration_trip", "cache_bytes", "fresh_bytes", "dot_parallel_at",
                   "loop_parallel_at")


def _rounded(figures: dict[str, float]) -> dict[str, float]:
    return {k: (round(v, 1) if k in _TO_ONE_DECIMAL else float(f"{v:.4g}")) for k, v in figures.items()}


def _as_timed_note(args: argparse.Namespace, what: str) -> str | None:
    """The stored note of a ``--fresh-only`` / ``--dispatch-only`` run: how its figure was read."""
    how = "the median of the rounds (--as-timed)" if args.as_timed else "the fastest round"
    return f"python -m benchmarks.calibrate --{what}-only --rounds {args.rounds}: {how}"


#: a process that measures one call of plain attention ``[2, 4, N, 64]`` (float32) and prints the growth of its peak
#: resident memory in that call, in bytes (the compile, the inputs and a warm-up of the allocator before it)
_ATTENTION_RSS = """
import resource, sys
import jax, jax.numpy as jnp
n = int(sys.argv[1])
q, k, v = (jax.random.normal(jax.random.key(i), (2, 4, n, 64), jnp.float32) for i in range(3))
f = jax.jit(lambda q, k, v: jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / 8.0, axis=-1) @ v).lower(q, k, v).compile()
jnp.ones(8).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
f(q, k, v).block_until_ready()
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
for _ in range(5):  # the allocator settles: glibc raises its mmap threshold to a freed chunk's size (to 32 MiB)
    f(q, k, v).block_until_ready()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    f(q, k, v).block_until_ready()
print(grown, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) * resource.getpagesize() // 5)
"""


def measure_attention_scratch(sizes: tuple[int, ...] = (2048, 4096), runs: int = 3) -> dict[str, Any]:
    """``attention_scratch``: the share of its scores that XLA:CPU's library holds at once while plain attention's
    one kernel runs (``rewrite/cost/attention.py``'s ``held_scores``): a call's growth of the peak resident memory,
    less its output, over the scores' bytes, each call in a fresh process; the median over ``sizes`` and ``runs``.
    jaxlib 0.10 holds them all; 0.12 runs a few of the 8 heads at a time. And ``attention_fresh_unit``
    (``mapped_fresh``): ``"head"`` where the library maps its scratch a head at a time, read from the pages that fault
    at each call once five have run (``ru_minflt``) at N=2048, whose scores (128 MiB) are past glibc's 32 MiB mmap
    threshold and a head's (16 MiB) under it: under half the scores fault there (jaxlib 0.12: 0-20%; 0.10: all)."""
    import subprocess

    shares, faulted = [], {}
    for n in sizes:
        scores, out = 2 * 4 * n * n * 4, 2 * 4 * n * 64 * 4
        for _ in range(runs):
            grown, fresh = subprocess.run([sys.executable, "-c", _ATTENTION_RSS, str(n)], check=True,
                                          capture_output=True, text=True,
                                          env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout.split()[-2:]
            shares.append(max(int(grown) - out, 0) / scores)
            faulted.setdefault(n, []).append(int(fresh) / scores)
    whole = statistics.median(faulted.get(2048, [1.0])) >= 0.5
    return {"attention_scratch": round(statistics.median(shares), 3), "attention_fresh_unit": "scores" if whole else
            "head", "readings": [round(x, 3) for x in shares],
            "faulted": {str(n): [round(x, 3) for x in f] for n, f in faulted.items()}}


def _attention_scratch_only(args: argparse.Namespace) -> None:
    """Print :func:`measure_attention_scratch`'s share and, with ``--write``, store it in the CPU table's overlay for
    the installed jaxlib (``calibration.json``'s ``OVERLAYS``: what differs there from the table's own JAX)."""
    from rewrite.cost import calibration as _calibration

    if jax.default_backend() != "cpu":
        raise SystemExit("--attention-scratch-only measures XLA:CPU's library")
    found = measure_attention_scratch(runs=max(args.runs, 1))
    print(json.dumps(found, indent=1))
    if not args.write:
        return
    overlay = _calibration.OVERLAYS.setdefault("CPU", {}).setdefault(_calibration.JAXLIB, {})
    overlay["attention_scratch"] = found["attention_scratch"]
    overlay["attention_fresh_unit"] = found["attention_fresh_unit"]
    overlay["attention_scratch_measured"] = {
        "date": datetime.date.today().isoformat(), "jax": jax.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()], "readings": found["readings"],
        "faulted": found["faulted"],
        "note": "python -m benchmarks.calibrate --attention-scratch-only: plain attention [2, 4, N, 64] at N=2048 and "
                "4096, one process each: its peak resident memory's growth in its first call less its output over "
                "its scores (readings), and the bytes faulting at each later call over its scores (faulted, by N)"}
    _write(_base_tables())


def _store_only(args: argparse.Namespace, figures: dict[str, float], stamp: str, drop: str | None = None,
                note: str | None = None) -> None:
    """Print figures measured alone and, with ``--write``, store them in this backend's table, with the date,
    device and load they were measured under as ``<stamp>_measured`` (``drop``: a key they supersede; ``note``: what
    they were measured from)."""
    print(json.dumps(figures, indent=1))
    if not args.write or not figures:
        return
    tables = _base_tables()
    table = tables[jax.default_backend().upper()]
    table.update(_rounded(figures))
    table[f"{stamp}_measured"] = {"date": datetime.date.today().isoformat(),
                                  "device": str(jax.devices()[0].device_kind),
                                  "load_average": [round(x, 2) for x in os.getloadavg()],
                                  **({"note": note} if note else {})}
    if drop is not None:
        table.pop(drop, None)
    _write(tables)


def _shared_only(args: argparse.Namespace) -> None:
    """Print :func:`measure_shared`'s findings and, with ``--write``, store the prices of ``--groups`` that share in
    this backend's ``elementwise_ns``, with what they were measured from as ``shared_measured``."""
    found = {}
    for _ in range(args.runs):  # each pair's ratio: the lowest of the runs
        for name, f in measure_shared(args.rounds, args.progress).items():
            if name not in found or f["ratio"] < found[name]["ratio"]:
                found[name] = f
    print(json.dumps(found, indent=1))
    tables = _base_tables()
    table = tables[jax.default_backend().upper()]
    prices = shared_prices(found, table["elementwise_ns"], [g for g in args.groups.split(",") if g])
    print(json.dumps(prices, indent=1))
    if not args.write or not prices:
        return
    table["elementwise_ns"] = dict(sorted({**table["elementwise_ns"], **prices}.items()))
    table["shared_measured"] = {
        "date": datetime.date.today().isoformat(), "device": str(jax.devices()[0].device_kind),
        "load_average": [round(x, 2) for x in os.getloadavg()], "runs": args.runs,
        "pairs": {n: (f"instructions {f['instructions_apart']} apart, {f['instructions_together']} together; ns "
                      + ", ".join(f"{k} {v:.3f}" for k, v in f["ns"].items())
                      + f"; ratio {f['ratio']:.3f}; {'shares' if f['shares'] else 'apart'}") for n, f in found.items()},
        "note": "python -m benchmarks.calibrate --shared-only: each stored pair priced at the table's dearer member "
                "times the pair's measured ratio to it, never below that member"}
    _write(tables)


def _call_only(args: argparse.Namespace) -> None:
    _store_only(args, measure_call(args.rounds, args.progress), "call", drop="call_uncalibrated")


def _loop_only(args: argparse.Namespace) -> None:
    from rewrite.cost import calibration as _calibration

    table = getattr(_calibration, _calibration.BACKENDS[jax.default_backend()])
    _store_only(args, measure_loop(args.rounds, args.progress, table["launch"]), "iteration")


def _cache_only(args: argparse.Namespace) -> None:
    if jax.default_backend() != "cpu":
        raise SystemExit("--cache-only measures a CPU's last-level cache")
    _store_only(args, measure_cache(args.rounds, args.progress), "cache")


def _base_tables() -> dict[str, dict]:
    """Every backend's table as ``calibration.json`` holds it, without the installed jaxlib's overlay: what a
    ``--write`` updates and writes back (:func:`_write` keeps the overlays as they are)."""
    from rewrite.cost import calibration as _calibration

    return {name: _calibration.base(name) for name in _calibration.BACKENDS.values()}


def _write(tables: dict) -> None:
    from rewrite.cost import calibration as _calibration

    backends = {t["platform"]: name for name, t in tables.items()}
    overlays = {"OVERLAYS": _calibration.OVERLAYS} if _calibration.OVERLAYS else {}  # (kept as they are)
    _calibration.PATH.write_text(json.dumps({**tables, **overlays, "BACKENDS": backends}, indent=1) + "\n")
    print(f"wrote {_calibration.PATH}", file=sys.stderr)


if __name__ == "__main__":
    main()
