"""Capacity N per key (SPEC §12), through the dispatch verbs: at most N valid
permits across the namespace, one token sequence per key, the lowest free slot,
lowering keeps holders, and no policy is the seed's behaviour."""

from __future__ import annotations

import pytest

from tasks.actions import endings, rounds
from tasks.key_rules import PolicySet, Rate
from tasks.models import Attempt, AttemptState, ConcurrencyKey, ConcurrencySlot, KeyMatch, KeyPolicy
from tests.support.api import make_queue
from tests.support.key_rows import make_policy
from tests.support.tasks import assert_invariants, report, start, submit_ok, worker_for

pytestmark = pytest.mark.django_db


def lease_all(worker, limit: int = 16, rounds_max: int = 20) -> list[dict]:
    """Leases until a lease takes nothing (one ready task per key and queue each time)."""
    leased: list[dict] = []
    for _ in range(rounds_max):
        got = rounds.lease_tasks(worker=worker, limit=limit)
        if not got:
            return leased
        leased += [{"worker": worker, **entry} for entry in got]
    raise AssertionError("the lease never ran dry")


def key_of(namespace_id: str, key: str) -> ConcurrencyKey:
    return ConcurrencyKey.objects.get(namespace_id=namespace_id, key=key)


def finish(lease: dict) -> None:
    start(lease)
    assert report(lease, "SUCCEEDED")["task_state"] == "SUCCEEDED"


def test_capacity_three_grants_three_permits_on_distinct_slots_with_increasing_tokens(tenant):
    # given a key with capacity 3 and six of its tasks
    make_policy(tenant.namespace, key="ledger/1", capacity=3)
    queue = make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)
    for n in range(6):
        submit_ok(tenant.client, queue["id"], f"t-{n}", concurrency_key="ledger/1")
    worker = worker_for(tenant, queue["id"])
    # when the worker leases all it can
    leased = lease_all(worker)
    # then three hold the key, on slots 0, 1 and 2, tokens in lease order
    assert len(leased) == 3
    assert sorted(entry["concurrency_slot"] for entry in leased) == [0, 1, 2]
    tokens = [int(entry["concurrency_token"]) for entry in leased]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    row = key_of(tenant.namespace_id, "ledger/1")
    assert row.holders == 3 and row.capacity == 3
    # when the holder of slot 1 ends, its slot (and only it) is given out again, with a larger token
    second = next(entry for entry in leased if entry["concurrency_slot"] == 1)
    finish(second)
    (again,) = lease_all(worker)
    assert again["concurrency_slot"] == 1
    assert int(again["concurrency_token"]) > max(tokens)
    assert key_of(tenant.namespace_id, "ledger/1").holders == 3
    assert (
        ConcurrencySlot.objects.get(namespace_id=tenant.namespace_id, key="ledger/1", slot=1).holder_attempt_id
        == (again["attempt_id"])
    )
    assert_invariants()


def test_without_a_policy_the_assignment_has_no_slot_and_the_seeds_tokens(tenant):
    queue = make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)
    for n in range(3):
        submit_ok(tenant.client, queue["id"], f"t-{n}", concurrency_key="plain/1")
    worker = worker_for(tenant, queue["id"])
    (first,) = lease_all(worker)
    assert "concurrency_slot" not in first and first["concurrency_token"] == "1"
    finish(first)
    (second,) = lease_all(worker)
    # one lease and one release advanced the row: the seed's token sequence
    assert "concurrency_slot" not in second and second["concurrency_token"] == "3"
    assert Attempt.objects.get(id=second["attempt_id"]).concurrency_slot is None
    assert_invariants()


def test_a_prefix_policy_gives_each_matching_key_its_own_capacity(tenant):
    make_policy(tenant.namespace, prefix="customer/", capacity=2)
    queue = make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)
    for key in ("customer/1", "customer/2", "other"):
        for n in range(3):
            submit_ok(tenant.client, queue["id"], f"{key}-{n}", concurrency_key=key)
    leased = lease_all(worker_for(tenant, queue["id"]))
    by_key: dict[str, int] = {}
    for entry in leased:
        by_key[entry["task"]["concurrency_key"]] = by_key.get(entry["task"]["concurrency_key"], 0) + 1
    assert by_key == {"customer/1": 2, "customer/2": 2, "other": 1}
    assert_invariants()


def test_exact_key_beats_the_longest_prefix_which_beats_the_default():
    def policy(kind: str, value: str, capacity: int) -> KeyPolicy:
        return KeyPolicy(id=f"{value}-{kind}", match_kind=kind, match_value=value, capacity=capacity)

    policies = PolicySet.of(
        [
            policy(KeyMatch.PREFIX, "a/", 2),
            policy(KeyMatch.PREFIX, "a/b/", 3),
            policy(KeyMatch.KEY, "a/b/c", 7),
            policy(KeyMatch.PREFIX, "\u00e9", 4),
        ]
    )
    assert policies.resolve("a/b/c").capacity == 7
    assert policies.resolve("a/b/cd").capacity == 3
    assert policies.resolve("a/x").capacity == 2
    assert policies.resolve("A/x").capacity == 1  # byte for byte: no case folding
    assert policies.resolve("e\u0301/1").capacity == 1  # nor normalization
    assert policies.resolve("\u00e9/1").capacity == 4
    assert policies.resolve("a").capacity == 1 and policies.resolve("a").policy_id is None


def test_lowering_capacity_keeps_its_holders_and_grants_nothing_until_fewer_hold(tenant):
    policy = make_policy(tenant.namespace, key="ledger/2", capacity=3)
    queue = make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)
    for n in range(5):
        submit_ok(tenant.client, queue["id"], f"t-{n}", concurrency_key="ledger/2")
    worker = worker_for(tenant, queue["id"])
    holders = lease_all(worker)
    assert len(holders) == 3
    # when the capacity is lowered to 1
    KeyPolicy.objects.filter(id=policy.id).update(capacity=1, revision=2)
    make_policy(tenant.namespace, key="unrelated", capacity=1)  # moves the generation
    # then the three keep their permits and nothing more is granted while any two hold
    assert lease_all(worker) == []
    for lease in sorted(holders, key=lambda entry: entry["concurrency_slot"])[:2]:
        finish(lease)
        assert lease_all(worker) == []
    assert Attempt.objects.filter(concurrency_key="ledger/2", state=AttemptState.LEASED).count() == 1
    # and once the last ends, the next grant is capacity 1's: no slot
    finish(sorted(holders, key=lambda entry: entry["concurrency_slot"])[2])
    (single,) = lease_all(worker)
    assert "concurrency_slot" not in single
    assert_invariants()


def test_a_key_at_capacity_does_not_hold_back_other_keys_or_unkeyed_work(tenant):
    make_policy(tenant.namespace, key="busy", capacity=2)
    queue = make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)
    for n in range(20):
        submit_ok(tenant.client, queue["id"], f"busy-{n}", concurrency_key="busy", priority=9)
    for n in range(5):
        submit_ok(tenant.client, queue["id"], f"free-{n}", priority=1)
    worker = worker_for(tenant, queue["id"])
    leased = lease_all(worker)
    keys = [entry["task"].get("concurrency_key", "") for entry in leased]
    assert keys.count("busy") == 2 and keys.count("") == 5


def test_rate_reservation_and_key_state_are_given_back_when_a_leased_attempt_ends_unstarted(tenant):
    make_policy(tenant.namespace, key="paced", capacity=2, rate=(1, 60, 2))
    queue = make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)
    for n in range(3):
        submit_ok(tenant.client, queue["id"], f"t-{n}", concurrency_key="paced")
    worker = worker_for(tenant, queue["id"])
    leased = lease_all(worker)
    # burst 2: two leases reserve the two Starts the key may make now
    assert len(leased) == 2
    row = key_of(tenant.namespace_id, "paced")
    assert row.rate_reserved == 2 and row.holders == 2
    # when one is released unstarted (the worker hands it back), its reservation is given back
    first = leased[0]
    endings.release_attempt(
        worker=first["worker"], attempt_id=first["attempt_id"], epoch=first["epoch"], reason="shutting down"
    )
    row = key_of(tenant.namespace_id, "paced")
    assert row.rate_reserved == 1 and row.holders == 1
    assert Rate(1, 60, 2).lease_allowed(row.rate_tat, row.rate_reserved, row.updated_at)
    assert_invariants()


def test_one_lease_fills_a_keys_capacity_from_one_queue(tenant):
    make_policy(tenant.namespace, key="wide", capacity=4)
    queue = make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)
    for n in range(10):
        submit_ok(tenant.client, queue["id"], f"t-{n}", concurrency_key="wide")
    leased = rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=16)
    assert sorted(entry["concurrency_slot"] for entry in leased) == [0, 1, 2, 3]
    assert_invariants()
