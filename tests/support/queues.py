"""Helpers the queue and HTTP-convention tests share: requests and envelope checks."""

from __future__ import annotations

import json
import re
from typing import Any

from orbit.models import IdempotencyRecord
from tests.conftest import post_json
from tests.support.api import HEX32, RFC3339_UTC, assert_ok

# The queue object exactly as the seed prints it; retired_at joins only once retired.
QUEUE_KEYS = {
    "id",
    "namespace_id",
    "name",
    "paused",
    "max_concurrency",
    "rate_per_second",
    "max_unfinished_tasks",
    "unfinished_tasks",
    "revision",
}

SEED_CREATE = {"name": "images", "max_concurrency": 8, "rate_per_second": 100}


def assert_queue_shape(queue: dict[str, Any], *, retired: bool = False) -> None:
    expected = QUEUE_KEYS | ({"retired_at"} if retired else set())
    assert set(queue) == expected, queue
    assert HEX32.fullmatch(queue["id"])
    assert HEX32.fullmatch(queue["namespace_id"])
    assert isinstance(queue["name"], str)
    assert type(queue["paused"]) is bool
    for field in ("max_concurrency", "rate_per_second", "max_unfinished_tasks"):
        assert type(queue[field]) is int, field
    for field in ("unfinished_tasks", "revision"):
        assert isinstance(queue[field], str) and re.fullmatch(r"0|[1-9][0-9]*", queue[field]), field
    if retired:
        assert RFC3339_UTC.fullmatch(queue["retired_at"]), queue["retired_at"]


def create_queue(client: Any, name: str, *, key: str | None = None, **fields: Any) -> dict[str, Any]:
    """Creates a queue over the API and returns the queue object of the receipt."""
    body = {"name": name, "max_concurrency": 8, "rate_per_second": 100, **fields}
    response = post_json(client, "/v1/queues", body, key=key or f"create-{name}")
    return assert_ok(response, 201)["queue"]


def configure_body(revision: str = "1", **overrides: Any) -> dict[str, Any]:
    body = {
        "expected_revision": revision,
        "reason": "limit background traffic",
        "paused": False,
        "max_concurrency": 2,
        "rate_per_second": 1,
        "max_unfinished_tasks": 100,
    }
    body.update(overrides)
    return body


def configure(client: Any, queue_id: str, body: dict[str, Any], key: str) -> Any:
    return post_json(client, f"/v1/queues/{queue_id}:configure", body, key=key)


def retire(client: Any, queue_id: str, body: dict[str, Any], key: str) -> Any:
    return post_json(client, f"/v1/queues/{queue_id}:retire", body, key=key)


def get_queue(client: Any, queue_id: str) -> Any:
    return client.get(f"/v1/queues/{queue_id}")


def record_count(namespace_id: str | None = None) -> int:
    records = IdempotencyRecord.objects.all()
    if namespace_id is not None:
        records = records.filter(namespace_id=namespace_id)
    return records.count()


def raw_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
