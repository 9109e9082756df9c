"""OpenAPI (drf-spectacular) for the v1 API: the bearer credential and the
request bodies. Responses are the envelope `{"request_id", "data"}` (or
`{"request_id", "error"}`) described in README and SPEC; they are documented as
objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema


class BearerCredential(OpenApiAuthenticationExtension):
    target_class = "orbit.api.auth.BearerTokenAuthentication"
    name = "bearer"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "orb_<credential id>_<secret>"}


def documented(request: type | None = None, *, operation_id: str | None = None) -> Callable[[Any], Any]:
    """A view method's OpenAPI entry: its request body serializer, an envelope response."""
    return extend_schema(request=request, responses=OpenApiTypes.OBJECT, operation_id=operation_id)
