"""orbit_sdk.Worker against the real server (the session's live server on MariaDB):
what each kind of handler outcome becomes, a handler that outlives its lease, cancellation of
a running task, a retryable failure, keyed tasks with a capacity-2 key policy."""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest

import orbit_sdk
from orbit_sdk import Client, Execution, SubmitTaskRequest, Task, Worker
from tests.support.concurrent import concurrently
from tests.support.sdk_live import finished, new_queue, worker_for
from tests.support.tasks import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def client(orbit_server: Any, tenant: Any) -> Iterator[Client]:
    with Client(orbit_server.url, tenant.token) as sdk:
        yield sdk


@pytest.fixture
def worker_of(orbit_server: Any, tenant: Any) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def make(queue_id: str, handlers: dict[Any, Any], **options: Any) -> Worker:
        worker = worker_for(orbit_server.url, tenant, queue_id, handlers, **options)
        worker.start()
        started.append(worker)
        return worker

    yield make
    for worker in started:
        worker.stop(timeout=0)
    for worker in started:
        worker.join(10)


def submit(client: Client, queue_id: str, handler: str, payload: Any = None, **fields: Any) -> Task:
    request = SubmitTaskRequest(queue_id, handler, "v1", "v1", {} if payload is None else payload, **fields)
    return client.submit_task(f"t-{uuid.uuid4()}", request).task


# ------------------------------------------------------------------ outcomes as the README's table says


def test_handler_outcomes_reach_the_server_as_the_readme_table_says(client, worker_of):
    queue_id = new_queue(client).id

    def boom(execution: Execution) -> None:
        raise KeyError("no such row")

    def retry_once(execution: Execution) -> dict[str, int]:
        if execution.attempt_number == 1:
            raise orbit_sdk.RetryableError("try again")
        return {"attempt": execution.attempt_number}

    def unknown(execution: Execution) -> None:
        raise orbit_sdk.UnknownOutcome("the charge may have gone through")

    def not_json(execution: Execution) -> Any:
        return {"when": datetime.datetime.now(datetime.UTC)}

    def nan(execution: Execution) -> Any:
        return {"ratio": float("nan")}

    def too_deep(execution: Execution) -> Any:
        value: Any = 1
        for _ in range(21):
            value = [value]
        return value

    def just_deep_enough(execution: Execution) -> Any:
        value: Any = 1
        for _ in range(20):
            value = [value]
        return value

    def tuple_and_int_keys(execution: Execution) -> Any:
        return {1: (1, 2), "s": "é"}

    handlers = {
        ("boom", "v1"): boom,
        ("retry_once", "v1"): retry_once,
        ("unknown", "v1"): unknown,
        ("not_json", "v1"): not_json,
        ("nan", "v1"): nan,
        ("too_deep", "v1"): too_deep,
        ("deep", "v1"): just_deep_enough,
        ("keys", "v1"): tuple_and_int_keys,
    }
    worker_of(queue_id, handlers, capacity=8)
    retry = orbit_sdk.RetryPolicy(initial_seconds=1, multiplier=1, max_seconds=1)
    tasks = {
        name: submit(client, queue_id, name, retry=retry if name == "retry_once" else None)
        for name in ("boom", "retry_once", "unknown", "not_json", "nan", "too_deep", "deep", "keys")
    }
    ended = {name: finished(client, task.id) for name, task in tasks.items()}

    assert ended["boom"].state == "FAILED"
    assert ended["boom"].last_error["type"] == "KeyError"
    assert ended["retry_once"].state == "SUCCEEDED" and ended["retry_once"].attempts == 2
    assert ended["retry_once"].output == {"attempt": 2}
    assert ended["unknown"].state == "NEEDS_REVIEW"
    for name in ("not_json", "nan", "too_deep"):
        assert ended[name].state == "NEEDS_REVIEW", (name, ended[name])
        assert ended[name].last_error["type"] == "OutputNotSerializable", (name, ended[name].last_error)
    assert ended["deep"].state == "SUCCEEDED"
    assert ended["keys"].state == "SUCCEEDED" and ended["keys"].output == {"1": [1, 2], "s": "é"}


def test_an_output_at_the_documented_size_limit_is_kept_and_one_byte_more_is_not(client, worker_of):
    queue_id = new_queue(client).id
    # A JSON string of n characters is n + 2 bytes as sent.
    handlers = {
        ("at_limit", "v1"): lambda execution: "x" * (1_000_000 - 2),
        ("over_limit", "v1"): lambda execution: "x" * (1_000_000 - 1),
        ("non_ascii", "v1"): lambda execution: "é" * 166_666,  # 6 bytes each as sent, 999,998 bytes
    }
    worker_of(queue_id, handlers, capacity=3)
    at = submit(client, queue_id, "at_limit")
    over = submit(client, queue_id, "over_limit")
    non_ascii = submit(client, queue_id, "non_ascii")
    at_task, over_task, non_ascii_task = (finished(client, t.id) for t in (at, over, non_ascii))
    assert at_task.state == "SUCCEEDED" and len(at_task.output) == 999_998
    assert over_task.state == "NEEDS_REVIEW" and over_task.last_error["type"] == "OutputNotSerializable"
    assert non_ascii_task.state == "SUCCEEDED" and non_ascii_task.output == "é" * 166_666


# ------------------------------------------------------------------ leases and cancellation


# Each of these waits out a lease or a renewal on the session's live server: on its own queue,
# with its own client and worker, so they run side by side (tests/support/concurrent.py) and the
# test waits about the longest of them (8 s) rather than their sum.


def a_handler_that_outlives_its_lease_is_renewed_and_succeeds_once(
    url: str, tenant: Any, worker_of: Callable[..., Worker]
) -> None:
    with Client(url, tenant.token) as client:
        queue_id = new_queue(client).id
        seen: list[datetime.datetime | None] = []

        def slow(execution: Execution) -> dict[str, bool]:
            for _ in range(8):  # past the 5 s lease, renewed every third of it
                time.sleep(1)
                seen.append(execution.lease_expires_at)
                execution.raise_if_cancelled()
            return {"done": True}

        worker_of(queue_id, {("slow", "v1"): slow})
        task = submit(client, queue_id, "slow", lease_seconds=5)
        ended = finished(client, task.id, timeout=30)
        assert ended.state == "SUCCEEDED" and ended.attempts == 1 and ended.output == {"done": True}
        (attempt,) = client.list_attempts(task.id).items
        assert attempt.state == "SUCCEEDED"
        # the handler saw its lease move forward (every renewal refreshes it)
        assert len({value for value in seen if value is not None}) >= 3


def cancelling_a_running_task_reaches_the_handler_and_ends_the_task(
    url: str, tenant: Any, worker_of: Callable[..., Worker]
) -> None:
    with Client(url, tenant.token) as client:
        queue_id = new_queue(client).id
        running = threading.Event()

        def waits(execution: Execution) -> dict[str, bool]:
            running.set()
            if execution.wait_cancelled(30):
                execution.raise_if_cancelled()
            return {"cancelled": False}

        worker_of(queue_id, {("waits", "v1"): waits})
        task = submit(client, queue_id, "waits", lease_seconds=6)
        assert running.wait(10)
        wait_until(lambda: client.get_task(task.id).state == "RUNNING", 5, "RUNNING")
        asked = time.monotonic()
        cancelled = client.cancel_task(task.id, f"cancel-{task.id}", "audit").task
        assert cancelled.cancel_requested
        ended = finished(client, task.id, timeout=20)
        took = time.monotonic() - asked
        assert ended.state == "CANCELLED", ended
        assert took < 6, took  # seen at the next renewal: a third of the 6 s lease


def async_handler_cancellation(url: str, tenant: Any, worker_of: Callable[..., Worker]) -> None:
    with Client(url, tenant.token) as client:
        queue_id = new_queue(client).id

        async def waits(execution: Execution) -> None:
            await execution.until_cancelled()
            execution.raise_if_cancelled()

        worker_of(queue_id, {("waits", "v1"): waits})
        task = submit(client, queue_id, "waits", lease_seconds=6)
        wait_until(lambda: client.get_task(task.id).state == "RUNNING", 10, "RUNNING")
        client.cancel_task(task.id, f"cancel-{task.id}", "audit")
        assert finished(client, task.id, timeout=20).state == "CANCELLED"


def test_a_handler_outliving_its_lease_and_cancelled_running_handlers(orbit_server, tenant, worker_of):
    scenarios = {
        "outlives-its-lease": a_handler_that_outlives_its_lease_is_renewed_and_succeeds_once,
        "cancel-reaches-the-handler": cancelling_a_running_task_reaches_the_handler_and_ends_the_task,
        "async-handler-cancelled": async_handler_cancellation,
    }
    concurrently({name: partial(scenario, orbit_server.url, tenant, worker_of) for name, scenario in scenarios.items()})
