"""Dependencies (SPEC §13) under real concurrency on the database: the
parents of one join ending at the same moment from several threads (and
from workers on two server processes), and a wide fan-out settling in
chunks while its dependents and a sibling parent are cancelled."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from orbit.models import Event
from tasks.actions import rounds
from tasks.actions.dependencies import INLINE_EDGES, run_follow_ups
from tasks.actions.endings import sweep_deadlines
from tasks.actions.permits import settle
from tasks.models import DependencySettlement, Task, TaskDependency
from tests.conftest import api_client, post_json
from tests.support.api import make_queue
from tests.support.dependencies import moves, moves_of, row
from tests.support.live import LiveServer, WorkerConnection, server_env
from tests.support.lock_order import assert_lock_order
from tests.support.tasks import (
    an_hour_on,
    assert_invariants,
    cancel,
    ends_unknown,
    in_seconds,
    lease_one,
    report,
    resolve,
    run_threads,
    start,
    submit_ok,
    task_body,
    wait_until,
    worker_for,
)

pytestmark = pytest.mark.django_db(transaction=True)

PARENTS = 8


QUEUE_RATE_PER_SECOND = 100_000  # the queue fixture's (conftest): its threads start at once


def final_seq(task_ids: list[str]) -> dict[str, int]:
    """Where each task's move into a final state stands in the event order."""
    finals = Event.objects.filter(
        subject_id__in=task_ids, type="task.state_changed", data__state__in=["SUCCEEDED", "FAILED", "CANCELLED"]
    )
    return {event.subject_id: event.seq for event in finals}


def seq_of_move(task_id: str, state: str) -> int:
    (seq,) = Event.objects.filter(subject_id=task_id, type="task.state_changed", data__state=state).values_list(
        "seq", flat=True
    )
    return seq


def running_parents(tenant, queue_id: str, count: int, **overrides: Any) -> tuple[list[str], list[dict]]:
    """`count` parents, each leased by a worker of its own and started."""
    parents = [submit_ok(tenant.client, queue_id, f"parent-{n}", **overrides)["id"] for n in range(count)]
    leases = [lease_one(tenant, queue_id, worker_id=f"parent-worker-{n}") for n in range(count)]
    assert sorted(lease["task"]["id"] for lease in leases) == sorted(parents)
    for lease in leases:
        start(lease)
    return parents, leases


def end_at_once(leases: list[dict], outcomes: list[str]) -> None:
    """Each lease's worker reports its outcome from its own thread, released together."""
    gate = threading.Barrier(len(leases))

    def end(index: int) -> dict:
        lease, outcome = leases[index], outcomes[index]
        gate.wait(timeout=10)
        error = None if outcome == "SUCCEEDED" else {"code": "boom"}
        return report(lease, outcome, output={"parent": lease["task"]["id"]}, error=error)

    results = run_threads(len(leases), end)
    assert [result["task_state"] for result in results] == outcomes
    assert all(result["duplicate"] is False for result in results)


def lease_everything(tenant, queue_id: str) -> list[dict]:
    return rounds.lease_tasks(worker=worker_for(tenant, queue_id, worker_id="after"), limit=100)


@pytest.mark.parametrize("trial", range(3))
def test_parents_of_one_join_succeeding_at_once_make_it_waiting_exactly_once(tenant, queue, trial):
    parents, leases = running_parents(tenant, queue["id"], PARENTS)
    join = submit_ok(tenant.client, queue["id"], "join", depends_on=parents)["id"]
    assert row(join).blocked_by == PARENTS

    end_at_once(leases, ["SUCCEEDED"] * PARENTS)

    joined = row(join)
    assert (joined.state, joined.blocked_by) == ("WAITING", 0)
    assert moves(join) == [("BLOCKED", None), ("WAITING", "BLOCKED")]
    # made ready by the last of its parents' endings, not before it
    assert seq_of_move(join, "WAITING") > max(final_seq(parents).values())
    assert not TaskDependency.objects.filter(task_id=join, settled=False).exists()
    (assigned,) = lease_everything(tenant, queue["id"])
    assert assigned["task"]["id"] == join
    assert assigned["dependencies"] == [
        {"task_id": parent, "state": "SUCCEEDED", "output": {"parent": parent}} for parent in parents
    ]
    assert lease_everything(tenant, queue["id"]) == []
    assert_invariants()


@pytest.mark.parametrize("trial", range(3))
def test_parents_ending_at_once_some_failed_cancel_a_cancel_join_once_and_run_a_run_join_once(tenant, queue, trial):
    parents, leases = running_parents(tenant, queue["id"], PARENTS, max_attempts=1)
    cancelled = submit_ok(tenant.client, queue["id"], "cancel-join", depends_on=parents)["id"]
    below = submit_ok(tenant.client, queue["id"], "below", depends_on=[cancelled])["id"]
    runs = submit_ok(tenant.client, queue["id"], "run-join", depends_on=parents, on_dependency_failure="RUN")["id"]
    outcomes = ["FAILED" if n % 3 == trial % 3 else "SUCCEEDED" for n in range(PARENTS)]

    end_at_once(leases, outcomes)

    # the CANCEL join was cancelled once, by a failed parent, and took its own dependent along
    gone = row(cancelled)
    assert gone.state == "CANCELLED" and gone.last_error["code"] == "DEPENDENCY_FAILED"
    failed = {parent for parent, outcome in zip(parents, outcomes, strict=True) if outcome == "FAILED"}
    assert gone.last_error["task_id"] in failed
    assert moves(cancelled) == [("BLOCKED", None), ("CANCELLED", "BLOCKED")]
    assert moves(below) == [("BLOCKED", None), ("CANCELLED", "BLOCKED")]
    assert row(below).last_error["task_id"] == cancelled
    # the RUN join waited for all of them, once
    assert (row(runs).state, row(runs).blocked_by) == ("WAITING", 0)
    assert moves(runs) == [("BLOCKED", None), ("WAITING", "BLOCKED")]
    assert seq_of_move(runs, "WAITING") > max(final_seq(parents).values())
    (assigned,) = lease_everything(tenant, queue["id"])
    assert assigned["task"]["id"] == runs
    assert [(d["task_id"], d["state"]) for d in assigned["dependencies"]] == list(zip(parents, outcomes, strict=True))
    assert not TaskDependency.objects.filter(settled=False).exists()
    assert_invariants()


def test_a_wide_fan_out_settling_in_chunks_while_dependents_and_a_sibling_are_cancelled(tenant, queue):
    # given a parent with 1,200 dependents: 300 of them also depend on a
    # sibling that will be cancelled, 300 on one that will succeed, and
    # 100 more the client cancels itself
    width = 1_200
    parent = submit_ok(tenant.client, queue["id"], "parent", priority=9)["id"]
    doomed = submit_ok(tenant.client, queue["id"], "doomed-sibling")["id"]
    lucky = submit_ok(tenant.client, queue["id"], "lucky-sibling", priority=9)["id"]
    dependents: list[str] = []
    parents_of: dict[str, list[str]] = {}
    for first in range(0, width, 400):
        items = []
        for n in range(first, first + 400):
            depends_on = [parent] + ([doomed] if n % 4 == 1 else [lucky] if n % 4 == 2 else [])
            items.append({"idempotency_key": f"fan-{n}", "task": task_body(queue["id"], depends_on=depends_on)})
        results = post_json(tenant.client, "/v1/tasks:batch", {"tasks": items}).json()["data"]["results"]
        for item, result in zip(items, results, strict=True):
            dependents.append(result["task"]["id"])
            parents_of[result["task"]["id"]] = item["task"]["depends_on"]
    client_cancels = [task_id for n, task_id in enumerate(dependents) if n % 12 == 3]
    parent_lease, lucky_lease = (lease_one(tenant, queue["id"], worker_id=f"w-{n}") for n in range(2))
    if parent_lease["task"]["id"] != parent:
        parent_lease, lucky_lease = lucky_lease, parent_lease
    assert (parent_lease["task"]["id"], lucky_lease["task"]["id"]) == (parent, lucky)
    start(parent_lease)
    start(lucky_lease)

    # when the parent and the lucky sibling succeed, the follow-up runs, and
    # the client cancels the doomed sibling and some dependents, all at once
    gate = threading.Barrier(5)
    settled = threading.Event()

    def parent_ends() -> None:
        gate.wait(timeout=10)
        report(parent_lease, "SUCCEEDED", output={"n": 1})

    def lucky_ends() -> None:
        gate.wait(timeout=10)
        time.sleep(0.01)
        report(lucky_lease, "SUCCEEDED")

    def follow_up() -> int:
        gate.wait(timeout=10)
        chunks = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            chunks += run_follow_ups(settle)
            if settled.is_set() and not DependencySettlement.objects.exists():
                return chunks
            time.sleep(0.005)
        raise AssertionError("the follow-up did not finish")

    def cancels_sibling() -> None:
        client = api_client(tenant.token)
        gate.wait(timeout=10)
        time.sleep(0.02)
        assert cancel(client, doomed, "cancel-doomed").status_code == 200

    def cancels_dependents() -> None:
        client = api_client(tenant.token)
        gate.wait(timeout=10)
        for task_id in client_cancels:
            response = cancel(client, task_id, f"cancel-{task_id}")
            assert response.status_code == 200, response.content

    work = [parent_ends, lucky_ends, follow_up, cancels_sibling, cancels_dependents]

    def run(index: int) -> Any:
        try:
            return work[index]()
        finally:
            if index != 2:
                done[index] = True
                if all(done[i] for i in (0, 1, 3, 4)):
                    settled.set()

    done = [False] * 5
    run_threads(5, run, timeout=120)

    # then every dependent was settled once: cancelled if the client or the
    # doomed sibling cancelled it, WAITING (after all its parents) otherwise
    assert not DependencySettlement.objects.exists()
    assert not TaskDependency.objects.filter(depends_on_id__in=[parent, lucky, doomed], settled=False).exists()
    states = dict(Task.objects.filter(id__in=dependents).values_list("id", "state"))
    expect_cancelled = set(client_cancels) | {t for t in dependents if doomed in parents_of[t]}
    assert {t for t, state in states.items() if state == "CANCELLED"} == expect_cancelled
    assert {t for t, state in states.items() if state == "WAITING"} == set(dependents) - expect_cancelled
    ended = final_seq([parent, lucky, doomed])
    waiting_at = {
        event.subject_id: event.seq
        for event in Event.objects.filter(subject_id__in=dependents, type="task.state_changed", data__state="WAITING")
    }
    blocked_by = dict(Task.objects.filter(id__in=dependents).values_list("id", "blocked_by"))
    errors = dict(Task.objects.filter(id__in=dependents).values_list("id", "last_error"))
    paths = moves_of(dependents)
    for task_id in dependents:
        path = paths[task_id]
        assert Counter(state for state, _ in path)["CANCELLED"] <= 1, (task_id, path)
        assert sum(1 for _, previous in path if previous == "BLOCKED") == 1, (task_id, path)
        if task_id in waiting_at:
            assert blocked_by[task_id] == 0
            assert waiting_at[task_id] > max(ended[p] for p in parents_of[task_id]), (task_id, path)
        if states[task_id] == "CANCELLED" and task_id not in client_cancels:
            assert errors[task_id]["task_id"] == doomed
    assert Task.objects.filter(id__in=dependents, state="WAITING").count() > INLINE_EDGES
    assert_invariants()


def take_assignments(workers: list[WorkerConnection], held: list[tuple[WorkerConnection, dict]]) -> None:
    for worker in workers:
        frame = worker.next_assignment(timeout=0.05)
        if frame is not None:
            worker.send("task.assign.ack", attempt_id=frame["attempt_id"])
            held.append((worker, frame))


def test_a_join_over_workers_on_two_servers_is_assigned_once_with_its_parents_outputs(tenant, orbit_server):
    queue = make_queue(tenant.client, "two-servers", max_concurrency=50, rate_per_second=100_000)
    parents = [submit_ok(tenant.client, queue["id"], f"parent-{n}")["id"] for n in range(PARENTS)]
    join = submit_ok(tenant.client, queue["id"], "join", depends_on=parents)["id"]
    second = LiveServer(server_env())
    urls = [orbit_server.url, second.url]
    workers = [WorkerConnection(urls[n % 2], tenant.token) for n in range(PARENTS)]
    try:
        for index, worker in enumerate(workers):
            worker.hello([queue["id"]], capacity=1, worker_id=f"w-dep-{index}")
        # each worker, half of them on each server, takes one parent and starts it
        held: list[tuple[WorkerConnection, dict]] = []
        wait_until(lambda: take_assignments(workers, held) or len(held) == PARENTS, 20, what="the parents' leases")
        assert sorted(frame["task"]["id"] for _, frame in held) == sorted(parents)
        for worker, frame in held:
            reply = worker.request("task.start", attempt_id=frame["attempt_id"], epoch=frame["epoch"])
            assert reply["type"] == "task.start.ok", reply
        gate = threading.Barrier(len(held))

        def end(index: int) -> dict:
            worker, frame = held[index]
            gate.wait(timeout=10)
            return worker.request(
                "task.result",
                attempt_id=frame["attempt_id"],
                epoch=frame["epoch"],
                outcome="SUCCEEDED",
                retryable=False,
                output={"parent": frame["task"]["id"]},
            )

        # when all of them report success at the same moment
        results = run_threads(len(held), end)
        assert all(r["type"] == "task.result.ok" and r["task_state"] == "SUCCEEDED" for r in results), results
        # then the join is assigned once, to one of the workers, with every parent's output
        joins: list[tuple[WorkerConnection, dict]] = []
        wait_until(lambda: take_assignments(workers, joins) or joins, 10, what="the join's assignment")
        time.sleep(1.0)
        take_assignments(workers, joins)
        assert [frame["task"]["id"] for _, frame in joins] == [join]
        assert joins[0][1]["dependencies"] == [
            {"task_id": parent, "state": "SUCCEEDED", "output": {"parent": parent}} for parent in parents
        ]
    finally:
        for worker in workers:
            worker.close()
        second.stop()
    assert moves(join)[:3] == [("BLOCKED", None), ("WAITING", "BLOCKED"), ("LEASED", "WAITING")]
    assert row(join).blocked_by == 0
    assert_invariants()


# --- the lock order of every path that settles dependencies -----------------


def checked(what: Callable[[], Any]) -> list[list[str]]:
    """Runs `what`; its transactions' locks must follow LOCK_ORDER."""
    with CaptureQueriesContext(connection) as queries:
        what()
    return assert_lock_order(queries)


@pytest.mark.mysql_only
def test_endings_that_settle_dependents_across_queues_and_keys_lock_in_the_global_order(tenant):
    first = make_queue(tenant.client, "first", max_concurrency=10, rate_per_second=1000)
    other = make_queue(tenant.client, "other", max_concurrency=10, rate_per_second=1000)
    # a submit with dependencies, keyed, in another queue
    succeeds = submit_ok(tenant.client, first["id"], "succeeds", concurrency_key="k/parent", priority=9)["id"]
    (locked,) = checked(
        lambda: submit_ok(tenant.client, other["id"], "keyed", depends_on=[succeeds], concurrency_key="k/child")
    )
    assert "orbit_application_state" in locked
    submit_ok(tenant.client, other["id"], "plain", depends_on=[succeeds])
    # a success that makes them WAITING
    lease = lease_one(tenant, first["id"])
    start(lease)
    (locked,) = checked(lambda: report(lease, "SUCCEEDED"))
    assert "orbit_task_dependency" in locked
    # a failure whose cascade cancels in another queue and back
    fails = submit_ok(tenant.client, first["id"], "fails", max_attempts=1, priority=9)["id"]
    child = submit_ok(tenant.client, other["id"], "child", depends_on=[fails], concurrency_key="k/c")["id"]
    submit_ok(tenant.client, first["id"], "grandchild", depends_on=[child])
    lease = lease_one(tenant, first["id"])
    start(lease)
    checked(lambda: report(lease, "FAILED", error={"code": "boom"}))
    assert row(child).state == "CANCELLED"
    # a cancel and a deadline of a blocked task, each with a dependent elsewhere
    waits = submit_ok(tenant.client, first["id"], "waits", priority=0)["id"]
    blocked = submit_ok(tenant.client, first["id"], "blocked", depends_on=[waits], deadline_at=in_seconds(60))["id"]
    submit_ok(tenant.client, other["id"], "below-blocked", depends_on=[blocked])
    Task.objects.filter(id=blocked).update(deadline_at=timezone.now() + timedelta(minutes=1))
    with an_hour_on():
        (locked,) = checked(sweep_deadlines)
    assert "orbit_task_dependency" in locked
    assert row(blocked).state == "FAILED"
    submit_ok(tenant.client, other["id"], "below-waits", depends_on=[waits], concurrency_key="k/w")
    checked(lambda: cancel(tenant.client, waits, "cancel-waits"))
    # a resolve to FAILED
    reviewed = submit_ok(tenant.client, first["id"], "reviewed", priority=9)["id"]
    submit_ok(tenant.client, other["id"], "below-reviewed", depends_on=[reviewed])
    ends_unknown(tenant, first["id"])
    checked(lambda: resolve(tenant.client, reviewed, "resolve-reviewed", "FAILED"))
    assert not TaskDependency.objects.filter(settled=False).exists()
    assert_invariants()


@pytest.mark.mysql_only
def test_a_follow_up_that_cancels_across_queues_locks_their_counters_first(tenant):
    first = make_queue(tenant.client, "first", max_concurrency=10, rate_per_second=1000)
    queues = [make_queue(tenant.client, f"fan-{n}", max_concurrency=10, rate_per_second=1000) for n in range(3)]
    parent = submit_ok(tenant.client, first["id"], "parent", max_attempts=1, priority=9)["id"]
    width = INLINE_EDGES + 60
    items = [
        {"idempotency_key": f"fan-{n}", "task": task_body(queues[n % 2]["id"], depends_on=[parent])}
        for n in range(width)
    ]
    results = post_json(tenant.client, "/v1/tasks:batch", {"tasks": items}).json()["data"]["results"]
    dependents = [result["task"]["id"] for result in results]
    # the last dependents, settled by the follow-up, have dependents in a third queue
    below = [
        submit_ok(tenant.client, queues[2]["id"], f"below-{n}", depends_on=[dependents[-1 - n]])["id"] for n in range(3)
    ]
    lease = lease_one(tenant, first["id"])
    start(lease)
    report(lease, "FAILED", error={"code": "boom"})
    assert DependencySettlement.objects.filter(task_id=parent).exists()
    assert Task.objects.filter(id__in=dependents, state="CANCELLED").count() == INLINE_EDGES

    chunks = checked(lambda: run_follow_ups(settle))
    # the chunk locked the counters of the queues it cancels in; its cascade
    # into a third queue, whose counter row it did not lock first, is left
    # to settlement rows of their own, which the next run settles
    assert sorted(DependencySettlement.objects.values_list("task_id", flat=True)) == sorted(dependents[-3:])
    assert Task.objects.filter(id__in=below, state="BLOCKED").count() == len(below)
    chunks += checked(lambda: run_follow_ups(settle))

    assert any("orbit_dependency_settlement" in locked for locked in chunks)
    assert Task.objects.filter(id__in=dependents + below, state="CANCELLED").count() == width + len(below)
    for task_id in below:
        assert moves(task_id) == [("BLOCKED", None), ("CANCELLED", "BLOCKED")]
    assert not DependencySettlement.objects.exists()
    assert_invariants()


def test_children_submitted_while_their_parents_end_are_never_left_blocked(tenant, queue):
    # given running parents
    parents, leases = running_parents(tenant, queue["id"], PARENTS)
    gate = threading.Barrier(2 * PARENTS)

    # when each parent's child is submitted at the moment the parent succeeds
    # (the same round or either side of it)
    def act(index: int) -> Any:
        n = index // 2
        if index % 2:
            client = api_client(tenant.token)
            gate.wait(timeout=10)
            return submit_ok(client, queue["id"], f"child-{n}", depends_on=[parents[n]])["id"]
        gate.wait(timeout=10)
        return report(leases[n], "SUCCEEDED", output={"n": n})

    results = run_threads(2 * PARENTS, act)
    children = results[1::2]

    # then every child is WAITING: admitted so, or made so by its parent's ending
    assert dict(Task.objects.filter(id__in=children).values_list("id", "state")) == dict.fromkeys(children, "WAITING")
    for child, path in moves_of(children).items():
        assert path in ([("WAITING", None)], [("BLOCKED", None), ("WAITING", "BLOCKED")]), (child, path)
    assert not TaskDependency.objects.filter(task_id__in=children, settled=False).exists()
    assert_invariants()
