"""Shared pieces of the keyed-concurrency tests (seed keyed-concurrency.zh.md)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
from typing import Any

from tasks.models import Attempt, ConcurrencyKey
from tests.conftest import post_json
from tests.support.live import WorkerConnection

TOKEN = re.compile(r"[1-9][0-9]{0,19}")
UINT64_MAX = 2**64 - 1


def task_body(queue_id: str, **extra: Any) -> dict[str, Any]:
    body = {"queue_id": queue_id, "handler": "echo", "handler_version": "v1", "payload_version": "v1", "payload": {}}
    body.update(extra)
    return body


def submit(tenant: Any, queue_id: str, idem: str, **extra: Any) -> dict[str, Any]:
    """Submits a task and returns the task object of the 201 receipt."""
    response = post_json(tenant.client, "/v1/tasks", task_body(queue_id, **extra), key=idem)
    assert response.status_code == 201, response.content
    return response.json()["data"]["task"]


def get_task(tenant: Any, task_id: str) -> dict[str, Any]:
    response = tenant.client.get(f"/v1/tasks/{task_id}")
    assert response.status_code == 200, response.content
    return response.json()["data"]


def list_attempts(tenant: Any, task_id: str) -> list[dict[str, Any]]:
    response = tenant.client.get(f"/v1/tasks/{task_id}/attempts")
    assert response.status_code == 200, response.content
    return response.json()["data"]["items"]


def get_attempt(tenant: Any, attempt_id: str) -> dict[str, Any]:
    response = tenant.client.get(f"/v1/attempts/{attempt_id}")
    assert response.status_code == 200, response.content
    return response.json()["data"]


def key_row(namespace_id: str, key: str) -> ConcurrencyKey | None:
    return ConcurrencyKey.objects.filter(namespace_id=namespace_id, key=key).first()


def attempt_row(attempt_id: str) -> Attempt:
    return Attempt.objects.get(id=attempt_id)


class Worker(WorkerConnection):
    """WorkerConnection with the verbs the key tests repeat."""

    welcome: dict[str, Any]

    def expect_assignment(self, timeout: float = 5) -> dict[str, Any]:
        frame = self.next_assignment(timeout=timeout)
        assert frame is not None, "no task.assign arrived"
        return frame

    def start(self, assign: dict[str, Any]) -> dict[str, Any]:
        reply = self.request("task.start", attempt_id=assign["attempt_id"], epoch=assign["epoch"])
        assert reply["type"] == "task.start.ok", reply
        return reply

    def result(self, assign: dict[str, Any], outcome: str = "SUCCEEDED", **fields: Any) -> dict[str, Any]:
        reply = self.request(
            "task.result", attempt_id=assign["attempt_id"], epoch=assign["epoch"], outcome=outcome, **fields
        )
        assert reply["type"] == "task.result.ok", reply
        return reply

    def finish(self, assign: dict[str, Any]) -> dict[str, Any]:
        self.start(assign)
        return self.result(assign)

    def drop(self) -> None:
        """Loses the connection without a close handshake (a killed process)."""
        sock = self.ws.socket
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        with contextlib.suppress(Exception):  # the socket is already gone
            self.ws.close()


def raw_task_json(queue_id: str, key_json: str) -> str:
    """A submit body whose concurrency_key is the given JSON text, sent verbatim."""
    head = json.dumps(task_body(queue_id))[:-1]
    return f'{head}, "concurrency_key": {key_json}}}'
