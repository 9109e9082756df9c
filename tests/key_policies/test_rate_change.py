"""A key policy's rate changed while the key has started under it (SPEC §12,
Rate: "with T = per_seconds / starts, a Start of a keyed task is approved only
if it keeps, for every interval of length t, the key's approved Starts ≤
burst + t / T"; `:configure` replaces capacity and rate). A raised rate holds
the key to the new rate from the change, not to the arrival time the old one
left: a key that started once under 1 Start an hour, then configured to 100
a second, stayed KEY_RATE_LIMITED for the rest of the old hour."""

from __future__ import annotations

import time

import pytest
from django.utils import timezone

from tasks.actions import rounds
from tasks.models import ConcurrencyKey
from tests.support.api import assert_ok, make_queue, parse_time
from tests.support.key_policies import configure, create_ok
from tests.support.tasks import assert_invariants, report, start, submit_ok, worker_for

pytestmark = pytest.mark.django_db(transaction=True)

SLOW = {"starts": 1, "per_seconds": 3600, "burst": 1}
FAST = {"starts": 100, "per_seconds": 1, "burst": 1}


def test_raising_a_keys_rate_holds_the_key_to_the_new_rate_not_the_old_one(tenant):
    # given a key limited to one Start an hour, which has just started once
    policy = create_ok(tenant.client, match={"key": "ledger"}, capacity=5, rate=SLOW)
    queue = make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)
    for n in range(2):
        submit_ok(tenant.client, queue["id"], f"t-{n}", concurrency_key="ledger")
    worker = worker_for(tenant, queue["id"])
    (first,) = rounds.lease_tasks(worker=worker, limit=16)
    lease = {"worker": worker, **first}
    start(lease)
    report(lease, "SUCCEEDED")
    assert rounds.lease_tasks(worker=worker, limit=16) == []  # the hour's one Start is spent
    # when the rate is raised to 100 Starts a second
    assert_ok(configure(tenant.client, policy["id"], capacity=5, rate=FAST))
    # then the key is held to 100 a second from the change: its next_start_at is no more
    # than one new interval (10 ms) away, not the old rate's hour
    key = assert_ok(tenant.client.get("/v1/concurrency-keys/ledger"))
    assert (parse_time(key["next_start_at"]) - timezone.now()).total_seconds() < 1, key
    row = ConcurrencyKey.objects.get(namespace_id=tenant.namespace_id, key="ledger")
    assert row.rate_tat is not None and (row.rate_tat - timezone.now()).total_seconds() < 1, row.rate_tat
    # and the waiting task is leased and started under the new rate
    leased = []
    for _ in range(20):
        leased = rounds.lease_tasks(worker=worker, limit=16)
        if leased:
            break
        time.sleep(0.05)
    assert len(leased) == 1, "the key stayed limited by the rate it no longer has"
    second = {"worker": worker, **leased[0]}
    start(second)
    report(second, "SUCCEEDED")
    assert_invariants()
