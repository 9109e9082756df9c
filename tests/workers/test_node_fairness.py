"""Node fairness (SPEC §7) with the slot hand-off: two workers of equal speed, each on its own
server process, draining one hot unkeyed queue while every result asks for its next task
started ahead. Each result refills its own slot in its round; the other worker's hand-offs
and dispatcher lease from the same queue, so neither takes it all."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest
from django.db.models import F

from tasks.models import Attempt, AttemptState, Task, TaskState
from tests.conftest import post_json
from tests.support.api import make_queue
from tests.support.keys import Worker
from tests.support.live import LiveServer, server_env
from tests.support.tasks import assert_invariants, run_threads, task_body

pytestmark = pytest.mark.django_db(transaction=True)

TASKS = 600
CAPACITY = 4
HANDLER_SECONDS = 0.005


def drain(url: str, token: str, queue_id: str, index: int, done: dict[str, Any]) -> int:
    """One worker connection: runs whatever it is given (its own Start for an unstarted one),
    each result with start_next; how many it ran."""
    worker = Worker(url, token)
    ran = 0
    try:
        worker.hello([queue_id], capacity=CAPACITY, worker_id=f"w-fair-{index}")
        done["connected"].wait(timeout=30)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with done["lock"]:
                if done["count"] >= TASKS:
                    return ran
            frame = worker.next_assignment(timeout=0.2)
            if frame is None:
                continue
            worker.send("task.assign.ack", attempt_id=frame["attempt_id"])
            if frame.get("state") != "RUNNING":
                worker.start(frame)
            time.sleep(HANDLER_SECONDS)
            reply = worker.result(frame, start_next=True)
            assert reply["task_state"] == "SUCCEEDED" and reply["duplicate"] is False, reply
            ran += 1
            with done["lock"]:
                done["count"] += 1
        raise AssertionError(f"worker {index} ran out of time")
    finally:
        worker.close()


def test_two_workers_on_two_servers_share_a_hot_queue(tenant, orbit_server):
    queue = make_queue(tenant.client, "hot", max_concurrency=100, rate_per_second=100_000)
    second = LiveServer(server_env())
    urls = [orbit_server.url, second.url]
    # both workers connected before the first task is submitted: neither has a head start
    done: dict[str, Any] = {"lock": threading.Lock(), "count": 0, "connected": threading.Barrier(3)}
    results: list[int] = []
    try:
        workers = threading.Thread(
            target=lambda: results.extend(
                run_threads(2, lambda index: drain(urls[index], tenant.token, queue["id"], index, done), timeout=150)
            )
        )
        workers.start()
        done["connected"].wait(timeout=30)
        for first in range(0, TASKS, 300):
            items = [{"idempotency_key": f"hot-{n}", "task": task_body(queue["id"])} for n in range(first, first + 300)]
            assert post_json(tenant.client, "/v1/tasks:batch", {"tasks": items}).status_code == 200
        workers.join(timeout=160)
    finally:
        second.stop()
    counts = results
    assert sum(counts) == TASKS
    share = counts[0] / TASKS
    assert 0.45 <= share <= 0.55, counts
    assert Task.objects.filter(queue_id=queue["id"], state=TaskState.SUCCEEDED).count() == TASKS
    # each task ran once, and most Starts went ahead with the result before them
    attempts = Attempt.objects.filter(queue_id=queue["id"])
    assert Counter(attempts.values_list("state", flat=True)) == {AttemptState.SUCCEEDED: TASKS}
    by_worker = Counter(attempts.values_list("worker_id", flat=True))
    assert by_worker == {"w-fair-0": counts[0], "w-fair-1": counts[1]}, by_worker
    ahead = attempts.filter(started_at=F("leased_at")).count()
    assert ahead > TASKS // 2, ahead
    assert_invariants()
