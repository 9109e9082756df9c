"""Read verbs for concurrency keys: GET /v1/concurrency-keys and the console.

A key's row is its permits and its token sequence; it is never reset or
deleted, so these verbs only read. Every read is an index range: the key rows
by (namespace_id, key) (uniq_ckey_ns_key), the slot rows of keys with holders
beyond slot 0 by (namespace_id, key, slot) (uniq_cslot_ns_key_slot), the
holder attempts by their primary keys, the waiting tasks as a count over
idx_task_ns_ckey (namespace_id, concurrency_key, queue_id, state, ...), read
from the index alone. Capacity, rate and policy are the key's rule as the
namespace's live policies resolve it now (SPEC §12): what the next lease
applies, which a lowered capacity's remaining holders may exceed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from itertools import takewhile
from typing import Any

from django.db.models import Count
from django.utils import timezone

from orbit.errors import NotFound
from orbit.models import Application, Namespace
from orbit.principal import Principal
from orbit.timefmt import format_time
from tasks.key_rules import KeyRule, PolicySet, policies_of
from tasks.models import Attempt, ConcurrencyKey, ConcurrencySlot, Task, TaskState

# IN lists of at most this many keys per waiting count.
_KEY_CHUNK = 500


def waiting_counts(namespace_id: str, keys: list[str]) -> dict[str, int]:
    """WAITING tasks per key of the namespace, in every queue."""
    counts: dict[str, int] = {}
    for start in range(0, len(keys), _KEY_CHUNK):
        rows = (
            Task.objects.filter(
                namespace_id=namespace_id, concurrency_key__in=keys[start : start + _KEY_CHUNK], state=TaskState.WAITING
            )
            .values_list("concurrency_key")
            .annotate(n=Count("*"))
            .order_by()
        )
        counts.update(dict(rows))
    return counts


def namespace_policies(namespace_id: str) -> PolicySet:
    """The namespace's live key policies as of its application's row now."""
    generation = (
        Application.objects.filter(id__in=Namespace.objects.filter(id=namespace_id).values("application_id"))
        .values_list("key_policy_generation", flat=True)
        .first()
    )
    return policies_of(namespace_id, generation or 0)


@dataclass(frozen=True)
class Holder:
    """One valid permit of a key: its slot and the attempt holding it (None
    when that attempt's row is gone, which only a damaged database shows)."""

    slot: int
    attempt_id: str
    task_id: str
    attempt: Attempt | None


def key_holders(rows: list[ConcurrencyKey]) -> dict[tuple[str, str], list[Holder]]:
    """Every key's holders by slot: slot 0 on the key row, slots 1…N−1 on
    their slot rows (read only for keys whose row counts more holders than
    slot 0 can be, so a key of capacity 1 costs no slot read)."""
    found: dict[tuple[str, str], list[Holder]] = {}
    for row in rows:
        if row.holder_attempt_id:
            found.setdefault((row.namespace_id, row.key), []).append(
                Holder(0, row.holder_attempt_id, row.holder_task_id, None)
            )
    beyond_slot_0: dict[str, list[str]] = {}
    for row in rows:
        if row.holders > (1 if row.holder_attempt_id else 0):
            beyond_slot_0.setdefault(row.namespace_id, []).append(row.key)
    for namespace_id, keys in beyond_slot_0.items():
        for start in range(0, len(keys), _KEY_CHUNK):
            slots = (
                ConcurrencySlot.objects.filter(namespace_id=namespace_id, key__in=keys[start : start + _KEY_CHUNK])
                .exclude(holder_attempt_id="")
                .order_by("key", "slot")
            )
            for slot in slots:
                found.setdefault((namespace_id, slot.key), []).append(
                    Holder(slot.slot, slot.holder_attempt_id, slot.holder_task_id, None)
                )
    ids = [holder.attempt_id for held in found.values() for holder in held]
    attempts = holder_attempts(ids)
    return {
        ident: [Holder(h.slot, h.attempt_id, h.task_id, attempts.get(h.attempt_id)) for h in held]
        for ident, held in found.items()
    }


def holder_attempts(ids: list[str]) -> dict[str, Attempt]:
    if not ids:
        return {}
    attempts = Attempt.objects.filter(id__in=ids).only(
        "id", "task_id", "worker_id", "leased_at", "started_at", "concurrency_token", "state", "queue_id"
    )
    return {attempt.id: attempt for attempt in attempts}


def holder_view(holder: Holder, row: ConcurrencyKey, *, slot: bool) -> dict[str, Any]:
    held: dict[str, Any] = {}
    if slot:
        held["slot"] = holder.slot
    held.update(attempt_id=holder.attempt_id, task_id=holder.task_id)
    if holder.attempt is not None:
        held["worker_id"] = holder.attempt.worker_id
        if holder.attempt.concurrency_token is not None:
            held["token"] = str(holder.attempt.concurrency_token)
    # The row's updated_at is its last lease or release: the holder's lease.
    held["since"] = format_time(holder.attempt.leased_at if holder.attempt is not None else row.updated_at)
    return held


def rule_view(rule: KeyRule, row: ConcurrencyKey | None, now: datetime) -> dict[str, Any]:
    """The key's rule: capacity, the policy that gave it (absent: the
    default), the start rate and, with one, when a lease may next take an
    attempt of the key (at most now: it may now)."""
    data: dict[str, Any] = {"capacity": rule.capacity}
    if rule.policy_id is not None:
        data["policy_id"] = rule.policy_id
    if rule.rate is not None:
        rate = rule.rate
        data["rate"] = {"starts": rate.starts, "per_seconds": rate.per_seconds, "burst": rate.burst}
        tat, reserved = (row.rate_tat, row.rate_reserved) if row is not None else (None, 0)
        data["reserved_starts"] = reserved
        data["next_start_at"] = format_time(max(now, rate.next_lease_at(tat, reserved, now)))
    return data


def key_view(row: ConcurrencyKey, waiting: int, holders: list[Holder], rule: KeyRule, now: datetime) -> dict[str, Any]:
    """The wire shape of one key: its rule (capacity, policy, rate), its
    holders by slot, `holder` as before for a key of capacity 1 (omitted when
    free), the highest token (the sequence's value: every token issued is at
    most it, the next one is above it), the waiting count."""
    data: dict[str, Any] = {"key": row.key}
    if rule.capacity == 1 and holders:
        data["holder"] = holder_view(holders[0], row, slot=False)
    data.update(rule_view(rule, row, now))
    data["holders"] = [holder_view(holder, row, slot=True) for holder in holders]
    data.update(highest_token=str(row.version), waiting_tasks=waiting, updated_at=format_time(row.updated_at))
    return data


def unleased_key_view(key: str, waiting: int, rule: KeyRule, now: datetime) -> dict[str, Any]:
    """A key whose tasks wait but never took a permit: its row (and token
    sequence) is made by its first lease."""
    return {"key": key, **rule_view(rule, None, now), "holders": [], "highest_token": "0", "waiting_tasks": waiting}


def describe_keys(namespace_id: str, rows: list[ConcurrencyKey]) -> list[dict[str, Any]]:
    now = timezone.now()
    counts = waiting_counts(namespace_id, [row.key for row in rows])
    holders = key_holders(rows)
    policies = namespace_policies(namespace_id)
    return [
        key_view(
            row, counts.get(row.key, 0), holders.get((row.namespace_id, row.key), []), policies.resolve(row.key), now
        )
        for row in rows
    ]


def key_row(namespace_id: str, key: str) -> ConcurrencyKey | None:
    return ConcurrencyKey.objects.filter(namespace_id=namespace_id, key=key).first()


def key_get(*, principal: Principal, key: str) -> dict[str, Any]:
    """One key of the credential's namespace, compared byte for byte."""
    principal.require("tasks:read")
    principal.require_all_queues()
    return describe_key(principal.namespace_id, key)


def describe_key(namespace_id: str, key: str) -> dict[str, Any]:
    row = key_row(namespace_id, key)
    if row is not None:
        return describe_keys(namespace_id, [row])[0]
    waiting = waiting_counts(namespace_id, [key]).get(key, 0)
    if not waiting:
        raise NotFound("concurrency key not found")
    return unleased_key_view(key, waiting, namespace_policies(namespace_id).resolve(key), timezone.now())


def key_list(
    *, principal: Principal, prefix: str, after: str | None, limit: int
) -> tuple[list[dict[str, Any]], str | None]:
    """The namespace's keys (those that ever leased: a key's row is made by
    its first lease) that start with `prefix`, in byte order, a page
    after the key `after`, and the key to continue after (None: the last page).

    The keys starting with a prefix are one contiguous range of the byte
    order, from the prefix itself: read from there along the unique index and
    stop at the first key without the prefix (LIKE would fold case on SQLite)."""
    principal.require("tasks:read")
    principal.require_all_queues()
    rows = ConcurrencyKey.objects.filter(namespace_id=principal.namespace_id)
    rows = rows.filter(key__gt=after) if after is not None and after >= prefix else rows.filter(key__gte=prefix)
    taken = list(takewhile(lambda row: row.key.startswith(prefix), rows.order_by("key")[: limit + 1]))
    page = taken[:limit]
    next_key = page[-1].key if len(taken) > limit else None
    return describe_keys(principal.namespace_id, page), next_key
