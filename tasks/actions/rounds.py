"""Dispatch rounds: the results, starts and leases of one application that
arrived together, decided in one transaction.

Every result and lease of an application locks its application_state row, and
every result, start and lease locks its queue_state rows: one at a time is all
that row lets through anyway. A round takes those locks once, in the global
order, then applies in turn the results (which free capacity and key permits),
the starts, and the leases (which can use what the results freed), and
commits once. Each part keeps the rules of its single verb and gives every
request its own answer; a lone request is a round of one.

Lock order inside a round: application_state → the union of the round's
queue_state rows (ascending) → key rows → tasks → attempts. Each part re-locks
the rows it needs (the counter rows the round holds are kept, with the
round's own changes, and cost no statement: orbit.rows.holding); the rows locked after
the union are only ever waited for by transactions that hold the same
application_state row first, so the parts cannot deadlock with other paths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction

from orbit.audit import gathered_events
from orbit.errors import OrbitError
from orbit.idempotency import run_retrying
from orbit.models import ApplicationState
from orbit.rows import holding
from queues.locks import lock_queue_states
from queues.models import QueueState
from tasks.actions import dispatch, endings
from tasks.actions.dispatch import LeaseOutcome, StartRequest, WorkerContext
from tasks.actions.endings import ResultReport
from tasks.actions.permits import WriteBook
from tasks.locks import lock_application_state


@dataclass(frozen=True)
class LeaseRequest:
    worker: WorkerContext
    limit: int


RoundItem = ResultReport | StartRequest | LeaseRequest
Answer = dict[str, Any] | LeaseOutcome


def run_round(items: list[RoundItem]) -> list[Answer | BaseException]:
    """One outcome per item, in order: the reply body (a LeaseOutcome for a
    lease) or the error that refused it."""
    answers: list[Answer | BaseException | None] = [None] * len(items)
    reports = [(i, item) for i, item in enumerate(items) if isinstance(item, ResultReport)]
    starts = [(i, item) for i, item in enumerate(items) if isinstance(item, StartRequest)]
    leases = [(i, item) for i, item in enumerate(items) if isinstance(item, LeaseRequest)]

    # Unlocked reads first: requests that need no transaction are answered here.
    refusals, report_peeks = endings.peek_reports([report for _, report in reports])
    for (index, _), refusal in zip(reports, refusals, strict=True):
        answers[index] = refusal
    start_answers, start_peeks = dispatch.peek_starts([start for _, start in starts])
    for (index, _), answer in zip(starts, start_answers, strict=True):
        answers[index] = answer
    for index, lease in leases:
        if lease.limit <= 0:
            answers[index] = LeaseOutcome([])
    leases = [(i, lease) for i, lease in leases if answers[i] is None]
    reports = [(i, report) for i, report in reports if answers[i] is None]
    starts = [(i, start) for i, start in starts if answers[i] is None]
    if not (reports or starts or leases):
        return answers  # type: ignore[return-value]

    applications = {report_peeks[r.attempt_id]["application_id"] for _, r in reports}
    applications |= {start_peeks[s.attempt_id].application_id for _, s in starts}
    applications |= {lease.worker.application_id for _, lease in leases}
    queue_ids = {report_peeks[r.attempt_id]["queue_id"] for _, r in reports}
    queue_ids |= {start_peeks[s.attempt_id].queue_id for _, s in starts}
    for _, lease in leases:
        queue_ids.update(lease.worker.queue_ids)

    configuration = dispatch.Configuration.read(applications, queue_ids)

    @transaction.atomic
    def decide() -> list[tuple[int, Any]]:
        with holding(ApplicationState, QueueState):
            return decide_holding()

    def decide_holding() -> list[tuple[int, Any]]:
        for application_id in sorted(applications):
            lock_application_state(application_id)
        lock_queue_states(queue_ids)
        decided: list[tuple[int, Any]] = []
        with gathered_events():
            if reports:
                book = WriteBook()
                outcomes = endings.apply_reports([r for _, r in reports], report_peeks, book)
                decided.extend(zip([i for i, _ in reports], outcomes, strict=True))
                book.write()  # before the starts and leases read those rows
            if starts:
                outcomes = dispatch.apply_starts([s for _, s in starts], start_peeks, configuration)
                decided.extend(zip([i for i, _ in starts], outcomes, strict=True))
            # Workers of one kind lease together: one candidate scan for all.
            kinds: dict[tuple[Any, ...], list[tuple[int, LeaseRequest]]] = {}
            for index, lease in leases:
                worker = lease.worker
                kind = (worker.namespace_id, worker.queue_ids, worker.handlers, worker.concurrency_keys)
                kinds.setdefault(kind, []).append((index, lease))
            for group in kinds.values():
                try:
                    leased: list[Any] = dispatch.lease(
                        [(lease.worker, lease.limit) for _, lease in group], configuration
                    )
                except OrbitError as error:
                    leased = [error] * len(group)
                decided.extend(zip([index for index, _ in group], leased, strict=True))
        return decided

    for index, outcome in run_retrying(decide):
        item = items[index]
        if isinstance(item, StartRequest):
            outcome = dispatch.finish_start(start_peeks[item.attempt_id], outcome)
        answers[index] = outcome
    return answers  # type: ignore[return-value]
