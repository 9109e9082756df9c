"""When a plan's version fires: the points of its schedule, and what the
misfire policy makes of the points the trigger loop reaches late."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from cronsim import CronSim

# Under SKIP a point still fires when the loop reaches it this late (the
# loop's own cadence, a busy database); later than that it is skipped.
SKIP_GRACE = timedelta(seconds=10)
ONE_MICROSECOND = timedelta(microseconds=1)


def points_from(schedule: dict[str, Any], anchor: datetime, start: datetime) -> Iterator[datetime]:
    """The schedule's points at or after `start`, ascending, in UTC. An
    interval schedule's points are anchor + k × interval (k ≥ 1); a cron
    schedule's are its matches in its time zone (cronsim: a local time that
    does not exist on a DST change fires at the first one that does)."""
    if "interval_seconds" in schedule:
        step = timedelta(seconds=schedule["interval_seconds"])
        k = max(1, math.ceil((start - anchor) / step))
        while True:
            yield anchor + k * step
            k += 1
    zone = ZoneInfo(schedule.get("timezone", "UTC"))
    for point in CronSim(schedule["cron"], (start - ONE_MICROSECOND).astimezone(zone)):
        # Started inside a repeated hour (fold=1), cronsim answers the first
        # occurrence of an ambiguous time, which lies before `start`: that
        # point is past (and may be decided already); the day fired once there.
        if point.astimezone(UTC) >= start:
            yield point.astimezone(UTC)


def first_point_after(schedule: dict[str, Any], anchor: datetime, moment: datetime) -> datetime:
    return next(points_from(schedule, anchor, moment + ONE_MICROSECOND))


@dataclass(frozen=True)
class Decision:
    point: datetime
    fire: bool
    reason: str = ""


def decide(points: list[datetime], misfire: dict[str, Any], now: datetime, complete: bool) -> list[Decision]:
    """Each due point (ascending, all ≤ now) fired or skipped by the policy.
    `complete`: `points` holds every due point (LATEST fires only the last
    one, so it waits for the complete list before firing any)."""
    policy = misfire["policy"]
    if policy == "SKIP":
        return [
            Decision(point, True) if now - point <= SKIP_GRACE else Decision(point, False, "missed its time")
            for point in points
        ]
    window = timedelta(seconds=misfire["catch_up_window_seconds"])
    outside = "outside the catch-up window"
    if policy == "CATCH_UP":
        return [Decision(point, True) if now - point <= window else Decision(point, False, outside) for point in points]
    superseded = [Decision(point, False, "superseded by a later point") for point in points]
    if not points or not complete:
        return superseded
    last = points[-1]
    return [*superseded[:-1], Decision(last, True) if now - last <= window else Decision(last, False, outside)]
