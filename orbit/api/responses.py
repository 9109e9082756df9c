from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api.middleware import request_id_of


def ok(request: Request, data: Any, status: int = 200) -> Response:
    return Response({"request_id": request_id_of(request._request), "data": data}, status=status)


def page(items: list[Any], next_page_token: str) -> dict[str, Any]:
    return {"items": items, "next_page_token": next_page_token}
