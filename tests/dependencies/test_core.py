"""Dependencies (SPEC §13) through the verbs: validation, BLOCKED, the
transition in the ending's own transaction, CANCEL and RUN, refs in a batch."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from orbit.models import Event
from tasks.actions import rounds
from tasks.actions.dependencies import FOLLOW_UP_CHUNK, INLINE_EDGES, run_follow_ups
from tasks.actions.permits import settle
from tasks.models import DependencySettlement, Task, TaskDependency
from tests.conftest import new_tenant, post_json
from tests.support.api import assert_error, make_queue
from tests.support.dependencies import fan_out, moves_of, run_one
from tests.support.tasks import (
    assert_invariants,
    cancel,
    lease_one,
    report,
    start,
    submit,
    submit_ok,
    task_body,
    worker_for,
)

pytestmark = pytest.mark.django_db


def state_of(task_id: str) -> str:
    return Task.objects.get(id=task_id).state


@pytest.mark.parametrize(
    ("depends_on", "message"),
    [
        ("x", "depends_on: must be a list of 1 to 1000 task ids"),
        ([], "depends_on: must be a list of 1 to 1000 task ids"),
        (["a" * 32] * 1001, "depends_on: must be a list of 1 to 1000 task ids"),
        (["A" * 32], "depends_on[0]: must be a task id (32 lowercase hex characters) or, in a batch, ref:NAME"),
        ([7], "depends_on[0]: must be a task id (32 lowercase hex characters) or, in a batch, ref:NAME"),
        (["a" * 32, "b" * 32, "a" * 32], "depends_on[2]: repeats entry 0"),
        (["a" * 32], "depends_on[0]: task not found"),
        (["ref:first"], "depends_on[0]: ref:NAME names an earlier item of the same POST /v1/tasks:batch"),
    ],
)
def test_bad_depends_on_is_a_400_naming_the_entry(tenant, queue, depends_on, message):
    response = submit(tenant.client, queue["id"], "bad", depends_on=depends_on)
    assert assert_error(response, 400, "INVALID_ARGUMENT") == message


def test_another_namespaces_task_answers_as_an_unknown_one(tenant, queue):
    other = new_tenant()
    theirs = submit_ok(other.client, make_queue(other.client)["id"], "theirs")
    response = submit(tenant.client, queue["id"], "mine", depends_on=["f" * 32, theirs["id"]])
    assert assert_error(response, 400, "INVALID_ARGUMENT") == "depends_on[0]: task not found"
    response = submit(tenant.client, queue["id"], "mine-2", depends_on=[theirs["id"]])
    assert assert_error(response, 400, "INVALID_ARGUMENT") == "depends_on[0]: task not found"


def test_a_dependent_is_blocked_never_leased_and_made_waiting_by_its_parents_success(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    assert child["state"] == "BLOCKED" and child["depends_on"] == [parent["id"]]
    assert child["on_dependency_failure"] == "CANCEL"
    # the parent is leased; the child never is while blocked
    lease = lease_one(tenant, queue["id"])
    assert lease["task"]["id"] == parent["id"]
    assert rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=10) == []
    start(lease)
    report(lease, "SUCCEEDED", output={"sum": 41})
    # the result's own transaction made it WAITING; its assignment carries the parent's output
    assert state_of(child["id"]) == "WAITING"
    (assigned,) = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=10)
    assert assigned["task"]["id"] == child["id"]
    assert assigned["dependencies"] == [{"task_id": parent["id"], "state": "SUCCEEDED", "output": {"sum": 41}}]
    moves = Event.objects.filter(subject_id=child["id"], type="task.state_changed").order_by("seq")
    assert [(e.data["state"], e.data.get("previous")) for e in moves][:2] == [("BLOCKED", None), ("WAITING", "BLOCKED")]
    assert_invariants()


def test_a_task_whose_dependencies_all_succeeded_is_created_waiting(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    run_one(tenant, queue["id"])
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    assert child["state"] == "WAITING"
    assert TaskDependency.objects.get(task_id=child["id"]).settled


def test_a_failed_dependency_cancels_its_dependents_transitively_in_the_same_transaction(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent", max_attempts=1)
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    grandchild = submit_ok(tenant.client, queue["id"], "grandchild", depends_on=[child["id"]])
    runner = submit_ok(tenant.client, queue["id"], "runner", depends_on=[parent["id"]], on_dependency_failure="RUN")
    run_one(tenant, queue["id"], "FAILED")
    for task_id in (child["id"], grandchild["id"]):
        task = Task.objects.get(id=task_id)
        assert task.state == "CANCELLED" and task.last_error["code"] == "DEPENDENCY_FAILED"
    assert Task.objects.get(id=child["id"]).last_error["task_id"] == parent["id"]
    assert Task.objects.get(id=grandchild["id"]).last_error["task_id"] == child["id"]
    # under RUN it runs all the same, and is told how its dependency ended
    assert state_of(runner["id"]) == "WAITING"
    assigned = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=10)
    assert [a["dependencies"][0]["state"] for a in assigned] == ["FAILED"]
    assert_invariants()


@pytest.mark.parametrize("below", [False, True], ids=["the join a leaf", "the join with a dependent"])
def test_a_diamond_under_a_failed_dependency_cancels_each_task_once(tenant, queue, below):
    """A task that depends on the failed parent and on a sibling the parent's
    failure cancels is reached twice, through each: it is cancelled once, and
    the counters count it once (twice, the backlog counter went below zero)."""
    parent = submit_ok(tenant.client, queue["id"], "parent", max_attempts=1)
    middle = submit_ok(tenant.client, queue["id"], "middle", depends_on=[parent["id"]])
    both = submit_ok(tenant.client, queue["id"], "both", depends_on=[parent["id"], middle["id"]])
    leaves = [submit_ok(tenant.client, queue["id"], f"leaf-{n}", depends_on=[parent["id"]]) for n in range(3)]
    if below:
        leaves.append(submit_ok(tenant.client, queue["id"], "under-both", depends_on=[both["id"]]))
    run_one(tenant, queue["id"], "FAILED")
    ids = [middle["id"], both["id"], *(leaf["id"] for leaf in leaves)]
    assert {task_id: state_of(task_id) for task_id in ids} == dict.fromkeys(ids, "CANCELLED")
    paths = moves_of(ids)
    assert all(path == [("BLOCKED", None), ("CANCELLED", "BLOCKED")] for path in paths.values()), paths
    assert_invariants()


def test_a_chunk_of_cancelled_dependents_is_written_in_a_few_statements(tenant, queue):
    """A failed parent's 500-wide fan-out is cancelled by the follow-up in a bounded
    number of statements, not three or more per dependent: the chunk holds the
    application's counter row while it runs."""
    parent = submit_ok(tenant.client, queue["id"], "parent", max_attempts=1)
    dependents = fan_out(tenant, queue["id"], parent["id"], INLINE_EDGES + FOLLOW_UP_CHUNK)
    run_one(tenant, queue["id"], "FAILED")
    with CaptureQueriesContext(connection) as chunk:
        assert run_follow_ups(settle) == 1
    assert Task.objects.filter(id__in=dependents, state="CANCELLED").count() == len(dependents)
    assert len(chunk.captured_queries) < 40, [q["sql"][:80] for q in chunk.captured_queries]
    assert_invariants()


def test_cancelling_a_task_cancels_its_blocked_dependents(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    assert cancel(tenant.client, parent["id"], "cancel-parent").status_code == 200
    assert state_of(child["id"]) == "CANCELLED"
    # and a blocked task can be cancelled itself
    other = submit_ok(tenant.client, queue["id"], "other")
    blocked = submit_ok(tenant.client, queue["id"], "blocked", depends_on=[other["id"]])
    assert cancel(tenant.client, blocked["id"], "cancel-blocked").status_code == 200
    assert state_of(blocked["id"]) == "CANCELLED"
    assert_invariants()


def test_a_join_waits_for_every_parent_and_a_needs_review_parent_holds_it(tenant, queue):
    parents = [submit_ok(tenant.client, queue["id"], f"p-{n}") for n in range(3)]
    join = submit_ok(tenant.client, queue["id"], "join", depends_on=[p["id"] for p in parents])
    assert Task.objects.get(id=join["id"]).blocked_by == 3
    run_one(tenant, queue["id"])
    run_one(tenant, queue["id"], "UNKNOWN")  # NEEDS_REVIEW
    run_one(tenant, queue["id"])
    assert state_of(join["id"]) == "BLOCKED"
    reviewed = next(p for p in parents if state_of(p["id"]) == "NEEDS_REVIEW")
    body = {"resolution": "SUCCEEDED", "reason": "checked"}
    assert post_json(tenant.client, f"/v1/tasks/{reviewed['id']}:resolve", body, key="resolve-1").status_code == 200
    assert state_of(join["id"]) == "WAITING"
    assert_invariants()


def test_a_batch_names_earlier_items_by_ref(tenant, queue):
    items = [
        {"idempotency_key": "split", "ref": "split", "task": task_body(queue["id"])},
        {"idempotency_key": "part-1", "ref": "p1", "task": task_body(queue["id"], depends_on=["ref:split"])},
        {"idempotency_key": "join", "task": task_body(queue["id"], depends_on=["ref:split", "ref:p1"])},
        {"idempotency_key": "bad", "task": task_body(queue["id"], depends_on=["ref:nope"])},
    ]
    results = post_json(tenant.client, "/v1/tasks:batch", {"tasks": items}).json()["data"]["results"]
    split, part, join, bad = results
    assert [r["status"] for r in results] == [201, 201, 201, 400]
    assert bad["error"]["message"] == "depends_on[0]: no earlier item of this batch has ref nope"
    assert part["task"]["depends_on"] == [split["task"]["id"]] and part["task"]["state"] == "BLOCKED"
    assert join["task"]["depends_on"] == [split["task"]["id"], part["task"]["id"]]
    assert Task.objects.get(id=split["task"]["id"]).has_dependents
    # a replay of the whole batch answers the same tasks
    again = post_json(tenant.client, "/v1/tasks:batch", {"tasks": items[:3]}).json()["data"]["results"]
    assert [r["task"]["id"] for r in again] == [r["task"]["id"] for r in results[:3]]


def test_a_wide_fan_out_settles_past_the_inline_budget_in_a_follow_up(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    items = [
        {"idempotency_key": f"fan-{n}", "task": task_body(queue["id"], depends_on=[parent["id"]])} for n in range(500)
    ]
    results = post_json(tenant.client, "/v1/tasks:batch", {"tasks": items}).json()["data"]["results"]
    dependents = [r["task"]["id"] for r in results]
    run_one(tenant, queue["id"])
    waiting = Task.objects.filter(id__in=dependents, state="WAITING").count()
    assert waiting == INLINE_EDGES
    assert DependencySettlement.objects.filter(task_id=parent["id"]).exists()
    run_follow_ups(settle)
    assert Task.objects.filter(id__in=dependents, state="WAITING").count() == 500
    assert not DependencySettlement.objects.exists()
    assert_invariants()


def test_a_ref_and_the_id_it_resolves_to_are_one_dependency_named_twice(tenant, queue):
    split = {"idempotency_key": "split", "ref": "split", "task": task_body(queue["id"])}
    first = post_json(tenant.client, "/v1/tasks:batch", {"tasks": [split]}).json()["data"]["results"][0]
    split_id = first["task"]["id"]
    # replayed, the split answers its task: naming it by ref and by id names one task twice
    join = {"idempotency_key": "join", "task": task_body(queue["id"], depends_on=["ref:split", split_id])}
    results = post_json(tenant.client, "/v1/tasks:batch", {"tasks": [split, join]}).json()["data"]["results"]
    assert [r["status"] for r in results] == [200, 400]
    assert results[1]["error"]["code"] == "INVALID_ARGUMENT"
    assert results[1]["error"]["message"] == "depends_on[1]: repeats entry 0"
    assert not TaskDependency.objects.filter(depends_on_id=split_id).exists()
    assert_invariants()
