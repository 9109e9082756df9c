"""The key policies' page (SPEC §12): read only, like every Orbit page; the
policy verbs (tasks.actions.policies) are the only writers."""

from __future__ import annotations

from django.contrib import admin

from console.admin_base import ReadOnlyAdmin, format_ms
from tasks.models import KeyPolicy


@admin.register(KeyPolicy)
class KeyPolicyAdmin(ReadOnlyAdmin):
    """One row per policy, retired ones too: what it matches, the capacity and
    rate each matching key gets, its revision and whether it is live."""

    list_display = ("match", "namespace_id", "capacity", "rate", "revision", "state", "updated_at")
    exact_search_fields = ("id",)
    namespaced_search_fields = ("match_value",)
    ordering = ("id",)

    def object_label(self, obj: KeyPolicy) -> str:
        return self.match(obj)

    @admin.display(description="match")
    def match(self, policy: KeyPolicy) -> str:
        return f"{policy.match_kind} {policy.match_value}"

    @admin.display(description="rate")
    def rate(self, policy: KeyPolicy) -> str:
        if policy.rate_starts is None or policy.rate_per_seconds is None:
            return "—"
        return f"{policy.rate_starts:,} per {policy.rate_per_seconds:,} s, burst {policy.rate_burst or 1:,}"

    @admin.display(description="state")
    def state(self, policy: KeyPolicy) -> str:
        # Plain words, as the queue page says them: not Django's ✓/✗ of the live flag.
        return f"retired {format_ms(policy.retired_at)}" if policy.retired_at is not None else "live"
