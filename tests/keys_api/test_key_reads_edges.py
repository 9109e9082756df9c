"""Edges of GET /v1/concurrency-keys on a live server (daphne): a path or a
query parameter whose percent-encoding is not UTF-8 names no key. Daphne decodes the path
with replacement characters, so without a check `%FF` would read the key
"\ufffd" (SPEC §1: keys match byte for byte; §3: invalid UTF-8 → 400)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def http(tenant, orbit_server):
    client = httpx.Client(base_url=orbit_server.url, headers={"Authorization": f"Bearer {tenant.token}"}, timeout=30)
    yield client
    client.close()


@pytest.mark.parametrize("encoded", ["%FF", "%ED%A0%80", "a%C3", "%EF%BF"])
def test_a_key_path_that_is_not_utf8_is_invalid_not_the_replacement_key(http, encoded):
    queue = http.post(
        "/v1/queues", json={"name": "q", "max_concurrency": 2, "rate_per_second": 10}, headers={"Idempotency-Key": "q"}
    ).json()["data"]["queue"]
    for index, key in enumerate(["\ufffd", "\ufffd\ufffd\ufffd", "a\ufffd", "\ufffd\ufffd"]):
        task = {
            "queue_id": queue["id"],
            "handler": "h",
            "handler_version": "v1",
            "payload_version": "v1",
            "payload": {},
            "concurrency_key": key,
        }
        assert http.post("/v1/tasks", json=task, headers={"Idempotency-Key": f"t{index}"}).status_code == 201
    assert http.get("/v1/concurrency-keys/%EF%BF%BD").json()["data"]["key"] == "\ufffd"  # the real key still reads

    response = http.get(f"/v1/concurrency-keys/{encoded}")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT" and error["message"].startswith("key:"), error


@pytest.mark.parametrize("encoded", ["a%0Ab", "%0A", "a%0D%0A"])
def test_a_key_path_with_a_line_break_is_a_key_not_found_not_an_unknown_endpoint(http, encoded):
    """No key holds a control character; the route still reaches the key's endpoint."""
    response = http.get(f"/v1/concurrency-keys/{encoded}")
    assert response.status_code == 404, response.text
    assert response.json()["error"] == {"code": "NOT_FOUND", "message": "concurrency key not found"}


@pytest.mark.parametrize("encoded", ["%FF", "%ED%A0%80", "a%C3", "%EF%BF"])
def test_a_query_parameter_that_is_not_utf8_is_invalid_not_the_replacement_character(http, encoded):
    """`?prefix=%FF` would otherwise list the keys starting with "\ufffd"."""
    assert http.get("/v1/concurrency-keys?prefix=%EF%BF%BD").status_code == 200  # the real character still reads

    for path in (f"/v1/concurrency-keys?prefix={encoded}", f"/v1/tasks?queue_id={encoded}", f"/v1/queues?x{encoded}=1"):
        response = http.get(path)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["code"] == "INVALID_ARGUMENT", error
        assert error["message"].endswith(": must be percent-encoded UTF-8"), error
    assert http.get(f"/v1/concurrency-keys?prefix={encoded}").json()["error"]["message"].startswith("prefix:")


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/v1/tasks?state=WAITING&state=LEASED", "state"),
        ("/v1/tasks?page_size=1&page_size=2", "page_size"),
        ("/v1/concurrency-keys?prefix=a&prefix=b", "prefix"),
        ("/v1/events?after=1&after=2", "after"),
        ("/v1/queues?page_token=&page_token=x", "page_token"),
        ("/v1/tasks?queue%5Fid=a&queue_id=b", "queue_id"),
    ],
)
def test_a_query_parameter_sent_twice_is_refused_not_the_last_one_taken(http, path, name):
    """Django keeps the last of a repeated parameter: `?state=WAITING&state=LEASED`
    listed only the LEASED tasks, a filter the caller did not ask for."""
    response = http.get(path)
    assert response.status_code == 400, (path, response.text)
    assert response.json()["error"] == {
        **response.json()["error"],
        "code": "INVALID_ARGUMENT",
        "message": f"{name}: must be sent once",
    }


@pytest.mark.parametrize(
    ("method", "path", "name"),
    [
        ("GET", "/v1/tasks?queueid=a", "queueid"),
        ("GET", "/v1/tasks?page_size=1&fairness_key=x", "fairness_key"),
        ("GET", "/v1/concurrency-keys?prefx=a", "prefx"),
        ("GET", "/v1/events?cursor=1", "cursor"),
        ("GET", "/v1/queues?state=ACTIVE", "state"),
        ("GET", "/v1/tasks/" + "0" * 32 + "?verbose", "verbose"),
        ("POST", "/v1/tasks?dry_run=1", "dry_run"),
        ("GET", "/v1/tasks?=x", "(an empty name)"),
    ],
)
def test_an_unknown_query_parameter_is_refused_not_ignored(http, method, path, name):
    """A misspelt filter ignored would list every task, as if none had been asked for."""
    response = http.request(method, path, json={}, headers={"Idempotency-Key": "unknown-parameter"})
    assert response.status_code == 400, (path, response.text)
    assert response.json()["error"] == {"code": "INVALID_ARGUMENT", "message": f"{name}: unknown query parameter"}


def test_every_documented_query_parameter_is_accepted(http):
    for path in [
        "/v1/tasks?queue_id=a&state=WAITING&business_key=b&concurrency_key=c&page_size=5&page_token=",
        "/v1/concurrency-keys?prefix=a&page_size=5",
        "/v1/events?after=0&page_size=5",
        "/v1/queues?page_size=5&page_token=",
    ]:
        assert http.get(path).status_code == 200, (path, http.get(path).text)


def test_empty_parts_of_a_query_are_not_parameters(http):
    assert http.get("/v1/tasks?page_size=1&&").status_code == 200
