"""Read verbs for concurrency keys: GET /v1/concurrency-keys and the console.

A key's row is its permit and its token sequence; it is never reset or deleted,
so these verbs only read. Every read is an index range: the key rows by
(namespace_id, key) (uniq_ckey_ns_key), the holder attempt by its primary key,
the waiting tasks as a count over idx_task_ns_ckey (namespace_id,
concurrency_key, queue_id, state, ...), read from the index alone."""

from __future__ import annotations

from itertools import takewhile
from typing import Any

from django.db.models import Count

from orbit.errors import NotFound
from orbit.principal import Principal
from orbit.timefmt import format_time
from tasks.models import Attempt, ConcurrencyKey, Task, TaskState

# IN lists of at most this many keys per waiting count.
_KEY_CHUNK = 500


def waiting_counts(namespace_id: str, keys: list[str]) -> dict[str, int]:
    """WAITING tasks per key of the namespace, in every queue."""
    counts: dict[str, int] = {}
    for start in range(0, len(keys), _KEY_CHUNK):
        rows = (
            Task.objects.filter(
                namespace_id=namespace_id, concurrency_key__in=keys[start : start + _KEY_CHUNK], state=TaskState.WAITING
            )
            .values_list("concurrency_key")
            .annotate(n=Count("*"))
            .order_by()
        )
        counts.update(dict(rows))
    return counts


def holder_attempts(rows: list[ConcurrencyKey]) -> dict[str, Attempt]:
    ids = [row.holder_attempt_id for row in rows if row.holder_attempt_id]
    if not ids:
        return {}
    attempts = Attempt.objects.filter(id__in=ids).only(
        "id", "task_id", "worker_id", "leased_at", "started_at", "concurrency_token", "state", "queue_id"
    )
    return {attempt.id: attempt for attempt in attempts}


def key_view(row: ConcurrencyKey, waiting: int, holder: Attempt | None) -> dict[str, Any]:
    """The wire shape of one key: holder (omitted when free), the highest token
    (the sequence's value: every token issued is at most it, the next one is
    above it), the waiting count."""
    data: dict[str, Any] = {"key": row.key}
    if row.holder_attempt_id:
        held: dict[str, Any] = {"attempt_id": row.holder_attempt_id, "task_id": row.holder_task_id}
        if holder is not None:
            held["worker_id"] = holder.worker_id
            if holder.concurrency_token is not None:
                held["token"] = str(holder.concurrency_token)
        # The row's updated_at is its last lease or release: the holder's lease.
        held["since"] = format_time(holder.leased_at if holder is not None else row.updated_at)
        data["holder"] = held
    data.update(highest_token=str(row.version), waiting_tasks=waiting, updated_at=format_time(row.updated_at))
    return data


def unleased_key_view(key: str, waiting: int) -> dict[str, Any]:
    """A key whose tasks wait but never took a permit: its row (and token
    sequence) is made by its first lease."""
    return {"key": key, "highest_token": "0", "waiting_tasks": waiting}


def describe_keys(namespace_id: str, rows: list[ConcurrencyKey]) -> list[dict[str, Any]]:
    counts = waiting_counts(namespace_id, [row.key for row in rows])
    holders = holder_attempts(rows)
    return [key_view(row, counts.get(row.key, 0), holders.get(row.holder_attempt_id)) for row in rows]


def key_row(namespace_id: str, key: str) -> ConcurrencyKey | None:
    return ConcurrencyKey.objects.filter(namespace_id=namespace_id, key=key).first()


def key_get(*, principal: Principal, key: str) -> dict[str, Any]:
    """One key of the credential's namespace, compared byte for byte."""
    principal.require("tasks:read")
    principal.require_all_queues()
    return describe_key(principal.namespace_id, key)


def describe_key(namespace_id: str, key: str) -> dict[str, Any]:
    row = key_row(namespace_id, key)
    if row is not None:
        return describe_keys(namespace_id, [row])[0]
    waiting = waiting_counts(namespace_id, [key]).get(key, 0)
    if not waiting:
        raise NotFound("concurrency key not found")
    return unleased_key_view(key, waiting)


def key_list(
    *, principal: Principal, prefix: str, after: str | None, limit: int
) -> tuple[list[dict[str, Any]], str | None]:
    """The namespace's keys (those that ever leased: a key's row is made by
    its first lease) that start with `prefix`, in byte order, a page
    after the key `after`, and the key to continue after (None: the last page).

    The keys starting with a prefix are one contiguous range of the byte
    order, from the prefix itself: read from there along the unique index and
    stop at the first key without the prefix (LIKE would fold case on SQLite)."""
    principal.require("tasks:read")
    principal.require_all_queues()
    rows = ConcurrencyKey.objects.filter(namespace_id=principal.namespace_id)
    rows = rows.filter(key__gt=after) if after is not None and after >= prefix else rows.filter(key__gte=prefix)
    taken = list(takewhile(lambda row: row.key.startswith(prefix), rows.order_by("key")[: limit + 1]))
    page = taken[:limit]
    next_key = page[-1].key if len(taken) > limit else None
    return describe_keys(principal.namespace_id, page), next_key
