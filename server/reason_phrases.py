"""Standard reason phrases on every HTTP status line.

Daphne hands the ASGI status to Twisted's Request.setResponseCode without a
message, and Twisted looks the phrase up in twisted.web.http.RESPONSES,
which lacks 429 (and 422, 428, 431, 451, ...): a 429 QUEUE_FULL went out
as "429 Unknown Status", and a few others with Twisted's own spellings
("Request Time-out", "Reset Content."). install() puts the standard library's
phrases (http.HTTPStatus, the IANA registry's) into that table, the one
place daphne's answers get theirs, and keeps Twisted's for a code the
standard library does not know."""

from __future__ import annotations

from http import HTTPStatus


def install() -> None:
    """Idempotent; call before serving (server.serving.tune_twisted)."""
    from twisted.web import http

    for status in HTTPStatus:
        http.RESPONSES[status.value] = status.phrase.encode("ascii")
