"""The OpenAPI shapes of what the API answers, the generic part: the
envelopes, the error envelopes with their codes, the building blocks (ids,
uint64 strings, times, closed objects, pages, receipts) and the foundation's
own objects (application, event).

The objects are written by plain functions (queues.actions.queue_snapshot,
tasks.actions.serialize, plans.actions.plan_snapshot, ...), not by DRF
serializers, so their shapes are stated once, as JSON Schema, closed
(`additionalProperties: false`): the contract test (tests/contract) checks
every answer of a live server against them, so a key added to a snapshot
without its line fails there. Each app states its own objects in its
`openapi` module and registers them (orbit.api.openapi_registry); enums are
taken from the models' choices and the error codes from orbit.errors, never
copied.

Rules the request bodies share with these shapes (ids, uint64 strings) are
built here from the validators' own constants."""

from __future__ import annotations

from typing import Any

from orbit import errors
from orbit.api.openapi_registry import COMPONENTS, Schema, register_component
from orbit.fields import RESOURCE_ID, UINT64_MAX

PROTOCOL_DOC = "docs/protocol.md"


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def decimal_up_to(limit: int, *, nonzero: bool = False) -> str:
    """A regular expression (anchored) matching exactly the decimal strings
    without sign or leading zeros of the integers 0 (1 when `nonzero`) to
    `limit`: what orbit.api.fields.canonical_uint64 takes, as a pattern."""
    digits = str(limit)
    shorter = [] if nonzero else ["0"]
    if len(digits) > 1:
        shorter.append(f"[1-9][0-9]{{0,{len(digits) - 2}}}")
    elif nonzero:
        shorter.append(f"[1-{digits}]")
    same_length = []
    if len(digits) > 1:
        for position, digit in enumerate(digits):
            low = 1 if position == 0 else 0
            if int(digit) > low:
                rest = len(digits) - position - 1
                tail = f"[0-9]{{{rest}}}" if rest else ""
                same_length.append(f"{digits[:position]}[{low}-{int(digit) - 1}]{tail}")
        same_length.append(digits)
    return "^(?:" + "|".join(shorter + same_length) + ")$"


UINT64_STRING: Schema = {
    "type": "string",
    "pattern": decimal_up_to(UINT64_MAX),
    "description": "a uint64 as its decimal string (no sign, no leading zeros)",
}
REVISION: Schema = {**UINT64_STRING, "pattern": decimal_up_to(UINT64_MAX, nonzero=True)}
TIME: Schema = {"type": "string", "format": "date-time", "description": "RFC 3339, UTC, with Z"}
ID: Schema = {"type": "string", "pattern": f"^{RESOURCE_ID.pattern}$", "description": "32 lowercase hex"}
ANY_JSON: Schema = {"description": "any JSON value"}
COUNT: Schema = {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}


def closed(properties: dict[str, Schema], optional: tuple[str, ...] = (), **extra: Any) -> Schema:
    """An object with exactly these properties, all present but `optional`."""
    return {
        "type": "object",
        "properties": properties,
        "required": [name for name in properties if name not in optional],
        "additionalProperties": False,
        **extra,
    }


def enum(values: Any, description: str = "") -> Schema:
    schema: Schema = {"type": "string", "enum": list(values)}
    return {**schema, "description": description} if description else schema


# --------------------------------------------------------------------------- errors

# Each documented error status, its codes (orbit.errors) and when it answers.
ERROR_CLASSES: dict[int, tuple[type[errors.OrbitError], ...]] = {
    400: (errors.InvalidArgument,),
    401: (errors.Unauthenticated,),
    403: (errors.PermissionDenied,),
    404: (errors.NotFound,),
    409: (errors.IdempotencyConflict, errors.StateConflict),
    413: (errors.PayloadTooLarge,),
    429: (errors.QueueFull,),
    431: (errors.HeadersTooLarge,),
    503: (errors.Unavailable,),
}
ERROR_DESCRIPTIONS = {
    400: "INVALID_ARGUMENT: malformed JSON, a wrong type, an out-of-range value, an unknown field, "
    "a missing or malformed Idempotency-Key; the message names the field",
    401: "UNAUTHENTICATED: no bearer token, or one that is unknown or revoked",
    403: "PERMISSION_DENIED: the credential lacks the scope, or its queue range does not cover all queues",
    404: "NOT_FOUND: no such resource in the credential's namespace and queue range",
    409: "IDEMPOTENCY_CONFLICT: the Idempotency-Key was used for another request; "
    "STATE_CONFLICT: expected_revision is not the current one, or the resource's state forbids the change",
    413: "PAYLOAD_TOO_LARGE: the body is over the upload limit, or a payload over 256 KiB encoded",
    429: "QUEUE_FULL: the queue's (or application's) unfinished-task limit is reached; retry with the "
    "same Idempotency-Key after Retry-After seconds",
    431: "REQUEST_HEADERS_TOO_LARGE: the request line and headers are over 16,384 bytes or 500 lines",
    503: "UNAVAILABLE: the database is unreachable, or did not answer within 4.5 s; retry later "
    "(a write with the same Idempotency-Key)",
}
ALL_ERROR_CODES = [cls.code for classes in ERROR_CLASSES.values() for cls in classes]


def error_envelope(status: int) -> Schema:
    codes = [cls.code for cls in ERROR_CLASSES[status]]
    return closed(
        {
            "request_id": ref("RequestId"),
            "error": closed({"code": enum(codes), "message": {"type": "string"}}),
        },
        description=ERROR_DESCRIPTIONS[status],
    )


# --------------------------------------------------------------------------- objects

APPLICATION = closed(
    {
        "id": ID,
        "name": {"type": "string"},
        "max_active_attempts": COUNT,
        "max_unfinished_tasks": COUNT,
        "active_attempts": UINT64_STRING,
        "unfinished_tasks": UINT64_STRING,
        "revision": REVISION,
    }
)

EVENT = closed(
    {
        "cursor": UINT64_STRING,
        "type": {"type": "string"},
        "subject_id": {"type": "string"},
        "data": ANY_JSON,
        "created_at": TIME,
    }
)


def page_of(item: str) -> Schema:
    return closed(
        {
            "items": {"type": "array", "items": ref(item)},
            "next_page_token": {"type": "string", "description": "empty on the last page"},
        }
    )


def receipt_of(name: str, item: str) -> Schema:
    return closed(
        {
            "deduplicated": {"type": "boolean", "description": "true: the replay of an earlier request's answer"},
            name: ref(item),
        }
    )


IDEMPOTENCY_KEY: Schema = {
    "type": "string",
    "minLength": 1,
    "maxLength": 255,
    "pattern": "^[\\x20-\\x7e]+$",
    "description": "1 to 255 printable ASCII characters (orbit.idempotency.validate_key)",
}

# The foundation's own components; each app registers its own beside them.
for _name, _schema in {
    "RequestId": {"type": "string", "pattern": f"^{RESOURCE_ID.pattern}$", "description": "also in X-Request-Id"},
    "IdempotencyKey": IDEMPOTENCY_KEY,
    "Application": APPLICATION,
    "ApplicationReceipt": receipt_of("application", "Application"),
    "Event": EVENT,
    "EventPage": closed(
        {
            "items": {"type": "array", "items": ref("Event")},
            "next_cursor": {**UINT64_STRING, "description": "pass as `after` to read on"},
        }
    ),
    **{f"Error{status}": error_envelope(status) for status in ERROR_CLASSES},
}.items():
    register_component(_name, _schema)

# Every component by name (the registry's store): the data objects, then
# `<name>Response`, the success envelope around each (see envelope()).
OBJECTS = COMPONENTS


def envelope(data: str) -> Schema:
    return closed({"request_id": ref("RequestId"), "data": ref(data)})


def component(name: str) -> Schema:
    """The schema of a component named here: an object, or `<object>Response`."""
    if name in OBJECTS:
        return OBJECTS[name]
    if name.endswith("Response") and name.removesuffix("Response") in OBJECTS:
        return envelope(name.removesuffix("Response"))
    raise KeyError(name)


def references(schema: Any) -> set[str]:
    """The component names a schema refers to, directly."""
    found: set[str] = set()
    if isinstance(schema, dict):
        target = schema.get("$ref")
        if isinstance(target, str) and target.startswith("#/components/schemas/"):
            found.add(target.rsplit("/", 1)[1])
        for value in schema.values():
            found |= references(value)
    elif isinstance(schema, list):
        for value in schema:
            found |= references(value)
    return found
