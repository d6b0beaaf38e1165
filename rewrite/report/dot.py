"""Drawing a small e-graph: Graphviz DOT source for ``Report.to_dot()``.

Each e-class the final program can reach is a cluster; each e-node in it is a
box labelled with its primitive (and short params); the node the extractor
chose is bold and filled. Edges go from a node to the classes of its operands.
Bodies (of scan, cond, ...) are drawn in the same picture, their inputs as
``param`` nodes. For large programs only the first ``max_classes`` classes
are drawn.
"""

from __future__ import annotations

import html
import shutil
import subprocess
from typing import Any

import itertools

from ..extract.choice import reachable
from ..ir import primitives as _primitives
from ..ir.intern import LITERALS, PARAMS
from ..ir.walk import children, walk

_HIDDEN_PARAMS = {"sharding", "out_sharding", "accuracy", "out_dtype", "_rw_order", "_rw_sliced", "_rw_inplace"}


def _label(ctor: str, args: tuple) -> str:
    if ctor == "Lit":
        return f"{LITERALS[args[0]][1]}"
    if ctor == "Param":
        return f"param {args[0]}.{args[1]}"
    if ctor == "Const":
        return "const"
    if ctor == "Proj":
        return f"#{args[1]}"
    if ctor == "Tok":
        return "token"
    if ctor in _primitives.BY_CTOR or ctor in ("Opaque", "Effect"):
        prim, params = PARAMS[args[-1]][0], PARAMS[args[-1]][1]
        shown = {k: v for k, v in params.items()
                 if k not in _HIDDEN_PARAMS and v is not None and not hasattr(v, "jaxpr") and len(repr(v)) < 30}
        extra = ", ".join(f"{k}={v}" for k, v in shown.items())
        return f"{prim.name}" + (f"[{extra}]" if extra else "")
    return ctor


def to_dot(result: Any, max_classes: int = 200) -> str:
    snap, choice, roots = result.snapshot, result.choice, result.roots
    if snap is None or choice is None:
        raise ValueError("this report kept no e-graph; use explain() to get one")
    # every node of each class, not only the chosen one: the picture shows the alternatives
    everything = walk(roots, lambda c: [k for n in snap.nodes.get(c, []) for k in children(n)])
    order = list(itertools.islice(everything, max_classes))
    ids = {c: i for i, c in enumerate(order)}
    used = reachable(snap, choice, roots)
    lines = ["digraph egraph {", "  compound=true; rankdir=BT; node [shape=box, fontname=monospace, fontsize=10];"]
    edges = []
    for c in order:
        i = ids[c]
        try:
            aval = snap.aval(c)
            title = getattr(aval, "str_short", lambda **k: str(aval))(short_dtypes=True) if hasattr(aval, "shape") else "tuple"
        except KeyError:
            title = ""
        lines.append(f"  subgraph cluster_{i} {{ style=dashed; color=gray; label=\"{html.escape(title)}\";")
        lines.append(f"    anchor_{i} [shape=point, style=invis];")
        for j, (ctor, args) in enumerate(snap.nodes.get(c, [])):
            chosen = c in used and choice.get(c) == (ctor, args)
            style = ", style=\"bold,filled\", fillcolor=\"#dde8ff\"" if chosen else ""
            lines.append(f"    n{i}_{j} [label=\"{html.escape(_label(ctor, args))}\"{style}];")
            for a in children((ctor, args)):
                if a in ids:
                    edges.append(f"  n{i}_{j} -> anchor_{ids[a]} [lhead=cluster_{ids[a]}];")
        lines.append("  }")
    lines += edges
    lines.append("}")
    return "\n".join(lines)


def to_svg(dot: str) -> str:
    """Render DOT with Graphviz's ``dot`` program (``apt-get install graphviz``)."""
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError("rendering needs Graphviz's `dot` program (Debian: apt-get install graphviz); "
                           "Report.to_dot() gives the source without it")
    return subprocess.run([exe, "-Tsvg"], input=dot, capture_output=True, text=True, check=True).stdout
