"""Frames an adversarial worker sends (docs/protocol.md): each is refused with
a clear error, never an INTERNAL or a crash of the consumer, the connection is
kept where the docs keep it, and nothing already accepted moves."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async

from tasks.models import Attempt, Task, WorkerIdentity
from tests.support.api import make_queue
from tests.support.tasks import (
    assert_error_frame,
    assert_invariants,
    connect_fixture,  # noqa: F401 - fixture "connect"
    invariants_fixture,  # noqa: F401 - fixture "invariants"
    submit_ok,
)
from tests.support.workers import ProtocolClient

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("invariants")]


@pytest.fixture
def queue(tenant):
    return make_queue(tenant.client, "refusals", rate_per_second=1000)


# --- a task.release naming its attempt with a list or an object -----------------


@pytest.mark.parametrize("attempt_id", [["a" * 32], {"id": "a" * 32}], ids=["list", "object"])
def test_a_release_whose_attempt_id_is_no_string_is_invalid_argument(tenant, queue, connect, attempt_id):
    # given a worker holding a leased task
    task = submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    worker.hello_as([queue["id"]], capacity=1, worker_id="releaser")
    assign = worker.assignment()
    # when it hands back "an attempt" whose id is a list or an object (the other
    # requests refuse that as INVALID_ARGUMENT naming attempt_id)
    reply = worker.request("task.release", attempt_id=attempt_id, epoch=assign["epoch"], reason="x")
    # then the same refusal, not INTERNAL ("internal error": the consumer looked the
    # unhashable value up among its started-ahead attempts before checking its type)
    assert_error_frame(reply, "INVALID_ARGUMENT")
    assert reply["message"].startswith("attempt_id:"), reply
    # and nothing moved; the connection goes on
    assert Task.objects.get(id=task["id"]).state == "LEASED"
    assert worker.release(assign)["type"] == "task.release.ok"
    assert Task.objects.get(id=task["id"]).state == "WAITING"


# --- a connection that closes before its hello ----------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("before_close", ["nothing", "a refused hello", "a request"])
async def test_a_connection_closed_before_hello_ends_without_an_error(tenant, before_close):
    # given an authenticated connection that never said a hello the server took
    queue = await sync_to_async(make_queue)(tenant.client, "no-hello")
    client = ProtocolClient(tenant.token)
    await client.connect()
    if before_close == "a refused hello":
        reply = await client.hello([queue["id"]], capacity=0)
        assert reply["type"] == "error" and reply["code"] == "INVALID_ARGUMENT", reply
    elif before_close == "a request":
        reply = await client.request("task.renew", attempt_id="a" * 32, epoch=1)
        assert reply["type"] == "error" and reply["code"] == "STATE_CONFLICT", reply
    # when the worker closes it
    await client.communicator.send_input({"type": "websocket.disconnect", "code": 1000})
    # then the consumer ends cleanly: its disconnect handler does not fail (it
    # raised AssertionError in hand_back, logged by daphne as "Exception inside
    # application" for every such connection, and left the hello timer running)
    await client.communicator.wait(timeout=2)
    assert client.communicator.future.done() and client.communicator.future.exception() is None
    await sync_to_async(assert_invariants)()


# --- worker identities are compared byte for byte -------------------------------


def test_worker_ids_that_differ_only_in_case_are_distinct_identities(tenant, queue, connect):
    # given worker "Runner" running a task
    task = submit_ok(tenant.client, queue["id"], "t-1", payload={"secret": "runner's"})
    runner = connect()
    runner.hello_as([queue["id"]], capacity=1, worker_id="Runner")
    assign = runner.assignment()
    runner.start_ok(assign)
    # when another process says hello as "runner" (lower case: another worker_id)
    other = connect()
    welcome = other.hello_as([queue["id"]], capacity=1, worker_id="runner")
    # then it holds nothing of Runner's (not listed, payload included, in its held)
    assert welcome["held"] == [], json.dumps(welcome)[:300]
    # and Runner is not superseded: it is still one identity of its own, renews and reports
    identities = WorkerIdentity.objects.filter(worker_id__in=["Runner", "runner"])
    assert set(identities.values_list("worker_id", flat=True)) == {"Runner", "runner"}
    renewed = runner.renew(assign)
    assert renewed["type"] == "task.renew.ok", renewed
    done = runner.result(assign)
    assert done["type"] == "task.result.ok" and done["task_state"] == "SUCCEEDED", done
    assert Attempt.objects.get(id=assign["attempt_id"]).worker_id == "Runner"
    assert Task.objects.get(id=task["id"]).state == "SUCCEEDED"
