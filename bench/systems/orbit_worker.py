"""An Orbit worker process for the benchmark: the real SDK Worker, a no-op
async handler that logs task start/finish to the harness's event log.

Runs with Orbit's own interpreter (it needs orbit_sdk), from the repository root:
    ORBIT_PYTHON -m bench.systems.orbit_worker URL TOKEN QUEUE_ID[,QUEUE_ID] CAPACITY WORKER_ID [LEDGER]

Payload fields it understands: "k" (task label for the event log), "sleep"
(seconds to hold the task), and with a LEDGER file, a fenced write of
(concurrency_key, concurrency_token) that refuses a token below the highest seen.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sys

from bench.common import log_event
from orbit_sdk import Worker


def fenced_write(ledger: str, key: str, token: int) -> bool:
    """The resource side of a permit token: check and raise the highest token atomically."""
    with open(ledger, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        state = json.loads(handle.read() or "{}")
        highest = state.setdefault("highest", {}).get(key, 0)
        accepted = token >= highest
        if accepted:
            state["highest"][key] = token
            state["writes"] = state.get("writes", 0) + 1
        else:
            state["rejected"] = state.get("rejected", 0) + 1
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(state))
        return accepted


def main() -> None:
    url, token, queues, capacity, worker_id = sys.argv[1:6]
    ledger = sys.argv[6] if len(sys.argv) > 6 else None

    async def handler(execution):
        payload = execution.payload if isinstance(execution.payload, dict) else {}
        label = payload.get("k", execution.task.id)
        log_event("S", label)
        if payload.get("sleep"):
            await asyncio.sleep(payload["sleep"])
        if ledger and execution.concurrency_token is not None:
            await asyncio.to_thread(fenced_write, ledger, execution.concurrency_key, execution.concurrency_token)
        log_event("D", label)
        return None

    log_event("R", worker_id)
    worker = Worker(
        url, token, queues=queues.split(","), handlers={"noop": handler}, capacity=int(capacity), worker_id=worker_id
    )
    worker.run()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
