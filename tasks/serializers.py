"""Field rules of POST /v1/tasks (SPEC §5) and of the concurrency key (keyed-concurrency seed §2)."""

from __future__ import annotations

import json
import re
import unicodedata
from datetime import UTC, datetime
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from orbit.api.fields import (
    DEFER,
    NameField,
    ReasonField,
    StrictCharField,
    StrictChoiceField,
    StrictSerializer,
    is_valid_utf8,
    uint32_field,
)
from orbit.errors import InvalidArgument, PayloadTooLarge
from orbit.json_depth import TOO_DEEP, nested_too_deeply

MAX_PAYLOAD_BYTES = 256 * 1024
MAX_KEY_CHARACTERS = 191
MAX_TIMEOUT_SECONDS = 366 * 24 * 3600


def encoded_payload_size(payload: Any) -> int:
    return len(json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


def is_unicode_whitespace(ch: str) -> bool:
    return ch.isspace() or unicodedata.category(ch) == "Zs"


def is_control(ch: str) -> bool:
    code = ord(ch)
    return code < 0x20 or code == 0x7F or 0x80 <= code <= 0x9F


class StrictNumberField(serializers.FloatField):
    default_error_messages = {"invalid": "must be a number"}

    def __init__(self, **kwargs: Any) -> None:
        bounds = f"must be a number between {kwargs.get('min_value')} and {kwargs.get('max_value')}"
        kwargs.setdefault("error_messages", {}).update({"max_value": bounds, "min_value": bounds})
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            self.fail("invalid")
        return super().to_internal_value(data)


class TimeField(StrictCharField):
    """RFC 3339 with an explicit offset; stored in UTC."""

    default_error_messages = {
        "time": "must be an RFC 3339 time with a time zone, e.g. 2026-01-02T03:04:05Z",
        "range": "out of range: must be from 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999Z in UTC",
    }

    def to_internal_value(self, data: Any) -> datetime:  # type: ignore[override]
        try:
            value = _utc_time(super().to_internal_value(data))
        except OverflowError:
            self.fail("range")
        if value is None:
            self.fail("time")
        return value

    def plain_value(self, data: Any) -> Any:
        text = super().plain_value(data)
        try:
            value = None if text is DEFER else _utc_time(text)
        except OverflowError:  # the full handler words it
            return DEFER
        return DEFER if value is None else value


# RFC 3339's date-time (section 5.6): T and Z in either case, any number of
# fraction digits (microseconds are kept), an offset with its colon.
# datetime.fromisoformat alone also takes other ISO 8601 forms (week dates,
# a comma, "+0100", a bare hour offset).
RFC3339_DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})", re.ASCII)


def _utc_time(text: str) -> datetime | None:
    """`text` as an RFC 3339 time with an offset, in UTC; None if it is not one.
    OverflowError: it is one, but its offset moves it out of years 1-9999."""
    if not RFC3339_DATE_TIME.fullmatch(text):
        return None
    try:
        value = datetime.fromisoformat(f"{text[:10]}T{text[11:]}".replace("z", "Z"))
    except ValueError:
        return None
    return None if value.tzinfo is None else value.astimezone(UTC)


class ConcurrencyKeyField(StrictCharField):
    """Omitted or "" means off; otherwise 1–191 characters, no control characters,
    no Unicode whitespace at either end. Compared byte-for-byte, never folded."""

    default_error_messages = {
        "control": "must not contain control characters",
        "edge_space": "must not start or end with whitespace",
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_blank=True, max_length=MAX_KEY_CHARACTERS, **kwargs)

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if value == "":
            return value
        if any(is_control(ch) for ch in value):
            self.fail("control")
        if is_unicode_whitespace(value[0]) or is_unicode_whitespace(value[-1]):
            self.fail("edge_space")
        return value

    def plain_value(self, data: Any) -> Any:
        # Printable ASCII has no control character and one whitespace, the space.
        value = super().plain_value(data)
        if value is DEFER or value == "":
            return value
        return value if value.isprintable() and value[0] != " " and value[-1] != " " else DEFER


class RetryInput(StrictSerializer):
    initial_seconds = StrictNumberField(min_value=0, max_value=86_400, required=False, default=1)
    multiplier = StrictNumberField(min_value=1, max_value=100, required=False, default=2)
    max_seconds = StrictNumberField(min_value=0, max_value=7 * 86_400, required=False, default=300)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["max_seconds"] < attrs["initial_seconds"]:
            raise serializers.ValidationError({"max_seconds": ["must be at least initial_seconds"]})
        return attrs


@extend_schema_field(OpenApiTypes.ANY)
class PayloadField(serializers.Field):
    default_error_messages = {
        "null": "must not be null",
        "utf8": "must be valid UTF-8 (no lone surrogates)",
        "depth": TOO_DEEP,
    }

    def to_internal_value(self, data: Any) -> Any:
        # The depth first, level by level: json.dumps recurses, and a payload
        # as deep as the parser allowed (it ran with less of the stack in use)
        # would overflow it here (RecursionError: a 500).
        if nested_too_deeply(data):
            self.fail("depth")
        try:
            size = encoded_payload_size(data)
        except UnicodeEncodeError:
            self.fail("utf8")
        if size > MAX_PAYLOAD_BYTES:
            raise PayloadTooLarge(f"payload: {size} bytes encoded, over the {MAX_PAYLOAD_BYTES} byte limit")
        return data

    def plain_value(self, data: Any) -> Any:
        if data is None:
            return DEFER
        try:
            return self.to_internal_value(data)
        except (serializers.ValidationError, PayloadTooLarge):
            return DEFER

    def to_representation(self, value: Any) -> Any:
        return value


MAX_DEPENDENCIES = 1000
REF_PREFIX = "ref:"
REF_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
TASK_ID = re.compile(r"[0-9a-f]{32}")


@extend_schema_field({"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_DEPENDENCIES})
class DependsOnField(serializers.Field):
    """1–1,000 distinct task ids, or in a batch `ref:NAME` of an earlier item
    (SPEC §13). Refused by position, as depends_on[i], which DRF's messages
    cannot name: the error is raised as the API's own."""

    def to_internal_value(self, data: Any) -> list[str]:
        if not isinstance(data, list) or not 1 <= len(data) <= MAX_DEPENDENCIES:
            raise InvalidArgument(f"depends_on: must be a list of 1 to {MAX_DEPENDENCIES} task ids")
        seen: dict[str, int] = {}
        for index, entry in enumerate(data):
            where = f"depends_on[{index}]"
            if not isinstance(entry, str) or not (
                TASK_ID.fullmatch(entry)
                or (entry.startswith(REF_PREFIX) and REF_NAME.fullmatch(entry[len(REF_PREFIX) :]))
            ):
                raise InvalidArgument(
                    f"{where}: must be a task id (32 lowercase hex characters) or, in a batch, ref:NAME"
                )
            if entry in seen:
                raise InvalidArgument(f"{where}: repeats entry {seen[entry]}")
            seen[entry] = index
        return list(data)

    def to_representation(self, value: Any) -> Any:
        return value


class SubmitTaskInput(StrictSerializer):
    plain_path = True  # every submit validates its body on the event loop (tasks/submit_route.py)

    queue_id = StrictCharField(max_length=32)
    handler = NameField(max_length=128)
    handler_version = NameField(max_length=64)
    payload_version = NameField(max_length=64)
    payload = PayloadField()
    business_key = StrictCharField(required=False, allow_blank=True, max_length=191)
    concurrency_key = ConcurrencyKeyField(required=False)
    fairness_key = ConcurrencyKeyField(required=False)  # the same rules (SPEC §12)
    priority = uint32_field(0, 9, required=False, default=5)
    available_at = TimeField(required=False)
    start_deadline_at = TimeField(required=False)
    deadline_at = TimeField(required=False)
    timeout_seconds = uint32_field(1, MAX_TIMEOUT_SECONDS, required=False)
    max_attempts = uint32_field(1, 100, required=False, default=3)
    retry = RetryInput(required=False)
    lease_seconds = uint32_field(5, 3600, required=False, default=30)
    depends_on = DependsOnField(required=False)
    on_dependency_failure = StrictChoiceField(("CANCEL", "RUN"), required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "deadline_at" in attrs and "timeout_seconds" in attrs:
            raise serializers.ValidationError({"timeout_seconds": ["give deadline_at or timeout_seconds, not both"]})
        for name in ("business_key",):
            if name in attrs and not is_valid_utf8(attrs[name]):
                raise serializers.ValidationError({name: ["must be valid UTF-8"]})
        return attrs


class CancelTaskInput(StrictSerializer):
    reason = ReasonField()


class ResolveTaskInput(StrictSerializer):
    resolution = StrictChoiceField(("SUCCEEDED", "FAILED", "RETRY"))
    reason = ReasonField()
