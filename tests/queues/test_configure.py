"""POST /v1/queues/{id}:configure: full replacement guarded by expected_revision."""

from __future__ import annotations

import pytest

from orbit.models import AuditEntry, Event, IdempotencyRecord
from queues.models import Queue, QueueState
from tests.conftest import post_json
from tests.support.api import assert_error, assert_invalid, assert_ok
from tests.support.queues import assert_queue_shape, configure, configure_body, create_queue, get_queue

SEED_CONFIGURE = (
    '{"expected_revision":"1","reason":"limit background traffic","paused":false,'
    '"max_concurrency":2,"rate_per_second":1,"max_unfinished_tasks":100}'
)

NOT_AN_INTEGER = ["8", 8.0, 8.5, True, None, [8]]


def without(field: str) -> dict:
    body = configure_body("1")
    del body[field]
    return body


INVALID_BODIES = [
    # expected_revision: a non-zero uint64 as a decimal string
    ("expected_revision", configure_body(1)),
    ("expected_revision", configure_body(1.0)),
    ("expected_revision", configure_body(True)),
    ("expected_revision", configure_body(None)),
    ("expected_revision", configure_body(["1"])),
    ("expected_revision", configure_body("0")),
    ("expected_revision", configure_body("-1")),
    ("expected_revision", configure_body("01")),
    ("expected_revision", configure_body("00")),
    ("expected_revision", configure_body("+1")),
    ("expected_revision", configure_body("1.0")),
    ("expected_revision", configure_body("1e0")),
    ("expected_revision", configure_body("0x1")),
    ("expected_revision", configure_body(" 1")),
    ("expected_revision", configure_body("1 ")),
    ("expected_revision", configure_body("1\n")),
    ("expected_revision", configure_body("")),
    ("expected_revision", configure_body("one")),
    ("expected_revision", configure_body("１")),  # fullwidth digit
    ("expected_revision", configure_body("١")),  # Arabic-Indic digit
    ("expected_revision", configure_body("18446744073709551616")),  # 2**64
    ("expected_revision", configure_body("99999999999999999999")),
    ("expected_revision", configure_body("1" * 21)),
    ("expected_revision", without("expected_revision")),
    # reason: required, non-blank, at most 1024 Unicode characters
    ("reason", configure_body(reason="")),
    ("reason", configure_body(reason="   ")),
    ("reason", configure_body(reason="\t\n ")),
    ("reason", configure_body(reason="\u3000")),  # ideographic space
    ("reason", configure_body(reason="队" * 1025)),
    ("reason", configure_body(reason="a" * 1025)),
    ("reason", configure_body(reason=None)),
    ("reason", configure_body(reason=5)),
    ("reason", configure_body(reason=["why"])),
    ("reason", configure_body(reason="a\x00b")),
    ("reason", without("reason")),
    # paused: must be explicit
    ("paused", without("paused")),
    ("paused", configure_body(paused=None)),
    ("paused", configure_body(paused="false")),
    ("paused", configure_body(paused=0)),
    ("paused", configure_body(paused=1)),
    # all three limits required, with their ranges; no zero default here
    ("max_concurrency", without("max_concurrency")),
    ("max_concurrency", configure_body(max_concurrency=0)),
    ("max_concurrency", configure_body(max_concurrency=100_001)),
    ("max_concurrency", configure_body(max_concurrency=-1)),
    *[("max_concurrency", configure_body(max_concurrency=value)) for value in NOT_AN_INTEGER],
    ("rate_per_second", without("rate_per_second")),
    ("rate_per_second", configure_body(rate_per_second=0)),
    ("rate_per_second", configure_body(rate_per_second=1_000_001)),
    *[("rate_per_second", configure_body(rate_per_second=value)) for value in NOT_AN_INTEGER],
    ("max_unfinished_tasks", without("max_unfinished_tasks")),
    ("max_unfinished_tasks", configure_body(max_unfinished_tasks=0)),
    ("max_unfinished_tasks", configure_body(max_unfinished_tasks=1_000_001)),
    ("max_unfinished_tasks", configure_body(max_unfinished_tasks=-1)),
    *[("max_unfinished_tasks", configure_body(max_unfinished_tasks=value)) for value in NOT_AN_INTEGER],
    # unknown fields: configure never renames a queue or sets its revision
    ("name", configure_body(name="renamed")),
    ("revision", {**configure_body("1"), "revision": "2"}),
    ("note", configure_body(note="x")),
]


@pytest.fixture
def queue(tenant):
    return create_queue(tenant.client, "images", key="queue-images-v1")


@pytest.mark.parametrize(("field", "body"), INVALID_BODIES)
def test_invalid_configure_is_rejected_naming_the_field_and_changes_nothing(tenant, queue, field, body):
    # given a queue at revision 1
    # when a configure breaks one field rule
    response = configure(tenant.client, queue["id"], body, key="cfg-1")
    # then 400 names the field; the queue, the records and the audit log are untouched
    assert_invalid(response, field)
    assert Queue.objects.get(id=queue["id"]).revision == 1
    assert not IdempotencyRecord.objects.filter(key="cfg-1").exists()
    assert not AuditEntry.objects.filter(action="queue.configured").exists()
    # and the key is free for a corrected request
    assert_ok(configure(tenant.client, queue["id"], configure_body("1"), key="cfg-1"))


@pytest.mark.parametrize(
    "reason",
    ["x", "队" * 1024, "a" * 1024, "😀" * 1024, "  padded reason  ", "多行\n原因"],
    ids=lambda r: f"len{len(r)}",
)
def test_reason_up_to_1024_unicode_characters_is_accepted_and_audited_verbatim(tenant, queue, reason):
    assert_ok(configure(tenant.client, queue["id"], configure_body("1", reason=reason), key="cfg-1"))
    assert AuditEntry.objects.get(action="queue.configured").reason == reason


def test_largest_uint64_revision_is_valid_but_stale(tenant, queue):
    # The largest uint64 passes the field rule and loses on the revision check.
    response = configure(tenant.client, queue["id"], configure_body("18446744073709551615"), key="cfg-1")
    assert_error(response, 409, "STATE_CONFLICT")


def test_seed_configure_replaces_the_controls_and_audits_the_change(tenant, queue):
    # given the seed's queue, with three tasks in its backlog
    QueueState.objects.filter(queue_id=queue["id"]).update(unfinished_tasks=3)
    # when the seed's configure is sent
    response = configure(tenant.client, queue["id"], SEED_CONFIGURE, key="queue-control-001")
    # then 200 with the create's shape, revision 2 and the new controls
    data = assert_ok(response, 200)
    assert set(data) == {"deduplicated", "queue"}
    assert data["deduplicated"] is False
    after = data["queue"]
    assert_queue_shape(after)
    assert after == {
        **queue,
        "paused": False,
        "max_concurrency": 2,
        "rate_per_second": 1,
        "max_unfinished_tasks": 100,
        "unfinished_tasks": "3",
        "revision": "2",
    }
    row = Queue.objects.get(id=queue["id"])
    assert (row.max_concurrency, row.rate_per_second, row.max_unfinished_tasks, row.revision) == (2, 1, 100, 2)
    # and the counters were not touched
    assert QueueState.objects.get(queue_id=queue["id"]).unfinished_tasks == 3
    # and one audit row and one event carry the reason and both snapshots
    request_id = response.json()["request_id"]
    audit = AuditEntry.objects.get(action="queue.configured")
    assert (audit.target_type, audit.target_id, audit.namespace_id) == ("queue", queue["id"], tenant.namespace_id)
    assert audit.reason == "limit background traffic"
    assert audit.before == {**queue, "unfinished_tasks": "3"}
    assert audit.after == after
    assert audit.request_id == request_id
    assert audit.credential_id == tenant.token.split("_")[1]
    event = Event.objects.get(type="queue.configured")
    assert (event.namespace_id, event.subject_id) == (tenant.namespace_id, queue["id"])
    assert event.data["reason"] == "limit background traffic"
    assert event.data["before"] == audit.before and event.data["after"] == after
    assert event.data["request_id"] == request_id
    record = IdempotencyRecord.objects.get(key="queue-control-001")
    assert (record.operation, record.response_status, record.response_data) == ("queue.configure", 200, data)


def test_pause_and_resume_are_configurations(tenant, queue):
    paused = assert_ok(configure(tenant.client, queue["id"], configure_body("1", paused=True), key="p"))["queue"]
    assert paused["paused"] is True and paused["revision"] == "2"
    resumed = assert_ok(configure(tenant.client, queue["id"], configure_body("2", paused=False), key="r"))["queue"]
    assert resumed["paused"] is False and resumed["revision"] == "3"


def test_identical_configuration_still_bumps_the_revision(tenant, queue):
    # A configure is a management change even when the values stay the same.
    same = configure_body("1", max_concurrency=8, rate_per_second=100, max_unfinished_tasks=100_000)
    assert assert_ok(configure(tenant.client, queue["id"], same, key="same"))["queue"]["revision"] == "2"


def test_replay_returns_the_original_snapshot_after_later_configures(tenant, queue):
    # given configure #1 (revision 1 -> 2) and then configure #2 (2 -> 3)
    first = assert_ok(configure(tenant.client, queue["id"], SEED_CONFIGURE, key="queue-control-001"))
    assert_ok(configure(tenant.client, queue["id"], configure_body("2", paused=True, reason="pause"), key="cfg-2"))
    QueueState.objects.filter(queue_id=queue["id"]).update(unfinished_tasks=9)
    # when configure #1 is re-sent with its key, its expected_revision and its body
    replay = configure(tenant.client, queue["id"], SEED_CONFIGURE, key="queue-control-001")
    # then 200, deduplicated, with the snapshot of the time
    assert assert_ok(replay, 200) == {**first, "deduplicated": True}
    # and nothing else happened
    assert Queue.objects.get(id=queue["id"]).revision == 3
    assert AuditEntry.objects.filter(action="queue.configured").count() == 2
    live = assert_ok(get_queue(tenant.client, queue["id"]))
    assert (live["revision"], live["paused"], live["unfinished_tasks"]) == ("3", True, "9")


def test_same_key_other_body_is_an_idempotency_conflict(tenant, queue):
    assert_ok(configure(tenant.client, queue["id"], configure_body("1"), key="cfg-1"))
    response = configure(tenant.client, queue["id"], configure_body("1", max_concurrency=3), key="cfg-1")
    assert_error(response, 409, "IDEMPOTENCY_CONFLICT")
    assert Queue.objects.get(id=queue["id"]).max_concurrency == 2


def test_same_key_same_body_on_another_queue_is_an_idempotency_conflict(tenant, queue):
    other = create_queue(tenant.client, "videos", key="create-videos")
    assert_ok(configure(tenant.client, queue["id"], configure_body("1"), key="cfg-1"))
    response = configure(tenant.client, other["id"], configure_body("1"), key="cfg-1")
    assert_error(response, 409, "IDEMPOTENCY_CONFLICT")
    assert Queue.objects.get(id=other["id"]).revision == 1


def test_new_key_with_a_stale_revision_is_a_state_conflict(tenant, queue):
    # given configure moved the queue to revision 2
    assert_ok(configure(tenant.client, queue["id"], configure_body("1"), key="cfg-1"))
    # when a new key still expects revision 1
    response = configure(tenant.client, queue["id"], configure_body("1", max_concurrency=50), key="cfg-2")
    # then 409 STATE_CONFLICT; no record, audit row or event for it
    assert_error(response, 409, "STATE_CONFLICT")
    assert Queue.objects.get(id=queue["id"]).max_concurrency == 2
    assert not IdempotencyRecord.objects.filter(key="cfg-2").exists()
    assert AuditEntry.objects.filter(action="queue.configured").count() == 1
    assert Event.objects.filter(type="queue.configured").count() == 1
    # and the same key works once it carries the current revision
    assert (
        assert_ok(configure(tenant.client, queue["id"], configure_body("2"), key="cfg-2"))["queue"]["revision"] == "3"
    )


def test_future_revision_is_a_state_conflict(tenant, queue):
    assert_error(configure(tenant.client, queue["id"], configure_body("2"), key="cfg-1"), 409, "STATE_CONFLICT")
    assert Queue.objects.get(id=queue["id"]).revision == 1


def test_revision_moves_only_with_configuration(tenant, queue):
    # given a queue at revision 1
    queue_id = queue["id"]
    # when its backlog changes, it is read, listed, its create is replayed, and configures are rejected
    QueueState.objects.filter(queue_id=queue_id).update(unfinished_tasks=42, active_permits=3)
    assert_ok(get_queue(tenant.client, queue_id))
    assert_ok(tenant.client.get("/v1/queues"))
    post_json(
        tenant.client,
        "/v1/queues",
        {"name": "images", "max_concurrency": 8, "rate_per_second": 100},
        key="queue-images-v1",
    )
    configure(tenant.client, queue_id, configure_body("1", max_concurrency=0), key="bad")
    configure(tenant.client, queue_id, configure_body("5"), key="stale")
    # then the revision is still 1 and the live count shows
    live = assert_ok(get_queue(tenant.client, queue_id))
    assert (live["revision"], live["unfinished_tasks"]) == ("1", "42")
    # and one configure moves it by exactly one
    assert assert_ok(configure(tenant.client, queue_id, configure_body("1"), key="ok"))["queue"]["revision"] == "2"


def test_configure_of_an_unknown_queue_is_not_found(tenant):
    response = configure(tenant.client, "0" * 32, configure_body("1"), key="cfg-1")
    assert_error(response, 404, "NOT_FOUND")
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_configure_commits_all_or_nothing(tenant, monkeypatch):
    queue = create_queue(tenant.client, "images", key="queue-images-v1")

    def broken_audit(*args, **kwargs):
        raise RuntimeError("audit table unavailable")

    monkeypatch.setattr("queues.actions.record_management_change", broken_audit)
    assert_error(configure(tenant.client, queue["id"], configure_body("1"), key="cfg-1"), 500, "INTERNAL")
    row = Queue.objects.get(id=queue["id"])
    assert (row.revision, row.max_concurrency) == (1, 8)
    assert not IdempotencyRecord.objects.filter(key="cfg-1").exists()
