"""The queues app's OpenAPI objects: the queue (queues.actions.queue_snapshot)
and its page and receipt. Registered by QueuesConfig.ready()
(orbit.api.openapi_registry)."""

from __future__ import annotations

from orbit.api import openapi_objects as shapes
from orbit.api.openapi_registry import register_component

QUEUE = shapes.closed(
    {
        "id": shapes.ID,
        "namespace_id": shapes.ID,
        "name": {"type": "string", "minLength": 1, "maxLength": 128},
        "paused": {"type": "boolean"},
        "max_concurrency": shapes.COUNT,
        "rate_per_second": shapes.COUNT,
        "max_unfinished_tasks": shapes.COUNT,
        "unfinished_tasks": shapes.UINT64_STRING,
        "revision": shapes.REVISION,
        "retired_at": shapes.TIME,
    },
    optional=("retired_at",),
)


def register() -> None:
    register_component("Queue", QUEUE)
    register_component("QueuePage", shapes.page_of("Queue"))
    register_component("QueueReceipt", shapes.receipt_of("queue", "Queue"))
