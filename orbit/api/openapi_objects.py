"""The OpenAPI shapes of what the API answers: the envelopes, the error
envelopes with their codes, and the objects inside `data` (queue, task,
attempt, plan, application, event, pages, receipts).

The objects are written by plain functions (queues.actions.queue_snapshot,
tasks.actions.serialize, plans.actions.plan_snapshot, ...), not by DRF
serializers, so their shapes are stated here once, as JSON Schema, closed
(`additionalProperties: false`): the contract test (tests/contract) checks
every answer of a live server against them, so a key added to a snapshot
without its line here fails there. Enums are taken from the models' choices
and the error codes from orbit.errors, never copied.

Rules the request bodies share with these shapes (ids, uint64 strings,
RFC 3339 times) are built here from the validators' own constants."""

from __future__ import annotations

from typing import Any

from orbit import errors
from orbit.fields import RESOURCE_ID, UINT64_MAX
from plans.models import PlanState, TriggerOutcome
from tasks.actions.blockers import MESSAGES as BLOCKER_CODES
from tasks.models import AttemptState, TaskState
from tasks.serializers import RFC3339_DATE_TIME

Schema = dict[str, Any]

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
# The pattern of tasks.serializers.TimeField, anchored, in the syntax both
# JSON Schema's (ECMA-262) and Python's regular expressions read alike.
DATE_TIME_PATTERN = "^" + RFC3339_DATE_TIME.pattern.replace(r"\d", "[0-9]") + "$"
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

QUEUE = closed(
    {
        "id": ID,
        "namespace_id": ID,
        "name": {"type": "string", "minLength": 1, "maxLength": 128},
        "paused": {"type": "boolean"},
        "max_concurrency": COUNT,
        "rate_per_second": COUNT,
        "max_unfinished_tasks": COUNT,
        "unfinished_tasks": UINT64_STRING,
        "revision": REVISION,
        "retired_at": TIME,
    },
    optional=("retired_at",),
)

_TASK_FIELDS: dict[str, Schema] = {
    "id": ID,
    "namespace_id": ID,
    "queue_id": ID,
    "handler": {"type": "string"},
    "handler_version": {"type": "string"},
    "payload_version": {"type": "string"},
    "business_key": {"type": "string", "minLength": 1},
    "concurrency_key": {"type": "string", "minLength": 1},
    "priority": {"type": "integer", "minimum": 0, "maximum": 9},
    "state": ref("TaskState"),
    "attempts": COUNT,
    "max_attempts": COUNT,
    "available_at": TIME,
    "start_deadline_at": TIME,
    "deadline_at": TIME,
    "cancel_requested": {"type": "boolean"},
    "created_at": TIME,
    "updated_at": TIME,
    "finished_at": TIME,
    "output": {**ANY_JSON, "description": "the output of the attempt that succeeded"},
    "last_error": {**ANY_JSON, "description": "the error of the last attempt that failed, or Orbit's own"},
}
_TASK_OPTIONAL = (
    "business_key",
    "concurrency_key",
    "start_deadline_at",
    "deadline_at",
    "finished_at",
    "output",
    "last_error",
)
TASK_SUMMARY = closed(_TASK_FIELDS, optional=_TASK_OPTIONAL, description="a task without its payload (lists)")
TASK = closed({**_TASK_FIELDS, "payload": ANY_JSON}, optional=_TASK_OPTIONAL)

ATTEMPT = closed(
    {
        "id": ID,
        "task_id": ID,
        "number": {**COUNT, "minimum": 1, "description": "counted attempts only (it started)"},
        "state": ref("AttemptState"),
        "epoch": {**COUNT, "minimum": 1},
        "concurrency_token": UINT64_STRING,
        "worker_id": {"type": "string"},
        "leased_at": TIME,
        "lease_expires_at": TIME,
        "started_at": TIME,
        "finished_at": TIME,
        "outcome": enum(("SUCCEEDED", "FAILED", "UNKNOWN")),
        "error": ANY_JSON,
        "late_outcome": closed(
            {
                "outcome": enum(("SUCCEEDED", "FAILED", "UNKNOWN")),
                "retryable": {"type": "boolean"},
                "output": ANY_JSON,
                "error": ANY_JSON,
                "received_at": TIME,
            },
            optional=("retryable", "output", "error"),
            description="a result that arrived after the attempt ended; it changed nothing",
        ),
    },
    optional=("number", "concurrency_token", "started_at", "finished_at", "outcome", "error", "late_outcome"),
)

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

PLAN = closed(
    {
        "id": ID,
        "namespace_id": ID,
        "queue_id": ID,
        "name": {"type": "string", "minLength": 1, "maxLength": 128},
        "state": ref("PlanState"),
        "version": {**COUNT, "minimum": 1},
        "revision": REVISION,
        # The plan's version holds them as they were accepted.
        "schedule": ref("ScheduleInput"),
        "misfire": ref("MisfireInput"),
        "definition": ref("DefinitionInput"),
        "next_fire_at": TIME,
    },
    optional=("next_fire_at",),
)

TRIGGER = closed(
    {
        "scheduled_at": TIME,
        "version": {**COUNT, "minimum": 1},
        "outcome": ref("TriggerOutcome"),
        "decided_at": TIME,
        "task_id": ID,
        "reason": {"type": "string"},
    },
    optional=("task_id", "reason"),
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


# POST /v1/tasks:batch: each item's own answer, as a single submit would give it.
BATCH_ACCEPTED = closed(
    {
        "idempotency_key": ref("IdempotencyKey"),
        "status": {"type": "integer", "enum": [200, 201]},
        "deduplicated": {"type": "boolean"},
        "task": ref("Task"),
    }
)
BATCH_REFUSED = closed(
    {
        "idempotency_key": ref("IdempotencyKey"),
        "status": {"type": "integer", "enum": [400, 403, 404, 409, 413, 429, 503]},
        "error": closed({"code": enum(ALL_ERROR_CODES), "message": {"type": "string"}}),
    }
)

IDEMPOTENCY_KEY: Schema = {
    "type": "string",
    "minLength": 1,
    "maxLength": 255,
    "pattern": "^[\\x20-\\x7e]+$",
    "description": "1 to 255 printable ASCII characters (orbit.idempotency.validate_key)",
}

# Every component by name. The data objects, then `<name>Response`: the
# success envelope around each (see envelope()).
OBJECTS: dict[str, Schema] = {
    "RequestId": {"type": "string", "pattern": f"^{RESOURCE_ID.pattern}$", "description": "also in X-Request-Id"},
    "IdempotencyKey": IDEMPOTENCY_KEY,
    "TaskState": enum(TaskState.values),
    "AttemptState": enum(AttemptState.values),
    "PlanState": enum(PlanState.values),
    "TriggerOutcome": enum(TriggerOutcome.values),
    "Queue": QUEUE,
    "QueuePage": page_of("Queue"),
    "QueueReceipt": receipt_of("queue", "Queue"),
    "TaskSummary": TASK_SUMMARY,
    "Task": TASK,
    "TaskPage": page_of("TaskSummary"),
    "TaskReceipt": receipt_of("task", "Task"),
    "BatchItemAccepted": BATCH_ACCEPTED,
    "BatchItemRefused": BATCH_REFUSED,
    "BatchResults": closed(
        {
            "results": {
                "type": "array",
                "items": {"oneOf": [ref("BatchItemAccepted"), ref("BatchItemRefused")]},
                "description": "one per item, in the order sent",
            }
        }
    ),
    "Attempt": ATTEMPT,
    "AttemptPage": page_of("Attempt"),
    "Blocker": {
        "type": "object",
        "properties": {
            "code": enum(sorted(BLOCKER_CODES)),
            "message": {"type": "string"},
        },
        "required": ["code", "message"],
        "additionalProperties": True,
        "description": "a reason the next lease would not take the task, with the facts behind it"
        " (e.g. until, active_permits, max_concurrency, attempt_id, task_id, worker_id, since, reason)",
    },
    "Blockers": closed(
        {
            "state": ref("TaskState"),
            "items": {
                "type": "array",
                "items": ref("Blocker"),
                "description": "empty: a lease would take the task now (always empty unless WAITING)",
            },
        }
    ),
    "Application": APPLICATION,
    "ApplicationReceipt": receipt_of("application", "Application"),
    "Event": EVENT,
    "EventPage": closed(
        {
            "items": {"type": "array", "items": ref("Event")},
            "next_cursor": {**UINT64_STRING, "description": "pass as `after` to read on"},
        }
    ),
    "Plan": PLAN,
    "PlanPage": page_of("Plan"),
    "PlanReceipt": receipt_of("plan", "Plan"),
    "Trigger": TRIGGER,
    "TriggerPage": page_of("Trigger"),
    **{f"Error{status}": error_envelope(status) for status in ERROR_CLASSES},
}


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
