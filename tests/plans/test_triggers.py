"""The trigger loop (plans.actions.fire_due_plans) at chosen moments: each
scheduled point decided once, by the version's misfire policy, under the
target queue's backpressure (seed queues-v1: 满额的原触发点保留为下一游标)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from orbit_sdk import Client, CreatePlanRequest, CreateQueueRequest
from plans import actions as plans_actions
from plans.actions import fire_due_plans
from plans.models import Plan, PlanTrigger, PlanVersion
from tasks.actions import rounds
from tasks.models import Task
from tests.conftest import post_json
from tests.support.api import assert_ok, make_queue
from tests.support.plans import TASK, create_plan, plan_body
from tests.support.race import race
from tests.support.tasks import assert_invariants, cancel, configure_queue, wait_until, worker_for


def new_plan(planner, queue_id: str, name: str = "p", **overrides) -> tuple[str, datetime]:
    plan = assert_ok(create_plan(planner.client, plan_body(queue_id, name=name, **overrides), key=name), 201)["plan"]
    return plan["id"], PlanVersion.objects.get(plan_id=plan["id"], version=1).anchor_at


def triggers(plan_id: str) -> list[tuple[str, str]]:
    """(outcome, reason) of each decided point, in point order."""
    return list(PlanTrigger.objects.filter(plan_id=plan_id).order_by("scheduled_at").values_list("outcome", "reason"))


def minutes(anchor: datetime, n: float) -> datetime:
    return anchor + timedelta(seconds=60 * n)


@pytest.mark.django_db
def test_each_point_is_decided_once_and_makes_the_defined_task(planner):
    queue = make_queue(planner.client, "q")
    plan_id, anchor = new_plan(planner, queue["id"], misfire={"policy": "SKIP"})
    assert fire_due_plans(minutes(anchor, 0.5)) == 0
    assert fire_due_plans(minutes(anchor, 1) + timedelta(seconds=1)) == 1
    assert fire_due_plans(minutes(anchor, 1) + timedelta(seconds=2)) == 0
    (trigger,) = PlanTrigger.objects.filter(plan_id=plan_id)
    assert (trigger.outcome, trigger.scheduled_at, trigger.version) == ("CREATED", minutes(anchor, 1), 1)
    task = Task.objects.get(id=trigger.task_id)
    assert (task.queue_id, task.handler, task.payload, task.priority, task.max_attempts) == (
        queue["id"],
        "report.build",
        {"kind": "daily"},
        5,
        3,
    )
    assert Plan.objects.get(id=plan_id).next_fire_at == minutes(anchor, 2)
    listed = assert_ok(planner.client.get(f"/v1/plans/{plan_id}/triggers"))
    assert listed["items"] == [
        {
            "scheduled_at": listed["items"][0]["scheduled_at"],
            "version": 1,
            "outcome": "CREATED",
            "task_id": task.id,
            "decided_at": listed["items"][0]["decided_at"],
        }
    ]
    assert listed["next_page_token"] == ""


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("misfire", "expected"),
    [
        # 20 points due, the last one a second ago; a 10-minute window
        ({"policy": "SKIP"}, [("SKIPPED", "missed its time")] * 19 + [("CREATED", "")]),
        (
            {"policy": "CATCH_UP", "catch_up_window_seconds": 600},
            [("SKIPPED", "outside the catch-up window")] * 10 + [("CREATED", "")] * 10,
        ),
        (
            {"policy": "LATEST", "catch_up_window_seconds": 600},
            [("SKIPPED", "superseded by a later point")] * 19 + [("CREATED", "")],
        ),
    ],
    ids=["skip", "catch-up", "latest"],
)
def test_misfire_policies(planner, misfire, expected):
    queue = make_queue(planner.client, "q")
    plan_id, anchor = new_plan(planner, queue["id"], misfire=misfire)
    assert fire_due_plans(minutes(anchor, 20) + timedelta(seconds=1)) == 20
    assert triggers(plan_id) == expected
    assert Task.objects.filter(queue_id=queue["id"]).count() == sum(
        1 for outcome, _ in expected if outcome == "CREATED"
    )
    assert_invariants()


@pytest.mark.django_db
def test_a_full_queue_keeps_the_point_as_the_cursor_and_the_frozen_policy_decides_it_later(planner):
    queue = make_queue(planner.client, "q", max_unfinished_tasks=3)
    plan_id, anchor = new_plan(planner, queue["id"], misfire={"policy": "CATCH_UP", "catch_up_window_seconds": 600})
    now = minutes(anchor, 5) + timedelta(seconds=1)
    assert fire_due_plans(now) == 3
    assert triggers(plan_id) == [("CREATED", "")] * 3  # no record, no task for the full point
    assert Plan.objects.get(id=plan_id).next_fire_at == minutes(anchor, 4)
    assert fire_due_plans(now + timedelta(seconds=5)) == 0  # still full: still no record
    for n, task_id in enumerate(PlanTrigger.objects.filter(plan_id=plan_id).values_list("task_id", flat=True)):
        assert_ok(cancel(planner.client, task_id, f"free-{n}"))
    # space again, but point 4 has waited past the 10-minute window: skipped by the
    # version's policy; point 5 and the ones since are inside it
    later = minutes(anchor, 14) + timedelta(seconds=30)
    assert fire_due_plans(later) == 4
    decided = triggers(plan_id)
    assert decided[3] == ("SKIPPED", "outside the catch-up window")
    assert decided[4:] == [("CREATED", "")] * 3  # the queue is full again after three
    assert Plan.objects.get(id=plan_id).next_fire_at == minutes(anchor, 8)
    assert_invariants()


@pytest.mark.django_db
def test_a_plan_catching_up_on_a_full_queue_writes_only_the_rows_it_has_room_for(planner, monkeypatch):
    # Each fired point's task row is written before the lock decides it, and
    # deleted if refused: held at a full queue, every step wrote and deleted
    # all the points it had waiting (up to 500), every half second.
    queue = make_queue(planner.client, "q", max_unfinished_tasks=3)
    plan_id, anchor = new_plan(planner, queue["id"], misfire={"policy": "CATCH_UP", "catch_up_window_seconds": 600})
    admitted: list[int] = []
    admit = plans_actions.admit_tasks

    def counting(*, items, **rest):
        admitted.append(len(items))
        return admit(items=items, **rest)

    monkeypatch.setattr(plans_actions, "admit_tasks", counting)
    now = minutes(anchor, 20) + timedelta(seconds=1)  # ten points inside the window
    assert fire_due_plans(now) == 13  # ten skipped, three created
    assert fire_due_plans(now + timedelta(seconds=1)) == 0
    assert fire_due_plans(now + timedelta(seconds=2)) == 0
    assert admitted == [3, 1, 1]
    assert triggers(plan_id) == [("SKIPPED", "outside the catch-up window")] * 10 + [("CREATED", "")] * 3
    assert Plan.objects.get(id=plan_id).next_fire_at == minutes(anchor, 14)
    assert Task.objects.filter(queue_id=queue["id"]).count() == 3
    # room for two: the next step takes two points, and the one after is held again
    for n, task_id in enumerate(PlanTrigger.objects.filter(plan_id=plan_id, outcome="CREATED")[:2]):
        assert_ok(cancel(planner.client, task_id.task_id, f"free-{n}"))
    assert fire_due_plans(now + timedelta(seconds=3)) == 2
    assert admitted[-1] == 2
    assert Plan.objects.get(id=plan_id).next_fire_at == minutes(anchor, 16)
    assert_invariants()


@pytest.mark.django_db
def test_a_paused_queue_still_receives_tasks_and_a_paused_plan_makes_none(planner):
    queue = make_queue(planner.client, "q")
    configure_queue(planner.client, queue["id"], paused=True)
    plan_id, anchor = new_plan(planner, queue["id"], misfire={"policy": "SKIP"})
    assert fire_due_plans(minutes(anchor, 1)) == 1
    assert triggers(plan_id) == [("CREATED", "")]
    pause = {"expected_revision": "1", "reason": "holiday"}
    assert_ok(post_json(planner.client, f"/v1/plans/{plan_id}:pause", pause, key="pause"))
    assert fire_due_plans(minutes(anchor, 30)) == 0
    assert len(triggers(plan_id)) == 1


@pytest.mark.django_db
def test_keyed_definition_tasks_share_one_permit(planner):
    queue = make_queue(planner.client, "q")
    definition = {"task": {**plan_body(queue["id"])["definition"]["task"], "concurrency_key": "ledger:1"}}
    plan_id, _ = new_plan(
        planner, queue["id"], definition=definition, misfire={"policy": "CATCH_UP", "catch_up_window_seconds": 600}
    )
    # as if created three and a half minutes ago, so its tasks are available now
    anchor = timezone.now() - timedelta(minutes=3, seconds=30)
    PlanVersion.objects.filter(plan_id=plan_id).update(anchor_at=anchor)
    Plan.objects.filter(id=plan_id).update(next_fire_at=minutes(anchor, 1))
    assert fire_due_plans() == 3
    assert set(Task.objects.filter(queue_id=queue["id"]).values_list("concurrency_key", flat=True)) == {"ledger:1"}
    leased = rounds.lease_tasks(worker=worker_for(planner, queue["id"]), limit=3)
    assert len(leased) == 1
    assert_invariants()


@pytest.mark.django_db(transaction=True)
def test_nodes_deciding_at_once_decide_each_point_once(planner):
    """Six threads run the trigger step at the same moment over four plans
    with 30 due points each: every point is recorded once and made at most
    one task."""
    queue = make_queue(planner.client, "q")
    anchors = [
        new_plan(planner, queue["id"], name=f"p{n}", misfire={"policy": "CATCH_UP", "catch_up_window_seconds": 7200})
        for n in range(4)
    ]
    now = max(anchor for _, anchor in anchors) + timedelta(minutes=30, seconds=1)
    decided = race(6, lambda _: fire_due_plans(now))
    assert sum(decided) == 120
    for plan_id, _ in anchors:
        assert triggers(plan_id) == [("CREATED", "")] * 30
    assert Task.objects.filter(queue_id=queue["id"]).count() == 120
    assert_invariants()


@pytest.mark.django_db(transaction=True)
def test_the_live_server_fires_a_plan_by_itself(planner, orbit_server):
    """Through the SDK against a live server: the server's own trigger loop
    makes the plan's tasks, and a paused plan makes none."""
    with Client(orbit_server.url, planner.token) as client:
        queue = client.create_queue("live-queue", CreateQueueRequest("live", 4, 10)).queue
        request = CreatePlanRequest(
            name="live",
            queue_id=queue.id,
            schedule={"interval_seconds": 1},
            misfire={"policy": "SKIP"},
            task=dict(TASK),
        )
        plan = client.create_plan("live-plan", request).plan

        def created() -> list:
            items = client.list_plan_triggers(plan.id).items
            return [item for item in items if item.outcome == "CREATED"] if len(items) >= 2 else []

        made = wait_until(created, timeout=10, what="two CREATED triggers")
        task = client.get_task(made[0].task_id)
        assert task.queue_id == queue.id and task.payload == {"kind": "daily"}
        paused = client.pause_plan(plan.id, "live-pause", plan.revision, "enough").plan
        decided = len(client.list_plan_triggers(plan.id).items)
        time.sleep(2.5)
        assert len(client.list_plan_triggers(plan.id).items) == decided
        assert client.retire_plan(plan.id, "live-retire", paused.revision, "done").plan.state == "RETIRED"
