"""OpenAPI (drf-spectacular) for the v1 API: the bearer credential and the
request bodies. Responses are the envelope `{"request_id", "data"}` (or
`{"request_id", "error"}`) described in README and SPEC; they are documented as
objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drf_spectacular.extensions import (
    OpenApiAuthenticationExtension,
    OpenApiSerializerExtension,
    OpenApiSerializerFieldExtension,
)
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from drf_spectacular.views import SpectacularJSONAPIView
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response


class BearerCredential(OpenApiAuthenticationExtension):
    target_class = "orbit.api.auth.BearerTokenAuthentication"
    name = "bearer"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "orb_<credential id>_<secret>"}


class StrictChoices(OpenApiSerializerFieldExtension):
    """A StrictChoiceField is a string enum (it subclasses CharField, which
    drf-spectacular would document as any string)."""

    target_class = "orbit.api.fields.StrictChoiceField"

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        return {"type": "string", "enum": list(self.target.values)}


class ClosedBodies(OpenApiSerializerExtension):
    """Request bodies refuse fields they do not name (400): the schema says so."""

    target_class = "orbit.api.fields.StrictSerializer"
    match_subclasses = True

    def map_serializer(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        schema = auto_schema._map_basic_serializer(self.target, direction)
        return {**schema, "additionalProperties": False}


PAGE_SIZE = OpenApiParameter("page_size", int, OpenApiParameter.QUERY, description="1 to 500, default 100")
PAGE_PARAMETERS = (
    PAGE_SIZE,
    OpenApiParameter("page_token", str, OpenApiParameter.QUERY, description="next_page_token of the previous page"),
)
IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    str,
    OpenApiParameter.HEADER,
    required=True,
    description="1 to 255 printable ASCII characters; the same key and body replay the first answer",
)


def documented(
    request: type | None = None,
    *,
    operation_id: str | None = None,
    created: bool = False,
    idempotent: bool = False,
    filters: tuple[str, ...] = (),
    paged: bool = False,
    extra_parameters: tuple[OpenApiParameter, ...] = (),
) -> Callable[[Any], Any]:
    """A view method's OpenAPI entry: its request body serializer, envelope
    responses (201 and the replay's 200 for a create), its query parameters
    and the Idempotency-Key header of a mutating call."""
    responses = {201: OpenApiTypes.OBJECT, 200: OpenApiTypes.OBJECT} if created else OpenApiTypes.OBJECT
    parameters = [OpenApiParameter(name, str, OpenApiParameter.QUERY, description="exact match") for name in filters]
    parameters += [*PAGE_PARAMETERS] if paged else []
    parameters += [IDEMPOTENCY_KEY] if idempotent else []
    parameters += extra_parameters
    return extend_schema(request=request, responses=responses, operation_id=operation_id, parameters=parameters)


class OpenApiDocumentView(SpectacularJSONAPIView):
    """`GET /v1/openapi.json`: the document as JSON whatever Accept says (the
    default view answers YAML to `Accept: */*`), and its errors as
    application/json like every other error of the API."""

    def finalize_response(self, request: Request, response: Response, *args: Any, **kwargs: Any) -> Response:
        if response.status_code >= 400:
            request.accepted_renderer = JSONRenderer()
            request.accepted_media_type = JSONRenderer.media_type
        return super().finalize_response(request, response, *args, **kwargs)
