"""Orbit reliability harness: servers, workers, one private MariaDB, and chaos under load.

    .venv/bin/python reliability/harness.py            # full run (4.5 minutes of chaos)
    .venv/bin/python reliability/harness.py --short    # CI form (40 s of chaos; tests/chaos runs it)
    .venv/bin/python reliability/harness.py --seconds 600 --rate 30
    .venv/bin/python reliability/harness.py --short --cells   # on a directory and two cells

1. Starts a private MariaDB (reliability/mariadb.py: own datadir, port and socket; the
   shared server on 127.0.0.1:3306 is never touched), migrates a database, bootstraps a
   credential with `manage.py orbit_bootstrap` and creates a second queue and key policies
   (a capped prefix, a capped and rated prefix, the stopped-worker event's prefix).
2. Starts Orbit servers A and B on that database, each a node of `SERVER_PROCESSES` daphne
   processes on one socket (`python -m server.supervisor --processes 2`, `orbit serve`'s
   supervisor without its start-up checks; `kill -9 server` kills the node's process group)
   with SDK workers (reliability/worker.py) split across them, server C that serves the API
   only, and submitter threads that send keyed and unkeyed tasks to A and B with unique
   Idempotency-Keys, re-sending the same key and body after a 503 or a network error (plus
   concurrent twins and late replays), and pipelines of tasks that depend on tasks
   (reliability/pipelines.py: chains, fan-out/fan-in, a wide fan-out past the inline budget).
3. Chaos while the load continues: kill -9 a worker (back under a new worker_id), a worker
   stopped with SIGSTOP past its lease (its permits recovered, its late results and
   write refused), kill -9 a server (restarted), kill -9 MariaDB and a clean SIGTERM
   restart (same datadir and port),
   MariaDB frozen, and one server process frozen (SIGSTOP) inside a round's transaction
   with the application's counter row locked (MariaDB must end that transaction within
   seconds; the other node may refuse submits for FROZEN_NODE_BOUND_SECONDS at most);
   the full run adds a same-worker_id restart, a server started while the database is
   down, every server killed at once, an outage longer than a lease, and a handler that
   outlives its lease (its late write must be refused by the permit token). While the
   database is down every HTTP probe must answer 503 UNAVAILABLE within 5 s; once it is
   back each server must answer again by itself and work must resume. After each event
   the checks of `manage.py orbit_check` run in one consistent snapshot (snapshot_check.py).
4. Stops submitting, lets the work settle (bounded), drains the workers, stops the servers,
   runs `manage.py orbit_check` (exit 0 required) and its own checks: no accepted task lost,
   one task per idempotency key, never more permits held on a key than its capacity and
   one holder per (key, slot) (database attempts and the workers' ledgers), tokens strictly
   increasing per key, rated keys' Starts within their GCRA bound, business code only
   after Start, stale writes only from attempts that lost their lease, attempt counters from the rows;
   every dependent ran only after its dependencies ended (under CANCEL, after they succeeded;
   else it was cancelled with DEPENDENCY_FAILED), nothing left BLOCKED or left to settle.

--cells (SPEC §14): the private MariaDB holds a directory (the default database) and two
cells, a and b, given to every server and command as ORBIT_MYSQL_DSN and ORBIT_CELLS. The
chaos application above is placed in cell b, and every read the harness makes of its rows
reads cell b; a neighbour application in cell a has a steady load of its own through A and B
(a submitter, two SDK workers) under the same chaos. At the end, also: every neighbour task
accepted is there once and SUCCEEDED, its rows pass the same end checks, and each
application's rows are in its own cell only, none of a cell's tables in the directory.

Prints a summary (kept with every log in .local/chaos/last/) and exits 1 on any violation.
Everything it starts it stops; the private datadir is removed. See reliability/README.md.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import datetime
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reliability import checks  # noqa: E402
from reliability.checks import utc_ts  # noqa: E402
from reliability.mariadb import PrivateMariaDB, available, free_port  # noqa: E402
from reliability.pipelines import Pipelines  # noqa: E402

PYTHON = sys.executable
HERE = Path(__file__).resolve().parent
LOG_KEEP = ROOT / ".local" / "chaos" / "last"
DB_NAME = "orbit_chaos"  # the one database; with --cells, the directory
# --cells (SPEC §14): two cells beside the directory, each a database of the private MariaDB.
# The chaos application is placed in the second, not the first, so that none of its
# requests or rounds can work by falling back on the first cell; the neighbour application,
# with a load of its own, lives in the first.
CELLS = ("a", "b")
CHAOS_CELL, NEIGHBOUR_CELL = "b", "a"
# Tables of an application's own rows named in the placement figures (every table with an
# application_id column is checked).
PLACED_TABLES = ("orbit_task", "orbit_attempt", "orbit_queue")
# The neighbour's leases outlast every event that can stall its workers' connections
# (MariaDB frozen 10 s or held down 13 s, a server process frozen 10 s), and its workers are
# never killed: none of its attempts can lose its lease, so each of its tasks must succeed.
NEIGHBOUR_LEASE_SECONDS = 30
NEIGHBOUR_KEY_PREFIX = "neighbour/resource-"
NEIGHBOUR_SEED_INDEX = 700  # its submitter's random stream, apart from the chaos submitters'
UNSETTLED = ("WAITING", "LEASED", "RUNNING")
PROBE_TIMEOUT = 5.0  # a request while the database is down must be answered within this
# A server process frozen inside a transaction: the other node may refuse submits only
# this long after the freeze (the idle-transaction limit, 3 s, plus the request deadline).
FROZEN_NODE_BOUND_SECONDS = 8.0
# Key policies the setup makes (SPEC §12): each prefix applies to every matching key on its own.
CAP_PREFIX, CAP_CAPACITY = "chaos/cap/", 3
RATED_PREFIX, RATED_CAPACITY = "chaos/rated/", 2
RATED_RATE = {"starts": 5, "per_seconds": 1, "burst": 2}
# The keys of the stopped-worker event: two permits, one held by the stopped worker.
STOP_PREFIX, STOP_CAPACITY = "chaos/stop/", 2


def cell_database(cell: str) -> str:
    return f"{DB_NAME}_{cell}"


def log(message: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"[chaos {stamp}] {message}", flush=True)


# --------------------------------------------------------------------------- configuration


@dataclass
class Config:
    short: bool
    seconds: float
    workers: int = 4
    capacity: int = 4
    submitters: int = 3
    rate: float = 12.0  # submitted tasks per second, all submitters together
    keys: int = 8
    keyed_share: float = 0.55
    # Keys with a policy (SPEC §12), made at setup: of the keyed tasks, these shares go to
    # `chaos/cap/<n>` (capacity CAP_CAPACITY) and `chaos/rated/<n>` (capacity RATED_CAPACITY
    # and RATED_RATE); the rest to the capacity-1 keys `chaos/resource-<n>`.
    cap_keys: int = 3
    cap_share: float = 0.25
    rated_keys: int = 2
    rated_share: float = 0.15
    # Every burst_every seconds burst_size tasks at once on one capped or one rated key (in
    # turn), so the capacity and the rate bind, not only the load's chance.
    burst_every: float = 4.0
    burst_size: int = 6
    long_share: float = 0.12  # tasks that sleep 1-2.5 s, so chaos lands mid-execution
    fail_first_share: float = 0.05
    twin_share: float = 0.08  # same key + body to both servers concurrently
    replay_share: float = 0.08  # same key + body again after acceptance
    lease_seconds: int = 10
    db_down_seconds: float = 3.0
    settle_seconds: float = 90.0
    warmup_seconds: float = 4.0
    seed: int = 0
    inject_faults: bool = False
    # Longer than a request's deadline (4.5 s): a request that waited on the
    # frozen server instead of answering 503 shows as a slow answer.
    freeze_seconds: float = 10.0
    # A pipeline (SPEC §13: chain, fan-out/fan-in, wide fan-out; reliability/pipelines.py)
    # submitted this often, besides the load.
    pipeline_every: float = 3.0
    # --cells: the directory and two cells; the chaos application in cell b, and a neighbour
    # application in cell a with its own steady load and workers, through servers A and B.
    cells: bool = False
    neighbour_rate: float = 3.0  # tasks per second
    neighbour_workers: int = 2
    neighbour_capacity: int = 2
    neighbour_keys: int = 4  # capacity-1 keys `neighbour/resource-<n>`
    neighbour_keyed_share: float = 0.5


# --------------------------------------------------------------------------- processes


class Processes:
    """Every child process the harness starts, so cleanup can always find them."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []
        self.groups: set[int] = set()  # pids that lead a process group of their own (server nodes)
        self.lock = threading.Lock()

    def popen(self, args: list[str], log_path: Path, env: dict[str, str], group: bool = False) -> subprocess.Popen:
        """`group`: the child leads a new process group (a server node: its supervisor and
        every daphne process it starts), ended as one by `kill`."""
        log_file = open(log_path, "a")  # noqa: SIM115 - handed to the child
        process = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=group
        )
        log_file.close()
        with self.lock:
            self.children.append(process)
            if group:
                self.groups.add(process.pid)
        return process

    def kill(self, process: subprocess.Popen) -> None:
        """SIGKILL to the process, or to its whole group when it leads one. Only while the
        process is not yet reaped (returncode None): until then its pid, and so its group's
        id, cannot belong to anything else."""
        if process.returncode is not None:
            return
        if process.pid in self.groups:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif process.poll() is None:
            process.kill()

    def kill_all(self) -> None:
        with self.lock:
            children = list(self.children)
        for process in children:
            self.kill(process)
        for process in children:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


# Each server node runs this many daphne processes on its one address (server/supervisor.py).
SERVER_PROCESSES = 2
START_LINE = b"orbit: serving on "


class Server:
    def __init__(self, name: str, procs: Processes, env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs = procs
        self.env = {**env, "ORBIT_HTTP_ADDR": f"127.0.0.1:{self.port}"}
        self.log_path = logs / f"server-{name}.log"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 60.0) -> float:
        began = time.monotonic()
        self.starts += 1
        with open(self.log_path, "a") as out:
            out.write(f"\n==== start #{self.starts} at {time.strftime('%H:%M:%S')} ====\n")
        offset = self.log_path.stat().st_size
        self.process = self.procs.popen(
            [
                PYTHON,
                "-m",
                "server.supervisor",
                "--processes",
                str(SERVER_PROCESSES),
                "-b",
                "127.0.0.1",
                "-p",
                str(self.port),
                "orbit.asgi:application",
            ],
            self.log_path,
            self.env,
            group=True,
        )
        # The supervisor's socket accepts connections at once; the node serves once every
        # process listens, which its start-up line says.
        while time.monotonic() - began < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"server {self.name} exited; see {self.log_path}")
            with open(self.log_path, "rb") as log_file:
                log_file.seek(offset)
                if START_LINE in log_file.read():
                    return time.monotonic() - began
            time.sleep(0.05)
        raise RuntimeError(f"server {self.name} did not listen within {timeout:.0f} s")

    def stop(self, kill: bool = False) -> None:
        """SIGTERM to the supervisor (it stops its processes gracefully), or kill -9 the
        whole node: the supervisor's process group."""
        process = self.process
        if process is None or process.returncode is not None:
            return
        if kill:
            self.procs.kill(process)
        elif process.poll() is None:
            process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.procs.kill(process)
            process.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and port_open(self.port):
            time.sleep(0.05)


class WorkerSlot:
    """One worker position; each (re)start is a new process under a new worker_id. `work`
    holds its ledgers, fenced resources and logs; `application` names it in its worker_id."""

    def __init__(
        self,
        index: int,
        server: Server,
        queues: list[str],
        run_id: str,
        procs: Processes,
        env: dict,
        work: Path,
        application: str = "chaos",
    ) -> None:
        self.index = index
        self.application = application
        self.server = server
        self.queues = queues
        self.run_id = run_id
        self.procs = procs
        self.env = env
        self.work = work
        self.incarnation = 0
        self.process: subprocess.Popen | None = None
        self.worker_id = ""
        # (worker_id, pid) -> wall time that process was killed (ends its open ledger intervals)
        self.killed_at: dict[tuple[str, int], float] = {}

    def start(self, capacity: int, credentials: Path, same_id: bool = False) -> None:
        """A new process; under a new worker_id unless `same_id` (a restart that keeps its identity)."""
        self.incarnation += 1
        if not same_id or not self.worker_id:
            self.worker_id = f"{self.application}-{self.run_id}-w{self.index}-{self.incarnation}"
        self.process = self.procs.popen(
            [
                PYTHON,
                str(HERE / "worker.py"),
                "--url",
                self.server.url,
                "--token-file",
                str(credentials),
                "--queues",
                ",".join(self.queues),
                "--worker-id",
                self.worker_id,
                "--capacity",
                str(capacity),
                "--ledger",
                str(self.work / "ledgers" / f"w{self.index}-{self.incarnation}.jsonl"),
                "--resources",
                str(self.work / "resources"),
            ],
            self.work / "logs" / f"worker-{self.index}.log",
            self.env,
        )

    def kill(self) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
            self.killed_at[(self.worker_id, process.pid)] = time.time()

    def drain(self, timeout: float) -> bool:
        process = self.process
        if process is None or process.poll() is not None:
            return True
        process.terminate()  # the worker drains on SIGTERM
        try:
            process.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            self.kill()
            return False


# --------------------------------------------------------------------------- load


@dataclass
class SubmitStats:
    accepted: dict[str, str] = field(default_factory=dict)  # idempotency key -> task id
    bodies: dict[str, dict] = field(default_factory=dict)
    deduplicated: int = 0  # answers that were replays (twins, late replays, retries after a lost answer)
    twins: int = 0  # keys sent to both servers at once
    replays: int = 0  # keys sent again after their acceptance
    statuses: collections.Counter = field(default_factory=collections.Counter)
    retries: int = 0
    given_up: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    slow: list[str] = field(default_factory=list)
    # While set (an event watches the submits it spans): answers by status and the slowest.
    watch: dict[str, Any] | None = None
    # While set: every answer as (server name, sent at (monotonic), status).
    answers: list[tuple[str, float, int]] | None = None
    # A server with a process stopped on purpose (freeze_node): its slow answers are expected.
    frozen: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class Submitter:
    """Threads that submit tasks to both servers, each key re-sent until it is accepted."""

    def __init__(self, cfg: Config, run_id: str, servers: list[Server], token: str, queues: list[str]) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.servers = servers
        self.token = token
        self.queues = queues
        self.stats = SubmitStats()
        self.stop = threading.Event()
        self.abandon = threading.Event()  # give up on keys still being retried
        self.sequence = itertools.count()
        self.threads: list[threading.Thread] = []

    def body_for(self, n: int, rng: random.Random) -> tuple[str, dict]:
        cfg = self.cfg
        key = f"chaos-{self.run_id}-{n:06d}"
        long_task = rng.random() < cfg.long_share
        payload = {
            "idem": key,
            "n": n,
            "sleep_ms": rng.randint(1000, 2500) if long_task else rng.randint(20, 200),
        }
        if rng.random() < cfg.fail_first_share:
            payload["fail_first"] = True
        body: dict[str, Any] = {
            "queue_id": self.queues[n % len(self.queues)],
            "handler": "chaos.work",
            "handler_version": "v1",
            "payload_version": "v1",
            "payload": payload,
            "priority": rng.randint(3, 7),
            "lease_seconds": cfg.lease_seconds,
            "max_attempts": 3,
            "retry": {"initial_seconds": 0.2, "multiplier": 2, "max_seconds": 2},
        }
        if rng.random() < cfg.keyed_share:
            family = rng.random()
            if family < cfg.cap_share:
                body["concurrency_key"] = f"{CAP_PREFIX}{rng.randrange(cfg.cap_keys)}"
            elif family < cfg.cap_share + cfg.rated_share:
                body["concurrency_key"] = f"{RATED_PREFIX}{rng.randrange(cfg.rated_keys)}"
            else:
                body["concurrency_key"] = f"chaos/resource-{rng.randrange(cfg.keys)}"
        return key, body

    def post_until_answered(self, client: httpx.Client, first: int, key: str, body: dict) -> dict | None:
        """POST until the server accepts or replays (its `data`); None when told to give up.

        Each retry goes to the other server with the same key and body, so a request whose
        answer was lost (server killed, database gone mid-commit) is de-duplicated there."""
        stats = self.stats
        tries = 0
        while not self.abandon.is_set():
            server = self.servers[(first + tries) % len(self.servers)]
            tries += 1
            began = time.monotonic()
            try:
                response = client.post(
                    server.url + "/v1/tasks",
                    json=body,
                    headers={"Idempotency-Key": key, "Authorization": f"Bearer {self.token}"},
                )
            except httpx.HTTPError as exc:
                with stats.lock:
                    stats.statuses[f"network:{type(exc).__name__}"] += 1
                    stats.retries += 1
                time.sleep(0.2)
                continue
            elapsed = time.monotonic() - began
            status = response.status_code
            with stats.lock:
                stats.statuses[str(status)] += 1
                if stats.answers is not None:
                    stats.answers.append((server.name, began, status))
                if stats.watch is not None:
                    stats.watch[str(status)] = stats.watch.get(str(status), 0) + 1
                    stats.watch["worst_s"] = round(max(stats.watch.get("worst_s", 0.0), elapsed), 3)
                if elapsed > PROBE_TIMEOUT and server.name != stats.frozen:
                    stats.slow.append(f"POST {key} to {server.name}: {status} after {elapsed:.1f} s")
            if status in (200, 201):
                data = response.json()["data"]
                if (status == 200) != bool(data.get("deduplicated")):
                    with stats.lock:
                        stats.unexpected.append(
                            f"POST {key}: HTTP {status} with deduplicated={data.get('deduplicated')}"
                        )
                return data
            code = _error_code(response)
            if status == 503 and code == "UNAVAILABLE":
                with stats.lock:
                    stats.retries += 1
                time.sleep(0.2)
                continue
            if status == 429:
                time.sleep(1.0)
                continue
            with stats.lock:
                stats.unexpected.append(f"POST {key} to {server.name}: HTTP {status} {response.text[:300]}")
            if status >= 500:  # INTERNAL is a finding, but the request may still be retried
                time.sleep(0.2)
                continue
            return None
        return None

    def submit_one(self, client: httpx.Client, n: int, key: str, body: dict, rng: random.Random) -> None:
        stats = self.stats
        with stats.lock:
            stats.bodies[key] = body
        answers: list[dict | None] = []
        if rng.random() < self.cfg.twin_share:
            # Concurrent twins: the same key and body to both servers at once; one effect only.
            def twin() -> None:
                with httpx.Client(timeout=client.timeout) as other:
                    answers.append(self.post_until_answered(other, n + 1, key, body))

            thread = threading.Thread(target=twin, daemon=True)
            thread.start()
            answers.append(self.post_until_answered(client, n, key, body))
            thread.join()
            with stats.lock:
                stats.twins += 1
        else:
            answers.append(self.post_until_answered(client, n, key, body))
        if answers[0] is not None and rng.random() < self.cfg.replay_share:
            # A late replay of an accepted request, to the other server: the original receipt.
            replay = self.post_until_answered(client, n + 1, key, body)
            if replay is not None and not replay.get("deduplicated"):
                with stats.lock:
                    stats.unexpected.append(f"replay of {key} was not deduplicated: {replay}")
            answers.append(replay)
            with stats.lock:
                stats.replays += 1
        got = [a for a in answers if a is not None]
        if not got:
            with stats.lock:
                stats.given_up.append(key)
            return
        ids = {a["task"]["id"] for a in got}
        with stats.lock:
            if len(ids) != 1:
                stats.unexpected.append(f"idempotency key {key} answered with different tasks {sorted(ids)}")
            if sum(1 for a in got if not a.get("deduplicated")) > 1:
                stats.unexpected.append(f"idempotency key {key}: two answers both say 201 (two effects)")
            stats.accepted[key] = got[0]["task"]["id"]
            stats.deduplicated += sum(1 for a in got if a.get("deduplicated"))

    def interval(self) -> float:
        """Seconds between one thread's submits: the rate shared by every submitter thread."""
        return self.cfg.submitters / self.cfg.rate

    def loop(self, index: int) -> None:
        rng = random.Random(self.cfg.seed * 1000 + index)
        interval = self.interval()
        timeout = httpx.Timeout(PROBE_TIMEOUT + 3, connect=2.0)
        with httpx.Client(timeout=timeout) as client:
            next_at = time.monotonic()
            while not self.stop.is_set():
                n = next(self.sequence)
                key, body = self.body_for(n, rng)
                self.submit_one(client, n, key, body, rng)
                next_at = max(next_at + interval, time.monotonic() - interval)
                self.stop.wait(max(0.0, next_at - time.monotonic()))

    def bursts(self) -> None:
        """burst_size tasks sent at once on one key, a capped one and a rated one in turn,
        each held 0.3-0.8 s: more than the key's permits or its start room."""
        cfg = self.cfg
        rng = random.Random(cfg.seed * 1000 + 999)
        timeout = httpx.Timeout(PROBE_TIMEOUT + 3, connect=2.0)
        for turn in itertools.count():
            if self.stop.wait(cfg.burst_every):
                return
            if turn % 2 == 0:
                key = f"{CAP_PREFIX}{rng.randrange(cfg.cap_keys)}"
            else:
                key = f"{RATED_PREFIX}{rng.randrange(cfg.rated_keys)}"
            sends = []
            for _ in range(cfg.burst_size):
                n = next(self.sequence)
                idem, body = self.body_for(n, rng)
                body["concurrency_key"] = key
                body["payload"]["sleep_ms"] = rng.randint(300, 800)
                seed = rng.randrange(1 << 30)

                def send(n: int = n, idem: str = idem, body: dict = body, seed: int = seed) -> None:
                    with httpx.Client(timeout=timeout) as client:
                        self.submit_one(client, n, idem, body, random.Random(seed))

                sends.append(threading.Thread(target=send, name=f"burst-{n}", daemon=True))
            for thread in sends:
                thread.start()
            for thread in sends:
                thread.join()

    def start(self) -> None:
        for index in range(self.cfg.submitters):
            thread = threading.Thread(target=self.loop, args=(index,), name=f"submitter-{index}", daemon=True)
            thread.start()
            self.threads.append(thread)
        thread = threading.Thread(target=self.bursts, name="bursts", daemon=True)
        thread.start()
        self.threads.append(thread)

    def finish(self, timeout: float) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.1, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self.threads):
            self.abandon.set()
            for thread in self.threads:
                thread.join(10)


class NeighbourSubmitter(Submitter):
    """--cells: the neighbour application's load, one thread sending to A and B in turn, a
    task every 1 / neighbour_rate s: unkeyed, or on a capacity-1 key, each Idempotency-Key
    re-sent with the same body after a 503 or a network error as the chaos submitters do
    (twins and late replays too). No bursts and no failing handlers: every task it sees
    accepted must end SUCCEEDED."""

    def body_for(self, n: int, rng: random.Random) -> tuple[str, dict]:
        cfg = self.cfg
        key = f"neighbour-{self.run_id}-{n:06d}"
        body: dict[str, Any] = {
            "queue_id": self.queues[0],
            "handler": "chaos.work",
            "handler_version": "v1",
            "payload_version": "v1",
            "payload": {"idem": key, "n": n, "sleep_ms": rng.randint(20, 150)},
            "priority": rng.randint(3, 7),
            "lease_seconds": NEIGHBOUR_LEASE_SECONDS,
            "max_attempts": 3,
            "retry": {"initial_seconds": 0.2, "multiplier": 2, "max_seconds": 2},
        }
        if rng.random() < cfg.neighbour_keyed_share:
            body["concurrency_key"] = f"{NEIGHBOUR_KEY_PREFIX}{rng.randrange(cfg.neighbour_keys)}"
        return key, body

    def interval(self) -> float:
        return 1.0 / self.cfg.neighbour_rate

    def start(self) -> None:
        thread = threading.Thread(
            target=self.loop, args=(NEIGHBOUR_SEED_INDEX,), name="neighbour-submitter", daemon=True
        )
        thread.start()
        self.threads.append(thread)


@dataclass
class Neighbour:
    """--cells: the application in cell a beside the chaos one, with its own load and workers."""

    application_id: str
    namespace_id: str
    work: Path  # its credentials, and its workers' ledgers, fenced resources and logs
    submitter: NeighbourSubmitter
    slots: list[WorkerSlot]


def _error_code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------- the run


class Harness:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.run_id = uuid.uuid4().hex[:8]
        base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
        self.work = Path(tempfile.mkdtemp(prefix=f"orbit-chaos-{self.run_id}-", dir=base))
        os.chmod(self.work, 0o755)  # the private mysqld (user mysql) must reach its datadir
        for sub in ("logs", "ledgers", "resources"):
            (self.work / sub).mkdir()
        self.db = PrivateMariaDB(self.work / "mariadb")
        # Where the chaos application's rows are: the one database, or with --cells its cell's.
        self.chaos_database = cell_database(CHAOS_CELL) if cfg.cells else DB_NAME
        self.neighbour: Neighbour | None = None
        self.procs = Processes()
        self.servers: list[Server] = []
        self.api_server: Server | None = None
        self.slots: list[WorkerSlot] = []
        self.submitter: Submitter | None = None
        self.pipelines: Pipelines | None = None
        self.violations: list[str] = []
        self.notes: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}
        self.began = time.monotonic()
        self.plain_check_noise = 0
        self.summary_path: Path | None = None
        self.killed_workers: list[tuple[str, float]] = []
        self._cleaned = False

    # -- helpers ---------------------------------------------------------------

    def violation(self, message: str) -> None:
        log(f"VIOLATION: {message}")
        self.violations.append(message)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "ORBIT_MYSQL_DSN": self.db.dsn(DB_NAME),
                "ORBIT_MAINTENANCE": "1",
                "ORBIT_LOG_LEVEL": "WARNING",
                "PYTHONUNBUFFERED": "1",
                "DJANGO_SETTINGS_MODULE": "server.settings",
            }
        )
        env.pop("ORBIT_SQLITE_PATH", None)
        # The cells are the harness's own databases, never ones the caller's environment names.
        env.pop("ORBIT_CELLS", None)
        if self.cfg.cells:
            env["ORBIT_CELLS"] = json.dumps({cell: self.db.dsn(cell_database(cell)) for cell in CELLS})
        return env

    def manage(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PYTHON, "manage.py", *args], cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    def query(self, sql: str, params: tuple = (), database: str | None = None) -> list[tuple]:
        """Reads `database`, by default the one holding the chaos application's rows."""
        conn = self.db.connect(database or self.chaos_database)
        try:
            cursor = conn.cursor()
            cursor.execute(sql, params)
            return list(cursor.fetchall())
        finally:
            conn.close()

    def wait_until(self, condition: Any, timeout: float, interval: float = 0.1) -> float | None:
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            try:
                if condition():
                    return time.monotonic() - began
            except Exception:  # noqa: BLE001 - the database may still be coming back
                pass
            time.sleep(interval)
        return None

    def get(self, server: Server, timeout: float = PROBE_TIMEOUT) -> tuple[int | None, str | None, float]:
        """GET a queue on `server`: (status, error code, seconds)."""
        began = time.monotonic()
        try:
            response = httpx.get(
                f"{server.url}/v1/queues/{self.queues[0]}",
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=timeout,
            )
        except httpx.HTTPError as exc:
            return None, type(exc).__name__, time.monotonic() - began
        return response.status_code, _error_code(response), time.monotonic() - began

    def serving(self, server: Server) -> bool:
        return self.get(server, timeout=2.0)[0] == 200

    def serving_steadily(self, server: Server) -> bool:
        """Three answers in a row are 200 (one lucky request on a fresh connection is not recovery)."""
        return all(self.serving(server) for _ in range(3))

    @property
    def every_server(self) -> list[Server]:
        return [*self.servers, *([self.api_server] if self.api_server else [])]

    # -- setup -----------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        seconds = self.db.start()
        log(f"private MariaDB on 127.0.0.1:{self.db.port} (datadir {self.db.datadir}) up in {seconds:.1f} s")
        self.db.create_database(DB_NAME)
        if cfg.cells:
            for cell in CELLS:
                self.db.create_database(cell_database(cell))
        began = time.monotonic()
        # With cells, migrate from the command line migrates the directory and every cell.
        result = self.manage("migrate", "-v0", timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"migrate failed:\n{result.stdout}\n{result.stderr}")
        log(f"migrated in {time.monotonic() - began:.1f} s")
        if cfg.cells:
            log(
                f"cells: directory {DB_NAME}, "
                + ", ".join(f"{cell} {cell_database(cell)}" for cell in CELLS)
                + f"; chaos application in cell {CHAOS_CELL}, neighbour in cell {NEIGHBOUR_CELL}"
            )
        self.credentials = self.work / "credentials.json"
        creds = self.bootstrap("chaos", self.credentials, CHAOS_CELL if cfg.cells else None)
        self.token = creds["token"]
        self.application_id = creds["application_id"]
        self.namespace_id = creds["namespace_id"]
        self.queues = [creds["queue_id"]]

        env = self.env()
        self.servers = [Server(name, self.procs, env, self.work / "logs") for name in ("A", "B")]
        # C serves the API only: no worker connects to it and no submitter writes through it, so
        # nothing but its own HTTP requests can heal it after a database restart.
        self.api_server = Server("C", self.procs, env, self.work / "logs")
        for server in self.every_server:
            seconds = server.start()
            log(f"server {server.name} on {server.url} listening after {seconds:.1f} s")
        response = httpx.post(
            f"{self.servers[0].url}/v1/queues",
            json={"name": "chaos-2", "max_concurrency": 16, "rate_per_second": 200},
            headers={"Authorization": f"Bearer {self.token}", "Idempotency-Key": f"chaos-{self.run_id}-queue-2"},
            timeout=10,
        )
        if response.status_code != 201:
            raise RuntimeError(f"creating queue chaos-2 failed: {response.status_code} {response.text}")
        self.queues.append(response.json()["data"]["queue"]["id"])
        self.make_key_policies()
        if not self.serving(self.api_server):  # its pool threads now hold connections
            raise RuntimeError("server C does not answer")

        worker_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        queue_sets = [self.queues, self.queues[:1], self.queues, self.queues[1:]]
        for index in range(cfg.workers):
            server = self.servers[index % len(self.servers)]
            slot = WorkerSlot(
                index, server, queue_sets[index % len(queue_sets)], self.run_id, self.procs, worker_env, self.work
            )
            slot.start(cfg.capacity, self.credentials)
            self.slots.append(slot)
        self.submitter = Submitter(cfg, self.run_id, self.servers, self.token, self.queues)
        self.pipelines = Pipelines(self, self.chaos_database)
        log(
            f"{cfg.workers} workers (capacity {cfg.capacity}) on servers "
            + ", ".join(f"w{s.index}->{s.server.name}" for s in self.slots)
            + f"; submitting about {cfg.rate:.0f} tasks/s"
        )
        if cfg.cells:
            self.neighbour = self.setup_neighbour(worker_env)

    def bootstrap(self, name: str, credentials: Path, cell: str | None) -> dict[str, Any]:
        """`orbit_bootstrap` of the application `name` (namespace and environment `name`, queue
        `<name>-1`, workers allowed), in `cell` if given; the credentials file it wrote."""
        result = self.manage(
            "orbit_bootstrap",
            "--application", name, "--namespace", name, "--environment", name, "--queue", f"{name}-1",
            "--max-concurrency", "16", "--rate-per-second", "200", "--worker-access",
            "--output", str(credentials), *(["--cell", cell] if cell is not None else []),
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"orbit_bootstrap of {name} failed:\n{result.stdout}\n{result.stderr}")
        return dict(json.loads(credentials.read_text()))

    def setup_neighbour(self, worker_env: dict[str, str]) -> Neighbour:
        """--cells: a second application, placed in cell a, with its own queue, SDK workers
        (one per server A and B) and submitter; its ledgers and resources kept apart."""
        cfg = self.cfg
        work = self.work / "neighbour"
        for sub in ("logs", "ledgers", "resources"):
            (work / sub).mkdir(parents=True)
        credentials = work / "credentials.json"
        creds = self.bootstrap("neighbour", credentials, NEIGHBOUR_CELL)
        slots = []
        for index in range(cfg.neighbour_workers):
            server = self.servers[index % len(self.servers)]
            slot = WorkerSlot(
                index, server, [creds["queue_id"]], self.run_id, self.procs, worker_env, work, application="neighbour"
            )
            slot.start(cfg.neighbour_capacity, credentials)
            slots.append(slot)
        submitter = NeighbourSubmitter(cfg, self.run_id, self.servers, creds["token"], [creds["queue_id"]])
        log(
            f"neighbour application in cell {NEIGHBOUR_CELL}: {len(slots)} workers (capacity "
            f"{cfg.neighbour_capacity}) on servers "
            + ", ".join(f"w{s.index}->{s.server.name}" for s in slots)
            + f"; submitting about {cfg.neighbour_rate:g} tasks/s"
        )
        return Neighbour(creds["application_id"], creds["namespace_id"], work, submitter, slots)

    def make_key_policies(self) -> None:
        """The key policies (SPEC §12) the load's capped and rated keys, and the stopped-worker
        event's keys, run under; over HTTP, as any client makes them."""
        policies = [
            {"match": {"prefix": CAP_PREFIX}, "capacity": CAP_CAPACITY},
            {"match": {"prefix": RATED_PREFIX}, "capacity": RATED_CAPACITY, "rate": RATED_RATE},
            {"match": {"prefix": STOP_PREFIX}, "capacity": STOP_CAPACITY},
        ]
        for index, policy in enumerate(policies):
            response = httpx.post(
                f"{self.servers[0].url}/v1/key-policies",
                json={**policy, "reason": "chaos harness"},
                headers={
                    "Authorization": f"Bearer {self.token}",
                    "Idempotency-Key": f"chaos-{self.run_id}-policy-{index}",
                },
                timeout=10,
            )
            if response.status_code != 201:
                raise RuntimeError(f"creating key policy {policy} failed: {response.status_code} {response.text}")
        log(
            f"key policies: {CAP_PREFIX}* capacity {CAP_CAPACITY}; {RATED_PREFIX}* capacity {RATED_CAPACITY}, "
            f"rate {RATED_RATE}; {STOP_PREFIX}* capacity {STOP_CAPACITY}"
        )

    # -- measurements ----------------------------------------------------------

    def succeeded_after(self, wall: float) -> bool:
        moment = datetime.datetime.fromtimestamp(wall, datetime.UTC).replace(tzinfo=None)
        rows = self.query("SELECT COUNT(*) FROM orbit_attempt WHERE state='SUCCEEDED' AND finished_at > %s", (moment,))
        return rows[0][0] > 0

    def connected_after(self, worker_ids: list[str], wall: float) -> bool:
        if not worker_ids:
            return True
        moment = datetime.datetime.fromtimestamp(wall, datetime.UTC).replace(tzinfo=None)
        marks = ",".join(["%s"] * len(worker_ids))
        rows = self.query(
            f"SELECT COUNT(*) FROM orbit_worker_identity WHERE worker_id IN ({marks}) AND connected_at > %s",
            (*worker_ids, moment),
        )
        return rows[0][0] == len(worker_ids)

    def snapshot_check(self, label: str) -> None:
        result = subprocess.run(
            [PYTHON, str(HERE / "snapshot_check.py")],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            self.violation(f"invariants after {label}: {(result.stderr or result.stdout).strip()[:2000]}")
            return
        # The plain command too, load still running: its separate READ COMMITTED reads can see a
        # commit between two queries, so a report here that the snapshot does not confirm is noted,
        # not counted.
        plain = self.manage("orbit_check")
        if plain.returncode != 0:
            self.plain_check_noise += 1
            self.notes.append(
                f"plain orbit_check under load after {label} reported (snapshot says ok): "
                + " | ".join(plain.stderr.strip().splitlines()[:3])
            )
        log(f"invariants after {label}: ok (snapshot); plain orbit_check under load exit {plain.returncode}")

    def rows_check(self, label: str) -> None:
        """So far: every task the client saw accepted exists, and no idempotency key has two
        tasks; with --cells, of the neighbour (in its cell) too."""
        assert self.submitter is not None
        self.accepted_rows_check(f"after {label}", self.submitter.stats, self.namespace_id, self.chaos_database)
        if self.neighbour is not None:
            self.accepted_rows_check(
                f"neighbour, after {label}",
                self.neighbour.submitter.stats,
                self.neighbour.namespace_id,
                cell_database(NEIGHBOUR_CELL),
            )

    def accepted_rows_check(self, label: str, stats: SubmitStats, namespace_id: str, database: str) -> None:
        with stats.lock:
            accepted = set(stats.accepted.values())
        present = {
            row[0]
            for row in self.query("SELECT id FROM orbit_task WHERE namespace_id=%s", (namespace_id,), database=database)
        }
        lost = accepted - present
        if lost:
            self.violation(f"{label}: {len(lost)} accepted tasks missing, e.g. {sorted(lost)[:3]}")
        twins = self.query(
            "SELECT JSON_UNQUOTE(JSON_EXTRACT(payload, '$.idem')) k, COUNT(*) FROM orbit_task "
            "WHERE namespace_id=%s GROUP BY k HAVING COUNT(*) > 1",
            (namespace_id,),
            database=database,
        )
        if twins:
            self.violation(f"{label}: idempotency keys with several tasks: {twins[:3]}")

    def probe_outage(self, until: float, event: dict[str, Any]) -> None:
        """While the database is down: every probe answers 503 UNAVAILABLE within PROBE_TIMEOUT."""
        probes, worst = 0, 0.0
        submit_probe_done = False
        while time.monotonic() < until:
            for server in self.every_server:
                if server.process is None or server.process.poll() is not None or not port_open(server.port):
                    continue
                status, code, seconds = self.get(server, timeout=PROBE_TIMEOUT + 3)
                probes += 1
                worst = max(worst, seconds)
                if status != 503 or code != "UNAVAILABLE" or seconds > PROBE_TIMEOUT:
                    self.violation(
                        f"{event['name']}: GET on server {server.name} while the database is down answered "
                        f"{status} {code} after {seconds:.2f} s (want 503 UNAVAILABLE within {PROBE_TIMEOUT:.0f} s)"
                    )
                if not submit_probe_done:
                    submit_probe_done = True
                    began = time.monotonic()
                    try:
                        response = httpx.post(
                            server.url + "/v1/tasks",
                            json={"queue_id": self.queues[0]},
                            headers={
                                "Authorization": f"Bearer {self.token}",
                                "Idempotency-Key": f"probe-{uuid.uuid4().hex}",
                            },
                            timeout=PROBE_TIMEOUT + 3,
                        )
                        status, code = response.status_code, _error_code(response)
                    except httpx.HTTPError as exc:
                        status, code = None, type(exc).__name__
                    seconds = time.monotonic() - began
                    probes += 1
                    worst = max(worst, seconds)
                    if status != 503 or code != "UNAVAILABLE" or seconds > PROBE_TIMEOUT:
                        self.violation(
                            f"{event['name']}: POST /v1/tasks on server {server.name} while the database is down "
                            f"answered {status} {code} after {seconds:.2f} s"
                        )
            time.sleep(0.3)
        event["outage_probes"] = probes
        event["outage_probe_worst_s"] = round(worst, 3)

    def wait_recovery(self, event: dict[str, Any], db_up_wall: float) -> None:
        """After the database is back: each server answers again by itself, and work resumes."""
        for server in self.every_server:
            seconds = self.wait_until(lambda s=server: self.serving_steadily(s), timeout=30)
            event[f"server_{server.name}_recovered_s"] = None if seconds is None else round(seconds, 2)
            if seconds is None:
                self.violation(
                    f"{event['name']}: server {server.name} did not answer 200 steadily within 30 s of the database"
                )
        seconds = self.wait_until(lambda: self.succeeded_after(db_up_wall), timeout=45, interval=0.2)
        event["work_resumed_s"] = None if seconds is None else round(seconds, 2)
        if seconds is None:
            self.violation(f"{event['name']}: no attempt succeeded within 45 s after the database came back")

    # -- chaos events ----------------------------------------------------------

    def active_attempts_of(self) -> dict[str, collections.Counter]:
        counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for worker_id, state, n in self.query(
            "SELECT worker_id, state, COUNT(*) FROM orbit_attempt WHERE state IN ('LEASED','RUNNING') "
            "GROUP BY worker_id, state"
        ):
            counts[worker_id][state] = n
        return counts

    def kill_worker(self, index: int, same_id: bool = False) -> dict[str, Any]:
        """Kills the worker with the most running attempts (waiting up to 5 s for one that runs any),
        so the kill lands mid-execution."""
        slot = self.slots[index % len(self.slots)]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            active = self.active_attempts_of()
            busiest = max(self.slots, key=lambda s: (active[s.worker_id]["RUNNING"], -s.index))
            if active[busiest.worker_id]["RUNNING"]:
                slot = busiest
                break
            time.sleep(0.1)
        held = self.active_attempts_of()[slot.worker_id]
        old = slot.worker_id
        slot.kill()
        killed_wall = time.time()
        self.killed_workers.append((old, killed_wall))
        slot.start(self.cfg.capacity, self.credentials, same_id=same_id)
        name = "kill -9 worker, restarted under the same worker_id" if same_id else "kill -9 worker"
        event = {
            "name": name,
            "worker": old,
            "replacement": slot.worker_id,
            "held_running": held["RUNNING"],
            "held_leased": held["LEASED"],
        }
        seconds = self.wait_until(lambda: self.connected_after([slot.worker_id], killed_wall), timeout=30)
        event["replacement_connected_s"] = None if seconds is None else round(seconds, 2)
        if seconds is None:
            self.violation(f"kill -9 worker: replacement {slot.worker_id} did not connect within 30 s")
        return event

    def kill_server(self, index: int) -> dict[str, Any]:
        server = self.servers[index % len(self.servers)]
        event: dict[str, Any] = {"name": f"kill -9 server {server.name}"}
        # A wide cancel through this server, its follow-up held in flight by the kill.
        cut = self.pipelines.cut_follow_up(server, event["name"]) if self.pipelines else None
        server.stop(kill=True)
        if cut is not None:
            cut.release()
        time.sleep(1.0)
        restarted_wall = time.time()
        event["listen_s"] = round(server.start(), 2)
        seconds = self.wait_until(lambda: self.serving(server), timeout=30)
        event["serving_s"] = None if seconds is None else round(seconds, 2)
        if seconds is None:
            self.violation(f"{event['name']}: restarted server did not answer 200 within 30 s")
        ids = [slot.worker_id for slot in self.slots if slot.server is server]
        seconds = self.wait_until(lambda: self.connected_after(ids, restarted_wall), timeout=30, interval=0.2)
        event["workers_reconnected_s"] = None if seconds is None else round(seconds, 2)
        if seconds is None:
            self.violation(f"{event['name']}: its workers did not reconnect within 30 s")
        if cut is not None:
            event["follow_up"] = cut.settled()
        return event

    def submit_direct(self, name: str, payload: dict, key: str, max_attempts: int = 1) -> str:
        """One task outside the submitters' stream (still counted in every end check)."""
        assert self.submitter is not None
        idem = f"chaos-{self.run_id}-{name}"
        body = {
            "queue_id": self.queues[0],
            "handler": "chaos.work",
            "handler_version": "v1",
            "payload_version": "v1",
            "payload": {"idem": idem, **payload},
            "concurrency_key": key,
            "lease_seconds": self.cfg.lease_seconds,
            "max_attempts": max_attempts,
        }
        with httpx.Client(timeout=httpx.Timeout(PROBE_TIMEOUT + 3, connect=2.0)) as client:
            data = self.submitter.post_until_answered(client, 0, idem, body)
        if data is None:
            raise RuntimeError(f"could not submit {name}")
        with self.submitter.stats.lock:
            self.submitter.stats.accepted[idem] = data["task"]["id"]
            self.submitter.stats.bodies[idem] = body
        return data["task"]["id"]

    def ledger_end(self, attempt_id: str) -> dict | None:
        for path in (self.work / "ledgers").glob("*.jsonl"):
            for line in path.read_text().splitlines():
                if attempt_id in line and '"event":"end"' in line:
                    return json.loads(line)
        return None

    def fence(self, n: int) -> dict[str, Any]:
        """A keyed handler outlives its lease while its server is down; the key's next holder (on
        the other server) writes with a higher token, and the old handler's late write is refused."""
        key = f"chaos/fence-{n}"
        event: dict[str, Any] = {"name": "handler outlives its lease (server down > lease): fencing token"}
        long_id = self.submit_direct(f"fence-{n}-long", {"sleep_ms": 60_000}, key)
        rows: list = []

        def running() -> bool:
            rows[:] = self.query(
                "SELECT id, worker_id, concurrency_token FROM orbit_attempt WHERE task_id=%s AND state='RUNNING'",
                (long_id,),
            )
            return bool(rows)

        if self.wait_until(running, timeout=30) is None:
            self.violation(f"{event['name']}: the long task did not start within 30 s")
            return event
        attempt_id, worker_id, long_token = rows[0]
        slot = next(s for s in self.slots if s.worker_id == worker_id)
        server = slot.server
        follow_id = self.submit_direct(f"fence-{n}-next", {"sleep_ms": 50}, key)
        server.stop(kill=True)
        killed = time.monotonic()
        event["server"] = server.name

        def follow_done() -> bool:
            rows[:] = self.query(
                "SELECT state, concurrency_token, leased_at FROM orbit_attempt WHERE task_id=%s AND state='SUCCEEDED'",
                (follow_id,),
            )
            return bool(rows)

        seconds = self.wait_until(follow_done, timeout=self.cfg.lease_seconds + 30, interval=0.2)
        event["next_holder_done_after_kill_s"] = None if seconds is None else round(time.monotonic() - killed, 2)
        event["listen_s"] = round(server.start(), 2)
        if seconds is None:
            self.violation(f"{event['name']}: the key's next task did not succeed while the old holder was cut off")
            return event
        follow_token = rows[0][1]
        end = None
        if self.wait_until(lambda: self.ledger_end(attempt_id) is not None, timeout=30, interval=0.2) is not None:
            end = self.ledger_end(attempt_id)
        state = self.query("SELECT state FROM orbit_attempt WHERE id=%s", (attempt_id,))[0][0]
        event.update(
            {
                "old_token": long_token,
                "new_token": follow_token,
                "old_attempt": state,
                "old_write": None if end is None else end["write"],
            }
        )
        if follow_token <= long_token:
            self.violation(f"{event['name']}: next holder's token {follow_token} not above {long_token}")
        if state != "UNKNOWN":
            self.violation(f"{event['name']}: the cut-off attempt ended {state}, not UNKNOWN")
        if end is None or end["write"] != "stale":
            self.violation(f"{event['name']}: the old holder's late write was not refused: {end}")
        return event

    def stop_worker_past_lease(self, n: int) -> dict[str, Any]:
        """A worker process stopped (SIGSTOP) longer than its leases, then resumed. A long task
        L holds one of two permits of a key and a longer one H the other (the key is full),
        the worker running L is stopped, and a third task F of the key is sent: F can have
        only a permit the stopped worker held, once a server recovered it at the lease's end
        (every attempt the stopped worker held must end UNKNOWN, and no key row or slot may
        still name one). Resumed, its results are refused (the rows keep UNKNOWN), and L's
        late write on a slot that a newer token already wrote is refused as stale."""
        key = f"{STOP_PREFIX}{n}"
        event: dict[str, Any] = {"name": "SIGSTOP worker past its lease"}
        stop_seconds = self.cfg.lease_seconds + 4
        rows: list = []

        def running(task_id: str) -> bool:
            rows[:] = self.query(
                "SELECT id, worker_id, concurrency_token, concurrency_slot FROM orbit_attempt "
                "WHERE task_id=%s AND state='RUNNING'",
                (task_id,),
            )
            return bool(rows)

        long_id = self.submit_direct(f"stop-{n}-long", {"sleep_ms": 60_000}, key)
        if self.wait_until(lambda: running(long_id), timeout=30) is None:
            self.violation(f"{event['name']}: the long task did not start within 30 s")
            return event
        long_attempt, worker_id, long_token, long_slot = rows[0]
        # Holds the key's other permit past the stop (on a worker that is not stopped, it renews).
        hold_id = self.submit_direct(f"stop-{n}-hold", {"sleep_ms": (stop_seconds + 8) * 1000}, key)
        if self.wait_until(lambda: running(hold_id), timeout=30) is None:
            self.violation(f"{event['name']}: the key's second task did not start within 30 s")
            return event
        slot = next(s for s in self.slots if s.worker_id == worker_id)
        assert slot.process is not None
        os.kill(slot.process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            time.sleep(0.5)  # results it sent before the stop are in by now
            held = {
                row[0]: {"key": row[1], "slot": row[2], "state": row[3]}
                for row in self.query(
                    "SELECT id, concurrency_key, concurrency_slot, state FROM orbit_attempt "
                    "WHERE worker_id=%s AND state IN ('LEASED','RUNNING')",
                    (worker_id,),
                )
            }
            event.update(
                {"worker": worker_id, "held": len(held), "held_keyed": sum(bool(h["key"]) for h in held.values())}
            )
            # Retried if the stopped worker is given it (its server still counts its capacity).
            follow_id = self.submit_direct(f"stop-{n}-next", {"sleep_ms": 50}, key, max_attempts=3)
            marks = ",".join(["%s"] * len(held))

            def recovered() -> bool:
                return not self.query(
                    f"SELECT 1 FROM orbit_attempt WHERE id IN ({marks}) AND state IN ('LEASED','RUNNING')", tuple(held)
                )

            seconds = self.wait_until(recovered, timeout=self.cfg.lease_seconds + 20, interval=0.2)
            event["recovered_after_stop_s"] = None if seconds is None else round(time.monotonic() - stopped, 2)
            if seconds is None:
                self.violation(f"{event['name']}: the stopped worker's attempts were not recovered")
            named = self.query(
                f"SELECT `key` FROM orbit_concurrency_key WHERE holder_attempt_id IN ({marks}) "
                f"UNION ALL SELECT `key` FROM orbit_concurrency_slot WHERE holder_attempt_id IN ({marks})",
                (*held, *held),
            )
            if named:
                self.violation(f"{event['name']}: key permits still name the stopped worker's attempts: {named[:5]}")

            def follow_done() -> bool:
                return bool(self.query("SELECT 1 FROM orbit_task WHERE id=%s AND state='SUCCEEDED'", (follow_id,)))

            self.wait_until(follow_done, timeout=max(0.5, stopped + stop_seconds - time.monotonic()), interval=0.2)
            time.sleep(max(0.0, stopped + stop_seconds - time.monotonic()))
        finally:
            os.kill(slot.process.pid, signal.SIGCONT)
        event["stopped_s"] = round(time.monotonic() - stopped, 2)
        if self.wait_until(follow_done, timeout=self.cfg.lease_seconds + 20, interval=0.2) is None:
            self.violation(f"{event['name']}: the key's third task did not succeed")
            return event
        follows = self.query(
            "SELECT concurrency_token, concurrency_slot, state, finished_at FROM orbit_attempt "
            "WHERE task_id=%s ORDER BY epoch",
            (follow_id,),
        )
        follow_token, follow_slot = follows[0][0], follows[0][1]
        event.update(
            {
                "long_token": long_token,
                "long_slot": long_slot,
                "next_token": follow_token,
                "next_slot": follow_slot,
                "next_attempts": len(follows),
            }
        )
        if follow_token <= long_token:
            self.violation(f"{event['name']}: the next holder's token {follow_token} is not above {long_token}")
        recovered_slots = {h["slot"] for h in held.values() if h["key"] == key}
        if follow_slot not in recovered_slots:
            self.violation(
                f"{event['name']}: the next holder got slot {follow_slot}, not one the stopped worker held "
                f"({sorted(recovered_slots)})"
            )
        end = None
        if self.wait_until(lambda: self.ledger_end(long_attempt) is not None, timeout=30, interval=0.2) is not None:
            end = self.ledger_end(long_attempt)
        time.sleep(1.0)  # the resumed worker's results reach a server
        ended = dict(self.query(f"SELECT id, state FROM orbit_attempt WHERE id IN ({marks})", tuple(held)))
        states = collections.Counter(ended.values())
        late = self.query(
            f"SELECT COUNT(*) FROM orbit_attempt WHERE id IN ({marks}) AND late_outcome IS NOT NULL", tuple(held)
        )
        event.update(
            {
                "held_states": dict(states),
                "late_results_refused": late[0][0],
                "long_write": None if end is None else end["write"],
            }
        )
        # Recovered: a running attempt as UNKNOWN (its effect is unknown), one never started as
        # EXPIRED, or RELEASED when its server closed the connection that did not acknowledge
        # it (its task is leased again); none may take the resumed worker's result.
        wrong = {
            attempt_id: (h["state"], ended.get(attempt_id))
            for attempt_id, h in held.items()
            if ended.get(attempt_id) not in ({"UNKNOWN"} if h["state"] == "RUNNING" else {"EXPIRED", "RELEASED"})
        }
        if wrong:
            self.violation(f"{event['name']}: the stopped worker's attempts (at the stop, at the end): {wrong}")
        # A newer holder of L's slot that finished (wrote) before L's late write: L must be refused.
        overtaken = any(
            slot_ == long_slot and state == "SUCCEEDED" and end is not None and (utc_ts(finished) or 0) < end["t"]
            for _, slot_, state, finished in follows
        )
        if overtaken and end is not None and end["write"] != "stale":
            self.violation(f"{event['name']}: the stopped holder's late write on slot {long_slot} was accepted: {end}")
        if end is None:
            self.violation(f"{event['name']}: the stopped holder's handler never ended after SIGCONT")
        return event

    def kill_all_servers(self) -> dict[str, Any]:
        event: dict[str, Any] = {"name": "kill -9 every server at once"}
        for server in self.every_server:
            server.stop(kill=True)
        time.sleep(1.0)
        restarted_wall = time.time()
        for server in self.every_server:
            event[f"server_{server.name}_listen_s"] = round(server.start(), 2)
        ids = [slot.worker_id for slot in self.slots]
        seconds = self.wait_until(lambda: self.connected_after(ids, restarted_wall), timeout=30, interval=0.2)
        event["workers_reconnected_s"] = None if seconds is None else round(seconds, 2)
        if seconds is None:
            self.violation("kill -9 both servers: workers did not reconnect within 30 s")
        seconds = self.wait_until(lambda: self.succeeded_after(restarted_wall), timeout=45, interval=0.2)
        event["work_resumed_s"] = None if seconds is None else round(seconds, 2)
        if seconds is None:
            self.violation("kill -9 both servers: no attempt succeeded within 45 s of the restart")
        return event

    def db_outage(
        self, kill: bool, restart_server: Server | None = None, down_seconds: float | None = None
    ) -> dict[str, Any]:
        name = "kill -9 MariaDB" if kill else "SIGTERM restart of MariaDB"
        down = self.cfg.db_down_seconds if down_seconds is None else down_seconds
        if down_seconds is not None:
            name += f" held down {down:.0f} s (longer than a lease)"
        if restart_server is not None:
            name += f" + server {restart_server.name} restarted while it is down"
        event: dict[str, Any] = {"name": name}
        cut = None
        if kill and restart_server is None and down_seconds is None and self.pipelines and self.api_server:
            # A wide cancel whose follow-up is held in flight when the database dies.
            cut = self.pipelines.cut_follow_up(self.api_server, name)
        began = time.monotonic()
        self.db.stop(kill=kill)
        if cut is not None:
            cut.release()
        event["stop_s"] = round(time.monotonic() - began, 2)
        if restart_server is not None:
            restart_server.stop(kill=True)
            event["server_listen_without_db_s"] = round(restart_server.start(), 2)
        self.probe_outage(time.monotonic() + down, event)
        event["db_start_s"] = round(self.db.start(), 2)
        db_up_wall = time.time()
        self.wait_recovery(event, db_up_wall)
        if restart_server is not None:
            ids = [slot.worker_id for slot in self.slots if slot.server is restart_server]
            seconds = self.wait_until(lambda: self.connected_after(ids, db_up_wall - 60), timeout=30, interval=0.2)
            event["workers_reconnected_s"] = None if seconds is None else round(seconds, 2)
            if seconds is None:
                self.violation(f"{name}: workers of server {restart_server.name} did not reconnect within 30 s")
        if cut is not None:
            event["follow_up"] = cut.settled()
        return event

    def db_freeze(self) -> dict[str, Any]:
        """Every request while the server is frozen answers 503 within PROBE_TIMEOUT
        (the submitters' slow answers are violations), and work resumes after."""
        event: dict[str, Any] = {"name": "MariaDB frozen (SIGSTOP: connections accepted, never answered)"}
        assert self.submitter is not None
        stats = self.submitter.stats
        with stats.lock:
            stats.watch = {}
        self.db.freeze()
        try:
            self.probe_outage(time.monotonic() + self.cfg.freeze_seconds, event)
        finally:
            self.db.thaw()
            with stats.lock:
                event["submits_during_freeze"], stats.watch = stats.watch, None
        self.wait_recovery(event, time.time())
        return event

    def counters_locked(self) -> bool:
        """Whether a transaction holds an application's counter row (read past, not waited on)."""
        rows = self.query("SELECT COUNT(*) FROM orbit_application_state")[0][0]
        free = self.query("SELECT application_id FROM orbit_application_state FOR UPDATE SKIP LOCKED")
        return len(free) < rows

    def freeze_node(self, index: int) -> dict[str, Any]:
        """One server process stopped (SIGSTOP) inside a round's transaction, its row locks
        held: MariaDB must end that transaction within SERVING_IDLE_TRANSACTION_SECONDS, so
        the other node refuses submits only about that long; the stopped process, resumed,
        commits nothing stale (the end checks: no accepted task lost, none twice)."""
        server, other = self.servers[index % 2], self.servers[(index + 1) % 2]
        event: dict[str, Any] = {"name": f"server {server.name} frozen mid-transaction (SIGSTOP of one process)"}
        assert self.submitter is not None and server.process is not None
        children = [
            int(pid)
            for pid in Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
        ]
        stats = self.submitter.stats
        caught: int | None = None
        for attempt in range(3000):
            pid = children[attempt % len(children)]
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.002)
            if self.counters_locked():
                time.sleep(0.1)  # still held: by the stopped process, not one finishing its commit
                if self.counters_locked():
                    caught = pid
                    break
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.005)
        event["tries"] = attempt + 1
        if caught is None:
            event["caught"] = False
            log(f"{event['name']}: no process caught inside a transaction in {attempt + 1} tries")
            return event
        frozen_at = time.monotonic()
        with stats.lock:
            stats.answers, stats.frozen = [], server.name
        if self.neighbour is not None:
            with self.neighbour.submitter.stats.lock:
                self.neighbour.submitter.stats.frozen = server.name
        try:
            released = self.wait_until(lambda: not self.counters_locked(), timeout=self.cfg.freeze_seconds)
            event["locks_released_s"] = None if released is None else round(released, 2)
            time.sleep(max(0.0, frozen_at + self.cfg.freeze_seconds - time.monotonic()))
        finally:
            os.kill(caught, signal.SIGCONT)
            with stats.lock:
                answers, stats.answers = stats.answers or [], None
        # The other node: refused only until the frozen transaction was ended, and the
        # request deadline after it.
        bound = FROZEN_NODE_BOUND_SECONDS
        on_other = [(sent - frozen_at, status) for name, sent, status in answers if name == other.name]
        late_refusals = [round(at, 2) for at, status in on_other if status == 503 and at > bound]
        event[f"server_{other.name}_answers"] = len(on_other)
        event[f"server_{other.name}_refused"] = sum(1 for _, status in on_other if status == 503)
        event[f"server_{other.name}_refused_after_{bound:g}_s"] = len(late_refusals)
        if released is None:
            self.violation(f"{event['name']}: its row locks were still held after {self.cfg.freeze_seconds:g} s")
        if late_refusals:
            self.violation(
                f"{event['name']}: server {other.name} refused {len(late_refusals)} submits more than {bound:g} s "
                f"into the freeze (first at {late_refusals[0]} s)"
            )
        self.wait_recovery(event, time.time())
        time.sleep(PROBE_TIMEOUT + 3)  # the frozen process's last requests answered
        with stats.lock:
            stats.frozen = None
        if self.neighbour is not None:
            with self.neighbour.submitter.stats.lock:
                self.neighbour.submitter.stats.frozen = None
        return event

    def schedule(self) -> list[Any]:
        # Which server an event hits: B in the first round, then the other in turn.
        events: list[Any] = []

        def server_of(n: int) -> int:
            return 1 + n // len(events)

        events += [
            lambda n: self.kill_worker(n),
            lambda n: self.stop_worker_past_lease(n),
            lambda n: self.kill_server(server_of(n)),
            lambda n: self.db_outage(kill=True),
            lambda n: self.db_outage(kill=False),
            lambda n: self.db_freeze(),
            lambda n: self.freeze_node(server_of(n)),
        ]
        if not self.cfg.short:
            events += [
                lambda n: self.kill_worker(n, same_id=True),
                lambda n: self.db_outage(kill=True, restart_server=self.servers[n % 2]),
                lambda n: self.kill_all_servers(),
                lambda n: self.db_outage(kill=True, down_seconds=self.cfg.lease_seconds + 3),
                lambda n: self.fence(n),
            ]
        return events

    def chaos(self) -> None:
        """Short: each event once. Full: the events in turn until the time is up."""
        cfg = self.cfg
        assert self.submitter is not None and self.pipelines is not None
        self.submitter.start()
        self.pipelines.start()
        if self.neighbour is not None:
            self.neighbour.submitter.start()
        time.sleep(cfg.warmup_seconds)
        events = self.schedule()
        began = time.monotonic()
        # Load runs on through each event's checks (seconds under load) and then this gap.
        gap = 1.0 if cfg.short else 6.0
        for n in itertools.count():
            if cfg.short and n >= len(events):
                break
            if not cfg.short and n > 0 and time.monotonic() - began + 10 > cfg.seconds:
                break
            t0 = time.monotonic()
            event = events[n % len(events)](n)
            event["at_s"] = round(t0 - self.began, 1)
            event["took_s"] = round(time.monotonic() - t0, 2)
            self.events.append(event)
            log(f"event {n + 1}: {json.dumps(event)}")
            self.snapshot_check(event["name"])
            self.rows_check(event["name"])
            time.sleep(gap)
        remaining = cfg.seconds - (time.monotonic() - began)
        if remaining > 0:
            log(f"load continues for {remaining:.0f} s")
            time.sleep(remaining)

    # -- the end ---------------------------------------------------------------

    def settle(self) -> None:
        assert self.submitter is not None
        log("stopping submitters")
        if self.pipelines is not None:
            self.pipelines.finish(timeout=30)
        self.submitter.finish(timeout=30)
        if self.neighbour is not None:
            self.neighbour.submitter.finish(timeout=30)
        # A BLOCKED task waits for its dependencies; a NEEDS_REVIEW pipeline task (a kill left its
        # effect unknown) is moved on with RETRY, as an operator would, so its dependents end too.
        unsettled_sql = "SELECT COUNT(*) FROM orbit_task WHERE state IN ('BLOCKED','WAITING','LEASED','RUNNING')"
        # With --cells the neighbour's cell too (each cell holds its one application's rows).
        neighbour_database = cell_database(NEIGHBOUR_CELL) if self.neighbour is not None else None

        def unsettled(database: str | None = None) -> int:
            return self.query(unsettled_sql, database=database)[0][0]

        def quiet() -> bool:
            if self.pipelines is not None:
                self.pipelines.resolve_reviews()
            return unsettled() == 0 and (neighbour_database is None or unsettled(neighbour_database) == 0)

        seconds = self.wait_until(quiet, self.cfg.settle_seconds, 0.5)
        self.figures["settle_s"] = None if seconds is None else round(seconds, 1)
        if seconds is None:
            left = [
                (label, database)
                for label, database in (("", None), ("neighbour: ", neighbour_database))
                if (label == "" or database is not None) and unsettled(database)
            ]
            # Nothing left by now (settled just past the bound): still late, reported as the chaos one's.
            for label, database in left or [("", None)]:
                rows = self.query(
                    "SELECT id, state, concurrency_key, available_at FROM orbit_task "
                    "WHERE state IN ('BLOCKED','WAITING','LEASED','RUNNING') LIMIT 10",
                    database=database,
                )
                self.violation(
                    f"{label}{unsettled(database)} tasks not settled {self.cfg.settle_seconds:.0f} s after the "
                    f"load stopped (sample: {rows})"
                )
        log("draining workers")
        for slot in [*self.slots, *(self.neighbour.slots if self.neighbour is not None else [])]:
            if not slot.drain(timeout=20):
                self.notes.append(f"worker {slot.worker_id} did not drain within 20 s; killed")
        for server in self.every_server:
            server.stop()

    def run_orbit_check(self) -> None:
        result = self.manage("orbit_check")
        self.figures["orbit_check_exit"] = result.returncode
        self.figures["plain_orbit_check_under_load_failures"] = self.plain_check_noise
        output = (result.stdout + result.stderr).strip()
        if result.returncode != 0:
            self.violation(f"manage.py orbit_check exit {result.returncode}: {output[:3000]}")
        else:
            log(output.splitlines()[-1] if output else "orbit_check: ok")

    def application_rows(
        self, namespace_id: str, database: str | None = None
    ) -> tuple[dict[str, dict], list[dict], checks.KeyRules, dict[str, Any]]:
        """An application's rows as the end checks read them: (tasks by id, attempts, its live
        key policies, its task.submit idempotency records by key)."""
        tasks = {
            row[0]: {"id": row[0], "state": row[1], "key": row[2], "attempts": row[3], "idem": row[4]}
            for row in self.query(
                "SELECT id, state, concurrency_key, attempts, "
                "JSON_UNQUOTE(JSON_EXTRACT(payload, '$.idem')) FROM orbit_task WHERE namespace_id=%s",
                (namespace_id,),
                database=database,
            )
        }
        attempts = [
            {
                "id": r[0],
                "task_id": r[1],
                "state": r[2],
                "epoch": r[3],
                "key": r[4],
                "token": r[5],
                "leased_at": utc_ts(r[6]),
                "started_at": utc_ts(r[7]),
                "finished_at": utc_ts(r[8]),
                "worker_id": r[9],
                "number": r[10],
                "late": r[11] is not None,
                "slot": r[12],
            }
            for r in self.query(
                "SELECT id, task_id, state, epoch, concurrency_key, concurrency_token, leased_at, started_at, "
                "finished_at, worker_id, number, late_outcome, concurrency_slot FROM orbit_attempt "
                "WHERE namespace_id=%s",
                (namespace_id,),
                database=database,
            )
        ]
        rules = checks.KeyRules.of(
            {
                "match_kind": r[0],
                "match_value": r[1],
                "capacity": r[2],
                "rate_starts": r[3],
                "rate_per_seconds": r[4],
                "rate_burst": r[5],
            }
            for r in self.query(
                "SELECT match_kind, match_value, capacity, rate_starts, rate_per_seconds, rate_burst "
                "FROM orbit_key_policy WHERE namespace_id=%s AND live",
                (namespace_id,),
                database=database,
            )
        )
        records = {
            row[0]: row[1]
            for row in self.query(
                "SELECT `key`, response_data FROM orbit_idempotency_record "
                "WHERE namespace_id=%s AND operation='task.submit'",
                (namespace_id,),
                database=database,
            )
        }
        return tasks, attempts, rules, records

    @staticmethod
    def row_violations(
        accepted: dict[str, str], tasks: dict[str, dict], attempts: list[dict], records: dict, rules: checks.KeyRules
    ) -> list[str]:
        """The end checks over one application's rows (reliability/checks.py)."""
        return [
            # No accepted task lost; exactly one task per idempotency key.
            *checks.accepted_tasks_not_lost(accepted, tasks),
            *checks.one_task_per_idempotency_key(tasks),
            *checks.idempotency_records_point_at_their_tasks(records, tasks),
            *checks.receipts_agree_with_idempotency_records(accepted, records),
            *checks.tasks_have_idempotency_records(tasks, records),
            # Attempts agree with their tasks: counters recomputed, one success, no work after it.
            *checks.attempt_counters_match_started_attempts(tasks, attempts),
            *checks.one_success_per_succeeded_task(tasks, attempts),
            # Per key: never more permits held than its capacity, each (key, slot) held by one
            # attempt at a time, tokens strictly increase in lease order, Starts within its rate.
            *checks.key_tokens_increase_in_lease_order(attempts),
            *checks.key_holders_within_capacity(attempts, rules),
            *checks.key_slots_fit_capacity(attempts, rules),
            *checks.slot_holders_never_overlap(attempts),
            *checks.key_starts_keep_their_rate(attempts, rules),
            *checks.rated_windows_within_bound(attempts, rules),
        ]

    def check(self) -> None:
        """The end checks (reliability/checks.py) over the quiet database and the ledgers."""
        assert self.submitter is not None
        stats = self.submitter.stats
        tasks, attempts, rules, records = self.application_rows(self.namespace_id)
        for message in self.row_violations(stats.accepted, tasks, attempts, records, rules):
            self.violation(message)
        unknown_to_client = [key for key in records if key not in stats.accepted]
        if unknown_to_client:
            # The client gave up on these (run ended mid-retry): accepted by the server, never acknowledged.
            self.notes.append(f"{len(unknown_to_client)} tasks accepted by the server but never acknowledged")
        delays = checks.killed_worker_recovery_delays(self.killed_workers, attempts)
        self.figures["killed_worker_attempts_recovered"] = len(delays)
        self.figures["killed_worker_recovery_max_s"] = round(max(delays), 2) if delays else None

        self.check_ledgers({a["id"]: a for a in attempts})
        self.key_figures(attempts, rules)
        if self.pipelines is not None:
            # Dependencies (SPEC §13): each dependent ran only after its dependencies ended, and
            # ended as its plan says; nothing BLOCKED or left to settle.
            found, figures = self.pipelines.check(self.work / "ledgers")
            for message in found:
                self.violation(message)
            self.figures.update(figures)

        states = collections.Counter(task["state"] for task in tasks.values())
        attempt_states = collections.Counter(a["state"] for a in attempts)
        self.figures.update(
            {
                "tasks_accepted": len(stats.accepted),
                "tasks_in_db": len(tasks),
                "tasks_lost": sum(1 for task_id in stats.accepted.values() if task_id not in tasks),
                "task_states": dict(sorted(states.items())),
                "attempts": len(attempts),
                "attempt_states": dict(sorted(attempt_states.items())),
                "late_results": sum(a["late"] for a in attempts),
                "keyed_tasks": sum(1 for t in tasks.values() if t["key"]),
                "keys": len({a["key"] for a in attempts if a["key"]}),
                "submit_deduplicated_replays": stats.deduplicated,
                "submit_concurrent_twins": stats.twins,
                "submit_late_replays": stats.replays,
                "submit_retries": stats.retries,
                "submit_statuses": dict(sorted(stats.statuses.items())),
                "submit_keys_given_up": len(stats.given_up),
            }
        )
        for message in stats.unexpected[:20]:
            self.violation(f"unexpected answer: {message}")
        for message in stats.slow[:20]:
            self.violation(f"slow answer: {message}")
        if self.neighbour is not None:
            self.check_neighbour(self.neighbour)
            self.check_placement(self.neighbour)

    def check_neighbour(self, neighbour: Neighbour) -> None:
        """--cells: the neighbour's rows in its cell pass the same end checks as the chaos
        application's, its workers' ledgers agree with them, and every task it saw accepted
        exists once and ended SUCCEEDED (its workers are never killed and its leases outlast
        every stall: nothing of it may end otherwise)."""
        stats = neighbour.submitter.stats
        tasks, attempts, rules, records = self.application_rows(neighbour.namespace_id, cell_database(NEIGHBOUR_CELL))
        by_attempt = {a["id"]: a for a in attempts}
        ledgers = checks.read_ledgers(neighbour.work / "ledgers")
        runs_by_slot = checks.executions_by_slot(ledgers, by_attempt, {})
        found = [
            *self.row_violations(stats.accepted, tasks, attempts, records, rules),
            *checks.handlers_ran_once(ledgers),
            *checks.ledger_attempts_exist(ledgers, by_attempt),
            *checks.ledger_attempts_match_the_database(ledgers, by_attempt),
            *checks.handlers_begin_after_start_approved(ledgers, by_attempt),
            *checks.unended_handlers_were_killed(ledgers, by_attempt, {}),
            *checks.stale_writes_only_from_lost_leases(ledgers, by_attempt),
            *checks.key_executions_never_overlap_while_both_held_the_permit(runs_by_slot, by_attempt),
            *checks.key_executions_begin_in_token_order(runs_by_slot),
        ]
        accepted_ids = set(stats.accepted.values())
        lost = sorted(accepted_ids - set(tasks))
        not_succeeded = {
            task_id: tasks[task_id]["state"]
            for task_id in sorted(accepted_ids & set(tasks))
            if tasks[task_id]["state"] != "SUCCEEDED"
        }
        if not_succeeded:
            found.append(
                f"{len(not_succeeded)} accepted tasks did not end SUCCEEDED: {dict(list(not_succeeded.items())[:5])}"
            )
        tasks_per_key = collections.Counter(task["idem"] for task in tasks.values())
        duplicates = sum(count - 1 for count in tasks_per_key.values() if count > 1)
        found += [f"unexpected answer: {message}" for message in stats.unexpected[:20]]
        found += [f"slow answer: {message}" for message in stats.slow[:20]]
        for message in found:
            self.violation(f"neighbour: {message}")
        self.figures["neighbour"] = {
            "cell": NEIGHBOUR_CELL,
            "accepted": len(stats.accepted),
            "succeeded": sum(1 for task_id in accepted_ids if tasks.get(task_id, {}).get("state") == "SUCCEEDED"),
            "lost": len(lost),
            "duplicates": duplicates,
            "tasks_in_db": len(tasks),
            "task_states": dict(sorted(collections.Counter(t["state"] for t in tasks.values()).items())),
            "keyed_tasks": sum(1 for t in tasks.values() if t["key"]),
            "attempts": len(attempts),
            "attempt_states": dict(sorted(collections.Counter(a["state"] for a in attempts).items())),
            "executions": len(ledgers.executions),
            "submit_deduplicated_replays": stats.deduplicated,
            "submit_retries": stats.retries,
            "submit_statuses": dict(sorted(stats.statuses.items())),
            "submit_keys_given_up": len(stats.given_up),
        }

    def check_placement(self, neighbour: Neighbour) -> None:
        """--cells: each application's rows only in its own cell (every table with an
        application_id column, in each cell), the directory placing each in its cell and
        holding none of a cell's tables."""
        names = {self.application_id: "chaos", neighbour.application_id: "neighbour"}
        owner_of = {CHAOS_CELL: "chaos", NEIGHBOUR_CELL: "neighbour"}
        rows: dict[str, dict[str, dict[str, int]]] = {}
        misplaced = 0
        cell_tables: set[str] = set()
        for cell in CELLS:
            database = cell_database(cell)
            cell_tables |= {row[0] for row in self.tables_of(database)}
            with_application = [
                row[0]
                for row in self.query(
                    "SELECT table_name FROM information_schema.columns "
                    "WHERE table_schema=%s AND column_name='application_id' ORDER BY table_name",
                    (database,),
                    database=database,
                )
            ]
            for table in (*PLACED_TABLES, *(t for t in with_application if t not in PLACED_TABLES)):
                counts = {
                    names.get(application_id, application_id): count
                    for application_id, count in self.query(
                        f"SELECT application_id, COUNT(*) FROM `{table}` GROUP BY application_id", database=database
                    )
                }
                if table in PLACED_TABLES:
                    rows.setdefault(cell, {})[table] = counts
                    if not counts.get(owner_of[cell]):
                        self.violation(f"cell {cell}: {table} holds no row of {owner_of[cell]}, the application there")
                foreign = {who: count for who, count in counts.items() if who != owner_of[cell]}
                if foreign:
                    misplaced += sum(foreign.values())
                    self.violation(
                        f"cell {cell}: {table} holds rows of {foreign}; only {owner_of[cell]}'s belong there"
                    )
        # Django's migration ledger is in every database; no other table of a cell may be in the directory.
        in_directory = sorted({row[0] for row in self.tables_of(DB_NAME)} & cell_tables - {"django_migrations"})
        if in_directory:
            self.violation(f"the directory ({DB_NAME}) holds tables of the cells: {in_directory}")
        placements = dict(self.query("SELECT name, cell FROM orbit_cell_placement ORDER BY name", database=DB_NAME))
        if placements != {"chaos": CHAOS_CELL, "neighbour": NEIGHBOUR_CELL}:
            self.violation(
                f"the directory places the applications {placements}, not chaos in cell {CHAOS_CELL} and "
                f"neighbour in cell {NEIGHBOUR_CELL}"
            )
        self.figures["placement"] = {
            "directory": placements,
            "rows": rows,
            "misplaced_rows": misplaced,
            "directory_cell_tables": in_directory,
        }

    def tables_of(self, database: str) -> list[tuple]:
        return self.query(
            "SELECT table_name FROM information_schema.tables WHERE table_schema=%s", (database,), database=database
        )

    def key_figures(self, attempts: list[dict], rules: checks.KeyRules) -> None:
        """Per key family: the most permits one key held at once against its capacity, the
        tokens granted; per rated key its Starts and its busiest window against the bound."""
        holders = checks.key_holders_max(attempts)
        families: dict[str, dict[str, Any]] = {}
        for key, most in sorted(holders.items()):
            family = key.rstrip("0123456789")
            figure = families.setdefault(
                family + "*", {"capacity": rules.of_key(key).capacity, "keys": 0, "holders_max": 0, "grants": 0}
            )
            figure["keys"] += 1
            figure["holders_max"] = max(figure["holders_max"], most)
        for attempt in attempts:
            if attempt["key"]:
                figure = families[attempt["key"].rstrip("0123456789") + "*"]
                figure["grants"] += 1
                figure["highest_token"] = max(figure.get("highest_token", 0), attempt["token"] or 0)
        self.figures["key_holders"] = families
        self.figures["key_slots_used"] = {
            family: sorted(
                {a["slot"] for a in attempts if a["key"] and a["key"].startswith(family.rstrip("*"))}, key=str
            )
            for family in (CAP_PREFIX + "*", RATED_PREFIX + "*", STOP_PREFIX + "*")
        }
        self.figures["rated_keys"] = checks.rated_window_figures(attempts, rules)

    def check_ledgers(self, attempts: dict[str, dict]) -> None:
        """The workers' ledgers against the attempt rows (reliability/checks.py)."""
        killed: dict[tuple[str, int], float] = {}
        for slot in self.slots:
            killed.update(slot.killed_at)
        ledgers = checks.read_ledgers(self.work / "ledgers")
        runs_by_slot = checks.executions_by_slot(ledgers, attempts, killed)
        found = [
            *checks.handlers_ran_once(ledgers),
            *checks.ledger_attempts_exist(ledgers, attempts),
            *checks.ledger_attempts_match_the_database(ledgers, attempts),
            *checks.handlers_begin_after_start_approved(ledgers, attempts),
            *checks.unended_handlers_were_killed(ledgers, attempts, killed),
            *checks.stale_writes_only_from_lost_leases(ledgers, attempts),
            *checks.key_executions_never_overlap_while_both_held_the_permit(runs_by_slot, attempts),
            *checks.key_executions_begin_in_token_order(runs_by_slot),
        ]
        for message in found:
            self.violation(message)
        known = [e for e in checks.started_executions(ledgers) if e["attempt_id"] in attempts]
        self.figures.update(
            {
                "executions": len(ledgers.executions),
                "executions_cut_by_kill": sum(1 for e in known if "end" not in e),
                "fenced_overlaps": checks.fenced_overlaps(runs_by_slot, attempts),
                "stale_writes_refused": sum(1 for e in known if e.get("write") == "stale"),
            }
        )

    def inject_faults(self) -> None:
        """--inject-faults: corrupt the quiet database and a ledger the way the bugs this harness
        hunts would, so a run shows that every check can fail (the run must then exit 1)."""
        assert self.submitter is not None
        log("injecting faults (checking the checks)")
        conn = self.db.connect(self.chaos_database)
        try:
            cursor = conn.cursor()
            cursor.execute("UPDATE orbit_queue_state SET unfinished_tasks = unfinished_tasks + 1 LIMIT 1")
            keys = sorted(self.submitter.stats.accepted)
            lost = self.submitter.stats.accepted[keys[0]]
            cursor.execute("DELETE FROM orbit_task WHERE id=%s", (lost,))
            cursor.execute(
                "CREATE TEMPORARY TABLE twin AS SELECT * FROM orbit_task WHERE id=%s",
                (self.submitter.stats.accepted[keys[1]],),
            )
            cursor.execute("UPDATE twin SET id=%s", (uuid.uuid4().hex,))
            # MariaDB refuses values for generated columns (deadline_due_at, ...): copy the stored ones only.
            cursor.execute(
                "SELECT GROUP_CONCAT(CONCAT('`', column_name, '`') ORDER BY ordinal_position) "
                "FROM information_schema.columns WHERE table_schema=DATABASE() AND table_name='orbit_task' "
                "AND extra NOT LIKE '%%GENERATED%%'"
            )
            stored = cursor.fetchone()[0]
            cursor.execute(f"INSERT INTO orbit_task ({stored}) SELECT {stored} FROM twin")
            cursor.execute(
                "SELECT id, concurrency_key, leased_at FROM orbit_attempt WHERE concurrency_key LIKE %s "
                "ORDER BY leased_at DESC LIMIT 1",
                ("chaos/resource-%",),
            )
            attempt_id, key, leased_at = cursor.fetchone()
            cursor.execute("UPDATE orbit_attempt SET concurrency_token=1 WHERE id=%s", (attempt_id,))
            cursor.execute(
                "SELECT id FROM orbit_attempt WHERE concurrency_key=%s AND leased_at<%s "
                "ORDER BY leased_at DESC LIMIT 1",
                (key, leased_at),
            )
            previous = cursor.fetchone()[0]
            cursor.execute(
                "UPDATE orbit_attempt SET finished_at=%s + INTERVAL 1 SECOND WHERE id=%s", (leased_at, previous)
            )
            # A capped key over its capacity: the CAP_CAPACITY attempts before one held on past its lease.
            cursor.execute(
                "SELECT id, concurrency_key, leased_at FROM orbit_attempt WHERE concurrency_key LIKE %s "
                "ORDER BY leased_at DESC LIMIT 1",
                (CAP_PREFIX + "%",),
            )
            attempt_id, key, leased_at = cursor.fetchone()
            cursor.execute(
                "UPDATE orbit_attempt SET finished_at=%s + INTERVAL 1 SECOND WHERE concurrency_key=%s AND "
                "leased_at<%s ORDER BY leased_at DESC LIMIT %s",
                (leased_at, key, leased_at, CAP_CAPACITY),
            )
            # A rated key's Starts at one moment, one more than its burst.
            cursor.execute(
                "SELECT concurrency_key FROM orbit_attempt WHERE concurrency_key LIKE %s AND started_at IS NOT NULL "
                "GROUP BY concurrency_key ORDER BY COUNT(*) DESC LIMIT 1",
                (RATED_PREFIX + "%",),
            )
            (key,) = cursor.fetchone()
            cursor.execute(
                "SELECT id, started_at FROM orbit_attempt WHERE concurrency_key=%s AND started_at IS NOT NULL "
                "ORDER BY started_at LIMIT %s",
                (key, RATED_RATE["burst"] + 1),
            )
            bunched = cursor.fetchall()
            cursor.execute(
                "UPDATE orbit_attempt SET started_at=%s WHERE id IN (" + ",".join(["%s"] * len(bunched)) + ")",
                (bunched[0][1], *(row[0] for row in bunched)),
            )
            if self.pipelines is not None:
                self.pipelines.inject_faults(cursor)
            conn.commit()
        finally:
            conn.close()
        cursor_rows = self.query("SELECT id, task_id FROM orbit_attempt WHERE started_at IS NOT NULL LIMIT 1")
        with open(self.work / "ledgers" / "zz-injected.jsonl", "w") as ledger:
            ledger.write(
                json.dumps(
                    {
                        "worker_id": "injected",
                        "pid": 0,
                        "event": "start",
                        "t": 0.0,
                        "task_id": cursor_rows[0][1],
                        "attempt_id": cursor_rows[0][0],
                        "key": None,
                        "token": None,
                        "idem": None,
                    }
                )
                + "\n"
            )
        if self.neighbour is not None:
            self.inject_neighbour_faults(self.neighbour)

    def inject_neighbour_faults(self, neighbour: Neighbour) -> None:
        """--inject-faults --cells: the neighbour's checks must fire too: one of its accepted
        tasks deleted (lost), one not SUCCEEDED, one duplicated under its key, one copied into
        the chaos application's cell, and a cell's table made in the directory."""
        keys = sorted(neighbour.submitter.stats.accepted)
        lost, unfinished, twin, misplaced = (neighbour.submitter.stats.accepted[key] for key in keys[:4])
        conn = self.db.connect(cell_database(NEIGHBOUR_CELL))
        try:
            cursor = conn.cursor()
            cursor.execute("SET SESSION foreign_key_checks=0")  # a copy whose queue is not in that cell
            # MariaDB refuses values for generated columns: copy the stored ones only.
            cursor.execute(
                "SELECT GROUP_CONCAT(CONCAT('`', column_name, '`') ORDER BY ordinal_position) "
                "FROM information_schema.columns WHERE table_schema=DATABASE() AND table_name='orbit_task' "
                "AND extra NOT LIKE '%%GENERATED%%'"
            )
            stored = cursor.fetchone()[0]
            cursor.execute("DELETE FROM orbit_task WHERE id=%s", (lost,))
            cursor.execute("UPDATE orbit_task SET state='FAILED' WHERE id=%s", (unfinished,))
            cursor.execute("CREATE TEMPORARY TABLE twin AS SELECT * FROM orbit_task WHERE id=%s", (twin,))
            cursor.execute("UPDATE twin SET id=%s", (uuid.uuid4().hex,))
            cursor.execute(f"INSERT INTO orbit_task ({stored}) SELECT {stored} FROM twin")
            cursor.execute(
                f"INSERT INTO `{self.chaos_database}`.orbit_task ({stored}) "
                f"SELECT {stored} FROM orbit_task WHERE id=%s",
                (misplaced,),
            )
            cursor.execute(f"CREATE TABLE `{DB_NAME}`.orbit_queue LIKE orbit_queue")
            conn.commit()
        finally:
            conn.close()

    def scan_logs(self) -> None:
        unhandled = []
        for server in self.every_server:
            text = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
            for line in text.splitlines():
                if (
                    "unhandled error" in line
                    or "submit group failed" in line
                    or ("worker message" in line and "failed" in line)
                ):
                    unhandled.append(f"server {server.name}: {line.strip()[:300]}")
        for line in unhandled[:20]:
            self.violation(f"INTERNAL error logged: {line}")
        self.figures["server_internal_errors"] = len(unhandled)

    # -- lifecycle -------------------------------------------------------------

    def run(self) -> int:
        try:
            self.setup()
            log(f"chaos for {self.cfg.seconds:.0f} s")
            self.chaos()
            self.settle()
            if self.cfg.inject_faults:
                self.inject_faults()
            self.run_orbit_check()
            self.check()
            self.scan_logs()
        except (SystemExit, KeyboardInterrupt):
            self.violation("interrupted before the end: not a verdict")
            raise
        except Exception as exc:  # noqa: BLE001 - reported as a failed run
            self.violation(f"harness error: {type(exc).__name__}: {exc}")
            import traceback

            traceback.print_exc()
        finally:
            self.figures["wall_s"] = round(time.monotonic() - self.began, 1)
            self.summary()
            self.cleanup()
        return 1 if self.violations else 0

    def summary(self) -> None:
        summary = {
            "ok": not self.violations,
            "mode": "short" if self.cfg.short else "full",
            **({"cells": list(CELLS)} if self.cfg.cells else {}),
            "chaos_seconds": self.cfg.seconds,
            "figures": self.figures,
            "events": self.events,
            "violations": self.violations,
            "notes": self.notes,
        }
        (self.work / "summary.json").write_text(json.dumps(summary, indent=2))
        if self.summary_path is not None:
            self.summary_path.write_text(json.dumps(summary, indent=2))
        print("\n==== chaos summary ====", flush=True)
        if self.cfg.cells:
            print(
                f"  cells: {', '.join(CELLS)} (chaos application in {CHAOS_CELL}, neighbour in {NEIGHBOUR_CELL}; "
                f"directory {DB_NAME})"
            )
        for event in self.events:
            details = ", ".join(f"{k}={v}" for k, v in event.items() if k != "name")
            print(f"  event: {event['name']}: {details}")
        for name, value in self.figures.items():
            print(f"  {name}: {value}")
        for note in self.notes:
            print(f"  note: {note}")
        for message in self.violations:
            print(f"  VIOLATION: {message}")
        verdict = "OK" if not self.violations else f"FAILED ({len(self.violations)} violations)"
        print(
            f"chaos: {verdict} events={len(self.events)} accepted={self.figures.get('tasks_accepted')} "
            f"orbit_check_exit={self.figures.get('orbit_check_exit')}",
            flush=True,
        )

    def cleanup(self) -> None:
        if self._cleaned:
            return
        self._cleaned = True
        self.procs.kill_all()
        try:
            self.db.stop(kill=True)
        except Exception:  # noqa: BLE001
            pass
        try:
            if LOG_KEEP.exists():
                shutil.rmtree(LOG_KEEP)
            LOG_KEEP.mkdir(parents=True)
            for sub in ("logs", "ledgers"):
                shutil.copytree(self.work / sub, LOG_KEEP / sub)
            if (self.work / "neighbour").exists():  # --cells: the neighbour's worker logs and ledgers
                for sub in ("logs", "ledgers"):
                    shutil.copytree(self.work / "neighbour" / sub, LOG_KEEP / "neighbour" / sub)
            for name in ("summary.json",):
                if (self.work / name).exists():
                    shutil.copy(self.work / name, LOG_KEEP / name)
            if self.db.log_path.exists():
                shutil.copy(self.db.log_path, LOG_KEEP / "mariadb.log")
        except OSError as exc:
            print(f"chaos: could not keep logs: {exc}", file=sys.stderr)
        shutil.rmtree(self.work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="CI form: one round of events, lighter load")
    parser.add_argument("--seconds", type=float, help="chaos duration (default 40 short, 260 full)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=None, help="tasks submitted per second")
    parser.add_argument("--summary", type=Path, help="also write the JSON summary here")
    parser.add_argument(
        "--inject-faults", action="store_true", help="corrupt the rows at the end: every check must then fire"
    )
    parser.add_argument(
        "--cells",
        action="store_true",
        help="a directory and two cells: the chaos application in cell b, a neighbour application in cell a",
    )
    args = parser.parse_args()
    reason = available()
    if reason is not None:
        print(f"chaos: cannot start a private MariaDB: {reason}", file=sys.stderr)
        return 2
    seconds = args.seconds if args.seconds is not None else (40.0 if args.short else 260.0)
    cfg = Config(
        short=args.short,
        seconds=seconds,
        workers=args.workers,
        rate=args.rate if args.rate is not None else (10.0 if args.short else 16.0),
        settle_seconds=75.0 if args.short else 120.0,
        seed=args.seed if args.seed is not None else random.randrange(1 << 30),
        inject_faults=args.inject_faults,
        cells=args.cells,
    )
    harness = Harness(cfg)
    harness.summary_path = args.summary
    log(
        f"run {harness.run_id} ({'short' if cfg.short else 'full'}{', cells' if cfg.cells else ''}), "
        f"seed {cfg.seed}, workdir {harness.work}"
    )
    atexit.register(harness.cleanup)

    def on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Hard bound on the whole run, whatever hangs.
    limit = seconds + cfg.settle_seconds + 300

    def expire() -> None:
        print(f"chaos: hard deadline of {limit:.0f} s passed; cleaning up", file=sys.stderr, flush=True)
        harness.cleanup()
        os._exit(3)

    timer = threading.Timer(limit, expire)
    timer.daemon = True
    timer.start()
    return harness.run()


if __name__ == "__main__":
    sys.exit(main())
