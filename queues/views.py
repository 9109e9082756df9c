from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api.responses import ok, page
from orbit.api.schema import documented
from orbit.api.views import OrbitView, decode_page_token, encode_page_token, page_size_of, validated
from orbit.idempotency import Actor
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

    @documented(QueueCreateInput, data="QueueReceipt", created=True, idempotent=True)
    def post(self, request: Request) -> Response:
        principal = self.principal(request)
        principal.require("queues:manage")
        principal.require_all_queues()

        def effect(actor: Actor, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            queue = actions.queue_create(actor=actor, name=fields["name"], limits=limits_of(fields))
            return 201, {"queue": queue}

        return self.mutate(
            request,
            operation="queue.create",
            target="",
            validate=lambda body: validated(QueueCreateInput, body),
            effect=effect,
        )


class QueueDetailView(OrbitView):
    @documented(data="Queue")
    def get(self, request: Request, queue_id: str) -> Response:
        principal = self.principal(request)
        principal.require("queues:read")
        return ok(request, actions.queue_get(principal=principal, queue_id=queue_id))


class QueueConfigureView(OrbitView):
    @documented(QueueConfigureInput, data="QueueReceipt", idempotent=True)
    def post(self, request: Request, queue_id: str) -> Response:
        principal = self.principal(request)
        principal.require("queues:manage")
        principal.require_queue(queue_id)

        def effect(actor: Actor, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            queue = actions.queue_configure(
                actor=actor,
                queue_id=queue_id,
                expected_revision=fields["expected_revision"],
                reason=fields["reason"],
                paused=fields["paused"],
                limits=limits_of(fields),
            )
            return 200, {"queue": queue}

        return self.mutate(
            request,
            operation="queue.configure",
            target=queue_id,
            validate=lambda body: validated(QueueConfigureInput, body),
            effect=effect,
        )


class QueueRetireView(OrbitView):
    @documented(QueueRetireInput, data="QueueReceipt", idempotent=True)
    def post(self, request: Request, queue_id: str) -> Response:
        principal = self.principal(request)
        principal.require("queues:manage")
        principal.require_queue(queue_id)

        def effect(actor: Actor, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            queue = actions.queue_retire(
                actor=actor, queue_id=queue_id, expected_revision=fields["expected_revision"], reason=fields["reason"]
            )
            return 200, {"queue": queue}

        return self.mutate(
            request,
            operation="queue.retire",
            target=queue_id,
            validate=lambda body: validated(QueueRetireInput, body),
            effect=effect,
        )
