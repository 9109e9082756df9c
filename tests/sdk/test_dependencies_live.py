"""Dependencies through the SDK against a live server (SPEC §13): a batch whose items name each
other by ref, a RUN join that sees a failed dependency's state in execution.dependencies, a
CANCEL dependent cancelled with DEPENDENCY_FAILED, and the tasks' depends_on as read back."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from orbit_sdk import BatchItem, Client, Execution, SubmitTaskRequest, Task, Worker
from tests.support.api import make_queue

pytestmark = pytest.mark.django_db(transaction=True)

FINISHED = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
T = TypeVar("T")


def eventually(probe: Callable[[], T | None], seconds: float = 15.0) -> T:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds} s")


@pytest.fixture
def client(orbit_server: Any, tenant: Any) -> Iterator[Client]:
    with Client(orbit_server.url, tenant.token) as sdk:
        yield sdk


def produce(execution: Execution) -> dict[str, Any]:
    return {"made": execution.payload["n"]}


def fail(execution: Execution) -> None:
    raise ValueError("this dependency fails on purpose")


def report(execution: Execution) -> list[list[Any]]:
    """What the join saw: each dependency as the assignment carried it."""
    return [[dependency.task_id, dependency.state, dependency.output] for dependency in execution.dependencies]


def finished(client: Client, task_id: str) -> Task:
    return eventually(lambda: task if (task := client.get_task(task_id)).state in FINISHED else None)


def test_a_run_join_reads_every_dependency_as_it_ended_and_a_cancel_one_is_cancelled(orbit_server, tenant, client):
    # given one batch: a task that succeeds, one that fails, a RUN join of both, a CANCEL dependent of the bad one
    queue = make_queue(tenant.client, "deps-live", rate_per_second=1000)

    def request(handler: str, **fields: Any) -> SubmitTaskRequest:
        return SubmitTaskRequest(queue["id"], handler, "v1", "v1", {"n": 7}, max_attempts=1, **fields)

    good = BatchItem("good", request("produce"), ref="good")
    bad = BatchItem("bad", request("fail"), ref="bad")
    join = BatchItem(
        "join", request("report", depends_on=[bad.depends_on_ref, good.depends_on_ref], on_dependency_failure="RUN")
    )
    doomed = BatchItem("doomed", request("report", depends_on=[bad.depends_on_ref]))
    results = client.submit_tasks([good, bad, join, doomed])
    tasks = [result.task for result in results]
    assert all(task is not None for task in tasks), results
    good_task, bad_task, join_task, doomed_task = (task for task in tasks if task is not None)

    # then the dependents are BLOCKED, their refs resolved to the ids of the tasks they name
    assert [task.state for task in (good_task, bad_task, join_task, doomed_task)] == [
        "WAITING",
        "WAITING",
        "BLOCKED",
        "BLOCKED",
    ]
    assert join_task.depends_on == (bad_task.id, good_task.id) and join_task.on_dependency_failure == "RUN"
    assert doomed_task.depends_on == (bad_task.id,) and doomed_task.on_dependency_failure == "CANCEL"
    assert good_task.depends_on == () and good_task.on_dependency_failure is None
    assert client.get_task(join_task.id).depends_on == join_task.depends_on
    blocked = client.list_tasks(queue_id=queue["id"], state="BLOCKED").items
    assert sorted(task.id for task in blocked) == sorted([join_task.id, doomed_task.id])

    # when a worker runs what it may
    worker = Worker(
        orbit_server.url,
        tenant.token,
        [queue["id"]],
        {("produce", "v1"): produce, ("fail", "v1"): fail, ("report", "v1"): report},
        capacity=4,
    )
    worker.start()
    try:
        joined = finished(client, join_task.id)
        cancelled = finished(client, doomed_task.id)
    finally:
        worker.stop()
        assert worker.join(timeout=15)

    # then the RUN join ran after both ended and saw each one's state and output, in depends_on order
    assert joined.state == "SUCCEEDED", joined.last_error
    assert joined.output == [[bad_task.id, "FAILED", None], [good_task.id, "SUCCEEDED", {"made": 7}]]
    # and the CANCEL dependent never ran: cancelled, naming the dependency that failed
    assert cancelled.state == "CANCELLED" and cancelled.attempts == 0
    assert cancelled.last_error["code"] == "DEPENDENCY_FAILED" and cancelled.last_error["task_id"] == bad_task.id
