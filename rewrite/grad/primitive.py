"""Differentiating a rewritten function: each derivative JAX asks for runs a program rewritten for it.

The best program for a gradient is often not the derivative of the best
forward program: the backward pass can read what the forward computed, or
recompute it more cheaply, and identities hold between the two passes that
neither has alone. So when a ``@rewrite`` function is called under a
differentiation trace it is bound as a primitive of its own, ``rewritten``,
whose rules ask the rewriter for the program each transformation needs,
rewriting it the first time it is asked for (once per signature and
transformation) and reusing it after:

* **Reverse mode** (``grad``, ``vjp``, ``value_and_grad``, ``jacrev``). JAX
  linearizes a primitive with its *linearization rule* and then transposes
  the linear part. Ours runs the forward half of the VJP of the rewritten
  forward program, rewritten jointly with its backward half (``rewrite/grad/vjp.py``: one e-graph, the
  residuals chosen by the cost model) and returns the chosen residuals; the
  linear part is a second primitive, ``rewritten_vjp_linear``, whose
  transpose rule is the rewritten backward half. So the program that runs is
  the split ``rewrite(fn, vjp=True)`` builds, from the rewritten forward program
  rather than the original: JAX's own derivative of that program (what ran
  before) is always a candidate, and the forward's choices (an accurate form,
  a loop's checkpoint policy) hold for the gradient too. Where rules of a ``jointly`` ruleset fired in the
  forward (the LM head's token loop), the split is decided on its joint program among the one from that forward,
  the one from the forward rewritten without them, and JAX's own VJP of the function as written, which a
  rewritten one must beat by price and not hold more than (``rewrite/grad/vjp.py``, ``decided_jointly``).
* **Forward mode** (``jvp``, ``jacfwd``; ``linearize``, whose linear part is
  evaluated rather than transposed). The JVP rule runs the rewritten program's JVP,
  ``(primals, tangents) -> (outputs, output tangents)``, rewritten as one
  program. A ``jax.custom_vjp`` has no JVP, which is why ``vjp=True`` cannot
  do this; where a rule built one (attention's recomputing backward), forward
  mode starts from the program as written (``Program.jvp_source``).
* **Higher order** (``hessian``, ``grad`` of ``grad``). The rules above run
  ordinary programs (inlined, not bound as a primitive), which the next
  transformation differentiates as JAX does any program.

Outside differentiation nothing changes: the rewritten forward program is
evaluated in line, so ``jit``, ``vmap``, ``make_jaxpr`` and a rewrite of a
program that calls this one all see its equations. Programs with effects,
and calls whose argument types differ from the traced signature (inside a
``shard_map`` body, for example), also run in line and JAX differentiates
the rewritten forward program. If rewriting a derivative fails, a
:class:`RewriteWarning` says so and JAX differentiates the forward program
(``strict=True`` raises instead).

>>> import jax, jax.numpy as jnp
>>> from rewrite import rewrite
>>> from rulesets.derivatives import derivatives
>>> f = rewrite(lambda x: jnp.sin(x) ** 2, rulesets=[derivatives])
>>> x = jnp.linspace(0.0, 1.0, 4)
>>> bool(jnp.allclose(jax.grad(lambda x: f(x).sum())(x), jnp.sin(2 * x), atol=1e-6))
True
>>> bool(jnp.allclose(jax.jvp(f, (x,), (jnp.ones(4),))[1], jnp.sin(2 * x), atol=1e-6))
True
>>> sorted(f.derivative_rewrites.items())
[('jvp', 1), ('vjp', 1)]
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from typing import Any, Sequence

import jax
from jax.dtypes import float0
from jax.interpreters import batching, mlir

from ..errors import RewriteLimitWarning, RewriteWarning, _strict
from ..ir.jaxapi import ad, core, custom_staging_rules, fallback_linearize, held_weakly_by_jax_caches, register_linearization
from ..ir.walk import loses_forward_mode
from ..jaxpr.trace import Traced, collect_young_only, same_program, spec_of
from ..pipeline import limits_met, program_cost, run_pipeline
from ..records import Budget
from .together import build_vjps
from .vjp import as_written_vjp, build_vjp, decided_jointly, float_positions, of_floats, priced_as, split_joint

log = logging.getLogger("rewrite")

rewritten_p = core.Primitive("rewritten")
rewritten_p.multiple_results = True
rewritten_lin_p = core.Primitive("rewritten_vjp_linear")
rewritten_lin_p.multiple_results = True


@held_weakly_by_jax_caches
class Signature:
    """One signature of a rewritten function, with its derivative programs built on first use.

    ``vjp()`` is the forward/backward split of the function's VJP
    (:class:`rewrite.grad.vjp.VJPResult`), ``jvp()`` its JVP rewritten as one
    program; either is ``None`` if rewriting it failed (a warning says so).
    Bound as the ``program`` parameter of the primitives, so it compares and
    hashes by identity, and JAX's caches keyed by params hold it weakly: it
    lives as long as its function, or a jaxpr that binds it (a pullback
    ``jax.vjp`` returned), and no longer.

    What it keeps is the programs, not the e-graph they were extracted from
    (its egglog instance goes back to the pool, ``rewrite/ir/egraph.py``): a
    signature costs its jaxprs and statistics, some tens of kilobytes, where
    the e-graph of the built-in packs is some 90 MB of native memory. Only
    ``vjp(keep=True)`` (``explain(..., grad=True)``, before the VJP was first
    built) keeps it, for the report's provenance.
    """

    def __init__(self, owner: Any, traced: Traced, result: Any) -> None:
        self.owner = owner
        self.traced = traced
        self.result = result  # the forward's rewrite: its rules' statistics say whether the VJP is decided jointly
        self.forward = result.after
        self._built: dict[str, Any] = {}  # "vjp", "jvp" -> its program, or None if rewriting it failed
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<{getattr(self.owner.fn, '__name__', 'function')} {list(self.traced.closed.in_avals)}>"

    def vjp(self, keep: bool = False) -> Any:
        """The VJP split; ``keep`` keeps its joint e-graph (``joint.egraph``) if this call builds it."""
        return self._once("vjp", keep)

    def jvp(self) -> Any:
        return self._once("jvp")

    def _once(self, kind: str, keep: bool = False) -> Any:
        """The ``kind`` program, built by the first caller (the others wait for it), then kept."""
        found = self._built.get(kind, _UNBUILT)
        if found is _UNBUILT:
            with self._lock:
                found = self._built.get(kind, _UNBUILT)
                if found is _UNBUILT:
                    found = self._built[kind] = self._build(kind, keep)
        return found

    def _of(self, program: core.ClosedJaxpr) -> Traced:
        # The derivative programs start from the rewritten forward program: JAX's derivative of it is
        # what ran before, so it is always a candidate (nothing gets slower), and what the forward
        # rules chose (an accurate form, a loop's checkpoint policy) holds for the gradient too.
        t = self.traced
        return Traced(program, t.in_tree, t.out_tree, t.dynamic)

    def jvp_source(self) -> core.ClosedJaxpr:
        """The program forward mode differentiates: the rewritten forward program, unless a rule built a
        ``jax.custom_vjp`` in it (attention's recomputing backward) that the program as written did not
        have. JAX has no JVP of a ``custom_vjp``, and the blocked primal's own JVP would round its
        uncentred tangents where the original rounds centred ones (bf16 weights); so forward mode
        differentiates the program as written (its JVP is rewritten still) and keeps JAX's derivative."""
        return self.traced.closed if self.breaks_forward_mode(self.forward) else self.forward

    def breaks_forward_mode(self, *programs: core.ClosedJaxpr) -> bool:
        """Whether ``programs`` hold something JAX cannot differentiate in forward mode (a ``jax.custom_vjp``, a
        primitive with no JVP rule) that the program as written does not hold."""
        return loses_forward_mode(self.traced.closed.jaxpr, *(p.jaxpr for p in programs))

    def _build(self, kind: str, keep: bool) -> Any:
        owner = self.owner
        name = getattr(owner.fn, "__name__", "function")
        t = time.perf_counter()
        # what the forward's rewrite left of Limits.seconds (a forward read from the disk cache saturated nothing)
        budget = getattr(self.result, "budget", None) or Budget(owner.limits.seconds)
        try:
            with collect_young_only(), budget.spending(f"the {kind.upper()}"):  # collect_young_only: see there
                built = self._build_kind(kind, keep)
            warned = built.warnings if kind == "vjp" else built.result.warnings
            if warned and _strict(owner.strict):
                raise RuntimeError(f"rewrite of the {kind.upper()} of {name!r} (strict): {'; '.join(warned)}")
            result = built.joint if kind == "vjp" else built.result
            result.budget = budget  # explain(grad=True)'s report says which saturation used the time up
            for said in limits_met(getattr(built, "tried", None) or result, budget):  # (decide.held_alone)
                # the derivative program is rewritten under the same limits, and a user waits on it the same
                warnings.warn(RewriteLimitWarning(f"rewrite of the {kind.upper()} of {name!r} {said}"), stacklevel=2)
        except Exception as e:
            if _strict(owner.strict):
                raise
            msg = (f"rewrite of the {kind.upper()} of {name!r} failed ({type(e).__name__}: {e}); "
                   "JAX differentiates the rewritten forward program instead")
            warnings.warn(RewriteWarning(msg), stacklevel=2)
            log.warning(msg)
            return None
        finally:
            owner.derivative_rewrites[kind] += 1
        log.info("rewrote the %s of %s in %.3f s", kind.upper(), name, time.perf_counter() - t)
        return built

    def _build_kind(self, kind: str, keep: bool) -> Any:
        """The ``kind`` program built: the VJP decided jointly (:func:`decided_jointly`), or the JVP rewritten."""
        owner = self.owner
        if kind == "vjp":
            spent: dict[str, float] = {}
            closed, written = self.traced.closed, []

            def as_written(f: core.ClosedJaxpr, priced: bool = True) -> Any:  # traced once: decided_jointly asks
                if not written or written[0][0] is not f:                        # it of closed
                    written[:] = [(f, as_written_vjp(self._of(f), owner.cost_model, priced))]
                built = written[0][1]
                if priced and built.split.cost != built.split.cost:  # not priced where it was made: priced now
                    priced_as(built, program_cost(built.joint.before, owner.cost_model))
                return built

            def build_both(f: core.ClosedJaxpr, p: core.ClosedJaxpr, rest: Sequence[Any]) -> Any:
                # the forward rewritten without the jointly rules is often the loss as written (flax_seq2seq_grad):
                # its joint program is JAX's as written (the same text), traced once for both, and priced where the
                # joints' e-graph loads it (run_together's price of the plain joint as loaded), not loaded apart
                if not written_as(p, closed):
                    return build_vjps(self._of(f), self._of(p), rest, owner.cost_model, owner.limits, lazy=True)
                aw = as_written(closed, priced=False)
                pending = build_vjps(self._of(f), self._of(p), rest, owner.cost_model, owner.limits, lazy=True,
                                     plain_joint=(aw.joint.before, None))
                priced_as(aw, pending[1].res.cost_before)
                return pending

            built, decided = decided_jointly(
                closed, self.result, owner.entries, owner.cost_model, owner.limits,
                lambda f, entries: build_vjp(self._of(f), entries, owner.cost_model, owner.limits, primal=False,
                                             keep=keep),
                as_written, split_joint, spent, build_both=None if keep else build_both,
                held_to=lambda f: as_written(f, priced=False))
            built.decided = decided
            if "step jointly" in spent:  # decided jointly: every candidate built and priced, the kept one's stages too
                built.times = {**built.times, "decided jointly": spent.get("step joint", 0.0) + spent["step jointly"]}
        else:
            program, dif_in, dif_out = jvp_program(self.jvp_source())
            result = run_pipeline(program, owner.entries, owner.cost_model, owner.limits)
            built = JVP(result.after, dif_in, dif_out, result)
        return built


def written_as(program: core.ClosedJaxpr, closed: core.ClosedJaxpr) -> bool:
    """Whether ``program`` (a forward rewritten without the ``jointly`` rules) is ``closed``, the loss as written:
    the same object, or the same text and constants (:func:`rewrite.jaxpr.trace.same_program`)."""
    return program is closed or same_program(program, closed)


class _Unbuilt:
    pass


_UNBUILT = _Unbuilt()


class JVP:
    """The JVP program ``(primals, tangents of the float inputs) -> (outputs, tangents of the float outputs)``."""

    def __init__(self, program: core.ClosedJaxpr, dif_in: list[int], dif_out: list[int], result: Any) -> None:
        self.program, self.dif_in, self.dif_out, self.result = program, dif_in, dif_out, result


def jvp_program(closed: core.ClosedJaxpr) -> tuple[core.ClosedJaxpr, list[int], list[int]]:
    """``closed``'s JVP traced as one program; returns it and the positions of the float inputs and outputs."""
    in_avals = closed.in_avals
    dif_in, dif_out = float_positions(closed)
    n = len(in_avals)
    fn = core.jaxpr_as_fun(closed)

    def joint(*args: Any) -> list[Any]:
        primals, ts = list(args[:n]), args[n:]
        outs, touts = jax.jvp(of_floats(fn, primals, dif_in), [primals[i] for i in dif_in], list(ts))
        return list(outs) + [touts[i] for i in dif_out]

    specs = [spec_of(a) for a in in_avals] + [spec_of(in_avals[i]) for i in dif_in]
    return jax.make_jaxpr(joint)(*specs), dif_in, dif_out


# ---------------------------------------------------------------------- binding
def bind_if_differentiated(program_of: Any, traced: Traced, flat: Sequence[Any]) -> list[Any] | None:
    """The outputs, if this call is being differentiated and can be bound as a primitive; else ``None``.

    ``program_of()`` gives the signature's :class:`Signature` (made on first use).
    """
    trace = core.trace_ctx.trace
    if not isinstance(trace, (ad.JVPTrace, ad.LinearizeTrace)):
        return None
    closed = traced.closed
    if closed.jaxpr.effects:
        return None  # a derivative program may not repeat or reorder effects: JAX differentiates the forward
    if [core.typeof(x) for x in flat] != list(closed.in_avals):
        log.debug("rewritten %s called with %s, traced at %s: differentiated in line", traced,
                  [core.typeof(x) for x in flat], closed.in_avals)
        return None
    return rewritten_p.bind(*[_strong(x) for x in flat], program=program_of())


def _strong(x: Any) -> Any:
    """``x`` converted to its own dtype where it is a weakly typed float (a Python number): a tracer's primal may be
    a Python float, which ``jax.jvp(f, (1000.,), (1.,))`` keeps so, and the rewritten program, traced at an
    array, holds none of the conversions ``jnp``'s functions make before an operation; the conversion makes the
    primal of every level an array. jax 0.12's JVP rule of ``asinh`` reads its primal's ``dtype``: ``jnp.arcsinh``
    under ``check_grads`` (JAX's ``testOpGradSpecialValue`` routed through the rewriter) raised
    ``AttributeError``. The programs' types are compared weak type aside, so the derivative programs run as before."""
    aval = core.typeof(x)
    if getattr(aval, "weak_type", False) and jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact):
        return jax.lax.convert_element_type(x, aval.dtype)
    return x


_ASKED = threading.local()  # ``vjp_asked``: a caller asked for the VJP itself (``Rewritten.grad_result``)


@contextlib.contextmanager
def vjp_asked():
    """While it is open, :func:`differentiating` says true on this thread: ``Rewritten.grad_result`` builds the VJP
    of the program it rewrites first, outside any JAX trace that would say so."""
    before = getattr(_ASKED, "on", False)
    _ASKED.on = True
    try:
        yield
    finally:
        _ASKED.on = before


def differentiating() -> bool:
    """Whether the program being rewritten now is being rewritten for its VJP: called under ``jax.grad``/``jax.vjp``
    (a differentiating trace, :func:`_differentiated_above`) or for ``grad_result`` (:func:`vjp_asked`). Such a
    forward's pipeline also reads the forward without the ``jointly`` rules off its own e-graph
    (``run_pipeline(plain=True)``), which :func:`rewrite.grad.vjp.decided_jointly` takes instead of saturating the
    program again without them (flax_seq2seq_grad cold: the forward's and the plain forward's pipelines 0.69 ->
    0.60 CPU s in one process, the same program; the log's h-s2s2). A forward rewritten only to be run (a loss's
    ``result``) does not pay that extraction."""
    return getattr(_ASKED, "on", False) or _differentiated_above()


def _differentiated_above() -> bool:
    """Whether the trace a linearization rule runs in (its parent's) is itself differentiating: the program's
    forward half would be differentiated again."""
    trace = core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, (ad.JVPTrace, ad.LinearizeTrace)):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def _eval(closed: core.ClosedJaxpr, *args: Any) -> list[Any]:
    return core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


# ---------------------------------------------------------------------- rewritten_p's rules
def _impl(*args: Any, program: Signature) -> list[Any]:
    return _eval(program.forward, *args)


def _abstract_eval(*avals: Any, program: Signature) -> list[Any]:
    return list(program.forward.out_avals)


def _staging(trace: Any, source_info: Any, *tracers: Any, program: Signature) -> list[Any]:
    # Staged into a jaxpr (jit, make_jaxpr, the parent of a linearization whose tangents are all zero):
    # the forward program's equations, not an opaque call, so a later rewrite or reader sees them.
    with core.set_current_trace(trace):
        return _eval(program.forward, *tracers)


def _batch(args: Sequence[Any], dims: Sequence[Any], *, program: Signature) -> tuple[list[Any], list[int]]:
    outs = jax.vmap(core.jaxpr_as_fun(program.forward), in_axes=tuple(dims), out_axes=0)(*args)
    return list(outs), [0] * len(outs)


def _untracked(dif_in: Sequence[int], nonzero: Sequence[bool]) -> bool:
    """Does a tangent flow into an input the derivative program does not differentiate?

    The program's inputs are chosen by dtype (:func:`rewrite.grad.vjp.float_positions`); should JAX ever
    differentiate an input that choice left out, the program would drop its tangent and give a
    silently zero derivative, so JAX differentiates the forward program instead.
    """
    dif = set(dif_in)
    return any(nz and i not in dif for i, nz in enumerate(nonzero))


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, program: Signature) -> tuple[list[Any], list[Any]]:
    built = program.jvp()
    if built is not None and _untracked(built.dif_in, [type(t) is not ad.Zero and core.typeof(t).dtype != float0
                                                       for t in tangents]):
        log.warning("the rewritten JVP of %s does not differentiate every input JAX does; "
                    "JAX differentiates the forward program", program)
        built = None
    if built is not None and _differentiated_above() and program.breaks_forward_mode(built.program):
        built = None  # differentiated again (see _linearize): JAX's JVP of the program forward mode differentiates
    if built is None:
        ts = [ad.instantiate_zeros(t) for t in tangents]
        outs, touts = jax.jvp(core.jaxpr_as_fun(program.jvp_source()), list(primals), ts)
        return list(outs), list(touts)
    outs = _eval(built.program, *primals, *[ad.instantiate_zeros(tangents[i]) for i in built.dif_in])
    n = len(program.forward.out_avals)
    primal_out, it = outs[:n], iter(outs[n:])
    dif = set(built.dif_out)
    touts = [next(it) if i in dif else ad.Zero(core.typeof(o).to_tangent_aval()) for i, o in enumerate(primal_out)]
    return primal_out, touts


def _linearize(is_vjp: bool, nonzeros: Sequence[bool], *primals: Any, program: Signature) -> Any:
    built = program.vjp() if is_vjp else None
    if built is not None and _untracked(built.dif_in, nonzeros):
        log.warning("the rewritten VJP of %s does not differentiate every input JAX does; "
                    "JAX differentiates the forward program", program)
        built = None
    if built is not None and _differentiated_above() and program.breaks_forward_mode(built.fwd, built.bwd):
        # Differentiated again (jax.jvp of jax.grad: a Hessian-vector product), by a trace that would have to
        # differentiate what a rule built and JAX cannot (cuDNN's fused attention): JAX's linearization of the
        # program forward mode differentiates (jvp_source) instead.
        built = None
    if built is None:
        # jax.linearize evaluates its linear part (forward mode); a failed VJP rewrite lands here too.
        return fallback_linearize(rewritten_p, is_vjp, nonzeros, *primals, program=program)
    n_out = len(program.forward.out_avals)
    outs = _eval(built.fwd, *primals)
    primal_out, residuals = outs[:n_out], outs[n_out:]
    dif = set(built.dif_out)
    nzs_out = [i in dif for i in range(n_out)]

    def linearized(residuals: Sequence[Any], *tangents: Any) -> list[Any]:
        ts = [ad.instantiate_zeros(tangents[i]) for i in built.dif_in]
        touts = iter(rewritten_lin_p.bind(*residuals, *ts, program=program))
        return [next(touts) if nz else ad.Zero(core.typeof(o).to_tangent_aval())
                for nz, o in zip(nzs_out, primal_out)]

    return primal_out, nzs_out, residuals, linearized


rewritten_p.def_impl(_impl)
rewritten_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(rewritten_p, mlir.lower_fun(_impl, multiple_results=True))
custom_staging_rules[rewritten_p] = _staging
batching.primitive_batchers[rewritten_p] = _batch
ad.primitive_jvps[rewritten_p] = _jvp
register_linearization(rewritten_p, _linearize)


# ---------------------------------------------------------------------- rewritten_lin_p's rules
# (residuals, tangents of the float inputs) -> tangents of the float outputs: linear in the tangents,
# and only ever transposed (it is made for reverse mode), by running the rewritten backward program.
def _lin_abstract_eval(*avals: Any, program: Signature) -> list[Any]:
    out_avals = program.forward.out_avals
    return [out_avals[i].to_tangent_aval() for i in program.vjp().dif_out]


def _lin_transpose(cts: Sequence[Any], *args: Any, program: Signature) -> list[Any]:
    built = program.vjp()
    k = len(built.split.residuals)
    residuals, tangents = args[:k], args[k:]
    assert not any(ad.is_undefined_primal(r) for r in residuals), "residuals are known in the backward pass"
    grads = _eval(built.bwd, *residuals, *[ad.instantiate_zeros(c) for c in cts])
    return [None] * k + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, tangents)]


rewritten_lin_p.def_abstract_eval(_lin_abstract_eval)
ad.primitive_transposes[rewritten_lin_p] = _lin_transpose
