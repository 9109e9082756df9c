"""Orbit under the benchmark contract (bench/systems/__init__.py).

Orbit runs as a user runs it: `python -m orbit.serve orbit.asgi:application` (daphne on uvloop) against a fresh
MariaDB database (with ORBIT_BENCH_PROCESSES=N above 1: `python -m server.supervisor --processes N`, that is
`orbit serve --processes N` without its start-up checks: N daphne processes on one socket),
real SDK Worker processes (`python -m bench.systems.orbit_worker`),
submitters in this process calling the SDK's Client (W1's one-by-one submits,
from threads, as the Celery and django-q2 harnesses call theirs) or httpx (queue
set-up and :batch pre-loads). W0 and W5 run in-process scripts with Orbit's
interpreter (`-m bench.systems.orbit_shapes`, `-m bench.systems.orbit_backlog`).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import common
from orbit_sdk import Client, SubmitTaskRequest

NAME = "orbit"
DURABILITY = (
    "a submit is answered after its MariaDB transaction commits (innodb_flush_log_at_trx_commit=1, "
    "redo fsynced per commit; concurrent submits of an application share one commit); leases, starts and "
    "results are committed in per-application rounds before any of them is answered or sent; a crash "
    "of any process loses nothing acknowledged"
)
WORKLOADS = ("W0", "W1", "W2", "W3", "W4", "W5", "W6")
NOTES = {
    "W1": "submit = one POST /v1/tasks per task, orbit_sdk.Client.submit_task from 16 threads sharing one "
    "client; drain = backlog pre-loaded with POST /v1/tasks:batch",
    "W2": "backlog pre-loaded with :batch, then drained; overlap and token order checked on the attempts table; "
    "keys10_cap4: the 10 keys under one prefix key policy of capacity 4 (at most 4 holders per key, checked)",
    "W3": "rate_per_second is a database window shared by all nodes; workers report starts after Start approval",
    "W4": "unstarted leases of the killed worker are re-leased after lease expiry; its running attempts become "
    "NEEDS_REVIEW (effect unknown), never re-run blindly",
    "W5": "lease transaction timed in-process on MariaDB; the large backlog is inserted with SQL, not HTTP",
    "W6": "one key under a key policy's GCRA start rate, its tasks loaded ahead of the unkeyed ones in one queue; "
    "a lease skips the key while it has no start room",
}
# Server processes on the one address (server/supervisor.py); 1 = one daphne process, as before.
PROCESSES = int(os.environ.get("ORBIT_BENCH_PROCESSES", "1"))
if PROCESSES < 1:
    raise ValueError(f"ORBIT_BENCH_PROCESSES must be at least 1, not {PROCESSES}")
CONFIG = {
    "server_processes": PROCESSES,
    "db_threads": int(os.environ.get("ORBIT_DB_THREADS", "8")),
    "sdk": "orbit_sdk.Worker",
}

FINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
METRICS_TOKEN = "bench-metrics-token"
# /metrics counters summed over the server processes, by the name they get here.
TRIP_COUNTERS = {
    "orbit_worker_frames_received_total": "frames_in",
    "orbit_worker_frames_sent_total": "frames_out",
    'orbit_groups_decided_total{lane="round"}': "rounds",
}


@dataclass
class Trips:
    """What the server processes and MariaDB have counted so far; the
    difference of two is what a phase cost (frames each way and rounds from
    /metrics, committed transactions from MariaDB's Com_commit)."""

    counts: dict[str, float]

    def per_task(self, since: Trips, tasks: int, prefix: str = "") -> dict[str, float]:
        spent = {name: self.counts.get(name, 0) - since.counts.get(name, 0) for name in self.counts}
        return {
            f"{prefix}frames_per_task": round((spent["frames_in"] + spent["frames_out"]) / tasks, 2),
            f"{prefix}rounds_per_task": round(spent["rounds"] / tasks, 2),
            f"{prefix}transactions_per_task": round(spent["commits"] / tasks, 2),
        }


class Server:
    def __init__(self, database: str) -> None:
        # The pid keeps two runs at once (two checkouts, two invocations) off each other's database.
        self.database = common.fresh_mariadb(f"{database}_{os.getpid()}")
        self.port = common.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "ORBIT_MYSQL_DSN": f"mysql://root:@127.0.0.1:3306/{self.database}",
            "ORBIT_HTTP_ADDR": f"127.0.0.1:{self.port}",
            "ORBIT_METRICS_TOKEN": METRICS_TOKEN,
        }
        self.work = common.work_dir(f"orbit-{database}")
        subprocess.run(
            [str(common.ORBIT_PYTHON), "manage.py", "migrate", "-v0"], cwd=common.ROOT, env=self.env, check=True
        )
        credentials = self.work / "credentials.json"
        credentials.unlink(missing_ok=True)
        subprocess.run(
            [
                str(common.ORBIT_PYTHON),
                "manage.py",
                "orbit_bootstrap",
                "--application",
                "bench",
                "--namespace",
                "bench",
                "--environment",
                "bench",
                "--queue",
                "bootstrap",
                "--worker-access",
                "--output",
                str(credentials),
            ],
            cwd=common.ROOT,
            env=self.env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        self.token = json.loads(credentials.read_text())["token"]
        server = ["orbit.serve"] if PROCESSES == 1 else ["server.supervisor", "--processes", str(PROCESSES)]
        log = self.work / "server.log"
        self.proc = common.spawn(
            [
                str(common.ORBIT_PYTHON),
                "-m",
                *server,
                "-b",
                "127.0.0.1",
                "-p",
                str(self.port),
                "orbit.asgi:application",
            ],
            env=self.env,
            cwd=common.ROOT,
            log=log,
        )
        # The supervisor's socket accepts at once; it serves once every process listens,
        # which its start-up line says (one daphne process listens when it serves).
        if PROCESSES == 1:
            started = common.wait_until(lambda: common.tcp_up(self.port), 30)
        else:
            started = common.wait_until(lambda: log.exists() and b"orbit: serving on " in log.read_bytes(), 30)
        if not started:
            raise RuntimeError("orbit server did not start")
        self.http = httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=120)

    async def create_queue(self, name: str, **limits: int) -> str:
        body = {
            "name": name,
            "max_concurrency": 100000,
            "rate_per_second": 1000000,
            "max_unfinished_tasks": 1000000,
            **limits,
        }
        response = await self.http.post("/v1/queues", json=body, headers={"Idempotency-Key": f"queue-{name}"})
        response.raise_for_status()
        return response.json()["data"]["queue"]["id"]

    async def key_policy(self, match: dict[str, str], capacity: int, rate: dict[str, int] | None = None) -> None:
        """A key policy (SPEC §12) over HTTP, as any client makes one."""
        body: dict = {"match": match, "capacity": capacity, "reason": "bench"}
        if rate is not None:
            body["rate"] = rate
        name = json.dumps(match, sort_keys=True)
        response = await self.http.post("/v1/key-policies", json=body, headers={"Idempotency-Key": f"policy-{name}"})
        response.raise_for_status()

    async def preload(self, queue_id: str, labels: list[str], extra=lambda label: {}) -> None:
        for start in range(0, len(labels), 500):
            items = [
                {"idempotency_key": f"pre-{label}", "task": task_body(queue_id, label, **extra(label))}
                for label in labels[start : start + 500]
            ]
            response = await self.http.post("/v1/tasks:batch", json={"tasks": items})
            response.raise_for_status()
            bad = [r for r in response.json()["data"]["results"] if r["status"] not in (200, 201)]
            if bad:
                raise RuntimeError(f"preload refused: {bad[:3]}")

    def workers(
        self,
        queue_ids: list[str],
        count: int,
        capacity: int,
        events: common.EventLog,
        role: str = "w",
        ledger: Path | None = None,
    ) -> list[subprocess.Popen]:
        procs = []
        for n in range(count):
            argv = [
                str(common.ORBIT_PYTHON),
                "-m",
                "bench.systems.orbit_worker",
                self.url,
                self.token,
                ",".join(queue_ids),
                str(capacity),
                f"{role}-{n}-{time.time_ns()}",
            ]
            if ledger:
                argv.append(str(ledger))
            procs.append(
                common.spawn(
                    argv,
                    env={**os.environ, **events.env(role)},
                    cwd=common.ROOT,
                    log=self.work / f"worker-{role}-{n}.log",
                )
            )
        return procs

    def trips(self) -> Trips:
        """The trip counters now, over every server process: with several, the
        counters are kept in prometheus-client's multiprocess mode, so any one
        scrape is already the node's total."""
        text = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10).text
        counts = {name: 0.0 for name in TRIP_COUNTERS.values()}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name in TRIP_COUNTERS:
                counts[TRIP_COUNTERS[name]] = float(value)
        ((_, commits),) = self.query("SHOW GLOBAL STATUS LIKE 'Com_commit'")
        return Trips({**counts, "commits": float(commits)})

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        db = common.mariadb_connect(self.database)
        try:
            cursor = db.cursor()
            cursor.execute(sql, params)
            return list(cursor.fetchall())
        finally:
            db.close()

    async def close(self) -> None:
        await self.http.aclose()
        common.stop_process(self.proc)
        common.drop_mariadb(self.database)


def task_body(queue_id: str, label: str, **extra: object) -> dict:
    return {
        "queue_id": queue_id,
        "handler": "noop",
        "handler_version": "v1",
        "payload_version": "v1",
        "payload": {"k": label, **extra.pop("payload", {})},
        **extra,
    }


def wait_done(events: common.EventLog, labels: list[str], deadline: float) -> None:
    while events.poll().done_count(labels) < len(labels):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{events.done_count(labels)}/{len(labels)} tasks done before the deadline")
        time.sleep(0.05)


def wait_ready(events: common.EventLog, count: int, deadline: float) -> None:
    while len(events.poll().ready) < count:
        if time.monotonic() > deadline:
            raise TimeoutError("workers did not start")
        time.sleep(0.05)


def drain_span(events: common.EventLog, labels: list[str]) -> float:
    """The harness's drain rule: first task start to last completion."""
    first = min(events.starts[label][0][0] for label in labels)
    return max(events.dones[label][0][0] for label in labels) - first


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        common.stop_process(proc, timeout=5)


def submit_one_by_one(server: Server, queue_id: str, labels: list[str], submitters: int) -> dict[str, float]:
    """Each label submitted on its own by the SDK's Client, from `submitters`
    threads sharing it (httpx.Client is thread-safe); the first refusal
    (an APIError, e.g. QUEUE_FULL) or replay stops the run."""
    sent: dict[str, float] = {}
    pending = iter(labels)
    take = threading.Lock()
    failures: list[BaseException] = []

    def submitter() -> None:
        while not failures:
            with take:
                label = next(pending, None)
            if label is None:
                return
            sent[label] = common.now()
            request = SubmitTaskRequest(
                queue_id=queue_id, handler="noop", handler_version="v1", payload_version="v1", payload={"k": label}
            )
            try:
                if client.submit_task(f"w1-{label}", request).deduplicated:  # a fresh key must be accepted
                    raise RuntimeError(f"w1-{label} answered as a replay")
            except BaseException as exc:  # noqa: BLE001 - re-raised below, in the harness's thread
                failures.append(exc)

    with Client(server.url, server.token, timeout=120) as client:
        threads = [threading.Thread(target=submitter, daemon=True) for _ in range(submitters)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failures:
        raise RuntimeError(f"submit refused: {failures[0]}") from failures[0]
    return sent


async def w1(scale: dict, deadline: float) -> dict:
    server = Server(f"bench_orbit_w1_{scale['run']}")
    procs: list[subprocess.Popen] = []
    try:
        queue_id = await server.create_queue("w1")
        events = common.EventLog(common.work_dir(f"orbit-w1-events-{time.time_ns()}"))
        procs = server.workers([queue_id], scale["workers"], scale["capacity"], events)
        wait_ready(events, scale["workers"], deadline)
        labels = [f"t{n}" for n in range(scale["tasks"])]
        trips = server.trips()
        meter = common.CpuMeter([server.proc.pid], ["mariadb"]).start()
        began = common.now()
        sent = await asyncio.to_thread(submit_one_by_one, server, queue_id, labels, scale["submitters"])
        submitted = common.now()
        wait_done(events, labels, deadline)
        meter.stop()
        time.sleep(0.3)  # the last results' rounds are counted
        finished = max(events.dones[label][0][0] for label in labels)
        result = {
            "server_processes": PROCESSES,
            "tasks": len(labels),
            "seconds": round(finished - began, 3),
            "tasks_per_s": round(len(labels) / (finished - began), 1),
            "submit_per_s": round(len(labels) / (submitted - began), 1),
            **common.latency_metrics([events.starts[label][0][0] - sent[label] for label in labels]),
            **meter.per_1k(len(labels)),
            **server.trips().per_task(trips, len(labels)),
        }
        stop_all(procs)
        drain_queue = await server.create_queue("w1-drain")
        drain_labels = [f"d{n}" for n in range(scale["tasks"])]
        await server.preload(drain_queue, drain_labels)
        trips = server.trips()
        drain_events = common.EventLog(common.work_dir(f"orbit-w1-drain-{time.time_ns()}"))
        procs = server.workers([drain_queue], scale["workers"], scale["capacity"], drain_events)
        wait_done(drain_events, drain_labels, deadline)
        seconds = drain_span(drain_events, drain_labels)
        time.sleep(0.3)
        result.update(
            drain_tasks=len(drain_labels),
            drain_seconds=round(seconds, 3),
            drain_tasks_per_s=round(len(drain_labels) / seconds, 1),
            **server.trips().per_task(trips, len(drain_labels), prefix="drain_"),
        )
        return result
    finally:
        stop_all(procs)
        await server.close()


def holders_max(server: Server, queue_id: str) -> int:
    """The most permits any one key of the queue held at one moment (from the attempts'
    leased_at to finished_at; an end at the moment of a grant does not overlap it)."""
    rows = server.query(
        "SELECT concurrency_key, leased_at, finished_at FROM orbit_attempt WHERE queue_id=%s", (queue_id,)
    )
    by_key: dict[str, list[tuple[float, int]]] = {}
    for key, leased, finished in rows:
        moments = by_key.setdefault(key, [])
        moments += [(leased.timestamp(), 1), ((finished or leased).timestamp(), -1)]
    most = 0
    for moments in by_key.values():
        held = 0
        for _, step in sorted(moments):
            held += step
            most = max(most, held)
    return most


def key_checks(server: Server, queue_id: str) -> tuple[bool, int, bool]:
    rows = server.query(
        "SELECT concurrency_key, leased_at, finished_at, concurrency_token FROM orbit_attempt "
        "WHERE queue_id=%s ORDER BY concurrency_key, leased_at, concurrency_token",
        (queue_id,),
    )
    intervals = [(key, leased.timestamp(), (finished or leased).timestamp()) for key, leased, finished, _ in rows]
    overlap_ok, overlaps = common.overlap_check(intervals)
    increasing = True
    last: dict[str, int] = {}
    for key, _, _, token in rows:
        if token is None or token <= last.get(key, 0):
            increasing = False
        last[key] = token or 0
    return overlap_ok, overlaps, increasing


async def w2(scale: dict, deadline: float) -> dict:
    server = Server(f"bench_orbit_w2_{scale['run']}")
    result: dict = {
        "server_processes": PROCESSES,
        "tasks": scale["tasks"],
        "overlap_ok": True,
        "overlaps": 0,
        "tokens_increasing": True,
    }
    try:
        for keys in scale["keys"]:
            queue_id = await server.create_queue(f"w2-{keys}")
            labels = [f"k{keys}-{n}" for n in range(scale["tasks"])]
            await server.preload(
                queue_id,
                labels,
                lambda label, keys=keys: {"concurrency_key": f"object/{int(label.rsplit('-', 1)[1]) % keys}"},
            )
            events = common.EventLog(common.work_dir(f"orbit-w2-{keys}-{time.time_ns()}"))
            trips = server.trips()
            procs = server.workers([queue_id], scale["workers"], scale["capacity"], events)
            try:
                wait_done(events, labels, deadline)
                time.sleep(0.3)
                spent = server.trips().per_task(trips, len(labels), prefix=f"keys{keys}_")
            finally:
                stop_all(procs)
            seconds = drain_span(events, labels)
            result[f"tasks_per_s_keys{keys}"] = round(len(labels) / seconds, 1)
            result.update(spent)
            overlap_ok, overlaps, increasing = key_checks(server, queue_id)
            result["overlap_ok"] = result["overlap_ok"] and overlap_ok
            result["overlaps"] += overlaps
            result["tokens_increasing"] = result["tokens_increasing"] and increasing
        # The 10 keys again, each with 4 permits (one prefix policy): holders per key up to 4.
        queue_id = await server.create_queue("w2-10-cap4")
        await server.key_policy({"prefix": "cap4/"}, CAP4)
        labels = [f"c10-{n}" for n in range(scale["tasks"])]
        await server.preload(queue_id, labels, lambda label: {"concurrency_key": f"cap4/{int(label[4:]) % 10}"})
        events = common.EventLog(common.work_dir(f"orbit-w2-cap4-{time.time_ns()}"))
        procs = server.workers([queue_id], scale["workers"], scale["capacity"], events)
        try:
            wait_done(events, labels, deadline)
        finally:
            stop_all(procs)
        result["tasks_per_s_keys10_cap4"] = round(len(labels) / drain_span(events, labels), 1)
        result["keys10_cap4_holders_max"] = holders_max(server, queue_id)
        _, _, increasing = key_checks(server, queue_id)
        result["tokens_increasing"] = result["tokens_increasing"] and increasing
        result["cap4_within_capacity"] = result["keys10_cap4_holders_max"] <= CAP4
        return result
    finally:
        await server.close()


# W2's capacity variant: permits per key of its 10 keys.
CAP4 = 4


async def w6(scale: dict, deadline: float) -> dict:
    """Unkeyed tasks drained alone, then again in one queue with a backlog of one
    rate-limited key loaded ahead of them: the unkeyed throughput must not drop (the lease
    skips the key while it has no start room: no head-of-line blocking), and the key
    starts at up to its rate. The rate is checked on Starts, which come a round trip after
    their lease: with burst 1 each Start's delay pushes the next one back (achieved rate
    about 1 / (T + that delay)); a burst of 4 absorbs it (the `_burst4` figures)."""
    server = Server(f"bench_orbit_w6_{scale['run']}")
    rate = scale["key_rate"]
    result: dict = {"server_processes": PROCESSES, "tasks": scale["tasks"], "key_rate": rate}
    try:
        phases = [("alone", None, 0), ("with_limited_key", "limited", 1), ("with_limited_key_burst4", "limited-b4", 4)]
        for phase, key, burst in phases:
            if key is not None:
                await server.key_policy({"key": key}, 1000, {"starts": rate, "per_seconds": 1, "burst": burst})
            queue_id = await server.create_queue(f"w6-{phase}")
            limited = [f"{phase}-l{n}" for n in range(rate * scale["key_rate_seconds"])] if key else []
            unkeyed = [f"{phase}-u{n}" for n in range(scale["tasks"])]
            # The limited key's tasks first: the oldest, at the head of the queue.
            await server.preload(queue_id, limited, lambda label, key=key: {"concurrency_key": key})
            await server.preload(queue_id, unkeyed)
            events = common.EventLog(common.work_dir(f"orbit-w6-{phase}-{time.time_ns()}"))
            procs = server.workers([queue_id], scale["workers"], scale["capacity"], events)
            try:
                wait_done(events, unkeyed, deadline)
                unkeyed_span = drain_span(events, unkeyed)
                wait_done(events, limited, deadline)
            finally:
                stop_all(procs)
            result[f"unkeyed_tasks_per_s_{phase}"] = round(len(unkeyed) / unkeyed_span, 1)
            if not limited:
                continue
            suffix = "" if burst == 1 else f"_burst{burst}"
            starts = sorted(events.starts[label][0][0] for label in limited)
            result[f"limited_key_starts{suffix}"] = len(starts)
            result[f"limited_key_achieved_rate{suffix}"] = round((len(starts) - 1) / (starts[-1] - starts[0]), 2)
            worst, j = 0, 0
            for i, at in enumerate(starts):
                while starts[j] <= at - 1.0:
                    j += 1
                worst = max(worst, i - j + 1)
            # Most Starts in a sliding 1 s; the bound is rate + burst.
            result[f"limited_key_worst_window{suffix}"] = worst
            unkeyed_done = max(events.dones[label][0][0] for label in unkeyed)
            result[f"limited_key_started_by_unkeyed_end{suffix}"] = sum(1 for at in starts if at <= unkeyed_done)
        result["unkeyed_ratio_with_vs_alone"] = round(
            result["unkeyed_tasks_per_s_with_limited_key"] / result["unkeyed_tasks_per_s_alone"], 2
        )
        return result
    finally:
        await server.close()


async def w3(scale: dict, deadline: float) -> dict:
    server = Server(f"bench_orbit_w3_{scale['run']}")
    procs: list[subprocess.Popen] = []
    try:
        rate, seconds = scale["rate"], scale["rate_seconds"]
        queue_id = await server.create_queue("w3", rate_per_second=rate)
        labels = [f"r{n}" for n in range(int(rate * (seconds + 5) * 1.5))]  # more demand than the limit
        await server.preload(queue_id, labels)
        events = common.EventLog(common.work_dir(f"orbit-w3-{time.time_ns()}"))
        procs = server.workers([queue_id], scale["workers"], scale["capacity"], events)
        while not events.poll().starts:
            if time.monotonic() > deadline:
                raise TimeoutError("orbit W3: no task started")
            time.sleep(0.05)
        # The window is measured from the first start (workers connect at their own pace
        # on a loaded machine), so wait for all of it, not for a time from their launch.
        t0 = min(record[0] for records in events.starts.values() for record in records) + 1.0
        wait_s = t0 + seconds + 0.5 - common.now()
        if time.monotonic() + wait_s > deadline:
            raise TimeoutError("orbit W3: not enough time left")
        time.sleep(max(0.0, wait_s))
        starts = [record[0] for records in events.poll().starts.values() for record in records]
        return {"server_processes": PROCESSES, **common.rate_metrics(starts, rate, seconds, t0)}
    finally:
        stop_all(procs)
        await server.close()


async def w4(scale: dict, deadline: float) -> dict:
    server = Server(f"bench_orbit_w4_{scale['run']}")
    procs: list[subprocess.Popen] = []
    try:
        queue_id = await server.create_queue("w4")
        labels = [f"c{n}" for n in range(scale["crash_tasks"])]
        await server.preload(
            queue_id,
            labels,
            lambda label: {
                "concurrency_key": f"object/{label}",
                "lease_seconds": scale["lease_seconds"],
                "payload": {"sleep": 0.3},
            },
        )
        events = common.EventLog(common.work_dir(f"orbit-w4-{time.time_ns()}"))
        ledger = server.work / "ledger.json"
        victim = server.workers([queue_id], 1, 16, events, role="victim", ledger=ledger)[0]
        wait_ready(events, 1, deadline)
        while sum(1 for records in events.poll().starts.values() for r in records if r[2] == "victim") < 8:
            time.sleep(0.02)
        t_kill = common.now()
        common.kill9(victim)
        procs = server.workers([queue_id], 1, 16, events, role="survivor", ledger=ledger)
        while True:
            states = dict(
                server.query("SELECT state, COUNT(*) FROM orbit_task WHERE queue_id=%s GROUP BY state", (queue_id,))
            )
            if sum(count for state, count in states.items() if state in FINAL) == len(labels):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"tasks not settled: {states}")
            time.sleep(0.1)
        # What the victim held at the kill, judged by how each attempt ended:
        # EXPIRED = leased but not started (re-leased), UNKNOWN = running (review).
        held = server.query(
            "SELECT task_id, state, finished_at FROM orbit_attempt WHERE queue_id=%s AND worker_id LIKE 'victim-%%' "
            "AND state IN ('EXPIRED', 'UNKNOWN')",
            (queue_id,),
        )
        expired = {task_id for task_id, state, _ in held if state == "EXPIRED"}
        recovered_at = [finished.timestamp() - t_kill for _, _, finished in held if finished is not None]
        releases = server.query(
            "SELECT task_id, MIN(leased_at) FROM orbit_attempt WHERE queue_id=%s AND worker_id LIKE 'survivor-%%' "
            "GROUP BY task_id",
            (queue_id,),
        )
        re_leased = {task_id: leased.timestamp() - t_kill for task_id, leased in releases if task_id in expired}
        succeeded_twice = server.query(
            "SELECT COUNT(*) FROM (SELECT task_id FROM orbit_attempt WHERE queue_id=%s AND state='SUCCEEDED' "
            "GROUP BY task_id HAVING COUNT(*) > 1) twice",
            (queue_id,),
        )[0][0]
        ledger_state = json.loads(ledger.read_text() or "{}") if ledger.exists() else {}
        # Runs beyond a task's first (Orbit never re-runs an attempt whose effect is unknown).
        reruns = sum(max(0, len(records) - 1) for records in events.starts.values())
        return {
            "server_processes": PROCESSES,
            "tasks": len(labels),
            "held_total": len(held),
            "held_running": len(held) - len(expired),
            "needs_review": states.get("NEEDS_REVIEW", 0),
            "recovered_s": round(max(recovered_at), 3) if recovered_at else None,
            "first_rerun_s": round(min(re_leased.values()), 3) if re_leased else None,
            "relapse_s": round(max(re_leased.values()), 3) if re_leased and len(re_leased) == len(expired) else None,
            "lost": len(labels) - sum(count for state, count in states.items() if state in FINAL),
            "duplicates": succeeded_twice,
            "extra_executions": reruns,
            "stale_writes_rejected": ledger_state.get("rejected", 0),
            "fenced_writes": ledger_state.get("writes", 0),
        }
    finally:
        stop_all(procs)
        await server.close()


def in_process(module: str, *args: str, timeout: float) -> dict:
    """``python -m bench.systems.<module> <args>`` with Orbit's interpreter, from the root."""
    out = subprocess.run(
        [str(common.ORBIT_PYTHON), "-m", f"bench.systems.{module}", *args],
        cwd=common.ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{module} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(workload: str, scale: dict) -> dict:
    deadline = time.monotonic() + scale["deadline_s"]
    if workload == "W0":
        return in_process(
            "orbit_shapes",
            "--seconds",
            str(scale["w0_seconds"]),
            "--run",
            str(scale["run"]),
            timeout=scale["deadline_s"],
        )
    if workload == "W5":
        return in_process(
            "orbit_backlog",
            "--small",
            str(scale["backlog_small"]),
            "--large",
            str(scale["backlog_large"]),
            "--samples",
            str(scale["lease_samples"]),
            "--run",
            str(scale["run"]),
            timeout=scale["deadline_s"],
        )
    runner = {"W1": w1, "W2": w2, "W3": w3, "W4": w4, "W6": w6}[workload]
    return asyncio.run(runner(scale, deadline))
