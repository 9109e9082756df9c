"""Connections: which driver (or Django) a connection belongs to, and how to open the guard's
transaction on it. No driver and no Django import: the drivers are the user's."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

from orbit_sdk.fencing._values import _check_dialect

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
