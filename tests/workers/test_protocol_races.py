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
