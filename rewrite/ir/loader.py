"""The loader relation: nodes, unions and facts written as rows of one relation to a file that egglog reads.

Even in chunks, egglog compiles each chunk's rule, some 30 us an action.
Nodes whose arguments are all ``Term`` or ``i64`` (most of them), unions
and facts are therefore written as rows of the loader relation (``Load``:
the kind's id, the name, then the arguments) to a tab-separated file that
egglog reads with ``input``, and rules declared once with the schema
(:func:`loader_program`) turn the rows into nodes: a tenth of the cost.
So do two nodes with a short list argument (:data:`LIST_ROWS`). The
expression helpers (:func:`call`, :func:`v_expr`, ...) build what cannot
be a row. :func:`commands` parses the texts an e-graph declares (the schema, the
loader, the rules' queries), a form at a time and once per process.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import os
import shutil
import tempfile
import threading
from typing import Any, Sequence

from egglog import bindings as eb

from . import terms as _terms


_SPAN = eb.PanicSpan()


def call(name: str, *args: Any) -> Any:
    return eb.Call(_SPAN, name, list(args))


def int_lit(n: int) -> Any:
    return eb.Lit(_SPAN, eb.Int(int(n)))


def v_expr(vid: int) -> Any:
    return call("V", int_lit(vid))


def tlist_expr(vids: Sequence[int]) -> Any:
    """The egglog expression of a ``TList`` of the named classes."""
    expr = call("TNil")
    for vid in reversed(vids):
        expr = call("TCons", v_expr(vid), expr)
    return expr


#: the ruleset of the loader rules, and the relation they read (never extracted, never counted)
LOADER = "load_rows"


LOAD = "Load"


@dataclasses.dataclass(frozen=True)
class _Loader:
    """The loader relation's declarations (``text``) and the kinds of row it takes, by id."""

    text: str
    ids: dict[str, int]     # kind (a flat constructor, "union", a fact, a relation on params) -> id
    kinds: tuple[str, ...]  # id -> kind
    lines: tuple[str, ...]  # a row's length -> its line's format: its columns, zeros for the rest, a newline
    params: frozenset[str]  # the kinds that are relations on params ids
    #: (constructor, length) -> kind id, for nodes whose one list argument has that many items (see LIST_ROWS)
    lists: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)


#: Nodes with one list argument that programs make often, loaded from rows at the list lengths named
#: here: ``select_n`` of two cases, an opaque call of one to three operands, a ``dynamic_slice`` of three
#: or four indices and a ``dynamic_update_slice`` of two or four (a loop body's reads and writes). As
#: actions, each costs egglog some 60-80 us to compile in its flush's rule; each kind of row costs a loader
#: rule, copied at every ``push`` and ``pop`` (see ``ir/egraph.py``'s ``_POOL``), and the relation is as
#: wide as its widest kind (zeros fill a shorter row), so only the common ones are rows.
LIST_ROWS = (("SelectN", 2), ("Opaque", 1), ("Opaque", 2), ("Opaque", 3), ("DynamicSlice", 3), ("DynamicSlice", 4),
             ("DynamicUpdateSlice", 2), ("DynamicUpdateSlice", 4))


@functools.lru_cache(maxsize=8)
def _loader(schema: str) -> _Loader:
    kinds: list[tuple[str, int, str]] = []  # kind, columns it uses, action
    for ctor in _terms.flat_ctors():  # the table's, which ``schema`` was made from
        sorts = _terms.ctor_arg_sorts(ctor)
        args = " ".join(f"(V a{i + 1})" if srt == "Term" else f"a{i + 1}" for i, srt in enumerate(sorts))
        kinds.append((ctor, 1 + len(sorts), f"(union (V a0) ({ctor} {args}))"))
    lists: dict[tuple[str, int], int] = {}
    for ctor, n in LIST_ROWS:
        try:
            sorts = _terms.ctor_arg_sorts(ctor)
        except KeyError:  # not a constructor of this table
            continue
        if _terms.ctor_sort(ctor) != "Term" or [s for s in sorts if s not in ("Term", "i64")] != ["TList"]:
            continue  # a node of another sort, or not with exactly one list argument
        parts, col = [], 1
        for srt in sorts:
            if srt == "TList":
                parts.append(_terms.tlist_text([f"(V a{col + j})" for j in range(n)]))
                col += n
            else:
                parts.append(f"(V a{col})" if srt == "Term" else f"a{col}")
                col += 1
        lists[(ctor, n)] = len(kinds)
        kinds.append((f"{ctor}/{n}", col, f"(union (V a0) ({ctor} {' '.join(parts)}))"))
    kinds.append(("union", 2, "(union (V a0) (V a1))"))
    kinds += [(fact, 1, f"({fact} (V a0))") for fact in _terms.FACTS]
    kinds += [(rel, 1, f"({rel} a0)") for rel in _terms.param_relations()]
    cols = max(n for _, n, _ in kinds)
    args = " ".join(f"a{i}" for i in range(cols))
    lines = [f"(ruleset {LOADER})", f"(relation {LOAD} ({' '.join(['i64'] * (1 + cols))}))"]
    lines += [f'(rule (({LOAD} {k} {args})) ({action}) :ruleset {LOADER} :name "L_{kind}")'
              for k, (kind, _, action) in enumerate(kinds)]
    formats = tuple("\t".join(["%d"] * n) + "\t0" * (1 + cols - n) + "\n" for n in range(2 + cols))
    return _Loader("\n".join(lines), {kind: k for k, (kind, _, _) in enumerate(kinds)},
                   tuple(kind for kind, _, _ in kinds), formats, frozenset(_terms.param_relations()), lists)


def loader_program(schema: str) -> str:
    """The loader relation and its rules, for the constructors of ``schema`` whose arguments are flat.

    Every row of ``Load`` starts with the id of its kind (zeros fill the
    columns a kind does not use). A constructor's row ``k v a b ...`` makes
    ``(union (V v) (<ctor> (V a) (V b) ...))`` (an ``i64`` argument is taken
    as it is); a ``union`` row ``k a b`` unions two names, a fact's row
    ``k v`` asserts the fact of a name, and a row of a relation on params ids
    ``k p`` adds ``p`` to it. One relation, not one per kind: every
    declaration costs at every ``push`` and ``pop`` (see :data:`_POOL`), and
    a flush then writes one file.
    """
    return _loader(schema).text


@functools.lru_cache(maxsize=8)
def _flat_ctors(schema: str) -> frozenset[str]:
    return frozenset(_terms.flat_ctors())  # the table's, which ``schema`` was made from


class _Rows:
    """Rows for the loader relation, written to a file that egglog reads (``input``), then run."""

    _dir: str | None = None
    _count = itertools.count()
    _lock = threading.Lock()

    @classmethod
    def folder(cls) -> str:
        if cls._dir is not None:
            return cls._dir
        with cls._lock:
            if cls._dir is None:
                # In memory where there is such a folder (Linux): a file there is made and removed
                # in a few microseconds, a tenth of what a disk's file system takes.
                shm = "/dev/shm"
                try:
                    made = tempfile.mkdtemp(prefix="rewrite-egraph-", dir=shm if os.path.isdir(shm) else None)
                except OSError:
                    made = tempfile.mkdtemp(prefix="rewrite-egraph-")
                atexit.register(shutil.rmtree, made, True)
                cls._dir = made
            return cls._dir

    @classmethod
    def commands(cls, rows: list[tuple[int, ...]], loader: _Loader) -> tuple[list[Any], list[str]]:
        """The ``input`` command for ``rows``, and the file it reads (to remove afterwards)."""
        path = f"{cls.folder()}/{os.getpid()}-{next(cls._count)}.tsv"
        lines = loader.lines  # (a row's columns are ints: ``%d`` writes each as ``str`` does, in a third of the time)
        data = "".join([lines[len(r)] % r for r in rows]).encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # (no text layer: a third of the time)
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            os.close(fd)
            os.remove(path)
            raise
        os.close(fd)
        return [eb.Input(_SPAN, LOAD, path)], [path]

    @staticmethod
    def actions(rows: list[tuple[int, ...]], loader: _Loader) -> list[Any]:
        """The egglog actions that do what ``rows`` do (when they cannot be written to a file)."""
        out: list[Any] = []
        for k, *r in rows:
            kind = loader.kinds[k]
            if kind == "union":
                out.append(eb.Union(_SPAN, v_expr(r[0]), v_expr(r[1])))
            elif kind in _terms.FACTS:
                out.append(eb.Expr_(_SPAN, call(kind, v_expr(r[0]))))
            elif kind in loader.params:
                out.append(eb.Expr_(_SPAN, call(kind, int_lit(r[0]))))  # a relation on params ids
            elif "/" in kind:  # a node with a list argument (LIST_ROWS)
                ctor, n = kind.split("/")
                it = iter(r[1:])
                args = []
                for srt in _terms.ctor_arg_sorts(ctor):
                    if srt == "TList":
                        args.append(tlist_expr([next(it) for _ in range(int(n))]))
                    else:
                        a = next(it)
                        args.append(v_expr(a) if srt == "Term" else int_lit(a))
                out.append(eb.Union(_SPAN, v_expr(r[0]), call(ctor, *args)))
            else:
                sorts = _terms.ctor_arg_sorts(kind)
                args = [v_expr(a) if srt == "Term" else int_lit(a) for srt, a in zip(sorts, r[1:])]
                out.append(eb.Union(_SPAN, v_expr(r[0]), call(kind, *args)))
        return out


#: The commands of the texts parsed last (:func:`commands`), by text.
_PARSED: dict[str, list[Any]] = {}
_PARSED_TEXTS = 16
_PARSED_LOCK = threading.Lock()


def commands(eg: Any, text: str) -> list[Any]:
    """The egglog commands of ``text`` (run with ``eg.run_program``), parsed once per process (the last few texts).

    egglog 13 gives every node of a parsed command a span that holds the whole text: parsing a text of n forms
    at once copies it into each of them (the rules' queries of the benchmarks' packs, 200 forms of 25 kB: 35-80
    ms), and running those commands copies it again (115-145 ms, where the same commands parsed a form at a time
    run in 30-50 ms). So a text is parsed a top-level form at a time (:func:`forms`), and its commands, which
    hold no state of the e-graph they were parsed by, are kept and run again on the next e-graph that declares
    it: another pooled instance, another thread's."""
    with _PARSED_LOCK:
        found = _PARSED.pop(text, None)
        if found is not None:
            _PARSED[text] = found  # most recently used last
            return found
    parts = forms(text)
    found = [c for part in parts for c in eg.parse_program(part)] if parts is not None else eg.parse_program(text)
    with _PARSED_LOCK:
        _PARSED[text] = found
        while len(_PARSED) > _PARSED_TEXTS:
            del _PARSED[next(iter(_PARSED))]
    return found


def forms(text: str) -> list[str] | None:
    """``text``'s top-level parenthesised forms, in order, with strings and ``;`` comments read as egglog reads
    them; ``None`` where it holds anything else at the top level or its parentheses do not balance (parsed
    whole, egglog reports the error)."""
    out: list[str] = []
    depth, start, i, n = 0, 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            if i >= n:
                return None
        elif c == ";":
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif c == "(":
            if depth == 0:
                start = i
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                return None
            if depth == 0:
                out.append(text[start:i + 1])
        elif depth == 0 and not c.isspace():
            return None
        i += 1
    return out if depth == 0 else None
