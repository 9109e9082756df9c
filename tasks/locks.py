"""Locking querysets for the task app, in the global order (orbit.locking.LOCK_ORDER:
application_state, then concurrency keys by ascending key bytes, their slots, tasks, attempts).

Each queryset reads one table (MariaDB rejects select_for_update(of=...))."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from django.db import connection
from django.utils import timezone

from orbit.db.rows import LockedBy, lock_by_pk, namespace_keys_in, select_rows
from orbit.models import ApplicationState
from tasks.models import Attempt, ConcurrencyKey, ConcurrencySlot, Task


def lock_application_state(application_id: str) -> ApplicationState:
    state = lock_by_pk(ApplicationState, [application_id]).get(application_id)
    if state is None:
        raise ApplicationState.DoesNotExist(application_id)
    return state


_kept = threading.local()


@contextmanager
def keeping_key_rows() -> Iterator[None]:
    """Inside one transaction (a round): the key rows lock_concurrency_keys
    locks are kept, and locking one again returns the kept row and sends
    nothing for it. A round changes a key row only through that object (its
    results release the key, its leases take it), so the kept row is what the
    database holds once the round's writes are sent; the row lock is held until
    the transaction ends."""
    _kept.rows = {}
    try:
        yield
    finally:
        _kept.rows = None


def key_rows_ahead(namespace_id: str, keys: Iterable[str]) -> LockedBy:
    """The key rows of a namespace (those that exist), locked in ascending key
    order in an earlier round trip of the round (orbit.db.rows.LockedBy) and
    kept for lock_concurrency_keys (keeping_key_rows)."""

    def keep(rows: list[ConcurrencyKey]) -> None:
        kept: dict[tuple[str, str], ConcurrencyKey] = _kept.rows
        kept.update(((namespace_id, row.key), row) for row in rows)

    return LockedBy(ConcurrencyKey, *_in_key_order(namespace_id, keys), keep)


def _in_key_order(namespace_id: str, keys: Iterable[str]) -> tuple[str, list[str]]:
    """The WHERE of a namespace's key rows, ascending by key (the lock order), and its parameters."""
    where, params = namespace_keys_in(namespace_id, keys)
    return f"{where} ORDER BY {connection.ops.quote_name('key')}", params


def lock_concurrency_keys(namespace_id: str, keys: Iterable[str]) -> dict[str, ConcurrencyKey]:
    """Locks the key rows in ascending key order, creating missing ones first.

    A row is never deleted, so once created it is the permanent home of that
    key's token sequence. INSERT IGNORE lets two leases race to create one key:
    the loser waits on the unique index, then finds the row and locks it."""
    kept: dict[tuple[str, str], ConcurrencyKey] | None = getattr(_kept, "rows", None)
    wanted = sorted(set(keys))
    rows = {key: kept[(namespace_id, key)] for key in wanted if (namespace_id, key) in kept} if kept else {}
    wanted = [key for key in wanted if key not in rows]
    if not wanted:
        return rows

    where, params = _in_key_order(namespace_id, wanted)

    def locked() -> dict[str, ConcurrencyKey]:
        return {row.key: row for row in select_rows(ConcurrencyKey, where, params, lock=True)}

    found = locked()  # the usual case: every row exists, one statement
    missing = [key for key in wanted if key not in found]
    if missing:
        now = timezone.now()
        ConcurrencyKey.objects.bulk_create(
            [ConcurrencyKey(namespace_id=namespace_id, key=key, version=0, updated_at=now) for key in missing],
            ignore_conflicts=True,
        )
        found = locked()
    if kept is not None:
        kept.update(((namespace_id, key), row) for key, row in found.items())
    return {**rows, **found}


def lock_slots(namespace_id: str, keys: list[str]) -> dict[str, dict[int, ConcurrencySlot]]:
    """The slot rows of these keys (capacity above 1), by key and slot. The
    caller holds the keys' rows, which serialize every change to their slots;
    the read locks anyway, so it sees the latest committed holders."""
    if not keys:
        return {}
    where, params = namespace_keys_in(namespace_id, keys)
    found: dict[str, dict[int, ConcurrencySlot]] = {}
    order = f"ORDER BY {connection.ops.quote_name('key')}, slot"
    for row in select_rows(ConcurrencySlot, f"{where} {order}", params, lock=True):
        found.setdefault(row.key, {})[row.slot] = row
    return found


def lock_task(task_id: str) -> Task | None:
    return lock_by_pk(Task, [task_id]).get(task_id)


def lock_attempt(attempt_id: str) -> Attempt | None:
    return lock_by_pk(Attempt, [attempt_id]).get(attempt_id)
