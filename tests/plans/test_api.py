"""The plan API (SPEC §7): create, read, versions, pause/resume/retire, and
the rules that tie plans to their queue."""

from __future__ import annotations

import pytest

from orbit.models import AuditEntry, IdempotencyRecord
from plans.models import Plan, PlanVersion
from tests.conftest import api_client, post_json
from tests.support.api import HEX32, RFC3339_UTC, assert_error, assert_invalid, assert_ok, make_queue
from tests.support.factories import make_credential
from tests.support.plans import TASK, change, create_plan, plan_body
from tests.support.race import race
from tests.support.tasks import configure_queue

PLAN_KEYS = {
    "id",
    "namespace_id",
    "queue_id",
    "name",
    "state",
    "version",
    "revision",
    "schedule",
    "misfire",
    "definition",
}


@pytest.fixture
def queue(planner):
    return make_queue(planner.client, "reports")


@pytest.mark.django_db
def test_create_returns_the_plan_with_its_next_point_and_replays(planner, queue):
    body = plan_body(queue["id"])
    response = create_plan(planner.client, body)
    data = assert_ok(response, 201)
    plan = data["plan"]
    assert data["deduplicated"] is False
    assert set(plan) == PLAN_KEYS | {"next_fire_at"}
    assert HEX32.fullmatch(plan["id"]) and RFC3339_UTC.fullmatch(plan["next_fire_at"])
    assert (plan["state"], plan["version"], plan["revision"]) == ("ACTIVE", 1, "1")
    assert plan["schedule"] == body["schedule"] and plan["misfire"] == body["misfire"]
    assert plan["definition"] == body["definition"]  # as sent: defaults are not written in
    assert AuditEntry.objects.filter(action="plan.created", target_id=plan["id"]).count() == 1

    replay = create_plan(planner.client, body)
    assert assert_ok(replay) == {**data, "deduplicated": True}
    assert_error(create_plan(planner.client, {**body, "name": "other"}), 409, "IDEMPOTENCY_CONFLICT")
    taken = create_plan(planner.client, body, key="plan-2")
    assert assert_error(taken, 409, "STATE_CONFLICT") == "plan name 'nightly' is already taken in this namespace"
    assert Plan.objects.count() == 1
    assert assert_ok(planner.client.get(f"/v1/plans/{plan['id']}")) == plan
    listed = assert_ok(planner.client.get("/v1/plans"))
    assert listed == {"items": [plan], "next_page_token": ""}


@pytest.mark.django_db
def test_cron_schedule_with_a_time_zone(planner, queue):
    body = plan_body(queue["id"], schedule={"cron": "30 2 * * *", "timezone": "Europe/Berlin"})
    plan = assert_ok(create_plan(planner.client, body), 201)["plan"]
    assert plan["next_fire_at"].endswith(("00:30:00Z", "01:30:00Z"))  # 02:30 in Berlin, CET or CEST


@pytest.mark.django_db
def test_update_makes_a_new_version_and_pause_resume_retire_follow_the_revision(planner, queue):
    plan = assert_ok(create_plan(planner.client, plan_body(queue["id"])), 201)["plan"]
    new_body = {
        "expected_revision": "1",
        "reason": "hourly now",
        "schedule": {"interval_seconds": 3600},
        "misfire": {"policy": "LATEST", "catch_up_window_seconds": 60},
        "definition": {"task": {**TASK, "priority": 9}},
    }
    updated = assert_ok(post_json(planner.client, f"/v1/plans/{plan['id']}:update", new_body, key="u1"))["plan"]
    assert (updated["version"], updated["revision"]) == (2, "2")
    assert updated["schedule"] == {"interval_seconds": 3600}
    assert list(
        PlanVersion.objects.filter(plan_id=plan["id"]).values_list("version", flat=True).order_by("version")
    ) == [1, 2]

    paused = assert_ok(change(planner.client, plan["id"], "pause", "2", "p1"))["plan"]
    assert paused["state"] == "PAUSED" and "next_fire_at" not in paused and paused["revision"] == "3"
    assert (
        assert_error(change(planner.client, plan["id"], "pause", "3", "p2"), 409, "STATE_CONFLICT") == "plan is PAUSED"
    )
    stale = change(planner.client, plan["id"], "resume", "2", "r0")
    assert assert_error(stale, 409, "STATE_CONFLICT") == "expected_revision 2 does not match current revision 3"
    resumed = assert_ok(change(planner.client, plan["id"], "resume", "3", "r1"))["plan"]
    assert resumed["state"] == "ACTIVE" and "next_fire_at" in resumed
    retired = assert_ok(change(planner.client, plan["id"], "retire", "4", "x1"))["plan"]
    assert retired["state"] == "RETIRED" and retired["revision"] == "5"
    assert (
        assert_error(change(planner.client, plan["id"], "resume", "5", "r2"), 409, "STATE_CONFLICT")
        == "plan is retired"
    )
    actions = list(AuditEntry.objects.filter(target_id=plan["id"]).order_by("id").values_list("action", flat=True))
    assert actions == ["plan.created", "plan.updated", "plan.paused", "plan.resumed", "plan.retired"]
    assert assert_ok(planner.client.get(f"/v1/plans/{plan['id']}"))["state"] == "RETIRED"


@pytest.mark.django_db
def test_a_queue_with_an_active_plan_cannot_be_retired(planner, queue):
    plan = assert_ok(create_plan(planner.client, plan_body(queue["id"])), 201)["plan"]
    paused = configure_queue(planner.client, queue["id"], paused=True)["queue"]
    retire = {"expected_revision": paused["revision"], "reason": "done"}
    post = post_json
    message = assert_error(
        post(planner.client, f"/v1/queues/{queue['id']}:retire", retire, key="qr1"), 409, "STATE_CONFLICT"
    )
    assert message == "queue is targeted by an active plan; pause or retire it first"
    assert_ok(change(planner.client, plan["id"], "pause", "1", "p1"))
    assert_ok(post(planner.client, f"/v1/queues/{queue['id']}:retire", retire, key="qr2"))
    # a paused plan of a retired queue cannot come back, nor can a new plan target it
    assert (
        assert_error(change(planner.client, plan["id"], "resume", "2", "r1"), 409, "STATE_CONFLICT")
        == "queue is retired"
    )
    again = create_plan(planner.client, plan_body(queue["id"], name="again"), key="plan-again")
    assert assert_error(again, 409, "STATE_CONFLICT") == "queue is retired"


def without(body: dict, *path: str) -> dict:
    copy = {**body, "schedule": dict(body["schedule"]), "misfire": dict(body["misfire"])}
    copy["definition"] = {"task": dict(body["definition"]["task"])}
    target = copy
    for part in path[:-1]:
        target = target[part]
    del target[path[-1]]
    return copy


def replaced(body: dict, value: object, *path: str) -> dict:
    copy = without(body, *path) if _has(body, path) else {**body}
    target = copy
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return copy


def _has(body: dict, path: tuple[str, ...]) -> bool:
    target = body
    for part in path:
        if not isinstance(target, dict) or part not in target:
            return False
        target = target[part]
    return True


INVALID = [
    ("name", lambda b: without(b, "name")),
    ("name", lambda b: replaced(b, "", "name")),
    ("name", lambda b: replaced(b, "a b", "name")),
    ("queue_id", lambda b: without(b, "queue_id")),
    ("queue_id", lambda b: replaced(b, 5, "queue_id")),
    ("schedule", lambda b: without(b, "schedule")),
    ("schedule", lambda b: replaced(b, {}, "schedule")),
    ("schedule", lambda b: replaced(b, {"interval_seconds": 60, "cron": "* * * * *"}, "schedule")),
    ("schedule.interval_seconds", lambda b: replaced(b, 0, "schedule", "interval_seconds")),
    ("schedule.interval_seconds", lambda b: replaced(b, "60", "schedule", "interval_seconds")),
    ("schedule.timezone", lambda b: replaced(b, {"interval_seconds": 60, "timezone": "UTC"}, "schedule")),
    ("schedule.cron", lambda b: replaced(b, {"cron": "61 * * * *"}, "schedule")),
    ("schedule.cron", lambda b: replaced(b, {"cron": "every day"}, "schedule")),
    ("schedule.timezone", lambda b: replaced(b, {"cron": "* * * * *", "timezone": "Mars/Olympus"}, "schedule")),
    # cronsim would read a sixth field as seconds (firing every second)
    ("schedule.cron", lambda b: replaced(b, {"cron": "* * * * * */2"}, "schedule")),
    ("schedule.cron", lambda b: replaced(b, {"cron": "0 0 * * * *"}, "schedule")),
    ("schedule.cron", lambda b: replaced(b, {"cron": "* * * *"}, "schedule")),
    # names a host's zone database holds that are not IANA zones (localtime differs between nodes)
    ("schedule.timezone", lambda b: replaced(b, {"cron": "* * * * *", "timezone": "localtime"}, "schedule")),
    ("schedule.timezone", lambda b: replaced(b, {"cron": "* * * * *", "timezone": "posixrules"}, "schedule")),
    ("schedule.timezone", lambda b: replaced(b, {"cron": "* * * * *", "timezone": "Factory"}, "schedule")),
    ("schedule.timezone", lambda b: replaced(b, {"cron": "* * * * *", "timezone": "../../etc/passwd"}, "schedule")),
    ("schedule.every", lambda b: replaced(b, {"every": 5}, "schedule")),
    ("misfire", lambda b: without(b, "misfire")),
    ("misfire.policy", lambda b: replaced(b, "NEVER", "misfire", "policy")),
    ("misfire.catch_up_window_seconds", lambda b: replaced(b, {"policy": "LATEST"}, "misfire")),
    (
        "misfire.catch_up_window_seconds",
        lambda b: replaced(b, {"policy": "SKIP", "catch_up_window_seconds": 5}, "misfire"),
    ),
    ("misfire.catch_up_window_seconds", lambda b: replaced(b, 0, "misfire", "catch_up_window_seconds")),
    ("definition", lambda b: without(b, "definition")),
    ("definition.task", lambda b: replaced(b, {}, "definition")),
    ("definition.task.handler", lambda b: without(b, "definition", "task", "handler")),
    ("definition.task.payload", lambda b: replaced(b, None, "definition", "task", "payload")),
    ("definition.task.priority", lambda b: replaced(b, 10, "definition", "task", "priority")),
    ("definition.task.concurrency_key", lambda b: replaced(b, " padded", "definition", "task", "concurrency_key")),
    ("definition.task.queue_id", lambda b: replaced(b, "0" * 32, "definition", "task", "queue_id")),
    (
        "definition.task.available_at",
        lambda b: replaced(b, "2030-01-01T00:00:00Z", "definition", "task", "available_at"),
    ),
    ("definition.task.deadline_at", lambda b: replaced(b, "2030-01-01T00:00:00Z", "definition", "task", "deadline_at")),
    # the field's own refusals by position, which DRF cannot name
    ("definition.task.depends_on", lambda b: replaced(b, [], "definition", "task", "depends_on")),
    ("definition.task.depends_on[0]", lambda b: replaced(b, ["zz"], "definition", "task", "depends_on")),
    ("definition.task.depends_on[1]", lambda b: replaced(b, ["a" * 32] * 2, "definition", "task", "depends_on")),
    ("extra", lambda b: replaced(b, 1, "extra")),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("field", "make"), INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_bodies_name_the_field(planner, queue, field, make):
    assert_invalid(create_plan(planner.client, make(plan_body(queue["id"]))), field)
    assert Plan.objects.count() == 0 and not IdempotencyRecord.objects.filter(key="plan-1").exists()


@pytest.mark.django_db
def test_a_repeated_dependency_is_named_by_its_place_in_the_definition(planner, queue):
    # (not "definition.task.depends_on[1]: repeats depends_on[0]", a path the body does not have)
    body = replaced(plan_body(queue["id"]), ["a" * 32] * 2, "definition", "task", "depends_on")
    answer = create_plan(planner.client, body)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "definition.task.depends_on[1]: repeats entry 0"


@pytest.mark.django_db
def test_scope_queue_range_and_namespace(planner, tenant, queue):
    assert_error(create_plan(tenant.client, plan_body(queue["id"])), 403, "PERMISSION_DENIED")
    assert_error(tenant.client.get("/v1/plans"), 403, "PERMISSION_DENIED")
    assert_error(create_plan(planner.client, plan_body("0" * 32)), 404, "NOT_FOUND")
    plan = assert_ok(create_plan(planner.client, plan_body(queue["id"])), 201)["plan"]
    other = make_queue(planner.client, "other")
    ranged = api_client(make_credential(planner.namespace, scopes=["plans:manage"], queue_ids=[other["id"]]).token)
    assert_error(ranged.get(f"/v1/plans/{plan['id']}"), 404, "NOT_FOUND")
    assert_error(change(ranged, plan["id"], "pause", "1", "p"), 404, "NOT_FOUND")
    assert assert_ok(ranged.get("/v1/plans"))["items"] == []
    assert_error(create_plan(ranged, plan_body(queue["id"], name="x"), key="r"), 404, "NOT_FOUND")
    for bad in ("0" * 32, "ABC", "x" * 40):
        assert_error(planner.client.get(f"/v1/plans/{bad}"), 404, "NOT_FOUND")


@pytest.mark.django_db(transaction=True)
def test_concurrent_creates_of_one_name_make_one_plan(planner, queue):
    def send(n: int) -> int:
        return create_plan(api_client(planner.token), plan_body(queue["id"]), key=f"race-{n}").status_code

    assert sorted(race(8, send)) == [201] + [409] * 7
    assert Plan.objects.count() == 1 and PlanVersion.objects.count() == 1


@pytest.mark.django_db
def test_a_definitions_payload_over_the_limit_is_413_naming_it_in_the_definition(planner, queue):
    body = replaced(plan_body(queue["id"]), {"blob": "x" * (256 * 1024)}, "definition", "task", "payload")
    message = assert_error(create_plan(planner.client, body), 413, "PAYLOAD_TOO_LARGE")
    assert message.startswith("definition.task.payload: "), message
    assert Plan.objects.count() == 0


@pytest.mark.django_db
def test_a_cron_expression_no_date_matches_says_so(planner, queue):
    body = replaced(plan_body(queue["id"]), {"cron": "0 0 */29 2 MON#5"}, "schedule")
    message = assert_invalid(create_plan(planner.client, body), "schedule.cron")
    assert message == "schedule.cron: matches no date: no day has every field it names"
