"""A fan-out / fan-in pipeline with task dependencies (SPEC §13).

One batch, one transaction, 22 tasks that name each other by ``ref`` before any has an id:

    split ──▶ part-0 … part-19 ──▶ join

``split`` cuts the numbers 1..N into 20 ranges and returns them; each ``part-i`` depends on
``split``, reads its range from the split's output (``execution.dependencies``) and returns the
range's sum; ``join`` depends on all 20 parts and adds up their outputs. Every task but
``split`` is BLOCKED until what it depends on has succeeded, so the worker started after the
submit runs them in that order without any coordination of its own.

    ORBIT_URL=http://127.0.0.1:8080 ORBIT_CREDENTIALS_FILE=.local/dev.credentials.json \\
        .venv/bin/python examples/pipeline.py
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples._common import arm_deadline, client_from_env, start_worker, wait_for  # noqa: E402
from orbit_sdk import BatchItem, CreateQueueRequest, Execution, SubmitTaskRequest, Worker  # noqa: E402

NUMBERS = 1_000_000  # the job: the sum of 1..NUMBERS
PARTS = 20
FINISHED = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}


def split(execution: Execution) -> dict[str, list[list[int]]]:
    """The job's numbers cut into `parts` contiguous ranges [first, last], as even as they go."""
    numbers, parts = execution.payload["numbers"], execution.payload["parts"]
    bounds = [numbers * index // parts for index in range(parts + 1)]
    return {"ranges": [[bounds[index] + 1, bounds[index + 1]] for index in range(parts)]}


def part(execution: Execution) -> dict[str, int]:
    (parent,) = execution.dependencies  # the split, which succeeded: a part runs only then
    first, last = parent.output["ranges"][execution.payload["part"]]
    return {"sum": sum(range(first, last + 1))}


def join(execution: Execution) -> dict[str, int]:
    # One dependency per part, in depends_on order, each with the output its part returned.
    return {"sum": sum(dependency.output["sum"] for dependency in execution.dependencies)}


def main() -> int:
    deadline = arm_deadline()
    client, url, token = client_from_env()
    run = uuid.uuid4().hex[:12]
    queue = client.create_queue(
        f"pipeline-{run}-queue", CreateQueueRequest(name=f"pipeline-{run}", max_concurrency=8, rate_per_second=100)
    ).queue

    def task(handler: str, payload: dict[str, int], depends_on: list[str] | None = None) -> SubmitTaskRequest:
        return SubmitTaskRequest(
            queue_id=queue.id,
            handler=handler,
            handler_version="v1",
            payload_version="v1",
            payload=payload,
            depends_on=depends_on,
            timeout_seconds=20,
        )

    splitter = BatchItem(f"pipeline-{run}-split", task("pipeline.split", {"numbers": NUMBERS, "parts": PARTS}), "split")
    parts = [
        BatchItem(
            f"pipeline-{run}-part-{n}", task("pipeline.part", {"part": n}, [splitter.depends_on_ref]), f"part-{n}"
        )
        for n in range(PARTS)
    ]
    joiner = BatchItem(f"pipeline-{run}-join", task("pipeline.join", {}, [item.depends_on_ref for item in parts]))
    results = client.submit_tasks([splitter, *parts, joiner])
    refused = [result for result in results if result.task is None]
    if refused:
        raise SystemExit(f"example: the batch refused {refused[0].idempotency_key}: {refused[0].error}")
    submitted = [result.task for result in results if result.task is not None]
    blocked = sum(task.state == "BLOCKED" for task in submitted)
    fanned_out = client.list_dependents(submitted[0].id, page_size=PARTS + 1).items  # the split's dependents
    print(f"submitted={len(submitted)} blocked={blocked} split_dependents={len(fanned_out)}", flush=True)

    worker = Worker(
        url,
        token,
        queues=[queue.id],
        handlers={("pipeline.split", "v1"): split, ("pipeline.part", "v1"): part, ("pipeline.join", "v1"): join},
        capacity=8,
    )
    thread = start_worker(worker)
    join_id = submitted[-1].id
    wait_for(lambda: client.get_task(join_id).state in FINISHED, deadline, "the join")
    done = client.get_task(join_id)
    total = done.output["sum"] if done.state == "SUCCEEDED" else None
    expected = NUMBERS * (NUMBERS + 1) // 2
    print(f"parts={len(done.depends_on)} state={done.state} sum={total} expected={expected}", flush=True)

    worker.drain()
    thread.join(timeout=max(0.1, deadline - time.monotonic()))
    drained = not thread.is_alive()
    print(f"worker_drained={str(drained).lower()}", flush=True)
    return 0 if total == expected and drained else 1


if __name__ == "__main__":
    sys.exit(main())
