"""Keys match byte-for-byte on MySQL: no case folding, no normalization, no padding."""

from __future__ import annotations

import pytest

from tasks.models import Attempt, AttemptState, ConcurrencyKey, Task, TaskState
from tests.conftest import post_json
from tests.support.api import assert_invalid, assert_ok, make_queue
from tests.support.keys import key_row, submit, task_body
from tests.support.tasks import assert_invariants, wait_until

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db(transaction=True)]

# Each pair is two different keys to the database (the seed's examples, plus a
# zero-width space, which is a format character and not whitespace).
PAIRS = [("object/A", "object/a"), ("\u00e9", "e\u0301"), ("k", "k\u200b")]


def test_trailing_space_twin_cannot_be_submitted(tenant):
    queue = make_queue(tenant.client, "pad", rate_per_second=1000)
    response = post_json(tenant.client, "/v1/tasks", task_body(queue["id"], concurrency_key="k "), key="pad")
    assert_invalid(response, "concurrency_key")


def test_zero_width_space_key_is_accepted_as_its_own_key(tenant):
    queue = make_queue(tenant.client, "zw", rate_per_second=1000)
    task = submit(tenant, queue["id"], "zw", concurrency_key="k\u200b")
    assert task["concurrency_key"] == "k\u200b"
    found = assert_ok(tenant.client.get("/v1/tasks", {"concurrency_key": "k"}))["items"]
    assert found == []


def test_pairs_hold_distinct_permits_while_identical_keys_exclude(tenant, connect):
    # given, across two queues, a task for each key of every pair, plus a twin
    # with the identical key of each
    first, second = (
        make_queue(tenant.client, "bytes-1", rate_per_second=1000),
        make_queue(tenant.client, "bytes-2", rate_per_second=1000),
    )
    tasks: dict[str, list[str]] = {}
    for index, pair in enumerate(PAIRS):
        for side, key in enumerate(pair):
            for twin in range(2):
                queue = (first, second)[(side + twin) % 2]
                task = submit(tenant, queue["id"], f"t-{index}-{side}-{twin}", concurrency_key=key)
                assert task["concurrency_key"] == key
                tasks.setdefault(key, []).append(task["id"])
    keys = [key for pair in PAIRS for key in pair]
    # when one worker with room for all of them leases and starts what it gets
    worker = connect(tenant, [first["id"], second["id"]], "w-bytes", capacity=len(tasks) * 2)
    frames = [worker.expect_assignment() for _ in keys]
    for frame in frames:
        worker.start(frame)
    assert worker.next_assignment(timeout=1.5) is None
    # then every distinct key got exactly one task, all RUNNING at once
    leased = {frame["task"]["concurrency_key"]: frame for frame in frames}
    assert sorted(leased) == sorted(keys)
    for key in keys:
        running, waiting = Task.objects.filter(id__in=tasks[key]).order_by("state").values_list("state", flat=True)
        assert (running, waiting) == (TaskState.RUNNING, TaskState.WAITING), key
    # and each key of a pair is its own row, held by its own running attempt
    assert ConcurrencyKey.objects.filter(namespace_id=tenant.namespace_id).count() == len(keys)
    for key in keys:
        row = key_row(tenant.namespace_id, key)
        assert row is not None and row.key == key
        assert row.holder_attempt_id == leased[key]["attempt_id"]
        assert Attempt.objects.get(id=row.holder_attempt_id).state == AttemptState.RUNNING
        assert leased[key]["concurrency_token"] == str(row.version) == "1"
    assert_invariants()

    # when the holders finish, the twins run, one per key again
    for frame in frames:
        worker.result(frame)
    twins = [worker.expect_assignment() for _ in keys]
    assert sorted(frame["task"]["concurrency_key"] for frame in twins) == sorted(keys)
    for frame in twins:
        assert frame["concurrency_token"] == "3"  # 1 leased, 2 released, 3 leased: its own sequence
        worker.finish(frame)
    wait_until(lambda: Task.objects.filter(state=TaskState.SUCCEEDED).count() == len(keys) * 2, timeout=5)
    assert_invariants()


def test_filters_separate_the_pairs(tenant):
    queue = make_queue(tenant.client, "filter", rate_per_second=1000)
    ids = {
        key: submit(tenant, queue["id"], f"f-{i}", concurrency_key=key)["id"] for i, key in enumerate(sum(PAIRS, ()))
    }
    for key, task_id in ids.items():
        found = assert_ok(tenant.client.get("/v1/tasks", {"concurrency_key": key}))["items"]
        assert [item["id"] for item in found] == [task_id], key


def test_longest_multibyte_keys_lease_with_their_own_rows(tenant, connect):
    # given keys of 191 four-byte and three-byte characters (764 and 573 UTF-8 bytes)
    queue = make_queue(tenant.client, "long", rate_per_second=1000)
    keys = ["\U0001f600" * 191, "键" * 191, "\U0001f600" * 190 + "键"]
    ids = {submit(tenant, queue["id"], f"long-{i}", concurrency_key=key)["id"]: key for i, key in enumerate(keys)}
    # when a worker leases them
    worker = connect(tenant, [queue["id"]], "w-long", capacity=3)
    frames = [worker.expect_assignment() for _ in keys]
    # then each is delivered exactly and holds its own key row
    for frame in frames:
        key = ids[frame["task"]["id"]]
        assert frame["task"]["concurrency_key"] == key and frame["concurrency_token"] == "1"
        row = key_row(tenant.namespace_id, key)
        assert row.key == key and len(row.key.encode("utf-8")) in (764, 573, 763)
        assert row.holder_attempt_id == frame["attempt_id"]
        worker.finish(frame)
    assert_invariants()
