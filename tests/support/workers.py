"""Drives the worker protocol in tests, through Channels' WebsocketCommunicator."""

from __future__ import annotations

import itertools
from typing import Any

from channels.testing import WebsocketCommunicator

from orbit.asgi import application
from orbit.db.mysql import base as mysql_backend
from tests.conftest import post_json

# Importing the application marks this process as a server (short database
# timeouts); the test process itself runs long statements (bulk fixtures).
mysql_backend.serving = False

_ids = itertools.count(1)


class ProtocolClient:
    def __init__(self, token: str) -> None:
        self.communicator = WebsocketCommunicator(
            application, "/v1/workers/connect", headers=[(b"authorization", f"Bearer {token}".encode())]
        )
        self.pending: list[dict[str, Any]] = []

    async def connect(self) -> None:
        connected, _ = await self.communicator.connect()
        assert connected

    async def receive(self, timeout: float = 5) -> dict[str, Any]:
        if self.pending:
            return self.pending.pop(0)
        return await self.communicator.receive_json_from(timeout=timeout)

    async def request(self, type: str, timeout: float = 5, **fields: Any) -> dict[str, Any]:
        """Sends a request and returns its reply; assignments met on the way are kept."""
        request_id = str(next(_ids))
        await self.communicator.send_json_to({"id": request_id, "type": type, **fields})
        while True:
            frame = await self.communicator.receive_json_from(timeout=timeout)
            if frame.get("reply_to") == request_id:
                return frame
            self.pending.append(frame)

    async def hello(self, queues: list[str], capacity: int = 1, worker_id: str = "w1", **extra: Any) -> dict[str, Any]:
        return await self.request(
            "hello",
            worker_id=worker_id,
            queues=queues,
            capacity=capacity,
            handlers=extra.pop("handlers", []),
            concurrency_keys=extra.pop("concurrency_keys", True),
            version="test",
            **extra,
        )

    async def next_assignment(self, timeout: float = 5) -> dict[str, Any]:
        for index, frame in enumerate(self.pending):
            if frame.get("type") == "task.assign":
                return self.pending.pop(index)
        while True:
            frame = await self.communicator.receive_json_from(timeout=timeout)
            if frame.get("type") == "task.assign":
                return frame
            self.pending.append(frame)

    async def close(self) -> None:
        await self.communicator.disconnect()


def submit(tenant, queue_id, key, **extra):
    body = {"queue_id": queue_id, "handler": "echo", "handler_version": "v1", "payload_version": "v1", "payload": {}}
    body.update(extra)
    response = post_json(tenant.client, "/v1/tasks", body, key=key)
    assert response.status_code == 201, response.content
    return response.json()["data"]["task"]
