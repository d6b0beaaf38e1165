"""A VJP's residual search prices its trials move by move (``rewrite/grad/splits.py``): each of a split's three
programs kept live (``rewrite.cost.live.LiveFusion``, whose outputs may change between edits), at the whole
programs' prices."""

import jax
import jax.numpy as jnp
import pytest

from rewrite import rewrite
from rewrite.cost.model import AnalyticCost
from rewrite.cost.program import Program
from rulesets.algebra import algebra
from rulesets.derivatives import derivatives


def test_a_live_program_whose_outputs_change_is_priced_as_the_whole_program_with_them():
    """An edit that changes only the outputs (an intermediate array becomes one, then stops being one) re-places
    and re-prices what holding it changes: the live price is the whole price of the program with those outputs,
    and differs from the one without (the array is written out, and not a temporary)."""
    from rewrite.cost.live import LiveFusion

    x = jnp.ones((256, 512))

    def fn(x):
        y = jnp.exp(x) * 2.0
        return jnp.sum(jnp.tanh(y) * y, axis=1), y

    model = AnalyticCost()
    fm = model.fusion_model()
    prog = Program.from_jaxpr(jax.make_jaxpr(fn)(x), model)
    total, mid = prog.outputs
    alone = Program(prog.ops, [total])
    live = LiveFusion(fm, alone.outputs)
    live.edit(dict(enumerate(prog.ops)))
    assert live.price() == pytest.approx(fm(alone), rel=1e-12)
    live.edit({}, [total, mid])
    assert live.price() == pytest.approx(fm(prog), rel=1e-12)
    assert fm(prog) != pytest.approx(fm(alone), rel=1e-6)
    live.edit({}, [total])
    assert live.price() == pytest.approx(fm(alone), rel=1e-12)


@pytest.mark.parametrize("packs", [[derivatives], [algebra, derivatives]], ids=["derivatives", "algebra"])
def test_the_residual_search_s_trials_priced_live_are_priced_as_whole(monkeypatch, packs):
    """Every greedy trial of ``choose_residuals`` is priced live (``split_pricer``'s ``live``) at the price the
    three programs have whole, so the search takes the splits it took when it priced each whole."""
    import rewrite.grad.vjp as vjp

    made = []
    pricer = vjp.split_pricer

    def spied(*args, **kwargs):
        price = pricer(*args, **kwargs)
        live = price.live

        def checked(residuals):
            got = live(residuals)
            made.append((got, price(residuals)))
            return got

        price.live = checked
        return price

    monkeypatch.setattr(vjp, "split_pricer", spied)

    def mlp(w1, w2, x):
        h = jnp.tanh(x @ w1)
        return jnp.sum(jnp.sin(h @ w2) ** 2)

    key = jax.random.PRNGKey(0)
    w1, w2, x = (jax.random.normal(k, s) for k, s in zip(jax.random.split(key, 3), [(64, 128), (128, 32), (16, 64)]))
    built = rewrite(mlp, rulesets=packs, cache=False).grad_result(w1, w2, x)
    assert built is not None and made, "the search tried no split past the first two"
    for got, whole in made:
        assert got == pytest.approx(whole, rel=1e-12)
