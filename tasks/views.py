from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api.errors import encodable
from orbit.api.middleware import request_id_of
from orbit.api.mutations import mutation
from orbit.api.responses import ok, page
from orbit.api.schema import Documented, documented
from orbit.api.views import (
    OrbitView,
    decode_page_token,
    encode_page_token,
    idempotency_key_of,
    page_size_of,
)
from orbit.errors import InvalidArgument, OrbitError
from orbit.idempotency import validate_key
from orbit.principal import Actor
from tasks.actions import batch, blockers, endings, reads
from tasks.actions.rounds import submit_request, submit_task
from tasks.serializers import REF_NAME, CancelTaskInput, ResolveTaskInput, SubmitTaskInput

# read(after, limit) -> (items, the cursor to continue after; None: the last page)
PageRead = Callable[[int | None, int], tuple[list[dict[str, Any]], int | None]]


def numbered_page(request: Request, cursor_pattern: str, read: PageRead) -> Response:
    """A list paged by a positive integer cursor (`cursor_pattern`, in the
    page token), as every v1 list: page_size, page_token, next_page_token."""
    after = decode_page_token(request, cursor_pattern=cursor_pattern)
    items, last = read(None if after is None else int(after), page_size_of(request))
    return ok(request, page(items, encode_page_token(str(last)) if last else ""))


class TaskCollectionView(OrbitView):
    @documented(
        data="TaskPage",
        operation_id="tasks_list",
        filters=("queue_id", "state", "business_key", "concurrency_key"),
        paged=True,
    )
    def get(self, request: Request) -> Response:
        """List tasks.

        The tasks the credential may read (tasks:read), filtered by exact queue_id, state,
        business_key or concurrency_key, one page at a time: pass a page's next_page_token as
        page_token for the next; an empty one ends the list."""
        principal = self.principal(request)
        principal.require("tasks:read")
        filters = {
            name: request.query_params[name]
            for name in ("queue_id", "state", "business_key", "concurrency_key")
            if name in request.query_params
        }
        items, last_id = reads.task_list(
            principal=principal, filters=filters, after_id=decode_page_token(request), limit=page_size_of(request)
        )
        return ok(request, page(items, encode_page_token(last_id) if last_id else ""))

    @documented(
        SubmitTaskInput,
        data="TaskReceipt",
        operation_id="tasks_submit",
        created=True,
        idempotent=True,
        not_found=True,
        queue_full=True,
    )
    def post(self, request: Request) -> Response:
        """Submit a task.

        A task for a queue (tasks:submit): its handler and payload, optionally when it may start
        (available_at), its deadline, retry policy, business_key and concurrency_key. 201 with the
        task; the same Idempotency-Key with the same body replays it (200); a queue at its
        max_unfinished_tasks is 429 with Retry-After."""
        principal = self.principal(request)
        principal.require("tasks:submit")
        body = self.body(request)
        receipt = submit_task(
            submit_request(principal, body, idempotency_key_of(request), request_id_of(request._request))
        )
        return ok(request, receipt.data, status=receipt.status)


class TaskDetailView(OrbitView):
    @documented(data="Task", operation_id="tasks_get")
    def get(self, request: Request, task_id: str) -> Response:
        """Get a task.

        The task's state, its definition and its latest attempt's outcome (tasks:read); 404 for
        a task the credential may not see."""
        principal = self.principal(request)
        principal.require("tasks:read")
        return ok(request, reads.task_get(principal=principal, task_id=task_id))


class TaskBlockersView(OrbitView):
    @documented(data="Blockers", operation_id="tasks_blockers_get")
    def get(self, request: Request, task_id: str) -> Response:
        """Say why a task is not running.

        The task's state and, while it is WAITING, every reason the next lease would pass it by
        (its queue paused or full, a held concurrency key, a start time not reached...); an empty
        list means a worker would take it now."""
        principal = self.principal(request)
        principal.require("tasks:read")
        return ok(request, blockers.task_blockers(principal=principal, task_id=task_id))


class TaskAttemptsView(OrbitView):
    @documented(data="AttemptPage", operation_id="tasks_attempts_list", paged=True)
    def get(self, request: Request, task_id: str) -> Response:
        """List a task's attempts.

        Every attempt of the task, in the order they were made (tasks:read), one page at a time:
        pass a page's next_page_token as page_token for the next; an empty one ends the list."""
        principal = self.principal(request)
        principal.require("tasks:read")
        return numbered_page(
            request,
            r"[1-9][0-9]{0,8}",  # an epoch
            lambda after, limit: reads.attempt_list(
                principal=principal, task_id=task_id, after_epoch=after, limit=limit
            ),
        )


class TaskDependenciesView(OrbitView):
    @documented(data="TaskLinkPage", operation_id="tasks_dependencies_list", paged=True)
    def get(self, request: Request, task_id: str) -> Response:
        """List the tasks a task depends on.

        Its depends_on, in that order, each with its queue, handler and state (tasks:read), one
        page at a time: pass a page's next_page_token as page_token for the next; an empty one
        ends the list. A dependency outside the credential's queue range shows its id alone; one
        pruned from the database, its id and pruned: true."""
        principal = self.principal(request)
        principal.require("tasks:read")
        return numbered_page(
            request,
            r"[1-9][0-9]{0,3}",  # how many dependencies are listed so far
            lambda after, limit: reads.dependency_list(principal=principal, task_id=task_id, after=after, limit=limit),
        )


class TaskDependentsView(OrbitView):
    @documented(data="TaskLinkPage", operation_id="tasks_dependents_list", paged=True)
    def get(self, request: Request, task_id: str) -> Response:
        """List the tasks that depend on a task.

        Every task whose depends_on names it, in the order they were admitted, each with its
        queue, handler and state (tasks:read), one page at a time: pass a page's next_page_token
        as page_token for the next; an empty one ends the list. A dependent outside the
        credential's queue range shows its id alone."""
        principal = self.principal(request)
        principal.require("tasks:read")
        items, last = reads.dependent_list(
            principal=principal, task_id=task_id, after=decode_page_token(request), limit=page_size_of(request)
        )
        return ok(request, page(items, encode_page_token(last) if last else ""))


class AttemptDetailView(OrbitView):
    @documented(data="Attempt", operation_id="attempts_get")
    def get(self, request: Request, attempt_id: str) -> Response:
        """Get an attempt.

        One run of a task by a worker: its lease, its outcome and its error, if any (tasks:read)."""
        principal = self.principal(request)
        principal.require("tasks:read")
        return ok(request, reads.attempt_get(principal=principal, attempt_id=attempt_id))


class TaskCancelView(OrbitView):
    @mutation(
        CancelTaskInput,
        scope="tasks:cancel",
        operation="task.cancel",
        data="TaskReceipt",
        check=reads.visible_task,
        operation_id="tasks_cancel",
    )
    def post(self, actor: Actor, fields: dict[str, Any], task_id: str) -> tuple[int, dict[str, Any]]:
        """Cancel a task.

        With a reason for the audit log (tasks:cancel): a task not yet running is CANCELLED at
        once, a RUNNING one is marked cancel_requested for its worker. A task that succeeded,
        failed or needs review is 409 STATE_CONFLICT."""
        return 200, endings.cancel_task(actor=actor, task_id=task_id, reason=fields["reason"])


class TaskResolveView(OrbitView):
    """POST /v1/tasks/{id}:resolve — a person's decision about a task whose
    effect was unknown (SPEC §7); held by the same scope as cancel."""

    @mutation(
        ResolveTaskInput,
        scope="tasks:cancel",
        operation="task.resolve",
        data="TaskReceipt",
        check=reads.visible_task,
        operation_id="tasks_resolve",
    )
    def post(self, actor: Actor, fields: dict[str, Any], task_id: str) -> tuple[int, dict[str, Any]]:
        """Resolve a task that needs review.

        A person's decision about a NEEDS_REVIEW task, whose last attempt's effect is unknown:
        SUCCEEDED, FAILED, or RETRY (run it again), with a reason for the audit log."""
        return 200, endings.resolve_task(
            actor=actor, task_id=task_id, resolution=fields["resolution"], reason=fields["reason"]
        )


BATCH_ENTRY_FIELDS = {"idempotency_key", "task", "ref"}


class TaskBatchView(OrbitView):
    """POST /v1/tasks:batch — each item carries its own Idempotency-Key and gets
    its own result; the request as a whole is not idempotent and needs no header."""

    @documented(Documented("SubmitBatchInput"), data="BatchResults", operation_id="tasks_submit_batch", tags=["tasks"])
    def post(self, request: Request) -> Response:
        """Submit several tasks at once.

        1 to 500 tasks, each with its own idempotency_key (no Idempotency-Key header), their
        depends_on lists 10,000 ids at most in all: every item gets its own result, the created or
        replayed task or its error, in the order sent."""
        principal = self.principal(request)
        principal.require("tasks:submit")
        body = self.body(request)
        unknown = sorted(set(body) - {"tasks"})
        if unknown:
            raise InvalidArgument(f"{unknown[0]}: unknown field")
        entries = body.get("tasks")
        if not isinstance(entries, list) or not 1 <= len(entries) <= batch.MAX_BATCH_ITEMS:
            raise InvalidArgument(f"tasks: must be a list of 1 to {batch.MAX_BATCH_ITEMS} items")
        actor = self.actor(request)
        items: list[batch.Submission] = []
        seen: set[str] = set()
        refs: set[str | None] = set()
        named = 0  # depends_on entries of the items so far
        for index, entry in enumerate(entries):
            where = f"tasks[{index}]"
            if not isinstance(entry, dict) or not {"idempotency_key", "task"} <= set(entry):
                raise InvalidArgument(f"{where}: must be an object with idempotency_key, task and optionally ref")
            unknown = sorted(set(entry) - BATCH_ENTRY_FIELDS)
            if unknown:
                raise InvalidArgument(f"{where}.{unknown[0]}: unknown field")
            ref = entry.get("ref")
            if "ref" in entry and ref is None:
                raise InvalidArgument(f"{where}.ref: This field may not be null.")  # as every other optional field
            if ref is not None and (not isinstance(ref, str) or not REF_NAME.fullmatch(ref)):
                raise InvalidArgument(f"{where}.ref: must be 1-64 letters, digits, '.', '_' or '-'")
            if ref is not None and ref in refs:
                raise InvalidArgument(f"{where}.ref: used twice in one batch")
            refs.add(ref)
            if not isinstance(entry["idempotency_key"], str):
                raise InvalidArgument(f"{where}.idempotency_key: must be a string")
            try:
                key = validate_key(entry["idempotency_key"])
            except InvalidArgument as exc:
                raise InvalidArgument(f"{where}.idempotency_key: must be 1-255 printable ASCII characters") from exc
            if key in seen:
                raise InvalidArgument(f"{where}.idempotency_key: used twice in one batch")
            seen.add(key)
            if not isinstance(entry["task"], dict):
                raise InvalidArgument(f"{where}.task: must be a JSON object")
            depends_on = entry["task"].get("depends_on")
            named += len(depends_on) if isinstance(depends_on, list) else 0
            if named > batch.MAX_BATCH_DEPENDENCIES:
                raise InvalidArgument(
                    f"{where}.task.depends_on: a batch names at most {batch.MAX_BATCH_DEPENDENCIES} "
                    "dependencies in all; send the rest in another batch"
                )
            items.append(
                batch.Submission(key=key, body=entry["task"], request_id=actor.request_id, ref=ref, in_batch=True)
            )
        outcomes = batch.submit_batch(actor=actor, items=items)
        results = [item_result(item.key, outcome) for item, outcome in zip(items, outcomes, strict=True)]
        return ok(request, {"results": results})


def item_result(key: str, outcome: batch.Outcome) -> dict[str, Any]:
    if isinstance(outcome, OrbitError):
        refused = {
            "idempotency_key": key,
            "status": outcome.status,
            # escaped as the single route's error envelope is (an unknown field's name may be a lone surrogate)
            "error": {"code": outcome.code, "message": encodable(outcome.message)},
        }
        # A single submit's Retry-After, per item: the batch's own answer is a 200.
        return refused if outcome.retry_after is None else {**refused, "retry_after": outcome.retry_after}
    return {"idempotency_key": key, "status": outcome.status, **outcome.data}
