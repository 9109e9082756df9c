"""Plan edges: a cron plan around Europe/Berlin's DST changes (docs/decisions.md,
Plans: "A local time a DST change skips fires at the first one that exists"; an
ambiguous one fires once), a definition that names another namespace's task in
depends_on (SPEC §13: "another namespace's id ... → 400 INVALID_ARGUMENT naming
depends_on[i]"), and a plan, or a part of the sweep, that fails on its own."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

import plans.actions
from plans.actions import fire_due_plans
from plans.models import Plan, PlanTrigger, PlanVersion
from plans.schedule import first_point_after, points_from
from tasks.models import TaskDependency
from tests.conftest import new_tenant
from tests.support.api import assert_error, assert_ok, make_queue
from tests.support.factories import ALL_SCOPES
from tests.support.plans import TASK, change, create_plan, plan_body
from tests.support.tasks import assert_invariants, submit_ok

BERLIN_0230 = {"cron": "30 2 * * *", "timezone": "Europe/Berlin"}


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize("day", ["2026-03-29", "2026-10-25"], ids=["spring-forward", "fall-back"])
def test_the_next_point_is_never_before_the_moment(day):
    """Every minute of the change's night: the next point is after it."""
    start = at(f"{day}T00:00:00") - timedelta(days=1)
    for minute in range(0, 3 * 24 * 60, 5):
        moment = start + timedelta(minutes=minute)
        point = first_point_after(BERLIN_0230, moment, moment)
        assert point > moment, (moment, point)


@pytest.mark.parametrize(
    ("start", "expected"),
    [
        # 02:30 does not exist on 29 March: 03:00 CEST, the first time that does
        ("2026-03-27T12:00:00", ["2026-03-28T01:30:00", "2026-03-29T01:00:00", "2026-03-30T00:30:00"]),
        # 02:30 exists twice on 25 October: once, at the first
        ("2026-10-23T12:00:00", ["2026-10-24T00:30:00", "2026-10-25T00:30:00", "2026-10-26T01:30:00"]),
    ],
    ids=["spring-forward", "fall-back"],
)
def test_a_0230_berlin_plan_fires_once_each_day_through_the_changes(start, expected):
    points = points_from(BERLIN_0230, at(start), at(start))
    assert [next(points) for _ in expected] == [at(text) for text in expected]


@pytest.mark.django_db
def test_resuming_in_the_repeated_hour_neither_points_back_nor_fires_the_day_twice(planner, monkeypatch):
    """A daily 02:30 Berlin plan fires at 02:30 CEST (00:30Z) on the fall-back
    day, is paused, and resumed at 02:15 CET (01:15Z, the repeated hour). The
    next point is after now (tomorrow's 02:30), the trigger loop goes on, and
    the day has one trigger. Before the fix the resume answered 00:30Z, in the
    past and already decided: the trigger step then failed on the trigger's
    unique key at every sweep, so the plan never fired again (and the failing
    step stopped every other plan of the cell behind it)."""
    clock = SimpleNamespace(now=lambda: at("2026-10-24T12:00:00"))
    monkeypatch.setattr(plans.actions, "timezone", clock)
    queue = make_queue(planner.client, "q")
    body = plan_body(queue["id"], schedule=BERLIN_0230, misfire={"policy": "CATCH_UP", "catch_up_window_seconds": 7200})
    plan = assert_ok(create_plan(planner.client, body, key="dst"), 201)["plan"]
    assert plan["next_fire_at"] == "2026-10-25T00:30:00Z"
    assert fire_due_plans(at("2026-10-25T00:30:01")) == 1

    clock.now = lambda: at("2026-10-25T00:50:00")
    paused = assert_ok(change(planner.client, plan["id"], "pause", "1", "dst-pause"))["plan"]
    clock.now = lambda: at("2026-10-25T01:15:00")
    resumed = assert_ok(change(planner.client, plan["id"], "resume", paused["revision"], "dst-resume"))["plan"]
    assert resumed["next_fire_at"] == "2026-10-26T01:30:00Z"

    assert fire_due_plans(at("2026-10-25T01:15:01")) == 0
    assert fire_due_plans(at("2026-10-26T01:30:01")) == 1
    decided = list(
        PlanTrigger.objects.filter(plan_id=plan["id"]).order_by("scheduled_at").values_list("scheduled_at", "outcome")
    )
    assert decided == [(at("2026-10-25T00:30:00"), "CREATED"), (at("2026-10-26T01:30:00"), "CREATED")]
    assert Plan.objects.get(id=plan["id"]).next_fire_at == at("2026-10-27T01:30:00")


@pytest.mark.django_db
def test_creating_in_the_repeated_hour_answers_a_point_after_now(planner, monkeypatch):
    monkeypatch.setattr(plans.actions, "timezone", SimpleNamespace(now=lambda: at("2026-10-25T01:15:00")))
    queue = make_queue(planner.client, "q")
    body = plan_body(queue["id"], schedule=BERLIN_0230, misfire={"policy": "CATCH_UP", "catch_up_window_seconds": 7200})
    plan = assert_ok(create_plan(planner.client, body, key="dst-create"), 201)["plan"]
    # 00:30Z, before the plan existed, was answered (and fired at once under CATCH_UP)
    assert plan["next_fire_at"] == "2026-10-26T01:30:00Z"
    assert fire_due_plans(at("2026-10-25T01:15:01")) == 0


@pytest.mark.django_db
@pytest.mark.parametrize("whose", ["another namespace's", "no one's", "a batch ref"])
def test_a_definition_depends_only_on_tasks_of_its_namespace(planner, whose):
    """As a submit: a foreign id answers exactly as an unknown one, and a batch
    ref names nothing outside a batch (SPEC §13)."""
    other = new_tenant(scopes=ALL_SCOPES)
    entry = {
        "another namespace's": lambda: submit_ok(other.client, make_queue(other.client, "theirs")["id"], "t")["id"],
        "no one's": lambda: "0" * 32,
        "a batch ref": lambda: "ref:first",
    }[whose]()
    queue = make_queue(planner.client, "q")
    body = plan_body(queue["id"], definition={"task": {**TASK, "depends_on": [entry]}})
    message = assert_error(create_plan(planner.client, body, key="xdep"), 400, "INVALID_ARGUMENT")
    expected = "definition.task.depends_on[0]: " + (
        "ref:NAME names an earlier item of the same POST /v1/tasks:batch"
        if whose == "a batch ref"
        else "task not found"
    )
    assert message == expected
    assert not Plan.objects.exists()


@pytest.mark.django_db
def test_a_definition_that_names_another_namespaces_task_makes_no_dependent_of_it(planner):
    """Should a definition name a foreign task all the same (a row written
    past the create's check), its points are SKIPPED as for a task not found:
    a plan's tasks must never wait on (nor learn how ended) another tenant's."""
    other = new_tenant(scopes=ALL_SCOPES)
    foreign = submit_ok(other.client, make_queue(other.client, "theirs")["id"], "theirs-1")["id"]
    queue = make_queue(planner.client, "q")
    body = plan_body(queue["id"], misfire={"policy": "CATCH_UP", "catch_up_window_seconds": 600})
    plan = assert_ok(create_plan(planner.client, body, key="xdep"), 201)["plan"]
    version = PlanVersion.objects.get(plan_id=plan["id"])
    version.definition = {"task": {**TASK, "depends_on": [foreign]}}
    version.save(update_fields=["definition"])
    fire_due_plans(at(plan["next_fire_at"].rstrip("Z")) + timedelta(seconds=1))
    assert not TaskDependency.objects.filter(depends_on_id=foreign).exists()
    (trigger,) = PlanTrigger.objects.filter(plan_id=plan["id"])
    assert (trigger.outcome, trigger.reason) == ("SKIPPED", "depends_on[0]: task not found")
    assert_invariants()


@pytest.mark.django_db
def test_a_plan_whose_step_fails_keeps_no_other_plan_from_firing(planner, monkeypatch, caplog):
    # given two due plans, the first of which cannot be decided (any fault of its own)
    queue = make_queue(planner.client, "q")
    every_minute = {"interval_seconds": 60}
    broken, healthy = (
        assert_ok(create_plan(planner.client, plan_body(queue["id"], name=name, schedule=every_minute), key=name), 201)[
            "plan"
        ]
        for name in ("broken", "healthy")
    )
    step = plans.actions._step_plan

    def failing_for_broken(plan_id: str, now: datetime) -> int:
        if plan_id == broken["id"]:
            raise RuntimeError("a fault of this plan")
        return step(plan_id, now)

    monkeypatch.setattr(plans.actions, "_step_plan", failing_for_broken)
    # when the trigger loop steps past both
    due = max(at(plan["next_fire_at"].rstrip("Z")) for plan in (broken, healthy)) + timedelta(seconds=1)
    fired = fire_due_plans(due)
    # then the healthy plan fired, and the broken one is named in the log, left for the next step
    assert fired == 1
    assert PlanTrigger.objects.filter(plan_id=healthy["id"], outcome="CREATED").count() == 1
    assert not PlanTrigger.objects.filter(plan_id=broken["id"]).exists()
    assert f"plan {broken['id']}" in caplog.text


def test_a_sweep_part_that_fails_keeps_no_other_part_from_running(monkeypatch):
    from tasks import maintenance

    ran: list[str] = []

    def part(name: str, fails: bool = False):
        def run() -> int:
            ran.append(name)
            if fails:
                raise RuntimeError(f"{name} failed")
            return 1

        return run

    monkeypatch.setattr(maintenance, "recover_expired_leases", part("leases"))
    monkeypatch.setattr(maintenance, "sweep_deadlines", part("deadlines", fails=True))
    monkeypatch.setattr(maintenance, "fire_due_plans", part("plans"))
    monkeypatch.setattr(maintenance, "catch_up_policies", part("policies"))
    monkeypatch.setattr(maintenance, "run_follow_ups", lambda settle: part("follow-ups")())
    with pytest.raises(RuntimeError, match="deadlines failed"):
        maintenance.run_sweep()
    assert ran == ["leases", "deadlines", "plans", "policies", "follow-ups"]


@pytest.mark.django_db
@pytest.mark.parametrize("page", [plans.actions.DUE_PAGE, 7], ids=["one-page", "pages-of-7"])
def test_plans_held_at_a_full_queue_do_not_hold_back_the_others(planner, monkeypatch, page):
    """A step decided the 50 plans due longest; a plan whose queue is full keeps its
    point as the next one, so as many such plans took every step, and no other plan
    of the cell fired (SKIP's "at most 10 s late" became never)."""
    monkeypatch.setattr(plans.actions, "DUE_PAGE", page)
    clock = SimpleNamespace(now=lambda: at("2026-11-02T12:00:00"))
    monkeypatch.setattr(plans.actions, "timezone", clock)
    # given more plans than a step decides, all due on a queue with room for one task
    full = make_queue(planner.client, "full", max_unfinished_tasks=1)
    held = [
        assert_ok(create_plan(planner.client, plan_body(full["id"], name=f"held-{n}"), key=f"held-{n}"), 201)["plan"]
        for n in range(plans.actions.PLANS_PER_STEP + 5)
    ]
    # and, due after them, a plan of another queue
    clock.now = lambda: at("2026-11-02T12:00:30")
    other = make_queue(planner.client, "other")
    victim = assert_ok(create_plan(planner.client, plan_body(other["id"], name="victim"), key="victim"), 201)["plan"]
    assert victim["next_fire_at"] > held[-1]["next_fire_at"]
    # when the trigger loop steps once they are all due
    fire_due_plans(at("2026-11-02T12:01:31"))
    # then the full queue took one task, and the other plan fired all the same
    assert PlanTrigger.objects.filter(plan_id=victim["id"], outcome="CREATED").count() == 1
    assert PlanTrigger.objects.filter(plan_id__in=[plan["id"] for plan in held], outcome="CREATED").count() == 1
    # and the held plans keep their points for when the queue has room
    waiting = Plan.objects.filter(id__in=[plan["id"] for plan in held], next_fire_at=at("2026-11-02T12:01:00"))
    assert waiting.count() == len(held) - 1
    assert_invariants()


@pytest.mark.parametrize(
    ("cron", "start", "expected"),
    [
        # every hour on the fall-back night: each of the 25 hours, the repeated one twice
        (
            "0 * * * *",
            "2026-10-24T23:30:00",
            ["2026-10-25T00:00:00", "2026-10-25T01:00:00", "2026-10-25T02:00:00"],
        ),
        # every two hours on the spring-forward night: 02:00 does not exist, 04:00 CEST is next
        ("0 */2 * * *", "2026-03-28T22:30:00", ["2026-03-28T23:00:00", "2026-03-29T02:00:00"]),
        # a fixed minute and hour: the skipped 02:00 fires at 03:00 CEST, the first time that exists
        ("0 2 * * *", "2026-03-28T02:00:00", ["2026-03-29T01:00:00", "2026-03-30T00:00:00"]),
    ],
    ids=["hourly-fall-back", "every-two-hours-spring-forward", "fixed-spring-forward"],
)
def test_an_expression_repeating_within_the_day_keeps_to_the_clock_through_dst(cron, start, expected):
    """cronsim's rule (and Debian cron's): with a `*` starting its minute or hour
    field, an expression fires at the local times that exist, each occurrence of
    a repeated one; with both fixed, a skipped time fires at the first that
    exists, a repeated one once."""
    schedule = {"cron": cron, "timezone": "Europe/Berlin"}
    points = points_from(schedule, at(start), at(start))
    assert [next(points) for _ in expected] == [at(text) for text in expected]
