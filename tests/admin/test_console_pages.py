"""The console's pages, joined up for an operator: the dashboard, queues with
their backlog by state, a task with its attempts and blockers, a key with its
holder and token history; times to the millisecond, capped counts as "N+";
users and groups for superusers only; every Orbit model view-only."""

from __future__ import annotations

import re

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from console import admin_base
from tasks.models import Attempt, ConcurrencyKey, Task
from tests.support.api import make_queue
from tests.support.operators import make_user
from tests.support.suite_cells import show_the_tests_cell
from tests.support.tasks import lease_one, start, submit_ok

pytestmark = pytest.mark.django_db

MS_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


@pytest.fixture
def busy(tenant):
    """A queue with a keyed task running (its attempt started), a sibling of the
    key waiting behind it, and an unkeyed task waiting."""
    queue = make_queue(tenant.client, "billing", max_concurrency=8, rate_per_second=50)
    held = submit_ok(tenant.client, queue["id"], "a", concurrency_key="acct/42", payload={"invoice": 7})
    lease = lease_one(tenant, queue["id"], worker_id="worker-1")
    assert lease["task"]["id"] == held["id"]
    start(lease)
    sibling = submit_ok(tenant.client, queue["id"], "b", concurrency_key="acct/42")
    plain = submit_ok(tenant.client, queue["id"], "c")
    return {"queue": queue, "held": held, "lease": lease, "sibling": sibling, "plain": plain}


def test_the_dashboard_is_the_first_page_and_charts_every_queue(operator, busy):
    page = operator.get("/admin/").content.decode()
    assert 'id="orbit-dashboard"' in page
    assert '<meta http-equiv="refresh" content="5">' in page
    assert 'data-state="WAITING" data-count="2"' in page and 'data-state="RUNNING" data-count="1"' in page
    assert "billing" in page and "1 of 8" in page
    # The start was counted by the rollup in its own transaction: one start this minute.
    assert 'class="orbit-start"' in page and "1 starts" in page
    assert MS_TIME.search(page)


def test_the_queue_list_shows_the_backlog_by_state_permits_window_and_age(operator, busy):
    page = operator.get("/admin/queues/queue/").content.decode()
    row = page[page.index("billing") :]
    for text in ("running", "1 of 8", "1 of 50/s", " s<", "?q=" + busy["queue"]["id"]):
        assert text in row, text
    cl = operator.get("/admin/queues/queue/").context["cl"]
    (queue,) = cl.result_list
    assert (queue.console.waiting, queue.console.leased, queue.console.running, queue.console.needs_review) == (
        2,
        0,
        1,
        0,
    )
    assert queue.console.oldest_waiting_at is not None


def test_the_oldest_waiting_age_reads_the_dispatch_index_only(operator, busy):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from console.data import oldest_waiting

    with CaptureQueriesContext(connection) as queries:
        found = oldest_waiting([busy["queue"]["id"]])
    assert found[busy["queue"]["id"]] == Task.objects.get(id=busy["sibling"]["id"]).available_at
    (sql,) = [q["sql"] for q in queries.captured_queries]
    assert sql.count("LIMIT 1") == 20  # one per (key_ready, priority) range of idx_task_dispatch


def test_a_task_page_has_its_attempts_links_blockers_and_readable_json(operator, busy):
    held = operator.get(f"/admin/tasks/task/{busy['held']['id']}/change/").content.decode()
    attempt = Attempt.objects.get(task_id=busy["held"]["id"])
    assert f'data-attempt="{attempt.id}"' in held
    assert "worker-1" in held and str(attempt.concurrency_token) in held
    assert "The task is <strong>RUNNING</strong>" in held
    assert "&quot;invoice&quot;: 7" in held  # pretty JSON: indented, key: value
    assert reverse("admin:queues_queue_change", args=[busy["queue"]["id"]]) in held
    assert "by-key/?namespace=" in held and "acct%2F42" in held
    assert MS_TIME.search(held)
    created = Task.objects.get(id=busy["held"]["id"]).created_at
    assert admin_base.format_ms(created) in held  # the task's own fields too, as the API writes them
    sibling = operator.get(f"/admin/tasks/task/{busy['sibling']['id']}/change/").content.decode()
    assert 'data-code="KEY_HELD"' in sibling
    plain = operator.get(f"/admin/tasks/task/{busy['plain']['id']}/change/").content.decode()
    assert 'data-code="NO_WORKER"' in plain


def test_a_key_page_names_its_holder_token_and_history(operator, busy):
    attempt = Attempt.objects.get(task_id=busy["held"]["id"])
    row = ConcurrencyKey.objects.get(key="acct/42")
    task_page = operator.get(f"/admin/tasks/task/{busy['held']['id']}/change/").content.decode()
    by_key = re.search(r'href="([^"]*by-key/[^"]*)"', task_page).group(1).replace("&amp;", "&")
    response = operator.get(by_key)
    assert response.status_code == 302 and response.url == reverse("admin:tasks_concurrencykey_change", args=[row.pk])
    page = operator.get(response.url).content.decode()
    assert f'id="key-holder-attempt">{attempt.id}<' in page
    assert "worker-1" in page and f'data-token="{attempt.concurrency_token}"' in page
    assert f'id="key-highest-token">{row.version}<' in page
    assert 'id="key-waiting">1<' in page
    attempt_page = operator.get(f"/admin/tasks/attempt/{attempt.id}/change/").content.decode()
    assert "by-key/?namespace=" in attempt_page


def test_a_key_before_its_first_lease_has_a_page_too(operator, tenant):
    queue = make_queue(tenant.client)
    task = submit_ok(tenant.client, queue["id"], "k", concurrency_key="fresh key")
    page = operator.get(f"/admin/tasks/task/{task['id']}/change/").content.decode()
    by_key = re.search(r'href="([^"]*by-key/[^"]*)"', page).group(1).replace("&amp;", "&")
    unleased = operator.get(by_key).content.decode()
    assert "no lease has taken its permit yet" in unleased and 'id="key-waiting">1<' in unleased
    assert operator.get(by_key.replace("fresh", "stale")).status_code == 404


def test_capped_counts_read_with_a_plus(operator, tenant, monkeypatch):
    queue = make_queue(tenant.client)
    for n in range(4):
        submit_ok(tenant.client, queue["id"], f"t-{n}")
    monkeypatch.setattr(admin_base, "ADMIN_ROW_CAP", 3)
    assert "3+ tasks" in operator.get("/admin/tasks/task/").content.decode()
    monkeypatch.setattr(admin_base, "ADMIN_ROW_CAP", 10_000)
    assert "4 tasks" in operator.get("/admin/tasks/task/").content.decode()
    assert admin_base.count_text(10_000, True) == "10,000+"


def test_users_and_groups_are_for_superusers_only(operator, client):
    assert operator.get("/admin/auth/user/").status_code == 200
    assert operator.get("/admin/auth/group/add/").status_code == 200
    staff = make_user("staff", "s@example.com", "pw", is_staff=True)
    staff.user_permissions.set(Permission.objects.filter(content_type__app_label__in=["auth", "tasks", "queues"]))
    client.force_login(staff)
    assert client.get("/admin/auth/user/").status_code == 403
    assert client.get("/admin/auth/group/").status_code == 403
    assert client.post("/admin/auth/user/add/", {"username": "x"}).status_code == 403
    assert "auth/user" not in client.get("/admin/").content.decode()
    assert client.get("/admin/tasks/task/").status_code == 200  # Orbit's models: view only
    assert client.get("/admin/tasks/task/add/").status_code == 403


def test_every_orbit_model_refuses_add_change_and_delete(operator, busy):
    orbit_apps = {"orbit", "queues", "tasks", "workers", "plans"}
    checked = 0
    for model in admin.site._registry:
        opts = model._meta
        if opts.app_label not in orbit_apps:
            continue
        base = f"/admin/{opts.app_label}/{opts.model_name}/"
        assert operator.get(base + "add/").status_code == 403, base
        assert operator.post(base + "add/", {}).status_code == 403, base
        obj = model.objects.first()
        if obj is None:
            continue
        page = operator.get(f"{base}{obj.pk}/change/")
        assert page.status_code == 200, base
        assert 'name="_save"' not in page.content.decode() and "deletelink" not in page.content.decode(), base
        assert operator.post(f"{base}{obj.pk}/change/", {}).status_code == 403, base
        assert operator.post(f"{base}{obj.pk}/delete/", {"post": "yes"}).status_code == 403, base
        assert model.objects.filter(pk=obj.pk).exists()
        checked += 1
    assert checked >= 8


def test_the_dashboard_shows_queues_only_to_users_who_may_view_them(operator, busy):
    """Issue 35 (6): a staff user with no permission saw every queue's name and figures."""
    queue_id = busy["queue"]["id"]
    staff = make_user("nobody", "n@example.com", "pw", is_staff=True)
    client = Client()  # the operator fixture's client stays the superuser's
    client.force_login(staff)
    show_the_tests_cell(client.get)
    page = client.get("/admin/").content.decode()
    for secret in ("billing", queue_id, "1 of 8", 'data-state="WAITING"', "NEEDS_REVIEW", "1 starts"):
        assert secret not in page
    assert 'id="orbit-dashboard-hidden"' in page and 'id="orbit-dashboard"' not in page
    assert client.get(f"/admin/queues/queue/{queue_id}/change/").status_code == 403  # as the dashboard says
    # granted queues but not tasks: the figures, without the links to the queue's tasks
    staff.user_permissions.set(Permission.objects.filter(codename="view_queue"))
    page = client.get("/admin/").content.decode()
    assert "billing" in page and "1 of 8" in page and "NEEDS_REVIEW 0" in page
    assert f"/admin/tasks/task/?q={queue_id}" not in page and "/admin/tasks/task/?state__exact" not in page
    # a superuser sees everything, links included
    page = operator.get("/admin/").content.decode()
    assert "billing" in page and queue_id in page and f"/admin/tasks/task/?q={queue_id}" in page
