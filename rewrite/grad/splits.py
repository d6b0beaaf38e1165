"""The price of a VJP's split as :func:`rewrite.grad.vjp.choose_residuals` searches it: each split priced as the
programs XLA compiles apart (a training step's, a gradient alone's, and the backward's), whole."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from ..cost.live import LiveFusion
from ..cost.program import Op, Program
from ..extract.extractor import shared
from ..extract.program import ProgramPricer, prices_programs
from ..ir.walk import operands, walk


def scope_classes(snap: Any, choice: dict, roots: Sequence[Any], stop: set | frozenset = frozenset()) -> set:
    """Classes the program's own scope computes for ``roots`` (not inside bodies), not looking past ``stop``."""
    return set(walk(roots, lambda c: () if c in stop else operands(snap, choice[c])))


def split_pricer(snap: Any, model: Any, choice: dict, f_roots: Sequence[Any], b_roots: Sequence[Any]
                 ) -> Callable[[list[Any]], float]:
    """The price of a split of ``choice``: a training step's plus a gradient alone's."""
    ex = shared(snap, model)
    if prices_programs(model):
        pricer = ProgramPricer(ex, model)
        templates = pricer.templates(choice, f_roots)  # the extractor's, but for what reads this choice

        fusion = model.program_fusion() if hasattr(model, "program_fusion") else None
        lives: dict[str, _LiveRole] = {}

        def program(roots: Sequence[Any], inputs: frozenset = frozenset(), role: str = "") -> float:
            prog = Program.from_choice(ex, choice, roots, lambda c, nd: pricer.own(c, nd, choice),
                                       templates, inputs=inputs)
            if fusion is None or not role:
                return pricer.price(prog)
            live = lives.get(role)
            if live is None:
                live = lives[role] = _LiveRole(fusion)
            return live.price(prog)
    else:
        def program(roots: Sequence[Any], inputs: frozenset = frozenset()) -> float:
            stop = set(inputs)
            cs = scope_classes(snap, choice, roots, stop) - stop
            return sum(ex.own(c, choice[c], choice) for c in cs)

    def price(residuals: list[Any], live: bool = False) -> float:
        bwd = program(b_roots, frozenset(residuals), "bwd" if live else "")
        train = program(list(f_roots) + list(residuals), role="train" if live else "")
        alone = program(list(residuals), role="alone" if live else "") if residuals else 0.0
        return train + alone + 2 * bwd

    price.live = lambda residuals: price(residuals, True)  # type: ignore[attr-defined]
    return price


class _LiveRole:
    """One of a split's programs (the backward, a training step's, a gradient alone's) kept as a
    :class:`rewrite.cost.live.LiveFusion` across the splits a search prices: each program is edited into it
    where it differs from the one before (ops by class), and only the kernels the edit touches are placed and
    priced again, where a whole price places and prices every kernel. Its prices equal the whole ones up to the
    order of the sums."""

    def __init__(self, fusion: Any) -> None:
        self.fusion = fusion
        self.live: LiveFusion | None = None
        self.ops: dict[Any, tuple] = {}  # class -> what its op in the live program is made of

    def price(self, prog: Program) -> float:
        ops = prog.ops
        keyed: dict[Any, tuple] = {}
        changes: dict[Any, Op | None] = {}
        for op in ops:
            args = tuple(ops[a].key for a in op.args)
            made = (("param", op.out_avals) if op.prim == "param"
                    else (op.prim, args, op.own, id(op.memo), id(op.params), op.out_avals))
            keyed[op.key] = made
            if self.ops.get(op.key) != made:
                changes[op.key] = dataclasses.replace(op, args=args)
        for c in self.ops:
            if c not in keyed:
                changes[c] = None
        self.ops = keyed
        outputs = [ops[i].key for i in prog.outputs]
        if self.live is None:
            self.live = LiveFusion(self.fusion, outputs)
        self.live.edit(changes, outputs)
        return float(self.live.price())
