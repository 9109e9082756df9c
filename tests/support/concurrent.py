"""Independent scenarios run side by side in one test, each in a thread of its own.

For scenarios that each wait out the same fixed server deadline (a hello or
acknowledgement timeout, a header deadline) against the same live server: run
one after another, the test waits that deadline once per scenario; side by
side, about once. Every scenario keeps every check it makes alone; a failure in
any is the test's failure, named by its scenario."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from django.db import connection


class ScenarioFailed(AssertionError):
    """A scenario's failure, re-raised in the test's thread with the scenario's name."""


def concurrently(
    scenarios: Mapping[str, Callable[[], Any]], *, after: Mapping[str, float] | None = None, timeout: float = 120
) -> dict[str, Any]:
    """Runs every scenario in a thread of its own (scenario `name` begins `after[name]`
    seconds after the first, default 0: a stagger keeps deadlines that must not coincide
    apart); waits for all of them and returns their results by name. Each thread has its
    own database connection (closed when its scenario ends) and works in the test's cell
    (tests/support/suite_cells.py). Fails with every scenario's error, the first one chained."""
    delays = dict(after or {})
    assert set(delays) <= set(scenarios), set(delays) - set(scenarios)
    results: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    began = time.monotonic()

    def run(name: str, work: Callable[[], Any]) -> None:
        try:
            time.sleep(max(0.0, began + delays.get(name, 0.0) - time.monotonic()))
            results[name] = work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread below
            errors[name] = exc
        finally:
            connection.close()

    threads = [
        threading.Thread(target=run, args=(name, work), name=f"scenario-{name}", daemon=True)
        for name, work in scenarios.items()
    ]
    for thread in threads:
        thread.start()
    deadline = began + timeout
    for thread in threads:
        thread.join(timeout=max(0.1, deadline - time.monotonic()))
    hung = [thread.name for thread in threads if thread.is_alive()]
    assert not hung, f"scenarios still running after {timeout}s: {hung}"
    if errors:
        summary = "; ".join(f"{name}: {type(exc).__name__}: {exc}" for name, exc in errors.items())
        raise ScenarioFailed(f"{len(errors)} of {len(scenarios)} scenarios failed — {summary}") from next(
            iter(errors.values())
        )
    return results
