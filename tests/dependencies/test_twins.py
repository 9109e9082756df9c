"""Concurrent duplicates (SPEC §3, §13) of submits with depends_on (the
same Idempotency-Key from several threads, single and batch) resolve to exactly
one effect, one edge per pair, and counters equal to a count of the rows."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tasks.models import Task, TaskDependency
from tests.conftest import api_client, post_json
from tests.support.dependencies import row, run_one
from tests.support.tasks import assert_invariants, lease_one, report, run_threads, start, submit, submit_ok, task_body

pytestmark = pytest.mark.django_db(transaction=True)


QUEUE_RATE_PER_SECOND = 100_000  # the queue fixture's (conftest): its threads start at once


def together(count: int, work: Any) -> list[Any]:
    gate = threading.Barrier(count)

    def run(index: int) -> Any:
        gate.wait(timeout=10)
        return work(index)

    return run_threads(count, run)


@pytest.mark.parametrize("trial", range(3))
def test_one_dependent_submitted_by_several_threads_at_once_is_made_once(tenant, queue, trial):
    parent = submit_ok(tenant.client, queue["id"], "parent")["id"]
    lease = lease_one(tenant, queue["id"])
    start(lease)
    clients = [api_client(tenant.token) for _ in range(4)]

    def act(n: int) -> Any:
        if n == 4:
            return report(lease, "SUCCEEDED", output={"t": trial})
        return submit(clients[n], queue["id"], "same-key", depends_on=[parent], on_dependency_failure="RUN")

    answers = together(5, act)[:4]
    assert sorted(a.status_code for a in answers) == [200, 200, 200, 201], [a.content for a in answers]
    ids = {a.json()["data"]["task"]["id"] for a in answers}
    assert len(ids) == 1
    (child,) = ids
    assert row(child).state == "WAITING"
    assert TaskDependency.objects.filter(task_id=child).count() == 1
    assert Task.objects.filter(depends_on__isnull=False).count() == 1
    assert_invariants()


@pytest.mark.parametrize("trial", range(3))
def test_twin_batches_with_refs_at_once_make_each_item_once(tenant, queue, trial):
    def items(tag: str) -> list[dict[str, Any]]:
        return [
            {"idempotency_key": "root", "ref": "root", "task": task_body(queue["id"])},
            {"idempotency_key": "mid", "ref": "mid", "task": task_body(queue["id"], depends_on=["ref:root"])},
            {"idempotency_key": f"own-{tag}", "task": task_body(queue["id"], depends_on=["ref:mid", "ref:root"])},
        ]

    clients = [api_client(tenant.token) for _ in range(3)]

    def act(n: int) -> Any:
        return post_json(clients[n], "/v1/tasks:batch", {"tasks": items(str(n))}).json()["data"]["results"]

    results = together(3, act)
    roots = {r[0]["task"]["id"] for r in results}
    mids = {r[1]["task"]["id"] for r in results}
    assert len(roots) == 1 and len(mids) == 1, results
    (root,), (mid,) = roots, mids
    for r in results:
        assert r[2]["status"] == 201 and r[2]["task"]["depends_on"] == [mid, root]
    assert sorted(r[0]["status"] for r in results) == [200, 200, 201]
    assert TaskDependency.objects.count() == 1 + 2 * 3
    assert row(mid).blocked_by == 1
    assert_invariants()
    # the chain runs through: root, then mid, then the three joins
    run_one(tenant, queue["id"], output={"root": True})
    assert row(mid).state == "WAITING"
    run_one(tenant, queue["id"], output={"mid": True})
    assert Task.objects.filter(state="WAITING").count() == 3
    assert_invariants()
