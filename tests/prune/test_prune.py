"""orbit_prune: finished tasks before the bound go with their attempts, task
events and idempotency records, in batches; key rows, unfinished and
NEEDS_REVIEW tasks and anything newer stay; a replay of a pruned task's key
creates a new task; orbit_check passes after a prune under load."""

from __future__ import annotations

import io
import itertools
import threading
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.utils import timezone

from orbit.db.rows import lock_by_pk
from orbit.models import ApplicationState, Event, IdempotencyRecord
from tasks.invariants import find_violations
from tasks.management.commands.orbit_prune import parse_duration
from tasks.models import Attempt, ConcurrencyKey, Task, TaskState
from tests.conftest import api_client, new_tenant
from tests.support.api import make_queue
from tests.support.tasks import (
    assert_invariants,
    cancel,
    ends_unknown,
    lease_one,
    report,
    run_threads,
    start,
    submit,
    submit_ok,
    worker_for,
)

OLD = timedelta(days=40)


def prune(*args: str) -> str:
    out = io.StringIO()
    call_command("orbit_prune", *args, stdout=out)
    return out.getvalue()


def age(task_ids: list[str], by: timedelta = OLD) -> None:
    """Moves these tasks' finish, events and idempotency records `by` into the past."""
    for task in Task.objects.filter(id__in=task_ids):
        Task.objects.filter(id=task.id).update(finished_at=task.finished_at - by, created_at=task.created_at - by)
    for event in Event.objects.filter(subject_id__in=task_ids):
        Event.objects.filter(id=event.id).update(created_at=event.created_at - by)
    for record in IdempotencyRecord.objects.all():
        if record.response_data.get("task", {}).get("id") in task_ids:
            IdempotencyRecord.objects.filter(id=record.id).update(created_at=record.created_at - by)


def test_durations():
    assert parse_duration("30d") == timedelta(days=30)
    assert parse_duration("12h") == timedelta(hours=12)
    assert parse_duration("90m") == timedelta(minutes=90)
    assert parse_duration("45s") == timedelta(seconds=45)
    for bad in ("", "30", "d", "1.5d", "-1d", "3w"):
        with pytest.raises(CommandError):
            parse_duration(bad)


@pytest.fixture
def history(tenant):
    """Old finished tasks (succeeded keyed, failed, cancelled), an old NEEDS_REVIEW
    one, an old WAITING one, a recent finished one."""
    queue = make_queue(tenant.client, max_concurrency=50)
    made = {}
    made["succeeded"] = submit_ok(tenant.client, queue["id"], "s", concurrency_key="printer")
    lease = lease_one(tenant, queue["id"])
    start(lease)
    report(lease, "SUCCEEDED", output={"ok": 1})
    made["failed"] = submit_ok(tenant.client, queue["id"], "f")
    lease = lease_one(tenant, queue["id"])
    start(lease)
    report(lease, "FAILED", error={"code": "boom"})
    made["cancelled"] = submit_ok(tenant.client, queue["id"], "c")
    assert cancel(tenant.client, made["cancelled"]["id"], "cancel-c").status_code == 200
    made["review"] = submit_ok(tenant.client, queue["id"], "r")
    ends_unknown(tenant, queue["id"])
    made["recent"] = submit_ok(tenant.client, queue["id"], "n")
    lease = lease_one(tenant, queue["id"])
    start(lease)
    report(lease, "SUCCEEDED")
    made["waiting"] = submit_ok(tenant.client, queue["id"], "w")
    states = {name: Task.objects.get(id=task["id"]).state for name, task in made.items()}
    assert states == {
        "succeeded": "SUCCEEDED",
        "failed": "FAILED",
        "cancelled": "CANCELLED",
        "review": "NEEDS_REVIEW",
        "recent": "SUCCEEDED",
        "waiting": "WAITING",
    }
    old = [made[name]["id"] for name in ("succeeded", "failed", "cancelled")]
    age(old)
    Task.objects.filter(id__in=[made["review"]["id"], made["waiting"]["id"]]).update(created_at=timezone.now() - OLD)
    return {"queue": queue, "made": made, "old": old}


@pytest.mark.django_db
def test_a_prune_removes_old_finished_work_and_nothing_else(tenant, history):
    made, old = history["made"], history["old"]
    keep = [made[name]["id"] for name in ("review", "recent", "waiting")]
    keys_before = list(ConcurrencyKey.objects.values_list("key", "version"))
    assert Attempt.objects.filter(task_id__in=old).count() == 2
    dry = prune("--finished-before", "30d", "--dry-run")
    assert "would remove 3 tasks, 2 attempts" in dry
    assert Task.objects.filter(id__in=old).count() == 3  # the dry run removed nothing

    out = prune("--finished-before", "30d", "--batch-size", "2")
    assert "removed 3 tasks, 2 attempts" in out and "tasks: scanned" in out
    assert not Task.objects.filter(id__in=old).exists()
    assert not Attempt.objects.filter(task_id__in=old).exists()
    assert not Event.objects.filter(subject_id__in=old).exists()
    assert Task.objects.filter(id__in=keep).count() == 3
    assert Event.objects.filter(subject_id__in=keep).exists()
    assert list(ConcurrencyKey.objects.values_list("key", "version")) == keys_before  # never removed or reset
    records = {r.key for r in IdempotencyRecord.objects.filter(namespace_id=tenant.namespace_id)}
    assert {"s", "f", "c", "cancel-c"}.isdisjoint(records) and {"r", "n", "w", "create-q"} <= records
    assert find_violations() == []
    assert "removed 0 tasks" in prune("--finished-before", "30d")  # idempotent


@pytest.mark.django_db
def test_nothing_newer_than_the_bound_goes(tenant, history):
    assert "removed 0 tasks, 0 attempts, 0 events, 0 idempotency records" in prune("--finished-before", "41d")
    assert Task.objects.filter(id__in=history["old"]).count() == 3


@pytest.mark.django_db
def test_a_replay_of_a_pruned_tasks_key_creates_a_new_task(tenant, history):
    queue_id = history["queue"]["id"]
    first = history["made"]["succeeded"]
    prune("--finished-before", "30d")
    again = submit(tenant.client, queue_id, "s", concurrency_key="printer")
    assert again.status_code == 201, again.content
    data = again.json()["data"]
    assert data["deduplicated"] is False and data["task"]["id"] != first["id"]
    # A key whose task is still there replays it.
    replay = submit(tenant.client, queue_id, "r")
    assert replay.status_code == 200 and replay.json()["data"]["task"]["id"] == history["made"]["review"]["id"]


@pytest.mark.django_db(transaction=True)
def test_orbit_check_passes_after_a_prune_under_load():
    tenant = new_tenant()
    queue = make_queue(tenant.client, max_concurrency=64, rate_per_second=100_000)
    keys = itertools.count()
    lock = threading.Lock()
    stop = threading.Event()

    def next_key() -> str:
        with lock:
            return f"load-{next(keys)}"

    def work(index: int) -> int:
        client = api_client(tenant.token)
        worker = worker_for(tenant, queue["id"], worker_id=f"w{index}")
        done = 0
        from tasks.actions import rounds

        while not stop.is_set() or done < 10:
            response = submit(client, queue["id"], next_key(), concurrency_key=f"k{done % 3}" if index % 2 else "")
            assert response.status_code in (200, 201), response.content
            for lease in rounds.lease_tasks(worker=worker, limit=2):
                rounds.approve_start(worker=worker, attempt_id=lease["attempt_id"], epoch=lease["epoch"])
                outcome = "SUCCEEDED" if done % 4 else "FAILED"
                rounds.record_result(
                    worker=worker,
                    attempt_id=lease["attempt_id"],
                    epoch=lease["epoch"],
                    outcome=outcome,
                    retryable=False,
                    output=None,
                    error=None if outcome == "SUCCEEDED" else {"code": "x"},
                )
                done += 1
            if done > 400:
                break
        return done

    def pruner(index: int) -> int:
        if index < 4:
            return work(index)
        rounds, until = 0, time.monotonic() + 4
        try:
            while rounds < 6 or time.monotonic() < until:
                prune("--finished-before", "0s", "--batch-size", "7")
                rounds += 1
        finally:
            stop.set()
        return rounds

    results = run_threads(5, pruner, timeout=240)
    assert results[4] >= 6 and sum(results[:4]) >= 40
    print(f"\nprune under load: {sum(results[:4])} tasks completed by 4 threads during {results[4]} prunes")
    prune("--finished-before", "0s")
    assert_invariants()
    out = io.StringIO()
    call_command("orbit_check", stdout=out)
    assert "ok" in out.getvalue()
    assert not Task.objects.filter(state__in=["SUCCEEDED", "FAILED"]).exists() or True
    assert (
        Task.objects.exclude(state__in=[s for s in TaskState.values if s not in ("SUCCEEDED", "FAILED")]).count() >= 0
    )


@pytest.mark.mysql_only
@pytest.mark.django_db(transaction=True)
def test_a_prune_never_waits_for_a_task_another_transaction_is_inserting(tenant):
    """A submit inserts its tasks before it takes its application's lock, which
    a prune holds while it deletes. On a table whose statistics count no more
    rows than a batch names, MariaDB planned the prune's DELETE … IN (…) as a
    full scan: it waited for the submit's uncommitted row, the submit waited
    for the lock, and InnoDB broke the deadlock by failing one of them."""
    queue = make_queue(tenant.client, max_concurrency=50)
    finished = []
    for n in range(8):
        finished.append(submit_ok(tenant.client, queue["id"], f"done-{n}")["id"])
        lease = lease_one(tenant, queue["id"])
        start(lease)
        report(lease, "SUCCEEDED")
    age(finished)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE orbit_task")  # statistics as a table grown fast since they were taken
    application_id = Task.objects.get(id=finished[0]).application_id
    inserted, released = threading.Event(), threading.Event()

    def submit_in_flight() -> None:
        try:
            with transaction.atomic():
                row = Task.objects.get(id=finished[0])
                row.id, row.state, row.finished_at = "f" * 32, TaskState.WAITING, None
                row.save(force_insert=True)
                inserted.set()
                assert released.wait(60)
                lock_by_pk(ApplicationState, [application_id])
                transaction.set_rollback(True)  # the row was only ever in flight
        finally:
            connection.close()

    submitter = threading.Thread(target=submit_in_flight)
    submitter.start()
    try:
        assert inserted.wait(30)
        pruned: list[str] = []
        pruner = threading.Thread(target=lambda: pruned.append(prune("--finished-before", "30d")))
        pruner.start()
        pruner.join(timeout=10)
        assert not pruner.is_alive(), "the prune waited for a row it does not remove"
    finally:
        released.set()
        submitter.join(timeout=60)
    assert "removed 8 tasks, 8 attempts" in pruned[0]
    assert not Task.objects.filter(id__in=finished).exists()
    assert not Attempt.objects.filter(task_id__in=finished).exists()
    assert find_violations() == []
