"""POST /v1/queues: the seed's example, its field rules, and its idempotency."""

from __future__ import annotations

import pytest

from orbit.models import AuditEntry, Event, IdempotencyRecord
from queues.models import Queue, QueueState
from tests.conftest import api_client, post_json
from tests.support.api import assert_error, assert_invalid, assert_ok
from tests.support.factories import NamespaceFactory, make_credential
from tests.support.queues import SEED_CREATE, assert_queue_shape, configure_body, create_queue, record_count

VALID = {"name": "q1", "max_concurrency": 8, "rate_per_second": 100}

# Integer fields reject every JSON type but an integer, and null.
NOT_AN_INTEGER = ["8", 8.0, 8.5, True, False, None, [8], {"v": 8}]


def with_field(field: str, value: object) -> dict:
    return {**VALID, field: value}


def without(field: str) -> dict:
    return {name: value for name, value in VALID.items() if name != field}


INVALID_BODIES = [
    # name: 1-128 characters, an ASCII letter or digit first, then letters, digits, _ . : -
    ("name", with_field("name", "")),
    ("name", with_field("name", "a" * 129)),
    ("name", with_field("name", "_images")),
    ("name", with_field("name", ".images")),
    ("name", with_field("name", "-images")),
    ("name", with_field("name", ":images")),
    ("name", with_field("name", "my images")),
    ("name", with_field("name", " images")),
    ("name", with_field("name", "images ")),
    ("name", with_field("name", "images\n")),
    ("name", with_field("name", "images\t")),
    ("name", with_field("name", "ima\x00ges")),
    ("name", with_field("name", "images/1")),
    ("name", with_field("name", "images@1")),
    ("name", with_field("name", "队列")),
    ("name", with_field("name", "imagés")),
    ("name", with_field("name", "ｉmages")),  # fullwidth letter first
    ("name", with_field("name", "é")),
    ("name", with_field("name", 5)),
    ("name", with_field("name", True)),
    ("name", with_field("name", None)),
    ("name", with_field("name", ["images"])),
    ("name", without("name")),
    # max_concurrency: 1-100000
    ("max_concurrency", with_field("max_concurrency", 0)),
    ("max_concurrency", with_field("max_concurrency", -1)),
    ("max_concurrency", with_field("max_concurrency", 100_001)),
    ("max_concurrency", with_field("max_concurrency", 2**32)),
    ("max_concurrency", with_field("max_concurrency", 2**64)),
    *[("max_concurrency", with_field("max_concurrency", value)) for value in NOT_AN_INTEGER],
    ("max_concurrency", without("max_concurrency")),
    # rate_per_second: 1-1000000
    ("rate_per_second", with_field("rate_per_second", 0)),
    ("rate_per_second", with_field("rate_per_second", -5)),
    ("rate_per_second", with_field("rate_per_second", 1_000_001)),
    *[("rate_per_second", with_field("rate_per_second", value)) for value in NOT_AN_INTEGER],
    ("rate_per_second", without("rate_per_second")),
    # max_unfinished_tasks: optional; when sent, 0 or 1-1000000
    ("max_unfinished_tasks", with_field("max_unfinished_tasks", 1_000_001)),
    ("max_unfinished_tasks", with_field("max_unfinished_tasks", -1)),
    *[("max_unfinished_tasks", with_field("max_unfinished_tasks", value)) for value in NOT_AN_INTEGER],
    # Unknown fields, including ones that exist on other endpoints.
    ("colour", with_field("colour", "blue")),
    ("paused", with_field("paused", True)),
    ("revision", with_field("revision", "1")),
    ("Name", {**without("name"), "Name": "images"}),
]


@pytest.mark.parametrize(("field", "body"), INVALID_BODIES)
def test_invalid_create_is_rejected_naming_the_field_and_leaves_nothing(tenant, field, body):
    # given a tenant with no queues
    # when a create breaks one field rule
    response = post_json(tenant.client, "/v1/queues", body, key="create-1")
    # then 400 INVALID_ARGUMENT names the field, and nothing was stored
    assert_invalid(response, field)
    assert Queue.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0
    assert AuditEntry.objects.count() == 0
    # and the key stays free for a corrected request
    assert_ok(post_json(tenant.client, "/v1/queues", VALID, key="create-1"), 201)


@pytest.mark.parametrize(
    "name",
    ["a", "Z", "7", "a" * 128, "9" + "x" * 127, "images", "a_b.c:d-e", "A-1.b_2:c", "0.0.0", "x__", "x--", "x::"],
)
def test_valid_names_are_accepted_verbatim(tenant, name):
    queue = create_queue(tenant.client, name, key="k")
    assert queue["name"] == name
    assert Queue.objects.get(id=queue["id"]).name == name


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_concurrency", 1),
        ("max_concurrency", 100_000),
        ("rate_per_second", 1),
        ("rate_per_second", 1_000_000),
        ("max_unfinished_tasks", 1),
        ("max_unfinished_tasks", 1_000_000),
    ],
)
def test_limit_bounds_are_inclusive(tenant, field, value):
    queue = create_queue(tenant.client, "bounds", **{field: value})
    assert queue[field] == value


@pytest.mark.parametrize("sent", [{}, {"max_unfinished_tasks": 0}])
def test_max_unfinished_tasks_omitted_or_zero_means_100000(tenant, sent):
    queue = create_queue(tenant.client, "backlog", **sent)
    assert queue["max_unfinished_tasks"] == 100_000
    assert Queue.objects.get(id=queue["id"]).max_unfinished_tasks == 100_000


def test_seed_curl_creates_the_queue_with_the_seed_shape(tenant):
    # given the seed's exact request bytes
    raw = '{"name":"images","max_concurrency":8,"rate_per_second":100}'
    # when it is sent for the first time
    response = post_json(tenant.client, "/v1/queues", raw, key="queue-images-v1")
    # then 201 with exactly the seed's data
    data = assert_ok(response, 201)
    assert set(data) == {"deduplicated", "queue"}
    assert data["deduplicated"] is False
    queue = data["queue"]
    assert_queue_shape(queue)
    assert queue == {
        "id": queue["id"],
        "namespace_id": tenant.namespace_id,
        "name": "images",
        "paused": False,
        "max_concurrency": 8,
        "rate_per_second": 100,
        "max_unfinished_tasks": 100000,
        "unfinished_tasks": "0",
        "revision": "1",
    }
    # and the rows behind it: queue, counters, one idempotency record, audit and event
    row = Queue.objects.get(id=queue["id"])
    assert (row.namespace_id, row.application_id) == (tenant.namespace_id, tenant.namespace.application_id)
    assert row.retired_at is None and row.revision == 1
    state = QueueState.objects.get(queue_id=queue["id"])
    assert (state.unfinished_tasks, state.active_permits, state.window_count) == (0, 0, 0)
    record = IdempotencyRecord.objects.get(namespace_id=tenant.namespace_id, key="queue-images-v1")
    assert record.operation == "queue.create"
    assert record.response_status == 201
    assert record.response_data == data
    assert record.request_id == response.json()["request_id"]
    audit = AuditEntry.objects.get(target_id=queue["id"])
    assert audit.action == "queue.created"
    assert audit.namespace_id == tenant.namespace_id
    assert audit.before is None and audit.after == queue
    assert audit.request_id == response.json()["request_id"]
    assert Event.objects.filter(subject_id=queue["id"], namespace_id=tenant.namespace_id).count() == 1


def test_replay_returns_the_original_queue_deduplicated(tenant):
    # given the seed's queue was created
    first = post_json(tenant.client, "/v1/queues", SEED_CREATE, key="queue-images-v1")
    original = assert_ok(first, 201)["queue"]
    # when the same key and the same body are sent again (fields in another order)
    again = post_json(
        tenant.client,
        "/v1/queues",
        '{ "rate_per_second": 100, "name": "images", "max_concurrency": 8 }',
        key="queue-images-v1",
    )
    # then 200, deduplicated, the original snapshot, and a fresh request id
    data = assert_ok(again, 200)
    assert data == {"deduplicated": True, "queue": original}
    assert again.json()["request_id"] != first.json()["request_id"]
    # and still exactly one queue, one record, one audit row
    assert Queue.objects.count() == 1
    assert record_count() == 1
    assert AuditEntry.objects.count() == 1


def test_replay_returns_the_snapshot_not_the_live_queue(tenant):
    # given a queue whose backlog and configuration changed after creation
    queue = create_queue(tenant.client, "images", key="queue-images-v1")
    QueueState.objects.filter(queue_id=queue["id"]).update(unfinished_tasks=7)
    assert_ok(post_json(tenant.client, f"/v1/queues/{queue['id']}:configure", configure_body("1"), key="cfg-1"))
    # when the create is replayed
    replay = post_json(
        tenant.client,
        "/v1/queues",
        {"name": "images", "max_concurrency": 8, "rate_per_second": 100},
        key="queue-images-v1",
    )
    # then the receipt is the one of the time of creation
    assert assert_ok(replay, 200) == {"deduplicated": True, "queue": queue}


@pytest.mark.parametrize(
    "other_body",
    [
        {**SEED_CREATE, "max_concurrency": 9},
        {**SEED_CREATE, "name": "images2"},
        {**SEED_CREATE, "max_unfinished_tasks": 100_000},  # an omitted field stays out of the digest
        {**SEED_CREATE, "max_unfinished_tasks": 0},
        {"name": "images", "max_concurrency": 8},  # invalid, but the key decides first
    ],
)
def test_same_key_other_body_is_an_idempotency_conflict(tenant, other_body):
    # given the seed's queue was created
    create_queue(tenant.client, "images", key="queue-images-v1")
    # when the key comes back with a different body
    response = post_json(tenant.client, "/v1/queues", other_body, key="queue-images-v1")
    # then 409 IDEMPOTENCY_CONFLICT and nothing new
    assert_error(response, 409, "IDEMPOTENCY_CONFLICT")
    assert Queue.objects.count() == 1
    assert record_count() == 1


def test_same_key_on_another_operation_is_an_idempotency_conflict(tenant):
    queue = create_queue(tenant.client, "images", key="shared-key")
    response = post_json(tenant.client, f"/v1/queues/{queue['id']}:configure", configure_body("1"), key="shared-key")
    assert_error(response, 409, "IDEMPOTENCY_CONFLICT")
    assert Queue.objects.get(id=queue["id"]).revision == 1


def test_new_key_same_name_is_a_state_conflict_and_stores_no_record(tenant):
    # given the seed's queue was created
    create_queue(tenant.client, "images", key="queue-images-v1")
    # when another key creates the same name
    response = post_json(tenant.client, "/v1/queues", SEED_CREATE, key="queue-images-v2")
    # then 409 STATE_CONFLICT, with no record, audit row or event for the rejected request
    message = assert_error(response, 409, "STATE_CONFLICT")
    assert "images" in message
    assert Queue.objects.count() == 1
    assert not IdempotencyRecord.objects.filter(key="queue-images-v2").exists()
    assert AuditEntry.objects.count() == 1
    assert Event.objects.count() == 1


def test_idempotency_keys_are_byte_exact(tenant):
    # given a queue created under one key
    create_queue(tenant.client, "images", key="queue-images-v1")
    # when a key differing only in case is used with the same body
    response = post_json(tenant.client, "/v1/queues", SEED_CREATE, key="QUEUE-IMAGES-V1")
    # then it is a new request (the name is taken), not a replay of the first
    assert_error(response, 409, "STATE_CONFLICT")


def test_idempotency_key_with_trailing_space_is_another_key(tenant):
    # given a queue created under key "k"
    create_queue(tenant.client, "images", key="k")
    # when keys "k " and "k  " (printable ASCII, so valid) create other queues
    second = post_json(tenant.client, "/v1/queues", {**SEED_CREATE, "name": "videos"}, key="k ")
    third = post_json(tenant.client, "/v1/queues", {**SEED_CREATE, "name": "audio"}, key="k  ")
    # then each is its own request (a PAD SPACE collation would have replayed "k")
    assert_ok(second, 201)
    assert_ok(third, 201)
    assert sorted(IdempotencyRecord.objects.values_list("key", flat=True)) == ["k", "k ", "k  "]


def test_idempotency_keys_and_names_are_per_namespace(tenant):
    # given the seed's queue in one namespace
    mine = create_queue(tenant.client, "images", key="queue-images-v1")
    # when another namespace sends the very same request
    other_namespace = NamespaceFactory()
    other = api_client(make_credential(other_namespace).token)
    theirs = assert_ok(post_json(other, "/v1/queues", SEED_CREATE, key="queue-images-v1"), 201)["queue"]
    # then it gets its own queue
    assert theirs["id"] != mine["id"]
    assert theirs["namespace_id"] == other_namespace.id
    assert record_count(tenant.namespace_id) == 1 and record_count(other_namespace.id) == 1


def test_names_differing_only_in_case_are_distinct_queues(tenant):
    # MySQL's default collations would fold these into one name.
    upper = create_queue(tenant.client, "Images", key="k-upper")
    lower = create_queue(tenant.client, "images", key="k-lower")
    assert upper["id"] != lower["id"]
    assert sorted(Queue.objects.values_list("name", flat=True)) == ["Images", "images"]
    assert Queue.objects.filter(name="images").count() == 1


def test_create_accepts_any_field_order_and_whitespace(tenant):
    # Fields may come in any order and with whitespace; JSON is parsed, not matched.
    response = post_json(
        tenant.client, "/v1/queues", '\n{"rate_per_second" : 1 ,"max_concurrency":1,"name":"x"}\n', key="k"
    )
    assert assert_ok(response, 201)["queue"]["name"] == "x"


@pytest.mark.django_db(transaction=True)
def test_create_commits_all_or_nothing(tenant, monkeypatch):
    # given the audit write fails after the queue and its counters were inserted
    def broken_audit(*args, **kwargs):
        raise RuntimeError("audit table unavailable")

    monkeypatch.setattr("queues.actions.record_management_change", broken_audit)
    # when the seed's create is sent
    response = post_json(tenant.client, "/v1/queues", SEED_CREATE, key="queue-images-v1")
    # then it fails as a whole: no queue, no counters, no idempotency record
    assert_error(response, 500, "INTERNAL")
    assert Queue.objects.count() == 0 and QueueState.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0
    # and once the audit works again, the same key creates the queue
    monkeypatch.undo()
    assert_ok(post_json(tenant.client, "/v1/queues", SEED_CREATE, key="queue-images-v1"), 201)
