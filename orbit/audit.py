"""Audit rows and events, written inside the caller's transaction."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection
from django.db.models import F

from orbit.db.rows import insert_rows, new_row, write_statement
from orbit.models import AuditEntry, Event, EventSequence
from orbit.principal import Actor, Principal
from orbit.timefmt import format_time

# Every audit action the verbs write (the admin filters by them).
AUDIT_ACTIONS = (
    "plan.created",
    "plan.updated",
    "plan.paused",
    "plan.resumed",
    "plan.retired",
    "queue.created",
    "queue.configured",
    "queue.retired",
    "task.cancel",
    "task.resolve",
    "application.configured",
    "key_policy.created",
    "key_policy.configured",
    "key_policy.retired",
)

_gathering = threading.local()


@contextmanager
def gathered_events() -> Iterator[None]:
    """Inside a transaction: events emitted within are inserted together, in
    order, on leaving the block (still inside the transaction)."""
    if getattr(_gathering, "events", None) is not None:
        yield  # an outer block writes them
        return
    _gathering.events = []
    try:
        yield
        _insert_events(_gathering.events)
    finally:
        _gathering.events = None


def emit_event(*, namespace_id: str, type: str, subject_id: str, data: dict[str, Any]) -> None:
    event = new_row(Event, namespace_id=namespace_id, type=type, subject_id=subject_id, data=data)
    gathering = getattr(_gathering, "events", None)
    if gathering is None:
        _insert_events([event])
    else:
        gathering.append(event)


# Locks a namespace's sequence row (made on first use), advances it by the
# count, and leaves the value it had in a session variable for the INSERT that
# follows: nothing is read back, so both wait for the transaction's next
# statement (in a round, its COMMIT) and cost no round trip of their own.
_ADVANCE_MYSQL = (
    "INSERT INTO orbit_event_sequence (namespace_id, last_seq) VALUES (%s, %s) "
    "ON DUPLICATE KEY UPDATE last_seq = (@orbit_event_seq := last_seq) + %s"
)


def _insert_events(events: list[Event]) -> None:
    """Each namespace's events, in the order emitted, take the next cursors of
    its EventSequence row, which stays locked to the commit: a namespace's
    events become visible in cursor order, and one whose transaction is still
    open holds every later cursor back, so a reader after cursor N never
    passes one by. Writers lock the rows in namespace order, each as the last
    lock of its transaction (orbit.transactions.outermost), so they wait on one another
    only at their very end."""
    if events and not connection.in_atomic_block:
        # In autocommit the sequence row would be released before the events
        # are inserted, and cursors could then commit out of order.
        raise RuntimeError("events are written inside a transaction")
    by_namespace: dict[str, list[Event]] = {}
    for event in events:
        by_namespace.setdefault(event.namespace_id, []).append(event)
    mysql = connection.vendor == "mysql"
    for namespace_id in sorted(by_namespace):
        batch = by_namespace[namespace_id]
        if mysql:
            write_statement("SET @orbit_event_seq = 0", [])
            write_statement(_ADVANCE_MYSQL, [namespace_id, len(batch), len(batch)])
            insert_rows(batch, sql_values={"seq": [f"@orbit_event_seq + {n}" for n in range(1, len(batch) + 1)]})
        else:  # SQLite: one writer at a time already
            first = _advance_sequence(namespace_id, len(batch))
            for offset, event in enumerate(batch):
                event.seq = first + offset
            insert_rows(batch)


def _advance_sequence(namespace_id: str, count: int) -> int:
    """The first of `count` new cursors of the namespace (the ORM's way)."""
    if not EventSequence.objects.filter(pk=namespace_id).update(last_seq=F("last_seq") + count):
        EventSequence.objects.create(namespace_id=namespace_id, last_seq=count)
        return 1
    return EventSequence.objects.get(pk=namespace_id).last_seq - count + 1


def record_management_change(
    actor: Actor,
    *,
    action: str,
    target_type: str,
    target_id: str,
    reason: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> None:
    """One audit row and one event for a change of management state."""
    AuditEntry.objects.create(
        namespace_id=actor.namespace_id,
        credential_id=actor.principal.credential_id,
        action=action,
        target_type=target_type,
        target_id=target_id,
        reason=reason,
        before=before,
        after=after,
        request_id=actor.request_id,
    )
    emit_event(
        namespace_id=actor.namespace_id,
        type=action,
        subject_id=target_id,
        data={"before": before, "after": after, "reason": reason, "request_id": actor.request_id},
    )


def event_page(*, principal: Principal, after: int, limit: int) -> list[dict[str, Any]]:
    """The namespace's events after cursor `after`, oldest first (GET /v1/events).
    Cursors follow the commit order with no gaps (_insert_events): what a
    page returns after N is everything committed after N, in order."""
    events = Event.objects.filter(namespace_id=principal.namespace_id, seq__gt=after).order_by("seq")[:limit]
    return [
        {
            "cursor": str(event.seq),
            "type": event.type,
            "subject_id": event.subject_id,
            "data": event.data,
            "created_at": format_time(event.created_at),
        }
        for event in events
    ]
