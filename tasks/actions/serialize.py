"""Wire shapes of tasks, attempts and assignments (optional fields omitted when empty)."""

from __future__ import annotations

from typing import Any

from orbit.timefmt import format_time
from tasks.models import Attempt, Task


def task_summary(task: Task) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": task.id,
        "namespace_id": task.namespace_id,
        "queue_id": task.queue_id,
        "handler": task.handler,
        "handler_version": task.handler_version,
        "payload_version": task.payload_version,
    }
    if task.business_key:
        data["business_key"] = task.business_key
    if task.concurrency_key:
        data["concurrency_key"] = task.concurrency_key
    if task.fairness_key:
        data["fairness_key"] = task.fairness_key
    data.update(
        priority=task.priority,
        state=task.state,
        attempts=task.attempts,
        max_attempts=task.max_attempts,
        available_at=format_time(task.available_at),
    )
    if task.start_deadline_at:
        data["start_deadline_at"] = format_time(task.start_deadline_at)
    if task.deadline_at:
        data["deadline_at"] = format_time(task.deadline_at)
    if task.depends_on:
        data["depends_on"] = task.depends_on
        data["on_dependency_failure"] = task.on_dependency_failure
    data.update(
        cancel_requested=task.cancel_requested,
        created_at=format_time(task.created_at),
        updated_at=format_time(task.updated_at),
    )
    if task.finished_at:
        data["finished_at"] = format_time(task.finished_at)
    if task.output is not None:
        data["output"] = task.output
    if task.last_error is not None:
        data["last_error"] = task.last_error
    return data


# The columns task_link reads.
LINK_FIELDS = (
    "id",
    "namespace_id",
    "queue_id",
    "handler",
    "business_key",
    "state",
    "created_at",
    "updated_at",
    "finished_at",
)


def task_link(task: Task) -> dict[str, Any]:
    """A related task in short form (GET /v1/tasks/{id}/dependencies and /dependents)."""
    data: dict[str, Any] = {"id": task.id, "queue_id": task.queue_id, "handler": task.handler}
    if task.business_key:
        data["business_key"] = task.business_key
    data.update(state=task.state, created_at=format_time(task.created_at), updated_at=format_time(task.updated_at))
    if task.finished_at:
        data["finished_at"] = format_time(task.finished_at)
    return data


def task_detail(task: Task) -> dict[str, Any]:
    data = task_summary(task)
    data["payload"] = task.payload
    return data


def attempt_view(attempt: Attempt) -> dict[str, Any]:
    data: dict[str, Any] = {"id": attempt.id, "task_id": attempt.task_id}
    if attempt.number is not None:
        data["number"] = attempt.number
    data.update(state=attempt.state, epoch=attempt.epoch)
    if attempt.concurrency_token is not None:
        data["concurrency_token"] = str(attempt.concurrency_token)
    if attempt.concurrency_slot is not None:
        data["concurrency_slot"] = attempt.concurrency_slot
    data.update(
        worker_id=attempt.worker_id,
        leased_at=format_time(attempt.leased_at),
        lease_expires_at=format_time(attempt.lease_expires_at),
    )
    if attempt.started_at:
        data["started_at"] = format_time(attempt.started_at)
    if attempt.finished_at:
        data["finished_at"] = format_time(attempt.finished_at)
    if attempt.outcome:
        data["outcome"] = attempt.outcome
    if attempt.error is not None:
        data["error"] = attempt.error
    if attempt.late_outcome is not None:
        data["late_outcome"] = attempt.late_outcome
    return data


def assignment(task: Task, attempt: Attempt) -> dict[str, Any]:
    """The body of task.assign, of a held entry and of task.resume.ok."""
    task_part: dict[str, Any] = {
        "id": task.id,
        "queue_id": task.queue_id,
        "handler": task.handler,
        "handler_version": task.handler_version,
        "payload_version": task.payload_version,
        "payload": task.payload,
    }
    if task.business_key:
        task_part["business_key"] = task.business_key
    if task.concurrency_key:
        task_part["concurrency_key"] = task.concurrency_key
    task_part["priority"] = task.priority
    data: dict[str, Any] = {
        "attempt_id": attempt.id,
        "epoch": attempt.epoch,
        "lease_expires_at": format_time(attempt.lease_expires_at),
        "task": task_part,
    }
    if attempt.concurrency_token is not None:
        data["concurrency_token"] = str(attempt.concurrency_token)
    if attempt.concurrency_slot is not None:
        # A key with capacity above 1: which of its N permits this is.
        data["concurrency_slot"] = attempt.concurrency_slot
    return data
