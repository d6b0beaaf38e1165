"""The choice :func:`rewrite.grad.vjp.decided_jointly` makes between derivatives of one loss: each candidate a
:class:`Joint` (a derivative built, its joint program priced), the one kept held to the one it would replace, as
extraction holds a rewrite to its input (:func:`held_to_written`); under a model that times programs
(``cost_model="measure"``, :class:`rewrite.cost.measure.Measured`) the joint programs are run and the fastest kept
of those the model does not predict to hold more than JAX's as written (:func:`timed`), as the pipeline times its
own candidates."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from typing import Any, Callable, Sequence

from ..cost.measure import fastest
from ..extract.extract import bounds_memory, fatter
from ..extract.lean import closed_peaks, keeps_leaner, peaks_keep_leaner, time_price
from ..ir.jaxapi import core
from ..pipeline import program_cost, programs_cost
from ..records import Result


class Joint:
    """One candidate of :func:`decided_jointly`: a derivative built, its joint program, that program's price, and
    its predicted peak of temporaries (``AnalyticCost.predict_temp_bytes``) and the part of its price that is the
    memory charge (``AnalyticCost.predict_peaks``), predicted once and only if asked.
    A program ``priced`` holds (by identity: the same object, priced by ``program_cost`` as it was built) is not
    priced again."""

    def __init__(self, name: str, built: Any, model: Any, joint_of: Callable[[Any], core.ClosedJaxpr],
                 priced: Sequence[tuple[core.ClosedJaxpr, float]] = ()) -> None:
        self.name, self.built, self.model = name, built, model
        self.program = joint_of(built)
        known = _known_cost(built, self.program, priced)
        self.cost = program_cost(self.program, model) if known is None else known
        self._peak: float | None = None
        self._charged = 0.0

    def peak(self) -> float | None:
        if self._peak is None:  # predicted already where built holds them (grad/together.py's Alone)
            known = getattr(self.built, "peaks", None) if self.program is getattr(self.built, "program", None) else None
            if (found := known or closed_peaks(self.model, self.program)) is not None:
                self._peak, self._charged = found
        return self._peak

    def time(self) -> float:
        """The price less its memory charge (:func:`rewrite.extract.lean.time_price`), which the lean band compares."""
        self.peak()
        return time_price(self.cost, self._charged, self.model)

    def __str__(self) -> str:
        peak = f", {self._peak / 2 ** 20:.2f} MiB predicted" if self._peak is not None else ""
        return f"{self.name} (priced {self.cost:.4g}{peak})"


def _known_cost(built: Any, program: core.ClosedJaxpr, priced: Sequence[tuple[core.ClosedJaxpr, float]]
                ) -> float | None:
    """``program``'s price where it is known already: ``built``'s own joint, priced as it was made
    (``as_written_vjp``), or a program ``priced`` holds (by identity: priced whole as it was chosen, ``rewrite_joint``'s
    ``joint_as_run``); else ``None``."""
    made = getattr(built, "joint", None)
    if isinstance(made, Result) and made.before is program and made.cost_before == made.cost_before:
        return made.cost_before
    return next((cost for p, cost in priced if p is program), None)


def priced_joints(named: Sequence[tuple[str, Any]], model: Any, joint_of: Callable[[Any], core.ClosedJaxpr],
                  priced: Sequence[tuple[core.ClosedJaxpr, float]] = ()) -> list[Joint]:
    """A :class:`Joint` of each ``(name, built)``, those whose joint programs are not priced already priced in one
    load (:func:`rewrite.pipeline.programs_cost`: the same floats as each priced alone). A step's JAX derivative
    as written and its two rewritten joints share most of their terms (wholestep_linen_gpt's 637, 529 and 494
    equations: their load about a third less CPU than three loads)."""
    programs = [joint_of(built) for _, built in named]
    unpriced = [p for p, (_, built) in zip(programs, named) if _known_cost(built, p, priced) is None]
    more = list(zip(unpriced, programs_cost(unpriced, model))) if len(unpriced) > 1 else []
    return [Joint(name, built, model, lambda _, p=p: p, [*priced, *more])  # type: ignore[misc]
            for (name, built), p in zip(named, programs)]


def _taken(a: Joint, b: Joint) -> bool:
    """Whether ``a`` is taken over ``b``: priced lower and ``b`` not kept for being the leaner within the lean band,
    or priced no lower and kept for being the leaner (:func:`rewrite.extract.lean.peaks_keep_leaner`, with the
    peaks each :class:`Joint` predicts once, for this and :func:`held_to_written`'s memory test alike)."""
    if a.cost < b.cost:
        return not peaks_keep_leaner(b.cost, b.peak, a.cost, a.peak, a.model, b.time, a.time)
    return peaks_keep_leaner(a.cost, a.peak, b.cost, b.peak, a.model, a.time, b.time)


def _bounded(model: Any) -> bool:
    """Whether a joint is held to the one it replaces by memory too: the model bounds memory
    (``extract.bounds_memory``) and predicts a program's temporaries (``predict_temp_bytes``)."""
    return bounds_memory(model) and getattr(model, "predict_temp_bytes", None) is not None


def _held(r: Joint, than: Joint, model: Any, slack: float = 0.0) -> str:
    """Why ``r`` does not replace ``than``, or "" where it does (:func:`held_to_written`)."""
    if not _taken(r, than):
        return f"{r} is not priced below {than}, nor kept as the leaner"
    if _bounded(model) and _holds_more(r.peak(), than.peak(), slack):  # type: ignore[arg-type]
        return f"{r} is predicted to hold more temporaries than {than}"
    return ""


def _holds_more(peak: float, than: float, slack: float) -> bool:
    """Whether a predicted peak of ``peak`` bytes holds more than one of ``than`` (``extract.fatter``) by over
    ``slack`` bytes: the memory test a joint is held to another by (:func:`_held`)."""
    return fatter(peak, than) and peak - than > slack


def in_order(rewritten: Sequence[Joint], model: Any) -> tuple[list[int], list[str]]:
    """The positions of one or two rewritten joints in the order :func:`held_to_written` holds them to JAX's as
    written, and why the first is not taken over the second where it is not: the second (the forward rewritten without
    the ``jointly`` rules) is taken over the first so, but for holding more by no more than the model's ``cache``."""
    if len(rewritten) < 2:
        return list(range(len(rewritten))), []
    why = _held(rewritten[1], rewritten[0], model, float(getattr(model, "cache", 0.0) or 0.0))
    return ([0, 1], [why]) if why else ([1, 0], [])


def held_to_written(rewritten: Sequence[Joint], written: Joint, model: Any,
                    order: tuple[list[int], list[str]] | None = None,
                    made: Callable[[int], Joint] | None = None) -> tuple[Joint, str]:
    """The joint :func:`decided_jointly` keeps, of one or two rewritten ones and the one as written, and why.

    Each is held to the one it would replace, as extraction holds a rewrite to its input (``no_fatter``): taken by
    price or lean band (:func:`_taken`) and, where the model bounds memory, not predicted to hold more
    (``extract.fatter``). The joint from the forward rewritten without the ``jointly`` rules (the second) replaces
    the one from the forward as its rules chose it (the first) so, but for holding more by no more than the
    model's ``cache``: what a small head's loop saves stays in the cache, where the price is right (the plain
    joint of ``linen_gpt`` at N=128 held 1.3 MiB more, predicted, and ran 1.11-1.17x against 0.93x); past it the
    arrays stream from memory, which the price underrates (``equinox_scan`` at N=1024: 7% cheaper, 179 MiB more,
    as ``AnalyticCost.lean_band_far`` reads it). The one taken replaces JAX's as written so; else the other
    rewritten one where it passes against JAX's, else JAX's.

    ``order``, where given, is that order and its reason (:func:`in_order`) found already, on other joints of the
    same two derivatives (their joint extractions, before either is split: ``grad/together.py``'s ``build_vjps``);
    ``made(i)``, where given, the joint of the ``i``-th derivative that is held to JAX's, made only when the choice
    reaches it (``rewritten[i]`` stands for it in the reasons till then)."""
    positions, said = in_order(rewritten, model) if order is None else order
    said = list(said)
    held: dict[int, Joint] = {}
    for i in positions:  # the one taken between the two first
        r = held[i] = rewritten[i] if made is None else made(i)
        why = _held(r, written, model)
        if not why:
            others = [str(held.get(j, o)) for j, o in enumerate(rewritten) if j != i] + [str(written)]
            return r, f"kept {r}; against {', '.join(others)}" + (f" ({'; '.join(said)})" if said else "")
        said.append(why)
    return written, f"kept {written}: {'; '.join(said)}"


def held_alone(built: Any, written: Callable[[], Any], model: Any, joint_of: Callable[[Any], core.ClosedJaxpr],
               as_run: Callable[[], Any] | None = None) -> tuple[Any, str]:
    """:func:`rewrite.grad.vjp.decided_jointly` where no ``jointly`` rule fired in the forward: the derivative of the
    forward rewritten, ``built``, held by memory to JAX's derivative of the loss as written, ``written()`` (unpriced):
    where the model bounds memory and predicts ``built``'s joint program to hold more (``extract.fatter``), JAX's
    runs (``built``'s e-graph released), and why, in words; else ``built``, and "". Its price was held to its own
    input's already (the VJP of the forward rewritten, as extraction holds every rewrite), but not its memory to the
    loss as written's: a forward rewritten to hold less can make a backward that holds more. The loss-first step of
    equinox's scanned, checkpointed GPT at N=128, V=1024 held 4.0 MiB against its 2.3 as written by
    ``memory_analysis``, rewritten by every pack but the LM head's (whose rules, firing there, had made it decided
    jointly and held so). ``as_run``, where given, makes ``written`` as it runs where it is kept (priced).

    It must be predicted to hold more in both of the schedules the model reads (the order XLA's fusion pass made
    the kernels, and that of XLA's lists of their users: ``predict_temp_bytes(users=True)``), as neither reads
    XLA's every tie: ising's free energy at ``[32, 256, 64]``, whose rewritten VJP holds 4.0 MiB against JAX's 6.0
    by ``memory_analysis``, is predicted at 4.0 against 2.0 in the first and 4.0 against 4.0 in the second (kept);
    the equinox step's at 5.4 against 3.7 and 4.4 against 3.7 (JAX's runs)."""
    if not _bounded(model) or "users" not in inspect.signature(model.predict_temp_bytes).parameters:
        return built, ""
    jax_s = written()
    mine, theirs = joint_of(built), joint_of(jax_s)
    known = getattr(built, "peaks", None) if mine is getattr(built, "program", None) else None
    held = [known[0] if known else model.predict_temp_bytes(mine), model.predict_temp_bytes(theirs)]
    if not fatter(*held):
        return built, ""
    users = [model.predict_temp_bytes(p, users=True) for p in (mine, theirs)]
    mib = lambda b: f"{b / 2 ** 20:.2f} MiB"  # noqa: E731
    said = f"{mib(held[0])} against {mib(held[1])}; {mib(users[0])} against {mib(users[1])} in their users' order"
    if not fatter(*users):
        return built, f"kept the forward rewritten: predicted to hold more than JAX's as written in one order ({said})"
    joint = getattr(built, "joint", None)
    if getattr(joint, "release", None) is not None:  # a VJP built to keep its e-graph (a report's): not kept
        joint.release()
    kept = jax_s if as_run is None else as_run()
    if isinstance(joint, Result) and dataclasses.is_dataclass(kept):  # what a limit cut short in the one not kept is
        kept = copy.copy(kept)                                        # still said (grad.primitive: RewriteLimitWarning)
        kept.tried = joint
    return kept, f"kept JAX's derivative of the loss as written: the forward rewritten predicted to hold more ({said})"


def decide(rewritten: Sequence[Joint], written: Joint, model: Any) -> tuple[Joint, str]:
    """The joint kept and why: timed where the model measures (:func:`timed`), else by price
    (:func:`held_to_written`)."""
    if getattr(model, "measures", False):
        found = timed(rewritten, written, model)
        if found is not None:
            return found
    return held_to_written(rewritten, written, model)


def timed(rewritten: Sequence[Joint], written: Joint, model: Any) -> tuple[Joint, str] | None:
    """The fastest joint as run (:func:`rewrite.cost.measure.fastest`, cached as the pipeline's timings are) of
    ``written`` and the ``rewritten`` not predicted to hold more than it where the model bounds memory, and why;
    its ``Timing`` is the kept derivative's ``joint.timing``. ``None`` where they cannot be timed (one candidate,
    programs of other inputs, effects, a timing that failed): then prices decide."""
    bounded = _bounded(model)
    held = [r for r in rewritten if bounded and fatter(r.peak(), written.peak())]
    timed_ = [r for r in rewritten if r not in held] + [written]
    avals = [tuple(j.program.in_avals) for j in timed_]
    if len(timed_) < 2 or any(a != avals[0] for a in avals):
        return None
    timing = fastest(model, [j.program for j in timed_], [j.name for j in timed_])
    if all(s is None for s in timing.seconds) and not timing.cached:
        return None
    chosen = timed_[timing.chosen]
    joint = getattr(chosen.built, "joint", None)
    if isinstance(joint, Result):  # the kept derivative says how it was chosen, as a pipeline's result does
        chosen.built.joint = dataclasses.replace(joint, timing=timing)
    runs = ", ".join(f"{j.name}: {'cached' if s is None else f'{s * 1e6:.4g} us'}"
                     for j, s in zip(timed_, timing.seconds))
    over = "".join(f"; {r} is predicted to hold more temporaries than {written}" for r in held)
    return chosen, f"kept {chosen.name}, the fastest as timed ({runs}){over}"


#: :func:`one_joint_can_win`: the joint program of the forward rewritten with the ``jointly`` rules, as traced, is
#: the only one of a whole step's two joints (``grad/together.py``'s ``rewrite_joints``) that can be kept where its
#: price is under the plain joint's (the forward rewritten without them) by more than this fraction. A rewritten joint
#: comes out no dearer than its input (it is held to it); the plain one is taken over it (:func:`in_order`) only where
#: it comes out priced below it, or within ``AnalyticCost.lean_band_far`` (0.2) above it and far leaner. So the plain
#: one cannot be taken unless its saturation takes more than ``1 - (1 - 0.3) * 1.2 = 16%`` off its input: the most any
#: plain joint's saturation was measured to take off (the extracted joint against its input, each priced whole,
#: 2026-12-03): 15.9% (wholestep_equinox_gpt), 15.1% (wholestep_linen_gpt), 12.7% (flax_lm_step), 0.3%
#: (flax_long_context_step), 0.3% (flax_seq2seq_grad's two VJP joints); in the decision corpus under the golden
#: table 14.0% (ecosystem_flax_lm_step), 0.3% (ecosystem_flax_long_context_step), 0.08% (transformer_step). The two
#: joints' inputs were apart by 0.2-2.2% in all of those but flax_lm_step's: there the jointly one is 35.3% under
#: (its saturation takes 0.3% off; the two together 0.71-0.75 s of CPU against 0.38-0.40 s for it alone, h-seedj),
#: and 23.4% under the golden table (both built there). Where the inputs are closer, or a wider far band is set,
#: both are built, as before.
ONE_JOINT_MARGIN = 0.3

#: the widest ``lean_band_far`` :data:`ONE_JOINT_MARGIN` was derived for (``AnalyticCost``'s default)
_MARGIN_FAR_BAND = 0.2


def one_joint_can_win(jointly_in: float, plain_in: float, model: Any) -> bool:
    """Whether only the joint with the ``jointly`` rules, its input priced ``jointly_in``, can be kept of a whole
    step's two (:data:`ONE_JOINT_MARGIN`): not where the model times programs (``measures``: both are timed) nor
    where its far lean band is wider than the margin was derived for."""
    band = float(getattr(model, "lean_band", 0.0) or 0.0)
    far = max(band, float(getattr(model, "lean_band_far", 0.0) or 0.0)) if band else 0.0
    if getattr(model, "measures", False) or far > _MARGIN_FAR_BAND:
        return False
    return jointly_in < plain_in * (1 - ONE_JOINT_MARGIN)


#: :func:`jointly_cannot_win`: the most a whole step's joint program with the ``jointly`` rules is taken to lose in its
#: saturation (``grad/together.py``'s ``rewrite_joints``), as run, against its input as traced: of its price
#: (:data:`JOINTLY_PRICE_MARGIN`) and of its predicted peak of temporaries (:data:`JOINTLY_PEAK_MARGIN`). That joint's
#: own sites (the LM head's loop) are the forward's, which its rules decided; a joint program of it holds none they
#: match (the module docstring of ``grad/together.py``), and what the other rules find in it they find in the plain
#: joint's shared terms alike. Measured (2026-12-04, as run: the extracted joint against its input, each priced whole
#: and its peak predicted), price / peak taken off: wholestep_linen_gpt 0.32% / 4.9%, wholestep_equinox_gpt
#: 0.36% / 4.4%, flax_long_context_step 0.27% / 16.4% (its two joints both lose the same 7.7-8.0 MiB); under the
#: golden table ecosystem_flax_lm_step 0.18% / 4.9%, ecosystem_flax_long_context_step 0.26% / 16.4%,
#: transformer_step 0.04% / 0%. The margins are about fourteen and two times the most of those. The two GPT steps'
#: test holds up to margins of 11.9% / 35% (equinox: the near band's price; the cache's width between the peaks);
#: flax_long_context_step's would need under 0.79% / 25%: its other joint is built, as before.
JOINTLY_PRICE_MARGIN = 0.05
JOINTLY_PEAK_MARGIN = 0.3


def jointly_cannot_win(jointly_in: float, jointly_peak: float | None, plain: float, plain_peak: float | None,
                       model: Any) -> bool:
    """Whether the joint with the ``jointly`` rules, its input as run priced ``jointly_in`` and predicted to hold
    ``jointly_peak``, cannot be kept over the plain joint rewritten already, priced ``plain`` and holding
    ``plain_peak`` (:func:`in_order`), however its saturation goes within :data:`JOINTLY_PRICE_MARGIN` and
    :data:`JOINTLY_PEAK_MARGIN`: the plain one priced under the least it can come to, not kept as the leaner in
    either lean band at the least it can hold (its time not read: as though within the near band), and the plain
    one not held under it for holding more by over the model's ``cache``. The plain one is then held to JAX's as
    written first (:func:`held_to_written`), the other only where it is not kept. Never where the model times
    programs (``measures``), nor where its far lean band is wider than :data:`ONE_JOINT_MARGIN`'s, nor where a peak
    is not predicted."""
    band = float(getattr(model, "lean_band", 0.0) or 0.0)
    far = max(band, float(getattr(model, "lean_band_far", 0.0) or 0.0)) if band else 0.0
    if getattr(model, "measures", False) or far > _MARGIN_FAR_BAND or jointly_peak is None or plain_peak is None:
        return False
    cost, peak = jointly_in * (1 - JOINTLY_PRICE_MARGIN), jointly_peak * (1 - JOINTLY_PEAK_MARGIN)
    if not plain < cost or keeps_leaner(cost, peak, plain, plain_peak, model, 0.0, math.inf):
        return False
    slack = float(getattr(model, "cache", 0.0) or 0.0)
    return not (_bounded(model) and _holds_more(plain_peak, peak, slack))


#: :func:`plain_cannot_lead`: the most a whole step's plain joint program (the forward rewritten without the
#: ``jointly`` rules) is taken to lose of its predicted peak of temporaries in its saturation, against its input as
#: traced. Its own rules can find more in it than in the other joint (the other rules match the plain forward's
#: head, which the other joint's loop replaced), so it is wider than :data:`JOINTLY_PEAK_MARGIN`. Measured
#: (2026-12-07, CPU table, as run: the extracted plain joint against its input, each priced whole and its peak
#: predicted), price / peak taken off: the full-size whole steps of ``benchmarks/wholestep.py`` 0.26-0.61% /
#: 2.2-3.4%, the ecosystem's wholestep_linen_gpt and wholestep_equinox_gpt 15.1% / 15.8% and 16.3% / 15.3%. The
#: margin is about three times the most of those; the full-size steps' test holds up to margins of 0.58-0.71.
PLAIN_PEAK_MARGIN = 0.5


def plain_cannot_lead(plain_in_peak: float | None, jointly_peak: float | None, model: Any) -> bool:
    """Whether the plain joint, its input as run predicted to hold ``plain_in_peak``, cannot be ordered before the
    joint with the ``jointly`` rules, rewritten already and holding ``jointly_peak`` (:func:`in_order`: the plain one
    goes first only where it holds no more than the other by over the model's ``cache``), however its saturation
    goes within :data:`PLAIN_PEAK_MARGIN`. The other one is then held to JAX's as written first
    (:func:`held_to_written`), the plain one only where it is not kept: the mirror of :func:`jointly_cannot_win`,
    which reads memory alone. Never where the model times programs (``measures``), does not bound memory, or
    predicts no peak."""
    if getattr(model, "measures", False) or plain_in_peak is None or jointly_peak is None or not _bounded(model):
        return False
    slack = float(getattr(model, "cache", 0.0) or 0.0)
    return _holds_more(plain_in_peak * (1 - PLAIN_PEAK_MARGIN), jointly_peak, slack)
