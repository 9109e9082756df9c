"""Template tags and filters of the operator console (templates/admin/)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django import template

from console import data
from console.admin_base import change_url, escape_direction_controls, format_ms, may_view, short_id
from queues.models import Queue
from tasks.models import Task

register = template.Library()


@register.simple_tag(takes_context=True)
def orbit_dashboard(context: template.Context) -> dict[str, Any] | None:
    """The dashboard's figures, or None for a user who may not view queues:
    every figure on it (names, backlog, permits, window, minutes) is a queue's.
    The links to a queue's tasks only for a user who may view tasks."""
    request = context["request"]
    if not may_view(request, Queue):
        return None
    return {**data.dashboard(), "tasks_viewable": may_view(request, Task)}


@register.filter
def age(seconds: float | None) -> str:
    return data.human_age(seconds)


@register.filter
def ms(value: datetime | None) -> str:
    """RFC 3339, UTC, to the millisecond and below (console.admin_base.format_ms)."""
    return format_ms(value)


@register.filter
def pretty_json(value: Any) -> str:
    return escape_direction_controls(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))


@register.filter
def count(value: int | None) -> str:
    """10,000 style."""
    if value is None:
        return "—"
    return f"{value:,}"


@register.filter(name="short_id")
def short_id_filter(value: str) -> str:
    """An id's first 8, the whole in the tooltip (console.admin_base.short_id)."""
    return short_id(str(value))


@register.filter
def task_url(task_id: str) -> str:
    """The console page of the task with this id."""
    return change_url(Task, task_id)
