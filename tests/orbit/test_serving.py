"""orbit.serving: the Content-Type fast path gives Twisted the answer its own
parser gives; a connection is asked once whether it is secure; Twisted
formats no access line of its own beside daphne's; orbit.serve puts daphne
on uvloop."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from daphne.http_protocol import HTTPFactory
from twisted.internet.interfaces import ISSLTransport
from twisted.internet.testing import StringTransport
from twisted.web import http
from zope.interface import directlyProvides

from orbit.serving import fast_content_type, secure_once, tune_twisted

ROOT = Path(__file__).resolve().parents[2]
ORIGINAL = getattr(http._parseContentType, "__wrapped__", http._parseContentType)

HEADERS = [
    b"application/json",
    b"Application/JSON",
    b"application/json; charset=utf-8",
    b"application/json;charset=UTF-8",
    b"  application/json  ",
    b"application/x-www-form-urlencoded",
    b"APPLICATION/X-WWW-FORM-URLENCODED; charset=latin-1",
    b"multipart/form-data; boundary=----abc",
    b'multipart/form-data;boundary="quoted; boundary"',
    b"text/plain",
    b"application/vnd.api+json",
    b"application/problem+json; q=0.5",
    b"",
    b"json",
    b"application/",
    b"/json",
    b"application /json",
    b"application/json (comment)",
    b"application/json, text/plain",
    b"\xe9/\xe9",
    b'application/json; charset="unterminated',
]


@pytest.mark.parametrize("header", HEADERS)
def test_fast_path_agrees_with_twisted(header: bytes) -> None:
    assert fast_content_type(ORIGINAL)(header) == ORIGINAL(header)


def test_tuning_installs_once_and_keeps_the_original_behind_it() -> None:
    tune_twisted()
    tune_twisted()
    assert http._parseContentType.__wrapped__ is ORIGINAL
    assert http._parseContentType(b"Application/Json; charset=utf-8") == b"application/json"


class TLSTransport(StringTransport):
    def setTcpNoDelay(self, enabled: bool) -> None:
        pass


def channel_over(tls: bool = False) -> http.HTTPChannel:
    transport = TLSTransport() if tls else StringTransport()
    if tls:
        directlyProvides(transport, ISSLTransport)
    channel = http.HTTPChannel()
    channel.makeConnection(transport)
    return channel


@pytest.mark.parametrize("over_tls", [False, True])
def test_secure_transport_is_asked_once_per_connection(over_tls: bool) -> None:
    tune_twisted()
    original = http.HTTPChannel.isSecure.__wrapped__
    asked: list[http.HTTPChannel] = []
    counting = secure_once(lambda channel: asked.append(channel) or original(channel))
    channel, other = channel_over(over_tls), channel_over()
    assert [counting(channel), counting(channel), counting(other)] == [over_tls, over_tls, False]
    assert asked == [channel, other]
    assert http.HTTPChannel.isSecure(channel_over(over_tls)) is over_tls  # the installed one


def test_daphne_keeps_the_access_log_and_twisted_formats_none() -> None:
    tune_twisted()
    factory = HTTPFactory.__new__(HTTPFactory)
    http.HTTPFactory.__init__(factory)
    factory._logFile = io.StringIO()
    request = http.Request(channel_over())
    request.method, request.uri, request.clientproto, request.code = b"POST", b"/v1/tasks", b"HTTP/1.1", 201
    factory.log(request)
    assert factory._logFile.getvalue() == ""
    plain = http.HTTPFactory()  # Twisted's own factory is untouched
    plain._logFile = io.StringIO()
    plain.log(request)
    assert '"POST /v1/tasks HTTP/1.1" 201' in plain._logFile.getvalue()


def test_orbit_serve_runs_daphne_on_uvloop() -> None:
    """daphne makes its event loop when imported: orbit.serve must set the policy first."""
    probe = "import orbit.serve, daphne.server as s; print(type(s.twisted_loop).__module__)"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert found.stdout.strip().startswith("uvloop")
