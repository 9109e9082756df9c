"""submit_batch: many submissions in one transaction, each with its own
Idempotency-Key and its own result.

Each item is digested exactly as a single POST /v1/tasks would be, so a key
first used in a batch replays from a single submit and vice versa."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError
from django.utils import timezone

from orbit.db.rows import delete_by_unique_key, insert_rows, namespace_keys_in, new_row, select_rows
from orbit.errors import IdempotencyConflict, OrbitError
from orbit.idempotency import Receipt, request_digest
from orbit.models import IdempotencyRecord
from orbit.principal import Actor
from orbit.transactions import outermost
from tasks.actions.context import Configuration
from tasks.actions.dependencies import resolve_depends_on
from tasks.actions.serialize import task_detail
from tasks.actions.submit import PreparedTasks, admit_prepared, check_times, prepare_tasks
from tasks.models import Task
from tasks.serializers import SubmitTaskInput

MAX_BATCH_ITEMS = 500
# Every edge of a batch is written in its one transaction under the application's lock:
# ten joins of 1,000. More (the body's 4 MiB carries 110,000 ids) held every round of the
# application for seconds and outlived the request's deadline, a 503 however often retried.
MAX_BATCH_DEPENDENCIES = 10_000
# A twin request that commits one of our keys first makes the whole batch
# transaction fail on the unique index; it is re-read and retried this often.
TWIN_RETRIES = 3


logger = logging.getLogger("orbit.submit")

Outcome = Receipt | OrbitError


@dataclass(frozen=True)
class Submission:
    key: str
    body: dict[str, Any]
    request_id: str
    # The body's validation (fields, or the error that refuses them), done in
    # advance on the caller's thread so the application's round does not wait
    # for it; used only if the key has no record, as validation always is.
    checked: dict[str, Any] | OrbitError | None = None
    # POST /v1/tasks:batch: the item's `ref`, which a later item's depends_on
    # names as ref:NAME (SPEC §13); a single submit is in no batch.
    ref: str | None = None
    in_batch: bool = False


def _validated(body: dict[str, Any]) -> dict[str, Any]:
    """The body's fields (the queue's range is read_submissions' first check)."""
    return SubmitTaskInput.validated(body)


def checked_submission(actor: Actor, key: str, body: dict[str, Any]) -> Submission:
    """A Submission with its body validated now (see Submission.checked)."""
    try:
        checked: dict[str, Any] | OrbitError = _validated(body)
    except OrbitError as error:
        checked = error
    return Submission(key=key, body=body, request_id=actor.request_id, checked=checked)


def read_submissions(
    actor: Actor,
    items: list[Submission],
    digests: list[str],
    results: list[Outcome | None],
    found: list[IdempotencyRecord] | None = None,
) -> list[tuple[int, dict[str, Any]]]:
    """The unlocked first pass over the items still without a result: a key
    with a record is answered from it (a replay, or a conflict), an invalid
    item is refused; returns the rest as (index, validated fields). `found`:
    the items' records, when the caller read them already."""
    pending: list[tuple[int, dict[str, Any]]] = []
    if found is None and items:
        found = select_rows(IdempotencyRecord, *namespace_keys_in(actor.namespace_id, [item.key for item in items]))
    records = {record.key: record for record in found or []}
    now = timezone.now()
    for index, item in enumerate(items):
        if results[index] is not None:
            continue
        try:
            queue_id = item.body.get("queue_id")
            if isinstance(queue_id, str):  # before the replay: permissions hold for replays too (SPEC §2)
                actor.principal.require_queue(queue_id)
            record = records.get(item.key)
            if record is not None:
                if record.operation != "task.submit" or record.digest != digests[index]:
                    raise IdempotencyConflict("Idempotency-Key was already used for a different request")
                results[index] = Receipt(status=200, data={**record.response_data, "deduplicated": True})
                continue
            fields = _validated(item.body) if item.checked is None else item.checked
            if isinstance(fields, OrbitError):
                raise fields
            check_times(fields, now)
            pending.append((index, fields))
        except OrbitError as error:
            results[index] = error
    replayed = {index: result.data["task"]["id"] for index, result in enumerate(results) if isinstance(result, Receipt)}
    pending, refused = resolve_depends_on(
        actor.namespace_id,
        [item.ref for item in items],
        any(item.in_batch for item in items),
        replayed,
        pending,
        queue_ids=actor.principal.queue_ids,
    )
    for index, refusal in refused.items():
        results[index] = refusal
    return pending


def digests_of(items: list[Submission]) -> list[str]:
    """Each item digested exactly as a single POST /v1/tasks would be."""
    return [request_digest("task.submit", "", item.body) for item in items]


def submit_batch(*, actor: Actor, items: list[Submission]) -> list[Outcome]:
    """Returns one outcome per item, in order: a receipt (201, or 200 replayed)
    or the error that refused it. Accepted items commit together. Keys must be
    distinct within one call."""
    results: list[Outcome | None] = [None] * len(items)
    digests = digests_of(items)
    for attempt in range(TWIN_RETRIES):
        pending = read_submissions(actor, items, digests, results)
        if not pending:
            break
        try:
            accepted = _apply(actor, items, digests, pending)
        except IntegrityError:
            if attempt == TWIN_RETRIES - 1:
                raise
            continue
        for index, result in accepted.items():
            results[index] = result
        break
    assert all(result is not None for result in results), "every item gets an outcome"
    return [result for result in results if result is not None]


def submit_each_credential(requests: list[tuple[Actor, Submission]]) -> list[Outcome | BaseException]:
    """Submits of several callers: one batch per credential (range checks
    belong to the caller's principal). A key twice goes to the next batch,
    where it finds its twin's record and replays it."""
    outcomes: list[Outcome | BaseException | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    while pending:
        batches: dict[str, list[int]] = {}
        later: list[int] = []
        for index in pending:
            actor, submission = requests[index]
            batch = batches.setdefault(actor.principal.credential_id, [])
            if any(requests[other][1].key == submission.key for other in batch):
                later.append(index)
            else:
                batch.append(index)
        for batch in batches.values():
            for index, result in zip(batch, _submitted_apart_if_failing(requests, batch), strict=True):
                outcomes[index] = result
        pending = later
    assert all(outcome is not None for outcome in outcomes), "every request gets an outcome"
    return [outcome for outcome in outcomes if outcome is not None]


def _submitted_apart_if_failing(
    requests: list[tuple[Actor, Submission]], batch: list[int]
) -> Sequence[Outcome | BaseException]:
    """One batch's outcomes; should the batch fail as a whole (its transaction
    kept nothing), each submit is tried again alone, so one that cannot be
    stored fails only itself, not the callers it happened to be batched with."""
    try:
        return submit_batch(actor=requests[batch[0]][0], items=[requests[i][1] for i in batch])
    except Exception as exc:
        if len(batch) == 1:
            return [exc]
        logger.warning("batch of %d submits failed; trying each alone", len(batch), exc_info=True)
    return [outcome for index in batch for outcome in _submitted_apart_if_failing(requests, [index])]


@outermost
def _apply(
    actor: Actor,
    items: list[Submission],
    digests: list[str],
    pending: list[tuple[int, dict[str, Any]]],
) -> dict[int, Outcome]:
    return admit_submissions(actor, items, write_submissions(actor, items, digests, pending))


@dataclass
class Written:
    """Submissions whose records and task rows are written, not yet admitted."""

    pending: list[tuple[int, dict[str, Any]]]
    receipts: dict[int, dict[str, Any]]
    tasks: PreparedTasks


def write_submissions(
    actor: Actor,
    items: list[Submission],
    digests: list[str],
    pending: list[tuple[int, dict[str, Any]]],
    configuration: Configuration | None = None,
) -> Written:
    """Inside the caller's transaction, before it takes any lock: the
    idempotency records, then the task rows (submit.prepare_tasks; with the
    caller's `configuration` if it read it already)."""
    receipts: dict[int, dict[str, Any]] = {}

    def write_records(prepared: list[Task | None]) -> None:
        """The records go first, before any lock: a twin waits on the unique
        index holding no other lock, and key order makes overlapping batches
        queue behind each other instead of deadlocking. Each holds the receipt
        its item gets if admitted (a task's receipt is fixed once it is
        prepared); a refused item's record is deleted in admit_submissions, so
        no record is ever seen but a final one."""
        for (index, _), task in zip(pending, prepared, strict=True):
            if task is not None:
                receipts[index] = {"deduplicated": False, "task": task_detail(task)}
        insert_rows(
            [
                new_row(
                    IdempotencyRecord,
                    namespace_id=actor.namespace_id,
                    key=items[index].key,
                    operation="task.submit",
                    digest=digests[index],
                    response_status=201,
                    response_data=receipts[index],
                    request_id=items[index].request_id,
                )
                for index in sorted(receipts, key=lambda index: items[index].key)
            ]
        )

    tasks = prepare_tasks(
        actor=actor,
        items=[fields for _, fields in pending],
        now=timezone.now(),
        before_insert=write_records,
        configuration=configuration,
    )
    return Written(pending=pending, receipts=receipts, tasks=tasks)


def admit_submissions(actor: Actor, items: list[Submission], written: Written) -> dict[int, Outcome]:
    """Admits written submissions under the application's locks
    (submit.admit_prepared); a refused item's record is deleted."""
    outcomes = admit_prepared(actor=actor, prepared=written.tasks)
    results: dict[int, Outcome] = {}
    refused_keys: list[str] = []
    for (index, _), outcome in zip(written.pending, outcomes, strict=True):
        if isinstance(outcome, Task):
            if written.receipts[index]["task"]["state"] != outcome.state:
                # Its dependencies decided otherwise under the lock than the
                # receipt written before it (SPEC §13): the record follows.
                written.receipts[index] = {"deduplicated": False, "task": task_detail(outcome)}
                IdempotencyRecord.objects.filter(namespace_id=actor.namespace_id, key=items[index].key).update(
                    response_data=written.receipts[index]
                )
            results[index] = Receipt(status=201, data=written.receipts[index])
        else:
            results[index] = outcome
            if index in written.receipts:
                refused_keys.append(items[index].key)
    # A refused item stores no record; each goes by its unique key, as a refused task by its own.
    delete_by_unique_key(
        IdempotencyRecord, ("namespace_id", "key"), [(actor.namespace_id, key) for key in refused_keys]
    )
    return results
