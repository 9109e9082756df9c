"""OpenAPI (drf-spectacular) for the v1 API: the exact contract.

Request bodies come from the serializers the views validate with; the
extensions below state in JSON Schema what each strict field checks (its
pattern, range, format) and the rules between fields (one of two schedule
forms, the misfire window, deadline_at or timeout_seconds), from the
fields' own constants. Answers are the envelopes and objects of
orbit.api.openapi_objects, with every error status an operation can answer.
What is an app's (its objects, its fields, its body rules) the app registers
from its AppConfig.ready() (orbit.api.openapi_registry): this module is the
generic machinery and names no app.
The document is served without a credential (it holds no data), from
`GET /v1/openapi.json`, and generated once per process."""

from __future__ import annotations

import copy
import inspect
import json
import re
import threading
from collections.abc import Callable
from typing import Any

from drf_spectacular.extensions import (
    OpenApiAuthenticationExtension,
    OpenApiSerializerExtension,
    OpenApiSerializerFieldExtension,
)
from drf_spectacular.plumbing import ResolvedComponent
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from drf_spectacular.views import SpectacularJSONAPIView
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api import openapi_objects as shapes
from orbit.api.fields import NAME_PATTERN
from orbit.api.openapi_registry import BODY_RULES, FIELD_SCHEMAS, QUERY_FILTERS, REFERENCED_SERIALIZERS, BodyRule
from orbit.api.views import MAX_PAGE_SIZE
from orbit.fields import UINT64_MAX

DOCUMENT_SETTINGS = {
    "DESCRIPTION": (
        "Orbit's HTTP API (v1). Every request but this document's carries `Authorization: Bearer "
        "<token>`; every mutating POST an `Idempotency-Key` (`tasks:batch` takes one in each item "
        "instead). Success is `{request_id, data}`, failure "
        "`{request_id, error: {code, message}}`, both with `X-Request-Id`. Workers use the WebSocket "
        f"protocol at `/v1/workers/connect`, described in [{shapes.PROTOCOL_DOC}]"
        f"(https://github.com/orbit/orbit/blob/main/{shapes.PROTOCOL_DOC}) ({shapes.PROTOCOL_DOC} in "
        "the repository)."
    ),
}


class BearerCredential(OpenApiAuthenticationExtension):
    target_class = "orbit.api.auth.BearerTokenAuthentication"
    name = "bearer"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "orb_<credential id>_<secret>"}


# --------------------------------------------------------------------------- fields


def base_field_schema(auto_schema: Any, field: Any, direction: Any) -> dict[str, Any]:
    """What drf-spectacular makes of the field (type, lengths, bounds)."""
    return auto_schema._map_serializer_field(field, direction, bypass_extensions=True)


# Django's CharField refuses NUL (ProhibitNullCharactersValidator) in every string field.
NO_NUL = "^[^\\u0000]*$"


class StrictChoices(OpenApiSerializerFieldExtension):
    """A StrictChoiceField is a string enum (it subclasses CharField, which
    drf-spectacular would document as any string)."""

    target_class = "orbit.api.fields.StrictChoiceField"

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        return {"type": "string", "enum": list(self.target.values)}


class StrictStrings(OpenApiSerializerFieldExtension):
    target_class = "orbit.api.fields.StrictCharField"

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        return {**base_field_schema(auto_schema, self.target, direction), "pattern": NO_NUL}


class Names(OpenApiSerializerFieldExtension):
    target_class = "orbit.api.fields.NameField"

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        return {**base_field_schema(auto_schema, self.target, direction), "pattern": f"^{NAME_PATTERN.pattern}$"}


class Reasons(OpenApiSerializerFieldExtension):
    """Non-blank: at least one character that is neither whitespace (what
    str.strip() removes) nor NUL."""

    target_class = "orbit.api.fields.ReasonField"

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        schema = base_field_schema(auto_schema, self.target, direction)
        return {
            **schema,
            "minLength": 1,
            "pattern": "^[^\\u0000]*[^\\u0000\\s][^\\u0000]*$",
            "description": "not blank (not only whitespace); goes to the audit row",
        }


class Uint64Strings(OpenApiSerializerFieldExtension):
    target_class = "orbit.api.fields.Uint64StringField"

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        return dict(shapes.REVISION if self.target.nonzero else shapes.UINT64_STRING)


# --------------------------------------------------------------------------- bodies


def exclusive(first: str, second: str) -> BodyRule:
    """A body rule: the two fields are not both given."""

    def rule(auto_schema: Any, schema: dict[str, Any]) -> dict[str, Any]:
        if first not in schema["properties"] or second not in schema["properties"]:
            return schema  # a subclass that drops one of them
        return {**schema, "not": {"required": [first, second]}}

    return rule


class ClosedBodies(OpenApiSerializerExtension):
    """Request bodies refuse fields they do not name (400): the schema says
    so, with the serializer's own rules between fields and the schemas of
    the fields registered by class (orbit.api.openapi_registry)."""

    target_class = "orbit.api.fields.StrictSerializer"
    match_subclasses = True

    def map_serializer(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        schema = {**auto_schema._map_basic_serializer(self.target, direction), "additionalProperties": False}
        for name, field in self.target.fields.items():
            for field_class, field_schema in FIELD_SCHEMAS.items():
                if isinstance(field, field_class):
                    schema["properties"][name] = field_schema()
        for spec in schema["properties"].values():
            _default_in_words(spec)
            _blank_in_one_branch(spec)
        rule = BODY_RULES.get(type(self.target).__name__)
        return rule(auto_schema, schema) if rule else schema


# What drf-spectacular adds beside the schema of a string field that may be blank.
_BLANK = {"type": "string", "maxLength": 0}


def _blank_in_one_branch(spec: dict[str, Any]) -> None:
    """A field that may be blank as one schema. drf-spectacular documents it as
    `oneOf: [its schema, maxLength 0]`, and where its pattern takes "" too, ""
    matches both branches: invalid under `oneOf`, so a validating client
    refused the `concurrency_key: ""` the server takes."""
    branches = spec.get("oneOf")
    if not branches or len(branches) != 2 or branches[1] != _BLANK:
        return
    inner = branches[0]
    try:
        takes_blank = re.search(inner.get("pattern", ""), "") is not None and inner.get("minLength", 0) == 0
    except re.error:  # an ECMA-only construct: not ours to judge
        takes_blank = False
    if not takes_blank:
        spec["anyOf"] = spec.pop("oneOf")  # "" only through the second branch: either will do
        return
    del spec["oneOf"]
    spec.update(inner)


def _default_in_words(spec: dict[str, Any]) -> None:
    """An optional request field's default, said in its description instead of
    `default`: openapi-typescript (default settings) declares every property
    with a `default` required, so a TypeScript caller could not leave out
    `priority` or `retry.multiplier`, which the server fills in."""
    if "default" not in spec:
        return
    default = spec.pop("default")
    said = f"default {json.dumps(default)}"
    spec["description"] = f"{spec['description']} ({said})" if spec.get("description") else said


# --------------------------------------------------------------------------- answers


class Documented(serializers.Serializer):
    """Stands for a registered component (orbit.api.openapi_registry)
    wherever drf-spectacular takes a serializer."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component


def _component_schema(name: str) -> dict[str, Any]:
    # A copy: drf-spectacular's enum hook rewrites the document's schemas in place.
    return copy.deepcopy(shapes.component(name))


def _register_references(auto_schema: Any, schema: dict[str, Any]) -> None:
    """Registers every registered component that `schema` reaches; the
    serializers' components it names are resolved from the serializers."""
    pending = list(shapes.references(schema))
    while pending:
        name = pending.pop()
        if name in REFERENCED_SERIALIZERS:
            auto_schema.resolve_serializer(REFERENCED_SERIALIZERS[name], "request")
            continue
        component = ResolvedComponent(name=name, type=ResolvedComponent.SCHEMA, object=name)
        if component in auto_schema.registry:
            continue
        component.schema = _component_schema(name)
        auto_schema.registry.register_on_missing(component)
        pending.extend(shapes.references(component.schema))


class DocumentedShapes(OpenApiSerializerExtension):
    target_class = "orbit.api.schema.Documented"

    def get_name(self, auto_schema: Any, direction: Any) -> str:
        return self.target.component

    def get_identity(self, auto_schema: Any, direction: Any) -> Any:
        return self.target.component

    def map_serializer(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        schema = _component_schema(self.target.component)
        _register_references(auto_schema, schema)
        return schema


PAGE_SIZE = OpenApiParameter(
    "page_size",
    {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_SIZE},
    OpenApiParameter.QUERY,
    description=f"1 to {MAX_PAGE_SIZE}, default 100",
)
PAGE_PARAMETERS = (
    PAGE_SIZE,
    OpenApiParameter("page_token", str, OpenApiParameter.QUERY, description="next_page_token of the previous page"),
)
IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    {
        **shapes.IDEMPOTENCY_KEY,
        # HTTP drops the spaces around a header's value, so a key sent as a
        # header cannot start or end with one.
        "pattern": "^[\\x21-\\x7e](?:[\\x20-\\x7e]*[\\x21-\\x7e])?$",
        "description": "1 to 255 printable ASCII characters, no space at either end",
    },
    OpenApiParameter.HEADER,
    required=True,
    description="1 to 255 printable ASCII characters, no space at either end; the same key and body "
    "replay the first answer (200, deduplicated: true), another body is 409 IDEMPOTENCY_CONFLICT",
)
REQUEST_ID_HEADER = OpenApiParameter(
    "X-Request-Id",
    {"type": "string", "pattern": "^[0-9a-f]{32}$"},
    OpenApiParameter.HEADER,
    required=True,
    response=True,
    description="the request's id, as in the envelope",
)
RETRY_AFTER_HEADER = OpenApiParameter(
    "Retry-After",
    {"type": "string", "pattern": "^[0-9]+$"},
    OpenApiParameter.HEADER,
    required=True,
    response=[429],
    description="seconds to wait before retrying with the same Idempotency-Key",
)


def uint64_query(name: str, description: str) -> OpenApiParameter:
    return OpenApiParameter(
        name,
        {"type": "string", "pattern": shapes.decimal_up_to(UINT64_MAX)},
        OpenApiParameter.QUERY,
        description=description,
    )


def _responses(data: str, created: bool, errors: list[int]) -> dict[int, Any]:
    success = Documented(f"{data}Response")
    responses: dict[int, Any] = (
        {201: OpenApiResponse(success, "created"), 200: OpenApiResponse(success, "the replay of a create")}
        if created
        else {200: OpenApiResponse(success, "success")}
    )
    for status in errors:
        responses[status] = OpenApiResponse(Documented(f"Error{status}"), shapes.ERROR_DESCRIPTIONS[status])
    return responses


def documented(
    request: type | Documented | None = None,
    *,
    data: str,
    operation_id: str | None = None,
    summary: str | None = None,
    description: str | None = None,
    tags: list[str] | None = None,
    created: bool = False,
    idempotent: bool = False,
    filters: tuple[str, ...] = (),
    paged: bool = False,
    extra_parameters: tuple[OpenApiParameter, ...] = (),
    not_found: bool = False,
    queue_full: bool = False,
) -> Callable[[Any], Any]:
    """A view method's OpenAPI entry: its request body, its answer (`data`,
    a component of openapi_objects, in the success envelope; 201 and the
    replay's 200 for a create), every error status it can answer, its query
    parameters and the Idempotency-Key header of a mutating call. A method
    with path parameters (a resource's id) answers 404; `not_found`: one
    that looks up a resource its body names.

    `operation_id`: `<resource>_<verb>` (queues_configure, tasks_list), the
    name a generated client gives the call. `summary` and `description`
    default to the method's docstring: its first paragraph, then the rest
    (a mutation's effect lends its docstring to the view method). `tags`:
    the resource a generator groups the call under, by default the path's
    first segment (which, for `/v1/tasks:batch`, is not the resource)."""

    def decorate(method: Any) -> Any:
        doc_summary, doc_description = summary_and_description(inspect.getdoc(method))
        path_parameters = len(inspect.signature(method).parameters) > 2  # self, request, ids...
        errors = [401, 403, 431, 503]
        if request is not None or paged or filters or extra_parameters or idempotent:
            errors.append(400)
        if path_parameters or not_found:
            errors.append(404)
        if idempotent:
            errors.append(409)
        if request is not None:
            errors.append(413)
        if queue_full:
            errors.append(429)
        parameters: list[OpenApiParameter] = []
        for name in filters:
            # A filter with a schema of its own (an enum) was registered by its app's ready().
            value_schema: Any = dict(QUERY_FILTERS[name]) if name in QUERY_FILTERS else str
            parameters.append(OpenApiParameter(name, value_schema, OpenApiParameter.QUERY, description="exact match"))
        parameters += [*PAGE_PARAMETERS] if paged else []
        parameters += [IDEMPOTENCY_KEY] if idempotent else []
        parameters += extra_parameters
        parameters.append(REQUEST_ID_HEADER)
        if queue_full:
            parameters.append(RETRY_AFTER_HEADER)
        schemed = extend_schema(
            request=request,
            responses=_responses(data, created, sorted(errors)),
            operation_id=operation_id,
            summary=summary or doc_summary,
            description=description or doc_description,
            tags=tags,
            parameters=parameters,
        )(method)
        # What orbit.api.views.OrbitView accepts in the query string, the names documented here.
        schemed.query_parameters = frozenset(p.name for p in parameters if p.location == OpenApiParameter.QUERY)
        return schemed

    return decorate


def summary_and_description(doc: str | None) -> tuple[str | None, str | None]:
    """A docstring's first paragraph (on one line) and the rest."""
    if not doc:
        return None, None
    first, _, rest = doc.strip().partition("\n\n")
    return " ".join(first.split()), rest.strip() or None


_document_lock = threading.Lock()


class OpenApiDocumentView(SpectacularJSONAPIView):
    """`GET /v1/openapi.json`: the document as JSON whatever Accept says (the
    default view answers YAML to `Accept: */*`), and its errors as
    application/json like every other error of the API. It needs no
    credential (SPEC §11: it holds no data), and is generated once per
    process: it depends on the code only."""

    authentication_classes: list[Any] = []
    custom_settings = DOCUMENT_SETTINGS

    def _get_schema_response(self, request: Request) -> Response:
        with _document_lock:
            return Response(data=_document(self, request))

    def finalize_response(self, request: Request, response: Response, *args: Any, **kwargs: Any) -> Response:
        if response.status_code >= 400:
            request.accepted_renderer = JSONRenderer()
            request.accepted_media_type = JSONRenderer.media_type
        return super().finalize_response(request, response, *args, **kwargs)


_document_cache: dict[str, Any] = {}


def _document(view: OpenApiDocumentView, request: Request) -> dict[str, Any]:
    if "document" not in _document_cache:
        generator = view.generator_class(urlconf=view.urlconf, api_version=None, patterns=view.patterns)
        _document_cache["document"] = generator.get_schema(request=None, public=True)
    return _document_cache["document"]
