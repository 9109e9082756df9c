from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from console import data
from console.admin_base import ReadOnlyAdmin, change_url, format_ms, link, may_view, short_id, viewable
from orbit.models import Namespace
from queues.models import Queue, QueueState
from tasks.models import Task


@admin.register(Queue)
class QueueAdmin(ReadOnlyAdmin):
    """One row per queue: its backlog by state (BLOCKED included), permits, start window and the
    oldest waiting task, from the counters and index-ordered LIMIT reads
    (console.data), and a link to its tasks."""

    list_display = (
        "name",
        "namespace",
        "status",
        "blocked",
        "waiting",
        "leased",
        "running",
        "needs_review",
        "permits",
        "start_window",
        "oldest_waiting",
        "tasks",
    )
    list_filter = ("paused",)
    exact_search_fields = ("id", "name")
    readonly_fields = ("console_figures",)

    def decorate_results(self, request: HttpRequest, queues: list[Queue]) -> None:
        rows = {row.id: row for row in data.queue_rows([queue.id for queue in queues])}
        now = timezone.now()
        # The rows carry their figures to the columns below (read back with getattr).
        for queue in queues:
            queue.console = rows.get(queue.id)  # type: ignore[attr-defined]
            queue.console_now = now  # type: ignore[attr-defined]

    @staticmethod
    def _row(queue: Queue) -> data.QueueRow | None:
        return getattr(queue, "console", None)

    @admin.display(description="namespace")
    def namespace(self, queue: Queue) -> SafeString:
        if not viewable(queue, Namespace):
            # The queue's own column; the namespace's name and page are the namespace's.
            return short_id(queue.namespace_id)
        row = self._row(queue)
        return link(change_url(Namespace, queue.namespace_id), row.namespace if row else queue.namespace_id)

    @admin.display(description="state")
    def status(self, queue: Queue) -> str:
        if queue.retired_at is not None:
            return f"retired {format_ms(queue.retired_at)}"
        # Plain words, the normal state unmarked: Django's red ✗ for
        # paused=False read as an alarm on a queue that is running.
        return "paused" if queue.paused else "running"

    def _count(self, queue: Queue, name: str) -> str:
        row = self._row(queue)
        return f"{getattr(row, name):,}" if row else "—"

    @admin.display(description="BLOCKED")
    def blocked(self, queue: Queue) -> str:
        return self._count(queue, "blocked")

    @admin.display(description="WAITING")
    def waiting(self, queue: Queue) -> str:
        return self._count(queue, "waiting")

    @admin.display(description="LEASED")
    def leased(self, queue: Queue) -> str:
        return self._count(queue, "leased")

    @admin.display(description="RUNNING")
    def running(self, queue: Queue) -> str:
        return self._count(queue, "running")

    @admin.display(description="NEEDS_REVIEW")
    def needs_review(self, queue: Queue) -> str:
        return self._count(queue, "needs_review")

    @admin.display(description="permits")
    def permits(self, queue: Queue) -> str:
        row = self._row(queue)
        return f"{row.active_permits:,} of {queue.max_concurrency:,}" if row else "—"

    @admin.display(description="starts this window")
    def start_window(self, queue: Queue) -> str:
        row = self._row(queue)
        return f"{row.window_count:,} of {queue.rate_per_second:,}/s" if row else "—"

    @admin.display(description="oldest waiting")
    def oldest_waiting(self, queue: Queue) -> str:
        row = self._row(queue)
        if row is None:
            return "—"
        return data.human_age(row.oldest_waiting_seconds(getattr(queue, "console_now", timezone.now())))

    @admin.display(description="tasks")
    def tasks(self, queue: Queue) -> SafeString | str:
        if not viewable(queue, Task):
            return "—"
        return link(reverse("admin:tasks_task_changelist") + f"?q={queue.id}", "tasks")

    @admin.display(description="now")
    def console_figures(self, queue: Queue) -> SafeString:
        # No row: None (mypy would type the [None] by the list on the left).
        (row,) = data.queue_rows([queue.id]) or [None]  # type: ignore[list-item]
        if row is None:
            return format_html("—")
        now = timezone.now()
        # The link to its tasks for a user who may view them; the figures are the queue's.
        tasks = (
            format_html(" · {}", link(reverse("admin:tasks_task_changelist") + f"?q={queue.id}", "its tasks"))
            if viewable(queue, Task)
            else ""
        )
        return format_html(
            "BLOCKED {} · WAITING {} · LEASED {} · RUNNING {} · NEEDS_REVIEW {} · permits {} of {}"
            " · starts this window {} of {}/s · oldest waiting {}{}",
            f"{row.blocked:,}",
            f"{row.waiting:,}",
            f"{row.leased:,}",
            f"{row.running:,}",
            f"{row.needs_review:,}",
            f"{row.active_permits:,}",
            f"{row.max_concurrency:,}",
            f"{row.window_count:,}",
            f"{row.rate_per_second:,}",
            data.human_age(row.oldest_waiting_seconds(now)),
            tasks,
        )

    # A list of field names is one of the layouts Django takes (the stubs' list is invariant).
    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:  # type: ignore[override]
        # Its state in words where the paused flag was.
        return ["console_figures", *["status" if f.name == "paused" else f.name for f in Queue._meta.fields]]


@admin.register(QueueState)
class QueueStateAdmin(ReadOnlyAdmin):
    """The backlog view: unfinished tasks, permits and the start window per queue."""

    list_display = (
        "queue",
        "unfinished_tasks",
        "active_permits",
        "reserved_starts",
        "window_started_at",
        "window_count",
        "accepting",
    )
    ordering = ("-unfinished_tasks",)

    def decorate_results(self, request: HttpRequest, states: list[QueueState]) -> None:
        if not may_view(request, Queue):
            return
        names = dict(Queue.objects.filter(id__in=[s.queue_id for s in states]).values_list("id", "name"))
        for state in states:
            state.queue_name = names.get(state.queue_id, state.queue_id)  # type: ignore[attr-defined]  # read by queue()

    @admin.display(description="queue")
    def queue(self, state: QueueState) -> SafeString:
        if not viewable(state, Queue):
            # Its own key column; the queue's name and page are the queue's.
            return short_id(state.queue_id)
        name = getattr(state, "queue_name", state.queue_id)
        return link(reverse("admin:queues_queue_change", args=[state.queue_id]), name)
