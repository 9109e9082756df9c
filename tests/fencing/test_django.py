"""The guard on a Django connection (the test database: MariaDB, or SQLite with
ORBIT_TEST_SQLITE=1), its migration helper, and the atomic rules documented in docs/fencing.md."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.migrations.state import ProjectState

from orbit_sdk import fencing

pytestmark = pytest.mark.django_db(transaction=True)

NS = "fedcba9876543210fedcba9876543210"


@pytest.fixture
def tables() -> Iterator[None]:
    """The guard's tables made by the migration helper (and dropped by its reverse)."""
    (operation,) = fencing.django_operations()
    state = ProjectState()
    with connection.schema_editor() as editor:
        operation.database_forwards("app", editor, state, state)
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE fence_django_ledger (op VARCHAR(64) NOT NULL)")
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE fence_django_ledger")
    with connection.schema_editor() as editor:
        operation.database_backwards("app", editor, state, state)


def note(op: str) -> Any:
    def fn(conn: Any) -> Any:
        with conn.cursor() as cursor:
            cursor.execute("INSERT INTO fence_django_ledger (op) VALUES (%s)", [op])
        return {"op": op}

    return fn


def ops() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT op FROM fence_django_ledger ORDER BY op")
        return [row[0] for row in cursor.fetchall()]


def test_outside_atomic_the_write_is_its_own_transaction(tables: None) -> None:
    guard = fencing.Guard(connection)  # the dialect is the connection's vendor
    assert guard.dialect == connection.vendor
    assert guard.write(NS, "k", 2, "a", note("a")) == {"op": "a"}
    assert guard.apply(NS, "k", 2, "a", note("a-again")).replayed
    with pytest.raises(fencing.StaleToken):
        guard.write(NS, "k", 1, "b", note("b"))
    assert ops() == ["a"] and guard.highest(NS, "k") == 2
    assert connection.get_autocommit() and not connection.in_atomic_block


def test_inside_atomic_the_write_is_a_savepoint_of_the_outer_transaction(tables: None) -> None:
    guard = fencing.Guard(connection)
    with pytest.raises(RuntimeError), transaction.atomic():
        guard.write(NS, "k", 3, "rolled-back", note("rolled-back"))
        raise RuntimeError("the outer block fails after the guarded write")
    assert ops() == [] and guard.highest(NS, "k") == 0  # the outer rollback took the write with it

    with transaction.atomic():
        guard.write(NS, "k", 5, "kept", note("kept"))
        with pytest.raises(fencing.StaleToken):  # a refusal rolls back its savepoint only
            guard.write(NS, "k", 4, "stale", note("stale"))
        note("outer")(connection)  # the outer transaction is still usable
    assert ops() == ["kept", "outer"] and guard.highest(NS, "k") == 5


def test_django_operations_for_a_named_vendor_is_one_runsql() -> None:
    from django.db import migrations

    (operation,) = fencing.django_operations("postgresql")
    assert isinstance(operation, migrations.RunSQL)
    assert operation.sql == fencing.ddl("postgresql") and operation.reverse_sql == fencing.drop_ddl("postgresql")
