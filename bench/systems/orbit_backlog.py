"""W5: lease latency with a small vs a large waiting backlog, in-process on MariaDB.

Three queues in one database: SMALL waiting tasks, LARGE waiting tasks, and a
keyed queue where LARGE tasks wait behind one busy key and a few tasks of
other keys sit at the end. Each sample times one lease transaction
(tasks.actions.dispatch.lease_tasks, limit 1) and then hands the attempt back
untimed, so the backlog keeps its size. The backlog rows are inserted with SQL
(MariaDB's sequence engine) and the counters set to match: this measures
leasing, not submitting.

    .venv/bin/python -m bench.systems.orbit_backlog --small 1000 --large 1000000 --samples 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", type=int, default=1000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--run", type=int, default=0)
    args = parser.parse_args()
    import MySQLdb

    database = f"bench_orbit_w5_{args.run}"
    admin = MySQLdb.connect(host="127.0.0.1", user="root", passwd="")
    admin.cursor().execute(f"DROP DATABASE IF EXISTS `{database}`")
    admin.cursor().execute(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
    os.environ["ORBIT_MYSQL_DSN"] = f"mysql://root:@127.0.0.1:3306/{database}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, check=True)
    import django

    django.setup()
    from django.db import connection

    from orbit.tenancy import ensure_application, ensure_namespace
    from queues.models import Queue, QueueState
    from tasks.actions import context, endings, rounds

    application = ensure_application("w5")
    namespace = ensure_namespace(application, "bench", "w5")

    def make_queue(name: str) -> Queue:
        queue = Queue.objects.create(
            namespace_id=namespace.id,
            application_id=application.id,
            name=name,
            max_concurrency=100000,
            rate_per_second=1000000,
            max_unfinished_tasks=1000000,
        )
        QueueState.objects.create(queue_id=queue.id, application_id=application.id)
        return queue

    def fill(queue: Queue, count: int, key_sql: str = "''", offset: int = 0, ready_sql: str = "1") -> float:
        began = time.perf_counter()
        with connection.cursor() as cursor:
            # In chunks: one statement per 100,000 rows stays well inside the
            # connection's read_timeout (30 s) on a slow machine.
            for start in range(0, count, 100_000):
                size = min(100_000, count - start)
                cursor.execute(
                    "INSERT INTO orbit_task (id,namespace_id,application_id,queue_id,handler,handler_version,"
                    "payload_version,payload,business_key,concurrency_key,key_ready,priority,state,attempts,"
                    "max_attempts,epoch,available_at,retry_initial_seconds,retry_multiplier,retry_max_seconds,"
                    "lease_seconds,cancel_requested,created_at,updated_at) "
                    f"SELECT LOWER(CONCAT(LEFT(%s, 16), LPAD(HEX(seq + %s), 16, '0'))), %s, %s, %s, 'noop', 'v1', "
                    f"'v1', '{{}}', '', {key_sql}, {ready_sql}, 5, 'WAITING', 0, 3, 0, "
                    "NOW(6) - INTERVAL 1 HOUR + INTERVAL seq MICROSECOND, "
                    f"1, 2, 300, 30, 0, NOW(6), NOW(6) FROM (SELECT seq + {start} AS seq FROM seq_1_to_{size}) AS s",
                    [queue.id, offset, namespace.id, application.id, queue.id],
                )
            cursor.execute(
                "UPDATE orbit_queue_state SET unfinished_tasks = unfinished_tasks + %s WHERE queue_id = %s",
                [count, queue.id],
            )
            cursor.execute(
                "UPDATE orbit_application_state SET unfinished_tasks = unfinished_tasks + %s WHERE application_id = %s",
                [count, application.id],
            )
        return time.perf_counter() - began

    def sample(queue: Queue, concurrency_keys: bool) -> tuple[list[float], str]:
        worker = context.WorkerContext(
            namespace_id=namespace.id,
            application_id=application.id,
            worker_id=f"w5-{queue.name}",
            session_id="s" * 32,
            queue_ids=(queue.id,),
            handlers=(),
            concurrency_keys=concurrency_keys,
        )
        times = []
        for _ in range(args.samples):
            began = time.perf_counter()
            leased = rounds.lease_tasks(worker=worker, limit=1)
            times.append((time.perf_counter() - began) * 1000)
            assert leased, "nothing leased"
            endings.release_attempt(
                worker=worker, attempt_id=leased[0]["attempt_id"], epoch=leased[0]["epoch"], reason="w5 sample"
            )
        return times, leased[0]["task"].get("concurrency_key", "")

    small, large, keyed = make_queue("small"), make_queue("large"), make_queue("keyed")
    fill_small = fill(small, args.small)
    fill_large = fill(large, args.large)
    # Keyed: the whole large backlog waits behind one held key; other keys come last.
    # As submit would leave it: one ready task per (key, queue), the rest blocked.
    fill(keyed, args.large, "'busy'", offset=10 * args.large, ready_sql="seq = 1")
    fill(keyed, 20, "CONCAT('free-', seq)", offset=20 * args.large)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE orbit_task")
    busy_holder = context.WorkerContext(
        namespace_id=namespace.id,
        application_id=application.id,
        worker_id="w5-holder",
        session_id="h" * 32,
        queue_ids=(keyed.id,),
        handlers=(),
        concurrency_keys=True,
    )
    assert rounds.lease_tasks(worker=busy_holder, limit=1)[0]["task"]["concurrency_key"] == "busy"

    small_ms, _ = sample(small, True)
    large_ms, _ = sample(large, True)
    keyed_ms, leased_key = sample(keyed, True)
    with connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN SELECT id FROM orbit_task WHERE queue_id=%s AND state='WAITING' AND key_ready=1 "
            "AND available_at<=NOW(6) "
            "ORDER BY priority DESC, available_at, id LIMIT 1",
            [large.id],
        )
        plan = cursor.fetchall()
    extra = " | ".join(str(row[-1]) for row in plan)
    print(
        json.dumps(
            {
                "backlog_small": args.small,
                "backlog_large": args.large,
                "lease_p50_ms_1k": round(statistics.median(small_ms), 3),
                "lease_p99_ms_1k": round(percentile(small_ms, 0.99), 3),
                "lease_p50_ms_1m": round(statistics.median(large_ms), 3),
                "lease_p99_ms_1m": round(percentile(large_ms, 0.99), 3),
                "lease_p50_ms_1m_busy_key": round(statistics.median(keyed_ms), 3),
                "lease_p99_ms_1m_busy_key": round(percentile(keyed_ms, 0.99), 3),
                "busy_key_skipped": leased_key != "busy",
                "ratio_p50_1m_to_1k": round(statistics.median(large_ms) / statistics.median(small_ms), 2),
                "fill_s_small": round(fill_small, 2),
                "fill_s_large": round(fill_large, 2),
                "plan_extra": extra[:120],
            }
        )
    )
    connection.close()
    admin.cursor().execute(f"DROP DATABASE IF EXISTS `{database}`")
    admin.close()


if __name__ == "__main__":
    main()
