"""Field rules of the key policy verbs (SPEC §12): a match names one key or
one prefix, under the concurrency key's own rules (1–191 characters, no
control characters, no whitespace at either end)."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from orbit.api.fields import ReasonField, StrictSerializer, Uint64StringField, uint32_field
from tasks.serializers import ConcurrencyKeyField

MAX_CAPACITY = 1000
MAX_RATE_STARTS = 100_000
MAX_RATE_PER_SECONDS = 3600
MAX_RATE_BURST = 100_000


class KeyMatchInput(StrictSerializer):
    key = ConcurrencyKeyField(required=False)
    prefix = ConcurrencyKeyField(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        for name, value in attrs.items():
            # The concurrency key's "" means "no key"; a match always names one.
            if value == "":
                raise serializers.ValidationError({name: ["must not be empty"]})
        if len(attrs) != 1:
            raise serializers.ValidationError("give exactly one of key or prefix")
        return attrs


class KeyRateInput(StrictSerializer):
    starts = uint32_field(1, MAX_RATE_STARTS)
    per_seconds = uint32_field(1, MAX_RATE_PER_SECONDS)
    burst = uint32_field(1, MAX_RATE_BURST, required=False, default=1)


class KeyPolicyCreateInput(StrictSerializer):
    match = KeyMatchInput()
    capacity = uint32_field(1, MAX_CAPACITY, required=False, default=1)
    rate = KeyRateInput(required=False)
    reason = ReasonField()


class KeyPolicyConfigureInput(StrictSerializer):
    """Full replacement: capacity is sent every time; a rate omitted is no rate."""

    expected_revision = Uint64StringField(nonzero=True)
    reason = ReasonField()
    capacity = uint32_field(1, MAX_CAPACITY)
    rate = KeyRateInput(required=False)


class KeyPolicyRetireInput(StrictSerializer):
    expected_revision = Uint64StringField(nonzero=True)
    reason = ReasonField()
