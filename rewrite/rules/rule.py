"""Rules: the Python DSL (rulesets, which collect them, are in ``ruleset.py``).

A rule is two JAX functions of the same pattern variables::

    rule(lambda x: 2 * jnp.sin(x) * jnp.cos(x), lambda x: jnp.sin(2 * x), name="double_angle")

The left-hand side is traced once per probe shape when the rule is defined (that is when a malformed rule
fails, with an error naming it) and compiled into egglog queries. At rewrite time both sides are traced again at
the matched classes' real shapes and dtypes: the left side to verify the match, the right side to build the
replacement, so axes and shapes in the right side adapt to whatever was matched.

A rule whose left side a JAX function cannot spell (any axes, a group of primitives, a scan's body) writes it as
a :class:`Pat`. Its right side is then a function of the pattern's named bindings, traced at the matched shapes::

    rule(Pat("reduce_sum", Pat("neg", X), params="p"), lambda x, p: -p.bind(x), name="sum_neg")

or, when it needs the e-graph itself (users of a class, a loop body), a
:func:`procedural` function of the whole :class:`Match`.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from ..ir import primitives as _primitives
from ..ir.intern import PARAMS
from ..ir.jaxapi import core
from ..ir.primitives import GROUPS
from ..jaxpr.trace import _mesh_of, trace_at
from .builder import standard_numpy
from .match import Params, Value, _short
from .pattern import (CONVERTED, Pat, PatternError, Query, anchored_queries, commuted, compile_pats,
                      compile_traced, generalize)


#: Pattern variables are traced at these shapes (float32) when no example is given.
PROBE_SHAPES: tuple[tuple[int, ...], ...] = ((), (3,), (3, 3), (3, 3, 3))


class Procedure:
    """A right-hand side written as Python code over the match. See :func:`procedural`."""

    def __init__(self, fn: Callable[["Match"], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"procedural() takes a function, got {type(fn).__name__}")
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "procedure")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, m: "Match") -> Any:
        return self.fn(m)


def procedural(fn: Callable[["Match"], Any]) -> Procedure:
    """Mark a right-hand side as a procedure of the :class:`Match` rather than a JAX function.

    The procedure returns a :class:`Term` to put in the matched class, or
    ``None`` to decline this match. It builds terms with :meth:`Match.trace`.

    >>> import jax.numpy as jnp
    >>> from rewrite import rule, procedural
    >>> @procedural
    ... def halve_if_even(m):
    ...     x = m["x"]
    ...     return m.trace(lambda v: v * 0.5, x) if x.shape and x.shape[-1] % 2 == 0 else None
    >>> r = rule(lambda x: x / 2.0, halve_if_even, name="div2")
    """
    return Procedure(fn)


class _Declined(Exception):
    """A function right-hand side returned ``None``."""


def _named_call(fn: Callable[..., Any], layout: tuple[tuple[str, str, Any], ...]) -> Callable[..., Any]:
    """``fn`` as a function of the traced inputs, its static bindings rebuilt from ``layout``.

    The closure holds plain data only (names, params ids, counts), so that
    the engine can reuse the trace of the same replacement met again.
    """
    def call(*xs: Any) -> Any:
        it = iter(xs)
        kw: dict[str, Any] = {}
        for name, kind, data in layout:
            if kind == "term":
                kw[name] = next(it)
            elif kind == "list":
                kw[name] = [next(it) for _ in range(data)]
            elif kind == "params":
                kw[name] = None if data < 0 else Params(PARAMS.prim(data), PARAMS.params(data))
            else:
                kw[name] = data
        out = fn(**kw)
        if out is None:
            raise _Declined
        return out

    return call


class _Bindings:
    """How a :class:`Pat` rule's named bindings are handed to a right side or guard that names them."""

    def __init__(self, rule_name: str, pat: Pat, names: list[str], sorts: dict[str, str], side: str,
                 fn: Callable[..., Any]) -> None:
        params = pat.param_names()
        self.kinds = {n: ("params" if n in params else "index") if sorts[n] == "i64" else
                      {"Term": "term", "TList": "list"}.get(sorts[n], "body") for n in names}
        try:
            wanted = [p.name for p in inspect.signature(fn).parameters.values()]
        except (TypeError, ValueError):
            raise ValueError(f"rule {rule_name!r}: cannot read the signature of {side}") from None
        unknown = [n for n in wanted if n not in self.kinds]
        if unknown:
            raise ValueError(f"rule {rule_name!r}: {side} takes {unknown[0]!r}, which the pattern does not bind "
                             f"(it binds {sorted(self.kinds)})")
        bodies = [n for n in wanted if self.kinds[n] == "body"]
        if bodies:
            raise ValueError(f"rule {rule_name!r}: {side} takes the body {bodies[0]!r}; a rule that reads "
                             "bodies is procedural (rewrite.procedural)")
        self.wanted = wanted
        self.params = [n for n in names if self.kinds[n] == "params"]

    def sharded(self, m: "Match") -> bool:
        return any(p is not None and p.sharded for p in map(m.params, self.params))

    def values(self, m: "Match") -> dict[str, Any]:
        """The bindings as a guard sees them: values, lists of values, params, indices."""
        out: dict[str, Any] = {}
        for n in self.wanted:
            kind = self.kinds[n]
            out[n] = (m[n] if kind == "term" else m.list(n) if kind == "list" else m.params(n) if kind == "params"
                      else m.int(n))
        return out


class _Function(Procedure):
    """A :class:`Pat` rule's right side written as a function of the pattern's named bindings.

    Term bindings arrive as traced arrays, list bindings as lists of them,
    ``params=`` bindings as :class:`Params` and projection indices as ints.
    It returns the replacement, or ``None`` to decline. A match whose bound
    params carry an explicit sharding is declined: the replacement, traced
    by JAX, would drop it.
    """

    def __init__(self, fn: Callable[..., Any], bindings: _Bindings) -> None:
        super().__init__(fn)
        self.bindings = bindings

    def __call__(self, m: "Match") -> Any:
        b = self.bindings
        if b.sharded(m):
            return None
        layout, inputs = [], []
        for n in b.wanted:
            kind = b.kinds[n]
            if kind == "term":
                inputs.append(m[n])
                layout.append((n, kind, None))
            elif kind == "list":
                items = m.list(n)
                inputs.extend(items)
                layout.append((n, kind, len(items)))
            else:
                layout.append((n, kind, m._bound(n) if kind == "params" else m.int(n)))
        try:
            return m.trace(_named_call(self.fn, tuple(layout)), *inputs)
        except _Declined:
            return None


class _NamedGuard:
    """A :class:`Pat` rule's ``when=`` that names the bindings it reads, as its right side does."""

    def __init__(self, fn: Callable[..., bool], bindings: _Bindings) -> None:
        self.fn = fn
        self.bindings = bindings

    def __call__(self, m: "Match") -> bool:
        return bool(self.fn(**self.bindings.values(m)))


#: How many avals' traces of its two sides a rule keeps (:meth:`Rule.traced`). Rules live as long as the process, and
#: each new input shape adds one: an elementwise rule's come from its one-shape traces, so these are the others'.
TRACED_KEEP = 256


class Rule:
    """One named rewrite. Build it with :func:`rule`.

    ``var_names`` are the pattern variables, ``queries`` the compiled egglog
    queries, ``probes`` the avals the sides were traced at when it was defined;
    :meth:`traced` gives both sides at any avals.

    >>> import jax.numpy as jnp
    >>> from jax.core import ShapedArray
    >>> from rewrite import rule
    >>> r = rule(lambda x: jnp.log(1.0 + x), lambda x: jnp.log1p(x), name="log1p")
    >>> r.var_names, len(r.queries), [p[0].shape for p in r.probes]
    (['x'], 1, [(), (3,), (3, 3), (3, 3, 3)])
    >>> lhs, rhs = r.traced((ShapedArray((5,), jnp.float32),))
    >>> [e.primitive.name for e in lhs.eqns], [e.primitive.name for e in rhs.eqns]
    (['add', 'log'], ['log1p'])
    """
    FINGERPRINT_SKIPS = frozenset("_traced _elementwise defined_at queries manual_queries anchor_literals".split())

    def __init__(self, name: str, lhs: Any, rhs: Any, when: Callable[..., bool] | None,
                 example: tuple[Any, ...] | None, var_names: list[str], queries: list[Query],
                 probes: list[tuple[Any, ...]], manual_queries: list[Query] | None = None,
                 program: tuple[Callable[..., Any], tuple[Any, ...]] | None = None) -> None:
        self.name = name
        self.lhs = lhs
        self.rhs = rhs
        self.when = when
        #: For a rule of two functions, the avals given with ``example_inputs=`` (else ``None``)
        self.example = example
        self.var_names = var_names
        self.queries = queries
        self.manual_queries = manual_queries or []  # extra variants for shard_map bodies
        self.probes = probes
        #: For a :class:`Pat` rule, ``(fn, avals)``: a program the rule applies in, given with
        #: ``example_program=``, on which :func:`rewrite.testing.check_ruleset` exercises the rule.
        self.program = program
        #: (file, line) of the code that defined this rule, where known (rewrite.define.rule records it)
        self.defined_at: tuple[str, int] | None = None
        #: pattern variable -> a function mapping a drawn input into the rule's domain, for property checks
        self.check_inputs: dict[str, Callable[[Any], Any]] = {}
        #: The replacement is preferred whatever it costs: the matched form is barred where it fired.
        self.prefer = False
        #: ``anchor=``'s primitive, which the queries match around (``pattern.anchored``), and the literal ids they hold
        self.anchor: str | None = None
        self.anchor_literals: frozenset[int] = frozenset()
        #: both sides traced per avals, the :data:`TRACED_KEEP` used last (a new input shape adds some), and
        #: elementwise sides traced at one shape, by the inputs' dtypes (see :meth:`traced`); neither is pickled
        self._traced: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._elementwise: dict[tuple, tuple] = {}

    def __getstate__(self) -> dict:  # this process's traces (JAX's programs, with their tracebacks) stay here
        return {**self.__dict__, "_traced": collections.OrderedDict(), "_elementwise": {}}

    @property
    def is_pat(self) -> bool:
        return isinstance(self.lhs, Pat)

    @property
    def is_procedural(self) -> bool:
        return isinstance(self.rhs, Procedure)

    def traced(self, avals: tuple[Any, ...]) -> tuple[core.ClosedJaxpr, core.ClosedJaxpr | None]:
        """Both sides traced at these avals (cached). Raises if either side cannot be traced there.

        Where every input has one shape, and both sides traced at another shape with the same dtypes were
        elementwise there (every value of that shape or a scalar literal, every equation elementwise), the sides
        are those programs at this shape (:func:`_retyped`) instead of new traces: an elementwise program computes
        the same scalar function at every position, so two that agree at one shape agree at all.
        """
        found = self._traced.get(avals)
        if found is not None:
            try:
                self._traced.move_to_end(avals)
            except KeyError:  # another thread's rewrite let it go meanwhile
                pass
        else:
            shape = _one_shape(avals)
            dtypes = tuple((a.dtype, bool(a.weak_type)) for a in avals) if shape is not None else None
            seen = self._elementwise.get(dtypes) if dtypes is not None else None
            if seen is not None:
                found = tuple(None if side is None else _retyped(side, avals, shape) for side in seen)
            else:
                try:
                    lhs = trace_at(self.lhs, avals)  # as the user's program was, under the user's settings
                    with standard_numpy():  # the replacement is the rule's code (rewrite.rules.builder)
                        found = (lhs, None if self.is_procedural else trace_at(self.rhs, avals))
                except Exception as e:  # a rule need not apply at every shape
                    found = e.with_traceback(None)  # its frames would keep the failed trace's values alive
                else:
                    if dtypes is not None and all(side is None or _elementwise_at(side, shape) for side in found):
                        self._elementwise[dtypes] = found
            self._traced[avals] = found
            if len(self._traced) > TRACED_KEEP:
                self._traced.popitem(last=False)
        if isinstance(found, Exception):
            raise found
        return found

    @functools.cached_property
    def symmetries(self) -> tuple[tuple[int, ...], ...]:
        """Permutations of the pattern variables that leave both sides the same (up to the order of the
        operands of ``add`` and ``mul``): a match with its bindings so permuted builds the same program.

        Patterns match sums and products in either operand order, so ``exp(x) * exp(y) -> exp(x + y)``
        matches every product of exponentials twice, as ``(a, b)`` and ``(b, a)``; the engine acts on one
        of each such pair. Only traced rules without a guard whose queries match in several operand
        orders have any: a procedure's or a guard's symmetry is not known, a query in one order finds no
        mirrored pairs, and an anchored rule's match may wait for the rest of its left side. Checked at
        the shapes the rule was defined at, where the permuted variables agree; computed once per rule.

        >>> import jax.numpy as jnp
        >>> from rewrite import rule
        >>> rule(lambda x, y: jnp.exp(x) * jnp.exp(y), lambda x, y: jnp.exp(x + y), name="e").symmetries
        ((1, 0),)
        >>> rule(lambda x, y: jnp.exp(x) * y, lambda x, y: y * jnp.exp(x), name="d").symmetries
        ()
        """
        n = len(self.var_names)
        if (self.is_pat or self.is_procedural or self.when is not None or self.anchor or not 2 <= n <= 4
                or not any(len(commuted(q)) > 1 for q in self.queries)):
            return ()
        found = []
        for perm in itertools.permutations(range(n)):
            if perm == tuple(range(n)):
                continue
            checked = False
            ok = True
            for avals in self.probes:
                if any(avals[i] != avals[perm[i]] for i in range(n)):
                    continue
                try:
                    sides = self.traced(tuple(avals))
                except Exception:
                    continue
                checked = True
                if any(_canonical(side, range(n)) != _canonical(side, perm) for side in sides):
                    ok = False
                    break
            if checked and ok:
                found.append(perm)
        return tuple(found)

    def __repr__(self) -> str:
        return f"<rule {self.name!r}>"


def _one_shape(avals: Sequence[Any]) -> tuple[int, ...] | None:
    """The shape every aval has, if they share one and carry no sharding or varying axes (else ``None``)."""
    if not avals:
        return None
    shape = avals[0].shape
    for a in avals:
        if type(a) is not core.ShapedArray or a.shape != shape or getattr(a, "vma", None) or _mesh_of(a) is not None:
            return None
    return tuple(shape)


def _elementwise_at(closed: core.ClosedJaxpr, shape: tuple[int, ...]) -> bool:
    """Whether ``closed`` computes elementwise at ``shape``: no constants or effects, every equation an
    elementwise primitive without sub-programs, every value of ``shape`` except scalar literals read by
    equations (an input or output is never a literal). Never at shape ``()``."""
    jaxpr = closed.jaxpr
    if closed.consts or jaxpr.constvars or jaxpr.effects or shape == ():
        return False  # (at shape (), an equation of literals alone would look elementwise)

    def ok(v: Any) -> bool:
        if isinstance(v, core.Literal):
            return tuple(getattr(v.aval, "shape", (None,))) == ()
        aval = v.aval
        return type(aval) is core.ShapedArray and tuple(aval.shape) == shape

    if not all(ok(v) and not isinstance(v, core.Literal) for v in (*jaxpr.invars, *jaxpr.outvars)):
        return False
    for eqn in jaxpr.eqns:
        spec = _primitives.BY_PRIM.get(eqn.primitive.name)
        if spec is None or spec.family not in (_primitives.ELEMENTWISE, _primitives.TRANSCENDENTAL):
            return False
        if next(iter(core.jaxprs_in_params(eqn.params)), None) is not None or eqn.effects:
            return False
        if not all(map(ok, eqn.invars)) or not all(ok(v) for v in eqn.outvars if not isinstance(v, core.DropVar)):
            return False
    return True


def _retyped(closed: core.ClosedJaxpr, avals: Sequence[Any], shape: tuple[int, ...]) -> core.ClosedJaxpr:
    """An elementwise program (:func:`_elementwise_at`) at ``shape``, taking inputs of these avals."""
    jaxpr = closed.jaxpr
    new: dict[Any, Any] = {v: core.Var(a) for v, a in zip(jaxpr.invars, avals)}

    def var(v: Any) -> Any:
        if isinstance(v, core.Literal):
            return v
        found = new.get(v)
        if found is None:
            aval = core.ShapedArray(shape, v.aval.dtype, weak_type=v.aval.weak_type)
            found = new[v] = core.DropVar(aval) if isinstance(v, core.DropVar) else core.Var(aval)
        return found

    eqns = [eqn.replace(invars=[var(v) for v in eqn.invars], outvars=[var(v) for v in eqn.outvars])
            for eqn in jaxpr.eqns]
    return core.ClosedJaxpr(jaxpr.replace(invars=[new[v] for v in jaxpr.invars],
                                          outvars=[var(v) for v in jaxpr.outvars], eqns=eqns), [])


def _canonical(closed: core.ClosedJaxpr, labels: Sequence[int]) -> tuple:
    """The outputs of ``closed`` as terms over inputs named by ``labels``, with the operands of commutative
    operations sorted: equal for two labellings exactly when they compute the same (see ``Rule.symmetries``)."""
    commutative = GROUPS.get("commutative", frozenset())
    env: dict[Any, str] = {v: f"x{labels[i]}" for i, v in enumerate(closed.jaxpr.invars)}
    env.update({v: f"c{i}" for i, v in enumerate(closed.jaxpr.constvars)})

    def read(a: Any) -> str:
        return env[a] if isinstance(a, core.Var) else f"{a.val!r}:{a.aval}"

    for e in closed.jaxpr.eqns:
        args = [read(a) for a in e.invars]
        if e.primitive.name in commutative and len(args) == 2:
            args.sort()
        term = f"{e.primitive.name}{sorted((k, repr(v)) for k, v in e.params.items())}({','.join(args)})"
        for k, o in enumerate(e.outvars):
            env[o] = f"{term}#{k}"
    return tuple(read(o) for o in closed.jaxpr.outvars)


def build_rule(lhs: Any, rhs: Any, *, name: str, when: Callable[..., bool] | None = None,
         example_inputs: Any = None, example_program: Any = None, prefer: bool = False,
         example: Any = None, anchor: str | None = None) -> Rule:
    """Define a rewrite ``lhs -> rhs``.

    ``lhs`` and ``rhs`` are functions of the pattern variables, written with
    ``jax.numpy`` and ``lax``. A pattern variable matches any tensor unless
    ``when`` rejects it. Literal constants match equal constants of any dtype.

    ``when`` is a predicate over the matched variables, called with one
    :class:`Value` per pattern variable in order. It can read shapes and
    dtypes and the facts the e-graph knows (``x.nonneg``, ``x.positive``,
    ``x.nonzero``).

    ``example_inputs`` gives the shapes and dtypes to trace the sides at (a
    tuple with one array or ``jax.ShapeDtypeStruct`` per pattern variable, or
    one for all). Without it the sides are traced at float32 scalars, vectors,
    matrices and rank-3 arrays, and the rule must hold at every one of them
    that it traces at.

    A :class:`Pat` left-hand side has no function to trace; its
    ``example_program`` is a pair ``(fn, args)``: a program in which the rule
    applies and its arguments (arrays or ``jax.ShapeDtypeStruct``, one per
    argument of ``fn``). It is traced once, to fail early, and kept as
    ``rule.program`` for :func:`rewrite.testing.check_ruleset`, which rewrites
    that program with the rule alone and compares it with the original on
    drawn inputs. Each of the two is an error on the other kind of rule.

    ``example`` is the old spelling of both (the inputs for a rule of two
    functions, the program for a :class:`Pat` rule): it still works, with a
    ``DeprecationWarning``.

    >>> import jax.numpy as jnp
    >>> from rewrite import rule
    >>> r = rule(lambda x: 2 * jnp.sin(x) * jnp.cos(x), lambda x: jnp.sin(2 * x), name="double_angle")
    >>> r.name, r.var_names
    ('double_angle', ['x'])
    >>> rule(lambda x: x.sum(0), lambda x: x, name="bad")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: rule 'bad': rhs gives f32[3], lhs gives f32[]...

    A procedural rule over a :class:`Pat`, with an example program:

    >>> import jax
    >>> from rewrite import Pat, procedural
    >>> @procedural
    ... def sum_of_neg(m):
    ...     return m.trace(lambda x: -jnp.sum(x, axis=tuple(m.params("r")["axes"])), m["x"])
    >>> r = rule(Pat("reduce_sum", Pat("neg", Pat.var("x")), params="r"), sum_of_neg, name="sum_of_neg",
    ...          example_program=(lambda x: jnp.sum(-x, axis=0), (jax.ShapeDtypeStruct((3, 4), jnp.float32),)))
    >>> r.program[1]
    (ShapedArray(float32[3,4]),)

    ``prefer=True`` says the right side is the better program whatever it
    costs (say, more accurate: ``log(1 + x) -> log1p(x)``): where the rule's
    replacement is built and joined to the match, extraction may no longer
    take the matched form in that class (see :mod:`rewrite.rules.prefer`).

    >>> rule(lambda x: jnp.log(1.0 + x), lambda x: jnp.log1p(x), name="log1p", prefer=True).prefer
    True

    ``anchor="tanh"`` (a rule of two functions) names a primitive of the left
    side that programs hold rarely. The rule's query is then the smallest part
    of the left side that holds one and binds every variable, and each match of
    it looks the whole left side up at its bindings: the same matches, by a
    small join where a large left side (a VJP) is a large one. The query is
    declared only where the program holds the primitive and the part's literals.

    >>> [len(q.atoms) for q in rule(lambda x, y: jnp.tanh(x) * y + y, lambda x, y: (jnp.tanh(x) + 1.0) * y,
    ...                                 name="tanh_y", anchor="tanh").queries]  # tanh(x) * y: 2 of 3 nodes
    [2]
    """
    example = _one_example(name, isinstance(lhs, Pat), example_inputs, example_program, example)
    r = _rule(lhs, rhs, name=name, when=when, example=example, anchor=anchor)
    r.prefer = bool(prefer)
    return r


#: Said where ``example=`` is given; the stack level points at the caller of :func:`rewrite.rule`.
DEPRECATED_EXAMPLE = ("rule {name!r}: example= is deprecated; it meant two things: give example_inputs= (the "
                      "pattern variables' shapes and dtypes) for a rule of two functions, example_program=(fn, args) "
                      "for a Pat rule")


def _one_example(name: Any, is_pat: bool, inputs: Any, program: Any, old: Any, stacklevel: int = 3) -> Any:
    """The one example a rule takes: ``example_inputs`` for a rule of two functions, ``example_program`` for
    a :class:`Pat` rule, or the deprecated ``example`` for either."""
    if old is not None:
        warnings.warn(DEPRECATED_EXAMPLE.format(name=name), DeprecationWarning, stacklevel=stacklevel)
        if inputs is not None or program is not None:
            raise ValueError(f"rule {name!r}: give example_inputs= or example_program=, not also example=")
        return old
    if is_pat and inputs is not None:
        raise ValueError(f"rule {name!r}: a Pat rule has no function to trace at example_inputs=; give "
                         "example_program=(fn, args), a program it applies in")
    if not is_pat and program is not None:
        raise ValueError(f"rule {name!r}: example_program= is for a Pat rule; a rule of two functions takes "
                         "example_inputs=, the shapes and dtypes to trace its sides at")
    return program if is_pat else inputs


def _rule(lhs: Any, rhs: Any, *, name: str, when: Callable[..., bool] | None, example: Any,
          anchor: str | None = None) -> Rule:
    if not isinstance(name, str) or not name.strip():
        raise ValueError("rule(): name= must be a non-empty string")
    if anchor is not None and (isinstance(lhs, Pat) or anchor not in _primitives.BY_PRIM):
        raise ValueError(f"rule {name!r}: anchor= names a primitive of a left side written as a function")
    if when is not None and not callable(when):
        raise ValueError(f"rule {name!r}: when= must be a callable, got {type(when).__name__}")
    if isinstance(lhs, Pat):
        if not callable(rhs):
            raise ValueError(f"rule {name!r}: a Pat left-hand side needs a right-hand side that is a function of "
                             f"its bindings, or procedural (got {type(rhs).__name__})")
        try:
            queries, names = compile_pats(lhs)
        except PatternError as e:
            raise ValueError(f"rule {name!r}: {e}") from None
        if not isinstance(rhs, Procedure):
            sorts = dict(zip(names, (s for _, s in queries[0].binds)))
            bindings = _Bindings(name, lhs, names, sorts, "rhs", rhs)
            rhs = _Function(rhs, bindings)
            if when is not None:
                when = _NamedGuard(when, _Bindings(name, lhs, names, sorts, "when", when))
        program = _example_program(name, example) if example is not None else None
        return Rule(name, lhs, rhs, when, None, names, queries, [], program=program)
    if not callable(lhs):
        raise ValueError(f"rule {name!r}: lhs is not callable (got {type(lhs).__name__})")
    if not isinstance(rhs, Procedure) and not callable(rhs):
        raise ValueError(f"rule {name!r}: rhs is not callable (got {type(rhs).__name__})")
    names = _positional_names(name, "lhs", lhs)
    if not isinstance(rhs, Procedure):
        rhs_names = _positional_names(name, "rhs", rhs)
        if len(rhs_names) != len(names):
            raise ValueError(f"rule {name!r}: lhs takes {len(names)} pattern variables {names}, "
                             f"rhs takes {len(rhs_names)} {rhs_names}")
    probes = _probes(name, names, example)
    queries: list[Query] = []
    manual: list[Query] = []
    seen: set[str] = set()
    traced_at: list[tuple[Any, ...]] = []
    first_error: Exception | None = None
    guard_error: tuple[Exception, tuple[Any, ...]] | None = None
    for avals in probes:
        if when is not None:
            try:
                if not _guard_allows(when, avals):
                    continue
            except Exception as e:
                if example is not None:  # the shapes the rule is for: a guard must answer there
                    raise ValueError(f"rule {name!r}: its guard (when=) raised {type(e).__name__}: {e} at the "
                                     f"example's inputs ({', '.join(_short(a) for a in avals)})") from e
                guard_error = guard_error or (e, avals)
                continue
        try:
            lhs_closed = trace_at(lhs, avals)
        except Exception as e:
            first_error = first_error or e
            continue
        if len(lhs_closed.out_avals) != 1:
            raise ValueError(f"rule {name!r}: lhs must return one array, it returns {len(lhs_closed.out_avals)}")
        if not isinstance(rhs, Procedure):
            try:
                rhs_closed = trace_at(rhs, avals)
            except Exception as e:
                raise ValueError(f"rule {name!r}: rhs cannot be traced at "
                                 f"({', '.join(_short(a) for a in avals)}): {e}") from None
            if len(rhs_closed.out_avals) != 1:
                raise ValueError(f"rule {name!r}: rhs must return one array, it returns {len(rhs_closed.out_avals)}")
            l, r = lhs_closed.out_avals[0], rhs_closed.out_avals[0]
            if (l.shape, l.dtype, l.weak_type) != (r.shape, r.dtype, r.weak_type):
                raise ValueError(f"rule {name!r}: rhs gives {_short(r)}, lhs gives {_short(l)} "
                                 f"for inputs ({', '.join(_short(a) for a in avals)})")
        try:
            query = compile_traced(lhs_closed, names)
        except PatternError as e:
            raise ValueError(f"rule {name!r}: {e}") from None
        traced_at.append(avals)
        # the variants for a shard_map body: each literal cast by pvary, or cast and then converted
        pvary = [compile_traced(lhs_closed, names, pvary_literals=v) for v in (True, CONVERTED)] \
            if "(Lit " in query.text else []
        if pvary or "(Opaque " in query.text:
            # A literal that changes with the shapes (a mean's divisor), or the params of an opaque
            # operation that carry shapes (lu's and custom_linear_solve's nested programs), match any
            # value; the verifier retraces the left side at the matched shapes, so the query may be loose.
            longer, other = _stretched(lhs, avals)
            loose = generalize(query, compile_traced(other, names)) if other is not None else None
            if loose is not None:
                query = loose
                pvary = [generalize(q, compile_traced(other, names, pvary_literals=v)) or q
                         for q, v in zip(pvary, (True, CONVERTED))]
                if longer not in traced_at:
                    traced_at.append(longer)  # so that checks see the literal at another size
        if query.text not in seen:
            seen.add(query.text)
            queries.append(query)
            manual.extend(pvary)
    if not queries:
        if guard_error is not None:
            e, avals = guard_error
            raise ValueError(f"rule {name!r}: its guard (when=) raised {type(e).__name__}: {e} at "
                             f"({', '.join(_short(a) for a in avals)}), and no probe shape let the rule "
                             "through; fix the guard, or give example_inputs= where it answers") from e
        why = f": {first_error}" if first_error else ""
        raise ValueError(f"rule {name!r}: lhs cannot be traced at any probe shape{why}; give example_inputs=")
    ex = tuple(probes[0]) if example is not None else None
    parts = anchored_queries(queries + manual, _primitives.BY_PRIM[anchor].ctor) if anchor is not None else None
    if anchor is not None and parts is None:
        raise ValueError(f"rule {name!r}: anchor={anchor!r}: no part of the left side holds a {anchor} and "
                         f"binds every pattern variable {names}")
    r = Rule(name, lhs, rhs, when, ex, names, *((queries, traced_at, manual) if parts is None else
                                                (parts[0][:len(queries)], traced_at, parts[0][len(queries):])))
    r.anchor, r.anchor_literals = (None, frozenset()) if parts is None else (anchor, parts[1])
    return r


def _stretched(lhs: Callable[..., Any], avals: tuple[Any, ...]) -> tuple[tuple[Any, ...], core.ClosedJaxpr | None]:
    """``lhs`` traced with every dimension one longer, to tell shape-derived literals from constants."""
    longer = tuple(a.update(shape=tuple(d + 1 for d in a.shape)) for a in avals)
    try:
        return longer, trace_at(lhs, longer)
    except Exception:
        return longer, None


def _positional_names(rule_name: str, side: str, fn: Callable[..., Any]) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ValueError(f"rule {rule_name!r}: cannot read the signature of {side}") from None
    names = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"rule {rule_name!r}: {side} must name its pattern variables (no *args/**kwargs)")
        if p.kind == p.KEYWORD_ONLY:
            raise ValueError(f"rule {rule_name!r}: {side} has keyword-only parameter {p.name!r}")
        if p.default is p.empty:
            names.append(p.name)
    if not names:
        raise ValueError(f"rule {rule_name!r}: {side} takes no pattern variables")
    return names


def _probes(name: str, names: list[str], example: Any) -> list[tuple[Any, ...]]:
    if example is None:
        return [tuple(core.ShapedArray(s, np.dtype(np.float32)) for _ in names) for s in PROBE_SHAPES]
    items = example if isinstance(example, (tuple, list)) else [example] * len(names)
    if len(items) != len(names):
        raise ValueError(f"rule {name!r}: example_inputs= gives {len(items)} inputs for {len(names)} pattern variables")
    return [tuple(_example_aval(name, x, "entries") for x in items)]


def _example_aval(name: str, x: Any, what: str) -> Any:
    """The aval of one example input or argument (an array or a ``ShapeDtypeStruct``)."""
    try:
        return core.ShapedArray(tuple(x.shape), np.dtype(x.dtype), weak_type=getattr(x, "weak_type", False))
    except AttributeError:
        raise ValueError(f"rule {name!r}: example {what} need .shape and .dtype, got {type(x).__name__}") from None


def _example_program(name: str, example: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Validate a Pat rule's ``example_program=(fn, args)`` and return ``(fn, avals)``."""
    if not (isinstance(example, (tuple, list)) and len(example) == 2 and callable(example[0])):
        raise ValueError(f"rule {name!r}: a Pat rule's example_program= is a pair (fn, args): a program the rule "
                         "applies in and its example arguments")
    fn, args = example
    if not isinstance(args, (tuple, list)):
        args = (args,)
    avals = [_example_aval(name, x, "arguments") for x in args]
    try:
        trace_at(fn, avals)
    except Exception as e:
        raise ValueError(f"rule {name!r}: the example program cannot be traced at "
                         f"({', '.join(_short(a) for a in avals)}): {e}") from None
    return fn, tuple(avals)


def _guard_allows(when: Callable[..., bool], avals: Sequence[Any]) -> bool:
    """Would the guard let these shapes through? Facts are unknown here and read as true. What the
    guard raises is raised: the caller decides whether these shapes were the guard's to answer."""
    return bool(when(*[Value.from_aval(a) for a in avals]))
