"""Fixtures of the keyed-concurrency tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.keys import Worker


@pytest.fixture
def connect(db: None, orbit_server: Any) -> Iterator[Callable[..., Worker]]:
    """connect(tenant, queues, worker_id, capacity=1, concurrency_keys=True) → a helloed Worker
    (its hello.ok is `worker.welcome`).

    Every connection is closed at teardown (before the test database is
    flushed), so a failed test leaves no dispatcher leasing in the live server."""
    opened: list[Worker] = []

    def open_worker(
        tenant: Any, queues: list[str], worker_id: str, capacity: int = 1, concurrency_keys: bool = True
    ) -> Worker:
        worker = Worker(orbit_server.url, tenant.token)
        opened.append(worker)
        worker.welcome = worker.hello(queues, capacity=capacity, worker_id=worker_id, concurrency_keys=concurrency_keys)
        return worker

    yield open_worker
    for worker in opened:
        with contextlib.suppress(Exception):  # already closed or dropped by the test
            worker.close()
