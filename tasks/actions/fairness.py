"""Fair shares (SPEC §12): the lease order of a queue whose tasks carry
fairness keys (fair_candidates), and when each key was last served
(record_served).

Within equal priority a lease serves the queue's fairness keys round robin:
every group's best task before any group's second, the group served least
recently first (a group never served before all), then the oldest
available_at within the group. Tasks without a key form one group, '', so a
queue where no task has a key comes out in the plain lease order
(tasks.sql.LEASE_ORDER). Dispatch asks this module only for a queue whose
QueueState.fair_shares is set (the submit that first accepts a keyed task
sets it), so every other queue keeps the one-index scan.

The named statements are here, in tasks.sql's style, until they move there."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection

from orbit.db.rows import db_value, select_rows, write_statement
from tasks import sql
from tasks.actions.context import MAX_LEASABLE_KEY_VERSION, WorkerContext
from tasks.models import ConcurrencyKey, FairShare, Task, TaskState

# --- the fair lease order ---------------------------------------------------

# The candidates of one queue (the normal scan's WHERE, `{where}`) ranked in
# the fair order, without a lock: `rn` is a task's place in its group at its
# priority (1 = the group's best), `served_at` when its group was last served
# (NULL: never, first). Priority first, then one task of each group per turn,
# groups by how long ago they were served, then the oldest available. The
# partition includes priority so a group's high-priority backlog does not
# push its lower-priority tasks behind other groups' at that lower priority.
# `{excluded}`: ids an earlier pass saw but could not lock. Parameters: the
# WHERE's, the excluded ids, queue_id, LIMIT.
FAIR_RANKED = (
    "SELECT r.{id}, r.rn, f.served_at FROM ("
    "SELECT {id}, fairness_key, priority, available_at,"
    " ROW_NUMBER() OVER (PARTITION BY fairness_key, priority ORDER BY available_at ASC, {id} ASC) AS rn"
    " FROM {task_table} WHERE {where}{excluded}) r"
    " LEFT JOIN {share_table} f ON f.queue_id = %s AND f.fairness_key = r.fairness_key"
    " ORDER BY r.priority DESC, r.rn ASC, f.served_at IS NOT NULL, f.served_at ASC, r.available_at ASC, r.{id} ASC"
    " LIMIT %s"
)

# The ranked ids locked, the candidate WHERE applied again: a row another
# transaction changed since the ranking (taken, cancelled) no longer
# matches, one it holds is skipped. Parameters: the WHERE's, then the ids.
FAIR_LOCK = "{where} AND {id} IN ({ids})"

# --- when each group was last served ------------------------------------------

# Sets served_at of (queue, key) rows, creating those never served: one
# statement at the end of a lease. Parameters: per row queue_id,
# fairness_key, served_at.
SERVED_UPSERT = "INSERT INTO {table} (queue_id, fairness_key, served_at) VALUES {rows} {upsert}"

SERVED_ON_CONFLICT = {
    "mysql": "ON DUPLICATE KEY UPDATE served_at = VALUES(served_at)",
    "sqlite": "ON CONFLICT (queue_id, fairness_key) DO UPDATE SET served_at = excluded.served_at",
}

# How often fair_candidates ranks again when rows it ranked could not be
# locked (held by another transaction, or changed), ranking without them.
FAIR_PASSES = 3
# The rank of a group never served: before every served one.
NEVER_SERVED = datetime.min.replace(tzinfo=UTC)


def candidate_filter(worker: WorkerContext, queue_id: str, now: datetime) -> tuple[str, list[Any]]:
    """The WHERE of the normal lease scan of one queue and its parameters, as
    tasks.actions.dispatch.candidate_filter builds them (a test holds the two
    equal; dispatch imports this module, so it cannot be imported here)."""
    at = db_value(Task, "available_at", now)
    where = sql.candidate_filter(
        keyed=worker.concurrency_keys, handlers=len(worker.handlers), max_key_version=MAX_LEASABLE_KEY_VERSION
    )
    params: list[Any] = [at, True, queue_id, TaskState.WAITING, at]
    if worker.concurrency_keys:
        params.append(db_value(ConcurrencyKey, "next_start_at", now))
    params += [part for pair in worker.handlers for part in pair]
    return where, params


def fair_candidates(worker: WorkerContext, queue_id: str, now: datetime, count: int) -> list[Task]:
    """Up to `count` leasable tasks of one queue whose QueueState.fair_shares is set, locked
    (FOR UPDATE SKIP LOCKED), in the fair order; each returned Task gets an attribute
    `fair_rank: tuple` that the lease sorts by after -priority.

    fair_rank is (rn, served_at of its group or NEVER_SERVED, available_at,
    id): within one priority it orders as FAIR_RANKED does, and across queues
    it interleaves their groups by the same rule. The ranking reads without a
    lock; rows it cannot lock are left out and the rest ranked again, so a
    row another transaction holds does not shorten the lease."""
    if count <= 0:
        return []
    where, params = candidate_filter(worker, queue_id, now)
    quote = connection.ops.quote_name
    excluded: list[str] = []
    locked: dict[str, Task] = {}
    ranked: list[tuple[str, int, datetime]] = []
    for _ in range(FAIR_PASSES):
        ranked = _ranked(where, params, excluded, queue_id, count)
        wanted = [task_id for task_id, _, _ in ranked if task_id not in locked]
        if wanted:
            statement = FAIR_LOCK.format(where=where, id=quote("id"), ids=", ".join(["%s"] * len(wanted)))
            for task in select_rows(Task, statement, [*params, *wanted], lock=True, skip_locked=True):
                locked[task.id] = task
        missing = [task_id for task_id, _, _ in ranked if task_id not in locked]
        if not missing:
            break
        excluded += missing
    found: list[Task] = []
    for task_id, rn, served_at in ranked:
        if task_id not in locked:
            continue
        task = locked[task_id]
        task.fair_rank = (rn, served_at, task.available_at, task.id)  # type: ignore[attr-defined]
        found.append(task)
    return found


def _ranked(
    where: str, params: list[Any], excluded: list[str], queue_id: str, count: int
) -> list[tuple[str, int, datetime]]:
    """FAIR_RANKED's rows: (id, rn, served_at or NEVER_SERVED), in the fair order."""
    quote = connection.ops.quote_name
    statement = FAIR_RANKED.format(
        id=quote("id"),
        task_table=quote(Task._meta.db_table),
        share_table=quote(FairShare._meta.db_table),
        where=where,
        excluded=f" AND {quote('id')} NOT IN ({', '.join(['%s'] * len(excluded))})" if excluded else "",
    )
    with connection.cursor() as cursor:
        cursor.execute(statement, [*params, *excluded, queue_id, count])
        rows = cursor.fetchall()
    # The backends' converter of a datetime column (a naive UTC value on
    # MariaDB, text on SQLite) to an aware one; the stubs' base class lacks it.
    ops: Any = connection.ops
    convert = ops.convert_datetimefield_value
    served_field = FairShare._meta.get_field("served_at")
    return [
        (task_id, int(rn), NEVER_SERVED if served is None else convert(served, served_field, connection))
        for task_id, rn, served in rows
    ]


def record_served(tasks: list[Task], now: datetime) -> None:
    """Upsert orbit_fair_share.served_at for each (queue_id, fairness_key) of the leased tasks
    (tasks in lease order: later in the list = served later, so give microsecond-increasing
    times or otherwise keep the order). One statement.

    A group's time is `now` plus its last task's place in the list, in
    microseconds: the group served last in this lease is served last in the
    next one's turn too. Rows go in ascending (queue, key), the order they
    are locked in (orbit.locking.LOCK_ORDER)."""
    last: dict[tuple[str, str], int] = {}
    for place, task in enumerate(tasks):
        last[(task.queue_id, task.fairness_key)] = place
    if not last:
        return
    rows = sorted(last.items(), key=lambda item: (item[0][0], item[0][1].encode("utf-8", "surrogatepass")))
    params: list[Any] = []
    for (queue_id, fairness_key), place in rows:
        params += [queue_id, fairness_key, db_value(FairShare, "served_at", now + timedelta(microseconds=place))]
    statement = SERVED_UPSERT.format(
        table=connection.ops.quote_name(FairShare._meta.db_table),
        rows=", ".join(["(%s, %s, %s)"] * len(rows)),
        upsert=SERVED_ON_CONFLICT[connection.vendor],
    )
    write_statement(statement, params)
