"""A Start sent ahead with a result (task.result's start_next): the round that
records the result and hands its key on, or leases into the unkeyed slot it
frees, also starts the task it hands on, under every check of a Start, and the
assignment arrives started. Against the live server, on the rows the round
leaves."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

import orbit_sdk
from orbit.db.pool import REQUEST_DEADLINE_SECONDS
from orbit.models import Event
from queues.models import QueueState
from tasks.models import Attempt, AttemptState, Task, TaskState
from tests.support.api import assert_ok, make_queue
from tests.support.other_connection import other_cursor
from tests.support.start_ahead import result_frames, running_first, send_result
from tests.support.tasks import (
    assert_error_frame,
    cancel,
    configure_queue,
    connect_fixture,  # noqa: F401 - fixture "connect"
    invariants_fixture,  # noqa: F401 - fixture "invariants"
    submit_ok,
    wait_until,
)
from workers import consumers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("invariants")]


def test_a_result_with_start_next_hands_its_key_on_started(tenant, connect):
    worker, first, queue_id = running_first(tenant, connect, "w-ahead")
    answer, handed = result_frames(worker, first, start_next=True)
    assert answer["type"] == "task.result.ok" and answer["task_state"] == "SUCCEEDED", answer
    # the key's next task, already started: the shape of a held entry
    assert handed is not None
    assert handed["state"] == "RUNNING" and handed["attempt_number"] == 1, handed
    assert handed["task"]["concurrency_key"] == "object/7"
    assert int(handed["concurrency_token"]) > int(first["concurrency_token"])
    attempt = Attempt.objects.get(id=handed["attempt_id"])
    task = Task.objects.get(id=handed["task"]["id"])
    assert (attempt.state, attempt.number, attempt.epoch) == (AttemptState.RUNNING, 1, handed["epoch"])
    assert attempt.started_at is not None and attempt.started_at == attempt.leased_at
    assert (task.state, task.attempts) == (TaskState.RUNNING, 1)
    # counted in the start window like any Start, reserving nothing
    state = QueueState.objects.get(queue_id=queue_id)
    assert state.reserved_starts == 0 and state.active_permits == 1
    assert state.window_count >= 1
    moves = [
        (event.data.get("previous"), event.data["state"])
        for event in Event.objects.filter(subject_id=task.id, type="task.state_changed").order_by("seq")
    ]
    assert moves == [(None, "WAITING"), ("WAITING", "LEASED"), ("LEASED", "RUNNING")]
    # a task.start sent anyway is answered from the record
    again = worker.start_ok(handed)
    assert again["attempt_number"] == 1
    assert Task.objects.get(id=task.id).attempts == 1
    # and its own result, asking again, hands on the last one started
    _, last = result_frames(worker, handed, start_next=True)
    assert last is not None and last["state"] == "RUNNING", last
    assert worker.result(last)["task_state"] == "SUCCEEDED"


def test_without_start_next_the_hand_off_arrives_unstarted(tenant, connect):
    worker, first, _ = running_first(tenant, connect, "w-plain")
    _, handed = result_frames(worker, first)
    assert handed is not None and "state" not in handed and "attempt_number" not in handed, handed
    task = Task.objects.get(id=handed["task"]["id"])
    assert (task.state, task.attempts) == (TaskState.LEASED, 0)
    assert worker.start_ok(handed)["attempt_number"] == 1


def test_only_a_task_the_worker_surely_serves_is_started(tenant, connect):
    # given a key whose tasks alternate between two handlers
    queue = make_queue(tenant.client, "ahead-handlers", max_concurrency=10)
    for n, handler in enumerate(["echo", "other", "echo"]):
        submit_ok(tenant.client, queue["id"], f"mixed-{n}", concurrency_key="object/8", handler=handler)
    worker = connect()
    worker.hello_as([queue["id"]], capacity=1, worker_id="w-any")
    first = worker.assignment()
    worker.start_ok(first)
    # a worker that takes any handler has shown it serves echo/v1, not other/v1
    _, handed = result_frames(worker, first, start_next=True)
    assert handed is not None and handed["task"]["handler"] == "other" and "state" not in handed, handed
    worker.start_ok(handed)
    worker.close()
    # a worker that listed its handlers serves whatever it is assigned
    listed = connect()
    hello = listed.hello_as(
        [queue["id"]],
        capacity=1,
        worker_id="w-any",
        handlers=[{"handler": "echo", "handler_version": "v1"}, {"handler": "other", "handler_version": "v1"}],
    )
    assert [(entry["attempt_id"], entry["state"]) for entry in hello["held"]] == [(handed["attempt_id"], "RUNNING")]
    _, last = result_frames(listed, handed, start_next=True)
    assert last is not None and last["task"]["handler"] == "echo" and last["state"] == "RUNNING", last
    assert listed.result(last)["task_state"] == "SUCCEEDED"


def test_a_refused_result_starts_nothing(tenant, connect):
    # given a worker of capacity 1 running a task of key A, and key B's task waiting
    queue = make_queue(tenant.client, "ahead-refused", max_concurrency=10)
    submit_ok(tenant.client, queue["id"], "refused-a", concurrency_key="object/a")
    waiting = submit_ok(tenant.client, queue["id"], "refused-b", concurrency_key="object/b")
    worker = connect()
    worker.hello_as([queue["id"]], capacity=1, worker_id="w-refused")
    first = worker.assignment()
    worker.start_ok(first)
    assert first["task"]["id"] != waiting["id"]
    # when its result names the wrong epoch, asking to start what comes next
    answer, handed = result_frames(worker, {**first, "epoch": first["epoch"] + 1}, start_next=True)
    # then the result is refused, and nothing was started in its slot
    assert_error_frame(answer, "LEASE_LOST")
    assert handed is None
    task = Task.objects.get(id=waiting["id"])
    assert (task.state, task.attempts) == (TaskState.WAITING, 0)
    assert not Attempt.objects.filter(task_id=waiting["id"], state=AttemptState.RUNNING).exists()
    assert Attempt.objects.get(id=first["attempt_id"]).state == AttemptState.RUNNING


def test_start_next_must_be_a_boolean(tenant, connect):
    worker, first, _ = running_first(tenant, connect, "w-bool")
    reply = worker.result(first, start_next="yes")
    assert_error_frame(reply, "INVALID_ARGUMENT")
    assert reply["message"] == "start_next: must be bool"
    # nothing of the result was kept
    assert Attempt.objects.get(id=first["attempt_id"]).state == AttemptState.RUNNING


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
def test_replays_of_a_result_start_nothing_more(tenant, connect, keyed):
    # given a worker of capacity 1 running the first of ten tasks, each of its own key (or unkeyed)
    queue = make_queue(tenant.client, "ahead-replayed", max_concurrency=20)
    for n in range(10):
        submit_ok(tenant.client, queue["id"], f"replayed-{n}", **({"concurrency_key": f"object/{n}"} if keyed else {}))
    worker = connect()
    worker.hello_as([queue["id"]], capacity=1, worker_id="w-replayed")
    first = worker.assignment()
    worker.start_ok(first)
    # when the same result, asking to start what comes next, is sent 8 times back to back
    for _ in range(8):
        send_result(worker, first, start_next=True)
    frames: list[dict[str, Any]] = []
    while (frame := worker.recv_frame(timeout=2)) is not None:
        frames.append(frame)
    # then one copy is recorded, the others answered as replays, and one task handed on
    answers = [frame for frame in frames if frame["type"] == "task.result.ok"]
    assert sorted(answer["duplicate"] for answer in answers) == [False] + [True] * 7, frames
    handed = [frame for frame in frames if frame["type"] == "task.assign"]
    assert len(handed) == 1, handed
    # and the worker holds no more than its capacity
    held = Attempt.objects.filter(
        task_id__in=Task.objects.filter(queue_id=queue["id"]).values("id"),
        state__in=[AttemptState.LEASED, AttemptState.RUNNING],
    ).count()
    assert held == 1
    assert Task.objects.filter(queue_id=queue["id"], state=TaskState.RUNNING).count() == 1


def drop_connection(worker: Any) -> None:
    """Ends the TCP connection without a close handshake, as a killed process does."""
    worker.ws.socket.shutdown(socket.SHUT_RDWR)
    worker.ws.socket.close()


@pytest.mark.parametrize("key", ["object/7", None], ids=["keyed", "unkeyed"])
def test_a_start_ahead_never_acknowledged_is_taken_back_when_the_worker_dies(tenant, connect, key):
    # given a worker of capacity 1 running the first of three tasks (of one key, or unkeyed)
    worker, first, queue_id = running_first(tenant, connect, "w-killed", key=key)
    second = Task.objects.filter(queue_id=queue_id).exclude(id=first["task"]["id"]).order_by("created_at").first()
    # when it sends its result asking to start what comes next, and dies right after
    send_result(worker, first, start_next=True)
    drop_connection(worker)
    # then the result is kept, and the task started ahead goes back to its queue unconsumed
    wait_until(lambda: Task.objects.get(id=first["task"]["id"]).state == TaskState.SUCCEEDED, timeout=10)
    wait_until(
        lambda: (
            not Attempt.objects.filter(
                queue_id=queue_id, state__in=[AttemptState.LEASED, AttemptState.RUNNING]
            ).exists()
        ),
        timeout=10,
    )
    assert not Task.objects.filter(queue_id=queue_id, state=TaskState.NEEDS_REVIEW).exists()
    taken_back = Attempt.objects.filter(queue_id=queue_id, state=AttemptState.RELEASED).get()
    assert taken_back.number is None and taken_back.started_at is None
    assert taken_back.error == {"code": "RELEASED", "message": consumers.TAKEN_BACK_ON_CLOSE}
    task = Task.objects.get(id=taken_back.task_id)
    assert (task.state, task.attempts) == (TaskState.WAITING, 0)
    assert second is not None and task.id == second.id
    state = QueueState.objects.get(queue_id=queue_id)
    assert state.active_permits == 0 and state.reserved_starts == 0
    # and the next worker runs it as attempt 1 (keyed: with a newer token than the one taken back)
    again = connect()
    again.hello_as([queue_id], capacity=1, worker_id="w-next")
    assign = again.assignment()
    assert assign["task"]["id"] == task.id
    if key is not None:
        assert int(assign["concurrency_token"]) > int(taken_back.concurrency_token)
    assert again.start_ok(assign)["attempt_number"] == 1


def test_a_start_ahead_acknowledged_is_left_to_its_lease(tenant, connect):
    # given a task started ahead whose assignment the worker acknowledged (its handler may run)
    worker, first, _ = running_first(tenant, connect, "w-acked")
    _, handed = result_frames(worker, first, start_next=True)
    assert handed is not None and handed["state"] == "RUNNING"
    worker.send("task.assign.ack", attempt_id=handed["attempt_id"])
    # then it can no longer be handed back
    assert_error_frame(worker.release(handed), "STATE_CONFLICT")
    # and the worker's death leaves it running, to its result or its lease
    drop_connection(worker)
    time.sleep(1)
    assert Attempt.objects.get(id=handed["attempt_id"]).state == AttemptState.RUNNING


@pytest.mark.parametrize("old_connection", ["goes away", "hands it back"])
def test_a_start_ahead_a_newer_connection_resumed_is_never_taken_back_by_the_old(tenant, connect, old_connection):
    """The old connection's list of what it never acknowledged knows nothing of
    the newer one's hello, which offered the attempt (held, RUNNING) and resumed
    it: taken back then, the task ran again elsewhere while it ran here."""
    # given a task started ahead on a connection that never acknowledged it (half-open, say)
    old, first, queue_id = running_first(tenant, connect, "w-moved", key=None)
    _, handed = result_frames(old, first, start_next=True)
    assert handed is not None and handed["state"] == "RUNNING"
    # when the worker connects again under its worker_id and resumes it there
    new = connect()
    held = new.hello_as([queue_id], capacity=1, worker_id="w-moved")["held"]
    assert [(entry["attempt_id"], entry["state"]) for entry in held] == [(handed["attempt_id"], "RUNNING")]
    resumed = new.request("task.resume", attempt_id=handed["attempt_id"], epoch=handed["epoch"])
    assert resumed["type"] == "task.resume.ok", resumed
    # and the old connection then goes away, or hands back what it never acknowledged
    if old_connection == "goes away":
        drop_connection(old)
        time.sleep(1)
    else:
        assert_error_frame(old.release(handed), "STATE_CONFLICT")
    # then the attempt runs on where it was resumed, to its result: nothing else may lease it
    attempt = Attempt.objects.get(id=handed["attempt_id"])
    assert (attempt.state, attempt.number) == (AttemptState.RUNNING, 1)
    assert Task.objects.get(id=handed["task"]["id"]).state == TaskState.RUNNING
    reply = new.result(handed)
    assert reply["type"] == "task.result.ok" and reply["task_state"] == "SUCCEEDED" and not reply.get("late"), reply


def test_a_start_ahead_not_yet_acknowledged_can_be_handed_back(tenant, connect):
    worker, first, _ = running_first(tenant, connect, "w-hands-back")
    _, handed = result_frames(worker, first, start_next=True)
    assert handed is not None
    reply = worker.release(handed, reason="no handler")
    assert reply["type"] == "task.release.ok" and reply["task_state"] == "WAITING", reply
    attempt = Attempt.objects.get(id=handed["attempt_id"])
    assert attempt.state == AttemptState.RELEASED and attempt.number is None
    assert Task.objects.get(id=handed["task"]["id"]).attempts == 0


@pytest.mark.parametrize("ending", ["hands it back", "goes away"])
def test_a_start_ahead_cancelled_before_its_handler_ran_ends_cancelled_when_taken_back(tenant, connect, ending):
    """To the API a task started ahead is RUNNING, so a cancel only records the
    intent; taken back, it was never delivered: the cancel holds, as an
    unstarted task's does, instead of the task waiting to run elsewhere."""
    # given a task started ahead, not yet acknowledged, whose cancel a user asked for
    worker, first, queue_id = running_first(tenant, connect, "w-cancelled-ahead")
    _, handed = result_frames(worker, first, start_next=True)
    assert handed is not None and handed["state"] == "RUNNING"
    cancelled = assert_ok(cancel(tenant.client, handed["task"]["id"], "cancel-ahead"))["task"]
    assert (cancelled["state"], cancelled["cancel_requested"]) == ("RUNNING", True)
    # when the worker hands it back, or goes away, before acknowledging it
    if ending == "hands it back":
        reply = worker.release(handed, reason="no handler")
        assert reply["type"] == "task.release.ok" and reply["task_state"] == "CANCELLED", reply
    else:
        drop_connection(worker)
    # then the task ends CANCELLED, its attempt unconsumed
    wait_until(lambda: Task.objects.get(id=handed["task"]["id"]).state == TaskState.CANCELLED, timeout=10)
    task = Task.objects.get(id=handed["task"]["id"])
    assert task.attempts == 0 and task.finished_at is not None
    attempt = Attempt.objects.get(id=handed["attempt_id"])
    assert attempt.state == AttemptState.CANCELLED and attempt.number is None and attempt.started_at is None
    # and the key goes on to the next task, which a worker is offered: never the cancelled one again
    if ending == "goes away":
        connect().hello_as([queue_id], capacity=1, worker_id="w-after-cancel")
    third = Task.objects.filter(queue_id=queue_id).exclude(id__in=[first["task"]["id"], task.id]).get()
    wait_until(lambda: Task.objects.get(id=third.id).state != TaskState.WAITING, timeout=10)
    assert Attempt.objects.filter(task_id=task.id).count() == 1


def held_past_the_deadline(locking_read: str, row_id: str) -> threading.Thread:
    """A row locked by another transaction (`locking_read` of `row_id`) from now
    until a second past the request deadline: a round that needs it waits past
    its caller's deadline, then commits. Join the thread for the lock's release."""
    held = threading.Event()

    def hold() -> None:
        with other_cursor() as cursor:
            cursor.execute(locking_read, [row_id])
            held.set()
            time.sleep(REQUEST_DEADLINE_SECONDS + 1)
            cursor.connection.rollback()

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(5)
    return holder


@pytest.mark.mysql_only
def test_a_hand_off_whose_round_outlived_its_deadline_is_handed_back_not_left_to_expire(tenant, connect):
    """A round that outlives its request's deadline commits after its caller was
    answered UNAVAILABLE: the task its hand-off started ahead was never sent, and
    at its lease's end went to review though no handler had run it."""
    # given a worker running the first of three tasks, whose attempt row another transaction holds
    worker, first, queue_id = running_first(tenant, connect, "w-slow-round", key=None)
    second = Task.objects.filter(queue_id=queue_id).exclude(id=first["task"]["id"]).order_by("created_at").first()
    assert second is not None
    holder = held_past_the_deadline("SELECT id FROM orbit_attempt WHERE id = %s FOR UPDATE", first["attempt_id"])
    # when its result with start_next is answered UNAVAILABLE, and its round commits after all
    reply = worker.request(
        "task.result", attempt_id=first["attempt_id"], epoch=first["epoch"], outcome="SUCCEEDED", start_next=True
    )
    holder.join()
    assert (reply["type"], reply["code"]) == ("error", "UNAVAILABLE"), reply
    wait_until(lambda: Task.objects.get(id=first["task"]["id"]).state == TaskState.SUCCEEDED, timeout=10)
    # then the task its round started ahead, never sent, is handed back unconsumed within a moment
    wait_until(lambda: Attempt.objects.filter(task_id=second.id, state=AttemptState.RELEASED).exists(), timeout=5)
    taken_back = Attempt.objects.get(task_id=second.id, state=AttemptState.RELEASED)
    assert taken_back.number is None and taken_back.started_at is None
    assert taken_back.error == {"code": "RELEASED", "message": consumers.NEVER_SENT}
    # and the worker is offered it again, to run as its first attempt
    assign = worker.assignment()
    assert assign["task"]["id"] == second.id and "state" not in assign, assign  # unstarted
    assert worker.start_ok(assign)["attempt_number"] == 1
    assert not Task.objects.filter(queue_id=queue_id, state=TaskState.NEEDS_REVIEW).exists()


@pytest.mark.mysql_only
def test_a_lease_whose_round_outlived_its_deadline_is_released_and_leased_again(tenant, connect):
    """The dispatcher's own lease, committed after its deadline, was never sent
    (and, unacknowledged by nobody, waited for its lease to run out)."""
    # given a waiting task whose queue's counter row another transaction holds
    queue = make_queue(tenant.client, "slow-lease", max_concurrency=4)
    task = submit_ok(tenant.client, queue["id"], "slow-lease")
    holder = held_past_the_deadline(
        "SELECT queue_id FROM orbit_queue_state WHERE queue_id = %s FOR UPDATE", queue["id"]
    )
    # when a worker's first lease waits past its deadline, and commits after all
    worker = connect()
    worker.hello_as([queue["id"]], capacity=1, worker_id="w-slow-lease")
    holder.join()
    # then that lease, never sent, is released, and the task leased again and sent
    assign = worker.assignment(timeout=10)
    assert assign["task"]["id"] == task["id"]
    attempts = Attempt.objects.filter(task_id=task["id"]).order_by("leased_at")
    assert [(a.state, a.error) for a in attempts][:-1] == [
        (AttemptState.RELEASED, {"code": "RELEASED", "message": consumers.NEVER_SENT})
    ]
    assert worker.start_ok(assign)["attempt_number"] == 1


# --- unkeyed work: the slot a result frees ------------------------------------


def test_an_unkeyed_result_with_start_next_starts_the_next_task_in_its_slot(tenant, connect):
    worker, first, queue_id = running_first(tenant, connect, "w-slot", key=None)
    answer, handed = result_frames(worker, first, start_next=True)
    assert answer["task_state"] == "SUCCEEDED", answer
    # the queue's next task, right behind the answer, already started
    assert handed is not None and handed["state"] == "RUNNING" and handed["attempt_number"] == 1, handed
    assert "concurrency_token" not in handed and "concurrency_key" not in handed["task"]
    attempt = Attempt.objects.get(id=handed["attempt_id"])
    task = Task.objects.get(id=handed["task"]["id"])
    assert attempt.state == AttemptState.RUNNING and attempt.started_at == attempt.leased_at
    assert (task.state, task.attempts) == (TaskState.RUNNING, 1)
    state = QueueState.objects.get(queue_id=queue_id)
    assert state.active_permits == 1 and state.reserved_starts == 0 and state.window_count == 2
    moves = [
        (event.data.get("previous"), event.data["state"])
        for event in Event.objects.filter(subject_id=task.id, type="task.state_changed").order_by("seq")
    ]
    assert moves == [(None, "WAITING"), ("WAITING", "LEASED"), ("LEASED", "RUNNING")]
    # and its own result hands on the last one, started too
    _, last = result_frames(worker, handed, start_next=True)
    assert last is not None and last["state"] == "RUNNING", last
    assert worker.result(last)["task_state"] == "SUCCEEDED"


def test_an_unkeyed_result_without_start_next_leaves_its_slot_to_the_dispatcher(tenant, connect):
    worker, first, _ = running_first(tenant, connect, "w-slot-plain", key=None)
    assert worker.result(first)["task_state"] == "SUCCEEDED"
    # the dispatcher leases the next one, unstarted, for the worker's own task.start
    following = worker.assignment()
    assert "state" not in following and "attempt_number" not in following, following
    assert Task.objects.get(id=following["task"]["id"]).state == TaskState.LEASED
    assert worker.start_ok(following)["attempt_number"] == 1


def test_an_unkeyed_hand_off_waits_for_room_in_the_start_window(tenant, connect):
    # given a queue that starts one task a second, its first started this second
    worker, first, queue_id = running_first(tenant, connect, "w-slot-rate", key=None, rate=1)
    # when its result asks to start what comes next
    answer, handed = result_frames(worker, first, start_next=True)
    # then nothing is started into the slot while the window is full
    assert answer["task_state"] == "SUCCEEDED", answer
    assert QueueState.objects.get(queue_id=queue_id).window_count == 1
    # and once it reopens, the dispatcher leases the next one for the worker's own Start (on a
    # slow machine the window may reopen within result_frames' wait for a frame behind the answer)
    following = handed if handed is not None else worker.assignment()
    assert "state" not in following, following
    opened = Attempt.objects.get(id=first["attempt_id"]).started_at
    assert Attempt.objects.get(id=following["attempt_id"]).leased_at >= opened + timedelta(seconds=1)
    assert worker.start_ok(following)["attempt_number"] == 1


def test_a_paused_queue_starts_nothing_ahead(tenant, connect):
    worker, first, queue_id = running_first(tenant, connect, "w-slot-paused", key=None)
    configure_queue(tenant.client, queue_id, paused=True)
    answer, handed = result_frames(worker, first, start_next=True)
    assert answer["task_state"] == "SUCCEEDED" and handed is None, (answer, handed)
    assert not Task.objects.filter(queue_id=queue_id, state__in=[TaskState.LEASED, TaskState.RUNNING]).exists()


def at_the_unacknowledged_bound(
    tenant: Any, connect: Any, worker_id: str, handlers: list[str]
) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    """A queue of unkeyed tasks of `handlers` (in submit order), and a worker of a
    capacity above UNACKED_MAX that started one assignment and acknowledged no other:
    UNACKED_MAX assignments wait for an acknowledgement, one runs, slots are left."""
    bound = consumers.UNACKED_MAX
    queue = make_queue(tenant.client, f"bound-{worker_id}", max_concurrency=100, rate_per_second=1000)
    for n, handler in enumerate(handlers):
        submit_ok(tenant.client, queue["id"], f"{worker_id}-{n}", handler=handler)
    worker = connect()
    worker.hello_as([queue["id"]], capacity=bound + 4, worker_id=worker_id)
    waiting = [worker.next_assignment(timeout=5) for _ in range(bound)]
    assert all(frame is not None and "state" not in frame for frame in waiting), waiting
    first = waiting.pop(0)
    worker.start_ok(first)  # names it: room for one more unacknowledged assignment
    extra = worker.next_assignment(timeout=5)
    assert extra is not None and "state" not in extra, extra
    waiting.append(extra)
    worker.no_assignment(within=0.5)  # the bound holds the rest back
    return worker, first, waiting


def test_past_the_unacknowledged_bound_a_result_with_start_next_still_hands_off(tenant, connect):
    # given a worker at the bound on unacknowledged assignments, with free capacity
    worker, first, waiting = at_the_unacknowledged_bound(tenant, connect, "w-bound", ["echo"] * 24)
    # when the one it runs ends with start_next
    answer, handed = result_frames(worker, first, start_next=True)
    # then the next task arrives started into its slot (nothing more to acknowledge)
    assert answer["task_state"] == "SUCCEEDED", answer
    assert handed is not None and handed["state"] == "RUNNING" and handed["attempt_number"] == 1, handed
    assert Task.objects.get(id=handed["task"]["id"]).state == TaskState.RUNNING
    # and still no unstarted one past the bound
    worker.no_assignment(within=0.5)
    unstarted = Attempt.objects.filter(worker_id="w-bound", state=AttemptState.LEASED).count()
    assert unstarted == consumers.UNACKED_MAX == len(waiting)
    assert worker.result(handed)["task_state"] == "SUCCEEDED"


def test_past_the_unacknowledged_bound_a_hand_off_takes_nothing_it_cannot_start(tenant, connect):
    # given a worker at the bound whose queue's next task is of a handler it has not shown it
    # serves (it takes any handler, and ran echo/v1)
    bound = consumers.UNACKED_MAX
    handlers = ["echo"] * (bound + 1) + ["other"] + ["echo"] * 4
    worker, first, waiting = at_the_unacknowledged_bound(tenant, connect, "w-bound-other", handlers)
    other = Task.objects.get(handler="other")
    # when the one it runs ends with start_next
    answer, handed = result_frames(worker, first, start_next=True)
    # then nothing follows the answer: other/v1 would go out unstarted, past the bound,
    # and no later task overtakes it
    assert answer["task_state"] == "SUCCEEDED", answer
    assert handed is None
    assert Task.objects.get(id=other.id).state == TaskState.WAITING
    assert Attempt.objects.filter(worker_id="w-bound-other", state=AttemptState.LEASED).count() == bound
    # and once an assignment is acknowledged, the dispatcher leases it, unstarted, into the free slot
    worker.send("task.assign.ack", attempt_id=waiting[0]["attempt_id"])
    following = worker.next_assignment(timeout=5)
    assert following is not None and following["task"]["id"] == other.id and "state" not in following, following


def test_sdk_workers_above_the_bound_drain_a_backlog_each_task_once(tenant, orbit_server):
    # given a backlog, and two SDK workers whose capacity is twice the unacknowledged bound
    queue = make_queue(tenant.client, "bound-drain", max_concurrency=1000, rate_per_second=100_000)
    task_ids = {submit_ok(tenant.client, queue["id"], f"bound-drain-{n}")["id"] for n in range(300)}
    ran: list[tuple[str, str]] = []
    lock = threading.Lock()

    async def echo(execution: orbit_sdk.Execution) -> dict[str, Any]:
        with lock:
            ran.append((execution.task.id, execution.attempt_id))
        return {"ok": True}

    workers = [
        orbit_sdk.Worker(
            orbit_server.url,
            tenant.token,
            [queue["id"]],
            {("echo", "v1"): echo},
            capacity=2 * consumers.UNACKED_MAX,
            worker_id=f"w-bound-drain-{n}",
            namespace_id=tenant.namespace_id,
        )
        for n in range(2)
    ]
    for worker in workers:
        worker.start()
    try:
        wait_until(
            lambda: Task.objects.filter(id__in=task_ids, state=TaskState.SUCCEEDED).count() == len(task_ids),
            timeout=60,
            what="the backlog drained",
        )
    finally:
        for worker in workers:
            worker.stop(timeout=5)
            worker.join(timeout=10)
    # then every task ran once, on its one attempt, and every one past each worker's first
    # fill (its capacity, leased unstarted by its dispatcher) was started by a hand-off
    assert Counter(task for task, _ in ran) == dict.fromkeys(task_ids, 1)
    attempts = list(Attempt.objects.filter(task_id__in=task_ids))
    assert sorted(attempt.task_id for attempt in attempts) == sorted(task_ids)
    assert {attempt.state for attempt in attempts} == {AttemptState.SUCCEEDED}
    assert {attempt.id for attempt in attempts} == {attempt_id for _, attempt_id in ran}
    started_ahead = sum(attempt.started_at == attempt.leased_at for attempt in attempts)
    assert started_ahead >= len(task_ids) - 2 * 2 * consumers.UNACKED_MAX, started_ahead
