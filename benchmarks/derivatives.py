"""Backward passes: JAX's VJP, hand-derived VJPs, and ``jax.vjp`` of ``rewrite(f)``, timed side by side.

Seed 000 is ``f(x, a) = sin(a*x)**2 / a`` with ``x`` of shape ``(B, T, C)``
and ``a`` of shape ``(C,)``; as in the seed, what is timed is
``jax.vjp(f, x, a)[1](g)`` under one ``jit``. Two more functions where
identities matter: a mean-field (Ising) free energy ``-log(2 cosh(b*h))/b``,
whose VJP divides ``sinh`` by ``cosh``, and a softplus written
``log1p(exp(w*z))``, whose VJP divides ``exp`` by ``1+exp``. A last case
uses the primal value too (``value_and_grad``), as a training step does,
where the residuals the cost model chooses matter.

Variants, all taking the same arguments:

* ``jax``: JAX's own VJP (the baseline; ratios are its time over theirs).
* ``hand_sin2ax``: the seed's hand-derived ``custom_vjp`` (``sin(2ax)``).
* ``hand_shared``: a hand-derived VJP computing one ``sin`` and one ``cos``.
* ``rewritten``: ``jax.vjp`` of the plain ``rewrite(f, rulesets=[derivatives])``,
  which runs ``f``'s VJP rewritten and split at the cost model's residuals.
* ``vjp=True``: the deprecated ``rewrite(f, ..., vjp=True)``, the same split
  as a ``jax.custom_vjp`` (the figures to match).
* ``rewritten_program``: the timed program itself (``vjp`` of ``f``)
  rewritten, without a forward/backward split.
* ``measured``: the same with ``cost_model="measure"``.
* ``fastmath``: with ``derivatives_fastmath`` too (``a*(g/a) -> g``).
* ``floor``: not a VJP: ``g*sin(ax)*cos(ax)`` and ``sum(g*x)``, the same
  inputs and outputs with no transcendental in the reduction.

``--forms`` times seed 000's VJP written by hand in other forms (``SEED_FORMS``:
where ``sin`` and ``cos`` are computed and what is stored), with the kernels
XLA:CPU compiles each to, and single loops of ``sin``, ``cos`` and both.

Run holding the benchmark lock::

    flock /tmp/bench.lock python -m benchmarks.derivatives --write
    flock /tmp/bench.lock python -m benchmarks.derivatives --forms --sizes 512,2048,8192 --rounds 15 --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import warnings
from pathlib import Path

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.harness import Row, compile_stats, format_rows, measure
from rewrite import AnalyticCost, rewrite
from rewrite.cost.program import Program
from rulesets._sincos import stored_sin
from rulesets.derivatives import derivatives, derivatives_fastmath
from rulesets.kernels.sin_squared import always_true, interleaved

B, C = 32, 64


# ---------------------------------------------------------------------- seed 000
def seed(x, a):
    return jnp.sin(a * x) ** 2 / a


@jax.custom_vjp
def seed_sin2ax(x, a):
    return seed(x, a)


def _sin2ax_bwd(res, g):  # the seed's hand-derived backward pass, verbatim in substance
    x, a = res
    ax = a * x
    sin_ax, sin_2ax = jnp.sin(ax), jnp.sin(2 * ax)
    grad_x = g * sin_2ax
    grad_a = (g * (ax * sin_2ax - sin_ax ** 2) / (a ** 2)).sum(axis=tuple(range(x.ndim - 1)))
    return grad_x, grad_a


seed_sin2ax.defvjp(lambda x, a: (seed(x, a), (x, a)), _sin2ax_bwd)


@jax.custom_vjp
def seed_shared(x, a):
    return seed(x, a)


def _shared_bwd(res, g):  # one sin and one cos per element, shared by both gradients
    x, a = res
    s, c = jnp.sin(a * x), jnp.cos(a * x)
    grad_x = g * 2 * s * c
    grad_a = (g * (2 * x * s * c / a - s * s / a ** 2)).sum(axis=tuple(range(x.ndim - 1)))
    return grad_x, grad_a


seed_shared.defvjp(lambda x, a: (seed(x, a), (x, a)), _shared_bwd)


def seed_floor(x, a, g):
    return g * jnp.sin(a * x) * jnp.cos(a * x), (g * x).sum((0, 1))


# ---------------------------------------------------------------------- seed 000's VJP in other forms (``--forms``)
# Each takes (x, a, g) and computes JAX's VJP of ``seed``, op for op, from ``sin(ax)`` and ``cos(ax)`` obtained
# differently: what each makes XLA:CPU compute and store is the question (benchmarks/results/derivatives_forms.md).
def _seed_terms(x, a, g, s, c):
    """JAX's ``t`` (``grad x / a``) and ``u`` (``a``'s second summand) from ``s = sin(ax)``, ``c = cos(ax)``."""
    return ((g * (1 / a)) * (s * 2)) * c, (g * (1 / (a * a))) * (s * s)


def _seed_grads(x, a, t, u):
    return a * t, (t * x).sum((0, 1)) - u.sum((0, 1))


def _tiny(v):
    return np.asarray(np.finfo(v.dtype).tiny, v.dtype)


def form_stored_sin(x, a, g):
    """The rewrite's program by hand (``trig_sin_stored``): ``sin`` stored once as a ``select``, ``cos`` beside it."""
    ax = a * x
    return _seed_grads(x, a, *_seed_terms(x, a, g, stored_sin(ax), jnp.cos(ax)))


def form_one_sum(x, a, g):
    """``form_stored_sin`` with ``a``'s two sums as one (one library reduction, not bit for bit: the sums' order)."""
    ax = a * x
    t, u = _seed_terms(x, a, g, stored_sin(ax), jnp.cos(ax))
    return a * t, (t * x - u).sum((0, 1))


def form_complex_pair(x, a, g):
    """``t`` and ``u`` from one loop of ``sin`` and ``cos``, as one complex array a ``select`` would store once."""
    ax = a * x
    t, u = _seed_terms(x, a, g, jnp.sin(ax), jnp.cos(ax))
    t0, u0 = _seed_terms(x, a, g, ax, jnp.ones_like(ax))  # sin(ax) = ax and cos(ax) = 1 below the smallest normal
    z = lax.select(jnp.abs(ax) < _tiny(ax), lax.complex(t0, u0), lax.complex(t, u))
    return _seed_grads(x, a, jnp.real(z), jnp.imag(z))


def form_complex_exp(x, a, g):
    """``cos`` and ``sin`` as one complex ``exp`` (an operation XLA:CPU counts expensive, so stores once)."""
    ax = a * x
    e = jnp.exp(lax.complex(ax * 0, ax))  # exp(+-0) = 1 for finite ax; NaN where sin(ax) and cos(ax) are NaN
    s = lax.select(jnp.abs(ax) < _tiny(ax), ax, jnp.imag(e))  # imag(e) is +0 at -0 and 0 at subnormals
    return _seed_grads(x, a, *_seed_terms(x, a, g, s, jnp.real(e)))


def form_interleaved(x, a, g):
    """``grad x``, ``t * x`` and ``u`` written by one loop as one ``[..., 3]`` array (one ``sin`` and one ``cos``
    an element), ``a``'s sums one library reduction of it over the rows (each sum's own terms, in another order);
    three times JAX's temp memory."""
    ax = a * x
    t, u = _seed_terms(x, a, g, jnp.sin(ax), jnp.cos(ax))
    y = interleaved([a * t, t * x, u])
    r = y.sum(tuple(range(x.ndim - 1)))
    return y[..., 0], r[:, 1] - r[:, 2]


def form_interleaved_one_sum(x, a, g):
    """``form_interleaved`` with ``a``'s two sums as one (``t * x - u``): two slots, twice JAX's temp memory."""
    ax = a * x
    t, u = _seed_terms(x, a, g, jnp.sin(ax), jnp.cos(ax))
    y = interleaved([a * t, t * x - u])
    return y[..., 0], y.sum(tuple(range(x.ndim - 1)))[:, 1]


def form_blocked(x, a, g, trips: int = 4):
    """``form_interleaved_one_sum`` over ``trips`` blocks of rows in a ``fori_loop`` (temp memory one block's
    ``[..., 2]``): XLA:CPU compiles the loop body's fusion without the vector ``sin``/``cos`` (scalar calls for
    each slot), so it runs at JAX's speed, not the unblocked form's."""
    c = x.shape[-1]
    xs, gs = x.reshape(-1, c), g.reshape(-1, c)
    rows = xs.shape[0] // trips

    def body(i, carry):
        gx, acc = carry
        xb, gb = (lax.dynamic_slice_in_dim(v, i * rows, rows, 0) for v in (xs, gs))
        ab = a * xb
        t, u = _seed_terms(xb, a, gb, jnp.sin(ab), jnp.cos(ab))
        y = interleaved([a * t, t * xb - u])
        return lax.dynamic_update_slice_in_dim(gx, y[..., 0], i * rows, 0), acc + y.sum(0)

    gx, acc = lax.fori_loop(0, trips, body, (jnp.zeros_like(xs), jnp.zeros((c, 2), x.dtype)))
    return gx.reshape(x.shape), acc[:, 1]


def form_chained(x, a, g, blocks: int = 0):
    """``form_interleaved`` over ``blocks`` blocks of the leading axis (all of it by default), unrolled: each block
    one loop writing its ``[..., 3]`` (in cache), one library reduction of it, ``grad x``'s rows put in place.

    Each block's ``x`` is ``select(p, x_block, g_block)`` with ``p`` true but computed from the sums so far, so XLA
    runs the blocks one after another and holds one block's array at a time (without it, it computes every block's
    first: the temp memory of the unblocked form); a ``fori_loop`` over the blocks would do the same, but XLA:CPU
    compiles a loop fusion that reads a ``dynamic-slice`` without the vector ``sin``/``cos`` (``form_blocked``)."""
    blocks = blocks or x.shape[0]
    rows = x.shape[0] // blocks
    lead = tuple(range(x.ndim - 1))
    gx, acc = jnp.zeros_like(x), jnp.zeros((x.shape[-1], 3), x.dtype)
    for b in range(blocks):
        xb, gb = x[b * rows:(b + 1) * rows], g[b * rows:(b + 1) * rows]
        if b:
            xb = lax.select(lax.broadcast(always_true(acc[0, 0]), xb.shape), xb, gb)
        ab = a * xb
        t, u = _seed_terms(xb, a, gb, jnp.sin(ab), jnp.cos(ab))
        y = interleaved([a * t, t * xb, u])
        gx = lax.dynamic_update_slice_in_dim(gx, y[..., 0], b * rows, 0)
        acc = acc + y.sum(lead)
    return gx, acc[:, 1] - acc[:, 2]


def loop_sin(x, a, g):
    return jnp.sin(a * x)


def loop_cos(x, a, g):
    return jnp.cos(a * x)


def loop_sin_cos(x, a, g):
    return jnp.sin(a * x) * jnp.cos(a * x)


#: The hand-written forms that compute JAX's VJP of ``seed`` value for value (``tests/test_derivatives.py``).
SEED_FORMS = {"stored_sin": form_stored_sin, "one_sum": form_one_sum, "complex_pair": form_complex_pair,
              "complex_exp": form_complex_exp, "interleaved": form_interleaved,
              "interleaved_one_sum": form_interleaved_one_sum, "blocked": form_blocked,
              "chained": form_chained}
#: The forms whose ``grad a`` sums its terms in another order (not bit for bit JAX's; the test allows the rounding).
CHANGED_SUMS = {"one_sum", "interleaved", "interleaved_one_sum", "blocked", "chained"}
LOOPS = {"sin": loop_sin, "cos": loop_cos, "sin*cos": loop_sin_cos}


def kernels(compiled, shape) -> list[str]:
    """The full-size kernels of a compiled program, in order: ``loop`` or ``library``, with their transcendentals."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    bodies = dict(re.findall(r"^%(\S+) \(.*?\{\n(.*?)^\}", text, re.S | re.M))
    full = "f32[" + ",".join(map(str, shape)) + "]"
    out = []
    for line in text[text.index("ENTRY"):].splitlines():
        m = re.search(r"= (\S+?)\{.*? fusion\(.*calls=%([\w.-]+)", line)
        if not m or (full not in m.group(1) and "__ynn_fusion" not in line):
            continue
        body = bodies.get(m.group(2), "")
        fns = [f for f in ("sine", "cosine", "exponential") if re.search(rf"\b{f}\(", body)]
        kind = "library" if "__ynn_fusion" in line else "loop"
        out.append(kind + (f" ({'+'.join(fns)})" if fns else ""))
    return out


def _repeats(ks: list[str]) -> list[str]:
    """``ks`` with a pair of kernels repeated back to back written once: ``32 x (loop, library)``."""
    if len(ks) > 4 and len(ks) % 2 == 0 and ks == ks[:2] * (len(ks) // 2):
        return [f"{len(ks) // 2} x ({', '.join(ks[:2])})"]
    return ks


def forms_case(T: int) -> tuple[tuple, dict]:
    """Seed 000's arguments at ``T`` and the programs ``--forms`` times: JAX's VJP (twice: the A/A control), the
    rewrite's, the hand-written forms, and, not VJPs, ``fastmath``'s and ``floor``."""
    vs = {"jax": as_vjp(seed), "jax (A/A)": as_vjp(lambda x, a: seed(x, a)),
          "rewritten": as_vjp(rewrite(seed, rulesets=[derivatives]))}
    vs.update(SEED_FORMS)
    vs["fastmath"] = as_vjp(rewrite(seed, rulesets=[derivatives, derivatives_fastmath]))
    vs["floor"] = seed_floor
    return inputs(T), vs


def forms_report(sizes: list[int], rounds: int, progress: bool) -> str:
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else None
    load = os.getloadavg()
    lines = [
        "# Seed 000's VJP in other forms: what XLA:CPU computes and stores",
        "",
        f"Generated by `python -m benchmarks.derivatives --forms` on {datetime.date.today().isoformat()}: jax "
        f"{jax.__version__}, {jax.devices()[0].platform.upper()} ({platform.machine()}, {os.cpu_count()} cores "
        f"shared; load average {load[0]:.1f} when the run started). {rounds} interleaved rounds a size; `paired` "
        "is the median over rounds of JAX's time over the form's (`Row.paired`, 90% interval); `jax (A/A)` is "
        "JAX's VJP compiled apart. `kernels` lists the full-size loops and library (YNN) reductions of the "
        "compiled program and the transcendentals each computes; XLA:CPU calls libm's `sinf`/`cosf` for each "
        "element of a `sin`/`cos` (LLVM scalarises its vector `sin`), and one `sincosf` where one loop computes "
        "both of one argument. `fastmath` and `floor` are not exact VJPs (see derivatives.md).",
        "",
    ]
    for T in sizes:
        args, vs = forms_case(T)
        n = args[0].size
        row = measure(f"seed000 forms T={T}", vs, args, baseline="jax", rounds=rounds, progress=say)
        lines += [f"## T={T} ({n:,} elements)", "",
                  "| form | ms | ns/element | paired | transcendentals/element | bytes/element | temp MiB | kernels |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, fn in vs.items():
            st = row.stats[name]
            med, lo, hi = row.paired(name)
            ks = _repeats(kernels(compile_stats(fn, *args)[0], args[0].shape))
            lines.append(f"| {name} | {row.seconds[name] * 1e3:.2f} | {row.seconds[name] / n * 1e9:.2f} | "
                         f"{med:.3f} [{lo:.3f}, {hi:.3f}] | {st.transcendentals / n:.0f} | "
                         f"{st.bytes_accessed / n:.0f} | {st.temp_bytes / 2 ** 20:.1f} | {', '.join(ks)} |")
        loops = measure(f"loops T={T}", LOOPS, args, baseline="sin", rounds=rounds, progress=say)
        lines += ["", "One loop over the same elements, writing one array: " + ", ".join(
            f"`{k}` {loops.seconds[k] / n * 1e9:.2f} ns/element" for k in LOOPS) + ".", ""]
    lines.append(f"Load average at the end: {os.getloadavg()[0]:.1f}.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- two more functions
def ising(h, b):
    """Mean-field free energy per spin at inverse temperature ``b`` in field ``h``."""
    return -jnp.log(2.0 * jnp.cosh(b * h)) / b


@jax.custom_vjp
def ising_hand(h, b):
    return ising(h, b)


def _ising_bwd(res, g):
    h, b = res
    t = jnp.tanh(b * h)
    lc = jnp.log(2.0 * jnp.cosh(b * h))
    return -g * t, (g * (lc / b ** 2 - h * t / b)).sum((0, 1))


ising_hand.defvjp(lambda h, b: (ising(h, b), (h, b)), _ising_bwd)


def softplus(z, w):
    return jnp.log1p(jnp.exp(w * z))


@jax.custom_vjp
def softplus_hand(z, w):
    return softplus(z, w)


def _softplus_bwd(res, g):
    z, w = res
    s = g * jax.nn.sigmoid(w * z)
    return s * w, (s * z).sum((0, 1))


softplus_hand.defvjp(lambda z, w: (softplus(z, w), (z, w)), _softplus_bwd)


# ---------------------------------------------------------------------- variants
def as_vjp(fn):
    def vjp(x, a, g):
        return jax.vjp(fn, x, a)[1](g)

    vjp.__name__ = getattr(fn, "__name__", "vjp")
    return vjp


def as_value_and_grad(fn):
    def step(x, a, g):
        return jax.value_and_grad(lambda x, a: (fn(x, a) * g).sum(), (0, 1))(x, a)

    return step


def variants(fn, hands: dict, *, floor=None, wrap=as_vjp, extras: bool = True) -> dict:
    """``jax``, the hand-derived ``hands``, ``rewritten``; with ``extras`` the other rewrites too (see above)."""
    out = {"jax": wrap(fn)}
    for name, h in hands.items():
        out[name] = wrap(h)
    out["rewritten"] = wrap(rewrite(fn, rulesets=[derivatives]))
    if not extras:
        return out
    with warnings.catch_warnings():  # deprecated, kept to show the plain decorator runs the same split
        warnings.filterwarnings("ignore", r"rewrite\(\.\.\., vjp=True\)", DeprecationWarning)
        out["vjp=True"] = wrap(rewrite(fn, rulesets=[derivatives], vjp=True))
    out["rewritten_program"] = rewrite(wrap(fn), rulesets=[derivatives])
    out["measured"] = wrap(rewrite(fn, rulesets=[derivatives], cost_model="measure"))
    out["fastmath"] = wrap(rewrite(fn, rulesets=[derivatives, derivatives_fastmath]))
    if floor is not None:
        out["floor"] = floor
    return out


def inputs(T: int, positive: bool = True):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k1, (B, T, C))
    a = jax.random.uniform(k2, (C,), minval=0.5, maxval=2.0)
    g = jax.random.normal(k3, (B, T, C))
    return x, a, g


SEED_HANDS = {"hand_sin2ax": seed_sin2ax, "hand_shared": seed_shared}


def seed_case(T: int, *, extras: bool = True, floor: bool = True) -> tuple[tuple, dict]:
    """Seed 000 at ``x`` of shape ``(B, T, C)``: its arguments ``(x, a, g)`` and its variants (see :func:`variants`)."""
    return inputs(T), variants(seed, SEED_HANDS, floor=seed_floor if floor else None, extras=extras)


def check(vs: dict, args, baseline: str = "jax") -> None:
    """Every variant that is a VJP computes JAX's gradients (tolerance for float32 reassociation)."""
    want = jax.tree_util.tree_leaves(jax.jit(vs[baseline])(*args))
    for name, fn in vs.items():
        if name == "floor":
            continue
        got = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
        for p, q in zip(got, want):
            err = float(jnp.max(jnp.abs(p - q)) / (jnp.max(jnp.abs(q)) + 1e-30))
            if err > 1e-4:
                raise AssertionError(f"{name} differs from JAX's VJP by {err:.2e} (relative to the largest entry)")


def predicted(vs: dict, args) -> dict[str, float]:
    """The fusion model's price of each variant's jaxpr, relative to JAX's (its predicted speed-up)."""
    model = AnalyticCost()
    price = {}
    for name, fn in vs.items():
        try:
            price[name] = model.program(Program.from_jaxpr(jax.make_jaxpr(fn)(*args), model))
        except Exception:
            continue
    return {n: price["jax"] / p for n, p in price.items() if p > 0}


def run(rounds: int, sizes: list[int], progress: bool) -> tuple[list[Row], list[Row], list[Row], dict]:
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else None
    seed_rows, other_rows, step_rows, preds = [], [], [], {}
    for T in sizes:
        args, vs = seed_case(T)
        check(vs, args)
        preds[f"seed T={T}"] = predicted(vs, args)
        seed_rows.append(measure(f"seed000 T={T}", vs, args, baseline="jax", rounds=rounds, progress=say))
    T = 2048
    args = inputs(T)
    for name, fn, hand in (("ising free energy", ising, ising_hand), ("softplus", softplus, softplus_hand)):
        vs = variants(fn, {"hand": hand})
        check(vs, args)
        preds[f"{name} T={T}"] = predicted(vs, args)
        other_rows.append(measure(f"{name} T={T}", vs, args, baseline="jax", rounds=rounds, progress=say))
    vs = variants(seed, SEED_HANDS, wrap=as_value_and_grad)
    check(vs, args)
    step_rows.append(measure(f"seed000 value_and_grad T={T}", vs, args, baseline="jax", rounds=rounds, progress=say))
    return seed_rows, other_rows, step_rows, preds


def ratio_table(rows: list[Row]) -> str:
    names = list(rows[0].seconds)
    lines = ["| case | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        lines.append(f"| {r.case} | " + " | ".join(f"{r.ratio(n):.2f}x" for n in names) + " |")
    return "\n".join(lines)


def report(seed_rows, other_rows, step_rows, preds, rounds: int, load: tuple) -> str:
    out = [
        "# Backward passes: JAX's VJP, hand-derived VJPs and `jax.vjp(rewrite(f))`",
        "",
        f"Generated by `benchmarks/derivatives.py` on {datetime.date.today().isoformat()}: jax {jax.__version__}, "
        f"{jax.devices()[0].platform.upper()} ({platform.machine()}, {os.cpu_count()} cores shared with other users; "
        f"load average {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f} when the run started). "
        f"{rounds} interleaved rounds per case after warm-up; each figure is a median.",
        "",
        "Caveats: two cores shared with other engineers' jobs, so absolute times drift by 2-3x between runs; "
        "the ratios, taken inside one interleaved run, are what to read, and even they move by about 10%. "
        "No GPU was available. `floor` is not a VJP (it has no transcendental in its reduction): "
        "it bounds what any VJP of this function can reach on this backend.",
        "",
        "## Reading the results",
        "",
        "* On XLA:CPU `sin` and `cos` are libm calls, `sinf`/`cosf` for every element (LLVM scalarises the vector "
        "`sin` XLA emits; the loop's object code calls them), and one `sincosf` (about 1.25x one of them) where one "
        "loop computes both of one argument; a multiply or an `exp` (XLA's own vectorised polynomial) is nearly free "
        "next to them. Speed is the libm calls an element, times the elements.",
        "* XLA:CPU fuses no loop with two outputs, recomputes `sin` and `cos` in every loop that reads them (it "
        "counts them cheap), and its library (YNN) reductions take no transcendental. JAX's VJP computes `sin` in "
        "a loop of its own, stored for `a`'s reduction, and `sin` and `cos` (one `sincosf`) in the gradient's loop. "
        "The rewrite (`trig_sin_stored`) stores `sin` once as a `select` and computes `cos` alone beside it: "
        "`sinf` + `cosf` against `sinf` + `sincosf`. One `sincosf` an element would need one loop to write both "
        "`grad x` and what `a`'s reduction reads; `--forms` (derivatives_forms.md) measures the forms tried.",
        "* `floor` has one loop of `sin` and `cos` (one `sincosf` an element) and is ~1.9x faster: that is the "
        "figure quoted in the issue, and it is not a "
        "VJP of this function (it drops the `sin(ax)**2` term of the gradient of `a`). A VJP that computes both "
        "gradients from one `sin` and one `cos` an element needs one loop for both: `chained` (below) writes them as "
        "slots of one array over blocks of the leading axis, and the pack's `trig_sin2_over` builds it.",
        "* The hand-derived VJPs are slower than JAX's: each computes the reduction from `sin`/`cos` it must "
        "recompute in a third loop (see their transcendental counts). The rewrite never does that.",
        "* `fastmath` adds `a * (g / a) -> g` (no fact says `a != 0`): `grad x` becomes `g * sin(2ax)` read by the "
        "reduction, one pass fewer.",
        "* Ising and softplus: the rewrite turns `sinh/cosh` into `tanh` (two costly functions into one cheap one) "
        "and `exp/(1+exp)` into `logistic`; the latter gains nothing here because XLA:CPU expands `logistic` into "
        "`1/(1+exp(-x))` again, and the cost model (which prices `logistic` as measured) keeps JAX's form.",
        "",
        "## Seed 000, `sin(a*x)**2 / a`, B=32, C=64: speed-up over JAX's VJP",
        "",
        ratio_table(seed_rows),
        "",
        "Times, temp memory (`memory_analysis`), flops and transcendentals (`cost_analysis`):",
        "",
        format_rows(seed_rows),
        "",
        "## Two more functions (T=2048)",
        "",
        ratio_table(other_rows),
        "",
        format_rows(other_rows),
        "",
        "## Seed 000 with its value used (`value_and_grad`, T=2048)",
        "",
        ratio_table(step_rows),
        "",
        format_rows(step_rows),
        "",
        "## What the cost model predicted (fusion model price of JAX's VJP over each variant's)",
        "",
    ]
    names = list(next(iter(preds.values())))
    out.append("| case | " + " | ".join(names) + " |")
    out.append("|---|" + "---|" * len(names))
    for case, p in preds.items():
        out.append(f"| {case} | " + " | ".join(f"{p[n]:.2f}x" if n in p else "-" for n in names) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sizes", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/derivatives.md and .json")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--forms", action="store_true",
                    help="time seed 000's VJP in other forms instead (with --write: results/derivatives_forms.md)")
    args = ap.parse_args(argv)
    if args.forms:
        text = forms_report([int(s) for s in args.sizes.split(",")], args.rounds, args.progress)
        print(text)
        if args.write:
            (Path(__file__).resolve().parent / "results" / "derivatives_forms.md").write_text(text)
        return
    load = os.getloadavg()
    sizes = [int(s) for s in args.sizes.split(",")]
    seed_rows, other_rows, step_rows, preds = run(args.rounds, sizes, args.progress)
    text = report(seed_rows, other_rows, step_rows, preds, args.rounds, load)
    print(text)
    if args.write:
        out = Path(__file__).resolve().parent / "results"
        out.mkdir(exist_ok=True)
        (out / "derivatives.md").write_text(text)
        (out / "derivatives.json").write_text(json.dumps(
            {"load": load, "rows": [r.as_dict() for r in seed_rows + other_rows + step_rows], "predicted": preds},
            indent=1))


if __name__ == "__main__":
    main()
