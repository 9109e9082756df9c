"""Bad input to POST /v1/tasks and POST /v1/tasks:batch is refused by name,
never with a 500, and a refusal writes nothing (SPEC §3: "INTERNAL 500 (never
for bad input)"; "Malformed JSON, invalid UTF-8, wrong types, ...: 400 with a
message naming the field")."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest

from orbit.models import IdempotencyRecord
from queues.models import QueueState
from tasks.models import Task
from tests.support.tasks import numbered_task

pytestmark = pytest.mark.django_db(transaction=True)

TOO_DEEP = "payload: must not nest arrays and objects more than 20 levels deep"


@pytest.fixture
def live(tenant, orbit_server):
    http = httpx.Client(base_url=orbit_server.url, headers={"Authorization": f"Bearer {tenant.token}"}, timeout=30)
    created = http.post(
        "/v1/queues",
        json={"name": "fuzz", "max_concurrency": 5, "rate_per_second": 5, "max_unfinished_tasks": 100},
        headers={"Idempotency-Key": "fuzz"},
    )
    return http, created.json()["data"]["queue"]["id"]


def batch_body(*entries: tuple[str, bytes]) -> bytes:
    """A batch whose tasks are raw JSON texts (so they may hold what json.dumps would not write)."""
    items = b",".join(
        b'{"idempotency_key":' + json.dumps(key).encode() + b',"task":' + task + b"}" for key, task in entries
    )
    return b'{"tasks":[' + items + b"]}"


PLAIN = {"Content-Type": "application/json"}


def test_a_batch_item_with_a_lone_surrogate_field_name_is_refused_alone_not_a_500(live):
    # given a batch of a good task, a task with an unknown field named by a lone surrogate escape, and a good task
    http, queue_id = live
    good = json.dumps(numbered_task(queue_id, 1)).encode()
    odd = json.dumps(numbered_task(queue_id, 2)).encode()[:-1] + rb', "\ud800": 1}'
    other = json.dumps(numbered_task(queue_id, 3)).encode()
    # when it is submitted
    body = batch_body(("g1", good), ("odd", odd), ("g2", other))
    response = http.post("/v1/tasks:batch", content=body, headers=PLAIN)
    # then the batch is answered 200 with a result per item, the odd one refused by name
    # as the single route refuses it (SPEC §3: unknown fields → 400, never INTERNAL)
    assert response.status_code == 200, response.text
    results = response.json()["data"]["results"]
    assert [result["status"] for result in results] == [201, 400, 201]
    single = http.post("/v1/tasks", content=odd, headers={**PLAIN, "Idempotency-Key": "odd-single"})
    assert single.status_code == 400
    assert results[1]["error"] == single.json()["error"]
    assert results[1]["error"]["code"] == "INVALID_ARGUMENT"
    assert results[1]["error"]["message"].endswith(": unknown field")
    # and exactly the two accepted tasks were stored and counted, and the refused key kept no record
    assert Task.objects.filter(queue_id=queue_id).count() == 2
    assert QueueState.objects.get(queue_id=queue_id).unfinished_tasks == 2
    assert not IdempotencyRecord.objects.filter(key__in=["odd", "odd-single"]).exists()


def test_a_payload_nested_as_deep_as_the_parser_goes_is_refused_by_name_not_a_500(live):
    # given payloads nested from a little under to past the depth Python's JSON
    # parser allows (its recursion limit, 1000 frames, less the stack in use)
    http, queue_id = live
    fields = {name: value for name, value in numbered_task(queue_id, 1).items() if name != "payload"}
    text = json.dumps(fields).encode()
    answers: dict[str, set[tuple[int, str, str]]] = {"single": set(), "batch": set()}
    for levels in range(940, 1000):
        raw = text[:-1] + b', "payload": ' + b"[" * levels + b"]" * levels + b"}"
        # when it is submitted through the single route and in a batch
        single = http.post("/v1/tasks", content=raw, headers={**PLAIN, "Idempotency-Key": f"deep-{levels}"})
        batch = http.post("/v1/tasks:batch", content=batch_body((f"deep-{levels}", raw)), headers=PLAIN)
        error = single.json()["error"]
        answers["single"].add((single.status_code, error["code"], error["message"]))
        if batch.status_code == 200:
            (result,) = batch.json()["data"]["results"]
            answers["batch"].add((result["status"], result["error"]["code"], result["error"]["message"]))
        else:
            error = batch.json()["error"]
            answers["batch"].add((batch.status_code, error["code"], error["message"]))
    # then every one is a 400 INVALID_ARGUMENT: too deep for the payload rule or for the parser, never INTERNAL
    allowed = {(400, "INVALID_ARGUMENT", TOO_DEEP), (400, "INVALID_ARGUMENT", "request body: JSON nested too deeply")}
    assert answers["single"] <= allowed, answers["single"]
    assert answers["batch"] <= allowed, answers["batch"]
    # and nothing was stored
    assert not Task.objects.filter(queue_id=queue_id).exists()
    assert QueueState.objects.get(queue_id=queue_id).unfinished_tasks == 0


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br, gzip"])
@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/tasks:batch", "/v1/queues"])
def test_a_compressed_body_is_refused_naming_its_content_encoding(live, path, encoding):
    # given a body sent compressed (Orbit reads bodies as sent)
    http, queue_id = live
    body = gzip.compress(json.dumps(numbered_task(queue_id, 1)).encode())
    # when it is posted
    headers = {**PLAIN, "Content-Encoding": encoding, "Idempotency-Key": f"zipped-{path}-{encoding}"}
    response = http.post(path, content=body, headers=headers)
    # then the refusal names the header, not the bytes it could not read, and nothing is stored
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == (
        f"Content-Encoding: {encoding} is not supported; send the body uncompressed"
    )
    assert not Task.objects.filter(queue_id=queue_id).exists()


@pytest.mark.parametrize(("encoding", "status", "stored"), [("gzip", 400, 0), ("identity", 201, 1)])
def test_a_plain_body_is_judged_by_its_content_encoding(live, encoding, status, stored):
    # a body said to be compressed is refused even when it reads as JSON (the submit route too)
    http, queue_id = live
    headers = {**PLAIN, "Content-Encoding": encoding, "Idempotency-Key": f"said-{encoding}"}
    response = http.post("/v1/tasks", content=json.dumps(numbered_task(queue_id, 1)), headers=headers)
    assert response.status_code == status, response.text
    assert Task.objects.filter(queue_id=queue_id).count() == stored
