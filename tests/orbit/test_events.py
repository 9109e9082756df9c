"""GET /v1/events?after=<cursor>: the namespace's event log, written in the
same transactions as the changes (SPEC §7)."""

from __future__ import annotations

import re

import pytest

from orbit.models import Event
from tests.conftest import api_client
from tests.support.api import RFC3339_UTC, assert_error, assert_invalid, assert_ok, make_queue
from tests.support.factories import NamespaceFactory, make_credential
from tests.support.tasks import cancel, submit_ok


def events(client, **params: str):
    return assert_ok(client.get("/v1/events", params))


@pytest.mark.django_db
def test_events_follow_changes_in_order_and_page_by_cursor(tenant):
    queue = make_queue(tenant.client)
    task = submit_ok(tenant.client, queue["id"], "one")
    assert_ok(cancel(tenant.client, task["id"], "cancel-one"))
    data = events(tenant.client)
    kinds = [(item["type"], item["subject_id"]) for item in data["items"]]
    assert kinds == [
        ("queue.created", queue["id"]),
        ("task.state_changed", task["id"]),
        ("task.state_changed", task["id"]),
        ("task.cancel", task["id"]),
    ]
    assert [item["data"].get("state") for item in data["items"][1:3]] == ["WAITING", "CANCELLED"]
    assert data["items"][3]["data"]["reason"] == "no longer needed"
    for item in data["items"]:
        assert set(item) == {"cursor", "type", "subject_id", "data", "created_at"}
        assert re.fullmatch(r"[1-9][0-9]*", item["cursor"])
        assert RFC3339_UTC.fullmatch(item["created_at"])
    cursors = [int(item["cursor"]) for item in data["items"]]
    assert cursors == sorted(cursors) and data["next_cursor"] == data["items"][-1]["cursor"]

    first = events(tenant.client, page_size="1")
    assert [item["cursor"] for item in first["items"]] == [data["items"][0]["cursor"]]
    rest = events(tenant.client, after=first["next_cursor"])
    assert rest["items"] == data["items"][1:]
    caught_up = events(tenant.client, after=data["next_cursor"])
    assert caught_up == {"items": [], "next_cursor": data["next_cursor"]}


@pytest.mark.django_db
def test_events_of_other_namespaces_are_not_shown(tenant):
    other = NamespaceFactory(application=tenant.namespace.application)
    other_client = api_client(make_credential(other).token)
    make_queue(other_client, "elsewhere")
    assert events(tenant.client)["items"] == []
    assert Event.objects.filter(namespace_id=other.id).count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("after", ["-1", "01", "1.0", "x", "", " 1", "18446744073709551616", "１"])
def test_bad_cursor_names_the_parameter(tenant, after):
    assert_invalid(tenant.client.get("/v1/events", {"after": after}), "after")


@pytest.mark.django_db
@pytest.mark.parametrize("page_size", ["0", "501", "a"])
def test_bad_page_size_names_the_parameter(tenant, page_size):
    assert_invalid(tenant.client.get("/v1/events", {"page_size": page_size}), "page_size")


@pytest.mark.django_db
def test_scopes_and_queue_range(tenant):
    queue = make_queue(tenant.client)
    for scopes in (["tasks:read"], ["queues:read"]):
        client = api_client(make_credential(tenant.namespace, scopes=scopes).token)
        assert_error(client.get("/v1/events"), 403, "PERMISSION_DENIED")
    ranged = make_credential(tenant.namespace, scopes=["tasks:read", "queues:read"], queue_ids=[queue["id"]])
    assert_error(api_client(ranged.token).get("/v1/events"), 403, "PERMISSION_DENIED")
    assert_error(api_client(None).get("/v1/events"), 401, "UNAUTHENTICATED")
