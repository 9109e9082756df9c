"""The one exception family for Orbit's domain errors.

Actions raise these; the HTTP exception handler and the worker consumer turn
them into the error envelope or the protocol's error frame. Each class fixes
its wire code and HTTP status:

    OrbitError
    ├── InvalidArgument       400 INVALID_ARGUMENT
    ├── Unauthenticated       401 UNAUTHENTICATED
    ├── PermissionDenied      403 PERMISSION_DENIED
    ├── NotFound              404 NOT_FOUND
    ├── IdempotencyConflict   409 IDEMPOTENCY_CONFLICT
    ├── StateConflict         409 STATE_CONFLICT
    ├── PayloadTooLarge       413 PAYLOAD_TOO_LARGE
    ├── QueueFull             429 QUEUE_FULL (Retry-After: 1)
    ├── HeadersTooLarge       431 REQUEST_HEADERS_TOO_LARGE (answered by server.serving)
    ├── Unavailable           503 UNAVAILABLE
    └── Internal              500 INTERNAL
"""

from __future__ import annotations


class OrbitError(Exception):
    code = "INTERNAL"
    status = 500

    def __init__(self, message: str, *, retry_after: int | None = None, details: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.details = details or {}


class InvalidArgument(OrbitError):
    code = "INVALID_ARGUMENT"
    status = 400


class Unauthenticated(OrbitError):
    code = "UNAUTHENTICATED"
    status = 401


class PermissionDenied(OrbitError):
    code = "PERMISSION_DENIED"
    status = 403


class NotFound(OrbitError):
    code = "NOT_FOUND"
    status = 404


class IdempotencyConflict(OrbitError):
    code = "IDEMPOTENCY_CONFLICT"
    status = 409


class StateConflict(OrbitError):
    code = "STATE_CONFLICT"
    status = 409


class PayloadTooLarge(OrbitError):
    code = "PAYLOAD_TOO_LARGE"
    status = 413


class QueueFull(OrbitError):
    code = "QUEUE_FULL"
    status = 429
    MESSAGE = "queue unfinished task limit reached; retry later using the original identity"

    def __init__(self) -> None:
        super().__init__(self.MESSAGE, retry_after=1)


class HeadersTooLarge(OrbitError):
    code = "REQUEST_HEADERS_TOO_LARGE"
    status = 431


class Unavailable(OrbitError):
    code = "UNAVAILABLE"
    status = 503


class Internal(OrbitError):
    code = "INTERNAL"
    status = 500


QUEUE_RATE_REACHED = "queue start rate reached; retry after the window"
KEY_RATE_REACHED = "concurrency key start rate reached; retry when the key has room"


class RateLimited(OrbitError):
    """Worker protocol only: Start refused, the queue's window is full or its
    concurrency key has no start room under its rate."""

    code = "RATE_LIMITED"
    status = 429

    def __init__(self, retry_after_ms: int, message: str = QUEUE_RATE_REACHED) -> None:
        super().__init__(message, details={"retry_after_ms": retry_after_ms})
        self.retry_after_ms = retry_after_ms


class QueuePaused(OrbitError):
    code = "QUEUE_PAUSED"
    status = 409


class LeaseLost(OrbitError):
    code = "LEASE_LOST"
    status = 409


class TaskCancelled(OrbitError):
    code = "TASK_CANCELLED"
    status = 409


def require_revision(expected: int, current: int) -> None:
    """A management change names the revision it read; any other is a conflict."""
    if current != expected:
        raise StateConflict(f"expected_revision {expected} does not match current revision {current}")
