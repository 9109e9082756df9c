"""orbit_sdk.Client over httpx.MockTransport: envelopes, error mapping, uint64 and request bodies."""

from __future__ import annotations

import datetime
import json
import math
from typing import Any

import httpx
import pytest

import orbit_sdk
from orbit_sdk import (
    APIError,
    AsyncClient,
    Client,
    ConfigureQueueRequest,
    CreatePlanRequest,
    CreateQueueRequest,
    ProtocolError,
    ResolveTaskResult,
    RetryPolicy,
    SubmitTaskRequest,
    TransportError,
    UpdatePlanRequest,
)
from orbit_sdk._client import parse_retry_after
from tests.support.sdk import (
    APPLICATION,
    ATTEMPT,
    ATTEMPT_ID,
    NAMESPACE_ID,
    PLAN,
    QUEUE,
    QUEUE_ID,
    REQUEST_ID,
    TASK_ID,
    TASK_SUMMARY,
    TOKEN,
    Recorder,
    client_for,
    ok,
)

UTC = datetime.UTC


# --------------------------------------------------------------------------- public surface


def test_all_lists_exactly_the_public_names():
    public = {
        name
        for name, value in vars(orbit_sdk).items()
        if not name.startswith("_") and not isinstance(value, type(orbit_sdk))
    }
    assert sorted(orbit_sdk.__all__) == sorted(public)
    assert set(orbit_sdk.__all__) == {
        "APIError",
        "Application",
        "AsyncClient",
        "Attempt",
        "BatchItem",
        "BatchItemResult",
        "Blocker",
        "CancelRequested",
        "CancelTaskResult",
        "Client",
        "ConcurrencyKey",
        "ConcurrencyKeyHolder",
        "ConfigureApplicationResult",
        "ConfigureKeyPolicyRequest",
        "ConfigureQueueRequest",
        "CreateKeyPolicyRequest",
        "CreatePlanRequest",
        "CreateQueueRequest",
        "CreateQueueResult",
        "Credentials",
        "CredentialsError",
        "Dependency",
        "Event",
        "EventPage",
        "Execution",
        "KeyMatch",
        "KeyPolicy",
        "KeyPolicyResult",
        "KeyRate",
        "OrbitError",
        "Page",
        "Plan",
        "PlanResult",
        "PlanTrigger",
        "ProtocolError",
        "Queue",
        "RetryPolicy",
        "ResolveTaskResult",
        "RetryableError",
        "SubmitTaskRequest",
        "SubmitTaskResult",
        "Task",
        "TaskBlockers",
        "TaskInfo",
        "TaskLink",
        "TransportError",
        "UnknownOutcome",
        "UpdatePlanRequest",
        "Worker",
        "load_credentials",
    }


def test_importing_the_sdk_does_not_import_django():
    import subprocess
    import sys

    code = "import sys, orbit_sdk; assert 'django' not in sys.modules, 'django imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_exception_hierarchy():
    for cls in (APIError, TransportError, ProtocolError, orbit_sdk.CredentialsError):
        assert issubclass(cls, orbit_sdk.OrbitError)
    for cls in (orbit_sdk.RetryableError, orbit_sdk.UnknownOutcome, orbit_sdk.CancelRequested):
        assert issubclass(cls, orbit_sdk.OrbitError)


# --------------------------------------------------------------------------- queues


def test_create_queue_sends_key_and_omits_unset_fields():
    recorder = Recorder(ok({"deduplicated": False, "queue": QUEUE}, status=201))
    with client_for(recorder) as client:
        result = client.create_queue("queue-images-v1", CreateQueueRequest("images", 8, 100))

    request = recorder.last
    assert (request.method, str(request.url)) == ("POST", "http://orbit.test/v1/queues")
    assert request.headers["Idempotency-Key"] == "queue-images-v1"
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert request.headers["Content-Type"] == "application/json"
    assert recorder.body() == {"name": "images", "max_concurrency": 8, "rate_per_second": 100}
    assert result == orbit_sdk.CreateQueueResult(
        deduplicated=False,
        queue=orbit_sdk.Queue(
            id=QUEUE_ID,
            namespace_id=NAMESPACE_ID,
            name="images",
            paused=False,
            max_concurrency=8,
            rate_per_second=100,
            max_unfinished_tasks=100000,
            unfinished_tasks=0,
            revision=1,
            retired_at=None,
        ),
    )


def test_create_queue_sends_max_unfinished_tasks_when_given():
    recorder = Recorder(ok({"deduplicated": True, "queue": QUEUE}))
    result = client_for(recorder).create_queue("k", CreateQueueRequest("images", 8, 100, max_unfinished_tasks=2))
    assert recorder.body()["max_unfinished_tasks"] == 2
    assert result.deduplicated is True


def test_uint64_fields_are_parsed_exactly():
    big = "18446744073709551615"
    recorder = Recorder(ok({**QUEUE, "unfinished_tasks": big, "revision": big, "retired_at": "2026-11-29T20:00:00Z"}))
    queue = client_for(recorder).get_queue(QUEUE_ID)
    assert queue.unfinished_tasks == 2**64 - 1 and type(queue.unfinished_tasks) is int
    assert queue.revision == 18446744073709551615
    assert queue.retired_at == datetime.datetime(2026, 11, 29, 20, 0, tzinfo=UTC)
    assert str(recorder.last.url) == f"http://orbit.test/v1/queues/{QUEUE_ID}"


@pytest.mark.parametrize("bad", ["1.0", "01", "-1", "1e3", " 1", "", "18446744073709551616", 1, None])
def test_a_uint64_that_is_not_a_canonical_string_is_a_protocol_error(bad):
    recorder = Recorder(ok({**QUEUE, "revision": bad}))
    with pytest.raises(ProtocolError):
        client_for(recorder).get_queue(QUEUE_ID)


def test_an_old_receipt_without_the_newer_queue_fields_reads_them_as_zero():
    old = {k: v for k, v in QUEUE.items() if k not in ("max_concurrency", "rate_per_second", "unfinished_tasks")}
    queue = client_for(Recorder(ok(old))).get_queue(QUEUE_ID)
    assert (queue.max_concurrency, queue.rate_per_second, queue.unfinished_tasks) == (0, 0, 0)


def test_configure_queue_sends_the_full_replacement_with_revision_as_string():
    recorder = Recorder(ok({"deduplicated": False, "queue": {**QUEUE, "paused": True, "revision": "2"}}))
    request = ConfigureQueueRequest(
        expected_revision=1,
        reason="limit background traffic",
        paused=True,
        max_concurrency=2,
        rate_per_second=1,
        max_unfinished_tasks=100,
    )
    result = client_for(recorder).configure_queue(QUEUE_ID, "queue-control-001", request)
    assert str(recorder.last.url) == f"http://orbit.test/v1/queues/{QUEUE_ID}:configure"
    assert recorder.last.headers["Idempotency-Key"] == "queue-control-001"
    assert recorder.body() == {
        "expected_revision": "1",
        "reason": "limit background traffic",
        "paused": True,
        "max_concurrency": 2,
        "rate_per_second": 1,
        "max_unfinished_tasks": 100,
    }
    assert result.queue.revision == 2 and result.queue.paused is True


def test_retire_queue():
    recorder = Recorder(ok({"deduplicated": False, "queue": {**QUEUE, "retired_at": "2026-11-29T21:00:00Z"}}))
    result = client_for(recorder).retire_queue(QUEUE_ID, "retire-1", 3, "no longer used")
    assert str(recorder.last.url) == f"http://orbit.test/v1/queues/{QUEUE_ID}:retire"
    assert recorder.body() == {"expected_revision": "3", "reason": "no longer used"}
    assert result.queue.retired_at is not None


def test_list_queues_passes_paging_and_returns_a_page():
    recorder = Recorder(ok({"items": [QUEUE], "next_page_token": "abc"}))
    page = client_for(recorder).list_queues(page_size=1, page_token="xyz")
    assert recorder.last.url.params == httpx.QueryParams({"page_size": "1", "page_token": "xyz"})
    assert [queue.id for queue in page.items] == [QUEUE_ID]
    assert page.next_page_token == "abc"

    last = client_for(Recorder(ok({"items": [], "next_page_token": ""}))).list_queues()
    assert last == orbit_sdk.Page(items=[], next_page_token=None)


# --------------------------------------------------------------------------- tasks


def test_submit_task_omits_unset_fields_and_formats_times_in_utc():
    recorder = Recorder(ok({"deduplicated": False, "task": {**TASK_SUMMARY, "payload": {"a": 1}}}, status=201))
    minimal = SubmitTaskRequest(QUEUE_ID, "object.update", "v1", "v1", {"a": 1})
    result = client_for(recorder).submit_task("submit-1", minimal)
    assert recorder.last.headers["Idempotency-Key"] == "submit-1"
    assert str(recorder.last.url) == "http://orbit.test/v1/tasks"
    assert recorder.body() == {
        "queue_id": QUEUE_ID,
        "handler": "object.update",
        "handler_version": "v1",
        "payload_version": "v1",
        "payload": {"a": 1},
    }
    assert result.task.payload == {"a": 1} and result.deduplicated is False

    plus_eight = datetime.timezone(datetime.timedelta(hours=8))
    full = SubmitTaskRequest(
        queue_id=QUEUE_ID,
        handler="object.update",
        handler_version="v1",
        payload_version="v1",
        payload=None,
        business_key="order-1",
        concurrency_key="object/42",
        priority=9,
        available_at=datetime.datetime(2026, 11, 30, 4, 0, tzinfo=plus_eight),
        start_deadline_at=datetime.datetime(2026, 11, 29, 21, 0, 0, 500000, tzinfo=UTC),
        deadline_at=datetime.datetime(2026, 11, 29, 22, 0, tzinfo=UTC),
        max_attempts=5,
        retry=RetryPolicy(initial_seconds=2, max_seconds=60),
        lease_seconds=60,
    )
    client_for(recorder).submit_task("submit-2", full)
    assert recorder.body() == {
        "queue_id": QUEUE_ID,
        "handler": "object.update",
        "handler_version": "v1",
        "payload_version": "v1",
        "payload": None,
        "business_key": "order-1",
        "concurrency_key": "object/42",
        "priority": 9,
        "available_at": "2026-11-29T20:00:00Z",
        "start_deadline_at": "2026-11-29T21:00:00.500000Z",
        "deadline_at": "2026-11-29T22:00:00Z",
        "max_attempts": 5,
        "retry": {"initial_seconds": 2, "max_seconds": 60},
        "lease_seconds": 60,
    }


def test_submit_task_refuses_a_naive_datetime_before_sending():
    recorder = Recorder(ok({}))
    request = SubmitTaskRequest(QUEUE_ID, "h", "v1", "v1", {}, available_at=datetime.datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="naive"):
        client_for(recorder).submit_task("k", request)
    assert recorder.requests == []


@pytest.mark.parametrize("key", ["", "x" * 256, "caf\u00e9", "line\nbreak"])
def test_an_invalid_idempotency_key_is_refused_before_sending(key):
    recorder = Recorder(ok({}))
    with pytest.raises(ValueError):
        client_for(recorder).submit_task(key, SubmitTaskRequest(QUEUE_ID, "h", "v1", "v1", {}))
    assert recorder.requests == []


@pytest.mark.parametrize("key", [None, 42, b"submit-1"], ids=repr)
def test_a_missing_or_non_string_idempotency_key_is_refused_before_sending(key: Any):
    """A key that is None (an unset variable) or not a string is a TypeError naming the
    Idempotency-Key, raised before anything is sent: the server would refuse a POST without
    one only after a round trip."""
    recorder = Recorder(ok({"deduplicated": False, "task": TASK_SUMMARY}))
    with pytest.raises(TypeError, match="Idempotency-Key"):
        client_for(recorder).submit_task(key, SubmitTaskRequest(QUEUE_ID, "h", "v1", "v1", {}))
    assert recorder.requests == []


def test_retry_given_as_a_dict_is_a_type_error_naming_retry():
    """``retry`` takes a RetryPolicy; the HTTP API's object given as a dict (a natural guess) is
    a TypeError that says so, raised before anything is sent."""
    recorder = Recorder(ok({}))
    request = SubmitTaskRequest(QUEUE_ID, "h", "v1", "v1", {}, retry={"initial_seconds": 5})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="retry must be a RetryPolicy"):
        client_for(recorder).submit_task("k", request)
    assert recorder.requests == []


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"payload": {"when": datetime.datetime(2030, 1, 1, tzinfo=UTC)}}, "payload.when"),
        ({"payload": {"ids": {1, 2}}}, "payload.ids"),
        ({"payload": {"ratio": math.nan}}, "payload.ratio"),
        ({"payload": [1, {"limit": math.inf}]}, "payload[1].limit"),
        ({"payload": {"text": "\ud800"}}, "payload.text"),
        ({"payload": {"\ud800": 1}}, "payload['\\ud800']"),
        ({"payload": {(1, 2): "pair"}}, "payload[(1, 2)]"),
        ({"payload": b"raw"}, "payload"),
        ({"available_at": "2030-01-01T00:00:00Z"}, "available_at"),
        ({"deadline_at": 1893456000}, "deadline_at"),
        ({"priority": "5"}, "priority"),
        ({"max_attempts": 3.0}, "max_attempts"),
        ({"lease_seconds": True}, "lease_seconds"),
        ({"queue_id": None}, "queue_id"),
        ({"business_key": 42}, "business_key"),
        ({"retry": RetryPolicy(initial_seconds="5")}, "retry.initial_seconds"),  # type: ignore[arg-type]
        ({"retry": RetryPolicy(max_seconds=math.nan)}, "retry.max_seconds"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_a_field_the_sdk_cannot_send_is_named_in_the_error(fields: dict[str, Any], name: str):
    """A payload the SDK cannot encode as JSON (a datetime, a set, NaN or infinity, a lone
    surrogate), or a field of the wrong kind (a time given as a string, a number as a string),
    is a TypeError or ValueError that names the field, down to the place in the payload,
    raised before anything is sent. (Values of the right kind are the server's to judge.)"""
    recorder = Recorder(ok({}))
    arguments: dict[str, Any] = {
        "queue_id": QUEUE_ID,
        "handler": "h",
        "handler_version": "v1",
        "payload_version": "v1",
        "payload": {},
    }
    request = SubmitTaskRequest(**{**arguments, **fields})
    with pytest.raises((TypeError, ValueError)) as raised:
        client_for(recorder).submit_task("k", request)
    assert str(raised.value).startswith(name), f"{type(raised.value).__name__}: {raised.value}"
    assert recorder.requests == []


def test_get_task_detail_and_summary_optional_fields():
    detail = {
        **TASK_SUMMARY,
        "payload": [1, 2],
        "business_key": "order-1",
        "concurrency_key": "object/42",
        "state": "SUCCEEDED",
        "attempts": 1,
        "finished_at": "2026-11-29T20:00:05Z",
        "output": {"ok": True},
    }
    task = client_for(Recorder(ok(detail))).get_task(TASK_ID)
    assert task.payload == [1, 2] and task.output == {"ok": True}
    assert (task.business_key, task.concurrency_key) == ("order-1", "object/42")
    assert task.finished_at == datetime.datetime(2026, 11, 29, 20, 0, 5, tzinfo=UTC)
    assert task.created_at.microsecond == 123456 and task.created_at.tzinfo is not None

    recorder = Recorder(ok({"items": [TASK_SUMMARY], "next_page_token": ""}))
    page = client_for(recorder).list_tasks(queue_id=QUEUE_ID, state="WAITING", concurrency_key="object/42")
    assert recorder.last.url.params == httpx.QueryParams(
        {"queue_id": QUEUE_ID, "state": "WAITING", "concurrency_key": "object/42"}
    )
    summary = page.items[0]
    assert summary.payload is None and summary.business_key is None and summary.concurrency_key is None
    assert summary.start_deadline_at is None and summary.finished_at is None and summary.last_error is None
    assert summary.attempts == 0 and page.next_page_token is None


def test_attempts_parse_the_token_as_an_int():
    recorder = Recorder(ok({"items": [ATTEMPT, {**ATTEMPT, "concurrency_token": "18446744073709551615"}]}))
    page = client_for(recorder).list_attempts(TASK_ID)
    assert str(recorder.last.url) == f"http://orbit.test/v1/tasks/{TASK_ID}/attempts"
    assert [attempt.concurrency_token for attempt in page.items] == [17, 2**64 - 1]
    recorder = Recorder(ok({"items": [ATTEMPT], "next_page_token": "Mg"}))
    page = client_for(recorder).list_attempts(TASK_ID, page_size=1, page_token="MQ")
    assert recorder.last.url.params == httpx.QueryParams({"page_size": "1", "page_token": "MQ"})
    assert page.next_page_token == "Mg"

    keyless = {k: v for k, v in ATTEMPT.items() if k not in ("concurrency_token", "number", "started_at")}
    attempt = client_for(Recorder(ok(keyless))).get_attempt(ATTEMPT_ID)
    assert (attempt.concurrency_token, attempt.number, attempt.started_at) == (None, None, None)

    with pytest.raises(ProtocolError):
        client_for(Recorder(ok({**ATTEMPT, "concurrency_token": 17}))).get_attempt(ATTEMPT_ID)


def test_cancel_task():
    recorder = Recorder(ok({"deduplicated": False, "task": {**TASK_SUMMARY, "state": "CANCELLED"}}))
    result = client_for(recorder).cancel_task(TASK_ID, "cancel-1", "not needed")
    assert str(recorder.last.url) == f"http://orbit.test/v1/tasks/{TASK_ID}:cancel"
    assert recorder.last.headers["Idempotency-Key"] == "cancel-1"
    assert recorder.body() == {"reason": "not needed"}
    assert result.task.state == "CANCELLED" and result.deduplicated is False


def test_resolve_task():
    recorder = Recorder(ok({"deduplicated": True, "task": {**TASK_SUMMARY, "state": "WAITING"}}))
    result = client_for(recorder).resolve_task(TASK_ID, "resolve-1", "RETRY", "ledger shows no write")
    assert str(recorder.last.url) == f"http://orbit.test/v1/tasks/{TASK_ID}:resolve"
    assert recorder.last.headers["Idempotency-Key"] == "resolve-1"
    assert recorder.body() == {"resolution": "RETRY", "reason": "ledger shows no write"}
    assert isinstance(result, ResolveTaskResult)
    assert result.task.state == "WAITING" and result.deduplicated is True


def test_application_get_and_configure():
    recorder = Recorder(ok(APPLICATION))
    application = client_for(recorder).get_application(APPLICATION["id"])
    assert str(recorder.last.url) == f"http://orbit.test/v1/applications/{APPLICATION['id']}"
    assert application.active_attempts == 2**64 - 1 and application.revision == 2

    recorder = Recorder(ok({"deduplicated": False, "application": APPLICATION}))
    result = client_for(recorder).configure_application(APPLICATION["id"], "cfg-1", 1, "cap", 3, 2)
    assert str(recorder.last.url) == f"http://orbit.test/v1/applications/{APPLICATION['id']}:configure"
    assert recorder.last.headers["Idempotency-Key"] == "cfg-1"
    assert recorder.body() == {
        "expected_revision": "1",
        "reason": "cap",
        "max_active_attempts": 3,
        "max_unfinished_tasks": 2,
    }
    assert result.application.max_unfinished_tasks == 2 and result.deduplicated is False


def test_list_events_pages_by_cursor():
    event = {
        "cursor": "41",
        "type": "task.state_changed",
        "subject_id": TASK_ID,
        "data": {"queue_id": QUEUE_ID, "state": "WAITING"},
        "created_at": "2026-11-30T10:00:00.5Z",
    }
    recorder = Recorder(ok({"items": [event], "next_cursor": "41"}))
    page = client_for(recorder).list_events(after=40, page_size=10)
    assert recorder.last.url.params == httpx.QueryParams({"after": "40", "page_size": "10"})
    assert page.next_cursor == 41 and page.items[0].cursor == 41
    assert page.items[0].data["state"] == "WAITING"
    assert page.items[0].created_at == datetime.datetime(2026, 11, 30, 10, 0, 0, 500000, tzinfo=UTC)
    client_for(recorder).list_events()
    assert "after" not in recorder.last.url.params
    with pytest.raises(ProtocolError):
        client_for(Recorder(ok({"items": [{**event, "cursor": 41}], "next_cursor": "41"}))).list_events()


def test_plans():
    recorder = Recorder(ok({"deduplicated": False, "plan": PLAN}))
    request = CreatePlanRequest(
        name="nightly",
        queue_id=QUEUE_ID,
        schedule=PLAN["schedule"],
        misfire=PLAN["misfire"],
        task=PLAN["definition"]["task"],
    )
    result = client_for(recorder).create_plan("plan-1", request)
    assert str(recorder.last.url) == "http://orbit.test/v1/plans"
    assert recorder.last.headers["Idempotency-Key"] == "plan-1"
    assert recorder.body() == {k: PLAN[k] for k in ("name", "queue_id", "schedule", "misfire", "definition")}
    assert result.plan.next_fire_at == datetime.datetime(2026, 12, 1, 1, 30, tzinfo=UTC)
    assert result.plan.revision == 1 and result.deduplicated is False

    paused = {k: v for k, v in PLAN.items() if k != "next_fire_at"} | {"state": "PAUSED", "revision": "2"}
    recorder = Recorder(ok({"deduplicated": False, "plan": paused}))
    result = client_for(recorder).pause_plan(PLAN["id"], "pause-2", 1, "holiday")
    assert str(recorder.last.url) == f"http://orbit.test/v1/plans/{PLAN['id']}:pause"
    assert recorder.body() == {"expected_revision": "1", "reason": "holiday"}
    assert result.plan.state == "PAUSED" and result.plan.next_fire_at is None

    update = UpdatePlanRequest(2, "hourly", {"interval_seconds": 3600}, {"policy": "SKIP"}, {"handler": "x"})
    client_for(recorder).update_plan(PLAN["id"], "u-1", update)
    assert str(recorder.last.url) == f"http://orbit.test/v1/plans/{PLAN['id']}:update"
    assert recorder.body()["definition"] == {"task": {"handler": "x"}}

    trigger = {"scheduled_at": "2026-12-01T01:30:00Z", "version": 1, "outcome": "SKIPPED", "reason": "missed its time"}
    recorder = Recorder(ok({"items": [{**trigger, "decided_at": "2026-12-01T01:31:00Z"}], "next_page_token": ""}))
    page = client_for(recorder).list_plan_triggers(PLAN["id"], page_size=5)
    assert str(recorder.last.url) == f"http://orbit.test/v1/plans/{PLAN['id']}/triggers?page_size=5"
    assert (page.items[0].outcome, page.items[0].reason, page.items[0].task_id) == ("SKIPPED", "missed its time", None)


def test_path_segments_are_quoted():
    recorder = Recorder(ok(QUEUE))
    client_for(recorder).get_queue("a/../b")
    assert recorder.last.url.raw_path == b"/v1/queues/a%2F..%2Fb"


@pytest.mark.parametrize("task_id", [".", ".."])
def test_a_dot_id_stays_one_path_segment(task_id: str):
    """An id of "." or ".." has its dots percent-encoded, as a concurrency key's: a URL parser
    would take it for a dot segment and resolve it (httpx does), and ``get_task(".")`` would
    ask ``GET /v1/tasks``, the task list. The server answers such an id NOT_FOUND."""
    recorder = Recorder(ok(TASK_SUMMARY))
    client_for(recorder).get_task(task_id)
    assert recorder.last.url.raw_path == b"/v1/tasks/" + task_id.replace(".", "%2E").encode()


@pytest.mark.parametrize("task_id", [None, 42, b"55555555555555555555555555555555"], ids=repr)
def test_an_id_that_is_not_a_string_is_a_type_error_naming_it(task_id: Any):
    recorder = Recorder(ok(TASK_SUMMARY))
    with pytest.raises(TypeError, match="task_id must be a string"):
        client_for(recorder).get_task(task_id)
    assert recorder.requests == []


# --------------------------------------------------------------------------- errors


def test_queue_full_maps_to_api_error_with_retry_after():
    body = {
        "request_id": REQUEST_ID,
        "error": {
            "code": "QUEUE_FULL",
            "message": "queue unfinished task limit reached; retry later using the original identity",
        },
    }
    recorder = Recorder(lambda request: httpx.Response(429, json=body, headers={"Retry-After": "1"}))
    with pytest.raises(APIError) as caught:
        client_for(recorder).submit_task("k", SubmitTaskRequest(QUEUE_ID, "h", "v1", "v1", {}))
    error = caught.value
    assert (error.code, error.status_code, error.request_id) == ("QUEUE_FULL", 429, REQUEST_ID)
    assert error.message == "queue unfinished task limit reached; retry later using the original identity"
    assert error.retry_after == datetime.timedelta(seconds=1)
    assert "QUEUE_FULL" in str(error)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("1", 1),
        (None, 0),
        ("abc", 0),
        ("-1", 0),
        ("3601", 0),
        ("3600", 3600),
        ("0", 0),
        ("1.5", 0),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0),
        ("99999999999999999999999", 0),
        ("9" * 4301, 0),  # past int()'s 4,300-digit limit: still 0, not a ValueError
        ("0" * 5000 + "5", 5),
        (" 0042 ", 42),
    ],
    ids=lambda value: value[:24] + "…" if isinstance(value, str) and len(value) > 24 else None,
)
def test_retry_after_parsing(header, expected):
    assert parse_retry_after(header) == datetime.timedelta(seconds=expected)
    headers = {} if header is None else {"Retry-After": header}
    body = {"request_id": REQUEST_ID, "error": {"code": "UNAVAILABLE", "message": "db"}}
    recorder = Recorder(lambda request: httpx.Response(503, json=body, headers=headers))
    with pytest.raises(APIError) as caught:
        client_for(recorder).get_queue(QUEUE_ID)
    assert caught.value.retry_after == datetime.timedelta(seconds=expected)


@pytest.mark.parametrize(
    ("status", "code"),
    [(502, "UNAVAILABLE"), (503, "UNAVAILABLE"), (504, "UNAVAILABLE"), (500, "INTERNAL"), (404, "INTERNAL")],
)
def test_an_error_without_an_envelope_still_is_an_api_error(status, code):
    recorder = Recorder(
        lambda request: httpx.Response(status, text="<html>bad gateway</html>", headers={"X-Request-Id": "rid"})
    )
    with pytest.raises(APIError) as caught:
        client_for(recorder).get_task(TASK_ID)
    assert (caught.value.code, caught.value.status_code, caught.value.request_id) == (code, status, "rid")
    assert caught.value.retry_after == datetime.timedelta(0)


def test_envelope_errors_map_code_message_and_request_id():
    body = {"request_id": REQUEST_ID, "error": {"code": "IDEMPOTENCY_CONFLICT", "message": "key reused"}}
    recorder = Recorder(lambda request: httpx.Response(409, json=body))
    with pytest.raises(APIError) as caught:
        client_for(recorder).create_queue("k", CreateQueueRequest("images", 1, 1))
    assert (caught.value.code, caught.value.status_code, caught.value.message) == (
        "IDEMPOTENCY_CONFLICT",
        409,
        "key reused",
    )


def test_a_success_without_an_envelope_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        client_for(Recorder(lambda request: httpx.Response(200, text="ok"))).get_queue(QUEUE_ID)
    with pytest.raises(ProtocolError):
        client_for(Recorder(lambda request: httpx.Response(200, json={"queue": QUEUE}))).get_queue(QUEUE_ID)


def test_writes_are_never_resent_on_5xx():
    body = {"request_id": REQUEST_ID, "error": {"code": "UNAVAILABLE", "message": "database unavailable"}}
    recorder = Recorder(lambda request: httpx.Response(503, json=body, headers={"Retry-After": "1"}))
    with pytest.raises(APIError):
        client_for(recorder).submit_task("k", SubmitTaskRequest(QUEUE_ID, "h", "v1", "v1", {}))
    assert len(recorder.requests) == 1


@pytest.mark.parametrize("failure", [httpx.ConnectError("refused"), httpx.ReadTimeout("slow")])
def test_writes_are_never_resent_on_transport_errors(failure):
    def respond(request: httpx.Request) -> httpx.Response:
        raise failure

    recorder = Recorder(respond)
    with pytest.raises(TransportError) as caught:
        client_for(recorder).submit_task("k", SubmitTaskRequest(QUEUE_ID, "h", "v1", "v1", {}))
    assert len(recorder.requests) == 1
    assert caught.value.__cause__ is failure


# --------------------------------------------------------------------------- credentials


def test_from_credentials_file_reads_the_env_var(tmp_path, monkeypatch):
    path = tmp_path / "creds.json"
    path.write_text(
        json.dumps({"url": "http://orbit.test", "token": TOKEN, "queue_id": QUEUE_ID, "scopes": ["tasks:submit"]})
    )
    monkeypatch.setenv("ORBIT_CREDENTIALS_FILE", str(path))
    credentials = orbit_sdk.load_credentials()
    assert (credentials.url, credentials.token, credentials.queue_id) == ("http://orbit.test", TOKEN, QUEUE_ID)
    assert credentials.scopes == ("tasks:submit",)
    assert TOKEN not in repr(credentials)

    recorder = Recorder(ok(QUEUE))
    client = Client.from_credentials_file(transport=httpx.MockTransport(recorder))
    client.get_queue(QUEUE_ID)
    assert recorder.last.headers["Authorization"] == f"Bearer {TOKEN}"
    assert str(recorder.last.url).startswith("http://orbit.test/v1/queues/")


def test_credentials_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("ORBIT_CREDENTIALS_FILE", raising=False)
    with pytest.raises(orbit_sdk.CredentialsError):
        orbit_sdk.load_credentials()
    with pytest.raises(orbit_sdk.CredentialsError):
        orbit_sdk.load_credentials(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"url": "http://x"}))
    with pytest.raises(orbit_sdk.CredentialsError):
        orbit_sdk.load_credentials(bad)


@pytest.mark.parametrize("base", ["http://127.0.0.1:8080", "https://orbit.example/behind/a/prefix", "http://h:1/a/"])
@pytest.mark.parametrize(
    "path", ["/v1/tasks", "/v1/tasks:batch", f"/v1/tasks/{TASK_ID}/attempts", "/v1/queues/a%2Fb%20c:configure"]
)
def test_request_urls_are_the_ones_httpx_would_join(base: str, path: str) -> None:
    seen: list[httpx.URL] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url)
        return httpx.Response(200, json={"request_id": REQUEST_ID, "data": [TASK_SUMMARY]})

    client = orbit_sdk.Client(base, TOKEN, transport=httpx.MockTransport(handler))
    client._request("GET", path, params={"page_size": 5})
    client._request("GET", path)
    joined = httpx.Client(base_url=base.rstrip("/")).build_request("GET", path, params={"page_size": 5}).url
    assert [str(url) for url in seen] == [str(joined), str(joined.copy_with(query=None))]


def test_a_cookie_set_in_front_of_the_server_is_sent_back() -> None:
    """The jar is read only when a response sets a cookie, but then as httpx reads it (a sticky session)."""
    sent: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("cookie"))
        headers = {"Set-Cookie": "lb=node-2; Path=/"} if len(sent) == 2 else {}
        return httpx.Response(200, json={"request_id": REQUEST_ID, "data": QUEUE}, headers=headers)

    client = orbit_sdk.Client("http://orbit.test", TOKEN, transport=httpx.MockTransport(handler))
    for _ in range(4):
        client.get_queue(QUEUE_ID)
    assert sent == [None, None, "lb=node-2", "lb=node-2"]


@pytest.mark.parametrize(
    ("url", "token", "message"),
    [
        ("http://orbit", "", "token must be a non-empty string"),
        ("http://orbit", "orb_x\n", "token must be a non-empty string"),
        ("http://orbit", "tök", "token must be a non-empty string"),
        ("orbit:8000", "orb_x", "url must be an http:// or https:// URL"),
    ],
)
def test_a_client_that_could_never_send_is_refused_when_made(url, token, message):
    # (not as a TransportError at the first call, which would say "outcome unknown, send again")
    with pytest.raises(ValueError, match=message):
        orbit_sdk.Client(url, token)


@pytest.mark.parametrize(
    ("url", "token", "message"),
    [
        ("http://orbit", None, "token must be a string, got NoneType"),
        (None, "orb_x", "url must be a string, got NoneType"),
        (b"http://orbit", "orb_x", "url must be a string, got bytes"),
    ],
)
def test_a_client_url_or_token_of_the_wrong_kind_is_a_type_error(url, token, message):
    with pytest.raises(TypeError, match=message):
        orbit_sdk.Client(url, token)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"queue_id": 5}, "queue_id must be a string, got int"),
        ({"state": ["WAITING"]}, "state must be a string, got list"),
        ({"page_size": "2"}, "page_size must be an int, got str"),
        ({"page_size": 2.5}, "page_size must be an int, got float"),
        ({"page_size": True}, "page_size must be an int, got bool"),
        ({"page_token": 7}, "page_token must be a string, got int"),
    ],
    ids=repr,
)
def test_a_list_filter_of_the_wrong_kind_is_refused_before_sending(arguments, message):
    sent: list[httpx.Request] = []
    client = orbit_sdk.Client("http://orbit.test", TOKEN, transport=httpx.MockTransport(sent.append))
    with pytest.raises(TypeError, match=message):
        client.list_tasks(**arguments)
    assert sent == []


@pytest.mark.parametrize("client_class", [Client, AsyncClient])
@pytest.mark.parametrize(
    ("timeout", "error"),
    [(-1, ValueError), (0, ValueError), (math.nan, ValueError), (math.inf, ValueError), ("10", TypeError)]
    + [(True, TypeError)],
    ids=repr,
)
def test_a_timeout_that_cannot_work_is_refused_when_the_client_is_made(
    client_class: type[Client] | type[AsyncClient], timeout: Any, error: type[Exception]
):
    """``timeout`` is None (no timeout) or a finite number of seconds above zero, checked when
    the client is made as url and token are: not at the first request, deep inside the socket
    module, nor as a TransportError ("outcome unknown, send again") for a request that could
    never be sent."""
    with pytest.raises(error, match="timeout"):
        client_class("http://127.0.0.1:1", TOKEN, timeout=timeout)


@pytest.mark.parametrize("timeout", [None, 0.25, 30])
def test_a_timeout_of_none_or_seconds_is_taken(timeout: float | None):
    client = Client("http://127.0.0.1:1", TOKEN, timeout=timeout)
    assert client._http.timeout == httpx.Timeout(timeout)


def test_arguments_no_request_could_carry_are_refused_before_sending():
    sent: list[httpx.Request] = []
    client = orbit_sdk.Client(
        "http://orbit",
        "orb_x",
        transport=httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(500)),
    )
    with pytest.raises(TypeError, match="request must be a SubmitTaskRequest, got NoneType"):
        client.submit_task("k", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request must be a CreateQueueRequest, got dict"):
        client.create_queue("k", {"name": "q"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="GET /v1/tasks/xxx"):
        client.get_task("x" * 100_000)
    assert sent == []
