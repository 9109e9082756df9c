from django.contrib import admin

from console.admin_base import ReadOnlyAdmin, fixed_choices_filter
from plans.models import Plan, PlanState, PlanTrigger, PlanVersion


@admin.register(Plan)
class PlanAdmin(ReadOnlyAdmin):
    list_display = ("name", "id", "namespace_id", "queue_id", "state", "version", "revision", "next_fire_at")
    list_filter = (fixed_choices_filter("state", tuple(PlanState.values)),)
    exact_search_fields = ("id", "name", "queue_id")


@admin.register(PlanVersion)
class PlanVersionAdmin(ReadOnlyAdmin):
    list_display = ("plan_id", "version", "schedule", "misfire", "anchor_at")
    exact_search_fields = ("plan_id",)
    sortable_by = ()


@admin.register(PlanTrigger)
class PlanTriggerAdmin(ReadOnlyAdmin):
    """Every decided point, newest first: what each plan made or skipped, and why."""

    list_display = ("plan_id", "scheduled_at", "version", "outcome", "task_id", "reason", "created_at")
    exact_search_fields = ("plan_id", "task_id")
    ordering = ("-id",)
    sortable_by = ()
