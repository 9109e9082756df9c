"""The submit part of a round (prepare_tasks, admit_prepared) and admit_tasks,
admit_one: accept tasks into queues under backpressure. A single POST /v1/tasks
goes through its round: tasks.actions.rounds.submit_task."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from orbit.audit import emit_event, gathered_events
from orbit.db.rows import Add, add_to_row, delete_by_pk, insert_rows, new_row, update_by_pk
from orbit.errors import InvalidArgument, NotFound, OrbitError, QueueFull, StateConflict
from orbit.metrics import TASKS_SUBMITTED
from orbit.models import ApplicationState
from orbit.principal import Actor
from queues.locks import lock_queue_states
from queues.models import Queue, QueueState
from tasks.actions.context import Configuration
from tasks.actions.dependencies import EarlierRefs, decide, link_dependencies, parent_states, write_admitted
from tasks.actions.readiness import admit_readiness
from tasks.actions.serialize import task_detail
from tasks.locks import lock_application_state
from tasks.models import Task, TaskState
from tasks.wakeups import wake_after_commit

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
    # A task that becomes available only when it may no longer start could never run.
    if "available_at" in fields:
        ends: dict[str, Any] = {name: fields[name] for name in ("start_deadline_at", "deadline_at") if name in fields}
        if "timeout_seconds" in fields:
            ends["timeout_seconds"] = now + timedelta(seconds=fields["timeout_seconds"])
        for name, end in ends.items():
            if fields["available_at"] >= end:
                raise InvalidArgument(f"available_at: must be before {name}")


def admit_one(*, actor: Actor, fields: dict[str, Any]) -> dict[str, Any]:
    """Inserts a WAITING task and counts it against queue and application
    backlog. Caller holds the transaction (the idempotency runner's)."""
    now = timezone.now()
    check_times(fields, now)
    (outcome,) = admit_tasks(actor=actor, items=[fields], now=now)
    if isinstance(outcome, OrbitError):
        raise outcome
    return {"task": task_detail(outcome)}


def new_task(actor: Actor, fields: dict[str, Any], now: datetime) -> Task:
    retry = fields.get("retry") or {}
    deadline_at = fields.get("deadline_at")
    if "timeout_seconds" in fields:
        deadline_at = now + timedelta(seconds=fields["timeout_seconds"])
    return new_row(
        Task,
        namespace_id=actor.namespace_id,
        application_id=actor.principal.application_id,
        queue_id=fields["queue_id"],
        handler=fields["handler"],
        handler_version=fields["handler_version"],
        payload_version=fields["payload_version"],
        payload=fields["payload"],
        business_key=fields.get("business_key", ""),
        concurrency_key=fields.get("concurrency_key", ""),
        fairness_key=fields.get("fairness_key", ""),
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


def admit_tasks(*, actor: Actor, items: list[dict[str, Any]], now: datetime) -> list[Task | OrbitError]:
    """Admits validated submissions in order under backpressure: each becomes a
    saved WAITING Task, or the error that refused it (nothing is kept for a
    refused one). Caller holds the transaction."""
    return admit_prepared(actor=actor, prepared=prepare_tasks(actor=actor, items=items, now=now))


@dataclass
class PreparedTasks:
    """Task rows written before any lock, waiting for admit_prepared."""

    now: datetime
    queues: dict[str, Queue]
    app_limit: int
    tasks: list[Task | None]  # per item; None: no such queue in the namespace
    earlier_refs: EarlierRefs  # the batch refs each task's depends_on named


def prepare_tasks(
    *,
    actor: Actor,
    items: list[dict[str, Any]],
    now: datetime,
    before_insert: Callable[[list[Task | None]], None] | None = None,
    configuration: Configuration | None = None,
) -> PreparedTasks:
    """The part of admission that needs no lock: configuration, and the task
    rows inserted (not yet counted; admit_prepared deletes a refused one), so
    the section that serializes an application's submits holds only the
    counter work. `before_insert` sees the prepared tasks before anything is
    written."""
    # Configuration is read unlocked: a configure racing a submit may order
    # either way. A retire is caught under the lock by queue_state.accepting.
    application_id, queue_ids = actor.principal.application_id, {fields["queue_id"] for fields in items}
    if configuration is None:
        configuration = Configuration.read([application_id], queue_ids)
    queues = {
        queue.id: queue for queue in configuration.queues_of(queue_ids) if queue.namespace_id == actor.namespace_id
    }
    app_limit = configuration.application(application_id).max_unfinished_tasks
    tasks = [new_task(actor, fields, now) if fields["queue_id"] in queues else None for fields in items]
    earlier_refs = link_dependencies(tasks, items)
    rows = [task for task in tasks if task is not None]
    if rows:
        for task in rows:
            task.key_ready = not task.concurrency_key  # a keyed task's readiness is decided under the lock
        if before_insert is not None:
            before_insert(tasks)
        insert_rows(rows)
    return PreparedTasks(now=now, queues=queues, app_limit=app_limit, tasks=tasks, earlier_refs=earlier_refs)


def admit_prepared(*, actor: Actor, prepared: PreparedTasks) -> list[Task | OrbitError]:
    """Counts prepared tasks against queue and application backlog, in order.
    Locks: application_state, then the tasks' queue_state rows (ascending)."""
    application_id = actor.principal.application_id
    rows = [task for task in prepared.tasks if task is not None]
    if not rows:
        return [NotFound("queue not found") for _ in prepared.tasks]
    now, queues = prepared.now, prepared.queues
    app_state = lock_application_state(application_id)
    queue_states = lock_queue_states({task.queue_id for task in rows})
    app_unfinished = app_state.unfinished_tasks
    unfinished = {queue_id: state.unfinished_tasks for queue_id, state in queue_states.items()}
    outcomes: list[Task | OrbitError] = []
    accepted: dict[str, Task] = {}
    refused: list[str] = []
    # Dependencies' states, read under the lock that every ending holds.
    parents = parent_states(prepared.tasks)
    for task in prepared.tasks:
        if task is None:
            outcomes.append(NotFound("queue not found"))
            continue
        refusal = decide(task, accepted, parents, prepared.earlier_refs, now) if task.depends_on else None
        if refusal is not None:
            outcomes.append(refusal)
        elif not queue_states[task.queue_id].accepting:
            outcomes.append(StateConflict("queue is retired"))
        elif task.state == TaskState.CANCELLED:
            # Born cancelled (a dependency failed under CANCEL): never unfinished.
            accepted[task.id] = task
            outcomes.append(task)
            continue
        elif unfinished[task.queue_id] >= queues[task.queue_id].max_unfinished_tasks or app_unfinished >= (
            prepared.app_limit
        ):
            outcomes.append(QueueFull())
        else:
            unfinished[task.queue_id] += 1
            app_unfinished += 1
            accepted[task.id] = task
            outcomes.append(task)
            continue
        refused.append(task.id)
    if refused:
        delete_by_pk(Task, refused)  # orbit.db.rows.delete_by_unique_key says why not an IN list
    if not accepted:
        return outcomes
    write_admitted([task for task in accepted.values() if task.depends_on], accepted, parents)
    ready = admit_readiness(
        [task for task in accepted.values() if task.concurrency_key and task.state == TaskState.WAITING], now
    )
    if ready:
        update_by_pk(Task, ready, {"key_ready": True})
    counted = [task for task in accepted.values() if task.state != TaskState.CANCELLED]
    add_to_row(ApplicationState, application_id, {"unfinished_tasks": len(counted)})
    per_queue = Counter(task.queue_id for task in counted)
    # The first task with a fairness key turns the queue's fair lease order
    # on for good (tasks.actions.fairness), in the counter's own statement.
    fair = {task.queue_id for task in counted if task.fairness_key}
    for queue_id, count in sorted(per_queue.items()):
        changes: dict[str, Any] = {"unfinished_tasks": Add(count)}
        if queue_id in fair and not queue_states[queue_id].fair_shares:
            changes["fair_shares"] = True
        update_by_pk(QueueState, [queue_id], changes)
    with gathered_events():  # inside a round: with the round's own events
        for task in accepted.values():
            emit_event(
                namespace_id=task.namespace_id,
                type="task.state_changed",
                subject_id=task.id,
                data={"queue_id": task.queue_id, "state": task.state},
            )
    TASKS_SUBMITTED.inc(len(accepted))
    wake_after_commit(per_queue)
    return outcomes
