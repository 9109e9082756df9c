"""The synchronous client's network transport: HTTP/1.1 keep-alive on the standard library.

:class:`Client` sends through ``httpx.Client`` as before; only the last step, bytes on a
socket, is the standard library's ``http.client`` instead of httpcore and h11. Why: with
sixteen threads sharing one client, httpcore's pool and h11's parser were about two fifths
of a submit's client CPU, and the threads share one interpreter lock, so that CPU is
latency too (docs/benchmarks/history.md). Requests go out with exactly the headers httpx
built; answers come back as ``httpx.Response``; failures are httpx's exceptions, so the
client's "outcome unknown" rule (:class:`TransportError`) is unchanged.

Not used when the environment names a proxy (``HTTP_PROXY``, ``HTTPS_PROXY``,
``ALL_PROXY``): httpx's own transport and proxy handling then serve every request.
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import threading
import urllib.request
from typing import Any

import httpx

# As many idle connections per origin as httpx keeps (max_keepalive_connections).
MAX_IDLE_PER_ORIGIN = 20

_Origin = tuple[str, str, int]


def environment_names_a_proxy() -> bool:
    """What makes httpx route requests through a proxy when it makes its own transport."""
    return any(scheme in ("http", "https", "all") for scheme in urllib.request.getproxies_environment())


def _dropped(sock: socket.socket) -> bool:
    """An idle keep-alive socket that is readable was closed by the server (or holds bytes
    no request asked for): either way it must not carry the next request."""
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable)
    except (OSError, ValueError):
        return True


class KeepAliveTransport(httpx.BaseTransport):
    """An ``httpx.BaseTransport`` over ``http.client`` connections, reused across requests
    and threads (a connection serves one request at a time, then waits idle for the next)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[_Origin, list[http.client.HTTPConnection]] = {}
        self._closed = False
        self._ssl_context: ssl.SSLContext | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        origin = (
            request.url.scheme,
            request.url.host,
            request.url.port or (443 if request.url.scheme == "https" else 80),
        )
        connection = self._checkout(origin, request, timeouts.get("connect"))
        try:
            response = self._exchange(connection, request, timeouts)
        except BaseException:
            connection.close()
            raise
        self._checkin(origin, connection)
        return response

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def _checkout(
        self, origin: _Origin, request: httpx.Request, connect_timeout: float | None
    ) -> http.client.HTTPConnection:
        while True:
            # The lock is held for the pop only: the poll in _dropped is a system call, and
            # a thread descheduled inside it would keep every other thread waiting here.
            with self._lock:
                if self._closed:
                    raise RuntimeError("the transport is closed")
                idle = self._idle.get(origin)
                connection = idle.pop() if idle else None
            if connection is None:
                return self._connect(origin, request, connect_timeout)
            if connection.sock is not None and not _dropped(connection.sock):
                return connection
            connection.close()

    def _connect(
        self, origin: _Origin, request: httpx.Request, connect_timeout: float | None
    ) -> http.client.HTTPConnection:
        scheme, host, port = origin
        connection: http.client.HTTPConnection
        if scheme == "https":
            if self._ssl_context is None:
                self._ssl_context = httpx.create_ssl_context()
            connection = http.client.HTTPSConnection(host, port, timeout=connect_timeout, context=self._ssl_context)
        elif scheme == "http":
            connection = http.client.HTTPConnection(host, port, timeout=connect_timeout)
        else:
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {scheme!r}", request=request)
        try:
            connection.connect()
        except TimeoutError as exc:
            connection.close()
            raise httpx.ConnectTimeout(str(exc) or "timed out", request=request) from exc
        except OSError as exc:  # refused, unreachable, a name that does not resolve, a TLS failure
            connection.close()
            raise httpx.ConnectError(str(exc), request=request) from exc
        return connection

    def _checkin(self, origin: _Origin, connection: http.client.HTTPConnection) -> None:
        if connection.sock is None:  # the answer said Connection: close (http.client closed it)
            return
        with self._lock:
            idle = self._idle.setdefault(origin, [])
            if not self._closed and len(idle) < MAX_IDLE_PER_ORIGIN:
                idle.append(connection)
                return
        connection.close()

    @staticmethod
    def _exchange(
        connection: http.client.HTTPConnection, request: httpx.Request, timeouts: dict[str, float | None]
    ) -> httpx.Response:
        assert connection.sock is not None
        target = request.url.raw_path.decode("ascii")
        body = request.read()
        try:
            connection.sock.settimeout(timeouts.get("write"))
            # httpx already wrote Host, Accept-Encoding and Content-Length: send its headers as they are.
            connection.putrequest(request.method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in request.headers.raw:
                connection.putheader(name, value)
            connection.endheaders(body or None)
        except TimeoutError as exc:
            raise httpx.WriteTimeout(str(exc) or "timed out", request=request) from exc
        except OSError as exc:
            raise httpx.WriteError(str(exc), request=request) from exc
        try:
            connection.sock.settimeout(timeouts.get("read"))
            answer = connection.getresponse()
            content = answer.read()
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "timed out", request=request) from exc
        except http.client.HTTPException as exc:  # a closed connection, a malformed status line or header
            raise httpx.RemoteProtocolError(f"{exc.__class__.__name__}: {exc}", request=request) from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc), request=request) from exc
        extensions: dict[str, Any] = {
            "http_version": b"HTTP/1.0" if answer.version == 10 else b"HTTP/1.1",
            "reason_phrase": answer.reason.encode("latin-1", "replace"),
        }
        return httpx.Response(
            answer.status, headers=answer.getheaders(), content=content, request=request, extensions=extensions
        )
