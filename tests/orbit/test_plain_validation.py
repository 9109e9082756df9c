"""StrictSerializer's plain path (SubmitTaskInput.plain_validated) gives
exactly what DRF's full validation gives, or defers to it: never another
value, never an acceptance DRF would refuse."""

from __future__ import annotations

import itertools
import random
from datetime import datetime
from typing import Any

import pytest
from rest_framework import serializers

from orbit.api.fields import DEFER, NameField, ReasonField, StrictCharField, StrictSerializer, uint32_field
from orbit.errors import InvalidArgument
from tasks.serializers import MAX_PAYLOAD_BYTES, SubmitTaskInput

BASE: dict[str, Any] = {
    "queue_id": "q_01JABCDEFGHJKMNPQRSTVWXYZ0",
    "handler": "noop",
    "handler_version": "v1",
    "payload_version": "v1",
    "payload": {"k": "label-1"},
}

STRINGS = [
    "",
    " ",
    "a",
    "ab c",
    " a",
    "a ",
    "a\x00b",
    "\x00",
    "tab\there",
    "line\n",
    "\x7f",
    "\x1f",
    "é",
    "a\u00a0",
    "\u3000x",
    "\u0085",
    "\ud800",
    "x\udfff",
    "😀",
    "A-b_c.d:e",
    "-lead",
    "_lead",
    "a" * 31,
    "a" * 32,
    "a" * 33,
    "a" * 64,
    "a" * 65,
    "a" * 128,
    "a" * 129,
    "a" * 190,
    "a" * 191,
    "a" * 192,
    "é" * 191,
    "2026-01-02T03:04:05Z",
    "2026-01-02t03:04:05z",
    "2026-01-02T03:04:05+08:00",
    "2026-01-02T03:04:05.123456-05:30",
    "2026-01-02 03:04:05Z",
    "2026-01-02T03:04:05",
    "2026-01-02T03:04:05+0800",
    "2026-13-02T03:04:05Z",
    "2026-01-02T03:04:05ZZ",
    " 2026-01-02T03:04:05Z",
    "2026-01-02T03:04:05Z ",
    "2026-01-02T24:00:00Z",
    "2026-W01-1T03:04:05Z",
    "2026-01-02T03:04:05,5Z",
    "2026-01-02T03:04:05+01",
    "2026-01-02T03:04:05.123456789Z",
    "１２３",
]
OTHERS = [
    None,
    True,
    False,
    0,
    1,
    -1,
    5,
    9,
    10,
    29,
    30,
    3600,
    3601,
    2**32 - 1,
    2**32,
    2**70,
    1.0,
    5.0,
    2.5,
    [],
    {},
    ["a"],
]
PAYLOADS = [None, {}, [], 0, "", "é", "\ud800", {"a": "\ud800"}, {"n": [1, 2, {"x": None}]}, "x" * MAX_PAYLOAD_BYTES]
RETRIES = [{}, {"initial_seconds": 1}, {"initial_seconds": 5, "max_seconds": 1}, {"bogus": 1}, None, 3]


def full_validation(serializer_class: type[StrictSerializer], body: Any) -> tuple[bool, Any]:
    """DRF's own answer: (True, validated data) or (False, the refusal)."""
    serializer = serializer_class(data=body)
    try:
        accepted = serializer.is_valid()
    except Exception as exc:  # PayloadTooLarge is raised, not collected
        return False, exc
    return accepted, serializer.validated_data if accepted else serializer.errors


def same(a: Any, b: Any) -> bool:
    """Equal, with the same keys in the same order and values of the same types."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[key], b[key]) for key in a)
    if isinstance(a, datetime):
        return a == b and a.utcoffset() == b.utcoffset()
    return a == b


def assert_agrees(serializer_class: type[StrictSerializer], body: Any) -> bool:
    """Asserts the plain path agrees with DRF on `body`; True if it answered."""
    plain = serializer_class.plain_validated(body)
    if plain is DEFER:
        return False
    accepted, full = full_validation(serializer_class, body)
    assert accepted, f"plain path accepted what DRF refuses: {body!r} -> {full!r}"
    assert same(plain, full), f"{body!r}: plain {plain!r} != DRF {full!r}"
    return True


def bodies() -> list[Any]:
    """One field changed at a time, then seeded random mixes of several."""
    values = STRINGS + OTHERS
    found: list[Any] = [BASE, {}, [], "x", None, {**BASE, "unknown": 1}]
    for name in list(SubmitTaskInput().fields):
        choices = PAYLOADS if name == "payload" else RETRIES if name == "retry" else values
        found.append({key: value for key, value in BASE.items() if key != name})
        found += [{**BASE, name: value} for value in choices]
    rng = random.Random(20261130)
    names = list(SubmitTaskInput().fields)
    for _ in range(3000):
        body = dict(BASE)
        for name in rng.sample(names, rng.randint(1, 6)):
            if rng.random() < 0.15:
                body.pop(name, None)
            elif name == "payload":
                body[name] = rng.choice(PAYLOADS)
            elif name == "retry":
                body[name] = rng.choice(RETRIES)
            else:
                body[name] = rng.choice(values)
        found.append(body)
    return found


def test_plain_path_never_disagrees_with_drf() -> None:
    answered = sum(assert_agrees(SubmitTaskInput, body) for body in bodies())
    assert answered > 200  # the corpus reaches the plain path, not only DRF


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"business_key": "order-42", "concurrency_key": "account:7", "priority": 0},
        {"business_key": "", "concurrency_key": "", "priority": 9, "max_attempts": 100, "lease_seconds": 5},
        {"available_at": "2026-01-02T03:04:05Z", "start_deadline_at": "2026-01-02T03:04:05.5+08:00"},
        {"deadline_at": "2026-01-02t03:04:05z", "max_attempts": 1, "lease_seconds": 3600},
        {"timeout_seconds": 60, "payload": None},
    ],
)
def test_plain_bodies_take_the_plain_path(extra: dict[str, Any]) -> None:
    body = {**BASE, **extra}
    if body["payload"] is None:  # null is refused by DRF: deferred
        assert SubmitTaskInput.plain_validated(body) is DEFER
        return
    assert assert_agrees(SubmitTaskInput, body)


def test_serializer_validate_still_runs() -> None:
    body = {**BASE, "deadline_at": "2026-01-02T03:04:05Z", "timeout_seconds": 5}
    assert SubmitTaskInput.plain_validated(body) is DEFER
    with pytest.raises(InvalidArgument) as refused:
        SubmitTaskInput.validated(body)
    assert refused.value.message == "timeout_seconds: give deadline_at or timeout_seconds, not both"


def refuse_x(value: str) -> None:
    if value == "x":
        raise serializers.ValidationError("not x")


class WithReason(StrictSerializer):
    plain_path = True
    reason = ReasonField()  # a subclass with a rule of its own (refuses blank text), no plain_value of its own


class WithValidator(StrictSerializer):
    plain_path = True
    name = NameField(validators=[refuse_x])


class WithHook(StrictSerializer):
    plain_path = True
    code = StrictCharField()

    def validate_code(self, value: str) -> str:
        return value.upper()


@pytest.mark.parametrize(
    ("serializer_class", "body"),
    [(WithReason, {"reason": "   "}), (WithValidator, {"name": "x"}), (WithHook, {"code": "x"})],
)
def test_fields_with_rules_of_their_own_go_the_full_way(
    serializer_class: type[StrictSerializer], body: dict[str, Any]
) -> None:
    assert serializer_class.plain_validated(body) is DEFER
    assert not assert_agrees(serializer_class, body)


class Plain(StrictSerializer):
    plain_path = True
    name = NameField(max_length=8)
    note = StrictCharField(required=False, allow_blank=True, max_length=4)
    count = uint32_field(1, 3, required=False, default=2)


@pytest.mark.parametrize(
    ("name", "note", "count"),
    list(
        itertools.product(
            ["a", "", "abcdefgh", "abcdefghi", "é", 1], ["", "abcd", "abcde", "\x00", None], [1, 3, 4, True]
        )
    ),
)
def test_a_plain_serializer_agrees_with_drf(name: Any, note: Any, count: Any) -> None:
    assert_agrees(Plain, {"name": name, "note": note, "count": count})
    assert_agrees(Plain, {"name": name})
