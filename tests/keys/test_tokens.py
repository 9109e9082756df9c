"""concurrency_token: a per-key uint64 that only grows, and which transitions release the key."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from orbit_sdk import Client
from tasks.models import Attempt, AttemptState, ConcurrencyKey, Task, TaskState
from tests.conftest import new_tenant, post_json
from tests.support.api import assert_ok, make_queue, parse_time
from tests.support.concurrent import concurrently
from tests.support.keys import (
    TOKEN,
    UINT64_MAX,
    attempt_row,
    get_attempt,
    get_task,
    key_row,
    list_attempts,
    submit,
)
from tests.support.queues import configure, configure_body
from tests.support.tasks import assert_invariants, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def task_state(task_id: str) -> str:
    return Task.objects.values_list("state", flat=True).get(id=task_id)


def test_token_is_a_decimal_string_iff_keyed_and_matches_the_attempt_views(tenant, connect):
    # given a keyed and an unkeyed task
    queue = make_queue(tenant.client, "tok", rate_per_second=1000)
    keyed = submit(tenant, queue["id"], "t-keyed", concurrency_key="object/42")
    plain = submit(tenant, queue["id"], "t-plain")
    # when a worker leases and completes both
    worker = connect(tenant, [queue["id"]], "w-tok", capacity=2)
    frames = {f["task"]["id"]: f for f in (worker.expect_assignment(), worker.expect_assignment())}
    token = frames[keyed["id"]]["concurrency_token"]
    # then the keyed assignment has a non-zero uint64 decimal string, the other none
    assert isinstance(token, str) and TOKEN.fullmatch(token) and 0 < int(token) <= UINT64_MAX
    assert "concurrency_token" not in frames[plain["id"]]
    for frame in frames.values():
        worker.finish(frame)
    # and the attempt list and detail show the same string (and none for the unkeyed)
    [keyed_attempt] = list_attempts(tenant, keyed["id"])
    assert keyed_attempt["concurrency_token"] == token
    assert get_attempt(tenant, keyed_attempt["id"])["concurrency_token"] == token
    [plain_attempt] = list_attempts(tenant, plain["id"])
    assert "concurrency_token" not in plain_attempt
    assert "concurrency_token" not in get_attempt(tenant, plain_attempt["id"])
    assert attempt_row(plain_attempt["id"]).concurrency_token is None
    assert_invariants()


def successive_attempts_of_a_key_get_increasing_tokens(tenant: Any, connect: Any) -> None:
    """Run by test_leases_backoffs_and_deadlines_waited_out_side_by_side."""
    # given three tasks of one key on two queues
    first, second = (
        make_queue(tenant.client, "seq-1", rate_per_second=1000),
        make_queue(tenant.client, "seq-2", rate_per_second=1000),
    )
    ids = [submit(tenant, (first, second)[i % 2]["id"], f"t-{i}", concurrency_key="object/seq")["id"] for i in range(3)]
    worker = connect(tenant, [first["id"], second["id"]], "w-seq", capacity=3)
    tokens = []
    for _ in ids:
        # when the worker leases one (it never gets a second while one is held)
        frame = worker.expect_assignment()
        assert worker.next_assignment(timeout=0.6) is None
        row = key_row(tenant.namespace_id, "object/seq")
        assert row.holder_attempt_id == frame["attempt_id"] and str(row.version) == frame["concurrency_token"]
        tokens.append(int(frame["concurrency_token"]))
        worker.finish(frame)
        # then the release advanced the version past the token and cleared the
        # holder; the result's own round may already have handed the key on to
        # the next task (a second step of the version, for that lease)
        row = key_row(tenant.namespace_id, "object/seq")
        waiting = [task_id for task_id in ids if Task.objects.get(id=task_id).state == "LEASED"]
        assert_released(row, frame, sibling_id=waiting[0] if waiting else "")
    # and the tokens strictly increase, with the release's step between them
    assert tokens[0] >= 1
    for earlier, later in zip(tokens, tokens[1:], strict=False):
        assert later >= earlier + 2
    assert_invariants()


def assert_released(row, frame, *, sibling_id):
    """The attempt of `frame` no longer holds the key and the version moved past
    its token. The waiting sibling may already hold the key again by the time
    the row is read (the server leases it as soon as the key is free): then the
    version moved once more, for that lease."""
    assert row.holder_attempt_id != frame["attempt_id"]
    if row.holder_attempt_id:
        assert row.holder_task_id == sibling_id and row.version == int(frame["concurrency_token"]) + 2
    else:
        assert row.holder_task_id == "" and row.version == int(frame["concurrency_token"]) + 1


def safe_retry_releases_the_key_during_backoff(tenant: Any, connect: Any) -> None:
    """Run by test_leases_backoffs_and_deadlines_waited_out_side_by_side."""
    # given a retryable task and a second task of the same key
    queue = make_queue(tenant.client, "retry", rate_per_second=1000)
    retried = submit(
        tenant,
        queue["id"],
        "t-retry",
        concurrency_key="object/retry",
        max_attempts=3,
        retry={"initial_seconds": 3, "multiplier": 1, "max_seconds": 3},
    )
    worker = connect(tenant, [queue["id"]], "w-retry", capacity=1)
    frame = worker.expect_assignment()
    assert frame["task"]["id"] == retried["id"]
    other = submit(tenant, queue["id"], "t-other", concurrency_key="object/retry")
    # when the first attempt fails retryably
    worker.start(frame)
    reply = worker.result(frame, outcome="FAILED", retryable=True, error={"code": "flaky"})
    assert reply["task_state"] == "WAITING"
    backoff_until = parse_time(get_task(tenant, retried["id"])["available_at"])
    assert_released(key_row(tenant.namespace_id, "object/retry"), frame, sibling_id=other["id"])
    # then the other task of the key is leased during the backoff
    during = worker.expect_assignment(timeout=2)
    assert during["task"]["id"] == other["id"]
    assert attempt_row(during["attempt_id"]).leased_at < backoff_until
    assert int(during["concurrency_token"]) > int(frame["concurrency_token"])
    worker.finish(during)
    # and the retry later runs with a larger token still
    retry = worker.expect_assignment(timeout=6)
    assert retry["task"]["id"] == retried["id"] and retry["epoch"] == frame["epoch"] + 1
    assert int(retry["concurrency_token"]) > int(during["concurrency_token"])
    assert attempt_row(retry["attempt_id"]).leased_at >= backoff_until
    worker.finish(retry)
    attempts = list_attempts(tenant, retried["id"])
    assert [a["concurrency_token"] for a in attempts] == [frame["concurrency_token"], retry["concurrency_token"]]
    assert [a["state"] for a in attempts] == ["FAILED", "SUCCEEDED"]
    assert_invariants()


def test_unknown_outcome_releases_the_key_and_keeps_the_task_for_review(tenant, connect):
    queue = make_queue(tenant.client, "unknown", rate_per_second=1000)
    doubtful = submit(tenant, queue["id"], "t-unknown", concurrency_key="object/unknown")
    after = submit(tenant, queue["id"], "t-after", concurrency_key="object/unknown")
    worker = connect(tenant, [queue["id"]], "w-unknown", capacity=2)
    frame = worker.expect_assignment()
    assert frame["task"]["id"] == doubtful["id"]
    assert worker.next_assignment(timeout=0.6) is None  # the key is held
    worker.start(frame)
    # when the worker cannot tell what happened
    assert worker.result(frame, outcome="UNKNOWN", error={"code": "timeout"})["task_state"] == "NEEDS_REVIEW"
    # then the key is released at once, not held until review
    assert_released(key_row(tenant.namespace_id, "object/unknown"), frame, sibling_id=after["id"])
    nxt = worker.expect_assignment(timeout=2)
    assert nxt["task"]["id"] == after["id"]
    assert int(nxt["concurrency_token"]) >= int(frame["concurrency_token"]) + 2
    worker.finish(nxt)
    # and the unknown effect stays on record, still counting in the backlog
    assert get_task(tenant, doubtful["id"])["state"] == "NEEDS_REVIEW"
    assert list_attempts(tenant, doubtful["id"])[0]["state"] == "UNKNOWN"
    assert assert_ok(tenant.client.get(f"/v1/queues/{queue['id']}"))["unfinished_tasks"] == "1"
    assert_invariants()


def test_a_reviewed_retry_through_the_sdk_runs_again_with_a_larger_token(tenant, connect, orbit_server):
    """Live server, SDK client: RETRY of a NEEDS_REVIEW keyed task wakes the
    waiting worker, which gets it with a token above the unknown attempt's;
    the event log read through the SDK shows the whole story in order."""
    queue = make_queue(tenant.client, "review", rate_per_second=1000)
    doubtful = submit(tenant, queue["id"], "t-review", concurrency_key="object/review")
    worker = connect(tenant, [queue["id"]], "w-review", capacity=1)
    first = worker.expect_assignment()
    worker.start(first)
    assert worker.result(first, outcome="UNKNOWN", error={"code": "timeout"})["task_state"] == "NEEDS_REVIEW"
    assert worker.next_assignment(timeout=0.5) is None
    with Client(orbit_server.url, tenant.token) as client:
        decided = client.resolve_task(doubtful["id"], "review-retry", "RETRY", "ledger shows no write")
        assert decided.task.state == "WAITING" and decided.deduplicated is False
        again = worker.expect_assignment(timeout=3)
        assert again["task"]["id"] == doubtful["id"]
        assert int(again["concurrency_token"]) > int(first["concurrency_token"])
        worker.finish(again)
        wait_until(lambda: task_state(doubtful["id"]) == TaskState.SUCCEEDED, timeout=5)
        page = client.list_events()
    story = [(e.type, e.data.get("state")) for e in page.items if e.subject_id == doubtful["id"]]
    assert story == [
        ("task.state_changed", "WAITING"),
        ("task.state_changed", "LEASED"),
        ("task.state_changed", "RUNNING"),
        ("task.state_changed", "NEEDS_REVIEW"),
        ("task.state_changed", "WAITING"),
        ("task.resolve", None),
        ("task.state_changed", "LEASED"),
        ("task.state_changed", "RUNNING"),
        ("task.state_changed", "SUCCEEDED"),
    ]
    assert [e.cursor for e in page.items] == sorted(e.cursor for e in page.items)
    assert assert_ok(tenant.client.get(f"/v1/queues/{queue['id']}"))["unfinished_tasks"] == "0"
    assert_invariants()


def test_unstarted_cancel_releases_the_key(tenant, connect):
    queue = make_queue(tenant.client, "cancel", rate_per_second=1000)
    cancelled = submit(tenant, queue["id"], "t-cancel", concurrency_key="object/cancel")
    after = submit(tenant, queue["id"], "t-after", concurrency_key="object/cancel")
    worker = connect(tenant, [queue["id"]], "w-cancel", capacity=2)
    frame = worker.expect_assignment()
    assert frame["task"]["id"] == cancelled["id"]
    # when the leased, unstarted task is cancelled
    response = post_json(tenant.client, f"/v1/tasks/{cancelled['id']}:cancel", {"reason": "obsolete"}, key="c-1")
    assert assert_ok(response)["task"]["state"] == "CANCELLED"
    # then the key is released in the same transaction
    assert_released(key_row(tenant.namespace_id, "object/cancel"), frame, sibling_id=after["id"])
    assert attempt_row(frame["attempt_id"]).state == AttemptState.CANCELLED
    # and the cancelled attempt can no longer start, while the next task of the key leases
    refused = worker.request("task.start", attempt_id=frame["attempt_id"], epoch=frame["epoch"])
    assert refused["type"] == "error" and refused["code"] == "TASK_CANCELLED", refused
    nxt = worker.expect_assignment(timeout=3)
    assert nxt["task"]["id"] == after["id"]
    assert int(nxt["concurrency_token"]) >= int(frame["concurrency_token"]) + 2
    worker.finish(nxt)
    assert_invariants()


def renew_keeps_the_token_and_extends_the_permit(tenant: Any, connect: Any) -> None:
    """Run by test_leases_backoffs_and_deadlines_waited_out_side_by_side."""
    queue = make_queue(tenant.client, "renew", rate_per_second=1000)
    task = submit(tenant, queue["id"], "t-renew", concurrency_key="object/renew", lease_seconds=5)
    waiting = submit(tenant, queue["id"], "t-waiting", concurrency_key="object/renew")
    worker = connect(tenant, [queue["id"]], "w-renew", capacity=2)
    frame = worker.expect_assignment()
    assert frame["task"]["id"] == task["id"]
    started = worker.start(frame)
    version = key_row(tenant.namespace_id, "object/renew").version
    expires = parse_time(started["lease_expires_at"])
    # when the worker renews past the original lease several times
    for _ in range(3):
        time.sleep(2)
        renewed = worker.request("task.renew", attempt_id=frame["attempt_id"], epoch=frame["epoch"])
        assert renewed["type"] == "task.renew.ok", renewed
        assert parse_time(renewed["lease_expires_at"]) > expires
        expires = parse_time(renewed["lease_expires_at"])
    # then, well past the first lease, the same attempt and token still hold the key
    row = key_row(tenant.namespace_id, "object/renew")
    assert row.holder_attempt_id == frame["attempt_id"] and row.version == version
    assert attempt_row(frame["attempt_id"]).concurrency_token == int(frame["concurrency_token"])
    assert attempt_row(frame["attempt_id"]).state == AttemptState.RUNNING
    assert task_state(waiting["id"]) == TaskState.WAITING
    assert worker.next_assignment(timeout=0.3) is None
    worker.result(frame)
    worker.finish(worker.expect_assignment())
    assert_invariants()


def test_reconnect_and_resume_keep_the_attempt_and_token(tenant, connect):
    queue = make_queue(tenant.client, "resume", rate_per_second=1000)
    task = submit(tenant, queue["id"], "t-resume", concurrency_key="object/resume")
    first = connect(tenant, [queue["id"]], "w-resume", capacity=1)
    frame = first.expect_assignment()
    first.start(frame)
    row_before = key_row(tenant.namespace_id, "object/resume")
    # when the process loses its connection and reconnects under the same worker_id
    first.drop()
    again = connect(tenant, [queue["id"]], "w-resume", capacity=1)
    # then hello.held lists the same attempt, epoch and token, still RUNNING
    [held] = again.welcome["held"]
    assert held["attempt_id"] == frame["attempt_id"] and held["epoch"] == frame["epoch"]
    assert held["concurrency_token"] == frame["concurrency_token"]
    assert held["task"]["concurrency_key"] == "object/resume" and held["state"] == "RUNNING"
    # and task.resume confirms the same assignment
    resumed = again.request("task.resume", attempt_id=frame["attempt_id"], epoch=frame["epoch"])
    assert resumed["type"] == "task.resume.ok", resumed
    assert resumed["assignment"]["attempt_id"] == frame["attempt_id"]
    assert resumed["assignment"]["epoch"] == frame["epoch"]
    assert resumed["assignment"]["concurrency_token"] == frame["concurrency_token"]
    # and the key row never moved
    row = key_row(tenant.namespace_id, "object/resume")
    assert (row.holder_attempt_id, row.version) == (row_before.holder_attempt_id, row_before.version)
    assert row.holder_attempt_id == frame["attempt_id"]
    assert again.result(frame)["task_state"] == "SUCCEEDED"
    assert get_task(tenant, task["id"])["state"] == "SUCCEEDED"
    assert [a["concurrency_token"] for a in list_attempts(tenant, task["id"])] == [frame["concurrency_token"]]
    assert key_row(tenant.namespace_id, "object/resume").version == row_before.version + 1
    assert_invariants()


def test_replayed_result_does_not_release_the_next_holders_permit(tenant, connect):
    queue = make_queue(tenant.client, "dup", rate_per_second=1000)
    first_task = submit(tenant, queue["id"], "t-1", concurrency_key="object/dup")
    second_task = submit(tenant, queue["id"], "t-2", concurrency_key="object/dup")
    worker = connect(tenant, [queue["id"]], "w-dup", capacity=1)
    first = worker.expect_assignment()
    assert first["task"]["id"] == first_task["id"]
    worker.start(first)
    assert worker.result(first, output={"n": 1})["duplicate"] is False
    # given the key has passed to the next task
    second = worker.expect_assignment()
    assert second["task"]["id"] == second_task["id"]
    worker.start(second)
    before = key_row(tenant.namespace_id, "object/dup")
    assert before.holder_attempt_id == second["attempt_id"]
    # when the first holder's result is replayed (a lost ack, a reconnect)
    for _ in range(2):
        replay = worker.result(first, output={"n": 1})
        assert replay["duplicate"] is True and replay["task_state"] == "SUCCEEDED"
    # then the next holder's permit is untouched: same holder, same version
    after = key_row(tenant.namespace_id, "object/dup")
    assert (after.holder_attempt_id, after.holder_task_id, after.version) == (
        second["attempt_id"],
        second_task["id"],
        before.version,
    )
    assert attempt_row(second["attempt_id"]).state == AttemptState.RUNNING
    assert_invariants()
    worker.result(second)
    assert key_row(tenant.namespace_id, "object/dup").version == before.version + 1
    # and a replay of the second result does not advance it again
    assert worker.result(second)["duplicate"] is True
    assert key_row(tenant.namespace_id, "object/dup").version == before.version + 1
    assert_invariants()


def pause_and_disconnect_do_not_release_until_the_lease_expires(tenant: Any, connect: Any) -> None:
    """Run by test_leases_backoffs_and_deadlines_waited_out_side_by_side."""
    # given a running keyed attempt on one queue and a task of the same key on another
    paused_queue, other_queue = (
        make_queue(tenant.client, "pause-1", rate_per_second=1000),
        make_queue(tenant.client, "pause-2", rate_per_second=1000),
    )
    held_task = submit(tenant, paused_queue["id"], "t-held", concurrency_key="object/pause", lease_seconds=5)
    holder = connect(tenant, [paused_queue["id"]], "w-holder", capacity=1)
    frame = holder.expect_assignment()
    holder.start(frame)
    waiting = submit(tenant, other_queue["id"], "t-waiting", concurrency_key="object/pause")
    other = connect(tenant, [other_queue["id"]], "w-other", capacity=1)
    held_row = key_row(tenant.namespace_id, "object/pause")
    # when the holder's queue is paused
    body = configure_body("1", paused=True, max_concurrency=8, rate_per_second=1000, max_unfinished_tasks=1000)
    assert assert_ok(configure(tenant.client, paused_queue["id"], body, key="pause"))["queue"]["paused"] is True
    assert other.next_assignment(timeout=0.8) is None
    # and then the holder disconnects without a result
    holder.drop()
    expires = attempt_row(frame["attempt_id"]).lease_expires_at
    # then the key stays held by that attempt until its lease runs out
    while timezone.now() < expires - timedelta(milliseconds=400):
        row = key_row(tenant.namespace_id, "object/pause")
        assert (row.holder_attempt_id, row.version) == (held_row.holder_attempt_id, held_row.version)
        assert other.next_assignment(timeout=0.2) is None
    # and after expiry the attempt is recovered (unknown effect) and the key moves on
    nxt = other.expect_assignment(timeout=5)
    assert nxt["task"]["id"] == waiting["id"]
    assert int(nxt["concurrency_token"]) >= int(frame["concurrency_token"]) + 2
    assert attempt_row(nxt["attempt_id"]).leased_at >= expires
    assert attempt_row(frame["attempt_id"]).state == AttemptState.UNKNOWN
    assert task_state(held_task["id"]) == TaskState.NEEDS_REVIEW
    other.start(nxt)
    # and the old holder's late result, sent after reconnecting, is kept as
    # evidence without touching the new holder's permit
    before = key_row(tenant.namespace_id, "object/pause")
    assert before.holder_attempt_id == nxt["attempt_id"]
    back = connect(tenant, [paused_queue["id"]], "w-holder", capacity=1)
    assert back.welcome["held"] == []
    late = back.result(frame)
    assert late["late"] is True and late["task_state"] == "NEEDS_REVIEW"
    after = key_row(tenant.namespace_id, "object/pause")
    assert (after.holder_attempt_id, after.version) == (before.holder_attempt_id, before.version)
    assert attempt_row(frame["attempt_id"]).late_outcome["outcome"] == "SUCCEEDED"
    assert task_state(held_task["id"]) == TaskState.NEEDS_REVIEW
    other.result(nxt)
    assert_invariants()


def test_release_and_unstarted_expiry_release_the_key(tenant, connect):
    queue = make_queue(tenant.client, "handback", rate_per_second=1000)
    task = submit(tenant, queue["id"], "t-handback", concurrency_key="object/handback")
    worker = connect(tenant, [queue["id"]], "w-handback", capacity=1)
    tokens = []
    # when the worker hands the unstarted attempt back
    frame = worker.expect_assignment()
    tokens.append(int(frame["concurrency_token"]))
    reply = worker.request("task.release", attempt_id=frame["attempt_id"], epoch=frame["epoch"], reason="busy")
    assert reply["type"] == "task.release.ok" and reply["task_state"] == "WAITING", reply
    # then the key is released in the same transaction and the task leases again, with a larger token
    # (the worker's slot is free again, so its dispatcher may have leased the task anew already)
    row = key_row(tenant.namespace_id, "object/handback")
    released = (row.holder_attempt_id, row.version) == ("", tokens[-1] + 1)
    assert released or (row.holder_attempt_id != frame["attempt_id"] and row.version == tokens[-1] + 2), row
    frame = worker.expect_assignment()
    assert frame["task"]["id"] == task["id"]
    assert released or row.holder_attempt_id == frame["attempt_id"]
    tokens.append(int(frame["concurrency_token"]))
    # when that lease runs out before Start
    Attempt.objects.filter(id=frame["attempt_id"]).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    # then the sweep expires it (no attempt consumed), releasing the key for the next lease
    wait_until(lambda: attempt_row(frame["attempt_id"]).state == AttemptState.EXPIRED, timeout=5)
    frame = worker.expect_assignment(timeout=5)
    tokens.append(int(frame["concurrency_token"]))
    worker.finish(frame)
    assert tokens[1] == tokens[0] + 2 and tokens[2] == tokens[1] + 2
    assert [a["state"] for a in list_attempts(tenant, task["id"])] == ["RELEASED", "EXPIRED", "SUCCEEDED"]
    assert get_task(tenant, task["id"])["attempts"] == 1
    assert key_row(tenant.namespace_id, "object/handback").version == tokens[2] + 1
    assert_invariants()


def token_space_is_never_wrapped(tenant: Any, connect: Any) -> None:
    """Run by test_leases_backoffs_and_deadlines_waited_out_side_by_side."""
    # given a key whose row version is three short of the uint64 maximum
    queue = make_queue(tenant.client, "overflow", rate_per_second=1000)
    ConcurrencyKey.objects.create(
        namespace_id=tenant.namespace_id, key="object/spent", version=UINT64_MAX - 2, updated_at=timezone.now()
    )
    last = submit(tenant, queue["id"], "t-last", concurrency_key="object/spent")
    worker = connect(tenant, [queue["id"]], "w-overflow", capacity=2)
    # when one more task of it leases
    frame = worker.expect_assignment()
    assert frame["task"]["id"] == last["id"]
    # then it gets the next token, 2^64 − 2, as an exact decimal string
    assert frame["concurrency_token"] == str(UINT64_MAX - 1) == "18446744073709551614"
    worker.finish(frame)
    assert list_attempts(tenant, last["id"])[0]["concurrency_token"] == "18446744073709551614"
    # and its release takes the version to 2^64 − 1
    row = key_row(tenant.namespace_id, "object/spent")
    assert row.version == UINT64_MAX and row.holder_attempt_id == ""
    # when more tasks of the spent key wait ahead of other work
    stuck = [submit(tenant, queue["id"], f"t-stuck-{i}", concurrency_key="object/spent")["id"] for i in range(20)]
    flowing = {
        submit(tenant, queue["id"], "t-fresh", concurrency_key="object/fresh")["id"],
        submit(tenant, queue["id"], "t-plain")["id"],
    }
    # then the other key and the unkeyed task keep flowing
    frames = [worker.expect_assignment(timeout=3), worker.expect_assignment(timeout=3)]
    got = {f["task"]["id"] for f in frames}
    assert got == flowing
    for f in frames:
        worker.finish(f)
    # and the spent key's tasks are refused: still WAITING, never leased, no wrap
    assert worker.next_assignment(timeout=1.5) is None
    assert set(Task.objects.filter(id__in=stuck).values_list("state", flat=True)) == {TaskState.WAITING}
    assert not Attempt.objects.filter(task_id__in=stuck).exists()
    row = key_row(tenant.namespace_id, "object/spent")
    assert row.version == UINT64_MAX and row.holder_attempt_id == ""
    assert all(get_task(tenant, task_id)["state"] == "WAITING" for task_id in stuck[:3])
    assert_invariants()


def waiting_behind_a_busy_key_keeps_counting_toward_the_deadline(tenant: Any, connect: Any) -> None:
    """Run by test_leases_backoffs_and_deadlines_waited_out_side_by_side."""
    # given a key held by a running attempt
    queue = make_queue(tenant.client, "deadline", rate_per_second=1000)
    holder_task = submit(tenant, queue["id"], "t-holder", concurrency_key="object/deadline")
    worker = connect(tenant, [queue["id"]], "w-deadline", capacity=2)
    frame = worker.expect_assignment()
    assert frame["task"]["id"] == holder_task["id"]
    worker.start(frame)
    # when a task of the busy key is submitted with a short total deadline
    late = submit(tenant, queue["id"], "t-late", concurrency_key="object/deadline", timeout_seconds=2)
    # then it is accepted and waits, consuming no attempt but counting in the backlog
    assert late["state"] == "WAITING" and late["attempts"] == 0
    assert assert_ok(tenant.client.get(f"/v1/queues/{queue['id']}"))["unfinished_tasks"] == "2"
    assert worker.next_assignment(timeout=1) is None
    # and its deadline still runs out while the key stays busy
    wait_until(lambda: task_state(late["id"]) == TaskState.FAILED, timeout=5)
    failed = get_task(tenant, late["id"])
    assert failed["last_error"]["code"] == "DEADLINE_EXCEEDED" and failed["attempts"] == 0
    assert list_attempts(tenant, late["id"]) == []
    assert key_row(tenant.namespace_id, "object/deadline").holder_attempt_id == frame["attempt_id"]
    worker.result(frame)
    assert_invariants()


def test_the_same_key_in_another_namespace_is_another_resource(tenant, connect):
    from tests.conftest import Tenant, api_client
    from tests.support.factories import NamespaceFactory, make_credential

    namespace = NamespaceFactory()
    issued = make_credential(namespace)
    neighbour = Tenant(namespace=namespace, token=issued.token, client=api_client(issued.token))
    # given one task of the same key in each of two namespaces
    mine, theirs = (
        make_queue(tenant.client, "ns-a", rate_per_second=1000),
        make_queue(neighbour.client, "ns-b", rate_per_second=1000),
    )
    submit(tenant, mine["id"], "t-mine", concurrency_key="object/shared-name")
    submit(neighbour, theirs["id"], "t-theirs", concurrency_key="object/shared-name")
    # when each namespace's worker leases and starts its task
    frames = []
    for owner, queue, worker_id in [(tenant, mine, "w-ns-a"), (neighbour, theirs, "w-ns-b")]:
        worker = connect(owner, [queue["id"]], worker_id, capacity=1)
        frames.append((worker, worker.expect_assignment()))
        worker.start(frames[-1][1])
    # then both hold a permit at once, each from its own row and token sequence
    for owner, (_, frame) in zip([tenant, neighbour], frames, strict=True):
        row = key_row(owner.namespace_id, "object/shared-name")
        assert row.holder_attempt_id == frame["attempt_id"] and frame["concurrency_token"] == "1"
    assert_invariants()
    for worker, frame in frames:
        worker.result(frame)
    assert_invariants()


def test_pipelined_duplicate_results_release_the_key_once(tenant, connect):
    queue = make_queue(tenant.client, "pipelined", rate_per_second=1000)
    submit(tenant, queue["id"], "t-1", concurrency_key="object/pipelined")
    worker = connect(tenant, [queue["id"]], "w-pipelined", capacity=1)
    frame = worker.expect_assignment()
    worker.start(frame)
    version = key_row(tenant.namespace_id, "object/pipelined").version
    # when the same result is sent five times without waiting for replies
    ids = [
        worker.send("task.result", attempt_id=frame["attempt_id"], epoch=frame["epoch"], outcome="SUCCEEDED")
        for _ in range(5)
    ]
    replies = {}
    while len(replies) < len(ids):
        reply = json.loads(worker.ws.recv(timeout=10))
        if reply.get("reply_to") in ids:
            replies[reply["reply_to"]] = reply
    # then exactly one applied it, and the key advanced exactly once
    assert all(r["type"] == "task.result.ok" and r["task_state"] == "SUCCEEDED" for r in replies.values()), replies
    assert sorted(r["duplicate"] for r in replies.values()) == [False, True, True, True, True]
    row = key_row(tenant.namespace_id, "object/pipelined")
    assert row.version == version + 1 and row.holder_attempt_id == ""
    assert_invariants()


def test_leases_backoffs_and_deadlines_waited_out_side_by_side(connect):
    """Six independent scenarios, each of which mostly waits: for a lease to run out
    (renewing past it, or held past a pause and a disconnect), a retry backoff, a
    task's total deadline, or windows in which nothing may be assigned. Each has its
    own application (API client, queues, keys) and worker ids; run side by side, the test waits
    about the longest of them, not their sum, and every scenario makes every check it
    makes alone. None of them loads the machine: the two lease scenarios start first,
    the others a few hundred milliseconds apart so that their setups do not all land
    in the same instant."""

    def scenario(run: Any) -> Any:
        # an application of its own, as each had as a test of its own: the scenarios reuse
        # idempotency keys ("t-waiting"), and its client is not shared across threads
        own = new_tenant()
        return lambda: run(own, connect)

    scenarios = {
        "renew-past-the-lease": scenario(renew_keeps_the_token_and_extends_the_permit),
        "pause-and-disconnect": scenario(pause_and_disconnect_do_not_release_until_the_lease_expires),
        "retry-backoff": scenario(safe_retry_releases_the_key_during_backoff),
        "deadline-behind-a-busy-key": scenario(waiting_behind_a_busy_key_keeps_counting_toward_the_deadline),
        "successive-tokens": scenario(successive_attempts_of_a_key_get_increasing_tokens),
    }
    after = {"retry-backoff": 0.3, "deadline-behind-a-busy-key": 0.6, "successive-tokens": 0.9}
    if connection.vendor == "mysql":  # the uint64 range needs MySQL (what mysql_only skipped it for)
        scenarios["token-space"] = scenario(token_space_is_never_wrapped)
        after["token-space"] = 1.2
    concurrently(scenarios, after=after)
    # and, with every scenario done, the keys' and counters' invariants hold
    assert_invariants()
