"""What an attacker found on the fence (issue 35): replays answered for any request and anyone,
with the first caller's Set-Cookie; an applied operation's own resend refused once a newer
holder wrote; a forged huge token. Sent the way an attacker sends them: crafted WSGI environs,
a bare ASGI driver, the guard called directly."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orbit_sdk import fencing
from tests.fencing.dbs import DB, POSTGRES, server_database

NS = "0123456789abcdef0123456789abcdef"
KEY = "object/42"
SESSION = "session=first-callers-secret; HttpOnly"
TOKEN = "Bearer good"


def fence_headers(token: int, operation_id: str, key: str = KEY) -> dict[str, str]:
    return {
        fencing.HEADER_NAMESPACE: NS,
        fencing.HEADER_KEY: key.replace("/", "%2F"),
        fencing.HEADER_TOKEN: str(token),
        fencing.HEADER_OPERATION: operation_id,
    }


# --------------------------------------------------------------------------- WSGI, crafted environs


def environ(method: str, path: str, body: bytes, headers: dict[str, str], query: str = "") -> dict[str, Any]:
    env: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "SCRIPT_NAME": "",
        "PATH_INFO": path,
        "QUERY_STRING": query,
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "SERVER_NAME": "service",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
    }
    for name, value in headers.items():
        env["HTTP_" + name.upper().replace("-", "_")] = value
    return env


class Response:
    def __init__(self, status: str, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status = int(status.split(" ", 1)[0])
        self.headers = headers
        self.body = body

    def header(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key.lower() == name.lower()]

    def json(self) -> Any:
        return json.loads(self.body)


def call(app: Callable[..., Any], env: dict[str, Any]) -> Response:
    started: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        started.update(status=status, headers=headers)

    body = b"".join(app(env, start_response))
    return Response(started["status"], started["headers"], body)


@pytest.fixture
def sqlite_path(tmp_path: Path) -> str:
    path = str(tmp_path / "service.sqlite3")
    conn = sqlite3.connect(path)
    fencing.install(conn)
    conn.execute("CREATE TABLE notes (method TEXT, path TEXT, body TEXT)")
    conn.commit()
    conn.close()
    return path


def rows(path: str, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.execute(sql))
    finally:
        conn.close()


def wsgi_service(path: str, calls: list[str], **options: Any) -> fencing.WSGIMiddleware:
    """A service whose handler stores the body and answers it with a session cookie."""

    def app(env: dict[str, Any], start_response: Any) -> list[bytes]:
        fence: fencing.FenceContext = env["orbit.fence"]
        body = env["wsgi.input"].read(int(env.get("CONTENT_LENGTH") or 0)).decode()
        calls.append(f"{env['REQUEST_METHOD']} {env['PATH_INFO']} {body}")
        fence.connection.execute("INSERT INTO notes VALUES (?, ?, ?)", (env["REQUEST_METHOD"], env["PATH_INFO"], body))
        start_response(
            "200 OK",
            [("Content-Type", "application/json"), ("Set-Cookie", SESSION), ("Cache-Control", "private")],
        )
        return [json.dumps({"stored": body, "secret": "for the first caller"}).encode()]

    @contextlib.contextmanager
    def open_guard() -> Iterator[fencing.Guard]:
        connection = sqlite3.connect(path, timeout=30)
        try:
            yield fencing.Guard(connection)
        finally:
            connection.close()

    return fencing.WSGIMiddleware(app, open_guard, **options)


def test_wsgi_a_replay_of_another_method_path_query_or_body_answers_409(sqlite_path: str) -> None:
    calls: list[str] = []
    service = wsgi_service(sqlite_path, calls)
    first = call(service, environ("POST", "/notes", b"hello", fence_headers(5, "op-1")))
    assert first.status == 200 and first.header("Set-Cookie") == [SESSION]  # the first caller's own answer

    # The attacker's request: same fence headers, another method, path and body, higher token.
    attack = call(service, environ("DELETE", "/admin/users/2", b"evil", fence_headers(6, "op-1")))
    assert attack.status == 409
    assert attack.json()["error"]["code"] == "OPERATION_MISMATCH" and attack.json()["error"]["operation_id"] == "op-1"
    assert b"first caller" not in attack.body and attack.header("Set-Cookie") == []
    # A second write with a different body is refused, not silently dropped.
    other = call(service, environ("POST", "/notes", b"changed", fence_headers(5, "op-1")))
    assert other.status == 409 and other.json()["error"]["code"] == "OPERATION_MISMATCH"
    query = call(service, environ("POST", "/notes", b"hello", fence_headers(5, "op-1"), query="force=1"))
    assert query.status == 409
    assert calls == ["POST /notes hello"] and rows(sqlite_path, "SELECT body FROM notes") == [("hello",)]
    # The mismatched request with token 6 kept nothing: the fence's highest token is still 5.
    assert rows(sqlite_path, "SELECT highest_token FROM orbit_fence") == [(f"{5:020d}",)]

    exact = call(service, environ("POST", "/notes", b"hello", fence_headers(5, "op-1")))
    assert exact.status == 200 and exact.json() == first.json() and exact.header("Orbit-Fence-Replayed") == ["true"]


def test_wsgi_a_replay_never_carries_the_recorded_set_cookie(sqlite_path: str) -> None:
    calls: list[str] = []
    service = wsgi_service(sqlite_path, calls)
    call(service, environ("POST", "/notes", b"hello", fence_headers(5, "op-1")))
    replay = call(service, environ("POST", "/notes", b"hello", fence_headers(5, "op-1")))
    assert replay.status == 200 and replay.header("Orbit-Fence-Replayed") == ["true"]
    assert replay.header("Set-Cookie") == [] and replay.header("Cache-Control") == []
    assert replay.header("Content-Type") == ["application/json"]
    assert replay.header("Content-Length") == [str(len(replay.body))]
    # Nor is the session kept in the operation table.
    (recorded,) = rows(sqlite_path, f"SELECT result FROM {fencing.OPERATION_TABLE}")
    assert "first-callers-secret" not in recorded[0]
    assert calls == ["POST /notes hello"]


def test_wsgi_an_unauthenticated_replay_never_sees_the_recorded_body(sqlite_path: str) -> None:
    calls: list[str] = []
    service = wsgi_service(sqlite_path, calls, authenticate=lambda env: env.get("HTTP_AUTHORIZATION") == TOKEN)
    signed_in = {**fence_headers(5, "op-1"), "Authorization": TOKEN}
    assert call(service, environ("POST", "/notes", b"hello", signed_in)).status == 200

    for headers in (fence_headers(5, "op-1"), {**fence_headers(5, "op-1"), "Authorization": "Bearer guessed"}):
        replay = call(service, environ("POST", "/notes", b"hello", headers))  # the exact request, no credential
        assert replay.status == 401 and replay.json()["error"]["code"] == "UNAUTHENTICATED"
        assert b"first caller" not in replay.body and b"hello" not in replay.body
        assert replay.header("Set-Cookie") == [] and replay.header("Orbit-Fence-Replayed") == []
    # Even a malformed fence is answered only after authentication.
    bad = call(service, environ("POST", "/notes", b"x", {**fence_headers(5, "op-2"), "Orbit-Fence-Token": "07"}))
    assert bad.status == 401
    authenticated = call(service, environ("POST", "/notes", b"hello", signed_in))
    assert authenticated.status == 200 and authenticated.header("Orbit-Fence-Replayed") == ["true"]
    assert calls == ["POST /notes hello"]


def test_wsgi_inside_the_apps_authentication_an_anonymous_replay_is_refused_by_the_app(sqlite_path: str) -> None:
    """The other documented order: the app's authentication wraps the fence middleware."""
    calls: list[str] = []
    fenced = wsgi_service(sqlite_path, calls)

    def authenticated_app(env: dict[str, Any], start_response: Any) -> Any:
        if env.get("HTTP_AUTHORIZATION") != TOKEN:
            start_response("401 Unauthorized", [("Content-Type", "text/plain")])
            return [b"sign in"]
        return fenced(env, start_response)

    signed_in = {**fence_headers(5, "op-1"), "Authorization": TOKEN}
    assert call(authenticated_app, environ("POST", "/notes", b"hello", signed_in)).status == 200
    anonymous = call(authenticated_app, environ("POST", "/notes", b"hello", fence_headers(5, "op-1")))
    assert anonymous.status == 401 and anonymous.body == b"sign in"


def test_wsgi_a_record_without_a_request_digest_answers_409(sqlite_path: str) -> None:
    """A record written before replays were bound (all headers, no digest) replays for nobody."""
    conn = sqlite3.connect(sqlite_path)
    old = {"status": 200, "reason": "OK", "headers": [["Set-Cookie", SESSION]], "body": "e30="}
    conn.execute("INSERT INTO orbit_fence VALUES (?, ?, ?, CURRENT_TIMESTAMP)", (NS, KEY, f"{5:020d}"))
    conn.execute(
        f"INSERT INTO {fencing.OPERATION_TABLE} VALUES (?, ?, ?, ?, ?, CURRENT_TIMESTAMP)",
        (NS, KEY, "op-old", f"{5:020d}", json.dumps(old)),
    )
    conn.commit()
    conn.close()
    replay = call(wsgi_service(sqlite_path, []), environ("POST", "/notes", b"{}", fence_headers(5, "op-old")))
    assert replay.status == 409 and replay.json()["error"]["code"] == "OPERATION_MISMATCH"
    assert replay.header("Set-Cookie") == []


def test_wsgi_a_malformed_content_length_is_a_400_naming_it(sqlite_path: str) -> None:
    env = environ("POST", "/notes", b"x", fence_headers(5, "op-1"))
    env["CONTENT_LENGTH"] = "1x"
    refused = call(wsgi_service(sqlite_path, []), env)
    assert refused.status == 400 and "Content-Length" in refused.json()["error"]["message"]


# --------------------------------------------------------------------------- ASGI, a bare driver


async def drive(app: Any, method: str, path: str, chunks: list[bytes], headers: dict[str, str]) -> Response:
    """One HTTP request through an ASGI app: the body in the given chunks, the answer collected."""
    messages = [
        {"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
        for index, chunk in enumerate(chunks)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # a live client stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path_only, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "path": path_only,
        "raw_path": path_only.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": [(name.lower().encode(), value.encode()) for name, value in headers.items()],
    }
    await asyncio.wait_for(app(scope, receive, send), 30)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return Response(str(start["status"]), [(n.decode(), v.decode()) for n, v in start["headers"]], body)


@pytest.mark.asyncio
async def test_asgi_replays_are_bound_to_the_request_authenticated_and_without_set_cookie(tmp_path: Path) -> None:
    import psycopg

    with server_database("postgresql", str(tmp_path)) as database:
        with psycopg.connect(dbname=database.name, **POSTGRES) as setup:
            fencing.install(setup)
            setup.execute("CREATE TABLE notes (body text)")
            setup.commit()
        calls: list[str] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            fence: fencing.FenceContext = scope["orbit.fence"]
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            calls.append(body.decode())
            async with fence.connection.cursor() as cursor:
                await cursor.execute("INSERT INTO notes VALUES (%s)", (body.decode(),))
            headers = [(b"content-type", b"application/json"), (b"set-cookie", SESSION.encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": json.dumps({"stored": body.decode()}).encode()})

        @contextlib.asynccontextmanager
        async def open_guard() -> AsyncIterator[fencing.AsyncGuard]:
            connection = await psycopg.AsyncConnection.connect(dbname=database.name, **POSTGRES)
            try:
                yield fencing.AsyncGuard(connection)
            finally:
                await connection.close()

        async def authenticate(scope: dict[str, Any]) -> bool:
            return (b"authorization", TOKEN.encode()) in scope["headers"]

        service = fencing.ASGIMiddleware(app, open_guard, authenticate=authenticate)
        signed_in = {**fence_headers(5, "op-a"), "Authorization": TOKEN}
        first = await drive(service, "POST", "/notes", [b"he", b"llo"], signed_in)
        assert first.status == 200 and first.json() == {"stored": "hello"} and first.header("set-cookie") == [SESSION]

        anonymous = await drive(service, "POST", "/notes", [b"hello"], fence_headers(5, "op-a"))
        assert anonymous.status == 401 and b"hello" not in anonymous.body
        for method, path, body in [
            ("DELETE", "/admin", b"hello"),
            ("POST", "/notes", b"evil"),
            ("POST", "/notes?x=1", b"hello"),
        ]:
            mismatch = await drive(service, method, path, [body], {**signed_in, fencing.HEADER_TOKEN: "6"})
            assert mismatch.status == 409 and mismatch.json()["error"]["code"] == "OPERATION_MISMATCH"
            assert mismatch.header("set-cookie") == []
        replay = await drive(service, "POST", "/notes", [b"hel", b"lo"], signed_in)
        assert replay.status == 200 and replay.json() == first.json()
        assert replay.header("orbit-fence-replayed") == ["true"] and replay.header("set-cookie") == []
        assert replay.header("content-type") == ["application/json"]
        assert calls == ["hello"]
        with psycopg.connect(dbname=database.name, **POSTGRES) as check:
            assert check.execute("SELECT body FROM notes").fetchall() == [("hello",)]
            assert check.execute("SELECT highest_token FROM orbit_fence").fetchall() == [(5,)]


# --------------------------------------------------------------------------- the guard


def test_an_applied_operation_resent_with_its_own_token_after_a_newer_holder_answers_its_record(
    fence_db: DB,
) -> None:
    guard = fencing.Guard(fence_db.connect())
    calls: list[str] = []

    def write(label: str) -> Callable[[Any], Any]:
        return lambda conn: calls.append(label) or {"by": label}

    first = guard.apply(NS, KEY, 7, "op-7", write("7"))
    guard.apply(NS, KEY, 9, "op-9", write("9"))  # a newer holder writes
    resent = guard.apply(NS, KEY, 7, "op-7", write("7 again"))  # the commit's answer was lost: resend
    assert resent.replayed and resent.result == first.result == {"by": "7"}
    assert resent.token == 7 and resent.highest == 9
    # A NEW operation with the stale token is still refused, and so is an older token's claim.
    with pytest.raises(fencing.StaleToken):
        guard.apply(NS, KEY, 7, "op-7b", write("7b"))
    with pytest.raises(fencing.StaleToken):
        guard.apply(NS, KEY, 6, "op-7", write("6"))
    assert calls == ["7", "9"] and guard.highest(NS, KEY) == 9


@pytest.mark.asyncio
async def test_the_async_guard_answers_its_own_resend_after_a_newer_holder(tmp_path: Path) -> None:
    import psycopg

    with server_database("postgresql", str(tmp_path)) as database:
        with psycopg.connect(dbname=database.name, **POSTGRES) as setup:
            fencing.install(setup)
        connection = await psycopg.AsyncConnection.connect(dbname=database.name, **POSTGRES)
        try:
            guard = fencing.AsyncGuard(connection)
            await guard.write(NS, KEY, 7, "op-7", lambda conn: {"by": 7})
            await guard.write(NS, KEY, 9, "op-9", lambda conn: {"by": 9})
            resent = await guard.apply(NS, KEY, 7, "op-7", lambda conn: {"by": "again"})
            assert resent.replayed and resent.result == {"by": 7}
            with pytest.raises(fencing.StaleToken):
                await guard.write(NS, KEY, 7, "op-new", lambda conn: {"by": "new"})
        finally:
            await connection.close()


def test_a_token_above_max_token_is_refused_before_it_can_brick_the_fence(fence_db: DB) -> None:
    bounded = fencing.Guard(fence_db.connect(), max_token=2**53)
    bounded.write(NS, KEY, 3, "op-3", lambda conn: None)
    with pytest.raises(fencing.TokenOutOfRange) as caught:
        bounded.write(NS, KEY, 2**64 - 1, "forged", lambda conn: None)
    assert isinstance(caught.value, ValueError) and caught.value.max_token == 2**53
    assert bounded.highest(NS, KEY) == 3
    bounded.write(NS, KEY, 4, "op-4", lambda conn: None)  # the real next holder still writes
    with pytest.raises(ValueError, match="token"):
        fencing.Guard(fence_db.connect(), max_token=0)


def test_unbounded_a_forged_token_bricks_the_key_until_the_operator_resets_the_row(fence_db: DB) -> None:
    """What docs/fencing.md says a forged token does, and its recovery SQL, as measured."""
    guard = fencing.Guard(fence_db.connect())
    guard.write(NS, KEY, 3, "op-3", lambda conn: None)
    guard.write(NS, KEY, 2**64 - 1, "forged", lambda conn: None)
    with pytest.raises(fencing.StaleToken):
        guard.write(NS, KEY, 4, "op-4", lambda conn: None)
    conn = fence_db.connect()
    cursor = conn.cursor()
    ph = fence_db.placeholder()
    value = f"{3:020d}" if fence_db.dialect == "sqlite" else 3  # the key's highest token in Orbit's keys API
    where = f"namespace = {ph} AND fence_key = {ph}"
    cursor.execute(f"UPDATE orbit_fence SET highest_token = {ph} WHERE {where}", (value, NS, KEY))
    # The forged operation's record goes too, or its resend would raise the fence again.
    cursor.execute(f"DELETE FROM orbit_fence_operation WHERE {where} AND token > {ph}", (NS, KEY, value))
    cursor.close()
    conn.commit()
    conn.close()
    guard.write(NS, KEY, 4, "op-4", lambda conn: None)
    assert guard.highest(NS, KEY) == 4 and guard.recorded(NS, KEY, "forged") is None


def test_the_wsgi_middleware_answers_a_forged_token_400_naming_the_header(sqlite_path: str) -> None:
    @contextlib.contextmanager
    def open_guard() -> Iterator[fencing.Guard]:
        connection = sqlite3.connect(sqlite_path, timeout=30)
        try:
            yield fencing.Guard(connection, max_token=2**53)
        finally:
            connection.close()

    calls: list[str] = []
    service = fencing.WSGIMiddleware(wsgi_service(sqlite_path, calls).app, open_guard)
    forged = call(service, environ("POST", "/notes", b"x", fence_headers(2**64 - 1, "op-f")))
    assert forged.status == 400 and forged.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert fencing.HEADER_TOKEN in forged.json()["error"]["message"] and calls == []
    assert rows(sqlite_path, "SELECT COUNT(*) FROM orbit_fence") == [(0,)]
