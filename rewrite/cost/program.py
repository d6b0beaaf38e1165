"""The program the whole-program cost model prices: one :class:`Op` per operation, in order.

A :class:`Program` is built from a jaxpr's top-level equations or from an
extractor's choice (bodies are priced whole by the node model, except a call
XLA inlines whose body is elementwise). Each op's kind says what XLA:CPU's
fusion makes of it (``LEAF``, ``VIEW``, ``LOOP``, ``LIBRARY``, ``REDUCE``,
``OTHER``), from the primitive's record; ``fusion.py`` prices programs (and makes one more kind of kernel,
``ATTENTION``, of several ops).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..ir import primitives as _primitives
from ..ir import terms as _terms
from ..ir.intern import PARAMS, TupleType
from ..ir.jaxapi import core, literals, scan_counts
from ..ir.primitives import NodeInfo, inner_jaxpr, is_float as _is_float, spec_of
from ..ir.scanread import SLICES
from ..ir.walk import children, operands, postorder_list, walk
from .prices import NODE_KEY


# What XLA:CPU does with each primitive (expensive, cheap, what a library reduction absorbs) lives in its
# record (rewrite/ir/primitives.py), which the functions below read.
#: The weight of the node-by-node price that breaks ties between programs that fuse alike (``cost/fusion.py``).
TIEBREAK = 1e-3
#: Smaller reductions stay ordinary loop fusions (measured: 2048 elements do, 4096 do not).
LIBRARY_MIN_ELEMENTS = 4096


LEAF, VIEW, LOOP, LIBRARY, REDUCE, OTHER = "leaf", "view", "loop", "library", "reduce", "other"
#: The kind of a kernel XLA:CPU's library (YNN) fusion makes of a product, a softmax and a product together
#: (``rewrite/cost/fusion.py``'s :func:`~rewrite.cost.attention.attention_chain`): no op is of this kind, a kernel is.
ATTENTION = "attention"


@dataclasses.dataclass
class Op:
    """One operation of a program, as the fusion model sees it."""

    prim: str
    family: str
    params: Mapping[str, Any]
    args: tuple[int, ...]
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    #: For ops the model does not fuse (dots, loops, opaque calls): their cost from the node model.
    own: float = 0.0
    #: The class (or variable) this op computes, for reading the decisions back.
    key: Any = None
    #: Facts about the op that do not depend on the program around it (its kind, its tie-break price),
    #: shared by every program an extraction builds with this node: a search prices hundreds of them.
    memo: dict | None = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class Program:
    """Operations in topological order, and which of them the program returns."""

    ops: list[Op]
    outputs: list[int]
    #: Where several programs share one ``ops`` list (they differ in their outputs only): their kernels' prices, by
    #: model, root, kind and members (:func:`remembered_kernel`); ``None``: each priced afresh.
    kernel_prices: dict | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_jaxpr(cls, closed: Any, node_cost: Callable[[Any], float] | None = None) -> "Program":
        """The top-level equations of a ``ClosedJaxpr`` (bodies are costed whole by ``node_cost``; a ``scan`` JAX
        unrolls is its straight-line code: :func:`unroll`).

        Equal equations are one operation, as after XLA's common-subexpression
        elimination: ``sin(a*x) * cos(a*x)`` traces ``a*x`` twice, and XLA
        computes it once, and the two functions of it as one ``sincos``.
        """
        ops: list[Op] = []
        seen: dict[tuple, int] = {}

        lits: dict[tuple, int] = {}
        options: list[str] = []  # numpy's print options, read at the first literal (they shape its ``repr``)

        def read(atom: Any, env: dict) -> int:
            if isinstance(atom, core.Literal):
                if not options:
                    options.append(repr(np.get_printoptions()))
                key = (literal_repr(atom.val, options[0]), aval_str(atom.aval))
                if key not in lits:
                    ops.append(Op("literal", _primitives.SPECIAL, {}, (), (), (atom.aval,)))
                    lits[key] = len(ops) - 1
                return lits[key]
            return env[atom]

        # what an equation makes that does not depend on its operands, by the equation object, where a body runs a
        # trip at a time (a scan JAX unrolls: seed 000's backward, 32 trips of 48 equations, priced several times a
        # rewrite): read at its first trip; and each literal's op, by the literal object
        facts: dict[int, tuple] = {}
        lit_ops: dict[int, int] = {}

        def read_again(atom: Any, env: dict) -> int:
            if isinstance(atom, core.Literal):
                found = lit_ops.get(id(atom))
                if found is None:
                    found = lit_ops[id(atom)] = read(atom, env)
                return found
            return env[atom]

        def run(jaxpr: Any, env: dict, trips: bool = False) -> None:
            for eqn in jaxpr.eqns:
                got = facts.get(id(eqn)) if trips else None
                if got is None:
                    name = eqn.primitive.name
                    got = (unrolled(name, eqn.params),
                           PARAMS.intern_params(eqn.primitive, eqn.params)
                           if not eqn.effects and len(eqn.outvars) == 1 else None,
                           name, _primitives.family_of(name), tuple(v.aval for v in eqn.outvars),
                           tuple(a.aval for a in eqn.invars))
                    if trips:
                        facts[id(eqn)] = got
                looped, pid, name, family, outs, ins = got
                at = read_again if trips else read
                args = tuple(at(a, env) for a in eqn.invars)
                if looped:  # straight-line code, as JAX lowers it
                    body = eqn.params["jaxpr"]

                    def trip(inputs: list[int], body: Any = body) -> list[int]:
                        inner = dict(zip(body.jaxpr.invars, inputs))
                        for v in body.jaxpr.constvars:
                            ops.append(Op("literal", _primitives.SPECIAL, {}, (), (), (v.aval,)))
                            inner[v] = len(ops) - 1
                        run(body.jaxpr, inner, True)
                        return [read_again(a, inner) for a in body.jaxpr.outvars]

                    outs = unroll(ops, eqn.params, args, [v.aval for v in body.jaxpr.invars],
                                  [v.aval for v in eqn.outvars], trip)
                    env.update(zip(eqn.outvars, outs))
                    continue
                if pid is not None:
                    key = (pid, args)
                    if key in seen:
                        env[eqn.outvars[0]] = seen[key]
                        continue
                    seen[key] = len(ops)
                op = Op(name, family, eqn.params, args, ins, outs, key=eqn)
                if node_cost is not None and _kind_of(op) == OTHER:  # (no kind asked for without a node price)
                    op.own = float(node_cost(NodeInfo(op.prim, family, eqn.params, op.in_avals, outs)))
                ops.append(op)
                tup = len(ops) - 1
                if len(eqn.outvars) == 1:
                    env[eqn.outvars[0]] = tup
                else:
                    for i, v in enumerate(eqn.outvars):
                        ops.append(Op("proj", _primitives.SPECIAL, {"index": i}, (tup,), (), (v.aval,), key=i))
                        env[v] = len(ops) - 1

        jaxpr = closed.jaxpr
        env: dict[Any, int] = {}
        for v in list(jaxpr.constvars) + list(jaxpr.invars):
            ops.append(Op("param", _primitives.SPECIAL, {}, (), (), (v.aval,), key=v))
            env[v] = len(ops) - 1
        run(jaxpr, env)
        del run  # a recursive closure is a reference cycle: it would hold the program until a collection
        outputs = [read(a, env) for a in jaxpr.outvars]
        return cls(ops, outputs)

    @classmethod
    def from_choice(cls, ex: Any, choice: Mapping[Any, tuple], roots: Sequence[Any],
                    own: Callable[[Any, tuple], float], cache: dict | None = None,
                    inputs: frozenset | set = frozenset(),
                    partial: Callable[[Any, tuple, frozenset], float] | None = None,
                    index: dict | None = None) -> "Program":
        """The program an extractor's ``choice`` makes at ``roots`` (its own scope; bodies costed by ``own``).

        A projection of a call of one result is the call's op (:func:`one_result`), as :meth:`from_jaxpr` builds
        no projection for one output. Classes in ``inputs`` are the program's inputs: read, not computed.
        ``partial(cls, node, read)`` prices a call XLA inlines at the part of its body that the outputs the program
        reads (``read``) need: XLA drops the rest (:func:`read_outputs`). ``index``, where given, is filled with
        the op of each class the program computes or reads.
        """
        cache = {} if cache is None else cache
        index = {} if index is None else index
        ops: list[Op] = []
        snap = ex.snap
        reads = getattr(ex, "operands", None) or (lambda node: operands(snap, node))
        order = postorder_list(roots, lambda c: () if c in inputs else reads(choice[c]))
        for c in order:
            if c in inputs:
                index[c] = len(ops)
                ops.append(Op("param", _primitives.SPECIAL, {}, (), (), (ex.snap.aval(c),), key=c))
                continue
            node = choice[c]
            tup = one_result(ex, node)
            if tup is not None and tup not in inputs:
                # the value of a call of one result is the call (as from_jaxpr reads it): no view between them,
                # which the fusion model would not pass its readers' kernels through
                index[c] = index[tup]
                ops[index[c]].own += chosen_op(ex, c, node, choice, own, cache, ()).own
                continue
            index[c] = len(ops)
            ops.append(chosen_op(ex, c, node, choice, own, cache, tuple(index[k] for k in reads(node))))
        prog = cls(ops, [index[r] for r in roots])
        if partial is not None:
            for i, read in read_outputs(prog, choice).items():
                op = ops[i]
                op.own = float(partial(op.key, choice[op.key], read))
                # it writes (and the program holds) the outputs read only; its facts are its own, not the node's
                op.memo = {"bytes": sum(_nbytes(a) for k, a in enumerate(op.out_avals) if k in read)}
        return prog


def unrolled(prim: str, params: Mapping[str, Any]) -> bool:
    """Whether an op is a ``scan`` that JAX lowers to straight-line code, its body once a trip with no loop around
    it: of one trip or more, its ``unroll`` other than 1 and at least its ``length``, or 0 (``unroll=True``)."""
    if prim != "scan":
        return False
    n, u = params.get("length", 1), int(params.get("unroll", 1))
    return n >= 1 and u != 1 and (u == 0 or u >= n)


def unrolled_bodies(op: Op) -> Any:
    """The chosen bodies of an :func:`unrolled` scan, where its memo holds them (an extractor's op:
    :func:`_chosen_bodies`); else ``None``. (A jaxpr's program holds such a scan as its trips' ops.)"""
    return op.memo.get("bodies") if op.memo and unrolled(op.prim, op.params) else None


def unroll(ops: list[Op], params: Mapping[str, Any], args: Sequence[int], body_avals: Sequence[Any],
           out_avals: Sequence[Any], trip: Callable[[list[int]], list[int]]) -> list[int]:
    """The ops of an :func:`unrolled` scan of operands ``args`` (ops of ``ops``), appended as JAX's ``_scan_impl``
    writes it: at each trip, each scanned operand's row (a ``slice`` and a ``squeeze``) and the body's ops
    (``trip(inputs)``: it appends them, reading the consts, carries and rows at ``inputs``, and returns its
    outputs' ops); each stacked output a ``broadcast_in_dim`` of every trip's value and their ``concatenate``.
    Returns the ops of the scan's outputs (``out_avals``), its carries' those of the last trip. XLA then fuses and
    schedules it as any program's ops, which is how the model prices it."""
    nc, ncarry = scan_counts(params)
    length, reverse = int(params.get("length", 1)), bool(params.get("reverse", False))
    consts, carry, xs = list(args[:nc]), list(args[nc:nc + ncarry]), list(args[nc + ncarry:])
    rows = body_avals[nc + ncarry:]
    ys: list[list[int]] = []
    for t in range(length):
        i = length - 1 - t if reverse else t
        inputs = [_row(ops, x, i, row) for x, row in zip(xs, rows)]
        outs = trip(consts + carry + inputs)
        carry, y = outs[:ncarry], outs[ncarry:]
        ys.append(y)
    if reverse:
        ys.reverse()
    return carry + [_stacked(ops, [y[m] for y in ys], aval) for m, aval in enumerate(out_avals[ncarry:])]


def _row(ops: list[Op], x: int, i: int, row: Any) -> int:
    """Row ``i`` of op ``x``'s value (of type ``row``), as ``lax.index_in_dim`` reads it: a slice, squeezed."""
    whole = ops[x].out_avals[0]
    one = core.ShapedArray((1, *row.shape), row.dtype)
    ops.append(Op("slice", _primitives.family_of("slice"),
                  {"start_indices": (i,) + (0,) * len(row.shape), "limit_indices": (i + 1, *whole.shape[1:]),
                   "strides": None}, (x,), (whole,), (one,)))
    ops.append(Op("squeeze", _primitives.family_of("squeeze"), {"dimensions": (0,)}, (len(ops) - 1,), (one,), (row,)))
    return len(ops) - 1


def _stacked(ops: list[Op], values: list[int], aval: Any) -> int:
    """``values`` (each trip's) stacked along a new leading axis into an array of type ``aval``."""
    parts = []
    for v in values:
        each = ops[v].out_avals[0]
        one = core.ShapedArray((1, *each.shape), each.dtype)
        ops.append(Op("broadcast_in_dim", _primitives.family_of("broadcast_in_dim"),
                      {"shape": one.shape, "broadcast_dimensions": tuple(range(1, 1 + len(each.shape))),
                       "sharding": None}, (v,), (each,), (one,)))
        parts.append(len(ops) - 1)
    if len(parts) == 1:
        return parts[0]
    ops.append(Op("concatenate", _primitives.family_of("concatenate"), {"dimension": 0}, tuple(parts),
                  tuple(ops[p].out_avals[0] for p in parts), (aval,)))
    return len(ops) - 1


#: :func:`literal_repr`'s and :func:`aval_str`'s strings, by what they print; emptied past ``_PRINTED_MOST`` entries
_REPRS: dict[tuple, str] = {}
_AVAL_STRS: dict[Any, str] = {}
_PRINTED_MOST = 4096
#: the array types whose ``repr`` is fixed by :func:`literal_repr`'s key: numpy's, and JAX's literal arrays (which
#: print their weak type too)
_ARRAYS = (np.ndarray, literals.TypedNdArray)


def literal_repr(val: Any, options: str) -> str:
    """``repr(val)``, a literal's value, as :meth:`Program.from_jaxpr` keys equal literals by it; kept, for a small
    array of numbers, by its type, dtype, shape, weak type, bytes and numpy's print ``options`` (``repr`` of
    ``np.get_printoptions()``), which fix the string: numpy prints even a scalar slowly (about 0.15 ms), and
    programs replayed one after another read the same few constants in hundreds of equations."""
    if type(val) not in _ARRAYS or val.dtype.hasobject or val.nbytes > 64:
        return repr(val)
    return _printed(_REPRS, (type(val), val.dtype, val.shape, getattr(val, "weak_type", None), val.tobytes(), options),
                    repr, val)


def aval_str(aval: Any) -> str:
    """``str(aval)``, kept by the aval where it is a ``ShapedArray``: JAX interns those (one object for equal
    ones, whose fields fix the string)."""
    return str(aval) if type(aval) is not core.ShapedArray else _printed(_AVAL_STRS, aval, str, aval)


def _printed(table: dict, key: Any, show: Callable[[Any], str], x: Any) -> str:
    """``show(x)``, kept in ``table`` by ``key`` (the table emptied once it holds ``_PRINTED_MOST`` strings)."""
    found = table.get(key)
    if found is None:
        if len(table) >= _PRINTED_MOST:
            table.clear()
        found = table[key] = show(x)
    return found


def remembered_kernel(model: Any) -> Callable[[Program, Any, str, list], tuple[float, set]]:
    """``model.kernel`` of a program whose :attr:`Program.kernel_prices` holds the prices of the kernels of the
    programs that share its ops: a kernel's price reads those ops (its members, what they read, ``sliced_parts``,
    ``chained``, ``folded_reduction``, ``cached_reduction``), not the program's outputs, so one of the same root, kind
    and members (in order: the sums run in it) is the same float. An attention kernel, which reads the outputs
    (``attention_chain``), is priced afresh."""
    def kernel(prog: Program, r: Any, kind: str, comp: list) -> tuple[float, set]:
        if kind == ATTENTION:
            return model.kernel(prog, r, kind, comp)
        key = (id(model), r, kind, tuple(comp))
        found = prog.kernel_prices.get(key)  # type: ignore[union-attr]
        if found is None:
            found = prog.kernel_prices[key] = model.kernel(prog, r, kind, comp)  # type: ignore[index]
        return found
    return kernel


def shared_prefix(old: Program, new: Program) -> int:
    """How many ops, from the first, two programs :meth:`Program.from_choice` built from one choice with one
    ``cache`` hold alike: the same class, arguments, own price and template (its ``memo``, made once per template:
    the same one is the same primitive, params and types), or both that class's input. (A class moved from input
    to computed, or roots in another order, renumbers the ops after where the walk first meets it; those before
    are built alike.)"""
    n = 0
    for a, b in zip(old.ops, new.ops):
        if not (a.key == b.key and a.args == b.args and a.own == b.own and a.prim == b.prim
                and (a.memo is b.memo or a.prim == "param")):
            break
        n += 1
    return n


def prices_before(prices: dict, upto: int) -> dict:
    """Of :func:`remembered_kernel`'s prices (by model, root, kind and members), those of kernels whose root and
    members are all before position ``upto``: a kernel's price reads its members and the ops they read, which come
    before them (a program is in topological order), so in another program holding the same ops up to ``upto``
    (:func:`shared_prefix`) the kernel of that root, kind and members reads the same ops at the same positions,
    its sums run over the same sets in the same order, and its price is the same float."""
    return {key: found for key, found in prices.items() if max(key[1], *key[3]) < upto}


def one_result(ex: Any, node: tuple) -> Any:
    """The class a projection ``node`` reads where that class's nodes have one result (a ``custom_jvp_call`` of one
    output, as ``jax.nn.relu``), else ``None``: the program's op for the projection is then that node's, its own
    price (a loop's stacked output) added (:func:`projected_op`)."""
    return node[1][0] if node[0] == "Proj" and of_one_result(ex, node[1][0]) else None


def of_one_result(ex: Any, c: Any) -> bool:
    """Whether class ``c``'s nodes have one result, read through a projection (:func:`one_result`)."""
    aval = ex.snap.aval(c)
    return isinstance(aval, TupleType) and len(aval) == 1


def projected_op(ex: Any, c: Any, node: tuple, choice: Mapping[Any, tuple], own: Callable[[Any, tuple], float],
                 cache: dict, args: tuple) -> Op:
    """The op of class ``c``, whose ``node`` projects the one result of class ``one_result(ex, node)``'s node: that
    node's op (reading ``args``), with the projection's own price added."""
    tup = node[1][0]
    op = chosen_op(ex, tup, choice[tup], choice, own, cache, args)
    op.own += chosen_op(ex, c, node, choice, own, cache, ()).own
    return op


def read_outputs(prog: "Program", choice: Mapping[Any, tuple]) -> dict[int, frozenset]:
    """The calls XLA inlines (``OpSpec.inlined``, one body) of ``prog`` (built from ``choice``) whose outputs the
    program reads only in part: op index -> the indices of the outputs read. XLA inlines such a call's body and
    drops what no read output needs (a custom VJP's forward that returns three values, one of them read)."""
    read: dict[int, set] = {}
    for op in prog.ops:
        if op.prim == "proj" and op.args:
            read.setdefault(op.args[0], set()).add(choice[op.key][1][1])
    out = {}
    outputs = set(prog.outputs)
    for i, used in read.items():
        op = prog.ops[i]
        spec = spec_of(op.prim)
        if spec.inlined and i not in outputs and len(used) < len(op.out_avals):
            out[i] = frozenset(used)
    return out


def chosen_op(ex: Any, c: Any, node: tuple, choice: Mapping[Any, tuple], own: Callable[[Any, tuple], float],
              cache: dict, args: tuple) -> Op:
    """The op class ``c`` computes with ``node``, reading ``args``; its facts are kept in ``cache`` per node.

    The facts of a node with bodies (a loop's body programs, a call's inlined body) read the choice inside them,
    which may differ between the programs that share ``cache``: they are kept with the choices they read, and
    used again only where those are the same (a search prices the same loop in many programs).
    """
    key = (c, node)
    tmpl = cache.get(key)
    if tmpl is not None and tmpl[7] is not None and any(choice.get(x) != n for x, n in tmpl[7]):
        tmpl = None
    if tmpl is None:
        tmpl = _template(ex, c, node, choice, own, cache)
        memo = tmpl[6]
        read = None
        if "inner" in memo or "bodies" in memo:
            kids = getattr(ex, "all_kids", children)
            read = tuple((x, choice.get(x)) for x in walk(
                ex.body_classes(*node), lambda x: kids(choice[x]) if x in choice else ()))
        tmpl = cache[key] = (*tmpl, read)
    prim, family, params, in_avals, out_avals, own_cost, memo, _ = tmpl
    return Op(prim, family, params, args, in_avals, out_avals, own_cost, key=c, memo=memo)


_LEAF_CTORS = _terms.LEAVES


def _template(ex: Any, c: Any, node: tuple, choice: Mapping[Any, tuple], own: Callable[[Any, tuple], float],
              cache: dict) -> tuple:
    ctor, args = node
    if ctor in _LEAF_CTORS:
        return _LEAF_CTORS[ctor], _primitives.SPECIAL, {}, (), (ex.snap.aval(c),), 0.0, {}
    if ctor == "Proj":
        # What the node model charges a projection: a loop's stacked output is written (and,
        # with ``stacked``, held); fusion has no say in that, so it is added as it is.
        return "proj", _primitives.SPECIAL, {"index": args[1]}, (), (ex.snap.aval(c),), float(own(c, node)), {}
    keyed = getattr(ex, "keyed_info", None)  # (an extractor's)
    if keyed is not None and not ex.body_classes(ctor, args):
        # no body: nothing inlined or chosen inside, and its key, by which its node price is kept across extractions
        # (``cost/prices.py``), read with its facts
        # (and its kind, which :func:`_kind` reads off these alone: not found again for each program's first ask)
        key, info = keyed(c, ctor, args)
        kind = _kind_of(Op(info.op, info.family, info.params, (), info.in_avals, info.out_avals))
        cost = float(own(c, node)) if kind == OTHER else 0.0
        return info.op, info.family, info.params, info.in_avals, info.out_avals, cost, {NODE_KEY: key, "kind": kind}
    info = ex.info(c, ctor, args, choice)
    op = Op(info.op, info.family, info.params, (), info.in_avals, info.out_avals)
    inner = _inlined_body(ex, ctor, args, choice, own, cache) if len(info.out_avals) == 1 else None
    if inner is not None:
        return info.op, info.family, info.params, info.in_avals, info.out_avals, 0.0, {"kind": LOOP, "inner": inner}
    cost = float(own(c, node)) if _kind_of(op) == OTHER else 0.0
    bodies = _chosen_bodies(ex, ctor, args, choice, own, cache)
    # a node without bodies: its key, by which its node price is kept across extractions (``cost/prices.py``)
    node_key = getattr(ex, "node_key", None)  # (an extractor's)
    memo = ({"bodies": bodies} if bodies else {} if node_key is None or ex.body_classes(ctor, args)
            else {NODE_KEY: node_key(c, ctor, args, choice)})
    return info.op, info.family, info.params, info.in_avals, info.out_avals, cost, memo


def _chosen_bodies(ex: Any, ctor: str, args: tuple, choice: Mapping[Any, tuple],
                   own: Callable[[Any, tuple], float], cache: dict) -> tuple["Program", ...]:
    """The programs a nested node's chosen bodies make (a loop's body, a ``cond``'s branches): in the
    e-graph a body is a class of its own, not a jaxpr in the params, so the memory model
    (``rewrite/cost/memory.py``) reads a body's temporaries from these. Their ops' facts are kept in the program's
    ``cache`` (:func:`chosen_op`), made with the same ``own``: a search prices the same loop in many programs."""
    found = []
    for b in getattr(ex, "body_classes", lambda *_: [])(ctor, args):
        node = choice.get(b)
        if node is None or len(node[1]) < 2:
            return ()
        found.append(Program.from_choice(ex, choice, ex.snap.list_items(node[1][1]), own, cache))
    return tuple(found)


def _inlined_body(ex: Any, ctor: str, args: tuple, choice: Mapping[Any, tuple],
                  own: Callable[[Any, tuple], float], cache: dict) -> tuple["Op", ...] | None:
    """The chosen body of a call XLA inlines (``OpSpec.inlined``), when every operation in it is elementwise.

    Such a call fuses like one elementwise operation (its price: its body's), not as a kernel boundary.
    """
    spec = _primitives.BY_CTOR.get(ctor)
    if spec is None or not spec.inlined:
        return None
    bodies = ex.body_classes(ctor, args)
    if len(bodies) != 1:
        return None
    outs = ex.snap.list_items(choice[bodies[0]][1][1])
    if len(outs) != 1:
        return None
    body = Program.from_choice(ex, choice, outs, own, cache)
    if not all(_kind(op) in (LEAF, LOOP) for op in body.ops):
        return None
    return tuple(op for op in body.ops if _kind(op) == LOOP)


def _size(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    return 0 if shape is None else int(math.prod(shape))


def _nbytes(aval: Any) -> int:
    dtype = getattr(aval, "dtype", None)
    return 0 if dtype is None else _size(aval) * int(getattr(dtype, "itemsize", 0))


def kernel_members(homes: Mapping[int, Any], roots: Mapping[int, str]) -> dict[int, list[int]]:
    """Each kernel root's members in program order, from a fusion's ``homes`` (op -> the roots it is fused into) and
    ``roots`` (``FusionModel.fuse``'s pair): what a kernel is made of, priced or not."""
    members: dict[int, list[int]] = {r: [] for r in roots}
    for i, hs in homes.items():
        for r in hs:
            if r in members:
                members[r].append(i)
    return members


def ops_in(prog: Program, kernels: Iterable[Any]) -> dict[str, int]:
    """How many times each primitive is evaluated across kernels (``cost/fusion.py``'s ``Fusion``s; duplicates
    counted)."""
    counts: dict[str, int] = {}
    for k in kernels:
        for i in k.computes:
            p = prog.ops[i].prim
            counts[p] = counts.get(p, 0) + 1
    return counts


def elementwise_call(op: Op) -> bool:
    """A call XLA inlines whose body is elementwise only: it fuses like one elementwise operation."""
    if len(op.out_avals) != 1 or not (op.family == _primitives.OPAQUE or spec_of(op.prim).inlined):
        return False
    j = inner_jaxpr(op.params)
    if j is None:
        return False
    return all(_elementwise_eqn(e) for e in j.eqns)


def _elementwise_eqn(e: Any) -> bool:
    spec = _primitives.BY_PRIM.get(e.primitive.name)
    if spec is not None and not spec.inlined:
        return spec.fusion == "loop"
    j = inner_jaxpr(e.params)
    return j is not None and len(e.outvars) == 1 and all(_elementwise_eqn(x) for x in j.eqns)


def _kind_of(op: Op) -> str:
    if op.prim in ("param", "literal", "const", "token"):
        return LEAF
    if op.prim == "proj":
        return VIEW
    if op.prim == "dynamic_update_slice":  # XLA:CPU writes it in place over its operand (memory.py's _shares)
        return OTHER
    spec = spec_of(op.prim)
    if spec.fusion == "loop" or elementwise_call(op):
        return LOOP
    if op.family == _primitives.REDUCE:
        return LIBRARY if library_reduction(op.prim, op.in_avals) else REDUCE
    return OTHER


def fused_update(op: Op, need: Any, output: bool, roots: Mapping[Any, str]) -> bool:
    """Whether XLA:CPU fuses ``op``, a ``dynamic_update_slice`` that ``need`` (the kernels that read it: their roots,
    kinds in ``roots``) reads, into its one reader, a loop kernel: the loop emitter computes each element of the
    update chain where the loop asks for it, so the chain's operands (each block's update: its array) are read,
    and live, until that loop runs. Seed 000's kernel (``rulesets/kernels/sin_squared.py``) writes ``grad x`` as 32
    blocks' updates of a zero array; a step that reads it in ``x - 0.01 * grad x`` got one loop reading all 32
    blocks' slot arrays (``multiply_subtract_fusion``): 192 MiB of temp at T=8192, predicted 8 as 32 in-place
    updates. Where it is an output or read by another kind of kernel it is a kernel of its own, written in place
    over its operand (``memory.py``'s ``_shares``)."""
    return (op.prim == "dynamic_update_slice" and not output and len(need) == 1
            and roots.get(next(iter(need))) == LOOP)


def library_reduction(prim: str, in_avals: Sequence[Any]) -> bool:
    """Whether XLA:CPU runs a reduction ``prim`` of operands ``in_avals`` as a library (YNN) reduction: a floating
    ``reduce_sum``/``reduce_max``/``reduce_min`` of ``LIBRARY_MIN_ELEMENTS`` elements or more."""
    return bool(spec_of(prim).library_reduction and in_avals and _is_float(in_avals[0])
                and _size(in_avals[0]) >= LIBRARY_MIN_ELEMENTS)


def bitcast(op: Op) -> bool:
    """Whether XLA makes a bitcast of ``op``: a reshape that keeps row-major order (``reshape`` without
    ``dimensions``, ``squeeze``, a ``broadcast_in_dim`` that only adds axes of size 1). On the default layouts
    XLA:CPU keeps, such a result is its operand's bytes read another way: no kernel computes it and it has no
    buffer of its own (``jax.jit(f).lower(x).compile().as_text()`` shows ``bitcast``). Kept in the op's memo."""
    memo = op.memo
    if memo is not None and "bitcast" in memo:
        return memo["bitcast"]
    found = False
    if op.prim in ("reshape", "squeeze", "broadcast_in_dim") and len(op.in_avals) >= 1 and len(op.out_avals) == 1:
        src, out = op.in_avals[0], op.out_avals[0]
        found = (getattr(src, "dtype", None) == getattr(out, "dtype", None) and _size(src) == _size(out)
                 and hasattr(src, "shape") and hasattr(out, "shape")
                 and (op.prim != "reshape" or op.params.get("dimensions") is None))
    if memo is not None:
        memo["bitcast"] = found
    return found


def _kind(op: Op) -> str:
    """``_kind_of(op)``, remembered in the op's memo when it has one."""
    memo = op.memo
    if memo is None:
        return _kind_of(op)
    found = memo.get("kind")
    if found is None:
        found = memo["kind"] = _kind_of(op)
    return found


def sliced_parts(prog: Any, inside: Any, root: Any, slicing: Any) -> dict[Any, float]:
    """The members of the loop kernel ``inside`` (rooted at ``root``) that it computes only where slices in it read
    them, each with the part of its elements computed: XLA's loop emitter computes a fused elementwise producer at
    the indices its readers ask for, so a kernel that slices ``1 * ct`` computes that slice's products and reads
    that slice of ``ct``. ``slicing(op, i)``: whether ``op`` reads ``i`` only as the operand it slices. (Seed
    000's kernel slices its cotangent into 32 blocks, each priced the whole product before: the joint of a
    ``value_and_grad`` step 8.18e7 against JAX's 5.50e7 at T=2048, measured 1.12x faster.) Empty, at once, where no
    member slices."""
    if not any(prog.ops[i].prim in SLICES for i in inside):
        return {}
    readers: dict[Any, list] = {}
    for i in inside:
        for a in set(prog.ops[i].args):
            if a in inside:
                readers.setdefault(a, []).append(i)
    part: dict[Any, float] = {}

    def of(i: Any) -> float:  # the part of member i's elements its readers in the kernel ask for
        if i not in part:
            op = prog.ops[i]
            part[i] = 1.0
            if i != root and i in readers and _kind(op) == LOOP and len(op.out_avals) == 1:
                shape, got = op.out_avals[0].shape, 0.0
                for u in readers[i]:
                    reader = prog.ops[u]
                    if slicing(reader, i):
                        got += _size(reader.out_avals[0]) / max(_size(op.out_avals[0]), 1)
                    elif reader.out_avals and reader.out_avals[0].shape == shape and of(u) < 1.0:
                        got += of(u)
                    else:
                        got = 1.0
                        break
                part[i] = min(got, 1.0)
        return part[i]

    try:
        return {i: f for i in inside if (f := of(i)) < 1.0}
    finally:
        del of  # a recursive closure is a reference cycle: it would hold the program until a collection
