"""What the LM head's procedures work out once: a normaliser's shift read from its text where that says its kind
(``rulesets.nn_lm_head._shift_kind``, the answer the probe ``rulesets.nn_lm_head_kernels.shift_kind`` gives), and
a token loop built once per saturation for a match found again."""

import collections

import jax
import jax.numpy as jnp
import pytest

import rulesets
from rewrite import explain
from rewrite.cache.fingerprint import Memo
from rewrite.ir.jaxapi import core
from rulesets import nn_lm_head as pack
from rewrite.rules import saturate
from rulesets import nn_lm_head_kernels as kernels
from rulesets.nn_lm_head_kernels import shift_kind

from .test_time_limits import _compiles


def _read_back(f, shape, dtype):
    """``f`` as ``Match.function`` hands it to the rules: a function of its jaxpr, which it carries."""
    closed = jax.make_jaxpr(lambda m: [f(m)])(jax.ShapeDtypeStruct(shape, dtype))
    fn = core.jaxpr_as_fun(closed)
    fn.jaxpr = closed
    return fn


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(12,), (3, 4), (1, 9)])
def test_each_known_shift_is_the_kind_the_probe_finds(shape, dtype):
    """The table ``known_shift_kind`` reads is the probe's answer: each of ``_FINITE_SHIFTS`` probes as ``"finite"``."""
    for f in kernels._FINITE_SHIFTS:
        assert shift_kind(lambda m, f=f: (f(m),), shape, dtype) == "finite"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logsumexp_s_shift_is_read_without_a_compile(monkeypatch, dtype):
    """``jax.nn.logsumexp``'s shift (as flax_lm_step's loss holds it) is known by its text: the rules read its kind
    without compiling the probe (85-110 ms of CPU per program), and answer as the probe does; another shift is
    probed."""
    monkeypatch.setattr(pack, "_KINDS", Memo("a fresh _KINDS"))
    shape = (4, 32)
    fn = _read_back(lambda m: jax.lax.stop_gradient(kernels._unit(m)), shape, dtype)  # log_softmax's: probed
    count, kind = _compiles(lambda: pack._shift_kind(fn, shape, dtype))
    assert (count, kind) == (1, "max")
    fn = _read_back(kernels._FINITE_SHIFTS[0], shape, dtype)
    assert "max -inf" in str(fn.jaxpr) and "is_finite" in str(fn.jaxpr)
    count, kind = _compiles(lambda: pack._shift_kind(fn, shape, dtype))
    assert (count, kind) == (0, "finite")
    assert kind == shift_kind(fn, shape, dtype)


def test_a_dtype_without_infinities_is_probed(monkeypatch):
    """In ``float8_e4m3fn`` the guard ``max(-inf, .)`` is NaN, and the probe says the shift is no known kind: the
    text alone is not read there."""
    monkeypatch.setattr(pack, "_KINDS", Memo("a fresh _KINDS"))
    dtype, shape = jnp.float8_e4m3fn, (12,)
    fn = _read_back(kernels._FINITE_SHIFTS[0], shape, dtype)
    assert kernels.known_shift_kind(str(fn.jaxpr.jaxpr), shape, dtype) is None
    assert pack._shift_kind(fn, shape, dtype) is None


def _loss(h, w, b, y):
    logits = h @ w + b
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0])


def _loops_built(monkeypatch, twice: bool):
    """The token loops the LM head traces (by block) rewriting ``_loss``, and the rules' firings; ``twice``: each
    of its loop rules acts on each match a second time, as on a match found again after a merge."""
    monkeypatch.undo()  # (a second call wraps the originals again, not the first call's wrappers)
    built = collections.Counter()
    real = pack.blocked_loss

    def counting(**kw):  # the kernel, counted where it is traced
        kernel = real(**kw)

        def traced(*args):
            built[kw["block"]] += 1
            return kernel(*args)

        return traced

    monkeypatch.setattr(pack, "blocked_loss", counting)
    run = saturate.Engine._run_procedure

    def again(self, m, stats):
        settled = run(self, m, stats)
        return run(self, m, stats) if twice and m.rule.name.startswith("nn_lm_head_lse") else settled

    monkeypatch.setattr(saturate.Engine, "_run_procedure", again)
    n, c, v = 1024, 16, 64
    args = (jnp.ones((n, c)), jnp.ones((c, v)), jnp.ones((v,)), jnp.zeros((n,), jnp.int32))
    report = explain(_loss, *args, rulesets=[rulesets.nn])
    return dict(built), {k: f for k, f in report.fired.items() if k.startswith("nn_lm_head")}


def test_a_match_found_again_reuses_its_loop(monkeypatch):
    """A loop rule acting again on a match in one saturation (flax_lm_step's normaliser is found anew in the third
    iteration, its classes merged) reuses the loop it built: no second trace, no copy in the e-graph (the base
    traced and inserted each of its three loops again, 13-20 ms of CPU in each heavy step)."""
    once = _loops_built(monkeypatch, twice=False)
    assert once[0] == {256: 2, 128: 2, 512: 2}, once  # the normaliser's loop and the label's, per block
    assert _loops_built(monkeypatch, twice=True) == once


def _stacks(jaxpr, out):
    """Each equation's primitive and name stack, bodies too (the loader marks a loop laid out by its stack)."""
    for e in jaxpr.eqns:
        out.append((e.primitive.name, str(e.source_info.name_stack)))
        for sub in core.jaxprs_in_params(e.params):
            _stacks(sub, out)
    return out


@pytest.mark.parametrize("label", [False, True])
def test_the_token_loop_s_forward_is_traced_once_and_its_joint_programs_are_as_traced(monkeypatch, label):
    """The kernel's forward is traced once, for its call, and replayed for the ``fwd`` JAX traces at each joint
    program (``rulesets/kernels/replay.py``); a joint program, equations and name stacks, is the one tracing the
    forward there gives (the rewrite's emitted programs must stay byte for byte)."""
    from rulesets.kernels import replay

    n, c, v = 256, 8, 64
    reads = kernels.Reads(shift="finite", log=True, label=label)
    layout = kernels.Layout((0, 1), (0, 1), (n,), c, v, True)
    y = jnp.arange(n, dtype=jnp.int32) % v
    ops = (jax.random.normal(jax.random.key(0), (n, c)), jax.random.normal(jax.random.key(1), (c, v)), jnp.ones(v))

    def joint(loss):
        def run(h, w, b):
            out, pull = jax.vjp(lambda *a: loss(*a, y if label else None).normaliser, h, w, b)
            return out, pull(jnp.ones_like(out))
        made = jax.make_jaxpr(run)(*ops)
        return str(made), _stacks(made.jaxpr, [])

    traced = []  # the forward's traces (``stats_of``), not the token loop's block traces inside them
    made_trace = replay._traced
    monkeypatch.setattr(replay, "_traced", lambda fn, tree, avals: (fn.__name__ == "stats_of" and traced.append(fn))
                        or made_trace(fn, tree, avals))
    monkeypatch.setattr(replay, "_shared", {})  # (not traced by an earlier test)
    loss = kernels.blocked_loss(layout=layout, block=128, reads=reads)
    first, second = joint(loss), joint(loss)
    assert first == second
    assert len(traced) == 1  # the forward, once (JAX traces the backward once a joint, as before)
    monkeypatch.setattr(kernels, "replayed", lambda fn, key=None: fn)  # each traced where JAX calls it
    assert joint(kernels.blocked_loss(layout=layout, block=128, reads=reads)) == first


_LOOP_READS = {"plain": kernels.Reads(shift="max", log=False),
               "label": kernels.Reads(shift="finite", label=True, fills=True, fill=-1.0),
               "target": kernels.Reads(shift="finite", target=True)}


@pytest.mark.parametrize("reads", sorted(_LOOP_READS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype,cast", [("bfloat16", None), ("bfloat16", "float32"), ("float16", None),
                                        ("float32", None), ("float64", None)])
def test_the_token_loop_s_body_is_its_block_traced_there(monkeypatch, reads, bias, dtype, cast):
    """The token loop (``_block_loop``) traces a block's stats once, for its carry's types, and replays that trace
    as the loop's body (``rulesets.kernels.replay.traced_once``): its program, equations, types and name stacks, is the one that
    ``jax.eval_shape`` for the types and a trace of the stats in the body give (the rewrite's emitted programs must
    stay byte for byte), over dtypes, casts, a bias or none, and the label's and a dense target's reads."""
    n, c, v = 64, 8, 16
    layout = kernels.Layout((1, 0), (0, 1), (n,), c, v, bias, cast)
    keys = jax.random.split(jax.random.key(0), 4)

    def program():
        with jax.enable_x64(dtype == "float64"):
            h = jax.random.normal(keys[0], (c, n), dtype)
            w = jax.random.normal(keys[1], (c, v), dtype)
            b = jax.random.normal(keys[2], (v,), dtype) if bias else None
            y = jnp.arange(n, dtype=jnp.int8) % (v + 2) - 1
            t = jax.random.normal(keys[3], (n, v), jnp.float32)
            run = lambda *a: kernels.blocked_forward(*a, layout=layout, block=16, reads=_LOOP_READS[reads],  # noqa: E731
                                                     tile=v)
            with jax.named_scope("head"):
                made = jax.make_jaxpr(run)(h, w, b, y, t)
            return str(made), _stacks(made.jaxpr, [])

    replayed = program()
    assert "scan[" in replayed[0]
    monkeypatch.setattr(kernels, "traced_once", lambda fn, *args: (jax.eval_shape(fn, *args), fn))
    assert replayed == program()


def _forward_programs(loss, ops):
    """The forward program of ``loss``'s custom_vjp (its ``call_jaxpr``: text and name stacks) at ``ops``."""
    made = jax.make_jaxpr(loss)(*ops)
    (eqn,) = [e for e in made.jaxpr.eqns if e.primitive.name == "custom_vjp_call"]
    return str(eqn.params["call_jaxpr"]), _stacks(eqn.params["call_jaxpr"].jaxpr, [])


@pytest.mark.parametrize("label", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab", [kernels.TILE // 2, 2 * kernels.TILE])
def test_a_forward_that_reads_no_block_is_traced_once_for_every_block(monkeypatch, label, dtype, vocab):
    """Where the forward computes the logits by vocabulary tiles it reads the block only through its rows
    (``forward_rows``): the losses of every block share one trace of it (``replayed``'s key), and each block's
    forward program, equations and name stacks, is what tracing ``blocked_forward`` at that block gives (the
    rewrite's emitted programs must stay byte for byte). Where it loops over token blocks (``vocab`` within a tile),
    each block is its own program and trace."""
    from rulesets.kernels import replay

    n, c = 256, 8
    reads = kernels.Reads(shift="finite", log=True, label=label, fills=label)
    layout = kernels.Layout((0, 1), (0, 1), (n,), c, vocab, True)
    y = jnp.arange(n, dtype=jnp.int32) % vocab if label else None
    keys = jax.random.split(jax.random.key(0), 3)
    ops = (jax.random.normal(keys[0], (n, c), dtype), jax.random.normal(keys[1], (c, vocab), dtype),
           jax.random.normal(keys[2], (vocab,), dtype), y)
    traced = []  # the forward's traces (``stats_of``), not the token loop's block traces inside them
    made_trace = replay._traced
    monkeypatch.setattr(replay, "_traced", lambda fn, tree, avals: (fn.__name__ == "stats_of" and traced.append(fn))
                        or made_trace(fn, tree, avals))
    monkeypatch.setattr(replay, "_shared", {})
    blocks = (32, 64, 128)
    for block in blocks:
        got = _forward_programs(kernels.blocked_loss(layout=layout, block=block, reads=reads), ops)
        plain = lambda *a, block=block: tuple(kernels.blocked_forward(*a, layout=layout, block=block,  # noqa: E731
                                                                      reads=reads))
        made = jax.make_jaxpr(plain)(*ops)
        assert got == (str(made), _stacks(made.jaxpr, []))
    assert len(traced) == (1 if vocab > kernels.TILE else len(blocks))


def test_the_shared_forward_traces_leave_the_pack_s_disk_cache_key_alone():
    """The forward traces that blocks share (``rulesets.kernels.replay._shared``, reached by the pack's rules through
    ``blocked_loss``) are a memo that the disk cache's key names, never walks: a rule's key is the same before and
    after the process traced a forward."""
    from rewrite.cache.fingerprint import fingerprint

    before = fingerprint((kernels.blocked_loss, pack.lm_head_rules))
    n, c, v = 64, 5, 3 * kernels.TILE  # a layout no other test traces: a new trace kept
    layout = kernels.Layout((0, 1), (0, 1), (n,), c, v)
    loss = kernels.blocked_loss(layout=layout, block=32, reads=kernels.Reads())
    jax.make_jaxpr(loss)(jnp.ones((n, c)), jnp.ones((c, v)))
    assert fingerprint((kernels.blocked_loss, pack.lm_head_rules)) == before
