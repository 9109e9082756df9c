from __future__ import annotations

from typing import Any

from rest_framework.metadata import SimpleMetadata
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
