"""The deadline sweep (tasks.actions.endings.sweep_deadlines) and the columns it
reads: the database keeps a task's deadlines in them only while the task can
still miss them (WAITING or LEASED; the start deadline only before the first
Start), so a state change of a task without deadlines rewrites no entry of
their indexes."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tasks.actions.endings import sweep_deadlines
from tasks.models import Task
from tests.support.api import make_queue
from tests.support.tasks import in_seconds, now, submit_ok

pytestmark = pytest.mark.django_db


def due(task_id: str) -> tuple[object, object]:
    return Task.objects.values_list("deadline_due_at", "start_deadline_due_at").get(id=task_id)


@pytest.fixture
def queue(tenant):
    return make_queue(tenant.client, "sweep")


def test_the_sweep_columns_hold_the_deadlines_while_they_can_be_missed(tenant, queue):
    task = submit_ok(tenant.client, queue["id"], "d-1", start_deadline_at=in_seconds(60), deadline_at=in_seconds(120))
    row = Task.objects.get(id=task["id"])

    assert due(row.id) == (row.deadline_at, row.start_deadline_at)
    Task.objects.filter(id=row.id).update(state="LEASED")
    assert due(row.id) == (row.deadline_at, row.start_deadline_at)
    Task.objects.filter(id=row.id).update(state="RUNNING", attempts=1)
    assert due(row.id) == (None, None)
    # back to WAITING for a retry: its deadline still counts, its start deadline no more
    Task.objects.filter(id=row.id).update(state="WAITING")
    assert due(row.id) == (row.deadline_at, None)
    for final in ("SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"):
        Task.objects.filter(id=row.id).update(state=final)
        assert due(row.id) == (None, None)


def test_a_task_without_deadlines_has_nothing_to_sweep_in_any_state(tenant, queue):
    task = submit_ok(tenant.client, queue["id"], "d-2")
    for state in ("WAITING", "LEASED", "RUNNING", "SUCCEEDED"):
        Task.objects.filter(id=task["id"]).update(state=state)
        assert due(task["id"]) == (None, None)


def test_the_sweep_fails_the_overdue_tasks_that_can_still_miss_them_and_no_other(tenant, queue):
    past = now() - timedelta(seconds=1)
    submitted = {
        name: submit_ok(tenant.client, queue["id"], name, start_deadline_at=in_seconds(60), deadline_at=in_seconds(120))
        for name in ("late", "late-start", "started-late-start", "running-late", "on-time")
    }
    ids = {name: task["id"] for name, task in submitted.items()}
    Task.objects.filter(id=ids["late"]).update(deadline_at=past)
    Task.objects.filter(id=ids["late-start"]).update(start_deadline_at=past)
    # a retry's wait after a first Start: the start deadline no longer applies
    Task.objects.filter(id=ids["started-late-start"]).update(start_deadline_at=past, attempts=1)
    # running: the deadline stops its renewals, not the sweep
    Task.objects.filter(id=ids["running-late"]).update(deadline_at=past, state="RUNNING", attempts=1)

    assert sweep_deadlines() == 2

    states = dict(Task.objects.filter(id__in=ids.values()).values_list("id", "state"))
    assert {name: states[task_id] for name, task_id in ids.items()} == {
        "late": "FAILED",
        "late-start": "FAILED",
        "started-late-start": "WAITING",
        "running-late": "RUNNING",
        "on-time": "WAITING",
    }
    assert due(ids["late"]) == (None, None)
    assert sweep_deadlines() == 0
