"""Queue resources end to end (queues-v1 seed, "完整 SDK 场景").

Creates its own queue (backlog 2, concurrency 2, one start per second), pauses
it and submits two tasks; the third is refused with QUEUE_FULL, the first's
replay still gets its original receipt; cancelling the first frees a slot and
the third is resubmitted under its original identity; then the queue resumes
and a worker runs the two echo tasks.

    ORBIT_URL=http://127.0.0.1:8080 ORBIT_CREDENTIALS_FILE=.local/dev.credentials.json \\
        .venv/bin/python examples/resources.py
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples._common import arm_deadline, client_from_env, start_worker, wait_for  # noqa: E402
from orbit_sdk import (  # noqa: E402
    APIError,
    ConfigureQueueRequest,
    CreateQueueRequest,
    SubmitTaskRequest,
    Worker,
)


def echo(execution):
    return {"echo": execution.payload}


def main() -> int:
    deadline = arm_deadline()
    client, url, token = client_from_env()
    run = uuid.uuid4().hex[:12]
    created = client.create_queue(
        f"resources-{run}-queue",
        CreateQueueRequest(name=f"resources-{run}", max_concurrency=2, rate_per_second=1, max_unfinished_tasks=2),
    )
    queue = created.queue
    limits = {"max_concurrency": 2, "rate_per_second": 1, "max_unfinished_tasks": 2}
    paused = client.configure_queue(
        queue.id,
        f"resources-{run}-pause",
        ConfigureQueueRequest(expected_revision=queue.revision, reason="example: hold work", paused=True, **limits),
    ).queue

    def task(n: int) -> SubmitTaskRequest:
        return SubmitTaskRequest(
            queue_id=queue.id,
            handler="example.echo",
            handler_version="v1",
            payload_version="v1",
            payload={"n": n, "run": run},
            timeout_seconds=20,
        )

    first = client.submit_task(f"resources-{run}-task-1", task(1)).task
    second = client.submit_task(f"resources-{run}-task-2", task(2)).task
    try:
        client.submit_task(f"resources-{run}-task-3", task(3))
        raise SystemExit("example: the third task was accepted by a full queue")
    except APIError as error:
        if error.code != "QUEUE_FULL":
            raise
        print(f"backpressure={error.code} http={error.status_code}", flush=True)

    replay = client.submit_task(f"resources-{run}-task-1", task(1))
    client.cancel_task(first.id, f"resources-{run}-cancel-1", "example: make room")
    third = client.submit_task(f"resources-{run}-task-3", task(3))
    print(
        f"duplicate={str(replay.deduplicated and replay.task.id == first.id).lower()} "
        f"rejected_request_retried={str(not third.deduplicated).lower()}",
        flush=True,
    )

    client.configure_queue(
        queue.id,
        f"resources-{run}-resume",
        ConfigureQueueRequest(expected_revision=paused.revision, reason="example: run", paused=False, **limits),
    )
    worker = Worker(url, token, queues=[queue.id], handlers={("example.echo", "v1"): echo}, capacity=2)
    thread = start_worker(worker)
    finished = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
    for submitted in (second, third.task):
        wait_for(lambda s=submitted: client.get_task(s.id).state in finished, deadline, f"task {submitted.id}")
        done = client.get_task(submitted.id)
        print(f"task={done.id} state={done.state} attempts={done.attempts}", flush=True)
    worker.drain()
    thread.join(timeout=max(0.1, deadline - __import__("time").monotonic()))
    final = client.get_queue(queue.id)
    drained = not thread.is_alive()
    print(
        f"unfinished={final.unfinished_tasks} rate_per_second={final.rate_per_second} "
        f"worker_drained={str(drained).lower()}",
        flush=True,
    )
    ok = (
        drained
        and final.unfinished_tasks == 0
        and all(client.get_task(t.id).state == "SUCCEEDED" for t in (second, third.task))
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
