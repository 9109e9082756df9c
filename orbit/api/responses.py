from __future__ import annotations

from typing import Any

from rest_framework.metadata import SimpleMetadata
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api.middleware import request_id_of


def ok(request: Request, data: Any, status: int = 200) -> Response:
    return Response({"request_id": request_id_of(request._request), "data": data}, status=status)


def page(items: list[Any], next_page_token: str) -> dict[str, Any]:
    return {"items": items, "next_page_token": next_page_token}


class EnvelopedMetadata(SimpleMetadata):
    """OPTIONS answers in the success envelope, like every other answer: DRF's
    description of the endpoint (name, renders, parses) is its `data`."""

    def determine_metadata(self, request: Request, view: Any) -> dict[str, Any]:
        return {"request_id": request_id_of(request._request), "data": super().determine_metadata(request, view)}


class JSONWhateverAccepted(DefaultContentNegotiation):
    """Every answer is the view's first renderer (JSON), whatever Accept or
    ?format= asks for: a browser's `Accept: text/html` gets the JSON answer,
    not a 406 the API's error codes do not have."""

    # DRF passes the view's list of renderers; the stubs say any Iterable.
    def select_renderer(  # type: ignore[override]
        self, request: Request, renderers: list[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        return renderers[0], renderers[0].media_type
