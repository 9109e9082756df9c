"""One chaos worker process: an orbit_sdk.Worker whose handler keeps a ledger.

Every execution appends JSON lines to this process's own ledger file: a
"start" line when the handler begins and an "end" line when it returns, with
the task, attempt, concurrency key, permit token and wall-clock times. The
harness reads the ledgers afterwards (a worker killed with -9 leaves "start"
lines without an "end"; the harness knows when it killed the process).

Keyed executions also write to a fenced resource: one file per permit (the
key, and its slot on a key of capacity above 1), updated under flock, that
refuses a token lower than the highest it has accepted (the keyed-concurrency
seed's resource model; holders of different slots of one key both write, as
the SDK's fencing guard lets them). A refused write is recorded as "stale" and
the handler reports a retryable failure.

SIGTERM drains the worker (in-flight work finishes and reports); SIGKILL is
what the harness uses to simulate a crash.

    python reliability/worker.py --url http://127.0.0.1:8001 --token-file cred.json \\
        --queues Q1,Q2 --worker-id chaos-w1-1 --capacity 4 --ledger ledger.jsonl --resources DIR
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "sdk")]

from orbit_sdk import Execution, RetryableError, Worker  # noqa: E402

HANDLER = ("chaos.work", "v1")


class Ledger:
    def __init__(self, path: Path, worker_id: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
        self._lock = threading.Lock()
        self.worker_id = worker_id

    def write(self, **record: object) -> None:
        line = json.dumps({"worker_id": self.worker_id, "pid": os.getpid(), **record}, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()


class FencedResource:
    """Per-permit files shared by all worker processes; check-and-raise under flock."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def write(self, key: str, slot: int | None, token: int) -> tuple[str, int]:
        permit = key.encode() if slot is None else key.encode() + b"\0" + str(slot).encode()
        path = self.directory / (hashlib.sha256(permit).hexdigest()[:32] + ".json")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 4096, 0)
            highest = json.loads(raw)["highest"] if raw else 0
            if token < highest:
                return "stale", highest
            data = json.dumps({"key": key, "slot": slot, "highest": token}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            return "accepted", highest
        finally:
            os.close(fd)  # releases the flock


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--queues", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--resources", required=True)
    args = parser.parse_args()

    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s {args.worker_id} %(name)s %(levelname)s %(message)s"
    )
    token = json.loads(Path(args.token_file).read_text())["token"]
    ledger = Ledger(Path(args.ledger), args.worker_id)
    resource = FencedResource(Path(args.resources))

    def handle(execution: Execution) -> dict[str, str | None]:
        key = execution.concurrency_key
        token = execution.concurrency_token
        slot = execution.concurrency_slot
        common = {
            "task_id": execution.task.id,
            "attempt_id": execution.attempt_id,
            "number": execution.attempt_number,
            "key": key,
            "token": str(token) if token is not None else None,
            "slot": slot,
            "idem": execution.payload.get("idem"),
        }
        # A pipeline's dependent (SPEC §13): what its assignment said of each dependency, for
        # the harness to hold against the rows (states final, outputs of those that succeeded).
        dependencies = [
            {"task_id": d.task_id, "state": d.state, "output": d.output is not None} for d in execution.dependencies
        ]
        ledger.write(event="start", t=time.time(), **common, **({"dependencies": dependencies} if dependencies else {}))
        # Sleep, but stop early if the server says the lease is gone.
        execution.wait_cancelled(execution.payload.get("sleep_ms", 100) / 1000)
        verdict, highest = ("unkeyed", 0) if key is None else resource.write(key, slot, token)
        ledger.write(
            event="end",
            t=time.time(),
            write=verdict,
            highest_seen=str(highest),
            lease_lost=execution.lease_lost,
            **common,
        )
        if verdict == "stale":
            raise RetryableError(f"stale token {token} < {highest} for {key}")
        if execution.payload.get("fail_first") and execution.attempt_number == 1:
            raise RetryableError("first attempt fails on purpose")
        if execution.payload.get("fail_always"):  # a pipeline's failing task: every attempt, retries exhausted
            raise RetryableError("fails on every attempt on purpose")
        return {"worker_id": args.worker_id, "token": common["token"]}

    worker = Worker(
        args.url,
        token,
        queues=args.queues.split(","),
        handlers={HANDLER: handle},
        capacity=args.capacity,
        concurrency_keys=True,
        worker_id=args.worker_id,
        version="chaos/1",
        request_timeout=10.0,
        min_reconnect_delay=0.2,
        max_reconnect_delay=1.0,
    )
    signal.signal(signal.SIGTERM, lambda *_: worker.drain())
    signal.signal(signal.SIGINT, lambda *_: worker.drain())
    failure: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:  # noqa: BLE001 - reported through the exit code
            failure.append(exc)
            logging.getLogger("chaos.worker").exception("worker stopped")

    thread = threading.Thread(target=run, name="worker", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
