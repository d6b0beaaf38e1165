"""Every use of JAX's internals, in one module: where a new JAX version is met.

The rewriter reads and writes jaxprs, traces functions at abstract values and
defines primitives of its own, which JAX's public API covers only in part:
``jax.extend.core`` (the jaxpr data structures), ``jax.core``,
``jax.interpreters`` (the transformation rule tables) and ``jax.extend``
(``linear_util``, ``source_info_util``). Other modules import those public
modules directly, and everything else from here, never from ``jax._src``
(``tests/test_layout.py`` checks it). :data:`core` gathers the jaxpr data
structures under one name, from the public modules where they are; each name
below that comes from ``jax._src`` has a comment saying what public API it
stands in for, or why there is none.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import itertools
import types
from typing import Any

import jax
import numpy as np
import jax.core as _jax_core
import jax.extend.core as _ext_core
import jax.extend.core.primitives as primitives  # noqa: F401  (public: the primitives of jax.lax)

from jax._src import api_util as _api_util
from jax._src import config as _config
from jax._src import core as _core
from jax._src import literals as _literals
from jax._src import source_info_util as _source_info_util
from jax._src import traceback_util as _traceback_util
from jax._src import tree_util as _tree_util  # (the registry flat trees' pytree structures are made in: no public name)
from jax._src import util as _util
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import control_flow as _control_flow
from jax._src.lax import lax as _lax
from jax._src.lax import slicing as _slicing
from jax._src.mesh import empty_concrete_mesh  # noqa: F401  (no public name: the mesh a jit traced outside any mesh
#                                                holds in its params, which the cache writes by name)
from jax._src.state.types import AbstractRef  # noqa: F401  (no public name: a mutable array's type, jax.new_ref)
from jax._src.sharding_impls import UNSPECIFIED, UnspecifiedValue  # noqa: F401  (no public name: the "no sharding given" marker
#                                                       a jaxpr's params hold, which the cost model reads as no sharding)

class UnsupportedJax(RuntimeError):
    """A program holds a form this rewriter does not know on the running JAX version."""


#: The jaxpr data structures and the tracing context, as ``core.X`` throughout the package.
core = types.SimpleNamespace(
    # public, jax.extend.core
    AbstractToken=_ext_core.AbstractToken,
    Token=_ext_core.Token,  # an effect token (jax.lax.create_token), an argument traced as arrays are
    ClosedJaxpr=_ext_core.ClosedJaxpr,
    DebugInfo=_ext_core.DebugInfo,
    DropVar=_ext_core.DropVar,
    Jaxpr=_ext_core.Jaxpr,
    JaxprEqn=_ext_core.JaxprEqn,
    Literal=_ext_core.Literal,
    Primitive=_ext_core.Primitive,
    Var=_ext_core.Var,
    check_jaxpr=_ext_core.check_jaxpr,
    jaxpr_as_fun=_ext_core.jaxpr_as_fun,
    jaxprs_in_params=_ext_core.jaxprs_in_params,
    mapped_aval=_ext_core.mapped_aval,
    new_jaxpr_eqn=_ext_core.new_jaxpr_eqn,
    no_effects=_ext_core.no_effects,
    primitives=_ext_core.primitives,
    set_current_trace=_ext_core.set_current_trace,
    unmapped_aval=_ext_core.unmapped_aval,
    # public, jax.core and jax
    ShapedArray=_jax_core.ShapedArray,
    Tracer=_jax_core.Tracer,
    eval_jaxpr=_jax_core.eval_jaxpr,
    typeof=jax.typeof,
    # internal: no public API
    current_jaxpr_eqn_context=_core.current_jaxpr_eqn_context,  # a traced equation's context (grad/seed.py)
    trace_state_clean=_core.trace_state_clean,  # whether no trace is active (jaxpr/metadata.py's EagerKeys)
    Ref=_core.Ref,  # a mutable array constant, which jit's staging rule moves out of its body (grad/seed.py)
    # whether the tracer stages a constant as a literal (grad/seed.py); jax 0.12.1 dropped ``for_ad``
    is_literalable=_core.is_literalable if "for_ad" in inspect.signature(_core.is_literalable).parameters
    else lambda x, for_ad=False: _core.is_literalable(x),
    JaxprEqnContext=_core.JaxprEqnContext,  # an equation's context (mesh, compute type), which an emitted equation keeps
    ManualAxisType=_core.ManualAxisType,  # the manual axes a value of a shard_map body varies over, which the cache writes
    NamedAxisEffect=_core.NamedAxisEffect,  # the effect of a collective over a named axis, which a loaded program keeps
    abstract_token=_core.abstract_token,  # the aval of an effect token (jax.extend.core has the type, not the value)
    extend_axis_env_nd=_core.extend_axis_env_nd,  # the named axes of a shard_map body, to trace inside one
    initial_result_paths=_core.initial_result_paths,  # DebugInfo's "no result paths yet", to trace without jit
    join_effects=_core.join_effects,  # the union of effect sets, as an emitted jaxpr's effects
    trace_ctx=_core.trace_ctx,  # the current trace, which a derivative rule dispatches on (jax.core has no reader)
    # what JAX raises where an operation's result sharding cannot be resolved under explicit mesh axes: a rule
    # whose replacement JAX will not build so declines (rewrite/rules/saturate.py)
    ShardingTypeError=getattr(_core, "ShardingTypeError", ()),
)

#: The debug info of a program the rewriter assembles from another's equations (JAX warns where a jaxpr has none).
BUILT_DEBUG = _core.DebugInfo("rewrite", "a program assembled by rewrite", None, None)


def _new_jaxpr(constvars: Any, invars: Any, outvars: Any, eqns: Any, effects: Any, debug_info: Any) -> Any:
    """``Jaxpr(constvars, invars, outvars, eqns, effects, debug_info)``, high where JAX's own tracer would make it
    so: an equation of a primitive that says it is high (JAX 0.12's ``call_hi_primitive`` of ``jnp.searchsorted``,
    a ``custom_vjp`` under ``jax_custom_vjp3``, a body holding one), or a value of a high type. A body built
    without the mark is lowered as it is: a ``scan`` whose body binds ``call_hi_primitive`` failed to compile
    ("MLIR translation rule for primitive 'call_hi_primitive' not found"; JAX's
    ``test_custom_vjp_scan_batching_edge_case`` routed through the rewriter). Every program this library
    assembles is made with this (``core.new_jaxpr``)."""
    if _any_eqn_is_high(eqns) or any(getattr(v.aval, "is_high", False)
                                      for v in itertools.chain(constvars, invars, outvars)):
        return _core.Jaxpr(constvars, invars, outvars, eqns, effects, debug_info, is_high=True)
    return _core.Jaxpr(constvars, invars, outvars, eqns, effects, debug_info)


core.new_jaxpr = _new_jaxpr
_PLAIN_IS_HIGH = _core.Primitive.is_high
_BODY_TYPES = frozenset({_ext_core.Jaxpr, _ext_core.ClosedJaxpr})
_plain_is_high: dict[Any, bool] = {}  # a primitive -> whether it keeps JAX's default ``is_high``


def _eqn_is_high(e: Any) -> bool:
    """``e.primitive.is_high(*in_avals, **params)``, as JAX's tracer asks it; where the primitive keeps JAX's
    default (high where a jaxpr among its params is), read off the params without calling it."""
    prim = e.primitive
    plain = _plain_is_high.get(prim)
    if plain is None:
        plain = _plain_is_high[prim] = (type(prim).is_high is _PLAIN_IS_HIGH
                                        and "is_high" not in getattr(prim, "__dict__", ()))
    if plain:
        for v in e.params.values():
            if type(v) in _BODY_TYPES and v.is_high:
                return True
        return False
    return prim.is_high(*[v.aval for v in e.invars], **e.params)


def _any_eqn_is_high(eqns: Any) -> bool:
    for e in eqns:  # (a loop, not ``any`` of a generator: a fifth of the time, on every program assembled)
        if _eqn_is_high(e):
            return True
    return False


#: Automatic differentiation's rule tables. ``jax.interpreters.ad`` exports ``primitive_jvps``,
#: ``primitive_transposes``, ``Zero``, ``instantiate_zeros``, ``is_undefined_primal`` and ``JVPTrace``;
#: the linearization protocol (``primitive_linearizations``, ``fallback_linearize_rule``,
#: ``LinearizeTrace``), which ``jax.grad`` runs through, has no public name.
ad = _ad


# ---------------------------------------------------------------------- linearization rules, across JAX versions
# JAX 0.10's linearization rule returns ``(primal_out, nonzeros_out, residuals, linearized)`` and calls
# ``linearized(residuals, *tangents)``; JAX 0.11 and later added structured residuals: the rule returns
# ``(primal_out, nonzeros_out, residuals, structured_residuals, linearized)`` and JAX calls
# ``linearized(residuals, structured_residual_binders, *tangents)``. The rewriter writes its rules in the
# first form (``structured_residuals`` always ``None``), and these two functions give JAX its own.
@functools.cache
def _linearization_arity() -> int:
    """How many values the running JAX's linearization rules return: 4 (jax 0.10) or 5 (0.11+), found by
    asking JAX's own fallback rule to linearize ``neg`` (no version number is read)."""
    found: list[int] = []

    def probe(x: Any) -> Any:  # traced on its own, so that nothing joins a trace this is called under
        out = _ad.fallback_linearize_rule(_lax.neg_p, False, [True], x)
        found.append(len(out))
        return out[0]

    jax.make_jaxpr(probe)(np.float32(1.0))
    n = found[0]
    if n not in (4, 5):
        raise UnsupportedJax(f"jax {jax.__version__}: its linearization rules return {n} values, a protocol "
                             f"jax-rewrite does not know (it knows jax 0.10's 4 and 0.11+'s 5)")
    return n


def register_linearization(prim: Any, rule: Any) -> None:
    """Register ``rule(is_vjp, nonzeros, *primals, **params) -> (primal_out, nonzeros_out, residuals,
    linearized)``, ``linearized(residuals, *tangents)`` as ``prim``'s linearization rule, in the form the
    running JAX calls (found on the first call, not at import)."""

    def adapted(*args: Any, **params: Any) -> Any:
        if _linearization_arity() == 4:
            return rule(*args, **params)
        primal_out, nzs_out, residuals, linearized = rule(*args, **params)
        return primal_out, nzs_out, residuals, None, lambda res, _structured, *ts: linearized(res, *ts)

    _ad.primitive_linearizations[prim] = adapted


def fallback_linearize(prim: Any, is_vjp: bool, nonzeros: Any, *primals: Any, **params: Any) -> tuple:
    """JAX's linearization of ``prim`` through its JVP rule, in the four-part form of :func:`register_linearization`."""
    out = _ad.fallback_linearize_rule(prim, is_vjp, nonzeros, *primals, **params)
    if len(out) == 4:
        return out
    primal_out, nzs_out, residuals, structured, linearized = out
    assert structured is None, "JAX's fallback linearization gave structured residuals"
    return primal_out, nzs_out, residuals, lambda res, *ts: linearized(res, None, *ts)


#: What the rewritten-derivative primitive registers with the tracer: a rule that stages it out as is.
#: ``jax.interpreters.partial_eval`` does not export the table.
custom_staging_rules = _pe.custom_staging_rules

#: The tracer's table of primitives it folds where an input is a constant (``convert_element_type``,
#: ``device_put``): a program edited as its trace would stage it (``rewrite/grad/seed.py``) leaves such an
#: equation with a literal input to the trace. Not exported.
const_fold_rules = _pe.const_fold_rules

#: A literal's value with its dtype, as jaxprs hold them (``TypedNdArray``, and the scalars ``TypedInt``,
#: ``TypedFloat``, ``TypedComplex``): no public name; the emitter builds them and the cache writes them down.
literals = _literals

#: ``jax.make_jaxpr`` traces through ``jit``, which is half the cost of a small trace; rules trace at new
#: shapes hundreds of times a rewrite, so ``trace_at`` traces directly, with the source location of the
#: function for its debug info. No public API gives either.
fun_sourceinfo = _api_util.fun_sourceinfo

#: Whether a ``shard_map`` body checks which manual axes a value varies over: the context a body is
#: traced in. No public API sets it outside ``shard_map``.
check_vma = _config._check_vma

#: What ``jax.jit`` keys its traces on besides the arguments: the configuration a trace reads (the default
#: matmul precision, rank and dtype promotion, x64, the axis and mesh contexts ...), so that a program traced
#: under one is never run under another. No public API gives it.
trace_context = _config.trace_context

#: ``convert_element_type`` as JAX's own functions apply it (with ``weak_type``), for test inputs of a
#: weak type; ``jax.lax.convert_element_type`` always gives a strong type.
convert_element_type = _lax._convert_element_type

#: The modules whose primitives a rule may name by string (``Match.node("cumsum", ...)``): lax's,
#: including the control-flow and slicing primitives that ``jax.extend.core.primitives`` does not list.
PRIMITIVE_MODULES = (_lax, _slicing, _control_flow, primitives)

#: ``lax.optimization_barrier``'s primitive, bound directly by the measured cost model's pinned variant
#: (``jax.extend.core.primitives`` does not list it).
optimization_barrier_p = _lax.optimization_barrier_p


def _hi_primitive_types() -> tuple[type, ...]:
    """JAX's classes of "hijax" primitive objects (``HiPrim``, ``VJPHiPrimitive``: no public name), whichever this
    JAX has. An equation of one holds the object as a param (``call_hi_primitive``'s ``_prim``)."""
    try:
        from jax._src import hijax
    except ImportError:  # pragma: no cover  (a JAX without them)
        return ()
    return tuple(c for c in (getattr(hijax, "HiPrim", None), getattr(hijax, "VJPHiPrimitive", None))
                 if isinstance(c, type))


HI_PRIMITIVE_TYPES = _hi_primitive_types()
#: The attributes a hijax primitive object holds besides its params' own (``HiPrim.__init__`` copies its params
#: into its attributes): the types it was made for and their trees.
_HI_STATE = frozenset({"in_avals", "out_aval", "params", "effects", "in_avals_flat", "in_tree", "out_avals_flat",
                       "out_tree"})


def hi_primitive_state(value: Any) -> tuple | None:
    """What a hijax primitive object (:data:`HI_PRIMITIVE_TYPES`) computes from, where that is all it holds: its class,
    params, effects, and the types it was made for (``(class, params, effects, in types, out types, their trees)``);
    ``None`` where it holds more (a ``custom_vjp``'s traced functions, say) or is no such object.

    JAX compares these objects by class, params and effects alone (``HiPrim.__eq__``), not the types they were made
    for, which their abstract evaluation reads: ``jnp.searchsorted`` of a scalar and of a ``[2]`` query (jax 0.12)
    are equal objects, whose results are ``int32[]`` and ``int32[2]``."""
    if not HI_PRIMITIVE_TYPES or not isinstance(value, HI_PRIMITIVE_TYPES):
        return None
    state = vars(value)
    params = state.get("params")
    if not isinstance(params, dict) or not set(state) <= _HI_STATE | set(params):
        return None
    if any(state[k] is not v for k, v in params.items() if k in state):
        return None  # an attribute that its param no longer is
    return (type(value), params, getattr(value, "effects", None), tuple(getattr(value, "in_avals_flat", ())),
            tuple(getattr(value, "out_avals_flat", ())), getattr(value, "in_tree", None),
            getattr(value, "out_tree", None))


def constant_array(a: Any) -> Any:
    """``a`` (a NumPy array) as a JAX array made as a constant, even while a JAX trace is open, where
    ``jnp.asarray`` would bind into that trace. Typed on no mesh, as the NumPy constant is: made under a mesh with
    explicit axes (``jax.set_mesh``) it would be typed on that mesh, and a program that reads it inside an Auto
    region of the mesh (``x.at[:].set(v, out_sharding=P('x'))``: a ``scatter`` under ``auto_axes``, whose indices
    are such a constant) failed JAX's check that a value's mesh is the context's (checkify_test's
    ``test_auto_axes_explicit_top_level``, routed). Put, not ``jnp.asarray``'d: that compiles a conversion per shape
    and dtype (8-30 ms each, a first call's; the same array, uncommitted, on the default device)."""
    with jax.ensure_compile_time_eval():
        return jax.device_put(a)


def is_prng_key(x: Any) -> bool:
    """Is ``x`` (an array or a constant of a program) a ``jax.random.key`` array, of an extended dtype?"""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def staged_var(x: Any) -> Any:
    """The variable of its jaxpr that ``x``, a tracer of a staging trace (``jit``, ``make_jaxpr``), stands for, even
    once that trace has ended; ``None`` for any other value. (No public reader: a ``DynamicJaxprTracer``'s ``val``.)"""
    v = getattr(x, "val", None) if isinstance(x, _pe.DynamicJaxprTracer) else None
    return v if isinstance(v, _ext_core.Var) else None


def held_as_is(x: Any) -> bool:
    """Is ``x`` a constant that a program the rewrite emits holds as it is, the very object, not made again from its
    values? A JAX array laid out on a mesh or over several devices (made again, it would sit on one device,
    unsharded, and under explicit sharding every value computed from it would change type, ``f32[32@x]`` to
    ``f32[32]``), and a PRNG key array (no NumPy array holds one, and JAX's key-reuse checker,
    ``jax_debug_key_reuse``, follows each key object through the programs it is passed to)."""
    if isinstance(x, _core.Tracer) or not isinstance(x, jax.Array):
        return False
    return is_prng_key(x) or not isinstance(x.sharding, jax.sharding.SingleDeviceSharding)


def has_reduced_axes(aval: Any) -> bool:
    """Is ``aval`` typed with reduced or unreduced mesh axes (``P(reduced={'x'})``: each device holds a whole copy,
    or a partial sum)? JAX's ``vmap`` refuses to batch such a value (``Using pspec[...] is dangerous``)."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    return bool(getattr(spec, "reduced", None) or getattr(spec, "unreduced", None))


def prng_impl_of(dtype: Any) -> Any:
    """The PRNG implementation a key dtype holds (what a ``random_wrap``'s ``impl`` param is), else ``None``."""
    return getattr(dtype, "_impl", None)


def key_parts(key: Any) -> tuple[Any, np.ndarray]:
    """A PRNG key array's implementation and data (a ``uint32`` NumPy array), read as constants even while a JAX
    trace is open (the rewrite of a jitted function runs inside its trace), where ``key_data`` would bind into it."""
    with jax.ensure_compile_time_eval():
        return jax.random.key_impl(key), np.asarray(jax.random.key_data(key))


def primal_arrays(x: Any) -> Any:
    """``x`` with a NumPy array made a JAX array, as ``jax.jit`` makes its arguments, and so the NumPy primal at
    the bottom of a differentiating tracer (``jax.vjp`` keeps a NumPy primal as it is, as a ``TypedNdArray``): the
    tracer is made again around the JAX array, with its trace and tangent. A rewritten program whose ``jit`` was
    inlined runs its ``custom_vjp`` eagerly, and one that forwards an input as a residual handed its backward the
    NumPy array: ``jax.experimental.ode``'s backward indexes its times with a traced index (``ts[i]``), which NumPy
    refuses (JAX's ``ode_test`` under ``check_grads`` of the second order, routed through the rewriter, raised
    ``TracerArrayConversionError``)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.numpy.asarray(x)
    if isinstance(x, (_ad.JVPTracer, _ad.LinearizeTracer)):
        primal = primal_arrays(x.primal)
        return x if primal is x.primal else type(x)(x._trace, primal, x.tangent)
    return x


def body_closed(jaxpr: Any) -> Any:
    """A call's body as the ``ClosedJaxpr`` the cost models read (``Program.from_jaxpr``): itself where closed; an
    open one (:func:`rewrite.ir.primitives.inner_jaxpr` reads a closed call's ``jaxpr``) with its constants'
    variables read as inputs (JAX's ``convert_constvars_jaxpr``), since its constants are not at hand there. A
    ``jit`` inside a ``cond`` branch holding ``jnp.array([1., 2.])`` has one: ``ClosedJaxpr(jaxpr, ())`` asserted, and
    the VJP of ``lax_control_flow_test``'s ``testCondGrad2`` fell back."""
    if hasattr(jaxpr, "consts"):
        return jaxpr
    if jaxpr.constvars:
        jaxpr = _pe.convert_constvars_jaxpr(jaxpr)
    return _core.ClosedJaxpr(jaxpr, ())


def held_weakly_by_jax_caches(cls: type) -> type:
    """Make JAX's caches that are keyed by a primitive's params hold ``cls``'s values weakly; returns ``cls``.

    Tracing a primitive puts its params in caches that outlive the trace (``_cached_abstract_eval``, an
    LRU of 2,048 entries, is one): a param whose value owns a rewrite's programs would keep them, and a
    function's every signature, alive for good. JAX holds its own ``Jaxpr`` and ``ClosedJaxpr`` weakly this
    way (``weakref_cache_key_types``); there is no public name for it. ``cls`` must hash by identity.
    """
    _util.weakref_cache_key_types.add(cls)
    return cls


def hide_from_tracebacks(path: str) -> None:
    """Count the files under ``path`` as JAX counts its own: left out of the tracebacks JAX filters and of the
    frames it names as the user's (``This error occurs at source: ...``, a leaked tracer's stack, an equation's
    source line), as flax and JAX itself register theirs. No public API registers one."""
    _traceback_util.register_exclusion(path)
    _source_info_util.register_exclusion(path)


#: The user's frame of an equation's source location, for the report (``jax.extend.source_info_util``
#: has ``summarize``, which formats it, but nothing that returns the frame).
user_frame = _source_info_util.user_frame


def pretty_named(jaxpr: Any, names: dict | None = None, avoid: Any = ()) -> tuple[str, dict]:
    """A jaxpr's text as ``str(closed)`` prints it (shared bodies inline), with ``names`` fixing what the
    given variables are called and every other variable a fresh name none of those nor ``avoid`` take;
    and the name each variable got. ``explain``'s diff prints the rewritten program with the original's names this
    way: no public API prints a jaxpr with chosen names."""
    names = dict(names or {})
    taken = set(names.values()) | set(avoid)
    fresh = (n for i in itertools.count() if (n := _core._encode_digits_alphabetic(i)) not in taken)
    context = _core.JaxprPpContext()
    context.var_names = collections.defaultdict(fresh.__next__, {**_core._dropvars(jaxpr), **names})
    text = _core.pp_jaxpr(jaxpr, context, _core.JaxprPpSettings()).format()
    return text, dict(context.var_names)


# ---------------------------------------------------------------------- scan's params, across JAX versions
# JAX 0.10 gives a scan's input groups as counts (``num_consts``, ``num_carry``, and ``linear`` per input);
# JAX 0.11 and later as flat trees (``ft_in``: consts, carry, xs; ``ft_out``: carry, ys). The rewriter
# keeps the counts in its own params table whichever JAX it runs on (:func:`scan_counted`) and gives JAX
# its own layout back when it emits a scan (:func:`scan_for_jax`).
try:
    from jax._src import flattree as _flattree  # JAX 0.11+: the flat trees a scan's params hold (no public name)
except ImportError:  # JAX 0.10
    _flattree = None


def _unknown(what: str, params: Any) -> UnsupportedJax:
    return UnsupportedJax(f"jax {jax.__version__}: {what} params {sorted(params)} are in a layout jax-rewrite does "
                          f"not know (it knows jax 0.10's num_consts/num_carry and 0.11+'s ft_in/ft_out); "
                          f"install a supported jax (see README) or report this version")


def missing_param(prim: str, params: Any, missing: KeyError) -> UnsupportedJax:
    """The error for a ``prim`` equation that lacks a param the loader reads (``missing``): a JAX whose
    equations this rewriter does not know, named with its version, in place of a ``KeyError`` deep inside."""
    return UnsupportedJax(f"jax {jax.__version__}: a '{prim}' equation has params {sorted(params)}, without "
                          f"{missing}, which jax-rewrite reads; this JAX's '{prim}' is in a layout jax-rewrite does "
                          f"not know: install a supported jax (see README) or report this version")


def scan_counts(params: Any) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a scan's params, in either JAX's layout or the rewriter's."""
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    ft_in = params.get("ft_in")
    if _flattree is not None and isinstance(ft_in, _flattree.FlatTree):
        groups = ft_in.unpack()
        if len(groups) == 3:
            return len(groups[0]), len(groups[1])
    raise _unknown("scan's", params)


def scan_counted(params: Any) -> dict:
    """A scan's params with its input groups as counts (``num_consts``, ``num_carry``), as the rewriter keeps them."""
    nc, ncarry = scan_counts(params)
    out = {k: v for k, v in params.items() if k not in ("ft_in", "ft_out")}
    out["num_consts"], out["num_carry"] = nc, ncarry
    return out


def _jax_scan_layout() -> str:
    global _SCAN_LAYOUT
    if _SCAN_LAYOUT is None:
        params = jax.make_jaxpr(lambda c: jax.lax.scan(lambda c, _: (c, None), c, None, length=1))(0.0).eqns[0].params
        _SCAN_LAYOUT = "counts" if "num_consts" in params else "flat trees" if "ft_in" in params else ""
        if not _SCAN_LAYOUT:
            raise _unknown("scan's", params)
    return _SCAN_LAYOUT


_SCAN_LAYOUT: str | None = None


def scan_for_jax(params: dict) -> dict:
    """A scan's params in the rewriter's layout (counts, ``jaxpr`` final) as the running JAX binds them."""
    if _jax_scan_layout() == "counts":
        return params
    nc, ncarry = scan_counts(params)
    body = params["jaxpr"]
    nxs, nys = len(body.in_avals) - nc - ncarry, len(body.out_avals) - ncarry
    out = {k: v for k, v in params.items() if k not in ("num_consts", "num_carry", "linear", "_split_transpose")}
    ft = _flattree
    out["ft_in"] = ft.pack((ft.nones(nc), ft.nones(ncarry), ft.nones(nxs)))
    # as lax.scan builds it: the ys group is what a mask over the body's outputs kept
    out["ft_out"] = ft.pack((ft.nones(ncarry), ft.nones(nys).filter_with_mask([True] * nys)))
    return out


#: Params JAX 0.11 added to a primitive, with the value that means what the primitive did without them on
#: JAX 0.10 (found by tracing the same programs on 0.10.2, 0.11.2 and 0.12.0.1 and comparing the params).
_ADDED_PARAMS = {"reduce_max": {"out_sharding": None}, "reduce_min": {"out_sharding": None}}


#: The neutral param that keeps a scan's own flat trees, as plain data (:func:`neutral_params` with ``trees``).
SCAN_TREES = "_rw_scan_trees"


def _tree_data(tree: Any) -> Any:
    """A flat tree (JAX 0.11+) as plain data: nested tuples, ``None`` leaves, ``Either`` sides and a pytree's
    structure as its protocol-buffer bytes. Raises ``TypeError`` on anything else."""
    ft = _flattree
    if isinstance(tree, ft.FTTuple):
        return ("tuple", tuple(_tree_data(e) for e in tree.elts))
    if isinstance(tree, ft.FTFiltered):
        return ("filtered", _tree_data(tree.val))
    if isinstance(tree, ft.FTSingleton):
        return ("one", _leaf_data(tree.val))
    if isinstance(tree, ft.FTPyTree):
        return ("pytree", tuple(_leaf_data(x) for x in tree.xs), tree.tree.serialize_using_proto())
    raise TypeError(f"a flat tree of {type(tree).__name__}")


def _leaf_data(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, _flattree.Either):
        return ("right" if x.is_right else "left", _leaf_data(x.val))
    raise TypeError(f"a flat tree's leaf {type(x).__name__}")


def _tree_from(data: Any) -> Any:
    """The inverse of :func:`_tree_data`."""
    ft, kind = _flattree, data[0]
    if kind == "tuple":
        return ft.FTTuple(*(_tree_from(e) for e in data[1]))
    if kind == "filtered":
        return ft.FTFiltered(_tree_from(data[1]))
    if kind == "one":
        return ft.FTSingleton(_leaf_from(data[1]))
    treedef = type(jax.tree_util.tree_structure(0)).deserialize_using_proto(_tree_util.tracing_registry, data[2])
    return ft.FTPyTree(tuple(_leaf_from(x) for x in data[1]), treedef)


def _group_sizes(tree: Any) -> list[int]:
    return [len(g) for g in tree.unpack()]


def _leaf_from(data: Any) -> Any:
    return None if data is None else _flattree.Either(data[0] == "right", _leaf_from(data[1]))


def neutral_params(prim: Any, params: Any, *, trees: bool = False) -> Any:
    """An equation's params in a form that does not depend on the JAX version that traced it: a scan's input
    groups as counts, and a param JAX 0.11 added left out where it holds the value that means what 0.10 did
    without it. Written down, hashed or printed this way, one program reads the same on every supported JAX;
    :func:`params_for_jax` is the inverse. With ``trees`` (what the loader keeps and the disk cache writes), a
    scan whose flat trees are not the ones :func:`scan_for_jax` builds (one JAX made through a transformation,
    say) keeps them as plain data (:data:`SCAN_TREES`), so that it is emitted, and read back, as it was while
    its groups keep their sizes."""
    name = getattr(prim, "name", prim)
    if name == "scan":
        out = scan_counted(params)
        if trees and "ft_in" in params:
            try:
                own = (_tree_data(params["ft_in"]), _tree_data(params["ft_out"]))
                rebuilt = scan_for_jax(out)
                if own != (_tree_data(rebuilt["ft_in"]), _tree_data(rebuilt["ft_out"])):
                    out[SCAN_TREES] = own
            except TypeError:
                pass  # a tree of a kind not known here: read back with the canonical trees, which run alike
        return out
    added = _ADDED_PARAMS.get(name)
    if added and any(k in params and params[k] is v for k, v in added.items()):
        return {k: v for k, v in params.items() if not (k in added and v is added[k])}
    return params


def neutral_jaxpr(jaxpr: Any) -> Any:
    """``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``) with every equation's params, its bodies' too, in the form of
    :func:`neutral_params`, its variables the same objects: for printing and comparing programs whichever JAX
    traced or transformed them. On JAX 0.11+ its scans do not run."""
    def params_of(e: Any) -> dict:
        return neutral_params(e.primitive, {k: inner(v) for k, v in e.params.items()})

    def inner(v: Any) -> Any:
        if isinstance(v, (tuple, list)) and any(isinstance(x, (core.Jaxpr, core.ClosedJaxpr)) for x in v):
            return type(v)(inner(x) for x in v)
        return neutral_jaxpr(v) if isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) else v

    try:
        if not isinstance(jaxpr, core.Jaxpr):  # a ClosedJaxpr on JAX 0.10 (an alias of Jaxpr from 0.11)
            return core.ClosedJaxpr(neutral_jaxpr(jaxpr.jaxpr), jaxpr.consts)
        return jaxpr.replace(eqns=[e.replace(params=params_of(e)) for e in jaxpr.eqns])
    finally:
        del inner  # a recursive closure is a reference cycle


#: The name scope in which a pack's kernel traces a loop it lays out by hand (:func:`rewrite.loops.laid_out`).
LAID_OUT_SCOPE = "rewrite_laid_out"


def laid_out_mark(eqn: Any) -> dict:
    """``{"_rw_laid_out": True}`` for a loop equation traced inside :data:`LAID_OUT_SCOPE` (JAX keeps the scope
    in the equation's name stack through ``jvp`` and ``transpose``: a kernel's backward loop is marked too)."""
    return {"_rw_laid_out": True} if LAID_OUT_SCOPE in str(eqn.source_info.name_stack) else {}


def scan_kept(params: Any) -> dict:
    """A scan's params as the loader keeps them: :func:`neutral_params` with the scan's own flat trees."""
    return neutral_params("scan", params, trees=True)


def params_for_jax(prim: Any, params: Any) -> Any:
    """The inverse of :func:`neutral_params`: params as the running JAX binds them."""
    name = getattr(prim, "name", prim)
    if name == "scan":
        own = params.get(SCAN_TREES)
        out = scan_for_jax({k: v for k, v in params.items() if k != SCAN_TREES})
        if own is not None and "ft_in" in out:
            kept = _tree_from(own[0]), _tree_from(own[1])
            if all(_group_sizes(a) == _group_sizes(b) for a, b in zip(kept, (out["ft_in"], out["ft_out"]))):
                out["ft_in"], out["ft_out"] = kept  # else a rule changed the loop's groups: the canonical trees
        return out
    added = _ADDED_PARAMS.get(name)
    if added and _has_added_params(name):
        return {**added, **params}
    return params


@functools.cache
def _has_added_params(name: str) -> bool:
    """Whether the running JAX's ``name`` equations hold the params of :data:`_ADDED_PARAMS` (0.11+)."""
    x = np.zeros((1, 1), np.float32)
    fn = {"reduce_max": lambda x: x.max(0), "reduce_min": lambda x: x.min(0)}[name]
    return set(_ADDED_PARAMS[name]) <= set(jax.make_jaxpr(fn)(x).eqns[0].params)


# ---------------------------------------------------------------------- custom_vjp's backward rule, across JAX versions
# A ``custom_vjp_call``'s ``bwd`` param maps ``(*residuals, *output cotangents)`` to the input cotangents on
# JAX 0.10, and to ``(input cotangents, logs)`` on JAX 0.11 and later (``defvjp_with_logs``; ``logs`` is
# ``None`` for a plain rule).
@functools.cache
def _bwd_returns_logs() -> bool:
    """Whether the running JAX's ``custom_vjp`` backward rules return ``(cotangents, logs)``: found by
    tracing a one-input ``custom_vjp`` and calling its rule."""
    @jax.custom_vjp
    def f(x: Any) -> Any:
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (g,))
    params = jax.make_jaxpr(f)(np.float32(1.0)).eqns[0].params
    params["fwd_jaxpr_thunk"].call_wrapped(True)  # fills the rule's output trees
    out = params["bwd"].call_wrapped(np.float32(1.0))
    if isinstance(out, list) and len(out) == 1:
        return False
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], list) and out[1] is None:
        return True
    raise UnsupportedJax(f"jax {jax.__version__}: a custom_vjp's backward rule returns {type(out).__name__} "
                         f"{out!r}, a protocol jax-rewrite does not know")


def call_custom_vjp_bwd(bwd: Any, *args: Any) -> list:
    """The input cotangents a ``custom_vjp_call``'s ``bwd`` param gives for ``(*residuals, *cotangents)``."""
    out = bwd.call_wrapped(*args)
    return list(out[0]) if _bwd_returns_logs() else list(out)


def custom_vjp_bwd(fn: Any) -> Any:
    """``fn`` (``(*residuals, *cotangents) -> input cotangents``, every cotangent an array) as the running JAX
    calls a ``bwd`` param of a ``custom_vjp_call`` without symbolic zeros. JAX 0.10 instantiates a zero
    output cotangent before it calls the rule; 0.11+ hands it a ``SymbolicZero``, which JAX's own rules
    instantiate (``_flatten_bwd``), and so does this."""
    def bwd(*args: Any) -> Any:
        args = tuple(_ad.zeros_like_aval(a.aval) if type(a) is _ad.SymbolicZero else a for a in args)
        cts = fn(*args)
        return (cts, None) if _bwd_returns_logs() else cts

    return bwd


# ---------------------------------------------------------------------- checkpoint policies, across JAX versions
from jax._src import ad_checkpoint as _ad_checkpoint  # noqa: E402  (name_p: what a named value's policy reads)


@dataclasses.dataclass(frozen=True)
class SaveOnlyTheseNames:
    """JAX 0.10's ``jax.checkpoint_policies.save_only_these_names`` policy, as a value: JAX 0.11 made it a
    closure, which prints its address and which no cache can write. The same rule (save a value only when
    ``checkpoint_name`` gave it one of these names) and, on every JAX, the same text in a jaxpr."""

    saveable_names: frozenset

    def __call__(self, prim: Any, *_: Any, **params: Any) -> bool:
        return prim is _ad_checkpoint.name_p and params["name"] in self.saveable_names


def save_only_these_names(*names: str) -> Any:
    """A checkpoint policy saving only the values named ``names`` (JAX's own where it is a value, 0.10)."""
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    return policy if dataclasses.is_dataclass(policy) else SaveOnlyTheseNames(frozenset(names))


def jit_inlined_when_staged(inline: Any) -> bool:
    """Whether a ``jit`` equation whose ``inline`` param is ``inline`` asks JAX's staging rule to inline its body into
    the trace it is bound in (where it gives no shardings or layouts): ``inline=True`` on jax 0.10, whose param is a
    bool; ``Inline.JAX_EARLY`` on jax 0.11+, whose param is an ``enum`` (every member of it truthy: ``AUTO``, the
    default, stays a call in the trace as ``False`` did).

    >>> jit_inlined_when_staged(False), jit_inlined_when_staged(True)
    (False, True)
    >>> import enum  # jax 0.11+'s Inline, as its members read
    >>> class Inline(enum.Enum): AUTO = "auto"; JAX_LATE = "jax_late"; JAX_EARLY = "jax_early"
    >>> [jit_inlined_when_staged(m) for m in Inline]
    [False, False, True]
    """
    if isinstance(inline, (bool, np.bool_)):
        return bool(inline)
    return getattr(inline, "value", inline) == "jax_early"
