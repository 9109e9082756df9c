"""POST /v1/tasks/{id}:resolve: a person's decision about a task whose effect
was unknown (SPEC §7; seed: 待核查任务仍占积压配额 until resolved)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from orbit.models import AuditEntry, Event
from tasks.actions import rounds
from tasks.models import Attempt, Task
from tests.conftest import api_client, post_json
from tests.support.api import assert_error, assert_invalid, assert_ok, make_queue
from tests.support.factories import ALL_SCOPES, make_credential
from tests.support.race import race
from tests.support.tasks import (
    assert_invariants,
    cancel,
    counters,
    ends_unknown,
    get_task,
    idempotency_records,
    invariants_fixture,  # noqa: F401 - fixture "invariants"
    lease_one,
    report,
    resolve,
    start,
    submit_ok,
)


@pytest.fixture
def queue(tenant):
    return make_queue(tenant.client, "work")


@pytest.mark.django_db
@pytest.mark.parametrize("resolution", ["SUCCEEDED", "FAILED"])
def test_final_resolution_frees_the_backlog_slot_once_and_is_audited(tenant, queue, invariants, resolution):
    task = submit_ok(tenant.client, queue["id"], "doubtful")
    ends_unknown(tenant, queue["id"])
    assert counters(queue["id"])["unfinished_tasks"] == 1  # NEEDS_REVIEW holds its slot
    response = resolve(tenant.client, task["id"], "resolve-1", resolution)
    data = assert_ok(response)
    assert data["deduplicated"] is False
    assert data["task"]["state"] == resolution and "finished_at" in data["task"]
    assert counters(queue["id"])["unfinished_tasks"] == 0
    assert counters(queue["id"])["app_unfinished_tasks"] == 0
    audit = AuditEntry.objects.get(action="task.resolve", target_id=task["id"])
    assert audit.before == {"state": "NEEDS_REVIEW"} and audit.after == {"state": resolution, "resolution": resolution}
    assert audit.reason == "checked the ledger" and audit.request_id == response.json()["request_id"]
    states = [e.data.get("state") for e in Event.objects.filter(subject_id=task["id"], type="task.state_changed")]
    assert states[-1] == resolution

    replay = resolve(tenant.client, task["id"], "resolve-1", resolution)
    assert assert_ok(replay) == {**data, "deduplicated": True}
    assert counters(queue["id"])["unfinished_tasks"] == 0
    message = assert_error(resolve(tenant.client, task["id"], "resolve-2", resolution), 409, "STATE_CONFLICT")
    assert message == f"task is {resolution}; only a NEEDS_REVIEW task can be resolved"
    assert_error(resolve(tenant.client, task["id"], "resolve-1", "RETRY"), 409, "IDEMPOTENCY_CONFLICT")
    assert idempotency_records(tenant.namespace_id, "resolve-2") == 0


@pytest.mark.django_db
def test_retry_runs_the_task_again_and_counts_it_once(tenant, queue, invariants):
    task = submit_ok(tenant.client, queue["id"], "again")
    first = ends_unknown(tenant, queue["id"])
    data = assert_ok(resolve(tenant.client, task["id"], "retry-1", "RETRY"))
    assert data["task"]["state"] == "WAITING"
    assert counters(queue["id"])["unfinished_tasks"] == 1
    second = lease_one(tenant, queue["id"])
    assert second["task"]["id"] == task["id"] and second["epoch"] == first["epoch"] + 1
    start(second)
    report(second, "SUCCEEDED", output={"ok": True})
    assert get_task(tenant.client, task["id"])["state"] == "SUCCEEDED"
    assert counters(queue["id"])["unfinished_tasks"] == 0
    states = list(Attempt.objects.filter(task_id=task["id"]).order_by("epoch").values_list("state", flat=True))
    assert states == ["UNKNOWN", "SUCCEEDED"]


@pytest.mark.django_db
def test_retried_keyed_task_waits_for_the_key_and_gets_a_larger_token(tenant, queue, invariants):
    doubtful = submit_ok(tenant.client, queue["id"], "k-1", concurrency_key="account:7")
    first = ends_unknown(tenant, queue["id"])
    sibling = submit_ok(tenant.client, queue["id"], "k-2", concurrency_key="account:7")
    held = lease_one(tenant, queue["id"])
    assert held["task"]["id"] == sibling["id"]
    assert_ok(resolve(tenant.client, doubtful["id"], "retry-k", "RETRY"))
    assert rounds.lease_tasks(worker=held["worker"], limit=4) == []  # the key is held by the sibling
    start(held)
    report(held, "FAILED", error={"code": "no"})
    again = lease_one(tenant, queue["id"])
    assert again["task"]["id"] == doubtful["id"]
    tokens = [int(first["concurrency_token"]), int(held["concurrency_token"]), int(again["concurrency_token"])]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


@pytest.mark.django_db
def test_only_needs_review_can_be_resolved(tenant, queue):
    task = submit_ok(tenant.client, queue["id"], "waiting")
    message = assert_error(resolve(tenant.client, task["id"], "r-waiting"), 409, "STATE_CONFLICT")
    assert message == "task is WAITING; only a NEEDS_REVIEW task can be resolved"
    assert Task.objects.get(id=task["id"]).state == "WAITING"
    assert not AuditEntry.objects.filter(action="task.resolve").exists()


@pytest.mark.django_db
def test_retry_is_refused_past_the_deadline_or_after_a_cancel_request(tenant, queue):
    late = submit_ok(tenant.client, queue["id"], "late")
    ends_unknown(tenant, queue["id"])
    Task.objects.filter(id=late["id"]).update(deadline_at=timezone.now() - timedelta(seconds=1))
    message = assert_error(resolve(tenant.client, late["id"], "r-late", "RETRY"), 409, "STATE_CONFLICT")
    assert message == "task deadline has passed; resolve it SUCCEEDED or FAILED"

    asked = submit_ok(tenant.client, queue["id"], "asked")
    lease = lease_one(tenant, queue["id"])
    start(lease)
    assert_ok(cancel(tenant.client, asked["id"], "cancel-asked"))  # RUNNING: intent only
    report(lease, "UNKNOWN")
    message = assert_error(resolve(tenant.client, asked["id"], "r-asked", "RETRY"), 409, "STATE_CONFLICT")
    assert message == "task has a cancel request; resolve it SUCCEEDED or FAILED"
    assert assert_ok(resolve(tenant.client, asked["id"], "r-asked-2", "FAILED"))["task"]["state"] == "FAILED"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "body"),
    [
        ("resolution", {"reason": "r"}),
        ("resolution", {"resolution": "succeeded", "reason": "r"}),
        ("resolution", {"resolution": "CANCELLED", "reason": "r"}),
        ("resolution", {"resolution": None, "reason": "r"}),
        ("resolution", {"resolution": 1, "reason": "r"}),
        ("reason", {"resolution": "FAILED"}),
        ("reason", {"resolution": "FAILED", "reason": " "}),
        ("note", {"resolution": "FAILED", "reason": "r", "note": "x"}),
    ],
)
def test_invalid_body_names_the_field(tenant, queue, field, body):
    task = submit_ok(tenant.client, queue["id"], "t")
    ends_unknown(tenant, queue["id"])
    assert_invalid(post_json(tenant.client, f"/v1/tasks/{task['id']}:resolve", body, key="bad"), field)
    assert Task.objects.get(id=task["id"]).state == "NEEDS_REVIEW"
    assert idempotency_records(tenant.namespace_id, "bad") == 0


@pytest.mark.django_db
def test_scope_namespace_and_queue_range(tenant, queue):
    task = submit_ok(tenant.client, queue["id"], "t")
    ends_unknown(tenant, queue["id"])
    no_cancel = make_credential(tenant.namespace, scopes=[s for s in ALL_SCOPES if s != "tasks:cancel"])
    assert_error(resolve(api_client(no_cancel.token), task["id"], "s-1"), 403, "PERMISSION_DENIED")
    other_queue = make_queue(tenant.client, "other")
    ranged = make_credential(tenant.namespace, queue_ids=[other_queue["id"]])
    assert_error(resolve(api_client(ranged.token), task["id"], "s-2"), 404, "NOT_FOUND")
    assert_error(resolve(tenant.client, "0" * 32, "s-3"), 404, "NOT_FOUND")
    assert Task.objects.get(id=task["id"]).state == "NEEDS_REVIEW"


@pytest.mark.django_db(transaction=True)
def test_concurrent_resolutions_apply_one(tenant, queue):
    """Eight people resolve one task at once under their own keys: one decision
    lands, the others see it and are refused; the slot is freed once."""
    task = submit_ok(tenant.client, queue["id"], "contested")
    ends_unknown(tenant, queue["id"])
    choices = ["SUCCEEDED", "FAILED", "RETRY", "SUCCEEDED", "FAILED", "RETRY", "SUCCEEDED", "FAILED"]

    def send(n: int) -> int:
        return resolve(api_client(tenant.token), task["id"], f"race-{n}", choices[n]).status_code

    statuses = race(len(choices), send)
    assert sorted(statuses) == [200] + [409] * 7
    winner = choices[statuses.index(200)]
    expected_state = "WAITING" if winner == "RETRY" else winner
    assert Task.objects.get(id=task["id"]).state == expected_state
    assert counters(queue["id"])["unfinished_tasks"] == (1 if winner == "RETRY" else 0)
    assert AuditEntry.objects.filter(action="task.resolve").count() == 1
    assert_invariants()
