"""Worker identity verbs: who may hold a worker identity (a hello), and its
session's liveness (a connection's heartbeat and close)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError
from django.utils import timezone

from orbit.errors import NotFound, StateConflict, Unavailable
from orbit.models import Application
from orbit.principal import Principal
from orbit.transactions import outermost
from queues.models import Queue
from tasks.models import WorkerIdentity

# A connection marks its session alive this often (workers.consumers); a
# session not seen for SESSION_STALE_SECONDS is taken to be gone (its server
# died without closing it).
HEARTBEAT_SECONDS = 5.0
SESSION_STALE_SECONDS = 3 * HEARTBEAT_SECONDS


def _may_take_over(identity: WorkerIdentity, principal: Principal, now: datetime) -> bool:
    """A hello supersedes the identity's current session if its credential may
    consume every queue that session consumes, or if that session is gone.
    Otherwise a credential of one queue range could close a live worker of
    another range (worker ids are not secret) and keep it out."""
    if all(principal.covers_queue(queue_id) for queue_id in identity.queue_ids):
        return True
    return identity.seen_at is None or identity.seen_at <= now - timedelta(seconds=SESSION_STALE_SECONDS)


def register_worker(
    *,
    principal: Principal,
    worker_id: str,
    session_id: str,
    concurrency_keys: bool,
    queue_ids: list[str],
    handlers: Sequence[tuple[str, str]] = (),
    capacity: int = 0,
) -> int:
    """Checks the queues and fixes `concurrency_keys` for this worker identity,
    which from now on leases only for `session_id`; returns the identity's row id.

    The flag is a property of the process identity: a reconnect that changes it
    is refused, an upgraded process must use a new worker_id. A live session
    whose queues this credential may not consume is not superseded: the hello
    is refused UNAVAILABLE (retry once that session has closed)."""
    _require_queues(principal, queue_ids)
    session = {
        "session_id": session_id,
        "credential_id": principal.credential_id,
        "queue_ids": queue_ids,
        "handlers": [list(pair) for pair in handlers],
        "capacity": capacity,  # orbit_check holds the session's attempts to it
    }
    for _ in range(2):
        taken = _take_over(principal, worker_id, concurrency_keys, session)
        if taken is not None:
            return taken
        try:
            return _create_identity(principal, worker_id, concurrency_keys, session)
        except IntegrityError:
            continue  # a twin connection registered first; compare with its row
    raise StateConflict("worker registration raced; reconnect")


def _require_queues(principal: Principal, queue_ids: list[str]) -> None:
    """Every queue is in the credential's range and exists in its namespace."""
    for queue_id in queue_ids:
        principal.require_queue(queue_id)
    found = set(
        Queue.objects.filter(id__in=queue_ids, namespace_id=principal.namespace_id).values_list("id", flat=True)
    )
    missing = [queue_id for queue_id in queue_ids if queue_id not in found]
    if missing:
        raise NotFound(f"queue not found: {missing[0]}")


@outermost
def _take_over(principal: Principal, worker_id: str, concurrency_keys: bool, session: dict[str, Any]) -> int | None:
    """The existing identity, now for this session, or None when there is none yet."""
    # Locked: waits for a lease of the previous session still deciding (it
    # holds this row), so the hello's held attempts include that lease's;
    # and two hellos of one worker_id decide one after the other.
    identity = (
        WorkerIdentity.objects.select_for_update()
        .filter(namespace_id=principal.namespace_id, worker_id=worker_id)
        .first()
    )
    if identity is None:
        return None
    now = timezone.now()
    if identity.concurrency_keys != concurrency_keys:
        raise StateConflict(
            "concurrency_keys is fixed for this worker_id; start the upgraded process under a new worker_id"
        )
    if not _may_take_over(identity, principal, now):
        raise Unavailable(
            "worker_id is in use by a live connection consuming queues outside this credential's range;"
            " retry after it closes, or use another worker_id"
        )
    WorkerIdentity.objects.filter(pk=identity.pk).update(**session, connected_at=now, seen_at=now)
    return identity.pk


@outermost
def _create_identity(principal: Principal, worker_id: str, concurrency_keys: bool, session: dict[str, Any]) -> int:
    now = timezone.now()
    created = WorkerIdentity.objects.create(
        namespace_id=principal.namespace_id,
        worker_id=worker_id,
        concurrency_keys=concurrency_keys,
        connected_at=now,
        seen_at=now,
        **session,
    )
    return created.pk


def mark_session_alive(*, identity_id: int, session_id: str) -> bool:
    """The connection's heartbeat; False once a newer hello superseded the session."""
    return bool(WorkerIdentity.objects.filter(pk=identity_id, session_id=session_id).update(seen_at=timezone.now()))


def application_here(application_id: str) -> bool:
    """Whether the cell entered still holds the application: a move to another
    cell removes its rows, worker identities included, from the old one."""
    return Application.objects.filter(id=application_id).exists()


def end_session(*, identity_id: int, session_id: str) -> None:
    """The session's connection closed: another credential's hello may now take the identity over."""
    WorkerIdentity.objects.filter(pk=identity_id, session_id=session_id).update(seen_at=None)
