"""orbit_sdk.Client's default transport (orbit_sdk._transport): keep-alive HTTP/1.1 on the
standard library, against a scripted server on 127.0.0.1 that counts its connections."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import orbit_sdk
from orbit_sdk._transport import KeepAliveTransport

ENVELOPE = json.dumps({"data": {"ok": True}, "request_id": "r-1"}).encode()


ANSWER_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-Id: r-1\r\n"
SIZED_ENVELOPE = b"Content-Length: %d\r\n\r\n%s" % (len(ENVELOPE), ENVELOPE)
# Answers sent as they are; the connection is then closed, but for those in KEEPING.
SCRIPTED = {
    "/http-1.0": b"HTTP/1.0 200 OK\r\n" + SIZED_ENVELOPE,
    "/continue": b"HTTP/1.1 100 Continue\r\n\r\n" + ANSWER_HEAD + SIZED_ENVELOPE,
    "/repeated-header": ANSWER_HEAD + b"Vary: a\r\nVary: b\r\n" + SIZED_ENVELOPE,
    "/until-close": ANSWER_HEAD + b"\r\n" + ENVELOPE,
    "/short": ANSWER_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(ENVELOPE) + 10, ENVELOPE),
    "/not-http": b"SSH-2.0-OpenSSH_9.2\r\n\r\n",
    "/bad-header": ANSWER_HEAD + b"no colon here\r\nContent-Length: 2\r\n\r\n{}",
    "/bad-chunk": ANSWER_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "/negative-chunk": ANSWER_HEAD + b"Transfer-Encoding: chunked\r\n\r\n-1\r\n{}\r\n0\r\n\r\n",
}
KEEPING = {"/continue", "/repeated-header"}


class ScriptedServer:
    """HTTP/1.1 on a real socket; what it answers depends on the request's path."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.tls = tls
        self.connections = 0
        self.requests: list[tuple[str, list[tuple[str, str]], bytes]] = []
        self.closed_by_client = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            reader = conn.makefile("rb")
            while True:
                line = reader.readline()
                if not line:
                    with self._lock:
                        self.closed_by_client += 1
                    return
                method, target, _ = line.decode().split(" ", 2)
                headers = []
                while (header := reader.readline()) not in (b"\r\n", b""):
                    name, value = header.decode().rstrip("\r\n").split(":", 1)
                    headers.append((name, value.strip()))
                length = int(next((v for n, v in headers if n.lower() == "content-length"), "0"))
                body = reader.read(length) if length else b""
                with self._lock:
                    self.requests.append((f"{method} {target}", headers, body))
                if not self._answer(conn, target):
                    conn.close()
                    return
        except (OSError, ssl.SSLError):
            conn.close()

    @staticmethod
    def _answer(conn: socket.socket, target: str) -> bool:
        """Answers; False when the connection is to be closed after the answer."""
        head = ANSWER_HEAD.decode()
        if target == "/slow":
            time.sleep(1.5)
        if target == "/chunked":
            half = len(ENVELOPE) // 2
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (ENVELOPE[:half], ENVELOPE[half:]))
            conn.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + chunks + b"0\r\n\r\n")
            return True
        if target in SCRIPTED:
            conn.sendall(SCRIPTED[target])
            return target in KEEPING
        close = "Connection: close\r\n" if target == "/connection-close" else ""
        conn.sendall(f"{head}{close}Content-Length: {len(ENVELOPE)}\r\n\r\n".encode() + ENVELOPE)
        # /drop: the server closes an idle keep-alive connection without saying so first.
        return target not in ("/connection-close", "/drop")

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    yield scripted
    scripted.close()


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_requests_reuse_one_connection_with_the_headers_httpx_built(server: ScriptedServer) -> None:
    with orbit_sdk.Client(server.url, "tok-1") as client:
        assert isinstance(client._http._transport, KeepAliveTransport)
        for n in range(5):
            assert client._request("POST", "/v1/tasks", key=f"k-{n}", body={"n": n}) == {"ok": True}
        assert client._request("GET", "/v1/tasks/t 1", params={"page_size": 2}) == {"ok": True}
    assert server.connections == 1
    line, headers, body = server.requests[0]
    assert line == "POST /v1/tasks"
    names = [name.lower() for name, _ in headers]
    assert sorted(names) == sorted(set(names))  # each header once
    sent = {name.lower(): value for name, value in headers}
    assert sent["authorization"] == "Bearer tok-1"
    assert sent["idempotency-key"] == "k-0"
    assert sent["content-type"] == "application/json"
    assert sent["user-agent"] == orbit_sdk._client.USER_AGENT
    assert sent["host"] == f"127.0.0.1:{server.port}"
    assert int(sent["content-length"]) == len(body) and json.loads(body) == {"n": 0}
    assert server.requests[-1][0] == "GET /v1/tasks/t%201?page_size=2"


def test_a_connection_the_server_dropped_while_idle_is_not_reused(server: ScriptedServer) -> None:
    with orbit_sdk.Client(server.url, "tok") as client:
        assert client._request("GET", "/drop") == {"ok": True}
        time.sleep(0.1)  # the server's close has arrived
        assert client._request("GET", "/v1") == {"ok": True}
        assert client._request("GET", "/connection-close") == {"ok": True}
        assert client._request("GET", "/v1") == {"ok": True}
    assert server.connections == 3


def test_a_chunked_answer_is_read_whole(server: ScriptedServer) -> None:
    with orbit_sdk.Client(server.url, "tok") as client:
        assert client._request("GET", "/chunked") == {"ok": True}
        assert client._request("GET", "/chunked") == {"ok": True}
    assert server.connections == 1


def test_answers_of_every_http_1_framing_are_read_whole(server: ScriptedServer) -> None:
    # an HTTP/1.0 answer and one whose body runs to the connection's end close their connection;
    # a 100 Continue before the answer, and a header sent twice, keep it
    with orbit_sdk.Client(server.url, "tok") as client:
        for path in ("/http-1.0", "/until-close", "/continue", "/repeated-header", "/v1"):
            assert client._request("GET", path) == {"ok": True}, path
    assert server.connections == 3


def test_a_repeated_header_is_kept_as_sent(server: ScriptedServer) -> None:
    with httpx.Client(transport=KeepAliveTransport()) as client:
        response = client.get(f"{server.url}/repeated-header")
    assert response.headers.get_list("vary") == ["a", "b"]


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/short", "10 bytes short of the answer's body"),
        ("/not-http", "not an HTTP/1.x status line"),
        ("/bad-header", "not a header line"),
        ("/bad-chunk", "not a chunk size"),
        ("/negative-chunk", "not a chunk size"),
    ],
)
def test_a_broken_answer_is_a_protocol_error_and_its_connection_is_not_reused(
    server: ScriptedServer, path: str, error: str
) -> None:
    with orbit_sdk.Client(server.url, "tok") as client:
        with pytest.raises(orbit_sdk.TransportError, match=f"GET {path}: RemoteProtocolError: .*{error}"):
            client._request("GET", path)
        assert client._request("GET", "/v1") == {"ok": True}
    assert server.connections == 2


@pytest.mark.parametrize("headers", [{"X-Note": "a\r\nX-Injected: 1"}, {"X-Note": "a\x00"}, {"Bad:Name": "1"}])
def test_a_header_that_would_break_the_request_s_framing_is_refused_before_anything_is_sent(
    server: ScriptedServer, headers: dict[str, str]
) -> None:
    with httpx.Client(transport=KeepAliveTransport()) as client:
        with pytest.raises(ValueError, match="invalid header"):
            client.get(f"{server.url}/v1", headers=headers)
    assert server.requests == []


def test_a_slow_answer_is_a_timeout_and_the_connection_is_not_reused(server: ScriptedServer) -> None:
    with orbit_sdk.Client(server.url, "tok", timeout=0.3) as client:
        with pytest.raises(orbit_sdk.TransportError, match=r"GET /slow: timed out \(ReadTimeout\)"):
            client._request("GET", "/slow")
        assert client._request("GET", "/v1") == {"ok": True}
    assert server.connections == 2


def test_a_refused_connection_is_a_transport_error() -> None:
    unused = socket.create_server(("127.0.0.1", 0))
    port = unused.getsockname()[1]
    unused.close()
    with orbit_sdk.Client(f"http://127.0.0.1:{port}", "tok") as client:
        with pytest.raises(orbit_sdk.TransportError, match=r"POST /v1/tasks: ConnectError: .*refused"):
            client._request("POST", "/v1/tasks", key="k", body={})


def test_sixteen_threads_share_the_client(server: ScriptedServer) -> None:
    failures: list[BaseException] = []
    with orbit_sdk.Client(server.url, "tok") as client:

        def submitter(n: int) -> None:
            try:
                for m in range(25):
                    assert client._request("POST", "/v1/tasks", key=f"k-{n}-{m}", body={"n": n}) == {"ok": True}
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=submitter, args=(n,)) for n in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []
    assert len(server.requests) == 400
    keys = {value for _, headers, _ in server.requests for name, value in headers if name.lower() == "idempotency-key"}
    assert len(keys) == 400
    assert server.connections <= 16


def test_a_thread_checking_an_idle_connection_keeps_no_other_thread_waiting(
    server: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given two idle connections, and a first thread whose check of one of them is stuck
    # (a system call whose thread the machine descheduled)
    with orbit_sdk.Client(server.url, "tok") as client:
        transport = client._http._transport
        assert isinstance(transport, KeepAliveTransport)
        origin = ("http", "127.0.0.1", server.port)
        request = client._http.build_request("GET", f"{server.url}/v1")
        both = [transport._checkout(origin, request, None) for _ in range(2)]
        for connection in both:
            transport._checkin(origin, connection)
        checking, release = threading.Event(), threading.Event()
        check = orbit_sdk._transport._dropped

        def stuck_check(sock: socket.socket) -> bool:
            if threading.current_thread().name == "stuck":
                checking.set()
                release.wait(5)
            return check(sock)

        monkeypatch.setattr(orbit_sdk._transport, "_dropped", stuck_check)
        stuck = threading.Thread(target=client._request, args=("GET", "/v1"), name="stuck")
        stuck.start()
        assert checking.wait(5)
        # then another thread's request takes the other idle connection and goes back idle meanwhile
        answered = threading.Event()
        threading.Thread(target=lambda: (client._request("GET", "/v1"), answered.set()), daemon=True).start()
        try:
            assert answered.wait(2), "a request waited for another thread's check of an idle connection"
        finally:
            release.set()
            stuck.join()
    assert server.connections == 2


def test_close_closes_the_idle_connections(server: ScriptedServer) -> None:
    client = orbit_sdk.Client(server.url, "tok")
    client._request("GET", "/v1")
    client.close()
    deadline = time.monotonic() + 2
    while server.closed_by_client < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.closed_by_client == 1


def test_a_proxy_in_the_environment_keeps_httpx_s_own_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    with orbit_sdk.Client("https://orbit.example", "tok") as client:
        assert not isinstance(client._http._transport, KeepAliveTransport)
        assert client._http._mounts  # httpx routes through the proxy


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_https_verifies_the_server_certificate(certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = certificate
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    tls = ScriptedServer(tls=context)
    try:
        with orbit_sdk.Client(tls.url, "tok") as client:
            with pytest.raises(orbit_sdk.TransportError, match="CERTIFICATE_VERIFY_FAILED"):
                client._request("GET", "/v1")
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trusted the way httpx trusts a bundle
        with orbit_sdk.Client(tls.url, "tok") as client:
            assert client._request("GET", "/v1") == {"ok": True}
            assert client._request("GET", "/v1") == {"ok": True}
        assert tls.requests[-1][0] == "GET /v1"
    finally:
        tls.close()


def test_an_answer_is_an_httpx_response_with_its_request() -> None:
    transport = KeepAliveTransport()
    scripted = ScriptedServer()
    try:
        with httpx.Client(transport=transport) as client:
            response = client.get(f"{scripted.url}/v1")
        assert response.status_code == 200
        assert response.http_version == "HTTP/1.1" and response.reason_phrase == "OK"
        assert response.headers["x-request-id"] == "r-1"
        assert response.request.url == f"{scripted.url}/v1"
        assert response.json() == {"data": {"ok": True}, "request_id": "r-1"}
    finally:
        scripted.close()
