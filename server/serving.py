"""Tuning of the serving stack (daphne on Twisted) that Orbit's own code cannot reach.

Forms: Twisted decodes the body of a POST sent as an HTML form (urlencoded or
multipart) into `request.args`, after parsing every POST's Content-Type
through the standard library's email package to find out (~13% of the event
loop's time under a stream of single submits), and answers a bare 400 of its
own, without the API's envelope, to a multipart body it cannot parse. Daphne
never reads `request.args` (it hands the raw body to the ASGI application),
so daphne's requests are made without that decoding: the application sees
every body as sent and answers it (a form is refused there: the API takes
JSON only).

Access log: Twisted's HTTPFactory formats a combined-log line for every
request and hands it to Twisted's log, which daphne sends nowhere (at its
default verbosity; above it, beside daphne's own line). Daphne writes the
access log itself (its --access-log, stdout by default): Twisted's line is
not formatted at all.

Secure transport: daphne asks whether each request came over TLS, which
Twisted answers by adapting the connection's transport to ISSLTransport
each time; a connection's transport is fixed once it is made, so the answer
is kept on the connection.

Oversized input: Twisted closes a connection whose request line or header
line is over 16 KiB without a word, answers a bare 400 to headers over 16 KiB
in all, and autobahn drops (close code 1006) a WebSocket whose frame is over
daphne's 1 MiB. Here the first two answer 431 with the API's error envelope,
and the third gets an error frame naming the limit, then close code 1009.
A body over DATA_UPLOAD_MAX_MEMORY_SIZE, which Django refuses anyway, was read
whole first (daphne hands the application all of it at once, in memory, on the
loop every client shares: 400 MB stalled the others for seconds); now a
Content-Length over it answers 413 with the envelope at the end of the headers
(before `100 Continue`), and a chunked body as soon as it passes it.

Slow headers: Twisted's idle timeout starts again at every byte received, so
a connection sending a header line a minute was kept for good. A request's
line and headers must now be complete within `HEADER_DEADLINE_SECONDS` of the
connection's start (the first request) or of the first byte of the request
(a later one on a kept-alive connection, which may idle between requests as
before); else the connection gets a bare 408 and is closed. The body is not
timed (it is read at the sender's pace), nor a WebSocket after its upgrade,
nor the response.

Closing: a connection the server closes (no hello in time, superseded,
assignments not read, a frame too big) gets an error frame saying why, then
the close. Autobahn waits one second for the client's answer to the close
and then resets the connection; a client that reads both frames and is
slower than that to write its answer (a loaded machine) finds the connection
reset, and a client that drops what it read when that write fails (the
synchronous client of the websockets library does) never sees the error. The
server waits `CLOSE_HANDSHAKE_SECONDS` instead.

WebSocket frames: autobahn formats the arguments of its debug lines (a
coloured type name and peer, through click) for every chunk it reads or
writes, and makes a masker through CFFI for every frame a worker sends (a
module import, two allocations and a finaliser: ~9 µs, against ~3 µs for the
XOR itself). The arguments are now formatted only if a line is written, and
a frame up to `SMALL_FRAME_BYTES` is unmasked with one integer XOR; a larger
one keeps autobahn's SIMD masker.

Unread answers: Twisted keeps whatever a WebSocket peer has not read yet in
the connection's send buffer, without bound, and ASGI shows the application
nothing of it; a worker that keeps sending and never reads grew the server by
its answers (1.2 GB in an audit). A worker connection with more than
`UNREAD_BYTES_LIMIT` unread is now dropped: its consumer's disconnect hands
back what it never acknowledged, as for any closed connection."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, TypeVar

from django.conf import settings

from orbit.errors import HeadersTooLarge, PayloadTooLarge
from orbit.fields import new_id
from server import reason_phrases

A = TypeVar("A")

logger = logging.getLogger("orbit.serving")

# The request line and headers of one HTTP request, in all (Twisted's own
# bound, stated); and the most header lines.
MAX_HEADER_BYTES = 16 * 1024
MAX_HEADER_LINES = 500
# The time from a connection's start (or a later request's first byte) to the
# end of that request's headers: more than any client on a slow link needs for
# a few KiB, short enough that a slow sender holds a connection only briefly.
HEADER_DEADLINE_SECONDS = 10.0
# How long a connection the server closes is kept for the client's answer to
# the close before it is reset: a loaded client's, as HEADER_DEADLINE_SECONDS.
CLOSE_HANDSHAKE_SECONDS = 10.0
# Up to this payload, a frame is unmasked with one integer XOR (linear, and
# cheaper than making autobahn's masker); above it, SIMD pays for its set-up.
SMALL_FRAME_BYTES = 4096
# The most of a worker connection's frames the server holds unread before it
# drops the connection: twice what a worker that reads can leave there (16
# unacknowledged assignments of at most a 256 KiB payload each, and small
# answers to its requests).
UNREAD_BYTES_LIMIT = 8 * 1024 * 1024
HEADER_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def without_form_decoding(init: Callable[..., None]) -> Callable[..., None]:
    """A Request's __init__ (`init`) that turns Twisted's form decoding off."""

    def made(request: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parsePOSTFormSubmission", False)
        init(request, *args, **kwargs)

    made.__wrapped__ = init  # type: ignore[attr-defined]
    return made


def once_per_connection(ask: Callable[[Any], A], kept: str) -> Callable[[Any], A]:
    """An HTTPChannel method (`ask`) whose answer is fixed for a connection,
    asked once per connection and kept on the channel as `kept`."""

    def answer(channel: Any) -> A:
        known = channel.__dict__.get(kept)
        if known is None:
            known = channel.__dict__[kept] = ask(channel)
        return known

    answer.__wrapped__ = ask  # type: ignore[attr-defined]
    return answer


def secure_once(is_secure: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """HTTPChannel.isSecure (`is_secure`), asked once per connection."""
    return once_per_connection(is_secure, "_orbit_secure")


def host_once(get_host: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """HTTPChannel.getHost (`get_host`), asked once per connection: a
    connection's local address does not change, and every request asks
    (a getsockname call each)."""
    return once_per_connection(get_host, "_orbit_host")


class SmallFrameMasker:
    """autobahn's masker interface (`process`, in one or more chunks;
    `pointer`; `reset`) for a small frame: XOR with the 4-byte key repeated,
    as one integer."""

    __slots__ = ("key", "done")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.done = 0

    def pointer(self) -> int:
        return self.done

    def reset(self) -> None:
        self.done = 0

    def process(self, data: bytes) -> bytes:
        size = len(data)
        turn = self.done & 3
        key = (self.key[turn:] + self.key[:turn]) * (size // 4 + 1)
        self.done += size
        return (int.from_bytes(data, "little") ^ int.from_bytes(key[:size], "little")).to_bytes(size, "little")


def cheap_small_frames(make: Callable[..., Any]) -> Callable[..., Any]:
    """autobahn's create_xor_masker (`make`), with a SmallFrameMasker for a
    frame up to SMALL_FRAME_BYTES."""

    def masker(key: bytes, length: int | None = None) -> Any:
        if length is not None and length <= SMALL_FRAME_BYTES:
            return SmallFrameMasker(key)
        return make(key, length)

    masker.__wrapped__ = make  # type: ignore[attr-defined]
    return masker


class FormattedIfWritten:
    """A log line's argument, formatted by `fmt` only when the line is."""

    __slots__ = ("fmt", "value", "options")

    def __init__(self, fmt: Callable[..., str], value: Any, options: dict[str, Any]) -> None:
        self.fmt = fmt
        self.value = value
        self.options = options

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __str__(self) -> str:
        return self.fmt(self.value, **self.options)


def formatted_if_written(fmt: Callable[..., str]) -> Callable[..., FormattedIfWritten]:
    """autobahn.util's hltype or hlval (`fmt`), deferred: autobahn's WebSocket
    modules pass their result only as an argument of a log line, mostly debug
    lines, which are not written at Orbit's levels."""

    def deferred(value: Any, **options: Any) -> FormattedIfWritten:
        return FormattedIfWritten(fmt, value, options)

    deferred.__wrapped__ = fmt  # type: ignore[attr-defined]
    return deferred


def tune_autobahn() -> None:
    from autobahn.twisted import websocket as twisted_websocket
    from autobahn.websocket import protocol

    if not hasattr(protocol.create_xor_masker, "__wrapped__"):
        protocol.create_xor_masker = cheap_small_frames(protocol.create_xor_masker)
    for module in (protocol, twisted_websocket):
        for name in ("hltype", "hlval"):
            if not hasattr(getattr(module, name), "__wrapped__"):
                setattr(module, name, formatted_if_written(getattr(module, name)))


def patient_close(reset: Callable[[Any], None]) -> Callable[[Any], None]:
    """WebSocketServerFactory.resetProtocolOptions (`reset`), with the wait
    for a client's answer to a close the server sent CLOSE_HANDSHAKE_SECONDS."""

    def reset_patiently(factory: Any) -> None:
        reset(factory)
        factory.closeHandshakeTimeout = CLOSE_HANDSHAKE_SECONDS

    reset_patiently.__wrapped__ = reset  # type: ignore[attr-defined]
    return reset_patiently


def _refusal(status: HTTPStatus, code: str, message: str) -> bytes:
    """A whole answer with the API's error envelope, written before any request
    object exists; the connection closes after it."""
    request_id = new_id()
    body = json.dumps(
        {"request_id": request_id, "error": {"code": code, "message": message}}, separators=(",", ":")
    ).encode()
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"X-Request-Id: {request_id}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def headers_too_large_response() -> bytes:
    return _refusal(
        HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
        HeadersTooLarge.code,
        f"request headers: larger than the limit of {MAX_HEADER_BYTES} bytes or {MAX_HEADER_LINES} lines",
    )


def body_too_large_response(limit: int) -> bytes:
    return _refusal(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE, PayloadTooLarge.code, f"request body: larger than {limit} bytes"
    )


def _body_limit() -> int | None:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return None if limit is None else int(limit)


def _discard(*args: Any) -> None:
    return None


def _answer_and_close(channel: Any, answer: bytes) -> None:
    """Writes `answer` (a whole HTTP answer) and closes: nothing more of the
    request is parsed or run."""
    # Instance attributes shadow the class's: whatever Twisted's parser does with the
    # rest of this read (a header, the body, a chunk's end) lands nowhere and runs nothing.
    channel.dataReceived = channel.lineReceived = channel.rawDataReceived = _discard
    channel.allContentReceived = _discard
    if channel.transport is None:
        return
    channel.transport.write(answer)
    channel.loseConnection()
    if channel.abortTimeout is not None and channel._abortingCall is None:
        # A peer that does not read keeps even a closing connection: abort it then,
        # as Twisted's own idle timeout does (connectionLost cancels the call).
        channel._abortingCall = channel.callLater(channel.abortTimeout, channel.forceAbortClient)


def _refuse_body(channel: Any, limit: int) -> None:
    """Answers 413 and closes: the rest of the body is neither read into the
    request nor handed to the application, and the request is never run."""
    if channel.__dict__.get("_orbit_body_refused"):
        return
    channel._orbit_body_refused = True
    _disarm_head_deadline(channel)  # the head is complete: no 408 for it
    _answer_and_close(channel, body_too_large_response(limit))


def bounded_declared_body(all_headers_received: Callable[[Any], None]) -> Callable[[Any], None]:
    """HTTPChannel.allHeadersReceived (`all_headers_received`) refusing a
    Content-Length over DATA_UPLOAD_MAX_MEMORY_SIZE with 413 before any of the
    body is read (and before `100 Continue`): Django would refuse it only after
    daphne had buffered all of it, in memory, on the loop every client shares."""

    def received(channel: Any) -> None:
        limit = _body_limit()
        length = channel.length
        if limit is not None and length is not None and length > limit:
            _refuse_body(channel, limit)
            return
        all_headers_received(channel)

    received.__wrapped__ = all_headers_received  # type: ignore[attr-defined]
    return received


def bounded_body_chunks(handle_content_chunk: Callable[[Any, bytes], None]) -> Callable[[Any, bytes], None]:
    """Request.handleContentChunk (`handle_content_chunk`) refusing a body
    (chunked: no length to check up front) once it passes the limit."""

    def handled(request: Any, data: bytes) -> None:
        limit = _body_limit()
        if limit is not None:
            seen = request.__dict__.get("_orbit_body_bytes", 0) + len(data)
            request._orbit_body_bytes = seen
            if seen > limit:
                channel = request.channel
                if channel is not None:
                    _refuse_body(channel, limit)
                return
        handle_content_chunk(request, data)

    handled.__wrapped__ = handle_content_chunk  # type: ignore[attr-defined]
    return handled


def _refuse_headers(channel: Any) -> None:
    """Answers 431 and closes: the rest of the request is not read."""
    _disarm_head_deadline(channel)  # answered: no 408 after it
    _answer_and_close(channel, headers_too_large_response())


def bounded_headers(line_received: Callable[[Any, bytes], None]) -> Callable[[Any, bytes], None]:
    """HTTPChannel.lineReceived (`line_received`) refusing a header section over the limits with 431."""

    def received(channel: Any, line: bytes) -> None:
        # Twisted parses a header line when the next line arrives: count the pending one.
        pending = 1 if getattr(channel, "_HTTPChannel__header", b"") else 0
        if (
            channel._receivedHeaderSize + len(line) > channel.totalHeadersSize
            or channel._receivedHeaderCount + pending > channel.maxHeaders
        ):
            _refuse_headers(channel)
            return
        line_received(channel, line)

    received.__wrapped__ = line_received  # type: ignore[attr-defined]
    return received


# The header deadline's state on a channel: when the awaited request head began
# (None: no head is awaited, or its first byte has not come), and its timer.
_HEAD_STARTED = "_orbit_head_started"
_HEAD_TIMER = "_orbit_head_timer"


def _awaiting_head(channel: Any) -> bool:
    """Reading a request line or headers: not a body, not a request being answered."""
    return bool(channel.line_mode) and not channel._handlingRequest


def _arm_head_deadline(channel: Any) -> None:
    started = channel.__dict__.get(_HEAD_STARTED)
    if started is None or channel.__dict__.get(_HEAD_TIMER) is not None:
        return
    remaining = max(0.0, started + HEADER_DEADLINE_SECONDS - time.monotonic())
    # TimeoutMixin's callLater (the reactor's, set by the factory) passes no arguments on.
    setattr(channel, _HEAD_TIMER, channel.callLater(remaining, lambda: _head_deadline_passed(channel)))


def _disarm_head_deadline(channel: Any) -> None:
    setattr(channel, _HEAD_STARTED, None)
    timer = channel.__dict__.get(_HEAD_TIMER)
    setattr(channel, _HEAD_TIMER, None)
    if timer is not None and timer.active():
        timer.cancel()


def _head_deadline_passed(channel: Any) -> None:
    setattr(channel, _HEAD_TIMER, None)
    if channel.__dict__.get(_HEAD_STARTED) is None or channel.transport is None:
        return
    setattr(channel, _HEAD_STARTED, None)
    _answer_and_close(channel, HEADER_TIMEOUT_RESPONSE)


def head_deadline_on_connect(connection_made: Callable[[Any], None]) -> Callable[[Any], None]:
    """HTTPChannel.connectionMade (`connection_made`) starting the first request's header deadline."""

    def made(channel: Any) -> None:
        connection_made(channel)
        setattr(channel, _HEAD_STARTED, time.monotonic())
        _arm_head_deadline(channel)

    made.__wrapped__ = connection_made  # type: ignore[attr-defined]
    return made


def head_deadline_on_data(data_received: Callable[[Any, bytes], None]) -> Callable[[Any, bytes], None]:
    """HTTPChannel.dataReceived (`data_received`) starting a later request's header
    deadline at its first byte. A head that arrives whole costs no timer."""

    def received(channel: Any, data: bytes) -> None:
        if data and channel.__dict__.get(_HEAD_STARTED) is None and _awaiting_head(channel):
            setattr(channel, _HEAD_STARTED, time.monotonic())
        data_received(channel, data)
        if channel.__dict__.get(_HEAD_STARTED) is not None:
            _arm_head_deadline(channel)

    received.__wrapped__ = data_received  # type: ignore[attr-defined]
    return received


def head_deadline_met(all_headers_received: Callable[[Any], None]) -> Callable[[Any], None]:
    """HTTPChannel.allHeadersReceived (`all_headers_received`) ending the header deadline."""

    def received(channel: Any) -> None:
        _disarm_head_deadline(channel)
        all_headers_received(channel)

    received.__wrapped__ = all_headers_received  # type: ignore[attr-defined]
    return received


def head_deadline_on_close(connection_lost: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """HTTPChannel.connectionLost (`connection_lost`) cancelling a pending header deadline."""

    def lost(channel: Any, reason: Any) -> None:
        _disarm_head_deadline(channel)
        connection_lost(channel, reason)

    lost.__wrapped__ = connection_lost  # type: ignore[attr-defined]
    return lost


def frame_too_big(protocol: Any, size: int, limit: int, reason: str) -> None:
    """autobahn's hook for a WebSocket message over the limit: tell the worker
    which limit, then close with 1009 (not drop the connection: 1006)."""
    frame = {"type": "error", "code": "PAYLOAD_TOO_LARGE", "message": f"frame: larger than the limit of {limit} bytes"}
    protocol.sendMessage(json.dumps(frame, separators=(",", ":")).encode(), isBinary=False)
    protocol.failByDrop = False
    protocol._fail_connection(protocol.CLOSE_STATUS_CODE_MESSAGE_TOO_BIG, f"frame larger than {limit} bytes")


def unread_bytes(transport: Any) -> int:
    """What Twisted still holds to write to the peer of a TCP transport (0
    for any other kind, which keeps its buffer elsewhere)."""
    buffer = getattr(transport, "dataBuffer", b"")
    return len(buffer) - getattr(transport, "offset", 0) + getattr(transport, "_tempDataLen", 0)


def dropped_when_unread(server_send: Callable[..., None]) -> Callable[..., None]:
    """daphne's WebSocketProtocol.serverSend (`server_send`), then the
    connection dropped if its peer leaves more than UNREAD_BYTES_LIMIT unread."""

    @functools.wraps(server_send)
    def send(protocol: Any, content: Any, binary: bool = False) -> None:
        server_send(protocol, content, binary)
        transport = protocol.transport
        if transport is not None and unread_bytes(transport) > UNREAD_BYTES_LIMIT:
            logger.warning(
                "dropping WebSocket connection %s: more than %d bytes sent and not read",
                protocol.client_addr,
                UNREAD_BYTES_LIMIT,
            )
            transport.abortConnection()

    return send


def _no_twisted_access_line(factory: Any, request: Any) -> None:
    """Daphne writes the access log; Twisted's own line would be dropped."""


def tune_twisted() -> None:
    from daphne.http_protocol import HTTPFactory, WebRequest
    from daphne.ws_protocol import WebSocketFactory, WebSocketProtocol
    from twisted.web import http

    reason_phrases.install()
    http.HTTPChannel.totalHeadersSize = MAX_HEADER_BYTES
    http.HTTPChannel.maxHeaders = MAX_HEADER_LINES
    # One line longer than the whole section never reaches lineReceived.
    http.HTTPChannel.MAX_LENGTH = MAX_HEADER_BYTES
    # Twisted's methods are replaced on purpose (mypy's method-assign): these are the patches.
    http.HTTPChannel.lineLengthExceeded = lambda channel, line: _refuse_headers(channel)  # type: ignore[method-assign]
    if not hasattr(http.HTTPChannel.lineReceived, "__wrapped__"):
        http.HTTPChannel.lineReceived = bounded_headers(http.HTTPChannel.lineReceived)  # type: ignore[method-assign]
    WebSocketProtocol._max_message_size_exceeded = frame_too_big
    if not hasattr(WebSocketProtocol.serverSend, "__wrapped__"):
        WebSocketProtocol.serverSend = dropped_when_unread(WebSocketProtocol.serverSend)
    if not hasattr(http.HTTPChannel.connectionMade, "__wrapped__"):
        http.HTTPChannel.connectionMade = head_deadline_on_connect(http.HTTPChannel.connectionMade)  # type: ignore[method-assign]
        http.HTTPChannel.dataReceived = head_deadline_on_data(http.HTTPChannel.dataReceived)  # type: ignore[method-assign]
        http.HTTPChannel.allHeadersReceived = head_deadline_met(http.HTTPChannel.allHeadersReceived)  # type: ignore[method-assign]
        http.HTTPChannel.connectionLost = head_deadline_on_close(http.HTTPChannel.connectionLost)  # type: ignore[method-assign]
    if not hasattr(http.Request.handleContentChunk, "__wrapped__"):
        # Around the deadline's wrapper: a refused body's head disarms the deadline itself.
        http.HTTPChannel.allHeadersReceived = bounded_declared_body(http.HTTPChannel.allHeadersReceived)  # type: ignore[method-assign]
        http.Request.handleContentChunk = bounded_body_chunks(http.Request.handleContentChunk)  # type: ignore[method-assign]

    if not hasattr(WebRequest.__init__, "__wrapped__"):
        WebRequest.__init__ = without_form_decoding(WebRequest.__init__)
    if not hasattr(http.HTTPChannel.isSecure, "__wrapped__"):
        http.HTTPChannel.isSecure = secure_once(http.HTTPChannel.isSecure)  # type: ignore[method-assign]
    if not hasattr(http.HTTPChannel.getHost, "__wrapped__"):
        http.HTTPChannel.getHost = host_once(http.HTTPChannel.getHost)  # type: ignore[method-assign]
    HTTPFactory.log = _no_twisted_access_line
    if not hasattr(WebSocketFactory.resetProtocolOptions, "__wrapped__"):
        WebSocketFactory.resetProtocolOptions = patient_close(WebSocketFactory.resetProtocolOptions)
    tune_autobahn()
