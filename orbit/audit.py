"""Audit rows and events, written inside the caller's transaction."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from orbit.idempotency import Actor
from orbit.models import AuditEntry, Event
from orbit.rows import insert_rows, new_row

# Every audit action the verbs write (the admin filters by them).
AUDIT_ACTIONS = ("queue.created", "queue.configured", "queue.retired", "task.cancel")

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
