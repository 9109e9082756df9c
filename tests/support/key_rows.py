"""Key policies and key rows made directly, for the read surfaces of capacity and rate
(the key API, blockers, the console, metrics, orbit_check) without going through the lease."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import F
from django.utils import timezone

from orbit.models import Application, Namespace
from tasks.models import Attempt, ConcurrencyKey, ConcurrencySlot, KeyMatch, KeyPolicy


def make_policy(
    namespace: Namespace,
    *,
    key: str | None = None,
    prefix: str | None = None,
    capacity: int = 1,
    rate: tuple[int, int, int] | None = None,
    changed_at: datetime | None = None,
) -> KeyPolicy:
    """A live policy, and the application's generation moved so every process reads it.
    `changed_at`: when it was made (by default a minute ago, so that orbit_check holds
    every lease of the test to it)."""
    assert (key is None) != (prefix is None)
    when = changed_at or timezone.now() - timedelta(minutes=1)
    policy = KeyPolicy.objects.create(
        namespace_id=namespace.id,
        match_kind=KeyMatch.KEY if key is not None else KeyMatch.PREFIX,
        match_value=key if key is not None else prefix,
        capacity=capacity,
        rate_starts=rate[0] if rate else None,
        rate_per_seconds=rate[1] if rate else None,
        rate_burst=rate[2] if rate else None,
        created_at=when,
        updated_at=when,
    )
    Application.objects.filter(id=namespace.application_id).update(key_policy_generation=F("key_policy_generation") + 1)
    return policy


def hold_slots(namespace_id: str, key: str, attempts: list[Attempt], *, version: int | None = None) -> ConcurrencyKey:
    """Makes the key's row (and slot rows) say that `attempts` hold it, each on
    its concurrency_slot (None: slot 0, the row's), as the lease would have."""
    now = timezone.now()
    highest = max((a.concurrency_token or 0) for a in attempts) if attempts else 0
    row, _ = ConcurrencyKey.objects.update_or_create(
        namespace_id=namespace_id,
        key=key,
        defaults={"version": version if version is not None else highest, "updated_at": now},
    )
    row.holders = len(attempts)
    row.holder_attempt_id = row.holder_task_id = ""
    for attempt in attempts:
        slot = attempt.concurrency_slot or 0
        if slot == 0:
            row.holder_attempt_id, row.holder_task_id = attempt.id, attempt.task_id
        else:
            ConcurrencySlot.objects.update_or_create(
                namespace_id=namespace_id,
                key=key,
                slot=slot,
                defaults={
                    "holder_attempt_id": attempt.id,
                    "holder_task_id": attempt.task_id,
                    "token": attempt.concurrency_token or 0,
                    "updated_at": now,
                },
            )
    row.save()
    return row
