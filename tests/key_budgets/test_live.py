"""Capacity and rate under real concurrency: two server processes, six worker
connections, the attempt rows as witness (SPEC §12)."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from datetime import datetime
from typing import Any

import pytest

from tasks.key_rules import Rate
from tasks.models import Attempt, AttemptState, Task, TaskState
from tests.support.api import make_queue
from tests.support.gcra import gcra_violations
from tests.support.key_rows import make_policy
from tests.support.keys import Worker, submit
from tests.support.live import LiveServer, server_env
from tests.support.tasks import assert_invariants

pytestmark = pytest.mark.django_db(transaction=True)

CAPACITY = 3
RATE = Rate(starts=10, per_seconds=1, burst=2)
CAPPED = [f"cap/{n}" for n in range(2)]
PER_KEY = 40
RATED = 25
PLAIN = 30
TOTAL = PER_KEY * len(CAPPED) + RATED + PLAIN


def work(url: str, token: str, index: int, queue_ids: list[str], done: dict[str, Any]) -> None:
    """One worker connection: takes what it is given, starts it (waiting out
    RATE_LIMITED), holds it 5–30 ms, reports success."""
    worker = Worker(url, token)
    rng = random.Random(index)
    try:
        worker.hello(queue_ids, capacity=4, worker_id=f"w-budget-{index}")
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline:
            with done["lock"]:
                if done["count"] >= TOTAL:
                    return
            frame = worker.next_assignment(timeout=0.2)
            if frame is None:
                continue
            while True:
                reply = worker.request("task.start", attempt_id=frame["attempt_id"], epoch=frame["epoch"])
                if reply["type"] == "task.start.ok":
                    break
                assert reply["code"] == "RATE_LIMITED", reply
                time.sleep(reply["retry_after_ms"] / 1000)
            time.sleep(rng.uniform(0.005, 0.030))
            reply = worker.result(frame)
            assert reply["task_state"] == "SUCCEEDED" and reply["duplicate"] is False, reply
            with done["lock"]:
                done["count"] += 1
        raise AssertionError(f"worker {index} ran out of time")
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        done["errors"].append(exc)
    finally:
        worker.close()


def most_at_once(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most intervals [start, end) that overlap at one moment."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    return most


def test_capacity_and_rate_hold_across_two_servers_and_six_workers(tenant, orbit_server):
    # given capacity 3 on two keys, a rated key, unkeyed work, and a second server process
    make_policy(tenant.namespace, prefix="cap/", capacity=CAPACITY)
    make_policy(tenant.namespace, key="rated", capacity=2, rate=(RATE.starts, RATE.per_seconds, RATE.burst))
    queue = make_queue(tenant.client, "budgets", max_concurrency=50, rate_per_second=100_000)
    tasks: dict[str, str] = {}
    for n in range(PER_KEY):
        for key in CAPPED:
            tasks[submit(tenant, queue["id"], f"{key}-{n}", concurrency_key=key)["id"]] = key
    for n in range(RATED):
        tasks[submit(tenant, queue["id"], f"rated-{n}", concurrency_key="rated")["id"]] = "rated"
    for n in range(PLAIN):
        tasks[submit(tenant, queue["id"], f"plain-{n}")["id"]] = ""
    second = LiveServer(server_env())
    try:
        # when six workers, three on each server, work through them at once
        done: dict[str, Any] = {"count": 0, "lock": threading.Lock(), "errors": []}
        urls = [orbit_server.url, second.url]
        threads = [
            threading.Thread(target=work, args=(urls[i % 2], tenant.token, i, [queue["id"]], done)) for i in range(6)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        second.stop()
    assert not any(thread.is_alive() for thread in threads), "a worker thread hung"
    assert not done["errors"], done["errors"]
    # then every task succeeded on its one attempt
    assert Task.objects.filter(id__in=list(tasks), state=TaskState.SUCCEEDED).count() == TOTAL
    attempts = list(Attempt.objects.filter(task_id__in=list(tasks)))
    assert len(attempts) == TOTAL and {a.state for a in attempts} == {AttemptState.SUCCEEDED}
    by_key: dict[str, list[Attempt]] = defaultdict(list)
    for attempt in attempts:
        by_key[attempt.concurrency_key].append(attempt)
    for key in CAPPED:
        rows = sorted(by_key[key], key=lambda a: a.leased_at)
        # never more than 3 valid permits, and all 3 were used at once
        assert most_at_once([(a.leased_at, a.finished_at) for a in rows]) == CAPACITY, key
        # a slot is given again only after its holder ended
        by_slot: dict[int, list[Attempt]] = defaultdict(list)
        for attempt in rows:
            by_slot[attempt.concurrency_slot].append(attempt)
        assert sorted(by_slot) == list(range(CAPACITY)), key
        for held in by_slot.values():
            for earlier, later in zip(held, held[1:], strict=False):
                assert earlier.finished_at <= later.leased_at, (key, earlier.id, later.id)
        # one strictly increasing token sequence per key, in lease order
        tokens = [a.concurrency_token for a in sorted(rows, key=lambda a: a.concurrency_token)]
        assert len(set(tokens)) == len(tokens)
        assert [a.id for a in sorted(rows, key=lambda a: a.concurrency_token)] == [
            a.id for a in sorted(rows, key=lambda a: (a.leased_at, a.concurrency_token))
        ]
    rated = by_key["rated"]
    assert most_at_once([(a.leased_at, a.finished_at) for a in rated]) <= 2
    assert gcra_violations([a.started_at for a in rated], RATE) == []
    # the rated key's 25 Starts took at least (25 − burst) × 0.1 s
    spread = max(a.started_at for a in rated) - min(a.started_at for a in rated)
    assert spread.total_seconds() >= (RATED - RATE.burst) * 0.1 - 0.01
    assert_invariants()
