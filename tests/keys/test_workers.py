"""hello.concurrency_keys: who may receive keyed work, and that the flag is fixed per worker_id."""

from __future__ import annotations

import json

import pytest
from websockets.exceptions import ConnectionClosed

from tasks.models import Attempt, Task, TaskState, WorkerIdentity
from tests.support.api import make_queue
from tests.support.keys import Worker, submit
from tests.support.tasks import assert_invariants

pytestmark = pytest.mark.django_db(transaction=True)


def hello_frame(queue_id: str, worker_id: str, **extra):
    return {"worker_id": worker_id, "queues": [queue_id], "capacity": 4, "handlers": [], "version": "t", **extra}


@pytest.mark.parametrize("flag", [False, None], ids=["false", "omitted"])
def test_worker_without_key_support_never_gets_keyed_tasks(tenant, orbit_server, connect, flag):
    # given keyed and unkeyed tasks interleaved, keyed first
    queue = make_queue(tenant.client, "legacy", rate_per_second=1000)
    keyed, plain = [], []
    for i in range(3):
        keyed.append(submit(tenant, queue["id"], f"k-{i}", concurrency_key=f"object/{i}")["id"])
        plain.append(submit(tenant, queue["id"], f"p-{i}")["id"])
    # when a worker that did not opt in (false, or the field omitted) connects with room for all
    if flag is None:
        worker = Worker(orbit_server.url, tenant.token)
        try:
            reply = worker.request("hello", **hello_frame(queue["id"], "w-legacy", capacity=10))
            assert reply["type"] == "hello.ok", reply
            got = _drain(worker)
        finally:
            worker.close()
    else:
        worker = connect(tenant, [queue["id"]], "w-legacy", capacity=10, concurrency_keys=False)
        got = _drain(worker)
    # then it gets only the unkeyed tasks, without tokens
    assert sorted(frame["task"]["id"] for frame in got) == sorted(plain)
    for frame in got:
        assert "concurrency_key" not in frame["task"] and "concurrency_token" not in frame
    assert set(Task.objects.filter(id__in=keyed).values_list("state", flat=True)) == {TaskState.WAITING}
    assert not Attempt.objects.filter(task_id__in=keyed).exists()
    assert WorkerIdentity.objects.get(worker_id="w-legacy").concurrency_keys is False
    # and an opted-in worker takes the keyed ones
    keyed_worker = connect(tenant, [queue["id"]], "w-keyed", capacity=10)
    frames = [keyed_worker.expect_assignment() for _ in keyed]
    assert sorted(frame["task"]["id"] for frame in frames) == sorted(keyed)
    for frame in frames:
        keyed_worker.finish(frame)
    assert_invariants()


def _drain(worker: Worker) -> list[dict]:
    got = []
    while (frame := worker.next_assignment(timeout=1.5)) is not None:
        got.append(frame)
        worker.finish(frame)
    return got


@pytest.mark.parametrize("first,then", [(True, False), (False, True), (True, None)], ids=["t-f", "f-t", "t-omit"])
def test_reconnect_changing_the_flag_is_refused_and_closed(tenant, orbit_server, connect, first, then):
    queue = make_queue(tenant.client, "fixed", rate_per_second=1000)
    original = connect(tenant, [queue["id"]], "w-fixed", capacity=1, concurrency_keys=first)
    original.close()
    # when the same worker_id says hello with another concurrency_keys
    worker = Worker(orbit_server.url, tenant.token)
    try:
        extra = {} if then is None else {"concurrency_keys": then}
        reply = worker.request("hello", **hello_frame(queue["id"], "w-fixed", **extra))
        # then STATE_CONFLICT, and the server closes the connection
        assert reply["type"] == "error" and reply["code"] == "STATE_CONFLICT", reply
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                frame = json.loads(worker.ws.recv(timeout=5))
                assert frame.get("type") != "task.assign", frame
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4409
    finally:
        worker.close()
    # and the identity keeps its original registration
    assert WorkerIdentity.objects.get(worker_id="w-fixed").concurrency_keys is first
    assert_invariants()


def test_same_flag_reconnects_and_a_new_worker_id_may_change_it(tenant, orbit_server, connect):
    queue = make_queue(tenant.client, "upgrade", rate_per_second=1000)
    keyed = submit(tenant, queue["id"], "k-1", concurrency_key="object/upgrade")["id"]
    old = connect(tenant, [queue["id"]], "w-old", capacity=1, concurrency_keys=False)
    assert old.next_assignment(timeout=1) is None
    old.close()
    # the same identity with the same flag reconnects fine
    again = connect(tenant, [queue["id"]], "w-old", capacity=1, concurrency_keys=False)
    assert again.welcome["type"] == "hello.ok"
    assert again.next_assignment(timeout=0.5) is None
    # an upgraded process under a new worker_id may opt in and gets the keyed task
    upgraded = connect(tenant, [queue["id"]], "w-new", capacity=1, concurrency_keys=True)
    frame = upgraded.expect_assignment()
    assert frame["task"]["id"] == keyed and frame["concurrency_token"]
    upgraded.finish(frame)
    identities = dict(WorkerIdentity.objects.values_list("worker_id", "concurrency_keys"))
    assert identities == {"w-old": False, "w-new": True}
    assert_invariants()


@pytest.mark.parametrize("value", ["true", 1, 0, None, [True]], ids=repr)
def test_non_boolean_flag_is_refused(tenant, orbit_server, value):
    queue = make_queue(tenant.client, "flag", rate_per_second=1000)
    worker = Worker(orbit_server.url, tenant.token)
    try:
        reply = worker.request("hello", **hello_frame(queue["id"], "w-flag", concurrency_keys=value))
        assert reply["type"] == "error" and reply["code"] == "INVALID_ARGUMENT", reply
        assert "concurrency_keys" in reply["message"]
    finally:
        worker.close()
    assert not WorkerIdentity.objects.filter(worker_id="w-flag").exists()
    assert_invariants()
