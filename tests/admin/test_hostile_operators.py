"""The console (Django's test client, no browser): values a
tenant writes, shown on console pages the hostile-values suite does not visit
(plan versions, audit entries, events, attempts); the admin's read-only
promise under raw POSTs; the login's handling of an unsafe `next`."""

from __future__ import annotations

import html
import re

import pytest

from orbit.models import AuditEntry, Credential, Event
from plans.models import Plan, PlanVersion
from tasks.models import Attempt, KeyPolicy, Task
from tests.conftest import Tenant, api_client
from tests.support.api import assert_ok, make_queue
from tests.support.factories import ALL_SCOPES, NamespaceFactory, make_credential
from tests.support.key_policies import create_ok
from tests.support.plans import TASK, create_plan, plan_body
from tests.support.tasks import lease_one, report, start, submit_ok

RTL_OVERRIDE = "\u202e"


@pytest.fixture
def planner(db: None) -> Tenant:
    """A tenant whose credential also holds plans:manage."""
    namespace = NamespaceFactory()
    token = make_credential(namespace, scopes=[*ALL_SCOPES, "plans:manage"]).token
    return Tenant(namespace=namespace, token=token, client=api_client(token))


SPOOF = RTL_OVERRIDE + "0001 DSU"  # reads "USD 1000"


def readonly_values(page: str) -> list[str]:
    """The text of every read-only field of a change page (Django's <div class="readonly">)."""
    return [html.unescape(value) for value in re.findall(r'<div class="readonly">(.*?)</div>', page, re.S)]


def spoofed(operator, url: str) -> list[str]:
    """The read-only fields of the page at `url` that hold a raw direction override."""
    response = operator.get(url)
    assert response.status_code == 200, url
    return [value[:120] for value in readonly_values(response.content.decode()) if RTL_OVERRIDE in value]


@pytest.mark.django_db
def test_json_fields_on_every_page_show_a_direction_override_as_its_escape(operator, planner):
    """The task page writes U+202E inside its JSON panels as `\\u202e`
    (templatetags.pretty_json): "\\u202e0001 DSU" must not read "USD 1000", and
    the console's own JSON keys after it must not be drawn reversed. The plan
    version's definition, an audit entry's before/after, an event's data and an
    attempt's output and error are JSON a planner writes too, shown by
    Django's default display with the override raw."""
    queue = make_queue(planner.client, "bidi")
    task = {**TASK, "payload": {"amount": SPOOF}}
    plan = assert_ok(create_plan(planner.client, plan_body(queue["id"], "bidi-plan", definition={"task": task})), 201)[
        "plan"
    ]
    submit_ok(planner.client, queue["id"], "bidi-task", payload={"amount": SPOOF})
    lease = lease_one(planner, queue["id"], worker_id="bidi-worker")
    start(lease)
    report(lease, "SUCCEEDED", output={"amount": SPOOF})

    version = PlanVersion.objects.get(plan_id=plan["id"])
    audit = AuditEntry.objects.filter(target_id=plan["id"]).latest("id")
    event = Event.objects.filter(subject_id=plan["id"]).latest("id")
    attempt = Attempt.objects.get(task_id=lease["task"]["id"])
    pages = {
        "plan version": f"/admin/plans/planversion/{version.pk}/change/",
        "audit entry": f"/admin/orbit/auditentry/{audit.pk}/change/",
        "event": f"/admin/orbit/event/{event.pk}/change/",
        "attempt": f"/admin/tasks/attempt/{attempt.pk}/change/",
    }
    raw = {name: found for name, url in pages.items() if (found := spoofed(operator, url))}
    assert raw == {}, f"pages showing a raw U+202E in a JSON field: {raw}"


@pytest.mark.django_db
def test_no_orbit_model_can_be_added_changed_or_deleted_by_raw_posts(operator, planner):
    """Every Orbit model's add, change and delete views, and the list's
    bulk delete action, refuse a superuser's well-formed POST; nothing moves."""
    queue = make_queue(planner.client, "ro")
    task = submit_ok(planner.client, queue["id"], "ro-1")
    plan = assert_ok(create_plan(planner.client, plan_body(queue["id"], "ro-plan")), 201)["plan"]
    policy = create_ok(planner.client, key="ro-policy", match={"prefix": "ro/"}, capacity=2)
    rows = {
        "tasks/task": (Task, task["id"]),
        "plans/plan": (Plan, plan["id"]),
        "tasks/keypolicy": (KeyPolicy, policy["id"]),
        "orbit/credential": (Credential, Credential.objects.filter(namespace_id=planner.namespace_id).first().pk),
        "orbit/auditentry": (AuditEntry, AuditEntry.objects.filter(target_id=plan["id"]).first().pk),
    }
    before = {name: model.objects.count() for name, (model, _) in rows.items()}
    for name, (model, pk) in rows.items():
        base = f"/admin/{name}/"
        assert operator.post(f"{base}add/", {"name": "x"}).status_code == 403, name
        assert operator.post(f"{base}{pk}/change/", {"name": "x", "_save": "Save"}).status_code == 403, name
        assert operator.post(f"{base}{pk}/delete/", {"post": "yes"}).status_code == 403, name
        bulk = operator.post(base, {"action": "delete_selected", "_selected_action": [pk], "post": "yes"})
        assert bulk.status_code in (200, 302, 400), (name, bulk.status_code)
        assert model.objects.filter(pk=pk).exists(), name
    assert {name: model.objects.count() for name, (model, _) in rows.items()} == before
    # No page offers a way to write: no save button, no delete link, no actions.
    for name, (_, pk) in rows.items():
        page = operator.get(f"/admin/{name}/{pk}/change/").content.decode()
        assert 'name="_save"' not in page and "deletelink" not in page, name
        assert 'name="action"' not in operator.get(f"/admin/{name}/").content.decode(), name


@pytest.mark.django_db
def test_a_credentials_page_shows_no_secret(operator, tenant):
    credential = Credential.objects.filter(namespace_id=tenant.namespace_id).first()
    page = operator.get(f"/admin/orbit/credential/{credential.pk}/change/").content.decode()
    listing = operator.get("/admin/orbit/credential/").content.decode()
    secret = tenant.token.split("_", 2)[2]  # orb_<id>_<secret>; the secret may hold "_" itself
    for text in (page, listing):
        assert credential.secret_hash not in text
        assert secret not in text
    # Neither sortable nor filterable by the hash (an oracle on its bytes).
    assert operator.get("/admin/orbit/credential/?secret_hash__startswith=a").status_code == 400


@pytest.mark.django_db
@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "javascript:alert(1)"])
def test_a_login_with_an_unsafe_next_lands_on_the_console(client, target):
    """Django refuses an off-site `next` (good), then sends the operator to
    settings.LOGIN_REDIRECT_URL, whose default /accounts/profile/ is no page of
    Orbit's: the operator lands on the API's JSON 404 'no such endpoint'."""
    from tests.support.operators import make_user

    make_user("audit-op", "op@example.com", "audit-pw-1", superuser=True)
    response = client.post("/admin/login/", {"username": "audit-op", "password": "audit-pw-1", "next": target})
    assert response.status_code == 302
    assert "evil.example" not in response["Location"] and "javascript" not in response["Location"]
    assert response["Location"] == "/admin/", f"redirected to {response['Location']}"
