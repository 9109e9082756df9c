"""The fence's names and limits, shared by every seam: the dialects, the two tables, the
identifier and token rules (Orbit's own), checked the same way for a guard call and a header."""

from __future__ import annotations

import datetime
from typing import Any

DIALECTS = ("mysql", "postgresql", "sqlite")
FENCE_TABLE = "orbit_fence"
# The fence rows of (key, slot): a key of capacity N > 1 has N valid holders at once, one per slot.
FENCE_SLOT_TABLE = "orbit_fence_slot"
OPERATION_TABLE = "orbit_fence_operation"
UINT64_MAX = 2**64 - 1
MAX_NAMESPACE = 64
MAX_KEY = 191  # Orbit's own limit for concurrency keys
MAX_OPERATION_ID = 191
MAX_SLOT = 2**31 - 1  # a slot column's range; Orbit's slots are 0…capacity−1 (capacity at most 1000)


def _check_dialect(dialect: str) -> str:
    if dialect not in DIALECTS:
        raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}; got {dialect!r}")
    return dialect


def _identifier(value: Any, what: str, limit: int) -> str:
    # Orbit's key rule for all three: MySQL's utf8mb4_bin pads trailing spaces, so a value
    # ending in whitespace would not be byte-exact there; refusing it everywhere keeps one rule.
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    if len(value) > limit:
        raise ValueError(f"{what} is {len(value)} characters, over the limit of {limit}")
    if value != value.strip() or any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in value):
        raise ValueError(f"{what} must not have leading/trailing whitespace or control characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode text: {exc}") from None
    return value


def _token(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= UINT64_MAX:
        raise ValueError(f"token must be an int from 1 to 2**64-1 (Orbit's concurrency_token); got {value!r}")
    return value


def _slot(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SLOT:
        raise ValueError(f"slot must be None or an int from 0 to {MAX_SLOT} (Orbit's concurrency_slot); got {value!r}")
    return value


def _aware(value: datetime.datetime) -> datetime.datetime:
    if value.tzinfo is None:
        raise ValueError("lease_expires_at must be an aware datetime (Orbit's are UTC)")
    return value.astimezone(datetime.UTC)
