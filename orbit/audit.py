"""Audit rows and events, written inside the caller's transaction."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from orbit.api.auth import Principal
from orbit.idempotency import Actor
from orbit.models import AuditEntry, Event
from orbit.rows import insert_rows, new_row
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
)

_gathering = threading.local()


@contextmanager
def gathered_events() -> Iterator[None]:
    """Inside a transaction: events emitted within are inserted together, in
    order, as one statement on leaving the block (still inside the transaction)."""
    if getattr(_gathering, "events", None) is not None:
        yield  # an outer block writes them
        return
    _gathering.events = []
    try:
        yield
        insert_rows(_gathering.events)
    finally:
        _gathering.events = None


def emit_event(*, namespace_id: str, type: str, subject_id: str, data: dict[str, Any]) -> None:
    event = new_row(Event, namespace_id=namespace_id, type=type, subject_id=subject_id, data=data)
    gathering = getattr(_gathering, "events", None)
    if gathering is None:
        event.save()
    else:
        gathering.append(event)


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
    The cursor is the event's id: ids grow with every insert, and an event is
    visible only once the transaction that wrote it (and its change) commits.
    A transaction still open may hold a smaller id than one already read; a
    reader that must not skip one re-reads a short window behind its cursor."""
    events = Event.objects.filter(namespace_id=principal.namespace_id, id__gt=after).order_by("id")[:limit]
    return [
        {
            "cursor": str(event.id),
            "type": event.type,
            "subject_id": event.subject_id,
            "data": event.data,
            "created_at": format_time(event.created_at),
        }
        for event in events
    ]
