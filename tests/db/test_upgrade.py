"""`manage.py migrate` upgrades a database made by an earlier release, rows intact.

The earlier release's schema is its migrations applied up to their last one
(the house's move of the shell and console out of the foundation moved no model
and renamed no app, so its database is exactly that), then its rows: a
bootstrapped tenant, a queue, tasks, a worker identity. The new code's migrate
must leave every row as it was and orbit_check clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from server.probes import database_settings, open_connection
from tests.support.live import ROOT

pytestmark = [pytest.mark.mysql_only]

# The last migration of each app in the release before worker sessions kept
# their capacity (main at 89abf20); Django's own apps had not changed since.
EARLIER_RELEASE = {"orbit": "0002", "queues": "0001", "tasks": "0005", "plans": "0001", "workers": "0004"}
DJANGO_APPS = ["contenttypes", "auth", "admin", "sessions"]


def manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture
def earlier_database(django_db_setup: None, django_db_blocker: Any) -> Iterator[tuple[dict[str, str], Any]]:
    """A database of its own on the suite's server, and a connection to it."""
    with django_db_blocker.unblock():
        base = database_settings()
        name = f"{connection.settings_dict['NAME']}_upgrade"
        admin = open_connection({**base, "NAME": ""}, 5)  # no database of its own: it creates one
        with admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
            cursor.execute(f"CREATE DATABASE `{name}`")
        env = {key: value for key, value in os.environ.items() if not key.startswith("ORBIT_")}
        env["ORBIT_MYSQL_DSN"] = f"mysql://{base['USER']}:{base['PASSWORD']}@{base['HOST']}:{base['PORT']}/{name}"
        database = open_connection({**base, "NAME": name}, 5)
        try:
            yield env, database
        finally:
            database.close()
            with admin.cursor() as cursor:
                cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
            admin.close()


def rows(database: Any, table: str) -> list[tuple[Any, ...]]:
    with database.cursor() as cursor:
        cursor.execute(f"SELECT * FROM `{table}` ORDER BY 1")
        return list(cursor.fetchall())


def test_migrate_upgrades_the_earlier_releases_database_with_its_rows_intact(earlier_database, tmp_path: Path):
    env, database = earlier_database
    # given a database at the earlier release's schema, with a tenant, tasks and a worker identity
    for app, migration in EARLIER_RELEASE.items():
        manage(env, "migrate", app, migration, "-v0")
    for app in DJANGO_APPS:
        manage(env, "migrate", app, "-v0")
    with database.cursor() as cursor:
        cursor.execute("SHOW COLUMNS FROM orbit_worker_identity LIKE 'capacity'")
        assert cursor.fetchall() == ()  # the earlier schema indeed
    credentials = tmp_path / "credentials.json"
    manage(
        env,
        "orbit_bootstrap",
        "--application",
        "upgrade",
        "--namespace",
        "default",
        "--queue",
        "upgrade",
        "--environment",
        "production",
        "--worker-access",
        "--output",
        str(credentials),
    )
    issued = json.loads(credentials.read_text())
    with database.cursor() as cursor:
        for n in range(3):
            cursor.execute(
                "INSERT INTO orbit_worker_identity (namespace_id, worker_id, concurrency_keys, credential_id,"
                " session_id, connected_at, queue_ids, handlers, seen_at)"
                " VALUES (%s, %s, 1, '', %s, NOW(6), '[]', '[]', NULL)",
                [issued["namespace_id"], f"earlier-{n}", f"{n:032x}"],
            )
    database.commit()
    tables = ["orbit_application", "orbit_namespace", "orbit_credential", "orbit_queue", "orbit_queue_state"]
    before = {table: rows(database, table) for table in tables}
    identities = rows(database, "orbit_worker_identity")
    # when the new code migrates it
    manage(env, "migrate", "-v0")
    # then every row is as it was, the identities now with capacity 0 ("not recorded")
    assert {table: rows(database, table) for table in tables} == before
    assert rows(database, "orbit_worker_identity") == [(*row, 0) for row in identities]
    manage(env, "orbit_check")  # exit 0: every counter agrees with the rows
    assert manage(env, "migrate", "--check", "-v0") == ""
