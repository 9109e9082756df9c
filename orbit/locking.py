"""The one global lock order (docs/architecture/locking.md).

Every transaction that locks rows of more than one of these tables locks them
in this order: a row of an earlier table is never locked after a row of a
later one (within a table, by ascending primary key or key bytes). A
transaction may take any subset, and may lock a row it already holds again.
Each module that locks rows cites this tuple; tests/orbit/test_lock_order.py
checks every verb's locking statements against it.

Before any lock, a submit inserts its idempotency record and task rows (a
twin waits on the unique index holding nothing else); the namespace's event
sequence row is the last row any transaction locks (orbit.audit)."""

from __future__ import annotations

LOCK_ORDER: tuple[str, ...] = (
    "orbit_plan",  # a plan verb, or a trigger step whose submit locks what follows
    "orbit_key_policy",  # a key policy configure or retire, then its application's generation
    "orbit_application",  # configuration rows: an application configure (alone in its transaction)
    "orbit_application_state",  # submits, leases, results, releases, cancels, recovery
    "orbit_queue",  # configuration rows: configure and retire
    "orbit_queue_state",  # ascending queue id
    "orbit_worker_identity",  # a lease's session check; a hello locks only this row
    "orbit_credential",  # the revocation check of a lease, Start, renew or result
    "orbit_concurrency_key",  # ascending (namespace, key bytes)
    "orbit_concurrency_slot",  # a key's slots 1…N−1, only ever under their key's row (GUARDED_BY)
    "orbit_task",  # ascending id
    "orbit_attempt",  # ascending id
    "orbit_task_dependency",  # a dependency's edges, settled under the application's state row
    "orbit_dependency_settlement",  # a wide fan-out's settlement left to the follow-up, deleted by its last chunk
    "orbit_plan_trigger",  # inserted with its task by a plan's step, deleted with it by orbit_prune
    "orbit_fair_share",  # a fair lease's served times, one upsert after all its passes (ascending queue, key)
    "orbit_queue_minute",  # the console's rollup, added at the end of a round (ascending queue, minute)
    "orbit_event_sequence",  # last: events are written at the end of their transaction
)


def rank(table: str) -> int:
    """A table's place in LOCK_ORDER (ValueError for a table outside it)."""
    return LOCK_ORDER.index(table)


# Rows only ever locked by a transaction that holds their guard's row (a
# key's slots, under the key's row): whoever waits for one holds the guard,
# so they can never close a cycle of their own, wherever they come in the
# transaction (a release learns its attempt's slot after locking the attempt).
GUARDED_BY: dict[str, str] = {"orbit_concurrency_slot": "orbit_concurrency_key"}
