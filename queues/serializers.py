from __future__ import annotations

from orbit.api.fields import (
    NameField,
    ReasonField,
    StrictBooleanField,
    StrictSerializer,
    Uint64StringField,
    uint32_field,
)


class QueueCreateInput(StrictSerializer):
    name = NameField()
    max_concurrency = uint32_field(1, 100_000)
    rate_per_second = uint32_field(1, 1_000_000)
    # Omitted or zero means the default 100000.
    max_unfinished_tasks = uint32_field(0, 1_000_000, required=False)


class QueueConfigureInput(StrictSerializer):
    expected_revision = Uint64StringField(nonzero=True)
    reason = ReasonField()
    paused = StrictBooleanField()
    max_concurrency = uint32_field(1, 100_000)
    rate_per_second = uint32_field(1, 1_000_000)
    max_unfinished_tasks = uint32_field(1, 1_000_000)


class QueueRetireInput(StrictSerializer):
    expected_revision = Uint64StringField(nonzero=True)
    reason = ReasonField()
