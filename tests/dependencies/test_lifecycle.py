"""Dependencies (SPEC §13) through a task's whole life: BLOCKED tasks under
deadlines, quotas and backpressure, review, a parent retried after its lease
expired, RUN joins, and a follow-up cut short by a crash."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from orbit.fields import new_id
from orbit.models import Application, ApplicationState
from orbit.principal import Actor, authenticate_token, known_credential
from queues.models import QueueState
from tasks.actions import dependencies, rounds
from tasks.actions.batch import checked_submission
from tasks.actions.dependencies import FOLLOW_UP_CHUNK, INLINE_EDGES, run_follow_ups
from tasks.actions.endings import ResultReport, recover_expired_leases, sweep_deadlines
from tasks.actions.permits import settle
from tasks.actions.rounds import SubmitRequest, run_round
from tasks.maintenance import run_sweep
from tasks.models import Attempt, DependencySettlement, Task, TaskDependency
from tests.conftest import Tenant
from tests.support.api import make_queue
from tests.support.dependencies import fan_out, moves, row, run_one
from tests.support.tasks import (
    QUEUE_FULL_ERROR,
    assert_invariants,
    cancel,
    configure_queue,
    ends_unknown,
    in_seconds,
    lease_one,
    report,
    resolve,
    start,
    submit,
    submit_ok,
    task_body,
    worker_for,
)

pytestmark = pytest.mark.django_db


def submit_request(tenant: Tenant, key: str, body: dict[str, Any]) -> SubmitRequest:
    actor = Actor(principal=authenticate_token(tenant.token), request_id=new_id())
    return SubmitRequest(actor, checked_submission(actor, key, body), known_credential(tenant.token))


def test_blocked_tasks_are_unfinished_for_the_counters(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    assert QueueState.objects.get(queue_id=queue["id"]).unfinished_tasks == 2
    assert ApplicationState.objects.get(application_id=tenant.namespace.application_id).unfinished_tasks == 2
    assert_invariants()


def test_a_child_submitted_in_the_round_that_ends_its_parent_is_settled(tenant, queue):
    # given a running parent
    parent = submit_ok(tenant.client, queue["id"], "parent")
    lease = lease_one(tenant, queue["id"])
    start(lease)
    # when one round admits a child of it and records the parent's success
    child_request = submit_request(tenant, "child", task_body(queue["id"], depends_on=[parent["id"]]))
    result = ResultReport(lease["worker"], lease["attempt_id"], lease["epoch"], "SUCCEEDED", False, {"v": 1}, None)
    receipt, outcome = run_round([child_request, result])
    # then the child, admitted BLOCKED behind the running parent, is WAITING with it
    assert outcome == {"task_state": "SUCCEEDED", "duplicate": False, "late": False}
    child_id = receipt.data["task"]["id"]
    assert row(child_id).state == "WAITING"
    assert moves(child_id) == [("BLOCKED", None), ("WAITING", "BLOCKED")]
    assert_invariants()


def make_due(task_id: str, **deadlines: Any) -> None:
    """Moves the task's deadlines (deadline_at, start_deadline_at) into the past."""
    past = timezone.now() - timedelta(seconds=1)
    Task.objects.filter(id=task_id).update(**{name: past for name in deadlines})


@pytest.mark.parametrize(
    ("deadline", "code"), [("deadline_at", "DEADLINE_EXCEEDED"), ("start_deadline_at", "START_DEADLINE_EXCEEDED")]
)
def test_a_blocked_tasks_deadline_fails_it_and_settles_its_own_dependents(tenant, queue, deadline, code):
    # given a blocked task with a deadline, a CANCEL and a RUN dependent of it
    parent = submit_ok(tenant.client, queue["id"], "parent")
    blocked = submit_ok(tenant.client, queue["id"], "blocked", depends_on=[parent["id"]], **{deadline: in_seconds(60)})
    cancelled = submit_ok(tenant.client, queue["id"], "cancel", depends_on=[blocked["id"]])
    runs = submit_ok(tenant.client, queue["id"], "run", depends_on=[blocked["id"]], on_dependency_failure="RUN")
    # when its deadline is reached while it is still blocked
    make_due(blocked["id"], **{deadline: True})
    assert sweep_deadlines() == 1
    # then it failed as a WAITING task would, and its dependents were settled in the same sweep
    failed = row(blocked["id"])
    assert failed.state == "FAILED" and failed.last_error["code"] == code and failed.finished_at is not None
    assert moves(blocked["id"]) == [("BLOCKED", None), ("FAILED", "BLOCKED")]
    assert row(cancelled["id"]).state == "CANCELLED"
    assert row(cancelled["id"]).last_error == {
        "code": "DEPENDENCY_FAILED",
        "message": f"dependency {blocked['id']} ended FAILED",
        "task_id": blocked["id"],
        "state": "FAILED",
    }
    assert row(runs["id"]).state == "WAITING"
    assert row(parent["id"]).state == "WAITING"  # its own dependency is not touched
    assert sweep_deadlines() == 0
    assert_invariants()
    # and its parent's later success settles the edge to it without moving it
    run_one(tenant, queue["id"])
    assert row(blocked["id"]).state == "FAILED"
    assert not TaskDependency.objects.filter(settled=False).exists()
    assert_invariants()


def test_a_blocked_task_whose_deadline_is_ahead_is_not_swept(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    blocked = submit_ok(tenant.client, queue["id"], "blocked", depends_on=[parent["id"]], deadline_at=in_seconds(60))
    assert sweep_deadlines() == 0
    assert row(blocked["id"]).state == "BLOCKED"


def test_blocked_tasks_fill_the_queues_backlog(tenant, queue):
    configure_queue(tenant.client, queue["id"], max_unfinished_tasks=3)
    parent = submit_ok(tenant.client, queue["id"], "parent")
    for n in range(2):
        submit_ok(tenant.client, queue["id"], f"child-{n}", depends_on=[parent["id"]])
    response = submit(tenant.client, queue["id"], "one-more", depends_on=[parent["id"]])
    assert response.status_code == 429 and response.json()["error"] == QUEUE_FULL_ERROR
    response = submit(tenant.client, queue["id"], "plain")
    assert response.status_code == 429
    assert_invariants()


def test_blocked_tasks_count_in_the_applications_max_unfinished_tasks(tenant, queue):
    other = make_queue(tenant.client, "other", max_concurrency=10)
    parent = submit_ok(tenant.client, queue["id"], "parent")
    submit_ok(tenant.client, other["id"], "child", depends_on=[parent["id"]])
    Application.objects.filter(id=tenant.namespace.application_id).update(max_unfinished_tasks=2)
    response = submit(tenant.client, other["id"], "third", depends_on=[parent["id"]])
    assert response.status_code == 429, response.content
    # a finished task frees its slot; the blocked one holds its own
    run_one(tenant, queue["id"])
    submit_ok(tenant.client, other["id"], "third", depends_on=[parent["id"]])
    app = ApplicationState.objects.get(application_id=tenant.namespace.application_id)
    assert app.unfinished_tasks == 2
    assert_invariants()


@pytest.mark.parametrize("policy", ["CANCEL", "RUN"])
def test_a_needs_review_dependency_holds_its_dependent_until_resolved_failed(tenant, queue, policy):
    parent = ends_unknown_after_submit(tenant, queue["id"])
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent], on_dependency_failure=policy)
    assert row(child["id"]).state == "BLOCKED"
    assert sweep_deadlines() == 0 and run_follow_ups(settle) == 0
    assert row(child["id"]).state == "BLOCKED"
    assert resolve(tenant.client, parent, "resolve", "FAILED").status_code == 200
    if policy == "CANCEL":
        moved = row(child["id"])
        assert moved.state == "CANCELLED" and moved.last_error["task_id"] == parent
        assert moved.last_error["state"] == "FAILED"
    else:
        assert row(child["id"]).state == "WAITING"
        (assigned,) = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=10)
        assert assigned["dependencies"] == [{"task_id": parent, "state": "FAILED"}]
    assert_invariants()


def test_a_needs_review_dependency_resolved_for_a_retry_keeps_its_dependent_blocked(tenant, queue):
    parent = ends_unknown_after_submit(tenant, queue["id"])
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent])
    assert resolve(tenant.client, parent, "retry", "RETRY").status_code == 200
    assert row(parent).state == "WAITING" and row(child["id"]).state == "BLOCKED"
    run_one(tenant, queue["id"], output={"second": True})
    assert row(child["id"]).state == "WAITING"
    (assigned,) = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=10)
    assert assigned["dependencies"] == [{"task_id": parent, "state": "SUCCEEDED", "output": {"second": True}}]
    assert_invariants()


def ends_unknown_after_submit(tenant, queue_id: str) -> str:
    parent = submit_ok(tenant.client, queue_id, "parent")
    ends_unknown(tenant, queue_id)
    assert row(parent["id"]).state == "NEEDS_REVIEW"
    return parent["id"]


def expire(lease: dict) -> None:
    Attempt.objects.filter(id=lease["attempt_id"]).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def test_a_parent_whose_worker_vanished_unstarted_is_retried_and_frees_its_child(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    # the worker leased the parent and disappeared before starting it
    expire(lease_one(tenant, queue["id"], worker_id="gone"))
    assert recover_expired_leases() == 1
    assert row(parent["id"]).state == "WAITING" and row(child["id"]).state == "BLOCKED"
    # another worker retries it and succeeds
    lease = lease_one(tenant, queue["id"], worker_id="second")
    assert lease["task"]["id"] == parent["id"]
    assert row(child["id"]).state == "BLOCKED"
    start(lease)
    report(lease, "SUCCEEDED", output={"by": "second"})
    (assigned,) = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=10)
    assert assigned["task"]["id"] == child["id"]
    assert assigned["dependencies"] == [{"task_id": parent["id"], "state": "SUCCEEDED", "output": {"by": "second"}}]
    assert moves(child["id"]) == [("BLOCKED", None), ("WAITING", "BLOCKED"), ("LEASED", "WAITING")]
    assert_invariants()


def test_a_parent_killed_mid_run_is_reviewed_retried_and_then_frees_its_child(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent", max_attempts=3)
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    lease = lease_one(tenant, queue["id"], worker_id="killed")
    start(lease)
    expire(lease)  # the worker died while running it
    assert recover_expired_leases() == 1
    assert row(parent["id"]).state == "NEEDS_REVIEW" and row(child["id"]).state == "BLOCKED"
    assert resolve(tenant.client, parent["id"], "retry", "RETRY").status_code == 200
    assert row(child["id"]).state == "BLOCKED"
    retry = lease_one(tenant, queue["id"], worker_id="second")
    assert retry["task"]["id"] == parent["id"] and row(child["id"]).state == "BLOCKED"
    start(retry)
    report(retry, "SUCCEEDED", output={"attempt": 2})
    (assigned,) = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=10)
    assert assigned["dependencies"] == [{"task_id": parent["id"], "state": "SUCCEEDED", "output": {"attempt": 2}}]
    assert [state for state, _ in moves(child["id"])] == ["BLOCKED", "WAITING", "LEASED"]
    assert_invariants()


def test_a_run_join_runs_once_after_every_parent_ended_and_sees_how_each_did(tenant, queue):
    parents = [submit_ok(tenant.client, queue["id"], f"p-{n}", max_attempts=1) for n in range(3)]
    join = submit_ok(
        tenant.client, queue["id"], "join", depends_on=[p["id"] for p in parents], on_dependency_failure="RUN"
    )
    run_one(tenant, queue["id"], "FAILED")
    assert row(join["id"]).state == "BLOCKED" and row(join["id"]).blocked_by == 2
    assert cancel(tenant.client, parents[2]["id"], "cancel-third").status_code == 200
    assert row(join["id"]).state == "BLOCKED" and row(join["id"]).blocked_by == 1
    run_one(tenant, queue["id"], output={"ok": 2})
    assert row(join["id"]).state == "WAITING" and row(join["id"]).blocked_by == 0
    (assigned,) = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=10)
    assert assigned["task"]["id"] == join["id"]
    assert assigned["dependencies"] == [
        {"task_id": parents[0]["id"], "state": "FAILED"},
        {"task_id": parents[1]["id"], "state": "SUCCEEDED", "output": {"ok": 2}},
        {"task_id": parents[2]["id"], "state": "CANCELLED"},
    ]
    assert [state for state, _ in moves(join["id"])] == ["BLOCKED", "WAITING", "LEASED"]
    assert_invariants()


class Crash(Exception):
    pass


def test_a_follow_up_cut_short_by_a_crash_is_finished_by_the_maintenance_sweep(tenant, queue, monkeypatch):
    # given a fan-out that leaves two follow-up chunks after the ending's inline share
    width = INLINE_EDGES + FOLLOW_UP_CHUNK + 100
    parent = submit_ok(tenant.client, queue["id"], "parent")
    dependents = fan_out(tenant, queue["id"], parent["id"], width)
    run_one(tenant, queue["id"])
    assert Task.objects.filter(id__in=dependents, state="WAITING").count() == INLINE_EDGES
    # when the follow-up dies after its first chunk committed
    real_chunk = dependencies._settle_chunk
    calls = []

    def dies_on_the_second_chunk(*args: Any, **kwargs: Any) -> bool:
        calls.append(1)
        if len(calls) == 2:
            raise Crash
        return real_chunk(*args, **kwargs)

    monkeypatch.setattr(dependencies, "_settle_chunk", dies_on_the_second_chunk)
    with pytest.raises(Crash):
        run_follow_ups(settle)
    monkeypatch.setattr(dependencies, "_settle_chunk", real_chunk)
    # then the first chunk stands, the settlement row remains, nothing is settled twice
    assert Task.objects.filter(id__in=dependents, state="WAITING").count() == INLINE_EDGES + FOLLOW_UP_CHUNK
    assert DependencySettlement.objects.filter(task_id=parent["id"]).exists()
    assert TaskDependency.objects.filter(depends_on_id=parent["id"], settled=False).count() == 100
    assert_invariants()
    # and the maintenance sweep finishes it
    run_sweep()
    assert Task.objects.filter(id__in=dependents, state="WAITING").count() == width
    assert Task.objects.filter(id__in=dependents, blocked_by=0).count() == width
    assert not DependencySettlement.objects.exists()
    for task_id in dependents[:: width // 7]:
        assert moves(task_id) == [("BLOCKED", None), ("WAITING", "BLOCKED")]
    assert_invariants()
