"""Keyed concurrency with a monotonic permit token (keyed-concurrency seed §4, §5).

Two queues each get one task with the same concurrency key; two workers of
capacity 4 (one per queue) run them. The handler writes to a real database
through orbit_sdk.fencing.Guard, which in ONE transaction locks the key's fence
row, rejects a token lower than the highest it has accepted, raises the highest
token, de-duplicates by operation id and records the write. The attempts' tokens
must increase, and a replayed stale write must be refused.

    ORBIT_URL=http://127.0.0.1:8080 ORBIT_CREDENTIALS_FILE=/tmp/orbit-keyed.credentials.json \\
        .venv/bin/python examples/keyed_concurrency.py

The resource is a SQLite file in a temporary directory, or MariaDB/MySQL when
ORBIT_FENCE_MYSQL_DSN=mysql://user:password@host:port/database is set (the
database must exist; the example creates its tables there and keeps them).
MySQL is reached with mysqlclient (MySQLdb) when it is installed, else with
PyMySQL; ORBIT_FENCE_MYSQL_DRIVER=pymysql (or MySQLdb) picks one. The guard tells
the dialect from the connection either way.
"""

from __future__ import annotations

import importlib
import os
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples._common import arm_deadline, client_from_env, start_worker, wait_for  # noqa: E402
from orbit_sdk import CreateQueueRequest, SubmitTaskRequest, Worker, fencing, load_credentials  # noqa: E402

RESOURCE_DDL = {
    "sqlite": "CREATE TABLE IF NOT EXISTS example_object_write (object_ref TEXT NOT NULL,"
    " operation_ref TEXT NOT NULL, token TEXT NOT NULL)",
    "mysql": "CREATE TABLE IF NOT EXISTS example_object_write (object_ref VARCHAR(191) NOT NULL,"
    " operation_ref VARCHAR(191) NOT NULL, token BIGINT UNSIGNED NOT NULL) DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
}


def mysql_driver() -> Any:
    """The DB-API module to reach MySQL with: ORBIT_FENCE_MYSQL_DRIVER's, else
    mysqlclient (the server's own driver), else PyMySQL. Both take the same
    connect() arguments and both are fenced the same way."""
    chosen = os.environ.get("ORBIT_FENCE_MYSQL_DRIVER", "").strip()
    if chosen not in ("", "MySQLdb", "pymysql"):
        raise SystemExit(f"example: ORBIT_FENCE_MYSQL_DRIVER must be MySQLdb or pymysql, not {chosen!r}")
    if chosen:
        return importlib.import_module(chosen)
    try:
        return importlib.import_module("MySQLdb")
    except ImportError:
        return importlib.import_module("pymysql")


def resource_connector() -> tuple[str, Any]:
    """(dialect, connect): a new connection per call, since each worker thread writes with its own."""
    dsn = os.environ.get("ORBIT_FENCE_MYSQL_DSN", "").strip()
    if dsn:
        parts = urlsplit(dsn)
        driver = mysql_driver()

        def connect_mysql() -> Any:
            return driver.connect(
                host=parts.hostname or "127.0.0.1",
                port=parts.port or 3306,
                user=unquote(parts.username or "root"),
                password=unquote(parts.password or ""),
                database=parts.path.lstrip("/"),
                charset="utf8mb4",
            )

        return "mysql", connect_mysql
    path = os.path.join(tempfile.mkdtemp(prefix="orbit-keyed-"), "resource.sqlite3")
    return "sqlite", lambda: sqlite3.connect(path, timeout=10)


class Resource:
    """The object the tasks update: rows in a real database, written only through the guard."""

    def __init__(self) -> None:
        self.dialect, self.connect = resource_connector()
        conn = self.connect()
        try:
            fencing.install(conn)  # the dialect is told from the connection: sqlite3, MySQLdb or PyMySQL
            cursor = conn.cursor()
            cursor.execute(RESOURCE_DDL[self.dialect])
            cursor.close()
            conn.commit()
        finally:
            conn.close()
        self._lock = threading.Lock()  # counts overlapping handlers only; the guard needs no mutex
        self.active = 0
        self.max_active = 0

    def write(self, namespace: str, key: str, token: int, operation_ref: str) -> None:
        """The guarded write: raises fencing.StaleToken when a newer token has been accepted."""
        mark = "?" if self.dialect == "sqlite" else "%s"

        def insert(conn: Any) -> dict[str, str]:
            cursor = conn.cursor()
            cursor.execute(
                f"INSERT INTO example_object_write (object_ref, operation_ref, token) VALUES ({mark}, {mark}, {mark})",
                (key, operation_ref, str(token) if self.dialect == "sqlite" else token),
            )
            cursor.close()
            return {"operation_ref": operation_ref, "token": str(token)}

        conn = self.connect()
        try:
            fencing.Guard(conn).write(namespace, key, token, operation_ref, insert)
        finally:
            conn.close()

    def writes(self, key: str) -> int:
        conn = self.connect()
        try:
            cursor = conn.cursor()
            mark = "?" if self.dialect == "sqlite" else "%s"
            cursor.execute(f"SELECT COUNT(*) FROM example_object_write WHERE object_ref = {mark}", (key,))
            (count,) = cursor.fetchone()
            cursor.close()
            return int(count)
        finally:
            conn.close()

    def enter(self) -> None:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)

    def leave(self) -> None:
        with self._lock:
            self.active -= 1


def main() -> int:
    deadline = arm_deadline()
    client, url, token = client_from_env()
    namespace_id = load_credentials(os.environ.get("ORBIT_CREDENTIALS_FILE")).namespace_id
    if namespace_id is None:
        raise SystemExit("example: the credentials file has no namespace_id (orbit_bootstrap writes one)")
    run = uuid.uuid4().hex[:12]
    key = f"object/{run}"
    resource = Resource()

    def update_object(execution):
        if execution.concurrency_key != key or execution.concurrency_token is None:
            raise RuntimeError("expected a keyed execution with a token")
        resource.enter()
        try:
            time.sleep(0.3)  # long enough that overlapping permits would show
            resource.write(execution.namespace_id, key, execution.concurrency_token, execution.payload["operation_ref"])
        finally:
            resource.leave()
        return {"token": str(execution.concurrency_token)}

    queues = [
        client.create_queue(
            f"keyed-{run}-queue-{n}",
            CreateQueueRequest(name=f"keyed-{run}-{n}", max_concurrency=4, rate_per_second=100),
        ).queue
        for n in (1, 2)
    ]
    tasks = [
        client.submit_task(
            f"keyed-{run}-operation-{n}",
            SubmitTaskRequest(
                queue_id=queue.id,
                handler="object.update",
                handler_version="v1",
                payload_version="v1",
                payload={"operation_ref": f"update-{n}", "object_ref": key},
                concurrency_key=key,
                timeout_seconds=20,
            ),
        ).task
        for n, queue in enumerate(queues, start=1)
    ]
    workers = [
        Worker(
            url,
            token,
            queues=[queue.id],
            handlers={("object.update", "v1"): update_object},
            capacity=4,
            namespace_id=namespace_id,
        )
        for queue in queues
    ]
    threads = [start_worker(worker) for worker in workers]
    finished = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
    wait_for(lambda: all(client.get_task(t.id).state in finished for t in tasks), deadline, "both tasks")
    completed = sum(client.get_task(t.id).state == "SUCCEEDED" for t in tasks)

    attempts = sorted(
        (a for t in tasks for a in client.list_attempts(t.id).items if a.started_at is not None),
        key=lambda a: a.started_at,
    )
    tokens = [a.concurrency_token for a in attempts]
    increasing = len(tokens) == 2 and all(b > a for a, b in zip(tokens, tokens[1:], strict=False))
    increasing = increasing and resource.max_active == 1
    print(f"queues={len(queues)} completed={completed} tokens_increasing={str(increasing).lower()}", flush=True)

    try:  # a request still carrying the first attempt's token arrives late
        resource.write(namespace_id, key, tokens[0], "late-replay-of-update-1")
        stale_rejected = False
    except fencing.StaleToken:
        stale_rejected = True
    for worker in workers:
        worker.drain()
    for thread in threads:
        thread.join(timeout=max(0.1, deadline - time.monotonic()))
    drained = not any(thread.is_alive() for thread in threads)
    print(
        f"resource_writes={resource.writes(key)} stale_write_rejected={str(stale_rejected).lower()} "
        f"worker_drained={str(drained).lower()}",
        flush=True,
    )
    ok = completed == 2 and increasing and stale_rejected and drained and resource.writes(key) == 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
