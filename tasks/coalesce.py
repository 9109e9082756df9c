"""The group-committed verbs: concurrent submits, results, starts and leases
of one application in this server process are decided together, in one
transaction per round (tasks.actions.rounds, workers.groupcommit).

The round applies exactly the per-item rules of each single verb and returns
one outcome per item, so a request's answer never depends on which others
happened to share its transaction."""

from __future__ import annotations

import asyncio
from typing import Any

from orbit.api.auth import Minted, Principal
from orbit.errors import OrbitError
from orbit.idempotency import Actor, Receipt, validate_key
from tasks.actions import batch
from tasks.actions.rounds import Answer, RoundItem, SubmitRequest, run_round
from workers.groupcommit import GroupCommit, within_deadline

# A round's submits are answered before its worker frames: a submit's caller
# sends nothing more until it hears back, while a worker keeps its other
# slots busy meanwhile.
ROUNDS: GroupCommit[RoundItem, Answer] = GroupCommit(
    "round", run_round, answer_first=lambda item: isinstance(item, SubmitRequest)
)


def submit_request(
    principal: Principal,
    body: dict[str, Any],
    key: str | None,
    request_id: str,
    credential_to_confirm: Minted | None = None,
) -> SubmitRequest:
    """POST /v1/tasks up to its round, for a caller holding tasks:submit whose
    body is a JSON object: the queue's range, the Idempotency-Key, and the
    body's validation (kept in the request for the round; see
    batch.Submission.checked). Raises what refuses the request outright.
    `credential_to_confirm`: see SubmitRequest."""
    if isinstance(body.get("queue_id"), str):
        principal.require_queue(body["queue_id"])
    actor = Actor(principal=principal, request_id=request_id)
    submission = batch.checked_submission(actor, validate_key(key), body)
    return SubmitRequest(actor, submission, credential_to_confirm)


def _receipt(outcome: Answer) -> Receipt:
    # A submit's answer is its Receipt; a refusal may come back as a value
    # from the batch path.
    if isinstance(outcome, OrbitError):
        raise outcome
    assert isinstance(outcome, Receipt)
    return outcome


def submit_coalesced(request: SubmitRequest) -> Receipt:
    """From a thread: the submit's Receipt, or its refusal raised."""
    return _receipt(ROUNDS.call(request.actor.principal.application_id, request))


def join_round(loop: asyncio.AbstractEventLoop, request: SubmitRequest) -> asyncio.Future[Answer]:
    """From the thread that prepared the submit (the event loop `loop`, or a
    pool thread working for it): it joins its application's round now, not
    after a hop back to the event loop (which every request and worker frame
    shares); the caller awaits it on `loop` with receipt_of."""
    return ROUNDS.enqueue_for(loop, request.actor.principal.application_id, request)


async def receipt_of(joined: asyncio.Future[Answer]) -> Receipt:
    """The submit's Receipt, or its refusal raised, holding no pool thread while the round runs."""
    return _receipt(await within_deadline(joined))
