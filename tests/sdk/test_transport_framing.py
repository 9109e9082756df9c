"""Answers as real servers and proxies send them, read by orbit_sdk._transport (the client's
own HTTP/1.1 reader and pool) from fake servers on plain sockets: framing, connection reuse,
timeouts, threads; and the worker link's request timer (orbit_sdk._connection.Link.raw_call)
in its races on the event loop."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close

import orbit_sdk
from orbit_sdk import _connection, _transport
from orbit_sdk._connection import Connection, Link, LinkEvents, NoAnswer
from orbit_sdk._transport import KeepAliveTransport

ENVELOPE = json.dumps({"data": {"ok": True}, "request_id": "r-1"}).encode()
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(ENVELOPE), ENVELOPE)

# (server, connection, request target, request body) -> keep the connection open
Answer = Callable[["FakeServer", socket.socket, str, bytes], bool]


class FakeServer:
    """HTTP/1.1 on a real socket: reads each request (line, headers, a Content-Length body
    unless `read_body` is off) and lets `answer` write whatever bytes it likes."""

    def __init__(self, answer: Answer, *, read_body: bool = True) -> None:
        self.answer = answer
        self.read_body = read_body
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.requests: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while True:
                line = reader.readline()
                if not line:
                    return
                target = line.decode().split(" ")[1]
                length = 0
                while (header := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = reader.read(length) if self.read_body and length else b""
                with self.lock:
                    self.requests.append((f"{line.split()[0].decode()} {target}", body))
                if not self.answer(self, conn, target, body):
                    return
        except OSError:
            pass
        finally:
            reader.close()
            conn.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., FakeServer]]:
    servers: list[FakeServer] = []

    def start(answer: Answer, **options: Any) -> FakeServer:
        servers.append(FakeServer(answer, **options))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def scripted(*answers: bytes, trickle: bool = False, keep: bool = True) -> Answer:
    """The n-th request gets answers[n] (the last one after that), sent whole or a byte at a time."""

    def answer(server: FakeServer, conn: socket.socket, target: str, body: bytes) -> bool:
        data = answers[min(len(server.requests), len(answers)) - 1]
        if trickle:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(len(data)):
                conn.sendall(data[i : i + 1])
        else:
            conn.sendall(data)
        return keep

    return answer


def http_client(timeout: float = 5.0) -> httpx.Client:
    return httpx.Client(transport=KeepAliveTransport(), timeout=timeout)


# --------------------------------------------------------------------------- framing


@pytest.mark.parametrize("trickle", [False, True], ids=["whole", "byte-by-byte"])
def test_every_framing_is_read_whole_and_keeps_one_connection(serve: Callable[..., FakeServer], trickle: bool) -> None:
    answers = [  # (what the server sends, the body read)
        # chunk extensions (quoted too), sizes in both cases of hex, whitespace before ';', trailers
        (
            b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;name=value\r\nhello\r\n6 ; q="a;b"\r\n world\r\n'
            b"A\r\n0123456789\r\n1a\r\nabcdefghijklmnopqrstuvwxyz\r\n0;last\r\nX-Trailer: 1\r\nX-Other: 2\r\n\r\n",
            b"hello world0123456789abcdefghijklmnopqrstuvwxyz",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b""),
        # a 204 and a 304 with a Content-Length and no body: nothing is read as their body
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 10\r\n\r\n", b""),
        (b'HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\nETag: "x"\r\n\r\n', b""),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nafter 1xx",
            b"after 1xx",
        ),
        (b"HTTP/1.1 200 OK\r\ncOnTeNt-LeNgTh: 8\r\nCONNECTION: Keep-Alive\r\n\r\nany case", b"any case"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: Chunked\r\n\r\n"
            b"c\r\nchunked wins\r\n0\r\n\r\n",
            b"chunked wins",
        ),
        (b"HTTP/1.1 200\r\nContent-Length: 9\r\n\r\nno reason", b"no reason"),
        (b"HTTP/1.1 200 OK\nContent-Length: 7\n\nbare LF", b"bare LF"),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 8\r\n\r\n1.0 kept", b"1.0 kept"),
    ]
    server = serve(scripted(*(sent for sent, _ in answers), trickle=trickle))
    with http_client() as client:
        got = [client.get(f"{server.url}/{n}").content for n in range(len(answers))]
        assert got == [body for _, body in answers]
        response = client.get(f"{server.url}/again")
    assert response.content == b"1.0 kept" and response.extensions["reason_phrase"] == b"OK"
    assert server.connections == 1


def test_repeated_header_names_of_any_case_are_all_kept(serve: Callable[..., FakeServer]) -> None:
    server = serve(scripted(b"HTTP/1.1 200 OK\r\nX-A: 1\r\nx-a: 2\r\nX-A: 3, 4\r\nContent-Length: 2\r\n\r\nok"))
    with http_client() as client:
        assert client.get(server.url).headers.get_list("X-A") == ["1", "2", "3, 4"]


@pytest.mark.parametrize("trickle", [False, True], ids=["whole", "byte-by-byte"])
def test_answers_that_end_their_connection_are_read_to_its_end(serve: Callable[..., FakeServer], trickle: bool) -> None:
    body = b"0123456789" * 300
    server = serve(
        scripted(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body,
            b"HTTP/1.0 200 OK\r\n\r\n" + body,
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 4\r\n\r\nfour",
            trickle=trickle,
            keep=False,
        )
    )
    with http_client() as client:
        assert client.get(server.url).content == body
        assert client.get(server.url).content == body
        assert client.get(server.url).content == b"four"
    assert server.connections == 3


def test_large_headers_and_bodies(serve: Callable[..., FakeServer]) -> None:
    big = b"z" * 20_000_000
    chunks = b"".join(b"%X\r\n%s\r\n" % (65536, b"q" * 65536) for _ in range(64))
    server = serve(
        scripted(
            b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 60_000 + b"\r\nContent-Length: 2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big),
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n",
        )
    )
    with http_client() as client:
        assert len(client.get(server.url).headers["x-big"]) == 60_000
        assert client.get(server.url).content == big
        assert client.get(server.url).content == b"q" * 65536 * 64
    assert server.connections == 1


def test_a_folded_header_is_unfolded(serve: Callable[..., FakeServer]) -> None:
    # obs-fold (RFC 9112 §5.2): a user agent MUST replace it with spaces; httpx's h11 did, and
    # so does http.client. It was refused as "not a header line" (a TransportError for every call).
    server = serve(scripted(b"HTTP/1.1 200 OK\r\nX-A: one\r\n two\r\n\tthree\r\nContent-Length: 2\r\n\r\nok"))
    with http_client() as client:
        response = client.get(server.url)
        assert response.headers["x-a"] == "one two three" and response.content == b"ok"
        assert client.get(server.url).content == b"ok"
    assert server.connections == 1


@pytest.mark.parametrize("lengths", [b"Content-Length: 2\r\nContent-Length: 2\r\n", b"Content-Length: 2, 2\r\n"])
def test_a_content_length_repeated_with_one_value_is_that_length(
    serve: Callable[..., FakeServer], lengths: bytes
) -> None:
    # A proxy that repeats the header (RFC 9110 §8.6: one value, repeated, is that value); h11 reads it
    server = serve(scripted(b"HTTP/1.1 200 OK\r\n" + lengths + b"\r\nok"))
    with http_client() as client:
        assert client.get(server.url).content == b"ok"
        assert client.get(server.url).content == b"ok"
    assert server.connections == 1


@pytest.mark.parametrize("lengths", [b"Content-Length: 2\r\nContent-Length: 3\r\n", b"Content-Length: 2, 3\r\n"])
def test_content_lengths_that_disagree_are_a_protocol_error(serve: Callable[..., FakeServer], lengths: bytes) -> None:
    server = serve(scripted(b"HTTP/1.1 200 OK\r\n" + lengths + b"\r\nok!"))
    with orbit_sdk.Client(server.url, "tok") as client:
        with pytest.raises(orbit_sdk.TransportError, match="RemoteProtocolError: not a content-length"):
            client._request("GET", "/v1")


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: 99999999999999999999\r\n",  # more than an index: OverflowError
        b"Content-Length: 9000000000000000000\r\n",  # more than the memory: MemoryError
        b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFF",
    ],
)
def test_a_body_size_no_server_sends_is_a_transport_error(serve: Callable[..., FakeServer], head: bytes) -> None:
    # BufferedReader.read(n) allocates n bytes up front: a made-up size escaped as an
    # OverflowError or MemoryError, outside httpx's and the SDK's exceptions.
    server = serve(scripted(b"HTTP/1.1 200 OK\r\n" + head + b"\r\nok", keep=False))
    with orbit_sdk.Client(server.url, "tok") as client:
        with pytest.raises(orbit_sdk.TransportError, match="RemoteProtocolError: the connection closed"):
            client._request("GET", "/v1")


def test_a_body_its_content_encoding_cannot_decode_is_a_protocol_error(serve: Callable[..., FakeServer]) -> None:
    # httpx decodes gzip as it builds the response and raises httpx.DecodingError, which is no
    # httpx.TransportError: it escaped both clients, outside the SDK's OrbitError.
    server = serve(scripted(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 8\r\n\r\nnot gzip"))
    with orbit_sdk.Client(server.url, "tok") as client:
        with pytest.raises(orbit_sdk.ProtocolError, match="GET /v1: DecodingError"):
            client._request("GET", "/v1")

    async def in_async() -> None:
        async with orbit_sdk.AsyncClient(server.url, "tok") as client:
            with pytest.raises(orbit_sdk.ProtocolError, match="GET /v1: DecodingError"):
                await client._request("GET", "/v1")

    asyncio.run(in_async())


# --------------------------------------------------------------------------- connection reuse


def test_an_answer_sent_before_the_request_was_read_is_the_outcome(serve: Callable[..., FakeServer]) -> None:
    # A proxy refuses a body over its limit as soon as it reads the headers and closes without
    # reading the body: sending the rest fails (a reset), yet the 413 is the definite answer
    # (httpx's own transport reads it). Reported as a TransportError, "outcome unknown, send
    # the same again" would loop for ever.
    refusal = json.dumps({"error": {"code": "PAYLOAD_TOO_LARGE", "message": "too big"}}).encode()
    too_large = b"HTTP/1.1 413 Payload Too Large\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (
        len(refusal),
        refusal,
    )

    def refuse(server: FakeServer, conn: socket.socket, target: str, body: bytes) -> bool:
        if target == "/v1/tasks:batch":
            conn.sendall(too_large)
            time.sleep(0.05)
            return False  # closed with the body unread: a reset
        conn.sendall(OK)
        return True

    server = serve(refuse, read_body=False)
    with orbit_sdk.Client(server.url, "tok") as client:
        with pytest.raises(orbit_sdk.APIError) as raised:
            client._request("POST", "/v1/tasks:batch", body={"tasks": "x" * 16_000_000})
        assert raised.value.code == "PAYLOAD_TOO_LARGE" and raised.value.status_code == 413
        # nothing of the refused request's connection is used again
        assert client._request("GET", "/v1") == {"ok": True}
    assert server.connections == 2


def test_a_write_that_fails_without_an_answer_stays_a_transport_error(
    serve: Callable[..., FakeServer],
) -> None:
    def hang_up(server: FakeServer, conn: socket.socket, target: str, body: bytes) -> bool:
        return False  # closed at once, the body unread, nothing said

    server = serve(hang_up, read_body=False)
    with orbit_sdk.Client(server.url, "tok") as client:
        with pytest.raises(orbit_sdk.TransportError, match=r"POST /v1/tasks: (WriteError|ReadError|RemoteProtocol)"):
            client._request("POST", "/v1/tasks", key="k-1", body={"blob": "x" * 16_000_000})
    assert len(server.requests) == 1


def test_a_keep_alive_connection_closed_as_the_request_goes_is_not_silently_resent(
    serve: Callable[..., FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The classic race: the server closes an idle connection just after the client found it
    # alive. The SDK says it never re-sends a write by itself: the caller gets a
    # TransportError (outcome unknown) and nothing is sent twice behind its back.
    server = serve(scripted(OK, keep=False))
    with orbit_sdk.Client(server.url, "tok") as client:
        assert client._request("POST", "/v1/tasks", key="k-1", body={}) == {"ok": True}
        time.sleep(0.1)  # the server's FIN has arrived
        monkeypatch.setattr(_transport, "_dropped", lambda sock: False)  # ... just after the check
        with pytest.raises(orbit_sdk.TransportError, match="POST /v1/tasks: "):
            client._request("POST", "/v1/tasks", key="k-2", body={})
        monkeypatch.undo()
        assert client._request("POST", "/v1/tasks", key="k-2", body={}) == {"ok": True}
    assert [body for _, body in server.requests] == [b"{}", b"{}"]  # k-1 once, k-2 once (the caller's resend)
    assert server.connections == 2


def test_a_request_taken_and_never_answered_is_sent_once(serve: Callable[..., FakeServer]) -> None:
    def swallow(server: FakeServer, conn: socket.socket, target: str, body: bytes) -> bool:
        return False  # read, perhaps done, then the connection ends without an answer

    server = serve(swallow)
    with orbit_sdk.Client(server.url, "tok") as client:
        with pytest.raises(orbit_sdk.TransportError, match="RemoteProtocolError: the server closed the connection"):
            client._request("POST", "/v1/tasks", key="k-1", body={"n": 1})
    assert server.requests == [("POST /v1/tasks", b'{"n":1}')]


@pytest.mark.parametrize(
    "broken",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + ENVELOPE[:5],  # half, then it stalls
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n" + ENVELOPE[:5],
        b"HTTP/1.1 200 OK\r\nContent-Le",
    ],
)
def test_a_connection_with_an_answer_half_read_never_serves_the_next_request(
    serve: Callable[..., FakeServer], broken: bytes
) -> None:
    def stall_then_finish(server: FakeServer, conn: socket.socket, target: str, body: bytes) -> bool:
        if target == "/stall":
            conn.sendall(broken)
            time.sleep(0.6)
            conn.sendall(b"x" * 200)  # the rest, late: would be read as the next answer
            return True
        conn.sendall(OK)
        return True

    server = serve(stall_then_finish)
    with orbit_sdk.Client(server.url, "tok", timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(orbit_sdk.TransportError, match=r"GET /stall: timed out \(ReadTimeout\)"):
            client._request("GET", "/stall")
        assert time.monotonic() - started < 2
        time.sleep(0.5)
        for _ in range(3):
            assert client._request("GET", "/v1") == {"ok": True}
    assert server.connections == 2


def test_bytes_after_an_answer_are_never_read_as_the_next_one(serve: Callable[..., FakeServer]) -> None:
    stale = b"HTTP/1.1 500 Stale\r\nContent-Length: 0\r\n\r\n"
    server = serve(scripted(OK + stale, OK))
    with orbit_sdk.Client(server.url, "tok") as client:
        assert client._request("GET", "/v1") == {"ok": True}
        time.sleep(0.1)
        assert client._request("GET", "/v1") == {"ok": True}


# --------------------------------------------------------------------------- timeouts, threads


def test_a_server_that_accepts_and_never_answers_is_a_read_timeout(serve: Callable[..., FakeServer]) -> None:
    def never(server: FakeServer, conn: socket.socket, target: str, body: bytes) -> bool:
        time.sleep(3)
        return False

    server = serve(never)
    with orbit_sdk.Client(server.url, "tok", timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(orbit_sdk.TransportError, match=r"timed out \(ReadTimeout\)"):
            client._request("POST", "/v1/tasks", key="k", body={})
        assert time.monotonic() - started < 1.5


def test_a_connect_that_is_never_accepted_is_a_connect_timeout() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    waiting = []
    for _ in range(4):  # fill the backlog: the next SYN is dropped
        pending = socket.socket()
        pending.setblocking(False)
        pending.connect_ex(("127.0.0.1", port))
        waiting.append(pending)
    time.sleep(0.1)
    try:
        with orbit_sdk.Client(f"http://127.0.0.1:{port}", "tok", timeout=0.3) as client:
            started = time.monotonic()
            with pytest.raises(orbit_sdk.TransportError, match=r"timed out \(ConnectTimeout\)"):
                client._request("GET", "/v1")
            assert time.monotonic() - started < 1.5
    finally:
        for pending in waiting:
            pending.close()
        listener.close()


def test_many_threads_each_get_their_own_answer(serve: Callable[..., FakeServer]) -> None:
    def echo(server: FakeServer, conn: socket.socket, target: str, body: bytes) -> bool:
        data = json.dumps({"data": {"target": target, "body": body.decode()}}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        return True

    server = serve(echo)
    wrong: list[Any] = []
    with orbit_sdk.Client(server.url, "tok") as client:

        def work(thread: int) -> None:
            for n in range(25):
                try:
                    got = client._request("POST", f"/t{thread}/{n}", key=f"k-{thread}-{n}", body={"n": n})
                except Exception as exc:  # noqa: BLE001 - collected and asserted below
                    wrong.append(exc)
                    continue
                if got != {"target": f"/t{thread}/{n}", "body": json.dumps({"n": n}, separators=(",", ":"))}:
                    wrong.append(got)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(24)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        idle = sum(len(connections) for connections in client._http._transport._idle.values())  # type: ignore[attr-defined]
    assert wrong == []
    assert len(server.requests) == 24 * 25
    assert server.connections <= 24 and idle <= _transport.MAX_IDLE_PER_ORIGIN


# --------------------------------------------------------------------------- the worker's request timer


class FakeWebSocket:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.send_gate: asyncio.Event | None = None
        self.fail_send = False

    async def send(self, message: str) -> None:
        if self.send_gate is not None:
            await self.send_gate.wait()
        if self.fail_send:
            raise ConnectionClosed(Close(1006, ""), None)
        self.sent.append(json.loads(message))


def make_link(timeout: float) -> Link:
    events = LinkEvents(
        on_hello=lambda conn, held: asyncio.sleep(0),
        on_ready=lambda conn: None,
        on_assign=lambda conn, frame: None,
        check_finished=lambda: None,
        spawn=lambda awaitable: asyncio.ensure_future(awaitable),
    )
    return Link(
        events,
        url="ws://127.0.0.1:1/v1/workers/connect",
        token="tok",
        worker_id="w",
        hello={"type": "hello"},
        done=asyncio.Event(),
        request_timeout=timeout,
        min_reconnect_delay=0.1,
        max_reconnect_delay=1.0,
    )


def run_checked(main: Callable[[], Any]) -> list[dict[str, Any]]:
    """Runs `main` on a fresh loop; what the loop's exception handler was told (InvalidStateError
    in a callback, "Future exception was never retrieved", ...)."""
    told: list[dict[str, Any]] = []

    async def wrapper() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: told.append(context))
        await main()
        await asyncio.sleep(0.05)
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(wrapper())
    return told


def reply(link: Link, conn: Connection, request_id: str) -> None:
    link._dispatch(conn, json.dumps({"type": "ok", "reply_to": request_id}))


def test_a_reply_in_time_cancels_the_timer() -> None:
    handles: list[asyncio.TimerHandle] = []

    async def main() -> None:
        link, ws = make_link(5.0), FakeWebSocket()
        conn = Connection(ws, 1)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        call_later = loop.call_later

        def recording(delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
            handle = call_later(delay, callback, *args)
            if callback is _connection._no_reply:
                handles.append(handle)
            return handle

        loop.call_later = recording  # type: ignore[method-assign]
        call = asyncio.ensure_future(link.raw_call(conn, {"type": "task.start"}))
        await asyncio.sleep(0)
        reply(link, conn, ws.sent[0]["id"])
        assert (await call)["type"] == "ok"
        assert conn.pending == {}

    assert run_checked(main) == []
    assert len(handles) == 1 and handles[0].cancelled()


@pytest.mark.parametrize("first", ["reply", "timer"])
def test_a_reply_as_the_timer_fires_is_one_outcome_and_no_error(first: str) -> None:
    outcome: list[Any] = []

    async def main() -> None:
        link, ws = make_link(0.05), FakeWebSocket()
        conn = Connection(ws, 1)  # type: ignore[arg-type]
        call = asyncio.ensure_future(link.raw_call(conn, {"type": "task.renew"}))
        await asyncio.sleep(0)
        request_id = ws.sent[0]["id"]
        future = conn.pending[request_id]
        # both in the same turn of the loop, before the caller runs again
        if first == "reply":
            reply(link, conn, request_id)
            _connection._no_reply(future, "task.renew", 0.05)
        else:
            _connection._no_reply(future, "task.renew", 0.05)
            reply(link, conn, request_id)
        try:
            outcome.append(await call)
        except NoAnswer as exc:
            outcome.append(exc)
        await asyncio.sleep(0.1)  # the real timer's deadline passes

    assert run_checked(main) == []
    assert (outcome[0]["type"] == "ok") if first == "reply" else isinstance(outcome[0], NoAnswer)


def test_a_cancelled_caller_leaves_no_timer_and_no_pending_request() -> None:
    async def main() -> None:
        link, ws = make_link(0.05), FakeWebSocket()
        conn = Connection(ws, 1)  # type: ignore[arg-type]
        call = asyncio.ensure_future(link.raw_call(conn, {"type": "task.start"}))
        await asyncio.sleep(0)
        request_id = ws.sent[0]["id"]
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert conn.pending == {}
        reply(link, conn, request_id)  # late
        await asyncio.sleep(0.1)  # past the timer's deadline
        link._drop(conn)

    assert run_checked(main) == []


def test_no_reply_in_time_is_no_answer() -> None:
    async def main() -> None:
        link, ws = make_link(0.05), FakeWebSocket()
        conn = Connection(ws, 1)  # type: ignore[arg-type]
        started = time.monotonic()
        with pytest.raises(NoAnswer, match="no reply to task.result within 0.05s"):
            await link.raw_call(conn, {"type": "task.result"})
        assert 0.04 < time.monotonic() - started < 1
        assert conn.pending == {}
        reply(link, conn, ws.sent[0]["id"])  # late: ignored

    assert run_checked(main) == []


def test_a_connection_that_closes_while_a_send_waits_logs_no_unretrieved_exception() -> None:
    # websockets' send on a closing connection waits for the close, then raises
    # ConnectionClosed; meanwhile the read loop ends and _drop fails every pending future,
    # this request's too, which nobody awaits: asyncio then logs "Future exception was
    # never retrieved" at ERROR level.
    async def main() -> None:
        link, ws = make_link(5.0), FakeWebSocket()
        conn = Connection(ws, 1)  # type: ignore[arg-type]
        ws.send_gate, ws.fail_send = asyncio.Event(), True
        call = asyncio.ensure_future(link.raw_call(conn, {"type": "task.start"}))
        await asyncio.sleep(0)
        link._drop(conn)  # the read loop saw the close
        ws.send_gate.set()
        with pytest.raises(NoAnswer, match="connection closed"):
            await call

    assert [context.get("message") for context in run_checked(main)] == []
