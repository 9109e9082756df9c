"""A worker of the live server (tests.support.tasks' `connect`) sending results that
ask for the next task started ahead, and reading what comes back."""

from __future__ import annotations

from typing import Any

from tests.support.api import make_queue
from tests.support.tasks import submit_ok


def send_result(worker: Any, assign: dict[str, Any], **fields: Any) -> str:
    """Sends the attempt's SUCCEEDED result without waiting for its answer; the request id."""
    return worker.send(
        "task.result",
        attempt_id=assign["attempt_id"],
        epoch=assign["epoch"],
        outcome="SUCCEEDED",
        retryable=False,
        **fields,
    )


def result_frames(worker: Any, assign: dict[str, Any], **fields: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Sends the attempt's result; its answer and the assignment right behind it, if any."""
    request = send_result(worker, assign, **fields)
    answer = worker.recv_frame(timeout=10)
    assert answer is not None and answer.get("reply_to") == request, answer
    following = worker.recv_frame(timeout=1)
    if following is not None:
        assert following["type"] == "task.assign", following
    return answer, following


def running_first(
    tenant: Any, connect: Any, worker_id: str, key: str | None = "object/7", rate: int = 100, **hello: Any
) -> tuple[Any, dict[str, Any], str]:
    """A queue with three tasks of one key (`key` None: unkeyed), and a worker of capacity 1
    that started the first."""
    queue = make_queue(tenant.client, f"ahead-{worker_id}", max_concurrency=10, rate_per_second=rate)
    for n in range(3):
        submit_ok(tenant.client, queue["id"], f"{worker_id}-{n}", **({"concurrency_key": key} if key else {}))
    worker = connect()
    worker.hello_as([queue["id"]], capacity=1, worker_id=worker_id, **hello)
    first = worker.assignment()
    worker.start_ok(first)
    return worker, first, queue["id"]
