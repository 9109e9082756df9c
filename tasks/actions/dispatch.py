"""Dispatch verbs: lease_tasks, approve_start, renew_lease, resume_attempt, held_assignments."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import reduce
from operator import or_
from typing import Any

from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q
from django.utils import timezone

from orbit.audit import emit_event
from orbit.errors import LeaseLost, QueuePaused, RateLimited, TaskCancelled
from orbit.fields import UINT64_MAX
from orbit.idempotency import run_retrying
from orbit.metrics import ATTEMPTS_LEASED, ATTEMPTS_STARTED
from orbit.models import Application, ApplicationState, Event
from queues.locks import lock_queue_states
from queues.models import Queue, QueueState
from tasks.actions.readiness import promote_next
from tasks.actions.serialize import assignment
from tasks.locks import lock_application_state, lock_attempt, lock_concurrency_keys, lock_task
from tasks.models import ACTIVE_ATTEMPT_STATES, Attempt, AttemptState, ConcurrencyKey, Task, TaskState

# Most attempts one lease transaction creates: several workers on several
# nodes share a hot queue instead of the fastest poller taking everything.
LEASE_BATCH_MAX = 16
RATE_WINDOW = timedelta(seconds=1)
# A key row must be able to advance twice more (this lease, then its release).
MAX_LEASABLE_KEY_VERSION = UINT64_MAX - 2


@dataclass(frozen=True)
class WorkerContext:
    namespace_id: str
    application_id: str
    worker_id: str
    session_id: str
    queue_ids: tuple[str, ...]
    handlers: tuple[tuple[str, str], ...]
    concurrency_keys: bool


def window_open(state: QueueState, now: datetime) -> bool:
    return state.window_started_at is not None and now < state.window_started_at + RATE_WINDOW


def lease_expiry(task: Task, now: datetime) -> datetime:
    expires = now + timedelta(seconds=task.lease_seconds)
    return min(expires, task.deadline_at) if task.deadline_at else expires


@dataclass(frozen=True)
class LeaseOutcome:
    assignments: list[dict[str, Any]]
    # Seconds until a queue's full start window closes and leasing may resume
    # (None when no queue was held back by its start rate).
    rate_reopens_in: float | None = None


def lease_tasks(*, worker: WorkerContext, limit: int) -> list[dict[str, Any]]:
    """Leases up to `limit` tasks for a worker in one transaction; returns task.assign bodies."""
    return lease_for_worker(worker=worker, limit=limit).assignments


def lease_for_worker(*, worker: WorkerContext, limit: int) -> LeaseOutcome:
    """lease_tasks, plus when a queue held back by its start window reopens, so
    a dispatcher can come back exactly then instead of at its next poll."""
    limit = min(limit, LEASE_BATCH_MAX)
    if limit <= 0:
        return LeaseOutcome([])
    return run_retrying(lambda: _lease(worker, limit))


def _candidates(worker: WorkerContext, queue_id: str, now: datetime, count: int) -> list[Task]:
    tasks = Task.objects.filter(
        queue_id=queue_id, state=TaskState.WAITING, key_ready=True, available_at__lte=now
    ).filter(Q(deadline_at__isnull=True) | Q(deadline_at__gt=now))
    if worker.concurrency_keys:
        # Occupied keys are excluded before the LIMIT, so a backlog behind one
        # busy key never hides the work of other keys. A key whose token space
        # is spent can never lease again: it is excluded the same way.
        occupied = ConcurrencyKey.objects.filter(
            namespace_id=OuterRef("namespace_id"), key=OuterRef("concurrency_key")
        ).filter(~Q(holder_attempt_id="") | Q(version__gt=MAX_LEASABLE_KEY_VERSION))
        tasks = tasks.filter(Q(concurrency_key="") | ~Exists(occupied))
    else:
        tasks = tasks.filter(concurrency_key="")
    if worker.handlers:
        tasks = tasks.filter(reduce(or_, [Q(handler=h, handler_version=v) for h, v in worker.handlers]))
    return list(tasks.order_by("-priority", "available_at", "id").select_for_update(skip_locked=True)[:count])


@transaction.atomic
def _lease(worker: WorkerContext, limit: int) -> LeaseOutcome:
    app_state = lock_application_state(worker.application_id)
    # Read the clock after the lock: leases of one application are serialized
    # here, so lease times follow token order.
    now = timezone.now()
    max_active = Application.objects.values_list("max_active_attempts", flat=True).get(id=worker.application_id)
    want = min(limit, max_active - app_state.active_attempts)
    if want <= 0:
        return LeaseOutcome([])
    states = lock_queue_states(worker.queue_ids)
    queues = Queue.objects.filter(id__in=list(states), namespace_id=worker.namespace_id)
    headroom: dict[str, int] = {}
    rate_reopens_in: float | None = None
    for queue in queues:
        if queue.paused or queue.retired_at is not None:
            continue
        state = states[queue.id]
        used = state.window_count if window_open(state, now) else 0
        # Leases reserve window room for attempts not yet started, so a lease
        # never creates an attempt its queue could not let start.
        rate_room = queue.rate_per_second - used - state.reserved_starts
        room = min(queue.max_concurrency - state.active_permits, rate_room)
        if room > 0:
            headroom[queue.id] = room
        elif rate_room <= 0 and used and state.window_started_at is not None:
            reopens = (state.window_started_at + RATE_WINDOW - now).total_seconds()
            rate_reopens_in = reopens if rate_reopens_in is None else min(rate_reopens_in, reopens)
    if not headroom:
        return LeaseOutcome([], rate_reopens_in)
    candidates: list[Task] = []
    for queue_id, room in sorted(headroom.items()):
        candidates.extend(_candidates(worker, queue_id, now, min(want, room)))
    candidates.sort(key=lambda t: (-t.priority, t.available_at, t.id))
    key_rows = lock_concurrency_keys(worker.namespace_id, [t.concurrency_key for t in candidates if t.concurrency_key])

    chosen: list[tuple[Task, Attempt]] = []
    taken_per_queue: dict[str, int] = {}
    for task in candidates:
        if len(chosen) >= want:
            break
        if taken_per_queue.get(task.queue_id, 0) >= headroom[task.queue_id]:
            continue
        token = None
        key_row = key_rows.get(task.concurrency_key) if task.concurrency_key else None
        if task.concurrency_key and key_row is None:
            continue  # never lease a keyed task without its key permit
        if key_row is not None:
            if key_row.holder_attempt_id or key_row.version > MAX_LEASABLE_KEY_VERSION:
                # Held (by a twin in this batch or a lease that won the race),
                # or the token space is spent: refuse rather than wrap.
                continue
            key_row.version += 1
            token = key_row.version
        task.epoch += 1
        attempt = Attempt(
            task_id=task.id,
            namespace_id=task.namespace_id,
            application_id=task.application_id,
            queue_id=task.queue_id,
            state=AttemptState.LEASED,
            epoch=task.epoch,
            concurrency_key=task.concurrency_key,
            concurrency_token=token,
            worker_id=worker.worker_id,
            session_id=worker.session_id,
            leased_at=now,
            lease_expires_at=lease_expiry(task, now),
        )
        if key_row is not None:
            key_row.holder_attempt_id = attempt.id
            key_row.holder_task_id = task.id
            key_row.updated_at = now
            key_row.save(update_fields=["version", "holder_attempt_id", "holder_task_id", "updated_at"])
        task.state = TaskState.LEASED
        task.updated_at = now
        chosen.append((task, attempt))
        taken_per_queue[task.queue_id] = taken_per_queue.get(task.queue_id, 0) + 1
    if not chosen:
        return LeaseOutcome([], rate_reopens_in)

    Attempt.objects.bulk_create([attempt for _, attempt in chosen])
    Task.objects.bulk_update([task for task, _ in chosen], ["state", "epoch", "updated_at"])
    for task, _ in chosen:  # each was its key's ready task in its queue: hand the role on
        promote_next(
            namespace_id=task.namespace_id, concurrency_key=task.concurrency_key, queue_id=task.queue_id, now=now
        )
    ApplicationState.objects.filter(application_id=worker.application_id).update(
        active_attempts=F("active_attempts") + len(chosen)
    )
    for queue_id, count in taken_per_queue.items():
        QueueState.objects.filter(queue_id=queue_id).update(
            active_permits=F("active_permits") + count, reserved_starts=F("reserved_starts") + count
        )
    Event.objects.bulk_create(
        [
            Event(
                namespace_id=task.namespace_id,
                type="task.state_changed",
                subject_id=task.id,
                data={"queue_id": task.queue_id, "state": TaskState.LEASED, "previous": TaskState.WAITING},
            )
            for task, _ in chosen
        ]
    )
    ATTEMPTS_LEASED.inc(len(chosen))
    return LeaseOutcome([assignment(task, attempt) for task, attempt in chosen], rate_reopens_in)


def _peek_own_attempt(worker: WorkerContext, attempt_id: str) -> Attempt:
    attempt = Attempt.objects.filter(id=attempt_id, namespace_id=worker.namespace_id).first()
    if attempt is None or attempt.worker_id != worker.worker_id:
        raise LeaseLost("attempt is not held by this worker")
    return attempt


def _start_receipt(attempt: Attempt) -> dict[str, Any]:
    from orbit.timefmt import format_time

    return {"attempt_number": attempt.number, "lease_expires_at": format_time(attempt.lease_expires_at)}


def approve_start(*, worker: WorkerContext, attempt_id: str, epoch: int) -> dict[str, Any]:
    """Grants the right to run: counts one Start in the queue's rate window.

    A replayed Start of a running attempt is answered from the record."""
    from tasks.actions.endings import fail_for_deadline

    peek = _peek_own_attempt(worker, attempt_id)
    if peek.epoch != epoch:
        raise LeaseLost("epoch does not match the current lease")
    if peek.state == AttemptState.RUNNING:
        return _start_receipt(peek)
    try:
        return run_retrying(lambda: _start(worker, peek, epoch))
    except _DeadlinePassed:
        # Failing the task moves application counters, whose lock comes first
        # in the global order: do it in a transaction of its own.
        fail_for_deadline(peek.task_id)
        raise LeaseLost("task deadline passed before start") from None


class _DeadlinePassed(Exception):
    pass


def deadline_failure(task: Task, now: datetime) -> dict[str, str] | None:
    if task.deadline_at and task.deadline_at <= now:
        return {"code": "DEADLINE_EXCEEDED", "message": "task deadline passed"}
    if task.start_deadline_at and task.start_deadline_at <= now and task.attempts == 0:
        return {"code": "START_DEADLINE_EXCEEDED", "message": "no attempt started before start_deadline_at"}
    return None


@transaction.atomic
def _start(worker: WorkerContext, peek: Attempt, epoch: int) -> dict[str, Any]:
    state = lock_queue_states([peek.queue_id])[peek.queue_id]
    task = lock_task(peek.task_id)
    attempt = lock_attempt(peek.id)
    assert task is not None and attempt is not None
    # Read the clock after the locks: a Start that waited on them must judge
    # its lease and the rate window by the time it is decided, not queued.
    now = timezone.now()
    if attempt.epoch != epoch or attempt.worker_id != worker.worker_id:
        raise LeaseLost("epoch does not match the current lease")
    if attempt.state == AttemptState.RUNNING:
        return _start_receipt(attempt)
    if attempt.state == AttemptState.CANCELLED:
        raise TaskCancelled("task was cancelled before start")
    if attempt.state != AttemptState.LEASED or attempt.lease_expires_at <= now:
        raise LeaseLost("lease is no longer valid")
    if deadline_failure(task, now) is not None:
        raise _DeadlinePassed()
    queue = Queue.objects.only("paused", "retired_at", "rate_per_second").get(id=peek.queue_id)
    if queue.paused or queue.retired_at is not None:
        raise QueuePaused("queue is paused")
    if not window_open(state, now):
        state.window_started_at = now
        state.window_count = 0
    if state.window_count >= queue.rate_per_second:
        remaining = state.window_started_at + RATE_WINDOW - now
        raise RateLimited(max(1, math.ceil(remaining.total_seconds() * 1000)))
    QueueState.objects.filter(queue_id=state.queue_id).update(
        window_started_at=state.window_started_at,
        window_count=state.window_count + 1,
        reserved_starts=F("reserved_starts") - 1,
    )
    task.attempts += 1
    task.state = TaskState.RUNNING
    task.updated_at = now
    task.save(update_fields=["attempts", "state", "updated_at"])
    attempt.state = AttemptState.RUNNING
    attempt.number = task.attempts
    attempt.started_at = now
    attempt.lease_expires_at = max(attempt.lease_expires_at, lease_expiry(task, now))
    attempt.save(update_fields=["state", "number", "started_at", "lease_expires_at"])
    emit_event(
        namespace_id=task.namespace_id,
        type="task.state_changed",
        subject_id=task.id,
        data={"queue_id": task.queue_id, "state": TaskState.RUNNING, "previous": TaskState.LEASED},
    )
    ATTEMPTS_STARTED.inc()
    return _start_receipt(attempt)


def renew_lease(*, worker: WorkerContext, attempt_id: str, epoch: int) -> dict[str, Any]:
    """Extends an active lease (and with it the key permit the attempt holds).

    Locks the attempt row alone; never past the task's total deadline."""
    from orbit.timefmt import format_time

    with transaction.atomic():
        attempt = lock_attempt(attempt_id)
        now = timezone.now()  # after the lock: the lease is judged as of now
        if (
            attempt is None
            or attempt.namespace_id != worker.namespace_id
            or attempt.worker_id != worker.worker_id
            or attempt.epoch != epoch
            or attempt.state not in ACTIVE_ATTEMPT_STATES
            or attempt.lease_expires_at <= now
        ):
            raise LeaseLost("lease is no longer valid")
        task = Task.objects.only("lease_seconds", "deadline_at", "cancel_requested").get(id=attempt.task_id)
        expires = lease_expiry(task, now)
        if expires > attempt.lease_expires_at:
            attempt.lease_expires_at = expires
            attempt.save(update_fields=["lease_expires_at"])
        return {"lease_expires_at": format_time(attempt.lease_expires_at), "cancel_requested": task.cancel_requested}


def held_entry(task: Task, attempt: Attempt) -> dict[str, Any]:
    entry = assignment(task, attempt)
    entry["state"] = attempt.state
    if attempt.number is not None:
        entry["attempt_number"] = attempt.number
    return entry


def resume_attempt(*, worker: WorkerContext, attempt_id: str, epoch: int) -> dict[str, Any]:
    """The same assignment again, for a worker that reconnected within its lease."""
    attempt = _peek_own_attempt(worker, attempt_id)
    if (
        attempt.epoch != epoch
        or attempt.state not in ACTIVE_ATTEMPT_STATES
        or attempt.lease_expires_at <= timezone.now()
    ):
        raise LeaseLost("lease is no longer valid")
    return held_entry(Task.objects.get(id=attempt.task_id), attempt)


def held_assignments(*, namespace_id: str, worker_id: str) -> list[dict[str, Any]]:
    attempts = list(
        Attempt.objects.filter(
            namespace_id=namespace_id,
            worker_id=worker_id,
            state__in=list(ACTIVE_ATTEMPT_STATES),
            lease_expires_at__gt=timezone.now(),
        ).order_by("leased_at")
    )
    tasks = Task.objects.in_bulk([a.task_id for a in attempts])
    return [held_entry(tasks[a.task_id], a) for a in attempts if a.task_id in tasks]


def held_attempt_ids(*, namespace_id: str, worker_id: str) -> set[str]:
    """Ids of the attempts a worker identity holds right now (capacity accounting)."""
    return set(
        Attempt.objects.filter(
            namespace_id=namespace_id,
            worker_id=worker_id,
            state__in=list(ACTIVE_ATTEMPT_STATES),
            lease_expires_at__gt=timezone.now(),
        ).values_list("id", flat=True)
    )
