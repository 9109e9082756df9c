"""Tuning of the serving stack (daphne on Twisted) that Orbit's own code cannot reach.

Content-Type: Twisted parses the Content-Type of every request with a body through the
standard library's email package, only to decide whether to decode an HTML
form into `request.args`. Daphne never reads `request.args` (it hands the raw
body to the ASGI application), yet that parse cost ~13% of the event loop's
time under a stream of single submits. Plain `type/subtype` values, which is
what every JSON client sends, are read directly; anything else still goes
through Twisted's own parser.

Access log: Twisted's HTTPFactory formats a combined-log line for every
request and hands it to Twisted's log, which daphne sends nowhere (at its
default verbosity; above it, beside daphne's own line). Daphne writes the
access log itself (its --access-log, stdout by default): Twisted's line is
not formatted at all.

Secure transport: daphne asks whether each request came over TLS, which
Twisted answers by adapting the connection's transport to ISSLTransport
each time; a connection's transport is fixed once it is made, so the answer
is kept on the connection."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_PLAIN_MEDIA_TYPE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+/[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def fast_content_type(parse: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
    """`parse` (Twisted's Content-Type parser) with a fast path for plain values:
    the lowercased `type/subtype`, as the email package returns it."""

    def parsed(line: bytes) -> bytes:
        media = line.split(b";", 1)[0].strip(b" \t")
        if _PLAIN_MEDIA_TYPE.fullmatch(media):
            return media.lower()
        return parse(line)

    parsed.__wrapped__ = parse  # type: ignore[attr-defined]
    return parsed


def secure_once(is_secure: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """HTTPChannel.isSecure (`is_secure`), asked once per connection."""

    def secure(channel: Any) -> bool:
        known = channel.__dict__.get("_orbit_secure")
        if known is None:
            known = channel._orbit_secure = is_secure(channel)
        return known

    secure.__wrapped__ = is_secure  # type: ignore[attr-defined]
    return secure


def _no_twisted_access_line(factory: Any, request: Any) -> None:
    """Daphne writes the access log; Twisted's own line would be dropped."""


def tune_twisted() -> None:
    from daphne.http_protocol import HTTPFactory
    from twisted.web import http

    if not hasattr(http._parseContentType, "__wrapped__"):
        http._parseContentType = fast_content_type(http._parseContentType)
    if not hasattr(http.HTTPChannel.isSecure, "__wrapped__"):
        http.HTTPChannel.isSecure = secure_once(http.HTTPChannel.isSecure)
    HTTPFactory.log = _no_twisted_access_line
