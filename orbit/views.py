"""HTTP views of the orbit app's own resources: the application (its quotas)
and the namespace's event log (SPEC §7)."""

from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from orbit import applications
from orbit.api.fields import canonical_uint64
from orbit.api.mutations import mutation
from orbit.api.responses import ok
from orbit.api.schema import PAGE_SIZE, documented, uint64_query
from orbit.api.views import OrbitView, page_size_of
from orbit.audit import event_page
from orbit.errors import InvalidArgument
from orbit.principal import Actor
from orbit.serializers import ApplicationConfigureInput


class ApplicationDetailView(OrbitView):
    @documented(data="Application", operation_id="applications_get")
    def get(self, request: Request, application_id: str) -> Response:
        """Get an application.

        The application's quotas over all its namespaces (max_active_attempts,
        max_unfinished_tasks) and its revision (applications:manage)."""
        principal = self.principal(request)
        principal.require("applications:manage")
        return ok(request, applications.application_get(principal=principal, application_id=application_id))


class ApplicationConfigureView(OrbitView):
    @mutation(
        ApplicationConfigureInput,
        scope="applications:manage",
        operation="application.configure",
        data="ApplicationReceipt",
        operation_id="applications_configure",
    )
    def post(self, actor: Actor, fields: dict[str, Any], application_id: str) -> tuple[int, dict[str, Any]]:
        """Configure an application's quotas.

        Sets max_active_attempts and max_unfinished_tasks with the revision it was read at
        (another one is 409 STATE_CONFLICT) and a reason for the audit log."""
        application = applications.application_configure(
            actor=actor,
            application_id=application_id,
            expected_revision=fields["expected_revision"],
            reason=fields["reason"],
            limits=applications.ApplicationLimits(
                max_active_attempts=fields["max_active_attempts"],
                max_unfinished_tasks=fields["max_unfinished_tasks"],
            ),
        )
        return 200, {"application": application}


def cursor_of(request: Request) -> int:
    raw = request.query_params.get("after")
    if raw is None:
        return 0
    cursor = canonical_uint64(raw)
    if cursor is None:
        raise InvalidArgument("after: must be an event cursor (a decimal string)")
    return cursor


class EventListView(OrbitView):
    @documented(
        data="EventPage",
        operation_id="events_list",
        extra_parameters=(uint64_query("after", "cursor of the last event read"), PAGE_SIZE),
    )
    def get(self, request: Request) -> Response:
        """List events.

        The namespace's event log after a cursor, oldest first (tasks:read and queues:read over
        every queue): read on from next_cursor; an empty page means no newer
        event yet."""
        principal = self.principal(request)
        principal.require("tasks:read", "queues:read")
        principal.require_all_queues()
        after = cursor_of(request)
        items = event_page(principal=principal, after=after, limit=page_size_of(request))
        return ok(request, {"items": items, "next_cursor": items[-1]["cursor"] if items else str(after)})
