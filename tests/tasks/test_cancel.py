"""POST /v1/tasks/{id}:cancel (SPEC §5; seed: 运行中取消只保存意图，仍占名额)."""

from __future__ import annotations

import pytest

from orbit.errors import TaskCancelled
from orbit.models import AuditEntry, Event
from tasks.actions import rounds
from tasks.models import Attempt, Task
from tests.conftest import api_client, post_json
from tests.support.api import assert_error, assert_invalid, assert_ok, make_queue, parse_time
from tests.support.factories import make_credential
from tests.support.tasks import (
    assert_invariants,
    cancel,
    connect_fixture,  # noqa: F401 - fixture "connect"
    counters,
    get_queue,
    get_task,
    idempotency_records,
    invariants_fixture,  # noqa: F401 - fixture "invariants"
    lease_one,
    submit_ok,
)


@pytest.fixture
def queue(tenant):
    return make_queue(tenant.client, "work")


@pytest.mark.django_db
def test_waiting_task_is_cancelled_and_frees_one_backlog_slot(tenant, queue):
    # given two waiting tasks
    task = submit_ok(tenant.client, queue["id"], "t-1")
    submit_ok(tenant.client, queue["id"], "t-2")
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "2"
    # when one is cancelled
    response = cancel(tenant.client, task["id"], "c-1", reason="customer withdrew")
    # then 200 with the task CANCELLED and finished, and the backlog drops by exactly one
    data = assert_ok(response)
    assert data["deduplicated"] is False
    cancelled = data["task"]
    assert cancelled["id"] == task["id"] and cancelled["state"] == "CANCELLED"
    assert "finished_at" in cancelled and "payload" in cancelled
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "1"
    assert counters(queue["id"])["app_unfinished_tasks"] == 1
    assert get_task(tenant.client, task["id"])["state"] == "CANCELLED"
    # and the change is audited with actor, reason, before/after and request id
    audit = AuditEntry.objects.get(action="task.cancel", target_id=task["id"])
    assert audit.namespace_id == tenant.namespace_id and audit.target_type == "task"
    assert audit.reason == "customer withdrew"
    assert audit.before["state"] == "WAITING" and audit.after["state"] == "CANCELLED"
    assert audit.request_id == response.json()["request_id"]
    assert audit.credential_id == tenant.token.split("_")[1]
    assert Event.objects.filter(subject_id=task["id"], type="task.cancel").exists()
    assert Event.objects.filter(subject_id=task["id"], type="task.state_changed", data__state="CANCELLED").exists()
    assert_invariants()


@pytest.mark.django_db
def test_cancelling_again_answers_200_with_the_same_task(tenant, queue):
    task = submit_ok(tenant.client, queue["id"], "t-1")
    first = assert_ok(cancel(tenant.client, task["id"], "c-1"))["task"]
    # a replay under the same key is the original receipt
    replay = assert_ok(cancel(tenant.client, task["id"], "c-1"))
    assert replay == {"deduplicated": True, "task": first}
    # a new cancel under a new key is 200 with the same task, nothing counted twice
    again = assert_ok(cancel(tenant.client, task["id"], "c-2"))
    assert again["task"] == first
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "0"
    assert AuditEntry.objects.filter(action="task.cancel").count() == 1
    assert_invariants()


@pytest.mark.django_db
def test_leased_unstarted_task_is_cancelled_and_its_permits_released(tenant, queue):
    # given a task leased to a worker but not started
    task = submit_ok(tenant.client, queue["id"], "t-1", concurrency_key="printer")
    leased = lease_one(tenant, queue["id"])
    assert counters(queue["id"])["active_permits"] == 1 and counters(queue["id"])["reserved_starts"] == 1
    # when it is cancelled
    cancelled = assert_ok(cancel(tenant.client, task["id"], "c-1"))["task"]
    # then CANCELLED now; the attempt ends CANCELLED and every permit is back
    assert cancelled["state"] == "CANCELLED"
    attempt = Attempt.objects.get(id=leased["attempt_id"])
    assert attempt.state == "CANCELLED" and attempt.finished_at is not None
    after = counters(queue["id"])
    assert after["active_permits"] == 0 and after["reserved_starts"] == 0
    assert after["app_active_attempts"] == 0 and after["unfinished_tasks"] == 0
    assert AuditEntry.objects.get(action="task.cancel").before["state"] == "LEASED"
    assert_invariants()
    # and the worker's Start is refused
    with pytest.raises(TaskCancelled):
        rounds.approve_start(worker=leased["worker"], attempt_id=leased["attempt_id"], epoch=1)
    assert Task.objects.get(id=task["id"]).attempts == 0


@pytest.mark.django_db
@pytest.mark.parametrize("outcome", ["SUCCEEDED", "FAILED"])
def test_finished_task_cannot_be_cancelled(tenant, queue, outcome):
    # given a task that ran to SUCCEEDED / FAILED
    task = submit_ok(tenant.client, queue["id"], "t-1", max_attempts=1)
    leased = lease_one(tenant, queue["id"])
    rounds.approve_start(worker=leased["worker"], attempt_id=leased["attempt_id"], epoch=1)
    rounds.record_result(
        worker=leased["worker"],
        attempt_id=leased["attempt_id"],
        epoch=1,
        outcome=outcome,
        retryable=False,
        output=None,
        error=None,
    )
    assert get_task(tenant.client, task["id"])["state"] == outcome
    # when it is cancelled: 409 STATE_CONFLICT, no record, no audit
    assert_error(cancel(tenant.client, task["id"], "c-1"), 409, "STATE_CONFLICT")
    assert idempotency_records(tenant.namespace_id, "c-1") == 0
    assert not AuditEntry.objects.filter(action="task.cancel").exists()
    assert get_task(tenant.client, task["id"])["state"] == outcome


@pytest.mark.django_db
def test_cancel_needs_a_reason(tenant, queue):
    task = submit_ok(tenant.client, queue["id"], "t-1")
    assert_invalid(post_json(tenant.client, f"/v1/tasks/{task['id']}:cancel", {}, key="c-1"), "reason")
    assert_invalid(post_json(tenant.client, f"/v1/tasks/{task['id']}:cancel", {"reason": "  "}, key="c-2"), "reason")
    assert_invalid(
        post_json(tenant.client, f"/v1/tasks/{task['id']}:cancel", {"reason": "x", "force": True}, key="c-3"), "force"
    )
    assert get_task(tenant.client, task["id"])["state"] == "WAITING"


@pytest.mark.django_db
def test_cancel_scope_and_range(tenant, queue):
    other = make_queue(tenant.client, "other")
    task = submit_ok(tenant.client, other["id"], "t-1")
    reader = api_client(make_credential(tenant.namespace, scopes=["tasks:read"]).token)
    assert_error(cancel(reader, task["id"], "c-1"), 403, "PERMISSION_DENIED")
    narrow = api_client(make_credential(tenant.namespace, queue_ids=[queue["id"]]).token)
    assert_error(cancel(narrow, task["id"], "c-2"), 404, "NOT_FOUND")
    assert_error(cancel(tenant.client, "a" * 32, "c-3"), 404, "NOT_FOUND")
    assert get_task(tenant.client, task["id"])["state"] == "WAITING"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("invariants")
def test_running_task_only_records_the_intent_and_the_worker_sees_it(tenant, queue, connect):
    # given a task a live worker has started
    task = submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    worker.hello_as([queue["id"]], capacity=1)
    assign = worker.assignment()
    worker.start_ok(assign)
    lease_before = parse_time(worker.renew(assign)["lease_expires_at"])
    # when it is cancelled
    response = cancel(tenant.client, task["id"], "c-1")
    # then 200, still RUNNING with cancel_requested, still holding its slot
    running = assert_ok(response)["task"]
    assert running["state"] == "RUNNING" and running["cancel_requested"] is True
    assert "finished_at" not in running
    state = counters(queue["id"])
    assert state["active_permits"] == 1 and state["unfinished_tasks"] == 1 and state["app_active_attempts"] == 1
    assert Attempt.objects.get(id=assign["attempt_id"]).state == "RUNNING"
    audit = AuditEntry.objects.get(action="task.cancel")
    assert audit.before == {"state": "RUNNING", "cancel_requested": False}
    assert audit.after == {"state": "RUNNING", "cancel_requested": True}
    # and the worker learns it on its next renewal (which still extends the lease)
    renewed = worker.renew(assign)
    assert renewed["type"] == "task.renew.ok" and renewed["cancel_requested"] is True, renewed
    assert parse_time(renewed["lease_expires_at"]) >= lease_before
    # and cancelling again is 200 with the same task, which changes nothing and so is not audited again
    again = assert_ok(cancel(tenant.client, task["id"], "c-2"))["task"]
    assert again == running
    assert counters(queue["id"])["active_permits"] == 1
    assert AuditEntry.objects.filter(action="task.cancel").count() == 1
    assert Event.objects.filter(subject_id=task["id"], type="task.cancel").count() == 1
    worker.close()
