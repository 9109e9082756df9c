"""Protocol races slipped in at a precise point: the consumer runs in process
(WebsocketCommunicator) with one dispatch verb wrapped to pause mid-way."""

from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async

from tasks.actions.dispatch import LeaseOutcome
from tasks.actions.rounds import ROUNDS, run_round
from tasks.models import Task
from tests.support.api import make_queue
from tests.support.tasks import assert_invariants, submit_ok
from tests.support.workers import ProtocolClient
from workers import consumers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


async def frames_until_quiet(client: ProtocolClient, quiet: float) -> list[dict]:
    frames = list(client.pending)
    client.pending.clear()
    # receive_nothing, not a receive timeout: asgiref cancels the app on the latter
    while not await client.communicator.receive_nothing(timeout=quiet):
        frames.append(await client.communicator.receive_json_from())
    return frames


async def test_no_assignment_follows_drain_ok_even_with_a_lease_in_flight(tenant, monkeypatch):
    # given a lease transaction that has committed but not yet been sent to the worker
    queue = await sync_to_async(make_queue)(tenant.client)
    leased = threading.Event()
    proceed = threading.Event()

    def paused_round(items):
        answers = run_round(items)
        if any(isinstance(a, LeaseOutcome) and a.assignments for a in answers) and not leased.is_set():
            leased.set()
            proceed.wait(timeout=5)
        return answers

    monkeypatch.setattr(ROUNDS, "run_group", paused_round)
    client = ProtocolClient(tenant.token)
    await client.connect()
    try:
        assert (await client.hello([queue["id"]], capacity=2, worker_id="drainer"))["type"] == "hello.ok"
        task = await sync_to_async(submit_ok)(tenant.client, queue["id"], "t-1")
        assert await asyncio.to_thread(leased.wait, 5)
        # when the worker drains while that lease is in flight
        await client.communicator.send_json_to({"id": "drain-1", "type": "drain"})
        await asyncio.sleep(0.2)
        proceed.set()
        frames = await frames_until_quiet(client, quiet=0.8)
    finally:
        proceed.set()
        await client.close()
    # then the leased task is delivered, but never after drain.ok
    kinds = [frame["type"] for frame in frames]
    assert "drain.ok" in kinds and "task.assign" in kinds, frames
    assert kinds.index("task.assign") < kinds.index("drain.ok"), kinds
    assert frames[kinds.index("task.assign")]["task"]["id"] == task["id"]
    assert await sync_to_async(lambda: Task.objects.get(id=task["id"]).state)() == "LEASED"
    await sync_to_async(assert_invariants)()


async def test_the_consumer_answers_every_frame_and_ends_when_its_client_disconnects(tenant):
    # the consumer reads frames straight from `receive` (no channel layer): it
    # must still answer each one, and end at the disconnect
    queue = await sync_to_async(make_queue)(tenant.client)
    client = ProtocolClient(tenant.token)
    await client.connect()
    assert (await client.hello([queue["id"]], capacity=1, worker_id="ender"))["type"] == "hello.ok"
    for n in range(3):
        await client.communicator.send_json_to({"id": f"bad-{n}", "type": "nonsense"})
    replies = [await client.communicator.receive_json_from(timeout=5) for _ in range(3)]
    assert sorted(reply["reply_to"] for reply in replies) == ["bad-0", "bad-1", "bad-2"]
    await client.communicator.send_input({"type": "websocket.disconnect", "code": 1000})
    await client.communicator.wait(timeout=2)  # raises if the application is still running
    assert client.communicator.future.done() and client.communicator.future.exception() is None


async def renews(client: ProtocolClient, count: int, prefix: str) -> None:
    for n in range(count):
        frame = {"id": f"{prefix}-{n}", "type": "task.renew", "attempt_id": "a" * 32, "epoch": 1}
        await client.communicator.send_json_to(frame)


async def test_a_burst_of_requests_runs_at_most_the_connections_turns_at_once(tenant, monkeypatch):
    # given a worker of capacity 1 (2 * 1 + 32 turns) whose renews each hold their turn until let go
    queue = await sync_to_async(make_queue)(tenant.client)
    running, most = 0, 0
    let_go = asyncio.Event()

    async def held_renew(consumer, message):
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await let_go.wait()
        finally:
            running -= 1
        return {"lease_expires_at": "2026-01-01T00:00:00Z"}

    monkeypatch.setitem(consumers.WorkerConsumer.HANDLERS, "task.renew", held_renew)
    client = ProtocolClient(tenant.token)
    await client.connect()
    try:
        assert (await client.hello([queue["id"]], capacity=1, worker_id="burst"))["type"] == "hello.ok"
        # when it sends 100 renews at once
        await renews(client, 100, "renew")
        await asyncio.sleep(0.5)
        # then 34 run and the rest wait their turn
        assert (running, most) == (34, 34)
        let_go.set()
        frames = [await client.receive(timeout=5) for _ in range(100)]
    finally:
        let_go.set()
        await client.close()
    # and every one is answered, in turns, never more than 34 at once
    assert sorted(frame["reply_to"] for frame in frames) == sorted(f"renew-{n}" for n in range(100))
    assert {frame["type"] for frame in frames} == {"task.renew.ok"}
    assert most == 34


async def test_a_request_that_waits_out_its_deadline_for_a_turn_is_answered_unavailable(tenant, monkeypatch):
    # given a worker of capacity 1 whose 34 results hold every turn (a result's round
    # has a deadline of its own, so it runs without a timer while turns are free)
    queue = await sync_to_async(make_queue)(tenant.client)
    monkeypatch.setattr(consumers, "REQUEST_DEADLINE_SECONDS", 0.5)
    let_go = asyncio.Event()

    async def held_result(consumer, message):
        await let_go.wait()
        return {"task_state": "SUCCEEDED", "duplicate": False}

    monkeypatch.setitem(consumers.WorkerConsumer.HANDLERS, "task.result", held_result)
    client = ProtocolClient(tenant.token)
    await client.connect()
    try:
        assert (await client.hello([queue["id"]], capacity=1, worker_id="waiter"))["type"] == "hello.ok"
        for n in range(34):
            frame = {"id": f"result-{n}", "type": "task.result", "attempt_id": "a" * 32, "epoch": 1}
            await client.communicator.send_json_to({**frame, "outcome": "SUCCEEDED"})
        # when 6 renews arrive behind them and wait past the deadline
        await renews(client, 6, "late")
        refused = [await client.receive(timeout=3) for _ in range(6)]
        let_go.set()
        recorded = [await client.receive(timeout=5) for _ in range(34)]
    finally:
        let_go.set()
        await client.close()
    # then each late one is told why, and the 34 before them still end as they would
    assert sorted(frame["reply_to"] for frame in refused) == [f"late-{n}" for n in range(6)]
    message = "this connection's earlier requests held every turn for 0.5 s (at most 34 run at once); retry later"
    assert {(frame["type"], frame["code"], frame["message"]) for frame in refused} == {
        ("error", "UNAVAILABLE", message)
    }
    assert {frame["type"] for frame in recorded} == {"task.result.ok"}


async def test_an_unknown_type_is_echoed_cut_short(tenant):
    # a reply is never as large as the frame it refuses
    queue = await sync_to_async(make_queue)(tenant.client)
    client = ProtocolClient(tenant.token)
    await client.connect()
    try:
        assert (await client.hello([queue["id"]], capacity=1, worker_id="echo"))["type"] == "hello.ok"
        reply = await client.request("x" * 100_000)
        short = await client.request("task.explode")
    finally:
        await client.close()
    assert reply["message"] == "type: unknown message type '" + "x" * 63 + "…"
    assert short["message"] == "type: unknown message type 'task.explode'"
