"""tests/support/alone.py: with the suite in several processes, a chaos test
runs while no other test does, and other tests run side by side."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.alone import turn_of


def item(nodeid: str) -> Any:
    return SimpleNamespace(nodeid=nodeid)


@pytest.fixture
def two_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"alone-{time.monotonic_ns()}")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")


def running(nodeid: str, inside: threading.Event, leave: threading.Event) -> threading.Thread:
    """A thread that runs `nodeid`'s turn: sets `inside` once in, stays until `leave`."""

    def run() -> None:
        with turn_of(item(nodeid)):
            inside.set()
            assert leave.wait(10)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_other_tests_share_and_a_chaos_test_waits_for_them_then_runs_alone(two_processes: None) -> None:
    # given two ordinary tests in their turn at once
    first_in, second_in, chaos_in, late_in = (threading.Event() for _ in range(4))
    let_first_go, let_second_go, let_chaos_go, let_late_go = (threading.Event() for _ in range(4))
    first = running("tests/queues/test_a.py::test_one", first_in, let_first_go)
    second = running("tests/tasks/test_b.py::test_two", second_in, let_second_go)
    assert first_in.wait(5) and second_in.wait(5)
    # when a chaos test asks for its turn, then another ordinary test
    chaos = running("tests/chaos/test_chaos.py::test_run", chaos_in, let_chaos_go)
    time.sleep(0.3)
    late = running("tests/orbit/test_c.py::test_three", late_in, let_late_go)
    # then the chaos test waits for both in flight, and the later test waits for it
    assert not chaos_in.wait(0.5)
    let_first_go.set()
    assert not chaos_in.wait(0.5)
    let_second_go.set()
    assert chaos_in.wait(5)
    assert not late_in.wait(0.5)
    let_chaos_go.set()
    assert late_in.wait(5)
    let_late_go.set()
    for thread in (first, second, chaos, late):
        thread.join(5)
        assert not thread.is_alive()


def test_in_one_process_nothing_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    with turn_of(item("tests/chaos/test_chaos.py::test_run")), turn_of(item("tests/queues/test_a.py::test_one")):
        pass  # an exclusive and a shared turn at once: no lock taken
