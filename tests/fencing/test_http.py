"""The guard for resources that are services: the WSGI and ASGI middlewares, driven by httpx
with the headers the SDK derives from an execution."""

from __future__ import annotations

import contextlib
import datetime
import json
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

import orbit_sdk
from orbit_sdk import fencing
from orbit_sdk._attempts import Execution
from orbit_sdk._protocol import parse_assignment
from tests.fencing.dbs import POSTGRES, server_database

NS = "00112233445566778899aabbccddeeff"


def execution(key: str = "object/42 é", token: int = 7, lease_in: float = 30.0) -> Any:
    expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=lease_in)
    return SimpleNamespace(namespace_id=NS, concurrency_key=key, concurrency_token=token, lease_expires_at=expires)


def test_the_execution_gives_the_fence_headers() -> None:
    worker = orbit_sdk.Worker("http://h", "t", ["q"], {"h": lambda e: None}, namespace_id=NS)
    task = {"id": "t1", "queue_id": "q", "handler": "h", "handler_version": "v1", "payload_version": "v1"}
    frame = {"attempt_id": "a1", "epoch": 1, "concurrency_token": "12", "task": {**task, "payload": {}, "priority": 5}}
    frame["task"]["concurrency_key"] = "object/é"
    expires = datetime.datetime(2030, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    run = Execution(worker, parse_assignment(frame, concurrency_keys=True), 1, expires)
    assert run.namespace_id == NS
    assert run.fence_headers("op/1") == {
        "Orbit-Fence-Namespace": NS,
        "Orbit-Fence-Key": "object%2F%C3%A9",
        "Orbit-Fence-Token": "12",
        "Orbit-Fence-Operation": "op%2F1",
        "Orbit-Fence-Lease-Expires-At": "2030-01-02T03:04:05.000000Z",
    }
    assert fencing.parse_headers(run.fence_headers("op/1").get) == fencing.FenceRequest(
        NS, "object/é", 12, "op/1", expires
    )
    anonymous = orbit_sdk.Worker("http://h", "t", ["q"], {"h": lambda e: None})
    with pytest.raises(ValueError, match="namespace_id"):
        Execution(anonymous, parse_assignment(frame, concurrency_keys=True), 1, expires).fence_headers("op")


def test_malformed_fence_headers_are_refused() -> None:
    good = fencing.headers_for(execution(), "op")
    for name, value in [("Orbit-Fence-Token", "07"), ("Orbit-Fence-Token", "-1"), ("Orbit-Fence-Key", "%FF")]:
        with pytest.raises(ValueError):
            fencing.parse_headers({**good, name: value}.get)
    partial = {k: v for k, v in good.items() if k != "Orbit-Fence-Operation"}
    with pytest.raises(ValueError, match="missing"):
        fencing.parse_headers(partial.get)
    assert fencing.parse_headers({}.get) is None


# --------------------------------------------------------------------------- WSGI on SQLite


@pytest.fixture
def wsgi(tmp_path: Path) -> Iterator[tuple[httpx.Client, list[str], str]]:
    path = str(tmp_path / "service.sqlite3")
    conn = sqlite3.connect(path)
    fencing.install(conn)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.commit()
    conn.close()
    calls: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        fence: fencing.FenceContext = environ["orbit.fence"]
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)).decode()
        calls.append(body)
        fence.connection.execute("INSERT INTO notes VALUES (?)", (body,))
        if body == "fail":
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
            return [b"failed"]
        start_response("201 Created", [("Content-Type", "application/json")])
        return [json.dumps({"stored": body, "token": fence.request.token}).encode()]

    @contextlib.contextmanager
    def open_guard() -> Iterator[fencing.Guard]:
        connection = sqlite3.connect(path, timeout=30)  # one connection per request
        try:
            yield fencing.Guard(connection)
        finally:
            connection.close()

    service = fencing.WSGIMiddleware(app, open_guard)
    with httpx.Client(transport=httpx.WSGITransport(app=service), base_url="http://service") as client:
        yield client, calls, path


def notes(path: str) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [row[0] for row in conn.execute("SELECT body FROM notes")]
    finally:
        conn.close()


def test_wsgi_runs_the_handler_inside_the_guard_and_replays_its_response(wsgi: Any) -> None:
    client, calls, path = wsgi
    run = execution()
    first = client.post("/notes", content="hello", headers=fencing.headers_for(run, "op-1"))
    assert first.status_code == 201 and first.json() == {"stored": "hello", "token": 7}
    assert "Orbit-Fence-Replayed" not in first.headers
    again = client.post("/notes", content="hello", headers=fencing.headers_for(run, "op-1"))
    assert again.status_code == 201 and again.json() == first.json()
    assert again.headers["Orbit-Fence-Replayed"] == "true"
    assert calls == ["hello"] and notes(path) == ["hello"]


def test_wsgi_answers_409_on_a_stale_token_and_lease_expired(wsgi: Any) -> None:
    client, calls, path = wsgi
    assert (
        client.post("/notes", content="new", headers=fencing.headers_for(execution(token=9), "op-9")).status_code == 201
    )
    stale = client.post("/notes", content="old", headers=fencing.headers_for(execution(token=8), "op-8"))
    assert stale.status_code == 409
    error = stale.json()["error"]
    assert error["code"] == "STALE_TOKEN" and error["token"] == "8" and error["highest"] == "9"
    late = client.post("/notes", content="late", headers=fencing.headers_for(execution(token=10, lease_in=-1), "op-10"))
    assert late.status_code == 409 and late.json()["error"]["code"] == "LEASE_EXPIRED"
    assert calls == ["new"] and notes(path) == ["new"]


def test_wsgi_rolls_back_an_error_response_and_refuses_missing_headers(wsgi: Any) -> None:
    client, calls, path = wsgi
    failed = client.post("/notes", content="fail", headers=fencing.headers_for(execution(token=3), "op-f"))
    assert failed.status_code == 500 and failed.text == "failed"
    assert notes(path) == []  # the handler's insert was rolled back, nothing recorded
    retried = client.post("/notes", content="fixed", headers=fencing.headers_for(execution(token=3), "op-f"))
    assert retried.status_code == 201  # the same operation id can be sent again
    bare = client.post("/notes", content="x")
    assert bare.status_code == 400 and bare.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert calls == ["fail", "fixed"]


# --------------------------------------------------------------------------- ASGI on PostgreSQL, async


@pytest.mark.asyncio
async def test_asgi_with_the_async_guard_on_postgresql(tmp_path: Path) -> None:
    import psycopg

    with server_database("postgresql", str(tmp_path)) as database:
        with psycopg.connect(dbname=database.name, **POSTGRES) as setup:
            fencing.install(setup)
            setup.execute("CREATE TABLE notes (body text)")
            setup.commit()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            fence: fencing.FenceContext = scope["orbit.fence"]
            message = await receive()
            async with fence.connection.cursor() as cursor:
                await cursor.execute("INSERT INTO notes VALUES (%s)", (message["body"].decode(),))
            body = json.dumps({"stored": message["body"].decode()}).encode()
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": body})

        @contextlib.asynccontextmanager
        async def open_guard() -> AsyncIterator[fencing.AsyncGuard]:
            connection = await psycopg.AsyncConnection.connect(dbname=database.name, **POSTGRES)
            try:
                yield fencing.AsyncGuard(connection)
            finally:
                await connection.close()

        service = fencing.ASGIMiddleware(app, open_guard)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=service), base_url="http://s") as client:
            ok = await client.post("/", content="a", headers=fencing.headers_for(execution(token=5), "op-a"))
            replay = await client.post("/", content="a", headers=fencing.headers_for(execution(token=5), "op-a"))
            stale = await client.post("/", content="b", headers=fencing.headers_for(execution(token=4), "op-b"))
        assert ok.status_code == 200 and ok.json() == {"stored": "a"}
        assert replay.json() == ok.json() and replay.headers["orbit-fence-replayed"] == "true"
        assert stale.status_code == 409 and stale.json()["error"]["highest"] == "5"
        with psycopg.connect(dbname=database.name, **POSTGRES) as check:
            assert check.execute("SELECT body FROM notes").fetchall() == [("a",)]
