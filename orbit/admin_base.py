"""Read-only Django admin: operators inspect, the verbs change.

Every counter and permit changes only through the actions modules; the admin
never writes, so it cannot break an invariant."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest


class ReadOnlyAdmin(admin.ModelAdmin):
    list_per_page = 100
    show_full_result_count = False  # COUNT(*) over millions of tasks on every page is not inspection

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
