"""The chaos runs alone on the machine while the suite runs in several processes.

The harness kills and freezes servers, workers and MariaDB and holds each
recovery to a time bound, within a wall-clock budget for the whole run; the
other process's tests running beside it (live servers, private MariaDB
servers) made a slow hour's run miss that budget. Every test of every
process holds a shared lock for its whole protocol (setup, call, teardown)
and a chaos test an exclusive one, so while a chaos run goes the other
process waits between two tests. A turnstile lock keeps the shared holders
from starving the exclusive one: each test passes through it, and a chaos
test holds it while it waits for the tests in flight to end."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHAOS_TESTS = "tests/chaos/"


def _lock_path(name: str) -> Path | None:
    """A lock file shared by the processes of this run only, or None when the
    suite runs in one process (nothing to keep apart)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run or "PYTEST_XDIST_WORKER" not in os.environ:
        return None
    return Path(tempfile.gettempdir()) / f"orbit-tests-{run}-{name}.lock"


@contextmanager
def _held(path: Path, mode: int) -> Iterator[None]:
    with path.open("a") as file:
        fcntl.flock(file, mode)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


@contextmanager
def turn_of(item: pytest.Item) -> Iterator[None]:
    """Around `item`'s whole protocol: alone if it is a chaos test, else beside
    any other test but no chaos test."""
    turnstile, room = _lock_path("turnstile"), _lock_path("room")
    if turnstile is None or room is None:
        yield
        return
    if item.nodeid.startswith(CHAOS_TESTS):
        with _held(turnstile, fcntl.LOCK_EX), _held(room, fcntl.LOCK_EX):
            yield
        return
    with _held(turnstile, fcntl.LOCK_EX):
        pass  # waits while a chaos test holds it
    with _held(room, fcntl.LOCK_SH):
        yield
