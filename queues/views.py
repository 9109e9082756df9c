from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api.mutations import mutation
from orbit.api.responses import ok, page
from orbit.api.schema import documented
from orbit.api.views import OrbitView, decode_page_token, encode_page_token, page_size_of
from orbit.principal import Actor, Principal
from queues import actions
from queues.serializers import QueueConfigureInput, QueueCreateInput, QueueRetireInput


def limits_of(fields: dict[str, Any]) -> actions.QueueLimits:
    return actions.QueueLimits(
        max_concurrency=fields["max_concurrency"],
        rate_per_second=fields["rate_per_second"],
        max_unfinished_tasks=fields.get("max_unfinished_tasks", 0),
    )


class QueueCollectionView(OrbitView):
    @documented(data="QueuePage", operation_id="queues_list", paged=True)
    def get(self, request: Request) -> Response:
        """List queues.

        The queues the credential may read (queues:read), in id order, one page at a time:
        pass a page's next_page_token as page_token for the next; an empty one ends the list."""
        principal = self.principal(request)
        principal.require("queues:read")
        items, last_id = actions.queue_list(
            principal=principal, after_id=decode_page_token(request), limit=page_size_of(request)
        )
        return ok(request, page(items, encode_page_token(last_id) if last_id else ""))

    @mutation(
        QueueCreateInput,
        scope="queues:manage",
        operation="queue.create",
        data="QueueReceipt",
        check=Principal.require_all_queues,
        created=True,
        operation_id="queues_create",
    )
    def post(self, actor: Actor, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Create a queue.

        A queue with a unique name and its limits: max_concurrency, rate_per_second and
        max_unfinished_tasks (omitted or 0: the default, 100000). Needs queues:manage over every queue; 201 with the
        queue, and the same Idempotency-Key with the same body replays that answer (200)."""
        queue = actions.queue_create(actor=actor, name=fields["name"], limits=limits_of(fields))
        return 201, {"queue": queue}


class QueueDetailView(OrbitView):
    @documented(data="Queue", operation_id="queues_get")
    def get(self, request: Request, queue_id: str) -> Response:
        """Get a queue.

        The queue's limits, paused flag, revision and counts (queues:read); 404 for a queue the
        credential may not see."""
        principal = self.principal(request)
        principal.require("queues:read")
        return ok(request, actions.queue_get(principal=principal, queue_id=queue_id))


class QueueConfigureView(OrbitView):
    @mutation(
        QueueConfigureInput,
        scope="queues:manage",
        operation="queue.configure",
        data="QueueReceipt",
        check=Principal.require_queue,
        operation_id="queues_configure",
    )
    def post(self, actor: Actor, fields: dict[str, Any], queue_id: str) -> tuple[int, dict[str, Any]]:
        """Configure a queue: its limits, or pause and resume it.

        Sends the whole configuration (paused and every limit) with the revision it was read at
        (expected_revision: another one is 409 STATE_CONFLICT) and a reason for the audit log.
        A paused queue keeps its tasks but hands none to workers."""
        queue = actions.queue_configure(
            actor=actor,
            queue_id=queue_id,
            expected_revision=fields["expected_revision"],
            reason=fields["reason"],
            paused=fields["paused"],
            limits=limits_of(fields),
        )
        return 200, {"queue": queue}


class QueueRetireView(OrbitView):
    @mutation(
        QueueRetireInput,
        scope="queues:manage",
        operation="queue.retire",
        data="QueueReceipt",
        check=Principal.require_queue,
        operation_id="queues_retire",
    )
    def post(self, actor: Actor, fields: dict[str, Any], queue_id: str) -> tuple[int, dict[str, Any]]:
        """Retire a queue, for good.

        The queue must be paused, hold no unfinished task and be the target of no active plan
        (409 STATE_CONFLICT otherwise); it then accepts no task again and its name stays taken."""
        queue = actions.queue_retire(
            actor=actor, queue_id=queue_id, expected_revision=fields["expected_revision"], reason=fields["reason"]
        )
        return 200, {"queue": queue}
