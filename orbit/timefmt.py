from __future__ import annotations

from datetime import UTC, datetime


def format_time(value: datetime) -> str:
    """RFC 3339 UTC with `Z`, microseconds kept when present."""
    text = value.astimezone(UTC).isoformat()
    return text.replace("+00:00", "Z")
