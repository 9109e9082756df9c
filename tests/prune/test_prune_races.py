"""A task a plan made goes with the CREATED trigger that names it
(docs/decisions.md Retention), never one without the other, also when the
plan fires, and its task finishes, while the prune runs (a short bound, as
`--finished-before 0s`): a task that ends during the run is newer than the
bound. And a dependent submitted (alone or in
a batch) inside a prune's batch transaction, between its dependents check and
its DELETE, waits for the application lock and is refused: never admitted
with its dependency pruned."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import call_command

from plans.actions import fire_due_plans
from plans.models import PlanTrigger, PlanVersion
from tasks.invariants import find_violations, plan_trigger_violations
from tasks.management.commands import orbit_prune
from tasks.models import Task
from tests.conftest import Tenant, api_client
from tests.support.api import assert_ok, make_queue
from tests.support.factories import ALL_SCOPES, make_credential
from tests.support.plans import create_plan, plan_body
from tests.support.tasks import cancel


def prune(*args: str) -> str:
    out = io.StringIO()
    call_command("orbit_prune", *args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_a_plan_task_goes_with_its_trigger_also_when_it_finishes_during_a_prune(tenant, monkeypatch):
    issued = make_credential(tenant.namespace, scopes=[*ALL_SCOPES, "plans:manage"])
    planner = Tenant(namespace=tenant.namespace, token=issued.token, client=api_client(issued.token))
    queue = make_queue(planner.client, "q", rate_per_second=100_000)
    plan = assert_ok(create_plan(planner.client, plan_body(queue["id"], name="p", misfire={"policy": "SKIP"})), 201)
    plan_id = plan["plan"]["id"]
    anchor = PlanVersion.objects.get(plan_id=plan_id, version=1).anchor_at

    def fire_and_finish(minute: int) -> str:
        assert fire_due_plans(anchor + timedelta(seconds=60 * minute + 1)) == 1
        task_id = PlanTrigger.objects.filter(plan_id=plan_id, outcome="CREATED").order_by("-scheduled_at")[0].task_id
        # The point's task is not available before its time: it ends by a cancel.
        assert cancel(planner.client, task_id, f"cancel-{minute}").status_code == 200
        assert Task.objects.get(id=task_id).state == "CANCELLED"
        return task_id

    first = fire_and_finish(1)
    assert "would remove 1 tasks" in prune("--finished-before", "0s", "--dry-run")
    assert PlanTrigger.objects.filter(task_id=first).exists()
    assert "removed 1 tasks" in prune("--finished-before", "0s")
    assert not Task.objects.filter(id=first).exists()
    assert not PlanTrigger.objects.filter(task_id=first).exists()

    # The plan fires, and its task ends, after the prune began (before its walk of
    # the task table): the task is newer than the bound and stays, with its trigger.
    real_batches = orbit_prune.batches
    made = []

    def batches_then_fire(model, fields, size):
        if model is Task and not made:
            made.append(fire_and_finish(2))
        return real_batches(model, fields, size)

    monkeypatch.setattr(orbit_prune, "batches", batches_then_fire)
    prune("--finished-before", "0s")
    assert Task.objects.filter(id=made[0]).exists()
    assert PlanTrigger.objects.filter(task_id=made[0]).exists()
    # An unfinished plan task is kept, and the plan's point cursor is untouched.
    monkeypatch.setattr(orbit_prune, "batches", real_batches)
    assert fire_due_plans(anchor + timedelta(seconds=60 * 3 + 1)) == 1
    waiting = PlanTrigger.objects.filter(plan_id=plan_id).order_by("-scheduled_at")[0].task_id
    assert "removed 1 tasks" in prune("--finished-before", "0s")  # the one that ended during the last run
    assert list(PlanTrigger.objects.filter(plan_id=plan_id).values_list("task_id", flat=True)) == [waiting]
    assert Task.objects.get(id=waiting).state == "WAITING"
    assert plan_trigger_violations() == []
    assert find_violations() == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["single", "batch"])
def test_a_dependent_submitted_inside_a_prune_batch_never_loses_its_parent(path, monkeypatch):
    """The prune's batch has checked the parent's dependents (none) and not yet
    deleted it; a submit (or a batch item) naming the parent arrives then. It
    must wait for the prune (application_state lock) and be refused, or be
    admitted and keep its parent: never an unfinished task whose dependency
    is gone."""
    import threading

    from tests.conftest import post_json
    from tests.support.factories import NamespaceFactory
    from tests.support.tasks import submit, submit_ok, task_body

    namespace = NamespaceFactory()
    token = make_credential(namespace).token
    tenant = Tenant(namespace=namespace, token=token, client=api_client(token))
    queue = make_queue(tenant.client, "q", rate_per_second=100_000)
    parent = submit_ok(tenant.client, queue["id"], "parent")
    assert cancel(tenant.client, parent["id"], "cancel-parent").status_code == 200
    answers = []

    def child_submit() -> None:
        from django.db import connection

        try:
            client = api_client(token)
            if path == "single":
                response = submit(client, queue["id"], "child", depends_on=[parent["id"]])
                answers.append((response.status_code, response.json()))
            else:
                items = [{"idempotency_key": "child", "task": task_body(queue["id"], depends_on=[parent["id"]])}]
                response = post_json(client, "/v1/tasks:batch", {"tasks": items})
                result = response.json()["data"]["results"][0]
                answers.append((result["status"], result))
        finally:
            connection.close()

    real_held = orbit_prune.held_by_dependents
    threads = []

    def held_then_submit(task_ids):
        held = real_held(task_ids)
        if parent["id"] in task_ids and not threads:
            thread = threading.Thread(target=child_submit, daemon=True)
            threads.append(thread)
            thread.start()
            thread.join(timeout=3)  # it finishes now unless it waits for this transaction's lock
        return held

    monkeypatch.setattr(orbit_prune, "held_by_dependents", held_then_submit)
    prune("--finished-before", "0s")
    threads[0].join(timeout=20)
    assert not threads[0].is_alive()
    (status, body) = answers[0]
    child_rows = list(
        Task.objects.filter(namespace_id=namespace.id, depends_on__isnull=False).values_list("id", "state")
    )
    parent_there = Task.objects.filter(id=parent["id"]).exists()
    assert not (child_rows and not parent_there), f"child {child_rows} admitted, its dependency pruned ({status})"
    assert find_violations() == []
