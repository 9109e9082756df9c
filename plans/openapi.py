"""The plans app's OpenAPI objects and body rules: the plan
(plans.actions.plan_snapshot), its triggers, the two schedule forms and the
misfire rule. Registered by PlansConfig.ready() (orbit.api.openapi_registry)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.plumbing import ResolvedComponent

from orbit.api import openapi_objects as shapes
from orbit.api.openapi_registry import (
    Schema,
    register_body_rule,
    register_component,
    register_referenced_serializer,
)
from plans.models import PlanState, TriggerOutcome
from plans.serializers import POLICIES, DefinitionInput, MisfireInput, ScheduleInput

PLAN = shapes.closed(
    {
        "id": shapes.ID,
        "namespace_id": shapes.ID,
        "queue_id": shapes.ID,
        "name": {"type": "string", "minLength": 1, "maxLength": 128},
        "state": shapes.ref("PlanState"),
        "version": {**shapes.COUNT, "minimum": 1},
        "revision": shapes.REVISION,
        # The plan's version holds them as they were accepted.
        "schedule": shapes.ref("ScheduleInput"),
        "misfire": shapes.ref("MisfireInput"),
        "definition": shapes.ref("DefinitionInput"),
        "next_fire_at": shapes.TIME,
    },
    optional=("next_fire_at",),
)

TRIGGER = shapes.closed(
    {
        "scheduled_at": shapes.TIME,
        "version": {**shapes.COUNT, "minimum": 1},
        "outcome": shapes.ref("TriggerOutcome"),
        "decided_at": shapes.TIME,
        "task_id": shapes.ID,
        "reason": {"type": "string"},
    },
    optional=("task_id", "reason"),
)


# --------------------------------------------------------------------------- cron


def _anycase(word: str) -> str:
    return "".join(f"[{ch.upper()}{ch.lower()}]" for ch in word)


def _names(words: str) -> str:
    return "|".join(_anycase(word) for word in words.split())


_STEP = "0*[1-9][0-9]*"


def _cron_field(value: str, *extra_terms: str) -> str:
    term = f"(?:(?:\\*|(?:{value})(?:-(?:{value}))?)(?:/{_STEP})?{''.join('|' + t for t in extra_terms)})"
    return f"{term}(?:,{term})*"


_DOW = f"0*[0-7]|{_names('SUN MON TUE WED THU FRI SAT')}"
# cronsim's five fields (minute hour day-of-month month day-of-week), each a
# list of `*`, values, ranges, steps, and the day fields' L, LW and #n.
CRON_PATTERN = (
    "^\\s*"
    + "\\s+".join(
        (
            _cron_field("0*[0-5]?[0-9]"),
            _cron_field("0*(?:1?[0-9]|2[0-3])"),
            _cron_field("0*(?:[1-9]|[12][0-9]|3[01])", _anycase("LW"), _anycase("L")),
            _cron_field(f"0*(?:[1-9]|1[0-2])|{_names('JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC')}"),
            _cron_field(_DOW, f"0*[0-7]{_anycase('L')}", f"(?:{_DOW})#0*[1-5]"),
        )
    )
    + "\\s*$"
)

TIMEZONE_DESCRIPTION = (
    "an IANA time zone name, e.g. Europe/Berlin (the tz database's names: Area/Location such as "
    "America/New_York, or UTC); omitted: UTC. An unknown name is 400 naming schedule.timezone"
)
# Every name of the tz database is made of these characters (letters, digits, _ + - and / between
# parts); the list of names itself is the server's, so a well-formed unknown name is still a 400.
TIMEZONE_PATTERN = "^[A-Za-z0-9_+-]+(/[A-Za-z0-9_+-]+)*$"


# --------------------------------------------------------------------------- bodies


def _schedule_forms(auto_schema: Any, schema: Schema) -> Schema:
    """plans.serializers.ScheduleInput: {cron, timezone?} or {interval_seconds}."""
    properties = schema["properties"]
    cron = {
        **properties["cron"],
        "pattern": CRON_PATTERN,
        "description": "5 fields: minute hour day-of-month month day-of-week; ranges ascending, "
        "and a day that some month of the expression has",
    }
    # A string, not an enum of the ~600 names: generators turn an enum into
    # identifiers, and Etc/GMT+0, Etc/GMT-0 and Etc/GMT0 collapse into one
    # (openapi-python-client refuses the document). The server still accepts
    # exactly iana_zone_names() (ScheduleInput.validate).
    timezone = {
        "type": "string",
        "minLength": 1,
        "maxLength": properties["timezone"].get("maxLength", 64),
        "pattern": TIMEZONE_PATTERN,
        "description": TIMEZONE_DESCRIPTION,
        "example": "Europe/Berlin",
    }
    forms = {
        "CronSchedule": shapes.closed({"cron": cron, "timezone": timezone}, optional=("timezone",)),
        "IntervalSchedule": shapes.closed({"interval_seconds": properties["interval_seconds"]}),
    }
    for name, form in forms.items():
        auto_schema.registry.register_on_missing(
            ResolvedComponent(name=name, type=ResolvedComponent.SCHEMA, object=name, schema=form)
        )
    return {"oneOf": [shapes.ref(name) for name in forms], "description": "a plan's schedule: one of two forms"}


def _misfire_rule(auto_schema: Any, schema: Schema) -> Schema:
    """plans.serializers.MisfireInput: SKIP has no window, the others need one."""
    choices = {"UnwindowedPolicy": ["SKIP"], "WindowedPolicy": [p for p in POLICIES if p != "SKIP"]}
    for name, values in choices.items():
        auto_schema.registry.register_on_missing(
            ResolvedComponent(name=name, type=ResolvedComponent.SCHEMA, object=name, schema=shapes.enum(values))
        )
    return {
        **schema,
        "oneOf": [
            {
                "properties": {"policy": shapes.ref("UnwindowedPolicy")},
                "not": {"required": ["catch_up_window_seconds"]},
            },
            {"properties": {"policy": shapes.ref("WindowedPolicy")}, "required": ["catch_up_window_seconds"]},
        ],
    }


def register() -> None:
    register_component("PlanState", shapes.enum(PlanState.values))
    register_component("TriggerOutcome", shapes.enum(TriggerOutcome.values))
    register_component("Plan", PLAN)
    register_component("PlanPage", shapes.page_of("Plan"))
    register_component("PlanReceipt", shapes.receipt_of("plan", "Plan"))
    register_component("Trigger", TRIGGER)
    register_component("TriggerPage", shapes.page_of("Trigger"))
    register_body_rule("ScheduleInput", _schedule_forms)
    register_body_rule("MisfireInput", _misfire_rule)
    # The plan's schedule, misfire and definition are the bodies it was given.
    for serializer in (ScheduleInput, MisfireInput, DefinitionInput):
        register_referenced_serializer(serializer)
