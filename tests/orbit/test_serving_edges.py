"""The serving layer's edges, black box against a live server with raw sockets.

A body over the upload limit (DATA_UPLOAD_MAX_MEMORY_SIZE) is answered 413
PAYLOAD_TOO_LARGE as soon as the server can tell: a declared Content-Length
at the end of the headers (before `100 Continue`, before any of the body is
read), a chunked body once it passes the limit. Before, daphne read the whole
body (to a temporary file, then all of it into memory on the event loop that
every client shares) and only then did Django refuse it: a 400 MB body grew
the process by 400 MB and stalled every other client for seconds, and a
Content-Length the client never meant to send held the connection waiting."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
from django.conf import settings

pytestmark = pytest.mark.django_db(transaction=True)

ANSWER_WITHIN_SECONDS = 5.0


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN_SECONDS)


def read_answer(sock: socket.socket) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One response with a Content-Length body: status line, headers (lowercase names), body.
    Fails (socket.timeout) if none arrives within ANSWER_WITHIN_SECONDS."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(b":") for line in lines)}
    length = int(headers[b"content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the answer's body"
        body += chunk
    return status, headers, body[:length]


def head(path: str, *lines: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + "".join(line + "\r\n" for line in lines)
        + "\r\n"
    ).encode()


def assert_too_large(answer: tuple[bytes, dict[bytes, bytes], bytes]) -> None:
    status, headers, body = answer
    assert status.startswith(b"HTTP/1.1 413 "), answer
    assert headers[b"content-type"] == b"application/json"
    envelope = json.loads(body)
    assert envelope["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert headers[b"x-request-id"].decode() == envelope["request_id"]


@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/queues"])
def test_a_declared_body_over_the_limit_is_refused_before_it_is_sent(orbit_server: Any, path: str) -> None:
    # given a Content-Length one byte over the limit, and none of the body
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    with connect(orbit_server.port) as sock:
        sock.sendall(head(path, f"Content-Length: {limit + 1}", "Idempotency-Key: over-the-limit"))
        # then 413 at once, in the envelope, without waiting for the body
        assert_too_large(read_answer(sock))


def test_an_absurd_content_length_is_refused_not_awaited(orbit_server: Any) -> None:
    with connect(orbit_server.port) as sock:
        sock.sendall(head("/v1/tasks", "Content-Length: 99999999999999999999", "Idempotency-Key: absurd"))
        assert_too_large(read_answer(sock))


def test_expect_continue_over_the_limit_gets_413_and_no_continue(orbit_server: Any) -> None:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    with connect(orbit_server.port) as sock:
        sock.sendall(head("/v1/tasks", f"Content-Length: {limit + 1}", "Expect: 100-continue", "Idempotency-Key: e"))
        status, _, _ = answer = read_answer(sock)
        assert not status.startswith(b"HTTP/1.1 100"), answer
        assert_too_large(answer)


def test_a_chunked_body_is_refused_once_past_the_limit(orbit_server: Any) -> None:
    # given a chunked body sent past the limit, never ended (no last chunk)
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    chunk = b"x" * 65536
    with connect(orbit_server.port) as sock:
        sock.sendall(head("/v1/tasks", "Transfer-Encoding: chunked", "Idempotency-Key: chunked-over"))
        sent = 0
        try:
            while sent <= limit + len(chunk):
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                sent += len(chunk)
        except OSError:  # the server answered and closed: what is asserted below
            pass
        # then the server answers 413 without waiting for the end of the body
        assert_too_large(read_answer(sock))


def test_a_body_at_the_limit_is_still_read_by_the_application(orbit_server: Any) -> None:
    # given a body of exactly the limit (no credential: the application's 401 shows it was read)
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    start = b'{"padding":"'
    body = start + b"x" * (limit - len(start) - 2) + b'"}'
    assert len(body) == limit
    with connect(orbit_server.port) as sock:
        sock.sendall(head("/v1/queues", f"Content-Length: {limit}", "Idempotency-Key: at-limit") + body)
        status, _, answer = read_answer(sock)
    assert status.startswith(b"HTTP/1.1 401 "), (status, answer)
    assert json.loads(answer)["error"]["code"] == "UNAUTHENTICATED"


def test_other_clients_are_answered_while_an_oversized_body_is_refused(orbit_server: Any) -> None:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    with connect(orbit_server.port) as big, connect(orbit_server.port) as other:
        big.sendall(head("/v1/tasks", f"Content-Length: {limit * 100}", "Idempotency-Key: big"))
        started = time.monotonic()
        other.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = read_answer(other)
        assert status.startswith(b"HTTP/1.1 200 ")
        assert time.monotonic() - started < ANSWER_WITHIN_SECONDS
        assert_too_large(read_answer(big))
