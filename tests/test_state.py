"""State a rewritten function changes in place: carried out (nnx Variables), the result (an entry of a container
the function returns) or refused (everything else).

Each stateful library is run three ways and compared: the original program,
the rewritten one, and (for nnx) ``nnx.jit`` of the original. Updated state
must match, not only the returned loss: a step that returns the right loss
and leaves its parameters where they were trains nothing.
"""

from typing import NamedTuple

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import rulesets
from rewrite import rewrite
from rewrite import StateError

PACKS = [rulesets.algebra, rulesets.nn]
X = jax.random.normal(jax.random.key(1), (8, 3)) * 2 + 1
Y = jnp.zeros((8, 2))


class Net(nnx.Module):
    """Parameters, batch statistics and a dropout stream: three kinds of Variable a step updates."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.bn(self.lin(x)))))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def train_step(model, optimizer, x, y):  # as flax's nnx docs write it
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def _trained(step, n=3):
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    losses = [float(step(model, opt, X, Y)) for _ in range(n)]
    return losses, {p: v.get_raw_value() for p, v in nnx.to_flat_state(nnx.state((model, opt)))}


def _assert_same_training(got, want):
    (losses, state), (want_losses, want_state) = got, want
    assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    assert state.keys() == want_state.keys()
    for path, v in want_state.items():
        if jnp.issubdtype(v.dtype, jax.dtypes.prng_key):
            v, state[path] = jax.random.key_data(v), jax.random.key_data(state[path])
        assert jnp.allclose(state[path], v, rtol=1e-5, atol=1e-6), path


@pytest.fixture(scope="module")
def eager():
    losses, state = _trained(train_step)
    assert state[(1, "step")] == 3 and len(set(losses)) == 3  # the reference itself trains
    return losses, state


@pytest.mark.parametrize("wrap", [
    lambda f: rewrite(f, rulesets=PACKS),
    lambda f: nnx.jit(rewrite(f, rulesets=PACKS)),
    lambda f: rewrite(nnx.jit(f), rulesets=PACKS),
], ids=["rewrite", "nnx.jit(rewrite)", "rewrite(nnx.jit)"])
def test_nnx_step_updates_carried_out(wrap, eager):
    _assert_same_training(_trained(wrap(train_step)), eager)


def test_nnx_step_strict_and_nnx_jit_agree(eager):
    _assert_same_training(_trained(rewrite(train_step, rulesets=PACKS, strict=True)), eager)
    _assert_same_training(_trained(nnx.jit(train_step)), eager)


def test_nnx_rewritten_loss_inside_grad(eager):
    """The loss rewritten, differentiated by nnx: its batch statistics and dropout count are updated too."""
    f = rewrite(loss_fn, rulesets=PACKS)

    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(f)(model, x, y)
        optimizer.update(model, grads)
        return loss

    _assert_same_training(_trained(step), eager)


def test_nnx_shared_variable_across_arguments():
    """A Variable reached through two arguments is one Variable inside the call, as in nnx.jit."""
    def bump(model, layer, x):
        layer.kernel[...] = layer.kernel[...] + 1.0
        return model(x)

    ref, rw = (Net(nnx.Rngs(0)) for _ in range(2))
    want = nnx.jit(bump)(ref, ref.lin, X)
    got = rewrite(bump)(rw, rw.lin, X)
    assert jnp.allclose(got, want, atol=1e-6)
    assert jnp.allclose(rw.lin.kernel[...], ref.lin.kernel[...])


def test_nnx_structure_change_refused():
    class Grows(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))

        def __call__(self, x):
            self.extra = nnx.BatchStat(x.sum())
            return self.w[...] * x

    with pytest.raises(StateError, match="structure of an nnx module"):
        rewrite(Grows.__call__)(Grows(), jnp.ones(3))


def test_dict_argument_updated_in_place_refused():
    def count(stats, x):
        stats["seen"] = stats["seen"] + x.shape[0]
        return x * 2

    with pytest.raises(StateError, match=r"args\[0\]\['seen'\]"):
        rewrite(count, strict=False)({"seen": jnp.zeros(())}, jnp.ones(3))


def test_an_entry_set_in_a_returned_dict_is_the_result_as_under_jit():
    """A step that sets an entry of a dict it was passed and returns that dict loses nothing: the result holds the
    new value, and ``jax.jit`` leaves the caller's own dict as it was, as the rewritten program does. It was refused
    (blackjax 1.7's SVGD step sets its kernel's ``length_scale`` in the state's dict, and returns the state), while
    an entry set in a dict that is not returned still is (the first test above)."""
    class State(NamedTuple):
        x: jax.Array
        params: dict

    def step(state):
        state.params["scale"] = jnp.median(jnp.abs(state.x)) + state.params["scale"]
        state.params["seen"] = state.params["seen"] + 1
        return State(state.x * state.params["scale"], state.params), jnp.sum(state.x)

    def fresh():
        return State(X, {"scale": jnp.float32(0.5), "seen": jnp.int32(0)})

    want = jax.jit(step)(fresh())
    for run in (rewrite(step, rulesets=PACKS), jax.jit(rewrite(step, rulesets=PACKS))):
        given = fresh()
        got = run(given)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert jnp.allclose(a, b, rtol=1e-6), (a, b)
        assert float(given.params["scale"]) == 0.5 and int(given.params["seen"]) == 0  # as jax.jit leaves it
    batched = jax.vmap(rewrite(step, rulesets=PACKS))(jax.tree.map(lambda a: jnp.stack([a, a]), fresh()))
    assert jnp.allclose(batched[0].params["scale"][1], want[0].params["scale"], rtol=1e-6)

    def value_only(state):  # the value returned, its dict not: the change to the dict would be lost
        state.params["scale"] = state.params["scale"] * 2
        return state.params["scale"]

    with pytest.raises(StateError, match=r"args\[0\]\.params\['scale'\]|args\[0\]\[1\]\['scale'\]"):
        rewrite(value_only)(fresh())


def test_blackjax_svgd_step_rewritten_as_jit_runs_it():
    """blackjax's SVGD with its median heuristic, whose step sets the kernel's bandwidth in place in the state's
    dict and returns the state (its own test, routed through the rewriter, raised StateError)."""
    blackjax = pytest.importorskip("blackjax")
    from blackjax.vi import svgd as svgd_mod
    from jax.scipy import stats

    heuristic = getattr(svgd_mod, "update_median_heuristic", None)
    if heuristic is None:
        pytest.skip("this blackjax has no median heuristic")
    def logp(x):
        return stats.multivariate_normal.logpdf(x, jnp.zeros(2), jnp.eye(2))

    svgd = blackjax.svgd(jax.grad(logp), optax.adam(0.2), svgd_mod.rbf_kernel, heuristic)
    state = svgd.init(jax.random.normal(jax.random.key(0), (50, 2)), {"length_scale": 1.0})
    want, got = jax.jit(svgd.step)(state), jax.jit(rewrite(svgd.step, rulesets=PACKS))(state)
    for _ in range(3):
        want, got = jax.jit(svgd.step)(want), jax.jit(rewrite(svgd.step, rulesets=PACKS))(got)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6), (a, b)


def test_list_argument_grown_in_place_refused():
    def remember(seen, x):
        seen.append(x)
        return x

    with pytest.raises(StateError, match=r"structure of args\[0\] in place"):
        rewrite(remember)([], jnp.ones(3))


def test_static_field_of_a_pytree_argument_changed_refused_by_name():
    """A field a registered pytree keeps as static data (distrax's Jittable keeps every non-array field so),
    changed in place, was reported as an entry added to a dict or list (distrax's jittable_test)."""
    @jax.tree_util.register_pytree_node_class
    class Named:
        def __init__(self, name, data):
            self.name, self.data = name, data

        def tree_flatten(self):
            return (self.data,), self.name

        @classmethod
        def tree_unflatten(cls, name, children):
            return cls(name, children[0])

    def rename(obj, x):
        obj.name += "_x"
        return obj.data * x

    with pytest.raises(StateError, match=r"changed a field of args\[0\] that is not an array"):
        rewrite(rename)(Named("a", jnp.ones(3)), jnp.ones(3))

    def grow(seen, x):
        seen["b"].append(1)
        return x

    with pytest.raises(StateError, match=r"structure of args\[0\]\['b'\] in place"):
        rewrite(grow)({"a": 1.0, "b": []}, jnp.ones(3))


def test_traced_value_stored_into_a_static_object_refused():
    class Acc:  # not a pytree: passed through the trace as it is
        def __init__(self):
            self.total = 0.0

    def accumulate(acc, x):
        acc.total = acc.total + x.sum()
        return x * 2

    acc = Acc()
    with pytest.raises(StateError, match=r"Acc argument>\.total"):
        rewrite(accumulate)(acc, jnp.ones(3))


def test_equinox_batchnorm_state_matches():
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, axis_name="batch", mode="ema")

    def step(bn, state, x):
        out, state = jax.vmap(bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
        return jnp.sum(out ** 2), state

    want = step(bn, state, X)
    got = rewrite(step, rulesets=PACKS)(bn, state, X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)
    # the running statistics did move: the comparison is not of two untouched states
    assert not all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(state)))


def test_linen_mutable_collection_matches():
    class Model(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.BatchNorm(use_running_average=False)(linen.Dense(4)(x))

    model = Model()
    variables = model.init(jax.random.key(0), X)

    def step(variables, x):
        out, updates = model.apply(variables, x, mutable=["batch_stats"])
        return jnp.sum(out ** 2), updates

    want = step(variables, X)
    got = rewrite(step, rulesets=PACKS)(variables, X)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not jnp.allclose(got[1]["batch_stats"]["BatchNorm_0"]["mean"], 0.0)
