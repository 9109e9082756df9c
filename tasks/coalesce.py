"""Group commit for single submits.

Concurrent POST /v1/tasks requests of one application in this server process
are handed to that application's submit thread, which commits whatever has
gathered while its previous transaction ran as ONE batch transaction
(tasks.actions.batch: the same per-item idempotency, validation, backpressure
and results as the batch endpoint). Every submit of an application takes that
application's lock anyway, so this trades N lock hand-offs and commits for
one, and adds no waiting when the thread is idle: a lone request commits at once.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue

from orbit.idempotency import Actor
from tasks.actions.batch import Outcome, Submission, submit_batch
from workers.db import call_guarded

logger = logging.getLogger("orbit.coalesce")

# Most requests one transaction takes; the rest wait for the next round.
MAX_GROUP = 200


@dataclass
class _Request:
    actor: Actor
    submission: Submission
    future: Future = field(default_factory=Future)


class _ApplicationSubmits:
    def __init__(self, application_id: str) -> None:
        self.inbox: SimpleQueue[_Request] = SimpleQueue()
        thread = threading.Thread(target=self._run, name=f"orbit-submit-{application_id[:8]}", daemon=True)
        thread.start()

    def submit(self, actor: Actor, submission: Submission) -> Outcome:
        request = _Request(actor, submission)
        self.inbox.put(request)
        return request.future.result()

    def _run(self) -> None:
        while True:
            group = [self.inbox.get()]
            while len(group) < MAX_GROUP:
                try:
                    group.append(self.inbox.get_nowait())
                except Empty:
                    break
            try:
                self._commit(group)
            except BaseException as exc:  # never leave a caller waiting
                logger.exception("submit group failed")
                for request in group:
                    if not request.future.done():
                        request.future.set_exception(exc)

    def _commit(self, group: list[_Request]) -> None:
        # One batch per credential: range checks belong to the caller's principal.
        # A key twice in one round waits for the next, where it finds its twin's
        # record and replays it.
        batches: dict[str, list[_Request]] = {}
        later: list[_Request] = []
        for request in group:
            batch = batches.setdefault(request.actor.principal.credential_id, [])
            if any(other.submission.key == request.submission.key for other in batch):
                later.append(request)
            else:
                batch.append(request)
        for batch in batches.values():
            try:
                outcomes = call_guarded(
                    submit_batch, actor=batch[0].actor, items=[request.submission for request in batch]
                )
            except Exception as exc:
                for request in batch:
                    request.future.set_exception(exc)
                continue
            for request, outcome in zip(batch, outcomes, strict=True):
                request.future.set_result(outcome)
        for request in later:
            self.inbox.put(request)


_lock = threading.Lock()
_by_application: dict[str, _ApplicationSubmits] = {}


def submit_coalesced(actor: Actor, submission: Submission) -> Outcome:
    application_id = actor.principal.application_id
    with _lock:
        submits = _by_application.get(application_id)
        if submits is None:
            submits = _by_application[application_id] = _ApplicationSubmits(application_id)
    return submits.submit(actor, submission)
