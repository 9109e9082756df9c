"""Read verbs for tasks and attempts; the credential's queue range applies."""

from __future__ import annotations

from typing import Any

from orbit.db.rows import keyset_page
from orbit.errors import InvalidArgument, NotFound
from orbit.principal import Principal
from tasks.actions.serialize import LINK_FIELDS, attempt_view, task_detail, task_link, task_summary
from tasks.models import Attempt, Task, TaskDependency, TaskState


def visible_task(principal: Principal, task_id: str) -> Task:
    task = Task.objects.filter(id=task_id, namespace_id=principal.namespace_id).first()
    if task is None or not principal.covers_queue(task.queue_id):
        raise NotFound("task not found")
    return task


def task_get(*, principal: Principal, task_id: str) -> dict[str, Any]:
    return task_detail(visible_task(principal, task_id))


def task_list(
    *, principal: Principal, filters: dict[str, str], after_id: str | None, limit: int
) -> tuple[list[dict[str, Any]], str | None]:
    tasks = Task.objects.filter(namespace_id=principal.namespace_id).defer("payload")
    if "queue_id" in filters:
        tasks = tasks.filter(queue_id=filters["queue_id"])
    if principal.queue_ids is not None:
        tasks = tasks.filter(queue_id__in=sorted(principal.queue_ids))
    if "state" in filters:
        if filters["state"] not in TaskState.values:
            raise InvalidArgument(f"state: must be one of {', '.join(TaskState.values)}")
        tasks = tasks.filter(state=filters["state"])
    for name in ("business_key", "concurrency_key"):
        if name in filters:
            tasks = tasks.filter(**{name: filters[name]})
    rows, next_id = keyset_page(tasks, after_id, limit)
    return [task_summary(t) for t in rows], next_id


def attempt_list(
    *, principal: Principal, task_id: str, after_epoch: int | None, limit: int
) -> tuple[list[dict[str, Any]], int | None]:
    """A task's attempts in lease order (by epoch, unique per task), a page
    after `after_epoch`, and the epoch to continue after (None: the last page).
    Released and expired attempts are not counted against max_attempts, so a
    task can have any number of them."""
    task = visible_task(principal, task_id)
    rows, next_epoch = keyset_page(Attempt.objects.filter(task_id=task.id), after_epoch, limit, key="epoch")
    return [attempt_view(a) for a in rows], next_epoch


def attempt_get(*, principal: Principal, attempt_id: str) -> dict[str, Any]:
    attempt = Attempt.objects.filter(id=attempt_id, namespace_id=principal.namespace_id).first()
    if attempt is None or not principal.covers_queue(attempt.queue_id):
        raise NotFound("attempt not found")
    return attempt_view(attempt)


def dependency_list(
    *, principal: Principal, task_id: str, after: int | None, limit: int
) -> tuple[list[dict[str, Any]], int | None]:
    """The task's dependencies in depends_on order (frozen at submit, so a
    pruned one keeps its place), a page after the first `after` of them, and
    the count to continue after (None: the last page)."""
    task = visible_task(principal, task_id)
    wanted = task.depends_on or []
    start = after or 0
    ids = wanted[start : start + limit]
    return _links(principal, ids), (start + limit if start + limit < len(wanted) else None)


def dependent_list(
    *, principal: Principal, task_id: str, after: str | None, limit: int
) -> tuple[list[dict[str, Any]], str | None]:
    """The tasks that depend on this one, in edge order (the order their
    edges were written, which is the order they were admitted), a page after
    the dependent `after`, and the dependent to continue after (None: the last
    page). The cursor names the dependent, not its edge's id: a move to another
    cell gives the edges new ids (in the same order), and a page token read
    before it must go on where it stopped."""
    task = visible_task(principal, task_id)
    after_edge = None
    if after is not None:
        after_edge = (
            TaskDependency.objects.filter(task_id=after, depends_on_id=task.id).values_list("id", flat=True).first()
        )
        if after_edge is None:  # pruned since: its place is gone with it
            raise InvalidArgument("page_token: the task it continues after is gone; list again from the start")
    # Edge order within each half of the (depends_on_id, settled, id) index,
    # merged: a wide fan-out's page costs its own rows, not a sort of all of them.
    halves = [
        list(
            TaskDependency.objects.filter(
                depends_on_id=task.id, settled=settled, **({"id__gt": after_edge} if after_edge else {})
            )
            .order_by("id")
            .values_list("id", "task_id")[: limit + 1]
        )
        for settled in (False, True)
    ]
    edges = sorted(halves[0] + halves[1])[: limit + 1]
    page = edges[:limit]
    return _links(principal, [dependent for _, dependent in page]), (page[-1][1] if len(edges) > limit else None)


def _links(principal: Principal, ids: list[str]) -> list[dict[str, Any]]:
    """Each related task in the order given, in short form; one the
    credential may not read (outside its queue range) by its id alone, one
    pruned from the database by its id and `pruned: true`."""
    rows = {
        row.id: row
        for row in Task.objects.filter(namespace_id=principal.namespace_id, id__in=sorted(set(ids))).only(*LINK_FIELDS)
    }
    links: list[dict[str, Any]] = []
    for related_id in ids:
        row = rows.get(related_id)
        if row is None:
            links.append({"id": related_id, "pruned": True})
        elif not principal.covers_queue(row.queue_id):
            links.append({"id": related_id})
        else:
            links.append(task_link(row))
    return links
