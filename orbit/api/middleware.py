from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from orbit.fields import new_id


class RequestIdMiddleware:
    """Gives every request a 32-hex id, echoed in X-Request-Id and the envelope."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        request.orbit_request_id = new_id()  # type: ignore[attr-defined]
        response = self.get_response(request)
        response["X-Request-Id"] = request.orbit_request_id  # type: ignore[attr-defined]
        return response


def request_id_of(request: HttpRequest) -> str:
    request_id = getattr(request, "orbit_request_id", None)
    if request_id is None:
        request_id = new_id()
        request.orbit_request_id = request_id  # type: ignore[attr-defined]
    return request_id
