"""Foreign ids answer exactly as unknown ones, and a credential never reads or
changes what its queue range does not grant (SPEC §2: "A single resource
outside the credential's namespace or queue range → 404 NOT_FOUND (never
reveal existence). Permissions are re-checked on every request, replays
included."; SPEC §13: "a foreign id answers exactly as an unknown one").

A queue-ranged credential once could name a task outside its range in
`depends_on` (accepted, where an unknown id is 400; the dependent's assignment
then carried that task's output), and replay another credential's plan
receipts for a plan outside its range."""

from __future__ import annotations

from typing import Any

import pytest

from orbit.fields import new_id
from plans.models import Plan
from tasks.models import Task
from tests.conftest import Tenant, api_client, post_json
from tests.support.api import assert_error, assert_ok, make_queue
from tests.support.factories import ALL_SCOPES, make_credential
from tests.support.plans import change, create_plan, plan_body
from tests.support.tasks import submit, submit_ok, task_body

pytestmark = pytest.mark.django_db


def error_of(response: Any) -> tuple[int, str, str]:
    """What an answer tells: status, code and message (the request id aside)."""
    body = response.json()
    assert set(body) == {"request_id", "error"}, body
    return response.status_code, body["error"]["code"], body["error"]["message"]


@pytest.fixture
def queues(tenant: Tenant) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two queues of the tenant's namespace: one in the ranged credential's range, one outside it."""
    return (
        make_queue(tenant.client, name="seen", max_concurrency=100, rate_per_second=1000),
        make_queue(tenant.client, name="hidden", max_concurrency=100, rate_per_second=1000),
    )


def ranged_client(tenant: Tenant, queue_id: str) -> Any:
    scopes = [*ALL_SCOPES, "plans:manage"]
    return api_client(make_credential(tenant.namespace, scopes=scopes, queue_ids=[queue_id]).token)


# --- depends_on ------------------------------------------------------------


def test_depends_on_a_task_outside_the_queue_range_answers_as_an_unknown_id(tenant, queues):
    seen, hidden = queues
    hidden_task = submit_ok(tenant.client, hidden["id"], "hidden", payload={"secret": 1})
    ranged = ranged_client(tenant, seen["id"])
    assert_error(ranged.get(f"/v1/tasks/{hidden_task['id']}"), 404, "NOT_FOUND")
    unknown = error_of(submit(ranged, seen["id"], "dep-unknown", depends_on=[new_id()]))
    foreign = error_of(submit(ranged, seen["id"], "dep-hidden", depends_on=[hidden_task["id"]]))
    assert unknown == (400, "INVALID_ARGUMENT", "depends_on[0]: task not found")
    assert foreign == unknown
    # nothing was made that waits on (and would be handed the output of) the hidden task
    assert not Task.objects.filter(queue_id=seen["id"]).exists()


def test_a_batch_item_depending_on_a_task_outside_the_queue_range_is_refused_as_unknown(tenant, queues):
    seen, hidden = queues
    hidden_task = submit_ok(tenant.client, hidden["id"], "hidden")
    ranged = ranged_client(tenant, seen["id"])
    items = [
        {"idempotency_key": "batch-own", "task": task_body(seen["id"])},
        {"idempotency_key": "batch-unknown", "task": task_body(seen["id"], depends_on=[new_id()])},
        {"idempotency_key": "batch-hidden", "task": task_body(seen["id"], depends_on=[hidden_task["id"]])},
    ]
    results = assert_ok(post_json(ranged, "/v1/tasks:batch", {"tasks": items}))["results"]
    assert results[0]["status"] == 201
    assert {k: results[1][k] for k in ("status", "error")} == {
        "status": 400,
        "error": {"code": "INVALID_ARGUMENT", "message": "depends_on[0]: task not found"},
    }
    assert {k: results[2][k] for k in ("status", "error")} == {k: results[1][k] for k in ("status", "error")}


def test_a_plan_depending_on_a_task_outside_the_queue_range_answers_as_an_unknown_id(tenant, queues):
    seen, hidden = queues
    hidden_task = submit_ok(tenant.client, hidden["id"], "hidden")
    ranged = ranged_client(tenant, seen["id"])

    def body(name: str, parent: str) -> dict[str, Any]:
        plan = plan_body(seen["id"], name=name)
        plan["definition"]["task"]["depends_on"] = [parent]
        return plan

    unknown = error_of(create_plan(ranged, body("a", new_id()), key="plan-unknown"))
    foreign = error_of(create_plan(ranged, body("b", hidden_task["id"]), key="plan-hidden"))
    assert unknown == (400, "INVALID_ARGUMENT", "definition.task.depends_on[0]: task not found")
    assert foreign == unknown
    assert not Plan.objects.exists()


# --- replays of plan writes --------------------------------------------------


@pytest.mark.parametrize("verb", ["pause", "retire"])
def test_a_plan_change_outside_the_queue_range_is_not_replayed_to_a_ranged_credential(tenant, queues, verb):
    seen, hidden = queues
    planner = api_client(make_credential(tenant.namespace, scopes=[*ALL_SCOPES, "plans:manage"]).token)
    plan = assert_ok(create_plan(planner, plan_body(hidden["id"])), 201)["plan"]
    assert_ok(change(planner, plan["id"], verb, plan["revision"], key="ops-1"))
    ranged = ranged_client(tenant, seen["id"])
    fresh = error_of(change(ranged, plan["id"], verb, plan["revision"], key="fresh"))
    assert fresh == (404, "NOT_FOUND", "plan not found")
    # the same key, body and path as the recorded change: a replay must be re-checked (SPEC §2)
    assert error_of(change(ranged, plan["id"], verb, plan["revision"], key="ops-1")) == fresh
    # the same key with another body: still the plan's 404, not a conflict revealing the record
    assert error_of(change(ranged, plan["id"], verb, plan["revision"], key="ops-1", reason="other")) == fresh


def test_a_plan_create_outside_the_queue_range_is_not_replayed_to_a_ranged_credential(tenant, queues):
    seen, hidden = queues
    planner = api_client(make_credential(tenant.namespace, scopes=[*ALL_SCOPES, "plans:manage"]).token)
    body = plan_body(hidden["id"], name="hidden-plan")
    assert_ok(create_plan(planner, body, key="made-1"), 201)
    ranged = ranged_client(tenant, seen["id"])
    fresh = error_of(create_plan(ranged, body, key="fresh"))
    assert fresh == (404, "NOT_FOUND", "queue not found")
    assert error_of(create_plan(ranged, body, key="made-1")) == fresh
