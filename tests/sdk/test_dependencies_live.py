"""Dependencies through the SDK against a live server (SPEC §13): a batch whose items name each
other by ref, a RUN join that sees a failed dependency's state in execution.dependencies, a
CANCEL dependent cancelled with DEPENDENCY_FAILED, the tasks' depends_on as read back, and the
dependencies / dependents lists a page at a time on both clients."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from orbit_sdk import AsyncClient, BatchItem, Client, Execution, Page, SubmitTaskRequest, Task, TaskLink, Worker
from tests.support.api import make_queue
from tests.support.tasks import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

FINISHED = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}


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
    return wait_until(
        lambda: task if (task := client.get_task(task_id)).state in FINISHED else None, 15, what=f"{task_id} finished"
    )


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


def on_async_client(orbit_server: Any, token: str, name: str, *args: Any) -> Any:
    async def call() -> Any:
        async with AsyncClient(orbit_server.url, token) as sdk:
            return await getattr(sdk, name)(*args)

    return asyncio.run(call())


def all_pages(read: Callable[[str | None], Page[TaskLink]]) -> tuple[list[TaskLink], int]:
    """Every item of a list read a page at a time, and how many pages it took."""
    items: list[TaskLink] = []
    token: str | None = None
    pages = 0
    while True:
        page = read(token)
        items.extend(page.items)
        pages += 1
        if page.next_page_token is None:
            return items, pages
        token = page.next_page_token


def test_dependencies_and_dependents_read_a_page_at_a_time_on_both_clients(orbit_server, tenant, client):
    # given a parent with three dependents, and a join of all four (nothing runs them)
    queue = make_queue(tenant.client, "deps-reads", rate_per_second=1000)

    def request(handler: str, depends_on: list[str] | None = None) -> SubmitTaskRequest:
        return SubmitTaskRequest(queue["id"], handler, "v1", "v1", {}, business_key="report/7", depends_on=depends_on)

    parent = BatchItem("parent", request("split"), ref="parent")
    children = [BatchItem(f"child-{n}", request("part", [parent.depends_on_ref]), ref=f"child-{n}") for n in range(3)]
    join = BatchItem("join", request("join", [parent.depends_on_ref, *(child.depends_on_ref for child in children)]))
    tasks = [result.task for result in client.submit_tasks([parent, *children, join])]
    assert all(task is not None for task in tasks)
    parent_task, *child_tasks, join_task = (task for task in tasks if task is not None)

    # when the join's dependencies and the parent's dependents are read one item a page
    dependencies, pages = all_pages(lambda token: client.list_dependencies(join_task.id, 1, token))
    dependents, _ = all_pages(lambda token: client.list_dependents(parent_task.id, 1, token))

    # then each list is complete and in its order: depends_on's, and the order of admission
    assert (
        [link.id for link in dependencies] == list(join_task.depends_on) == [t.id for t in (parent_task, *child_tasks)]
    )
    assert pages == 4
    assert [link.id for link in dependents] == [*(t.id for t in child_tasks), join_task.id]
    first = dependencies[0]
    assert isinstance(first, TaskLink) and not first.pruned
    assert (first.queue_id, first.handler, first.state, first.business_key) == (
        queue["id"],
        "split",
        "WAITING",
        "report/7",
    )
    assert first.created_at == parent_task.created_at and first.finished_at is None
    assert [link.state for link in dependents] == ["BLOCKED"] * 4
    # and a leaf has no dependents, in one empty page
    empty = client.list_dependents(join_task.id)
    assert empty.items == [] and empty.next_page_token is None
    # and the async client reads the same
    assert on_async_client(orbit_server, tenant.token, "list_dependents", parent_task.id) == Page(dependents, None)

    # and a BLOCKED task's one blocker names the dependencies it still waits for
    blockers = client.get_task_blockers(join_task.id)
    assert blockers.state == "BLOCKED" and [blocker.code for blocker in blockers.items] == ["WAITING_FOR_DEPENDENCIES"]
    assert blockers.items[0].facts["task_ids"] == list(join_task.depends_on)
