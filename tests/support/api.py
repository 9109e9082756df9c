"""The HTTP checks and calls every API suite shares: the envelope asserts (SPEC §3),
the shapes of ids and timestamps, and a queue to work in."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from tests.conftest import post_json

HEX32 = re.compile(r"[0-9a-f]{32}")
RFC3339_UTC = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?Z")


def assert_envelope_ids(response: Any) -> dict[str, Any]:
    body = response.json()
    assert HEX32.fullmatch(body["request_id"]), body
    assert response["X-Request-Id"] == body["request_id"]
    return body


def assert_ok(response: Any, status: int = 200) -> Any:
    """The success envelope; returns its data."""
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json")
    body = assert_envelope_ids(response)
    assert set(body) == {"request_id", "data"}, body
    return body["data"]


def assert_error(response: Any, status: int, code: str) -> str:
    """The error envelope; returns its message."""
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json")
    body = assert_envelope_ids(response)
    assert set(body) == {"request_id", "error"}, body
    assert set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"] == code, body
    message = body["error"]["message"]
    assert isinstance(message, str) and message
    return message


def assert_invalid(response: Any, field: str) -> str:
    """400 INVALID_ARGUMENT whose message names the offending field first."""
    message = assert_error(response, 400, "INVALID_ARGUMENT")
    assert message.startswith(f"{field}:"), message
    return message


def parse_time(text: str) -> datetime:
    """An RFC 3339 UTC timestamp as the API prints it."""
    assert RFC3339_UTC.fullmatch(text), text
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def make_queue(client: Any, name: str = "q", **limits: Any) -> dict[str, Any]:
    """Creates a queue over the API (8 concurrent, 100/s unless `limits` say otherwise)
    and returns the queue object of the 201 receipt."""
    body = {"name": name, "max_concurrency": 8, "rate_per_second": 100, **limits}
    return assert_ok(post_json(client, "/v1/queues", body, key=f"create-{name}"), 201)["queue"]
