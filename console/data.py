"""What the console's pages show, read the way the engine's own reads are:

- per queue, unfinished tasks by state, permits and the start window from the
  queue_state counters, split as the /metrics gauges split them (their own
  code: queue_gauges);
- the oldest waiting task of a queue: one index-ordered LIMIT 1 subquery per
  (key_ready, priority) range of idx_task_dispatch, the smallest of them;
- starts and results per minute from the tasks.QueueMinute rollup, which the
  engine writes in the transactions that approve starts and record results;
- a key's token history along idx_attempt_ckey, newest lease first;
- a task's dependencies from its own depends_on, and its dependents along
  idx_dependency_parent (depends_on_id, settled, id), a page at a time.

Nothing here scans the task or attempt table."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import OuterRef, Subquery
from django.utils import timezone

from console.metrics_view import queue_gauges
from orbit.models import Application, Namespace
from queues.models import Queue
from tasks.models import Attempt, Task, TaskDependency, TaskState

PRIORITIES = range(10)  # tasks.serializers: 0-9
CHART_MINUTES = 60
# The dashboard charts at most this many queues (the most unfinished first).
DASHBOARD_QUEUES = 24
STATES = ("BLOCKED", "WAITING", "LEASED", "RUNNING", "NEEDS_REVIEW")


@dataclass
class QueueRow:
    id: str
    name: str
    namespace_id: str
    namespace: str
    paused: bool
    retired_at: datetime | None
    max_concurrency: int
    rate_per_second: int
    blocked: int = 0
    waiting: int = 0
    leased: int = 0
    running: int = 0
    needs_review: int = 0
    unfinished: int = 0
    active_permits: int = 0
    window_count: int = 0
    oldest_waiting_at: datetime | None = None
    starts: list[int] = field(default_factory=list)
    results: list[int] = field(default_factory=list)

    @property
    def by_state(self) -> dict[str, int]:
        return {
            "BLOCKED": self.blocked,
            "WAITING": self.waiting,
            "LEASED": self.leased,
            "RUNNING": self.running,
            "NEEDS_REVIEW": self.needs_review,
        }

    def oldest_waiting_seconds(self, now: datetime) -> float | None:
        if self.oldest_waiting_at is None:
            return None
        return max(0.0, (now - self.oldest_waiting_at).total_seconds())


def queue_rows(queue_ids: list[str] | None = None) -> list[QueueRow]:
    """The queues (all, or these), with the gauges /metrics reports for them."""
    found = Queue.objects.values_list(
        "id", "namespace_id", "name", "retired_at", "paused", "max_concurrency", "rate_per_second"
    ).order_by("id")
    if queue_ids is not None:
        found = found.filter(id__in=queue_ids)
    queues = list(found)
    namespaces = {
        row[0]: row
        for row in Namespace.objects.filter(id__in={q[1] for q in queues}).values_list(
            "id", "application_id", "environment", "name"
        )
    }
    applications = dict(
        Application.objects.filter(id__in={n[1] for n in namespaces.values()}).values_list("id", "name")
    )
    # The gauges name a queue by its labels (application, environment, namespace, queue).
    gauges = {gauge.labels: gauge for gauge in queue_gauges()} if queues else {}
    rows = []
    for queue_id, namespace_id, name, retired_at, paused, max_concurrency, rate_per_second in queues:
        namespace = namespaces.get(namespace_id, (namespace_id, "", "", namespace_id))
        row = QueueRow(
            id=queue_id,
            name=name,
            namespace_id=namespace_id,
            namespace=f"{namespace[2]}/{namespace[3]}",
            paused=paused,
            retired_at=retired_at,
            max_concurrency=max_concurrency,
            rate_per_second=rate_per_second,
        )
        gauge = gauges.get((applications.get(namespace[1], ""), namespace[2], namespace[3], name))
        if gauge is not None:
            row.blocked, row.waiting = gauge.blocked, gauge.waiting
            row.leased, row.running = gauge.leased, gauge.running
            row.needs_review, row.unfinished = gauge.needs_review, gauge.unfinished
            row.active_permits, row.window_count = gauge.active_permits, gauge.window_count
        rows.append(row)
    waiting = [row.id for row in rows if row.waiting]
    oldest = oldest_waiting(waiting)
    for row in rows:
        row.oldest_waiting_at = oldest.get(row.id)
    return rows


def oldest_waiting(queue_ids: list[str]) -> dict[str, datetime]:
    """Per queue, the smallest available_at of its WAITING tasks: idx_task_dispatch
    (queue_id, state, key_ready, -priority, available_at, id) orders each
    (queue, WAITING, key_ready, priority) range by available_at, so each range's
    first row is one LIMIT 1 read; the oldest is the smallest of the 20."""
    if not queue_ids:
        return {}
    ranges = {
        f"w_{int(ready)}_{priority}": Subquery(
            Task.objects.filter(queue_id=OuterRef("id"), state=TaskState.WAITING, key_ready=ready, priority=priority)
            .order_by("available_at")
            .values("available_at")[:1]
        )
        for ready in (True, False)
        for priority in PRIORITIES
    }
    found: dict[str, datetime] = {}
    for start in range(0, len(queue_ids), 100):
        for row in Queue.objects.filter(id__in=queue_ids[start : start + 100]).annotate(**ranges).values("id", *ranges):
            times = [row[name] for name in ranges if row[name] is not None]
            if times:
                found[row["id"]] = min(times)
    return found


@functools.cache
def _rollup_table_exists() -> bool:
    try:
        from tasks.models import QueueMinute
    except ImportError:
        return False
    return QueueMinute._meta.db_table in connection.introspection.table_names()


def rollup_available() -> bool:
    """The per-minute rollup (tasks.QueueMinute) is there to read."""
    return _rollup_table_exists()


def minute_series(queue_ids: list[str], now: datetime) -> dict[str, tuple[list[int], list[int]]]:
    """Starts and results per minute of each queue over the last CHART_MINUTES
    minutes, oldest first (the current minute last), from the rollup's
    (queue_id, minute) unique index."""
    if not queue_ids or not rollup_available():
        return {}
    from tasks.models import QueueMinute

    current = now.replace(second=0, microsecond=0)
    first = current - timedelta(minutes=CHART_MINUTES - 1)
    series = {queue_id: ([0] * CHART_MINUTES, [0] * CHART_MINUTES) for queue_id in queue_ids}
    for queue_id, minute, starts, results in QueueMinute.objects.filter(
        queue_id__in=queue_ids, minute__gte=first, minute__lte=current
    ).values_list("queue_id", "minute", "starts", "results"):
        index = int((minute - first).total_seconds() // 60)
        if 0 <= index < CHART_MINUTES:
            series[queue_id][0][index] += starts
            series[queue_id][1][index] += results
    return series


# --------------------------------------------------------------------------- charts

STATE_COLOURS = {
    "BLOCKED": "#9673a6",
    "WAITING": "#6c8ebf",
    "LEASED": "#d6b656",
    "RUNNING": "#82b366",
    "NEEDS_REVIEW": "#b85450",
}


def state_bar(row: QueueRow, width: int = 240, height: int = 14) -> dict[str, Any]:
    """A stacked bar: the queue's unfinished tasks by state."""
    total = sum(row.by_state.values())
    parts, x = [], 0.0
    for state, count in row.by_state.items():
        if not count:
            continue
        w = width * count / total
        parts.append({"state": state, "count": count, "x": round(x, 2), "w": round(w, 2), "fill": STATE_COLOURS[state]})
        x += w
    return {"width": width, "height": height, "parts": parts, "total": total}


def use_bar(used: int, limit: int, width: int = 160, height: int = 12) -> dict[str, Any]:
    """A bar of `used` against `limit` (permits of max_concurrency, starts of the rate)."""
    share = min(1.0, used / limit) if limit else 0.0
    return {
        "width": width,
        "height": height,
        "used": used,
        "limit": limit,
        "w": round(width * share, 2),
        "percent": round(100 * share),
        "fill": "#b85450" if share >= 1 else "#d6b656" if share >= 0.8 else "#82b366",
    }


def minute_chart(starts: list[int], results: list[int], width: int = 300, height: int = 60) -> dict[str, Any]:
    """Starts as bars, results as a line, per minute over the last hour."""
    top = max([*starts, *results, 1])
    step = width / CHART_MINUTES
    bars = [
        {"x": round(i * step, 2), "h": round(height * n / top, 2), "y": round(height - height * n / top, 2), "n": n}
        for i, n in enumerate(starts)
        if n
    ]
    line = " ".join(
        f"{round(i * step + step / 2, 2)},{round(height - height * n / top, 2)}" for i, n in enumerate(results)
    )
    return {
        "width": width,
        "height": height,
        "bar_width": round(max(1.0, step - 1), 2),
        "bars": bars,
        "line": line,
        "top": top,
        "starts": sum(starts),
        "results": sum(results),
    }


def dashboard(now: datetime | None = None) -> dict[str, Any]:
    """The dashboard's figures: every queue's counters, the busiest charted."""
    now = now or timezone.now()
    rows = [row for row in queue_rows() if row.retired_at is None or row.unfinished]
    rows.sort(key=lambda row: (-row.unfinished, row.namespace, row.name))
    charted = rows[:DASHBOARD_QUEUES]
    series = minute_series([row.id for row in charted], now)
    cards = []
    for row in charted:
        starts, results = series.get(row.id, ([], []))
        cards.append(
            {
                "queue": row,
                "states": state_bar(row),
                "permits": use_bar(row.active_permits, row.max_concurrency),
                "window": use_bar(row.window_count + row.leased, row.rate_per_second),
                "window_started": row.window_count,
                "minutes": minute_chart(starts, results) if row.id in series else None,
                "oldest_waiting_seconds": row.oldest_waiting_seconds(now),
            }
        )
    totals = {state: sum(row.by_state[state] for row in rows) for state in STATES}
    return {
        "now": now,
        "cards": cards,
        "queues": len(rows),
        "uncharted": len(rows) - len(charted),
        "totals": totals,
        "total_bar": state_bar(
            QueueRow(
                id="",
                name="",
                namespace_id="",
                namespace="",
                paused=False,
                retired_at=None,
                max_concurrency=0,
                rate_per_second=0,
                blocked=totals["BLOCKED"],
                waiting=totals["WAITING"],
                leased=totals["LEASED"],
                running=totals["RUNNING"],
                needs_review=totals["NEEDS_REVIEW"],
            ),
            width=600,
            height=22,
        ),
        "rollup": rollup_available(),
        "chart_minutes": CHART_MINUTES,
    }


# --------------------------------------------------------------------------- keys and tasks

TOKEN_HISTORY = 100
KEY_WAITING_SHOWN = 20


def key_history(namespace_id: str, key: str, limit: int = TOKEN_HISTORY) -> list[Attempt]:
    """The key's attempts, newest lease first (idx_attempt_ckey)."""
    return list(Attempt.objects.filter(namespace_id=namespace_id, concurrency_key=key).order_by("-leased_at")[:limit])


def key_waiting_tasks(namespace_id: str, key: str, limit: int = KEY_WAITING_SHOWN) -> list[Task]:
    """The first WAITING tasks of the key, queue by queue in lease order (idx_task_ns_ckey)."""
    return list(
        Task.objects.filter(namespace_id=namespace_id, concurrency_key=key, state=TaskState.WAITING)
        .order_by("queue_id", "-priority", "available_at", "id")
        .defer("payload", "output", "last_error")[:limit]
    )


def task_attempts(task_id: str, limit: int = 200) -> list[Attempt]:
    """A task's attempts in lease order (idx_attempt_task_epoch)."""
    return list(Attempt.objects.filter(task_id=task_id).order_by("epoch")[:limit])


# --------------------------------------------------------------------------- dependencies

# Rows of a task page's dependency and dependent tables.
DEPENDENCIES_PER_PAGE = 100
# A task's dependents are counted this far (a fan-out has no upper bound).
DEPENDENTS_COUNT_CAP = 100_000
# Dependencies and dependents drawn each way in the task's graph.
GRAPH_NODES = 20


@dataclass
class Linked:
    """A task at the other end of one of a task's dependency edges. state
    None: the task is gone (pruned)."""

    task_id: str
    state: str | None = None
    handler: str = ""
    queue_id: str = ""
    blocked_by: int = 0
    on_dependency_failure: str = ""
    # Whether the edge is settled: the dependency's ending has been counted.
    settled: bool = False
    queue_name: str = ""


@dataclass
class LinkedPage:
    rows: list[Linked]
    number: int
    per_page: int
    count: int
    capped: bool = False

    @property
    def first_index(self) -> int:
        return (self.number - 1) * self.per_page + 1 if self.rows else 0

    @property
    def last_index(self) -> int:
        return self.first_index + len(self.rows) - 1 if self.rows else 0

    @property
    def has_next(self) -> bool:
        return self.number * self.per_page < self.count

    @property
    def pages(self) -> int:
        return max(1, -(-self.count // self.per_page))


@dataclass
class TaskDependencies:
    dependencies: LinkedPage
    dependents: LinkedPage
    # The graph's nodes each way, in table order: the first GRAPH_NODES.
    parents: list[Linked]
    children: list[Linked]
    # A BLOCKED task's first GRAPH_NODES dependencies not settled yet, in depends_on order.
    waiting_for: list[Linked]


def page_number(value: str | None) -> int:
    """A ?…_page= value: anything but a positive number is the first page."""
    try:
        number = int(value or 1)
    except ValueError:
        return 1
    return max(1, min(number, 1_000_000))


def task_dependencies(
    task: Task, dependencies_page: int = 1, dependents_page: int = 1, per_page: int = DEPENDENCIES_PER_PAGE
) -> TaskDependencies:
    """The task's dependencies (depends_on order) and dependents (the edges
    still to settle first, then in edge order), a page of each, and the
    first GRAPH_NODES each way for its graph, and what a BLOCKED task still
    waits for. At most seven queries whatever the fan-out: the dependents are counted up to DEPENDENTS_COUNT_CAP along
    the index and only the shown ones are read."""
    depends_on = list(task.depends_on or [])
    dependency_pages = max(1, -(-len(depends_on) // per_page))
    dependencies_page = min(dependencies_page, dependency_pages)
    shown_parents = depends_on[(dependencies_page - 1) * per_page : dependencies_page * per_page]
    drawn_parents = depends_on[:GRAPH_NODES]

    edges = TaskDependency.objects.filter(depends_on_id=task.id)
    count = edges.order_by()[:DEPENDENTS_COUNT_CAP].count()
    dependent_pages = max(1, -(-count // per_page))
    dependents_page = min(dependents_page, dependent_pages)
    # (depends_on_id, settled, id): idx_dependency_parent orders it, no sort.
    ordered = edges.order_by("settled", "id").values_list("task_id", "settled")
    offset = (dependents_page - 1) * per_page
    shown_children = list(ordered[offset : offset + per_page]) if count else []
    drawn_children = shown_children[:GRAPH_NODES] if offset == 0 else list(ordered[:GRAPH_NODES])

    parent_edges = set(shown_parents) | set(drawn_parents)
    settled_parents = (
        dict(
            TaskDependency.objects.filter(task_id=task.id, depends_on_id__in=sorted(parent_edges)).values_list(
                "depends_on_id", "settled"
            )
        )
        if parent_edges
        else {}
    )
    # The edges a BLOCKED task's blocked_by counts (its unique index narrows them to its own, at most 1,000).
    waiting_for = (
        list(
            TaskDependency.objects.filter(task_id=task.id, settled=False)
            .order_by("position")
            .values_list("depends_on_id", flat=True)[:GRAPH_NODES]
        )
        if task.state == TaskState.BLOCKED and depends_on
        else []
    )
    wanted = (
        parent_edges
        | set(waiting_for)
        | {task_id for task_id, _ in shown_children}
        | {task_id for task_id, _ in drawn_children}
    )
    found = linked_tasks(wanted)

    def linked(task_id: str, settled: bool) -> Linked:
        row = found.get(task_id)
        return Linked(task_id=task_id, settled=settled) if row is None else replace(row, settled=settled)

    return TaskDependencies(
        dependencies=LinkedPage(
            rows=[linked(p, settled_parents.get(p, False)) for p in shown_parents],
            number=dependencies_page,
            per_page=per_page,
            count=len(depends_on),
        ),
        dependents=LinkedPage(
            rows=[linked(c, settled) for c, settled in shown_children],
            number=dependents_page,
            per_page=per_page,
            count=count,
            capped=count >= DEPENDENTS_COUNT_CAP,
        ),
        parents=[linked(p, settled_parents.get(p, False)) for p in drawn_parents],
        children=[linked(c, settled) for c, settled in drawn_children],
        waiting_for=[linked(p, False) for p in waiting_for],
    )


def linked_tasks(task_ids: set[str]) -> dict[str, Linked]:
    """These tasks (those still there) with their queues' names: two queries."""
    if not task_ids:
        return {}
    rows = list(
        Task.objects.filter(id__in=sorted(task_ids)).values_list(
            "id", "state", "handler", "queue_id", "blocked_by", "on_dependency_failure"
        )
    )
    names = dict(Queue.objects.filter(id__in={row[3] for row in rows}).values_list("id", "name"))
    return {
        task_id: Linked(
            task_id=task_id,
            state=state,
            handler=handler,
            queue_id=queue_id,
            blocked_by=blocked_by,
            on_dependency_failure=on_failure,
            queue_name=names.get(queue_id, queue_id),
        )
        for task_id, state, handler, queue_id, blocked_by, on_failure in rows
    }


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"
