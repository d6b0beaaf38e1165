"""The interning tables' shortcuts give the ids interning afresh gives."""

import jax
import numpy as np
from jax import lax

from rewrite.ir import intern as _intern


def test_a_params_dict_interned_again_is_frozen_once(monkeypatch):
    """An equation's params are interned again and again (each load, each price); a dict of settled values is
    keyed once, and gives the id a fresh key gives."""
    table = _intern.ParamTable()
    frozen = []
    real = _intern._freeze
    monkeypatch.setattr(_intern, "_freeze", lambda v: (isinstance(v, dict) and frozen.append(v)) or real(v))
    params = {"dimension_numbers": (((1,), (0,)), ((), ())), "precision": None, "preferred_element_type": None}
    first = table.intern_params(lax.dot_general_p, params)
    assert table.intern_params(lax.dot_general_p, params) == first
    assert len(frozen) == 1
    assert table.intern_params(lax.dot_general_p, dict(params)) == first  # an equal dict: frozen, the same id
    assert len(frozen) == 2


def test_a_params_dict_changed_or_unsettled_is_frozen_again(monkeypatch):
    """A kept key is read only while the dict holds the same objects, and only for values that cannot change."""
    table = _intern.ParamTable()
    params = {"axes": (0,), "out_sharding": None}
    first = table.intern_params(lax.reduce_sum_p, params)
    params["axes"] = (1,)  # rebound: a new key
    second = table.intern_params(lax.reduce_sum_p, params)
    assert second != first and table.params(second)["axes"] == (1,)
    assert table.intern_params(lax.reduce_sum_p, {"axes": (1,), "out_sharding": None}) == second
    del params["out_sharding"]  # a key gone: a new key
    assert table.intern_params(lax.reduce_sum_p, params) not in (first, second)
    listed = {"sizes": [2, 3]}  # a list can change in place: never kept
    one = table.intern_params(lax.reshape_p, listed)
    listed["sizes"].append(4)
    assert table.intern_params(lax.reshape_p, listed) != one
    assert id(listed) not in table._frozen


def test_settled_values_are_those_that_cannot_change():
    assert all(_intern._settled(v) for v in (None, 1, 2.0, True, "x", np.float32(1), np.dtype("float32"),
                                              lax.Precision.HIGHEST, ((1,), (0,)), ()))
    assert not any(_intern._settled(v) for v in ([1], {"a": 1}, np.zeros(2), ((1,), [0]), jax.numpy.float32))


def test_the_kept_keys_are_bounded(monkeypatch):
    table = _intern.ParamTable()
    monkeypatch.setattr(table, "kept", 4)
    dicts = [{"y": i} for i in range(10)]
    ids = [table.intern_params(lax.integer_pow_p, d) for d in dicts]
    assert len(table._frozen) <= 4
    assert [table.intern_params(lax.integer_pow_p, d) for d in dicts] == ids


def test_the_fast_keys_are_the_general_ones():
    """``_freeze`` keys the common params values (``None``, strings, shapes, Python scalars, dicts with string keys)
    by their exact type; the key is the one the general path (``_freeze_any``) gives, so equal params get equal ids
    and unequal ones do not, as before the shortcut."""
    values = [None, "x", (), [], (1, 2), [1, 2], (1, True), (1.0, -0.0), ((1,), (0,)), ((1,), [0]), 0.0, -0.0,
              float("nan"), 1, True, False, 2**70, {"b": (1,), "a": None}, {"a": {"c": 1.0}}, {1: 2, "1": 3},
              (np.float32(1), 2), {"p": lax.Precision.HIGHEST, "t": np.dtype("float32")}, (np.zeros(2),),
              {"a": [1]}, {"a": [{1}]}, ([None, "y"], {"k": (0,)}), lax.GatherDimensionNumbers((1,), (0,), (0,))]
    for v in values:
        fast, general = _intern._freeze(v), _intern._freeze_any(v)
        assert (fast is general is _intern._IDENTITY) or (fast == general and type(fast) is type(general)), v
    assert _intern._freeze({"a": [{1, 2}]}) is _intern._IDENTITY  # a set: no key, identity
    assert _intern._freeze((1, 2)) != _intern._freeze([1, 2]) != _intern._freeze((1, True))
    assert _intern._freeze(0.0) != _intern._freeze(-0.0) and _intern._freeze(1) != _intern._freeze(True)


def test_hijax_primitive_objects_are_keyed_by_the_types_they_were_made_for():
    """A ``call_hi_primitive`` equation's ``_prim`` is interned by its class, params and types (JAX's equality leaves
    the types out): searches for queries of two shapes get two ids, each giving back its own object; one made
    again for the same types (another trace) gets the same id; one that holds more than those is kept apart."""
    import pytest
    hijax = pytest.importorskip("jax._src.numpy.hijax")
    if not hasattr(hijax, "searchsorted"):
        pytest.skip("this JAX has no hijax searchsorted")
    x = jax.numpy.arange(10.0)

    def eqn(q):
        (e,) = [e for e in jax.make_jaxpr(hijax.searchsorted)(x, q).jaxpr.eqns if "_prim" in e.params]
        return e

    scalar, vector, again = eqn(np.float32(1.5)), eqn(np.ones(2, np.float32)), eqn(np.float32(2.5))
    assert scalar.params["_prim"] == vector.params["_prim"]  # JAX's own equality: why keying by it was wrong
    table = _intern.ParamTable()
    ids = [table.intern_params(e.primitive, e.params) for e in (scalar, vector, again)]
    assert ids[0] != ids[1] and ids[0] == ids[2]
    assert table.params(ids[1])["_prim"].out_aval.shape == (2,)
    assert table.params(ids[0])["_prim"].out_aval.shape == ()
    more = eqn(np.float32(3.5))
    more.params["_prim"].extra = object()  # state beyond params and types: by identity only
    assert table.intern_params(more.primitive, more.params) not in ids
