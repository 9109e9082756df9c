"""submit_task: accept a task into a queue under backpressure."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from orbit.audit import emit_event
from orbit.errors import InvalidArgument, NotFound, QueueFull, StateConflict
from orbit.idempotency import Actor
from orbit.metrics import TASKS_SUBMITTED
from orbit.models import Application, ApplicationState
from queues.locks import lock_queue_states
from queues.models import Queue, QueueState
from tasks.actions.serialize import task_detail
from tasks.locks import lock_application_state
from tasks.models import Task, TaskState

# available_at may lag the server clock by this much (client clock skew)
# before the request counts as expired.
AVAILABLE_AT_TOLERANCE = timedelta(seconds=60)


def check_times(fields: dict[str, Any], now: Any) -> None:
    """Absolute times against the server clock at acceptance, so that a rejected
    request cannot be retried forever."""
    if "start_deadline_at" in fields and fields["start_deadline_at"] <= now:
        raise InvalidArgument("start_deadline_at: must be in the future")
    if "deadline_at" in fields and fields["deadline_at"] <= now:
        raise InvalidArgument("deadline_at: must be in the future")
    if "available_at" in fields and fields["available_at"] < now - AVAILABLE_AT_TOLERANCE:
        raise InvalidArgument("available_at: more than 60 seconds in the past (expired)")


def submit_task(*, actor: Actor, fields: dict[str, Any]) -> dict[str, Any]:
    """Inserts a WAITING task and counts it against queue and application
    backlog. Caller holds the transaction (the idempotency runner's).

    Locks: application_state, then the queue's queue_state."""
    now = timezone.now()
    check_times(fields, now)
    application_id = actor.principal.application_id
    app_state = lock_application_state(application_id)
    queue_states = lock_queue_states([fields["queue_id"]])
    queue_state = queue_states.get(fields["queue_id"])
    # Read after the queue_state lock: a retire commits while holding it, so
    # a retire that saw this queue empty is visible here.
    queue = Queue.objects.filter(id=fields["queue_id"], namespace_id=actor.namespace_id).first()
    if queue is None or queue_state is None:
        raise NotFound("queue not found")
    if queue.retired_at is not None:
        raise StateConflict("queue is retired")
    application = Application.objects.only("max_unfinished_tasks").get(id=application_id)
    if (
        queue_state.unfinished_tasks >= queue.max_unfinished_tasks
        or app_state.unfinished_tasks >= application.max_unfinished_tasks
    ):
        raise QueueFull()

    retry = fields.get("retry") or {}
    deadline_at = fields.get("deadline_at")
    if "timeout_seconds" in fields:
        deadline_at = now + timedelta(seconds=fields["timeout_seconds"])
    task = Task.objects.create(
        namespace_id=actor.namespace_id,
        application_id=application_id,
        queue_id=queue.id,
        handler=fields["handler"],
        handler_version=fields["handler_version"],
        payload_version=fields["payload_version"],
        payload=fields["payload"],
        business_key=fields.get("business_key", ""),
        concurrency_key=fields.get("concurrency_key", ""),
        priority=fields["priority"],
        state=TaskState.WAITING,
        max_attempts=fields["max_attempts"],
        available_at=fields.get("available_at", now),
        start_deadline_at=fields.get("start_deadline_at"),
        deadline_at=deadline_at,
        retry_initial_seconds=retry.get("initial_seconds", 1),
        retry_multiplier=retry.get("multiplier", 2),
        retry_max_seconds=retry.get("max_seconds", 300),
        lease_seconds=fields["lease_seconds"],
        created_at=now,
        updated_at=now,
    )
    ApplicationState.objects.filter(application_id=application_id).update(unfinished_tasks=F("unfinished_tasks") + 1)
    QueueState.objects.filter(queue_id=queue.id).update(unfinished_tasks=F("unfinished_tasks") + 1)
    emit_event(
        namespace_id=actor.namespace_id,
        type="task.state_changed",
        subject_id=task.id,
        data={"queue_id": queue.id, "state": TaskState.WAITING},
    )
    TASKS_SUBMITTED.inc()
    queue_id = queue.id
    transaction.on_commit(lambda: notify_work_available([queue_id]))
    return {"task": task_detail(task)}


def notify_work_available(queue_ids: list[str]) -> None:
    from workers.wakeup import wake_dispatchers

    wake_dispatchers(queue_ids)
