"""Orbit throughput benchmark: a real server on loopback against MariaDB.

Starts daphne on a fresh database, connects N protocol workers (asyncio,
pipelined: start → result as soon as the assignment arrives), submits tasks over
HTTP from concurrent submitters, and prints submit rate, completion rate and
submit→start latency percentiles. With --keys it spreads tasks over that many
concurrency keys and checks from the attempts table that no two attempts of a
key overlapped and that tokens strictly increase per key.

    .venv/bin/python bench/orbit_bench.py --tasks 10000 --workers 4
    .venv/bin/python bench/orbit_bench.py --tasks 10000 --workers 4 --keys 1,10,100

Not a test: it prints figures. Everything it starts, it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import MySQLdb
from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fresh_database(name: str) -> str:
    db = MySQLdb.connect(host="127.0.0.1", user="root", passwd="")
    cursor = db.cursor()
    cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
    cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
    db.close()
    return f"mysql://root:@127.0.0.1:3306/{name}"


@dataclass
class Server:
    dsn: str
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "ORBIT_MYSQL_DSN": self.dsn, "ORBIT_HTTP_ADDR": f"127.0.0.1:{self.port}"}

    def prepare(self, credentials: Path) -> dict:
        subprocess.run([PYTHON, "manage.py", "migrate", "-v0"], cwd=ROOT, env=self.env(), check=True)
        credentials.unlink(missing_ok=True)
        subprocess.run(
            [
                PYTHON,
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
            cwd=ROOT,
            env=self.env(),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(credentials.read_text())

    def start(self) -> None:
        self.log = open(ROOT / ".local" / "bench-server.log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            [PYTHON, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "orbit.asgi:application"],
            cwd=ROOT,
            env=self.env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        for _ in range(300):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Run:
    total: int
    submitted_at: dict[str, float] = field(default_factory=dict)
    started_at: dict[str, float] = field(default_factory=dict)
    completed: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


async def worker(url: str, token: str, queue_ids: list[str], capacity: int, name: str, run: Run) -> None:
    ids = itertools.count()
    pending: dict[str, tuple[str, dict]] = {}
    async with connect(
        url.replace("http", "ws") + "/v1/workers/connect",
        additional_headers={"Authorization": f"Bearer {token}"},
        max_size=None,
    ) as ws:

        async def send(kind: str, **fields: object) -> str:
            request_id = f"{name}-{next(ids)}"
            await ws.send(json.dumps({"id": request_id, "type": kind, **fields}))
            return request_id

        await send(
            "hello",
            worker_id=name,
            queues=queue_ids,
            capacity=capacity,
            handlers=[],
            concurrency_keys=True,
            version="bench",
        )
        async for raw in ws:
            frame = json.loads(raw)
            kind = frame.get("type")
            if kind == "task.assign":
                ref = {"attempt_id": frame["attempt_id"], "epoch": frame["epoch"]}
                pending[await send("task.start", **ref)] = ("start", {**ref, "task_id": frame["task"]["id"]})
            elif kind == "task.start.ok":
                _, ref = pending.pop(frame["reply_to"])
                run.started_at[ref.pop("task_id")] = time.perf_counter()
                pending[await send("task.result", outcome="SUCCEEDED", retryable=False, **ref)] = ("result", ref)
            elif kind == "task.result.ok":
                pending.pop(frame["reply_to"], None)
                run.completed += 1
                if run.completed >= run.total:
                    run.done.set()
            elif kind == "error":
                what, ref = pending.pop(frame.get("reply_to"), ("?", {}))
                if frame["code"] == "RATE_LIMITED" and what == "start":
                    await asyncio.sleep(frame.get("retry_after_ms", 10) / 1000)
                    pending[await send("task.start", attempt_id=ref["attempt_id"], epoch=ref["epoch"])] = (what, ref)
                elif frame["code"] != "LEASE_LOST":
                    print("worker error:", frame, file=sys.stderr)


async def submit_all(url: str, token: str, queue_id: str, count: int, concurrency: int, keys: int, run: Run) -> float:
    numbers = iter(range(count))
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:

        async def submitter() -> None:
            for n in numbers:
                body = {
                    "queue_id": queue_id,
                    "handler": "noop",
                    "handler_version": "v1",
                    "payload_version": "v1",
                    "payload": {"n": n},
                }
                if keys:
                    body["concurrency_key"] = f"object/{n % keys}"
                sent = time.perf_counter()
                response = await client.post("/v1/tasks", json=body, headers={"Idempotency-Key": f"bench-{n}"})
                if response.status_code != 201:
                    raise RuntimeError(f"submit failed: {response.status_code} {response.text}")
                run.submitted_at[response.json()["data"]["task"]["id"]] = sent

        began = time.perf_counter()
        await asyncio.gather(*(submitter() for _ in range(concurrency)))
        return time.perf_counter() - began


async def create_queue(url: str, token: str, name: str) -> str:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}) as client:
        response = await client.post(
            "/v1/queues",
            json={"name": name, "max_concurrency": 100000, "rate_per_second": 1000000, "max_unfinished_tasks": 1000000},
            headers={"Idempotency-Key": f"bench-queue-{name}"},
        )
        response.raise_for_status()
        return response.json()["data"]["queue"]["id"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def keyed_checks(dsn_name: str, queue_id: str) -> tuple[bool, bool]:
    db = MySQLdb.connect(host="127.0.0.1", user="root", passwd="", db=dsn_name)
    cursor = db.cursor()
    cursor.execute(
        "SELECT concurrency_key, leased_at, finished_at, concurrency_token FROM orbit_attempt "
        "WHERE queue_id=%s AND concurrency_key<>'' ORDER BY concurrency_key, concurrency_token",
        (queue_id,),
    )
    overlap_free = True
    increasing = True
    previous: dict[str, tuple] = {}
    for key, leased_at, finished_at, token in cursor.fetchall():
        if key in previous:
            _, prev_finished, prev_token = previous[key]
            if prev_finished is None or leased_at < prev_finished:
                overlap_free = False
            if token <= prev_token:
                increasing = False
        previous[key] = (leased_at, finished_at, token)
    db.close()
    return overlap_free, increasing


async def scenario(server: Server, creds: dict, args: argparse.Namespace, keys: int, label: str) -> dict:
    queue_id = await create_queue(server.url, creds["token"], f"bench-{label}-{int(time.time() * 1000)}")
    run = Run(total=args.tasks)
    workers = [
        asyncio.create_task(worker(server.url, creds["token"], [queue_id], args.capacity, f"{label}-w{i}", run))
        for i in range(args.workers)
    ]
    began = time.perf_counter()
    submit_seconds = await submit_all(server.url, creds["token"], queue_id, args.tasks, args.submitters, keys, run)
    await asyncio.wait_for(run.done.wait(), timeout=args.timeout)
    total_seconds = time.perf_counter() - began
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    latencies = [run.started_at[t] - run.submitted_at[t] for t in run.started_at if t in run.submitted_at]
    result = {
        "scenario": label,
        "tasks": args.tasks,
        "workers": args.workers,
        "capacity": args.capacity,
        "submit_rate": round(args.tasks / submit_seconds, 1),
        "completion_rate": round(args.tasks / total_seconds, 1),
        "latency_p50_ms": round(statistics.median(latencies) * 1000, 1),
        "latency_p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
    }
    if keys:
        overlap_free, increasing = keyed_checks(server.dsn.rsplit("/", 1)[1], queue_id)
        result.update(keys=keys, no_overlap=overlap_free, tokens_increasing=increasing)
    return result


async def main_async(args: argparse.Namespace) -> list[dict]:
    server = Server(dsn=fresh_database(args.database))
    credentials = ROOT / ".local" / "bench.credentials.json"
    credentials.parent.mkdir(exist_ok=True)
    creds = server.prepare(credentials)
    server.start()
    results = []
    try:
        for keys in args.keys:
            label = f"keys{keys}" if keys else "unkeyed"
            result = await scenario(server, creds, args, keys, label)
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=10000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--submitters", type=int, default=16)
    parser.add_argument("--keys", default="0", help="comma-separated key counts; 0 = unkeyed, e.g. 0,1,10,100")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--database", default="orbit_bench")
    args = parser.parse_args()
    args.keys = [int(k) for k in args.keys.split(",")]
    results = asyncio.run(main_async(args))
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "orbit_bench.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
