"""The ASGI handler for /v1/: Django's, minus what an API request pays for nothing.

Under ASGI, Django runs every sync piece of a request (each MiddlewareMixin's
process_request/process_response, the sync receivers of request_started and
request_finished) through sync_to_async on a thread made for that request.
At a few hundred requests a second those thread starts and hops were the
largest cost on the event loop, which every request and worker frame shares.
The API needs none of them: its views run on the database pool with their own
connections (orbit/api/pooled.py), it has no sessions, users, messages or
CSRF, and its only middleware is async. So /v1/ gets a handler with the API's
middleware chain, no per-request thread context, and no sync signal
receivers; everything else (the admin) keeps Django's full handler."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.cache import close_caches
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, reset_queries

API_MIDDLEWARE = ["orbit.api.middleware.RequestIdMiddleware"]
API_PREFIX = "/v1/"

# Django's sync receivers of the request signals, connected for every sender;
# re-connected below for Django's own handlers only.
_REQUEST_RECEIVERS = (
    (request_started, reset_queries),
    (request_started, close_old_connections),
    (request_finished, close_old_connections),
    (request_finished, close_caches),
)


def _keep_request_receivers_off_the_api() -> None:
    for signal, receiver in _REQUEST_RECEIVERS:
        signal.disconnect(receiver)
        for handler in (ASGIHandler, WSGIHandler):
            signal.connect(receiver, sender=handler)


class ApiHandler(ASGIHandler):
    def __init__(self) -> None:
        _keep_request_receivers_off_the_api()
        super().__init__()

    def load_middleware(self, is_async: bool = False) -> None:
        # BaseHandler builds its chain from settings.MIDDLEWARE; lend it the
        # API's list for the build (at startup, before any request).
        full = settings.MIDDLEWARE
        settings.MIDDLEWARE = API_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = full

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        # No ThreadSensitiveContext: it would start a thread per request for
        # the one sync call left (response.close), which can share Django's
        # single sync thread instead.
        await self.handle(scope, receive, send)


def split_http(api: Any, other: Any) -> Any:
    """An ASGI app sending /v1/ to `api` and every other path to `other`."""

    async def route(scope: dict[str, Any], receive: Any, send: Any) -> None:
        app = api if scope.get("path", "").startswith(API_PREFIX) else other
        await app(scope, receive, send)

    return route
