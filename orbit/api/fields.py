"""Strict DRF fields: JSON types are taken as sent, never coerced.

DRF's stock fields accept "8" or 8.0 for an integer, 1 or "true" for a bool
and numbers for a string; the seeds reject all of those with 400.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from rest_framework import serializers

from orbit.fields import UINT32_MAX, UINT64_MAX

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")


class StrictIntegerField(serializers.IntegerField):
    default_error_messages = {"invalid": "must be an integer"}

    def __init__(self, **kwargs: Any) -> None:
        # DRF formats each bound's message with that bound alone; name both.
        bounds = f"must be an integer between {kwargs.get('min_value')} and {kwargs.get('max_value')}"
        kwargs.setdefault("error_messages", {}).update({"max_value": bounds, "min_value": bounds})
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


def uint32_field(minimum: int, maximum: int = UINT32_MAX, **kwargs: Any) -> StrictIntegerField:
    return StrictIntegerField(min_value=minimum, max_value=maximum, **kwargs)


class StrictBooleanField(serializers.BooleanField):
    default_error_messages = {"invalid": "must be a boolean"}

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class StrictCharField(serializers.CharField):
    default_error_messages = {
        "invalid": "must be a string",
        "blank": "must not be empty",
        "max_length": "must be at most {max_length} characters",
        "min_length": "must be at least {min_length} characters",
        "utf8": "must be valid UTF-8 (no lone surrogates)",
    }

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        if not is_valid_utf8(data):
            self.fail("utf8")
        return super().to_internal_value(data)


def is_valid_utf8(text: str) -> bool:
    """JSON's \\ud800 escapes decode to lone surrogates, which are not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class NameField(StrictCharField):
    """1–128 characters: an ASCII letter or digit, then letters, digits, `_ . : -`."""

    default_error_messages = {
        "pattern": "must start with an ASCII letter or digit followed by letters, digits, '_', '.', ':' or '-'",
    }

    def __init__(self, max_length: int = 128, **kwargs: Any) -> None:
        super().__init__(min_length=1, max_length=max_length, **kwargs)

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        # fullmatch: `$` would also match before a trailing newline.
        if not NAME_PATTERN.fullmatch(value):
            self.fail("pattern")
        return value


class Uint64StringField(StrictCharField):
    """A uint64 sent as its decimal string, e.g. expected_revision "1"."""

    default_error_messages = {"uint64": "must be a decimal string of a uint64"}

    def __init__(self, *, nonzero: bool = False, **kwargs: Any) -> None:
        self.nonzero = nonzero
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> int:  # type: ignore[override]
        value = super().to_internal_value(data)
        if not re.fullmatch(r"(0|[1-9][0-9]{0,19})", value) or int(value) > UINT64_MAX:
            self.fail("uint64")
        number = int(value)
        if self.nonzero and number == 0:
            raise serializers.ValidationError("must be a non-zero uint64 decimal string")
        return number


class ReasonField(StrictCharField):
    """Non-blank, at most 1024 Unicode characters; goes to the audit row."""

    default_error_messages = {"blank": "must not be blank"}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_length=1024, **kwargs)

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if not value.strip():
            self.fail("blank")
        return value


_reusable = threading.local()


class StrictSerializer(serializers.Serializer):
    """Rejects fields it does not know: a typo must not pass as an omission."""

    @classmethod
    def validated(cls, data: Any) -> Any:
        """Validates `data` (raising ValidationError) with this thread's instance
        of the serializer. DRF deep-copies every declared field for each new
        instance, which was a third of a grouped submit's CPU; an instance
        reused with its per-call state cleared validates the same way."""
        instances: dict[type, StrictSerializer] = _reusable.__dict__.setdefault("instances", {})
        serializer = instances.get(cls)
        if serializer is None:
            serializer = instances[cls] = cls(data=data)
        else:
            serializer.initial_data = data
            for state in ("_validated_data", "_errors", "_data"):
                serializer.__dict__.pop(state, None)
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({unknown[0]: ["unknown field"]})
        return super().to_internal_value(data)
