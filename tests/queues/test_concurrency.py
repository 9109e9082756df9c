"""Real races on the database: threads, each with its own connection and client."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from orbit.models import AuditEntry, IdempotencyRecord
from queues.models import Queue, QueueState
from tests.conftest import api_client, post_json
from tests.support.api import assert_error, assert_ok
from tests.support.queues import SEED_CREATE, configure, configure_body, create_queue
from tests.support.race import race

pytestmark = pytest.mark.django_db(transaction=True)


def test_concurrent_duplicates_of_one_create_make_one_queue(tenant):
    # given 20 callers holding the same create under one Idempotency-Key
    def send(_: int) -> tuple[int, dict]:
        response = post_json(api_client(tenant.token), "/v1/queues", SEED_CREATE, key="queue-images-v1")
        return response.status_code, response.json()

    # when they all send at once
    results = race(20, send)
    # then exactly one effect: one 201, the rest 200 replays, all naming one queue
    statuses = Counter(status for status, _ in results)
    assert statuses == {201: 1, 200: 19}, [body for _, body in results]
    queue_ids = {body["data"]["queue"]["id"] for _, body in results}
    assert len(queue_ids) == 1
    for status, body in results:
        assert body["data"]["deduplicated"] is (status == 200)
    assert Queue.objects.count() == 1 and QueueState.objects.count() == 1
    assert Queue.objects.get().id == queue_ids.pop()
    assert IdempotencyRecord.objects.count() == 1
    assert AuditEntry.objects.count() == 1


def test_concurrent_creates_of_one_name_under_different_keys(tenant):
    # given 10 callers creating the same name, each under its own key
    def send(index: int) -> tuple[int, dict]:
        response = post_json(api_client(tenant.token), "/v1/queues", SEED_CREATE, key=f"queue-images-{index}")
        return response.status_code, response.json()

    # when they all send at once
    results = race(10, send)
    # then one 201 and nine 409 STATE_CONFLICT
    statuses = Counter(status for status, _ in results)
    assert statuses == {201: 1, 409: 9}, [body for _, body in results]
    assert {body["error"]["code"] for status, body in results if status == 409} == {"STATE_CONFLICT"}
    winner = next(index for index, (status, _) in enumerate(results) if status == 201)
    # and only the winner left a record
    assert Queue.objects.count() == 1 and QueueState.objects.count() == 1
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == [f"queue-images-{winner}"]
    assert AuditEntry.objects.count() == 1


@pytest.mark.parametrize("round_number", range(5))
def test_concurrent_configures_on_one_revision_one_wins(tenant, round_number):
    # given a queue at revision 1
    queue = create_queue(tenant.client, "images", key="queue-images-v1")

    # when two configures expecting revision 1 arrive together under different keys
    def send(index: int) -> Any:
        body = configure_body("1", max_concurrency=10 + index, reason=f"operator {index}")
        return configure(api_client(tenant.token), queue["id"], body, key=f"cfg-{round_number}-{index}")

    results = race(2, send)
    # then exactly one 200 and one 409 STATE_CONFLICT
    assert sorted(response.status_code for response in results) == [200, 409], [r.content for r in results]
    winner = next(index for index, response in enumerate(results) if response.status_code == 200)
    loser = 1 - winner
    assert assert_ok(results[winner])["queue"]["revision"] == "2"
    assert_error(results[loser], 409, "STATE_CONFLICT")
    # and the queue holds the winner's configuration at revision 2, audited once
    row = Queue.objects.get(id=queue["id"])
    assert (row.revision, row.max_concurrency) == (2, 10 + winner)
    assert AuditEntry.objects.filter(action="queue.configured").count() == 1
    assert IdempotencyRecord.objects.filter(key=f"cfg-{round_number}-{loser}").count() == 0


def test_concurrent_duplicates_of_one_configure_apply_once(tenant):
    # given a queue at revision 1
    queue = create_queue(tenant.client, "images", key="queue-images-v1")

    # when eight callers send the same configure under the same key at once
    def send(_: int) -> Any:
        return configure(api_client(tenant.token), queue["id"], configure_body("1"), key="queue-control-001")

    results = race(8, send)
    # then all succeed with one snapshot, one of them fresh
    datas = [assert_ok(response) for response in results]
    assert Counter(data["deduplicated"] for data in datas) == {False: 1, True: 7}
    assert len({str(data["queue"]) for data in datas}) == 1
    assert Queue.objects.get(id=queue["id"]).revision == 2
    assert AuditEntry.objects.filter(action="queue.configured").count() == 1


def test_concurrent_configure_and_retire_on_one_revision_one_wins(tenant):
    # given a paused queue at revision 2
    queue = create_queue(tenant.client, "images", key="queue-images-v1")
    assert_ok(configure(tenant.client, queue["id"], configure_body("1", paused=True), key="pause"))

    # when a configure and a retire, both expecting revision 2, arrive together
    def send(index: int) -> Any:
        client = api_client(tenant.token)
        if index == 0:
            return configure(client, queue["id"], configure_body("2", paused=True, max_concurrency=50), key="cfg")
        return post_json(
            client, f"/v1/queues/{queue['id']}:retire", {"expected_revision": "2", "reason": "r"}, key="ret"
        )

    configured, retired = race(2, send)
    # then exactly one of them happened, at revision 3
    assert sorted([configured.status_code, retired.status_code]) == [200, 409]
    row = Queue.objects.get(id=queue["id"])
    assert row.revision == 3
    if configured.status_code == 200:
        assert row.retired_at is None and row.max_concurrency == 50
    else:
        assert row.retired_at is not None and row.max_concurrency == 2
    assert IdempotencyRecord.objects.filter(key__in=["cfg", "ret"]).count() == 1
