"""Dispatch rounds (tasks.actions.rounds): many results, starts and leases in one
transaction, each answered exactly as its single verb would answer it."""

from __future__ import annotations

import pytest

from orbit.errors import LeaseLost, StateConflict
from tasks.actions import dispatch
from tasks.actions.dispatch import LeaseOutcome, StartRequest
from tasks.actions.endings import ResultReport
from tasks.actions.rounds import LeaseRequest, run_round
from tasks.models import Attempt, ConcurrencyKey, Task
from tests.tasks.support import assert_invariants, make_queue, submit_ok
from tests.tasks.test_dispatch import worker_for

pytestmark = pytest.mark.django_db


def report(worker, assignment, outcome="SUCCEEDED", retryable=False):
    return ResultReport(worker, assignment["attempt_id"], assignment["epoch"], outcome, retryable, {"ok": 1}, None)


def test_one_round_leases_for_several_workers_each_within_its_limit(tenant):
    queue = make_queue(tenant.client, "many", max_concurrency=50, rate_per_second=1000)
    for n in range(10):
        submit_ok(tenant.client, queue["id"], f"t{n}")
    workers = [worker_for(tenant, queue["id"], worker_id=f"w{n}") for n in range(3)]

    answers = run_round([LeaseRequest(workers[0], 3), LeaseRequest(workers[1], 4), LeaseRequest(workers[2], 16)])

    assert [len(answer.assignments) for answer in answers] == [3, 4, 3]
    task_ids = [entry["task"]["id"] for answer in answers for entry in answer.assignments]
    assert len(set(task_ids)) == 10
    for worker, answer in zip(workers, answers, strict=True):
        attempt_ids = [entry["attempt_id"] for entry in answer.assignments]
        assert set(Attempt.objects.filter(id__in=attempt_ids).values_list("worker_id", flat=True)) == {worker.worker_id}
    assert_invariants()


def test_workers_of_one_kind_never_share_a_key_in_one_round(tenant):
    queue = make_queue(tenant.client, "keys", max_concurrency=50, rate_per_second=1000)
    for n in range(6):
        submit_ok(tenant.client, queue["id"], f"k{n}", concurrency_key=f"object/{n % 2}")
    workers = [worker_for(tenant, queue["id"], worker_id=f"w{n}") for n in range(3)]

    answers = run_round([LeaseRequest(worker, 16) for worker in workers])

    keys = [entry["task"]["concurrency_key"] for answer in answers for entry in answer.assignments]
    assert sorted(keys) == ["object/0", "object/1"]
    holders = ConcurrencyKey.objects.filter(key__in=keys).values_list("holder_attempt_id", flat=True)
    assert all(holders)
    assert_invariants()


def test_a_mixed_round_answers_each_request_as_its_single_verb_would(tenant):
    queue = make_queue(tenant.client, "mixed", max_concurrency=4, rate_per_second=1000)
    for n in range(6):
        submit_ok(tenant.client, queue["id"], f"m{n}")
    worker = worker_for(tenant, queue["id"])
    other = worker_for(tenant, queue["id"], worker_id="other")
    first = dispatch.lease_tasks(worker=worker, limit=4)
    for entry in first[:2]:
        dispatch.approve_start(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])
    running, leased = first[:2], first[2:]

    items = [
        report(worker, running[0]),
        report(worker, running[1], outcome="FAILED"),
        report(worker, running[0]),  # a replay in the same round
        report(worker, leased[0]),  # not started yet
        StartRequest(worker, leased[0]["attempt_id"], leased[0]["epoch"]),
        StartRequest(worker, leased[0]["attempt_id"], leased[0]["epoch"]),  # twice
        StartRequest(worker, leased[1]["attempt_id"], leased[1]["epoch"] + 1),  # wrong epoch
        StartRequest(other, leased[1]["attempt_id"], leased[1]["epoch"]),  # not its attempt
        LeaseRequest(other, 16),
    ]
    answers = run_round(items)

    assert answers[0] == {"task_state": "SUCCEEDED", "duplicate": False, "late": False}
    assert answers[1] == {"task_state": "FAILED", "duplicate": False, "late": False}
    assert answers[2] == {"task_state": "SUCCEEDED", "duplicate": True, "late": False}
    assert isinstance(answers[3], StateConflict)
    assert answers[4]["attempt_number"] == 1 and answers[5] == answers[4]
    assert isinstance(answers[6], LeaseLost) and isinstance(answers[7], LeaseLost)
    # The two results freed two of the queue's four permits; the lease took them.
    assert isinstance(answers[8], LeaseOutcome) and len(answers[8].assignments) == 2
    assert Task.objects.get(id=running[0]["task"]["id"]).output == {"ok": 1}
    assert Attempt.objects.get(id=running[1]["attempt_id"]).state == "FAILED"
    assert Attempt.objects.get(id=leased[0]["attempt_id"]).state == "RUNNING"
    assert Attempt.objects.get(id=leased[1]["attempt_id"]).state == "LEASED"
    assert_invariants()
