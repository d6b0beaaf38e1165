"""``rewrite(fn, vjp=True)``: a function whose backward pass is JAX's own VJP of ``fn``, rewritten.

JAX differentiates a program one primitive at a time, so its backward pass
repeats work the forward pass did, and misses identities that a person
deriving the gradient by hand would use. Here the function and its VJP are
traced together, as one program ``(primals, cotangents) -> (outputs,
gradients)``, and that program goes through the ordinary pipeline: loaded
into one e-graph, where the forward's ``sin(a*x)`` and the backward's are
one class; saturated with the rulesets; extracted. The result is split in
two and wrapped in a ``jax.custom_vjp``:

* ``fwd(primals) -> (outputs, residuals)`` and ``bwd(residuals, cotangents)
  -> gradients``. The *residuals* are what the backward pass reads from the
  forward pass. The cost model chooses them (:func:`choose_residuals`):
  keeping only the inputs and recomputing, keeping every value the forward
  computes that the backward reads, or any set in between that a greedy
  descent finds cheaper, each priced as two programs that XLA compiles
  apart (``AnalyticCost.program``), in two uses weighted alike: a training
  step, which reads the outputs, and ``jax.grad``, which drops them (and
  XLA the forward work only they needed). Both the joint extraction and
  one for the gradients alone are split so, and where they differ a third
  split computes the outputs as the first does and the gradients as the
  second; of those the one taken is the cheapest as ``jit`` runs it, where
  the two halves inline into one program and each use is one program
  (``grad/uses.py``).
* Without differentiation, the primal function runs: the forward program
  extracted on its own, so inference pays nothing for the backward pass.

``fn`` may itself contain ``jax.grad`` or ``jax.vjp`` (a whole training
step): its trace is an ordinary program, and its VJP is JAX's second-order
one. Integer inputs get no gradient (``None``, which JAX reads as zero).

>>> import jax, jax.numpy as jnp
>>> from rewrite import rewrite
>>> from rulesets.derivatives import derivatives
>>> f = rewrite(lambda x, a: jnp.sin(a * x) ** 2 / a, rulesets=[derivatives])  # jax.grad runs the split
>>> x, a = jnp.linspace(-1.0, 1.0, 4), jnp.float32(1.5)
>>> g = jax.grad(lambda x, a: f(x, a).sum(), argnums=(0, 1))(x, a)
>>> want = jax.grad(lambda x, a: (jnp.sin(a * x) ** 2 / a).sum(), argnums=(0, 1))(x, a)
>>> all(bool(jnp.allclose(p, q, atol=1e-6)) for p, q in zip(g, want))
True
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ..cost.program import Program, prices_before, shared_prefix
from ..extract.extract import extract
from ..extract.extractor import shared
from ..extract.policy import no_fatter
from ..extract.program import ProgramPricer, prices_programs
from ..ir.jaxapi import core
from ..ir.primitives import is_float
from ..ir.walk import operands, walk
from ..jaxpr.emit import Emitter, _Scope, check_signature, dce, emitter
from ..jaxpr.trace import Traced, jvp_rules_unnamed, no_cotangents, same_program, spec_of
from ..pipeline import extract_by_policy, program_cost, run_pipeline
from ..records import Result, lap, out_of_time
from .decide import Joint, decide, held_alone, held_to_written, in_order, priced_joints
from .uses import as_emitted, cheapest_use, emit_parts, inlined, joint_as_run, same_choice, uses_prices, without_outputs

log = logging.getLogger("rewrite")


def float_positions(closed: core.ClosedJaxpr) -> tuple[list[int], list[int]]:
    """The positions of ``closed``'s float inputs and outputs (those a derivative flows through)."""
    return ([i for i, a in enumerate(closed.in_avals) if is_float(a)],
            [i for i, a in enumerate(closed.out_avals) if is_float(a)])


def of_floats(fn: Any, primals: Sequence[Any], dif_in: Sequence[int]) -> Any:
    """``fn`` as a function of the inputs at ``dif_in`` alone, the others fixed at ``primals``."""
    def call(*fl: Any) -> list[Any]:
        xs = list(primals)
        for i, v in zip(dif_in, fl):
            xs[i] = v
        return list(fn(*xs))
    return call


def joint_program(closed: core.ClosedJaxpr, wrt: Sequence[int] | None = None
                  ) -> tuple[core.ClosedJaxpr, list[int], list[int]]:
    """``(primals, cotangents of the float outputs) -> (outputs, gradients of the float inputs)``, traced;
    ``wrt``, where given, the positions of the float inputs whose gradients are wanted (the others get none).

    Returns the program and the positions of the float inputs (differentiated) and outputs."""
    in_avals, out_avals = closed.in_avals, closed.out_avals
    dif_in, dif_out = float_positions(closed)
    if wrt is not None:
        wanted = set(wrt)
        dif_in = [i for i in dif_in if i in wanted]
    n = len(in_avals)
    fn = core.jaxpr_as_fun(closed)

    def joint(*args: Any) -> list[Any]:
        primals, cts = list(args[:n]), args[n:]
        outs, pullback = jax.vjp(of_floats(fn, primals, dif_in), *[primals[i] for i in dif_in])
        full = no_cotangents(out_avals)
        for i, c in zip(dif_out, cts):
            full[i] = c
        return list(outs) + list(pullback(full))

    specs = [spec_of(a) for a in in_avals]
    # a cotangent has its output's type but for weak type: inside a shard_map body that includes the manual
    # axes the output varies over, which the pullback checks (a plain ShapeDtypeStruct dropped them)
    specs += [spec_of(out_avals[i].update(weak_type=False)) for i in dif_out]
    with jvp_rules_unnamed():  # (the same program, traced without naming each JVP rule's arguments)
        return jax.make_jaxpr(joint)(*specs), dif_in, dif_out


def joint_at(closed: core.ClosedJaxpr, wrt: Sequence[int] | None = None,
             written: tuple[core.ClosedJaxpr, core.ClosedJaxpr] | None = None) -> core.ClosedJaxpr:
    """:func:`joint_program`'s program of ``closed`` at ``wrt``; ``written``, where given, is a program and its joint
    program at ``wrt`` traced already (``grad/step.py``'s ``rederive``): where ``closed`` is that program, or the same
    program (:func:`rewrite.jaxpr.trace.same_program`: its text and constants, bit for bit, so that JAX traces the
    same joint), that joint, not traced again. A forward rewritten without a ``jointly`` ruleset's rules is often the
    loss as written (flax_lm_step, both ``wholestep_*_gpt``: 0.16-0.19 s a trace of their first call)."""
    if written is not None and (closed is written[0] or same_program(closed, written[0])):
        return written[1]
    return joint_program(closed, wrt)[0]


# ---------------------------------------------------------------------- residuals
def scope_classes(snap: Any, choice: dict, roots: Sequence[Any], stop: set | frozenset = frozenset()) -> set:
    """Classes the program's own scope computes for ``roots`` (not inside bodies), not looking past ``stop``."""
    return set(walk(roots, lambda c: () if c in stop else operands(snap, choice[c])))


@dataclasses.dataclass
class Split:
    """A forward/backward split: residual classes, and the predicted cost of the two programs."""

    policy: str
    residuals: list[Any]
    cost: float
    #: the price of its two uses under ``jit``, each one program (``grad/uses.py``), where it was chosen among the
    #: extractions' splits so; NaN where there was one to take
    uses: float = math.nan


def _is_free(snap: Any, choice: dict, c: Any) -> bool:
    """Literals and constants: the backward pass has them without saving them."""
    return choice[c][0] in ("Lit", "Const")


def frontier(snap: Any, choice: dict, b_roots: Sequence[Any], forward: set, *, expand: set | frozenset = frozenset()
             ) -> list[Any]:
    """What the backward pass reads from the forward: classes the forward computes, met walking back from
    the gradients (classes in ``expand`` are recomputed instead, so the walk goes through them)."""
    def read(c: Any) -> bool:  # the backward pass reads c as it is, not what c is computed from
        ctor = choice[c][0]
        return (ctor not in ("Lit", "Const", "Tok") and c in forward and (c not in expand or ctor == "Param")
                # a value of several outputs (a call's tuple, before its projections) is not one array to keep
                and not isinstance(snap.aval(c), tuple))

    def kids(c: Any) -> list[Any]:
        return [] if choice[c][0] in ("Lit", "Const", "Tok") or read(c) else operands(snap, choice[c])

    return [c for c in walk(b_roots, kids) if read(c)]


def choose_residuals(snap: Any, choice: dict, f_roots: Sequence[Any], b_roots: Sequence[Any],
                     params: dict[int, Any], n_primals: int, price: Callable[[list[Any]], float],
                     tried: list[Split] | None = None, steps: int | None = None) -> Split:
    """Pick what the backward pass reads from the forward pass; ``price(residuals)`` prices a split.

    Candidates: only inputs (recompute everything), the whole frontier (reuse everything), then a greedy descent
    from the cheaper of the two that recomputes one residual at a time while the price falls, largest residuals
    first, each tried once, at most ``steps`` trials (:data:`GREEDY_STEPS`), while the rewrite has time left
    (``records.out_of_time``). Every split priced is appended to ``tried``.
    """
    steps = GREEDY_STEPS if steps is None else steps
    tried = [] if tried is None else tried
    inner_price = price

    def price(residuals: list[Any], policy: str = "greedy") -> float:  # noqa: F811
        cost = inner_price(residuals)
        tried.append(Split(policy, list(residuals), cost))
        return cost

    forward = scope_classes(snap, choice, f_roots)
    inputs = {c for i, c in params.items() if i < n_primals}
    forward |= inputs
    # Recompute everything: walk through every computed class to the inputs.
    recompute = frontier(snap, choice, b_roots, forward, expand=forward - inputs)
    reuse = frontier(snap, choice, b_roots, forward)
    splits = [Split("recompute", recompute, price(recompute, "recompute")), Split("reuse", reuse, price(reuse, "reuse"))]
    best = min(splits, key=lambda s: s.cost)
    expand: set[Any] = set(forward - inputs - set(best.residuals)) if best.policy == "recompute" else set()
    current = list(best.residuals)
    seen: set[Any] = set()
    improved = True
    while improved and best.policy != "recompute":
        improved = False
        for r in sorted(current, key=lambda c: -_nbytes_of(snap, c)):
            if r in inputs or r in seen:
                continue
            if len(seen) >= steps or out_of_time():  # (the rewrite's time spent: the best split found)
                break
            seen.add(r)
            trial_expand = expand | {r}
            trial = frontier(snap, choice, b_roots, forward, expand=trial_expand)
            cost = price(trial)
            if cost < best.cost - 1e-9 * abs(best.cost):
                best = Split("greedy", trial, cost)
                expand, current, improved = trial_expand, trial, True
                break
    return best


#: How many residuals the greedy descent tries recomputing. Each trial prices two whole programs, and
#: a transformer's VJP has hundreds of candidate residuals: trying each once and restarting after every
#: gain took 28 s for a 2-layer one (1,028 splits priced); the largest residuals, tried first, are where
#: the gains are. 12, not 24: a measured decision (flax_seq2seq_grad, the one ecosystem program whose VJP
#: searches its residuals: 26 splits priced, about 11 ms each, the gains after the 12th trial 0.21% of the
#: predicted price together, 1.81595e8 against 1.81216e8; its gradient's run time measured the same,
#: interleaved with an A/A, at the same temp memory: the log's h-resid section).
GREEDY_STEPS = 12


def _nbytes_of(snap: Any, c: Any) -> int:
    a = snap.aval(c)
    try:
        return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
    except Exception:
        return 0


# ---------------------------------------------------------------------- emission
_FWD_DEBUG = core.DebugInfo("rewrite", "forward pass emitted by rewrite(vjp=True)", None, None)
_BWD_DEBUG = core.DebugInfo("rewrite", "backward pass emitted by rewrite(vjp=True)", None, None)


def emit_split(snap: Any, choice: dict, egraph: Any, in_avals: Sequence[Any], ct_avals: Sequence[Any],
               f_roots: Sequence[Any], b_roots: Sequence[Any], residuals: Sequence[Any], forward: dict | None = None
               ) -> tuple[core.ClosedJaxpr, core.ClosedJaxpr]:
    """The forward program (primals -> outputs + residuals) and the backward (residuals + cotangents -> grads);
    ``forward``, where given, is the choice the outputs are computed under (``grad.uses.emit_parts``)."""
    em = Emitter(snap, choice, egraph)
    if forward is None:
        fwd = dce(em.program(in_avals, list(f_roots) + list(residuals), None, _FWD_DEBUG))
    else:
        fwd = dce(emit_parts(snap, egraph, in_avals, [(forward, f_roots), (choice, residuals)], _FWD_DEBUG))
    debug_info = _BWD_DEBUG
    n = len(in_avals)
    params = {n + j: core.Var(a) for j, a in enumerate(ct_avals)}
    res_vars = [core.Var(snap.aval(c)) for c in residuals]
    sc = _Scope(em, 0, params)
    for c, v in zip(residuals, res_vars):
        sc.env[c] = v
    outs = sc.atoms(list(b_roots))
    invars = res_vars + [params[n + j] for j in range(len(ct_avals))]
    eff = core.join_effects(*(e.effects for e in sc.eqns)) if sc.eqns else core.no_effects
    jaxpr = core.new_jaxpr(sc.constvars, invars, outs, sc.eqns, eff, debug_info)
    return fwd, dce(core.ClosedJaxpr(jaxpr, sc.consts))


# ---------------------------------------------------------------------- the function
@dataclasses.dataclass
class VJPResult:
    """One signature's rewrite: the primal program, the forward/backward split, and the joint pipeline's result."""

    forward: core.ClosedJaxpr | None  # None when built without the primal program (``primal=False``)
    fwd: core.ClosedJaxpr
    bwd: core.ClosedJaxpr
    split: Split
    splits_considered: list[Split]
    joint: Result
    dif_in: list[int]
    dif_out: list[int]
    function: Callable[..., Any] | None
    times: dict[str, float]
    #: which derivative :func:`decided_jointly` kept, and why ("" where it did not decide: no ``jointly`` rule fired)
    decided: str = ""
    #: the price of the training step the split runs (its halves inlined, ``grad/uses.py``) where the split taken is
    #: not the joint extraction's, whose price is ``joint.cost_after``; NaN otherwise
    composed_cost: float = math.nan

    @property
    def after(self) -> core.ClosedJaxpr:
        return self.forward

    @property
    def as_written(self) -> bool:
        """Whether this is JAX's own VJP of the function as written, nothing rewritten (:func:`as_written_vjp`)."""
        return self.split.policy == AS_WRITTEN

    @property
    def before(self) -> core.ClosedJaxpr:
        return self.joint.before

    @property
    def stats(self) -> Any:
        return self.joint.stats

    @property
    def stopped(self) -> str:
        return self.joint.stopped

    @property
    def warnings(self) -> list[str]:
        return self.joint.warnings


def custom_vjp_function(forward: core.ClosedJaxpr, fwd: core.ClosedJaxpr, bwd: core.ClosedJaxpr, n_in: int,
                        dif_in: Sequence[int], dif_out: Sequence[int]) -> Callable[..., Any]:
    """A ``jax.custom_vjp`` over flat arguments from the three programs."""
    prim_f, fwd_f, bwd_f = core.jaxpr_as_fun(forward), core.jaxpr_as_fun(fwd), core.jaxpr_as_fun(bwd)
    n_out = len(forward.out_avals)

    @jax.custom_vjp
    def f(*xs: Any) -> tuple:
        return tuple(prim_f(*xs))

    def f_fwd(*xs: Any) -> tuple:
        r = fwd_f(*xs)
        return tuple(r[:n_out]), tuple(r[n_out:])

    def f_bwd(res: tuple, cts: tuple) -> tuple:
        grads = bwd_f(*res, *[cts[i] for i in dif_out])
        out: list[Any] = [None] * n_in
        for i, gr in zip(dif_in, grads):
            out[i] = gr
        return tuple(out)

    f.defvjp(f_fwd, f_bwd)
    return f


def build_vjp(traced: Traced, entries: Sequence[Any], model: Any, limits: Any, primal: bool = True,
              keep: bool = False) -> VJPResult:
    """Rewrite ``traced``'s VJP: the joint program through the pipeline, split at the cheapest residuals.

    ``primal`` also extracts the forward program alone and wraps the three
    in a ``jax.custom_vjp`` (what ``vjp=True`` returns); without it only the
    split is built (what the plain decorator's derivative rules run).
    ``keep`` keeps the joint e-graph in ``joint`` (its ``egraph``,
    ``snapshot``, ``choice``...) for a report; otherwise it goes back to the
    pool once the programs are emitted, since a result is kept per signature
    and an e-graph of the built-in packs holds some 90 MB of native memory.
    """
    closed = traced.closed
    t0 = time.perf_counter()
    joint, dif_in, dif_out = joint_program(closed)
    times = {"trace_vjp": time.perf_counter() - t0}
    res = run_pipeline(joint, entries, model, limits, keep=True)
    return _vjp_of(res, closed, dif_in, dif_out, model, entries, times, primal, keep)


def _vjp_of(res: Result, closed: core.ClosedJaxpr, dif_in: list[int], dif_out: list[int], model: Any,
            entries: Sequence[Any], times: dict, primal: bool, keep: bool) -> VJPResult:
    """:func:`build_vjp` from the joint program's pipeline result ``res``: the split, and the forward alone."""
    times.update(res.times)
    snap, eg = res.snapshot, res.egraph
    n = len(closed.in_avals)
    in_avals = list(closed.in_avals)
    ct_avals = [closed.out_avals[i] for i in dif_out]
    t0 = time.perf_counter()
    f_roots, b_roots, params, choices = _joint_choices(res, len(closed.out_avals), n + len(ct_avals), model, entries)
    considered: list[Split] = []
    # Each choice's residuals are searched with its halves priced apart (choose_residuals); the splits so found are
    # chosen between as they run, each use one program (grad/uses.py).
    found: list[tuple[str, dict, dict | None, Split]] = []
    searched: list[tuple[dict, tuple[Split, list[Split]]]] = []
    for name, choice in choices:
        made = made_before(snap, searched, choice, f_roots + b_roots)
        if made is not None:  # the program of a choice searched already: the same splits, at the same prices
            split, tried = made
        else:
            price = split_pricer(snap, model, choice, f_roots, b_roots)
            tried = []
            split = choose_residuals(snap, choice, f_roots, b_roots, params, n, price, tried)
            searched.append((choice, (split, tried)))
            found.append((name, choice, None, dataclasses.replace(split, policy=f"{name}:{split.policy}")))
        considered += [dataclasses.replace(t, policy=f"{name}:{t.policy}") for t in tried]
    if len(found) == 2:  # the outputs as the joint extraction computes them, the gradients as their own does
        (jname, joint_choice, _, _), (gname, grads_choice, _, gsplit) = found
        if not same_choice(snap, joint_choice, grads_choice, f_roots):
            found.append((f"{jname}+{gname}", grads_choice, joint_choice,
                          dataclasses.replace(gsplit, policy=f"{jname}+{gsplit.policy}")))
    halves = [emit_split(snap, choice, eg, in_avals, ct_avals, f_roots, b_roots, split.residuals, forward)
              for _, choice, forward, split in found]
    best, composed = 0, math.nan
    if len(found) > 1:
        seen: list = []
        uses = uses_prices([(f, b, len(s.residuals)) for (f, b), (*_, s) in zip(halves, found)], model, seen)
        best = cheapest_use(uses, (res.before, without_outputs(res.before, len(closed.out_avals))), model)
        for (*_, split), u in zip(found, uses):
            split.uses = u.price
        composed = uses[best].train_price if best else math.nan
    split = found[best][3]
    considered += [s for *_, s in found if s.policy.startswith(f"{found[0][0]}+")]
    times["residuals"] = time.perf_counter() - t0
    fwd, bwd = halves[best]
    forward = fn = None
    if primal:
        # The primal function alone: extracted for the outputs only, so inference skips the backward pass.
        prim = extract(snap, f_roots, model, res.original)
        forward = dce(Emitter(snap, prim.choice, eg).program(in_avals, f_roots, None, closed.jaxpr.debug_info))
        check_signature(closed, forward)
        fn = custom_vjp_function(forward, fwd, bwd, n, dif_in, dif_out)
    if not keep:
        res.release()
    return VJPResult(forward, fwd, bwd, split, considered, res, dif_in, dif_out, fn, times, composed_cost=composed)


def made_before(snap: Any, made: Sequence[tuple[dict, Any]], choice: dict, roots: Sequence[Any]) -> Any:
    """What was made of the first choice in ``made`` (pairs ``(choice, what)``) whose program from ``roots`` is
    ``choice``'s (:func:`same_choice`), or ``None``: a residual search or a price is not made twice."""
    return next((what for c, what in made if same_choice(snap, c, choice, roots)), None)


def _joint_choices(res: Result, n_out: int, n_params: int, model: Any, entries: Sequence[Any],
                   value: bool | None = None) -> tuple[list[Any], list[Any], dict[int, Any], list[tuple[str, dict]]]:
    """A joint program's pipeline result read as a VJP: its forward roots (the outputs), backward roots (the
    gradients), input classes by position, and two extractions: for a training step (outputs and gradients
    both used) and for the gradients alone (``jax.grad`` drops the value, and XLA the forward work only the
    value needed). The second is made under the pipeline's policy, as the first was: without the recomputing
    rules' nodes, held to the rulesets' ``min_saving`` (``extract.policy.worth_their_saving``), then with the
    recomputing nodes where they free memory (``extract.policy.recomputations``). Where the rewrite's time is spent
    (``records.out_of_time``), or where the caller reads the outputs (``value`` true: a training step that reads
    its loss, which runs the joint program whole, as the first extraction priced it), the second is the first."""
    snap, eg = res.snapshot, res.egraph
    f_roots, b_roots = res.roots[:n_out], res.roots[n_out:]
    params = {}
    for i in range(n_params):
        cls = eg.lookup("Param", [eg.int_value(0), eg.int_value(i)])
        if cls is not None:
            params[i] = cls
    if value or out_of_time():  # the outputs read, or the rewrite's time spent (Limits.seconds): not searched apart
        return f_roots, b_roots, params, [("joint", res.choice), ("gradients", res.choice)]
    tree = shared(snap, model).tree()[1]
    grads = extract_by_policy(snap, eg, entries, b_roots, model, res.original)  # the pipeline's policy, min_saving too
    if grads.leaner_fallback is not None:  # held to the input's gradients' memory, as the joint program is (pipeline)
        emit_choice = emitter(snap, eg, res.before.in_avals, b_roots, None, None)
        first = next(c for c in grads.candidates if not c.rewritten)  # there is one, since a fallback is
        grads = no_fatter(grads, emit_choice(first.choice), emit_choice(grads.choice), emit_choice, model)[0]
    grads_only = grads.choice
    return f_roots, b_roots, params, [("joint", res.choice), ("gradients", {**tree, **grads_only})]


#: the :class:`Split` policy of :func:`as_written_vjp`'s split: JAX's own
AS_WRITTEN = "as written"


def as_written_vjp(traced: Traced, model: Any, priced: bool = True) -> VJPResult:
    """JAX's own VJP of ``traced``, split where JAX splits it, as a :class:`VJPResult` with nothing rewritten: the
    forward ``primals -> (outputs, residuals)`` returns the residuals ``jax.vjp``'s pullback holds (its leaves),
    and the backward is that pullback. Under ``jit`` the two inline into the program ``jax.value_and_grad`` of
    the function as written compiles, so that is what a derivative held to it (:func:`decided_jointly`) runs.
    Its ``joint`` is that program (:func:`split_joint`), unrewritten and priced: the one :func:`decided_jointly`
    prices, so it is traced and priced once (not :func:`joint_program` traced again beside it). ``priced`` false: its
    price is left NaN, for a caller that prices that program where it loads it anyway (:func:`priced_as`)."""
    closed = traced.closed
    t0 = time.perf_counter()
    dif_in, dif_out = float_positions(closed)
    in_avals, out_avals = list(closed.in_avals), list(closed.out_avals)
    fn = core.jaxpr_as_fun(closed)
    trees: list[Any] = []

    def forward(*primals: Any) -> list[Any]:
        outs, pullback = jax.vjp(of_floats(fn, primals, dif_in), *[primals[i] for i in dif_in])
        residuals, tree = jax.tree.flatten(pullback)
        trees.append(tree)
        return list(outs) + residuals

    with jvp_rules_unnamed():  # (the same program, traced without naming each JVP rule's arguments)
        fwd = jax.make_jaxpr(forward)(*[spec_of(a) for a in in_avals])
    n_res = len(fwd.out_avals) - len(out_avals)

    def backward(*args: Any) -> list[Any]:
        pullback = jax.tree.unflatten(trees[0], args[:n_res])
        full = no_cotangents(out_avals)
        for i, c in zip(dif_out, args[n_res:]):
            full[i] = c
        return list(pullback(full))

    # the cotangents as joint_program types them
    bwd = jax.make_jaxpr(backward)(*[spec_of(a) for a in fwd.out_avals[len(out_avals):]],
                                   *[spec_of(out_avals[i].update(weak_type=False)) for i in dif_out])
    # no e-graph holds these residuals: the split names their types
    split = Split(AS_WRITTEN, list(fwd.out_avals[len(out_avals):]), float("nan"))
    built = VJPResult(None, fwd, bwd, split, [split], None, dif_in, dif_out, None, {})  # type: ignore[arg-type]
    joint = split_joint(built)
    built.times["trace_vjp"] = time.perf_counter() - t0
    split.cost = cost = program_cost(joint, model) if priced else float("nan")
    built.joint = Result(before=joint, after=joint, cost_before=cost, cost_after=cost, stopped="as written",
                         iterations=0, rows=0, times=built.times, stats={}, rewritten=False, warnings=[])
    return built


def priced_as(built: VJPResult, cost: float) -> VJPResult:
    """``built`` (:func:`as_written_vjp`'s, made with ``priced`` false) with its joint's price ``cost``: what
    :func:`rewrite.pipeline.program_cost` gives that program (``run_together``'s price of it as loaded)."""
    built.split.cost = cost
    built.joint = dataclasses.replace(built.joint, cost_before=cost, cost_after=cost)
    return built


def rewrite_joint(closed: core.ClosedJaxpr, entries: Sequence[Any], model: Any, limits: Any,
                  wrt: Sequence[int] | None = None, value: bool | None = None,
                  seen: list[tuple[core.ClosedJaxpr, float]] | None = None,
                  trace: Callable[[core.ClosedJaxpr], core.ClosedJaxpr] | None = None) -> core.ClosedJaxpr:
    """``closed``'s VJP as one program ``(primals, cotangents) -> (outputs, gradients)`` (:func:`joint_program`,
    the gradients of the float inputs at ``wrt`` where given: those its caller reads), rewritten: what a caller
    that runs the forward and backward passes together (a training step) reads.

    The caller inlines it, so it is chosen as ``jit`` runs it, as :func:`build_vjp` chooses its split
    (``grad/uses.py``): of :func:`build_vjp`'s two extractions, each emitted whole, and where they compute the
    outputs apart a third program, the outputs as the joint extraction computes them and the gradients as their
    own (:func:`rewrite.grad.uses.emit_parts`), the one priced lowest in the use its caller makes of it (``value``:
    the outputs read too, or the gradients alone; where not given, the two uses weighted alike, as
    :func:`build_vjp` weighs them), each use one program, held to the input's memory in that use as
    :func:`rewrite.grad.uses.cheapest_use` holds a split. Where the outputs are read (``value`` true), the joint
    extraction alone: its program is the one the caller runs whole (the gradients extracted apart, about a tenth of
    a heavy step's rewrite, chose otherwise in 3 of the 12 such joints of the 24 ecosystem programs, and changed
    no step's program). ``seen``, where given, receives the programs priced whole with their prices
    (:func:`rewrite.grad.uses.joint_as_run`): :func:`decided_jointly` reads the returned one's. ``trace``, where
    given, makes the joint program of ``closed`` (at ``wrt``: :func:`joint_at`, which reuses one traced already)."""
    joint = joint_program(closed, wrt)[0] if trace is None else trace(closed)
    res = run_pipeline(joint, entries, model, limits, keep=True, price_input=False)
    try:
        return _as_run(res, len(closed.out_avals), model, entries, value, seen)
    finally:
        res.egraph.release()


def _as_run(res: Result, n_out: int, model: Any, entries: Sequence[Any], value: bool | None,
            seen: list[tuple[core.ClosedJaxpr, float]] | None) -> core.ClosedJaxpr:
    """:func:`rewrite_joint`'s program from its joint program's pipeline result ``res`` (kept)."""
    joint = res.before
    f_roots, _, _, choices = _joint_choices(res, n_out, len(joint.in_avals), model, entries, value)
    return joint_as_run(res.snapshot, res.egraph, joint, res.roots, joint, f_roots, [c for _, c in choices], model,
                        value, seen, (res.after, res.cost_after), emitted=as_emitted(res))


def split_joint(built: VJPResult) -> core.ClosedJaxpr:
    """The program a caller of both halves of ``built``'s split runs (``jax.value_and_grad`` under ``jit``, which
    inlines them together), as :func:`joint_program` shapes it: ``(primals, cotangents) -> (outputs, gradients)``.
    JAX's split (:func:`as_written_vjp`) holds it already, as its ``joint``."""
    if built.as_written and built.joint is not None:
        return built.joint.before
    return inlined(built.fwd, built.bwd, len(built.split.residuals))


def decided_jointly(closed: core.ClosedJaxpr, forward: Result, entries: Sequence[Any], model: Any, limits: Any,
                    build: Callable[[core.ClosedJaxpr, Sequence[Any]], Any],
                    as_written: Callable[[core.ClosedJaxpr], Any],
                    joint_of: Callable[[Any], core.ClosedJaxpr] = lambda built: built,
                    spent: dict[str, float] | None = None,
                    priced: Sequence[tuple[core.ClosedJaxpr, float]] = (),
                    build_both: Callable[[core.ClosedJaxpr, core.ClosedJaxpr, Sequence[Any]], tuple] | None = None,
                    held_to: Callable[[core.ClosedJaxpr], Any] | None = None) -> tuple[Any, str]:
    """``build(forward.after, entries)``, a derivative of ``closed`` rewritten (``forward``) for the forward alone,
    decided on its joint program, and why, in words: where no ``jointly=True`` ruleset's rule fired in that forward,
    held by memory to JAX's as written alone (``held_to(closed)``, unpriced, else ``as_written``'s: ``held_alone``).

    Such rules replace a forward computation together with its backward (``rulesets.nn``'s LM head over token
    blocks, whose backward recomputes each block's logits: that pays where the logits are large and costs a
    product where they are not), which the forward's price does not see. So three derivatives are built and
    their joint programs (``joint_of``) priced: the one from the forward with those rules, the one from
    ``closed`` rewritten without them (where that differs; where the forward as chosen uses nothing they built,
    ``Result.jointly_chosen``, that is the forward itself, not saturated again), and ``as_written(closed)``,
    JAX's derivative of the loss as written, with no rule at all (:func:`joint_program`, :func:`as_written_vjp`).
    A rewritten joint replaces the one it is held to only where it is taken by price or the lean bands
    (:func:`rewrite.extract.lean.peaks_keep_leaner`, as a training step is chosen) and is not predicted
    to hold more (:func:`rewrite.grad.decide.held_to_written`): the plain one the one with the rules, and either
    JAX's as written. Under a model that times programs (``Measured``) the joint programs are timed instead and the
    fastest kept of those not predicted to hold more than JAX's (:func:`rewrite.grad.decide.timed`).
    A tie keeps the one held to. ``priced``: programs ``build`` priced whole already (``program_cost``), with their
    prices (:func:`rewrite_joint`'s ``seen``): a joint program that is one of them (the same object) is not priced
    again. ``build_both(forward, plain, rest)``, where given, builds the two rewritten ones in one e-graph
    (``grad/together.py``); where it returns them unsplit (``Pending``, the derivative rules' VJP), they are ordered
    by their joint extractions and split only as the choice reaches them (:func:`held_pending`)."""
    spent = {} if spent is None else spent
    t = time.perf_counter()
    jointly = {r.name for r, owner in entries if getattr(owner, "jointly", False)}
    fired = sorted(n for n, s in forward.stats.items() if n in jointly and s.fired)
    if not fired:  # held to JAX's as written all the same
        found = held_alone(build(forward.after, entries), lambda: (held_to or as_written)(closed), model, joint_of,
                           None if held_to is None else lambda: as_written(closed))  # (priced where it is kept)
        lap(spent, "step joint", t)
        return found
    made: list = []
    pending: list = []
    try:
        rest = [(r, owner) for r, owner in entries if r.name not in jointly]
        if forward.jointly_chosen == frozenset() and not getattr(forward.step, "replaced", None):
            # they fired, but the forward as chosen uses nothing they built: it is the plain one (a step whose losses
            # are read from loss-first programs is not the pipeline's program of ``closed``: it is rewritten again)
            plain = forward.after
        elif forward.plain is not None and not getattr(forward.step, "replaced", None):
            plain = forward.plain  # read off the forward's own saturated e-graph (run_pipeline's ``plain``)
        else:  # only the program that comes out is read: the input is not priced; one that saves less than its
            # floored rules' min_saving is the loss as written (as_loaded), whose joint is JAX's as written
            plain = run_pipeline(closed, rest, model, limits, price_input=False, as_loaded=True).after
        t = lap(spent, "step jointly", t)
        if same_program(plain, forward.after):
            made = [build(forward.after, entries)]
        elif build_both is not None:  # the two joint programs rewritten in one e-graph, with the other rules
            made = list(build_both(forward.after, plain, rest))
        else:
            made = [build(forward.after, entries), build(plain, rest)]
        names = [f"the forward rewritten with {', '.join(fired)}",
                 f"the forward rewritten without {'it' if len(fired) == 1 else 'them'}"]
        # build_both's two before their splits (grad/together.py's Pending): split where the choice reaches them
        pending = list(made) if len(made) == 2 and all(callable(getattr(m, "build", None)) for m in made) else []
        if pending and getattr(model, "measures", False):  # timed: each candidate built whole (decide.timed)
            made = [p.build() for p in pending]
        t = lap(spent, "step joint", t)
        made.append(as_written(closed))
        named = [*zip(names, made[:-1]), ("JAX's derivative of the loss as written", made[-1])]
        if pending and not getattr(model, "measures", False):
            written = Joint(*named[-1], model, joint_of, priced)
            chosen, why = held_pending(pending, names, written, model, joint_of, priced)
        else:  # the three priced in one load (decide.priced_joints)
            *rewritten, written = priced_joints(named, model, joint_of, priced)
            chosen, why = decide(rewritten, written, model)
        for b in made:
            release = getattr(getattr(b, "joint", None), "release", None)
            if b is not chosen.built and release is not None:  # a VJP built to keep its e-graph (a report's)
                release()                                        # keeps only the one chosen
        return chosen.built, why
    finally:
        for p in pending:
            p.release()
        lap(spent, "step jointly", t)


def held_pending(pending: Sequence[Any], names: Sequence[str], written: Joint, model: Any,
                 joint_of: Callable[[Any], core.ClosedJaxpr], priced: Sequence[tuple[core.ClosedJaxpr, float]]
                 ) -> tuple[Joint, str]:
    """:func:`rewrite.grad.decide.held_to_written` of two derivatives not split yet (``grad/together.py``'s
    ``Pending``, named ``names``): ordered by their joint extractions, each priced as its pipeline priced it and its
    peak predicted (:func:`rewrite.grad.decide.in_order`: the same rule, on the programs a training step that reads
    the loss runs, as ``rewrite_joints`` decides a step's two), then split and held to JAX's derivative (``written``)
    in that order, the second only where the first is not taken. The joint a split runs loads into the same
    e-graph terms as the joint extraction it was split from (a recomputed residual is the class the forward
    computed), so it is priced alike and predicted to hold alike (flax_seq2seq_grad's kept one: 90,540,637 as
    extracted, 90,540,607 split and loaded afresh, 57.22 MiB both; the decisions in words of it and of three LM
    heads' are the same text). It is not exact: a split taken from the gradients-alone extraction is another
    program, and the two are ordered here as a step's are. The split not reached, about 0.6 s of
    flax_seq2seq_grad's 4.3, is not made. A step's two ``rewrite_joints`` returns as ``Alone`` alike, by their inputs."""
    pre = [Joint(n + p.note, p, model, lambda p: p.program, [(p.program, p.cost)])
           for n, p in zip(names, pending)]
    return held_to_written(pre, written, model, in_order(pre, model),
                           lambda i: Joint(names[i], pending[i].build(), model, joint_of, priced))


def split_pricer(snap: Any, model: Any, choice: dict, f_roots: Sequence[Any], b_roots: Sequence[Any]
                 ) -> Callable[[list[Any]], float]:
    """The price of a split of ``choice``: a training step's plus a gradient alone's."""
    ex = shared(snap, model)
    if prices_programs(model):
        pricer = ProgramPricer(ex, model)
        templates = pricer.templates(choice, f_roots)  # the extractor's, but for what reads this choice
        own = lambda c, nd: pricer.own(c, nd, choice)  # noqa: E731
        index: dict[Any, int] = {}
        # every split's training step is the forward's ops (postorder from its outputs reaches each residual it
        # computes): built once, the outputs the split's, its kernels' prices shared (``remembered_kernel``)
        step = Program.from_choice(ex, choice, list(f_roots), own, templates, index=index)
        step.kernel_prices = {}

        last: dict[bool, Program] = {}  # the last backward (True) and the last residuals alone priced

        def program(roots: Sequence[Any], inputs: frozenset = frozenset()) -> float:
            if not inputs and roots[:len(f_roots)] == list(f_roots) and all(r in index for r in roots):
                return pricer.price(Program(step.ops, [index[r] for r in roots], step.kernel_prices))
            prog = Program.from_choice(ex, choice, roots, own, templates, inputs=inputs)
            # a split's backward, or its residuals alone, priced as a move from the last one: the kernels before
            # the first op the two build apart keep their prices, the same floats (``prices_before``); a greedy
            # trial recomputes one residual, so the programs differ from where the walk first meets it or its
            # operands (flax_seq2seq_grad: the residuals alone differ in about 4% of their kernels, a backward
            # from about a third of its ops)
            before = last.get(bool(inputs))
            prog.kernel_prices = {} if before is None else prices_before(before.kernel_prices,  # type: ignore[arg-type]
                                                                         shared_prefix(before, prog))
            last[bool(inputs)] = prog
            return pricer.price(prog)
    else:
        def program(roots: Sequence[Any], inputs: frozenset = frozenset()) -> float:
            stop = set(inputs)
            cs = scope_classes(snap, choice, roots, stop) - stop
            return sum(ex.own(c, choice[c], choice) for c in cs)

    def price(residuals: list[Any]) -> float:
        bwd = program(b_roots, frozenset(residuals))
        train = program(list(f_roots) + list(residuals))
        alone = program(list(residuals)) if residuals else 0.0
        return train + alone + 2 * bwd

    return price
