from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api.mutations import mutation
from orbit.api.responses import ok, page
from orbit.api.schema import documented
from orbit.api.views import OrbitView, decode_page_token, encode_page_token, page_size_of
from orbit.principal import Actor
from plans import actions
from plans.serializers import PlanChangeInput, PlanCreateInput, PlanUpdateInput

T = TypeVar("T")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def body_of(fields: dict[str, Any], body: dict[str, Any]) -> actions.PlanBody:
    """Schedule and misfire as validated; the definition as sent (it is
    validated again, with its defaults, each time a task is made from it)."""
    return actions.PlanBody(
        schedule=dict(fields["schedule"]), misfire=dict(fields["misfire"]), definition=body["definition"]
    )


class PlanCollectionView(OrbitView):
    def mutate(
        self,
        request: Request,
        *,
        operation: str,
        target: str,
        validate: Callable[[dict[str, Any]], T],
        effect: Callable[[Actor, T], tuple[int, dict[str, Any]]],
    ) -> Response:
        """A create names its queue in the body: the queue's range is checked
        before the Idempotency-Key's record is looked up, as a submit's, so a
        credential never gets the receipt of a plan outside its range replayed
        (SPEC §2: permissions are checked again on replays)."""
        queue_id = self.body(request).get("queue_id")
        if isinstance(queue_id, str):
            self.principal(request).require_queue(queue_id)
        return super().mutate(request, operation=operation, target=target, validate=validate, effect=effect)

    @documented(data="PlanPage", operation_id="plans_list", paged=True)
    def get(self, request: Request) -> Response:
        """List plans.

        The namespace's plans (plans:manage), in id order, one page at a time: pass a page's
        next_page_token as page_token for the next; an empty one ends the list."""
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
        operation_id="plans_create",
    )
    def post(self, actor: Actor, fields: dict[str, Any], body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Create a plan.

        A schedule (a cron expression in a time zone, or every interval_seconds) that submits a
        task made from its definition to a queue at each point, with a misfire policy for points
        missed. 201 with the plan; the same Idempotency-Key with the same body replays it (200)."""
        plan = actions.plan_create(
            actor=actor, name=fields["name"], queue_id=fields["queue_id"], body=body_of(fields, body)
        )
        return 201, {"plan": plan}


class PlanDetailView(OrbitView):
    @documented(data="Plan", operation_id="plans_get")
    def get(self, request: Request, plan_id: str) -> Response:
        """Get a plan.

        The plan's state, current version (schedule, misfire policy, definition) and next fire
        time (plans:manage)."""
        principal = self.principal(request)
        principal.require("plans:manage")
        return ok(request, actions.plan_get(principal=principal, plan_id=plan_id))


class PlanTriggersView(OrbitView):
    @documented(data="TriggerPage", operation_id="plans_triggers_list", paged=True)
    def get(self, request: Request, plan_id: str) -> Response:
        """List a plan's triggers.

        Each point of the schedule the plan decided on: the task it submitted or why it did not,
        oldest first, one page at a time."""
        principal = self.principal(request)
        principal.require("plans:manage")
        # The last point of a page, in microseconds since 1970 (UTC).
        after = decode_page_token(request, cursor_pattern=r"[1-9][0-9]{0,17}")
        items, last = actions.trigger_list(
            principal=principal,
            plan_id=plan_id,
            after=EPOCH + timedelta(microseconds=int(after)) if after else None,
            limit=page_size_of(request),
        )
        cursor = str((last - EPOCH) // timedelta(microseconds=1)) if last else ""
        return ok(request, page(items, encode_page_token(cursor) if cursor else ""))


class PlanUpdateView(OrbitView):
    @mutation(
        PlanUpdateInput,
        scope="plans:manage",
        operation="plan.update",
        data="PlanReceipt",
        as_sent=True,
        check=actions.visible_plan,
        operation_id="plans_update",
    )
    def post(
        self, actor: Actor, fields: dict[str, Any], plan_id: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        """Update a plan: a new version.

        A new schedule, misfire policy and definition, with the revision it was read at and a
        reason; the schedule starts over from now (points of the old version not yet decided are
        dropped, never fired twice)."""
        plan = actions.plan_update(
            actor=actor,
            plan_id=plan_id,
            expected_revision=fields["expected_revision"],
            reason=fields["reason"],
            body=body_of(fields, body),
        )
        return 200, {"plan": plan}


def change_view(verb: Callable[..., dict[str, Any]], operation: str, doc: str) -> type[OrbitView]:
    """:pause, :resume and :retire: `{expected_revision, reason}`, the plan back.
    `doc`: the endpoint's docstring (its OpenAPI summary and description)."""
    verb_name = operation.split(".")[1]

    def change(self: OrbitView, actor: Actor, fields: dict[str, Any], plan_id: str) -> tuple[int, dict[str, Any]]:
        plan = verb(
            actor=actor, plan_id=plan_id, expected_revision=fields["expected_revision"], reason=fields["reason"]
        )
        return 200, {"plan": plan}

    # mutation() reads the effect's docstring when it documents the endpoint.
    change.__doc__ = doc

    class PlanChangeView(OrbitView):
        post = mutation(
            PlanChangeInput,
            scope="plans:manage",
            operation=operation,
            data="PlanReceipt",
            check=actions.visible_plan,
            operation_id=f"plans_{verb_name}",
        )(change)

    PlanChangeView.__name__ = PlanChangeView.__qualname__ = f"Plan{verb_name.title()}View"
    return PlanChangeView


PlanPauseView = change_view(
    actions.plan_pause,
    "plan.pause",
    """Pause a plan.

    An ACTIVE plan stops submitting tasks until it is resumed (409 STATE_CONFLICT otherwise),
    with the revision it was read at and a reason for the audit log.""",
)
PlanResumeView = change_view(
    actions.plan_resume,
    "plan.resume",
    """Resume a paused plan.

    Points that fell while it was paused are not made up: the next is the first after now. Its
    queue must still accept tasks.""",
)
PlanRetireView = change_view(
    actions.plan_retire,
    "plan.retire",
    """Retire a plan, for good.

    It never fires again; its name stays taken, and the plan and its triggers stay readable.""",
)
