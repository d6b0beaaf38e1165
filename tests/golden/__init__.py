"""Golden files: what each built-in pack does to the seed programs and a few corpus programs.

Every case rewrites one program with one pack and writes a text file
``tests/golden/<pack>/<program>.txt`` holding the program before, the rules
that fired and how often, and the program after (for ``vjp=True`` also the
forward and backward programs it runs). ``tests/test_golden.py`` regenerates
each file and compares it with the one checked in, so that a change to what a
pack does shows up in review as a change to these files.

After a deliberate change, regenerate them and read the diff before committing::

    python -m tests.golden --update              # every case
    python -m tests.golden --update scan         # one pack (or pack/program)
    python -m tests.golden --check               # compare only, with a diff per mismatch
    python -m tests.golden --check --programs-only   # ignore which rules fired (a rule renamed)

The same relaxation in the test: ``GOLDEN_PROGRAMS_ONLY=1 python -m pytest tests/test_golden.py``.

What is recorded is what every run on a CPU backend must reproduce: jaxprs
print with deterministic variable names, and the analytic cost model prices
with a fixed table kept here, ``tests/golden/cost_table.json`` (a copy of the
CPU calibration table of 2026-11-23), pinned with
:func:`rewrite.cost.model.priced_with` while a case is made: calibrating the
machine again (``benchmarks/calibrate.py --write``) changes what ``rewrite``
chooses on it, never a golden file. Nothing measured (timings,
``cost_model="measure"``) is recorded. The only normalisation is of object
addresses (``<function f at 0x...>``) that JAX prints in some parameters.
The files are made and compared on CPU only (see :data:`BACKEND`): another
backend traces some programs differently; run with ``JAX_PLATFORMS=cpu`` on a
machine with a GPU.

Sizes are small so that the whole comparison takes seconds; the programs are
the benchmarks' own (``benchmarks/programs.py``, ``derivatives.py``,
``scan.py``) and ``tests/corpus.py``'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import jax

HERE = Path(__file__).resolve().parent
HEADER = ("# Golden file, written by `python -m tests.golden --update`: do not edit by hand.\n"
          "# What a built-in pack does to one program (tests/golden/__init__.py says how it is made).\n")
RULES = "rules fired"  # the section that --programs-only ignores
#: The backend the recorded programs were traced and rewritten on.
BACKEND = "cpu"
#: The prices every golden file is made with, in place of the machine's calibration table.
COST_TABLE = HERE / "cost_table.json"


def on_backend() -> str | None:
    """``None`` when this process runs as the golden files were made, else why it does not."""
    backend = jax.default_backend()
    if backend == BACKEND:
        return None
    return (f"golden files are made on the {BACKEND} backend; "
            f"this process runs on {backend}: set JAX_PLATFORMS={BACKEND}")


#: The JAX the base golden files (``<program>.txt``) are made on. A newer JAX that traces a program
#: differently (its own derivatives change between releases: jax 0.11 differentiates ``tanh`` through
#: ``one_minus_square``; an ``inline=True`` jit stays a call in jax 0.11+'s jaxprs) gets a file of its own,
#: ``<program>.jax-0.11.txt``, used by that JAX and every later one that has none newer. Printing
#: differences alone never get one: programs print through version-neutral params (:func:`_jaxpr_text`).
BASE_JAX = (0, 10)
_VERSIONED = re.compile(r"^(?P<name>.+)\.jax-(?P<major>\d+)\.(?P<minor>\d+)\.txt$")


def _jax_minor() -> tuple[int, int]:
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


def versioned(case: "Case") -> dict[tuple[int, int], Path]:
    """This case's files for JAX versions newer than :data:`BASE_JAX`, by ``(major, minor)``."""
    found = {}
    for p in (HERE / case.pack).glob(f"{case.name}.jax-*.txt"):
        m = _VERSIONED.match(p.name)
        if m and m["name"] == case.name:
            found[(int(m["major"]), int(m["minor"]))] = p
    return found


def _for_jax(case: "Case", version: tuple[int, int]) -> Path | None:
    usable = [v for v in versioned(case) if v <= version]
    return versioned(case)[max(usable)] if usable else None


def cost_table() -> dict[str, Any]:
    """The fixed table the golden files are priced with (``tests/golden/cost_table.json``)."""
    return json.loads(COST_TABLE.read_text())


@dataclasses.dataclass(frozen=True)
class Case:
    """One program rewritten by one pack.

    ``build()`` returns ``(fn, args, rulesets, options)``: ``options`` are passed
    to :func:`rewrite.rewrite`, and an ``"outer"`` option (a function of a
    function, such as ``jax.grad``) is applied to both the original and the
    rewritten program, recording the program that runs (the demo's
    ``jax.grad(rewrite(f))``) rather than the one rewritten.
    """

    pack: str
    name: str
    source: str  # where the program comes from, as the golden file states it
    build: Callable[[], tuple[Callable, tuple, list, dict]]

    @property
    def key(self) -> str:
        return f"{self.pack}/{self.name}"

    @property
    def path(self) -> Path:
        """The file this JAX compares with: the newest of this case's files made on a JAX no newer than the
        running one (:func:`versioned`), else the base file, made on :data:`BASE_JAX`."""
        return _for_jax(self, _jax_minor()) or self.base_path

    @property
    def base_path(self) -> Path:
        return HERE / self.pack / f"{self.name}.txt"


# ---------------------------------------------------------------------- the cases
def _pack(name: str) -> Any:
    import rulesets

    return getattr(rulesets, name)


def _corpus(name: str) -> tuple[Callable, tuple]:
    from tests.corpus import corpus

    return next((f, a) for n, f, a in corpus() if n == name)


def _transformer(kind: str) -> tuple[Callable, tuple]:
    from benchmarks.programs import transformer_step

    return transformer_step(1, d=8, batch=2, seq=4, kind=kind)


def _seed000(T: int = 8) -> tuple:
    from benchmarks import derivatives

    return derivatives.inputs(T)  # x (32, T, 64), a (64,), g (32, T, 64)


def _scan_seed() -> tuple:
    from benchmarks import scan

    return scan.seed_case((4,), (6, 4))[0]  # the demo's smoke size


def _rnn() -> tuple:
    from benchmarks import scan

    return scan.rnn_params(2)


def _cases() -> list[Case]:
    from benchmarks import derivatives as bd
    from benchmarks import scan as bs

    out: list[Case] = []

    def add(pack: str, name: str, source: str, build: Callable[[], tuple]) -> None:
        out.append(Case(pack, name, source, build))

    # algebra and fastmath: the same programs, the exact pack and the approximate one.
    for pack in ("algebra", "fastmath"):
        add(pack, "transformer_forward", "benchmarks.programs.transformer_step(1, d=8, batch=2, seq=4, kind='forward')",
            lambda p=pack: (*_transformer("forward"), [_pack(p)], {}))
        add(pack, "transformer_step", "benchmarks.programs.transformer_step(1, d=8, batch=2, seq=4, kind='step')",
            lambda p=pack: (*_transformer("step"), [_pack(p)], {}))
        add(pack, "seed000", "benchmarks.derivatives.seed at T=8",
            lambda p=pack: (bd.seed, _seed000()[:2], [_pack(p)], {}))
        for name in ("layernorm", "layernorm_grad", "attention", "mlp_loss", "jax_nn", "numpy_mix", "optax_adam",
                     "float64_free_literals"):
            add(pack, f"corpus_{name}", f"tests.corpus: {name}",
                lambda p=pack, n=name: (*_corpus(n), [_pack(p)], {}))

    # derivatives: the demo's seed 000 (rewrite(vjp=True)), the benchmark's other variants and functions.
    def der(*extra):
        return [_pack("derivatives"), *extra]

    add("derivatives", "seed000_vjp", "benchmarks.derivatives: rewrite(seed, vjp=True) at T=8 (the demo's)",
        lambda: (bd.seed, _seed000()[:2], der(), {"vjp": True}))
    add("derivatives", "seed000_vjp_program", "benchmarks.derivatives: rewrite(as_vjp(seed)) at T=8",
        lambda: (bd.as_vjp(bd.seed), _seed000(), der(), {}))
    add("derivatives", "seed000_vjp_fastmath",
        "benchmarks.derivatives: rewrite(seed, vjp=True) with derivatives_fastmath at T=8",
        lambda: (bd.seed, _seed000()[:2], der(bd.derivatives_fastmath), {"vjp": True}))
    add("derivatives", "seed000_value_and_grad",
        "benchmarks.derivatives: as_value_and_grad(rewrite(seed, vjp=True)) at T=8",
        lambda: (bd.seed, _seed000()[:2], der(), {"vjp": True, "outer": bd.as_value_and_grad, "outer_args": _seed000()}))
    add("derivatives", "seed000_rewrite_vjp",
        "benchmarks.derivatives: as_vjp(rewrite(seed)) at T=8 (the demo's: jax.vjp of the plain decorator)",
        lambda: (bd.seed, _seed000()[:2], der(), {"outer": bd.as_vjp, "outer_args": _seed000()}))
    add("derivatives", "ising_vjp", "benchmarks.derivatives: rewrite(ising, vjp=True) at T=8",
        lambda: (bd.ising, _seed000()[:2], der(), {"vjp": True}))
    add("derivatives", "softplus_vjp", "benchmarks.derivatives: rewrite(softplus, vjp=True) at T=8",
        lambda: (bd.softplus, _seed000()[:2], der(), {"vjp": True}))
    for name in ("seed000_grad", "layernorm_grad", "attention_grad", "mlp_grad"):
        add("derivatives", f"corpus_{name}", f"tests.corpus: {name}", lambda n=name: (*_corpus(n), der(), {}))

    # scan: the demo's seed 001 and RNN (forward, and the gradient of the rewritten forward), and their variants.
    scan_pack = lambda: [_pack("scan")]  # noqa: E731
    grad12 = lambda f: jax.grad(f, argnums=(1, 2))  # noqa: E731
    add("scan", "seed001", "benchmarks.scan: rewrite(seed) at xs (6, 4) (the demo's smoke size)",
        lambda: (bs.seed, _scan_seed(), scan_pack(), {}))
    add("scan", "seed001_hoist_only", "benchmarks.scan: rewrite(seed, rulesets=[scan.hoist]) at xs (6, 4)",
        lambda: (bs.seed, _scan_seed(), [_pack("scan").hoist], {}))
    add("scan", "seed001_grad", "benchmarks.scan: jax.grad(rewrite(seed), argnums=(1, 2)) at xs (6, 4)",
        lambda: (bs.seed, _scan_seed(), scan_pack(), {"outer": grad12}))
    add("scan", "seed001_rewrite_grad", "benchmarks.scan: rewrite(jax.grad(seed, argnums=(1, 2))) at xs (6, 4)",
        lambda: (grad12(bs.seed), _scan_seed(), scan_pack(), {}))
    add("scan", "rnn", "benchmarks.scan: rewrite(rnn_mse) at batch 2",
        lambda: (bs.rnn_mse, _rnn(), scan_pack(), {}))
    add("scan", "rnn_grad", "benchmarks.scan: jax.grad(rewrite(rnn_mse)) at batch 2",
        lambda: (bs.rnn_mse, _rnn(), scan_pack(), {"outer": jax.grad}))
    for remat in ("nothing", None):
        add("scan", f"rnn_grad_remat_{str(remat).lower()}", f"benchmarks.scan: jax.grad(rewrite(rnn_mse, "
            f"rulesets=[make(remat={remat!r})])) at batch 2",
            lambda r=remat: (bs.rnn_mse, _rnn(), [bs.make(remat=r)], {"outer": jax.grad}))
    add("scan", "rnn_rewrite_grad", "benchmarks.scan: rewrite(jax.grad(rnn_mse)) at batch 2",
        lambda: (jax.grad(bs.rnn_mse), _rnn(), scan_pack(), {}))
    add("scan", "rnn_rewrite_grad_stacked100",
        "benchmarks.scan: rewrite(jax.grad(rnn_mse), cost_model=AnalyticCost(stacked=100.0)) at batch 2",
        lambda: (jax.grad(bs.rnn_mse), _rnn(), scan_pack(), {"cost_model": _stacked100()}))
    for name in ("seed001_grad", "rnn_mse_grad", "nested", "eqx_gru_scan", "eqx_gru_scan_grad"):
        add("scan", f"corpus_{name}", f"tests.corpus: {name}", lambda n=name: (*_corpus(n), scan_pack(), {}))

    # nn: the benchmark's one-hot language-model loss (small, but large enough that the gather is taken).
    from benchmarks import nn as bn

    nn_pack = lambda: [_pack("nn")]  # noqa: E731
    add("nn", "lm_loss", "benchmarks.nn: rewrite(lm_one_hot) at N=32, V=512",
        lambda: (bn.lm_one_hot, _lm(), nn_pack(), {}))
    add("nn", "lm_value_and_grad", "benchmarks.nn: jax.value_and_grad(rewrite(lm_one_hot)) at N=32, V=512",
        lambda: (bn.lm_one_hot, _lm(), nn_pack(), {"outer": jax.value_and_grad}))
    add("nn", "lm_rewrite_value_and_grad", "benchmarks.nn: rewrite(jax.value_and_grad(lm_one_hot)) at N=32, V=512",
        lambda: (jax.value_and_grad(bn.lm_one_hot), _lm(), nn_pack(), {}))
    for name in ("jax_nn", "mlp_loss", "attention", "binary_cross_entropy"):
        add("nn", f"corpus_{name}", f"tests.corpus: {name}", lambda n=name: (*_corpus(n), nn_pack(), {}))

    # linalg: programs with products (the transformer's attention and MLP, the corpus's) and the benchmark's own.
    for kind in ("forward", "step"):
        add("linalg", f"transformer_{kind}",
            f"benchmarks.programs.transformer_step(1, d=8, batch=2, seq=4, kind={kind!r})",
            lambda k=kind: (*_transformer(k), [_pack("linalg")], {}))
    for name in ("attention", "attention_grad", "mlp_loss", "mlp_grad"):
        add("linalg", f"corpus_{name}", f"tests.corpus: {name}", lambda n=name: (*_corpus(n), [_pack("linalg")], {}))
    add("linalg", "linear_attention", "benchmarks.linalg.attention at (1, 2, 16, 4)",
        lambda: (_linalg_bench().attention, _ones((1, 2, 16, 4), (1, 2, 16, 4), (1, 2, 16, 4)), [_pack("linalg")], {}))
    add("linalg", "chain5", "benchmarks.linalg.chain of five matrices, 9x30x2x17x40x3",
        lambda: (_linalg_bench().chain, _ones((9, 30), (30, 2), (2, 17), (17, 40), (40, 3)), [_pack("linalg")], {}))

    # attention: the benchmark's plain attention over key blocks, and the corpus's (short keys: kept). Its 4 MiB of
    # scores stay in the cache, where the model keeps it as written (AnalyticCost.scores_cached): priced with them
    # stored, to show the blocked form.
    add("attention", "plain_512",
        "benchmarks.attention.plain at (2, 2, 512, 8), cost_model=AnalyticCost(scores_cached=0.0)",
        lambda: (_attention_bench().plain, _ones((2, 2, 512, 8), (2, 2, 512, 8), (2, 2, 512, 8)),
                 [_pack("attention")], {"cost_model": _stored_scores()}))
    for name in ("attention", "attention_grad"):
        add("attention", f"corpus_{name}", f"tests.corpus: {name}", lambda n=name: (*_corpus(n), [_pack("attention")], {}))
    return out


def _stored_scores() -> Any:
    from rewrite import AnalyticCost

    return AnalyticCost(scores_cached=0.0)


def _attention_bench() -> Any:
    from benchmarks import attention

    return attention


def _lm() -> tuple:
    import jax.numpy as jnp

    return jnp.linspace(-3.0, 3.0, 32 * 512, dtype=jnp.float32).reshape(32, 512), jnp.arange(32) * 15 % 512


def _linalg_bench() -> Any:
    from benchmarks import linalg

    return linalg


def _ones(*shapes: tuple[int, ...]) -> tuple:
    import jax.numpy as jnp

    return tuple(jnp.ones(s) for s in shapes)


def _stacked100() -> Any:
    from rewrite import AnalyticCost

    return AnalyticCost(stacked=100.0)


_CASES: list[Case] | None = None


def cases() -> list[Case]:
    """Every golden case, in a fixed order (pack by pack)."""
    global _CASES
    if _CASES is None:
        _CASES = _cases()
    return _CASES


def select(patterns: list[str]) -> list[Case]:
    """The cases whose ``pack/program`` key starts with one of ``patterns`` (all of them if none)."""
    chosen = [c for c in cases() if not patterns or any(c.key == p or c.pack == p.rstrip("/") for p in patterns)]
    if patterns and not chosen:
        raise SystemExit(f"no golden case matches {patterns}; the cases are: {[c.key for c in cases()]}")
    return chosen


# ---------------------------------------------------------------------- rendering
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _jaxpr_text(closed: Any) -> str:
    return _ADDRESS.sub(" at 0x...", str(_share_equal_jaxprs(closed))).rstrip()


def _share_equal_jaxprs(closed: Any) -> Any:
    """``closed`` with sub-jaxprs that print the same made one object, and every equation's params in
    their version-neutral form (:func:`rewrite.ir.jaxapi.neutral_params`: a scan's input groups as
    ``num_consts``/``num_carry`` counts, which JAX 0.11 and later hold as flat trees), so that one golden
    file holds on every supported JAX. The result is for printing: on JAX 0.11+ its scans do not run.

    JAX prints a sub-jaxpr used by several equations once, at the top
    (``let jaxpr = ... in``), when the equations hold the same object. Whether
    two equal update functions of two scatters are one object depends on what
    the process traced before, not on the program, so the text is made not to.
    """
    from rewrite.ir.jaxapi import core, neutral_params

    seen: dict[str, Any] = {}

    def canon(jaxpr: Any) -> Any:
        eqns = []
        for e in jaxpr.eqns:
            params = neutral_params(e.primitive, {k: one(v) for k, v in e.params.items()})
            eqns.append(e.replace(params=params) if params.keys() != e.params.keys()
                        or any(params[k] is not e.params[k] for k in params) else e)
        new = jaxpr.replace(eqns=eqns) if any(a is not b for a, b in zip(eqns, jaxpr.eqns)) else jaxpr
        return seen.setdefault(str(new), new)

    def one(v: Any) -> Any:
        if isinstance(v, core.Jaxpr):
            return canon(v)
        if isinstance(v, core.ClosedJaxpr):
            inner = canon(v.jaxpr)
            return v if inner is v.jaxpr else core.ClosedJaxpr(inner, v.consts)
        if isinstance(v, tuple) and any(isinstance(x, (core.Jaxpr, core.ClosedJaxpr)) for x in v):
            return tuple(one(x) for x in v)
        return v

    return core.ClosedJaxpr(canon(closed.jaxpr), closed.consts) if isinstance(closed, core.ClosedJaxpr) else closed


def _avals(args: tuple) -> str:
    leaves = jax.tree_util.tree_leaves(args)
    return " ".join(jax.typeof(x).str_short() if hasattr(x, "shape") else _ADDRESS.sub(" at 0x...", repr(x))
                    for x in leaves)


def render(case: Case) -> str:
    """The golden text of one case, made now (rewriting its program), priced with :func:`cost_table`."""
    from rewrite.cost.model import priced_with

    with priced_with(cost_table()):
        return _render(case)


def _render(case: Case) -> str:
    from rewrite import rewrite

    fn, args, packs, options = case.build()
    options = dict(options)
    outer = options.pop("outer", None)
    outer_args = options.pop("outer_args", args)
    with warnings.catch_warnings():  # vjp=True is deprecated; its golden files keep what it still does
        warnings.filterwarnings("ignore", r"rewrite\(\.\.\., vjp=True\)", DeprecationWarning)
        rewritten = rewrite(fn, rulesets=packs, **options)
    result = rewritten.result(*args)
    lines = [HEADER.rstrip("\n"),
             f"program: {case.source}",
             f"rulesets: {', '.join(getattr(p, 'name', repr(p)) for p in packs)}",
             f"inputs: {_avals(outer_args)}",
             f"stopped: {result.stopped}"]
    for w in result.warnings:
        lines.append(f"warning: {w}")
    fired = {k: s.fired for k, s in result.stats.items() if s.fired}
    sections = [(RULES, "\n".join(f"{k} {n}" for k, n in sorted(fired.items())) or "(none)")]
    if outer is None:
        sections += [("before", _jaxpr_text(result.before)), ("after", _jaxpr_text(result.after))]
        if options.get("vjp"):
            fwd, bwd = rewritten.vjp_jaxprs(*args)
            sections += [("after: forward pass (primals -> outputs, residuals)", _jaxpr_text(fwd)),
                         ("after: backward pass (residuals, cotangents -> gradients)", _jaxpr_text(bwd))]
    else:
        sections += [("before (the original program, transformed)", _jaxpr_text(jax.make_jaxpr(outer(fn))(*outer_args))),
                     ("after (the rewritten program, transformed)",
                      _jaxpr_text(jax.make_jaxpr(outer(rewritten))(*outer_args)))]
    body = "\n".join(lines) + "\n"
    for title, text in sections:
        body += f"\n## {title}\n{text}\n"
    return body


# ---------------------------------------------------------------------- comparing
def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.*)$", text, flags=re.M)
    out = {"header": parts[0]}
    for title, body in zip(parts[1::2], parts[2::2]):
        out[title] = body
    return out


def compare(expected: str, actual: str, *, programs_only: bool = False, name: str = "") -> str | None:
    """``None`` when the two golden texts agree, else a readable report: the sections that differ, then a diff.

    With ``programs_only`` the rules that fired are not compared (for a change that renames or regroups
    rules and claims to leave every program as it was).

    >>> compare("a\\n## after\\nx\\n", "a\\n## after\\nx\\n") is None
    True
    >>> print(compare("a\\n## after\\nx\\n", "a\\n## after\\ny\\n", name="p"))
    golden p differs in: after
    --- p (checked in)
    +++ p (made now)
    @@ -1,3 +1,3 @@
     a
     ## after
    -x
    +y
    """
    want, got = _sections(expected), _sections(actual)
    if programs_only:
        want.pop(RULES, None)
        got.pop(RULES, None)
    differ = [k for k in dict.fromkeys([*want, *got]) if want.get(k) != got.get(k)]
    if not differ:
        return None
    if programs_only:
        expected, actual = ("".join(f"## {k}\n{v}" if k != "header" else v for k, v in s.items()) for s in (want, got))
    diff = difflib.unified_diff(expected.splitlines(), actual.splitlines(), f"{name} (checked in)", f"{name} (made now)",
                                lineterm="", n=3)
    return f"golden {name} differs in: {', '.join(differ)}\n" + "\n".join(diff)


def check(case: Case, *, programs_only: bool = False) -> str | None:
    """Regenerate one case and compare it with its file: ``None`` if equal, else what differs and how."""
    if not case.path.exists():
        return f"golden {case.key}: no file {case.path.relative_to(HERE.parent.parent)}; run `python -m tests.golden --update`"
    return compare(case.path.read_text(), render(case), programs_only=programs_only, name=case.key)


def stale() -> list[Path]:
    """Golden files that no case writes any more (a case renamed or removed), and files for a newer JAX
    that say what the file before them says."""
    made = {c.base_path for c in cases()}
    for c in cases():
        files = sorted(versioned(c).items())
        before = c.base_path.read_text() if c.base_path.exists() else None
        for _, p in files:
            text = p.read_text()
            if text != before:
                made.add(p)
            before = text
    return sorted(p for p in HERE.glob("*/*.txt") if p not in made)


def update(case: Case, out: Path | None = None) -> bool:
    """Write one case's golden file (under ``out`` instead of this folder if given); True if it changed.

    On :data:`BASE_JAX` that is the base file. On a newer JAX it is a file for this JAX's version, written
    only where its text differs from the file this JAX would otherwise compare with (and removed where it
    no longer does)."""
    why = on_backend()
    if why is not None:
        raise RuntimeError(why)
    text = render(case)
    version = _jax_minor()
    if out is not None:
        path = Path(out) / case.pack / f"{case.name}.txt"
    elif version <= BASE_JAX:
        path = case.base_path
    else:
        path = HERE / case.pack / f"{case.name}.jax-{version[0]}.{version[1]}.txt"
        older = _for_jax(case, (version[0], version[1] - 1)) if version[1] else None
        inherited = older or case.base_path
        if inherited.exists() and inherited.read_text() == text:
            if path.exists():
                path.unlink()
                return True
            return False
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True
