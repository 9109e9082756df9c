"""GET /v1/concurrency-keys and /v1/concurrency-keys/{key}: holder, highest
token and waiting count, byte-exact, tasks:read over all queues, read only."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from tasks.actions import rounds
from tasks.models import ConcurrencyKey
from tests.conftest import api_client, post_json
from tests.support.api import assert_error, assert_ok, make_queue
from tests.support.factories import make_credential
from tests.support.tasks import lease_one, submit_ok, worker_for

pytestmark = pytest.mark.django_db


def key_url(key: str) -> str:
    return "/v1/concurrency-keys/" + quote(key, safe="")


def test_a_held_key_names_its_holder_token_and_waiting_tasks(tenant):
    first = make_queue(tenant.client, "first")
    second = make_queue(tenant.client, "second")
    submit_ok(tenant.client, first["id"], "a", concurrency_key="printer/1")
    submit_ok(tenant.client, first["id"], "b", concurrency_key="printer/1")
    submit_ok(tenant.client, second["id"], "c", concurrency_key="printer/1")
    lease = lease_one(tenant, first["id"], worker_id="w-7")

    data = assert_ok(tenant.client.get(key_url("printer/1")))
    row = ConcurrencyKey.objects.get(namespace_id=tenant.namespace_id, key="printer/1")
    assert data["key"] == "printer/1"
    assert data["holder"]["attempt_id"] == lease["attempt_id"]
    assert data["holder"]["task_id"] == lease["task"]["id"]
    assert data["holder"]["worker_id"] == "w-7"
    assert data["holder"]["token"] == lease["concurrency_token"] == str(row.version)
    assert data["holder"]["since"].endswith("Z")
    assert data["highest_token"] == str(row.version)
    assert data["waiting_tasks"] == 2  # one per queue is left WAITING, across queues


def test_a_free_key_has_no_holder(tenant):
    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "a", concurrency_key="k")
    data = assert_ok(tenant.client.get(key_url("k")))
    assert "holder" not in data and data["waiting_tasks"] == 1 and data["highest_token"] == "0"


def test_keys_are_byte_exact_and_unknown_ones_are_not_found(tenant):
    queue = make_queue(tenant.client)
    for index, key in enumerate(["Straße", "strasse", "a b", "x%2Fy"]):
        submit_ok(tenant.client, queue["id"], f"k{index}", concurrency_key=key)
    assert assert_ok(tenant.client.get(key_url("Straße")))["key"] == "Straße"
    assert assert_ok(tenant.client.get(key_url("a b")))["key"] == "a b"
    assert assert_ok(tenant.client.get(key_url("x%2Fy")))["key"] == "x%2Fy"
    assert_error(tenant.client.get(key_url("STRASSE")), 404, "NOT_FOUND")
    assert_error(tenant.client.get(key_url("straße")), 404, "NOT_FOUND")
    assert_error(tenant.client.get(key_url("a")), 404, "NOT_FOUND")


def test_the_list_pages_through_a_prefix_in_byte_order(tenant):
    queue = make_queue(tenant.client, max_concurrency=20)
    keys = ["acct/1", "acct/2", "acct/10", "Acct/3", "acct", "acctx", "b"]
    for index, key in enumerate(keys):
        submit_ok(tenant.client, queue["id"], f"k{index}", concurrency_key=key)
        submit_ok(tenant.client, queue["id"], f"w{index}", concurrency_key=key)
    assert len(rounds.lease_tasks(worker=worker_for(tenant, queue["id"]), limit=len(keys))) == len(
        keys
    )  # makes the rows
    seen, token = [], ""
    while True:
        data = assert_ok(
            tenant.client.get("/v1/concurrency-keys", {"prefix": "acct/", "page_size": 2, "page_token": token})
        )
        seen += [item["key"] for item in data["items"]]
        token = data["next_page_token"]
        if not token:
            break
    assert seen == ["acct/1", "acct/10", "acct/2"]
    everything = assert_ok(tenant.client.get("/v1/concurrency-keys"))["items"]
    assert [item["key"] for item in everything] == sorted(keys)
    assert all(item["waiting_tasks"] == 1 for item in everything)
    assert_error(tenant.client.get("/v1/concurrency-keys", {"page_token": "!!"}), 400, "INVALID_ARGUMENT")


def test_other_namespaces_keys_are_invisible(tenant):
    from tests.support.factories import NamespaceFactory

    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "a", concurrency_key="shared-name")
    other = api_client(make_credential(NamespaceFactory()).token)
    assert_error(other.get(key_url("shared-name")), 404, "NOT_FOUND")
    assert assert_ok(other.get("/v1/concurrency-keys"))["items"] == []


def test_reading_keys_takes_tasks_read_over_every_queue(tenant):
    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "a", concurrency_key="k")
    no_read = api_client(make_credential(tenant.namespace, scopes=["tasks:submit"]).token)
    ranged = api_client(make_credential(tenant.namespace, scopes=["tasks:read"], queue_ids=[queue["id"]]).token)
    for client in (no_read, ranged):
        assert_error(client.get(key_url("k")), 403, "PERMISSION_DENIED")
        assert_error(client.get("/v1/concurrency-keys"), 403, "PERMISSION_DENIED")
    assert_error(api_client(None).get(key_url("k")), 401, "UNAUTHENTICATED")


def test_there_is_no_reset_and_no_delete(tenant):
    queue = make_queue(tenant.client)
    submit_ok(tenant.client, queue["id"], "a", concurrency_key="k")
    lease_one(tenant, queue["id"])
    for method in ("post", "delete", "put", "patch"):
        response = getattr(tenant.client, method)(key_url("k"))
        assert response.status_code in (404, 405), (method, response.status_code)
    assert post_json(tenant.client, key_url("k") + ":reset", {}, key="r").status_code in (404, 405)
    assert ConcurrencyKey.objects.filter(namespace_id=tenant.namespace_id, key="k").exists()
