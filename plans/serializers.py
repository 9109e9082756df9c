from __future__ import annotations

import re
import zoneinfo
from functools import cache
from typing import Any
from zoneinfo import ZoneInfo

from cronsim import CronSim, CronSimError
from django.utils import timezone
from rest_framework import serializers

from orbit.api.fields import (
    NameField,
    ReasonField,
    StrictCharField,
    StrictChoiceField,
    StrictSerializer,
    Uint64StringField,
    uint32_field,
)
from tasks.serializers import SubmitTaskInput

MAX_INTERVAL_SECONDS = 366 * 86400
MAX_CATCH_UP_WINDOW_SECONDS = 7 * 86400
POLICIES = ("SKIP", "CATCH_UP", "LATEST")


# A step on the month's last day (L/2, LW/3), which cronsim reads as the day alone.
STEPPED_LAST_DAY = re.compile(r"LW?/", re.IGNORECASE)


class ScheduleInput(StrictSerializer):
    cron = StrictCharField(required=False, max_length=255)
    timezone = StrictCharField(required=False, max_length=64)
    interval_seconds = uint32_field(1, MAX_INTERVAL_SECONDS, required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("cron" in attrs) == ("interval_seconds" in attrs):
            raise serializers.ValidationError("must hold either cron (with timezone) or interval_seconds")
        if "interval_seconds" in attrs:
            if "timezone" in attrs:
                raise serializers.ValidationError({"timezone": ["only with cron"]})
            return attrs
        name = attrs.get("timezone", "UTC")
        if name not in iana_zone_names():
            raise serializers.ValidationError({"timezone": ["must be an IANA time zone, e.g. Europe/Berlin"]})
        try:
            fields = attrs["cron"].split()
            if len(fields) != 5:  # cronsim also reads a sixth field, of seconds
                raise CronSimError("Wrong number of fields")
            if any(STEPPED_LAST_DAY.match(term) for term in fields[2].split(",")):
                raise CronSimError("Bad day-of-month")  # cronsim takes L/2 as L: a step it ignores
            next(CronSim(attrs["cron"], timezone.now().astimezone(ZoneInfo(name))))
        except CronSimError as exc:
            raise serializers.ValidationError({"cron": [f"must be a 5-field cron expression ({exc})"]}) from exc
        except StopIteration as exc:  # every field valid, no date has them all (the 29th Monday #5 of February)
            raise serializers.ValidationError({"cron": ["matches no date: no day has every field it names"]}) from exc
        return attrs


# Names the host's zone database holds that are not zones of the IANA database:
# the host's own setting (which differs between nodes), a POSIX default rule
# file, and tzdata's placeholder "Factory".
HOST_ZONE_NAMES = frozenset({"localtime", "posixrules", "Factory"})


@cache
def iana_zone_names() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones()) - HOST_ZONE_NAMES


class MisfireInput(StrictSerializer):
    policy = StrictChoiceField(POLICIES)
    catch_up_window_seconds = uint32_field(1, MAX_CATCH_UP_WINDOW_SECONDS, required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        windowed = attrs["policy"] != "SKIP"
        if windowed and "catch_up_window_seconds" not in attrs:
            raise serializers.ValidationError({"catch_up_window_seconds": [f"required for {attrs['policy']}"]})
        if not windowed and "catch_up_window_seconds" in attrs:
            raise serializers.ValidationError({"catch_up_window_seconds": ["not used by SKIP"]})
        return attrs


class PlanTaskInput(SubmitTaskInput):
    """A submit's fields without the queue (the plan's) or absolute times (a
    template cannot hold one; timeout_seconds is relative to each task)."""

    plain_path = False
    # DRF drops an inherited field set to None; the stubs know the field only.
    queue_id = None  # type: ignore[assignment]
    available_at = None  # type: ignore[assignment]
    start_deadline_at = None  # type: ignore[assignment]
    deadline_at = None  # type: ignore[assignment]


class DefinitionInput(StrictSerializer):
    task = PlanTaskInput()


class PlanBodyInput(StrictSerializer):
    schedule = ScheduleInput()
    misfire = MisfireInput()
    definition = DefinitionInput()


class PlanCreateInput(PlanBodyInput):
    name = NameField()
    queue_id = StrictCharField(max_length=32)


class PlanUpdateInput(PlanBodyInput):
    expected_revision = Uint64StringField(nonzero=True)
    reason = ReasonField()


class PlanChangeInput(StrictSerializer):
    expected_revision = Uint64StringField(nonzero=True)
    reason = ReasonField()
