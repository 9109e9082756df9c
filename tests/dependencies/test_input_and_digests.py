"""Dependencies' bad input is a 400 naming the field,
never a 500; batch refs; the Idempotency-Key digest covers depends_on and
on_dependency_failure; a batch item refused under the lock and its dependents."""

from __future__ import annotations

import json

import pytest

from tasks.models import Task, TaskDependency
from tests.conftest import post_json
from tests.support.api import assert_error, assert_ok, make_queue
from tests.support.tasks import assert_invariants, configure_queue, submit, submit_ok, task_body

pytestmark = pytest.mark.django_db


def batch(client, items):
    return assert_ok(post_json(client, "/v1/tasks:batch", {"tasks": items}))["results"]


# --- bad values: 400 naming the field --------------------------------------


@pytest.mark.parametrize("value", [None, "cancel", "run", "", 1, True, ["CANCEL"], {"x": 1}, "CANCEL "])
def test_a_bad_on_dependency_failure_is_a_400_naming_it(tenant, queue, value):
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    response = submit(
        tenant.client, queue["id"], f"bad-{json.dumps(value)}", depends_on=[parent], on_dependency_failure=value
    )
    message = assert_error(response, 400, "INVALID_ARGUMENT")
    assert message.startswith("on_dependency_failure"), message
    assert not Task.objects.filter(state="BLOCKED").exists()


@pytest.mark.parametrize(
    "value",
    [
        None,
        {"a": 1},
        7,
        [None],
        [["a" * 32]],
        ["ref:"],
        ["ref:" + "a" * 65],
        ["ref:a b"],
        ["\u00e9" * 32],
        ["a" * 31],
        ["a" * 33],
        [" " + "a" * 31],
    ],
)
def test_a_bad_depends_on_is_a_400_naming_it(tenant, queue, value):
    response = submit(tenant.client, queue["id"], f"bad-{json.dumps(value)}", depends_on=value)
    message = assert_error(response, 400, "INVALID_ARGUMENT")
    assert message.startswith("depends_on"), message


def test_a_lone_surrogate_in_depends_on_is_a_400(tenant, queue):
    raw = (
        f'{{"queue_id":"{queue["id"]}","handler":"echo","handler_version":"v1","payload_version":"v1",'
        '"payload":{},"depends_on":["\\ud800"]}'
    )
    response = tenant.client.post("/v1/tasks", raw, content_type="application/json", HTTP_IDEMPOTENCY_KEY="surrogate")
    message = assert_error(response, 400, "INVALID_ARGUMENT")
    assert message.startswith("depends_on"), message


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (5, "tasks[0].ref:"),
        ("", "tasks[0].ref:"),
        ("a b", "tasks[0].ref:"),
        ("x" * 65, "tasks[0].ref:"),
        (None, "tasks[0].ref:"),
        (["a"], "tasks[0].ref:"),
    ],
)
def test_a_bad_ref_is_a_400_naming_it(tenant, queue, ref, message):
    items = [{"idempotency_key": "a", "ref": ref, "task": task_body(queue["id"])}]
    response = post_json(tenant.client, "/v1/tasks:batch", {"tasks": items})
    assert assert_error(response, 400, "INVALID_ARGUMENT").startswith(message)
    assert not Task.objects.exists()


def test_refs_that_name_no_earlier_item_are_refused_each_by_position(tenant, queue):
    items = [
        {"idempotency_key": "self", "ref": "self", "task": task_body(queue["id"], depends_on=["ref:self"])},
        {"idempotency_key": "later", "task": task_body(queue["id"], depends_on=["ref:after"])},
        {"idempotency_key": "after", "ref": "after", "task": task_body(queue["id"])},
    ]
    results = batch(tenant.client, items)
    assert [r["status"] for r in results] == [400, 400, 201]
    assert results[0]["error"]["message"] == "depends_on[0]: no earlier item of this batch has ref self"
    assert results[1]["error"]["message"] == "depends_on[0]: no earlier item of this batch has ref after"
    assert_invariants()


# --- an earlier item refused under the lock ----------------------------------


def test_a_dependent_of_an_item_refused_for_a_full_queue_is_told_which_ref(tenant, queue):
    """decisions.md "Refs in a batch": an earlier item refused refuses its
    dependents too (400, "the item with ref NAME was not accepted"). The
    earlier item here is refused under the lock (QUEUE_FULL), not by the
    first pass."""
    full = make_queue(tenant.client, "full", max_concurrency=10, rate_per_second=100, max_unfinished_tasks=1)
    submit_ok(tenant.client, full["id"], "filler")
    items = [
        {"idempotency_key": "parent", "ref": "parent", "task": task_body(full["id"])},
        {"idempotency_key": "child", "task": task_body(queue["id"], depends_on=["ref:parent"])},
    ]
    results = batch(tenant.client, items)
    assert results[0]["status"] == 429 and results[0]["error"]["code"] == "QUEUE_FULL"
    assert results[1]["status"] == 400, results[1]
    assert results[1]["error"]["message"] == "depends_on[0]: the item with ref parent was not accepted", results[1]
    assert not TaskDependency.objects.exists()
    assert_invariants()


def test_a_dependent_of_an_item_in_an_unknown_queue_is_told_which_ref(tenant, queue):
    items = [
        {"idempotency_key": "parent", "ref": "parent", "task": task_body("f" * 32)},
        {"idempotency_key": "child", "task": task_body(queue["id"], depends_on=["ref:parent"])},
    ]
    results = batch(tenant.client, items)
    assert results[0]["status"] == 404, results[0]
    assert results[1]["status"] == 400, results[1]
    assert results[1]["error"]["message"] == "depends_on[0]: the item with ref parent was not accepted", results[1]
    assert_invariants()


def test_a_dependent_of_an_item_in_a_retired_queue_is_told_which_ref(tenant, queue):
    retired = make_queue(tenant.client, "retired", max_concurrency=10, rate_per_second=100)
    configure_queue(tenant.client, retired["id"], paused=True)
    current = assert_ok(tenant.client.get(f"/v1/queues/{retired['id']}"))
    assert_ok(
        post_json(
            tenant.client,
            f"/v1/queues/{retired['id']}:retire",
            {"expected_revision": current["revision"], "reason": "gone"},
            key="retire",
        )
    )
    items = [
        {"idempotency_key": "parent", "ref": "parent", "task": task_body(retired["id"])},
        {"idempotency_key": "child", "task": task_body(queue["id"], depends_on=["ref:parent"])},
    ]
    results = batch(tenant.client, items)
    assert results[0]["status"] == 409, results[0]
    assert results[1]["status"] == 400, results[1]
    assert results[1]["error"]["message"] == "depends_on[0]: the item with ref parent was not accepted", results[1]
    assert_invariants()


# --- the digest --------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({}, {"on_dependency_failure": "RUN"}),
        ({"on_dependency_failure": "RUN"}, {"on_dependency_failure": "CANCEL"}),
        ({"on_dependency_failure": "CANCEL"}, {}),
    ],
)
def test_a_replay_with_another_on_dependency_failure_is_a_conflict(tenant, queue, first, second):
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    submit_ok(tenant.client, queue["id"], "child", depends_on=[parent], **first)
    response = submit(tenant.client, queue["id"], "child", depends_on=[parent], **second)
    assert_error(response, 409, "IDEMPOTENCY_CONFLICT")
    again = assert_ok(submit(tenant.client, queue["id"], "child", depends_on=[parent], **first))
    assert again["deduplicated"] is True


def test_a_replay_with_other_or_reordered_depends_on_is_a_conflict(tenant, queue):
    a = submit_ok(tenant.client, queue["id"], "a")["id"]
    b = submit_ok(tenant.client, queue["id"], "b")["id"]
    submit_ok(tenant.client, queue["id"], "child", depends_on=[a, b])
    assert_error(submit(tenant.client, queue["id"], "child", depends_on=[a]), 409, "IDEMPOTENCY_CONFLICT")
    assert_error(submit(tenant.client, queue["id"], "child", depends_on=[b, a]), 409, "IDEMPOTENCY_CONFLICT")
    assert_error(submit(tenant.client, queue["id"], "child"), 409, "IDEMPOTENCY_CONFLICT")
    # and a task first submitted without dependencies cannot be replayed with them
    assert_error(submit(tenant.client, queue["id"], "a", depends_on=[b]), 409, "IDEMPOTENCY_CONFLICT")


def test_a_replay_after_the_parent_finished_answers_the_original_receipt(tenant, queue):
    from tests.support.dependencies import run_one

    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent])
    assert child["state"] == "BLOCKED"
    run_one(tenant, queue["id"], "FAILED")
    assert Task.objects.get(id=child["id"]).state == "CANCELLED"
    again = assert_ok(submit(tenant.client, queue["id"], "child", depends_on=[parent]))
    assert again["deduplicated"] is True and again["task"]["id"] == child["id"]
    # a new submit naming the failed parent is born CANCELLED, counted nowhere
    born = submit_ok(tenant.client, queue["id"], "born", depends_on=[parent])
    assert born["state"] == "CANCELLED" and born["last_error"]["code"] == "DEPENDENCY_FAILED"
    assert born["last_error"]["task_id"] == parent
    assert_invariants()


def test_a_batch_replay_of_a_dependent_keeps_its_ref_resolution(tenant, queue):
    items = [
        {"idempotency_key": "p", "ref": "p", "task": task_body(queue["id"])},
        {"idempotency_key": "c", "task": task_body(queue["id"], depends_on=["ref:p"])},
    ]
    first = batch(tenant.client, items)
    second = batch(tenant.client, items)
    assert [r["status"] for r in second] == [200, 200]
    assert second[1]["task"]["depends_on"] == [first[0]["task"]["id"]]
    # the dependent alone, its ref now naming a replayed earlier item
    third = batch(
        tenant.client, [items[0], {"idempotency_key": "c2", "task": task_body(queue["id"], depends_on=["ref:p"])}]
    )
    assert third[1]["status"] == 201 and third[1]["task"]["depends_on"] == [first[0]["task"]["id"]]
    assert_invariants()


# --- bad values inside batch items ---------------------------------------------


@pytest.mark.parametrize(
    ("task_fields", "message"),
    [
        ({"depends_on": None}, "depends_on"),
        ({"depends_on": ["ref:p"], "on_dependency_failure": None}, "on_dependency_failure"),
        ({"depends_on": ["ref:p"], "on_dependency_failure": "IGNORE"}, "on_dependency_failure"),
        ({"depends_on": ["ref:p", "ref:p"]}, "depends_on[1]: repeats entry 0"),
        ({"depends_on": ["p"]}, "depends_on[0]: must be a task id"),
    ],
)
def test_a_bad_dependency_field_in_a_batch_item_refuses_that_item_only(tenant, queue, task_fields, message):
    items = [
        {"idempotency_key": "p", "ref": "p", "task": task_body(queue["id"])},
        {"idempotency_key": "bad", "ref": "bad", "task": task_body(queue["id"], **task_fields)},
        {"idempotency_key": "below", "task": task_body(queue["id"], depends_on=["ref:bad"])},
    ]
    results = batch(tenant.client, items)
    assert [r["status"] for r in results] == [201, 400, 400], results
    assert results[1]["error"]["code"] == "INVALID_ARGUMENT"
    assert results[1]["error"]["message"].startswith(message), results[1]
    assert results[2]["error"]["message"] == "depends_on[0]: the item with ref bad was not accepted"
    assert_invariants()
