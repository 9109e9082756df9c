from django.contrib import admin

from orbit.admin_base import ReadOnlyAdmin
from queues.models import Queue, QueueState


@admin.register(Queue)
class QueueAdmin(ReadOnlyAdmin):
    list_display = (
        "name",
        "id",
        "namespace_id",
        "paused",
        "max_concurrency",
        "rate_per_second",
        "max_unfinished_tasks",
        "revision",
        "retired_at",
    )
    list_filter = ("paused",)
    exact_search_fields = ("id", "name")


@admin.register(QueueState)
class QueueStateAdmin(ReadOnlyAdmin):
    """The backlog view: unfinished tasks, permits and the start window per queue."""

    list_display = (
        "queue_id",
        "unfinished_tasks",
        "active_permits",
        "reserved_starts",
        "window_started_at",
        "window_count",
        "accepting",
    )
    ordering = ("-unfinished_tasks",)
