"""Key policy verbs (SPEC §12): create, configure, retire, read, and the
reconcile that brings the key rows' cached capacity and rate state in line
with a policy change.

Each mutating verb runs inside the transaction opened by the idempotency
runner (orbit.transactions.outermost) and writes its audit row and event
there. Locks, in the global order (orbit.locking.LOCK_ORDER): the policy row
(configure, retire; a create inserts it), then the application row, whose
key_policy_generation every change moves by one so that each process reads
the namespace's policies again (tasks.key_rules.policies_of).

A policy's match is what it is: configure replaces its capacity and rate,
never its key or prefix (retire it and create another to match other keys).

The key rows cache each key's resolved capacity and next_start_at for the
lease's scan. After a change commits, reconcile_policy refreshes the rows the
policy matches, in chunks of their own transactions, and records the
revision it applied; the maintenance loop finishes a reconcile a crash cut
short (catch_up_policies)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import takewhile
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from orbit.audit import record_management_change
from orbit.db.rows import Pk, keyset_page, update_each_by_pk
from orbit.errors import NotFound, PermissionDenied, StateConflict, require_revision
from orbit.fields import is_resource_id
from orbit.models import Application, Namespace
from orbit.principal import Actor, Principal
from orbit.timefmt import format_time
from orbit.transactions import outermost
from tasks.key_rules import cache_rule, read_policy_set
from tasks.locks import lock_application_state
from tasks.models import ConcurrencyKey, KeyMatch, KeyPolicy

logger = logging.getLogger("orbit.key_policies")

# Key rows locked and refreshed per reconcile transaction.
RECONCILE_CHUNK = 500
# A policy whose reconcile has not finished this long after its change is
# taken up by the maintenance loop (the request's own reconcile normally
# finishes well within it; seconds).
CATCH_UP_AFTER = timedelta(seconds=5)


@dataclass(frozen=True)
class PolicyRate:
    starts: int
    per_seconds: int
    burst: int = 1


@dataclass(frozen=True)
class PolicyRule:
    """What configure replaces: the capacity and the rate (None: no rate)."""

    capacity: int
    rate: PolicyRate | None


def policy_snapshot(policy: KeyPolicy) -> dict[str, Any]:
    snapshot: dict[str, Any] = {
        "id": policy.id,
        "namespace_id": policy.namespace_id,
        "match": {policy.match_kind: policy.match_value},
        "capacity": policy.capacity,
    }
    if policy.rate_starts is not None and policy.rate_per_seconds is not None:
        snapshot["rate"] = {
            "starts": policy.rate_starts,
            "per_seconds": policy.rate_per_seconds,
            "burst": policy.rate_burst or 1,
        }
    snapshot.update(
        revision=str(policy.revision),
        created_at=format_time(policy.created_at),
        updated_at=format_time(policy.updated_at),
    )
    if policy.retired_at is not None:
        snapshot["retired_at"] = format_time(policy.retired_at)
    return snapshot


def _apply_rule(policy: KeyPolicy, rule: PolicyRule) -> None:
    policy.capacity = rule.capacity
    rate = rule.rate
    policy.rate_starts = rate.starts if rate else None
    policy.rate_per_seconds = rate.per_seconds if rate else None
    policy.rate_burst = rate.burst if rate else None


def _next_generation(application_id: str) -> None:
    """Every process's copy of the application's policies is stale from this commit on."""
    Application.objects.filter(id=application_id).update(key_policy_generation=F("key_policy_generation") + 1)


def _match_text(kind: str, value: str) -> str:
    return f"{kind} {value!r}"


def policy_create(*, actor: Actor, kind: str, value: str, rule: PolicyRule, reason: str) -> dict[str, Any]:
    """A live policy for one key or one prefix. Caller holds the transaction.

    The insert is the transaction's first lock: a concurrent create of the
    same match waits on uniq_key_policy_live_match holding nothing else, and
    fails there once the winner commits."""
    conflict = f"a live key policy already matches {_match_text(kind, value)}"
    if KeyPolicy.objects.filter(
        namespace_id=actor.namespace_id, match_kind=kind, match_value=value, live=True
    ).exists():
        raise StateConflict(conflict)
    now = timezone.now()
    policy = KeyPolicy(
        namespace_id=actor.namespace_id,
        match_kind=kind,
        match_value=value,
        revision=1,
        live=True,
        applied_revision=0,
        created_at=now,
        updated_at=now,
    )
    _apply_rule(policy, rule)
    try:
        with transaction.atomic():
            policy.save(force_insert=True)
    except IntegrityError as exc:
        raise StateConflict(conflict) from exc
    _next_generation(actor.principal.application_id)
    snapshot = policy_snapshot(policy)
    record_management_change(
        actor,
        action="key_policy.created",
        target_type="key_policy",
        target_id=policy.id,
        reason=reason,
        before=None,
        after=snapshot,
    )
    return snapshot


def _locked_live_policy(actor: Actor, policy_id: str, expected_revision: int) -> KeyPolicy:
    """The policy locked for a change: in the actor's namespace, live, at the expected revision."""
    if not is_resource_id(policy_id):
        raise NotFound("key policy not found")
    policy = KeyPolicy.objects.select_for_update().filter(id=policy_id).first()
    if policy is None or policy.namespace_id != actor.namespace_id:
        raise NotFound("key policy not found")
    if policy.retired_at is not None:
        raise StateConflict("key policy is retired")
    require_revision(expected_revision, policy.revision)
    return policy


def policy_configure(
    *, actor: Actor, policy_id: str, expected_revision: int, reason: str, rule: PolicyRule
) -> dict[str, Any]:
    """Full replacement of the capacity and rate; revision + 1. Holders are
    kept: a lower capacity only stops new grants until fewer hold."""
    policy = _locked_live_policy(actor, policy_id, expected_revision)
    before = policy_snapshot(policy)
    _apply_rule(policy, rule)
    policy.revision += 1
    policy.updated_at = timezone.now()
    policy.save(update_fields=["capacity", "rate_starts", "rate_per_seconds", "rate_burst", "revision", "updated_at"])
    _next_generation(actor.principal.application_id)
    after = policy_snapshot(policy)
    record_management_change(
        actor,
        action="key_policy.configured",
        target_type="key_policy",
        target_id=policy.id,
        reason=reason,
        before=before,
        after=after,
    )
    return after


def policy_retire(*, actor: Actor, policy_id: str, expected_revision: int, reason: str) -> dict[str, Any]:
    """For good: its keys fall back to the next rule that matches them (a
    shorter prefix, or capacity 1 and no rate), and its match is free for a
    new policy. Reads keep answering it, with retired_at."""
    policy = _locked_live_policy(actor, policy_id, expected_revision)
    before = policy_snapshot(policy)
    now = timezone.now()
    policy.live = None  # out of the unique constraint (it holds among live policies only)
    policy.retired_at = now
    policy.revision += 1
    policy.updated_at = now
    policy.save(update_fields=["live", "retired_at", "revision", "updated_at"])
    _next_generation(actor.principal.application_id)
    after = policy_snapshot(policy)
    record_management_change(
        actor,
        action="key_policy.retired",
        target_type="key_policy",
        target_id=policy.id,
        reason=reason,
        before=before,
        after=after,
    )
    return after


def _require_reader(principal: Principal) -> None:
    """keys:manage or tasks:read, over every queue: a policy governs keys that
    every queue's tasks hold, as reading a key takes."""
    if "keys:manage" not in principal.scopes and "tasks:read" not in principal.scopes:
        raise PermissionDenied("credential lacks scope keys:manage (or tasks:read over all queues)")
    principal.require_all_queues()


def policy_get(*, principal: Principal, policy_id: str) -> dict[str, Any]:
    _require_reader(principal)
    if not is_resource_id(policy_id):
        raise NotFound("key policy not found")
    policy = KeyPolicy.objects.filter(id=policy_id, namespace_id=principal.namespace_id).first()
    if policy is None:
        raise NotFound("key policy not found")
    return policy_snapshot(policy)


def policy_list(*, principal: Principal, after_id: str | None, limit: int) -> tuple[list[dict[str, Any]], str | None]:
    """Every policy of the namespace, retired ones too, in id order."""
    _require_reader(principal)
    rows, next_id = keyset_page(KeyPolicy.objects.filter(namespace_id=principal.namespace_id), after_id, limit)
    return [policy_snapshot(policy) for policy in rows], next_id


# --------------------------------------------------------------------------- reconcile


def prefix_end(prefix: str) -> str | None:
    """The least string above every string that starts with `prefix` (None:
    there is none). Code point order is UTF-8's byte order, so this bounds
    the prefix's byte range: drop trailing U+10FFFF, then raise the last
    character by one, over the surrogates (never in a key)."""
    head = prefix.rstrip(chr(sys.maxunicode))
    if not head:
        return None
    last = ord(head[-1]) + 1
    if 0xD800 <= last <= 0xDFFF:
        last = 0xE000
    return head[:-1] + chr(last)


@outermost
def _reconcile_chunk(namespace_id: str, kind: str, value: str, after: str | None) -> tuple[int, str | None]:
    """One transaction: locks the next RECONCILE_CHUNK key rows the match
    covers (ascending key bytes, the lock order), resolves each with the
    namespace's policies as committed now (read after the locks), writes the
    cached columns that changed. Returns the rows changed and the key to go
    on after (None: done).

    The application's state row comes first, as for every other transaction
    that locks key rows: a round locks the keys of its results, Starts and
    leases in turn, each part in ascending order but not the whole, which is
    safe only because they all hold the application's row first."""
    application_id = Namespace.objects.filter(id=namespace_id).values_list("application_id", flat=True).first()
    if application_id is None:
        return 0, None
    lock_application_state(application_id)
    rows_of = ConcurrencyKey.objects.select_for_update().filter(namespace_id=namespace_id)
    if kind == KeyMatch.KEY:
        rows = list(rows_of.filter(key=value).order_by("key")) if after is None else []
        last = None
    else:
        rows_of = rows_of.filter(key__gt=after) if after is not None else rows_of.filter(key__gte=value)
        end = prefix_end(value)
        if end is not None:
            rows_of = rows_of.filter(key__lt=end)
        taken = list(rows_of.order_by("key")[:RECONCILE_CHUNK])
        rows = list(takewhile(lambda row: row.key.startswith(value), taken))
        last = rows[-1].key if len(rows) == RECONCILE_CHUNK else None
    if not rows:
        return 0, None
    policies = read_policy_set(namespace_id)
    now = timezone.now()
    changes: dict[Pk, dict[str, Any]] = {}
    for row in rows:
        if cache_rule(row, policies.resolve(row.key), now):
            changes[row.pk] = {"capacity": row.capacity, "rate_tat": row.rate_tat, "next_start_at": row.next_start_at}
    if changes:
        update_each_by_pk(ConcurrencyKey, changes)
    return len(changes), last


def reconcile_policy(policy_id: str) -> int:
    """Refreshes the cached capacity and rate state of every key row the
    policy matches, then records its revision as applied. Rerunnable: a row
    already right is left alone, and a later change's reconcile covers what
    an earlier one raced with. Returns the rows changed."""
    policy = KeyPolicy.objects.filter(id=policy_id).first()
    if policy is None or policy.applied_revision >= policy.revision:
        return 0
    revision = policy.revision
    changed, after = 0, None
    while True:
        count, after = _reconcile_chunk(policy.namespace_id, policy.match_kind, policy.match_value, after)
        changed += count
        if after is None:
            break
    # Never backwards: a later revision's reconcile may have finished first.
    KeyPolicy.objects.filter(id=policy_id, applied_revision__lt=revision).update(applied_revision=revision)
    return changed


def reconcile_after_commit(policy_id: str) -> None:
    """A verb's reconcile, once its change committed. A failure here leaves
    the change committed and the catch-up to finish it: logged, not raised."""
    try:
        reconcile_policy(policy_id)
    except Exception:
        logger.exception("key policy %s: reconcile failed; the maintenance loop will finish it", policy_id)


def catch_up_policies(now: datetime | None = None) -> int:
    """Finishes the reconciles a crash cut short: policies changed more than
    CATCH_UP_AFTER ago whose applied revision is behind. Returns the policies
    brought up to date."""
    cutoff = (now or timezone.now()) - CATCH_UP_AFTER
    behind = list(
        KeyPolicy.objects.filter(applied_revision__lt=F("revision"), updated_at__lt=cutoff)
        .order_by("updated_at")
        .values_list("id", flat=True)[:100]
    )
    for policy_id in behind:
        reconcile_policy(policy_id)
    return len(behind)
