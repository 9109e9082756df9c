"""POST /v1/tasks through its direct route (tasks.submit_route) answers
exactly as the Django/DRF view does: same status, headers and envelope, for
accepted, replayed and refused submits alike, on a live server.

A `Content-Encoding: identity` header makes the route decline (the view takes
it: the body is as sent), so it sends the same request through the full handler
for comparison. (A query string no longer can: the view refuses a parameter it
does not document.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from django.test import override_settings

from orbit.fields import new_id
from orbit.models import Credential
from orbit.tenancy import revoke_credential
from tasks import submit_route
from tasks.models import Task
from tests.support.factories import make_credential
from tests.support.tasks import numbered_task

pytestmark = pytest.mark.django_db(transaction=True)

VOLATILE = {"request_id", "id", "available_at", "created_at", "updated_at"}


def normalized(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: "<v>" if key in VOLATILE else normalized(inner) for key, inner in value.items()}
    if isinstance(value, list):
        return [normalized(inner) for inner in value]
    return value


def answer_shape(response: httpx.Response) -> tuple[int, dict[str, str], Any]:
    headers = {name: value for name, value in response.headers.items() if name not in {"x-request-id", "date"}}
    headers["content-length"] = "<n>"  # ids and times vary; `both` checks the length against the body
    envelope = response.json()
    assert envelope["request_id"] == response.headers["x-request-id"]
    return response.status_code, headers, normalized(envelope)


@pytest.fixture
def setup(tenant, orbit_server):
    http = httpx.Client(base_url=orbit_server.url, headers={"Authorization": f"Bearer {tenant.token}"}, timeout=30)
    limits = {"max_concurrency": 5, "rate_per_second": 5, "max_unfinished_tasks": 6}
    ids = []
    for name in ("route", "elsewhere"):
        created = http.post("/v1/queues", json={"name": name, **limits}, headers={"Idempotency-Key": name})
        ids.append(created.json()["data"]["queue"]["id"])
    return http, ids[0], ids[1]


def both(http: httpx.Client, key: str | None, **request: Any) -> tuple[int, dict[str, str], Any]:
    """Sends the request through the route and through the view (each with
    its own key, so neither replays the other) and compares the answers."""
    headers = dict(request.pop("headers", {}))
    answers = []
    for suffix, declined in (("route", {}), ("view", {"Content-Encoding": "identity"})):
        sent = {**headers, **declined, **({"Idempotency-Key": f"{key}-{suffix}"} if key else {})}
        response = http.post("/v1/tasks", headers=sent, **request)
        if response.headers.get("content-length") is not None:
            assert int(response.headers["content-length"]) == len(response.content)
        answers.append(answer_shape(response))
    assert answers[0] == answers[1]
    return answers[0]


def test_accepted_replayed_and_conflicting_submits_answer_alike(setup):
    http, queue_id, elsewhere = setup
    assert both(http, "a", json=numbered_task(queue_id, 1))[0] == 201
    assert both(http, "a", json=numbered_task(queue_id, 1))[0] == 200  # replay of each
    assert both(http, "a", json=numbered_task(queue_id, 2))[2]["error"]["code"] == "IDEMPOTENCY_CONFLICT"
    status, _, envelope = both(http, "u", json={**numbered_task(queue_id, 3), "payload": {"é": "\u2028"}})
    assert status == 201 and envelope["data"]["task"]["payload"] == {"é": "\u2028"}
    big = {**numbered_task(queue_id, 4), "payload": {"blob": "x" * 100_000}}  # over the route's 64 KiB: the view's
    assert both(http, "big", json=big)[0] == 201
    # Accept other than JSON: the view's path (the route takes only the plain request), the same JSON answer
    status, headers, _ = both(http, "html", json=numbered_task(elsewhere, 5), headers={"Accept": "text/html"})
    assert status == 201 and headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    "case",
    [
        "unknown field",
        "bad priority",
        "no key",
        "long key",
        "bad token",
        "no token",
        "malformed JSON",
        "array body",
        "empty body",
        "text/plain",
        "unknown queue",
        "queue_id not a string",
        "NaN",
        "lone surrogate",
    ],
)
def test_refusals_answer_alike(setup, case):
    http, queue_id, _ = setup
    task = numbered_task(queue_id, 7)
    plain = {"Content-Type": "application/json"}
    requests: dict[str, tuple[str | None, dict[str, Any]]] = {
        "unknown field": ("k", {"json": {**task, "colour": "red"}}),
        "bad priority": ("k", {"json": {**task, "priority": 42}}),
        "no key": (None, {"json": task}),
        "long key": ("k" * 300, {"json": task}),
        "bad token": ("k", {"json": task, "headers": {"Authorization": "Bearer orb_nope"}}),
        "no token": ("k", {"json": task, "headers": {"Authorization": ""}}),
        "malformed JSON": ("k", {"content": b'{"queue_id": ', "headers": plain}),
        "array body": ("k", {"content": b"[1]", "headers": plain}),
        "empty body": ("k", {"content": b"", "headers": plain}),
        "text/plain": ("k", {"content": json.dumps(task), "headers": {"Content-Type": "text/plain"}}),
        "unknown queue": ("k", {"json": {**task, "queue_id": new_id()}}),
        "queue_id not a string": ("k", {"json": {**task, "queue_id": 5}}),
        "NaN": ("k", {"content": b'{"priority": NaN}', "headers": plain}),
        "lone surrogate": ("k", {"content": json.dumps({**task, "\ud800x": 1}), "headers": plain}),
    }
    key, request = requests[case]
    status, _, envelope = both(http, key, **request)
    assert status >= 400 and "error" in envelope
    assert not Task.objects.filter(queue_id=queue_id).exists()


def deeply(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("payload 21 deep", "payload: must not nest arrays and objects more than 20 levels deep"),
        ("payload 1e999", "request body: malformed JSON (1e999 is out of range for a number)"),
        ("payload 5000 digits", "request body: malformed JSON (an integer of 5000 digits, more than 4300)"),
        ("queue_id a lone surrogate", "queue_id: must be valid UTF-8 (no lone surrogates)"),
        (
            "time past year 9999 in UTC",
            "deadline_at: out of range: must be from 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999Z in UTC",
        ),
        (
            "time before year 1 in UTC",
            "available_at: out of range: must be from 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999Z in UTC",
        ),
    ],
)
def test_what_no_column_can_store_is_refused_by_name_not_internal(setup, case, message):
    # given a body whose value MariaDB (or Python's datetime) cannot hold
    http, queue_id, _ = setup
    task = numbered_task(queue_id, 8)
    plain = {"Content-Type": "application/json"}
    huge = "7" * 5000  # past Python's int conversion limit
    requests: dict[str, dict[str, Any]] = {
        "payload 21 deep": {"json": {**task, "payload": {"a": deeply(20)}}},
        "payload 1e999": {"content": json.dumps(task)[:-1] + ', "business_key": "b", "payload": [1e999]}'},
        "payload 5000 digits": {"content": json.dumps(task)[:-1] + f', "business_key": "c", "payload": [{huge}]}}'},
        "queue_id a lone surrogate": {"content": json.dumps({**task, "queue_id": "\ud800"})},
        "time past year 9999 in UTC": {"json": {**task, "deadline_at": "9999-12-31T23:59:59-01:00"}},
        "time before year 1 in UTC": {"json": {**task, "available_at": "0001-01-01T00:00:00+01:00"}},
    }
    # when it is submitted, through the route and through the view
    status, _, envelope = both(http, "k", headers=plain, **requests[case])
    # then both refuse it by field, and nothing is stored
    assert (status, envelope["error"]) == (400, {"code": "INVALID_ARGUMENT", "message": message})
    assert not Task.objects.filter(queue_id=queue_id).exists()
    # and 20 levels are accepted
    assert both(http, "twenty", json={**task, "payload": deeply(20)})[0] == 201


def test_a_refused_submit_does_not_fail_the_submits_decided_beside_it(setup, tenant, orbit_server):
    # given sixteen good submits and one whose payload is too deep, sent at once, five times
    http, _, _ = setup
    created = http.post(
        "/v1/queues",
        json={"name": "crowd", "max_concurrency": 5, "rate_per_second": 5, "max_unfinished_tasks": 1000},
        headers={"Idempotency-Key": "crowd"},
    )
    queue_id = created.json()["data"]["queue"]["id"]

    async def one_round(round_number: int) -> list[int]:
        headers = {"Authorization": f"Bearer {tenant.token}"}
        async with httpx.AsyncClient(base_url=orbit_server.url, headers=headers, timeout=30) as client:
            bodies = [numbered_task(queue_id, 100 * round_number + n) for n in range(16)]
            bodies.append({**numbered_task(queue_id, 100 * round_number + 99), "payload": deeply(40)})
            answers = await asyncio.gather(
                *(
                    client.post("/v1/tasks", json=body, headers={"Idempotency-Key": f"r{round_number}-{n}"})
                    for n, body in enumerate(bodies)
                )
            )
            return [answer.status_code for answer in answers]

    for round_number in range(5):
        # then each good submit is accepted and stored, and only the deep one refused
        assert asyncio.run(one_round(round_number)) == [201] * 16 + [400]
    assert Task.objects.filter(queue_id=queue_id).count() == 16 * 5


@pytest.mark.parametrize("body", [b"{}", b"--x\r\nnot a part"])
def test_a_form_content_type_is_answered_by_the_api_not_by_twisted(setup, body):
    # given a body Twisted would have decoded as a form (and refused bare when it could not)
    http, queue_id, _ = setup
    headers = {"Content-Type": "multipart/form-data; boundary=x", "Idempotency-Key": "form"}
    # when it is posted
    response = http.post("/v1/tasks", content=body, headers=headers)
    # then the API answers it, in its envelope
    assert response.status_code == 400
    assert response.json()["error"] == {"code": "INVALID_ARGUMENT", "message": "Content-Type must be application/json"}
    assert response.headers["x-request-id"] == response.json()["request_id"]


def test_more_query_parameters_than_django_reads_is_invalid_argument(setup):
    http, _, _ = setup
    query = "&".join(["a=1"] * 1001)
    for path in ("/v1/queues", "/v1/tasks"):
        response = http.get(f"{path}?{query}")
        assert response.status_code == 400, response.text
        assert response.json()["error"] == {"code": "INVALID_ARGUMENT", "message": "query: more than 1000 parameters"}


def test_scope_range_and_backpressure_answer_alike(setup, tenant, orbit_server):
    http, queue_id, other_id = setup
    narrow = make_credential(tenant.namespace, scopes=["tasks:submit"], queue_ids=[queue_id])
    reader = make_credential(tenant.namespace, scopes=["tasks:read"])
    for token, task, code in (
        (narrow.token, numbered_task(other_id, 1), "NOT_FOUND"),
        (reader.token, numbered_task(queue_id, 1), "PERMISSION_DENIED"),
    ):
        with httpx.Client(base_url=orbit_server.url, headers={"Authorization": f"Bearer {token}"}) as client:
            assert both(client, "scoped", json=task)[2]["error"]["code"] == code
    for n in range(3):  # 6 fit: 3 through each path
        assert both(http, f"fill{n}", json=numbered_task(queue_id, n))[0] == 201
    status, headers, envelope = both(http, "over", json=numbered_task(queue_id, 9))
    assert (status, headers["retry-after"], envelope["error"]["code"]) == (429, "1", "QUEUE_FULL")


@pytest.mark.parametrize("change", ["revoked", "narrowed"])
def test_a_credential_revoked_or_changed_after_use_is_refused_at_once(setup, tenant, orbit_server, change):
    """The server knows a credential once it has read it; its next submits go
    by what it knows, and their round reads the row again before deciding."""
    _, queue_id, _ = setup
    issued = make_credential(tenant.namespace)
    with httpx.Client(base_url=orbit_server.url, headers={"Authorization": f"Bearer {issued.token}"}) as client:
        for n in range(3):
            accepted = client.post("/v1/tasks", json=numbered_task(queue_id, n), headers={"Idempotency-Key": f"k{n}"})
            assert accepted.status_code == 201
        if change == "revoked":
            revoke_credential(issued.credential.id)
        else:
            Credential.objects.filter(id=issued.credential.id).update(scopes=["tasks:read"])
        status, _, envelope = both(client, "after", json=numbered_task(queue_id, 5))
    expected = (401, "UNAUTHENTICATED") if change == "revoked" else (403, "PERMISSION_DENIED")
    assert (status, envelope["error"]["code"]) == expected
    assert Task.objects.filter(queue_id=queue_id).count() == 3


def scope_of(headers: list[tuple[bytes, bytes]], query: bytes = b"") -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/tasks", "query_string": query, "headers": headers}


@pytest.mark.parametrize(
    ("extra", "query", "body"),
    [
        ([(b"content-type", b"text/plain")], b"", b"{}"),
        ([(b"content-type", b"application/json; charset=utf-8")], b"", b"{}"),
        ([(b"content-type", b"application/json"), (b"accept", b"text/html")], b"", b"{}"),
        ([(b"content-type", b"application/json")], b"format=json", b"{}"),
        ([(b"content-type", b"application/json"), (b"idempotency-key", b"b")], b"", b"{}"),  # key twice
        ([(b"content-type", b"application/json")], b"", b"[]"),
        ([(b"content-type", b"application/json")], b"", b"{"),
        ([(b"content-type", b"application/json")], b"", b'{"payload": "' + b"x" * 70_000 + b'"}'),
    ],
)
def test_the_route_declines_what_is_not_plain(tenant, extra, query, body):
    headers = [(b"authorization", f"Bearer {tenant.token}".encode()), (b"idempotency-key", b"a"), *extra]
    with override_settings(ORBIT_INLINE_DB=False):
        assert asyncio.run(submit_route.answer(scope_of(headers, query), body)) is None


def test_the_route_answers_a_plain_submit_itself(tenant, orbit_server, setup):
    _, queue_id, _ = setup
    headers = [
        (b"authorization", f"Bearer {tenant.token}".encode()),
        (b"idempotency-key", b"direct"),
        (b"content-type", b"application/json"),
        (b"accept", b"*/*"),
        (b"idempotency_key", b"ignored, as Django ignores it"),
    ]
    with override_settings(ORBIT_INLINE_DB=False):
        answer = asyncio.run(submit_route.answer(scope_of(headers), json.dumps(numbered_task(queue_id, 1)).encode()))
    assert answer is not None
    status, response_headers, body = answer
    envelope = json.loads(body)
    assert status == 201 and envelope["data"]["deduplicated"] is False
    assert dict(response_headers)[b"X-Request-Id"] == envelope["request_id"].encode()
    assert Task.objects.filter(queue_id=queue_id).count() == 1


@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/queues"])
def test_an_idempotency_key_sent_twice_is_refused_not_joined(setup, path):
    """Django would join two headers into one key, "k1,k2", which neither names."""
    http, queue_id, _ = setup
    queue = {"name": "twice", "max_concurrency": 1, "rate_per_second": 1}
    body = numbered_task(queue_id, 7) if path == "/v1/tasks" else queue
    headers = [("Idempotency-Key", "k1"), ("Idempotency-Key", "k2"), ("Content-Type", "application/json")]
    response = http.post(path, content=json.dumps(body), headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {"code": "INVALID_ARGUMENT", "message": "Idempotency-Key: must be sent once"}
    # nothing was accepted under the joined key
    again = http.post(path, json=body, headers={"Idempotency-Key": "k1,k2"})
    assert again.status_code == 201, again.text
