"""What the SDK's tests against a live server share: a new queue, a worker, and a task's end."""

from __future__ import annotations

import uuid
from typing import Any

import orbit_sdk
from orbit_sdk import Client, Task, Worker
from tests.support.tasks import wait_until

FINISHED = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"})


def new_queue(client: Client, **limits: Any) -> orbit_sdk.Queue:
    """A queue of a name of its own: 8 at a time, 1,000 starts a second unless `limits` say."""
    name = f"sdk-{uuid.uuid4().hex[:10]}"
    fields: dict[str, Any] = {"max_concurrency": 8, "rate_per_second": 1000, **limits}
    return client.create_queue(f"q-{name}", orbit_sdk.CreateQueueRequest(name=name, **fields)).queue


def finished(client: Client, task_id: str, timeout: float = 20) -> Task:
    """The task once it has ended, read through the client."""
    return wait_until(
        lambda: task if (task := client.get_task(task_id)).state in FINISHED else None, timeout, f"{task_id} finished"
    )


def worker_for(url: str, tenant: Any, queue_id: str, handlers: dict[Any, Any], **options: Any) -> Worker:
    """A Worker (not started) of the tenant's credential on one queue, reconnecting
    within half a second of a server that went away unless `options` say."""
    options = {"min_reconnect_delay": 0.1, "max_reconnect_delay": 0.5, **options}
    return Worker(url, tenant.token, [queue_id], handlers, namespace_id=tenant.namespace_id, **options)
