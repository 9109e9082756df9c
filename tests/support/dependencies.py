"""What the dependency tests (tests/dependencies) do again and again: run the next task of
a queue to its end, submit a fan-out, and read a task's state changes from its events."""

from __future__ import annotations

from typing import Any

from orbit.models import Event
from tasks.models import Task
from tests.conftest import post_json
from tests.support.tasks import lease_one, report, start, task_body

MAX_BATCH_ITEMS = 500  # POST /v1/tasks:batch


def row(task_id: str) -> Task:
    return Task.objects.get(id=task_id)


def run_one(tenant: Any, queue_id: str, outcome: str = "SUCCEEDED", output: object = None) -> dict[str, Any]:
    """Leases, starts and ends the queue's next task with `outcome`; the lease."""
    lease = lease_one(tenant, queue_id)
    start(lease)
    report(lease, outcome, output=output, error=None if outcome == "SUCCEEDED" else {"code": "boom"})
    return lease


def fan_out(tenant: Any, queue_id: str, parent_id: str, width: int, **overrides: Any) -> list[str]:
    """`width` dependents of the parent, submitted in batches; their ids."""
    ids: list[str] = []
    for first in range(0, width, MAX_BATCH_ITEMS):
        items = [
            {
                "idempotency_key": f"fan-{parent_id}-{n}",
                "task": task_body(queue_id, depends_on=[parent_id], **overrides),
            }
            for n in range(first, min(width, first + MAX_BATCH_ITEMS))
        ]
        results = post_json(tenant.client, "/v1/tasks:batch", {"tasks": items}).json()["data"]["results"]
        ids += [result["task"]["id"] for result in results]
    return ids


def moves_of(task_ids: list[str]) -> dict[str, list[tuple[str, str | None]]]:
    """Each task's state changes, as (state, previous), in commit order."""
    paths: dict[str, list[tuple[str, str | None]]] = {task_id: [] for task_id in task_ids}
    events = Event.objects.filter(subject_id__in=task_ids, type="task.state_changed").order_by("seq")
    for event in events:
        paths[event.subject_id].append((event.data["state"], event.data.get("previous")))
    return paths


def moves(task_id: str) -> list[tuple[str, str | None]]:
    return moves_of([task_id])[task_id]
