"""Canned API objects for the SDK client tests, and the httpx.MockTransport handler that
answers with them and records what the client sent."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from orbit_sdk import Client

TOKEN = "orb_0123456789abcdef0123456789abcdef_secretsecretsecretsecret"
REQUEST_ID = "44444444444444444444444444444444"
QUEUE_ID = "11111111111111111111111111111111"
NAMESPACE_ID = "33333333333333333333333333333333"
TASK_ID = "55555555555555555555555555555555"
ATTEMPT_ID = "66666666666666666666666666666666"


QUEUE = {
    "id": QUEUE_ID,
    "namespace_id": NAMESPACE_ID,
    "name": "images",
    "paused": False,
    "max_concurrency": 8,
    "rate_per_second": 100,
    "max_unfinished_tasks": 100000,
    "unfinished_tasks": "0",
    "revision": "1",
}


TASK_SUMMARY = {
    "id": TASK_ID,
    "namespace_id": NAMESPACE_ID,
    "queue_id": QUEUE_ID,
    "handler": "object.update",
    "handler_version": "v1",
    "payload_version": "v1",
    "priority": 5,
    "state": "WAITING",
    "attempts": 0,
    "max_attempts": 3,
    "available_at": "2026-11-29T20:00:00Z",
    "cancel_requested": False,
    "created_at": "2026-11-29T20:00:00.123456Z",
    "updated_at": "2026-11-29T20:00:00.123456Z",
}


ATTEMPT = {
    "id": ATTEMPT_ID,
    "task_id": TASK_ID,
    "number": 1,
    "state": "RUNNING",
    "epoch": 1,
    "concurrency_token": "17",
    "worker_id": "host-1-abcd",
    "leased_at": "2026-11-29T20:00:00Z",
    "lease_expires_at": "2026-11-29T20:00:30Z",
    "started_at": "2026-11-29T20:00:01Z",
}


APPLICATION = {
    "id": "77777777777777777777777777777777",
    "name": "billing",
    "max_active_attempts": 3,
    "max_unfinished_tasks": 2,
    "active_attempts": "18446744073709551615",
    "unfinished_tasks": "1",
    "revision": "2",
}


PLAN = {
    "id": "88888888888888888888888888888888",
    "namespace_id": NAMESPACE_ID,
    "queue_id": QUEUE_ID,
    "name": "nightly",
    "state": "ACTIVE",
    "version": 1,
    "revision": "1",
    "schedule": {"cron": "30 2 * * *", "timezone": "Europe/Berlin"},
    "misfire": {"policy": "SKIP"},
    "definition": {
        "task": {"handler": "report.build", "handler_version": "v1", "payload_version": "v1", "payload": {}}
    },
    "next_fire_at": "2026-12-01T01:30:00Z",
}


class Recorder:
    """A MockTransport handler that records requests and answers from a script."""

    def __init__(self, respond: Callable[[httpx.Request], httpx.Response]) -> None:
        self.requests: list[httpx.Request] = []
        self.respond = respond

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.respond(request)

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]

    def body(self, index: int = -1) -> Any:
        return json.loads(self.requests[index].content)


def ok(data: Any, status: int = 200) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, json={"request_id": REQUEST_ID, "data": data})


def client_for(recorder: Recorder) -> Client:
    return Client("http://orbit.test/", TOKEN, transport=httpx.MockTransport(recorder))
