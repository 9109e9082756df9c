"""orbit_check (tasks.invariants) for keys with capacities and rates: a key's valid permits are
its active attempts, one per slot, each named by its slot; no grant beyond the capacity in
force; slot tokens issued by the key and distinct among holders; the GCRA state counts the
LEASED attempts that reserved a Start, and the Starts keep the rate's bound."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tasks.invariants import find_violations
from tasks.models import Attempt, ConcurrencyKey, ConcurrencySlot, KeyPolicy
from tests.support.api import make_queue
from tests.support.key_rows import make_policy
from tests.support.tasks import lease_one, start, submit_ok

pytestmark = pytest.mark.django_db


@pytest.fixture
def three_holders(tenant):
    """A key of capacity 3 whose three slots are held (through the lease), a fourth task waiting."""
    policy = make_policy(tenant.namespace, key="k", capacity=3)
    queue = make_queue(tenant.client, max_concurrency=10)
    for n in range(4):
        submit_ok(tenant.client, queue["id"], f"t{n}", concurrency_key="k")
    leases = [lease_one(tenant, queue["id"], worker_id=f"w{n}") for n in range(3)]
    assert sorted(int(lease["concurrency_slot"]) for lease in leases) == [0, 1, 2]
    assert find_violations() == []
    return {"policy": policy, "leases": leases, "ident": (tenant.namespace_id, "k")}


def test_a_holders_count_off_by_one_is_named(three_holders):
    ConcurrencyKey.objects.filter(key="k").update(holders=2)
    assert f"key {three_holders['ident']}: holders=2 but 3 active attempts" in find_violations()


def test_a_slot_row_naming_another_attempt_is_named(three_holders):
    slot = ConcurrencySlot.objects.get(key="k", slot=1)
    ConcurrencySlot.objects.filter(id=slot.id).update(holder_attempt_id="f" * 32)
    problems = find_violations()
    ident = three_holders["ident"]
    assert f"key {ident}: active attempt {slot.holder_attempt_id} on slot 1 is not the slot's holder" in problems
    assert f"key {ident}: slot 1 held by {'f' * 32}, which is not active on it" in problems


def test_two_attempts_on_one_slot_are_named(three_holders):
    on_2 = Attempt.objects.get(concurrency_key="k", concurrency_slot=2)
    Attempt.objects.filter(id=on_2.id).update(concurrency_slot=1)
    assert f"key {three_holders['ident']}: slot 1 held by 2 active attempts" in find_violations()


def test_a_grant_beyond_the_capacity_in_force_is_named_but_a_lowered_capacity_keeps_its_holders(three_holders):
    policy, ident = three_holders["policy"], three_holders["ident"]
    # lowered just now: the three were granted under 3, and keep their permits
    KeyPolicy.objects.filter(id=policy.id).update(capacity=2, updated_at=timezone.now())
    assert find_violations() == []
    # had the capacity been 2 since before the leases, the third permit was granted beyond it
    KeyPolicy.objects.filter(id=policy.id).update(updated_at=timezone.now() - timedelta(minutes=1))
    problems = find_violations()
    assert any(p.startswith(f"key {ident}: attempt ") and "granted as permit 3 of capacity 2" in p for p in problems)
    assert any(p.startswith(f"key {ident}: attempt ") and "on slot 2 of capacity 2" in p for p in problems)


def test_without_any_policy_a_second_active_permit_is_named(tenant):
    queue = make_queue(tenant.client, max_concurrency=10)
    tasks = [submit_ok(tenant.client, queue["id"], f"t{n}", concurrency_key="m") for n in range(2)]
    first = lease_one(tenant, queue["id"])
    assert find_violations() == []
    # a second active attempt of the key, as a lease that ignored the permit would have made it
    extra = Attempt.objects.get(id=first["attempt_id"])
    extra.pk = extra.id = "e" * 32
    extra.task_id = next(task["id"] for task in tasks if task["id"] != first["task"]["id"])
    extra.concurrency_token = (extra.concurrency_token or 0) + 100
    extra.leased_at = extra.leased_at + timedelta(milliseconds=1)
    extra.save(force_insert=True)
    problems = find_violations()
    ident = (tenant.namespace_id, "m")
    assert f"key {ident}: attempt {extra.id} granted as permit 2 of capacity 1" in problems
    assert f"key {ident}: holders=1 but 2 active attempts" in problems


def test_slot_tokens_beyond_the_key_or_not_their_holders_are_named(three_holders):
    ident = three_holders["ident"]
    row = ConcurrencyKey.objects.get(key="k")
    ConcurrencySlot.objects.filter(key="k", slot=1).update(token=row.version + 5)
    problems = find_violations()
    assert f"key {ident}: slot 1 token {row.version + 5} beyond the key's version {row.version}" in problems
    assert any(p.startswith(f"key {ident}: slot 1 token {row.version + 5} but its holder") for p in problems)


def test_two_holders_with_one_token_are_named(three_holders):
    on_1 = Attempt.objects.get(concurrency_key="k", concurrency_slot=1)
    on_2 = Attempt.objects.get(concurrency_key="k", concurrency_slot=2)
    Attempt.objects.filter(id=on_2.id).update(concurrency_token=on_1.concurrency_token)
    assert (
        f"key {three_holders['ident']}: token {on_1.concurrency_token} held by 2 active attempts" in find_violations()
    )


def test_the_rate_state_counts_the_leased_attempts_that_reserved_a_start(tenant):
    make_policy(tenant.namespace, key="r", capacity=3, rate=(100, 1, 10))
    queue = make_queue(tenant.client, max_concurrency=10, rate_per_second=100)
    for n in range(3):
        submit_ok(tenant.client, queue["id"], f"t{n}", concurrency_key="r")
    leases = [lease_one(tenant, queue["id"]) for _ in range(2)]
    row = ConcurrencyKey.objects.get(key="r")
    assert row.rate_reserved == 2 and find_violations() == []
    start(leases[0])
    assert ConcurrencyKey.objects.get(key="r").rate_reserved == 1 and find_violations() == []
    ConcurrencyKey.objects.filter(key="r").update(rate_reserved=3)
    ident = (tenant.namespace_id, "r")
    assert f"key {ident}: rate_reserved=3 but 1 LEASED attempts reserved" in find_violations()


def test_starts_faster_than_the_rate_are_named(tenant):
    """The engine keeps the rate; rows rewritten to Starts 1 s apart under 1 per 10 s (burst 2)
    break the bound on the third, and 10 s apart keep it."""
    make_policy(
        tenant.namespace, key="slow", capacity=5, rate=(1, 10, 2), changed_at=timezone.now() - timedelta(hours=1)
    )
    queue = make_queue(tenant.client, max_concurrency=10, rate_per_second=100)
    for n in range(4):
        submit_ok(tenant.client, queue["id"], f"t{n}", concurrency_key="slow")
    leases = [lease_one(tenant, queue["id"]) for _ in range(2)]
    for lease in leases:
        start(lease)
    assert find_violations() == []
    started = list(Attempt.objects.filter(concurrency_key="slow", started_at__isnull=False).order_by("started_at"))
    assert len(started) == 2
    ident = (tenant.namespace_id, "slow")
    base = timezone.now() - timedelta(minutes=10)
    # a third Start, rewritten with the others: t, t + 10 s, t + 20 s keep 1 per 10 s
    third = Attempt.objects.get(id=started[1].id)
    third.pk = third.id = "d" * 32
    third.state = "SUCCEEDED"
    third.number = None  # counted by no task: only its started_at matters here
    third.save(force_insert=True)
    ids = [started[0].id, started[1].id, third.id]
    for n, attempt_id in enumerate(ids):
        Attempt.objects.filter(id=attempt_id).update(started_at=base + timedelta(seconds=10 * n))
    assert not [p for p in find_violations() if "before its rate" in p]
    # 0 s, 1 s, 2 s: the burst of 2 takes the first two, the third comes 8 s early
    for n, attempt_id in enumerate(ids):
        Attempt.objects.filter(id=attempt_id).update(started_at=base + timedelta(seconds=n))
    problems = [p for p in find_violations() if "before its rate" in p]
    assert len(problems) == 1 and problems[0].startswith(f"key {ident}: attempt {ids[2]} started at")
    # the bound's edge: the third exactly when GCRA allows it (t + T with burst 2), less than 1 ms early
    Attempt.objects.filter(id=ids[2]).update(started_at=base + timedelta(seconds=10) - timedelta(microseconds=500))
    Attempt.objects.filter(id=ids[1]).update(started_at=base)
    assert not [p for p in find_violations() if "before its rate" in p]
