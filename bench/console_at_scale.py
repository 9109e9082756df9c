"""The console's server time at 1,000,000 tasks (not part of the suite).

    .venv/bin/python -m bench.console_at_scale [--tasks 1000000] [--queues 20] [--runs 7]

Makes a fresh MariaDB database (orbit_console_bench on 127.0.0.1:3306, root,
no password; dropped at the end unless --keep), migrates it, creates the
queues through the API verbs, then bulk-inserts the tasks (multi-row INSERTs
of the model's own columns): 88% finished (each run one with its attempt),
12% WAITING and NEEDS_REVIEW backlogs, one task in seven keyed (5,000 keys)
and a hot key with a thousand attempts of token history, the counters set to
match, and an hour of the per-minute rollup. Then it times, with Django's test client in
this process (the server's own work, no network), the dashboard, the queue
list, a task page and a key page, and prints the median and the slowest of
--runs requests each, with their statement counts."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

DATABASE = "orbit_console_bench"


def fresh_database(name: str) -> None:
    import MySQLdb

    connection = MySQLdb.connect(host="127.0.0.1", port=3306, user="root", passwd="")
    cursor = connection.cursor()
    cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
    cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
    connection.close()


def drop_database(name: str) -> None:
    import MySQLdb

    connection = MySQLdb.connect(host="127.0.0.1", port=3306, user="root", passwd="")
    connection.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
    connection.close()


def new_id() -> str:
    return uuid.uuid4().hex


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--queues", type=int, default=20)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args()

    fresh_database(DATABASE)
    os.environ["ORBIT_MYSQL_DSN"] = f"mysql://root:@127.0.0.1:3306/{DATABASE}"
    os.environ["ORBIT_INLINE_DB"] = "1"
    os.environ["ORBIT_MAINTENANCE"] = "0"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
    import django

    django.setup()
    from django.conf import settings

    settings.ORBIT_INLINE_DB = True
    settings.ALLOWED_HOSTS = ["*"]
    try:
        load_and_time(args)
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            drop_database(DATABASE)


def load_and_time(args: argparse.Namespace) -> None:
    from django.core.management import call_command
    from django.db import connection

    started = time.monotonic()
    call_command("migrate", verbosity=0)
    world = load(args.tasks, args.queues)
    print(f"loaded {args.tasks:,} tasks, {world['attempts']:,} attempts in {time.monotonic() - started:.0f} s")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE orbit_task, orbit_attempt, orbit_concurrency_key, orbit_queue_minute")
        cursor.fetchall()
    time_pages(world, args.runs)


def load(total: int, queue_count: int) -> dict:
    from django.db import connection
    from rest_framework.test import APIClient

    from orbit.models import SCOPES
    from orbit.tenancy import ensure_application, ensure_namespace, issue_credential
    from queues.models import QueueState
    from tasks.models import Attempt, ConcurrencyKey, QueueMinute, Task

    application = ensure_application("bench")
    namespace = ensure_namespace(application, "bench", "console")
    client = APIClient()
    client.credentials(
        HTTP_AUTHORIZATION=f"Bearer {issue_credential(namespace, scopes=list(SCOPES), queue_ids=None).token}"
    )
    queues = []
    for n in range(queue_count):
        body = {"name": f"queue-{n:02d}", "max_concurrency": 50, "rate_per_second": 200}
        response = client.post("/v1/queues", body, format="json", HTTP_IDEMPOTENCY_KEY=f"q{n}")
        assert response.status_code == 201, response.content
        queues.append(response.json()["data"]["queue"]["id"])

    now = datetime.now(UTC)
    rng = random.Random(7)
    task_columns = [f.column for f in Task._meta.concrete_fields if not f.generated]
    attempt_columns = [f.column for f in Attempt._meta.concrete_fields]
    hot_key = "acct/hot"
    counters = {q: {"unfinished": 0, "active": 0, "reserved": 0} for q in queues}
    keys: set[str] = set()
    attempts_made = 0
    sample: dict = {}
    batch_tasks: list[tuple] = []
    batch_attempts: list[tuple] = []

    def flush() -> None:
        with connection.cursor() as cursor:
            if batch_tasks:
                cursor.executemany(
                    f"INSERT INTO orbit_task ({', '.join(task_columns)}) "
                    f"VALUES ({', '.join(['%s'] * len(task_columns))})",
                    batch_tasks,
                )
            if batch_attempts:
                cursor.executemany(
                    f"INSERT INTO orbit_attempt ({', '.join(attempt_columns)}) "
                    f"VALUES ({', '.join(['%s'] * len(attempt_columns))})",
                    batch_attempts,
                )
        batch_tasks.clear()
        batch_attempts.clear()

    for n in range(total):
        queue_id = queues[n % queue_count] if n % 10 else queues[0]  # queue-00 is the biggest
        roll = rng.random()
        state = (
            "SUCCEEDED"
            if roll < 0.80
            else "FAILED"
            if roll < 0.86
            else "CANCELLED"
            if roll < 0.88
            else "NEEDS_REVIEW"
            if roll < 0.882
            else "WAITING"
        )
        keyed = n % 7 == 0
        key = hot_key if n % 997 == 0 else (f"acct/{n % 5000}" if keyed else "")
        created = now - timedelta(seconds=rng.uniform(0, 7 * 86400))
        task_id = new_id()
        finished = state in ("SUCCEEDED", "FAILED", "CANCELLED")
        values = {
            "id": task_id,
            "namespace_id": namespace.id,
            "application_id": application.id,
            "queue_id": queue_id,
            "handler": "bench",
            "handler_version": "v1",
            "payload_version": "v1",
            "payload": f'{{"n": {n}}}',
            "business_key": "",
            "concurrency_key": key,
            "key_ready": 1,
            "priority": rng.randint(0, 9),
            "state": state,
            "attempts": 1 if finished and state != "CANCELLED" else 0,
            "max_attempts": 3,
            "epoch": 1 if finished and state != "CANCELLED" else 0,
            "available_at": created,
            "start_deadline_at": None,
            "deadline_at": None,
            "retry_initial_seconds": 1,
            "retry_multiplier": 2,
            "retry_max_seconds": 300,
            "lease_seconds": 30,
            "cancel_requested": 0,
            "output": '{"ok": true}' if state == "SUCCEEDED" else None,
            "last_error": '{"code": "boom"}' if state in ("FAILED", "NEEDS_REVIEW") else None,
            "created_at": created,
            "updated_at": created,
            "finished_at": created + timedelta(seconds=1) if finished else None,
        }
        if state == "WAITING" and key:
            values["key_ready"] = 0  # one ready per key and queue is fixed up below
        if not finished:
            counters[queue_id]["unfinished"] += 1
        if key:
            keys.add(key)
        batch_tasks.append(tuple(values[c] for c in task_columns))
        if values["attempts"] or (key == hot_key and finished):
            token = None  # numbered per key below, in lease order
            attempt = {
                "id": new_id(),
                "task_id": task_id,
                "namespace_id": namespace.id,
                "application_id": application.id,
                "queue_id": queue_id,
                "number": 1,
                "state": state if state in ("SUCCEEDED", "FAILED") else "SUCCEEDED",
                "epoch": 1,
                "concurrency_key": key,
                "concurrency_token": token,
                "worker_id": f"worker-{n % 16}",
                "session_id": new_id(),
                "leased_at": created,
                "lease_expires_at": created + timedelta(seconds=30),
                "started_at": created + timedelta(milliseconds=5),
                "finished_at": created + timedelta(seconds=1),
                "outcome": "SUCCEEDED",
                "retryable": 0,
                "output": None,
                "error": None,
                "late_outcome": None,
            }
            batch_attempts.append(tuple(attempt[c] for c in attempt_columns))
            attempts_made += 1
        if state == "FAILED" and "task" not in sample:
            sample["task"] = task_id
        if len(batch_tasks) >= 2000:
            flush()
        if n % 100_000 == 0 and n:
            print(f"  {n:,} tasks", flush=True)
    flush()
    with connection.cursor() as cursor:
        # Tokens in lease order, per key; one ready WAITING task per (key, queue).
        cursor.execute("SET @t = 0, @k = ''")
        cursor.execute(
            "UPDATE orbit_attempt SET concurrency_token = (@t := IF(@k = concurrency_key, @t + 2, 1)), "
            "concurrency_key = (@k := concurrency_key) WHERE concurrency_key <> '' ORDER BY concurrency_key, leased_at"
        )
        cursor.execute(
            "UPDATE orbit_task t JOIN (SELECT MIN(id) id FROM orbit_task "
            "WHERE state = 'WAITING' AND concurrency_key <> '' "
            "GROUP BY namespace_id, concurrency_key, queue_id) f ON f.id = t.id SET t.key_ready = 1"
        )
    for key in keys:
        highest = (
            Attempt.objects.filter(namespace_id=namespace.id, concurrency_key=key)
            .order_by("-concurrency_token")
            .values_list("concurrency_token", flat=True)
            .first()
        )
        ConcurrencyKey.objects.create(namespace_id=namespace.id, key=key, version=(highest or 0) + 1, updated_at=now)
    for queue_id, counts in counters.items():
        QueueState.objects.filter(queue_id=queue_id).update(unfinished_tasks=counts["unfinished"])
    from orbit.models import ApplicationState

    ApplicationState.objects.filter(application_id=application.id).update(
        unfinished_tasks=sum(c["unfinished"] for c in counters.values())
    )
    minute = now.replace(second=0, microsecond=0)
    QueueMinute.objects.bulk_create(
        [
            QueueMinute(
                queue_id=queue_id,
                minute=minute - timedelta(minutes=m),
                starts=rng.randint(50, 900),
                results=rng.randint(50, 900),
            )
            for queue_id in queues
            for m in range(60)
        ]
    )
    hot = ConcurrencyKey.objects.get(namespace_id=namespace.id, key=hot_key)
    history = Attempt.objects.filter(concurrency_key=hot_key).count()
    print(f"  keys: {len(keys):,}; hot key {hot_key!r}: {history:,} attempts")
    return {"attempts": attempts_made, "task": sample["task"], "key_pk": hot.pk, "namespace_id": namespace.id}


def time_pages(world: dict, runs: int) -> None:
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    user = get_user_model().objects.create_superuser("bench", "bench@example.com", "pw")
    client = Client()
    client.force_login(user)
    pages = {
        "dashboard (/admin/)": "/admin/",
        "queue list": "/admin/queues/queue/",
        "task page": f"/admin/tasks/task/{world['task']}/change/",
        "key page (hot key)": f"/admin/tasks/concurrencykey/{world['key_pk']}/change/",
        "task list (capped count)": "/admin/tasks/task/",
    }
    print(f"\nserver time per page, {runs} requests each (Django test client, MariaDB):")
    for name, url in pages.items():
        client.get(url)  # warm
        times = []
        statements = 0
        for _ in range(runs):
            with CaptureQueriesContext(connection) as queries:
                started = time.perf_counter()
                response = client.get(url)
                times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200, (url, response.status_code)
            statements = len(queries.captured_queries)
        median = statistics.median(times)
        print(f"  {name:28s} median {median:7.1f} ms   max {max(times):7.1f} ms   {statements} statements")


if __name__ == "__main__":
    main()
