"""JAX's own test suite with every ``jax.jit`` routed through ``rewrite``.

Each JAX test file runs twice in its own pytest process, once as JAX ships it and once with
``jax.jit`` (and the ``jit`` that ``jtu.JaxTestCase._CompileAndCheck`` uses) replaced by a ``jit`` of
``rewrite(fun, rulesets=PACKS)``, and ``jax.pmap`` by a ``pmap`` of it (``JAX_SUITE_ROUTE_PMAP=0``: not); the two
runs' outcomes are compared test by test. The report
gives the tests run, those passed each way, those that newly fail with routing, the tests that went
through the rewriter, the rewrites that fell back to the original program (``RewriteWarning``) and
those that stopped at a limit (``RewriteLimitWarning``).

JAX's wheel has no ``tests/``: take them from JAX's repository at the tag of the installed
version, into ``third_party/jax_tests/`` (ignored by git, never committed)::

    git clone --bare https://github.com/jax-ml/jax /tmp/jax.git      # or any clone of it
    python -m benchmarks.jax_suite extract --git-dir /tmp/jax.git   # git archive jax-v<version> tests

Then run a subset (each file twice; ``JAX_NUM_GENERATED_CASES`` bounds JAX's sampled cases)::

    python -m benchmarks.jax_suite run nn_test lax_numpy_reducers_test --cases 2
    python -m benchmarks.jax_suite run lax_test --cases 1 -k "testOp or testReduce" --timeout 900
    python -m benchmarks.jax_suite run lax_autodiff_test --cases 1 --grads --out benchmarks/out/jax_suite_grads

``--grads`` routes ``jtu.check_grads`` as well: the function it checks is ``rewrite(f)``, called eagerly,
so JAX's finite-difference checks of every order and mode are asked of the rewritten program.

JAX's tests need ``absl-py`` (the ``jaxsuite`` extra: ``pip install -e '.[jaxsuite]'``). ``run``
writes ``benchmarks/out/jax_suite/<file>.{plain,routed}.json`` and appends to nothing: the figures
committed in ``benchmarks/results/jax_suite.md`` are copied from its printed table, with the
command.

Loaded as a pytest plugin (``-p benchmarks.jax_suite``) with ``JAX_SUITE_ROUTE=1``, this module
does the routing; with ``JAX_SUITE_OUT=<path>`` it writes each test's outcome there (and to ``<path>.partial`` as
each test ends, so that a file stopped at ``--timeout`` keeps the outcomes of the tests it finished, and the test it
was in counts as failed).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import types
import warnings
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ROOT / "third_party" / "jax_tests"
OUT = ROOT / "benchmarks" / "out" / "jax_suite"
FILES = ("lax_numpy_test", "lax_test", "lax_control_flow_test", "lax_autodiff_test", "lax_numpy_reducers_test",
         "nn_test", "linalg_test")
#: The packs every routed jit uses: the built-in packs whose soundness is not fastmath.
PACKS = ("algebra", "scan", "derivatives", "nn", "linalg")


def available() -> bool:
    """Are JAX's test sources extracted (and absl, which they import, installed)?"""
    try:
        import absl.testing  # noqa: F401
    except ImportError:
        return False
    return (SOURCES / "tests" / "lax_test.py").exists()


# ---------------------------------------------------------------------------------------------------
# The routing, as a pytest plugin.

class _State:
    """What the routed jits saw during the current test."""

    def __init__(self) -> None:
        self.calls = 0
        self.fallbacks: list[str] = []
        self.limits: list[str] = []
        self.build_errors: list[str] = []

    def take(self) -> dict[str, Any]:
        out = {"calls": self.calls, "fallbacks": self.fallbacks, "limits": self.limits,
               "build_errors": self.build_errors}
        self.__init__()
        return out


STATE = _State()


def _counted(fun: Any, rewritten: Any) -> Any:
    """``rewritten`` in ``fun``'s name, each call counted; its RewriteWarnings are recorded (by
    :func:`_recording_warn`) and kept quiet, every other warning passed on."""
    from rewrite import RewriteWarning

    @functools.wraps(fun)
    def routed(*args: Any, **kwargs: Any) -> Any:
        STATE.calls += 1
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RewriteWarning)
                return rewritten(*args, **kwargs)
        finally:  # passed on when the call raises too (diffrax's test_event_backsolve: a warning, then an error)
            for w in caught:
                if not issubclass(w.category, RewriteWarning):
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    return routed


def _routed(real: Any, packs: Any, statics: Any) -> Any:
    """``real`` (``jax.jit``, ``jax.pmap``) of ``rewrite(fun)``, static in what ``real`` makes static (``statics``:
    ``rewrite``'s keywords from ``real``'s); under ``pmap`` the rewriter traces inside each map (collectives over the
    named axis in its program)."""
    from rewrite import rewrite

    def route(fun: Any = None, /, *args: Any, **kw: Any) -> Any:
        if fun is None:
            return functools.partial(route, *args, **kw)
        if not callable(fun) or _called_from_the_rewriter():
            return real(fun, *args, **kw)
        static = statics(kw)
        key = (id(fun), id(real), tuple((k, (v,) if isinstance(v, (int, str)) else tuple(v))
                                        for k, v in static.items()))
        kept = _ROUTED.get(key)
        if kept is not None and kept[0] is fun:  # as jax.jit(f) again reuses f's traces and executables
            _ROUTED.move_to_end(key)
            return real(kept[1], *args, **kw)
        try:
            rewritten = rewrite(fun, rulesets=packs, strict=False, cache=False, **static)
        except Exception as e:  # what jax.jit or pmap itself rejects (a bad static_argnums): it says so
            STATE.build_errors.append(f"{type(e).__name__}: {e}")
            return real(fun, *args, **kw)
        counted = _counted(fun, rewritten)
        _ROUTED[key] = (fun, counted)
        while len(_ROUTED) > ROUTED_KEEP:
            _ROUTED.popitem(last=False)
        return real(counted, *args, **kw)

    return route


#: The last functions routed, by ``id``, ``real`` and static arguments: ``jax.jit(f)`` called again for the same
#: ``f`` (blackjax's meanfield test: 15,000 times) reuses ``f``'s traces and executables, and routed it reuses
#: ``f``'s rewrite and the wrapper JAX caches them by (each kept holds ``f`` and its rewrite alive: a few only).
_ROUTED: collections.OrderedDict = collections.OrderedDict()
ROUTED_KEEP = 8


def _jit_statics(kw: dict) -> dict:
    return {"static_argnums": kw.get("static_argnums") or (), "static_argnames": kw.get("static_argnames") or ()}


def _pmap_statics(kw: dict) -> dict:
    return {"static_argnums": kw.get("static_broadcasted_argnums") or ()}


def _called_from_the_rewriter() -> bool:
    """Is ``jax.jit`` being called by the rewriter or a pack (``rewrite.api`` runs a jitted function's program
    compiled; a rule's procedure may compile a probe), not by JAX's tests? Routed, a program the rewriter leaves as
    written came back to it: ``mutable_array_test``'s nested ``jit``s recursed until Python's limit."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller.split(".")[0] in ("rewrite", "rulesets")


def _routed_check_grads(real_check: Any, packs: Any) -> Any:
    """``check_grads(f, args, order, ...)`` on ``rewrite(f)``: JAX's finite-difference checks of every
    order and mode (jvp, vjp, their compositions) asked of the rewritten function, called eagerly."""
    from rewrite import rewrite

    @functools.wraps(real_check)
    def check_grads(f: Any, args: Any, order: int, *rest: Any, **kw: Any) -> Any:
        try:
            rewritten = rewrite(f, rulesets=packs, strict=False, cache=False)
        except Exception as e:  # noqa: BLE001 - counted like a jit that could not be routed
            STATE.build_errors.append(f"{type(e).__name__}: {e}")
            return real_check(f, args, order, *rest, **kw)

        return real_check(_counted(f, rewritten), args, order, *rest, **kw)

    return check_grads


def _recording_warn(real_warn: Any) -> Any:
    """``warnings.warn`` that also records each RewriteWarning: the rewrite of a derivative (under
    ``jax.grad`` of a jitted function) warns outside the routed call, and a test may catch warnings."""
    from rewrite import RewriteLimitWarning, RewriteWarning

    def warn(message: Any, category: Any = None, stacklevel: int = 1, source: Any = None, **kw: Any) -> None:
        cat = type(message) if isinstance(message, Warning) else category
        if isinstance(cat, type) and issubclass(cat, RewriteLimitWarning):
            STATE.limits.append(str(message)[:300])
        elif isinstance(cat, type) and issubclass(cat, RewriteWarning):
            STATE.fallbacks.append(str(message)[:300])
        return real_warn(message, category, stacklevel + 1, source, **kw)

    return warn


def _install() -> None:
    import jax
    from jax._src import test_util as jtu

    warnings.warn = _recording_warn(warnings.warn)
    # By name: loading a pack traces its examples, which would start JAX's backend before a test module sets
    # XLA_FLAGS (flax's spmd and bridge tests: four host devices); each rewrite resolves the names.
    packs = list(PACKS)
    jit = _routed(jax.jit, packs, _jit_statics)
    jax.jit = jit
    real_api = jtu.api
    proxy = types.ModuleType("api")  # test_util calls api.jit; only that name changes
    proxy.__getattr__ = lambda name: getattr(real_api, name)  # type: ignore[method-assign]
    proxy.jit = jit
    jtu.api = proxy
    if os.environ.get("JAX_SUITE_ROUTE_PMAP", "1") == "1":
        jax.pmap = _routed(jax.pmap, packs, _pmap_statics)
    if os.environ.get("JAX_SUITE_ROUTE_GRADS") == "1":
        import jax.test_util

        jtu.check_grads = jax.test_util.check_grads = _routed_check_grads(jtu.check_grads, packs)


def pytest_configure(config: Any) -> None:
    if os.environ.get("JAX_SUITE_ROUTE") == "1":
        _install()
    config._jax_suite = {}


def pytest_runtest_setup(item: Any) -> None:
    STATE.take()


def _partial(record: list) -> None:
    """One line of ``JAX_SUITE_OUT``'s ``.partial`` file: a test started (``[nodeid]``) or its outcome
    (``[nodeid, entry]``), written as the file runs, so that a pytest stopped at ``--timeout`` keeps what it did
    (:func:`_kept`)."""
    path = os.environ.get("JAX_SUITE_OUT")
    if path:
        with open(path + ".partial", "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _partial([nodeid])


def pytest_runtest_logreport(report: Any) -> None:
    results = getattr(pytest_runtest_logreport, "results", None)
    if results is None:
        results = pytest_runtest_logreport.results = {}  # type: ignore[attr-defined]
    entry = results.setdefault(report.nodeid, {"outcome": "passed"})
    if report.outcome == "failed":
        entry["outcome"] = "failed"
        entry["error"] = str(report.longrepr).splitlines()[-1][:300] if report.longrepr else ""
    elif report.outcome == "skipped" and report.when in ("setup", "call"):
        entry["outcome"] = "skipped"
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        # summed over the test's reports: each ``self.subTest`` sends one of its own (pytest 9), and what the
        # routed jits saw inside it was lost to the test's final report (optax's hungarian tests: 0 calls for 1)
        taken = STATE.take()
        entry["calls"] = entry.get("calls", 0) + taken["calls"]
        for k in ("fallbacks", "limits", "build_errors"):
            entry[k] = entry.get(k, []) + taken[k]
    if report.when == "teardown":
        _partial([report.nodeid, entry])


def pytest_sessionfinish(session: Any) -> None:
    path = os.environ.get("JAX_SUITE_OUT")
    if path:
        results = getattr(pytest_runtest_logreport, "results", {})
        pathlib.Path(path).write_text(json.dumps(results, indent=1))


# ---------------------------------------------------------------------------------------------------
# The driver.

def extract(git_dir: str, ref: str | None = None) -> str:
    """Extract ``tests/`` of JAX's repository at the installed version's tag into :data:`SOURCES`."""
    import jax

    ref = ref or f"jax-v{jax.__version__}"
    SOURCES.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", ref, "tests"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(SOURCES)], input=archive, check=True)
    return ref


def test_path(name: str) -> str:
    """The file a name stands for, relative to the tests' root: JAX's ``tests/<name>.py``, or a path that ends in
    ``.py`` as it is (another library's tests: ``optax/_src/alias_test.py`` under its ``site-packages``)."""
    return name if name.endswith(".py") else f"tests/{name}.py"


def out_name(name: str) -> str:
    """The name a file's outcomes are written under: ``optax/_src/alias_test.py`` -> ``optax._src.alias_test``."""
    return name[:-3].replace("/", ".") if name.endswith(".py") else name


def run_file(name: str, routed: bool, cases: int, select: str | None, timeout: float,
             out_dir: pathlib.Path = OUT, root: pathlib.Path = SOURCES) -> dict[str, Any]:
    """One pytest process over the test file ``name`` (:func:`test_path`) under ``root`` (JAX's extracted
    ``tests/`` by default; any library's tests can be routed so); each test's outcome (and, routed, what the
    rewriter did), also written to ``out_dir``."""
    out_dir = pathlib.Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(root).resolve()
    path = test_path(name)
    out = out_dir / f"{out_name(name)}.{'routed' if routed else 'plain'}.json"
    out.unlink(missing_ok=True)
    pathlib.Path(f"{out}.partial").unlink(missing_ok=True)
    env = dict(os.environ, JAX_NUM_GENERATED_CASES=str(cases), JAX_SUITE_OUT=str(out),
               JAX_SUITE_ROUTE="1" if routed else "0", REWRITE_STRICT="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # The CPU devices a file asks for (jtu.request_cpu_devices at its top), given before any backend starts, both
    # ways: the routed process starts one as its plugin configures, before the file can ask (pjit_test: 664 of 798
    # tests skipped for want of 8 devices)
    source = root / path
    asked = [int(n) for n in re.findall(r"request_cpu_devices\((\d+)\)", source.read_text())] if source.exists() else []
    if asked:
        env["JAX_NUM_CPU_DEVICES"] = str(max(asked))
    # -s, both ways: the tests that read what they print (jtu.capture_stdout) lost it to pytest's own capture in the
    # routed process, whose plugin compiles programs as it configures (debugging_primitives_test: 42 of 65)
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "benchmarks.jax_suite",
           "-o", "addopts=", "--rootdir", str(root), path]
    if select:
        cmd += ["-k", select]
    t = time.perf_counter()
    try:
        subprocess.run(cmd, cwd=root, env=env, timeout=timeout, capture_output=True)
    except subprocess.TimeoutExpired:
        if not out.exists():
            out.write_text(json.dumps(_kept(pathlib.Path(f"{out}.partial"), timeout), indent=1))
        print(f"{name} ({'routed' if routed else 'plain'}): timed out after {timeout:.0f} s; the outcomes of "
              f"{len(json.loads(out.read_text()))} test(s) kept", file=sys.stderr)
    pathlib.Path(f"{out}.partial").unlink(missing_ok=True)
    results = json.loads(out.read_text()) if out.exists() else {}
    return {"results": results, "seconds": time.perf_counter() - t}


def _kept(partial: pathlib.Path, timeout: float) -> dict[str, Any]:
    """The outcomes a pytest stopped at ``timeout`` wrote as it ran (:func:`_partial`): each finished test's, and the
    test it was running, failed as timed out (a test with no outcome would drop out of :func:`compare`)."""
    results: dict[str, Any] = {}
    running = None
    lines = partial.read_text().splitlines() if partial.exists() else []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # the last line, cut off where the process was stopped
            continue
        if len(record) == 2:
            results[record[0]] = record[1]
            running = None if running == record[0] else running
        else:
            running = record[0]
    if running is not None and running not in results:
        results[running] = {"outcome": "failed", "calls": 0, "fallbacks": [], "limits": [], "build_errors": [],
                            "error": f"timed out: the file's pytest was stopped after {timeout:.0f} s in this test"}
    return results


def compare(plain: dict[str, Any], routed: dict[str, Any]) -> dict[str, Any]:
    """The figures of one file: counts each way, the tests that newly fail, and what fell back."""
    both = sorted(set(plain) & set(routed))
    ran = [t for t in both if plain[t]["outcome"] != "skipped"]
    count = collections.Counter
    return {
        "tests": len(both),
        "ran": len(ran),
        "passed_plain": sum(plain[t]["outcome"] == "passed" for t in both),
        "passed_routed": sum(routed[t]["outcome"] == "passed" for t in both),
        "through_rewriter": sum(routed[t].get("calls", 0) > 0 for t in both),
        "newly_failing": {t: routed[t].get("error", "") for t in both
                          if plain[t]["outcome"] == "passed" and routed[t]["outcome"] == "failed"},
        "newly_passing": [t for t in both if plain[t]["outcome"] == "failed" and routed[t]["outcome"] == "passed"],
        "fallbacks": {t: routed[t]["fallbacks"] for t in both if routed[t].get("fallbacks")},
        "limits": {t: routed[t]["limits"] for t in both if routed[t].get("limits")},
        "fallback_kinds": count(m.split(" (")[0][:120] for t in both for m in routed[t].get("fallbacks", [])),
    }


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| file | tests | ran | passed (jit) | passed (routed) | through the rewriter | newly failing "
             "| tests with fallbacks | tests with limit stops |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tests']} | {r['ran']} | {r['passed_plain']} | {r['passed_routed']} "
                     f"| {r['through_rewriter']} | {len(r['newly_failing'])} | {len(r['fallbacks'])} "
                     f"| {len(r['limits'])} |")
    return "\n".join(lines)


def details(rows: dict[str, dict[str, Any]]) -> str:
    out = []
    for name, r in rows.items():
        for t, err in r["newly_failing"].items():
            out.append(f"- newly failing: `{t}`: {err}")
        for t, msgs in r["fallbacks"].items():
            out.append(f"- fallback: `{t}`: {msgs[0]}")
        for t, msgs in r["limits"].items():
            out.append(f"- limit: `{t}`: {msgs[0]}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("extract", help="extract JAX's tests/ at the installed version's tag")
    ex.add_argument("--git-dir", required=True)
    ex.add_argument("--ref", default=None, help="a tag or commit (default: jax-v<installed version>)")
    rn = sub.add_parser("run", help="run JAX test files plain and routed, and compare")
    rn.add_argument("files", nargs="*", default=list(FILES),
                    help="JAX's test files by name, or paths ending in .py relative to --root")
    rn.add_argument("--root", type=pathlib.Path, default=SOURCES,
                    help="where the files are (default: JAX's extracted tests); e.g. a site-packages folder, whose "
                         "libraries ship their tests (optax, distrax, haiku)")
    rn.add_argument("--cases", type=int, default=2, help="JAX_NUM_GENERATED_CASES")
    rn.add_argument("-k", dest="select", default=None)
    rn.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest process")
    rn.add_argument("--routed-only", action="store_true", help="reuse the last plain run's outcomes")
    rn.add_argument("--grads", action="store_true",
                    help="route jtu.check_grads too: its function is rewritten (JAX_SUITE_ROUTE_GRADS=1)")
    rn.add_argument("--out", type=pathlib.Path, default=OUT,
                    help=f"where outcomes go (default {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    if args.command == "extract":
        print(f"extracted tests/ at {extract(args.git_dir, args.ref)} into {SOURCES.relative_to(ROOT)}")
        return
    if args.root == SOURCES and not available():
        sys.exit(f"no JAX test sources in {SOURCES.relative_to(ROOT)} (or absl-py missing): run `extract` first")
    rows = {}
    if getattr(args, "grads", False):
        os.environ["JAX_SUITE_ROUTE_GRADS"] = "1"
    for name in args.files:
        plain_path = args.out / f"{out_name(name)}.plain.json"
        if args.routed_only and plain_path.exists():
            plain = {"results": json.loads(plain_path.read_text()), "seconds": 0.0}
        else:
            plain = run_file(name, False, args.cases, args.select, args.timeout, args.out, args.root)
        routed = run_file(name, True, args.cases, args.select, args.timeout, args.out, args.root)
        rows[name] = compare(plain["results"], routed["results"])
        print(f"{name}: plain {plain['seconds']:.0f} s, routed {routed['seconds']:.0f} s", file=sys.stderr)
        (args.out / f"{out_name(name)}.summary.json").write_text(json.dumps(rows[name], indent=1))
    print(table(rows))
    print(details(rows))


if __name__ == "__main__":
    main()
