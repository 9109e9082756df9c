"""Shared by the product tests: databases that are not ready, in every way."""

from __future__ import annotations

import socket
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from server.probes import database_settings, open_connection


def mysql_settings(port: int) -> dict[str, Any]:
    """A MySQL database on 127.0.0.1:`port`: whatever the suite's own vendor."""
    return {
        "ENGINE": "orbit.db.mysql",
        "NAME": "orbit",
        "USER": "root",
        "PASSWORD": "",
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "OPTIONS": {"charset": "utf8mb4"},
        "CONN_MAX_AGE": 0,
        "CONN_HEALTH_CHECKS": False,
        "AUTOCOMMIT": True,
        "ATOMIC_REQUESTS": False,
        "TIME_ZONE": None,
        "TEST": {},
    }


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def frozen_server() -> Iterator[int]:
    """A port whose server accepts connections (the kernel completes the
    handshake into the backlog) and never says a word: a frozen mysqld."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def empty_database(django_db_setup: None, django_db_blocker: Any, tmp_path_factory: Any) -> Iterator[dict[str, Any]]:
    """A reachable database with no migration applied, beside the test database."""
    with django_db_blocker.unblock():
        base = database_settings()
        if connection.vendor == "sqlite":
            path = tmp_path_factory.mktemp("empty") / "empty.sqlite3"
            sqlite3.connect(path).close()
            yield {**base, "NAME": str(path)}
            return
        name = f"{base['NAME']}_empty"
        admin = open_connection(base, 5)
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE IF NOT EXISTS `{name}`")
        try:
            yield {**base, "NAME": name}
        finally:
            with admin.cursor() as cursor:
                cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
            admin.close()
