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

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from orbit.db.rows import db_value, select_ids_together, select_rows, update_by_pk
from tasks import sql
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


def next_in_line(tasks: list[Task], now: datetime) -> dict[str, NextInLine]:
    """For ready keyed `tasks` (of distinct (key, queue) groups): the best
    waiting sibling available now (its deadline not passed), locked, by the
    ready task's id. A sibling that outranks its ready task is made ready in
    its place (`overtakes`); one that does not is the task's successor, the
    one to make ready once the lease takes the task (`hand_on`), with no read
    more.

    Readiness is decided when a task enters WAITING, and tasks available later
    are ranked by when they become available; by the time the key is free, a
    sibling ranked below may have become available with a higher priority
    (SPEC §7: higher priority leases first). The lease asks before taking the
    ready task: for all its keyed candidates in one round trip. The caller
    holds the application_state lock, so no sibling row is locked by anyone
    else."""
    keyed = [task for task in tasks if task.concurrency_key]
    if not keyed:
        return {}
    at = db_value(Task, "available_at", now)
    # One statement for all the groups, the siblings it names locked (tasks.sql.NEXT_IN_LINE).
    params: list[Any] = [TaskState.WAITING, False, at, at, *(task.id for task in keyed)]
    found = select_rows(Task, sql.next_in_line(len(keyed)), params, lock=True)
    by_group = {
        (row.namespace_id, row.concurrency_key, row.queue_id): row
        for row in found
        if row.state == TaskState.WAITING and not row.key_ready
    }
    lines: dict[str, NextInLine] = {}
    for task in keyed:
        sibling = by_group.get((task.namespace_id, task.concurrency_key, task.queue_id))
        overtakes = sibling is not None and rank(sibling, now) < rank(task, now)
        if sibling is not None and overtakes:
            update_by_pk(Task, [task.id], {"key_ready": False})
            update_by_pk(Task, [sibling.id], {"key_ready": True})
            task.key_ready, sibling.key_ready = False, True
        lines[task.id] = NextInLine(sibling, overtakes)
    return lines


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
