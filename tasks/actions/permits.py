"""The only code that moves permits and counters when an attempt or task ends.

Callers hold every row in `Held` locked (global order) and have checked that
the attempt is still LEASED or RUNNING: that check under the lock is what
makes each release happen exactly once."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import F

from orbit.audit import emit_event
from orbit.metrics import ATTEMPTS_FINISHED
from orbit.models import ApplicationState
from queues.locks import lock_queue_states
from queues.models import QueueState
from tasks.actions.readiness import enter_waiting, promote_next
from tasks.locks import lock_application_state, lock_attempt, lock_concurrency_keys, lock_task
from tasks.models import (
    ACTIVE_ATTEMPT_STATES,
    FINAL_TASK_STATES,
    Attempt,
    AttemptState,
    ConcurrencyKey,
    Task,
    TaskState,
)


@dataclass
class Held:
    task: Task
    attempt: Attempt
    key_row: ConcurrencyKey | None


def lock_attempt_chain(attempt_id: str) -> Held | None:
    """Locks application_state → queue_state → key → task → attempt for one attempt.

    The first read takes no lock: it only learns which rows to lock. Every
    decision is made on the rows re-read under their locks."""
    peek = (
        Attempt.objects.filter(id=attempt_id)
        .values("task_id", "application_id", "queue_id", "namespace_id", "concurrency_key")
        .first()
    )
    if peek is None:
        return None
    lock_application_state(peek["application_id"])
    lock_queue_states([peek["queue_id"]])
    key_row = None
    if peek["concurrency_key"]:
        key_row = lock_concurrency_keys(peek["namespace_id"], [peek["concurrency_key"]])[peek["concurrency_key"]]
    task = lock_task(peek["task_id"])
    attempt = lock_attempt(attempt_id)
    if task is None or attempt is None:
        return None
    return Held(task=task, attempt=attempt, key_row=key_row)


def lock_task_chain(task_id: str) -> tuple[Task, Held | None] | None:
    """Like lock_attempt_chain, starting from a task; includes its active attempt if any."""
    peek = (
        Task.objects.filter(id=task_id).values("application_id", "queue_id", "namespace_id", "concurrency_key").first()
    )
    if peek is None:
        return None
    lock_application_state(peek["application_id"])
    lock_queue_states([peek["queue_id"]])
    key_row = None
    if peek["concurrency_key"]:
        key_row = lock_concurrency_keys(peek["namespace_id"], [peek["concurrency_key"]])[peek["concurrency_key"]]
    task = lock_task(task_id)
    if task is None:
        return None
    attempt = (
        Attempt.objects.select_for_update()
        .filter(task_id=task_id, epoch=task.epoch, state__in=list(ACTIVE_ATTEMPT_STATES))
        .first()
    )
    return task, (Held(task=task, attempt=attempt, key_row=key_row) if attempt else None)


def end_attempt(held: Held, state: AttemptState, *, now: datetime, **fields: Any) -> None:
    """Ends an active attempt and releases its application, queue and key permits."""
    attempt = held.attempt
    assert attempt.state in ACTIVE_ATTEMPT_STATES, "callers check the attempt is active under lock"
    was_reserved = attempt.state == AttemptState.LEASED
    ApplicationState.objects.filter(application_id=attempt.application_id).update(
        active_attempts=F("active_attempts") - 1
    )
    queue_update: dict[str, Any] = {"active_permits": F("active_permits") - 1}
    if was_reserved:
        queue_update["reserved_starts"] = F("reserved_starts") - 1
    QueueState.objects.filter(queue_id=attempt.queue_id).update(**queue_update)
    key_row = held.key_row
    if key_row is not None and key_row.holder_attempt_id == attempt.id:
        # Releasing advances the version too, so the next permit's token is
        # larger than any this attempt could have shown a resource.
        key_row.version += 1
        key_row.holder_attempt_id = ""
        key_row.holder_task_id = ""
        key_row.updated_at = now
        key_row.save(update_fields=["version", "holder_attempt_id", "holder_task_id", "updated_at"])
    attempt.state = state
    attempt.finished_at = now
    for name, value in fields.items():
        setattr(attempt, name, value)
    attempt.save(update_fields=["state", "finished_at", *fields])
    ATTEMPTS_FINISHED.labels(state=str(state)).inc()


def move_task(task: Task, state: str, *, now: datetime, **fields: Any) -> None:
    """Sets a task's state; the first entry into a final state frees its backlog slot."""
    previous = task.state
    task.state = state
    task.updated_at = now
    for name, value in fields.items():
        setattr(task, name, value)
    changed = ["state", "updated_at", *fields]
    left_ready_set = previous == TaskState.WAITING and state != TaskState.WAITING and task.key_ready
    if state == TaskState.WAITING and previous != TaskState.WAITING:
        task.key_ready = enter_waiting(task, now)
        changed.append("key_ready")
    if state in FINAL_TASK_STATES and previous not in FINAL_TASK_STATES:
        task.finished_at = now
        changed.append("finished_at")
        ApplicationState.objects.filter(application_id=task.application_id).update(
            unfinished_tasks=F("unfinished_tasks") - 1
        )
        QueueState.objects.filter(queue_id=task.queue_id).update(unfinished_tasks=F("unfinished_tasks") - 1)
    task.save(update_fields=changed)
    if left_ready_set:
        promote_next(
            namespace_id=task.namespace_id, concurrency_key=task.concurrency_key, queue_id=task.queue_id, now=now
        )
    emit_event(
        namespace_id=task.namespace_id,
        type="task.state_changed",
        subject_id=task.id,
        data={"queue_id": task.queue_id, "state": state, "previous": previous},
    )
