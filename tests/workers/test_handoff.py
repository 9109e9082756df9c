"""The hand-off (issue 25): a keyed result's round leases the released key's
next task for the connection that reported it, so the assignment leaves
with the result's answer. Against the live server, with several results of
one connection in flight at once."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tasks.models import Attempt
from tests.support.api import make_queue
from tests.support.tasks import (
    connect_fixture,  # noqa: F401 - fixture "connect"
    invariants_fixture,  # noqa: F401 - fixture "invariants"
    submit_ok,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("invariants")]

KEYS = 4
PER_KEY = 3


def keyed_backlog(tenant: Any) -> dict[str, Any]:
    queue = make_queue(tenant.client, "handoff", max_concurrency=100)
    for n in range(KEYS * PER_KEY):
        submit_ok(tenant.client, queue["id"], f"t-{n}", concurrency_key=f"object/{n % KEYS}")
    return queue


def one_running_per_key(tenant: Any, connect: Any, worker_id: str) -> tuple[Any, list[dict[str, Any]]]:
    """A worker with capacity for exactly one task of each key, each started:
    the next one of a key can only come in the slot its result frees."""
    queue = keyed_backlog(tenant)
    worker = connect()
    worker.hello_as([queue["id"]], capacity=KEYS, worker_id=worker_id)
    running = worker.assignments(KEYS)
    for assign in running:
        worker.start_ok(assign)
    return worker, running


def send_result(worker: Any, assign: dict[str, Any]) -> str:
    return worker.send(
        "task.result", attempt_id=assign["attempt_id"], epoch=assign["epoch"], outcome="SUCCEEDED", retryable=False
    )


def frames_until(worker: Any, done: Any, timeout: float = 10) -> list[dict[str, Any]]:
    """Every frame until `done(frames)` holds."""
    frames: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while not done(frames):
        assert time.monotonic() < deadline, frames
        frame = worker.recv_frame(timeout=max(0.01, deadline - time.monotonic()))
        if frame is not None:
            frames.append(frame)
    return frames


def test_each_keyed_result_hands_its_key_on_right_behind_its_answer(tenant, connect):
    worker, running = one_running_per_key(tenant, connect, "handoff")
    tokens = {a["task"]["concurrency_key"]: a["concurrency_token"] for a in running}
    for _ in range(PER_KEY - 1):
        # Every result of the round at once: the hand-offs run side by side.
        requests = {send_result(worker, assign): assign for assign in running}
        frames = frames_until(
            worker, lambda got: sum(f["type"] in ("task.result.ok", "task.assign") for f in got) == 2 * KEYS
        )
        answers = [f for f in frames if f["type"] == "task.result.ok"]
        handed = [f for f in frames if f["type"] == "task.assign"]
        assert sorted(f["reply_to"] for f in answers) == sorted(requests)
        assert all(f["task_state"] == "SUCCEEDED" and not f["duplicate"] for f in answers)
        # Each answer is followed by its key's next task, before the next answer's
        # own assignment: the assignment left with the answer.
        for index, frame in enumerate(frames):
            if frame["type"] == "task.result.ok":
                key = requests[frame["reply_to"]]["task"]["concurrency_key"]
                assert frames[index + 1]["type"] == "task.assign", frames
                assert frames[index + 1]["task"]["concurrency_key"] == key, frames
        assert sorted(a["task"]["concurrency_key"] for a in handed) == sorted(tokens)
        for assign in handed:
            key = assign["task"]["concurrency_key"]
            assert assign["concurrency_token"] > tokens[key]
            tokens[key] = assign["concurrency_token"]
        # Never more than the capacity at once, as the database counts it.
        assert Attempt.objects.filter(worker_id="handoff", state__in=["LEASED", "RUNNING"]).count() == KEYS
        for assign in handed:
            worker.send("task.assign.ack", attempt_id=assign["attempt_id"])
            worker.start_ok(assign)
        running = handed
    for assign in running:
        assert worker.result(assign)["type"] == "task.result.ok"
    worker.no_assignment(within=0.5)


def test_no_assignment_follows_drain_ok_even_with_hand_offs_in_flight(tenant, connect):
    worker, running = one_running_per_key(tenant, connect, "draining")
    for assign in running:
        send_result(worker, assign)
    drain = worker.send("drain")
    frames = frames_until(
        worker,
        lambda got: (
            any(f.get("reply_to") == drain for f in got) and sum(f["type"] == "task.result.ok" for f in got) == KEYS
        ),
    )
    drained_at = next(index for index, f in enumerate(frames) if f.get("reply_to") == drain)
    handed = [f for f in frames if f["type"] == "task.assign"]
    # What was handed on before drain.ok is the worker's to finish; nothing after it.
    assert all(f["type"] != "task.assign" for f in frames[drained_at:]), frames
    for assign in handed:
        worker.send("task.assign.ack", attempt_id=assign["attempt_id"])
        worker.start_ok(assign)
        assert worker.result(assign)["type"] == "task.result.ok"
    assert worker.wait_closed() == 1000
    assert not [f for f in worker.pending if f["type"] == "task.assign"], worker.pending
