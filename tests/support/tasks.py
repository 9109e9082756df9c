"""Helpers shared by the task and worker-protocol tests: HTTP calls with envelope
checks, row snapshots, the invariant check, and a thread-friendly worker client."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import pytest
from django.db import connection
from django.utils import timezone
from websockets.exceptions import ConnectionClosed

from orbit.fields import new_id
from orbit.models import ApplicationState, IdempotencyRecord
from queues.models import QueueState
from tasks.actions import rounds
from tasks.actions.context import WorkerContext
from tasks.invariants import find_violations_in_snapshot
from tasks.models import Attempt, Task
from tests.conftest import post_json
from tests.support.api import assert_ok
from tests.support.live import WorkerConnection

# The keys every task object carries (SPEC §5); the optional ones appear only when set.
TASK_REQUIRED_KEYS = {
    "id",
    "namespace_id",
    "queue_id",
    "handler",
    "handler_version",
    "payload_version",
    "priority",
    "state",
    "attempts",
    "max_attempts",
    "available_at",
    "cancel_requested",
    "created_at",
    "updated_at",
}

QUEUE_FULL_ERROR = {
    "code": "QUEUE_FULL",
    "message": "queue unfinished task limit reached; retry later using the original identity",
}


# --- HTTP ---------------------------------------------------------------


def rfc3339(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def now() -> datetime:
    return datetime.now(UTC)


def in_seconds(seconds: float) -> str:
    return rfc3339(now() + timedelta(seconds=seconds))


@contextmanager
def an_hour_on() -> Iterator[None]:
    """This process's clock (django.utils.timezone.now) an hour ahead, inside.
    The session's live server sweeps the test database every 0.5 s on the real
    clock: what a transactional test sets to run out within the hour (a lease,
    a deadline) is its own sweep's alone, not a race with the server's."""
    later = timezone.now() + timedelta(hours=1)
    with mock.patch.object(timezone, "now", lambda: later):
        yield


def task_body(queue_id: str, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "queue_id": queue_id,
        "handler": "echo",
        "handler_version": "v1",
        "payload_version": "v1",
        "payload": {"n": 1},
    }
    body.update(overrides)
    return body


def numbered_task(queue_id: str, n: int, **overrides: Any) -> dict[str, Any]:
    """A task body told apart by its payload {"n": n}."""
    return task_body(queue_id, payload={"n": n}, **overrides)


def submit(client: Any, queue_id: str, key: str, **overrides: Any) -> Any:
    return post_json(client, "/v1/tasks", task_body(queue_id, **overrides), key=key)


def submit_ok(client: Any, queue_id: str, key: str, **overrides: Any) -> dict[str, Any]:
    data = assert_ok(submit(client, queue_id, key, **overrides), 201)
    assert data["deduplicated"] is False
    return data["task"]


def get_queue(client: Any, queue_id: str) -> dict[str, Any]:
    return assert_ok(client.get(f"/v1/queues/{queue_id}"))


def configure_queue(client: Any, queue_id: str, **changes: Any) -> dict[str, Any]:
    """Full replacement of the queue's controls: the current values with `changes` applied."""
    queue = get_queue(client, queue_id)
    body = {
        "expected_revision": queue["revision"],
        "reason": "test",
        "paused": queue["paused"],
        "max_concurrency": queue["max_concurrency"],
        "rate_per_second": queue["rate_per_second"],
        "max_unfinished_tasks": queue["max_unfinished_tasks"],
        **changes,
    }
    key = f"configure-{queue_id}-{queue['revision']}"
    return assert_ok(post_json(client, f"/v1/queues/{queue_id}:configure", body, key=key))


def get_task(client: Any, task_id: str) -> dict[str, Any]:
    return assert_ok(client.get(f"/v1/tasks/{task_id}"))


def cancel(client: Any, task_id: str, key: str, reason: str = "no longer needed") -> Any:
    return post_json(client, f"/v1/tasks/{task_id}:cancel", {"reason": reason}, key=key)


def assert_no_nulls(obj: dict[str, Any]) -> None:
    """Optional fields are omitted when empty, never sent as null."""
    nulls = [name for name, value in obj.items() if value is None]
    assert not nulls, f"null fields {nulls} in {obj}"


# --- rows -----------------------------------------------------------------


def counters(queue_id: str) -> dict[str, Any]:
    """The queue's and its application's counters, for before/after comparisons."""
    state = QueueState.objects.get(queue_id=queue_id)
    app = ApplicationState.objects.get(application_id=state.application_id)
    return {
        "unfinished_tasks": state.unfinished_tasks,
        "active_permits": state.active_permits,
        "reserved_starts": state.reserved_starts,
        "window_started_at": state.window_started_at,
        "window_count": state.window_count,
        "app_unfinished_tasks": app.unfinished_tasks,
        "app_active_attempts": app.active_attempts,
    }


def snapshot(task_id: str) -> dict[str, Any]:
    """The task row, its attempt rows and its queue's counters."""
    task = Task.objects.filter(id=task_id).values().get()
    attempts = list(Attempt.objects.filter(task_id=task_id).order_by("epoch").values())
    return {"task": task, "attempts": attempts, "counters": counters(task["queue_id"])}


def idempotency_records(namespace_id: str, key: str | None = None) -> int:
    records = IdempotencyRecord.objects.filter(namespace_id=namespace_id)
    if key is not None:
        records = records.filter(key=key)
    return records.count()


def assert_invariants() -> None:
    """Counters and permits agree with the rows (tasks.invariants), read from
    one consistent snapshot so a transaction a live server commits meanwhile
    cannot show up half-way as drift (inside a test case's own transaction: in
    that one)."""
    assert find_violations_in_snapshot() == []


@pytest.fixture(name="invariants")
def invariants_fixture() -> Iterator[None]:
    """Checks the invariants after the test body, whatever it asserted itself."""
    yield
    assert_invariants()


def wait_until(predicate: Callable[[], Any], timeout: float, what: str = "condition", *, interval: float = 0.05) -> Any:
    """The predicate's first true value, polled every `interval` s; fails the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def run_threads(count: int, work: Callable[[int], Any], timeout: float = 60) -> list[Any]:
    """Runs work(i) in `count` threads, each with its own database connection."""
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = work(index)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(timeout=max(0.1, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a worker thread hung"
    if errors:
        raise errors[0]
    return results


class Background:
    """Runs fn() in a thread; join() returns its result or re-raises its error."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by join()
            self.error = exc
        finally:
            connection.close()

    def join(self, timeout: float) -> Any:
        self.thread.join(timeout=timeout)
        assert not self.thread.is_alive(), "background work hung"
        if self.error is not None:
            raise self.error
        return self.result


# --- worker protocol -------------------------------------------------------


class Worker(WorkerConnection):
    """WorkerConnection plus the calls the protocol tests repeat."""

    def hello_raw(self, **fields: Any) -> dict[str, Any]:
        return self.request("hello", **fields)

    def hello_as(self, queues: list[str], capacity: int = 1, worker_id: str = "w1", **extra: Any) -> dict[str, Any]:
        fields = {
            "worker_id": worker_id,
            "queues": queues,
            "capacity": capacity,
            "handlers": [],
            "concurrency_keys": True,
            "version": "tests",
            **extra,
        }
        reply = self.request("hello", **fields)
        assert reply["type"] == "hello.ok", reply
        return reply

    def recv_frame(self, timeout: float) -> dict[str, Any] | None:
        """The next frame not yet consumed, or None on timeout."""
        if self.pending:
            return self.pending.pop(0)
        try:
            return json.loads(self.ws.recv(timeout=timeout))
        except TimeoutError:
            return None

    def assignment(self, timeout: float = 5) -> dict[str, Any]:
        frame = self.next_assignment(timeout=timeout)
        assert frame is not None, "no task.assign arrived"
        assert frame["type"] == "task.assign" and frame["id"] == frame["attempt_id"], frame
        self.send("task.assign.ack", attempt_id=frame["attempt_id"])
        return frame

    def assignments(self, count: int, timeout: float = 5) -> list[dict[str, Any]]:
        return [self.assignment(timeout) for _ in range(count)]

    def no_assignment(self, within: float) -> None:
        frame = self.next_assignment(timeout=within)
        assert frame is None, f"unexpected assignment {frame}"

    def start(self, assign: dict[str, Any]) -> dict[str, Any]:
        return self.request("task.start", attempt_id=assign["attempt_id"], epoch=assign["epoch"])

    def start_ok(self, assign: dict[str, Any]) -> dict[str, Any]:
        reply = self.start(assign)
        assert reply["type"] == "task.start.ok", reply
        return reply

    def renew(self, assign: dict[str, Any]) -> dict[str, Any]:
        return self.request("task.renew", attempt_id=assign["attempt_id"], epoch=assign["epoch"])

    def result(self, assign: dict[str, Any], outcome: str = "SUCCEEDED", **fields: Any) -> dict[str, Any]:
        fields.setdefault("retryable", False)
        return self.request(
            "task.result", attempt_id=assign["attempt_id"], epoch=assign["epoch"], outcome=outcome, **fields
        )

    def release(self, assign: dict[str, Any], reason: str = "not now") -> dict[str, Any]:
        return self.request("task.release", attempt_id=assign["attempt_id"], epoch=assign["epoch"], reason=reason)

    def wait_closed(self, timeout: float = 5) -> int | None:
        """Reads until the server closes the connection; returns the close code."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.pending.append(json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic()))))
            except TimeoutError:
                break
            except ConnectionClosed as closed:
                return closed.rcvd.code if closed.rcvd else None
        raise AssertionError("the server did not close the connection")


def assert_error_frame(frame: dict[str, Any], code: str) -> None:
    assert frame["type"] == "error" and frame["code"] == code, frame
    assert isinstance(frame["message"], str) and frame["message"], frame


@pytest.fixture(name="connect")
def connect_fixture(orbit_server: Any, tenant: Any) -> Iterator[Callable[..., Worker]]:
    """Opens worker connections to the live server; closes them all afterwards."""
    opened: list[Worker] = []

    def open_connection(token: str | None = None) -> Worker:
        worker = Worker(orbit_server.url, token or tenant.token)
        opened.append(worker)
        return worker

    yield open_connection
    for worker in opened:
        worker.close()


def worker_for(tenant, *queue_ids: str, keys: bool = True, handlers: tuple = (), worker_id: str = "w") -> WorkerContext:
    return WorkerContext(
        namespace_id=tenant.namespace_id,
        application_id=tenant.namespace.application_id,
        worker_id=worker_id,
        session_id=new_id(),
        queue_ids=tuple(queue_ids),
        handlers=handlers,
        concurrency_keys=keys,
    )


def lease_one(tenant, queue_id: str, worker_id: str = "reader-w") -> dict:
    """Leases one task of the queue through the dispatch verb, as a worker would."""
    worker = WorkerContext(
        namespace_id=tenant.namespace_id,
        application_id=tenant.namespace.application_id,
        worker_id=worker_id,
        session_id=new_id(),
        queue_ids=(queue_id,),
        handlers=(),
        concurrency_keys=True,
    )
    (assignment,) = rounds.lease_tasks(worker=worker, limit=1)
    return {"worker": worker, **assignment}


def resolve(client, task_id: str, key: str, resolution: object = "SUCCEEDED", reason: object = "checked the ledger"):
    return post_json(client, f"/v1/tasks/{task_id}:resolve", {"resolution": resolution, "reason": reason}, key=key)


def start(lease: dict) -> None:
    rounds.approve_start(worker=lease["worker"], attempt_id=lease["attempt_id"], epoch=lease["epoch"])


def report(lease: dict, outcome: str, output: object = None, error: object = None) -> dict:
    return rounds.record_result(
        worker=lease["worker"],
        attempt_id=lease["attempt_id"],
        epoch=lease["epoch"],
        outcome=outcome,
        retryable=False,
        output=output,
        error=error,
    )


def ends_unknown(tenant, queue_id: str) -> dict:
    """Leases, starts and reports UNKNOWN for the queue's next task: NEEDS_REVIEW."""
    lease = lease_one(tenant, queue_id)
    start(lease)
    assert report(lease, "UNKNOWN", error={"code": "timeout"})["task_state"] == "NEEDS_REVIEW"
    return lease
