"""Template tags and filters of the operator console (templates/admin/)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from django import template

from orbit.console import data

register = template.Library()


@register.simple_tag
def orbit_dashboard() -> dict[str, Any]:
    return data.dashboard()


@register.filter
def age(seconds: float | None) -> str:
    return data.human_age(seconds)


@register.filter
def ms(value: datetime | None) -> str:
    """RFC 3339, UTC, to the millisecond."""
    if value is None:
        return "—"
    return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@register.filter
def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


@register.filter
def count(value: int | None) -> str:
    """10,000 style."""
    if value is None:
        return "—"
    return f"{value:,}"
