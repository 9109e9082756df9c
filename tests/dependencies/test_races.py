"""Dependencies (SPEC §5, §13) under real concurrency on MariaDB, each
scenario ending with the counters compared against a count of the rows
(assert_invariants) and the dependency edges all settled.

Threads are released together (a barrier), each on its own connection."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from orbit.models import ApplicationState
from queues.models import QueueState
from tasks.actions import rounds
from tasks.actions.endings import recover_expired_leases, sweep_deadlines
from tasks.models import Attempt, Task, TaskDependency
from tests.conftest import api_client
from tests.support.api import assert_error, assert_ok, make_queue
from tests.support.dependencies import moves, row
from tests.support.tasks import (
    assert_invariants,
    cancel,
    configure_queue,
    ends_unknown,
    lease_one,
    report,
    resolve,
    run_threads,
    start,
    submit,
    submit_ok,
    worker_for,
)

pytestmark = pytest.mark.django_db(transaction=True)

TRIALS = 4


QUEUE_RATE_PER_SECOND = 100_000  # the queue fixture's (conftest): its threads start at once


def together(*work: Any) -> list[Any]:
    """Runs each callable in its own thread, released at once."""
    gate = threading.Barrier(len(work))

    def run(index: int) -> Any:
        gate.wait(timeout=10)
        return work[index]()

    return run_threads(len(work), run)


def counted_rows(tenant) -> tuple[int, int]:
    """(the application's unfinished_tasks counter, a count of its unfinished rows)."""
    app_id = tenant.namespace.application_id
    counter = ApplicationState.objects.get(application_id=app_id).unfinished_tasks
    rows = Task.objects.filter(
        application_id=app_id, state__in=["BLOCKED", "WAITING", "LEASED", "RUNNING", "NEEDS_REVIEW"]
    ).count()
    return counter, rows


def assert_counted(tenant) -> None:
    counter, rows = counted_rows(tenant)
    assert counter == rows
    for state in QueueState.objects.filter(application_id=tenant.namespace.application_id):
        unfinished = Task.objects.filter(
            queue_id=state.queue_id, state__in=["BLOCKED", "WAITING", "LEASED", "RUNNING", "NEEDS_REVIEW"]
        ).count()
        assert state.unfinished_tasks == unfinished, state.queue_id
    assert_invariants()


def expire(lease: dict) -> None:
    Attempt.objects.filter(id=lease["attempt_id"]).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


# --- a parent cancelled while dependents are submitted -----------------------


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_parent_cancelled_while_its_dependents_are_submitted(tenant, queue, trial):
    other = make_queue(tenant.client, f"other-{trial}", max_concurrency=10, rate_per_second=1000)
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    clients = [api_client(tenant.token) for _ in range(3)]

    def cancels() -> Any:
        return cancel(clients[0], parent, "cancel-parent")

    def submits_cancel_child() -> Any:
        return submit(clients[1], other["id"], "cancel-child", depends_on=[parent])

    def submits_run_child() -> Any:
        return submit(clients[2], queue["id"], "run-child", depends_on=[parent], on_dependency_failure="RUN")

    cancelled, cancel_child, run_child = together(cancels, submits_cancel_child, submits_run_child)

    assert cancelled.status_code == 200, cancelled.content
    child = assert_ok(cancel_child, 201)["task"]
    runner = assert_ok(run_child, 201)["task"]
    assert child["state"] in ("BLOCKED", "CANCELLED")
    assert runner["state"] in ("BLOCKED", "WAITING")
    gone = row(child["id"])
    assert gone.state == "CANCELLED" and gone.last_error["code"] == "DEPENDENCY_FAILED"
    assert gone.last_error["task_id"] == parent and gone.last_error["state"] == "CANCELLED"
    assert row(runner["id"]).state == "WAITING"
    assert not TaskDependency.objects.filter(settled=False).exists()
    # the receipt the key replays is the one the caller got
    again = assert_ok(submit(clients[1], other["id"], "cancel-child", depends_on=[parent]))
    assert again["task"]["state"] == child["state"]
    assert_counted(tenant)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_blocked_task_cancelled_while_its_parent_succeeds(tenant, queue, trial):
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent])["id"]
    below = submit_ok(tenant.client, queue["id"], "below", depends_on=[child])["id"]
    lease = lease_one(tenant, queue["id"])
    start(lease)
    client = api_client(tenant.token)

    response, result = together(
        lambda: cancel(client, child, "cancel-child"), lambda: report(lease, "SUCCEEDED", output={"n": trial})
    )

    assert response.status_code == 200, response.content
    assert result["task_state"] == "SUCCEEDED"
    assert row(child).state == "CANCELLED"
    assert [state for state, _ in moves(child)] in (["BLOCKED", "CANCELLED"], ["BLOCKED", "WAITING", "CANCELLED"])
    assert row(below).state == "CANCELLED"
    assert row(below).last_error["task_id"] == child
    assert not TaskDependency.objects.filter(settled=False).exists()
    assert_counted(tenant)


# --- a diamond over three queues, its parents ending at once -------------------


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_diamond_over_queues_whose_parents_end_at_once(tenant, queue, trial):
    q2 = make_queue(tenant.client, f"q2-{trial}", max_concurrency=10, rate_per_second=1000)
    q3 = make_queue(tenant.client, f"q3-{trial}", max_concurrency=10, rate_per_second=1000)
    configure_queue(tenant.client, q3["id"], paused=True)
    a = submit_ok(tenant.client, queue["id"], "a", max_attempts=1)["id"]
    b = submit_ok(tenant.client, q2["id"], "b", max_attempts=1)["id"]
    c = submit_ok(tenant.client, q3["id"], "c", depends_on=[a, b])["id"]  # CANCEL
    d = submit_ok(tenant.client, q3["id"], "d", depends_on=[c, a], on_dependency_failure="RUN")["id"]
    e = submit_ok(tenant.client, q2["id"], "e", depends_on=[d, b])["id"]  # CANCEL
    la = lease_one(tenant, queue["id"], worker_id="wa")
    lb = lease_one(tenant, q2["id"], worker_id="wb")
    start(la)
    start(lb)
    a_fails = trial % 2 == 0

    ra, rb = together(
        lambda: report(la, "FAILED" if a_fails else "SUCCEEDED", error={"code": "x"} if a_fails else None),
        lambda: report(lb, "SUCCEEDED" if a_fails else "FAILED", error=None if a_fails else {"code": "x"}),
    )

    # c is cancelled by whichever failed; d (RUN) waits for c and a, then is WAITING (paused queue)
    assert row(c).state == "CANCELLED"
    assert row(c).last_error["task_id"] == (a if a_fails else b)
    assert (row(d).state, row(d).blocked_by) == ("WAITING", 0)
    # e depends on d (unfinished) and b: cancelled only if b failed
    assert row(e).state == ("BLOCKED" if a_fails else "CANCELLED")
    assert [s for s, _ in moves(d)] == ["BLOCKED", "WAITING"]
    assert_counted(tenant)
    # d never runs while q3 is paused; its blocker says so
    blockers = assert_ok(tenant.client.get(f"/v1/tasks/{d}/blockers"))
    assert blockers["state"] == "WAITING" and "QUEUE_PAUSED" in [i["code"] for i in blockers["items"]]


# --- a parent that fails retryably, then succeeds -------------------------------


def test_a_parent_failing_retryably_keeps_its_dependents_blocked_until_its_retry_succeeds(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent", max_attempts=2)["id"]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent])["id"]
    lease = lease_one(tenant, queue["id"], worker_id="first")
    start(lease)
    result = rounds.record_result(
        worker=lease["worker"],
        attempt_id=lease["attempt_id"],
        epoch=lease["epoch"],
        outcome="FAILED",
        retryable=True,
        output=None,
        error={"code": "flaky"},
    )
    assert result["task_state"] == "WAITING"
    assert row(child).state == "BLOCKED" and row(child).blocked_by == 1
    blockers = assert_ok(tenant.client.get(f"/v1/tasks/{child}/blockers"))
    assert blockers["items"][0]["code"] == "WAITING_FOR_DEPENDENCIES" and blockers["items"][0]["task_ids"] == [parent]
    Task.objects.filter(id=parent).update(available_at=timezone.now() - timedelta(seconds=1))
    retry = lease_one(tenant, queue["id"], worker_id="second")
    assert retry["task"]["id"] == parent
    start(retry)
    report(retry, "SUCCEEDED", output={"attempt": 2})
    (assigned,) = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=10)
    assert assigned["task"]["id"] == child
    assert assigned["dependencies"] == [{"task_id": parent, "state": "SUCCEEDED", "output": {"attempt": 2}}]
    assert_counted(tenant)


# --- an expired lease, and a result that arrives too late ---------------------


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_result_racing_the_recovery_of_an_expired_parent_frees_no_dependent(tenant, queue, trial):
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent])["id"]
    lease = lease_one(tenant, queue["id"])
    start(lease)
    expire(lease)

    result, _ = together(lambda: report(lease, "SUCCEEDED", output={"late": True}), recover_expired_leases)

    assert result["late"] is True and result["task_state"] == "NEEDS_REVIEW"
    assert row(parent).state == "NEEDS_REVIEW"
    assert (row(child).state, row(child).blocked_by) == ("BLOCKED", 1)
    assert_counted(tenant)
    # review moves it on: SUCCEEDED frees the child
    assert_ok(resolve(tenant.client, parent, "ok", "SUCCEEDED"))
    assert row(child).state == "WAITING"
    assert_counted(tenant)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_two_reviewers_resolving_a_parent_at_once_move_its_dependents_once(tenant, queue, trial):
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent])["id"]
    runner = submit_ok(tenant.client, queue["id"], "runner", depends_on=[parent], on_dependency_failure="RUN")["id"]
    ends_unknown(tenant, queue["id"])
    clients = [api_client(tenant.token) for _ in range(3)]
    resolutions = ["SUCCEEDED", "FAILED", "RETRY"]

    answers = together(*(lambda n=n: resolve(clients[n], parent, f"r-{n}", resolutions[n]) for n in range(3)))

    won = [n for n, answer in enumerate(answers) if answer.status_code == 200]
    assert len(won) == 1, [a.content for a in answers]
    for n, answer in enumerate(answers):
        if n not in won:
            assert_error(answer, 409, "STATE_CONFLICT")
    winner = resolutions[won[0]]
    expected_child = {"SUCCEEDED": "WAITING", "FAILED": "CANCELLED", "RETRY": "BLOCKED"}[winner]
    assert row(child).state == expected_child
    assert row(runner).state == ("BLOCKED" if winner == "RETRY" else "WAITING")
    assert_counted(tenant)


# --- a BLOCKED task's deadline against its parent's ending ----------------------


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_blocked_tasks_deadline_racing_its_parents_success(tenant, queue, trial):
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    child = submit_ok(tenant.client, queue["id"], "child", depends_on=[parent], timeout_seconds=3600)["id"]
    below = submit_ok(tenant.client, queue["id"], "below", depends_on=[child])["id"]
    runner = submit_ok(tenant.client, queue["id"], "runner", depends_on=[child], on_dependency_failure="RUN")["id"]
    lease = lease_one(tenant, queue["id"])
    start(lease)
    Task.objects.filter(id=child).update(deadline_at=timezone.now() - timedelta(milliseconds=1))

    together(lambda: report(lease, "SUCCEEDED"), sweep_deadlines)
    sweep_deadlines()  # a WAITING task past its deadline fails too

    assert row(parent).state == "SUCCEEDED"
    assert row(child).state == "FAILED" and row(child).last_error["code"] == "DEADLINE_EXCEEDED"
    assert row(below).state == "CANCELLED" and row(below).last_error["task_id"] == child
    assert row(runner).state == "WAITING"
    assert not TaskDependency.objects.filter(settled=False).exists()
    assert_counted(tenant)


# --- many dependents submitted while their parent ends, under quotas ----------


@pytest.mark.parametrize("outcome", ["SUCCEEDED", "FAILED"])
def test_dependents_submitted_while_the_parent_ends_keep_every_counter(tenant, queue, outcome):
    small = make_queue(tenant.client, "small", max_concurrency=10, rate_per_second=1000, max_unfinished_tasks=5)
    parent = submit_ok(tenant.client, queue["id"], "parent", max_attempts=1)["id"]
    lease = lease_one(tenant, queue["id"])
    start(lease)
    clients = [api_client(tenant.token) for _ in range(8)]

    def submits(n: int) -> Any:
        return lambda: submit(clients[n], small["id"], f"dep-{n}", depends_on=[parent])

    answers = together(
        *(submits(n) for n in range(8)),
        lambda: report(lease, outcome, error=None if outcome == "SUCCEEDED" else {"code": "x"}),
    )[:8]

    statuses = sorted(a.status_code for a in answers)
    accepted = [a.json()["data"]["task"] for a in answers if a.status_code == 201]
    if outcome == "SUCCEEDED":
        # every accepted one counts: at most five, the rest QUEUE_FULL
        assert statuses.count(201) == 5 and statuses.count(429) == 3, statuses
        assert Task.objects.filter(queue_id=small["id"], state="WAITING").count() == 5
    else:
        # one born CANCELLED takes no backlog slot; one BLOCKED then cancelled frees it
        assert all(s in (201, 429) for s in statuses), statuses
        assert Task.objects.filter(queue_id=small["id"]).exclude(state="CANCELLED").count() == 0
        assert all(row(t["id"]).last_error["code"] == "DEPENDENCY_FAILED" for t in accepted)
    assert_counted(tenant)
