"""The dispatch verbs directly (lease_tasks, approve_start): what a lease may
take, and the checks Start repeats under its lock (SPEC §6, §10)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import transaction
from django.db.models import F

from orbit.errors import LeaseLost, QueuePaused, RateLimited
from queues.models import QueueState
from tasks.actions import rounds
from tasks.models import Attempt, Task
from tests.support.api import make_queue
from tests.support.tasks import (
    Background,
    assert_invariants,
    cancel,
    configure_queue,
    counters,
    in_seconds,
    now,
    submit_ok,
    worker_for,
)


def leased_task_ids(assignments: list[dict]) -> list[str]:
    return [a["task"]["id"] for a in assignments]


@pytest.mark.django_db
def test_higher_priority_first_then_oldest(tenant):
    queue = make_queue(tenant.client)
    low = submit_ok(tenant.client, queue["id"], "low", priority=1)
    old = submit_ok(tenant.client, queue["id"], "old", priority=5, available_at=in_seconds(-20))
    new = submit_ok(tenant.client, queue["id"], "new", priority=5, available_at=in_seconds(-10))
    high = submit_ok(tenant.client, queue["id"], "high", priority=9)
    worker = worker_for(tenant, queue["id"])
    order = [leased_task_ids(rounds.lease_tasks(worker=worker, limit=1))[0] for _ in range(4)]
    assert order == [high["id"], old["id"], new["id"], low["id"]]


@pytest.mark.django_db
def test_lease_takes_at_most_the_queue_headroom(tenant):
    # given max_concurrency 3 and ten waiting tasks
    queue = make_queue(tenant.client, max_concurrency=3, rate_per_second=1000)
    for i in range(10):
        submit_ok(tenant.client, queue["id"], f"t-{i}")
    worker = worker_for(tenant, queue["id"])
    # then one lease takes 3, the next none
    assert len(rounds.lease_tasks(worker=worker, limit=10)) == 3
    assert rounds.lease_tasks(worker=worker, limit=10) == []
    state = counters(queue["id"])
    assert state["active_permits"] == 3 and state["reserved_starts"] == 3 and state["app_active_attempts"] == 3
    assert_invariants()


@pytest.mark.django_db
def test_lease_reserves_start_rate_room(tenant):
    # given 2 Starts per second: a lease never creates an attempt that could not start
    queue = make_queue(tenant.client, max_concurrency=10, rate_per_second=2)
    for i in range(5):
        submit_ok(tenant.client, queue["id"], f"t-{i}")
    worker = worker_for(tenant, queue["id"])
    first = rounds.lease_tasks(worker=worker, limit=10)
    assert len(first) == 2
    assert rounds.lease_tasks(worker=worker, limit=10) == []
    # when both start, the window is used up: still no room
    for assign in first:
        rounds.approve_start(worker=worker, attempt_id=assign["attempt_id"], epoch=assign["epoch"])
    assert rounds.lease_tasks(worker=worker, limit=10) == []
    assert counters(queue["id"])["window_count"] == 2
    assert_invariants()


@pytest.mark.django_db
def test_paused_queue_leases_nothing_and_start_is_refused(tenant):
    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "t-1")
    submit_ok(tenant.client, queue["id"], "t-2")
    worker = worker_for(tenant, queue["id"])
    (assign,) = rounds.lease_tasks(worker=worker, limit=1)
    configure_queue(tenant.client, queue["id"], paused=True)
    assert rounds.lease_tasks(worker=worker, limit=5) == []
    with pytest.raises(QueuePaused):
        rounds.approve_start(worker=worker, attempt_id=assign["attempt_id"], epoch=1)
    assert Attempt.objects.get(id=assign["attempt_id"]).state == "LEASED"


@pytest.mark.django_db
def test_not_yet_available_and_expired_tasks_are_not_leased(tenant):
    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "later", available_at=in_seconds(60))
    past_deadline = submit_ok(tenant.client, queue["id"], "late", deadline_at=in_seconds(60))
    Task.objects.filter(id=past_deadline["id"]).update(deadline_at=now() - timedelta(seconds=1))
    assert rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=5) == []


@pytest.mark.django_db
def test_keyless_worker_never_gets_keyed_tasks(tenant):
    queue = make_queue(tenant.client)
    keyed = submit_ok(tenant.client, queue["id"], "keyed", concurrency_key="printer", priority=9)
    plain = submit_ok(tenant.client, queue["id"], "plain")
    assert leased_task_ids(rounds.lease_tasks(worker=worker_for(tenant, queue["id"], keys=False), limit=5)) == [
        plain["id"]
    ]
    assert Task.objects.get(id=keyed["id"]).state == "WAITING"


def pass_time(*task_ids: str, seconds: float) -> None:
    """As if `seconds` had passed for these waiting tasks."""
    Task.objects.filter(id__in=task_ids).update(available_at=F("available_at") - timedelta(seconds=seconds))


def hold_key(tenant, queue_id: str, key: str) -> dict:
    """A task of `key` leased, so the ones submitted next wait behind it."""
    holder = submit_ok(tenant.client, queue_id, "holder", concurrency_key=key)
    assert leased_task_ids(rounds.lease_tasks(worker=worker_for(tenant, queue_id), limit=1)) == [holder["id"]]
    return holder


@pytest.mark.django_db
@pytest.mark.parametrize("first_available_in", [2, -5], ids=["both-later", "lower-already-available"])
def test_a_keyed_sibling_that_became_available_leases_by_priority(tenant, first_available_in):
    # given a busy key, a low-priority task of it and a high-priority one available later
    queue = make_queue(tenant.client)
    holder = hold_key(tenant, queue["id"], "printer")
    low = submit_ok(
        tenant.client, queue["id"], "low", concurrency_key="printer", available_at=in_seconds(first_available_in)
    )
    high = submit_ok(
        tenant.client, queue["id"], "high", concurrency_key="printer", priority=9, available_at=in_seconds(3)
    )
    # when both are available and the key is freed
    pass_time(low["id"], high["id"], seconds=10)
    assert cancel(tenant.client, holder["id"], "free").status_code == 200
    # then the higher priority is leased first, then the other, each with its key
    worker = worker_for(tenant, queue["id"])
    assert leased_task_ids(rounds.lease_tasks(worker=worker, limit=5)) == [high["id"]]
    assert rounds.lease_tasks(worker=worker, limit=5) == []  # the key is held again
    assert cancel(tenant.client, high["id"], "free-2").status_code == 200
    assert leased_task_ids(rounds.lease_tasks(worker=worker, limit=5)) == [low["id"]]
    assert_invariants()


@pytest.mark.django_db
def test_each_lease_of_a_key_makes_its_best_available_sibling_ready(tenant):
    # given a busy key with waiting tasks of three priorities and a fourth available later
    queue = make_queue(tenant.client)
    holder = hold_key(tenant, queue["id"], "printer")
    low, mid, high = (
        submit_ok(tenant.client, queue["id"], name, concurrency_key="printer", priority=priority)["id"]
        for name, priority in (("low", 1), ("mid", 5), ("high", 9))
    )
    later = submit_ok(
        tenant.client, queue["id"], "later", concurrency_key="printer", priority=7, available_at=in_seconds(60)
    )["id"]
    worker = worker_for(tenant, queue["id"])
    # when the key is freed and leased again, three times
    leased, free = [], holder["id"]
    for n in range(3):
        assert cancel(tenant.client, free, f"free-{n}").status_code == 200
        (free,) = leased_task_ids(rounds.lease_tasks(worker=worker, limit=5))
        leased.append(free)
        # then after each lease exactly one waiting task of the key is ready
        assert_invariants()
    # in priority order among the available ones; the later one is ready last
    assert leased == [high, mid, low]
    assert Task.objects.get(id=later).key_ready


@pytest.mark.django_db
def test_one_lease_of_several_keys_hands_each_key_on_by_its_own_siblings(tenant):
    # given three busy keys: one whose later high-priority task is available
    # now, one with a plain successor, one with a single waiting task
    queue = make_queue(tenant.client)
    holders = [submit_ok(tenant.client, queue["id"], f"holder-{key}", concurrency_key=key)["id"] for key in "abc"]
    worker = worker_for(tenant, queue["id"])
    assert sorted(leased_task_ids(rounds.lease_tasks(worker=worker, limit=5))) == sorted(holders)
    a_low = submit_ok(tenant.client, queue["id"], "a-low", concurrency_key="a")["id"]
    a_high = submit_ok(
        tenant.client, queue["id"], "a-high", concurrency_key="a", priority=9, available_at=in_seconds(3)
    )["id"]
    b_first, b_second = (submit_ok(tenant.client, queue["id"], f"b-{n}", concurrency_key="b")["id"] for n in (1, 2))
    c_only = submit_ok(tenant.client, queue["id"], "c-only", concurrency_key="c")["id"]
    pass_time(a_high, seconds=10)
    for n, holder in enumerate(holders):
        assert cancel(tenant.client, holder, f"free-{n}").status_code == 200
    # when one lease takes all three keys
    leased = leased_task_ids(rounds.lease_tasks(worker=worker, limit=5))
    # then each key's best task went, and each key's next one is ready
    assert sorted(leased) == sorted([a_high, b_first, c_only])
    ready = set(Task.objects.filter(queue_id=queue["id"], state="WAITING", key_ready=True).values_list("id", flat=True))
    assert ready == {a_low, b_second}
    assert_invariants()


@pytest.mark.django_db
def test_the_overtaking_sibling_goes_to_a_worker_that_serves_its_handler(tenant):
    queue = make_queue(tenant.client)
    holder = hold_key(tenant, queue["id"], "printer")
    low = submit_ok(tenant.client, queue["id"], "low", concurrency_key="printer")
    high = submit_ok(
        tenant.client,
        queue["id"],
        "high",
        concurrency_key="printer",
        priority=9,
        handler="other",
        available_at=in_seconds(3),
    )
    pass_time(high["id"], seconds=10)
    assert cancel(tenant.client, holder["id"], "free").status_code == 200
    # a worker of the low task's handler only does not take the key's turn from the higher one
    echo_only = worker_for(tenant, queue["id"], handlers=(("echo", "v1"),), worker_id="echo-only")
    assert rounds.lease_tasks(worker=echo_only, limit=5) == []
    other = worker_for(tenant, queue["id"], handlers=(("other", "v1"),), worker_id="other")
    assert leased_task_ids(rounds.lease_tasks(worker=other, limit=5)) == [high["id"]]
    assert Task.objects.get(id=low["id"]).state == "WAITING"
    assert_invariants()


@pytest.mark.django_db
def test_rate_limited_start_changes_nothing(tenant):
    # given two leased tasks and the rate lowered to 1 after the lease
    queue = make_queue(tenant.client, max_concurrency=10, rate_per_second=100)
    for i in range(2):
        submit_ok(tenant.client, queue["id"], f"t-{i}")
    worker = worker_for(tenant, queue["id"])
    first, second = rounds.lease_tasks(worker=worker, limit=2)
    configure_queue(tenant.client, queue["id"], rate_per_second=1)
    rounds.approve_start(worker=worker, attempt_id=first["attempt_id"], epoch=1)
    before = counters(queue["id"])
    # when the second asks to start in the same window
    with pytest.raises(RateLimited) as limited:
        rounds.approve_start(worker=worker, attempt_id=second["attempt_id"], epoch=1)
    # then RATE_LIMITED with the time left in the window, and nothing moved
    assert 0 < limited.value.details["retry_after_ms"] <= 1000
    assert counters(queue["id"]) == before
    attempt = Attempt.objects.get(id=second["attempt_id"])
    assert attempt.state == "LEASED" and attempt.number is None
    assert Task.objects.get(id=second["task"]["id"]).attempts == 0


@pytest.mark.django_db(transaction=True)
def test_start_rechecks_the_lease_with_the_clock_read_under_its_lock(tenant):
    # given a leased task whose lease has 0.3 s left
    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "t-1")
    worker = worker_for(tenant, queue["id"])
    (assign,) = rounds.lease_tasks(worker=worker, limit=1)
    Attempt.objects.filter(id=assign["attempt_id"]).update(lease_expires_at=now() + timedelta(seconds=0.3))
    # and another transaction holding the queue's counter row for 0.8 s
    locked = threading.Event()

    def hold_queue_state() -> None:
        with transaction.atomic():
            QueueState.objects.select_for_update().get(queue_id=queue["id"])
            locked.set()
            time.sleep(0.8)

    holder = Background(hold_queue_state)
    assert locked.wait(timeout=5)
    # when the Start waits on that lock past the lease's end
    # then it is refused: the lease is re-checked under the lock, not before it
    with pytest.raises(LeaseLost):
        rounds.approve_start(worker=worker, attempt_id=assign["attempt_id"], epoch=1)
    holder.join(timeout=5)
    # (a live server's lease recovery, if one runs, may have expired it meanwhile)
    attempt = Attempt.objects.get(id=assign["attempt_id"])
    assert attempt.state in ("LEASED", "EXPIRED") and attempt.started_at is None and attempt.number is None
    assert Task.objects.get(id=assign["task"]["id"]).attempts == 0
    assert counters(queue["id"])["window_count"] == 0
    assert_invariants()
