"""``rewrite.rules.builder._trace_key``: which rule-built closures keep their trace for the process.

A closure the key cannot read is traced afresh at every match: flax_lm_step's rewrite traced 129 such
closures, 29 of them distinct (a primitive's params five levels deep, a dict of params, a NumPy axis
number, a closure over a matched ``Value`` where its shape was all it read). Each key must still tell
apart every two closures whose traces differ.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import rulesets
from rewrite import explain
from rewrite.ir.loopstep import bound
from rewrite.rules import builder
from rewrite.rules.builder import _trace_key

F32 = jax.core.ShapedArray((3, 4), jnp.float32)
F32T = jax.core.ShapedArray((4, 5), jnp.float32)


def test_a_bound_dot_general_is_keyed_by_its_dimension_numbers():
    dot = lax.dot_general_p
    params = dict(dimension_numbers=(((1,), (0,)), ((), ())), precision=None, preferred_element_type=np.dtype("float32"),
                  out_sharding=None)
    key = _trace_key(bound(dot, params), (F32, F32T))
    assert key is not None  # five levels down: the key went no deeper than four
    assert key == _trace_key(bound(dot, dict(params)), (F32, F32T))  # a new closure over equal params: one trace
    other = dict(params, preferred_element_type=np.dtype("float64"))
    assert key != _trace_key(bound(dot, other), (F32, F32T))


def test_a_dict_and_a_numpy_scalar_key_a_closure_by_type_and_order():
    def over(params):
        return lambda e: lax.reduce_sum_p.bind(e, **dict(params, axes=(0,)))

    a = _trace_key(over({"axes": (0, 1), "out_sharding": None}), (F32,))
    assert a is not None and a == _trace_key(over({"axes": (0, 1), "out_sharding": None}), (F32,))
    assert a != _trace_key(over({"axes": (1,), "out_sharding": None}), (F32,))
    assert a != _trace_key(over({"out_sharding": None, "axes": (0, 1)}), (F32,))  # order is kept, not judged

    def along(dims):
        return lambda x: lax.broadcast_in_dim(x, (2, 3, 4), dims)

    n = _trace_key(along((np.int64(1), np.int64(2))), (F32,))
    assert n is not None and n == _trace_key(along((np.int64(1), np.int64(2))), (F32,))
    assert n != _trace_key(along((1, 2)), (F32,))  # np.int64(1) is not the int 1
    assert n != _trace_key(along((np.int32(1), np.int32(2))), (F32,))
    assert n != _trace_key(along((np.int64(0), np.int64(2))), (F32,))


def test_hoisting_a_reduction_traces_no_closure_afresh(monkeypatch):
    # rulesets.scan's accumulator init closed over the matched root (a Value) for its shape alone.
    unkeyed = []
    real = builder._trace_key

    def spy(fn, avals):
        key = real(fn, avals)
        if key is None and fn.__code__.co_filename.endswith("scan.py"):
            unkeyed.append(fn.__code__.co_qualname)
        return key

    monkeypatch.setattr(builder, "_trace_key", spy)
    xs, ys = jnp.ones((6, 8, 3)), jnp.ones((6, 8, 3))

    def mse(h0, xs, ys):
        _, out = lax.scan(lambda h, x: (jnp.tanh(h + x), h * x), h0, xs)
        return jnp.mean((out - ys) ** 2)

    report = explain(mse, jnp.zeros((8, 3)), xs, ys, rulesets=[rulesets.scan])
    assert report.fired.get("hoist_reductions")
    assert unkeyed == []
