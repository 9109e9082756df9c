"""GET /v1/concurrency-keys(/{key}) under key policies (SPEC §12): capacity as resolved now,
holders by slot with their tokens, the policy that applies, and the rate state; a key of
capacity 1 answers `holder` exactly as before, beside `holders`."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import quote

import pytest
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from orbit.timefmt import format_time
from tasks.models import Attempt, ConcurrencyKey
from tests.support.api import assert_ok, make_queue
from tests.support.key_rows import make_policy
from tests.support.tasks import lease_one, submit_ok

pytestmark = pytest.mark.django_db


def when(text: str):
    value = parse_datetime(text)
    assert value is not None, text
    return value


def key_url(key: str) -> str:
    return "/v1/concurrency-keys/" + quote(key, safe="")


def hold(tenant, queue_id: str, key: str, count: int) -> list[dict]:
    """`count` leases of the key's tasks, one a round (one waiting task of a key and queue is next)."""
    for n in range(count + 1):
        submit_ok(tenant.client, queue_id, f"{key}-{n}", concurrency_key=key)
    return [lease_one(tenant, queue_id, worker_id=f"w-{n}") for n in range(count)]


def test_a_key_of_capacity_3_shows_its_three_holders_by_slot(tenant):
    policy = make_policy(tenant.namespace, prefix="printer/", capacity=3)
    queue = make_queue(tenant.client, max_concurrency=10)
    leases = hold(tenant, queue["id"], "printer/1", 3)

    data = assert_ok(tenant.client.get(key_url("printer/1")))
    row = ConcurrencyKey.objects.get(namespace_id=tenant.namespace_id, key="printer/1")
    assert data["capacity"] == 3 and data["policy_id"] == policy.id
    assert "holder" not in data  # capacity above 1: no one holder
    assert [holder["slot"] for holder in data["holders"]] == [0, 1, 2]
    by_attempt = {holder["attempt_id"]: holder for holder in data["holders"]}
    assert set(by_attempt) == {lease["attempt_id"] for lease in leases}
    for lease in leases:
        holder = by_attempt[lease["attempt_id"]]
        attempt = Attempt.objects.get(id=lease["attempt_id"])
        assert holder["token"] == lease["concurrency_token"] == str(attempt.concurrency_token)
        assert holder["slot"] == attempt.concurrency_slot == lease["concurrency_slot"]
        assert holder["task_id"] == lease["task"]["id"] and holder["worker_id"] == lease["worker"].worker_id
        assert holder["since"] == format_time(attempt.leased_at)
    assert len({holder["token"] for holder in data["holders"]}) == 3
    assert data["highest_token"] == str(row.version) == str(max(int(lease["concurrency_token"]) for lease in leases))
    assert data["waiting_tasks"] == 1
    assert "rate" not in data and "next_start_at" not in data and "reserved_starts" not in data
    # the list shows the same key the same way
    (listed,) = assert_ok(tenant.client.get("/v1/concurrency-keys", {"prefix": "printer/"}))["items"]
    assert listed == data


def test_a_key_of_capacity_1_keeps_its_holder_and_shows_it_as_slot_0(tenant):
    queue = make_queue(tenant.client)
    (lease,) = hold(tenant, queue["id"], "mutex", 1)
    data = assert_ok(tenant.client.get(key_url("mutex")))
    assert data["capacity"] == 1 and "policy_id" not in data
    assert data["holder"] == {
        "attempt_id": lease["attempt_id"],
        "task_id": lease["task"]["id"],
        "worker_id": "w-0",
        "token": lease["concurrency_token"],
        "since": data["holder"]["since"],
    }
    assert data["holders"] == [{"slot": 0, **data["holder"]}]
    assert "concurrency_slot" not in lease  # the seed's assignment, exactly
    assert Attempt.objects.get(id=lease["attempt_id"]).concurrency_slot is None


def test_a_lowered_capacity_keeps_its_holders_beyond_it(tenant):
    policy = make_policy(tenant.namespace, key="k", capacity=3)
    queue = make_queue(tenant.client, max_concurrency=10)
    hold(tenant, queue["id"], "k", 3)
    type(policy).objects.filter(id=policy.id).update(capacity=1)
    make_policy(tenant.namespace, key="other", capacity=1)  # moves the generation: the change is read
    data = assert_ok(tenant.client.get(key_url("k")))
    assert data["capacity"] == 1 and len(data["holders"]) == 3
    assert data["holder"]["attempt_id"] == data["holders"][0]["attempt_id"]  # slot 0's


def test_a_rated_key_shows_its_rate_reserved_starts_and_next_start(tenant):
    make_policy(tenant.namespace, key="api/x", capacity=2, rate=(1, 60, 1))
    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "a", concurrency_key="api/x")
    before = assert_ok(tenant.client.get(key_url("api/x")))
    assert before["rate"] == {"starts": 1, "per_seconds": 60, "burst": 1}
    assert before["reserved_starts"] == 0 and before["holders"] == [] and before["highest_token"] == "0"
    assert when(before["next_start_at"]) <= timezone.now()

    now = timezone.now()
    ConcurrencyKey.objects.create(
        namespace_id=tenant.namespace_id,
        key="api/x",
        version=4,
        rate_tat=now + timedelta(seconds=30),
        rate_reserved=1,
        updated_at=now,
    )
    data = assert_ok(tenant.client.get(key_url("api/x")))
    assert data["reserved_starts"] == 1 and data["capacity"] == 2
    # the next lease waits for the tat plus one interval for the reserved Start: now + 90 s
    expected = now + timedelta(seconds=90)
    assert abs(when(data["next_start_at"]) - expected) < timedelta(milliseconds=2)


def test_a_prefix_policy_gives_each_matching_key_its_own_capacity_and_an_exact_one_wins(tenant):
    prefix = make_policy(tenant.namespace, prefix="customer/", capacity=5)
    exact = make_policy(tenant.namespace, key="customer/vip", capacity=50)
    queue = make_queue(tenant.client, max_concurrency=10)
    for key in ("customer/1", "customer/2", "customer/vip", "customer", "Customer/1"):
        submit_ok(tenant.client, queue["id"], key, concurrency_key=key)
    items = assert_ok(tenant.client.get("/v1/concurrency-keys"))["items"]
    assert items == []  # no lease made a row yet: the list shows rows
    rules = {key: assert_ok(tenant.client.get(key_url(key))) for key in ("customer/1", "customer/2", "customer/vip")}
    assert [rules[key]["capacity"] for key in ("customer/1", "customer/2", "customer/vip")] == [5, 5, 50]
    assert rules["customer/1"]["policy_id"] == rules["customer/2"]["policy_id"] == prefix.id
    assert rules["customer/vip"]["policy_id"] == exact.id
    for key in ("customer", "Customer/1"):  # byte for byte: neither matches the prefix
        data = assert_ok(tenant.client.get(key_url(key)))
        assert data["capacity"] == 1 and "policy_id" not in data
