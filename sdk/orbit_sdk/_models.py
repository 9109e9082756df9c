"""Typed requests and results, and the strict decoding of the server's JSON into them.

Rules that hold everywhere here: uint64 values travel as decimal strings and are parsed with
``int()`` after a canonical-form check, never through ``float``; times are RFC 3339 UTC with
``Z``; optional fields the server omits read as ``None``; request fields left ``None`` are
omitted from the JSON body (the server digests a request exactly as sent).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

from orbit_sdk._exceptions import APIError, ProtocolError, parse_retry_after

T = TypeVar("T")

UINT64_MAX = 2**64 - 1
# ASCII digits only ("[0-9]", not "\d"), no sign, no leading zero, no whitespace.
_CANONICAL_UINT = re.compile(r"0|[1-9][0-9]{0,19}")


# --------------------------------------------------------------------------- decoding helpers


def parse_uint64(value: Any, field: str, *, nonzero: bool = False) -> int:
    """A uint64 from its canonical decimal string; anything else is a ProtocolError."""
    if not isinstance(value, str) or not _CANONICAL_UINT.fullmatch(value):
        raise ProtocolError(f"{field}: expected a canonical uint64 decimal string, got {value!r}")
    number = int(value)
    if number > UINT64_MAX:
        raise ProtocolError(f"{field}: {value} is beyond uint64")
    if nonzero and number == 0:
        raise ProtocolError(f"{field}: must be a non-zero uint64")
    return number


def parse_time(value: Any, field: str) -> datetime.datetime:
    if not isinstance(value, str):
        raise ProtocolError(f"{field}: expected an RFC 3339 time string, got {value!r}")
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError as exc:
        raise ProtocolError(f"{field}: not an RFC 3339 time: {value!r}") from exc
    if parsed.tzinfo is None:
        raise ProtocolError(f"{field}: time without a UTC offset: {value!r}")
    return parsed.astimezone(datetime.UTC)


def format_time(value: datetime.datetime, field: str = "time") -> str:
    """RFC 3339 UTC with ``Z``; a naive datetime is refused rather than guessed at."""
    if not isinstance(value, datetime.datetime):
        raise TypeError(f"{field} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{field}: naive datetime: pass a timezone-aware value (e.g. datetime.now(UTC))")
    return value.astimezone(datetime.UTC).isoformat().replace("+00:00", "Z")


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def _required(obj: Mapping[str, Any], name: str, what: str) -> Any:
    if name not in obj:
        raise ProtocolError(f"{what}.{name}: missing")
    return obj[name]


def _str(obj: Mapping[str, Any], name: str, what: str) -> str:
    value = _required(obj, name, what)
    if not isinstance(value, str):
        raise ProtocolError(f"{what}.{name}: expected a string, got {value!r}")
    return value


def _opt_str(obj: Mapping[str, Any], name: str, what: str) -> str | None:
    value = obj.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ProtocolError(f"{what}.{name}: expected a string, got {value!r}")
    return value


def _int(obj: Mapping[str, Any], name: str, what: str, default: int | None = None) -> int:
    if default is not None and obj.get(name) is None:
        return default
    value = _required(obj, name, what)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{what}.{name}: expected an integer, got {value!r}")
    return value


def _opt_int(obj: Mapping[str, Any], name: str, what: str) -> int | None:
    if obj.get(name) is None:
        return None
    return _int(obj, name, what)


def _bool(obj: Mapping[str, Any], name: str, what: str) -> bool:
    value = _required(obj, name, what)
    if not isinstance(value, bool):
        raise ProtocolError(f"{what}.{name}: expected a boolean, got {value!r}")
    return value


def _time(obj: Mapping[str, Any], name: str, what: str) -> datetime.datetime:
    return parse_time(_required(obj, name, what), f"{what}.{name}")


def _opt_time(obj: Mapping[str, Any], name: str, what: str) -> datetime.datetime | None:
    value = obj.get(name)
    if value is None or value == "":
        return None
    return parse_time(value, f"{what}.{name}")


def _uint64(obj: Mapping[str, Any], name: str, what: str, default: int | None = None) -> int:
    if default is not None and name not in obj:
        return default
    return parse_uint64(_required(obj, name, what), f"{what}.{name}")


def _uint64_text(value: Any, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= UINT64_MAX:
        raise ValueError(f"{field}: expected an int in the uint64 range, got {value!r}")
    return str(value)


def _str_tuple(obj: Mapping[str, Any], name: str, what: str) -> tuple[str, ...]:
    """An optional list of strings; absent or null reads as empty."""
    value = obj.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ProtocolError(f"{what}.{name}: expected a list of strings, got {value!r}")
    return tuple(value)


def _without_none(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


# --------------------------------------------------------------------------- request fields
#
# A request field of the wrong kind is refused before anything is sent, naming the field: a
# TypeError for the wrong type (what the SDK could not encode, or would send as another JSON
# type than the server takes). Values (ranges, lengths, names) are the server's to judge: its
# INVALID_ARGUMENT names the field too, and its rules stay in one place.


def _kind(name: str, expected: str, value: object) -> TypeError:
    return TypeError(f"{name} must be {expected}, got {type(value).__name__}")


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise _kind(name, "a string", value)
    return value


def _opt_text(value: object, name: str) -> str | None:
    return None if value is None else _text(value, name)


def _whole(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _kind(name, "an int", value)
    return value


def _opt_whole(value: object, name: str) -> int | None:
    return None if value is None else _whole(value, name)


def _opt_number(value: object, name: str) -> int | float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _kind(name, "a number", value)
    return value


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise _kind(name, "a bool", value)
    return value


def _json_object(value: object, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _kind(name, "a dict", value)
    return dict(value)


def _opt_time_text(value: Any, name: str) -> str | None:
    return None if value is None else format_time(value, name)


# --------------------------------------------------------------------------- resources


@dataclass(frozen=True)
class Queue:
    """A queue as the server reports it. ``unfinished_tasks`` and ``revision`` are uint64."""

    id: str
    namespace_id: str
    name: str
    paused: bool
    max_concurrency: int
    rate_per_second: int
    max_unfinished_tasks: int
    unfinished_tasks: int
    revision: int
    retired_at: datetime.datetime | None = None

    @classmethod
    def from_json(cls, value: Any) -> Queue:
        what = "queue"
        obj = _object(value, what)
        # Receipts stored before these fields existed omit them; they read as 0 (seed queues-v1,
        # "升级"): a historical snapshot lacking the information, not a configuration of zero.
        return cls(
            id=_str(obj, "id", what),
            namespace_id=_str(obj, "namespace_id", what),
            name=_str(obj, "name", what),
            paused=_bool(obj, "paused", what),
            max_concurrency=_int(obj, "max_concurrency", what, default=0),
            rate_per_second=_int(obj, "rate_per_second", what, default=0),
            max_unfinished_tasks=_int(obj, "max_unfinished_tasks", what, default=0),
            unfinished_tasks=_uint64(obj, "unfinished_tasks", what, default=0),
            revision=_uint64(obj, "revision", what),
            retired_at=_opt_time(obj, "retired_at", what),
        )


@dataclass(frozen=True)
class Task:
    """A task (SPEC §5). ``payload`` is only present on the detail read (``get_task``).

    ``state`` is one of BLOCKED (a dependency has not finished, SPEC §13), WAITING, LEASED,
    RUNNING, SUCCEEDED, FAILED, CANCELLED and NEEDS_REVIEW. ``depends_on`` lists the ids of the
    tasks it waits for, in the order submitted (a batch's ``ref:NAME`` entries resolved to ids;
    empty for a task without dependencies), and ``on_dependency_failure`` (CANCEL or RUN) what
    a failed or cancelled one does to it (None without dependencies).
    """

    id: str
    namespace_id: str
    queue_id: str
    handler: str
    handler_version: str
    payload_version: str
    priority: int
    state: str
    attempts: int
    max_attempts: int
    available_at: datetime.datetime
    cancel_requested: bool
    created_at: datetime.datetime
    updated_at: datetime.datetime
    payload: Any = None
    business_key: str | None = None
    concurrency_key: str | None = None
    fairness_key: str | None = None
    start_deadline_at: datetime.datetime | None = None
    deadline_at: datetime.datetime | None = None
    finished_at: datetime.datetime | None = None
    output: Any = None
    last_error: Any = None
    depends_on: tuple[str, ...] = ()
    on_dependency_failure: str | None = None

    @classmethod
    def from_json(cls, value: Any) -> Task:
        what = "task"
        obj = _object(value, what)
        return cls(
            id=_str(obj, "id", what),
            namespace_id=_str(obj, "namespace_id", what),
            queue_id=_str(obj, "queue_id", what),
            handler=_str(obj, "handler", what),
            handler_version=_str(obj, "handler_version", what),
            payload_version=_str(obj, "payload_version", what),
            priority=_int(obj, "priority", what),
            state=_str(obj, "state", what),
            attempts=_int(obj, "attempts", what),
            max_attempts=_int(obj, "max_attempts", what),
            available_at=_time(obj, "available_at", what),
            cancel_requested=_bool(obj, "cancel_requested", what),
            created_at=_time(obj, "created_at", what),
            updated_at=_time(obj, "updated_at", what),
            payload=obj.get("payload"),
            business_key=_opt_str(obj, "business_key", what),
            concurrency_key=_opt_str(obj, "concurrency_key", what),
            fairness_key=_opt_str(obj, "fairness_key", what),
            start_deadline_at=_opt_time(obj, "start_deadline_at", what),
            deadline_at=_opt_time(obj, "deadline_at", what),
            finished_at=_opt_time(obj, "finished_at", what),
            output=obj.get("output"),
            last_error=obj.get("last_error"),
            depends_on=_str_tuple(obj, "depends_on", what),
            on_dependency_failure=_opt_str(obj, "on_dependency_failure", what),
        )


@dataclass(frozen=True)
class TaskLink:
    """A related task in short form (``list_dependencies`` / ``list_dependents``, SPEC §13).

    A task the credential may read has ``queue_id``, ``handler``, ``state`` and its times; one
    outside the credential's queues has its ``id`` alone; one pruned since has ``pruned`` True.
    """

    id: str
    queue_id: str | None = None
    handler: str | None = None
    state: str | None = None
    business_key: str | None = None
    created_at: datetime.datetime | None = None
    updated_at: datetime.datetime | None = None
    finished_at: datetime.datetime | None = None
    pruned: bool = False

    @classmethod
    def from_json(cls, value: Any) -> TaskLink:
        what = "task link"
        obj = _object(value, what)
        return cls(
            id=_str(obj, "id", what),
            queue_id=_opt_str(obj, "queue_id", what),
            handler=_opt_str(obj, "handler", what),
            state=_opt_str(obj, "state", what),
            business_key=_opt_str(obj, "business_key", what),
            created_at=_opt_time(obj, "created_at", what),
            updated_at=_opt_time(obj, "updated_at", what),
            finished_at=_opt_time(obj, "finished_at", what),
            pruned=_bool(obj, "pruned", what) if "pruned" in obj else False,
        )


@dataclass(frozen=True)
class Attempt:
    """One lease of a task (SPEC §5). ``number`` is set at Start; ``concurrency_token`` is uint64."""

    id: str
    task_id: str
    state: str
    epoch: int
    worker_id: str
    leased_at: datetime.datetime
    lease_expires_at: datetime.datetime
    number: int | None = None
    concurrency_token: int | None = None
    started_at: datetime.datetime | None = None
    finished_at: datetime.datetime | None = None
    outcome: str | None = None
    error: Any = None
    late_outcome: Any = None  # a result that arrived after the attempt had ended (SPEC §5)

    @classmethod
    def from_json(cls, value: Any) -> Attempt:
        what = "attempt"
        obj = _object(value, what)
        token = obj.get("concurrency_token")
        return cls(
            id=_str(obj, "id", what),
            task_id=_str(obj, "task_id", what),
            state=_str(obj, "state", what),
            epoch=_int(obj, "epoch", what),
            worker_id=_str(obj, "worker_id", what),
            leased_at=_time(obj, "leased_at", what),
            lease_expires_at=_time(obj, "lease_expires_at", what),
            number=_opt_int(obj, "number", what),
            concurrency_token=None if token is None else parse_uint64(token, f"{what}.concurrency_token"),
            started_at=_opt_time(obj, "started_at", what),
            finished_at=_opt_time(obj, "finished_at", what),
            outcome=_opt_str(obj, "outcome", what),
            error=obj.get("error"),
            late_outcome=obj.get("late_outcome"),
        )


@dataclass(frozen=True)
class TaskInfo:
    """The task as a worker receives it in ``task.assign`` (docs/protocol.md)."""

    id: str
    queue_id: str
    handler: str
    handler_version: str
    payload_version: str
    payload: Any
    priority: int
    business_key: str | None = None
    concurrency_key: str | None = None

    @classmethod
    def from_json(cls, value: Any) -> TaskInfo:
        what = "assignment.task"
        obj = _object(value, what)
        return cls(
            id=_str(obj, "id", what),
            queue_id=_str(obj, "queue_id", what),
            handler=_str(obj, "handler", what),
            handler_version=_str(obj, "handler_version", what),
            payload_version=_str(obj, "payload_version", what),
            payload=_required(obj, "payload", what),
            priority=_int(obj, "priority", what),
            business_key=_opt_str(obj, "business_key", what),
            concurrency_key=_opt_str(obj, "concurrency_key", what),
        )


@dataclass(frozen=True)
class Dependency:
    """One dependency of the task a worker runs, as its assignment carries it (SPEC §13), in
    ``depends_on`` order: ``Execution.dependencies``. ``state`` is the dependency's final state
    (SUCCEEDED, or FAILED / CANCELLED for a task submitted with ``on_dependency_failure="RUN"``);
    ``output`` is what it returned (None when it returned nothing, or did not succeed). Both
    are None for a dependency the server could no longer read."""

    task_id: str
    state: str | None = None
    output: Any = None

    @classmethod
    def from_json(cls, value: Any, what: str = "assignment.dependencies[]") -> Dependency:
        obj = _object(value, what)
        return cls(task_id=_str(obj, "task_id", what), state=_opt_str(obj, "state", what), output=obj.get("output"))


@dataclass(frozen=True)
class Application:
    """An application's quotas across all its namespaces, with its live counters (uint64)."""

    id: str
    name: str
    max_active_attempts: int
    max_unfinished_tasks: int
    active_attempts: int
    unfinished_tasks: int
    revision: int

    @classmethod
    def from_json(cls, value: Any) -> Application:
        what = "application"
        obj = _object(value, what)
        return cls(
            id=_str(obj, "id", what),
            name=_str(obj, "name", what),
            max_active_attempts=_int(obj, "max_active_attempts", what),
            max_unfinished_tasks=_int(obj, "max_unfinished_tasks", what),
            active_attempts=_uint64(obj, "active_attempts", what),
            unfinished_tasks=_uint64(obj, "unfinished_tasks", what),
            revision=_uint64(obj, "revision", what),
        )


@dataclass(frozen=True)
class ConfigureApplicationResult:
    """Receipt of an application configure: ``deduplicated`` is True for a replay."""

    deduplicated: bool
    application: Application

    @classmethod
    def from_json(cls, value: Any) -> ConfigureApplicationResult:
        obj = _object(value, "data")
        return cls(
            deduplicated=_bool(obj, "deduplicated", "data"), application=Application.from_json(obj.get("application"))
        )


@dataclass(frozen=True)
class Event:
    """One entry of the namespace's event log; ``cursor`` (uint64) orders them."""

    cursor: int
    type: str
    subject_id: str
    data: Any
    created_at: datetime.datetime

    @classmethod
    def from_json(cls, value: Any) -> Event:
        what = "event"
        obj = _object(value, what)
        return cls(
            cursor=_uint64(obj, "cursor", what),
            type=_str(obj, "type", what),
            subject_id=_str(obj, "subject_id", what),
            data=_required(obj, "data", what),
            created_at=_time(obj, "created_at", what),
        )


@dataclass(frozen=True)
class EventPage:
    """Events after a cursor; pass ``next_cursor`` back as ``after`` for the next ones."""

    items: list[Event]
    next_cursor: int

    @classmethod
    def from_json(cls, value: Any) -> EventPage:
        obj = _object(value, "data")
        items = _required(obj, "items", "data")
        if not isinstance(items, list):
            raise ProtocolError("events: expected an 'items' list")
        return cls(items=[Event.from_json(item) for item in items], next_cursor=_uint64(obj, "next_cursor", "data"))


@dataclass(frozen=True)
class Plan:
    """A plan (SPEC §7): ``schedule``, ``misfire`` and ``definition`` as sent;
    ``next_fire_at`` only while ACTIVE. ``revision`` is a uint64."""

    id: str
    namespace_id: str
    queue_id: str
    name: str
    state: str
    version: int
    revision: int
    schedule: dict[str, Any]
    misfire: dict[str, Any]
    definition: dict[str, Any]
    next_fire_at: datetime.datetime | None = None

    @classmethod
    def from_json(cls, value: Any) -> Plan:
        what = "plan"
        obj = _object(value, what)
        return cls(
            id=_str(obj, "id", what),
            namespace_id=_str(obj, "namespace_id", what),
            queue_id=_str(obj, "queue_id", what),
            name=_str(obj, "name", what),
            state=_str(obj, "state", what),
            version=_int(obj, "version", what),
            revision=_uint64(obj, "revision", what),
            schedule=dict(_object(obj.get("schedule"), "plan.schedule")),
            misfire=dict(_object(obj.get("misfire"), "plan.misfire")),
            definition=dict(_object(obj.get("definition"), "plan.definition")),
            next_fire_at=_opt_time(obj, "next_fire_at", what),
        )


@dataclass(frozen=True)
class PlanResult:
    """Receipt of a plan create or change: ``deduplicated`` is True for a replay."""

    deduplicated: bool
    plan: Plan

    @classmethod
    def from_json(cls, value: Any) -> PlanResult:
        obj = _object(value, "data")
        return cls(deduplicated=_bool(obj, "deduplicated", "data"), plan=Plan.from_json(obj.get("plan")))


@dataclass(frozen=True)
class PlanTrigger:
    """One decided point of a plan: CREATED with ``task_id``, or SKIPPED with ``reason``."""

    scheduled_at: datetime.datetime
    version: int
    outcome: str
    decided_at: datetime.datetime
    task_id: str | None = None
    reason: str | None = None

    @classmethod
    def from_json(cls, value: Any) -> PlanTrigger:
        what = "trigger"
        obj = _object(value, what)
        return cls(
            scheduled_at=_time(obj, "scheduled_at", what),
            version=_int(obj, "version", what),
            outcome=_str(obj, "outcome", what),
            decided_at=_time(obj, "decided_at", what),
            task_id=_opt_str(obj, "task_id", what),
            reason=_opt_str(obj, "reason", what),
        )


@dataclass(frozen=True)
class Blocker:
    """One reason the next lease would not take a WAITING task, or why a BLOCKED one waits
    (``GET /v1/tasks/{id}/blockers``).

    ``code`` is one of the server's blocker codes (``NOT_YET_AVAILABLE``, ``QUEUE_PAUSED``,
    ``KEY_HELD``, ``KEY_AT_CAPACITY``, ``KEY_RATE_LIMITED``, ``NO_WORKER``,
    ``WAITING_FOR_DEPENDENCIES``, …); ``facts`` holds
    what the server says behind it, as sent (for ``KEY_HELD``, a key of capacity 1: the holder's
    ``attempt_id``, ``task_id``, ``worker_id`` and ``since``; for ``KEY_AT_CAPACITY``, a key of
    capacity above 1: its ``capacity`` and how many ``holders`` hold; for ``KEY_RATE_LIMITED``:
    ``next_start_at``, when the key's start rate lets a lease take one of its tasks again; both
    with the ``policy_id`` that set them; for ``WAITING_FOR_DEPENDENCIES``, a BLOCKED task's
    only blocker: ``task_ids``, the dependencies it still waits for), and only what the
    credential may read itself.
    """

    code: str
    message: str
    facts: dict[str, Any]

    @classmethod
    def from_json(cls, value: Any) -> Blocker:
        what = "blocker"
        obj = _object(value, what)
        facts = {name: fact for name, fact in obj.items() if name not in ("code", "message")}
        return cls(code=_str(obj, "code", what), message=_str(obj, "message", what), facts=facts)


@dataclass(frozen=True)
class TaskBlockers:
    """Why a task is not running: its ``state`` and, when WAITING, every ``Blocker`` of its next
    lease; when BLOCKED, the one ``WAITING_FOR_DEPENDENCIES``. Empty ``items``: a lease would
    take it now (always empty unless WAITING or BLOCKED). A snapshot, read without locks; the
    next lease decides."""

    state: str
    items: list[Blocker]

    @classmethod
    def from_json(cls, value: Any) -> TaskBlockers:
        what = "blockers"
        obj = _object(value, what)
        items = _required(obj, "items", what)
        if not isinstance(items, list):
            raise ProtocolError(f"{what}.items: expected a list")
        return cls(state=_str(obj, "state", what), items=[Blocker.from_json(item) for item in items])


@dataclass(frozen=True)
class ConcurrencyKeyHolder:
    """An attempt holding one of a key's valid permits; ``token`` (uint64) is its permit token,
    ``slot`` (0…capacity−1) the permit's slot (None in ``ConcurrencyKey.holder``, the one permit
    of a key of capacity 1)."""

    attempt_id: str
    task_id: str
    since: datetime.datetime
    worker_id: str | None = None
    token: int | None = None
    slot: int | None = None

    @classmethod
    def from_json(cls, value: Any, what: str = "concurrency_key.holder") -> ConcurrencyKeyHolder:
        obj = _object(value, what)
        token = obj.get("token")
        return cls(
            attempt_id=_str(obj, "attempt_id", what),
            task_id=_str(obj, "task_id", what),
            since=_time(obj, "since", what),
            worker_id=_opt_str(obj, "worker_id", what),
            token=None if token is None else parse_uint64(token, f"{what}.token"),
            slot=_opt_int(obj, "slot", what),
        )


@dataclass(frozen=True)
class KeyRate:
    """A key's start rate: at most ``burst`` + t / (``per_seconds`` / ``starts``) Starts in any
    interval of length t."""

    starts: int
    per_seconds: int
    burst: int

    @classmethod
    def from_json(cls, value: Any, what: str = "rate") -> KeyRate:
        obj = _object(value, what)
        return cls(
            starts=_int(obj, "starts", what),
            per_seconds=_int(obj, "per_seconds", what),
            burst=_int(obj, "burst", what, default=1),
        )


@dataclass(frozen=True)
class ConcurrencyKey:
    """A concurrency key of the namespace (``GET /v1/concurrency-keys/{key}``).

    ``capacity`` is how many valid permits the key grants at once, as its policies resolve it
    now (1 without a policy; ``policy_id`` names the policy that applies); ``holders`` lists
    every valid permit by slot, lowest first (empty while free; a lowered capacity keeps its
    holders, so there may be more than ``capacity``). ``holder`` is the one holder of a key of
    capacity 1 (None while free, and for a key of a larger capacity). With a start ``rate``,
    ``reserved_starts`` counts leased attempts not started yet and ``next_start_at`` is when a
    lease may next take one of its tasks (at most the read's time: now). ``highest_token``
    (uint64) is the key's token sequence: every token issued is at most it, the next is above
    it. The sequence advances on every lease and every release, so tokens strictly increase but
    are not consecutive (1, 3, 5, … for one attempt at a time): a resource compares them, never
    counts them. ``updated_at`` (the last lease or release) is None for a key whose tasks never
    leased.
    """

    key: str
    highest_token: int
    waiting_tasks: int
    holder: ConcurrencyKeyHolder | None = None
    updated_at: datetime.datetime | None = None
    capacity: int = 1
    holders: tuple[ConcurrencyKeyHolder, ...] = ()
    policy_id: str | None = None
    rate: KeyRate | None = None
    reserved_starts: int | None = None
    next_start_at: datetime.datetime | None = None

    @classmethod
    def from_json(cls, value: Any) -> ConcurrencyKey:
        what = "concurrency_key"
        obj = _object(value, what)
        holder = obj.get("holder")
        holders = obj.get("holders", [])
        if not isinstance(holders, list):
            raise ProtocolError(f"{what}.holders: expected a list")
        rate = obj.get("rate")
        return cls(
            key=_str(obj, "key", what),
            highest_token=_uint64(obj, "highest_token", what),
            waiting_tasks=_int(obj, "waiting_tasks", what),
            holder=None if holder is None else ConcurrencyKeyHolder.from_json(holder),
            updated_at=_opt_time(obj, "updated_at", what),
            capacity=_int(obj, "capacity", what, default=1),
            holders=tuple(
                ConcurrencyKeyHolder.from_json(item, f"{what}.holders[{index}]") for index, item in enumerate(holders)
            ),
            policy_id=_opt_str(obj, "policy_id", what),
            rate=None if rate is None else KeyRate.from_json(rate, f"{what}.rate"),
            reserved_starts=_opt_int(obj, "reserved_starts", what),
            next_start_at=_opt_time(obj, "next_start_at", what),
        )


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list; ``next_page_token`` is None on the last page."""

    items: list[T]
    next_page_token: str | None


@dataclass(frozen=True)
class CreateQueueResult:
    """Receipt of create/configure/retire: ``deduplicated`` is True for a replay."""

    deduplicated: bool
    queue: Queue

    @classmethod
    def from_json(cls, value: Any) -> CreateQueueResult:
        obj = _object(value, "data")
        return cls(deduplicated=_bool(obj, "deduplicated", "data"), queue=Queue.from_json(obj.get("queue")))


@dataclass(frozen=True)
class SubmitTaskResult:
    """Receipt of a submit: ``deduplicated`` is True for a replay of an accepted request."""

    deduplicated: bool
    task: Task

    @classmethod
    def from_json(cls, value: Any) -> SubmitTaskResult:
        obj = _object(value, "data")
        return cls(deduplicated=_bool(obj, "deduplicated", "data"), task=Task.from_json(obj.get("task")))


@dataclass(frozen=True)
class BatchItemResult:
    """One item's result of ``submit_tasks``, in the order the items were sent.

    Accepted: ``task`` is set, ``status`` is 201 (or 200 with ``deduplicated=True``, a replay).
    Refused: ``error`` is set (its ``code``, ``status_code``, ``message`` and ``retry_after``, and
    the batch's ``request_id``) and nothing was stored for this key: fix the item, or after
    ``QUEUE_FULL`` wait ``error.retry_after``, and send it again with the same key.
    """

    idempotency_key: str
    status: int
    task: Task | None = None
    deduplicated: bool = False
    error: APIError | None = None

    @property
    def accepted(self) -> bool:
        return self.error is None

    @classmethod
    def from_json(cls, value: Any, request_id: str = "") -> BatchItemResult:
        what = "tasks:batch result"
        obj = _object(value, what)
        key, status = _str(obj, "idempotency_key", what), _int(obj, "status", what)
        error = obj.get("error")
        if error is not None:
            error = _object(error, f"{what}.error")
            message = error.get("message")
            advice = obj.get("retry_after")  # integer seconds, as a single submit's Retry-After header
            return cls(
                idempotency_key=key,
                status=status,
                error=APIError(
                    code=_str(error, "code", f"{what}.error"),
                    status_code=status,
                    message=message if isinstance(message, str) else "",
                    request_id=request_id,
                    retry_after=parse_retry_after(str(advice) if type(advice) is int else None),
                ),
            )
        return cls(
            idempotency_key=key,
            status=status,
            task=Task.from_json(obj.get("task")),
            deduplicated=_bool(obj, "deduplicated", what),
        )


@dataclass(frozen=True)
class CancelTaskResult:
    """Receipt of a cancel; ``task.cancel_requested`` is True when the task was already running."""

    deduplicated: bool
    task: Task

    @classmethod
    def from_json(cls, value: Any) -> Self:
        obj = _object(value, "data")
        task = obj.get("task", obj)  # the task itself, or wrapped with the receipt's flag
        return cls(deduplicated=bool(obj.get("deduplicated", False)), task=Task.from_json(task))


@dataclass(frozen=True)
class ResolveTaskResult(CancelTaskResult):
    """Receipt of a review decision: ``task.state`` is SUCCEEDED or FAILED, or WAITING after RETRY."""


# --------------------------------------------------------------------------- requests


@dataclass
class CreateQueueRequest:
    name: str
    max_concurrency: int
    rate_per_second: int
    max_unfinished_tasks: int | None = None

    def to_json(self) -> dict[str, Any]:
        return _without_none(
            {
                "name": _text(self.name, "name"),
                "max_concurrency": _whole(self.max_concurrency, "max_concurrency"),
                "rate_per_second": _whole(self.rate_per_second, "rate_per_second"),
                "max_unfinished_tasks": _opt_whole(self.max_unfinished_tasks, "max_unfinished_tasks"),
            }
        )


@dataclass
class ConfigureQueueRequest:
    """Full replacement of a queue's controls; every field is required (seed queues-v1)."""

    expected_revision: int
    reason: str
    paused: bool
    max_concurrency: int
    rate_per_second: int
    max_unfinished_tasks: int

    def to_json(self) -> dict[str, Any]:
        return {
            "expected_revision": _uint64_text(self.expected_revision, "expected_revision"),
            "reason": _text(self.reason, "reason"),
            "paused": _flag(self.paused, "paused"),
            "max_concurrency": _whole(self.max_concurrency, "max_concurrency"),
            "rate_per_second": _whole(self.rate_per_second, "rate_per_second"),
            "max_unfinished_tasks": _whole(self.max_unfinished_tasks, "max_unfinished_tasks"),
        }


@dataclass
class CreatePlanRequest:
    """``schedule``: ``{"interval_seconds": n}`` or ``{"cron": ..., "timezone": ...}``;
    ``misfire``: ``{"policy": "SKIP"}`` or CATCH_UP/LATEST with ``catch_up_window_seconds``;
    ``task``: a submit's fields without ``queue_id`` or absolute times."""

    name: str
    queue_id: str
    schedule: dict[str, Any]
    misfire: dict[str, Any]
    task: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": _text(self.name, "name"),
            "queue_id": _text(self.queue_id, "queue_id"),
            "schedule": _json_object(self.schedule, "schedule"),
            "misfire": _json_object(self.misfire, "misfire"),
            "definition": {"task": _json_object(self.task, "task")},
        }


@dataclass
class UpdatePlanRequest:
    """A new version of the plan: every part is replaced."""

    expected_revision: int
    reason: str
    schedule: dict[str, Any]
    misfire: dict[str, Any]
    task: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "expected_revision": _uint64_text(self.expected_revision, "expected_revision"),
            "reason": _text(self.reason, "reason"),
            "schedule": _json_object(self.schedule, "schedule"),
            "misfire": _json_object(self.misfire, "misfire"),
            "definition": {"task": _json_object(self.task, "task")},
        }


@dataclass
class RetryPolicy:
    """Backoff for safe retries; fields left None take the server's defaults (1 s, ×2, 300 s)."""

    initial_seconds: float | None = None
    multiplier: float | None = None
    max_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        return _without_none(
            {
                "initial_seconds": _opt_number(self.initial_seconds, "retry.initial_seconds"),
                "multiplier": _opt_number(self.multiplier, "retry.multiplier"),
                "max_seconds": _opt_number(self.max_seconds, "retry.max_seconds"),
            }
        )


@dataclass
class SubmitTaskRequest:
    """One task to submit. ``depends_on`` (SPEC §13): 1 to 1,000 distinct ids of tasks of the
    namespace (any queue) it waits for, BLOCKED until each has finished; in a ``submit_tasks``
    batch an entry may also be ``"ref:NAME"``, the ``ref`` of an earlier :class:`BatchItem` of
    the same batch. A list, or any iterable of them: an iterator (a generator, ``map(...)``) is
    read once, when the request is made. ``on_dependency_failure``: ``"CANCEL"`` (the server's
    default: cancelled with ``DEPENDENCY_FAILED`` once one fails or is cancelled) or ``"RUN"``
    (runs after all have finished, however they ended)."""

    queue_id: str
    handler: str
    handler_version: str
    payload_version: str
    payload: Any
    business_key: str | None = None
    concurrency_key: str | None = None
    # Tasks of one fairness key share the queue round robin with other keys (SPEC §12).
    fairness_key: str | None = None
    priority: int | None = None
    available_at: datetime.datetime | None = None
    start_deadline_at: datetime.datetime | None = None
    deadline_at: datetime.datetime | None = None
    timeout_seconds: int | None = None
    max_attempts: int | None = None
    retry: RetryPolicy | None = None
    lease_seconds: int | None = None
    depends_on: Iterable[str] | None = None
    on_dependency_failure: str | None = None

    def __post_init__(self) -> None:
        # An iterator (a generator, map(...)) is read once, here: the request is then the same
        # every time it is sent, as re-sending with the same key requires.
        if isinstance(self.depends_on, Iterator):
            self.depends_on = tuple(self.depends_on)

    def to_json(self) -> dict[str, Any]:
        body = {
            "queue_id": _text(self.queue_id, "queue_id"),
            "handler": _text(self.handler, "handler"),
            "handler_version": _text(self.handler_version, "handler_version"),
            "payload_version": _text(self.payload_version, "payload_version"),
            "business_key": _opt_text(self.business_key, "business_key"),
            "concurrency_key": _opt_text(self.concurrency_key, "concurrency_key"),
            "fairness_key": _opt_text(self.fairness_key, "fairness_key"),
            "priority": _opt_whole(self.priority, "priority"),
            "available_at": _opt_time_text(self.available_at, "available_at"),
            "start_deadline_at": _opt_time_text(self.start_deadline_at, "start_deadline_at"),
            "deadline_at": _opt_time_text(self.deadline_at, "deadline_at"),
            "timeout_seconds": _opt_whole(self.timeout_seconds, "timeout_seconds"),
            "max_attempts": _opt_whole(self.max_attempts, "max_attempts"),
            "retry": _retry_json(self.retry),
            "lease_seconds": _opt_whole(self.lease_seconds, "lease_seconds"),
            "depends_on": _depends_on_json(self.depends_on),
            "on_dependency_failure": _opt_text(self.on_dependency_failure, "on_dependency_failure"),
        }
        # payload is required and may itself be JSON null: it is never dropped. What JSON
        # cannot carry in it (a datetime, a set, NaN, a lone surrogate) is found, and named,
        # when the body is encoded (orbit_sdk._client).
        return {**_without_none(body), "payload": self.payload}


def _retry_json(retry: Any) -> dict[str, Any] | None:
    if retry is None:
        return None
    if not isinstance(retry, RetryPolicy):
        raise _kind("retry", "a RetryPolicy (e.g. RetryPolicy(initial_seconds=5))", retry)
    return retry.to_json()


def _depends_on_json(depends_on: Any) -> list[str] | None:
    # A bare string is a sequence of characters: refused rather than sent as one id per letter.
    # Any other iterable of strings is taken (a list, a tuple, a generator read once).
    if depends_on is None:
        return None
    expected = "a list of task ids or ref:NAME strings"
    if isinstance(depends_on, str | bytes | bytearray | Mapping) or not isinstance(depends_on, Iterable):
        raise TypeError(f"depends_on must be {expected} (any iterable of them), got {type(depends_on).__name__}")
    entries = list(depends_on)
    for index, entry in enumerate(entries):
        if not isinstance(entry, str):
            raise TypeError(f"depends_on must be {expected}: depends_on[{index}] is a {type(entry).__name__}")
    return entries


REF_PREFIX = "ref:"
_REF_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class BatchItem:
    """One item of a ``submit_tasks`` batch: its Idempotency-Key, its task, and optionally a
    ``ref`` (1-64 letters, digits, ``.``, ``_`` or ``-``, unique in the batch) that later items
    name in their ``depends_on`` as ``"ref:NAME"`` (:attr:`depends_on_ref`) before the
    task has an id. The ref is not part of the item's digest: only the task is."""

    idempotency_key: str
    task: SubmitTaskRequest
    ref: str | None = None

    def __post_init__(self) -> None:
        if self.ref is not None and (not isinstance(self.ref, str) or not _REF_NAME.fullmatch(self.ref)):
            raise ValueError(f"ref must be 1-64 letters, digits, '.', '_' or '-', got {self.ref!r}")

    @property
    def depends_on_ref(self) -> str:
        """``"ref:NAME"``: this item, as a later item of the same batch names it in ``depends_on``."""
        if self.ref is None:
            raise ValueError(f"batch item {self.idempotency_key!r} has no ref")
        return REF_PREFIX + self.ref


# --------------------------------------------------------------------------- key policies


@dataclass(frozen=True)
class KeyMatch:
    """What a key policy matches: exactly one ``key``, or each key starting with ``prefix``
    (compared byte for byte). Exactly one of the two is set."""

    key: str | None = None
    prefix: str | None = None

    def to_json(self) -> dict[str, str]:
        if (self.key is None) == (self.prefix is None):
            raise ValueError("KeyMatch takes exactly one of key or prefix")
        if self.key is not None:
            return {"key": _text(self.key, "match.key")}
        return {"prefix": _text(self.prefix, "match.prefix")}

    @classmethod
    def from_json(cls, value: Any, what: str = "policy.match") -> KeyMatch:
        obj = _object(value, what)
        if set(obj) == {"key"}:
            return cls(key=_str(obj, "key", what))
        if set(obj) == {"prefix"}:
            return cls(prefix=_str(obj, "prefix", what))
        raise ProtocolError(f"{what}: expected exactly one of key or prefix, got {sorted(obj)}")


@dataclass(frozen=True)
class KeyPolicy:
    """A key policy (``/v1/key-policies``): the capacity and start ``rate`` (None: no rate)
    of the keys its ``match`` names. ``revision`` is uint64; ``retired_at`` is set once retired
    (a retired policy still reads, and its match is free for a new one)."""

    id: str
    namespace_id: str
    match: KeyMatch
    capacity: int
    revision: int
    created_at: datetime.datetime
    updated_at: datetime.datetime
    rate: KeyRate | None = None
    retired_at: datetime.datetime | None = None

    @classmethod
    def from_json(cls, value: Any) -> KeyPolicy:
        what = "policy"
        obj = _object(value, what)
        rate = obj.get("rate")
        return cls(
            id=_str(obj, "id", what),
            namespace_id=_str(obj, "namespace_id", what),
            match=KeyMatch.from_json(_required(obj, "match", what)),
            capacity=_int(obj, "capacity", what),
            revision=_uint64(obj, "revision", what),
            created_at=_time(obj, "created_at", what),
            updated_at=_time(obj, "updated_at", what),
            rate=None if rate is None else KeyRate.from_json(rate, f"{what}.rate"),
            retired_at=_opt_time(obj, "retired_at", what),
        )


@dataclass(frozen=True)
class KeyPolicyResult:
    """Receipt of a key policy create/configure/retire: ``deduplicated`` is True for a replay."""

    deduplicated: bool
    policy: KeyPolicy

    @classmethod
    def from_json(cls, value: Any) -> KeyPolicyResult:
        obj = _object(value, "data")
        return cls(deduplicated=_bool(obj, "deduplicated", "data"), policy=KeyPolicy.from_json(obj.get("policy")))


def _rate_json(rate: KeyRate | None) -> dict[str, int] | None:
    if rate is None:
        return None
    if not isinstance(rate, KeyRate):
        raise TypeError(f"rate must be a KeyRate, got {type(rate).__name__}")
    return {
        "starts": _whole(rate.starts, "rate.starts"),
        "per_seconds": _whole(rate.per_seconds, "rate.per_seconds"),
        "burst": _whole(rate.burst, "rate.burst"),
    }


@dataclass
class CreateKeyPolicyRequest:
    """``capacity`` None: the server's default, 1; ``rate`` None: no start rate."""

    match: KeyMatch
    reason: str
    capacity: int | None = None
    rate: KeyRate | None = None

    def to_json(self) -> dict[str, Any]:
        if not isinstance(self.match, KeyMatch):
            raise TypeError(f"match must be a KeyMatch, got {type(self.match).__name__}")
        return _without_none(
            {
                "match": self.match.to_json(),
                "capacity": _opt_whole(self.capacity, "capacity"),
                "rate": _rate_json(self.rate),
                "reason": _text(self.reason, "reason"),
            }
        )


@dataclass
class ConfigureKeyPolicyRequest:
    """Full replacement of a policy's capacity and rate (``rate`` None: the policy has none
    from now on), checked against ``expected_revision``. The match never changes."""

    expected_revision: int
    reason: str
    capacity: int
    rate: KeyRate | None = None

    def to_json(self) -> dict[str, Any]:
        return _without_none(
            {
                "expected_revision": _uint64_text(self.expected_revision, "expected_revision"),
                "reason": _text(self.reason, "reason"),
                "capacity": _whole(self.capacity, "capacity"),
                "rate": _rate_json(self.rate),
            }
        )
