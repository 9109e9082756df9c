"""The worker protocol (SPEC §6, docs/protocol.md) against a real daphne server.

Every test here runs with the live server's lease recovery running beside it,
as in production; the invariants are checked after each one."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect

from tasks.models import Attempt, Task
from tests.support.api import assert_error, assert_ok, make_queue, parse_time
from tests.support.factories import make_credential
from tests.support.tasks import (
    assert_error_frame,
    assert_invariants,
    cancel,
    configure_queue,
    connect_fixture,  # noqa: F401 - fixture "connect"
    counters,
    get_task,
    in_seconds,
    invariants_fixture,  # noqa: F401 - fixture "invariants"
    now,
    snapshot,
    submit,
    submit_ok,
    task_body,
    wait_until,
)
from workers.frames import MAX_HANDLERS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("invariants")]


@pytest.fixture
def queue(tenant):
    return make_queue(tenant.client, "work")


def active_attempts_of(worker_id: str) -> int:
    return Attempt.objects.filter(worker_id=worker_id, state__in=["LEASED", "RUNNING"]).count()


def expire_lease(attempt_id: str) -> None:
    """Moves a lease's expiry into the past, as if its time had run out."""
    Attempt.objects.filter(id=attempt_id).update(lease_expires_at=now() - timedelta(seconds=1))


def started_task(tenant, queue, connect, **submit_fields):
    """A submitted task whose attempt a connected worker has started: (task, worker, assignment)."""
    task = submit_ok(tenant.client, queue["id"], "t-1", **submit_fields)
    worker = connect()
    worker.hello_as([queue["id"]], capacity=1, worker_id="runner")
    assign = worker.assignment()
    worker.start_ok(assign)
    return task, worker, assign


# --- handshake -------------------------------------------------------------------


def test_bad_or_missing_token_gets_an_error_frame_and_close(orbit_server, connect):
    for token in ("orb_" + "0" * 32 + "_" + "x" * 30, "not-a-token"):
        worker = connect(token)
        assert_error_frame(worker.recv_frame(timeout=5), "UNAUTHENTICATED")
        assert worker.wait_closed() == 4401
    # no Authorization header at all
    with ws_connect(orbit_server.url.replace("http://", "ws://") + "/v1/workers/connect") as ws:
        assert_error_frame(json.loads(ws.recv(timeout=5)), "UNAUTHENTICATED")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd.code == 4401


@pytest.mark.parametrize("path", ["/v1/nope", "/", "/healthz", "/v1/workers/connect/", "/v1/workers/connectx"])
def test_a_handshake_on_another_path_is_refused(orbit_server, tenant, path):
    # given a valid credential, on a path that is not the worker endpoint
    url = orbit_server.url.replace("http://", "ws://") + path
    # when it asks for a WebSocket: the handshake is refused (403), not failed (500)
    with pytest.raises(InvalidStatus) as refused:
        ws_connect(url, additional_headers={"Authorization": f"Bearer {tenant.token}"})
    assert refused.value.response.status_code == 403
    # and plain HTTP on the same server still answers
    assert httpx.get(orbit_server.url + "/healthz").status_code == 200


def test_credential_without_workers_connect_is_refused(tenant, connect):
    token = make_credential(tenant.namespace, scopes=["tasks:read", "workers:consume"]).token
    worker = connect(token)
    assert_error_frame(worker.recv_frame(timeout=5), "PERMISSION_DENIED")
    assert worker.wait_closed() == 4403


def test_hello_without_workers_consume_is_permission_denied(tenant, queue, connect):
    token = make_credential(tenant.namespace, scopes=["workers:connect"]).token
    worker = connect(token)
    reply = worker.hello_raw(worker_id="w1", queues=[queue["id"]], capacity=1, handlers=[], version="t")
    assert_error_frame(reply, "PERMISSION_DENIED")


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"queues": []}, "INVALID_ARGUMENT"),
        ({"queues": "q"}, "INVALID_ARGUMENT"),
        ({"capacity": 0}, "INVALID_ARGUMENT"),
        ({"capacity": 1001}, "INVALID_ARGUMENT"),
        ({"capacity": "2"}, "INVALID_ARGUMENT"),
        ({"worker_id": ""}, "INVALID_ARGUMENT"),
        ({"worker_id": "has space"}, "INVALID_ARGUMENT"),
        ({"worker_id": "w" * 129}, "INVALID_ARGUMENT"),
        ({"concurrency_keys": "yes"}, "INVALID_ARGUMENT"),
        ({"handlers": [{"handler": "echo", "handler_version": ""}]}, "INVALID_ARGUMENT"),
        ({"handlers": [{"handler_version": "v1"}]}, "INVALID_ARGUMENT"),
        ({"queues": ["0" * 32]}, "NOT_FOUND"),
    ],
)
def test_hello_validation_errors(queue, connect, fields, code):
    # given a connected worker
    worker = connect()
    hello = {"worker_id": "w1", "queues": [queue["id"]], "capacity": 2, "handlers": [], "version": "t", **fields}
    # when its hello breaks a rule: an error frame in reply
    assert_error_frame(worker.hello_raw(**hello), code)
    # then the connection stays open and a correct hello still works
    assert worker.hello_raw(worker_id="w1", queues=[queue["id"]], capacity=1000)["type"] == "hello.ok"


def test_hello_names_its_handlers_when_it_lists_too_many(tenant, queue, connect):
    # given a worker whose handler filter is one pair over the limit
    worker = connect()
    many = [{"handler": f"h{n}", "handler_version": "v1"} for n in range(MAX_HANDLERS + 1)]
    # when it says hello: refused, naming the field
    reply = worker.hello_raw(worker_id="w1", queues=[queue["id"]], capacity=1, handlers=many)
    assert_error_frame(reply, "INVALID_ARGUMENT")
    assert reply["message"].startswith("handlers: "), reply
    # then the limit itself is accepted, and its worker is served
    assert worker.hello_raw(worker_id="w1", queues=[queue["id"]], capacity=1, handlers=many[:-1])["type"] == "hello.ok"
    task = submit_ok(tenant.client, queue["id"], "last", handler=f"h{MAX_HANDLERS - 1}", handler_version="v1")
    assert worker.assignment()["task"]["id"] == task["id"]


def test_hello_accepts_capacity_bounds(queue, connect):
    assert connect().hello_as([queue["id"]], capacity=1, worker_id="a")["type"] == "hello.ok"
    assert connect().hello_as([queue["id"]], capacity=1000, worker_id="b")["type"] == "hello.ok"


def test_hello_for_a_queue_outside_the_range_is_not_found(tenant, queue, connect):
    other = make_queue(tenant.client, "other")
    token = make_credential(tenant.namespace, queue_ids=[queue["id"]]).token
    worker = connect(token)
    assert_error_frame(worker.hello_raw(worker_id="w1", queues=[queue["id"], other["id"]], capacity=1), "NOT_FOUND")
    assert worker.hello_raw(worker_id="w1", queues=[queue["id"]], capacity=1)["type"] == "hello.ok"


def test_hello_ok_shape(queue, connect):
    reply = connect().hello_as([queue["id"]], capacity=3)
    assert set(reply) == {"type", "reply_to", "session_id", "lease_seconds", "renew_seconds", "held"}
    assert reply["held"] == []
    assert reply["renew_seconds"] < reply["lease_seconds"]


def test_messages_before_hello_are_state_conflict(tenant, queue, connect):
    task = submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    for kind, fields in [
        ("task.start", {"attempt_id": "a" * 32, "epoch": 1}),
        ("task.renew", {"attempt_id": "a" * 32, "epoch": 1}),
        ("task.result", {"attempt_id": "a" * 32, "epoch": 1, "outcome": "SUCCEEDED"}),
        ("task.release", {"attempt_id": "a" * 32, "epoch": 1}),
        ("drain", {}),
    ]:
        reply = worker.request(kind, **fields)
        assert_error_frame(reply, "STATE_CONFLICT")
    # nothing was leased to a connection that never said hello
    time.sleep(0.3)
    assert Task.objects.get(id=task["id"]).state == "WAITING"
    assert worker.hello_as([queue["id"]])["type"] == "hello.ok"
    # a second hello on the same connection is refused too
    assert_error_frame(worker.hello_raw(worker_id="w1", queues=[queue["id"]], capacity=1), "STATE_CONFLICT")


def test_unknown_type_and_bad_frames_are_invalid_argument(queue, connect):
    worker = connect()
    worker.hello_as([queue["id"]])
    assert_error_frame(worker.request("task.explode"), "INVALID_ARGUMENT")
    assert_error_frame(worker.request("task.start", attempt_id="a" * 32), "INVALID_ARGUMENT")
    assert_error_frame(worker.request("task.start", attempt_id="a" * 32, epoch="1"), "INVALID_ARGUMENT")
    for epoch in (0, -1, 2**32, 10**40):
        reply = worker.request("task.renew", attempt_id="a" * 32, epoch=epoch)
        assert_error_frame(reply, "INVALID_ARGUMENT")
        assert reply["message"] == "epoch: must be an integer between 1 and 4294967295"
    reply = worker.request("task.result", attempt_id="a" * 32, epoch=1, outcome="FAILED", retryable="yes")
    assert_error_frame(reply, "INVALID_ARGUMENT")
    assert reply["message"] == "retryable: must be bool"  # optional: false when omitted
    worker.ws.send("[1, 2]")
    reply = worker.recv_frame(timeout=5)
    assert_error_frame(reply, "INVALID_ARGUMENT")
    assert reply["message"] == "frame: must be a JSON object"
    worker.ws.send("{not json")
    reply = worker.recv_frame(timeout=5)
    assert_error_frame(reply, "INVALID_ARGUMENT")
    assert reply["message"].startswith("frame: malformed JSON (Expecting property name"), reply
    worker.ws.send('{"type": "drain", "id": "big", "n": ' + "9" * 5000 + "}")
    reply = worker.recv_frame(timeout=5)
    assert_error_frame(reply, "INVALID_ARGUMENT")
    assert reply["message"] == "frame: malformed JSON (an integer of 5000 digits, more than 4300)"
    worker.ws.send('{"type": ["task.assign.ack"], "id": "odd-type"}')  # a type that is no string
    assert_error_frame(worker.recv_frame(timeout=5), "INVALID_ARGUMENT")
    assert_error_frame(worker.request("task.assign.ack", attempt_id=7), "INVALID_ARGUMENT")  # answered in turn
    assert worker.request("drain")["type"] == "drain.ok"


@pytest.mark.parametrize(
    "request_id", [None, 7, "", "x" * 129, ["a"]], ids=["missing", "number", "empty", "long", "list"]
)
def test_a_request_without_a_string_id_is_refused_and_changes_nothing(tenant, queue, connect, request_id):
    # given a worker holding a leased task
    task = submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    worker.hello_as([queue["id"]], capacity=1)
    assign = worker.assignment()
    # when it sends a Start without a usable id
    frame = {"type": "task.start", "attempt_id": assign["attempt_id"], "epoch": assign["epoch"]}
    worker.ws.send(json.dumps(frame if request_id is None else {**frame, "id": request_id}))
    # then an error with no reply_to (there is nothing to answer to) and the attempt is not started
    error = worker.recv_frame(timeout=5)
    assert_error_frame(error, "INVALID_ARGUMENT")
    assert "reply_to" not in error and error["message"] == "id: must be a string of 1 to 128 characters"
    assert Task.objects.get(id=task["id"]).state == "LEASED"
    # and the connection goes on: the same Start with an id is approved
    assert worker.request("task.start", attempt_id=assign["attempt_id"], epoch=assign["epoch"])["type"] == (
        "task.start.ok"
    )


def test_a_lone_surrogate_in_a_frame_is_invalid_argument_not_internal(tenant, queue, connect):
    # given a started task
    task, worker, assign = started_task(tenant, queue, connect)
    # when its result's output holds a \ud800 escape (valid JSON, not valid UTF-8)
    frame = json.dumps(
        {
            "id": "bad-1",
            "type": "task.result",
            "attempt_id": assign["attempt_id"],
            "epoch": assign["epoch"],
            "outcome": "SUCCEEDED",
            "output": {"text": "\ud800"},
        }
    )
    worker.ws.send(frame)
    # then that frame is refused by name and the attempt is untouched
    reply = worker.recv_frame(timeout=5)
    assert_error_frame(reply, "INVALID_ARGUMENT")
    assert reply["reply_to"] == "bad-1" and "surrogate" in reply["message"]
    assert Attempt.objects.get(id=assign["attempt_id"]).state == "RUNNING"
    # and a valid surrogate pair (one emoji) is fine, on the same connection
    done = worker.result(assign, output={"text": "\U0001f600"})
    assert done["type"] == "task.result.ok", done
    assert get_task(tenant.client, task["id"])["output"] == {"text": "\U0001f600"}


def test_frames_nested_too_deeply_or_holding_nan_are_invalid_argument_and_the_connection_lives(tenant, queue, connect):
    # given a started task
    task, worker, assign = started_task(tenant, queue, connect)
    ref = {"attempt_id": assign["attempt_id"], "epoch": assign["epoch"]}
    # when frames too deep for the JSON parser arrive
    for deep in ("[" * 990, '{"a":' * 3000):
        worker.ws.send(deep)
        reply = worker.recv_frame(timeout=5)
        assert_error_frame(reply, "INVALID_ARGUMENT")
        # the parser stops at its recursion limit or, with room to spare, at the unclosed end
        assert reply["message"] == "frame: JSON nested too deeply" or reply["message"].startswith(
            "frame: malformed JSON (Expecting value"
        ), reply
    # and results whose output no JSON column can store: not standard JSON,
    for number in ("NaN", "Infinity", "-Infinity", "1e999"):
        frame = json.dumps({"id": number, "type": "task.result", **ref, "outcome": "SUCCEEDED"})
        worker.ws.send(frame[:-1] + f', "output": {number}}}')
        reply = worker.recv_frame(timeout=5)
        assert_error_frame(reply, "INVALID_ARGUMENT")
        assert reply["message"].startswith("frame: malformed JSON ("), reply
    # or nested 21 levels deep, in the output or the error
    deep_output: list = []
    for _ in range(20):
        deep_output = [deep_output]
    for name, outcome in (("output", "SUCCEEDED"), ("error", "FAILED")):
        reply = worker.result(assign, outcome=outcome, **{name: deep_output})
        assert_error_frame(reply, "INVALID_ARGUMENT")
        assert reply["message"] == f"{name}: must not nest arrays and objects more than 20 levels deep"
    # then nothing was recorded, the connection still answers, and 20 levels are stored
    assert Attempt.objects.get(id=assign["attempt_id"]).state == "RUNNING"
    done = worker.result(assign, output=deep_output[0])
    assert done["type"] == "task.result.ok", done
    assert get_task(tenant.client, task["id"])["output"] == deep_output[0]


def test_changing_concurrency_keys_for_a_worker_id_is_refused(queue, connect):
    connect().hello_as([queue["id"]], worker_id="fixed", concurrency_keys=True)
    worker = connect()
    reply = worker.hello_raw(worker_id="fixed", queues=[queue["id"]], capacity=1, concurrency_keys=False)
    assert_error_frame(reply, "STATE_CONFLICT")
    assert worker.wait_closed() == 4409


# --- start, result, release --------------------------------------------------------------


def test_assignment_shape(tenant, queue, connect):
    task = submit_ok(tenant.client, queue["id"], "t-1", payload={"x": [1]}, business_key="b-1", priority=7)
    worker = connect()
    worker.hello_as([queue["id"]], concurrency_keys=False)
    assign = worker.assignment()
    assert set(assign) == {"type", "id", "attempt_id", "epoch", "lease_expires_at", "task"}
    assert assign["epoch"] == 1
    assert assign["task"] == {
        "id": task["id"],
        "queue_id": queue["id"],
        "handler": "echo",
        "handler_version": "v1",
        "payload_version": "v1",
        "payload": {"x": [1]},
        "business_key": "b-1",
        "priority": 7,
    }
    lease = parse_time(assign["lease_expires_at"]) - now()
    assert timedelta(seconds=25) < lease <= timedelta(seconds=30)


def test_duplicate_start_and_result_change_nothing(tenant, queue, connect):
    # given a leased task
    task = submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    worker.hello_as([queue["id"]])
    assign = worker.assignment()
    # when it is started twice
    first = worker.start_ok(assign)
    after_first = snapshot(task["id"])
    second = worker.start_ok(assign)
    # then the second answer is the recorded one and no row or counter moved
    assert second["attempt_number"] == first["attempt_number"] == 1
    assert second["lease_expires_at"] == first["lease_expires_at"]
    assert snapshot(task["id"]) == after_first
    assert after_first["task"]["attempts"] == 1 and after_first["counters"]["window_count"] == 1
    # (renewals do not count against the start rate either)
    assert worker.renew(assign)["type"] == "task.renew.ok"
    assert counters(queue["id"]) == after_first["counters"]
    # when the result is reported twice
    done = worker.result(assign, output={"ok": True})
    assert done["type"] == "task.result.ok", done
    assert (done["task_state"], done["duplicate"], done["late"]) == ("SUCCEEDED", False, False)
    after_result = snapshot(task["id"])
    again = worker.result(assign, output={"ok": True})
    # then the replay says duplicate and changes nothing
    assert again["type"] == "task.result.ok" and again["duplicate"] is True and again["task_state"] == "SUCCEEDED"
    assert snapshot(task["id"]) == after_result
    # and a start after the result is no new attempt either
    late_start = worker.start(assign)
    assert late_start["type"] == "error" or late_start["attempt_number"] == 1
    assert snapshot(task["id"]) == after_result
    assert after_result["task"]["state"] == "SUCCEEDED" and after_result["task"]["attempts"] == 1
    assert after_result["counters"]["unfinished_tasks"] == 0 and after_result["counters"]["active_permits"] == 0
    assert get_task(tenant.client, task["id"])["output"] == {"ok": True}


def test_start_after_the_lease_expired_is_lease_lost(tenant, queue, connect):
    # given a leased, unstarted task whose lease has run out
    task = submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    worker.hello_as([queue["id"]], worker_id="slow")
    assign = worker.assignment()
    configure_queue(tenant.client, queue["id"], paused=True)  # no re-lease to this worker meanwhile
    expire_lease(assign["attempt_id"])
    # when the worker asks to start
    reply = worker.start(assign)
    # then LEASE_LOST, no attempt consumed; recovery hands the task back
    assert_error_frame(reply, "LEASE_LOST")
    wait_until(lambda: Attempt.objects.get(id=assign["attempt_id"]).state == "EXPIRED", 5, what="recovery")
    row = Task.objects.get(id=task["id"])
    assert row.state == "WAITING" and row.attempts == 0
    assert counters(queue["id"])["active_permits"] == 0 and counters(queue["id"])["window_count"] == 0


def test_renew_and_resume_of_a_lost_lease_are_lease_lost(tenant, queue, connect):
    submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    worker.hello_as([queue["id"]])
    assign = worker.assignment()
    wrong_epoch = {**assign, "epoch": assign["epoch"] + 1}
    assert_error_frame(worker.start(wrong_epoch), "LEASE_LOST")
    assert_error_frame(worker.renew(wrong_epoch), "LEASE_LOST")
    expire_lease(assign["attempt_id"])
    reply = worker.request("task.resume", attempt_id=assign["attempt_id"], epoch=assign["epoch"])
    assert_error_frame(reply, "LEASE_LOST")
    assert_error_frame(worker.renew(assign), "LEASE_LOST")


def test_a_renewal_with_a_wrong_epoch_does_not_free_capacity(tenant, queue, connect):
    # given a worker of capacity 1 holding one of two tasks
    submit_ok(tenant.client, queue["id"], "t-1")
    submit_ok(tenant.client, queue["id"], "t-2")
    worker = connect()
    worker.hello_as([queue["id"]], capacity=1, worker_id="one-slot")
    assign = worker.assignment()
    # when it sends a renewal that names the wrong epoch
    assert_error_frame(worker.renew({**assign, "epoch": assign["epoch"] + 5}), "LEASE_LOST")
    # then its real attempt still fills its only slot: no second assignment
    worker.no_assignment(within=0.8)
    assert active_attempts_of("one-slot") == 1
    # and a drain still waits for that attempt
    assert worker.request("drain")["type"] == "drain.ok"
    worker.start_ok(assign)
    assert worker.result(assign)["task_state"] == "SUCCEEDED"
    assert worker.wait_closed() == 1000


def test_another_workers_attempt_is_lease_lost(tenant, queue, connect):
    submit_ok(tenant.client, queue["id"], "t-1")
    owner = connect()
    owner.hello_as([queue["id"]], worker_id="owner")
    assign = owner.assignment()
    thief = connect()
    thief.hello_as([queue["id"]], worker_id="thief")
    assert_error_frame(thief.start(assign), "LEASE_LOST")
    assert_error_frame(thief.result(assign), "LEASE_LOST")
    assert_error_frame(thief.release(assign), "LEASE_LOST")
    assert Attempt.objects.get(id=assign["attempt_id"]).state == "LEASED"


def test_release_before_start_returns_the_task_to_waiting(tenant, queue, connect):
    # given a leased, unstarted task on a draining worker
    task = submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    worker.hello_as([queue["id"]])
    assign = worker.assignment()
    assert worker.request("drain")["type"] == "drain.ok"
    # when the worker hands it back
    reply = worker.release(assign, reason="shutting down")
    # then the task waits again, no attempt consumed, every permit returned
    assert reply["type"] == "task.release.ok" and reply["task_state"] == "WAITING", reply
    row = Task.objects.get(id=task["id"])
    assert row.state == "WAITING" and row.attempts == 0
    attempt = Attempt.objects.get(id=assign["attempt_id"])
    assert attempt.state == "RELEASED" and attempt.number is None and attempt.started_at is None
    state = counters(queue["id"])
    assert state["active_permits"] == 0 and state["reserved_starts"] == 0 and state["app_active_attempts"] == 0
    assert state["unfinished_tasks"] == 1
    # and the drained worker, now idle, is closed
    assert worker.wait_closed() == 1000


def test_start_of_a_task_cancelled_while_leased_is_task_cancelled(tenant, queue, connect):
    task = submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    worker.hello_as([queue["id"]])
    assign = worker.assignment()
    assert assert_ok(cancel(tenant.client, task["id"], "c-1"))["task"]["state"] == "CANCELLED"
    before = snapshot(task["id"])
    assert_error_frame(worker.start(assign), "TASK_CANCELLED")
    assert snapshot(task["id"]) == before
    assert before["task"]["attempts"] == 0 and before["counters"]["active_permits"] == 0


def test_release_after_start_is_refused(tenant, queue, connect):
    _, worker, assign = started_task(tenant, queue, connect)
    assert_error_frame(worker.release(assign), "STATE_CONFLICT")
    assert Attempt.objects.get(id=assign["attempt_id"]).state == "RUNNING"


def test_result_for_an_unstarted_attempt_is_an_error(tenant, queue, connect):
    task = submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    worker.hello_as([queue["id"]])
    assign = worker.assignment()
    before = snapshot(task["id"])
    reply = worker.result(assign, outcome="SUCCEEDED")
    assert reply["type"] == "error", reply
    assert snapshot(task["id"]) == before
    assert before["task"]["state"] == "LEASED"


def test_result_with_a_bad_outcome_is_invalid_argument(tenant, queue, connect):
    task, worker, assign = started_task(tenant, queue, connect)
    before = snapshot(task["id"])
    assert_error_frame(worker.result(assign, outcome="DONE"), "INVALID_ARGUMENT")
    assert_error_frame(worker.result(assign, outcome="FAILED", retryable="yes"), "INVALID_ARGUMENT")
    assert snapshot(task["id"]) == before


# --- capacity, handlers, drain, reconnect ---------------------------------------------------


def test_worker_never_holds_more_than_its_capacity(tenant, queue, connect):
    # given ten waiting tasks and a worker of capacity 2
    tasks = [submit_ok(tenant.client, queue["id"], f"t-{i}")["id"] for i in range(10)]
    worker = connect()
    worker.hello_as([queue["id"]], capacity=2, worker_id="cap2")
    # when it withholds results, it gets exactly two assignments
    held = worker.assignments(2)
    worker.no_assignment(within=0.8)
    assert active_attempts_of("cap2") == 2
    # when it works them one at a time, each result frees exactly one slot
    done = 0
    while held:
        assign = held.pop(0)
        worker.start_ok(assign)
        assert active_attempts_of("cap2") <= 2
        assert worker.result(assign)["task_state"] == "SUCCEEDED"
        done += 1
        if done <= 8:
            held.append(worker.assignment())
        assert active_attempts_of("cap2") <= 2
    worker.no_assignment(within=0.5)
    assert Task.objects.filter(id__in=tasks, state="SUCCEEDED").count() == 10
    assert Attempt.objects.filter(worker_id="cap2").count() == 10


def test_handlers_filter_assignments(tenant, queue, connect):
    # given tasks for three handler versions
    wanted = submit_ok(tenant.client, queue["id"], "a1", handler="resize", handler_version="v1")
    other_version = submit_ok(tenant.client, queue["id"], "a2", handler="resize", handler_version="v2")
    other_handler = submit_ok(tenant.client, queue["id"], "b1", handler="crop", handler_version="v1")
    # when a worker lists only resize/v1
    picky = connect()
    picky.hello_as(
        [queue["id"]], capacity=5, worker_id="picky", handlers=[{"handler": "resize", "handler_version": "v1"}]
    )
    # then it gets that task and nothing else
    assert picky.assignment()["task"]["id"] == wanted["id"]
    picky.no_assignment(within=0.6)
    assert Task.objects.get(id=other_version["id"]).state == "WAITING"
    # and a worker with an empty list takes any handler
    anyone = connect()
    anyone.hello_as([queue["id"]], capacity=5, worker_id="anyone")
    got = {a["task"]["id"] for a in anyone.assignments(2)}
    assert got == {other_version["id"], other_handler["id"]}


def test_a_handler_listed_without_a_version_takes_any_version_of_it_and_nothing_else(tenant, queue, connect):
    # given tasks of another handler first, then two versions of resize
    other = submit_ok(tenant.client, queue["id"], "c1", handler="crop", handler_version="v1")
    v1 = submit_ok(tenant.client, queue["id"], "r1", handler="resize", handler_version="v1")
    v2 = submit_ok(tenant.client, queue["id"], "r2", handler="resize", handler_version="v2")
    # when a worker lists resize without a version, and crop/v9 exactly
    picky = connect()
    picky.hello_as(
        [queue["id"]],
        capacity=5,
        worker_id="any-resize",
        handlers=[{"handler": "resize"}, {"handler": "crop", "handler_version": "v9"}],
    )
    # then it gets both versions of resize, and never the crop/v1 task it cannot run
    assert {a["task"]["id"] for a in picky.assignments(2)} == {v1["id"], v2["id"]}
    picky.no_assignment(within=0.6)
    assert Task.objects.get(id=other["id"]).state == "WAITING"
    assert not Attempt.objects.filter(task_id=other["id"]).exists()


def test_drain_stops_assignments_and_closes_when_idle(tenant, queue, connect):
    # given a worker of capacity 3 running one task
    submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    worker.hello_as([queue["id"]], capacity=3, worker_id="drainer")
    assign = worker.assignment()
    worker.start_ok(assign)
    # when it drains
    reply = worker.request("drain")
    assert reply["type"] == "drain.ok", reply
    # then new work is not assigned to it although it has free capacity
    later = [submit_ok(tenant.client, queue["id"], f"t-{i}")["id"] for i in range(2, 4)]
    worker.no_assignment(within=0.8)
    assert Task.objects.filter(id__in=later, state="WAITING").count() == 2
    # and once the last result is in, the server closes the connection
    assert worker.result(assign)["task_state"] == "SUCCEEDED"
    assert worker.wait_closed() == 1000
    assert not [f for f in worker.pending if f.get("type") == "task.assign"]


def test_a_superseded_connection_leases_nothing_more_for_its_worker_id(tenant, queue, connect):
    # given two connections that said hello as the same worker_id, capacity 2, the second one last
    old = connect()
    old.hello_as([queue["id"]], capacity=2, worker_id="twice")
    new = connect()
    new.hello_as([queue["id"]], capacity=2, worker_id="twice")
    # when six tasks arrive
    for n in range(6):
        submit_ok(tenant.client, queue["id"], f"t-{n}")
    # then only the newest connection is assigned work, up to the identity's capacity
    assert len(new.assignments(2)) == 2
    new.no_assignment(within=0.5)
    assert active_attempts_of("twice") == 2
    # and the superseded one is told so and closed, with nothing assigned
    assert old.wait_closed() == 4409
    assert not [frame for frame in old.pending if frame.get("type") == "task.assign"]
    superseded = [frame for frame in old.pending if frame.get("type") == "error"]
    assert [frame["code"] for frame in superseded] == ["STATE_CONFLICT"], old.pending
    assert superseded[0]["message"] == "superseded by a newer connection of this worker_id"


def test_a_renewal_racing_a_cancel_is_answered_ok_or_lease_lost(tenant, queue, orbit_server, connect):
    # given leased, unstarted attempts renewed at the moment their tasks are cancelled, many times over
    headers = {"Authorization": f"Bearer {tenant.token}"}
    queues = [queue] + [make_queue(tenant.client, f"race-{n}") for n in (1, 2)]  # one worker each
    workers = [connect() for _ in queues]
    for n, (worker, own) in enumerate(zip(workers, queues, strict=True)):
        worker.hello_as([own["id"]], capacity=1, worker_id=f"racer-{n}")

    def race(n: int, worker) -> list[str]:
        answers = []
        with httpx.Client(base_url=orbit_server.url, headers=headers, timeout=30) as http:
            for round_number in range(25):
                body = {**task_body(queues[n]["id"]), "payload": {"round": round_number}}
                key = f"race-{n}-{round_number}"
                submitted = http.post("/v1/tasks", json=body, headers={"Idempotency-Key": key})
                task_id = submitted.json()["data"]["task"]["id"]
                assign = worker.assignment()
                with ThreadPoolExecutor(1) as pool:
                    cancel_key = {"Idempotency-Key": f"{key}-cancel"}
                    path = f"/v1/tasks/{task_id}:cancel"
                    cancelled = pool.submit(http.post, path, json={"reason": "race"}, headers=cancel_key)
                    renewed = worker.renew(assign)
                    assert cancelled.result().status_code == 200
                worker.release(assign, reason="cancelled")  # as the SDK gives back a cancelled lease
                answers.append(renewed["type"] if renewed["type"] != "error" else renewed["code"])
        return answers

    # when the renewals and cancels run side by side on three connections
    with ThreadPoolExecutor(len(workers)) as pool:
        answers = [answer for done in pool.map(race, range(len(workers)), workers) for answer in done]
    # then each renewal is answered as one side or the other won, never as if the database were down
    assert set(answers) <= {"task.renew.ok", "LEASE_LOST"}, answers


def test_reconnect_within_the_lease_keeps_attempts(tenant, queue, connect):
    # given a worker holding a running and a leased attempt
    submit_ok(tenant.client, queue["id"], "t-1", priority=9)
    submit_ok(tenant.client, queue["id"], "t-2", priority=1, concurrency_key="printer")
    first = connect()
    first.hello_as([queue["id"]], capacity=2, worker_id="phoenix")
    running, leased = first.assignments(2)
    first.start_ok(running)
    # when its connection drops without drain and it reconnects under the same worker_id
    first.close()
    # (disconnecting releases nothing)
    time.sleep(0.2)
    assert counters(queue["id"])["active_permits"] == 2 and active_attempts_of("phoenix") == 2
    second = connect()
    submit_ok(tenant.client, queue["id"], "t-3")
    hello = second.hello_as([queue["id"]], capacity=2, worker_id="phoenix")
    # then hello.ok.held lists both attempts with their state
    held = {entry["attempt_id"]: entry for entry in hello["held"]}
    assert set(held) == {running["attempt_id"], leased["attempt_id"]}
    assert held[running["attempt_id"]]["state"] == "RUNNING" and held[running["attempt_id"]]["attempt_number"] == 1
    assert held[leased["attempt_id"]]["state"] == "LEASED" and "attempt_number" not in held[leased["attempt_id"]]
    for original in (running, leased):
        entry = held[original["attempt_id"]]
        assert entry["epoch"] == original["epoch"] and entry["task"] == original["task"]
        assert entry.get("concurrency_token") == original.get("concurrency_token")
    assert leased["concurrency_token"] == "1"
    # and task.resume confirms the same attempt and epoch
    for original in (running, leased):
        reply = second.request("task.resume", attempt_id=original["attempt_id"], epoch=original["epoch"])
        assert reply["type"] == "task.resume.ok", reply
        body = reply.get("assignment", reply)
        assert body["attempt_id"] == original["attempt_id"] and body["epoch"] == original["epoch"]
        assert body["task"] == original["task"]
        assert body.get("concurrency_token") == original.get("concurrency_token")
    # and the held attempts fill its capacity: the third task is not assigned
    second.no_assignment(within=0.6)
    assert active_attempts_of("phoenix") == 2
    # and both can be finished over the new connection
    assert second.result(running)["task_state"] == "SUCCEEDED"
    second.start_ok(leased)
    assert second.result(leased)["task_state"] == "SUCCEEDED"
    assert second.assignment()["task"]["handler"] == "echo"


# --- outcomes ------------------------------------------------------------------------------------


def test_retryable_failure_waits_out_its_backoff(tenant, queue, connect):
    # given a running task with attempts left and a 30 s initial backoff
    retry = {"initial_seconds": 30, "multiplier": 2}
    task, worker, assign = started_task(tenant, queue, connect, max_attempts=3, retry=retry)
    # when it fails retryably
    reply = worker.result(assign, outcome="FAILED", retryable=True, error={"code": "TIMEOUT"})
    failed_at = now()
    # then it waits again until now + 30 s, one attempt counted, its permit released
    assert reply["type"] == "task.result.ok" and reply["task_state"] == "WAITING", reply
    detail = get_task(tenant.client, task["id"])
    assert detail["state"] == "WAITING" and detail["attempts"] == 1 and detail["last_error"] == {"code": "TIMEOUT"}
    delay = (parse_time(detail["available_at"]) - failed_at).total_seconds()
    assert 28 <= delay <= 30.5, delay
    attempt = Attempt.objects.get(id=assign["attempt_id"])
    assert attempt.state == "FAILED" and attempt.retryable is True and attempt.number == 1
    state = counters(queue["id"])
    assert state["active_permits"] == 0 and state["app_active_attempts"] == 0 and state["unfinished_tasks"] == 1
    # and it is not leased again before its time
    worker.no_assignment(within=0.6)


def test_non_retryable_failure_is_final(tenant, queue, connect):
    task, worker, assign = started_task(tenant, queue, connect)
    reply = worker.result(assign, outcome="FAILED", retryable=False, error={"code": "BAD_INPUT"})
    assert reply["task_state"] == "FAILED"
    detail = get_task(tenant.client, task["id"])
    assert detail["state"] == "FAILED" and "finished_at" in detail and detail["last_error"] == {"code": "BAD_INPUT"}
    state = counters(queue["id"])
    assert state["unfinished_tasks"] == 0 and state["active_permits"] == 0


def test_full_backlog_does_not_limit_results_or_cancels(tenant, connect):
    # given a queue whose only backlog slot is taken by a running task
    small = make_queue(tenant.client, "small", max_unfinished_tasks=1)
    task = submit_ok(tenant.client, small["id"], "t-1")
    worker = connect()
    worker.hello_as([small["id"]], worker_id="full")
    assign = worker.assignment()
    worker.start_ok(assign)
    assert submit(tenant.client, small["id"], "t-2").status_code == 429
    # then its result is still accepted, and a cancel of it is answered normally
    assert worker.result(assign)["task_state"] == "SUCCEEDED"
    assert_error(cancel(tenant.client, task["id"], "c-1"), 409, "STATE_CONFLICT")
    assert counters(small["id"])["unfinished_tasks"] == 0


def test_retryable_failure_with_attempts_exhausted_is_final(tenant, queue, connect):
    task, worker, assign = started_task(tenant, queue, connect, max_attempts=1)
    assert worker.result(assign, outcome="FAILED", retryable=True)["task_state"] == "FAILED"
    assert get_task(tenant.client, task["id"])["attempts"] == 1
    assert counters(queue["id"])["unfinished_tasks"] == 0


def test_retries_until_the_budget_is_spent(tenant, queue, connect):
    submit_ok(tenant.client, queue["id"], "t-1", max_attempts=2, retry={"initial_seconds": 0, "max_seconds": 0})
    worker = connect()
    worker.hello_as([queue["id"]], worker_id="retrier")
    first = worker.assignment()
    assert worker.start_ok(first)["attempt_number"] == 1
    assert worker.result(first, outcome="FAILED", retryable=True)["task_state"] == "WAITING"
    second = worker.assignment()
    assert second["epoch"] == 2 and second["task"]["id"] == first["task"]["id"]
    assert worker.start_ok(second)["attempt_number"] == 2
    assert worker.result(second, outcome="FAILED", retryable=True)["task_state"] == "FAILED"
    assert counters(queue["id"])["unfinished_tasks"] == 0


def test_unknown_outcome_needs_review_and_keeps_its_backlog_slot(tenant, queue, connect):
    task, worker, assign = started_task(tenant, queue, connect)
    reply = worker.result(assign, outcome="UNKNOWN", error={"code": "CRASHED_MIDWAY"})
    assert reply["task_state"] == "NEEDS_REVIEW"
    detail = get_task(tenant.client, task["id"])
    assert detail["state"] == "NEEDS_REVIEW" and "finished_at" not in detail
    assert Attempt.objects.get(id=assign["attempt_id"]).state == "UNKNOWN"
    state = counters(queue["id"])
    assert state["active_permits"] == 0 and state["app_active_attempts"] == 0
    assert state["unfinished_tasks"] == 1 and state["app_unfinished_tasks"] == 1
    # a NEEDS_REVIEW task is never leased again by itself
    worker.no_assignment(within=0.6)


def test_late_result_for_an_expired_running_attempt_is_kept_as_evidence(tenant, queue, connect):
    # given a started attempt whose lease ran out and was recovered
    task, worker, assign = started_task(tenant, queue, connect)
    expire_lease(assign["attempt_id"])
    wait_until(lambda: Attempt.objects.get(id=assign["attempt_id"]).state == "UNKNOWN", 5, what="recovery")
    before = snapshot(task["id"])
    assert before["task"]["state"] == "NEEDS_REVIEW"
    # when the result arrives late
    reply = worker.result(assign, outcome="SUCCEEDED", output={"done": 1})
    # then it is acknowledged as late, stored on the attempt, and nothing else moves
    assert reply["type"] == "task.result.ok", reply
    assert reply["late"] is True and reply["duplicate"] is False and reply["task_state"] == "NEEDS_REVIEW"
    after = snapshot(task["id"])
    late = after["attempts"][0].pop("late_outcome")
    assert late["outcome"] == "SUCCEEDED" and late["output"] == {"done": 1}
    assert set(late) == {"outcome", "retryable", "output", "received_at"}  # no error: omitted, not null
    before["attempts"][0].pop("late_outcome")
    assert after == before
    # and a replay of the late result is a duplicate
    again = worker.result(assign, outcome="SUCCEEDED", output={"done": 1})
    assert again["late"] is True and again["duplicate"] is True
    assert snapshot(task["id"])["counters"] == before["counters"]


def test_late_result_for_an_expired_unstarted_attempt_changes_nothing(tenant, queue, connect):
    task = submit_ok(tenant.client, queue["id"], "t-1")
    worker = connect()
    worker.hello_as([queue["id"]], worker_id="late")
    assign = worker.assignment()
    configure_queue(tenant.client, queue["id"], paused=True)  # no re-lease to this worker meanwhile
    expire_lease(assign["attempt_id"])
    wait_until(lambda: Attempt.objects.get(id=assign["attempt_id"]).state == "EXPIRED", 5, what="recovery")
    before = snapshot(task["id"])
    reply = worker.result(assign, outcome="FAILED", retryable=True)
    assert reply["type"] == "task.result.ok" and reply["late"] is True, reply
    after = snapshot(task["id"])
    assert after["attempts"][0].pop("late_outcome")["outcome"] == "FAILED"
    before["attempts"][0].pop("late_outcome")
    assert after == before and after["task"]["state"] == "WAITING"


# --- deadlines -------------------------------------------------------------------------------------


def test_start_deadline_passing_while_waiting_fails_the_task(tenant, queue, connect):
    # given a waiting task whose start deadline is one second away and no worker
    task = submit_ok(tenant.client, queue["id"], "t-1", start_deadline_at=in_seconds(1))
    # when the deadline passes (the server's sweep runs every 0.5 s)
    wait_until(lambda: Task.objects.get(id=task["id"]).state == "FAILED", 5, what="start deadline sweep")
    # then FAILED START_DEADLINE_EXCEEDED and its backlog slot is free
    detail = get_task(tenant.client, task["id"])
    assert detail["last_error"]["code"] == "START_DEADLINE_EXCEEDED" and detail["attempts"] == 0
    assert counters(queue["id"])["unfinished_tasks"] == 0


def test_start_deadline_passing_while_leased_fails_the_task(tenant, queue, connect):
    # given a task leased to a worker that never starts it
    task = submit_ok(tenant.client, queue["id"], "t-1", start_deadline_at=in_seconds(1.5))
    worker = connect()
    worker.hello_as([queue["id"]], worker_id="idle")
    assign = worker.assignment()
    # when the start deadline passes
    wait_until(lambda: Task.objects.get(id=task["id"]).state == "FAILED", 5, what="start deadline sweep")
    # then the task FAILED, its attempt ended and every permit came back
    assert get_task(tenant.client, task["id"])["last_error"]["code"] == "START_DEADLINE_EXCEEDED"
    assert Attempt.objects.get(id=assign["attempt_id"]).state == "EXPIRED"
    state = counters(queue["id"])
    assert state == {**state, "unfinished_tasks": 0, "active_permits": 0, "reserved_starts": 0}
    # and the late Start is refused
    assert_error_frame(worker.start(assign), "LEASE_LOST")


def test_sweep_deadlines_fails_a_waiting_task_in_process(tenant, queue):
    from tasks.actions.endings import sweep_deadlines

    task = submit_ok(tenant.client, queue["id"], "t-1", start_deadline_at=in_seconds(0.5))
    time.sleep(0.6)
    sweep_deadlines()  # the live server's own sweep may have won: both are idempotent
    sweep_deadlines()
    row = Task.objects.get(id=task["id"])
    assert row.state == "FAILED" and row.last_error["code"] == "START_DEADLINE_EXCEEDED"
    assert counters(queue["id"])["unfinished_tasks"] == 0
    assert_invariants()
