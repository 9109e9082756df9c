"""Running an orbit_sdk.Worker against the scripted FakeServer (tests/support/fake_server.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import orbit_sdk
from tests.support.fake_server import FakeServer

T = TypeVar("T")

TOKEN = "orb_0123456789abcdef0123456789abcdef_secretsecretsecretsecret"


def run(scenario: Callable[[], Coroutine[Any, Any, T]], timeout: float = 3.0) -> T:
    return asyncio.run(asyncio.wait_for(scenario(), timeout))


def make_worker(server: FakeServer, handlers: dict[Any, Any], **kwargs: Any) -> orbit_sdk.Worker:
    options: dict[str, Any] = {
        "worker_id": "w1",
        "request_timeout": 0.5,
        "min_reconnect_delay": 0.02,
        "max_reconnect_delay": 0.1,
    }
    options.update(kwargs)
    return orbit_sdk.Worker(server.url, TOKEN, ["q1"], handlers, **options)


@contextlib.asynccontextmanager
async def running(worker: orbit_sdk.Worker) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(worker.run_async())
    try:
        yield task
    finally:
        if not task.done():
            worker.stop(timeout=0)  # at once: a test may leave a handler blocked
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 1.0)


def recv_types(server: FakeServer, *, skip: tuple[str, ...] = ("task.renew",)) -> list[str]:
    return [frame["type"] for direction, frame in server.log if direction == "recv" and frame["type"] not in skip]
