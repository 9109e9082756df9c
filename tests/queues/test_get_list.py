"""GET /v1/queues/{id} and GET /v1/queues."""

from __future__ import annotations

import base64

import pytest

from queues.models import Queue, QueueState
from tests.conftest import api_client
from tests.support.api import assert_error, assert_invalid, assert_ok
from tests.support.factories import NamespaceFactory, QueueFactory, make_credential
from tests.support.queues import assert_queue_shape, create_queue, get_queue


def test_get_returns_the_queue_object_directly(tenant):
    # given the seed's queue with a live backlog beyond uint32
    created = create_queue(tenant.client, "images", key="queue-images-v1")
    QueueState.objects.filter(queue_id=created["id"]).update(unfinished_tasks=2**40)
    # when it is read
    data = assert_ok(get_queue(tenant.client, created["id"]))
    # then data is the queue object itself, with the live count as a decimal string
    assert_queue_shape(data)
    assert data == {**created, "unfinished_tasks": str(2**40)}


@pytest.mark.mysql_only
def test_get_renders_the_largest_uint64_exactly(tenant):
    # SQLite integers are signed 64-bit; the full uint64 range is MySQL's.
    created = create_queue(tenant.client, "images", key="queue-images-v1")
    QueueState.objects.filter(queue_id=created["id"]).update(unfinished_tasks=2**64 - 1)
    Queue.objects.filter(id=created["id"]).update(revision=2**64 - 1)
    data = assert_ok(get_queue(tenant.client, created["id"]))
    assert (data["unfinished_tasks"], data["revision"]) == ("18446744073709551615", "18446744073709551615")


@pytest.mark.parametrize("queue_id", ["0" * 32, "not-an-id", "A" * 32, "x" * 300, "%00", "%E9%98%9F"])
def test_get_of_a_missing_queue_is_not_found(tenant, queue_id):
    assert_error(tenant.client.get(f"/v1/queues/{queue_id}"), 404, "NOT_FOUND")


def test_get_id_is_exact(tenant):
    created = create_queue(tenant.client, "images")
    assert_error(get_queue(tenant.client, created["id"].upper()), 404, "NOT_FOUND")
    assert_error(get_queue(tenant.client, created["id"] + " "), 404, "NOT_FOUND")


def list_page(client, **params):
    return assert_ok(client.get("/v1/queues", params))


def test_list_is_empty_for_a_new_namespace(tenant):
    assert list_page(tenant.client) == {"items": [], "next_page_token": ""}


def test_list_default_page_is_100(tenant):
    QueueFactory.create_batch(105, namespace=tenant.namespace)
    first = list_page(tenant.client)
    assert len(first["items"]) == 100 and first["next_page_token"]
    rest = list_page(tenant.client, page_token=first["next_page_token"])
    assert len(rest["items"]) == 5 and rest["next_page_token"] == ""


def test_list_max_page_size_is_500(tenant):
    QueueFactory.create_batch(501, namespace=tenant.namespace)
    first = list_page(tenant.client, page_size="500")
    assert len(first["items"]) == 500 and first["next_page_token"]
    assert len(list_page(tenant.client, page_size="500", page_token=first["next_page_token"])["items"]) == 1


@pytest.mark.parametrize("page_size", ["1", "2", "3", "7", "23"])
def test_page_tokens_walk_every_queue_exactly_once(tenant, page_size):
    # given 23 queues in the namespace and 4 in another one
    expected = {create_queue(tenant.client, f"q{n}", key=f"k{n}")["id"] for n in range(8)}
    expected |= {q.id for q in QueueFactory.create_batch(15, namespace=tenant.namespace)}
    QueueFactory.create_batch(4)
    # when the list is walked page by page
    seen, token, pages = [], None, 0
    while True:
        params = {"page_size": page_size, **({"page_token": token} if token else {})}
        data = list_page(tenant.client, **params)
        assert set(data) == {"items", "next_page_token"}
        assert len(data["items"]) <= int(page_size)
        for item in data["items"]:
            assert_queue_shape(item)
        seen += [item["id"] for item in data["items"]]
        pages += 1
        token = data["next_page_token"]
        if not token:
            break
        assert pages < 100
    # then every queue of the namespace appears once and no other does
    assert len(seen) == len(set(seen)) == 23
    assert set(seen) == expected


def test_list_items_carry_live_counts(tenant):
    created = create_queue(tenant.client, "images")
    QueueState.objects.filter(queue_id=created["id"]).update(unfinished_tasks=5)
    assert list_page(tenant.client)["items"] == [{**created, "unfinished_tasks": "5"}]


@pytest.mark.parametrize(
    "page_size", ["0", "501", "-1", "abc", "", "1.5", "1e2", " 1", "１", "²", "٣", "99999999999999999999999"]
)
def test_invalid_page_size_is_rejected(tenant, page_size):
    assert_invalid(tenant.client.get("/v1/queues", {"page_size": page_size}), "page_size")


@pytest.mark.parametrize(
    "page_token",
    [
        "***",
        "%%%",
        "队列",
        "a",
        "====",
        base64.urlsafe_b64encode(b"not-an-id").decode(),
        base64.urlsafe_b64encode(b"\xff" * 32).decode(),
        base64.urlsafe_b64encode(b"F" * 32).decode(),
    ],
)
def test_garbage_page_token_is_rejected(tenant, page_token):
    # A mangled token must not silently restart the walk at the first page.
    create_queue(tenant.client, "images")
    assert_invalid(tenant.client.get("/v1/queues", {"page_token": page_token}), "page_token")


def test_page_token_with_padding_stripped_or_not_is_accepted(tenant):
    created = sorted(create_queue(tenant.client, f"q{n}", key=f"k{n}")["id"] for n in range(3))
    token = list_page(tenant.client, page_size="1")["next_page_token"]
    assert "=" not in token
    padded = token + "=" * (-len(token) % 4)
    for sent in {token, padded}:
        assert [item["id"] for item in list_page(tenant.client, page_size="1", page_token=sent)["items"]] == [
            created[1]
        ]


def test_list_applies_the_queue_range(tenant):
    # given five queues and a credential limited to two of them
    queues = [create_queue(tenant.client, f"q{n}", key=f"k{n}") for n in range(5)]
    chosen = sorted([queues[1]["id"], queues[3]["id"]])
    limited = api_client(make_credential(tenant.namespace, scopes=["queues:read"], queue_ids=chosen).token)
    # when it lists (one item per page, to cross page boundaries)
    first = list_page(limited, page_size="1")
    second = list_page(limited, page_size="1", page_token=first["next_page_token"])
    # then it sees exactly those two
    assert [first["items"][0]["id"], second["items"][0]["id"]] == chosen
    assert second["next_page_token"] == ""


def test_list_never_shows_another_namespace(tenant):
    create_queue(tenant.client, "images")
    other = NamespaceFactory()
    QueueFactory(namespace=other, name="images")
    items = list_page(tenant.client)["items"]
    assert [item["namespace_id"] for item in items] == [tenant.namespace_id]


def test_list_query_count_does_not_grow_with_the_page(tenant, django_assert_num_queries):
    # authentication, the page of queues, their counters: three queries for 3 or 60 items
    QueueFactory.create_batch(3, namespace=tenant.namespace)
    with django_assert_num_queries(3):
        assert len(list_page(tenant.client)["items"]) == 3
    QueueFactory.create_batch(57, namespace=tenant.namespace)
    with django_assert_num_queries(3):
        assert len(list_page(tenant.client)["items"]) == 60


def test_get_query_count(tenant, django_assert_num_queries):
    created = create_queue(tenant.client, "images")
    with django_assert_num_queries(3):
        assert_ok(get_queue(tenant.client, created["id"]))
