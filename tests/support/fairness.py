"""Task rows of a queue with fair shares, written straight to the table, and
the fair lease order read from tasks.actions.fairness."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import transaction

from orbit.fields import new_id
from queues.models import QueueState
from tasks.actions.context import WorkerContext
from tasks.actions.fairness import fair_candidates
from tasks.models import Task, TaskState

# Tasks made by make_tasks are this far apart in available_at, oldest first.
STEP = timedelta(milliseconds=1)


def set_fair(queue_id: str, fair: bool = True) -> None:
    QueueState.objects.filter(queue_id=queue_id).update(fair_shares=fair)


def make_tasks(
    tenant: Any, queue_id: str, count: int, *, key: str = "", start: datetime, priority: int = 5, **fields: Any
) -> list[Task]:
    """`count` WAITING ready tasks of fairness key `key`, available at
    start, start + STEP, … (all in the past), in that order."""
    base = {"handler": "echo", "handler_version": "v1", "payload_version": "v1", "state": TaskState.WAITING, **fields}
    rows = [
        Task(
            id=new_id(),
            namespace_id=tenant.namespace_id,
            application_id=tenant.namespace.application_id,
            queue_id=queue_id,
            payload={"key": key, "n": n},
            fairness_key=key,
            priority=priority,
            available_at=start + n * STEP,
            created_at=start,
            updated_at=start,
            **base,
        )
        for n in range(count)
    ]
    Task.objects.bulk_create(rows)
    return rows


def fair_order(worker: WorkerContext, queue_id: str, now: datetime, count: int) -> list[Task]:
    """fair_candidates in a transaction of its own (its locks end with it)."""
    with transaction.atomic():
        return fair_candidates(worker, queue_id, now, count)


def keys_of(tasks: list[Task]) -> list[str]:
    return [task.fairness_key for task in tasks]
