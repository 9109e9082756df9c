from __future__ import annotations

from orbit.api.fields import ReasonField, StrictSerializer, Uint64StringField, uint32_field

# The application's quotas span all its namespaces, so they reach past a
# queue's (max_concurrency up to 100,000, max_unfinished_tasks up to
# 1,000,000); the defaults (100,000 and 10,000,000) lie inside.
MAX_ACTIVE_ATTEMPTS = 1_000_000
MAX_UNFINISHED_TASKS = 100_000_000


class ApplicationConfigureInput(StrictSerializer):
    expected_revision = Uint64StringField(nonzero=True)
    reason = ReasonField()
    max_active_attempts = uint32_field(1, MAX_ACTIVE_ATTEMPTS)
    max_unfinished_tasks = uint32_field(1, MAX_UNFINISHED_TASKS)
