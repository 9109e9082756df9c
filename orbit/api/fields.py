"""Strict DRF fields: JSON types are taken as sent, never coerced.

DRF's stock fields accept "8" or 8.0 for an integer, 1 or "true" for a bool
and numbers for a string; the seeds reject all of those with 400.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, cast

from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import (
    MaxLengthValidator,
    MaxValueValidator,
    MinLengthValidator,
    MinValueValidator,
    ProhibitNullCharactersValidator,
)
from rest_framework import serializers
from rest_framework.fields import empty
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from orbit.errors import InvalidArgument, OrbitError
from orbit.fields import UINT32_MAX, UINT64_MAX

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")

# What a field's plain_value (or a serializer's plain_validated) returns when
# it is not sure: the full validation decides, and words the refusal if any.
DEFER: Any = object()


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

    def plain_value(self, data: Any) -> Any:
        if type(data) is not int:
            return DEFER
        if (self.min_value is not None and data < self.min_value) or (
            self.max_value is not None and data > self.max_value
        ):
            return DEFER
        return data


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

    def plain_value(self, data: Any) -> Any:
        """An ASCII string without NUL within the length bounds is taken as
        is; everything else (non-ASCII text included) goes the full way."""
        if type(data) is not str or self.trim_whitespace:
            return DEFER
        if data == "":
            return "" if self.allow_blank else DEFER
        if not data.isascii() or "\x00" in data:
            return DEFER
        if (self.max_length is not None and len(data) > self.max_length) or (
            self.min_length is not None and len(data) < self.min_length
        ):
            return DEFER
        return data


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

    def plain_value(self, data: Any) -> Any:
        value = super().plain_value(data)
        return value if value is not DEFER and NAME_PATTERN.fullmatch(value) else DEFER


class StrictChoiceField(StrictCharField):
    """A string that must be one of `values`, spelled exactly."""

    default_error_messages = {"choice": "must be one of {values}"}

    def __init__(self, values: tuple[str, ...], **kwargs: Any) -> None:
        self.values = values
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if value not in self.values:
            self.fail("choice", values=", ".join(self.values))
        return value


def canonical_uint64(text: str) -> int | None:
    """The uint64 a decimal string spells without sign or leading zeros, else None."""
    if not re.fullmatch(r"0|[1-9][0-9]{0,19}", text) or int(text) > UINT64_MAX:
        return None
    return int(text)


class Uint64StringField(StrictCharField):
    """A uint64 sent as its decimal string, e.g. expected_revision "1"."""

    default_error_messages = {"uint64": "must be a decimal string of a uint64"}

    def __init__(self, *, nonzero: bool = False, **kwargs: Any) -> None:
        self.nonzero = nonzero
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> int:  # type: ignore[override]
        number = canonical_uint64(super().to_internal_value(data))
        if number is None:
            self.fail("uint64")
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


# The validators DRF gives the fields that have a plain_value, and the field
# attribute each one's limit must equal.
_OWN_VALIDATORS: dict[type, str | None] = {
    MaxLengthValidator: "max_length",
    MinLengthValidator: "min_length",
    MaxValueValidator: "max_value",
    MinValueValidator: "min_value",
    ProhibitNullCharactersValidator: None,
    ProhibitSurrogateCharactersValidator: None,
}


def _plain_check(serializer: serializers.Serializer, field: Any) -> Any:
    """The field's plain_value if it can stand in for the field's validation:
    defined on the field's own class (a subclass that changes the rules
    without its own plain_value inherits none), and no validator the field
    did not give itself. None otherwise."""
    # `field` is Any: plain_value (Orbit's fields) and limit_value (the validators of
    # _OWN_VALIDATORS) are read from the classes that have them, which a Field is not.
    if "plain_value" not in type(field).__dict__ or getattr(serializer, "validate_" + field.field_name, None):
        return None
    for validator in field.validators:
        attribute = _OWN_VALIDATORS.get(type(validator), "-")
        if attribute == "-" or (attribute is not None and validator.limit_value != getattr(field, attribute)):
            return None
    return field.plain_value


@dataclass(frozen=True)
class _PlainField:
    name: str
    check: Any  # the field's plain_value, or None: present, it goes the full way
    required: bool
    default: Any  # `empty`: none


class _PlainPlan:
    """A StrictSerializer's fields as its plain path walks them."""

    def __init__(self, serializer_class: type[StrictSerializer]) -> None:
        self.serializer = serializer_class()
        writable = [field for field in self.serializer.fields.values() if not field.read_only]
        own_steps = (
            serializer_class.to_internal_value is StrictSerializer.to_internal_value
            # StrictSerializer's own only names a nested field's errors: at the top, as DRF's
            and serializer_class.run_validation is StrictSerializer.run_validation
            and serializer_class.run_validators is serializers.Serializer.run_validators
        )
        self.usable = (
            own_steps
            and not self.serializer.validators
            and all(
                field.source_attrs == [field.field_name] and (field.default is empty or not callable(field.default))
                for field in writable
            )
        )
        self.fields = [
            # A bound field has its name.
            _PlainField(
                cast(str, field.field_name), _plain_check(self.serializer, field), field.required, field.default
            )
            for field in writable
        ]
        self.names = frozenset(field.name for field in self.fields)


_reusable = threading.local()
_plans: dict[type, _PlainPlan] = {}


def first_validation_message(detail: Any, path: str = "") -> str:
    """The message of a DRF error detail's first error, prefixed by the field's dotted path."""
    if isinstance(detail, dict):
        for field, inner in detail.items():
            name = path if field == "non_field_errors" else (f"{path}.{field}" if path else str(field))
            return first_validation_message(inner, name)
    if isinstance(detail, list) and detail:
        return first_validation_message(detail[0], path)
    return f"{path}: {detail}" if path else str(detail)


class StrictSerializer(serializers.Serializer):
    """Rejects fields it does not know: a typo must not pass as an omission."""

    # A serializer that sets this validates a plain body (see plain_validated)
    # without DRF's per-field machinery: on the request path every submit
    # takes, that machinery cost more than the rules it applies.
    plain_path = False

    @classmethod
    def plain_validated(cls, data: Any) -> Any:
        """What the full validation returns for `data`, when every field it
        holds has a plain_value that takes it and the serializer's validate()
        passes; DEFER otherwise (an unknown or missing field, a value a
        plain_value is not sure of, a field without one, any refusal). Never
        a different answer: DEFER only costs the full validation."""
        plan = _plans.get(cls)
        if plan is None:
            plan = _plans.setdefault(cls, _PlainPlan(cls))
        if not plan.usable or type(data) is not dict or not data.keys() <= plan.names:
            return DEFER
        values: dict[str, Any] = {}
        for field in plan.fields:
            if field.name in data:
                if field.check is None:
                    return DEFER
                value = field.check(data[field.name])
                if value is DEFER:
                    return DEFER
                values[field.name] = value
            elif field.required:
                return DEFER
            elif field.default is not empty:
                values[field.name] = field.default
        try:
            return plan.serializer.validate(values)
        except (serializers.ValidationError, DjangoValidationError):
            return DEFER

    def run_validation(self, data: Any = empty) -> Any:
        """As a nested field (a plan's definition.task): an API error one of
        its fields raised itself, naming the field alone (depends_on[i], the
        payload's size), is named under this one, as DRF names its own."""
        try:
            return super().run_validation(data)
        except OrbitError as error:
            if self.parent is None or not self.field_name:
                raise
            raise type(error)(f"{self.field_name}.{error.message}", details=error.details) from None

    @classmethod
    def validated(cls, data: Any) -> Any:
        """Validates `data` (raising InvalidArgument naming the first field it
        refuses, so a verb never handles a DRF error): by the plain path if
        the serializer has one and it takes `data`, else with this thread's
        instance of the serializer. DRF deep-copies every declared field for
        each new instance, which was a third of a grouped submit's CPU; an
        instance reused with its per-call state cleared validates the same way."""
        if cls.plain_path:
            plain = cls.plain_validated(data)
            if plain is not DEFER:
                return plain
        instances: dict[type, StrictSerializer] = _reusable.__dict__.setdefault("instances", {})
        serializer = instances.get(cls)
        if serializer is None:
            serializer = instances[cls] = cls(data=data)
        else:
            serializer.initial_data = data
            for state in ("_validated_data", "_errors", "_data"):
                serializer.__dict__.pop(state, None)
        if not serializer.is_valid():
            raise InvalidArgument(first_validation_message(serializer.errors))
        return serializer.validated_data

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({unknown[0]: ["unknown field"]})
        return super().to_internal_value(data)
