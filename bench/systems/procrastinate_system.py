"""Procrastinate (PostgreSQL) — harness adapter and the worker app.

Workers: 4 processes (``python -m bench.systems.procrastinate_system worker`` from the root), each
``run_worker_async(concurrency=32)`` (async tasks, like Orbit's 4 connections x capacity
32), LISTEN/NOTIFY on, psycopg pool of 4 connections per worker (psycopg_pool's default),
jobs kept after success (``delete_jobs="never"``, Procrastinate's default, like Orbit
keeps its tasks). Submitters: 16 coroutines calling ``defer_async`` on a pool of 16.
A fresh PostgreSQL database per run (``bench_procrastinate``), dropped afterwards.

W2: ``lock`` is Procrastinate's per-key mutex ("no two jobs with the same lock run at the
same time"; the fetch query skips a job while another job with its lock is ``doing`` or
queued earlier). W2 defers every task with ``lock=object/<i % K>`` and checks overlaps.

W4: Procrastinate does not re-run a dead worker's jobs by itself. Its documented recipe
is a periodic task that retries stalled jobs (``get_stalled_jobs`` = jobs ``doing`` on a
worker whose heartbeat is older than N seconds, then ``retry_job``). W4 runs that recipe
on the workers every second with N = lease_seconds and heartbeat every lease/5 s, and
``fetch_job_polling_interval`` = 1 s, since a retried job sends no NOTIFY.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from typing import Any

import procrastinate

from bench.common import (
    ROLE_ENV,
    ROOT,
    EventLog,
    drop_postgres,
    fresh_postgres,
    log_event,
    now,
    spawn,
)
from bench.systems import peerkit

DSN_ENV = "BENCH_PG_DSN"
LEASE_ENV = "BENCH_LEASE_SECONDS"
RECOVERY_ENV = "BENCH_PROCRASTINATE_RECOVERY"
POLLING_ENV = "BENCH_PROCRASTINATE_POLLING"
QUEUE = "bench"
MAINTENANCE_QUEUE = "maintenance"
HOLD_SECONDS = 600.0
DB_NAME = "bench_procrastinate"

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=os.environ.get(DSN_ENV, "")))


@app.task(name="bench.noop", queue=QUEUE)
async def noop(key: str) -> None:
    log_event("S", key)
    log_event("D", key)


@app.task(name="bench.hold", queue=QUEUE)
async def hold(key: str) -> None:
    log_event("S", key)
    if os.environ.get(ROLE_ENV) == "victim":
        await asyncio.sleep(HOLD_SECONDS)
    log_event("D", key)


if os.environ.get(RECOVERY_ENV):  # W4 only: the documented stalled-jobs recipe, every second

    @app.periodic(cron="* * * * * *")
    @app.task(name="bench.retry_stalled", queue=MAINTENANCE_QUEUE, queueing_lock="retry_stalled",
              pass_context=True)  # fmt: skip
    async def retry_stalled(context: Any, timestamp: int) -> None:
        lease = float(os.environ.get(LEASE_ENV, "10"))
        for job in await context.app.job_manager.get_stalled_jobs(seconds_since_heartbeat=lease):
            if job.queue == QUEUE:
                await context.app.job_manager.retry_job(job)


async def _worker_main() -> None:
    lease = float(os.environ.get(LEASE_ENV, "10"))
    recovery = bool(os.environ.get(RECOVERY_ENV))
    options: dict[str, Any] = {}
    if recovery:
        options.update(update_heartbeat_interval=max(1.0, lease / 5), fetch_job_polling_interval=1.0)
    if os.environ.get(POLLING_ENV):
        options["fetch_job_polling_interval"] = float(os.environ[POLLING_ENV])
    async with app.open_async():
        log_event("R", "procrastinate")
        await app.run_worker_async(
            queues=[QUEUE, MAINTENANCE_QUEUE] if recovery else [QUEUE],
            concurrency=int(os.environ.get("BENCH_CONCURRENCY", "32")),
            name=os.environ.get("BENCH_WORKER_NAME", "worker"),
            listen_notify=True,
            delete_jobs="never",
            install_signal_handlers=True,
            **options,
        )


class ProcrastinatePeer(peerkit.Peer):
    NAME = "procrastinate"
    SERVICES = ("postgres",)
    WORKLOADS = ("W1", "W2", "W4", "W5")
    DURABILITY = (
        "PostgreSQL commit per defer (fsync=on, synchronous_commit=on here); a job row is "
        "'doing' while it runs; a dead worker's jobs stay 'doing' until something retries "
        "them (W4 runs the documented stalled-jobs recipe)"
    )
    NOTES = {
        "W0": "Orbit-only (MariaDB transaction ceiling).",
        "W2": (
            "lock= is Procrastinate's per-key mutex (one 'doing' job per lock, FIFO per lock). "
            "Finishing a job does not wake the workers (only an insert NOTIFYs), so the next job "
            "of a busy lock waits for the fetch polling interval: W2 runs with "
            "fetch_job_polling_interval=0.1 s instead of the default 5 s (with 5 s a quick run "
            "managed ~1.3 tasks/s on 1 key)."
        ),
        "W3": "n/a: Procrastinate has no start-rate limit.",
        "W4": (
            "not automatic: the documented periodic 'retry stalled jobs' task, run every 1 s with "
            "seconds_since_heartbeat = lease_seconds, heartbeat every lease/5 s, polling 1 s; "
            "tokens n/a."
        ),
        "W5": "fetch = procrastinate_fetch_job_v2 (the worker's fetch call), timed from the harness.",
    }
    W2_NODE_OPTIONS = {"polling": 0.1}
    CONFIG = {
        "worker_processes": 4,
        "concurrency_per_worker": 32,
        "listen_notify": True,
        "pool_per_worker": "psycopg_pool default (min_size=max_size=4)",
        "delete_jobs": "never",
        "submitters": "16 coroutines, defer_async, pool max 16",
        "fetch_job_polling_interval": "5 s default; W2 0.1 s; W4 1 s",
        "w4": "stalled-jobs recipe every 1 s, seconds_since_heartbeat=lease_seconds",
    }

    def __init__(self) -> None:
        self.dsn = ""
        self.lease = 10.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: procrastinate.App | None = None
        self._stack: contextlib.ExitStack | None = None
        self._worker_id: int | None = None
        self._recovery = False

    # --- lifecycle
    def setup(self, scale: dict) -> None:
        self.lease = float(scale.get("lease_seconds", 10))
        self.dsn = fresh_postgres(DB_NAME)
        self._loop = asyncio.new_event_loop()
        connector = procrastinate.PsycopgConnector(conninfo=self.dsn, min_size=1, max_size=16)
        self._stack = contextlib.ExitStack()
        self._client = self._stack.enter_context(app.replace_connector(connector))
        self._run(self._client.open_async())
        self._run(self._client.schema_manager.apply_schema_async())
        self._recovery = False

    def teardown(self) -> None:
        try:
            if self._client is not None and self._loop is not None:
                self._run(self._client.close_async())
        except Exception as exc:  # noqa: BLE001
            print(f"procrastinate: close: {exc!r}", file=sys.stderr)
        finally:
            if self._loop is not None:
                self._loop.close()
            if self._stack is not None:
                self._stack.close()
            self._loop = self._client = self._stack = None
            self._worker_id = None
        try:
            drop_postgres(DB_NAME)
        except Exception as exc:  # noqa: BLE001
            print(f"procrastinate: drop database: {exc!r}", file=sys.stderr)

    def _run(self, coro: Any) -> Any:
        assert self._loop is not None
        return self._loop.run_until_complete(coro)

    # --- workers
    def start_node(
        self, role: str, index: int, events: EventLog, polling: float | None = None, **_: Any
    ) -> subprocess.Popen:
        env = {
            **os.environ,
            **events.env(role),
            DSN_ENV: self.dsn,
            LEASE_ENV: str(self.lease),
            "BENCH_WORKER_NAME": f"{role}{index}",
        }
        if role in ("victim", "survivor"):
            env[RECOVERY_ENV] = "1"
        if polling is not None:
            env[POLLING_ENV] = str(polling)
        return spawn(
            [sys.executable, "-m", "bench.systems.procrastinate_system", "worker"],
            env=env,
            cwd=ROOT,
            log=events.directory / f"node-{role}{index}.out",
        )

    def node_ready(self, proc: subprocess.Popen, events: EventLog) -> bool:
        # R is written once the worker's pool is open; it registers and listens right after
        return proc.pid in events.ready and now() - events.ready[proc.pid][1] > 0.5

    # --- submission
    def submit_all(self, items: list[peerkit.Item], concurrency: int) -> dict[str, float]:
        names = {"noop": "bench.noop", "hold": "bench.hold"}
        client = self._client

        async def go() -> dict[str, float]:
            source = iter(items)
            submitted: dict[str, float] = {}

            async def submitter() -> None:
                for key, options in source:
                    name = names[options.get("kind", "noop")]
                    extra = {"lock": options["lock"]} if options.get("lock") else {}
                    at = now()
                    await client.configure_task(name, queue=QUEUE, **extra).defer_async(key=key)
                    submitted[key] = at

            await asyncio.gather(*(submitter() for _ in range(max(1, concurrency))))
            return submitted

        return self._run(go())

    def confirm_done(self, prefix: str, count: int) -> bool:
        rows = self._run(
            self._client.connector.execute_query_all_async(
                "SELECT count(*) AS n FROM procrastinate_jobs WHERE status = 'succeeded' "
                "AND args->>'key' LIKE %(pattern)s",
                pattern=f"{prefix}-%",
            )
        )
        return rows[0]["n"] >= count

    def clear_phase(self, prefix: str) -> None:
        self._run(
            self._client.connector.execute_query_async(
                "DELETE FROM procrastinate_jobs WHERE status = 'todo' AND args->>'key' LIKE %(pattern)s",
                pattern=f"{prefix}-%",
            )
        )

    # --- W5
    def preload_bulk(self, count: int) -> None:
        async def go() -> None:
            done = 0
            while done < count:
                chunk = min(50_000, count - done)
                await self._client.connector.execute_query_async(
                    "INSERT INTO procrastinate_jobs (queue_name, task_name, args) "
                    "SELECT %(queue)s, 'bench.noop', jsonb_build_object('key', 'bulk-' || g) "
                    "FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g",
                    queue=QUEUE,
                    first=done,
                    last=done + chunk - 1,
                )
                done += chunk
            await self._client.connector.execute_query_async("ANALYZE procrastinate_jobs")
            if self._worker_id is None:
                self._worker_id = await self._client.job_manager.register_worker()

        self._run(go())

    def fetch_once(self) -> None:
        job = self._run(self._client.job_manager.fetch_job(queues=[QUEUE], worker_id=self._worker_id))
        if job is None:
            raise RuntimeError("procrastinate W5: fetch returned no job")

    def clear_backlog(self) -> None:
        self._run(self._client.connector.execute_query_async("TRUNCATE procrastinate_jobs CASCADE"))


SYSTEM = ProcrastinatePeer()
NAME = SYSTEM.NAME
DURABILITY = SYSTEM.DURABILITY
WORKLOADS = SYSTEM.WORKLOADS
NOTES = SYSTEM.NOTES
CONFIG = SYSTEM.CONFIG
run = SYSTEM.run

if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    import logging

    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_worker_main())
