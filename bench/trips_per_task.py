"""Frames and rounds per task: what one task costs in trips, keyed and unkeyed.

Starts a private MariaDB (reliability/mariadb.py), an Orbit server of the
checkout given (default: this one) on it, and one worker-protocol client that
does what the SDK worker does for each assignment: (optionally) acknowledge
it, send task.start, then task.result (with --start-next, as the SDK does, each
result asks for what its answer hands on to arrive started, and a started
assignment gets its result at once). It counts the frames each way and the
transactions the database committed (MariaDB's Com_commit: every round, lease,
start and result is one) and the row statements it ran (SELECT, INSERT, UPDATE,
DELETE), per task, for N unkeyed tasks and N tasks over K
keys. Run it from any checkout against another to compare:

    .venv/bin/python -m bench.trips_per_task                       # this checkout
    .venv/bin/python -m bench.trips_per_task --repo /tmp/before    # another one
    .venv/bin/python -m bench.trips_per_task --no-ack              # Start as the acknowledgement
    .venv/bin/python -m bench.trips_per_task --no-ack --start-next # and the Start sent ahead
(from this checkout's root: the harness and its private MariaDB come from here)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

from bench.private_orbit import private_orbit
from reliability.mariadb import PrivateMariaDB

HERE = Path(__file__).resolve().parent


STATEMENTS = ("Com_select", "Com_insert", "Com_update", "Com_delete")


def counters(db: PrivateMariaDB) -> dict[str, int]:
    """The server's commits and row statements so far (the private server serves this bench only)."""
    connection = db.connect()
    try:
        cursor = connection.cursor()
        names = ", ".join(f"'{name}'" for name in ("Com_commit", *STATEMENTS))
        cursor.execute(f"SHOW GLOBAL STATUS WHERE Variable_name IN ({names})")
        return {name: int(value) for name, value in cursor.fetchall()}
    finally:
        connection.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    with private_orbit(Path(args.repo).resolve(), "trips", Path(tempfile.mkdtemp(prefix="orbit-trips-"))) as orbit:
        db, url, token = orbit.db, orbit.url, orbit.token
        # Its own queue, with room to spare: the bootstrap queue's defaults (8 at once, 100
        # starts a second) would be what is measured, not the trips.
        limits = {"max_concurrency": args.max_concurrency, "rate_per_second": args.rate}
        created = httpx.post(
            f"{url}/v1/queues",
            json={"name": "trips-open", **limits},
            headers={"Authorization": f"Bearer {token}", "Idempotency-Key": uuid.uuid4().hex},
            timeout=10,
        )
        assert created.status_code == 201, created.text
        queue_id = created.json()["data"]["queue"]["id"]
        figures = {}
        for label, keys in (("unkeyed", 0), (f"keyed, {args.keys} keys", args.keys)):
            figures[label] = measure(args, db, url, token, queue_id, keys)
        return figures


def measure(args: argparse.Namespace, db: PrivateMariaDB, url: str, token: str, queue_id: str, keys: int) -> dict:
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=10) as client:
        for n in range(args.tasks):
            body: dict[str, Any] = {
                "queue_id": queue_id,
                "handler": "trip",
                "handler_version": "v1",
                "payload_version": "v1",
                "payload": {"n": n},
            }
            if keys:
                body["concurrency_key"] = f"trip/{n % keys}"
            answer = client.post("/v1/tasks", json=body, headers={"Idempotency-Key": uuid.uuid4().hex})
            assert answer.status_code == 201, answer.text
    before = counters(db)
    sent = received = 0
    with connect(url.replace("http", "ws") + "/v1/workers/connect", additional_headers=headers) as ws:
        ids = iter(range(1, 1 << 30))

        def send(frame: dict[str, Any]) -> None:
            nonlocal sent
            sent += 1
            ws.send(json.dumps(frame))

        send(
            {"id": f"r{next(ids)}", "type": "hello", "worker_id": f"trips-{uuid.uuid4().hex[:8]}", "queues": [queue_id]}
            | {"capacity": args.capacity, "handlers": [], "concurrency_keys": True, "version": "trips"}
        )
        ahead = {"start_next": True} if args.start_next else {}
        done = 0
        began = time.monotonic()
        while done < args.tasks:
            frame = json.loads(ws.recv(timeout=30))
            received += 1
            kind = frame.get("type")
            if kind == "task.assign":
                ref = {"attempt_id": frame["attempt_id"], "epoch": frame["epoch"]}
                if frame.get("state") == "RUNNING":  # its Start went ahead with the last result
                    send({"id": f"r{next(ids)}", "type": "task.result", **ref, "outcome": "SUCCEEDED", **ahead})
                    continue
                if not args.no_ack:
                    send({"type": "task.assign.ack", "attempt_id": frame["attempt_id"]})
                send({"id": f"s:{frame['attempt_id']}:{frame['epoch']}", "type": "task.start", **ref})
            elif kind == "task.start.ok":
                _, attempt_id, epoch = frame["reply_to"].split(":")
                ref = {"attempt_id": attempt_id, "epoch": int(epoch)}
                send({"id": f"r{next(ids)}", "type": "task.result", **ref, "outcome": "SUCCEEDED", **ahead})
            elif kind == "task.result.ok":
                done += 1
            elif kind == "error":
                raise RuntimeError(frame)
        seconds = time.monotonic() - began
    time.sleep(0.5)  # the last rounds' commits land
    after = counters(db)
    transactions = after["Com_commit"] - before["Com_commit"]
    statements = sum(after[name] - before[name] for name in STATEMENTS)
    return {
        "tasks": args.tasks,
        "frames_per_task": round((sent + received) / args.tasks, 2),
        "frames_sent_per_task": round(sent / args.tasks, 2),
        "frames_received_per_task": round(received / args.tasks, 2),
        "transactions_per_task": round(transactions / args.tasks, 2),
        "statements_per_task": round(statements / args.tasks, 2),
        "tasks_per_s": round(args.tasks / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=str(HERE.parent), help="the Orbit checkout whose server to run")
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument("--capacity", type=int, default=16)
    parser.add_argument("--no-ack", action="store_true", help="send no task.assign.ack (Start acknowledges)")
    parser.add_argument("--max-concurrency", type=int, default=100, help="the queue's max_concurrency")
    parser.add_argument("--rate", type=int, default=10000, help="the queue's rate_per_second")
    parser.add_argument("--start-next", action="store_true", help="results ask for the next assignment started")
    args = parser.parse_args()
    for label, row in run(args).items():
        print(f"{label}: " + ", ".join(f"{name}={value}" for name, value in row.items()))


if __name__ == "__main__":
    main()
