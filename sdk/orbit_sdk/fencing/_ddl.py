"""The guard's tables: their DDL per dialect, installing them on a connection, and the
Django migration operations. Knows nothing of the guard's protocol.

Three tables: the key's fence rows, the operations, and (since keys have capacities) the
fence rows of (key, slot). A guard installed before the third runs :func:`slot_ddl` (or
:func:`install` again, or a migration of :func:`django_slot_operations`): it only creates the
new table, and the existing two and their rows are left as they are."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from orbit_sdk.fencing._adapters import _adapter
from orbit_sdk.fencing._values import (
    FENCE_SLOT_TABLE,
    FENCE_TABLE,
    MAX_KEY,
    MAX_NAMESPACE,
    MAX_OPERATION_ID,
    OPERATION_TABLE,
    UINT64_MAX,
    _check_dialect,
)


def ddl(dialect: str) -> list[str]:
    """The statements that create the guard's tables (idempotent: IF NOT EXISTS), the slot
    table's (:func:`slot_ddl`) last.

    Keys compare byte for byte, as Orbit's own keys do (no case folding, no Unicode
    normalisation): ``utf8mb4_bin`` on MySQL/MariaDB, ``COLLATE "C"`` on PostgreSQL, the
    default BINARY collation on SQLite. Tokens are uint64: ``BIGINT UNSIGNED``,
    ``numeric(20,0)``, and on SQLite (whose INTEGER is signed 64-bit) zero-padded 20-digit text.
    """
    return _key_ddl(_check_dialect(dialect)) + slot_ddl(dialect)


def slot_ddl(dialect: str) -> list[str]:
    """The statements that create the fence rows of (key, slot) (idempotent), for
    ``Guard.write(..., slot=...)``: the upgrade of a guard installed before slots."""
    _check_dialect(dialect)
    if dialect == "mysql":
        text = "VARCHAR({n}) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
        return [
            f"CREATE TABLE IF NOT EXISTS {FENCE_SLOT_TABLE} ("
            f" namespace {text.format(n=MAX_NAMESPACE)} COMMENT 'Orbit namespace id (or any fencing scope)',"
            f" fence_key {text.format(n=MAX_KEY)} COMMENT 'Orbit concurrency key, compared byte for byte',"
            " slot INT UNSIGNED NOT NULL COMMENT 'Orbit concurrency_slot of the key',"
            " highest_token BIGINT UNSIGNED NOT NULL COMMENT 'highest permit token accepted; only ever raised',"
            " updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),"
            " PRIMARY KEY (namespace, fence_key, slot)"
            ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
            " COMMENT='orbit_sdk.fencing: one row per key and slot; never delete or lower it'",
        ]
    if dialect == "postgresql":
        return [
            f"CREATE TABLE IF NOT EXISTS {FENCE_SLOT_TABLE} ("
            ' namespace text COLLATE "C" NOT NULL,'
            ' fence_key text COLLATE "C" NOT NULL,'
            " slot integer NOT NULL CHECK (slot >= 0),"
            f" highest_token numeric(20,0) NOT NULL CHECK (highest_token >= 0 AND highest_token <= {UINT64_MAX}),"
            " updated_at timestamptz NOT NULL DEFAULT now(),"
            " PRIMARY KEY (namespace, fence_key, slot))",
            f"COMMENT ON TABLE {FENCE_SLOT_TABLE}"
            " IS 'orbit_sdk.fencing: one row per key and slot; never delete or lower it'",
        ]
    return [
        f"CREATE TABLE IF NOT EXISTS {FENCE_SLOT_TABLE} ("
        " namespace TEXT NOT NULL,"
        " fence_key TEXT NOT NULL,"
        " slot INTEGER NOT NULL CHECK (slot >= 0),"
        " highest_token TEXT NOT NULL CHECK (length(highest_token) = 20),"
        " updated_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP,"
        " PRIMARY KEY (namespace, fence_key, slot)) WITHOUT ROWID",
    ]


def _key_ddl(dialect: str) -> list[str]:
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
    """The statements that drop the tables (for a migration's reverse; it loses the fence)."""
    return slot_drop_ddl(dialect) + [f"DROP TABLE IF EXISTS {OPERATION_TABLE}", f"DROP TABLE IF EXISTS {FENCE_TABLE}"]


def slot_drop_ddl(dialect: str) -> list[str]:
    """The reverse of :func:`slot_ddl` alone."""
    _check_dialect(dialect)
    return [f"DROP TABLE IF EXISTS {FENCE_SLOT_TABLE}"]


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

    A project whose migration already made the first two tables adds a new migration of
    :func:`django_slot_operations` instead (its own earlier migration keeps doing what it did).
    """
    return _operations(vendor, ddl, drop_ddl)


def django_slot_operations(vendor: str | None = None) -> list[Any]:
    """:func:`django_operations` for the slot table alone: the upgrade of a project that
    installed the guard before slots."""
    return _operations(vendor, slot_ddl, slot_drop_ddl)


def _operations(vendor: str | None, create: Callable[[str], list[str]], drop: Callable[[str], list[str]]) -> list[Any]:
    migrations = importlib.import_module("django.db.migrations")  # lazy: the SDK does not need Django

    if vendor is not None:
        return [migrations.RunSQL(sql=create(vendor), reverse_sql=drop(vendor))]

    def forwards(apps: Any, schema_editor: Any) -> None:
        for statement in create(schema_editor.connection.vendor):
            schema_editor.execute(statement, params=None)

    def backwards(apps: Any, schema_editor: Any) -> None:
        for statement in drop(schema_editor.connection.vendor):
            schema_editor.execute(statement, params=None)

    return [migrations.RunPython(forwards, backwards, elidable=False)]
