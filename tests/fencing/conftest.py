"""Fixtures of the fencing tests: a fresh database per test on each of the three dialects."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orbit_sdk import fencing
from tests.fencing.dbs import DB, server_database


@pytest.fixture(params=["mysql", "postgresql", "sqlite"])
def fence_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DB]:
    """An empty database with the guard's tables and a `ledger` table for the tests' writes."""
    with server_database(request.param, str(tmp_path_factory.mktemp("fence"))) as database:
        conn = database.connect()
        try:
            fencing.install(conn)
            cursor = conn.cursor()
            cursor.execute(database.ledger_ddl())
            cursor.close()
            conn.commit()
        finally:
            conn.close()
        yield database
