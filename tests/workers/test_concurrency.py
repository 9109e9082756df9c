"""Real concurrency against a live daphne server on MariaDB: several worker
connections in threads (and one in a process that is killed), the queue's
shared limits read back from the attempts table, invariants after each test."""

from __future__ import annotations

import json
import random
import select
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest

from queues.models import QueueState
from tasks.models import Attempt, Task
from tests.conftest import new_tenant
from tests.support.api import assert_ok, make_queue
from tests.support.concurrent import concurrently
from tests.support.live import ROOT
from tests.support.tasks import (
    Background,
    Worker,
    assert_error_frame,
    assert_invariants,
    cancel,
    configure_queue,
    connect_fixture,  # noqa: F401 - fixture "connect"
    counters,
    get_queue,
    invariants_fixture,  # noqa: F401 - fixture "invariants"
    run_threads,
    submit_ok,
    wait_until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("invariants")]

WINDOW = timedelta(seconds=1)


def max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    """Most half-open intervals [begin, end) active at one instant."""
    events = sorted([(begin, 1) for begin, _ in intervals] + [(end, -1) for _, end in intervals])
    active = peak = 0
    for _, step in events:  # at one instant, ends (-1) sort before begins (+1)
        active += step
        peak = max(peak, active)
    return peak


def take_assignments(worker: Worker, first_wait: float) -> list[dict[str, Any]]:
    """Whatever assignments have arrived (waiting up to first_wait for the first)."""
    got = []
    frame = worker.next_assignment(timeout=first_wait)
    while frame is not None:
        worker.send("task.assign.ack", attempt_id=frame["attempt_id"])
        got.append(frame)
        frame = worker.next_assignment(timeout=0.005)
    return got


def test_queue_max_concurrency_holds_across_four_workers(tenant, orbit_server):
    # given 60 tasks on a queue that allows 3 active attempts (start rate no constraint)
    queue = make_queue(tenant.client, "hot", max_concurrency=3, rate_per_second=1000)
    task_ids = [submit_ok(tenant.client, queue["id"], f"t-{i}")["id"] for i in range(60)]
    finished = [0]
    lock = threading.Lock()

    # when 4 workers of capacity 3 each run them: start, 20-50 ms of work, SUCCEEDED
    def work(index: int) -> int:
        worker = Worker(orbit_server.url, tenant.token)
        handled = 0
        try:
            worker.hello_as([queue["id"]], capacity=3, worker_id=f"hot-{index}")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with lock:
                    if finished[0] >= 60:
                        return handled
                batch = take_assignments(worker, first_wait=0.1)
                for assign in batch:
                    reply = worker.start(assign)
                    assert reply["type"] == "task.start.ok", reply
                time.sleep(random.uniform(0.02, 0.05))
                for assign in batch:
                    reply = worker.result(assign)
                    assert reply["type"] == "task.result.ok" and reply["task_state"] == "SUCCEEDED", reply
                    with lock:
                        finished[0] += 1
                    handled += 1
            raise AssertionError("worker timed out")
        finally:
            worker.close()

    handled = run_threads(4, work, timeout=40)

    # then every task succeeded once, and the attempts table never shows more than 3 active
    assert sum(handled) == 60
    assert Task.objects.filter(id__in=task_ids, state="SUCCEEDED", attempts=1).count() == 60
    attempts = list(Attempt.objects.filter(queue_id=queue["id"]).values())
    assert len(attempts) == 60 and all(a["state"] == "SUCCEEDED" and a["finished_at"] for a in attempts)
    assert max_overlap([(a["leased_at"], a["finished_at"]) for a in attempts]) == 3
    assert max_overlap([(a["started_at"], a["finished_at"]) for a in attempts]) <= 3
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "0"
    state = counters(queue["id"])
    assert state["active_permits"] == 0 and state["reserved_starts"] == 0 and state["app_active_attempts"] == 0
    assert_invariants()


def starts_per_window(starts: list[datetime]) -> list[int]:
    """Groups Start times into the queue's windows as the seed defines them: the
    first Start opens a one-second window; the first Start at or after its end
    opens the next."""
    counts: list[int] = []
    window_start = None
    for started in sorted(starts):
        if window_start is None or started >= window_start + WINDOW:
            window_start = started
            counts.append(0)
        counts[-1] += 1
    return counts


def start_rate_window_holds_across_three_workers(tenant: Any, orbit_server: Any) -> None:
    """Run by test_lease_recovery_pause_and_rate_window_side_by_side."""
    # given 12 tasks, 10 of them leased (max_concurrency 10) while the rate was high
    queue = make_queue(tenant.client, "rated", max_concurrency=10, rate_per_second=1000)
    task_ids = [submit_ok(tenant.client, queue["id"], f"t-{i}")["id"] for i in range(12)]
    go = threading.Event()
    finished = [0]
    rate_limited: list[str] = []
    lock = threading.Lock()

    def work(index: int) -> None:
        worker = Worker(orbit_server.url, tenant.token)
        try:
            worker.hello_as([queue["id"]], capacity=4, worker_id=f"rated-{index}")
            assert go.wait(timeout=15)
            waiting: dict[str, tuple[dict[str, Any], float]] = {}  # attempt id → (assignment, next try)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with lock:
                    if finished[0] >= 12:
                        return
                due = [a for a, at in waiting.values() if at <= time.monotonic()]
                if not due:
                    for assign in take_assignments(worker, first_wait=0.02):
                        waiting[assign["attempt_id"]] = (assign, 0.0)
                    continue
                for assign in due:
                    reply = worker.start(assign)
                    if reply["type"] == "error" and reply["code"] == "RATE_LIMITED":
                        # RATE_LIMITED: no start approved, no attempt consumed
                        assert 0 < reply["retry_after_ms"] <= 1000, reply
                        attempt = Attempt.objects.get(id=assign["attempt_id"])
                        assert attempt.state == "LEASED" and attempt.number is None and attempt.started_at is None
                        task = Task.objects.get(id=assign["task"]["id"])
                        assert task.state == "LEASED" and task.attempts == 0
                        with lock:
                            rate_limited.append(assign["attempt_id"])
                        retry_at = time.monotonic() + reply["retry_after_ms"] / 1000
                        waiting[assign["attempt_id"]] = (assign, retry_at)
                        continue
                    assert reply["type"] == "task.start.ok" and reply["attempt_number"] == 1, reply
                    del waiting[assign["attempt_id"]]
                    time.sleep(0.02)
                    assert worker.result(assign)["task_state"] == "SUCCEEDED"
                    with lock:
                        finished[0] += 1
            raise AssertionError("worker timed out")
        finally:
            worker.close()

    workers = Background(lambda: run_threads(3, work, timeout=45))
    wait_until(lambda: counters(queue["id"])["active_permits"] == 10, 10, what="10 leases")
    assert Attempt.objects.filter(queue_id=queue["id"], state="LEASED").count() == 10
    # when the rate drops to 2 Starts per second and the 3 workers all hammer task.start
    configure_queue(tenant.client, queue["id"], rate_per_second=2)
    go.set()
    workers.join(timeout=50)

    # then every task ran exactly once and RATE_LIMITED replies happened and consumed nothing
    assert Task.objects.filter(id__in=task_ids, state="SUCCEEDED", attempts=1).count() == 12
    attempts = list(Attempt.objects.filter(queue_id=queue["id"]).values("number", "started_at", "state"))
    assert len(attempts) == 12 and {a["number"] for a in attempts} == {1}
    assert rate_limited, "the workers never met the rate limit"
    # and grouped by the queue's one-second windows, no window approved more than 2 Starts
    starts = sorted(a["started_at"] for a in attempts)
    per_window = starts_per_window(starts)
    assert max(per_window) <= 2, per_window
    assert len(per_window) >= 6, per_window
    # (the seed allows close to twice the rate across a window boundary, never more)
    for started in starts:
        assert sum(1 for s in starts if started <= s < started + WINDOW) <= 4
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "0"
    assert_invariants()


KILLABLE_WORKER = r"""
import json, sys
from tests.support.live import WorkerConnection

url, token, queue_id = sys.argv[1:4]
worker = WorkerConnection(url, token)
worker.hello([queue_id], capacity=2, worker_id="doomed")
first = worker.next_assignment(timeout=10)
second = worker.next_assignment(timeout=10)
reply = worker.request("task.start", attempt_id=first["attempt_id"], epoch=first["epoch"])
assert reply["type"] == "task.start.ok", reply
print(json.dumps({"started": first["attempt_id"], "leased": second["attempt_id"]}), flush=True)
sys.stdin.read()  # hold the connection until killed
"""


def killed_worker_leases_are_recovered(tenant: Any, orbit_server: Any, connect: Any, killed: threading.Event) -> None:
    """Run by test_lease_recovery_pause_and_rate_window_side_by_side; sets `killed` once the
    worker process is gone (its start-up, an interpreter loading Django, is behind it)."""
    # given a worker process holding two 5-second leases, one of them started
    queue = make_queue(tenant.client, "fragile")
    for i in range(2):
        submit_ok(tenant.client, queue["id"], f"t-{i}", lease_seconds=5)
    process = subprocess.Popen(
        [sys.executable, "-c", KILLABLE_WORKER, orbit_server.url, tenant.token, queue["id"]],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 20)
        assert ready, "worker process did not report"
        held = json.loads(process.stdout.readline())
        started = Attempt.objects.get(id=held["started"])
        leased = Attempt.objects.get(id=held["leased"])
        assert (started.state, leased.state) == ("RUNNING", "LEASED")
        # when it is killed with SIGKILL: no drain, no goodbye
        process.kill()
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        killed.set()

    # then, after the leases run out, the server's sweep recovers both
    def recovered() -> bool:
        states = dict(Attempt.objects.filter(id__in=[started.id, leased.id]).values_list("id", "state"))
        return states == {started.id: "UNKNOWN", leased.id: "EXPIRED"}

    wait_until(recovered, 12, interval=0.1, what="lease recovery")
    unstarted = Task.objects.get(id=leased.task_id)
    assert unstarted.state == "WAITING" and unstarted.attempts == 0
    review = Task.objects.get(id=started.task_id)
    assert review.state == "NEEDS_REVIEW" and review.attempts == 1
    assert review.last_error["code"] == "LEASE_EXPIRED"
    state = counters(queue["id"])
    assert state["active_permits"] == 0 and state["reserved_starts"] == 0 and state["app_active_attempts"] == 0
    assert state["unfinished_tasks"] == 2
    assert_invariants()

    # and a second worker leases the unstarted task (a new epoch), never the one under review
    heir = connect(tenant.token)
    heir.hello_as([queue["id"]], capacity=2, worker_id="heir")
    assign = heir.assignment()
    assert assign["task"]["id"] == unstarted.id and assign["epoch"] == 2
    heir.no_assignment(within=0.6)
    assert heir.start_ok(assign)["attempt_number"] == 1
    assert heir.result(assign)["task_state"] == "SUCCEEDED"
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "1"
    assert_invariants()


def pause_and_lowered_concurrency_revoke_nothing(tenant: Any, connect: Any) -> None:
    """Run by test_lease_recovery_pause_and_rate_window_side_by_side."""
    # given a worker holding 4 of 6 tasks, two of them started
    queue = make_queue(tenant.client, "controlled", max_concurrency=4, rate_per_second=1000)
    task_ids = [submit_ok(tenant.client, queue["id"], f"t-{i}")["id"] for i in range(6)]
    worker = connect(tenant.token)
    worker.hello_as([queue["id"]], capacity=4, worker_id="steady")
    a, b, c, d = worker.assignments(4)
    worker.start_ok(a)
    worker.start_ok(b)

    # when the queue is paused over HTTP
    configure_queue(tenant.client, queue["id"], paused=True)
    # then Start is refused with QUEUE_PAUSED and consumes nothing
    before = counters(queue["id"])
    assert_error_frame(worker.start(c), "QUEUE_PAUSED")
    assert counters(queue["id"]) == before
    assert Attempt.objects.get(id=c["attempt_id"]).state == "LEASED"
    assert Task.objects.get(id=c["task"]["id"]).attempts == 0
    # and renewals and results still work
    assert worker.renew(a)["type"] == "task.renew.ok"
    assert worker.renew(c)["type"] == "task.renew.ok"
    assert worker.result(a)["task_state"] == "SUCCEEDED"
    # and the freed slot is not filled while paused, although tasks wait
    worker.no_assignment(within=0.8)
    assert Task.objects.filter(id__in=task_ids, state="WAITING").count() == 2
    # and submit and cancel keep working on the paused queue
    extra = submit_ok(tenant.client, queue["id"], "t-extra")
    assert assert_ok(cancel(tenant.client, extra["id"], "c-extra"))["task"]["state"] == "CANCELLED"

    # when it is resumed with max_concurrency 1, below the 3 attempts still active
    configure_queue(tenant.client, queue["id"], paused=False, max_concurrency=1)
    # then nothing is revoked: the held attempts renew, start and finish as usual
    assert counters(queue["id"])["active_permits"] == 3
    assert QueueState.objects.get(queue_id=queue["id"]).active_permits == 3
    assert worker.renew(b)["type"] == "task.renew.ok"
    assert worker.start_ok(c)["attempt_number"] == 1
    # and no new lease until the active count is under the new limit
    worker.no_assignment(within=0.6)
    assert worker.result(b)["task_state"] == "SUCCEEDED"
    assert worker.result(c)["task_state"] == "SUCCEEDED"
    worker.no_assignment(within=0.6)
    worker.start_ok(d)
    assert worker.result(d)["task_state"] == "SUCCEEDED"
    # and then the rest flows one at a time
    for _ in range(2):
        assign = worker.assignment()
        worker.no_assignment(within=0.3)
        assert counters(queue["id"])["active_permits"] == 1
        worker.start_ok(assign)
        assert worker.result(assign)["task_state"] == "SUCCEEDED"
    assert Task.objects.filter(id__in=task_ids, state="SUCCEEDED").count() == 6
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "0"
    assert_invariants()


def test_lease_recovery_pause_and_rate_window_side_by_side(orbit_server, connect):
    """Three independent scenarios, each in an application (API client, queues) and with
    worker ids of its own: a killed worker's 5 s leases waited out, a paused queue's
    windows in which nothing may be assigned, and a start rate of 2 per second across
    six windows. Each mostly waits,
    so side by side the test waits about the longest, not their sum; every scenario
    makes every check it makes alone. The rate window's scenario begins only once the
    killed worker's process is gone, so its windows never share a second with that
    process's start-up; what runs beside it then (polling for the recovery, one heir
    worker, a few frames of the paused queue's) is light."""

    killed = threading.Event()
    # an application each, as each had as a test of its own: the scenarios reuse
    # idempotency keys ("t-0"), and a client is not shared across threads
    recovery_tenant, pause_tenant, rate_tenant = new_tenant(), new_tenant(), new_tenant()

    def rate_window_after_the_kill() -> None:
        assert killed.wait(timeout=60), "the killed worker's scenario never got its process killed"
        start_rate_window_holds_across_three_workers(rate_tenant, orbit_server)

    concurrently(
        {
            "killed-worker-recovery": lambda: killed_worker_leases_are_recovered(
                recovery_tenant, orbit_server, connect, killed
            ),
            "pause-and-lowered-concurrency": lambda: pause_and_lowered_concurrency_revoke_nothing(
                pause_tenant, connect
            ),
            "start-rate-window": rate_window_after_the_kill,
        }
    )
    # and, with every scenario done, the counters and permits agree with the rows
    assert_invariants()


def test_cancels_racing_with_workers_keep_the_counters_exact(tenant, orbit_server):
    # given 40 tasks and 3 workers working them
    queue = make_queue(tenant.client, "racy", max_concurrency=4, rate_per_second=1000)
    task_ids = [submit_ok(tenant.client, queue["id"], f"t-{i}")["id"] for i in range(40)]
    stop = threading.Event()

    def work(index: int) -> None:
        if index == 3:
            # when a fourth thread cancels every other task meanwhile
            from tests.conftest import api_client

            client = api_client(tenant.token)
            for i, task_id in enumerate(task_ids[::2]):
                response = cancel(client, task_id, f"c-{i}")
                assert response.status_code in (200, 409), response.content
                time.sleep(0.005)
            return
        worker = Worker(orbit_server.url, tenant.token)
        try:
            worker.hello_as([queue["id"]], capacity=2, worker_id=f"racy-{index}")
            while not stop.is_set():
                for assign in take_assignments(worker, first_wait=0.05):
                    reply = worker.start(assign)
                    if reply["type"] == "error":
                        assert reply["code"] in ("TASK_CANCELLED", "LEASE_LOST"), reply
                        continue
                    time.sleep(0.005)
                    # a task cancelled while running is told so on renewal, then reports
                    renewed = worker.renew(assign)
                    outcome = "FAILED" if renewed.get("cancel_requested") else "SUCCEEDED"
                    assert worker.result(assign, outcome=outcome)["type"] == "task.result.ok"
        finally:
            worker.close()

    def all_final() -> bool:
        return Task.objects.filter(id__in=task_ids, state__in=["SUCCEEDED", "CANCELLED", "FAILED"]).count() == 40

    runner = Background(lambda: run_threads(4, work, timeout=40))
    try:
        wait_until(all_final, 30, interval=0.1, what="every task final")
    finally:
        stop.set()
        runner.join(timeout=45)
    # then every task ended once and no counter drifted
    assert Task.objects.filter(id__in=task_ids[1::2], state="SUCCEEDED").count() == 20
    assert Task.objects.filter(state="CANCELLED").count() >= 1
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "0"
    state = counters(queue["id"])
    assert state["active_permits"] == 0 and state["reserved_starts"] == 0 and state["app_active_attempts"] == 0
    assert_invariants()
