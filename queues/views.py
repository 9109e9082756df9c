from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api.mutations import mutation
from orbit.api.responses import ok, page
from orbit.api.schema import documented
from orbit.api.views import OrbitView, decode_page_token, encode_page_token, page_size_of
from orbit.principal import Actor, Principal
from queues import actions
from queues.serializers import QueueConfigureInput, QueueCreateInput, QueueRetireInput


def limits_of(fields: dict[str, Any]) -> actions.QueueLimits:
    return actions.QueueLimits(
        max_concurrency=fields["max_concurrency"],
        rate_per_second=fields["rate_per_second"],
        max_unfinished_tasks=fields.get("max_unfinished_tasks", 0),
    )


class QueueCollectionView(OrbitView):
    @documented(data="QueuePage", operation_id="queues_list", paged=True)
    def get(self, request: Request) -> Response:
        principal = self.principal(request)
        principal.require("queues:read")
        items, last_id = actions.queue_list(
            principal=principal, after_id=decode_page_token(request), limit=page_size_of(request)
        )
        return ok(request, page(items, encode_page_token(last_id) if last_id else ""))

    @mutation(
        QueueCreateInput,
        scope="queues:manage",
        operation="queue.create",
        data="QueueReceipt",
        check=Principal.require_all_queues,
        created=True,
    )
    def post(self, actor: Actor, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        queue = actions.queue_create(actor=actor, name=fields["name"], limits=limits_of(fields))
        return 201, {"queue": queue}


class QueueDetailView(OrbitView):
    @documented(data="Queue")
    def get(self, request: Request, queue_id: str) -> Response:
        principal = self.principal(request)
        principal.require("queues:read")
        return ok(request, actions.queue_get(principal=principal, queue_id=queue_id))


class QueueConfigureView(OrbitView):
    @mutation(
        QueueConfigureInput,
        scope="queues:manage",
        operation="queue.configure",
        data="QueueReceipt",
        check=Principal.require_queue,
    )
    def post(self, actor: Actor, fields: dict[str, Any], queue_id: str) -> tuple[int, dict[str, Any]]:
        queue = actions.queue_configure(
            actor=actor,
            queue_id=queue_id,
            expected_revision=fields["expected_revision"],
            reason=fields["reason"],
            paused=fields["paused"],
            limits=limits_of(fields),
        )
        return 200, {"queue": queue}


class QueueRetireView(OrbitView):
    @mutation(
        QueueRetireInput,
        scope="queues:manage",
        operation="queue.retire",
        data="QueueReceipt",
        check=Principal.require_queue,
    )
    def post(self, actor: Actor, fields: dict[str, Any], queue_id: str) -> tuple[int, dict[str, Any]]:
        queue = actions.queue_retire(
            actor=actor, queue_id=queue_id, expected_revision=fields["expected_revision"], reason=fields["reason"]
        )
        return 200, {"queue": queue}
