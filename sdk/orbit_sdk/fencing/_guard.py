"""The guard: the one check-raise-dedupe-write operation, its refusals, and the sync
:class:`Guard` / async :class:`AsyncGuard` that run it in a transaction on a connection."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import inspect
import json
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any, Protocol

from orbit_sdk._exceptions import OrbitError
from orbit_sdk.fencing._adapters import _adapter
from orbit_sdk.fencing._values import (
    FENCE_SLOT_TABLE,
    FENCE_TABLE,
    MAX_KEY,
    MAX_NAMESPACE,
    MAX_OPERATION_ID,
    OPERATION_TABLE,
    _aware,
    _check_dialect,
    _identifier,
    _slot,
    _token,
)

# Seconds by which the lease check refuses early: covers the skew between the Orbit server's
# clock (which set lease_expires_at) and the database's clock. Healthy workers renew when a
# third of the lease has passed, so their lease_expires_at is far ahead of any sane margin.
DEFAULT_LEASE_MARGIN = 2.0
LOCK_RETRIES = 8  # deadlock / busy answers while taking the fence lock, retried (nothing ran yet)


# --------------------------------------------------------------------------- errors


class FenceRefused(OrbitError):
    """The guard refused a write; nothing it did in that transaction was kept."""


class StaleToken(FenceRefused):
    """``token`` is lower than the ``highest`` token this (namespace, key) has accepted, or with
    a ``slot``, this (namespace, key, slot)."""

    def __init__(self, token: int, highest: int, namespace: str = "", key: str = "", slot: int | None = None) -> None:
        self.token = token
        self.highest = highest
        self.namespace = namespace
        self.key = key
        self.slot = slot
        where = f"key {key!r}" if slot is None else f"key {key!r} slot {slot}"
        held = "this key" if slot is None else "this slot of the key"
        super().__init__(
            f"stale token {token} for {where} in namespace {namespace!r}: the resource has "
            f"accepted token {highest}; a newer attempt holds (or held) {held}, so this write is refused"
        )


class LeaseExpired(FenceRefused):
    """The writer's lease has passed by the database's clock (less ``margin`` seconds)."""

    def __init__(self, lease_expires_at: datetime.datetime, database_now: datetime.datetime, margin: float) -> None:
        self.lease_expires_at = lease_expires_at
        self.database_now = database_now
        self.margin = margin
        super().__init__(
            f"lease expired: it ended at {lease_expires_at.isoformat()} and the database's clock reads "
            f"{database_now.isoformat()} (margin {margin:g} s); the platform may already have given the key "
            "to a newer attempt, so this write is refused"
        )


class TokenOutOfRange(FenceRefused, ValueError):
    """``token`` is above the guard's ``max_token``: no token Orbit assigns gets that high, and
    accepting it would make every real holder's token stale for good (docs/fencing.md)."""

    def __init__(self, token: int, max_token: int) -> None:
        self.token = token
        self.max_token = max_token
        super().__init__(
            f"token {token} is above this resource's max_token {max_token}: Orbit assigns no token that "
            "high, so it is forged or mistyped; refused before the fence row is touched"
        )


class OperationMismatch(FenceRefused):
    """An operation id the middleware recorded for one request was sent with another (a
    different method, path, query string or body): neither answered from the record nor run."""

    def __init__(self, operation_id: str) -> None:
        self.operation_id = operation_id
        super().__init__(
            f"operation {operation_id!r} was recorded for a different request (method, path, query string or "
            "body differ): a replay must repeat the request exactly; a new write needs a new operation id"
        )


def _encode(dialect: str, token: int) -> Any:
    return f"{token:020d}" if dialect == "sqlite" else token


def _encode_result(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the write's result must be JSON-serialisable (it is recorded for replays): {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Applied:
    """What a guarded write did: ``result`` (decoded from its JSON record, the same for the
    first call and every replay), whether it was a ``replayed`` operation, the ``token`` it was
    recorded with, and the ``highest`` token before this call."""

    result: Any
    replayed: bool
    token: int
    highest: int


# --------------------------------------------------------------------------- the one operation
#
# The check-raise-dedupe-write sequence is written once, as a generator that yields what it
# needs from the database (a _Query) or the user's function (_CALL) and gets the answer sent
# back; a sync and an async driver run it. So the two can never disagree on the order.


@dataclasses.dataclass(frozen=True)
class _Query:
    sql: str
    params: tuple[Any, ...]
    lock_step: bool = False  # an error here is retried: nothing but the fence lock was tried


_CALL = object()


def _clock_sql(dialect: str) -> str:
    """The database's current time as integer microseconds since the epoch, in UTC."""
    if dialect == "mysql":
        return "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
    if dialect == "postgresql":
        return "SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint"
    return "SELECT CAST(round((julianday('now') - 2440587.5) * 86400000000.0) AS INTEGER)"


def _lease_check(dialect: str, lease_expires_at: datetime.datetime, margin: float) -> Generator[Any, Any, None]:
    rows = yield _Query(_clock_sql(dialect), ())
    now = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(microseconds=int(rows[0][0]))
    if now + datetime.timedelta(seconds=margin) >= lease_expires_at:
        raise LeaseExpired(lease_expires_at, now, margin)


def _protocol(
    dialect: str,
    namespace: str,
    key: str,
    token: int,
    operation_id: str,
    lease_expires_at: datetime.datetime | None,
    margin: float,
    slot: int | None = None,
) -> Generator[Any, Any, Applied]:
    where = "namespace = %s AND fence_key = %s"
    ids: tuple[Any, ...] = (namespace, key)
    # The fence row: the key's, or with a slot the (key, slot)'s, so that the valid holders of
    # a key's different slots do not fence each other out. Operations stay per key.
    table, fence_where, fence_ids, columns = FENCE_TABLE, where, ids, "namespace, fence_key"
    if slot is not None:
        table, fence_where, fence_ids = FENCE_SLOT_TABLE, where + " AND slot = %s", (*ids, slot)
        columns += ", slot"
    # 1. Lock (or create, then lock) the fence row. SQLite has no row locks: the guard's
    #    transaction holds the database's write lock from its first statement (BEGIN IMMEDIATE,
    #    or a write as the first statement under Django), so it starts with the insert.
    select = f"SELECT highest_token FROM {table} WHERE {fence_where}"
    rows: list[Any] = []
    if dialect != "sqlite":
        rows = yield _Query(select + " FOR UPDATE", fence_ids, lock_step=True)
    if not rows:
        marks = ", ".join(["%s"] * len(fence_ids))
        insert = f"INSERT INTO {table} ({columns}, highest_token) VALUES ({marks}, %s)"
        if dialect == "mysql":
            insert += " ON DUPLICATE KEY UPDATE highest_token = highest_token"
        elif dialect == "postgresql":
            insert += f" ON CONFLICT ({columns}) DO NOTHING"
        else:
            insert = insert.replace("INSERT INTO", "INSERT OR IGNORE INTO", 1)
        yield _Query(insert, (*fence_ids, _encode(dialect, 0)), lock_step=True)
        rows = yield _Query(select + ("" if dialect == "sqlite" else " FOR UPDATE"), fence_ids, lock_step=True)
    highest = int(rows[0][0])
    record = f"SELECT token, result FROM {OPERATION_TABLE} WHERE {where} AND operation_id = %s"
    # 2. Refuse a stale token, except for the resend of an operation this token (or an older
    #    one) already applied: it changes nothing, so it answers what it recorded.
    if token < highest:
        rows = yield _Query(record, (*ids, operation_id))
        if rows and int(rows[0][0]) <= token:
            return Applied(json.loads(rows[0][1]), True, int(rows[0][0]), highest)
        raise StaleToken(token, highest, namespace, key, slot)
    # 3. Raise the highest token (kept only if the transaction commits).
    if token > highest:
        yield _Query(
            f"UPDATE {table} SET highest_token = %s WHERE {fence_where}", (_encode(dialect, token), *fence_ids)
        )
    # 4. An operation already applied (by this token or an older one) answers what it recorded.
    rows = yield _Query(record, (*ids, operation_id))
    if rows:
        return Applied(json.loads(rows[0][1]), True, int(rows[0][0]), highest)
    # 5. Optionally, the lease by the database's clock; 6. the write; the lease again, since the
    #    write becomes visible only at commit; 7. the record.
    if lease_expires_at is not None:
        yield from _lease_check(dialect, lease_expires_at, margin)
    value = yield _CALL
    encoded = _encode_result(value)
    if lease_expires_at is not None:
        yield from _lease_check(dialect, lease_expires_at, margin)
    yield _Query(
        f"INSERT INTO {OPERATION_TABLE} (namespace, fence_key, operation_id, token, result)"
        " VALUES (%s, %s, %s, %s, %s)",
        (*ids, operation_id, _encode(dialect, token), encoded),
    )
    return Applied(json.loads(encoded), False, token, highest)


def _retryable(exc: BaseException) -> bool:
    """Deadlock, serialization failure, lock wait timeout, SQLite busy: a try that can be re-run."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "sqlstate", None) in ("40P01", "40001", "55P03"):
            return True
        args = getattr(seen, "args", ())
        if args and isinstance(args[0], int) and args[0] in (1213, 1205):
            return True
        if isinstance(seen, sqlite3.OperationalError) and ("locked" in str(seen) or "busy" in str(seen)):
            return True
        seen = seen.__cause__
    return False


def _backoff(attempt: int) -> float:
    return random.uniform(0, min(0.2, 0.005 * 2**attempt))  # jitter: contenders do not retry in step


# --------------------------------------------------------------------------- the guards


class _ExecutionLike(Protocol):
    """What the guard reads from an ``orbit_sdk.Execution`` (so tests can pass their own)."""

    @property
    def concurrency_key(self) -> str | None: ...

    concurrency_token: int | None
    lease_expires_at: datetime.datetime | None
    namespace_id: str | None


def _from_execution(execution: _ExecutionLike) -> tuple[str, str, int]:
    namespace, key, token = execution.namespace_id, execution.concurrency_key, execution.concurrency_token
    if key is None or token is None:
        raise ValueError("the execution is not keyed: it has no concurrency_key and token to fence with")
    if namespace is None:
        raise ValueError(
            "the execution has no namespace_id: make the Worker with Worker.from_credentials_file (the "
            "credentials carry it) or pass namespace_id= to Worker"
        )
    return namespace, key, token


def _slot_of(execution: _ExecutionLike) -> int | None:
    # Read, not required: an execution of an SDK before capacities (or a test's own) has none.
    return _slot(getattr(execution, "concurrency_slot", None))


class Guard:
    """Runs writes on ``connection`` inside the fence (see the module docstring).

    ``connection``: a sqlite3, psycopg 3, mysqlclient or PyMySQL connection, or a Django
    connection (``django.db.connection``). ``dialect``: ``"mysql"``, ``"postgresql"`` or
    ``"sqlite"``; detected from the connection when omitted. ``lease_margin``: seconds the lease
    check refuses early, to cover clock skew between the Orbit server and the database.
    ``max_token``: when given, a token above it raises :class:`TokenOutOfRange` before any
    statement, so a forged huge token cannot brick the key's fence (docs/fencing.md).

    Transactions: on a plain DB-API connection the write is its own transaction, committed
    before :meth:`write` returns (sqlite3 and psycopg refuse to start it inside a transaction
    you left open, except that psycopg, like Django, nests it as a savepoint inside an open
    ``conn.transaction()`` block; with MySQL drivers, uncommitted work on the connection is
    committed by the guard's START TRANSACTION, so leave none). On a Django connection outside
    ``atomic`` it is its own transaction; inside ``atomic`` it is a savepoint: its effects,
    and the fence row's lock, last until the outer block commits, and vanish if it rolls back.
    ``fn`` must not commit or roll back.
    """

    def __init__(
        self,
        connection: Any,
        dialect: str | None = None,
        *,
        lease_margin: float = DEFAULT_LEASE_MARGIN,
        lock_retries: int = LOCK_RETRIES,
        max_token: int | None = None,
    ) -> None:
        self.connection = connection
        self._adapter = _adapter(connection, dialect)
        self.dialect = self._adapter.dialect
        if lease_margin < 0:
            raise ValueError("lease_margin must be >= 0 seconds")
        self.lease_margin = float(lease_margin)
        self.lock_retries = lock_retries
        self.max_token = None if max_token is None else _token(max_token)

    def write(
        self,
        namespace: str,
        key: str,
        token: int,
        operation_id: str,
        fn: Callable[[Any], Any],
        *,
        lease_expires_at: datetime.datetime | None = None,
        slot: int | None = None,
    ) -> Any:
        """Run ``fn(connection)`` in the fence's transaction and return its JSON result.

        Raises :class:`StaleToken` when ``token`` is below the highest token accepted for
        (namespace, key), and :class:`LeaseExpired` when ``lease_expires_at`` is given and has
        passed by the database's clock (less the margin), and :class:`TokenOutOfRange` when
        ``token`` is above ``max_token``. With ``slot`` (a key of capacity above 1: Orbit's
        ``concurrency_slot``), the highest token is the (namespace, key, slot)'s: a write is
        refused only when a newer token of the same slot was accepted, so the valid holders of
        different slots both write. Without it, the key's, exactly as for a key of capacity 1; a
        key's writes must all pass a slot or none (the two are fenced apart). An ``operation_id``
        already applied returns the recorded
        result without calling ``fn``, also when a newer holder has written since, provided
        ``token`` is the one it was applied with (or newer). Any exception rolls back
        everything: the raised token, ``fn``'s writes, the record.
        """
        return self.apply(namespace, key, token, operation_id, fn, lease_expires_at=lease_expires_at, slot=slot).result

    def apply(
        self,
        namespace: str,
        key: str,
        token: int,
        operation_id: str,
        fn: Callable[[Any], Any],
        *,
        lease_expires_at: datetime.datetime | None = None,
        on_replay: Callable[[Any], None] | None = None,
        slot: int | None = None,
    ) -> Applied:
        """:meth:`write`, answering an :class:`Applied` (whether it was a replay, the tokens).

        ``on_replay(recorded_result)``, when given, is called before a replay is answered, inside
        the transaction: an exception it raises rolls back (the fence keeps its highest token)
        and propagates. The middlewares use it to refuse a replay of a different request.
        """
        args = _arguments(namespace, key, token, operation_id, lease_expires_at, self.max_token)
        fenced_slot = _slot(slot)
        attempt = 0
        while True:
            steps = _protocol(self.dialect, *args, self.lease_margin, fenced_slot)
            lock_step, owned = True, True
            try:
                with self._adapter.transaction() as (run, owned):
                    answer: Any = None
                    while True:
                        try:
                            step = steps.send(answer)
                        except StopIteration as done:
                            result: Applied = done.value
                            if result.replayed and on_replay is not None:
                                on_replay(result.result)  # still in the transaction: a refusal undoes the raise
                            break
                        if step is _CALL:
                            lock_step = False
                            answer = fn(self.connection)
                        else:
                            lock_step = lock_step and step.lock_step
                            answer = run(step.sql, step.params)
                return result
            except Exception as exc:
                # Retried only when nothing but the fence lock was tried, and only when the guard
                # owns the transaction (MySQL rolls back the caller's whole transaction on a deadlock).
                if lock_step and owned and attempt < self.lock_retries and _retryable(exc):
                    time.sleep(_backoff(attempt))
                    attempt += 1
                    continue
                raise

    def highest(self, namespace: str, key: str, slot: int | None = None) -> int:
        """The highest token accepted for (namespace, key), or (namespace, key, slot); 0 when
        none was (read in its own transaction)."""
        rows = self._read(*_highest_query(namespace, key, slot))
        return int(rows[0][0]) if rows else 0

    def recorded(self, namespace: str, key: str, operation_id: str) -> Applied | None:
        """The record of an applied operation (``replayed=True``), or None."""
        rows = self._read(
            f"SELECT token, result FROM {OPERATION_TABLE}"
            " WHERE namespace = %s AND fence_key = %s AND operation_id = %s",
            (namespace, key, operation_id),
        )
        return Applied(json.loads(rows[0][1]), True, int(rows[0][0]), 0) if rows else None

    def _read(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        with self._adapter.transaction() as (run, _owned):
            return run(sql, params)

    def for_execution(self, execution: _ExecutionLike, *, check_lease: bool = True) -> ExecutionFence:
        """A guard bound to a worker's execution: its namespace, key, token, slot (its
        ``concurrency_slot``: None under capacity 1) and (with ``check_lease``) its current
        ``lease_expires_at``, read at each write."""
        namespace, key, token = _from_execution(execution)
        return ExecutionFence(self, execution, namespace, key, token, check_lease, _slot_of(execution))


def _highest_query(namespace: str, key: str, slot: int | None) -> tuple[str, tuple[Any, ...]]:
    where = "namespace = %s AND fence_key = %s"
    if _slot(slot) is None:
        return f"SELECT highest_token FROM {FENCE_TABLE} WHERE {where}", (namespace, key)
    return f"SELECT highest_token FROM {FENCE_SLOT_TABLE} WHERE {where} AND slot = %s", (namespace, key, slot)


def _arguments(
    namespace: str,
    key: str,
    token: int,
    operation_id: str,
    lease_expires_at: datetime.datetime | None,
    max_token: int | None,
) -> tuple[str, str, int, str, datetime.datetime | None]:
    if max_token is not None and _token(token) > max_token:
        raise TokenOutOfRange(token, max_token)
    return (
        _identifier(namespace, "namespace", MAX_NAMESPACE),
        _identifier(key, "key", MAX_KEY),
        _token(token),
        _identifier(operation_id, "operation_id", MAX_OPERATION_ID),
        None if lease_expires_at is None else _aware(lease_expires_at),
    )


@dataclasses.dataclass(frozen=True)
class ExecutionFence:
    """:meth:`Guard.for_execution`: ``write(operation_id, fn)`` with the execution's fence."""

    guard: Guard
    execution: _ExecutionLike
    namespace: str
    key: str
    token: int
    check_lease: bool
    slot: int | None = None

    def _lease(self) -> datetime.datetime | None:
        if not self.check_lease:
            return None
        expires = self.execution.lease_expires_at  # refreshed by every renewal: read it now
        if expires is None:
            raise ValueError("the execution has no lease_expires_at to check; use check_lease=False")
        return expires

    def write(self, operation_id: str, fn: Callable[[Any], Any]) -> Any:
        return self.apply(operation_id, fn).result

    def apply(self, operation_id: str, fn: Callable[[Any], Any]) -> Applied:
        return self.guard.apply(
            self.namespace, self.key, self.token, operation_id, fn, lease_expires_at=self._lease(), slot=self.slot
        )


class AsyncGuard:
    """The async :class:`Guard`, for psycopg 3's ``AsyncConnection`` (dialect ``"postgresql"``).

    ``await guard.write(namespace, key, token, operation_id, fn)``; ``fn(connection)`` may be a
    coroutine function or a plain one. Its transaction is ``conn.transaction()``: its own on an
    idle connection, a savepoint inside an open ``async with conn.transaction()`` block. Other
    drivers (mysqlclient, PyMySQL, sqlite3, Django) have no async transaction API: run the sync
    guard in a thread (``await asyncio.to_thread(guard.write, ...)``, or Django's
    ``sync_to_async``).
    """

    def __init__(
        self,
        connection: Any,
        dialect: str = "postgresql",
        *,
        lease_margin: float = DEFAULT_LEASE_MARGIN,
        lock_retries: int = LOCK_RETRIES,
        max_token: int | None = None,
    ) -> None:
        if _check_dialect(dialect) != "postgresql" or not type(connection).__module__.startswith("psycopg"):
            raise TypeError("AsyncGuard supports psycopg 3 AsyncConnection (postgresql); see its docstring")
        self.connection = connection
        self.dialect = dialect
        if lease_margin < 0:
            raise ValueError("lease_margin must be >= 0 seconds")
        self.lease_margin = float(lease_margin)
        self.lock_retries = lock_retries
        self.max_token = None if max_token is None else _token(max_token)

    async def write(
        self,
        namespace: str,
        key: str,
        token: int,
        operation_id: str,
        fn: Callable[[Any], Any],
        *,
        lease_expires_at: datetime.datetime | None = None,
        slot: int | None = None,
    ) -> Any:
        applied = await self.apply(
            namespace, key, token, operation_id, fn, lease_expires_at=lease_expires_at, slot=slot
        )
        return applied.result

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[tuple[Any, bool]]:
        conn = self.connection
        status = int(conn.info.transaction_status)
        if status == 3:
            raise RuntimeError("the psycopg connection is in a failed transaction: roll it back first")
        owned = status == 0
        async with conn.transaction(), conn.cursor() as cursor:
            if owned:
                await cursor.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            yield cursor, owned

    async def apply(
        self,
        namespace: str,
        key: str,
        token: int,
        operation_id: str,
        fn: Callable[[Any], Any],
        *,
        lease_expires_at: datetime.datetime | None = None,
        on_replay: Callable[[Any], None] | None = None,
        slot: int | None = None,
    ) -> Applied:
        args = _arguments(namespace, key, token, operation_id, lease_expires_at, self.max_token)
        fenced_slot = _slot(slot)
        attempt = 0
        while True:
            steps = _protocol(self.dialect, *args, self.lease_margin, fenced_slot)
            lock_step, owned = True, True
            try:
                async with self._transaction() as (cursor, owned):
                    answer: Any = None
                    while True:
                        try:
                            step = steps.send(answer)
                        except StopIteration as done:
                            result: Applied = done.value
                            if result.replayed and on_replay is not None:
                                on_replay(result.result)  # still in the transaction: a refusal undoes the raise
                            break
                        if step is _CALL:
                            lock_step = False
                            answer = fn(self.connection)
                            if inspect.isawaitable(answer):
                                answer = await answer
                        else:
                            lock_step = lock_step and step.lock_step
                            await cursor.execute(step.sql, step.params)
                            answer = list(await cursor.fetchall()) if cursor.description is not None else []
                return result
            except Exception as exc:
                if lock_step and owned and attempt < self.lock_retries and _retryable(exc):
                    await asyncio.sleep(_backoff(attempt))
                    attempt += 1
                    continue
                raise

    async def highest(self, namespace: str, key: str, slot: int | None = None) -> int:
        async with self._transaction() as (cursor, _owned):
            await cursor.execute(*_highest_query(namespace, key, slot))
            row = await cursor.fetchone()
        return int(row[0]) if row else 0

    def for_execution(self, execution: _ExecutionLike, *, check_lease: bool = True) -> AsyncExecutionFence:
        namespace, key, token = _from_execution(execution)
        return AsyncExecutionFence(self, execution, namespace, key, token, check_lease, _slot_of(execution))


@dataclasses.dataclass(frozen=True)
class AsyncExecutionFence:
    """:meth:`AsyncGuard.for_execution`: ``await write(operation_id, fn)``."""

    guard: AsyncGuard
    execution: _ExecutionLike
    namespace: str
    key: str
    token: int
    check_lease: bool
    slot: int | None = None

    async def write(self, operation_id: str, fn: Callable[[Any], Any]) -> Any:
        lease = self.execution.lease_expires_at if self.check_lease else None
        if self.check_lease and lease is None:
            raise ValueError("the execution has no lease_expires_at to check; use check_lease=False")
        return await self.guard.write(
            self.namespace, self.key, self.token, operation_id, fn, lease_expires_at=lease, slot=self.slot
        )
