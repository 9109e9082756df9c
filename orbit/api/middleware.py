from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse

from orbit.fields import new_id


class RequestIdMiddleware:
    """Gives every request a 32-hex id, echoed in X-Request-Id and the envelope.

    Sync and async capable, so an all-async chain runs without a thread hop."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> HttpResponse | Awaitable[HttpResponse]:
        if self.is_async:
            return self._acall(request)
        request.orbit_request_id = new_id()  # type: ignore[attr-defined]
        response = self.get_response(request)
        response["X-Request-Id"] = request.orbit_request_id  # type: ignore[attr-defined]
        return response

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        request.orbit_request_id = new_id()  # type: ignore[attr-defined]
        response = await self.get_response(request)
        response["X-Request-Id"] = request.orbit_request_id  # type: ignore[attr-defined]
        # What SecurityMiddleware and CommonMiddleware add, for the API chain
        # that runs without them (orbit/api/handler.py).
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        if not response.streaming and "Content-Length" not in response:
            response["Content-Length"] = str(len(response.content))
        return response


def request_id_of(request: HttpRequest) -> str:
    request_id = getattr(request, "orbit_request_id", None)
    if request_id is None:
        request_id = new_id()
        request.orbit_request_id = request_id  # type: ignore[attr-defined]
    return request_id
