"""Read verbs for tasks and attempts; the credential's queue range applies."""

from __future__ import annotations

from typing import Any

from orbit.db.rows import keyset_page
from orbit.errors import InvalidArgument, NotFound
from orbit.principal import Principal
from tasks.actions.serialize import attempt_view, task_detail, task_summary
from tasks.models import Attempt, Task, TaskState


def visible_task(principal: Principal, task_id: str) -> Task:
    task = Task.objects.filter(id=task_id, namespace_id=principal.namespace_id).first()
    if task is None or not principal.covers_queue(task.queue_id):
        raise NotFound("task not found")
    return task


def task_get(*, principal: Principal, task_id: str) -> dict[str, Any]:
    return task_detail(visible_task(principal, task_id))


def task_list(
    *, principal: Principal, filters: dict[str, str], after_id: str | None, limit: int
) -> tuple[list[dict[str, Any]], str | None]:
    tasks = Task.objects.filter(namespace_id=principal.namespace_id).defer("payload")
    if "queue_id" in filters:
        tasks = tasks.filter(queue_id=filters["queue_id"])
    if principal.queue_ids is not None:
        tasks = tasks.filter(queue_id__in=sorted(principal.queue_ids))
    if "state" in filters:
        if filters["state"] not in TaskState.values:
            raise InvalidArgument(f"state: must be one of {', '.join(TaskState.values)}")
        tasks = tasks.filter(state=filters["state"])
    for name in ("business_key", "concurrency_key"):
        if name in filters:
            tasks = tasks.filter(**{name: filters[name]})
    rows, next_id = keyset_page(tasks, after_id, limit)
    return [task_summary(t) for t in rows], next_id


def attempt_list(
    *, principal: Principal, task_id: str, after_epoch: int | None, limit: int
) -> tuple[list[dict[str, Any]], int | None]:
    """A task's attempts in lease order (by epoch, unique per task), a page
    after `after_epoch`, and the epoch to continue after (None: the last page).
    Released and expired attempts are not counted against max_attempts, so a
    task can have any number of them."""
    task = visible_task(principal, task_id)
    rows, next_epoch = keyset_page(Attempt.objects.filter(task_id=task.id), after_epoch, limit, key="epoch")
    return [attempt_view(a) for a in rows], next_epoch


def attempt_get(*, principal: Principal, attempt_id: str) -> dict[str, Any]:
    attempt = Attempt.objects.filter(id=attempt_id, namespace_id=principal.namespace_id).first()
    if attempt is None or not principal.covers_queue(attempt.queue_id):
        raise NotFound("attempt not found")
    return attempt_view(attempt)
