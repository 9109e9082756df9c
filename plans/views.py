from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api.mutations import mutation
from orbit.api.responses import ok, page
from orbit.api.schema import documented
from orbit.api.views import OrbitView, decode_page_token, encode_page_token, page_size_of
from orbit.principal import Actor
from plans import actions
from plans.serializers import PlanChangeInput, PlanCreateInput, PlanUpdateInput


def body_of(fields: dict[str, Any], body: dict[str, Any]) -> actions.PlanBody:
    """Schedule and misfire as validated; the definition as sent (it is
    validated again, with its defaults, each time a task is made from it)."""
    return actions.PlanBody(
        schedule=dict(fields["schedule"]), misfire=dict(fields["misfire"]), definition=body["definition"]
    )


class PlanCollectionView(OrbitView):
    @documented(data="PlanPage", operation_id="plans_list", paged=True)
    def get(self, request: Request) -> Response:
        principal = self.principal(request)
        principal.require("plans:manage")
        items, last_id = actions.plan_list(
            principal=principal, after_id=decode_page_token(request), limit=page_size_of(request)
        )
        return ok(request, page(items, encode_page_token(last_id) if last_id else ""))

    @mutation(
        PlanCreateInput,
        scope="plans:manage",
        operation="plan.create",
        data="PlanReceipt",
        as_sent=True,
        created=True,
        not_found=True,
    )
    def post(self, actor: Actor, fields: dict[str, Any], body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        plan = actions.plan_create(
            actor=actor, name=fields["name"], queue_id=fields["queue_id"], body=body_of(fields, body)
        )
        return 201, {"plan": plan}


class PlanDetailView(OrbitView):
    @documented(data="Plan")
    def get(self, request: Request, plan_id: str) -> Response:
        principal = self.principal(request)
        principal.require("plans:manage")
        return ok(request, actions.plan_get(principal=principal, plan_id=plan_id))


class PlanTriggersView(OrbitView):
    @documented(data="TriggerPage", operation_id="plan_triggers_list", paged=True)
    def get(self, request: Request, plan_id: str) -> Response:
        principal = self.principal(request)
        principal.require("plans:manage")
        after = decode_page_token(request, cursor_pattern=r"[1-9][0-9]{0,19}")
        items, last_id = actions.trigger_list(
            principal=principal, plan_id=plan_id, after_id=int(after) if after else None, limit=page_size_of(request)
        )
        return ok(request, page(items, encode_page_token(str(last_id)) if last_id else ""))


class PlanUpdateView(OrbitView):
    @mutation(PlanUpdateInput, scope="plans:manage", operation="plan.update", data="PlanReceipt", as_sent=True)
    def post(
        self, actor: Actor, fields: dict[str, Any], plan_id: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        plan = actions.plan_update(
            actor=actor,
            plan_id=plan_id,
            expected_revision=fields["expected_revision"],
            reason=fields["reason"],
            body=body_of(fields, body),
        )
        return 200, {"plan": plan}


def change_view(verb: Callable[..., dict[str, Any]], operation: str) -> type[OrbitView]:
    """:pause, :resume and :retire: `{expected_revision, reason}`, the plan back."""

    class PlanChangeView(OrbitView):
        @mutation(
            PlanChangeInput,
            scope="plans:manage",
            operation=operation,
            data="PlanReceipt",
            operation_id=operation.replace(".", "_"),
        )
        def post(self, actor: Actor, fields: dict[str, Any], plan_id: str) -> tuple[int, dict[str, Any]]:
            plan = verb(
                actor=actor, plan_id=plan_id, expected_revision=fields["expected_revision"], reason=fields["reason"]
            )
            return 200, {"plan": plan}

    PlanChangeView.__name__ = PlanChangeView.__qualname__ = f"Plan{operation.split('.')[1].title()}View"
    return PlanChangeView


PlanPauseView = change_view(actions.plan_pause, "plan.pause")
PlanResumeView = change_view(actions.plan_resume, "plan.resume")
PlanRetireView = change_view(actions.plan_retire, "plan.retire")
