"""egglog 14's native extraction against the extractor's own bottom-up pass, on the same e-graph and prices.

``python -m benchmarks.egglog_dag [program ...]`` (the ecosystem suite's names; needs egglog 14, whose bindings
have ``extract_best_with_dag_cost_model``). Each program is explained with the identity packs; then, on its
saturated e-graph, three passes are timed: the extractor's tree pass (``Extractor.tree``, the start of every
search), and egglog's ``tree`` and ``greedy-dag`` extractors given the same node prices (the analytic model's,
read from the tree pass's choice; a node's class is fixed by the node). The whole extraction stage is timed
too, for scale. Prices are computed before the clock starts, so egglog's figures leave out the cost model.
Run under the bench lock; ``benchmarks/results/versions.md`` has the figures.

``python -m benchmarks.egglog_dag --saturation [program ...]`` (any egglog) times, within saturation
(``Engine.run``), what egglog itself runs: the ``facts`` ruleset to saturation and the ``match`` ruleset (the only
runs a scheduler of egglog's could govern: the rules' right-hand sides are built in Python, under the engine's own
back-off), and the batched inserts with their rebuild (``EGraph.flush``).
"""

from __future__ import annotations

import sys
import time

from egglog import bindings as eb

import rulesets
from benchmarks import ecosystem
from rewrite import explain
from rewrite.cost.model import AnalyticCost
from rewrite.extract.extract import extract
from rewrite.extract.extractor import _CONTAINERS, Extractor
from rewrite.ir import terms

PACKS = "algebra,derivatives,scan,linalg,nn,attention"
DEFAULT = ("equinox_mlp_grad", "haiku_lstm_grad", "flax_transformer_step", "flax_lm_step")


def _prices(ex: Extractor, snap, cost: dict, choice: dict) -> dict:
    """Every node's own price under the analytic model, a nested node's with its bodies' tree costs."""
    out = {}
    for cls, ns in snap.nodes.items():
        for ctor, args in ns:
            bodies = ex.body_classes(ctor, args)
            if bodies:
                out[(ctor, args)] = float(ex.model(ex.info(cls, ctor, args, choice, tuple(cost.get(b, 0.0)
                                                                                          for b in bodies))))
            elif ctor in _CONTAINERS or (ctor == "Proj" and args[0] not in choice):
                out[(ctor, args)] = 0.0
            else:
                out[(ctor, args)] = ex.own(cls, (ctor, args), choice)
    return out


def compare(name: str) -> str:
    fn, args = ecosystem.PROGRAMS[name].build()
    flat, leaves = ecosystem._flat(fn, args)
    res = explain(flat, *leaves, rulesets=[getattr(rulesets, p) for p in PACKS.split(",")]).result
    snap, roots = res.snapshot, res.roots
    ex = Extractor(snap, AnalyticCost())
    t = time.perf_counter()
    cost, choice = ex.tree()
    ours = time.perf_counter() - t
    t = time.perf_counter()
    extract(snap, roots, ex.model, res.original)
    whole = time.perf_counter() - t
    prices, to_int = _prices(ex, snap, cost, choice), snap.egraph.eg.value_to_i64

    def enode_cost(fname: str, values: list) -> float:
        key = (fname, tuple(to_int(v) if s == "i64" else v for v, s in zip(values, terms.ctor_arg_sorts(fname))))
        return prices.get(key, 0.0)  # rows that are not program nodes (facts, names) cost nothing

    model = eb.DagCostModel(0.0, enode_cost, lambda *_: 0.0, lambda *_: 0.0)
    sort = {cls: snap.functions[ns[0][0]].output_sort for cls, ns in snap.nodes.items()}
    egg_roots = [(sort[r], r) for r in roots]
    times = {}
    for mode in ("tree", "greedy-dag"):
        t = time.perf_counter()
        eb.extract_best_with_dag_cost_model(snap.egraph.eg, egg_roots, model, extractor=mode)
        times[mode] = time.perf_counter() - t
    return (f"| {name} | {len(snap.nodes)} | {snap.num_rows} | {ours:.3f} | {times['tree']:.3f} | "
            f"{times['greedy-dag']:.3f} | {whole:.3f} |")


def saturation(name: str) -> str:
    """One program's saturation time, and egglog's runs' and inserts' parts of it."""
    from rewrite.ir.egraph import EGraph
    from rewrite.rules.saturate import Engine

    spent = {"facts": 0.0, "match": 0.0, "flush": 0.0, "saturate": 0.0}
    runs = {"facts": 0, "match": 0}
    originals = (EGraph.run, EGraph.flush, Engine.run)

    def run(self, ruleset, *, saturate=False):
        t = time.perf_counter()
        try:
            return originals[0](self, ruleset, saturate=saturate)
        finally:
            spent[ruleset] = spent.get(ruleset, 0.0) + time.perf_counter() - t
            runs[ruleset] = runs.get(ruleset, 0) + 1

    def timed(original, key):
        def wrapped(self):
            t = time.perf_counter()
            try:
                return original(self)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapped

    flush, engine_run = timed(originals[1], "flush"), timed(originals[2], "saturate")

    fn, args = ecosystem.PROGRAMS[name].build()
    flat, leaves = ecosystem._flat(fn, args)
    EGraph.run, EGraph.flush, Engine.run = run, flush, engine_run
    try:
        explain(flat, *leaves, rulesets=[getattr(rulesets, p) for p in PACKS.split(",")])
    finally:
        EGraph.run, EGraph.flush, Engine.run = originals
    whole = spent["saturate"]
    part = lambda k: f"{spent[k]:.3f} ({100 * spent[k] / whole:.0f}%)"  # noqa: E731
    return (f"| {name} | {runs['match']} | {whole:.3f} | {part('facts')} | {part('match')} | {part('flush')} |")


def main(argv: list[str]) -> None:
    if argv[:1] == ["--saturation"]:
        print("| program | `match` runs | saturation (s) | egglog `facts` runs (s) | egglog `match` runs (s) | "
              "inserts and rebuilds (s) |")
        print("|---|---|---|---|---|---|")
        for name in argv[1:] or DEFAULT:
            print(saturation(name), flush=True)
        return
    if not hasattr(eb, "extract_best_with_dag_cost_model"):
        raise SystemExit("this egglog has no native DAG extraction (egglog 14 has)")
    print("| program | classes | rows | our tree pass (s) | egglog tree (s) | egglog greedy-dag (s) | "
          "our whole extraction (s) |")
    print("|---|---|---|---|---|---|---|")
    for name in argv or DEFAULT:
        print(compare(name), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
