"""Concurrent single submits against a live server, where they are group-committed:
each request still gets exactly its own outcome."""

import threading

import httpx
import pytest

from orbit.models import IdempotencyRecord
from tasks.invariants import find_violations
from tasks.models import Task
from tests.support.live import LIVE_METRICS_TOKEN
from tests.support.tasks import numbered_task

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE_FULL_MESSAGE = "queue unfinished task limit reached; retry later using the original identity"


def test_concurrent_single_submits_each_get_their_own_outcome(tenant, orbit_server):
    http = httpx.Client(base_url=orbit_server.url, headers={"Authorization": f"Bearer {tenant.token}"}, timeout=30)
    queue = http.post(
        "/v1/queues",
        json={"name": "co", "max_concurrency": 1, "rate_per_second": 1, "max_unfinished_tasks": 30},
        headers={"Idempotency-Key": "co"},
    )
    queue_id = queue.json()["data"]["queue"]["id"]
    # 40 distinct valid keys (only 30 fit), each sent twice at once; 5 invalid; one key sent with two bodies.
    requests = [(f"k{n}", numbered_task(queue_id, n)) for n in range(40) for _ in range(2)]
    requests += [(f"bad{n}", numbered_task(queue_id, n, priority=42)) for n in range(5)]
    requests += [("x", numbered_task(queue_id, 1000)), ("x", numbered_task(queue_id, 1001))]
    answers = {}
    barrier = threading.Barrier(len(requests))

    def send(index, key, payload):
        client = httpx.Client(
            base_url=orbit_server.url, headers={"Authorization": f"Bearer {tenant.token}"}, timeout=30
        )
        barrier.wait()
        response = client.post("/v1/tasks", json=payload, headers={"Idempotency-Key": key})
        answers[index] = (key, payload, response.status_code, response.json(), response.headers)

    threads = [threading.Thread(target=send, args=(i, k, p)) for i, (k, p) in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    by_key = {}
    for key, payload, status, envelope, headers in answers.values():
        by_key.setdefault(key, []).append((payload, status, envelope, headers))
    accepted_keys = set()
    for n in range(40):
        outcomes = [(s, e) for _, s, e, _ in by_key[f"k{n}"]]
        statuses = sorted(s for s, _ in outcomes)
        assert statuses in ([200, 201], [429, 429], [201, 429]), statuses
        if 201 in statuses:
            accepted_keys.add(f"k{n}")
            ids = {e["data"]["task"]["id"] for s, e in outcomes if s in (200, 201)}
            assert len(ids) == 1
            assert [s for s, _ in outcomes].count(201) == 1
        for s, e in outcomes:
            if s == 429:
                assert e["error"] == {"code": "QUEUE_FULL", "message": QUEUE_FULL_MESSAGE}
    twins = sorted((s, e.get("error", {}).get("code")) for _, s, e, _ in by_key["x"])
    # one body wins (or the queue is full for it), the other is a different request under a used key
    assert twins in (
        [(201, None), (409, "IDEMPOTENCY_CONFLICT")],
        [(409, "IDEMPOTENCY_CONFLICT"), (429, "QUEUE_FULL")],
        [(429, "QUEUE_FULL"), (429, "QUEUE_FULL")],
    ), twins
    if twins[0][0] == 201:
        accepted_keys.add("x")
    assert len(accepted_keys) == 30
    for n in range(5):
        ((_, status, envelope, _),) = by_key[f"bad{n}"]
        assert status == 400 and "priority" in envelope["error"]["message"]
    assert Task.objects.filter(queue_id=queue_id).count() == 30
    assert IdempotencyRecord.objects.exclude(key="co").count() == 30
    assert not IdempotencyRecord.objects.filter(key__startswith="bad").exists()
    assert find_violations() == []
    assert any(h.get("Retry-After") == "1" for _, s, _, h in [v for vs in by_key.values() for v in vs] if s == 429)


def test_the_api_handler_answers_with_the_usual_headers(tenant, orbit_server):
    # /v1/ runs through its own ASGI handler (orbit/api/handler.py); the admin keeps Django's
    http = httpx.Client(base_url=orbit_server.url, headers={"Authorization": f"Bearer {tenant.token}"}, timeout=30)
    response = http.post(
        "/v1/queues",
        json={"name": "headers", "max_concurrency": 1, "rate_per_second": 1},
        headers={"Idempotency-Key": "headers"},
    )
    assert response.status_code == 201
    assert response.headers["Content-Length"] == str(len(response.content))
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["X-Request-Id"] == response.json()["request_id"]
    assert http.get("/v1/no-such-endpoint").json()["error"]["code"] == "NOT_FOUND"
    schema = http.get("/v1/openapi.json")  # a sync DRF view without the per-request thread
    assert schema.status_code == 200 and "/v1/tasks" in schema.text
    admin = httpx.get(f"{orbit_server.url}/admin/login/", timeout=30)
    assert admin.status_code == 200 and "csrftoken" in admin.cookies
    # metrics are the platform operator's: ORBIT_METRICS_TOKEN, never a tenant's credential (SPEC §11)
    anonymous = httpx.get(f"{orbit_server.url}/metrics", timeout=30)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "UNAUTHENTICATED"
    tenant_scrape = http.get("/metrics")
    assert tenant_scrape.status_code == 403 and tenant_scrape.json()["error"]["code"] == "PERMISSION_DENIED"
    metrics = httpx.get(
        f"{orbit_server.url}/metrics", headers={"Authorization": f"Bearer {LIVE_METRICS_TOKEN}"}, timeout=30
    )
    assert metrics.status_code == 200 and metrics.headers["Content-Type"].startswith("text/plain")
    assert "orbit_tasks_submitted_total" in metrics.text
