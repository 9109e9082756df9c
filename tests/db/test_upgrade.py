"""`manage.py migrate` upgrades a database made by an earlier release, rows intact.

The earlier release's schema is its migrations applied up to their last one
(the house's move of the shell and console out of the foundation moved no model
and renamed no app, so its database is exactly that), then its rows: a
bootstrapped tenant, a queue, tasks, a worker identity. The new code's migrate
must leave every row as it was and orbit_check clean."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from server.probes import database_settings, open_connection
from tests.support.live import ROOT

pytestmark = [pytest.mark.mysql_only]

# The last migration of each app in the release before key policies (capacity
# and rate per key, fair shares); Django's own apps had not changed since.
EARLIER_RELEASE = {"orbit": "0003", "queues": "0001", "tasks": "0007", "plans": "0001", "workers": "0004"}
DJANGO_APPS = ["contenttypes", "auth", "admin", "sessions"]
APPLICATION, NAMESPACE, QUEUE = "a" * 32, "b" * 32, "c" * 32
TASK, ATTEMPT = "d" * 32, "e" * 32

# The earlier release's rows, as its code wrote them (this code's bootstrap
# reads columns that schema lacks): a tenant and a queue, a task running under
# a key's permit, a free key, the counters that agree with them.
EARLIER_ROWS = [
    "INSERT INTO orbit_application (id, name, max_active_attempts, max_unfinished_tasks, revision, created_at,"
    f" updated_at) VALUES ('{APPLICATION}', 'upgrade', 100000, 10000000, 1, NOW(6), NOW(6))",
    "INSERT INTO orbit_application_state (application_id, active_attempts, unfinished_tasks)"
    f" VALUES ('{APPLICATION}', 1, 1)",
    "INSERT INTO orbit_namespace (id, application_id, environment, name, created_at)"
    f" VALUES ('{NAMESPACE}', '{APPLICATION}', 'production', 'default', NOW(6))",
    "INSERT INTO orbit_queue (id, namespace_id, application_id, name, paused, max_concurrency, rate_per_second,"
    f" max_unfinished_tasks, revision, retired_at, created_at, updated_at) VALUES ('{QUEUE}', '{NAMESPACE}',"
    f" '{APPLICATION}', 'upgrade', 0, 10, 100, 1000, 1, NULL, NOW(6), NOW(6))",
    "INSERT INTO orbit_queue_state (queue_id, application_id, unfinished_tasks, active_permits, reserved_starts,"
    f" window_started_at, window_count, accepting) VALUES ('{QUEUE}', '{APPLICATION}', 1, 1, 0, NOW(6), 1, 1)",
    "INSERT INTO orbit_task (id, namespace_id, application_id, queue_id, handler, handler_version, payload_version,"
    " payload, business_key, concurrency_key, key_ready, priority, state, attempts, max_attempts, epoch,"
    " available_at, start_deadline_at, deadline_at, retry_initial_seconds, retry_multiplier, retry_max_seconds,"
    " lease_seconds, cancel_requested, output, last_error, created_at, updated_at, finished_at)"
    f" VALUES ('{TASK}', '{NAMESPACE}', '{APPLICATION}', '{QUEUE}', 'h', '1', '1', '{{}}', '', 'account/1', 1, 5,"
    " 'RUNNING', 1, 3, 1, NOW(6), NULL, NULL, 1, 2, 300, 3600, 0, NULL, NULL, NOW(6), NOW(6), NULL)",
    "INSERT INTO orbit_attempt (id, task_id, namespace_id, application_id, queue_id, number, state, epoch,"
    " concurrency_key, concurrency_token, worker_id, session_id, leased_at, lease_expires_at, started_at,"
    " finished_at, outcome, retryable, output, error, late_outcome)"
    f" VALUES ('{ATTEMPT}', '{TASK}', '{NAMESPACE}', '{APPLICATION}', '{QUEUE}', 1, 'RUNNING', 1, 'account/1', 1,"
    f" 'earlier-0', '{'f' * 32}', NOW(6), NOW(6) + INTERVAL 1 HOUR, NOW(6), NULL, '', 0, NULL, NULL, NULL)",
    "INSERT INTO orbit_concurrency_key (namespace_id, `key`, version, holder_attempt_id, holder_task_id, updated_at)"
    f" VALUES ('{NAMESPACE}', 'account/1', 1, '{ATTEMPT}', '{TASK}', NOW(6)),"
    f" ('{NAMESPACE}', 'account/2', 2, '', '', NOW(6))",
]


# The earlier release's `migrate <app> <migration>` for each of its apps, then Django's
# own apps' `migrate <app>`: the same commands, run one after another in one process
# rather than one process each (each start of manage.py costs more than its migrate).
MIGRATE_TO_THE_EARLIER_RELEASE = f"""
from django.core.management import call_command
for app, migration in {list(EARLIER_RELEASE.items())!r}:
    call_command("migrate", app, migration, verbosity=0)
for app in {DJANGO_APPS!r}:
    call_command("migrate", app, verbosity=0)
"""


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


def columns(database: Any, query: str) -> list[tuple[Any, ...]]:
    with database.cursor() as cursor:
        cursor.execute(query)
        return list(cursor.fetchall())


def test_migrate_upgrades_the_earlier_releases_database_with_its_rows_intact(earlier_database):
    env, database = earlier_database
    # given a database at the earlier release's schema, with a tenant, a task holding a key, a free key
    manage(env, "shell", "-c", MIGRATE_TO_THE_EARLIER_RELEASE)
    assert columns(database, "SHOW COLUMNS FROM orbit_concurrency_key LIKE 'holders'") == []  # the earlier schema
    with database.cursor() as cursor:
        for statement in EARLIER_ROWS:
            cursor.execute(statement)
    database.commit()
    tables = ["orbit_namespace", "orbit_queue"]
    before = {table: rows(database, table) for table in tables}
    applications = rows(database, "orbit_application")
    # when the new code migrates it
    manage(env, "migrate", "-v0")
    # then every row is as it was; the held key counts its one holder, both keys have capacity 1 and no rate
    assert {table: rows(database, table) for table in tables} == before
    assert [row[:5] for row in rows(database, "orbit_application")] == [row[:5] for row in applications]
    keys = columns(
        database,
        "SELECT `key`, version, holder_attempt_id, holders, capacity, rate_tat, rate_reserved, next_start_at"
        " FROM orbit_concurrency_key ORDER BY `key`",
    )
    assert keys == [("account/1", 1, ATTEMPT, 1, 1, None, 0, None), ("account/2", 2, "", 0, 1, None, 0, None)]
    assert columns(database, "SELECT concurrency_slot, key_rate_reserved FROM orbit_attempt") == [(None, 0)]
    assert columns(database, "SELECT fairness_key FROM orbit_task") == [("",)]
    manage(env, "orbit_check")  # exit 0: every counter agrees with the rows
    assert manage(env, "migrate", "--check", "-v0") == ""
