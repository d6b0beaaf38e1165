"""The decision corpus: the cost model's choices between two programs, checked against the clock.

A *decision* is one choice the model makes between two programs that compute the same thing:

* ``chosen``: a rewrite's result against the program as written (``explain``'s ``before`` and ``after``);
* ``declined``: the program the rewrite chose against the same program with a rule's nodes forced in, for
  every loop rewrite that ``explain`` lists as built and not chosen (:meth:`rewrite.Report.forced`);
* ``block``: attention with one key block offered alone, against the program as written;
* ``hand``: the program as written against the benchmarks' own hand-written form, each priced as
  extraction prices an input program: what the model would choose if a rule built it.

The programs are the benchmarks' own builders: the seeds (``derivatives.py``, ``scan.py``), every pack's cases
(``nn.py``, ``linalg.py``, ``loops.py``, ``lm_head.py``, ``attention.py``), the transformer of
``programs.py`` and the ecosystem suite (``ecosystem.py``), rewritten with every built-in pack but
``fastmath``. For each pair the model's predicted ratio (price of the first over the second, a call's fixed
cost included: above 1 means the model prefers the second) is set beside the measured one: one process,
interleaved rounds after a warm-up with an A/A control (``benchmarks/harness.py``), and the temp memory
each holds: what XLA allocates (``memory_analysis``) plus the scratch of its library (YNN) fusions, which
``memory_analysis`` does not count (``benchmarks/library_scratch.py``; plain attention's N x N scores). A pair
is on the wrong side when the model prefers a program measured at least 10% slower, or declines one measured
at least 10% faster, by more than the A/A control moved.

``--write`` writes ``benchmarks/results/decisions.md`` and ``.json``, and the golden decisions
``tests/golden/decisions.json``: each case's choice under the fixed table ``tests/golden/cost_table.json``
with the ratio measured for it, which ``tests/test_decisions.py`` holds every change to. ``--lock`` holds the
benchmark lock while cases are timed (``--chunk`` at a time), not while they are rewritten::

    python -m benchmarks.decisions --lock /tmp/bench.lock --write            # every case, about half an hour
    python -m benchmarks.decisions --lock /tmp/bench.lock --quick            # a few minutes, nothing written
    python -m benchmarks.decisions --lock /tmp/bench.lock --write --cases lm_head_loss_small,seed000_vjp_T64

With ``--cases`` and ``--write`` only those cases are measured again; the other cases' records are kept. A write
keeps beside each pair the last run's measurement of the same programs, and each round's ratio, from which the
report says how far the clock's own noise caps the rank correlation (``benchmarks/decision_noise.py``);
``--report --retest-from OLD.json`` takes another run's measurements instead. A record keeps the prediction of
the model it was timed under; ``--stale`` decides the recorded cases under the model in force (timing nothing)
and names the cases whose decision or predictions have moved since, with the command that times them again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import warnings
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks import decision_noise, decision_programs
from benchmarks.decision_programs import program_key

RESULTS = pathlib.Path(__file__).parent / "results"
GOLDEN = pathlib.Path(__file__).parent.parent / "tests" / "golden" / "decisions.json"
#: the records of a run so far, one case at a time, so that a run stopped part-way can ``--resume``
PARTIAL = RESULTS / "decisions.partial.json"
#: every built-in pack but fastmath, as a user who takes the exact packs gets them
PACKS = ("algebra", "derivatives", "scan", "linalg", "nn", "attention")
#: how far a measured ratio must be on the other side of 1 for a decision to count as wrong (beyond the A/A)
MARGIN = 0.10
REGENERATE = "python -m benchmarks.decisions --lock /tmp/bench.lock --write --cases {cases}"


def packs(blocks: tuple[int, ...] | None = None) -> list:
    """The packs the decisions are made with; ``blocks``: attention's key blocks, where not its default."""
    import rulesets
    from rulesets.attention import attention_with

    return [attention_with(blocks=blocks) if p == "attention" and blocks is not None else getattr(rulesets, p)
            for p in PACKS]


# ---------------------------------------------------------------------------------------------- the corpus
@dataclasses.dataclass(frozen=True)
class Case:
    """One program and how its decisions are made.

    ``build()`` returns ``(fn, args)`` (``args`` a tuple of pytrees). ``mode`` is ``"forward"`` (``rewrite(fn)``),
    ``"grad"`` (the program ``jax.grad(rewrite(fn))`` runs: ``explain(..., grad=True)``), or ``"hand"``: then
    ``hand(fn)`` is the hand-written form it is compared with. ``blocks``: attention's key blocks, each
    offered alone as a ``block`` pair. ``quick``: part of ``--quick``.
    """

    name: str
    source: str
    build: Callable[[], tuple[Callable, tuple]]
    mode: str = "forward"
    hand: Callable[[], Callable] | None = None
    blocks: tuple[int, ...] = ()
    quick: bool = False


def _flat(fn: Callable, args: tuple) -> tuple[Callable, list]:
    from benchmarks.ecosystem import _flat as flat

    return flat(fn, args)


def _cases() -> list[Case]:
    from benchmarks import attention as ba
    from benchmarks import derivatives as bd
    from benchmarks import ecosystem as be
    from benchmarks import linalg as bl
    from benchmarks import lm_head as bh
    from benchmarks import loops as bo
    from benchmarks import nn as bn
    from benchmarks import programs as bp
    from benchmarks import scan as bs

    out: list[Case] = []
    add = lambda *a, **k: out.append(Case(*a, **k))  # noqa: E731

    # seed 000 (derivatives.py): the VJP that jax.vjp(rewrite(f)) runs, its forward, and the hand-derived VJPs
    for T in (64, 512):
        add(f"seed000_vjp_T{T}", f"benchmarks.derivatives.seed, jax.vjp(rewrite(seed)) at T={T}",
            lambda T=T: (bd.seed, bd.inputs(T)[:2]), "grad", quick=T == 64)
        for hand, hfn in bd.SEED_HANDS.items():
            add(f"seed000_{hand}_T{T}", f"benchmarks.derivatives: JAX's VJP of seed against {hand} at T={T}",
                lambda T=T: (bd.as_vjp(bd.seed), bd.inputs(T)), "hand", hand=lambda h=hfn: bd.as_vjp(h),
                quick=T == 64)
    add("seed000_forward_T512", "benchmarks.derivatives.seed at T=512", lambda: (bd.seed, bd.inputs(512)[:2]))
    for name in ("ising", "softplus"):
        add(f"{name}_vjp_T256", f"benchmarks.derivatives.{name}, jax.vjp(rewrite({name})) at T=256",
            lambda n=name: (getattr(bd, n), bd.inputs(256)[:2]), "grad")
        add(f"{name}_hand_T256", f"benchmarks.derivatives: JAX's VJP of {name} against {name}_hand at T=256",
            lambda n=name: (bd.as_vjp(getattr(bd, n)), bd.inputs(256)), "hand",
            hand=lambda n=name: bd.as_vjp(getattr(bd, f"{n}_hand")))

    # seed 001 and the RNN (scan.py)
    seed_args = lambda: bs.seed_case((10, 5, 8), (64, 256, 128))[0]  # noqa: E731
    add("scan_seed", "benchmarks.scan.seed at xs (64, 256, 128)", lambda: (bs.seed, seed_args()), quick=True)
    add("scan_seed_grad", "benchmarks.scan.seed, jax.grad(rewrite(seed)) at xs (64, 256, 128)",
        lambda: (bs.seed, seed_args()), "grad")
    for hand in ("accumulator", "vectorised"):
        add(f"scan_seed_hand_{hand}", f"benchmarks.scan: seed against seed_{hand}", lambda: (bs.seed, seed_args()),
            "hand", hand=lambda h=hand: getattr(bs, f"seed_{h}"))
    add("scan_rnn64", "benchmarks.scan.rnn_mse at batch 64", lambda: (bs.rnn_mse, bs.rnn_params(64)), quick=True)
    add("scan_rnn64_grad", "benchmarks.scan.rnn_mse, jax.grad(rewrite(rnn_mse)) at batch 64",
        lambda: (bs.rnn_mse, bs.rnn_params(64)), "grad")
    add("scan_rnn64_hand", "benchmarks.scan: rnn_mse against rnn_accumulator at batch 64",
        lambda: (bs.rnn_mse, bs.rnn_params(64)), "hand", hand=lambda: bs.rnn_accumulator)
    for steps, width in ((16, 128), (64, 1024)):  # docs/api.md's rulesets.scan example, at its size and larger
        add(f"scan_docs_rnn_{steps}x{width}", f"benchmarks.scan.docs_rnn (docs/api.md's RNN loss) at {steps} x {width}",
            lambda s=steps, w=width: (bs.docs_rnn, bs.docs_rnn_args(s, w)))

    # loops.py: library loops and a fori_loop buffer, forward, gradient and the hand-written accumulators
    for name, make in bo.CASES.items():
        def built(make=make):
            args, vs = make()
            return vs["standard"], args
        add(f"loops_{name}", f"benchmarks.loops.{name}_case", built, quick=name == "fori")
        if name in bo.GRAD:
            add(f"loops_{name}_grad", f"benchmarks.loops.{name}_case, jax.grad(rewrite(loss))", built, "grad")
        add(f"loops_{name}_hand", f"benchmarks.loops.{name}_case: standard against hand-written", built, "hand",
            hand=lambda make=make: make()[1]["hand-written"])

    # nn.py: the one-hot language-model loss and the flax classifier's training step
    def lm_args(n: int = 512, v: int = 8000) -> tuple:
        k1, k2 = jax.random.split(jax.random.PRNGKey(0))
        return jax.random.normal(k1, (n, v), jnp.float32), jax.random.randint(k2, (n,), 0, v)

    add("nn_lm_one_hot", "benchmarks.nn.lm_one_hot at N=512, V=8000", lambda: (bn.lm_one_hot, lm_args()), quick=True)
    add("nn_lm_one_hot_grad", "benchmarks.nn.lm_one_hot, jax.grad(rewrite(...)) at N=512, V=8000",
        lambda: (bn.lm_one_hot, lm_args()), "grad")
    add("nn_lm_one_hot_value_and_grad_program", "benchmarks.nn: rewrite(jax.value_and_grad(lm_one_hot))",
        lambda: (jax.value_and_grad(bn.lm_one_hot), lm_args()))
    add("nn_lm_hand_integer", "benchmarks.nn: lm_one_hot against lm_integer", lambda: (bn.lm_one_hot, lm_args()),
        "hand", hand=lambda: bn.lm_integer)

    def mlp_step() -> tuple:
        [(_, vs, args)] = bn.mlp_cases(10)
        return vs["one_hot"], args

    add("nn_flax_mlp_step", "benchmarks.nn.mlp_cases(10): the training step rewritten whole", mlp_step)

    # lm_head.py: the LM head's loss and gradient, at a small size and at the issue's
    for label, (n, c, v), quick in (("small", (512, 256, 8192), True), ("issue", (2048, 512, 32768), False)):
        built = lambda n=n, c=c, v=v: (bh.loss, tuple(bh.args_at(n, c, v)))  # noqa: E731
        add(f"lm_head_loss_{label}", f"benchmarks.lm_head.loss at N={n}, C={c}, V={v}", built, quick=quick)
        if label == "issue":  # a second at a call here: its gradient and the hand-written form at the small size only
            continue
        add(f"lm_head_grad_{label}", f"benchmarks.lm_head.loss, jax.grad(rewrite(loss)) at N={n}, C={c}, V={v}",
            built, "grad")
        add(f"lm_head_hand_chunked_{label}", f"benchmarks.lm_head: loss against chunked at N={n}, C={c}, V={v}",
            built, "hand", hand=lambda: bh.chunked)

    def bf16_head() -> tuple:
        k = jax.random.split(jax.random.PRNGKey(0), 3)
        h = jax.random.normal(k[0], (512, 256), jnp.bfloat16)
        w = (jax.random.normal(k[1], (256, 8192), jnp.float32) / 16).astype(jnp.bfloat16)
        y = jax.random.randint(k[2], (512,), 0, 8192)

        def loss(h, w, y):
            z = jax.nn.log_softmax(h @ w, axis=-1)
            return -jnp.take_along_axis(z, y[:, None], axis=-1).mean()
        return loss, (h, w, y)

    add("lm_head_bf16_grad", "log_softmax + take_along_axis in bfloat16, jax.grad(rewrite(loss)), N=512 C=256 V=8192",
        bf16_head, "grad")

    # attention.py: plain attention, flax's, a library layer; each key block alone; the hand-written forms
    for n, quick in ((1024, True), (2048, False)):
        qkv = lambda n=n: (ba.plain, tuple(ba.qkv_args("plain", n)))  # noqa: E731
        add(f"attention_plain_N{n}", f"benchmarks.attention.plain at N={n}", qkv, blocks=(256, 512, 1024) if n == 2048
            else (256, 512), quick=quick)
        add(f"attention_plain_hand_chunked_N{n}", f"benchmarks.attention: plain against chunked at N={n}", qkv, "hand",
            hand=lambda: ba.chunked)
        add(f"attention_plain_hand_dpa_xla_N{n}", f"benchmarks.attention: plain against dot_product_attention(xla) "
            f"at N={n}", qkv, "hand", hand=lambda: ba.dpa_xla_bhnd)
    add("attention_plain_grad_N1024", "benchmarks.attention.plain, jax.grad(rewrite(plain)) at N=1024",
        lambda: (ba.plain, tuple(ba.qkv_args("plain", 1024))), "grad")
    add("attention_flax_dpa_N1024", "benchmarks.attention.flax_dpa at N=1024",
        lambda: (ba.flax_dpa, tuple(ba.qkv_args("flax", 1024))))
    add("attention_flax_mha_N1024", "benchmarks.attention.layers(1024)['flax_mha']",
        lambda: (lambda f, x: (f, (x,)))(*ba.layers(1024)["flax_mha"]))

    # linalg.py: the product programs, rewritten, and against the best order written by hand
    def linalg_programs() -> list:
        return bl.programs(np.random.default_rng(0))

    for i, (label, written, best, _) in enumerate(linalg_programs()):
        slug = "_".join(w for w in "".join(ch if ch.isalnum() else " " for ch in label.split(":")[-1].lower()).split())
        slug = f"{i:02d}_{slug}"
        built = lambda i=i: (linalg_programs()[i][1], tuple(linalg_programs()[i][3]))  # noqa: E731
        add(f"linalg_{slug}", f"benchmarks.linalg.programs: {label}", built, quick=i == 0)
        if best is not written and i == 0:  # elsewhere the rewrite builds the hand-written order itself
            add(f"linalg_{slug}_hand", f"benchmarks.linalg.programs: {label}, against the best order by hand", built,
                "hand", hand=lambda i=i: linalg_programs()[i][2])

    # programs.py: the transformer, forward and training step
    for kind in ("forward", "step"):
        add(f"transformer_{kind}", f"benchmarks.programs.transformer_step(2, kind={kind!r})",
            lambda k=kind: bp.transformer_step(2, kind=k))

    # ecosystem.py: every program of the suite
    for name, prog in be.PROGRAMS.items():
        if name in be.TIME_ONLY:
            continue
        add(f"ecosystem_{name}", f"benchmarks.ecosystem: {name} ({prog.library})", prog.build,
            quick=name in ("flax_classifier_onehot", "numpyro_mixture_logp"))
    return out


@functools.cache
def cases() -> list[Case]:
    """Every case of the corpus, built once (building imports every benchmark module)."""
    return _cases()


def select(names: Sequence[str] | None, quick: bool = False) -> list[Case]:
    """The cases named (a name or a prefix ending in ``*``), or the quick ones, or all."""
    every = cases()
    if names:
        chosen = [c for c in every if any(c.name == n or (n.endswith("*") and c.name.startswith(n[:-1]))
                                          for n in names)]
        missing = [n for n in names if not any(c.name == n or (n.endswith("*") and c.name.startswith(n[:-1]))
                                               for c in every)]
        if missing:
            raise SystemExit(f"no case {missing}; the cases are: {', '.join(c.name for c in every)}")
        return chosen
    return [c for c in every if c.quick] if quick else every


# ---------------------------------------------------------------------------------------------- deciding
@dataclasses.dataclass
class Pair:
    """One decision between two programs: ``first`` (the program as written, or as chosen) and ``second``."""

    case: str
    name: str           # "chosen", "declined:<rule>", "block:<keys>", "hand"
    kind: str
    first: str          # which variant of the case's measurement is the first program
    second: str
    predicted: float    # the model's price of first over second, a call's fixed cost included
    #: the operations whose node prices differ most: (operation, price in first, price in second)
    drivers: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)
    predicted_temp: tuple[int, int] = (0, 0)  # the model's predicted peak of temporaries, first and second

    @property
    def prefers(self) -> str:
        """Which program the model takes: a rewrite's choice (``chosen``) always, which it took (the lean band takes
        a program priced up to ``lean_band`` dearer for the memory it saves); elsewhere the second only where it
        prices it lower."""
        return "second" if self.kind == "chosen" or self.predicted > 1.0 else "first"


@dataclasses.dataclass
class Decided:
    """One case decided: its decision (what a rewrite chose), its pairs, and the programs to time them."""

    case: Case
    decision: str
    pairs: list[Pair]
    variants: dict[str, Callable]  # variant name -> a function of ``args``
    args: list
    program: str = ""  # the input program's key (benchmarks/decision_programs.py)


def _fun(closed: Any) -> Callable:
    from rewrite.ir.jaxapi import core

    return core.jaxpr_as_fun(closed)


def _temp(model: Any, closed: Any) -> int:
    try:
        return int(model.predict_temp_bytes(closed))
    except Exception:
        return 0


def _cotangents(closed: Any, n_primals: int, seed: int = 1) -> list:
    from rewrite.cost.measure import synthetic_inputs

    return synthetic_inputs(closed.in_avals[n_primals:], seed)


def _breakdown(report: Any) -> list[tuple[str, float, float]]:
    """The node prices of the input program and the chosen one, by operation, largest difference first."""
    from rewrite.extract.extractor import _CONTAINERS, Extractor
    from rewrite.report.why import _breakdown as by_op

    res = report.result
    if res.egraph is None or res.choice is None or report.model is None:
        return []
    ex = Extractor(res.snapshot, report.model)
    _, tree = ex.tree()
    _, orig = ex.tree(lambda cls, ctor, args: ctor in _CONTAINERS or (ctor, args) in res.original)
    roots = list(res.roots)
    if not all(r in orig for r in roots):
        return []
    a, b = by_op(ex, {**tree, **orig}, roots), by_op(ex, dict(res.choice), roots)
    out = sorted(((op, a.get(op, 0.0), b.get(op, 0.0)) for op in set(a) | set(b)), key=lambda t: -abs(t[2] - t[1]))
    return [d for d in out if d[1] != d[2]][:4]


#: The corpus records the cost model's decisions, so the limits that depend on the machine's load are lifted:
#: wall time (and each rule's share of it) is ten times the default, which no case comes near on a quiet
#: machine, so that a loaded one (CI's two test workers, other jobs) cannot cut a rule short and flip a
#: decision. The iteration and node limits, which do not depend on the load, are the defaults.
DECIDE_LIMITS = {"seconds": 200.0}


def decide(case: Case, *, programs: bool = True, declined: bool = True) -> Decided:
    """Make the case's decisions under the cost model in force (``priced_with`` pins a table).

    With ``programs=False`` nothing is emitted for timing: only the decision and each pair's predicted side;
    with ``declined=False`` the declined rules' pairs are left out (their forced programs are not built).
    """
    from rewrite import explain
    from rewrite.cost.model import default_model

    model = default_model()
    fn, args = case.build()
    flat, leaves = _flat(fn, args)
    if case.mode == "hand":
        hand, _ = _flat(case.hand(), args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first, second = explain(flat, *leaves), explain(hand, *leaves)  # no rules: the programs as loaded
        before, after = first.before, second.before
        predicted = (first.cost_before + first.fixed_cost) / (second.cost_before + first.fixed_cost_of(after))
        pair = Pair(case.name, "hand", "hand", "original", "hand", predicted,
                    predicted_temp=(_temp(model, before), _temp(model, after)) if programs else (0, 0))
        decision = "prefers the hand-written form" if pair.prefers == "second" else "prefers the program as written"
        variants = {"original": flat, "aa": _again(flat), "hand": hand} if programs else {}
        return Decided(case, decision, [pair], variants, leaves, program_key(before))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = explain(flat, *leaves, rulesets=packs(), grad=case.mode == "grad", limits=DECIDE_LIMITS)
    res = report.result
    fixed = report.fixed_cost
    decision = "rewritten: " + ", ".join(sorted(report.used)) if res.rewritten and report.used else (
        "rewritten" if res.rewritten else "original")
    run_args = list(leaves)
    if case.mode == "grad":
        run_args += _cotangents(report.before, len(leaves))
    pairs: list[Pair] = []
    variants: dict[str, Callable] = {}
    if programs:
        variants = {"original": _fun(report.before), "aa": _again(_fun(report.before))}
    if res.rewritten:
        pairs.append(Pair(case.name, "chosen", "chosen", "original", "rewritten", report.predicted_speedup))
        if programs:  # what a report shows: the terms behind the prediction
            pairs[-1].drivers = _breakdown(report)
            pairs[-1].predicted_temp = (_temp(model, report.before), _temp(model, report.after))
            variants["rewritten"] = _fun(report.after)
    if report.step_used:  # what rewrite(step) runs: the step with its losses read from the loss-first program
        pairs.append(Pair(case.name, "runs", "chosen", "original", "runs", report.runs_speedup))
        if programs:
            pairs[-1].predicted_temp = (_temp(model, report.before), _temp(model, report.runs))
            variants["runs"] = _fun(report.runs)
    # the loop rewrites built and not chosen, each against the program chosen (for a gradient, both unsplit)
    kept = "rewritten" if case.mode == "forward" and res.rewritten else ("kept" if res.rewritten else "original")
    for d in report.declined() if declined else ():
        pairs.append(Pair(case.name, f"declined:{d.rule}", "declined", kept, f"declined:{d.rule}",
                          (d.kept + fixed) / (d.declined + fixed), list(d.drivers[:4])))
        if programs:
            forced = report.forced(d.rule)
            if forced is None:
                pairs.pop()
                continue
            variants[f"declined:{d.rule}"] = _fun(forced)
            pairs[-1].predicted_temp = (_temp(model, res.after), _temp(model, forced))
            if kept == "kept":
                variants["kept"] = _fun(res.after)
    # attention's key blocks, each offered alone: which the model would take, against the program as written
    for keys in case.blocks:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            alone = explain(flat, *leaves, rulesets=packs((keys,)))
        if alone.result.rewritten:
            pairs.append(Pair(case.name, f"block:{keys}", "block", "original", f"block:{keys}",
                              alone.predicted_speedup))
            if programs:
                pairs[-1].drivers = _breakdown(alone)
                pairs[-1].predicted_temp = (_temp(model, alone.before), _temp(model, alone.after))
                variants[f"block:{keys}"] = _fun(alone.after)
    return Decided(case, decision, pairs, variants, run_args, program_key(report.before))


def _again(fn: Callable) -> Callable:
    """``fn`` under another identity, so that ``jax.jit`` compiles it apart: the A/A control."""
    def again(*args: Any) -> Any:
        return fn(*args)
    return again


def decisions(chosen: Sequence[Case]) -> dict[str, dict]:
    """Each case's decision and its pairs' sides under the model in force, nothing compiled or timed."""
    out = {}
    for case in chosen:
        d = decide(case, programs=False)
        out[case.name] = {"decision": d.decision, "pairs": {p.name: p.prefers for p in d.pairs}, "program": d.program}
    return out


def compare(name: str, want: dict, got: dict) -> str | None:
    """``None`` when the decisions ``got`` (:func:`decisions`) are the golden ``want``, else what flipped, with
    the measurement recorded for it and the command that records a new one."""
    lines = []
    if want["decision"] != got["decision"]:
        lines.append(f"the rewrite's choice: golden {want['decision']!r}, now {got['decision']!r}")
    for pair in dict.fromkeys([*want["pairs"], *got["pairs"]]):
        w, side = want["pairs"].get(pair), got["pairs"].get(pair)
        if w is not None and w["prefers"] == side:
            continue
        if w is None:
            lines.append(f"pair {pair}: new, the model prefers the {side} program (not measured yet)")
            continue
        measured = ("not measured" if w["measured"] is None else
                    f"measured {w['measured']:.2f}x, A/A {w['aa']:.2f}x: the {'second' if w['measured'] > 1 else 'first'} "
                    "program ran faster")
        now = "no longer made" if side is None else f"now prefers the {side}"
        lines.append(f"pair {pair}: golden prefers the {w['prefers']} program ({measured}); {now}")
    if not lines:
        return None
    return (f"decision flipped in case {name}:\n  " + "\n  ".join(lines) + "\nIf the change is meant, measure the case "
            "again and record the new decision (put the new ratio in the commit message):\n  "
            + REGENERATE.format(cases=name))


def golden_decisions(chosen: Sequence[Case]) -> dict[str, dict]:
    """:func:`decisions` priced with the golden files' fixed table (``tests/golden/cost_table.json``)."""
    from rewrite.cost.model import priced_with

    table = json.loads((GOLDEN.parent / "cost_table.json").read_text())
    with priced_with(table):
        return decisions(chosen)


# ---------------------------------------------------------------------------------------------- measuring
#: A case is timed in ``rounds`` interleaved rounds, and again as many more, up to ``MORE_ROUNDS`` times ``rounds``,
#: while it is noisy (:func:`noisy`): its A/A control off by more than ``NOISY``, or a pair's per-round ratios spread
#: (interquartile range over median) by more than ``WIDE``. A quiet case costs what it did; a loaded one is timed
#: until its ratios settle or the rounds run out.
MORE_ROUNDS = 3
NOISY = 0.03
WIDE = 0.15


def paired(samples: dict[str, list[float]], first: str, second: str) -> tuple[float, float]:
    """The median over rounds of ``time(first) / time(second)`` within a round, and the interquartile range of
    those ratios over it. Each round ran every variant once, back to back, so a ratio within a round cancels the
    machine's drift between rounds, which the ratio of the two medians keeps."""
    ratios = [a / b for a, b in zip(samples[first], samples[second])]
    med = statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else [min(ratios), med, max(ratios)]
    return med, (q[2] - q[0]) / med if med else 0.0


def noisy(samples: dict[str, list[float]], pairs: Sequence[tuple[str, str]]) -> bool:
    """Whether the rounds so far leave the case's ratios unsettled: the A/A control's paired ratio off 1 by more
    than :data:`NOISY`, or some pair's per-round ratios spread by more than :data:`WIDE`.

    >>> noisy({"original": [1.0, 1.0, 1.0], "aa": [1.0, 1.01, 0.99], "b": [0.5, 0.5, 0.5]}, [("original", "b")])
    False
    >>> noisy({"original": [1.0, 1.0, 1.0], "aa": [0.9, 0.9, 0.9], "b": [0.5, 0.5, 0.5]}, [("original", "b")])
    True
    """
    if "aa" in samples and abs(paired(samples, "original", "aa")[0] - 1.0) > NOISY:
        return True
    return any(paired(samples, a, b)[1] > WIDE for a, b in pairs)


def timed(d: "Decided", rounds: int, most: int) -> harness.Row:
    """The case's variants compiled, warmed up and timed by ``harness.measure`` (interleaved rounds in a shuffled
    order, each block at least 20 ms), in ``rounds`` rounds and, while :func:`noisy`, ``rounds`` more at a time, up
    to ``most``."""
    pairs = [(p.first, p.second) for p in d.pairs]
    return harness.measure(d.case.name, d.variants, d.args, baseline="original", rounds=rounds, warmup=2,
                           more=lambda samples: noisy(samples, pairs), most_rounds=most)


def _cpu_busy() -> tuple[float, float]:
    """Seconds of CPU the whole machine and this process have spent busy so far (``/proc/stat``, ``os.times``)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return math.nan, math.nan
    hz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0.0)) / hz, own.user + own.system


class Contention:
    """What else ran on the machine while a case was timed: the load average (one minute) at the start and the
    end, and ``others``, the share of the machine's cores that other processes kept busy on average (the machine's
    busy CPU time less this process's, over the wall time and the cores). The load average counts this process's
    own threads (a product on both cores adds 2) and lags by a minute; ``others`` does neither.

    >>> with Contention() as c:
    ...     pass
    >>> sorted(c.record())
    ['load', 'others']
    """

    def __enter__(self) -> "Contention":
        import time

        self.load0, (self.busy0, self.own0), self.t0 = os.getloadavg()[0], _cpu_busy(), time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        import time

        busy, own = _cpu_busy()
        wall = max(time.monotonic() - self.t0, 1e-9)
        others = ((busy - self.busy0) - (own - self.own0)) / (wall * (os.cpu_count() or 1))
        self.load = [round(self.load0, 2), round(os.getloadavg()[0], 2)]
        self.others = round(min(max(others, 0.0), 1.0), 3) if not math.isnan(others) else math.nan

    def record(self) -> dict[str, Any]:
        return {"load": self.load, "others": self.others}


#: a pair counts as measured on a quiet machine when the load average stayed under ``QUIET_LOAD`` through its case
QUIET_LOAD = 2.0


def quiet(rec: dict) -> bool:
    """Whether the pair's case was timed with the load average under :data:`QUIET_LOAD` at its start and end
    (records made before the load was recorded are not)."""
    return bool(rec.get("load")) and max(rec["load"]) < QUIET_LOAD


def measure_case(d: Decided, rounds: int, most: int | None = None) -> list[dict]:
    """Time the case's programs interleaved (with an A/A control) and return one record per pair: the measured
    ratio is the median of the per-round ratios (:func:`paired`), in ``rounds`` rounds or, where the case is noisy,
    up to ``most`` (:func:`timed`; by default :data:`MORE_ROUNDS` times ``rounds``). Each record keeps what else
    ran meanwhile (:class:`Contention`)."""
    if not d.pairs:
        return []
    with warnings.catch_warnings(), Contention() as busy:
        warnings.simplefilter("ignore")
        row = timed(d, rounds, most if most is not None else MORE_ROUNDS * rounds)
    aa = paired(row.samples, "original", "aa")[0]
    out = []
    for p in d.pairs:
        measured, spread = paired(row.samples, p.first, p.second)
        rec = {"case": p.case, "pair": p.name, "kind": p.kind, "source": d.case.source, "mode": d.case.mode,
               "decision": d.decision, "predicted": p.predicted, "prefers": p.prefers, "measured": measured,
               "measured_medians": row.seconds[p.first] / row.seconds[p.second],
               # the least time of each over the rounds (the least disturbed): an estimator that a busy machine
               # moves less than the median, kept beside it to compare (not the headline's)
               "measured_least": min(row.samples[p.first]) / min(row.samples[p.second]),
               "aa": aa, "noise": abs(1.0 - aa), "spread": spread,
               "ms_first": row.seconds[p.first] * 1e3, "ms_second": row.seconds[p.second] * 1e3,
               "temp_first": row.stats[p.first].temp_bytes, "temp_second": row.stats[p.second].temp_bytes,
               "scratch_first": row.stats[p.first].scratch_bytes, "scratch_second": row.stats[p.second].scratch_bytes,
               "predicted_temp_first": p.predicted_temp[0], "predicted_temp_second": p.predicted_temp[1],
               "drivers": [list(t) for t in p.drivers], "rounds": row.rounds, **busy.record(),
               # each round's ratio, for the noise ceiling (benchmarks/decision_noise.py: odd rounds against even)
               "ratios": [round(a / b, 5) for a, b in zip(row.samples[p.first], row.samples[p.second])]}
        rec["wrong"] = wrong_side(rec)
        out.append(rec)
    return out


def keep_quieter(records: list[dict], again: list[dict]) -> list[dict]:
    """``records`` with each case timed ``again`` replaced by the timing during which other processes kept the
    smaller share of the cores busy (:class:`Contention`); each pair of such a case lists both timings
    (``timings``), so the choice stays visible. Cases not timed again are kept as they are, in their order.

    >>> first = [{"case": "a", "pair": "chosen", "measured": 0.9, "aa": 1.0, "load": [3, 3], "others": 0.6},
    ...          {"case": "b", "pair": "chosen", "measured": 1.1, "aa": 1.0, "load": [1, 1], "others": 0.0}]
    >>> again = [{"case": "a", "pair": "chosen", "measured": 1.2, "aa": 1.0, "load": [1, 1], "others": 0.1}]
    >>> [(r["case"], r["measured"], len(r.get("timings", []))) for r in keep_quieter(first, again)]
    [('a', 1.2, 2), ('b', 1.1, 0)]
    """
    by_case: dict[str, list[dict]] = {}
    for r in again:
        by_case.setdefault(r["case"], []).append(r)
    out: list[dict] = []
    for r in records:
        if r["case"] not in by_case:
            out.append(r)
            continue
        if any(x["case"] == r["case"] for x in out):  # the case's records are already in
            continue
        first = [x for x in records if x["case"] == r["case"]]
        second = by_case[r["case"]]
        quieter = second if second[0].get("others", 1.0) < first[0].get("others", 1.0) else first
        for x in quieter:
            x["timings"] = [{k: y.get(k) for k in ("measured", "aa", "load", "others")}
                            for y in first + second if y["pair"] == x["pair"]]
        out.extend(quieter)
    return out


def wrong_side(rec: dict) -> bool:
    """The model prefers a program measured >= 10% slower, or declines one measured >= 10% faster, by more
    than the A/A control moved. Declining a program that holds more temp memory than the first
    (:func:`holds_more`) is right whatever its speed: a rewrite must not hold more memory than the original."""
    m, noise = rec["measured"], rec["noise"]
    if rec["prefers"] == "second":
        return m <= 1.0 - MARGIN and (1.0 - m) > noise
    return m >= 1.0 + MARGIN and (m - 1.0) > noise and not holds_more(rec)


def held(rec: dict, side: str, scratch: bool = True) -> int:
    """The temp memory the pair's ``side`` (``first``, ``second``) program holds: ``memory_analysis``'s temp plus,
    with ``scratch``, its library fusions' scratch (``benchmarks.library_scratch``; 0 where not recorded).

    >>> rec = {"temp_first": 0, "scratch_first": 32}
    >>> held(rec, "first"), held(rec, "first", scratch=False)
    (32, 0)
    """
    return rec.get(f"temp_{side}", 0) + (rec.get(f"scratch_{side}", 0) if scratch else 0)


def holds_more(rec: dict, scratch: bool = True) -> bool:
    """Whether the pair's second program holds more temp memory than its first, by 1% and 64 KiB (as measured:
    ``memory_analysis`` plus, with ``scratch``, the library scratch it does not count: :func:`held`)."""
    first, second = held(rec, "first", scratch), held(rec, "second", scratch)
    return second > first * 1.01 and second - first > 64 * 1024


#: the library scratch of the pairs recorded before records kept it (``--scratch-only``): "case|pair" ->
#: [first, second], bytes
SCRATCH = RESULTS / "decisions_scratch.json"


def fill_scratch(records: list[dict]) -> int:
    """Give each record without its programs' library scratch the one :data:`SCRATCH` holds for its pair; the
    number of records left without (their scratch counts 0)."""
    known = json.loads(SCRATCH.read_text())["pairs"] if SCRATCH.exists() else {}
    missing = 0
    for r in records:
        if "scratch_first" in r:
            continue
        got = known.get(f"{r['case']}|{r['pair']}")
        if got is None:
            missing += 1
            continue
        r["scratch_first"], r["scratch_second"] = got
    return missing


#: a recorded pair whose prediction under the model in force has moved by more than this share is stale (``--stale``)
STALE = 0.02


def stale(records: Sequence[dict], now: dict[str, tuple[str, dict[str, float]]]) -> dict[str, list[str]]:
    """The recorded pairs that the model in force no longer predicts as their records say, by case: ``now`` maps
    each case decided again (``decide(case, programs=False)``) to its decision and each pair's predicted ratio.
    A case is stale where its decision moved (its programs measured are not the ones it chooses now), where a
    pair's prediction moved by over :data:`STALE`, or where a pair is built and not recorded, or recorded and no
    longer built; a line for each. Cases not in ``now`` are not judged.

    >>> recs = [{"case": "a", "pair": "chosen", "decision": "rewritten: r", "predicted": 1.10},
    ...         {"case": "b", "pair": "chosen", "decision": "rewritten: r", "predicted": 1.10}]
    >>> stale(recs, {"a": ("rewritten: r", {"chosen": 1.105}), "b": ("rewritten: r, s", {"chosen": 1.3})})
    {'b': ["decision 'rewritten: r' -> 'rewritten: r, s'", 'chosen predicted 1.100 -> 1.300']}
    """
    out: dict[str, list[str]] = {}
    by_case: dict[str, dict[str, dict]] = {}
    for r in records:
        by_case.setdefault(r["case"], {})[r["pair"]] = r
    for case, (decision, pairs) in now.items():
        recorded = by_case.get(case, {})
        lines = []
        was = {r.get("decision") for r in recorded.values()} - {None}
        if was and decision not in was:
            lines.append(f"decision {sorted(was)[0]!r} -> {decision!r}")
        for name, predicted in pairs.items():
            rec = recorded.get(name)
            if rec is None:
                lines.append(f"{name} built (predicted {predicted:.3f}), not recorded")
            elif abs(math.log(predicted / rec["predicted"])) > math.log1p(STALE):
                lines.append(f"{name} predicted {rec['predicted']:.3f} -> {predicted:.3f}")
        lines += [f"{name} recorded, no longer built" for name in recorded if name not in pairs]
        if lines:
            out[case] = lines
    return out


def stale_only(chosen: Sequence[Case]) -> None:
    """``--stale``: decide each recorded case under the model in force (nothing compiled or timed), print the
    stale pairs (:func:`stale`) and the command that times their cases again, and the corpus's rank correlation
    with every pair's prediction made now."""
    saved = json.loads((RESULTS / "decisions.json").read_text())
    records = saved["records"]
    now: dict[str, tuple[str, dict[str, float]]] = {}
    for case in chosen:  # every case: one recorded with no pair (the program kept) may rewrite under the model now
        d = decide(case, programs=False)
        now[case.name] = (d.decision, {p.name: p.predicted for p in d.pairs})
    found = stale(records, now)
    for case, lines in found.items():
        print(f"{case}:\n  " + "\n  ".join(lines), flush=True)
    here = [r for r in records if r["pair"] in now.get(r["case"], ("", {}))[1]]
    made = [{**r, "predicted": now[r["case"]][1][r["pair"]]} for r in here]
    print(f"{len(found)} of {len(now)} cases stale; Spearman over the {len(here)} pairs still built: recorded "
          f"{rank_figures(here)['all']:.4f}, predicted now {rank_figures(made)['all']:.4f}", flush=True)
    if found:
        print("time them again:\n  " + REGENERATE.format(cases=",".join(found)), flush=True)


def scratch_only(chosen: Sequence[Case], declined: bool) -> None:
    """Decide each case, compile its programs (timing nothing) and record each pair's library scratch in
    :data:`SCRATCH`, beside those already there, and in ``decisions.json``'s records of the pair that keep one
    (a count read from the compiled programs again, not a timing)."""
    from benchmarks.library_scratch import scratch_bytes

    out = json.loads(SCRATCH.read_text())["pairs"] if SCRATCH.exists() else {}
    path = RESULTS / "decisions.json"
    saved = json.loads(path.read_text()) if path.exists() else {"records": []}
    for case in chosen:
        try:
            d = decide(case, declined=declined)
            got = {v: scratch_bytes(jax.jit(fn).lower(*d.args).compile()) for v, fn in d.variants.items() if v != "aa"}
        except Exception as e:
            print(f"{case.name}: FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        kept = False
        for p in d.pairs:
            out[f"{case.name}|{p.name}"] = [got[p.first], got[p.second]]
            print(f"{case.name:45s} {p.name:40s} scratch {got[p.first] / harness.MiB:.1f} -> "
                  f"{got[p.second] / harness.MiB:.1f} MiB", flush=True)
            for r in saved["records"]:
                if (r["case"], r["pair"]) == (case.name, p.name) and "scratch_first" in r:
                    r["scratch_first"], r["scratch_second"] = got[p.first], got[p.second]
                    kept = True
        if kept:  # once a case, not once a record: the whole file each time
            path.write_text(json.dumps(saved, indent=1, default=float))
        SCRATCH.write_text(json.dumps({"note": "the library (YNN) fusions' scratch of each pair's programs, bytes "
                                       "(python -m benchmarks.decisions --scratch-only), for the records made "
                                       "before decisions.json kept it", "pairs": dict(sorted(out.items()))}, indent=1)
                           + "\n")
        jax.clear_caches()


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    if len(xs) < 3:
        return math.nan
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx and vy else math.nan


# ---------------------------------------------------------------------------------------------- the report
def _term(rec: dict) -> str:
    """The model's terms behind a pair's prediction: the node prices that differ most, and the memory term."""
    parts = [f"{op} {a:,.0f} -> {b:,.0f}" for op, a, b in rec["drivers"][:2]]
    pt = (rec["predicted_temp_first"], rec["predicted_temp_second"])
    mib = harness.MiB
    if pt[0] or pt[1]:
        parts.append(f"predicted temp {pt[0] / mib:.1f} -> {pt[1] / mib:.1f} MiB "
                     f"(measured {held(rec, 'first') / mib:.1f} -> {held(rec, 'second') / mib:.1f}"
                     + (f"; memory_analysis {rec['temp_first'] / mib:.1f} -> {rec['temp_second'] / mib:.1f}"
                        if rec.get("scratch_first") or rec.get("scratch_second") else "") + ")")
    if not rec["drivers"] and rec["kind"] == "hand":
        parts.insert(0, "priced whole (fusion model), no per-node split")
    return "; ".join(parts) or "-"


def _load(rec: dict) -> str:
    """The load average at the case's start and end, and the share of the cores other processes kept busy."""
    if not rec.get("load"):
        return "-"
    others = rec.get("others", math.nan)
    return (f"{rec['load'][0]:.1f}-{rec['load'][1]:.1f}"
            + (f" ({others:.0%})" if isinstance(others, (int, float)) and not math.isnan(others) else "")
            + (", the quieter of " + " and ".join(f"{t['measured']:.2f}x ({t['others']:.0%})" for t in rec["timings"])
               if len(rec.get("timings", [])) > 1 else ""))


def _row(rec: dict) -> str:
    def ratio(scratch: bool) -> str:
        first, second = held(rec, "first", scratch), held(rec, "second", scratch)
        return f"x{second / first:.2f}" if first else ("-" if not second else f"0 -> {second / harness.MiB:.1f} MiB")

    mem = ratio(True) if "scratch_first" in rec else "?"
    return (f"| {rec['case']} | {rec['pair']} | {rec['predicted']:.2f}x | {rec['measured']:.2f}x | {rec['aa']:.2f}x | "
            f"{rec['ms_first']:.2f} | {mem} | {ratio(False)} | {_load(rec)} | {'**wrong**' if rec['wrong'] else ''} |")


def rank_figures(records: Sequence[dict]) -> dict[str, Any]:
    """Spearman's rank correlation of predicted against measured ratios over every pair, over the close calls
    (predicted within 0.8-1.25x), and over the pairs timed on a quiet machine (:func:`quiet`), with their counts.

    >>> recs = [{"predicted": p, "measured": m, "load": [l, l]} for p, m, l in
    ...         ((1.0, 1.0, 1.0), (2.0, 2.1, 1.0), (3.0, 2.9, 1.5), (1.1, 0.5, 4.0))]
    >>> f = rank_figures(recs)
    >>> round(f["all"], 2), f["quiet"], f["n_quiet"]
    (0.8, 1.0, 3)
    """
    def rho(rows: Sequence[dict]) -> float:
        return spearman([math.log(r["predicted"]) for r in rows], [math.log(r["measured"]) for r in rows])

    near = [r for r in records if 0.8 <= r["predicted"] <= 1.25]
    calm = [r for r in records if quiet(r)]
    least = [{**r, "measured": r["measured_least"]} for r in records if r.get("measured_least")]
    return {"all": rho(records), "near": rho(near), "n_near": len(near), "quiet": rho(calm), "n_quiet": len(calm),
            "quiet_near": rho([r for r in calm if r in near]), "n_quiet_near": sum(1 for r in calm if r in near),
            "least": rho(least), "n_least": len(least)}


def markdown(records: list[dict], meta: dict) -> str:
    unscratched = fill_scratch(records)
    ranks = rank_figures(records)
    errors = sorted(abs(math.log(r["measured"] / r["predicted"])) for r in records)
    band = {q: math.exp(errors[min(len(errors) - 1, int(q * len(errors)))]) - 1 for q in (0.5, 0.8, 0.9)}
    for r in records:
        r["wrong"] = wrong_side(r)
    wrong = [r for r in records if r["wrong"]]
    for_memory = [r for r in records if r["prefers"] == "first" and holds_more(r) and r["measured"] >= 1.0 + MARGIN
                  and r["measured"] - 1.0 > r["noise"]]
    miss = sorted(records, key=lambda r: -abs(math.log(r["predicted"]) - math.log(r["measured"])))
    kinds = {k: sum(1 for r in records if r["kind"] == k) for k in ("chosen", "declined", "block", "hand")}
    grew = [r for r in records if r["prefers"] == "second" and holds_more(r)]
    grew_ma = [r for r in records if r["prefers"] == "second" and holds_more(r, scratch=False)]
    lines = [
        "# Decisions: the cost model's choices against the clock\n",
        f"`{meta['command']}`, {meta['date']}, {meta['machine']}, {meta['device']}, jax {meta['jax']}. "
        f"Load average at the start {meta['load'][0]}, at the end {meta['load'][1]}: **this machine is shared** "
        "(two cores, other sessions compiling and timing beside this run), so single ratios move by the A/A "
        "column and more. Each case is measured in one process, interleaved rounds after a warm-up, with an A/A "
        f"control (the first program compiled again); {meta['rounds']} rounds"
        + (f", and more, up to {meta['most_rounds']}, where a case's A/A is off by over {NOISY:.0%} or a pair's "
           f"per-round ratios spread over {WIDE:.0%}" if meta.get("most_rounds", meta["rounds"]) > meta["rounds"]
           else "")
        + ". Predicted: the model's price of the "
        "first program over the second (`AnalyticCost` with this machine's calibration table, a call's fixed cost "
        "included); measured: "
        + ("the median over rounds of the first's time over the second's in the same round (paired)"
           if "most_rounds" in meta else "the first's median time over the second's") + ". Above 1: the second is (predicted) "
        "faster. The model *prefers* the second where it predicts above 1. Memory: the second's temp memory "
        "over the first's, **`memory_analysis`'s temp plus the scratch of XLA:CPU's library (YNN) fusions**, which "
        "`memory_analysis` does not count (plain attention's N x N scores, held inside its one library fusion: "
        "`benchmarks/library_scratch.py` reads it from the compiled HLO, checked against the peak resident memory "
        "of one call in `results/library_scratch.md`); `memory_analysis`'s alone beside it"
        + (f" ({unscratched} pair{'s have' if unscratched > 1 else ' has'} no scratch recorded, `?`: counted 0)"
           if unscratched else "") + ".\n",
        "## Headline\n",
        *([f"- decided and recorded but not timed (XLA compiled one of their programs for minutes): "
           f"{', '.join(meta['skipped'])}"] if meta.get("skipped") else []),
        f"- pairs: {len(records)} ({', '.join(f'{n} {k}' for k, n in kinds.items())}) from {len({r['case'] for r in records})} "
        f"cases, rewritten with {', '.join(PACKS)}",
        f"- **on the wrong side** (prefers a program measured >= {MARGIN:.0%} slower, or declines one measured "
        f">= {MARGIN:.0%} faster, beyond the A/A): **{len(wrong)}**"
        + (f": {', '.join(r['case'] + ' ' + r['pair'] for r in wrong)}" if wrong else "")
        + ("; not counted, declined though measured faster because they hold more temp memory than the first: "
           + ", ".join(f"{r['case']} {r['pair']} ({r['measured']:.2f}x, temp {held(r, 'first') / harness.MiB:.1f} -> "
                        f"{held(r, 'second') / harness.MiB:.1f} MiB)"
                       for r in for_memory) if for_memory else ""),
        f"- **Spearman rank correlation** of predicted against measured ratio: **{ranks['all']:.3f}** over every pair; "
        f"{ranks['near']:.3f} over the {ranks['n_near']} pairs predicted within 0.8-1.25x (the decisions that are "
        f"close calls); over the {ranks['n_quiet']} pairs whose case was timed with the load average under {QUIET_LOAD:g} at "
        f"its start and end (the load column): {ranks['quiet']:.3f}, close calls {ranks['quiet_near']:.3f} "
        f"({ranks['n_quiet_near']})"
        + (f"; against each program's least time over the rounds (`measured_least`, the least disturbed; the "
           f"{ranks['n_least']} pairs that record it) {ranks['least']:.3f}" if ranks["n_least"] else ""),
        *decision_noise.headline(records, spearman),
        f"- the model's error (measured over predicted, either way): median {band[0.5]:.0%}, 80th percentile "
        f"{band[0.8]:.0%}, 90th {band[0.9]:.0%}",
        f"- preferred programs that hold more temp memory than the first (`memory_analysis` + library scratch, by 1% "
        f"and 64 KiB): **{len(grew)}**" + (f": {', '.join(r['case'] + ' ' + r['pair'] for r in grew)}" if grew else "")
        + f"; by `memory_analysis` alone: {len(grew_ma)}",
        "",
        "## Worst misses (largest gap between predicted and measured, in log ratio)\n",
        "| case | pair | predicted | measured | A/A | the model's terms behind the prediction |",
        "|---|---|---|---|---|---|",
    ]
    for r in miss[:12]:
        lines.append(f"| {r['case']} | {r['pair']} | {r['predicted']:.2f}x | {r['measured']:.2f}x | {r['aa']:.2f}x | "
                     f"{_term(r)} |")
    lines += ["", "## Every pair\n",
              "Load: the load average (one minute) at the start and end of the case's timing, and in brackets the "
              "share of the two cores other processes kept busy meanwhile (this process's own threads are in the load "
              "average, not in the share).\n",
              "Temp: the second's over the first's, `memory_analysis` + library scratch (`?`: no scratch recorded); "
              "memory_analysis: its alone.\n",
              "| case | pair | predicted | measured | A/A | first ms | temp | memory_analysis | load | |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(r) for r in records]
    return "\n".join(lines) + "\n"


def write(records: list[dict], meta: dict, golden: dict[str, dict], only: Sequence[str] | None) -> None:
    """The results (md, json) and the golden decisions. With ``only``, the other cases' records are kept."""
    path = RESULTS / "decisions.json"
    if path.exists():  # the last run's measurements of the same programs: the clock's noise (decision_noise)
        last = json.loads(path.read_text())
        decision_noise.carry_retest(records, last["records"], last["meta"]["date"])
    if only and path.exists():
        old = last["records"]
        records = [r for r in old if r["case"] not in only] + records
    (RESULTS / "decisions.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1, default=float))
    old_md = RESULTS / "decisions.md"
    kept = old_md.read_text() if old_md.exists() else ""
    kept = kept[kept.index(harness.HAND_NOTES):] if harness.HAND_NOTES in kept else ""
    (RESULTS / "decisions.md").write_text(markdown(records, meta) + (f"\n{kept}" if kept else ""))
    write_golden(golden, records, only)


def write_golden(golden: dict[str, dict], records: list[dict], only: Sequence[str] | None) -> None:
    """``tests/golden/decisions.json``: each case's decision under the fixed table, with what was measured for it."""
    old = json.loads(GOLDEN.read_text())["cases"] if only and GOLDEN.exists() else {}
    cases_out = {k: v for k, v in old.items() if k not in golden}
    for name, g in golden.items():
        cases_out[name] = {"decision": g["decision"], "pairs": decision_programs.measured_pairs(name, g, records)}
    GOLDEN.write_text(json.dumps({
        "note": "Golden decisions (tests/test_decisions.py): each case's choice under tests/golden/cost_table.json, "
                "with the ratio measured for each pair by the last `python -m benchmarks.decisions --write` "
                "(first program's time over the second's; prefers: the side the model takes). Regenerate only "
                "with a new measurement: " + REGENERATE.format(cases="<the cases that changed>"),
        "cases": dict(sorted(cases_out.items()))}, indent=1) + "\n")


@contextlib.contextmanager
def holding(path: str) -> Iterator[None]:
    """Hold the lock file ``path`` (``flock``) meanwhile, so that no other benchmark times beside this one."""
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decisions", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the quick subset, few rounds")
    ap.add_argument("--cases", default="", help="comma-separated case names (a trailing * matches a prefix)")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds per case (default 7, --quick 5)")
    ap.add_argument("--write", action="store_true", help="write the results and the golden decisions")
    ap.add_argument("--this-program", action="store_true", help="with --write: record the golden decisions for the "
                    "input programs this JAX traces (tests/golden/decisions.programs.json), nothing else")
    ap.add_argument("--this-jax", action="store_true",
                    help="with --this-program: record them for this JAX's minor version too, where the same input "
                         "program decides otherwise on another JAX (the whole-step search traces the loss's VJP)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--report", action="store_true", help="write decisions.md again from decisions.json, measuring nothing")
    ap.add_argument("--retest-from", default="", help="with --report: a decisions.json of another run, whose "
                    "measurements of the same pairs are kept beside this run's for the noise ceiling")
    ap.add_argument("--most-rounds", type=int, default=0, help="rounds a noisy case is timed up to (default "
                    f"{MORE_ROUNDS} times --rounds; --rounds itself: no more rounds)")
    ap.add_argument("--lock", default="", help="a lock file (flock) to hold while cases are timed, and only then")
    ap.add_argument("--chunk", type=int, default=12, help="cases rewritten before each hold of the lock")
    ap.add_argument("--skip", default="", help="cases decided and recorded but not timed (a program XLA compiles for minutes)")
    ap.add_argument("--chosen-only", action="store_true", help="time no declined pair (a forced program XLA "
                    "compiles for minutes); the golden decisions still record every pair's side")
    ap.add_argument("--again-above", type=float, default=1.0, help="time once more, at the end, each case timed while "
                    "other processes kept more than this share of the cores busy (decisions.Contention), and keep the "
                    "quieter of its two timings (both in the record's timings); default 1: never")
    ap.add_argument("--scratch-only", action="store_true", help="decide and compile the cases (timing nothing) and "
                    f"record each pair's library scratch in {SCRATCH.name}, for records made before they kept it")
    ap.add_argument("--stale", action="store_true", help="decide the recorded cases under the model in force "
                    "(timing nothing) and list the pairs whose decision or prediction moved since they were timed")
    ap.add_argument("--resume", action="store_true", help=f"keep the cases already timed in {PARTIAL.name} and time the rest")
    opts = ap.parse_args(argv)
    names = [n for n in opts.cases.split(",") if n]
    chosen = select(names, opts.quick)
    if opts.list:
        for c in chosen:
            print(f"{c.name:55s} {c.mode:8s} {c.source}")
        return
    if opts.scratch_only:
        return scratch_only(chosen, declined=not opts.chosen_only)
    if opts.stale:
        return stale_only(chosen)
    if opts.report:
        saved = json.loads((RESULTS / "decisions.json").read_text())
        if opts.retest_from:  # another run's measurements of the same pairs, kept beside this run's (decision_noise)
            other = json.loads(pathlib.Path(opts.retest_from).read_text())
            found = decision_noise.carry_retest(saved["records"], other["records"], other["meta"]["date"])
            print(f"{found} of {len(saved['records'])} pairs measured in the run of {other['meta']['date']}")
            (RESULTS / "decisions.json").write_text(json.dumps(saved, indent=1, default=float))
        old_md = (RESULTS / "decisions.md").read_text() if (RESULTS / "decisions.md").exists() else ""
        kept = old_md[old_md.index(harness.HAND_NOTES):] if harness.HAND_NOTES in old_md else ""
        (RESULTS / "decisions.md").write_text(markdown(saved["records"], saved["meta"]) + (f"\n{kept}" if kept else ""))
        return
    if opts.write and opts.quick:
        ap.error("--write records every case (or those of --cases); --quick is a look, not a record")
    rounds = opts.rounds or (5 if opts.quick else 7)
    load0 = os.getloadavg()
    records: list[dict] = []
    skip = {n for n in opts.skip.split(",") if n}
    done: set[str] = set()
    if opts.resume and PARTIAL.exists():
        saved = json.loads(PARTIAL.read_text())
        records, done = saved["records"], set(saved["done"])
    timed = [c for c in chosen if c.name not in skip and c.name not in done]

    def run(cases: Sequence[Case]) -> list[dict]:
        """Decide and time ``cases``: rewritten outside the lock, a chunk of cases at a time, then timed holding it."""
        found: list[dict] = []
        for start in range(0, len(cases), opts.chunk):
            decided = []
            for case in cases[start:start + opts.chunk]:
                try:
                    decided.append(decide(case, declined=not opts.chosen_only))
                except Exception as e:  # a case that fails to build is reported, not hidden
                    print(f"{case.name}: FAILED to decide: {type(e).__name__}: {e}", flush=True)
            with holding(opts.lock):
                for d in decided:
                    try:
                        recs = measure_case(d, rounds, opts.most_rounds or None)
                    except Exception as e:
                        print(f"{d.case.name}: FAILED to run: {type(e).__name__}: {e}", flush=True)
                        continue
                    found.extend(recs)
                    for r in recs:
                        print(f"{r['case']:45s} {r['pair']:40s} predicted {r['predicted']:6.2f}x measured "
                              f"{r['measured']:6.2f}x A/A {r['aa']:.2f}x load {_load(r)}"
                              f"{'  WRONG' if r['wrong'] else ''}", flush=True)
                    if not recs:
                        print(f"{d.case.name:45s} ({d.decision}; no pair to time)", flush=True)
                    done.add(d.case.name)
                    PARTIAL.write_text(json.dumps({"records": records + found, "done": sorted(done)}, default=float))
            del decided
            jax.clear_caches()
        return found

    records.extend(run(timed))
    if opts.again_above < 1.0:  # the cases timed while other processes were busy, once more at the end
        busy = {r["case"] for r in records if r.get("others", 0.0) > opts.again_above}
        records[:] = keep_quieter(records, run([c for c in timed if c.name in busy]))
    meta = {"command": "python -m benchmarks.decisions" + (" --quick" if opts.quick else "")
            + (f" --cases {opts.cases}" if names else "") + (f" --rounds {opts.rounds}" if opts.rounds else "")
            + (" --chosen-only" if opts.chosen_only else "")
            + (f" --again-above {opts.again_above:g}" if opts.again_above < 1.0 else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": platform.processor() or platform.machine(), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "rounds": rounds, "most_rounds": opts.most_rounds or MORE_ROUNDS * rounds,
            "load": [f"{x:.1f}" for x in load0[:1]] + [f"{os.getloadavg()[0]:.1f}"]}
    if records:
        print(markdown(records, meta).split("## Worst misses")[0])
    meta["skipped"] = sorted(skip)
    if opts.write and opts.this_program:
        decision_programs.write(golden_decisions(chosen), records, f"jax {jax.__version__}", by_jax=opts.this_jax)
        PARTIAL.unlink(missing_ok=True)
        print(f"wrote {decision_programs.PROGRAMS}")
    elif opts.write:
        write(records, meta, golden_decisions(chosen), [c.name for c in chosen] if names else None)
        PARTIAL.unlink(missing_ok=True)
        print(f"wrote {RESULTS / 'decisions.md'}, .json and {GOLDEN}")


if __name__ == "__main__":
    sys.exit(main())
