from django.contrib import admin

from orbit.admin_base import ReadOnlyAdmin
from tasks.models import Attempt, ConcurrencyKey, Task


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "queue_id",
        "handler",
        "state",
        "priority",
        "attempts",
        "concurrency_key",
        "available_at",
        "created_at",
    )
    list_filter = ("state",)
    exact_search_fields = ("id", "queue_id")
    namespaced_search_fields = ("concurrency_key", "business_key")
    sortable_by = ()


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    """Token history: every attempt of a key with its token, in lease order."""

    list_display = (
        "id",
        "task_id",
        "state",
        "epoch",
        "number",
        "concurrency_key",
        "concurrency_token",
        "worker_id",
        "leased_at",
        "started_at",
        "finished_at",
    )
    list_filter = ("state",)
    exact_search_fields = ("task_id", "worker_id")
    namespaced_search_fields = ("concurrency_key",)
    ordering = ("-leased_at",)
    sortable_by = ("leased_at",)


@admin.register(ConcurrencyKey)
class ConcurrencyKeyAdmin(ReadOnlyAdmin):
    list_display = ("key", "namespace_id", "version", "holder_attempt_id", "holder_task_id", "updated_at")
    namespaced_search_fields = ("key",)
