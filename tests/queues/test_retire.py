"""POST /v1/queues/{id}:retire: permanent, only for a paused and empty queue."""

from __future__ import annotations

import pytest

from orbit.models import AuditEntry, Event, IdempotencyRecord
from queues.models import Queue, QueueState
from tests.conftest import post_json
from tests.support.api import assert_error, assert_invalid, assert_ok
from tests.support.queues import (
    SEED_CREATE,
    assert_queue_shape,
    configure,
    configure_body,
    create_queue,
    get_queue,
    retire,
)


def retire_body(revision: object = "2", **overrides: object) -> dict:
    return {"expected_revision": revision, "reason": "images moved to the new pipeline", **overrides}


@pytest.fixture
def paused_queue(tenant):
    """The seed's queue, paused: revision 2."""
    queue = create_queue(tenant.client, "images", key="queue-images-v1")
    assert_ok(configure(tenant.client, queue["id"], configure_body("1", paused=True), key="pause"))
    return queue


INVALID_BODIES = [
    ("expected_revision", retire_body(2)),
    ("expected_revision", retire_body("0")),
    ("expected_revision", retire_body("-2")),
    ("expected_revision", retire_body("02")),
    ("expected_revision", retire_body("18446744073709551616")),
    ("expected_revision", retire_body(None)),
    ("expected_revision", {"reason": "x"}),
    ("reason", retire_body(reason="")),
    ("reason", retire_body(reason="   ")),
    ("reason", retire_body(reason="队" * 1025)),
    ("reason", retire_body(reason=None)),
    ("reason", {"expected_revision": "2"}),
    ("paused", retire_body(paused=True)),
    ("max_concurrency", retire_body(max_concurrency=1)),
]


@pytest.mark.parametrize(("field", "body"), INVALID_BODIES)
def test_invalid_retire_is_rejected_naming_the_field(tenant, paused_queue, field, body):
    response = retire(tenant.client, paused_queue["id"], body, key="retire-1")
    assert_invalid(response, field)
    assert Queue.objects.get(id=paused_queue["id"]).retired_at is None
    assert not IdempotencyRecord.objects.filter(key="retire-1").exists()


def test_retire_a_paused_empty_queue(tenant, paused_queue):
    # given a paused queue with no unfinished tasks, at revision 2
    queue_id = paused_queue["id"]
    # when it is retired with "队" * 1024 as the reason
    reason = "队" * 1024
    response = retire(tenant.client, queue_id, retire_body("2", reason=reason), key="retire-1")
    # then 200 with the queue: revision 3, retired_at in RFC 3339 UTC
    data = assert_ok(response, 200)
    assert data["deduplicated"] is False
    queue = data["queue"]
    assert_queue_shape(queue, retired=True)
    assert queue["revision"] == "3" and queue["paused"] is True
    row = Queue.objects.get(id=queue_id)
    assert row.retired_at is not None and row.revision == 3
    # and the change is audited with its reason
    audit = AuditEntry.objects.get(action="queue.retired")
    assert audit.reason == reason and audit.target_id == queue_id
    assert "retired_at" not in audit.before and audit.after == queue
    assert Event.objects.filter(type="queue.retired", subject_id=queue_id).count() == 1
    # and reads keep working and show the same retired_at
    live = assert_ok(get_queue(tenant.client, queue_id))
    assert_queue_shape(live, retired=True)
    assert live == queue
    listed = assert_ok(tenant.client.get("/v1/queues"))["items"]
    assert listed == [queue]


def test_retire_replay_returns_the_original_receipt(tenant, paused_queue):
    first = assert_ok(retire(tenant.client, paused_queue["id"], retire_body("2"), key="retire-1"))
    again = retire(tenant.client, paused_queue["id"], retire_body("2"), key="retire-1")
    assert assert_ok(again) == {**first, "deduplicated": True}
    assert Queue.objects.get(id=paused_queue["id"]).revision == 3
    assert AuditEntry.objects.filter(action="queue.retired").count() == 1


def test_retire_requires_the_queue_paused(tenant):
    # given a running queue
    queue = create_queue(tenant.client, "images", key="queue-images-v1")
    # when it is retired
    response = retire(tenant.client, queue["id"], retire_body("1"), key="retire-1")
    # then 409 STATE_CONFLICT and nothing changes
    assert "paused" in assert_error(response, 409, "STATE_CONFLICT")
    row = Queue.objects.get(id=queue["id"])
    assert row.retired_at is None and row.revision == 1
    assert not IdempotencyRecord.objects.filter(key="retire-1").exists()
    assert not AuditEntry.objects.filter(action="queue.retired").exists()


def test_retire_requires_no_unfinished_tasks(tenant, paused_queue):
    # given a paused queue that still holds one unfinished task
    queue_id = paused_queue["id"]
    QueueState.objects.filter(queue_id=queue_id).update(unfinished_tasks=1)
    # when it is retired
    response = retire(tenant.client, queue_id, retire_body("2"), key="retire-1")
    # then 409 STATE_CONFLICT, counted in words
    assert assert_error(response, 409, "STATE_CONFLICT") == "queue still has 1 unfinished task"
    QueueState.objects.filter(queue_id=queue_id).update(unfinished_tasks=2)
    response = retire(tenant.client, queue_id, retire_body("2"), key="retire-1")
    assert assert_error(response, 409, "STATE_CONFLICT") == "queue still has 2 unfinished tasks"
    assert Queue.objects.get(id=queue_id).retired_at is None
    assert not IdempotencyRecord.objects.filter(key="retire-1").exists()
    # and once the backlog drains, the same key retires it
    QueueState.objects.filter(queue_id=queue_id).update(unfinished_tasks=0)
    assert_ok(retire(tenant.client, queue_id, retire_body("2"), key="retire-1"))


def test_retire_with_a_stale_revision_is_a_state_conflict(tenant, paused_queue):
    response = retire(tenant.client, paused_queue["id"], retire_body("1"), key="retire-1")
    assert_error(response, 409, "STATE_CONFLICT")
    assert Queue.objects.get(id=paused_queue["id"]).retired_at is None


def test_retired_queue_refuses_configure_and_retire(tenant, paused_queue):
    # given a retired queue at revision 3
    queue_id = paused_queue["id"]
    assert_ok(retire(tenant.client, queue_id, retire_body("2"), key="retire-1"))
    # when it is configured (with the current revision) or retired again under new keys
    configured = configure(tenant.client, queue_id, configure_body("3", paused=False), key="cfg-after")
    retired_again = retire(tenant.client, queue_id, retire_body("3"), key="retire-2")
    # then both are 409 STATE_CONFLICT and leave no record
    assert_error(configured, 409, "STATE_CONFLICT")
    assert_error(retired_again, 409, "STATE_CONFLICT")
    row = Queue.objects.get(id=queue_id)
    assert row.revision == 3 and row.paused is True
    assert not IdempotencyRecord.objects.filter(key__in=["cfg-after", "retire-2"]).exists()


def test_retired_name_stays_taken(tenant, paused_queue):
    # given the seed's queue was retired
    assert_ok(retire(tenant.client, paused_queue["id"], retire_body("2"), key="retire-1"))
    # when the same name is created under a new key
    response = post_json(tenant.client, "/v1/queues", SEED_CREATE, key="queue-images-v2")
    # then 409 STATE_CONFLICT
    assert_error(response, 409, "STATE_CONFLICT")
    assert Queue.objects.filter(name="images").count() == 1
    # while the original create still replays its receipt
    replay = post_json(tenant.client, "/v1/queues", SEED_CREATE, key="queue-images-v1")
    assert assert_ok(replay, 200)["queue"] == paused_queue


def test_retire_of_an_unknown_queue_is_not_found(tenant):
    assert_error(retire(tenant.client, "f" * 32, retire_body("1"), key="retire-1"), 404, "NOT_FOUND")
