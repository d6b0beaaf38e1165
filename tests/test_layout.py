"""The package's layout holds: imports run one way, modules stay small, dependencies sit in headers.

``rewrite/`` is a set of folders, each a role (``ir``, ``jaxpr``, ``rules``,
``extract``, ``cost``, ``grad``, ``cache``, ``report``, ``testing``), plus the
public entry points at the top. These tests read the sources (no import) and
fail when a change brings back what the layout was made to remove: an import
circle between modules or between folders (imports inside functions count),
a module over 700 lines, an import of a project module hidden inside a
function without a comment saying why it cannot be at the top, or an import
of JAX's internals (``jax._src``) anywhere but ``rewrite/ir/jaxapi.py``, an
import that runs up the layers (:data:`LAYERS`), a module imported by name
(``importlib``, ``__import__``), the core importing the packs, or a stage run
outside the one entry point, ``pipeline.run_pipeline``.
"""

from __future__ import annotations

import ast
import collections
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("rewrite", "rulesets")
MAX_LINES = 700
MAX_FUNCTION_IMPORTS = 4

#: The layers of ``rewrite/``, bottom first: a folder (or top-level module) imports only from layers below
#: its own. The stages sit low, the one entry point (``pipeline``) above them, its callers above that, and
#: the public entry points (``api``: ``rewrite``, ``explain``, pack names; ``loops``: the loop rules' public
#: path, whose code is in ``rules/``; ``define``: ``rule``, which keeps its example checks in the disk cache)
#: on top of the core.
LAYERS = (
    ("rewrite.ir", "rewrite.errors"),
    ("rewrite.records", "rewrite.jaxpr", "rewrite.cost"),
    ("rewrite.extract",),
    ("rewrite.rules",),
    ("rewrite.pipeline",),
    ("rewrite.grad", "rewrite.cache", "rewrite.report"),
    ("rewrite.api", "rewrite.loops", "rewrite.define"),
    ("rewrite.testing",),
    ("rewrite",),
)

#: the modules that run a rewrite, each through ``pipeline.run_pipeline`` and nothing else
PIPELINE_CALLERS = {"rewrite.api", "rewrite.define", "rewrite.grad.primitive", "rewrite.grad.together",
                    "rewrite.grad.vjp", "rewrite.testing._check_rule"}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources(package: str) -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(package: str) -> list[tuple[str, str, bool, int, pathlib.Path]]:
    """(importer, imported module, inside a function, line, file) for every import of a module of ``package``."""
    modules = _sources(package)
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                targets: list[str] = []
                if isinstance(child, ast.ImportFrom):
                    base = (child.module or "").split(".") if child.level == 0 else (
                        here[:len(here) - (child.level - 1)] + ([child.module] if child.module else []))
                    base_name = ".".join(p for p in base if p)
                    for alias in child.names:
                        full = f"{base_name}.{alias.name}"
                        targets.append(full if full in modules else base_name)
                elif isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                for t in targets:
                    if t in modules and t != name:
                        out.append((name, t, in_function, child.lineno, path))
                visit(child, inner)

        visit(tree, False)
    return out


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = dfs(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state:
            found = dfs(v)
            if found:
                return found
    return None


def _folder(module: str) -> str:
    """The unit of the one-way rule: a folder of ``rewrite/`` (``rewrite.rules``), or a top-level module."""
    return ".".join(module.split(".")[:2])


def test_no_import_circle_between_modules_counting_imports_inside_functions():
    for package in PACKAGES:
        edges: dict[str, set[str]] = collections.defaultdict(set)
        for importer, imported, _, _, _ in _imports(package):
            if not importer.startswith(imported + "."):  # a module reading its own package's __init__
                edges[importer].add(imported)
        assert _cycle(edges) is None, f"import circle: {' -> '.join(_cycle(edges))}"


def test_the_folders_of_rewrite_import_one_way():
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for importer, imported, _, _, _ in _imports("rewrite"):
        a, b = _folder(importer), _folder(imported)
        if a != b and a != "rewrite":  # rewrite/__init__.py re-exports from everywhere
            edges[a].add(b)
    assert _cycle(edges) is None, f"folders import each other: {' -> '.join(_cycle(edges))}"


def test_no_module_is_over_700_lines():
    long = {str(p.relative_to(ROOT)): n for package in PACKAGES for p in _sources(package).values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them along their seams): {long}"


def test_few_imports_of_project_modules_inside_functions_each_saying_why():
    inside = [(path, line) for _, _, in_function, line, path in _imports("rewrite") if in_function]
    places = sorted({(str(p.relative_to(ROOT)), line) for p, line in inside})
    assert len(places) <= MAX_FUNCTION_IMPORTS, f"imports inside functions (move them to the top): {places}"
    for path, line in places:
        text = (ROOT / path).read_text().splitlines()
        assert "#" in text[line - 1] or text[line - 2].strip().startswith("#"), (
            f"{path}:{line}: an import inside a function needs a comment saying why it is not at the top")


def test_only_jaxapi_imports_jax_internals():
    """Every use of ``jax._src`` goes through ``rewrite/ir/jaxapi.py``, where each says what it stands in for."""
    allowed = ROOT / "rewrite" / "ir" / "jaxapi.py"
    found = []
    for package in PACKAGES:
        for path in _sources(package).values():
            if path == allowed:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                         else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                if any(n == "jax._src" or n.startswith("jax._src.") for n in names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"import JAX's internals through rewrite/ir/jaxapi.py: {found}"


def _layer(folder: str) -> int:
    found = [i for i, layer in enumerate(LAYERS) if folder in layer]
    assert found, f"{folder} is in no layer of LAYERS: place it"
    return found[0]


def test_no_import_runs_up_the_layers():
    up = sorted({f"{path.relative_to(ROOT)}:{line} imports {imported}"
                 for importer, imported, _, line, path in _imports("rewrite")
                 if (a := _folder(importer)) != (b := _folder(imported)) and _layer(b) >= _layer(a)})
    assert not up, f"imports that run up the layers (see LAYERS): {up}"


def _calls(tree: ast.AST) -> list[tuple[str, int]]:
    """(called name, line) for every call of a plain or dotted name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            out.append((name, node.lineno))
    return out


def test_no_module_is_imported_by_name_and_the_core_never_imports_the_packs():
    found = []
    for name, path in _sources("rewrite").items():
        tree = ast.parse(path.read_text())
        for called, line in _calls(tree):
            if called in ("import_module", "__import__"):
                found.append(f"{path.relative_to(ROOT)}:{line} imports a module by name ({called})")
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n == "importlib" or n.startswith("importlib.") and n != "importlib.metadata" for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports importlib")
            if any(n == "rulesets" or n.startswith("rulesets.") for n in names) and name != "rewrite.api":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports the packs (resolve them in api.py)")
    assert not found, found


def test_one_entry_point_runs_every_rewrite():
    callers, stages = set(), []
    for name, path in _sources("rewrite").items():
        calls = _calls(ast.parse(path.read_text()))
        if any(c == "run_pipeline" for c, _ in calls) and name != "rewrite.pipeline":
            callers.add(name)
        if name != "rewrite.pipeline":
            stages += [f"{path.relative_to(ROOT)}:{line} runs {c}" for c, line in calls
                       if c in ("Engine", "worth_their_saving", "bar_preferred", "input_cost")]
    assert callers == PIPELINE_CALLERS, f"modules that run a rewrite: {sorted(callers)}"
    assert not stages, f"stages run outside pipeline.run_pipeline: {stages}"


def test_comments_name_no_stage_numbers_and_no_module_that_is_gone():
    """Docstrings and comments say where things are now: no numbered stages (the numbered modules are gone)
    and no ``_module.name`` reference to a module that does not exist."""
    modules = {p.stem for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    found = []
    for package in PACKAGES:
        for path in _sources(package).values():
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\bStage \d", line):
                    found.append(f"{path.relative_to(ROOT)}:{i}: a stage number")
                for mod in re.findall(r"``(_[a-z][a-z_]*)\.[A-Za-z_]", line):
                    if mod not in modules:
                        found.append(f"{path.relative_to(ROOT)}:{i}: names {mod}, which is no module")
    assert not found, found


def _code_lines(path: pathlib.Path) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a docstring."""
    src = path.read_text()
    docs = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and (
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


#: The identity packs' code, held where it stood before guards were added (each guard kept, the code made
#: shorter): a new rule there earns its lines by what it does.
IDENTITY_PACKS_CODE_LINES = 748


def test_the_identity_packs_stay_within_their_code_lines():
    files = [ROOT / "rulesets" / f"{name}.py" for name in ("algebra", "fastmath", "derivatives")]
    counts = {f.stem: _code_lines(f) for f in files}
    assert sum(counts.values()) <= IDENTITY_PACKS_CODE_LINES, counts


def test_the_packs_define_rules_one_way_checked_when_defined():
    """Every pack calls ``rewrite.rule`` as it is: no pack rebinds it or turns its check off, so a malformed
    rule of a pack fails when the pack is loaded, naming the rule, as a user's rule does."""
    found = []
    for path in _sources("rulesets").values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "rule" for t in node.targets):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} rebinds rule")
            if isinstance(node, ast.ImportFrom) and any(a.name == "rule" and a.asname for a in node.names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports rule under another name")
            if isinstance(node, ast.keyword) and node.arg == "check":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} passes check=")
    assert not found, found


def _rules_defined(path: pathlib.Path) -> int:
    """How many rules a pack's file defines: its calls of ``rule``."""
    return sum(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "rule"
               for node in ast.walk(ast.parse(path.read_text())))


#: The LM head's lines per rule: every line of ``rulesets/nn_lm_head.py`` (blank, comment and docstring lines
#: too) over the rules it defines; the kernels the rules call, the public ``rulesets/nn_lm_head_kernels.py``, are
#: not counted. A new rule earns its lines; a helper that other packs could use belongs in the rules language.
LM_HEAD_LINES_PER_RULE = 47.4


def _lines_and_rules(*names: str) -> tuple[int, int]:
    paths = [ROOT / "rulesets" / name for name in names]
    return sum(len(p.read_text().splitlines()) for p in paths), sum(_rules_defined(p) for p in paths)


def test_the_lm_head_reads_as_its_rules():
    lines, rules = _lines_and_rules("nn_lm_head.py")
    assert rules and lines / rules <= LM_HEAD_LINES_PER_RULE, f"{lines} lines for {rules} rules"


#: Attention's lines per rule: every line of ``rulesets/attention.py`` and ``rulesets/_fused_attention.py`` (the
#: rule files: the rules and the matching that maps a program onto a kernel) over the rules they define; the
#: kernels the rules call, ``rulesets/kernels/attention.py``, and the readers of a matched program in the rules
#: language (``rewrite/rules/sliced.py``: ``Sliced.affine``, ``Sliced.blocks``; ``Value.max_under``) are not counted.
ATTENTION_LINES_PER_RULE = 67.0


def test_attention_reads_as_its_rules():
    lines, rules = _lines_and_rules("attention.py", "_fused_attention.py")
    assert rules and lines / rules <= ATTENTION_LINES_PER_RULE, f"{lines} lines for {rules} rules"


def test_the_packs_read_a_sliced_program_by_field_names():
    """No pack unpacks a :class:`rewrite.Sliced`'s steps by position (``prim, params, args, aval, _ = steps[i]``)
    or indexes one (``steps[i][4]``): a step is a record read by its fields."""
    found = []
    for path in _sources("rulesets").values():
        for node in ast.walk(ast.parse(path.read_text())):
            steps = lambda n: isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and \
                n.value.attr == "steps"  # noqa: E731
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and steps(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} unpacks a step")
            if isinstance(node, ast.Subscript) and steps(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} indexes a step")
    assert not found, found


def _nested_defs(fn: ast.AST) -> list[ast.FunctionDef]:
    """The functions defined directly in ``fn``'s body (in its blocks too, not inside another def or class)."""
    out: list = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append(child)
            elif not isinstance(child, (ast.Lambda, ast.ClassDef)):
                visit(child)

    visit(fn)
    return out


def test_every_recursive_closure_is_deleted_by_the_function_that_made_it():
    """A nested function that calls itself (or calls one that calls it back) holds itself through its closure's
    cell: a reference cycle, which keeps everything it reads (a program, an extractor and its e-graph) alive until a
    collection finds it. The function that made it deletes it (``del name``: the cell is emptied), as
    ``Extractor.dag_cost`` does; a first call then leaves no cycle of its own (``tests/test_held_memory.py``)."""
    kept = []
    for package in PACKAGES:
        for name, path in _sources(package).items():
            for outer in ast.walk(ast.parse(path.read_text())):
                if not isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                defs = _nested_defs(outer)
                names = {d.name for d in defs}
                deleted = {n.id for d in ast.walk(outer) if isinstance(d, ast.Delete)
                           for t in d.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                # a closure that calls a nested function holds that one's cell, which ``del`` empties
                held = {d.name: {n.id for n in ast.walk(d) if isinstance(n, ast.Name) and n.id in names - deleted}
                        for d in defs}
                cycle = _cycle(held)
                if cycle:
                    kept.append(f"{name}: {outer.name}: {' -> '.join(cycle)}")
    assert not kept, kept
