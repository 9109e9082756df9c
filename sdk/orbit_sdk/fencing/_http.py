"""HTTP: the fence headers a worker sends (:func:`headers_for`) and a service reads
(:func:`parse_headers`), and the WSGI / ASGI middlewares that run a request inside the guard,
record its response bound to the request's digest, and replay it."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import hashlib
import inspect
import io
import json
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from orbit_sdk.fencing._guard import (
    AsyncGuard,
    FenceRefused,
    Guard,
    LeaseExpired,
    OperationMismatch,
    StaleToken,
    TokenOutOfRange,
    _ExecutionLike,
    _from_execution,
    _slot_of,
)
from orbit_sdk.fencing._values import (
    MAX_KEY,
    MAX_NAMESPACE,
    MAX_OPERATION_ID,
    MAX_SLOT,
    _aware,
    _identifier,
    _slot,
    _token,
)

# --------------------------------------------------------------------------- HTTP


HEADER_NAMESPACE = "Orbit-Fence-Namespace"
HEADER_KEY = "Orbit-Fence-Key"
HEADER_TOKEN = "Orbit-Fence-Token"
HEADER_OPERATION = "Orbit-Fence-Operation"
HEADER_LEASE = "Orbit-Fence-Lease-Expires-At"
# Only for a key of capacity above 1 (the execution's concurrency_slot): fences (key, slot).
HEADER_SLOT = "Orbit-Fence-Slot"
HEADER_REPLAYED = "Orbit-Fence-Replayed"


def _format_time(value: datetime.datetime) -> str:
    return _aware(value).isoformat(timespec="microseconds").replace("+00:00", "Z")


def headers_for(execution: _ExecutionLike, operation_id: str, *, include_lease: bool = True) -> dict[str, str]:
    """The fence headers for a request a handler makes to a fenced service (add to httpx)::

        httpx.post(url, json=body, headers=fencing.headers_for(execution, "update-42-op-1"))

    Namespace, key and operation id are percent-encoded UTF-8 (HTTP header values are ASCII);
    the token is decimal; the lease end (when known) is RFC 3339 UTC; the slot (only on a key of
    capacity above 1) is decimal.
    """
    namespace, key, token = _from_execution(execution)
    slot = _slot_of(execution)
    _identifier(operation_id, "operation_id", MAX_OPERATION_ID)
    headers = {
        HEADER_NAMESPACE: urllib.parse.quote(namespace, safe=""),
        HEADER_KEY: urllib.parse.quote(key, safe=""),
        HEADER_TOKEN: str(token),
        HEADER_OPERATION: urllib.parse.quote(operation_id, safe=""),
    }
    if slot is not None:
        headers[HEADER_SLOT] = str(slot)
    if include_lease and execution.lease_expires_at is not None:
        headers[HEADER_LEASE] = _format_time(execution.lease_expires_at)
    return headers


@dataclasses.dataclass(frozen=True)
class FenceRequest:
    """The fence a request carries in its headers."""

    namespace: str
    key: str
    token: int
    operation_id: str
    lease_expires_at: datetime.datetime | None
    slot: int | None = None


def parse_headers(get: Callable[[str], str | None]) -> FenceRequest | None:
    """Read the fence headers through ``get(name)``; None when the request carries none of them.

    Raises ValueError for a partial or malformed set (the middlewares answer it 400).
    """
    values = {name: get(name) for name in (HEADER_NAMESPACE, HEADER_KEY, HEADER_TOKEN, HEADER_OPERATION)}
    lease_text = get(HEADER_LEASE)
    slot_text = get(HEADER_SLOT)
    if all(value is None for value in values.values()) and lease_text is None and slot_text is None:
        return None
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise ValueError(f"missing fence header(s): {', '.join(missing)}")

    def text(name: str, limit: int) -> str:
        raw = values[name]
        assert raw is not None
        try:
            decoded = urllib.parse.unquote(raw, errors="strict")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not percent-encoded UTF-8") from None
        return _identifier(decoded, name, limit)

    token_text = values[HEADER_TOKEN]
    assert token_text is not None
    if not token_text.isascii() or not token_text.isdigit() or token_text != str(int(token_text)):
        raise ValueError(f"{HEADER_TOKEN} must be a canonical decimal uint64")
    lease: datetime.datetime | None = None
    if lease_text is not None:
        try:
            lease = _aware(datetime.datetime.fromisoformat(lease_text))
        except ValueError:
            raise ValueError(f"{HEADER_LEASE} must be an RFC 3339 time with an offset") from None
    slot: int | None = None
    if slot_text is not None:
        if not slot_text.isascii() or not slot_text.isdigit() or slot_text != str(int(slot_text)):
            raise ValueError(f"{HEADER_SLOT} must be a canonical decimal integer from 0 to {MAX_SLOT}")
        try:
            slot = _slot(int(slot_text))
        except ValueError:
            raise ValueError(f"{HEADER_SLOT} must be a canonical decimal integer from 0 to {MAX_SLOT}") from None
    return FenceRequest(
        namespace=text(HEADER_NAMESPACE, MAX_NAMESPACE),
        key=text(HEADER_KEY, MAX_KEY),
        token=_token(int(token_text)),
        operation_id=text(HEADER_OPERATION, MAX_OPERATION_ID),
        lease_expires_at=lease,
        slot=slot,
    )


@dataclasses.dataclass(frozen=True)
class FenceContext:
    """What a fenced handler finds in ``environ["orbit.fence"]`` / ``scope["orbit.fence"]``: the
    connection to write with (inside the guard's transaction) and the request's fence."""

    connection: Any
    request: FenceRequest


class _NotRecorded(Exception):
    """The handler answered an error status: roll back, send its answer, record nothing."""

    def __init__(self, response: dict[str, Any]) -> None:
        super().__init__(response.get("status"))
        self.response = response


# The only response headers recorded and replayed (compared lower-case): what a client needs to
# read the body and follow a 201's or 3xx's Location. Everything else (Set-Cookie, caching,
# authentication challenges, CORS) belongs to the first caller's response alone: recording it
# would keep a session in the operation table and hand it to whoever replays.
REPLAYED_HEADERS = ("content-type", "location")


def _refusal(exc: FenceRefused | ValueError) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, StaleToken):
        # uint64 tokens as decimal strings, as everywhere in Orbit's API.
        error = {"code": "STALE_TOKEN", "message": str(exc), "token": str(exc.token), "highest": str(exc.highest)}
        if exc.slot is not None:
            error["slot"] = str(exc.slot)
        return 409, {"error": error}
    if isinstance(exc, LeaseExpired):
        error = {"code": "LEASE_EXPIRED", "message": str(exc), "lease_expires_at": _format_time(exc.lease_expires_at)}
        return 409, {"error": error}
    if isinstance(exc, OperationMismatch):
        error = {"code": "OPERATION_MISMATCH", "message": str(exc), "operation_id": exc.operation_id}
        return 409, {"error": error}
    if isinstance(exc, TokenOutOfRange):
        return 400, {"error": {"code": "INVALID_ARGUMENT", "message": f"{HEADER_TOKEN}: {exc}"}}
    return 400, {"error": {"code": "INVALID_ARGUMENT", "message": str(exc)}}


def _unauthenticated() -> tuple[int, dict[str, Any]]:
    message = "authentication required: the fence answers (and replays) only requests the service has authenticated"
    return 401, {"error": {"code": "UNAUTHENTICATED", "message": message}}


def _request_digest(method: str, path: str, query: bytes, body: bytes) -> str:
    """SHA-256 over method, path, query string and the body's SHA-256, each length-prefixed so
    no two different requests run together into the same bytes."""
    digest = hashlib.sha256(b"orbit-fence-request/1")
    # surrogatepass: any str a server hands over encodes, and the same str always the same way.
    for part in (method.encode("utf-8", "surrogatepass"), path.encode("utf-8", "surrogatepass"), query):
        digest.update(len(part).to_bytes(8, "big") + part)
    digest.update(hashlib.sha256(body).digest())
    return digest.hexdigest()


def _bound_to(request_digest: str, operation_id: str) -> Callable[[Any], None]:
    """The guard's ``on_replay`` for a middleware: a record answers only the request it recorded.
    A record without a digest (written before replays were bound) matches nothing."""

    def check(recorded: Any) -> None:
        if not isinstance(recorded, Mapping) or recorded.get("request") != request_digest:
            raise OperationMismatch(operation_id)

    return check


def _replayable(headers: Iterable[Iterable[str]]) -> list[list[str]]:
    return [[str(name), str(value)] for name, value in headers if str(name).lower() in REPLAYED_HEADERS]


def _recorded_response(
    status: int, reason: str, headers: list[tuple[str, str]], body: bytes, request_digest: str
) -> dict[str, Any]:
    return {
        "status": status,
        "reason": reason,
        "headers": _replayable(headers),
        "body": base64.b64encode(body).decode("ascii"),
        "request": request_digest,
    }


_REASONS = {400: "Bad Request", 401: "Unauthorized", 409: "Conflict"}


def _wsgi_body(environ: Mapping[str, Any]) -> bytes:
    """The request body, read whole: its digest binds the operation before the app runs."""
    stream = environ.get("wsgi.input")
    length_text = str(environ.get("CONTENT_LENGTH") or "").strip()
    if stream is None:
        return b""
    if not length_text:
        return bytes(stream.read()) if environ.get("wsgi.input_terminated") else b""
    if not length_text.isascii() or not length_text.isdigit():
        raise ValueError(f"Content-Length must be a non-negative decimal integer; got {length_text!r}")
    return bytes(stream.read(int(length_text)))


class WSGIMiddleware:
    """Runs a WSGI app inside the fence named by the request's headers.

    ``open_guard()`` returns a context manager giving a :class:`Guard` on a connection of its
    own for this request (a pool checkout, say). The handler finds a :class:`FenceContext` in
    ``environ["orbit.fence"]`` and writes with its ``connection``. Its response is buffered and
    sent after the commit; a 2xx/3xx one is recorded and replayed for the same operation id
    (with ``Orbit-Fence-Replayed: true``); a 4xx/5xx one rolls everything back and is sent as is.
    A stale token → 409 ``STALE_TOKEN``; a passed lease (header given, ``check_lease``) → 409
    ``LEASE_EXPIRED``; bad or partial headers → 400. Without fence headers: 400 when
    ``require`` (the default), else the app runs unfenced.

    A record answers only the request it recorded: the same method, path, query string and
    body (SHA-256); any other request with that operation id → 409 ``OPERATION_MISMATCH``. A
    replay carries the recorded status, body and :data:`REPLAYED_HEADERS` only (never
    ``Set-Cookie``).

    Order: authentication, then the fence. Either the middleware sits inside the app's
    authentication (it wraps only the authenticated view layer), or ``authenticate(environ)``
    says whether the request is authenticated: a fenced request it refuses is answered 401
    ``UNAUTHENTICATED`` before any header is judged, any record read or the app run.
    """

    def __init__(
        self,
        app: Callable[..., Iterable[bytes]],
        open_guard: Callable[[], contextlib.AbstractContextManager[Guard]],
        *,
        require: bool = True,
        check_lease: bool = True,
        authenticate: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self.app = app
        self.open_guard = open_guard
        self.require = require
        self.check_lease = check_lease
        self.authenticate = authenticate

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        invalid: ValueError | None = None
        fence: FenceRequest | None = None
        try:
            fence = parse_headers(lambda name: environ.get("HTTP_" + name.upper().replace("-", "_")))
            if fence is None and self.require:
                raise ValueError("this endpoint is fenced: send the Orbit-Fence-* headers")
        except ValueError as exc:
            invalid = exc
        if fence is None and invalid is None:
            return self.app(environ, start_response)
        if self.authenticate is not None and not self.authenticate(environ):
            return self._send(start_response, *_json(*_unauthenticated()))
        try:
            if invalid is not None:
                raise invalid
            body = _wsgi_body(environ)
        except ValueError as exc:
            return self._send(start_response, *_json(*_refusal(exc)))
        assert fence is not None
        environ["wsgi.input"] = io.BytesIO(body)  # the app reads the body the digest was taken of
        environ["CONTENT_LENGTH"] = str(len(body))
        path = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))
        query = str(environ.get("QUERY_STRING", "")).encode("utf-8", "surrogatepass")
        digest = _request_digest(str(environ.get("REQUEST_METHOD", "")), path, query, body)
        sent: dict[str, Any] = {}

        def handle(connection: Any) -> dict[str, Any]:
            environ["orbit.fence"] = FenceContext(connection, fence)
            captured: dict[str, Any] = {}

            def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
                captured["status"], captured["headers"] = status, headers
                return lambda data: captured.setdefault("written", []).append(data)

            body_iter = self.app(environ, capture)
            try:
                body = b"".join([*captured.get("written", []), *body_iter])
            finally:
                close = getattr(body_iter, "close", None)
                if close is not None:
                    close()
            code_text, _, reason = str(captured["status"]).partition(" ")
            headers = [(str(name), str(value)) for name, value in captured["headers"]]
            sent.update(status=int(code_text), reason=reason, headers=headers, body=body)
            if sent["status"] >= 400:
                raise _NotRecorded(sent)
            return _recorded_response(int(code_text), reason, headers, body, digest)

        try:
            with self.open_guard() as guard:
                lease = fence.lease_expires_at if self.check_lease else None
                applied = guard.apply(
                    fence.namespace,
                    fence.key,
                    fence.token,
                    fence.operation_id,
                    handle,
                    lease_expires_at=lease,
                    on_replay=_bound_to(digest, fence.operation_id),
                    slot=fence.slot,
                )
        except FenceRefused as exc:
            return self._send(start_response, *_json(*_refusal(exc)))
        except _NotRecorded:
            return self._send(start_response, sent["status"], sent["reason"], sent["headers"], sent["body"])
        if not applied.replayed:  # the caller who ran the app gets its whole response
            return self._send(start_response, sent["status"], sent["reason"], sent["headers"], sent["body"])
        return self._send(start_response, *_replay(applied.result))

    @staticmethod
    def _send(
        start_response: Callable[..., Any], status: int, reason: str, headers: list[tuple[str, str]], body: bytes
    ) -> list[bytes]:
        start_response(f"{status} {reason}", headers)
        return [body]


def _json(status: int, document: dict[str, Any]) -> tuple[int, str, list[tuple[str, str]], bytes]:
    body = json.dumps(document).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    return status, _REASONS.get(status, ""), headers, body


def _replay(response: Mapping[str, Any]) -> tuple[int, str, list[tuple[str, str]], bytes]:
    """A recorded response as replayed: status, body and the allow-listed headers (filtered
    again, for records written before the allow-list), its length and the replay mark."""
    body = base64.b64decode(response["body"])
    headers = [(name, value) for name, value in _replayable(response["headers"])]
    headers += [("Content-Length", str(len(body))), (HEADER_REPLAYED, "true")]
    return int(response["status"]), str(response["reason"]), headers, body


async def _asgi_body(receive: Callable[[], Awaitable[Any]]) -> bytes | None:
    """The request body, read whole (its digest binds the operation); None if the client left."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        if message["type"] == "http.request":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                return b"".join(chunks)


class ASGIMiddleware:
    """Runs an ASGI app's HTTP requests inside the fence named by their headers.

    As :class:`WSGIMiddleware`, with ``open_guard()`` an async context manager giving an
    :class:`AsyncGuard` (psycopg 3 ``AsyncConnection``) for this request, the
    :class:`FenceContext` in ``scope["orbit.fence"]``, and ``authenticate(scope)`` returning a
    bool or an awaitable of one. Other scope types (lifespan, websocket) pass through.
    """

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        open_guard: Callable[[], contextlib.AbstractAsyncContextManager[AsyncGuard]],
        *,
        require: bool = True,
        check_lease: bool = True,
        authenticate: Callable[[dict[str, Any]], bool | Awaitable[bool]] | None = None,
    ) -> None:
        self.app = app
        self.open_guard = open_guard
        self.require = require
        self.check_lease = check_lease
        self.authenticate = authenticate

    async def _authenticated(self, scope: dict[str, Any]) -> bool:
        if self.authenticate is None:
            return True
        verdict = self.authenticate(scope)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        return bool(verdict)

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        raw = {
            bytes(name).decode("latin-1").lower(): bytes(value).decode("latin-1")
            for name, value in scope.get("headers", [])
        }
        invalid: ValueError | None = None
        fence: FenceRequest | None = None
        try:
            fence = parse_headers(lambda name: raw.get(name.lower()))
            if fence is None and self.require:
                raise ValueError("this endpoint is fenced: send the Orbit-Fence-* headers")
        except ValueError as exc:
            invalid = exc
        if fence is None and invalid is None:
            await self.app(scope, receive, send)
            return
        if not await self._authenticated(scope):
            await _asgi_send(send, *_json(*_unauthenticated()))
            return
        if invalid is not None:
            await _asgi_send(send, *_json(*_refusal(invalid)))
            return
        assert fence is not None
        body = await _asgi_body(receive)
        if body is None:
            return  # the client is gone: nothing to answer, nothing run
        path = str(scope.get("root_path", "")) + str(scope.get("path", ""))
        digest = _request_digest(str(scope.get("method", "")), path, bytes(scope.get("query_string", b"")), body)
        delivered = False

        async def receive_buffered() -> Any:
            nonlocal delivered
            if not delivered:  # the app reads the body the digest was taken of
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        sent: dict[str, Any] = {}

        async def handle(connection: Any) -> dict[str, Any]:
            start: dict[str, Any] = {}
            chunks: list[bytes] = []

            async def capture(message: Any) -> None:
                if message["type"] == "http.response.start":
                    start.update(message)
                elif message["type"] == "http.response.body":
                    chunks.append(bytes(message.get("body", b"")))

            await self.app({**scope, "orbit.fence": FenceContext(connection, fence)}, receive_buffered, capture)
            headers = [(bytes(n).decode("latin-1"), bytes(v).decode("latin-1")) for n, v in start.get("headers", [])]
            sent.update(status=int(start["status"]), reason="", headers=headers, body=b"".join(chunks))
            if sent["status"] >= 400:
                raise _NotRecorded(sent)
            return _recorded_response(sent["status"], "", headers, sent["body"], digest)

        try:
            async with self.open_guard() as guard:
                lease = fence.lease_expires_at if self.check_lease else None
                applied = await guard.apply(
                    fence.namespace,
                    fence.key,
                    fence.token,
                    fence.operation_id,
                    handle,
                    lease_expires_at=lease,
                    on_replay=_bound_to(digest, fence.operation_id),
                    slot=fence.slot,
                )
        except FenceRefused as exc:
            await _asgi_send(send, *_json(*_refusal(exc)))
            return
        except _NotRecorded:
            await _asgi_send(send, sent["status"], "", sent["headers"], sent["body"])
            return
        if not applied.replayed:
            await _asgi_send(send, sent["status"], "", sent["headers"], sent["body"])
            return
        await _asgi_send(send, *_replay(applied.result))


async def _asgi_send(
    send: Callable[[Any], Awaitable[None]], status: int, reason: str, headers: list[tuple[str, str]], body: bytes
) -> None:
    encoded = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
    await send({"type": "http.response.start", "status": status, "headers": encoded})
    await send({"type": "http.response.body", "body": body})
