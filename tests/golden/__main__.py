"""``python -m tests.golden``: regenerate the golden files, or compare them (see ``tests/golden/__init__.py``)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tests.golden import HERE, check, on_backend, select, stale, update


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.golden", description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", help="packs or pack/program keys (default: every case)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--update", action="store_true", help="rewrite the golden files from what the packs do now")
    mode.add_argument("--check", action="store_true", help="compare, printing a diff for each mismatch")
    ap.add_argument("--programs-only", action="store_true", help="with --check: ignore which rules fired")
    ap.add_argument("--out", type=Path, help="with --update: write under this folder instead (to compare two runs)")
    opts = ap.parse_args(argv)
    if on_backend() is not None:
        ap.error(on_backend())
    chosen = select(opts.cases)
    failed = 0
    for case in chosen:
        t = time.perf_counter()
        if opts.update:
            changed = update(case, opts.out)
            print(f"{case.key}: {'written' if changed else 'unchanged'} ({time.perf_counter() - t:.1f} s)")
        else:
            report = check(case, programs_only=opts.programs_only)
            print(f"{case.key}: {'ok' if report is None else 'DIFFERS'} ({time.perf_counter() - t:.1f} s)")
            if report is not None:
                failed += 1
                print(report)
    if not opts.cases and opts.out is None:
        for path in stale():
            if opts.update:
                path.unlink()
                print(f"removed {path.relative_to(HERE)} (no case writes it)")
            else:
                failed += 1
                print(f"stale: {path.relative_to(HERE)} (no case writes it; --update removes it)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
