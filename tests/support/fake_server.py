"""A small, scriptable server speaking the worker protocol (docs/protocol.md) for SDK tests.

It keeps just enough state to be honest about the protocol: attempts per worker identity, their
state (LEASED → RUNNING → ended), replayed starts and results answered from the record, `held`
on reconnect, drain closing once nothing is held. Tests steer it with scripts:

* ``start_replies[attempt_id]`` / ``renew_replies[...]`` / ``resume_replies[...]``: replies sent
  (popped in order) instead of the normal answer;
* ``result_actions``: per received task.result, "ok" (default), "drop" (recorded, no reply),
  "close" (not recorded, connection closed), "close_after" (recorded, connection closed);
* ``tamper_held``: rewrites the ``held`` list of the next hello.ok.

Everything received and sent is appended to ``log`` in order, as ``(direction, frame)``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

LIVE = ("LEASED", "RUNNING")


@dataclass
class FakeAttempt:
    frame: dict[str, Any]  # the task.assign frame as sent
    worker_id: str | None = None
    state: str = "LEASED"
    attempt_number: int | None = None
    cancel_requested: bool = False
    result: dict[str, Any] | None = None
    release_reason: str | None = None
    results_received: int = 0


@dataclass
class FakeServer:
    lease_seconds: float = 5
    renew_seconds: float = 0.1
    resume_nested: bool = True
    log: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    attempts: dict[str, FakeAttempt] = field(default_factory=dict)
    start_replies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    renew_replies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    resume_replies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    result_actions: list[str] = field(default_factory=list)
    tamper_held: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None
    hello_error: dict[str, Any] | None = None  # {"code":..., "message":..., "close": 4401}
    # Refusals for the next hellos, one each (then hellos succeed); same shape as hello_error,
    # without "close" the connection stays open as the server leaves it after UNAVAILABLE.
    hello_refusals: list[dict[str, Any]] = field(default_factory=list)
    connected_at: list[float] = field(default_factory=list)  # time.monotonic() of each connection
    auth_headers: list[str | None] = field(default_factory=list)
    connections: int = 0
    events: list[str] = field(default_factory=list)  # shared with handlers for ordering checks

    def __post_init__(self) -> None:
        self._queued: list[dict[str, Any]] = []
        self._live: ServerConnection | None = None
        self._live_worker: str | None = None
        self._draining: set[str] = set()

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> FakeServer:
        self._server = await serve(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ steering

    def assign(
        self,
        attempt_id: str,
        *,
        epoch: int = 1,
        handler: str = "echo",
        version: str = "v1",
        payload: Any = None,
        key: str | None = None,
        token: Any = None,
        business_key: str | None = None,
        extra: dict[str, Any] | None = None,
        started: bool = False,
    ) -> dict[str, Any]:
        """Queue a task.assign for the next hello (or send it now on a live connection).

        ``token`` goes into the frame as given (so tests can send ints, "017", …); None omits it.
        ``started``: the assignment arrives started (a result's start_next): RUNNING, attempt 1.
        """
        task: dict[str, Any] = {
            "id": f"task-{attempt_id}",
            "queue_id": "q1",
            "handler": handler,
            "handler_version": version,
            "payload_version": "p1",
            "payload": {"n": attempt_id} if payload is None else payload,
            "priority": 5,
        }
        if business_key is not None:
            task["business_key"] = business_key
        if key is not None:
            task["concurrency_key"] = key
        frame: dict[str, Any] = {
            "type": "task.assign",
            "id": attempt_id,
            "attempt_id": attempt_id,
            "epoch": epoch,
            "lease_expires_at": "2030-01-01T00:00:30.123456Z",
            "task": task,
        }
        if token is not None:
            frame["concurrency_token"] = token
        if started:
            frame.update(state="RUNNING", attempt_number=1)
        frame.update(extra or {})
        self.attempts.setdefault(
            attempt_id,
            FakeAttempt(frame=frame, state="RUNNING", attempt_number=1) if started else FakeAttempt(frame=frame),
        )
        self._queued.append(frame)
        if self._live is not None and self._live_worker is not None:
            asyncio.get_running_loop().create_task(self._flush())
        return frame

    async def close_connection(self, code: int = 1011) -> None:
        if self._live is not None:
            await self._live.close(code)

    async def close_with_error(self, close_code: int, code: str, message: str) -> None:
        """As the server closes a connection for cause: an error frame saying why, then the close."""
        if self._live is not None:
            ws = self._live
            await self._send(ws, {"type": "error", "code": code, "message": message})
            await ws.close(close_code)

    def received(self, kind: str, attempt_id: str | None = None) -> list[dict[str, Any]]:
        return [
            frame
            for direction, frame in self.log
            if direction == "recv"
            and frame.get("type") == kind
            and (attempt_id is None or frame.get("attempt_id") == attempt_id)
        ]

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 2.0) -> None:
        async def poll() -> None:
            while not predicate():
                await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), timeout)

    # ------------------------------------------------------------------ protocol

    def held_entry(self, attempt: FakeAttempt) -> dict[str, Any]:
        entry = {k: copy.deepcopy(v) for k, v in attempt.frame.items() if k not in ("type", "id")}
        entry["state"] = attempt.state
        if attempt.state == "RUNNING":
            entry["attempt_number"] = attempt.attempt_number
        return entry

    async def _send(self, ws: ServerConnection, frame: dict[str, Any]) -> None:
        self.log.append(("send", frame))
        await ws.send(json.dumps(frame))

    async def _flush(self) -> None:
        ws, worker = self._live, self._live_worker
        while ws is not None and self._queued:
            frame = self._queued.pop(0)
            self.attempts[frame["attempt_id"]].worker_id = worker
            try:
                await self._send(ws, frame)
            except ConnectionClosed:
                return

    async def _maybe_close_drained(self, ws: ServerConnection, worker: str | None) -> None:
        if worker in self._draining and not any(
            a.worker_id == worker and a.state in LIVE for a in self.attempts.values()
        ):
            await ws.close(1000)

    async def _serve(self, ws: ServerConnection) -> None:
        self.connections += 1
        self.connected_at.append(time.monotonic())
        self.auth_headers.append(ws.request.headers.get("Authorization"))
        worker: str | None = None
        try:
            async for message in ws:
                frame = json.loads(message)
                self.log.append(("recv", frame))
                kind, rid = frame.get("type"), frame.get("id")
                attempt = self.attempts.get(frame.get("attempt_id", ""))

                def ok(kind: str = kind, rid: Any = rid, **fields: Any) -> dict[str, Any]:
                    return {"type": f"{kind}.ok", "reply_to": rid, **fields}

                def error(code: str, rid: Any = rid, **fields: Any) -> dict[str, Any]:
                    return {"type": "error", "reply_to": rid, "code": code, "message": code.lower(), **fields}

                if kind == "hello":
                    if self.hello_refusals or self.hello_error is not None:
                        scripted = bool(self.hello_refusals)
                        spec = dict(self.hello_refusals.pop(0) if scripted else self.hello_error or {})
                        close = spec.pop("close", None)
                        await self._send(ws, error(spec["code"], message=spec.get("message", "no")))
                        if close:
                            await ws.close(close)
                        if close or not scripted:
                            return
                        continue
                    worker = frame["worker_id"]
                    held = [
                        self.held_entry(a) for a in self.attempts.values() if a.worker_id == worker and a.state in LIVE
                    ]
                    if self.tamper_held is not None:
                        held, self.tamper_held = self.tamper_held(held), None
                    await self._send(
                        ws,
                        ok(
                            session_id=f"s{self.connections}",
                            lease_seconds=self.lease_seconds,
                            renew_seconds=self.renew_seconds,
                            held=held,
                        ),
                    )
                    self._live, self._live_worker = ws, worker
                    await self._flush()
                elif kind == "task.assign.ack":
                    pass
                elif kind == "task.start":
                    self.events.append(f"start:{frame['attempt_id']}")
                    script = self.start_replies.get(frame["attempt_id"])
                    if script:
                        await self._send(ws, {**script.pop(0), "reply_to": rid})
                    elif attempt is not None and attempt.state == "LEASED":
                        attempt.state, attempt.attempt_number = "RUNNING", 1
                        self.events.append(f"start.ok:{frame['attempt_id']}")
                        await self._send(ws, ok(attempt_number=1, lease_expires_at="2030-01-01T00:01:00Z"))
                    elif attempt is not None and attempt.state == "RUNNING":
                        await self._send(
                            ws, ok(attempt_number=attempt.attempt_number, lease_expires_at="2030-01-01T00:01:00Z")
                        )
                    else:
                        await self._send(ws, error("LEASE_LOST"))
                elif kind == "task.renew":
                    script = self.renew_replies.get(frame["attempt_id"])
                    if script:
                        await self._send(ws, {**script.pop(0), "reply_to": rid})
                    elif attempt is not None and attempt.state in LIVE:
                        await self._send(
                            ws, ok(lease_expires_at="2030-01-01T00:02:00Z", cancel_requested=attempt.cancel_requested)
                        )
                    else:
                        await self._send(ws, error("LEASE_LOST"))
                elif kind == "task.resume":
                    script = self.resume_replies.get(frame["attempt_id"])
                    if script:
                        await self._send(ws, {**script.pop(0), "reply_to": rid})
                    elif attempt is not None and attempt.state in LIVE and attempt.worker_id == worker:
                        entry = self.held_entry(attempt)
                        await self._send(ws, ok(assignment=entry) if self.resume_nested else ok(**entry))
                    else:
                        await self._send(ws, error("LEASE_LOST"))
                elif kind == "task.result":
                    action = self.result_actions.pop(0) if self.result_actions else "ok"
                    if action == "close":
                        await ws.close(1011)
                        return
                    assert attempt is not None, frame
                    attempt.results_received += 1
                    duplicate = attempt.result is not None
                    if not duplicate:
                        attempt.result = frame
                        attempt.state = {"SUCCEEDED": "SUCCEEDED", "FAILED": "FAILED"}.get(frame["outcome"], "UNKNOWN")
                    if action == "drop":
                        continue
                    if action == "close_after":
                        await ws.close(1011)
                        return
                    await self._send(ws, ok(task_state=attempt.state, duplicate=duplicate, late=False))
                    await self._maybe_close_drained(ws, worker)
                elif kind == "task.release":
                    if attempt is not None and attempt.state == "LEASED":
                        attempt.state, attempt.release_reason = "RELEASED", frame["reason"]
                    elif attempt is not None and attempt.release_reason is None:
                        attempt.release_reason = frame["reason"]
                    await self._send(ws, ok(task_state="WAITING"))
                    await self._maybe_close_drained(ws, worker)
                elif kind == "drain":
                    self._draining.add(worker)
                    await self._send(ws, ok())
                    await self._maybe_close_drained(ws, worker)
                else:
                    await self._send(ws, error("INVALID_ARGUMENT"))
        except ConnectionClosed:
            pass
        finally:
            if self._live is ws:
                self._live, self._live_worker = None, None
