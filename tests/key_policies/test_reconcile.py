"""The key rows' cached capacity and rate state follow policy changes
(tasks.actions.policies.reconcile_policy): refreshed right after each write,
in chunks of their own transactions, and finished by the maintenance loop
when a crash cut a reconcile short."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tasks import maintenance
from tasks.actions import policies
from tasks.models import ConcurrencyKey, KeyPolicy
from tests.support.api import assert_ok
from tests.support.key_policies import configure, create_ok, make_key_rows, retire
from tests.support.lock_order import assert_lock_order

pytestmark = pytest.mark.django_db(transaction=True)

RATE = {"starts": 10, "per_seconds": 1, "burst": 2}


def capacities(namespace_id: str) -> dict[str, int]:
    return dict(ConcurrencyKey.objects.filter(namespace_id=namespace_id).values_list("key", "capacity"))


def test_a_prefix_policy_over_2000_key_rows_updates_every_one_and_no_other(tenant):
    # given 2,000 key rows under the prefix, and neighbours on both sides of its byte range
    inside = [f"customer/{n:05d}" for n in range(2000)]
    outside = ["customer", "customer.", "customer0", "customeR/1", "custom", "d"]
    make_key_rows(tenant.namespace_id, inside + outside)
    # when a prefix policy with capacity 5 and a rate is created
    policy = create_ok(tenant.client, capacity=5, rate=RATE)
    # then every matching row caches capacity 5 and a rate state, the others are untouched
    rows = {row.key: row for row in ConcurrencyKey.objects.filter(namespace_id=tenant.namespace_id)}
    assert {rows[key].capacity for key in inside} == {5}
    assert all(rows[key].next_start_at is not None for key in inside)
    assert {(rows[key].capacity, rows[key].next_start_at) for key in outside} == {(1, None)}
    assert KeyPolicy.objects.get(id=policy["id"]).applied_revision == 1
    # when it is configured without a rate, then retired
    assert_ok(configure(tenant.client, policy["id"], capacity=3))
    assert set(capacities(tenant.namespace_id)[key] for key in inside) == {3}
    assert not ConcurrencyKey.objects.filter(key__in=inside, next_start_at__isnull=False).exists()
    assert_ok(retire(tenant.client, policy["id"], revision="2"))
    # then the keys are back to the default
    assert set(capacities(tenant.namespace_id).values()) == {1}
    assert KeyPolicy.objects.get(id=policy["id"]).applied_revision == 3


def test_an_exact_key_beats_a_longer_prefix_which_beats_a_shorter_one(tenant):
    make_key_rows(tenant.namespace_id, ["a/b/1", "a/b/2", "a/c", "b"])
    create_ok(tenant.client, key="p1", match={"prefix": "a/"}, capacity=2)
    create_ok(tenant.client, key="p2", match={"prefix": "a/b/"}, capacity=3)
    exact = create_ok(tenant.client, key="p3", match={"key": "a/b/2"}, capacity=4)
    assert capacities(tenant.namespace_id) == {"a/b/1": 3, "a/b/2": 4, "a/c": 2, "b": 1}
    # retiring the exact policy hands its key to the longest prefix left
    assert_ok(retire(tenant.client, exact["id"]))
    assert capacities(tenant.namespace_id)["a/b/2"] == 3


def test_each_chunk_is_its_own_transaction_locking_its_application_then_key_rows(tenant):
    make_key_rows(tenant.namespace_id, [f"k/{n:04d}" for n in range(1200)])
    policy = KeyPolicy.objects.create(
        namespace_id=tenant.namespace_id,
        match_kind="prefix",
        match_value="k/",
        capacity=9,
        created_at=timezone.now(),
        updated_at=timezone.now(),
    )
    with CaptureQueriesContext(connection) as queries:
        assert policies.reconcile_policy(policy.id) == 1200
    if connection.vendor == "mysql":
        chunk = ["orbit_application_state", "orbit_concurrency_key"]
        locked = assert_lock_order(queries, expect=chunk)
        assert locked.count(chunk) == 3  # 500 + 500 + 200
    # rerunnable: nothing left to change
    KeyPolicy.objects.filter(id=policy.id).update(applied_revision=0)
    assert policies.reconcile_policy(policy.id) == 0
    assert KeyPolicy.objects.get(id=policy.id).applied_revision == 1


def test_a_crash_after_the_first_chunk_is_finished_by_the_maintenance_catch_up(tenant, monkeypatch):
    keys = [f"tenant/{n:04d}" for n in range(1500)]
    make_key_rows(tenant.namespace_id, keys)
    real_chunk = policies._reconcile_chunk
    calls = []

    def crash_after_first(*args, **kwargs):
        if calls:
            raise RuntimeError("the process died here")
        calls.append(args)
        return real_chunk(*args, **kwargs)

    monkeypatch.setattr(policies, "_reconcile_chunk", crash_after_first)
    # when the create commits and its reconcile dies after one chunk
    policy = create_ok(tenant.client, match={"prefix": "tenant/"}, capacity=6)
    # then the change stands, one chunk is cached, the revision is not applied
    assert KeyPolicy.objects.get(id=policy["id"]).applied_revision == 0
    assert sorted(capacities(tenant.namespace_id).values()) == [1] * 1000 + [6] * 500
    monkeypatch.setattr(policies, "_reconcile_chunk", real_chunk)
    # a policy changed just now is left to its own request
    assert policies.catch_up_policies() == 0
    # when the maintenance loop sweeps once the grace period is over
    later = timezone.now() + policies.CATCH_UP_AFTER + timedelta(seconds=1)
    monkeypatch.setattr(maintenance, "catch_up_policies", lambda: policies.catch_up_policies(later))
    maintenance.run_sweep()
    # then every row is done and the revision is applied
    assert set(capacities(tenant.namespace_id).values()) == {6}
    assert KeyPolicy.objects.get(id=policy["id"]).applied_revision == 1
    assert policies.catch_up_policies(later) == 0


def test_the_sweep_itself_calls_the_catch_up(monkeypatch):
    called = []
    monkeypatch.setattr(maintenance, "recover_expired_leases", lambda: 0)
    monkeypatch.setattr(maintenance, "sweep_deadlines", lambda: 0)
    monkeypatch.setattr(maintenance, "fire_due_plans", lambda: 0)
    monkeypatch.setattr(maintenance, "catch_up_policies", lambda: called.append(1) or 1)
    assert maintenance.run_sweep() == 1 and called == [1]


@pytest.mark.parametrize(
    ("prefix", "end"),
    [("a", "b"), ("customer/", "customer0"), ("a\U0010ffff", "b"), ("\U0010ffff", None), ("a\ud7ff", "a\ue000")],
)
def test_a_prefix_range_ends_at_the_next_string(prefix, end):
    assert policies.prefix_end(prefix) == end
