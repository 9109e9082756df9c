"""GET /v1/tasks/{id}/blockers for keys with policies (SPEC §12): KEY_HELD stays for capacity 1,
KEY_AT_CAPACITY (capacity, holders) for N > 1 once N hold, KEY_RATE_LIMITED (next_start_at)
while the key's start rate has no room; each agrees with what the next lease does."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from tasks.actions import rounds
from tasks.models import ConcurrencyKey, KeyPolicy
from tests.support.api import assert_ok, make_queue
from tests.support.key_rows import make_policy
from tests.support.tasks import lease_one, submit_ok, worker_for

pytestmark = pytest.mark.django_db


def blockers(tenant, task_id: str) -> list[dict]:
    return assert_ok(tenant.client.get(f"/v1/tasks/{task_id}/blockers"))["items"]


def key_codes(items: list[dict]) -> list[str]:
    return [item["code"] for item in items if item["code"].startswith("KEY_")]


def test_a_key_of_capacity_2_blocks_only_once_two_hold(tenant):
    policy = make_policy(tenant.namespace, key="k", capacity=2)
    queue = make_queue(tenant.client, max_concurrency=10)
    tasks = [submit_ok(tenant.client, queue["id"], f"t{n}", concurrency_key="k") for n in range(3)]
    lease_one(tenant, queue["id"])
    waiting = [task for task in tasks if assert_ok(tenant.client.get(f"/v1/tasks/{task['id']}"))["state"] == "WAITING"]
    ready = [t for t in waiting if not key_codes(blockers(tenant, t["id"]))]
    assert len(ready) == 1  # one permit left: the key's next task is not blocked by it
    lease_one(tenant, queue["id"])
    (last,) = [t for t in tasks if assert_ok(tenant.client.get(f"/v1/tasks/{t['id']}"))["state"] == "WAITING"]
    items = blockers(tenant, last["id"])
    (at_capacity,) = [item for item in items if item["code"].startswith("KEY_")]
    assert at_capacity == {
        "code": "KEY_AT_CAPACITY",
        "message": "attempts hold every permit of the concurrency key's capacity",
        "capacity": 2,
        "holders": 2,
        "policy_id": policy.id,
    }
    # and the lease agrees: nothing more of the key now
    assert rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=5) == []


def test_a_lowered_capacity_blocks_with_the_holders_it_kept(tenant):
    policy = make_policy(tenant.namespace, key="k", capacity=3)
    queue = make_queue(tenant.client, max_concurrency=10)
    tasks = [submit_ok(tenant.client, queue["id"], f"t{n}", concurrency_key="k") for n in range(4)]
    for _ in range(3):
        lease_one(tenant, queue["id"])
    (last,) = [t for t in tasks if assert_ok(tenant.client.get(f"/v1/tasks/{t['id']}"))["state"] == "WAITING"]
    KeyPolicy.objects.filter(id=policy.id).update(capacity=2)
    make_policy(tenant.namespace, key="unrelated")  # moves the generation: every reader sees the change
    (item,) = [item for item in blockers(tenant, last["id"]) if item["code"].startswith("KEY_")]
    assert (item["code"], item["capacity"], item["holders"]) == ("KEY_AT_CAPACITY", 2, 3)
    # down to 1: the seed's KEY_HELD, naming slot 0's holder
    KeyPolicy.objects.filter(id=policy.id).update(capacity=1)
    make_policy(tenant.namespace, key="unrelated-2")
    row = ConcurrencyKey.objects.get(namespace_id=tenant.namespace_id, key="k")
    (item,) = [item for item in blockers(tenant, last["id"]) if item["code"].startswith("KEY_")]
    assert item["code"] == "KEY_HELD" and item["attempt_id"] == row.holder_attempt_id


def test_capacity_1_is_key_held_exactly_as_before(tenant):
    queue = make_queue(tenant.client)
    first = submit_ok(tenant.client, queue["id"], "a", concurrency_key="m")
    second = submit_ok(tenant.client, queue["id"], "b", concurrency_key="m")
    lease = lease_one(tenant, queue["id"], worker_id="w-1")
    assert lease["task"]["id"] == first["id"]
    (item,) = [item for item in blockers(tenant, second["id"]) if item["code"].startswith("KEY_")]
    assert set(item) == {"code", "message", "attempt_id", "task_id", "worker_id", "since"}
    assert item["code"] == "KEY_HELD" and item["attempt_id"] == lease["attempt_id"]


def test_a_rate_limited_key_names_its_next_start(tenant):
    policy = make_policy(tenant.namespace, key="api", capacity=5, rate=(1, 60, 1))
    queue = make_queue(tenant.client, max_concurrency=10)
    task = submit_ok(tenant.client, queue["id"], "a", concurrency_key="api")
    assert key_codes(blockers(tenant, task["id"])) == []  # no Start yet: room now
    now = timezone.now()
    ConcurrencyKey.objects.create(
        namespace_id=tenant.namespace_id, key="api", version=2, rate_tat=now + timedelta(seconds=20), updated_at=now
    )
    (item,) = [item for item in blockers(tenant, task["id"]) if item["code"].startswith("KEY_")]
    assert item["code"] == "KEY_RATE_LIMITED" and item["policy_id"] == policy.id
    assert item["message"] == "the concurrency key's start rate has no room before next_start_at"
    assert abs(parse_datetime(item["next_start_at"]) - (now + timedelta(seconds=20))) < timedelta(milliseconds=2)
    # the lease skips the key, and takes the queue's unkeyed task
    plain = submit_ok(tenant.client, queue["id"], "plain")
    (taken,) = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=5)
    assert taken["task"]["id"] == plain["id"]
    # once the tat has passed there is room again
    ConcurrencyKey.objects.filter(namespace_id=tenant.namespace_id, key="api").update(
        rate_tat=now - timedelta(seconds=1), next_start_at=None
    )
    assert key_codes(blockers(tenant, task["id"])) == []


def test_at_capacity_and_rate_limited_are_both_named(tenant):
    make_policy(tenant.namespace, key="both", capacity=2, rate=(1, 60, 1))
    queue = make_queue(tenant.client)
    task = submit_ok(tenant.client, queue["id"], "a", concurrency_key="both")
    now = timezone.now()
    ConcurrencyKey.objects.create(
        namespace_id=tenant.namespace_id,
        key="both",
        version=9,
        holders=2,
        capacity=2,
        rate_tat=now + timedelta(seconds=60),
        rate_reserved=1,
        updated_at=now,
    )
    assert key_codes(blockers(tenant, task["id"])) == ["KEY_AT_CAPACITY", "KEY_RATE_LIMITED"]
