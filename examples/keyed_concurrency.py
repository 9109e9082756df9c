"""Keyed concurrency with a monotonic permit token (keyed-concurrency seed §5).

Two queues each get one task with the same concurrency key; two workers of
capacity 4 (one per queue) run them. The handler writes to an in-memory
resource that, in ONE atomic step, rejects a token lower than the highest it
has seen, raises the highest token, and de-duplicates by operation identity.
The attempts' tokens must increase, and a replayed stale write must be refused.

    ORBIT_URL=http://127.0.0.1:8080 ORBIT_CREDENTIALS_FILE=/tmp/orbit-keyed.credentials.json \\
        .venv/bin/python examples/keyed_concurrency.py

The resource model only shows where the atomic check belongs; it is not a
distributed store.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples._common import arm_deadline, client_from_env, start_worker, wait_for  # noqa: E402
from orbit_sdk import CreateQueueRequest, SubmitTaskRequest, Worker  # noqa: E402


class StaleWrite(Exception):
    pass


class Resource:
    """One object guarded by the highest permit token it has accepted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.highest_token = 0
        self.writes: dict[str, int] = {}  # operation_ref -> token that wrote it
        self.active = 0
        self.max_active = 0

    def write(self, key: str, token: int, operation_ref: str) -> None:
        with self._lock:  # check, raise and record in one atomic step
            if token < self.highest_token:
                raise StaleWrite(f"token {token} < highest {self.highest_token} for {key}")
            self.highest_token = token
            self.writes.setdefault(operation_ref, token)

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
    run = uuid.uuid4().hex[:12]
    key = f"object/{run}"
    resource = Resource()

    def update_object(execution):
        if execution.concurrency_key != key or execution.concurrency_token is None:
            raise RuntimeError("expected a keyed execution with a token")
        resource.enter()
        try:
            time.sleep(0.3)  # long enough that overlapping permits would show
            resource.write(execution.concurrency_key, execution.concurrency_token, execution.payload["operation_ref"])
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
        Worker(url, token, queues=[queue.id], handlers={("object.update", "v1"): update_object}, capacity=4)
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
        resource.write(key, tokens[0], "late-replay-of-update-1")
        stale_rejected = False
    except StaleWrite:
        stale_rejected = True
    for worker in workers:
        worker.drain()
    for thread in threads:
        thread.join(timeout=max(0.1, deadline - time.monotonic()))
    drained = not any(thread.is_alive() for thread in threads)
    print(
        f"resource_writes={len(resource.writes)} stale_write_rejected={str(stale_rejected).lower()} "
        f"worker_drained={str(drained).lower()}",
        flush=True,
    )
    ok = completed == 2 and increasing and stale_rejected and drained and len(resource.writes) == 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
