"""A start rate per key (SPEC §12, GCRA): checked in the Start's own
transaction and at lease time; a limited key never holds back the queue's
other keys or unkeyed work; a refused Start answers RATE_LIMITED with
retry_after_ms."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from orbit.errors import RateLimited
from tasks.actions import rounds
from tasks.key_rules import Rate
from tasks.models import Attempt, KeyPolicy
from tests.support.api import make_queue
from tests.support.gcra import gcra_violations
from tests.support.key_rows import make_policy
from tests.support.tasks import assert_invariants, report, start, submit_ok, worker_for

pytestmark = pytest.mark.django_db


def run_for(worker, seconds: float) -> list[str]:
    """Leases, starts and finishes everything it can for `seconds`, as a busy worker would."""
    ran: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for entry in rounds.lease_tasks(worker=worker, limit=16):
            lease = {"worker": worker, **entry}
            start(lease)
            report(lease, "SUCCEEDED")
            ran.append(entry["task"]["id"])
        time.sleep(0.01)
    return ran


def test_starts_of_a_rated_key_keep_the_gcra_bound(tenant):
    # given 4 Starts a second with a burst of 2 on a key with room for 3 at once, and 30 of its tasks
    rate = Rate(starts=4, per_seconds=1, burst=2)
    make_policy(tenant.namespace, key="paced", capacity=3, rate=(4, 1, 2))
    queue = make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)
    for n in range(30):
        submit_ok(tenant.client, queue["id"], f"t-{n}", concurrency_key="paced")
    # when a worker takes all it may for 2.5 seconds
    ran = run_for(worker_for(tenant, queue["id"]), 2.5)
    # then about burst + 2.5 s × 4 ran, and no window of started_at is over the bound
    started = sorted(a.started_at for a in Attempt.objects.filter(concurrency_key="paced", started_at__isnull=False))
    assert 2 + 8 <= len(ran) <= 2 + 11, len(ran)
    assert gcra_violations(started, rate) == []
    assert_invariants()


def test_gcra_violations_finds_a_window_over_the_bound():
    at = datetime(2026, 1, 1, tzinfo=UTC)
    rate = Rate(starts=1, per_seconds=1, burst=2)
    fine = [at, at, at + timedelta(seconds=1), at + timedelta(seconds=2)]
    assert gcra_violations(fine, rate) == []
    assert gcra_violations([at, at, at + timedelta(milliseconds=500)], rate) != []


def test_a_rate_limited_key_does_not_hold_back_other_keys_or_unkeyed_work(tenant):
    make_policy(tenant.namespace, key="slow", capacity=5, rate=(1, 60, 1))
    queue = make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)
    for n in range(30):
        submit_ok(tenant.client, queue["id"], f"slow-{n}", concurrency_key="slow", priority=9)
    for n in range(10):
        submit_ok(tenant.client, queue["id"], f"other-{n}", concurrency_key=f"other/{n}", priority=5)
    for n in range(10):
        submit_ok(tenant.client, queue["id"], f"plain-{n}", priority=1)
    worker = worker_for(tenant, queue["id"])
    leased = rounds.lease_tasks(worker=worker, limit=16) + rounds.lease_tasks(worker=worker, limit=16)
    keys = [entry["task"].get("concurrency_key", "") for entry in leased]
    # one Start of the slow key fits its rate now; everything else flows past it
    assert keys.count("slow") == 1
    assert sum(key.startswith("other/") for key in keys) == 10 and keys.count("") == 10
    # and the outcome says when the slow key reopens, so the dispatcher comes back then
    outcome = rounds.lease_for_worker(worker=worker, limit=16)
    assert outcome.assignments == []
    assert outcome.rate_reopens_in is not None and 55 < outcome.rate_reopens_in <= 60


def test_a_start_over_the_keys_rate_answers_rate_limited_with_retry_after(tenant):
    # given two leases of a key with capacity 2 and no rate yet
    policy = make_policy(tenant.namespace, key="late", capacity=2)
    queue = make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)
    for n in range(2):
        submit_ok(tenant.client, queue["id"], f"t-{n}", concurrency_key="late")
    worker = worker_for(tenant, queue["id"])
    first, second = ({"worker": worker, **entry} for entry in rounds.lease_tasks(worker=worker, limit=16))
    # when the key is given one Start a minute before they start
    KeyPolicy.objects.filter(id=policy.id).update(rate_starts=1, rate_per_seconds=60, rate_burst=1, revision=2)
    make_policy(tenant.namespace, key="unrelated")  # moves the generation
    start(first)
    # then the second Start is refused, with the wait until the key has room
    with pytest.raises(RateLimited) as refused:
        start(second)
    assert 59_000 <= refused.value.retry_after_ms <= 60_000
    assert Attempt.objects.get(id=second["attempt_id"]).state == "LEASED"
    assert_invariants()
