"""The scratch XLA:CPU's library (YNN) fusions hold while they run, which ``memory_analysis()`` does not count.

XLA:CPU hands a library fusion (``"kind":"__ynn_fusion"``) to its YNN runtime whole: the fusion's own result is
one of the program's buffers (``memory_analysis`` counts it), but the values computed inside it are the runtime's,
in a scratch it allocates at every call. Plain attention compiled whole is one such fusion holding both products
and the softmax: ``memory_analysis`` reports 0 bytes of temp, while the process's peak resident memory grows by the
N x N scores (``benchmarks/results/attention_rss.md``). :func:`scratch_bytes` reads that scratch from the compiled
HLO: for each library fusion, the largest value computed inside it but not its result (broadcasts, constants,
parameters, bitcasts and reshapes take no memory of their own), the fusions run one at a time, so the program's
scratch is the largest fusion's. Checked against the peak resident memory's growth of one call in a fresh process
(:func:`rss_one`; ``python -m benchmarks.library_scratch``, the table in ``benchmarks/results/attention_rss.md``).
"""

from __future__ import annotations

import re
from typing import Any

#: bytes per element of the HLO element types
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
            "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
#: instructions of a fusion's computation that hold no memory of their own inside the library's runtime
NO_BUFFER = {"parameter", "constant", "broadcast", "bitcast", "reshape", "iota", "tuple", "get-tuple-element"}

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (\(?[\w\[\],{}: ]*?\)?) ([\w\-]+)\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def _bytes(shape: str) -> int:
    """The bytes of an HLO shape (a tuple's: the sum of its elements')."""
    total = 0
    for dtype, dims in _SHAPE.findall(shape):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * ITEMSIZE.get(dtype, 4)
    return total


def computations(hlo: str) -> dict[str, list[tuple[str, str, int, bool, list[str]]]]:
    """Each computation of the HLO text: its instructions as (name, opcode, bytes, is the root, operands)."""
    out: dict[str, list[tuple[str, str, int, bool, list[str]]]] = {}
    current: list | None = None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is None:
            continue
        i = _INSTRUCTION.match(line)
        if i:
            rest = line[i.end():]
            depth, end = 1, 0
            for end, ch in enumerate(rest):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    break
            operands = re.findall(r"%([\w.\-]+)", rest[:end])
            current.append((i.group(2), i.group(4), _bytes(i.group(3)), bool(i.group(1)), operands))
    return out


def library_fusions(hlo: str) -> list[str]:
    """The names of the computations that library (YNN) fusions call."""
    return [m.group(1) for line in hlo.splitlines() if "__ynn_fusion" in line and (m := _CALLS.search(line))]


def fusion_scratch(hlo: str) -> dict[str, int]:
    """Each library fusion's scratch: the largest value its computation makes, other than its result, that two
    or more of its instructions read and that holds memory of its own (not in :data:`NO_BUFFER`).

    The library runs a chain of operations tile by tile: a value read once streams into its reader (an LM head's
    ``exp(z - m)`` into its row sum: no scratch). A value read twice is held whole until its last reader, where one
    of them is a reduction over it that the other must wait for (attention's scores: their row maximum, then
    ``exp(s - m)``). Those held values share one buffer (the exponentials are written over the scores they are
    computed from), so the fusion's scratch is the largest of them, not their sum: plain attention's one fusion
    at N=2048 holds the scores and the exponentials, 128 MiB each, and its call grows the resident memory by
    about 140 MiB, not 260 (``benchmarks/results/library_scratch.md``). Where the fusion's result is as large as
    they are, they are computed in the result's buffer: ``dot_product_attention(implementation="xla")``'s fusion,
    whose result is the probabilities, holds nothing more (its call grows the resident memory by its temp).

    jaxlib 0.12's library runs an attention fusion (two products) a few heads at a time, and holds that share of its
    scores at once: its call at N=2048 grows the resident memory by 54 MiB where 0.10's grew by 145. The HLO is the
    same, so an attention fusion's scratch is scaled by the share measured by resident memory for the installed
    jaxlib (the CPU table's ``attention_scratch``, ``benchmarks/calibrate.py --attention-scratch-only``; 1 where it
    has none)."""
    from rewrite.cost import calibration

    share = calibration.CPU.get("attention_scratch", 1.0)
    comps = computations(hlo)
    out = {}
    for name in library_fusions(hlo):
        instrs = comps.get(name, [])
        readers: dict[str, int] = {}
        for *_, operands in instrs:
            for o in set(operands):
                readers[o] = readers.get(o, 0) + 1
        held = [b for (n, op, b, root, _) in instrs if not root and op not in NO_BUFFER and readers.get(n, 0) >= 2]
        result = sum(b for (*_, b, root, _) in instrs if root)
        scratch = max(held, default=0) if max(held, default=0) > result else 0
        out[name] = int(scratch * share) if sum(op == "dot" for (_, op, *_) in instrs) >= 2 else scratch
    return out


def scratch_bytes(compiled: Any) -> int:
    """The library scratch of a compiled program (a ``jax.stages.Compiled``, or its HLO text): the largest of its
    library fusions' (:func:`fusion_scratch`), 0 where it has none.

    >>> import jax, jax.numpy as jnp
    >>> x = jnp.ones((4, 8))
    >>> scratch_bytes(jax.jit(lambda a: a * 2).lower(x).compile())
    0
    """
    hlo = compiled if isinstance(compiled, str) else compiled.as_text()
    return max(fusion_scratch(hlo).values(), default=0)


# ---------------------------------------------------------------------------------------------- checked by RSS
def _peak_since() -> Any:
    """``harness.peak_rss_since``: the growth of the peak resident memory from now, in bytes (None: not here)."""
    from benchmarks import harness  # harness reads this module's scratch count: imported here, not above

    return harness.peak_rss_since()


def _mlp() -> tuple:
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(k[0], (1024, 512), jnp.float32)
    w1 = jax.random.normal(k[1], (512, 2048), jnp.float32) / 23
    w2 = jax.random.normal(k[2], (2048, 512), jnp.float32) / 45
    b1, b2 = jax.random.normal(k[3], (2048,), jnp.float32), jax.random.normal(k[4], (512,), jnp.float32)

    def mlp(x, w1, b1, w2, b2):
        return jax.nn.relu(x @ w1 + b1) @ w2 + b2
    return mlp, (x, w1, b1, w2, b2)


def programs() -> dict[str, Any]:
    """The programs checked: name -> a function returning ``(fn, args)`` (``args`` a tuple)."""
    from benchmarks import attention as ba
    from benchmarks import lm_head as bh

    out: dict[str, Any] = {}
    for n in (1024, 2048):
        out[f"attention plain N={n}"] = lambda n=n: (ba.plain, tuple(ba.qkv_args("plain", n)))
        out[f"attention chunked N={n}"] = lambda n=n: (ba.chunked, tuple(ba.qkv_args("plain", n)))
    out["attention dpa_xla N=1024"] = lambda: (ba.dpa_xla_bhnd, tuple(ba.qkv_args("plain", 1024)))
    out["attention flax_dpa N=1024"] = lambda: (ba.flax_dpa, tuple(ba.qkv_args("flax", 1024)))
    out["attention flax_mha N=1024"] = lambda: (lambda f, x: (f, (x,)))(*ba.layers(1024)["flax_mha"])
    out["lm_head loss N=512 C=256 V=8192"] = lambda: (bh.loss, tuple(bh.args_at(512, 256, 8192)))
    out["mlp [1024, 512] -> 2048 -> 512"] = _mlp
    return out


def rss_one(spec: str) -> dict:
    """The program ``spec`` (``name;variant``: a name of :func:`programs`, ``standard`` or ``rewritten`` with the
    packs of ``benchmarks.decisions``) compiled and run once in this process (a fresh one): the growth of the peak
    resident memory over the call (reset after compiling), beside what ``memory_analysis`` says and
    :func:`scratch_bytes` reads."""
    import warnings

    import jax

    name, variant = spec.split(";")
    fn, args = programs()[name]()
    if variant == "rewritten":
        from benchmarks.decisions import packs
        from rewrite import rewrite

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn = rewrite(fn, rulesets=packs())
    c = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(args)
    since = _peak_since()
    jax.block_until_ready(c(*args))
    mem = c.memory_analysis()
    return {"program": name, "variant": variant, "rss_growth": since() if since is not None else -1,
            "temp": int(mem.temp_size_in_bytes), "output": int(mem.output_size_in_bytes), "scratch": scratch_bytes(c),
            "fusions": fusion_scratch(c.as_text())}


def rss(spec: str) -> dict:
    """:func:`rss_one` in a fresh subprocess."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "benchmarks.library_scratch", "--one", spec], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    import argparse
    import datetime
    import json
    import os
    import pathlib

    ap = argparse.ArgumentParser(prog="python -m benchmarks.library_scratch", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/library_scratch.md")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(rss_one(a.one)))
        return
    mib = 2 ** 20
    load = os.getloadavg()[0]
    lines = ["# Library scratch: read from the HLO, against the peak resident memory of one call\n",
             f"`python -m benchmarks.library_scratch --write`, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load {load:.1f}. Each program "
             "compiled and run once in a fresh process (`rewritten`: `rewrite(f, rulesets=benchmarks.decisions."
             "packs())`); RSS growth: the peak resident memory's growth over the call, reset after compiling, which "
             "counts the output, the temp `memory_analysis` reports and the library (YNN) fusions' scratch it does "
             "not (and allocator noise: a few MiB; pages already resident read as no growth). Scratch: "
             "`benchmarks.library_scratch.scratch_bytes`, the largest value a library fusion holds whole inside "
             "itself (read by two of its instructions) and not computed in its result's buffer. Expected: output + "
             "temp + scratch. `dot_product_attention(implementation=\"xla\")` (`dpa_xla`) grows by 20-25 MiB more "
             "than that at N=1024, and by 34 and 75 MiB at N=2048 and 4096 (`attention_rss.md`): not its scores "
             "(32, 128, 512 MiB), which its library fusion computes in its result, the probabilities.\n",
             "| program | variant | RSS growth MiB | temp MiB | output MiB | scratch MiB | output + temp + scratch |",
             "|---|---|---|---|---|---|---|"]
    for name in programs():
        for variant in ("standard", "rewritten"):
            r = rss(f"{name};{variant}")
            lines.append(f"| {name} | {variant} | {r['rss_growth'] / mib:.1f} | {r['temp'] / mib:.1f} | "
                         f"{r['output'] / mib:.1f} | {r['scratch'] / mib:.1f} | "
                         f"{(r['output'] + r['temp'] + r['scratch']) / mib:.1f} |")
            print(lines[-1], flush=True)
    if a.write:
        (pathlib.Path(__file__).parent / "results" / "library_scratch.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
