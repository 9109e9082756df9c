"""Dependencies (SPEC §13) through a task's whole life: BLOCKED tasks under
deadlines, quotas and backpressure, review, a parent retried after its lease
expired, RUN joins, and a follow-up cut short by a crash."""

from __future__ import annotations

from typing import Any

import pytest

from orbit.fields import new_id
from orbit.models import ApplicationState, Event
from orbit.principal import Actor, authenticate_token, known_credential
from queues.models import QueueState
from tasks.actions.batch import checked_submission
from tasks.actions.endings import ResultReport
from tasks.actions.rounds import SubmitRequest, run_round
from tasks.models import Task
from tests.conftest import Tenant
from tests.support.api import make_queue
from tests.support.tasks import (
    assert_invariants,
    lease_one,
    start,
    submit_ok,
    task_body,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def queue(tenant):
    return make_queue(tenant.client, max_concurrency=100, rate_per_second=1000)


def row(task_id: str) -> Task:
    return Task.objects.get(id=task_id)


def moves(task_id: str) -> list[tuple[str, str | None]]:
    """The task's state changes, as (state, previous), in event order."""
    events = Event.objects.filter(subject_id=task_id, type="task.state_changed").order_by("seq")
    return [(e.data["state"], e.data.get("previous")) for e in events]


def submit_request(tenant: Tenant, key: str, body: dict[str, Any]) -> SubmitRequest:
    actor = Actor(principal=authenticate_token(tenant.token), request_id=new_id())
    return SubmitRequest(actor, checked_submission(actor, key, body), known_credential(tenant.token))


def test_blocked_tasks_are_unfinished_for_the_counters(tenant, queue):
    parent = submit_ok(tenant.client, queue["id"], "parent")
    submit_ok(tenant.client, queue["id"], "child", depends_on=[parent["id"]])
    assert QueueState.objects.get(queue_id=queue["id"]).unfinished_tasks == 2
    assert ApplicationState.objects.get(application_id=tenant.namespace.application_id).unfinished_tasks == 2
    assert_invariants()


def test_a_child_submitted_in_the_round_that_ends_its_parent_is_settled(tenant, queue):
    # given a running parent
    parent = submit_ok(tenant.client, queue["id"], "parent")
    lease = lease_one(tenant, queue["id"])
    start(lease)
    # when one round admits a child of it and records the parent's success
    child_request = submit_request(tenant, "child", task_body(queue["id"], depends_on=[parent["id"]]))
    result = ResultReport(lease["worker"], lease["attempt_id"], lease["epoch"], "SUCCEEDED", False, {"v": 1}, None)
    receipt, outcome = run_round([child_request, result])
    # then the child, admitted BLOCKED behind the running parent, is WAITING with it
    assert outcome == {"task_state": "SUCCEEDED", "duplicate": False, "late": False}
    child_id = receipt.data["task"]["id"]
    assert row(child_id).state == "WAITING"
    assert moves(child_id) == [("BLOCKED", None), ("WAITING", "BLOCKED")]
    assert_invariants()
