from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.http import HttpRequest

from console.admin_base import ReadOnlyAdmin, fixed_choices_filter
from orbit.audit import AUDIT_ACTIONS
from orbit.models import Application, ApplicationState, AuditEntry, Credential, Event, Namespace


@admin.register(Application)
class ApplicationAdmin(ReadOnlyAdmin):
    list_display = ("name", "id", "max_active_attempts", "max_unfinished_tasks", "revision")


@admin.register(ApplicationState)
class ApplicationStateAdmin(ReadOnlyAdmin):
    list_display = ("application_id", "active_attempts", "unfinished_tasks")


@admin.register(Namespace)
class NamespaceAdmin(ReadOnlyAdmin):
    list_display = ("name", "environment", "id", "application_id")


@admin.register(Credential)
class CredentialAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "namespace_id", "created_at", "revoked_at")
    exclude = ("secret_hash",)


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "action", "target_type", "target_id", "credential_id", "reason")
    list_filter = (fixed_choices_filter("action", AUDIT_ACTIONS),)


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    """Newest first, unfiltered: a filter by type would scan the table (no
    index on a table written in every state change) for the rare types."""

    list_display = ("id", "seq", "created_at", "type", "subject_id", "namespace_id")
    sortable_by = ("id",)


# The console's first page is the dashboard (templates/admin/orbit_dashboard.html).
admin.site.site_header = "Orbit console"
admin.site.site_title = "Orbit console"
admin.site.index_title = "Dashboard"
admin.site.index_template = "admin/orbit_dashboard.html"
# The console has no public site: "View site" led to a 404.
admin.site.site_url = None
# The console's own top navigation; Django's sidebar took 300 px of a
# 1440 px window and cut the task and attempt lists off after two columns.
admin.site.enable_nav_sidebar = False


class SuperusersOnly:
    """Django's own users and groups: seen and managed by superusers only
    (a staff user granted auth permissions still cannot)."""

    def has_module_permission(self, request: HttpRequest) -> bool:
        return request.user.is_active and request.user.is_superuser

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_active and request.user.is_superuser

    def has_add_permission(self, request: HttpRequest, *args: Any) -> bool:
        return request.user.is_active and request.user.is_superuser

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_active and request.user.is_superuser

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_active and request.user.is_superuser


class SuperuserUserAdmin(SuperusersOnly, UserAdmin):
    pass


class SuperuserGroupAdmin(SuperusersOnly, GroupAdmin):
    pass


for model, model_admin in ((User, SuperuserUserAdmin), (Group, SuperuserGroupAdmin)):
    if admin.site.is_registered(model):
        admin.site.unregister(model)
    admin.site.register(model, model_admin)
