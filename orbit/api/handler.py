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
receivers; everything else (the admin) keeps Django's full handler.

A request may also have a route of its own (ApiHandler(routes=...)), which
answers it from the ASGI scope and body without Django's request and response
objects, or declines it to this handler (tasks/submit_route.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

from django.conf import settings
from django.core.cache import close_caches
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, reset_queries
from django.http.response import HttpResponseBase
from django.urls import set_script_prefix

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


# An answer: status, headers, body.
HttpAnswer = tuple[int, list[tuple[bytes, bytes]], bytes]
# Answers a request from its scope and body, or declines it (None) to the full handler.
Route = Callable[[dict[str, Any], bytes], Awaitable[HttpAnswer | None]]


class ApiHandler(ASGIHandler):
    def __init__(self, routes: dict[tuple[str, str], Route] | None = None) -> None:
        """`routes`, by (method, path): requests answered without Django's
        request/response machinery when their route takes them."""
        _keep_request_receivers_off_the_api()
        super().__init__()
        self.routes = routes or {}

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
        # No ThreadSensitiveContext: it would start a thread per request.
        await self.handle(scope, receive, send)

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """ASGIHandler.handle without its two per-request costs that buy the
        API nothing. Django races the view against a task listening for a
        client disconnect, to cancel the view: API views run on the database
        pool (orbit/api/pooled.py), where a cancel cannot stop a view once
        started, and a request that arrived whole is answered whole (its
        Idempotency-Key makes the client's retry safe either way). And Django
        closes the response on its sync thread, for the request_finished
        receivers: none that does I/O is connected for this handler (see
        above), and the response is in memory, so it is closed here."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        # Every wait for the database inside is bounded by the request deadline
        # (orbit.db.pool.within_deadline: the pool and the rounds), so a
        # database that stopped answering gets a 503, not a hung request; a
        # deadline around the whole request measured 5-10 % of W1 by itself.
        answer = await self.answer(scope, body_file)
        if isinstance(answer, tuple):
            body_file.close()
            status, headers, body = answer
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            await self.send_response(answer, send)
        finally:
            answer.close()
            body_file.close()

    async def answer(self, scope: dict[str, Any], body_file: Any) -> HttpAnswer | HttpResponseBase:
        route = self.routes.get((scope["method"], scope["path"]))
        if route is not None:
            answer = await route(scope, body_file.read())
            if answer is not None:
                return answer
            body_file.seek(0)
        set_script_prefix(get_script_prefix(scope))
        if request_started.has_listeners(type(self)):  # none of Django's own (see above)
            await request_started.asend(sender=type(self), scope=scope)
        request, error_response = self.create_request(scope, body_file)
        # Django's create_request gives a response exactly when it could build no request.
        return cast(HttpResponseBase, error_response) if request is None else await self.run_get_response(request)


def split_http(api: Any, other: Any) -> Any:
    """An ASGI app sending /v1/ to `api` and every other path to `other`."""

    async def route(scope: dict[str, Any], receive: Any, send: Any) -> None:
        app = api if scope.get("path", "").startswith(API_PREFIX) else other
        await app(scope, receive, send)

    return route
