"""Least-privilege console users: a staff user who may view some models sees
none of another model's rows anywhere on the pages it may open. No embedded
panel (a task's attempts and the attempt its blockers name; a key's holders,
token history and waiting tasks; a key's policy), no name of another model's
row (a queue's, a namespace's, an application's, a plan's) and no link to a
page the user may not open; the page's own fields (the ids it stores) stay.
A superuser's pages are unchanged."""

from __future__ import annotations

import re
from itertools import count
from typing import Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from console.admin_base import key_url
from tasks.models import ConcurrencyKey, WorkerIdentity
from tests.conftest import api_client
from tests.support.api import make_queue
from tests.support.factories import ALL_SCOPES, make_credential
from tests.support.key_rows import make_policy
from tests.support.operators import make_user
from tests.support.plans import create_plan, plan_body
from tests.support.suite_cells import show_the_tests_cell
from tests.support.tasks import lease_one, start, submit_ok

pytestmark = pytest.mark.django_db

# A link to a model's console pages: (app label, model name).
ADMIN_HREF = re.compile(r'href="/admin/(\w+)/(\w+)/')
# The console's top menu: the same links for every staff user, no row's data.
TOP_MENU = re.compile(r'<nav class="orbit-nav">.*?</nav>', re.DOTALL)
USERS = count()
# Rows that record other rows in their own JSON (an audit entry's before and
# after, an event's payload): that is their own data, not a name the console
# looked up in another model's table.
OWN_RECORDS = {"orbit.AuditEntry", "orbit.Event"}


@pytest.fixture
def world(tenant: Any) -> dict[str, Any]:
    """A queue "billing" with a keyed task running (attempt on worker-1, its key
    under a policy), a sibling waiting behind the key (KEY_HELD), a task that
    depends on the running one, a task waiting on a key no lease has taken yet
    (its key has no row), a connected worker and a plan "nightly" on the queue."""
    queue = make_queue(tenant.client, "billing", max_concurrency=8, rate_per_second=50)
    policy = make_policy(tenant.namespace, key="acct/42")
    held = submit_ok(tenant.client, queue["id"], "a", concurrency_key="acct/42")
    lease = lease_one(tenant, queue["id"], worker_id="worker-1")
    assert lease["task"]["id"] == held["id"]
    start(lease)
    sibling = submit_ok(tenant.client, queue["id"], "b", concurrency_key="acct/42")
    child = submit_ok(tenant.client, queue["id"], "c", depends_on=[held["id"]])
    unleased = submit_ok(tenant.client, queue["id"], "d", concurrency_key="spare/1")
    WorkerIdentity.objects.create(
        namespace_id=tenant.namespace_id,
        worker_id="w-live",
        concurrency_keys=True,
        credential_id="0" * 32,
        session_id="1" * 32,
        connected_at=timezone.now(),
        seen_at=timezone.now(),
        queue_ids=[queue["id"]],
    )
    planner = api_client(make_credential(tenant.namespace, scopes=[*ALL_SCOPES, "plans:manage"]).token)
    plan = create_plan(planner, plan_body(queue["id"]))
    assert plan.status_code == 201, plan.content
    namespace = tenant.namespace
    return {
        "namespace": namespace,
        "queue": queue,
        "policy": policy,
        "held": held,
        "attempt_id": lease["attempt_id"],
        "sibling": sibling,
        "child": child,
        "unleased": unleased,
        "key": ConcurrencyKey.objects.get(namespace_id=namespace.id, key="acct/42"),
        # What only a row of each model says: its name, or the worker of an attempt.
        "secrets": {
            "queues.Queue": ["billing"],
            "orbit.Namespace": [f"{namespace.environment}/{namespace.name}"],
            "orbit.Application": [namespace.application.name],
            "plans.Plan": ["nightly"],
            "tasks.KeyPolicy": [policy.id],
            "tasks.Attempt": ["worker-1"],
        },
    }


def staff(*codenames: str) -> Client:
    """A staff user's console, granted these view permissions only."""
    user = make_user(f"staff-{next(USERS)}", "s@example.com", "pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    assert user.user_permissions.count() == len(codenames), codenames
    client = Client()
    client.force_login(user)
    show_the_tests_cell(client.get)
    return client


def content(client: Client, url: str) -> str:
    """The page below the top menu."""
    response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return TOP_MENU.sub("", response.content.decode())


def task_page(client: Client, task_id: str) -> str:
    return content(client, reverse("admin:tasks_task_change", args=[task_id]))


def key_page(client: Client, world: dict[str, Any]) -> str:
    return content(client, reverse("admin:tasks_concurrencykey_change", args=[world["key"].pk]))


def test_a_task_page_shows_its_attempts_only_to_users_who_may_view_attempts(operator, world):
    attempt_id = world["attempt_id"]
    tasks_only = staff("view_task")
    page = task_page(tasks_only, world["held"]["id"])
    assert 'id="task-attempts"' not in page
    assert attempt_id not in page and "worker-1" not in page and "/admin/tasks/attempt/" not in page
    # RUNNING, without the attempt that runs it
    assert 'id="task-state-meaning"' in page and "RUNNING" in page
    # its dependents are tasks: shown, without their queue's name
    assert f'data-task="{world["child"]["id"]}"' in page and "billing" not in page
    # the sibling waits behind the key: the reason, not the holder's attempt and worker
    page = task_page(tasks_only, world["sibling"]["id"])
    assert 'data-code="KEY_HELD"' in page
    assert attempt_id not in page and "worker-1" not in page and "/admin/tasks/attempt/" not in page
    assert world["held"]["id"] in page  # the holding task is a task
    # no link to the key's page either, the key itself is the task's
    assert "acct/42" in page and "/admin/tasks/concurrencykey/" not in page

    with_attempts = staff("view_task", "view_attempt")
    page = task_page(with_attempts, world["held"]["id"])
    assert 'id="task-attempts"' in page and f'data-attempt="{attempt_id}"' in page and "worker-1" in page
    page = task_page(with_attempts, world["sibling"]["id"])
    assert f'href="/admin/tasks/attempt/{attempt_id}/change/"' in page and "worker-1" in page

    # the superuser's page is unchanged
    page = task_page(operator, world["held"]["id"])
    assert 'id="task-attempts"' in page and f'data-attempt="{attempt_id}"' in page and "worker-1" in page
    assert "billing" in page and "/admin/tasks/concurrencykey/by-key/" in page
    page = task_page(operator, world["sibling"]["id"])
    assert f'href="/admin/tasks/attempt/{attempt_id}/change/"' in page and "worker-1" in page


def test_a_key_page_shows_holders_history_and_waiting_tasks_only_to_users_who_may_view_them(operator, world):
    attempt_link = f'href="/admin/tasks/attempt/{world["attempt_id"]}/change/"'
    sibling_id = world["sibling"]["id"]
    panels = ('id="key-holders"', 'id="key-token-history"', 'id="key-waiting-tasks"')

    keys_only = staff("view_concurrencykey")
    page = key_page(keys_only, world)
    for hidden in (*panels, attempt_link, sibling_id, "worker-1", world["policy"].id, "/admin/tasks/task/"):
        assert hidden not in page, hidden
    # the key's own figures stay: held, its capacity, its highest token, how many wait
    assert '<strong id="key-capacity">1</strong>' in page and 'id="key-highest-token"' in page
    assert '<strong id="key-waiting">1</strong>' in page and "held" in page
    # the key of a task no lease has taken: its waiting task is a task
    unleased = content(keys_only, key_url(world["namespace"].id, "spare/1"))
    assert world["unleased"]["id"] not in unleased and 'id="key-waiting-tasks"' not in unleased

    keys_and_attempts = staff("view_concurrencykey", "view_attempt")
    page = key_page(keys_and_attempts, world)
    assert 'id="key-holders"' in page and 'id="key-token-history"' in page and attempt_link in page
    assert "worker-1" in page and "/admin/tasks/task/" not in page and 'id="key-waiting-tasks"' not in page

    keys_and_tasks = staff("view_concurrencykey", "view_task")
    page = key_page(keys_and_tasks, world)
    assert 'id="key-waiting-tasks"' in page and f'href="/admin/tasks/task/{sibling_id}/change/"' in page
    assert 'id="key-holders"' not in page and 'id="key-token-history"' not in page and "worker-1" not in page

    page = key_page(operator, world)
    for shown in (*panels, attempt_link, sibling_id, "worker-1", world["policy"].id, "billing"):
        assert shown in page, shown


def orbit_models() -> list[type[Any]]:
    return [model for model in admin.site._registry if model._meta.app_label != "auth"]


def test_no_page_shows_another_models_rows_names_or_links_to_a_user_who_may_not_view_it(operator, world):
    """Every list and change page of every Orbit model, seen by a user who may
    view that model alone: its links go to its own pages only, and no other
    model's name (or an attempt's worker) is on it."""
    secrets: dict[str, list[str]] = world["secrets"]
    visited = 0
    for model in orbit_models():
        client = staff(f"view_{model._meta.model_name}")
        opts = model._meta
        urls = [reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")]
        urls += [
            reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk])
            for pk in model.objects.values_list("pk", flat=True)[:5]
        ]
        for url in urls:
            page = content(client, url)
            links = {(app, name) for app, name in ADMIN_HREF.findall(page)}
            assert links <= {(opts.app_label, opts.model_name)}, (url, links)
            if opts.label in OWN_RECORDS and url != urls[0]:
                continue
            for label, texts in secrets.items():
                if label != opts.label:
                    for text in texts:
                        assert text not in page, (url, label, text)
            visited += 1
    assert visited >= 20


def test_a_superuser_still_sees_every_name_and_link(operator, world):
    namespace = world["secrets"]["orbit.Namespace"][0]
    lists = {
        "tasks.Task": ["billing", "/admin/queues/queue/", "/admin/tasks/concurrencykey/by-key/"],
        "queues.Queue": [namespace, "/admin/tasks/task/?q="],
        "queues.QueueState": ["billing"],
        "plans.Plan": ["billing", namespace],
        "tasks.Attempt": ["/admin/tasks/task/", "/admin/tasks/concurrencykey/by-key/"],
        "tasks.ConcurrencyKey": ["/admin/tasks/attempt/", namespace],
        "tasks.WorkerIdentity": [namespace],
    }
    for label, texts in lists.items():
        opts = apps.get_model(label)._meta
        page = content(operator, reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"))
        for text in texts:
            assert text in page, (label, text)
    queue = content(operator, reverse("admin:queues_queue_change", args=[world["queue"]["id"]]))
    assert "its tasks" in queue and namespace in queue
    namespace_page = content(operator, reverse("admin:orbit_namespace_change", args=[world["namespace"].id]))
    assert f'<a href="/admin/orbit/application/{world["namespace"].application_id}/change/">' in namespace_page
