"""The worker protocol's frames as the SDK writes and reads them (docs/protocol.md).

Requests are built here, replies and pushed frames decoded, and an assignment checked against
the contract before anything runs under it. No I/O: the connection sends and receives, the
attempts decide what to do with what these functions return.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from orbit_sdk._exceptions import STATUS_OF_CODE, APIError, ProtocolError
from orbit_sdk._models import Dependency, TaskInfo, _object, _opt_int, _opt_str, _opt_time, parse_uint64

CONNECT_PATH = "/v1/workers/connect"
MAX_OUTPUT_DEPTH = 20  # the server refuses an output nested deeper (MariaDB stores JSON up to 32 levels)
MAX_OUTPUT_BYTES = 1_000_000  # a task.result frame must fit the server's 1 MiB WebSocket message limit
MAX_ERROR_MESSAGE = 4096  # characters of an exception's message reported as the error
MISSING_RETRY_AFTER = 1.0  # seconds to wait on a RATE_LIMITED reply without retry_after_ms

# Answers that say "not now" rather than "no".
TRANSIENT_CODES = frozenset({"UNAVAILABLE", "INTERNAL"})


def websocket_url(url: str) -> str:
    """``http(s)://host[/prefix]`` → ``ws(s)://host[/prefix]/v1/workers/connect``."""
    parts = urlsplit(url)
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    if parts.scheme not in schemes or not parts.netloc:
        raise ValueError(f"expected an http(s):// or ws(s):// URL, got {url!r}")
    return urlunsplit((schemes[parts.scheme], parts.netloc, parts.path.rstrip("/") + CONNECT_PATH, "", ""))


# --------------------------------------------------------------------------- frames out


def hello_frame(
    *,
    worker_id: str,
    queues: list[str],
    capacity: int,
    handlers: list[dict[str, str]],
    concurrency_keys: bool,
    version: str,
) -> dict[str, Any]:
    return {
        "type": "hello",
        "worker_id": worker_id,
        "queues": queues,
        "capacity": capacity,
        "handlers": handlers,
        "concurrency_keys": concurrency_keys,
        "version": version,
    }


def attempt_frame(kind: str, attempt_id: str, epoch: int, **fields: Any) -> dict[str, Any]:
    """A request about one attempt (task.start, task.renew, task.result, ...)."""
    return {"type": kind, "attempt_id": attempt_id, "epoch": epoch, **fields}


def encoded(frame: Mapping[str, Any], request_id: str) -> str:
    return json.dumps({**frame, "id": request_id})


# --------------------------------------------------------------------------- frames in


def decoded(message: str | bytes) -> dict[str, Any]:
    """A frame from the server; a ProtocolError when it is not a JSON object."""
    try:
        frame = json.loads(message)
    except ValueError:
        raise ProtocolError("frame is not JSON") from None
    if not isinstance(frame, dict):
        raise ProtocolError("frame is not a JSON object")
    return frame


def error_code(reply: Mapping[str, Any]) -> str:
    code = reply.get("code")
    return code if isinstance(code, str) else "UNKNOWN"


def fatal(code: str, message: str) -> APIError:
    return APIError(code=code, status_code=STATUS_OF_CODE.get(code, 0), message=message)


def seconds(value: Any, default: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return default
    return float(value)


def retry_after(reply: Mapping[str, Any]) -> float:
    """Seconds a RATE_LIMITED reply asks to wait (retry_after_ms)."""
    wait_ms = reply.get("retry_after_ms")
    if isinstance(wait_ms, bool) or not isinstance(wait_ms, (int, float)) or wait_ms < 0:
        return MISSING_RETRY_AFTER
    return float(wait_ms / 1000)


def lease_end(reply: Mapping[str, Any], what: str) -> datetime.datetime | None:
    """A reply's lease_expires_at; None when absent or unreadable (the lease is then renewed
    on the worker's own schedule, never treated as over)."""
    try:
        return _opt_time(reply, "lease_expires_at", what)
    except ProtocolError:
        return None


# --------------------------------------------------------------------------- assignments


@dataclasses.dataclass(frozen=True)
class Assignment:
    attempt_id: str
    epoch: int
    task: TaskInfo
    concurrency_token: int | None
    lease_expires_at: datetime.datetime | None
    state: str | None  # only in hello.ok.held and task.resume.ok
    attempt_number: int | None
    # The permit's slot of a key with capacity above 1 (SPEC §12); absent (None) under capacity 1.
    concurrency_slot: int | None = None
    # The task's dependencies, in depends_on order, with their states and outputs (SPEC §13);
    # empty for a task without dependencies.
    dependencies: tuple[Dependency, ...] = ()


def ids_of(frame: Any) -> tuple[str, int] | None:
    """attempt_id and epoch, when readable: enough to hand a bad assignment back."""
    if not isinstance(frame, Mapping):
        return None
    attempt_id, epoch = frame.get("attempt_id"), frame.get("epoch")
    if not isinstance(attempt_id, str) or not attempt_id or isinstance(epoch, bool) or not isinstance(epoch, int):
        return None
    return attempt_id, epoch


def parse_assignment(frame: Any, *, concurrency_keys: bool) -> Assignment:
    """Decode a task.assign (or held / resume) entry; every contract breach is a ProtocolError.

    Seed keyed-concurrency §4: a keyed task must carry a token, a token needs a key, a worker
    that did not ask for keyed tasks must not get one, and a token is a non-zero canonical
    uint64 decimal string (never a JSON number: it would lose precision beyond 2**53).
    """
    what = "assignment"
    obj = _object(frame, what)
    ids = ids_of(obj)
    if ids is None:
        raise ProtocolError("assignment without a readable attempt_id and epoch")
    task = TaskInfo.from_json(obj.get("task"))
    if task.concurrency_key is not None and not concurrency_keys:
        raise ProtocolError("keyed task assigned to a worker that did not ask for concurrency_keys")
    has_token = "concurrency_token" in obj
    token = parse_uint64(obj["concurrency_token"], "concurrency_token", nonzero=True) if has_token else None
    if task.concurrency_key is not None and token is None:
        raise ProtocolError("keyed task without concurrency_token")
    if task.concurrency_key is None and has_token:
        raise ProtocolError("concurrency_token without a concurrency key")
    slot = _opt_int(obj, "concurrency_slot", what)
    if slot is not None and (slot < 0 or task.concurrency_key is None):
        raise ProtocolError(f"concurrency_slot {slot!r} without a concurrency key, or below 0")
    dependencies = obj.get("dependencies", [])
    if not isinstance(dependencies, list):
        raise ProtocolError(f"{what}.dependencies: expected a list, got {type(dependencies).__name__}")
    return Assignment(
        attempt_id=ids[0],
        epoch=ids[1],
        task=task,
        concurrency_token=token,
        lease_expires_at=_opt_time(obj, "lease_expires_at", what),
        state=_opt_str(obj, "state", what),
        attempt_number=_opt_int(obj, "attempt_number", what),
        concurrency_slot=slot,
        dependencies=tuple(
            Dependency.from_json(item, f"{what}.dependencies[{index}]") for index, item in enumerate(dependencies)
        ),
    )


def changes(known: Assignment, new: Assignment) -> str | None:
    """What a repeated assignment changes about an attempt we already hold, if anything."""
    for name, old_value, new_value in (
        ("epoch", known.epoch, new.epoch),
        ("task id", known.task.id, new.task.id),
        ("concurrency_key", known.task.concurrency_key, new.task.concurrency_key),
        ("concurrency_token", known.concurrency_token, new.concurrency_token),
        ("concurrency_slot", known.concurrency_slot, new.concurrency_slot),
    ):
        if old_value != new_value:
            return f"attempt {known.attempt_id}: {name} changed from {old_value!r} to {new_value!r}"
    return None


# --------------------------------------------------------------------------- results


def failure(outcome: str, retryable: bool, exc: BaseException) -> dict[str, Any]:
    return {
        "outcome": outcome,
        "retryable": retryable,
        "error": {"type": type(exc).__name__, "message": _message_of(exc)},
    }


def _message_of(exc: BaseException) -> str:
    """``str(exc)``, as the result can carry it: kept short enough for its frame (the server
    takes frames up to 1 MiB), valid UTF-8 (the server refuses a frame with a lone surrogate),
    and a placeholder when ``str`` itself fails."""
    try:
        message = str(exc)[:MAX_ERROR_MESSAGE]
    except Exception as problem:
        return f"<str() of {type(exc).__name__} raised {type(problem).__name__}>"
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def success(value: Any) -> dict[str, Any]:
    """The result of a handler that returned `value`, checked as the server would check it."""
    if value is None:
        return {"outcome": "SUCCEEDED", "retryable": False}
    try:
        encoded = json.dumps(value, allow_nan=False)  # as it will be sent: ASCII-escaped
        if "\\ud" in encoded:
            # A surrogate escape (a pair for an emoji, or a lone one): UTF-8 refuses
            # a lone surrogate, as the server would.
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        if len(encoded) > MAX_OUTPUT_BYTES:
            raise ValueError(f"{len(encoded)} bytes encoded, over the {MAX_OUTPUT_BYTES} byte limit")
        if _deeper_than(value, MAX_OUTPUT_DEPTH):
            raise ValueError(f"nested more than {MAX_OUTPUT_DEPTH} levels deep")
    except (TypeError, ValueError, RecursionError) as exc:
        # RecursionError: nested past the encoder's recursion limit (before the depth check).
        # The handler finished (its effect happened) but the output cannot be reported: that
        # is an unknown outcome for the platform, not a failure that could be retried.
        return {
            "outcome": "UNKNOWN",
            "retryable": False,
            "error": {"type": "OutputNotSerializable", "message": f"handler output is not JSON: {exc}"},
        }
    return {"outcome": "SUCCEEDED", "retryable": False, "output": value}


def _deeper_than(value: Any, levels: int) -> bool:
    """Whether JSON `value` nests lists and dicts more than `levels` deep."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth == levels:
                return True
            stack.extend((inner, depth + 1) for inner in (item.values() if isinstance(item, dict) else item))
    return False
