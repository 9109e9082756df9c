"""Verbs that end attempts or tasks: the result part of a round (peek_reports,
apply_reports) and the standalone transactions release_attempt, cancel_task,
resolve_task, recover_expired_leases, sweep_deadlines, fail_for_deadline. Each locks in the global order and
re-checks under the locks, so a second arrival changes nothing."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from orbit.audit import record_management_change
from orbit.errors import LeaseLost, NotFound, OrbitError, StateConflict
from orbit.metrics import LEASES_RECOVERED
from orbit.principal import Actor
from orbit.timefmt import format_time
from orbit.transactions import outermost
from tasks.actions import rollup
from tasks.actions.context import WorkerContext, deadline_failure, refuse_revoked
from tasks.actions.permits import (
    Held,
    lock_attempt_chain,
    lock_attempt_chain_and_session,
    lock_attempt_chains,
    lock_task_chain,
    peek_attempt,
    peek_attempts,
    settle,
)
from tasks.actions.serialize import task_detail
from tasks.actions.writebook import WriteBook
from tasks.models import (
    ACTIVE_ATTEMPT_STATES,
    SWEPT_STATES,
    Attempt,
    AttemptState,
    Task,
    TaskState,
    started_with_its_lease,
)
from tasks.wakeups import wake_after_commit

OUTCOMES = ("SUCCEEDED", "FAILED", "UNKNOWN")
RECOVERY_BATCH = 200
LEASE_EXPIRED = {"code": "LEASE_EXPIRED", "message": "lease expired before a result arrived"}


def retry_backoff(task: Task) -> timedelta:
    exponent = max(task.attempts - 1, 0)
    seconds = min(task.retry_initial_seconds * task.retry_multiplier**exponent, task.retry_max_seconds)
    return timedelta(seconds=seconds)


def _recover_locked(held: Held, now: datetime, book: WriteBook | None = None) -> None:
    """An expired lease: unstarted → EXPIRED and the task waits again (no
    attempt consumed); running → UNKNOWN and the task needs review."""
    task, attempt = held.task, held.attempt
    if attempt.state == AttemptState.LEASED:
        expired: dict[str, Any] = {
            "attempt_state": AttemptState.EXPIRED,
            "attempt_fields": {"error": LEASE_EXPIRED},
            "book": book,
        }
        failure = deadline_failure(task, now)
        if failure:
            settle(task, held, now=now, task_state=TaskState.FAILED, last_error=failure, **expired)
        else:
            settle(task, held, now=now, task_state=TaskState.WAITING, **expired)
    else:
        settle(
            task,
            held,
            now=now,
            task_state=TaskState.NEEDS_REVIEW,
            attempt_state=AttemptState.UNKNOWN,
            attempt_fields={"error": LEASE_EXPIRED},
            last_error=LEASE_EXPIRED,
            book=book,
        )
    LEASES_RECOVERED.inc()
    wake_after_commit([task.queue_id])


def _apply_outcome(
    held: Held, outcome: str, retryable: bool, output: Any, error: Any, now: datetime, book: WriteBook
) -> None:
    task = held.task
    if outcome == "SUCCEEDED":
        settle(
            task,
            held,
            now=now,
            task_state=TaskState.SUCCEEDED,
            attempt_state=AttemptState.SUCCEEDED,
            attempt_fields={"outcome": outcome, "output": output},
            output=output,
            book=book,
        )
    elif outcome == "UNKNOWN":
        settle(
            task,
            held,
            now=now,
            task_state=TaskState.NEEDS_REVIEW,
            attempt_state=AttemptState.UNKNOWN,
            attempt_fields={"outcome": outcome, "error": error},
            last_error=error,
            book=book,
        )
    else:
        failed: dict[str, Any] = {
            "attempt_state": AttemptState.FAILED,
            "attempt_fields": {"outcome": outcome, "retryable": retryable, "error": error},
            "book": book,
        }
        if task.cancel_requested:
            settle(task, held, now=now, task_state=TaskState.CANCELLED, last_error=error, **failed)
        elif retryable and task.attempts < task.max_attempts:
            # Safe retry: permits are released now; the task waits out its backoff.
            settle(
                task,
                held,
                now=now,
                task_state=TaskState.WAITING,
                last_error=error,
                available_at=now + retry_backoff(task),
                **failed,
            )
        else:
            settle(task, held, now=now, task_state=TaskState.FAILED, last_error=error, **failed)
    wake_after_commit([task.queue_id])


def _holds(worker: WorkerContext, peek: dict[str, Any] | None, epoch: int) -> bool:
    return (
        peek is not None
        and worker.owns(namespace_id=peek["namespace_id"], worker_id=peek["worker_id"], queue_id=peek["queue_id"])
        and peek["epoch"] == epoch
    )


def _peek_held(worker: WorkerContext, attempt_id: str, epoch: int) -> dict[str, Any]:
    """The unlocked first read of a worker's attempt; refuses one it does not hold."""
    peek = peek_attempt(attempt_id, "worker_id", "epoch")
    if not _holds(worker, peek, epoch):
        raise LeaseLost("attempt is not held by this worker")
    assert peek is not None
    return peek


@dataclass(frozen=True)
class ResultReport:
    worker: WorkerContext
    attempt_id: str
    epoch: int
    outcome: str
    retryable: bool
    output: Any
    error: Any


def peek_reports(
    reports: list[ResultReport], rows: dict[str, Attempt] | None = None
) -> tuple[list[LeaseLost | None], dict[str, dict[str, Any]]]:
    """The unlocked first reads of reports (from `rows`, when the caller read
    them already): a refusal for each report whose attempt the worker does not
    hold (None for the others), and the peeks."""
    peeks = peek_attempts([report.attempt_id for report in reports], "worker_id", "epoch", rows=rows)
    refusals = [
        None
        if _holds(report.worker, peeks.get(report.attempt_id), report.epoch)
        else LeaseLost("attempt is not held by this worker")
        for report in reports
    ]
    return refusals, peeks


def apply_reports(
    reports: list[ResultReport], peeks: dict[str, dict[str, Any]], book: WriteBook
) -> list[dict[str, Any] | OrbitError]:
    """Applies held reports (peeked by peek_reports); caller holds the transaction
    and the reports' application_state and queue_state locks, and writes `book`.
    One outcome per report."""
    chains = lock_attempt_chains(
        {report.attempt_id: peeks[report.attempt_id] for report in reports}, counters_held=True
    )
    now = timezone.now()  # after the locks: leases are judged as of now
    outcomes: list[dict[str, Any] | OrbitError] = []
    for report in reports:
        held = chains.get(report.attempt_id)
        try:
            if held is None:
                raise LeaseLost("attempt is not held by this worker")
            outcomes.append(_apply_report(held, report, now, book))
        except OrbitError as error:  # raised before this report wrote anything
            outcomes.append(error)
    return outcomes


def _apply_report(held: Held, report: ResultReport, now: datetime, book: WriteBook) -> dict[str, Any]:
    attempt = held.attempt
    if attempt.state in ACTIVE_ATTEMPT_STATES and attempt.lease_expires_at <= now:
        _recover_locked(held, now, book)
    if attempt.state == AttemptState.LEASED:
        raise StateConflict("attempt has not started; send task.start or task.release")
    if attempt.state == AttemptState.RUNNING:
        _apply_outcome(held, report.outcome, report.retryable, report.output, report.error, now, book)
        rollup.count("results", held.task.queue_id, now)
        return {"task_state": held.task.state, "duplicate": False, "late": False}
    if attempt.outcome:
        return {"task_state": held.task.state, "duplicate": True, "late": False}
    if attempt.late_outcome is not None:
        return {"task_state": held.task.state, "duplicate": True, "late": True}
    # The attempt already ended (expired, cancelled): keep the evidence on
    # the attempt; no task state or counter moves.
    evidence = {
        "outcome": report.outcome,
        "retryable": report.retryable,
        "output": report.output,
        "error": report.error,
    }
    # Omitted, not null, like every optional field the API shows.
    attempt.late_outcome = {name: value for name, value in evidence.items() if value is not None}
    attempt.late_outcome["received_at"] = format_time(now)
    attempt.save(update_fields=["late_outcome"])
    return {"task_state": held.task.state, "duplicate": False, "late": True}


CANCELLED_BEFORE_DELIVERY = "cancel requested before the task reached its handler"


def release_attempt(
    *, worker: WorkerContext, attempt_id: str, epoch: int, reason: str, undelivered_start: bool = False
) -> dict[str, Any]:
    """A worker hands back an attempt it has not started; no attempt is consumed.

    `undelivered_start`: the connection knows this attempt was started ahead
    (a result's start_next) and never acknowledged, so its handler never ran
    here: the Start is taken back with the lease (SPEC §6, nothing started
    that was never delivered). An attempt started by a task.start of its own
    is never taken back, nor one that a newer connection of the worker_id
    was offered at its hello (held, RUNNING): delivered there."""
    peek = _peek_held(worker, attempt_id, epoch)

    @outermost
    def apply() -> dict[str, Any]:
        session: str | None = worker.session_id
        if undelivered_start and worker.identity_id is not None:
            # Locked: a hello taking the identity over lists the attempt as held
            # either before this transaction (then it is not taken back) or after it.
            held, session = lock_attempt_chain_and_session(attempt_id, peek, worker.identity_id)
        else:
            held = lock_attempt_chain(attempt_id, peek)
        assert held is not None
        # Read, not locked: credentials come before keys and tasks in the
        # global order, and a release grants nothing.
        refuse_revoked([worker], locked=False)
        now = timezone.now()
        attempt = held.attempt
        if attempt.state == AttemptState.RELEASED:
            return {"task_state": held.task.state}
        started_ahead = attempt.state == AttemptState.RUNNING and started_with_its_lease(
            attempt.started_at, attempt.leased_at
        )
        if attempt.state == AttemptState.RUNNING and not (undelivered_start and started_ahead):
            raise StateConflict("attempt already started; report a result instead")
        if attempt.state == AttemptState.RUNNING and session != worker.session_id:
            raise StateConflict("attempt was offered to a newer connection of this worker_id; report its result there")
        if attempt.state not in (AttemptState.LEASED, AttemptState.RUNNING):
            raise LeaseLost("lease is no longer valid")
        attempt_fields: dict[str, Any] = {"error": {"code": "RELEASED", "message": reason}}
        task_fields: dict[str, Any] = {}
        task_state, attempt_state = TaskState.WAITING, AttemptState.RELEASED
        if attempt.state == AttemptState.RUNNING:
            # Its Start never reached a handler: the attempt was not consumed.
            attempt_fields.update(number=None, started_at=None)
            task_fields["attempts"] = held.task.attempts - 1
            if held.task.cancel_requested:
                # Cancelled while started ahead (RUNNING to the API, so only the
                # intent was kept); never delivered, it ends as an unstarted task's cancel does.
                task_state, attempt_state = TaskState.CANCELLED, AttemptState.CANCELLED
                attempt_fields["error"] = {"code": "CANCELLED", "message": CANCELLED_BEFORE_DELIVERY}
        settle(
            held.task,
            held,
            now=now,
            task_state=task_state,
            attempt_state=attempt_state,
            attempt_fields=attempt_fields,
            **task_fields,
        )
        wake_after_commit([held.task.queue_id])
        return {"task_state": held.task.state}

    return apply()


def _locked_visible_task(actor: Actor, task_id: str) -> tuple[Task, Held | None]:
    """The task and its active attempt's chain, locked in the global order, if
    the actor may see it; NOT_FOUND otherwise (never reveal existence)."""
    chain = lock_task_chain(task_id)
    if chain is None or chain[0].namespace_id != actor.namespace_id:
        raise NotFound("task not found")
    if not actor.principal.covers_queue(chain[0].queue_id):
        raise NotFound("task not found")
    return chain


def cancel_task(*, actor: Actor, task_id: str, reason: str) -> dict[str, Any]:
    """WAITING or unstarted → CANCELLED now, permits released in this
    transaction; RUNNING → cancel_requested only. Caller holds the transaction."""
    now = timezone.now()
    task, held = _locked_visible_task(actor, task_id)
    before = {"state": task.state, "cancel_requested": task.cancel_requested}
    if task.state == TaskState.CANCELLED or (task.state == TaskState.RUNNING and task.cancel_requested):
        return {"task": task_detail(task)}  # asked before: nothing changes, nothing to audit
    if task.state in (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.NEEDS_REVIEW):
        raise StateConflict(f"task is {task.state} and cannot be cancelled")
    if task.state == TaskState.RUNNING:
        task.cancel_requested = True
        task.updated_at = now
        task.save(update_fields=["cancel_requested", "updated_at"])
    else:
        settle(
            task,
            held,
            now=now,
            task_state=TaskState.CANCELLED,
            attempt_state=AttemptState.CANCELLED,
            attempt_fields={"error": {"code": "CANCELLED", "message": reason}},
            cancel_requested=True,
        )
        wake_after_commit([task.queue_id])
    record_management_change(
        actor,
        action="task.cancel",
        target_type="task",
        target_id=task.id,
        reason=reason,
        before=before,
        after={"state": task.state, "cancel_requested": task.cancel_requested},
    )
    return {"task": task_detail(task)}


RESOLUTIONS = {"SUCCEEDED": TaskState.SUCCEEDED, "FAILED": TaskState.FAILED, "RETRY": TaskState.WAITING}


def resolve_task(*, actor: Actor, task_id: str, resolution: str, reason: str) -> dict[str, Any]:
    """NEEDS_REVIEW → SUCCEEDED or FAILED (its backlog slot freed now, the first
    entry into a final state) or, for RETRY, WAITING again (available now,
    ready by its key's rules); audited. The attempt whose effect was unknown
    already ended and released its permits. Caller holds the transaction."""
    now = timezone.now()
    task, _ = _locked_visible_task(actor, task_id)
    if task.state != TaskState.NEEDS_REVIEW:
        raise StateConflict(f"task is {task.state}; only a NEEDS_REVIEW task can be resolved")
    if resolution == "RETRY":
        if task.cancel_requested:
            raise StateConflict("task has a cancel request; resolve it SUCCEEDED or FAILED")
        if task.deadline_at is not None and task.deadline_at <= now:
            raise StateConflict("task deadline has passed; resolve it SUCCEEDED or FAILED")
    before = {"state": task.state}
    moved: dict[str, Any] = {"available_at": now} if resolution == "RETRY" else {}
    settle(task, None, now=now, task_state=RESOLUTIONS[resolution], **moved)
    if resolution == "RETRY":
        wake_after_commit([task.queue_id])
    record_management_change(
        actor,
        action="task.resolve",
        target_type="task",
        target_id=task.id,
        reason=reason,
        before=before,
        after={"state": task.state, "resolution": resolution},
    )
    return {"task": task_detail(task)}


def recover_expired_leases(*, limit: int = RECOVERY_BATCH) -> int:
    """Ends attempts whose lease ran out. Safe on every node at once: the
    candidates are read without locks and each is re-checked under its locks."""
    now = timezone.now()
    expired = list(
        Attempt.objects.filter(state__in=list(ACTIVE_ATTEMPT_STATES), lease_expires_at__lte=now)
        .order_by("lease_expires_at")
        .values_list("id", flat=True)[:limit]
    )
    recovered = 0
    for attempt_id in expired:

        @outermost
        def recover(attempt_id: str = attempt_id) -> int:
            held = lock_attempt_chain(attempt_id)
            now = timezone.now()
            if held is None or held.attempt.state not in ACTIVE_ATTEMPT_STATES or held.attempt.lease_expires_at > now:
                return 0
            _recover_locked(held, now)
            return 1

        recovered += recover()
    return recovered


def fail_for_deadline(task_id: str) -> bool:
    """Fails a task whose total or start deadline passed while it waited (or
    sat leased but unstarted). Running tasks are left to their lease."""

    @outermost
    def apply() -> bool:
        now = timezone.now()
        chain = lock_task_chain(task_id)
        if chain is None:
            return False
        task, held = chain
        failure = deadline_failure(task, now)
        if failure is None or task.state not in SWEPT_STATES:
            return False
        if held is not None and held.attempt.state != AttemptState.LEASED:
            return False
        settle(
            task,
            held,
            now=now,
            task_state=TaskState.FAILED,
            attempt_state=AttemptState.EXPIRED,
            attempt_fields={"error": failure},
            last_error=failure,
        )
        wake_after_commit([task.queue_id])
        return True

    return apply()


def sweep_deadlines(*, limit: int = RECOVERY_BATCH) -> int:
    now = timezone.now()
    due = list(Task.objects.filter(deadline_due_at__lte=now).values_list("id", flat=True)[:limit]) + list(
        Task.objects.filter(start_deadline_due_at__lte=now).values_list("id", flat=True)[:limit]
    )
    return sum(fail_for_deadline(task_id) for task_id in dict.fromkeys(due))
