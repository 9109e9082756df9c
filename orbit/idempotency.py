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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import IntegrityError

from orbit.errors import IdempotencyConflict, InvalidArgument
from orbit.models import IdempotencyRecord
from orbit.principal import Actor
from orbit.transactions import outermost

T = TypeVar("T")


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

    @outermost
    def apply() -> Receipt:
        # The record, the effect, its audit row and events: one transaction.
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
        return apply()
    except IntegrityError:
        # A concurrent twin committed the same key first.
        replay = find_replay(actor.namespace_id, key, operation, digest)
        if replay is None:
            raise
        return replay
