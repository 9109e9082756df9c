"""Reading the worker protocol's frames (docs/protocol.md): JSON decoding,
the request id, and each request's fields, with the exact refusal of each.

Nothing here touches a connection or the database, so the consumer
(workers/consumers.py) is left with dispatching frames to action calls."""

from __future__ import annotations

import json
import re
from typing import Any, TypedDict

from rest_framework import serializers

from orbit.api.fields import StrictBooleanField, StrictCharField, StrictSerializer, is_valid_utf8, uint32_field
from orbit.api.parsers import malformed, strict_loads
from orbit.errors import InvalidArgument
from orbit.fields import UINT32_MAX
from orbit.json_depth import TOO_DEEP, nested_too_deeply
from tasks.actions import endings

# A JSON escape of a UTF-16 surrogate (pairs are fine; a lone one is not UTF-8).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

# A request's id is echoed in its reply: a string the worker chose, bounded.
MAX_REQUEST_ID_LENGTH = 128
MAX_EPOCH = UINT32_MAX  # attempts' epoch column (INT UNSIGNED)
MAX_RELEASE_REASON = 1024  # kept, not refused: a release must not fail on its note
# A worker's handler filter becomes one OR term per pair in every lease's
# candidate scan: past a few hundred, SQLite refuses the expression (its
# depth limit is 1,000) and MySQL plans a long chain for each lease.
MAX_HANDLERS = 256

UNANSWERED = frozenset({"task.assign.ack"})  # no reply, so no id to answer to


class UnreadableFrame(Exception):
    """A frame refused before it is a request: the error to send, and the id
    to answer to when one could be read."""

    def __init__(self, error: InvalidArgument, request_id: Any = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.request_id = request_id


def decode(text_data: str | None, bytes_data: bytes | None) -> dict[str, Any]:
    """The frame as a JSON object, or UnreadableFrame: strict JSON (no NaN,
    Infinity or overflowing numbers), valid UTF-8, an object at the top."""
    try:
        text = text_data if text_data is not None else (bytes_data or b"").decode("utf-8")
        message = strict_loads(text)
    except UnicodeDecodeError:  # before ValueError, of which it is a subclass
        raise UnreadableFrame(InvalidArgument("frame: invalid UTF-8")) from None
    except ValueError as exc:
        raise UnreadableFrame(InvalidArgument(f"frame: malformed JSON ({malformed(exc)})")) from None
    except RecursionError:
        raise UnreadableFrame(InvalidArgument("frame: JSON nested too deeply")) from None
    if not isinstance(message, dict):
        raise UnreadableFrame(InvalidArgument("frame: must be a JSON object"))
    if SURROGATE_ESCAPE.search(text) and not is_valid_utf8(json.dumps(message, ensure_ascii=False)):
        # A \ud800 escape decodes to a lone surrogate, which no column can store.
        request_id = message.get("id")
        readable = not isinstance(request_id, str) or is_valid_utf8(request_id)
        error = InvalidArgument("frame: must be valid UTF-8 (no lone surrogates)")
        raise UnreadableFrame(error, request_id if readable else None)
    return message


def answerable(request_id: Any) -> bool:
    return isinstance(request_id, str) and 0 < len(request_id) <= MAX_REQUEST_ID_LENGTH


def check_request_id(kind: object, request_id: Any) -> None:
    """A request needs an id its reply can name; the unanswered ack does not."""
    if kind not in UNANSWERED and not answerable(request_id):
        raise InvalidArgument(f"id: must be a string of 1 to {MAX_REQUEST_ID_LENGTH} characters")


# The most of an unknown type's text an error echoes: its reply is never as large as the frame it refuses.
ECHOED_TYPE_CHARS = 64


def unknown_type(kind: Any) -> InvalidArgument:
    shown = repr(kind)
    if len(shown) > ECHOED_TYPE_CHARS:
        shown = shown[:ECHOED_TYPE_CHARS] + "…"
    return InvalidArgument(f"type: unknown message type {shown}")


class HandlerInput(StrictSerializer):
    handler = StrictCharField(min_length=1, max_length=128)
    # Left out: any version of the handler (tasks.actions.context.ANY_VERSION).
    handler_version = StrictCharField(min_length=1, max_length=64, required=False)


class HelloInput(StrictSerializer):
    id = serializers.JSONField(required=False)
    type = StrictCharField()
    worker_id = StrictCharField(min_length=1, max_length=128)
    queues = serializers.ListField(child=StrictCharField(max_length=32), allow_empty=False)
    capacity = uint32_field(1, 1000)
    handlers: serializers.ListSerializer[Any] = serializers.ListSerializer(
        child=HandlerInput(), required=False, max_length=MAX_HANDLERS
    )
    concurrency_keys = StrictBooleanField(required=False, default=False)
    version = StrictCharField(required=False, allow_blank=True, max_length=128)

    def validate_worker_id(self, value: str) -> str:
        # Orbit's own error, so it names the field itself. It leaves DRF's
        # error gathering at once, which words the refusal the same: id and
        # type come first but cannot fail (the frame was dispatched as a
        # hello by its type, and an id was required to be a short string).
        if not all(0x20 < ord(ch) < 0x7F for ch in value):
            raise InvalidArgument("worker_id: must be printable ASCII without spaces")
        return value


def hello(message: dict[str, Any]) -> dict[str, Any]:
    """A hello's fields; unlike the other requests it refuses unknown ones."""
    serializer = HelloInput(data=message)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


def field(message: dict[str, Any], name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    value = message.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) and kind is not bool:
        raise InvalidArgument(f"{name}: must be {getattr(kind, '__name__', 'valid')}")
    if not isinstance(value, kind):
        required = "" if optional else "required, "
        raise InvalidArgument(f"{name}: {required}must be {getattr(kind, '__name__', 'valid')}")
    return value


class AttemptRef(TypedDict):
    attempt_id: str
    epoch: int


def attempt_ref(message: dict[str, Any]) -> AttemptRef:
    """The attempt and epoch a start, renew, resume, result or release names."""
    attempt_id = field(message, "attempt_id", str)
    epoch = field(message, "epoch", int)
    if not 1 <= epoch <= MAX_EPOCH:
        raise InvalidArgument(f"epoch: must be an integer between 1 and {MAX_EPOCH}")
    return {"attempt_id": attempt_id, "epoch": epoch}


class ResultFields(TypedDict):
    outcome: str
    retryable: bool
    output: Any
    error: Any


def result(message: dict[str, Any]) -> ResultFields:
    """A task.result's fields besides its attempt reference (read first)."""
    outcome = field(message, "outcome", str)
    if outcome not in endings.OUTCOMES:
        raise InvalidArgument("outcome: must be SUCCEEDED, FAILED or UNKNOWN")
    retryable = field(message, "retryable", bool, optional=True) or False
    for name in ("output", "error"):
        if nested_too_deeply(message.get(name)):
            raise InvalidArgument(f"{name}: {TOO_DEEP}")
    return {"outcome": outcome, "retryable": retryable, "output": message.get("output"), "error": message.get("error")}


def start_next(message: dict[str, Any]) -> bool:
    """A task.result's `start_next`: whether its worker sends ahead the Start
    of the assignment the answer may hand on (docs/protocol.md)."""
    return field(message, "start_next", bool, optional=True) or False


def release_reason(message: dict[str, Any]) -> str:
    reason = field(message, "reason", str, optional=True) or ""
    return reason[:MAX_RELEASE_REASON]
