"""The key policy's OpenAPI objects (tasks.actions.policies.policy_snapshot)
and its page and receipt. Registered by TasksConfig.ready()
(orbit.api.openapi_registry)."""

from __future__ import annotations

from typing import Any

from orbit.api import openapi_objects as shapes
from orbit.api.openapi_registry import Schema, register_body_rule, register_component
from tasks.openapi import KEY_PATTERN
from tasks.policy_serializers import MAX_CAPACITY, MAX_RATE_BURST, MAX_RATE_PER_SECONDS, MAX_RATE_STARTS

# ConcurrencyKeyField's rules, never empty: no control characters, no whitespace at either end.
_KEY = {"type": "string", "minLength": 1, "maxLength": 191, "pattern": KEY_PATTERN}

KEY_POLICY_MATCH = {
    "oneOf": [
        shapes.closed({"key": {**_KEY, "description": "exactly this key, byte for byte"}}),
        shapes.closed({"prefix": {**_KEY, "description": "each key starting with it, byte for byte"}}),
    ],
    "description": "one key, or every key starting with a prefix (each key on its own)",
}
KEY_POLICY_RATE = shapes.closed(
    {
        "starts": {"type": "integer", "minimum": 1, "maximum": MAX_RATE_STARTS},
        "per_seconds": {"type": "integer", "minimum": 1, "maximum": MAX_RATE_PER_SECONDS},
        "burst": {"type": "integer", "minimum": 1, "maximum": MAX_RATE_BURST},
    },
    description="at most burst + t·starts/per_seconds approved Starts of a key in any interval of t seconds",
)
KEY_POLICY = shapes.closed(
    {
        "id": shapes.ID,
        "namespace_id": shapes.ID,
        "match": shapes.ref("KeyPolicyMatch"),
        "capacity": {"type": "integer", "minimum": 1, "maximum": MAX_CAPACITY},
        "rate": shapes.ref("KeyPolicyRate"),
        "revision": shapes.REVISION,
        "created_at": shapes.TIME,
        "updated_at": shapes.TIME,
        "retired_at": shapes.TIME,
    },
    optional=("rate", "retired_at"),
    description="a key policy: rate omitted when the keys have none, retired_at once retired",
)


def _exactly_one(auto_schema: Any, schema: Schema) -> Schema:
    # tasks.policy_serializers.KeyMatchInput.validate: key or prefix, not both, not
    # neither, and never "" (the concurrency key's "no key").
    properties = {
        name: {
            **spec,
            "minLength": 1,
            "description": "not empty; no control characters, no whitespace at either end; compared byte for byte",
        }
        for name, spec in schema["properties"].items()
    }
    return {**schema, "properties": properties, "minProperties": 1, "maxProperties": 1}


def register() -> None:
    register_component("KeyPolicyMatch", KEY_POLICY_MATCH)
    register_component("KeyPolicyRate", KEY_POLICY_RATE)
    register_component("KeyPolicy", KEY_POLICY)
    register_component("KeyPolicyPage", shapes.page_of("KeyPolicy"))
    register_component("KeyPolicyReceipt", shapes.receipt_of("policy", "KeyPolicy"))
    register_body_rule("KeyMatchInput", _exactly_one)
