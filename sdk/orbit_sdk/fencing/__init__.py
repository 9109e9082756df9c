"""Fencing: make a keyed task's permit token protect the real write (seed keyed-concurrency §4).

Orbit gives every attempt on a concurrency key a strictly increasing ``concurrency_token``.
The token protects nothing unless the resource checks it, in ONE atomic operation: lock the
(namespace, key) fence row (or, for a key of capacity above 1, the (namespace, key, slot) row:
``Guard.write(..., slot=execution.concurrency_slot)``, which ``for_execution`` does by itself),
refuse ``token < highest_token``, raise the highest token,
de-duplicate by a stable operation id, do the write and record its result. This module is
that operation for resources kept in MySQL/MariaDB, PostgreSQL or SQLite::

    guard = fencing.Guard(connection, "postgresql")          # a DB-API or Django connection
    for statement in fencing.ddl("postgresql"): ...           # once: the two tables it needs

    def update(execution: orbit_sdk.Execution) -> dict[str, int]:
        def write(conn: Any) -> dict[str, int]:               # runs inside the guard's transaction
            conn.cursor().execute("UPDATE objects SET ... WHERE id = %s", [42])
            return {"rows": 1}
        return guard.for_execution(execution).write("update-42-op-1", write)

What it proves and what not (docs/fencing.md has the long form): a write that commits
through the guard was made with a token no lower than any the resource had seen, and an
operation id is applied at most once. A token cannot prove that no higher token exists that
has not reached the resource yet (a paused worker past its lease still passes the token
check until a newer holder writes); the optional lease check narrows that window by the
resource's own clock. Neither is an authorization check: the resource must still
authenticate the caller.

No Django import at module import time, and no driver import: the drivers are the user's.

One module per seam, imported one way (``_http`` → ``_guard`` → ``_adapters`` / ``_ddl``, all on
``_values``): ``_values`` the names and limits, ``_ddl`` the tables, ``_adapters`` the
connections, ``_guard`` the operation and the guards, ``_http`` the headers and middlewares.
This module is the API: import from ``orbit_sdk.fencing``, not from the seams.
"""

from __future__ import annotations

# `X as X`: public names the module had outside __all__ (tests and docs read them as
# fencing.NAME), re-exported explicitly so they stay importable, and typed, from here.
from orbit_sdk.fencing._ddl import (
    ddl,
    django_operations,
    django_slot_operations,
    drop_ddl,
    install,
    slot_ddl,
    slot_drop_ddl,
)
from orbit_sdk.fencing._guard import (
    DEFAULT_LEASE_MARGIN,
    Applied,
    AsyncGuard,
    ExecutionFence,
    FenceRefused,
    Guard,
    LeaseExpired,
    OperationMismatch,
    StaleToken,
    TokenOutOfRange,
)
from orbit_sdk.fencing._guard import LOCK_RETRIES as LOCK_RETRIES
from orbit_sdk.fencing._guard import AsyncExecutionFence as AsyncExecutionFence
from orbit_sdk.fencing._http import (
    HEADER_KEY,
    HEADER_LEASE,
    HEADER_NAMESPACE,
    HEADER_OPERATION,
    HEADER_SLOT,
    HEADER_TOKEN,
    REPLAYED_HEADERS,
    ASGIMiddleware,
    FenceContext,
    FenceRequest,
    WSGIMiddleware,
    headers_for,
    parse_headers,
)
from orbit_sdk.fencing._http import HEADER_REPLAYED as HEADER_REPLAYED
from orbit_sdk.fencing._values import DIALECTS
from orbit_sdk.fencing._values import FENCE_SLOT_TABLE as FENCE_SLOT_TABLE
from orbit_sdk.fencing._values import FENCE_TABLE as FENCE_TABLE
from orbit_sdk.fencing._values import MAX_KEY as MAX_KEY
from orbit_sdk.fencing._values import MAX_NAMESPACE as MAX_NAMESPACE
from orbit_sdk.fencing._values import MAX_OPERATION_ID as MAX_OPERATION_ID
from orbit_sdk.fencing._values import OPERATION_TABLE as OPERATION_TABLE
from orbit_sdk.fencing._values import UINT64_MAX as UINT64_MAX

__all__ = [
    "ASGIMiddleware",
    "Applied",
    "AsyncGuard",
    "DIALECTS",
    "DEFAULT_LEASE_MARGIN",
    "ExecutionFence",
    "FenceContext",
    "FenceRefused",
    "FenceRequest",
    "Guard",
    "HEADER_KEY",
    "HEADER_LEASE",
    "HEADER_NAMESPACE",
    "HEADER_OPERATION",
    "HEADER_SLOT",
    "HEADER_TOKEN",
    "LeaseExpired",
    "OperationMismatch",
    "REPLAYED_HEADERS",
    "StaleToken",
    "TokenOutOfRange",
    "WSGIMiddleware",
    "ddl",
    "django_operations",
    "django_slot_operations",
    "drop_ddl",
    "headers_for",
    "install",
    "parse_headers",
    "slot_ddl",
    "slot_drop_ddl",
]
