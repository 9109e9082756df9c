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
    search_fields = ("=id", "=queue_id", "=concurrency_key", "=business_key")


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
    search_fields = ("=task_id", "=concurrency_key", "=worker_id")
    ordering = ("-leased_at",)


@admin.register(ConcurrencyKey)
class ConcurrencyKeyAdmin(ReadOnlyAdmin):
    list_display = ("key", "namespace_id", "version", "holder_attempt_id", "holder_task_id", "updated_at")
    search_fields = ("=key",)
