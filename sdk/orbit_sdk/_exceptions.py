"""Exceptions raised by, and understood by, the Orbit SDK.

Hierarchy::

    OrbitError                  base of everything the SDK raises on purpose
    ├── APIError                the server answered with an error envelope (or an error status)
    ├── TransportError          no answer: connect/read/write failure or timeout; the outcome of a
    │                           write is unknown, re-send it with the same Idempotency-Key
    ├── ProtocolError           the server's answer breaks the contract (bad envelope, a uint64 that
    │                           is not a canonical decimal string, a keyed assignment without token…)
    ├── CredentialsError        the credentials file is missing, unreadable or malformed
    └── handler signals         raised by Worker handlers to choose the reported outcome
        ├── RetryableError      → outcome FAILED, retryable=True ("safe retry": no effect happened)
        ├── UnknownOutcome      → outcome UNKNOWN (the effect may or may not have happened)
        └── CancelRequested     raised by Execution.raise_if_cancelled(); reported like any other
                                exception: FAILED, retryable=False

Any other exception raised by a handler is reported as FAILED, retryable=False, with error
``{"type": <class name>, "message": str(exc)}``.
"""

from __future__ import annotations

import datetime
import re

# SPEC §3: the code → HTTP status table. Used to give worker-protocol errors (which carry a code
# but no HTTP status) the status their code stands for.
STATUS_OF_CODE = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "IDEMPOTENCY_CONFLICT": 409,
    "STATE_CONFLICT": 409,
    "PAYLOAD_TOO_LARGE": 413,
    "QUEUE_FULL": 429,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
}


MAX_RETRY_AFTER = datetime.timedelta(hours=1)
_RETRY_AFTER_SECONDS = re.compile(r"[0-9]+")


def parse_retry_after(value: str | None) -> datetime.timedelta:
    """Integer seconds from a Retry-After header; missing, invalid or over one hour → 0.

    An HTTP-date is not integer seconds and reads as 0 as well: the server only sends seconds.
    """
    if value is None:
        return datetime.timedelta(0)
    text = value.strip().lstrip("0") or "0"
    # More than four digits is over an hour whatever they say (and int() refuses
    # a string of over 4,300 digits).
    if len(text) > 4 or not _RETRY_AFTER_SECONDS.fullmatch(text):
        return datetime.timedelta(0)
    seconds = int(text)
    if seconds > MAX_RETRY_AFTER.total_seconds():
        return datetime.timedelta(0)
    return datetime.timedelta(seconds=seconds)


class OrbitError(Exception):
    """Base class of every exception the SDK raises on purpose."""


class APIError(OrbitError):
    """The server rejected a request.

    ``retry_after`` is the server's integer-seconds ``Retry-After`` advice; missing, invalid or
    over one hour reads as ``timedelta(0)``. The SDK never re-sends a business write by itself:
    after ``QUEUE_FULL`` wait at least ``retry_after`` and re-send the same request with the same
    Idempotency-Key.
    """

    def __init__(
        self,
        code: str,
        status_code: int,
        message: str,
        request_id: str = "",
        retry_after: datetime.timedelta = datetime.timedelta(0),
    ) -> None:
        self.code = code
        self.status_code = status_code
        self.message = message
        self.request_id = request_id
        self.retry_after = retry_after
        super().__init__(code, status_code, message, request_id, retry_after)

    def __str__(self) -> str:
        text = f"{self.code} ({self.status_code}): {self.message}"
        if self.request_id:
            text += f" [request_id={self.request_id}]"
        return text


class TransportError(OrbitError):
    """The request got no answer; for a write, whether it took effect is unknown."""


class ProtocolError(OrbitError):
    """The server sent something the contract does not allow."""


class CredentialsError(OrbitError):
    """The credentials file could not be used."""


class RetryableError(OrbitError):
    """Raise from a handler when the attempt failed without effect and may safely run again."""


class UnknownOutcome(OrbitError):
    """Raise from a handler when the effect may have happened: the task goes to NEEDS_REVIEW."""


class CancelRequested(OrbitError):
    """Raised by ``Execution.raise_if_cancelled()`` once the task was cancelled or its lease lost."""
