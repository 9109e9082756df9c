from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api.responses import ok, page
from orbit.api.views import OrbitView, decode_page_token, encode_page_token, page_size_of
from orbit.idempotency import Actor
from tasks.actions import endings, reads, submit
from tasks.serializers import CancelTaskInput, SubmitTaskInput


def validated(serializer_class: type, body: dict[str, Any]) -> dict[str, Any]:
    serializer = serializer_class(data=body)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


class TaskCollectionView(OrbitView):
    def get(self, request: Request) -> Response:
        principal = self.principal(request)
        principal.require("tasks:read")
        filters = {
            name: request.query_params[name]
            for name in ("queue_id", "state", "business_key", "concurrency_key")
            if name in request.query_params
        }
        items, last_id = reads.task_list(
            principal=principal, filters=filters, after_id=decode_page_token(request), limit=page_size_of(request)
        )
        return ok(request, page(items, encode_page_token(last_id) if last_id else ""))

    def post(self, request: Request) -> Response:
        principal = self.principal(request)
        principal.require("tasks:submit")
        body = self.body(request)
        if isinstance(body.get("queue_id"), str):
            principal.require_queue(body["queue_id"])

        def effect(actor: Actor, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            return 201, submit.submit_task(actor=actor, fields=fields)

        return self.mutate(
            request,
            operation="task.submit",
            target="",
            validate=lambda body: validated(SubmitTaskInput, body),
            effect=effect,
        )


class TaskDetailView(OrbitView):
    def get(self, request: Request, task_id: str) -> Response:
        principal = self.principal(request)
        principal.require("tasks:read")
        return ok(request, reads.task_get(principal=principal, task_id=task_id))


class TaskAttemptsView(OrbitView):
    def get(self, request: Request, task_id: str) -> Response:
        principal = self.principal(request)
        principal.require("tasks:read")
        return ok(request, page(reads.attempt_list(principal=principal, task_id=task_id), ""))


class AttemptDetailView(OrbitView):
    def get(self, request: Request, attempt_id: str) -> Response:
        principal = self.principal(request)
        principal.require("tasks:read")
        return ok(request, reads.attempt_get(principal=principal, attempt_id=attempt_id))


class TaskCancelView(OrbitView):
    def post(self, request: Request, task_id: str) -> Response:
        principal = self.principal(request)
        principal.require("tasks:cancel")
        reads.visible_task(principal, task_id)

        def effect(actor: Actor, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            return 200, endings.cancel_task(actor=actor, task_id=task_id, reason=fields["reason"])

        return self.mutate(
            request,
            operation="task.cancel",
            target=task_id,
            validate=lambda body: validated(CancelTaskInput, body),
            effect=effect,
        )
