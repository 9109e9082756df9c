"""Fencing: make a keyed task's permit token protect the real write (seed keyed-concurrency §4).

Orbit gives every attempt on a concurrency key a strictly increasing ``concurrency_token``.
The token protects nothing unless the resource checks it, in ONE atomic operation: lock the
(namespace, key) fence row, refuse ``token < highest_token``, raise the highest token,
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
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime
import hashlib
import importlib
import inspect
import io
import json
import random
import sqlite3
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Iterator, Mapping
from typing import Any, Protocol

from orbit_sdk._exceptions import OrbitError

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
    "HEADER_TOKEN",
    "LeaseExpired",
    "OperationMismatch",
    "REPLAYED_HEADERS",
    "StaleToken",
    "TokenOutOfRange",
    "WSGIMiddleware",
    "ddl",
    "django_operations",
    "drop_ddl",
    "headers_for",
    "install",
    "parse_headers",
]

DIALECTS = ("mysql", "postgresql", "sqlite")
FENCE_TABLE = "orbit_fence"
OPERATION_TABLE = "orbit_fence_operation"
UINT64_MAX = 2**64 - 1
# Seconds by which the lease check refuses early: covers the skew between the Orbit server's
# clock (which set lease_expires_at) and the database's clock. Healthy workers renew when a
# third of the lease has passed, so their lease_expires_at is far ahead of any sane margin.
DEFAULT_LEASE_MARGIN = 2.0
LOCK_RETRIES = 8  # deadlock / busy answers while taking the fence lock, retried (nothing ran yet)
MAX_NAMESPACE = 64
MAX_KEY = 191  # Orbit's own limit for concurrency keys
MAX_OPERATION_ID = 191

HEADER_NAMESPACE = "Orbit-Fence-Namespace"
HEADER_KEY = "Orbit-Fence-Key"
HEADER_TOKEN = "Orbit-Fence-Token"
HEADER_OPERATION = "Orbit-Fence-Operation"
HEADER_LEASE = "Orbit-Fence-Lease-Expires-At"
HEADER_REPLAYED = "Orbit-Fence-Replayed"


# --------------------------------------------------------------------------- errors


class FenceRefused(OrbitError):
    """The guard refused a write; nothing it did in that transaction was kept."""


class StaleToken(FenceRefused):
    """``token`` is lower than the ``highest`` token this (namespace, key) has accepted."""

    def __init__(self, token: int, highest: int, namespace: str = "", key: str = "") -> None:
        self.token = token
        self.highest = highest
        self.namespace = namespace
        self.key = key
        super().__init__(
            f"stale token {token} for key {key!r} in namespace {namespace!r}: the resource has "
            f"accepted token {highest}; a newer attempt holds (or held) this key, so this write is refused"
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


# --------------------------------------------------------------------------- DDL


def _check_dialect(dialect: str) -> str:
    if dialect not in DIALECTS:
        raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}; got {dialect!r}")
    return dialect


def ddl(dialect: str) -> list[str]:
    """The statements that create the guard's two tables (idempotent: IF NOT EXISTS).

    Keys compare byte for byte, as Orbit's own keys do (no case folding, no Unicode
    normalisation): ``utf8mb4_bin`` on MySQL/MariaDB, ``COLLATE "C"`` on PostgreSQL, the
    default BINARY collation on SQLite. Tokens are uint64: ``BIGINT UNSIGNED``,
    ``numeric(20,0)``, and on SQLite (whose INTEGER is signed 64-bit) zero-padded 20-digit text.
    """
    _check_dialect(dialect)
    if dialect == "mysql":
        text = "VARCHAR({n}) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
        return [
            f"CREATE TABLE IF NOT EXISTS {FENCE_TABLE} ("
            f" namespace {text.format(n=MAX_NAMESPACE)} COMMENT 'Orbit namespace id (or any fencing scope)',"
            f" fence_key {text.format(n=MAX_KEY)} COMMENT 'Orbit concurrency key, compared byte for byte',"
            " highest_token BIGINT UNSIGNED NOT NULL COMMENT 'highest permit token accepted; only ever raised',"
            " updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),"
            " PRIMARY KEY (namespace, fence_key)"
            ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
            " COMMENT='orbit_sdk.fencing: one row per key; never delete or lower it'",
            f"CREATE TABLE IF NOT EXISTS {OPERATION_TABLE} ("
            f" namespace {text.format(n=MAX_NAMESPACE)},"
            f" fence_key {text.format(n=MAX_KEY)},"
            f" operation_id {text.format(n=MAX_OPERATION_ID)} COMMENT 'the caller''s stable operation id',"
            " token BIGINT UNSIGNED NOT NULL COMMENT 'token the operation was applied with',"
            " result LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL COMMENT 'JSON result, replayed',"
            " applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),"
            " PRIMARY KEY (namespace, fence_key, operation_id)"
            ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
            " COMMENT='orbit_sdk.fencing: operations applied, each once'",
        ]
    if dialect == "postgresql":
        token = f"numeric(20,0) NOT NULL CHECK ({{c}} >= 0 AND {{c}} <= {UINT64_MAX})"
        return [
            f"CREATE TABLE IF NOT EXISTS {FENCE_TABLE} ("
            ' namespace text COLLATE "C" NOT NULL,'
            ' fence_key text COLLATE "C" NOT NULL,'
            f" highest_token {token.format(c='highest_token')},"
            " updated_at timestamptz NOT NULL DEFAULT now(),"
            " PRIMARY KEY (namespace, fence_key))",
            f"COMMENT ON TABLE {FENCE_TABLE} IS 'orbit_sdk.fencing: one row per key; never delete or lower it'",
            f"CREATE TABLE IF NOT EXISTS {OPERATION_TABLE} ("
            ' namespace text COLLATE "C" NOT NULL,'
            ' fence_key text COLLATE "C" NOT NULL,'
            ' operation_id text COLLATE "C" NOT NULL,'
            f" token {token.format(c='token')},"
            " result text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now(),"
            " PRIMARY KEY (namespace, fence_key, operation_id))",
            f"COMMENT ON TABLE {OPERATION_TABLE} IS 'orbit_sdk.fencing: operations applied, each once'",
        ]
    return [
        # WITHOUT ROWID: the primary key is the table; TEXT compares with BINARY (byte-exact).
        f"CREATE TABLE IF NOT EXISTS {FENCE_TABLE} ("
        " namespace TEXT NOT NULL,"
        " fence_key TEXT NOT NULL,"
        " highest_token TEXT NOT NULL CHECK (length(highest_token) = 20),"
        " updated_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP,"
        " PRIMARY KEY (namespace, fence_key)) WITHOUT ROWID",
        f"CREATE TABLE IF NOT EXISTS {OPERATION_TABLE} ("
        " namespace TEXT NOT NULL,"
        " fence_key TEXT NOT NULL,"
        " operation_id TEXT NOT NULL,"
        " token TEXT NOT NULL CHECK (length(token) = 20),"
        " result TEXT NOT NULL,"
        " applied_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP,"
        " PRIMARY KEY (namespace, fence_key, operation_id)) WITHOUT ROWID",
    ]


def drop_ddl(dialect: str) -> list[str]:
    """The statements that drop the two tables (for a migration's reverse; it loses the fence)."""
    _check_dialect(dialect)
    return [f"DROP TABLE IF EXISTS {OPERATION_TABLE}", f"DROP TABLE IF EXISTS {FENCE_TABLE}"]


def install(connection: Any, dialect: str | None = None) -> None:
    """Run :func:`ddl` on a DB-API or Django connection and commit."""
    adapter = _adapter(connection, dialect)
    cursor = adapter.cursor()
    try:
        for statement in ddl(adapter.dialect):
            cursor.execute(statement)
    finally:
        cursor.close()
    adapter.commit_ddl()


def django_operations(vendor: str | None = None) -> list[Any]:
    """Migration operations that create (and, reversed, drop) the guard's tables.

    ``vendor`` given (``"mysql"``, ``"postgresql"``, ``"sqlite"``): one ``RunSQL``. ``None``: a
    ``RunPython`` that picks the DDL for the database the migration runs on. In a migration::

        operations = orbit_sdk.fencing.django_operations()
    """
    migrations = importlib.import_module("django.db.migrations")  # lazy: the SDK does not need Django

    if vendor is not None:
        return [migrations.RunSQL(sql=ddl(vendor), reverse_sql=drop_ddl(vendor))]

    def forwards(apps: Any, schema_editor: Any) -> None:
        for statement in ddl(schema_editor.connection.vendor):
            schema_editor.execute(statement, params=None)

    def backwards(apps: Any, schema_editor: Any) -> None:
        for statement in drop_ddl(schema_editor.connection.vendor):
            schema_editor.execute(statement, params=None)

    return [migrations.RunPython(forwards, backwards, elidable=False)]


# --------------------------------------------------------------------------- values


def _identifier(value: Any, what: str, limit: int) -> str:
    # Orbit's key rule for all three: MySQL's utf8mb4_bin pads trailing spaces, so a value
    # ending in whitespace would not be byte-exact there; refusing it everywhere keeps one rule.
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    if len(value) > limit:
        raise ValueError(f"{what} is {len(value)} characters, over the limit of {limit}")
    if value != value.strip() or any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in value):
        raise ValueError(f"{what} must not have leading/trailing whitespace or control characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode text: {exc}") from None
    return value


def _token(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= UINT64_MAX:
        raise ValueError(f"token must be an int from 1 to 2**64-1 (Orbit's concurrency_token); got {value!r}")
    return value


def _aware(value: datetime.datetime) -> datetime.datetime:
    if value.tzinfo is None:
        raise ValueError("lease_expires_at must be an aware datetime (Orbit's are UTC)")
    return value.astimezone(datetime.UTC)


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
) -> Generator[Any, Any, Applied]:
    where = "namespace = %s AND fence_key = %s"
    ids = (namespace, key)
    # 1. Lock (or create, then lock) the fence row. SQLite has no row locks: the guard's
    #    transaction holds the database's write lock from its first statement (BEGIN IMMEDIATE,
    #    or a write as the first statement under Django), so it starts with the insert.
    select = f"SELECT highest_token FROM {FENCE_TABLE} WHERE {where}"
    rows: list[Any] = []
    if dialect != "sqlite":
        rows = yield _Query(select + " FOR UPDATE", ids, lock_step=True)
    if not rows:
        insert = f"INSERT INTO {FENCE_TABLE} (namespace, fence_key, highest_token) VALUES (%s, %s, %s)"
        if dialect == "mysql":
            insert += " ON DUPLICATE KEY UPDATE highest_token = highest_token"
        elif dialect == "postgresql":
            insert += " ON CONFLICT (namespace, fence_key) DO NOTHING"
        else:
            insert = insert.replace("INSERT INTO", "INSERT OR IGNORE INTO", 1)
        yield _Query(insert, (*ids, _encode(dialect, 0)), lock_step=True)
        rows = yield _Query(select + ("" if dialect == "sqlite" else " FOR UPDATE"), ids, lock_step=True)
    highest = int(rows[0][0])
    record = f"SELECT token, result FROM {OPERATION_TABLE} WHERE {where} AND operation_id = %s"
    # 2. Refuse a stale token, except for the resend of an operation this token (or an older
    #    one) already applied: it changes nothing, so it answers what it recorded.
    if token < highest:
        rows = yield _Query(record, (*ids, operation_id))
        if rows and int(rows[0][0]) <= token:
            return Applied(json.loads(rows[0][1]), True, int(rows[0][0]), highest)
        raise StaleToken(token, highest, namespace, key)
    # 3. Raise the highest token (kept only if the transaction commits).
    if token > highest:
        yield _Query(f"UPDATE {FENCE_TABLE} SET highest_token = %s WHERE {where}", (_encode(dialect, token), *ids))
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


# --------------------------------------------------------------------------- connections


class _Adapter:
    """One kind of sync connection: how to open the guard's transaction on it."""

    dialect: str
    placeholder = "%s"

    def __init__(self, connection: Any, dialect: str) -> None:
        self.connection = connection
        self.dialect = dialect

    def cursor(self) -> Any:
        return self.connection.cursor()

    def commit_ddl(self) -> None:
        self.connection.commit()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[tuple[Callable[[str, tuple[Any, ...]], list[Any]], bool]]:
        """Yields (run, owned): run a statement, and whether this is the outermost transaction."""
        raise NotImplementedError

    def _runner(self, cursor: Any) -> Callable[[str, tuple[Any, ...]], list[Any]]:
        placeholder = self.placeholder

        def run(sql: str, params: tuple[Any, ...]) -> list[Any]:
            cursor.execute(sql if placeholder == "%s" else sql.replace("%s", placeholder), params)
            return list(cursor.fetchall()) if cursor.description is not None else []

        return run


class _DBAPIAdapter(_Adapter):
    """mysqlclient, PyMySQL and other %s-paramstyle DB-API drivers: the guard owns the transaction."""

    @contextlib.contextmanager
    def transaction(self) -> Iterator[tuple[Callable[[str, tuple[Any, ...]], list[Any]], bool]]:
        cursor = self.connection.cursor()
        try:
            if self.dialect == "mysql":
                # READ COMMITTED for this transaction only: no gap locks (REPEATABLE READ, the
                # server's default, deadlocks inserts of different new keys), and every plain read
                # after the fence lock sees what the previous holder committed.
                cursor.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                cursor.execute("START TRANSACTION")
            try:
                yield self._runner(cursor), True
            except BaseException:
                self.connection.rollback()
                raise
            self.connection.commit()
        finally:
            cursor.close()


class _SQLiteAdapter(_Adapter):
    """sqlite3: BEGIN IMMEDIATE takes the write lock first, so two writers never both read."""

    placeholder = "?"

    @contextlib.contextmanager
    def transaction(self) -> Iterator[tuple[Callable[[str, tuple[Any, ...]], list[Any]], bool]]:
        conn = self.connection
        if conn.in_transaction:
            raise RuntimeError(
                "the sqlite3 connection has an open transaction: commit or roll back before a guarded write "
                "(the guard's write is its own transaction)"
            )
        previous = conn.isolation_level
        conn.isolation_level = None  # the guard issues BEGIN/COMMIT itself
        cursor = conn.cursor()
        try:
            cursor.execute("BEGIN IMMEDIATE")
            try:
                yield self._runner(cursor), True
            except BaseException:
                if conn.in_transaction:
                    cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")
        finally:
            cursor.close()
            conn.isolation_level = previous


class _PsycopgAdapter(_Adapter):
    """psycopg 3: ``conn.transaction()``, a savepoint when a transaction is already open."""

    @contextlib.contextmanager
    def transaction(self) -> Iterator[tuple[Callable[[str, tuple[Any, ...]], list[Any]], bool]]:
        conn = self.connection
        status = int(conn.info.transaction_status)
        if status == 3:  # INERROR
            raise RuntimeError("the psycopg connection is in a failed transaction: roll it back first")
        owned = status == 0  # IDLE
        with conn.transaction(), conn.cursor() as cursor:
            if owned:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            yield self._runner(cursor), owned

    def commit_ddl(self) -> None:
        if not self.connection.autocommit:
            self.connection.commit()


class _DjangoAdapter(_Adapter):
    """A Django connection: ``transaction.atomic``, a savepoint inside an atomic block."""

    def cursor(self) -> Any:
        return self.connection.cursor()

    def commit_ddl(self) -> None:
        if not self.connection.in_atomic_block and not self.connection.get_autocommit():
            self.connection.commit()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[tuple[Callable[[str, tuple[Any, ...]], list[Any]], bool]]:
        transaction = importlib.import_module("django.db.transaction")  # lazy: only Django connections get here

        owned = not self.connection.in_atomic_block
        with transaction.atomic(using=self.connection.alias), self.connection.cursor() as cursor:
            yield self._runner(cursor), owned


def _is_django(connection: Any) -> bool:
    return all(hasattr(connection, name) for name in ("vendor", "alias", "in_atomic_block", "settings_dict"))


def _detect(connection: Any) -> str:
    if _is_django(connection):
        vendor = str(connection.vendor)
        return vendor
    if isinstance(connection, sqlite3.Connection):
        return "sqlite"
    module = type(connection).__module__
    if module.startswith("psycopg"):
        return "postgresql"
    if module.startswith(("MySQLdb", "pymysql")):
        return "mysql"
    raise ValueError(f"cannot tell the dialect of a {type(connection).__qualname__}: pass dialect=")


def _adapter(connection: Any, dialect: str | None) -> _Adapter:
    dialect = _check_dialect(dialect if dialect is not None else _detect(connection))
    if _is_django(connection):
        if connection.vendor != dialect:
            raise ValueError(f"the Django connection is {connection.vendor}, not {dialect}")
        return _DjangoAdapter(connection, dialect)
    if isinstance(connection, sqlite3.Connection):
        return _SQLiteAdapter(connection, dialect)
    if type(connection).__module__.startswith("psycopg"):
        if inspect.iscoroutinefunction(getattr(connection, "commit", None)):
            raise TypeError("an async psycopg connection needs fencing.AsyncGuard")
        return _PsycopgAdapter(connection, dialect)
    return _DBAPIAdapter(connection, dialect)


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
    ) -> Any:
        """Run ``fn(connection)`` in the fence's transaction and return its JSON result.

        Raises :class:`StaleToken` when ``token`` is below the highest token accepted for
        (namespace, key), and :class:`LeaseExpired` when ``lease_expires_at`` is given and has
        passed by the database's clock (less the margin), and :class:`TokenOutOfRange` when
        ``token`` is above ``max_token``. An ``operation_id`` already applied returns the recorded
        result without calling ``fn``, also when a newer holder has written since, provided
        ``token`` is the one it was applied with (or newer). Any exception rolls back
        everything: the raised token, ``fn``'s writes, the record.
        """
        return self.apply(namespace, key, token, operation_id, fn, lease_expires_at=lease_expires_at).result

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
    ) -> Applied:
        """:meth:`write`, answering an :class:`Applied` (whether it was a replay, the tokens).

        ``on_replay(recorded_result)``, when given, is called before a replay is answered, inside
        the transaction: an exception it raises rolls back (the fence keeps its highest token)
        and propagates. The middlewares use it to refuse a replay of a different request.
        """
        args = _arguments(namespace, key, token, operation_id, lease_expires_at, self.max_token)
        attempt = 0
        while True:
            steps = _protocol(self.dialect, *args, self.lease_margin)
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

    def highest(self, namespace: str, key: str) -> int:
        """The highest token accepted for (namespace, key); 0 when none was (read in its own transaction)."""
        rows = self._read(
            f"SELECT highest_token FROM {FENCE_TABLE} WHERE namespace = %s AND fence_key = %s", (namespace, key)
        )
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
        """A guard bound to a worker's execution: its namespace, key, token and (with
        ``check_lease``) its current ``lease_expires_at``, read at each write."""
        namespace, key, token = _from_execution(execution)
        return ExecutionFence(self, execution, namespace, key, token, check_lease)


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
        return self.guard.apply(self.namespace, self.key, self.token, operation_id, fn, lease_expires_at=self._lease())


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
    ) -> Any:
        applied = await self.apply(namespace, key, token, operation_id, fn, lease_expires_at=lease_expires_at)
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
    ) -> Applied:
        args = _arguments(namespace, key, token, operation_id, lease_expires_at, self.max_token)
        attempt = 0
        while True:
            steps = _protocol(self.dialect, *args, self.lease_margin)
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

    async def highest(self, namespace: str, key: str) -> int:
        async with self._transaction() as (cursor, _owned):
            await cursor.execute(
                f"SELECT highest_token FROM {FENCE_TABLE} WHERE namespace = %s AND fence_key = %s", (namespace, key)
            )
            row = await cursor.fetchone()
        return int(row[0]) if row else 0

    def for_execution(self, execution: _ExecutionLike, *, check_lease: bool = True) -> AsyncExecutionFence:
        namespace, key, token = _from_execution(execution)
        return AsyncExecutionFence(self, execution, namespace, key, token, check_lease)


@dataclasses.dataclass(frozen=True)
class AsyncExecutionFence:
    """:meth:`AsyncGuard.for_execution`: ``await write(operation_id, fn)``."""

    guard: AsyncGuard
    execution: _ExecutionLike
    namespace: str
    key: str
    token: int
    check_lease: bool

    async def write(self, operation_id: str, fn: Callable[[Any], Any]) -> Any:
        lease = self.execution.lease_expires_at if self.check_lease else None
        if self.check_lease and lease is None:
            raise ValueError("the execution has no lease_expires_at to check; use check_lease=False")
        return await self.guard.write(self.namespace, self.key, self.token, operation_id, fn, lease_expires_at=lease)


# --------------------------------------------------------------------------- HTTP


def _format_time(value: datetime.datetime) -> str:
    return _aware(value).isoformat(timespec="microseconds").replace("+00:00", "Z")


def headers_for(execution: _ExecutionLike, operation_id: str, *, include_lease: bool = True) -> dict[str, str]:
    """The fence headers for a request a handler makes to a fenced service (add to httpx)::

        httpx.post(url, json=body, headers=fencing.headers_for(execution, "update-42-op-1"))

    Namespace, key and operation id are percent-encoded UTF-8 (HTTP header values are ASCII);
    the token is decimal; the lease end (when known) is RFC 3339 UTC.
    """
    namespace, key, token = _from_execution(execution)
    _identifier(operation_id, "operation_id", MAX_OPERATION_ID)
    headers = {
        HEADER_NAMESPACE: urllib.parse.quote(namespace, safe=""),
        HEADER_KEY: urllib.parse.quote(key, safe=""),
        HEADER_TOKEN: str(token),
        HEADER_OPERATION: urllib.parse.quote(operation_id, safe=""),
    }
    if include_lease and execution.lease_expires_at is not None:
        headers[HEADER_LEASE] = _format_time(execution.lease_expires_at)
    return headers


@dataclasses.dataclass(frozen=True)
class FenceRequest:
    """The fence a request carries in its headers."""

    namespace: str
    key: str
    token: int
    operation_id: str
    lease_expires_at: datetime.datetime | None


def parse_headers(get: Callable[[str], str | None]) -> FenceRequest | None:
    """Read the fence headers through ``get(name)``; None when the request carries none of them.

    Raises ValueError for a partial or malformed set (the middlewares answer it 400).
    """
    values = {name: get(name) for name in (HEADER_NAMESPACE, HEADER_KEY, HEADER_TOKEN, HEADER_OPERATION)}
    lease_text = get(HEADER_LEASE)
    if all(value is None for value in values.values()) and lease_text is None:
        return None
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise ValueError(f"missing fence header(s): {', '.join(missing)}")

    def text(name: str, limit: int) -> str:
        raw = values[name]
        assert raw is not None
        try:
            decoded = urllib.parse.unquote(raw, errors="strict")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not percent-encoded UTF-8") from None
        return _identifier(decoded, name, limit)

    token_text = values[HEADER_TOKEN]
    assert token_text is not None
    if not token_text.isascii() or not token_text.isdigit() or token_text != str(int(token_text)):
        raise ValueError(f"{HEADER_TOKEN} must be a canonical decimal uint64")
    lease: datetime.datetime | None = None
    if lease_text is not None:
        try:
            lease = _aware(datetime.datetime.fromisoformat(lease_text))
        except ValueError:
            raise ValueError(f"{HEADER_LEASE} must be an RFC 3339 time with an offset") from None
    return FenceRequest(
        namespace=text(HEADER_NAMESPACE, MAX_NAMESPACE),
        key=text(HEADER_KEY, MAX_KEY),
        token=_token(int(token_text)),
        operation_id=text(HEADER_OPERATION, MAX_OPERATION_ID),
        lease_expires_at=lease,
    )


@dataclasses.dataclass(frozen=True)
class FenceContext:
    """What a fenced handler finds in ``environ["orbit.fence"]`` / ``scope["orbit.fence"]``: the
    connection to write with (inside the guard's transaction) and the request's fence."""

    connection: Any
    request: FenceRequest


class _NotRecorded(Exception):
    """The handler answered an error status: roll back, send its answer, record nothing."""

    def __init__(self, response: dict[str, Any]) -> None:
        super().__init__(response.get("status"))
        self.response = response


# The only response headers recorded and replayed (compared lower-case): what a client needs to
# read the body and follow a 201's or 3xx's Location. Everything else (Set-Cookie, caching,
# authentication challenges, CORS) belongs to the first caller's response alone: recording it
# would keep a session in the operation table and hand it to whoever replays.
REPLAYED_HEADERS = ("content-type", "location")


def _refusal(exc: FenceRefused | ValueError) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, StaleToken):
        # uint64 tokens as decimal strings, as everywhere in Orbit's API.
        error = {"code": "STALE_TOKEN", "message": str(exc), "token": str(exc.token), "highest": str(exc.highest)}
        return 409, {"error": error}
    if isinstance(exc, LeaseExpired):
        error = {"code": "LEASE_EXPIRED", "message": str(exc), "lease_expires_at": _format_time(exc.lease_expires_at)}
        return 409, {"error": error}
    if isinstance(exc, OperationMismatch):
        error = {"code": "OPERATION_MISMATCH", "message": str(exc), "operation_id": exc.operation_id}
        return 409, {"error": error}
    if isinstance(exc, TokenOutOfRange):
        return 400, {"error": {"code": "INVALID_ARGUMENT", "message": f"{HEADER_TOKEN}: {exc}"}}
    return 400, {"error": {"code": "INVALID_ARGUMENT", "message": str(exc)}}


def _unauthenticated() -> tuple[int, dict[str, Any]]:
    message = "authentication required: the fence answers (and replays) only requests the service has authenticated"
    return 401, {"error": {"code": "UNAUTHENTICATED", "message": message}}


def _request_digest(method: str, path: str, query: bytes, body: bytes) -> str:
    """SHA-256 over method, path, query string and the body's SHA-256, each length-prefixed so
    no two different requests run together into the same bytes."""
    digest = hashlib.sha256(b"orbit-fence-request/1")
    # surrogatepass: any str a server hands over encodes, and the same str always the same way.
    for part in (method.encode("utf-8", "surrogatepass"), path.encode("utf-8", "surrogatepass"), query):
        digest.update(len(part).to_bytes(8, "big") + part)
    digest.update(hashlib.sha256(body).digest())
    return digest.hexdigest()


def _bound_to(request_digest: str, operation_id: str) -> Callable[[Any], None]:
    """The guard's ``on_replay`` for a middleware: a record answers only the request it recorded.
    A record without a digest (written before replays were bound) matches nothing."""

    def check(recorded: Any) -> None:
        if not isinstance(recorded, Mapping) or recorded.get("request") != request_digest:
            raise OperationMismatch(operation_id)

    return check


def _replayable(headers: Iterable[Iterable[str]]) -> list[list[str]]:
    return [[str(name), str(value)] for name, value in headers if str(name).lower() in REPLAYED_HEADERS]


def _recorded_response(
    status: int, reason: str, headers: list[tuple[str, str]], body: bytes, request_digest: str
) -> dict[str, Any]:
    return {
        "status": status,
        "reason": reason,
        "headers": _replayable(headers),
        "body": base64.b64encode(body).decode("ascii"),
        "request": request_digest,
    }


_REASONS = {400: "Bad Request", 401: "Unauthorized", 409: "Conflict"}


def _wsgi_body(environ: Mapping[str, Any]) -> bytes:
    """The request body, read whole: its digest binds the operation before the app runs."""
    stream = environ.get("wsgi.input")
    length_text = str(environ.get("CONTENT_LENGTH") or "").strip()
    if stream is None:
        return b""
    if not length_text:
        return bytes(stream.read()) if environ.get("wsgi.input_terminated") else b""
    if not length_text.isascii() or not length_text.isdigit():
        raise ValueError(f"Content-Length must be a non-negative decimal integer; got {length_text!r}")
    return bytes(stream.read(int(length_text)))


class WSGIMiddleware:
    """Runs a WSGI app inside the fence named by the request's headers.

    ``open_guard()`` returns a context manager giving a :class:`Guard` on a connection of its
    own for this request (a pool checkout, say). The handler finds a :class:`FenceContext` in
    ``environ["orbit.fence"]`` and writes with its ``connection``. Its response is buffered and
    sent after the commit; a 2xx/3xx one is recorded and replayed for the same operation id
    (with ``Orbit-Fence-Replayed: true``); a 4xx/5xx one rolls everything back and is sent as is.
    A stale token → 409 ``STALE_TOKEN``; a passed lease (header given, ``check_lease``) → 409
    ``LEASE_EXPIRED``; bad or partial headers → 400. Without fence headers: 400 when
    ``require`` (the default), else the app runs unfenced.

    A record answers only the request it recorded: the same method, path, query string and
    body (SHA-256); any other request with that operation id → 409 ``OPERATION_MISMATCH``. A
    replay carries the recorded status, body and :data:`REPLAYED_HEADERS` only (never
    ``Set-Cookie``).

    Order: authentication, then the fence. Either the middleware sits inside the app's
    authentication (it wraps only the authenticated view layer), or ``authenticate(environ)``
    says whether the request is authenticated: a fenced request it refuses is answered 401
    ``UNAUTHENTICATED`` before any header is judged, any record read or the app run.
    """

    def __init__(
        self,
        app: Callable[..., Iterable[bytes]],
        open_guard: Callable[[], contextlib.AbstractContextManager[Guard]],
        *,
        require: bool = True,
        check_lease: bool = True,
        authenticate: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self.app = app
        self.open_guard = open_guard
        self.require = require
        self.check_lease = check_lease
        self.authenticate = authenticate

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        invalid: ValueError | None = None
        fence: FenceRequest | None = None
        try:
            fence = parse_headers(lambda name: environ.get("HTTP_" + name.upper().replace("-", "_")))
            if fence is None and self.require:
                raise ValueError("this endpoint is fenced: send the Orbit-Fence-* headers")
        except ValueError as exc:
            invalid = exc
        if fence is None and invalid is None:
            return self.app(environ, start_response)
        if self.authenticate is not None and not self.authenticate(environ):
            return self._send(start_response, *_json(*_unauthenticated()))
        try:
            if invalid is not None:
                raise invalid
            body = _wsgi_body(environ)
        except ValueError as exc:
            return self._send(start_response, *_json(*_refusal(exc)))
        assert fence is not None
        environ["wsgi.input"] = io.BytesIO(body)  # the app reads the body the digest was taken of
        environ["CONTENT_LENGTH"] = str(len(body))
        path = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))
        query = str(environ.get("QUERY_STRING", "")).encode("utf-8", "surrogatepass")
        digest = _request_digest(str(environ.get("REQUEST_METHOD", "")), path, query, body)
        sent: dict[str, Any] = {}

        def handle(connection: Any) -> dict[str, Any]:
            environ["orbit.fence"] = FenceContext(connection, fence)
            captured: dict[str, Any] = {}

            def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
                captured["status"], captured["headers"] = status, headers
                return lambda data: captured.setdefault("written", []).append(data)

            body_iter = self.app(environ, capture)
            try:
                body = b"".join([*captured.get("written", []), *body_iter])
            finally:
                close = getattr(body_iter, "close", None)
                if close is not None:
                    close()
            code_text, _, reason = str(captured["status"]).partition(" ")
            headers = [(str(name), str(value)) for name, value in captured["headers"]]
            sent.update(status=int(code_text), reason=reason, headers=headers, body=body)
            if sent["status"] >= 400:
                raise _NotRecorded(sent)
            return _recorded_response(int(code_text), reason, headers, body, digest)

        try:
            with self.open_guard() as guard:
                lease = fence.lease_expires_at if self.check_lease else None
                applied = guard.apply(
                    fence.namespace,
                    fence.key,
                    fence.token,
                    fence.operation_id,
                    handle,
                    lease_expires_at=lease,
                    on_replay=_bound_to(digest, fence.operation_id),
                )
        except FenceRefused as exc:
            return self._send(start_response, *_json(*_refusal(exc)))
        except _NotRecorded:
            return self._send(start_response, sent["status"], sent["reason"], sent["headers"], sent["body"])
        if not applied.replayed:  # the caller who ran the app gets its whole response
            return self._send(start_response, sent["status"], sent["reason"], sent["headers"], sent["body"])
        return self._send(start_response, *_replay(applied.result))

    @staticmethod
    def _send(
        start_response: Callable[..., Any], status: int, reason: str, headers: list[tuple[str, str]], body: bytes
    ) -> list[bytes]:
        start_response(f"{status} {reason}", headers)
        return [body]


def _json(status: int, document: dict[str, Any]) -> tuple[int, str, list[tuple[str, str]], bytes]:
    body = json.dumps(document).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    return status, _REASONS.get(status, ""), headers, body


def _replay(response: Mapping[str, Any]) -> tuple[int, str, list[tuple[str, str]], bytes]:
    """A recorded response as replayed: status, body and the allow-listed headers (filtered
    again, for records written before the allow-list), its length and the replay mark."""
    body = base64.b64decode(response["body"])
    headers = [(name, value) for name, value in _replayable(response["headers"])]
    headers += [("Content-Length", str(len(body))), (HEADER_REPLAYED, "true")]
    return int(response["status"]), str(response["reason"]), headers, body


async def _asgi_body(receive: Callable[[], Awaitable[Any]]) -> bytes | None:
    """The request body, read whole (its digest binds the operation); None if the client left."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        if message["type"] == "http.request":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                return b"".join(chunks)


class ASGIMiddleware:
    """Runs an ASGI app's HTTP requests inside the fence named by their headers.

    As :class:`WSGIMiddleware`, with ``open_guard()`` an async context manager giving an
    :class:`AsyncGuard` (psycopg 3 ``AsyncConnection``) for this request, the
    :class:`FenceContext` in ``scope["orbit.fence"]``, and ``authenticate(scope)`` returning a
    bool or an awaitable of one. Other scope types (lifespan, websocket) pass through.
    """

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        open_guard: Callable[[], contextlib.AbstractAsyncContextManager[AsyncGuard]],
        *,
        require: bool = True,
        check_lease: bool = True,
        authenticate: Callable[[dict[str, Any]], bool | Awaitable[bool]] | None = None,
    ) -> None:
        self.app = app
        self.open_guard = open_guard
        self.require = require
        self.check_lease = check_lease
        self.authenticate = authenticate

    async def _authenticated(self, scope: dict[str, Any]) -> bool:
        if self.authenticate is None:
            return True
        verdict = self.authenticate(scope)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        return bool(verdict)

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        raw = {
            bytes(name).decode("latin-1").lower(): bytes(value).decode("latin-1")
            for name, value in scope.get("headers", [])
        }
        invalid: ValueError | None = None
        fence: FenceRequest | None = None
        try:
            fence = parse_headers(lambda name: raw.get(name.lower()))
            if fence is None and self.require:
                raise ValueError("this endpoint is fenced: send the Orbit-Fence-* headers")
        except ValueError as exc:
            invalid = exc
        if fence is None and invalid is None:
            await self.app(scope, receive, send)
            return
        if not await self._authenticated(scope):
            await _asgi_send(send, *_json(*_unauthenticated()))
            return
        if invalid is not None:
            await _asgi_send(send, *_json(*_refusal(invalid)))
            return
        assert fence is not None
        body = await _asgi_body(receive)
        if body is None:
            return  # the client is gone: nothing to answer, nothing run
        path = str(scope.get("root_path", "")) + str(scope.get("path", ""))
        digest = _request_digest(str(scope.get("method", "")), path, bytes(scope.get("query_string", b"")), body)
        delivered = False

        async def receive_buffered() -> Any:
            nonlocal delivered
            if not delivered:  # the app reads the body the digest was taken of
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        sent: dict[str, Any] = {}

        async def handle(connection: Any) -> dict[str, Any]:
            start: dict[str, Any] = {}
            chunks: list[bytes] = []

            async def capture(message: Any) -> None:
                if message["type"] == "http.response.start":
                    start.update(message)
                elif message["type"] == "http.response.body":
                    chunks.append(bytes(message.get("body", b"")))

            await self.app({**scope, "orbit.fence": FenceContext(connection, fence)}, receive_buffered, capture)
            headers = [(bytes(n).decode("latin-1"), bytes(v).decode("latin-1")) for n, v in start.get("headers", [])]
            sent.update(status=int(start["status"]), reason="", headers=headers, body=b"".join(chunks))
            if sent["status"] >= 400:
                raise _NotRecorded(sent)
            return _recorded_response(sent["status"], "", headers, sent["body"], digest)

        try:
            async with self.open_guard() as guard:
                lease = fence.lease_expires_at if self.check_lease else None
                applied = await guard.apply(
                    fence.namespace,
                    fence.key,
                    fence.token,
                    fence.operation_id,
                    handle,
                    lease_expires_at=lease,
                    on_replay=_bound_to(digest, fence.operation_id),
                )
        except FenceRefused as exc:
            await _asgi_send(send, *_json(*_refusal(exc)))
            return
        except _NotRecorded:
            await _asgi_send(send, sent["status"], "", sent["headers"], sent["body"])
            return
        if not applied.replayed:
            await _asgi_send(send, sent["status"], "", sent["headers"], sent["body"])
            return
        await _asgi_send(send, *_replay(applied.result))


async def _asgi_send(
    send: Callable[[Any], Awaitable[None]], status: int, reason: str, headers: list[tuple[str, str]], body: bytes
) -> None:
    encoded = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
    await send({"type": "http.response.start", "status": status, "headers": encoded})
    await send({"type": "http.response.body", "body": body})
