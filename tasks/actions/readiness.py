"""The ready set of keyed work (SPEC §10): among the WAITING tasks of one
(namespace, concurrency key, queue), exactly one is `key_ready`; the others
stay out of the part of the dispatch index the lease scans. A deep backlog
behind a busy key then costs the lease one row, not one row per task.

The ready task is the best by `rank`: available now beats available later;
among available tasks the lease order (priority, available_at, id); among
later ones the earliest. So the ready task is never waiting out a backoff
while a sibling could run. Time can change the order (a sibling ranked below
for being later becomes available with a higher priority): the lease asks
`next_in_line` before it takes a ready task. Unkeyed tasks are always
ready.

Every caller holds the application_state lock, which serializes all changes
to an application's WAITING sets (submit, lease, attempt endings, cancel,
deadline sweeps), so these checks cannot race each other."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection

from orbit.db.rows import db_value, select_ids_together, select_rows, update_by_pk
from tasks import sql
from tasks.actions.fairness import NEVER_SERVED
from tasks.models import Task, TaskState


def rank(task: Task, now: datetime) -> tuple[Any, ...]:
    if task.available_at <= now:
        return (0, -task.priority, task.available_at, task.id)
    return (1, task.available_at, -task.priority, task.id)


def _siblings(task: Task) -> Any:
    return Task.objects.filter(
        namespace_id=task.namespace_id,
        concurrency_key=task.concurrency_key,
        queue_id=task.queue_id,
        state=TaskState.WAITING,
    ).exclude(id=task.id)


def enter_waiting(task: Task, now: datetime) -> bool:
    """Decides `key_ready` for a task (re-)entering WAITING; may demote the
    sibling it outranks. Returns the value to store."""
    if not task.concurrency_key:
        return True
    current = _siblings(task).filter(key_ready=True).only("id", "priority", "available_at").first()
    if current is None:
        return True
    if rank(task, now) < rank(current, now):
        Task.objects.filter(id=current.id).update(key_ready=False)
        return True
    return False


KeyGroup = tuple[str, str, str]  # (namespace_id, concurrency_key, queue_id)


def promote_next(*, namespace_id: str, concurrency_key: str, queue_id: str, now: datetime) -> None:
    """After the ready task of a (key, queue) left WAITING: make the best waiting sibling ready."""
    promote_each([(namespace_id, concurrency_key, queue_id)], now)


def promote_each(groups: list[KeyGroup], now: datetime) -> None:
    """promote_next for several (key, queue) groups: whether each still has a
    ready task, its best available sibling and whether it has any other, for
    all of them in one round trip; its best later sibling only for a group
    with siblings but none available (a second one, rarely: that query walks
    every waiting task of the group). The promotions go in one write, sent
    with the next statement. A lease of N keyed tasks hands N ready roles on."""
    wanted = sorted({group for group in groups if group[1]})
    if not wanted:
        return
    at = db_value(Task, "available_at", now)
    queries: list[tuple[str, list[Any]]] = []
    for namespace_id, key, queue_id in wanted:
        columns = [namespace_id, key, queue_id, TaskState.WAITING]
        queries += [
            (sql.GROUP_ANY, [*columns, True]),
            (sql.GROUP_BEST_AVAILABLE, [*columns, False, at]),
            (sql.GROUP_ANY, [*columns, False]),
        ]
    found = iter(select_ids_together(Task, queries))
    chosen: list[str] = []
    later: list[KeyGroup] = []
    for group in wanted:
        ready, available, other = next(found), next(found), next(found)
        if ready:
            continue
        if available:
            chosen.append(available[0])
        elif other:
            later.append(group)
    if later:
        queries = [
            (sql.GROUP_FIRST_LATER, [namespace_id, key, queue_id, TaskState.WAITING, False])
            for namespace_id, key, queue_id in later
        ]
        chosen += [ids[0] for ids in select_ids_together(Task, queries) if ids]
    if chosen:
        update_by_pk(Task, chosen, {"key_ready": True})


@dataclass
class NextInLine:
    """What the lease learns of a ready keyed task's group before taking it
    (`next_in_line`): the best waiting sibling available now, locked."""

    sibling: Task | None
    # The sibling outranks the ready task: it was made ready in its place.
    overtakes: bool

    @property
    def overtaker(self) -> Task | None:
        """The sibling that takes the ready task's turn."""
        return self.sibling if self.overtakes else None

    @property
    def successor(self) -> Task | None:
        """The sibling to make ready once the lease takes the ready task."""
        return None if self.overtakes else self.sibling


def next_in_line(
    tasks: list[Task], now: datetime, fair_queues: Collection[str] = (), served_in_lease: Sequence[Task] = ()
) -> dict[str, NextInLine]:
    """For ready keyed `tasks` (of distinct (key, queue) groups): the best
    waiting sibling available now (its deadline not passed), locked, by the
    ready task's id. A sibling that outranks its ready task is made ready in
    its place (`overtakes`); one that does not is the task's successor, the
    one to make ready once the lease takes the task (`hand_on`), with no read
    more. In `fair_queues` "best" and "outranks" are the fair order's
    (`_fair_lines`), the fairness groups `served_in_lease` counted as served.

    Readiness is decided when a task enters WAITING, and tasks available later
    are ranked by when they become available; by the time the key is free, a
    sibling ranked below may have become available with a higher priority
    (SPEC §7: higher priority leases first). The lease asks before taking the
    ready task: for all its keyed candidates in one round trip. The caller
    holds the application_state lock, so no sibling row is locked by anyone
    else."""
    keyed = [task for task in tasks if task.concurrency_key and task.queue_id not in fair_queues]
    fair = [task for task in tasks if task.concurrency_key and task.queue_id in fair_queues]
    lines = _fair_lines(fair, now, served_in_lease) if fair else {}
    if not keyed:
        return lines
    at = db_value(Task, "available_at", now)
    # One statement for all the groups, the siblings it names locked (tasks.sql.NEXT_IN_LINE).
    params: list[Any] = [TaskState.WAITING, False, at, at, *(task.id for task in keyed)]
    found = select_rows(Task, sql.next_in_line(len(keyed)), params, lock=True)
    by_group = {
        (row.namespace_id, row.concurrency_key, row.queue_id): row
        for row in found
        if row.state == TaskState.WAITING and not row.key_ready
    }
    for task in keyed:
        sibling = by_group.get((task.namespace_id, task.concurrency_key, task.queue_id))
        lines[task.id] = _line(task, sibling, sibling is not None and rank(sibling, now) < rank(task, now))
    return lines


def _line(task: Task, sibling: Task | None, overtakes: bool) -> NextInLine:
    """The ready task's line; an overtaking sibling is made ready in its place."""
    if sibling is not None and overtakes:
        update_by_pk(Task, [task.id], {"key_ready": False})
        update_by_pk(Task, [sibling.id], {"key_ready": True})
        task.key_ready, sibling.key_ready = False, True
    return NextInLine(sibling, overtakes)


@dataclass(frozen=True)
class _Head:
    """Where a fairness group within a key group stands: its best priority among
    its available tasks, the first available_at at it, and when it was served."""

    fairness_key: str
    priority: int
    first_available: datetime
    served_at: datetime  # NEVER_SERVED if never


def _fair_lines(tasks: list[Task], now: datetime, served_in_lease: Sequence[Task]) -> dict[str, NextInLine]:
    """next_in_line for ready keyed tasks of fair queues (SPEC §12: within
    equal priority a lease serves fairness groups round robin, and a key's
    turns are leases too). Readiness is decided in the plain order when a task
    enters WAITING, but which fairness group was served last changes with every
    lease; so the lease ranks the key group's fairness groups
    (tasks.sql.FAIR_NEXT_IN_LINE) in the fair order, the groups this lease has
    served already (`served_in_lease`, in lease order) after every other.
    When the first group's best task is not the ready task it overtakes;
    otherwise another group's best at the same priority, if any, is the
    successor (else hand_on's reads choose, as in a plain queue). Without
    this, a tenant whose tasks share a key with another's deep backlog would
    wait for all of that backlog."""
    at = db_value(Task, "available_at", now)
    params: list[Any] = []
    for task in tasks:
        columns = [task.namespace_id, task.concurrency_key, task.queue_id]
        params += [*columns, *columns, TaskState.WAITING, at]
    with connection.cursor() as cursor:
        cursor.execute(sql.fair_next_in_line(len(tasks)), params)
        found = cursor.fetchall()
    # The backends' converter of a datetime column to an aware one; the stubs' base class lacks it.
    ops: Any = connection.ops
    convert = ops.convert_datetimefield_value
    datetime_field = Task._meta.get_field("available_at")
    heads: dict[KeyGroup, dict[str, _Head]] = {}
    for namespace_id, key, queue_id, fairness_key, priority, first_available, served_at in found:
        group = heads.setdefault((namespace_id, key, queue_id), {})
        known = group.get(fairness_key)
        if known is None or int(priority) > known.priority:
            group[fairness_key] = _Head(
                fairness_key,
                int(priority),
                convert(first_available, datetime_field, connection),
                NEVER_SERVED if served_at is None else convert(served_at, datetime_field, connection),
            )
    in_lease = {(task.queue_id, task.fairness_key): place for place, task in enumerate(served_in_lease)}
    lines: dict[str, NextInLine] = {}
    for task in tasks:
        group = heads.get((task.namespace_id, task.concurrency_key, task.queue_id), {})

        def order(head: _Head, queue_id: str = task.queue_id) -> tuple[Any, ...]:
            place = in_lease.get((queue_id, head.fairness_key))
            served = (0, head.served_at) if place is None else (1, place)
            return (-head.priority, served, head.first_available, head.fairness_key)

        ranked = sorted(group.values(), key=order)
        if not ranked:
            lines[task.id] = NextInLine(None, False)
            continue
        first = ranked[0]
        # The ready task is the best of the key group in the plain order, so of its own
        # fairness group at its priority too (a task past its deadline, which the heads
        # count, aside).
        if (first.fairness_key, first.priority) != (task.fairness_key, task.priority):
            sibling = _best_of(task, first, at)
            lines[task.id] = _line(task, sibling, sibling is not None)
            continue
        # The ready task leads; the next group at its priority follows it.
        others = [head for head in ranked[1:] if head.fairness_key != task.fairness_key]
        follower = others[0] if others and others[0].priority == task.priority else None
        lines[task.id] = NextInLine(_best_of(task, follower, at) if follower is not None else None, False)
    return lines


def _best_of(task: Task, head: _Head, at: Any) -> Task | None:
    """The best not-ready task of `head`'s fairness group in `task`'s key group, locked."""
    params = [
        task.namespace_id,
        task.concurrency_key,
        task.queue_id,
        TaskState.WAITING,
        False,
        head.fairness_key,
        head.priority,
        db_value(Task, "available_at", head.first_available),
        at,
        at,
    ]
    found = select_rows(Task, sql.FAIR_GROUP_BEST, params, lock=True)
    return found[0] if found else None


def hand_on(leased: list[tuple[Task, NextInLine | None]], now: datetime) -> None:
    """After a lease took these keyed tasks, each its group's ready task:
    hands each group's ready role on. A task leased with a successor
    (`next_in_line` found one that it outranked) makes that one ready: it is
    what promote_each would choose, read already and locked, and no other
    task of the group is ready (the one ready role was the leased task's).
    The other groups (the lease took an overtaking sibling, or nothing was
    available) go through promote_each."""
    successors = [(task, line.successor if line is not None else None) for task, line in leased]
    promote_each(
        [
            (task.namespace_id, task.concurrency_key, task.queue_id)
            for task, successor in successors
            if successor is None
        ],
        now,
    )
    chosen = [successor.id for _, successor in successors if successor is not None]
    if chosen:
        update_by_pk(Task, chosen, {"key_ready": True})


def admit_readiness(tasks: list[Task], now: datetime) -> list[str]:
    """Decides `key_ready` for new keyed tasks of one submit (saved not ready),
    against the ready siblings already waiting and each other. Demotes a
    sibling that a new task outranks; returns the ids of the new ready ones."""
    groups: dict[tuple[str, str, str], list[Task]] = {}
    for task in tasks:
        groups.setdefault((task.namespace_id, task.concurrency_key, task.queue_id), []).append(task)
    ready = []
    for (namespace_id, key, queue_id), group in groups.items():
        current = (
            Task.objects.filter(
                namespace_id=namespace_id,
                concurrency_key=key,
                queue_id=queue_id,
                state=TaskState.WAITING,
                key_ready=True,
            )
            .only("id", "priority", "available_at")
            .first()
        )
        best = min(group, key=lambda task: rank(task, now))
        if current is None or rank(best, now) < rank(current, now):
            best.key_ready = True
            ready.append(best.id)
            if current is not None:
                Task.objects.filter(id=current.id).update(key_ready=False)
    return ready
