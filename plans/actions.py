"""Plan verbs: create, update (a new version), pause, resume, retire, reads,
and fire_due_plans, the trigger loop's step that every node runs.

Lock order (orbit.locking.LOCK_ORDER): the plan row comes first. A plan verb
locks its plan row, and create and resume the target's queue_state row after
it, where a queue's retire checks for active plans under the same lock; the
trigger step holds its plan row while the submit locks the counters, as a round
does. No path locks a plan row after a counter row, so none can wait in a
cycle."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from django.db import IntegrityError, InterfaceError, OperationalError, transaction
from django.db.models import Q
from django.utils import timezone

from orbit.audit import record_management_change
from orbit.db.rows import keyset_page, select_rows
from orbit.errors import InvalidArgument, NotFound, OrbitError, QueueFull, StateConflict, require_revision
from orbit.fields import is_resource_id
from orbit.models import Application, ApplicationState
from orbit.principal import Actor, Principal
from orbit.timefmt import format_time
from orbit.transactions import outermost
from plans.models import Plan, PlanState, PlanTrigger, PlanVersion, TriggerOutcome
from plans.schedule import decide, first_point_after, points_from
from plans.serializers import PlanTaskInput
from queues.locks import lock_queue_states
from queues.models import Queue, QueueState
from tasks.actions.dependencies import resolve_depends_on
from tasks.actions.submit import admit_tasks

logger = logging.getLogger("orbit.plans")

# Points one trigger step decides for one plan at most; a plan further behind
# is continued by the next step.
POINTS_PER_STEP = 500
PLANS_PER_STEP = 50
# Due plans a step reads at a time, past those held at a full queue.
DUE_PAGE = 200
# Transactions a step may spend on plans held at a full queue (one per queue
# found full: the queue's other plans are passed over), however many are held.
HELD_TRIES_PER_STEP = 200


@dataclass(frozen=True)
class PlanBody:
    schedule: dict[str, Any]
    misfire: dict[str, Any]
    definition: dict[str, Any]


def plan_snapshot(plan: Plan, version: PlanVersion) -> dict[str, Any]:
    snapshot: dict[str, Any] = {
        "id": plan.id,
        "namespace_id": plan.namespace_id,
        "queue_id": plan.queue_id,
        "name": plan.name,
        "state": plan.state,
        "version": plan.version,
        "revision": str(plan.revision),
        "schedule": version.schedule,
        "misfire": version.misfire,
        "definition": version.definition,
    }
    if plan.state == PlanState.ACTIVE and plan.next_fire_at is not None:
        snapshot["next_fire_at"] = format_time(plan.next_fire_at)
    return snapshot


def _current_version(plan: Plan) -> PlanVersion:
    return PlanVersion.objects.get(plan_id=plan.id, version=plan.version)


def _locked_queue_state_accepting(actor: Actor, queue_id: str) -> None:
    """The target queue's counter row locked (a retire holds it while it looks
    for active plans), or the refusal: absent or out of range, or retired."""
    if not is_resource_id(queue_id) or not actor.principal.covers_queue(queue_id):
        raise NotFound("queue not found")
    if not Queue.objects.filter(id=queue_id, namespace_id=actor.namespace_id).exists():
        raise NotFound("queue not found")
    state = lock_queue_states([queue_id]).get(queue_id)
    if state is None:
        raise NotFound("queue not found")
    if not state.accepting:
        raise StateConflict("queue is retired")


def _write_version(plan: Plan, body: PlanBody, now: datetime) -> PlanVersion:
    """The row of the plan's version `plan.version`, its schedule starting from `now`."""
    return PlanVersion.objects.create(
        plan_id=plan.id,
        version=plan.version,
        schedule=body.schedule,
        misfire=body.misfire,
        definition=body.definition,
        anchor_at=now,
    )


def _check_dependencies(actor: Actor, body: PlanBody) -> None:
    """The definition's depends_on, checked as a submit's: each id a task of
    the plan's namespace (a foreign one answers as an unknown one), no
    batch ref, in the credential's queue range. A task pruned later makes its
    points SKIPPED, naming it."""
    task = body.definition["task"]
    if task.get("depends_on"):
        _, refused = resolve_depends_on(
            actor.namespace_id, [None], False, {}, [(0, task)], queue_ids=actor.principal.queue_ids
        )
        if refused:
            raise InvalidArgument(f"definition.task.{refused[0].message}")


def plan_create(*, actor: Actor, name: str, queue_id: str, body: PlanBody) -> dict[str, Any]:
    """Caller holds the transaction."""
    _locked_queue_state_accepting(actor, queue_id)
    _check_dependencies(actor, body)
    now = timezone.now()
    plan = Plan(
        namespace_id=actor.namespace_id,
        application_id=actor.principal.application_id,
        queue_id=queue_id,
        name=name,
        state=PlanState.ACTIVE,
        version=1,
        revision=1,
        next_fire_at=first_point_after(body.schedule, now, now),
    )
    try:
        with transaction.atomic():  # a concurrent create of the name fails here once the winner commits
            plan.save(force_insert=True)
    except IntegrityError as exc:
        raise StateConflict(f"plan name {name!r} is already taken in this namespace") from exc
    version = _write_version(plan, body, now)
    snapshot = plan_snapshot(plan, version)
    record_management_change(
        actor, action="plan.created", target_type="plan", target_id=plan.id, reason="", before=None, after=snapshot
    )
    return snapshot


def _locked_plan(actor: Actor, plan_id: str, expected_revision: int) -> Plan:
    if not is_resource_id(plan_id):
        raise NotFound("plan not found")
    plan = Plan.objects.select_for_update().filter(id=plan_id, namespace_id=actor.namespace_id).first()
    if plan is None or not actor.principal.covers_queue(plan.queue_id):
        raise NotFound("plan not found")
    if plan.state == PlanState.RETIRED:
        raise StateConflict("plan is retired")
    require_revision(expected_revision, plan.revision)
    return plan


def _change(actor: Actor, plan: Plan, version: PlanVersion, action: str, reason: str, before: dict) -> dict[str, Any]:
    plan.revision += 1
    plan.save(update_fields=["state", "version", "revision", "next_fire_at", "updated_at"])
    after = plan_snapshot(plan, version)
    record_management_change(
        actor, action=action, target_type="plan", target_id=plan.id, reason=reason, before=before, after=after
    )
    return after


def plan_update(*, actor: Actor, plan_id: str, expected_revision: int, reason: str, body: PlanBody) -> dict[str, Any]:
    """A new immutable version; the schedule starts over from now (points of
    the old version not yet decided are dropped, never fired twice)."""
    plan = _locked_plan(actor, plan_id, expected_revision)
    _check_dependencies(actor, body)
    before = plan_snapshot(plan, _current_version(plan))
    now = timezone.now()
    plan.version += 1
    version = _write_version(plan, body, now)
    plan.next_fire_at = first_point_after(body.schedule, now, now)
    return _change(actor, plan, version, "plan.updated", reason, before)


def plan_pause(*, actor: Actor, plan_id: str, expected_revision: int, reason: str) -> dict[str, Any]:
    plan = _locked_plan(actor, plan_id, expected_revision)
    if plan.state != PlanState.ACTIVE:
        raise StateConflict(f"plan is {plan.state}")
    version = _current_version(plan)
    before = plan_snapshot(plan, version)
    plan.state = PlanState.PAUSED
    return _change(actor, plan, version, "plan.paused", reason, before)


def plan_resume(*, actor: Actor, plan_id: str, expected_revision: int, reason: str) -> dict[str, Any]:
    """Points that fell while paused are not made up: the next is the first after now."""
    plan = _locked_plan(actor, plan_id, expected_revision)
    if plan.state != PlanState.PAUSED:
        raise StateConflict(f"plan is {plan.state}")
    _locked_queue_state_accepting(actor, plan.queue_id)
    version = _current_version(plan)
    before = plan_snapshot(plan, version)
    now = timezone.now()
    plan.state = PlanState.ACTIVE
    plan.next_fire_at = first_point_after(version.schedule, version.anchor_at, now)
    return _change(actor, plan, version, "plan.resumed", reason, before)


def plan_retire(*, actor: Actor, plan_id: str, expected_revision: int, reason: str) -> dict[str, Any]:
    """Permanent; the name stays taken, the plan and its triggers stay readable."""
    plan = _locked_plan(actor, plan_id, expected_revision)
    version = _current_version(plan)
    before = plan_snapshot(plan, version)
    plan.state = PlanState.RETIRED
    plan.next_fire_at = None
    return _change(actor, plan, version, "plan.retired", reason, before)


def visible_plan(principal: Principal, plan_id: str) -> Plan:
    plan = (
        Plan.objects.filter(id=plan_id, namespace_id=principal.namespace_id).first()
        if is_resource_id(plan_id)
        else None
    )
    if plan is None or not principal.covers_queue(plan.queue_id):
        raise NotFound("plan not found")
    return plan


def plan_get(*, principal: Principal, plan_id: str) -> dict[str, Any]:
    plan = visible_plan(principal, plan_id)
    return plan_snapshot(plan, _current_version(plan))


def plan_list(*, principal: Principal, after_id: str | None, limit: int) -> tuple[list[dict[str, Any]], str | None]:
    plans = Plan.objects.filter(namespace_id=principal.namespace_id)
    if principal.queue_ids is not None:
        plans = plans.filter(queue_id__in=sorted(principal.queue_ids))
    rows, next_id = keyset_page(plans, after_id, limit)
    versions = {
        (v.plan_id, v.version): v
        for v in PlanVersion.objects.filter(plan_id__in=[p.id for p in rows], version__in={p.version for p in rows})
    }
    return [plan_snapshot(p, versions[(p.id, p.version)]) for p in rows], next_id


def trigger_snapshot(trigger: PlanTrigger) -> dict[str, Any]:
    snapshot: dict[str, Any] = {
        "scheduled_at": format_time(trigger.scheduled_at),
        "version": trigger.version,
        "outcome": trigger.outcome,
        "decided_at": format_time(trigger.created_at),
    }
    if trigger.task_id:
        snapshot["task_id"] = trigger.task_id
    if trigger.reason:
        snapshot["reason"] = trigger.reason
    return snapshot


def trigger_list(
    *, principal: Principal, plan_id: str, after: datetime | None, limit: int
) -> tuple[list[dict[str, Any]], datetime | None]:
    """The plan's triggers in the order they were decided, which is their
    points' order (a plan decides each point once, in time), a page after the
    point `after`, and the point to continue after. Paged by the point, not by
    the row's id: an application moved to another cell gets new ids there, and
    a page token read before the move must go on where it stopped."""
    plan = visible_plan(principal, plan_id)
    rows, next_point = keyset_page(PlanTrigger.objects.filter(plan_id=plan.id), after, limit, key="scheduled_at")
    return [trigger_snapshot(t) for t in rows], next_point


# --------------------------------------------------------------------------- the trigger loop


def _plan_actor(plan: Plan) -> Actor:
    """Submits of a plan act for its namespace with exactly the right to submit to its queue."""
    principal = Principal(
        credential_id="",
        application_id=plan.application_id,
        namespace_id=plan.namespace_id,
        scopes=frozenset({"tasks:submit"}),
        queue_ids=frozenset({plan.queue_id}),
    )
    return Actor(principal=principal, request_id="")


@dataclass(frozen=True)
class Stepped:
    """What one plan's step decided: its points recorded, and whether its
    queue was full (its next point waits for room)."""

    recorded: int = 0
    held: bool = False


@outermost
def _step_plan(plan_id: str, now: datetime) -> Stepped:
    """Decides the due points of one plan in one transaction. The plan row is
    taken with SKIP LOCKED: a plan another node is deciding is left to it."""
    locked = select_rows(Plan, "id = %s AND state = %s", [plan_id, PlanState.ACTIVE], lock=True, skip_locked=True)
    if not locked or locked[0].next_fire_at is None or locked[0].next_fire_at > now:
        return Stepped()
    plan = locked[0]
    version = _current_version(plan)
    due: list[datetime] = []
    following = None
    # next_fire_at was checked above (not None) on the same row.
    for point in points_from(version.schedule, version.anchor_at, cast(datetime, plan.next_fire_at)):
        if point > now or len(due) == POINTS_PER_STEP:
            following = point
            break
        due.append(point)
    complete = following is not None and following > now
    decisions = decide(due, version.misfire, now, complete)
    fired = [d for d in decisions if d.fire]
    if len(fired) > 1:
        # Each fired point's task row is written before the lock decides it
        # and deleted if refused: a plan catching up on a full queue would
        # write and delete up to POINTS_PER_STEP rows every step.
        fired = fired[: max(1, _room(plan.queue_id, plan.application_id))]
    outcomes: list[Any] = []
    if fired:
        task = PlanTaskInput.validated(version.definition["task"])
        items = [{**task, "queue_id": plan.queue_id} for _ in fired]
        outcomes = admit_tasks(actor=_plan_actor(plan), items=items, now=now)
    created = dict(zip([d.point for d in fired], outcomes, strict=True))
    records: list[PlanTrigger] = []
    cursor = following
    held = False
    for decision in decisions:
        outcome = created.get(decision.point, QueueFull() if decision.fire else None)
        if isinstance(outcome, QueueFull):
            # The full point stays the next cursor: no task, no record; the
            # next step decides it again by the same (frozen) policy.
            cursor, held = decision.point, True
            break
        record = PlanTrigger(
            plan_id=plan.id, namespace_id=plan.namespace_id, version=plan.version, scheduled_at=decision.point
        )
        if outcome is None:
            record.outcome, record.reason = TriggerOutcome.SKIPPED, decision.reason
        elif isinstance(outcome, OrbitError):
            record.outcome, record.reason = TriggerOutcome.SKIPPED, outcome.message[:255]
        else:
            record.outcome, record.task_id = TriggerOutcome.CREATED, outcome.id
        records.append(record)
    PlanTrigger.objects.bulk_create(records)
    plan.next_fire_at = cursor
    plan.updated_at = now
    plan.save(update_fields=["next_fire_at", "updated_at"])
    return Stepped(len(records), held)


def _room(queue_id: str, application_id: str) -> int:
    """How many more tasks the queue and its application take, read without a
    lock (the admission decides under it): the points past it wait for the
    next step, as a refused one does."""
    queue_limit = Queue.objects.filter(id=queue_id).values_list("max_unfinished_tasks", flat=True).first()
    queue_unfinished = QueueState.objects.filter(queue_id=queue_id).values_list("unfinished_tasks", flat=True).first()
    app_limit = Application.objects.filter(id=application_id).values_list("max_unfinished_tasks", flat=True).first()
    app_unfinished = (
        ApplicationState.objects.filter(application_id=application_id)
        .values_list("unfinished_tasks", flat=True)
        .first()
    )
    if None in (queue_limit, queue_unfinished, app_limit, app_unfinished):
        return 1  # the admission says what is missing
    return min(cast(int, queue_limit) - cast(int, queue_unfinished), cast(int, app_limit) - cast(int, app_unfinished))


def _due_plans(now: datetime) -> Iterator[tuple[str, str]]:
    """(plan id, queue id) of the active plans due at `now`, longest due first,
    read DUE_PAGE at a time as the caller goes on."""
    due = Plan.objects.filter(state=PlanState.ACTIVE, next_fire_at__lte=now).order_by("next_fire_at", "id")
    page = due
    while True:
        rows = list(page.values_list("id", "queue_id", "next_fire_at")[:DUE_PAGE])
        for plan_id, queue_id, _ in rows:
            yield plan_id, queue_id
        if len(rows) < DUE_PAGE:
            return
        _, _, last_at = rows[-1]
        page = due.filter(Q(next_fire_at__gt=last_at) | Q(next_fire_at=last_at, id__gt=rows[-1][0]))


def fire_due_plans(now: datetime | None = None) -> int:
    """One step of the trigger loop: the active plans whose next point is due
    decide their due points, longest due first, up to PLANS_PER_STEP plans that
    recorded one; returns the points recorded. Safe on every node at once (SKIP
    LOCKED on the plan row, and a point is recorded once: unique per plan).

    A plan held at a full queue keeps its point as the next one, and stays due:
    the step reads on past it, and passes over the other plans of a queue it
    found full this step, so however many plans wait for room, the others of
    the cell fire on time."""
    now = now or timezone.now()
    recorded = plans_recorded = held_tries = 0
    full_queues: set[str] = set()
    for plan_id, queue_id in _due_plans(now):
        if queue_id in full_queues:
            continue
        try:
            stepped = _step_plan(plan_id, now)
        except (OperationalError, InterfaceError):
            raise  # the database, not the plan: the sweep's outage handling tells it
        except Exception:
            # One plan's fault must not keep every other due plan of the cell from firing.
            logger.exception("plan %s: its due points could not be decided; tried again next step", plan_id)
            continue
        recorded += stepped.recorded
        plans_recorded += stepped.recorded > 0
        if stepped.held:
            full_queues.add(queue_id)
            held_tries += 1
        if plans_recorded >= PLANS_PER_STEP or held_tries >= HELD_TRIES_PER_STEP:
            break
    return recorded
