"""Tuning of the serving stack (daphne on Twisted) that Orbit's own code cannot reach.

Twisted parses the Content-Type of every request with a body through the
standard library's email package, only to decide whether to decode an HTML
form into `request.args`. Daphne never reads `request.args` (it hands the raw
body to the ASGI application), yet that parse cost ~13% of the event loop's
time under a stream of single submits. Plain `type/subtype` values, which is
what every JSON client sends, are read directly; anything else still goes
through Twisted's own parser."""

from __future__ import annotations

import re
from collections.abc import Callable

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


def tune_twisted() -> None:
    from twisted.web import http

    if not hasattr(http._parseContentType, "__wrapped__"):
        http._parseContentType = fast_content_type(http._parseContentType)
