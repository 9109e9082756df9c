"""Runs the API's sync views on the database pool (orbit/db/pool.py).

Under ASGI Django gives each request a thread of its own, and with it a new
MySQL connection (CONN_MAX_AGE must be 0 there, or connections strand with
their threads). Running the view on the fixed pool instead reuses one
persistent connection per pool thread: no connect, no session setup per
request. The DRF response is rendered on the pool thread too, so Django has
nothing left to do in a thread of its own."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import RequestDataTooBig
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, JsonResponse

from orbit.api.errors import COMPACT_JSON, error_response_for
from orbit.db import inline
from orbit.db.pool import run_db
from orbit.errors import Unavailable
from orbit.principal import enter_cell_of_header


def _render(view: Callable[..., Any], request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
    response = view(request, *args, **kwargs)
    if hasattr(response, "render"):
        response.render()
        plain = HttpResponse(response.content, status=response.status_code)
        for header, value in response.items():
            plain[header] = value
        return plain
    return response


def pooled(view: Callable[..., Any]) -> Callable[..., Any]:
    # wraps() keeps the DRF view's attributes (cls, initkwargs): the OpenAPI
    # generator finds the API's views through them.
    @functools.wraps(view)
    async def pooled_view(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        # Read the body now: if the client hangs up while the view waits for a
        # pool thread, the request's body file is closed by then.
        try:
            _ = request.body
        except RequestDataTooBig as exc:
            status, body, headers = error_response_for(request, exc)
            return JsonResponse(body, status=status, headers=headers, json_dumps_params=COMPACT_JSON)
        if inline():
            # Tests that share the test case's transaction must stay on its connection.
            return await sync_to_async(_render, thread_sensitive=True)(view, request, *args, **kwargs)
        try:
            await enter_cell_of_header(request.headers.get("Authorization"))
            return await run_db(_render, view, request, *args, **kwargs)
        # The request deadline passed waiting for the pool, or, with cells, the
        # directory could not be read for an unseen credential's cell (the
        # database down: 503 UNAVAILABLE, as from the view itself).
        except (Unavailable, DatabaseError) as exc:
            status, body, headers = error_response_for(request, exc)
            return JsonResponse(body, status=status, headers=headers, json_dumps_params=COMPACT_JSON)

    pooled_view.csrf_exempt = True  # type: ignore[attr-defined]
    return pooled_view
