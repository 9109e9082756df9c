"""Fair shares through the lease itself (tasks.actions.rounds.lease_tasks,
SPEC §12): a tenant that submits a thousand tasks does not delay another
tenant's ten by more than about one task of each other group."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tasks.actions import rounds
from tasks.actions.endings import ResultReport
from tasks.actions.rounds import LeaseRequest, run_round
from tasks.models import FairShare, Task
from tests.conftest import post_json
from tests.support.api import assert_ok, make_queue
from tests.support.key_rows import make_policy
from tests.support.lock_order import assert_lock_order
from tests.support.tasks import assert_invariants, in_seconds, numbered_task, submit_ok, worker_for

pytestmark = pytest.mark.django_db


def submit_many(tenant, queue_id: str, key: str, count: int, **fields) -> list[str]:
    """`count` tasks of fairness key `key` (and `fields`) through POST /v1/tasks:batch, in order; their ids."""
    ids: list[str] = []
    for first in range(0, count, 500):
        items = [
            {"idempotency_key": f"{key}-{n}", "task": numbered_task(queue_id, n, fairness_key=key, **fields)}
            for n in range(first, min(count, first + 500))
        ]
        results = assert_ok(post_json(tenant.client, "/v1/tasks:batch", {"tasks": items}))["results"]
        assert all(result["status"] == 201 for result in results), results
        ids += [result["task"]["id"] for result in results]
    return ids


def in_group_order(ids: list[str]) -> list[str]:
    """The tasks as their group serves them: oldest available first, then by id
    (a batch's tasks share one available_at)."""
    rows = Task.objects.filter(id__in=ids).values_list("available_at", "id")
    return [task_id for _, task_id in sorted(rows)]


def keys_of(assignments: list[dict]) -> list[str]:
    keys = dict(Task.objects.filter(id__in=[a["task"]["id"] for a in assignments]).values_list("id", "fairness_key"))
    return [keys[a["task"]["id"]] for a in assignments]


def run_one(worker) -> str | None:
    """A worker of capacity 1: lease one task, start it, succeed; its fairness key."""
    ran = run_lease(worker, 1)
    return ran[0] if ran else None


def run_lease(worker, limit: int) -> list[str]:
    """Lease up to `limit` tasks, start each, succeed each; their fairness keys in lease order."""
    leased = rounds.lease_tasks(worker=worker, limit=limit)
    for entry in leased:
        rounds.approve_start(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])
        rounds.record_result(
            worker=worker,
            attempt_id=entry["attempt_id"],
            epoch=entry["epoch"],
            outcome="SUCCEEDED",
            retryable=False,
            output=None,
            error=None,
        )
    return keys_of(leased)


def test_ten_tasks_of_one_tenant_run_before_the_others_twentieth(tenant):
    # given tenant A's 1,000 tasks, all submitted before tenant B's 10
    queue = make_queue(tenant.client, "shared", max_concurrency=1000, rate_per_second=10_000)
    submit_many(tenant, queue["id"], "A", 1000)
    submit_many(tenant, queue["id"], "B", 10)
    worker = worker_for(tenant, queue["id"])
    # when a worker with capacity 1 runs them one after another
    ran = [run_one(worker) for _ in range(21)]
    # then B's ten all ran before A's 12th: one of A's between each two of B's
    assert ran.count("B") == 10, ran
    assert ran[:20] == ["A", "B"] * 10, ran
    assert ran[20] == "A"
    assert_invariants()


@pytest.mark.parametrize("capacity", [1, 3])
def test_tenants_sharing_one_concurrency_key_take_turns(tenant, capacity):
    # given tenant A's 300 tasks and then tenant B's 10, every one on the same concurrency key
    queue = make_queue(tenant.client, "shared", max_concurrency=1000, rate_per_second=10_000)
    if capacity > 1:
        make_policy(tenant.namespace, key="ledger", capacity=capacity)
    submit_many(tenant, queue["id"], "A", 300, concurrency_key="ledger")
    submit_many(tenant, queue["id"], "B", 10, concurrency_key="ledger")
    worker = worker_for(tenant, queue["id"])
    # when a worker runs them, as many at once as the key allows
    ran: list[str] = []
    while len(ran) < 21:
        ran += run_lease(worker, capacity)
    # then the key's turns alternate between the tenants, as without the key
    assert ran[:20] == ["A", "B"] * 10, ran
    assert ran[20] == "A"
    assert_invariants()


def test_one_lease_alternates_the_tenants(tenant):
    queue = make_queue(tenant.client, "shared", max_concurrency=1000, rate_per_second=10_000)
    a = in_group_order(submit_many(tenant, queue["id"], "A", 100))
    b = in_group_order(submit_many(tenant, queue["id"], "B", 10))
    worker = worker_for(tenant, queue["id"])
    first = rounds.lease_tasks(worker=worker, limit=16)
    assert [entry["task"]["id"] for entry in first] == [
        task for pair in zip(a[:8], b[:8], strict=True) for task in pair
    ]
    # B was served last: the next lease starts with A, and B's last two, then only A
    second = rounds.lease_tasks(worker=worker, limit=16)
    assert [entry["task"]["id"] for entry in second] == [a[8], b[8], a[9], b[9], *a[10:22]]
    served = dict(FairShare.objects.filter(queue_id=queue["id"]).values_list("fairness_key", "served_at"))
    assert served["B"] < served["A"]
    assert_invariants()


def test_priority_still_comes_first(tenant):
    queue = make_queue(tenant.client, "shared", max_concurrency=1000, rate_per_second=10_000)
    submit_many(tenant, queue["id"], "A", 20)
    urgent = [
        submit_ok(tenant.client, queue["id"], f"urgent-{n}", fairness_key="A", priority=9)["id"] for n in range(3)
    ]
    b = in_group_order(submit_many(tenant, queue["id"], "B", 2))
    first = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=6)
    assert [entry["task"]["id"] for entry in first][:3] == urgent
    assert keys_of(first)[3:] == ["A", "B", "A"] and first[4]["task"]["id"] == b[0]


def test_a_fair_queue_without_keys_leases_in_the_plain_order(tenant):
    # given a queue whose fair order is on (it took one keyed task), then only tasks without one
    queue = make_queue(tenant.client, "shared", max_concurrency=1000, rate_per_second=10_000)
    submit_ok(tenant.client, queue["id"], "keyed", fairness_key="A")
    worker = worker_for(tenant, queue["id"])
    assert len(rounds.lease_tasks(worker=worker, limit=1)) == 1
    low = submit_ok(tenant.client, queue["id"], "low", priority=1)
    old = submit_ok(tenant.client, queue["id"], "old", available_at=in_seconds(-20))
    new = submit_ok(tenant.client, queue["id"], "new", available_at=in_seconds(-10))
    now = [submit_ok(tenant.client, queue["id"], f"now-{n}") for n in range(3)]
    high = submit_ok(tenant.client, queue["id"], "high", priority=9)
    leased = rounds.lease_tasks(worker=worker, limit=16)
    plain = sorted([low, old, new, *now, high], key=lambda t: (-t["priority"], t["available_at"], t["id"]))
    assert [entry["task"]["id"] for entry in leased] == [task["id"] for task in plain]


@pytest.mark.mysql_only  # the checker reads MariaDB's statements
def test_the_lease_records_served_in_lock_order(tenant):
    # given a fair queue with a running task of A and waiting ones of A and B
    queue = make_queue(tenant.client, "shared", max_concurrency=1000, rate_per_second=10_000)
    submit_many(tenant, queue["id"], "A", 4)
    submit_many(tenant, queue["id"], "B", 4)
    worker = worker_for(tenant, queue["id"])
    (entry,) = rounds.lease_tasks(worker=worker, limit=1)
    rounds.approve_start(worker=worker, attempt_id=entry["attempt_id"], epoch=entry["epoch"])
    # when one round records its result (the per-minute rollup) and leases (the served times)
    report = ResultReport(worker, entry["attempt_id"], entry["epoch"], "SUCCEEDED", False, None, None)
    with CaptureQueriesContext(connection) as queries:
        answers = run_round([report, LeaseRequest(worker, 4)])
    assert not [answer for answer in answers if isinstance(answer, BaseException)], answers
    # then orbit_fair_share is upserted after the tasks and attempts, before the rollup
    assert_lock_order(queries, expect=["orbit_task", "orbit_attempt", "orbit_fair_share", "orbit_queue_minute"])
    assert sorted(FairShare.objects.filter(queue_id=queue["id"]).values_list("fairness_key", flat=True)) == ["A", "B"]
    assert_invariants()
