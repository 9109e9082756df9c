"""A deadline for request headers (issue 35), black box against a live server: a
connection that trickles its headers a line at a time is closed once
HEADER_DEADLINE_SECONDS have passed, while a WebSocket, a body sent at a slow
but steady pace and a kept-alive connection idling between requests all outlast
the deadline."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from server.serving import HEADER_DEADLINE_SECONDS
from tests.support.api import make_queue
from tests.support.keys import Worker

pytestmark = pytest.mark.django_db(transaction=True)

SLACK_SECONDS = 3.0
LINE_EVERY_SECONDS = 2.0
# Long enough past the deadline that a connection cut by it shows.
OUTLAST_SECONDS = HEADER_DEADLINE_SECONDS + 2.0


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length body (what /healthz and the errors answer)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the body"
        body += chunk
    return head + b"\r\n\r\n" + body


def headers_sent_a_line_every_two_seconds(port: int) -> tuple[float, int, bytes]:
    """A request whose headers never end, a line every two seconds: how long until the
    server closed it, how many lines were sent, and what it answered."""
    with connect(port) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        sock.settimeout(LINE_EVERY_SECONDS)
        answer, sent = b"", 0
        # Never the blank line that ends the headers: only the deadline can end this.
        while time.monotonic() - started < HEADER_DEADLINE_SECONDS + 10:
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                try:
                    sock.sendall(b"X-Slow-%d: 1\r\n" % sent)
                except OSError:  # closed under us (a reset after the 408)
                    break
                sent += 1
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
        closed_after = time.monotonic() - started
    return closed_after, sent, answer


def test_a_request_that_is_not_slow_is_served(orbit_server: Any) -> None:
    with connect(orbit_server.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")


def test_trickled_headers_are_cut_at_the_deadline_while_a_websocket_a_steady_body_and_an_idle_connection_outlast_it(
    orbit_server: Any, tenant: Any
) -> None:
    """Side by side, on connections of their own, so that the deadline is waited once:
    headers sent a line every two seconds are cut at it, and the three others outlast it."""
    queue = make_queue(tenant.client, "header-deadline", rate_per_second=1000)
    results: dict[str, Any] = {}

    def keep(name: str, work: Callable[[], Any]) -> threading.Thread:
        def run() -> None:
            try:
                results[name] = work()
            except Exception as exc:  # reported below, with the others' outcome
                results[name] = exc

        thread = threading.Thread(target=run, name=name)
        thread.start()
        return thread

    def websocket() -> str:
        worker = Worker(orbit_server.url, tenant.token)
        try:
            welcome = worker.hello([queue["id"]], capacity=1, worker_id="header-deadline")
            assert welcome["type"] == "hello.ok", welcome
            time.sleep(OUTLAST_SECONDS)
            return str(worker.request("drain")["type"])  # answered: the connection is still there
        finally:
            with contextlib.suppress(Exception):
                worker.close()

    def steady_body() -> bytes:
        body = b"x" * 64
        with connect(orbit_server.port) as sock:
            sock.sendall(
                # /healthz takes GET only; the server reads a body of any request all the same
                b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)
            )
            # Eight bytes every 1.5 s is a slow link, not an attack on the headers: never timed.
            for start in range(0, len(body), 8):
                sock.sendall(body[start : start + 8])
                time.sleep(OUTLAST_SECONDS / 8)
            return read_response(sock)

    def idle_kept_alive() -> tuple[bytes, bytes]:
        with connect(orbit_server.port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            first = read_response(sock)
            time.sleep(OUTLAST_SECONDS)  # idle between requests: the next one's deadline starts at its first byte
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            return first, read_response(sock)

    threads = [
        keep("trickle", lambda: headers_sent_a_line_every_two_seconds(orbit_server.port)),
        keep("websocket", websocket),
        keep("body", steady_body),
        keep("idle", idle_kept_alive),
    ]
    for thread in threads:
        thread.join(timeout=OUTLAST_SECONDS + 30)
    trickle = results.get("trickle")
    assert isinstance(trickle, tuple), results
    closed_after, sent, answer = trickle
    assert closed_after < HEADER_DEADLINE_SECONDS + SLACK_SECONDS, (closed_after, sent)
    assert closed_after >= HEADER_DEADLINE_SECONDS - 0.5, closed_after  # not before it
    assert sent >= 4, sent  # the lines did keep coming
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert results.get("websocket") == "drain.ok", results
    body_answer = results.get("body")
    assert isinstance(body_answer, bytes) and body_answer.startswith(b"HTTP/1.1 200 "), results
    idle = results.get("idle")
    assert isinstance(idle, tuple) and all(answer.startswith(b"HTTP/1.1 200 ") for answer in idle), results
