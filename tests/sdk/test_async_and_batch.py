"""AsyncClient has Client's verbs and sends the same requests; submit_tasks (POST /v1/tasks:batch)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import inspect
import json
import re
from dataclasses import replace
from typing import Any
from urllib.parse import quote

import httpx
import pytest

import orbit_sdk
from orbit_sdk import (
    APIError,
    AsyncClient,
    BatchItemResult,
    Client,
    ConfigureKeyPolicyRequest,
    ConfigureQueueRequest,
    CreateKeyPolicyRequest,
    CreatePlanRequest,
    CreateQueueRequest,
    KeyMatch,
    KeyRate,
    ProtocolError,
    SubmitTaskRequest,
    TransportError,
    UpdatePlanRequest,
)
from tests.support.sdk import (
    APPLICATION,
    ATTEMPT,
    ATTEMPT_ID,
    PLAN,
    QUEUE,
    QUEUE_ID,
    REQUEST_ID,
    TASK_ID,
    TASK_SUMMARY,
    TOKEN,
    Recorder,
    ok,
)

PLAN_ID = PLAN["id"]
POLICY = {
    "id": "c" * 32,
    "namespace_id": "d" * 32,
    "match": {"prefix": "customer/"},
    "capacity": 5,
    "rate": {"starts": 10, "per_seconds": 1, "burst": 5},
    "revision": "1",
    "created_at": "2026-01-01T00:00:00Z",
    "updated_at": "2026-01-01T00:00:00Z",
}
POLICY_RESULT = {"deduplicated": False, "policy": POLICY}
KEY = {"key": "object/42", "highest_token": "4", "waiting_tasks": 0, "updated_at": "2026-01-01T00:00:00Z"}
TASK_SPEC = {"handler": "h", "handler_version": "v1", "payload_version": "v1", "payload": {}}
REQUEST = SubmitTaskRequest(QUEUE_ID, "object.update", "v1", "v1", {"a": 1})

# Every verb, with arguments and the data its answer carries.
VERBS: list[tuple[str, tuple[Any, ...], Any]] = [
    ("create_queue", ("k1", CreateQueueRequest("images", 8, 100)), {"deduplicated": False, "queue": QUEUE}),
    ("get_queue", (QUEUE_ID,), QUEUE),
    ("list_queues", (10, "tok"), {"items": [QUEUE], "next_page_token": None}),
    (
        "configure_queue",
        (QUEUE_ID, "k2", ConfigureQueueRequest(1, "more", False, 8, 10, 100)),
        {"deduplicated": False, "queue": QUEUE},
    ),
    ("retire_queue", (QUEUE_ID, "k3", 2, "done"), {"deduplicated": False, "queue": QUEUE}),
    ("get_application", (APPLICATION["id"],), APPLICATION),
    (
        "configure_application",
        (APPLICATION["id"], "k4", 1, "cap", 3, 2),
        {"deduplicated": False, "application": APPLICATION},
    ),
    ("list_events", (40, 10), {"items": [], "next_cursor": "40"}),
    (
        "create_plan",
        ("k5", CreatePlanRequest("nightly", QUEUE_ID, {"interval_seconds": 60}, {"policy": "SKIP"}, TASK_SPEC)),
        {"deduplicated": False, "plan": PLAN},
    ),
    ("get_plan", (PLAN_ID,), PLAN),
    ("list_plans", (), {"items": [PLAN]}),
    (
        "update_plan",
        (PLAN_ID, "k6", UpdatePlanRequest(1, "r", {"interval_seconds": 60}, {"policy": "SKIP"}, TASK_SPEC)),
        {"deduplicated": False, "plan": PLAN},
    ),
    ("pause_plan", (PLAN_ID, "k7", 1, "r"), {"deduplicated": False, "plan": PLAN}),
    ("resume_plan", (PLAN_ID, "k8", 1, "r"), {"deduplicated": False, "plan": PLAN}),
    ("retire_plan", (PLAN_ID, "k9", 1, "r"), {"deduplicated": False, "plan": PLAN}),
    ("list_plan_triggers", (PLAN_ID,), {"items": []}),
    ("submit_task", ("k10", REQUEST), {"deduplicated": False, "task": TASK_SUMMARY}),
    (
        "submit_tasks",
        ({"k11": REQUEST},),
        {"results": [{"idempotency_key": "k11", "status": 201, "deduplicated": False, "task": TASK_SUMMARY}]},
    ),
    ("get_task", (TASK_ID,), {**TASK_SUMMARY, "payload": {"a": 1}}),
    ("list_tasks", (QUEUE_ID, "WAITING", None, None, 5), {"items": [TASK_SUMMARY]}),
    ("get_task_blockers", (TASK_ID,), {"state": "WAITING", "items": [{"code": "NO_WORKER", "message": "m"}]}),
    ("list_dependencies", (TASK_ID, 10, "tok"), {"items": [{"id": TASK_ID, "state": "SUCCEEDED"}]}),
    ("list_dependents", (TASK_ID,), {"items": [{"id": TASK_ID}], "next_page_token": "next"}),
    ("list_attempts", (TASK_ID,), {"items": [ATTEMPT]}),
    ("get_attempt", (ATTEMPT_ID,), ATTEMPT),
    ("cancel_task", (TASK_ID, "k12", "not needed"), {"deduplicated": False, "task": TASK_SUMMARY}),
    ("resolve_task", (TASK_ID, "k13", "FAILED", "checked"), {"deduplicated": False, "task": TASK_SUMMARY}),
    ("list_concurrency_keys", ("object/", 2, "tok"), {"items": [KEY], "next_page_token": "next"}),
    ("get_concurrency_key", ("object/42",), KEY),
    (
        "create_key_policy",
        ("k14", CreateKeyPolicyRequest(KeyMatch(prefix="customer/"), "five writers", 5, KeyRate(10, 1, 5))),
        POLICY_RESULT,
    ),
    ("get_key_policy", (POLICY["id"],), POLICY),
    ("list_key_policies", (10, "tok"), {"items": [POLICY], "next_page_token": None}),
    (
        "configure_key_policy",
        (POLICY["id"], "k15", ConfigureKeyPolicyRequest(1, "more", 6)),
        POLICY_RESULT,
    ),
    ("retire_key_policy", (POLICY["id"], "k16", 2, "done"), POLICY_RESULT),
]

CLIENT_ONLY = {"close", "from_credentials_file"}
ASYNC_ONLY = {"aclose", "from_credentials_file"}


def public_methods(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name))}


def test_both_clients_have_the_same_verbs_with_the_same_signatures():
    verbs = public_methods(Client) - CLIENT_ONLY
    assert verbs == public_methods(AsyncClient) - ASYNC_ONLY
    assert verbs == {name for name, _, _ in VERBS}  # the table below covers every verb
    for name in verbs:
        assert inspect.signature(getattr(Client, name)) == inspect.signature(getattr(AsyncClient, name)), name
        assert getattr(Client, name).__doc__ == getattr(AsyncClient, name).__doc__


def seen(request: httpx.Request) -> tuple[str, str, str | None, bytes]:
    return request.method, str(request.url), request.headers.get("Idempotency-Key"), request.content


@pytest.mark.parametrize(("name", "args", "data"), VERBS, ids=[name for name, _, _ in VERBS])
def test_each_verb_sends_the_same_request_and_reads_the_same_answer_on_both_clients(name, args, data):
    sync_recorder, async_recorder = Recorder(ok(data)), Recorder(ok(data))
    sync_result = getattr(Client("http://orbit.test", TOKEN, transport=httpx.MockTransport(sync_recorder)), name)(*args)

    async def call() -> Any:
        async with AsyncClient("http://orbit.test", TOKEN, transport=httpx.MockTransport(async_recorder)) as client:
            pending = getattr(client, name)(*args)
            assert inspect.iscoroutine(pending)
            return await pending

    async_result = asyncio.run(call())
    assert async_result == sync_result
    assert [seen(r) for r in async_recorder.requests] == [seen(r) for r in sync_recorder.requests]
    (request,) = async_recorder.requests
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"


def test_the_async_client_maps_errors_as_the_sync_one_and_raises_argument_errors_when_awaited():
    body = {"request_id": REQUEST_ID, "error": {"code": "QUEUE_FULL", "message": "full"}}

    def respond(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/tasks":
            return httpx.Response(429, json=body, headers={"Retry-After": "3"})
        raise httpx.ConnectError("refused")

    async def scenario() -> None:
        async with AsyncClient("http://orbit.test", TOKEN, transport=httpx.MockTransport(respond)) as client:
            with pytest.raises(APIError) as caught:
                await client.submit_task("k", REQUEST)
            assert (caught.value.code, caught.value.status_code, caught.value.request_id) == (
                "QUEUE_FULL",
                429,
                REQUEST_ID,
            )
            assert caught.value.retry_after.total_seconds() == 3
            with pytest.raises(TransportError):
                await client.get_task(TASK_ID)
            pending = client.submit_task("k", None)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="request must be a SubmitTaskRequest"):
                await pending

    asyncio.run(scenario())


def test_async_client_from_credentials_file(tmp_path, monkeypatch):
    path = tmp_path / "creds.json"
    path.write_text(json.dumps({"url": "http://orbit.test", "token": TOKEN}))
    monkeypatch.setenv("ORBIT_CREDENTIALS_FILE", str(path))
    recorder = Recorder(ok(QUEUE))

    async def scenario() -> None:
        async with AsyncClient.from_credentials_file(transport=httpx.MockTransport(recorder)) as client:
            queue = await client.get_queue(QUEUE_ID)
        assert queue.id == QUEUE_ID

    asyncio.run(scenario())
    assert recorder.requests[0].headers["Authorization"] == f"Bearer {TOKEN}"


def is_key(arg: Any) -> bool:
    """An Idempotency-Key of the VERBS table: "k1", "k2", …"""
    return isinstance(arg, str) and re.fullmatch(r"k[0-9]+", arg) is not None


KEYED = [(name, args) for name, args, _ in VERBS if any(is_key(arg) for arg in args)]
IDS = {QUEUE_ID, APPLICATION["id"], PLAN_ID, TASK_ID, ATTEMPT_ID, POLICY["id"], KEY["key"]}
# The verbs whose first argument is a path segment (list_tasks's queue_id is a query parameter).
ADDRESSED = [
    (name, args)
    for name, args, _ in VERBS
    if name != "list_tasks" and args and isinstance(args[0], str) and args[0] in IDS
]


def call_on_both_clients(name: str, args: tuple[Any, ...]) -> tuple[list[Exception], Recorder]:
    """What `name(*args)` raised on a Client and on an AsyncClient (none: None), and what they sent."""
    recorder = Recorder(ok({}))
    raised: list[Exception] = []
    try:
        getattr(Client("http://orbit.test", TOKEN, transport=httpx.MockTransport(recorder)), name)(*args)
    except Exception as exc:
        raised.append(exc)

    async def call() -> None:
        async with AsyncClient("http://orbit.test", TOKEN, transport=httpx.MockTransport(recorder)) as client:
            await getattr(client, name)(*args)

    try:
        asyncio.run(call())
    except Exception as exc:
        raised.append(exc)
    return raised, recorder


@pytest.mark.parametrize("key", [None, 42])
@pytest.mark.parametrize(("name", "args"), KEYED, ids=[name for name, _ in KEYED])
def test_every_mutating_verb_refuses_a_missing_or_non_string_key_before_sending(name, args, key):
    assert len(KEYED) == 15  # every verb that takes an Idempotency-Key (submit_tasks: one per item)
    args = tuple(key if is_key(arg) else arg for arg in args)
    raised, recorder = call_on_both_clients(name, args)
    assert [type(exc) for exc in raised] == [TypeError, TypeError], raised
    assert all("Idempotency-Key" in str(exc) for exc in raised)
    assert recorder.requests == []


@pytest.mark.parametrize("key", [None, 42])
def test_a_batch_item_with_a_missing_or_non_string_key_is_refused_before_sending(key):
    raised, recorder = call_on_both_clients("submit_tasks", ([(key, REQUEST)],))
    assert [type(exc) for exc in raised] == [TypeError, TypeError], raised
    assert recorder.requests == []


@pytest.mark.parametrize("dots", [".", ".."])
@pytest.mark.parametrize(("name", "args"), ADDRESSED, ids=[name for name, _ in ADDRESSED])
def test_no_id_can_address_another_endpoint(name, args, dots):
    """Whatever the verb, an id (or concurrency key) of "." or ".." is one path segment with
    its dots percent-encoded, in the place of the id: never resolved into another path."""
    assert len(ADDRESSED) == 23
    real = Recorder(ok({}))
    with contextlib.suppress(ProtocolError):
        getattr(Client("http://orbit.test", TOKEN, transport=httpx.MockTransport(real)), name)(*args)
    raised, recorder = call_on_both_clients(name, (dots, *args[1:]))
    assert all(isinstance(exc, ProtocolError) for exc in raised)  # the canned answer, not the argument
    expected = real.last.url.raw_path.replace(quote(args[0], safe="").encode(), dots.replace(".", "%2E").encode())
    assert [request.url.raw_path for request in recorder.requests] == [expected, expected]


@pytest.mark.parametrize(("name", "args"), ADDRESSED, ids=[name for name, _ in ADDRESSED])
def test_an_id_that_is_not_a_string_is_a_type_error_before_sending(name, args):
    raised, recorder = call_on_both_clients(name, (42, *args[1:]))
    assert [type(exc) for exc in raised] == [TypeError, TypeError], raised
    assert all("must be a string, got int" in str(exc) for exc in raised)
    assert recorder.requests == []


def test_a_verb_read_on_the_class_can_be_called_with_the_client():
    recorder = Recorder(ok(QUEUE))
    client = Client("http://orbit.test", TOKEN, transport=httpx.MockTransport(recorder))
    assert Client.get_queue(client, QUEUE_ID).id == QUEUE_ID


# --------------------------------------------------------------------------- submit_tasks


def test_submit_tasks_sends_each_item_with_its_key_and_reads_each_result():
    recorder = Recorder(
        ok(
            {
                "results": [
                    {"idempotency_key": "a", "status": 201, "deduplicated": False, "task": TASK_SUMMARY},
                    {"idempotency_key": "b", "status": 200, "deduplicated": True, "task": TASK_SUMMARY},
                    {
                        "idempotency_key": "c",
                        "status": 429,
                        "error": {"code": "QUEUE_FULL", "message": "queue is full"},
                        "retry_after": 1,
                    },
                ]
            }
        )
    )
    client = Client("http://orbit.test", TOKEN, transport=httpx.MockTransport(recorder))
    other = SubmitTaskRequest(QUEUE_ID, "object.update", "v1", "v1", None, concurrency_key="object/42")
    results = client.submit_tasks([("a", REQUEST), ("b", REQUEST), ("c", other)])

    (request,) = recorder.requests
    assert (request.method, str(request.url)) == ("POST", "http://orbit.test/v1/tasks:batch")
    assert "Idempotency-Key" not in request.headers  # the items carry theirs
    assert json.loads(request.content) == {
        "tasks": [
            {"idempotency_key": "a", "task": REQUEST.to_json()},
            {"idempotency_key": "b", "task": REQUEST.to_json()},
            {"idempotency_key": "c", "task": other.to_json()},
        ]
    }
    assert [(r.idempotency_key, r.status, r.accepted, r.deduplicated) for r in results] == [
        ("a", 201, True, False),
        ("b", 200, True, True),
        ("c", 429, False, False),
    ]
    assert results[0].task is not None and results[0].task.id == TASK_ID
    refused = results[2]
    assert refused.task is None and isinstance(refused.error, APIError)
    assert (refused.error.code, refused.error.status_code, refused.error.message, refused.error.request_id) == (
        "QUEUE_FULL",
        429,
        "queue is full",
        REQUEST_ID,
    )
    assert refused.error.retry_after == datetime.timedelta(seconds=1)  # as a single submit's Retry-After
    assert isinstance(refused, BatchItemResult)


def test_a_batch_item_the_sdk_cannot_send_is_named_with_its_place_in_the_batch():
    recorder = Recorder(ok({"results": []}))
    client = Client("http://orbit.test", TOKEN, transport=httpx.MockTransport(recorder))
    when = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    unencodable = SubmitTaskRequest(QUEUE_ID, "h", "v1", "v1", {"when": when})
    with pytest.raises(TypeError, match=r"^tasks\[1\]\.task\.payload\.when: a datetime is not JSON"):
        client.submit_tasks({"ok": REQUEST, "late": unencodable})
    wrong_kind = SubmitTaskRequest(QUEUE_ID, "h", "v1", "v1", {}, priority="5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^batch item 'second': priority must be an int, got str$"):
        client.submit_tasks({"first": REQUEST, "second": wrong_kind})
    assert recorder.requests == []


def test_submit_tasks_takes_a_mapping_of_keys_to_requests():
    recorder = Recorder(
        ok({"results": [{"idempotency_key": "x", "status": 201, "deduplicated": False, "task": TASK_SUMMARY}]})
    )
    client = Client("http://orbit.test", TOKEN, transport=httpx.MockTransport(recorder))
    (result,) = client.submit_tasks({"x": REQUEST})
    assert result.accepted and json.loads(recorder.requests[0].content)["tasks"][0]["idempotency_key"] == "x"


@pytest.mark.parametrize(
    ("tasks", "error", "match"),
    [
        ({}, ValueError, "1 to 500 tasks, got 0"),
        ({f"k{n}": REQUEST for n in range(501)}, ValueError, "1 to 500 tasks, got 501"),
        ([("same", REQUEST), ("same", REQUEST)], ValueError, "given twice"),
        ([("", REQUEST)], ValueError, "Idempotency-Key"),
        ([("k", {"queue_id": QUEUE_ID})], TypeError, "request must be a SubmitTaskRequest"),
        (["k"], TypeError, "pairs of"),
        (
            {f"k{n}": replace(REQUEST, depends_on=[f"{m:032x}" for m in range(1000)]) for n in range(11)},
            ValueError,
            "at most 10000 depends_on entries in all, got 11000",
        ),
    ],
)
def test_submit_tasks_refuses_a_batch_the_server_could_not_take_before_sending(tasks, error, match):
    recorder = Recorder(ok({"results": []}))
    client = Client("http://orbit.test", TOKEN, transport=httpx.MockTransport(recorder))
    with pytest.raises(error, match=match):
        client.submit_tasks(tasks)
    assert recorder.requests == []


@pytest.mark.parametrize(
    "data",
    [
        {"results": []},
        {"results": [{"idempotency_key": "other", "status": 201, "deduplicated": False, "task": TASK_SUMMARY}]},
        {"results": [{"idempotency_key": "k", "status": 201}]},
        {"items": []},
    ],
)
def test_submit_tasks_answers_that_do_not_match_the_items_are_protocol_errors(data):
    client = Client("http://orbit.test", TOKEN, transport=httpx.MockTransport(Recorder(ok(data))))
    with pytest.raises(ProtocolError):
        client.submit_tasks({"k": REQUEST})


def test_a_refused_batch_raises_api_error():
    body = {"request_id": REQUEST_ID, "error": {"code": "INVALID_ARGUMENT", "message": "tasks[0].task: ..."}}
    client = Client(
        "http://orbit.test", TOKEN, transport=httpx.MockTransport(lambda request: httpx.Response(400, json=body))
    )
    with pytest.raises(APIError) as caught:
        client.submit_tasks({"k": REQUEST})
    assert caught.value.code == "INVALID_ARGUMENT"


def test_the_new_names_are_exported():
    assert orbit_sdk.AsyncClient is AsyncClient and orbit_sdk.BatchItemResult is BatchItemResult
