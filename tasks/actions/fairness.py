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

Its named statements are in tasks.sql (FAIR_RANKED, FAIR_LOCK, SERVED_UPSERT)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection

from orbit.db.rows import db_value, select_rows, write_statement
from tasks import sql
from tasks.actions.context import WorkerContext, candidate_filter
from tasks.models import FairShare, Task

# How often fair_candidates ranks again when rows it ranked could not be
# locked (held by another transaction, or changed), ranking without them.
FAIR_PASSES = 3
# The rank of a group never served: before every served one.
NEVER_SERVED = datetime.min.replace(tzinfo=UTC)


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
            statement = sql.FAIR_LOCK.format(where=where, id=quote("id"), ids=", ".join(["%s"] * len(wanted)))
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
        task.fair_rank = (rn, served_at, task.available_at, task.id)
        found.append(task)
    return found


def rank_as_one_group(tasks: list[Task]) -> None:
    """Ranks a plain queue's candidates (in the plain lease order) beside a
    fair queue's: one group, never served."""
    places: dict[int, int] = {}
    for task in tasks:
        places[task.priority] = places.get(task.priority, 0) + 1
        task.fair_rank = (places[task.priority], NEVER_SERVED, task.available_at, task.id)


def _ranked(
    where: str, params: list[Any], excluded: list[str], queue_id: str, count: int
) -> list[tuple[str, int, datetime]]:
    """FAIR_RANKED's rows: (id, rn, served_at or NEVER_SERVED), in the fair order."""
    quote = connection.ops.quote_name
    statement = sql.FAIR_RANKED.format(
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
    statement = sql.SERVED_UPSERT.format(
        table=connection.ops.quote_name(FairShare._meta.db_table),
        rows=", ".join(["(%s, %s, %s)"] * len(rows)),
        upsert=sql.SERVED_ON_CONFLICT[connection.vendor],
    )
    write_statement(statement, params)
