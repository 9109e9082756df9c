"""server.serving: daphne's requests leave their bodies undecoded; a
connection is asked once whether it is secure; Twisted formats no access line
of its own beside daphne's; orbit.serve puts daphne on uvloop."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from daphne.http_protocol import HTTPFactory, WebRequest
from twisted.internet.interfaces import ISSLTransport
from twisted.internet.testing import StringTransport
from twisted.web import http
from zope.interface import directlyProvides

from server.serving import (
    SMALL_FRAME_BYTES,
    SmallFrameMasker,
    formatted_if_written,
    host_once,
    secure_once,
    tune_autobahn,
    tune_twisted,
)

ROOT = Path(__file__).resolve().parents[2]
ORIGINAL_INIT = getattr(WebRequest.__init__, "__wrapped__", WebRequest.__init__)


def test_tuning_installs_once_and_daphnes_requests_decode_no_form() -> None:
    tune_twisted()
    tune_twisted()
    assert WebRequest.__init__.__wrapped__ is ORIGINAL_INIT
    assert getattr(ORIGINAL_INIT, "__wrapped__", None) is None
    channel = channel_over()
    channel.factory = SimpleNamespace(server=SimpleNamespace(protocol_connected=lambda request: None))
    assert WebRequest(channel)._parsePOSTFormSubmission is False
    assert http.Request(channel)._parsePOSTFormSubmission is True  # Twisted's own default is left alone


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


def test_local_address_is_asked_once_per_connection() -> None:
    tune_twisted()
    original = http.HTTPChannel.getHost.__wrapped__
    asked: list[http.HTTPChannel] = []
    counting = host_once(lambda channel: asked.append(channel) or original(channel))
    channel, other = channel_over(), channel_over()
    assert counting(channel) == counting(channel) == channel.transport.getHost()
    assert counting(other) == other.transport.getHost()
    assert asked == [channel, other]
    installed = channel_over()
    assert http.HTTPChannel.getHost(installed) == installed.transport.getHost()  # the installed one
    assert http.Request(installed).getHost() == installed.transport.getHost()  # what each request asks


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


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 127, 128, 1000, 4096])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_a_small_frame_is_unmasked_as_autobahns_own_masker_unmasks_it(size: int, chunks: int) -> None:
    from autobahn.websocket import protocol, xormasker

    tune_autobahn()
    tune_autobahn()
    assert protocol.create_xor_masker.__wrapped__ is xormasker.create_xor_masker
    key, payload = os.urandom(4), os.urandom(size)
    cuts = sorted(random.Random(size * 7 + chunks).sample(range(size + 1), chunks - 1)) if size else [0] * (chunks - 1)
    pieces = [payload[start:end] for start, end in zip([0, *cuts], [*cuts, size], strict=True)]
    ours, theirs = protocol.create_xor_masker(key, size), xormasker.create_xor_masker(key, size)
    if size <= SMALL_FRAME_BYTES:
        assert isinstance(ours, SmallFrameMasker)
    assert [ours.process(piece) for piece in pieces] == [theirs.process(piece) for piece in pieces]
    assert ours.pointer() == theirs.pointer() == size
    ours.reset()
    assert ours.pointer() == 0 and ours.process(payload) == xormasker.create_xor_masker(key, size).process(payload)


def test_a_large_frame_keeps_autobahns_masker() -> None:
    from autobahn.websocket import protocol

    tune_autobahn()
    key, payload = os.urandom(4), os.urandom(SMALL_FRAME_BYTES + 1)
    masker = protocol.create_xor_masker(key, len(payload))
    assert not isinstance(masker, SmallFrameMasker)
    assert SmallFrameMasker(key).process(payload) == masker.process(payload)


def test_autobahns_log_arguments_are_formatted_only_when_a_line_is_written() -> None:
    from autobahn import util
    from autobahn.twisted import websocket as twisted_websocket
    from autobahn.websocket import protocol

    tune_autobahn()
    for module in (protocol, twisted_websocket):
        assert module.hltype.__wrapped__ is util.hltype and module.hlval.__wrapped__ is util.hlval
    formatted: list[object] = []
    deferred = formatted_if_written(lambda value, **options: formatted.append(value) or f"<{value}:{options}>")
    argument = deferred(7, color="blue")
    assert formatted == []
    assert f"{argument}" == "<7:{'color': 'blue'}>" == str(argument)
    assert f"{argument:>20}" == "<7:{'color': 'blue'}>".rjust(20)
    assert formatted == [7, 7, 7]
    line = f"{protocol.hltype(protocol.WebSocketProtocol.sendData)} sent {protocol.hlval(3)} bytes"
    assert "WebSocketProtocol.sendData" in line and "3" in line  # as autobahn's own, when written
