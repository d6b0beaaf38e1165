"""The public entry points: the function that ``@rewrite`` returns, and ``explain``.

It traces once per input signature (the tree structure, shapes, dtypes and
weak types of the arguments, plus static arguments), rewrites, caches the
result, and evaluates the rewritten jaxpr by binding its primitives. That
binding happens under whatever transformation is active, so the result
composes with ``jit``, ``grad``, ``vjp``, ``vmap`` and sharded inputs like any
JAX code. A repeated call with the same signature never saturates again.

A failure inside the rewriter never reaches the user's program: it is
reported as a :class:`RewriteWarning` and the original program runs. Set
``strict=True`` (or ``REWRITE_STRICT=1``) to raise instead.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import sys
import threading
import time
import warnings
from typing import Any, Callable, Mapping, Sequence

import jax

from .cache import store as _cache
from .cache.fingerprint import program_fingerprint
from .cache.key import make_key
from .cost import guard as _guard
from .cost.measure import resolve
from .errors import RewriteLimitWarning, RewriteWarning, _strict
from .extract.lean import closed_keep_leaner
from .grad.primitive import Signature, bind_if_differentiated, differentiating, vjp_asked
from .grad.pinned import PIN_FROM, as_is, fused_only, join_pinned, packs_only, split_pinned, wholly_pinned
from .grad.step import AsWritten, find_losses, proof_graph, searches_steps
from .grad.together import rewrite_alone, rewrite_joints
from .grad.uses import as_run
from .grad.vjp import VJPResult, build_vjp, decided_jointly, joint_at
from .ir.jaxapi import core
from .jaxpr import state as _state
from .jaxpr.emit import jitted_program
from .jaxpr.trace import (CONCRETIZATION_ERRORS, Traced, as_operand, check_function, collect_young_only,
                          concrete_operands, flatten_args, resolve_static, same_program, trace, trace_call)
from .jaxpr.metadata import EagerKeys
from .pipeline import limits_met, program_cost, run_pipeline, saturated_classes
from .records import STEP_STAGES, Budget, Limits, Result, lap, stage
from .report.report import Report, _fixed_cost, gradient_report, report_of
from .rules.ruleset import Ruleset, entries_of, named_packs

log = logging.getLogger("rewrite")


def builtin_packs(loaded: bool = False) -> Mapping[str, Ruleset]:
    """The built-in packs by name (``rulesets=["algebra", ...]``; ``loaded``: only those loaded already): the
    ``rulesets`` package, built on this one, resolved here at the top so that nothing in the core imports it."""
    import rulesets  # built on rewrite: imported when a name is first resolved, never at import time
    return {n: vars(rulesets)[n] for n in rulesets.PACKS if n in vars(rulesets)} if loaded else rulesets.BUILTIN


def _outputs(traced: Traced, values: Sequence[Any], nodes: tuple) -> Any:
    """The call's result; the new values of the nnx Variables it replaced are written into ``nodes``."""
    out = traced.outputs(values)
    if not traced.carries_state:
        return out
    out, updates = out
    _state.apply(nodes, updates)
    return out


def fallback_result(traced: Traced, stopped: str) -> Result:
    return Result(before=traced.closed, after=traced.closed, cost_before=float("nan"), cost_after=float("nan"),
                  stopped=stopped, iterations=0, rows=0, times={}, stats={}, rewritten=False, warnings=[stopped])


class Rewritten:
    """A function whose program is rewritten once per input signature. Made by :func:`rewrite`.

    Calling it runs the rewritten program; :meth:`jaxpr` gives that program and :meth:`result` the whole pipeline
    result (costs, stop reason, per-rule stats) for a signature, rewriting it first if needed. ``rewrites`` counts
    the signatures rewritten so far, ``loaded`` those of them read from the disk cache instead (their
    ``result(...).cached`` names the entry), and ``__wrapped__`` is the original function.

    >>> import jax, jax.numpy as jnp
    >>> from rewrite import rewrite
    >>> f = rewrite(lambda x: jnp.sin(x) * 2 + jnp.sin(x) * 2)  # no rules: duplicates still merge
    >>> [e.primitive.name for e in f.jaxpr(jnp.ones(3)).eqns]
    ['sin', 'mul', 'add']
    >>> _ = f(jnp.ones(3)), jax.jit(f)(jnp.zeros(3)), f(jnp.ones(4))
    >>> f.rewrites
    2
    """

    def __init__(self, fn: Callable[..., Any], rulesets: Any, cost_model: Any, limits: Limits | None,
                 static_argnums: Sequence[int], static_argnames: Sequence[str], strict: bool | None,
                 cache: Any = None, guard: Any = False, whole_step: bool | None = None) -> None:
        functools.update_wrapper(self, fn)
        # what it was made of: a pickle holds these (no program of this process) and makes the function again
        self._made = (fn, rulesets, cost_model, limits, static_argnums, static_argnames, strict, cache, guard,
                      whole_step)
        self.fn, self.entries = fn, entries_of(rulesets, builtin_packs)
        self.cost_model, self.limits = resolve(cost_model), Limits.of(limits)
        self.static_argnums, self.static_argnames = resolve_static(fn, static_argnums, static_argnames)
        self._trace_floats, self.strict = True, strict  # Python floats are traced until one steers control flow
        self._cache: dict[Any, tuple[Traced, Result]] = EagerKeys()  # (a key's metadata compared eagerly)
        self._lock, self._warned = threading.RLock(), set()  # reentrant: it may call itself as it is traced
        self.rewrites = 0  # how many times a program was rewritten (cache misses)
        self.disk = _cache.resolve(cache)  # the disk cache (rewrite/cache/store.py), or None
        self.loaded = 0  # of those, how many were read from the disk cache instead
        self.guard = _guard.Guard() if guard is True else (guard or None)
        #: derivative programs rewritten so far, by transformation ("vjp", "jvp"); see rewrite/grad/primitive.py
        self.derivative_rewrites: collections.Counter = collections.Counter()
        self._programs: dict[Any, Any] = EagerKeys()
        self._jitted: dict[Any, tuple[core.ClosedJaxpr, Any]] = EagerKeys()  # key -> (program, jax.jit of it)
        #: look for a loss whose gradients the program holds (a training step: rewrite/grad/step.py, searches_steps)
        self.whole_step, self.step_by_default = searches_steps(self.entries, whole_step), whole_step is None

    def __reduce__(self) -> Any:
        """By name where its module holds it (``@rewrite`` on a module's function), else made again from its making"""
        held = sys.modules.get(self.__module__) if self.__module__ != "__main__" else None
        for part in self.__qualname__.split("."):
            held = getattr(held, part, None)
        fn, packs, *rest = self._made  # the built-in packs by name: found again, not copied rule by rule
        return self.__qualname__ if held is self else (type(self), (fn, named_packs(packs, builtin_packs(True)), *rest))

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[Any, list[Any], tuple[Traced, Result], tuple]:
        """The call's cache key, program operands, (traced, result) entry, and nnx nodes (``state.lift``)."""
        try:
            return self._lookup(args, kwargs)
        except CONCRETIZATION_ERRORS as e:
            if not self._trace_floats or not any(type(x) in (float, complex) for x in (*args, *kwargs.values())):
                raise
            # A Python float argument steers Python control flow (jax.jit fails here): such arguments are
            # static from now on, as they were before they were traced, and the warning says what it costs.
            self._trace_floats = False
            warnings.warn(RewriteWarning(
                f"{getattr(self.fn, '__name__', 'function')!r} branches in Python on a float argument "
                f"({type(e).__name__}); its Python float arguments are static from now on, so each new value "
                "is rewritten again: name them in static_argnums/static_argnames to say so, or pass arrays to "
                "trace them"), stacklevel=3)
            return self._lookup(args, kwargs)

    def _lookup(self, args: tuple, kwargs: dict) -> tuple[Any, list[Any], tuple[Traced, Result], tuple]:
        leaves, in_tree, specs, key, stat_args, stat_kwargs, nodes = flatten_args(
            args, kwargs, self.static_argnums, self.static_argnames, trace_floats=self._trace_floats)
        entry = self._cache.get(key)
        traced = None
        if entry is not None and entry[0].retraced:
            # The function closed over values of an outer trace, or holds hijax values (Traced.retraced): it is
            # traced again, and the rewrite is reused only if that trace is the same program.
            traced = trace(self.fn, specs, in_tree, stat_args, stat_kwargs, len(args))
            if not same_program(traced.closed, entry[0].closed):
                entry = None
        if entry is None:
            with self._lock:
                entry = self._cache.get(key) if traced is None else None
                if entry is None:
                    t = time.perf_counter()
                    if traced is None:
                        traced = trace(self.fn, specs, in_tree, stat_args, stat_kwargs, len(args))
                    trace_time = time.perf_counter() - t
                    # the cache keeps no tracer: they belong to this call's trace
                    kept = dataclasses.replace(traced, captured=())
                    entry = (kept, self._rewrite(kept, concrete_operands(leaves, traced)))
                    entry[1].times["trace"] = trace_time
                    self._cache[key] = entry
                    self.rewrites += 1
        if entry[0].retraced and traced is None:  # another thread rewrote it first
            traced = trace(self.fn, specs, in_tree, stat_args, stat_kwargs, len(args))
        captured = traced.captured if traced is not None else ()
        flat = [as_operand(x) for x, d in zip(leaves, entry[0].dynamic) if d] + list(captured)
        return key, flat, entry, nodes

    @collect_young_only()  # a first call, whole: the cache's key, load and store, the pipelines, pricings, searches
    def _rewrite(self, traced: Traced, args: Sequence[Any] | None = None) -> Result:
        """The result for one traced program: from the disk cache, else rewritten (and guarded, timed on
        ``args``, the call's operands if concrete) and stored."""
        t = time.perf_counter()
        key, program = self._disk_key(traced)
        key_time = time.perf_counter() - t
        if key is not None:
            t = time.perf_counter()
            found = self.disk.load(key, traced.closed, program)
            if found is not None:
                result = _cache.result_from(traced.closed, *found, where=str(self.disk.file(key)))
                result.times["cache_key"] = key_time
                result.times["cache_load"] = time.perf_counter() - t
                self.loaded += 1
                log.info("rewrite of %s read from the cache: %s", getattr(self.fn, "__name__", "function"),
                         result.cached)
                return result
        result = self._rewrite_fresh(traced)
        failed = result.stopped.startswith("error:")
        if self.guard is not None and not failed:
            self._guard(result, args)
        if key is not None and not failed:
            result.times["cache_key"] = key_time
            t = time.perf_counter()
            self.disk.store(key, None if result.after is traced.closed else result.after, _cache.result_meta(result),
                            traced.closed, program)
            result.times["cache_store"] = time.perf_counter() - t
        return result

    def _disk_key(self, traced: Traced) -> tuple[str | None, str | None]:
        """The disk cache's key for this program, and the program's own fingerprint; ``None`` if uncacheable."""
        if self.disk is None:
            return None, None
        try:
            program = program_fingerprint(traced.closed)
            return make_key(traced.closed, self.entries, self.cost_model, self.limits, program,
                            guard=self.guard), program
        except Exception as e:  # Unstable: a rule or a param with no stable identity
            msg = (f"the rewrite cache is off for {getattr(self.fn, '__name__', 'function')!r}: its key cannot be "
                   f"made ({type(e).__name__}: {e}); each process rewrites it afresh")
            if msg not in self._warned:
                self._warned.add(msg)
                log.warning(msg)
                warnings.warn(RewriteWarning(msg), stacklevel=5)
            return None, None

    def _guard(self, result: Result, args: Sequence[Any] | None) -> None:
        t = time.perf_counter()
        name = getattr(self.fn, "__name__", "function")
        untimed = self.guard.untimed(self._predicted(result)) if result.rewritten else None
        if untimed is not None:
            result.guard = _guard.GuardDecision("rewritten", None, None, untimed)
            result.times["guard"] = time.perf_counter() - t
            return
        chosen = result.after
        try:
            # an unchanged program is passed as ``before`` itself, which the guard keeps without timing
            after = result.after if result.rewritten else result.before
            result.after, result.guard = _guard.guard(result.before, after, self.guard, args)
        except Exception as e:
            if _strict(self.strict):
                raise
            result.after = result.before
            result.guard = _guard.GuardDecision("original", None, None, f"timing failed: {type(e).__name__}: {e}")
        if result.after is not chosen:  # not the extraction's program: what it used is not known (decided_jointly)
            result.jointly_chosen = result.used = None
        if result.guard.seconds_original is None and result.rewritten:
            warnings.warn(RewriteWarning(f"the guard could not time {name!r} ({result.guard.reason}); "
                                         "keeping the original program"), stacklevel=5)
        result.times["guard"] = time.perf_counter() - t

    def _predicted(self, result: Result) -> float:
        """The model's predicted speed-up of the rewrite, a call's fixed cost included where the model has one."""
        before = result.cost_before + _fixed_cost(self.cost_model, result.before)  # each its dispatch (cost/dispatch.py)
        after = result.cost_after + _fixed_cost(self.cost_model, result.before if result.after is None else result.after)
        return before / after if after > 0 else float("nan")

    def _fall_back(self, e: Exception, what: str, instead: str) -> None:
        """Called while ``e`` is handled: re-raise it under strict; else say, as a warning at the user's call
        and in the log, that ``what`` failed and what runs ``instead``."""
        if _strict(self.strict):
            raise
        msg = f"{what} failed ({type(e).__name__}: {e}); {instead}"
        warnings.warn(RewriteWarning(msg), stacklevel=5)  # where the callers pointed (4 frames up from them)
        log.warning(msg)

    def _rewrite_fresh(self, traced: Traced) -> Result:
        name = getattr(self.fn, "__name__", "function")
        budget = Budget(self.limits.seconds)  # all this signature's saturations, its derivatives' too (Limits)
        try:
            with budget.spending():
                result = self._whole_step(traced)
        except Exception as e:
            self._fall_back(e, f"rewrite of {name!r}", "running it unchanged")
            return fallback_result(traced, f"error: {type(e).__name__}: {e}")
        result.budget = budget
        if result.warnings and _strict(self.strict):
            raise RuntimeError(f"rewrite of {name!r} (strict): {'; '.join(result.warnings)}")
        for said in limits_met(result, budget):
            key = said.split(" after ")[0].split(" (")[0]  # once per reason, whatever the counts
            if key not in self._warned:
                self._warned.add(key)
                warnings.warn(RewriteLimitWarning(f"rewrite of {name!r} {said}"), stacklevel=4)
        for w in result.warnings:
            if w not in self._warned:
                self._warned.add(w)
                warnings.warn(RewriteWarning(w), stacklevel=4)
        fired = {k: s.fired for k, s in result.stats.items() if s.fired}
        log.info("rewrote %s: cost %.4g -> %.4g (%s), %s, fired %s", name, result.cost_before, result.cost_after,
                 result.why or "input kept", result.stopped, fired)
        return result

    def _whole_step(self, traced: Traced, result: Result | None = None) -> Result:
        """A training step: each loss whose gradients the step holds, proven so (``rewrite/grad/step.py``), read
        from the loss-first program instead; the step so changed is rewritten, and kept where it is priced below
        the step as written. ``result`` is the step as written, rewritten, where a caller has it (``explain``);
        otherwise it is made here only where it is needed: where no loss is replaced, or where the step with
        its losses replaced neither prices below the step as written unrewritten nor, each loss's derivative kept
        over JAX's as written (as ``jax.grad(rewrite(loss))`` decides it), keeps leaner than it as loaded on the
        model's lean bands. Then the cheaper of the two rewritten steps is kept (or the leaner within those bands).

        The result's ``times`` hold the search's seconds as ``whole_step`` and its parts, which sum to it
        (:data:`rewrite.records.STEP_STAGES`): ``step find`` (the candidates, their re-derivations and proofs, the
        replacement), ``step forward`` and ``step joint`` (each loss's forward rewritten, and its VJP jointly,
        ``_loss_first``; where a ``jointly`` ruleset fired, both joints), ``step jointly`` (the forward without
        it, and the choice), ``step rest`` (the step so changed, rewritten and priced) and ``step price`` (the step
        as written, priced; read off the proofs' load, ``StepFinding.price``, where it can be, in ``step find``)."""
        def as_written(price: float | None = None) -> Result:  # (``price``: the step's, priced already, not again)
            with stage("the step as written" if self.whole_step and self.entries else "the program"):
                return result if result is not None else run_pipeline(
                    traced, self.entries, self.cost_model, self.limits, input_price=price, plain=differentiating())

        def timed(kept: Result) -> Result:
            spent["step find"] = finding.seconds - sum(spent.get(k, 0.0) for k in STEP_STAGES[1:4])
            kept.times.update({k: spent.get(k, 0.0) for k in STEP_STAGES})
            kept.times["whole_step"] = sum(spent.get(k, 0.0) for k in STEP_STAGES)
            return kept

        if not self.whole_step or not self.entries:
            return as_written()
        spent: dict[str, float] = {}
        small = self.step_by_default and len(traced.closed.jaxpr.eqns) < PIN_FROM  # (grad.step.AsWritten)
        try:
            pinned: set = set()  # (the proofs saturate with no rule: a step is loaded once for all, proof_graph)
            decided: list[str] = []
            kept: list[bool] = []  # for each loss-first program, whether it is JAX's derivative as written
            loss_first = functools.partial(self._loss_first, spent=spent, decided=decided, small=small, forwards={},
                                           kept=kept)
            # a small step's loss whose forward comes out as written is left so before its proof (grad.step._attempt)
            changed, finding = find_losses(traced.closed, self._proof, loss_first, pinned,
                                           functools.partial(proof_graph, model=self.cost_model), price=result is None,
                                           left_as_written=functools.partial(loss_first, written_only=True)
                                           if small else None)
            finding.decided = decided
            alt = None
            if changed is not None:
                t = time.perf_counter()
                before = result.cost_before if result is not None else finding.price  # off the proofs' load
                before = program_cost(traced.closed, self.cost_model) if before is None else before
                t = lap(spent, "step price", t)
                with stage("the step's rest"):  # a remainder XLA fuses, as it is, where that may come under before
                    alt = self._rewrite_rest(changed, pinned, fused=not all(kept))
                    if alt.stopped == "fused" and not alt.cost_after < before:
                        alt = self._rewrite_rest(changed, pinned, fused=False)
                lap(spent, "step rest", t)
        except Exception as e:  # the step as written, rewritten, still runs
            self._fall_back(e, f"the whole-step search of {getattr(self.fn, '__name__', 'function')!r}",
                            "running the step rewritten as written")
            return as_written()
        if result is not None:
            result.step = finding
        if alt is None:
            written = as_written()
            written.step = finding
            return timed(written)  # the search ran, though its step was not kept
        if alt.cost_after < before:
            # priced below the step as written: kept, the step as written not saturated (most of a step's rewrite)
            return timed(self._replaced(traced, alt, finding, before, f"priced {alt.cost_after:.4g}, below the "
                                        f"step as written ({before:.4g})"))
        leaner = functools.partial(closed_keep_leaner, self.cost_model, alt.cost_after, alt.after)  # (extract/lean.py)
        if result is None and kept and not any(kept):  # each loss's derivative kept over JAX's as written
            t = time.perf_counter()  # (vjp.py's decided_jointly): held to the step as written as loaded, on those bands
            loaded = run_pipeline(traced, (), self.cost_model, self.limits, input_price=before)
            lap(spent, "step price", t)
            if leaner(loaded.cost_after, loaded.after):
                return timed(self._replaced(traced, alt, finding, before, f"priced {alt.cost_after:.4g} against the "
                                            f"step as written ({loaded.cost_after:.4g}), leaner on the model's lean "
                                            "bands as each loss's derivative was: the step as written not rewritten"))
        written = as_written(before)
        written.step = finding
        cheaper = alt.cost_after < written.cost_after
        if cheaper or leaner(written.cost_after, written.after):
            return timed(self._replaced(traced, alt, finding, written.cost_before, "" if cheaper else (
                f"priced {alt.cost_after:.4g} against {written.cost_after:.4g}, within the model's lean band, and "
                "predicted to hold less memory")))
        finding.declined.append(f"the step with them replaced was priced {alt.cost_after:.4g}, the step rewritten "
                                f"as written {written.cost_after:.4g}: kept the latter")
        return timed(written)

    def _rewrite_rest(self, changed: core.ClosedJaxpr, pinned: set, fused: bool = True) -> Result:
        """The step with its losses replaced, rewritten: its loss-first programs are rewritten already (each jointly
        with its forward, ``_loss_first``), so only the remainder (the optimizer's update, what computes the losses'
        inputs) is saturated, and the step so joined priced as it is (loaded with no rule: what both parts compute
        is priced once, as XLA computes it once); where it cannot be cut so, all of it is rewritten. ``fused``: a
        remainder XLA fuses as it is (``grad.pinned.fused_only``) is not saturated where the rules are the packs'
        (``packs_only``) and the step so priced comes under the step as written (the caller's test, and ``kept``)."""
        whole = wholly_pinned(changed, pinned)  # its loss-first programs only, each rewritten jointly
        cut = None if whole else split_pinned(changed, pinned)
        fused = fused and cut is not None and fused_only(cut.rest) and packs_only(self.entries, builtin_packs(True))
        if whole or fused:  # priced as is
            return as_is(changed, self.cost_model, "pinned" if whole else "fused")
        if cut is None:
            return run_pipeline(changed, self.entries, self.cost_model, self.limits)
        rest = run_pipeline(cut.rest, self.entries, self.cost_model, self.limits, price_input=False)
        joined = join_pinned(cut, rest.after)
        if joined is None:
            return run_pipeline(changed, self.entries, self.cost_model, self.limits)
        t = time.perf_counter()
        cost = program_cost(joined, self.cost_model)
        times = {**rest.times, "price": time.perf_counter() - t}
        return dataclasses.replace(rest, before=changed, after=joined, cost_before=float("nan"), cost_after=cost,
                                   rewritten=True, times=times, used=None)

    @staticmethod
    def _replaced(traced: Traced, alt: Result, finding: Any, cost_before: float, how: str) -> Result:
        alt.before, alt.cost_before, alt.rewritten, alt.step = traced.closed, cost_before, True, finding
        alt.why = (f"the step's loss and gradients read from the loss-first program ({finding}"
                   + (f", {how}" if how else "") + "); " + (alt.why or "its program kept as built"))
        return alt

    def _proof(self, program: core.ClosedJaxpr) -> list[Any]:
        """``program``'s outputs' classes, saturated with no rules: equal values share one (``find_losses``'s proof)."""
        return saturated_classes(program, (), self.limits)

    def _loss_first(self, cone: core.ClosedJaxpr, spent: dict[str, float] | None = None,
                    decided: list[str] | None = None, wrt: Sequence[int] | None = None, kept: list | None = None,
                    value: bool | None = None, written: core.ClosedJaxpr | None = None, small: bool = False,
                    forwards: dict | None = None, written_only: bool = False, held: Any = None) -> Any:
        """A loss's VJP as ``jax.value_and_grad(rewrite(loss))`` runs it, with these rules, as one program
        ``(primals, cotangent) -> (loss, gradients)``: JAX's VJP of the rewritten forward, rewritten, decided on
        that joint program where a ``jointly`` ruleset's rules fired in the forward, and held to JAX's joint of the
        loss as written (:func:`rewrite.grad.vjp.decided_jointly`), as the derivative rules decide it
        (``grad/primitive.py``). ``decided``, where given, receives that decision in words; ``wrt``, where given,
        the positions of the float inputs whose gradients the step reads (the program has only those), and ``value``
        whether it reads the loss (:func:`rewrite.grad.together.rewrite_alone`); ``written``, where given, JAX's joint
        program of ``cone`` as written at ``wrt``, traced already (:func:`rewrite.grad.step.rederive`): not traced
        again, for ``cone`` nor a forward that is the same program (:func:`rewrite.grad.vjp.joint_at`). ``forwards``,
        where given, keeps each cone's forward by the cone's ``id`` (with the cone), so that ``written_only`` (raise
        ``AsWritten`` or return ``None``: the search's test before a proof) and the build after it run one pipeline.
        ``held``: JAX's joint of ``cone`` at ``wrt`` read off one traced at every float leaf (``grad.uses.sliced``)."""
        # only the programs that come out are read: the inputs are not priced
        spent = {} if spent is None else spent
        t = time.perf_counter()
        forwards = {} if forwards is None else forwards
        if forwards.get(id(cone), (None,))[0] is not cone:
            with stage("a loss's forward"):
                forwards[id(cone)] = (cone, run_pipeline(cone, self.entries, self.cost_model, self.limits,
                                                         price_input=False, plain=True))
        forward = forwards[id(cone)][1]
        t = lap(spent, "step forward", t)
        if small and not forward.rewritten:
            raise AsWritten("a small step's loss whose forward comes out as written: left as written, JAX's VJP in "
                            "the step (grad.step.AsWritten)")
        if written_only:
            return None
        priced: list = []  # the joint programs priced whole as they were chosen: decided_jointly does not price again
        # a step reading only the gradients runs each candidate without the loss (XLA drops what only it reads): each
        # is priced and held to memory so (the stored sin of seed 000's pullback costs more with the loss kept)
        run = as_run(len(cone.out_avals), value)
        known = written if written is not None else held  # JAX's joint of the cone at wrt, traced already
        trace = functools.partial(joint_at, wrt=wrt, written=None if known is None else (cone, known))
        with stage("a loss's joint"):
            program, why = decided_jointly(
                cone, forward, self.entries, self.cost_model, self.limits, lambda f, entries: rewrite_alone(
                    f, entries, self.cost_model, self.limits, wrt, value, seen=priced, trace=trace), trace,
                joint_of=run, spent=spent, priced=priced, build_both=lambda f, p, rest: rewrite_joints(
                    f, p, rest, self.cost_model, self.limits, wrt, value, priced, trace,
                    (forward.cost_after, forward.plain_cost) if p is forward.plain else None),
                held_to=None if held is None else lambda _: held)  # (decided_jointly asks it of cone alone)
        if why and decided is not None:
            decided.append(why)
        if kept is not None:  # (Rewritten._rewrite_rest's ``fused``)
            kept.append(written is not None and program is written)
        return program

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if jax.config.jax_disable_jit:  # as jax.jit there: the function as written, one operation at a time
            return self.fn(*args, **kwargs)
        key, flat, (traced, result), nodes = self._prepare(args, kwargs)
        closed = result.after
        # Under grad/jvp the derivative rules run derivative programs rewritten for them (rewrite/grad/primitive.py).
        outs = bind_if_differentiated(lambda: self._program(key, traced, result), traced, flat)
        if outs is None and traced.jitted:
            # fn was a jitted function, whose jit the trace inlined: the rewritten program runs compiled
            # too, not one operation at a time (which an eager call of eval_jaxpr would do)
            outs = self._compiled(key, closed)(*flat)
        if outs is None:
            outs = core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)
        return _outputs(traced, outs, nodes)

    def _compiled(self, key: Any, closed: core.ClosedJaxpr) -> Callable[..., Any]:
        found = self._jitted.get(key)
        if found is None or found[0] is not closed:
            found = (closed, jitted_program(closed, self.fn))
            self._jitted[key] = found
        return found[1]

    def _program(self, key: Any, traced: Traced, result: Result) -> Any:
        program = self._programs.get(key)
        if program is None:
            with self._lock:
                program = self._programs.setdefault(key, Signature(self, traced, result))
        return program

    def grad_result(self, *args: Any, **kwargs: Any) -> Any:
        """The rewritten VJP for these arguments' signature (:class:`rewrite.grad.vjp.VJPResult`), built if needed.

        It is what ``jax.grad``/``jax.vjp`` of this function run: the forward
        program (``.fwd``: primals -> outputs + residuals), the backward one
        (``.bwd``: residuals + cotangents -> gradients), the residual split
        chosen and the splits considered. ``None`` if its rewrite failed.
        """
        with vjp_asked():  # the forward rewritten here is for its VJP (grad.primitive.differentiating)
            return self._signature(args, kwargs).vjp()

    def _signature(self, args: tuple, kwargs: dict) -> Signature:
        key, _, (traced, result), _ = self._prepare(args, kwargs)
        return self._program(key, traced, result)

    def vjp_jaxprs(self, *args: Any, **kwargs: Any) -> tuple[core.ClosedJaxpr, core.ClosedJaxpr]:
        """The forward (primals -> outputs + residuals) and backward (residuals + cotangents -> gradients) programs."""
        built = self.grad_result(*args, **kwargs)
        if built is None:
            raise RuntimeError("the VJP was not rewritten (see the RewriteWarning); JAX differentiates the forward")
        return built.fwd, built.bwd

    def jvp_jaxpr(self, *args: Any, **kwargs: Any) -> core.ClosedJaxpr:
        """The JVP program that ``jax.jvp`` of this function runs: (primals, tangents) -> (outputs, tangents)."""
        built = self._signature(args, kwargs).jvp()
        if built is None:
            raise RuntimeError("the JVP was not rewritten (see the RewriteWarning); JAX differentiates the forward")
        return built.program

    def jaxpr(self, *args: Any, **kwargs: Any) -> core.ClosedJaxpr:
        """The rewritten program for these arguments' signature."""
        return self._prepare(args, kwargs)[2][1].after

    def result(self, *args: Any, **kwargs: Any) -> Result:
        return self._prepare(args, kwargs)[2][1]

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Methods: bind like a plain function would.
        return self if obj is None else functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"<rewritten {getattr(self.fn, '__name__', 'function')}: {len(self.entries)} rules, {len(self._cache)} cached signatures>"


def rewrite(fn: Callable[..., Any] | None = None, *, rulesets: Any = (), cost_model: Any = None,
            limits: Limits | None = None, static_argnums: Sequence[int] = (), static_argnames: Sequence[str] = (),
            strict: bool | None = None, vjp: bool = False, cache: Any = None, guard: Any = False,
            whole_step: bool | None = None) -> Any:
    """Rewrite ``fn``'s program with the given rulesets; returns a function with the same signature.

    Usable directly or as a decorator. The program is traced once per input signature, saturated with the rules,
    and the cheapest equivalent program under ``cost_model`` runs in its place. ``limits`` bounds saturation
    (``Limits.seconds`` the time of all one signature's saturations, its derivatives' too). ``cost_model`` is
    ``None``/``"analytic"`` (predicted), ``"measure"`` (the best candidates timed on the backend) or a
    :class:`rewrite.CostModel` (a plain function is a node price alone: :class:`rewrite.NodeCost`).

    Differentiating the result runs programs rewritten for the derivative
    asked for (``rewrite/grad/primitive.py``): ``jax.grad``/``jax.vjp`` run ``fn``'s
    VJP rewritten as one program and split into forward and backward passes
    at the residuals the cost model prefers; ``jax.jvp``/``jax.jacfwd`` run
    ``fn``'s JVP rewritten. Each is rewritten the first time it is asked for,
    once per signature. ``vjp=True`` (a ``jax.custom_vjp`` over the same
    split, rewritten eagerly, without forward mode) is deprecated.

    ``cache`` is where rewritten programs are kept across processes
    (``rewrite/cache/store.py``): ``None`` for the default (``$JAX_REWRITE_CACHE_DIR``,
    else ``~/.cache/jax-rewrite``), a directory, or ``False`` for none. With
    ``guard=True`` (or a :class:`rewrite.cost.guard.Guard` with timing settings),
    the first rewrite of each signature times the original and the rewritten
    program side by side and keeps the faster (``rewrite/cost/guard.py``); the
    decision is in ``result(...).guard`` and in the cache entry.

    ``whole_step``: a training step that holds JAX's backward of a loss (``jax.value_and_grad`` inside the
    step) has that loss found, its gradients proven equal to JAX's VJP of it by re-derivation, and both read
    from the loss-first program, as ``jax.value_and_grad(rewrite(loss))`` would run it
    (``rewrite/grad/step.py``, docs/steps.md); the cheaper of that and the step as written is kept. ``None``
    (the default) searches when the rulesets hold ``rulesets.attention`` or the LM head's rules
    (``rulesets.nn``), and leaves as written a small step's loss whose forward no rule rewrites (``grad.step.AsWritten``),
    ``True`` always, ``False`` never.

    >>> import jax, jax.numpy as jnp
    >>> from rewrite import rewrite, rule, Ruleset
    >>> double_angle = Ruleset("trig", [rule(lambda x: 2 * jnp.sin(x) * jnp.cos(x),
    ...                                      lambda x: jnp.sin(2 * x), name="double_angle")], soundness="identity")
    >>> @rewrite(rulesets=[double_angle])
    ... def f(x):
    ...     return 2 * jnp.sin(x) * jnp.cos(x)
    >>> x = jnp.linspace(0.0, 1.0, 5)
    >>> bool(jnp.allclose(f(x), jnp.sin(2 * x), atol=1e-6))
    True
    >>> [e.primitive.name for e in f.jaxpr(x).eqns]
    ['mul', 'sin']
    """
    if fn is None:
        return functools.partial(rewrite, rulesets=rulesets, cost_model=cost_model, limits=limits,
                                 static_argnums=static_argnums, static_argnames=static_argnames, strict=strict,
                                 vjp=vjp, cache=cache, guard=guard, whole_step=whole_step)
    check_function(fn)
    if vjp:
        warnings.warn("rewrite(..., vjp=True) is deprecated: the plain decorator already runs the rewritten VJP "
                      "under jax.grad/jax.vjp (and the rewritten JVP under jax.jvp, which vjp=True cannot)",
                      DeprecationWarning, stacklevel=2)
        return RewrittenVJP(fn, rulesets, cost_model, limits, static_argnums, static_argnames, strict)
    return Rewritten(fn, rulesets, cost_model, limits, static_argnums, static_argnames, strict, cache=cache,
                     guard=guard, whole_step=whole_step)


@dataclasses.dataclass
class _Unchanged:
    """The fallback after a failure: the original program, differentiated by JAX."""

    after: core.ClosedJaxpr
    times: dict[str, float]


class RewrittenVJP(Rewritten):
    """A function whose VJP is JAX's VJP of ``fn`` rewritten, as a ``jax.custom_vjp``. Made by ``rewrite(vjp=True)``."""

    def _rewrite(self, traced: Traced, args: Sequence[Any] | None = None) -> Any:
        name = getattr(self.fn, "__name__", "function")
        try:
            return self._build(traced)
        except Exception as e:
            self._fall_back(e, f"rewrite of the VJP of {name!r}", "using JAX's own")
            return _Unchanged(traced.closed, {})

    def _build(self, traced: Traced) -> VJPResult:
        if traced.closed.jaxpr.effects:
            raise ValueError("vjp=True needs a program without effects (its backward pass may not repeat them)")
        return build_vjp(traced, self.entries, self.cost_model, self.limits)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if jax.config.jax_disable_jit:
            return self.fn(*args, **kwargs)
        _, flat, (traced, result), nodes = self._prepare(args, kwargs)
        if isinstance(result, _Unchanged):
            outs = core.eval_jaxpr(traced.closed.jaxpr, traced.closed.consts, *flat)
        else:
            outs = result.function(*flat)
        return _outputs(traced, list(outs), nodes)

    def jaxpr(self, *args: Any, **kwargs: Any) -> core.ClosedJaxpr:
        """The primal program for these arguments' signature."""
        return self._prepare(args, kwargs)[2][1].after

    def vjp_jaxprs(self, *args: Any, **kwargs: Any) -> tuple[core.ClosedJaxpr, core.ClosedJaxpr]:
        """The forward (primals -> outputs + residuals) and backward (residuals + cotangents -> gradients) programs."""
        result = self._prepare(args, kwargs)[2][1]
        if isinstance(result, _Unchanged):
            raise RuntimeError("the VJP was not rewritten (see the RewriteWarning); JAX's own is used")
        return result.fwd, result.bwd

    def __repr__(self) -> str:
        return (f"<rewritten VJP of {getattr(self.fn, '__name__', 'function')}: {len(self.entries)} rules, "
                f"{len(self._cache)} cached signatures>")


def explain(fn: Any, *args: Any, rulesets: Any = (), cost_model: Any = None, limits: Limits | None = None,
            static_argnums: Sequence[int] = (), static_argnames: Sequence[str] = (), grad: bool = False,
            whole_step: bool | None = None, **kwargs: Any) -> Report:
    """Rewrite ``fn`` at these arguments and report what happened (``whole_step`` as in :func:`rewrite`).

    With ``grad=True`` the report is about the program that ``jax.grad`` and
    ``jax.vjp`` of ``rewrite(fn)`` run: ``before`` is JAX's VJP of ``fn``'s
    rewritten program as one program ``(primals, cotangents) -> (outputs, gradients)``, ``after``
    the rewritten forward and backward passes composed the same way, and
    ``gradient`` the split (residuals chosen, splits priced). Given a
    function made by :func:`rewrite` (and no ``rulesets``), it reports that
    function's own cached program with its own rules.

    >>> import jax.numpy as jnp
    >>> from rewrite import explain, rule, Ruleset
    >>> rs = Ruleset("mine", [rule(lambda x: x * 1.0, lambda x: x, name="mul_one")])
    >>> report = explain(lambda x: jnp.sin(x * 1.0), jnp.ones(3), rulesets=[rs])
    >>> report.fired
    {'mul_one': 1}
    >>> print(report.summary().splitlines()[0])  # doctest: +ELLIPSIS
    cost ... -> ... saved), equations 2 -> 1
    >>> from rulesets.derivatives import derivatives, derivatives_fastmath  # sin(2x) for any x is fastmath's
    >>> g = explain(lambda x: jnp.sin(x) ** 2, jnp.ones(3), rulesets=[derivatives, derivatives_fastmath], grad=True)
    >>> from rewrite.report.report import primitive_counts
    >>> primitive_counts(g.before)["cos"], primitive_counts(g.after)["cos"]
    (1, 0)
    """
    if grad:
        # What jax.grad of rewrite(fn) runs: the VJP of the rewritten forward program, rewritten.
        if not (isinstance(fn, Rewritten) and not rulesets):
            fn = Rewritten(fn, rulesets, cost_model, limits, static_argnums, static_argnames, strict=None)
        # its e-graph is kept for the provenance below, unless jax.grad built this signature's VJP first
        gradient = fn._signature(args, kwargs).vjp(keep=True)
        if gradient is None:
            raise RuntimeError("the VJP was not rewritten (see the RewriteWarning)")
        return gradient_report(gradient, fn.entries, fn.cost_model)
    entries = entries_of(rulesets, builtin_packs)
    traced, trace_time = trace_call(fn, args, kwargs, static_argnums, static_argnames)
    model = resolve(cost_model)
    budget = Budget(Limits.of(limits).seconds)  # as rewrite's: the pipeline and the step's search share it
    with budget.spending():
        result = run_pipeline(traced, entries, model, Limits.of(limits), keep=True)
        result.times["trace"], result.budget = trace_time, budget
        # what rewrite(step) does besides: a loss whose gradients the step holds (rewrite/grad/step.py)
        finder = Rewritten(fn, (), model, limits, static_argnums, static_argnames, strict=None, cache=False)
        finder.entries = entries
        finder.whole_step, finder.step_by_default = searches_steps(entries, whole_step), whole_step is None
        t = time.perf_counter()
        chosen = finder._whole_step(traced, result)
    if finder.whole_step and finder.entries:  # the search's time and its parts, whether or not its step is used
        result.times.update({k: chosen.times[k] for k in STEP_STAGES if k in chosen.times})
        result.times["whole_step"] = time.perf_counter() - t
    return report_of(result, entries, model, step=chosen.step, runs=None if chosen is result else chosen)
