"""The ready set of keyed work (SPEC §10): among the WAITING tasks of one
(namespace, concurrency key, queue), exactly one is `key_ready`; the others
stay out of the part of the dispatch index the lease scans. A deep backlog
behind a busy key then costs the lease one row, not one row per task.

The ready task is the best by `rank`: available now beats available later;
among available tasks the lease order (priority, available_at, id); among
later ones the earliest. So the ready task is never waiting out a backoff
while a sibling could run. Time can change the order (a sibling ranked below
for being later becomes available with a higher priority): the lease asks
`overtaking_siblings` before it takes a ready task. Unkeyed tasks are always
ready.

Every caller holds the application_state lock, which serializes all changes
to an application's WAITING sets (submit, lease, attempt endings, cancel,
deadline sweeps), so these checks cannot race each other."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from orbit.db.rows import db_value, select_ids_together, select_together, update_by_pk
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

_GROUP = "namespace_id = %s AND concurrency_key = %s AND queue_id = %s AND state = %s"


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
            (f"{_GROUP} AND key_ready = %s LIMIT 1", [*columns, True]),
            (
                f"{_GROUP} AND key_ready = %s AND available_at <= %s"
                " ORDER BY priority DESC, available_at ASC, id ASC LIMIT 1",
                [*columns, False, at],
            ),
            (f"{_GROUP} AND key_ready = %s LIMIT 1", [*columns, False]),
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
            (
                f"{_GROUP} AND key_ready = %s ORDER BY available_at ASC, priority DESC, id ASC LIMIT 1",
                [namespace_id, key, queue_id, TaskState.WAITING, False],
            )
            for namespace_id, key, queue_id in later
        ]
        chosen += [ids[0] for ids in select_ids_together(Task, queries) if ids]
    if chosen:
        update_by_pk(Task, chosen, {"key_ready": True})


def overtaking_siblings(tasks: list[Task], now: datetime) -> dict[str, Task]:
    """For ready keyed `tasks` (of distinct (key, queue) groups): the waiting
    sibling that outranks each now, locked and made ready in its place, by
    the ready task's id; a task that is still the best of its group is absent.

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
    where = (
        f"{_GROUP} AND key_ready = %s AND available_at <= %s AND (deadline_at IS NULL OR deadline_at > %s)"
        " ORDER BY priority DESC, available_at ASC, id ASC LIMIT 1"
    )
    queries: list[tuple[type[Task], str, list[Any]]] = [
        (Task, where, [task.namespace_id, task.concurrency_key, task.queue_id, TaskState.WAITING, False, at, at])
        for task in keyed
    ]
    overtaking: dict[str, Task] = {}
    for task, best in zip(keyed, select_together(queries, lock=True), strict=True):
        if not best or rank(task, now) < rank(best[0], now):
            continue
        sibling = best[0]
        update_by_pk(Task, [task.id], {"key_ready": False})
        update_by_pk(Task, [sibling.id], {"key_ready": True})
        task.key_ready, sibling.key_ready = False, True
        overtaking[task.id] = sibling
    return overtaking


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
