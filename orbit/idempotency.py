"""Idempotency-Key semantics shared by every mutating POST.

The record is keyed by (namespace, key). The first request inserts a
placeholder as its first write, so a concurrent twin blocks on the unique index
while holding no other lock, then finds the committed record and replays it.
Record, effect, audit and events commit in one transaction; a rejected request
(any OrbitError inside the effect) rolls the placeholder back with everything else.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import IntegrityError, OperationalError

from orbit.api.auth import Principal
from orbit.audit import atomic_with_events
from orbit.errors import IdempotencyConflict, InvalidArgument
from orbit.models import IdempotencyRecord

T = TypeVar("T")

# InnoDB deadlock and lock-wait timeout: the transaction was rolled back whole,
# so running it again is safe.
RETRYABLE_MYSQL_ERRNOS = frozenset({1213, 1205})
TRANSACTION_RETRIES = 5


@dataclass(frozen=True)
class Actor:
    principal: Principal
    request_id: str

    @property
    def namespace_id(self) -> str:
        return self.principal.namespace_id


@dataclass(frozen=True)
class Receipt:
    status: int
    data: dict[str, Any]


def validate_key(value: str | None) -> str:
    if value is None or value == "":
        raise InvalidArgument("Idempotency-Key: header is required")
    if len(value) > 255 or not all(0x20 <= ord(ch) <= 0x7E for ch in value):
        raise InvalidArgument("Idempotency-Key: must be 1-255 printable ASCII characters")
    return value


def request_digest(operation: str, target: str, body: dict[str, Any]) -> str:
    canonical = json.dumps(
        {"operation": operation, "target": target, "body": body},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def find_replay(namespace_id: str, key: str, operation: str, digest: str) -> Receipt | None:
    record = IdempotencyRecord.objects.filter(namespace_id=namespace_id, key=key).first()
    if record is None:
        return None
    if record.operation != operation or record.digest != digest:
        raise IdempotencyConflict("Idempotency-Key was already used for a different request")
    return Receipt(status=200, data={**record.response_data, "deduplicated": True})


def is_retryable(exc: OperationalError) -> bool:
    return bool(exc.args) and exc.args[0] in RETRYABLE_MYSQL_ERRNOS


def run_retrying(work: Callable[[], T]) -> T:
    """Runs a whole transaction again after an InnoDB deadlock or lock timeout."""
    for attempt in range(TRANSACTION_RETRIES):
        try:
            return work()
        except OperationalError as exc:
            if not is_retryable(exc) or attempt == TRANSACTION_RETRIES - 1:
                raise
            time.sleep(0.005 * (attempt + 1))
    raise AssertionError("unreachable")


def run_idempotent(
    *,
    actor: Actor,
    key: str,
    operation: str,
    target: str,
    body: dict[str, Any],
    validate: Callable[[], T],
    effect: Callable[[T], tuple[int, dict[str, Any]]],
) -> Receipt:
    """Replay, or validate and apply `effect` exactly once for (namespace, key).

    The order is the API's promise: an accepted request's replay gets its
    original receipt before any field rule or queue state is looked at.
    """
    digest = request_digest(operation, target, body)
    replay = find_replay(actor.namespace_id, key, operation, digest)
    if replay is not None:
        return replay
    validated = validate()

    def apply() -> Receipt:
        with atomic_with_events(durable=True):
            record = IdempotencyRecord.objects.create(
                namespace_id=actor.namespace_id,
                key=key,
                operation=operation,
                digest=digest,
                response_status=0,
                response_data={},
                request_id=actor.request_id,
            )
            status, data = effect(validated)
            data = {"deduplicated": False, **data}
            IdempotencyRecord.objects.filter(pk=record.pk).update(response_status=status, response_data=data)
        return Receipt(status=status, data=data)

    try:
        return run_retrying(apply)
    except IntegrityError:
        # A concurrent twin committed the same key first.
        replay = find_replay(actor.namespace_id, key, operation, digest)
        if replay is None:
            raise
        return replay
