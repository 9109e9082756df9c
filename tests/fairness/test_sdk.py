"""The SDK's fairness_key: sent when set, read back from a task."""

from __future__ import annotations

from orbit_sdk import SubmitTaskRequest, Task


def test_the_request_sends_the_key_only_when_set():
    plain = SubmitTaskRequest("q", "h", "v1", "v1", {})
    assert "fairness_key" not in plain.to_json()
    keyed = SubmitTaskRequest("q", "h", "v1", "v1", {}, fairness_key="tenant/42")
    assert keyed.to_json()["fairness_key"] == "tenant/42"


def test_a_task_reads_the_key():
    body = {
        "id": "t" * 32,
        "namespace_id": "n" * 32,
        "queue_id": "q" * 32,
        "handler": "h",
        "handler_version": "v1",
        "payload_version": "v1",
        "priority": 5,
        "state": "WAITING",
        "attempts": 0,
        "max_attempts": 3,
        "available_at": "2026-01-02T03:04:05Z",
        "cancel_requested": False,
        "created_at": "2026-01-02T03:04:05Z",
        "updated_at": "2026-01-02T03:04:05Z",
    }
    assert Task.from_json(body).fairness_key is None
    assert Task.from_json({**body, "fairness_key": "tenant/42"}).fairness_key == "tenant/42"
