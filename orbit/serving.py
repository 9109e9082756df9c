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
is kept on the connection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def without_form_decoding(init: Callable[..., None]) -> Callable[..., None]:
    """A Request's __init__ (`init`) that turns Twisted's form decoding off."""

    def made(request: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parsePOSTFormSubmission", False)
        init(request, *args, **kwargs)

    made.__wrapped__ = init  # type: ignore[attr-defined]
    return made


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
    from daphne.http_protocol import HTTPFactory, WebRequest
    from twisted.web import http

    if not hasattr(WebRequest.__init__, "__wrapped__"):
        WebRequest.__init__ = without_form_decoding(WebRequest.__init__)
    if not hasattr(http.HTTPChannel.isSecure, "__wrapped__"):
        http.HTTPChannel.isSecure = secure_once(http.HTTPChannel.isSecure)
    HTTPFactory.log = _no_twisted_access_line
