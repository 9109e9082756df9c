from django.contrib import admin

from console.admin_base import ReadOnlyAdmin
from tasks.models import WorkerIdentity


@admin.register(WorkerIdentity)
class WorkerIdentityAdmin(ReadOnlyAdmin):
    list_display = ("worker_id", "namespace_id", "concurrency_keys", "session_id", "connected_at")
    exact_search_fields = ("worker_id",)
