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
import itertools
import types
from typing import Any

import jax
import jax.core as _jax_core
import jax.extend.core as _ext_core
import jax.extend.core.primitives as primitives  # noqa: F401  (public: the primitives of jax.lax)

from jax._src import api_util as _api_util
from jax._src import config as _config
from jax._src import core as _core
from jax._src import literals as _literals
from jax._src import source_info_util as _source_info_util
from jax._src import util as _util
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import control_flow as _control_flow
from jax._src.lax import lax as _lax
from jax._src.lax import slicing as _slicing
from jax._src.mesh import empty_concrete_mesh  # noqa: F401  (no public name: the mesh a jit traced outside any mesh
#                                                holds in its params, which the cache writes by name)
from jax._src.sharding_impls import UNSPECIFIED, UnspecifiedValue  # noqa: F401  (no public name: the "no sharding given" marker
#                                                       a jaxpr's params hold, which the cost model reads as no sharding)

#: The jaxpr data structures and the tracing context, as ``core.X`` throughout the package.
core = types.SimpleNamespace(
    # public, jax.extend.core
    AbstractToken=_ext_core.AbstractToken,
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
    JaxprEqnContext=_core.JaxprEqnContext,  # an equation's context (mesh, compute type), which an emitted equation keeps
    ManualAxisType=_core.ManualAxisType,  # the manual axes a value of a shard_map body varies over, which the cache writes
    NamedAxisEffect=_core.NamedAxisEffect,  # the effect of a collective over a named axis, which a loaded program keeps
    abstract_token=_core.abstract_token,  # the aval of an effect token (jax.extend.core has the type, not the value)
    extend_axis_env_nd=_core.extend_axis_env_nd,  # the named axes of a shard_map body, to trace inside one
    initial_result_paths=_core.initial_result_paths,  # DebugInfo's "no result paths yet", to trace without jit
    join_effects=_core.join_effects,  # the union of effect sets, as an emitted jaxpr's effects
    trace_ctx=_core.trace_ctx,  # the current trace, which a derivative rule dispatches on (jax.core has no reader)
)

#: Automatic differentiation's rule tables. ``jax.interpreters.ad`` exports ``primitive_jvps``,
#: ``primitive_transposes``, ``Zero``, ``instantiate_zeros``, ``is_undefined_primal`` and ``JVPTrace``;
#: the linearization protocol (``primitive_linearizations``, ``fallback_linearize_rule``,
#: ``LinearizeTrace``), which ``jax.grad`` runs through, has no public name.
ad = _ad

#: What the rewritten-derivative primitive registers with the tracer: a rule that stages it out as is.
#: ``jax.interpreters.partial_eval`` does not export the table.
custom_staging_rules = _pe.custom_staging_rules

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

#: ``convert_element_type`` as JAX's own functions apply it (with ``weak_type``), for test inputs of a
#: weak type; ``jax.lax.convert_element_type`` always gives a strong type.
convert_element_type = _lax._convert_element_type

#: The modules whose primitives a rule may name by string (``Match.node("cumsum", ...)``): lax's,
#: including the control-flow and slicing primitives that ``jax.extend.core.primitives`` does not list.
PRIMITIVE_MODULES = (_lax, _slicing, _control_flow, primitives)

#: ``lax.optimization_barrier``'s primitive, bound directly by the measured cost model's pinned variant
#: (``jax.extend.core.primitives`` does not list it).
optimization_barrier_p = _lax.optimization_barrier_p

def held_weakly_by_jax_caches(cls: type) -> type:
    """Make JAX's caches that are keyed by a primitive's params hold ``cls``'s values weakly; returns ``cls``.

    Tracing a primitive puts its params in caches that outlive the trace (``_cached_abstract_eval``, an
    LRU of 2,048 entries, is one): a param whose value owns a rewrite's programs would keep them, and a
    function's every signature, alive for good. JAX holds its own ``Jaxpr`` and ``ClosedJaxpr`` weakly this
    way (``weakref_cache_key_types``); there is no public name for it. ``cls`` must hash by identity.
    """
    _util.weakref_cache_key_types.add(cls)
    return cls


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


class UnsupportedJax(RuntimeError):
    """A program holds a form this rewriter does not know on the running JAX version."""


def _unknown(what: str, params: Any) -> UnsupportedJax:
    return UnsupportedJax(f"jax {jax.__version__}: {what} params {sorted(params)} are in a layout jax-rewrite does "
                          f"not know (it knows jax 0.10's num_consts/num_carry and 0.11+'s ft_in/ft_out); "
                          f"install a supported jax (see README) or report this version")


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
