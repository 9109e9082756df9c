"""The tasks app's OpenAPI objects and body rules: the task
(tasks.actions.serialize), its attempts, blockers and batch answers, the batch
body, and what the task serializers' own fields check (payload, concurrency
key, RFC 3339 times). Registered by TasksConfig.ready()
(orbit.api.openapi_registry); the field extensions register with
drf-spectacular when this module is imported."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiSerializerFieldExtension

from orbit.api import openapi_objects as shapes
from orbit.api.openapi_registry import (
    Schema,
    register_body_rule,
    register_component,
    register_field_schema,
    register_query_filter,
    register_referenced_serializer,
)
from orbit.api.schema import base_field_schema, exclusive
from orbit.json_depth import MAX_JSON_DEPTH
from tasks.actions.batch import MAX_BATCH_ITEMS
from tasks.actions.blockers import MESSAGES as BLOCKER_CODES
from tasks.models import AttemptState, DependencyFailure, TaskState
from tasks.serializers import (
    MAX_DEPENDENCIES,
    MAX_PAYLOAD_BYTES,
    REF_NAME,
    REF_PREFIX,
    RFC3339_DATE_TIME,
    TASK_ID,
    ConcurrencyKeyField,
    DependsOnField,
    PayloadField,
    SubmitTaskInput,
    TimeField,
)

# The pattern of tasks.serializers.TimeField, anchored, in the syntax both
# JSON Schema's (ECMA-262) and Python's regular expressions read alike.
DATE_TIME_PATTERN = "^" + RFC3339_DATE_TIME.pattern.replace(r"\d", "[0-9]") + "$"

# --------------------------------------------------------------------------- objects

TASK_STATE = shapes.enum(
    TaskState.values, "BLOCKED: waiting for its dependencies (depends_on), never leased until they finish"
)
ON_DEPENDENCY_FAILURE = shapes.enum(
    DependencyFailure.values,
    "when a dependency ends FAILED or CANCELLED: CANCEL the task with DEPENDENCY_FAILED, "
    "or RUN it once the rest have finished",
)
TASK_ID_PATTERN = f"^{TASK_ID.pattern}$"
REF_NAME_PATTERN = f"^{REF_NAME.pattern}$"

_TASK_FIELDS: dict[str, Schema] = {
    "id": shapes.ID,
    "namespace_id": shapes.ID,
    "queue_id": shapes.ID,
    "handler": {"type": "string"},
    "handler_version": {"type": "string"},
    "payload_version": {"type": "string"},
    "business_key": {"type": "string", "minLength": 1},
    "concurrency_key": {"type": "string", "minLength": 1},
    "fairness_key": {"type": "string", "minLength": 1},
    "priority": {"type": "integer", "minimum": 0, "maximum": 9},
    "state": shapes.ref("TaskState"),
    "attempts": shapes.COUNT,
    "max_attempts": shapes.COUNT,
    "available_at": shapes.TIME,
    "start_deadline_at": shapes.TIME,
    "deadline_at": shapes.TIME,
    "depends_on": {
        "type": "array",
        "items": {"type": "string", "pattern": TASK_ID_PATTERN},
        "minItems": 1,
        "maxItems": MAX_DEPENDENCIES,
        "description": "the ids of the tasks it waits for, in the order submitted (refs resolved)",
    },
    "on_dependency_failure": ON_DEPENDENCY_FAILURE,
    "cancel_requested": {"type": "boolean"},
    "created_at": shapes.TIME,
    "updated_at": shapes.TIME,
    "finished_at": shapes.TIME,
    "output": {**shapes.ANY_JSON, "description": "the output of the attempt that succeeded"},
    "last_error": {**shapes.ANY_JSON, "description": "the error of the last attempt that failed, or Orbit's own"},
}
_TASK_OPTIONAL = (
    "business_key",
    "concurrency_key",
    "fairness_key",
    "start_deadline_at",
    "deadline_at",
    "depends_on",
    "on_dependency_failure",
    "finished_at",
    "output",
    "last_error",
)
TASK_SUMMARY = shapes.closed(_TASK_FIELDS, optional=_TASK_OPTIONAL, description="a task without its payload (lists)")
TASK = shapes.closed({**_TASK_FIELDS, "payload": shapes.ANY_JSON}, optional=_TASK_OPTIONAL)

ATTEMPT = shapes.closed(
    {
        "id": shapes.ID,
        "task_id": shapes.ID,
        "number": {**shapes.COUNT, "minimum": 1, "description": "counted attempts only (it started)"},
        "state": shapes.ref("AttemptState"),
        "epoch": {**shapes.COUNT, "minimum": 1},
        "concurrency_token": shapes.UINT64_STRING,
        "concurrency_slot": {
            **shapes.COUNT,
            "description": "which of its key's permits the attempt holds; only for a key of capacity above 1",
        },
        "worker_id": {"type": "string"},
        "leased_at": shapes.TIME,
        "lease_expires_at": shapes.TIME,
        "started_at": shapes.TIME,
        "finished_at": shapes.TIME,
        "outcome": shapes.enum(("SUCCEEDED", "FAILED", "UNKNOWN")),
        "error": shapes.ANY_JSON,
        "late_outcome": shapes.closed(
            {
                "outcome": shapes.enum(("SUCCEEDED", "FAILED", "UNKNOWN")),
                "retryable": {"type": "boolean"},
                "output": shapes.ANY_JSON,
                "error": shapes.ANY_JSON,
                "received_at": shapes.TIME,
            },
            optional=("retryable", "output", "error"),
            description="a result that arrived after the attempt ended; it changed nothing",
        ),
    },
    optional=(
        "number",
        "concurrency_token",
        "concurrency_slot",
        "started_at",
        "finished_at",
        "outcome",
        "error",
        "late_outcome",
    ),
)

# GET /v1/tasks/{id}/dependencies and /dependents (tasks.actions.serialize.task_link).
TASK_LINK = shapes.closed(
    {
        "id": shapes.ID,
        "pruned": {"type": "boolean", "enum": [True], "description": "the task was pruned from the database"},
        "queue_id": shapes.ID,
        "handler": {"type": "string"},
        "business_key": {"type": "string", "minLength": 1},
        "state": shapes.ref("TaskState"),
        "created_at": shapes.TIME,
        "updated_at": shapes.TIME,
        "finished_at": shapes.TIME,
    },
    optional=("pruned", "queue_id", "handler", "business_key", "state", "created_at", "updated_at", "finished_at"),
    description="a related task in short form; only its id when the credential's queue range does not cover it, "
    "its id and pruned when it is no longer in the database",
)

# POST /v1/tasks:batch: each item's own answer, as a single submit would give it.
BATCH_ACCEPTED = shapes.closed(
    {
        "idempotency_key": shapes.ref("IdempotencyKey"),
        "status": {"type": "integer", "enum": [200, 201]},
        "deduplicated": {"type": "boolean"},
        "task": shapes.ref("Task"),
    }
)
BATCH_REFUSED = shapes.closed(
    {
        "idempotency_key": shapes.ref("IdempotencyKey"),
        "status": {"type": "integer", "enum": [400, 403, 404, 409, 413, 429, 503]},
        "error": shapes.closed({"code": shapes.enum(shapes.ALL_ERROR_CODES), "message": {"type": "string"}}),
        "retry_after": {
            "type": "integer",
            "minimum": 1,
            "description": "with 429 and 503: the seconds a single submit's Retry-After would advise",
        },
    },
    optional=("retry_after",),
)

BATCH_RESULTS = shapes.closed(
    {
        "results": {
            "type": "array",
            "items": {"oneOf": [shapes.ref("BatchItemAccepted"), shapes.ref("BatchItemRefused")]},
            "description": "one per item, in the order sent",
        }
    }
)
BLOCKER: Schema = {
    "type": "object",
    "properties": {
        "code": shapes.enum(sorted(BLOCKER_CODES)),
        "message": {"type": "string"},
    },
    "required": ["code", "message"],
    "additionalProperties": True,
    "description": "a reason the next lease would not take the task, with the facts behind it"
    " (e.g. until, active_permits, max_concurrency, attempt_id, task_id, worker_id, since, reason;"
    " WAITING_FOR_DEPENDENCIES: task_ids, the dependencies not finished, in depends_on order)",
}
BLOCKERS = shapes.closed(
    {
        "state": shapes.ref("TaskState"),
        "items": {
            "type": "array",
            "items": shapes.ref("Blocker"),
            "description": "WAITING: empty when a lease would take the task now; BLOCKED: "
            "WAITING_FOR_DEPENDENCIES; empty in every other state",
        },
    }
)

# --------------------------------------------------------------------------- bodies

# POST /v1/tasks:batch (no serializer: each item is validated as a submit).
SUBMIT_BATCH_INPUT = shapes.closed(
    {
        "tasks": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_BATCH_ITEMS,
            "items": shapes.closed(
                {
                    "idempotency_key": shapes.ref("IdempotencyKey"),
                    "ref": {
                        "type": "string",
                        "pattern": REF_NAME_PATTERN,
                        "description": f"a name a later item's depends_on gives as {REF_PREFIX}NAME",
                    },
                    "task": shapes.ref("SubmitTaskInput"),
                },
                optional=("ref",),
            ),
            "description": "each item's key and ref used once in the batch; each item is answered as "
            "POST /v1/tasks would answer it",
        }
    }
)


def depends_on_schema() -> Schema:
    """tasks.serializers.DependsOnField."""
    return {
        "type": "array",
        "minItems": 1,
        "maxItems": MAX_DEPENDENCIES,
        "uniqueItems": True,
        "items": {
            "type": "string",
            "pattern": f"^(?:{TASK_ID.pattern}|{REF_PREFIX}{REF_NAME.pattern})$",
        },
        "description": "distinct ids of tasks of the namespace (any queue) this one waits for; in a batch, "
        f"{REF_PREFIX}NAME names an earlier item's ref. An unknown or another namespace's id is 400 naming "
        "depends_on[i]",
    }


def payload_schema() -> Schema:
    """tasks.serializers.PayloadField. Set by orbit.api.schema.ClosedBodies: the
    field class's own extend_schema_field (any value) wins over a field extension."""
    return {
        # Any JSON but null (OpenAPI 3.0 has no "null" type to exclude).
        "anyOf": [
            # additionalProperties said: openapi-typescript declares a bare object one without keys.
            {"type": "object", "additionalProperties": True},
            {"type": "array", "items": {}},
            {"type": "string"},
            {"type": "number"},
            {"type": "boolean"},
        ],
        "description": f"any JSON value but null: at most {MAX_PAYLOAD_BYTES} bytes encoded (413 above), "
        f"arrays and objects nested at most {MAX_JSON_DEPTH} deep",
    }


# tasks.serializers.SubmitTaskInput.validate: one of the two, not both.
_DEADLINE_OR_TIMEOUT = exclusive("deadline_at", "timeout_seconds")


def _retry_rule(auto_schema: Any, schema: Schema) -> Schema:
    return {**schema, "description": "max_seconds must be at least initial_seconds (defaults 1 and 300)"}


# --------------------------------------------------------------------------- fields

# tasks.serializers.is_control: C0, DEL and C1.
_KEY_CHARACTER = "[^\\u0000-\\u001f\\u007f-\\u009f]"
_KEY_EDGE = "[^\\u0000-\\u001f\\u007f-\\u009f\\s]"
_KEY_BODY = f"{_KEY_EDGE}(?:{_KEY_CHARACTER}*{_KEY_EDGE})?"
# A concurrency key that is given (ConcurrencyKeyField, not empty).
KEY_PATTERN = f"^{_KEY_BODY}$"


class ConcurrencyKeys(OpenApiSerializerFieldExtension):
    target_class = ConcurrencyKeyField

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> Schema:
        return {
            **base_field_schema(auto_schema, self.target, direction),
            "pattern": f"^(?:{_KEY_BODY})?$",
            "description": "empty or omitted: none; no control characters, no whitespace at either end; "
            "compared byte for byte",
        }


class Times(OpenApiSerializerFieldExtension):
    target_class = TimeField

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> Schema:
        return {
            "type": "string",
            "format": "date-time",
            "pattern": DATE_TIME_PATTERN,
            "description": "RFC 3339 with a time zone offset, e.g. 2026-01-02T03:04:05Z",
        }


def register() -> None:
    register_component("TaskState", TASK_STATE)
    register_component("AttemptState", shapes.enum(AttemptState.values))
    register_component("TaskSummary", TASK_SUMMARY)
    register_component("Task", TASK)
    register_component("TaskPage", shapes.page_of("TaskSummary"))
    register_component("TaskReceipt", shapes.receipt_of("task", "Task"))
    register_component("BatchItemAccepted", BATCH_ACCEPTED)
    register_component("BatchItemRefused", BATCH_REFUSED)
    register_component("BatchResults", BATCH_RESULTS)
    register_component("TaskLink", TASK_LINK)
    register_component("TaskLinkPage", shapes.page_of("TaskLink"))
    register_component("Attempt", ATTEMPT)
    register_component("AttemptPage", shapes.page_of("Attempt"))
    register_component("Blocker", BLOCKER)
    register_component("Blockers", BLOCKERS)
    register_component("SubmitBatchInput", SUBMIT_BATCH_INPUT)
    register_field_schema(PayloadField, payload_schema)
    register_field_schema(DependsOnField, depends_on_schema)
    register_body_rule("SubmitTaskInput", _DEADLINE_OR_TIMEOUT)
    register_body_rule("RetryInput", _retry_rule)
    register_referenced_serializer(SubmitTaskInput)
    register_query_filter("state", TASK_STATE)
