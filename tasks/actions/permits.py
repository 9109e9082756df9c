"""The only code that moves permits and counters when an attempt or task ends.

Callers hold every row in `Held` locked (global order) and have checked that
the attempt is still LEASED or RUNNING: that check under the lock is what
makes each release happen exactly once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Model

from orbit.audit import emit_event
from orbit.db.rows import lock_by_pk, lock_by_pk_together, read_by_pk
from orbit.metrics import count_finished_attempt
from queues.locks import lock_queue_states
from tasks.actions.dependencies import settle_dependents
from tasks.actions.readiness import enter_waiting, promote_next
from tasks.actions.writebook import CounterDeltas, WriteBook
from tasks.locks import lock_application_state, lock_concurrency_keys, lock_task
from tasks.models import (
    ACTIVE_ATTEMPT_STATES,
    FINAL_TASK_STATES,
    Attempt,
    AttemptState,
    ConcurrencyKey,
    ConcurrencySlot,
    Task,
    TaskState,
    WorkerIdentity,
)


@dataclass
class Held:
    task: Task
    attempt: Attempt
    key_row: ConcurrencyKey | None


CHAIN_FIELDS = ("task_id", "application_id", "queue_id", "namespace_id", "concurrency_key")


def peek_attempts(
    attempt_ids: list[str], *extra: str, rows: dict[str, Attempt] | None = None
) -> dict[str, dict[str, Any]]:
    """Unlocked reads of attempts (or of `rows`, read already without a lock):
    which rows their transitions must lock."""
    fields = ("id", *CHAIN_FIELDS, *extra)
    if rows is None:
        rows = read_by_pk(Attempt, attempt_ids)
    return {pk: {name: getattr(rows[pk], name) for name in fields} for pk in attempt_ids if pk in rows}


def peek_attempt(attempt_id: str, *extra: str) -> dict[str, Any] | None:
    return peek_attempts([attempt_id], *extra).get(attempt_id)


def keys_by_namespace(peeks: Iterable[Mapping[str, Any]]) -> dict[str, set[str]]:
    """The concurrency keys of these peeked attempts or tasks, by namespace."""
    keys: dict[str, set[str]] = {}
    for peek in peeks:
        if peek["concurrency_key"]:
            keys.setdefault(peek["namespace_id"], set()).add(peek["concurrency_key"])
    return keys


def _lock_parents(
    peeks: Iterable[Mapping[str, Any]], *, counters_held: bool = False
) -> dict[tuple[str, str], ConcurrencyKey]:
    """The first half of the global lock order for a set of tasks:
    application_state, queue_state (unless the caller holds them already),
    then their key rows, which are returned by (namespace, key)."""
    peeks = list(peeks)
    if not counters_held:
        for application_id in sorted({peek["application_id"] for peek in peeks}):
            lock_application_state(application_id)
        lock_queue_states(peek["queue_id"] for peek in peeks)
    keys = keys_by_namespace(peeks)
    key_rows: dict[tuple[str, str], ConcurrencyKey] = {}
    for namespace_id in sorted(keys):
        for key, row in lock_concurrency_keys(namespace_id, keys[namespace_id]).items():
            key_rows[(namespace_id, key)] = row
    return key_rows


def lock_attempt_chains(peeks: dict[str, dict[str, Any]], *, counters_held: bool = False) -> dict[str, Held]:
    """Locks application_state → queue_state → keys → tasks → attempts for a
    set of attempts (attempt id → its peek), each level in ascending order;
    with `counters_held`, the caller holds their application_state and
    queue_state rows already and the chain starts at the keys.

    The peeks take no lock: they only say which rows to lock. Every decision is
    made on the rows re-read under their locks. Attempts of one task share
    one Task object, so a group sees its own earlier changes."""
    if not peeks:
        return {}
    key_rows = _lock_parents(peeks.values(), counters_held=counters_held)
    # tasks → attempts, one round trip
    tasks, attempts = lock_by_pk_together([(Task, [peek["task_id"] for peek in peeks.values()]), (Attempt, peeks)])
    chains: dict[str, Held] = {}
    for attempt_id, peek in peeks.items():
        task, attempt = tasks.get(peek["task_id"]), attempts.get(attempt_id)
        if task is not None and attempt is not None:
            key_row = key_rows.get((peek["namespace_id"], peek["concurrency_key"]))
            chains[attempt_id] = Held(task=task, attempt=attempt, key_row=key_row)
    return chains


def lock_attempt_chain(attempt_id: str, peek: dict[str, Any] | None = None) -> Held | None:
    """lock_attempt_chains for one attempt (peeked here when the caller has no peek)."""
    peek = peek or peek_attempt(attempt_id)
    if peek is None:
        return None
    return lock_attempt_chains({attempt_id: peek}).get(attempt_id)


def lock_attempt_chain_and_session(
    attempt_id: str, peek: dict[str, Any], identity_id: int
) -> tuple[Held | None, str | None]:
    """lock_attempt_chain with a worker identity's row locked in its place in
    the order (after the queue's state, before the keys): the chain, and the
    session the identity belongs to now (None: no such identity)."""
    lock_application_state(peek["application_id"])
    lock_queue_states([peek["queue_id"]])
    identity = lock_by_pk(WorkerIdentity, [identity_id]).get(identity_id)
    held = lock_attempt_chains({attempt_id: peek}, counters_held=True).get(attempt_id)
    return held, None if identity is None else identity.session_id


def lock_task_chain(task_id: str) -> tuple[Task, Held | None] | None:
    """Like lock_attempt_chain, starting from a task; includes its active attempt if any."""
    peek = (
        Task.objects.filter(id=task_id).values("application_id", "queue_id", "namespace_id", "concurrency_key").first()
    )
    if peek is None:
        return None
    key_row = _lock_parents([peek]).get((peek["namespace_id"], peek["concurrency_key"]))
    task = lock_task(task_id)
    if task is None:
        return None
    # Found by (task_id, epoch) alone, the state checked here: with the state
    # in the WHERE, MariaDB may filter through the expiry index and lock other
    # tasks' attempts too (a deadlock with their renewals).
    found = Attempt.objects.select_for_update().filter(task_id=task_id, epoch=task.epoch).order_by("id")
    attempt = next((attempt for attempt in found if attempt.state in ACTIVE_ATTEMPT_STATES), None)
    return task, (Held(task=task, attempt=attempt, key_row=key_row) if attempt else None)


def _save(row: Model, fields: list[str], book: WriteBook | None) -> None:
    if book is None:
        row.save(update_fields=fields)
    else:
        book.save(row, fields)


def settle(
    task: Task,
    held: Held | None,
    *,
    now: datetime,
    task_state: str,
    attempt_state: AttemptState | None = None,
    attempt_fields: dict[str, Any] | None = None,
    book: WriteBook | None = None,
    **task_fields: Any,
) -> None:
    """Ends the task's active attempt (if `held`) and moves the task to
    `task_state`; every permit and counter change of the transition, written once.

    Callers hold every row locked (global order) and checked under the lock that
    the attempt is still active, which is what makes each release happen once.
    With a `book`, counters and the rows' updates go into it, for the caller to
    write once for its whole group; a task entering or leaving WAITING is
    written at once, as the ready set's queries read WAITING rows. A task
    with dependents that finishes settles them (tasks.actions.dependencies)."""
    deltas = CounterDeltas()
    if held is not None:
        assert attempt_state is not None
        _end_attempt(held, attempt_state, now, deltas, attempt_fields or {}, book)
    finishing = task_state in FINAL_TASK_STATES and task.state not in FINAL_TASK_STATES
    left_ready_set = _move_task(task, task_state, now, deltas, task_fields, book)
    if book is None:
        deltas.write(application_id=task.application_id, queue_id=task.queue_id)
    else:
        book.add(application_id=task.application_id, queue_id=task.queue_id, deltas=deltas)
    if left_ready_set:
        promote_next(
            namespace_id=task.namespace_id, concurrency_key=task.concurrency_key, queue_id=task.queue_id, now=now
        )
    if finishing and task.has_dependents:
        settle_dependents(task, now, settle)


def _end_attempt(
    held: Held,
    state: AttemptState,
    now: datetime,
    deltas: CounterDeltas,
    fields: dict[str, Any],
    book: WriteBook | None,
) -> None:
    """Ends an active attempt and releases its application, queue and key permits."""
    attempt = held.attempt
    assert attempt.state in ACTIVE_ATTEMPT_STATES, "callers check the attempt is active under lock"
    deltas.active_attempts -= 1
    deltas.active_permits -= 1
    if attempt.state == AttemptState.LEASED:
        deltas.reserved_starts -= 1
    if held.key_row is not None:
        _release_key(held.key_row, attempt, now, book)
    attempt.state = state
    attempt.finished_at = now
    for name, value in fields.items():
        setattr(attempt, name, value)
    _save(attempt, ["state", "finished_at", *fields], book)
    count_finished_attempt(str(state))


def _release_key(key_row: ConcurrencyKey, attempt: Attempt, now: datetime, book: WriteBook | None) -> None:
    """Gives back the ending attempt's permit of its key (slot 0 on the row,
    another slot on its slot row, which only holders of the key's row lock
    touch) and the Start's room its lease reserved under the key's rate."""
    fields = []
    if attempt.key_rate_reserved and attempt.state == AttemptState.LEASED and key_row.rate_reserved > 0:
        key_row.rate_reserved -= 1
        # The cached next lease time was counted with this reservation: the
        # next lease that meets the key computes it again (a filter that is
        # too early costs a look, never a permit).
        key_row.next_start_at = None
        fields += ["rate_reserved", "next_start_at"]
    held = key_row.holder_attempt_id == attempt.id
    if not held and attempt.concurrency_slot:
        held = bool(
            ConcurrencySlot.objects.filter(
                namespace_id=key_row.namespace_id,
                key=key_row.key,
                slot=attempt.concurrency_slot,
                holder_attempt_id=attempt.id,
            ).update(holder_attempt_id="", holder_task_id="", updated_at=now)
        )
    elif held:
        key_row.holder_attempt_id = ""
        key_row.holder_task_id = ""
        fields += ["holder_attempt_id", "holder_task_id"]
    if held:
        # Releasing advances the version too, so the next permit's token is
        # larger than any this attempt could have shown a resource.
        key_row.version += 1
        key_row.holders = max(0, key_row.holders - 1)
        key_row.updated_at = now
        fields += ["version", "holders", "updated_at"]
    if fields:
        _save(key_row, fields, book)


def _move_task(
    task: Task, state: str, now: datetime, deltas: CounterDeltas, fields: dict[str, Any], book: WriteBook | None
) -> bool:
    """Sets a task's state; the first entry into a final state frees its backlog
    slot. Returns whether the task left its key's ready set."""
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
        deltas.app_unfinished -= 1
        deltas.queue_unfinished -= 1
    _save(task, changed, None if TaskState.WAITING in (previous, state) else book)
    emit_event(
        namespace_id=task.namespace_id,
        type="task.state_changed",
        subject_id=task.id,
        data={"queue_id": task.queue_id, "state": state, "previous": previous},
    )
    return left_ready_set
