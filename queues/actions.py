"""Queue verbs: create, configure, retire, read.

Each mutating verb runs inside the transaction opened by the idempotency runner
(the outermost entry point) and writes its audit row and event there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from orbit.audit import record_management_change
from orbit.db.rows import keyset_page
from orbit.errors import NotFound, StateConflict, require_revision
from orbit.fields import is_resource_id
from orbit.principal import Actor, Principal
from orbit.timefmt import format_time
from plans.models import Plan, PlanState
from queues.locks import lock_queue, lock_queue_states
from queues.models import DEFAULT_MAX_UNFINISHED_TASKS, Queue, QueueState


@dataclass(frozen=True)
class QueueLimits:
    max_concurrency: int
    rate_per_second: int
    max_unfinished_tasks: int


def queue_snapshot(queue: Queue, unfinished_tasks: int) -> dict[str, Any]:
    snapshot: dict[str, Any] = {
        "id": queue.id,
        "namespace_id": queue.namespace_id,
        "name": queue.name,
        "paused": queue.paused,
        "max_concurrency": queue.max_concurrency,
        "rate_per_second": queue.rate_per_second,
        "max_unfinished_tasks": queue.max_unfinished_tasks,
        "unfinished_tasks": str(unfinished_tasks),
        "revision": str(queue.revision),
    }
    if queue.retired_at is not None:
        snapshot["retired_at"] = format_time(queue.retired_at)
    return snapshot


def queue_create(*, actor: Actor, name: str, limits: QueueLimits) -> dict[str, Any]:
    """Creates a queue and its counter row. Caller holds the transaction."""
    if Queue.objects.filter(namespace_id=actor.namespace_id, name=name).exists():
        raise StateConflict(f"queue name {name!r} is already taken in this namespace")
    queue = Queue(
        namespace_id=actor.namespace_id,
        application_id=actor.principal.application_id,
        name=name,
        paused=False,
        max_concurrency=limits.max_concurrency,
        rate_per_second=limits.rate_per_second,
        max_unfinished_tasks=limits.max_unfinished_tasks or DEFAULT_MAX_UNFINISHED_TASKS,
        revision=1,
    )
    try:
        # A concurrent create of the same name under another key waits on the
        # unique index and fails here once the winner commits.
        with transaction.atomic():
            queue.save(force_insert=True)
    except IntegrityError as exc:
        raise StateConflict(f"queue name {name!r} is already taken in this namespace") from exc
    QueueState.objects.create(queue_id=queue.id, application_id=queue.application_id)
    snapshot = queue_snapshot(queue, 0)
    record_management_change(
        actor, action="queue.created", target_type="queue", target_id=queue.id, reason="", before=None, after=snapshot
    )
    return snapshot


def _locked_queue_in_namespace(actor: Actor, queue_id: str) -> Queue:
    if not is_resource_id(queue_id):
        raise NotFound("queue not found")
    queue = lock_queue(queue_id)
    if queue is None or queue.namespace_id != actor.namespace_id:
        raise NotFound("queue not found")
    return queue


def _locked_live_queue(actor: Actor, queue_id: str, expected_revision: int) -> Queue:
    """The queue locked for a management change: not retired, at the expected revision."""
    queue = _locked_queue_in_namespace(actor, queue_id)
    if queue.retired_at is not None:
        raise StateConflict("queue is retired")
    require_revision(expected_revision, queue.revision)
    return queue


def _unfinished_tasks_of(queue_id: str) -> int:
    state = QueueState.objects.filter(queue_id=queue_id).only("unfinished_tasks").first()
    return state.unfinished_tasks if state else 0


def queue_configure(
    *, actor: Actor, queue_id: str, expected_revision: int, reason: str, paused: bool, limits: QueueLimits
) -> dict[str, Any]:
    """Full replacement of the control parameters; revision + 1.

    Counters are untouched: lowering a limit never revokes what is held."""
    queue = _locked_live_queue(actor, queue_id, expected_revision)
    unfinished = _unfinished_tasks_of(queue.id)
    before = queue_snapshot(queue, unfinished)
    queue.paused = paused
    queue.max_concurrency = limits.max_concurrency
    queue.rate_per_second = limits.rate_per_second
    queue.max_unfinished_tasks = limits.max_unfinished_tasks
    queue.revision += 1
    queue.updated_at = timezone.now()
    queue.save(
        update_fields=["paused", "max_concurrency", "rate_per_second", "max_unfinished_tasks", "revision", "updated_at"]
    )
    after = queue_snapshot(queue, unfinished)
    record_management_change(
        actor,
        action="queue.configured",
        target_type="queue",
        target_id=queue.id,
        reason=reason,
        before=before,
        after=after,
    )
    return after


def queue_retire(*, actor: Actor, queue_id: str, expected_revision: int, reason: str) -> dict[str, Any]:
    """Permanent: the queue must be paused, empty and no active plan may target
    it; its name stays taken."""
    queue = _locked_live_queue(actor, queue_id, expected_revision)
    if not queue.paused:
        raise StateConflict("queue must be paused before it is retired")
    state = lock_queue_states([queue.id])[queue.id]
    if state.unfinished_tasks != 0:
        count = state.unfinished_tasks
        raise StateConflict(f"queue still has {count} unfinished task{'' if count == 1 else 's'}")
    # Plan create and resume lock this row too before they target the queue.
    if Plan.objects.filter(queue_id=queue.id, state=PlanState.ACTIVE).exists():
        raise StateConflict("queue is targeted by an active plan; pause or retire it first")
    # Submits check this flag under the same row lock, so none can slip in
    # between this check and the commit.
    QueueState.objects.filter(queue_id=queue.id).update(accepting=False)
    before = queue_snapshot(queue, 0)
    now = timezone.now()
    queue.retired_at = now
    queue.revision += 1
    queue.updated_at = now
    queue.save(update_fields=["retired_at", "revision", "updated_at"])
    after = queue_snapshot(queue, 0)
    record_management_change(
        actor,
        action="queue.retired",
        target_type="queue",
        target_id=queue.id,
        reason=reason,
        before=before,
        after=after,
    )
    return after


def queue_get(*, principal: Principal, queue_id: str) -> dict[str, Any]:
    principal.require_queue(queue_id)
    if not is_resource_id(queue_id):
        raise NotFound("queue not found")
    queue = Queue.objects.filter(id=queue_id, namespace_id=principal.namespace_id).first()
    if queue is None:
        raise NotFound("queue not found")
    return queue_snapshot(queue, _unfinished_tasks_of(queue.id))


def queue_list(*, principal: Principal, after_id: str | None, limit: int) -> tuple[list[dict[str, Any]], str | None]:
    queues = Queue.objects.filter(namespace_id=principal.namespace_id)
    if principal.queue_ids is not None:
        queues = queues.filter(id__in=sorted(principal.queue_ids))
    rows, next_id = keyset_page(queues, after_id, limit)
    counts = dict(
        QueueState.objects.filter(queue_id__in=[q.id for q in rows]).values_list("queue_id", "unfinished_tasks")
    )
    return [queue_snapshot(q, counts.get(q.id, 0)) for q in rows], next_id
