"""A test helper: work run on several threads at once, its errors collected for the test to assert on."""

from __future__ import annotations

import threading
from typing import Callable


def in_threads(work: Callable[[int], None], n: int) -> list[BaseException]:
    """Run ``work(k)`` for each ``k`` of ``range(n)``, each on a thread of its own, all started before any is
    joined; what they raised, in the order they raised it (an assertion in a thread fails nothing by itself)."""
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            work(k)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
