"""The compatibility layer over JAX (rewrite/ir/jaxapi.py): both scan layouts, the protocols it probes, and a clear error naming the version on a JAX whose equations it does not know."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rewrite
from rewrite.ir import jaxapi


def _scan_params():
    f = lambda c, x: jax.lax.scan(lambda c, x: (c + x, c * x), c, x)  # noqa: E731
    return jax.make_jaxpr(f)(0.0, jnp.ones(3)).eqns[0].params


def test_scan_counts_read_the_running_jax_layout_and_round_trip():
    params = _scan_params()
    assert jaxapi.scan_counts(params) == (0, 1)
    counted = jaxapi.scan_counted(params)
    assert (counted["num_consts"], counted["num_carry"]) == (0, 1)
    assert "ft_in" not in counted and "ft_out" not in counted
    back = jaxapi.scan_for_jax(counted)
    assert sorted(back) == sorted(params)
    assert jaxapi.scan_counts(back) == (0, 1)


def test_an_unknown_scan_layout_names_the_jax_version():
    params = {k: v for k, v in _scan_params().items() if k not in ("num_consts", "num_carry", "ft_in", "ft_out")}
    params["groups_in"] = (0, 1, 1)  # a layout no JAX this project knows uses
    with pytest.raises(jaxapi.UnsupportedJax, match=f"jax {jax.__version__}: scan's params"):
        jaxapi.scan_counts(params)


def test_loading_a_scan_of_an_unknown_layout_fails_clearly(monkeypatch):
    def f(c, x):
        return jax.lax.scan(lambda c, x: (c + x, c * x), c, x)

    monkeypatch.setattr(jaxapi, "scan_counts", lambda p: (_ for _ in ()).throw(jaxapi._unknown("scan's", p)))
    from rewrite.ir import primitives
    monkeypatch.setattr(primitives, "scan_counts", jaxapi.scan_counts)
    with pytest.raises(jaxapi.UnsupportedJax, match=jax.__version__):
        rewrite.rewrite(f, rulesets=[])(0.0, jnp.ones(3))


@pytest.mark.parametrize("prim, param", [("while", "body_jaxpr"), ("cond", "branches"), ("scan", "jaxpr")])
def test_an_equation_without_a_param_the_loader_reads_names_the_jax_version(prim, param):
    """A JAX whose equations hold their bodies under other names (as a newer one may): loading fails with an
    ``UnsupportedJax`` naming the version and the primitive, never with a ``KeyError`` from inside the loader."""
    from rewrite.cost.model import AnalyticCost
    from rewrite.pipeline import run_pipeline
    from rewrite.records import Limits

    def f(x):
        y = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[1]
        y = jax.lax.cond(y.sum() > 0, jnp.sin, jnp.cos, y)
        return jax.lax.scan(lambda c, xi: (c + xi, c), 0.0, y)

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    eqns = [e.replace(params={(k + "_renamed" if k == param else k): v for k, v in e.params.items()})
            if e.primitive.name == prim else e for e in closed.jaxpr.eqns]
    renamed = closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns))
    assert [e.primitive.name for e in renamed.jaxpr.eqns if param + "_renamed" in e.params] == [prim]
    with pytest.raises(jaxapi.UnsupportedJax, match=rf"jax {jax.__version__}: a '{prim}' equation .*'{param}'"):
        run_pipeline(renamed, (), AnalyticCost(), Limits())
    run_pipeline(closed, (), AnalyticCost(), Limits())  # the program as this JAX traced it loads


def test_the_linearization_probe_leaves_nothing_in_a_trace_it_runs_under():
    jaxapi._linearization_arity.cache_clear()
    closed = jax.make_jaxpr(lambda x: x * jaxapi._linearization_arity())(1.0)
    assert [e.primitive.name for e in closed.eqns] == ["mul"]
    assert jaxapi._linearization_arity() in (4, 5)


def test_neutral_params_are_the_same_on_every_jax_and_go_back_to_the_running_jax_s():
    closed = jax.make_jaxpr(lambda x: (x.max(0), jax.lax.scan(lambda c, y: (c + y, c), 0.0, x)))(jnp.ones(3))
    by_name = {e.primitive.name: e.params for e in closed.eqns}
    for name, params in by_name.items():
        neutral = jaxapi.neutral_params(name, params)
        assert "ft_in" not in neutral and "ft_out" not in neutral
        assert "out_sharding" not in neutral or name != "reduce_max"  # jax 0.10's reduce_max has none
        back = jaxapi.params_for_jax(name, neutral)
        assert sorted(back) == sorted(params)
    assert sorted(jaxapi.neutral_params("reduce_max", by_name["reduce_max"])) == ["axes"]
    assert (jaxapi.neutral_params("scan", by_name["scan"])["num_consts"],
            jaxapi.neutral_params("scan", by_name["scan"])["num_carry"]) == (0, 1)


def test_a_scan_jax_built_keeps_its_own_flat_trees_through_the_kept_params():
    """The scans of JAX's own derivative of a scan hold flat trees of other shapes (filtered, pytree groups) than
    ``scan_for_jax`` builds on jax 0.11+: the loader and the cache keep them, so the scan comes back as it was."""
    def f(x, w):
        return jax.lax.scan(lambda c, xi: (jnp.sin(c * w + xi), c * 2.0), x[0], x)[1].sum()

    closed = jax.make_jaxpr(jax.grad(f))(jnp.ones((4, 3)), jnp.ones(3))
    scans = [e.params for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    assert scans
    for params in scans:
        kept = jaxapi.scan_kept(params)
        assert jaxapi.scan_counts(kept) == jaxapi.scan_counts(params)
        back = jaxapi.params_for_jax("scan", kept)
        assert sorted(back) == sorted(params)
        assert all(back[k] == params[k] for k in params if k != "jaxpr"), sorted(params)
        assert jaxapi.SCAN_TREES not in jaxapi.neutral_params("scan", params)  # printing and hashing: counts only


def test_a_custom_vjp_bwd_is_called_and_rebuilt_in_the_running_jax_s_protocol():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (3.0 * c * g,))
    params = jax.make_jaxpr(f)(1.0).eqns[0].params
    params["fwd_jaxpr_thunk"].call_wrapped(True)
    assert [float(c) for c in jaxapi.call_custom_vjp_bwd(params["bwd"], 2.0, 5.0)] == [30.0]
    rebuilt = jaxapi.custom_vjp_bwd(lambda r, g: [r * g])
    out = rebuilt(2.0, 5.0)
    assert (out[0] if isinstance(out, tuple) else out) == [10.0]


def test_the_carry_checkpoint_policy_prints_the_same_on_every_jax_and_saves_only_its_names():
    policy = jaxapi.save_only_these_names("_rw_carry")
    assert repr(policy) == "SaveOnlyTheseNames(saveable_names=frozenset({'_rw_carry'}))"
    name_p = jaxapi._ad_checkpoint.name_p
    assert policy(name_p, 1.0, name="_rw_carry") is True
    assert policy(name_p, 1.0, name="other") is False
    assert policy(jax.lax.sin_p, 1.0) is False
    from jax.ad_checkpoint import checkpoint_name

    def f(x):
        return jnp.sin(checkpoint_name(jnp.sin(x), "_rw_carry") * jnp.sin(x))

    g = jax.grad(jax.checkpoint(f, policy=policy))
    assert float(g(0.5)) == pytest.approx(float(jax.grad(f)(0.5)))


# ---------------------------------------------------------------------- recorded programs from each JAX
# Programs traced on each supported JAX, recorded as text under tests/data/jaxprs/: ``<name>.raw.jax-X.Y.txt``
# as that JAX prints them, ``<name>.jax-X.Y.txt`` through the neutral params (what golden files and the
# cache use). Every JAX must print each program neutrally as every recorded version did; the raw texts show
# what the layer hides. Record on a new JAX with ``python -m tests.test_jaxapi_compat``.
from pathlib import Path  # noqa: E402

RECORDED = Path(__file__).resolve().parent / "data" / "jaxprs"


def _recorded_programs():
    def loop(x, w):  # a scan with a const, a carry and stacked outputs; a reduce_max that 0.11 gave a param
        c, ys = jax.lax.scan(lambda c, xi: (c + xi @ w, c.max()), jnp.zeros(3), x)
        return c, ys, x.max(1), x.min(0)

    def checkpointed(x):  # the carry checkpoint policy the emitter builds, inside a scan
        body = jax.checkpoint(lambda c, xi: (jnp.sin(c) * xi, c), prevent_cse=False,
                              policy=jaxapi.save_only_these_names("_rw_carry"))
        return jax.lax.scan(body, x[0], x)

    def while_cond(x, w):  # a while with a const in its body, a cond whose branch closes over one
        n, y = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1]) * w), (0, x))
        return jax.lax.cond(y.sum() > 0, lambda v: v * w, jnp.cos, y)

    def customs(x):  # a custom_jvp and a custom_vjp call
        return _clipped_vjp(_softplus_jvp(x) * 2.0)

    def calls(x):  # a nested jit, and an inline=True one (inlined on jax 0.10, a call on 0.11+)
        y = jax.jit(lambda y: jnp.tanh(y) + 1.0, inline=True)(x)
        return jax.jit(lambda z: z * 3.0)(y)

    def sharded(x):  # a shard_map body with a Python int literal (pvary and a convert on jax 0.11+)
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
        spec = jax.sharding.PartitionSpec("data")
        return jax.shard_map(lambda b: b * 2 + 1, mesh=mesh, in_specs=spec, out_specs=spec)(x)

    return {"scan_consts_carry_ys": (loop, (jnp.ones((4, 3)), jnp.ones((3, 3)))),
            "scan_checkpointed": (checkpointed, (jnp.ones((5, 2)),)),
            "while_cond": (while_cond, (jnp.ones(3), jnp.full(3, 0.5))),
            "custom_jvp_vjp": (customs, (jnp.linspace(-2.0, 2.0, 5),)),
            "nested_jits": (calls, (jnp.linspace(-1.0, 1.0, 4),)),
            "shard_map_literal": (sharded, (jnp.arange(4.0),))}


@jax.custom_jvp
def _softplus_jvp(x):
    return jnp.logaddexp(x, 0.0)


_softplus_jvp.defjvp(lambda primals, tangents: (_softplus_jvp(primals[0]), jax.nn.sigmoid(primals[0]) * tangents[0]))


@jax.custom_vjp
def _clipped_vjp(x):
    return x


_clipped_vjp.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))


def _texts(name):
    from tests.golden import _jaxpr_text

    fn, args = _recorded_programs()[name]
    closed = jax.make_jaxpr(fn)(*args)
    return _jaxpr_text(closed), str(closed)


@pytest.mark.parametrize("name", sorted(_recorded_programs()))
def test_the_neutral_jaxpr_prints_as_every_recorded_jax_printed_the_program(name):
    """``neutral_jaxpr`` (explain's diff, the decisions' program keys) rebuilds the program, its bodies too, with
    the neutral params: it prints as the recorded neutral texts of every JAX."""
    fn, args = _recorded_programs()[name]
    text = str(jaxapi.neutral_jaxpr(jax.make_jaxpr(fn)(*args)))
    for version, recorded in _recorded(name, "").items():
        if name in TRACED_OTHERWISE and version != _version_tag():
            continue
        assert text == recorded, f"{name}: neutral_jaxpr on jax {jax.__version__} prints otherwise than {version}'s"


def _version_tag():
    return "jax-" + ".".join(jax.__version__.split(".")[:2])


def record():
    RECORDED.mkdir(parents=True, exist_ok=True)
    for name in _recorded_programs():
        neutral, raw = _texts(name)
        (RECORDED / f"{name}.{_version_tag()}.txt").write_text(neutral + "\n")
        (RECORDED / f"{name}.raw.{_version_tag()}.txt").write_text(raw + "\n")


def _recorded(name, kind):
    import re

    pattern = re.compile(rf"^{re.escape(name)}{kind}\.(jax-\d+\.\d+)\.txt$")
    return {m[1]: p.read_text().rstrip("\n") for p in RECORDED.glob(f"{name}*.txt") if (m := pattern.match(p.name))}


#: Programs that JAX 0.11 and 0.12 trace otherwise than 0.10 (not only print otherwise): ``inline=True`` jits stay
#: calls from 0.11; a Python int literal in a shard_map body is an ``i32`` under ``pvary`` and a conversion from
#: 0.12 (``f32`` before). Each version's neutral text is its own.
TRACED_OTHERWISE = {"nested_jits", "shard_map_literal"}


@pytest.mark.parametrize("name", sorted(_recorded_programs()))
def test_a_program_prints_neutrally_as_every_recorded_jax_printed_it(name):
    neutral, raw = _texts(name)
    recorded, raws = _recorded(name, ""), _recorded(name, r"\.raw")
    assert {"jax-0.10", "jax-0.11", "jax-0.12"} <= recorded.keys() == raws.keys()
    if _version_tag() in raws:  # the running JAX prints as it did when recorded
        assert (neutral, raw) == (recorded[_version_tag()], raws[_version_tag()])
    if name in TRACED_OTHERWISE:
        assert len(set(recorded.values())) > 1  # the versions' programs differ, and each prints as its own
        return
    for version, text in recorded.items():
        assert neutral == text, f"{name}: the neutral print on jax {jax.__version__} differs from {version}'s"
    # the layer is not idle where the versions' own prints differ
    assert len(set(raws.values())) > 1 or not name.startswith("scan")


@pytest.mark.parametrize("name", sorted(_recorded_programs()))
def test_the_loader_reads_each_recorded_program_and_emits_it_back(name):
    """Each recorded program, as the running JAX traces it, loads, computes what the original does under jit
    after a rewrite with no rules, and comes back out unchanged where the emitter keeps its forms; on a JAX whose
    equations it does not know, loading raises ``UnsupportedJax`` naming the version (the test above)."""
    from rewrite.cost.model import AnalyticCost
    from rewrite.pipeline import run_pipeline
    from rewrite.records import Limits
    from tests.golden import _jaxpr_text

    fn, args = _recorded_programs()[name]
    closed = jax.make_jaxpr(fn)(*args)
    result = run_pipeline(closed, (), AnalyticCost(), Limits())
    got = jax.jit(jax.extend.core.jaxpr_as_fun(result.after))(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(fn)(*args))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if name not in EMITTED_OWN_WAY:
        assert _jaxpr_text(result.after) == _jaxpr_text(closed)


#: Programs the emitter writes back in its own forms even with no rules (a nested jit inlined, a checkpoint and
#: a custom derivative's call rebuilt), so that only their values are compared.
EMITTED_OWN_WAY = {"custom_jvp_vjp", "nested_jits", "scan_checkpointed"}


if __name__ == "__main__":
    record()


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.float32, np.float16, jnp.bfloat16, np.bool_, np.uint8])
def test_a_constant_array_is_the_array_jnp_asarray_makes_and_compiles_nothing(dtype):
    """An emitted program's constants are made by ``constant_array``: the array ``jnp.asarray`` makes (its dtype
    canonical, not weak, uncommitted, on no mesh), also while a trace is open, without the XLA compile of a
    conversion that ``jnp.asarray`` asks for per shape and dtype (8-30 ms each in a first call)."""
    from .rewritten import compiles_during

    a = (np.arange(42) % 3).reshape(7, 3, 2).astype(dtype)  # a shape no other test converts
    inside = []

    def both():
        jax.make_jaxpr(lambda x: inside.append(jaxapi.constant_array(a)) or x)(1.0)
        return jaxapi.constant_array(a)

    made, compiles = compiles_during(both)
    assert compiles == 0
    want = jnp.asarray(a)
    for got in (made, inside[0]):
        assert isinstance(got, jax.Array)  # (concrete: np.asarray below reads it)
        assert jax.typeof(got) == jax.typeof(want) and got.weak_type == want.weak_type is False
        assert not got.committed
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
