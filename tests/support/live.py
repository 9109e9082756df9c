"""A real Orbit server (daphne, in a subprocess) on the test database, and a
small synchronous worker-protocol client for threads."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

ROOT = Path(__file__).resolve().parents[2]
# The platform operator's /metrics token of every live server the tests start.
LIVE_METRICS_TOKEN = "live-metrics-token-for-tests"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mysql_dsn(settings: dict[str, Any]) -> str:
    return f"mysql://{settings['USER']}:{settings['PASSWORD']}@{settings['HOST']}:{settings['PORT']}/{settings['NAME']}"


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A live server's environment: the test databases (with ORBIT_CELLS,
    the directory and each cell's), the maintenance loop on."""
    from django.db import connections

    from orbit import cells

    with cells.in_cell(None):  # the default alias as itself, not a test's cell
        connection = connections["default"]
    env = dict(os.environ)
    if connection.vendor == "mysql":
        env["ORBIT_MYSQL_DSN"] = mysql_dsn(connection.settings_dict)
    else:
        env.pop("ORBIT_MYSQL_DSN", None)
        env["ORBIT_SQLITE_PATH"] = connection.settings_dict["NAME"]
    if cells.configured():
        tested = {name: mysql_dsn(connections[cells.alias_of(name)].settings_dict) for name in cells.names()}
        env["ORBIT_CELLS"] = json.dumps(tested)
    env["ORBIT_MAINTENANCE"] = "1"
    env["ORBIT_INLINE_DB"] = "0"
    env.setdefault("ORBIT_METRICS_TOKEN", LIVE_METRICS_TOKEN)
    env.update(extra or {})
    return env


class LiveServer:
    """`python -m orbit.serve` on a port of its own, which stays the same across `start()`s."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(ROOT / ".local" / f"live-server-{self.port}.log", "w")  # noqa: SIM115
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "orbit.serve", "-b", "127.0.0.1", "-p", str(self.port), "orbit.asgi:application"],
            cwd=ROOT,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited; see {self.log.name}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("server did not start")

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            (self.process.kill if kill else self.process.terminate)()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@pytest.fixture(scope="session")
def orbit_server(django_db_setup: None, django_db_blocker: Any) -> Iterator[LiveServer]:
    (ROOT / ".local").mkdir(exist_ok=True)
    with django_db_blocker.unblock():
        env = server_env()
    server = LiveServer(env)
    yield server
    server.stop()


class WorkerConnection:
    """One worker-protocol connection, driven synchronously from a thread."""

    def __init__(self, url: str, token: str) -> None:
        ws_url = url.replace("http://", "ws://") + "/v1/workers/connect"
        self.ws: ClientConnection = connect(
            ws_url, additional_headers={"Authorization": f"Bearer {token}"}, legacy=True
        )
        self.ids = itertools.count(1)
        self.pending: list[dict[str, Any]] = []

    def send(self, type: str, **fields: Any) -> str:
        request_id = f"r{next(self.ids)}"
        self.ws.send(json.dumps({"id": request_id, "type": type, **fields}))
        return request_id

    def request(self, type: str, timeout: float = 10, **fields: Any) -> dict[str, Any]:
        request_id = self.send(type, **fields)
        deadline = time.monotonic() + timeout
        while True:
            frame = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if frame.get("reply_to") == request_id:
                return frame
            self.pending.append(frame)

    def hello(self, queues: list[str], capacity: int, worker_id: str, concurrency_keys: bool = True) -> dict[str, Any]:
        reply = self.request(
            "hello",
            worker_id=worker_id,
            queues=queues,
            capacity=capacity,
            handlers=[],
            concurrency_keys=concurrency_keys,
            version="tests",
        )
        assert reply["type"] == "hello.ok", reply
        return reply

    def next_assignment(self, timeout: float) -> dict[str, Any] | None:
        for index, frame in enumerate(self.pending):
            if frame.get("type") == "task.assign":
                return self.pending.pop(index)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                frame = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            except TimeoutError:
                return None
            if frame.get("type") == "task.assign":
                return frame
            self.pending.append(frame)
        return None

    def close(self) -> None:
        self.ws.close()
