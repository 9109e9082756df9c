"""Celery 5 on RabbitMQ and on Redis (two systems: ``RABBITMQ`` and ``REDIS``).

This module is both the harness-side adapter and the Celery app the worker processes
load (``python -m celery -A bench.systems.celery_system:app worker``, from the repository root); the worker side is
configured from environment variables set by the adapter.

At-least-once settings: ``task_acks_late=True`` (ack after the task body) and
``task_reject_on_worker_lost=True``; no result backend (``task_ignore_result``), since
the bench never reads results. Worker nodes: 4 x ``--pool threads --concurrency 32``
(same process count and in-flight slots as Orbit's 4 connections x capacity 32),
prefetch multiplier 4 (Celery's default), ``--without-mingle --without-gossip``,
log level WARNING.

Brokers (on this machine's shared services):
- RabbitMQ: durable classic queue, persistent messages (delivery_mode 2, Celery's
  default) and publisher confirms (``confirm_publish``), so ``apply_async`` returns after
  the broker has taken responsibility for the message.
- Redis: db 13 (used by this bench only, flushed before and after each run), the server
  here runs with ``appendonly no`` and ``save ""``: nothing survives a Redis restart.
  ``visibility_timeout`` = the lease (scale["lease_seconds"]) and
  ``unacked_restore_interval`` = 1 s so a dead worker's messages come back at the same
  timescale as Orbit's lease (Celery's default visibility timeout is one hour).

W3: Celery's ``rate_limit`` is a token bucket *per worker node and task type*, not per
queue. The headline figures use the configuration that targets 50/s fleet-wide
(50/4 = 12.5/s on each of the 4 nodes); ``*_literal`` figures use ``rate_limit="50/s"``
on each node, which a reader of the option name might expect to mean 50/s total.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from typing import Any

from celery import Celery
from celery.signals import worker_ready

from bench.common import (
    ROLE_ENV,
    ROOT,
    EventLog,
    log_event,
    now,
    rate_metrics,
    spawn,
    wait_until,
    work_dir,
)
from bench.systems import peerkit

QUEUE_ENV = "BENCH_CELERY_QUEUE"
BROKER_ENV = "BENCH_CELERY_BROKER"
LEASE_ENV = "BENCH_LEASE_SECONDS"
RATE_ENV = "BENCH_RATE_LIMIT"
HOLD_SECONDS = 600.0  # how long a task sleeps on the W4 victim (it is killed long before)

REDIS_DB = 13
BROKERS = {
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672//",
    "redis": f"redis://127.0.0.1:6379/{REDIS_DB}",
}

app = Celery("bench", set_as_current=False)


def configure(broker: str, queue: str, lease_seconds: float) -> None:
    options: dict[str, Any] = (
        {"confirm_publish": True}
        if broker.startswith("amqp")
        else {"visibility_timeout": lease_seconds, "unacked_restore_interval": 1}
    )
    app.conf.update(
        broker_url=broker,
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        worker_prefetch_multiplier=4,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        task_default_delivery_mode="persistent",
    )


if os.environ.get(BROKER_ENV):  # worker side
    configure(os.environ[BROKER_ENV], os.environ[QUEUE_ENV], float(os.environ.get(LEASE_ENV, "10")))


@worker_ready.connect
def _ready(sender=None, **_: Any) -> None:
    log_event("R", getattr(sender, "hostname", "node"))


@app.task(name="bench.noop")
def noop(key: str) -> None:
    log_event("S", key)
    log_event("D", key)


@app.task(name="bench.hold")
def hold(key: str) -> None:
    log_event("S", key)
    if os.environ.get(ROLE_ENV) == "victim":
        time.sleep(HOLD_SECONDS)
    log_event("D", key)


@app.task(name="bench.rated", rate_limit=os.environ.get(RATE_ENV) or None)
def rated(key: str) -> None:
    log_event("S", key)
    log_event("D", key)


class CeleryPeer(peerkit.Peer):
    WORKLOADS = ("W1", "W3", "W4")
    NODE_CONCURRENCY = 32

    def __init__(self, broker: str):
        self.broker = broker
        self.NAME = f"celery-{broker}"
        self.SERVICES = (broker,)
        self.url = BROKERS[broker]
        if broker == "rabbitmq":
            self.DURABILITY = (
                "RabbitMQ durable classic queue, persistent messages, publisher confirms "
                "(submit returns after the broker confirmed); acks_late + "
                "reject_on_worker_lost: at-least-once; a dead worker's unacked messages "
                "are requeued when its connection drops"
            )
        else:
            self.DURABILITY = (
                'Redis with no persistence on this machine (appendonly no, save ""): a '
                "Redis restart loses every queued task; acks_late + reject_on_worker_lost; "
                "unacked messages are restored after visibility_timeout = lease_seconds"
            )
        self.NOTES = {
            "W0": "Orbit-only (MariaDB transaction ceiling).",
            "W2": "n/a: Celery has no per-key mutex.",
            "W3": (
                "rate_limit is per worker node and task type (token bucket, capacity 1), not "
                "per queue: headline = 12.5/s on each of 4 nodes (targets 50/s total); "
                "*_literal = rate_limit='50/s' on each node (would be up to 200/s total). "
                "With a prefetched backlog each waiting message holds a timer; kombu's "
                "Hub.fire_timers runs at most 10 due timers and then sleeps min_delay=1 s, so "
                "starts fall to about one per second per node (known: celery/celery#6845, "
                "#5927)."
            ),
            "W4": "tokens n/a (no fencing tokens); the victim node is SIGKILLed with its pool.",
            "W5": (
                "n/a: a broker queue pop has no selection query over the backlog "
                "(RabbitMQ/Redis deliver from the head), nothing comparable to a lease scan."
            ),
        }
        self.CONFIG = {
            "nodes": "4 (W1/W3); W4: 1 victim + 1 survivor",
            "pool": "threads",
            "concurrency_per_node": self.NODE_CONCURRENCY,
            "prefetch_multiplier": 4,
            "acks_late": True,
            "reject_on_worker_lost": True,
            "result_backend": None,
            "broker_transport_options": (
                {"confirm_publish": True}
                if broker == "rabbitmq"
                else {"visibility_timeout": "lease_seconds", "unacked_restore_interval": 1}
            ),
            "submitters": "threads calling send_task",
        }
        self.queue = ""
        self.lease = 10.0

    # --- lifecycle
    def setup(self, scale: dict) -> None:
        self.queue = f"bench-{uuid.uuid4().hex[:12]}"
        self.lease = float(scale.get("lease_seconds", 10))
        configure(self.url, self.queue, self.lease)
        if self.broker == "redis":
            self._flush_redis()
        else:
            self._drop_stale_queues()

    def _drop_stale_queues(self) -> None:
        """Queues of earlier runs that were killed before their teardown: this bench's own
        names (bench-<12 hex>) with no consumer left."""
        try:
            out = subprocess.run(
                ["rabbitmqctl", "-q", "list_queues", "name", "consumers"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        stale = [
            parts[0]
            for parts in (line.split() for line in out.splitlines())
            if len(parts) == 2 and re.fullmatch(r"bench-[0-9a-f]{12}", parts[0]) and parts[1] == "0"
        ]
        if stale:
            with app.connection_for_write() as conn:
                for name in stale:
                    conn.default_channel.queue_delete(name)
                    conn.default_channel.exchange_delete(name)

    def teardown(self) -> None:
        try:
            if self.broker == "rabbitmq":
                with app.connection_for_write() as conn:
                    channel = conn.default_channel
                    channel.queue_delete(self.queue)
                    channel.exchange_delete(self.queue)
            else:
                self._flush_redis()
        except Exception as exc:  # noqa: BLE001
            print(f"{self.NAME}: teardown: {exc!r}", file=sys.stderr)
        app.pool.force_close_all()

    def _flush_redis(self) -> None:
        import redis  # noqa: PLC0415

        client = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
        client.flushdb()
        client.close()

    # --- workers
    def start_node(
        self, role: str, index: int, events: EventLog, rate_limit: str | None = None, **_: Any
    ) -> subprocess.Popen:
        env = {
            **os.environ,
            **events.env(role),
            BROKER_ENV: self.url,
            QUEUE_ENV: self.queue,
            LEASE_ENV: str(self.lease),
        }
        if rate_limit:
            env[RATE_ENV] = rate_limit
        name = f"{role}{index}-{self.queue}@bench"
        cmd = [
            sys.executable, "-m", "celery", "-A", "bench.systems.celery_system:app", "worker",
            "--pool", os.environ.get("BENCH_CELERY_POOL", "threads"),
            "--concurrency", os.environ.get("BENCH_CELERY_CONCURRENCY", str(self.NODE_CONCURRENCY)),
            "--hostname", name, "--queues", self.queue,
            "--without-mingle", "--without-gossip", "--loglevel", "WARNING",
        ]  # fmt: skip
        return spawn(cmd, env=env, cwd=ROOT, log=events.directory / f"node-{role}{index}.out")

    # --- submission
    def submit_all(self, items: list[peerkit.Item], concurrency: int) -> dict[str, float]:
        names = {"noop": "bench.noop", "hold": "bench.hold", "rated": "bench.rated"}

        def submit_one(key: str, options: dict[str, Any]) -> None:
            app.send_task(names[options.get("kind", "noop")], args=[key], queue=self.queue)

        return peerkit.threaded_submit(submit_one, items, concurrency)

    # --- W3
    def run_w3(self, scale: dict) -> dict:
        deadline = peerkit.deadline_from(scale)
        rate = float(scale["rate"])
        seconds = float(scale["rate_seconds"])
        nodes = int(scale["workers"])
        result: dict[str, Any] = {}
        self.setup(scale)
        procs: list = []
        try:
            for label, per_node in (("", rate / nodes), ("_literal", rate)):
                events = EventLog(work_dir(f"{self.NAME}-w3{label}"))
                prefix = f"rate{label.strip('_') or 'split'}"
                # demand: 1.5x what the whole fleet could start, for the whole window
                demand = int(per_node * nodes * 1.5 * (seconds + 3)) + 100
                self.submit_all([(f"{prefix}-{i}", {"kind": "rated"}) for i in range(demand)], 16)
                procs = [self.start_node("w", i, events, rate_limit=f"{per_node:g}/s") for i in range(nodes)]
                # measure over `seconds` from 1 s after the last node reported ready
                if not wait_until(lambda ev=events: len(ev.poll().ready) >= nodes, 60, 0.05):
                    raise TimeoutError(f"{self.NAME} W3: workers not ready")
                first = max(at for _, at in events.ready.values()) + 1.0
                wait_s = first + seconds + 0.5 - now()
                if time.monotonic() + wait_s > deadline:
                    raise TimeoutError(f"{self.NAME} W3: not enough time left")
                time.sleep(max(0.0, wait_s))
                events.poll()
                starts = [t for k, runs in events.starts.items() if k.startswith(prefix) for t, _, _ in runs]
                metrics = rate_metrics(starts, rate, seconds, first)
                metrics["rate_limit_per_node"] = f"{per_node:g}/s"
                result.update({f"{k}{label}": v for k, v in metrics.items()})
                peerkit.stop_nodes(procs)
                procs = []
                self._purge()
            result["nodes"] = nodes
            result["seconds"] = seconds
            return result
        finally:
            peerkit.stop_nodes(procs)
            self.teardown()

    def _purge(self) -> None:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_purge(self.queue)


RABBITMQ = CeleryPeer("rabbitmq")
REDIS = CeleryPeer("redis")
