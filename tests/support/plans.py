"""Helpers the plan tests share."""

from __future__ import annotations

from typing import Any

from tests.conftest import post_json

TASK = {"handler": "report.build", "handler_version": "v1", "payload_version": "v1", "payload": {"kind": "daily"}}


def plan_body(queue_id: str, name: str = "nightly", **overrides: Any) -> dict[str, Any]:
    return {
        "name": name,
        "queue_id": queue_id,
        "schedule": {"interval_seconds": 60},
        "misfire": {"policy": "CATCH_UP", "catch_up_window_seconds": 600},
        "definition": {"task": dict(TASK)},
        **overrides,
    }


def create_plan(client: Any, body: dict[str, Any], key: str = "plan-1") -> Any:
    return post_json(client, "/v1/plans", body, key=key)


def change(client: Any, plan_id: str, verb: str, revision: str, key: str, reason: str = "ops") -> Any:
    return post_json(client, f"/v1/plans/{plan_id}:{verb}", {"expected_revision": revision, "reason": reason}, key=key)
