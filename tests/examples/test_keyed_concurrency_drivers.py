"""examples/keyed_concurrency.py fences its MariaDB resource with either MySQL driver, as its
docstring says: mysqlclient when it is installed, else PyMySQL (or the one
ORBIT_FENCE_MYSQL_DRIVER names), the guard telling the dialect from the connection."""

from __future__ import annotations

import pytest

from tests.fencing.dbs import MYSQL, server_database
from tests.support.examples import run_example

pytestmark = pytest.mark.django_db(transaction=True)

SEED_LINES = [
    "queues=2 completed=2 tokens_increasing=true",
    "resource_writes=2 stale_write_rejected=true worker_drained=true",
]


def fenced_writes(name: str) -> list[tuple[str, int]]:
    """The resource rows the example wrote (operation, token), in token order."""
    import pymysql

    conn = pymysql.connect(database=name, charset="utf8mb4", **MYSQL)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT operation_ref, token FROM example_object_write ORDER BY token")
            return [(str(ref), int(token)) for ref, token in cursor.fetchall()]
    finally:
        conn.close()


def dsn(name: str) -> str:
    return f"mysql://{MYSQL['user']}:{MYSQL['password']}@{MYSQL['host']}:{MYSQL['port']}/{name}"


def test_without_mysqlclient_the_example_fences_mariadb_through_pymysql(orbit_server, tmp_path):
    pytest.importorskip("pymysql")
    # given a Python where `import MySQLdb` fails, as where only PyMySQL is installed
    shadow = tmp_path / "no-mysqlclient" / "MySQLdb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("mysqlclient is not installed here")\n')
    with server_database("mysql", str(tmp_path)) as db:
        # when the example runs against a MariaDB resource
        result = run_example(
            "keyed_concurrency.py",
            orbit_server,
            tmp_path,
            ORBIT_FENCE_MYSQL_DSN=dsn(db.name),
            PYTHONPATH=str(shadow.parent),
        )
        # then it prints the seed lines, and its two writes landed in MariaDB with increasing tokens
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.splitlines() == SEED_LINES
        writes = fenced_writes(db.name)
    assert sorted(ref for ref, _ in writes) == ["update-1", "update-2"]
    assert writes[0][1] < writes[1][1]


@pytest.mark.parametrize("driver", ["pymysql", "MySQLdb"])
def test_the_driver_named_in_the_environment_is_the_one_used(orbit_server, tmp_path, driver):
    pytest.importorskip(driver)
    with server_database("mysql", str(tmp_path)) as db:
        result = run_example(
            "keyed_concurrency.py",
            orbit_server,
            tmp_path,
            ORBIT_FENCE_MYSQL_DSN=dsn(db.name),
            ORBIT_FENCE_MYSQL_DRIVER=driver,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.splitlines() == SEED_LINES
        assert len(fenced_writes(db.name)) == 2


def test_an_unknown_driver_name_is_refused_in_one_line(orbit_server, tmp_path):
    result = run_example(
        "keyed_concurrency.py",
        orbit_server,
        tmp_path,
        ORBIT_FENCE_MYSQL_DSN=dsn("unused"),
        ORBIT_FENCE_MYSQL_DRIVER="mysql-connector",
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "example: ORBIT_FENCE_MYSQL_DRIVER must be MySQLdb or pymysql, not 'mysql-connector'"
    ]
