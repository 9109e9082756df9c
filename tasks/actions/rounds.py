"""Rounds: the submits, results, starts and leases of one application that
arrived together, decided in one transaction.

Every submit, result and lease of an application locks its application_state
row, and each of them and every start locks its queue_state rows: one at a
time is all that row lets through anyway. A round writes its submits'
idempotency records and task rows first (no lock yet: a twin waits on the
unique index holding nothing else), takes the counter locks once, in the
global order, then applies in turn the submits (admission under backpressure),
the results (which free capacity and key permits), the starts, and the leases
(which can use what the submits and results made available), and commits
once. Each part keeps the rules of its single verb and gives every request
its own answer; a lone request is a round of one. A round admits the submits
of one credential with distinct keys; other submits follow it through the
batch path, and should a twin elsewhere commit one of the round's keys first,
the round is decided again without its submits, which then take that path
(where the twin's record is replayed). The round's unlocked first reads go
to the database together, in one round trip, and its writes with its next
statement (orbit.db.rows.select_together, writes_sent_together).

Lock order inside a round (orbit.locking.LOCK_ORDER): application_state → the
union of the round's queue_state rows → its leases' worker identity rows → its
workers' credential rows → key rows → tasks → attempts. Each part re-locks the
rows it needs (the counter rows the round holds are kept, with the round's own
changes, and cost no statement: orbit.db.rows.holding; so are the key rows
its results locked, for its leases: tasks.locks.keeping_key_rows); the rows locked after
the union are only ever waited for by transactions that hold the same
application_state row first, or by a hello's update of its identity row, which
holds nothing else, so the parts cannot deadlock with other paths.
A round with no keyed submit and no submit with depends_on in it locks its
keyed results' key rows and its results' and starts' tasks and attempts in
the counters' round trip (orbit.db.rows.locked_ahead,
tasks.locks.key_rows_ahead)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django.db import IntegrityError

from orbit import cells
from orbit.audit import gathered_events
from orbit.db.groupcommit import HAND_ON, NEXT, GroupCommit, Phase
from orbit.db.pool import DATABASE_TOO_SLOW, REQUEST_DEADLINE_SECONDS, within_deadline
from orbit.db.rows import (
    LockedBy,
    holding,
    lock_by_pk,
    lock_by_pk_together,
    locked_ahead,
    namespace_keys_in,
    pk_in,
    select_together,
)
from orbit.errors import LeaseLost, OrbitError, StateConflict, Unauthenticated, Unavailable
from orbit.idempotency import Receipt, validate_key
from orbit.models import Application, ApplicationState, Credential, IdempotencyRecord
from orbit.principal import Actor, Minted, Principal
from orbit.transactions import outermost
from queues.models import Queue, QueueState
from tasks import wakeups
from tasks.actions import batch, context, dispatch, endings, rollup
from tasks.actions.batch import Submission
from tasks.actions.context import Configuration, WorkerContext
from tasks.actions.dispatch import DeadlinePassed, LeaseOutcome, StartRequest
from tasks.actions.endings import ResultReport
from tasks.actions.permits import keys_by_namespace
from tasks.actions.writebook import WriteBook
from tasks.locks import keeping_key_rows, key_rows_ahead, lock_application_state
from tasks.models import Attempt, Task, WorkerIdentity


@dataclass(frozen=True)
class LeaseRequest:
    """A lease for a worker's connection. `after`: a hand-off, leasing into
    the slot that result frees, so it leases only if the same round records
    that result now; a refused result, or a replay of one recorded before,
    frees nothing and the lease takes nothing (a replay must never add work
    to a connection: SPEC §6). `start_ahead`: that result's frame also sent
    the Start of what the lease takes, a task of this handler and version
    (the one the result ends, which its worker evidently serves): dispatch.lease's
    `starting`. Only a hand-off starts ahead: nothing else vouches for it.
    `started_only`: a hand-off with `start_ahead` that came past its
    connection's bound on unacknowledged assignments takes only what it
    starts (dispatch.lease's `started_only`): a started assignment is never
    waited on for an acknowledgement."""

    worker: WorkerContext
    limit: int
    after: ResultReport | None = None
    start_ahead: tuple[str, str] | None = None
    started_only: bool = False


@dataclass(frozen=True)
class SubmitRequest:
    """A single POST /v1/tasks (tasks.actions.batch: its own key, digest,
    checks and answer). `credential_to_confirm`: the caller's credential as
    this process knew it, its row not read for this request; the round reads
    it again and decides the submit only if it still grants the principal.
    `deadline`: when its caller stops waiting (time.monotonic(); the caller
    starts its own clock a moment later)."""

    actor: Actor
    submission: Submission
    credential_to_confirm: Minted | None = None
    deadline: float = field(default_factory=lambda: time.monotonic() + REQUEST_DEADLINE_SECONDS)


class CredentialNotConfirmed(Exception):
    """The round read a submit's credential again and found it revoked (or
    gone, or not as minted): the submit was not decided; the full handler,
    which reads the credential itself, answers it."""


SUPERSEDED = "superseded by a newer connection of this worker_id"

RoundItem = ResultReport | StartRequest | LeaseRequest | SubmitRequest
Answer = dict[str, Any] | LeaseOutcome | Receipt


@dataclass
class _Submits:
    """The round's share of submits: those of one credential with distinct
    keys (range checks belong to the caller's principal; a key twice must
    see its twin's record)."""

    indexes: list[int]  # into the round's items
    actor: Actor
    items: list[Submission]
    digests: list[str]
    pending: list[tuple[int, dict[str, Any]]]  # into `items`


def _split_submits(items: list[RoundItem]) -> tuple[list[tuple[int, SubmitRequest]], list[int]]:
    """The submits this round admits (those of the first submit's credential,
    distinct keys) and the indexes of the others, submitted after the round."""
    mine: list[tuple[int, SubmitRequest]] = []
    later: list[int] = []
    for index, item in enumerate(items):
        if not isinstance(item, SubmitRequest):
            continue
        if not mine or (
            item.actor.principal.credential_id == mine[0][1].actor.principal.credential_id
            and all(other.submission.key != item.submission.key for _, other in mine)
        ):
            mine.append((index, item))
        else:
            later.append(index)
    return mine, later


@dataclass
class _FirstReads:
    """A round's unlocked reads before its transaction, sent in one round trip
    (orbit.db.rows.select_together): the records of its submits' keys, the
    attempts of its results and starts, and the applications and queues its
    items name (their workers' and submits'). A result's or start's attempt
    in a queue its worker does not name is read after, with its configuration."""

    records: list[IdempotencyRecord]
    credentials: dict[str, Credential]
    attempts: dict[str, Attempt]
    application_ids: set[str]
    queue_ids: set[str]
    configuration: Configuration

    @classmethod
    def read(cls, items: list[RoundItem], mine: list[tuple[int, SubmitRequest]]) -> _FirstReads:
        attempt_ids = {item.attempt_id for item in items if isinstance(item, ResultReport | StartRequest)}
        credential_ids = {
            item.credential_to_confirm.principal.credential_id
            for item in items
            if isinstance(item, SubmitRequest) and item.credential_to_confirm is not None
        }
        application_ids: set[str] = set()
        queue_ids: set[str] = set()
        for item in items:
            if isinstance(item, SubmitRequest):
                continue
            application_ids.add(item.worker.application_id)
            queue_ids.update(item.worker.queue_ids)
        for _, submit in mine:
            application_ids.add(submit.actor.principal.application_id)
            checked = submit.submission.checked
            queue_id = (checked if isinstance(checked, dict) else submit.submission.body).get("queue_id")
            # An unchecked body's queue_id may hold anything, a lone surrogate
            # included, which no query can carry; ids are ASCII, and one that is
            # not names no queue (its submit is refused or read again later).
            if isinstance(queue_id, str) and queue_id.isascii():
                queue_ids.add(queue_id)
        queries: list[tuple[Any, str, list[Any]]] = []
        if mine:
            actor = mine[0][1].actor
            queries.append(
                (IdempotencyRecord, *namespace_keys_in(actor.namespace_id, [s.submission.key for _, s in mine]))
            )
        for model, ids in (
            (Credential, credential_ids),
            (Attempt, attempt_ids),
            (Application, application_ids),
            (Queue, queue_ids),
        ):
            if ids:
                queries.append((model, *pk_in(model, ids)))
        found = iter(select_together(queries))
        records: list[IdempotencyRecord] = next(found) if mine else []
        credentials = {row.pk: row for row in next(found)} if credential_ids else {}
        attempts = {row.pk: row for row in next(found)} if attempt_ids else {}
        applications = {row.pk: row for row in next(found)} if application_ids else {}
        queues = {row.pk: row for row in next(found)} if queue_ids else {}
        return cls(records, credentials, attempts, application_ids, queue_ids, Configuration(applications, queues))

    def confirms(self, item: SubmitRequest) -> bool:
        minted = item.credential_to_confirm
        return minted is None or minted.still_grants(self.credentials.get(minted.principal.credential_id))

    def configuration_of(self, application_ids: set[str], queue_ids: set[str]) -> Configuration:
        """The configuration of these applications and queues (those not read first, read now)."""
        unread = [(Application, application_ids - self.application_ids), (Queue, queue_ids - self.queue_ids)]
        if not any(ids for _, ids in unread):
            return self.configuration
        more = Configuration.read(*(ids for _, ids in unread))
        return Configuration(
            applications={**self.configuration.applications, **more.applications},
            queues={**self.configuration.queues, **more.queues},
        )


def _take_submits(
    mine: list[tuple[int, SubmitRequest]], answers: list[Answer | BaseException | None], first: _FirstReads
) -> _Submits | None:
    """The round's submits after their unlocked first pass, which answers
    replays and invalid items."""
    if not mine:
        return None
    actor = mine[0][1].actor
    submissions = [item.submission for _, item in mine]
    digests = batch.digests_of(submissions)
    results: list[Receipt | OrbitError | None] = [None] * len(submissions)
    pending = batch.read_submissions(actor, submissions, digests, results, first.records)
    for (index, _), result in zip(mine, results, strict=True):
        answers[index] = result
    indexes = [index for index, _ in mine]
    return _Submits(indexes=indexes, actor=actor, items=submissions, digests=digests, pending=pending)


def _application_of(item: RoundItem) -> str:
    return item.actor.principal.application_id if isinstance(item, SubmitRequest) else item.worker.application_id


def _refuse_while_moving(
    items: list[RoundItem], answers: list[Answer | BaseException | None], applications: dict[str, Application]
) -> None:
    """With cells: an application being moved (orbit_move_application) takes
    no submit and no lease, while its running attempts still report and
    finish; one no longer in this cell (moved away, this process's
    directory cache stale) takes nothing here, and its cell is looked up
    again for the retry; and a worker connection made to another cell (the
    application's cell before a move) takes nothing. `applications`: the
    rows of the items' applications as the round's first reads found them
    in this cell."""
    here = cells.entered()
    for index, item in enumerate(items):
        application_id = _application_of(item)
        application = applications.get(application_id)
        if not isinstance(item, SubmitRequest) and item.worker.cell not in (None, here):
            answers[index] = Unavailable(cells.MOVED_AWAY, retry_after=1)  # a connection to the old cell
        elif application is None:
            cells.forget(application_id)
            answers[index] = Unavailable(cells.MOVED_AWAY, retry_after=1)
        elif application.moving:
            cells.forget(application_id)  # the next round reads the directory: it names the new cell once switched
            if isinstance(item, SubmitRequest | LeaseRequest):
                answers[index] = Unavailable(cells.MOVING, retry_after=1)


def run_round(items: list[RoundItem]) -> list[Answer | BaseException]:
    """One outcome per item, in order: the reply body (a LeaseOutcome for a
    lease, a Receipt for a submit) or the error that refused it."""
    answers: list[Answer | BaseException | None] = [None] * len(items)
    mine, later = _split_submits(items)
    first = _FirstReads.read(items, mine)
    if cells.configured():
        _refuse_while_moving(items, answers, first.configuration.applications)
        if any(answer is not None for answer in answers):  # a move: the rest is a round of its own
            left = [index for index, answer in enumerate(answers) if answer is None]
            for index, answer in zip(left, run_round([items[i] for i in left]) if left else [], strict=True):
                answers[index] = answer
            return [answer for answer in answers if answer is not None]
    for index, item in enumerate(items):
        if isinstance(item, SubmitRequest) and not first.confirms(item):
            answers[index] = CredentialNotConfirmed()
    mine = [(index, item) for index, item in mine if answers[index] is None]
    later = [index for index in later if answers[index] is None]
    submits = _take_submits(mine, answers, first)
    try:
        _decide_round(items, answers, submits, first)
    except IntegrityError:
        if submits is None or not submits.pending:
            raise
        # A twin of one of the submits committed its record first (another
        # process, or the batch endpoint): nothing of the round was kept. The
        # submits go the batch path, which replays the twin's record; the
        # rest is decided again without them.
        later += [submits.indexes[index] for index, _ in submits.pending]
        rest = [i for i, item in enumerate(items) if answers[i] is None and not isinstance(item, SubmitRequest)]
        for index, answer in zip(rest, run_round([items[i] for i in rest]), strict=True):
            answers[index] = answer
    later = _unexpired(items, answers, later)  # before their transactions of the batch path
    if later:
        requests = [
            (item.actor, item.submission) for item in (items[i] for i in later) if isinstance(item, SubmitRequest)
        ]
        for index, outcome in zip(later, batch.submit_each_credential(requests), strict=True):
            answers[index] = outcome
    assert all(answer is not None for answer in answers), "every item gets an answer"
    return [answer for answer in answers if answer is not None]


def _identity_ids(leases: list[tuple[int, LeaseRequest]]) -> list[int]:
    return sorted({lease.worker.identity_id for _, lease in leases if lease.worker.identity_id is not None})


def _current_sessions(
    leases: list[tuple[int, LeaseRequest]], decided: list[tuple[int, Any]]
) -> list[tuple[int, LeaseRequest]]:
    """The leases whose connection is still its worker identity's session;
    the others are refused into `decided` (their identity rows are locked)."""
    sessions = {
        identity.pk: identity.session_id for identity in lock_by_pk(WorkerIdentity, _identity_ids(leases)).values()
    }
    current: list[tuple[int, LeaseRequest]] = []
    for index, lease in leases:
        identity_id = lease.worker.identity_id
        if identity_id is None or sessions.get(identity_id) == lease.worker.session_id:
            current.append((index, lease))
        else:
            decided.append((index, StateConflict(SUPERSEDED)))
    return current


W = TypeVar("W", ResultReport, StartRequest, LeaseRequest)


def _granted(items: list[tuple[int, W]], revoked: set[str], decided: list[tuple[int, Any]]) -> list[tuple[int, W]]:
    """The items whose worker's credential still grants; the others are refused into `decided`."""
    granted: list[tuple[int, W]] = []
    for index, item in items:
        credential = item.worker.credential
        if credential is not None and credential.principal.credential_id in revoked:
            decided.append((index, Unauthenticated(context.CREDENTIAL_REVOKED)))
        else:
            granted.append((index, item))
    return granted


def _unexpired(items: list[RoundItem], answers: list[Answer | BaseException | None], indexes: list[int]) -> list[int]:
    """`indexes` (into `items`) less the submits whose callers' deadlines
    have passed, which are answered UNAVAILABLE: their transaction has not
    opened yet. A process stopped between a round's first reads and its
    transaction (SIGSTOP, a frozen VM) wakes with its callers answered 503
    by their timers: their submits must not be committed then. Once the
    transaction is open, a stop leaves it idle, and the database rolls it
    back (SERVING_IDLE_TRANSACTION_SECONDS)."""
    now = time.monotonic()
    for index in indexes:
        item = items[index]
        if isinstance(item, SubmitRequest) and now >= item.deadline:
            answers[index] = Unavailable(DATABASE_TOO_SLOW)
    return [index for index in indexes if answers[index] is None]


def _drop_expired_submits(
    items: list[RoundItem], answers: list[Answer | BaseException | None], submits: _Submits
) -> None:
    """The round's own submits, as _unexpired: the expired ones left out of its transaction."""
    kept = set(_unexpired(items, answers, [submits.indexes[index] for index, _ in submits.pending]))
    submits.pending[:] = [(index, fields) for index, fields in submits.pending if submits.indexes[index] in kept]


def _decide_round(
    items: list[RoundItem], answers: list[Answer | BaseException | None], submits: _Submits | None, first: _FirstReads
) -> None:
    """Fills in `answers` for the round's results, starts, leases and `submits`
    (unlocked first reads, then one transaction)."""
    if submits is not None:
        _drop_expired_submits(items, answers, submits)
    parts = _Parts.unanswered(items, answers, first)
    submitting = submits if submits is not None and submits.pending else None  # the submits left to admit
    if not (parts.reports or parts.starts or parts.leases or submitting):
        return
    round_ = _Round.of(parts, submitting, first)
    with wakeups.collected() as woken:
        decided = round_.decide()
    wakeups.notify_work_available(woken - _exhausted(parts.leases, decided))
    for index, outcome in decided:
        item = items[index]
        if isinstance(item, StartRequest):
            outcome = _finish_start(parts.start_peeks[item.attempt_id], outcome)
        answers[index] = outcome


@dataclass(frozen=True)
class _Parts:
    """A round's results, starts and leases (each with its index into the
    round's items) that its first reads did not answer, and the attempts
    those reads peeked."""

    reports: list[tuple[int, ResultReport]]
    starts: list[tuple[int, StartRequest]]
    leases: list[tuple[int, LeaseRequest]]
    report_peeks: dict[str, dict[str, Any]]
    start_peeks: dict[str, Attempt]

    @classmethod
    def unanswered(
        cls, items: list[RoundItem], answers: list[Answer | BaseException | None], first: _FirstReads
    ) -> _Parts:
        """Answers from the first reads the requests that need no transaction
        (a result or start whose attempt the worker does not hold, a replayed
        start, a lease of nothing); the others are the parts."""
        reports = [(i, item) for i, item in enumerate(items) if isinstance(item, ResultReport)]
        starts = [(i, item) for i, item in enumerate(items) if isinstance(item, StartRequest)]
        leases = [(i, item) for i, item in enumerate(items) if isinstance(item, LeaseRequest)]
        refusals, report_peeks = endings.peek_reports([report for _, report in reports], first.attempts)
        for (index, _), refusal in zip(reports, refusals, strict=True):
            answers[index] = refusal
        start_answers, start_peeks = dispatch.peek_starts([start for _, start in starts], first.attempts)
        for (index, _), answer in zip(starts, start_answers, strict=True):
            answers[index] = answer
        for index, lease in leases:
            if lease.limit <= 0:
                answers[index] = LeaseOutcome([])
        return cls(
            reports=[(i, report) for i, report in reports if answers[i] is None],
            starts=[(i, start) for i, start in starts if answers[i] is None],
            leases=[(i, lease) for i, lease in leases if answers[i] is None],
            report_peeks=report_peeks,
            start_peeks=start_peeks,
        )

    @property
    def workers(self) -> list[WorkerContext]:
        return [item.worker for _, item in self.reports + self.starts + self.leases]

    def counter_rows(self) -> tuple[set[str], set[str]]:
        """The applications and queues whose counter rows the parts lock."""
        applications = {self.report_peeks[r.attempt_id]["application_id"] for _, r in self.reports}
        applications |= {self.start_peeks[s.attempt_id].application_id for _, s in self.starts}
        applications |= {lease.worker.application_id for _, lease in self.leases}
        queue_ids = {self.report_peeks[r.attempt_id]["queue_id"] for _, r in self.reports}
        queue_ids |= {self.start_peeks[s.attempt_id].queue_id for _, s in self.starts}
        for _, lease in self.leases:
            queue_ids.update(lease.worker.queue_ids)
        return applications, queue_ids

    def rows_ahead(self, submitting: _Submits | None, configuration: Configuration) -> list[tuple[Any, Any] | LockedBy]:
        """The rows locked in the counters' round trip, after them, in the
        global order: a lease is for its connection's session only, so its
        worker identity row (a hello of the same worker_id waits for this
        round, then counts what it leased as held); each worker's credential,
        read again so a revocation commits before this round (which then
        refuses its items) or after it; and, with no keyed submit and no
        submit with depends_on in the round, the key rows of its keyed
        results and of its Starts under a key's rate
        (dispatch.start_key_rules), then the results' and
        starts' tasks and attempts, which nothing but their own part changes
        (key rows before tasks): the results and starts then lock nothing in
        round trips of their own."""
        workers = self.workers
        ahead: list[tuple[Any, Any] | LockedBy] = [
            (WorkerIdentity, _identity_ids(self.leases)),
            (Credential, {w.credential.principal.credential_id for w in workers if w.credential is not None}),
        ]
        # A keyed submit changes key rows, and one with depends_on marks its
        # parents' task rows (has_dependents), before the results lock theirs:
        # rows read ahead would be stale then.
        if submitting and any(
            fields.get("concurrency_key") or fields.get("depends_on") for _, fields in submitting.pending
        ):
            return ahead
        reports, starts = self.reports, self.starts
        result_keys = keys_by_namespace(self.report_peeks[report.attempt_id] for _, report in reports)
        start_keys = dispatch.start_key_rules([self.start_peeks[s.attempt_id] for _, s in starts], configuration)
        for namespace_id, key in start_keys:
            result_keys.setdefault(namespace_id, set()).add(key)
        ahead += [key_rows_ahead(namespace_id, keys) for namespace_id, keys in sorted(result_keys.items())]
        task_ids = [self.report_peeks[r.attempt_id]["task_id"] for _, r in reports]
        task_ids += [self.start_peeks[s.attempt_id].task_id for _, s in starts]
        ahead += [(Task, task_ids), (Attempt, [item.attempt_id for _, item in reports + starts])]
        return ahead


@dataclass(frozen=True)
class _Round:
    """What a round's transaction decides, and the rows it locks first."""

    parts: _Parts
    submitting: _Submits | None  # the submits left to admit
    applications: set[str]
    queue_ids: set[str]
    configuration: Configuration
    ahead: list[tuple[Any, Any] | LockedBy]

    @classmethod
    def of(cls, parts: _Parts, submitting: _Submits | None, first: _FirstReads) -> _Round:
        applications, queue_ids = parts.counter_rows()
        submit_queue_ids: set[str] = set()
        if submitting:
            applications.add(submitting.actor.principal.application_id)
            submit_queue_ids = {fields["queue_id"] for _, fields in submitting.pending}
        configuration = first.configuration_of(applications, queue_ids | submit_queue_ids)
        if submitting:
            # Only queues of the submits' namespace are locked: admission refuses
            # the others as not found, without a lock.
            namespace_id = submitting.actor.namespace_id
            queue_ids |= {q.id for q in configuration.queues_of(submit_queue_ids) if q.namespace_id == namespace_id}
        ahead = parts.rows_ahead(submitting, configuration)
        return cls(parts, submitting, applications, queue_ids, configuration, ahead)

    def decide(self) -> list[tuple[int, Any]]:
        """The round's transaction: each decided item's index and outcome."""

        @outermost(sent_together=True)
        def decide() -> list[tuple[int, Any]]:
            with holding(ApplicationState, QueueState), locked_ahead(), keeping_key_rows():
                return self._decide_holding()

        return decide()

    def _decide_holding(self) -> list[tuple[int, Any]]:
        """In the transaction: the submits' rows, the counter locks, then the
        submits, results, starts and leases, in that order."""
        decided: list[tuple[int, Any]] = []
        submitting, parts = self.submitting, self.parts
        # A submit's records and task rows go in before any lock (batch.write_submissions).
        written = None
        if submitting:
            written = batch.write_submissions(
                submitting.actor, submitting.items, submitting.digests, submitting.pending, self.configuration
            )
        lock_by_pk_together(  # one round trip
            [(ApplicationState, self.applications), (QueueState, self.queue_ids)], ahead=self.ahead
        )
        for application_id in sorted(self.applications):
            lock_application_state(application_id)  # kept now: raises if it has no row
        revoked = context.confirm_credentials(parts.workers)  # kept from the round trip above
        reports = _granted(parts.reports, revoked, decided)
        starts = _granted(parts.starts, revoked, decided)
        leases = _granted(parts.leases, revoked, decided)
        with gathered_events(), rollup.gathered():
            if submitting and written is not None:
                # Admitted first: the round's leases can hand out what it accepts.
                admitted = batch.admit_submissions(submitting.actor, submitting.items, written)
                decided.extend((submitting.indexes[index], outcome) for index, outcome in admitted.items())
            freed = _apply_reports(reports, parts.report_peeks, decided)
            if starts:
                started = dispatch.apply_starts([s for _, s in starts], parts.start_peeks, self.configuration)
                decided.extend(zip([i for i, _ in starts], started, strict=True))
            _apply_leases(_current_sessions(leases, decided), freed, self.configuration, decided)
        return decided


def _apply_reports(
    reports: list[tuple[int, ResultReport]], peeks: dict[str, dict[str, Any]], decided: list[tuple[int, Any]]
) -> set[int]:
    """Records the round's results into `decided`; returns those that ended
    their attempt in this round (by id()), whose slots its leases may fill."""
    if not reports:
        return set()
    book = WriteBook()
    outcomes = endings.apply_reports([r for _, r in reports], peeks, book)
    decided.extend(zip([i for i, _ in reports], outcomes, strict=True))
    book.write()  # before the starts and leases read those rows
    return {
        id(report)
        for (_, report), outcome in zip(reports, outcomes, strict=True)
        if not isinstance(outcome, OrbitError) and not outcome["duplicate"]
    }


def _apply_leases(
    leases: list[tuple[int, LeaseRequest]],
    freed: set[int],
    configuration: Configuration,
    decided: list[tuple[int, Any]],
) -> None:
    """Decides the round's leases of current sessions into `decided`: workers
    of one kind lease together, one candidate scan for all; a hand-off whose
    result freed nothing takes nothing."""
    kinds: dict[tuple[Any, ...], list[tuple[int, LeaseRequest]]] = {}
    for index, lease in leases:
        if lease.after is not None and id(lease.after) not in freed:
            # `more`: the worker's queues may well hold work for its dispatcher.
            decided.append((index, LeaseOutcome([], more=True)))
            continue
        worker = lease.worker
        kind = (worker.namespace_id, worker.queue_ids, worker.handlers, worker.concurrency_keys)
        kinds.setdefault(kind, []).append((index, lease))
    for group in kinds.values():
        try:
            leased: list[LeaseOutcome | OrbitError] = list(
                dispatch.lease(
                    [(lease.worker, lease.limit) for _, lease in group],
                    configuration,
                    starting=[lease.start_ahead if lease.after is not None else None for _, lease in group],
                    started_only=[lease.started_only for _, lease in group],
                )
            )
        except OrbitError as error:
            leased = [error] * len(group)
        decided.extend(zip([index for index, _ in group], leased, strict=True))


def _exhausted(leases: list[tuple[int, LeaseRequest]], decided: list[tuple[int, Any]]) -> set[str]:
    """The queues a lease of the round left with nothing any worker could
    lease: the lease of a worker that takes every handler and keyed tasks
    found no candidate left over (LeaseOutcome.more). It was decided after the round's
    results, releases and submits, so a wake-up they made for those queues
    would only send dispatchers to find nothing (the same connection's
    included, right after its hand-off)."""
    outcomes = dict(decided)
    exhausted: set[str] = set()
    for index, lease in leases:
        outcome, worker = outcomes.get(index), lease.worker
        if isinstance(outcome, LeaseOutcome) and not outcome.more and not worker.handlers and worker.concurrency_keys:
            exhausted.update(worker.queue_ids)
    return exhausted


def _finish_start(peek: Attempt, outcome: dict[str, Any] | OrbitError | DeadlinePassed) -> dict[str, Any] | OrbitError:
    """After the round's transaction: a task whose deadline passed before its
    Start is failed. That moves application counters, whose lock comes first
    in the global order, so it is a transaction of its own."""
    if isinstance(outcome, DeadlinePassed):
        endings.fail_for_deadline(peek.task_id)
        return LeaseLost("task deadline passed before start")
    return outcome


# --- the doors ------------------------------------------------------------
# Every submit, start, result and lease of an application in this process
# joins its application's lane and is decided in its next round; the single-
# item doors below are all the consumer, views, commands and tests call. A
# lone request is a round of one.


def _phase(items: list[RoundItem]) -> Phase:
    """A keyed result with its hand-off (record_result_and_lease_async) is
    answered with the worker's next assignment, whose Start follows at once
    (or, sent ahead, was decided with it: then the next result follows)."""
    if len(items) == 2 and isinstance(items[0], ResultReport) and isinstance(items[1], LeaseRequest):
        return HAND_ON
    return NEXT if isinstance(items[0], StartRequest) else None


# A round's submits are answered before its worker frames: a submit's caller
# sends nothing more until it hears back, while a worker keeps its other
# slots busy meanwhile.
ROUNDS: GroupCommit[RoundItem, Answer] = GroupCommit(
    "round",
    run_round,
    answer_first=lambda item: isinstance(item, SubmitRequest),
    phase=_phase,
    enter_lane=cells.enter_application,
)


def _reply(answer: Answer) -> dict[str, Any]:
    # The round answers a StartRequest and a ResultReport with its reply body
    # (a refusal comes back raised).
    assert isinstance(answer, dict), "a start or result is answered with its reply body"
    return answer


def _lease_outcome(answer: Answer) -> LeaseOutcome:
    # The round answers a LeaseRequest with its LeaseOutcome.
    assert isinstance(answer, LeaseOutcome), "a lease is answered with its LeaseOutcome"
    return answer


def lease_for_worker(*, worker: WorkerContext, limit: int) -> LeaseOutcome:
    """Leases up to `limit` tasks (at most LEASE_BATCH_MAX) for a worker; the
    outcome also says when a queue held back by its start window reopens, so
    a dispatcher can come back exactly then instead of at its next poll."""
    return _lease_outcome(ROUNDS.call(worker.application_id, LeaseRequest(worker, limit)))


def lease_tasks(*, worker: WorkerContext, limit: int) -> list[dict[str, Any]]:
    """lease_for_worker's task.assign bodies."""
    return lease_for_worker(worker=worker, limit=limit).assignments


def approve_start(*, worker: WorkerContext, attempt_id: str, epoch: int) -> dict[str, Any]:
    """Grants the right to run: counts one Start in the queue's rate window.
    A replayed Start of a running attempt is answered from the record."""
    return _reply(ROUNDS.call(worker.application_id, StartRequest(worker, attempt_id, epoch)))


def record_result(
    *, worker: WorkerContext, attempt_id: str, epoch: int, outcome: str, retryable: bool, output: Any, error: Any
) -> dict[str, Any]:
    """Applies a worker's result exactly once; replays and late evidence change nothing."""
    report = ResultReport(worker, attempt_id, epoch, outcome, retryable, output, error)
    return _reply(ROUNDS.call(worker.application_id, report))


# The same doors from the event loop (the worker protocol): awaiting holds no
# pool thread while the round runs; UNAVAILABLE past the request deadline.


async def lease_for_worker_async(*, worker: WorkerContext, limit: int) -> LeaseOutcome:
    return _lease_outcome(await ROUNDS.call_async(worker.application_id, LeaseRequest(worker, limit)))


async def approve_start_async(*, worker: WorkerContext, attempt_id: str, epoch: int) -> dict[str, Any]:
    return _reply(await ROUNDS.call_async(worker.application_id, StartRequest(worker, attempt_id, epoch)))


async def record_result_async(report: ResultReport) -> dict[str, Any]:
    return _reply(await ROUNDS.call_async(report.worker.application_id, report))


async def record_result_and_lease_async(
    report: ResultReport,
    *,
    limit: int,
    start_ahead_for: tuple[str, str] | None = None,
    started_only: bool = False,
) -> tuple[dict[str, Any] | BaseException, LeaseOutcome | BaseException]:
    """The result and a lease for its worker, decided in one round: the round
    applies results before leases, so the slot (and a keyed attempt's key) the
    result frees can go to the worker's next task in the same transaction.
    `start_ahead_for`: the result's frame sent the Start of that task ahead,
    and its own task has this handler and version; `started_only`: the lease
    takes only a task it starts (LeaseRequest)."""
    worker = report.worker
    lease = LeaseRequest(worker, limit, after=report, start_ahead=start_ahead_for, started_only=started_only)
    reply, leased = await ROUNDS.call_together_async(worker.application_id, [report, lease])
    return (
        reply if isinstance(reply, BaseException) else _reply(reply),
        leased if isinstance(leased, BaseException) else _lease_outcome(leased),
    )


def submit_request(
    principal: Principal,
    body: dict[str, Any],
    key: str | None,
    request_id: str,
    credential_to_confirm: Minted | None = None,
) -> SubmitRequest:
    """POST /v1/tasks up to its round, for a caller holding tasks:submit whose
    body is a JSON object: the queue's range, the Idempotency-Key, and the
    body's validation (kept in the request for the round; see
    batch.Submission.checked). Raises what refuses the request outright.
    `credential_to_confirm`: see SubmitRequest."""
    if isinstance(body.get("queue_id"), str):
        principal.require_queue(body["queue_id"])
    actor = Actor(principal=principal, request_id=request_id)
    submission = batch.checked_submission(actor, validate_key(key), body)
    return SubmitRequest(actor, submission, credential_to_confirm)


def _receipt(outcome: Answer) -> Receipt:
    # A submit's answer is its Receipt; a refusal may come back as a value
    # from the batch path.
    if isinstance(outcome, OrbitError):
        raise outcome
    assert isinstance(outcome, Receipt)
    return outcome


def submit_task(request: SubmitRequest) -> Receipt:
    """From a thread: the submit's Receipt, or its refusal raised."""
    return _receipt(ROUNDS.call(request.actor.principal.application_id, request))


def join_round(loop: asyncio.AbstractEventLoop, request: SubmitRequest) -> asyncio.Future[Answer]:
    """From the thread that prepared the submit (the event loop `loop`, or a
    pool thread working for it): it joins its application's round now, not
    after a hop back to the event loop (which every request and worker frame
    shares); the caller awaits it on `loop` with receipt_of."""
    return ROUNDS.enqueue_for(loop, request.actor.principal.application_id, request)


async def receipt_of(joined: asyncio.Future[Answer]) -> Receipt:
    """The submit's Receipt, or its refusal raised, holding no pool thread while the round runs."""
    return _receipt(await within_deadline(joined))
