"""Dependencies (SPEC §4, §5, §13) through the less travelled verbs —
a parent leased then cancelled, released, cancelled while running; a queue
holding BLOCKED tasks cannot be retired; BLOCKED in the task list; the
dependents list paged while its edges settle; counters after each."""

from __future__ import annotations

import pytest

from tasks.actions import rounds
from tasks.actions.endings import release_attempt
from tasks.models import Attempt, TaskDependency
from tests.conftest import post_json
from tests.support.api import assert_error, assert_ok, make_queue
from tests.support.dependencies import row, run_one
from tests.support.tasks import (
    assert_invariants,
    cancel,
    configure_queue,
    get_queue,
    lease_one,
    report,
    start,
    submit,
    submit_ok,
    worker_for,
)

pytestmark = pytest.mark.django_db


def test_a_leased_unstarted_parent_cancelled_cancels_its_dependents_and_frees_its_permit(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent])["id"]
    runner = submit_ok(tenant.client, queue["id"], "runner", depends_on=[parent], on_dependency_failure="RUN")["id"]
    lease = lease_one(tenant, queue["id"])
    assert assert_ok(cancel(tenant.client, parent, "c"))["task"]["state"] == "CANCELLED"
    assert Attempt.objects.get(id=lease["attempt_id"]).state == "CANCELLED"
    assert row(child).state == "CANCELLED" and row(child).last_error == {
        "code": "DEPENDENCY_FAILED",
        "message": f"dependency {parent} ended CANCELLED",
        "task_id": parent,
        "state": "CANCELLED",
    }
    assert row(runner).state == "WAITING"
    (assigned,) = rounds.lease_tasks(worker=worker_for(tenant, queue["id"], worker_id="w2"), limit=10)
    assert assigned["task"]["id"] == runner
    assert assigned["dependencies"] == [{"task_id": parent, "state": "CANCELLED"}]
    assert_invariants()


def test_a_released_parent_keeps_its_dependents_blocked(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent])["id"]
    lease = lease_one(tenant, queue["id"])
    release_attempt(worker=lease["worker"], attempt_id=lease["attempt_id"], epoch=lease["epoch"], reason="busy")
    assert row(parent).state == "WAITING"
    assert (row(child).state, row(child).blocked_by) == ("BLOCKED", 1)
    run_one(tenant, queue["id"], output={"ok": 1})
    assert row(child).state == "WAITING"
    assert_invariants()


@pytest.mark.parametrize(("outcome", "child_state"), [("FAILED", "CANCELLED"), ("SUCCEEDED", "WAITING")])
def test_a_running_parent_cancelled_ends_as_its_worker_says_and_so_do_its_dependents(
    tenant, queue, outcome, child_state
):
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent])["id"]
    lease = lease_one(tenant, queue["id"])
    start(lease)
    answered = assert_ok(cancel(tenant.client, parent, "c"))["task"]
    assert answered["state"] == "RUNNING" and answered["cancel_requested"] is True
    assert row(child).state == "BLOCKED"
    report(lease, outcome, error=None if outcome == "SUCCEEDED" else {"code": "stopped"})
    assert row(child).state == child_state
    if child_state == "CANCELLED":
        assert row(child).last_error["state"] == "CANCELLED"
    assert_invariants()


def test_a_queue_holding_blocked_tasks_cannot_be_retired(tenant, queue):
    held = make_queue(tenant.client, "held", max_concurrency=10, rate_per_second=100)
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    child = submit_ok(tenant.client, held["id"], "child", depends_on=[parent])["id"]
    configure_queue(tenant.client, held["id"], paused=True)
    state = get_queue(tenant.client, held["id"])
    assert state["unfinished_tasks"] == "1"
    body = {"expected_revision": state["revision"], "reason": "done"}
    assert_error(
        post_json(tenant.client, f"/v1/queues/{held['id']}:retire", body, key="retire-1"), 409, "STATE_CONFLICT"
    )
    # once the child is cancelled, the queue retires; a dependent submitted there then is refused
    assert_ok(cancel(tenant.client, child, "c"))
    state = get_queue(tenant.client, held["id"])
    assert state["unfinished_tasks"] == "0"
    body = {"expected_revision": state["revision"], "reason": "done"}
    assert_ok(post_json(tenant.client, f"/v1/queues/{held['id']}:retire", body, key="retire-2"))
    assert_error(submit(tenant.client, held["id"], "late", depends_on=[parent]), 409, "STATE_CONFLICT")
    # and one whose dependency failed already is refused there too, not born CANCELLED
    failed = submit_ok(tenant.client, queue["id"], "fails", max_attempts=1, priority=9)["id"]
    run_one(tenant, queue["id"], "FAILED")
    assert row(failed).state == "FAILED"
    assert_error(submit(tenant.client, held["id"], "late-2", depends_on=[failed]), 409, "STATE_CONFLICT")
    assert_invariants()


def test_blocked_tasks_are_listed_by_state(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent])["id"]
    listed = assert_ok(tenant.client.get("/v1/tasks", {"queue_id": queue["id"], "state": "BLOCKED"}))
    assert [item["id"] for item in listed["items"]] == [child]
    assert listed["items"][0]["depends_on"] == [parent]
    assert "payload" not in listed["items"][0]


def test_the_dependents_list_pages_once_over_edges_settling_between_pages(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent", priority=9)["id"]
    others = [submit_ok(tenant.client, queue["id"], f"other-{n}", priority=0)["id"] for n in range(3)]
    dependents = []
    for n in range(12):
        extra = [others[n % 3]] if n % 2 else []
        dependents.append(submit_ok(tenant.client, queue["id"], f"dep-{n}", depends_on=[parent, *extra])["id"])
    seen: list[str] = []
    token = None
    pages = 0
    while True:
        params = {"page_size": 5, **({"page_token": token} if token else {})}
        page = assert_ok(tenant.client.get(f"/v1/tasks/{parent}/dependents", params))
        seen += [item["id"] for item in page["items"]]
        pages += 1
        if pages == 1:
            # between pages: some dependents cancelled, and the parent ends (every edge settles)
            for task_id in dependents[:3] + dependents[7:9]:
                assert_ok(cancel(tenant.client, task_id, f"c-{task_id}"))
            assert run_one(tenant, queue["id"])["task"]["id"] == parent
            assert not TaskDependency.objects.filter(depends_on_id=parent, settled=False).exists()
        token = page["next_page_token"]
        if not token:
            break
    assert seen == dependents
    assert_invariants()


def test_a_born_cancelled_dependent_takes_no_slot_even_in_a_full_queue(tenant, queue):
    full = make_queue(tenant.client, "full", max_concurrency=10, rate_per_second=100, max_unfinished_tasks=1)
    failed = submit_ok(tenant.client, queue["id"], "fails", max_attempts=1)["id"]
    run_one(tenant, queue["id"], "FAILED")
    submit_ok(tenant.client, full["id"], "filler")
    born = submit_ok(tenant.client, full["id"], "born", depends_on=[failed])
    assert born["state"] == "CANCELLED" and born["finished_at"]
    assert get_queue(tenant.client, full["id"])["unfinished_tasks"] == "1"
    # a RUN one is a real task: the queue is full
    response = submit(tenant.client, full["id"], "runner", depends_on=[failed], on_dependency_failure="RUN")
    assert_error(response, 429, "QUEUE_FULL")
    assert_invariants()
