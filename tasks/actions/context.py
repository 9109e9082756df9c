"""What every part of a round reads: who asks (WorkerContext), the
configuration read ahead of the transaction, the credential re-check, and the
window, lease and deadline arithmetic. The bottom of tasks.actions: it imports
no other part."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from orbit.db.rows import db_value, lock_by_pk, read_by_pk
from orbit.errors import Unauthenticated
from orbit.fields import UINT64_MAX
from orbit.models import Application, Credential
from orbit.principal import Minted
from queues.models import Queue, QueueState
from tasks import sql
from tasks.key_rules import KeyRule, PolicySet, policies_of
from tasks.models import Attempt, ConcurrencyKey, Task, TaskState

# A worker's handler pair with this version (hello's entry without one) admits any version:
# a task's handler_version is never empty.
ANY_VERSION = ""
# Most attempts one lease gives one worker: several workers on several nodes
# share a hot queue instead of the fastest poller taking everything.
LEASE_BATCH_MAX = 16
# Most candidate scans one lease makes: a key with capacity above 1 shows the
# scan one ready task per queue, so a lease that took one scans again for the next.
LEASE_PASSES = 4
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
    # (handler, version) pairs; version ANY_VERSION for any version of it.
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
    # With cells: the cell the connection entered at its hello. After its
    # application moved, rounds refuse the connection (its other calls would
    # still reach the old cell) and the worker reconnects to the new one.
    cell: str | None = None

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

    def key_policies(self, application_id: str, namespace_id: str) -> PolicySet:
        """The namespace's key policies as of its application row read here."""
        return policies_of(namespace_id, self.application(application_id).key_policy_generation)


def candidate_filter(worker: WorkerContext, queue_id: str, now: datetime) -> tuple[str, list[Any]]:
    """The WHERE of the lease's scan of one queue for this worker
    (tasks.sql.candidate_filter), and its parameters: the plain scan's and
    the fair order's (tasks.actions.fairness)."""
    at = db_value(Task, "available_at", now)
    where = sql.candidate_filter(
        keyed=worker.concurrency_keys, handlers=len(worker.handlers), max_key_version=MAX_LEASABLE_KEY_VERSION
    )
    params: list[Any] = [at, True, queue_id, TaskState.WAITING, at]
    if worker.concurrency_keys:
        params.append(at)  # next_start_at is a DateTimeField too: the same value
    for handler, version in worker.handlers:
        params += [handler, version, version]  # tasks.sql.CANDIDATE_HANDLER
    return where, params


def lease_expiry(task: Task, now: datetime) -> datetime:
    expires = now + timedelta(seconds=task.lease_seconds)
    return min(expires, task.deadline_at) if task.deadline_at else expires


def deadline_failure(task: Task, now: datetime) -> dict[str, str] | None:
    if task.deadline_at and task.deadline_at <= now:
        return {"code": "DEADLINE_EXCEEDED", "message": "task deadline passed"}
    if task.start_deadline_at and task.start_deadline_at <= now and task.attempts == 0:
        return {"code": "START_DEADLINE_EXCEEDED", "message": "no attempt started before start_deadline_at"}
    return None


# --- what decides a lease -------------------------------------------------
# The lease transaction (tasks.actions.dispatch.lease) and the answer to "why
# isn't this task running?" (tasks.actions.blockers) ask these same questions.


def queue_closed(queue: Queue) -> str | None:
    """QUEUE_RETIRED or QUEUE_PAUSED when the queue leases nothing, else None."""
    if queue.retired_at is not None:
        return "QUEUE_RETIRED"
    return "QUEUE_PAUSED" if queue.paused else None


def concurrency_room(queue: Queue, state: QueueState) -> int:
    """Permits of max_concurrency still free (LEASED and RUNNING attempts hold one each)."""
    return queue.max_concurrency - state.active_permits


def window_used(state: QueueState, now: datetime) -> int:
    return state.window_count if window_open(state, now) else 0


def rate_room(queue: Queue, state: QueueState, now: datetime) -> int:
    """Starts this window can still approve beyond those leases reserved: a
    lease reserves window room for its attempt, so it never creates an attempt
    its queue could not let start."""
    return queue.rate_per_second - window_used(state, now) - state.reserved_starts


def window_reopens_at(state: QueueState) -> datetime | None:
    return None if state.window_started_at is None else state.window_started_at + RATE_WINDOW


def application_room(application: Application, active_attempts: int) -> int:
    return application.max_active_attempts - active_attempts


def key_blocks(*, holder_attempt_id: str, version: int) -> str | None:
    """KEY_HELD while an attempt holds the key's permit; KEY_TOKENS_EXHAUSTED
    once its token space is spent (a key never wraps); else None."""
    if holder_attempt_id:
        return "KEY_HELD"
    return "KEY_TOKENS_EXHAUSTED" if version > MAX_LEASABLE_KEY_VERSION else None


def key_refusal(row: ConcurrencyKey, rule: KeyRule, now: datetime) -> str | None:
    """Why a key's row, under the rule in force now, grants no permit now:
    KEY_TOKENS_EXHAUSTED, KEY_HELD (capacity 1) or KEY_AT_CAPACITY (every
    permit held: a lowered capacity keeps its holders and grants nothing until
    fewer hold), KEY_RATE_LIMITED (no start room); None when it may."""
    if row.version > MAX_LEASABLE_KEY_VERSION:
        return "KEY_TOKENS_EXHAUSTED"
    if row.holders >= rule.capacity:
        return "KEY_HELD" if rule.capacity == 1 else "KEY_AT_CAPACITY"
    if rule.rate is not None and not rule.rate.lease_allowed(row.rate_tat, row.rate_reserved, now):
        return "KEY_RATE_LIMITED"
    return None


def available(task: Task, now: datetime) -> bool:
    """Not before its available_at (and not past its total deadline, which the sweep then fails)."""
    return task.available_at <= now and (task.deadline_at is None or task.deadline_at > now)


def serves(handlers: Iterable[Iterable[str]], task: Task) -> bool:
    """Whether a worker's handler filter (empty: any handler; a pair with
    ANY_VERSION: any version of that handler) admits the task."""
    listed = {tuple(pair) for pair in handlers}
    return not listed or (task.handler, task.handler_version) in listed or (task.handler, ANY_VERSION) in listed


def takes(*, handlers: Iterable[Iterable[str]], concurrency_keys: bool, task: Task) -> bool:
    """Whether a worker with these hello settings may be assigned the task:
    its handler filter (`serves`), and keyed tasks only with the opt-in."""
    return serves(handlers, task) and (concurrency_keys or not task.concurrency_key)
