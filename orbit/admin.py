from django.contrib import admin

from orbit.admin_base import ReadOnlyAdmin, fixed_choices_filter
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
