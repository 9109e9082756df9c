"""The three databases the fencing tests run on, described so a child process can connect.

MariaDB (127.0.0.1:3306, root, no password) and PostgreSQL (127.0.0.1:5432, postgres, trust)
are the machine's services; each test module makes its own database and drops it. SQLite is
a file in the test's temporary directory.
"""

from __future__ import annotations

import dataclasses
import secrets
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository: children run from here

MYSQL = {"host": "127.0.0.1", "port": 3306, "user": "root", "password": ""}
POSTGRES = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}


@dataclasses.dataclass(frozen=True)
class DB:
    dialect: str  # mysql | postgresql | sqlite
    name: str  # the database (a file path for SQLite)

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    def connect(self, driver: str | None = None) -> Any:
        """A new connection; `driver` picks mysqlclient or pymysql for MySQL (default: mysqlclient)."""
        if self.dialect == "sqlite":
            return sqlite3.connect(self.name, timeout=30)
        if self.dialect == "postgresql":
            import psycopg

            return psycopg.connect(dbname=self.name, **POSTGRES)
        if driver == "pymysql":
            import pymysql

            return pymysql.connect(database=self.name, charset="utf8mb4", **MYSQL)
        import MySQLdb

        return MySQLdb.connect(database=self.name, charset="utf8mb4", **MYSQL)

    def ledger_ddl(self) -> str:
        """A user table the tests' writes go to: the order of its ids is the order writes landed."""
        key = {"mysql": "VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin", "postgresql": 'text COLLATE "C"'}
        ident = {
            "mysql": "BIGINT AUTO_INCREMENT PRIMARY KEY",
            "postgresql": "bigserial PRIMARY KEY",
            "sqlite": "INTEGER PRIMARY KEY AUTOINCREMENT",
        }
        return (
            f"CREATE TABLE ledger (id {ident[self.dialect]}, fence_key {key.get(self.dialect, 'TEXT')} NOT NULL,"
            " token BIGINT NOT NULL, operation_id VARCHAR(191) NOT NULL, writer INT NOT NULL)"
        )

    def placeholder(self) -> str:
        return "?" if self.dialect == "sqlite" else "%s"


@contextmanager
def server_database(dialect: str, tmp_dir: str) -> Iterator[DB]:
    """A fresh, empty database on `dialect`'s server, dropped afterwards."""
    name = f"orbit_fence_{secrets.token_hex(4)}"
    if dialect == "sqlite":
        yield DB("sqlite", f"{tmp_dir}/{name}.sqlite3")
        return
    if dialect == "mysql":
        import MySQLdb

        admin = MySQLdb.connect(charset="utf8mb4", **MYSQL)
        admin.cursor().execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        try:
            yield DB("mysql", name)
        finally:
            admin.cursor().execute(f"DROP DATABASE IF EXISTS {name}")
            admin.close()
        return
    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, **POSTGRES) as admin:
        admin.execute(f"CREATE DATABASE {name}")
        try:
            yield DB("postgresql", name)
        finally:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
