"""GET /v1/applications/{id} and :configure: the application's quotas across
all its namespaces (SPEC §7), and that submits and leases obey them."""

from __future__ import annotations

import pytest

from orbit.models import Application, AuditEntry, Event, IdempotencyRecord
from tasks.actions import rounds
from tests.conftest import Tenant, api_client, post_json
from tests.support.api import assert_error, assert_invalid, assert_ok, make_queue
from tests.support.factories import ALL_SCOPES, NamespaceFactory, make_credential
from tests.support.race import race
from tests.support.tasks import counters, submit, submit_ok, worker_for

APPLICATION_KEYS = {
    "id",
    "name",
    "max_active_attempts",
    "max_unfinished_tasks",
    "active_attempts",
    "unfinished_tasks",
    "revision",
}


@pytest.fixture
def manager(tenant: Tenant) -> Tenant:
    """A credential of the tenant's namespace that also holds applications:manage."""
    issued = make_credential(tenant.namespace, scopes=[*ALL_SCOPES, "applications:manage"])
    return Tenant(namespace=tenant.namespace, token=issued.token, client=api_client(issued.token))


def configure_body(revision: str = "1", **overrides: object) -> dict:
    return {
        "expected_revision": revision,
        "reason": "cap the batch tenant",
        "max_active_attempts": 3,
        "max_unfinished_tasks": 2,
        **overrides,
    }


def configure(client, application_id: str, body: object, key: str = "app-configure-1"):
    return post_json(client, f"/v1/applications/{application_id}:configure", body, key=key)


@pytest.mark.django_db
def test_get_shows_quotas_and_live_counters(manager):
    application_id = manager.namespace.application_id
    queue = make_queue(manager.client)
    submit_ok(manager.client, queue["id"], "one")
    data = assert_ok(manager.client.get(f"/v1/applications/{application_id}"))
    assert set(data) == APPLICATION_KEYS
    assert data["id"] == application_id
    assert data["max_active_attempts"] == 100_000 and data["max_unfinished_tasks"] == 10_000_000
    assert (data["active_attempts"], data["unfinished_tasks"], data["revision"]) == ("0", "1", "1")


@pytest.mark.django_db
def test_configure_replaces_quotas_audits_and_replays(manager):
    application_id = manager.namespace.application_id
    first = configure(manager.client, application_id, configure_body())
    data = assert_ok(first)
    assert set(data) == {"application", "deduplicated"} and set(data["application"]) == APPLICATION_KEYS
    assert data["deduplicated"] is False
    assert data["application"]["max_active_attempts"] == 3
    assert data["application"]["max_unfinished_tasks"] == 2
    assert data["application"]["revision"] == "2"
    row = Application.objects.get(id=application_id)
    assert (row.max_active_attempts, row.max_unfinished_tasks, row.revision) == (3, 2, 2)
    audit = AuditEntry.objects.get(action="application.configured")
    assert audit.target_id == application_id and audit.reason == "cap the batch tenant"
    assert audit.before["revision"] == "1" and audit.after["revision"] == "2"
    assert Event.objects.filter(type="application.configured", subject_id=application_id).count() == 1

    replay = configure(manager.client, application_id, configure_body())
    assert replay.status_code == 200
    assert replay.json()["data"] == {**first.json()["data"], "deduplicated": True}
    assert Application.objects.get(id=application_id).revision == 2
    assert AuditEntry.objects.filter(action="application.configured").count() == 1

    other_body = configure(manager.client, application_id, configure_body(max_active_attempts=4))
    assert_error(other_body, 409, "IDEMPOTENCY_CONFLICT")
    stale = configure(manager.client, application_id, configure_body("1"), key="app-configure-2")
    message = assert_error(stale, 409, "STATE_CONFLICT")
    assert message == "expected_revision 1 does not match current revision 2"
    assert IdempotencyRecord.objects.filter(key="app-configure-2").count() == 0


@pytest.mark.django_db
def test_other_applications_are_not_found_and_scope_is_required(tenant, manager):
    stranger = NamespaceFactory()  # another application
    for application_id in (stranger.application_id, "0" * 32, "ABC", "x" * 300):
        assert_error(manager.client.get(f"/v1/applications/{application_id}"), 404, "NOT_FOUND")
        assert_error(configure(manager.client, application_id, configure_body()), 404, "NOT_FOUND")
    own = tenant.namespace.application_id
    message = assert_error(tenant.client.get(f"/v1/applications/{own}"), 403, "PERMISSION_DENIED")
    assert "applications:manage" in message
    assert_error(configure(tenant.client, own, configure_body()), 403, "PERMISSION_DENIED")
    assert_error(api_client(None).get(f"/v1/applications/{own}"), 401, "UNAUTHENTICATED")
    assert Application.objects.get(id=stranger.application_id).revision == 1


def without(field: str) -> dict:
    body = configure_body()
    del body[field]
    return body


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "body"),
    [
        ("expected_revision", without("expected_revision")),
        ("expected_revision", configure_body(1)),
        ("expected_revision", configure_body("0")),
        ("expected_revision", configure_body("01")),
        ("reason", without("reason")),
        ("reason", configure_body(reason="  ")),
        ("reason", configure_body(reason="a" * 1025)),
        ("max_active_attempts", without("max_active_attempts")),
        ("max_active_attempts", configure_body(max_active_attempts=0)),
        ("max_active_attempts", configure_body(max_active_attempts=1_000_001)),
        ("max_active_attempts", configure_body(max_active_attempts="3")),
        ("max_active_attempts", configure_body(max_active_attempts=None)),
        ("max_active_attempts", configure_body(max_active_attempts=3.0)),
        ("max_unfinished_tasks", without("max_unfinished_tasks")),
        ("max_unfinished_tasks", configure_body(max_unfinished_tasks=0)),
        ("max_unfinished_tasks", configure_body(max_unfinished_tasks=100_000_001)),
        ("max_unfinished_tasks", configure_body(max_unfinished_tasks=True)),
        ("paused", configure_body(paused=False)),  # unknown field
    ],
)
def test_invalid_configure_names_the_field(manager, field, body):
    application_id = manager.namespace.application_id
    assert_invalid(configure(manager.client, application_id, body), field)
    assert Application.objects.get(id=application_id).revision == 1
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.django_db
def test_bounds_are_accepted(manager):
    application_id = manager.namespace.application_id
    body = configure_body(max_active_attempts=1_000_000, max_unfinished_tasks=100_000_000)
    data = assert_ok(configure(manager.client, application_id, body))["application"]
    assert (data["max_active_attempts"], data["max_unfinished_tasks"]) == (1_000_000, 100_000_000)
    body = configure_body("2", max_active_attempts=1, max_unfinished_tasks=1)
    assert assert_ok(configure(manager.client, application_id, body, key="k2"))["application"]["revision"] == "3"


@pytest.mark.django_db
def test_unfinished_quota_spans_namespaces_and_lowering_keeps_what_is_held(manager):
    """max_unfinished_tasks counts the application's tasks in every namespace;
    tasks already accepted stay when it is lowered below them."""
    application_id = manager.namespace.application_id
    sibling_namespace = NamespaceFactory(application=manager.namespace.application)
    sibling = api_client(make_credential(sibling_namespace).token)
    here, there = make_queue(manager.client), make_queue(sibling)
    for n in range(3):
        submit_ok(manager.client, here["id"], f"before-{n}")
    assert_ok(configure(manager.client, application_id, configure_body(max_unfinished_tasks=4)))
    submit_ok(sibling, there["id"], "fourth")
    message = assert_error(submit(sibling, there["id"], "fifth"), 429, "QUEUE_FULL")
    assert message == "queue unfinished task limit reached; retry later using the original identity"
    assert_error(submit(manager.client, here["id"], "fifth-here"), 429, "QUEUE_FULL")
    lowered = configure_body("2", max_unfinished_tasks=1)
    assert (
        assert_ok(configure(manager.client, application_id, lowered, key="lower"))["application"]["unfinished_tasks"]
        == "4"
    )
    assert counters(here["id"])["unfinished_tasks"] == 3
    assert counters(there["id"])["unfinished_tasks"] == 1


@pytest.mark.django_db
def test_active_quota_bounds_leases_across_namespaces(manager):
    application_id = manager.namespace.application_id
    sibling_namespace = NamespaceFactory(application=manager.namespace.application)
    sibling_issued = make_credential(sibling_namespace)
    sibling = api_client(sibling_issued.token)
    here, there = make_queue(manager.client), make_queue(sibling)
    for n in range(4):
        submit_ok(manager.client, here["id"], f"here-{n}")
        submit_ok(sibling, there["id"], f"there-{n}")
    assert_ok(
        configure(manager.client, application_id, configure_body(max_active_attempts=3, max_unfinished_tasks=100))
    )
    leased_here = rounds.lease_tasks(worker=worker_for(manager, here["id"]), limit=2)
    sibling_tenant = Tenant(namespace=sibling_namespace, token=sibling_issued.token, client=sibling)
    leased_there = rounds.lease_tasks(worker=worker_for(sibling_tenant, there["id"]), limit=4)
    assert (len(leased_here), len(leased_there)) == (2, 1)
    assert rounds.lease_tasks(worker=worker_for(manager, here["id"]), limit=4) == []
    data = assert_ok(manager.client.get(f"/v1/applications/{application_id}"))
    assert data["active_attempts"] == "3"


@pytest.mark.django_db(transaction=True)
def test_concurrent_configures_at_one_revision_make_one_change(manager):
    """Twelve configures at revision 1 under distinct keys, sent at once: the
    row lock lets exactly one through; the others see revision 2 and store nothing."""
    application_id = manager.namespace.application_id

    def send(n: int) -> int:
        body = configure_body(max_active_attempts=10 + n)
        return configure(api_client(manager.token), application_id, body, key=f"race-{n}").status_code

    statuses = race(12, send)
    assert sorted(statuses) == [200] + [409] * 11
    row = Application.objects.get(id=application_id)
    assert row.revision == 2 and row.max_active_attempts == 10 + statuses.index(200)
    assert AuditEntry.objects.filter(action="application.configured").count() == 1
    assert IdempotencyRecord.objects.filter(key__startswith="race-").count() == 1
