"""The synchronous client's network transport: HTTP/1.1 keep-alive on the standard library.

:class:`Client` sends through ``httpx.Client`` as before; only the last step, bytes on a
socket, is the standard library's (``http.client`` connects, with TLS where the URL says
https) instead of httpcore and h11. A request goes out in one write with exactly the
headers httpx built; its answer is read by this module's HTTP/1.x reader (status line,
headers, and a body by Content-Length, chunked, or up to the connection's end) and comes
back as ``httpx.Response``; failures are httpx's exceptions, so the client's "outcome
unknown" rule (:class:`TransportError`) is unchanged. Why: with sixteen threads sharing one
client, httpcore's pool and h11's parser were about two fifths of a submit's client CPU,
and ``http.client``'s request and answer handling (its header parsing goes through the
email package) a quarter of what was left; the threads share one interpreter lock, so
that CPU is latency too (docs/benchmarks/history.md).

Not used when the environment names a proxy (``HTTP_PROXY``, ``HTTPS_PROXY``,
``ALL_PROXY``): httpx's own transport and proxy handling then serve every request.
"""

from __future__ import annotations

import http.client
import re
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
    """An ``httpx.BaseTransport`` over ``http.client``'s sockets, reused across requests
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
        if connection.sock is None:  # the answer ended the connection (_exchange closed it)
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
        sock = connection.sock
        assert sock is not None
        message = _request_bytes(request)
        unsent: OSError | None = None
        try:
            sock.settimeout(timeouts.get("write"))
            sock.sendall(message)
        except TimeoutError as exc:
            raise httpx.WriteTimeout(str(exc) or "timed out", request=request) from exc
        except OSError as exc:
            # A server (a proxy refusing a body over its limit) may answer before it has read
            # the whole request, then close: that answer is the outcome, as httpcore reads it.
            unsent = exc
        try:
            answer = _answer_on(sock, request, timeouts.get("read"))
        except httpx.TransportError:
            if unsent is None:
                raise
            raise httpx.WriteError(str(unsent), request=request) from unsent
        if answer.close or unsent is not None:  # a request sent in part ends its connection
            connection.close()
        extensions: dict[str, Any] = {"http_version": answer.version, "reason_phrase": answer.reason}
        return httpx.Response(
            answer.status, headers=answer.headers, content=answer.content, request=request, extensions=extensions
        )


def _answer_on(sock: socket.socket, request: httpx.Request, read_timeout: float | None) -> _Answer:
    # A reader per answer, closed after it (as http.client's): the socket's own close
    # waits for every reader made on it to be closed.
    reader = sock.makefile("rb")
    try:
        sock.settimeout(read_timeout)
        return _read_answer(reader, request.method == "HEAD")
    except TimeoutError as exc:
        raise httpx.ReadTimeout(str(exc) or "timed out", request=request) from exc
    except _Malformed as exc:
        raise httpx.RemoteProtocolError(str(exc), request=request) from exc
    except OSError as exc:
        raise httpx.ReadError(str(exc), request=request) from exc
    finally:
        reader.close()


# A request's header name is a token, and no value holds a line break or NUL (httpx
# checks neither; its URLs hold no space or control character). An answer's header name is
# read as leniently as http.client reads it.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_ILLEGAL_VALUE = re.compile(rb"[\r\n\x00]")
_ANSWER_NAME = re.compile(rb"[^:\s][^:\r\n]*")
# The longest status or header line, and the most header lines, an answer may have
# (http.client's bounds).
_MAX_LINE = 65536
_MAX_HEADERS = 100
_END_OF_HEADERS = (b"\r\n", b"\n")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_FOLD = (b" ", b"\t")  # a header line that starts so continues the previous one
_READ_PIECE = 1 << 20  # the most of a body asked of the reader at once


def _request_bytes(request: httpx.Request) -> bytes:
    """The request as sent: httpx already wrote Host, Accept-Encoding and Content-Length,
    so its headers go as they are."""
    lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), request.url.raw_path)]
    for name, value in request.headers.raw:
        if not _TOKEN.fullmatch(name) or _ILLEGAL_VALUE.search(value):
            raise ValueError(f"invalid header {name[:80]!r}")
        lines.append(b"%s: %s\r\n" % (name, value))
    lines.append(b"\r\n")
    return b"".join(lines) + request.read()


class _Malformed(Exception):
    """The server's answer is not HTTP/1.x as it must be."""


class _Answer:
    __slots__ = ("close", "content", "headers", "reason", "status", "version")

    def __init__(self, version: bytes, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.version, self.status, self.reason, self.headers = version, status, reason, headers
        self.content = b""
        self.close = False  # the connection ends with this answer


def _line(reader: Any) -> bytes:
    line: bytes = reader.readline(_MAX_LINE + 1)
    if not line:
        raise _Malformed("the server closed the connection before its answer was complete")
    if len(line) > _MAX_LINE:
        raise _Malformed(f"an answer line longer than {_MAX_LINE} bytes")
    return line


def _read_answer(reader: Any, head: bool) -> _Answer:
    """One HTTP/1.x answer from `reader`: its status line, headers and body (by
    Content-Length, chunked, or up to the end of the connection); 1xx answers are skipped."""
    while True:
        parts = _line(reader).rstrip(b"\r\n").split(b" ", 2)
        if len(parts) < 2 or parts[0] not in (b"HTTP/1.0", b"HTTP/1.1") or not parts[1].isdigit() or len(parts[1]) != 3:
            raise _Malformed(f"not an HTTP/1.x status line: {b' '.join(parts)[:100]!r}")
        status = int(parts[1])
        headers: list[tuple[bytes, bytes]] = []
        lines = 0
        while (line := _line(reader)) not in _END_OF_HEADERS:
            lines += 1
            if lines > _MAX_HEADERS:
                raise _Malformed(f"more than {_MAX_HEADERS} header lines")
            if line[:1] in _FOLD and headers:
                # obs-fold: the previous field's value goes on; it reads as one space (RFC 9112 §5.2)
                name, value = headers[-1]
                headers[-1] = (name, b"%s %s" % (value, line.strip()) if value else line.strip())
                continue
            name, colon, value = line.partition(b":")
            if not colon or not _ANSWER_NAME.fullmatch(name):
                raise _Malformed(f"not a header line: {line[:100]!r}")
            headers.append((name, value.strip()))
        if not 100 <= status < 200:
            break
    answer = _Answer(parts[0], status, parts[2] if len(parts) > 2 else b"", headers)
    fields: dict[bytes, bytes] = {}
    for name, value in headers:
        key = name.lower()
        fields[key] = fields[key] + b"," + value if key in fields else value
    tokens = {token.strip().lower() for token in fields.get(b"connection", b"").split(b",")}
    answer.close = b"close" in tokens or (answer.version == b"HTTP/1.0" and b"keep-alive" not in tokens)
    if head or status in (204, 304):
        return answer
    if b"transfer-encoding" in fields:
        if fields[b"transfer-encoding"].lower() != b"chunked":
            raise _Malformed(f"an unsupported transfer-encoding: {fields[b'transfer-encoding'][:40]!r}")
        answer.content = _read_chunked(reader)
    elif b"content-length" in fields:
        # Repeated (by a proxy) with one value, it is that value (RFC 9110 §8.6), as h11 reads it.
        lengths = {length.strip() for length in fields[b"content-length"].split(b",")}
        length = lengths.pop()
        if lengths or not length.isdigit():
            raise _Malformed(f"not a content-length: {fields[b'content-length'][:40]!r}")
        answer.content = _read_exactly(reader, int(length))
    else:
        answer.content = reader.read()  # up to the end of the connection
        answer.close = True
    return answer


def _read_exactly(reader: Any, size: int) -> bytes:
    # In pieces: BufferedReader.read(n) allocates n bytes before it reads, and a size no
    # server sends (over the memory, or over an index) would fail there with a MemoryError
    # or an OverflowError, not as the connection ending short of it.
    pieces: list[bytes] = []
    left = size
    while left:
        piece: bytes = reader.read(min(left, _READ_PIECE))
        if not piece:
            raise _Malformed(f"the connection closed {left} bytes short of the answer's body")
        pieces.append(piece)
        left -= len(piece)
    return b"".join(pieces)


def _read_chunked(reader: Any) -> bytes:
    chunks: list[bytes] = []
    while True:
        size_field = _line(reader).split(b";", 1)[0].strip()
        if not _CHUNK_SIZE.fullmatch(size_field):  # int() would take a sign, 0x or underscores
            raise _Malformed(f"not a chunk size: {size_field[:40]!r}")
        size = int(size_field, 16)
        if size == 0:
            while _line(reader) not in _END_OF_HEADERS:  # trailers: nothing Orbit sends
                pass
            return b"".join(chunks)
        chunks.append(_read_exactly(reader, size))
        if _line(reader) not in _END_OF_HEADERS:
            raise _Malformed("a chunk longer than its size")
