"""POST /v1/tasks:batch: one transaction, per-item idempotency and results."""

import threading
from types import SimpleNamespace

import pytest
from django.db import connection, transaction

from orbit.models import IdempotencyRecord
from queues.models import QueueState
from tasks.actions import batch
from tasks.invariants import find_violations
from tasks.models import Task
from tests.conftest import api_client, post_json
from tests.support.api import make_queue
from tests.support.factories import make_credential
from tests.support.tasks import assert_invariants, numbered_task


def post_batch(client, items):
    return post_json(client, "/v1/tasks:batch", {"tasks": items})


@pytest.mark.django_db
def test_batch_accepts_each_item_with_its_own_receipt(tenant):
    queue = make_queue(tenant.client, "batch")
    items = [{"idempotency_key": f"b-{n}", "task": numbered_task(queue["id"], n)} for n in range(5)]
    response = post_batch(tenant.client, items)
    assert response.status_code == 200, response.content
    results = response.json()["data"]["results"]
    assert [r["idempotency_key"] for r in results] == [f"b-{n}" for n in range(5)]
    assert all(r["status"] == 201 and r["deduplicated"] is False for r in results)
    assert Task.objects.filter(queue_id=queue["id"]).count() == 5
    assert QueueState.objects.get(queue_id=queue["id"]).unfinished_tasks == 5
    # a key of the batch replays through the single endpoint, and the reverse
    single = post_json(tenant.client, "/v1/tasks", numbered_task(queue["id"], 2), key="b-2")
    assert single.status_code == 200 and single.json()["data"]["task"] == results[2]["task"]
    again = post_batch(tenant.client, items)
    assert all(r["status"] == 200 and r["deduplicated"] is True for r in again.json()["data"]["results"])
    assert Task.objects.filter(queue_id=queue["id"]).count() == 5


@pytest.mark.django_db
def test_a_replay_outside_the_credentials_queue_range_is_not_found(tenant):
    """Permissions are checked on replays too (SPEC §2): a narrower credential
    of the namespace that learns another queue's key gets 404, not the task."""
    mine, other = make_queue(tenant.client, "mine"), make_queue(tenant.client, "other")
    secret = {**numbered_task(other["id"], 1), "payload": {"secret": "s3cr3t"}}
    assert (
        post_batch(tenant.client, [{"idempotency_key": "theirs", "task": secret}]).json()["data"]["results"][0][
            "status"
        ]
        == 201
    )
    ranged = api_client(make_credential(tenant.namespace, queue_ids=[mine["id"]]).token)
    response = post_batch(ranged, [{"idempotency_key": "theirs", "task": secret}])
    assert response.status_code == 200, response.content
    (result,) = response.json()["data"]["results"]
    assert result == {
        "idempotency_key": "theirs",
        "status": 404,
        "error": {"code": "NOT_FOUND", "message": "queue not found"},
    }
    single = post_json(ranged, "/v1/tasks", secret, key="theirs")
    assert single.status_code == 404 and single.json()["error"]["message"] == "queue not found"
    assert Task.objects.count() == 1


def nested(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.django_db
def test_items_a_database_cannot_store_are_refused_by_name_and_fail_alone(tenant):
    # given items with a payload nested past the limit and a time the offset moves out of range
    queue = make_queue(tenant.client, "batch")
    items = [
        {"idempotency_key": "ok", "task": {**numbered_task(queue["id"], 1), "payload": nested(20)}},
        {"idempotency_key": "deep", "task": {**numbered_task(queue["id"], 2), "payload": {"a": nested(20)}}},
        {"idempotency_key": "late", "task": numbered_task(queue["id"], 3, deadline_at="9999-12-31T23:59:59-01:00")},
        {"idempotency_key": "early", "task": numbered_task(queue["id"], 4, available_at="0001-01-01T00:00:00+01:00")},
    ]
    # when they are sent in one batch
    response = post_batch(tenant.client, items)
    # then each is answered on its own: the 20 levels are kept, the rest refused by field
    assert response.status_code == 200, response.content
    results = response.json()["data"]["results"]
    assert [r["status"] for r in results] == [201, 400, 400, 400]
    assert results[0]["task"]["payload"] == nested(20)
    assert [r["error"]["message"] for r in results[1:]] == [
        "payload: must not nest arrays and objects more than 20 levels deep",
        "deadline_at: out of range: must be from 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999Z in UTC",
        "available_at: out of range: must be from 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999Z in UTC",
    ]
    assert Task.objects.filter(queue_id=queue["id"]).count() == 1


@pytest.mark.django_db
def test_batch_items_fail_alone_and_refused_items_store_nothing(tenant):
    queue = make_queue(tenant.client, "batch", max_unfinished_tasks=2)
    post_json(tenant.client, "/v1/tasks", numbered_task(queue["id"], 0), key="first")
    items = [
        {"idempotency_key": "ok", "task": numbered_task(queue["id"], 1)},
        {"idempotency_key": "bad", "task": numbered_task(queue["id"], 2, priority=10)},
        {"idempotency_key": "full", "task": numbered_task(queue["id"], 3)},
        {"idempotency_key": "first", "task": numbered_task(queue["id"], 99)},
        {"idempotency_key": "nowhere", "task": numbered_task("0" * 32, 4)},
    ]
    results = post_batch(tenant.client, items).json()["data"]["results"]
    assert [r["status"] for r in results] == [201, 400, 429, 409, 404]
    assert "priority" in results[1]["error"]["message"]
    assert results[2]["error"] == {
        "code": "QUEUE_FULL",
        "message": "queue unfinished task limit reached; retry later using the original identity",
    }
    # a single submit's Retry-After, on the item it applies to, and on no other
    assert results[2]["retry_after"] == 1
    assert [("retry_after" in r) for r in results] == [False, False, True, False, False]
    assert results[3]["error"]["code"] == "IDEMPOTENCY_CONFLICT"
    assert not IdempotencyRecord.objects.filter(key__in=["bad", "full", "nowhere"]).exists()
    assert QueueState.objects.get(queue_id=queue["id"]).unfinished_tasks == 2


@pytest.mark.mysql_only
@pytest.mark.django_db(transaction=True)
def test_refused_items_never_wait_for_rows_another_application_is_inserting(tenant):
    """A round inserts its tasks and their idempotency records before it takes
    its application's lock, and removes a refused item's rows under it. On
    tables whose statistics count no more rows than the refusals name (a table
    grown fast since they were taken), MariaDB planned a DELETE … IN (…) as a
    full scan, which waited for every row any other transaction had locked or
    not yet committed: another application's in-flight submit held this
    application's round, and with this one's rows in the other's way, a deadlock."""
    queue = make_queue(tenant.client, "batch", max_unfinished_tasks=1)
    post_json(tenant.client, "/v1/tasks", numbered_task(queue["id"], 0), key="first")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE orbit_task, orbit_idempotency_record")
    inserted, released = threading.Event(), threading.Event()

    def another_application_submitting() -> None:
        try:
            with transaction.atomic():
                row = Task.objects.get(queue_id=queue["id"])
                row.id, row.namespace_id, row.application_id = "f" * 32, "e" * 32, "d" * 32
                row.save(force_insert=True)
                IdempotencyRecord.objects.create(
                    namespace_id="e" * 32,
                    key="theirs",
                    operation="task.submit",
                    digest="0" * 64,
                    response_status=201,
                    response_data={},
                    request_id="c" * 32,
                )
                inserted.set()
                assert released.wait(60)
                transaction.set_rollback(True)  # only ever in flight
        finally:
            connection.close()

    other = threading.Thread(target=another_application_submitting)
    other.start()
    answered: list = []
    try:
        assert inserted.wait(30)
        items = [{"idempotency_key": f"full-{n}", "task": numbered_task(queue["id"], n)} for n in range(1, 11)]
        submitter = threading.Thread(target=lambda: answered.append(post_batch(tenant.client, items)))
        submitter.start()
        submitter.join(timeout=10)
        assert not submitter.is_alive(), "the refusals waited for rows of another application"
    finally:
        released.set()
        other.join(timeout=60)
        connection.close()
    results = answered[0].json()["data"]["results"]
    assert [r["status"] for r in results] == [429] * 10
    assert Task.objects.filter(queue_id=queue["id"]).count() == 1
    assert not IdempotencyRecord.objects.filter(key__startswith="full-").exists()
    assert QueueState.objects.get(queue_id=queue["id"]).unfinished_tasks == 1
    assert_invariants()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field",
    [
        ({"tasks": []}, "tasks"),
        ({"tasks": "x"}, "tasks"),
        ({"tasks": [{"idempotency_key": "a"}]}, "tasks[0]"),
        ({"tasks": [{"idempotency_key": "", "task": {}}]}, "tasks[0].idempotency_key"),
        ({"tasks": [{"idempotency_key": 5, "task": {}}]}, "tasks[0].idempotency_key"),
        (
            {"tasks": [{"idempotency_key": "a", "task": {}}, {"idempotency_key": "a", "task": {}}]},
            "tasks[1].idempotency_key",
        ),
        ({"tasks": [{"idempotency_key": "a", "task": []}]}, "tasks[0].task"),
        ({"tasks": [], "extra": 1}, "extra"),
        ({"tasks": [{"idempotency_key": "a", "task": {}, "ref": None}]}, "tasks[0].ref: This field may not be null."),
        ({"tasks": [{"idempotency_key": "a", "task": {}, "ref": ""}]}, "tasks[0].ref: must be 1-64"),
        ({"tasks": [{"idempotency_key": "a", "task": {}, "refs": "x"}]}, "tasks[0].refs: unknown field"),
    ],
)
def test_malformed_batches_are_refused_whole(tenant, body, field):
    response = post_json(tenant.client, "/v1/tasks:batch", body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert response.json()["error"]["message"].startswith(field)


@pytest.mark.django_db(transaction=True)
def test_concurrent_batches_sharing_keys_create_each_task_once(tenant):
    queue = make_queue(tenant.client, "batch")
    items = [{"idempotency_key": f"shared-{n}", "task": numbered_task(queue["id"], n)} for n in range(40)]
    statuses: list[list[int]] = []
    barrier = threading.Barrier(6)

    def send(offset):
        client = api_client(tenant.token)
        rotated = items[offset:] + items[:offset]
        barrier.wait()
        response = post_batch(client, rotated)
        statuses.append([r["status"] for r in response.json()["data"]["results"]])
        connection.close()

    threads = [threading.Thread(target=send, args=(n * 7,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(statuses) == 6
    assert all(set(s) <= {200, 201} for s in statuses)
    assert sum(s.count(201) for s in statuses) == 40
    assert Task.objects.filter(queue_id=queue["id"]).count() == 40
    assert find_violations() == []


@pytest.mark.django_db
def test_keys_differing_only_in_case_or_spaces_keep_their_own_receipts(tenant):
    # each record's receipt is written by its key: the keys compare byte for byte
    queue = make_queue(tenant.client, "bytes")
    keys = ["k", "k ", "K", " k"]
    items = [{"idempotency_key": key, "task": numbered_task(queue["id"], n)} for n, key in enumerate(keys)]
    results = post_batch(tenant.client, items).json()["data"]["results"]
    assert [r["status"] for r in results] == [201] * len(keys)
    replays = post_batch(tenant.client, items).json()["data"]["results"]
    assert [r["status"] for r in replays] == [200] * len(keys)
    for n, (first, replay) in enumerate(zip(results, replays, strict=True)):
        assert replay["task"] == first["task"] and replay["task"]["payload"] == {"n": n}
    assert len({r["task"]["id"] for r in results}) == len(keys)


def test_a_batch_that_fails_whole_is_tried_again_item_by_item(monkeypatch):
    # given submits of one credential, one of which fails any batch it is in
    calls: list[list[str]] = []

    def submit_batch(*, actor, items):
        calls.append([item.key for item in items])
        if any(item.key == "poison" for item in items):
            raise RuntimeError("cannot store")
        return [f"stored {item.key}" for item in items]

    monkeypatch.setattr(batch, "submit_batch", submit_batch)
    actor = SimpleNamespace(principal=SimpleNamespace(credential_id="c1"))
    requests = [(actor, SimpleNamespace(key=key)) for key in ("a", "poison", "b")]
    # when they are submitted together
    outcomes = batch.submit_each_credential(requests)
    # then only the poisonous one fails; the others are stored, each alone after the failed batch
    assert outcomes[0] == "stored a" and outcomes[2] == "stored b"
    assert isinstance(outcomes[1], RuntimeError)
    assert calls == [["a", "poison", "b"], ["a"], ["poison"], ["b"]]
