"""Why isn't this task running? (GET /v1/tasks/{id}/blockers, the console's task page)

For a WAITING task, every reason the next lease would not take it, each with a
code and the facts behind it, asked with the lease's own predicates
(tasks.actions.context: queue_closed, concurrency_room, rate_room,
application_room, key_blocks, available, takes) on the rows as they are now.
Read without locks: the answer is a snapshot, and the next lease decides
under its locks. An empty list: a lease would take the task now. For a
BLOCKED task, one reason: the dependencies it still waits for
(WAITING_FOR_DEPENDENCIES), which no lease predicate is asked about.

A credential reads each reason's facts only where it may read them itself: a
key's holder outside its queue range (a task GET would answer 404) and the
application's counters without `applications:manage` (GET /v1/application)
are reduced to the reason's code and message. The console's operator reads
every fact."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from orbit.models import Application, ApplicationState
from orbit.principal import Principal
from orbit.timefmt import format_time
from queues.models import Queue, QueueState
from tasks.actions.context import (
    application_room,
    available,
    concurrency_room,
    key_blocks,
    queue_closed,
    rate_room,
    takes,
    window_reopens_at,
)
from tasks.actions.identities import SESSION_STALE_SECONDS
from tasks.actions.keys import key_holders, namespace_policies
from tasks.actions.reads import visible_task
from tasks.key_rules import KeyRule
from tasks.models import Attempt, ConcurrencyKey, Task, TaskDependency, TaskState, WorkerIdentity

MESSAGES = {
    "NOT_YET_AVAILABLE": "the task is not available before available_at",
    "QUEUE_PAUSED": "the queue is paused",
    "QUEUE_RETIRED": "the queue is retired",
    "QUEUE_AT_MAX_CONCURRENCY": "every permit of the queue's max_concurrency is held",
    "START_WINDOW_FULL": "the queue's start window is full (rate_per_second, leases reserve room)",
    "APPLICATION_QUOTA_FULL": "the application's max_active_attempts are all in use",
    "KEY_HELD": "another attempt holds the concurrency key's permit",
    "KEY_AT_CAPACITY": "attempts hold every permit of the concurrency key's capacity",
    "KEY_RATE_LIMITED": "the concurrency key's start rate has no room before next_start_at",
    "KEY_TOKENS_EXHAUSTED": "the concurrency key's token space is spent; it never leases again",
    "KEY_TURN_OF_ANOTHER_TASK": "another waiting task of the same key and queue is next in line",
    "NO_WORKER": "no connected worker may take the task",
    "WAITING_FOR_DEPENDENCIES": "dependencies of the task have not finished yet",
}


def _reason(code: str, **facts: Any) -> dict[str, Any]:
    return {"code": code, "message": MESSAGES[code], **facts}


def task_blockers(*, principal: Principal, task_id: str) -> dict[str, Any]:
    """The task's state and, when WAITING or BLOCKED, its blockers (empty: a lease would take it now)."""
    task = visible_task(principal, task_id)
    items: list[dict[str, Any]] = []
    if task.state == TaskState.WAITING:
        items = blockers_of(task, reader=principal)
    elif task.state == TaskState.BLOCKED:
        items = dependency_blockers(task)
    return {"state": task.state, "items": items}


def dependency_blockers(task: Task) -> list[dict[str, Any]]:
    """WAITING_FOR_DEPENDENCIES with the dependencies whose edges are not
    settled: those not finished, and (for a wide fan-out's follow-up, within
    a second) one that finished but has not counted down this task yet. Ids
    only: they are the task's own depends_on, which its reader sees already."""
    waiting_for = list(
        TaskDependency.objects.filter(task_id=task.id, settled=False)
        .order_by("position")
        .values_list("depends_on_id", flat=True)
    )
    return [_reason("WAITING_FOR_DEPENDENCIES", task_ids=waiting_for)]


def blockers_of(task: Task, now: datetime | None = None, *, reader: Principal | None = None) -> list[dict[str, Any]]:
    """Every reason the next lease would not take this WAITING task, with
    the facts `reader` may read (None: the operator, every fact)."""
    now = now or timezone.now()
    found: list[dict[str, Any]] = []
    if not available(task, now):
        found.append(_reason("NOT_YET_AVAILABLE", until=format_time(task.available_at)))
    queue = Queue.objects.get(id=task.queue_id)
    state = QueueState.objects.get(queue_id=task.queue_id)
    closed = queue_closed(queue)
    if closed:
        found.append(_reason(closed))
    if concurrency_room(queue, state) <= 0:
        found.append(
            _reason(
                "QUEUE_AT_MAX_CONCURRENCY", active_permits=state.active_permits, max_concurrency=queue.max_concurrency
            )
        )
    if rate_room(queue, state, now) <= 0:
        reopens_at = window_reopens_at(state)
        facts: dict[str, Any] = {"rate_per_second": queue.rate_per_second, "reserved_starts": state.reserved_starts}
        if reopens_at is not None and reopens_at > now:
            facts.update(window_count=state.window_count, until=format_time(reopens_at))
        found.append(_reason("START_WINDOW_FULL", **facts))
    application = Application.objects.get(id=task.application_id)
    app_state = ApplicationState.objects.get(application_id=task.application_id)
    if application_room(application, app_state.active_attempts) <= 0:
        if reader is None or "applications:manage" in reader.scopes:
            found.append(
                _reason(
                    "APPLICATION_QUOTA_FULL",
                    active_attempts=app_state.active_attempts,
                    max_active_attempts=application.max_active_attempts,
                )
            )
        else:
            found.append(_reason("APPLICATION_QUOTA_FULL"))
    if task.concurrency_key:
        found += _key_blockers(task, reader, now)
    found += _worker_blockers(task, now)
    return found


def _key_blockers(task: Task, reader: Principal | None, now: datetime) -> list[dict[str, Any]]:
    key = ConcurrencyKey.objects.filter(namespace_id=task.namespace_id, key=task.concurrency_key).first()
    if key is not None:
        rule = namespace_policies(task.namespace_id).resolve(task.concurrency_key)
        found = _key_permit_blockers(key, rule, reader)
        if rule.rate is not None and not rule.rate.lease_allowed(key.rate_tat, key.rate_reserved, now):
            next_start_at = rule.rate.next_lease_at(key.rate_tat, key.rate_reserved, now)
            found.append(_reason("KEY_RATE_LIMITED", next_start_at=format_time(next_start_at), **_policy(rule)))
        if found:
            return found
    if not task.key_ready:
        # The key's ready set (tasks.actions.readiness): one waiting task per
        # key and queue is eligible; the lease takes that one first.
        ready = (
            Task.objects.filter(
                namespace_id=task.namespace_id,
                concurrency_key=task.concurrency_key,
                queue_id=task.queue_id,
                state=TaskState.WAITING,
                key_ready=True,
            )
            .values_list("id", flat=True)
            .first()
        )
        return [_reason("KEY_TURN_OF_ANOTHER_TASK", **({"task_id": ready} if ready else {}))]
    return []


def _policy(rule: KeyRule) -> dict[str, Any]:
    return {"policy_id": rule.policy_id} if rule.policy_id is not None else {}


def _key_permit_blockers(key: ConcurrencyKey, rule: KeyRule, reader: Principal | None) -> list[dict[str, Any]]:
    """KEY_HELD (capacity 1: the seed's one permit, naming its holder),
    KEY_AT_CAPACITY (capacity N > 1: at least N hold, a lowered capacity's
    holders too), KEY_TOKENS_EXHAUSTED."""
    if rule.capacity == 1:
        holders = key_holders([key]).get((key.namespace_id, key.key), [])
        if holders:
            holder = holders[0]
            if reader is not None and not _may_read_holder(reader, holder.task_id, holder.attempt):
                # A key spans the namespace's queues; its holder may be a
                # task this credential cannot read: only that the key is held.
                return [_reason("KEY_HELD")]
            facts = {"attempt_id": holder.attempt_id, "task_id": holder.task_id}
            if holder.attempt is not None:
                facts.update(worker_id=holder.attempt.worker_id, since=format_time(holder.attempt.leased_at))
            return [_reason("KEY_HELD", **facts)]
    elif key.holders >= rule.capacity:
        # Counts only: which tasks hold is the key's page (GET /v1/concurrency-keys/{key}).
        return [_reason("KEY_AT_CAPACITY", capacity=rule.capacity, holders=key.holders, **_policy(rule))]
    if key_blocks(holder_attempt_id="", version=key.version) == "KEY_TOKENS_EXHAUSTED":
        return [_reason("KEY_TOKENS_EXHAUSTED", highest_token=str(key.version))]
    return []


def _may_read_holder(reader: Principal, task_id: str, holder: Attempt | None) -> bool:
    """Whether `reader` may read the holding task (GET /v1/tasks/{id} would answer it)."""
    if reader.all_queues:
        return True
    queue_id = (
        holder.queue_id
        if holder is not None
        else Task.objects.filter(id=task_id).values_list("queue_id", flat=True).first()
    )
    return queue_id is not None and reader.covers_queue(queue_id)


def _worker_blockers(task: Task, now: datetime) -> list[dict[str, Any]]:
    """NO_WORKER unless a connected worker (its session seen lately) consumes
    the queue and would be assigned this task (handler filter, keyed opt-in)."""
    live = WorkerIdentity.objects.filter(
        namespace_id=task.namespace_id, seen_at__gt=now - timedelta(seconds=SESSION_STALE_SECONDS)
    ).only("queue_ids", "handlers", "concurrency_keys")
    consuming = [identity for identity in live if task.queue_id in identity.queue_ids]
    if not consuming:
        return [_reason("NO_WORKER", reason="no connected worker consumes this queue")]
    by_handler = [
        identity for identity in consuming if takes(handlers=identity.handlers, concurrency_keys=True, task=task)
    ]
    if not by_handler:
        return [_reason("NO_WORKER", reason="no connected worker of this queue serves this handler and version")]
    if not any(takes(handlers=i.handlers, concurrency_keys=i.concurrency_keys, task=task) for i in by_handler):
        return [_reason("NO_WORKER", reason="no connected worker of this queue accepts keyed tasks")]
    return []
