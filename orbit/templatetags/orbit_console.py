"""Template tags and filters of the operator console (templates/admin/)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django import template

from orbit.admin_base import format_ms
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
    """RFC 3339, UTC, to the millisecond and below (orbit.admin_base.format_ms)."""
    return format_ms(value)


@register.filter
def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


@register.filter
def count(value: int | None) -> str:
    """10,000 style."""
    if value is None:
        return "—"
    return f"{value:,}"
