"""POST /v1/tasks (SPEC §5, queues seed "HTTP 429 QUEUE_FULL")."""

from __future__ import annotations

import time
from datetime import timedelta, timezone

import pytest

from orbit.models import IdempotencyRecord
from tasks.models import Task
from tests.conftest import api_client, post_json
from tests.support.api import HEX32, assert_error, assert_invalid, assert_ok, make_queue, parse_time
from tests.support.factories import NamespaceFactory, make_credential
from tests.support.tasks import (
    QUEUE_FULL_ERROR,
    TASK_REQUIRED_KEYS,
    cancel,
    configure_queue,
    get_queue,
    idempotency_records,
    in_seconds,
    now,
    rfc3339,
    submit,
    submit_ok,
    task_body,
)

pytestmark = pytest.mark.django_db

MAX_PAYLOAD = 256 * 1024


@pytest.fixture
def queue(tenant):
    return make_queue(tenant.client, "work")


def assert_rejected_without_trace(tenant, key: str) -> None:
    """A rejected request leaves no task and no idempotency record behind."""
    assert Task.objects.count() == 0
    assert idempotency_records(tenant.namespace_id, key) == 0


# --- acceptance -------------------------------------------------------------


def test_minimal_task_is_accepted_waiting_with_defaults(tenant, queue):
    # given an empty queue
    before = now()
    # when a task with only the required fields is submitted
    data = assert_ok(submit(tenant.client, queue["id"], "t-1"), 201)
    # then 201 with the task, WAITING, defaults applied, empty optionals omitted
    assert data["deduplicated"] is False
    task = data["task"]
    assert set(task) == TASK_REQUIRED_KEYS | {"payload"}, task
    assert HEX32.fullmatch(task["id"])
    assert task["namespace_id"] == tenant.namespace_id and task["queue_id"] == queue["id"]
    assert (task["handler"], task["handler_version"], task["payload_version"]) == ("echo", "v1", "v1")
    assert task["payload"] == {"n": 1}
    assert task["state"] == "WAITING"
    assert task["priority"] == 5 and task["max_attempts"] == 3 and task["attempts"] == 0
    assert task["cancel_requested"] is False
    created = parse_time(task["created_at"])
    assert before - timedelta(seconds=1) <= created <= now() + timedelta(seconds=1)
    assert parse_time(task["available_at"]) == created
    row = Task.objects.get(id=task["id"])
    assert row.lease_seconds == 30
    assert (row.retry_initial_seconds, row.retry_multiplier, row.retry_max_seconds) == (1, 2, 300)
    assert row.deadline_at is None and row.start_deadline_at is None
    # and the queue counts it
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "1"


def test_every_optional_field_is_stored_and_returned(tenant, queue):
    # given a body with every optional field
    available_at, start_deadline_at, deadline_at = in_seconds(10), in_seconds(600), in_seconds(3600)
    body = task_body(
        queue["id"],
        payload=[1, "two", {"three": None}],
        business_key="order-17",
        concurrency_key="printer-1",
        priority=9,
        available_at=available_at,
        start_deadline_at=start_deadline_at,
        deadline_at=deadline_at,
        max_attempts=100,
        retry={"initial_seconds": 0.5, "multiplier": 3, "max_seconds": 60},
        lease_seconds=3600,
    )
    # when it is submitted
    task = assert_ok(post_json(tenant.client, "/v1/tasks", body, key="t-1"), 201)["task"]
    # then the receipt carries them
    assert task["payload"] == [1, "two", {"three": None}]
    assert task["business_key"] == "order-17" and task["concurrency_key"] == "printer-1"
    assert task["priority"] == 9 and task["max_attempts"] == 100
    assert task["available_at"] == available_at
    assert task["start_deadline_at"] == start_deadline_at and task["deadline_at"] == deadline_at
    # and the row keeps what the receipt does not show
    row = Task.objects.get(id=task["id"])
    assert row.lease_seconds == 3600
    assert (row.retry_initial_seconds, row.retry_multiplier, row.retry_max_seconds) == (0.5, 3, 60)


def test_timeout_seconds_becomes_a_deadline(tenant, queue):
    before = now()
    task = submit_ok(tenant.client, queue["id"], "t-1", timeout_seconds=120)
    deadline = parse_time(task["deadline_at"])
    assert before + timedelta(seconds=119) <= deadline <= now() + timedelta(seconds=121)


@pytest.mark.parametrize(
    "overrides",
    [
        {"handler": "x" * 128},
        {"handler": "A9_.:-z"},
        {"handler": "0"},
        {"handler_version": "v" * 64},
        {"payload_version": "2024-01-01:rev.3_b"},
        {"priority": 0},
        {"priority": 9},
        {"max_attempts": 1},
        {"max_attempts": 100},
        {"lease_seconds": 5},
        {"lease_seconds": 3600},
        {"retry": {}},
        {"retry": {"initial_seconds": 0, "multiplier": 1, "max_seconds": 0}},
        {"business_key": ""},
        {"business_key": "b" * 191},
        {"payload": "text"},
        {"payload": 0},
    ],
)
def test_boundary_values_are_accepted(tenant, queue, overrides):
    task = submit_ok(tenant.client, queue["id"], "t-1", **overrides)
    assert task["state"] == "WAITING"


# --- field rules -----------------------------------------------------------

MISSING = object()

INVALID_FIELDS = [
    # (field reported, overrides)
    ("queue_id", {"queue_id": MISSING}),
    ("queue_id", {"queue_id": None}),
    ("queue_id", {"queue_id": 7}),
    ("handler", {"handler": MISSING}),
    ("handler", {"handler": None}),
    ("handler", {"handler": ""}),
    ("handler", {"handler": "x" * 129}),
    ("handler", {"handler": "_leading"}),
    ("handler", {"handler": "-leading"}),
    ("handler", {"handler": "has space"}),
    ("handler", {"handler": "slash/name"}),
    ("handler", {"handler": "café"}),
    ("handler", {"handler": "trailing\n"}),
    ("handler", {"handler": 12}),
    ("handler", {"handler": ["echo"]}),
    ("handler_version", {"handler_version": MISSING}),
    ("handler_version", {"handler_version": ""}),
    ("handler_version", {"handler_version": "v" * 65}),
    ("handler_version", {"handler_version": "v 1"}),
    ("handler_version", {"handler_version": 1}),
    ("handler_version", {"handler_version": None}),
    ("payload_version", {"payload_version": MISSING}),
    ("payload_version", {"payload_version": ""}),
    ("payload_version", {"payload_version": "p" * 65}),
    ("payload_version", {"payload_version": ".dot"}),
    ("payload_version", {"payload_version": None}),
    ("payload", {"payload": MISSING}),
    ("business_key", {"business_key": "b" * 192}),
    ("business_key", {"business_key": 5}),
    ("business_key", {"business_key": None}),
    ("concurrency_key", {"concurrency_key": "k" * 192}),
    ("concurrency_key", {"concurrency_key": 5}),
    ("priority", {"priority": -1}),
    ("priority", {"priority": 10}),
    ("priority", {"priority": "5"}),
    ("priority", {"priority": 5.0}),
    ("priority", {"priority": 5.5}),
    ("priority", {"priority": True}),
    ("priority", {"priority": None}),
    ("max_attempts", {"max_attempts": 0}),
    ("max_attempts", {"max_attempts": 101}),
    ("max_attempts", {"max_attempts": "3"}),
    ("max_attempts", {"max_attempts": None}),
    ("lease_seconds", {"lease_seconds": 4}),
    ("lease_seconds", {"lease_seconds": 3601}),
    ("lease_seconds", {"lease_seconds": 30.5}),
    ("lease_seconds", {"lease_seconds": None}),
    ("timeout_seconds", {"timeout_seconds": 0}),
    ("timeout_seconds", {"timeout_seconds": "60"}),
    ("timeout_seconds", {"timeout_seconds": None}),
    ("available_at", {"available_at": "tomorrow"}),
    ("available_at", {"available_at": "2030-01-02T03:04:05"}),
    ("available_at", {"available_at": "2030-01-02"}),
    ("available_at", {"available_at": 1893553445}),
    ("available_at", {"available_at": None}),
    ("start_deadline_at", {"start_deadline_at": "2030-13-02T03:04:05Z"}),
    ("start_deadline_at", {"start_deadline_at": None}),
    ("deadline_at", {"deadline_at": "soon"}),
    ("deadline_at", {"deadline_at": None}),
    ("retry", {"retry": None}),
    ("retry", {"retry": "fast"}),
    ("retry", {"retry": [1, 2, 300]}),
    ("retry.initial_seconds", {"retry": {"initial_seconds": -1}}),
    ("retry.initial_seconds", {"retry": {"initial_seconds": "1"}}),
    ("retry.initial_seconds", {"retry": {"initial_seconds": True}}),
    ("retry.initial_seconds", {"retry": {"initial_seconds": None}}),
    ("retry.multiplier", {"retry": {"multiplier": 0.5}}),
    ("retry.max_seconds", {"retry": {"max_seconds": 7 * 86_400 + 1}}),
    ("retry.max_seconds", {"retry": {"initial_seconds": 10, "max_seconds": 5}}),
    ("retry.jitter", {"retry": {"jitter": 0.1}}),
    ("colour", {"colour": "blue"}),
    ("task", {"task": {}}),
]


@pytest.mark.parametrize(
    ("field", "overrides"), INVALID_FIELDS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID_FIELDS)]
)
def test_field_rules_reject_with_400_naming_the_field(tenant, queue, field, overrides):
    # given a body that breaks exactly one rule
    body = task_body(queue["id"])
    for name, value in overrides.items():
        if value is MISSING:
            body.pop(name)
        else:
            body[name] = value
    # when it is submitted
    response = post_json(tenant.client, "/v1/tasks", body, key="t-1")
    # then 400 INVALID_ARGUMENT naming that field, and nothing is kept
    assert_invalid(response, field)
    assert_rejected_without_trace(tenant, "t-1")


def test_deadline_at_and_timeout_seconds_together_are_rejected(tenant, queue):
    response = submit(tenant.client, queue["id"], "t-1", deadline_at=in_seconds(60), timeout_seconds=60)
    message = assert_error(response, 400, "INVALID_ARGUMENT")
    assert "deadline_at" in message and "timeout_seconds" in message, message
    assert_rejected_without_trace(tenant, "t-1")


def test_body_that_is_not_an_object_is_rejected(tenant, queue):
    response = post_json(tenant.client, "/v1/tasks", [task_body(queue["id"])], key="t-1")
    assert_error(response, 400, "INVALID_ARGUMENT")
    assert_rejected_without_trace(tenant, "t-1")


# --- payload size -------------------------------------------------------------


def test_payload_of_exactly_256_kib_encoded_is_accepted(tenant, queue):
    # a JSON string of n ASCII characters encodes to n + 2 bytes
    submit_ok(tenant.client, queue["id"], "t-1", payload="x" * (MAX_PAYLOAD - 2))


def test_payload_one_byte_over_256_kib_is_413(tenant, queue):
    response = submit(tenant.client, queue["id"], "t-1", payload="x" * (MAX_PAYLOAD - 1))
    assert_error(response, 413, "PAYLOAD_TOO_LARGE")
    assert_rejected_without_trace(tenant, "t-1")


def test_payload_size_counts_utf8_bytes_not_characters(tenant, queue):
    # "é" is two bytes in UTF-8: 131071 of them plus quotes is exactly 256 KiB
    submit_ok(tenant.client, queue["id"], "t-1", payload="é" * (MAX_PAYLOAD // 2 - 1))
    response = submit(tenant.client, queue["id"], "t-2", payload="é" * (MAX_PAYLOAD // 2))
    assert_error(response, 413, "PAYLOAD_TOO_LARGE")
    assert Task.objects.count() == 1 and idempotency_records(tenant.namespace_id, "t-2") == 0


def test_a_nul_inside_the_payload_is_data_and_kept(tenant, queue):
    payload = {"nul\u0000key": ["a\u0000b", "\u0000"]}
    task = submit_ok(tenant.client, queue["id"], "t-1", payload=payload)
    assert assert_ok(tenant.client.get(f"/v1/tasks/{task['id']}"))["payload"] == payload


def test_large_nested_payload_over_the_limit_is_413(tenant, queue):
    payload = {f"k{i}": "v" * 1000 for i in range(300)}
    response = submit(tenant.client, queue["id"], "t-1", payload=payload)
    assert_error(response, 413, "PAYLOAD_TOO_LARGE")
    assert_rejected_without_trace(tenant, "t-1")


# --- absolute times --------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "offset"),
    [
        ("start_deadline_at", -1),
        ("start_deadline_at", -3600),
        ("deadline_at", -1),
        ("deadline_at", -86_400),
        ("available_at", -61),
        ("available_at", -90),
        ("available_at", -86_400),
    ],
)
def test_times_in_the_past_are_rejected(tenant, queue, field, offset):
    response = submit(tenant.client, queue["id"], "t-1", **{field: in_seconds(offset)})
    assert_invalid(response, field)
    assert_rejected_without_trace(tenant, "t-1")


def test_deadline_at_exactly_now_is_rejected(tenant, queue, monkeypatch):
    # given a server clock frozen at the instant the body names
    frozen = now()
    monkeypatch.setattr("tasks.actions.submit.timezone.now", lambda: frozen)
    # when start_deadline_at/deadline_at equal it: "not in the future" → 400
    assert_invalid(submit(tenant.client, queue["id"], "t-1", start_deadline_at=rfc3339(frozen)), "start_deadline_at")
    assert_invalid(submit(tenant.client, queue["id"], "t-2", deadline_at=rfc3339(frozen)), "deadline_at")
    # and available_at exactly 60 s back is still tolerated
    submit_ok(tenant.client, queue["id"], "t-3", available_at=rfc3339(frozen - timedelta(seconds=60)))


def test_available_at_30_seconds_in_the_past_is_accepted(tenant, queue):
    available_at = in_seconds(-30)
    task = submit_ok(tenant.client, queue["id"], "t-1", available_at=available_at)
    assert task["available_at"] == available_at and task["state"] == "WAITING"


def test_times_with_offsets_are_stored_in_utc(tenant, queue):
    local = (now() + timedelta(hours=1)).astimezone(timezone(timedelta(hours=8)))
    task = submit_ok(tenant.client, queue["id"], "t-1", deadline_at=local.isoformat())
    assert task["deadline_at"].endswith("Z")
    assert parse_time(task["deadline_at"]) == local


@pytest.mark.parametrize(
    ("times", "message"),
    [
        ({"available_at": 7200, "deadline_at": 3600}, "available_at: must be before deadline_at"),
        ({"available_at": 3600, "deadline_at": 3600}, "available_at: must be before deadline_at"),
        ({"available_at": 7200, "start_deadline_at": 3600}, "available_at: must be before start_deadline_at"),
        ({"available_at": 7200, "timeout_seconds": 60}, "available_at: must be before timeout_seconds"),
    ],
)
def test_a_task_that_could_never_start_is_refused(tenant, queue, times, message):
    moment = now()  # one clock reading: equal offsets are equal times
    fields = {
        name: value if name == "timeout_seconds" else rfc3339(moment + timedelta(seconds=value))
        for name, value in times.items()
    }
    response = submit(tenant.client, queue["id"], "t-1", **fields)
    assert_invalid(response, "available_at")
    assert response.json()["error"]["message"] == message
    assert not Task.objects.exists()


def test_a_task_available_before_its_deadlines_is_accepted(tenant, queue):
    fields = {"available_at": in_seconds(600), "start_deadline_at": in_seconds(1200), "deadline_at": in_seconds(1800)}
    assert submit_ok(tenant.client, queue["id"], "t-1", **fields)["state"] == "WAITING"


@pytest.mark.parametrize(
    "text",
    [
        "2030-W01-1T00:00:00Z",  # ISO 8601 week date
        "2030-01-01T00:00:00,5Z",  # comma fraction
        "2030-01-01T00:00:00.Z",  # empty fraction
        "2030-01-01T00:00:00+0100",  # offset without its colon
        "2030-01-01T00:00:00+01",  # hour-only offset
        "2030-01-01T00:00Z",  # no seconds
        "2030-06-30T23:59:60Z",  # a leap second: RFC 3339 syntax, but no such instant here
    ],
)
def test_times_other_than_rfc_3339_are_refused(tenant, queue, text):
    response = submit(tenant.client, queue["id"], "t-1", deadline_at=text)
    assert_invalid(response, "deadline_at")
    assert response.json()["error"]["message"] == (
        "deadline_at: must be an RFC 3339 time with a time zone, e.g. 2026-01-02T03:04:05Z"
    )


@pytest.mark.parametrize("text", ["9999-12-31T23:59:59.999999-14:00", "0001-01-01T00:00:00+00:01"])
def test_a_time_that_leaves_the_calendar_in_utc_is_out_of_range(tenant, queue, text):
    """A well-formed time whose offset moves it past year 9999 (or before year 1)
    in UTC, where it is stored: out of range, not "must be an RFC 3339 time"."""
    response = submit(tenant.client, queue["id"], "t-1", available_at=text)
    assert_invalid(response, "available_at")
    assert response.json()["error"]["message"] == (
        "available_at: out of range: must be from 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999Z in UTC"
    )


def test_rfc_3339_times_in_either_case_and_with_any_fraction_are_taken(tenant, queue):
    task = submit_ok(tenant.client, queue["id"], "t-1", deadline_at="2030-01-01t00:00:00.123456789z")
    assert task["deadline_at"] == "2030-01-01T00:00:00.123456Z"


# --- idempotency ------------------------------------------------------------------


def test_replay_returns_the_original_receipt_with_200(tenant, queue):
    # given an accepted task
    first = assert_ok(submit(tenant.client, queue["id"], "t-1"), 201)
    # when the same request is sent again under the same key
    again = assert_ok(submit(tenant.client, queue["id"], "t-1"), 200)
    # then the original receipt, marked deduplicated, and still one task
    assert again == {**first, "deduplicated": True}
    assert Task.objects.count() == 1
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "1"


def test_same_key_other_body_is_idempotency_conflict(tenant, queue):
    submit_ok(tenant.client, queue["id"], "t-1")
    response = submit(tenant.client, queue["id"], "t-1", priority=7)
    assert_error(response, 409, "IDEMPOTENCY_CONFLICT")
    assert Task.objects.count() == 1


def test_idempotency_is_checked_before_field_rules(tenant, queue):
    # given an accepted request under key t-1
    submit_ok(tenant.client, queue["id"], "t-1")
    # when an invalid body reuses the key, the record answers first
    response = submit(tenant.client, queue["id"], "t-1", priority=99)
    assert_error(response, 409, "IDEMPOTENCY_CONFLICT")


def test_replay_succeeds_when_the_queue_is_now_full(tenant):
    queue = make_queue(tenant.client, "small", max_unfinished_tasks=1)
    first = assert_ok(submit(tenant.client, queue["id"], "t-1"), 201)
    assert_error(submit(tenant.client, queue["id"], "t-2"), 429, "QUEUE_FULL")
    again = assert_ok(submit(tenant.client, queue["id"], "t-1"), 200)
    assert again == {**first, "deduplicated": True}


def test_replay_succeeds_when_the_queue_is_now_paused(tenant, queue):
    first = assert_ok(submit(tenant.client, queue["id"], "t-1"), 201)
    configure_queue(tenant.client, queue["id"], paused=True)
    again = assert_ok(submit(tenant.client, queue["id"], "t-1"), 200)
    assert again == {**first, "deduplicated": True}


def test_replay_succeeds_after_its_times_have_passed(tenant, queue):
    # given a request whose deadline is 1 s away and whose available_at is
    # just inside the 60 s tolerance
    body = task_body(
        queue["id"], deadline_at=in_seconds(1), start_deadline_at=in_seconds(1), available_at=in_seconds(-59.5)
    )
    first = assert_ok(post_json(tenant.client, "/v1/tasks", body, key="t-1"), 201)
    # when the same request is replayed after all three times have expired
    time.sleep(1.2)
    assert_invalid(post_json(tenant.client, "/v1/tasks", body, key="t-2"), "start_deadline_at")
    again = assert_ok(post_json(tenant.client, "/v1/tasks", body, key="t-1"), 200)
    # then it still gets its original receipt
    assert again == {**first, "deduplicated": True}


def test_replay_succeeds_after_the_queue_was_retired(tenant, queue):
    first = assert_ok(submit(tenant.client, queue["id"], "t-1"), 201)
    assert_ok(cancel(tenant.client, first["task"]["id"], "c-1"))
    configure_queue(tenant.client, queue["id"], paused=True)
    revision = get_queue(tenant.client, queue["id"])["revision"]
    retire = {"expected_revision": revision, "reason": "done"}
    assert_ok(post_json(tenant.client, f"/v1/queues/{queue['id']}:retire", retire, key="r-1"))
    again = assert_ok(submit(tenant.client, queue["id"], "t-1"), 200)
    assert again == {**first, "deduplicated": True}


def test_replay_rechecks_permissions(tenant, queue):
    # given a task accepted under key t-1
    submit_ok(tenant.client, queue["id"], "t-1")
    # when the same request is replayed by credentials that may no longer submit there
    reader = api_client(make_credential(tenant.namespace, scopes=["tasks:read"]).token)
    other = make_queue(tenant.client, "other")
    narrow = api_client(make_credential(tenant.namespace, queue_ids=[other["id"]]).token)
    # then scope and range are checked before the record answers
    assert_error(submit(reader, queue["id"], "t-1"), 403, "PERMISSION_DENIED")
    assert_error(submit(narrow, queue["id"], "t-1"), 404, "NOT_FOUND")


def test_idempotency_key_is_required(tenant, queue):
    response = post_json(tenant.client, "/v1/tasks", task_body(queue["id"]))
    assert_invalid(response, "Idempotency-Key")
    assert Task.objects.count() == 0


# --- queue state ----------------------------------------------------------------------


def test_paused_queue_accepts_tasks_as_waiting(tenant, queue):
    configure_queue(tenant.client, queue["id"], paused=True)
    task = submit_ok(tenant.client, queue["id"], "t-1")
    assert task["state"] == "WAITING"
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "1"


def test_retired_queue_rejects_with_state_conflict(tenant, queue):
    configure_queue(tenant.client, queue["id"], paused=True)
    retire = {"expected_revision": get_queue(tenant.client, queue["id"])["revision"], "reason": "gone"}
    assert_ok(post_json(tenant.client, f"/v1/queues/{queue['id']}:retire", retire, key="r-1"))
    response = submit(tenant.client, queue["id"], "t-1")
    assert_error(response, 409, "STATE_CONFLICT")
    assert_rejected_without_trace(tenant, "t-1")


def test_full_queue_answers_429_queue_full_exactly(tenant):
    # given a queue with room for two unfinished tasks, both taken
    queue = make_queue(tenant.client, "small", max_unfinished_tasks=2)
    first = submit_ok(tenant.client, queue["id"], "t-1")
    submit_ok(tenant.client, queue["id"], "t-2")
    records_before = IdempotencyRecord.objects.count()
    # when a third task is submitted
    body = task_body(queue["id"], business_key="third")
    response = post_json(tenant.client, "/v1/tasks", body, key="t-3")
    # then 429, Retry-After: 1 and the seed's exact error object
    assert response.status_code == 429, response.content
    assert response["Retry-After"] == "1"
    envelope = response.json()
    assert set(envelope) == {"request_id", "error"}
    assert HEX32.fullmatch(envelope["request_id"]) and response["X-Request-Id"] == envelope["request_id"]
    assert envelope["error"] == QUEUE_FULL_ERROR
    # and no task row and no idempotency record were left
    assert Task.objects.count() == 2 and not Task.objects.filter(business_key="third").exists()
    assert IdempotencyRecord.objects.count() == records_before
    assert idempotency_records(tenant.namespace_id, "t-3") == 0
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "2"
    # when it is sent again while still full, the same 429
    assert post_json(tenant.client, "/v1/tasks", body, key="t-3").status_code == 429
    # when space frees (one task cancelled), the original key and body succeed
    assert_ok(cancel(tenant.client, first["id"], "c-1"))
    accepted = assert_ok(post_json(tenant.client, "/v1/tasks", body, key="t-3"), 201)
    assert accepted["deduplicated"] is False and accepted["task"]["business_key"] == "third"
    assert get_queue(tenant.client, queue["id"])["unfinished_tasks"] == "2"


def test_lowered_backlog_limit_keeps_tasks_and_refuses_new_ones(tenant, queue):
    for i in range(3):
        submit_ok(tenant.client, queue["id"], f"t-{i}")
    configure_queue(tenant.client, queue["id"], max_unfinished_tasks=2)
    assert Task.objects.filter(state="WAITING").count() == 3
    assert_error(submit(tenant.client, queue["id"], "t-9"), 429, "QUEUE_FULL")


# --- who may submit where ---------------------------------------------------------------


def test_unknown_queue_is_404(tenant):
    assert_error(submit(tenant.client, "0" * 32, "t-1"), 404, "NOT_FOUND")
    assert_rejected_without_trace(tenant, "t-1")


def test_queue_of_another_namespace_is_404(tenant):
    other = NamespaceFactory()
    other_client = api_client(make_credential(other).token)
    foreign = make_queue(other_client, "theirs")
    assert_error(submit(tenant.client, foreign["id"], "t-1"), 404, "NOT_FOUND")
    assert_rejected_without_trace(tenant, "t-1")


def test_queue_outside_the_credential_range_is_404(tenant, queue):
    other = make_queue(tenant.client, "other")
    narrow = api_client(make_credential(tenant.namespace, queue_ids=[queue["id"]]).token)
    assert_error(submit(narrow, other["id"], "t-1"), 404, "NOT_FOUND")
    submit_ok(narrow, queue["id"], "t-2")


def test_submit_needs_the_tasks_submit_scope(tenant, queue):
    reader = api_client(make_credential(tenant.namespace, scopes=["tasks:read"]).token)
    assert_error(submit(reader, queue["id"], "t-1"), 403, "PERMISSION_DENIED")
    assert_rejected_without_trace(tenant, "t-1")


def test_submit_needs_a_valid_token(tenant, queue):
    assert_error(submit(api_client(None), queue["id"], "t-1"), 401, "UNAUTHENTICATED")
    assert_error(submit(api_client("orb_" + "0" * 32 + "_" + "x" * 30), queue["id"], "t-1"), 401, "UNAUTHENTICATED")
