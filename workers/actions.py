"""Worker registration verbs."""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.utils import timezone

from orbit.api.auth import Principal
from orbit.errors import NotFound, StateConflict
from queues.models import Queue
from workers.models import WorkerIdentity


def register_worker(
    *, principal: Principal, worker_id: str, session_id: str, concurrency_keys: bool, queue_ids: list[str]
) -> int:
    """Checks the queues and fixes `concurrency_keys` for this worker identity,
    which from now on leases only for `session_id`; returns the identity's row id.

    The flag is a property of the process identity: a reconnect that changes it
    is refused, an upgraded process must use a new worker_id."""
    for queue_id in queue_ids:
        principal.require_queue(queue_id)
    found = set(
        Queue.objects.filter(id__in=queue_ids, namespace_id=principal.namespace_id).values_list("id", flat=True)
    )
    missing = [queue_id for queue_id in queue_ids if queue_id not in found]
    if missing:
        raise NotFound(f"queue not found: {missing[0]}")
    now = timezone.now()
    for _ in range(2):
        identity = WorkerIdentity.objects.filter(namespace_id=principal.namespace_id, worker_id=worker_id).first()
        if identity is not None:
            if identity.concurrency_keys != concurrency_keys:
                raise StateConflict(
                    "concurrency_keys is fixed for this worker_id; start the upgraded process under a new worker_id"
                )
            # Waits for a lease of the previous session still deciding (it
            # holds this row), so the hello's held attempts include that lease's.
            WorkerIdentity.objects.filter(pk=identity.pk).update(
                session_id=session_id, credential_id=principal.credential_id, connected_at=now
            )
            return identity.pk
        try:
            with transaction.atomic():
                created = WorkerIdentity.objects.create(
                    namespace_id=principal.namespace_id,
                    worker_id=worker_id,
                    concurrency_keys=concurrency_keys,
                    credential_id=principal.credential_id,
                    session_id=session_id,
                    connected_at=now,
                )
            return created.pk
        except IntegrityError:
            continue  # a twin connection registered first; compare with its row
    raise StateConflict("worker registration raced; reconnect")


def current_session(*, namespace_id: str, worker_id: str) -> str | None:
    """The session id of the newest hello of this worker identity."""
    return (
        WorkerIdentity.objects.filter(namespace_id=namespace_id, worker_id=worker_id)
        .values_list("session_id", flat=True)
        .first()
    )
