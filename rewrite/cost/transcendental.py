"""How XLA:CPU evaluates transcendentals in a fused loop beyond their prices one by one.

The fusion model (``rewrite/cost/fusion.py``) prices a kernel's elementwise work as the sum of its operations'
measured prices. Two things make a loop's transcendentals cost other than that sum, each measured on this backend
(``benchmarks/calibrate.py``): some pairs of one argument are computed from shared work (``sin`` and ``cos``;
``sinh`` and ``cosh``, also across kernels), and a transcendental that reads another's result in the same loop waits
for its latency (a chain). The functions here are read by ``FusionModel.kernel`` and by its incremental twin
``LiveFusion`` alike.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Container, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Var

from ..ir import primitives as _primitives
from .program import REDUCE, Op, _kind, _size


#: Transcendentals XLA:CPU computes from shared work where they take one argument, each to the calibration table's key
#: for the pair of them in one loop: ``sin`` and ``cos`` (LLVM merges them into one ``sincos`` call); ``sinh`` and
#: ``cosh`` (JAX lowers both through ``exp(x - ln 2)`` and ``exp(-x - ln 2)``, which XLA's common-subexpression
#: elimination computes once). ``benchmarks/calibrate.py --shared-only`` reads the sharing from the compiled programs
#: and times each pair alone and together.
SHARED = {"sin": "sincos", "cos": "sincos", "sinh": "sinhcosh", "cosh": "sinhcosh"}
#: The groups whose shared work XLA computes once in the whole program, not once per kernel: the two ``exp`` of
#: ``sinh`` and ``cosh`` are operations of their own, expensive, so XLA stores them for every kernel that reads them
#: (the VJP of ``log(cosh(x))``: ``cosh`` in one kernel, ``sinh`` in another, two ``exp`` kernels between). ``sin`` and
#: ``cos`` are each one operation, recomputed in every loop that needs them.
SHARED_ACROSS = frozenset({"sinhcosh"})


def shared_group(op: Op) -> str | None:
    """The :data:`SHARED` group ``op`` is a member of (``None``: none): ``sin``/``cos`` of an argument, and ``sinh``/
    ``cosh`` of real numbers (of complex ones XLA computes each apart)."""
    group = SHARED.get(op.prim)
    if group is None or not op.args:
        return None
    if group != "sincos" and op.out_avals and np.issubdtype(getattr(op.out_avals[0], "dtype", np.float32),
                                                           np.complexfloating):
        return None
    return group


def group_price(model: Any, group: str, which: Iterable[str]) -> float:
    """ns per element of a group's members in one loop: the table's measured price of the group where both are
    there, else (a table that has none) ``sincos`` at 1.3 ``sin`` as always, and another group at its members' sum."""
    which = sorted(which)
    if len(which) == 1:
        return model.ns.get(which[0], model.default)
    found = model.ns.get(group)
    if found is not None:
        return found
    if group == "sincos":
        return model.ns.get("sin", model.default) * 1.3
    return sum(model.ns.get(p, model.default) for p in which)


def add_shared(cost: float, model: Any, ops: Sequence[Any], sincos: dict) -> float:
    """``cost`` plus the transcendentals of ``sincos`` ((group, argument) -> which of the group's members a kernel
    takes of it, :data:`SHARED`): both of one argument are priced as the group. Added one by one, in order, so that
    the whole and the live price (``LiveFusion._kernel``) sum them alike."""
    for (group, arg), which in sincos.items():
        cost += _size(ops[arg].out_avals[0]) * group_price(model, group, which)
    return cost


def shared_across(model: Any, ops: Any, kernels_of: Mapping[tuple, int]) -> float:
    """What the kernels of a program pay more than XLA for the work of :data:`SHARED_ACROSS` it computes once:
    ``kernels_of`` maps (group, argument) to how many kernels compute a member of the group of that argument, each of
    which pays the shared part (the two members apart less the pair in one loop); XLA pays it once. 0 where the table
    has no price of the pair (the members are then priced apart, as before), at the multiple of its per-element prices
    a loop of that size pays (``FusionModel.loop_share``). The bytes of the stored ``exp`` are not counted: each
    kernel reads a member's argument or the other member's output in their place."""
    terms = []
    for (group, arg), k in kernels_of.items():
        if k < 2 or group not in model.ns:
            continue
        members = [p for p, g in SHARED.items() if g == group]
        part = sum(model.ns.get(p, model.default) for p in members) - model.ns[group]
        if part > 0:
            elems = _size(ops[arg].out_avals[0])
            terms.append((k - 1) * elems * part * model.loop_share(elems))
    return math.fsum(terms)


def chained(model: Any, prog: Any, inside: Container[Any] | Iterable[Any]) -> float:
    """The price of the dearest chain of transcendentals in the loop computing ``inside``, where one reads
    another's result through the loop's own arithmetic (``log(2 cosh(x))``, ``log1p(exp(x))``); 0 where none does.

    A loop is evaluated element by element: a transcendental alone runs at its throughput, but one that waits for
    another waits for its latency too, and XLA:CPU's loops of a few such functions run at about 1.5-2 times
    the two apart (``benchmarks/calibrate.py --chain-only``: ``chain`` is the measured share of the chain's
    prices paid more). A reduction in the loop ends a chain: what it reads is summed, not waited for element by
    element.
    """
    ops = prog.ops
    members = inside if isinstance(inside, (set, frozenset, dict)) else set(inside)
    trans = [i for i in members if ops[i].family == _primitives.TRANSCENDENTAL]
    if len(trans) < 2:
        return 0.0
    best: dict[Any, tuple[float, int]] = {}  # op -> (price, transcendentals) of the dearest chain ending there

    def chain_to(i: Any) -> tuple[float, int]:
        stack = [i]
        while stack:
            x = stack[-1]
            if x in best:
                stack.pop()
                continue
            op = ops[x]
            todo = [a for a in op.args if a in members and a not in best]
            if todo and _kind(op) != REDUCE:
                stack.extend(todo)
                continue
            stack.pop()
            ins = [best[a] for a in op.args if a in members] if _kind(op) != REDUCE else []
            price, count = max(ins, default=(0.0, 0))
            if op.family == _primitives.TRANSCENDENTAL:
                price, count = price + model._facts(op, prog)[5], count + 1
            best[x] = (price, count)
        return best[i]

    return max((p for p, n in map(chain_to, trans) if n >= 2), default=0.0)


#: ``log(1/2)``: XLA:CPU computes ``cosh(x)`` as ``exp(x + log(1/2)) + exp(log(1/2) - x)`` (``chlo.cosh``'s
#: decomposition) and ``sinh(x)`` of ``|x| >= 1`` as their difference.
LOG_HALF = math.log(0.5)


def _exponentials(x: Any) -> tuple[Any, Any]:
    w = x.astype(jnp.float32) if jnp.finfo(x.dtype).bits < 32 else x  # 16-bit floats: computed in float32
    return jnp.exp(w + LOG_HALF), jnp.exp(LOG_HALF - w)


def _cosh_of(x: Any, up: Any, down: Any) -> Any:
    return (up + down).astype(x.dtype)


def _sinh_of(x: Any, up: Any, down: Any) -> Any:
    w = x.astype(up.dtype)
    m = lax.expm1(w)
    return lax.select(lax.abs(w) < 1.0, (m + m / (m + 1.0)) * 0.5, up - down).astype(x.dtype)


def as_exponentials(eqns: Sequence[Any]) -> list[Any] | None:
    """``eqns`` with each ``sinh`` and ``cosh`` of a real argument written as XLA:CPU computes it, or ``None`` where
    there is none: the two exponentials of :data:`LOG_HALF` (in float32 for a 16-bit argument), made once for every
    member of one argument (XLA's common-subexpression elimination), and each member from them (``cosh`` their sum,
    ``sinh`` their difference, or ``expm1``'s form where ``|x| < 1``). Each exponential is an expensive operation of
    its own, so XLA stores both for every kernel that reads a member where members are read by two kernels or
    more, where the model stored one ``cosh``: JAX's VJP of ``log(2 cosh(b h)) / b`` at ``[32, 256, 64]`` holds
    4 MiB by ``memory_analysis``, which the model had predicted as 2 (``tests/test_memory.py``). For the memory
    model only (``memory.as_xla_simplifies``): the equations are sized, never run.

    The three forms are traced once per argument type (:func:`_forms`) and inlined with variables of their own. An
    argument whose forms cannot be inlined (a trace that holds constants, or a member that is not an equation's
    result) is left as written, its exponentials not made."""
    made: dict[Any, tuple[Any, Any]] = {}  # argument -> its two exponentials
    out: list[Any] = []
    changed = False
    for e in eqns:
        name = e.primitive.name
        x = e.invars[0] if e.invars else None
        aval = getattr(x, "aval", None)
        forms = (_forms(tuple(aval.shape), aval.dtype, bool(jax.config.jax_enable_x64))
                 if name in ("sinh", "cosh") and isinstance(x, Var) and aval is not None
                 and jnp.issubdtype(aval.dtype, jnp.floating) else None)
        if forms is None:
            out.append(e)
            continue
        exponentials, members = forms
        if x not in made:
            made[x] = (Var(exponentials.outvars[0].aval), Var(exponentials.outvars[1].aval))
            out += _inlined(exponentials, [x], dict(zip(exponentials.outvars, made[x])))
        member = members[name]
        out += _inlined(member, [x, *made[x]], {member.outvars[0]: e.outvars[0]})
        changed = True
    return out if changed else None


@functools.lru_cache(maxsize=64)
def _forms(shape: tuple, dtype: Any, x64: bool) -> tuple[Any, dict[str, Any]] | None:
    """``(exponentials, {"cosh": ..., "sinh": ...})``: the jaxprs of :func:`_exponentials` at an argument of
    ``shape`` and ``dtype`` and of each member from those two (``x64``, the process's ``jax_enable_x64``, types
    their literals), or ``None`` where one holds constants or a result is not an equation's."""
    spec = jax.ShapeDtypeStruct(shape, dtype)
    exponentials = jax.make_jaxpr(_exponentials)(spec)
    both = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in exponentials.jaxpr.outvars]
    members = {name: jax.make_jaxpr(f)(spec, *both) for name, f in (("cosh", _cosh_of), ("sinh", _sinh_of))}
    if not all(_made(t) for t in (exponentials, *members.values())):
        return None
    return exponentials.jaxpr, {name: m.jaxpr for name, m in members.items()}


def _made(traced: Any) -> bool:
    """Whether ``traced`` holds no constants and each of its results is one of its equations' (so that inlining it
    writes them)."""
    made = {o for e in traced.jaxpr.eqns for o in e.outvars}
    return not traced.consts and all(isinstance(v, Var) and v in made for v in traced.jaxpr.outvars)


def _inlined(jaxpr: Any, args: Sequence[Any], outs: Mapping[Any, Any]) -> list[Any]:
    """``jaxpr``'s equations reading ``args`` for its inputs and writing ``outs``' values for its keys, each of its
    other results a new variable (a form is inlined once for each argument it is made of)."""
    to: dict[Any, Any] = dict(zip(jaxpr.invars, args))
    eqns = []
    for e in jaxpr.eqns:
        results = [outs[v] if v in outs else Var(v.aval) if isinstance(v, Var) else v for v in e.outvars]
        eqns.append(e.replace(invars=[to.get(v, v) if isinstance(v, Var) else v for v in e.invars], outvars=results))
        to.update(zip(e.outvars, results))
    return eqns
