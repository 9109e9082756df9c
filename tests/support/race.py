"""Real races on the database: threads released together, each on its own connection."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import connection


def race(count: int, work: Callable[[int], Any]) -> list[Any]:
    """Runs work(i) in `count` threads released together; returns results in order."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[index] = work(index)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a racing thread hung"
    assert not errors, errors
    return results
