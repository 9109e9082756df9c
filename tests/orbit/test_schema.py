"""Schema rules of SPEC §1, read back from MySQL's information_schema."""

from __future__ import annotations

import pytest
from django.db import connection

from queues.models import Queue, QueueState
from tests.support.queues import create_queue

pytestmark = pytest.mark.mysql_only

BINARY_COLUMNS = [
    ("orbit_queue", "name"),
    ("orbit_task", "concurrency_key"),
    ("orbit_idempotency_record", "key"),
    ("orbit_concurrency_key", "key"),
]


def fetch(sql: str, *params: object) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())


def orbit_tables() -> list[str]:
    rows = fetch(
        "SELECT TABLE_NAME FROM information_schema.TABLES "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'orbit\\_%%' ORDER BY TABLE_NAME"
    )
    return [name for (name,) in rows]


def test_schema_queries_run_against_the_test_database(db):
    (name,) = fetch("SELECT DATABASE()")[0]
    assert name == connection.settings_dict["NAME"] and name.startswith("test_")
    assert {"orbit_queue", "orbit_queue_state", "orbit_idempotency_record", "orbit_credential"} <= set(orbit_tables())


def test_no_foreign_key_constraints_anywhere(db):
    # Django's contrib tables included: the whole database has none.
    constraints = fetch(
        "SELECT CONSTRAINT_NAME, TABLE_NAME, REFERENCED_TABLE_NAME FROM information_schema.REFERENTIAL_CONSTRAINTS "
        "WHERE CONSTRAINT_SCHEMA = DATABASE()"
    )
    assert constraints == []
    foreign_keys = fetch(
        "SELECT CONSTRAINT_NAME, TABLE_NAME FROM information_schema.TABLE_CONSTRAINTS "
        "WHERE CONSTRAINT_SCHEMA = DATABASE() AND CONSTRAINT_TYPE = 'FOREIGN KEY'"
    )
    assert foreign_keys == []


def test_every_orbit_table_has_a_comment(db):
    rows = fetch(
        "SELECT TABLE_NAME, TABLE_COMMENT FROM information_schema.TABLES "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'orbit\\_%%'"
    )
    assert rows
    missing = [name for name, comment in rows if not (comment or "").strip()]
    assert missing == []


def test_every_orbit_column_has_a_comment(db):
    rows = fetch(
        "SELECT TABLE_NAME, COLUMN_NAME, COLUMN_COMMENT FROM information_schema.COLUMNS "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'orbit\\_%%'"
    )
    assert len(rows) > 50
    missing = [f"{table}.{column}" for table, column, comment in rows if not (comment or "").strip()]
    assert missing == []


@pytest.mark.parametrize(("table", "column"), BINARY_COLUMNS)
def test_names_and_keys_compare_byte_for_byte(db, table, column):
    rows = fetch(
        "SELECT CHARACTER_SET_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND COLUMN_NAME = %s",
        table,
        column,
    )
    # NO PAD binary: utf8mb4_bin would also fold trailing spaces ("k" = "k ").
    expected = "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
    assert rows == [("utf8mb4", expected)]


@pytest.mark.parametrize(("table", "column"), [("orbit_queue", "revision"), ("orbit_queue_state", "unfinished_tasks")])
def test_uint64_columns_are_bigint_unsigned(db, table, column):
    rows = fetch(
        "SELECT COLUMN_TYPE FROM information_schema.COLUMNS "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND COLUMN_NAME = %s",
        table,
        column,
    )
    assert rows == [("bigint(20) unsigned",)]


def test_the_database_default_collation_would_fold_case(db):
    # The premise of the byte-exact columns: the default collation folds.
    (folded,) = fetch("SELECT _utf8mb4'Images' = _utf8mb4'images' COLLATE utf8mb4_unicode_ci")[0]
    assert folded == 1


def test_the_binary_collation_does_not_pad_trailing_spaces(db):
    (collation,) = fetch(
        "SELECT COLLATION_NAME FROM information_schema.COLUMNS "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'orbit_idempotency_record' AND COLUMN_NAME = 'key'"
    )[0]
    (padded, case_folded) = fetch(
        f"SELECT _utf8mb4'k' = _utf8mb4'k ' COLLATE {collation}, _utf8mb4'k' = _utf8mb4'K' COLLATE {collation}"
    )[0]
    assert (padded, case_folded) == (0, 0)


def test_names_differing_only_in_case_are_two_queues(tenant):
    upper = create_queue(tenant.client, "Images", key="queue-upper")
    lower = create_queue(tenant.client, "images", key="queue-lower")
    assert upper["id"] != lower["id"]
    assert Queue.objects.get(namespace_id=tenant.namespace_id, name="Images").id == upper["id"]
    assert Queue.objects.get(namespace_id=tenant.namespace_id, name="images").id == lower["id"]


def test_uint64_counters_hold_the_full_range(tenant):
    queue = create_queue(tenant.client, "images")
    QueueState.objects.filter(queue_id=queue["id"]).update(unfinished_tasks=2**64 - 1)
    assert QueueState.objects.get(queue_id=queue["id"]).unfinished_tasks == 2**64 - 1
