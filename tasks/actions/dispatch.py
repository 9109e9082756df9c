"""Dispatch verbs: lease_tasks, approve_start, renew_lease, resume_attempt, held_assignments."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from orbit.api.auth import Minted
from orbit.audit import emit_event
from orbit.errors import LeaseLost, OrbitError, QueuePaused, RateLimited, TaskCancelled, Unauthenticated
from orbit.fields import UINT64_MAX
from orbit.idempotency import run_retrying
from orbit.metrics import ATTEMPTS_LEASED, ATTEMPTS_STARTED
from orbit.models import Application, ApplicationState, Credential
from orbit.rows import (
    Add,
    add_to_row,
    db_value,
    insert_rows,
    lock_by_pk,
    lock_by_pk_together,
    new_row,
    read_by_pk,
    select_rows,
    update_by_pk,
)
from queues.locks import lock_queue_states
from queues.models import Queue, QueueState
from tasks.actions.readiness import overtaking_sibling, promote_next
from tasks.actions.serialize import assignment
from tasks.locks import lock_application_state, lock_attempt, lock_concurrency_keys
from tasks.models import ACTIVE_ATTEMPT_STATES, Attempt, AttemptState, ConcurrencyKey, Task, TaskState
from workers.groupcommit import unwrap

# Most attempts one lease gives one worker: several workers on several nodes
# share a hot queue instead of the fastest poller taking everything.
LEASE_BATCH_MAX = 16
RATE_WINDOW = timedelta(seconds=1)
# A key row must be able to advance twice more (this lease, then its release).
MAX_LEASABLE_KEY_VERSION = UINT64_MAX - 2
CREDENTIAL_REVOKED = "credential was revoked or no longer grants this connection"


@dataclass(frozen=True)
class WorkerContext:
    namespace_id: str
    application_id: str
    worker_id: str
    session_id: str
    queue_ids: tuple[str, ...]
    handlers: tuple[tuple[str, str], ...]
    concurrency_keys: bool
    # The connection's worker identity row, whose session must still be this
    # one for a lease (a newer hello of the worker_id supersedes it); None for
    # in-process callers, which have no connection.
    identity_id: int | None = None
    # The queues the connection's credential may consume (None: every queue
    # of the namespace). Worker ids are not secret (every attempt shows them):
    # an attempt of another queue is not this connection's, whatever its
    # worker_id says, and is answered as an unknown attempt.
    consumable: frozenset[str] | None = None
    # The credential as the connection authenticated it: every transaction
    # that grants or records for this worker reads its row again (locked) and
    # refuses if it no longer grants; None for in-process callers.
    credential: Minted | None = None

    def owns(self, *, namespace_id: str, worker_id: str, queue_id: str) -> bool:
        """Whether an attempt with these columns is this connection's to act on."""
        return (
            namespace_id == self.namespace_id
            and worker_id == self.worker_id
            and (self.consumable is None or queue_id in self.consumable)
        )

    def owns_attempt(self, attempt: Attempt) -> bool:
        return self.owns(namespace_id=attempt.namespace_id, worker_id=attempt.worker_id, queue_id=attempt.queue_id)

    def range_filter(self) -> dict[str, Any]:
        """Attempt filters for what this connection holds (held, capacity)."""
        found: dict[str, Any] = {"namespace_id": self.namespace_id, "worker_id": self.worker_id}
        if self.consumable is not None:
            found["queue_id__in"] = sorted(self.consumable)
        return found


def confirm_credentials(workers: Iterable[WorkerContext], *, locked: bool = True) -> set[str]:
    """Reads the workers' credential rows again inside the caller's
    transaction (locked, so a revocation commits before or after this
    transaction, never during it); returns the ids of those that no longer
    grant what the connection authenticated with (revoked, or changed)."""
    minted = {worker.credential.principal.credential_id: worker.credential for worker in workers if worker.credential}
    if not minted:
        return set()
    rows = lock_by_pk(Credential, minted) if locked else read_by_pk(Credential, minted)
    return {credential_id for credential_id, grant in minted.items() if not grant.still_grants(rows.get(credential_id))}


def refuse_revoked(workers: Iterable[WorkerContext], *, locked: bool = True) -> None:
    """Raises UNAUTHENTICATED if a worker's credential no longer grants (caller holds the transaction)."""
    if confirm_credentials(workers, locked=locked):
        raise Unauthenticated(CREDENTIAL_REVOKED)


def window_open(state: QueueState, now: datetime) -> bool:
    return state.window_started_at is not None and now < state.window_started_at + RATE_WINDOW


@dataclass(frozen=True)
class Configuration:
    """The applications and queues a round works with, read once before its
    transaction. Configuration is always read without a lock (a configure
    racing a lease or start may order either way); reading it ahead keeps
    those reads out of the section that holds the application's locks."""

    applications: dict[str, Application]
    queues: dict[str, Queue]

    @classmethod
    def read(cls, application_ids: Iterable[str], queue_ids: Iterable[str]) -> Configuration:
        return cls(applications=read_by_pk(Application, application_ids), queues=read_by_pk(Queue, queue_ids))

    def application(self, application_id: str) -> Application:
        found = self.applications.get(application_id)
        if found is None:
            raise Application.DoesNotExist(application_id)
        return found

    def queues_of(self, queue_ids: Iterable[str]) -> list[Queue]:
        return [self.queues[queue_id] for queue_id in queue_ids if queue_id in self.queues]


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
    from tasks.actions.rounds import LeaseRequest, run_round

    return unwrap(run_round([LeaseRequest(worker, limit)])[0])


def _candidates(worker: WorkerContext, queue_id: str, now: datetime, count: int) -> list[Task]:
    """The best `count` leasable tasks of a queue for this worker, locked,
    skipping rows another lease holds (the dispatch index, SPEC §10)."""
    quote = connection.ops.quote_name
    task_table, key_table = quote(Task._meta.db_table), quote(ConcurrencyKey._meta.db_table)
    at = db_value(Task, "available_at", now)
    where = [
        "available_at <= %s AND key_ready = %s AND queue_id = %s AND state = %s",
        "(deadline_at IS NULL OR deadline_at > %s)",
    ]
    params: list[Any] = [at, True, queue_id, TaskState.WAITING, at]
    if worker.concurrency_keys:
        # Occupied keys are excluded before the LIMIT, so a backlog behind one
        # busy key never hides the work of other keys. A key whose token space
        # is spent can never lease again: it is excluded the same way (the
        # bound is a literal: SQLite's integers cannot hold it as a parameter).
        where.append(
            f"(concurrency_key = '' OR NOT EXISTS (SELECT 1 FROM {key_table} k"
            f" WHERE k.{quote('key')} = {task_table}.concurrency_key AND k.namespace_id = {task_table}.namespace_id"
            f" AND (k.holder_attempt_id <> '' OR k.version > {int(MAX_LEASABLE_KEY_VERSION)})))"
        )
    else:
        where.append("concurrency_key = ''")
    if worker.handlers:
        where.append(f"({' OR '.join(['(handler = %s AND handler_version = %s)'] * len(worker.handlers))})")
        params += [part for pair in worker.handlers for part in pair]
    order = "ORDER BY priority DESC, available_at ASC, id ASC LIMIT %s"
    return select_rows(Task, f"{' AND '.join(where)} {order}", [*params, count], lock=True, skip_locked=True)


def lease(requests: list[tuple[WorkerContext, int]], configuration: Configuration) -> list[LeaseOutcome]:
    """Leases for several workers of one kind (same namespace, queues, handlers
    and key opt-in) at once: up to its limit (at most LEASE_BATCH_MAX) for each,
    filled in request order. Caller holds the transaction. One candidate scan,
    one set of counter writes, however many workers asked."""
    worker = requests[0][0]  # what the kind shares
    limits = [max(0, min(limit, LEASE_BATCH_MAX)) for _, limit in requests]
    if sum(limits) <= 0:
        return [LeaseOutcome([]) for _ in requests]
    app_state = lock_application_state(worker.application_id)
    # Read the clock after the lock: leases of one application are serialized
    # here, so lease times follow token order.
    now = timezone.now()
    max_active = configuration.application(worker.application_id).max_active_attempts
    want = min(sum(limits), max_active - app_state.active_attempts)
    if want <= 0:
        return [LeaseOutcome([]) for _ in requests]
    states = lock_queue_states(worker.queue_ids)
    queues = [queue for queue in configuration.queues_of(states) if queue.namespace_id == worker.namespace_id]
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
        return [LeaseOutcome([], rate_reopens_in) for _ in requests]
    candidates: list[Task] = []
    for queue_id, room in sorted(headroom.items()):
        candidates.extend(_candidates(worker, queue_id, now, min(want, room)))
    candidates.sort(key=lambda t: (-t.priority, t.available_at, t.id))
    key_rows = lock_concurrency_keys(worker.namespace_id, [t.concurrency_key for t in candidates if t.concurrency_key])

    chosen: list[tuple[Task, Attempt]] = []
    taken_per_queue: dict[str, int] = {}
    # Which request the next attempt goes to: each is filled up to its limit in turn.
    takers = iter([index for index, limit in enumerate(limits) for _ in range(limit)])
    assignments: list[list[dict[str, Any]]] = [[] for _ in requests]
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
            sibling = overtaking_sibling(task, now)
            if sibling is not None:
                if worker.handlers and (sibling.handler, sibling.handler_version) not in worker.handlers:
                    continue  # the key's turn is the sibling's, for a worker that serves it
                task = sibling
            key_row.version += 1
            token = key_row.version
        taker = next(takers)
        holder = requests[taker][0]
        task.epoch += 1
        attempt = new_row(
            Attempt,
            task_id=task.id,
            namespace_id=task.namespace_id,
            application_id=task.application_id,
            queue_id=task.queue_id,
            state=AttemptState.LEASED,
            epoch=task.epoch,
            concurrency_key=task.concurrency_key,
            concurrency_token=token,
            worker_id=holder.worker_id,
            session_id=holder.session_id,
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
        assignments[taker].append(assignment(task, attempt))
        taken_per_queue[task.queue_id] = taken_per_queue.get(task.queue_id, 0) + 1
    if not chosen:
        return [LeaseOutcome([], rate_reopens_in) for _ in requests]

    insert_rows([attempt for _, attempt in chosen])
    # Every chosen task was locked WAITING at its epoch: one statement moves them all.
    update_by_pk(Task, [task.id for task, _ in chosen], {"state": TaskState.LEASED, "epoch": Add(1), "updated_at": now})
    for task, _ in chosen:  # each was its key's ready task in its queue: hand the role on
        promote_next(
            namespace_id=task.namespace_id, concurrency_key=task.concurrency_key, queue_id=task.queue_id, now=now
        )
    add_to_row(ApplicationState, worker.application_id, {"active_attempts": len(chosen)})
    for queue_id, count in sorted(taken_per_queue.items()):
        add_to_row(QueueState, queue_id, {"active_permits": count, "reserved_starts": count})
    _emit_moves([task for task, _ in chosen], TaskState.LEASED, previous=TaskState.WAITING)
    ATTEMPTS_LEASED.inc(len(chosen))
    return [LeaseOutcome(entries, rate_reopens_in) for entries in assignments]


def _emit_moves(tasks: list[Task], state: str, *, previous: str) -> None:
    """One task.state_changed event per task (a round gathers them into one insert)."""
    for task in tasks:
        emit_event(
            namespace_id=task.namespace_id,
            type="task.state_changed",
            subject_id=task.id,
            data={"queue_id": task.queue_id, "state": state, "previous": previous},
        )


def _peek_own_attempt(worker: WorkerContext, attempt_id: str) -> Attempt:
    attempt = Attempt.objects.filter(id=attempt_id, namespace_id=worker.namespace_id).first()
    if attempt is None or not worker.owns_attempt(attempt):
        raise LeaseLost("attempt is not held by this worker")
    return attempt


def _start_receipt(attempt: Attempt) -> dict[str, Any]:
    from orbit.timefmt import format_time

    return {"attempt_number": attempt.number, "lease_expires_at": format_time(attempt.lease_expires_at)}


@dataclass(frozen=True)
class StartRequest:
    worker: WorkerContext
    attempt_id: str
    epoch: int


def approve_start(*, worker: WorkerContext, attempt_id: str, epoch: int) -> dict[str, Any]:
    """Grants the right to run: counts one Start in the queue's rate window.

    A replayed Start of a running attempt is answered from the record."""
    from tasks.actions.rounds import run_round

    return unwrap(run_round([StartRequest(worker, attempt_id, epoch)])[0])


def peek_starts(
    requests: list[StartRequest], rows: dict[str, Attempt] | None = None
) -> tuple[list[dict[str, Any] | LeaseLost | None], dict[str, Attempt]]:
    """The unlocked first reads of Starts (from `rows`, when the caller read
    them already): an answer for each request that needs no transaction (not
    held, wrong epoch, replay of a running attempt), None for the others; and
    the peeked attempts."""
    peeks = read_by_pk(Attempt, [request.attempt_id for request in requests]) if rows is None else rows
    answers: list[dict[str, Any] | LeaseLost | None] = []
    for request in requests:
        peek, worker = peeks.get(request.attempt_id), request.worker
        if peek is None or not worker.owns_attempt(peek):
            answers.append(LeaseLost("attempt is not held by this worker"))
        elif peek.epoch != request.epoch:
            answers.append(LeaseLost("epoch does not match the current lease"))
        elif peek.state == AttemptState.RUNNING:
            answers.append(_start_receipt(peek))
        else:
            answers.append(None)
    return answers, peeks


def finish_start(peek: Attempt, outcome: dict[str, Any] | OrbitError | DeadlinePassed) -> dict[str, Any] | OrbitError:
    """After the Start transaction: a task whose deadline passed is failed.
    That moves application counters, whose lock comes first in the global
    order, so it is a transaction of its own."""
    from tasks.actions.endings import fail_for_deadline

    if isinstance(outcome, DeadlinePassed):
        fail_for_deadline(peek.task_id)
        return LeaseLost("task deadline passed before start")
    return outcome


class DeadlinePassed(Exception):
    pass


def deadline_failure(task: Task, now: datetime) -> dict[str, str] | None:
    if task.deadline_at and task.deadline_at <= now:
        return {"code": "DEADLINE_EXCEEDED", "message": "task deadline passed"}
    if task.start_deadline_at and task.start_deadline_at <= now and task.attempts == 0:
        return {"code": "START_DEADLINE_EXCEEDED", "message": "no attempt started before start_deadline_at"}
    return None


def apply_starts(
    requests: list[StartRequest], peeks: dict[str, Attempt], configuration: Configuration
) -> list[dict[str, Any] | OrbitError | DeadlinePassed]:
    """Decides Starts (peeked by peek_starts) under their locks; caller holds the
    transaction. One outcome per request."""
    states = lock_queue_states(peeks[request.attempt_id].queue_id for request in requests)
    tasks, attempts = lock_by_pk_together(  # tasks → attempts, one round trip
        [
            (Task, [peeks[request.attempt_id].task_id for request in requests]),
            (Attempt, [request.attempt_id for request in requests]),
        ]
    )
    # Read the clock after the locks: a Start that waited on them must judge
    # its lease and the rate window by the time it is decided, not queued.
    now = timezone.now()
    queues = {queue.id: queue for queue in configuration.queues_of(states)}
    started: list[tuple[Task, Attempt]] = []
    outcomes: list[dict[str, Any] | OrbitError | DeadlinePassed] = []
    for request in requests:
        peek = peeks[request.attempt_id]
        task, attempt = tasks.get(peek.task_id), attempts.get(peek.id)
        try:
            outcomes.append(
                _start_one(request, task, attempt, states[peek.queue_id], queues[peek.queue_id], now, started)
            )
        except (OrbitError, DeadlinePassed) as refusal:  # raised before this request changed anything
            outcomes.append(refusal)
    if not started:
        return outcomes
    per_queue = Counter(task.queue_id for task, _ in started)
    for queue_id, count in sorted(per_queue.items()):
        state = states[queue_id]
        update_by_pk(
            QueueState,
            [queue_id],
            {
                "window_started_at": state.window_started_at,
                "window_count": state.window_count,
                "reserved_starts": Add(-count),
            },
        )
    # Started tasks were locked LEASED: one statement moves them all; attempts
    # differ only in number and lease end, so one statement per distinct pair.
    update_by_pk(
        Task, [task.id for task, _ in started], {"state": TaskState.RUNNING, "attempts": Add(1), "updated_at": now}
    )
    alike: dict[tuple[int | None, datetime], list[str]] = {}
    for _, attempt in started:
        alike.setdefault((attempt.number, attempt.lease_expires_at), []).append(attempt.id)
    for (number, lease_expires_at), attempt_ids in alike.items():
        update_by_pk(
            Attempt,
            attempt_ids,
            {
                "state": AttemptState.RUNNING,
                "number": number,
                "started_at": now,
                "lease_expires_at": lease_expires_at,
            },
        )
    _emit_moves([task for task, _ in started], TaskState.RUNNING, previous=TaskState.LEASED)
    ATTEMPTS_STARTED.inc(len(started))
    return outcomes


def _start_one(
    request: StartRequest,
    task: Task | None,
    attempt: Attempt | None,
    state: QueueState,
    queue: Queue,
    now: datetime,
    started: list[tuple[Task, Attempt]],
) -> dict[str, Any]:
    """Decides one Start under the group's locks. The queue state is shared by
    the group: each approval counts in the window the next one sees."""
    if task is None or attempt is None:
        raise LeaseLost("attempt is not held by this worker")
    if attempt.epoch != request.epoch or attempt.worker_id != request.worker.worker_id:
        raise LeaseLost("epoch does not match the current lease")
    if attempt.state == AttemptState.RUNNING:
        return _start_receipt(attempt)
    if attempt.state == AttemptState.CANCELLED:
        raise TaskCancelled("task was cancelled before start")
    if attempt.state != AttemptState.LEASED or attempt.lease_expires_at <= now:
        raise LeaseLost("lease is no longer valid")
    if deadline_failure(task, now) is not None:
        raise DeadlinePassed()
    if queue.paused or queue.retired_at is not None:
        raise QueuePaused("queue is paused")
    if not window_open(state, now):
        state.window_started_at = now
        state.window_count = 0
    if state.window_count >= queue.rate_per_second:
        remaining = state.window_started_at + RATE_WINDOW - now
        raise RateLimited(max(1, math.ceil(remaining.total_seconds() * 1000)))
    state.window_count += 1
    task.attempts += 1
    task.state = TaskState.RUNNING
    task.updated_at = now
    attempt.state = AttemptState.RUNNING
    attempt.number = task.attempts
    attempt.started_at = now
    attempt.lease_expires_at = max(attempt.lease_expires_at, lease_expiry(task, now))
    started.append((task, attempt))
    return _start_receipt(attempt)


def renew_lease(*, worker: WorkerContext, attempt_id: str, epoch: int) -> dict[str, Any]:
    """Extends an active lease (and with it the key permit the attempt holds).

    Locks the attempt row alone; never past the task's total deadline."""
    return run_retrying(lambda: _renew(worker, attempt_id, epoch))


def _renew(worker: WorkerContext, attempt_id: str, epoch: int) -> dict[str, Any]:
    from orbit.timefmt import format_time

    with transaction.atomic():
        refuse_revoked([worker])  # credentials come before attempts in the global order
        attempt = lock_attempt(attempt_id)
        now = timezone.now()  # after the lock: the lease is judged as of now
        if (
            attempt is None
            or not worker.owns_attempt(attempt)
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


def held_assignments(*, worker: WorkerContext) -> list[dict[str, Any]]:
    """The attempts this connection may resume (hello's `held`): those of its
    worker identity in queues its credential may consume. Others of the same
    worker_id run out their lease as if their worker were gone."""
    attempts = list(
        Attempt.objects.filter(
            **worker.range_filter(),
            state__in=list(ACTIVE_ATTEMPT_STATES),
            lease_expires_at__gt=timezone.now(),
        ).order_by("leased_at")
    )
    tasks = Task.objects.in_bulk([a.task_id for a in attempts])
    return [held_entry(tasks[a.task_id], a) for a in attempts if a.task_id in tasks]


def held_attempt_ids(*, worker: WorkerContext) -> set[str]:
    """Ids of the attempts this connection holds right now (capacity accounting)."""
    return set(
        Attempt.objects.filter(
            **worker.range_filter(),
            state__in=list(ACTIVE_ATTEMPT_STATES),
            lease_expires_at__gt=timezone.now(),
        ).values_list("id", flat=True)
    )
