"""Locking querysets for queue rows, in the global order (orbit.locking.LOCK_ORDER:
queue configuration rows, then queue_state rows by ascending id).
Querysets here touch one table each: MariaDB rejects select_for_update(of=...)."""

from __future__ import annotations

from collections.abc import Iterable

from orbit.db.rows import lock_by_pk
from queues.models import Queue, QueueState


def lock_queue(queue_id: str) -> Queue | None:
    return Queue.objects.select_for_update().filter(id=queue_id).first()


def lock_queue_states(queue_ids: Iterable[str]) -> dict[str, QueueState]:
    return lock_by_pk(QueueState, queue_ids)
