"""django-q2 with its ORM broker, on the same MariaDB server as Orbit.

Why django-q2 (1.11): it is the maintained fork of django-q, widely used, and its ORM
broker keeps the queue in a Django model (``django_q_ormq``), so it runs on MariaDB with
no other service — the closest well-known peer to "a Django app whose database is the
queue". It is at-least-once: a dequeued row is hidden for ``retry`` seconds (a visibility
timeout, the ORM broker's lease) and deleted on acknowledgement, so a crashed cluster's
tasks come back by themselves. The alternative considered, django-tasks' database backend
(``django-tasks-db``, the reference backend of Django 6's task framework), claims a row
with ``SELECT … FOR UPDATE SKIP LOCKED`` but has no recovery for a worker that dies
while running a task (the row stays RUNNING), runs one task at a time per worker process,
and has no rate limit or per-key mutex — W4 would only show "lost".

Project: ``bench/systems/djq_site`` (own settings module; never Orbit's project), a fresh
MariaDB database ``bench_djq`` per run, dropped afterwards. Nodes: 4 ``qcluster``
processes ("clusters"), each with 4 worker processes (django-q2 runs one task per worker
process; 4 x 4 = 16 in flight, as many as 2 cores sensibly run), pusher ``bulk=1``,
``poll=0.2`` s, ``queue_limit`` = workers² = 16, ``save_limit`` = 250 (defaults), retry =
lease_seconds, timeout = lease − 2. Submitters: 16 threads calling ``async_task`` (one
INSERT + commit each).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from bench.common import ROOT, EventLog, drop_mariadb, fresh_mariadb, spawn
from bench.systems import peerkit

SETTINGS = "bench.systems.djq_site.settings"
DB_NAME = "bench_djq"
FUNCS = {"noop": "bench.systems.djq_site.tasks.noop", "hold": "bench.systems.djq_site.tasks.hold"}
WORKERS_PER_NODE = 4


class DjangoQ2Peer(peerkit.Peer):
    NAME = "django-q2"
    SERVICES = ("mariadb",)
    WORKLOADS = ("W1", "W4", "W5")
    DURABILITY = (
        "InnoDB commit per async_task (innodb_flush_log_at_trx_commit=1 here); a dequeued row "
        "is hidden for retry = lease_seconds and deleted on acknowledgement: at-least-once, "
        "a dead cluster's tasks reappear after the retry timeout"
    )
    NOTES = {
        "W0": "Orbit-only (MariaDB transaction ceiling).",
        "W2": "n/a: django-q2 has no per-key mutex.",
        "W3": "n/a: django-q2 has no rate limit.",
        "W4": "the whole victim cluster (sentinel, pusher, monitor, workers) is SIGKILLed; tokens n/a.",
        "W5": (
            "fetch = the ORM broker's dequeue (SELECT … WHERE key AND lock < now LIMIT bulk, no "
            "ORDER BY, then a conditional UPDATE of lock), timed from the harness."
        ),
    }
    CONFIG = {
        "broker": "ORM (django_q_ormq on MariaDB)",
        "cluster_nodes": 4,
        "workers_per_node": WORKERS_PER_NODE,
        "bulk": 1,
        "poll_s": 0.2,
        "queue_limit": WORKERS_PER_NODE**2,
        "save_limit": 250,
        "retry": "lease_seconds",
        "timeout": "lease_seconds - 2",
        "submitters": "16 threads, async_task",
    }

    def __init__(self) -> None:
        self.lease = 10.0
        self._logs: dict[int, Path] = {}
        self._django_ready = False

    # --- lifecycle
    def _django(self) -> None:
        if not self._django_ready:
            os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
            os.environ["BENCH_DJQ_DB"] = DB_NAME
            os.environ["BENCH_LEASE_SECONDS"] = str(self.lease)
            import django  # noqa: PLC0415

            django.setup()
            self._django_ready = True

    def setup(self, scale: dict) -> None:
        self.lease = float(scale.get("lease_seconds", 10))
        fresh_mariadb(DB_NAME)
        self._django()
        from django.core.management import call_command  # noqa: PLC0415
        from django.db import connections  # noqa: PLC0415

        connections.close_all()
        call_command("migrate", verbosity=0)

    def teardown(self) -> None:
        try:
            from django.db import connections  # noqa: PLC0415

            connections.close_all()
        except Exception:  # noqa: BLE001
            pass
        try:
            drop_mariadb(DB_NAME)
        except Exception as exc:  # noqa: BLE001
            print(f"django-q2: drop database: {exc!r}", file=sys.stderr)

    # --- workers
    def start_node(self, role: str, index: int, events: EventLog, **_: Any) -> subprocess.Popen:
        env = {
            **os.environ,
            **events.env(role),
            "DJANGO_SETTINGS_MODULE": SETTINGS,
            "BENCH_DJQ_DB": DB_NAME,
            "BENCH_DJQ_WORKERS": str(WORKERS_PER_NODE),
            "BENCH_LEASE_SECONDS": str(self.lease),
        }
        log = events.directory / f"node-{role}{index}-{uuid.uuid4().hex[:6]}.out"
        proc = spawn([sys.executable, "-m", "django", "qcluster"], env=env, cwd=ROOT, log=log)
        self._logs[proc.pid] = log
        return proc

    def node_ready(self, proc: subprocess.Popen, events: EventLog) -> bool:
        log = self._logs.get(proc.pid)
        try:
            return log is not None and "running." in log.read_text(errors="replace")
        except OSError:
            return False

    # --- submission
    def submit_all(self, items: list[peerkit.Item], concurrency: int) -> dict[str, float]:
        from django.db import connection  # noqa: PLC0415
        from django_q.tasks import async_task  # noqa: PLC0415

        def submit_one(key: str, options: dict[str, Any]) -> None:
            async_task(FUNCS[options.get("kind", "noop")], key)

        return peerkit.threaded_submit(submit_one, items, concurrency, thread_teardown=lambda: connection.close())

    def confirm_done(self, prefix: str, count: int) -> bool:
        from django_q.models import OrmQ  # noqa: PLC0415

        return not OrmQ.objects.exists()

    # --- W5
    def preload_bulk(self, count: int) -> None:
        from django.db import connection  # noqa: PLC0415
        from django_q.signing import SignedPackage  # noqa: PLC0415

        payload = SignedPackage.dumps(
            {"id": uuid.uuid4().hex, "name": "bulk", "func": FUNCS["noop"], "args": ("bulk",), "kwargs": {}}
        )
        with connection.cursor() as cur:
            done = 0
            while done < count:
                chunk = min(100_000, count - done)
                cur.execute(
                    "INSERT INTO django_q_ormq (`key`, payload, `lock`) "
                    f"SELECT 'bench', %s, UTC_TIMESTAMP(6) - INTERVAL 1 SECOND FROM mysql.seq_1_to_{chunk}",
                    [payload],
                )
                done += chunk
            cur.execute("ANALYZE TABLE django_q_ormq")
        self._broker = None

    def fetch_once(self) -> None:
        from django_q.brokers import get_broker  # noqa: PLC0415

        if getattr(self, "_broker", None) is None:
            self._broker = get_broker()
        got = self._broker.dequeue()
        if not got:
            raise RuntimeError("django-q2 W5: dequeue returned nothing")

    def clear_backlog(self) -> None:
        from django.db import connection  # noqa: PLC0415

        with connection.cursor() as cur:
            cur.execute("TRUNCATE TABLE django_q_ormq")


SYSTEM = DjangoQ2Peer()
NAME = SYSTEM.NAME
DURABILITY = SYSTEM.DURABILITY
WORKLOADS = SYSTEM.WORKLOADS
NOTES = SYSTEM.NOTES
CONFIG = SYSTEM.CONFIG
run = SYSTEM.run
