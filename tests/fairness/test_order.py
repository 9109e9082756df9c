"""The fair lease order of one queue (tasks.actions.fairness, SPEC §12) on
rows made here: round robin between fairness keys within a priority, the
key served least recently first, the plain order when no task has a key."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from tasks.actions import dispatch, fairness
from tasks.actions.fairness import NEVER_SERVED, fair_candidates, record_served
from tasks.models import FairShare, Task, TaskState
from tests.support.api import make_queue
from tests.support.fairness import fair_order, keys_of, make_tasks, set_fair
from tests.support.tasks import Background, worker_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def queue(tenant):
    queue = make_queue(tenant.client, "fair", max_concurrency=1000, rate_per_second=1000)
    set_fair(queue["id"])
    return queue


def ago(seconds: float) -> datetime:
    return datetime.now(UTC) - timedelta(seconds=seconds)


def lease(worker, queue_id: str, count: int) -> list[Task]:
    """One fair lease as dispatch would make it: the candidates, marked
    LEASED, their groups recorded served in lease order."""
    with transaction.atomic():
        now = datetime.now(UTC)
        found = fair_candidates(worker, queue_id, now, count)
        found.sort(key=lambda task: (-task.priority, task.fair_rank))
        Task.objects.filter(id__in=[task.id for task in found]).update(state=TaskState.LEASED)
        record_served(found, now)
    return found


def ids(tasks: list[Task]) -> list[str]:
    return [task.id for task in tasks]


def test_without_keys_the_order_is_the_plain_lease_order(tenant, queue):
    # given a fair queue whose tasks carry no fairness key, over priorities and times
    start = ago(60)
    made = [
        *make_tasks(tenant, queue["id"], 7, start=start, priority=5),
        *make_tasks(tenant, queue["id"], 5, start=start + timedelta(seconds=1), priority=9),
        *make_tasks(tenant, queue["id"], 6, start=start - timedelta(seconds=1), priority=1),
        *make_tasks(tenant, queue["id"], 3, start=start + timedelta(microseconds=500), priority=5),
    ]
    worker = worker_for(tenant, queue["id"])
    plain = sorted(made, key=lambda task: (-task.priority, task.available_at, task.id))
    now = datetime.now(UTC)
    for count in (1, 4, 16, 100):
        # then the fair order is exactly the normal scan's
        with transaction.atomic():
            normal = dispatch._candidates(worker, queue["id"], now, count)
        found = fair_order(worker, queue["id"], now, count)
        assert ids(found) == ids(normal) == ids(plain[:count])
        assert ids(sorted(found, key=lambda t: (-t.priority, t.fair_rank))) == ids(found)


def test_served_rows_do_not_change_the_order_without_keys(tenant, queue):
    made = make_tasks(tenant, queue["id"], 40, start=ago(60))
    worker = worker_for(tenant, queue["id"])
    taken = [*lease(worker, queue["id"], 16), *lease(worker, queue["id"], 16), *lease(worker, queue["id"], 16)]
    assert ids(taken) == ids(made)
    assert list(FairShare.objects.values_list("queue_id", "fairness_key")) == [(queue["id"], "")]


def test_one_lease_serves_the_keys_round_robin(tenant, queue):
    # given tenant A's 100 tasks, then tenant B's 10 (all of A's older)
    a = make_tasks(tenant, queue["id"], 100, key="A", start=ago(60))
    b = make_tasks(tenant, queue["id"], 10, key="B", start=ago(30))
    worker = worker_for(tenant, queue["id"])
    # when one lease takes 16: one of each per turn, A first (neither served, A's oldest is older)
    found = fair_order(worker, queue["id"], datetime.now(UTC), 16)
    assert ids(found) == [task.id for pair in zip(a[:8], b[:8], strict=True) for task in pair]
    assert [task.fair_rank[0] for task in found] == [n for n in range(1, 9) for _ in "AB"]
    assert all(task.fair_rank[1] == NEVER_SERVED for task in found)


def test_consecutive_leases_keep_turning(tenant, queue):
    a = make_tasks(tenant, queue["id"], 100, key="A", start=ago(60))
    b = make_tasks(tenant, queue["id"], 10, key="B", start=ago(30))
    worker = worker_for(tenant, queue["id"])
    first = lease(worker, queue["id"], 16)
    assert keys_of(first) == ["A", "B"] * 8
    # B was served last (its 8th was the lease's last): A's turn comes first again
    second = lease(worker, queue["id"], 16)
    assert ids(second) == [a[8].id, b[8].id, a[9].id, b[9].id, *ids(a[10:22])]
    third = lease(worker, queue["id"], 16)
    assert ids(third) == ids(a[22:38])


def test_the_group_served_least_recently_goes_first(tenant, queue):
    a = make_tasks(tenant, queue["id"], 10, key="A", start=ago(60))
    b = make_tasks(tenant, queue["id"], 10, key="B", start=ago(30))
    worker = worker_for(tenant, queue["id"])
    # a lease of 3 ends with A: the next one starts with B, though A's tasks are older
    assert ids(lease(worker, queue["id"], 3)) == [a[0].id, b[0].id, a[1].id]
    assert ids(lease(worker, queue["id"], 3)) == [b[1].id, a[2].id, b[2].id]
    assert ids(lease(worker, queue["id"], 1)) == [a[3].id]
    assert ids(lease(worker, queue["id"], 1)) == [b[3].id]


def test_a_never_served_group_goes_before_served_ones(tenant, queue):
    a = make_tasks(tenant, queue["id"], 10, key="A", start=ago(60))
    worker = worker_for(tenant, queue["id"])
    assert ids(lease(worker, queue["id"], 2)) == ids(a[:2])
    # when C arrives later than all of A, never served: it goes first
    c = make_tasks(tenant, queue["id"], 2, key="C", start=ago(1))
    assert ids(lease(worker, queue["id"], 3)) == [c[0].id, a[2].id, c[1].id]


def test_priority_dominates_the_groups(tenant, queue):
    # given A's urgent tasks, and A's and B's ordinary ones
    urgent = make_tasks(tenant, queue["id"], 5, key="A", start=ago(10), priority=9)
    a = make_tasks(tenant, queue["id"], 5, key="A", start=ago(60))
    b = make_tasks(tenant, queue["id"], 5, key="B", start=ago(50))
    low = make_tasks(tenant, queue["id"], 3, key="C", start=ago(120), priority=1)
    worker = worker_for(tenant, queue["id"])
    found = fair_order(worker, queue["id"], datetime.now(UTC), 18)
    # then all of priority 9 first; at 5, A's urgent backlog does not push A behind B
    expected = [*ids(urgent), *[t.id for pair in zip(a, b, strict=True) for t in pair], *ids(low)]
    assert ids(sorted(found, key=lambda t: (-t.priority, t.fair_rank))) == expected == ids(found)


def test_tasks_without_a_key_are_one_group(tenant, queue):
    plain = make_tasks(tenant, queue["id"], 6, start=ago(60))
    a = make_tasks(tenant, queue["id"], 3, key="A", start=ago(30))
    z = make_tasks(tenant, queue["id"], 3, key="Z", start=ago(20))
    worker = worker_for(tenant, queue["id"])
    first = lease(worker, queue["id"], 6)
    assert ids(first) == [plain[0].id, a[0].id, z[0].id, plain[1].id, a[1].id, z[1].id]
    rest = lease(worker, queue["id"], 6)
    assert ids(rest) == [plain[2].id, a[2].id, z[2].id, *ids(plain[3:6])]
    served = dict(FairShare.objects.filter(queue_id=queue["id"]).values_list("fairness_key", "served_at"))
    assert sorted(served) == ["", "A", "Z"]


def test_keys_compare_byte_for_byte(tenant, queue):
    # "a" and "A", "é" and "e\u0301" are four groups
    groups = ["a", "A", "\u00e9", "e\u0301"]
    made = {key: make_tasks(tenant, queue["id"], 2, key=key, start=ago(60 - i)) for i, key in enumerate(groups)}
    worker = worker_for(tenant, queue["id"])
    first = lease(worker, queue["id"], 4)
    assert ids(first) == [made[key][0].id for key in groups]
    served = FairShare.objects.filter(queue_id=queue["id"]).values_list("fairness_key", flat=True)
    assert sorted(served) == sorted(groups)


def test_only_leasable_tasks_are_ranked(tenant, queue):
    # given tasks the normal scan would not take: later, keyed (for a worker without keys),
    # another handler, past their deadline, not WAITING
    ready = make_tasks(tenant, queue["id"], 2, key="A", start=ago(60))
    make_tasks(tenant, queue["id"], 2, key="B", start=ago(-60))
    make_tasks(tenant, queue["id"], 2, key="C", start=ago(90), concurrency_key="k")
    make_tasks(tenant, queue["id"], 2, key="D", start=ago(90), handler="other")
    make_tasks(tenant, queue["id"], 2, key="E", start=ago(90), deadline_at=ago(1))
    make_tasks(tenant, queue["id"], 2, key="F", start=ago(90), state=TaskState.RUNNING)
    worker = worker_for(tenant, queue["id"], keys=False, handlers=(("echo", "v1"),))
    assert ids(fair_order(worker, queue["id"], datetime.now(UTC), 16)) == ids(ready)
    # and another queue's tasks are not this queue's
    other = make_queue(tenant.client, "other")
    make_tasks(tenant, other["id"], 3, key="A", start=ago(100))
    assert ids(fair_order(worker, queue["id"], datetime.now(UTC), 16)) == ids(ready)


def test_record_served_is_one_upsert_in_lease_order(tenant, queue):
    a = make_tasks(tenant, queue["id"], 3, key="A", start=ago(60))
    b = make_tasks(tenant, queue["id"], 3, key="B", start=ago(60))
    c = make_tasks(tenant, queue["id"], 1, key="C", start=ago(60))
    now = datetime.now(UTC)
    FairShare.objects.create(queue_id=queue["id"], fairness_key="B", served_at=now - timedelta(days=1))
    # the lease order: B, A, C, A, B — so C before A before B
    with CaptureQueriesContext(connection) as queries:
        record_served([b[0], a[0], c[0], a[1], b[1]], now)
    assert len(queries) == 1
    served = dict(FairShare.objects.filter(queue_id=queue["id"]).values_list("fairness_key", "served_at"))
    assert served["C"] < served["A"] < served["B"]
    assert served["C"] >= now and served["B"] - now < timedelta(milliseconds=1)
    assert FairShare.objects.count() == 3
    record_served([], now)
    assert FairShare.objects.count() == 3


@pytest.mark.mysql_only  # row locks: SQLite locks the whole database
@pytest.mark.django_db(transaction=True)
def test_rows_another_transaction_holds_are_skipped(tenant, queue):
    a = make_tasks(tenant, queue["id"], 6, key="A", start=ago(60))
    b = make_tasks(tenant, queue["id"], 6, key="B", start=ago(30))
    worker = worker_for(tenant, queue["id"])
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with transaction.atomic():
            list(Task.objects.select_for_update().filter(id__in=[a[0].id, b[0].id, b[1].id]).order_by("id"))
            held.set()
            release.wait(30)

    holder = Background(hold)
    try:
        assert held.wait(10)
        # when a lease ranks while another transaction holds A's first and B's first two
        started = datetime.now(UTC)
        found = fair_order(worker, queue["id"], datetime.now(UTC), 4)
        # then it does not wait, and fills its count from the rest, ranked without them
        assert datetime.now(UTC) - started < timedelta(seconds=2)
        assert ids(found) == [a[1].id, b[2].id, a[2].id, b[3].id]
    finally:
        release.set()
        holder.join(30)
    # once released they lead again
    assert ids(fair_order(worker, queue["id"], datetime.now(UTC), 3)) == [a[0].id, b[0].id, a[1].id]


def test_a_row_changed_after_the_ranking_is_not_returned(tenant, queue, monkeypatch):
    a = make_tasks(tenant, queue["id"], 3, key="A", start=ago(60))
    worker = worker_for(tenant, queue["id"])
    ranked = fairness._ranked

    def ranked_then_taken(*args, **kwargs):
        rows = ranked(*args, **kwargs)
        Task.objects.filter(id=a[0].id).update(state=TaskState.CANCELLED)  # between the two statements
        return rows

    monkeypatch.setattr(fairness, "_ranked", ranked_then_taken)
    assert ids(fair_order(worker, queue["id"], datetime.now(UTC), 2)) == [a[1].id, a[2].id]


def test_count_zero_reads_nothing(tenant, queue):
    make_tasks(tenant, queue["id"], 3, key="A", start=ago(60))
    with CaptureQueriesContext(connection) as queries:
        assert fair_order(worker_for(tenant, queue["id"]), queue["id"], datetime.now(UTC), 0) == []
    assert [q for q in queries if "orbit_task" in q["sql"]] == []
