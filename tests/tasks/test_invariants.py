"""`manage.py orbit_check` (tasks.invariants) finds drift: each case tampers
with the rows the way a bug or an operator's hand could, and the check names it."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from orbit.models import ApplicationState
from queues.models import QueueState
from tasks.actions import rounds
from tasks.models import ConcurrencyKey, Task
from tests.support.api import make_queue
from tests.support.suite_cells import without_cell
from tests.support.tasks import submit_ok, worker_for

pytestmark = pytest.mark.django_db(transaction=True)  # orbit_check reads in a transaction of its own


def check() -> tuple[str, list[str]]:
    """orbit_check's answer: "ok" or the drift it reported, line by line."""
    errors = io.StringIO()
    try:
        call_command("orbit_check", stdout=io.StringIO(), stderr=errors)
    except CommandError:
        return "drift", without_cell(errors.getvalue().splitlines())
    return "ok", []


@pytest.fixture
def worked(tenant):
    """A queue where one keyed task ran to the end (token 1) and a second one was
    started (token 3: a release advances the key too, RUNNING): every counter, key row and token in use."""
    queue = make_queue(tenant.client, "checked", max_concurrency=5, rate_per_second=100)
    worker = worker_for(tenant, queue["id"])
    for n in (1, 2):
        submit_ok(tenant.client, queue["id"], f"t-{n}", concurrency_key="obj/1")
        (assignment,) = rounds.lease_tasks(worker=worker, limit=1)
        ref = {"attempt_id": assignment["attempt_id"], "epoch": assignment["epoch"]}
        rounds.approve_start(worker=worker, **ref)
        if n == 1:
            rounds.record_result(worker=worker, outcome="SUCCEEDED", retryable=False, output=None, error=None, **ref)
    assert check() == ("ok", [])
    return queue, Task.objects.get(state="RUNNING")


def test_a_counter_off_by_one_is_named(worked):
    queue, _ = worked
    QueueState.objects.filter(queue_id=queue["id"]).update(active_permits=2)
    assert check() == ("drift", [f"queue {queue['id']}: active_permits=2 but rows say 1"])


def test_a_deleted_key_row_is_found_before_it_can_issue_token_1_again(worked):
    queue, task = worked
    ConcurrencyKey.objects.filter(key="obj/1").delete()
    status, problems = check()
    assert status == "drift"
    assert f"key {(task.namespace_id, 'obj/1')}: tokens issued up to 3 but it has no key row" in problems


@pytest.mark.parametrize("model", [QueueState, ApplicationState])
def test_a_missing_counter_row_is_named(worked, model):
    queue, task = worked
    if model is QueueState:
        QueueState.objects.filter(queue_id=queue["id"]).delete()
        expected = f"queue {queue['id']}: has no queue_state row"
    else:
        ApplicationState.objects.filter(application_id=task.application_id).delete()
        expected = f"application {task.application_id}: has no application_state row"
    status, problems = check()
    assert status == "drift" and expected in problems


def test_a_task_counting_attempts_it_never_started_is_named(worked):
    _, task = worked
    Task.objects.filter(id=task.id).update(attempts=7)
    assert check() == ("drift", [f"task {task.id}: attempts=7 but 1 attempts were started"])


def test_an_event_sequence_behind_its_events_is_named(worked, tenant):
    from orbit.models import EventSequence

    EventSequence.objects.filter(namespace_id=tenant.namespace.id).update(last_seq=1)
    outcome, lines = check()
    assert outcome == "drift"
    named = f"namespace {tenant.namespace.id}: events up to cursor"
    assert any(named in line and line.endswith("sequence at 1") for line in lines), lines
